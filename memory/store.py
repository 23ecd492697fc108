"""The persistent store: a SQLite index (through sqlite-utils) plus one tensor file per span.

This is the only module that touches the database. The transcript (sessions, messages,
documents) is the truth; spans are a cache that may be evicted and recomputed.

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

Budget. After every span write the least recently used unpinned spans are evicted
until the files fit `StoreConfig.disk_budget_bytes`. An evicted span keeps its row
(state 'evicted', no file) so reads raise `SpanEvicted`, distinct from `SpanMissing`
and `SpanCorrupt`; the caller recomputes it and calls `refill_span`. Pins (`pin()`)
are in memory only. Reads stamp `last_used` lazily (see memory/lru.py).

`verify(root)` is the crash harness's check of a closed data directory.

Schema. `Migrations("kvstore")` applies `memory.migrations.MIGRATIONS` in order and
records them; `PRAGMA user_version` is the count. A database that has applied a
migration this code does not know raises `SchemaTooNew` before anything is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import sqlite_utils
from sqlite_utils.migrations import Migrations

from memory import blobs
from memory.blobs import PrefixHash, SpanFile, SpanId, SpanTensors
from memory.errors import (
    DocumentNotFound,
    FingerprintMismatch,
    MessageNotFound,
    PrefixNotFound,
    SchemaTooNew,
    SessionNotFound,
    SpanCorrupt,
    SpanEvicted,
    SpanMissing,
    SpanNotFound,
    StoreCorrupt,
    StoreError,
    StoreLocked,
    StoreWriteError,
)
from memory.lru import EvictionCandidate, PinTable, TouchBuffer, plan_eviction
from memory.migrations import (
    MIGRATIONS,
    CacheSize,
    DocumentId,
    DocumentRecord,
    MessageId,
    MessageRecord,
    PrefixRecord,
    SegmentId,
    SegmentRecord,
    SegmentSpec,
    SessionId,
    SessionRecord,
    SpanRecord,
    document_record,
    message_record,
    prefix_record,
    session_record,
)
from spotlight.config import StoreConfig

ROLES = ("system", "user", "assistant", "tool")
LOCK_NAME = "store.lock"
EXPORT_FORMAT = "spotlight-chat/session"
EXPORT_VERSION = 1
_BUSY_TIMEOUT_S = 30.0
_MAX_SEARCH_WORDS = 16
_IO_ERRORS = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_BUSY")


def _register(functions) -> Migrations:
    migrations = Migrations("kvstore")
    for function in functions:
        migrations()(function)
    return migrations


KVSTORE = _register(MIGRATIONS)
SCHEMA_VERSION = len(MIGRATIONS)


class _ActiveLeaf:
    def __repr__(self):
        return "ACTIVE_LEAF"


ACTIVE_LEAF: Any = _ActiveLeaf()  # add_message's default parent: the session's active leaf


def _new_id() -> str:
    return uuid.uuid4().hex


def _dumps(value: dict | None) -> str:
    return json.dumps(value or {}, sort_keys=True)


# ----------------------------------------------------------------------------- store


class Store:
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

    # ------------------------------------------------------------------ sessions

    def create_session(
        self, title: str = "New chat", system_prompt: str = "", settings: dict | None = None
    ) -> SessionRecord:
        """A new empty session."""
        now = self._clock()
        row = {
            "id": _new_id(),
            "title": title,
            "created": now,
            "updated": now,
            "system_prompt": system_prompt,
            "settings": _dumps(settings),
            "active_leaf_id": None,
        }
        with self._write() as db:
            db["sessions"].insert(row)
        return session_record(row)

    def get_session(self, session_id: SessionId) -> SessionRecord:
        """The session, or `SessionNotFound`."""
        with self._read() as db:
            return session_record(_get_session_row(db, session_id))

    def list_sessions(self, limit: int | None = None, offset: int = 0) -> list[SessionRecord]:
        """Sessions, most recently updated first."""
        with self._read() as db:
            rows = db.query(
                "SELECT * FROM sessions ORDER BY updated DESC, rowid DESC LIMIT ? OFFSET ?",
                [-1 if limit is None else limit, offset],
            )
            return [session_record(row) for row in rows]

    def update_session(
        self,
        session_id: SessionId,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict | None = None,
    ) -> SessionRecord:
        """Change the given fields (None keeps a field) and bump `updated`."""
        changes: dict[str, Any] = {"updated": self._clock()}
        if title is not None:
            changes["title"] = title
        if system_prompt is not None:
            changes["system_prompt"] = system_prompt
        if settings is not None:
            changes["settings"] = _dumps(settings)
        with self._write() as db:
            _get_session_row(db, session_id)
            db["sessions"].update(session_id, changes)
            return session_record(_get_session_row(db, session_id))

    def search_sessions(self, query: str, limit: int = 50) -> list[SessionRecord]:
        """Sessions in which every word of `query` starts a word of the title or of some
        message (full-text search, case-insensitive). Most recently updated first.
        Search syntax characters in `query` are ignored."""
        terms = _fts_terms(query)
        if not terms:
            return []
        one_term = (
            "SELECT * FROM (SELECT id FROM sessions WHERE rowid IN "
            "(SELECT rowid FROM sessions_fts WHERE sessions_fts MATCH ?) "
            "UNION SELECT messages.session_id FROM messages_fts "
            "JOIN messages ON messages.rowid = messages_fts.rowid "
            "WHERE messages_fts MATCH ?)"
        )
        sql = (
            f"SELECT * FROM sessions WHERE id IN ({' INTERSECT '.join([one_term] * len(terms))}) "
            "ORDER BY updated DESC, rowid DESC LIMIT ?"
        )
        with self._read() as db:
            params = [term for term in terms for _ in range(2)] + [limit]
            return [session_record(row) for row in db.query(sql, params)]

    def delete_session(self, session_id: SessionId) -> None:
        """Delete the session, its messages, its spans and files, its prefixes and documents
        that no other session uses."""
        with self._write() as db:
            _get_session_row(db, session_id)
            exclusive = _exclusive_prefixes(db, session_id)
            files = _span_files(db, session_id, exclusive)
            marks = ",".join("?" * len(exclusive))
            db.execute(
                f"DELETE FROM spans WHERE session_id = ? OR prefix_hash IN ({marks})",
                [session_id, *exclusive],
            )
            db.execute("DELETE FROM session_prefixes WHERE session_id = ?", [session_id])
            db.execute(f"DELETE FROM prefixes WHERE hash IN ({marks})", exclusive)
            documents = [
                row[0]
                for row in db.execute(
                    "SELECT document_id FROM session_documents WHERE session_id = ?", [session_id]
                )
            ]
            db.execute("DELETE FROM session_documents WHERE session_id = ?", [session_id])
            _delete_unused_documents(db, documents)
            db.execute("DELETE FROM messages WHERE session_id = ?", [session_id])
            db.execute("DELETE FROM sessions WHERE id = ?", [session_id])
        self._unlink(files)

    # ------------------------------------------------------------------ messages

    def add_message(
        self,
        session_id: SessionId,
        role: str,
        content: str,
        *,
        parent_id: MessageId | None = ACTIVE_LEAF,
        n_tokens: int | None = None,
        metadata: dict | None = None,
    ) -> MessageRecord:
        """Append a message under `parent_id` (default: the active leaf; None: a new root)
        and make it the session's active leaf. Committed before it returns."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
        with self._write() as db:
            session = _get_session_row(db, session_id)
            parent = session["active_leaf_id"] if parent_id is ACTIVE_LEAF else parent_id
            if parent is not None:
                _get_message_row(db, parent, session_id)
            return self._insert_message(db, session_id, parent, role, content, n_tokens, metadata)

    def add_sibling(
        self,
        message_id: MessageId,
        content: str,
        *,
        n_tokens: int | None = None,
        metadata: dict | None = None,
    ) -> MessageRecord:
        """Edit (user) or regenerate (assistant): a new message with the same parent and role
        as `message_id`, which becomes the active leaf. The old branch is kept unchanged."""
        with self._write() as db:
            old = _get_message_row(db, message_id)
            return self._insert_message(
                db, old["session_id"], old["parent_id"], old["role"], content, n_tokens, metadata
            )

    def _insert_message(self, db, session_id, parent_id, role, content, n_tokens, metadata) -> MessageRecord:
        now = self._clock()
        row = {
            "id": _new_id(),
            "session_id": session_id,
            "parent_id": parent_id,
            "role": role,
            "content": content,
            "created": now,
            "n_tokens": n_tokens,
            "metadata": _dumps(metadata),
        }
        db["messages"].insert(row)
        db["sessions"].update(session_id, {"active_leaf_id": row["id"], "updated": now})
        return message_record(row)

    def get_message(self, message_id: MessageId) -> MessageRecord:
        """The message, or `MessageNotFound`."""
        with self._read() as db:
            return message_record(_get_message_row(db, message_id))

    def set_message_metadata(self, message_id: MessageId, metadata: dict) -> MessageRecord:
        """Merge `metadata` into the message's metadata (content is never changed)."""
        with self._write() as db:
            row = _get_message_row(db, message_id)
            merged = {**json.loads(row["metadata"]), **metadata}
            db["messages"].update(message_id, {"metadata": _dumps(merged)})
            return message_record({**row, "metadata": _dumps(merged)})

    def path_to(self, message_id: MessageId) -> list[MessageRecord]:
        """Messages from the root down to `message_id`, inclusive."""
        with self._read() as db:
            _get_message_row(db, message_id)
            return _path(db, message_id)

    def active_path(self, session_id: SessionId) -> list[MessageRecord]:
        """The conversation as shown: root to the session's active leaf ([] when empty)."""
        with self._read() as db:
            leaf = _get_session_row(db, session_id)["active_leaf_id"]
            return _path(db, leaf) if leaf else []

    def children(self, session_id: SessionId, parent_id: MessageId | None) -> list[MessageRecord]:
        """Direct replies to `parent_id` (None: the session's roots), oldest first."""
        with self._read() as db:
            _get_session_row(db, session_id)
            return _children(db, session_id, parent_id)

    def siblings(self, message_id: MessageId) -> list[MessageRecord]:
        """The alternatives at `message_id`'s place (itself included), oldest first."""
        with self._read() as db:
            row = _get_message_row(db, message_id)
            return _children(db, row["session_id"], row["parent_id"])

    def switch_branch(self, message_id: MessageId) -> list[MessageRecord]:
        """Make the newest leaf below `message_id` the active leaf; returns the new active path."""
        with self._write() as db:
            row = _get_message_row(db, message_id)
            leaf = message_id
            while replies := _children(db, row["session_id"], leaf):
                leaf = replies[-1].id
            db["sessions"].update(row["session_id"], {"active_leaf_id": leaf, "updated": self._clock()})
            return _path(db, leaf)

    # ------------------------------------------------------------------ documents

    def add_document(
        self,
        name: str,
        text: str,
        *,
        segments: Iterable[SegmentSpec | dict] = (),
        pages: int | None = None,
        n_tokens: int | None = None,
        metadata: dict | None = None,
        session_id: SessionId | None = None,
    ) -> DocumentRecord:
        """Store a document snapshot with its segments; attach it to `session_id` if given.

        Content-addressed: the same text (sha256) returns the existing document (its
        stored segments are kept; `segments` only fill a document that has none).
        """
        specs = [spec if isinstance(spec, SegmentSpec) else SegmentSpec(**spec) for spec in segments]
        _check_segments(specs, len(text))
        digest = hashlib.sha256(text.encode()).hexdigest()
        with self._write() as db:
            if session_id is not None:
                _get_session_row(db, session_id)
            row = next(db["documents"].rows_where("sha256 = ?", [digest]), None)
            if row is None:
                row = {
                    "id": _new_id(),
                    "name": name,
                    "sha256": digest,
                    "text": text,
                    "n_chars": len(text),
                    "pages": pages,
                    "n_tokens": n_tokens,
                    "metadata": _dumps(metadata),
                    "created": self._clock(),
                }
                db["documents"].insert(row)
            if (
                specs
                and not db.execute("SELECT 1 FROM segments WHERE document_id = ?", [row["id"]]).fetchone()
            ):
                db["segments"].insert_all(
                    {"document_id": row["id"], "ordinal": ordinal, **_spec_row(spec)}
                    for ordinal, spec in enumerate(specs)
                )
            if session_id is not None:
                self._attach(db, session_id, row["id"])
            return document_record(row)

    def attach_document(self, session_id: SessionId, document_id: DocumentId) -> None:
        """Make the document part of the session (idempotent; order of first attachment)."""
        with self._write() as db:
            _get_session_row(db, session_id)
            _get_document_row(db, document_id)
            self._attach(db, session_id, document_id)

    def _attach(self, db, session_id, document_id) -> None:
        ordinal = db.execute(
            "SELECT COUNT(*) FROM session_documents WHERE session_id = ?", [session_id]
        ).fetchone()[0]
        db.execute(
            "INSERT OR IGNORE INTO session_documents (session_id, document_id, ordinal, added) "
            "VALUES (?, ?, ?, ?)",
            [session_id, document_id, ordinal, self._clock()],
        )

    def get_document(self, document_id: DocumentId) -> DocumentRecord:
        with self._read() as db:
            return document_record(_get_document_row(db, document_id))

    def document_text(self, document_id: DocumentId) -> str:
        with self._read() as db:
            return _get_document_row(db, document_id)["text"]

    def segments(self, document_id: DocumentId) -> list[SegmentRecord]:
        """The document's segments in order."""
        with self._read() as db:
            _get_document_row(db, document_id)
            return [
                SegmentRecord(**row)
                for row in db["segments"].rows_where("document_id = ?", [document_id], order_by="ordinal")
            ]

    def session_documents(self, session_id: SessionId) -> list[DocumentRecord]:
        """Documents attached to the session, in attachment order."""
        with self._read() as db:
            _get_session_row(db, session_id)
            return [
                document_record(row)
                for row in db.query(
                    "SELECT documents.* FROM session_documents JOIN documents ON documents.id = document_id "
                    "WHERE session_id = ? ORDER BY ordinal",
                    [session_id],
                )
            ]

    # ------------------------------------------------------------------ spans: write

    def put_prefix_span(
        self,
        prefix_hash: PrefixHash,
        ordinal: int,
        tensors: SpanTensors,
        *,
        model_fp: str,
        encoder_fp: str,
        start_pos: int,
        segment_id: SegmentId | None = None,
        session_id: SessionId | None = None,
    ) -> SpanRecord:
        """Store span number `ordinal` of the content-addressed prefix `prefix_hash`
        (see `blobs.prefix_hash`); the prefix row is created with its first span. Links the
        prefix to `session_id` when given. Call `complete_prefix` after the last span."""

        def check(db) -> None:
            if session_id is not None:
                _get_session_row(db, session_id)
            stored = db.execute(
                "SELECT model_fp, encoder_fp FROM prefixes WHERE hash = ?", [prefix_hash]
            ).fetchone()
            if stored and tuple(stored) != (model_fp, encoder_fp):
                raise ValueError(
                    f"prefix {prefix_hash} was stored for fingerprints {tuple(stored)}; hash "
                    "prefixes with blobs.prefix_hash(token_ids, model_fp, encoder_fp)"
                )
            _check_free_slot(
                db, "prefix_hash = ? AND ordinal = ?", [prefix_hash, ordinal], f"prefix {prefix_hash}"
            )

        def write(db) -> None:
            db.execute(
                "INSERT OR IGNORE INTO prefixes (hash, model_fp, encoder_fp, n_tokens, complete, created) "
                "VALUES (?, ?, ?, NULL, 0, ?)",
                [prefix_hash, model_fp, encoder_fp, self._clock()],
            )
            if session_id is not None:
                self._link(db, session_id, prefix_hash)

        owner = {
            "owner": "prefix",
            "prefix_hash": prefix_hash,
            "message_id": None,
            "session_id": None,
            "ordinal": ordinal,
            "segment_id": segment_id,
        }
        return self._put_span(tensors, owner, model_fp, encoder_fp, start_pos, check, write)

    def put_message_span(
        self,
        message_id: MessageId,
        ordinal: int,
        tensors: SpanTensors,
        *,
        model_fp: str,
        encoder_fp: str,
        start_pos: int,
    ) -> SpanRecord:
        """Store span number `ordinal` of a message (a chat turn's tokens) for these fingerprints."""
        session_id = self.get_message(message_id).session_id

        def check(db) -> None:
            _get_message_row(db, message_id)
            _check_free_slot(
                db,
                "message_id = ? AND model_fp = ? AND encoder_fp = ? AND ordinal = ?",
                [message_id, model_fp, encoder_fp, ordinal],
                f"message {message_id}",
            )

        owner = {
            "owner": "message",
            "prefix_hash": None,
            "message_id": message_id,
            "session_id": session_id,
            "ordinal": ordinal,
            "segment_id": None,
        }
        return self._put_span(tensors, owner, model_fp, encoder_fp, start_pos, check, lambda db: None)

    def _put_span(self, tensors, owner: dict, model_fp, encoder_fp, start_pos, check, write) -> SpanRecord:
        """Validate, check the owner (before writing a large file, and again when committing),
        write the file, commit the row; the file is removed if the commit fails."""
        prepared = blobs.prepare(tensors)
        with self._read() as db:
            check(db)
        span_id = SpanId(_new_id())
        written = self._write_file(span_id, prepared, model_fp, encoder_fp, start_pos)
        now = self._clock()
        row = {
            "id": span_id,
            "state": "ready",
            "file": written.name,
            **owner,
            "model_fp": model_fp,
            "encoder_fp": encoder_fp,
            "dtype": prepared.dtype,
            "n_tokens": prepared.n_tokens,
            "start_pos": int(start_pos),
            "tokens_sha256": blobs.tokens_sha256(prepared.arrays["token_ids"]),
            "bytes": written.bytes,
            "checksum": written.checksum,
            "created": now,
            "last_used": now,
        }
        try:
            with self._write() as db:
                check(db)
                write(db)
                db["spans"].insert(row)
        except BaseException:
            blobs.remove_quietly(self.config.spans_dir / written.name)
            raise
        self.evict_to_budget(keep={span_id})
        return SpanRecord(**row)

    def _write_file(self, span_id, prepared, model_fp, encoder_fp, start_pos) -> blobs.WrittenFile:
        metadata = blobs.span_metadata(prepared, model_fp, encoder_fp, start_pos)
        name = f"{span_id}.{_new_id()[:8]}{blobs.SUFFIX}"  # a fresh name per write: see refill_span
        return blobs.write_span_file(self.config.spans_dir, name, prepared, metadata)

    def refill_span(
        self, span_id: SpanId, tensors: SpanTensors, *, model_fp: str, encoder_fp: str
    ) -> SpanRecord:
        """Store recomputed tensors for an evicted, missing or corrupt span.

        The tokens must be the span's own (same count and sha256) and the fingerprints
        the span's; the new file gets a new name, so a crash before the row commits
        leaves only an orphan file and the old state.
        """
        record = self.get_span(span_id)
        _check_fingerprints(record, model_fp, encoder_fp)
        prepared = blobs.prepare(tensors)
        if (prepared.n_tokens, blobs.tokens_sha256(prepared.arrays["token_ids"])) != (
            record.n_tokens,
            record.tokens_sha256,
        ):
            raise ValueError(
                f"span {span_id} holds {record.n_tokens} other tokens; refill it with its own token ids"
            )
        written = self._write_file(span_id, prepared, model_fp, encoder_fp, record.start_pos)
        try:
            with self._write() as db:
                old = db.execute("SELECT file FROM spans WHERE id = ?", [span_id]).fetchone()
                if old is None:
                    raise SpanNotFound(span_id)
                db["spans"].update(
                    span_id,
                    {
                        "state": "ready",
                        "file": written.name,
                        "dtype": prepared.dtype,
                        "bytes": written.bytes,
                        "checksum": written.checksum,
                        "last_used": self._clock(),
                    },
                )
                updated = SpanRecord(**next(db["spans"].rows_where("id = ?", [span_id])))
        except BaseException:
            blobs.remove_quietly(self.config.spans_dir / written.name)
            raise
        self._unlink([old[0]] if old[0] else [])
        self.evict_to_budget(keep={span_id})
        return updated

    def complete_prefix(self, prefix_hash: PrefixHash, n_tokens: int) -> PrefixRecord:
        """Mark the prefix fully stored (all its spans written) with its total token count."""
        with self._write() as db:
            if not db.execute("SELECT 1 FROM prefixes WHERE hash = ?", [prefix_hash]).fetchone():
                raise PrefixNotFound(prefix_hash)
            db.execute(
                "UPDATE prefixes SET complete = 1, n_tokens = ? WHERE hash = ?", [n_tokens, prefix_hash]
            )
            return _prefix(db, prefix_hash)

    def link_prefix(self, session_id: SessionId, prefix_hash: PrefixHash) -> None:
        """Record that the session uses the prefix now (its newest link wins in `session_chain`)."""
        with self._write() as db:
            _get_session_row(db, session_id)
            if not db.execute("SELECT 1 FROM prefixes WHERE hash = ?", [prefix_hash]).fetchone():
                raise PrefixNotFound(prefix_hash)
            self._link(db, session_id, prefix_hash)

    def _link(self, db, session_id, prefix_hash) -> None:
        db.execute(
            "INSERT INTO session_prefixes (session_id, prefix_hash, linked) VALUES (?, ?, ?) "
            "ON CONFLICT (session_id, prefix_hash) DO UPDATE SET linked = excluded.linked",
            [session_id, prefix_hash, self._clock()],
        )

    # ------------------------------------------------------------------ spans: read

    def get_span(self, span_id: SpanId) -> SpanRecord:
        """The span's row, or `SpanNotFound`."""
        with self._read() as db:
            return _get_span(db, span_id)

    def find_prefix(self, prefix_hash: PrefixHash) -> PrefixRecord | None:
        """The cached prefix with its spans in order (any state), or None on a cache miss."""
        with self._read() as db:
            if not db.execute("SELECT 1 FROM prefixes WHERE hash = ?", [prefix_hash]).fetchone():
                return None
            return _prefix(db, prefix_hash)

    def session_chain(
        self,
        session_id: SessionId,
        *,
        model_fp: str,
        encoder_fp: str,
        prefix_hash: PrefixHash | None = None,
    ) -> list[SpanRecord]:
        """Spans that tile positions [0, N) of the session for these fingerprints, in order.

        The prefix (`prefix_hash`, default the session's newest linked prefix with these
        fingerprints) comes first, then the spans of each message on the active path.
        The chain stops before the first span that does not start where the previous
        one ended. Evicted spans are included (state 'evicted'): recompute and refill.
        """
        with self._read() as db:
            leaf = _get_session_row(db, session_id)["active_leaf_id"]
            if prefix_hash is None:
                found = db.execute(
                    "SELECT hash FROM session_prefixes JOIN prefixes ON hash = prefix_hash "
                    "WHERE session_id = ? AND model_fp = ? AND encoder_fp = ? "
                    "ORDER BY linked DESC, session_prefixes.rowid DESC LIMIT 1",
                    [session_id, model_fp, encoder_fp],
                ).fetchone()
                prefix_hash = found[0] if found else None
            prefix = _prefix(db, prefix_hash) if prefix_hash and _has_prefix(db, prefix_hash) else None
            usable = prefix is not None and (prefix.model_fp, prefix.encoder_fp) == (model_fp, encoder_fp)
            spans = prefix.spans if usable else []
            for message in _path(db, leaf) if leaf else []:
                spans += [
                    SpanRecord(**row)
                    for row in db["spans"].rows_where(
                        "message_id = ? AND model_fp = ? AND encoder_fp = ?",
                        [message.id, model_fp, encoder_fp],
                        order_by="ordinal",
                    )
                ]
        return _contiguous(spans)

    def read_span(
        self,
        span_id: SpanId,
        *,
        model_fp: str | None = None,
        encoder_fp: str | None = None,
        verify: bool = True,
    ) -> SpanFile:
        """Map the span's file and return its tensors (zero-copy numpy views).

        Raises `SpanEvicted`, `SpanMissing`, `SpanCorrupt` (size, checksum, header or
        fingerprints differ from the row), and `FingerprintMismatch` when `model_fp` /
        `encoder_fp` are given and differ. Pin the span first if eviction may run meanwhile.
        """
        for attempt in range(2):  # a second try if refill_span replaced the file meanwhile
            record = self.get_span(span_id)
            _check_fingerprints(record, model_fp, encoder_fp)
            if record.state != "ready":
                raise SpanEvicted(span_id)
            path = self.config.spans_dir / record.file
            try:
                data = blobs.read_span_file(path, span_id, record.bytes, record.checksum, verify=verify)
                break
            except SpanMissing:
                current = self.get_span(span_id)
                if current.state != "ready":  # evicted between the row read and the open
                    raise SpanEvicted(span_id) from None
                if current.file == record.file or attempt:
                    raise
        header = (data.model_fp, data.encoder_fp, data.start_pos, data.n_tokens)
        if header != (record.model_fp, record.encoder_fp, record.start_pos, record.n_tokens):
            raise SpanCorrupt(span_id, path, f"header {header} disagrees with the index")
        self._touches.touch([span_id], self._clock())
        return data

    # ------------------------------------------------------------------ budget and eviction

    @contextlib.contextmanager
    def pin(self, span_ids: Iterable[SpanId]) -> Iterator[None]:
        """Within the block the spans are in use: eviction and "drop cache" skip them.

        Pin a chain before reading it for a resume, and the spans already written while
        storing a long prefix (each write evicts down to the budget)."""
        ids = list(span_ids)
        self._pins.pin(ids)
        try:
            yield
        finally:
            self._pins.unpin(ids)

    def disk_usage(self) -> int:
        """Bytes of all span files present."""
        with self._read() as db:
            return db.execute("SELECT COALESCE(SUM(bytes), 0) FROM spans WHERE state = 'ready'").fetchone()[0]

    def evict_to_budget(
        self, budget_bytes: int | None = None, *, keep: Iterable[SpanId] = ()
    ) -> list[SpanId]:
        """Evict least recently used unpinned spans until the files fit `budget_bytes`
        (default: the configured budget). Returns the evicted ids, oldest first."""
        budget = self.config.disk_budget_bytes if budget_bytes is None else budget_bytes
        with self._write() as db:
            rows = db.execute("SELECT id, bytes, last_used FROM spans WHERE state = 'ready'").fetchall()
            total = sum(row[1] for row in rows)
            if total <= budget:
                return []
            candidates = [EvictionCandidate(*row) for row in rows]
            victims = plan_eviction(candidates, total, budget, self._pins.pinned() | set(keep))
            files = _mark_evicted(db, victims)
        self._unlink(files)
        return [SpanId(span_id) for span_id in victims]

    def session_cache_size(self, session_id: SessionId) -> CacheSize:
        """Span bytes of the session's messages and of prefixes only it uses (session_bytes),
        and of prefixes it shares with other sessions (shared_bytes)."""
        with self._read() as db:
            _get_session_row(db, session_id)
            exclusive = _exclusive_prefixes(db, session_id)
            shared = [
                row[0]
                for row in db.execute(
                    "SELECT prefix_hash FROM session_prefixes WHERE session_id = ?", [session_id]
                )
                if row[0] not in exclusive
            ]

            def totals(where: str, params: list) -> tuple[int, int, int]:
                return db.execute(
                    "SELECT COALESCE(SUM(bytes), 0), COALESCE(SUM(state = 'ready'), 0), "
                    f"COALESCE(SUM(state = 'evicted'), 0) FROM spans WHERE {where}",
                    params,
                ).fetchone()

            own = totals(
                f"session_id = ? OR prefix_hash IN ({','.join('?' * len(exclusive))})",
                [session_id, *exclusive],
            )
            other = totals(f"prefix_hash IN ({','.join('?' * len(shared))})", shared)
        return CacheSize(own[0], other[0], own[1] + other[1], own[2] + other[2])

    def drop_session_cache(self, session_id: SessionId) -> list[SpanId]:
        """Evict the session's spans and those of prefixes no other session uses (pinned ones
        stay). The transcript is untouched; the spans are recomputed on next use."""
        pinned = self._pins.pinned()
        with self._write() as db:
            _get_session_row(db, session_id)
            exclusive = _exclusive_prefixes(db, session_id)
            marks = ",".join("?" * len(exclusive))
            ids = [
                row[0]
                for row in db.execute(
                    "SELECT id FROM spans WHERE state = 'ready' "
                    f"AND (session_id = ? OR prefix_hash IN ({marks}))",
                    [session_id, *exclusive],
                )
                if row[0] not in pinned
            ]
            files = _mark_evicted(db, ids)
        self._unlink(files)
        return ids

    def _unlink(self, files: Iterable[str]) -> None:
        for name in files:
            blobs.remove_quietly(self.config.spans_dir / name)

    # ------------------------------------------------------------------ export / import

    def export_session(self, session_id: SessionId) -> dict:
        """The session as plain JSON data: session fields, every message of every branch
        (parents referenced by list index), and its documents with text and segments.
        Spans are a cache and are not exported. Contains no database ids."""
        with self._read() as db:
            session = session_record(_get_session_row(db, session_id))
            messages = [
                message_record(row)
                for row in db["messages"].rows_where("session_id = ?", [session_id], order_by="rowid")
            ]
            documents = [
                dict(row)
                for row in db.query(
                    "SELECT documents.* FROM session_documents JOIN documents ON documents.id = document_id "
                    "WHERE session_id = ? ORDER BY ordinal",
                    [session_id],
                )
            ]
            for document in documents:
                document["segments"] = [
                    {key: row[key] for key in ("char_start", "char_end", "page", "heading", "n_tokens")}
                    for row in db["segments"].rows_where(
                        "document_id = ?", [document["id"]], order_by="ordinal"
                    )
                ]
        index = {message.id: position for position, message in enumerate(messages)}
        return {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "session": {
                "title": session.title,
                "created": session.created,
                "updated": session.updated,
                "system_prompt": session.system_prompt,
                "settings": session.settings,
                "active_leaf": index.get(session.active_leaf_id),
            },
            "messages": [
                {
                    "parent": index.get(m.parent_id),
                    "role": m.role,
                    "content": m.content,
                    "created": m.created,
                    "n_tokens": m.n_tokens,
                    "metadata": m.metadata,
                }
                for m in messages
            ],
            "documents": [
                {
                    key: d[key]
                    for key in ("name", "sha256", "text", "pages", "n_tokens", "created", "segments")
                }
                | {"metadata": json.loads(d["metadata"])}
                for d in documents
            ],
        }

    def import_session(self, data: dict) -> SessionId:
        """Create a new session from `export_session` data (new ids, same content and times);
        documents already stored (same sha256) are reused. All or nothing."""
        _check_export(data)
        session_id = SessionId(_new_id())
        header = data["session"]
        with self._write() as db:
            db["sessions"].insert(
                {
                    "id": session_id,
                    "title": header["title"],
                    "created": header["created"],
                    "updated": header["updated"],
                    "system_prompt": header["system_prompt"],
                    "settings": _dumps(header["settings"]),
                    "active_leaf_id": None,
                }
            )
            ids = [MessageId(_new_id()) for _ in data["messages"]]
            db["messages"].insert_all(
                {
                    "id": ids[i],
                    "session_id": session_id,
                    "parent_id": None if m["parent"] is None else ids[m["parent"]],
                    "role": m["role"],
                    "content": m["content"],
                    "created": m["created"],
                    "n_tokens": m["n_tokens"],
                    "metadata": _dumps(m["metadata"]),
                }
                for i, m in enumerate(data["messages"])
            )
            leaf = header["active_leaf"]
            db["sessions"].update(session_id, {"active_leaf_id": None if leaf is None else ids[leaf]})
            for document in data["documents"]:
                self._import_document(db, session_id, document)
        return session_id

    def _import_document(self, db, session_id, document: dict) -> None:
        row = next(db["documents"].rows_where("sha256 = ?", [document["sha256"]]), None)
        if row is None:
            row = {key: document[key] for key in ("name", "sha256", "text", "pages", "n_tokens", "created")}
            row |= {
                "id": _new_id(),
                "n_chars": len(document["text"]),
                "metadata": _dumps(document["metadata"]),
            }
            db["documents"].insert(row)
            db["segments"].insert_all(
                {"document_id": row["id"], "ordinal": ordinal, **segment}
                for ordinal, segment in enumerate(document["segments"])
            )
        self._attach(db, session_id, row["id"])


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


