"""Two-level retrieval: span summaries and scores, ranged selection, the decode path. Issue #6, parts 3-4."""
import numpy as np
import pytest
import torch

import kernels
from conftest import tiny_pair
from kernels import cpu, ranges
from fakes import SelectionRecorder
from spotlight.attention import CodeSelector, SpotlightDecode
from spotlight.cache import KVCache
from spotlight.config import SpotlightConfig
from spotlight.hashing import EncoderSpec, Encoders
from spotlight.twolevel import SpanTable, TwoLevelConfig, code_summary

SINKS, WINDOW = 4, 64


def random_codes(rng, hkv=3, group=3, words=2, capacity=5000, distinct=0):
    q = rng.integers(0, 2**64, size=(hkv * group, words), dtype=np.uint64)
    if not distinct:
        return q, rng.integers(0, 2**64, size=(hkv, words, capacity), dtype=np.uint64)
    pool = rng.integers(0, 2**64, size=(distinct, words), dtype=np.uint64)
    return q, np.ascontiguousarray(pool[rng.integers(0, distinct, size=(hkv, capacity))].transpose(0, 2, 1))


def ranges_for(chosen_by_head, starts, ends, lo, hi, slots):
    """Every token outside the spans plus the chosen spans, as kernels.pick_ranges lays them out."""
    hkv = len(chosen_by_head)
    rl, rh, rc = np.zeros((hkv, slots), np.int64), np.zeros((hkv, slots), np.int64), np.zeros(hkv, np.int64)
    for h, chosen in enumerate(chosen_by_head):
        scanned = np.ones(hi - lo, bool)
        for s, (a, b) in enumerate(zip(starts, ends)):
            if s not in chosen:
                scanned[max(a, lo) - lo : max(min(b, hi) - lo, 0)] = False
        edges = np.flatnonzero(np.diff(np.r_[0, scanned.astype(np.int8), 0]))
        rc[h] = edges.size // 2
        rl[h, : rc[h]], rh[h, : rc[h]] = edges[::2] + lo, edges[1::2] + lo
    return rl, rh, rc


def ref_select_in(scores_row, allowed, n, k, sinks, window):
    """Forced tokens plus the top k allowed middle tokens by (score desc, index asc), ascending."""
    forced = set(range(min(sinks, n))) | set(range(max(n - window, 0), n))
    middle = sorted((t for t in allowed if t not in forced), key=lambda t: (-int(scores_row[t]), t))
    return sorted(forced | set(middle[:k]))


SEGMENTS = ([100, 700, 1500, 3000], [600, 1400, 2900, 4500])  # a gap before each, a chat tail after the last


@pytest.mark.parametrize("n,k,distinct", [(4800, 96, 0), (4800, 96, 4), (4800, 4000, 0), (4700, 1, 1), (200, 30, 0)])
@pytest.mark.parametrize("backend", ["cpu", "numpy"])
def test_every_span_chosen_equals_the_flat_scan(backend, n, k, distinct):
    q, codes = random_codes(np.random.default_rng(n + k), distinct=distinct)
    starts, ends = map(np.array, SEGMENTS)
    layout = kernels.selection_layout(n, k, SINKS, WINDOW)
    rl, rh, rc = ranges_for([set(range(4))] * 3, starts, ends, layout.sinks_end, layout.window_start, 9)
    with kernels.use_backend(backend):
        flat = kernels.score_select(q, codes, n, k, SINKS, WINDOW)
    got = ranges.ranges_score_select(q, codes, n, rl, rh, rc, k, SINKS, WINDOW) if backend == "cpu" else \
        ranges._ranges_numpy(q, codes, n, rl, rh, rc, layout, np.empty_like(flat))
    np.testing.assert_array_equal(got, flat)


