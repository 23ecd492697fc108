"""The store's plumbing: connections, transactions, the directory lock, clock, pins, touches.

This is the only module that imports sqlite_utils. `Transcript` (memory/transcript.py)
and `SpanIndex` (memory/spans.py) each take one `Connections` and reach the database
only through its `read()` / `write()` transactions.

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

import sqlite_utils
from sqlite_utils.migrations import Migrations

from memory import blobs
from memory.config import StoreConfig
from memory.errors import SchemaTooNew, StoreCorrupt, StoreError, StoreLocked, StoreWriteError
from memory.lru import PinTable, TouchBuffer
from memory.migrations import MIGRATIONS

__all__ = ["KVSTORE", "LOCK_NAME", "SCHEMA_VERSION", "Connections"]

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


class Connections:
    """Per-thread readers and the one writer of a data directory, plus the state the parts share.

    Opening creates `config.root` if needed, takes the directory lock (`StoreLocked`),
    refuses newer schemas (`SchemaTooNew`) and unreadable databases (`StoreCorrupt`) and
    applies pending migrations. `clock` supplies timestamps; `pins` are the spans in use;
    `touches` buffers last-used stamps until the next write.
    """

    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        self.pins = PinTable()
        self.touches = TouchBuffer()
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
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Write buffered last-used stamps, close every connection, release the lock. Idempotent."""
        if self._db is not None and self._lock_fd is not None:
            with contextlib.suppress(StoreError, sqlite3.Error):
                with self.write():
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
    def read(self) -> Iterator[sqlite_utils.Database]:
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
    def write(self) -> Iterator[sqlite_utils.Database]:
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
        stamps = self.touches.drain()
        if stamps:
            db.conn.executemany(
                "UPDATE spans SET last_used = max(last_used, ?) WHERE id = ?",
                [(when, span_id) for span_id, when in stamps.items()],
            )

    def unlink(self, files: Iterable[str]) -> None:
        """Remove span files by name (after the commit that stopped referencing them)."""
        for name in files:
            blobs.remove_quietly(self.config.spans_dir / name)


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