def _one(db, sql: str, params: list) -> dict | None:
    return next(iter(list(db.query(sql, params))), None)


def _get_session_row(db, session_id) -> dict:
    row = _one(db, "SELECT * FROM sessions WHERE id = ?", [session_id])
    if row is None:
        raise SessionNotFound(session_id)
    return row


def _get_message_row(db, message_id, session_id=None) -> dict:
    row = _one(db, "SELECT * FROM messages WHERE id = ?", [message_id])
    if row is None or (session_id is not None and row["session_id"] != session_id):
        raise MessageNotFound(message_id, session_id)
    return row


def _get_document_row(db, document_id) -> dict:
    row = _one(db, "SELECT * FROM documents WHERE id = ?", [document_id])
    if row is None:
        raise DocumentNotFound(document_id)
    return row


def _get_span(db, span_id) -> SpanRecord:
    row = _one(db, "SELECT * FROM spans WHERE id = ?", [span_id])
    if row is None:
        raise SpanNotFound(span_id)
    return SpanRecord(**row)


def _has_prefix(db, prefix_hash) -> bool:
    return db.execute("SELECT 1 FROM prefixes WHERE hash = ?", [prefix_hash]).fetchone() is not None


def _prefix(db, prefix_hash) -> PrefixRecord:
    row = _one(db, "SELECT * FROM prefixes WHERE hash = ?", [prefix_hash])
    spans = [
        SpanRecord(**r) for r in db["spans"].rows_where("prefix_hash = ?", [prefix_hash], order_by="ordinal")
    ]
    return prefix_record(row, spans)


