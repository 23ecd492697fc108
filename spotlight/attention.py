"""Decode-time attention policies: dense, and (issue 3) Spotlight with pluggable selectors.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv, D head dim, N cached tokens,
T new tokens.

A policy is called by every layer of the model:
  - `keys_added(layer, k, cache)` when T new keys (Hkv, T, D) enter the cache
    (before `cache.advance`), so a key's code is computed exactly once;
  - `decode(layer, q, cache)` for a single-token step, q (H, 1, D) -> (H, 1, D).
Prefill chunks always attend densely (see model.causal_attention).
"""
from __future__ import annotations

import torch

from .model import dense_decode


class DenseDecode:
    """Exact attention over every cached token."""

    def keys_added(self, layer: int, k: torch.Tensor, cache) -> None:
        pass

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        return dense_decode(q, cache.keys(layer, 1), cache.values(layer, 1))  # (H, 1, D)
