/* One run of one head over rows of ROW_T (float, or uint16_t fp16 words), included by attend.c
   once per row type and mode with ATTEND_RUN (the function's name), ROW_T, LOAD_ROW(p) (eight
   row values at p as fp32), PREFETCH_ROW(p, dim) and REMAP (0 or 1) defined. Every product and
   sum is fp32 either way.

   The run: the G scaled queries qs (G, D) over `count` rows (row j at k + rows[j] * D, or
   k + (first + j) * D when rows is NULL). Leaves per query the running max stats[g], the sum of
   2^(s - max) stats[G + g] and the unnormalised output acc (G, D).

   REMAP (past the model's window, spotlight/beyond.py): column first + j of the selection moves
   to position base - K + first + j, so its key is rotated forward by that minus rows[j]
   (`struct remap`, cos/sin from two tables by angle sum, as positions.Rotations.rotate does,
   with the same operations in the same order); columns from `moved` on (the local window) keep
   their positions. The tile's keys are staged widened (and rotated) in fp32; V is read in place. */
#if REMAP
#define KROW_T float
#define LOAD_K(p) _mm256_loadu_ps(p)
#else
#define KROW_T ROW_T
#define LOAD_K(p) LOAD_ROW(p)
#endif
#if REMAP
/* dst (D) fp32 = the key src widened, then rotated forward by delta positions (delta < 0: not
   rotated): x * cos + rotate_half(x) * sin, cos = hc * lc - hs * ls, sin = hs * lc + hc * ls for
   delta = hi * block + lo, as positions.Rotations.cos_sin and rotate compute it. Where half of D is
   a multiple of 8, each pair of halves is widened once into registers and both rotated outputs
   written from them (no staged copy of the row first), with one cos and sin per pair: the tables'
   two halves hold the same angles (positions.rope_angles), so the second half's are not re-formed. */
static inline void STAGE_KEY(float *dst, const ROW_T *src, int64_t dim, int64_t delta, const struct remap *rot) {
    if (delta < 0) {
        for (int64_t c = 0; c < dim; c += 8) _mm256_storeu_ps(dst + c, LOAD_ROW(src + c));
        return;
    }
    const float *hi = rot->hi + (delta / rot->block) * 2 * dim, *lo = rot->lo + (delta % rot->block) * 2 * dim;
    int64_t half = dim / 2, i = 0;
    if (half % 8 == 0) {
        for (; i < half; i += 8) {
            __m256 a = LOAD_ROW(src + i), b = LOAD_ROW(src + i + half);  /* x[i], x[i + half] */
            __m256 hc = _mm256_loadu_ps(hi + i), hs = _mm256_loadu_ps(hi + dim + i);
            __m256 lc = _mm256_loadu_ps(lo + i), ls = _mm256_loadu_ps(lo + dim + i);
            __m256 cos = _mm256_sub_ps(_mm256_mul_ps(hc, lc), _mm256_mul_ps(hs, ls));
            __m256 sin = _mm256_add_ps(_mm256_mul_ps(hs, lc), _mm256_mul_ps(hc, ls));
            _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_mul_ps(a, cos),
                                                    _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), b), sin)));
            /* the second half's angles are the first half's (positions.rope_angles repeats them) */
            _mm256_storeu_ps(dst + half + i, _mm256_add_ps(_mm256_mul_ps(b, cos), _mm256_mul_ps(a, sin)));
        }
        return;
    }
    float x[MAX_DIM];
    for (int64_t c = 0; c < dim; c += 8) _mm256_storeu_ps(x + c, LOAD_ROW(src + c));
    for (; i < dim; i++) {
        float cos = hi[i] * lo[i] - hi[dim + i] * lo[dim + i];
        float sin = hi[dim + i] * lo[i] + hi[i] * lo[dim + i];
        float other = i < half ? -x[i + half] : x[i - half];
        dst[i] = x[i] * cos + other * sin;
    }
}
#endif

