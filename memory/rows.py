"""Row helpers shared by the store's parts (memory/transcript.py and memory/spans.py).

Each takes the `db` of an open transaction (`Connections.read()` / `write()`); none
opens a connection or imports sqlite_utils.
"""

from __future__ import annotations

import uuid

from memory.errors import DocumentNotFound, MessageNotFound, SessionNotFound
from memory.records import MessageRecord


def new_id() -> str:
    return uuid.uuid4().hex


def one(db, sql: str, params: list) -> dict | None:
    """The first row of `sql` as a dict, or None."""
    return next(iter(list(db.query(sql, params))), None)


def session_row(db, session_id) -> dict:
    row = one(db, "SELECT * FROM sessions WHERE id = ?", [session_id])
    if row is None:
        raise SessionNotFound(session_id)
    return row


def message_row(db, message_id, session_id=None) -> dict:
    row = one(db, "SELECT * FROM messages WHERE id = ?", [message_id])
    if row is None or (session_id is not None and row["session_id"] != session_id):
        raise MessageNotFound(message_id, session_id)
    return row


def document_row(db, document_id) -> dict:
    row = one(db, "SELECT * FROM documents WHERE id = ?", [document_id])
    if row is None:
        raise DocumentNotFound(document_id)
    return row


_PATH_SQL = """
WITH RECURSIVE path(id, parent_id, depth) AS (
    SELECT id, parent_id, 0 FROM messages WHERE id = ?
    UNION ALL
    SELECT messages.id, messages.parent_id, path.depth + 1
    FROM messages JOIN path ON messages.id = path.parent_id
)
SELECT messages.* FROM path JOIN messages ON messages.id = path.id ORDER BY path.depth DESC
"""


def message_path(db, leaf_id) -> list[MessageRecord]:
    """Messages from the root down to `leaf_id`, inclusive."""
    return [MessageRecord.from_row(row) for row in db.query(_PATH_SQL, [leaf_id])]


def exclusive_prefixes(db, session_id) -> list[str]:
    """Prefixes linked to this session and to no other."""
    return [
        row[0]
        for row in db.execute(
            "SELECT prefix_hash FROM session_prefixes WHERE session_id = ? AND prefix_hash NOT IN "
            "(SELECT prefix_hash FROM session_prefixes WHERE session_id != ?)",
            [session_id, session_id],
        )
    ]
