"""Two-level retrieval kernels (CPU): span summaries, span scores, and top-k over token ranges.

Shape legend: H query heads, Hkv KV heads, G = H / Hkv, W words, B = 64 W bit positions,
N code-buffer capacity, n valid tokens, S spans, R ranges per head (R <= 2 S + 1), K selected.

A span is a stored run of tokens [start, end) of the cache with a summary per layer and KV head: ones[h, s, b],
how many of its tokens have bit b set. With Q[h, b] = how many of the head's G query codes have
bit b set, the span's total score (sum over its tokens of the token scores of kernels.cpu) is

    sum_b  Q_b ones_b + (G - Q_b)(len - ones_b)  =  G (B len - sum_b ones_b) + sum_b Q_b (2 ones_b - len)

so its mean token score, the expected score of a token drawn from it, costs one dot product.

    bit_counts(k_codes, lo, hi, out)        out[h, b] += #tokens t in [lo, hi) with bit b set
    span_scores(q_codes, ones, lengths)     mean token score per (head, span), float64 (Hkv, S)
    pick_ranges(...)                        per head: best spans until their middle tokens
                                            reach `need`, plus every token outside spans
    ranges_score_select(...)                kernels.score_select restricted to each head's ranges

Selection semantics are the flat scan's (kernels/cpu.py): forced sinks and window, the top
`retrieved` of the scanned middle tokens by (score desc, index asc), ascending. When the ranges
cover the whole middle the result equals `score_select` exactly. Every head must scan at least
`retrieved` middle tokens, so K is the flat layout's and the same for every head.
"""
from __future__ import annotations

import functools

import numpy as np

from .cpu import (HAVE_NUMBA, WORD_BITS, Scratch, _numba_threads, as_codes, as_numpy, check_codes, fill_forced,
                  make_scratch, result, selection_layout, tags)


def _append_range(range_lo, range_hi, count, a, b):
    """Append [a, b) after the `count` ranges (merged with the last one when adjacent)."""
    if count and range_hi[count - 1] == a:
        range_hi[count - 1] = b
        return count
    range_lo[count], range_hi[count] = a, b
    return count + 1


def _scanned_tokens(range_lo, range_hi, range_count, lo, hi):
    """Fewest tokens any head scans, or -1 when some head's ranges are not ascending, disjoint, in [lo, hi)."""
    fewest = hi - lo
    for h in range(range_count.size):
        total, cursor = 0, lo
        for i in range(range_count[h]):
            a, b = range_lo[h, i], range_hi[h, i]
            if a < cursor or b < a or b > hi:
                return -1
            total += b - a
            cursor = b
        fewest = min(fewest, total)
    return fewest


COUNT_RUN = 8192  # tokens per pass of bit_counts


@functools.cache
def jitted():
    """kernels/ranges_jit.py, this module's numba kernels, imported at the first call that runs one
    (as kernels/cpu.py's `jitted`)."""
    from . import ranges_jit

    return ranges_jit


def bit_counts(k_codes, lo: int, hi: int, out) -> np.ndarray:
    """out (Hkv, B) int32 += per-bit counts of the codes of tokens [lo, hi) of k_codes (Hkv, W, N)."""
    k = as_codes(k_codes, "k_codes")
    dest = as_numpy(out)
    if dest.shape != (k.shape[0], k.shape[1] * WORD_BITS) or dest.dtype != np.int32 or not 0 <= lo <= hi <= k.shape[2]:
        raise ValueError(f"need out int32 (Hkv, 64 W) and 0 <= lo <= hi <= N; got {dest.dtype} {dest.shape}, {lo}, {hi}")
    # numpy, in runs of COUNT_RUN tokens (a few MiB of unpacked bits): 8K tokens of Qwen2.5's layer in
    # ~1.5 ms, where a numba loop took ~1.1; a stored span's summary is not worth loading numba for
    for t0 in range(lo, hi, COUNT_RUN):
        t1 = min(t0 + COUNT_RUN, hi)
        bits = np.unpackbits(k[:, :, t0:t1].view(np.uint8).reshape(k.shape[0], k.shape[1], t1 - t0, 8), axis=3,
                             bitorder="little")  # (Hkv, W, T, 64)
        dest += bits.sum(2, dtype=np.int32).reshape(dest.shape)
    return dest


