/* Decode-step attention over cached K/V rows, AVX2 (kernels/attend_cpu.py's `attend` and
   `gather_attend`, compiled; built by `make setup` into kernels/_quant.so with quant.c).

   Shape legend: H query heads, Hkv KV heads, G = H / Hkv (query head h * G + g reads KV head h),
   D head dim (a multiple of 8, at most MAX_DIM), n rows per head (contiguous [0, n) or the rows
   idx[h, 0:n]), B rows per tile.

       out[h*G+g] = softmax(q[h*G+g] . k[h, rows] / sqrt(D)) @ v[h, rows]

   Why: the numba kernel computes each score as its own dot product and horizontal sum. Here
   two queries' scores over four rows come out of one transposing reduction (each K load feeds
   both queries), the tile's max, probabilities and sum are computed eight at a time, and V is
   accumulated in registers two queries at a time (each V load feeds both). Measured (12-01
   20:15, idle machine, best of 3 x 30 calls, 8K rows), the one-query-at-a-time version of this
   kernel against numba: Qwen2.5's geometry (14 / 2 heads, D 64) 1.47 vs 1.83 ms on 1 thread,
   0.96 vs 1.09 ms on 2; SmolLM2's (9 / 3) 1.17 vs 1.09 and 0.49 vs 0.83; at 1K 0.16 vs 0.23 ms.
   Pairing the queries (ad hoc, 12-01 22:15, CPU time of 1 thread, best of 9 x 40 calls, both
   orders, while two other jobs shared the 2 cores): 1K rows 0.116-0.124 vs 0.145-0.147 ms, 8K
   rows 0.97-1.04 vs 1.05-1.15 ms. At 8K the rows come from memory (8.4 MB per call for Qwen2.5),
   so the kernel is within about 2x of reading them; at 1K it is still about 3x its FMA count.

   Numerics as attend_cpu.py: fp32, scores pre-scaled by log2(e) / sqrt(D), online softmax per
   tile with probabilities 2^(s - max) from the same range reduction and degree-6 polynomial
   (relative error < 1.1e-7), a finite "minus infinity". The rows of one head are split into
   `splits` runs whose partial results merge by log-sum-exp in base 2 (as attend_cpu._merge). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

enum { TILE = 64, MAX_GROUP = 16, MAX_DIM = 256, PREFETCH_AHEAD = 8 };
#define FLOAT_MIN (-3.0e38f)

/* 2^x for x in [-126, 0] (clamped below), eight at a time: attend_cpu._exp2_parts's polynomial. */
static inline __m256 exp2_8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    __m256 e = _mm256_floor_ps(x), f = _mm256_sub_ps(x, e);
    __m256 p = _mm256_set1_ps(2.1690609004527763e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.2443081554968543e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.678472549665511e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5483524726123015e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022979581386028e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931469870574893e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000000018154944f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float exp2_1(float x) {
    float out[8];
    _mm256_storeu_ps(out, exp2_8(_mm256_set1_ps(x)));
    return out[0];
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The eight horizontal sums of a[0..7] as one vector (lane i = sum of a[i]). */
static inline __m256 sums8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* lanes: 0 1 2 3 | 0 1 2 3 halves */
    __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    return _mm256_add_ps(lo, hi);
}

static inline void prefetch_row(const float *row, int64_t dim) {
    for (int64_t c = 0; c < dim; c += 16) _mm_prefetch((const char *)(row + c), _MM_HINT_T0);
}

/* One run of one head: the G scaled queries qs (G, D) over `count` rows (row j at
   k + rows[j] * D, or k + (first + j) * D when rows is NULL). Leaves per query the running max
   stats[g], the sum of 2^(s - max) stats[G + g] and the unnormalised output acc (G, D). */
static void attend_run(const float *qs, int group, int64_t dim, const float *k, const float *v, const int32_t *rows,
                       int64_t first, int64_t count, float *stats, float *acc) {
    float scores[MAX_GROUP][TILE];
    const float *krow[TILE], *vrow[TILE];
    for (int g = 0; g < group; g++) {
        stats[g] = FLOAT_MIN;
        stats[group + g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)group * (size_t)dim);
    for (int64_t t0 = 0; t0 < count; t0 += TILE) {
        int n = count - t0 < TILE ? (int)(count - t0) : TILE;
        for (int j = 0; j < n; j++) {
            int64_t r = rows ? rows[t0 + j] : first + t0 + j;
            krow[j] = k + r * dim;
            vrow[j] = v + r * dim;
            if (rows && t0 + j + PREFETCH_AHEAD < count) {  /* random rows: fetch ahead of use */
                int64_t ahead = rows[t0 + j + PREFETCH_AHEAD];
                prefetch_row(k + ahead * dim, dim);
                prefetch_row(v + ahead * dim, dim);
            }
        }
        /* scores: two queries x four rows per transposing reduction (each K load feeds two
           queries), an odd last query eight rows at a time, the rows past a multiple of 4 one by one */
        int g = 0;
        for (; g + 2 <= group; g += 2) {
            const float *q0 = qs + g * dim, *q1 = q0 + dim;
            int j = 0;
            for (; j + 4 <= n; j += 4) {
                const float *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
                __m256 a[8] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t c = 0; c < dim; c += 8) {
                    __m256 x0 = _mm256_loadu_ps(q0 + c), x1 = _mm256_loadu_ps(q1 + c);
                    __m256 r0 = _mm256_loadu_ps(k0 + c), r1 = _mm256_loadu_ps(k1 + c);
                    __m256 r2 = _mm256_loadu_ps(k2 + c), r3 = _mm256_loadu_ps(k3 + c);
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
                    __m256 r = _mm256_loadu_ps(krow[j] + c);
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
                const float *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
                const float *k4 = krow[j + 4], *k5 = krow[j + 5], *k6 = krow[j + 6], *k7 = krow[j + 7];
                __m256 a[8] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t c = 0; c < dim; c += 8) {
                    __m256 qv = _mm256_loadu_ps(qg + c);
                    a[0] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a[0]);
                    a[1] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + c), a[1]);
                    a[2] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + c), a[2]);
                    a[3] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + c), a[3]);
                    a[4] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4 + c), a[4]);
                    a[5] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k5 + c), a[5]);
                    a[6] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k6 + c), a[6]);
                    a[7] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k7 + c), a[7]);
                }
                _mm256_storeu_ps(&scores[g][j], sums8(a));
            }
            for (; j < n; j++) {
                __m256 a = _mm256_setzero_ps();
                for (int64_t c = 0; c < dim; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), _mm256_loadu_ps(krow[j] + c), a);
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
        /* V: two queries' output rows 32 values at a time in registers (each V load feeds two
           queries), an odd last query 64 at a time, the rest of D 8 at a time */
        for (g = 0; g + 2 <= group; g += 2) {
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
                    const float *vr = vrow[jj] + c0;
                    __m256 x0 = _mm256_loadu_ps(vr), x1 = _mm256_loadu_ps(vr + 8);
                    __m256 x2 = _mm256_loadu_ps(vr + 16), x3 = _mm256_loadu_ps(vr + 24);
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
                    __m256 x = _mm256_loadu_ps(vrow[jj] + c0);
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
                    const float *vr = vrow[jj] + c0;
                    o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), o0);
                    o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), o1);
                    o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), o2);
                    o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), o3);
                    o4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 32), o4);
                    o5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 40), o5);
                    o6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 48), o6);
                    o7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 56), o7);
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
                for (int jj = 0; jj < n; jj++) o = _mm256_fmadd_ps(_mm256_broadcast_ss(s + jj), _mm256_loadu_ps(vrow[jj] + c0), o);
                _mm256_storeu_ps(out + c0, o);
            }
        }
    }
}

