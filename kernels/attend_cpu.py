"""CPU decode-step attention: exact softmax attention of one query step over cached K/V rows.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv (query head h * G + g reads KV head h,
Hugging Face order), D head dim, Ncap cache capacity, n valid rows, K selected rows per KV
head, B rows per block, S splits of one head's rows (one partial result each).

    attend(q, k, v, n)           out[h*G+g] = softmax(q[h*G+g] . k[h, :n] / sqrt(D)) @ v[h, :n]
    gather_attend(q, k, v, idx)  the same over the rows idx[h, :] of each head (no gathered copy)

Why a kernel (bench/retrieval.py, "decode attention per layer"): torch.gather + SDPA spent ~0.9 ms
per sparse layer at 32K (index expansion, two gathered copies, 3 parallel regions); this reads
the selected rows in place, prefetching them ahead of use (random rows defeat the hardware
prefetcher), in ~0.1 ms. Over contiguous rows it streams K and V once at ~1.3x a one-thread
read where SDPA ran at ~2x (MKL's small GEMMs on this AMD CPU).

The same two functions run kernels/attend.c (AVX2, built into kernels/_quant.so by `make setup`)
where the geometry fits (c_attend_fits); the numba kernels (kernels/attend_jit.py) are the fallback and the check.
Where it was built with AVX-512 (-march=native on such a CPU), attend.c computes scores and V
products sixteen lanes at a time for a head dim that is a multiple of 16 (kernels/attend_wide.h;
`set_wide(False)` runs the eight-lane loops instead, which the tests compare).

Numerics: fp32 q; K/V rows fp32, or fp16 (an fp16 cache, EngineConfig.kv_dtype) widened to fp32
as attend.c loads them (the numba fallback widens the rows it reads into a copy first); fp32
accumulators, online softmax per block of B rows. Scores are computed
pre-scaled by log2(e) / sqrt(D), so probabilities are 2^(s - max), evaluated by range reduction
and a degree-6 polynomial (relative error < 1.1e-7, about fp32 rounding) that LLVM vectorises;
results agree with torch SDPA to ~1e-7 relative. No infinities are relied upon (no `ninf`).
The numpy functions (`jit=False`) compute the same in float64 math and are the reference.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .cpu import HAVE_NUMBA, as_numpy, threads

BLOCK = 128  # rows per online-softmax block: B * D floats of K stay in L1 between the two passes
PREFETCH_AHEAD = 8  # rows: far enough to hide a DRAM miss behind the dot products of 8 rows
MIN_SPLIT_ROWS = 4 * BLOCK  # a head's rows are split across threads only above this many
FLOAT_MIN = np.float32(-3.0e38)  # "minus infinity" of the running max, finite on purpose
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}  # vectorise reductions; keep inf/nan semantics


@functools.cache
def jitted():
    """kernels/attend_jit.py, the numba kernels, imported at the first call that runs one (as
    kernels/cpu.py's `jitted`): where attend.c runs, numba is never loaded."""
    from . import attend_jit

    return attend_jit


# ----------------------------------------------------------------------------- the C kernel
# kernels/attend.c, built with quant.c into kernels/_quant.so by `make setup` (AVX2 + FMA); where
# the library or its AVX2 build is missing, the numba kernels (attend_jit.py) run.
from .quant import _LIB as _NATIVE  # noqa: E402  (the one compiled library of the CPU kernels)

C_ATTEND = bool(_NATIVE is not None and hasattr(_NATIVE, "attend_available") and _NATIVE.attend_available())
C_ATTEND_MAX_GROUP, C_ATTEND_MAX_DIM = 16, 256  # attend.c's MAX_GROUP and MAX_DIM
if C_ATTEND:
    import ctypes

    _p, _i64 = ctypes.c_void_p, ctypes.c_int64
    _NATIVE.attend_decode.argtypes = [_p, _i64, _i64, _i64, _p, _p, _i64, _p, _i64, _i64, ctypes.c_int, _p, _p, _p,
                                      _p, ctypes.c_int, ctypes.c_int, _p, _p, _i64, _i64, _i64]
    _NATIVE.attend_decode.restype = ctypes.c_int
    if hasattr(_NATIVE, "attend_scores"):
        _NATIVE.attend_scores.argtypes = [_p, _i64, _i64, _i64, _p, _i64, _p, _i64, _i64, ctypes.c_int, _p, _p, _i64,
                                          _i64, _i64, _p, ctypes.c_int]
        _NATIVE.attend_scores.restype = ctypes.c_int
# fp16 K/V rows read as they are (F16C); without it they are converted to fp32 before the kernel
C_ATTEND_F16 = bool(C_ATTEND and hasattr(_NATIVE, "attend_f16_available") and _NATIVE.attend_f16_available())
# sixteen lanes (kernels/attend_wide.h) where attend.c was built with AVX-512, for D a multiple of 16
C_ATTEND_WIDE = bool(C_ATTEND and hasattr(_NATIVE, "attend_wide_available") and _NATIVE.attend_wide_available())
if C_ATTEND_WIDE:
    _NATIVE.attend_set_wide.argtypes = [ctypes.c_int]
    _NATIVE.attend_set_wide.restype = ctypes.c_int


def set_wide(on: bool) -> bool:
    """Whether attend.c runs its sixteen-lane loops (AVX-512 builds; on by default) or its
    eight-lane ones, process-wide; returns the previous setting (False where not built wide).
    For tests and benchmarks that compare the two; set it between calls, not during one."""
    return bool(_NATIVE.attend_set_wide(int(on))) if C_ATTEND_WIDE else False


def c_attend_fits(heads: int, hkv: int, dim: int) -> bool:
    """Whether attend.c takes this geometry: G = H / Hkv and D within its limits, D a multiple of 8."""
    return C_ATTEND and heads // hkv <= C_ATTEND_MAX_GROUP and dim % 8 == 0 and dim <= C_ATTEND_MAX_DIM


# ----------------------------------------------------------------------------- scratch


@dataclass
class AttendScratch:
    """Buffers of the attention kernels for one (H, Hkv, D) geometry; none depends on n or Ncap."""

    scaled_q: np.ndarray  # (Hkv, G, D) float32: q * log2(e) / sqrt(D)
    scores: np.ndarray  # (threads, G, B) float32: one block's scores, then probabilities
    power: np.ndarray  # (threads, B) float32: polynomial part of 2^x
    bits: np.ndarray  # (threads, B) int32: exponent part of 2^x, as float bits
    stats: np.ndarray  # (Hkv * threads, 2, G) float32: running max and sum per piece
    acc: np.ndarray  # (Hkv * threads, G, D) float32: unnormalised output per piece
    dummy_rows: np.ndarray  # (Hkv, 1) int32: the rows argument of contiguous calls

    def __post_init__(self):
        # the C kernel's pointers to scaled_q, stats, acc, taken once (`.ctypes.data` costs ~1 us a call)
        self.addresses = tuple(a.ctypes.data for a in (self.scaled_q, self.stats, self.acc))

    def fits(self, heads: int, hkv: int, dim: int) -> bool:
        return self.scaled_q.shape == (hkv, heads // hkv, dim)


def attend_splits(count: int, scratch: AttendScratch) -> tuple[int, int]:
    """(workers, splits) for `count` rows per head: the kernels' threads the scratch has room for,
    and into how many runs each head's rows are cut (one per worker, above MIN_SPLIT_ROWS each)."""
    workers = min(threads(), scratch.scores.shape[0])
    return workers, workers if count >= MIN_SPLIT_ROWS * workers else 1


def make_attend_scratch(q, k) -> AttendScratch:
    """Buffers for attend / gather_attend of q (H, D) over k (Hkv, Ncap, D); allocate once, reuse."""
    return new_attend_scratch(q.shape[0], k.shape[0], k.shape[-1])


def new_attend_scratch(heads: int, hkv: int, dim: int, workers: int | None = None) -> AttendScratch:
    """Buffers for H = heads, Hkv = hkv, D = dim and `workers` threads (default: the kernels' count)."""
    if heads % hkv:
        raise ValueError(f"query heads {heads} must be a multiple of KV heads {hkv}")
    workers = max(workers or threads(), 1)
    group = heads // hkv
    return AttendScratch(
        scaled_q=np.empty((hkv, group, dim), np.float32),
        scores=np.empty((workers, group, BLOCK), np.float32),
        power=np.empty((workers, BLOCK), np.float32),
        bits=np.empty((workers, BLOCK), np.int32),
        stats=np.empty((hkv * workers, 2, group), np.float32),
        acc=np.empty((hkv * workers, group, dim), np.float32),
        dummy_rows=np.zeros((hkv, 1), np.int32),
    )


# ----------------------------------------------------------------------------- public functions


def attend(q, k, v, n: int, out=None, scratch=None, *, jit: bool = True, native: bool = True) -> np.ndarray:
    """Exact attention of q (H, D) over rows [0, n) of k, v (Hkv, Ncap, D) -> float32 (H, D).
    `native=False` runs the numba kernel where the C one (kernels/attend.c) would (tests compare them)."""
    qa, ka, va = _check(q, k, v)
    if not 0 <= n <= ka.shape[1]:
        raise ValueError(f"n = {n} outside the cache's capacity {ka.shape[1]}")
    dest = _result(out, qa.shape)
    if not (jit and HAVE_NUMBA):
        return _reference(qa, ka[:, :n], va[:, :n], dest)
    return _run(qa, ka, va, None, n, dest, scratch, native)


def gather_attend(q, k, v, idx, out=None, scratch=None, *, jit: bool = True, native: bool = True) -> np.ndarray:
    """Exact attention of q (H, D) over the rows idx (Hkv, K) int32 of k, v (Hkv, Ncap, D) -> (H, D).

    Rows may repeat or come in any order (each is weighted once per occurrence); they must be < Ncap.
    """
    qa, ka, va = _check(q, k, v)
    rows = np.ascontiguousarray(as_numpy(idx), dtype=np.int32)  # (Hkv, K); no copy when already int32
    if rows.ndim != 2 or rows.shape[0] != ka.shape[0]:
        raise ValueError(f"idx must be (Hkv, K) = ({ka.shape[0]}, K), got {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= ka.shape[1]):
        raise ValueError(f"idx must lie in [0, {ka.shape[1]}), got [{rows.min()}, {rows.max()}]")
    dest = _result(out, qa.shape)
    if not (jit and HAVE_NUMBA):
        gathered = [np.take(ka[h], rows[h], axis=0) for h in range(ka.shape[0])]
        values = [np.take(va[h], rows[h], axis=0) for h in range(ka.shape[0])]
        return _reference(qa, np.stack(gathered), np.stack(values), dest)
    return _run(qa, ka, va, rows, rows.shape[1], dest, scratch, native)


def remapped_attend(q, k, v, idx, base: int, moved: int, lo_table, hi_table, block: int, out=None,
                    scratch=None) -> np.ndarray | None:
    """Attention of q (H, D) over the selection idx (Hkv, K) of k, v (Hkv, Ncap, D), re-positioned
    past the model's window as spotlight/beyond.py's remapped_decode does: column j < `moved`
    rotated forward to position base - K + j, the rest (the local window) as they are. lo_table
    (block, 2D) and hi_table (rows, 2D) fp32 hold cos | sin of deltas (positions.Rotations.tables),
    hi_table covering deltas up to base. One call of kernels/attend.c: the keys are rotated as
    they are read, nothing is gathered. Returns (H, D) float32, or None where attend.c cannot
    run this (no C kernel, or the geometry does not fit): the caller takes the torch path."""
    qa, ka, va = _check(q, k, v)
    rows = np.ascontiguousarray(as_numpy(idx), dtype=np.int32)  # (Hkv, K)
    lo, hi = (np.ascontiguousarray(as_numpy(t), dtype=np.float32) for t in (lo_table, hi_table))
    hkv, capacity, dim = ka.shape
    half = ka.dtype == np.float16
    if not (c_attend_fits(qa.shape[0], hkv, dim) and ka.strides == va.strides and (C_ATTEND_F16 or not half)):
        return None
    _check_selection(rows, hkv, moved, min(capacity, base))
    _check_tables(lo, hi, block, base, dim)
    dest = _result(out, qa.shape)
    buf = scratch if scratch is not None else new_attend_scratch(qa.shape[0], hkv, dim)
    if not buf.fits(qa.shape[0], hkv, dim):
        raise ValueError("scratch was made for other head counts or head dim: call make_attend_scratch again")
    count = rows.shape[1]
    workers, splits = attend_splits(count, buf)
    status = _NATIVE.attend_decode(
        qa.ctypes.data, qa.shape[0], hkv, dim, ka.ctypes.data, va.ctypes.data, ka.strides[0] // ka.itemsize,
        rows.ctypes.data, count, count, splits, *buf.addresses, dest.ctypes.data, workers, int(half), lo.ctypes.data,
        hi.ctypes.data, block, base, moved)
    assert status == 0, status  # the checks above cover attend.c's
    return dest


def selected_scores(q, k, idx, base: int = 0, moved: int = 0, lo_table=None, hi_table=None, block: int = 0,
                    out=None) -> np.ndarray | None:
    """Scores (Hkv, G, K) float32 = q . key / sqrt(D) of each KV head's query group (q (H, D)) over
    its selected rows idx (Hkv, K) of k (Hkv, Ncap, D), the first `moved` columns re-positioned past
    the model's window as `remapped_attend` reads them (with its tables; moved 0: as stored): the
    scores whose softmax a sparse or re-positioned decode step weighs. One kernels/attend.c call;
    None where it cannot run this (no C kernel, or the geometry does not fit)."""
    qa = np.ascontiguousarray(as_numpy(q), dtype=np.float32)
    ka = as_numpy(k)
    hkv, capacity, dim = ka.shape
    half = ka.dtype == np.float16
    rows_contiguous = ka.strides[1:] == (dim * ka.itemsize, ka.itemsize)
    if not (C_ATTEND and hasattr(_NATIVE, "attend_scores") and c_attend_fits(qa.shape[0], hkv, dim)
            and (C_ATTEND_F16 or not half) and ka.dtype in (np.float16, np.float32) and rows_contiguous):
        return None
    rows = np.ascontiguousarray(as_numpy(idx), dtype=np.int32)  # (Hkv, K)
    _check_selection(rows, hkv, moved, min(capacity, base) if moved else capacity)
    lo = hi = None
    if moved:
        lo, hi = (np.ascontiguousarray(as_numpy(t), dtype=np.float32) for t in (lo_table, hi_table))
        _check_tables(lo, hi, block, base, dim)
    group, count = qa.shape[0] // hkv, rows.shape[1]
    dest = _result(out, (hkv, group, count))
    status = _NATIVE.attend_scores(
        qa.ctypes.data, qa.shape[0], hkv, dim, ka.ctypes.data, ka.strides[0] // ka.itemsize, rows.ctypes.data, count,
        count, int(half), None if lo is None else lo.ctypes.data, None if hi is None else hi.ctypes.data, block, base,
        moved, dest.ctypes.data, threads())
    assert status == 0, status  # the checks above cover attend.c's
    return dest


def _check_selection(rows: np.ndarray, hkv: int, moved: int, limit: int) -> None:
    """A selection (Hkv, K) of rows below `limit`, its first `moved` columns re-positioned."""
    if rows.ndim != 2 or rows.shape[0] != hkv or not 0 <= moved <= rows.shape[1]:
        raise ValueError(f"idx must be (Hkv, K) = ({hkv}, K) with moved <= K, got {rows.shape} and moved {moved}")
    if rows.size and (rows.min() < 0 or rows.max() >= limit):
        raise ValueError(f"idx must lie in [0, {limit}), got [{rows.min()}, {rows.max()}]")


def _check_tables(lo: np.ndarray, hi: np.ndarray, block: int, base: int, dim: int) -> None:
    """positions.Rotations' tables: lo (block, 2D), hi (rows, 2D) covering deltas up to base."""
    if lo.shape != (block, 2 * dim) or hi.ndim != 2 or hi.shape[1] != 2 * dim or hi.shape[0] * block <= base:
        raise ValueError(f"rotation tables must be (block, 2D) and (rows, 2D) covering deltas to {base}; "
                         f"got {lo.shape} and {hi.shape} for D = {dim}")


def _run(q, k, v, rows, count, dest, scratch, native=True):
    hkv, _, dim = k.shape
    buf = scratch if scratch is not None else new_attend_scratch(q.shape[0], hkv, dim)
    if not buf.fits(q.shape[0], hkv, dim):
        raise ValueError("scratch was made for other head counts or head dim: call make_attend_scratch again")
    workers, splits = attend_splits(count, buf)
    half = k.dtype == np.float16
    if native and c_attend_fits(q.shape[0], hkv, dim) and k.strides == v.strides and (C_ATTEND_F16 or not half):
        # kernels/attend.c: the same arithmetic, two queries per row load (its header); fp16 rows
        # are widened to fp32 as they are loaded
        contiguous = rows is None
        status = _NATIVE.attend_decode(
            q.ctypes.data, q.shape[0], hkv, dim, k.ctypes.data, v.ctypes.data,
            k.strides[0] // k.itemsize, None if contiguous else rows.ctypes.data, 0 if contiguous else rows.shape[1],
            count, splits, *buf.addresses, dest.ctypes.data, workers, int(half), None, None, 0, 0, 0)
        assert status == 0, status  # c_attend_fits checked the geometry
        return dest
    if half:  # the numba kernels read fp32: the rows read, widened once (a copy of count rows per head)
        k, v = _widened(k, rows, count), _widened(v, rows, count)
        rows = None
    np.multiply(q.reshape(buf.scaled_q.shape), np.float32(math.log2(math.e) / math.sqrt(dim)), out=buf.scaled_q)
    tags = ((0,) * buf.scaled_q.shape[1], (0,) * (dim // 8), (0,) * (dim % 8))  # compile-time G and D
    contiguous = rows is None
    rows = buf.dummy_rows if contiguous else rows
    out3 = dest.reshape(buf.scaled_q.shape)  # (Hkv, G, D)
    if workers > 1:
        from .cpu import _numba_threads

        _numba_threads()
        jitted()._attend_parallel(buf.scaled_q, k, v, rows, count, contiguous, splits, buf.scores[:workers],
                                  buf.power, buf.bits, buf.stats, buf.acc, out3, *tags)
    else:
        jitted()._attend_serial(buf.scaled_q, k, v, rows, count, contiguous, splits, buf.scores, buf.power, buf.bits,
                                buf.stats, buf.acc, out3, *tags)
    return dest


def _widened(rows_of, rows, count) -> np.ndarray:
    """fp32 copy (Hkv, count, D) of the rows [0, count) of rows_of (Hkv, Ncap, D), or of rows (Hkv, count)."""
    if rows is None:
        return rows_of[:, :count].astype(np.float32)
    return np.stack([np.take(rows_of[h], rows[h], axis=0) for h in range(rows_of.shape[0])]).astype(np.float32)


def _check(q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    qa, ka, va = as_numpy(q), as_numpy(k), as_numpy(v)
    if qa.dtype != np.float32:
        raise ValueError(f"q must be float32 on the CPU backend, got {qa.dtype}")
    for name, a in (("k", ka), ("v", va)):
        if a.dtype not in (np.float32, np.float16) or a.dtype != ka.dtype:
            raise ValueError(f"{name} must be float32 or float16 (k and v alike) on the CPU backend, got {a.dtype}")
    if qa.ndim != 2 or ka.ndim != 3 or ka.shape != va.shape or qa.shape[1] != ka.shape[2] or qa.shape[0] % ka.shape[0]:
        raise ValueError(f"need q (H, D), k and v (Hkv, Ncap, D) with Hkv | H; got {qa.shape}, {ka.shape}, {va.shape}")
    if not (ka[0].flags.c_contiguous and va[0].flags.c_contiguous) or ka.strides[1:] != va.strides[1:]:
        raise ValueError("k and v must be row-major per head (e.g. cache.k[layer], a view of the capacity buffer)")
    return np.ascontiguousarray(qa), ka, va


def _result(out, shape) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    a = as_numpy(out)
    if a.shape != shape or a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {shape}, got {a.dtype} {a.shape}")
    return a


def _reference(q, k, v, dest) -> np.ndarray:
    """Softmax attention in float64 (the numpy backend and the tests' reference). k, v (Hkv, K, D)."""
    hkv, _, dim = k.shape
    qg = q.reshape(hkv, -1, dim).astype(np.float64)  # (Hkv, G, D)
    logits = qg @ k.astype(np.float64).transpose(0, 2, 1) / math.sqrt(dim)  # (Hkv, G, K)
    if logits.shape[-1] == 0:
        dest[...] = 0.0
        return dest
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    dest[...] = (weights @ v.astype(np.float64)).reshape(dest.shape)  # (H, D)
    return dest