_PATH_SQL = """
WITH RECURSIVE path(id, parent_id, depth) AS (
    SELECT id, parent_id, 0 FROM messages WHERE id = ?
    UNION ALL
    SELECT messages.id, messages.parent_id, path.depth + 1
    FROM messages JOIN path ON messages.id = path.parent_id
)
SELECT messages.* FROM path JOIN messages ON messages.id = path.id ORDER BY path.depth DESC
"""


def _path(db, leaf_id) -> list[MessageRecord]:
    return [message_record(row) for row in db.query(_PATH_SQL, [leaf_id])]


def _children(db, session_id, parent_id) -> list[MessageRecord]:
    where, params = ("parent_id = ?", [parent_id]) if parent_id else ("parent_id IS NULL", [])
    rows = db["messages"].rows_where(f"session_id = ? AND {where}", [session_id, *params], order_by="rowid")
    return [message_record(row) for row in rows]


def _contiguous(spans: list[SpanRecord]) -> list[SpanRecord]:
    chain, position = [], 0
    for span in spans:
        if span.start_pos != position:
            break
        chain.append(span)
        position = span.end_pos
    return chain


def _check_fingerprints(record: SpanRecord, model_fp: str | None, encoder_fp: str | None) -> None:
    if model_fp is not None and model_fp != record.model_fp:
        raise FingerprintMismatch(record.id, "model fingerprint", record.model_fp, model_fp)
    if encoder_fp is not None and encoder_fp != record.encoder_fp:
        raise FingerprintMismatch(record.id, "encoder fingerprint", record.encoder_fp, encoder_fp)


