"""numba kernels of kernels/quant.py: decode GGUF blocks in registers, one row at a time (the fallback
where kernels/quant.c lacks a format; imported at the first call that runs one: `quant.jitted`).

Shape legend as in kernels/quant.py: F rows, E cols, S blocks per row, R bytes per block, L values
per group (the run that shares one scale), U = E / L groups per row.

Block layouts (ggml-quants, little-endian; "f16" is an IEEE half; d scale, m/dmin minimum):
  Q4_0  f16 d, 16 B nibbles                     w = d * (q - 8)      q in [0, 16)
  Q4_1  f16 d, f16 m, 16 B nibbles              w = d * q + m
  Q5_0  f16 d, u32 high bits, 16 B nibbles      w = d * (q - 16)     q in [0, 32)
  Q5_1  f16 d, f16 m, u32 high bits, 16 B       w = d * q + m
  Q8_0  f16 d, 32 int8                          w = q * d
  nibble i of a 32-value block: byte i % 16, low nibble for i < 16, high nibble above.
  Q4_K  f16 d, f16 dmin, 12 B packed 6-bit scales/mins, 128 B nibbles (8 sub-blocks of 32)
                                                w = (d * sc) * q - dmin * mn
  Q5_K  as Q4_K plus 32 B high bits before the nibbles (bit j of byte l: sub-block j, value l)
  Q6_K  128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, f16 d (16 sub-blocks of 16)
                                                w = (d * sc) * (q - 32)

Why numba and this loop shape (measured: docs/notes-quant.md, bench/quant_speed.py):
  * every inner loop runs over one group of L values with its trip count read from an array
    shape (`xg.shape[1]`), never a constant: with a constant LLVM unrolls the loop and its SLP
    pass then leaves it scalar (~1 GB/s), while the loop vectoriser turns the runtime-count loop
    into AVX2 byte-extend / convert / multiply code;
  * the dot kernels add into a lane accumulator acc[l] (lane l of every group) and sum the L
    lanes once per row. That elementwise loop vectorises with fastmath off; a scalar running sum
    only vectorises with "reassoc", and then pays a horizontal sum per group (3x slower at L = 16);
  * integer parts stay int32 before conversion (AVX2 has no vector int64 -> float);
  * activations are never quantized: an int8-activation variant (llama.cpp's approach) was no
    faster in numba on AVX2 (no pmaddubsw from this IR) and had relative error 5e-3..2e-2.
Each row is summed by one thread in one fixed order, so results are bit-identical for any
thread count (kernels.set_threads).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .quant import (HALF, K_SUB, KIND_Q4_0, KIND_Q4_1, KIND_Q4_K, KIND_Q5_0, KIND_Q5_1, KIND_Q5_K, KIND_Q8_0, NIBBLES_AT,
                    Q6_SUB, QK_K, SCALE_BYTES_K)

I32 = np.int32
F32 = np.float32


@njit(inline="always")
def _half(f16, rb, b, at):
    """The fp16 at byte `at` of block b of one row's blocks rb (S, R), as fp32."""
    return f16[np.int64(rb[b, at]) | (np.int64(rb[b, at + 1]) << 8)]


@njit(inline="always")
def _bits32(rb, b, at):
    """The little-endian uint32 at byte `at` of block b, as int64."""
    return (np.int64(rb[b, at]) | (np.int64(rb[b, at + 1]) << 8)
            | (np.int64(rb[b, at + 2]) << 16) | (np.int64(rb[b, at + 3]) << 24))


@njit(inline="always")
def _scale_min_k4(rb, b, j):
    """Sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block (ggml get_scale_min_k4)."""
    at = 4  # after f16 d and f16 dmin
    if j < 4:
        return I32(rb[b, at + j] & 63), I32(rb[b, at + 4 + j] & 63)
    sc = (I32(rb[b, at + 8 + j - 4]) & 15) | ((I32(rb[b, at + j - 4]) >> 6) << 4)
    mn = (I32(rb[b, at + 8 + j - 4]) >> 4) | ((I32(rb[b, at + 4 + j - 4]) >> 6) << 4)
    return sc, mn


