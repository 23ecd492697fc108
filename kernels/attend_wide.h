/* A tile's scores and its V products sixteen lanes at a time (AVX-512), included by attend.c once
   per row type with WIDE_T (float, or uint16_t fp16 words), LOAD16(p) (sixteen row values at p
   as fp32) and WIDE_NAME(name) (name with the row type's suffix: wide_scores_f32, ...) defined;
   it undefines them at its end. attend_rows.h calls them for a head dim that is a multiple of 16
   where attend.c was built with AVX-512F (and `attend_set_wide` has not turned them off);
   otherwise it runs its own eight-lane loops.

   Why (docs/DECISIONS.md, "Decode attention sixteen lanes at a time"): inside the model's window
   a decode step's attention is bound by arithmetic, not by reading the rows. At 8K rows the
   eight-lane run took 12.6 ms a step for Qwen2.5's 24 layers (G = 7, D = 64) on one thread of a
   Zen 5 where the rows take ~3 ms to read: every K row was widened once per query pair and every
   score was a horizontal sum of its own. Here four queries share each widened K row over four
   rows, and their sixteen dot products leave in one transposing reduction (sums16); V is widened
   once per four queries.

   Numerics: fp32 products and sums, as attend_rows.h's loops. A score sums its sixteen lane
   partials in another order than the eight-lane run (within fp32 rounding of it); each output
   value of V accumulates the tile's rows in the same order with the same operations, so given the
   same probabilities it is the same bits. */

#ifndef SPOTLIGHT_ATTEND_WIDE_SUMS
#define SPOTLIGHT_ATTEND_WIDE_SUMS
/* The sixteen horizontal sums of a[0..15] as one vector: lane 4k + p = sum of a[4p + k]. */
static inline __m512 sums16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* 128-bit chunks 0-1: a[2i]'s halves added, 2-3: a[2i + 1]'s */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* chunk k: a[4i + k]'s four partial sums */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* chunk k: a[8i + k] and a[8i + 4 + k], two partials each */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* Store lanes 4 * query .. 4 * query + rows - 1 of sums (query's scores over the block's rows). */
static inline void store_scores16(__m512 sums, int query, float *dest, int rows) {
    __m128 s = query == 0 ? _mm512_extractf32x4_ps(sums, 0) : query == 1 ? _mm512_extractf32x4_ps(sums, 1)
             : query == 2 ? _mm512_extractf32x4_ps(sums, 2) : _mm512_extractf32x4_ps(sums, 3);
    if (rows == 4)
        _mm_storeu_ps(dest, s);
    else
        _mm_mask_storeu_ps(dest, (__mmask8)((1u << rows) - 1u), s);
}
#endif

/* scores[g0 + i][j .. j + 3] = qs[g0 + i] . krow[j + r] for the QUERIES (1-4) queries from g0 and
   the tile's n rows, four rows at a time (a last block of fewer rows repeats its last row and
   stores only its own). */
static inline __attribute__((always_inline)) void WIDE_NAME(wide_scores_block)(const float *qs, int g0, const int queries,
                                                                      int64_t dim, const WIDE_T **krow, int n,
                                                                      float (*scores)[TILE]) {
    const float *q = qs + (int64_t)g0 * dim;
    for (int j = 0; j < n; j += 4) {
        const WIDE_T *k0 = krow[j], *k1 = krow[j + 1 < n ? j + 1 : n - 1];
        const WIDE_T *k2 = krow[j + 2 < n ? j + 2 : n - 1], *k3 = krow[j + 3 < n ? j + 3 : n - 1];
        __m512 a[16];
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < dim; c += 16) {  /* a[4 * row + query] */
            __m512 r0 = LOAD16(k0 + c), r1 = LOAD16(k1 + c), r2 = LOAD16(k2 + c), r3 = LOAD16(k3 + c);
            for (int i = 0; i < queries; i++) {
                __m512 x = _mm512_loadu_ps(q + i * dim + c);
                a[i] = _mm512_fmadd_ps(x, r0, a[i]);
                a[4 + i] = _mm512_fmadd_ps(x, r1, a[4 + i]);
                a[8 + i] = _mm512_fmadd_ps(x, r2, a[8 + i]);
                a[12 + i] = _mm512_fmadd_ps(x, r3, a[12 + i]);
            }
        }
        __m512 sums = sums16(a);  /* lane 4 * query + row */
        int rows = n - j < 4 ? n - j : 4;
        for (int i = 0; i < queries; i++) store_scores16(sums, i, &scores[g0 + i][j], rows);
    }
}

