"""CPU retrieval kernels: the reference semantics, a numba JIT fast path and a pure-numpy fallback.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv query heads per KV head (Hugging Face
order: query head h * G + g belongs to KV head h), r code bits, W = ceil(r / 64) packed words,
N / n cached tokens (capacity / valid), T new tokens, K selected tokens per KV head, D head dim,
S = G * W * 64 the largest score.

Semantics, written once (kernels/cuda.py and kernels/*.cu match them bit for bit):
  * bit order: bit j of word w is `x[..., 64 * w + j] > 0` (NaN and -0.0 give 0); the unused
    high bits of the last word are zero in query and key codes alike;
  * score[h, t] = sum over g < G and w < W of popcount(~(q[h * G + g, w] ^ k[h, w, t])), the
    number of matching bits. Padding bits match for every token, which adds the same constant
    G * (64 * W - r) to every score of a head: rankings are unchanged;
  * selection: forced = [0, sinks) and [n - window, n) clipped to [0, n), plus the top
    min(k, n - |forced|) of the middle tokens by score, **equal scores -> lower index first**,
    returned as ascending int32 indices; K is the same for every head.

Implementation, chosen by measurement (bench/retrieval.py; numbers in docs/RESULTS.md):
  * scoring is a numba loop specialised on constant G and W (`tags`), which LLVM unrolls and
    vectorises over tokens (VPOPCNTQ with AVX-512, pshufb nibble counts with AVX2). From G = 5 query
    heads per KV head the G query words are first counted into bit planes (`query_words`), so a key
    word costs P + 1 popcounts (P = G.bit_length()) instead of G, for the same scores. numpy's
    `bitwise_count` makes three passes per (g, w) and was 5-10x slower (the `numpy` rows); torch
    has no popcount.
  * `score_select` never stores the score rows: one pass per (head, token run) keeps only the
    tokens that beat a running lower bound of the k-th best score (`_scan_codes`), about
    k (1 + ln(n / k)) of them, then a histogram threshold over those candidates gives the cut
    and the tie quota (`_finish_head`): linear time, no sort, each code read once. `select`
    runs the same scan over given scores. From a 16K-token middle and 2,048 selected tokens on,
    the bound starts at one estimated from 2,048 sampled tokens (`_sample_bound`, checked after
    the scan), so a 10 % selection keeps ~1.7 k candidates instead of ~3.3 k.
  * threads: `set_threads(n)`, default 1 (why: its docstring). All heads' tokens are cut into one
    run per thread. numba's threading layer here is OpenMP: calls from several Python threads
    at once are safe.
  * the numba kernels live in kernels/cpu_jit.py, imported at the first call that runs one
    (`jitted`): on a host cache the engine scans byte planes with kernels/scan.c instead
    (kernels/planes.py, spotlight/attention.py `CodeSelector`), and a process that never falls
    back here never loads numba (~54 MiB). `pack`, `pack_into` and the forced indices are numpy.
Without numba every function falls back to numpy (same results, several times slower).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

# numba is the fast path of the word-major scan (kernels/cpu_jit.py, imported at its first use: `jitted`);
# without it every function still works through numpy
HAVE_NUMBA = importlib.util.find_spec("numba") is not None

assert sys.byteorder == "little", "packed codes assume a little-endian host (uint8 -> uint64 views)"

WORD_BITS = 64
# Bit pattern of +inf per float type: x > 0 exactly when 0 < bits(x) <= bits(+inf) read as an
# unsigned int (negative numbers and NaNs compare above +inf); numba has no float16, CUDA no bf16.
INF_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, "float64": 0x7FF0000000000000}
TILE = 512  # tokens scored per inner tile (a multiple of 64): W * TILE words of codes stay in L1
GATHER_BYTE_BITS = np.uint64(0x0102040810204080)  # (8 bytes of 0/1) * this >> 56 = those 8 bits
NUMPY_CHUNK = 16384  # tokens per chunk of the numpy fallback (a few hundred KiB, L2-resident)
# score_select's starting bound: SAMPLE_RUNS runs of SAMPLE_RUN tokens spread over a head's middle
# are scored first (6 % of a 32K middle), when the middle holds at least SAMPLE_FROM tokens and at
# least SAMPLE_K are selected (below that the candidates it saves cost less than the sample)
SAMPLE_RUNS, SAMPLE_RUN, SAMPLE_FROM, SAMPLE_K = 8, 256, 16384, 2048


class Layout(NamedTuple):
    """Where the forced and retrieved tokens of one selection lie.

    Token axis of one KV head (n valid tokens):

        0        sinks_end                         window_start        n
        |-forced-|----------- middle --------------|------forced------|
                   top `retrieved` by (score desc, index asc)

    Output row: [0 .. sinks_end) ++ retrieved middle tokens ascending ++ [window_start .. n).
    """

    n: int
    sinks_end: int
    window_start: int
    retrieved: int

    @property
    def size(self) -> int:
        """K: selected tokens per head."""
        return self.sinks_end + self.retrieved + (self.n - self.window_start)

    @property
    def middle(self) -> int:
        return self.window_start - self.sinks_end


def selection_layout(n: int, k: int, sinks: int, window: int) -> Layout:
    """Layout of `select(scores[:, :n], k, sinks, window)`; all arguments are non-negative ints."""
    if min(n, k, sinks, window) < 0:
        raise ValueError(f"n, k, sinks and window must be >= 0, got {n}, {k}, {sinks}, {window}")
    sinks_end = min(sinks, n)
    window_start = max(n - window, sinks_end)
    return Layout(n, sinks_end, window_start, min(k, window_start - sinks_end))


def words_for(bits: int) -> int:
    """W: packed uint64 words for `bits` code bits."""
    return -(-bits // WORD_BITS)


# ----------------------------------------------------------------------------- argument checks


def as_numpy(x):
    """A numpy view of a numpy array or a CPU torch tensor (zero-copy)."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise ValueError(f"the CPU backend got a tensor on {x.device}")
        return x.detach().numpy()
    raise TypeError(f"expected a numpy array or a torch tensor, got {type(x).__name__}")


