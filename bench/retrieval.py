"""Retrieval kernels: score + select per layer against the memory-bandwidth floor, in one run.

For each model shape and context N: microseconds per layer (all KV heads) of `scores`,
`select` and the fused `score_select` (128-bit codes, k = 2 % of N, 4 sinks, 64 window), beside
the floor = bytes of key codes read / a large numpy read's bandwidth measured in this run (an
all-core numba read is measured and compared too).
Every call reads a different layer's codes from a rotating set larger than the last-level
cache, as a decode step does (the weights and the other layers flush the cache in between).
Also: the K/V row gather candidates, the kernels right after a torch op, and (with a GPU) the
CUDA path. Times are medians of repeated calls; the machine may be shared, ratios are the point.

Two-level retrieval (segments or blocks by their code counts first, then tokens) had a part here
until session 38 retired it: at the app's budget it was no faster than the byte-plane flat scan
unless it lost recall (docs/DECISIONS.md, "Two-level retrieval retired").
"""
from __future__ import annotations

import time

import numpy as np

import kernels
from bench.common import Target, finish, log, parser
from kernels import cpu

MODELS = {"SmolLM2-135M": (3, 3, 64), "Qwen2.5-0.5B": (2, 7, 64), "Llama-8B-like": (8, 4, 128)}  # (Hkv, G, D); G = 7 takes the bit-plane scan
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
    fused = timings_us(lambda: kernels.score_select(q, codes(), n, k, SINKS, WINDOW, out=out, scratch=scratch),
                       repeats)
    return _score_select_row(label, model, n, k, bandwidth, fused, score_us, select_us)


def _score_select_row(label: str, model: str, n: int, k: int, bandwidth: dict, fused: tuple[float, float],
                      score_us: float | None = None, select_us: float | None = None) -> dict:
    """One row of the score + select table: fused (median, best) us against the codes' read floor."""
    hkv, group, _ = MODELS[model]
    code_bytes = hkv * kernels.words_for(BITS) * 8 * n
    floor_us = code_bytes / bandwidth["numpy 1 thread"] * 1e6
    return {"part": "score + select per layer", "backend": label, "model": model, "Hkv": hkv, "G": group,
            "N": n, "k": k, "codes MiB": code_bytes / 2**20, "floor us": floor_us, "scores us": score_us,
            "select us": select_us, "score_select us": fused[0], "score_select best us": fused[1],
            "ratio to floor": fused[0] / floor_us,
            "ratio to all-core read": fused[0] / (code_bytes / max(bandwidth.values()) * 1e6)}


def planes_row(label: str, model: str, n: int, pool, rng, repeats: int, bandwidth: dict) -> dict:
    """cpu_row for the app's flat scan on the CPU: the codes' byte planes (kernels/scan.c), one block."""
    hkv, group, _ = MODELS[model]
    words = kernels.words_for(BITS)
    planes = []
    for codes in layer_codes(pool, hkv, words, n):  # the same rotating codes, as byte planes (as many bytes)
        planes.append(np.empty((hkv, 8 * words, n), np.uint8))
        kernels.write_planes(codes, 0, n, planes[-1])
    planes = Rotation(planes)
    q = rng.integers(0, 2**64, size=(hkv * group, words), dtype=np.uint64)
    k = int(RATIO * n)
    layout = kernels.selection_layout(n, k, SINKS, WINDOW)
    out, bounds = np.empty((hkv, layout.size), np.int32), np.array([layout.sinks_end, layout.window_start])
    scratch = kernels.PlaneScratch(hkv * group, hkv, 8 * words, n)
    fused = timings_us(lambda: kernels.planes_select_blocks(q[None], planes(), n, bounds, k, SINKS, WINDOW, out=out,
                                                            scratch=scratch), repeats)
    return _score_select_row(label, model, n, k, bandwidth, fused)


