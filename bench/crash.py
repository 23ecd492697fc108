"""Crash soak: kill -9 a chat service process at random moments, then check nothing was lost.

    python -m bench.crash [--trials 50] [--quick] [--json PATH]

Each trial starts a child process running the real chat service (tiny random model,
small disk budget so eviction runs too) on one data directory shared by all trials.
The child loops: create a conversation, attach a document, ingest it (`resume`: prefill
plus span writes), then send and regenerate a few messages. After every commit it prints
the committed message's id, and before each stage its phase ("ingest" / "generate").
The parent kills it with SIGKILL at a random moment (after a random number of its
progress lines plus a random delay), then checks, with no process
holding the directory:
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

DISK_BUDGET = 4 * 1024**2  # bytes: small, so the soak evicts and recomputes too
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


def _service(home: Path, max_new_tokens: int = 24):
    from chat.service import ChatService
    from spotlight.testing import tiny_engine
    from chat.config import AppConfig
    from memory.config import StoreConfig
    from spotlight.config import SamplingConfig

    config = AppConfig(home=home, sampling=SamplingConfig(max_new_tokens=max_new_tokens))
    store = StoreConfig(root=home / "store", disk_budget_bytes=DISK_BUDGET)
    return ChatService(config, _engine=tiny_engine(seed=0, prefill_chunk=64), store_config=store)


def child(home: Path, seed: int) -> None:
    """The process that gets killed: ingest and chat forever, reporting each commit."""
    import torch

    torch.set_num_threads(1)  # a tiny model; one thread avoids OpenMP stalls when cores are shared
    rng = random.Random(seed)
    service = _service(home, max_new_tokens=rng.randint(8, 48))
    service.list_sessions()  # opens the store (recovers leftovers of the previous kill)
    service.warm_up()  # so the kill lands in the work, not in one-time initialisation
    print("ready", flush=True)
    while True:
        session = service.create()
        print(f"session {session.id}", flush=True)
        print("phase ingest", flush=True)
        service.attach_text(session.id, "doc.txt", _text(rng, rng.randint(200, 1200)))
        service.resume(session.id)
        print("phase generate", flush=True)
        for _ in range(rng.randint(1, 3)):
            turns = service.regenerate(session.id) if rng.random() < 0.25 and service.history(session.id) \
                else service.send(session.id, _text(rng, rng.randint(3, 30)))
            for turn in turns:
                if turn.user_message_id:
                    print(f"message {turn.user_message_id}", flush=True)
            if turn.message_id:
                print(f"message {turn.message_id}", flush=True)


def run_trial(home: Path, trial: int, rng: random.Random, committed: set[str], max_delay_s: float = 0.5) -> TrialResult:
    """Start a child on `home`, let it report a random number (0-12) of progress lines,
    wait a random 0..`max_delay_s` more, kill -9 it, check the directory. `committed`
    accumulates the ids of committed messages over trials."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.crash", "--child", str(home), str(rng.randrange(2**31))],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    started, progress = time.monotonic(), rng.randint(0, 12)
    while process.poll() is None and time.monotonic() - started < 120 and (
        "ready\n" not in lines or len(lines) - lines.index("ready\n") - 1 < progress
    ):
        time.sleep(0.005)
    delay = rng.uniform(0.0, max_delay_s)
    time.sleep(delay)
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
    check(home, committed, result, resume=set(touched))
    return result


def check(home: Path, committed: set[str], result: TrialResult, resume: set[str] | None = None) -> None:
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
    service = _service(home)
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


def soak(home: Path, trials: int, seed: int = 0, max_delay_s: float = 0.5) -> list[TrialResult]:
    """`trials` kills on one directory; then a last check that resumes every conversation."""
    rng, committed, results = random.Random(seed), set(), []
    for trial in range(trials):
        result = run_trial(home, trial, rng, committed, max_delay_s)
        results.append(result)
        log(f"trial {trial}: killed during {result.phase} after {result.delay_s:.2f}s; "
            f"{result.committed} committed, {result.sessions} sessions, {result.leftovers} leftover files, "
            f"{'ok' if result.ok else result.problems}")
    final = TrialResult(trials, "final check", 0.0, len(committed), 0)
    check(home, committed, final)
    results.append(final)
    log(f"final check: every one of {final.sessions} conversations resumed; {'ok' if final.ok else final.problems}")
    return results


def main(argv=None) -> int:
    p = parser("crash", "kill -9 the chat service at random moments and check that nothing is lost")
    p.add_argument("--trials", type=int, default=50, help="number of kills (default 50; --quick: 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", nargs=2, metavar=("HOME", "SEED"), help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.child:
        child(Path(args.child[0]), int(args.child[1]))
        return 0
    trials = 5 if args.quick else args.trials
    with tempfile.TemporaryDirectory(prefix="spotlight-crash-") as tmp:
        results = soak(Path(tmp), trials, args.seed)
    rows = _rows(results)
    total, final = rows[-2], rows[-1]
    targets = [
        Target("trials with kill -9", total["trials"], 5 if args.quick else 50),
        Target("trials with a problem", total["trials"] - total["ok"] + 1 - final["ok"], 0, higher_is_better=False),
        Target("committed messages lost", total["lost"] + final["lost"], 0, higher_is_better=False),
    ]
    notes = (
        "A child process runs the chat service (tiny random model, 4 MiB disk budget) on one data "
        "directory: attach + ingest (prefill, span writes), then send/regenerate; it is killed with "
        "SIGKILL at a random moment (after a random number, 0-12, of its progress lines, plus 0-0.5 s). "
        "After each kill: `memory.verify` "
        "(integrity_check, foreign keys, every ready span file's size and checksum), every committed "
        "message still present, every conversation's history reads, and the conversations the killed "
        "child worked on resume to their exact rendered length without a missing/corrupt span; after "
        "the last kill every conversation is resumed. \"mid span write\": kills after which the next open "
        "removed a temporary or unreferenced span file (the kill hit a span write)."
    )
    finish("crash", args, rows, targets, title="Crash soak (kill -9 during ingestion and generation)", notes=notes,
           columns=["killed during", "trials", "ok", "lost", "mid span write", "committed messages", "sessions"])
    return 0 if all(t.met for t in targets[1:]) else 1


def _rows(results: list[TrialResult]) -> list[dict]:
    """One row per phase the kills hit, a total, and the final resume-everything check."""
    kills, final = results[:-1], results[-1]
    rows = []
    for phase in ("start", "ingest", "generate"):
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
