"""The store's schema: an ordered list of migrations (the records its rows become: memory/records.py).

`memory/store.py` registers these functions, in this order, in `Migrations("kvstore")`
(sqlite-utils records each applied one in `_sqlite_migrations`) and keeps
`PRAGMA user_version` equal to the number applied. Rules:

- Never edit or reorder a released migration; append a new one.
- Each function receives a sqlite-utils `Database` and runs inside one transaction.
- A database that has applied a migration this list does not know was written by a
  newer Spotlight Chat: the store refuses it (`SchemaTooNew`) before touching it.

This module does not import sqlite_utils (only store.py does); it only calls methods
on the `db` it is given.

Tables (ids are uuid4 hex strings unless noted; times are seconds since the epoch;
JSON columns hold objects):

    sessions          id, title, created, updated, system_prompt, settings JSON, active_leaf_id
    messages          id, session_id, parent_id (NULL for a root), role, content, created,
                      n_tokens, metadata JSON. Never updated except metadata: an edit or a
                      regeneration is a new sibling (same parent).
    documents         id, name, sha256 (unique: content-addressed), text, n_chars, pages,
                      n_tokens, metadata JSON, created
    segments          id (integer), document_id, ordinal, char_start, char_end, page,
                      heading, n_tokens
    session_documents session_id, document_id, ordinal, added, name (m004: the file name
                      the document has in that session; its content is shared)
    session_versions  session_id, version (m005): bumped by every change to the conversation a
                      tab shows (messages, branch, undo marks, title, documents)
    prefixes          hash (sha256 of token ids + fingerprints), model_fp, encoder_fp,
                      prefix_digest (m003), n_tokens, complete, created
    session_prefixes  session_id, prefix_hash, linked: which sessions use a cached prefix
    spans             id, state ('ready' | 'evicted'), file (NULL unless ready), owner
                      ('prefix' | 'message'), prefix_hash | message_id (+ session_id),
                      ordinal, segment_id, model_fp, encoder_fp, prefix_digest (m003),
                      dtype, n_tokens, start_pos, tokens_sha256, bytes, checksum, created,
                      last_used. A span's key (`records.SpanKey`) is model_fp + encoder_fp
                      ("" for dense) + prefix_digest ("" when its K/V depend on no prefix).
    settings          key, value JSON, updated (m004): the app's saved settings
"""

from __future__ import annotations

from memory.records import split_legacy_encoder_fp


