"""Needles far beyond the model's window, ingest and decode speed past it (issue #21).

Through the engine's front door (`Engine.load`, `new_context`, `prefill`, `stream`) on
SmolLM2-135M (`--model`; its 8K window is what the lengths reach past). At each length ONE chat prompt holds a haystack of
Paul Graham essays (held out from the encoders' training) with NEEDLES planted at their depths,
two formats (a number, a short phrase). It is prefilled once; then each needle's question is
appended in turn, answered greedily (`stream`, a few tokens) and the context truncated back;
the teacher-forced log-probability of the answer tokens (a phrase's opening quote included)
after the question and the needle sentence's start is scored the same way (higher is better,
0 = certain). Side by side, in one run:

* `spotlight`: the app's path past the window (SpotlightConfig far_window / far_retrieved);
* `sinks+window`: the same budget without retrieval (SinkWindowSelector, StreamingLLM);
* `truncated`: dense attention over the template and the document's last tokens that fit the
  window with the question (what other local apps do);
* `dense in window`: the reference, dense attention over the same needles and questions in a
  haystack that fits the window (the model's own ability).

Speed: while the Spotlight context of the longest length is prefilled, the tokens/s of its first
8,128 tokens (an 8K ingest, its decode still inside the window) beside that of the whole length,
and decode tokens/s (greedy, the essay's continuation) at 8K (a copy of the context's first 8,128
tokens) and at the full length, measured in turn, each side's best of SPEED_REPEATS. Where
`make bench-deps` built llama.cpp, its own llama-bench then measures prompt processing on the same
GGUF at its maximum, the model's window (every core, flash attention), beside the Spotlight
context's ingest of the longest length: the issue's 1.5x.
"""
from __future__ import annotations

import dataclasses
import itertools
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from bench.common import SMALL_MODEL, Target, finish, log, parser, peak_rss_mb

QUICK = {"lengths": [16_384, 32_768]}
DEFAULT = {"lengths": [16_384, 32_768, 65_536, 131_072]}
FULL = {"lengths": DEFAULT["lengths"] + [262_144, 524_288]}
LONGEST_DEFAULT = max(DEFAULT["lengths"])  # a run past it writes a section of its own (`section`)
NEW_TOKENS = 20  # greedy reply tokens per question: the model restates the question's frame first (~12 tokens)
# The short ingest / decode the longest length is compared with: 8K less the decoded tokens, so
# that reference decode stays inside the model's window (at 8,192 + 1 it already runs past it).
SPEED_AT = 8192 - 64
SPEED_TOKENS = 32  # decode tokens per speed measurement
# NOTE: decodes at 8K and at the whole length in turn, each side's best, as bench.decode counts them:
# one 16-token decode at 8K read 27.1 tokens/s where the runs before read 34.7-41.1 (12-06 11:31), and
# at 12:14 the 128K decode read 16.1 tokens/s (a 62 ms step; 24-25 from a probe minutes later), each a
# slow spell of the shared VM that swung the 128K / 8K ratio
SPEED_REPEATS = 5  # rounds; at 12:44 the 128K side rose round by round (18.1, 19.2, 21.6) while 8K did not
QUESTION_ROOM = 512  # tokens kept free for a question and its reply in the truncated and reference prompts
SLICE = 8192  # the longest length's prefill is logged and tabulated per this many tokens
LLAMA_TIMEOUT_S = 3600  # llama-bench's 32K prompt ran past 30 minutes on a 2-core AMD EPYC (session 14)


@dataclass(frozen=True)
class Needle:
    kind: str  # "number" | "phrase"
    sentence: str  # planted in the haystack
    question: str
    answer: str
    depth: float  # share of the haystack before it

    @property
    def frame(self) -> str:
        """The sentence up to its answer, less the answer's opening quote: the reply's natural
        start, teacher-forced before the answer.

        NOTE: the quote is scored with the answer, not forced before it: after "is" the model
        chooses between a quoted phrase and a number, and past the window it wrote another
        needle's number there where the phrase, once its quote was forced, had a log-prob of
        -0.04 (docs/DECISIONS.md, "The teacher-forced answer scores its opening quote")."""
        return self.sentence[: self.sentence.index(self.answer)].rstrip(" '")

    @property
    def forced_answer(self) -> str:
        """The answer as it follows `frame` in the sentence (its leading space and quote included)."""
        return self.sentence[len(self.frame) : self.sentence.index(self.answer) + len(self.answer)]


