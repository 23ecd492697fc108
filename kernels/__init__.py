"""Retrieval kernels behind one dispatch: pack codes, score cached keys, select the top tokens.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv (query head h * G + g belongs to KV head
h, Hugging Face order), r code bits, W = ceil(r / 64) uint64 words, N code-buffer capacity, n
valid tokens, T new tokens, K selected tokens per KV head, D head dim.

The backend follows the arguments: numpy arrays and CPU torch tensors run on the CPU backend
(kernels/cpu.py: numba when installed, loaded at its first use, else numpy) and return numpy arrays (wrap them with
`torch.from_numpy`, or pass torch tensors as `out=` and keep using those); CuPy arrays and CUDA
torch tensors run on kernels/cuda.py and return CuPy arrays. `use_backend(name)` forces one
("cpu", "numpy" or "cuda"), for tests and benchmarks. Both backends give bit-identical integer
results; the semantics (bit order, scores, the tie rule) are written once in kernels/cpu.py.

Decode-step attention (`attend`, `gather_attend`: exact softmax attention of one query step
over all cached rows or over selected rows, reading them in place) lives in kernels/attend_cpu.py
(CPU) and kernels/cuda.py; `mlp_codes` / `MlpCoder` (an encoder MLP + pack in one call) are CPU only
(kernels/encode.py). The folded scan past the window also runs on byte planes of the codes
(kernels/planes.py over kernels/scan.c, AVX2; CPU only): `write_planes`, `planes_select_blocks`
(score_select_blocks' result), where `planes_fit`; the engine's flat scan inside the window reads
them too.

numba: each module's JIT kernels sit in a sibling module (cpu_jit, attend_jit,
encode_jit, linear_jit, quant_cpu) imported by the module's `jitted()` at the first call that
runs one. Importing this package, or running the engine's CPU path where kernels/_quant.so is
built, never imports numba (tests/test_engine.py checks a whole conversation).

CPU threads: `set_threads(n)` (default 1, measured in kernels/cpu.py). Importing this package
never imports cupy; the CUDA backend raises `CudaUnavailable` when asked for without a usable
GPU. Packed codes may be given as uint64 or int64 (same bits).
"""
from __future__ import annotations

import contextlib
import functools
import types

from . import attend_cpu as _attend
from . import cpu
from .cpu import Layout, Scratch, selection_layout, set_threads, words_for
from .encode import MlpCoder, mlp_codes
from .planes import PlaneScratch, planes_fit, planes_select_blocks, write_planes

__all__ = [
    "pack", "pack_into", "scores", "scores_blocks", "select", "score_select", "score_select_blocks", "make_scratch",
    "gather",
    "selection_layout", "words_for", "Layout", "Scratch", "backend_of", "use_backend", "CudaUnavailable",
    "set_threads", "attend", "gather_attend", "remapped_attend", "selected_scores", "make_attend_scratch", "mlp_codes",
    "MlpCoder",
    "write_planes", "planes_fit", "planes_select_blocks", "PlaneScratch",
]

BACKENDS = ("cpu", "numpy", "cuda")
_forced: list[str] = []  # stack of use_backend() overrides


class CudaUnavailable(RuntimeError):
    """CUDA was requested (a CUDA array, or use_backend("cuda")) but no usable GPU is present."""


def backend_of(x) -> str:
    """"cpu" for numpy arrays and CPU torch tensors, "cuda" for CuPy arrays and CUDA torch tensors."""
    module = type(x).__module__
    if module.startswith("numpy"):
        return "cpu"
    if module.startswith("cupy"):
        return "cuda"
    if module.startswith("torch"):
        return "cuda" if x.device.type == "cuda" else "cpu"
    raise TypeError(f"kernels take numpy/cupy arrays or torch tensors, got {type(x).__name__}")