@pytest.mark.parametrize("group", [3, 7])  # 7: Qwen2.5's group, scored in the scan's bit-plane form
@pytest.mark.parametrize("distinct", [0, 3])
def test_ranged_selection_equals_brute_force_over_the_scanned_tokens(distinct, group):
    rng = np.random.default_rng(distinct)
    q, codes = random_codes(rng, group=group, distinct=distinct)
    n, k = 4800, 200
    starts, ends = map(np.array, SEGMENTS)
    layout = kernels.selection_layout(n, k, SINKS, WINDOW)
    chosen = [{0}, {1, 3}, {2}]
    rl, rh, rc = ranges_for(chosen, starts, ends, layout.sinks_end, layout.window_start, 9)
    got = kernels.ranges_score_select(q, codes, n, rl, rh, rc, k, SINKS, WINDOW)
    scores = kernels.scores(q, codes, n)
    assert got.shape == (3, layout.size)
    for h in range(3):
        allowed = [t for i in range(rc[h]) for t in range(rl[h, i], rh[h, i])]
        assert got[h].tolist() == ref_select_in(scores[h], allowed, n, k, SINKS, WINDOW)


def test_tail_and_gaps_are_always_scanned():
    """Tokens outside spans (prompt before, chat turns after) win when they score best, whatever is chosen."""
    q, codes = random_codes(np.random.default_rng(1), hkv=1, group=1, words=1, capacity=5000)
    codes[0, 0, 4600:4620] = q[0, 0]  # perfect matches in the chat tail
    codes[0, 0, 50:55] = q[0, 0]  # ... and in the prompt gap before the first span
    starts, ends = map(np.array, SEGMENTS)
    layout = kernels.selection_layout(4800, 25, SINKS, WINDOW)
    rl, rh, rc = ranges_for([set()], starts, ends, layout.sinks_end, layout.window_start, 9)
    got = kernels.ranges_score_select(q, codes, 4800, rl, rh, rc, 25, SINKS, WINDOW)[0]
    assert set(range(4600, 4620)) | set(range(50, 55)) <= set(got.tolist())


def test_pick_ranges_covers_the_need_and_matches_numpy():
    rng = np.random.default_rng(2)
    starts, ends = np.arange(0, 10000, 500) + 40, np.arange(500, 10001, 500) + 20  # 20 spans, gaps of 20
    scores = rng.integers(0, 5, size=(3, starts.size)).astype(np.float64)  # ties: lower span first
    for need in [1, 900, 5000, 10**6]:
        got = [np.zeros((3, 41), np.int64), np.zeros((3, 41), np.int64), np.zeros(3, np.int64)]
        ref = [np.zeros((3, 41), np.int64), np.zeros((3, 41), np.int64), np.zeros(3, np.int64)]
        kernels.pick_ranges(scores, starts, ends, 4, 9900, need, *got)
        _numpy_pick(scores, starts, ends, 4, 9900, need, *ref)
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(a, b)
        for h in range(3):
            spans = [(got[0][h, i], got[1][h, i]) for i in range(got[2][h])]
            assert all(a < b for a, b in spans) and all(b < a for (_, b), (a, _) in zip(spans, spans[1:]))
            scanned = sum(b - a for a, b in spans)
            outside = 9896 - int(sum(min(e, 9900) - max(s, 4) for s, e in zip(starts, ends)))
            assert scanned >= min(need, 9896 - outside) + outside


def _numpy_pick(*args):
    ranges.pick_ranges(*args, jit=False)


