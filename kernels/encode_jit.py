"""numba kernels of kernels/encode.py: the one-row coder's fallback (where kernels/encode.c is not
built) and `many`'s numpy path, imported at their first use (`encode.jitted`), as kernels/cpu_jit.py
is. Shapes and numerics: kernels/encode.py."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .attend_jit import _exp2_parts
from .cpu import WORD_BITS
from .encode import LOG2E

FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _silu(z, out, power, scale_bits):
    """out (F,) = silu(z) (F,) = z / (1 + exp(-z)) (out may be z); power, scale_bits (F,) scratch."""
    for f in range(z.shape[0]):  # exp(-z) = 2^(-z log2 e) = power * 2^exponent, vectorised
        t = min(max(-z[f] * LOG2E, np.float32(-126.0)), np.float32(126.0))
        power[f], exponent = _exp2_parts(t)
        scale_bits[f] = (exponent + 127) << 23
    scale = scale_bits.view(np.float32)
    for f in range(z.shape[0]):
        out[f] = z[f] / (np.float32(1.0) + power[f] * scale[f])


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _code_row(x, r, m, w1, b1, w2, w_out, depth, out, y, z, h, power, scale_bits):
    """out[r] = the packed signs of MLP m on row r; y (D,), z (F,), h (C,), power (F,), scale_bits (F,) scratch."""
    dim, width, bits = x.shape[1], w1.shape[3], w_out.shape[2]
    for d in range(dim):
        y[d] = x[r, d]
    for block in range(depth):
        for f in range(width):
            z[f] = b1[m, block, 0, f]
        for d in range(dim):  # z += y[d] * w1[d, :], vectorised over F
            yd = y[d]
            for f in range(width):
                z[f] += yd * w1[m, block, d, f]
        _silu(z, z, power, scale_bits)
        for f in range(width):
            zf = z[f]
            for d in range(dim):
                y[d] += zf * w2[m, block, f, d]
    for c in range(bits):
        h[c] = 0.0
    for d in range(dim):
        yd = y[d]
        for c in range(bits):
            h[c] += yd * w_out[m, d, c]
    for w in range(out.shape[1]):
        word = np.uint64(0)
        for j in range(min(WORD_BITS, bits - WORD_BITS * w)):
            if h[WORD_BITS * w + j] > 0:
                word |= np.uint64(1) << np.uint64(j)
        out[r, w] = word


@njit(fastmath=FASTMATH, cache=True)
def _bias_silu(z, b1, block, act, power, scale_bits):
    """z (R, B, F) += b1[:, block] (R, 1, F); act (R, B, F) = silu(z), as _code_row forms it
    (power, scale_bits (R, B, F) scratch): one pass, where numpy's float32 exp alone took 2.6-3.6
    ns a value on an AVX2 EPYC (numpy 2.4)."""
    rows, batch, width = z.shape
    for r in range(rows):
        for b in range(batch):
            for f in range(width):
                z[r, b, f] += b1[r, block, 0, f]
    _silu(z.ravel(), act.ravel(), power.ravel(), scale_bits.ravel())


@njit(cache=True)
def _pack_turned(h, out):
    """out[b, r] (B, R, W) = the packed signs of h[r, b] (R, B, C), kernels.pack's bit order."""
    rows, batch, bits = h.shape
    for r in range(rows):
        for b in range(batch):
            for w in range(out.shape[2]):
                word = np.uint64(0)
                for j in range(min(WORD_BITS, bits - WORD_BITS * w)):
                    word |= np.uint64(h[r, b, WORD_BITS * w + j] > 0) << np.uint64(j)
                out[b, r, w] = word


@njit(fastmath=FASTMATH, cache=True)
def _mlp_codes(x, w1, b1, w2, w_out, depth, out, y, z, h, power, scale_bits):
    for r in range(x.shape[0]):
        _code_row(x, r, r, w1, b1, w2, w_out, depth, out, y[r], z[r], h[r], power[r], scale_bits[r])


@njit(fastmath=FASTMATH, cache=True, parallel=True)
def _mlp_codes_parallel(x, w1, b1, w2, w_out, depth, out, y, z, h, power, scale_bits):
    """_mlp_codes with the rows spread over numba's threads (each row's sums in the same order:
    bit-identical)."""
    for r in prange(x.shape[0]):
        _code_row(x, r, r, w1, b1, w2, w_out, depth, out, y[r], z[r], h[r], power[r], scale_bits[r])