def _needle(kind: str, subject: str, answer: str, depth: float) -> Needle:
    said = answer if kind == "number" else f"'{answer}'"
    return Needle(kind, f"The {subject} is {said}.", f"What is the {subject}?", answer, depth)


# Each needle has its own frame: with one frame for all ten ("... for the city of X is NNNN."), the
# 135M model answered with another needle's value (measured in the smoke run, dense at 7.6K: 0 of 3).
# Twenty per length (the issue asks for 20 or more per cell): the first ten at depths 0.05-0.95 (the
# runs before session 17 had only these), ten more between them at 0.10-0.90 and 0.98.
NEEDLES = (
    _needle("number", "special magic number for the city of Lisbon", "7481", 0.05),
    _needle("phrase", "secret word for the old harbor", "blue lantern", 0.15),
    _needle("number", "locker code at the Nairobi train station", "6137", 0.25),
    _needle("phrase", "password of the north garden gate", "silver kettle", 0.35),
    _needle("number", "room number of the Hanoi office", "3719", 0.45),
    _needle("phrase", "motto of the chess club", "velvet anchor", 0.55),
    _needle("number", "ticket number for the Oslo ferry", "2953", 0.65),
    _needle("phrase", "nickname of the bakery's cat", "copper violin", 0.75),
    _needle("number", "PIN of the Lima bank account", "8426", 0.85),
    _needle("phrase", "title of Maria's first painting", "amber compass", 0.95),
    _needle("phrase", "name of the lighthouse keeper's boat", "quiet heron", 0.10),
    _needle("number", "gate code of the Quito warehouse", "5092", 0.20),
    _needle("phrase", "codeword of the Tuesday reading group", "marble orchard", 0.30),
    _needle("number", "seat number on the Cairo night train", "4268", 0.40),
    _needle("phrase", "name of the garden's oldest rose", "winter ember", 0.50),
    _needle("number", "safe combination in the Dublin hotel", "3586", 0.60),
    _needle("phrase", "label on the museum's hidden drawer", "golden thimble", 0.70),
    _needle("number", "badge number of the Lagos inspector", "6841", 0.80),
    _needle("phrase", "password of the river boat club", "hollow maple", 0.90),
    _needle("number", "parcel number at the Manila post office", "2397", 0.98),
)
N_NUMBERS = sum(n.kind == "number" for n in NEEDLES)
N_PHRASES = len(NEEDLES) - N_NUMBERS


def plant(body: Sequence, needles: Sequence[tuple[float, Sequence]], snap: Callable[[Sequence, int], int]) -> list:
    """`body` with each (depth, items) inserted at snap(body, int(depth * len(body))): a position
    of the unplanted body (e.g. the sentence start at or before it), in depth order."""
    cuts = sorted((snap(body, int(depth * len(body))), i) for i, (depth, _) in enumerate(needles))
    out, last = [], 0
    for at, i in cuts:
        out += list(body[last:at]) + list(needles[i][1])
        last = at
    return out + list(body[last:])


def found(reply: str, answer: str) -> bool:
    """Whether the answer is in the reply (case and quotes ignored)."""
    clean = reply.lower().replace("'", "").replace('"', "")
    return answer.lower() in clean


# ----------------------------------------------------------------------------- prompts


def haystack(engine, hay: list[int], length: int) -> list[int]:
    """Template head + essays with every needle planted, leaving room for the longest question
    and its reply within `length` tokens. Past the essays' ~150K tokens they start again from the
    first (`repeated`), as the standard needle-in-a-haystack test repeats them."""
    from bench.quality_tasks import chat_frame, sentence_start

    head, _ = chat_frame(engine, NEEDLES[0].question)
    planted = [(n.depth, engine.encode(" " + n.sentence + " ")) for n in NEEDLES]
    tail = max(len(chat_frame(engine, n.question)[1]) for n in NEEDLES)
    room = length - len(head) - tail - NEW_TOKENS - sum(len(ids) for _, ids in planted)
    return head + plant(repeated(hay, room), planted, lambda ids, at: sentence_start(engine, ids, at))


