"""Quantized matrix-vector kernels that read GGUF (ggml) blocks as they are stored.

Shape legend: F output features (rows), E input features (cols), Q bytes per row, S blocks per
row, R bytes per block, V values per block, L values per group (the run of values that share one
scale: a half block for Q4/Q5, a sub-block for the k-quants), U = E / L groups per row.

`QuantMatrix` holds one 2-D weight as its raw blocks (F, Q) uint8, validated once.
`matvec(qm, x, out)` computes out (F,) = W (F, E) @ x (E,) [+ bias], decoding each block's
weights in registers and accumulating `weight * x` in fp32, where `weight` is computed exactly as
gguf.quants.dequantize computes it (same fp32 operations in the same order). Activations are
never quantized. `dequantize_into(qm, out)` writes fp32 rows bit-identical to gguf's.

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

from dataclasses import dataclass

import numpy as np

from .cpu import HAVE_NUMBA, _numba_threads, as_numpy, threads


class UnsupportedQuantType(ValueError):
    """The tensor's ggml type has no quantized kernel here; the caller may dequantize to fp32."""

    def __init__(self, qtype: str, tensor: str):
        self.qtype, self.tensor = qtype, tensor
        super().__init__(f"tensor {tensor!r}: ggml type {qtype} has no quantized kernel (supported: "
                         f"{', '.join(SUPPORTED)}); dequantize it to fp32 instead (gguf.quants.dequantize)")


class CorruptTensor(ValueError):
    """The raw bytes do not match the declared type and shape (a truncated or mislabelled tensor)."""


@dataclass(frozen=True)
class QuantFormat:
    """One ggml block type: its geometry and its kernel id."""

    name: str
    kind: int  # kernel id, the branch taken in _row_dot / _row_dequantize
    values: int  # V: weights per block
    block_bytes: int  # R
    group: int  # L: the inner loop's length (values sharing one scale)


QK = 32  # QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0: values per block of the legacy ggml types
QK_K = 256  # values per super-block of the k-quants (Q4_K, Q5_K, Q6_K)
HALF = QK // 2  # Q4/Q5 nibble groups: bytes of nibbles per block
K_SUB = 32  # Q4_K / Q5_K sub-block length
Q6_SUB = 16  # Q6_K sub-block length
SCALE_BYTES_K = 12  # Q4_K / Q5_K packed 6-bit scales and mins

