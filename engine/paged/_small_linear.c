/* Linear layers for a few rows (a decode step's one token per running request, a short prefill chunk beside them):
 * y = x W^T (+ bias) for 1 to MAX_M rows of x, reading each weight from memory once, for float32 and bfloat16
 * weights.
 *
 * Weights are packed ahead of time (engine/paged/linear.py) so that one 64-byte line holds 16 outputs' weights at
 * one k: float32 [N/16][K][16], bfloat16 [N/16][K/2][16][2] (pairs of k). A work item is one block of 16 outputs: it
 * streams its block's K lines once, each line multiplied into every row's 16 accumulators (an fma per row, or a
 * vdpbf16ps per row: each bf16 product exact in float32, sums in float32; without AVX512-BF16 the pairs widened to
 * float32 and two fmas, in vdpbf16ps's order, block_bf16 below), so the weights are read once whatever
 * the row count, and the rows' accumulators stay in registers. Each stream is prefetched PREFETCH lines ahead: the
 * hardware prefetcher alone left a decode step's linears at about 36 GB/s here, oneDNN's too.
 * Sums run over k in order, one float32 accumulator per output (per pair of k for bf16), bias added last, then one
 * rounding to the output dtype (nearest even): oneDNN's own order for these shapes, so the results are mostly its
 * bits (tests/test_paged_linear.py counts the rest).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef W_HINT
/* The weight streams' prefetch locality: 2 (prefetcht1, into L2), as the attention kernel's KV_HINT (every build;
 * the AVX2 one's CPUs were not timed with it). On an AMD Zen 4, the small preset's 85 linears in turn, weights
 * streamed (interleaved, 3 processes): fp32 15.7-16.1 ms over 8 rows with 0 (prefetchnta, the first choice) against
 * 14.4-14.8 with 2 (7-8%), 33.0 against 31.2-31.4 over 24 rows; bf16 1-2%; 3 (into L1) as 0. 64 or 256 lines ahead
 * instead of 128 moved nothing. The same bits either way. */
#define W_HINT 2
#endif

#if defined(__AVX512F__) /* 16-lane vectors; bfloat16 too where AVX512-BF16 is there */
#include <immintrin.h>

#define MAX_ROWS 16 /* rows whose accumulators one pass over a block keeps in registers */
#define MAX_M 256   /* rows per call, in groups of MAX_ROWS */
#ifndef PREFETCH
#define PREFETCH 128 /* lines (8 KiB) ahead in each weight stream */
#endif

static inline __attribute__((always_inline)) void block_f32(const float *x, int64_t ldx, const int M, const float *wp,
                                                            int K, const float *bias, int nb, float *y, int64_t ldy) {
    __m512 acc[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const float *w = wp + (int64_t)nb * K * 16;
    for (int k = 0; k < K; k++) {
        __builtin_prefetch(w + (int64_t)(k + PREFETCH) * 16, 0, W_HINT);
        const __m512 wv = _mm512_loadu_ps(w + (int64_t)k * 16);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), wv, acc[m]);
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy + nb * 16, _mm512_add_ps(acc[m], b));
}

#define ROWS_CASES(CALL)                                                                                              \
    switch (mm) {                                                                                                     \
    case 1: CALL(1) case 2: CALL(2) case 3: CALL(3) case 4: CALL(4) case 5: CALL(5) case 6: CALL(6) case 7: CALL(7) \
    case 8: CALL(8) case 9: CALL(9) case 10: CALL(10) case 11: CALL(11) case 12: CALL(12) case 13: CALL(13)         \
    case 14: CALL(14) case 15: CALL(15) default: CALL(16)                                                             \
    }

#if defined(__AVX512BF16__)
#define BF16_BUILT 1
static inline __attribute__((always_inline)) void block_bf16(const uint16_t *x, int64_t ldx, const int M,
                                                             const uint32_t *wp, int K, const float *bias, int nb,
                                                             uint16_t *y, int64_t ldy) {
    __m512 acc[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const uint32_t *w = wp + (int64_t)nb * (K / 2) * 16;
    for (int kk = 0; kk < K / 2; kk++) {
        __builtin_prefetch(w + (int64_t)(kk + PREFETCH) * 16, 0, W_HINT);
        const __m512i wv = _mm512_loadu_si512((const void *)(w + (int64_t)kk * 16));
        for (int m = 0; m < M; m++) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * kk, 4);
            const __m512i xb = _mm512_set1_epi32(pair);
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)xb, (__m512bh)wv);
        }
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m], b));
        _mm256_storeu_si256((__m256i *)(y + m * ldy + nb * 16), (__m256i)h);
    }
}
#define BF16_CALL(MM) block_bf16(x + (int64_t)g * ldx, ldx, MM, wp, K, bias, nb, y + (int64_t)g * ldy, ldy); break;

