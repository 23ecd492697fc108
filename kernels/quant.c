/* One-row matrix-vector products over GGUF (ggml) blocks as stored: out = W @ x [+ bias].

   Built by `make setup` into kernels/_quant.so and called through ctypes (kernels/quant.py).
   Each weight is decoded exactly as gguf.quants.dequantize computes it (same fp32 operations in
   the same order, no contraction: the file is compiled with -ffp-contract=off and the AVX2 code
   multiplies and adds the weight in separate instructions), then `weight * x` is accumulated in
   fp32 (FMA in the AVX2 path); the int16-activation kernels further down are the one exception.
   Rows are independent: one row is summed by one call in one fixed order, so any split of the
   rows gives the same bits.

   Block layouts (ggml, little-endian; f16 = IEEE half; w = the dequantised weight):
     Q4_1  f16 d, f16 m, 16 B nibbles            w = d * q + m         (20 B / 32)
     Q8_0  f16 d, 32 int8                        w = q * d             (34 B / 32)
     Q5_0  f16 d, u32 high bits, 16 B nibbles    w = d * (q - 16)      (22 B / 32)
     Q4_K  f16 d, f16 dmin, 12 B 6-bit scales/mins, 128 B nibbles (8 sub-blocks of 32)
                                                 w = (d * sc) * q - (dmin * mn)   (144 B / 256)
     Q6_K  128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, f16 d (16 sub-blocks of 16)
                                                 w = (d * sc) * (q - 32)          (210 B / 256)
   Legacy 32-value blocks: value i < 16 is the low nibble of byte i, value i >= 16 the high
   nibble of byte i - 16; Q5_0's bit i of the u32 is value i's fifth bit.

   The kind ids equal kernels/quant_cpu.py's KIND_* constants. The SIMD path is chosen at compile
   time (__AVX2__ and __FMA__ and __F16C__, as -march=native sets them on this CPU class); the
   scalar path is the fallback and the reference of the same arithmetic. */
#include <stdint.h>
#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include "simd.h"  /* exp2_8 */
#define QUANT_SIMD 1
#else
#define QUANT_SIMD 0
#endif

enum { KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0, KIND_Q4_K, KIND_Q5_K, KIND_Q6_K };
enum { QK = 32, QK_K = 256 };

/* IEEE half -> float, exact (as numpy converts: normals, subnormals, inf, nan). */
static float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if QUANT_SIMD
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else {  /* subnormal: shift the mantissa up until its leading one is the implicit bit */
        exp = 113;
        while (!(man & 1024)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Q4_K / Q5_K sub-block j's 6-bit scale and min (ggml's packing of 12 bytes). */
static void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ------------------------------------------------------------------------ scalar rows */

static float row_q4_1_scalar(const uint8_t *rb, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 20, x += QK) {
        float d = half_to_float(rb), m = half_to_float(rb + 2);
        for (int i = 0; i < 16; i++) {
            float lo = d * (float)(rb[4 + i] & 15) + m, hi = d * (float)(rb[4 + i] >> 4) + m;
            acc += lo * x[i] + hi * x[i + 16];
        }
    }
    return acc;
}

static float row_q8_0_scalar(const uint8_t *rb, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 34, x += QK) {
        float d = half_to_float(rb);
        for (int i = 0; i < QK; i++) acc += ((float)(int8_t)rb[2 + i] * d) * x[i];
    }
    return acc;
}

static float row_q5_0_scalar(const uint8_t *rb, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 22, x += QK) {
        float d = half_to_float(rb);
        uint32_t qh = (uint32_t)rb[2] | ((uint32_t)rb[3] << 8) | ((uint32_t)rb[4] << 16) | ((uint32_t)rb[5] << 24);
        for (int i = 0; i < 16; i++) {
            int lo = (int)((rb[6 + i] & 15) | (((qh >> i) & 1) << 4)) - 16;
            int hi = (int)((rb[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16;
            acc += (d * (float)lo) * x[i] + (d * (float)hi) * x[i + 16];
        }
    }
    return acc;
}

static float row_q4_k_scalar(const uint8_t *rb, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 144, x += QK_K) {
        float d = half_to_float(rb), dmin = half_to_float(rb + 2);
        const uint8_t *qs = rb + 16;
        for (int j = 0; j < 8; j++) {  /* sub-block j: nibbles of bytes 32*(j/2).., low for even j */
            int sc, mn;
            scale_min_k4(rb + 4, j, &sc, &mn);
            float ds = d * (float)sc, dm = dmin * (float)mn;
            const uint8_t *q = qs + 32 * (j / 2);
            int shift = 4 * (j & 1);
            for (int i = 0; i < 32; i++) acc += (ds * (float)((q[i] >> shift) & 15) - dm) * x[32 * j + i];
        }
    }
    return acc;
}

static float row_q6_k_scalar(const uint8_t *rb, int64_t nb, const float *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 210, x += QK_K) {
        float d = half_to_float(rb + 208);
        const int8_t *scales = (const int8_t *)(rb + 192);
        for (int n = 0; n < 2; n++) {  /* two halves of 128 values */
            const uint8_t *ql = rb + 64 * n, *qh = rb + 128 + 32 * n;
            const float *xh = x + 128 * n;
            for (int l = 0; l < 32; l++) {
                int q1 = (int)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                const int8_t *sc = scales + 8 * n + l / 16;
                acc += ((d * (float)sc[0]) * (float)q1) * xh[l] + ((d * (float)sc[2]) * (float)q2) * xh[l + 32]
                     + ((d * (float)sc[4]) * (float)q3) * xh[l + 64] + ((d * (float)sc[6]) * (float)q4) * xh[l + 96];
            }
        }
    }
    return acc;
}

/* ------------------------------------------------------------------------ AVX2 rows */
#if QUANT_SIMD