def as_codes(x, name: str) -> np.ndarray:
    """uint64 view of packed codes given as uint64 or int64 (same bits)."""
    a = as_numpy(x)
    if a.dtype == np.int64:
        a = a.view(np.uint64)
    if a.dtype != np.uint64:
        raise ValueError(f"{name} must hold packed codes as uint64 (or int64), got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {a.shape}, strides {a.strides})")
    return a


def check_codes(q: np.ndarray, k: np.ndarray, n: int) -> tuple[int, int, int]:
    """(Hkv, G, W) of q_codes (H, W) and k_codes (Hkv, W, N); asserts GQA divisibility and n <= N."""
    if q.ndim != 2 or k.ndim != 3:
        raise ValueError(f"q_codes must be (H, W) and k_codes (Hkv, W, N), got {q.shape} and {k.shape}")
    hkv, words, capacity = k.shape
    if q.shape[1] != words or q.shape[0] % hkv:
        raise ValueError(f"q_codes {q.shape} does not match k_codes {k.shape}: need (G * Hkv, W)")
    if not 0 <= n <= capacity:
        raise ValueError(f"n = {n} outside the code buffer's capacity {capacity}")
    return hkv, q.shape[0] // hkv, words


def result(out, shape: tuple[int, ...], dtype) -> np.ndarray:
    """`out` as a checked numpy array of this shape and dtype, or a new one."""
    if out is None:
        return np.empty(shape, dtype)
    a = as_numpy(out)
    if a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous {np.dtype(dtype)} {shape}, got {a.dtype} {a.shape}")
    return a


# ----------------------------------------------------------------------------- numba kernels


