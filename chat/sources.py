"""Sources: the document segments an answer attended to most (DESIGN.md §6).

While a reply decodes, `AttentionTally` wraps the engine's decode policy and, at every
decode step, adds up the attention each cached position received in a few layers:

* dense decode: the exact softmax probabilities of the step's query heads over all
  cached keys (recomputed for `layers` only: a handful of layers of the second half of
  the model, ~1/8 of one decode step's attention work for SmolLM2-135M);
* Spotlight decode: the positions each kv-head selected (`StepRecord.selected`), each
  selection counting 1/(Hkv*K) of the step's mass (the layers Spotlight runs densely
  fall back to the exact probabilities).

`SourceTracker` maps positions to document segments: the documents are parsed back out
of the rendered system message (chat/render.py's DOCUMENT_FORMAT), cut by the segmenter,
and each segment's character range becomes a token range of the rendered prefix by
tokenising the system text up to its boundaries (exact for byte tokenizers, off by at
most a merge at the boundary for BPE). The top segments by mass are the `Source`s.
"""
from __future__ import annotations

import hashlib
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from segmenter import Document, Segment, segment
from segmenter.segment import sentences

from spotlight.observers import tally_layers

from .documents import token_offsets
from .records import Source

TOP_SOURCES = 3
SEGMENT_TOKENS = 128  # max tokens of a source segment: a passage short enough to quote
_CACHE_DOCUMENTS = 16
_DOCUMENT = re.compile(r'<document name="(?P<name>[^"\n]*)">\n(?P<text>.*?)\n</document>', re.S)

__all__ = ["AttentionTally", "SourceTracker", "tally_layers", "top_sources"]


