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

`KeyCodes` owns the codes on either device (and, for host codes, their byte planes, which
`truncate` truncates with the rows); `rows` / `append_rows` copy whole rows out and in
(`KVRows`), so nothing outside the engine touches the buffers.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

import kernels

from .config import ModelArgs

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
    shared base tensor, so nothing ties their lifetimes together). NOTE: by design the memory
    of a cache's K and V belongs to the cache alone: views of `KVCache.k` / `v` are valid only
    while their cache lives (the decode path's views are transient; `KVCache.rows` copies), so
    the pool needs no count of a storage's users, which torch does not expose publicly. `take(n)` returns one of
    >= n bytes, and at most twice n (a short context does not hold a long one's buffer), or
    None. A miss also lets go of the kept buffers smaller than n: a longer cache is about to be
    allocated beside them, and they would only serve a shorter context later (bench.decode's
    process, 1K then 4K then 8K tokens of Qwen2.5, held the first two's 60 MiB through its 8K
    peak). At most `max_bytes` are kept, in buffers of at least 1/64 of it; over the budget the
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
            fits = [b for b in self._free if nbytes <= b.nbytes() <= 2 * nbytes]
            if not fits:
                self.misses += 1
                self._free = [b for b in self._free if b.nbytes() >= nbytes]  # the smaller ones are freed
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


def _give_back(pool: BufferPool, buffers: list[torch.UntypedStorage]) -> None:
    for buffer in buffers:
        pool.give(buffer)


@dataclass(slots=True)
class KVRows:
    """Copies of rows [start, end) of a Context: what a stored span holds.

    k, v: (L, Hkv, T, D) torch, the cache's dtype, on the host; token_ids: the T token ids;
    key_codes: (L, Hkv, W, T) numpy uint64 (a host copy also for a CUDA cache), None without
    codes.
    """

    k: torch.Tensor
    v: torch.Tensor
    token_ids: list[int]
    key_codes: np.ndarray | None = None

    def __len__(self) -> int:
        return self.k.shape[2]


class KeyCodes:
    """Packed key codes of one cache, word-major (L, Hkv, W, Ncap): numpy uint64 in host memory,
    on a GPU a torch int64 tensor holding the same bits (torch's uint64 has few CUDA ops; the
    kernels take either). The one place that knows the two layouts: kernels read `data`, and
    everything else goes through the methods, which take and give numpy uint64."""

    def __init__(self, shape: tuple[int, int, int, int], device: torch.device):
        self.device = device
        if device.type == "cpu":
            self.data = np.zeros(shape, dtype=np.uint64)  # (L, Hkv, W, Ncap)
        else:
            self.data = torch.zeros(shape, dtype=torch.int64, device=device)  # (L, Hkv, W, Ncap), the same bits
        # host codes also as byte planes (kernels/planes.py: the far scan reads them), made at the first
        # `planes` call and kept up to date lazily, per layer: tokens [0, planed[l]) are written
        self._planes: np.ndarray | None = None  # (L, Hkv, 8 W, Ncap) uint8
        self.planed = np.zeros(shape[0], np.int64)  # (L,)

    def planes(self, layer: int, n: int) -> np.ndarray:
        """The byte planes (Hkv, 8 W, Ncap) of `layer` (host codes only) with tokens [0, n) written."""
        if self._planes is None:
            L, hkv, words, capacity = self.data.shape
            self._planes = np.empty((L, hkv, 8 * words, capacity), np.uint8)
        done = int(self.planed[layer])
        if done < n:
            kernels.write_planes(self.data[layer], done, n, self._planes[layer])
            self.planed[layer] = n
        return self._planes[layer]

    def truncate(self, length: int) -> None:
        """Forget the byte planes of tokens from `length` on (the codes there will be written again)."""
        np.minimum(self.planed, length, out=self.planed)

    @property
    def on_host(self) -> bool:
        return isinstance(self.data, np.ndarray)

    @property
    def words(self) -> int:
        return self.data.shape[2]

    def grown(self, capacity: int, n: int) -> "KeyCodes":
        """A copy with room for `capacity` tokens holding the first n."""
        bigger = KeyCodes((*self.data.shape[:3], capacity), self.device)
        bigger.data[..., :n] = self.data[..., :n]
        return bigger

    def load(self, start: int, codes) -> None:
        """Write codes (L, Hkv, W, T) at [start, start + T): numpy uint64, or a torch tensor of the
        same 64-bit words (e.g. read from a span file), for either device."""
        if isinstance(codes, torch.Tensor):
            codes = codes.cpu().numpy()
        codes = np.ascontiguousarray(codes).view(np.uint64)  # (L, Hkv, W, T)
        end = start + codes.shape[-1]
        if self.on_host:
            self.data[..., start:end] = codes
        else:
            self.data[..., start:end] = torch.from_numpy(codes.view(np.int64)).to(self.device)

    def host(self, start: int, end: int) -> np.ndarray:
        """A numpy uint64 copy (L, Hkv, W, T) of the codes of tokens [start, end)."""
        if self.on_host:
            return self.data[..., start:end].copy()
        return self.data[..., start:end].cpu().numpy().view(np.uint64)


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
        self.key_codes: KeyCodes | None = None
        self._allocate(max(capacity, 1))

    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // _GROW_ROUND) * _GROW_ROUND
        shape = kv_cache_shape(self.args, capacity)
        # NOTE: uninitialised: only rows [0, length) are ever read, and zero-filling an 8K cache
        # (380 MB) took ~70 ms of every resume's time to first token.
        self.k = self._empty(shape)  # (L, Hkv, Ncap, D)
        self.v = self._empty(shape)  # (L, Hkv, Ncap, D)
        # numpy views of the same host memory, for the CPU kernels (host_layer); None on a GPU
        self._host = (self.k.numpy(), self.v.numpy()) if self.device.type == "cpu" else None
        if self.code_words:
            if self.key_codes is None:
                self.key_codes = KeyCodes(code_cache_shape(self.args, self.code_words, capacity), self.device)
            else:
                self.key_codes = self.key_codes.grown(capacity, self.length)

    def host_layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """numpy views k, v (Hkv, Ncap, D) of one layer of a host cache's buffers (the CPU kernels'
        arguments: numpy indexing costs ~0.1 us where torch's indexing and .numpy() cost ~1 us each,
        a dozen times per layer and decode step)."""
        return self._host[0][layer], self._host[1][layer]

    @property
    def codes(self):
        """The raw code buffer (L, Hkv, W, Ncap) the kernels read (see KeyCodes), None without codes."""
        return None if self.key_codes is None else self.key_codes.data

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
        old_k, old_v, n = self.k, self.v, self.length
        outgrown = len(self._pooled)
        self._allocate(max(n_tokens, 2 * self.capacity))
        del self._pooled[:outgrown]  # freed with old_k / old_v, never pooled
        self.k[:, :, :n].copy_(old_k[:, :, :n])
        self.v[:, :, :n].copy_(old_v[:, :, :n])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's new rows at [length, length + T). k, v: (Hkv, T, D)."""
        start, end = self.length, self.length + k.shape[1]
        assert end <= self.capacity, f"call reserve() first: need {end} tokens, capacity {self.capacity}"
        self.k[layer, :, start:end].copy_(k)
        self.v[layer, :, start:end].copy_(v)

    def advance(self, n_tokens: int) -> None:
        """Commit the rows written by the last forward."""
        assert self.length + n_tokens <= self.capacity
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (and their codes' byte planes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        if self.key_codes is not None:
            self.key_codes.truncate(length)

    def keys(self, layer: int, extra: int = 0) -> torch.Tensor:
        """Cached keys of a layer including `extra` rows being written: (Hkv, N, D) view."""
        return self.k[layer, :, : self.length + extra]

    def values(self, layer: int, extra: int = 0) -> torch.Tensor:
        return self.v[layer, :, : self.length + extra]

    def load(self, k: torch.Tensor, v: torch.Tensor, codes=None) -> None:
        """Append whole precomputed rows (e.g. a span read from disk). k, v: (L, Hkv, T, D);
        codes (L, Hkv, W, T) uint64 words (see KeyCodes.load), ignored by a cache without codes."""
        n_new = k.shape[2]
        self.reserve(self.length + n_new)
        start, end = self.length, self.length + n_new
        self.k[:, :, start:end].copy_(k)
        self.v[:, :, start:end].copy_(v)
        if codes is not None and self.key_codes is not None:
            self.key_codes.load(start, codes)
        self.length = end

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
        """Host copies of rows [start, end): k, v (L, Hkv, T, D) and codes (L, Hkv, W, T) uint64 or None."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"rows [{start}, {end}) are not within the cache's {self.length} tokens")
        k = self.k[:, :, start:end].to("cpu", copy=True)  # (L, Hkv, T, D)
        v = self.v[:, :, start:end].to("cpu", copy=True)  # (L, Hkv, T, D)
        codes = None if self.key_codes is None else self.key_codes.host(start, end)  # (L, Hkv, W, T)
        return k, v, codes