/* small_linear_f32 (below) for bfloat16 x, packed W and y; K even. */
int small_linear_bf16(const uint16_t *x, int64_t ldx, int M, const uint32_t *wp, int N, int K, const float *bias,
                      uint16_t *y, int64_t ldy, int threads) {
    if (!BF16_BUILT || N % 16 || K % 2 || K < 2 || M < 1 || M > MAX_M) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int nb = 0; nb < N / 16; nb++)
        for (int g = 0; g < M; g += MAX_ROWS) {
            const int mm = M - g < MAX_ROWS ? M - g : MAX_ROWS;
            ROWS_CASES(BF16_CALL)
        }
    return 0;
}
#define WIDE_BF16 0

#else /* AVX-512 without AVX512-BF16 (Intel Skylake to Ice Lake servers): pairs widened, as the AVX2 build's */
#define BF16_BUILT 1
#define WIDE_BF16 1
#define BF16_ROWS MAX_ROWS
#define BF16_ROWS_CASES ROWS_CASES

/* Sixteen floats rounded to bf16, nearest even, as vcvtneps2bf16 rounds them (NaN included: every NaN here has its
 * low 16 bits zero, from bf16 inputs or the default NaN, so it stays that NaN), in order. */
static inline __attribute__((always_inline)) __m256i pack_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16));
}

/* The AVX2 build's block_bf16 (below) with 16-lane vectors: vdpbf16ps's sums, in its order. */
static inline __attribute__((always_inline)) void block_bf16(const float *xf, int64_t ldx, const int M,
                                                             const uint32_t *wp, int K, const float *bias, int nb,
                                                             uint16_t *y, int64_t ldy) {
    __m512 acc[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const uint32_t *w = wp + (int64_t)nb * (K / 2) * 16;
    const __m512i upper = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int kk = 0; kk < K / 2; kk++) {
        __builtin_prefetch(w + (int64_t)(kk + PREFETCH) * 16, 0, W_HINT);
        const __m512i wv = _mm512_loadu_si512((const void *)(w + (int64_t)kk * 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(wv, upper));
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xf[m * ldx + 2 * kk + 1]), odd, acc[m]);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xf[m * ldx + 2 * kk]), even, acc[m]);
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++)
        _mm256_storeu_si256((__m256i *)(y + m * ldy + nb * 16), pack_bf16(_mm512_add_ps(acc[m], b)));
}
#endif

#define AVX2_LINEAR 0

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2: the same packing, each 64-byte line two 8-lane halves, so a row takes two accumulators and fewer rows fit in
 * the 16 registers. Each output's sum is the same fmas in the same order as the AVX-512 build's: the same bits. */
#define MAX_ROWS 6
#define MAX_M (1 << 20) /* any step: where oneDNN has no bf16 (linear.onednn_refuses), this takes every row count */
#define PREFETCH 128
/* bf16 rows per pass: 8 accumulators, the four widened halves of a pair line and two broadcasts fit the 16
 * registers (at 5 or 6 rows the compiler put an accumulator on the stack, and its store-to-load chain halved the
 * fmas' rate: 40-64 GFLOP/s on one Zen 4 core against 99 at 4 rows, fp32's 104) */
#define BF16_ROWS 4
#define BF16_ROWS_CASES(CALL)                                                                                         \
    switch (mm) {                                                                                                     \
    case 1: CALL(1) case 2: CALL(2) case 3: CALL(3) default: CALL(4)                                                \
    }