/* The tile's scores (G, n) of the scaled queries qs (G, D) over the rows krow[0 .. n). */
static void WIDE_NAME(wide_scores)(const float *qs, int group, int64_t dim, const WIDE_T **krow, int n,
                        float (*scores)[TILE]) {
    int g0 = 0;
    for (; g0 + 4 <= group; g0 += 4) WIDE_NAME(wide_scores_block)(qs, g0, 4, dim, krow, n, scores);
    switch (group - g0) {
        case 3: WIDE_NAME(wide_scores_block)(qs, g0, 3, dim, krow, n, scores); break;
        case 2: WIDE_NAME(wide_scores_block)(qs, g0, 2, dim, krow, n, scores); break;
        case 1: WIDE_NAME(wide_scores_block)(qs, g0, 1, dim, krow, n, scores); break;
        default: break;
    }
}

/* acc[g0 + i][c0 .. c0 + 16 * CHUNKS) = that times rescale[g0 + i] + sum over the tile's rows of
   probs[g0 + i][j] * vrow[j][c0 ..], for the QUERIES (1-4) queries from g0, in registers. */
static inline __attribute__((always_inline)) void WIDE_NAME(wide_values_block)(float (*probs)[TILE], const float *rescale,
                                                                      int g0, const int queries, int64_t dim,
                                                                      int64_t c0, const int chunks,
                                                                      const WIDE_T **vrow, int n, float *acc) {
    __m512 o[4][4];
    for (int i = 0; i < queries; i++) {
        __m512 scale = _mm512_set1_ps(rescale[g0 + i]);
        for (int ch = 0; ch < chunks; ch++)
            o[i][ch] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g0 + i) * dim + c0 + 16 * ch), scale);
    }
    for (int j = 0; j < n; j++) {
        __m512 x[4];
        for (int ch = 0; ch < chunks; ch++) x[ch] = LOAD16(vrow[j] + c0 + 16 * ch);
        for (int i = 0; i < queries; i++) {
            __m512 w = _mm512_set1_ps(probs[g0 + i][j]);
            for (int ch = 0; ch < chunks; ch++) o[i][ch] = _mm512_fmadd_ps(w, x[ch], o[i][ch]);
        }
    }
    for (int i = 0; i < queries; i++)
        for (int ch = 0; ch < chunks; ch++) _mm512_storeu_ps(acc + (g0 + i) * dim + c0 + 16 * ch, o[i][ch]);
}

#define WIDE_VALUES_CHUNKS(queries)                                                                    \
    do {                                                                                               \
        int64_t c0 = 0;                                                                                \
        for (; c0 + 64 <= dim; c0 += 64) WIDE_NAME(wide_values_block)(probs, rescale, g0, queries, dim, c0, 4, vrow, n, acc); \
        switch ((dim - c0) / 16) {                                                                     \
            case 3: WIDE_NAME(wide_values_block)(probs, rescale, g0, queries, dim, c0, 3, vrow, n, acc); break;   \
            case 2: WIDE_NAME(wide_values_block)(probs, rescale, g0, queries, dim, c0, 2, vrow, n, acc); break;   \
            case 1: WIDE_NAME(wide_values_block)(probs, rescale, g0, queries, dim, c0, 1, vrow, n, acc); break;   \
            default: break;                                                                            \
        }                                                                                              \
    } while (0)

/* acc (G, D) = acc * rescale + probs (G, n) @ the rows vrow[0 .. n), four queries at a time. */
static void WIDE_NAME(wide_values)(float (*probs)[TILE], const float *rescale, int group, int64_t dim,
                        const WIDE_T **vrow, int n, float *acc) {
    int g0 = 0;
    for (; g0 + 4 <= group; g0 += 4) WIDE_VALUES_CHUNKS(4);
    switch (group - g0) {
        case 3: WIDE_VALUES_CHUNKS(3); break;
        case 2: WIDE_VALUES_CHUNKS(2); break;
        case 1: WIDE_VALUES_CHUNKS(1); break;
        default: break;
    }
}
#undef WIDE_VALUES_CHUNKS
#undef WIDE_T
#undef LOAD16
#undef WIDE_NAME