static float hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float hsum(__m256 v) {
    return hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

/* 8 bytes (zero- or sign-extended) as 8 floats */
static inline __m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

static float row_q4_1_simd(const uint8_t *rb, int64_t nb, const float *x) {
    const __m128i low4 = _mm_set1_epi8(15);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 20, x += QK) {
        __m256 d = _mm256_set1_ps(half_to_float(rb)), m = _mm256_set1_ps(half_to_float(rb + 2));
        __m128i q = _mm_loadu_si128((const __m128i *)(rb + 4));
        __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
        /* NOTE: mul then add (not fmadd) for the weight: gguf rounds d * q before adding m */
        a0 = _mm256_fmadd_ps(_mm256_add_ps(_mm256_mul_ps(d, u8x8(lo)), m), _mm256_loadu_ps(x), a0);
        a1 = _mm256_fmadd_ps(_mm256_add_ps(_mm256_mul_ps(d, u8x8(_mm_srli_si128(lo, 8))), m), _mm256_loadu_ps(x + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_add_ps(_mm256_mul_ps(d, u8x8(hi)), m), _mm256_loadu_ps(x + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_add_ps(_mm256_mul_ps(d, u8x8(_mm_srli_si128(hi, 8))), m), _mm256_loadu_ps(x + 24), a3);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

static float row_q8_0_simd(const uint8_t *rb, int64_t nb, const float *x) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 34, x += QK) {
        __m256 d = _mm256_set1_ps(half_to_float(rb));
        __m128i q0 = _mm_loadu_si128((const __m128i *)(rb + 2)), q1 = _mm_loadu_si128((const __m128i *)(rb + 18));
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(i8x8(q0), d), _mm256_loadu_ps(x), a0);
        a1 = _mm256_fmadd_ps(_mm256_mul_ps(i8x8(_mm_srli_si128(q0, 8)), d), _mm256_loadu_ps(x + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_mul_ps(i8x8(q1), d), _mm256_loadu_ps(x + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_mul_ps(i8x8(_mm_srli_si128(q1, 8)), d), _mm256_loadu_ps(x + 24), a3);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

static float row_q4_k_simd(const uint8_t *rb, int64_t nb, const float *x) {
    const __m128i low4 = _mm_set1_epi8(15);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 144, x += QK_K) {
        float d = half_to_float(rb), dmin = half_to_float(rb + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min_k4(rb + 4, j, &sc, &mn);
            __m256 ds = _mm256_set1_ps(d * (float)sc), dm = _mm256_set1_ps(dmin * (float)mn);
            const uint8_t *q = rb + 16 + 32 * (j / 2);
            __m128i v0 = _mm_loadu_si128((const __m128i *)q), v1 = _mm_loadu_si128((const __m128i *)(q + 16));
            if (j & 1) { v0 = _mm_srli_epi16(v0, 4); v1 = _mm_srli_epi16(v1, 4); }
            v0 = _mm_and_si128(v0, low4);
            v1 = _mm_and_si128(v1, low4);
            const float *xs = x + 32 * j;
            a0 = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_mul_ps(ds, u8x8(v0)), dm), _mm256_loadu_ps(xs), a0);
            a1 = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_mul_ps(ds, u8x8(_mm_srli_si128(v0, 8))), dm), _mm256_loadu_ps(xs + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_mul_ps(ds, u8x8(v1)), dm), _mm256_loadu_ps(xs + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_mul_ps(ds, u8x8(_mm_srli_si128(v1, 8))), dm), _mm256_loadu_ps(xs + 24), a3);
        }
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

static float row_q5_0_simd(const uint8_t *rb, int64_t nb, const float *x) {
    const __m256i low4 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1), off = _mm256_set1_epi32(16);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 22, x += QK) {
        __m256 d = _mm256_set1_ps(half_to_float(rb));
        uint32_t bits;
        memcpy(&bits, rb + 2, sizeof bits);  /* little-endian, as x86 is */
        __m256i qh = _mm256_set1_epi32((int)bits);
        __m256i n0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rb + 6)));
        __m256i n1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rb + 14)));
        /* value i's fifth bit is bit i of qh: lanes 0-7, 8-15 (low nibbles), 16-23, 24-31 (high) */
        __m256i s0 = lane, s1 = _mm256_add_epi32(lane, eight), s2 = _mm256_add_epi32(s1, eight), s3 = _mm256_add_epi32(s2, eight);
#define Q5_HIGH(s) _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh, s), one), 4)
        __m256i q0 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(n0, low4), Q5_HIGH(s0)), off);
        __m256i q1 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(n1, low4), Q5_HIGH(s1)), off);
        __m256i q2 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(n0, 4), Q5_HIGH(s2)), off);
        __m256i q3 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(n1, 4), Q5_HIGH(s3)), off);
#undef Q5_HIGH
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q0)), _mm256_loadu_ps(x), a0);
        a1 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q1)), _mm256_loadu_ps(x + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q2)), _mm256_loadu_ps(x + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q3)), _mm256_loadu_ps(x + 24), a3);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* 8 bytes at p, zero-extended to 8 int32 lanes */
static inline __m256i u8x8_i32(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

static float row_q6_k_simd(const uint8_t *rb, int64_t nb, const float *x) {
    const __m256i low4 = _mm256_set1_epi32(15), two = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 210, x += QK_K) {
        float d = half_to_float(rb + 208);
        const int8_t *scales = (const int8_t *)(rb + 192);
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = rb + 64 * n, *qh = rb + 128 + 32 * n;
            const float *xh = x + 128 * n;
            for (int l = 0; l < 32; l += 8) {  /* 8 lanes share one sub-block of 16: l / 16 is constant */
                const int8_t *sc = scales + 8 * n + l / 16;
                __m256i lo = u8x8_i32(ql + l), hi = u8x8_i32(ql + l + 32), h = u8x8_i32(qh + l);
                __m256i q1 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(lo, low4),
                                              _mm256_slli_epi32(_mm256_and_si256(h, two), 4)), off);
                __m256i q2 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(hi, low4),
                                              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), two), 4)), off);
                __m256i q3 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(lo, 4),
                                              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), two), 4)), off);
                __m256i q4 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(hi, 4),
                                              _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4)), off);
                a0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d * (float)sc[0]), _mm256_cvtepi32_ps(q1)), _mm256_loadu_ps(xh + l), a0);
                a1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d * (float)sc[2]), _mm256_cvtepi32_ps(q2)), _mm256_loadu_ps(xh + l + 32), a1);
                a2 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d * (float)sc[4]), _mm256_cvtepi32_ps(q3)), _mm256_loadu_ps(xh + l + 64), a2);
                a3 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d * (float)sc[6]), _mm256_cvtepi32_ps(q4)), _mm256_loadu_ps(xh + l + 96), a3);
            }
        }
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
#endif

/* ============================================================ int16 activations (issue #20)

   The same products with x first rounded to int16: x is cut into runs of 32 (one per legacy
   block, eight per k-quant block, aligned with their 32-value sub-blocks), each run stored as
   int16 q with one fp32 scale xd = max|x| / 32639 and the sum of its q. Each 32-value run of a
   row is then one exact integer dot product of the weight's integer codes with q, scaled once in
   fp32 by the block's (and sub-block's) scales times xd. The weights are read as stored; only
   the activations are rounded, to 1 part in 65,278 of their run's range (llama.cpp rounds them
   to int8, 1 in 254: measured 0.7 % of perplexity on SmolLM2 against ~0 here, docs/DECISIONS.md).
   AVX2 turns 32 codes times 32 activations into 8 int32 sums with two madd instructions (signed
   codes) or two maddubs and two madd over the byte planes (unsigned codes, x16 below), where the
   fp32 kernels above spend about eight instructions per 8 weights. Where the compiler targets
   AVX-512 VNNI (-march=native on such a CPU), two vpdpbusd do the planes' work, and with VBMI a
   Q5_0 block's nibbles and fifth bits unpack in three instructions instead of nine: together
   1.3-1.6x faster Q5_0 / Q4_K / Q6_K rows on one thread (docs/DECISIONS.md). The AVX2 paths
   stay, and tests build them on AVX-512 machines too (tests/test_quant.py, avx2_library).

   The integer sums are exact (|code| <= 128, |q| <= 32639: a madd pair stays below 2^23; a
   maddubs pair of codes <= 63 and bytes >= -128 stays within int16), so the
   SIMD and scalar paths differ only in the order of the fp32 additions of the per-run terms (and,
   for Q5_0's SIMD rows, in taking the codes' offset out of the row's fp32 sum, not each run's). */

/* The largest |q|: 127 * 256 + 127, so that every q splits into two signed bytes (below). */
enum { X16_MAX = 32639 };

/* x as the int16 kernels read it, for n values: q (n,) int16 codes; planes (2n,) the same codes
   as two signed bytes per value, q = 256 * high + low (low the signed low byte), stored per run
   of 32 as its 32 low bytes then its 32 high bytes; d (n/32,) fp32 scales; sum (n/32,) and
   sum4 (n/4,) int32 sums of q over each run of 32 and of 4. The AVX2 kernels of formats with
   unsigned codes (Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) multiply the codes by both byte planes with
   maddubs (unsigned x signed bytes, 32 products an instruction) and take a stored offset out of
   each int32 lane with sum4 (Q5_0: out of the row's sum with sum, rowx_q5_0_simd); Q8_0's signed
   codes use q. */
typedef struct {
    const int16_t *q;
    const int8_t *planes;
    const float *d;
    const int32_t *sum, *sum4;
} x16;

/* Bytes of the scratch for n values, and where each part of x16 lies in it. */
static int64_t x16_bytes(int64_t n) {
    return (int64_t)(sizeof(int16_t) + 2) * n + (int64_t)(sizeof(float) + sizeof(int32_t)) * (n / QK)
           + (int64_t)sizeof(int32_t) * (n / 4);
}