@functools.cache
def jitted():
    """kernels/cpu_jit.py, this module's numba kernels, imported at the first call that runs one.

    NOTE: not at import: numba maps ~54 MiB (docs/DECISIONS.md, "numba off the default path"), and
    the app's CPU path runs the compiled kernels instead (kernels/planes.py, encode.py, attend_cpu.py,
    quant.py), so a process that never falls back to numba never loads it.
    """
    from . import cpu_jit

    return cpu_jit


def most_threads() -> int:
    """numba's thread pool size, without importing numba: $NUMBA_NUM_THREADS, else the CPUs this
    process may run on (numba's own default)."""
    if os.environ.get("NUMBA_NUM_THREADS"):
        return int(os.environ["NUMBA_NUM_THREADS"])
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else max(1, os.cpu_count() or 1)


def tags(group: int, words: int) -> tuple[tuple, tuple]:
    """Compile-time G and W for the numba kernels: tuples of these lengths, whose len() numba folds
    to a constant.

    NOTE: specialising by argument type (not by closure) keeps numba's on-disk cache valid.
    """
    return (0,) * group, (0,) * words


def _plane_count(group):
    """Bit planes of the query words for G query heads (`query_words`): G.bit_length() for
    5 <= G < 64, else 0 (the complemented words, G popcounts a key word): below 5 P + 1
    popcounts would not be fewer, and a chain of constants keeps P a compile-time number
    (kernels/cpu_jit.py inlines this function)."""
    if group < 5 or group >= 64:
        return 0
    return 3 if group < 8 else (4 if group < 16 else (5 if group < 32 else 6))


# ----------------------------------------------------------------------------- scratch


@dataclass
class Scratch:
    """Preallocated buffers of the candidate scan, for one (q_codes, k_codes) geometry.

    The scan cuts all heads' middle tokens into one run per thread; a run covers pieces of one
    or more heads (`_piece`), so there are at most Hkv + threads - 1 pieces.
    """

    tile: np.ndarray  # (threads, TILE) int32: scores of one tile
    flags: np.ndarray  # (threads, TILE) uint8: score > bound
    hist: np.ndarray  # (pieces, S + 1) int64: candidates per score
    cand_index: np.ndarray  # (Hkv, N) int32: candidate tokens, each piece from its own offset
    cand_score: np.ndarray  # (Hkv, N) int32
    counts: np.ndarray  # (pieces,) int64: candidates per piece
    bounds: np.ndarray  # (Hkv,) int64: each head's starting bound (_sample_bound)
    query: np.ndarray  # (>= Hkv * R * L,) uint64: `query_words` of the last call, grown to the most blocks R seen

    def query_words(self, q: np.ndarray, hkv: int, group: int, words: int) -> np.ndarray:
        """`query_words` written into this scratch's buffer: (Hkv, R, L), a view valid until the next call."""
        size = hkv * len(q) * query_width(group, words)
        if self.query.size < size:  # more blocks than before: past the window R grows once every fold tokens
            self.query = np.empty(2 * size, np.uint64)
        return query_words(q, hkv, group, words, out=self.query[:size].reshape(hkv, len(q), -1))

    def fits(self, hkv: int, bins: int, n: int, chunks: int) -> bool:
        """Room for Hkv heads of n tokens, scores below `bins`, and `chunks` threads."""
        return (self.cand_index.shape[0] == hkv and self.cand_index.shape[1] >= n and self.hist.shape[1] >= bins
                and len(self.tile) >= chunks and len(self.counts) >= hkv + chunks - 1)


_threads = 1  # see set_threads
_applied = threading.local()  # the count last passed to numba.set_num_threads, per Python thread


