"""Cache bookkeeping for span files: pins, deferred last-used stamps, eviction plans.

Plain Python, no database and no tensors, so the rules are unit-tested on their own:

- A *pinned* span is in use by the engine (its tensors are mapped or being copied);
  it is never chosen for eviction, whatever its age. Pins are reference counts held
  in memory only: after a crash nothing is in use, so nothing stays pinned.
- Reading a span stamps it "used now". Stamps are buffered here and written by the
  store with its next write transaction, so a read never takes the write lock.
  Losing buffered stamps in a crash only makes the LRU order slightly stale.
- `plan_eviction` picks the least recently used unpinned spans until the total fits.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


class PinTable:
    """Thread-safe reference counts of spans in use."""

    def __init__(self):
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def pin(self, span_ids: Iterable[str]) -> None:
        with self._lock:
            self._counts.update(span_ids)

    def unpin(self, span_ids: Iterable[str]) -> None:
        with self._lock:
            for span_id in span_ids:
                assert self._counts[span_id] > 0, f"unpin of span {span_id} that is not pinned"
                self._counts[span_id] -= 1
                if not self._counts[span_id]:
                    del self._counts[span_id]

    def pinned(self) -> frozenset[str]:
        """The spans pinned right now (a snapshot)."""
        with self._lock:
            return frozenset(self._counts)


class TouchBuffer:
    """Last-used stamps waiting to be written: span id -> newest time seen."""

    def __init__(self):
        self._stamps: dict[str, float] = {}
        self._lock = threading.Lock()

    def touch(self, span_ids: Iterable[str], when: float) -> None:
        with self._lock:
            for span_id in span_ids:
                self._stamps[span_id] = max(when, self._stamps.get(span_id, when))

    def drain(self) -> dict[str, float]:
        """Take every buffered stamp (the buffer is left empty)."""
        with self._lock:
            stamps, self._stamps = self._stamps, {}
        return stamps


@dataclass(slots=True, frozen=True)
class EvictionCandidate:
    span_id: str
    bytes: int
    last_used: float


def plan_eviction(
    candidates: Iterable[EvictionCandidate],
    total_bytes: int,
    budget_bytes: int,
    keep: frozenset[str] | set[str] = frozenset(),
) -> list[str]:
    """Span ids to evict, oldest first, so that `total_bytes` drops to `budget_bytes` or below.

    `candidates` are the spans whose files exist; `keep` (pinned spans, the span just
    written) is never chosen. Ties in `last_used` fall back to the span id so the plan
    is deterministic. When the kept spans alone exceed the budget the plan evicts every
    other candidate and the total stays above budget: a span in use cannot be dropped.
    """
    assert budget_bytes >= 0, f"budget must be >= 0, got {budget_bytes}"
    victims: list[str] = []
    for candidate in sorted(candidates, key=lambda c: (c.last_used, c.span_id)):
        if total_bytes <= budget_bytes:
            break
        if candidate.span_id in keep:
            continue
        victims.append(candidate.span_id)
        total_bytes -= candidate.bytes
    return victims
