"""CUDA retrieval kernels: validated CuPy wrappers around kernels/retrieval.cu.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv, r code bits, W words, N capacity,
n valid tokens, T new tokens, K selected per KV head, S = G * W * 64 the largest score,
tiles = ceil(middle / TILE) token tiles per head.

Same contract as kernels/cpu.py (the reference), bit-identical integer results. cupy is imported
on first use only; without it, or without a device, `backend()` raises CudaUnavailable. The
.cu source is read once into a lazily built RawModule; kernels come from a memoised lookup.
CuPy passes a Python int as long long and ignores strides, so every wrapper checks dtype,
contiguity and device, and passes scalars as numpy.int32 / numpy.int64.

score_select launches, on the current stream and with no host sync: a memset of the histogram,
hamming_scores (16-bit scores plus the middle's histogram), select_count, select_write.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import CudaUnavailable
from .cpu import INF_BITS, WORD_BITS, check_blocks, check_cover, selection_layout, words_for

SOURCE = Path(__file__).with_name("retrieval.cu")
OPTIONS = ("-std=c++17",)
PACK_TYPES = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}  # float bytes -> bits type
SCORE_TYPES = {np.dtype(np.int32): "int", np.dtype(np.uint16): "unsigned short"}  # score array dtype -> C type
SCORE_KERNELS = ("hamming_scores", "select_count", "select_write")  # templates on the score type
# Every kernel is named to NVRTC (the templates must be; CuPy then looks each name up in one mapping).
NAME_EXPRESSIONS = (tuple(f"pack_rows<{t}>" for t in PACK_TYPES.values())
                    + tuple(f"{k}<{t}>" for k in SCORE_KERNELS for t in SCORE_TYPES.values()) + ("score_histogram",))
THREADS = 256  # threads per block of every kernel (a multiple of 32)
SCORE_UNROLL = 4  # tokens per thread and pass of hamming_scores (kernels/retrieval.cu's #define)
SELECT_ITEMS = 32  # tokens per thread in select_count / select_write (kernels/retrieval.cu's #define):
                   # each warp owns 32 * SELECT_ITEMS contiguous tokens, read 32 at a time
TILE = THREADS * SELECT_ITEMS  # tokens per block in select_count / select_write (< 65536: packed 16-bit counts)
BLOCKS_PER_SM = 16  # grid of the grid-stride scoring kernels: two waves of 8 resident blocks (2048 threads per
                    # SM): 2.4-2.5 us faster than one wave at 512K tokens on an H200 (docs/gpu/)
MAX_BINS = 12288  # histogram bins (int32) in the 48 KiB of shared memory a launch gets without opt-in;
                  # below 65536, so the fused paths keep uint16 scores (half the selection kernels' reads)


@functools.cache
def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailable(f"CUDA requested but no GPU is available: cupy is not installed ({e})") from e
    try:
        available = cupy.is_available()
    except Exception as e:  # a broken driver install can raise instead of returning False
        raise CudaUnavailable(f"CUDA requested but no GPU is available: {e}") from e
    if not available:
        raise CudaUnavailable("CUDA requested but no GPU is available: cupy.is_available() is False "
                              "(no device, or no driver)")
    return cupy


def backend():
    """This module, once cupy and a device are known to be usable."""
    _cupy()
    return sys.modules[__name__]


@functools.cache
def _module():
    return _cupy().RawModule(code=SOURCE.read_text(), options=OPTIONS, name_expressions=NAME_EXPRESSIONS)


@functools.cache
def _kernel(name: str):
    return _module().get_function(name)


def _score_kernel(name: str, scores_array):
    """The instance of a score-type template kernel for this score array's dtype."""
    return _kernel(f"{name}<{SCORE_TYPES[scores_array.dtype]}>")


# ----------------------------------------------------------------------------- argument checks


def _as_cupy(x, name: str):
    """A CuPy view of a CuPy array or a CUDA torch tensor (zero-copy), on the current device."""
    cp = _cupy()
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cuda":
            raise ValueError(f"{name}: the CUDA backend got a tensor on {x.device}")
        if str(x.dtype) == "torch.uint64":  # DLPack export of torch's unsigned types varies by version
            import torch

            x = x.view(torch.int64)
        x = cp.from_dlpack(x.detach())
    if not isinstance(x, cp.ndarray):
        raise TypeError(f"{name}: the CUDA backend takes CuPy arrays or CUDA torch tensors, got {type(x).__name__}")
    if x.device.id != cp.cuda.Device().id:
        raise ValueError(f"{name} is on device {x.device.id}, the current device is {cp.cuda.Device().id}")
    return x