static void ATTEND_RUN(const float *qs, int group, int64_t dim, const ROW_T *k, const ROW_T *v, const int32_t *rows,
                       int64_t first, int64_t count, float *stats, float *acc, const struct remap *rot) {
    float scores[MAX_GROUP][TILE];
    const KROW_T *krow[TILE];
    const ROW_T *vrow[TILE];
#if REMAP
    float staged[TILE][MAX_DIM];
#else
    (void)rot;
#endif
    for (int g = 0; g < group; g++) {
        stats[g] = FLOAT_MIN;
        stats[group + g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)group * (size_t)dim);
#if HAVE_WIDE
    const int wide = wide_rows && dim % 16 == 0;  /* attend_wide.h: sixteen lanes, four queries per K load */
#else
    const int wide = 0;
#endif
    const int eight_from = wide ? group : 0;  /* the eight-lane loops' first query: none after the wide ones */
    for (int64_t t0 = 0; t0 < count; t0 += TILE) {
        int n = count - t0 < TILE ? (int)(count - t0) : TILE;
        for (int j = 0; j < n; j++) {
            int64_t r = rows ? rows[t0 + j] : first + t0 + j;
#if REMAP
            int64_t column = first + t0 + j;
            STAGE_KEY(staged[j], k + r * dim, dim, column < rot->moved ? rot->base - rot->count + column - r : -1, rot);
            krow[j] = staged[j];
#else
            krow[j] = k + r * dim;
#endif
            vrow[j] = v + r * dim;
            if (rows && t0 + j + PREFETCH_AHEAD < count) {  /* random rows: fetch ahead of use */
                int64_t ahead = rows[t0 + j + PREFETCH_AHEAD];
                PREFETCH_ROW(k + ahead * dim, dim);
                PREFETCH_ROW(v + ahead * dim, dim);
            }
        }
        int g;
#if HAVE_WIDE
        if (wide)
            ROW_SCORES(qs, group, dim, krow, n, scores);
#endif
        /* scores: two queries x four rows per transposing reduction (each K load feeds two
           queries), an odd last query eight rows at a time, the rows past a multiple of 4 one by one */
        for (g = eight_from; g + 2 <= group; g += 2) {
            const float *q0 = qs + g * dim, *q1 = q0 + dim;
            int j = 0;
            for (; j + 4 <= n; j += 4) {
                const KROW_T *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
                __m256 a[8] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t c = 0; c < dim; c += 8) {
                    __m256 x0 = _mm256_loadu_ps(q0 + c), x1 = _mm256_loadu_ps(q1 + c);
                    __m256 r0 = LOAD_K(k0 + c), r1 = LOAD_K(k1 + c);
                    __m256 r2 = LOAD_K(k2 + c), r3 = LOAD_K(k3 + c);
                    a[0] = _mm256_fmadd_ps(x0, r0, a[0]);
                    a[1] = _mm256_fmadd_ps(x0, r1, a[1]);
                    a[2] = _mm256_fmadd_ps(x0, r2, a[2]);
                    a[3] = _mm256_fmadd_ps(x0, r3, a[3]);
                    a[4] = _mm256_fmadd_ps(x1, r0, a[4]);
                    a[5] = _mm256_fmadd_ps(x1, r1, a[5]);
                    a[6] = _mm256_fmadd_ps(x1, r2, a[6]);
                    a[7] = _mm256_fmadd_ps(x1, r3, a[7]);
                }
                __m256 both = sums8(a);  /* lanes 0-3: query g, rows j..j+3; lanes 4-7: query g + 1 */
                _mm_storeu_ps(&scores[g][j], _mm256_castps256_ps128(both));
                _mm_storeu_ps(&scores[g + 1][j], _mm256_extractf128_ps(both, 1));
            }
            for (; j < n; j++) {
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                for (int64_t c = 0; c < dim; c += 8) {
                    __m256 r = LOAD_K(krow[j] + c);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + c), r, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + c), r, a1);
                }
                scores[g][j] = hsum8(a0);
                scores[g + 1][j] = hsum8(a1);
            }
        }
        for (; g < group; g++) {
            const float *qg = qs + g * dim;
            int j = 0;
            for (; j + 8 <= n; j += 8) {
                const KROW_T *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
                const KROW_T *k4 = krow[j + 4], *k5 = krow[j + 5], *k6 = krow[j + 6], *k7 = krow[j + 7];
                __m256 a[8] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t c = 0; c < dim; c += 8) {
                    __m256 qv = _mm256_loadu_ps(qg + c);
                    a[0] = _mm256_fmadd_ps(qv, LOAD_K(k0 + c), a[0]);
                    a[1] = _mm256_fmadd_ps(qv, LOAD_K(k1 + c), a[1]);
                    a[2] = _mm256_fmadd_ps(qv, LOAD_K(k2 + c), a[2]);
                    a[3] = _mm256_fmadd_ps(qv, LOAD_K(k3 + c), a[3]);
                    a[4] = _mm256_fmadd_ps(qv, LOAD_K(k4 + c), a[4]);
                    a[5] = _mm256_fmadd_ps(qv, LOAD_K(k5 + c), a[5]);
                    a[6] = _mm256_fmadd_ps(qv, LOAD_K(k6 + c), a[6]);
                    a[7] = _mm256_fmadd_ps(qv, LOAD_K(k7 + c), a[7]);
                }
                _mm256_storeu_ps(&scores[g][j], sums8(a));
            }
            for (; j < n; j++) {
                __m256 a = _mm256_setzero_ps();
                for (int64_t c = 0; c < dim; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), LOAD_K(krow[j] + c), a);
                scores[g][j] = hsum8(a);
            }
        }
        /* online softmax update per query: the tile's max and sum eight lanes at a time */
        float rescale[MAX_GROUP];
        for (g = 0; g < group; g++) {
            float *s = scores[g];
            __m256 m8 = _mm256_set1_ps(stats[g]);
            int j = 0;
            for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
            float lanes[8];
            _mm256_storeu_ps(lanes, m8);
            float top = lanes[0];
            for (int i = 1; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
            for (; j < n; j++) top = s[j] > top ? s[j] : top;
            rescale[g] = exp2_1(stats[g] - top);
            __m256 sum8 = _mm256_setzero_ps(), top8 = _mm256_set1_ps(top);
            float total = 0.0f;
            for (j = 0; j + 8 <= n; j += 8) {
                __m256 p = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(s + j), top8));
                _mm256_storeu_ps(s + j, p);
                sum8 = _mm256_add_ps(sum8, p);
            }
            for (; j < n; j++) {
                s[j] = exp2_1(s[j] - top);
                total += s[j];
            }
            stats[group + g] = stats[group + g] * rescale[g] + hsum8(sum8) + total;
            stats[g] = top;
        }
