"""Sources: the document passages an answer attended to most (DESIGN.md §6).

While a reply decodes, the engine's `AttentionTally` observer adds up the attention each
cached position of the prefix received (spotlight/observe.py: exact probabilities in dense
steps, the selected positions in sparse ones). The rendering (chat/render.py) says which
token range each document segment occupies, so no text is searched or tokenised again.

Within a segment the passage shown is its most attended sentence, scored by its mass over
the square root of its length (so one sharp sentence beats a long one that collects a
little everywhere); segments are ranked by that score, and each `Source` carries its
document's name, the segment's page (PDF) or heading path (DOCX, Markdown), the sentence
and the segment's share of the mass the answer put on all documents.

A source is shown only when it is likely right: its quote shares a salient word (a name, a
number, a word of five letters or more outside a short list of common ones) with the reply.
Attention alone picked unrelated passages under small models' answers (issue #22); a quote
that has none of the answer's words cannot be where the answer came from. `bench.docqa`
measures how often the shown top source holds the answer (`top_source_hit`).
"""
from __future__ import annotations

import re

import numpy as np

from segmenter.segment import paragraphs, sentences
from spotlight import AttentionTally

from .records import Source
from .render import Conversation, Rendering, SegmentRange

TOP_SOURCES = 3
QUOTE_CHARS = 240  # a quoted sentence longer than this is cut with an ellipsis

# Words too common to tie a quote to a reply (five letters or more; shorter words never count).
COMMON_WORDS = frozenset("""
about above after again against along among another answer before being below between could
document during every first found given great their there these thing think those three through
under until where which while whose would write wrote years other since still today never often
people place point right small large world might should shall little before later early
""".split())
_WORD = re.compile(r"[^\W\d_]{5,}|\d+(?:[.,]\d+)*", re.UNICODE)

__all__ = ["SourceTracker", "TOP_SOURCES", "likely_right", "related", "salient_words"]


def salient_words(text: str) -> set[str]:
    """The words of `text` that can tie it to another text: numbers, and words of five letters
    or more (lower-cased) outside COMMON_WORDS."""
    return {w for w in (m.group(0).lower() for m in _WORD.finditer(text)) if w not in COMMON_WORDS}


def related(quote: str, reply: str) -> bool:
    """Whether the quote shares a salient word with the reply (a likely source of it)."""
    return bool(salient_words(quote) & salient_words(reply))


def likely_right(sources: list[Source], reply: str) -> list[Source]:
    """The sources worth showing under `reply`: those `related` to it, in their order."""
    words = salient_words(reply)
    return [source for source in sources if salient_words(source.quote) & words]


class SourceTracker:
    """Sources for one reply over `rendering` of `conversation`: pass `observer` to `engine.stream`."""

    def __init__(self, conversation: Conversation, rendering: Rendering, ranges: list[SegmentRange]):
        self.conversation = conversation
        self.rendering = rendering
        self.ranges = ranges
        self.observer = AttentionTally(max(r.end for r in ranges))

    @classmethod
    def for_rendering(cls, conversation: Conversation, rendering: Rendering) -> "SourceTracker | None":
        """A tracker when the prompt holds document segments (else None)."""
        ranges = [r for r in rendering.segments if r.end <= len(rendering)]
        return cls(conversation, rendering, ranges) if ranges else None

    def sources(self, reply: str | None = None, top: int = TOP_SOURCES) -> list[Source]:
        """The reply's sources (none before its first decode step); with `reply`, only those
        `related` to it."""
        ranked = self.rank(self.observer.mass, top) if self.observer.steps else []
        return ranked if reply is None else likely_right(ranked, reply)

    def rank(self, mass: np.ndarray, top: int = TOP_SOURCES) -> list[Source]:
        """The `top` segments by their best sentence's score under `mass` (attention per
        position, (limit,)), each with that sentence as its quote."""
        cumulative = np.concatenate(([0.0], np.cumsum(mass)))  # (limit + 1,)
        segment_mass = np.array([cumulative[r.end] - cumulative[r.start] for r in self.ranges])
        total = float(segment_mass.sum())
        if total <= 0:
            return []
        best = [self._best_sentence(r, cumulative) for r in self.ranges]
        order = sorted(range(len(self.ranges)), key=lambda i: (-best[i][0], i))[:top]
        return [self._source(self.ranges[i], best[i][1], float(segment_mass[i]) / total)
                for i in order if segment_mass[i] > 0]

    def _best_sentence(self, r: SegmentRange, cumulative: np.ndarray) -> tuple[float, str]:
        """(score, text) of the segment's most attended sentence."""
        text = self.conversation.documents[r.document].text
        best, best_score = text[r.segment.char_start : r.segment.char_end], -1.0
        pieces = [sentence for paragraph in paragraphs(text, r.segment.char_start, r.segment.char_end)
                  for sentence in sentences(text, *paragraph)]
        for start, end in pieces:
            lo = min(max(self.rendering.token_at(r.document, start), r.start), r.end)
            hi = min(max(self.rendering.token_at(r.document, end), lo), r.end)
            if hi > lo:
                score = float(cumulative[hi] - cumulative[lo]) / (hi - lo) ** 0.5
                if score > best_score:
                    best, best_score = text[start:end], score
        return best_score, best

    def _source(self, r: SegmentRange, sentence: str, weight: float) -> Source:
        quote = " ".join(sentence.split())
        if len(quote) > QUOTE_CHARS:
            quote = quote[: QUOTE_CHARS - 1].rstrip() + "…"
        document = self.conversation.documents[r.document]
        return Source(document.name, r.segment.page, r.segment.heading, quote, weight)
