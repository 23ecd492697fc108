"""CPU codes of one decode step (its queries, its new key): the residual-MLP encoder and sign
packing in one call.

Shape legend: R rows (query heads, or KV heads for a key), D head dim, F hidden width, C code
bits, W = ceil(C / 64).

The encoder of each row (spotlight/hashing.py `HeadMLP`) is

    y = x;  for each of `depth` blocks: y = y + silu(y @ w1 + b1) @ w2;   h = y @ w_out

and its code is the bits h > 0, packed as kernels.pack packs them. torch runs it as ~10 small
ops (~90 us per layer for 9 heads, plus ~25 us to pack); kernels/encode.c runs it in ~14 us
(numba's one-row kernel, kernels/encode_jit.py, is the fallback where encode.c is not built).

NOTE: the sums run in another order than torch's, so a bit whose h lies within float rounding
of 0 can differ from `pack(encoders.query_bits(...))` (about one bit in 10^6 of random inputs);
such a bit carries no ranking information either way. `MlpCoder.many` (many inputs per MLP)
runs kernels/encode.c (or, without it, BLAS matrix products) instead, with the same caveat.
spotlight/attention.py `CodeSelector` runs the query codes and a decode step's key codes here
(prefill keys go through torch in one batch); a decoded key's code may thus differ from the
prefill path's in such a bit (one in ~10^7 measured on SmolLM2), as its key itself differs by
float rounding between the two paths.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .cpu import HAVE_NUMBA, WORD_BITS, _numba_threads, as_numpy, pack, threads, words_for
from .quant import _LIB as _NATIVE  # the one compiled library of the CPU kernels (kernels/encode.c in it)

LOG2E = np.float32(math.log2(math.e))

# kernels/encode.c: `many` and `turned` in one call (AVX2 + FMA builds; else numpy's products below)
C_ENCODE = bool(_NATIVE is not None and hasattr(_NATIVE, "encode_available") and _NATIVE.encode_available())
if C_ENCODE:
    import ctypes

    _p, _i64 = ctypes.c_void_p, ctypes.c_int64
    _NATIVE.encode_many.argtypes = [_p, _i64, _p, _p] + [_i64] * 5 + [_p] * 4 + [_i64, _i64, _p, ctypes.c_int]
    _NATIVE.encode_many.restype = ctypes.c_int
    if hasattr(_NATIVE, "encode_rows"):  # a library built before it codes one row through encode_many
        _NATIVE.encode_rows.argtypes = [_p, _p, _p, ctypes.c_int]
        _NATIVE.encode_rows.restype = ctypes.c_int

@functools.cache
def jitted():
    """kernels/encode_jit.py, the numba kernels, imported at the first call that runs one (as
    kernels/cpu.py's `jitted`): where encode.c is built, numba is never loaded for the codes."""
    from . import encode_jit

    return encode_jit


class MlpCoder:
    """Packed codes uint64 (R, W) of h = mlp(x) @ w_out > 0, one MLP per row, for one layer's
    encoder: its checks, numpy views and scratch made once (a decode step codes one query and one
    key per layer; checking the weights on each call cost more than coding the key).

    w1 (R, >=depth, D, F); b1 (R, >=depth, 1, F); w2 (R, >=depth, F, D); w_out (R, D, C); float32
    numpy arrays or CPU tensors, viewed in place (values copied into them later are seen). With
    kernels.set_threads(n > 1) the rows are coded on n threads (the same bits).
    """

    def __init__(self, w1, b1, w2, w_out, depth: int):
        self.weights = [as_numpy(a) for a in (w1, b1, w2, w_out)]
        rows, dim, bits = self.weights[3].shape if self.weights[3].ndim == 3 else (None, None, None)  # checked below
        width = self.weights[0].shape[-1]
        expected = [(rows, None, dim, width), (rows, None, 1, width), (rows, None, width, dim), (rows, dim, bits)]
        for name, a, shape in zip(("w1", "b1", "w2", "w_out"), self.weights, expected):
            if (a.dtype != np.float32 or len(a.shape) != len(shape) or not a.flags.c_contiguous
                    or any(s is not None and s != t for s, t in zip(shape, a.shape))):
                raise ValueError(f"{name} must be C-contiguous float32 of shape {shape} (None: >= depth), "
                                 f"got {a.dtype} {a.shape}")
        if not 0 <= depth <= min(self.weights[0].shape[1], self.weights[2].shape[1]):
            raise ValueError(f"0 <= depth <= the stacked blocks ({self.weights[0].shape[1]}), got {depth}")
        self.depth, self.shape = depth, (rows, words_for(bits))  # out: (R, W)
        self.x_shape = (rows, dim)
        f32 = np.float32
        self.scratch = [np.empty((rows, dim), f32), np.empty((rows, width), f32), np.empty((rows, bits), f32),
                        np.empty((rows, width), f32), np.empty((rows, width), np.int32)]  # y, z, h, power, scale_bits
        self._batch = None  # `many`'s buffers for B inputs per MLP, (R, B, ...) each
        # encode.c's pointers to the weights, taken once (views of the encoder's parameters, updated in place)
        self._addresses = tuple(w.ctypes.data for w in self.weights)
        # encode_rows' spec (R, D, F, C, S, depth, the weights' addresses) and the last `out`'s address:
        # `.ctypes.data` costs ~1.4 us, and a decode step codes one query and one key per layer
        stacked = self.weights[0].shape[1]
        self._spec = np.array([rows, dim, width, bits, stacked, depth, *self._addresses], np.int64)
        self._spec_address = self._spec.ctypes.data
        self._rows_native = (C_ENCODE and hasattr(_NATIVE, "encode_rows")
                             and self.weights[0].shape[1] == self.weights[1].shape[1] == self.weights[2].shape[1])
        self._out = (None, 0)  # (array, its address)

    @property
    def native(self) -> bool:
        """Whether encode.c's encode_rows codes one input per MLP (what `__call__` runs first)."""
        return self._rows_native

    @property
    def spec_address(self) -> int:
        """The address of encode_rows' spec (int64: R, D, F, C, S, depth, the weights' addresses),
        for a compiled caller (kernels.quant.decode_step's key_codes); valid while this coder lives."""
        return self._spec_address

    def __call__(self, x: np.ndarray, out: np.ndarray, *, native: bool = True) -> np.ndarray:
        """x: C-contiguous float32 (R, D) numpy; out: C-contiguous uint64 (R, W) numpy, written and returned.

        kernels/encode.c's `many` with one input per MLP where it is built (`native=False`: numba's
        one-row kernel, the fallback; the same sums in another order, hence the module note).
        """
        if x.shape != self.x_shape or x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"x must be C-contiguous float32 {self.x_shape}, got {x.dtype} {x.shape}")
        if out.shape != self.shape or out.dtype != np.uint64 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous uint64 {self.shape}, got {out.dtype} {out.shape}")
        if native and self._rows_native:
            if self._out[0] is not out:
                self._out = (out, out.ctypes.data)
            if _NATIVE.encode_rows(self._spec_address, x.ctypes.data, self._out[1], threads()) == 0:
                return out
        if HAVE_NUMBA and threads() > 1:
            _numba_threads()
            jitted()._mlp_codes_parallel(x, *self.weights, self.depth, out, *self.scratch)
        elif HAVE_NUMBA:
            jitted()._mlp_codes(x, *self.weights, self.depth, out, *self.scratch)
        else:
            out[...] = _reference(x, *self.weights, self.depth)
        return out

    def _many_scratch(self, batch: int) -> list[np.ndarray]:
        """`many`'s buffers for B inputs per MLP, (R, B, ...) each: made when B changes, then reused."""
        if self._batch is None or self._batch[0].shape[1] != batch:
            rows, dim = self.x_shape
            width, bits = self.weights[0].shape[-1], self.weights[3].shape[-1]
            f32 = np.float32
            self._batch = [np.empty((rows, batch, dim), f32), np.empty((rows, batch, width), f32),
                           np.empty((rows, batch, width), f32), np.empty((rows, batch, dim), f32),
                           np.empty((rows, batch, bits), f32), np.empty((rows, batch, words_for(bits)), np.uint64),
                           np.empty((rows, batch, width), f32), np.empty((rows, batch, width), np.int32)]
            # y, z, silu(z), its product, h, codes, silu's power and scale bits
        return self._batch

    def many(self, x: np.ndarray, out: np.ndarray, *, native: bool = True) -> np.ndarray:
        """B inputs per row's MLP at once: x C-contiguous float32 (B, R, D), out uint64 (B, R, W), written
        and returned; out[b] holds self(x[b], ...)'s codes but for bits within float rounding of 0.

        One call of kernels/encode.c where it is built (`native=False`: the numpy path, for tests).
        Else each MLP's B inputs are one small matrix product (numpy's BLAS; below its threading
        size, so one thread), the bias, silu and sign packing between them in numba (`_bias_silu`,
        `_pack_turned`). For select_far's 32 x 14 turned-back queries (Qwen2.5, depth 1, width 64,
        128 bits) the numpy path took ~0.35 ms on a 2-core AMD EPYC (AVX2), ~0.24 of it the three
        products (ad hoc, 12-03); encode.c's numbers are in docs/DECISIONS.md. Either's sums run in
        another order than the one-row coder's, hence the rounding caveat of the module docstring.
        """
        if x.ndim != 3 or x.shape[1:] != self.x_shape or x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"x must be C-contiguous float32 (B, {self.x_shape[0]}, {self.x_shape[1]}), "
                             f"got {x.dtype} {x.shape}")
        self._check_out(out, x.shape[0])
        if native and self._native(x, x.shape[1] * x.shape[2], None, None, x.shape[0], out):
            return out
        return self._many_numpy(x, out)

    def turned(self, q: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray, *,
               native: bool = True) -> np.ndarray:
        """`many` of the B inputs x[b] = q turned by the table row b (positions.Rotations.turn_back:
        q * cos[b] - rotate_half(q) * sin[b], the same fp32 operations): q C-contiguous float32 (R, D),
        cos and sin (B, D), out uint64 (B, R, W), written and returned. kernels/encode.c turns and
        codes them in one call; `native=False` (or without it) turns them in numpy, then `many`."""
        if q.shape != self.x_shape or q.dtype != np.float32 or not q.flags.c_contiguous:
            raise ValueError(f"q must be C-contiguous float32 {self.x_shape}, got {q.dtype} {q.shape}")
        batch, dim = cos.shape[0], self.x_shape[1]
        for name, table in (("cos", cos), ("sin", sin)):
            if table.shape != (batch, dim) or table.dtype != np.float32 or not table.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous float32 (B, {dim}), got {table.dtype} {table.shape}")
        self._check_out(out, batch)
        if native and self._native(q, 0, cos, sin, batch, out):
            return out
        other = np.concatenate([-q[:, dim // 2:], q[:, : dim // 2]], axis=1)  # rotate_half(q) (R, D)
        x = q[None] * cos[:, None] - other[None] * sin[:, None]  # (B, R, D)
        return self._many_numpy(x, out)

    def _check_out(self, out: np.ndarray, batch: int) -> None:
        if out.shape != (batch, *self.shape) or out.dtype != np.uint64 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous uint64 ({batch}, {self.shape[0]}, {self.shape[1]}), "
                             f"got {out.dtype} {out.shape}")

    def _native(self, x, x_step: int, cos, sin, batch: int, out) -> bool:
        """kernels/encode.c's encode_many into out; False where it is not built or does not take the shapes."""
        w1, b1, w2, w_out = self.weights
        if not C_ENCODE or not w1.shape[1] == b1.shape[1] == w2.shape[1]:  # encode.c: one stride of stacked blocks
            return False
        rows, dim = self.x_shape
        status = _NATIVE.encode_many(
            x.ctypes.data, x_step, None if cos is None else cos.ctypes.data, None if sin is None else sin.ctypes.data,
            batch, rows, dim, w1.shape[-1], w_out.shape[-1], *self._addresses, w1.shape[1], self.depth,
            out.ctypes.data, threads())
        return status == 0

    def _many_numpy(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`many` through numpy's stacked matrix products (and numba between them)."""
        w1, b1, w2, w_out = self.weights
        y, z, act, dy, h, codes, power, scale_bits = self._many_scratch(x.shape[0])
        np.copyto(y, x.transpose(1, 0, 2))  # (R, B, D)
        for block in range(self.depth):
            np.matmul(y, w1[:, block], out=z)  # (R, B, F); each (D, F) slice is contiguous: BLAS
            if HAVE_NUMBA:
                jitted()._bias_silu(z, b1, block, act, power, scale_bits)
            else:
                z += b1[:, block]
                np.negative(z, out=act)
                np.minimum(act, 80.0, out=act)  # exp(80) is finite in fp32; silu(z < -80) is -0 either way
                np.exp(act, out=act)
                act += 1
                np.divide(z, act, out=act)  # silu(z) = z / (1 + exp(-z))
            y += np.matmul(act, w2[:, block], out=dy)  # (R, B, D)
        np.matmul(y, w_out, out=h)  # (R, B, C)
        if HAVE_NUMBA:
            jitted()._pack_turned(h, out)
            return out
        pack(h, out=codes)  # (R, B, W)
        np.copyto(out, codes.transpose(1, 0, 2))
        return out


def mlp_codes(x, w1, b1, w2, w_out, depth: int, out=None) -> np.ndarray:
    """Packed codes uint64 (R, W) of h = mlp(x) @ w_out > 0, one MLP per row (see MlpCoder;
    a caller coding every decode step keeps an MlpCoder per layer instead).

    x (R, D) float32; w1 (R, >=depth, D, F); b1 (R, >=depth, 1, F); w2 (R, >=depth, F, D);
    w_out (R, D, C); all float32 (numpy arrays or CPU tensors, used in place). depth: blocks run.
    """
    coder = MlpCoder(w1, b1, w2, w_out, depth)
    return coder(np.ascontiguousarray(as_numpy(x)), _result(out, coder.shape))


def _reference(x, w1, b1, w2, w_out, depth: int) -> np.ndarray:
    """The same codes through numpy matmuls (float32)."""
    y = x.copy()  # (R, D)
    for block in range(depth):
        z = np.einsum("rd,rdf->rf", y, w1[:, block]) + b1[:, block, 0]  # (R, F)
        y = y + np.einsum("rf,rfd->rd", z / (1 + np.exp(-z)), w2[:, block])  # (R, D)
    return pack(np.einsum("rd,rdc->rc", y, w_out), jit=False)  # (R, W)


def _result(out, shape) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.uint64)
    a = as_numpy(out)
    if a.dtype == np.int64:
        a = a.view(np.uint64)
    if a.shape != shape or a.dtype != np.uint64 or not a.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous uint64 {shape}, got {a.dtype} {a.shape}")
    return a
