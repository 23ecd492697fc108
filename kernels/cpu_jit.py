"""numba kernels of kernels/cpu.py: the word-major scan, its selection and the score rows.

kernels/cpu.py holds the semantics, the checks and the numpy fallback; it imports this module at
the first call that runs one of these kernels (`cpu.jitted`), never at its own import: importing
numba maps ~54 MiB (its LLVM library and compiler state) that the app's default CPU path, which
runs the compiled C kernels (kernels/scan.c, encode.c, attend.c, quant.c), never needs
(docs/DECISIONS.md, "numba off the default path"). Shape legend and measurements: kernels/cpu.py.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, set_num_threads, types  # noqa: F401  (set_num_threads: cpu._numba_threads)
from numba.extending import intrinsic

from .cpu import GATHER_BYTE_BITS, SAMPLE_RUN, SAMPLE_RUNS, TILE, WORD_BITS
from .cpu import _plane_count as _plane_count_py

# `query_width`'s plane count, inlined where the scan reads it (a compile-time constant for constant G)
_plane_count = njit(inline="always")(_plane_count_py)


@intrinsic
def popcount(typingctx, x):
    """llvm.ctpop on uint64: VPOPCNTQ / POPCNT / pshufb nibble counts, as the CPU allows."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def trailing_zeros(typingctx, x):
    """llvm.cttz on a non-zero uint64 (TZCNT)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen


@njit(cache=True)
def _query_words_jit(q, hkv, out, g_tag, w_tag):
    """out (Hkv, R, L) = `query_words` of q (R, H, W)."""
    G, W = len(g_tag), len(w_tag)
    P = _plane_count(G)
    for r in range(q.shape[0]):
        for h in range(hkv):
            if P == 0:
                for g in range(G):
                    for w in range(W):
                        out[h, r, g * W + w] = ~q[r, h * G + g, w]
                continue
            matches = np.int64(G * W * WORD_BITS)  # every bit matches G queries where the key's is 0 ...
            for w in range(W):
                for p in range(P):
                    out[h, r, p * W + w] = 0
                for g in range(G):  # ripple-carry add of the G query words into the planes
                    carry = q[r, h * G + g, w]
                    matches -= np.int64(popcount(carry))  # ... but those with the bit set
                    for p in range(P):
                        plane = out[h, r, p * W + w]
                        out[h, r, p * W + w] = plane ^ carry
                        carry = plane & carry
            out[h, r, P * W] = np.uint64(matches)


@njit(cache=True)
def _tile_scores(qh, kf, capacity, t0, count, bound, tile, flags, g_tag, w_tag):
    """tile[i] = score of token t0 + i of one head, flags[i] = tile[i] > bound.

    qh (L,) the head's `query_words`, kf (W * N,) the head's code planes. With G and W
    constant, LLVM unrolls the (w, g) or (w, plane) loops and vectorises over tokens. The
    plane form: where c_b of the G queries set bit b, a key matching bit b set scores c_b and
    one with it clear G - c_b, so score = sum_b (G - c_b) + 2 sum_b k_b c_b - G popcount(k),
    and sum_b k_b c_b = sum_p 2^p popcount(k & plane_p): P + 1 popcounts a word instead of G.
    """
    G, W = len(g_tag), len(w_tag)
    P = _plane_count(G)
    if P == 0:
        for i in range(np.uint64(count)):  # unsigned index: no wraparound test, hence no gathers
            s = np.uint64(0)
            for w in range(W):
                x = kf[np.uint64(w * capacity + t0) + i]
                for g in range(G):
                    s += popcount(qh[g * W + w] ^ x)
            v = np.int32(s)
            tile[i] = v
            flags[i] = v > bound
        return
    base = np.int64(qh[P * W])
    for i in range(np.uint64(count)):
        s = base
        for w in range(W):
            x = kf[np.uint64(w * capacity + t0) + i]
            t = np.int64(0)
            for p in range(P):
                t += np.int64(popcount(qh[p * W + w] & x)) << np.int64(p + 1)
            s += t - np.int64(G) * np.int64(popcount(x))
        v = np.int32(s)
        tile[i] = v
        flags[i] = v > bound


@njit(cache=True)
def _tile_flags(row, t0, count, bound, flags):
    """flags[i] = row[t0 + i] > bound."""
    for i in range(count):
        flags[i] = row[t0 + i] > bound


@njit(cache=True)
def _collect(tile, flags, count, t0, cand_index, cand_score, kept):
    """Append the flagged tokens of a tile (t0 + i, tile[i]) in order; returns the new total.

    The 0/1 flag bytes become one 64-bit mask per 64 tokens (a multiply gathers bit 0 of
    each of 8 bytes into the top byte), whose set bits are walked with TZCNT: time goes to
    the flagged tokens, with about one mispredicted branch per 64 tokens.
    """
    flags[count : -(-count // 64) * 64] = 0
    words = flags.view(np.uint64)
    for j in range(-(-count // 64)):
        bits = np.uint64(0)
        for b in range(8):
            bits |= ((words[8 * j + b] * GATHER_BYTE_BITS) >> np.uint64(56)) << np.uint64(8 * b)
        while bits:
            i = 64 * j + np.int64(trailing_zeros(bits))
            cand_index[kept] = t0 + i
            cand_score[kept] = tile[i]
            kept += 1
            bits &= bits - np.uint64(1)
    return kept


@njit(cache=True)
def _raise_bound(hist, cand_score, start, kept, bound, above, r):
    """Count the new candidates, then raise the bound while >= r tokens score above it."""
    for j in range(start, kept):
        hist[cand_score[j]] += 1
    above += kept - start
    while above >= r:
        bound += 1
        above -= hist[bound]
    return bound, above


@njit(cache=True)
def _scan_codes(qhs, starts, kf, capacity, lo, hi, r, start_bound, tile, flags, hist, cand_index, cand_score,
                g_tag, w_tag):
    """Candidates of tokens [lo, hi) of one head scoring above start_bound (-1: all), scored from
    codes, in index order; returns how many. Token t is scored with the query words qhs[j]
    (R, L) of its block (`query_words`), starts[j] <= t < starts[j + 1] (the flat scan: one block).

    NOTE: a token is dropped only when at least r earlier tokens of the range score >= it (it
    then ranks below r tokens in (score desc, index asc) order and cannot be selected), or when
    it scores <= start_bound (the caller checks that >= r tokens scored above that bound).
    `bound` is the r-th best score seen so far or start_bound, whichever is higher, raised after
    each tile; `hist` counts the kept candidates, all the seen tokens above the old bound.
    """
    hist[:] = 0
    bound, above, kept, t0 = start_bound, 0, 0, lo  # above = candidates scoring >= bound + 1
    j = 0
    while t0 < hi:
        while starts[j + 1] <= t0:
            j += 1
        count = min(_tile_size(t0 - lo, hi - t0, r), starts[j + 1] - t0)  # no tile straddles two blocks
        _tile_scores(qhs[j], kf, capacity, t0, count, bound, tile, flags, g_tag, w_tag)
        start = kept
        kept = _collect(tile, flags, count, t0, cand_index, cand_score, kept)
        bound, above = _raise_bound(hist, cand_score, start, kept, bound, above, r)
        t0 += count
    return kept


@njit(cache=True)
def _sample_bound(qhs, starts, kf, capacity, sinks_end, m, r, runs, halves, tile, flags, hist, g_tag, w_tag):
    """A starting bound for the scan of one head's middle [sinks_end, sinks_end + m): the score
    above which `runs` evenly spread runs of the SAMPLE_RUNS * SAMPLE_RUN sampled tokens hold
    `halves` / 2 times their share of r (+ 16), minus 1; -1 (keep everything) when that share
    is most of the sample. Called only for a middle of at least SAMPLE_FROM tokens and at least
    SAMPLE_K selected (`score_select`). The flat scan samples SAMPLE_RUNS runs for 1.5x its
    share; a folded one (R blocks, whose scores differ block to block) at least two runs per
    block for 2.5x (`_sample_runs`, `_sample_halves`).

    Only a speed-up: with r = 10 % of the middle the running bound alone keeps ~3.3 r
    candidates, 1.5x ~1.7 r. Whether >= r tokens really score above it is checked after
    the scan (`_short_heads`), and a head short of them is scanned again from -1. A run is
    scored with the query words of the block it starts in (an estimate either way).
    """
    run = SAMPLE_RUNS * SAMPLE_RUN // runs
    total = runs * run
    want = (halves * total * r) // (2 * m) + 16
    if want >= total:
        return -1
    hist[:] = 0
    block = 0
    for i in range(runs):
        t0 = sinks_end + i * (m - run) // (runs - 1)
        while starts[block + 1] <= t0:
            block += 1
        _tile_scores(qhs[block], kf, capacity, t0, run, -1, tile, flags, g_tag, w_tag)
        for j in range(run):
            hist[tile[j]] += 1
    seen = 0
    for v in range(hist.size - 1, -1, -1):
        seen += hist[v]
        if seen >= want:
            return v - 1
    return -1


@njit(cache=True)
def _short_heads(bounds, counts, chunks, hkv, m, r):
    """Leave bounds[h] = -1 for each head whose pieces kept fewer than r candidates above a
    sampled bound (more of its tokens may belong to the selection) and -2 for the others (done);
    returns whether any head is left to scan again."""
    any_short = False
    for h in range(hkv):
        if bounds[h] < 0:
            bounds[h] = -2
            continue
        kept = 0
        for c in range(chunks):
            lo, hi = _piece(c, h, chunks, hkv, m)
            if lo < hi:
                kept += counts[c + h]
        if kept < r:
            bounds[h] = -1
            any_short = True
        else:
            bounds[h] = -2
    return any_short


@njit(cache=True)
def _tile_size(seen, left, r):
    """Tokens in the next tile: small while few tokens are seen, so the bound rises early."""
    return min(left, TILE, max(64, (max(r, seen // 2) + 63) // 64 * 64))


@njit(cache=True)
def _scan_scores(row, lo, hi, r, flags, hist, cand_index, cand_score):
    """_scan_codes for given scores row (N,)."""
    hist[:] = 0
    bound, above, kept, t0 = -1, 0, 0, lo
    while t0 < hi:
        count = _tile_size(t0 - lo, hi - t0, r)
        _tile_flags(row, t0, count, bound, flags)
        start = kept
        kept = _collect(row[t0:], flags, count, t0, cand_index, cand_score, kept)
        bound, above = _raise_bound(hist, cand_score, start, kept, bound, above, r)
        t0 += count
    return kept


@njit(cache=True)
def _histogram_cut(hist, r):
    """(cut, above): the r-th best score and how many score above it."""
    total = 0
    for v in range(hist.size - 1, -1, -1):
        if total + hist[v] >= r:
            return v, total
        total += hist[v]
    return -1, total  # unreachable when sum(hist) >= r


@njit(cache=True)
def _piece(chunk, h, chunks, hkv, m):
    """Middle offsets [lo, hi) of head h scanned by thread chunk `chunk` (empty when lo >= hi).

    The Hkv * m middle tokens of all heads are cut into `chunks` equal runs, one per thread,
    so a head is split only where a run boundary falls inside it: few splits, even load.
    Piece (chunk, h) owns row chunk + h of hist and counts (no two non-empty pieces share it).
    """
    start, end = chunk * hkv * m // chunks, (chunk + 1) * hkv * m // chunks
    return max(start - h * m, 0), min(end - h * m, m)


@njit(cache=True)
def _finish_head(h, chunks, layout, counts, hist, cand_index, cand_score, dest):
    """Cut and tie quota from the candidates' histogram, then the ordered, branch-free selection."""
    n, sinks_end, window_start, r = layout
    hkv, m = cand_index.shape[0], window_start - sinks_end
    total, first = hist[h], True  # NOTE: sums in place into the row of the head's first piece
    for c in range(chunks):
        lo, hi = _piece(c, h, chunks, hkv, m)
        if lo < hi and first:
            total, first = hist[c + h], False
        elif lo < hi:
            total += hist[c + h]
    cut, above = _histogram_cut(total, r)
    ties, taken_ties, j = r - above, 0, 0
    for c in range(chunks):
        lo, hi = _piece(c, h, chunks, hkv, m)
        for i in range(lo, lo + counts[c + h] if lo < hi else lo):
            if j == r:
                return
            s = cand_score[h, i]
            tie = s == cut
            dest[j] = cand_index[h, i]
            j += (s > cut) | (tie & (taken_ties < ties))
            taken_ties += tie