static x16 x16_in(uint8_t *scratch, int64_t n) {
    x16 x;
    x.q = (const int16_t *)scratch;
    x.planes = (const int8_t *)(scratch + sizeof(int16_t) * n);
    x.d = (const float *)(scratch + 4 * n);
    x.sum = (const int32_t *)(x.d + n / QK);
    x.sum4 = x.sum + n / QK;
    return x;
}

/* x (n,) fp32, n a multiple of 32 -> the x16 in `scratch` (x16_bytes(n), 4-byte aligned): each
   run of 32 rounded to int16 codes of one fp32 scale max|x| / X16_MAX. The AVX2 path gives the
   same bits (the same scale; cvtps rounds half to even as nearbyintf does in the default mode). */
static void quantize_x(const float *x, int64_t n, uint8_t *scratch) {
    x16 v = x16_in(scratch, n);
    int16_t *q = (int16_t *)v.q;
    int8_t *planes = (int8_t *)v.planes;
    float *d = (float *)v.d;
    int32_t *s = (int32_t *)v.sum, *s4 = (int32_t *)v.sum4;
    for (int64_t c = 0; c < n / QK; c++) {
        const float *xc = x + QK * c;
#if QUANT_SIMD
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 xs[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            xs[i] = _mm256_loadu_ps(xc + 8 * i);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, xs[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        float id = amax > 0.0f ? (float)X16_MAX / amax : 0.0f;
        const __m256i hi = _mm256_set1_epi32(X16_MAX), lo = _mm256_set1_epi32(-X16_MAX);
        __m256i codes[4], low[4], high[4];
        for (int i = 0; i < 4; i++) {
            codes[i] = _mm256_cvtps_epi32(_mm256_mul_ps(xs[i], _mm256_set1_ps(id)));
            codes[i] = _mm256_max_epi32(_mm256_min_epi32(codes[i], hi), lo);
            low[i] = _mm256_srai_epi32(_mm256_slli_epi32(codes[i], 24), 24);  /* the signed low byte */
            high[i] = _mm256_srai_epi32(_mm256_sub_epi32(codes[i], low[i]), 8);
        }
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        /* packs work within 128-bit lanes: the permutes put the values back in order */
        __m256i q01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[0], codes[1]), 0xD8);
        __m256i q23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[2], codes[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + QK * c), q01);
        _mm256_storeu_si256((__m256i *)(q + QK * c + 16), q23);
        __m256i l8 = _mm256_packs_epi16(_mm256_packs_epi32(low[0], low[1]), _mm256_packs_epi32(low[2], low[3]));
        __m256i h8 = _mm256_packs_epi16(_mm256_packs_epi32(high[0], high[1]), _mm256_packs_epi32(high[2], high[3]));
        _mm256_storeu_si256((__m256i *)(planes + 2 * QK * c), _mm256_permutevar8x32_epi32(l8, order));
        _mm256_storeu_si256((__m256i *)(planes + 2 * QK * c + QK), _mm256_permutevar8x32_epi32(h8, order));
        __m256i fours = _mm256_hadd_epi32(_mm256_hadd_epi32(codes[0], codes[1]), _mm256_hadd_epi32(codes[2], codes[3]));
        fours = _mm256_permutevar8x32_epi32(fours, order);  /* lane j: the sum of values 4j .. 4j + 3 */
        _mm256_storeu_si256((__m256i *)(s4 + QK / 4 * c), fours);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(fours), _mm256_extracti128_si256(fours, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        s[c] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
#else
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            float a = xc[i] < 0 ? -xc[i] : xc[i];
            amax = a > amax ? a : amax;
        }
        float id = amax > 0.0f ? (float)X16_MAX / amax : 0.0f;
        int32_t sum[QK / 4] = {0};
        for (int i = 0; i < QK; i++) {
            int v = (int)nearbyintf(xc[i] * id);
            v = v > X16_MAX ? X16_MAX : (v < -X16_MAX ? -X16_MAX : v);
            int low = (int)(int8_t)(uint8_t)(v & 255);
            q[QK * c + i] = (int16_t)v;
            planes[2 * QK * c + i] = (int8_t)low;
            planes[2 * QK * c + QK + i] = (int8_t)((v - low) / 256);
            sum[i / 4] += v;
        }
        s[c] = 0;
        for (int j = 0; j < QK / 4; j++) {
            s4[QK / 4 * c + j] = sum[j];
            s[c] += sum[j];
        }
#endif
        d[c] = amax / (float)X16_MAX;
    }
}

typedef float (*row_x16_fn)(const uint8_t *, int64_t, const x16 *);

static float rowx_q8_0_scalar(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int16_t *xq = x->q;
    const float *xd = x->d;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 34, xq += QK) {
        int32_t isum = 0;
        for (int i = 0; i < QK; i++) isum += (int32_t)(int8_t)rb[2 + i] * xq[i];
        acc += half_to_float(rb) * xd[b] * (float)isum;
    }
    return acc;
}

static float rowx_q4_0_scalar(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int16_t *xq = x->q;
    const float *xd = x->d;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 18, xq += QK) {
        int32_t isum = 0;
        for (int i = 0; i < 16; i++)
            isum += ((rb[2 + i] & 15) - 8) * xq[i] + ((rb[2 + i] >> 4) - 8) * xq[i + 16];
        acc += half_to_float(rb) * xd[b] * (float)isum;
    }
    return acc;
}

static float rowx_q4_1_scalar(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int16_t *xq = x->q;
    const float *xd = x->d;
    const int32_t *xs = x->sum;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 20, xq += QK) {
        int32_t isum = 0;
        for (int i = 0; i < 16; i++) isum += (rb[4 + i] & 15) * xq[i] + (rb[4 + i] >> 4) * xq[i + 16];
        acc += half_to_float(rb) * xd[b] * (float)isum + half_to_float(rb + 2) * xd[b] * (float)xs[b];
    }
    return acc;
}

static float rowx_q5_0_scalar(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int16_t *xq = x->q;
    const float *xd = x->d;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 22, xq += QK) {
        uint32_t qh = (uint32_t)rb[2] | ((uint32_t)rb[3] << 8) | ((uint32_t)rb[4] << 16) | ((uint32_t)rb[5] << 24);
        int32_t isum = 0;
        for (int i = 0; i < 16; i++) {
            int lo = (int)((rb[6 + i] & 15) | (((qh >> i) & 1) << 4)) - 16;
            int hi = (int)((rb[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16;
            isum += lo * xq[i] + hi * xq[i + 16];
        }
        acc += half_to_float(rb) * xd[b] * (float)isum;
    }
    return acc;
}

static float rowx_q4_k_scalar(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int16_t *xq = x->q;
    const float *xd = x->d;
    const int32_t *xs = x->sum;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 144) {
        float d = half_to_float(rb), dmin = half_to_float(rb + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min_k4(rb + 4, j, &sc, &mn);
            const uint8_t *q = rb + 16 + 32 * (j / 2);
            const int16_t *xj = xq + QK_K * b + QK * j;
            int shift = 4 * (j & 1);
            int32_t isum = 0;
            for (int i = 0; i < 32; i++) isum += ((q[i] >> shift) & 15) * xj[i];
            int64_t c = 8 * b + j;
            acc += d * (float)sc * xd[c] * (float)isum - dmin * (float)mn * xd[c] * (float)xs[c];
        }
    }
    return acc;
}

static float rowx_q6_k_scalar(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int16_t *xq = x->q;
    const float *xd = x->d;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 210) {
        float d = half_to_float(rb + 208);
        const int8_t *scales = (const int8_t *)(rb + 192);
        for (int k = 0; k < 8; k++) {  /* run k: half n = k / 4, which (q1..q4) = k % 4 */
            int n = k / 4, which = k % 4;
            const uint8_t *ql = rb + 64 * n + 32 * (which & 1), *qh = rb + 128 + 32 * n;
            const int16_t *xk = xq + QK_K * b + QK * k;
            for (int half = 0; half < 2; half++) {  /* two sub-blocks of 16, scales 2k and 2k + 1 */
                int32_t isum = 0;
                for (int l = 16 * half; l < 16 * half + 16; l++) {
                    int low = which < 2 ? (ql[l] & 15) : (ql[l] >> 4);
                    isum += ((int)(low | (((qh[l] >> (2 * which)) & 3) << 4)) - 32) * xk[l];
                }
                acc += d * (float)scales[2 * k + half] * xd[8 * b + k] * (float)isum;
            }
        }
    }
    return acc;
}

