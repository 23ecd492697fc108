"""KV cache with key codes: preallocated per layer, grown in large steps, truncatable.

Shape legend: L layers, Hkv KV heads, D head dim, N cached tokens, Ncap capacity,
T new tokens, W packed code words (uint64; on a GPU a torch int64 tensor holding the same bits,
since torch's uint64 supports few CUDA ops and the kernels take either).

Positions and lengths (batch size is always 1: one conversation per cache):

    tokens:    [ 0 ......................... n-1 | n ... n+T-1 | free ... Ncap-1 ]
                 cached (length = n)               being written   preallocated

`write(layer, k, v)` stores the T new rows of one layer at [n, n+T); after all layers
ran, `advance(T)` makes them part of the cache. `truncate(m)` forgets everything from
m on (edit / regenerate); nothing is freed, so the next append reuses the memory.

`segments` (spotlight/twolevel.py) holds the cache's segment boundaries and per-segment code
summaries for two-level retrieval. Whoever lays the tokens out registers them (chat/kv.py: one
segment per stored span, set when spans are restored or stored); the summaries are kept only
for host-memory codes (bound here), and `truncate` truncates them with the rows.
"""
from __future__ import annotations

import numpy as np
import torch

from .config import ModelArgs
from .twolevel import SegmentTable

_GROW_ROUND = 256  # capacity grows in multiples of this many tokens


def kv_cache_shape(args: ModelArgs, capacity: int) -> tuple[int, int, int, int]:
    """(L, Hkv, Ncap, D): the one place that defines the KV layout."""
    return (args.n_layers, args.n_kv_heads, capacity, args.head_dim)


def code_cache_shape(args: ModelArgs, words: int, capacity: int) -> tuple[int, int, int, int]:
    """(L, Hkv, W, Ncap): key codes, word-major so a scan reads each word plane contiguously."""
    return (args.n_layers, args.n_kv_heads, words, capacity)


class KVCache:
    """Keys, values and (optionally) packed key codes of one conversation."""

    def __init__(self, args: ModelArgs, capacity: int, *, dtype=torch.float32, device="cpu", code_words: int = 0):
        self.args = args
        self.dtype = dtype
        self.device = torch.device(device)
        self.code_words = code_words
        self.length = 0
        self._allocate(max(capacity, 1))
        self.segments = SegmentTable()
        if isinstance(self.codes, np.ndarray):
            self.segments.bind(args.n_layers, args.n_kv_heads, code_words)

    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // _GROW_ROUND) * _GROW_ROUND
        shape = kv_cache_shape(self.args, capacity)
        # NOTE: uninitialised: only rows [0, length) are ever read, and zero-filling an 8K cache
        # (380 MB) took ~70 ms of every resume's time to first token.
        self.k = torch.empty(shape, dtype=self.dtype, device=self.device)  # (L, Hkv, Ncap, D)
        self.v = torch.empty(shape, dtype=self.dtype, device=self.device)  # (L, Hkv, Ncap, D)
        self.codes = None
        if self.code_words:
            code_shape = code_cache_shape(self.args, self.code_words, capacity)
            if self.device.type == "cpu":
                self.codes = np.zeros(code_shape, dtype=np.uint64)  # (L, Hkv, W, Ncap)
            else:
                self.codes = torch.zeros(code_shape, dtype=torch.int64, device=self.device)  # the same bits

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` in total; grows geometrically and copies the cached rows once."""
        if n_tokens <= self.capacity:
            return
        old_k, old_v, old_codes, n = self.k, self.v, self.codes, self.length
        self._allocate(max(n_tokens, 2 * self.capacity))
        self.k[:, :, :n].copy_(old_k[:, :, :n])
        self.v[:, :, :n].copy_(old_v[:, :, :n])
        if old_codes is not None:
            self.codes[..., :n] = old_codes[..., :n]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's new rows at [length, length + T). k, v: (Hkv, T, D)."""
        start, end = self.length, self.length + k.shape[1]
        assert end <= self.capacity, f"call reserve() first: need {end} tokens, capacity {self.capacity}"
        self.k[layer, :, start:end].copy_(k)
        self.v[layer, :, start:end].copy_(v)

    def write_codes(self, layer: int, codes) -> None:
        """Store one layer's packed key codes (Hkv, W, T) at [length, length + T)."""
        start = self.length
        self.codes[layer, :, :, start : start + codes.shape[-1]] = codes

    def advance(self, n_tokens: int) -> None:
        """Commit the rows written by the last forward."""
        assert self.length + n_tokens <= self.capacity
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (and the segments' share of them)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        self.segments.truncate(length)

    def keys(self, layer: int, extra: int = 0) -> torch.Tensor:
        """Cached keys of a layer including `extra` rows being written: (Hkv, N, D) view."""
        return self.k[layer, :, : self.length + extra]

    def values(self, layer: int, extra: int = 0) -> torch.Tensor:
        return self.v[layer, :, : self.length + extra]

    def load(self, k: torch.Tensor, v: torch.Tensor, codes=None) -> None:
        """Append whole precomputed rows (e.g. a span read from disk). k, v: (L, Hkv, T, D)."""
        n_new = k.shape[2]
        self.reserve(self.length + n_new)
        start, end = self.length, self.length + n_new
        self.k[:, :, start:end].copy_(k)
        self.v[:, :, start:end].copy_(v)
        if codes is not None and self.codes is not None:
            if isinstance(self.codes, torch.Tensor):  # device codes: int64 holding the uint64 bits
                codes = torch.from_numpy(np.ascontiguousarray(codes).view(np.int64)).to(self.device)
            self.codes[..., start:end] = codes
        self.length = end

    def nbytes(self) -> int:
        """Bytes of the cached tokens (K, V and codes), not of the capacity."""
        per_token = 2 * self.args.n_layers * self.args.n_kv_heads * self.args.head_dim * self.k.element_size()
        per_token += self.args.n_layers * self.args.n_kv_heads * self.code_words * 8
        return per_token * self.length
