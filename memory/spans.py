"""The cache part of the store: KV spans, content-addressed prefixes, the disk budget.

`SpanIndex` takes the store's `Connections` (memory/connections.py), reaches the
database only through its `read()` / `write()` transactions and writes span files with
memory/blobs.py. A new span's file is written and fsynced before its row commits;
eviction and "drop cache" commit the row change before unlinking files (see the crash
rules in memory/store.py).

Keys. Every span is stored under a `SpanKey` (model fingerprint, encoder fingerprint,
prefix digest) and is only returned or read under an equal key: a mismatch raises
`FingerprintMismatch` naming the field. A slot (a prefix's ordinal, or a message's
ordinal under one key) holds one span; a second put raises `SpanSlotTaken`.

Budget. After every span write the least recently used unpinned spans are evicted
until the files fit `StoreConfig.disk_budget_bytes`. An evicted span keeps its row
(state 'evicted', no file) so reads raise `SpanEvicted`, distinct from `SpanMissing`
and `SpanCorrupt`; the caller recomputes it and calls `refill_span`. Pins (`pin()`)
are in memory only. Reads stamp `last_used` lazily (see memory/lru.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from memory import blobs, rows
from memory.blobs import SpanFile, SpanTensors
from memory.connections import Connections
from memory.errors import (
    FingerprintMismatch,
    PrefixNotFound,
    SpanCorrupt,
    SpanEvicted,
    SpanMissing,
    SpanNotFound,
    SpanSlotTaken,
)
from memory.lru import EvictionCandidate, plan_eviction
from memory.records import (
    CacheSize,
    MessageId,
    PrefixHash,
    PrefixRecord,
    SegmentId,
    SessionId,
    SpanId,
    SpanKey,
    SpanRecord,
)

_KEY_FIELDS = (("model_fp", "model fingerprint"), ("encoder_fp", "encoder fingerprint"),
               ("prefix_digest", "prefix digest"))


class SpanIndex:
    """Span files and their rows, prefixes, pins and eviction (`store.spans`)."""

    def __init__(self, connections: Connections):
        self._connections = connections
        self._config = connections.config

    # ------------------------------------------------------------------ spans: write

    def put_prefix_span(
        self,
        prefix_hash: PrefixHash,
        ordinal: int,
        tensors: SpanTensors,
        key: SpanKey,
        *,
        start_pos: int,
        session_id: SessionId | None = None,
        segment_id: SegmentId | None = None,
    ) -> SpanRecord:
        """Store span number `ordinal` of the content-addressed prefix `prefix_hash`
        (see `blobs.prefix_hash`) under `key`; the prefix row is created with its first
        span. `segment_id` is the document segment the span holds, if any. Links the
        prefix to `session_id` when given. Call `complete_prefix` after the last span.
        Raises `SpanSlotTaken` when the prefix already has a span at `ordinal`."""

        def check(db) -> None:
            if session_id is not None:
                rows.session_row(db, session_id)
            stored = rows.one(db, "SELECT * FROM prefixes WHERE hash = ?", [prefix_hash])
            if stored and SpanKey(stored["model_fp"], stored["encoder_fp"], stored["prefix_digest"]) != key:
                raise ValueError(
                    f"prefix {prefix_hash} was stored under another key than {key}; hash prefixes "
                    "with blobs.prefix_hash(token_ids, model_fp, encoder_fp) and store them under one key"
                )
            _check_free_slot(
                db, "prefix_hash = ? AND ordinal = ?", [prefix_hash, ordinal], f"prefix {prefix_hash}", ordinal
            )

        def write(db) -> None:
            db.execute(
                "INSERT OR IGNORE INTO prefixes "
                "(hash, model_fp, encoder_fp, prefix_digest, n_tokens, complete, created) "
                "VALUES (?, ?, ?, ?, NULL, 0, ?)",
                [prefix_hash, key.model_fp, key.encoder_fp, key.prefix_digest, self._connections.clock()],
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
        return self._put_span(tensors, owner, key, start_pos, check, write)

    def put_message_span(
        self, message_id: MessageId, ordinal: int, tensors: SpanTensors, key: SpanKey, *, start_pos: int
    ) -> SpanRecord:
        """Store span number `ordinal` of a message (a chat turn's tokens) under `key`.
        Raises `SpanSlotTaken` when the message already has a span there under `key`."""
        with self._connections.read() as db:
            session_id = rows.message_row(db, message_id)["session_id"]

        def check(db) -> None:
            rows.message_row(db, message_id)
            _check_free_slot(
                db,
                "message_id = ? AND ordinal = ? AND model_fp = ? AND encoder_fp = ? AND prefix_digest = ?",
                [message_id, ordinal, key.model_fp, key.encoder_fp, key.prefix_digest],
                f"message {message_id}",
                ordinal,
            )

        owner = {
            "owner": "message",
            "prefix_hash": None,
            "message_id": message_id,
            "session_id": session_id,
            "ordinal": ordinal,
            "segment_id": None,
        }
        return self._put_span(tensors, owner, key, start_pos, check, lambda db: None)

    def _put_span(
        self, tensors, owner: dict, key: SpanKey, start_pos: int, check: Callable, write: Callable
    ) -> SpanRecord:
        """Validate (`MalformedSpan`), check the owner (before writing a large file, and again
        when committing), write the file, commit the row; the file is removed if the commit fails."""
        prepared = blobs.prepare(tensors)
        with self._connections.read() as db:
            check(db)
        span_id = SpanId(rows.new_id())
        written = self._write_file(span_id, prepared, key, start_pos)
        now = self._connections.clock()
        row = {
            "id": span_id,
            "state": "ready",
            "file": written.name,
            **owner,
            "model_fp": key.model_fp,
            "encoder_fp": key.encoder_fp,
            "prefix_digest": key.prefix_digest,
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
            with self._connections.write() as db:
                check(db)
                write(db)
                db["spans"].insert(row)
        except BaseException:
            blobs.remove_quietly(self._config.spans_dir / written.name)
            raise
        self.evict_to_budget(keep={span_id})
        return SpanRecord(**row)

    def _write_file(self, span_id, prepared, key: SpanKey, start_pos: int) -> blobs.WrittenFile:
        metadata = blobs.span_metadata(prepared, key, start_pos)
        name = f"{span_id}.{rows.new_id()[:8]}{blobs.SUFFIX}"  # a fresh name per write: see refill_span
        return blobs.write_span_file(self._config.spans_dir, name, prepared, metadata)

    def refill_span(self, span_id: SpanId, tensors: SpanTensors, key: SpanKey) -> SpanRecord:
        """Store recomputed tensors for an evicted, missing or corrupt span.

        The tokens must be the span's own (same count and sha256, else ValueError) and
        the key the span's (`FingerprintMismatch`); malformed tensors raise `MalformedSpan`.
        The new file gets a new name, so a crash before the row commits leaves only an
        orphan file and the old state.
        """
        record = self.get_span(span_id)
        _check_key(record, key)
        prepared = blobs.prepare(tensors)
        if (prepared.n_tokens, blobs.tokens_sha256(prepared.arrays["token_ids"])) != (
            record.n_tokens,
            record.tokens_sha256,
        ):
            raise ValueError(
                f"span {span_id} holds {record.n_tokens} other tokens; refill it with its own token ids"
            )
        written = self._write_file(span_id, prepared, key, record.start_pos)
        try:
            with self._connections.write() as db:
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
                        "last_used": self._connections.clock(),
                    },
                )
                updated = _get_span(db, span_id)
        except BaseException:
            blobs.remove_quietly(self._config.spans_dir / written.name)
            raise
        self._connections.unlink([old[0]] if old[0] else [])
        self.evict_to_budget(keep={span_id})
        return updated

    def complete_prefix(self, prefix_hash: PrefixHash, n_tokens: int) -> PrefixRecord:
        """Mark the prefix fully stored (all its spans written) with its total token count."""
        with self._connections.write() as db:
            if not _has_prefix(db, prefix_hash):
                raise PrefixNotFound(prefix_hash)
            db.execute(
                "UPDATE prefixes SET complete = 1, n_tokens = ? WHERE hash = ?", [n_tokens, prefix_hash]
            )
            return _prefix(db, prefix_hash)

    def link_prefix(self, session_id: SessionId, prefix_hash: PrefixHash) -> None:
        """Record that the session uses the prefix now (its newest link wins in `session_chain`)."""
        with self._connections.write() as db:
            rows.session_row(db, session_id)
            if not _has_prefix(db, prefix_hash):
                raise PrefixNotFound(prefix_hash)
            self._link(db, session_id, prefix_hash)

    def _link(self, db, session_id, prefix_hash) -> None:
        db.execute(
            "INSERT INTO session_prefixes (session_id, prefix_hash, linked) VALUES (?, ?, ?) "
            "ON CONFLICT (session_id, prefix_hash) DO UPDATE SET linked = excluded.linked",
            [session_id, prefix_hash, self._connections.clock()],
        )

    # ------------------------------------------------------------------ spans: read

    def get_span(self, span_id: SpanId) -> SpanRecord:
        """The span's row, or `SpanNotFound`."""
        with self._connections.read() as db:
            return _get_span(db, span_id)

    def find_prefix(self, prefix_hash: PrefixHash) -> PrefixRecord | None:
        """The cached prefix with its spans in order (any state), or None on a cache miss."""
        with self._connections.read() as db:
            return _prefix(db, prefix_hash) if _has_prefix(db, prefix_hash) else None

    def session_chain(
        self, session_id: SessionId, key: SpanKey, *, prefix_hash: PrefixHash | None = None
    ) -> list[SpanRecord]:
        """Spans stored under `key` that tile positions [0, N) of the session, in order.

        The prefix (`prefix_hash`, default the session's newest linked prefix under `key`)
        comes first, then the spans of each message on the active path. The chain stops
        before the first span that does not start where the previous one ended. Evicted
        spans are included (state 'evicted'): recompute and refill.
        """
        with self._connections.read() as db:
            leaf = rows.session_row(db, session_id)["active_leaf_id"]
            if prefix_hash is None:
                found = db.execute(
                    "SELECT hash FROM session_prefixes JOIN prefixes ON hash = prefix_hash "
                    "WHERE session_id = ? AND model_fp = ? AND encoder_fp = ? AND prefix_digest = ? "
                    "ORDER BY linked DESC, session_prefixes.rowid DESC LIMIT 1",
                    [session_id, key.model_fp, key.encoder_fp, key.prefix_digest],
                ).fetchone()
                prefix_hash = found[0] if found else None
            prefix = _prefix(db, prefix_hash) if prefix_hash and _has_prefix(db, prefix_hash) else None
            spans = prefix.spans if prefix is not None and prefix.key == key else []
            for message in rows.message_path(db, leaf) if leaf else []:
                spans += [
                    SpanRecord(**row)
                    for row in db["spans"].rows_where(
                        "message_id = ? AND model_fp = ? AND encoder_fp = ? AND prefix_digest = ?",
                        [message.id, key.model_fp, key.encoder_fp, key.prefix_digest],
                        order_by="ordinal",
                    )
                ]
        return _contiguous(spans)

    def session_keys(self, session_id: SessionId) -> list[SpanKey]:
        """The distinct keys the session's spans (its messages' and its linked prefixes') are
        stored under, oldest first: what tells a caller the cache was computed by another
        model or encoder."""
        with self._connections.read() as db:
            rows.session_row(db, session_id)
            found = db.execute(
                "SELECT model_fp, encoder_fp, prefix_digest, MIN(created) AS first FROM spans "
                "WHERE message_id IN (SELECT id FROM messages WHERE session_id = ?) "
                "OR prefix_hash IN (SELECT prefix_hash FROM session_prefixes WHERE session_id = ?) "
                "GROUP BY model_fp, encoder_fp, prefix_digest ORDER BY first",
                [session_id, session_id],
            ).fetchall()
        return [SpanKey(model_fp, encoder_fp, digest) for model_fp, encoder_fp, digest, _ in found]

    def read_span(self, span_id: SpanId, key: SpanKey, *, verify: bool = True) -> SpanFile:
        """Map the span's file and return its tensors (zero-copy numpy views).

        Raises `FingerprintMismatch` when the span was stored under another key (naming the
        field), `SpanEvicted`, `SpanMissing`, and `SpanCorrupt` (size, checksum, header or
        key differ from the row). Pin the span first if eviction may run meanwhile.
        """
        for attempt in range(2):  # a second try if refill_span replaced the file meanwhile
            record = self.get_span(span_id)
            _check_key(record, key)
            if record.state != "ready":
                raise SpanEvicted(span_id)
            path = self._config.spans_dir / record.file
            try:
                data = blobs.read_span_file(path, span_id, record.bytes, record.checksum, verify=verify)
                break
            except SpanMissing:
                current = self.get_span(span_id)
                if current.state != "ready":  # evicted between the row read and the open
                    raise SpanEvicted(span_id) from None
                if current.file == record.file or attempt:
                    raise
        header = (data.key, data.start_pos, data.n_tokens)
        if header != (record.key, record.start_pos, record.n_tokens):
            raise SpanCorrupt(span_id, path, f"header {header} disagrees with the index")
        self._connections.touches.touch([span_id], self._connections.clock())
        return data

    # ------------------------------------------------------------------ budget and eviction

    @contextlib.contextmanager
    def pin(self, span_ids: Iterable[SpanId]) -> Iterator[None]:
        """Within the block the spans are in use: eviction and "drop cache" skip them.

        Pin a chain before reading it for a resume, and the spans already written while
        storing a long prefix (each write evicts down to the budget)."""
        ids = list(span_ids)
        self._connections.pins.pin(ids)
        try:
            yield
        finally:
            self._connections.pins.unpin(ids)

    def disk_usage(self) -> int:
        """Bytes of all span files present."""
        with self._connections.read() as db:
            return db.execute("SELECT COALESCE(SUM(bytes), 0) FROM spans WHERE state = 'ready'").fetchone()[0]

    def evict_to_budget(
        self, budget_bytes: int | None = None, *, keep: Iterable[SpanId] = ()
    ) -> list[SpanId]:
        """Evict least recently used unpinned spans until the files fit `budget_bytes`
        (default: the configured budget). Returns the evicted ids, oldest first."""
        budget = self._config.disk_budget_bytes if budget_bytes is None else budget_bytes
        with self._connections.write() as db:
            found = db.execute("SELECT id, bytes, last_used FROM spans WHERE state = 'ready'").fetchall()
            total = sum(row[1] for row in found)
            if total <= budget:
                return []
            candidates = [EvictionCandidate(*row) for row in found]
            victims = plan_eviction(candidates, total, budget, self._connections.pins.pinned() | set(keep))
            files = _mark_evicted(db, victims)
        self._connections.unlink(files)
        return [SpanId(span_id) for span_id in victims]

    def session_cache_size(self, session_id: SessionId) -> CacheSize:
        """Span bytes of the session's messages and of prefixes only it uses (session_bytes),
        and of prefixes it shares with other sessions (shared_bytes)."""
        with self._connections.read() as db:
            rows.session_row(db, session_id)
            exclusive = rows.exclusive_prefixes(db, session_id)
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
        pinned = self._connections.pins.pinned()
        with self._connections.write() as db:
            rows.session_row(db, session_id)
            exclusive = rows.exclusive_prefixes(db, session_id)
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
        self._connections.unlink(files)
        return ids


# ----------------------------------------------------------------------------- helpers


def _get_span(db, span_id) -> SpanRecord:
    row = rows.one(db, "SELECT * FROM spans WHERE id = ?", [span_id])
    if row is None:
        raise SpanNotFound(span_id)
    return SpanRecord(**row)


def _has_prefix(db, prefix_hash) -> bool:
    return db.execute("SELECT 1 FROM prefixes WHERE hash = ?", [prefix_hash]).fetchone() is not None


def _prefix(db, prefix_hash) -> PrefixRecord:
    row = rows.one(db, "SELECT * FROM prefixes WHERE hash = ?", [prefix_hash])
    spans = [
        SpanRecord(**r) for r in db["spans"].rows_where("prefix_hash = ?", [prefix_hash], order_by="ordinal")
    ]
    return PrefixRecord.from_row(row, spans)


def _contiguous(spans: list[SpanRecord]) -> list[SpanRecord]:
    chain, position = [], 0
    for span in spans:
        if span.start_pos != position:
            break
        chain.append(span)
        position = span.end_pos
    return chain


def _check_key(record: SpanRecord, key: SpanKey) -> None:
    """`FingerprintMismatch` naming the first field of `key` that differs from the span's."""
    for name, label in _KEY_FIELDS:
        stored, expected = getattr(record, name), getattr(key, name)
        if stored != expected:
            raise FingerprintMismatch(record.id, label, stored, expected)


def _check_free_slot(db, where: str, params: list, owner: str, ordinal: int) -> None:
    taken = db.execute(f"SELECT id FROM spans WHERE {where}", params).fetchone()
    if taken:
        raise SpanSlotTaken(owner, ordinal, taken[0])


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
