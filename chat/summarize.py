"""Summarising a conversation's documents (`ChatService.summarize`).

One pass when the conversation plus "Summarize the document." plus a reply fits the
model's window: the request goes through the normal send path (cached prefix, sources,
stored reply). Otherwise map-reduce: the documents are cut into segments (segmenter),
packed into groups that fit with room for a reply, each group is summarised on a
throwaway context, then the part summaries are summarised; the answer says so and
progress goes to `turn.notices` (one notice per part) and the optional callback.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from segmenter import Document, segment

REQUEST = "Summarize the document."
PART_PROMPT = "Summarize this part ({index} of {total}) of the document {name!r}:\n\n{text}"
REDUCE_PROMPT = "These are summaries of the consecutive parts of a document. Write one summary of the whole document.\n\n{text}"

Progress = Callable[[int, int, str], None]  # (parts done, parts total, what is happening)


def plan_groups(engine, documents: list[tuple[str, str]], budget: int) -> list[tuple[str, str]]:
    """(document name, text) groups of consecutive segments of at most `budget` tokens."""
    groups: list[tuple[str, str]] = []
    count = lambda s: len(engine.encode(s))  # noqa: E731
    for name, text in documents:
        pieces = segment(Document(name, "txt", text), count, max_tokens=max(16, budget), min_tokens=0)
        current, used = [], 0
        for piece in pieces:
            if current and used + piece.n_tokens > budget:
                groups.append((name, "".join(current)))
                current, used = [], 0
            current.append(piece.text)
            used += piece.n_tokens
        if current:
            groups.append((name, "".join(current)))
    return groups


def generate(engine, messages: list[dict], sampling, cancel=None) -> str:
    """One reply on a throwaway context (nothing is cached or stored)."""
    ids = engine.chat_ids(messages, add_generation_prompt=True)
    context = engine.new_context(len(ids) + sampling.max_new_tokens + 8)
    text = ""
    for step in engine.stream(context, ids, sampling, cancel=cancel):
        text += step.text
    return text.strip()


def map_reduce(engine, sampling, system_prompt: str, documents: list[tuple[str, str]], turn,
               cancel=None, progress: Progress | None = None) -> Iterator:
    """Fill `turn` with a map-reduce summary; yields `turn` after each part."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    longest = max((name for name, _ in documents), key=len, default="")
    frame = engine.chat_ids(system + [{"role": "user", "content": PART_PROMPT.format(
        index=999, total=999, name=longest, text="")}], add_generation_prompt=True)
    room = engine.max_context - sampling.max_new_tokens - len(frame) - 8
    groups = plan_groups(engine, documents, max(16, room))
    parts = []
    for index, (name, text) in enumerate(groups, 1):
        if cancel is not None and cancel.is_set():
            break
        prompt = PART_PROMPT.format(index=index, total=len(groups), name=name, text=text)
        parts.append(generate(engine, system + [{"role": "user", "content": prompt}], sampling, cancel))
        turn.notices.append(f"Summarised part {index} of {len(groups)}")
        if progress is not None:
            progress(index, len(groups) + 1, f"part {index} of {len(groups)}")
        yield turn
    joined = "\n\n".join(f"Part {i}: {p}" for i, p in enumerate(parts, 1))
    joined = engine.decode(engine.encode(joined)[: max(16, room)])  # the summaries must fit too
    final = generate(engine, system + [{"role": "user", "content": REDUCE_PROMPT.format(text=joined)}],
                     sampling, cancel) if parts else ""
    if progress is not None:
        progress(len(groups) + 1, len(groups) + 1, "combining the parts")
    turn.text = (f"Summary (map-reduce over {len(groups)} parts, the document exceeds the context window)\n\n"
                 f"{final}")
    turn.finish = "cancelled" if cancel is not None and cancel.is_set() else "stop"