#if HAVE_WIDE
        if (wide)
            ROW_VALUES(scores, rescale, group, dim, vrow, n, acc);
#endif
        /* V: two queries' output rows 32 values at a time in registers (each V load feeds two
           queries), an odd last query 64 at a time, the rest of D 8 at a time */
        for (g = eight_from; g + 2 <= group; g += 2) {
            const float *s0 = scores[g], *s1 = scores[g + 1];
            float *out0 = acc + (int64_t)g * dim, *out1 = out0 + dim;
            __m256 sc0 = _mm256_set1_ps(rescale[g]), sc1 = _mm256_set1_ps(rescale[g + 1]);
            int64_t c0 = 0;
            for (; c0 + 32 <= dim; c0 += 32) {
                __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(out0 + c0), sc0);
                __m256 o1 = _mm256_mul_ps(_mm256_loadu_ps(out0 + c0 + 8), sc0);
                __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(out0 + c0 + 16), sc0);
                __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(out0 + c0 + 24), sc0);
                __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(out1 + c0), sc1);
                __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(out1 + c0 + 8), sc1);
                __m256 p2 = _mm256_mul_ps(_mm256_loadu_ps(out1 + c0 + 16), sc1);
                __m256 p3 = _mm256_mul_ps(_mm256_loadu_ps(out1 + c0 + 24), sc1);
                for (int jj = 0; jj < n; jj++) {
                    __m256 w0 = _mm256_broadcast_ss(s0 + jj), w1 = _mm256_broadcast_ss(s1 + jj);
                    const ROW_T *vr = vrow[jj] + c0;
                    __m256 x0 = LOAD_ROW(vr), x1 = LOAD_ROW(vr + 8);
                    __m256 x2 = LOAD_ROW(vr + 16), x3 = LOAD_ROW(vr + 24);
                    o0 = _mm256_fmadd_ps(w0, x0, o0);
                    o1 = _mm256_fmadd_ps(w0, x1, o1);
                    o2 = _mm256_fmadd_ps(w0, x2, o2);
                    o3 = _mm256_fmadd_ps(w0, x3, o3);
                    p0 = _mm256_fmadd_ps(w1, x0, p0);
                    p1 = _mm256_fmadd_ps(w1, x1, p1);
                    p2 = _mm256_fmadd_ps(w1, x2, p2);
                    p3 = _mm256_fmadd_ps(w1, x3, p3);
                }
                _mm256_storeu_ps(out0 + c0, o0);
                _mm256_storeu_ps(out0 + c0 + 8, o1);
                _mm256_storeu_ps(out0 + c0 + 16, o2);
                _mm256_storeu_ps(out0 + c0 + 24, o3);
                _mm256_storeu_ps(out1 + c0, p0);
                _mm256_storeu_ps(out1 + c0 + 8, p1);
                _mm256_storeu_ps(out1 + c0 + 16, p2);
                _mm256_storeu_ps(out1 + c0 + 24, p3);
            }
            for (; c0 < dim; c0 += 8) {
                __m256 o = _mm256_mul_ps(_mm256_loadu_ps(out0 + c0), sc0), p = _mm256_mul_ps(_mm256_loadu_ps(out1 + c0), sc1);
                for (int jj = 0; jj < n; jj++) {
                    __m256 x = LOAD_ROW(vrow[jj] + c0);
                    o = _mm256_fmadd_ps(_mm256_broadcast_ss(s0 + jj), x, o);
                    p = _mm256_fmadd_ps(_mm256_broadcast_ss(s1 + jj), x, p);
                }
                _mm256_storeu_ps(out0 + c0, o);
                _mm256_storeu_ps(out1 + c0, p);
            }
        }
        for (; g < group; g++) {
            const float *s = scores[g];
            float *out = acc + (int64_t)g * dim;
            __m256 scale = _mm256_set1_ps(rescale[g]);
            int64_t c0 = 0;
            for (; c0 + 64 <= dim; c0 += 64) {  /* 64 output values in 8 registers over the tile's rows */
                __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(out + c0), scale);
                __m256 o1 = _mm256_mul_ps(_mm256_loadu_ps(out + c0 + 8), scale);
                __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(out + c0 + 16), scale);
                __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(out + c0 + 24), scale);
                __m256 o4 = _mm256_mul_ps(_mm256_loadu_ps(out + c0 + 32), scale);
                __m256 o5 = _mm256_mul_ps(_mm256_loadu_ps(out + c0 + 40), scale);
                __m256 o6 = _mm256_mul_ps(_mm256_loadu_ps(out + c0 + 48), scale);
                __m256 o7 = _mm256_mul_ps(_mm256_loadu_ps(out + c0 + 56), scale);
                for (int jj = 0; jj < n; jj++) {
                    __m256 w = _mm256_broadcast_ss(s + jj);
                    const ROW_T *vr = vrow[jj] + c0;
                    o0 = _mm256_fmadd_ps(w, LOAD_ROW(vr), o0);
                    o1 = _mm256_fmadd_ps(w, LOAD_ROW(vr + 8), o1);
                    o2 = _mm256_fmadd_ps(w, LOAD_ROW(vr + 16), o2);
                    o3 = _mm256_fmadd_ps(w, LOAD_ROW(vr + 24), o3);
                    o4 = _mm256_fmadd_ps(w, LOAD_ROW(vr + 32), o4);
                    o5 = _mm256_fmadd_ps(w, LOAD_ROW(vr + 40), o5);
                    o6 = _mm256_fmadd_ps(w, LOAD_ROW(vr + 48), o6);
                    o7 = _mm256_fmadd_ps(w, LOAD_ROW(vr + 56), o7);
                }
                _mm256_storeu_ps(out + c0, o0);
                _mm256_storeu_ps(out + c0 + 8, o1);
                _mm256_storeu_ps(out + c0 + 16, o2);
                _mm256_storeu_ps(out + c0 + 24, o3);
                _mm256_storeu_ps(out + c0 + 32, o4);
                _mm256_storeu_ps(out + c0 + 40, o5);
                _mm256_storeu_ps(out + c0 + 48, o6);
                _mm256_storeu_ps(out + c0 + 56, o7);
            }
            for (; c0 < dim; c0 += 8) {  /* the rest, 8 at a time */
                __m256 o = _mm256_mul_ps(_mm256_loadu_ps(out + c0), scale);
                for (int jj = 0; jj < n; jj++) o = _mm256_fmadd_ps(_mm256_broadcast_ss(s + jj), LOAD_ROW(vrow[jj] + c0), o);
                _mm256_storeu_ps(out + c0, o);
            }
        }
    }
}
#undef KROW_T
#undef LOAD_K