def _contiguous(x, name: str):
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {x.shape}, strides {x.strides})")
    return x


def _codes(x, name: str):
    a = _as_cupy(x, name)
    if a.dtype == np.int64:
        a = a.view(np.uint64)
    if a.dtype != np.uint64:
        raise ValueError(f"{name} must hold packed codes as uint64 (or int64), got {a.dtype}")
    return _contiguous(a, name)


def _check_codes(q, k, n: int) -> tuple[int, int, int]:
    if q.ndim != 2 or k.ndim != 3:
        raise ValueError(f"q_codes must be (H, W) and k_codes (Hkv, W, N), got {q.shape} and {k.shape}")
    hkv, words, capacity = k.shape
    if q.shape[1] != words or q.shape[0] % hkv:
        raise ValueError(f"q_codes {q.shape} does not match k_codes {k.shape}: need (G * Hkv, W)")
    if not 0 <= n <= capacity:
        raise ValueError(f"n = {n} outside the code buffer's capacity {capacity}")
    return hkv, q.shape[0] // hkv, words


def _result(out, shape: tuple[int, ...], dtype):
    if out is None:
        return _cupy().empty(shape, dtype)
    a = _contiguous(_as_cupy(out, "out"), "out")
    if dtype == np.uint64 and a.dtype == np.int64:  # codes buffers may be int64 (torch): the same bits
        a = a.view(np.uint64)
    if a.shape != shape or a.dtype != dtype:
        raise ValueError(f"out must be {np.dtype(dtype)} {shape}, got {a.dtype} {a.shape}")
    return a


def _float_bits(x):
    """(raw bit pattern array, its C type, +inf's bits) of a float CuPy array or CUDA torch tensor."""
    cp = _cupy()
    if type(x).__module__.startswith("torch") and str(x.dtype) == "torch.bfloat16":
        import torch

        return cp.from_dlpack(x.detach().contiguous().view(torch.int16)).view(np.uint16), "unsigned short", INF_BITS["bfloat16"]
    a = _contiguous(cp.ascontiguousarray(_as_cupy(x, "x")), "x")
    if a.dtype.name not in INF_BITS:
        raise ValueError(f"pack takes float16/bfloat16/float32/float64 input, got {a.dtype}")
    size = a.dtype.itemsize
    return a.view(f"uint{8 * size}"), PACK_TYPES[size], INF_BITS[a.dtype.name]


@functools.cache
def _resident_blocks() -> int:
    """Blocks of THREADS threads per scoring grid: BLOCKS_PER_SM per multiprocessor (8 are resident at once)."""
    return BLOCKS_PER_SM * _cupy().cuda.Device().attributes["MultiProcessorCount"]