def repeated(hay: Sequence, n: int) -> list:
    """The first `n` items of `hay` read again and again from its start."""
    return list(itertools.islice(itertools.cycle(hay), n))


def truncated(engine, prompt: list[int], keep: int) -> list[int]:
    """The template head + the last tokens of the document, `keep` tokens in all."""
    from bench.quality_tasks import chat_frame

    head, _ = chat_frame(engine, NEEDLES[0].question)
    return head + prompt[len(prompt) - (keep - len(head)) :]


# ----------------------------------------------------------------------------- asking


def ingest(engine, ids: list[int], speed_at: int | None = None) -> tuple[object, dict]:
    """A context holding `ids`, prefilled through the engine; with `speed_at`, the prefill and
    decode tokens/s at `speed_at` tokens and at len(ids). Decode: the text's greedy continuation
    (truncated back), on a copy of the context's first `speed_at` tokens and on the whole context
    in turn, SPEED_REPEATS rounds, each side's best; the copy holds ~12 KB a token of the run's
    peak memory (100 MB at 8K for Qwen2.5)."""
    context = engine.new_context(capacity=len(ids) + 256)
    speed = {}
    started = time.perf_counter()
    if speed_at is not None and len(ids) > speed_at:
        speed["slices"] = slices = []
        engine.prefill(context, ids[:speed_at], progress=slice_meter(0, slices))
        short = time.perf_counter() - started
        speed["prefill_short"] = speed_at / short
        inside = engine.new_context(capacity=speed_at + 256)  # the 8K context, kept for the decodes below
        inside.append_rows(context.rows(0, speed_at))
        resumed = time.perf_counter()
        engine.prefill(context, ids[speed_at:], progress=slice_meter(speed_at, slices))
        seconds = short + (time.perf_counter() - resumed)  # the copy left out
        speed["prefill_long"] = len(ids) / seconds
        speed["decode_short"] = speed["decode_long"] = 0.0
        for round_ in range(SPEED_REPEATS):  # in turn: a slow spell of the shared VM lands on both sides
            at_short, at_long = _decode_speed(engine, inside, ids[:speed_at]), _decode_speed(engine, context, ids)
            log(f"  decode round {round_ + 1}: {at_short:.2f} tokens/s at {speed_at:,} tokens, "
                f"{at_long:.2f} at {len(ids):,}")
            speed["decode_short"] = max(speed["decode_short"], at_short)
            speed["decode_long"] = max(speed["decode_long"], at_long)
        del inside
    else:
        engine.prefill(context, ids)
    speed["prefill_seconds"] = time.perf_counter() - started
    return context, speed


def slice_meter(offset: int, slices: list, clock: Callable[[], float] = time.perf_counter):
    """A prefill progress callback (engine.prefill's `progress`) that appends (from, to, tokens/s)
    to `slices` for every SLICE tokens read, and at the end, and logs each; `offset` tokens were
    in the context before this prefill."""
    mark = {"at": offset, "time": clock()}

    def progress(done: int, total: int) -> None:
        at = offset + done
        if at - mark["at"] >= SLICE or (done == total and at > mark["at"]):
            now = clock()
            slices.append((mark["at"], at, (at - mark["at"]) / max(now - mark["time"], 1e-9)))
            log(f"  prefilled {at:,} tokens: {slices[-1][2]:.1f} tokens/s since {mark['at']:,}")
            mark.update(at=at, time=now)

    return progress


def _decode_speed(engine, context, ids: list[int]) -> float:
    from spotlight.config import SamplingConfig

    steps = list(engine.stream(context, ids, SamplingConfig(max_new_tokens=SPEED_TOKENS)))
    context.truncate(len(ids))
    return steps[-1].stats.decode_tps