def m001_core_tables(db) -> None:
    """Sessions, branch-aware messages, documents and segments, cached prefixes and spans."""
    db["sessions"].create(
        {
            "id": str,
            "title": str,
            "created": float,
            "updated": float,
            "system_prompt": str,
            "settings": str,
            "active_leaf_id": str,
        },
        pk="id",
        not_null={"title", "created", "updated", "system_prompt", "settings"},
    )
    db["messages"].create(
        {
            "id": str,
            "session_id": str,
            "parent_id": str,
            "role": str,
            "content": str,
            "created": float,
            "n_tokens": int,
            "metadata": str,
        },
        pk="id",
        not_null={"session_id", "role", "content", "created", "metadata"},
        foreign_keys=[("session_id", "sessions", "id"), ("parent_id", "messages", "id")],
    )
    db["messages"].create_index(["session_id"])
    db["messages"].create_index(["parent_id"])
    db["documents"].create(
        {
            "id": str,
            "name": str,
            "sha256": str,
            "text": str,
            "n_chars": int,
            "pages": int,
            "n_tokens": int,
            "metadata": str,
            "created": float,
        },
        pk="id",
        not_null={"name", "sha256", "text", "n_chars", "metadata", "created"},
    )
    db["documents"].create_index(["sha256"], unique=True)
    db["segments"].create(
        {
            "id": int,
            "document_id": str,
            "ordinal": int,
            "char_start": int,
            "char_end": int,
            "page": int,
            "heading": str,
            "n_tokens": int,
        },
        pk="id",
        not_null={"document_id", "ordinal", "char_start", "char_end"},
        foreign_keys=[("document_id", "documents", "id")],
    )
    db["segments"].create_index(["document_id", "ordinal"], unique=True)
    db["session_documents"].create(
        {"session_id": str, "document_id": str, "ordinal": int, "added": float},
        pk=("session_id", "document_id"),
        foreign_keys=[("session_id", "sessions", "id"), ("document_id", "documents", "id")],
    )
    db["prefixes"].create(
        {
            "hash": str,
            "model_fp": str,
            "encoder_fp": str,
            "n_tokens": int,
            "complete": int,
            "created": float,
        },
        pk="hash",
        not_null={"model_fp", "encoder_fp", "complete", "created"},
    )
    db["session_prefixes"].create(
        {"session_id": str, "prefix_hash": str, "linked": float},
        pk=("session_id", "prefix_hash"),
        foreign_keys=[("session_id", "sessions", "id"), ("prefix_hash", "prefixes", "hash")],
    )
    db["spans"].create(
        {
            "id": str,
            "state": str,
            "file": str,
            "owner": str,
            "prefix_hash": str,
            "message_id": str,
            "session_id": str,
            "ordinal": int,
            "segment_id": int,
            "model_fp": str,
            "encoder_fp": str,
            "dtype": str,
            "n_tokens": int,
            "start_pos": int,
            "tokens_sha256": str,
            "bytes": int,
            "checksum": str,
            "created": float,
            "last_used": float,
        },
        pk="id",
        not_null={
            "state",
            "owner",
            "ordinal",
            "model_fp",
            "encoder_fp",
            "dtype",
            "n_tokens",
            "start_pos",
            "tokens_sha256",
            "bytes",
            "created",
            "last_used",
        },
        foreign_keys=[
            ("prefix_hash", "prefixes", "hash"),
            ("message_id", "messages", "id"),
            ("session_id", "sessions", "id"),
            ("segment_id", "segments", "id"),
        ],
    )
    db["spans"].create_index(["prefix_hash", "ordinal"], unique=True)
    db["spans"].create_index(["message_id", "model_fp", "encoder_fp", "ordinal"], unique=True)
    db["spans"].create_index(["session_id"])
    db["spans"].create_index(["state", "last_used"])
    db["spans"].create_index(["file"], unique=True)


def m002_full_text_search(db) -> None:
    """FTS5 over session titles and message content, kept current by triggers."""
    db["sessions"].enable_fts(["title"], create_triggers=True)
    db["messages"].enable_fts(["content"], create_triggers=True)


def m003_span_key_columns(db) -> None:
    """Spans and prefixes get an explicit prefix_digest column; the packed encoder_fp
    "<enc or 'dense'>+prefix:<digest>" that chat wrote before becomes encoder_fp <enc>
    ("" for dense) and prefix_digest <digest>. Message span slots become unique per
    (message_id, ordinal, model_fp, encoder_fp, prefix_digest)."""
    for table in ("spans", "prefixes"):
        db[table].add_column("prefix_digest", str, not_null_default="")
        key = "id" if table == "spans" else "hash"
        rows = db.execute(f"SELECT {key}, encoder_fp FROM {table}").fetchall()
        db.conn.executemany(
            f"UPDATE {table} SET encoder_fp = ?, prefix_digest = ? WHERE {key} = ?",
            [(*split_legacy_encoder_fp(encoder_fp), row_id) for row_id, encoder_fp in rows],
        )
    db.execute("DROP INDEX IF EXISTS idx_spans_message_id_model_fp_encoder_fp_ordinal")
    db["spans"].create_index(
        ["message_id", "ordinal", "model_fp", "encoder_fp", "prefix_digest"], unique=True
    )


def m004_attachment_names_and_settings(db) -> None:
    """Each attachment (session x document) gets its own file name, first the document's; and a
    key-value table of the app's settings, so that they survive a restart."""
    db["session_documents"].add_column("name", str, not_null_default="")
    db.execute(
        "UPDATE session_documents SET name = "
        "(SELECT documents.name FROM documents WHERE documents.id = session_documents.document_id)"
    )
    db["settings"].create({"key": str, "value": str, "updated": float}, pk="key", not_null={"value", "updated"})


def m005_session_versions(db) -> None:
    """A version number per session, so a browser tab can tell that it shows an older state
    (a session without a row is at version 0)."""
    db["session_versions"].create({"session_id": str, "version": int}, pk="session_id",
                                  not_null={"version"})


MIGRATIONS = [m001_core_tables, m002_full_text_search, m003_span_key_columns, m004_attachment_names_and_settings,
              m005_session_versions]
