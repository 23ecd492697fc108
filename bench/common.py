"""Shared benchmark plumbing: CLI flags, tables, targets, JSON, and docs/RESULTS.md.

Every benchmark is `python -m bench.NAME [--quick] [--json PATH] [--no-results]`.
It builds rows (dicts), computes each target from those rows, prints a table and
rewrites its own section of docs/RESULTS.md (between markers), so the file always
holds the latest run of each benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "RESULTS.md"
# The model the benchmarks measure unless one names another (--model): SmolLM2-135M, the small
# packaged model, whose 8K window the long-context lengths reach far past and on which every
# section of docs/RESULTS.md without a model in its name was measured. The app's default is
# Qwen2.5-Coder-0.5B (spotlight.loading.DEFAULT_MODEL, issue #22): bench.docqa chose it, and
# bench.decode / bench.quality measure it with --model qwen2.5-coder-0.5b-instruct.
SMALL_MODEL = "smollm2-135m-instruct"


def small_gguf() -> Path:
    """The small model's verified GGUF: what llama.cpp reads beside our engine on it."""
    from spotlight.config import default_home
    from spotlight.loading import packaged_path
    from spotlight.packaged import MODELS

    return packaged_path(MODELS[SMALL_MODEL], default_home())


@dataclass(frozen=True)
class Target:
    """A target named by an issue, checked against a value measured in the same run."""

    name: str
    value: float
    target: float
    higher_is_better: bool = True

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "target": self.target, "met": self.met}


def parser(name: str, description: str,
           quick: str = "small sizes; about a minute on 2 cores") -> argparse.ArgumentParser:
    """The flags every bench takes; `quick` is what --quick runs and how long it takes."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--json", metavar="PATH", help="also write the rows and targets as JSON here")
    p.add_argument(
        "--no-results", action="store_true", help="do not rewrite this benchmark's section of docs/RESULTS.md"
    )
    return p


def peak_rss_mb() -> float:
    """Peak resident set size of this process image in MiB.

    Linux's VmHWM, which starts afresh at exec; `ru_maxrss` does not: a spawned benchmark
    process would report its parent's peak (e.g. a llama.cpp child of a process that held
    a 128K cache reported 7.5 GB). Other systems: ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fmt(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    if value is None:
        return "—"
    return str(value)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Markdown table of rows (dicts); columns default to the first row's keys."""
    if not rows:
        return "(no rows)\n"
    if columns is None:  # every key of every row, in first-seen order
        columns = []
        for row in rows:
            columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def grouped_tables(rows: list[dict]) -> str:
    """One table per value of the rows' "part" key, each with only its own columns."""
    parts: dict[str, list[dict]] = {}
    for row in rows:
        parts.setdefault(row["part"], []).append({k: v for k, v in row.items() if k != "part"})
    out = []
    for name, part_rows in parts.items():
        columns = []
        for row in part_rows:
            columns += [k for k in row if k not in columns]
        out.append(f"**{name}**\n\n" + table(part_rows, columns))
    return "\n".join(out)


def targets_table(targets: list[Target]) -> str:
    rows = [
        {
            "target": t.name,
            "measured": _precise(t.value, t.target),
            "goal": (">= " if t.higher_is_better else "<= ") + fmt(t.target),
            "met": "yes" if t.met else f"**no** ({_miss(t)})",
        }
        for t in targets
    ]
    return table(rows)


def _precise(value, goal):
    """`value` with the digits that tell it from `goal` (1.0106 against 1.01, not 1.01 against 1.01)."""
    if isinstance(value, float) and value != goal and fmt(value) == fmt(float(goal)):
        return f"{value:.5g}"
    return value


def _miss(t: Target) -> str:
    if t.target == 0:
        return "missed"
    ratio = t.value / t.target
    return f"{ratio:.2f}x of goal" if f"{ratio:.2f}" != "1.00" else f"{ratio:.4f}x of goal"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def finish(
    name: str,
    args: argparse.Namespace,
    rows: list[dict],
    targets: list[Target],
    *,
    title: str,
    notes: str = "",
    columns: list[str] | None = None,
    extra: str = "",
    command: str | None = None,
) -> dict:
    """Print the table, write JSON and the RESULTS.md section; return the JSON document.

    `name` keys the RESULTS.md section; `command` (default: `name`) is what the section says ran."""
    doc = {
        "bench": name,
        "quick": bool(args.quick),
        "rows": rows,
        "targets": [t.as_dict() for t in targets],
    }
    body = grouped_tables(rows) if rows and "part" in rows[0] else table(rows, columns)
    print(body)
    if targets:
        print(targets_table(targets))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))
    if not args.no_results:
        stamp = time.strftime("%Y-%m-%d %H:%M")
        section = (
            f"## {title}\n\n`python -m bench.{command or name}{' --quick' if args.quick else ''}` "
            f"— {stamp}, {machine()}\n\n{notes.strip()}\n\n{body}\n"
        )
        if targets:
            section += "Targets (computed from the rows above, same run):\n\n" + targets_table(targets) + "\n"
        if extra:
            section += extra.strip() + "\n\n"
        write_section(name, section)
    return doc


def write_section(name: str, section: str) -> None:
    """Replace (or append) the section of docs/RESULTS.md between this benchmark's markers."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    text = RESULTS.read_text() if RESULTS.exists() else _results_header()
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(RESULTS)


def _results_header() -> str:
    return (
        "# Results\n\nGenerated by the benchmarks in `bench/` (`make bench`); each section is rewritten by\n"
        "its benchmark's latest run. Ratios are measured side by side in one run; absolute times on\n"
        "these 2-core machines are noisy.\n"
    )


def timer() -> float:
    return time.perf_counter()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