def ask(engine, context, base: list[int], needle: Needle) -> dict:
    """Ask one needle's question after `base` (the context's tokens), then truncate back: the
    greedy reply, whether it holds the answer, and the log-probability of the answer's tokens
    teacher-forced after the question and the needle's frame (the reply's natural start)."""
    import torch

    from bench.quality_tasks import chat_frame
    from spotlight.config import SamplingConfig
    from spotlight.generate import prefill, reply_alone

    _, tail = chat_frame(engine, needle.question)
    steps = list(engine.stream(context, base + tail, SamplingConfig(max_new_tokens=NEW_TOKENS)))
    reply = "".join(s.text for s in steps)
    context.truncate(len(base))
    logprob = 0.0
    with torch.inference_mode():
        frame = tail + engine.encode(needle.frame)
        logits = prefill(engine.model, context, frame, engine.policy, chunk=engine.config.prefill_chunk,
                         alone=reply_alone(engine.policy))  # (V,): the question's tokens as a reply's prompt runs them
        answer = engine.encode(needle.forced_answer)
        for i, token in enumerate(answer):
            logprob += float(torch.log_softmax(logits.float(), -1)[token])
            if i + 1 < len(answer):
                logits = prefill(engine.model, context, [token], engine.policy, chunk=1)
    context.truncate(len(base))
    return {"found": found(reply, needle.answer), "logprob": logprob, "reply": reply.strip().replace("\n", " ")}


def ask_all(engine, ids: list[int], name: str, label: str, speed_at: int | None = None) -> tuple[list[dict], dict]:
    context, speed = ingest(engine, ids, speed_at)
    log(f"{label} {name}: {len(ids):,} tokens prefilled in {speed['prefill_seconds']:.0f} s")
    results = []
    for needle in NEEDLES:
        result = ask(engine, context, ids, needle)
        log(f"  {needle.kind} @{needle.depth:.2f} found={result['found']} logprob={result['logprob']:.2f} "
            f"{result['reply'][:60]!r}")
        results.append(result)
    del context
    return results, speed


# ----------------------------------------------------------------------------- run


def engines(model: str):
    """(spotlight, sinks+window, dense) engines sharing one model."""
    from spotlight import Engine
    from spotlight.attention import SinkWindowSelector, SpotlightDecode
    from spotlight.config import EngineConfig, SpotlightConfig, default_home

    spot = Engine.load(EngineConfig(model_path=model), default_home(), SpotlightConfig())
    sink = dataclasses.replace(spot, policy=SpotlightDecode(spot.spotlight, SinkWindowSelector()))
    return spot, sink, spot.with_spotlight(SpotlightConfig(enabled=False))


METHODS = ("spotlight", "sinks+window", "truncated", "dense in window")


