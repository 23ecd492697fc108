"""Crash soak: kill -9 a chat service process at random moments, then check nothing was lost.

    python -m bench.crash [--model tiny|default] [--trials 50] [--quick] [--json PATH]

Each trial starts a child process running the real chat service on one data directory
shared by all trials: `--model tiny` (a tiny random model, small disk budget so eviction
runs too) or `--model default` (the packaged SmolLM2-135M GGUF, as the app loads it, with
a 512 MiB disk budget). The child loops: create a conversation, write a document file
(random words for tiny, a stretch of a Shakespeare play for default) and ingest it as an
upload is (`read_document` -> `attach_document` -> `resume`: prefill plus span writes),
then send and regenerate a few messages. After every commit it prints the committed
message's id, and at each stage its phase: "ingest" (reading, segmenting, attaching),
"prefill" (the first prefill chunk is done), "spans" (prefill done: the span writes run),
"generate" (a message sent: restore and prompt prefill), "reply" (tokens streaming, then
the reply's commit, settle and span writes). The parent kills it with SIGKILL at a
random moment (after a random number of its progress lines plus a random delay), then
checks, with no process holding the directory:
  - `memory.verify`: PRAGMA integrity_check is "ok", no foreign-key violation, every
    ready span's file present with its recorded size and checksum, no dangling leaf;
  - every message the child reported as committed is still there;
  - every conversation opens: its history reads; the ones the killed child worked on
    are resumed, i.e. their cache is rebuilt (restored or recomputed) to exactly their
    rendered length, and no restore reports a missing or corrupt file (evictions are
    normal). After the last kill, every conversation is resumed.
Not part of the test suite (tests/test_resume.py runs two trials of `run_trial`).
"""
from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import ROOT, Target, finish, log, parser

DISK_BUDGET = 4 * 1024**2  # bytes: small, so the soak evicts and recomputes too (tiny model)
REAL_DISK_BUDGET = 512 * 1024**2  # SmolLM2 spans take ~46 KB per token: ~7 conversations fit, then eviction
PHASES = ("start", "ingest", "prefill", "spans", "generate", "reply")
MODELS = ("tiny", "default")
MAX_DELAY_S = {"tiny": 0.5, "default": 1.5}  # the real model's stages last seconds: spread the kills over them
_WORDS = "the a river stone lamp ledger north quiet seven orbit maple copper signal harbor".split()


@dataclass
class TrialResult:
    trial: int
    phase: str  # what the child was doing when it was killed: start | ingest | generate
    delay_s: float
    committed: int  # messages the child reported committed (cumulative over trials)
    sessions: int
    leftovers: int = 0  # temp / unreferenced span files the next open removed: killed mid span write
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def default_name() -> str:
    from spotlight.loading import DEFAULT_MODEL

    return DEFAULT_MODEL


def _service(home: Path, model: str = "tiny", max_new_tokens: int = 24, engine=None):
    """The chat service the child runs (and the parent checks with): `model` "tiny" or
    "default" (loaded as the app loads it, unless `engine` is given)."""
    from chat.service import ChatService
    from spotlight.testing import tiny_engine
    from chat.config import AppConfig
    from memory.config import StoreConfig
    from spotlight.config import SamplingConfig

    config = AppConfig(home=home, sampling=SamplingConfig(max_new_tokens=max_new_tokens))
    budget = DISK_BUDGET if model == "tiny" else REAL_DISK_BUDGET
    store = StoreConfig(root=home / "store", disk_budget_bytes=budget)
    if engine is None and model == "tiny":
        engine = tiny_engine(seed=0, prefill_chunk=64)
    return ChatService(config, _engine=engine, store_config=store)


def _document(rng: random.Random, model: str) -> str:
    """A document's text: random words (tiny: 200-1200 of them, byte tokens), or a stretch of
    a Shakespeare play of ~1,000-3,000 SmolLM2 tokens (4 characters a token, about)."""
    if model == "tiny":
        return _text(rng, rng.randint(200, 1200))
    from spotlight.corpus import shakespeare

    play = rng.choice(shakespeare()).text
    n_chars = 4 * rng.randint(1000, 3000)
    start = rng.randrange(max(1, len(play) - n_chars))
    return play[start:start + n_chars]