def _grid(count: int, heads: int = 1, per_thread: int = 1) -> tuple[int, int]:
    """(token blocks per head, heads): _resident_blocks() over all heads, fewer for short rows."""
    return (max(1, min(_resident_blocks() // heads, -(-count // (THREADS * per_thread)))), heads)


def _zero(a) -> None:
    """Zero a device array with one async memset on the current stream (no elementwise kernel launch)."""
    cp = _cupy()
    cp.cuda.runtime.memsetAsync(a.data.ptr, 0, a.nbytes, cp.cuda.get_current_stream().ptr)


# ----------------------------------------------------------------------------- public functions


def pack(x, out=None):
    """Signs of x (..., r) float -> uint64 (..., W); bit j of word w is x[..., 64 w + j] > 0."""
    bits_array, ctype, inf = _float_bits(x)
    bits = bits_array.shape[-1]
    words = words_for(bits)
    dest = _result(out, bits_array.shape[:-1] + (words,), np.uint64)
    rows = bits_array.size // max(bits, 1)
    _launch_pack(bits_array, dest, ctype, inf, rows, bits, words, rows, 0, words, 1, 0)
    return dest


def pack_into(x, k_codes, start: int) -> None:
    """Pack keys x (Hkv, T, r) into the word-major buffer k_codes (Hkv, W, N) at tokens [start, start + T)."""
    bits_array, ctype, inf = _float_bits(x)
    k = _codes(k_codes, "k_codes")
    hkv, count, bits = bits_array.shape
    words, capacity = k.shape[1], k.shape[2]
    if k.shape[0] != hkv or words != words_for(bits) or not 0 <= start <= capacity - count:
        raise ValueError(f"keys {bits_array.shape} at {start} do not fit k_codes {k.shape}")
    _launch_pack(bits_array, k, ctype, inf, hkv * count, bits, words, count, words * capacity, 1, capacity, start)


def _launch_pack(src, dest, ctype, inf, rows, bits, words, rows_per_head, head_stride, row_stride,
                 word_stride, base) -> None:
    if rows * words == 0:
        return
    dtype = src.dtype.type
    _kernel(f"pack_rows<{ctype}>")(
        (-(-rows * words // THREADS),), (THREADS,),
        (src, dest, np.int64(rows), np.int32(bits), np.int32(words), np.int64(max(rows_per_head, 1)),
         np.int64(head_stride), np.int64(row_stride), np.int64(word_stride), np.int64(base), dtype(inf)),
    )


def scores(q_codes, k_codes, n: int, out=None):
    """int32 (Hkv, n) matching-bit counts, as kernels/cpu.py `scores`."""
    q, k = _codes(q_codes, "q_codes"), _codes(k_codes, "k_codes")
    hkv, group, words = _check_codes(q, k, n)
    dest = _result(out, (hkv, n), np.int32)
    if n:
        _launch_scores(q, k, n, dest, n, group, words, None, 0, 0, 0)
    return dest


def scores_blocks(q_codes, k_codes, n: int, bounds, out=None):
    """int32 (Hkv, n), as kernels/cpu.py `scores_blocks`.

    NOTE: one `hamming_scores` launch per block over [0, block end), of which the block's slice is
    kept: R launches and up to R x n scores where one pass would do (a block-aware kernel is to come).
    """
    cp = _cupy()
    q, k = _codes(q_codes, "q_codes"), _codes(k_codes, "k_codes")
    b = check_blocks(q, bounds, n).tolist()  # host ints
    hkv = k.shape[0]
    dest = _result(out, (hkv, n), np.int32)
    dest[...] = 0
    for r in range(q.shape[0]):
        lo, hi = b[r], b[r + 1]
        if hi > lo:
            whole = cp.empty((hkv, hi), np.int32)  # (Hkv, hi)
            scores(q[r], k, hi, out=whole)
            dest[:, lo:hi] = whole[:, lo:hi]
    return dest


def score_select_blocks(q_codes, k_codes, n: int, bounds, k: int, sinks: int, window: int, out=None, scratch=None):
    """As kernels/cpu.py `score_select_blocks`. NOTE: scores_blocks, then select (one host sync);
    a fused block-aware kernel is to come."""
    q = _codes(q_codes, "q_codes")
    check_cover(q, bounds, selection_layout(n, k, sinks, window))  # shapes only: no copy
    return select(scores_blocks(q, k_codes, n, bounds), k, sinks, window, out=out, scratch=scratch)


def _launch_scores(q, k, n, dest, stride, group, words, hist, bins, lo, hi) -> None:
    shared = group * words * 8 + (bins * 4 if hist is not None else 0)
    _score_kernel("hamming_scores", dest)(
        _grid(n, k.shape[0], SCORE_UNROLL), (THREADS,),
        (q, k, dest, np.int32(n), np.int64(k.shape[2]), np.int64(stride), np.int32(group), np.int32(words),
         hist if hist is not None else np.uint64(0), np.int32(bins), np.int32(lo), np.int32(hi)),
        shared_mem=shared,
    )


def select(scores_, k: int, sinks: int, window: int, out=None, scratch=None):
    """Ascending int32 (Hkv, K) selection, as kernels/cpu.py `select`.

    NOTE: reads the middle's min and max back to the host (one sync) to size the histogram;
    score_select, which knows S = G * W * 64, does not. scratch: used when its buffers fit.
    """
    cp = _cupy()
    s = _as_cupy(scores_, "scores")
    if s.ndim != 2 or s.dtype.kind not in "iu":
        raise ValueError(f"scores must be a 2-D integer array, got {s.dtype} {s.shape}")
    s = cp.ascontiguousarray(s, dtype=np.int32)
    hkv = s.shape[0]
    layout = selection_layout(s.shape[1], k, sinks, window)
    dest = _result(out, (hkv, layout.size), np.int32)
    if layout.retrieved in (0, layout.middle):
        return _fill_all(dest, layout)
    middle = s[:, layout.sinks_end : layout.window_start]
    if int(middle.min()) < 0:
        raise ValueError("scores must be >= 0 (a histogram threshold needs small non-negative ints)")
    bins = int(middle.max()) + 1
    if bins > MAX_BINS:
        raise ValueError(f"scores must be below {MAX_BINS} on CUDA (codes give at most G * W * 64), got {bins - 1}")
    buf = scratch if scratch is not None and scratch.fits(hkv, bins, layout.middle) else \
        _SelectBuffers.make(hkv, layout.middle, bins)
    _zero(buf.hist)
    bins = buf.hist.shape[1]
    _kernel("score_histogram")(
        _grid(layout.middle, hkv), (THREADS,),
        (s, np.int64(s.shape[1]), np.int32(layout.sinks_end), np.int32(layout.window_start), buf.hist, np.int32(bins)),
        shared_mem=bins * 4,
    )
    _select_from_hist(s, s.shape[1], layout, buf, dest)
    return dest


def score_select(q_codes, k_codes, n: int, k: int, sinks: int, window: int, out=None, scratch=None):
    """select(scores(q_codes, k_codes, n), k, sinks, window), fused on the device; no host sync."""
    q, kc = _codes(q_codes, "q_codes"), _codes(k_codes, "k_codes")
    hkv, group, words = _check_codes(q, kc, n)
    layout = selection_layout(n, k, sinks, window)
    dest = _result(out, (hkv, layout.size), np.int32)
    if layout.retrieved in (0, layout.middle):
        return _fill_all(dest, layout)
    buf = scratch if scratch is not None else make_scratch(q, kc)
    bins = group * words * WORD_BITS + 1
    if buf.scores.shape != (hkv, kc.shape[2]) or buf.hist.shape != (hkv, bins):
        raise ValueError("scratch was made for other q_codes / k_codes shapes: call make_scratch again")
    _zero(buf.hist)
    _launch_scores(q, kc, n, buf.scores, kc.shape[2], group, words, buf.hist, bins,
                   layout.sinks_end, layout.window_start)
    _select_from_hist(buf.scores, kc.shape[2], layout, buf, dest)
    return dest


def _select_from_hist(s, stride, layout, buf, dest) -> None:
    """Per-tile counts, then the ordered write (with the forced indices); each finds the cut itself."""
    hkv, bins = buf.hist.shape
    tiles = -(-layout.middle // TILE)
    counts = buf.tile_counts[: hkv * tiles * 2]
    lo, hi, r = np.int32(layout.sinks_end), np.int32(layout.window_start), np.int32(layout.retrieved)
    _score_kernel("select_count", s)((tiles, hkv), (THREADS,),
                            (s, np.int64(stride), lo, hi, np.int32(TILE), buf.hist, np.int32(bins), r, counts))
    _score_kernel("select_write", s)((tiles, hkv), (THREADS,),
                            (s, np.int64(stride), np.int32(layout.n), lo, hi, np.int32(TILE), buf.hist,
                             np.int32(bins), r, counts, dest, np.int32(layout.size)))


def _fill_all(dest, layout):
    """The middle is empty or taken whole: forced indices only (tiny, built on the host)."""
    cp = _cupy()
    n, sinks_end, window_start, r = layout
    row = np.concatenate([np.arange(sinks_end), np.arange(sinks_end, sinks_end + r), np.arange(window_start, n)])
    dest[...] = cp.asarray(row.astype(np.int32))
    return dest


def gather(kv, idx, out=None):
    """out[h, j] = kv[h, idx[h, j]]: kv (Hkv, N, D), idx (Hkv, K) -> (Hkv, K, D)."""
    cp = _cupy()
    a, i = _as_cupy(kv, "kv"), _as_cupy(idx, "idx")
    if a.ndim != 3 or i.ndim != 2 or i.shape[0] != a.shape[0]:
        raise ValueError(f"kv must be (Hkv, N, D) and idx (Hkv, K), got {a.shape} and {i.shape}")
    dest = _result(out, (a.shape[0], i.shape[1], a.shape[2]), a.dtype)
    for h in range(a.shape[0]):
        cp.take(a[h], i[h], axis=0, out=dest[h])
    return dest


def attend(q, k, v, n: int, out=None, scratch=None):
    """Exact attention of q (H, D) over rows [0, n) of k, v (Hkv, Ncap, D), as kernels/attend_cpu.py."""
    qa, ka, va = _as_cupy(q, "q"), _as_cupy(k, "k"), _as_cupy(v, "v")
    if not 0 <= n <= ka.shape[1]:
        raise ValueError(f"n = {n} outside the cache's capacity {ka.shape[1]}")
    return _softmax_attend(qa, ka[:, :n], va[:, :n], out)


def gather_attend(q, k, v, idx, out=None, scratch=None):
    """Exact attention of q (H, D) over the rows idx (Hkv, K) of k, v (Hkv, Ncap, D)."""
    cp = _cupy()
    qa, ka, va, rows = _as_cupy(q, "q"), _as_cupy(k, "k"), _as_cupy(v, "v"), _as_cupy(idx, "idx")
    if rows.ndim != 2 or rows.shape[0] != ka.shape[0]:
        raise ValueError(f"idx must be (Hkv, K) = ({ka.shape[0]}, K), got {rows.shape}")
    heads = cp.arange(ka.shape[0])[:, None]  # (Hkv, 1)
    return _softmax_attend(qa, ka[heads, rows], va[heads, rows], out)  # gathered (Hkv, K, D)


def _softmax_attend(q, k, v, out):
    """q (H, D) over k, v (Hkv, K, D) in the inputs' float type with fp32 softmax -> (H, D)."""
    cp = _cupy()
    hkv, count, dim = k.shape
    if q.ndim != 2 or q.shape[1] != dim or q.shape[0] % hkv:
        raise ValueError(f"need q (H, D) with Hkv | H; got q {q.shape}, k {k.shape}")
    dest = _result(out, q.shape, q.dtype)
    if count == 0:
        dest.fill(0)
        return dest
    logits = cp.matmul(q.reshape(hkv, -1, dim), k.transpose(0, 2, 1)).astype(np.float32) / np.float32(dim**0.5)
    weights = cp.exp(logits - logits.max(-1, keepdims=True))  # (Hkv, G, K)
    weights /= weights.sum(-1, keepdims=True)
    dest[...] = cp.matmul(weights.astype(v.dtype), v).reshape(q.shape)  # (H, D)
    return dest


def make_attend_scratch(q, k):
    """No scratch on the device (CuPy allocates from its memory pool)."""
    return None


# ----------------------------------------------------------------------------- scratch


@dataclass
class _SelectBuffers:
    """Device scratch of the selection kernels (and, in Scratch, of the fused scores)."""

    hist: object  # (Hkv, bins) int32
    tile_counts: object  # (Hkv * tiles * 2,) int32: tokens above / at the cut per tile

    def fits(self, hkv: int, bins: int, middle: int) -> bool:
        tiles = -(-middle // TILE)
        return self.hist.shape[0] == hkv and self.hist.shape[1] >= bins and self.tile_counts.size >= hkv * tiles * 2

    @classmethod
    def make(cls, hkv: int, middle: int, bins: int) -> "_SelectBuffers":
        cp = _cupy()
        tiles = max(1, -(-middle // TILE))
        return cls(cp.zeros((hkv, bins), np.int32), cp.empty(hkv * tiles * 2, np.int32))


@dataclass
class Scratch(_SelectBuffers):
    scores: object = None  # (Hkv, N) uint16: every score is <= S < MAX_BINS


def make_scratch(q_codes, k_codes) -> Scratch:
    """Device buffers for score_select with these code shapes; allocate once, reuse every step."""
    q, k = _codes(q_codes, "q_codes"), _codes(k_codes, "k_codes")
    hkv, group, words = _check_codes(q, k, 0)
    if group * words * WORD_BITS + 1 > MAX_BINS:
        raise ValueError(f"G * W * 64 = {group * words * WORD_BITS} exceeds the CUDA histogram's {MAX_BINS - 1}")
    base = _SelectBuffers.make(hkv, k.shape[2], group * words * WORD_BITS + 1)
    return Scratch(base.hist, base.tile_counts, _cupy().empty((hkv, k.shape[2]), np.uint16))