def test_bit_counts_over_runs_longer_than_one_pass_add_every_tokens_bits():
    """bit_counts (numpy, COUNT_RUN tokens a pass) adds to `out` how many tokens of [lo, hi) set each bit."""
    rng = np.random.default_rng(8)
    codes = rng.integers(0, 2**64, size=(2, 2, 2 * ranges.COUNT_RUN + 100), dtype=np.uint64)  # (Hkv, W, N)
    lo, hi = 7, 2 * ranges.COUNT_RUN + 51
    bits = (codes[:, :, lo:hi, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)  # (Hkv, W, T, 64)
    expected = bits.sum(2).reshape(2, 128).astype(np.int32) + 5
    out = np.full((2, 128), 5, np.int32)
    np.testing.assert_array_equal(kernels.bit_counts(codes, lo, hi, out), expected)


def test_span_scores_are_the_mean_token_scores():
    q, codes = random_codes(np.random.default_rng(3), words=2)
    starts, ends = map(np.array, SEGMENTS)
    ones = np.zeros((3, 4, 128), np.int32)
    for s in range(4):
        kernels.bit_counts(codes, starts[s], ends[s], ones[:, s])
    scores = kernels.scores(q, codes, 5000)
    expected = np.array([[scores[h, a:b].mean() for a, b in zip(starts, ends)] for h in range(3)])
    np.testing.assert_allclose(kernels.span_scores(q, ones, ends - starts), expected, rtol=1e-12)
    np.testing.assert_allclose(ranges.span_scores(q, ones, ends - starts, jit=False), expected, rtol=1e-12)


# ----------------------------------------------------------------------------- summaries


def at_once(table: SpanTable, codes_by_layer, n: int) -> np.ndarray:
    """(L, Hkv, S, B) bit counts of every span's first-n tokens, computed from scratch."""
    out = np.zeros(table.ones.shape[:2] + (len(table), table.ones.shape[3]), np.int32)
    for layer, codes in enumerate(codes_by_layer):
        for s, (a, b) in enumerate(zip(table.starts, table.ends)):
            kernels.bit_counts(codes, int(a), int(min(b, n)), out[layer, :, s])
    return out


def test_summaries_updated_incrementally_equal_summaries_computed_at_once():
    rng = np.random.default_rng(4)
    codes = [rng.integers(0, 2**64, size=(3, 2, 6000), dtype=np.uint64) for _ in range(2)]
    table = SpanTable()
    table.bind(layers=2, kv_heads=3, words=2)
    table.add(10, 300)
    n = 0
    for step in [37, 200, 1, 1, 512, 3, 1000]:  # prefill chunks and single decode steps, per layer
        n += step
        if n > 700 and len(table) == 1:
            table.add(320, 650)  # registered after its tokens were summarized: recounted
            table.add(650, 4000)
        for layer in range(2):
            table.sync(layer, codes[layer], n)
        np.testing.assert_array_equal(table.ones[:, :, : len(table)], at_once(table, codes, n))
    table.truncate(1200)  # regenerate: the last span is clipped, tokens after 1200 change
    codes[0][:, :, 1200:] = rng.integers(0, 2**64, size=(3, 2, 4800), dtype=np.uint64)
    table.add(1500, 1700)
    for layer in range(2):
        table.sync(layer, codes[layer], 1800)
    assert table.ends.tolist() == [300, 650, 1200, 1700]
    np.testing.assert_array_equal(table.ones[:, :, : len(table)], at_once(table, codes, 1800))


def test_spans_must_be_ascending_and_disjoint():
    table = SpanTable()
    table.add(0, 10)
    with pytest.raises(ValueError, match="start at or after 10"):
        table.add(5, 20)
    with pytest.raises(ValueError, match="non-empty"):
        table.add(30, 30)
    for i in range(200):  # growth keeps earlier spans
        table.add(10 + 2 * i, 11 + 2 * i)
    assert len(table) == 201 and table.starts[:3].tolist() == [0, 10, 12]


# ----------------------------------------------------------------------------- the selector


PROMPT = [(i * 37) % 211 for i in range(600)]
FLAT, TWO_LEVEL = 10**9, 0  # SpotlightConfig.two_level_from: never, always


def run(model, selector, spans, steps=3, two_level_from=TWO_LEVEL):
    """Prefill PROMPT, register spans, decode `steps` tokens through SpotlightDecode:
    (logits, selections per step, which path each step's layers took)."""
    config = SpotlightConfig(dense_layers=(), dense_below=0, sinks=4, window=16, ratio=0.05, k_min=8, bits=128,
                             two_level_from=two_level_from)
    policy = SpotlightDecode(config, selector)
    recorder = SelectionRecorder()
    cache = KVCache(model.args, 64, code_words=2)
    logits, paths = [], []
    with torch.inference_mode():
        model(torch.tensor(PROMPT), cache, policy)
        for a, b in spans:
            cache.spans.add(a, b)
        for token in [5, 17, 99][:steps]:
            before = policy.selections["two_level"]
            logits.append(model(torch.tensor([token]), cache, policy, observers=[recorder]))
            recorder.on_step(cache.length)  # the decode loop's call (spotlight/generate.py)
            two_level = policy.selections["two_level"] - before  # sparse layers that picked spans first
            paths.append({layer: two_level == len(recorder.steps[-1]) for layer in recorder.steps[-1]})
    return torch.stack(logits), recorder.steps, paths


def encoders_and_model():
    _, model = tiny_pair("llama", seed=0, max_position_embeddings=4096)
    return Encoders(EncoderSpec.for_model(model.args, 128), seed=0), model


def test_two_level_with_every_span_chosen_equals_the_flat_scan_through_the_decode_path():
    encoders, model = encoders_and_model()
    spans = [(20, 200), (200, 410), (450, 560)]
    flat_logits, flat_sel, flat_paths = run(model, CodeSelector(encoders), spans, two_level_from=FLAT)
    every = CodeSelector(encoders, TwoLevelConfig(multiple=1000.0))
    logits, sel, paths = run(model, every, spans)
    assert flat_paths == [{0: False, 1: False}] * 3 and paths == [{0: True, 1: True}] * 3
    torch.testing.assert_close(logits, flat_logits, rtol=0, atol=0)
    for a, b in zip(sel, flat_sel):
        assert a.keys() == b.keys() and all(np.array_equal(a[layer], b[layer]) for layer in a)


def test_two_level_keeps_the_budget_and_scans_only_chosen_spans():
    encoders, model = encoders_and_model()
    spans = [(20 + 50 * i, 70 + 50 * i) for i in range(10)]  # [20, 520) in 10 spans; tail 520..
    _, flat_sel, _ = run(model, CodeSelector(encoders), spans, steps=1, two_level_from=FLAT)
    _, sel, paths = run(model, CodeSelector(encoders, TwoLevelConfig(multiple=1.0)), spans, steps=1)
    assert paths == [{0: True, 1: True}]
    n = len(PROMPT) + 1
    for layer, idx in sel[0].items():
        assert idx.shape == flat_sel[0][layer].shape, "same K as the flat selection"
        for row in idx.tolist():
            assert row == sorted(set(row)) and set(range(4)) <= set(row) and set(range(n - 16, n)) <= set(row)
            spans_used = {(t - 20) // 50 for t in row if 20 <= t < 520}
            retrieved = max(8, int(0.05 * n))
            assert len(spans_used) <= -(-retrieved // 50) + 1, "only the spans the summary picked"


def test_below_the_threshold_or_without_spans_the_flat_scan_runs():
    encoders, model = encoders_and_model()
    spans = [(20 + 50 * i, 70 + 50 * i) for i in range(10)]
    flat_logits, _, _ = run(model, CodeSelector(encoders), spans, two_level_from=FLAT)
    selector = CodeSelector(encoders, TwoLevelConfig(multiple=1.0))
    n = len(PROMPT) + 1  # the first decode step's context
    logits, _, paths = run(model, selector, spans, two_level_from=n + 1)  # reached at the second step
    assert paths == [{0: False, 1: False}, {0: True, 1: True}, {0: True, 1: True}]
    torch.testing.assert_close(logits[0], flat_logits[0], rtol=0, atol=0)
    logits, _, paths = run(model, selector, [])
    assert paths == [{0: False, 1: False}] * 3
    torch.testing.assert_close(logits, flat_logits, rtol=0, atol=0)


def test_summaries_kept_through_decode_equal_summaries_computed_at_once():
    """The cache's table, synced layer by layer as prefill and decode steps append keys, equals
    per-span bit counts computed from scratch; the last span grows with the decoded tokens."""
    encoders, model = encoders_and_model()
    selector = CodeSelector(encoders, TwoLevelConfig(multiple=1.0))
    config = SpotlightConfig(dense_layers=(), dense_below=0, sinks=4, window=16, k_min=8, bits=128, two_level_from=0)
    policy = SpotlightDecode(config, selector)
    cache = KVCache(model.args, 64, code_words=2)
    with torch.inference_mode():
        model(torch.tensor(PROMPT[:300]), cache, policy)
        cache.spans.add(0, 150)
        model(torch.tensor(PROMPT[300:]), cache, policy)
        cache.spans.add(150, 580)
        cache.spans.add(580, 700)  # runs ahead of the tokens: counted as they arrive
        for token in range(120):
            model(torch.tensor([token]), cache, policy)
    table = cache.spans
    assert table.summarized.tolist() == [cache.length] * 2  # each layer synced at its last step
    np.testing.assert_array_equal(table.ones[:, :, :3], at_once(table, cache.codes, cache.length))


def test_truncating_the_cache_truncates_its_spans():
    encoders, model = encoders_and_model()
    cache = KVCache(model.args, 64, code_words=2)
    policy = SpotlightDecode(SpotlightConfig(bits=128), CodeSelector(encoders))
    with torch.inference_mode():
        model(torch.tensor(PROMPT), cache, policy)
    for a, b in [(0, 100), (100, 300), (300, 500)]:
        cache.spans.add(a, b)
    cache.truncate(200)
    assert (cache.spans.starts.tolist(), cache.spans.ends.tolist()) == ([0, 100], [100, 200])
    cache.spans.cover(100, 200)  # already a span: kept
    cache.spans.cover(150, 180)  # an older layout of these tokens: replaced
    assert (cache.spans.starts.tolist(), cache.spans.ends.tolist()) == ([0, 100, 150], [100, 150, 180])


def test_a_known_summary_is_taken_as_is_and_matches_the_counted_one():
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 2**64, size=(2, 3, 2, 900), dtype=np.uint64)  # (L, Hkv, W, N)
    loaded, counted = SpanTable(), SpanTable()
    for table in (loaded, counted):
        table.bind(layers=2, kv_heads=3, words=2)
    for a, b in [(0, 400), (400, 900)]:
        loaded.add(a, b, code_summary(np.ascontiguousarray(codes[..., a:b])))  # as restore does
        counted.add(a, b)
    assert loaded.summarized.tolist() == [900, 900]  # nothing left to count
    for layer in range(2):
        counted.sync(layer, codes[layer], 900)
    np.testing.assert_array_equal(loaded.ones[:, :, :2], counted.ones[:, :, :2])


@pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")
def test_ranges_must_be_inside_the_middle_and_hold_the_budget():
    q, codes = random_codes(np.random.default_rng(5))
    rl, rh, rc = np.array([[4, 0]] * 3), np.array([[50, 0]] * 3), np.ones(3, np.int64)
    with pytest.raises(ValueError, match="hold >= 100 tokens"):
        kernels.ranges_score_select(q, codes, 4800, rl, rh, rc, 100, SINKS, WINDOW)
    with pytest.raises(ValueError, match="misplaced"):
        kernels.ranges_score_select(q, codes, 4800, rl - 4, rh, rc, 10, SINKS, WINDOW)


@pytest.mark.gpu
@pytest.mark.parametrize("distinct", [0, 3])
def test_cuda_ranged_selection_equals_cpu(distinct):
    import cupy

    q, codes = random_codes(np.random.default_rng(6 + distinct), distinct=distinct)
    starts, ends = map(np.array, SEGMENTS)
    layout = kernels.selection_layout(4800, 150, SINKS, WINDOW)
    for chosen in ([{0}, {1, 3}, {2}], [set(range(4))] * 3):
        rl, rh, rc = ranges_for(chosen, starts, ends, layout.sinks_end, layout.window_start, 9)
        expected = kernels.ranges_score_select(q, codes, 4800, rl, rh, rc, 150, SINKS, WINDOW)
        dq, dk = cupy.asarray(q), cupy.asarray(codes)
        got = kernels.ranges_score_select(dq, dk, 4800, rl, rh, rc, 150, SINKS, WINDOW,
                                          scratch=kernels.make_scratch(dq, dk))
        np.testing.assert_array_equal(cupy.asnumpy(got), expected)