FORMATS = {f.name: f for f in (
    QuantFormat("Q4_0", 0, QK, 2 + HALF, HALF),
    QuantFormat("Q4_1", 1, QK, 4 + HALF, HALF),
    QuantFormat("Q5_0", 2, QK, 6 + HALF, HALF),
    QuantFormat("Q5_1", 3, QK, 8 + HALF, HALF),
    QuantFormat("Q8_0", 4, QK, 2 + QK, QK),
    QuantFormat("Q4_K", 5, QK_K, 4 + SCALE_BYTES_K + QK_K // 2, K_SUB),
    QuantFormat("Q5_K", 6, QK_K, 4 + SCALE_BYTES_K + QK_K // 8 + QK_K // 2, K_SUB),
    QuantFormat("Q6_K", 7, QK_K, QK_K // 2 + QK_K // 4 + QK_K // Q6_SUB + 2, Q6_SUB),
)}
SUPPORTED = tuple(FORMATS)

# fp16 bits -> fp32, exactly numpy's conversion (the one gguf.quants uses); 256 KB, L2-resident.
HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def format_of(qtype, tensor: str = "<raw>") -> QuantFormat:
    """The QuantFormat of a ggml type given by name ("Q4_K"), gguf.GGMLQuantizationType or type id."""
    import gguf

    name = qtype.name if isinstance(qtype, gguf.GGMLQuantizationType) else qtype
    if isinstance(name, (int, np.integer)) and not isinstance(name, bool):
        try:
            name = gguf.GGMLQuantizationType(int(name)).name
        except ValueError:
            raise UnsupportedQuantType(f"id {int(name)} (not a ggml type)", tensor) from None
    if name not in FORMATS:
        raise UnsupportedQuantType(str(name), tensor)
    return FORMATS[name]


@dataclass(frozen=True)
class QuantMatrix:
    """One 2-D weight W (F, E) kept as raw GGUF blocks: blocks (F, Q) uint8, row r = W[r, :]."""

    name: str  # tensor name, for messages
    qtype: str  # ggml type name, one of SUPPORTED
    rows: int  # F, output features
    cols: int  # E, input features
    blocks: np.ndarray  # (F, Q) uint8, C-contiguous (may be a read-only memory map)

    def __post_init__(self):
        fmt = format_of(self.qtype, self.name)
        if self.rows < 1 or self.cols < 1 or self.cols % fmt.values:
            raise CorruptTensor(f"tensor {self.name!r}: {self.qtype} needs rows >= 1 and cols a multiple "
                                f"of {fmt.values}, got ({self.rows}, {self.cols}); the file is damaged or "
                                "the shape is given as (cols, rows) (GGUF lists ne0 = cols first)")
        want = (self.rows, self.bytes_per_row)
        b = self.blocks
        if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.shape != want or not b.flags.c_contiguous:
            got = f"{b.dtype} {b.shape}" if isinstance(b, np.ndarray) else type(b).__name__
            raise CorruptTensor(f"tensor {self.name!r}: {self.qtype} ({self.rows}, {self.cols}) needs "
                                f"C-contiguous uint8 blocks {want} ({self.rows * self.bytes_per_row} bytes), "
                                f"got {got}; the file is truncated or the type is wrong, re-download it")

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.qtype]

    @property
    def bytes_per_row(self) -> int:
        return self.cols // self.format.values * self.format.block_bytes  # Q

    @property
    def nbytes(self) -> int:
        return self.rows * self.bytes_per_row

    @classmethod
    def from_bytes(cls, data, qtype, rows: int, cols: int, name: str = "<raw>") -> "QuantMatrix":
        """From raw block bytes (any shape of uint8 holding exactly rows * Q bytes, zero-copy)."""
        fmt = format_of(qtype, name)
        data = np.asarray(data)
        if data.dtype != np.uint8:
            raise CorruptTensor(f"tensor {name!r}: raw blocks must be uint8, got {data.dtype}")
        if cols % fmt.values:  # checked here too, so the reshape below cannot hide it
            return cls(name, fmt.name, rows, cols, data)
        per_row = cols // fmt.values * fmt.block_bytes
        if data.size != rows * per_row:
            raise CorruptTensor(f"tensor {name!r}: {fmt.name} ({rows}, {cols}) needs {rows * per_row} bytes "
                                f"({per_row} per row), got {data.size}; the file is truncated or the type is wrong")
        return cls(name, fmt.name, rows, cols, np.ascontiguousarray(data).reshape(rows, per_row))

    @classmethod
    def from_gguf_tensor(cls, tensor) -> "QuantMatrix":
        """From a gguf.GGUFReader tensor (2-D; its shape lists cols first), sharing the file's memory map."""
        fmt = format_of(tensor.tensor_type, tensor.name)
        shape = [int(n) for n in tensor.shape]
        if len(shape) != 2:
            raise CorruptTensor(f"tensor {tensor.name!r}: a matrix needs 2 dimensions, got shape {shape}")
        cols, rows = shape
        return cls.from_bytes(tensor.data, fmt.name, rows, cols, tensor.name)


if HAVE_NUMBA:
    from numba import njit, prange

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
        subs = QK_K // Q6_SUB  # 16 sub-blocks: u = b * 16 + half * 8 + quarter * 2 + g
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
                for l in range(xg.shape[1]):
                    q = (((I32(rb[b, lo_at + l]) >> lo_shift) & 15) | (((I32(rb[b, hi_at + l]) >> hi_shift) & 3) << 4))
                    acc[l] += (ds * F32(I32(q - 32))) * xg[u, l]
        return _lanes_sum(acc)

    @njit(cache=True)
    def _row_dot(kind, f16, rb, xg, acc):
        if kind == 0:
            return _dot_q4_0(f16, rb, xg, acc)
        if kind == 1:
            return _dot_q4_1(f16, rb, xg, acc)
        if kind == 2:
            return _dot_q5_0(f16, rb, xg, acc)
        if kind == 3:
            return _dot_q5_1(f16, rb, xg, acc)
        if kind == 4:
            return _dot_q8_0(f16, rb, xg, acc)
        if kind == 5:
            return _dot_q4_k(f16, rb, xg, acc)
        if kind == 6:
            return _dot_q5_k(f16, rb, xg, acc)
        return _dot_q6_k(f16, rb, xg, acc)

    @njit(cache=True)
    def _dot_rows(kind, f16, blocks, xg, bias, has_bias, out, row_start, row_end):
        """out[r] for r in [row_start, row_end); its lane accumulators allocated once."""
        acc = np.zeros((2, xg.shape[1]), np.float32)  # (2, L)
        first = row_start
        if kind == 4:  # Q8_0: pairs of rows, then the odd one out
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
            if kind == 4:
                for l in range(dg.shape[1]):
                    dg[b, l] = F32(np.int8(rb[b, 2 + l])) * d
                continue
            m = _half(f16, rb, b, 2) if kind == 1 or kind == 3 else F32(0.0)
            qh = _bits32(rb, b, 2) if kind == 2 else (_bits32(rb, b, 4) if kind == 3 else np.int64(0))
            at = (2, 4, 6, 8)[kind]
            for l in range(dg.shape[1]):
                v = I32(rb[b, at + l])
                lo = I32((v & 15) | (I32((qh >> l) & 1) << 4))
                hi = I32((v >> 4) | (I32((qh >> (l + HALF)) & 1) << 4))
                if kind == 0:
                    dg[2 * b, l], dg[2 * b + 1, l] = d * F32(I32(lo - 8)), d * F32(I32(hi - 8))
                elif kind == 2:
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
        if kind <= 4:
            _deq_legacy(kind, f16, rb, dg)
        elif kind <= 6:
            _deq_q45_k(f16, rb, dg, kind == 6)
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


# ---------------------------------------------------------------------------------- public API


def _check_vector(a, length: int, what: str) -> np.ndarray:
    a = as_numpy(a)
    if a.shape != (length,) or a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous float32 ({length},), got {a.dtype} {a.shape}")
    return a


def _block_view(qm: QuantMatrix, row_start: int, row_end: int) -> np.ndarray:
    fmt = qm.format
    return qm.blocks[row_start:row_end].reshape(row_end - row_start, qm.cols // fmt.values, fmt.block_bytes)  # (F', S, R)


def matvec(qm: QuantMatrix, x, out, bias=None) -> np.ndarray:
    """out (F,) = W (F, E) @ x (E,) [+ bias (F,)], reading qm's blocks in place; returns out.

    x, out, bias: C-contiguous float32 numpy arrays or CPU tensors (out is written). fp32 sums of
    the exactly dequantized weights times x; rows split over kernels.set_threads(n) threads with
    bit-identical results for every n.
    """
    xs = _check_vector(x, qm.cols, "x")
    dest = _check_vector(out, qm.rows, "out")
    has_bias = bias is not None
    b = _check_vector(bias, qm.rows, "bias") if has_bias else dest[:1]
    fmt = qm.format
    if not HAVE_NUMBA:  # pragma: no cover - numpy fallback
        dense = np.empty((qm.rows, qm.cols), np.float32)
        dequantize_into(qm, dense)
        np.dot(dense, xs, out=dest)
        if has_bias:
            dest += b
        return dest
    xg = xs.reshape(qm.cols // fmt.group, fmt.group)  # (U, L)
    blocks = _block_view(qm, 0, qm.rows)  # (F, S, R)
    if threads() > 1:  # kernels.set_threads(n): the rows split over n threads
        _matvec_parallel(fmt.kind, HALF_TO_FLOAT, blocks, xg, b, has_bias, dest, _numba_threads())
    else:
        _matvec_serial(fmt.kind, HALF_TO_FLOAT, blocks, xg, b, has_bias, dest)
    return dest


def dequantize_into(qm: QuantMatrix, out, row_start: int = 0, row_end: int | None = None) -> np.ndarray:
    """Rows [row_start, row_end) of W as fp32 into out (row_end - row_start, E); returns out.

    The values equal gguf.quants.dequantize's bit for bit. out: a C-contiguous float32 numpy array
    or CPU tensor of exactly that shape (e.g. a view of a reused buffer).
    """
    row_end = qm.rows if row_end is None else row_end
    if not 0 <= row_start <= row_end <= qm.rows:
        raise ValueError(f"rows [{row_start}, {row_end}) are outside [0, {qm.rows}) of {qm.name!r}")
    dest = as_numpy(out)
    want = (row_end - row_start, qm.cols)
    if dest.shape != want or dest.dtype != np.float32 or not dest.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 {want}, got {dest.dtype} {dest.shape}")
    if row_end == row_start:
        return dest
    fmt = qm.format
    if not HAVE_NUMBA:  # pragma: no cover - numpy fallback
        import gguf

        dest[...] = gguf.quants.dequantize(qm.blocks[row_start:row_end], gguf.GGMLQuantizationType[fmt.name])
        return dest
    dg = dest.reshape(want[0], qm.cols // fmt.group, fmt.group)  # (F', U, L)
    kernel = _dequantize_parallel if threads() > 1 and _numba_threads() > 1 else _dequantize_serial
    kernel(fmt.kind, HALF_TO_FLOAT, _block_view(qm, row_start, row_end), dg)
    return dest