#if QUANT_SIMD

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 32 signed byte codes w times 32 int16 activations at x -> 8 int32 partial sums: values 0-15
   in `lo`, 16-31 in `hi` when the caller needs them apart (Q6_K), else added. */
static inline void dot_w16(__m256i w, const int16_t *x, __m256i *lo, __m256i *hi) {
    *lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)), load32(x));
    *hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1)), load32(x + 16));
}

static inline __m256 dot32(__m256i w, const int16_t *x) {
    __m256i lo, hi;
    dot_w16(w, x, &lo, &hi);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}

/* 16 bytes of nibbles -> 32 bytes: value i < 16 the low nibble of byte i, value i >= 16 the high
   nibble of byte i - 16 (the legacy blocks' order). */
static inline __m256i nibbles_32(const uint8_t *p) {
    /* the 16 bytes in both halves, the upper half's 64-bit lanes shifted down 4 (a byte's high
       nibble comes down; the bits shifted in from the next byte are masked off) */
    __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
}

/* The 32 bits of `bits` as 32 bytes, byte i = 0xFF where bit i is set. */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);  /* byte i = byte i / 8 of bits */
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

static float rowx_q8_0_simd(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int16_t *xq = x->q;
    const float *xd = x->d;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 34, xq += QK)
        acc = _mm256_fmadd_ps(dot32(load32(rb + 2), xq), _mm256_set1_ps(half_to_float(rb) * xd[b]), acc);
    return hsum(acc);
}

/* 32 unsigned codes w (each <= 63) times the run of x at `planes` (its 32 low then 32 high
   bytes), less `minus` -> 8 int32 sums of 4 products each (lane j: values 4j .. 4j + 3). */
static inline __m256i dot_planes_less(__m256i w, const int8_t *planes, __m256i minus) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i high = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, load32(planes + QK));
    return _mm256_dpbusd_epi32(_mm256_sub_epi32(_mm256_slli_epi32(high, 8), minus), w, load32(planes));
#else
    const __m256i ones = _mm256_set1_epi16(1), c256 = _mm256_set1_epi16(256);
    __m256i low = _mm256_maddubs_epi16(w, load32(planes)), high = _mm256_maddubs_epi16(w, load32(planes + QK));
    return _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(high, c256), _mm256_madd_epi16(low, ones)), minus);
#endif
}

static inline __m256i dot_planes(__m256i w, const int8_t *planes) {
    return dot_planes_less(w, planes, _mm256_setzero_si256());
}

/* The same for codes stored as code + 2^shift: lane j less 2^shift * sum4[j], as floats. */
static inline __m256 dot32_offset(__m256i w, const int8_t *planes, const int32_t *sum4, int shift) {
    return _mm256_cvtepi32_ps(dot_planes_less(w, planes, _mm256_slli_epi32(load32(sum4), shift)));
}

static float rowx_q4_0_simd(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int8_t *xp = x->planes;
    const float *xd = x->d;
    const int32_t *s4 = x->sum4;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 18, xp += 2 * QK, s4 += QK / 4)
        acc = _mm256_fmadd_ps(dot32_offset(nibbles_32(rb + 2), xp, s4, 3), _mm256_set1_ps(half_to_float(rb) * xd[b]), acc);
    return hsum(acc);
}

static float rowx_q4_1_simd(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int8_t *xp = x->planes;
    const float *xd = x->d;
    const int32_t *xs = x->sum;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t b = 0; b < nb; b++, rb += 20, xp += 2 * QK) {
        __m256 dot = _mm256_cvtepi32_ps(dot_planes(nibbles_32(rb + 4), xp));
        acc = _mm256_fmadd_ps(dot, _mm256_set1_ps(half_to_float(rb) * xd[b]), acc);
        mins += half_to_float(rb + 2) * xd[b] * (float)xs[b];
    }
    return hsum(acc) + mins;
}

/* One Q5_0 block's stored codes (code + 16, unsigned) times its run of x: 8 int32 lane sums as
   floats, the offset not taken out (rowx_q5_0_simd takes it out of the row's sum). */
static inline __m256 q5_0_dot(const uint8_t *rb, const int8_t *xp) {
    uint32_t bits;
    memcpy(&bits, rb + 2, sizeof bits);  /* little-endian, as x86 is */
#if defined(__AVX512VBMI__) && defined(__AVX512VL__)
    __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(rb + 6)));
    const __m256i shifts = _mm256_setr_epi8(0, 8, 16, 24, 32, 40, 48, 56, 0, 8, 16, 24, 32, 40, 48, 56,
                                            4, 12, 20, 28, 36, 44, 52, 60, 4, 12, 20, 28, 36, 44, 52, 60);
    __m256i nib = _mm256_and_si256(_mm256_multishift_epi64_epi8(shifts, both), _mm256_set1_epi8(15));
    __m256i w = _mm256_mask_add_epi8(nib, (__mmask32)bits, nib, _mm256_set1_epi8(16));
#else
    __m256i w = _mm256_or_si256(nibbles_32(rb + 6), _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(16)));
#endif
    return _mm256_cvtepi32_ps(dot_planes(w, xp));
}

/* The codes' offset (16) comes out once per row: 16 * sum over blocks of d * x's scale * x's
   integer sum over the run, four blocks a vector (one per block cost a load, a shift and a
   subtraction per block, a sixth of the block's instructions). */
static float rowx_q5_0_simd(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int8_t *xp = x->planes;
    const float *xd = x->d;
    const int32_t *xs = x->sum;
    __m256 acc = _mm256_setzero_ps();
    __m128 offset = _mm_setzero_ps();
    int64_t b = 0;
    /* Four blocks at a time: their fp16 scales converted and multiplied by x's in one vector, then
       broadcast from memory (one converted scale a block cost as many shuffles as its codes). */
    for (; b + 4 <= nb; b += 4, rb += 4 * 22, xp += 4 * 2 * QK) {
        uint16_t h[4];
        float f[4];
        for (int i = 0; i < 4; i++) memcpy(h + i, rb + 22 * i, sizeof h[i]);
        __m128 f4 = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h)), _mm_loadu_ps(xd + b));
        _mm_storeu_ps(f, f4);
        offset = _mm_fmadd_ps(f4, _mm_cvtepi32_ps(_mm_loadu_si128((const __m128i *)(xs + b))), offset);
        for (int i = 0; i < 4; i++)
            acc = _mm256_fmadd_ps(q5_0_dot(rb + 22 * i, xp + 2 * QK * i), _mm256_broadcast_ss(f + i), acc);
    }
    float rest = 0.0f;
    for (; b < nb; b++, rb += 22, xp += 2 * QK) {
        float f = half_to_float(rb) * xd[b];
        acc = _mm256_fmadd_ps(q5_0_dot(rb, xp), _mm256_set1_ps(f), acc);
        rest += f * (float)xs[b];
    }
    return hsum(acc) - 16.0f * (hsum128(offset) + rest);
}