def child(home: Path, seed: int, model: str = "tiny") -> None:
    """The process that gets killed: ingest and chat forever, reporting each commit."""
    import torch

    from segmenter import read_document

    if model == "tiny":
        torch.set_num_threads(1)  # a tiny model; one thread avoids OpenMP stalls when cores are shared
    rng = random.Random(seed)
    service = _service(home, model, max_new_tokens=rng.randint(8, 48))
    service.list_sessions()  # opens the store (recovers leftovers of the previous kill)
    service.warm_up()  # so the kill lands in the work, not in one-time initialisation
    uploads = home / "uploads"
    uploads.mkdir(exist_ok=True)
    print("ready", flush=True)
    while True:
        session = service.create()
        print(f"session {session.id}", flush=True)
        print("phase ingest", flush=True)
        path = uploads / f"{session.id}.txt"
        path.write_text(_document(rng, model), encoding="utf-8")
        service.attach_document(session.id, read_document(str(path)))  # as chat/documents.ingest does
        service.resume(session.id, progress=_PhaseLines())
        print("phase generate", flush=True)
        for _ in range(rng.randint(1, 3)):
            turns = service.regenerate(session.id) if rng.random() < 0.25 and service.history(session.id) \
                else service.send(session.id, _text(rng, rng.randint(3, 30)))
            for index, turn in enumerate(turns):  # a line per token streamed: kills land mid-reply too
                if turn.user_message_id:
                    print(f"message {turn.user_message_id}", flush=True)
                if index == 0:
                    print("phase reply", flush=True)
            if turn.message_id:
                print(f"message {turn.message_id}", flush=True)
                print("phase generate", flush=True)


class _PhaseLines:
    """A resume's progress as phase lines: "prefill" after its first chunk, "spans" once the
    prefill is done (the span writes follow)."""

    def __init__(self):
        self.said: set[str] = set()

    def __call__(self, done: int, total: int) -> None:
        phase = "spans" if done >= total else "prefill"
        if phase not in self.said:
            self.said.add(phase)
            print(f"phase {phase}", flush=True)


