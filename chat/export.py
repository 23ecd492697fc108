"""Exports: Markdown for people, JSON (the store's export format) for re-import.

Both are built from `Store.export_session` data: session fields, every message of every
branch (parents as list indexes), documents with their text. The Markdown shows the
visible conversation in order, then every message of the other branches under "Other
branches", so nothing written is left out; documents are listed by name and size (their
text is in the JSON export).
"""
from __future__ import annotations

import json

ROLE_TITLES = {"system": "System", "user": "You", "assistant": "Assistant", "tool": "Tool"}


def to_json(data: dict) -> str:
    """The export as indented JSON text (UTF-8 characters kept as they are)."""
    return json.dumps(data, indent=2, ensure_ascii=False, sort_keys=False)


def from_json(text: str | bytes) -> dict:
    """Parse an export; ValueError (with what is wrong) when it is not JSON."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"the file is not JSON ({error})") from error
    if not isinstance(data, dict):
        raise ValueError("the file holds JSON but not a Spotlight Chat session export (expected an object)")
    return data


def active_indexes(data: dict) -> list[int]:
    """Indexes of the messages on the active branch, root first."""
    messages, index = data["messages"], data["session"]["active_leaf"]
    path = []
    while index is not None:
        path.append(index)
        index = messages[index]["parent"]
    return path[::-1]


def to_markdown(data: dict) -> str:
    """The session as Markdown: title, system prompt, documents, conversation, other branches."""
    session, messages = data["session"], data["messages"]
    lines = [f"# {session['title']}", ""]
    if session["system_prompt"]:
        lines += ["> **System prompt:** " + session["system_prompt"].replace("\n", "\n> "), ""]
    if data["documents"]:
        lines += ["## Documents", ""]
        lines += [f"- {d['name']} ({len(d['text']):,} characters)" for d in data["documents"]]
        lines.append("")
    active = active_indexes(data)
    lines += ["## Conversation", ""]
    for index in active:
        lines += _message(messages[index])
    others = [i for i in range(len(messages)) if i not in set(active)]
    if others:
        lines += ["## Other branches", ""]
        for index in others:
            parent = messages[index]["parent"]
            where = "a new start" if parent is None else f"a reply to message {parent + 1}"
            lines += [f"*Message {index + 1}, {where}:*", ""] + _message(messages[index])
    return "\n".join(lines).rstrip() + "\n"


def _message(message: dict) -> list[str]:
    title = ROLE_TITLES.get(message["role"], message["role"].title())
    note = " *(undone)*" if message["metadata"].get("undone") else ""
    return [f"**{title}**{note}", "", message["content"], ""]