def main(argv=None) -> dict:
    from bench.quality_tasks import essay_ids

    p = parser("longctx", __doc__.splitlines()[0], quick="16K and 32K only; about 20 minutes on 2 cores")
    p.add_argument("--full", action="store_true",
                   help="also 256K and 512K tokens (the default: 16K, 32K, 64K and 128K; --quick: 16K and 32K)")
    p.add_argument("--lengths", help="comma-separated prompt lengths in tokens (overrides --quick/--full)")
    p.add_argument("--model", default=SMALL_MODEL, metavar="NAME|PATH",
                   help=f"the model (default: {SMALL_MODEL}, whose 8K window the lengths reach past; a model with "
                        "a 32K window, like the app's default, needs --lengths of 65536 and more)")
    p.add_argument("--methods", default=",".join(METHODS[:3]), metavar="LIST",
                   help="comma-separated methods past the window, of " + ", ".join(METHODS[:3])
                        + " (default: all; dense in window always runs, the reference)")
    args = p.parse_args(argv)
    methods = tuple(m for m in METHODS if m in args.methods.split(",") or m == "dense in window")
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown or "spotlight" not in methods:
        p.error(f"--methods takes spotlight (always) and any of {', '.join(METHODS[1:3])}; got {args.methods!r}")
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
               else (FULL if args.full else QUICK if args.quick else DEFAULT)["lengths"])
    started = time.perf_counter()
    spot, sink, dense = engines(args.model)
    window = spot.native_window
    hay = essay_ids(spot)
    reference = haystack(spot, hay, window - QUESTION_ROOM)
    log(f"window {window:,}; essays {len(hay):,} tokens; lengths {lengths}")
    answers = {"dense in window": ask_all(dense, reference, "dense in window", "reference")[0]}
    cells, speed, n_tokens = {}, {}, {}
    for length in lengths:
        prompt = haystack(spot, hay, length)
        n_tokens[length] = len(prompt)
        cells[(length, "spotlight")], speed[length] = ask_all(
            spot, prompt, "spotlight", f"{length:,}", SPEED_AT if length == max(lengths) else None)
        if "sinks+window" in methods:
            cells[(length, "sinks+window")], _ = ask_all(sink, prompt, "sinks+window", f"{length:,}")
        if "truncated" in methods:
            cells[(length, "truncated")], _ = ask_all(dense, truncated(spot, prompt, window - QUESTION_ROOM),
                                                      "truncated", f"{length:,}")
        cells[(length, "dense in window")] = answers["dense in window"]
    llama = llama_prompt_speed(args.model, window)
    longest = max(lengths)
    rows = needle_rows(lengths, n_tokens, cells, methods) + speed_rows(lengths, speed, window) + \
        llama_rows(n_tokens[longest], speed[longest], llama)
    targets = needle_targets(lengths, cells) + speed_targets(longest, speed[longest]) + \
        llama_targets(longest, speed[longest], llama)
    notes = notes_for(spot, lengths, len(reference), time.perf_counter() - started, len(hay))
    if llama is None:
        notes += (" llama.cpp was not measured (the log says why: not built by `make bench-deps`, a model without a "
                  "GGUF, or llama-bench failed or ran past its time).")
    if methods != METHODS:
        notes += f" This run measured only: {', '.join(methods)}."
    other = args.model != SMALL_MODEL  # another model's run: a section of its own
    given = (f" --model {args.model}" if other else "") + (f" --lengths {args.lengths}" if args.lengths else "") \
        + (" --full" if args.full and not args.lengths else "") \
        + (f" --methods {args.methods}" if methods != METHODS else "")
    name, title = section(args.model if other else None, lengths, methods)
    return finish(name, args, rows, targets, title=title, notes=notes, command="longctx" + given)


def section(model: str | None, lengths: list[int], methods: tuple[str, ...] = METHODS) -> tuple[str, str]:
    """(RESULTS.md section key, title) of a run: another model's run, a run past 128K (--full) and a
    run of fewer methods each write a section of their own, a run past 128K one per longest length
    (a 256K run does not replace a 512K one, nor either the 16K-128K one), and a Spotlight-only run
    does not replace the side-by-side one."""
    name, title = "longctx", "Long context: needles and speed past the window (issue #21)"
    if model is not None:
        name, title = f"{name}-{Path(model).name}", f"{title}: {Path(model).name}"
    if max(lengths) > LONGEST_DEFAULT:
        name, title = f"{name}-{max(lengths) // 1024}k", f"{title}, up to {max(lengths):,} tokens"
    if set(methods) != set(METHODS):
        measured = [m for m in METHODS if m in methods and m != "dense in window"]
        name, title = f"{name}-{'-'.join(m.replace('+', '-') for m in measured)}", f"{title}, {', '.join(measured)} only"
    return name, title


def found_of_dense(mine: list[dict], dense: list[dict]) -> int:
    """How many of the needles dense attention found within the window `mine` found too."""
    return sum(r["found"] and d["found"] for r, d in zip(mine, dense))


def needle_rows(lengths, n_tokens, cells, methods=METHODS) -> list[dict]:
    summary = []
    for length in lengths:
        for method in methods:
            mine = cells[(length, method)]
            summary.append({"part": f"needles found (of {len(NEEDLES)}: {N_NUMBERS} numbers + {N_PHRASES} phrases)",
                            "length": f"{length:,}",
                            "prompt tokens": n_tokens[length], "method": method,
                            "found": sum(r["found"] for r in mine),
                            "numbers": sum(r["found"] for r, n in zip(mine, NEEDLES) if n.kind == "number"),
                            "phrases": sum(r["found"] for r, n in zip(mine, NEEDLES) if n.kind == "phrase"),
                            "of dense in window's": found_of_dense(mine, cells[(length, "dense in window")]),
                            "mean answer log-prob": sum(r["logprob"] for r in mine) / len(mine)})
    detail = []
    for length in lengths:
        for i, needle in sorted(enumerate(NEEDLES), key=lambda item: item[1].depth):  # by depth
            row = {"part": "each needle: found, answer log-prob", "length": f"{length:,}", "depth": needle.depth,
                   "answer": needle.answer}
            for method in methods:
                r = cells[(length, method)][i]
                row[method] = f"{'yes' if r['found'] else 'no'} {r['logprob']:.2f}"
            row["spotlight's reply"] = cells[(length, "spotlight")][i]["reply"][:40]
            detail.append(row)
    return summary + detail