def run_trial(home: Path, trial: int, rng: random.Random, committed: set[str], max_delay_s: float = 0.5,
              model: str = "tiny", engine=None) -> TrialResult:
    """Start a child on `home`, let it report a random number (0-12) of progress lines,
    wait a random 0..`max_delay_s` more, kill -9 it, check the directory (with `engine`
    when given). `committed` accumulates the ids of committed messages over trials."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.crash", "--child", str(home), str(rng.randrange(2**31)), model],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    started, progress = time.monotonic(), rng.randint(0, 12)
    try:
        while process.poll() is None and time.monotonic() - started < 300 and (
            "ready\n" not in lines or len(lines) - lines.index("ready\n") - 1 < progress
        ):
            time.sleep(0.005)
        delay = rng.uniform(0.0, max_delay_s)
        time.sleep(delay)
    except KeyboardInterrupt:  # the soak is being stopped: no child may keep the directory
        process.kill()
        process.wait()
        raise
    crashed_by_itself = process.poll() is not None
    if not crashed_by_itself:
        process.send_signal(signal.SIGKILL)
    process.wait()
    reader.join(5)
    phases = [line.split()[1] for line in lines if line.startswith("phase ")]
    committed.update(line.split()[1] for line in lines if line.startswith("message "))
    touched = [line.split()[1] for line in lines if line.startswith("session ")]
    result = TrialResult(trial, phases[-1] if phases else "start", delay, len(committed), 0)
    if crashed_by_itself:
        result.problems.append(f"the child exited by itself: {process.stderr.read()[-2000:]}")
    check(home, committed, result, resume=set(touched), model=model, engine=engine)
    return result


def check(home: Path, committed: set[str], result: TrialResult, resume: set[str] | None = None,
          model: str = "tiny", engine=None) -> None:
    """Append to `result.problems` everything wrong with the directory after a kill.

    Every conversation's history is read; those in `resume` (default: all), the ones the
    killed child worked on, are also resumed (restored or recomputed, then checked)."""
    from memory import verify

    report = verify(home / "store")
    if not report["ok"]:
        result.problems.append(
            f"verify: integrity {report['integrity_check']}, fk {report['foreign_key_violations']}, "
            f"spans {report['span_errors']}, dangling {report['dangling_leaves']}"
        )
    service = _service(home, model, engine=engine)
    try:
        result.leftovers = sum(service.store.recovered.values())
        for message_id in sorted(committed):
            try:
                service.store.transcript.get_message(message_id)
            except LookupError:
                result.problems.append(f"committed message {message_id} was lost")
        sessions = service.list_sessions()
        result.sessions = len(sessions)
        for session in sessions:
            _check_session_opens(service, session.id, result, resume is None or session.id in resume)
    finally:
        service.close()


def _check_session_opens(service, session_id: str, result: TrialResult, resume: bool) -> None:
    from chat.render import Renderer

    try:
        service.history(session_id)
        if not resume:
            return
        report = service.resume(session_id)
        conversation = service._conversation(session_id, service._visible(session_id))
        expected = len(Renderer(service.engine).full(conversation).ids)
        if report.n_tokens != expected:
            result.problems.append(f"session {session_id}: resumed {report.n_tokens} tokens, expected {expected}")
        bad = [n for n in report.notices if "missing" in n or "corrupt" in n]
        if bad:
            result.problems.append(f"session {session_id}: {bad}")
    except Exception as error:  # any failure to open is a finding, reported with its type
        result.problems.append(f"session {session_id} does not open: {type(error).__name__}: {error}")


def soak(home: Path, trials: int, seed: int = 0, max_delay_s: float | None = None,
         model: str = "tiny") -> list[TrialResult]:
    """`trials` kills on one directory; then a last check that resumes every conversation.
    With the default model, the parent loads it once (converting it into `home` on the first
    use, before any child starts) and checks every trial with that engine."""
    rng, committed, results = random.Random(seed), set(), []
    max_delay_s = MAX_DELAY_S[model] if max_delay_s is None else max_delay_s
    engine = None
    if model != "tiny":
        engine = _service(home, model).engine
    try:
        for trial in range(trials):
            result = run_trial(home, trial, rng, committed, max_delay_s, model, engine)
            results.append(result)
            log(f"trial {trial}: killed during {result.phase} after {result.delay_s:.2f}s; "
                f"{result.committed} committed, {result.sessions} sessions, {result.leftovers} leftover files, "
                f"{'ok' if result.ok else result.problems}")
    except KeyboardInterrupt:  # Ctrl-C (SIGINT): stop killing, check and report the trials done
        log(f"interrupted after {len(results)} trials: the final check runs now")
    final = TrialResult(len(results), "final check", 0.0, len(committed), 0)
    check(home, committed, final, model=model, engine=engine)
    results.append(final)
    log(f"final check: every one of {final.sessions} conversations resumed; {'ok' if final.ok else final.problems}")
    return results


def main(argv=None) -> int:
    p = parser("crash", "kill -9 the chat service at random moments and check that nothing is lost")
    p.add_argument("--trials", type=int, default=50, help="number of kills (default 50; --quick: 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=MODELS, default="tiny",
                   help="tiny: a tiny random model (default); default: the app's default model (spotlight.loading.DEFAULT_MODEL)")
    p.add_argument("--child", nargs=3, metavar=("HOME", "SEED", "MODEL"), help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.child:
        child(Path(args.child[0]), int(args.child[1]), args.child[2])
        return 0
    trials = 5 if args.quick else args.trials
    with tempfile.TemporaryDirectory(prefix="spotlight-crash-") as tmp:
        results = soak(Path(tmp), trials, args.seed, model=args.model)
    rows = _rows(results)
    total, final = rows[-2], rows[-1]
    targets = [
        Target("trials with kill -9", total["trials"], 5 if args.quick else 50),
        Target("trials with a problem", total["trials"] - total["ok"] + 1 - final["ok"], 0, higher_is_better=False),
        Target("committed messages lost", total["lost"] + final["lost"], 0, higher_is_better=False),
    ]
    what = ("tiny random model, 4 MiB disk budget; documents of random words" if args.model == "tiny" else
            f"the default model, {default_name()} from its GGUF as the app loads it, 512 MiB disk budget; "
            "documents of 1,000-3,000 tokens of Shakespeare")
    notes = (
        f"A child process runs the chat service ({what}) on one data directory: a document file read, "
        "attached and ingested as an upload is (`read_document`, `attach_document`, prefill, span writes), "
        "then send/regenerate; it is killed with SIGKILL at a random moment (after a random number, 0-12, "
        f"of its progress lines, plus 0-{MAX_DELAY_S[args.model]} s). Phases: ingest (reading, attaching), "
        "prefill, spans (the ingest's span writes), generate (restore, prompt prefill), reply (tokens "
        "streaming, then the reply's commit, settle and span writes). After each kill: `memory.verify` "
        "(integrity_check, foreign keys, every ready span file's size and checksum), every committed "
        "message still present, every conversation's history reads, and the conversations the killed "
        "child worked on resume to their exact rendered length without a missing/corrupt span; after "
        "the last kill every conversation is resumed. \"mid span write\": kills after which the next open "
        "removed a temporary or unreferenced span file (the kill hit a span write)."
    )
    name, title = ("crash", "Crash soak (kill -9 during ingestion and generation)") if args.model == "tiny" else (
        "crash-default", f"Crash soak on the default model ({default_name()}, kill -9 during ingestion and generation)")
    finish(name, args, rows, targets, title=title, notes=notes, command=f"crash --model {args.model}",
           columns=["killed during", "trials", "ok", "lost", "mid span write", "committed messages", "sessions"])
    return 0 if all(t.met for t in targets[1:]) else 1


def _rows(results: list[TrialResult]) -> list[dict]:
    """One row per phase the kills hit, a total, and the final resume-everything check."""
    kills, final = results[:-1], results[-1]
    rows = []
    for phase in PHASES:
        chosen = [r for r in kills if r.phase == phase]
        rows.append({"killed during": phase, "trials": len(chosen), "ok": sum(r.ok for r in chosen),
                     "lost": sum("was lost" in p for r in chosen for p in r.problems),
                     "mid span write": sum(r.leftovers > 0 for r in chosen)})
    rows.append({"killed during": "all", "trials": len(kills), "ok": sum(r.ok for r in kills),
                 "lost": sum(row["lost"] for row in rows), "mid span write": sum(r.leftovers > 0 for r in kills)})
    rows.append({"killed during": "final check (resume all)", "trials": 1, "ok": int(final.ok),
                 "lost": sum("was lost" in p for p in final.problems), "committed messages": final.committed,
                 "sessions": final.sessions})
    return rows


if __name__ == "__main__":
    sys.exit(main())
