"""numba kernels of kernels/ranges.py (two-level retrieval), imported at their first use
(`ranges.jitted`), as kernels/cpu_jit.py is: numba is not loaded by a process that never runs them.
Semantics and shapes: kernels/ranges.py."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu import WORD_BITS
from .cpu_jit import _collect, _histogram_cut, _tile_scores
from .ranges import _append_range as _append_range_py
from .ranges import _scanned_tokens as _scanned_tokens_py

_append_range = njit(cache=True)(_append_range_py)
_scanned_tokens = njit(cache=True)(_scanned_tokens_py)


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