# ------------------------------------------------------------------ one row: rb (S, R) uint8
# Dot kernels take xg = x viewed as (U, L) and a lane accumulator acc (L,); dequantize kernels
# write dg (U, L). Group u of a legacy block b: u = 2b (low nibbles / first half) and 2b + 1;
# of a k-quant super-block b: u = b * (V / L) + sub-block. NOTE: the dot kernels add into
# acc[l] (lane l of every group) and sum the L lanes at the end of the row. That elementwise
# loop vectorises without fastmath; a scalar running sum needs "reassoc" to vectorise and
# then runs a horizontal sum per group, which at L = 16 LLVM leaves scalar (3x slower).


@njit(cache=True, inline="always")
def _lanes_sum(acc):
    total = F32(0.0)
    for l in range(acc.shape[0]):
        total += acc[l]
        acc[l] = F32(0.0)  # ready for the next row
    return total


@njit(cache=True)
def _dot_q4_0(f16, rb, xg, acc):
    for b in range(rb.shape[0]):
        d = _half(f16, rb, b, 0)
        for l in range(xg.shape[1]):
            v = I32(rb[b, 2 + l])
            acc[l] += (d * F32(I32((v & 15) - 8))) * xg[2 * b, l] + (d * F32(I32((v >> 4) - 8))) * xg[2 * b + 1, l]
    return _lanes_sum(acc)


@njit(cache=True)
def _dot_q4_1(f16, rb, xg, acc):
    for b in range(rb.shape[0]):
        d, m = _half(f16, rb, b, 0), _half(f16, rb, b, 2)
        for l in range(xg.shape[1]):
            v = I32(rb[b, 4 + l])
            acc[l] += (d * F32(I32(v & 15)) + m) * xg[2 * b, l] + (d * F32(I32(v >> 4)) + m) * xg[2 * b + 1, l]
    return _lanes_sum(acc)


@njit(cache=True)
def _dot_q5_0(f16, rb, xg, acc):
    for b in range(rb.shape[0]):
        d, qh = _half(f16, rb, b, 0), _bits32(rb, b, 2)
        for l in range(xg.shape[1]):
            v = I32(rb[b, 6 + l])
            lo = I32((v & 15) | (I32((qh >> l) & 1) << 4)) - 16
            hi = I32((v >> 4) | (I32((qh >> (l + HALF)) & 1) << 4)) - 16
            acc[l] += (d * F32(I32(lo))) * xg[2 * b, l] + (d * F32(I32(hi))) * xg[2 * b + 1, l]
    return _lanes_sum(acc)


@njit(cache=True)
def _dot_q5_1(f16, rb, xg, acc):
    for b in range(rb.shape[0]):
        d, m, qh = _half(f16, rb, b, 0), _half(f16, rb, b, 2), _bits32(rb, b, 4)
        for l in range(xg.shape[1]):
            v = I32(rb[b, 8 + l])
            lo = I32((v & 15) | (I32((qh >> l) & 1) << 4))
            hi = I32((v >> 4) | (I32((qh >> (l + HALF)) & 1) << 4))
            acc[l] += (d * F32(lo) + m) * xg[2 * b, l] + (d * F32(hi) + m) * xg[2 * b + 1, l]
    return _lanes_sum(acc)


@njit(cache=True)
def _dot_q8_0(f16, rb, xg, acc):
    for b in range(rb.shape[0]):
        d = _half(f16, rb, b, 0)
        for l in range(xg.shape[1]):
            acc[l] += (F32(np.int8(rb[b, 2 + l])) * d) * xg[b, l]
    return _lanes_sum(acc)