def _check_free_slot(db, where: str, params: list, owner: str) -> None:
    taken = db.execute(f"SELECT id FROM spans WHERE {where}", params).fetchone()
    if taken:
        raise ValueError(
            f"{owner} already has span {taken[0]} at that ordinal; "
            "replace its tensors with Store.refill_span()"
        )


def _mark_evicted(db, span_ids: list[str]) -> list[str]:
    """Set spans to 'evicted' (no file); returns the file names to unlink after commit."""
    files = []
    for span_id in span_ids:
        row = db.execute("SELECT file FROM spans WHERE id = ?", [span_id]).fetchone()
        if row and row[0]:
            files.append(row[0])
    db.conn.executemany(
        "UPDATE spans SET state = 'evicted', file = NULL, bytes = 0, checksum = NULL WHERE id = ?",
        [(span_id,) for span_id in span_ids],
    )
    return files


def _exclusive_prefixes(db, session_id) -> list[str]:
    """Prefixes linked to this session and to no other."""
    return [
        row[0]
        for row in db.execute(
            "SELECT prefix_hash FROM session_prefixes WHERE session_id = ? AND prefix_hash NOT IN "
            "(SELECT prefix_hash FROM session_prefixes WHERE session_id != ?)",
            [session_id, session_id],
        )
    ]


