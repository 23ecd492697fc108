"""Retrieval kernels: every backend against brute-force references, one test body per backend.

Backends: "cpu" (numba), "numpy" (the pure-numpy fallback) and "cuda" (gpu marker: skipped
without a GPU). Inputs are built on the host with numpy and moved to the backend's device;
results come back to the host and are compared whole, exactly.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import kernels
from kernels import cpu

ROOT = Path(__file__).resolve().parent.parent
CU_SOURCES = sorted((ROOT / "kernels").glob("*.cu"))
SINKS, WINDOW = 4, 64


@dataclass(frozen=True)
class Backend:
    name: str

    def put(self, a: np.ndarray):
        if self.name != "cuda":
            return a
        import cupy

        return cupy.asarray(a)

    def get(self, a) -> np.ndarray:
        if self.name != "cuda":
            return np.asarray(a)
        import cupy

        return cupy.asnumpy(a)


@pytest.fixture(params=[
    pytest.param("cpu", marks=pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")),
    "numpy",
    pytest.param("cuda", marks=pytest.mark.gpu),
])
def backend(request):
    with kernels.use_backend(request.param):
        yield Backend(request.param)


# ----------------------------------------------------------------------------- references


def ref_pack(x: np.ndarray) -> np.ndarray:
    """Bit j of word w is x[..., 64 w + j] > 0, one Python int per word."""
    flat = x.reshape(-1, x.shape[-1])
    words = -(-x.shape[-1] // 64)
    out = np.zeros((flat.shape[0], words), np.uint64)
    for i, row in enumerate(flat):
        for w in range(words):
            out[i, w] = sum(1 << j for j, v in enumerate(row[64 * w : 64 * w + 64]) if v > 0)
    return out.reshape(x.shape[:-1] + (words,))


def ref_scores(q: np.ndarray, k: np.ndarray, n: int) -> np.ndarray:
    """Matching bits: sum over the group's query heads and all words of 64 - popcount(q ^ k)."""
    hkv, words, _ = k.shape
    group = q.shape[0] // hkv
    out = np.zeros((hkv, n), np.int64)
    for h in range(hkv):
        for g in range(group):
            for w in range(words):
                out[h] += 64 - np.bitwise_count(q[h * group + g, w] ^ k[h, w, :n]).astype(np.int64)
    return out


def ref_select(s: np.ndarray, k: int, sinks: int, window: int) -> np.ndarray:
    """Forced sinks and window, plus the first k others sorted by (-score, index); ascending."""
    hkv, n = s.shape
    forced = set(range(min(sinks, n))) | set(range(max(n - window, 0), n))
    rows = []
    for h in range(hkv):
        others = sorted((t for t in range(n) if t not in forced), key=lambda t: (-int(s[h, t]), t))
        rows.append(sorted(forced | set(others[:k])))
    return np.array(rows, np.int32).reshape(hkv, -1)


def random_codes(rng, hkv: int, group: int, words: int, capacity: int, distinct: int = 0):
    """(q_codes (H, W), k_codes (Hkv, W, N)); distinct > 0 draws keys from that few codes (ties)."""
    q = rng.integers(0, 2**64, size=(hkv * group, words), dtype=np.uint64)
    if not distinct:
        return q, rng.integers(0, 2**64, size=(hkv, words, capacity), dtype=np.uint64)
    pool = rng.integers(0, 2**64, size=(distinct, words), dtype=np.uint64)
    k = pool[rng.integers(0, distinct, size=(hkv, capacity))]  # (Hkv, N, W)
    return q, np.ascontiguousarray(k.transpose(0, 2, 1))  # (Hkv, W, N)


# (Hkv, G, W, n): odd sizes; few distinct (G, W) pairs keep the JIT's cold compile short. G = 7
# (Qwen2.5's geometry) takes the CPU scan's bit-plane form (kernels.cpu.query_words).
CASES = [(1, 1, 1, 1), (2, 3, 2, 13), (3, 3, 2, 255), (2, 4, 4, 1000), (1, 4, 3, 4097), (3, 1, 1, 300),
         (2, 7, 2, 777)]


# ----------------------------------------------------------------------------- pack


def test_pack_bit_order_known_vectors(backend):
    x = np.zeros((2, 70), np.float32)
    x[0, [0, 3, 63, 64, 69]] = [1.0, 0.5, 2.0, 1e-30, 7.0]
    x[1, [1, 2, 65]] = [-1.0, np.inf, 3.0]
    x[1, [5, 6, 7]] = [np.nan, -0.0, -np.inf]  # none of these is > 0
    expected = np.array([[1 | 8 | 1 << 63, 1 | 1 << 5], [4, 2]], np.uint64)
    np.testing.assert_array_equal(backend.get(kernels.pack(backend.put(x))), expected)


@pytest.mark.parametrize("bits", [1, 63, 64, 65, 128, 200])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_pack_matches_reference(backend, bits, dtype):
    x = np.random.default_rng(bits).standard_normal((3, 5, bits)).astype(dtype)
    np.testing.assert_array_equal(backend.get(kernels.pack(backend.put(x))), ref_pack(x))


def test_pack_out_buffer_is_reused(backend):
    rng = np.random.default_rng(0)
    out = backend.put(np.zeros((4, 2), np.uint64))
    for _ in range(2):
        x = rng.standard_normal((4, 128)).astype(np.float32)
        assert kernels.pack(backend.put(x), out=out) is out
        np.testing.assert_array_equal(backend.get(out), ref_pack(x))


