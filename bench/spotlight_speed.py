"""Spotlight vs dense decode speed at long contexts, beside bytes-moved floors (issue #3).

Used by `python -m bench.decode --part spotlight`. The cache is filled with random keys
and values (codes computed by the encoders as usual); contexts beyond the model's 8K
window are for speed only.
"""
from __future__ import annotations

import time

import torch

from bench.common import Target, log

FULL = {"contexts": [8192, 32768, 131072], "steps": 6}
QUICK = {"contexts": [8192, 32768], "steps": 3}
LLAMA_CPP_REFERENCE_32K = 8.8  # tok/s, measured on this machine class (reference/environment.md §10)


def measure_bandwidth(n_bytes: int = 1 << 30, repeats: int = 3) -> float:
    """Read bandwidth in bytes/s: the best of `repeats` sums over an n_bytes fp32 tensor."""
    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return n_bytes / best


def weight_bytes(model) -> int:
    """Bytes of every matrix a decode step reads (the tied embedding is read once, as the head)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel() * module.weight.element_size()
    return total


def floor_bytes(args, n: int, spotlight, kv_bytes: int, code_words: int, dense: bool) -> int:
    """KV-side bytes one decode step must read at n cached tokens (weights excluded)."""
    row = 2 * args.head_dim * kv_bytes  # K + V of one token and KV head
    if dense:
        return args.n_layers * args.n_kv_heads * row * n
    sparse_layers = args.n_layers - len(spotlight.dense_layers)
    selected = spotlight.budget(n)
    per_sparse = args.n_kv_heads * (n * code_words * 8 + selected * row)
    per_dense = args.n_kv_heads * row * n
    return sparse_layers * per_sparse + len(spotlight.dense_layers) * per_dense


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


def seconds_per_token(model, cache, policy, steps: int) -> float:
    token = torch.zeros(1, dtype=torch.long)
    times = []
    with torch.inference_mode():
        for _ in range(steps + 1):
            start = time.perf_counter()
            model(token, cache, policy)
            times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]  # median, the first step warms up


def spotlight_part(quick: bool):
    from spotlight.attention import CodeSelector, DenseDecode, SpotlightDecode
    from spotlight.config import EngineConfig, SpotlightConfig, default_home
    from spotlight.engine import Engine, find_encoders

    sizes = QUICK if quick else FULL
    engine = Engine.load(EngineConfig(), default_home())
    model, args = engine.model, engine.args
    config = SpotlightConfig()
    encoders, _ = find_encoders(args, engine.fingerprint, config.bits, None)
    policies = {"dense": DenseDecode(), "spotlight": SpotlightDecode(config, CodeSelector(encoders))}
    bandwidth = measure_bandwidth()
    weights = weight_bytes(model)
    kv_bytes = model.tok_embeddings.weight.element_size()
    rows = []
    for n in sizes["contexts"]:
        measured = {}
        for name, policy in policies.items():
            cache = filled_cache(model, policy, n, seed=n)
            seconds = seconds_per_token(model, cache, policy, sizes["steps"])
            del cache
            floor = (weights + floor_bytes(args, n + 1, config, kv_bytes, policy.code_words, name == "dense")) / bandwidth
            measured[name] = seconds
            rows.append({"context": n, "path": name, "ms/token": seconds * 1e3, "tok/s": 1 / seconds,
                         "floor ms": floor * 1e3, "measured/floor": seconds / floor,
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
        f"run: {bandwidth / 1e9:.1f} GB/s; weights read per token: {weights / 1e6:.0f} MB. Caches of random "
        f"keys/values: contexts past 8K are beyond SmolLM2's window (speed only). llama.cpp was not measured in "
        f"this run (`make bench-deps` builds it); its 32K reference is 8.8 tok/s on this machine class."
    )
    return rows, targets, notes
