"""Attention past the model's native window (spotlight/beyond.py, issue #21): re-positioned
sinks and retrieved tokens, chunked prefill past the window, and the engine's limits."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from conftest import tiny_pair
from spotlight.attention import CodeSelector, DenseDecode, SinkWindowSelector, SpotlightDecode
from spotlight.beyond import deltas, fitted, fitted_config, remapped_chunk, remapped_decode, remapped_rows
from spotlight.cache import KVCache
from spotlight.config import SpotlightConfig
from spotlight.engine import KV_MEMORY_SHARE, physical_memory_bytes
from spotlight.errors import ContextTooLong
from spotlight.generate import Context, _pieces, prefill, reply_alone
from spotlight.hashing import EncoderSpec, Encoders
from spotlight.model import apply_rope, causal_attention, rope_inv_freq
from spotlight.positions import Rotations, rope_angles
from spotlight.testing import tiny_engine

WINDOW = 64  # the tiny model's native window: everything below runs far past it
PROMPT = [(i * 37) % 211 for i in range(300)]
STEPS = [5, 17, 99, 3, 140]


def tiny_model():
    _, model = tiny_pair("llama", max_position_embeddings=WINDOW)
    return model


def spotlight(model, **overrides):
    fields = dict(bits=64, dense_layers=(), dense_below=0, sinks=4, window=8, k_min=8, far_window=16,
                  far_retrieved=16)
    fields.update(overrides)
    encoders = Encoders(EncoderSpec.for_model(model.args, 64), seed=0)
    return SpotlightDecode(SpotlightConfig(**fields), CodeSelector(encoders))


def run(model, policy, prompt, steps, chunk=32):
    """Chunked prefill of `prompt` (every position's logits), then one token at a time: (logits, cache)."""
    cache = KVCache(model.args, 64, code_words=getattr(policy, "code_words", 0))
    prefill, decoded = [], []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            prefill.append(model(torch.tensor(prompt[start : start + chunk]), cache, policy, all_logits=True))
        for token in steps:
            decoded.append(model(torch.tensor([token]), cache, policy))
    return torch.cat(prefill), torch.stack(decoded), cache


def test_every_token_selected_at_unchanged_distances_equals_dense():
    """A window covering the whole context past the model's window: prefill and decode are dense."""
    model = tiny_model()
    dense_prefill, dense_decode, _ = run(model, DenseDecode(), PROMPT, STEPS)
    policy = spotlight(model, far_window=len(PROMPT) + len(STEPS), far_retrieved=1)
    sparse_prefill, sparse_decode, _ = run(model, policy, PROMPT, STEPS)
    torch.testing.assert_close(sparse_prefill, dense_prefill, rtol=0, atol=1e-5)
    torch.testing.assert_close(sparse_decode, dense_decode, rtol=0, atol=1e-5)


def test_every_token_retrieved_is_moved_by_zero_and_equals_dense():
    """Retrieval covering every middle token: each selected row keeps its position (delta 0)."""
    model = tiny_model()
    _, dense_decode, _ = run(model, DenseDecode(), PROMPT, STEPS)
    _, sparse_decode, _ = run(model, spotlight(model, far_retrieved=len(PROMPT) + len(STEPS)), PROMPT, STEPS)
    torch.testing.assert_close(sparse_decode, dense_decode, rtol=0, atol=1e-5)


def test_a_small_budget_past_the_window_reads_sinks_retrieved_and_window_only():
    model = tiny_model()
    policy = spotlight(model)
    _, _, cache = run(model, policy, PROMPT, STEPS)
    n = len(PROMPT) + len(STEPS)  # tokens the last step read, itself included
    for layer in range(model.args.n_layers):
        idx = torch.as_tensor(policy.selection(layer)).to(torch.int64)  # (Hkv, K)
        assert idx.shape == (model.args.n_kv_heads, 4 + 16 + 16)
        assert idx[:, :4].tolist() == [list(range(4))] * model.args.n_kv_heads
        assert idx[:, -16:].tolist() == [list(range(n - 16, n))] * model.args.n_kv_heads
        moved = deltas(idx, n)
        assert bool((moved >= 0).all()) and moved[:, -16:].abs().sum() == 0
    _, dense_decode, _ = run(model, DenseDecode(), PROMPT, STEPS)
    _, sparse_decode, _ = run(model, policy, PROMPT, STEPS)
    assert not torch.allclose(sparse_decode, dense_decode, atol=1e-3)  # it did read less


def test_folding_with_one_block_is_the_flat_scan_at_true_distances():
    """A fold wider than every candidate turns nothing back: the run equals far_fold = 0 exactly
    (chunks of at most 16 queries code all of them, as select_chunk does)."""
    model = tiny_model()
    _, plain, _ = run(model, spotlight(model), PROMPT, STEPS, chunk=16)
    _, folded, _ = run(model, spotlight(model, far_fold=len(PROMPT) + len(STEPS)), PROMPT, STEPS, chunk=16)
    torch.testing.assert_close(folded, plain, rtol=0, atol=0)


def test_folded_selection_scores_each_block_by_the_query_turned_back_by_its_distance():
    model = tiny_model()
    fold = 40
    policy = spotlight(model, far_fold=fold)
    _, _, cache = run(model, policy, PROMPT, STEPS[:1])
    n = cache.length
    q = torch.randn(model.args.n_heads, 1, model.args.head_dim)  # (H, 1, D): a query at n - 1
    selector, rotations = policy.selector, policy.rotations(cache)
    for layer in range(model.args.n_layers):
        got = np.array(selector.select_far(layer, q, cache, n, 16, 4, 16, fold, rotations))  # (Hkv, K)
        ends = list(range(n - 16, 4, -fold)) + [4]  # block j: [ends[j + 1], ends[j]), turned back j * fold
        scores = np.zeros((model.args.n_kv_heads, n), np.int32)
        for j, (hi, lo) in enumerate(zip(ends, ends[1:])):
            turned = rotations.rotate_back(q, torch.tensor([j * fold]), j * fold)  # (H, 1, D)
            codes = np.array(selector.query_codes(layer, turned))  # (H, W)
            scores[:, lo:hi] = kernels.scores(codes, cache.codes[layer], n)[:, lo:hi]
        np.testing.assert_array_equal(got, kernels.select(scores, 16, 4, 16))


def test_selection_inside_the_window_is_the_flat_scan_of_the_codes():
    """CodeSelector.select (a decode step) and select_chunk (a prefill chunk) inside the window read
    the codes' byte planes where kernels/scan.c takes the geometry (so numba is not loaded), and
    select what the flat scan's scores select over the same codes."""
    model = tiny_model()
    policy = spotlight(model)
    _, _, cache = run(model, policy, PROMPT, STEPS[:1])
    n, selector = cache.length, policy.selector
    assert selector._on_planes(np.zeros((model.args.n_heads, 1), np.uint64), cache, 0) == kernels.planes_fit(
        model.args.n_heads, model.args.n_kv_heads, 1)
    q = torch.randn(model.args.n_heads, 1, model.args.head_dim)  # (H, 1, D)
    chunk = torch.randn(model.args.n_heads, 5, model.args.head_dim)  # (H, T, D)
    for layer in range(model.args.n_layers):
        got = np.array(selector.select(layer, q, cache, n, 16, 4, 16))  # (Hkv, K): a copy of the reused buffer
        scores = kernels.scores(np.array(selector.query_codes(layer, q)), cache.codes[layer], n)
        np.testing.assert_array_equal(got, kernels.select(scores, 16, 4, 16))
        got = np.array(selector.select_chunk(layer, chunk, cache, n, 16, 4, 16))
        scores = kernels.scores(np.array(selector.chunk_codes(layer, chunk)), cache.codes[layer], n)
        np.testing.assert_array_equal(got, kernels.select(scores, 16, 4, 16))


@pytest.mark.skipif(not kernels.planes_fit(4, 2, 1), reason="kernels/scan.c not built (AVX2)")
def test_the_codes_byte_planes_follow_the_cache_through_truncation_and_growth():
    """KeyCodes.planes (what the far scan reads) is written lazily up to the tokens asked for; a
    truncated cache writes the planes of its new codes again, and a grown one rebuilds them."""
    model = tiny_model()
    cache = KVCache(model.args, 1000, code_words=1)
    rng = np.random.default_rng(4)

    def expected(layer, n):
        codes = cache.codes[layer, :, :, :n]  # (Hkv, W, n)
        hkv, words = codes.shape[:2]
        return np.ascontiguousarray(codes).view(np.uint8).reshape(hkv, words, n, 8).transpose(0, 1, 3, 2) \
            .reshape(hkv, 8 * words, n)

    cache.codes[..., :900] = rng.integers(0, 2**64, size=cache.codes[..., :900].shape, dtype=np.uint64)
    cache.advance(900)
    np.testing.assert_array_equal(cache.key_codes.planes(1, 700)[:, :, :700], expected(1, 700))
    cache.truncate(500)
    cache.codes[..., 500:900] = rng.integers(0, 2**64, size=cache.codes[..., 500:900].shape, dtype=np.uint64)
    cache.advance(400)
    np.testing.assert_array_equal(cache.key_codes.planes(1, 880)[:, :, :880], expected(1, 880))
    assert cache.key_codes.planed.tolist() == [0, 880] + [0] * (model.args.n_layers - 2)
    cache.reserve(3000)  # grown: the codes are copied, the planes made again when asked
    np.testing.assert_array_equal(cache.key_codes.planes(1, 900)[:, :, :900], expected(1, 900))


def rope_at(raw: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """raw rows (Hkv, T, D) rotated at `positions` (T,) or per head (Hkv, T)."""
    if positions.dim() == 1:
        return apply_rope(raw, *rope_angles(inv_freq, positions))
    return torch.stack([rope_at(raw[h : h + 1], positions[h], inv_freq)[0] for h in range(raw.shape[0])])


@pytest.mark.parametrize("n", [5_000, 131_072, 1_000_000])
def test_remapped_decode_equals_attention_over_keys_roped_at_their_new_positions(n):
    torch.manual_seed(0)
    _, model = tiny_pair("llama", max_position_embeddings=WINDOW)
    inv_freq = rope_inv_freq(model.args)
    H, Hkv, D, K = 4, 2, model.args.head_dim, 12
    q_raw, k_raw, v = torch.randn(H, 1, D), torch.randn(Hkv, K, D), torch.randn(Hkv, K, D)
    middle = torch.stack([torch.sort(torch.randperm(n - 10)[:6] + 2).values for _ in range(Hkv)])  # (Hkv, 6)
    idx = torch.cat([torch.arange(2).expand(Hkv, -1), middle, torch.arange(n - 4, n).expand(Hkv, -1)], 1)  # (Hkv, K)
    k_cache = torch.zeros(Hkv, n, D)
    k_cache.scatter_(1, idx.unsqueeze(-1).expand(-1, -1, D), rope_at(k_raw, idx, inv_freq))  # keys at true positions
    v_cache = torch.zeros(Hkv, n, D)
    v_cache.scatter_(1, idx.unsqueeze(-1).expand(-1, -1, D), v)
    q = rope_at(q_raw, torch.tensor([n - 1]), inv_freq)
    out = remapped_decode(q, k_cache, v_cache, idx, n, Rotations(inv_freq))
    at_new = rope_at(k_raw, torch.arange(n - K, n), inv_freq)  # (Hkv, K, D): re-positioned before the query
    expected = F.scaled_dot_product_attention(q.view(1, Hkv, H // Hkv, D), at_new[None], v[None]).reshape(H, 1, D)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("heads,hkv,dim,n,local,dtype", [(4, 2, 16, 131_072, 8, torch.float32),
                                                        (14, 2, 64, 20_000, 2048, torch.float16),
                                                        (4, 2, 24, 3_000, 100, torch.float32)])
def test_the_kernel_past_the_window_rotates_as_it_reads_and_equals_the_torch_path(heads, hkv, dim, n, local, dtype):
    """kernels.remapped_attend (attend.c: each selected key rotated to its new position as it is
    loaded, fp32 or fp16 rows, the rotation SIMD for D/2 a multiple of 8, else scalar) gives
    beyond.remapped_decode's attention (gather, rotate, SDPA) on one and two threads; without
    the rotation (moved = 0) it would not."""
    import kernels
    from kernels import attend_cpu

    if not attend_cpu.c_attend_fits(heads, hkv, dim):
        pytest.skip("kernels/_quant.so without the AVX2 attention kernel (make setup)")
    torch.manual_seed(n)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rotations = Rotations(inv_freq)
    q = torch.randn(heads, 1, dim)
    k, v = (3 * torch.randn(hkv, n + 40, dim)).to(dtype), torch.randn(hkv, n + 40, dim).to(dtype)
    moved = 3 * local // 2
    far = torch.stack([torch.sort(torch.randperm(n - local)[:moved]).values for _ in range(hkv)])  # (Hkv, moved)
    idx = torch.cat([far, torch.arange(n - local, n).expand(hkv, -1)], 1).to(torch.int32)  # (Hkv, K)
    expected = remapped_decode(q, k, v, idx, n, rotations, local)[:, 0]  # (H, D)
    lo, hi = rotations.tables(n, "cpu")
    for count in (1, 2):
        kernels.set_threads(count)
        try:
            out = kernels.remapped_attend(q[:, 0], k, v, idx, n, moved, lo, hi, rotations.block)
            unrotated = kernels.remapped_attend(q[:, 0], k, v, idx, n, 0, lo, hi, rotations.block)
        finally:
            kernels.set_threads(1)
        torch.testing.assert_close(torch.from_numpy(out), expected, rtol=0, atol=1e-5)
        assert (torch.from_numpy(unrotated) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_selected_scores_are_the_scores_of_the_keys_as_the_kernel_reads_them(dtype):
    """kernels.selected_scores (attend.c, what the attention tally weighs) gives the group's scores
    over beyond.remapped_rows' re-positioned keys past the window, and over the keys as stored
    with moved = 0, on one and two threads."""
    import kernels
    from kernels import attend_cpu

    heads, hkv, dim, n, local = 14, 2, 64, 70_000, 512
    if not attend_cpu.c_attend_fits(heads, hkv, dim):
        pytest.skip("kernels/_quant.so without the AVX2 attention kernel (make setup)")
    torch.manual_seed(3)
    rotations = Rotations(1.0 / 1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    q = torch.randn(heads, 1, dim)
    k, v = (3 * torch.randn(hkv, n + 40, dim)).to(dtype), torch.randn(hkv, n + 40, dim).to(dtype)
    far = torch.stack([torch.sort(torch.randperm(n - local)[:2 * local]).values for _ in range(hkv)])
    idx = torch.cat([far, torch.arange(n - local, n).expand(hkv, -1)], 1).to(torch.int32)  # (Hkv, K)
    K = idx.shape[1]
    lo, hi = rotations.tables(n, "cpu")
    moved_keys = remapped_rows(k, v, idx, n, rotations, dtype=torch.float32)[0]  # (Hkv, K, D)
    stored_keys = torch.gather(k, 1, idx.long().unsqueeze(-1).expand(-1, -1, dim)).float()  # (Hkv, K, D)
    group = q[:, 0].view(hkv, heads // hkv, dim)  # (Hkv, G, D)
    for count in (1, 2):
        kernels.set_threads(count)
        try:
            moved = kernels.selected_scores(q[:, 0], k, idx, n, K, lo, hi, rotations.block)
            stored = kernels.selected_scores(q[:, 0], k, idx)
        finally:
            kernels.set_threads(1)
        for got, keys in ((moved, moved_keys), (stored, stored_keys)):
            expected = torch.einsum("hgd,hkd->hgk", group, keys) / dim ** 0.5  # (Hkv, G, K)
            torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=2e-4)
        assert (torch.from_numpy(moved) - torch.from_numpy(stored)).abs().max() > 1.0  # the rotation matters


def test_selected_scores_refuses_a_selection_or_tables_that_do_not_fit_with_what_they_must_be():
    from kernels import attend_cpu

    if not attend_cpu.c_attend_fits(4, 2, 16):
        pytest.skip("kernels/_quant.so without the AVX2 attention kernel (make setup)")
    rotations = Rotations(1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    q, k = torch.randn(4, 16), torch.randn(2, 100, 16)
    lo, hi = rotations.tables(90, "cpu")
    idx = torch.arange(10).expand(2, -1).to(torch.int32)  # (Hkv, K)
    with pytest.raises(ValueError, match=r"idx must be \(Hkv, K\) = \(2, K\)"):
        kernels.selected_scores(q, k, idx[:1])
    with pytest.raises(ValueError, match=r"idx must lie in \[0, 100\), got \[0, 100\]"):
        kernels.selected_scores(q, k, torch.cat([idx, torch.full((2, 1), 100, dtype=torch.int32)], 1))
    with pytest.raises(ValueError, match=r"idx must lie in \[0, 8\)"):  # re-positioned rows lie before base
        kernels.selected_scores(q, k, idx, 8, 10, lo, hi, rotations.block)
    with pytest.raises(ValueError, match="rotation tables must be"):
        kernels.selected_scores(q, k, idx, 90, 10, lo[:, :16], hi, rotations.block)


def test_remapped_chunk_sees_its_selection_before_its_local_keys_and_itself_causally():
    torch.manual_seed(1)
    inv_freq = rope_inv_freq(tiny_model().args)
    Hkv, H, D, T, past = 2, 4, 16, 5, 40_000
    k_all, v_all = torch.randn(Hkv, past + T, D), torch.randn(Hkv, past + T, D)
    q = torch.randn(H, T, D)
    idx = torch.arange(past - 8, past).expand(Hkv, -1)  # only the recent window: nothing moves
    out = remapped_chunk(q, k_all, v_all, idx, past, Rotations(inv_freq))
    expected = causal_attention(q, k_all[:, past - 8 :], v_all[:, past - 8 :])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_positions_past_the_window_take_float64_angles_and_inside_the_table():
    model = tiny_model()
    model.setup_rope(4096)
    assert model.rope_cos.shape[0] == WINDOW  # no table past the window
    cos, sin = model.rope(WINDOW - 3, 6)
    exact_cos, exact_sin = rope_angles(model.inv_freq, torch.arange(WINDOW, WINDOW + 3))
    torch.testing.assert_close(cos[:3], model.rope_cos[WINDOW - 3 :], rtol=0, atol=0)
    torch.testing.assert_close((cos[3:], sin[3:]), (exact_cos, exact_sin), rtol=0, atol=0)


def test_sink_window_selector_past_the_window_decodes():
    model = tiny_model()
    policy = SpotlightDecode(SpotlightConfig(dense_layers=(), dense_below=0, far_window=16, far_retrieved=16),
                             SinkWindowSelector())
    _, decoded, _ = run(model, policy, PROMPT, STEPS)
    assert decoded.shape == (len(STEPS), model.args.vocab_size) and bool(decoded.isfinite().all())


def test_a_budget_too_large_for_the_window_is_lowered_to_fit_it():
    assert fitted(4, 2048, 2048, 1024, 8192) == (2048, 2048)  # SmolLM2's window: as configured
    assert fitted(4, 2048, 2048, 64, 2048) == (990, 990)  # 4 + 990 + 990 + 64 = 2048


def test_the_prefill_budget_is_lowered_with_the_decode_budget_and_never_above_it():
    fit = fitted_config(SpotlightConfig(far_retrieved=2048, far_window=2048, far_prefill_retrieved=1500), 2048, 64)
    kept = fitted_config(SpotlightConfig(), 32768, 1024)
    assert (fit.far_retrieved, fit.far_window, fit.far_prefill_retrieved) == (990, 990, 990)
    assert (kept.far_retrieved, kept.far_window, kept.far_prefill_retrieved) == (4096, 1024, 2048)


def test_dense_below_is_at_most_the_window():
    below = [fitted_config(SpotlightConfig(dense_below=16384), native, 1024).dense_below for native in (32768, 8192)]
    assert below == [16384, 8192]  # Qwen2.5's 32K window: as set; SmolLM2's 8K: the window


def test_the_fold_is_at_most_half_the_window_and_zero_stays_zero():
    folds = [fitted_config(SpotlightConfig(far_fold=fold), native, 1024).far_fold
             for fold, native in ((8192, 32768), (8192, 8192), (8192, 2048), (0, 8192), (3000, 8192))]
    assert folds == [8192, 4096, 1024, 0, 3000]  # Qwen2.5's 32K window, SmolLM2's 8K, a 2K one, unfolded, as set


def test_engine_reads_past_its_window_with_spotlight_and_refuses_without():
    engine = tiny_engine(spotlight=True, max_seq_len=512)
    assert (engine.native_window, engine.max_context) == (512, 1_000_000)
    context = engine.new_context()
    ids = engine.encode("a long page " * 200)  # 2,400 tokens: past the 512-token window
    assert engine.prefill(context, ids)
    dense = engine.with_spotlight(SpotlightConfig(enabled=False))
    assert dense.max_context == 512
    with pytest.raises(ContextTooLong, match="turn Spotlight on to read beyond the window"):
        dense.prefill(dense.new_context(), ids)


def test_a_conversation_past_the_window_is_capped_by_what_memory_holds():
    """Until cached rows live outside RAM, the K/V rows of one conversation, its key codes and their
    byte planes (the far scan's copy, where scan.c is built) must fit in KV_MEMORY_SHARE of the
    machine's memory; the refusal says that memory is the limit."""
    engine = tiny_engine(spotlight=True, max_seq_len=512)
    args = engine.args
    assert engine.kv_bytes_per_token == 2 * args.n_layers * args.n_kv_heads * args.head_dim * 2  # fp16 K and V (auto)
    codes = args.n_layers * args.n_kv_heads * engine.spotlight.bits // 8
    planes = codes if kernels.planes_fit(args.n_heads, args.n_kv_heads, engine.policy.code_words) else 0
    assert engine.memory_bytes_per_token == engine.kv_bytes_per_token + codes + planes
    assert engine.with_spotlight(SpotlightConfig(enabled=False)).memory_bytes_per_token == engine.kv_bytes_per_token
    assert (engine.memory_tokens, engine.memory_bound) == (
        int(KV_MEMORY_SHARE * physical_memory_bytes()) // engine.memory_bytes_per_token, False)
    huge = engine.with_spotlight(dataclasses.replace(engine.spotlight, max_context=10 * engine.memory_tokens))
    assert (huge.max_context, huge.memory_bound) == (engine.memory_tokens, True)
    with pytest.raises(ContextTooLong) as refused:
        huge.check_fits(huge.max_context, 1)
    assert str(refused.value) == (
        f"{huge.max_context:,} prompt tokens + 1 reply tokens exceed the limit of {huge.max_context:,} tokens per "
        "conversation (what this machine's memory holds); shorten the input or raise the limit")


NEEDLE = "The special magic number for the city of Lisbon is 7481."  # dense finds it within the window
QUESTION = "What is the special magic number for the city of Lisbon?"


@pytest.mark.model
@pytest.mark.timeout(3600)  # ~20K tokens of prefill: minutes on a busy 2-core machine
@pytest.mark.xfail(reason="measured 2026-12-01: answers 'The special magic number for the city of Lisbon is 1000.' "
                          "(fluent, the question's frame found, the digits not): the shipped encoders' codes do "
                          "not retrieve the needle at 20K; dense finds this needle inside the 8K window "
                          "(docs/RESULTS.md needle grid)", strict=False)
def test_a_fact_at_10_percent_of_a_20k_token_document_comes_back_through_spotlight(engine, tmp_path):
    """SmolLM2-135M (the test model, 8K window) answers from a ~20K-token document attached in the service."""
    from chat.config import AppConfig
    from chat.service import ChatService
    from spotlight.config import SamplingConfig
    from spotlight.corpus import essays

    hay = "\n\n".join(doc.text for doc in essays())
    words = engine.decode(engine.encode(hay)[:20_000])
    at = words.find(". ", len(words) // 10) + 2  # a sentence start at 10 % depth
    document = words[:at] + NEEDLE + " " + words[at:]
    service = ChatService(AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=16)),
                          _engine=engine.with_spotlight(SpotlightConfig()))
    try:
        session = service.create()
        info = service.attach_text(session.id, "essays.txt", document)
        assert info.n_tokens > 2 * engine.native_window
        turns = list(service.send(session.id, QUESTION))
        assert "7481" in turns[-1].text, turns[-1].text
    finally:
        service.close()


def test_a_negative_fold_is_refused_with_what_zero_means():
    with pytest.raises(ValueError) as refused:
        SpotlightConfig(far_fold=-1)
    assert str(refused.value) == "far_fold must be >= 0 (0: score far tokens at their true distances), got -1"


def test_a_prompts_last_tokens_run_alone_each_its_own_piece():
    assert list(_pieces(list(range(10)), 4, 3)) == [[0, 1, 2, 3], [4, 5, 6], [7], [8], [9]]
    assert list(_pieces(list(range(10)), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(_pieces([5, 6], 4, 2)) == [[5], [6]]


class Recorded(SpotlightDecode):
    """SpotlightDecode that notes, at layer 0, each decode step's and each past-window chunk's cache length."""

    def __init__(self, config, selector):
        super().__init__(config, selector)
        self.calls = []

    def decode(self, layer, q, cache):
        if layer == 0:
            self.calls.append(("decode", cache.length))
        return super().decode(layer, q, cache)

    def prefill(self, layer, q, cache):
        if layer == 0:
            self.calls.append(("chunk", cache.length, q.shape[1]))
        return super().prefill(layer, q, cache)


@pytest.mark.parametrize("alone, calls", [
    (1, [("chunk", 64, 5), ("decode", 69)]),  # the rule before far_alone: only the last token alone
    (10, [("decode", n) for n in range(64, 70)]),  # 10 asked, 6 past the window: those 6, one at a time
])
def test_past_the_window_a_prompts_last_tokens_each_select_for_themselves(alone, calls):
    """Inside the window nothing runs alone (the chunks stay exact); past it the last `alone` tokens
    run as decode steps, each with its own selection (SpotlightConfig.far_alone)."""
    model = tiny_model()
    policy = spotlight(model)
    recorded = Recorded(policy.config, policy.selector)
    context = Context(KVCache(model.args, 128, code_words=recorded.code_words))
    with torch.inference_mode():
        logits = prefill(model, context, PROMPT[:70], recorded, chunk=32, alone=alone)
    assert (recorded.calls, len(context.tokens), logits.shape) == (calls, 70, (model.args.vocab_size,))


class Budgets(CodeSelector):
    """CodeSelector that notes, at layer 0, each past-window selection's (queries, retrieved budget)."""

    def __init__(self, encoders):
        super().__init__(encoders)
        self.asked = []

    def select_far(self, layer, q, cache, n, retrieved, sinks, window, fold, rotations):
        if layer == 0:
            self.asked.append((q.shape[1], retrieved))
        return super().select_far(layer, q, cache, n, retrieved, sinks, window, fold, rotations)


@pytest.mark.parametrize("prefill_budget, chunk_asks", [(8, 8), (32, 16)])  # never above a step's 16
def test_past_the_window_a_prefill_chunk_retrieves_its_own_budget_and_a_step_the_decode_one(prefill_budget,
                                                                                             chunk_asks):
    """A chunk read past the window retrieves far_prefill_retrieved tokens (at most far_retrieved),
    every token that runs alone (and every decode step) far_retrieved."""
    model = tiny_model()
    policy = spotlight(model, far_prefill_retrieved=prefill_budget)
    budgets = Budgets(policy.selector.encoders)
    policy = SpotlightDecode(policy.config, budgets)
    context = Context(KVCache(model.args, 128, code_words=policy.code_words))
    with torch.inference_mode():
        prefill(model, context, PROMPT[:100], policy, chunk=32, alone=3)
        model(torch.tensor([7]), context.cache, policy)
    assert budgets.asked == [(32, chunk_asks), (1, 16), (1, 16), (1, 16), (1, 16), (1, 16)]


def test_a_reply_runs_the_configured_tokens_alone_and_a_dense_policy_its_last():
    model = tiny_model()
    assert (reply_alone(spotlight(model, far_alone=7)), reply_alone(spotlight(model)), reply_alone(DenseDecode())) == (
        7, SpotlightConfig().far_alone, 1)


def test_no_prompt_token_running_alone_is_refused_with_why():
    with pytest.raises(ValueError) as refused:
        SpotlightConfig(far_alone=0)
    assert str(refused.value) == "far_alone must be >= 1 (the prompt's last token always runs alone), got 0"


def test_a_prefill_budget_past_the_window_below_one_token_is_refused():
    with pytest.raises(ValueError) as refused:
        SpotlightConfig(far_prefill_retrieved=0)
    assert str(refused.value) == "far_window, far_retrieved and far_prefill_retrieved must be >= 1"