def _span_files(db, session_id, prefixes: list[str]) -> list[str]:
    marks = ",".join("?" * len(prefixes))
    return [
        row[0]
        for row in db.execute(
            f"SELECT file FROM spans WHERE file IS NOT NULL AND (session_id = ? OR prefix_hash IN ({marks}))",
            [session_id, *prefixes],
        )
    ]


def _delete_unused_documents(db, document_ids: list[str]) -> None:
    """Delete documents no session links to and no remaining span points into."""
    for document_id in document_ids:
        used = db.execute(
            "SELECT 1 FROM session_documents WHERE document_id = ? UNION ALL SELECT 1 FROM spans "
            "JOIN segments ON segments.id = spans.segment_id WHERE segments.document_id = ? LIMIT 1",
            [document_id, document_id],
        ).fetchone()
        if not used:
            db.execute("DELETE FROM segments WHERE document_id = ?", [document_id])
            db.execute("DELETE FROM documents WHERE id = ?", [document_id])


def _check_segments(specs: list[SegmentSpec], n_chars: int) -> None:
    previous_end = 0
    for ordinal, spec in enumerate(specs):
        if not previous_end <= spec.char_start <= spec.char_end <= n_chars:
            raise ValueError(
                f"segment {ordinal} covers characters {spec.char_start}..{spec.char_end}; segments must be "
                f"in order, not overlap, and lie within the text's {n_chars} characters"
            )
        previous_end = spec.char_end


