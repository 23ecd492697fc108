"""Two-level retrieval over cache spans: pick spans by their code summaries, then tokens.

Shape legend: L layers, H query heads, Hkv KV heads, W packed words, B = 64 W code bit positions,
S spans (Scap allocated), N cached tokens (including the one being decoded), R ranges per head,
T tokens of one span.

A KV cache with key codes in host memory carries a `SpanTable` (`KVCache.spans`): ascending,
disjoint token spans, one per stored memory span (chat/cachesync.py: the prefix cut at document segment
ends, then each chat turn, long parts in fixed-size blocks), each with its own code table (its
range of cache.codes) and a summary per layer and KV head: ones[l, h, s, b], how many of the
span's tokens have code bit b set. Tokens outside every span (the turn being written or
generated, not stored yet) are always scanned exactly.

    tokens:  [ prompt + doc seg 0 | doc seg 1 | ... | turn | turn | new turn, not stored | new ]
               spans: by summary first, then the tokens inside the chosen ones   always scanned

`TwoLevelScan.select` (CodeSelector.select_spans, which SpotlightDecode calls from
`SpotlightConfig.two_level_from` cached tokens on) scores each span by the mean token score
its summary implies (kernels.span_scores), takes per KV head the best spans until their
middle tokens reach `multiple` x the retrieved budget, and runs the flat selection (sinks +
window forced, top `retrieved` by score desc, index asc) over those spans plus every token
outside spans (kernels.ranges_score_select). The flat scan stays the reference: with every
span chosen, both return identical indices.

Summaries follow cache.codes incrementally: `sync(layer, codes, n)` (at select time) counts the
bits of the tokens that arrived since that layer's last sync, so prefill and decode update them
the same way and no step recounts a span; a span read from disk brings its stored summary
(`add(..., ones=)`), which is taken as is. `KVCache.truncate` truncates the table with the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import kernels

_GROW = 64  # span slots are allocated in multiples of this


@dataclass(frozen=True)
class TwoLevelConfig:
    """How widely the two-level scan reads (measured: bench/retrieval.py, two-level part). When it
    runs at all is `SpotlightConfig.two_level_from`."""

    multiple: float = 2.0  # chosen spans cover this multiple of the retrieved budget per KV head

    def __post_init__(self):
        if self.multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {self.multiple}")


def code_summary(codes: np.ndarray) -> np.ndarray:
    """A span's summary: per-bit counts (L, Hkv, B) int32 of its codes (L, Hkv, W, T) uint64."""
    layers, kv_heads, words, n_tokens = codes.shape
    ones = np.zeros((layers, kv_heads, words * 64), np.int32)  # (L, Hkv, B)
    for layer in range(layers):
        kernels.bit_counts(np.ascontiguousarray(codes[layer]), 0, n_tokens, ones[layer])  # (Hkv, B)
    return ones


