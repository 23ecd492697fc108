"""The persistent store: a SQLite index (through sqlite-utils) plus one tensor file per span.

This is the only module that opens the database (the only importer of sqlite_utils).
The transcript (sessions, messages, documents) is the truth; spans are a cache that
may be evicted and recomputed.

Threading rule. Gradio runs handlers on worker threads, so:
  - reads use one connection per thread (thread-local, opened lazily, `query_only`),
    and every public read runs in one read transaction: one consistent WAL snapshot;
  - writes go through one writer connection, serialised by one `threading.Lock`,
    each as a single `BEGIN IMMEDIATE ... COMMIT` (all or nothing);
  - span files are written and fsynced *outside* the lock, so a slow 100 MB write
    never blocks readers or other writers' short transactions.
  `close()` closes every connection; call it when no handler is running.

Process rule. One process per data directory: opening takes an exclusive
`fcntl.flock` on `<root>/store.lock` (holder pid written inside); a second process
gets `StoreLocked`. The lock dies with its process, so kill -9 never leaves it stale.

Crash safety (kill -9 at any point leaves the previous consistent state):
  - SQLite in WAL mode with synchronous=FULL: a committed message survives.
  - New span: write temp file, fsync, rename, fsync dir, *then* commit its row.
  - Evict / drop / delete: commit the row change first, *then* unlink the files.
  - So a crash can leave only files without rows, never rows without files. On open,
    temp files (".*.tmp") and span files that no row references are deleted (not
    adopted: a span's owner and position live only in its row).

Layout. `Store` is assembled from two mixins that reach the database only through
this module's `_read()` / `_write()` transactions (so sqlite_utils is imported here
alone): `memory.transcript.TranscriptStore` (sessions, messages, documents,
export/import: the truth) and `memory.spans.SpanStore` (span files, prefixes, pins,
the disk budget and LRU eviction: a cache). This module owns the connections, the
directory lock, opening (schema guard, migrations, leftover cleanup) and `verify`.

`verify(root)` is the crash harness's check of a closed data directory.

Schema. `Migrations("kvstore")` applies `memory.migrations.MIGRATIONS` in order and
records them; `PRAGMA user_version` is the count. A database that has applied a
migration this code does not know raises `SchemaTooNew` before anything is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import sqlite_utils
from sqlite_utils.migrations import Migrations

from memory import blobs
from memory.errors import SchemaTooNew, StoreCorrupt, StoreError, StoreLocked, StoreWriteError
from memory.lru import PinTable, TouchBuffer
from memory.migrations import MIGRATIONS
from memory.spans import SpanStore
from memory.transcript import ACTIVE_LEAF, TranscriptStore
from memory.config import StoreConfig

__all__ = ["ACTIVE_LEAF", "KVSTORE", "SCHEMA_VERSION", "Store", "verify"]

LOCK_NAME = "store.lock"
_BUSY_TIMEOUT_S = 30.0
_IO_ERRORS = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_BUSY")


def _register(functions) -> Migrations:
    migrations = Migrations("kvstore")
    for function in functions:
        migrations()(function)
    return migrations


KVSTORE = _register(MIGRATIONS)
SCHEMA_VERSION = len(MIGRATIONS)


# ----------------------------------------------------------------------------- store


class Store(TranscriptStore, SpanStore):
    """Sessions, messages, documents and cached KV spans under one data directory.

    Opening creates `config.root` if needed, takes the directory lock (`StoreLocked`),
    refuses newer schemas (`SchemaTooNew`) and unreadable databases (`StoreCorrupt`),
    applies pending migrations, removes crash leftovers (counts in `self.recovered`)
    and evicts down to the disk budget. `clock` supplies timestamps (tests inject one).
    """

    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.time):
        if config.disk_budget_bytes < 0:
            raise ValueError(f"disk_budget_bytes must be >= 0, got {config.disk_budget_bytes}")
        self.config = config
        self._clock = clock
        self._pins = PinTable()
        self._touches = TouchBuffer()
        self._write_lock = threading.Lock()
        self._local = threading.local()
        self._readers: list[sqlite_utils.Database] = []
        self._readers_lock = threading.Lock()
        self._lock_fd: int | None = None
        self._db: sqlite_utils.Database | None = None
        try:
            self._make_directories()
            self._lock_fd = _acquire_lock(config.root)
            self._db = _open_writer(config.db_path)
            self.recovered = self._remove_leftovers()
            self.evict_to_budget()
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
        if self._db is not None and self._lock_fd is not None:
            with contextlib.suppress(StoreError, sqlite3.Error):
                with self._write():
                    pass  # flushes the touch buffer
        with self._readers_lock:
            for reader in self._readers:
                reader.close()
            self._readers.clear()
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # ------------------------------------------------------------------ connections

    def _make_directories(self) -> None:
        try:
            self.config.spans_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreWriteError(
                f"cannot create the data directory {self.config.root}: {error.strerror}; "
                "set SPOTLIGHT_HOME to a writable directory"
            ) from error

    def _reader(self) -> sqlite_utils.Database:
        if self._db is None:
            raise StoreError(f"the store at {self.config.root} is closed; open a new Store")
        db = getattr(self._local, "db", None)
        if db is None:
            # check_same_thread=False only so that close() may close it from another thread;
            # it is used by its own thread alone.
            conn = sqlite3.connect(self.config.db_path, check_same_thread=False, timeout=_BUSY_TIMEOUT_S)
            db = sqlite_utils.Database(conn, execute_plugins=False)
            conn.execute("PRAGMA query_only=ON")
            self._local.db = db
            with self._readers_lock:
                self._readers.append(db)
        return db

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite_utils.Database]:
        """This thread's connection inside one read transaction (one snapshot)."""
        db = self._reader()
        if db.conn.in_transaction:
            yield db
            return
        db.conn.execute("BEGIN")
        try:
            yield db
        finally:
            db.conn.execute("COMMIT")

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        """The writer connection inside BEGIN IMMEDIATE ... COMMIT, under the write lock."""
        if self._db is None:
            raise StoreError(f"the store at {self.config.root} is closed; open a new Store")
        with self._write_lock:
            db = self._db
            try:
                db.conn.execute("BEGIN IMMEDIATE")
                self._flush_touches(db)
                yield db
                db.conn.execute("COMMIT")
            except BaseException as error:
                if db.conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.conn.execute("ROLLBACK")
                if isinstance(error, sqlite3.OperationalError) and _is_io_error(error):
                    raise StoreWriteError(
                        f"could not write to {self.config.db_path}: {error}; free disk space or "
                        "set SPOTLIGHT_HOME to a writable directory. Nothing was committed."
                    ) from error
                raise

    def _flush_touches(self, db: sqlite_utils.Database) -> None:
        stamps = self._touches.drain()
        if stamps:
            db.conn.executemany(
                "UPDATE spans SET last_used = max(last_used, ?) WHERE id = ?",
                [(when, span_id) for span_id, when in stamps.items()],
            )

    def _remove_leftovers(self) -> dict[str, int]:
        """Delete temp files and span files with no row (see the module docstring)."""
        with self._read() as db:
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

    def _unlink(self, files: Iterable[str]) -> None:
        """Remove span files by name (after the commit that stopped referencing them)."""
        for name in files:
            blobs.remove_quietly(self.config.spans_dir / name)