/* Q4_K's 12 bytes of 6-bit scales and mins (scale_min_k4's packing) -> 8 scale bytes then 8 min bytes. */
static inline void unpack_scales_k4(const uint8_t *packed, uint8_t out[16]) {
    uint32_t s[3], u[4];
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    memcpy(s, packed, sizeof s);
    u[0] = s[0] & six;                                   /* scales 0-3: low 6 bits of bytes 0-3 */
    u[1] = (s[2] & four) | (((s[0] >> 6) & two) << 4);   /* scales 4-7: bytes 8-11's low nibbles + bytes 0-3's top bits */
    u[2] = s[1] & six;                                   /* mins 0-3: low 6 bits of bytes 4-7 */
    u[3] = ((s[2] >> 4) & four) | (((s[1] >> 6) & two) << 4);  /* mins 4-7: high nibbles + bytes 4-7's top bits */
    memcpy(out, u, sizeof u);
}

static float rowx_q4_k_simd(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int8_t *xp = x->planes;
    const float *xd = x->d;
    const int32_t *xs = x->sum;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 144, xp += 2 * QK_K, xd += 8, xs += 8) {
        uint8_t sm[16];
        unpack_scales_k4(rb + 4, sm);
        __m256 xd8 = _mm256_loadu_ps(xd);
        __m256 scale = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(rb)), u8x8(_mm_loadl_epi64((const __m128i *)sm))), xd8);
        __m256 minimum = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(rb + 2)), u8x8(_mm_loadl_epi64((const __m128i *)(sm + 8)))), xd8);
        acc = _mm256_fnmadd_ps(minimum, _mm256_cvtepi32_ps(load32(xs)), acc);
        for (int j = 0; j < 8; j += 2) {  /* 32 bytes: sub-block j in the low nibbles, j + 1 in the high */
            __m256i q = load32(rb + 16 + 16 * j);
            __m256 dot0 = _mm256_cvtepi32_ps(dot_planes(_mm256_and_si256(q, low4), xp + 2 * QK * j));
            __m256 dot1 = _mm256_cvtepi32_ps(dot_planes(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4), xp + 2 * QK * (j + 1)));
            acc = _mm256_fmadd_ps(dot0, _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(j)), acc);
            acc = _mm256_fmadd_ps(dot1, _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(j + 1)), acc);
        }
    }
    return hsum(acc);
}

/* Q6_K: codes stored as code + 32, one scale per 16 values: a run's two halves (lanes 0-3 and
   4-7 of dot_planes) get their scales in one vector. */
static float rowx_q6_k_simd(const uint8_t *rb, int64_t nb, const x16 *x) {
    const int8_t *xp = x->planes;
    const float *xd = x->d;
    const int32_t *s4 = x->sum4;
    const __m256i low4 = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, rb += 210, xp += 2 * QK_K, xd += 8, s4 += QK_K / 4) {
        float d = half_to_float(rb + 208);
        const int8_t *scales = (const int8_t *)(rb + 192);
        for (int n = 0; n < 2; n++) {  /* half n: runs 4n .. 4n + 3 */
            __m256i l0 = load32(rb + 64 * n), l1 = load32(rb + 64 * n + 32), h = load32(rb + 128 + 32 * n);
            __m256i q[4] = {  /* the stored 6-bit codes of the half's four runs of 32 */
                _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45)),
                _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(h, bits45)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45))};
            /* d * the half's 8 scales (2 per run), as floats */
            __m256 half_scales = _mm256_mul_ps(_mm256_set1_ps(d), i8x8(_mm_loadl_epi64((const __m128i *)(scales + 8 * n))));
            for (int which = 0; which < 4; which++) {
                int k = 4 * n + which;
                const __m256i pick = _mm256_setr_epi32(2 * which, 2 * which, 2 * which, 2 * which,
                                                       2 * which + 1, 2 * which + 1, 2 * which + 1, 2 * which + 1);
                __m256 f = _mm256_mul_ps(_mm256_permutevar8x32_ps(half_scales, pick), _mm256_set1_ps(xd[k]));
                acc = _mm256_fmadd_ps(dot32_offset(q[which], xp + 2 * QK * k, s4 + QK / 4 * k, 5), f, acc);
            }
        }
    }
    return hsum(acc);
}
#endif

/* The int16-activation row kernel of `kind` (SIMD unless `scalar`), or 0 where there is none. */
static row_x16_fn row_kernel_x16(int kind, int scalar) {
#if QUANT_SIMD
    if (!scalar) {
        switch (kind) {
        case KIND_Q4_0: return rowx_q4_0_simd;
        case KIND_Q4_1: return rowx_q4_1_simd;
        case KIND_Q5_0: return rowx_q5_0_simd;
        case KIND_Q8_0: return rowx_q8_0_simd;
        case KIND_Q4_K: return rowx_q4_k_simd;
        case KIND_Q6_K: return rowx_q6_k_simd;
        default: break;
        }
    }
#endif
    (void)scalar;
    switch (kind) {
    case KIND_Q4_0: return rowx_q4_0_scalar;
    case KIND_Q4_1: return rowx_q4_1_scalar;
    case KIND_Q5_0: return rowx_q5_0_scalar;
    case KIND_Q8_0: return rowx_q8_0_scalar;
    case KIND_Q4_K: return rowx_q4_k_scalar;
    case KIND_Q6_K: return rowx_q6_k_scalar;
    default: return 0;
    }
}

/* 1 when `kind` has an int16-activation kernel (scalar or SIMD) in this library. */
int quant_x16_supports(int kind) { return row_kernel_x16(kind, 1) != 0; }

/* Bytes of the scratch quant_matvec_x16 needs for `cols` activations (x16_bytes). */
int64_t quant_x16_scratch_bytes(int64_t cols) { return x16_bytes(cols); }

typedef float (*row_fn)(const uint8_t *, int64_t, const float *);

/* The row kernel of `kind`: the SIMD one where compiled in, unless `scalar` asks for the fallback
   (tests run both paths of one build). */
static row_fn row_kernel(int kind, int scalar) {
#if QUANT_SIMD
    if (!scalar) {
        switch (kind) {
        case KIND_Q4_1: return row_q4_1_simd;
        case KIND_Q8_0: return row_q8_0_simd;
        case KIND_Q4_K: return row_q4_k_simd;
        case KIND_Q6_K: return row_q6_k_simd;
        case KIND_Q5_0: return row_q5_0_simd;
        default: break;
        }
    }
#endif
    (void)scalar;
    switch (kind) {
    case KIND_Q4_1: return row_q4_1_scalar;
    case KIND_Q8_0: return row_q8_0_scalar;
    case KIND_Q4_K: return row_q4_k_scalar;
    case KIND_Q5_0: return row_q5_0_scalar;
    case KIND_Q6_K: return row_q6_k_scalar;
    default: return 0;
    }
}

/* 1 when the library has a kernel for `kind`. */
int quant_supports(int kind) { return row_kernel(kind, 1) != 0; }

/* 1 when `kind` has a SIMD kernel in this build (the scalar-only kinds are slower than numba's
   vectorised ones, so kernels/quant.py uses C only for these by default). */
int quant_has_simd(int kind) { return QUANT_SIMD && row_kernel(kind, 0) != row_kernel(kind, 1); }

/* 1 when the SIMD (AVX2 + FMA + F16C) path was compiled in. */
int quant_simd(void) { return QUANT_SIMD; }

/* out[r] = sum_c W[r, c] * x[c] (+ bias[r]) for rows [row_start, row_end) of `blocks`, each row
   `row_bytes` bytes holding `blocks_per_row` blocks. bias may be NULL. Returns 0, or -1 for a
   kind without a kernel (checked once by the caller: kernels/quant.py). scalar: 1 forces the
   scalar fallback. */