def set_threads(count: int) -> None:
    """Threads of the numba kernels, process-wide. Default 1.

    NOTE: on a 2-core machine a parallel call waits for both cores, and right after a torch op
    (whose OpenMP threads spin) or beside any busy process it can wait a whole scheduler tick
    (4-24 ms, bench/retrieval.py "after torch.mm"); one thread never does, and its score_select
    already runs within 2x of a single-thread memory read. Raise it on an idle many-core machine.
    """
    most = most_threads() if HAVE_NUMBA else 1
    if not 1 <= count <= most:
        raise ValueError(f"threads must be in [1, {most}] (NUMBA_NUM_THREADS), got {count}")
    global _threads
    _threads = count


def threads() -> int:
    """Threads (and token runs) of the numba kernels."""
    return _threads


def _numba_threads() -> int:
    """Apply the thread count to numba (a per-Python-thread setting) when it changed; return it."""
    if getattr(_applied, "count", None) != _threads:
        jitted().set_num_threads(_threads)
        _applied.count = _threads
    return threads()


def new_scratch(hkv: int, capacity: int, bins: int) -> Scratch:
    most = max(threads(), most_threads() if HAVE_NUMBA else 1)
    return Scratch(
        tile=np.empty((most, TILE), np.int32),
        flags=np.empty((most, TILE), np.uint8),
        hist=np.empty((hkv + most - 1, bins), np.int64),
        cand_index=np.empty((hkv, capacity), np.int32),
        cand_score=np.empty((hkv, capacity), np.int32),
        counts=np.empty(hkv + most - 1, np.int64),
        bounds=np.empty(hkv, np.int64),
        query=np.empty(0, np.uint64),
    )


def query_width(group: int, words: int) -> int:
    """L: `query_words`' words per KV head and block."""
    planes = _plane_count(group)
    return planes * words + 1 if planes else group * words


def query_words(q: np.ndarray, hkv: int, group: int, words: int, out: np.ndarray | None = None) -> np.ndarray:
    """The scan's form of query codes q (R, H, W) uint64: (Hkv, R, L) uint64 per KV head and block.

    Below G = 5 (and from 64) the complemented words (L = G * W; score = the sum of G popcounts a
    key word); from 5 to 63, the G words of each bit position counted into P = G.bit_length() bit planes
    (L = P * W + 1, the last word the matches of a key whose bits are all clear), scored with
    P + 1 popcounts a key word (`_tile_scores`): the same integer scores, 1.8x faster at G = 7
    (Qwen2.5's 14 heads over 2 KV heads; ad hoc, 131K tokens, one AMD EPYC core). numba only.
    out: a C-contiguous uint64 (Hkv, R, L) buffer to write (decode steps: Scratch.query_words), else made.
    """
    shape = (hkv, len(q), query_width(group, words))
    if out is None:
        out = np.empty(shape, np.uint64)
    elif out.shape != shape or out.dtype != np.uint64 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous uint64 {shape}, got {out.dtype} {out.shape}")
    jitted()._query_words_jit(np.ascontiguousarray(q), hkv, out, *tags(group, words))
    return out


def make_scratch(q_codes, k_codes) -> Scratch:
    """Buffers for `score_select(q_codes, k_codes, ...)`; allocate once per cache, reuse every step."""
    q, k = as_codes(q_codes, "q_codes"), as_codes(k_codes, "k_codes")
    hkv, group, words = check_codes(q, k, 0)
    return new_scratch(hkv, k.shape[2], group * words * WORD_BITS + 1)


# ----------------------------------------------------------------------------- public functions


def pack(x, out=None, *, jit: bool = True) -> np.ndarray:
    """Pack the signs of x (..., r) float into uint64 (..., W): bit j of word w is x[..., 64w + j] > 0.

    numpy's packbits (`jit` is accepted for a uniform signature and ignored): a prefill chunk's keys,
    2 x 1,024 x 128 bits, in ~0.16 ms where a numba loop took ~0.10, not worth loading numba for."""
    a, inf_bits = float_bits(x)
    dest = result(out, a.shape[:-1] + (words_for(a.shape[-1]),), np.uint64)
    dest[...] = _pack_numpy(a, inf_bits)
    return dest