/* out (H, D) = attention of q (H, D) over each KV head's rows: [0, count) when rows is NULL,
   else rows[h * rows_stride + 0 .. count). k, v: head h's row r at k + h * head_stride + r * D
   (head_stride for both). Each head's rows split into `splits` runs (one partial result each:
   stats (Hkv * splits, 2, G), acc (Hkv * splits, G, D), the caller's scratch), runs spread over
   `threads` OpenMP threads. qs: the caller's (H, D) scratch for the scaled queries. Returns 0, or
   -1 when G or D is out of range. */
int attend_decode(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const float *k, const float *v,
                  int64_t head_stride, const int32_t *rows, int64_t rows_stride, int64_t count, int splits,
                  float *qs, float *stats, float *acc, float *out, int threads) {
    int64_t group = heads / kv_heads;
    if (group < 1 || group > MAX_GROUP || dim % 8 || dim > MAX_DIM || splits < 1) return -1;
    const float scale = (float)(1.4426950408889634 / sqrt((double)dim));  /* log2(e) / sqrt(D), as numpy rounds it */
    for (int64_t i = 0; i < heads * dim; i++) qs[i] = q[i] * scale;
    int64_t pieces = kv_heads * splits;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) schedule(static)
#endif
    for (int64_t piece = 0; piece < pieces; piece++) {
        int64_t h = piece / splits, split = piece % splits;
        int64_t lo = count * split / splits, hi = count * (split + 1) / splits;
        attend_run(qs + h * group * dim, (int)group, dim, k + h * head_stride, v + h * head_stride,
                   rows ? rows + h * rows_stride + lo : NULL, lo, hi - lo, stats + piece * 2 * group,
                   acc + piece * group * dim);
    }
    (void)threads;
    for (int64_t h = 0; h < kv_heads; h++) {  /* merge the runs (log-sum-exp in base 2) */
        for (int64_t g = 0; g < group; g++) {
            float top = FLOAT_MIN, total = 0.0f;
            for (int sp = 0; sp < splits; sp++) {
                float m = stats[(h * splits + sp) * 2 * group + g];
                top = m > top ? m : top;
            }
            float *dest = out + (h * group + g) * dim;
            memset(dest, 0, sizeof(float) * (size_t)dim);
            for (int sp = 0; sp < splits; sp++) {
                int64_t piece = h * splits + sp;
                float w = exp2_1(stats[piece * 2 * group + g] - top);
                total += w * stats[piece * 2 * group + group + g];
                const float *a = acc + (piece * group + g) * dim;
                for (int64_t e = 0; e < dim; e++) dest[e] += w * a[e];
            }
            float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t e = 0; e < dim; e++) dest[e] *= inv;
        }
    }
    return 0;
}

int attend_available(void) { return 1; }
#else
int attend_available(void) { return 0; }
#endif
