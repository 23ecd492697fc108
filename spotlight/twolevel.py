"""Two-level retrieval over document segments: pick segments by their code summaries, then tokens.

Shape legend: L layers, H query heads, Hkv KV heads, W packed words, B = 64 W code bit positions,
S segments (Scap allocated), N cached tokens (including the one being decoded), R ranges per head.

A cache holding long documents carries a `SegmentTable`: its segments are ascending, disjoint
token spans (one document segment each, i.e. one memory span) with their own code table (their
range of cache.codes) and a summary per layer and KV head: ones[l, h, s, b], how many of the
segment's tokens have code bit b set. Tokens outside every segment (system prompt, chat turns)
are always scanned exactly.

    tokens:  [ prompt | seg 0 | seg 1 | ... | seg S-1 | chat turns ...... | new ]
               always   by summary first, then tokens   always (window: forced)

`TwoLevelSelector` (above `TwoLevelConfig.min_tokens` cached tokens, with segments) scores each
segment by the mean token score its summary implies (kernels.segment_scores), takes per KV head
the best segments until their middle tokens reach `multiple` x the retrieved budget, and runs the
flat selection (sinks + window forced, top `retrieved` by score desc, index asc) over those
segments plus every token outside segments (kernels.ranges_score_select). Below the threshold,
or with no segments, it is the flat CodeSelector, which stays the reference: with every segment
chosen, both return identical indices.

Summaries follow cache.codes lazily: `sync(layer, codes, n)` (called at select time) counts the
bits of tokens that arrived since the last sync of that layer, so prefill, decode and
`cache.load` all update them the same way; `truncate(m)` must be called with the cache's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import kernels

from .attention import CodeSelector
from .hashing import Encoders

_GROW = 64  # segment slots are allocated in multiples of this


@dataclass(frozen=True)
class TwoLevelConfig:
    """When and how widely the two-level selector scans (measured: bench/retrieval.py, two-level part)."""

    min_tokens: int = 65536  # below this many cached tokens the flat scan is cheap enough: use it
    multiple: float = 2.0  # chosen segments cover this multiple of the retrieved budget per KV head

    def __post_init__(self):
        if self.multiple < 1 or self.min_tokens < 0:
            raise ValueError(f"multiple must be >= 1 and min_tokens >= 0, got {self.multiple}, {self.min_tokens}")


class SegmentTable:
    """Segments of one cache and their per-bit code summaries (plain numpy; device-free)."""

    def __init__(self):
        self.count = 0
        self._starts = np.zeros(_GROW, np.int64)  # (Scap,)
        self._ends = np.zeros(_GROW, np.int64)  # (Scap,)
        self.ones: np.ndarray | None = None  # (L, Hkv, Scap, B) int32, made at the first sync
        self.summarized: np.ndarray | None = None  # (L,) int64: tokens [0, summarized[l]) are counted
        self._stale: list[set[int]] = []  # per layer: segments to recount from their start

    def __len__(self) -> int:
        return self.count

    @property
    def starts(self) -> np.ndarray:
        return self._starts[: self.count]  # (S,)

    @property
    def ends(self) -> np.ndarray:
        return self._ends[: self.count]  # (S,)

    def add(self, start: int, end: int) -> None:
        """Register the span [start, end) as a segment; spans come in ascending, disjoint order."""
        last = int(self._ends[self.count - 1]) if self.count else 0
        if not last <= start < end:
            raise ValueError(f"segment [{start}, {end}) must be non-empty and start at or after {last}")
        if self.count == self._starts.size:
            self._grow()
        self._starts[self.count], self._ends[self.count] = start, end
        if self.summarized is not None:  # tokens already counted past its start: recount it
            for layer in np.flatnonzero(self.summarized > start):
                self._stale[layer].add(self.count)
        self.count += 1

    def truncate(self, length: int) -> None:
        """Forget segments and counts from token `length` on (call with KVCache.truncate)."""
        keep = int(np.searchsorted(self.starts, length, side="left"))  # segments starting before length
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
        """Tokens of each segment among the first n: (S,) int64."""
        return np.clip(np.minimum(self.ends, n) - self.starts, 0, None)

    def summary(self, layer: int) -> np.ndarray:
        """ones of one layer: (Hkv, Scap, B) int32 view (the first S segments are valid)."""
        return self.ones[layer]

    def sync(self, layer: int, codes, n: int) -> None:
        """Count the code bits of tokens [summarized[layer], n) of `layer`; codes (Hkv, W, Ncap) uint64."""
        if self.ones is None:
            raise RuntimeError("SegmentTable.bind(layers, kv_heads, words) must run before sync")
        done = int(self.summarized[layer])
        for s in self._stale[layer]:  # added behind the watermark or clipped: recount up to it
            self.ones[layer, :, s] = 0
            kernels.bit_counts(codes, int(self._starts[s]), min(int(self._ends[s]), done), self.ones[layer, :, s])
        self._stale[layer].clear()
        if n <= done:
            return
        first = int(np.searchsorted(self.ends, done, side="right"))  # segments ending after `done`
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


class TwoLevelSelector(CodeSelector):
    """Spotlight codes, scanning only the best segments (and every token outside segments).

    The cache's segments come from `cache.segments` (a SegmentTable; none: the flat scan).
    Returned selections are reused buffers, as CodeSelector's.
    """

    def __init__(self, encoders: Encoders, config: TwoLevelConfig = TwoLevelConfig()):
        super().__init__(encoders)
        self.config = config
        self._ranges = None  # (lo, hi) (Hkv, 2 Scap + 1) int64 and count (Hkv,) int64
        self._segment_scores = None  # (Hkv, S) float64

    def select(self, layer, q, cache, n, retrieved, sinks, window):
        table: SegmentTable | None = getattr(cache, "segments", None)
        if table is None or not len(table) or n < self.config.min_tokens or not isinstance(cache.codes, np.ndarray):
            return super().select(layer, q, cache, n, retrieved, sinks, window)
        q_codes = self.query_codes(layer, q)  # (H, W)
        k_codes = cache.codes[layer]  # (Hkv, W, Ncap)
        if table.ones is None:
            table.bind(cache.args.n_layers, k_codes.shape[0], k_codes.shape[1])
        table.sync(layer, k_codes, n)
        layout = kernels.selection_layout(n, retrieved, sinks, window)
        need = max(layout.retrieved, int(np.ceil(self.config.multiple * layout.retrieved)))
        lo, hi, count, scores = self._buffers(k_codes.shape[0], table)
        kernels.segment_scores(q_codes, table.summary(layer), table.lengths(n), out=scores)  # (Hkv, S)
        kernels.pick_ranges(scores, table.starts, table.ends, layout.sinks_end, layout.window_start, need, lo, hi, count)
        hkv = k_codes.shape[0]
        out = self._selection_buffer(q_codes, k_codes)[: hkv * layout.size].reshape(hkv, layout.size)  # (Hkv, K)
        return kernels.ranges_score_select(q_codes, k_codes, n, lo, hi, count, retrieved, sinks, window, out=out,
                                           scratch=self._scratch)  # (Hkv, K)

    def _buffers(self, hkv: int, table: SegmentTable):
        slots = 2 * table.ones.shape[2] + 1  # at most one gap per segment, the segment, and the tail
        if self._ranges is None or self._ranges[0].shape != (hkv, slots):
            self._ranges = (np.zeros((hkv, slots), np.int64), np.zeros((hkv, slots), np.int64), np.zeros(hkv, np.int64))
        if self._segment_scores is None or self._segment_scores.shape != (hkv, len(table)):
            self._segment_scores = np.empty((hkv, len(table)), np.float64)  # (Hkv, S): changes when segments do
        return (*self._ranges, self._segment_scores)
