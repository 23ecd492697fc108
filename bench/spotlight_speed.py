"""Spotlight vs dense decode speed at long contexts, beside bytes-moved floors (issue #3).

Used by `python -m bench.decode --part spotlight`. The cache is filled with random keys
and values (codes computed by the encoders as usual); contexts beyond the model's 8K
window are for speed only.

Floor = bytes a decode step must read / memory read bandwidth, both from this run:
  * bytes: every weight matrix once; dense path: K and V of every cached token in every
    layer; Spotlight: in each sparse layer the key codes of every token plus K and V of the
    selected rows, the query encoder's weights, and full K and V in the dense layers; the
    key encoder's weights in every layer (each new key is coded once);
  * bandwidth: the fastest of a 1-thread and a 2-thread streaming read (torch sum over 1 GiB,
    best of 5 each) and of our own decode step's weight GEMVs at each kernel thread count
    (this shared machine's read bandwidth varies between runs, 40-75 GB/s for two threads; a
    floor our own kernels beat would be no floor). That is the most this machine delivered to
    a reader in the run, so the floor is a lower bound on the step time.
Decode runs with DECODE_THREADS torch intra-op threads (see its comment).
"""
from __future__ import annotations

import os
import statistics
import time

import torch

import kernels
from bench.common import SMALL_MODEL, Target, log, peak_rss_mb, small_gguf

FULL = {"contexts": [8192, 32768, 131072], "steps": 8}
QUICK = {"contexts": [8192, 32768], "steps": 3}
LLAMA_CPP_REFERENCE_32K = 8.8  # tok/s, measured on this machine class (reference/environment.md §10)
LLAMA_CPP_CONTEXTS = {False: [8192, 32768], True: [8192]}  # quick -> contexts llama.cpp is measured at
LLAMA_CPP_STEPS = 16  # decode steps timed after the prompt
# NOTE: one torch thread for decode. The decode step is ~600 small ops plus GEMVs; with 2 OpenMP
# threads each op's parallel region waits for the second core, and beside any other busy process
# (this machine is shared) a step took 3-6x longer (e.g. 372 vs 60 ms at 64 tokens); MKL's GEMVs
# gained nothing from the second thread (49 vs 50 ms). The numba kernels run one thread too.
DECODE_THREADS = 1
# Threads of the numba decode kernels (kernels.set_threads; EngineConfig.kernel_threads): each path is
# timed at 1 (the default) and at every core of a 2-core machine, side by side on the same cache.
KERNEL_THREADS = (1, 2) if os.cpu_count() >= 2 else (1,)