class AttentionTally:
    """A decode policy proxy: delegates everything to `inner`, and for each decode step of
    `layers` adds the attention mass of the step's query to `mass[position]` for the first
    `limit` cached positions (the prefix holding the documents)."""

    def __init__(self, inner, layers: list[int], limit: int):
        self.inner = inner
        self.layers = set(layers)
        self.limit = limit
        self.mass = np.zeros(limit, dtype=np.float64)
        self.steps = 0
        self._record_before = getattr(inner, "record", None)
        self._selects = hasattr(inner, "record") and hasattr(inner, "is_dense")
        if self._selects:
            from spotlight.attention import StepRecord

            inner.record = StepRecord()

    def __getattr__(self, name):  # code_words, attend, config, ...
        return getattr(self.inner, name)

    def restore(self) -> None:
        if self._selects:
            self.inner.record = self._record_before

    def on_new_tokens(self, layer, q, k, cache) -> None:
        self.inner.on_new_tokens(layer, q, k, cache)

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        out = self.inner.decode(layer, q, cache)
        if layer in self.layers:
            try:
                self._add(layer, q, cache)
            except Exception:  # sources are a nicety: never break a reply over them
                self.layers.discard(layer)
        return out

    def _add(self, layer: int, q: torch.Tensor, cache) -> None:
        n = cache.length + 1
        limit = min(n, self.limit)
        if layer == max(self.layers):
            self.steps += 1
        if self._selects and not self.inner.is_dense(layer, n):
            selected = (self.inner.record.selected or {}).get(layer)
            if selected is not None:
                idx = np.asarray(selected).reshape(-1)
                weight = 1.0 / max(1, idx.size)
                idx = idx[(idx >= 0) & (idx < limit)]
                np.add.at(self.mass, idx, weight)
                return
        keys = cache.keys(layer, 1).float()  # (Hkv, N, D)
        H, D = q.shape[0], q.shape[-1]
        Hkv = keys.shape[0]
        query = q[:, 0].float().reshape(Hkv, H // Hkv, D)  # (Hkv, G, D)
        scores = torch.einsum("hgd,hnd->hgn", query, keys) / math.sqrt(D)  # (Hkv, G, N)
        probs = scores.softmax(-1).sum((0, 1)) / H  # (N,): the mass of an average head
        self.mass[:limit] += probs[:limit].double().numpy()


@dataclass(slots=True, frozen=True)
class _Span:
    """A document segment at token positions [start, end) of the rendered prompt."""

    name: str
    segment: Segment
    start: int
    end: int
    offset: int  # where the document text starts in the system text


_segment_cache: OrderedDict[str, list[Segment]] = OrderedDict()
_segment_lock = threading.Lock()
_span_cache: OrderedDict[str, list[_Span]] = OrderedDict()  # rendered system text -> its segment spans


def _spans(engine, system: str, documents, base: int) -> list[_Span]:
    """Token ranges (relative to the prompt) of every segment of every document."""
    spans = []
    _, tokens_before = token_offsets(engine, system)  # one tokeniser pass with offsets, not two per segment
    for match in documents:
        offset = match.start("text")
        for piece in document_segments(engine, match["name"], match["text"]):
            start = base + tokens_before(offset + piece.char_start)
            end = base + tokens_before(offset + piece.char_end)
            if end > start:
                spans.append(_Span(match["name"], piece, start, end, offset))
    return spans


def document_segments(engine, name: str, text: str) -> list[Segment]:
    """The segmenter's cut of a document (memoised by content: segmenting costs a few
    tokeniser passes)."""
    key = hashlib.sha1(f"{engine.fingerprint}\0{name}\0{text}".encode()).hexdigest()
    with _segment_lock:
        if key in _segment_cache:
            _segment_cache.move_to_end(key)
            return _segment_cache[key]
    segments = segment(Document(name, "txt", text), lambda s: len(engine.encode(s)),
                       max_tokens=SEGMENT_TOKENS, min_tokens=min(32, SEGMENT_TOKENS))
    with _segment_lock:
        _segment_cache[key] = segments
        while len(_segment_cache) > _CACHE_DOCUMENTS:
            _segment_cache.popitem(last=False)
    return segments


def _locate(needle: list[int], haystack: list[int], within: int = 64) -> int | None:
    probe = needle[: min(8, len(needle))]
    if not probe:
        return None
    for at in range(0, min(within, len(haystack) - len(probe) + 1)):
        if haystack[at : at + len(probe)] == probe:
            return at
    return None


class SourceTracker:
    """Sources for one reply: segment token ranges of the prompt and the attention tally."""

    def __init__(self, engine, spans: list[_Span], limit: int):
        self.engine = engine
        self.spans = spans
        self.limit = limit
        self.tally: AttentionTally | None = None

    @classmethod
    def for_prompt(cls, engine, system: str, prompt: list[int]) -> "SourceTracker | None":
        """A tracker when the system message holds documents (else None)."""
        documents = list(_DOCUMENT.finditer(system or ""))
        if not documents or not hasattr(engine, "policy"):
            return None
        system_ids = engine.encode(system)
        base = _locate(system_ids, prompt)
        if base is None:
            return None
        key = hashlib.sha1(f"{engine.fingerprint}\0{base}\0{system}".encode()).hexdigest()
        with _segment_lock:
            spans = _span_cache.get(key)
        if spans is None:
            spans = _spans(engine, system, documents, base)
            with _segment_lock:
                _span_cache[key] = spans
                while len(_span_cache) > _CACHE_DOCUMENTS:
                    _span_cache.popitem(last=False)
        spans = [span for span in spans if span.start < len(prompt)]
        if not spans:
            return None
        tracker = cls(engine, spans, max(span.end for span in spans))
        tracker.system, tracker.base = system, base
        return tracker

    def start(self) -> None:
        """Wrap the engine's policy (call under the engine gate)."""
        self.tally = AttentionTally(self.engine.policy, tally_layers(self.engine.args.n_layers), self.limit)
        self.engine.policy = self.tally

    def stop(self) -> None:
        if self.tally is not None and self.engine.policy is self.tally:
            self.engine.policy = self.tally.inner
            self.tally.restore()

    def sources(self, top: int = TOP_SOURCES) -> list[Source]:
        if self.tally is None or not self.tally.steps:
            return []
        mass = self.tally.mass
        per_span = np.array([mass[span.start : span.end].sum() for span in self.spans])
        return top_sources(self.spans, per_span, top, self._quote)

    def _quote(self, span: _Span) -> str:
        """The segment's most attended sentence (a segment can hold several paragraphs),
        else its opening (`Segment.quote`)."""
        seg, mass = span.segment, self.tally.mass
        best, best_mass = None, 0.0
        for start, end in sentences(seg.text, 0, len(seg.text)):
            at = self.base + span.offset + seg.char_start
            lo = self.base + len(self.engine.encode(self.system[: at - self.base + start]))
            hi = self.base + len(self.engine.encode(self.system[: at - self.base + end]))
            share = float(mass[lo:hi].sum()) / max(1, hi - lo) ** 0.5
            if hi > lo and share > best_mass:
                best, best_mass = seg.text[start:end], share
        if best is None:
            return seg.quote()
        quote = " ".join(best.split())
        return quote if len(quote) <= 240 else quote[:239].rstrip() + "…"


def top_sources(spans: list[_Span], per_span: np.ndarray, top: int = TOP_SOURCES, quote=None) -> list[Source]:
    """The `top` spans by mass, as Sources whose weights are shares of the total."""
    total = float(per_span.sum())
    if total <= 0:
        return []
    order = np.argsort(-per_span, kind="stable")[:top]
    return [Source(spans[i].name, spans[i].segment.page, spans[i].segment.heading_path,
                   (quote or (lambda span: span.segment.quote()))(spans[i]), float(per_span[i]) / total)
            for i in order if per_span[i] > 0]
