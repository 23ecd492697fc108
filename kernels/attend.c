/* Decode-step attention over cached K/V rows, AVX2 (kernels/attend_cpu.py's `attend`,
   `gather_attend` and `remapped_attend`, compiled; built by `make setup` into kernels/_quant.so
   with quant.c). The run over one head's rows is attend_rows.h, included once per row type (fp32,
   fp16) and mode (as stored; re-positioned past the model's window). Built with AVX-512 (-march=native
   on such a CPU), a tile's scores and V products run sixteen lanes at a time (attend_wide.h).

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

   Numerics as attend_cpu.py: fp32 (fp16 rows widened exactly as they are loaded), scores pre-scaled by log2(e) / sqrt(D), online softmax per
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

#include "simd.h"  /* exp2_8 */

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

/* Into L2 (T1), not L1: a tile's prefetched lines held L1's few miss buffers and stalled the
   loads that compute; into L2 a random-row gather ran as fast as consecutive rows (0.53 -> 0.27 ms
   a layer at 32K, docs/DECISIONS.md). */
static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(row + c, _MM_HINT_T1);
}

/* Re-positioning past the window (REMAP runs): the selection's K columns, the first `moved`
   moved to base - count + column; lo (block, 2D) and hi (rows, 2D) hold cos | sin of deltas
   d % block and (d / block) * block (positions.Rotations' tables). */
struct remap {
    const float *lo, *hi;
    int64_t block, base, count, moved;
};

/* Sixteen lanes (attend_wide.h) where built with AVX-512: on by default, `attend_set_wide` turns
   it off (the tests run both). */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define HAVE_WIDE 1
static int wide_rows = 1;
#define WIDE_T float
#define LOAD16(p) _mm512_loadu_ps(p)
#define WIDE_NAME(name) name##_f32
#include "attend_wide.h"
#if defined(__F16C__)
#define WIDE_T uint16_t
#define LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define WIDE_NAME(name) name##_f16
#include "attend_wide.h"
#endif
#else
#define HAVE_WIDE 0
#endif

/* The run over fp32 rows and over fp16 rows (widened to fp32 as they are loaded, F16C), each
   as it is and re-positioning (REMAP; its keys are staged in fp32). ROW_SCORES and ROW_VALUES:
   attend_wide.h's functions for the run's K and V rows. */
#define ROW_T float
#define LOAD_ROW(p) _mm256_loadu_ps(p)
#define PREFETCH_ROW(p, dim) prefetch_row((const char *)(p), (dim) * 4)
#define ROW_SCORES wide_scores_f32
#define ROW_VALUES wide_values_f32
#define REMAP 0
#define ATTEND_RUN attend_run_f32
#include "attend_rows.h"
#undef ATTEND_RUN
#undef REMAP
#define REMAP 1
#define ATTEND_RUN remap_run_f32
#define STAGE_KEY stage_key_f32
#include "attend_rows.h"
#undef ATTEND_RUN
#undef STAGE_KEY
#undef REMAP
#undef ROW_T
#undef LOAD_ROW
#undef PREFETCH_ROW
#undef ROW_SCORES
#undef ROW_VALUES

#if defined(__F16C__)
#define HAVE_F16_ROWS 1
#define ROW_T uint16_t
#define LOAD_ROW(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define PREFETCH_ROW(p, dim) prefetch_row((const char *)(p), (dim) * 2)
#define ROW_SCORES wide_scores_f16
#define ROW_VALUES wide_values_f16
#define REMAP 0
#define ATTEND_RUN attend_run_f16
#include "attend_rows.h"
#undef ATTEND_RUN
#undef REMAP
#undef ROW_SCORES
#define ROW_SCORES wide_scores_f32  /* the staged keys */
#define REMAP 1
#define ATTEND_RUN remap_run_f16
#define STAGE_KEY stage_key_f16
#include "attend_rows.h"
#undef ATTEND_RUN
#undef STAGE_KEY
#undef REMAP
#undef ROW_T
#undef LOAD_ROW
#undef PREFETCH_ROW
#undef ROW_SCORES
#undef ROW_VALUES
#else
#define HAVE_F16_ROWS 0
#endif

/* out (H, D) = attention of q (H, D) over each KV head's rows: [0, count) when rows is NULL,
   else rows[h * rows_stride + 0 .. count). k, v: head h's row r at k + h * head_stride + r * D
   (head_stride for both). Each head's rows split into `splits` runs (one partial result each:
   stats (Hkv * splits, 2, G), acc (Hkv * splits, G, D), the caller's scratch), runs spread over
   `threads` OpenMP threads. qs: the caller's (H, D) scratch for the scaled queries. half: 0 when
   k and v hold fp32 values, 1 when they hold fp16 words (head_stride and rows in elements
   either way). rot_lo / rot_hi non-NULL: the rows are a selection re-positioned past the model's
   window (struct remap; rows required), its first `moved` columns rotated to base - count +
   column, the tables' rows rot_block apart. Returns 0, or -1 when G or D is out of range, fp16
   rows are not compiled in, or a re-positioning lacks its rows. */