def measure_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> dict[int, float]:
    """Streaming read bandwidth in bytes/s per torch thread count (1 and 2): best of `repeats` sums."""
    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    before, result = torch.get_num_threads(), {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
        result[threads] = n_bytes / best
    torch.set_num_threads(before)
    return result


def weight_pass_bandwidth(model, repeats: int = 5) -> dict[int, float]:
    """Bytes/s of one decode step's weight GEMVs (kernels.linear over every matrix, best of `repeats`)
    per kernel thread count: a read our own kernels achieve, so no floor may assume less."""
    from kernels.linear import linear

    matrices, seen = [], set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            matrices.append(module.weight.detach())
    inputs = {w.shape[1]: torch.randn(w.shape[1]) for w in matrices}
    outputs = [torch.empty(w.shape[0]) for w in matrices]
    total = sum(w.numel() * w.element_size() for w in matrices)
    result = {}
    for threads in KERNEL_THREADS:
        kernels.set_threads(threads)
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass compiles / warms up
            start = time.perf_counter()
            for w, out in zip(matrices, outputs):
                linear(inputs[w.shape[1]], w, out=out)
            best = min(best, time.perf_counter() - start)
        result[threads] = total / best
    kernels.set_threads(1)
    return result


def weight_bytes(model) -> int:
    """Bytes of every matrix a decode step reads (the tied embedding is read once, as the head);
    a QuantLinear's are its GGUF blocks (spotlight/quantized.py)."""
    from spotlight.quantized import QuantLinear

    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            for part in module.parts:
                if id(part.blocks) not in seen:
                    seen.add(id(part.blocks))
                    total += part.nbytes
        elif isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel() * module.weight.element_size()
    return total


def encoder_bytes(encoders) -> tuple[int, int]:
    """(query, key) encoder bytes read per layer: the parameters of one layer of each side."""
    def per_layer(mlp):
        return sum(p[0].numel() * p.element_size() for p in mlp.parameters())

    return per_layer(encoders.query), per_layer(encoders.key)


def floor_bytes(args, n: int, spotlight, kv_bytes: int, code_words: int, dense: bool, encoders=None) -> int:
    """Bytes one decode step must read at n cached tokens besides the model's weights."""
    row = 2 * args.head_dim * kv_bytes  # K + V of one token and KV head
    if dense:
        return args.n_layers * args.n_kv_heads * row * n
    sparse_layers = args.n_layers - len(spotlight.dense_layers)
    selected = spotlight.budget(n)
    query_encoder, key_encoder = encoder_bytes(encoders) if encoders is not None else (0, 0)
    per_sparse = args.n_kv_heads * (n * code_words * 8 + selected * row) + query_encoder
    per_dense = args.n_kv_heads * row * n
    return sparse_layers * per_sparse + len(spotlight.dense_layers) * per_dense + args.n_layers * key_encoder


def filled_cache(model, policy, n: int, seed: int):
    """A cache of n random tokens, codes computed through the policy as a prefill would."""
    from spotlight.cache import KVCache

    args = model.args
    cache = KVCache(args, n + 64, code_words=policy.code_words)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for layer in range(args.n_layers):
            k = torch.randn(args.n_kv_heads, n, args.head_dim, generator=generator)  # (Hkv, N, D)
            cache.write(layer, k, torch.randn(args.n_kv_heads, n, args.head_dim, generator=generator))
            policy.on_new_tokens(layer, None, k, cache)
    cache.advance(n)
    return cache


def seconds_per_token(model, cache, policy, steps: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of a decode step; the first step warms up and is dropped.

    CPU time is this thread's: with one decode thread it is the step's cost without the time
    a shared machine spends running other processes (wall time is what the targets use).
    """
    token = torch.zeros(1, dtype=torch.long)
    wall, cpu = [], []
    with torch.inference_mode():
        for _ in range(steps + 1):
            start, start_cpu = time.perf_counter(), time.thread_time()
            model(token, cache, policy)
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def _llama_cpp_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_llama_cpp(contexts: list[int], steps: int) -> list[dict]:
    """llama.cpp (llama-cpp-python, `make bench-deps`) on the packaged GGUF: for each context, the
    prompt-processing speed of a random-token prompt of that length, then the median decode step.

    Runs in its own process (see `in_subprocess`); threads: every core, llama.cpp's own choice
    of batch (512) and flash attention on (its fastest long-context CPU setting).
    """
    import random

    from llama_cpp import Llama


    rows = []
    for n in contexts:
        llm = Llama(model_path=str(small_gguf()), n_ctx=n + 2 * steps + 8, n_threads=os.cpu_count(),
                    n_threads_batch=os.cpu_count(), n_batch=512, flash_attn=True, verbose=False)
        rng = random.Random(n)
        prompt = [rng.randrange(100, llm.n_vocab()) for _ in range(n)]
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            llm.eval([rng.randrange(100, llm.n_vocab())])
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        rows.append({"context": n, "path": "llama.cpp", "kernel threads": os.cpu_count(), "ms/token": seconds * 1e3,
                     "tok/s": 1 / seconds,
                     "prompt tok/s": n / prefill, "peak RSS MiB": peak_rss_mb()})
        log(f"llama.cpp {n}: {rows[-1]}")
        del llm
    return rows


def best(rows: list[dict], context: int, path: str) -> dict | None:
    """The fastest of our rows for this context and path (any kernel thread count)."""
    mine = [r for r in rows if r["context"] == context and r["path"] == path]
    return min(mine, key=lambda r: r["ms/token"]) if mine else None


def spotlight_part(quick: bool):
    from spotlight.attention import CodeSelector, DenseDecode, SpotlightDecode
    from spotlight.config import EngineConfig, SpotlightConfig, default_home
    from spotlight.engine import Engine, find_encoders

    sizes = QUICK if quick else FULL
    engine = Engine.load(EngineConfig(model_path=SMALL_MODEL, threads=DECODE_THREADS), default_home())
    model, args = engine.model, engine.args
    config = SpotlightConfig()
    encoders, _ = find_encoders(args, engine.fingerprint, config.bits, None)
    def make_policy(name):  # a fresh policy: its kernel scratch is sized for the current thread count
        return DenseDecode() if name == "dense" else SpotlightDecode(config, CodeSelector(encoders))

    reads = measure_bandwidth()
    torch.set_num_threads(DECODE_THREADS)
    passes = weight_pass_bandwidth(model)
    bandwidth = max(*reads.values(), *passes.values())
    weights = weight_bytes(model)
    kv_bytes = model.tok_embeddings.weight.element_size()
    rows = []
    for n in sizes["contexts"]:
        measured = {}
        for name in ("dense", "spotlight"):
            cache = filled_cache(model, make_policy(name), n, seed=n)
            for threads in KERNEL_THREADS:
                kernels.set_threads(threads)
                policy = make_policy(name)
                seconds, cpu_seconds = seconds_per_token(model, cache, policy, sizes["steps"])
                extra = floor_bytes(args, n + 1, config, kv_bytes, policy.code_words, name == "dense", encoders)
                floor = (weights + extra) / bandwidth
                measured[name, threads] = seconds
                rows.append({"context": n, "path": name, "kernel threads": threads, "ms/token": seconds * 1e3,
                             "tok/s": 1 / seconds, "cpu ms/token": cpu_seconds * 1e3, "floor ms": floor * 1e3,
                             "measured/floor": seconds / floor,
                             "speedup vs dense": measured["dense", threads] / seconds})
                log(f"{name} {n} {threads} thread(s): {rows[-1]}")
            kernels.set_threads(1)
            del cache
    llama_rows = []
    if llama_cpp_available():
        from bench.decode import in_subprocess

        llama_rows = in_subprocess(run_llama_cpp, LLAMA_CPP_CONTEXTS[quick], LLAMA_CPP_STEPS)
        for row in llama_rows:
            ours = {path: best(rows, row["context"], path) for path in ("dense", "spotlight")}
            row["speedup vs dense"] = ours["dense"]["ms/token"] / row["ms/token"] if ours["dense"] else None
            row["spotlight vs llama.cpp"] = row["ms/token"] / ours["spotlight"]["ms/token"] if ours["spotlight"] else None
        order = ["dense", "spotlight", "llama.cpp"]
        rows = sorted(rows + llama_rows, key=lambda r: (r["context"], order.index(r["path"]), r.get("kernel threads", 0)))
    targets = []
    for row in rows:
        if row["context"] >= 32768 and row["path"] != "llama.cpp":
            targets.append(Target(f"{row['path']} ({row['kernel threads']} kernel thread(s)) within 1.3x of its floor "
                                  f"at {row['context']}", row["measured/floor"], 1.3, higher_is_better=False))
    spot32 = best(rows, 32768, "spotlight")
    llama32 = [r for r in llama_rows if r["context"] == 32768]
    if spot32 and llama32:
        targets.append(Target(f"Spotlight tok/s at 32K ({spot32['kernel threads']} kernel thread(s)) >= 2x llama.cpp "
                              f"measured in this run ({llama32[0]['tok/s']:.1f})", spot32["tok/s"], 2 * llama32[0]["tok/s"]))
    elif spot32:
        targets.append(Target(f"Spotlight tok/s at 32K ({spot32['kernel threads']} kernel thread(s)) >= 2x llama.cpp's "
                              f"reference 8.8 tok/s (not measured here)", spot32["tok/s"], 2 * LLAMA_CPP_REFERENCE_32K))
    notes = (
        f"Spotlight: {config.bits}-bit codes, dense layers {list(config.dense_layers)}, sinks {config.sinks}, "
        f"window {config.window}, ratio {config.ratio:.0%} (k_min {config.k_min}); encoders "
        f"{'trained' if encoders.trained else 'untrained (same speed)'}. Memory read bandwidth measured in this "
        f"run (streaming read, torch sum over 1 GiB, best of 5): 1 thread {reads[1] / 1e9:.1f} GB/s, 2 threads "
        f"{reads[2] / 1e9:.1f} GB/s; our decode step's weight GEMVs alone (kernels.linear, best of 5): "
        + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in passes.items())
        + f"; the floor divides by the fastest of these ({bandwidth / 1e9:.1f} GB/s), the most this machine was "
        f"seen to deliver to a reader in this run. "
        f"Floor bytes: weights ({weights / 1e6:.0f} MB per token) + KV rows (dense) or, for Spotlight, codes + "
        f"selected rows + query encoder per sparse layer, full KV in dense layers, key encoder in every layer. "
        f"Decode with {DECODE_THREADS} torch thread(s) (why: bench/spotlight_speed.py) and each path at "
        f"{' and '.join(map(str, KERNEL_THREADS))} thread(s) of the numba kernels (`kernel threads`: weight GEMVs, "
        f"attention, retrieval; the app's default is 1, `--kernel-threads` raises it), timed side by side on the same "
        f"cache; `speedup vs dense` compares equal thread counts, and llama.cpp's columns compare with our fastest row. "
        f"Attention on CPU runs kernels.attend / kernels.gather_attend; one-row weight GEMVs run kernels.linear (numba). "
        f"Peak RSS of our process (model, encoders, the largest cache of each path): {peak_rss_mb():.0f} MiB"
        + (f"; llama.cpp's process: {max(r['peak RSS MiB'] for r in llama_rows):.0f} MiB. " if llama_rows else ". ")
        + f"Load average at the end of the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (the machine is "
        f"shared: wall times include other processes' share; `cpu ms/token` is the decode thread's own time). "
        f"Caches of random "
        f"keys/values: contexts past 8K are beyond SmolLM2's window (speed only). "
        + (f"llama.cpp: llama-cpp-python {_llama_cpp_version()} built from source (`make bench-deps`) on the same "
           f"Q4_1 GGUF, {os.cpu_count()} threads, flash attention on, in its own process after ours; its cache is "
           f"filled by processing a random-token prompt of that length (`prompt tok/s`), then "
           f"{LLAMA_CPP_STEPS} decode steps are timed (median). `spotlight vs llama.cpp` = llama.cpp's ms/token "
           f"over Spotlight's." if llama_rows else
           "llama.cpp was not measured in this run (`make bench-deps` builds it); its 32K reference is 8.8 tok/s "
           "on this machine class.")
    )
    return rows, targets, notes
