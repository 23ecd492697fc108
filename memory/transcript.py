"""The transcript part of the store: sessions, branch-aware messages, documents, export/import.

`Transcript` takes the store's `Connections` (memory/connections.py) and reaches the
database only through its `read()` / `write()` transactions, so the threading,
process and crash-safety rules of memory/connections.py and memory/store.py apply
unchanged. The transcript is the truth; spans (memory/spans.py) are a cache beside it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from memory import rows
from memory.connections import Connections
from memory.records import (
    DocumentId,
    DocumentRecord,
    MessageId,
    MessageRecord,
    SegmentRecord,
    SegmentSpec,
    SessionId,
    SessionRecord,
)

ROLES = ("system", "user", "assistant", "tool")
EXPORT_FORMAT = "spotlight-chat/session"
EXPORT_VERSION = 1
_MAX_SEARCH_WORDS = 16
# A session's documents in attachment order, each named as attached there (the content is shared).
_ATTACHED = (
    "SELECT documents.id, COALESCE(NULLIF(session_documents.name, ''), documents.name) AS name, "
    "sha256, text, n_chars, pages, n_tokens, metadata, created "
    "FROM session_documents JOIN documents ON documents.id = document_id WHERE session_id = ? ORDER BY ordinal"
)


class _ActiveLeaf:
    def __repr__(self):
        return "ACTIVE_LEAF"


ACTIVE_LEAF: Any = _ActiveLeaf()  # add_message's default parent: the session's active leaf


def _dumps(value: dict | None) -> str:
    return json.dumps(value or {}, sort_keys=True)


class Transcript:
    """Sessions, messages, documents and their export (`store.transcript`)."""

    def __init__(self, connections: Connections):
        self._connections = connections

    # ------------------------------------------------------------------ sessions

    def create_session(
        self, title: str = "New chat", system_prompt: str = "", settings: dict | None = None
    ) -> SessionRecord:
        """A new empty session."""
        now = self._connections.clock()
        row = {
            "id": rows.new_id(),
            "title": title,
            "created": now,
            "updated": now,
            "system_prompt": system_prompt,
            "settings": _dumps(settings),
            "active_leaf_id": None,
        }
        with self._connections.write() as db:
            db["sessions"].insert(row)
        return SessionRecord.from_row(row)

    def get_session(self, session_id: SessionId) -> SessionRecord:
        """The session, or `SessionNotFound`."""
        with self._connections.read() as db:
            return SessionRecord.from_row(rows.session_row(db, session_id))

    def list_sessions(self, limit: int | None = None, offset: int = 0) -> list[SessionRecord]:
        """Sessions, most recently updated first."""
        with self._connections.read() as db:
            found = db.query(
                "SELECT * FROM sessions ORDER BY updated DESC, rowid DESC LIMIT ? OFFSET ?",
                [-1 if limit is None else limit, offset],
            )
            return [SessionRecord.from_row(row) for row in found]

    def update_session(
        self,
        session_id: SessionId,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict | None = None,
    ) -> SessionRecord:
        """Change the given fields (None keeps a field) and bump `updated`."""
        changes: dict[str, Any] = {"updated": self._connections.clock()}
        if title is not None:
            changes["title"] = title
        if system_prompt is not None:
            changes["system_prompt"] = system_prompt
        if settings is not None:
            changes["settings"] = _dumps(settings)
        with self._connections.write() as db:
            rows.session_row(db, session_id)
            db["sessions"].update(session_id, changes)
            _bump_version(db, session_id)
            return SessionRecord.from_row(rows.session_row(db, session_id))

    def session_version(self, session_id: SessionId) -> int:
        """The session's version number: 0 when created, +1 with every change to what a tab
        shows of it (a message, a branch switch, an undo mark, its title, a document). One
        indexed read, cheap enough to poll. `SessionNotFound` for a deleted session."""
        with self._connections.read() as db:
            rows.session_row(db, session_id)
            found = rows.one(db, "SELECT version FROM session_versions WHERE session_id = ?", [session_id])
            return found["version"] if found else 0

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
        with self._connections.read() as db:
            params = [term for term in terms for _ in range(2)] + [limit]
            return [SessionRecord.from_row(row) for row in db.query(sql, params)]

    def delete_session(self, session_id: SessionId) -> None:
        """Delete the session, its messages, its spans and files, its prefixes and documents
        that no other session uses."""
        with self._connections.write() as db:
            rows.session_row(db, session_id)
            exclusive = rows.exclusive_prefixes(db, session_id)
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
            db.execute("DELETE FROM session_versions WHERE session_id = ?", [session_id])
            db.execute("DELETE FROM sessions WHERE id = ?", [session_id])
        self._connections.unlink(files)

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
        with self._connections.write() as db:
            session = rows.session_row(db, session_id)
            parent = session["active_leaf_id"] if parent_id is ACTIVE_LEAF else parent_id
            if parent is not None:
                rows.message_row(db, parent, session_id)
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
        with self._connections.write() as db:
            old = rows.message_row(db, message_id)
            return self._insert_message(
                db, old["session_id"], old["parent_id"], old["role"], content, n_tokens, metadata
            )

    def _insert_message(self, db, session_id, parent_id, role, content, n_tokens, metadata) -> MessageRecord:
        now = self._connections.clock()
        row = {
            "id": rows.new_id(),
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
        _bump_version(db, session_id)
        return MessageRecord.from_row(row)

    def get_message(self, message_id: MessageId) -> MessageRecord:
        """The message, or `MessageNotFound`."""
        with self._connections.read() as db:
            return MessageRecord.from_row(rows.message_row(db, message_id))

    def set_message_metadata(self, message_id: MessageId, metadata: dict) -> MessageRecord:
        """Merge `metadata` into the message's metadata (content is never changed)."""
        with self._connections.write() as db:
            row = rows.message_row(db, message_id)
            merged = {**json.loads(row["metadata"]), **metadata}
            db["messages"].update(message_id, {"metadata": _dumps(merged)})
            _bump_version(db, row["session_id"])
            return MessageRecord.from_row({**row, "metadata": _dumps(merged)})

    def path_to(self, message_id: MessageId) -> list[MessageRecord]:
        """Messages from the root down to `message_id`, inclusive."""
        with self._connections.read() as db:
            rows.message_row(db, message_id)
            return rows.message_path(db, message_id)

    def active_path(self, session_id: SessionId) -> list[MessageRecord]:
        """The conversation as shown: root to the session's active leaf ([] when empty)."""
        with self._connections.read() as db:
            leaf = rows.session_row(db, session_id)["active_leaf_id"]
            return rows.message_path(db, leaf) if leaf else []

    def siblings(self, message_id: MessageId) -> list[MessageRecord]:
        """The alternatives at `message_id`'s place (itself included), oldest first."""
        with self._connections.read() as db:
            row = rows.message_row(db, message_id)
            return _children(db, row["session_id"], row["parent_id"])

    def switch_branch(self, message_id: MessageId) -> list[MessageRecord]:
        """Make the newest leaf below `message_id` the active leaf; returns the new active path."""
        with self._connections.write() as db:
            row = rows.message_row(db, message_id)
            leaf = message_id
            while replies := _children(db, row["session_id"], leaf):
                leaf = replies[-1].id
            db["sessions"].update(row["session_id"], {"active_leaf_id": leaf, "updated": self._connections.clock()})
            _bump_version(db, row["session_id"])
            return rows.message_path(db, leaf)

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
        stored segments are kept; `segments` only fill a document that has none). The name
        belongs to the attachment: attached to `session_id`, the record returned carries
        `name`, whatever the shared content was first stored as; the same text attached
        again to the same session is that attachment, renamed.
        """
        specs = [spec if isinstance(spec, SegmentSpec) else SegmentSpec(**spec) for spec in segments]
        _check_segments(specs, len(text))
        digest = hashlib.sha256(text.encode()).hexdigest()
        with self._connections.write() as db:
            if session_id is not None:
                rows.session_row(db, session_id)
            row = next(db["documents"].rows_where("sha256 = ?", [digest]), None)
            if row is None:
                row = {
                    "id": rows.new_id(),
                    "name": name,
                    "sha256": digest,
                    "text": text,
                    "n_chars": len(text),
                    "pages": pages,
                    "n_tokens": n_tokens,
                    "metadata": _dumps(metadata),
                    "created": self._connections.clock(),
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
                self._attach(db, session_id, row["id"], name)
                return DocumentRecord.from_row({**row, "name": name})
            return DocumentRecord.from_row(row)

    def _attach(self, db, session_id, document_id, name: str) -> None:
        ordinal = db.execute(
            "SELECT COUNT(*) FROM session_documents WHERE session_id = ?", [session_id]
        ).fetchone()[0]
        db.execute(
            "INSERT INTO session_documents (session_id, document_id, ordinal, added, name) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (session_id, document_id) DO UPDATE SET name = excluded.name",
            [session_id, document_id, ordinal, self._connections.clock(), name],
        )
        _bump_version(db, session_id)

    def copy_documents(self, source: SessionId, target: SessionId) -> None:
        """Attach `source`'s documents to `target` as they are attached there (same order,
        same attachment rows), after any `target` already has."""
        with self._connections.write() as db:
            rows.session_row(db, source)
            rows.session_row(db, target)
            attached = list(db.query("SELECT * FROM session_documents WHERE session_id = ? ORDER BY ordinal",
                                     [source]))
            have = db.execute("SELECT COUNT(*) FROM session_documents WHERE session_id = ?", [target]).fetchone()[0]
            db["session_documents"].insert_all(
                ({**row, "session_id": target, "ordinal": have + index} for index, row in enumerate(attached)),
                ignore=True)
            _bump_version(db, target)

    def get_document(self, document_id: DocumentId) -> DocumentRecord:
        with self._connections.read() as db:
            return DocumentRecord.from_row(rows.document_row(db, document_id))

    def document_text(self, document_id: DocumentId) -> str:
        with self._connections.read() as db:
            return rows.document_row(db, document_id)["text"]

    def segments(self, document_id: DocumentId) -> list[SegmentRecord]:
        """The document's segments in order."""
        with self._connections.read() as db:
            rows.document_row(db, document_id)
            return [
                SegmentRecord(**row)
                for row in db["segments"].rows_where("document_id = ?", [document_id], order_by="ordinal")
            ]

    def session_documents(self, session_id: SessionId) -> list[DocumentRecord]:
        """Documents attached to the session, in attachment order, each under the name it
        was attached with."""
        with self._connections.read() as db:
            rows.session_row(db, session_id)
            return [DocumentRecord.from_row(row) for row in db.query(_ATTACHED, [session_id])]

    # ------------------------------------------------------------------ export / import

    def export_session(self, session_id: SessionId) -> dict:
        """The session as plain JSON data: session fields, every message of every branch
        (parents referenced by list index), and its documents with text and segments.
        Spans are a cache and are not exported. Contains no database ids."""
        with self._connections.read() as db:
            session = SessionRecord.from_row(rows.session_row(db, session_id))
            messages = [
                MessageRecord.from_row(row)
                for row in db["messages"].rows_where("session_id = ?", [session_id], order_by="rowid")
            ]
            documents = [dict(row) for row in db.query(_ATTACHED, [session_id])]
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
        session_id = SessionId(rows.new_id())
        header = data["session"]
        with self._connections.write() as db:
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
            ids = [MessageId(rows.new_id()) for _ in data["messages"]]
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
                "id": rows.new_id(),
                "n_chars": len(document["text"]),
                "metadata": _dumps(document["metadata"]),
            }
            db["documents"].insert(row)
            db["segments"].insert_all(
                {"document_id": row["id"], "ordinal": ordinal, **segment}
                for ordinal, segment in enumerate(document["segments"])
            )
        self._attach(db, session_id, row["id"], document["name"])


# ----------------------------------------------------------------------------- helpers


def _bump_version(db, session_id: SessionId) -> None:
    db.execute("INSERT INTO session_versions (session_id, version) VALUES (?, 1) "
               "ON CONFLICT(session_id) DO UPDATE SET version = version + 1", [session_id])


def _children(db, session_id, parent_id) -> list[MessageRecord]:
    where, params = ("parent_id = ?", [parent_id]) if parent_id else ("parent_id IS NULL", [])
    found = db["messages"].rows_where(f"session_id = ? AND {where}", [session_id, *params], order_by="rowid")
    return [MessageRecord.from_row(row) for row in found]


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
