"""Retrieval kernels: score + select per layer against the memory-bandwidth floor, in one run.

For each model shape and context N: microseconds per layer (all KV heads) of `scores`,
`select` and the fused `score_select` (128-bit codes, k = 2 % of N, 4 sinks, 64 window), beside
the floor = bytes of key codes read / a large numpy read's bandwidth measured in this run (an
all-core numba read is measured and compared too).
Every call reads a different layer's codes from a rotating set larger than the last-level
cache, as a decode step does (the weights and the other layers flush the cache in between).
Also: the K/V row gather candidates, the kernels right after a torch op, and (with a GPU) the
CUDA path. Times are medians of repeated calls; the machine may be shared, ratios are the point.
"""
from __future__ import annotations

import time

import numpy as np

import kernels
from bench.common import Target, finish, log, parser
from kernels import cpu

MODELS = {"SmolLM2-135M": (3, 3, 64), "Llama-8B-like": (8, 4, 128)}  # (Hkv, G, D)
FULL = {"contexts": [4096, 32768, 131072, 524288], "repeats": 25, "numpy_up_to": 131072}
QUICK = {"contexts": [4096, 32768, 131072], "repeats": 7, "numpy_up_to": 32768}
BITS, RATIO, SINKS, WINDOW = 128, 0.02, 4, 64
TARGET_FROM, TARGET_RATIO, CUDA_TARGET_US = 32768, 2.0, 50.0
FOOTPRINT = 256 << 20  # bytes of rotating code buffers: several times a server's 32 MiB L3


def median_us(fn, repeats: int) -> float:
    return timings_us(fn, repeats)[0]


def timings_us(fn, repeats: int) -> tuple[float, float]:
    """(median, best) microseconds of repeated calls, after one warm-up (compile) call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6, float(np.min(times)) * 1e6


def read_bandwidth(pool: np.ndarray) -> dict:
    """Bytes/s of a full read of `pool`: numpy's single-thread OR-reduce (the floor), numba on all cores."""
    bandwidth = {"numpy 1 thread": pool.nbytes / (median_us(lambda: np.bitwise_or.reduce(pool), 5) / 1e6)}
    if cpu.HAVE_NUMBA:
        import numba

        cores = numba.config.NUMBA_NUM_THREADS
        numba.set_num_threads(cores)
        bandwidth[f"numba {cores} threads"] = pool.nbytes / (median_us(lambda: _parallel_or(pool, cores), 5) / 1e6)
        numba.set_num_threads(cpu.threads())  # back to what the kernels last applied in this thread
    return bandwidth