static inline __attribute__((always_inline)) void block_f32(const float *x, int64_t ldx, const int M, const float *wp,
                                                            int K, const float *bias, int nb, float *y, int64_t ldy) {
    __m256 lo[MAX_ROWS], hi[MAX_ROWS];
    for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    const float *w = wp + (int64_t)nb * K * 16;
    for (int k = 0; k < K; k++) {
        __builtin_prefetch(w + (int64_t)(k + PREFETCH) * 16, 0, W_HINT);
        const __m256 wl = _mm256_loadu_ps(w + (int64_t)k * 16), wh = _mm256_loadu_ps(w + (int64_t)k * 16 + 8);
        for (int m = 0; m < M; m++) {
            const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
            lo[m] = _mm256_fmadd_ps(xb, wl, lo[m]);
            hi[m] = _mm256_fmadd_ps(xb, wh, hi[m]);
        }
    }
    const __m256 bl = bias ? _mm256_loadu_ps(bias + nb * 16) : _mm256_setzero_ps();
    const __m256 bh = bias ? _mm256_loadu_ps(bias + nb * 16 + 8) : _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        _mm256_storeu_ps(y + m * ldy + nb * 16, _mm256_add_ps(lo[m], bl));
        _mm256_storeu_ps(y + m * ldy + nb * 16 + 8, _mm256_add_ps(hi[m], bh));
    }
}

/* Sixteen floats rounded to bf16, as the AVX-512 build's pack_bf16 (above), in order. */
static inline __attribute__((always_inline)) __m256i pack_bf16(__m256 a, __m256 b) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF);
    const __m256i ua = _mm256_castps_si256(a), ub = _mm256_castps_si256(b);
    const __m256i ra = _mm256_add_epi32(_mm256_add_epi32(ua, half), _mm256_and_si256(_mm256_srli_epi32(ua, 16), one));
    const __m256i rb = _mm256_add_epi32(_mm256_add_epi32(ub, half), _mm256_and_si256(_mm256_srli_epi32(ub, 16), one));
    /* packus interleaves the two 128-bit halves: [a0-3 b0-3 a4-7 b4-7]; put a's eight before b's */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_srli_epi32(ra, 16), _mm256_srli_epi32(rb, 16)), 0xD8);
}

/* bf16 without AVX512-BF16: each pair of k widened to float32 (a bf16 is a float's upper 16 bits), the odd k's
 * product added first, then the even one's, each by an fma: as vdpbf16ps adds them (each bf16 product is exact in
 * float32, so an fma rounds as its add does), so the AVX-512 build's bits but for subnormals, which vdpbf16ps reads
 * and writes as zero. x arrives widened (xf: float32 rows of stride K, small_linear_bf16 below). */
static inline __attribute__((always_inline)) void block_bf16(const float *xf, int64_t ldx, const int M,
                                                             const uint32_t *wp, int K, const float *bias, int nb,
                                                             uint16_t *y, int64_t ldy) {
    __m256 lo[BF16_ROWS], hi[BF16_ROWS];
    for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    const uint32_t *w = wp + (int64_t)nb * (K / 2) * 16;
    const __m256i upper = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int kk = 0; kk < K / 2; kk++) {
        __builtin_prefetch(w + (int64_t)(kk + PREFETCH) * 16, 0, W_HINT);
        const __m256i wl = _mm256_loadu_si256((const __m256i *)(w + (int64_t)kk * 16));
        const __m256i wh = _mm256_loadu_si256((const __m256i *)(w + (int64_t)kk * 16 + 8));
        const __m256 ol = _mm256_castsi256_ps(_mm256_and_si256(wl, upper));
        const __m256 oh = _mm256_castsi256_ps(_mm256_and_si256(wh, upper));
        const __m256 el = _mm256_castsi256_ps(_mm256_slli_epi32(wl, 16));
        const __m256 eh = _mm256_castsi256_ps(_mm256_slli_epi32(wh, 16));
        for (int m = 0; m < M; m++) {
            const __m256 xo = _mm256_broadcast_ss(xf + m * ldx + 2 * kk + 1);
            const __m256 xe = _mm256_broadcast_ss(xf + m * ldx + 2 * kk);
            lo[m] = _mm256_fmadd_ps(xe, el, _mm256_fmadd_ps(xo, ol, lo[m]));
            hi[m] = _mm256_fmadd_ps(xe, eh, _mm256_fmadd_ps(xo, oh, hi[m]));
        }
    }
    const __m256 bl = bias ? _mm256_loadu_ps(bias + nb * 16) : _mm256_setzero_ps();
    const __m256 bh = bias ? _mm256_loadu_ps(bias + nb * 16 + 8) : _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        const __m256i h = pack_bf16(_mm256_add_ps(lo[m], bl), _mm256_add_ps(hi[m], bh));
        _mm256_storeu_si256((__m256i *)(y + m * ldy + nb * 16), h);
    }
}

