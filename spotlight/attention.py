"""Decode-time attention policies: dense, and Spotlight with pluggable selectors.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv, D head dim, C code bits,
W packed words, N cached tokens (including the one being decoded), K selected tokens.

A policy is called by every layer of the model:
  - `on_new_tokens(layer, q, k, cache)` when T new tokens' post-RoPE queries (H, T, D)
    and keys (Hkv, T, D) enter the cache (before `cache.advance`), so a key's code is
    computed exactly once (and training can record q and k);
  - `decode(layer, q, cache)` for a single-token step, q (H, 1, D) -> (H, 1, D).
Prefill chunks always attend densely (see model.causal_attention).

`SpotlightDecode` keeps, per KV head, the first `sinks` and last `window` tokens plus the
`retrieved = max(k_min, ratio * N)` others that its selector ranks highest, gathers those
K/V rows and runs exact softmax attention over them. Every selector (Spotlight codes,
random SimHash, exact top-k, Quest pages, sinks + window only) returns the same layout
(`kernels.selection_layout`), so budgets are identical across methods.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels

from .config import SpotlightConfig
from .hashing import Encoders
from .model import dense_decode


class DenseDecode:
    """Exact attention over every cached token."""

    code_words = 0

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        pass

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        return dense_decode(q, cache.keys(layer, 1), cache.values(layer, 1))  # (H, 1, D)


@dataclass
class StepRecord:
    """What the last decode step of each layer selected (for sources and diagnostics)."""

    n_tokens: int = 0
    selected: dict | None = None  # layer -> (Hkv, K) int32 indices


class SpotlightDecode:
    """Sparse decode attention over the tokens a selector picks."""

    def __init__(self, config: SpotlightConfig, selector):
        self.config = config
        self.selector = selector
        self.record: StepRecord | None = None  # set to StepRecord() to keep each step's selections

    @property
    def code_words(self) -> int:
        return getattr(self.selector, "code_words", 0)

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        self.selector.on_new_tokens(layer, q, k, cache)

    def is_dense(self, layer: int, n_tokens: int) -> bool:
        c = self.config
        return not c.enabled or layer in c.dense_layers or n_tokens < c.dense_below

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        n = cache.length + 1  # the key of the token being decoded is already written
        if self.is_dense(layer, n):
            return dense_decode(q, cache.keys(layer, 1), cache.values(layer, 1))  # (H, 1, D)
        c = self.config
        retrieved = max(c.k_min, int(c.ratio * n))
        idx = self.selector.select(layer, q, cache, n, retrieved, c.sinks, c.window)  # (Hkv, K) int
        if self.record is not None:
            self.record.n_tokens = n
            self.record.selected = self.record.selected or {}
            self.record.selected[layer] = idx
        return sparse_decode(q, cache.k[layer], cache.v[layer], idx)  # (H, 1, D)


def sparse_decode(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, idx) -> torch.Tensor:
    """Attention of q (H, 1, D) over the rows idx (Hkv, K) of k_all, v_all (Hkv, Ncap, D)."""
    H, _, D = q.shape
    Hkv = k_all.shape[0]
    idx = torch.as_tensor(idx, dtype=torch.long)  # (Hkv, K)
    k_sel = torch.gather(k_all, 1, idx.unsqueeze(-1).expand(-1, -1, D))  # (Hkv, K, D)
    v_sel = torch.gather(v_all, 1, idx.unsqueeze(-1).expand(-1, -1, D))  # (Hkv, K, D)
    out = F.scaled_dot_product_attention(q.view(1, Hkv, H // Hkv, D), k_sel[None], v_sel[None])  # (1, Hkv, G, D)
    return out.view(H, 1, D)


# ----------------------------------------------------------------------------- selectors


class CodeSelector:
    """Hamming top-k over packed codes: Spotlight (trained or untrained) or random SimHash."""

    def __init__(self, encoders: Encoders):
        self.encoders = encoders
        self.code_words = kernels.words_for(encoders.spec.bits)
        self._scratch = {}  # capacity -> kernels scratch (reused every step)

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        h = self.encoders.key_bits(layer, k)  # (Hkv, T, C)
        kernels.pack_into(h.detach().float().numpy(), cache.codes[layer], cache.length)

    def select(self, layer, q, cache, n, retrieved, sinks, window):
        h = self.encoders.query_bits(layer, q)[:, 0]  # (H, C)
        q_codes = kernels.pack(h.detach().float().numpy())  # (H, W)
        k_codes = cache.codes[layer]  # (Hkv, W, Ncap)
        scratch = self._scratch.get(k_codes.shape)
        if scratch is None:
            self._scratch = {k_codes.shape: kernels.make_scratch(q_codes, k_codes)}
            scratch = self._scratch[k_codes.shape]
        return kernels.score_select(q_codes, k_codes, n, retrieved, sinks, window, scratch=scratch)  # (Hkv, K)


class OracleSelector:
    """Exact top-k: ranks tokens by the attention probability summed over the query group."""

    code_words = 0

    def on_new_tokens(self, layer, q, k, cache) -> None:
        pass

    def scores(self, q, cache, layer, n) -> torch.Tensor:
        H, _, D = q.shape
        k = cache.k[layer, :, :n]  # (Hkv, N, D)
        logits = q.view(k.shape[0], H // k.shape[0], D) @ k.transpose(1, 2) / D**0.5  # (Hkv, G, N)
        return logits.float().softmax(-1).sum(1)  # (Hkv, N)

    def select(self, layer, q, cache, n, retrieved, sinks, window):
        return topk_layout(self.scores(q, cache, layer, n), retrieved, sinks, window)


class SinkWindowSelector:
    """No retrieval: the retrieved budget extends the local window (StreamingLLM at equal K)."""

    code_words = 0

    def on_new_tokens(self, layer, q, k, cache) -> None:
        pass

    def select(self, layer, q, cache, n, retrieved, sinks, window):
        layout = kernels.selection_layout(n, retrieved, sinks, window)
        head = torch.arange(layout.sinks_end)
        tail = torch.arange(layout.window_start - layout.retrieved, n)
        row = torch.cat([head, tail]).to(torch.int32)  # (K,)
        return row.expand(cache.args.n_kv_heads, -1).contiguous()  # (Hkv, K)


class QuestSelector:
    """Quest: per-page key min/max bounds of q.k; the best pages fill the retrieved budget."""

    code_words = 0

    def __init__(self, page: int = 16):
        self.page = page

    def on_new_tokens(self, layer, q, k, cache) -> None:
        pass

    def scores(self, q, cache, layer, n) -> torch.Tensor:
        """Per-token score = its page's upper bound, summed over the query group: (Hkv, N)."""
        H, _, D = q.shape
        k = cache.k[layer, :, :n].float()  # (Hkv, N, D)
        Hkv = k.shape[0]
        pages = -(-n // self.page)
        padded = F.pad(k, (0, 0, 0, pages * self.page - n), value=float("nan")).view(Hkv, pages, self.page, D)
        kmin = torch.nan_to_num(padded, nan=float("inf")).amin(2)  # (Hkv, P, D)
        kmax = torch.nan_to_num(padded, nan=float("-inf")).amax(2)  # (Hkv, P, D)
        qg = q.float().view(Hkv, H // Hkv, 1, D)  # (Hkv, G, 1, D)
        bound = torch.maximum(qg * kmin[:, None], qg * kmax[:, None]).sum(-1).sum(1)  # (Hkv, P)
        return bound.repeat_interleave(self.page, dim=1)[:, :n]  # (Hkv, N)

    def select(self, layer, q, cache, n, retrieved, sinks, window):
        return topk_layout(self.scores(q, cache, layer, n), retrieved, sinks, window)


def topk_layout(scores: torch.Tensor, retrieved: int, sinks: int, window: int) -> torch.Tensor:
    """Float scores (Hkv, N) -> int32 (Hkv, K) in the kernels' layout and tie rule.

    Forced tokens first; among the middle tokens the highest scores win, equal scores
    going to the lower index (a stable descending sort keeps index order within ties).
    """
    Hkv, n = scores.shape
    layout = kernels.selection_layout(n, retrieved, sinks, window)
    middle = scores[:, layout.sinks_end : layout.window_start]  # (Hkv, M)
    order = torch.sort(middle, dim=1, descending=True, stable=True).indices[:, : layout.retrieved]
    picked = torch.sort(order, dim=1).values + layout.sinks_end  # (Hkv, R) ascending
    head = torch.arange(layout.sinks_end).expand(Hkv, -1)
    tail = torch.arange(layout.window_start, n).expand(Hkv, -1)
    return torch.cat([head, picked, tail], dim=1).to(torch.int32)  # (Hkv, K)
