"""Summarising a conversation's documents (`ChatService.summarize`).

One pass when the conversation plus "Summarize the document." plus a reply fits the
model's window: the request goes through the normal send path (cached prefix, sources,
stored reply). Otherwise map-reduce: the documents' stored segments (cut once at ingest,
chat/documents.py) are packed into groups that fit with room for a reply, each group is
summarised on a throwaway context, then the part summaries are summarised; the answer says
so and progress goes to `turn.notices` (one notice per part) and the optional callback.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .render import AttachedDocument

REQUEST = "Summarize the document."
PART_PROMPT = "Summarize this part ({index} of {total}) of the document {name!r}:\n\n{text}"
REDUCE_PROMPT = "These are summaries of the consecutive parts of a document. Write one summary of the whole document.\n\n{text}"

Progress = Callable[[int, int, str], None]  # (parts done, parts total, what is happening)


def plan_groups(documents: Sequence[AttachedDocument], budget: int, count_tokens) -> list[tuple[str, str]]:
    """(document name, text) groups of consecutive segments of at most `budget` tokens; a
    segment longer than the budget alone is cut to it (`count_tokens` counts a segment whose
    count was not stored)."""
    groups: list[tuple[str, str]] = []
    for document in documents:
        current, used = [], 0
        for piece in document.segments:
            n = piece.n_tokens if piece.n_tokens is not None else count_tokens(document.text[piece.char_start:piece.char_end])
            if current and used + n > budget:
                groups.append((document.name, "".join(current)))
                current, used = [], 0
            current.append(document.text[piece.char_start:piece.char_end])
            used += n
        if current:
            groups.append((document.name, "".join(current)))
    return groups


def generate(engine, messages: list[dict], sampling, cancel=None, observers=()) -> str:
    """One reply on a throwaway context (nothing is cached or stored)."""
    ids = engine.chat_ids(messages, add_generation_prompt=True)
    context = engine.new_context(len(ids) + sampling.max_new_tokens + 8)
    text = ""
    for step in engine.stream(context, ids, sampling, cancel=cancel, observers=observers):
        text += step.text
    return text.strip()


def map_reduce(engine, sampling, system_prompt: str, documents: Sequence[AttachedDocument], turn,
               cancel=None, progress: Progress | None = None, observers=()) -> Iterator:
    """Fill `turn` with a map-reduce summary; yields `turn` after each part."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    longest = max((document.name for document in documents), key=len, default="")
    frame = engine.chat_ids(system + [{"role": "user", "content": PART_PROMPT.format(
        index=999, total=999, name=longest, text="")}], add_generation_prompt=True)
    room = engine.native_window - sampling.max_new_tokens - len(frame) - 8  # each part within the model's window
    groups = plan_groups(documents, max(16, room), engine.count_tokens)
    parts = []
    for index, (name, text) in enumerate(groups, 1):
        if cancel is not None and cancel.is_set():
            break
        prompt = PART_PROMPT.format(index=index, total=len(groups), name=name, text=text)
        parts.append(generate(engine, system + [{"role": "user", "content": prompt}], sampling, cancel, observers))
        turn.notices.append(f"Summarised part {index} of {len(groups)}")
        if progress is not None:
            progress(index, len(groups) + 1, f"part {index} of {len(groups)}")
        yield turn
    joined = "\n\n".join(f"Part {i}: {p}" for i, p in enumerate(parts, 1))
    joined = engine.decode(engine.encode(joined)[: max(16, room)])  # the summaries must fit too
    final = generate(engine, system + [{"role": "user", "content": REDUCE_PROMPT.format(text=joined)}],
                     sampling, cancel, observers) if parts else ""
    if progress is not None:
        progress(len(groups) + 1, len(groups) + 1, "combining the parts")
    turn.text = (f"Summary (map-reduce over {len(groups)} parts, the document exceeds the context window)\n\n"
                 f"{final}")
    turn.finish = "cancelled" if cancel is not None and cancel.is_set() else "stop"
