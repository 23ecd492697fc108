"""Rotary positions far beyond the trained window: exact angles, and moving a cached key.

Shape legend: T tokens, D head dim.

RoPE rotates each pair of dimensions (i, i + D/2) of a query or key at position p by the
angle p * inv_freq[i] (Hugging Face's rotate-half layout, as `model.apply_rope`). A score
q·k then depends only on the distance between the two positions, so a key cached at position
p moves to position p + delta by one more rotation by delta * inv_freq: past the window,
retrieved keys can be re-positioned inside the trained range without recomputing them.

NOTE: angles must be formed in float64. A float32 angle of ~1M radians is only ~0.06 rad apart
from its neighbours (24-bit mantissa), so a float32 table's cos/sin at position 1,000,003 are
off by up to 0.007 (measured: head dim 64, theta 1e5); an integer position times a float32
inverse frequency is exact in float64 (20 + 24 bits < 53), reduced modulo 2π by libm's cos/sin.
"""
from __future__ import annotations

import torch


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, D) of integer `positions` (T,), formed in float64 and returned as `dtype`.

    `inv_freq` (D/2,) any float dtype; positions may run to 2^32 and beyond."""
    angles = torch.outer(positions.to(torch.float64), inv_freq.to(torch.float64))  # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def shift(x: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE rows x (..., T, D) moved by `delta` positions (an int, or (T,) per row):
    equal, up to rounding, to RoPE of the same pre-RoPE rows at their positions + delta."""
    T = x.shape[-2]
    deltas = torch.full((T,), delta, dtype=torch.int64) if isinstance(delta, int) else delta.to(torch.int64)
    cos, sin = rope_angles(inv_freq, deltas, dtype=torch.float64)  # (T, D)
    rotated = x.to(torch.float64) * cos + rotate_half(x.to(torch.float64)) * sin  # (..., T, D)
    return rotated.to(x.dtype)