def pack_into(x, k_codes, start: int, *, jit: bool = True) -> None:
    """Pack keys x (Hkv, T, r) into the word-major buffer k_codes (Hkv, W, N) at tokens [start, start + T)."""
    a, inf_bits = float_bits(x)
    k = as_codes(k_codes, "k_codes")
    hkv, count, bits = a.shape
    if k.shape[0] != hkv or k.shape[1] != words_for(bits) or not 0 <= start <= k.shape[2] - count:
        raise ValueError(f"keys {a.shape} at {start} do not fit k_codes {k.shape}")
    view = k[:, :, start : start + count].transpose(0, 2, 1)  # (Hkv, T, W) strided
    view[...] = _pack_numpy(a, inf_bits)  # as `pack`: `jit` is ignored


def scores(q_codes, k_codes, n: int, out=None, *, jit: bool = True) -> np.ndarray:
    """Matching-bit counts, int32 (Hkv, n): score[h, t] = sum_g popcount(~(q[h*G+g] ^ k[h, :, t])).

    One thread (the decode path, score_select, never materialises these rows).
    """
    q, k = as_codes(q_codes, "q_codes"), as_codes(k_codes, "k_codes")
    hkv, group, words = check_codes(q, k, n)
    dest = result(out, (hkv, n), np.int32)
    if jit and HAVE_NUMBA:
        flags = np.empty(TILE, np.uint8)  # (TILE,) written and unused here
        jitted()._scores_jit(query_words(q[None], hkv, group, words), k, n, flags, dest, *tags(group, words))
    else:
        _scores_numpy(q, k, n, group, dest)
    return dest


def check_blocks(q: np.ndarray, bounds, n: int) -> np.ndarray:
    """bounds as int64 (R + 1,), checked: ascending within [0, n], one per block of q (R, H, W) and one more."""
    b = np.asarray(bounds, dtype=np.int64)
    if q.ndim != 3 or b.ndim != 1 or b.shape[0] != q.shape[0] + 1:
        raise ValueError(f"q_codes must be (R, H, W) with R + 1 bounds, got {q.shape} and {b.shape}")
    # NOTE: compared as Python ints: a decode step past the window checks ~17 bounds per layer, where
    # numpy's diff and any cost ~8 us a call (docs/DECISIONS.md, "Far-step overhead")
    edges = b.tolist()
    if edges and (edges[0] < 0 or edges[-1] > n or any(a > c for a, c in zip(edges, edges[1:]))):
        raise ValueError(f"bounds must ascend within [0, {n}], got {edges}")
    return b


def check_cover(q: np.ndarray, bounds, layout: Layout) -> np.ndarray:
    """check_blocks, and the blocks cover the layout's middle [sinks_end, window_start) (score_select_blocks)."""
    b = check_blocks(q, bounds, layout.n)
    if len(q) == 0 or int(b[0]) > layout.sinks_end or int(b[-1]) < layout.window_start:
        raise ValueError(f"bounds {b.tolist()} must cover the middle [{layout.sinks_end}, {layout.window_start})")
    return b


def scores_blocks(q_codes, k_codes, n: int, bounds, out=None, *, jit: bool = True) -> np.ndarray:
    """int32 (Hkv, n): token t in block r (bounds[r] <= t < bounds[r + 1]) scored as `scores` does with
    the query codes q_codes[r] (R, H, W); 0 outside [bounds[0], bounds[-1]). One thread."""
    q, k = as_codes(q_codes, "q_codes"), as_codes(k_codes, "k_codes")
    b = check_blocks(q, bounds, n)
    hkv, group, words = check_codes(q[0] if len(q) else q.reshape(-1, k.shape[1]), k, n)
    dest = result(out, (hkv, n), np.int32)
    if len(q) == 0:
        dest[...] = 0
        return dest
    dest[:, : b[0]] = 0
    dest[:, b[-1] :] = 0
    if jit and HAVE_NUMBA:
        jitted()._scores_blocks_jit(query_words(q, hkv, group, words), k, b, np.empty(TILE, np.uint8), dest,
                           *tags(group, words))
        return dest
    for r in range(len(q)):
        lo, hi = int(b[r]), int(b[r + 1])
        whole = np.empty((hkv, hi), np.int32)  # (Hkv, hi)
        _scores_numpy(q[r], k, hi, group, whole)
        dest[:, lo:hi] = whole[:, lo:hi]
    return dest


