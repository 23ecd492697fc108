"""Our compact model against transformers (the oracle), and cache/prefill invariants. Issue #2."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_pair
from spotlight.attention import DenseDecode
from spotlight.cache import KVCache
from spotlight.model import rope_inv_freq

# fp32 on the same weights: the only differences come from matmul blocking (qkv and
# gate/up are fused here). Observed max |diff| is 0 to ~1e-5; the bound leaves headroom.
LOGIT_TOLERANCE = 1e-3


def our_logits(model, ids, chunk=None):
    cache = KVCache(model.args, 16)
    out = []
    with torch.inference_mode():
        chunk = chunk or len(ids)
        for start in range(0, len(ids), chunk):
            piece = torch.tensor(ids[start : start + chunk])
            out.append(model(piece, cache, DenseDecode(), all_logits=True))
    return torch.cat(out)  # (T, V)


def ref_logits(ref, ids):
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0]  # (T, V)


PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Écris un haïku sur la mer. 日本語も少し。"}],
]


@pytest.mark.model
@pytest.mark.parametrize("messages", PROMPTS)
def test_default_model_logits_match_transformers(engine, reference_model, messages):
    ids = engine.chat_ids(messages)
    diff = (our_logits(engine.model, ids) - ref_logits(reference_model, ids)).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"max |logit diff| {diff}"


@pytest.mark.model
def test_default_model_logits_match_on_2k_tokens(engine, reference_model, essay_text):
    ids = engine.encode(essay_text)[:2048]
    assert len(ids) == 2048
    ours = our_logits(engine.model, ids, chunk=512)
    diff = (ours - ref_logits(reference_model, ids)).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"max |logit diff| over 2048 positions: {diff}"


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen2", {}),
        ("mistral", {}),
    ],
)
def test_tiny_random_models_match_transformers(arch, overrides):
    ref, ours = tiny_pair(arch, **overrides)
    ids = torch.randint(0, ref.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    diff = (our_logits(ours, ids) - ref_logits(ref, ids)).abs().max().item()
    assert diff <= 1e-4, f"{arch} {overrides}: max |logit diff| {diff}"


def test_qwen2_has_qkv_bias_and_it_is_loaded():
    ref, ours = tiny_pair("qwen2")
    bias = ours.layers[0].attention.wqkv.bias
    expected = torch.cat([getattr(ref.model.layers[0].self_attn, f"{p}_proj").bias for p in "qkv"])
    assert torch.equal(bias, expected)


def test_chunked_prefill_equals_one_shot():
    _, ours = tiny_pair("llama", seed=3)
    ids = torch.randint(0, 211, (97,), generator=torch.Generator().manual_seed(2)).tolist()
    one_shot = our_logits(ours, ids)
    for chunk in (1, 7, 32, 96):
        torch.testing.assert_close(our_logits(ours, ids, chunk=chunk), one_shot, rtol=0, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, past, T", [(9, 3, 37, 11), (4, 4, 1, 5), (8, 2, 300, 64)])
def test_split_chunk_attention_equals_masked_sdpa(heads, kv_heads, past, T):
    import torch.nn.functional as F

    from spotlight.model import _split_attention, causal_attention, prefill_mask

    g = torch.Generator().manual_seed(past)
    q = torch.randn(heads, T, 16, generator=g)  # (H, T, D)
    k, v = (torch.randn(kv_heads, past + T, 16, generator=g) for _ in range(2))  # (Hkv, N, D)
    mask = prefill_mask(T, past, torch.float32, "cpu")
    assert mask.shape == (T, past + T) and mask[0, past] == 0 and mask[0, past + 1] == float("-inf")
    masked = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
    torch.testing.assert_close(_split_attention(q, k, v, past), masked, rtol=0, atol=1e-6)
    torch.testing.assert_close(causal_attention(q, k, v), masked, rtol=0, atol=1e-6)


@pytest.mark.parametrize("block", [16, 64, 2048])
def test_split_chunk_attention_widens_an_fp16_past_in_blocks(block):
    """An fp16 cache's past, widened and attended block by block and merged, equals SDPA over the
    whole widened cache (the blocks bound the widened copy's memory, not the result)."""
    import torch.nn.functional as F

    from spotlight.model import _split_attention, causal_attention, prefill_mask

    heads, kv_heads, past, T = 9, 3, 300, 24
    g = torch.Generator().manual_seed(block)
    q = torch.randn(heads, T, 16, generator=g)  # (H, T, D)
    k, v = (torch.randn(kv_heads, past + T, 16, generator=g).half() for _ in range(2))  # (Hkv, N, D) fp16
    mask = prefill_mask(T, past, torch.float32, "cpu")
    masked = F.scaled_dot_product_attention(q[None], k.float()[None], v.float()[None], attn_mask=mask, enable_gqa=True)[0]
    torch.testing.assert_close(_split_attention(q, k, v, past, block), masked, rtol=0, atol=1e-6)
    torch.testing.assert_close(causal_attention(q, k, v), masked, rtol=0, atol=1e-6)


def test_cache_grows_truncates_and_extends():
    _, ours = tiny_pair("llama", seed=4)
    ids = list(range(40))
    cache = KVCache(ours.args, 8)
    with torch.inference_mode():
        ours(torch.tensor(ids), cache, DenseDecode())
    assert cache.length == 40 and cache.capacity >= 40
    keys_before = cache.keys(0).clone()
    cache.truncate(25)
    assert cache.length == 25
    with torch.inference_mode():
        ours(torch.tensor(ids[25:]), cache, DenseDecode())
    assert cache.length == 40
    torch.testing.assert_close(cache.keys(0), keys_before, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(41)


def test_host_layer_views_the_cache_buffers_and_follows_them_when_they_grow():
    _, ours = tiny_pair("llama", seed=4)
    cache = KVCache(ours.args, 8)
    with torch.inference_mode():
        ours(torch.tensor(list(range(6))), cache, DenseDecode())
    k, v = cache.host_layer(1)  # (Hkv, Ncap, D) numpy views
    assert (k.shape, np.shares_memory(k, cache.k.numpy()), np.shares_memory(v, cache.v.numpy())) == \
        (tuple(cache.k[1].shape), True, True)
    with torch.inference_mode():
        ours(torch.arange(6, 300) % ours.args.vocab_size, cache, DenseDecode())  # past the capacity: new buffers
    k, v = cache.host_layer(1)
    np.testing.assert_array_equal(k[:, :300], cache.keys(1).numpy())
    np.testing.assert_array_equal(v[:, :300], cache.values(1).numpy())


def test_buffer_pool_keeps_fitting_buffers_and_drops_the_smallest_first():
    from spotlight.cache import BufferPool

    pool = BufferPool(max_bytes=1000)
    a, b, c = (torch.UntypedStorage(n) for n in (400, 300, 500))
    pool.give(torch.UntypedStorage(14))  # under 1/64 of max_bytes (15): not worth keeping
    pool.give(torch.UntypedStorage(1001))  # over max_bytes
    assert pool.kept_bytes == 0
    for buffer in (a, b, c):
        pool.give(buffer)
    assert pool.kept_bytes == 900  # 400 + 300 + 500 > 1000: the smallest (300) went
    assert pool.take(199) is None  # 400 and 500 are more than twice 199
    assert pool.take(450) is c  # the smallest fit
    assert pool.take(399) is a and pool.take(399) is None  # taken once
    assert (pool.hits, pool.misses, pool.kept_bytes) == (2, 2, 0)


def test_a_buffer_pool_miss_lets_go_of_the_buffers_smaller_than_it_asked_for():
    from spotlight.cache import BufferPool

    pool = BufferPool(max_bytes=1000)
    small, middle, large = (torch.UntypedStorage(n) for n in (100, 250, 600))
    for buffer in (small, middle, large):
        pool.give(buffer)
    assert pool.take(260) is None  # 600 is more than twice 260: a miss, and 100 and 250 cannot serve it
    assert (pool.kept_bytes, pool.misses) == (600, 1)
    assert pool.take(300) is large  # what was at least as large as the miss stays


def test_pooled_cache_reuses_a_dropped_caches_memory_and_computes_the_same():
    import gc

    from spotlight.cache import BufferPool, kv_buffer_bytes

    _, ours = tiny_pair("llama", seed=5)
    ids = torch.randint(0, 211, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    pool = BufferPool(2 * kv_buffer_bytes(ours.args, torch.float32, 64))
    pool.prefault(pool.max_bytes // 2, 2)
    first = KVCache(ours.args, 64, pool=pool)
    assert pool.kept_bytes == 0 and first.k.untyped_storage().nbytes() == pool.max_bytes // 2
    with torch.inference_mode():
        ours(torch.tensor(ids[::-1]), first, DenseDecode())  # other rows in the memory
    pointers = {first.k.data_ptr(), first.v.data_ptr()}
    del first  # its memory is its own: views of a cache's K/V are valid only while it lives
    gc.collect()
    assert pool.kept_bytes == pool.max_bytes
    second = KVCache(ours.args, 64, pool=pool)
    assert {second.k.data_ptr(), second.v.data_ptr()} == pointers  # both buffers reused
    del second
    gc.collect()
    hits = pool.hits
    reused, fresh = KVCache(ours.args, 64, pool=pool), KVCache(ours.args, 64)
    assert pool.hits == hits + 2 and {reused.k.data_ptr(), reused.v.data_ptr()} <= pointers
    with torch.inference_mode():
        torch.testing.assert_close(ours(torch.tensor(ids), reused, DenseDecode(), all_logits=True),
                                   ours(torch.tensor(ids), fresh, DenseDecode(), all_logits=True), rtol=0, atol=0)
    kept = pool.kept_bytes
    reused.reserve(600)  # grown: its old buffers are freed, not pooled (views of them may live on) ...
    del reused
    gc.collect()
    assert pool.kept_bytes == kept  # ... and its new ones are too large for this pool


def test_buffer_pool_size_follows_the_config():
    from spotlight.config import EngineConfig
    from spotlight.engine import _pool_tokens

    _, ours = tiny_pair("llama", seed=0)
    window = ours.args.max_seq_len
    assert _pool_tokens(EngineConfig(), ours.args) == min(window, 16384)
    assert _pool_tokens(EngineConfig(kv_pool_tokens=0), ours.args) == 0
    assert _pool_tokens(EngineConfig(kv_pool_tokens=300), ours.args) == 300
    assert _pool_tokens(EngineConfig(device="cuda"), ours.args) == 0  # host caches only
    with pytest.raises(ValueError, match="kv_pool_tokens must be >= 0"):
        EngineConfig(kv_pool_tokens=-1)


def test_rope_llama3_scaling_changes_only_long_wavelengths():
    from spotlight.config import ModelArgs, RopeScaling

    base = ModelArgs(vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=8, max_seq_len=128)
    scaled = ModelArgs(**{**base.__dict__, "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 64)})
    a, b = rope_inv_freq(base), rope_inv_freq(scaled)
    assert a[0] == b[0]  # the highest frequency is untouched
    assert b[-1] == pytest.approx(a[-1] / 8.0)  # the lowest frequency is divided by the factor


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_linear_equals_torch_and_keeps_autograd_path(bias):
    from spotlight.onerow import OneRowLinear

    torch.manual_seed(0)
    layer = OneRowLinear(37, 23, bias=bias)  # odd sizes: the kernel's 4-row blocks leave a remainder
    x = torch.randn(1, 37)
    with torch.inference_mode():
        fast = layer(x)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert fast.shape == (1, 23)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)
    rows = torch.randn(3, 37)  # prefill chunks: torch's path, bit-identical
    with torch.inference_mode():
        assert torch.equal(layer(rows), torch.nn.functional.linear(rows, layer.weight, layer.bias))
    trained = layer(x)  # grad enabled: F.linear, so gradients flow
    trained.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (23, 37)


def test_one_row_linear_sees_weights_changed_in_place_and_replaced():
    from spotlight.onerow import OneRowLinear

    torch.manual_seed(0)
    layer = OneRowLinear(16, 8, bias=True).requires_grad_(False)
    x = torch.randn(1, 16)

    def check():
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                       rtol=1e-5, atol=1e-5)

    check()  # the numpy views are made here
    layer.weight.mul_(2.0)  # same memory: the views see it
    check()
    layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.randn(8)})  # copied in place
    check()
    layer.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)  # new memory: views remade
    layer.bias = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    check()


def test_a_long_chunk_runs_its_mlp_in_slices_with_the_same_values():
    """FeedForward over a chunk whose (T, 2F) intermediate exceeds FFN_WHOLE_BYTES (inference):
    slices of FFN_ROWS rows, each row's values those of the whole product (to fp32 rounding of a
    GEMM blocked by its row count); a chunk within the bound runs in one call."""
    from spotlight.model import FFN_ROWS, FFN_WHOLE_BYTES, FeedForward
    from spotlight.testing import tiny_args

    torch.manual_seed(3)
    mlp = FeedForward(tiny_args()).eval()
    whole = FFN_WHOLE_BYTES // (2 * mlp.width * torch.float32.itemsize)  # the most rows one call takes
    x = torch.randn(whole + 5, tiny_args().dim)  # (T, E): past the bound
    gate, up = mlp.w_gate_up(x).split(mlp.width, dim=-1)  # (T, F) x2
    want = mlp.w_down(torch.nn.functional.silu(gate) * up).detach()  # (T, E) in one product
    rows_per_call = []
    mlp.w_gate_up.register_forward_hook(lambda module, args, out: rows_per_call.append(args[0].shape[0]))
    with torch.inference_mode():
        got = mlp(x)
        sliced, rows_per_call[:] = list(rows_per_call), []
        first = mlp(x[:whole])  # at the bound: one call
    assert sliced == [min(FFN_ROWS, x.shape[0] - start) for start in range(0, x.shape[0], FFN_ROWS)]
    assert rows_per_call == [whole]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(first, want[:whole], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon and malloc_trim: Linux with glibc")
def test_release_freed_memory_gives_freed_heap_pages_back():
    """Small freed buffers below a live one stay resident until release_freed_memory trims the heap."""
    from spotlight.heap import release_freed_memory

    def anon_mib() -> float:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("RssAnon:"))
        return int(line.split()[1]) / 1024

    release_freed_memory()
    buffers = [np.ones(100_000 // 8) for _ in range(400)]  # 40 MB in 100 KB buffers (malloc's heap)
    pin = np.ones(100_000 // 8)  # a live buffer above them, so freeing them cannot shrink the heap's top
    del buffers
    before = anon_mib()
    assert release_freed_memory() is True
    assert before - anon_mib() >= 20, (before, anon_mib())
    assert pin.sum() == 100_000 // 8
