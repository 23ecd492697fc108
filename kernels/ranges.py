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

import numpy as np

from .cpu import (HAVE_NUMBA, WORD_BITS, Scratch, as_codes, as_numpy, check_codes, make_scratch, result,
                  selection_layout)


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


if HAVE_NUMBA:  # the plain Python functions above are also the no-numba fallback
    from numba import njit, prange

    _append_range = njit(cache=True)(_append_range)
    _scanned_tokens = njit(cache=True)(_scanned_tokens)

    from .cpu import _collect, _fill_forced, _histogram_cut, _numba_threads, _tile_scores, tags

    @njit(cache=True)
    def _bit_counts(k, lo, hi, out):
        hkv, words, _ = k.shape
        for h in range(hkv):
            for w in range(words):
                for j in range(WORD_BITS):
                    total = 0
                    for t in range(lo, hi):
                        total += np.int64((k[h, w, t] >> np.uint64(j)) & np.uint64(1))
                    out[h, WORD_BITS * w + j] += total

    @njit(cache=True)
    def _span_scores(q, ones, lengths, group, out):
        hkv, _, bits = ones.shape
        counts = np.zeros(bits, np.int64)  # Q_b of one head
        for h in range(hkv):
            counts[:] = 0
            for g in range(group):
                for b in range(bits):
                    counts[b] += np.int64((q[h * group + g, b // WORD_BITS] >> np.uint64(b % WORD_BITS)) & np.uint64(1))
            q_total = counts.sum()
            for s in range(lengths.size):
                size = lengths[s]
                dot, set_bits = 0, 0
                for b in range(bits):
                    dot += counts[b] * ones[h, s, b]
                    set_bits += ones[h, s, b]
                total = group * (bits * size - set_bits) + 2 * dot - size * q_total
                out[h, s] = total / size if size > 0 else -1.0

    @njit(cache=True)
    def _best_first(scores, width, need):
        """Range indices by (score desc, index asc), enough of them to cover `need` tokens of `width`.

        Only the spans scoring at least the c-th best are sorted, c = the most spans `need` can
        take (need / the narrowest non-empty width + 1): the same prefix as a full stable sort.
        """
        narrowest = width.max()
        for s in range(width.size):
            if width[s] > 0:
                narrowest = min(narrowest, width[s])
        c = min(width.size, need // max(narrowest, 1) + 1)
        key = np.where(width > 0, -scores, np.inf)  # empty spans last
        if c < width.size:
            top = np.partition(key, c - 1)[c - 1]
            pool = np.flatnonzero(key <= top)  # ascending indices: ties keep index order below
        else:
            pool = np.arange(width.size)
        return pool[np.argsort(key[pool], kind="mergesort")]

    @njit(cache=True)
    def _pick_ranges(scores, starts, ends, lo, hi, need, range_lo, range_hi, range_count):
        """Per head: spans by (score desc, index asc) until their [lo, hi) tokens reach `need`."""
        hkv, spans = scores.shape
        chosen = np.zeros(spans, np.bool_)
        width = np.maximum(np.minimum(ends, hi) - np.maximum(starts, lo), 0)  # (S,) tokens in [lo, hi)
        for h in range(hkv):
            chosen[:] = False
            covered = 0
            for s in _best_first(scores[h], width, need):
                if covered >= need:
                    break
                if width[s] > 0:
                    chosen[s] = True
                    covered += width[s]
            count, cursor = 0, lo
            for s in range(spans + 1):  # the gap before each span, the span if chosen; the tail
                a = min(max(starts[s], lo), hi) if s < spans else hi
                b = min(max(ends[s], lo), hi) if s < spans else hi
                if cursor < a:
                    count = _append_range(range_lo[h], range_hi[h], count, cursor, a)
                if a < b and chosen[s]:
                    count = _append_range(range_lo[h], range_hi[h], count, a, b)
                cursor = max(cursor, b)
            range_count[h] = count

    @njit(cache=True)
    def _histogram_ranges(qh, kf, capacity, range_lo, range_hi, count, tile, flags, hist, g_tag, w_tag):
        """hist[v] = how many tokens of the ranges score v (pass 1: scores only, nothing kept).

        NOTE: four interleaved sub-histograms (in hist's spare rows of bins) avoid the store-to-load
        stalls of consecutive equal scores; they are summed into hist[0] at the end.
        """
        bins = hist.shape[1]
        hist[:4] = 0
        for i in range(count):
            for t0 in range(range_lo[i], range_hi[i], tile.size):
                size = min(tile.size, range_hi[i] - t0)
                _tile_scores(qh, kf, capacity, t0, size, -1, tile, flags, g_tag, w_tag)
                for j in range(size):
                    hist[j & 3, tile[j]] += 1
        for v in range(bins):
            hist[0, v] += hist[1, v] + hist[2, v] + hist[3, v]

    @njit(cache=True)
    def _select_ranges(qh, kf, capacity, range_lo, range_hi, count, r, tile, flags, hist, cand_index, cand_score,
                       dest, g_tag, w_tag):
        """Top r of the ranges' tokens by (score desc, index asc), ascending, into dest (r,): pass 1 finds
        the cut from a histogram, pass 2 re-scores and keeps the tokens at or above it, in index order."""
        _histogram_ranges(qh, kf, capacity, range_lo, range_hi, count, tile, flags, hist, g_tag, w_tag)
        cut, above = _histogram_cut(hist[0], r)
        kept = 0
        for i in range(count):
            for t0 in range(range_lo[i], range_hi[i], tile.size):
                size = min(tile.size, range_hi[i] - t0)
                _tile_scores(qh, kf, capacity, t0, size, cut - 1, tile, flags, g_tag, w_tag)
                kept = _collect(tile, flags, size, t0, cand_index, cand_score, kept)
        ties, taken_ties, j = r - above, 0, 0
        for i in range(kept):  # candidates score >= cut; the first `ties` at the cut are taken
            if j == r:
                return
            tie = cand_score[i] == cut
            dest[j] = cand_index[i]
            j += (~tie) | (taken_ties < ties)
            taken_ties += tie

    @njit(parallel=True, cache=True)
    def _ranges_score_select(qn, k, range_lo, range_hi, range_count, layout, chunks, tile, flags, hist, cand_index,
                             cand_score, out, g_tag, w_tag):
        """qn (Hkv, 1, L): the codes' `cpu.query_words` (the form `_tile_scores` reads)."""
        hkv, _, capacity = k.shape
        n, sinks_end, window_start, r = layout
        for c in prange(chunks):
            for h in range(c * hkv // chunks, (c + 1) * hkv // chunks):
                _select_ranges(qn[h, 0], k[h].ravel(), capacity, range_lo[h], range_hi[h], range_count[h], r, tile[c],
                               flags[c], hist[4 * c : 4 * c + 4], cand_index[h], cand_score[h],
                               out[h, sinks_end : sinks_end + r], g_tag, w_tag)


def bit_counts(k_codes, lo: int, hi: int, out) -> np.ndarray:
    """out (Hkv, B) int32 += per-bit counts of the codes of tokens [lo, hi) of k_codes (Hkv, W, N)."""
    k = as_codes(k_codes, "k_codes")
    dest = as_numpy(out)
    if dest.shape != (k.shape[0], k.shape[1] * WORD_BITS) or dest.dtype != np.int32 or not 0 <= lo <= hi <= k.shape[2]:
        raise ValueError(f"need out int32 (Hkv, 64 W) and 0 <= lo <= hi <= N; got {dest.dtype} {dest.shape}, {lo}, {hi}")
    if HAVE_NUMBA:
        _bit_counts(k, lo, hi, dest)
    else:
        bits = np.unpackbits(k[:, :, lo:hi].view(np.uint8).reshape(k.shape[0], k.shape[1], hi - lo, 8), axis=3,
                             bitorder="little")  # (Hkv, W, T, 64)
        dest += bits.sum(2, dtype=np.int32).reshape(dest.shape)
    return dest


def span_scores(q_codes, ones, lengths, out=None) -> np.ndarray:
    """Mean token score of each span, float64 (Hkv, S); ones (Hkv, >= S, B) int32, lengths (S,) int64.

    A span of length 0 scores -1 (below every real score).
    """
    q = as_codes(q_codes, "q_codes")
    counts, sizes = as_numpy(ones), np.asarray(lengths, np.int64)
    hkv = counts.shape[0]
    if q.shape[0] % hkv or counts.shape[2] != q.shape[1] * WORD_BITS or counts.shape[1] < sizes.size:
        raise ValueError(f"q_codes {q.shape}, ones {counts.shape} and {sizes.size} lengths do not match")
    dest = result(out, (hkv, sizes.size), np.float64)
    if HAVE_NUMBA:
        _span_scores(q, counts, sizes, q.shape[0] // hkv, dest)
    else:
        bits = np.unpackbits(q.view(np.uint8), axis=1, bitorder="little").reshape(hkv, -1, counts.shape[2])
        per_bit = bits.sum(1).astype(np.int64)  # (Hkv, B): Q_b
        ones_s = counts[:, : sizes.size].astype(np.int64)  # (Hkv, S, B)
        group, width = bits.shape[1], counts.shape[2]
        total = (group * (width * sizes - ones_s.sum(2)) + 2 * np.einsum("hb,hsb->hs", per_bit, ones_s)
                 - sizes * per_bit.sum(1, keepdims=True))
        dest[...] = np.where(sizes > 0, total / np.maximum(sizes, 1), -1.0)
    return dest


def pick_ranges(scores, starts, ends, lo: int, hi: int, need: int, range_lo, range_hi, range_count) -> None:
    """Ranges (ascending, disjoint, within [lo, hi)) each head scans: every token outside the spans,
    and the best spans by (score desc, index asc) until their tokens in [lo, hi) reach `need`.

    scores (Hkv, S) float64; starts, ends (S,) int64 ascending and disjoint; range_lo / range_hi
    (Hkv, >= 2 S + 1) int64 and range_count (Hkv,) int64 are written.
    """
    s, a, b = as_numpy(scores), np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    if s.shape[1] != a.size or a.size != b.size or range_lo.shape[1] < 2 * a.size + 1:
        raise ValueError(f"scores {s.shape}, {a.size} starts, {b.size} ends and {range_lo.shape[1]} range slots")
    if HAVE_NUMBA:
        _pick_ranges(s, a, b, lo, hi, need, range_lo, range_hi, range_count)
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
    fewest = _scanned_tokens(lo_, hi_, count_, layout.sinks_end, layout.window_start)
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
    _ranges_score_select(buf.query_words(q[None], hkv, group, words), kc, lo_, hi_, count_, layout, chunks, buf.tile, buf.flags, hist, buf.cand_index,
                         buf.cand_score, dest, *tags(group, words))
    _fill_forced(dest, *layout)
    return dest


def _ranges_numpy(q, kc, n, lo_, hi_, count_, layout, dest) -> np.ndarray:
    from .cpu import _fill_forced_numpy, scores

    s = scores(q, kc, n, jit=False)  # (Hkv, n)
    _fill_forced_numpy(dest, layout)
    for h in range(kc.shape[0]):
        idx = np.concatenate([np.arange(lo_[h, i], hi_[h, i]) for i in range(count_[h])] or [np.zeros(0, np.int64)])
        order = np.lexsort((idx, -s[h, idx]))[: layout.retrieved]  # (score desc, index asc)
        dest[h, layout.sinks_end : layout.sinks_end + layout.retrieved] = np.sort(idx[order])
    return dest


__all__ = ["bit_counts", "span_scores", "pick_ranges", "ranges_score_select"]