def select(scores_, k: int, sinks: int, window: int, out=None, scratch=None, *, jit: bool = True) -> np.ndarray:
    """Ascending int32 (Hkv, K) indices: sinks, window, and the top-k middle tokens (ties: lower index).

    scratch: optional `make_scratch(...)` buffers, used when their histogram covers the scores.
    """
    s = as_numpy(scores_)
    if s.ndim != 2 or s.dtype.kind not in "iu":
        raise ValueError(f"scores must be a 2-D integer array, got {s.dtype} {s.shape}")
    s = np.ascontiguousarray(s, dtype=np.int32)  # (Hkv, n); a copy unless already int32
    layout = selection_layout(s.shape[1], k, sinks, window)
    dest = result(out, (s.shape[0], layout.size), np.int32)
    if layout.retrieved in (0, layout.middle):
        _fill_all(dest, layout)
        return dest
    middle = s[:, layout.sinks_end : layout.window_start]  # (Hkv, m)
    if middle.min() < 0:
        raise ValueError("scores must be >= 0 (a histogram threshold needs small non-negative ints)")
    if jit and HAVE_NUMBA:
        bins, chunks = int(middle.max()) + 1, _numba_threads()
        buf = scratch if scratch is not None and scratch.fits(s.shape[0], bins, s.shape[1], chunks) else \
            new_scratch(s.shape[0], s.shape[1], bins)
        jitted()._select_jit(s, layout, chunks, buf.flags, buf.hist, buf.cand_index, buf.cand_score, buf.counts, dest)
    else:
        _select_numpy(s, layout, dest)
    fill_forced(dest, layout)
    return dest


def score_select(q_codes, k_codes, n: int, k: int, sinks: int, window: int, out=None, scratch=None,
                 *, jit: bool = True) -> np.ndarray:
    """`select(scores(q_codes, k_codes, n), k, sinks, window)`, fused; identical results.

    scratch: `make_scratch(q_codes, k_codes)`, reused across steps (allocated per call if None).
    """
    q, kc = as_codes(q_codes, "q_codes"), as_codes(k_codes, "k_codes")
    hkv, group, words = check_codes(q, kc, n)
    layout = selection_layout(n, k, sinks, window)
    dest = result(out, (hkv, layout.size), np.int32)
    if layout.retrieved in (0, layout.middle):
        _fill_all(dest, layout)
        return dest
    if not (jit and HAVE_NUMBA):
        return select(scores(q, kc, n, jit=False), k, sinks, window, out=dest, jit=False)
    _fused_select(q[None], np.array([0, n], np.int64), kc, layout, group, words, dest, scratch)
    return dest


def score_select_blocks(q_codes, k_codes, n: int, bounds, k: int, sinks: int, window: int, out=None,
                        scratch=None, *, jit: bool = True) -> np.ndarray:
    """`select(scores_blocks(q_codes, k_codes, n, bounds), k, sinks, window)`, fused; identical results.

    q_codes (R, H, W): block r's query codes; bounds (R + 1,) ascending and covering the middle
    [sinks_end, window_start) of the selection layout. scratch: `make_scratch(q_codes[0], k_codes)`.
    """
    q, kc = as_codes(q_codes, "q_codes"), as_codes(k_codes, "k_codes")
    layout = selection_layout(n, k, sinks, window)
    b = check_cover(q, bounds, layout)
    hkv, group, words = check_codes(q[0], kc, n)
    dest = result(out, (hkv, layout.size), np.int32)
    if layout.retrieved in (0, layout.middle):
        _fill_all(dest, layout)
        return dest
    if not (jit and HAVE_NUMBA):
        return select(scores_blocks(q, kc, n, b, jit=False), k, sinks, window, out=dest, jit=False)
    _fused_select(q, b, kc, layout, group, words, dest, scratch)
    return dest