def _spec_row(spec: SegmentSpec) -> dict:
    return {
        "char_start": spec.char_start,
        "char_end": spec.char_end,
        "page": spec.page,
        "heading": spec.heading,
        "n_tokens": spec.n_tokens,
    }


def _fts_terms(query: str) -> list[str]:
    """One FTS5 prefix term per word, quoted so that search syntax in `query` is inert."""
    words = [word.replace('"', "") for word in query.split()][:_MAX_SEARCH_WORDS]
    return [f'"{word}"*' for word in words if word]


def _check_export(data: dict) -> None:
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
        raise ValueError(f"not a Spotlight Chat session export (expected format {EXPORT_FORMAT!r})")
    if data.get("version") != EXPORT_VERSION:
        raise ValueError(
            f"export version {data.get('version')!r} is not supported (this version reads "
            f"{EXPORT_VERSION}); export it again with a matching Spotlight Chat"
        )
    count = len(data["messages"])
    for position, message in enumerate(data["messages"]):
        parent = message["parent"]
        if parent is not None and not 0 <= parent < position:
            raise ValueError(
                f"message {position} has parent {parent}; parents must come before their replies"
            )
        if message["role"] not in ROLES:
            raise ValueError(f"message {position} has role {message['role']!r}; expected one of {ROLES}")
    leaf = data["session"]["active_leaf"]
    if leaf is not None and not 0 <= leaf < count:
        raise ValueError(f"active_leaf {leaf} is not a message index (0..{count - 1})")
    for document in data["documents"]:
        if hashlib.sha256(document["text"].encode()).hexdigest() != document["sha256"]:
            raise ValueError(
                f"document {document['name']!r}: text does not match its sha256 (edited export?)"
            )
        _check_segments([SegmentSpec(**segment) for segment in document["segments"]], len(document["text"]))


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