def cpu_part(sizes: dict, pool, rng, bandwidth: dict) -> tuple[list[dict], list[Target]]:
    """Rows for the default thread count (1) and for all cores: the app's scan on byte planes (the
    targets, where kernels/scan.c is built) and numba's word-major one; plus the numpy fallback."""
    import numba

    rows, targets = [], []
    default, cores = cpu.threads(), numba.config.NUMBA_NUM_THREADS
    for model in MODELS:
        hkv, group, _ = MODELS[model]
        planes = kernels.planes_fit(hkv * group, hkv, kernels.words_for(BITS))
        for n in sizes["contexts"]:
            for count in sorted({default, cores}):
                kernels.set_threads(count)
                mark = " (default)" if count == default else ""
                if planes:
                    rows.append(planes_row(f"byte planes {count} thr{mark}", model, n, pool, rng, sizes["repeats"],
                                           bandwidth))
                    log(f"byte planes {count} thr {model} N={n}: {rows[-1]['score_select us']:.0f} us")
                    target_row = rows[-1]
                rows.append(cpu_row(f"numba {count} thr", model, n, pool, rng, sizes["repeats"], bandwidth))
                log(f"numba {count} thr {model} N={n}: {rows[-1]['score_select us']:.0f} us")
                if count == default and n >= TARGET_FROM:
                    row = target_row if planes else rows[-1]
                    targets.append(Target(f"cpu score+select / floor ({row['backend'].split(' thr')[0]}), {model}, "
                                          f"N={n}", row["ratio to floor"], TARGET_RATIO, higher_is_better=False))
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


CUDA_RATIOS = (0.02, 0.10)  # the paper's budget and the app's default (spotlight/config.py)
CUDA_FOOTPRINT = 1 << 30  # bytes of rotating code buffers: ~17x the H200's 60 MB L2
GRAPH_CALLS = 20  # score_select calls captured in one CUDA graph (each on another layer's codes)


