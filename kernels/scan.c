/* The folded scan over key codes stored as byte planes (kernels/planes.py), built with quant.c into
   kernels/_quant.so by `make setup`.

   The same selection as kernels/cpu.py `score_select_blocks`: token t of block r (bounds[r] <= t <
   bounds[r + 1]) scores sum_g popcount(~(q[r, g] ^ k_t)) over its KV head's G query codes, and each
   head keeps the top `retrieved` tokens of the middle [bounds[0], bounds[R]) by (score desc, index
   asc), written in ascending order. Only the scoring differs.

   Byte planes: byte j of a token's code (bits 8j..8j+7, word j / 8) is planes[h, j, t], so 32
   consecutive tokens' byte j are one 256-bit load. With Q_b = how many of the G query codes set bit
   b, a token's score is its agreements: sum over its set bits of Q_b and over its clear bits of
   G - Q_b. Per byte, two 16-entry uint8 tables (a nibble's four bits' agreements, at most 4 G) read
   by pshufb; the planes' entries add in uint8 while 8 G K <= 255 (K planes: 8 for G <= 3, 4 for
   G <= 7, 2 up to G = 15), then widen to int16 (scores <= G * 64 W < 32768). Before session 39
   the tables held signed sums of 2 Q_b - G beside a base, and two planes added in int8: 8-18 %
   slower (docs/DECISIONS.md, "The far scan's planes add in uint8").

   Per head, one head per thread: the middle's scores into `scores` (int16); a bound from an even
   sample of them (twice the retrieved share); the tokens at or above it, in index order (a vector
   compare per 16 tokens and a table permutation per eight; every token when the sample misjudged,
   which only costs time); then the candidates' histogram gives the cut (the retrieved-th best
   score), and the picks are every candidate above it and the first ties at it. No branch in the
   collection or the picks depends on a score. Measured (docs/DECISIONS.md, "The far scan reads the
   key codes as byte planes" and "Branch-free candidates"): 24 layers at 131K tokens in 11.1-11.6 ms
   on one Zen 3 thread (AVX2) and 6.6-8.6 on two, where numba's word-major scan took 18.9-19.2 and
   10.5-11.1; with the uint8 sums (session 39, random codes, the two builds in turn, best of 7) 11.2 ms
   against 12.2 on one thread, 6.0 against 6.5 on two. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { MAX_WORDS = 4, MAX_PLANES = 8 * MAX_WORDS, MAX_GROUP = 15, SAMPLE = 4096, SAMPLE_SLACK = 16, TILE = 512,
       CAND_SLACK = 8 };

/* planes[h, 8 w + j, t] = byte j of codes[h, w, t] for tokens [lo, hi). codes (Hkv, W, Ncap) uint64,
   planes (Hkv, 8 W, Pcap) uint8. */
int planes_write(const uint64_t *codes, int64_t hkv, int64_t words, int64_t ncap, int64_t lo, int64_t hi,
                 uint8_t *planes, int64_t pcap) {
    if (words < 1 || words > MAX_WORDS || lo < 0 || hi > ncap || hi > pcap || lo > hi) return -1;
    for (int64_t h = 0; h < hkv; h++)
        for (int64_t w = 0; w < words; w++) {
            const uint64_t *row = codes + (h * words + w) * ncap;
            uint8_t *out = planes + (h * 8 * words + 8 * w) * pcap;
            for (int64_t t = lo; t < hi; t++) {
                uint64_t x = row[t];
                for (int j = 0; j < 8; j++) out[j * pcap + t] = (uint8_t)(x >> (8 * j));
            }
        }
    return 0;
}

/* One head's tables for query codes q (G, W) (row-major, words per code W): tab[p][0 | 1][v], the
   low and high nibble of plane p: how many of the G query codes agree with the nibble's four key bits
   when they read v (a set bit b agrees with Q_b of them, a clear one with G - Q_b), at most 4 G. */
static void make_tables(const uint64_t *q, int64_t group, int64_t words, uint8_t tab[][2][16]) {
    for (int64_t p = 0; p < 8 * words; p++) {
        int32_t set[8];
        for (int i = 0; i < 8; i++) {
            int64_t bit = 8 * p + i;
            set[i] = 0;
            for (int64_t g = 0; g < group; g++) set[i] += (int32_t)((q[g * words + bit / 64] >> (bit % 64)) & 1);
        }
        for (int half = 0; half < 2; half++)
            for (int v = 0; v < 16; v++) {
                int32_t s = 0;
                for (int i = 0; i < 4; i++) s += v >> i & 1 ? set[4 * half + i] : (int32_t)group - set[4 * half + i];
                tab[p][half][v] = (uint8_t)s;
            }
    }
}

#if defined(__AVX2__)
/* How many planes' agreements add in uint8 before widening: a plane adds at most 8 G, so K of them
   while 8 G K <= 255; a power of two that divides the planes (8 W of them). */
