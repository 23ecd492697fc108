"""The engine's front door (issue #18): prefill, the Context row API, with_spotlight,
fingerprints, observers and warm-up, on the tiny random engine of spotlight/testing.py."""
import os
import subprocess
import sys
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ROOT
from spotlight.testing import tiny_engine
from spotlight import AttentionTally, Context, Fingerprints, KVRows, ReadMeter
from spotlight.config import SamplingConfig, SpotlightConfig
from spotlight.hashing import EncoderSpec, Encoders
from spotlight.observers import ReadStep, tally_layers

TEXT = "The quick brown fox jumps over the lazy dog. " * 4  # 180 byte tokens


def ids_of(n: int) -> list[int]:
    return list(TEXT.encode())[:n]


def filled(engine, n: int) -> Context:
    context = engine.new_context()
    assert engine.prefill(context, ids_of(n))
    return context


@torch.inference_mode()
def next_logits(engine, context: Context, token: int = 65) -> torch.Tensor:
    """Logits (V,) of one decode step of `token` after the context (which it extends)."""
    return engine.model(torch.tensor([token]), context.cache, engine.policy)


def greedy(max_new_tokens: int) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, repetition_penalty=1.0)


# ----------------------------------------------------------------------------- prefill


def test_prefill_reports_progress_after_each_chunk():
    engine = tiny_engine(prefill_chunk=64)
    context, calls = engine.new_context(), []
    assert engine.prefill(context, ids_of(150), progress=lambda done, total: calls.append((done, total)))
    assert calls == [(64, 150), (128, 150), (150, 150)]
    assert context.tokens == ids_of(150) and context.cache.length == 150


def test_cancelled_prefill_returns_false_and_keeps_a_consistent_context():
    engine = tiny_engine(prefill_chunk=64)
    cancel = threading.Event()
    context = engine.new_context()

    def stop_after_two(done, total):
        if done == 128:
            cancel.set()

    assert not engine.prefill(context, ids_of(180), progress=stop_after_two, cancel=cancel)
    assert context.tokens == ids_of(128) and context.cache.length == 128
    assert engine.prefill(context, ids_of(180)[128:])  # continuing gives what one prefill gives
    torch.testing.assert_close(next_logits(engine, context), next_logits(engine, filled(engine, 180)), rtol=0, atol=0)


# ----------------------------------------------------------------------------- rows


@pytest.mark.parametrize("spotlight", [False, True])
def test_rows_round_trip_gives_the_same_next_token_logits(spotlight):
    engine = tiny_engine(spotlight=spotlight)
    original = filled(engine, 150)
    rows = original.rows(0, 150)
    assert rows.token_ids == ids_of(150) and len(rows) == 150
    assert rows.k.shape == (2, 2, 150, 16) and rows.k.dtype == torch.float16  # kv_dtype auto on the CPU
    if spotlight:
        assert rows.key_codes.dtype == np.uint64 and rows.key_codes.shape == (2, 2, 1, 150)
    else:
        assert rows.key_codes is None
    restored = engine.new_context()
    restored.reserve(150)
    restored.append_rows(original.rows(0, 100))
    restored.append_rows(original.rows(100, 150))
    assert restored.tokens == original.tokens
    if spotlight:
        np.testing.assert_array_equal(restored.rows(0, 150).key_codes, rows.key_codes)
    torch.testing.assert_close(next_logits(engine, restored), next_logits(engine, original), rtol=0, atol=0)


