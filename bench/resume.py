"""Resume speed: time to first token of a conversation restored from disk vs recomputed.

    python -m bench.resume [--quick] [--spotlight] [--threads N] [--json PATH]
    python -m bench.resume --long 131072 --model qwen2.5-coder-0.5b-instruct [--decode-tokens N]

`--long TOKENS` measures instead a real conversation past the model's window: a ChatService reads
a document of TOKENS essay tokens and answers once from nothing (the recompute), then a fresh
process resumes it for the next questions (section resume-long), and times a longer reply's decode
there and in an 8K-token conversation, both through the service.

The resumes of each row run in one **fresh process** (a restart: model loaded, nothing else
in RAM), each through a new service and Store on the data directory, timed from the call to
the first streamed token; the first resume after the restart is reported on its own.

Row "8K" (real model, real conversation): the system message holds Paul Graham essays
cut to ~7.9K tokens; one exchange is computed and stored by a `ChatService`. Then, in a
new process, a new service gets the next question (three questions, three new services;
the median is reported): render, verify and map the spans, load them, prefill the new
question, first decode step. Recompute TTFT = the same prompt prefilled from nothing on a
fresh Context, to its first token, measured in this run.

Row "32K": beyond SmolLM2's 8K window, so the spans are synthetic: 16 spans of 2048
random token ids with random K/V (and random key codes with --spotlight) of the model's
exact shapes, stored through the store like real ones. Resume = `CacheSync.restore` (the
code path `send()` uses: chain, pin, checksum, token check, load) + one decode step, in
a new process (median of three). Recompute: measured for real in full mode (32K random
tokens prefilled in the engine's chunks, then one step); in --quick mode *estimated* from
the 8K recompute measured above, scaled quadratically in the context length.

Span files sit in the page cache right after being written (a warm-disk resume).
"""
from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import SMALL_MODEL, Target, finish, log, parser

SPAN = 2048
LONG = 16 * SPAN  # 32K tokens
DOC_TOKENS = 7900  # essay tokens in the system message: the conversation ends just under 8K
QUESTIONS = ("And the second one?", "Which essay is the longest?", "Name one idea they share.",
             "Who wrote them?", "Any advice for founders?")
# --long's decode measurement: a reply long enough to time (greedy replies to short questions
# stop after a dozen tokens), asked of the resumed long conversation and of an 8K one
DECODE_QUESTION = "Summarise each of the essays in three sentences."
DECODE_TOKENS = 96
RUNS = len(QUESTIONS)  # resumes per row; the median is the row's value (the minimum is shown too)


def load_engine(spotlight: bool, threads: int | None = None, model: str = SMALL_MODEL):
    from spotlight.config import EngineConfig, SpotlightConfig, default_home
    from spotlight.engine import Engine

    config = EngineConfig(model_path=model, threads=threads)
    return Engine.load(config, default_home(), spotlight=SpotlightConfig() if spotlight else None)


def in_subprocess(fn, *args):
    """Run fn(*args) in a fresh spawned process: a restart."""
    with futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def first_turn_seconds(turns) -> tuple[float, object]:
    """Seconds from the call to the first streamed token, and the finished Turn (Turns that only
    report reading the documents, `Turn.reading`, come before the first token)."""
    started = time.perf_counter()
    first = turn = None
    for turn in turns:
        if first is None and turn.reading is None:
            first = time.perf_counter() - started
    return first, turn


def warm_up(engine, home: Path) -> None:
    """Warm the engine up as ChatService does after loading it (then close: one Store per directory)."""
    warming = service(engine, home)
    warming.warm_up()
    warming.close()


def service(engine, home: Path, max_new_tokens: int = 4):
    from chat.service import ChatService
    from chat.config import AppConfig
    from spotlight.config import SamplingConfig

    return ChatService(AppConfig(home=home, sampling=SamplingConfig(max_new_tokens=max_new_tokens)), _engine=engine)