static int64_t planes_per_sum(int64_t group, int64_t nplanes) {
    int64_t k = 8;
    while (k > 1 && (8 * group * k > 255 || nplanes % k)) k /= 2;
    return k;
}

/* Tokens [t, end) (a multiple of 32) of planes [p, p + K): their agreements summed in uint8, then
   widened into scores (stored when `first`, else added). K is a constant where it is inlined. */
static inline __attribute__((always_inline)) void score_planes(uint8_t tab[][2][16], const uint8_t *planes,
                                                                int64_t pcap, int64_t p, int64_t t, int64_t end,
                                                                int first, int16_t *scores, const int K) {
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256i lo[8], hi[8];
    for (int i = 0; i < K; i++) {
        lo[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tab[p + i][0]));
        hi[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tab[p + i][1]));
    }
    for (int64_t u = t; u < end; u += 32) {
        __m256i s = _mm256_setzero_si256();
        for (int i = 0; i < K; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(planes + (p + i) * pcap + u));
            s = _mm256_add_epi8(s, _mm256_add_epi8(_mm256_shuffle_epi8(lo[i], _mm256_and_si256(v, nib)),
                                                   _mm256_shuffle_epi8(hi[i], _mm256_and_si256(_mm256_srli_epi16(v, 4), nib))));
        }
        __m256i a = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(s));
        __m256i b = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(s, 1));
        if (!first) {
            a = _mm256_add_epi16(a, _mm256_loadu_si256((const __m256i *)(scores + u)));
            b = _mm256_add_epi16(b, _mm256_loadu_si256((const __m256i *)(scores + u + 16)));
        }
        _mm256_storeu_si256((__m256i *)(scores + u), a);
        _mm256_storeu_si256((__m256i *)(scores + u + 16), b);
    }
}
#endif

/* scores[t] for tokens [lo, hi) of one head: planes (P, Pcap) of that head. Tiles of TILE tokens:
   each group of planes keeps its tables in registers over the tile, whose int16 scores stay in L1. */
static void score_run(uint8_t tab[][2][16], int64_t nplanes, int64_t group, const uint8_t *planes,
                      int64_t pcap, int64_t lo, int64_t hi, int16_t *scores) {
    int64_t t = lo;
#if defined(__AVX2__)
    const int64_t k = planes_per_sum(group, nplanes);
    for (; t + 32 <= hi; t += TILE) {
        int64_t end = t + TILE <= hi ? t + TILE : t + (hi - t) / 32 * 32;
        for (int64_t p = 0; p < nplanes; p += k) {
            if (k == 8) score_planes(tab, planes, pcap, p, t, end, p == 0, scores, 8);
            else if (k == 4) score_planes(tab, planes, pcap, p, t, end, p == 0, scores, 4);
            else if (k == 2) score_planes(tab, planes, pcap, p, t, end, p == 0, scores, 2);
            else score_planes(tab, planes, pcap, p, t, end, p == 0, scores, 1);
        }
        if (end < t + TILE) {  /* the run's last whole 32 tokens are scored: the rest below */
            t = end;
            break;
        }
    }
#endif
    for (; t < hi; t++) {  /* the run's last tokens (all of them without AVX2) */
        int32_t s = 0;
        for (int64_t p = 0; p < nplanes; p++) {
            uint8_t v = planes[p * pcap + t];
            s += tab[p][0][v & 15] + tab[p][1][v >> 4];
        }
        scores[t] = (int16_t)s;
    }
}

/* LEFT_PACK[m]: the positions of m's set bits (m < 256) in ascending order, then zeros: the
   permutation that moves the tokens of eight whose bits are set to the front (collect). */
static int32_t LEFT_PACK[256][8];

__attribute__((constructor)) static void make_left_pack(void) {
    for (int m = 0; m < 256; m++) {
        int c = 0;
        for (int b = 0; b < 8; b++)
            if (m >> b & 1) LEFT_PACK[m][c++] = b;
        while (c < 8) LEFT_PACK[m][c++] = 0;
    }
}

/* Tokens of [lo, hi) scoring >= bound, in index order, into cand (room for hi - lo + 8: each eight
   tokens store eight indices, of which the set ones are kept); returns how many. No branch depends on
   the scores: a compare and movemask per 16 tokens, then per eight a permutation of their indices. */
