"""Decode-time attention policies: dense, and Spotlight with pluggable selectors.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv, D head dim, C code bits,
W packed words, N cached tokens (including the one being decoded), Ncap cache capacity,
K selected tokens.

A policy (`DecodePolicy`) is called by every layer of the model:
  - `on_new_tokens(layer, q, k, cache)` when T new tokens' post-RoPE queries (H, T, D)
    and keys (Hkv, T, D) enter the cache (before `cache.advance`), so a key's code is
    computed exactly once (and training can record q and k);
  - `decode(layer, q, cache)` for a single-token step, q (H, 1, D) -> (H, 1, D), after
    which `selection(layer)` says what it read (for the step's observers, observers.py).
  - `prefill(layer, q, cache)` for a prefill chunk q (H, T, D) reaching past the model's
    native window (within it chunks attend densely, model.causal_attention).

`SpotlightDecode` keeps, per KV head, the first `sinks` and last `window` tokens plus the
`retrieved = max(k_min, ratio * N)` others that its selector ranks highest, and runs exact
softmax attention over those rows. Every selector (Spotlight codes, random SimHash, exact
top-k, Quest pages, sinks + window only) returns the same layout
(`kernels.selection_layout`), so budgets are identical across methods. Inside the window
CodeSelector's flat scan scores every cached token's code at every length (two-level retrieval,
segments first, was retired: at the app's budget it was no faster than the byte-plane flat scan
unless it lost recall; docs/DECISIONS.md, "Two-level retrieval retired").

Past the model's native window (`cache.args.max_seq_len`) every layer, dense layers included,
reads sinks + `far_window` recent tokens + `far_retrieved` selected ones, re-positioned inside
the trained range (spotlight/beyond.py); a prefill chunk there selects `far_prefill_retrieved`
once for all its queries by their majority code. With `far_fold` (the default) the candidates are
scored in blocks, each by the query turned back to see them about where they will be read
(`select_far`: the flat scan); with 0, at their true distances (`select_chunk` / `select`). Within
the window nothing of this runs.

Fast path (CPU, fp32 cache, numba): attention reads the selected rows in place
(`kernels.gather_attend`, no gathered copies) and dense layers stream the cache once
(`kernels.attend`); query codes come from one fused MLP + pack call. Buffers are allocated
once per geometry or capacity and reused, so a step allocates nothing in Python. Elsewhere
(CUDA, bf16/fp16) the torch path (gather + SDPA) runs; both are exact softmax attention. On a
GPU the codes, the selection and its buffers stay on the device (kernels/cuda.py); the query and
key encoders must be on the model's device (`Encoders.to`).
NOTE: the output of `decode` is a reused buffer, valid until the next call of the policy.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

import kernels

from .config import SpotlightConfig
from .hashing import Encoders
from .beyond import remapped_chunk, remapped_decode
from .model import as_compute, causal_attention, dense_decode, rope_inv_freq
from .positions import Rotations


class Selector(Protocol):
    """Which cached tokens a sparse layer reads. Every selector implements all of it.

    `select` returns int32 (Hkv, K) indices in `kernels.selection_layout`'s
    layout and tie rule (numpy, or a tensor on the cache's device; possibly a reused buffer)."""

    code_words: int  # W of the key codes it keeps in the cache (0: none)

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the encoders behind its key codes ("" without codes)."""

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        """Post-RoPE q (H, T, D) and k (Hkv, T, D) of T tokens entering the cache at cache.length."""

    def step_key_coders(self, layers: int) -> tuple["kernels.MlpCoder", ...] | None:
        """The C-built key coders of all `layers` that code a decode step's keys as on_new_tokens
        does, for the one-call dense step (FusedStep); () when it keeps no codes, None when its
        coding has no such coders."""

    def select(self, layer: int, q: torch.Tensor, cache, n: int, retrieved: int, sinks: int, window: int):
        """The flat scan over the first n cached tokens for the query q (H, 1, D)."""

    def select_chunk(self, layer: int, q: torch.Tensor, cache, n: int, retrieved: int, sinks: int, window: int):
        """One selection among the first n cached tokens for all T queries q (H, T, D) of a chunk."""

    def select_far(self, layer: int, q: torch.Tensor, cache, n: int, retrieved: int, sinks: int, window: int,
                   fold: int, rotations: Rotations):
        """Past the native window: one selection among the first n cached tokens for the T >= 1
        queries q (H, T, D) that follow them, each block of `fold` candidates scored as if it lay
        just before the local window (the flat scan; a decode step has T = 1)."""


class DecodePolicy(Protocol):
    """How each layer of a decode step attends (called by model.Attention.forward)."""

    code_words: int  # W of the key codes the cache must hold (0: none)

    @property
    def spotlight(self) -> SpotlightConfig | None:
        """The Spotlight configuration it decodes with; None when it decodes densely."""

    @property
    def encoder_fingerprint(self) -> str:
        """The fingerprint of the encoders that produce the cache's key codes ("" without codes)."""

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        """Post-RoPE q (H, T, D), k (Hkv, T, D) of T tokens entering the cache (before cache.advance)."""

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        """q (H, 1, D) over the N = cache.length + 1 cached rows -> (H, 1, D), a reused buffer."""

    def selection(self, layer: int):
        """The (Hkv, K) indices the last `decode` of `layer` read, None when it read all rows."""

    def dense_step(self, n_tokens: int) -> bool:
        """Whether a decode step over `n_tokens` is DenseDecode's: every layer attends to all rows
        and the policy keeps nothing of it (on_new_tokens does nothing, selection is None), so the
        model may run it in one compiled call (spotlight/quantized.py FusedStep)."""

    def step_key_coders(self, n_tokens: int, cache):
        """For a decode step over `n_tokens` that attends to all rows in every layer and keeps only
        each layer's new key codes (Spotlight below dense_below): the per-layer key coders
        (kernels.MlpCoder, C-built; empty when no codes are kept), so the model may run it in one
        compiled call that also codes the keys (FusedStep). None for any other step."""

    def prefill(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        """A chunk's q (H, T, D), keys written at [cache.length, + T), past the native window -> (H, T, D)."""


def fast_path(q: torch.Tensor, cache) -> bool:
    """Whether the CPU kernels serve this step: CPU, fp32 queries, an fp32 or fp16 cache, numba
    installed (kernels/attend.c reads fp16 rows as they are; the numba fallback widens them)."""
    return (kernels.cpu.HAVE_NUMBA and q.device.type == "cpu" and q.dtype == torch.float32
            and cache.k.dtype in (torch.float32, torch.float16))


class Attend:
    """Exact decode attention over all cached rows or selected rows; owns the step's buffers."""

    def __init__(self):
        self._out: torch.Tensor | None = None  # (H, D) fp32, reused by every layer and step
        self._out_host: np.ndarray | None = None  # the same memory as numpy (remapped)
        self._scratch = None  # kernels.attend scratch for (H, Hkv, D)

    def _buffers(self, q: torch.Tensor, k):
        """The (H, D) output and kernel scratch for q (H, 1, D) over k (Hkv, Ncap, D), made once."""
        heads, _, dim = q.shape
        if self._out is None or self._out.shape != (heads, dim) or not self._scratch.fits(heads, k.shape[0], dim):
            self._out = torch.empty(heads, dim)  # (H, D)
            self._out_host = self._out.numpy()
            self._scratch = kernels.make_attend_scratch(self._out, k)
        return self._out, self._scratch

    def dense(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        """q (H, 1, D) over the N = cache.length + 1 rows of `layer` (the new key is written) -> (H, 1, D)."""
        n = cache.length + 1
        if not fast_path(q, cache):
            return dense_decode(q, cache.keys(layer, 1), cache.values(layer, 1))  # (H, 1, D)
        out, scratch = self._buffers(q, cache.k[layer])
        kernels.attend(q[:, 0], cache.k[layer], cache.v[layer], n, out=out, scratch=scratch)
        return out.unsqueeze(1)  # (H, 1, D)

    def remapped(self, layer: int, q: torch.Tensor, cache, idx, n: int, local: int, rotations: Rotations):
        """q (H, 1, D) of the token at n - 1 over the selection idx (Hkv, K) re-positioned past the
        window (beyond.remapped_decode's result) -> (H, 1, D): on the CPU one kernels/attend.c call
        that rotates the keys as it reads them, else (or where it does not fit) the torch path."""
        if fast_path(q, cache):
            # NOTE: numpy views throughout (the cache's, the tables', the output's): torch's indexing
            # and .numpy() cost ~1 us each, ~40 us a layer of a far step's ~190 us of Python
            # (docs/DECISIONS.md, "Far-step overhead")
            k, v = cache.host_layer(layer)  # (Hkv, Ncap, D) each
            out, scratch = self._buffers(q, k)
            lo, hi = rotations.host_tables(n)
            done = kernels.remapped_attend(q.detach().numpy()[:, 0], k, v, idx, n, idx.shape[1] - local, lo, hi,
                                           rotations.block, self._out_host, scratch)
            if done is not None:
                return out.unsqueeze(1)  # (H, 1, D)
        return remapped_decode(q, cache.k[layer], cache.v[layer], idx, n, rotations, local)  # (H, 1, D)

    def sparse(self, layer: int, q: torch.Tensor, cache, idx) -> torch.Tensor:
        """q (H, 1, D) over the rows idx (Hkv, K) of `layer` -> (H, 1, D)."""
        if not fast_path(q, cache):
            return sparse_decode(q, cache.k[layer], cache.v[layer], idx)  # (H, 1, D)
        out, scratch = self._buffers(q, cache.k[layer])
        kernels.gather_attend(q[:, 0], cache.k[layer], cache.v[layer], idx, out=out, scratch=scratch)
        return out.unsqueeze(1)  # (H, 1, D)


class DenseDecode:
    """Exact attention over every cached token."""

    code_words = 0
    spotlight = None
    encoder_fingerprint = ""

    def __init__(self):
        self.attend = Attend()

    def selection(self, layer: int) -> None:
        return None

    def dense_step(self, n_tokens: int) -> bool:
        return True

    def step_key_coders(self, n_tokens: int, cache) -> None:
        return None  # dense_step says it all

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        pass

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        return self.attend.dense(layer, q, cache)  # (H, 1, D)

    def prefill(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        T = q.shape[1]
        return causal_attention(q, cache.keys(layer, T), cache.values(layer, T))  # (H, T, D)


class SpotlightDecode:
    """Sparse decode attention over the tokens a selector picks."""

    def __init__(self, config: SpotlightConfig, selector):
        self.config = config
        self.selector = selector
        self.attend = Attend()
        self._selected: dict[int, object] = {}  # layer -> what its last decode read (None: all rows)
        self._rotations: Rotations | None = None  # moves keys past the window (made on first use)

    @property
    def code_words(self) -> int:
        return self.selector.code_words

    @property
    def spotlight(self) -> SpotlightConfig | None:
        return self.config if self.config.enabled else None

    @property
    def encoder_fingerprint(self) -> str:
        return self.selector.fingerprint if self.code_words else ""

    def selection(self, layer: int):
        return self._selected.get(layer)

    def dense_step(self, n_tokens: int) -> bool:
        return False  # on_new_tokens codes every layer's key (and sparse layers select)

    def step_key_coders(self, n_tokens: int, cache):
        """Below dense_below, inside the window, every layer reads all rows: the selector's key
        coders, when it has C-built ones, for the one-call step (DecodePolicy.step_key_coders)."""
        c = self.config
        if c.enabled and (n_tokens >= c.dense_below or self.beyond(cache, n_tokens)):
            return None
        return self.selector.step_key_coders(cache.args.n_layers)

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        self.selector.on_new_tokens(layer, q, k, cache)

    def is_dense(self, layer: int, n_tokens: int) -> bool:
        c = self.config
        return not c.enabled or layer in c.dense_layers or n_tokens < c.dense_below

    def beyond(self, cache, n_tokens: int) -> bool:
        """Whether `n_tokens` reach past the model's native window (then every layer remaps)."""
        return self.config.enabled and n_tokens > cache.args.max_seq_len

    def rotations(self, cache) -> Rotations:
        if self._rotations is None:
            self._rotations = Rotations(rope_inv_freq(cache.args))
        return self._rotations

    def prefill(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        """q (H, T, D) of a chunk past the window over sinks + selected + its local window
        (re-positioned, spotlight/beyond.py) and itself -> (H, T, D)."""
        past, T = cache.length, q.shape[1]
        if not self.beyond(cache, past + T):
            return causal_attention(q, cache.keys(layer, T), cache.values(layer, T))  # (H, T, D)
        sinks, step, window = self.far_budget
        retrieved = min(self.config.far_prefill_retrieved, step)  # a chunk reads no more than a decode step
        if self.config.far_fold:  # the flat scan, folded
            idx = self.selector.select_far(layer, q, cache, past, retrieved, sinks, window, self.config.far_fold,
                                           self.rotations(cache))
        else:
            idx = self.selector.select_chunk(layer, q, cache, past, retrieved, sinks, window)
        local = _local(past, retrieved, sinks, window)  # the window's columns keep their positions
        return remapped_chunk(q, cache.k[layer], cache.v[layer], idx, past, self.rotations(cache), local)

    @property
    def far_budget(self) -> tuple[int, int, int]:
        """(sinks, retrieved, window) past the window (the engine fits them to the model's, beyond.fitted)."""
        return self.config.sinks, self.config.far_retrieved, self.config.far_window

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        n = cache.length + 1  # the key of the token being decoded is already written
        if self.beyond(cache, n):
            sinks, retrieved, window = self.far_budget
            idx = self._select(layer, q, cache, n, retrieved, sinks, window, far=True)  # (Hkv, K)
            local = _local(n, retrieved, sinks, window)
            return self.attend.remapped(layer, q, cache, idx, n, local, self.rotations(cache))  # (H, 1, D)
        if self.is_dense(layer, n):
            self._selected[layer] = None
            return self.attend.dense(layer, q, cache)  # (H, 1, D)
        c = self.config
        retrieved = max(c.k_min, int(c.ratio * n))
        idx = self._select(layer, q, cache, n, retrieved, c.sinks, c.window)  # (Hkv, K) int
        return self.attend.sparse(layer, q, cache, idx)  # (H, 1, D)

    def _select(self, layer: int, q: torch.Tensor, cache, n: int, retrieved: int, sinks: int, window: int,
                far: bool = False):
        """The selector's (Hkv, K) pick for a decode step (`far`: past the window, folded when
        far_fold is set), kept as `selection(layer)`."""
        if far and self.config.far_fold:  # past the window: the folded flat scan
            idx = self.selector.select_far(layer, q, cache, n, retrieved, sinks, window, self.config.far_fold,
                                           self.rotations(cache))
        else:
            idx = self.selector.select(layer, q, cache, n, retrieved, sinks, window)  # (Hkv, K) int
        self._selected[layer] = idx
        return idx


def _local(n: int, retrieved: int, sinks: int, window: int) -> int:
    """Columns of the local window in a selection over n tokens (the layout's tail)."""
    layout = kernels.selection_layout(n, retrieved, sinks, window)
    return layout.n - layout.window_start


def sparse_decode(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, idx) -> torch.Tensor:
    """Attention of q (H, 1, D) over the rows idx (Hkv, K) of k_all, v_all (Hkv, Ncap, D); torch ops."""
    H, _, D = q.shape
    Hkv = k_all.shape[0]
    idx = torch.as_tensor(idx, dtype=torch.long, device=k_all.device)  # (Hkv, K)
    k_sel = as_compute(torch.gather(k_all, 1, idx.unsqueeze(-1).expand(-1, -1, D)), q)  # (Hkv, K, D)
    v_sel = as_compute(torch.gather(v_all, 1, idx.unsqueeze(-1).expand(-1, -1, D)), q)  # (Hkv, K, D)
    out = F.scaled_dot_product_attention(q.view(1, Hkv, H // Hkv, D), k_sel[None], v_sel[None])  # (1, Hkv, G, D)
    return out.reshape(H, 1, D)  # a view on the CPU; CUDA's SDPA may return other strides


# ----------------------------------------------------------------------------- selectors


class CodeSelector:
    """Hamming top-k over packed codes: Spotlight (trained or untrained) or random SimHash.

    On the fast path the query codes and a decode step's key codes come from
    `kernels.MlpCoder` over views of the encoders' parameters (in place: retraining
    them in place is seen), and the selection is written into a buffer of the cache's
    capacity (reused: copy it to keep it). `select` is the flat scan.
    """

    def __init__(self, encoders: Encoders):
        self.encoders = encoders
        self.code_words = kernels.words_for(encoders.spec.bits)
        self.fingerprint = encoders.fingerprint
        self._capacity = None  # (shape (Hkv, W, Ncap), device) of the code buffer the buffers below were made for
        self._scratch = None  # kernels.score_select scratch
        self._selected = None  # (Hkv * Ncap,) int32: room for any selection of this capacity
        self._q_codes = None  # (H, W): uint64 numpy, or an int64 tensor on a GPU (the same bits)
        self._k_codes = None  # (Hkv, W) uint64: a decode step's key codes
        self._query_coders = {}  # layer -> kernels.MlpCoder over views of the query encoder's weights
        self._key_coders = {}  # layer -> the same for the key encoder
        self._step_coders = None  # step_key_coders' tuple of _key_coders, all layers
        self._far_q_codes = None  # (R, H, W) uint64: a decode step's turned-back query codes
        self._far_table = None  # (key, (cos, sin), their (R, D) numpy copies or None) of _far_turn
        self._plane_scratch = None  # kernels.PlaneScratch of select_far's byte-plane scan

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        mlp = self.encoders.key
        if k.shape[1] == 1 and _fused(k, mlp):
            # NOTE: a decode step's key codes come from the fused kernel, like its query codes.
            # Through torch they are three tiny batched GEMMs per layer, each an MKL parallel region
            # that waits for the second core: ~8 ms on a shared 2-core machine with torch's default
            # 2 threads (0.7-2.5 s per token over 30 layers), ~15 us here. Its sums run in another
            # order, so about one bit in 10^7 can differ from the prefill path's code; the keys
            # themselves already differ by float rounding between decode and prefill.
            if self._k_codes is None or self._k_codes.shape[0] != k.shape[0]:
                self._k_codes = np.empty((k.shape[0], self.code_words), np.uint64)  # (Hkv, W)
            coder = _coder(mlp, layer, self._key_coders)
            codes = coder(np.ascontiguousarray(k[:, 0].numpy()), self._k_codes)  # (Hkv, W)
            cache.codes[layer, :, :, cache.length] = codes
            return
        h = self.encoders.key_bits(layer, k).detach().float()  # (Hkv, T, C)
        kernels.pack_into(h if h.is_cuda else h.numpy(), cache.codes[layer], cache.length)

    def step_key_coders(self, layers: int) -> tuple["kernels.MlpCoder", ...] | None:
        """The fused key coders of all `layers`, when encode.c serves a decode step's keys as
        on_new_tokens codes them (fp32 CPU encoders, the C build); None otherwise."""
        mlp = self.encoders.key
        if not (kernels.cpu.HAVE_NUMBA and mlp.w_out.device.type == "cpu" and mlp.w_out.dtype == torch.float32):
            return None
        if self._step_coders is None or len(self._step_coders) != layers:  # made once: asked every decode step
            self._step_coders = tuple(_coder(mlp, layer, self._key_coders) for layer in range(layers))
        return self._step_coders if all(coder.native for coder in self._step_coders) else None

    def query_codes(self, layer: int, q: torch.Tensor) -> np.ndarray:
        """Packed query codes (H, W) of q (H, 1, D): numpy on the CPU, a reused int64 device tensor on a GPU."""
        mlp = self.encoders.query
        if _fused(q, mlp):
            if not isinstance(self._q_codes, np.ndarray) or self._q_codes.shape[0] != q.shape[0]:
                self._q_codes = np.empty((q.shape[0], self.code_words), np.uint64)  # (H, W)
            coder = _coder(mlp, layer, self._query_coders)
            return coder(np.ascontiguousarray(q[:, 0].numpy()), self._q_codes)  # (H, W)
        h = self.encoders.query_bits(layer, q)[:, 0].detach().float()  # (H, C)
        if not h.is_cuda:
            return kernels.pack(h.numpy())  # (H, W)
        if not isinstance(self._q_codes, torch.Tensor) or self._q_codes.shape[0] != q.shape[0]:
            self._q_codes = torch.empty((q.shape[0], self.code_words), dtype=torch.int64, device=q.device)
        kernels.pack(h, out=self._q_codes)  # int64 holds the same bits
        return self._q_codes  # (H, W)

    def select(self, layer, q, cache, n, retrieved, sinks, window):
        return self._scan(layer, self.query_codes(layer, q), cache, n, retrieved, sinks, window)

    def chunk_codes(self, layer: int, q: torch.Tensor):
        """Packed (H, W) majority codes of a chunk's queries q (H, T, D): bit set where most of the
        T queries of a head set it (numpy on the CPU, int64 on a GPU: the same bits)."""
        h = self.encoders.query_bits(layer, q).detach().float()  # (H, T, C)
        majority = (h > 0).float().mean(1) - 0.5  # (H, C): > 0 where more than half set the bit
        if not majority.is_cuda:
            return kernels.pack(majority.numpy())  # (H, W)
        return kernels.pack(majority, out=torch.empty((q.shape[0], self.code_words), dtype=torch.int64,
                                                       device=q.device))

    def select_chunk(self, layer, q, cache, n, retrieved, sinks, window):
        return self._scan(layer, self.chunk_codes(layer, q), cache, n, retrieved, sinks, window)

    def select_far(self, layer, q, cache, n, retrieved, sinks, window, fold, rotations):
        # The candidates [sinks_end, window_start) in blocks of `fold` counted back from the local
        # window; block j (0 nearest) is scored by the queries turned back by j * fold positions,
        # so its keys sit at distances [window, window + fold) (+ i for a chunk's query i): inside
        # the range the codes were trained on whatever n is, and about where a retrieved key is
        # read after re-positioning. RoPE scores depend only on the distance, so this is the score
        # the key would get there. A chunk codes `_FAR_QUERIES` of its queries per block.
        layout = kernels.selection_layout(n, retrieved, sinks, window)
        lo, hi = layout.sinks_end, layout.window_start
        blocks = max(1, -(-(hi - lo) // fold))
        bounds = [lo] + [hi - j * fold for j in range(blocks - 1, 0, -1)] + [hi]  # ascending
        q_codes = self._far_codes(layer, q, *self._far_turn(blocks, fold, rotations, q.device))  # (R, H, W)
        k_codes = cache.codes[layer]  # (Hkv, W, Ncap)
        out = self._out(q_codes[0], k_codes, n, retrieved, sinks, window)  # (Hkv, K) view
        if self._on_planes(q_codes[0], cache, layer):
            return self._planes_select(q_codes, cache, layer, n, bounds, retrieved, sinks, window, out,
                                       layout.window_start)
        kernels.score_select_blocks(q_codes, k_codes, n, bounds, retrieved, sinks, window, out=out,
                                    scratch=self._scratch)
        return out  # as _scan: numpy on the CPU, a torch view of the device buffer on a GPU (not a CuPy array)

    @staticmethod
    def _on_planes(q_codes, cache, layer: int) -> bool:
        """Whether the scan reads this cache's byte planes (kernels/scan.c: host codes, a geometry it takes)."""
        k_codes = cache.codes[layer]  # (Hkv, W, Ncap)
        return cache.key_codes.on_host and kernels.planes_fit(q_codes.shape[0], k_codes.shape[0], k_codes.shape[1])

    def _planes_select(self, q_codes, cache, layer, n, bounds, retrieved, sinks, window, out, window_start: int):
        """score_select_blocks' selection from the codes' byte planes (kernels/scan.c), into out (Hkv, K);
        window_start: the caller's layout's (the planes are written up to it).

        Why: the scan alone 1.3x faster on AVX2 at 131K than numba's word-major one, and a process whose
        scans all run here never imports numba (~54 MiB; docs/DECISIONS.md, "numba off the default path")."""
        planes = cache.key_codes.planes(layer, window_start)
        if self._plane_scratch is None or not self._plane_scratch.fits(q_codes.shape[1], planes):
            self._plane_scratch = kernels.PlaneScratch(q_codes.shape[1], *planes.shape)  # planes (Hkv, 8 W, Ncap)
        return kernels.planes_select_blocks(q_codes, planes, n, bounds, retrieved, sinks, window, out=out,
                                            scratch=self._plane_scratch)

    def _far_turn(self, blocks: int, fold: int, rotations: Rotations, device):
        """((cos, sin) (R, 1, 1, D) turning queries back by (R - 1 - r) * fold for block r, and their (R, D)
        numpy copies on the CPU, else None); made when the blocks or the fold change (every `fold`
        tokens), not each step."""
        key = (blocks, fold, id(rotations), str(device))
        if self._far_table is None or self._far_table[0] != key:
            back = torch.arange(blocks - 1, -1, -1, dtype=torch.int64).to(device) * fold  # (R,): block r turned back
            cos, sin = rotations.cos_sin(back.view(-1, 1, 1), (blocks - 1) * fold)  # (R, 1, 1, D) each
            host = tuple(np.ascontiguousarray(t.reshape(blocks, -1).numpy()) for t in (cos, sin)) \
                if cos.device.type == "cpu" else None  # (R, D) each: what a decode step's fused coder reads
            self._far_table = (key, (cos, sin), host)
        return self._far_table[1:]

    def _far_codes(self, layer, q, turn, host_turn):
        """Packed codes (R, H, W) of q (H, T, D) turned back by `turn` (_far_turn's cos, sin; `host_turn` the
        same as numpy, for the fused coder): one
        query's codes for a decode step, the majority code of up to `_FAR_QUERIES` spread queries for a chunk."""
        H, T, D = q.shape
        mlp = self.encoders.query
        if T == 1 and _fused(q, mlp):  # turned and coded in one kernels.MlpCoder.turned call
            R = turn[0].shape[0]
            if self._far_q_codes is None or self._far_q_codes.shape != (R, H, self.code_words):
                self._far_q_codes = np.empty((R, H, self.code_words), np.uint64)  # (R, H, W), reused while R holds
            cos, sin = host_turn  # (R, D) numpy copies of `turn`
            return _coder(mlp, layer, self._query_coders).turned(np.ascontiguousarray(q.detach().numpy()[:, 0]), cos,
                                                                 sin, self._far_q_codes)
        if T > 1:
            pick = torch.linspace(0, T - 1, min(T, _FAR_QUERIES)).round().to(torch.int64).to(q.device)  # (S,) the last included
            q = q[:, pick]  # (H, S, D)
        turned = Rotations.turn_back(q[None], *turn)  # (R, H, S, D)
        R, S = turned.shape[0], turned.shape[2]
        h = self.encoders.query_bits(layer, turned.permute(1, 0, 2, 3).reshape(H, R * S, D)).detach().float()
        majority = (h.view(H, R, S, -1) > 0).float().mean(2) - 0.5  # (H, R, C): > 0 where most set the bit
        majority = majority.transpose(0, 1).contiguous()  # (R, H, C)
        if not majority.is_cuda:
            return kernels.pack(majority.numpy())  # (R, H, W)
        return kernels.pack(majority, out=torch.empty((R, H, self.code_words), dtype=torch.int64, device=q.device))

    def _scan(self, layer, q_codes, cache, n, retrieved, sinks, window):
        """The flat scan for query codes (H, W) over the first n key codes of `layer`."""
        k_codes = cache.codes[layer]  # (Hkv, W, Ncap)
        out = self._out(q_codes, k_codes, n, retrieved, sinks, window)  # (Hkv, K) view
        if self._on_planes(q_codes, cache, layer):  # one block: the middle's own bounds
            layout = kernels.selection_layout(n, retrieved, sinks, window)
            bounds = np.array([layout.sinks_end, layout.window_start], np.int64)
            return self._planes_select(q_codes[None], cache, layer, n, bounds, retrieved, sinks, window, out,
                                       layout.window_start)
        kernels.score_select(q_codes, k_codes, n, retrieved, sinks, window, out=out, scratch=self._scratch)
        return out  # numpy on the CPU, a torch view of the device buffer on a GPU

    def _out(self, q_codes, k_codes, n, retrieved, sinks, window) -> np.ndarray:
        """The (Hkv, K) view of the reused selection buffer for this step's layout."""
        hkv, size = k_codes.shape[0], kernels.selection_layout(n, retrieved, sinks, window).size
        return self._selection_buffer(q_codes, k_codes)[: hkv * size].reshape(hkv, size)

    def _selection_buffer(self, q_codes, k_codes):
        """(Hkv * Ncap,) int32 room for any selection, and the scan's scratch, made once per capacity
        (numpy for host codes, a torch tensor on the codes' device otherwise)."""
        made_for = (k_codes.shape, str(k_codes.device))  # numpy arrays say "cpu"
        if self._capacity != made_for:
            self._capacity = made_for
            self._scratch = kernels.make_scratch(q_codes, k_codes)
            size = k_codes.shape[0] * k_codes.shape[2]
            self._selected = (np.empty(size, np.int32) if isinstance(k_codes, np.ndarray)
                              else torch.empty(size, dtype=torch.int32, device=k_codes.device))  # (Hkv * Ncap,)
        return self._selected


_FAR_QUERIES = 16  # a chunk past the window codes this many of its queries per block (select_far)


def _fused(x: torch.Tensor, mlp) -> bool:
    """Whether `kernels.MlpCoder` serves x: numba, and x and the encoder fp32 on the CPU."""
    return (kernels.cpu.HAVE_NUMBA and x.device.type == mlp.w_out.device.type == "cpu"
            and x.dtype == mlp.w_out.dtype == torch.float32)


def _coder(mlp, layer: int, memo: dict) -> "kernels.MlpCoder":
    """The fused coder of one layer of an encoder MLP over views of its weights, made once per layer."""
    if layer not in memo:
        memo[layer] = kernels.MlpCoder(*(p.detach()[layer].numpy() for p in (mlp.w1, mlp.b1, mlp.w2, mlp.w_out)),
                                       mlp.depth)
    return memo[layer]


class _Uncoded:
    """What the selectors that keep no key codes share: no codes to write."""

    code_words = 0
    fingerprint = ""

    def on_new_tokens(self, layer, q, k, cache) -> None:
        pass

    def step_key_coders(self, layers: int) -> tuple:
        return ()  # no codes to write

    def select_chunk(self, layer, q, cache, n, retrieved, sinks, window):
        """`select` for the chunk's mean query (H, 1, D)."""
        return self.select(layer, q.mean(1, keepdim=True), cache, n, retrieved, sinks, window)

    def select_far(self, layer, q, cache, n, retrieved, sinks, window, fold, rotations):
        """`select` (a chunk: its mean query) at true distances: exact scores need no folding to compare."""
        return self.select(layer, q.mean(1, keepdim=True), cache, n, retrieved, sinks, window)


class OracleSelector(_Uncoded):
    """Exact top-k: ranks tokens by the attention probability summed over the query group."""

    def scores(self, q, cache, layer, n) -> torch.Tensor:
        H, _, D = q.shape
        k = as_compute(cache.k[layer, :, :n], q)  # (Hkv, N, D)
        logits = q.view(k.shape[0], H // k.shape[0], D) @ k.transpose(1, 2) / D**0.5  # (Hkv, G, N)
        return logits.float().softmax(-1).sum(1)  # (Hkv, N)

    def select(self, layer, q, cache, n, retrieved, sinks, window):
        return topk_layout(self.scores(q, cache, layer, n), retrieved, sinks, window)


class SinkWindowSelector(_Uncoded):
    """No retrieval: the retrieved budget extends the local window (StreamingLLM at equal K)."""

    def select(self, layer, q, cache, n, retrieved, sinks, window):
        layout = kernels.selection_layout(n, retrieved, sinks, window)
        head = torch.arange(layout.sinks_end, device=cache.k.device)
        tail = torch.arange(layout.window_start - layout.retrieved, n, device=cache.k.device)
        row = torch.cat([head, tail]).to(torch.int32)  # (K,)
        return row.expand(cache.args.n_kv_heads, -1).contiguous()  # (Hkv, K)


class QuestSelector(_Uncoded):
    """Quest: per-page key min/max bounds of q.k; the best pages fill the retrieved budget."""

    def __init__(self, page: int = 16):
        self.page = page

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
    head = torch.arange(layout.sinks_end, device=scores.device).expand(Hkv, -1)
    tail = torch.arange(layout.window_start, n, device=scores.device).expand(Hkv, -1)
    return torch.cat([head, picked, tail], dim=1).to(torch.int32)  # (Hkv, K)