@njit(cache=True)
def _sample_bounds(qn, starts, k, layout, runs, halves, tile, flags, hist, bounds, g_tag, w_tag):
    """bounds[h] = _sample_bound of each head (one thread: a few microseconds); qn (Hkv, R, L)."""
    hkv, _, capacity = k.shape
    n, sinks_end, window_start, r = layout
    for h in range(hkv):
        bounds[h] = _sample_bound(qn[h], starts, k[h].ravel(), capacity, sinks_end, window_start - sinks_end,
                                  r, runs, halves, tile, flags, hist, g_tag, w_tag)


@njit(parallel=True, cache=True)
def _scan_jit(qn, starts, k, layout, chunks, tile, flags, hist, cand_index, cand_score, counts, bounds, g_tag,
              w_tag):
    """The candidates of every piece of the heads with bounds[h] >= -1, from that bound; qn
    (Hkv, R, L) the `query_words` of each block of starts (R + 1,)."""
    hkv, _, capacity = k.shape
    n, sinks_end, window_start, r = layout
    m = window_start - sinks_end
    for c in prange(chunks):
        for h in range(hkv):
            lo, hi = _piece(c, h, chunks, hkv, m)
            if lo < hi and bounds[h] >= -1:
                counts[c + h] = _scan_codes(qn[h], starts, k[h].ravel(), capacity, sinks_end + lo,
                                            sinks_end + hi, r, bounds[h], tile[c], flags[c], hist[c + h],
                                            cand_index[h, lo:], cand_score[h, lo:], g_tag, w_tag)


