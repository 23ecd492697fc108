"""Spotlight vs dense decode speed at long contexts, beside bytes-moved floors (issue #3).

Used by `python -m bench.decode --part spotlight`. The cache is filled with random keys
and values (codes computed by the encoders as usual); contexts beyond the model's 8K
window are for speed only.

Floor = bytes a decode step must read / memory read bandwidth, both from this run:
  * bytes: every weight matrix once; dense path: K and V of every cached token in every
    layer; Spotlight: in each sparse layer the key codes of every token plus K and V of the
    selected rows, the query encoder's weights, and full K and V in the dense layers; the
    key encoder's weights in every layer (each new key is coded once);
  * bandwidth: the faster of a 1-thread and a 2-thread streaming read (torch sum over 1 GiB,
    best of 5 each). That is the most this machine delivers to a reader, so the floor is a
    lower bound on the step time (a 1-thread read alone would make the floor easier).
Decode runs with DECODE_THREADS torch intra-op threads (see its comment).
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from bench.common import Target, log

FULL = {"contexts": [8192, 32768, 131072], "steps": 8}
QUICK = {"contexts": [8192, 32768], "steps": 3}
LLAMA_CPP_REFERENCE_32K = 8.8  # tok/s, measured on this machine class (reference/environment.md §10)
# NOTE: one torch thread for decode. The decode step is ~600 small ops plus GEMVs; with 2 OpenMP
# threads each op's parallel region waits for the second core, and beside any other busy process
# (this machine is shared) a step took 3-6x longer (e.g. 372 vs 60 ms at 64 tokens); MKL's GEMVs
# gained nothing from the second thread (49 vs 50 ms). The numba kernels run one thread too.
DECODE_THREADS = 1


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


def weight_bytes(model) -> int:
    """Bytes of every matrix a decode step reads (the tied embedding is read once, as the head)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
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


def spotlight_part(quick: bool):
    from spotlight.attention import CodeSelector, DenseDecode, SpotlightDecode
    from spotlight.config import EngineConfig, SpotlightConfig, default_home
    from spotlight.engine import Engine, find_encoders

    sizes = QUICK if quick else FULL
    engine = Engine.load(EngineConfig(threads=DECODE_THREADS), default_home())
    model, args = engine.model, engine.args
    config = SpotlightConfig()
    encoders, _ = find_encoders(args, engine.fingerprint, config.bits, None)
    policies = {"dense": DenseDecode(), "spotlight": SpotlightDecode(config, CodeSelector(encoders))}
    reads = measure_bandwidth()
    torch.set_num_threads(DECODE_THREADS)
    bandwidth = max(reads.values())
    weights = weight_bytes(model)
    kv_bytes = model.tok_embeddings.weight.element_size()
    rows = []
    for n in sizes["contexts"]:
        measured = {}
        for name, policy in policies.items():
            cache = filled_cache(model, policy, n, seed=n)
            seconds, cpu_seconds = seconds_per_token(model, cache, policy, sizes["steps"])
            del cache
            extra = floor_bytes(args, n + 1, config, kv_bytes, policy.code_words, name == "dense", encoders)
            floor = (weights + extra) / bandwidth
            measured[name] = seconds
            rows.append({"context": n, "path": name, "ms/token": seconds * 1e3, "tok/s": 1 / seconds,
                         "cpu ms/token": cpu_seconds * 1e3, "floor ms": floor * 1e3, "measured/floor": seconds / floor,
                         "speedup vs dense": measured["dense"] / seconds})
            log(f"{name} {n}: {rows[-1]}")
    targets = []
    for row in rows:
        if row["context"] >= 32768:
            targets.append(Target(f"{row['path']} within 1.3x of its floor at {row['context']}",
                                  row["measured/floor"], 1.3, higher_is_better=False))
    spot32 = [r for r in rows if r["context"] == 32768 and r["path"] == "spotlight"]
    if spot32:
        targets.append(Target("Spotlight tok/s at 32K >= 2x llama.cpp's reference 8.8 tok/s",
                              spot32[0]["tok/s"], 2 * LLAMA_CPP_REFERENCE_32K))
    notes = (
        f"Spotlight: {config.bits}-bit codes, dense layers {list(config.dense_layers)}, sinks {config.sinks}, "
        f"window {config.window}, ratio {config.ratio:.0%} (k_min {config.k_min}); encoders "
        f"{'trained' if encoders.trained else 'untrained (same speed)'}. Memory read bandwidth measured in this "
        f"run (streaming read, torch sum over 1 GiB, best of 5): 1 thread {reads[1] / 1e9:.1f} GB/s, 2 threads "
        f"{reads[2] / 1e9:.1f} GB/s; the floor divides by the faster, the most this machine delivers to a reader. "
        f"Floor bytes: weights ({weights / 1e6:.0f} MB per token) + KV rows (dense) or, for Spotlight, codes + "
        f"selected rows + query encoder per sparse layer, full KV in dense layers, key encoder in every layer. "
        f"Decode with {DECODE_THREADS} torch thread(s) and 1 numba thread (why: bench/spotlight_speed.py). "
        f"Attention on CPU runs kernels.attend / kernels.gather_attend; one-row weight GEMVs run kernels.linear (numba). "
        f"Load average at the end of the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (the machine is "
        f"shared: wall times include other processes' share; `cpu ms/token` is the decode thread's own time). "
        f"Caches of random "
        f"keys/values: contexts past 8K are beyond SmolLM2's window (speed only). llama.cpp was not measured in "
        f"this run (`make bench-deps` builds it); its 32K reference is 8.8 tok/s on this machine class."
    )
    return rows, targets, notes
