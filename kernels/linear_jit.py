"""numba kernels of kernels/linear.py (the fp32 one-row product), imported at their first use
(`linear.jitted`), as kernels/cpu_jit.py is."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import ROWS

FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _four_rows(weight, x, i, out):
    """out[i:i+4] = weight[i:i+4] @ x, one pass over x."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for j in range(weight.shape[1]):
        xj = x[j]
        a0 += weight[i, j] * xj
        a1 += weight[i + 1, j] * xj
        a2 += weight[i + 2, j] * xj
        a3 += weight[i + 3, j] * xj
    out[i], out[i + 1], out[i + 2], out[i + 3] = a0, a1, a2, a3


@njit(fastmath=FASTMATH, cache=True)
def _matvec(weight, x, bias, has_bias, out):
    rows, cols = weight.shape
    full = rows - rows % ROWS
    for i in range(0, full, ROWS):
        _four_rows(weight, x, i, out)
    _tail(weight, x, bias, has_bias, out, full)


@njit(fastmath=FASTMATH, cache=True, parallel=True)
def _matvec_parallel(weight, x, bias, has_bias, out):
    """_matvec with the four-row blocks spread over numba's threads: each row is summed
    by one thread in the same order, so the result is bit-identical to _matvec's."""
    rows, cols = weight.shape
    full = rows - rows % ROWS
    for b in prange(full // ROWS):
        _four_rows(weight, x, b * ROWS, out)
    _tail(weight, x, bias, has_bias, out, full)


@njit(fastmath=FASTMATH, cache=True)
def _tail(weight, x, bias, has_bias, out, full):
    """The rows after the last four-row block, then the bias."""
    rows, cols = weight.shape
    for i in range(full, rows):
        acc = np.float32(0.0)
        for j in range(cols):
            acc += weight[i, j] * x[j]
        out[i] = acc
    if has_bias:
        for i in range(rows):
            out[i] += bias[i]
