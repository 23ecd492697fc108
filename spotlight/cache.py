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

import threading
import weakref

import numpy as np
import torch

from .config import ModelArgs
from .twolevel import SegmentTable

_GROW_ROUND = 256  # capacity grows in multiples of this many tokens


def kv_cache_shape(args: ModelArgs, capacity: int) -> tuple[int, int, int, int]:
    """(L, Hkv, Ncap, D): the one place that defines the KV layout."""
    return (args.n_layers, args.n_kv_heads, capacity, args.head_dim)


def kv_buffer_bytes(args: ModelArgs, dtype: torch.dtype, capacity: int) -> int:
    """Bytes of one of K or V for `capacity` tokens, rounded up as KVCache allocates them (0 for 0)."""
    rounded = -(-capacity // _GROW_ROUND) * _GROW_ROUND
    return int(np.prod(kv_cache_shape(args, rounded))) * dtype.itemsize


def code_cache_shape(args: ModelArgs, words: int, capacity: int) -> tuple[int, int, int, int]:
    """(L, Hkv, W, Ncap): key codes, word-major so a scan reads each word plane contiguously."""
    return (args.n_layers, args.n_kv_heads, words, capacity)


class BufferPool:
    """Host memory for K/V buffers that is already mapped in, kept when a cache is dropped.

    A fresh allocation of an 8K-token cache (2 x 189 MB for SmolLM2 in fp32) is only reserved
    address space: the first write of each 4 KiB page faults and zeroes it, which cost ~70 ms of
    every resume's time to first token (docs/DECISIONS.md, "Engine"). A cache made with a pool
    takes a kept buffer when one fits and gives its buffers back when it is garbage collected
    (so no live cache ever shares memory); `prefault` fills the pool ahead of time.

    Buffers are untyped storages; a cache's tensors are set on them (no autograd view of a
    shared base tensor, so nothing ties their lifetimes together). `take(n)` returns one of
    >= n bytes, and at most twice n (a short context does not hold a long one's buffer), or
    None. At most `max_bytes` are kept, in buffers of at least 1/64 of it; over the budget the
    smallest go first, so a short context's buffers never push out a long one's. Thread-safe:
    caches die on whichever thread drops them last.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.nbytes() <= 2 * nbytes and _unshared(b)]
            if not fits:
                self.misses += 1
                return None
            buffer = min(fits, key=torch.UntypedStorage.nbytes)
            self._free = [b for b in self._free if b is not buffer]
            self.hits += 1
            return buffer

    def give(self, buffer: torch.UntypedStorage) -> None:
        if not self.max_bytes // 64 <= buffer.nbytes() <= self.max_bytes:
            return
        with self._lock:
            self._free.append(buffer)
            while sum(b.nbytes() for b in self._free) > self.max_bytes:
                self._free.remove(min(self._free, key=torch.UntypedStorage.nbytes))

    def prefault(self, nbytes: int, count: int) -> None:
        """Add `count` buffers of `nbytes`, every page written once now (not on first use)."""
        for _ in range(count):
            self.give(torch.UntypedStorage(nbytes).fill_(0))

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes() for b in self._free)


def _unshared(buffer: torch.UntypedStorage) -> bool:
    """No tensor uses the storage any more (a view of a dropped cache's K, kept by someone,
    keeps the buffer out of reuse). NOTE: torch has no public storage use count; the private
    one is used where it exists (1 = the pool's own reference)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is None or use_count(buffer._cdata) <= 1


def _give_back(pool: BufferPool, buffers: list[torch.UntypedStorage]) -> None:
    for buffer in buffers:
        pool.give(buffer)


class KVCache:
    """Keys, values and (optionally) packed key codes of one conversation.

    With a `pool` (host caches only), K and V live in pooled buffers: taken when they fit,
    returned to the pool when this cache is garbage collected."""

    def __init__(self, args: ModelArgs, capacity: int, *, dtype=torch.float32, device="cpu", code_words: int = 0,
                 pool: BufferPool | None = None):
        self.args = args
        self.dtype = dtype
        self.device = torch.device(device)
        self.code_words = code_words
        self.length = 0
        self._pool = pool if self.device.type == "cpu" else None
        self._pooled: list[torch.UntypedStorage] = []  # the storages of k and v, given back at collection
        if self._pool is not None:
            weakref.finalize(self, _give_back, self._pool, self._pooled)
        self._allocate(max(capacity, 1))
        self.segments = SegmentTable()
        if isinstance(self.codes, np.ndarray):
            self.segments.bind(args.n_layers, args.n_kv_heads, code_words)

    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // _GROW_ROUND) * _GROW_ROUND
        shape = kv_cache_shape(self.args, capacity)
        # NOTE: uninitialised: only rows [0, length) are ever read, and zero-filling an 8K cache
        # (380 MB) took ~70 ms of every resume's time to first token.
        self.k = self._empty(shape)  # (L, Hkv, Ncap, D)
        self.v = self._empty(shape)  # (L, Hkv, Ncap, D)
        self.codes = None
        if self.code_words:
            code_shape = code_cache_shape(self.args, self.code_words, capacity)
            if self.device.type == "cpu":
                self.codes = np.zeros(code_shape, dtype=np.uint64)  # (L, Hkv, W, Ncap)
            else:
                self.codes = torch.zeros(code_shape, dtype=torch.int64, device=self.device)  # the same bits

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialised tensor, from a pooled buffer when one fits (then kept in _pooled)."""
        nbytes = int(np.prod(shape)) * self.dtype.itemsize
        if self._pool is None or nbytes > self._pool.max_bytes:  # a buffer the pool would never keep
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        buffer = self._pool.take(nbytes)
        if buffer is None:  # NOTE: allocated as torch.empty allocates, uninitialised
            buffer = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        self._pooled.append(buffer)
        return torch.empty(0, dtype=self.dtype).set_(buffer, 0, shape)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` in total; grows geometrically and copies the cached rows once."""
        if n_tokens <= self.capacity:
            return
        old_k, old_v, old_codes, n = self.k, self.v, self.codes, self.length
        outgrown = len(self._pooled)
        self._allocate(max(n_tokens, 2 * self.capacity))
        del self._pooled[:outgrown]  # freed with old_k / old_v, never pooled: a view of them may live on
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
