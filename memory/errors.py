"""Named failures of the persistent store.

Every message says what happened and how to fix it. `StoreError` is the base of all of
them, so the UI layer can turn any of them into one `gr.Error`.

Span read failures share the base `SpanUnavailable`: a caller that only wants "recompute
this span" catches that; one that reports *why* distinguishes `SpanEvicted` (normal
cache eviction), `SpanMissing` (the file vanished) and `SpanCorrupt` (bytes changed).
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every expected failure raised by `memory`."""


class StoreLocked(StoreError):
    """Another process holds the data directory's lock file."""

    def __init__(self, root, holder_pid: int | None = None):
        who = f" (pid {holder_pid})" if holder_pid else ""
        super().__init__(
            f"another Spotlight Chat process{who} is using {root}; close it or set "
            "SPOTLIGHT_HOME to another directory"
        )
        self.root = root
        self.holder_pid = holder_pid


class SchemaTooNew(StoreError):
    """The database was written by a newer version of Spotlight Chat; it is left untouched."""

    def __init__(self, db_path, unknown: list[str], known: int, found: int):
        super().__init__(
            f"{db_path} has schema version {found} (migrations {', '.join(unknown) or 'unknown'}) "
            f"but this version of Spotlight Chat knows only {known}; upgrade Spotlight Chat, or "
            "set SPOTLIGHT_HOME to another directory. The database was not modified."
        )
        self.db_path = db_path
        self.unknown = unknown


class StoreCorrupt(StoreError):
    """The index database cannot be read as a Spotlight Chat store."""


class StoreWriteError(StoreError):
    """A write failed (disk full, read-only or vanished directory); nothing was committed."""


class NotFound(StoreError, LookupError):
    """Base of the "no such id" errors."""


class SessionNotFound(NotFound):
    def __init__(self, session_id):
        super().__init__(
            f"no session with id {session_id!r}; it may have been deleted. "
            "List the existing ones with store.transcript.list_sessions()"
        )
        self.session_id = session_id


class MessageNotFound(NotFound):
    def __init__(self, message_id, session_id=None):
        where = f" in session {session_id!r}" if session_id else ""
        super().__init__(
            f"no message with id {message_id!r}{where}; take ids from store.transcript.active_path() or path_to()"
        )
        self.message_id = message_id


class DocumentNotFound(NotFound):
    def __init__(self, document_id):
        super().__init__(f"no document with id {document_id!r}; add it with store.transcript.add_document()")
        self.document_id = document_id


class SpanNotFound(NotFound):
    def __init__(self, span_id):
        super().__init__(f"no span with id {span_id!r}; it was deleted with its session or prefix")
        self.span_id = span_id


class PrefixNotFound(NotFound):
    def __init__(self, prefix_hash):
        super().__init__(
            f"no cached prefix {prefix_hash!r}; store its spans first with store.spans.put_prefix_span()"
        )
        self.prefix_hash = prefix_hash


class SpanUnavailable(StoreError):
    """A span row exists but its tensors cannot be used: recompute them and `store.spans.refill_span()`."""

    def __init__(self, span_id, message: str):
        super().__init__(message)
        self.span_id = span_id


class SpanEvicted(SpanUnavailable):
    """The span's file was removed by the disk budget (or "drop cache"): normal, recompute it."""

    def __init__(self, span_id):
        super().__init__(
            span_id,
            f"span {span_id} was evicted to stay within the disk budget; recompute it and "
            "store it again with store.spans.refill_span()",
        )


class SpanMissing(SpanUnavailable):
    """The span row says its file is present, but the file does not exist."""

    def __init__(self, span_id, path):
        super().__init__(
            span_id,
            f"span {span_id}: file {path} is missing (deleted outside Spotlight Chat?); "
            "recompute it and store it again with store.spans.refill_span()",
        )
        self.path = path


class SpanCorrupt(SpanUnavailable):
    """The span file exists but its size, checksum or header differs from what was written."""

    def __init__(self, span_id, path, reason: str):
        super().__init__(
            span_id,
            f"span {span_id}: file {path} is corrupt ({reason}); recompute it and store it "
            "again with store.spans.refill_span()",
        )
        self.path = path
        self.reason = reason


class FingerprintMismatch(StoreError):
    """A span was computed by another model or encoder; it must never be reused silently."""

    def __init__(self, span_id, field: str, stored: str, expected: str):
        super().__init__(
            f"span {span_id} was computed with {field} {stored!r} but the running one is "
            f"{expected!r}; recompute it with the current model"
        )
        self.span_id = span_id
        self.field = field


class SpanSlotTaken(StoreError):
    """The slot (prefix or message, ordinal, key) already holds a span: it is stored already."""

    def __init__(self, owner: str, ordinal: int, span_id):
        super().__init__(
            f"{owner} already has span {span_id} at ordinal {ordinal}: that span is already "
            "stored; read it, or replace its tensors with store.spans.refill_span()"
        )
        self.owner = owner
        self.ordinal = ordinal
        self.span_id = span_id


class MalformedSpan(StoreError):
    """Span tensors with a wrong shape or dtype, or that disagree with each other; nothing is stored."""
