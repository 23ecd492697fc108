"""Uploading files into a conversation: read them (segmenter), attach them, then read them
into the KV cache so the first question is fast. No UI code: progress goes to a callback.

    report = ingest(service, session_id, ["report.pdf"], progress=lambda f, text: ...)
    report.documents   # attached, as DocumentInfo
    report.errors      # (file name, message) for each file that could not be used

A file that cannot be read (unsupported, broken, empty, over the app's byte or token
limit (`AppConfig.uploads`), too large for the context) is reported and skipped; the others
are still attached. The byte limit is checked against the file's size on disk before it is
read; the token limits with a count that stops at the limit. Every uploaded file is deleted
once it has been read or refused (`service.discard_upload`: only files in the app's
short-lived files folder, memory/scratch.py). A document whose cache would not fit the disk
budget or the free disk is refused before it is read (`NotEnoughDisk`). Reading into the cache
can be stopped with `service.stop(session_id)`: what was computed is kept, in memory and, stage
by stage (`AppConfig.checkpoint_tokens`), on disk, so also a crash or a restart part way keeps
it; the rest is read with the next message (or the next resume).

The upload path enters each module once, top to bottom:

    ingest -> segmenter.read_document (text, pages, headings)
           -> service.attach_document -> segment_document (segments, cut once) -> store
           -> service.resume -> turns -> render -> cachesync -> engine.prefill (progress) -> store
"""
from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from segmenter import DEFAULT_MAX_TOKENS, Document, DocumentError, read_document, segment
from spotlight import release_freed_memory

from .errors import ChatError
from .records import DocumentInfo, ResumeReport, SessionId
from .render import DocumentSegment

Progress = Callable[[float, str], None]  # (fraction done in [0, 1], what is happening)
READ_SHARE = 0.1  # of the progress bar: parsing, segmenting and tokenising; the rest is prefill
SEGMENT_TOKENS = DEFAULT_MAX_TOKENS  # tokens per document segment at most (= per prefix span)
_MIN_RATE_SECONDS = 0.5  # measure prefill for this long before showing a rate and time left
COUNT_SLICE_CHARS = 1 << 16  # characters tokenised at a time when counting a document against a limit


@dataclass(slots=True)
class IngestReport:
    documents: list[DocumentInfo] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    resume: ResumeReport | None = None


def segment_document(document: Document, count_tokens: Callable[[str], int]) -> list[DocumentSegment]:
    """The document's segments (segmenter), with the page and heading path of each: cut once,
    at ingest, and stored; every later step (span layout, sources, summaries) reads them."""
    return [DocumentSegment(piece.ordinal, piece.char_start, piece.char_end, piece.page, piece.heading_path,
                            piece.n_tokens)
            for piece in segment(document, count_tokens, max_tokens=SEGMENT_TOKENS)]


def count_tokens_within(count_tokens: Callable[[str], int], text: str, limit: int) -> int | None:
    """The number of tokens of `text`, or None as soon as it exceeds `limit`: counted in slices
    cut at whitespace, so a huge file costs ~`limit` tokens of work and no list of ids at all.
    (A slice edge can merge differently than the whole text; the count is for limits and display.)"""
    total, start = 0, 0
    while start < len(text):
        end = min(len(text), start + COUNT_SLICE_CHARS)
        if end < len(text):
            space = text.rfind(" ", start + COUNT_SLICE_CHARS // 2, end)
            end = space if space > start else end
        total += count_tokens(text[start:end])
        if total > limit:
            return None
        start = end
    return total


def upload(service, session_id: SessionId | None, paths: Sequence[str], progress: Progress | None = None,
           *, tab: str | None = None) -> tuple[SessionId | None, IngestReport]:
    """`ingest` into the conversation, or into a new one when `session_id` is None: a new one
    to which no file could be attached is deleted again (none is left behind, also when
    reading fails). The work belongs to browser tab `tab`: `service.tab_closed(tab)` stops it.
    Returns (the conversation, or None when the new one was deleted; the report)."""
    created, session_id = session_id is None, session_id or service.create().id
    report = None
    try:
        with service.for_tab(tab, session_id):
            report = ingest(service, session_id, paths, progress)
    finally:
        if created and (report is None or not report.documents):
            service.delete(session_id)
    return (None if created and not report.documents else session_id), report


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
            document = read_document(str(path), name, max_bytes=service.config.uploads.max_bytes)
            report.documents.append(service.attach_document(session_id, document))
            report.warnings += list(document.warnings)
        except (DocumentError, ChatError) as error:
            report.errors.append((name, str(error)))
        finally:  # read or refused, the uploaded file is not kept (its text is in the store)
            service.discard_upload(path)
        document = None  # NOTE: a refused file's text is not kept while the others are read
    if report.errors:
        give_back_memory()  # a refused file was read (up to the byte limit): return its buffers to the system
    if prefill and report.documents:
        report.resume = service.resume(session_id, progress=PrefillProgress(progress))
    progress(1.0, "Done")
    return report


def give_back_memory() -> None:
    """Free unreachable objects and hand the C heap's free pages back to the system
    (spotlight.release_freed_memory). After a large file was read and dropped, glibc keeps
    freed buffers of that size in the process (its mmap threshold rises to the largest
    freed buffer), so the resident size would stay tens of MB above what is used."""
    gc.collect()
    release_freed_memory()


class PrefillProgress:
    """Turns the engine's (tokens done, tokens total) into the bar's fraction and a line with
    the measured speed and the time left."""

    def __init__(self, progress: Progress, clock: Callable[[], float] = time.perf_counter):
        self.progress = progress
        self.clock = clock
        self.first: tuple[int, float] | None = None  # (tokens done, when) at the first report

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if self.first is None:
            self.first = (done, now)
        fraction = READ_SHARE + (1 - READ_SHARE) * (done / total if total else 1.0)
        self.progress(fraction, prefill_text(done, total, done - self.first[0], now - self.first[1]))


def prefill_text(done: int, total: int, measured_tokens: int = 0, seconds: float = 0.0) -> str:
    """'Reading 12,288 of 30,000 tokens into memory (310 tokens/s, about 57 s left)': the rate
    is `measured_tokens` over `seconds` (the chunks since the first report, so it is measured,
    not guessed), shown once it was measured for a while."""
    head = f"Reading {done:,} of {total:,} tokens into memory"
    if seconds < _MIN_RATE_SECONDS or measured_tokens <= 0:
        return head
    rate = measured_tokens / seconds
    left = (total - done) / rate
    eta = f"about {left:,.0f} s left" if left >= 1 else "almost done"
    return f"{head} ({rate:,.0f} tokens/s, {eta})"
