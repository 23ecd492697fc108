"""Quantized matrix-vector kernels that read GGUF (ggml) blocks as they are stored.

Shape legend: F output features (rows), E input features (cols), Q bytes per row, S blocks per
row, R bytes per block, V values per block, L values per group (the run of values that share one
scale: a half block for Q4/Q5, a sub-block for the k-quants), U = E / L groups per row.

`QuantMatrix` holds one 2-D weight as its raw blocks (F, Q) uint8, validated once.
`matvec(qm, x, out)` computes out (F,) = W (F, E) @ x (E,) [+ bias], decoding each block's
weights in registers and accumulating `weight * x` in fp32, where `weight` is computed exactly as
gguf.quants.dequantize computes it (same fp32 operations in the same order); these numba
kernels never quantize the activations. `dequantize_into(qm, out)` writes fp32 rows
bit-identical to gguf's. The compiled kernels (QuantMatVec) can also round x to int16 first
(`activations="int16"`, see ACTIVATIONS).

The block layouts, the kernels and why they are shaped as they are: kernels/quant_cpu.py;
measurements: docs/notes-quant.md. `QuantMatVec(qm)` binds one matrix for repeated one-row
products and runs kernels/quant.c (built by `make setup` into kernels/_quant.so, AVX2 + FMA,
~2x the numba kernels; rows split over kernels.set_threads(n) OpenMP threads) where the library
is built and has the format, else the numba kernel.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cpu import HAVE_NUMBA, _numba_threads, as_numpy, threads

# The ggml block geometry (layouts: kernels/quant_cpu.py's docstring).
QK = 32  # QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0: values per block of the legacy ggml types
QK_K = 256  # values per super-block of the k-quants (Q4_K, Q5_K, Q6_K)
HALF = QK // 2  # Q4/Q5 nibble groups: bytes of nibbles per block
K_SUB = 32  # Q4_K / Q5_K sub-block length
Q6_SUB = 16  # Q6_K sub-block length
SCALE_BYTES_K = 12  # Q4_K / Q5_K packed 6-bit scales and mins
# kernel ids (QuantFormat.kind), the branch each format takes in _row_dot / _row_dequantize
KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0, KIND_Q4_K, KIND_Q5_K, KIND_Q6_K = range(8)
NIBBLES_AT = (2, 4, 6, 8)  # byte of the first nibble in a Q4_0 / Q4_1 / Q5_0 / Q5_1 block (by kind)

# fp16 bits -> fp32, exactly numpy's conversion (the one gguf.quants uses); 256 KB, L2-resident.
HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@functools.cache
def jitted():
    """kernels/quant_cpu.py, the numba kernels, imported at the first call that runs one (as
    kernels/cpu.py's `jitted`): where quant.c has the format, numba is never loaded."""
    from . import quant_cpu

    return quant_cpu


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


FORMATS = {f.name: f for f in (
    QuantFormat("Q4_0", KIND_Q4_0, QK, 2 + HALF, HALF),
    QuantFormat("Q4_1", KIND_Q4_1, QK, 4 + HALF, HALF),
    QuantFormat("Q5_0", KIND_Q5_0, QK, 6 + HALF, HALF),
    QuantFormat("Q5_1", KIND_Q5_1, QK, 8 + HALF, HALF),
    QuantFormat("Q8_0", KIND_Q8_0, QK, 2 + QK, QK),
    QuantFormat("Q4_K", KIND_Q4_K, QK_K, 4 + SCALE_BYTES_K + QK_K // 2, K_SUB),
    QuantFormat("Q5_K", KIND_Q5_K, QK_K, 4 + SCALE_BYTES_K + QK_K // 8 + QK_K // 2, K_SUB),
    QuantFormat("Q6_K", KIND_Q6_K, QK_K, QK_K // 2 + QK_K // 4 + QK_K // Q6_SUB + 2, Q6_SUB),
)}
SUPPORTED = tuple(FORMATS)

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
        jitted()._matvec_parallel(fmt.kind, HALF_TO_FLOAT, blocks, xg, b, has_bias, dest, _numba_threads())
    else:
        jitted()._matvec_serial(fmt.kind, HALF_TO_FLOAT, blocks, xg, b, has_bias, dest)
    return dest


def dequantize_into(qm: QuantMatrix, out, row_start: int = 0, row_end: int | None = None, *,
                    numba: bool = False, workers: int | None = None) -> np.ndarray:
    """Rows [row_start, row_end) of W as fp32 into out (row_end - row_start, E); returns out.

    The values equal gguf.quants.dequantize's bit for bit. out: a C-contiguous float32 numpy array
    or CPU tensor of exactly that shape (e.g. a view of a reused buffer). Runs quant.c's
    quant_dequantize where the library has it (every format; no JIT compiler in memory), else the
    numba kernels; `numba=True` forces those (tests compare both). quant.c splits the rows over
    `workers` OpenMP threads (default: the kernel threads, `threads()`); a prefill passes torch's
    thread count, since its GEMMs run on those (the values do not depend on the split).
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
    if C_DEQUANTIZE and not numba:  # quant.c: no JIT (numba's compiler is never loaded for it)
        if _LIB.quant_dequantize(fmt.kind, qm.blocks.ctypes.data, qm.bytes_per_row, qm.cols // fmt.values, row_start,
                                 row_end, dest.ctypes.data, (workers or threads()) if C_THREADS else 1):
            raise ValueError(f"{LIBRARY} has no {qm.qtype} dequantisation; rebuild it with `make setup`")
        return dest
    if not HAVE_NUMBA:  # pragma: no cover - numpy fallback
        import gguf

        dest[...] = gguf.quants.dequantize(qm.blocks[row_start:row_end], gguf.GGMLQuantizationType[fmt.name])
        return dest
    dg = dest.reshape(want[0], qm.cols // fmt.group, fmt.group)  # (F', U, L)
    kernel = jitted()._dequantize_parallel if threads() > 1 and _numba_threads() > 1 else jitted()._dequantize_serial
    kernel(fmt.kind, HALF_TO_FLOAT, _block_view(qm, row_start, row_end), dg)
    return dest


def quantize_q8_0(weights, name: str = "<fp32>", chunk_rows: int = 4096) -> QuantMatrix:
    """An fp32 matrix W (F, E) as Q8_0 blocks, byte for byte what gguf.quants.quantize writes (the
    same fp32 operations: d = max|w| / 127, q = round-half-away(w / d) as w * (1 / d), d stored as
    fp16). E must be a multiple of 32. Rows are done `chunk_rows` at a time (bounded temporaries)."""
    w = as_numpy(weights)
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"{name}: Q8_0 quantization needs a float32 (F, E) matrix, got {w.dtype} {w.shape}")
    rows, cols = w.shape
    fmt = FORMATS["Q8_0"]
    if cols % fmt.values:
        raise ValueError(f"{name}: Q8_0 needs a column count that is a multiple of {fmt.values}, got {cols}")
    per_row = cols // fmt.values
    out = np.empty((rows, per_row, fmt.block_bytes), np.uint8)  # (F, S, R)
    for start in range(0, rows, chunk_rows):
        blocks = w[start:start + chunk_rows].reshape(-1, fmt.values)  # (n, 32)
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)  # (n, 1) fp32
        with np.errstate(divide="ignore"):
            inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
        scaled = blocks * inverse
        magnitude = np.abs(scaled)
        floored = np.floor(magnitude)
        q = np.sign(scaled) * (floored + np.floor(2 * (magnitude - floored)))  # gguf's np_roundf
        view = out[start:start + chunk_rows].reshape(-1, fmt.block_bytes)
        view[:, :2] = d.astype(np.float16).view(np.uint8)
        view[:, 2:] = q.astype(np.int8).view(np.uint8)
    return QuantMatrix(name, "Q8_0", rows, cols, out.reshape(rows, per_row * fmt.block_bytes))


# ------------------------------------------------------------------ the compiled kernels (quant.c)
# `make setup` builds kernels/quant.c into kernels/_quant.so (cc -O3 -march=native); without it
# (no compiler, a failed build) every product runs on the numba kernels above.

LIBRARY = Path(__file__).resolve().parent / "_quant.so"


def _load_library(path: Path = LIBRARY):
    """(the ctypes library at `path`, "") or (None, why it is not there)."""
    if not path.is_file():
        return None, f"{path} is not built (run `make setup`, which needs a C compiler)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        return None, f"cannot load {path} ({error}); rebuild it with `make setup`"
    lib.quant_matvec.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.quant_matvec.restype = ctypes.c_int
    lib.quant_supports.argtypes = [ctypes.c_int]
    lib.quant_supports.restype = ctypes.c_int
    lib.quant_simd.restype = ctypes.c_int
    lib.quant_has_simd.argtypes = [ctypes.c_int]
    lib.quant_has_simd.restype = ctypes.c_int
    if hasattr(lib, "quant_matvec_threads"):  # a library built before it has one thread only
        lib.quant_matvec_threads.argtypes = lib.quant_matvec.argtypes + [ctypes.c_int]
        lib.quant_matvec_threads.restype = ctypes.c_int
    if hasattr(lib, "quant_matvec_x16"):  # a library built before it has fp32 activations only
        lib.quant_x16_supports.argtypes = [ctypes.c_int]
        lib.quant_x16_supports.restype = ctypes.c_int
        lib.quant_x16_scratch_bytes.argtypes = [ctypes.c_int64]
        lib.quant_x16_scratch_bytes.restype = ctypes.c_int64
        lib.quant_matvec_x16.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.quant_matvec_x16.restype = ctypes.c_int
    if hasattr(lib, "quant_decode_head"):  # a library built before it has no fused decode block
        part, f32, i64, ptr, c_int = ctypes.POINTER(QuantPart), ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.quant_decode_head.argtypes = [ptr, i64, ptr, f32, part, c_int, c_int, c_int, ptr, ptr, ptr, ptr, ptr, c_int]
        lib.quant_decode_head.restype = c_int
        lib.quant_decode_tail.argtypes = [ptr, i64, ptr, i64, part, c_int, ptr, f32, part, c_int, i64, part, c_int,
                                          ptr, ptr, ptr, ptr, ptr, c_int]
        lib.quant_decode_tail.restype = c_int
    if hasattr(lib, "quant_decode_step"):  # the SIMD build has the whole step (attend.c's attention)
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.quant_decode_step.argtypes = [ctypes.POINTER(QuantBlock), c_int, ptr, i64, i64, i64, i64, i64, ptr, ptr,
                                          ptr, ptr, i64, i64, i64, c_int, c_int, ptr, ptr, ptr, ptr, c_int]
        lib.quant_decode_step.restype = c_int
    if hasattr(lib, "quant_decode_step_coded"):  # the step that also codes each layer's key
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.quant_decode_step_coded.argtypes = lib.quant_decode_step.argtypes[:-1] + [ptr, ptr, i64, i64, ptr, c_int]
        lib.quant_decode_step_coded.restype = c_int
    if hasattr(lib, "quant_dequantize"):  # a library built before it dequantises with numba
        lib.quant_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        lib.quant_dequantize.restype = ctypes.c_int
    return lib, ""


class QuantPart(ctypes.Structure):
    """quant.c's quant_part: one QuantMatrix (and its bias) inside a fused product (QuantMatVec.part)."""

    _fields_ = [("kind", ctypes.c_int32), ("x16", ctypes.c_int32), ("blocks", ctypes.c_void_p),
                ("row_bytes", ctypes.c_int64), ("blocks_per_row", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]


class QuantBlock(ctypes.Structure):
    """quant.c's quant_block: one block's norms, product parts and buffers (spotlight/quantized.py
    FusedDecode.block), for decode_step."""

    _fields_ = [("attention_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("qkv", ctypes.POINTER(QuantPart)), ("wo", ctypes.POINTER(QuantPart)),
                ("gate_up", ctypes.POINTER(QuantPart)), ("down", ctypes.POINTER(QuantPart)),
                ("h", ctypes.c_void_p), ("qkv_out", ctypes.c_void_p), ("ff", ctypes.c_void_p),
                ("act", ctypes.c_void_p), ("out", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
                ("attention_eps", ctypes.c_float), ("ffn_eps", ctypes.c_float), ("n_qkv", ctypes.c_int32),
                ("n_wo", ctypes.c_int32), ("n_gate_up", ctypes.c_int32), ("n_down", ctypes.c_int32)]


_LIB, C_MISSING = _load_library()  # C_MISSING: why the C kernels are unavailable ("" when loaded)
C_SIMD = bool(_LIB is not None and _LIB.quant_simd())  # the library was built with AVX2 + FMA + F16C
# the library splits rows over kernels.set_threads(n) OpenMP threads (built with -fopenmp)
C_THREADS = bool(_LIB is not None and hasattr(_LIB, "quant_openmp") and _LIB.quant_openmp())
C_DEQUANTIZE = bool(_LIB is not None and hasattr(_LIB, "quant_dequantize"))  # the library dequantises blocks


# The activations of a one-row product (QuantMatVec(activations=...), EngineConfig.activations):
# "fp32" multiplies the exactly decoded weights by x in fp32 (relative error ~1e-7); "int16" first
# rounds x to int16 in runs of 32 (one fp32 scale each) and sums exact integer products of the
# weights' codes (relative error ~3e-5 per product on random rows, 1.2-1.7x faster on the large
# matrices here: docs/DECISIONS.md, "int16 activations").
ACTIVATIONS = ("fp32", "int16")
C_INT16 = bool(_LIB is not None and hasattr(_LIB, "quant_matvec_x16"))  # the library has the int16 kernels


def c_int16_supports(qtype: str, scalar: bool = False) -> bool:
    """Whether the library runs this ggml type with int16 activations: a SIMD kernel (or, with
    `scalar`, the scalar one; without AVX2 the fp32-activation kernels are used instead)."""
    return C_INT16 and bool(_LIB.quant_x16_supports(format_of(qtype).kind)) and (scalar or C_SIMD)


def c_supports(qtype: str) -> bool:
    """Whether the compiled library is loaded and has a kernel for this ggml type."""
    return _LIB is not None and bool(_LIB.quant_supports(format_of(qtype).kind))


def c_is_fast(qtype: str) -> bool:
    """Whether the library has a SIMD kernel for this type (a build without AVX2 has none). quant.c's
    scalar kernels measured 2-4x slower than numba's (576 x 1536, hot, 1 thread: Q5_0 751 vs 335
    µs, Q6_K 1136 vs 306 µs), so the default backend uses C only where this holds."""
    return _LIB is not None and bool(_LIB.quant_has_simd(format_of(qtype).kind))


class QuantMatVec:
    """out (F,) = W (F, E) @ x (E,) [+ bias (F,)] for one QuantMatrix, its checks done once.

    Runs quant.c's kernel with `backend="c"`, or with "auto" where the library has a SIMD kernel
    for the format (c_is_fast); else kernels.quant.matvec (numba). `scalar=True` forces the C library's scalar fallback (tests).
    `activations="int16"` runs quant.c's int16-activation kernel where it has the format (see
    ACTIVATIONS; `self.activations` says what runs), else the fp32 one.
    A call checks only x and out (~1 µs through ctypes). The C path splits the rows over
    kernels.set_threads(n) threads (OpenMP inside quant.c, C_THREADS), bit-identical for every n.
    """

    def __init__(self, qm: QuantMatrix, bias=None, backend: str = "auto", scalar: bool = False,
                 activations: str = "fp32"):
        if backend not in ("auto", "c", "numba"):
            raise ValueError(f"backend must be 'auto', 'c' or 'numba', got {backend!r}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        int16 = activations == "int16" and backend != "numba" and c_int16_supports(qm.qtype, scalar)
        if backend == "c" and not (int16 or c_supports(qm.qtype)):
            raise ValueError(f"no C kernel for {qm.qtype} ({C_MISSING or 'not in quant.c'}); use backend='numba'")
        self.qm = qm
        self.bias = None if bias is None else _check_vector(bias, qm.rows, "bias")
        fast = c_is_fast(qm.qtype) if backend == "auto" else backend == "c"
        self.backend = "c" if fast else "numba"
        fmt = qm.format
        # the ctypes arguments before x, bias and out, made once
        self._head = (fmt.kind, qm.blocks.ctypes.data, qm.bytes_per_row, qm.cols // fmt.values, 0, qm.rows)
        self._bias_ptr = None if self.bias is None else self.bias.ctypes.data
        self._scalar = int(scalar)
        # "int16" where asked and the library has the format's int16 kernel, else fp32 (what runs)
        self.activations = "int16" if int16 else "fp32"
        if self.activations == "int16":
            self.backend = "c"
            # x's int16 codes, scales and sums, written by every call (allocated once, here)
            self._scratch = np.empty(_LIB.quant_x16_scratch_bytes(qm.cols), np.uint8)
            self._scratch_ptr = self._scratch.ctypes.data

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """x: C-contiguous float32 (E,) numpy; out: C-contiguous float32 (F,) numpy, written and returned."""
        qm = self.qm
        if x.shape != (qm.cols,) or x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"x must be C-contiguous float32 ({qm.cols},), got {x.dtype} {x.shape}")
        if out.shape != (qm.rows,) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32 ({qm.rows},), got {out.dtype} {out.shape}")
        if self.backend == "numba":
            return matvec(qm, x, out, self.bias)
        self.call(x.ctypes.data, out.ctypes.data)
        return out

    def part(self) -> QuantPart:
        """This product as quant.c's quant_part (the C kernels only: backend "c", not scalar), for
        the fused decode calls (kernels.quant.decode_head / decode_tail)."""
        assert self.backend == "c" and not self._scalar, (self.backend, self._scalar)
        kind, blocks, row_bytes, blocks_per_row, _, rows = self._head
        return QuantPart(kind, int(self.activations == "int16"), blocks, row_bytes, blocks_per_row, rows,
                         self._bias_ptr)

    def call(self, x_ptr: int, out_ptr: int) -> None:
        """The C product on raw addresses of float32 x (E,) and out (F,) that the caller has checked."""
        count = threads()
        if self.activations == "int16":
            _LIB.quant_matvec_x16(*self._head, x_ptr, self._scratch_ptr, self._bias_ptr, out_ptr, self._scalar,
                                 count if C_THREADS else 1)
        elif count > 1 and C_THREADS:
            _LIB.quant_matvec_threads(*self._head, x_ptr, self._bias_ptr, out_ptr, self._scalar, count)
        else:
            _LIB.quant_matvec(*self._head, x_ptr, self._bias_ptr, out_ptr, self._scalar)


# ------------------------------------------------------------- one decode step's block (quant.c)
C_FUSED = bool(_LIB is not None and hasattr(_LIB, "quant_decode_head"))  # the library has the fused block


def scratch_bytes(cols: int) -> int:
    """Bytes of the int16 scratch a product over `cols` inputs needs (quant_x16_scratch_bytes)."""
    return int(_LIB.quant_x16_scratch_bytes(cols))


def decode_head(x_ptr, dim, norm_ptr, eps, qkv, n_qkv, rope_heads, head_dim, cos_ptr, sin_ptr, h_ptr, scratch_ptr,
                out_ptr) -> None:
    """quant.c's quant_decode_head on raw addresses the caller has checked (spotlight/quantized.py
    FusedDecode): norm, the q/k/v parts (a QuantPart array), rope; on kernels.set_threads(n) threads."""
    if _LIB.quant_decode_head(x_ptr, dim, norm_ptr, eps, qkv, n_qkv, rope_heads, head_dim, cos_ptr, sin_ptr, h_ptr,
                              scratch_ptr, out_ptr, threads() if C_THREADS else 1):
        raise ValueError("quant_decode_head: a part's format has no C kernel for its activations")


def decode_tail(x_ptr, dim, attn_ptr, attn_dim, wo, n_wo, norm_ptr, eps, gate_up, n_gate_up, width, down, n_down,
                h_ptr, ff_ptr, act_ptr, scratch_ptr, out_ptr) -> None:
    """quant.c's quant_decode_tail on raw addresses the caller has checked: output product,
    residual, norm, MLP, residual; on kernels.set_threads(n) threads."""
    if _LIB.quant_decode_tail(x_ptr, dim, attn_ptr, attn_dim, wo, n_wo, norm_ptr, eps, gate_up, n_gate_up, width,
                              down, n_down, h_ptr, ff_ptr, act_ptr, scratch_ptr, out_ptr,
                              threads() if C_THREADS else 1):
        raise ValueError("quant_decode_tail: a part's format has no C kernel for its activations")


# ------------------------------------------------------------- a whole one-token step (quant.c)
C_STEP = bool(_LIB is not None and hasattr(_LIB, "quant_decode_step"))  # the SIMD build has it
C_CODED_STEP = bool(C_STEP and hasattr(_LIB, "quant_decode_step_coded"))  # and the step that codes keys


def decode_step(blocks, n_blocks, x_ptr, dim, heads, kv_heads, head_dim, width, cos_ptr, sin_ptr, k_ptr, v_ptr,
                layer_stride, head_stride, row, half, splits, qs_ptr, stats_ptr, acc_ptr, attn_ptr,
                key_codes=None) -> None:
    """quant.c's quant_decode_step on raw addresses the caller has checked (spotlight/quantized.py
    FusedStep): every block of a one-token step, attending to all cached rows [0, row], on
    kernels.set_threads(n) threads. With `key_codes` (specs_ptr, codes_ptr, words, code_capacity,
    words_out_ptr: quant_decode_step_coded's arguments, C_CODED_STEP), each layer's new key is also
    coded into the key codes at `row`."""
    count = threads() if C_THREADS else 1
    args = (blocks, n_blocks, x_ptr, dim, heads, kv_heads, head_dim, width, cos_ptr, sin_ptr, k_ptr, v_ptr,
            layer_stride, head_stride, row, int(half), splits, qs_ptr, stats_ptr, acc_ptr, attn_ptr)
    if key_codes is None:
        status = _LIB.quant_decode_step(*args, count)
    else:
        status = _LIB.quant_decode_step_coded(*args, *key_codes, count)
    if status:
        raise ValueError(f"quant_decode_step: block {-status - 1} could not run (a part's format has no C kernel "
                         "for its activations, attend.c does not take the head geometry, or a key coder failed)")
