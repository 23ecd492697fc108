"""numba kernels of kernels/attend_cpu.py: the fallback of kernels/attend.c and its check in tests,
imported at their first use (`attend_cpu.jitted`), as kernels/cpu_jit.py is. Numerics and shapes:
kernels/attend_cpu.py."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .attend_cpu import FASTMATH, FLOAT_MIN, PREFETCH_AHEAD


@intrinsic
def prefetch_row(typingctx, rows, row):
    """Hint the cache lines of rows[row, :] (a 2-D float32 array, row-major) into the caches."""
    sig = types.void(rows, row)

    def codegen(context, builder, signature, args):
        array_type, index_type = signature.args
        array = context.make_array(array_type)(context, builder, args[0])
        shape = cgutils.unpack_tuple(builder, array.shape)
        index = context.cast(builder, args[1], index_type, types.intp)
        pointer = cgutils.get_item_pointer2(context, builder, data=array.data, shape=shape,
                                            strides=cgutils.unpack_tuple(builder, array.strides),
                                            layout=array_type.layout, inds=[index, context.get_constant(types.intp, 0)],
                                            wraparound=False)
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        base = builder.bitcast(pointer, byte_pointer)
        for line in range(4):  # 256 bytes: a row of D = 64 fp32 values (longer rows: the first 256 B)
            builder.call(fn, [builder.gep(base, [ir.Constant(ir.IntType(64), 64 * line)]), ir.Constant(i32, 0),
                              ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def dims(d8_tag, d1_tag):
    """D = 8 * len(d8_tag) + len(d1_tag), a compile-time constant from tuples short enough for parfors."""
    return 8 * len(d8_tag) + len(d1_tag)


@njit(inline="always", fastmath=FASTMATH)
def _exp2_parts(x):
    """(p, e) with 2^x = p * 2^e, p in [1, 2), for x in [-126, 0]."""
    e = np.floor(x)
    f = x - e
    # least-squares fit of 2^f on [0, 1] (relative weights, Chebyshev nodes): |rel err| < 1.1e-7 in fp32
    p = np.float32(2.1690609004527763e-4)
    p = p * f + np.float32(1.2443081554968543e-3)
    p = p * f + np.float32(9.678472549665511e-3)
    p = p * f + np.float32(5.5483524726123015e-2)
    p = p * f + np.float32(2.4022979581386028e-1)
    p = p * f + np.float32(6.931469870574893e-1)
    p = p * f + np.float32(1.0000000018154944)
    return p, np.int32(e)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _exp2_block(s, count, top, power, bits):
    """s[:count] <- 2^(s - top) (clamped below at 2^-126); returns their sum."""
    for j in range(count):
        p, e = _exp2_parts(max(s[j] - top, np.float32(-126.0)))
        power[j] = p
        bits[j] = (e + 127) << 23  # the float 2^e
    scale = bits[:count].view(np.float32)
    total = np.float32(0.0)
    for j in range(count):
        s[j] = power[j] * scale[j]
        total += s[j]
    return total


@njit(fastmath=FASTMATH, cache=True)
def _attend_rows(qh, kh, vh, rows, lo, hi, contiguous, s, power, bits, stats, acc, g_tag, d8_tag, d1_tag):
    """Online softmax of the G queries qh (G, D) over rows [lo, hi) of one head.

    Rows are lo..hi-1 themselves (contiguous) or rows[lo:hi]. Leaves, per query, the running
    max stats[0], the sum of 2^(s - max) stats[1] and the unnormalised output acc (G, D).
    """
    group, dim = len(g_tag), dims(d8_tag, d1_tag)
    for i in range(group):
        stats[0, i] = FLOAT_MIN
        stats[1, i] = 0.0
        for e in range(dim):
            acc[i, e] = 0.0
    for j0 in range(lo, hi, s.shape[1]):
        count = min(s.shape[1], hi - j0)
        for j in range(count):  # scores; prefetch the rows ahead and this row's V
            r = j0 + j if contiguous else rows[j0 + j]
            ahead = j0 + j + PREFETCH_AHEAD
            if ahead < hi:
                prefetch_row(kh, ahead if contiguous else rows[ahead])
            prefetch_row(vh, r)
            for i in range(group):
                dot = np.float32(0.0)
                for e in range(dim):
                    dot += qh[i, e] * kh[r, e]
                s[i, j] = dot
        for i in range(group):  # online softmax update
            top = stats[0, i]
            for j in range(count):
                top = max(top, s[i, j])
            mantissa, exponent = _exp2_parts(max(stats[0, i] - top, np.float32(-126.0)))
            rescale = mantissa * np.float32(2.0) ** np.float32(exponent)
            stats[1, i] = stats[1, i] * rescale + _exp2_block(s[i], count, top, power, bits)
            stats[0, i] = top
            for e in range(dim):
                acc[i, e] *= rescale
        for j in range(count):  # weighted sum of V rows (in cache: prefetched above)
            r = j0 + j if contiguous else rows[j0 + j]
            for i in range(group):
                weight = s[i, j]
                for e in range(dim):
                    acc[i, e] += weight * vh[r, e]


@njit(fastmath=FASTMATH, cache=True)
def _piece(q, k, v, rows, count, contiguous, splits, piece, scratch_s, scratch_p, scratch_b, stats, acc,
           g_tag, d8_tag, d1_tag):
    """Partial result of piece = head * splits + split: rows [count*split/S, count*(split+1)/S)."""
    h, split = piece // splits, piece % splits
    lo, hi = count * split // splits, count * (split + 1) // splits
    _attend_rows(q[h], k[h], v[h], rows[h], lo, hi, contiguous, scratch_s, scratch_p, scratch_b, stats[piece],
                 acc[piece], g_tag, d8_tag, d1_tag)


@njit(fastmath=FASTMATH, cache=True)
def _merge(stats, acc, splits, out):
    """out (Hkv, G, D) = the splits' partial results combined (log-sum-exp in base 2)."""
    hkv, group, dim = out.shape  # (Hkv, G, D)
    for h in range(hkv):
        for i in range(group):
            top = FLOAT_MIN
            for sp in range(splits):
                top = max(top, stats[h * splits + sp, 0, i])
            total = np.float32(0.0)
            for e in range(dim):
                out[h, i, e] = 0.0
            for sp in range(splits):
                piece = h * splits + sp
                w = np.float32(2.0) ** (stats[piece, 0, i] - top)
                total += w * stats[piece, 1, i]
                for e in range(dim):
                    out[h, i, e] += w * acc[piece, i, e]
            inv = np.float32(1.0) / total if total > 0 else np.float32(0.0)
            for e in range(dim):
                out[h, i, e] *= inv


@njit(fastmath=FASTMATH, cache=True)
def _attend_serial(q, k, v, rows, count, contiguous, splits, scratch, power, bits, stats, acc, out, g_tag, d8_tag, d1_tag):
    for piece in range(k.shape[0] * splits):
        _piece(q, k, v, rows, count, contiguous, splits, piece, scratch[0], power[0], bits[0], stats, acc,
               g_tag, d8_tag, d1_tag)
    _merge(stats, acc, splits, out)


@njit(fastmath=FASTMATH, parallel=True, cache=True)
def _attend_parallel(q, k, v, rows, count, contiguous, splits, scratch, power, bits, stats, acc, out, g_tag,
                     d8_tag, d1_tag):
    workers = scratch.shape[0]
    pieces = k.shape[0] * splits
    for w in prange(workers):
        for piece in range(w * pieces // workers, (w + 1) * pieces // workers):
            _piece(q, k, v, rows, count, contiguous, splits, piece, scratch[w], power[w], bits[w], stats, acc,
                   g_tag, d8_tag, d1_tag)
    _merge(stats, acc, splits, out)