int quant_matvec(int kind, const uint8_t *blocks, int64_t row_bytes, int64_t blocks_per_row,
                 int64_t row_start, int64_t row_end, const float *x, const float *bias, float *out,
                 int scalar) {
    row_fn row = row_kernel(kind, scalar);
    if (!row) return -1;
    for (int64_t r = row_start; r < row_end; r++) {
        float v = row(blocks + r * row_bytes, blocks_per_row, x);
        out[r] = bias ? v + bias[r] : v;
    }
    return 0;
}

/* quant_matvec with the rows cut into `threads` contiguous runs, one per OpenMP thread (libgomp:
   the same pool as numba's "omp" threading layer, kept alive between calls). Each row is still
   summed by one call of the same row kernel, so the bits equal one thread's. threads <= 1, or a
   build without OpenMP, runs quant_matvec on the calling thread. */
int quant_matvec_threads(int kind, const uint8_t *blocks, int64_t row_bytes, int64_t blocks_per_row,
                         int64_t row_start, int64_t row_end, const float *x, const float *bias, float *out,
                         int scalar, int threads) {
    row_fn row = row_kernel(kind, scalar);
    if (!row) return -1;
#ifdef _OPENMP
    int64_t rows = row_end - row_start;
    if (threads > 1 && rows > 1) {
        if (threads > rows) threads = (int)rows;
#pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), n = omp_get_num_threads();
            quant_matvec(kind, blocks, row_bytes, blocks_per_row, row_start + rows * t / n,
                         row_start + rows * (t + 1) / n, x, bias, out, scalar);
        }
        return 0;
    }
#endif
    (void)threads;
    return quant_matvec(kind, blocks, row_bytes, blocks_per_row, row_start, row_end, x, bias, out, scalar);
}

/* 1 when the library was built with OpenMP (quant_matvec_threads can split rows). */
int quant_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ============================================================ one decode step's block (issue #20)

   A decode step spends as long in the framework's small operations around the matrix products
   (norms, rope, residuals, the MLP's activation, one call per product) as in the products
   themselves (Qwen2.5-0.5B: ~21 ms of ~55 ms per token at 2 threads, docs/DECISIONS.md). These two
   calls do a block's work around its attention in C: quant_decode_head before it (norm, the
   q/k/v products, rope) and quant_decode_tail after it (output product, residual, norm, the MLP,
   residual). Each product's rows, over all its parts, are split over `threads` OpenMP threads in
   one parallel region. The arithmetic is the model's (spotlight/model.py): the same fp32
   operations in the same order, except that sums (the norm's mean of squares, the products) run
   in this file's order. */

typedef struct {
    int32_t kind;            /* KIND_* */
    int32_t x16;             /* 1: int16 activations (quant_matvec_x16), 0: fp32 (quant_matvec) */
    const uint8_t *blocks;   /* rows * row_bytes */
    int64_t row_bytes, blocks_per_row, rows;
    const float *bias;       /* rows, or NULL */
} quant_part;

/* out[0 : sum of rows] = parts stacked row-wise @ x (+ their biases); every part has `cols`
   columns. x is rounded to int16 once, into scratch, when a part asks for it. `scalar`: the
   scalar kernels (tests). Returns 0, or -1 for a part whose kind has no kernel of its activations. */
static int parts_matvec(const quant_part *parts, int n_parts, int64_t cols, const float *x, uint8_t *scratch,
                        float *out, int scalar, int threads) {
    enum { MAX_PARTS = 8 };
    if (n_parts < 1 || n_parts > MAX_PARTS) return -1;
    row_fn fp32_rows[MAX_PARTS];
    row_x16_fn x16_rows[MAX_PARTS];
    int64_t offset[MAX_PARTS + 1];
    int any_x16 = 0;
    offset[0] = 0;
    for (int i = 0; i < n_parts; i++) {
        fp32_rows[i] = parts[i].x16 ? 0 : row_kernel(parts[i].kind, scalar);
        x16_rows[i] = parts[i].x16 ? row_kernel_x16(parts[i].kind, scalar) : 0;
        if (!fp32_rows[i] && !x16_rows[i]) return -1;
        any_x16 |= parts[i].x16;
        offset[i + 1] = offset[i] + parts[i].rows;
    }
    x16 xv = x16_in(scratch, cols);
    if (any_x16) quantize_x(x, cols, scratch);
    int64_t total = offset[n_parts];
#ifdef _OPENMP
    if (threads > total) threads = (int)total;
#pragma omp parallel num_threads(threads > 1 ? threads : 1)
#endif
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        int t = 0, n = 1;
#endif
        int64_t start = total * t / n, end = total * (t + 1) / n;
        for (int i = 0; i < n_parts; i++) {
            const quant_part *p = parts + i;
            int64_t lo = start > offset[i] ? start : offset[i], hi = end < offset[i + 1] ? end : offset[i + 1];
            for (int64_t r = lo; r < hi; r++) {
                const uint8_t *rb = p->blocks + (r - offset[i]) * p->row_bytes;
                float v = p->x16 ? x16_rows[i](rb, p->blocks_per_row, &xv)
                                 : fp32_rows[i](rb, p->blocks_per_row, x);
                out[r] = p->bias ? v + p->bias[r - offset[i]] : v;
            }
        }
    }
    return 0;
}

/* quant_matvec with x rounded to int16 first (into `scratch`, quant_x16_scratch_bytes(cols)
   bytes, 4-byte aligned) and the rows split over `threads` OpenMP threads as
   quant_matvec_threads does: parts_matvec over one part, rows [row_start, row_end). x is rounded
   once, before the rows, so every split gives the same bits. Returns 0, or -1 for a kind without
   an int16 kernel. */
int quant_matvec_x16(int kind, const uint8_t *blocks, int64_t row_bytes, int64_t blocks_per_row,
                     int64_t row_start, int64_t row_end, const float *x, uint8_t *scratch,
                     const float *bias, float *out, int scalar, int threads) {
    if (!row_kernel_x16(kind, scalar)) return -1;
    quant_part part = {kind, 1, blocks + row_start * row_bytes, row_bytes, blocks_per_row, row_end - row_start,
                       bias ? bias + row_start : 0};
    int64_t cols = blocks_per_row * (kind == KIND_Q4_K || kind == KIND_Q5_K || kind == KIND_Q6_K ? QK_K : QK);
    return row_end > row_start ? parts_matvec(&part, 1, cols, x, scratch, out + row_start, scalar, threads) : 0;
}

/* out (dim,) = weight * (x * rsqrt(mean(x^2) + eps)), as spotlight/model.py RMSNorm (fp32); the
   squares are summed in double, so the mean is the correctly rounded one torch's fp32 sum
   approximates. */
static void rms_norm(const float *x, const float *weight, float eps, int64_t dim, float *out) {
    double squares = 0.0;
    for (int64_t i = 0; i < dim; i++) squares += (double)(x[i] * x[i]);
    float scale = 1.0f / sqrtf((float)(squares / (double)dim) + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * scale);
}

/* Before a block's attention: h = norm(x); qkv = the q/k/v parts @ h (+ biases); the first
   n_rope_heads heads of head_dim values (q's and k's) rotated by cos, sin (head_dim,) in the
   rotate-half convention: v[i] * cos[i] + (-v[i + D/2] or v[i - D/2]) * sin[i]. `h` (dim,) and
   `scratch` (quant_x16_scratch_bytes(dim)) are the caller's buffers. Returns 0 or -1. */
