"""CPU matrix-vector product for single-token decode: y = x @ weight.T + bias, fp32.

Shape legend: E input features, F output features.

Why (measured on this machine class, an AMD EPYC with AVX-512; bench/spotlight_speed.py):
torch.nn.functional.linear on a (1, E) input goes to MKL's sgemv, whose code path on AMD CPUs
streams SmolLM2's 538 MB of fp32 weights at ~11 GB/s (33 ms of CPU per token); this loop
streams them at ~25 GB/s (one core's read bandwidth), four output rows at a time so each
load of x feeds four FMAs. It is a drop-in for T = 1 (results equal F.linear's up to float
rounding: the dot products are summed in another order).
"""
from __future__ import annotations

import functools

import numpy as np

from .cpu import HAVE_NUMBA, _numba_threads, as_numpy, threads

ROWS = 4  # output rows per pass over x

@functools.cache
def jitted():
    """kernels/linear_jit.py, the numba kernels, imported at the first product (as kernels/cpu.py's `jitted`)."""
    from . import linear_jit

    return linear_jit


class MatVec:
    """y (F,) = weight (F, E) @ x (E,) + bias (F,) for one matrix, its checks and numpy views made once.

    A decode step multiplies every matrix once per token; checking and converting the weight on
    each call cost more than a small matrix's product. The views share the weight's memory, so
    values copied into it in place are seen; a weight given new memory needs a new MatVec.
    """

    def __init__(self, weight, bias=None):
        self.weight = as_numpy(weight)
        if self.weight.ndim != 2 or self.weight.dtype != np.float32:
            raise ValueError(f"need a float32 weight (F, E), got {self.weight.dtype} {self.weight.shape}")
        if not self.weight.flags.c_contiguous:
            raise ValueError("weight must be C-contiguous (row-major)")
        rows = self.weight.shape[0]
        self.has_bias = bias is not None
        self.bias = as_numpy(bias) if bias is not None else np.zeros(1, np.float32)
        if self.has_bias and (self.bias.shape != (rows,) or self.bias.dtype != np.float32):
            raise ValueError(f"bias must be float32 ({rows},), got {self.bias.dtype} {self.bias.shape}")

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """x: float32 (E,) numpy; out: C-contiguous float32 (F,) numpy, written and returned."""
        wa = self.weight
        if x.shape != (wa.shape[1],) or x.dtype != np.float32:
            raise ValueError(f"x must be float32 ({wa.shape[1]},), got {x.dtype} {x.shape}")
        if out.shape != (wa.shape[0],) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32 ({wa.shape[0]},), got {out.dtype} {out.shape}")
        if HAVE_NUMBA and threads() > 1:  # kernels.set_threads(n): the weight rows split over n threads
            _numba_threads()
            jitted()._matvec_parallel(wa, x, self.bias, self.has_bias, out)
        elif HAVE_NUMBA:
            jitted()._matvec(wa, x, self.bias, self.has_bias, out)
        else:
            np.dot(wa, x, out=out)
            if self.has_bias:
                out += self.bias
        return out


def linear(x, weight, bias=None, out=None) -> np.ndarray:
    """y (F,) = weight (F, E) @ x (E,) + bias (F,); float32 numpy arrays or CPU tensors, used in place.

    out: C-contiguous float32 (F,) (a numpy array or a CPU tensor) to write into.
    """
    matvec = MatVec(weight, bias)
    dest = np.empty(matvec.weight.shape[0], np.float32) if out is None else as_numpy(out)
    return matvec(np.ascontiguousarray(as_numpy(x)).reshape(-1), dest)