if cpu.HAVE_NUMBA:
    from numba import njit, prange

    @njit(cache=True)
    def _or_part(a):
        acc = np.uint64(0)
        for i in range(a.size):
            acc |= a[i]
        return acc

    @njit(cache=True)
    def _gather_rows(kv, idx, out):
        """The numba alternative to np.take / index_select: copy row by row."""
        for h in range(idx.shape[0]):
            for j in range(idx.shape[1]):
                out[h, j, :] = kv[h, idx[h, j], :]

    @njit(parallel=True, cache=True)
    def _parallel_or(a, parts):
        out = np.zeros(parts, np.uint64)
        for p in prange(parts):
            out[p] = _or_part(a[a.size * p // parts : a.size * (p + 1) // parts])
        return out


def cpu_features() -> str:
    """Whether this CPU has AVX-512 VPOPCNTQ (one instruction per 8 popcounts) or only AVX2."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    if "avx512_vpopcntdq" in flags:
        return "AVX-512 with VPOPCNTDQ"
    return "AVX2" if "avx2" in flags else "no AVX2"


def layer_codes(pool: np.ndarray, hkv: int, words: int, n: int) -> list[np.ndarray]:
    """Views of the random pool as (Hkv, W, N) code buffers, one per simulated layer."""
    size = hkv * words * n
    return [pool[i * size : (i + 1) * size].reshape(hkv, words, n) for i in range(max(1, pool.size // size))]


class Rotation:
    """Hands out the next layer's buffer on every call."""

    def __init__(self, buffers: list):
        self.buffers, self.i = buffers, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.buffers)
        return self.buffers[self.i]


def cpu_row(label: str, model: str, n: int, pool, rng, repeats: int, bandwidth: dict) -> dict:
    hkv, group, _ = MODELS[model]
    words = kernels.words_for(BITS)
    codes = Rotation(layer_codes(pool, hkv, words, n))
    q = rng.integers(0, 2**64, size=(hkv * group, words), dtype=np.uint64)
    k = int(RATIO * n)
    layout = kernels.selection_layout(n, k, SINKS, WINDOW)
    out, scored = np.empty((hkv, layout.size), np.int32), np.empty((hkv, n), np.int32)
    scratch = kernels.make_scratch(q, codes())
    score_us = median_us(lambda: kernels.scores(q, codes(), n, out=scored), repeats)
    select_us = median_us(lambda: kernels.select(scored, k, SINKS, WINDOW, out=out, scratch=scratch), repeats)
    fused_us, fused_best = timings_us(
        lambda: kernels.score_select(q, codes(), n, k, SINKS, WINDOW, out=out, scratch=scratch), repeats)
    code_bytes = hkv * words * 8 * n
    floor_us = code_bytes / bandwidth["numpy 1 thread"] * 1e6
    return {"part": "score + select per layer", "backend": label, "model": model, "Hkv": hkv, "G": group,
            "N": n, "k": k, "codes MiB": hkv * words * 8 * n / 2**20, "floor us": floor_us,
            "scores us": score_us, "select us": select_us, "score_select us": fused_us,
            "score_select best us": fused_best, "ratio to floor": fused_us / floor_us,
            "ratio to all-core read": fused_us / (code_bytes / max(bandwidth.values()) * 1e6)}


def cpu_part(sizes: dict, pool, rng, bandwidth: dict) -> tuple[list[dict], list[Target]]:
    """Rows for the default thread count (1; the targets) and for all cores, plus the numpy fallback."""
    import numba

    rows, targets = [], []
    default, cores = cpu.threads(), numba.config.NUMBA_NUM_THREADS
    for model in MODELS:
        for n in sizes["contexts"]:
            for count in sorted({default, cores}):
                kernels.set_threads(count)
                label = f"numba {count} thr" + (" (default)" if count == default else "")
                rows.append(cpu_row(label, model, n, pool, rng, sizes["repeats"], bandwidth))
                log(f"{label} {model} N={n}: {rows[-1]['score_select us']:.0f} us")
                if count == default and n >= TARGET_FROM:
                    targets.append(Target(f"cpu score+select / floor, {model}, N={n}", rows[-1]["ratio to floor"],
                                          TARGET_RATIO, higher_is_better=False))
            kernels.set_threads(default)
            if n <= sizes["numpy_up_to"]:
                with kernels.use_backend("numpy"):
                    rows.append(cpu_row("numpy", model, n, pool, rng, max(3, sizes["repeats"] // 5), bandwidth))
    return rows, targets


def gather_rows(sizes: dict, rng) -> list[dict]:
    """K rows of one layer's K (Hkv, N, D) fp32 per head: np.take vs torch.index_select vs the rest."""
    import torch

    cores = torch.get_num_threads()

    n = 32768 if sizes is QUICK else 131072
    rows = []
    for model, (hkv, _, dim) in MODELS.items():
        count = int(RATIO * n) + SINKS + WINDOW
        layers = Rotation([rng.standard_normal((hkv, n, dim), dtype=np.float32)
                           for _ in range(max(2, FOOTPRINT // (hkv * n * dim * 4)))])
        idx = np.sort(np.stack([rng.choice(n, count, replace=False) for _ in range(hkv)]), axis=1).astype(np.int32)
        out = np.empty((hkv, count, dim), np.float32)
        tidx, tout = torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(out)

        def take():
            kv = layers()
            for h in range(hkv):
                np.take(kv[h], idx[h], axis=0, out=out[h])

        def index_select():
            kv = torch.from_numpy(layers())
            for h in range(hkv):
                torch.index_select(kv[h], 0, tidx[h], out=tout[h])

        row = {"part": "K/V row gather (one of K or V, fp32)", "model": model, "N": n, "rows per head": count}
        row["np.take us"] = median_us(take, sizes["repeats"])
        row["numba row loop us"] = median_us(lambda: _gather_rows(layers(), idx, out), sizes["repeats"])
        row["advanced indexing us"] = median_us(lambda: layers()[np.arange(hkv)[:, None], idx], sizes["repeats"])
        for threads in (1, cores):
            torch.set_num_threads(threads)
            row[f"torch.index_select {threads} thr us"] = median_us(index_select, sizes["repeats"])
        rows.append(row)
    return rows


def after_torch_rows(sizes: dict, pool, rng) -> list[dict]:
    """score_select right after a torch matmul on all cores, as in a decode step: OpenMP threads compete."""
    import numba
    import torch

    hkv, group, _ = MODELS["SmolLM2-135M"]
    n, words = 32768, kernels.words_for(BITS)
    codes = Rotation(layer_codes(pool, hkv, words, n))
    q = rng.integers(0, 2**64, size=(hkv * group, words), dtype=np.uint64)
    scratch = kernels.make_scratch(q, codes())
    weight = torch.randn(576, 576)
    rows, default = [], cpu.threads()
    for count in sorted({default, numba.config.NUMBA_NUM_THREADS}):
        kernels.set_threads(count)
        times = []
        for _ in range(sizes["repeats"] * 4):
            torch.mm(weight, weight)
            start = time.perf_counter()
            kernels.score_select(q, codes(), n, int(RATIO * n), SINKS, WINDOW, scratch=scratch)
            times.append((time.perf_counter() - start) * 1e6)
        rows.append({"part": f"score_select right after torch.mm ({torch.get_num_threads()} torch threads), "
                             f"SmolLM2, N={n}",
                     "numba threads": count, "median us": float(np.median(times)),
                     "p90 us": float(np.percentile(times, 90)), "max us": float(np.max(times))})
    kernels.set_threads(default)
    return rows


def cuda_part(sizes: dict) -> tuple[list[dict], list[Target]]:
    """CUDA: all heads of one layer at the largest N; event-timed on the device."""
    try:
        import cupy as cp

        if not cp.is_available():
            return [], []
    except ImportError:
        return [], []
    n = max(sizes["contexts"])
    rows, targets = [], []
    for model, (hkv, group, _) in MODELS.items():
        words = kernels.words_for(BITS)
        layers = Rotation([cp.random.randint(0, 2**63, size=(hkv, words, n), dtype=np.int64).view(np.uint64)
                           for _ in range(4)])
        q = cp.random.randint(0, 2**63, size=(hkv * group, words), dtype=np.int64).view(np.uint64)
        k = int(RATIO * n)
        scratch = kernels.make_scratch(q, layers())
        scored = cp.empty((hkv, n), np.int32)
        row = {"part": "CUDA score + select per layer", "model": model, "N": n,
               "scores us": _device_us(lambda: kernels.scores(q, layers(), n, out=scored), sizes["repeats"]),
               "score_select us": _device_us(lambda: kernels.score_select(q, layers(), n, k, SINKS, WINDOW,
                                                                          scratch=scratch), sizes["repeats"])}
        rows.append(row)
        targets.append(Target(f"cuda score+select us, {model}, N={n}", row["score_select us"], CUDA_TARGET_US,
                              higher_is_better=False))
    return rows, targets


def _device_us(fn, repeats: int) -> float:
    import cupy as cp

    fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats * 4):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


def main(argv=None):
    args = parser("retrieval", __doc__.splitlines()[0]).parse_args(argv)
    sizes = QUICK if args.quick else FULL
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 2**64, size=FOOTPRINT // 8, dtype=np.uint64)  # (FOOTPRINT / 8,)
    bandwidth = read_bandwidth(pool)
    log("read bandwidth: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items()))
    rows, targets = cpu_part(sizes, pool, rng, bandwidth)
    cuda_rows, cuda_targets = cuda_part(sizes)
    rows += gather_rows(sizes, rng) + after_torch_rows(sizes, pool, rng) + cuda_rows
    notes = (
        f"Codes: {BITS} bits per token per KV head, word-major (Hkv, W, N) uint64, random; k = {RATIO:.0%} of N, "
        f"sinks {SINKS}, window {WINDOW}; each call reads another layer's codes out of {FOOTPRINT >> 20} MiB "
        f"(beyond the last-level cache). Memory read bandwidth in this run: "
        + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items())
        + ". `floor us` = bytes of codes / numpy's read; `ratio to all-core read` divides by the faster "
        f"all-core read instead. Times are medians of repeated calls (`best` = fastest); the machine is "
        f"shared, so parallel rows can include waits for a busy core. CPU: {cpu_features()}. `numba` rows: the "
        f"project's kernels at the default thread count and on all cores; `numpy`: the pure-numpy fallback "
        f"(np.bitwise_count). {'No GPU here: no CUDA rows.' if not cuda_rows else ''}"
    )
    finish("retrieval", args, rows, targets + cuda_targets, title="Retrieval kernels (score + select)", notes=notes)


if __name__ == "__main__":
    main()
