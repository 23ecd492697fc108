"""Uploading files into a conversation: read them (segmenter), attach their text, then read
them into the KV cache so the first question is fast. No UI code: progress goes to a callback.

    report = ingest(service, session_id, ["report.pdf"], progress=lambda f, text: ...)
    report.documents   # attached, as DocumentInfo
    report.errors      # (file name, message) for each file that could not be used

A file that cannot be read (unsupported, broken, empty, too large for the context) is
reported and skipped; the others are still attached. Reading into the cache can be
stopped with `service.stop(session_id)`: what was computed is kept, the rest is computed
with the next message.

Segments (DESIGN.md §6). Attached documents are rendered, in order, into the conversation's
prefix (chat/render.py) and prefilled in order. `segment_ends` finds where each document's
semantic segments (segmenter, at most `SEGMENT_TOKENS` tokens) end in the rendered prefix
ids; chat/kv.py cuts the prefix there, so each segment is stored as its own span (its
K/V, its code table and the summary of its codes) and becomes one segment of the KV
cache's segment table, the unit two-level retrieval picks first.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from segmenter import DEFAULT_MAX_TOKENS, Document, DocumentError, read_document, segment

from .errors import ChatError
from .records import DocumentInfo, ResumeReport, SessionId

Progress = Callable[[float, str], None]  # (fraction done in [0, 1], what is happening)
READ_SHARE = 0.3  # of the progress bar: parsing and tokenising; the rest is prefill
PREFILL_TOKENS_PER_SECOND = 250.0  # first ETA guess: SmolLM2 fp32 on 2 CPU threads (218-342 tok/s)
POLL_SECONDS = 0.25
SEGMENT_TOKENS = DEFAULT_MAX_TOKENS  # tokens per retrieval segment at most (= per document span)


@dataclass(slots=True)
class IngestReport:
    documents: list[DocumentInfo] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    resume: ResumeReport | None = None


def ingest(service, session_id: SessionId, paths: Sequence[str], progress: Progress | None = None,
           *, prefill: bool = True) -> IngestReport:
    """Attach every readable file in `paths` to the conversation, then (if `prefill`) read
    the conversation into the KV cache. Never raises for a bad file; see `IngestReport`."""
    progress = progress or (lambda fraction, text: None)
    report = IngestReport()
    for index, path in enumerate(paths):
        name = os.path.basename(str(path))
        progress(READ_SHARE * index / max(1, len(paths)), f"Reading {name}")
        try:
            document = read_document(str(path), name)
            report.documents.append(service.attach_text(session_id, document.name, document.text,
                                                        pages=document.page_count))
            report.warnings += list(document.warnings)
        except (DocumentError, ChatError) as error:
            report.errors.append((name, str(error)))
    if prefill and report.documents:
        report.resume = _resume_with_progress(service, session_id, report.documents, progress)
    progress(1.0, "Done")
    return report


def _resume_with_progress(service, session_id: SessionId, documents: list[DocumentInfo],
                          progress: Progress) -> ResumeReport:
    """Run `service.resume` in a thread and report an estimated fraction and ETA meanwhile
    (the service reports no prefill progress of its own yet)."""
    tokens = sum(d.n_tokens or d.n_chars // 4 for d in documents)
    expected = max(0.5, tokens / PREFILL_TOKENS_PER_SECOND)
    outcome: dict = {}

    def run():
        try:
            outcome["report"] = service.resume(session_id)
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=run, name=f"ingest-{session_id}", daemon=True)
    started = time.perf_counter()
    worker.start()
    while worker.is_alive():
        elapsed = time.perf_counter() - started
        share = min(0.95, elapsed / expected)
        left = max(0.0, expected - elapsed)
        eta = f"about {left:.0f} s left" if left >= 1 else "almost done"
        progress(READ_SHARE + (1 - READ_SHARE) * share,
                 f"Reading {tokens:,} tokens into memory ({eta}, estimated)")
        worker.join(POLL_SECONDS)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["report"]


# ----------------------------------------------------------------------------- segments


def segment_ends(engine, texts: Sequence[str], prefix_ids: Sequence[int]) -> list[int]:
    """Positions in `prefix_ids` (the rendered prefix) where a segment of one of the documents
    `texts` ends, ascending. Each document is found by its token ids, searched in order after
    the previous one; its first and last token may differ in the rendering (a tokenizer can
    merge across the document's edges), so only the others must match. A document that is
    not found contributes nothing (its tokens then go with their neighbours' spans)."""
    ends: list[int] = []
    prefix_ids, position = list(prefix_ids), 0
    for text in texts:
        ids, tokens_before = token_offsets(engine, text)
        at = _find(ids[1:-1], prefix_ids, position + 1)
        if at is None:
            continue
        base = at - 1  # where the document's first token is
        for piece in segment(Document("document", "txt", text), lambda s: len(engine.encode(s)),
                             max_tokens=SEGMENT_TOKENS):
            end = base + tokens_before(piece.char_end)
            if end > (ends[-1] if ends else base):
                ends.append(end)
        position = base + len(ids)
    return ends


def token_offsets(engine, text: str):
    """(token ids of `text`, char position -> how many of those tokens start before it)."""
    ids, starts = engine.token_offsets(text)  # one tokenizer pass
    return ids, lambda char: bisect.bisect_left(starts, char)


def _find(needle: Sequence[int], haystack: Sequence[int], start: int) -> int | None:
    """First index >= start where `needle` occurs in `haystack`; None if none (or `needle` is empty)."""
    if not needle:
        return None
    first, size = needle[0], len(needle)
    at = start
    while True:
        try:
            at = haystack.index(first, at, len(haystack) - size + 1)
        except ValueError:
            return None
        if haystack[at : at + size] == needle:
            return at
        at += 1
