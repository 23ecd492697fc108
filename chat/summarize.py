"""Summarising a conversation's documents (`ChatService.summarize`).

A summary is a request of its own over the documents: it is rendered with the system prompt,
the documents and the summary instruction only (`request`), never after the conversation's
turns, and may run to `AppConfig.summary_tokens` tokens (longer than a reply). One pass when
that rendering plus at least MIN_TOKENS of summary fits the model's window: it reads the
documents' cached prefix (chat/turns.py, `ReplyPlan.prefix_only`). Otherwise map-reduce: the
documents' stored segments (cut once at ingest, chat/documents.py) are packed into groups that
fit with room for a reply, each group is summarised on a throwaway context, then the part
summaries are summarised; the answer says so and progress goes to `turn.notices` (one notice
per part) and the optional callback. Either way the request, naming the documents, and the
summary are stored in the conversation.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from .render import AttachedDocument, Conversation

MIN_TOKENS = 128  # a one-pass summary shorter than this would be cut: map-reduce instead
PART_PROMPT = "Summarize this part ({index} of {total}) of the document {name!r}:\n\n{text}"
REDUCE_PROMPT = "These are summaries of the consecutive parts of a document. Write one summary of the whole document.\n\n{text}"

Progress = Callable[[int, int, str], None]  # (parts done, parts total, what is happening)


def request(names: Sequence[str]) -> str:
    """The summary instruction, naming the documents (it is also the message the conversation shows)."""
    if len(names) == 1:
        return f'Summarize the document "{names[0]}".'
    return "Summarize the documents " + ", ".join(f'"{name}"' for name in names) + "."


def conversation(system_prompt: str, documents: Sequence[AttachedDocument]) -> Conversation:
    """What a one-pass summary renders: the documents and the instruction, no earlier turn."""
    return Conversation(system_prompt, tuple(documents), (("user", request([d.name for d in documents])),))


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
               cancel=None, progress: Progress | None = None, observers=(), *,
               summary_tokens: int | None = None) -> Iterator:
    """Fill `turn` with a map-reduce summary; yields `turn` after each part. Each part's summary
    runs to `sampling.max_new_tokens`; the final one to `summary_tokens` (default: the same), at
    most half of what the window leaves beside the request, so the part summaries fit too."""
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
    final_tokens = min(summary_tokens or sampling.max_new_tokens,
                       max(sampling.max_new_tokens, (engine.native_window - len(frame)) // 2))
    joined = "\n\n".join(f"Part {i}: {p}" for i, p in enumerate(parts, 1))
    joined = engine.decode(engine.encode(joined)[: max(16, engine.native_window - final_tokens - len(frame) - 8)])
    final = generate(engine, system + [{"role": "user", "content": REDUCE_PROMPT.format(text=joined)}],
                     replace(sampling, max_new_tokens=final_tokens), cancel, observers) if parts else ""
    if progress is not None:
        progress(len(groups) + 1, len(groups) + 1, "combining the parts")
    turn.text = (f"Summary (map-reduce over {len(groups)} parts, the document exceeds the context window)\n\n"
                 f"{final}")
    turn.finish = "cancelled" if cancel is not None and cancel.is_set() else "stop"