def _sample_runs(blocks: int) -> int:
    """Sample runs for R query blocks: SAMPLE_RUNS for the flat scan, else two per block, each at
    least 32 tokens (the runs share SAMPLE_RUNS * SAMPLE_RUN tokens)."""
    return SAMPLE_RUNS if blocks == 1 else min(max(SAMPLE_RUNS, 2 * blocks), SAMPLE_RUNS * SAMPLE_RUN // 32)


def _sample_halves(blocks: int) -> int:
    """The sampled bound's margin, in halves of r's share (`_sample_bound`): 1.5x for the flat scan;
    2.5x for a folded one, whose two 32-token runs per block miss how real text's matches bunch: on
    the default model's 131K context (the saved bench.longctx prompt, 24 tokens through Engine.stream)
    1.5x left some head short, and so rescanned from -1, in 108 of 600 layer-steps, 2.5x in 1, with
    the same selections (docs/DECISIONS.md)."""
    return 3 if blocks == 1 else 5


def _fused_select(q, starts, kc, layout, group: int, words: int, dest, scratch) -> None:
    """The fused scan of score_select(_blocks): q (R, H, W) over the blocks of starts (R + 1,)."""
    hkv = kc.shape[0]
    buf, chunks = scratch if scratch is not None else make_scratch(q[0], kc), _numba_threads()
    if not buf.fits(hkv, group * words * WORD_BITS + 1, layout.n, chunks):
        raise ValueError("scratch was made for other q_codes / k_codes shapes: call make_scratch again")
    qn = buf.query_words(q, hkv, group, words)  # (Hkv, R, L)
    g_tag, w_tag = tags(group, words)
    scan = (qn, starts, kc, layout, chunks, buf.tile, buf.flags, buf.hist, buf.cand_index, buf.cand_score,
            buf.counts, buf.bounds, g_tag, w_tag)
    jit = jitted()
    if layout.middle >= SAMPLE_FROM and layout.retrieved >= SAMPLE_K:  # below, the sample costs more than it saves
        jit._sample_bounds(qn, starts, kc, layout, _sample_runs(len(q)), _sample_halves(len(q)), buf.tile[0],
                           buf.flags[0], buf.hist[0], buf.bounds, g_tag, w_tag)
    else:
        buf.bounds[:] = -1  # every head's scan starts from the bottom
    jit._scan_jit(*scan)
    if jit._short_heads(buf.bounds, buf.counts, chunks, hkv, layout.middle, layout.retrieved):  # rare: see _sample_bound
        jit._scan_jit(*scan)  # those heads again from -1
    jit._finish_jit(layout, chunks, buf.hist, buf.cand_index, buf.cand_score, buf.counts, dest)
    fill_forced(dest, layout)


def gather(kv, idx, out=None, *, jit: bool = True):
    """out[h, j] = kv[h, idx[h, j]]: kv (Hkv, N, D), idx (Hkv, K) int -> (Hkv, K, D), kv's dtype and type.

    Per head, torch.index_select for torch tensors and np.take for numpy arrays: both beat a numba
    row-copy loop and advanced indexing (bench/retrieval.py, "K/V row gather"); torch's runs on
    torch's intra-op threads. `jit` is accepted for a uniform signature and ignored.
    """
    if type(kv).__module__.startswith("torch"):
        return _gather_torch(kv, idx, out)
    a, i = as_numpy(kv), as_numpy(idx)
    _check_gather(a.shape, i.shape)
    dest = result(out, (a.shape[0], i.shape[1], a.shape[2]), a.dtype)
    for h in range(a.shape[0]):
        np.take(a[h], i[h], axis=0, out=dest[h])  # (K, D)
    return dest


def _gather_torch(kv, idx, out):
    import torch

    index = idx if isinstance(idx, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(idx))
    _check_gather(tuple(kv.shape), tuple(index.shape))
    dest = kv.new_empty((kv.shape[0], index.shape[1], kv.shape[2])) if out is None else out  # (Hkv, K, D)
    for h in range(kv.shape[0]):
        torch.index_select(kv[h], 0, index[h], out=dest[h])  # (K, D)
    return dest


def _check_gather(kv_shape: tuple, idx_shape: tuple) -> None:
    if len(kv_shape) != 3 or len(idx_shape) != 2 or idx_shape[0] != kv_shape[0]:
        raise ValueError(f"kv must be (Hkv, N, D) and idx (Hkv, K), got {kv_shape} and {idx_shape}")


# ----------------------------------------------------------------------------- numpy fallback


def float_bits(x) -> tuple[np.ndarray, int]:
    """(unsigned view of the float bit patterns, +inf's bits) of a float array or CPU tensor (zero-copy)."""
    if type(x).__module__.startswith("torch") and str(x.dtype) == "torch.bfloat16":
        import torch

        return as_numpy(x.view(torch.int16)).view(np.uint16), INF_BITS["bfloat16"]
    a = as_numpy(x)
    if a.dtype.name not in INF_BITS:
        raise ValueError(f"pack takes float16/bfloat16/float32/float64 input, got {a.dtype}")
    return a.view(f"uint{8 * a.dtype.itemsize}"), INF_BITS[a.dtype.name]


def _pack_numpy(a: np.ndarray, inf_bits: int) -> np.ndarray:
    bits = a.shape[-1]
    padded = np.zeros(a.shape[:-1] + (words_for(bits) * WORD_BITS,), np.bool_)  # (..., W * 64)
    padded[..., :bits] = (a != 0) & (a <= inf_bits)
    return np.packbits(padded, axis=-1, bitorder="little").view(np.uint64)  # (..., W)


def _scores_numpy(q, k, n, group, out) -> None:
    inverted = ~q  # (H, W)
    for h in range(k.shape[0]):
        for t0 in range(0, n, NUMPY_CHUNK):
            acc = out[h, t0 : t0 + NUMPY_CHUNK]  # (chunk,)
            acc[:] = 0
            for w in range(k.shape[1]):
                plane = k[h, w, t0 : t0 + acc.size]  # (chunk,)
                for g in range(group):
                    acc += np.bitwise_count(plane ^ inverted[h * group + g, w])


def _select_numpy(s, layout: Layout, out) -> None:
    _, sinks_end, window_start, r = layout
    for h in range(s.shape[0]):
        middle = s[h, sinks_end:window_start]  # (m,)
        at_least = np.cumsum(np.bincount(middle)[::-1])[::-1]  # at_least[v] = #(score >= v)
        cut = int(np.flatnonzero(at_least >= r)[-1])
        above = int(at_least[cut + 1]) if cut + 1 < at_least.size else 0
        keep = middle > cut
        keep[np.flatnonzero(middle == cut)[: r - above]] = True
        out[h, sinks_end : sinks_end + r] = np.flatnonzero(keep) + sinks_end


def fill_forced(out, layout: Layout) -> None:
    """Write the sink and window indices of every head's output row out (Hkv, K) (~3 us: numpy)."""
    n, sinks_end, window_start, r = layout
    out[:, :sinks_end] = np.arange(sinks_end)
    out[:, sinks_end + r :] = np.arange(window_start, n)


def _fill_all(out, layout: Layout) -> None:
    """The middle is empty or taken whole: the selection is forced, no scores needed."""
    n, sinks_end, window_start, r = layout
    fill_forced(out, layout)
    out[:, sinks_end : sinks_end + r] = np.arange(sinks_end, sinks_end + r)
