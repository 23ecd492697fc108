"""Long conversations: facts told early, asked again 40 turns later (issue #21).

    python -m bench.longconv [--quick] [--json PATH] [--model NAME|PATH] [--attention spotlight|dense]

One scripted conversation of 60 turns through `ChatService` (the app's path: `create`,
`attach_text`, `resume`, then `send` for every turn, each reply stored, settled and its span
written), over a 6K-token document (Paul Graham essays, held out from the encoders' training):
  turns 1-20   ten facts, each told ("Please remember this for later: my locker code is 4721.")
               and asked right after it was told ("What is my locker code?"): the reference;
  turns 21-50  thirty questions about the document (filler, as a reader would ask);
  turns 51-60  the ten facts asked again, in another order.
A fact is answered when the reply contains its value (case-insensitive). Target: of the facts
answered right after they were told, at least 90 % are answered again in the last ten turns.
Greedy replies of at most 48 tokens (`--max-new-tokens`). The conversation's length at the end
and how much of it lies beyond the model's window are reported with the decode speed per turn.
`--quick`: 4 facts and 6 filler turns (18 turns).
"""
from __future__ import annotations

import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Target, finish, log, parser

DOCUMENT_TOKENS = 6000
MAX_NEW_TOKENS = 48
FILLER_TURNS = 30
QUICK = {"facts": 4, "filler": 6}
TARGET = 0.9  # share of the early-answered facts answered again at the end


@dataclass(frozen=True)
class Fact:
    statement: str  # what the user tells, after "Please remember this for later: "
    question: str
    answer: str  # the value a right reply contains


FACTS = (
    Fact("my locker code is 4721.", "What is my locker code?", "4721"),
    Fact("my sister's name is Orla.", "What is my sister's name?", "Orla"),
    Fact("I parked the car in the Magnolia garage.", "Where did I park the car?", "Magnolia"),
    Fact("my flight to Oslo leaves at 7:45.", "When does my flight to Oslo leave?", "7:45"),
    Fact("the wifi password at the cabin is bluefinch.", "What is the wifi password at the cabin?", "bluefinch"),
    Fact("my dentist is Dr. Halvorsen.", "Who is my dentist?", "Halvorsen"),
    Fact("I owe Marek 38 euros.", "How much money do I owe Marek?", "38"),
    Fact("our project is code-named Kestrel.", "What is our project's code name?", "Kestrel"),
    Fact("my favourite tea is lapsang souchong.", "What is my favourite tea?", "lapsang"),
    Fact("the Friday meeting is in room 512.", "Which room is the Friday meeting in?", "512"),
)


@dataclass(frozen=True)
class Turn:
    kind: str  # "tell" | "ask early" | "filler" | "ask late"
    text: str
    fact: int | None = None  # index into the facts


def script(n_facts: int, n_filler: int, document: str, seed: int = 0) -> list[Turn]:
    """The conversation's user turns, in order (see the module docstring)."""
    facts = FACTS[:n_facts]
    turns: list[Turn] = []
    for index, fact in enumerate(facts):
        turns.append(Turn("tell", f"Please remember this for later: {fact.statement}", index))
        turns.append(Turn("ask early", fact.question, index))
    turns += [Turn("filler", text) for text in filler_questions(document, n_filler, seed)]
    order = list(range(len(facts)))
    random.Random(seed).shuffle(order)
    turns += [Turn("ask late", facts[index].question, index) for index in order]
    return turns


def filler_questions(document: str, n: int, seed: int = 0) -> list[str]:
    """Questions a reader might ask about the document: its long, repeated words in turn."""
    words = re.findall(r"[A-Za-z]{7,}", document)
    counts: dict[str, int] = {}
    for word in words:
        counts[word.lower()] = counts.get(word.lower(), 0) + 1
    common = sorted(counts, key=lambda w: (-counts[w], w))[: max(n, 1)]
    forms = ("What does the document say about {}?", "Quote a sentence from the document that mentions {}.",
             "Why does the author bring up {}?")
    rng = random.Random(seed)
    return [rng.choice(forms).format(common[i % len(common)]) for i in range(n)]


def answered(fact: Fact, reply: str) -> bool:
    return fact.answer.lower() in reply.lower()


def document_text(encode, decode, n_tokens: int = DOCUMENT_TOKENS) -> str:
    """About `n_tokens` tokens of the held-out essays, cut at a paragraph."""
    from spotlight.corpus import essays

    text = "\n\n".join(doc.text for doc in essays())
    ids = encode(text)[:n_tokens]
    cut = decode(ids)
    return cut[: cut.rfind("\n\n")] if "\n\n" in cut else cut