@contextlib.contextmanager
def use_backend(name: str):
    """Force a backend inside the block: `with kernels.use_backend("numpy"): ...`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    if name == "cuda":
        _backend("cuda")  # fail here, with the reason, rather than at the first call
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


@functools.cache
def _numpy_backend():
    names = ("pack", "pack_into", "scores", "scores_blocks", "select", "score_select", "score_select_blocks", "gather")
    funcs = {name: functools.partial(getattr(cpu, name), jit=False) for name in names}
    funcs.update({name: functools.partial(getattr(_attend, name), jit=False) for name in ("attend", "gather_attend")})
    return types.SimpleNamespace(make_scratch=cpu.make_scratch, make_attend_scratch=_attend.make_attend_scratch, **funcs)


@functools.cache
def _cpu_backend():
    """kernels/cpu.py plus the CPU attention kernels, as one namespace."""
    names = ("pack", "pack_into", "scores", "scores_blocks", "select", "score_select", "score_select_blocks", "gather",
             "make_scratch")
    funcs = {name: getattr(cpu, name) for name in names}
    funcs.update({name: getattr(_attend, name) for name in ("attend", "gather_attend", "make_attend_scratch")})
    return types.SimpleNamespace(**funcs)


def _backend(name: str):
    if name == "cpu":
        return _cpu_backend()
    if name == "numpy":
        return _numpy_backend()
    from . import cuda  # imports cupy lazily and checks for a device

    return cuda.backend()


def _pick(x):
    return _backend(_forced[-1] if _forced else backend_of(x))


def pack(x, out=None):
    """Signs of x (..., r) float -> uint64 (..., W); bit j of word w is x[..., 64 w + j] > 0."""
    return _pick(x).pack(x, out=out)


def pack_into(x, k_codes, start: int) -> None:
    """Pack keys x (Hkv, T, r) into the word-major code buffer k_codes (Hkv, W, N) at [start, start + T)."""
    return _pick(k_codes).pack_into(x, k_codes, start)


def scores(q_codes, k_codes, n: int, out=None):
    """int32 (Hkv, n): matching bits of each token's key code with its KV head's G query codes.

    q_codes (H, W), k_codes (Hkv, W, N) with n <= N valid tokens; out: C-contiguous int32 (Hkv, n).
    """
    return _pick(k_codes).scores(q_codes, k_codes, n, out=out)


def scores_blocks(q_codes, k_codes, n: int, bounds, out=None):
    """int32 (Hkv, n): `scores` with a query of its own per token block: token t with
    bounds[r] <= t < bounds[r + 1] scored against q_codes[r] (R, H, W); 0 outside the blocks.

    Past the model's window each block of far tokens is scored by the query turned back by a
    multiple of the block size (CodeSelector.select_far). bounds: R + 1 ascending ints in [0, n].
    """
    return _pick(k_codes).scores_blocks(q_codes, k_codes, n, bounds, out=out)


def select(scores_, k: int, sinks: int, window: int, out=None, scratch=None):
    """int32 (Hkv, K) ascending: tokens [0, sinks) and [n - window, n), plus the top-k others.

    Ties: equal scores -> lower token index first. K = selection_layout(n, k, sinks, window).size,
    the same for every head; out: C-contiguous int32 (Hkv, K). Scores must be small ints >= 0.
    scratch: optional make_scratch(...) buffers, used when they fit (else allocated per call).
    """
    return _pick(scores_).select(scores_, k, sinks, window, out=out, scratch=scratch)


def score_select(q_codes, k_codes, n: int, k: int, sinks: int, window: int, out=None, scratch=None):
    """select(scores(q_codes, k_codes, n), k, sinks, window), fused; identical results.

    scratch: make_scratch(q_codes, k_codes), allocated once and reused, so a step allocates nothing.
    """
    return _pick(k_codes).score_select(q_codes, k_codes, n, k, sinks, window, out=out, scratch=scratch)


def score_select_blocks(q_codes, k_codes, n: int, bounds, k: int, sinks: int, window: int, out=None, scratch=None):
    """select(scores_blocks(q_codes, k_codes, n, bounds), k, sinks, window), fused on the CPU; identical
    results. The blocks must cover the middle [sinks_end, window_start) of the selection layout.

    scratch: make_scratch(q_codes[0], k_codes), allocated once and reused.
    """
    return _pick(k_codes).score_select_blocks(q_codes, k_codes, n, bounds, k, sinks, window, out=out,
                                              scratch=scratch)


def make_scratch(q_codes, k_codes):
    """Scratch buffers of score_select for these code shapes (and this backend)."""
    return _pick(k_codes).make_scratch(q_codes, k_codes)


def gather(kv, idx, out=None):
    """out[h, j] = kv[h, idx[h, j]]: kv (Hkv, N, D), idx (Hkv, K) -> (Hkv, K, D), kv's dtype and array type."""
    return _pick(kv).gather(kv, idx, out=out)


def attend(q, k, v, n: int, out=None, scratch=None):
    """Exact softmax attention of q (H, D) over rows [0, n) of k, v (Hkv, Ncap, D) -> (H, D).

    Query head h * G + g reads KV head h. CPU: q float32, k and v float32 or float16 (widened to
    float32 as they are read); out (H, D) float32 C-contiguous;
    scratch: make_attend_scratch(q, k), reused every step.
    """
    return _pick(k).attend(q, k, v, n, out=out, scratch=scratch)


def gather_attend(q, k, v, idx, out=None, scratch=None):
    """Exact softmax attention of q (H, D) over the rows idx (Hkv, K) int32 of k, v (Hkv, Ncap, D) -> (H, D).

    The rows are read in place (no gathered copy); attend(q, k, v, n) equals gather_attend over
    idx = [0, n) per head up to float rounding.
    """
    return _pick(k).gather_attend(q, k, v, idx, out=out, scratch=scratch)


def remapped_attend(q, k, v, idx, base: int, moved: int, lo_table, hi_table, block: int, out=None, scratch=None):
    """Attention of q (H, D) over the selection idx (Hkv, K) of k, v re-positioned past the model's
    window (column j < moved rotated to position base - K + j; spotlight/beyond.py), the keys
    rotated as they are read -> (H, D) float32; CPU only (kernels/attend.c), None where it
    cannot run (then the caller's torch path does the same)."""
    return _attend.remapped_attend(q, k, v, idx, base, moved, lo_table, hi_table, block, out=out, scratch=scratch)


def selected_scores(q, k, idx, base: int = 0, moved: int = 0, lo_table=None, hi_table=None, block: int = 0,
                    out=None):
    """Scores (Hkv, G, K) float32 = q . key / sqrt(D) of each KV head's query group over its
    selected rows idx (Hkv, K) of k, the first `moved` re-positioned as `remapped_attend` reads them
    (moved 0: as stored): what a sparse decode step's softmax weighs; CPU only (kernels/attend.c),
    None where it cannot run (then the caller's torch path does the same)."""
    return _attend.selected_scores(q, k, idx, base, moved, lo_table, hi_table, block, out=out)


def make_attend_scratch(q, k):
    """Buffers of attend / gather_attend for q (H, D) and k (Hkv, Ncap, D); independent of n and Ncap."""
    return _pick(k).make_attend_scratch(q, k)