def span_scores(q_codes, ones, lengths, out=None, *, jit: bool = True) -> np.ndarray:
    """Mean token score of each span, float64 (Hkv, S); ones (Hkv, >= S, B) int32, lengths (S,) int64.

    A span of length 0 scores -1 (below every real score). jit=False: the numpy form (the tests'
    reference for the numba kernel), also where numba is not installed.
    """
    q = as_codes(q_codes, "q_codes")
    counts, sizes = as_numpy(ones), np.asarray(lengths, np.int64)
    hkv = counts.shape[0]
    if q.shape[0] % hkv or counts.shape[2] != q.shape[1] * WORD_BITS or counts.shape[1] < sizes.size:
        raise ValueError(f"q_codes {q.shape}, ones {counts.shape} and {sizes.size} lengths do not match")
    dest = result(out, (hkv, sizes.size), np.float64)
    if jit and HAVE_NUMBA:
        jitted()._span_scores(q, counts, sizes, q.shape[0] // hkv, dest)
    else:
        bits = np.unpackbits(q.view(np.uint8), axis=1, bitorder="little").reshape(hkv, -1, counts.shape[2])
        per_bit = bits.sum(1).astype(np.int64)  # (Hkv, B): Q_b
        ones_s = counts[:, : sizes.size].astype(np.int64)  # (Hkv, S, B)
        group, width = bits.shape[1], counts.shape[2]
        total = (group * (width * sizes - ones_s.sum(2)) + 2 * np.einsum("hb,hsb->hs", per_bit, ones_s)
                 - sizes * per_bit.sum(1, keepdims=True))
        dest[...] = np.where(sizes > 0, total / np.maximum(sizes, 1), -1.0)
    return dest


def pick_ranges(scores, starts, ends, lo: int, hi: int, need: int, range_lo, range_hi, range_count, *,
                jit: bool = True) -> None:
    """Ranges (ascending, disjoint, within [lo, hi)) each head scans: every token outside the spans,
    and the best spans by (score desc, index asc) until their tokens in [lo, hi) reach `need`.

    scores (Hkv, S) float64; starts, ends (S,) int64 ascending and disjoint; range_lo / range_hi
    (Hkv, >= 2 S + 1) int64 and range_count (Hkv,) int64 are written. jit=False: the numpy form.
    """
    s, a, b = as_numpy(scores), np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    if s.shape[1] != a.size or a.size != b.size or range_lo.shape[1] < 2 * a.size + 1:
        raise ValueError(f"scores {s.shape}, {a.size} starts, {b.size} ends and {range_lo.shape[1]} range slots")
    if jit and HAVE_NUMBA:
        jitted()._pick_ranges(s, a, b, lo, hi, need, range_lo, range_hi, range_count)
        return
    for h in range(s.shape[0]):
        chosen, covered = np.zeros(a.size, bool), 0
        for seg in np.argsort(-s[h], kind="stable"):
            if covered >= need:
                break
            width = min(b[seg], hi) - max(a[seg], lo)
            chosen[seg], covered = width > 0, covered + max(width, 0)
        scanned = np.ones(max(hi - lo, 0), bool)  # (hi - lo,): token lo + i is scanned
        for seg in np.flatnonzero(~chosen):
            scanned[max(a[seg], lo) - lo : max(min(b[seg], hi) - lo, 0)] = False
        edges = np.flatnonzero(np.diff(np.r_[0, scanned.astype(np.int8), 0]))  # run starts and ends
        range_lo[h, : edges.size // 2], range_hi[h, : edges.size // 2] = edges[::2] + lo, edges[1::2] + lo
        range_count[h] = edges.size // 2


def ranges_score_select(q_codes, k_codes, n: int, range_lo, range_hi, range_count, k: int, sinks: int, window: int,
                        out=None, scratch: Scratch | None = None, *, jit: bool = True) -> np.ndarray:
    """int32 (Hkv, K) ascending: sinks, window, and the top-k tokens of each head's ranges.

    range_lo / range_hi (Hkv, R) int64, range_count (Hkv,): head h scans [range_lo[h, i],
    range_hi[h, i]) for i < range_count[h], ascending, disjoint, inside [sinks, n - window).
    Each head must scan at least min(k, middle) tokens. scratch: kernels.make_scratch(q, k).
    """
    q, kc = as_codes(q_codes, "q_codes"), as_codes(k_codes, "k_codes")
    hkv, group, words = check_codes(q, kc, n)
    layout = selection_layout(n, k, sinks, window)
    dest = result(out, (hkv, layout.size), np.int32)
    lo_, hi_, count_ = (np.asarray(a, np.int64) for a in (range_lo, range_hi, range_count))
    if lo_.shape != hi_.shape or lo_.shape[0] != hkv or count_.shape != (hkv,) or (count_ > lo_.shape[1]).any():
        raise ValueError(f"range_lo / range_hi must be (Hkv, R) = ({hkv}, R) and range_count (Hkv,) <= R")
    fewest = (jitted()._scanned_tokens if jit and HAVE_NUMBA else _scanned_tokens)(lo_, hi_, count_, layout.sinks_end,
                                                                              layout.window_start)
    if fewest < layout.retrieved:
        raise ValueError(f"ranges must be ascending, disjoint, inside [{layout.sinks_end}, {layout.window_start}) "
                         f"and hold >= {layout.retrieved} tokens per head (fewest: {fewest}, -1: misplaced)")
    from .cpu import _fill_all

    if layout.retrieved in (0, layout.middle):
        _fill_all(dest, layout)
        return dest
    if not (jit and HAVE_NUMBA):
        return _ranges_numpy(q, kc, n, lo_, hi_, count_, layout, dest)
    buf, chunks = scratch if scratch is not None else make_scratch(q, kc), min(_numba_threads(), hkv)
    if not buf.fits(hkv, group * words * WORD_BITS + 1, n, chunks):
        raise ValueError("scratch was made for other q_codes / k_codes shapes: call make_scratch again")
    hist = buf.hist if buf.hist.shape[0] >= 4 * chunks else np.empty((4 * chunks, buf.hist.shape[1]), np.int64)
    jitted()._ranges_score_select(buf.query_words(q[None], hkv, group, words), kc, lo_, hi_, count_, layout, chunks,
                                  buf.tile, buf.flags, hist, buf.cand_index, buf.cand_score, dest, *tags(group, words))
    fill_forced(dest, layout)
    return dest


def _ranges_numpy(q, kc, n, lo_, hi_, count_, layout, dest) -> np.ndarray:
    from .cpu import scores

    s = scores(q, kc, n, jit=False)  # (Hkv, n)
    fill_forced(dest, layout)
    for h in range(kc.shape[0]):
        idx = np.concatenate([np.arange(lo_[h, i], hi_[h, i]) for i in range(count_[h])] or [np.zeros(0, np.int64)])
        order = np.lexsort((idx, -s[h, idx]))[: layout.retrieved]  # (score desc, index asc)
        dest[h, layout.sinks_end : layout.sinks_end + layout.retrieved] = np.sort(idx[order])
    return dest


__all__ = ["bit_counts", "span_scores", "pick_ranges", "ranges_score_select"]