def speed_rows(lengths, speed, window: int) -> list[dict]:
    longest = max(lengths)
    s = speed[longest]
    rss = peak_rss_mb()
    return [
        {"part": "speed (Spotlight, one context)", "measure": "prefill tokens/s", "at 8K": s.get("prefill_short"),
         f"at {longest:,}": s.get("prefill_long"), "ratio": _ratio(s, "prefill")},
        {"part": "speed (Spotlight, one context)", "measure": "decode tokens/s", "at 8K": s.get("decode_short"),
         f"at {longest:,}": s.get("decode_long"), "ratio": _ratio(s, "decode")},
        {"part": "speed (Spotlight, one context)", "measure": "peak RSS MB (whole run)", "at 8K": None,
         f"at {longest:,}": rss, "ratio": None},
    ] + [{"part": f"prefill tokens/s by position (the same context; past {window:,} tokens: past the window)",
          "tokens": f"{a:,}-{b:,}", "tokens/s": tps} for a, b, tps in s.get("slices", [])]


def llama_prompt_speed(model: str, window: int) -> dict | None:
    """llama.cpp's prompt processing of `window` tokens (the most its context holds: the model's
    window) on the same GGUF, through bench.decode's llama-bench runner: {"tokens", "tps"}; None
    where `make bench-deps` has not built it or the model is not a GGUF."""
    from bench.decode import LlamaCppRunner, llama_bench_available

    if not llama_bench_available():
        log("llama.cpp's llama-bench is not built (make bench-deps): its prompt processing is not measured")
        return None
    try:  # a model without a GGUF, a failing or a too slow llama-bench must not cost the run its rows
        runner = LlamaCppRunner(window, model)
        log(f"llama.cpp: prompt processing of {window:,} tokens (llama-bench) ...")
        return {"tokens": window, "tps": runner.prefill_tps(window, timeout=LLAMA_TIMEOUT_S)}
    except (subprocess.SubprocessError, ValueError) as e:
        log(f"llama.cpp's prompt processing was not measured: {e}")
        return None


LLAMA_PART = "ingest beside llama.cpp (same GGUF, prompt processing from an empty cache)"


def llama_rows(prompt_tokens: int, s: dict, llama: dict | None) -> list[dict]:
    """Our ingest of the longest prompt (`prompt_tokens`) beside llama.cpp's at its window (none without llama)."""
    if llama is None:
        return []
    return [
        {"part": LLAMA_PART, "engine": "ours: Spotlight past the window", "prompt tokens": prompt_tokens,
         "prefill tokens/s": s.get("prefill_long")},
        {"part": LLAMA_PART, "engine": "llama.cpp (llama-bench pp): its window, dense", "prompt tokens": llama["tokens"],
         "prefill tokens/s": llama["tps"]},
    ]


def llama_targets(longest: int, s: dict, llama: dict | None) -> list[Target]:
    if llama is None:
        return []
    ours = s.get("prefill_long")
    ratio = ours / llama["tps"] if ours and llama["tps"] else float("nan")
    return [Target(f"prefill tokens/s at {longest:,} / llama.cpp's at its window ({llama['tokens']:,})", ratio, 1.5)]


def _ratio(s: dict, what: str) -> float:
    short, long = s.get(f"{what}_short"), s.get(f"{what}_long")
    return long / short if short and long else float("nan")