int quant_decode_head(const float *x, int64_t dim, const float *norm_weight, float eps, const quant_part *qkv,
                      int n_qkv, int n_rope_heads, int head_dim, const float *cos, const float *sin, float *h,
                      uint8_t *scratch, float *out, int threads) {
    rms_norm(x, norm_weight, eps, dim, h);
    if (parts_matvec(qkv, n_qkv, dim, h, scratch, out, 0, threads)) return -1;
    int half = head_dim / 2;
    for (int head = 0; head < n_rope_heads; head++) {
        float *v = out + (int64_t)head * head_dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] + (-b) * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
    return 0;
}

/* act (width,) = silu(gate) * up, silu(g) = g / (1 + e^-g): eight at a time where the build has
   AVX2, e^-g as simd.h's exp2_8 of -g * log2(e), capped at 2^126 (g below -87, where silu is 0 to
   fp32's precision; expf one value at a time was ~33 us of a Qwen2.5 layer, serial between two
   parallel products), expf for the rest. */
static void silu_mul(const float *gate, const float *up, int64_t width, float *act) {
    int64_t i = 0;
#if QUANT_SIMD
    const __m256 one = _mm256_set1_ps(1.0f), minus_log2e = _mm256_set1_ps(-1.44269504088896341f);
    for (; i + 8 <= width; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp2_8(_mm256_min_ps(_mm256_mul_ps(g, minus_log2e), _mm256_set1_ps(126.0f)));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < width; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* After a block's attention: out = x + wo @ attn; h = norm(out); [gate, up] = gate_up @ h;
   out += down @ (silu(gate) * up), silu(g) = g / (1 + exp(-g)). gate_up's parts stack gate then
   up (2 * width rows). Buffers: h (dim,), ff (2 * width,), act (width,), scratch
   (quant_x16_scratch_bytes(max(dim, width))). Returns 0 or -1. */
int quant_decode_tail(const float *x, int64_t dim, const float *attn, int64_t attn_dim, const quant_part *wo,
                      int n_wo, const float *norm_weight, float eps, const quant_part *gate_up, int n_gate_up,
                      int64_t width, const quant_part *down, int n_down, float *h, float *ff, float *act,
                      uint8_t *scratch, float *out, int threads) {
    if (parts_matvec(wo, n_wo, attn_dim, attn, scratch, h, 0, threads)) return -1;
    for (int64_t i = 0; i < dim; i++) out[i] = x[i] + h[i];
    rms_norm(out, norm_weight, eps, dim, h);
    if (parts_matvec(gate_up, n_gate_up, dim, h, scratch, ff, 0, threads)) return -1;
    silu_mul(ff, ff + width, width, act);
    if (parts_matvec(down, n_down, width, act, scratch, h, 0, threads)) return -1;
    for (int64_t i = 0; i < dim; i++) out[i] = out[i] + h[i];
    return 0;
}

/* ============================================================ a whole one-token step (issue #20)

   quant_decode_step runs every block of a decode step in one call, for a step that attends to all
   cached rows in every layer (spotlight/attention.py DecodePolicy.reads_every_row; spotlight/
   quantized.py FusedStep): per layer, quant_decode_head; the new key and value rows stored into
   the cache at `row` (fp16 rounded to nearest even, as torch's copy rounds, or fp32 as they are);
   attend.c's attend_decode over rows [0, row]; quant_decode_tail, whose output is the next
   block's input. The arithmetic is exactly the per-layer calls'; what goes is the Python between
   them (about 60 us a layer: the cache write, the policy, the attention call's checks). Built
   with the SIMD kernels only (attend.c's attend_decode needs AVX2 + FMA, fp16 rows F16C). */
#if QUANT_SIMD
typedef struct {
    const float *attention_norm, *ffn_norm;   /* (dim,) each */
    const quant_part *qkv, *wo, *gate_up, *down;
    float *h, *qkv_out, *ff, *act, *out;      /* the block's buffers (FusedDecode's) */
    uint8_t *scratch;
    float attention_eps, ffn_eps;
    int32_t n_qkv, n_wo, n_gate_up, n_down;
} quant_block;

/* attend.c's; weak, so a build of this file alone (tests/test_quant.py's variants) still loads */
__attribute__((weak)) int attend_decode(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k, const void *v,
                  int64_t head_stride, const int32_t *rows, int64_t rows_stride, int64_t count, int splits,
                  float *qs, float *stats, float *acc, float *out, int threads, int half,
                  const float *rot_lo, const float *rot_hi, int64_t rot_block, int64_t base, int64_t moved);

/* encode.c's (a decode step's key codes: quant_decode_step_coded); weak, as attend_decode */
__attribute__((weak)) int encode_rows(const int64_t *spec, const float *x, uint64_t *out, int threads);

/* The kv_heads rows of head_dim values at src into dst's row `row` of each head (head_stride
   elements apart): fp16 (half) or fp32. */
static void store_rows(const float *src, void *dst, int64_t kv_heads, int64_t head_dim, int64_t head_stride,
                      int64_t row, int half) {
    for (int64_t h = 0; h < kv_heads; h++) {
        const float *s = src + h * head_dim;
        if (!half) {
            memcpy((float *)dst + h * head_stride + row * head_dim, s, sizeof(float) * (size_t)head_dim);
            continue;
        }
        uint16_t *d = (uint16_t *)dst + h * head_stride + row * head_dim;
        int64_t i = 0;
        for (; i + 8 <= head_dim; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < head_dim; i++) d[i] = _cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT);
    }
}

/* x (dim,) the step's embedding -> blocks[n_blocks - 1].out (dim,). k, v: the cache's rows
   (L, kv_heads, Ncap, head_dim), fp16 (half) or fp32, layer_stride and head_stride elements
   apart; the step's token sits at `row` and attends to rows [0, row]. cos, sin (head_dim,) its
   rotation. qs, stats, acc, attn: attend_decode's buffers (kernels/attend_cpu.py AttendScratch)
   for `splits` runs per head, attn (heads * head_dim,) the attention output. Returns 0, or
   -(layer + 1) of the first block that failed (a part without a kernel, attend.c's geometry
   limits).

   quant_decode_step_coded: the same with each layer's new key also coded (a Spotlight step below dense_below, which
   attends to every row yet keeps the keys' codes for the steps past it): key_specs[i] is layer
   i's key coder (encode.c's encode_rows spec: kernels.MlpCoder), coding the kv_heads post-RoPE
   fp32 keys as the per-layer path codes them; their words (kv_heads, words) go into `codes`
   (L, kv_heads, words, code_capacity) uint64 at `row`, through `words_out` (kv_heads * words). */
int quant_decode_step_coded(const quant_block *blocks, int n_blocks, const float *x, int64_t dim, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, int64_t width, const float *cos, const float *sin,
                            void *k, void *v, int64_t layer_stride, int64_t head_stride, int64_t row, int half,
                            int splits, float *qs, float *stats, float *acc, float *attn,
                            const int64_t *const *key_specs, uint64_t *codes, int64_t words, int64_t code_capacity,
                            uint64_t *words_out, int threads) {
    if (!attend_decode || (key_specs && !encode_rows)) return -1;  /* built without attend.c or encode.c */
    size_t item = half ? 2 : 4;
    int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const float *in = x;
    for (int i = 0; i < n_blocks; i++) {
        const quant_block *b = blocks + i;
        char *kl = (char *)k + (size_t)i * (size_t)layer_stride * item;
        char *vl = (char *)v + (size_t)i * (size_t)layer_stride * item;
        if (quant_decode_head(in, dim, b->attention_norm, b->attention_eps, b->qkv, b->n_qkv, (int)(heads + kv_heads),
                              (int)head_dim, cos, sin, b->h, b->scratch, b->qkv_out, threads))
            return -(i + 1);
        store_rows(b->qkv_out + q_size, kl, kv_heads, head_dim, head_stride, row, half);
        store_rows(b->qkv_out + q_size + kv_size, vl, kv_heads, head_dim, head_stride, row, half);
        if (key_specs) {
            if (encode_rows(key_specs[i], b->qkv_out + q_size, words_out, threads)) return -(i + 1);
            uint64_t *layer_codes = codes + (size_t)i * (size_t)(kv_heads * words * code_capacity);
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t w = 0; w < words; w++)
                    layer_codes[(h * words + w) * code_capacity + row] = words_out[h * words + w];
        }
        if (attend_decode(b->qkv_out, heads, kv_heads, head_dim, kl, vl, head_stride, NULL, 0, row + 1, splits, qs,
                          stats, acc, attn, threads, half, NULL, NULL, 0, 0, 0) ||
            quant_decode_tail(in, dim, attn, q_size, b->wo, b->n_wo, b->ffn_norm, b->ffn_eps, b->gate_up,
                              b->n_gate_up, width, b->down, b->n_down, b->h, b->ff, b->act, b->scratch, b->out,
                              threads))
            return -(i + 1);
        in = b->out;
    }
    return 0;
}

