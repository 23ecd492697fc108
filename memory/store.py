"""The persistent store: a SQLite index plus one tensor file per span, as three parts.

The transcript (sessions, messages, documents) is the truth; spans are a cache that
may be evicted and recomputed.

Layout. `Store` composes:
  - `Connections` (memory/connections.py, the only importer of sqlite_utils): per-thread
    readers, the one writer (BEGIN IMMEDIATE), the directory lock, migrations, clock,
    pins and the touch buffer. Its docstring states the threading and process rules.
  - `store.transcript`, a `Transcript` (memory/transcript.py): sessions, messages,
    branches, documents, segments, export/import, search.
  - `store.spans`, a `SpanIndex` (memory/spans.py): span files, prefixes, pins, the disk
    budget and LRU eviction, cache sizes.
  - `store.settings`, `SavedSettings` (memory/settings.py): the app's settings by key.
The parts share row helpers through memory/rows.py only, and records through
memory/records.py. This module opens and closes them, removes crash leftovers and
holds `verify`.

Crash safety (kill -9 at any point leaves the previous consistent state):
  - SQLite in WAL mode with synchronous=FULL: a committed message survives.
  - New span: write temp file, fsync, rename, fsync dir, *then* commit its row.
  - Evict / drop / delete: commit the row change first, *then* unlink the files.
  - So a crash can leave only files without rows, never rows without files. On open,
    temp files (".*.tmp") and span files that no row references are deleted (not
    adopted: a span's owner and position live only in its row).

`verify(root)` is the crash harness's check of a closed data directory (also
`python -m memory verify`).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memory import blobs
from memory.config import StoreConfig
from memory.connections import KVSTORE, SCHEMA_VERSION, Connections
from memory.errors import StoreError
from memory.settings import SavedSettings
from memory.spans import SpanIndex
from memory.transcript import ACTIVE_LEAF, Transcript

__all__ = ["ACTIVE_LEAF", "KVSTORE", "SCHEMA_VERSION", "Store", "verify"]


class Store:
    """Sessions, messages, documents and cached KV spans under one data directory.

    `store.transcript` holds the conversation data, `store.spans` the KV cache,
    `store.settings` the app's saved settings. Opening
    creates `config.root` if needed, takes the directory lock (`StoreLocked`), refuses
    newer schemas (`SchemaTooNew`) and unreadable databases (`StoreCorrupt`), applies
    pending migrations, removes crash leftovers (counts in `self.recovered`) and evicts
    down to the disk budget. `clock` supplies timestamps (tests inject one).
    """

    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.time):
        if config.disk_budget_bytes < 0:
            raise ValueError(f"disk_budget_bytes must be >= 0, got {config.disk_budget_bytes}")
        self.config = config
        self.connections = Connections(config, clock=clock)
        self.transcript = Transcript(self.connections)
        self.spans = SpanIndex(self.connections)
        self.settings = SavedSettings(self.connections)
        try:
            self.recovered = self._remove_leftovers()
            self.spans.evict_to_budget()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Store {self.config.root}>"

    def close(self) -> None:
        """Write buffered last-used stamps, close every connection, release the lock. Idempotent."""
        self.connections.close()

    def disk_usage(self) -> int:
        """Bytes of all span files present."""
        return self.spans.disk_usage()

    def free_disk_bytes(self) -> int:
        """Bytes free on the file system that holds the span files (for the calling user)."""
        return shutil.disk_usage(self.config.spans_dir).free

    def _remove_leftovers(self) -> dict[str, int]:
        """Delete temp files and span files with no row (see the module docstring)."""
        with self.connections.read() as db:
            live = {row[0] for row in db.execute("SELECT file FROM spans WHERE file IS NOT NULL")}
        removed = {"temp_files": 0, "orphan_files": 0}
        for entry in os.scandir(self.config.spans_dir):
            if entry.name.endswith(blobs.TEMP_SUFFIX):
                kind = "temp_files"
            elif entry.name.endswith(blobs.SUFFIX) and entry.name not in live:
                kind = "orphan_files"
            else:
                continue
            blobs.remove_quietly(Path(entry.path))
            removed[kind] += 1
        return removed


# ----------------------------------------------------------------------------- crash harness


def verify(root: Path | str) -> dict:
    """Check a data directory after a crash; run it while no Store has the directory open.

    Opens the index read-only and changes nothing. Returns {"ok", "schema_version",
    "integrity_check", "foreign_key_violations", "sessions", "messages", "documents",
    "spans_ready", "spans_evicted", "files_present", "spans_checked", "span_errors"
    {span_id: message}, "dangling_leaves", "temp_files", "orphan_files"}.
    `ok` requires integrity_check "ok", no foreign-key violation, every ready span's file
    present with the recorded size and checksum, and every active leaf an existing
    message of its session. Temp and orphan files are listed but allowed: the next open
    deletes them (a crash mid-write leaves exactly those).
    """
    config = StoreConfig(root=Path(root))
    report: dict[str, Any] = {
        "ok": True,
        "schema_version": 0,
        "integrity_check": "ok",
        "foreign_key_violations": 0,
        "sessions": 0,
        "messages": 0,
        "documents": 0,
        "spans_ready": 0,
        "spans_evicted": 0,
        "files_present": 0,
        "spans_checked": 0,
        "span_errors": {},
        "dangling_leaves": [],
        "temp_files": [],
        "orphan_files": [],
    }
    live: set[str] = set()
    if config.db_path.exists():
        conn = sqlite3.connect(f"{config.db_path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            live = _check_index(conn, config, report)
        finally:
            conn.close()
    if config.spans_dir.exists():
        for entry in sorted(os.scandir(config.spans_dir), key=lambda e: e.name):
            if entry.name.endswith(blobs.TEMP_SUFFIX):
                report["temp_files"].append(entry.name)
            elif entry.name.endswith(blobs.SUFFIX):
                report["files_present"] += 1
                if entry.name not in live:
                    report["orphan_files"].append(entry.name)
    report["ok"] = (
        report["integrity_check"] == "ok"
        and not report["foreign_key_violations"]
        and not report["span_errors"]
        and not report["dangling_leaves"]
    )
    return report


def _check_index(conn: sqlite3.Connection, config: StoreConfig, report: dict) -> set[str]:
    """Fill `report` from the index; returns the span file names its ready rows reference."""
    report["schema_version"] = conn.execute("PRAGMA user_version").fetchone()[0]
    report["integrity_check"] = "; ".join(row[0] for row in conn.execute("PRAGMA integrity_check"))
    report["foreign_key_violations"] = len(conn.execute("PRAGMA foreign_key_check").fetchall())
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table in ("sessions", "messages", "documents"):
        if table in tables:
            report[table] = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    if "spans" not in tables:
        return set()
    report["spans_evicted"] = conn.execute("SELECT COUNT(*) FROM spans WHERE state = 'evicted'").fetchone()[0]
    rows = conn.execute("SELECT id, file, bytes, checksum FROM spans WHERE state = 'ready'").fetchall()
    report["spans_ready"] = report["spans_checked"] = len(rows)
    for span_id, name, size, digest in rows:
        try:
            blobs.read_span_file(config.spans_dir / name, span_id, size, digest)
        except StoreError as error:  # SpanUnavailable, or a checksum it cannot compute
            report["span_errors"][span_id] = str(error)
    report["dangling_leaves"] = [
        row[0]
        for row in conn.execute(
            "SELECT id FROM sessions WHERE active_leaf_id IS NOT NULL AND active_leaf_id NOT IN "
            "(SELECT id FROM messages WHERE messages.session_id = sessions.id)"
        )
    ]
    return {row[1] for row in rows}