int attend_decode(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k, const void *v,
                  int64_t head_stride, const int32_t *rows, int64_t rows_stride, int64_t count, int splits,
                  float *qs, float *stats, float *acc, float *out, int threads, int half,
                  const float *rot_lo, const float *rot_hi, int64_t rot_block, int64_t base, int64_t moved) {
    int64_t group = heads / kv_heads;
    if (group < 1 || group > MAX_GROUP || dim % 8 || dim > MAX_DIM || splits < 1) return -1;
    if (half && !HAVE_F16_ROWS) return -1;
    struct remap rot = {rot_lo, rot_hi, rot_block, base, count, moved};
    int remapped = rot_lo != NULL && rot_hi != NULL;
    if (remapped && (rows == NULL || rot_block < 1)) return -1;
    const float scale = (float)(1.4426950408889634 / sqrt((double)dim));  /* log2(e) / sqrt(D), as numpy rounds it */
    for (int64_t i = 0; i < heads * dim; i++) qs[i] = q[i] * scale;
    int64_t pieces = kv_heads * splits;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) schedule(static)
#endif
    for (int64_t piece = 0; piece < pieces; piece++) {
        int64_t h = piece / splits, split = piece % splits;
        int64_t lo = count * split / splits, hi = count * (split + 1) / splits;
        const int32_t *run_rows = rows ? rows + h * rows_stride + lo : NULL;
        float *run_stats = stats + piece * 2 * group, *run_acc = acc + piece * group * dim;
        const float *qh = qs + h * group * dim;
#if HAVE_F16_ROWS
        if (half) {
            const uint16_t *kh = (const uint16_t *)k + h * head_stride, *vh = (const uint16_t *)v + h * head_stride;
            if (remapped)
                remap_run_f16(qh, (int)group, dim, kh, vh, run_rows, lo, hi - lo, run_stats, run_acc, &rot);
            else
                attend_run_f16(qh, (int)group, dim, kh, vh, run_rows, lo, hi - lo, run_stats, run_acc, NULL);
            continue;
        }
#endif
        const float *kh = (const float *)k + h * head_stride, *vh = (const float *)v + h * head_stride;
        if (remapped)
            remap_run_f32(qh, (int)group, dim, kh, vh, run_rows, lo, hi - lo, run_stats, run_acc, &rot);
        else
            attend_run_f32(qh, (int)group, dim, kh, vh, run_rows, lo, hi - lo, run_stats, run_acc, NULL);
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

/* scores (Hkv, G, count) = q[h * G + g] . key / sqrt(D) of each KV head's query group over its
   rows[h * rows_stride + 0 .. count) (k as in attend_decode), each key re-positioned as
   attend_decode's rot arguments say (rot_lo NULL: as stored): the scores whose softmax
   attend_decode weighs, for a caller that wants the weights themselves (spotlight/observers.py's
   tally of what a reply attended to). Rows spread over `threads` OpenMP threads. Returns 0, or -1
   when G or D is out of range or fp16 rows are not compiled in. */
int attend_scores(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k, int64_t head_stride,
                  const int32_t *rows, int64_t rows_stride, int64_t count, int half, const float *rot_lo,
                  const float *rot_hi, int64_t rot_block, int64_t base, int64_t moved, float *scores, int threads) {
    int64_t group = heads / kv_heads;
    if (group < 1 || group > MAX_GROUP || dim % 8 || dim > MAX_DIM || (half && !HAVE_F16_ROWS)) return -1;
    int remapped = rot_lo != NULL && rot_hi != NULL && rot_block >= 1;
    struct remap rot = {rot_lo, rot_hi, rot_block, base, count, remapped ? moved : 0};
    const float scale = (float)(1.0 / sqrt((double)dim));
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) schedule(static)
#endif
    for (int64_t i = 0; i < kv_heads * count; i++) {
        int64_t h = i / count, column = i % count, r = rows[h * rows_stride + column];
        int64_t delta = column < rot.moved ? base - count + column - r : -1;
        float key[MAX_DIM];
#if HAVE_F16_ROWS
        if (half)
            stage_key_f16(key, (const uint16_t *)k + h * head_stride + r * dim, dim, delta, &rot);
        else
#endif
            stage_key_f32(key, (const float *)k + h * head_stride + r * dim, dim, delta, &rot);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + (h * group + g) * dim;
            __m256 a = _mm256_setzero_ps();
            for (int64_t c = 0; c < dim; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), _mm256_loadu_ps(key + c), a);
            scores[(h * group + g) * count + column] = hsum8(a) * scale;
        }
    }
    return 0;
}

int attend_available(void) { return 1; }
int attend_f16_available(void) { return HAVE_F16_ROWS; }
int attend_wide_available(void) { return HAVE_WIDE; }

/* Whether the runs take attend_wide.h's sixteen lanes where they can (on: 1, off: 0; where not
   built with AVX-512 it stays off); returns the previous setting. Process-wide: set it between
   calls, not while one runs. */
int attend_set_wide(int on) {
#if HAVE_WIDE
    int before = wide_rows;
    wide_rows = on != 0;
    return before;
#else
    (void)on;
    return 0;
#endif
}
#else
int attend_available(void) { return 0; }
int attend_f16_available(void) { return 0; }
#endif