int quant_decode_step(const quant_block *blocks, int n_blocks, const float *x, int64_t dim, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t width, const float *cos, const float *sin, void *k,
                      void *v, int64_t layer_stride, int64_t head_stride, int64_t row, int half, int splits,
                      float *qs, float *stats, float *acc, float *attn, int threads) {
    return quant_decode_step_coded(blocks, n_blocks, x, dim, heads, kv_heads, head_dim, width, cos, sin, k, v,
                                   layer_stride, head_stride, row, half, splits, qs, stats, acc, attn, NULL, NULL, 0,
                                   0, NULL, threads);
}
#endif

/* ============================================================ dequantisation (prefill weights)

   Rows of W written out as fp32, each weight exactly as gguf.quants.dequantize rounds it (the
   formulas at the top of this file, with Q4_0 w = d * (q - 8), Q5_1 w = d * q + m and Q5_K as Q4_K
   with a fifth bit); what a prefill chunk's GEMM multiplies. Plain loops the compiler vectorises;
   -ffp-contract=off keeps every multiply and add rounded on its own. */

static void deq_legacy(int kind, const uint8_t *rb, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++, out += QK) {
        if (kind == KIND_Q8_0) {
            const uint8_t *blk = rb + b * 34;
            float d = half_to_float(blk);
            for (int l = 0; l < QK; l++) out[l] = (float)(int8_t)blk[2 + l] * d;
            continue;
        }
        int has_min = kind == KIND_Q4_1 || kind == KIND_Q5_1, has_high = kind == KIND_Q5_0 || kind == KIND_Q5_1;
        int64_t size = 2 + (has_min ? 2 : 0) + (has_high ? 4 : 0) + QK / 2;
        const uint8_t *blk = rb + b * size;
        float d = half_to_float(blk), m = has_min ? half_to_float(blk + 2) : 0.0f;
        uint32_t qh = 0;
        if (has_high) memcpy(&qh, blk + (has_min ? 4 : 2), 4);  /* little-endian, as this CPU class */
        const uint8_t *qs = blk + size - QK / 2;
        int offset = kind == KIND_Q4_0 ? 8 : (kind == KIND_Q5_0 ? 16 : 0);
        for (int l = 0; l < QK / 2; l++) {
            int lo = (qs[l] & 15) | (int)(((qh >> l) & 1) << 4);
            int hi = (qs[l] >> 4) | (int)(((qh >> (l + QK / 2)) & 1) << 4);
            if (has_min) {
                out[l] = d * (float)lo + m;
                out[l + QK / 2] = d * (float)hi + m;
            } else {
                out[l] = d * (float)(lo - offset);
                out[l + QK / 2] = d * (float)(hi - offset);
            }
        }
    }
}

static void deq_q45_k(const uint8_t *rb, int64_t nb, float *out, int has_high) {
    int64_t size = 4 + 12 + (has_high ? QK_K / 8 : 0) + QK_K / 2;
    for (int64_t b = 0; b < nb; b++, out += QK_K) {
        const uint8_t *blk = rb + b * size, *high = blk + 16, *qs = blk + 16 + (has_high ? QK_K / 8 : 0);
        float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        for (int pair = 0; pair < 4; pair++) {
            int j = 2 * pair, sc0, mn0, sc1, mn1;
            scale_min_k4(blk + 4, j, &sc0, &mn0);
            scale_min_k4(blk + 4, j + 1, &sc1, &mn1);
            float d0 = d * (float)sc0, m0 = dmin * (float)mn0, d1 = d * (float)sc1, m1 = dmin * (float)mn1;
            float *o = out + j * 32;
            for (int l = 0; l < 32; l++) {
                int v = qs[pair * 32 + l], lo = v & 15, hi = v >> 4;
                if (has_high) {
                    lo |= ((high[l] >> j) & 1) << 4;
                    hi |= ((high[l] >> (j + 1)) & 1) << 4;
                }
                o[l] = d0 * (float)lo - m0;
                o[l + 32] = d1 * (float)hi - m1;
            }
        }
    }
}

static void deq_q6_k(const uint8_t *rb, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++, out += QK_K) {
        const uint8_t *blk = rb + b * 210, *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = half_to_float(blk + 208);
        for (int sub = 0; sub < 16; sub++) {
            int half = sub / 8, quarter = (sub / 2) % 4, g = sub % 2;
            float ds = d * (float)sc[sub];
            const uint8_t *lo = ql + half * 64 + (quarter % 2) * 32 + g * 16, *hi = qh + half * 32 + g * 16;
            int lo_shift = (quarter / 2) * 4, hi_shift = quarter * 2;
            for (int l = 0; l < 16; l++) {
                int q = ((lo[l] >> lo_shift) & 15) | (((hi[l] >> hi_shift) & 3) << 4);
                out[sub * 16 + l] = ds * (float)(q - 32);
            }
        }
    }
}

static void deq_rows(int kind, const uint8_t *blocks, int64_t row_bytes, int64_t blocks_per_row, int64_t cols,
                     int64_t row_start, int64_t row_end, float *out) {
    for (int64_t r = row_start; r < row_end; r++) {
        const uint8_t *rb = blocks + r * row_bytes;
        float *o = out + (r - row_start) * cols;
        if (kind <= KIND_Q8_0) deq_legacy(kind, rb, blocks_per_row, o);
        else if (kind == KIND_Q6_K) deq_q6_k(rb, blocks_per_row, o);
        else deq_q45_k(rb, blocks_per_row, o, kind == KIND_Q5_K);
    }
}

/* Rows [row_start, row_end) of `blocks` as fp32 into out ((row_end - row_start) x cols, C order),
   the rows cut over `threads` OpenMP threads (each weight's value does not depend on the split).
   Returns 0, or -1 for a kind this file does not know. */
int quant_dequantize(int kind, const uint8_t *blocks, int64_t row_bytes, int64_t blocks_per_row,
                     int64_t row_start, int64_t row_end, float *out, int threads) {
    if (kind < KIND_Q4_0 || kind > KIND_Q6_K) return -1;
    int64_t cols = blocks_per_row * (kind <= KIND_Q8_0 ? QK : QK_K), rows = row_end - row_start;
#ifdef _OPENMP
    if (threads > 1 && rows > 1) {
        if (threads > rows) threads = (int)rows;
#pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), n = omp_get_num_threads();
            int64_t a = row_start + rows * t / n, e = row_start + rows * (t + 1) / n;
            deq_rows(kind, blocks, row_bytes, blocks_per_row, cols, a, e, out + (a - row_start) * cols);
        }
        return 0;
    }
#endif
    (void)threads;
    deq_rows(kind, blocks, row_bytes, blocks_per_row, cols, row_start, row_end, out);
    return 0;
}
