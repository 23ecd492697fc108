"""How much of the context a reply's attention read: measured at every decode step.

`ReadMeter` wraps the engine's decode policy while a reply decodes (like chat/sources.py's
`AttentionTally`, under the engine gate) and records, for each decode step over N cached
tokens, the tokens each layer attended per KV head:

* a Spotlight layer that selected: the size of its selection (`StepRecord.selected`:
  sinks + window + retrieved, the same for every KV head);
* a layer that ran densely (Spotlight's dense layers, contexts below `dense_below`,
  Spotlight off): all N.

A step's read share is the sum over layers divided by (layers x N); a turn reports the mean
over its steps (`Turn.read_share`, shown under the reply). Sampling the first token of a
reply needs no decode step, so a one-token reply has no measurement.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["ReadMeter", "ReadStep", "measuring", "uses_spotlight"]


@dataclass(slots=True, frozen=True)
class ReadStep:
    """One decode step: `n_tokens` cached (the decoded token included), `read[layer]` of them
    attended per KV head."""

    n_tokens: int
    read: tuple[int, ...]

    @property
    def share(self) -> float:
        return sum(self.read) / (len(self.read) * self.n_tokens)


class ReadMeter:
    """A decode policy proxy: delegates everything to `inner` and records each decode step's
    reads (`steps`). `record` reads and writes the inner policy's `StepRecord`, so a proxy
    stacked on this one (chat/sources.py) shares it."""

    def __init__(self, inner):
        self.inner = inner
        self.steps: list[ReadStep] = []
        self._selects = hasattr(inner, "record") and hasattr(inner, "is_dense")
        self._record_before = getattr(inner, "record", None)
        self._n_tokens = 0
        self._read: list[int] = []
        if self._selects:
            from spotlight.attention import StepRecord

            inner.record = StepRecord()

    def __getattr__(self, name):  # code_words, attend, config, is_dense, ...
        return getattr(self.inner, name)

    @property
    def record(self):
        return self.inner.record

    @record.setter
    def record(self, value) -> None:
        self.inner.record = value

    def on_new_tokens(self, layer, q, k, cache) -> None:
        self.inner.on_new_tokens(layer, q, k, cache)

    def decode(self, layer: int, q, cache):
        out = self.inner.decode(layer, q, cache)
        n = cache.length + 1  # the decoded token's key is written
        if n != self._n_tokens:  # every layer of one step sees the same n; the next step one more
            self._close()
            self._n_tokens = n
        self._read.append(self._attended(layer, n))
        return out

    def _attended(self, layer: int, n: int) -> int:
        if self._selects and not self.inner.is_dense(layer, n):
            selected = self.inner.record.selected[layer]  # (Hkv, K): this step's selection
            return int(selected.shape[1])
        return n

    def _close(self) -> None:
        if self._read:
            self.steps.append(ReadStep(self._n_tokens, tuple(self._read)))
            self._read = []

    def share(self) -> float | None:
        """The mean read share of the steps so far; None before the first decode step."""
        self._close()
        if not self.steps:
            return None
        return sum(step.share for step in self.steps) / len(self.steps)

    def restore(self) -> None:
        self._close()
        if self._selects:
            self.inner.record = self._record_before


@contextlib.contextmanager
def measuring(engine) -> Iterator[ReadMeter]:
    """Measure the reads of `engine`'s decode steps in the block (call under the engine gate)."""
    meter = ReadMeter(engine.policy)
    engine.policy = meter
    try:
        yield meter
    finally:
        if engine.policy is meter:
            engine.policy = meter.inner
        meter.restore()


def uses_spotlight(engine) -> bool:
    """Whether the engine decodes with Spotlight attention (an enabled Spotlight policy)."""
    return bool(getattr(getattr(engine.policy, "config", None), "enabled", False))