class SpanTable:
    """Spans of one cache and their per-bit code summaries (plain numpy; device-free)."""

    def __init__(self):
        self.count = 0
        self._starts = np.zeros(_GROW, np.int64)  # (Scap,)
        self._ends = np.zeros(_GROW, np.int64)  # (Scap,)
        self.ones: np.ndarray | None = None  # (L, Hkv, Scap, B) int32, made by bind()
        self.summarized: np.ndarray | None = None  # (L,) int64: tokens [0, summarized[l]) are counted
        self._stale: list[set[int]] = []  # per layer: spans to recount from their start

    def __len__(self) -> int:
        return self.count

    @property
    def starts(self) -> np.ndarray:
        return self._starts[: self.count]  # (S,)

    @property
    def ends(self) -> np.ndarray:
        return self._ends[: self.count]  # (S,)

    def add(self, start: int, end: int, ones: np.ndarray | None = None) -> None:
        """Register the tokens [start, end) as a span; spans come in ascending, disjoint order.

        `ones` (L, Hkv, B) int32: the span's summary when it is known (a span read from disk,
        whose codes are already in the cache); a layer whose counts reach exactly `start` takes
        it as is, any other layer counts the span's codes at its next sync.
        """
        last = int(self._ends[self.count - 1]) if self.count else 0
        if not last <= start < end:
            raise ValueError(f"span [{start}, {end}) must be non-empty and start at or after {last}")
        if self.count == self._starts.size:
            self._grow()
        span = self.count
        self._starts[span], self._ends[span] = start, end
        self.count += 1
        if self.summarized is None:
            return
        for layer in np.flatnonzero(self.summarized > start):  # tokens already counted past its start
            self._stale[layer].add(span)
        if ones is not None:
            assert ones.shape == self.ones[:, :, span].shape, f"summary {ones.shape} for {self.ones.shape}"
            for layer in np.flatnonzero(self.summarized == start):
                self.ones[layer, :, span] = ones[layer]  # (Hkv, B)
                self.summarized[layer] = end

    def cover(self, start: int, end: int, ones: np.ndarray | None = None) -> None:
        """Make [start, end) a span unless it already is one. Spans reaching past `start`
        come from an older layout of those tokens (a reply being regenerated) and are dropped or
        clipped first."""
        at = int(np.searchsorted(self.starts, start))
        if at < self.count and (self._starts[at], self._ends[at]) == (start, end):
            return
        if self.count and self._ends[self.count - 1] > start:
            self.truncate(start)
        self.add(start, end, ones)

    def truncate(self, length: int) -> None:
        """Forget spans and counts from token `length` on (call with KVCache.truncate)."""
        keep = int(np.searchsorted(self.starts, length, side="left"))  # spans starting before length
        if self.ones is not None:
            self.ones[:, :, keep : self.count] = 0
        self.count = keep
        if keep and self._ends[keep - 1] > length:
            self._ends[keep - 1] = length
            if self.summarized is not None:
                for layer in range(len(self._stale)):
                    self._stale[layer].add(keep - 1)
        if self.summarized is not None:
            np.minimum(self.summarized, length, out=self.summarized)
            for stale in self._stale:
                stale.intersection_update(range(keep))

    def lengths(self, n: int) -> np.ndarray:
        """Tokens of each span among the first n: (S,) int64."""
        return np.clip(np.minimum(self.ends, n) - self.starts, 0, None)

    def summary(self, layer: int) -> np.ndarray:
        """ones of one layer: (Hkv, Scap, B) int32 view (the first S spans are valid)."""
        return self.ones[layer]

    def sync(self, layer: int, codes, n: int) -> None:
        """Count the code bits of tokens [summarized[layer], n) of `layer`; codes (Hkv, W, Ncap) uint64."""
        if self.ones is None:
            raise RuntimeError("SpanTable.bind(layers, kv_heads, words) must run before sync")
        done = int(self.summarized[layer])
        for s in self._stale[layer]:  # added behind the watermark or clipped: recount up to it
            self.ones[layer, :, s] = 0
            kernels.bit_counts(codes, int(self._starts[s]), min(int(self._ends[s]), done), self.ones[layer, :, s])
        self._stale[layer].clear()
        if n <= done:
            return
        first = int(np.searchsorted(self.ends, done, side="right"))  # spans ending after `done`
        for s in range(first, self.count):
            if self._starts[s] >= n:
                break
            lo, hi = max(int(self._starts[s]), done), min(int(self._ends[s]), n)
            kernels.bit_counts(codes, lo, hi, self.ones[layer, :, s])  # (Hkv, B) view
        self.summarized[layer] = n

    def bind(self, layers: int, kv_heads: int, words: int) -> None:
        """Allocate the summaries for this cache geometry (once, before the first sync)."""
        self.ones = np.zeros((layers, kv_heads, self._starts.size, words * 64), np.int32)  # (L, Hkv, Scap, B)
        self.summarized = np.zeros(layers, np.int64)
        self._stale = [set() for _ in range(layers)]

    def _grow(self) -> None:
        size = self._starts.size + max(_GROW, self._starts.size)
        self._starts = np.resize(self._starts, size)
        self._ends = np.resize(self._ends, size)
        if self.ones is not None:
            grown = np.zeros(self.ones.shape[:2] + (size,) + self.ones.shape[3:], np.int32)
            grown[:, :, : self.ones.shape[2]] = self.ones
            self.ones = grown


class TwoLevelScan:
    """One two-level selection per call, with its reused buffers (owned by a CodeSelector)."""

    def __init__(self, config: TwoLevelConfig = TwoLevelConfig()):
        self.config = config
        self._ranges = None  # (lo, hi) (Hkv, 2 Scap + 1) int64 and count (Hkv,) int64
        self._span_scores = None  # (Hkv, S) float64

    def select(self, layer: int, q_codes, k_codes, table: SpanTable, n: int, retrieved: int, sinks: int,
               window: int, out: np.ndarray, scratch) -> np.ndarray:
        """int32 (Hkv, K) in the flat layout: q_codes (H, W), k_codes (Hkv, W, Ncap) of `layer`;
        `out` (Hkv, K) and `scratch` (kernels.make_scratch) are the caller's reused buffers."""
        table.sync(layer, k_codes, n)
        layout = kernels.selection_layout(n, retrieved, sinks, window)
        need = max(layout.retrieved, int(np.ceil(self.config.multiple * layout.retrieved)))
        lo, hi, count, scores = self._buffers(k_codes.shape[0], table)
        kernels.span_scores(q_codes, table.summary(layer), table.lengths(n), out=scores)  # (Hkv, S)
        kernels.pick_ranges(scores, table.starts, table.ends, layout.sinks_end, layout.window_start, need, lo, hi, count)
        return kernels.ranges_score_select(q_codes, k_codes, n, lo, hi, count, retrieved, sinks, window, out=out,
                                           scratch=scratch)  # (Hkv, K)

    def _buffers(self, hkv: int, table: SpanTable):
        slots = 2 * table.ones.shape[2] + 1  # at most one gap per span, the span, and the tail
        if self._ranges is None or self._ranges[0].shape != (hkv, slots):
            self._ranges = (np.zeros((hkv, slots), np.int64), np.zeros((hkv, slots), np.int64), np.zeros(hkv, np.int64))
        if self._span_scores is None or self._span_scores.shape != (hkv, len(table)):
            self._span_scores = np.empty((hkv, len(table)), np.float64)  # (Hkv, S): changes when spans do
        return (*self._ranges, self._span_scores)
