"""Command line for the store: `python -m memory verify [PATH]` (see `--help`).

Checks a data directory without changing it: the index is opened read-only and the
span files are only read. Exit status 0 when clean, 1 when problems were found, 2
when the store cannot be checked (no store there, or another process holds it).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from memory.connections import LOCK_NAME, SCHEMA_VERSION
from memory.store import verify

EXIT_CLEAN, EXIT_PROBLEMS, EXIT_UNCHECKED = 0, 1, 2


def default_store_root() -> Path:
    """$SPOTLIGHT_HOME/store, else $XDG_CACHE_HOME (or ~/.cache)/spotlight-chat/store: the
    same directory the app uses (spotlight.config.default_home + chat.config.AppConfig.store)."""
    env = os.environ.get("SPOTLIGHT_HOME")
    if env:
        return Path(env).expanduser() / "store"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spotlight-chat" / "store"


class Busy(Exception):
    """Another process holds the store's lock."""


@contextlib.contextmanager
def shared_lock(root: Path) -> Iterator[None]:
    """Hold a shared lock on the store's lock file (if there is one) while checking it, so
    that no Store opens it meanwhile; `Busy` when a running Store holds it."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        yield  # no store has ever been opened here: nobody holds it
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise Busy(f" (pid {text})" if text.isdigit() else "") from None
        yield
    finally:
        os.close(fd)


def report_lines(root: Path, report: dict) -> list[str]:
    """What was checked, one line each, then the problems found."""
    lines = [
        f"Spotlight Chat store at {root}",
        f"  schema version   {report['schema_version']} (this Spotlight Chat knows {SCHEMA_VERSION})",
        f"  integrity check  {report['integrity_check']}",
        f"  foreign keys     {report['foreign_key_violations']} violations",
        f"  sessions         {report['sessions']}",
        f"  messages         {report['messages']}",
        f"  documents        {report['documents']}",
        f"  spans            {report['spans_ready']} ready, {report['spans_evicted']} evicted",
        f"  span files       {report['files_present']} present",
        f"  checksums        {report['spans_checked']} checked",
        f"  leftovers        {len(report['temp_files'])} temp files, {len(report['orphan_files'])} orphan "
        "files (allowed: the next open removes them)",
    ]
    problems = problem_lines(report)
    lines += ["Problems:", *(f"  {line}" for line in problems)] if problems else []
    lines.append(f"{len(problems)} problem(s) found." if problems else "OK: no problems found.")
    return lines


def problem_lines(report: dict) -> list[str]:
    problems = []
    if report["integrity_check"] != "ok":
        problems.append(f"SQLite integrity check: {report['integrity_check']}")
    if report["foreign_key_violations"]:
        problems.append(f"{report['foreign_key_violations']} foreign-key violations in the index")
    problems += [message for _, message in sorted(report["span_errors"].items())]
    problems += [f"session {session_id}: its active leaf is not one of its messages"
                 for session_id in report["dangling_leaves"]]
    return problems


def run_verify(root: Path) -> int:
    if not (root / "index.db").exists():
        print(f"no Spotlight Chat store at {root} (no index.db); pass the store directory "
              "(the app's is $SPOTLIGHT_HOME/store)", file=sys.stderr)
        return EXIT_UNCHECKED
    try:
        with shared_lock(root):
            report = verify(root)
    except Busy as busy:
        print(f"another Spotlight Chat process{busy} is using {root}; close it, then run "
              "`python -m memory verify` again", file=sys.stderr)
        return EXIT_UNCHECKED
    print("\n".join(report_lines(root, report)))
    return EXIT_CLEAN if report["ok"] else EXIT_PROBLEMS


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m memory", description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "verify",
        help="check a store's index and span files (read-only)",
        description="Check a Spotlight Chat store without changing it: SQLite integrity and foreign "
        "keys, every ready span's file (size and checksum), active leaves, leftover files. Exit "
        "status: 0 clean, 1 problems found, 2 not checked (no store, or another process uses it).",
    )
    check.add_argument(
        "path", nargs="?", type=Path, default=None,
        help="the store directory (holding index.db); default $SPOTLIGHT_HOME/store, else "
        "~/.cache/spotlight-chat/store",
    )
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = args.path if args.path is not None else default_store_root()
    return run_verify(root)


if __name__ == "__main__":
    sys.exit(main())
