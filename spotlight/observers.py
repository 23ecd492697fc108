"""Decode-step observers: what a reply's attention read, measured while it decodes.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv, D head dim, N cached tokens (the
decoded token included), K selected tokens.

`Engine.stream(..., observers=[...])` hands observers to the decode path for that one call.
In every decode step each layer, after it attended, calls `on_layer(layer, q, cache,
selected)`: `selected` is the (Hkv, K) selection a sparse layer read (one row per KV head,
shared by its query group), None when the layer read all N cached rows; after the last layer
the decode loop calls `on_step(n_tokens)`. Prefill never calls observers. The selection is the
policy's reused buffer: an observer copies what it keeps.

Two observers ship here:

* `ReadMeter`: the share of the context each step read (sinks + window + retrieved in sparse
  layers, all N in dense ones), summed over layers / (layers x N); `share()` is the mean over
  the steps seen. Sampling a reply's first token needs no decode step, so a one-token reply
  has no measurement.
* `AttentionTally(limit)`: the attention mass each cached position < limit received, summed
  over steps, in the layers `tally_layers` picks: dense layers and dense steps add the exact
  softmax probabilities of the step's queries (averaged over the H heads), sparse layers the
  softmax over the positions they selected (each KV head's K rows, weighed by its query group;
  past the model's window with the keys re-positioned as the layer read them, spotlight/beyond.py),
  so a passage counts as much as the layer attended to it, not merely whether it was read (a
  uniform 1 / (Hkv x K) per selected position made Spotlight's sources follow the local window
  and the retrieval's spread: bench.docqa's top source held the answer in 0 of 10 replies at
  8K against 7 of 10 dense). Each step adds 1 / len(layers) per tallied layer, so over a
  context of at most `limit` tokens the whole mass sums to the number of steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

import kernels

from .beyond import remapped_rows
from .model import rope_inv_freq
from .positions import Rotations

__all__ = ["AttentionTally", "ReadMeter", "ReadStep", "StepObserver", "tally_layers"]


class StepObserver(Protocol):
    """Called by the decode path of one `Engine.stream` call (see the module docstring)."""

    def on_layer(self, layer: int, q: torch.Tensor, cache, selected) -> None:
        """`layer` attended: q (H, 1, D) over N = cache.length + 1 rows; `selected` (Hkv, K)
        int indices (numpy, or a tensor on the cache's device), or None when it read all N."""

    def on_step(self, n_tokens: int) -> None:
        """Every layer of a decode step over `n_tokens` cached tokens has run."""


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
    """The measured share of the context each decode step read (`steps`, `share()`)."""

    def __init__(self):
        self.steps: list[ReadStep] = []
        self._read: list[int] = []

    def on_layer(self, layer: int, q: torch.Tensor, cache, selected) -> None:
        self._read.append(cache.length + 1 if selected is None else int(selected.shape[1]))

    def on_step(self, n_tokens: int) -> None:
        self.steps.append(ReadStep(n_tokens, tuple(self._read)))
        self._read = []

    def share(self) -> float | None:
        """The mean read share of the steps so far; None before the first decode step."""
        if not self.steps:
            return None
        return sum(step.share for step in self.steps) / len(self.steps)


def tally_layers(n_layers: int) -> list[int]:
    """Layers whose attention is tallied: spread over the second half, the last included
    (a handful of layers: recomputing dense probabilities there costs ~1/8 of a step's attention)."""
    return sorted({min(n_layers - 1, int(n_layers * f)) for f in (0.5, 0.67, 0.83)} | {n_layers - 1})


class AttentionTally:
    """The attention mass each cached position < `limit` received (`mass` (limit,) float64),
    summed over the decode steps seen (`steps`)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.mass = np.zeros(limit, dtype=np.float64)  # (limit,)
        self.steps = 0
        self._layers: frozenset[int] | None = None  # tally_layers of the cache's model, at the first step
        self._rotations: Rotations | None = None  # past the window: the keys as the layer read them

    def on_layer(self, layer: int, q: torch.Tensor, cache, selected) -> None:
        if self._layers is None:
            self._layers = frozenset(tally_layers(cache.args.n_layers))
        if layer not in self._layers:
            return
        n = cache.length + 1
        limit = min(n, self.limit)
        share = 1.0 / len(self._layers)
        if selected is None:
            self.mass[:limit] += share * _probabilities(layer, q, cache)[:limit]
            return
        rows = torch.as_tensor(selected, device=q.device).long()  # (Hkv, K)
        scores = self._read_scores(layer, q, cache, selected, n)  # (Hkv, G, K), or None: from the keys
        if scores is None:
            scores = _selected_scores(q, self._read_keys(layer, cache, rows, n))
        probs = _probabilities_of(scores, q.shape[0])  # (Hkv, K)
        idx, weight = rows.cpu().numpy().reshape(-1), probs.reshape(-1)
        keep = idx < limit
        np.add.at(self.mass, idx[keep], share * weight[keep])

    def on_step(self, n_tokens: int) -> None:
        self.steps += 1

    def _read_scores(self, layer: int, q: torch.Tensor, cache, selected, n: int) -> torch.Tensor | None:
        """fp32 (Hkv, G, K) scores of the query group over the selected keys as the layer read them,
        from one kernels.selected_scores call (CPU, fp32 queries: rotating the keys as it reads them
        past the window, where the torch path's gather and rotation cost ~5 ms a layer at 128K);
        None where it does not run."""
        if q.device.type != "cpu" or q.dtype != torch.float32 or cache.k.dtype not in (torch.float16, torch.float32):
            return None
        K = selected.shape[1]
        if n <= cache.args.max_seq_len:
            scores = kernels.selected_scores(q[:, 0], cache.k[layer], selected)
        else:
            rotations = self._rotations_of(cache)
            lo, hi = rotations.tables(n, "cpu")
            scores = kernels.selected_scores(q[:, 0], cache.k[layer], selected, n, K, lo, hi, rotations.block)
        return None if scores is None else torch.from_numpy(scores)

    def _read_keys(self, layer: int, cache, rows: torch.Tensor, n: int) -> torch.Tensor:
        """fp32 (Hkv, K, D): the selected keys as the layer read them; past the model's window the
        selection is re-positioned (spotlight/beyond.py), so its keys are rotated the same way."""
        if n <= cache.args.max_seq_len:
            D = cache.k.shape[-1]
            return torch.gather(cache.keys(layer, 1), 1, rows.unsqueeze(-1).expand(-1, -1, D)).float()  # (Hkv, K, D)
        return remapped_rows(cache.k[layer], cache.v[layer], rows, n, self._rotations_of(cache), dtype=torch.float32)[0]

    def _rotations_of(self, cache) -> Rotations:
        """The cache's model's key rotations past the window, made at first use."""
        if self._rotations is None:
            self._rotations = Rotations(rope_inv_freq(cache.args))
        return self._rotations


def _selected_scores(q: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """Scores (Hkv, G, K) of q (H, 1, D) over `read` (Hkv, K, D), the keys a sparse layer read (one
    row per KV head, shared by its query group)."""
    H, D = q.shape[0], q.shape[-1]
    Hkv = read.shape[0]
    query = q[:, 0].float().reshape(Hkv, H // Hkv, D)  # (Hkv, G, D)
    return torch.einsum("hgd,hkd->hgk", query, read) / math.sqrt(D)  # (Hkv, G, K)


def _probabilities_of(scores: torch.Tensor, heads: int) -> np.ndarray:
    """Softmax attention (Hkv, K) float64 from the group's scores (Hkv, G, K), averaged over the H
    query heads (so it sums to 1): what the layer attended to, as it weighed it."""
    return (scores.float().softmax(-1).sum(1) / heads).double().cpu().numpy()  # (Hkv, K)


def _probabilities(layer: int, q: torch.Tensor, cache) -> np.ndarray:
    """Exact softmax attention (N,) float64 of q (H, 1, D) over the layer's N cached keys,
    averaged over the H query heads (so it sums to 1)."""
    keys = cache.keys(layer, 1).float()  # (Hkv, N, D)
    H, D = q.shape[0], q.shape[-1]
    Hkv = keys.shape[0]
    query = q[:, 0].float().reshape(Hkv, H // Hkv, D)  # (Hkv, G, D)
    scores = torch.einsum("hgd,hnd->hgn", query, keys) / math.sqrt(D)  # (Hkv, G, N)
    return (scores.softmax(-1).sum((0, 1)) / H).double().cpu().numpy()  # (N,)