@njit(cache=True)
def _dot_q8_0_pair(f16, ra, rb, xg, acc, out, r):
    """out[r], out[r + 1] from rows ra, rb: one pass over x for both (1.3-1.6x faster than two
    single rows for Q8_0; no gain for Q4_1, docs/notes-quant.md). acc: (2, L). The same
    operations per row as _dot_q8_0 (fastmath off), hence the same bits."""
    first, second = acc[0], acc[1]
    for b in range(ra.shape[0]):
        d0, d1 = _half(f16, ra, b, 0), _half(f16, rb, b, 0)
        for l in range(xg.shape[1]):
            xl = xg[b, l]
            first[l] += (F32(np.int8(ra[b, 2 + l])) * d0) * xl
            second[l] += (F32(np.int8(rb[b, 2 + l])) * d1) * xl
    out[r], out[r + 1] = _lanes_sum(first), _lanes_sum(second)


@njit(cache=True)
def _dot_q4_k(f16, rb, xg, acc):
    subs = QK_K // K_SUB
    qs = 4 + SCALE_BYTES_K
    for b in range(rb.shape[0]):
        d, dmin = _half(f16, rb, b, 0), _half(f16, rb, b, 2)
        for pair in range(subs // 2):  # sub-blocks 2 * pair (low nibbles) and 2 * pair + 1 (high)
            j = 2 * pair
            sc0, mn0 = _scale_min_k4(rb, b, j)
            sc1, mn1 = _scale_min_k4(rb, b, j + 1)
            d0, m0, d1, m1 = d * F32(sc0), dmin * F32(mn0), d * F32(sc1), dmin * F32(mn1)
            u, at = b * subs + j, qs + pair * K_SUB
            for l in range(xg.shape[1]):
                v = I32(rb[b, at + l])
                acc[l] += (d0 * F32(I32(v & 15)) - m0) * xg[u, l] + (d1 * F32(I32(v >> 4)) - m1) * xg[u + 1, l]
    return _lanes_sum(acc)


@njit(cache=True)
def _dot_q5_k(f16, rb, xg, acc):
    subs = QK_K // K_SUB
    qh_at = 4 + SCALE_BYTES_K
    qs = qh_at + QK_K // 8
    for b in range(rb.shape[0]):
        d, dmin = _half(f16, rb, b, 0), _half(f16, rb, b, 2)
        for pair in range(subs // 2):
            j = 2 * pair
            sc0, mn0 = _scale_min_k4(rb, b, j)
            sc1, mn1 = _scale_min_k4(rb, b, j + 1)
            d0, m0, d1, m1 = d * F32(sc0), dmin * F32(mn0), d * F32(sc1), dmin * F32(mn1)
            u, at = b * subs + j, qs + pair * K_SUB
            for l in range(xg.shape[1]):
                v, h = I32(rb[b, at + l]), I32(rb[b, qh_at + l])
                lo = I32((v & 15) | (((h >> j) & 1) << 4))
                hi = I32((v >> 4) | (((h >> (j + 1)) & 1) << 4))
                acc[l] += (d0 * F32(lo) - m0) * xg[u, l] + (d1 * F32(hi) - m1) * xg[u + 1, l]
    return _lanes_sum(acc)


@njit(cache=True)
def _dot_q6_k(f16, rb, xg, acc):
    """One pass over 16 positions of a (half, g) yields the four quarters' values (ggml's
    order): constant shifts, and each ql / qh byte loaded once (3x faster than a pass per
    sub-block with shifts chosen at run time)."""
    subs = QK_K // Q6_SUB  # 16 sub-blocks: sub = half * 8 + quarter * 2 + g
    qh_at, sc_at, d_at = QK_K // 2, QK_K // 2 + QK_K // 4, QK_K // 2 + QK_K // 4 + subs
    for b in range(rb.shape[0]):
        d = _half(f16, rb, b, d_at)
        for half in range(2):
            for g in range(2):
                sub = half * 8 + g  # quarter 0; quarters 1, 2, 3 are sub + 2, + 4, + 6
                d0 = d * F32(np.int8(rb[b, sc_at + sub]))
                d1 = d * F32(np.int8(rb[b, sc_at + sub + 2]))
                d2 = d * F32(np.int8(rb[b, sc_at + sub + 4]))
                d3 = d * F32(np.int8(rb[b, sc_at + sub + 6]))
                lo_at, hi_at, u = half * 64 + g * Q6_SUB, qh_at + half * 32 + g * Q6_SUB, b * subs + sub
                for l in range(xg.shape[1]):
                    a, c, h = I32(rb[b, lo_at + l]), I32(rb[b, lo_at + 32 + l]), I32(rb[b, hi_at + l])
                    q0 = I32((a & 15) | ((h & 3) << 4)) - 32
                    q1 = I32((c & 15) | (((h >> 2) & 3) << 4)) - 32
                    q2 = I32((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                    q3 = I32((c >> 4) | ((h >> 6) << 4)) - 32
                    acc[l] += ((d0 * F32(I32(q0))) * xg[u, l] + (d1 * F32(I32(q1))) * xg[u + 2, l]
                               + (d2 * F32(I32(q2))) * xg[u + 4, l] + (d3 * F32(I32(q3))) * xg[u + 6, l])
    return _lanes_sum(acc)


@njit(cache=True)
def _row_dot(kind, f16, rb, xg, acc):
    if kind == KIND_Q4_0:
        return _dot_q4_0(f16, rb, xg, acc)
    if kind == KIND_Q4_1:
        return _dot_q4_1(f16, rb, xg, acc)
    if kind == KIND_Q5_0:
        return _dot_q5_0(f16, rb, xg, acc)
    if kind == KIND_Q5_1:
        return _dot_q5_1(f16, rb, xg, acc)
    if kind == KIND_Q8_0:
        return _dot_q8_0(f16, rb, xg, acc)
    if kind == KIND_Q4_K:
        return _dot_q4_k(f16, rb, xg, acc)
    if kind == KIND_Q5_K:
        return _dot_q5_k(f16, rb, xg, acc)
    return _dot_q6_k(f16, rb, xg, acc)


@njit(cache=True)
def _dot_rows(kind, f16, blocks, xg, bias, has_bias, out, row_start, row_end):
    """out[r] for r in [row_start, row_end); its lane accumulators allocated once."""
    acc = np.zeros((2, xg.shape[1]), np.float32)  # (2, L)
    first = row_start
    if kind == KIND_Q8_0:  # Q8_0: pairs of rows, then the odd one out
        for r in range(row_start, row_end - 1, 2):
            _dot_q8_0_pair(f16, blocks[r], blocks[r + 1], xg, acc, out, r)
        first = row_end - (row_end - row_start) % 2
    for r in range(first, row_end):
        out[r] = _row_dot(kind, f16, blocks[r], xg, acc[0])
    if has_bias:
        for r in range(row_start, row_end):
            out[r] += bias[r]


@njit(cache=True)
def _matvec_serial(kind, f16, blocks, xg, bias, has_bias, out):
    """blocks (F, S, R) uint8, xg (U, L) float32, out (F,) float32."""
    _dot_rows(kind, f16, blocks, xg, bias, has_bias, out, 0, blocks.shape[0])


@njit(cache=True, parallel=True)
def _matvec_parallel(kind, f16, blocks, xg, bias, has_bias, out, runs):
    """_matvec_serial with the rows cut into `runs` runs, one per thread (same bits: a row is
    summed by one thread in the same order whatever the thread count)."""
    rows = blocks.shape[0]
    for run in prange(runs):
        _dot_rows(kind, f16, blocks, xg, bias, has_bias, out, run * rows // runs, (run + 1) * rows // runs)

# Dequantization: the same decoding, written out instead of summed. fastmath off: every weight
# must round exactly as gguf's numpy code rounds it.


@njit(cache=True)
def _deq_legacy(kind, f16, rb, dg):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows into dg (U, L)."""
    for b in range(rb.shape[0]):
        d = _half(f16, rb, b, 0)
        if kind == KIND_Q8_0:
            for l in range(dg.shape[1]):
                dg[b, l] = F32(np.int8(rb[b, 2 + l])) * d
            continue
        m = _half(f16, rb, b, 2) if kind == KIND_Q4_1 or kind == KIND_Q5_1 else F32(0.0)
        qh = _bits32(rb, b, 2) if kind == KIND_Q5_0 else (_bits32(rb, b, 4) if kind == KIND_Q5_1 else np.int64(0))
        at = NIBBLES_AT[kind]
        for l in range(dg.shape[1]):
            v = I32(rb[b, at + l])
            lo = I32((v & 15) | (I32((qh >> l) & 1) << 4))
            hi = I32((v >> 4) | (I32((qh >> (l + HALF)) & 1) << 4))
            if kind == KIND_Q4_0:
                dg[2 * b, l], dg[2 * b + 1, l] = d * F32(I32(lo - 8)), d * F32(I32(hi - 8))
            elif kind == KIND_Q5_0:
                dg[2 * b, l], dg[2 * b + 1, l] = d * F32(I32(lo - 16)), d * F32(I32(hi - 16))
            else:
                dg[2 * b, l], dg[2 * b + 1, l] = d * F32(lo) + m, d * F32(hi) + m


@njit(cache=True)
def _deq_q45_k(f16, rb, dg, has_high):
    subs = QK_K // K_SUB
    qs = 4 + SCALE_BYTES_K + (QK_K // 8 if has_high else 0)
    for b in range(rb.shape[0]):
        d, dmin = _half(f16, rb, b, 0), _half(f16, rb, b, 2)
        for pair in range(subs // 2):
            j = 2 * pair
            sc0, mn0 = _scale_min_k4(rb, b, j)
            sc1, mn1 = _scale_min_k4(rb, b, j + 1)
            d0, m0, d1, m1 = d * F32(sc0), dmin * F32(mn0), d * F32(sc1), dmin * F32(mn1)
            u = b * subs + j
            for l in range(dg.shape[1]):
                v = I32(rb[b, qs + pair * K_SUB + l])
                lo, hi = I32(v & 15), I32(v >> 4)
                if has_high:
                    h = I32(rb[b, 4 + SCALE_BYTES_K + l])
                    lo, hi = lo | (((h >> j) & 1) << 4), hi | (((h >> (j + 1)) & 1) << 4)
                dg[u, l], dg[u + 1, l] = d0 * F32(I32(lo)) - m0, d1 * F32(I32(hi)) - m1


@njit(cache=True)
def _deq_q6_k(f16, rb, dg):
    subs = QK_K // Q6_SUB
    qh_at, sc_at, d_at = QK_K // 2, QK_K // 2 + QK_K // 4, QK_K // 2 + QK_K // 4 + subs
    for b in range(rb.shape[0]):
        d = _half(f16, rb, b, d_at)
        for sub in range(subs):
            half, quarter, g = sub // 8, (sub // 2) % 4, sub % 2
            ds = d * F32(np.int8(rb[b, sc_at + sub]))
            lo_at = half * 64 + (quarter % 2) * 32 + g * Q6_SUB
            hi_at = qh_at + half * 32 + g * Q6_SUB
            lo_shift, hi_shift = (quarter // 2) * 4, quarter * 2
            u = b * subs + sub
            for l in range(dg.shape[1]):
                q = (((I32(rb[b, lo_at + l]) >> lo_shift) & 15) | (((I32(rb[b, hi_at + l]) >> hi_shift) & 3) << 4))
                dg[u, l] = ds * F32(I32(q - 32))


@njit(cache=True)
def _row_dequantize(kind, f16, rb, dg):
    if kind <= KIND_Q8_0:
        _deq_legacy(kind, f16, rb, dg)
    elif kind <= KIND_Q5_K:
        _deq_q45_k(f16, rb, dg, kind == KIND_Q5_K)
    else:
        _deq_q6_k(f16, rb, dg)


@njit(cache=True)
def _dequantize_serial(kind, f16, blocks, dest):
    """blocks (F', S, R) uint8 -> dest (F', U, L) float32."""
    for r in range(blocks.shape[0]):
        _row_dequantize(kind, f16, blocks[r], dest[r])


@njit(cache=True, parallel=True)
def _dequantize_parallel(kind, f16, blocks, dest):
    for r in prange(blocks.shape[0]):
        _row_dequantize(kind, f16, blocks[r], dest[r])