@pytest.mark.parametrize("bits", [64, 100, 128])
def test_pack_into_incremental_equals_all_at_once(backend, bits):
    rng = np.random.default_rng(bits)
    hkv, n, capacity = 3, 300, 320
    keys = rng.standard_normal((hkv, n, bits)).astype(np.float32)
    expected = np.zeros((hkv, -(-bits // 64), capacity), np.uint64)
    expected[:, :, :n] = ref_pack(keys).transpose(0, 2, 1)
    buffer = backend.put(np.zeros_like(expected))
    start = 0
    for count in [1, 7, 100, 0, 64, 128]:
        kernels.pack_into(backend.put(np.ascontiguousarray(keys[:, start : start + count])), buffer, start)
        start += count
    assert start == n
    np.testing.assert_array_equal(backend.get(buffer), expected)


def test_pack_torch_cpu_tensors_match_numpy():
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, 130)
    expected = ref_pack(x.numpy())
    np.testing.assert_array_equal(kernels.pack(x), expected)
    np.testing.assert_array_equal(kernels.pack(x.to(torch.bfloat16)), ref_pack(x.to(torch.bfloat16).float().numpy()))
    out = torch.zeros(2, 3, 3, dtype=torch.uint64)
    kernels.pack(x, out=out)
    np.testing.assert_array_equal(out.numpy(), expected)


# ----------------------------------------------------------------------------- scores


@pytest.mark.parametrize("hkv,group,words,n", CASES)
def test_scores_equal_brute_force(backend, hkv, group, words, n):
    q, k = random_codes(np.random.default_rng(n), hkv, group, words, n + 5)
    got = backend.get(kernels.scores(backend.put(q), backend.put(k), n))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ref_scores(q, k, n))


def test_scores_count_padding_bits_as_matches(backend):
    """Codes of 100-bit vectors: the 28 zero padding bits match for every token (Python-int check)."""
    rng = np.random.default_rng(7)
    q = ref_pack(rng.standard_normal((3, 100)).astype(np.float32))  # (3, 2): G = 3 query heads
    k = ref_pack(rng.standard_normal((1, 9, 100)).astype(np.float32)).transpose(0, 2, 1).copy()  # (1, 2, 9)
    expected = [[sum(64 - (int(q[g, w]) ^ int(k[0, w, t])).bit_count() for g in range(3) for w in range(2))
                 for t in range(9)]]
    np.testing.assert_array_equal(backend.get(kernels.scores(backend.put(q), backend.put(k), 9)), expected)


@pytest.mark.parametrize("group,planes", [(5, 3), (8, 4), (16, 5)])
def test_scores_of_large_groups_equal_brute_force_in_plane_form(backend, group, planes):
    """From G = 5 the CPU counts the group's query words into G.bit_length() planes; 100-bit codes,
    so the padding bits (clear in every query and key) count as matches there too."""
    rng = np.random.default_rng(group)
    q = ref_pack(rng.standard_normal((2 * group, 100)).astype(np.float32))  # (H, 2), Hkv = 2
    k = ref_pack(rng.standard_normal((2, 301, 100)).astype(np.float32)).transpose(0, 2, 1).copy()  # (2, 2, 301)
    if backend.name == "cpu":
        assert cpu.query_words(q[None], 2, group, 2).shape == (2, 1, planes * 2 + 1)
    np.testing.assert_array_equal(backend.get(kernels.scores(backend.put(q), backend.put(k), 300)), ref_scores(q, k, 300))


def test_scores_out_buffer_is_reused(backend):
    rng = np.random.default_rng(1)
    out = backend.put(np.zeros((2, 50), np.int32))
    for _ in range(2):
        q, k = random_codes(rng, 2, 3, 2, 64)
        assert kernels.scores(backend.put(q), backend.put(k), 50, out=out) is out
        np.testing.assert_array_equal(backend.get(out), ref_scores(q, k, 50))


@pytest.mark.parametrize("hkv,group,words,n", CASES[1:])
def test_scores_blocks_score_each_block_with_its_own_query(backend, hkv, group, words, n):
    """Block r of [bounds[r], bounds[r + 1]) scored against q_codes[r]; 0 outside the blocks."""
    rng = np.random.default_rng(n + 1)
    blocks = 3
    q = rng.integers(0, 2**64, size=(blocks, hkv * group, words), dtype=np.uint64)  # (R, H, W)
    _, k = random_codes(rng, hkv, group, words, n + 5)
    bounds = [min(n, 1), n // 3, n // 3, n - 1]  # an empty block among them
    expected = np.zeros((hkv, n), np.int64)
    for r in range(blocks):
        expected[:, bounds[r] : bounds[r + 1]] = ref_scores(q[r], k, n)[:, bounds[r] : bounds[r + 1]]
    got = backend.get(kernels.scores_blocks(backend.put(q), backend.put(k), n, bounds))
    np.testing.assert_array_equal(got, expected)


def test_scores_blocks_refuse_bounds_that_do_not_ascend():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**64, size=(2, 2, 1), dtype=np.uint64)
    _, k = random_codes(rng, 1, 2, 1, 20)
    with pytest.raises(ValueError, match="bounds must ascend within"):
        kernels.scores_blocks(q, k, 20, [0, 15, 10])


# ----------------------------------------------------------------------------- select


def budgets(n: int) -> list[int]:
    return sorted({0, 1, 3, n // 10, n // 2, n, n + 100})


def check_selection(got: np.ndarray, s: np.ndarray, k: int, sinks: int, window: int) -> None:
    n = s.shape[1]
    layout = kernels.selection_layout(n, k, sinks, window)
    assert got.dtype == np.int32 and got.shape == (s.shape[0], layout.size)
    forced = np.r_[0 : min(sinks, n), max(n - window, 0) : n]
    for row in got:
        assert np.all(np.diff(row) > 0), "ascending and unique"
        assert np.isin(forced, row).all(), "sinks and window always selected"
    np.testing.assert_array_equal(got, ref_select(s, k, sinks, window))


@pytest.mark.parametrize("hkv,group,words,n", CASES)
@pytest.mark.parametrize("distinct", [0, 3, 1])  # random codes, few distinct codes, all equal
def test_select_and_score_select_equal_brute_force(backend, hkv, group, words, n, distinct):
    q, k = random_codes(np.random.default_rng(n + distinct), hkv, group, words, n + 3, distinct)
    s = ref_scores(q, k, n)
    dq, dk = backend.put(q), backend.put(k)
    scratch = kernels.make_scratch(dq, dk)
    for budget in budgets(n):
        check_selection(backend.get(kernels.select(backend.put(s.astype(np.int32)), budget, SINKS, WINDOW)),
                        s, budget, SINKS, WINDOW)
        fused = kernels.score_select(dq, dk, n, budget, SINKS, WINDOW, scratch=scratch)
        check_selection(backend.get(fused), s, budget, SINKS, WINDOW)


def ref_select_fast(s: np.ndarray, k: int, sinks: int, window: int) -> np.ndarray:
    """ref_select for long rows: the same order, (-score, index), by np.lexsort."""
    hkv, n = s.shape
    layout = kernels.selection_layout(n, k, sinks, window)
    middle = np.arange(layout.sinks_end, layout.window_start)
    rows = []
    for h in range(hkv):
        best = middle[np.lexsort((middle, -s[h, middle].astype(np.int64)))[: layout.retrieved]]
        rows.append(np.sort(np.r_[0 : layout.sinks_end, best, layout.window_start : n]))
    return np.array(rows, np.int32)


@pytest.mark.parametrize("distinct", [0, 40, 3])  # random codes, few distinct codes (ties)
@pytest.mark.parametrize("threads", [1, 2])
def test_score_select_from_a_sampled_bound_equals_brute_force(backend, distinct, threads):
    """From a 16K-token middle and 2,048 selected tokens on, the scan starts from a bound sampled
    from the codes (kernels/cpu.py `_sample_bound`); the selection must not change."""
    n = cpu.SAMPLE_FROM + 3001
    q, k = random_codes(np.random.default_rng(distinct + threads), 3, 3, 2, n + 5, distinct)
    s = ref_scores(q, k, n)
    before = cpu.threads()
    try:
        kernels.set_threads(min(threads, cpu.most_threads()) if cpu.HAVE_NUMBA else 1)
        scratch = kernels.make_scratch(backend.put(q), backend.put(k))
        for budget in [cpu.SAMPLE_K, n // 10, n // 2, n - 300]:
            got = backend.get(kernels.score_select(backend.put(q), backend.put(k), n, budget, SINKS, 256,
                                                   scratch=scratch))
            np.testing.assert_array_equal(got, ref_select_fast(s, budget, SINKS, 256))
    finally:
        kernels.set_threads(before)


def blocks_of(layout, blocks: int) -> list[int]:
    """R + 1 ascending bounds cutting the middle of `layout` into `blocks` (an empty one among them)."""
    lo, hi = layout.sinks_end, layout.window_start
    cuts = [lo + (hi - lo) * i // (blocks - 1) for i in range(blocks - 1)]
    return [lo] + cuts[1:] + [cuts[-1], hi]  # block R - 2 is empty


def ref_scores_blocks(q: np.ndarray, k: np.ndarray, n: int, bounds) -> np.ndarray:
    """Scores of token t by q[r] where bounds[r] <= t < bounds[r + 1], 0 elsewhere."""
    s = np.zeros((k.shape[0], n), np.int64)
    for r in range(len(q)):
        s[:, bounds[r] : bounds[r + 1]] = ref_scores(q[r], k, n)[:, bounds[r] : bounds[r + 1]]
    return s


@pytest.mark.parametrize("n, budget", [(300, 40), (cpu.SAMPLE_FROM + 3001, cpu.SAMPLE_K), (cpu.SAMPLE_FROM + 3001, 9000)])
@pytest.mark.parametrize("threads", [1, 2])
def test_score_select_blocks_equals_brute_force_over_the_block_scores(backend, n, budget, threads):
    """The fused folded scan (select_far's): each block's tokens scored with its own query codes,
    from a sampled bound on long middles (two sample runs per block); the selection is the
    brute-force one over those scores."""
    rng = np.random.default_rng(n + budget + threads)
    _, k = random_codes(rng, 2, 3, 2, n + 5)
    layout = kernels.selection_layout(n, budget, SINKS, 256)
    q = rng.integers(0, 2**64, size=(6, 6, 2), dtype=np.uint64)  # (R, H, W)
    bounds = blocks_of(layout, len(q))
    before = cpu.threads()
    try:
        kernels.set_threads(min(threads, cpu.most_threads()) if cpu.HAVE_NUMBA else 1)
        scratch = kernels.make_scratch(backend.put(q[0]), backend.put(k))
        got = backend.get(kernels.score_select_blocks(backend.put(q), backend.put(k), n, bounds, budget, SINKS, 256,
                                                      scratch=scratch))
    finally:
        kernels.set_threads(before)
    np.testing.assert_array_equal(got, ref_select_fast(ref_scores_blocks(q, k, n, bounds), budget, SINKS, 256))


def test_one_scratch_serves_a_changing_number_of_blocks(backend):
    """Past the window the blocks grow by one every fold tokens and a new conversation starts
    with fewer: one scratch (whose query-word buffer grows) gives each call the fresh-scratch
    selection, at G = 7 (the bit-plane form)."""
    rng = np.random.default_rng(7)
    n, budget = 3000, 200
    _, k = random_codes(rng, 2, 7, 2, n)
    layout = kernels.selection_layout(n, budget, SINKS, 256)
    scratch = kernels.make_scratch(backend.put(rng.integers(0, 2**64, size=(14, 2), dtype=np.uint64)), backend.put(k))
    for blocks in (2, 5, 9, 3, 5):
        q = rng.integers(0, 2**64, size=(blocks, 14, 2), dtype=np.uint64)  # (R, H, W)
        bounds = blocks_of(layout, blocks)
        got = backend.get(kernels.score_select_blocks(backend.put(q), backend.put(k), n, bounds, budget, SINKS, 256,
                                                      scratch=scratch))
        np.testing.assert_array_equal(got, ref_select_fast(ref_scores_blocks(q, k, n, bounds), budget, SINKS, 256))


def test_score_select_blocks_refuses_blocks_that_leave_part_of_the_middle_out():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 2**64, size=(2, 2, 1), dtype=np.uint64)
    _, k = random_codes(rng, 1, 2, 1, 100)
    with pytest.raises(ValueError, match=r"bounds \[4, 50, 90\] must cover the middle \[4, 92\)"):
        kernels.score_select_blocks(q, k, 100, [4, 50, 90], 10, 4, 8)


needs_planes = pytest.mark.skipif(not kernels.planes_fit(14, 2, 2), reason="kernels/scan.c not built (AVX2)")


@needs_planes
@pytest.mark.parametrize("group, words", [(1, 1), (3, 2), (7, 2), (8, 2), (15, 1), (4, 4)])  # 8+: one plane at a time
@pytest.mark.parametrize("n, budget, blocks", [(300, 40, 3), (5000, 700, 1), (cpu.SAMPLE_FROM + 3001, 2000, 6)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_byte_plane_scan_selects_what_the_folded_scan_selects(group, words, n, budget, blocks, threads):
    """kernels/scan.c over the codes' byte planes: the folded scan's selection, index for index, with
    ties (repeated codes), blocks whose bounds are no multiple of its 32-token vectors, and a middle
    shorter than a vector's multiple."""
    rng = np.random.default_rng(group * 100 + words + n + threads)
    _, k = random_codes(rng, 2, group, words, n + 5)
    k[:, :, 100:160] = k[:, :, 40:100]  # ties
    q = rng.integers(0, 2**64, size=(blocks, 2 * group, words), dtype=np.uint64)  # (R, H, W)
    layout = kernels.selection_layout(n, budget, SINKS, 256)
    bounds = blocks_of(layout, blocks) if blocks > 1 else [layout.sinks_end, layout.window_start]
    planes = np.zeros((2, 8 * words, n + 5), np.uint8)
    kernels.write_planes(k, 0, n, planes)
    before = cpu.threads()
    try:
        kernels.set_threads(threads)
        got = kernels.planes_select_blocks(q, planes, n, bounds, budget, SINKS, 256)
    finally:
        kernels.set_threads(before)
    np.testing.assert_array_equal(got, ref_select_fast(ref_scores_blocks(q, k, n, bounds), budget, SINKS, 256))


@needs_planes
def test_the_byte_plane_scan_takes_blocks_that_reach_into_the_sinks_and_the_window():
    """Bounds from 0 to n (blocks reaching past the middle at both ends) select what the folded scan does."""
    rng = np.random.default_rng(12)
    n, budget = 3000, 300
    _, k = random_codes(rng, 2, 7, 2, n)
    q = rng.integers(0, 2**64, size=(3, 14, 2), dtype=np.uint64)  # (R, H, W)
    bounds = [0, 1000, 2500, n]
    planes = np.zeros((2, 16, n), np.uint8)
    kernels.write_planes(k, 0, n, planes)
    got = kernels.planes_select_blocks(q, planes, n, bounds, budget, SINKS, 256)
    np.testing.assert_array_equal(got, kernels.score_select_blocks(q, k, n, bounds, budget, SINKS, 256))


@needs_planes
def test_the_byte_plane_scan_selects_right_where_an_even_sample_of_the_scores_misleads():
    """Every 9th token of the middle (where an even sample of ~4,096 scores falls) holds the query's own
    code and the others random ones: the sample sees only top scores, so the bound it sets passes fewer
    tokens than are retrieved, and the scan must fall back to every token and still pick exactly."""
    rng = np.random.default_rng(9)
    n, budget = 40_000, 10_000
    layout = kernels.selection_layout(n, budget, SINKS, 256)
    q = rng.integers(0, 2**64, size=(1, 2, 2), dtype=np.uint64)  # (R, H, W): one query per KV head
    _, k = random_codes(rng, 2, 1, 2, n)
    stride = (layout.window_start - layout.sinks_end) // 4096
    for h in range(2):
        k[h, :, layout.sinks_end : layout.window_start : stride] = q[0, h][:, None]
    planes = np.zeros((2, 16, n), np.uint8)
    kernels.write_planes(k, 0, n, planes)
    bounds = [layout.sinks_end, layout.window_start]
    got = kernels.planes_select_blocks(q, planes, n, bounds, budget, SINKS, 256)
    np.testing.assert_array_equal(got, ref_select_fast(ref_scores_blocks(q, k, n, bounds), budget, SINKS, 256))


@needs_planes
@pytest.mark.parametrize("group, words", [(1, 2), (3, 2), (7, 2), (8, 2), (15, 1), (4, 4)])
def test_the_byte_plane_scan_sums_full_agreement_without_overflow(group, words):
    """Every query code of a head the same and keys that agree with it on every bit, on none, or on
    some: scan.c adds up to 8 planes' agreements in uint8 before widening (8 G per plane at most), so
    the extreme scores (G * 64 W and 0) must come out exact and rank first and last."""
    rng = np.random.default_rng(group * 10 + words)
    n, budget, hkv = 2000, 300, 2
    code = rng.integers(0, 2**64, size=(hkv, words), dtype=np.uint64)  # one code per KV head
    q = np.repeat(code, group, axis=0)[None]  # (1, H, W): the G query codes of a head all equal
    k = rng.integers(0, 2**64, size=(hkv, words, n), dtype=np.uint64)
    k[:, :, 100:1700:9] = code[:, :, None]  # full agreement: score G * 64 W
    k[:, :, 105:1700:9] = ~code[:, :, None]  # none: score 0
    planes = np.zeros((hkv, 8 * words, n), np.uint8)
    kernels.write_planes(k, 0, n, planes)
    layout = kernels.selection_layout(n, budget, SINKS, 256)
    bounds = [layout.sinks_end, layout.window_start]
    got = kernels.planes_select_blocks(q, planes, n, bounds, budget, SINKS, 256)
    scores = ref_scores_blocks(q, k, n, bounds)
    assert scores[:, 100:1700:9].min() == group * 64 * words and scores[:, 105:1700:9].max() == 0
    np.testing.assert_array_equal(got, ref_select_fast(scores, budget, SINKS, 256))


@needs_planes
def test_byte_planes_hold_byte_j_of_every_code_in_row_j():
    rng = np.random.default_rng(3)
    _, k = random_codes(rng, 3, 1, 2, 700)
    planes = np.full((3, 16, 710), 7, np.uint8)
    kernels.write_planes(k, 100, 650, planes)
    for h, w, j, t in [(0, 0, 0, 100), (2, 1, 7, 649), (1, 1, 3, 333)]:
        assert planes[h, 8 * w + j, t] == (int(k[h, w, t]) >> (8 * j)) & 0xFF
    assert (planes[:, :, :100] == 7).all() and (planes[:, :, 650:] == 7).all()  # tokens outside untouched
    expected = k[:, :, 100:650].view(np.uint8).reshape(3, 2, 550, 8).transpose(0, 1, 3, 2).reshape(3, 16, 550)
    np.testing.assert_array_equal(planes[:, :, 100:650], expected)


@needs_planes
def test_byte_planes_refuse_shapes_that_do_not_match_with_a_message():
    rng = np.random.default_rng(5)
    _, k = random_codes(rng, 2, 7, 2, 400)
    with pytest.raises(ValueError, match=r"planes must be C-contiguous uint8 \(2, 16, Pcap\), got int16"):
        kernels.write_planes(k, 0, 100, np.zeros((2, 16, 400), np.int16))
    with pytest.raises(ValueError, match=r"tokens \[0, 500\) must lie within the codes' 400 and the planes' 400"):
        kernels.write_planes(k, 0, 500, np.zeros((2, 16, 400), np.uint8))
    q = rng.integers(0, 2**64, size=(2, 14, 2), dtype=np.uint64)  # (R, H, W)
    layout = kernels.selection_layout(300, 40, SINKS, 64)
    bounds = blocks_of(layout, 2)
    with pytest.raises(ValueError, match=r"planes uint8 \(2, 8, 400\) do not hold 300 tokens of codes"):
        kernels.planes_select_blocks(q, np.zeros((2, 8, 400), np.uint8), 300, bounds, 40, SINKS, 64)
    with pytest.raises(ValueError, match=r"must cover the middle"):
        kernels.planes_select_blocks(q, np.zeros((2, 16, 400), np.uint8), 300, [10, 100, 200], 40, SINKS, 64)
    wide = rng.integers(0, 2**64, size=(2, 16 * 2, 2), dtype=np.uint64)  # G = 16: more than scan.c takes
    with pytest.raises(ValueError, match="does not take this geometry: use score_select_blocks"):
        kernels.planes_select_blocks(wide, np.zeros((2, 16, 400), np.uint8), 300, bounds, 40, SINKS, 64)


def test_score_select_scans_again_a_head_its_sample_overrates(backend):
    """Adversarial codes: every sampled run matches the queries exactly, every other token does
    not, and more tokens are selected than the runs hold. The sampled bound then keeps too few
    candidates; the head is scanned again from the bottom and the selection stays exact."""
    n, budget, window = cpu.SAMPLE_FROM + 3001, 4000, 256
    rng = np.random.default_rng(5)
    q, k = random_codes(rng, 2, 1, 2, n + 5)
    layout = kernels.selection_layout(n, budget, SINKS, window)
    m = layout.middle
    for i in range(cpu.SAMPLE_RUNS):  # the runs _sample_bound scores, made to match the query bit for bit
        t0 = layout.sinks_end + i * (m - cpu.SAMPLE_RUN) // (cpu.SAMPLE_RUNS - 1)
        k[:, :, t0 : t0 + cpu.SAMPLE_RUN] = q.reshape(2, 2, 1)  # (Hkv, W, run): G = 1
    s = ref_scores(q, k, n)
    assert (s[:, layout.sinks_end : layout.window_start] == 128).sum(axis=1).tolist() == [
        cpu.SAMPLE_RUNS * cpu.SAMPLE_RUN] * 2 and cpu.SAMPLE_RUNS * cpu.SAMPLE_RUN < budget
    scratch = kernels.make_scratch(backend.put(q), backend.put(k))
    got = backend.get(kernels.score_select(backend.put(q), backend.put(k), n, budget, SINKS, window, scratch=scratch))
    np.testing.assert_array_equal(got, ref_select_fast(s, budget, SINKS, window))
    if backend.name == "cpu":
        assert scratch.bounds.tolist() == [-1, -1]  # both heads were scanned again from -1


def test_a_folded_scan_samples_a_wider_margin_so_bunched_matches_are_not_scanned_twice():
    """Matches bunched where the sample looks: the first 100 tokens of each sampled run match the
    query, nothing else does, and 4,000 are selected. The flat scan's sampled bound (1.5x the share)
    keeps only those 800 and scans both heads again; the folded scan (four blocks, one query, so the
    same scores and the same eight runs) samples for 2.5x the share, keeps enough at once, and
    selects the same tokens."""
    n, budget, window = cpu.SAMPLE_FROM + 3001, 4000, 256
    q, k = random_codes(np.random.default_rng(7), 2, 1, 2, n + 5)
    layout = kernels.selection_layout(n, budget, SINKS, window)
    m = layout.middle
    for i in range(cpu.SAMPLE_RUNS):
        t0 = layout.sinks_end + i * (m - cpu.SAMPLE_RUN) // (cpu.SAMPLE_RUNS - 1)
        k[:, :, t0 : t0 + 100] = q.reshape(2, 2, 1)  # (Hkv, W, 100): G = 1
    s = ref_scores(q, k, n)
    assert (s[:, layout.sinks_end : layout.window_start] == 128).sum(axis=1).tolist() == [800, 800]
    blocks = [layout.sinks_end + m * i // 4 for i in range(4)] + [layout.window_start]
    flat, folded = kernels.make_scratch(q, k), kernels.make_scratch(q, k)
    got_flat = kernels.score_select(q, k, n, budget, SINKS, window, scratch=flat)
    got_folded = kernels.score_select_blocks(np.stack([q] * 4), k, n, blocks, budget, SINKS, window, scratch=folded)
    np.testing.assert_array_equal(np.stack([got_flat, got_folded]), np.stack([ref_select_fast(s, budget, SINKS, window)] * 2))
    assert (flat.bounds.tolist(), folded.bounds.tolist()) == ([-1, -1], [-2, -2])  # -1: scanned again; -2: done


@pytest.mark.parametrize("sinks,window", [(0, 0), (0, 5), (7, 0), (600, 600), (1, 1)])
def test_select_sinks_and_window_edges(backend, sinks, window):
    rng = np.random.default_rng(sinks + window)
    q, k = random_codes(rng, 2, 3, 2, 1000, distinct=5)
    s = ref_scores(q, k, 1000)
    for budget in [0, 10, 1000]:
        check_selection(backend.get(kernels.select(backend.put(s.astype(np.int32)), budget, sinks, window)),
                        s, budget, sinks, window)
        check_selection(backend.get(kernels.score_select(backend.put(q), backend.put(k), 1000, budget, sinks, window)),
                        s, budget, sinks, window)


def test_select_all_equal_scores_take_lowest_indices(backend):
    s = np.full((2, 200), 7, np.int32)
    expected = np.tile(np.r_[0:4, 4:14, 136:200], (2, 1)).astype(np.int32)
    np.testing.assert_array_equal(backend.get(kernels.select(backend.put(s), 10, SINKS, WINDOW)), expected)


def test_select_handles_other_integer_dtypes(backend):
    s = np.random.default_rng(3).integers(0, 300, size=(3, 700)).astype(np.uint16)
    got = backend.get(kernels.select(backend.put(s), 20, SINKS, WINDOW))
    np.testing.assert_array_equal(got, ref_select(s, 20, SINKS, WINDOW))


def test_select_and_score_select_reuse_out_and_scratch(backend):
    """One capacity-sized code buffer, growing n: the same out / scratch serve every step."""
    rng = np.random.default_rng(11)
    q, k = random_codes(rng, 3, 3, 2, 2048, distinct=40)
    dq, dk = backend.put(q), backend.put(k)
    scratch = kernels.make_scratch(dq, dk)
    for n in [1, 100, 1500, 2048]:
        layout = kernels.selection_layout(n, 30, SINKS, WINDOW)
        out = backend.put(np.full((3, layout.size), -1, np.int32))
        for _ in range(2):
            assert kernels.score_select(dq, dk, n, 30, SINKS, WINDOW, out=out, scratch=scratch) is out
            np.testing.assert_array_equal(backend.get(out), ref_select(ref_scores(q, k, n), 30, SINKS, WINDOW))
        assert kernels.select(backend.put(ref_scores(q, k, n).astype(np.int32)), 30, SINKS, WINDOW, out=out,
                              scratch=scratch) is out
        np.testing.assert_array_equal(backend.get(out), ref_select(ref_scores(q, k, n), 30, SINKS, WINDOW))


def test_empty_cache_selects_nothing(backend):
    q, k = random_codes(np.random.default_rng(0), 2, 3, 2, 16)
    got = backend.get(kernels.score_select(backend.put(q), backend.put(k), 0, 10, SINKS, WINDOW))
    assert got.shape == (2, 0)


@pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("chunks", [1, 3, 5])
def test_cpu_results_do_not_depend_on_the_thread_split(monkeypatch, chunks):
    """The numba scan cuts the heads' tokens into one run per thread; any split gives the same result."""
    monkeypatch.setattr(cpu, "threads", lambda: chunks)
    q, k = random_codes(np.random.default_rng(chunks), 3, 3, 2, 777, distinct=6)
    s = ref_scores(q, k, 777)
    scratch = kernels.make_scratch(q, k)
    np.testing.assert_array_equal(kernels.scores(q, k, 777), s)
    for budget in [1, 30, 300]:
        check_selection(kernels.score_select(q, k, 777, budget, SINKS, WINDOW, scratch=scratch), s, budget, SINKS, WINDOW)
        check_selection(kernels.select(s.astype(np.int32), budget, SINKS, WINDOW), s, budget, SINKS, WINDOW)


# ----------------------------------------------------------------------------- gather


def test_gather_equals_advanced_indexing(backend):
    rng = np.random.default_rng(5)
    kv = rng.standard_normal((3, 257, 64)).astype(np.float32)
    idx = np.sort(rng.choice(257, size=(3, 40)), axis=1).astype(np.int32)
    expected = np.stack([kv[h][idx[h]] for h in range(3)])
    out = backend.put(np.zeros_like(expected))
    assert kernels.gather(backend.put(kv), backend.put(idx), out=out) is out
    np.testing.assert_array_equal(backend.get(out), expected)


def test_gather_torch_tensors_return_torch():
    torch = pytest.importorskip("torch")
    kv = torch.randn(2, 50, 8, dtype=torch.bfloat16)
    idx = np.array([[0, 7, 49], [3, 4, 5]], np.int32)
    got = kernels.gather(kv, idx)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got, torch.stack([kv[h][torch.from_numpy(idx[h]).long()] for h in range(2)]))


# ----------------------------------------------------------------------------- attention


def ref_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 softmax attention of q (H, D) over k, v (Hkv, K, D); query head h * G + g reads KV head h."""
    hkv, _, dim = k.shape
    logits = q.reshape(hkv, -1, dim).astype(np.float64) @ k.transpose(0, 2, 1) / np.sqrt(dim)  # (Hkv, G, K)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return ((weights / weights.sum(-1, keepdims=True)) @ v).reshape(q.shape)  # (H, D)


def attention_inputs(rng, heads, hkv, dim, capacity, scale=1.0):
    q = rng.standard_normal((heads, dim)).astype(np.float32)
    k = (scale * rng.standard_normal((hkv, capacity, dim))).astype(np.float32)
    return q, k, rng.standard_normal((hkv, capacity, dim)).astype(np.float32)


# (H, Hkv, D, capacity, n): odd sizes, n below, at and above one block (128 rows) and the thread split
ATTENTION_CASES = [(9, 3, 64, 1000, 1), (9, 3, 64, 1000, 777), (4, 4, 24, 300, 300), (8, 2, 128, 2100, 2049),
                   (3, 1, 13, 70, 5)]


@pytest.mark.parametrize("heads,hkv,dim,capacity,n", ATTENTION_CASES)
def test_attend_and_gather_attend_equal_softmax_attention(backend, heads, hkv, dim, capacity, n):
    rng = np.random.default_rng(n)
    q, k, v = attention_inputs(rng, heads, hkv, dim, capacity, scale=4.0)  # sharp softmax: tests the max shift
    dq, dk, dv = backend.put(q), backend.put(k), backend.put(v)
    scratch = kernels.make_attend_scratch(dq, dk)
    got = backend.get(kernels.attend(dq, dk, dv, n, scratch=scratch))
    np.testing.assert_allclose(got, ref_attend(q, k[:, :n], v[:, :n]), rtol=1e-5, atol=1e-5)
    idx = np.sort([rng.choice(capacity, min(n, 200), replace=False) for _ in range(hkv)], axis=1).astype(np.int32)
    out = backend.put(np.zeros((heads, dim), np.float32))
    assert kernels.gather_attend(dq, dk, dv, backend.put(idx), out=out, scratch=scratch) is out
    expected = ref_attend(q, np.stack([k[h, idx[h]] for h in range(hkv)]), np.stack([v[h, idx[h]] for h in range(hkv)]))
    np.testing.assert_allclose(backend.get(out), expected, rtol=1e-5, atol=1e-5)


def test_gather_attend_over_all_rows_equals_attend(backend):
    q, k, v = attention_inputs(np.random.default_rng(3), 6, 2, 64, 600)
    idx = np.tile(np.arange(517, dtype=np.int32), (2, 1))
    dense = backend.get(kernels.attend(backend.put(q), backend.put(k), backend.put(v), 517))
    rows = backend.get(kernels.gather_attend(backend.put(q), backend.put(k), backend.put(v), backend.put(idx)))
    np.testing.assert_allclose(rows, dense, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("count", [2, 3])
def test_attend_thread_split_gives_the_same_result(monkeypatch, count):
    """With several threads each head's rows are split and merged (log-sum-exp): same result."""
    from kernels import attend_cpu

    q, k, v = attention_inputs(np.random.default_rng(count), 9, 3, 64, 5000, scale=3.0)
    one = kernels.attend(q, k, v, 4999)
    monkeypatch.setattr(attend_cpu, "threads", lambda: count)
    several = kernels.attend(q, k, v, 4999, scratch=kernels.make_attend_scratch(q, k))
    np.testing.assert_allclose(several, one, rtol=1e-5, atol=1e-5)


@pytest.fixture(params=["sixteen lanes", "eight lanes"])
def lanes(request):
    """attend.c's sixteen-lane loops (kernels/attend_wide.h, built where the CPU has AVX-512) and its
    eight-lane ones, each in turn; the first is skipped where attend.c was built without AVX-512."""
    from kernels import attend_cpu

    if request.param == "sixteen lanes" and not attend_cpu.C_ATTEND_WIDE:
        pytest.skip("kernels/_quant.so built without AVX-512: only the eight-lane loops exist")
    before = attend_cpu.set_wide(request.param == "sixteen lanes")
    yield request.param
    attend_cpu.set_wide(before)


# G from 1 to 16 (blocks of four queries and every remainder), D a multiple of 16 with every
# remainder of a 64-value pass (16, 48, 80, 128), n with every remainder of a four-row block
@pytest.mark.parametrize("heads,hkv,dim,n", [(1, 1, 16, 1), (7, 1, 48, 130), (14, 2, 64, 8193), (9, 3, 64, 66),
                                             (16, 1, 80, 67), (10, 5, 128, 515), (32, 2, 64, 200)])
def test_sixteen_lane_attention_equals_softmax_attention(lanes, heads, hkv, dim, n):
    """attend.c's sixteen-lane loops (lanes: scores four queries by four rows, V four queries at a
    time) and its eight-lane ones give float64 softmax attention, contiguous and over gathered
    rows, fp32 and fp16 rows, on one and two threads; the two agree to fp32 rounding."""
    from kernels import attend_cpu

    rng = np.random.default_rng(n)
    q, k, v = attention_inputs(rng, heads, hkv, dim, n + 5, scale=3.0)
    idx = np.sort(rng.integers(0, n + 5, (hkv, 131)), axis=1).astype(np.int32)
    for rows_k, rows_v in ((k, v), (k.astype(np.float16), v.astype(np.float16))):
        wide_k, wide_v = rows_k.astype(np.float32), rows_v.astype(np.float32)
        expected = ref_attend(q, wide_k[:, :n], wide_v[:, :n])
        expected_rows = ref_attend(q, np.take_along_axis(wide_k, idx[..., None].astype(np.int64), 1),
                                   np.take_along_axis(wide_v, idx[..., None].astype(np.int64), 1))
        for count in (1, 2):
            kernels.set_threads(count)
            try:
                dense = attend_cpu.attend(q, rows_k, rows_v, n)
                rows = attend_cpu.gather_attend(q, rows_k, rows_v, idx)
                other = attend_cpu.set_wide(lanes != "sixteen lanes")
                try:
                    dense_other = attend_cpu.attend(q, rows_k, rows_v, n)
                finally:
                    attend_cpu.set_wide(other)
            finally:
                kernels.set_threads(1)
            np.testing.assert_allclose(dense, expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(rows, expected_rows, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(dense, dense_other, rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")
# Qwen2.5's geometry (G = 7: three query pairs and one single) at 8K; the next three reuse
# ATTENTION_CASES' compiled numba shapes (D = 24 takes the single query's 8-wide remainder, D = 128
# two 64-wide passes); G = 2 with D = 40 takes the query pair's 8-wide remainder past 32
@pytest.mark.parametrize("heads,hkv,dim,capacity,n", [(14, 2, 64, 8200, 8193), (9, 3, 64, 700, 130),
                                                      (8, 2, 128, 600, 77), (4, 4, 24, 300, 300),
                                                      (8, 4, 40, 200, 101)])
def test_c_attention_equals_the_numba_kernel(lanes, heads, hkv, dim, capacity, n):
    """kernels/attend.c (where it fits: G <= 16, D a multiple of 8) and the numba kernel compute the
    same attention, contiguous and over gathered rows, on one and two threads."""
    from kernels import attend_cpu

    if not attend_cpu.c_attend_fits(heads, hkv, dim):
        pytest.skip("kernels/_quant.so without the AVX2 attention kernel (make setup)")
    rng = np.random.default_rng(n)
    q, k, v = attention_inputs(rng, heads, hkv, dim, capacity, scale=3.0)
    idx = np.sort(rng.integers(0, capacity, (hkv, 333)), axis=1).astype(np.int32)  # repeats allowed
    for count in (1, 2):
        kernels.set_threads(count)
        try:
            scratch = kernels.make_attend_scratch(q, k)
            for native in (True, False):
                dense = attend_cpu.attend(q, k, v, n, scratch=scratch, native=native)
                rows = attend_cpu.gather_attend(q, k, v, idx, scratch=scratch, native=native)
                if native:
                    c_dense, c_rows = dense, rows
            np.testing.assert_allclose(c_dense, dense, rtol=2e-6, atol=2e-6)
            np.testing.assert_allclose(c_rows, rows, rtol=2e-6, atol=2e-6)
        finally:
            kernels.set_threads(1)
    np.testing.assert_allclose(c_dense, ref_attend(q, k[:, :n], v[:, :n]), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("heads,hkv,dim,capacity,n", [(14, 2, 64, 8200, 8193), (8, 4, 40, 200, 101)])
def test_fp16_rows_give_the_attention_of_their_fp32_values(lanes, heads, hkv, dim, capacity, n):
    """An fp16 cache (EngineConfig.kv_dtype): attend.c widens each row as it loads it, the numba
    fallback widens the rows it reads first; both give exactly the attention over the same
    values stored as fp32, contiguous and gathered, on one and two threads."""
    from kernels import attend_cpu

    rng = np.random.default_rng(n)
    q, k, v = attention_inputs(rng, heads, hkv, dim, capacity, scale=3.0)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    k32, v32 = k16.astype(np.float32), v16.astype(np.float32)  # the same values, stored as fp32
    idx = np.sort(rng.integers(0, capacity, (hkv, 333)), axis=1).astype(np.int32)
    for count in (1, 2):
        kernels.set_threads(count)
        try:
            for native in (True, False):
                np.testing.assert_array_equal(attend_cpu.attend(q, k16, v16, n, native=native),
                                              attend_cpu.attend(q, k32, v32, n, native=native))
                np.testing.assert_array_equal(attend_cpu.gather_attend(q, k16, v16, idx, native=native),
                                              attend_cpu.gather_attend(q, k32, v32, idx, native=native))
        finally:
            kernels.set_threads(1)
    assert attend_cpu.C_ATTEND_F16 == attend_cpu.C_ATTEND  # F16C comes with AVX2 on the machines we build for


def test_attend_rejects_mixed_row_dtypes():
    q, k, v = attention_inputs(np.random.default_rng(0), 4, 2, 8, 20)
    with pytest.raises(ValueError, match="k and v alike"):
        kernels.attend(q, k.astype(np.float16), v, 5)
    with pytest.raises(ValueError, match="q must be float32"):
        kernels.attend(q.astype(np.float16), k, v, 5)


def test_attend_rejects_bad_rows_and_shapes():
    q, k, v = attention_inputs(np.random.default_rng(0), 4, 2, 8, 20)
    with pytest.raises(ValueError, match=r"idx must lie in \[0, 20\)"):
        kernels.gather_attend(q, k, v, np.array([[0, 20], [1, 2]], np.int32))
    with pytest.raises(ValueError, match="capacity"):
        kernels.attend(q, k, v, 21)
    with pytest.raises(ValueError, match="float32"):
        kernels.attend(q.astype(np.float64), k, v, 5)


def test_mlp_codes_equal_the_packed_signs_of_the_mlp():
    """Fused query encoder + pack vs numpy float64 math; bits within rounding of 0 are not compared."""
    rng = np.random.default_rng(9)
    rows, dim, width, bits, depth = 9, 64, 48, 128, 2
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    w1, b1 = [(0.2 * rng.standard_normal(s)).astype(np.float32) for s in [(rows, 3, dim, width), (rows, 3, 1, width)]]
    w2, w_out = [(0.2 * rng.standard_normal(s)).astype(np.float32) for s in [(rows, 3, width, dim), (rows, dim, bits)]]
    y = x.astype(np.float64)
    for block in range(depth):
        z = np.einsum("rd,rdf->rf", y, w1[:, block]) + b1[:, block, 0]
        y = y + np.einsum("rf,rfd->rd", z / (1 + np.exp(-z)), w2[:, block])
    h = np.einsum("rd,rdc->rc", y, w_out)  # (R, C)
    got = kernels.mlp_codes(x, w1, b1, w2, w_out, depth)
    bits_got = np.unpackbits(got.view(np.uint8), axis=1, bitorder="little")[:, :bits].astype(bool)
    clear = np.abs(h) > 1e-4
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(bits_got[clear], (h > 0)[clear])


def mlp_inputs(rng, rows=9, dim=64, width=48, bits=128, stacked=3):
    """x (R, D) and the stacked encoder weights w1, b1, w2, w_out of kernels.mlp_codes."""
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    shapes = [(rows, stacked, dim, width), (rows, stacked, 1, width), (rows, stacked, width, dim), (rows, dim, bits)]
    return x, [(0.2 * rng.standard_normal(s)).astype(np.float32) for s in shapes]


@pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("native", [True, False])  # kernels/encode.c where built; numba's one-row kernel
def test_mlp_coder_on_two_threads_equals_one_thread_and_sees_weights_changed_in_place(native):
    """The rows are coded on two threads (each row's sums in the same order): the same bits; the
    coder views the weights, so a weight changed in place changes its codes."""
    if cpu.most_threads() < 2:
        pytest.skip("one thread here")
    x, weights = mlp_inputs(np.random.default_rng(3))
    coder = kernels.MlpCoder(*weights, 2)
    before = cpu.threads()
    try:
        kernels.set_threads(1)
        one = coder(x, np.empty((9, 2), np.uint64), native=native).copy()
        kernels.set_threads(2)
        two = coder(x, np.empty((9, 2), np.uint64), native=native).copy()
        np.testing.assert_array_equal(two, one)
        np.testing.assert_array_equal(one, kernels.mlp_codes(x, *weights, 2))
        weights[3] *= -1  # w_out negated in place: every clear bit flips
        flipped = coder(x, np.empty((9, 2), np.uint64), native=native)
        assert (flipped == ~one).mean() > 0.9
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize("change, message", [
    (lambda x, w: (x.astype(np.float64), w), r"x must be C-contiguous float32 \(9, 64\)"),
    (lambda x, w: (x[:4], w), r"x must be C-contiguous float32 \(9, 64\)"),
    (lambda x, w: (x, [w[0].astype(np.float64)] + w[1:]), "w1 must be C-contiguous float32"),
    (lambda x, w: (x, w[:3] + [w[3][:, :, :100]]), "w_out must be C-contiguous float32"),
    (lambda x, w: (x, [w[0][:, :, :32]] + w[1:]), "w1 must be C-contiguous float32"),
])
def test_mlp_coder_refuses_wrong_shapes_and_dtypes_with_what_it_needs(change, message):
    x, weights = change(*mlp_inputs(np.random.default_rng(4)))
    with pytest.raises(ValueError, match=message):
        kernels.MlpCoder(*weights, 2)(x, np.empty((9, 2), np.uint64))


def _mlp_fp64(x, w1, b1, w2, w_out, depth):
    """h (..., R, C) of the encoder MLP in float64, rows of x (..., R, D) through MLP r."""
    y = x.astype(np.float64)
    for block in range(depth):
        z = np.einsum("...rd,rdf->...rf", y, w1[:, block]) + b1[:, block, 0]
        y = y + np.einsum("...rf,rfd->...rd", z / (1 + np.exp(-z)), w2[:, block])
    return np.einsum("...rd,rdc->...rc", y, w_out)


def test_mlp_coder_codes_many_inputs_per_row_as_fp64_and_one_call_each_do():
    """`many` (B inputs through each row's MLP, select_far's turned-back queries; kernels/encode.c,
    and numpy's BLAS products) sets every bit the fp64 MLP sets, but for bits within float rounding
    of 0; so does each one-row call. It refuses an x whose rows do not match the coder's."""
    rng = np.random.default_rng(6)
    _, weights = mlp_inputs(rng)
    coder = kernels.MlpCoder(*weights, 2)
    xs = rng.standard_normal((33, 9, 64)).astype(np.float32)  # (B, R, D)
    got = coder.many(xs, np.empty((33, 9, 2), np.uint64))
    numpy_path = coder.many(xs, np.empty((33, 9, 2), np.uint64), native=False)
    one = np.stack([coder(x, np.empty((9, 2), np.uint64)).copy() for x in xs])  # (B, R, W)
    one_numba = np.stack([coder(x, np.empty((9, 2), np.uint64), native=False).copy() for x in xs])
    h = _mlp_fp64(xs, *weights, 2)  # (B, R, C)
    clear = np.abs(h) > 1e-4 * np.abs(h).max()  # bits not within rounding of 0
    bits = lambda codes: np.unpackbits(codes.view(np.uint8), axis=-1, bitorder="little")[..., : h.shape[-1]]
    expected = (h > 0).astype(np.uint8)
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(bits(got)[clear], expected[clear])
    np.testing.assert_array_equal(bits(numpy_path)[clear], expected[clear])
    np.testing.assert_array_equal(bits(one)[clear], expected[clear])
    np.testing.assert_array_equal(bits(one_numba)[clear], expected[clear])
    with pytest.raises(ValueError, match=r"x must be C-contiguous float32 \(B, 9, 64\)"):
        coder.many(xs[:, :4].copy(), np.empty((33, 4, 2), np.uint64))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("bits", [128, 100])  # 100: not a multiple of 8, which encode.c leaves to numpy
def test_mlp_coder_codes_turned_queries_as_turn_back_then_many(native, bits):
    """`turned` (select_far's decode query turned back once per block, then coded) equals
    positions.Rotations.turn_back followed by `many`, bit for bit, through kernels/encode.c and
    through numpy, on one thread and on two; either sets every bit the fp64 MLP of the turned
    inputs sets, but for bits within float rounding of 0."""
    import torch

    from spotlight.positions import Rotations

    from kernels import encode, quant

    if native and bits == 128:  # the compiled path runs wherever the SIMD library is built
        assert encode.C_ENCODE == (quant._LIB is not None and quant.C_SIMD)
    rng = np.random.default_rng(7)
    q, weights = mlp_inputs(rng, bits=bits)  # q (R, D)
    coder = kernels.MlpCoder(*weights, 2)
    angles = rng.uniform(-50, 50, (33, 64)).astype(np.float32)  # (B, D)
    cos, sin = np.cos(angles), np.sin(angles)
    x = Rotations.turn_back(torch.from_numpy(q)[None], torch.from_numpy(cos)[:, None],
                            torch.from_numpy(sin)[:, None]).numpy()  # (B, R, D)
    words = kernels.words_for(bits)
    before = cpu.threads()
    try:
        got = {}
        for count in (1, 2):
            kernels.set_threads(count)
            got[count] = coder.turned(q, cos, sin, np.empty((33, 9, words), np.uint64), native=native)
        np.testing.assert_array_equal(got[2], got[1])
        np.testing.assert_array_equal(got[1], coder.many(x, np.empty((33, 9, words), np.uint64), native=native))
    finally:
        kernels.set_threads(before)
    h = _mlp_fp64(x, *weights, 2)  # (B, R, C)
    clear = np.abs(h) > 1e-4 * np.abs(h).max()
    assert clear.mean() > 0.99
    bits_of = np.unpackbits(got[1].view(np.uint8), axis=-1, bitorder="little")[..., :bits]
    np.testing.assert_array_equal(bits_of[clear], (h > 0).astype(np.uint8)[clear])
    with pytest.raises(ValueError, match=r"cos must be C-contiguous float32 \(B, 64\)"):
        coder.turned(q, cos[:, :32].copy(), sin, np.empty((33, 9, words), np.uint64))


def test_mlp_coder_refuses_more_blocks_than_stacked():
    with pytest.raises(ValueError, match="depth"):
        kernels.MlpCoder(*mlp_inputs(np.random.default_rng(5))[1], 4)


def test_linear_equals_matmul():
    from kernels.linear import linear

    rng = np.random.default_rng(1)
    for rows, cols in [(7, 5), (576, 576), (1, 3)]:
        w, x, b = [rng.standard_normal(s).astype(np.float32) for s in [(rows, cols), (cols,), (rows,)]]
        np.testing.assert_allclose(linear(x, w), w.astype(np.float64) @ x, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(linear(x, w, b), w.astype(np.float64) @ x + b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("weight, bias, x, out, message", [
    (np.zeros((4, 3), np.float64), None, np.zeros(3, np.float32), np.zeros(4, np.float32), "float32 weight"),
    (np.zeros((3, 4), np.float32).T, None, np.zeros(3, np.float32), np.zeros(4, np.float32), "C-contiguous"),
    (np.zeros((4, 3), np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(4, np.float32),
     r"bias must be float32 \(4,\)"),
    (np.zeros((4, 3), np.float32), None, np.zeros(5, np.float32), np.zeros(4, np.float32), r"x must be float32 \(3,\)"),
    (np.zeros((4, 3), np.float32), None, np.zeros(3, np.float32), np.zeros(0, np.float32), r"out must be .* \(4,\)"),
])
def test_matvec_refuses_wrong_shapes_and_dtypes_with_what_it_needs(weight, bias, x, out, message):
    from kernels.linear import MatVec

    with pytest.raises(ValueError, match=message):
        MatVec(weight, bias)(x, out)


@pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")
def test_linear_on_two_threads_equals_one_thread():
    """kernels.set_threads(2) splits the weight rows over two threads; every row is still summed
    by one thread in the same order."""
    from kernels.linear import linear

    if cpu.most_threads() < 2:
        pytest.skip("numba has one thread here")
    rng = np.random.default_rng(2)
    before = cpu.threads()
    try:
        for rows, cols in [(7, 5), (1538, 576), (3, 3)]:
            w, x, b = [rng.standard_normal(s).astype(np.float32) for s in [(rows, cols), (cols,), (rows,)]]
            kernels.set_threads(1)
            one = linear(x, w, b)
            kernels.set_threads(2)
            two = linear(x, w, b)
            np.testing.assert_array_equal(two, one)
            np.testing.assert_allclose(two, w.astype(np.float64) @ x + b, rtol=1e-5, atol=1e-4)
    finally:
        kernels.set_threads(before)


# ----------------------------------------------------------------------------- dispatch, errors


def test_bad_shapes_and_dtypes_raise_value_error(backend):
    q, k = random_codes(np.random.default_rng(0), 2, 3, 2, 16)
    with pytest.raises(ValueError, match="does not match"):
        kernels.scores(backend.put(q[:, :1].copy()), backend.put(k), 16)
    with pytest.raises(ValueError, match="capacity"):
        kernels.scores(backend.put(q), backend.put(k), 17)
    with pytest.raises(ValueError, match="uint64"):
        kernels.scores(backend.put(q.astype(np.float64)), backend.put(k), 16)
    with pytest.raises(ValueError, match=">= 0"):
        kernels.select(backend.put(np.full((1, 200), -1, np.int32)), 5, SINKS, WINDOW)
    with pytest.raises(ValueError, match="out must"):
        kernels.scores(backend.put(q), backend.put(k), 16, out=backend.put(np.zeros((2, 15), np.int32)))


def test_int64_codes_are_accepted_as_the_same_bits(backend):
    q, k = random_codes(np.random.default_rng(2), 2, 3, 2, 40)
    got = kernels.scores(backend.put(q.view(np.int64)), backend.put(k.view(np.int64)), 40)
    np.testing.assert_array_equal(backend.get(got), ref_scores(q, k, 40))


def test_dispatch_follows_array_type():
    torch = pytest.importorskip("torch")
    assert kernels.backend_of(np.zeros(1)) == "cpu"
    assert kernels.backend_of(torch.zeros(1)) == "cpu"
    with pytest.raises(TypeError):
        kernels.backend_of([1, 2])
    with pytest.raises(ValueError, match="unknown backend"):
        with kernels.use_backend("tpu"):
            pass


def test_torch_cpu_tensors_are_used_zero_copy():
    torch = pytest.importorskip("torch")
    q, k = random_codes(np.random.default_rng(4), 2, 3, 2, 300)
    tq, tk = torch.from_numpy(q), torch.from_numpy(k)
    layout = kernels.selection_layout(300, 20, SINKS, WINDOW)
    out = torch.zeros(2, layout.size, dtype=torch.int32)
    kernels.score_select(tq, tk, 300, 20, SINKS, WINDOW, out=out)
    np.testing.assert_array_equal(out.numpy(), ref_select(ref_scores(q, k, 300), 20, SINKS, WINDOW))


def test_import_does_not_import_cupy():
    code = "import sys, kernels; kernels.scores; assert 'cupy' not in sys.modules, 'cupy imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_cuda_without_gpu_raises_clear_error():
    try:
        import cupy

        if cupy.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    with pytest.raises(kernels.CudaUnavailable, match="CUDA requested but no GPU is available"):
        with kernels.use_backend("cuda"):
            pass


# ----------------------------------------------------------------------------- CUDA sources


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", CU_SOURCES, ids=lambda p: p.name)
def test_cuda_sources_compile_to_cubin(tmp_path, source, arch):
    from kernels.cuda import OPTIONS

    cubin = tmp_path / f"{source.stem}.{arch}.cubin"
    run = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", *OPTIONS, str(source), "-o", str(cubin)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert cubin.stat().st_size > 0


def test_there_are_cuda_sources():
    assert [p.name for p in CU_SOURCES] == ["retrieval.cu"]