def run(service, turns: list[Turn], document: str, progress=log) -> list[dict]:
    """Play the script in one conversation; one row per turn."""
    session = service.create()
    service.attach_text(session.id, "essays.txt", document)
    service.resume(session.id)
    rows = []
    for number, turn in enumerate(turns, 1):
        final = None
        for final in service.send(session.id, turn.text):
            pass
        fact = FACTS[turn.fact] if turn.fact is not None else None
        asked = fact is not None and turn.kind != "tell"
        rows.append({"turn": number, "kind": turn.kind, "question": turn.text,
                     "answer": fact.answer if fact else "", "right": answered(fact, final.text) if asked else None,
                     "reply": final.text.strip().replace("\n", " "),
                     "tokens": final.cached_tokens + final.prefill_tokens + final.decode_tokens,
                     "decode tok/s": round(final.decode_tps, 1) if final.decode_tokens >= 8 else None})
        progress(f"turn {number}/{len(turns)} {turn.kind}: {rows[-1]['reply'][:60]!r}")
    return rows


def fact_rows(rows: list[dict], n_facts: int) -> list[dict]:
    """Per fact: answered right after it was told, and again at the end."""
    out = []
    for index, fact in enumerate(FACTS[:n_facts]):
        early = next(r for r in rows if r["kind"] == "ask early" and r["question"] == fact.question)
        late = next(r for r in rows if r["kind"] == "ask late" and r["question"] == fact.question)
        out.append({"part": "facts: asked right after, and 40 turns later", "fact": fact.answer,
                    "early": early["right"], "late": late["right"], "turn told": early["turn"] - 1,
                    "turn asked again": late["turn"], "late reply": late["reply"][:70]})
    return out


def kept_share(facts: list[dict]) -> float | None:
    """Of the facts answered early, the share answered late too (None when none was answered early)."""
    early = [f for f in facts if f["early"]]
    return sum(f["late"] for f in early) / len(early) if early else None


def service_for(model: str, store_root: Path, spotlight: bool, max_new_tokens: int):
    """The app's service on `model`, its conversations in `store_root` (the models, converted once,
    stay in the data directory)."""
    from chat.config import AppConfig
    from chat.service import ChatService
    from memory.config import StoreConfig
    from spotlight.config import EngineConfig, SamplingConfig, SpotlightConfig

    config = AppConfig(engine=EngineConfig(model_path=model),
                       sampling=SamplingConfig(max_new_tokens=max_new_tokens, repetition_penalty=1.1),
                       spotlight=SpotlightConfig(enabled=spotlight))
    return ChatService(config, store_config=StoreConfig(store_root))


def main(argv=None) -> dict:
    from spotlight.loading import DEFAULT_MODEL

    p = parser("longconv", __doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|PATH",
                   help=f"the model (default: the app's, {DEFAULT_MODEL})")
    p.add_argument("--attention", choices=("spotlight", "dense"), default="spotlight",
                   help="decode attention (default: spotlight, as the app)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="longest reply (default: 48)")
    args = p.parse_args(argv)
    n_facts, n_filler = (QUICK["facts"], QUICK["filler"]) if args.quick else (len(FACTS), FILLER_TURNS)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spotlight-longconv-") as tmp:
        service = service_for(args.model, Path(tmp), args.attention == "spotlight", args.max_new_tokens)
        engine = service.engine
        document = document_text(engine.encode, engine.decode)
        turns = script(n_facts, n_filler, document)
        rows = run(service, turns, document)
        window = service.context_window(), engine.native_window
        service.close()
    facts = fact_rows(rows, n_facts)
    share = kept_share(facts)
    speeds = [r["decode tok/s"] for r in rows if r["decode tok/s"] is not None]
    end_tokens = rows[-1]["tokens"]
    summary = [{"part": "the conversation", "turns": len(rows), "document tokens": engine.count_tokens(document),
                "tokens at the end": end_tokens, "model window": window[1],
                "beyond the window": max(0, end_tokens - window[1]),
                "facts answered early": sum(bool(f["early"]) for f in facts),
                "and again late": sum(bool(f["early"] and f["late"]) for f in facts),
                "median decode tok/s": round(statistics.median(speeds), 1) if speeds else None,
                "minutes": round((time.perf_counter() - started) / 60, 1)}]
    turn_rows = [{"part": "every turn", **{k: v for k, v in r.items() if k != "question"},
                  "question": r["question"][:50]} for r in rows]
    targets = [Target("facts answered again in the last turns / answered right after they were told",
                      share if share is not None else 0.0, TARGET, ">=")]
    notes = (f"{args.model} through `ChatService` with {args.attention} attention, greedy, replies of at most "
             f"{args.max_new_tokens} tokens, in a fresh data directory. {len(rows)} turns: {n_facts} facts told and "
             f"asked at once, {n_filler} questions about the document, the {n_facts} facts asked again. A fact is "
             "answered when the reply contains its value."
             + ("" if share is not None else " No fact was answered right after it was told, so the ratio is 0."))
    return finish("longconv", args, summary + facts + turn_rows, targets, title="Long conversations (issue #21)",
                  notes=notes, command="longconv" + (f" --model {args.model}" if args.model != DEFAULT_MODEL else "")
                  + (" --attention dense" if args.attention == "dense" else ""))


if __name__ == "__main__":
    main()