static int64_t collect(const int16_t *scores, int64_t lo, int64_t hi, int32_t bound, int32_t *cand) {
    int64_t c = 0, t = lo;
#if defined(__AVX2__)
    const __m256i below = _mm256_set1_epi16((int16_t)(bound - 1)), eight = _mm256_set1_epi32(8);
    __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int32_t)lo), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (; t + 16 <= hi; t += 16) {
        __m256i a = _mm256_cmpgt_epi16(_mm256_loadu_si256((const __m256i *)(scores + t)), below);
        /* one bit per token: the int16 lanes' byte pairs, packed to bytes (lanes stay in order) */
        __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        uint32_t mask = (uint32_t)_mm_movemask_epi8(bytes);
        for (int part = 0; part < 2; part++, mask >>= 8) {
            __m256i order = _mm256_loadu_si256((const __m256i *)LEFT_PACK[mask & 0xff]);
            _mm256_storeu_si256((__m256i *)(cand + c), _mm256_permutevar8x32_epi32(index, order));
            c += __builtin_popcount(mask & 0xff);
            index = _mm256_add_epi32(index, eight);
        }
    }
#endif
    for (; t < hi; t++) {
        cand[c] = (int32_t)t;
        c += scores[t] >= bound;
    }
    return c;
}

/* The selection of one head: scores of the middle, a bound from a sample of them, the candidates at
   or above it (every token when the sample misjudged), their histogram's cut, and the picks. */
static void select_head(const uint64_t *q, int64_t blocks, int64_t heads, int64_t words, const int64_t *bounds,
                        const uint8_t *planes, int64_t pcap, int64_t h, int64_t group, int64_t retrieved,
                        int32_t *out, int16_t *scores, int32_t *cand, int64_t *hist) {
    int64_t nplanes = 8 * words, bins = group * 64 * words + 1, lo = bounds[0], hi = bounds[blocks];
    uint8_t tab[MAX_PLANES][2][16];
    for (int64_t r = 0; r < blocks; r++) {
        if (bounds[r] >= bounds[r + 1]) continue;
        make_tables(q + (r * heads + h * group) * words, group, words, tab);
        score_run(tab, nplanes, group, planes, pcap, bounds[r], bounds[r + 1], scores);
    }
    /* the bound: the score that twice the retrieved share of an even sample reaches (+ SAMPLE_SLACK) */
    int64_t middle = hi - lo, stride = middle / SAMPLE > 1 ? middle / SAMPLE : 1, sampled = 0;
    memset(hist, 0, sizeof(int64_t) * bins);
    for (int64_t t = lo; t < hi; t += stride, sampled++) hist[scores[t]]++;
    int64_t want = 2 * retrieved * sampled / middle + SAMPLE_SLACK, seen = 0;
    int32_t bound = (int32_t)bins - 1;
    for (; bound > 0 && seen + hist[bound] < want; bound--) seen += hist[bound];
    int64_t count = collect(scores, lo, hi, bound, cand);
    if (count < retrieved) count = collect(scores, lo, hi, 0, cand);  /* the sample misjudged: every token */
    memset(hist, 0, sizeof(int64_t) * bins);
    for (int64_t i = 0; i < count; i++) hist[scores[cand[i]]]++;
    int64_t above = 0, cut = bins - 1;
    for (; cut > 0 && above + hist[cut] < retrieved; cut--) above += hist[cut];
    int64_t ties = retrieved - above, j = 0;  /* candidates scoring `cut` to take, lowest index first */
    for (int64_t i = 0; i < count && j < retrieved; i++) {  /* no branch on the scores */
        int32_t s = scores[cand[i]], tie = s == cut, take = (s > cut) | (tie & (ties > 0));
        out[j] = cand[i];
        j += take;
        ties -= tie & take;
    }
}

/* q (R, H, W) uint64, bounds (R + 1,) ascending; planes (Hkv, 8 W, Pcap); out row h at out + h *
   out_stride gets the `retrieved` picks in ascending order; scores (Hkv, Pcap) int16, cand (Hkv, Pcap + 8)
   int32 and hist (Hkv, 64 W G + 1) int64 are scratch. Returns 0, or -1 for a geometry it does not take. */
int planes_select(const uint64_t *q, int64_t blocks, int64_t heads, int64_t words, const int64_t *bounds,
                  const uint8_t *planes, int64_t hkv, int64_t pcap, int64_t retrieved, int32_t *out,
                  int64_t out_stride, int16_t *scores, int32_t *cand, int64_t *hist, int threads) {
    int64_t group = heads / hkv;
    if (words < 1 || words > MAX_WORDS || group < 1 || group > MAX_GROUP || heads % hkv || blocks < 1 ||
        bounds[0] < 0 || bounds[blocks] > pcap || retrieved < 1 || retrieved > bounds[blocks] - bounds[0])
        return -1;
    int64_t bins = group * 64 * words + 1;
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) schedule(static)
    for (int64_t h = 0; h < hkv; h++)
        select_head(q, blocks, heads, words, bounds, planes + h * 8 * words * pcap, pcap, h, group, retrieved,
                    out + h * out_stride, scores + h * pcap, cand + h * (pcap + CAND_SLACK), hist + h * bins);
    return 0;
}

int planes_available(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
