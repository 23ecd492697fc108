"""spotlight/positions.py: RoPE angles exact at large positions; a cached key moved by the
position difference equals RoPE at the new position (issue #21)."""
import math

import numpy as np
import torch

from spotlight.config import ModelArgs
from spotlight.model import apply_rope, rope_inv_freq
from spotlight.positions import Rotations, rope_angles, shift

ARGS = ModelArgs(vocab_size=16, dim=128, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=64,
                 intermediate_size=64, max_seq_len=8192, norm_eps=1e-6, rope_theta=100000.0)
POSITIONS = torch.tensor([0, 1, 4095, 8191, 65_537, 131_071, 524_289, 1_000_003, 1_048_575])


def test_angles_at_a_million_positions_match_exact_trigonometry():
    inv_freq = rope_inv_freq(ARGS)  # (D/2,) float32
    cos, sin = rope_angles(inv_freq, POSITIONS)
    for row, p in enumerate(POSITIONS.tolist()):
        for i, f in enumerate(inv_freq.tolist()):
            exact = p * f  # an int times a float32 value: exact in float64
            assert abs(cos[row, i].item() - math.cos(exact)) <= 1e-7, (p, i)
            assert abs(sin[row, i + ARGS.head_dim // 2].item() - math.sin(exact)) <= 1e-7, (p, i)


def test_a_key_moved_by_the_position_difference_equals_rope_at_the_new_position():
    torch.manual_seed(0)
    inv_freq = rope_inv_freq(ARGS)
    raw = torch.randn(3, len(POSITIONS), ARGS.head_dim)  # (Hkv, T, D) keys before RoPE
    for delta in (-4096, 7, 900_001):
        targets = POSITIONS + delta
        keep = targets >= 0
        at_old = apply_rope(raw[:, keep], *rope_angles(inv_freq, POSITIONS[keep]))  # (Hkv, T', D) as cached
        at_new = apply_rope(raw[:, keep], *rope_angles(inv_freq, targets[keep]))
        moved = shift(at_old, delta, inv_freq)
        assert torch.allclose(moved, at_new, atol=2e-5, rtol=0), (delta, (moved - at_new).abs().max())


def test_per_row_shifts_keep_scores_a_function_of_distance():
    """Query at q_pos, keys re-positioned to q_pos - distance: the score is the one RoPE gives at
    that distance, whatever the keys' original positions were."""
    torch.manual_seed(1)
    inv_freq = rope_inv_freq(ARGS)
    q_raw, k_raw = torch.randn(1, 1, ARGS.head_dim), torch.randn(1, 4, ARGS.head_dim)
    original = torch.tensor([10, 500_000, 700_123, 999_999])
    new = torch.tensor([8000, 8100, 8150, 8190])
    cached = apply_rope(k_raw, *rope_angles(inv_freq, original))
    moved = shift(cached, new - original, inv_freq)
    q = apply_rope(q_raw, *rope_angles(inv_freq, torch.tensor([8191])))
    expected = apply_rope(k_raw, *rope_angles(inv_freq, new))
    assert torch.allclose(q @ moved.transpose(-1, -2), q @ expected.transpose(-1, -2), atol=1e-4, rtol=0)


def test_rotations_from_two_tables_equal_float64_angles_up_to_a_million():
    inv_freq = rope_inv_freq(ARGS)
    rotations = Rotations(inv_freq, block=1024)
    cos, sin = rotations.cos_sin(POSITIONS, largest=int(POSITIONS.max()))
    exact_cos, exact_sin = rope_angles(inv_freq, POSITIONS, dtype=torch.float64)
    assert cos.dtype == torch.float32
    torch.testing.assert_close((cos.double(), sin.double()), (exact_cos, exact_sin), rtol=0, atol=1e-6)


def test_host_tables_are_the_cpu_tables_as_numpy_and_grow_with_them():
    rotations = Rotations(rope_inv_freq(ARGS), block=256)
    lo, hi = rotations.host_tables(1000)
    assert (lo.dtype, hi.shape[0] * 256 > 1000) == (np.float32, True)
    torch.testing.assert_close((torch.from_numpy(lo), torch.from_numpy(hi)), rotations.tables(1000, "cpu"), rtol=0, atol=0)
    lo, hi = rotations.host_tables(100_000)  # the high table grew: new views
    assert hi.shape[0] * 256 > 100_000
    torch.testing.assert_close(torch.from_numpy(hi), rotations.tables(100_000, "cpu")[1], rtol=0, atol=0)


def test_a_key_rotated_in_fp32_by_the_tables_equals_rope_at_the_new_position_in_float64():
    torch.manual_seed(2)
    inv_freq = rope_inv_freq(ARGS)
    raw = torch.randn(2, len(POSITIONS), ARGS.head_dim, dtype=torch.float64)  # (Hkv, T, D)
    cached = apply_rope(raw, *rope_angles(inv_freq, POSITIONS, dtype=torch.float64))
    moves = torch.arange(len(POSITIONS)) * 124_999 + 7  # (T,) forward, up to 1,000,000
    target = POSITIONS + moves
    moved = Rotations(inv_freq).rotate(cached.float(), moves.expand(2, -1), largest=int(moves.max()))
    at_new = apply_rope(raw, *rope_angles(inv_freq, target, dtype=torch.float64))
    torch.testing.assert_close(moved.double(), at_new, rtol=0, atol=2e-5)
    torch.testing.assert_close(shift(cached, target - POSITIONS, inv_freq), at_new, rtol=0, atol=1e-9)


def test_a_query_turned_back_in_fp32_equals_rope_at_the_earlier_position():
    torch.manual_seed(3)
    inv_freq = rope_inv_freq(ARGS)
    raw = torch.randn(3, len(POSITIONS), ARGS.head_dim, dtype=torch.float64)  # (H, T, D)
    at = POSITIONS + 1_000_000
    cached = apply_rope(raw, *rope_angles(inv_freq, at, dtype=torch.float64))
    back = torch.arange(len(POSITIONS)) * 99_991  # (T,) up to ~700K back
    turned = Rotations(inv_freq).rotate_back(cached.float(), back, largest=int(back.max()))
    expected = apply_rope(raw, *rope_angles(inv_freq, at - back, dtype=torch.float64))
    torch.testing.assert_close(turned.double(), expected, rtol=0, atol=2e-5)