@njit(parallel=True, cache=True)
def _finish_jit(layout, chunks, hist, cand_index, cand_score, counts, out):
    """Each head's cut, tie quota and ordered selection from its pieces' candidates."""
    n, sinks_end, window_start, r = layout
    for h in prange(out.shape[0]):
        _finish_head(h, chunks, layout, counts, hist, cand_index, cand_score, out[h, sinks_end : sinks_end + r])


@njit(parallel=True, cache=True)
def _select_jit(scores, layout, chunks, flags, hist, cand_index, cand_score, counts, out):
    hkv = scores.shape[0]
    n, sinks_end, window_start, r = layout
    m = window_start - sinks_end
    for c in prange(chunks):
        for h in range(hkv):
            lo, hi = _piece(c, h, chunks, hkv, m)
            if lo < hi:
                counts[c + h] = _scan_scores(scores[h], sinks_end + lo, sinks_end + hi, r, flags[c],
                                             hist[c + h], cand_index[h, lo:], cand_score[h, lo:])
    for h in prange(hkv):
        _finish_head(h, chunks, layout, counts, hist, cand_index, cand_score, out[h, sinks_end : sinks_end + r])


@njit(cache=True)
def _scores_jit(qn, k, n, flags, out, g_tag, w_tag):
    """Full score rows, one thread: score_select (the decode path) never needs them; qn (Hkv, 1, L)."""
    hkv, _, capacity = k.shape
    for h in range(hkv):
        for t0 in range(0, n, TILE):
            count = min(TILE, n - t0)
            _tile_scores(qn[h, 0], k[h].ravel(), capacity, t0, count, -1, out[h, t0:], flags, g_tag, w_tag)


@njit(cache=True)
def _scores_blocks_jit(qn, k, bounds, flags, out, g_tag, w_tag):
    """Score rows over ascending token blocks, block r with its own query words qn[:, r]; one thread."""
    hkv, _, capacity = k.shape
    for r in range(len(bounds) - 1):
        for h in range(hkv):
            for t0 in range(bounds[r], bounds[r + 1], TILE):
                count = min(TILE, bounds[r + 1] - t0)
                _tile_scores(qn[h, r], k[h].ravel(), capacity, t0, count, -1, out[h, t0:], flags, g_tag, w_tag)