# ----------------------------------------------------------------------------- 8K: a real conversation


def write_conversation(engine, home: Path) -> str:
    """Compute and store a ~8K-token conversation; returns its session id."""
    writer = service(engine, home)
    session = essay_conversation(writer, engine, "resume bench", DOC_TOKENS)
    first_turn_seconds(writer.send(session.id, "Summarise the first essay in one sentence."))
    writer.close()
    return session.id


def essay_conversation(writer, engine, title: str, n_tokens: int):
    """A new conversation of `writer` (a ChatService) holding `n_tokens` essay tokens as a document."""
    from bench.decode import essay_ids

    session = writer.create(title)
    writer.attach_text(session.id, "essays.txt", engine.tokenizer.decode(essay_ids(engine.tokenizer, n_tokens)))
    return session


def resume_conversation(home: str, session_id: str, spotlight: bool, threads: int | None) -> dict:
    """In a fresh process: one new service per question; TTFT of each, and the last prompt."""
    from chat.render import Renderer

    engine = load_engine(spotlight, threads)
    warm_up(engine, Path(home))
    times, turn, prompt = [], None, []
    for question in QUESTIONS:
        reader = service(engine, Path(home))
        seconds, turn = first_turn_seconds(reader.send(session_id, question))
        assert turn.restored_tokens >= DOC_TOKENS and not turn.notices, f"the cache was not reused: {turn}"
        times.append(seconds)
        records = reader._visible(session_id)[:-1]  # the prompt this reply answered
        prompt = list(Renderer(engine).prompt(reader._conversation(session_id, records)).ids)
        reader.close()
    return {"times": times, "prompt": prompt, "restored": turn.restored_tokens, "computed": turn.prefill_tokens}


def real_row(engine, home: Path, spotlight: bool, threads: int | None) -> dict:
    log("8K: computing and storing the conversation ...")
    session_id = write_conversation(engine, home)
    resumed = in_subprocess(resume_conversation, str(home), session_id, spotlight, threads)
    log(f"8K: resume TTFT {resumed['times']} s")
    prompt = resumed["prompt"]
    recompute_s, _ = first_turn_seconds(engine.stream(engine.new_context(len(prompt) + 8), prompt, _greedy(4)))
    log(f"8K: recompute TTFT {recompute_s:.1f}s for {len(prompt)} tokens")
    resume_s = statistics.median(resumed["times"])
    return {"context": len(prompt), "data": "real conversation", "resume_ttft_s": resume_s,
            "resume_min_s": min(resumed["times"]), "resume_first_s": resumed["times"][0],
            "resume_runs": len(resumed["times"]),
            "recompute_ttft_s": recompute_s, "recompute": "measured",
            "speedup": recompute_s / resume_s, "restored_tokens": resumed["restored"],
            "computed_tokens": resumed["computed"]}


def _greedy(n: int):
    from spotlight.config import SamplingConfig

    return SamplingConfig(max_new_tokens=n)


# ----------------------------------------------------------------------------- 32K: synthetic spans


def synthetic_ids(engine) -> list[int]:
    return np.random.default_rng(0).integers(0, engine.args.vocab_size, LONG).tolist()


def write_synthetic(engine, root: Path) -> str:
    """Store 16 synthetic prefix spans for one session; returns its id."""
    from chat.cachesync import CacheKey
    from memory import Store
    from memory.config import StoreConfig

    ids, rng = synthetic_ids(engine), np.random.default_rng(1)
    key = CacheKey.for_engine(engine, ids)
    with Store(StoreConfig(root)) as store:
        session = store.transcript.create_session("32K synthetic")
        prefix_hash = key.prefix_hash(ids)
        for ordinal, start in enumerate(range(0, LONG, SPAN)):
            store.spans.put_prefix_span(prefix_hash, ordinal, _random_span(engine, rng, ids[start:start + SPAN]),
                                        key.span_key, start_pos=start, session_id=session.id)
        store.spans.complete_prefix(prefix_hash, LONG)
    return session.id


