"""Attention past the model's native window: sinks and retrieved tokens re-positioned just
before the local window (issue #21).

Shape legend: H query heads, Hkv KV heads, G = H / Hkv, D head dim, T new tokens of a prefill
chunk, Ncap cache capacity, K selected rows per KV head (sinks + retrieved + local window).

A model never saw a distance of its native window or more. Past it, a decode step (the token at
n - 1) or a prefill chunk ([past, past + T)) reads per KV head the selection idx (Hkv, K) of
`kernels.selection_layout` (ascending: sinks, retrieved, local window), whose column j moves to
position base - K + j (base = n for a decode step, whose window ends with the token itself;
base = past for a chunk, whose own keys follow at their true positions):

    true:      [ s0 s1 | ... r0 ..... r1 ...... r2 ... | w0 w1 ... w_last ] [ chunk ]
    read as:              [ s0 s1 | r0 r1 r2 | w0 w1 ... w_last ] [ chunk ]
                            base - K ...       base - w  ... base - 1

The local window keeps its true distances (delta 0); retrieved tokens keep their order and move
forward, and the sinks with them, so no distance exceeds K - 1 (K + T - 1 in a chunk): inside the
trained range while sinks + retrieved + window (+ chunk) fit the native window. Measured against
one fixed distance for every retrieved token in the issue's experiment (docs/DECISIONS.md). A
cached post-RoPE key moves by one more rotation by its delta (`positions.Rotations`), so nothing
is recomputed; when every token is selected every delta is 0 and this is dense attention.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .config import SpotlightConfig

from .model import causal_attention
from .positions import Rotations


def deltas(idx: torch.Tensor, base: int) -> torch.Tensor:
    """int64 (Hkv, K): how far each selected row moves forward (column j to base - K + j)."""
    K = idx.shape[1]
    target = torch.arange(base - K, base, device=idx.device)  # (K,)
    return target - idx.to(torch.int64)  # (Hkv, K), >= 0 for an ascending selection below base


def remapped_rows(k_all: torch.Tensor, v_all: torch.Tensor, idx, base: int, rotations: Rotations, local: int = 0,
                  dtype: torch.dtype | None = None):
    """The selected rows idx (Hkv, K) of k_all, v_all (Hkv, Ncap, D), keys re-positioned: (Hkv, K, D) x2,
    in `dtype` (default the cache's: an fp16 cache's rows are widened before they are rotated).
    The last `local` columns are the local window ending at base - 1 (delta 0: not rotated)."""
    D = k_all.shape[-1]
    dtype = dtype or k_all.dtype
    idx = torch.as_tensor(idx, device=k_all.device).to(torch.int64)  # (Hkv, K)
    rows = idx.unsqueeze(-1).expand(-1, -1, D)  # (Hkv, K, D)
    k_sel = torch.gather(k_all, 1, rows).to(dtype)  # (Hkv, K, D)
    v_sel = torch.gather(v_all, 1, rows).to(dtype)  # (Hkv, K, D)
    moved = idx.shape[1] - local
    k_sel[:, :moved] = rotations.rotate(k_sel[:, :moved], deltas(idx, base)[:, :moved], largest=base)
    return k_sel, v_sel


def remapped_decode(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, idx, n: int,
                    rotations: Rotations, local: int = 0) -> torch.Tensor:
    """q (H, 1, D) of the token at n - 1 over the re-positioned selection idx (Hkv, K), whose last
    `local` columns are the window ending at n - 1 -> (H, 1, D)."""
    H, _, D = q.shape
    k_sel, v_sel = remapped_rows(k_all, v_all, idx, n, rotations, local, q.dtype)  # (Hkv, K, D) x2
    Hkv = k_sel.shape[0]
    out = F.scaled_dot_product_attention(q.view(1, Hkv, H // Hkv, D), k_sel[None], v_sel[None])  # (1, Hkv, G, D)
    return out.reshape(H, 1, D)


def remapped_chunk(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, idx, past: int,
                   rotations: Rotations, local: int = 0) -> torch.Tensor:
    """q (H, T, D) of the chunk [past, past + T), whose keys are written, over the re-positioned
    selection idx (Hkv, K) among the first `past` tokens (the last `local` columns the window
    ending at past - 1) and causally over itself -> (H, T, D)."""
    T = q.shape[1]
    k_sel, v_sel = remapped_rows(k_all, v_all, idx, past, rotations, local, q.dtype)  # (Hkv, K, D) x2
    k = torch.cat([k_sel, k_all[:, past : past + T].to(q.dtype)], dim=1)  # (Hkv, K + T, D)
    v = torch.cat([v_sel, v_all[:, past : past + T].to(q.dtype)], dim=1)  # (Hkv, K + T, D)
    return causal_attention(q, k, v)  # (H, T, D)


def fitted_config(config: SpotlightConfig, native: int, chunk: int) -> SpotlightConfig:
    """`config` with its budget past the window lowered, when needed, to fit a model's `native` window,
    its fold at most half that window (a folded candidate is scored at most far_window + far_fold
    + a chunk back, which must stay inside what the encoders were trained on), and dense_below at most
    the window (past it every layer reads the far budget, so `n < dense_below` means inside it)."""
    retrieved, window = fitted(config.sinks, config.far_retrieved, config.far_window, chunk, native)
    return dataclasses.replace(config, far_retrieved=retrieved, far_window=window,
                               far_prefill_retrieved=min(config.far_prefill_retrieved, retrieved),
                               far_fold=min(config.far_fold, max(1, native // 2)),
                               dense_below=min(config.dense_below, native))


def fitted(sinks: int, retrieved: int, window: int, chunk: int, native: int) -> tuple[int, int]:
    """(retrieved, window) lowered, when needed, so that sinks + retrieved + window + chunk (the
    largest distance a chunk of `chunk` queries sees, plus one) fit the native window."""
    room = max(2, native - sinks - chunk)
    if retrieved + window <= room:
        return retrieved, window
    window = min(window, room // 2)
    return max(1, min(retrieved, room - window)), window