def cuda_part(sizes: dict) -> tuple[list[dict], list[Target], str]:
    """CUDA: score + select per layer (all KV heads), event-timed, beside the bandwidth floor and
    dense decode attention over the same N; the 512K rows carry the issue's 50 us target."""
    try:
        import cupy as cp

        if not cp.is_available():
            return [], [], ""
    except ImportError:
        return [], [], ""
    import torch

    bandwidth = _device_bandwidth(cp)
    rng = np.random.default_rng(1)
    pool = cp.asarray(rng.integers(0, 2**64, size=CUDA_FOOTPRINT // 8, dtype=np.uint64))  # (FOOTPRINT / 8,)
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    log(f"CUDA: {device}, device copy {bandwidth / 1e12:.2f} TB/s (bytes read + written)")
    rows, targets = [], []
    for model, (hkv, group, dim) in MODELS.items():
        words = kernels.words_for(BITS)
        for n in sizes["contexts"]:
            per_layer = hkv * words * n * 8
            layers = Rotation(layer_codes(pool, hkv, words, n))  # (Hkv, W, N) views of the device pool
            q = cp.asarray(rng.integers(0, 2**64, size=(hkv * group, words), dtype=np.uint64))  # (H, W)
            scored = cp.empty((hkv, n), np.int32)
            scratch = kernels.make_scratch(q, layers())
            dense_us, sparse_us = _attention_us(torch, hkv, group, dim, n, sizes["repeats"])
            for ratio in CUDA_RATIOS:
                k = int(ratio * n)
                out = cp.empty((hkv, kernels.selection_layout(n, k, SINKS, WINDOW).size), np.int32)

                def fused():
                    return kernels.score_select(q, layers(), n, k, SINKS, WINDOW, out=out, scratch=scratch)

                row = {"part": "CUDA score + select per layer (all KV heads)", "model": model, "N": n,
                       "budget": f"{ratio:.0%}", "scores us": _device_us(
                           lambda: kernels.scores(q, layers(), n, out=scored), sizes["repeats"]),
                       "score_select us": _device_us(fused, sizes["repeats"]),
                       "score_select in a graph us": _graph_us(cp, fused),
                       "floor us": per_layer / bandwidth * 1e6,
                       "dense attention us": dense_us, "dense floor us": 2 * hkv * n * dim * 2 / bandwidth * 1e6,
                       "sparse attention us": sparse_us(int(ratio * n))}
                row["ratio to floor"] = row["score_select in a graph us"] / row["floor us"]
                rows.append(row)
                if n == max(sizes["contexts"]):
                    targets.append(Target(f"cuda score+select us (device time, graph), {model}, N={n}, {ratio:.0%}",
                                          row["score_select in a graph us"], CUDA_TARGET_US, higher_is_better=False))
                    targets.append(Target(f"cuda score+select us (launched from Python), {model}, N={n}, {ratio:.0%}",
                                          row["score_select us"], CUDA_TARGET_US, higher_is_better=False))
            del layers, scratch, scored
    rows += _breakdown(cp, pool, rng, max(sizes["contexts"]), bandwidth)
    rows += _grid_sweep(cp, pool, rng, max(sizes["contexts"]))
    note = (f"CUDA rows: {device}. Codes random, {BITS} bits, word-major, rotating over {CUDA_FOOTPRINT >> 30} GiB "
            f"of layers (beyond the L2). `score_select us`: one call launched from Python (a memset and three "
            f"kernels), timed with CUDA events around it, median of {sizes['repeats'] * 4}; `in a graph`: "
            f"{GRAPH_CALLS} calls captured in one CUDA graph, per call (device time without Python's launch "
            f"overhead, as a captured decode step would run). `floor us` = bytes of key codes / the device's "
            f"copy bandwidth measured in this run ({bandwidth / 1e12:.2f} TB/s, bytes read + written). "
            f"`dense attention us`: torch SDPA of one decode query group over all N bf16 K/V rows of the layer; "
            f"`sparse attention us`: gather of the selected rows + SDPA (both event-timed, torch "
            f"{torch.__version__}); `dense floor us` = bytes of the layer's bf16 K and V / the copy bandwidth, what "
            f"a split-KV (flash-decoding) kernel could approach; SDPA runs one block per query head group here.")
    return rows, targets, note


def _breakdown(cp, pool, rng, n: int, bandwidth: float) -> list[dict]:
    """Where score_select's device time goes at N tokens (2 %): graphs of its first launches, differenced."""
    from kernels import cuda

    rows = []
    for model, (hkv, group, _) in MODELS.items():
        words = kernels.words_for(BITS)
        layers = Rotation(layer_codes(pool, hkv, words, n))
        q = cp.asarray(rng.integers(0, 2**64, size=(hkv * group, words), dtype=np.uint64))  # (H, W)
        k = int(RATIO * n)
        layout = kernels.selection_layout(n, k, SINKS, WINDOW)
        scratch = kernels.make_scratch(q, layers())
        out = cp.empty((hkv, layout.size), np.int32)
        bins = scratch.hist.shape[1]

        def zero():
            cuda._zero(scratch.hist)

        def zero_score():
            cuda._zero(scratch.hist)
            cuda._launch_scores(q, layers(), n, scratch.scores, n, group, words, scratch.hist, bins,
                                layout.sinks_end, layout.window_start)

        def full():
            kernels.score_select(q, layers(), n, k, SINKS, WINDOW, out=out, scratch=scratch)

        t_zero, t_score, t_full = (_graph_us(cp, fn) for fn in (zero, zero_score, full))
        score_bytes = hkv * n * scratch.scores.itemsize  # 16-bit scores in the fused path
        code_bytes = hkv * words * n * 8
        part = f"CUDA score_select device time by step (N={n}, {RATIO:.0%}, graph)"
        for step, us, moved in (("memset of the histogram", t_zero, 0),
                                ("hamming_scores (+ histogram)", t_score - t_zero, code_bytes + score_bytes),
                                ("select_count + select_write", t_full - t_score, 2 * score_bytes),
                                ("all", t_full, code_bytes + 3 * score_bytes)):
            rows.append({"part": part, "model": model, "step": step, "us": us, "MB moved": moved / 1e6,
                         "TB/s": moved / (us / 1e6) / 1e12 if moved and us > 0 else float("nan"),
                         "floor us": moved / bandwidth * 1e6})
    return rows


def _grid_sweep(cp, pool, rng, n: int) -> list[dict]:
    """score_select at N tokens (Llama-8B-like, 2 %) for several scoring grids: how BLOCKS_PER_SM was chosen."""
    from kernels import cuda

    hkv, group, _ = MODELS["Llama-8B-like"]
    words = kernels.words_for(BITS)
    layers = Rotation(layer_codes(pool, hkv, words, n))
    q = cp.asarray(rng.integers(0, 2**64, size=(hkv * group, words), dtype=np.uint64))  # (H, W)
    k = int(RATIO * n)
    scratch = kernels.make_scratch(q, layers())
    out = cp.empty((hkv, kernels.selection_layout(n, k, SINKS, WINDOW).size), np.int32)
    default, rows = cuda.BLOCKS_PER_SM, []
    try:
        for per_sm in (1, 2, 4, 8, 16, 64):
            cuda.BLOCKS_PER_SM = per_sm
            cuda._resident_blocks.cache_clear()

            def fused():
                return kernels.score_select(q, layers(), n, k, SINKS, WINDOW, out=out, scratch=scratch)

            rows.append({"part": f"CUDA scoring grid sweep (Llama-8B-like, N={n}, {RATIO:.0%})",
                         "blocks per SM": per_sm, "default": "yes" if per_sm == default else "",
                         "score_select in a graph us": _graph_us(cp, fused)})
    finally:
        cuda.BLOCKS_PER_SM = default
        cuda._resident_blocks.cache_clear()
    return rows


def _device_bandwidth(cp) -> float:
    """Bytes/s (read + written) of a 1 GiB device-to-device copy, median of 10."""
    a = cp.empty(1 << 30, np.uint8)
    b = cp.empty_like(a)
    us = _device_us(lambda: cp.copyto(b, a), 3)
    del a, b
    return 2 * (1 << 30) / (us / 1e6)


def _device_us(fn, repeats: int) -> float:
    """Median microseconds of fn() between two CUDA events (launch overhead included)."""
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


def _graph_us(cp, fn) -> float:
    """Microseconds per call of GRAPH_CALLS calls of fn captured in one CUDA graph (median of 10 replays)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # compile and warm outside the capture
        stream.synchronize()
        stream.begin_capture()
        for _ in range(GRAPH_CALLS):
            fn()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(10):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / GRAPH_CALLS)
    return float(np.median(times))


def _attention_us(torch, hkv: int, group: int, dim: int, n: int, repeats: int):
    """(dense us, sparse_us(k)) of one decode step's attention over a layer of N bf16 rows on the GPU."""
    import torch.nn.functional as F

    device = "cuda"
    kv = [torch.randn(2, 1, hkv, n, dim, dtype=torch.bfloat16, device=device) for _ in range(2)]
    turn = Rotation(kv)
    q = torch.randn(1, hkv, group, dim, dtype=torch.bfloat16, device=device)  # (1, Hkv, G, D): one step

    def dense():
        k, v = turn()
        return F.scaled_dot_product_attention(q, k, v)  # (1, Hkv, G, D)

    def sparse_us(k: int) -> float:
        idx = torch.randint(0, n, (1, hkv, k, 1), device=device).expand(-1, -1, -1, dim)  # (1, Hkv, K, D)

        def sparse():
            kk, vv = turn()
            return F.scaled_dot_product_attention(q, kk.gather(2, idx), vv.gather(2, idx))

        return _device_us(sparse, repeats)  # torch and CuPy share the legacy default stream

    return _device_us(dense, repeats), sparse_us


def attention_rows(sizes: dict, rng) -> list[dict]:
    """Decode attention of one SmolLM2 layer: kernels.attend vs SDPA over all rows, kernels.gather_attend vs
    torch.gather + SDPA over 2 % of them (random ascending rows); K/V rotate over layers beyond the cache."""
    import torch
    import torch.nn.functional as F

    from spotlight.attention import sparse_decode

    hkv, group, dim = MODELS["SmolLM2-135M"]
    torch.set_num_threads(1)  # as in decode (bench/spotlight_speed.py DECODE_THREADS)
    rows = []
    for n in ([32768] if sizes is QUICK else [32768, 131072]):
        count = max(2, (512 << 20) // (2 * hkv * n * dim * 4))
        layers = Rotation([(torch.randn(hkv, n, dim), torch.randn(hkv, n, dim)) for _ in range(count)])
        q = torch.randn(hkv * group, 1, dim)
        k = int(RATIO * n) + SINKS + WINDOW
        idx = np.sort(np.stack([rng.choice(n, k, replace=False) for _ in range(hkv)]), axis=1).astype(np.int32)
        out = torch.empty(hkv * group, dim)
        scratch = kernels.make_attend_scratch(out, layers()[0])

        def sdpa():
            kv = layers()
            return F.scaled_dot_product_attention(q.view(1, hkv, group, dim), kv[0][None], kv[1][None])

        def attend():
            kv = layers()
            return kernels.attend(q[:, 0], kv[0], kv[1], n, out=out, scratch=scratch)

        def torch_sparse():
            kv = layers()
            return sparse_decode(q, kv[0], kv[1], idx)

        def gather_attend():
            kv = layers()
            return kernels.gather_attend(q[:, 0], kv[0], kv[1], idx, out=out, scratch=scratch)

        rows.append({"part": "decode attention per layer (SmolLM2, fp32, 1 thread)", "N": n, "rows selected": k,
                     "SDPA all rows us": median_us(sdpa, sizes["repeats"]),
                     "kernels.attend us": median_us(attend, sizes["repeats"]),
                     "torch gather + SDPA us": median_us(torch_sparse, sizes["repeats"]),
                     "kernels.gather_attend us": median_us(gather_attend, sizes["repeats"])})
        del layers
    return rows


def main(argv=None):
    p = parser("retrieval", __doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "kernels", "cuda"], default="all",
                   help="which part to run (cuda: the GPU rows only, in their own RESULTS section; "
                        "'all' runs it too when a GPU is present)")
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    rows, targets, notes = [], [], []
    if args.part in ("all", "kernels"):
        rng = np.random.default_rng(0)
        pool = rng.integers(0, 2**64, size=FOOTPRINT // 8, dtype=np.uint64)  # (FOOTPRINT / 8,)
        bandwidth = read_bandwidth(pool)
        log("read bandwidth: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items()))
        rows, targets = cpu_part(sizes, pool, rng, bandwidth)
        rows += gather_rows(sizes, rng) + attention_rows(sizes, rng) + after_torch_rows(sizes, pool, rng)
        notes.append(
            f"Codes: {BITS} bits per token per KV head, word-major (Hkv, W, N) uint64, random; k = {RATIO:.0%} of N, "
            f"sinks {SINKS}, window {WINDOW}; each call reads another layer's codes out of {FOOTPRINT >> 20} MiB "
            f"(beyond the last-level cache). Memory read bandwidth in this run: "
            + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items())
            + ". `floor us` = bytes of codes / numpy's read; `ratio to all-core read` divides by the faster "
            f"all-core read instead. Times are medians of repeated calls (`best` = fastest); the machine is "
            f"shared, so parallel rows can include waits for a busy core. CPU: {cpu_features()}. `byte planes` rows: "
            f"the app's flat scan on the CPU where kernels/scan.c is built (the codes also kept as byte planes, "
            f"as many bytes; score and select in one call), the targets' rows; `numba` rows: the word-major "
            f"kernels (the app's scan where scan.c is not built), at the default thread count and on all cores; "
            f"`numpy`: the pure-numpy fallback (np.bitwise_count). Decode attention rows: K and V of one layer rotate over 512 MiB. "
            f"The CUDA rows have their own section (`--part cuda`).")
    if args.part in ("all", "kernels"):
        finish("retrieval", args, rows, targets, title="Retrieval kernels (score + select)", notes="\n\n".join(notes))
    if args.part in ("all", "cuda"):
        cuda_rows, cuda_targets, cuda_note = cuda_part(sizes)
        if not cuda_rows:
            log("No CUDA GPU here (cupy missing or no device): no CUDA rows; the RESULTS section is kept as it was.")
            if args.part == "cuda":
                raise SystemExit(1)
            return
        finish("retrieval-cuda", args, cuda_rows, cuda_targets, title="Retrieval kernels on CUDA (score + select)",
               notes=cuda_note, command="retrieval --part cuda")


if __name__ == "__main__":
    main()