def resume_synthetic(root: str, session_id: str, spotlight: bool, threads: int | None) -> dict:
    """In a fresh process: restore the 32K spans with a new Store + one decode step, RUNS times."""
    from chat.cachesync import CacheSync
    from chat.render import Rendering
    from memory import Store
    from memory.config import StoreConfig

    engine = load_engine(spotlight, threads)
    warm_up(engine, Path(root))
    ids = synthetic_ids(engine)
    rendering = Rendering(tuple(ids), (), LONG, (), (), ())  # all of it a stored prefix
    runs = []
    for _ in range(RUNS):
        with Store(StoreConfig(Path(root))) as store:
            started = time.perf_counter()
            context, restored = CacheSync(store, engine).restore(session_id, rendering)
            restore_s = time.perf_counter() - started
            _first_step(engine, context)
            runs.append((time.perf_counter() - started, restore_s))
            assert restored.restored == LONG, f"restored {restored.restored} of {LONG} tokens"
            del context
    return {"runs": runs}


def synthetic_row(engine, home: Path, recompute_8k: tuple[int, float], measure: bool, spotlight: bool,
                  threads: int | None) -> dict:
    session_id = write_synthetic(engine, home / "synthetic")
    log("32K: synthetic spans stored; resuming in a new process ...")
    runs = in_subprocess(resume_synthetic, str(home / "synthetic"), session_id, spotlight, threads)["runs"]
    resume_s, restore_s = sorted(runs)[len(runs) // 2]  # the median run
    n_8k, seconds_8k = recompute_8k
    if measure:
        log("32K: recomputing for real (several minutes) ...")
        recompute_s, how = _recompute(engine, synthetic_ids(engine)), "measured"
    else:
        factor = (LONG / n_8k) ** 2
        recompute_s, how = seconds_8k * factor, f"estimated: 8K x {factor:.1f} (quadratic)"
    log(f"32K: resume {[round(r[0], 3) for r in runs]} s, recompute {recompute_s:.0f}s ({how})")
    return {"context": LONG, "data": "synthetic spans", "resume_ttft_s": resume_s, "resume_min_s": min(runs)[0],
            "resume_first_s": runs[0][0],
            "restore_s": restore_s, "first_step_s": resume_s - restore_s, "resume_runs": len(runs),
            "recompute_ttft_s": recompute_s,
            "recompute": how, "speedup": recompute_s / resume_s, "restored_tokens": LONG, "computed_tokens": 0}


def _random_span(engine, rng, ids: list[int]):
    from memory import SpanTensors

    a = engine.args
    shape = (a.n_layers, a.n_kv_heads, len(ids), a.head_dim)  # (L, Hkv, T, D)
    codes = None
    if not engine.decodes_densely:
        codes = rng.integers(0, 2**63, (a.n_layers, a.n_kv_heads, engine.spotlight.words, len(ids)),
                             dtype=np.uint64)  # (L, Hkv, W, T)
    return SpanTensors(k=rng.standard_normal(shape, dtype=np.float32), v=rng.standard_normal(shape, dtype=np.float32),
                       token_ids=np.asarray(ids), key_codes=codes)


@torch.inference_mode()
def _first_step(engine, context) -> int:
    """One decode step on the restored cache; the first token's id."""
    token = torch.tensor([context.tokens[-1]], dtype=torch.long)
    return int(engine.model(token, context.cache, engine.policy).argmax())


def _recompute(engine, ids: list[int]) -> float:
    from spotlight.generate import prefill

    started = time.perf_counter()
    context = engine.new_context(len(ids) + 1)
    prefill(engine.model, context, ids[:-1], engine.policy, chunk=engine.config.prefill_chunk)
    _first_step(engine, context)
    return time.perf_counter() - started


# ----------------------------------------------------------------------------- --long: a real document past the window


def write_long(engine, home: Path, n_tokens: int) -> tuple[str, float]:
    """A conversation whose document holds `n_tokens` essay tokens, read and answered once by a
    ChatService from nothing: (session id, seconds from the attach to the answer's first token)."""
    from bench.decode import essay_ids

    writer = service(engine, home)
    session = writer.create("resume bench, long document")
    text = engine.tokenizer.decode(essay_ids(engine.tokenizer, n_tokens))
    started = time.perf_counter()
    writer.attach_text(session.id, "essays.txt", text)
    attached = time.perf_counter() - started
    seconds, _ = first_turn_seconds(writer.send(session.id, QUESTIONS[0]))
    writer.close()
    return session.id, attached + seconds


def resume_long(home: str, session_id: str, model: str, threads: int | None, decode_tokens: int) -> dict:
    """In a fresh process: one new service per question (the 2nd to the last); TTFT of each. Then,
    with `decode_tokens` > 0, the decode speed of a longer reply through the service (its sources
    tally included), in the long conversation and in a new 8K-token one in the same process."""
    engine = load_engine(True, threads, model)
    warm_up(engine, Path(home))
    times, turn = [], None
    for question in QUESTIONS[1:]:
        reader = service(engine, Path(home))
        seconds, turn = first_turn_seconds(reader.send(session_id, question))
        reader.close()
        log(f"long: resumed in {seconds:.2f} s ({turn.restored_tokens:,} tokens restored, "
            f"{turn.prefill_tokens:,} computed) {turn.notices or ''}")
        assert not turn.notices, f"the cache was not reused: {turn.notices}"
        times.append(seconds)
    resumed = {"times": times, "restored": turn.restored_tokens, "computed": turn.prefill_tokens}
    if decode_tokens:
        resumed["decode_long"] = decode_reply(engine, Path(home), session_id, decode_tokens)
        resumed["decode_8k"] = decode_reply(engine, Path(home), None, decode_tokens)
    return resumed


def decode_reply(engine, home: Path, session_id: str | None, decode_tokens: int) -> dict:
    """Decode tokens/s of DECODE_QUESTION's reply (at most `decode_tokens`) through a new service:
    in the conversation `session_id`, or (None) in a new one holding DOC_TOKENS essay tokens."""
    writer = service(engine, home, max_new_tokens=decode_tokens)
    if session_id is None:
        session_id = essay_conversation(writer, engine, "resume bench, decode at 8K", DOC_TOKENS).id
    turn = None
    for turn in writer.send(session_id, DECODE_QUESTION):
        pass
    writer.close()
    context = turn.restored_tokens + turn.prefill_tokens + turn.decode_tokens
    log(f"long: decode {turn.decode_tps:.2f} tokens/s over {turn.decode_tokens} tokens at {context:,} tokens")
    return {"tps": turn.decode_tps, "tokens": turn.decode_tokens, "context": context}


def long_row(engine, home: Path, n_tokens: int, model: str, threads: int | None, decode_tokens: int) -> dict:
    log(f"long: reading a {n_tokens:,}-token document and answering (many minutes) ...")
    session_id, recompute_s = write_long(engine, home, n_tokens)
    log(f"long: first answer after {recompute_s:.0f} s; resuming in a new process ...")
    resumed = in_subprocess(resume_long, str(home), session_id, model, threads, decode_tokens)
    log(f"long: resume TTFT {resumed['times']} s")
    resume_s = statistics.median(resumed["times"])
    context = resumed["restored"] + resumed["computed"]
    row = {"context": context, "data": "real document (essays), past the window", "resume_ttft_s": resume_s,
           "resume_min_s": min(resumed["times"]), "resume_first_s": resumed["times"][0],
           "resume_runs": len(resumed["times"]), "recompute_ttft_s": recompute_s,
           "recompute": "measured (the first question, from nothing)", "speedup": recompute_s / resume_s,
           "restored_tokens": resumed["restored"], "computed_tokens": resumed["computed"]}
    if decode_tokens:
        long, short = resumed["decode_long"], resumed["decode_8k"]
        row.update({"decode_tps": long["tps"], "decode_tokens": long["tokens"], "decode_tps_8k": short["tps"],
                    "decode_tokens_8k": short["tokens"], "context_8k": short["context"],
                    "decode_ratio": long["tps"] / short["tps"]})
    return row


def main_long(args) -> int:
    engine = load_engine(True, args.threads, args.model)
    with tempfile.TemporaryDirectory(prefix="spotlight-resume-") as tmp:
        row = long_row(engine, Path(tmp), args.long, args.model, args.threads, args.decode_tokens)
    targets = [Target(f"resume TTFT at {row['context']:,} tokens (s)", row["resume_ttft_s"], 2.0,
                      higher_is_better=False)]
    if args.decode_tokens:
        targets.append(Target(f"decode tokens/s through the service at {row['context']:,} tokens / at "
                              f"{row['context_8k']:,}", row["decode_ratio"], 0.7))
    notes = (
        f"{Path(args.model).name} on CPU with Spotlight (its shipped encoders; native window "
        f"{engine.native_window:,} tokens), {args.threads or torch.get_num_threads()} torch thread(s). A ChatService "
        f"attaches {args.long:,} tokens of Paul Graham essays as a document and answers one question from "
        "nothing (recompute_ttft_s: from the attach to the first token of that answer: the whole document read "
        "through the app's staged prefill, past the window through Spotlight); then a fresh process (a "
        "restart: model loaded and warmed up once) asks the next questions, each through a new ChatService and "
        f"Store; resume_ttft_s is the median of {len(QUESTIONS) - 1} (each restores the stored spans, "
        "checksummed and token-checked, prefills the earlier turns and the question, and decodes the first token). "
        "Span files are in the page cache (warm disk)."
    )
    columns = ["context", "data", "resume_ttft_s", "resume_min_s", "resume_first_s", "resume_runs",
               "recompute_ttft_s", "recompute", "speedup", "restored_tokens", "computed_tokens"]
    if args.decode_tokens:
        notes += (f" Decode through the service (issue #21's decode target, on the path a reply takes, its sources "
                  f"tally included): in the same restarted process, after the resumes, a new ChatService asks "
                  f"{DECODE_QUESTION!r} (greedy, at most {args.decode_tokens} new tokens) of the long conversation "
                  f"(decode_tps, Turn.decode_tps over decode_tokens), then of a new conversation holding the "
                  f"first {DOC_TOKENS:,} essay tokens (decode_tps_8k at context_8k tokens, prompt and reply "
                  f"included); decode_ratio = decode_tps / decode_tps_8k, one reply each.")
        columns += ["decode_tps", "decode_tokens", "decode_tps_8k", "decode_tokens_8k", "context_8k", "decode_ratio"]
    finish("resume-long", args, [row], targets, title="Resume of a long document past the window (issue #21)",
           notes=notes, columns=columns, command=f"resume --long {args.long} --model {args.model}")
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = parser("resume", "time to first token: resuming a stored conversation vs recomputing it")
    p.add_argument("--spotlight", action="store_true",
                   help="Spotlight decode with key codes in the spans, as the app decodes by default "
                        "(default here: dense, the reference path)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every measurement (default: torch's). 1 avoids OpenMP stalls "
                        "when other jobs share the cores")
    p.add_argument("--long", type=int, metavar="TOKENS",
                   help="instead: resume a real conversation over a document of this many tokens, read past the "
                        "model's window through Spotlight (its own section, resume-long)")
    p.add_argument("--model", default=SMALL_MODEL, metavar="NAME|PATH", help=f"with --long (default {SMALL_MODEL})")
    p.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, metavar="N",
                   help=f"with --long: also time a reply of at most N tokens through the service in the long "
                        f"conversation and in an 8K one (default {DECODE_TOKENS}; 0: skip)")
    args = p.parse_args(argv)
    if args.decode_tokens < 0:
        p.error(f"--decode-tokens: give a number of reply tokens to time, or 0 to skip; got {args.decode_tokens}")
    if args.long:
        return main_long(args)
    load_before = os.getloadavg()[0]
    engine = load_engine(args.spotlight, args.threads)
    with tempfile.TemporaryDirectory(prefix="spotlight-resume-") as tmp:
        real = real_row(engine, Path(tmp), args.spotlight, args.threads)
        synthetic = synthetic_row(engine, Path(tmp), (real["context"], real["recompute_ttft_s"]),
                                  measure=not args.quick, spotlight=args.spotlight, threads=args.threads)
    rows = [real, synthetic]
    estimated = " (estimated recompute)" if args.quick else ""
    targets = [
        Target(f"resume speedup at {real['context']} tokens (x)", real["speedup"], 100),
        Target(f"resume speedup at 32K tokens{estimated} (x)", synthetic["speedup"], 100),
        Target("resume TTFT at 32K tokens (s)", synthetic["resume_ttft_s"], 1.0, higher_is_better=False),
    ]
    policy = ("Spotlight (the shipped encoders; spans carry key codes)" if args.spotlight
              else "dense (the reference path; the app decodes with Spotlight by default; spans carry no key codes)")
    notes = (
        f"SmolLM2-135M fp32 on CPU, {policy} decode, {args.threads or torch.get_num_threads()} torch "
        "thread(s) for every measurement. TTFT = time to the first streamed token (the "
        "engine yields it as soon as the prompt's logits give it, before running the model on it; both "
        "columns alike). The resumes of "
        f"a row run in one fresh process (a restart: model loaded and warmed up once, as ChatService does "
        f"after loading it), each through a new ChatService and Store; resume_first_s is the first of "
        f"them (it also pays the process's first-use costs); resume_ttft_s is the median of {RUNS} runs "
        f"(restore_s and first_step_s "
        "split the median run) and speedups use it; spans are checksummed and "
        "token-checked before use. 8K row: a real conversation written by one ChatService and resumed "
        "by new ones; recompute = the same prompt prefilled on a fresh context, measured in this run. "
        "32K row: beyond the model's 8K window, so its 16 spans hold random ids/K/V of the real "
        "shapes; resume = restore (same code path as send) + one decode step. "
        + (f"Its recompute is **estimated** from the 8K recompute measured above, scaled quadratically "
           f"(x{(LONG / real['context']) ** 2:.1f}; linear scaling would give x{LONG / real['context']:.1f}, "
           "i.e. a 4x smaller speedup)." if args.quick
           else f"Its recompute was measured (32K random tokens prefilled in {engine.config.prefill_chunk}-token "
                "chunks + one step).")
        + f" Load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
        f"{os.cpu_count()} cores: other jobs share this machine, and short timings (resume) suffer "
        "more from that than long ones (recompute)."
        + " Span files are in the page cache (warm disk). restore_s is mostly copying the mapped spans "
        "into the cache: at 8K into the engine's prefaulted K/V buffers (BufferPool, filled by the warm-up), "
        "at 32K into a fresh 1.5 GiB allocation (beyond the pool's 8K window), paying a page fault per 4 KiB."
    )
    columns = ["context", "data", "resume_ttft_s", "resume_min_s", "resume_first_s", "restore_s", "first_step_s",
               "resume_runs",
               "recompute_ttft_s", "recompute", "speedup", "restored_tokens", "computed_tokens"]
    finish("resume", args, rows, targets, title="Resume vs recompute (persistent KV memory)", notes=notes,
           columns=columns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
