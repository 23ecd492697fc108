/* The residual-MLP encoder over many inputs per MLP, compiled (kernels/encode.py's
   `MlpCoder.many` and `MlpCoder.turned`; built by `make setup` into kernels/_quant.so with
   quant.c and attend.c).

   Shape legend: B inputs per MLP, R rows (one MLP each: query heads), D head dim, F hidden
   width, C code bits, W = ceil(C / 64), S stacked blocks (>= depth).

       y = x;  for each of `depth` blocks: y = y + silu(y @ w1 + b1) @ w2;   h = y @ w_out
       out[b, r] = the bits h > 0, packed as kernels.pack packs them (bit j of word w: h[64 w + j])

   With cos and sin (B, D), input b of row r is q[r] turned by table row b as
   positions.Rotations.turn_back computes it (x * cos - rotate_half(x) * sin, the same fp32
   operations: bit-identical), so past the model's window a decode step's turned-back queries
   (select_far: one per fold block and query head, 16 x 14 at 131K) are formed and coded in one call.

   Why: numpy's stacked matrix products ran 3 x 14 small BLAS calls per layer (~0.28 ms for
   Qwen2.5's 32 x 14 inputs at the fold of 12-03, 0.07 ms more to turn them in torch); here the
   three products run from L1, four inputs per weight load (add_products4), spread over OpenMP
   threads by row.

   NOTE: the sums run in another order than BLAS's (and than torch's), so a bit whose h lies
   within float rounding of 0 can differ (kernels/encode.py's module note). */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd.h"  /* exp2_8 */

enum { STRIP = 64, QUAD = 4, ENCODE_MAX_DIM = 256, ENCODE_MAX_WIDTH = 1024, ENCODE_MAX_BITS = 1024 };

/* acc[0:n] += sum_k a[k] * m[k * stride + 0:n] (n a multiple of 8): each strip of 64 columns in
   eight independent accumulators, k in order. */
static void add_products(float *acc, const float *a, int64_t count, const float *m, int64_t stride, int64_t n) {
    int64_t c0 = 0;
    for (; c0 + STRIP <= n; c0 += STRIP) {
        __m256 s[8];
        for (int i = 0; i < 8; i++) s[i] = _mm256_loadu_ps(acc + c0 + 8 * i);
        for (int64_t k = 0; k < count; k++) {
            __m256 ak = _mm256_set1_ps(a[k]);
            const float *row = m + k * stride + c0;
            for (int i = 0; i < 8; i++) s[i] = _mm256_fmadd_ps(ak, _mm256_loadu_ps(row + 8 * i), s[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + c0 + 8 * i, s[i]);
    }
    for (; c0 < n; c0 += 8) {
        __m256 s = _mm256_loadu_ps(acc + c0);
        for (int64_t k = 0; k < count; k++) s = _mm256_fmadd_ps(_mm256_set1_ps(a[k]), _mm256_loadu_ps(m + k * stride + c0), s);
        _mm256_storeu_ps(acc + c0, s);
    }
}

/* add_products for QUAD inputs at once (acc + j * acc_step, a + j * a_step for input j): each
   weight load feeds all four, strips of 24 columns in 12 accumulators (then 16, then add_products'
   8): twelve independent FMA chains keep both FMA units busy, and 12 accumulators and a broadcast
   fit AVX2's 16 registers (with strips of 32 the compiler spilled accumulators to the stack inside
   the loop; docs/DECISIONS.md, "The encoder's four-input products"); every sum in the same order as
   add_products (the same bits). */
#define STRIP4(WIDTH)                                                                                       \
    for (; c0 + 8 * (WIDTH) <= n; c0 += 8 * (WIDTH)) {                                                  \
        __m256 s[QUAD][WIDTH];                                                                          \
        for (int j = 0; j < QUAD; j++)                                                                  \
            for (int i = 0; i < (WIDTH); i++) s[j][i] = _mm256_loadu_ps(acc + j * acc_step + c0 + 8 * i); \
        for (int64_t k = 0; k < count; k++) {                                                           \
            const float *row = m + k * n + c0;                                                          \
            __m256 w[WIDTH];                                                                            \
            for (int i = 0; i < (WIDTH); i++) {                                                         \
                w[i] = _mm256_loadu_ps(row + 8 * i);                                                    \
                __asm__("" : "+x"(w[i])); /* held in a register: loaded once, not once per input */     \
            }                                                                                           \
            for (int j = 0; j < QUAD; j++) {                                                            \
                __m256 ak = _mm256_set1_ps(a[j * a_step + k]);                                          \
                for (int i = 0; i < (WIDTH); i++) s[j][i] = _mm256_fmadd_ps(ak, w[i], s[j][i]);        \
            }                                                                                           \
        }                                                                                               \
        for (int j = 0; j < QUAD; j++)                                                                  \
            for (int i = 0; i < (WIDTH); i++) _mm256_storeu_ps(acc + j * acc_step + c0 + 8 * i, s[j][i]); \
    }
static void add_products4(float *acc, int64_t acc_step, const float *a, int64_t a_step, int64_t count,
                          const float *m, int64_t n) {
    int64_t c0 = 0;
    STRIP4(3)
    STRIP4(2)
    if (c0 < n)
        for (int j = 0; j < QUAD; j++) add_products(acc + j * acc_step + c0, a + j * a_step, count, m + c0, n, n - c0);
}
#undef STRIP4

/* z[0:n] <- silu(z) = z / (1 + 2^(-z log2 e)), the exponent clamped to [-126, 126] (as encode.py's _silu). */
static void silu(float *z, int64_t n) {
    const __m256 log2e = _mm256_set1_ps(1.4426950408889634f), one = _mm256_set1_ps(1.0f);
    const __m256 top = _mm256_set1_ps(126.0f), zero = _mm256_setzero_ps();
    for (int64_t f = 0; f < n; f += 8) {
        __m256 x = _mm256_loadu_ps(z + f);
        __m256 t = _mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(zero, x), log2e), top);
        _mm256_storeu_ps(z + f, _mm256_div_ps(x, _mm256_add_ps(one, exp2_8(t))));
    }
}