def needle_targets(lengths, cells) -> list[Target]:
    """Per length: of the needles dense attention finds within the window, the share Spotlight finds
    (issue #21: "at least 95 % of the needles that the same model finds with dense attention"; a
    needle only Spotlight finds does not make up for one it misses)."""
    out = []
    for length in lengths:
        dense = cells[(length, "dense in window")]
        reference = sum(d["found"] for d in dense)
        mine = found_of_dense(cells[(length, "spotlight")], dense)
        share = mine / reference if reference else float("nan")
        out.append(Target(f"needles dense finds within the window, found at {length:,} ({mine} of {reference})",
                          share, 0.95))
    return out


def speed_targets(longest: int, s: dict) -> list[Target]:
    out = [Target(f"prefill tokens/s at {longest:,} / at 8K", _ratio(s, "prefill"), 0.8),
           Target(f"decode tokens/s at {longest:,} / at 8K", _ratio(s, "decode"), 0.7)]
    if longest >= 131_072:
        out.append(Target(f"peak RSS MB at {longest:,}", peak_rss_mb(), 4096, higher_is_better=False))
    return out


def notes_for(engine, lengths, reference_tokens, seconds, essay_tokens: int) -> str:
    cfg = engine.spotlight
    again = [n for n in lengths if n > essay_tokens]
    return (
        f"The model {Path(engine.source.origin).name} ({engine.config.weights} "
        f"weights, native window {engine.native_window:,} tokens), through the engine's front door. At each length "
        f"({', '.join(f'{n:,}' for n in lengths)} tokens) one chat prompt of Paul Graham essays (held out from the "
        f"encoders' training"
        + (f"; {essay_tokens:,} tokens in all, so at {', '.join(f'{n:,}' for n in again)} they are read again from "
           f"the first, as the standard needle-in-a-haystack test repeats them" if again else "")
        + f") holds {len(NEEDLES)} needles at depths {min(n.depth for n in NEEDLES)}-"
        f"{max(n.depth for n in NEEDLES)}, {N_NUMBERS} numbers (\"The special magic number for the "
        f"city of Lisbon is 7481.\", \"The locker code at the Nairobi train station is 6137.\", ...) and {N_PHRASES} "
        f"phrases (\"The secret word for the old harbor is 'blue lantern'.\", ...), each with its own frame; it is prefilled once, "
        f"then each question is appended in turn, answered greedily ({NEW_TOKENS} tokens; found = the answer is in "
        f"the reply) and truncated back; beside it the log-probability of the answer tokens (a phrase's opening quote included) "
        f"teacher-forced after the question and the needle's own frame (e.g. \"The special magic number for the city of Lisbon is\", the replies' "
        f"natural start; 0 = certain). spotlight = the app's path past the window (sinks {cfg.sinks} + "
        f"retrieved {cfg.far_retrieved:,} re-positioned + last {cfg.far_window:,} tokens; far candidates scored "
        f"in blocks of {cfg.far_fold:,} by the query turned back to them (far_fold; 0 = at true distances); the question's last "
        f"{cfg.far_alone} tokens each a decode step with its own selection (far_alone); a prefill chunk past the window "
        f"retrieves {cfg.far_prefill_retrieved:,} (far_prefill_retrieved) and multiplies its weights in "
        f"{engine.far_products} (EngineConfig.far_products)); sinks+window = the same "
        f"budget without retrieval; truncated = dense over the template and the document's last tokens "
        f"({engine.native_window - QUESTION_ROOM:,} in all); dense in window = the same needles and questions in a "
        f"{reference_tokens:,}-token haystack, dense (the model's own ability, the reference). Speed: in the "
        f"Spotlight context of the longest length, prefill tokens/s of its first {SPEED_AT:,} tokens and of the whole, "
        f"decode tokens/s ({SPEED_TOKENS} greedy tokens; the best of {SPEED_REPEATS} rounds, the two lengths in turn) "
        f"at {SPEED_AT:,} (inside the window: a copy of the context's first tokens, ~100 MB of the peak memory) "
        f"and at the whole "
        f"length, past it; the 2-core machine may be shared with other jobs, so absolute rates are noisy and the "
        f"ratios compare. Run took {seconds / 60:.0f} "
        f"minutes."
    )


if __name__ == "__main__":
    main()