def test_append_rows_takes_the_first_n_rows_and_their_tokens():
    engine = tiny_engine(spotlight=True)
    rows = filled(engine, 120).rows(0, 120)
    context = engine.new_context()
    context.append_rows(rows, 70)
    assert context.tokens == ids_of(70)
    np.testing.assert_array_equal(context.rows(0, 70).key_codes, rows.key_codes[..., :70])
    reference = filled(engine, 120)
    reference.truncate(70)  # the same rows (prefilling 70 tokens would chunk them otherwise)
    torch.testing.assert_close(next_logits(engine, context), next_logits(engine, reference), rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot append 121 of 120 rows"):
        context.append_rows(rows, 121)
    with pytest.raises(ValueError, match="not within the cache's 71 tokens"):
        context.rows(0, 72)


def test_rows_are_copies():
    engine = tiny_engine()
    context = filled(engine, 20)
    rows = context.rows(0, 20)
    rows.k.zero_()
    assert context.rows(0, 20).k.abs().sum() > 0
    assert isinstance(rows, KVRows)


@pytest.mark.parametrize("spotlight", [False, True])
def test_an_fp16_cache_decodes_as_the_fp32_cache_within_its_rounding(spotlight):
    """kv_dtype (auto = float16 on the CPU): the cache keeps K/V in half the bytes, its rows and
    spans are fp16, and prefill + decode logits stay within fp16's rounding of the fp32 cache's;
    the greedy reply is the same."""
    half, full = tiny_engine(spotlight=spotlight), tiny_engine(spotlight=spotlight, kv_dtype="float32")
    assert (half.kv_dtype, full.kv_dtype) == (torch.float16, torch.float32)
    assert (half.kv_bytes_per_token, full.kv_bytes_per_token) == (2 * 2 * 2 * 16 * 2, 2 * 2 * 2 * 16 * 4)
    assert (half.fingerprints.kv_dtype, full.fingerprints.kv_dtype) == ("float16", "float32")
    a, b = filled(half, 170), filled(full, 170)
    assert (a.cache.k.dtype, a.rows(0, 170).v.dtype, b.cache.k.dtype) == (torch.float16, torch.float16, torch.float32)
    torch.testing.assert_close(a.rows(0, 170).k.float(), b.rows(0, 170).k, rtol=1e-3, atol=1e-3)  # fp16 rounding
    logits_a, logits_b = next_logits(half, a), next_logits(full, b)
    scale = logits_b.abs().max().item()
    assert (logits_a - logits_b).abs().max().item() <= 2e-4 * scale  # measured 1.9-2.2e-5
    replies = []
    for engine in (half, full):
        steps = list(engine.stream(engine.new_context(), ids_of(120), greedy(12)))
        replies.append([s.token for s in steps if s.token is not None])
    assert replies[0] == replies[1] and len(replies[0]) == 12


# ----------------------------------------------------------------------------- which way it decodes


def test_fingerprints_and_decode_mode():
    dense, sparse = tiny_engine(), tiny_engine(spotlight=True)
    expected = Encoders(EncoderSpec.for_model(sparse.args, 64), seed=0, model_fingerprint="tiny").fingerprint
    assert dense.fingerprints == Fingerprints("tiny-random-0", "", "float16")  # kv_dtype auto on the CPU
    assert sparse.fingerprints == Fingerprints("tiny-random-0", expected, "float16")
    assert (dense.decodes_densely, dense.spotlight) == (True, None)
    assert not sparse.decodes_densely
    assert sparse.spotlight == SpotlightConfig(bits=64, dense_layers=(0,), dense_below=64, k_min=16, window=16,
                                               far_window=2048, far_retrieved=2048, far_fold=4096)  # tiny_engine's


def test_with_spotlight_returns_the_same_engine_when_unchanged():
    dense, sparse = tiny_engine(), tiny_engine(spotlight=True)
    assert dense.with_spotlight(SpotlightConfig(enabled=False)) is dense
    assert sparse.with_spotlight(sparse.spotlight) is sparse


def test_with_spotlight_makes_a_new_engine_and_leaves_the_original_untouched():
    dense = tiny_engine()
    policy = dense.policy
    config = SpotlightConfig(bits=64, dense_below=0)
    sparse = dense.with_spotlight(config)
    assert sparse is not dense and sparse.model is dense.model and sparse.tokenizer is dense.tokenizer
    assert (sparse.spotlight, sparse.decodes_densely) == (replace(config, far_fold=4096), False)  # half the window
    assert sparse.warnings and "untrained" in sparse.warnings[0]  # no shipped encoders for the tiny model
    assert dense.policy is policy and dense.decodes_densely and dense.fingerprints.encoders == ""
    back = sparse.with_spotlight(SpotlightConfig(enabled=False))
    assert back.decodes_densely and back.warnings == () and not sparse.decodes_densely


def test_with_spotlight_keeps_encoders_whose_width_fits():
    sparse = tiny_engine(spotlight=True)
    wider = sparse.with_spotlight(SpotlightConfig(bits=64, ratio=0.5))
    assert wider.fingerprints == sparse.fingerprints and wider.policy.selector.encoders is sparse.policy.selector.encoders
    other = sparse.with_spotlight(SpotlightConfig(bits=128))
    assert other.fingerprints.encoders not in ("", sparse.fingerprints.encoders)


def test_warm_up_runs_on_both_decode_paths():
    for engine in (tiny_engine(), tiny_engine(spotlight=True)):
        assert engine.warm_up() >= 0.0


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_calls():
    engine = tiny_engine()
    text = "ab<|im_start|>é x"
    assert engine.token_offsets(text) == ([97, 98, 256, 195, 169, 32, 120], [0, 1, 2, 14, 14, 15, 16])
    assert engine.count_tokens(text) == 7 and engine.encode(text) == engine.token_offsets(text)[0]
    assert engine.decode(engine.encode("hello")) == "hello"
    assert engine.chat_ids([{"role": "user", "content": "hi"}]) == engine.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- observers


class Selections:
    """Copies of what `layer` read in each decode step."""

    def __init__(self, layer: int):
        self.layer, self.seen, self.reads = layer, [], []  # reads: (q, keys) of each step

    def on_layer(self, layer, q, cache, selected):
        if layer == self.layer:
            self.seen.append((cache.length + 1, None if selected is None else np.array(selected, copy=True)))
            self.reads.append((q.clone(), cache.keys(layer, 1).clone()))

    def on_step(self, n_tokens):
        pass


def decode_with(engine, n_prompt: int, steps: int, *observers):
    context = engine.new_context()
    out = list(engine.stream(context, ids_of(n_prompt), greedy(steps), observers=observers))
    assert out[-1].finish == "length", "the tiny model ended early: pick other ids"
    return context


def test_read_meter_measures_dense_and_sparse_reads():
    dense_meter, sparse_meter = ReadMeter(), ReadMeter()
    assert dense_meter.share() is None
    decode_with(tiny_engine(), 30, 4, dense_meter)
    assert dense_meter.steps == [ReadStep(n, (n, n)) for n in range(31, 35)]
    assert dense_meter.share() == 1.0
    engine = tiny_engine(spotlight=True)
    decode_with(engine, 150, 4, sparse_meter)
    budget = engine.spotlight.budget
    assert sparse_meter.steps == [ReadStep(n, (n, budget(n))) for n in range(151, 155)]  # layer 0 is dense
    assert sparse_meter.share() == pytest.approx(np.mean([(n + budget(n)) / (2 * n) for n in range(151, 155)]))


def test_attention_tally_of_dense_steps_sums_to_the_steps():
    tally, meter = AttentionTally(limit=1000), ReadMeter()
    decode_with(tiny_engine(), 40, 5, tally, meter)
    assert tally.steps == len(meter.steps) == 5
    assert tally.mass.shape == (1000,) and tally.mass.dtype == np.float64
    assert tally.mass.sum() == pytest.approx(5.0, abs=1e-6)  # fp32 softmax rows
    assert (tally.mass[45:] == 0).all() and (tally.mass[:45] > 0).all()  # positions past the last step get none
    clipped = AttentionTally(limit=10)
    decode_with(tiny_engine(), 40, 5, clipped)
    np.testing.assert_allclose(clipped.mass, tally.mass[:10], rtol=1e-12)


def test_attention_tally_of_sparse_steps_weighs_selected_positions_by_their_attention():
    engine = tiny_engine(spotlight=True)
    assert tally_layers(engine.args.n_layers) == [1]  # the tiny model's sparse layer
    tally, seen = AttentionTally(limit=1000), Selections(layer=1)
    decode_with(engine, 150, 3, tally, seen)
    expected = np.zeros(1000)
    for (n, selected), (q, keys) in zip(seen.seen, seen.reads):
        assert selected is not None and selected.shape == (2, engine.spotlight.budget(n))
        (H, _, D), Hkv = q.shape, selected.shape[0]
        for h in range(Hkv):  # each KV head: its query group's softmax over its selected rows
            group = q[h * H // Hkv : (h + 1) * H // Hkv, 0].double()  # (G, D)
            scores = group @ keys[h, selected[h]].double().T / D ** 0.5  # (G, K)
            np.add.at(expected, selected[h], (scores.softmax(-1).sum(0) / H).numpy())
    np.testing.assert_allclose(tally.mass, expected, rtol=1e-5, atol=1e-9)
    assert tally.steps == 3 and tally.mass.sum() == pytest.approx(3.0)
    unselected = np.setdiff1d(np.arange(1000), np.concatenate([s.reshape(-1) for _, s in seen.seen]))
    assert (tally.mass[unselected] == 0).all()


def test_attention_tally_past_the_window_weighs_the_keys_as_re_positioned():
    """Past the model's window a sparse layer reads its selection re-positioned (column j at
    n - K + j, spotlight/beyond.py): the tally weighs each selected position by the softmax over
    those rotated keys (here in float64 from RoPE's angles), not over the keys at their true
    distances, which the layer never saw."""
    from spotlight.model import rope_inv_freq
    from spotlight.positions import rotate_half

    engine = tiny_engine(spotlight=True, max_seq_len=128)
    tally, seen = AttentionTally(limit=1000), Selections(layer=1)
    decode_with(engine, 150, 3, tally, seen)
    inv_freq = rope_inv_freq(engine.args).double()  # (D / 2,)
    expected, true_distances = np.zeros(1000), np.zeros(1000)
    for (n, selected), (q, keys) in zip(seen.seen, seen.reads):
        assert n > engine.native_window and selected is not None
        (H, _, D), (Hkv, K) = q.shape, selected.shape
        for h in range(Hkv):
            group = q[h * H // Hkv : (h + 1) * H // Hkv, 0].double()  # (G, D)
            k = keys[h, selected[h]].double()  # (K, D) at their true positions
            angle = torch.from_numpy(np.arange(n - K, n) - selected[h]).double()[:, None] * inv_freq  # (K, D / 2)
            cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # (K, D)
            moved = k * cos + rotate_half(k) * sin  # (K, D): each key forward by its delta
            for rows, out in ((moved, expected), (k, true_distances)):
                np.add.at(out, selected[h], ((group @ rows.T / D ** 0.5).softmax(-1).sum(0) / H).numpy())
    np.testing.assert_allclose(tally.mass, expected, rtol=1e-4, atol=1e-8)
    assert np.abs(true_distances - expected).max() > 1e-3  # the two weighings differ here
    assert tally.steps == 3 and tally.mass.sum() == pytest.approx(3.0)


def test_observers_see_decode_steps_only_and_leave_the_policy_alone():
    engine = tiny_engine(spotlight=True)
    policy, meter = engine.policy, ReadMeter()
    context = engine.new_context()
    list(engine.stream(context, ids_of(100), greedy(1), observers=[meter]))
    assert meter.steps == [ReadStep(101, (101, engine.spotlight.budget(101)))]
    assert engine.policy is policy


@pytest.mark.gpu
def test_cuda_rows_are_host_copies_that_a_cpu_context_takes():
    from spotlight.cache import KVCache

    engine = tiny_engine(spotlight=True)
    args, words = engine.args, engine.policy.code_words
    gpu = Context(KVCache(args, 64, device="cuda", code_words=words))
    cpu = Context(KVCache(args, 64, code_words=words))
    host = filled(engine, 40).rows(0, 40)
    gpu.append_rows(host)
    rows = gpu.rows(0, 40)
    assert rows.k.device.type == "cpu" and rows.key_codes.dtype == np.uint64
    np.testing.assert_array_equal(rows.key_codes, host.key_codes)
    cpu.append_rows(rows)
    torch.testing.assert_close(cpu.rows(0, 40).k, host.k, rtol=0, atol=0)
    assert cpu.tokens == gpu.tokens == host.token_ids


def test_key_codes_grow_load_and_copy_out_on_the_host():
    from spotlight.cache import KeyCodes

    codes = KeyCodes((2, 3, 1, 8), torch.device("cpu"))
    words = np.arange(2 * 3 * 1 * 5, dtype=np.uint64).reshape(2, 3, 1, 5) + np.uint64(2**63)  # top bit set
    codes.load(0, torch.from_numpy(words.view(np.int64)))  # a span file's int64 tensor of the same words
    codes.load(5, words[..., :2])
    grown = codes.grown(16, 7)
    assert grown.data.shape == (2, 3, 1, 16) and grown.on_host and grown.words == 1
    np.testing.assert_array_equal(grown.host(0, 7), np.concatenate([words, words[..., :2]], axis=-1))
    copy = grown.host(0, 2)
    copy[:] = 0
    np.testing.assert_array_equal(grown.host(0, 2), words[..., :2])  # host() copies


def test_front_door_exports():
    import spotlight

    assert spotlight.__all__ == sorted(["AttentionTally", "Context", "Engine", "Fingerprints", "KVRows", "ReadMeter",
                                        "Stats", "Step", "StepObserver",
                                        "DEFAULT_MODEL", "InstalledModel", "installed_models", "packaged_model_names",
                                        "EncoderTraining", "TrainingProgress", "encoder_dirs", "trained_encoders",
                                        "release_freed_memory"])
    with pytest.raises(AttributeError, match="no attribute 'Policy'"):
        spotlight.Policy


def _compiled_kernels_built() -> bool:
    from kernels import attend_cpu, encode, planes, quant

    return planes.C_PLANES and encode.C_ENCODE and attend_cpu.C_ATTEND and quant.C_DEQUANTIZE


@pytest.mark.skipif(not _compiled_kernels_built(), reason="the compiled CPU kernels are not built (make setup)")
def test_a_spotlight_conversation_on_the_cpu_never_imports_numba():
    """The app's CPU path runs the compiled kernels (kernels/_quant.so): the in-window scan and the
    far scan on byte planes, the codes, attention, the quantized products, a stored span's summary.
    numba (~54 MiB resident, issue #20) is loaded only by a fallback, so a Spotlight conversation
    inside the window and past it, and the rows the cache sync stores, leave it unimported."""
    from conftest import TEST_HOME, TEST_MODEL

    code = ("import sys\nfrom pathlib import Path\nfrom bench.decode import essay_ids\n"
            "from spotlight.config import EngineConfig, SamplingConfig, SpotlightConfig\n"
            "from spotlight.engine import Engine\n"
            "e = Engine.load(EngineConfig(model_path=sys.argv[1]), Path(sys.argv[2]), SpotlightConfig())\n"
            "e.warm_up()\n"
            "for n in (600, e.native_window + 300):\n"
            "    ctx = e.new_context(n + 8)\n"
            "    steps = list(e.stream(ctx, essay_ids(e.tokenizer, n), SamplingConfig(max_new_tokens=4)))\n"
            "rows = ctx.rows(0, 1000)\n"
            "print(len(ctx.tokens) > e.native_window, rows.key_codes.shape[0] == e.args.n_layers, "
            "'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, TEST_MODEL, str(TEST_HOME)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert (out.returncode, out.stdout.strip().splitlines()[-1:]) == (0, ["True True False"]), out.stderr[-3000:]