# ----------------------------------------------------------------------------- helpers


def _acquire_lock(root: Path) -> int:
    """Take the directory's exclusive lock or raise `StoreLocked` naming the holder."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StoreLocked(root, int(text) if text.isdigit() else None) from None
    with contextlib.suppress(OSError):  # the pid is informational only
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _open_writer(db_path: Path) -> sqlite_utils.Database:
    """Open the writer connection: schema guard first (read-only), then WAL and migrations."""
    conn = sqlite3.connect(db_path, check_same_thread=False, timeout=_BUSY_TIMEOUT_S)
    try:
        db = sqlite_utils.Database(conn, execute_plugins=False)
        _refuse_newer_schema(db, db_path)
        db.enable_wal()
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        KVSTORE.apply(db)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return db
    except BaseException as error:
        conn.close()
        if isinstance(error, sqlite3.OperationalError) and _is_io_error(error):
            raise StoreWriteError(
                f"cannot open {db_path} for writing: {error}; set SPOTLIGHT_HOME to a writable directory"
            ) from error
        if isinstance(error, sqlite3.DatabaseError):
            raise StoreCorrupt(
                f"{db_path} is not a readable Spotlight Chat index ({error}); move it away "
                "(a new one is created) or set SPOTLIGHT_HOME to another directory"
            ) from error
        raise


def _refuse_newer_schema(db: sqlite_utils.Database, db_path: Path) -> None:
    found = db.execute("PRAGMA user_version").fetchone()[0]
    applied = [migration.name for migration in KVSTORE.applied(db)]
    known = {function.__name__ for function in MIGRATIONS}
    unknown = [name for name in applied if name not in known]
    if unknown or found > SCHEMA_VERSION:
        raise SchemaTooNew(db_path, unknown, SCHEMA_VERSION, max(found, len(applied)))


def _is_io_error(error: sqlite3.Error) -> bool:
    return str(getattr(error, "sqlite_errorname", "")).startswith(_IO_ERRORS)


# ----------------------------------------------------------------------------- crash harness


def verify(root: Path | str) -> dict:
    """Check a data directory after a crash; run it while no Store has the directory open.

    Returns {"ok", "integrity_check", "foreign_key_violations", "spans_checked",
    "span_errors" {span_id: message}, "dangling_leaves", "temp_files", "orphan_files"}.
    `ok` requires integrity_check "ok", no foreign-key violation, every ready span's file
    present with the recorded size and checksum, and every active leaf an existing
    message of its session. Temp and orphan files are listed but allowed: the next open
    deletes them (a crash mid-write leaves exactly those).
    """
    config = StoreConfig(root=Path(root))
    report: dict[str, Any] = {
        "ok": True,
        "integrity_check": "ok",
        "foreign_key_violations": 0,
        "spans_checked": 0,
        "span_errors": {},
        "dangling_leaves": [],
        "temp_files": [],
        "orphan_files": [],
    }
    live: set[str] = set()
    if config.db_path.exists():
        conn = sqlite3.connect(config.db_path)
        try:
            report["integrity_check"] = "; ".join(row[0] for row in conn.execute("PRAGMA integrity_check"))
            report["foreign_key_violations"] = len(conn.execute("PRAGMA foreign_key_check").fetchall())
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "spans" in tables:
                rows = conn.execute(
                    "SELECT id, file, bytes, checksum FROM spans WHERE state = 'ready'"
                ).fetchall()
                live = {row[1] for row in rows}
                report["spans_checked"] = len(rows)
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
        finally:
            conn.close()
    if config.spans_dir.exists():
        for entry in sorted(os.scandir(config.spans_dir), key=lambda e: e.name):
            if entry.name.endswith(blobs.TEMP_SUFFIX):
                report["temp_files"].append(entry.name)
            elif entry.name.endswith(blobs.SUFFIX) and entry.name not in live:
                report["orphan_files"].append(entry.name)
    report["ok"] = (
        report["integrity_check"] == "ok"
        and not report["foreign_key_violations"]
        and not report["span_errors"]
        and not report["dangling_leaves"]
    )
    return report
