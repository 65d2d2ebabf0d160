/* Linear layers for a few rows (a decode step's one token per running request, a short prefill chunk beside them):
 * y = x W^T (+ bias) for 1 to MAX_M rows of x, reading each weight from memory once, for float32 and bfloat16
 * weights.
 *
 * Weights are packed ahead of time (engine/paged/linear.py) so that one 64-byte line holds 16 outputs' weights at
 * one k: float32 [N/16][K][16], bfloat16 [N/16][K/2][16][2] (pairs of k). A work item is one block of 16 outputs: it
 * streams its block's K lines once, each line multiplied into every row's 16 accumulators (an fma per row, or a
 * vdpbf16ps per row: each bf16 product exact in float32, sums in float32), so the weights are read once whatever
 * the row count, and the rows' accumulators stay in registers. Each stream is prefetched PREFETCH lines ahead: the
 * hardware prefetcher alone left a decode step's linears at about 36 GB/s here, oneDNN's too.
 * Sums run over k in order, one float32 accumulator per output (per pair of k for bf16), bias added last, then one
 * rounding to the output dtype (nearest even): oneDNN's own order for these shapes, so the results are mostly its
 * bits (tests/test_paged_linear.py counts the rest).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) /* 16-lane vectors; bfloat16 too where AVX512-BF16 is there */
#include <immintrin.h>

#define MAX_ROWS 16 /* rows whose accumulators one pass over a block keeps in registers */
#define MAX_M 256   /* rows per call, in groups of MAX_ROWS */
#define PREFETCH 128 /* lines (8 KiB) ahead in each weight stream */

static inline __attribute__((always_inline)) void block_f32(const float *x, int64_t ldx, const int M, const float *wp,
                                                            int K, const float *bias, int nb, float *y, int64_t ldy) {
    __m512 acc[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const float *w = wp + (int64_t)nb * K * 16;
    for (int k = 0; k < K; k++) {
        __builtin_prefetch(w + (int64_t)(k + PREFETCH) * 16, 0, 0);
        const __m512 wv = _mm512_loadu_ps(w + (int64_t)k * 16);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), wv, acc[m]);
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * ldy + nb * 16, _mm512_add_ps(acc[m], b));
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
        __builtin_prefetch(w + (int64_t)(kk + PREFETCH) * 16, 0, 0);
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
#else
#define BF16_BUILT 0
static inline void block_bf16(const uint16_t *x, int64_t ldx, const int M, const uint32_t *wp, int K,
                              const float *bias, int nb, uint16_t *y, int64_t ldy) {}
#endif

#define ROWS_CASES(CALL)                                                                                              \
    switch (mm) {                                                                                                     \
    case 1: CALL(1) case 2: CALL(2) case 3: CALL(3) case 4: CALL(4) case 5: CALL(5) case 6: CALL(6) case 7: CALL(7) \
    case 8: CALL(8) case 9: CALL(9) case 10: CALL(10) case 11: CALL(11) case 12: CALL(12) case 13: CALL(13)         \
    case 14: CALL(14) case 15: CALL(15) default: CALL(16)                                                             \
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

#define AVX2_LINEAR 0

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2: the same packing, each 64-byte line two 8-lane halves, so a row takes two accumulators and fewer rows fit in
 * the 16 registers. Each output's sum is the same fmas in the same order as the AVX-512 build's: the same bits. */
#define MAX_ROWS 6
#define MAX_M 256
#define PREFETCH 128

static inline __attribute__((always_inline)) void block_f32(const float *x, int64_t ldx, const int M, const float *wp,
                                                            int K, const float *bias, int nb, float *y, int64_t ldy) {
    __m256 lo[MAX_ROWS], hi[MAX_ROWS];
    for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    const float *w = wp + (int64_t)nb * K * 16;
    for (int k = 0; k < K; k++) {
        __builtin_prefetch(w + (int64_t)(k + PREFETCH) * 16, 0, 0);
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

#define ROWS_CASES(CALL)                                                                                              \
    switch (mm) {                                                                                                     \
    case 1: CALL(1) case 2: CALL(2) case 3: CALL(3) case 4: CALL(4) case 5: CALL(5) default: CALL(6)               \
    }

int small_linear_bf16(const uint16_t *x, int64_t ldx, int M, const uint32_t *wp, int N, int K, const float *bias,
                      uint16_t *y, int64_t ldy, int threads) {
    return -1; /* no AVX512-BF16: bf16 keeps the model's own linears */
}
#define BF16_BUILT 0
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

/* 1: float32 built; | 2: bfloat16 too (AVX512-BF16); | 4: the AVX2 build (linear.AVX2_BUILD). */
int small_linear_available(void) { return 1 | (BF16_BUILT ? 2 : 0) | (AVX2_LINEAR ? 4 : 0); }

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