/* out (B, R, W) uint64: the codes of x through each row's MLP (the header's formula).
   x: input b of row r at x + b * x_step + r * D (x_step 0: the same R inputs for every b); with
   cos and sin non-NULL (B, D), each input is first turned by its table row. w1 (R, S, D, F),
   b1 (R, S, 1, F), w2 (R, S, F, D), w_out (R, D, C): C-contiguous float32. Inputs are spread over
   `threads` OpenMP threads (each input's sums in the same order: the same bits). Returns 0, or -1
   when D, F or C is not a multiple of 8 or above this file's limits. */
int encode_many(const float *x, int64_t x_step, const float *cos, const float *sin, int64_t batch, int64_t rows,
                int64_t dim, int64_t width, int64_t bits, const float *w1, const float *b1, const float *w2,
                const float *w_out, int64_t stacked, int64_t depth, uint64_t *out, int threads) {
    if (dim % 8 || width % 8 || bits % 8 || dim > ENCODE_MAX_DIM || width > ENCODE_MAX_WIDTH || bits > ENCODE_MAX_BITS
        || depth > stacked || (cos == NULL) != (sin == NULL))
        return -1;
    int64_t words = (bits + 63) / 64, half = dim / 2, quads = (batch + QUAD - 1) / QUAD, jobs = rows * quads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) schedule(static)
