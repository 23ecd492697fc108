"""The folded scan over key codes stored as byte planes: kernels/scan.c (CPU, AVX2).

Shape legend as kernels/__init__.py; P = 8 W byte planes, Pcap their token capacity.

Key codes are word-major (Hkv, W, Ncap) uint64 everywhere (spotlight/cache.py KeyCodes). A host
cache also keeps them as byte planes (Hkv, P, Pcap) uint8, byte j of every token's code in one row
(`write_planes`), because on AVX2 the scan's popcounts cost ~20 instructions a token for Qwen2.5's
G = 7 and 128 bits, where byte planes score 32 tokens with two table lookups a plane
(docs/DECISIONS.md, "Where the 131K far step goes on AVX2"). `planes_select_blocks` returns
exactly what `score_select_blocks` returns for the same codes (tests/test_kernels.py).
"""
from __future__ import annotations

import ctypes

import numpy as np

from .cpu import _fill_all, as_codes, check_cover, fill_forced, result, selection_layout, threads
from .quant import _LIB as _NATIVE  # the one compiled library of the CPU kernels

C_PLANES = bool(_NATIVE is not None and hasattr(_NATIVE, "planes_available") and _NATIVE.planes_available())
MAX_WORDS, MAX_GROUP, CAND_SLACK = 4, 15, 8  # scan.c's MAX_WORDS, MAX_GROUP and CAND_SLACK
if C_PLANES:
    _p, _i64 = ctypes.c_void_p, ctypes.c_int64
    _NATIVE.planes_write.argtypes = [_p, _i64, _i64, _i64, _i64, _i64, _p, _i64]
    _NATIVE.planes_write.restype = ctypes.c_int
    _NATIVE.planes_select.argtypes = [_p, _i64, _i64, _i64, _p, _p, _i64, _i64, _i64, _p, _i64, _p, _p, _p,
                                      ctypes.c_int]
    _NATIVE.planes_select.restype = ctypes.c_int


def planes_fit(heads: int, kv_heads: int, words: int) -> bool:
    """Whether scan.c takes this geometry (and is built)."""
    return C_PLANES and words <= MAX_WORDS and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP


def write_planes(k_codes: np.ndarray, lo: int, hi: int, planes: np.ndarray) -> None:
    """planes[h, 8 w + j, t] = byte j of k_codes[h, w, t] for tokens [lo, hi): k_codes (Hkv, W, Ncap)
    uint64, planes (Hkv, 8 W, Pcap) uint8, both C-contiguous."""
    k = as_codes(k_codes, "k_codes")
    hkv, words, capacity = k.shape
    if planes.dtype != np.uint8 or planes.shape[:2] != (hkv, 8 * words) or not planes.flags.c_contiguous:
        raise ValueError(f"planes must be C-contiguous uint8 ({hkv}, {8 * words}, Pcap), got {planes.dtype} {planes.shape}")
    if not 0 <= lo <= hi <= min(capacity, planes.shape[2]):
        raise ValueError(f"tokens [{lo}, {hi}) must lie within the codes' {capacity} and the planes' {planes.shape[2]}")
    if not C_PLANES:  # nothing reads planes without scan.c (planes_fit)
        raise ValueError("kernels/scan.c is not built: run `make setup` (byte planes are only read by it)")
    if _NATIVE.planes_write(k.ctypes.data, hkv, words, capacity, lo, hi, planes.ctypes.data, planes.shape[2]):
        raise ValueError(f"scan.c takes at most {MAX_WORDS} words a code, got {words}")


class PlaneScratch:
    """scan.c's scratch for one (H, Hkv, 8 W, Pcap): int16 scores (Hkv, Pcap), int32 candidates (Hkv, Pcap +
    CAND_SLACK), histograms."""

    def __init__(self, heads: int, kv_heads: int, planes: int, capacity: int):
        words = planes // 8
        self.key = (heads, kv_heads, words, capacity)
        self.scores = np.empty((kv_heads, capacity), np.int16)
        self.candidates = np.empty((kv_heads, capacity + CAND_SLACK), np.int32)  # collect stores eight at a time
        self.hist = np.empty((kv_heads, (heads // kv_heads) * 64 * words + 1), np.int64)
        # taken once: .ctypes.data costs ~1 us, and a far decode step calls the scan once per layer
        self.addresses = (self.scores.ctypes.data, self.candidates.ctypes.data, self.hist.ctypes.data)

    def fits(self, heads: int, planes: np.ndarray) -> bool:
        """Whether it was made for H = heads query heads over these planes (Hkv, 8 W, Pcap)."""
        hkv, rows, capacity = planes.shape
        return self.key == (heads, hkv, rows // 8, capacity)


def planes_select_blocks(q_codes, planes: np.ndarray, n: int, bounds, k: int, sinks: int, window: int,
                         out=None, scratch: PlaneScratch | None = None) -> np.ndarray:
    """`score_select_blocks(q_codes, k_codes, n, bounds, k, sinks, window)` read from the codes' byte
    planes (Hkv, 8 W, Pcap), tokens [0, n) written: int32 (Hkv, K), the same indices.

    q_codes (R, H, W): block r's query codes; bounds (R + 1,) ascending, covering the middle.
    Needs scan.c (`planes_fit`); scratch: a PlaneScratch for this geometry (made when None).
    """
    q = as_codes(q_codes, "q_codes")
    layout = selection_layout(n, k, sinks, window)
    b = check_cover(q, bounds, layout)
    hkv, words8, capacity = planes.shape
    heads, words = q.shape[1], q.shape[2]
    if words8 != 8 * words or heads % hkv or planes.dtype != np.uint8 or not planes.flags.c_contiguous \
            or n > capacity:
        raise ValueError(f"planes {planes.dtype} {planes.shape} do not hold {n} tokens of codes for q_codes {q.shape}")
    if not planes_fit(heads, hkv, words):
        raise ValueError("kernels/scan.c is not built or does not take this geometry: use score_select_blocks")
    dest = result(out, (hkv, layout.size), np.int32)
    if layout.retrieved in (0, layout.middle):
        _fill_all(dest, layout)
        return dest
    if scratch is None or not scratch.fits(heads, planes):
        scratch = PlaneScratch(heads, hkv, words8, capacity)
    # the middle as the blocks' bounds clipped to it (a block may reach into the sinks or the window;
    # select_far's bounds are the middle's own, and np.clip costs ~5 us)
    inside = int(b[0]) >= layout.sinks_end and int(b[-1]) <= layout.window_start
    middle = b if inside else np.clip(b, layout.sinks_end, layout.window_start)
    status = _NATIVE.planes_select(q.ctypes.data, len(q), heads, words, middle.ctypes.data, planes.ctypes.data, hkv,
                                   capacity, layout.retrieved, dest.ctypes.data + dest.itemsize * layout.sinks_end,
                                   dest.shape[1], *scratch.addresses, threads())
    if status:
        raise ValueError(f"kernels/scan.c refused q_codes {q.shape}, bounds {b.tolist()} and {layout}")
    fill_forced(dest, layout)
    return dest


__all__ = ["C_PLANES", "planes_fit", "write_planes", "PlaneScratch", "planes_select_blocks"]
