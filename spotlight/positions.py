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

import numpy as np
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


class Rotations:
    """cos, sin of many integer deltas in fp32 from two small float64-formed tables.

    A delta d = hi * block + lo turns by d * inv_freq = hi * block * inv_freq + lo * inv_freq, so
    cos/sin(d) follow from the tables' rows hi and lo by the angle-sum identities, in fp32 (error
    ~1e-7 whatever d, where one fp32 angle of 1M radians is off by up to 0.06). The low table has
    `block` rows; the high one grows to the largest delta asked, so a decode step forms no angle.
    Each table holds cos and sin side by side (rows, 2D): one row gather per table and delta."""

    def __init__(self, inv_freq: torch.Tensor, block: int = 1024):
        self.inv_freq = inv_freq.detach().cpu()
        self.block = block
        self._lo = torch.cat(rope_angles(self.inv_freq, torch.arange(block)), dim=-1)  # (block, 2D)
        self._hi = torch.cat(rope_angles(self.inv_freq, torch.zeros(1, dtype=torch.int64)), dim=-1)  # (rows, 2D)
        self._host = None  # (the hi table they view, lo, hi as numpy): host_tables

    def tables(self, largest: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) (rows, 2D) cos | sin on `device`, the high table covering deltas up to `largest`."""
        rows = largest // self.block + 1
        device = torch.device(device)
        if self._hi.shape[0] < rows or self._hi.device != device:
            grown = max(rows, 2 * self._hi.shape[0]) if self._hi.shape[0] < rows else self._hi.shape[0]
            self._hi = torch.cat(rope_angles(self.inv_freq, torch.arange(grown) * self.block), dim=-1).to(device)
            self._lo = self._lo.to(device)
        return self._lo, self._hi

    def host_tables(self, largest: int) -> tuple[np.ndarray, np.ndarray]:
        """`tables(largest, "cpu")` as numpy views (lo, hi), made again only when the high table grows."""
        lo, hi = self.tables(largest, "cpu")
        if self._host is None or self._host[0] is not hi:
            self._host = (hi, lo.numpy(), hi.numpy())
        return self._host[1], self._host[2]

    def cos_sin(self, deltas: torch.Tensor, largest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., D) fp32 of integer `deltas` (...,) in [0, largest] (a bound, so no host sync)."""
        lo_table, hi_table = self.tables(largest, deltas.device)
        flat = deltas.reshape(-1)
        shape = (*deltas.shape, lo_table.shape[-1] // 2)
        hi = hi_table.index_select(0, flat // self.block).view(-1, 2, shape[-1])  # (T, 2, D): cos, sin
        lo = lo_table.index_select(0, flat % self.block).view(-1, 2, shape[-1])  # (T, 2, D)
        cos = torch.addcmul(hi[:, 0] * lo[:, 0], hi[:, 1], lo[:, 1], value=-1)  # (T, D)
        sin = torch.addcmul(hi[:, 1] * lo[:, 0], hi[:, 0], lo[:, 1])  # (T, D)
        return cos.view(shape), sin.view(shape)

    def rotate(self, x: torch.Tensor, deltas: torch.Tensor, largest: int) -> torch.Tensor:
        """Post-RoPE rows x (..., D) moved forward by `deltas` (...,) in [0, largest] positions (see `shift`)."""
        cos, sin = self.cos_sin(deltas, largest)  # (..., D)
        return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)

    def rotate_back(self, x: torch.Tensor, deltas: torch.Tensor, largest: int) -> torch.Tensor:
        """Post-RoPE rows x (..., D) moved back by `deltas` (..., broadcast to x's rows) in [0, largest]
        positions: the inverse rotation, cos - sin (`shift` by -deltas)."""
        return self.turn_back(x, *self.cos_sin(deltas, largest))

    @staticmethod
    def turn_back(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """rotate_back with its cos, sin (cos_sin of the deltas) made once for many rows."""
        return (x.float() * cos - rotate_half(x.float()) * sin).to(x.dtype)