#endif
    for (int64_t job = 0; job < jobs; job++) {
        int64_t r = job / quads, b0 = job % quads * QUAD;  /* row-major: a thread's inputs share their MLPs */
        int64_t count = batch - b0 < QUAD ? batch - b0 : QUAD;
        float y[QUAD][ENCODE_MAX_DIM], z[QUAD][ENCODE_MAX_WIDTH], h[QUAD][ENCODE_MAX_BITS];
        for (int64_t j = 0; j < count; j++) {
            const float *xs = x + (b0 + j) * x_step + r * dim;
            if (cos != NULL) {  /* x * cos - rotate_half(x) * sin, rotate_half(x) = (-x2, x1) */
                const float *c = cos + (b0 + j) * dim, *s = sin + (b0 + j) * dim;
                for (int64_t i = 0; i < half; i++) y[j][i] = xs[i] * c[i] - (-xs[i + half]) * s[i];  /* vectorised: */
                for (int64_t i = half; i < dim; i++) y[j][i] = xs[i] * c[i] - xs[i - half] * s[i];  /* no branch */
            } else {
                memcpy(y[j], xs, sizeof(float) * (size_t)dim);
            }
        }
        for (int64_t block = 0; block < depth; block++) {
            const float *w1b = w1 + (r * stacked + block) * dim * width, *b1b = b1 + (r * stacked + block) * width;
            const float *w2b = w2 + (r * stacked + block) * width * dim;
            for (int64_t j = 0; j < count; j++) memcpy(z[j], b1b, sizeof(float) * (size_t)width);
            if (count == QUAD)  /* z = b1 + y @ w1 */
                add_products4(z[0], ENCODE_MAX_WIDTH, y[0], ENCODE_MAX_DIM, dim, w1b, width);
            else
                for (int64_t j = 0; j < count; j++) add_products(z[j], y[j], dim, w1b, width, width);
            for (int64_t j = 0; j < count; j++) silu(z[j], width);
            if (count == QUAD)  /* y += silu(z) @ w2 */
                add_products4(y[0], ENCODE_MAX_DIM, z[0], ENCODE_MAX_WIDTH, width, w2b, dim);
            else
                for (int64_t j = 0; j < count; j++) add_products(y[j], z[j], width, w2b, dim, dim);
        }
        const float *wo = w_out + r * dim * bits;
        for (int64_t j = 0; j < count; j++) memset(h[j], 0, sizeof(float) * (size_t)bits);
        if (count == QUAD)  /* h = y @ w_out */
            add_products4(h[0], ENCODE_MAX_BITS, y[0], ENCODE_MAX_DIM, dim, wo, bits);
        else
            for (int64_t j = 0; j < count; j++) add_products(h[j], y[j], dim, wo, bits, bits);
        for (int64_t j = 0; j < count; j++) {
            uint64_t *code = out + ((b0 + j) * rows + r) * words;
            memset(code, 0, sizeof(uint64_t) * (size_t)words);
            for (int64_t c = 0; c < bits; c += 8) {
                __m256 positive = _mm256_cmp_ps(_mm256_loadu_ps(h[j] + c), _mm256_setzero_ps(), _CMP_GT_OQ);
                code[c / 64] |= (uint64_t)_mm256_movemask_ps(positive) << (c % 64);
            }
        }
    }
    return 0;
}

int encode_available(void) { return 1; }
#else
int encode_many(const float *x, int64_t x_step, const float *cos, const float *sin, int64_t batch, int64_t rows,
                int64_t dim, int64_t width, int64_t bits, const float *w1, const float *b1, const float *w2,
                const float *w_out, int64_t stacked, int64_t depth, uint64_t *out, int threads) {
    (void)x; (void)x_step; (void)cos; (void)sin; (void)batch; (void)rows; (void)dim; (void)width; (void)bits;
    (void)w1; (void)b1; (void)w2; (void)w_out; (void)stacked; (void)depth; (void)out; (void)threads;
    return -1;
}
int encode_available(void) { return 0; }
#endif

/* encode_many for one input per MLP (a decode step's query or key codes: MlpCoder.__call__), its geometry
   read from spec (int64: R, D, F, C, S, depth, then the addresses of w1, b1, w2 and w_out), made once per
   coder: ctypes converts every argument of a call (~0.15 us apiece), and encode_many takes 17. */
int encode_rows(const int64_t *spec, const float *x, uint64_t *out, int threads) {
    return encode_many(x, 0, NULL, NULL, 1, spec[0], spec[1], spec[2], spec[3], (const float *)(intptr_t)spec[6],
                       (const float *)(intptr_t)spec[7], (const float *)(intptr_t)spec[8],
                       (const float *)(intptr_t)spec[9], spec[4], spec[5], out, threads);
}