#define ROWS_CASES(CALL)                                                                                              \
    switch (mm) {                                                                                                     \
    case 1: CALL(1) case 2: CALL(2) case 3: CALL(3) case 4: CALL(4) case 5: CALL(5) default: CALL(6)               \
    }

#define BF16_BUILT 1
#define WIDE_BF16 1
#define AVX2_LINEAR 1
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* One work item: output block nb for every group of up to MAX_ROWS rows, in turn. The first group streams the
 * block's weights from memory; the others find them in cache (a block is K/2 (bf16) or K lines of 64 bytes: 24 KiB
 * to 96 KiB at K = 768 to 3,072), so the weights are still read from memory once. */
#define F32_CALL(MM) block_f32(x + (int64_t)g * ldx, ldx, MM, wp, K, bias, nb, y + (int64_t)g * ldy, ldy); break;

/* y[m][n] (row stride ldy) = sum over k of x[m][k] (row stride ldx) * W[n][k], plus bias[n] (float32; NULL: none),
 * for M rows, 1 <= M <= MAX_M, N a multiple of 16. Returns 0, or -1 for shapes it does not take. */
int small_linear_f32(const float *x, int64_t ldx, int M, const float *wp, int N, int K, const float *bias, float *y,
                     int64_t ldy, int threads) {
    if (N % 16 || K < 1 || M < 1 || M > MAX_M) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int nb = 0; nb < N / 16; nb++)
        for (int g = 0; g < M; g += MAX_ROWS) {
            const int mm = M - g < MAX_ROWS ? M - g : MAX_ROWS;
            ROWS_CASES(F32_CALL)
        }
    return 0;
}

#if WIDE_BF16
#define BF16_CALL(MM) block_bf16(xf + (int64_t)g * K, K, MM, wp, K, bias, nb, y + (int64_t)g * ldy, ldy); break;

/* small_linear_f32 (below) for bfloat16 x, packed W and y, K even, where bf16 pairs are widened (AVX2, or AVX-512
 * without AVX512-BF16). x is widened to float32 once (into M x K floats of scratch, kept for the calling thread's
 * next call; -1 if they cannot be had), then each block's pass reads it from cache. */
int small_linear_bf16(const uint16_t *x, int64_t ldx, int M, const uint32_t *wp, int N, int K, const float *bias,
                      uint16_t *y, int64_t ldy, int threads) {
    if (N % 16 || K % 2 || K < 2 || M < 1 || M > MAX_M) return -1;
    /* this thread's scratch, kept between calls: a fresh malloc of this size is a fresh mmap, faulted in anew */
    static __thread float *scratch = NULL;
    static __thread size_t have = 0;
    const size_t need = (size_t)M * K;
    if (need > have) {
        free(scratch);
        scratch = (float *)malloc(need * sizeof(float));
        have = scratch ? need : 0;
        if (!scratch) return -1;
    }
    float *const xf = scratch; /* shared with the team (its threads have scratches of their own) */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) {
                const uint32_t bits = (uint32_t)x[(int64_t)m * ldx + k] << 16;
                memcpy(xf + (int64_t)m * K + k, &bits, 4);
            }
#pragma omp for schedule(static)
        for (int nb = 0; nb < N / 16; nb++)
            for (int g = 0; g < M; g += BF16_ROWS) {
                const int mm = M - g < BF16_ROWS ? M - g : BF16_ROWS;
                BF16_ROWS_CASES(BF16_CALL)
            }
    }
    return 0;
}
#endif

/* 1: float32 built; | 2: bfloat16 too; | 4: the AVX2 build (linear.AVX2_BUILD); | 8: its bfloat16 widens the pairs
 * (no AVX512-BF16: linear.WIDE_BF16). */
int small_linear_available(void) { return 1 | (BF16_BUILT ? 2 : 0) | (AVX2_LINEAR ? 4 : 0) | (WIDE_BF16 ? 8 : 0); }

#else /* neither AVX-512 nor AVX2 with FMA: the caller keeps oneDNN */
int small_linear_f32(const float *x, int64_t ldx, int M, const float *wp, int N, int K, const float *bias, float *y,
                     int64_t ldy, int threads) {
    return -1;
}
int small_linear_bf16(const uint16_t *x, int64_t ldx, int M, const uint16_t *wp, int N, int K, const float *bias,
                      uint16_t *y, int64_t ldy, int threads) {
    return -1;
}
int small_linear_available(void) { return 0; }
#endif
