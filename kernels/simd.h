/* Small AVX2 helpers shared by the compiled kernels (attend.c, encode.c). Include inside an
   `#if defined(__AVX2__) && defined(__FMA__)` block, after <immintrin.h>. */
#ifndef SPOTLIGHT_SIMD_H
#define SPOTLIGHT_SIMD_H

/* 2^x for x in [-126, 126] (clamped below at -126), eight at a time: attend_cpu._exp2_parts's
   least-squares polynomial of 2^f on [0, 1] (relative error < 1.1e-7) times 2^floor(x). */
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

#endif
