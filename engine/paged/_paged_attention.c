/* Paged attention on the CPU for float32 and bfloat16 KV pools: every query reads its row's keys and values where
 * they lie in the pool, through the row's block table (no gather into a per-row buffer).
 *
 * Pool layout, per layer and side: [Hkv][num_blocks][block_size * D] elements (engine/kv_pool.py), float32 or
 * bfloat16 (`bf`), so one head's block is block_size * D contiguous elements.
 * Queries: float32, token-major, q[t][h][d] at q + t * q_st + h * q_sh + d (d contiguous). Output: float32
 * out[t][h][d], contiguous [T][Hq][D].
 * Row r: queries q_start[r] .. q_start[r] + q_len[r] - 1; key positions 0 .. kv_len[r] - 1, block i of them in
 * pool block tables[r * table_stride + i]. Query i of the row has position kv_len[r] - q_len[r] + i and attends
 * the keys j <= its position, and j > position - window when window > 0 (transformers' sliding window).
 * Scores are q.k * scale, then softcap * tanh(score / softcap) when softcap > 0 (Gemma 2), then a softmax.
 * Query head h reads kv head h / (Hq / Hkv) (grouped-query attention).
 *
 * Work items are (row, kv head) pairs, split across OpenMP threads: the library links libgomp.so.1, which resolves
 * to the copy torch has loaded already, so the kernel runs on torch's own thread pool.
 *
 * Numerics: an online softmax over splits of `split` key positions (0 .. split - 1, split .. 2 split - 1, ...; one
 * split when kv_len < split), in float32, as torch's CPU flash attention does: a split's scores, their max, the
 * running max and sum rescaled, the split's exps (a polynomial accurate to about 2 ulp) summed and applied to the
 * values. With bfloat16 K/V each exp is rounded to bfloat16 (nearest even) before it weights its value, as torch's
 * flash attention rounds its probabilities for its bf16 matmul; the sum takes them unrounded, as torch's does. So
 * a bf16 row differs from torch's SDPA by the order of fp32 sums and the exp's last bits, not by its arithmetic
 * (tests/test_paged_attention.py measures how often an output moves by one bf16 ulp).
 * Where the compiler targets AVX-512 (-march=native on such a CPU) and the head dim is a multiple of 16, run_item16
 * does the same with 16-lane vectors: one reduction per key's score, a split's exps 16 at a time (2.6x the scalar
 * loop's speed on 8 rows of 1,500 tokens, 12 heads of 64; the scalar one was bound by arithmetic).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_BLOCK 1024
#define MAX_DIM 1024
#define MAX_SPLIT 1024

typedef struct {
    const float *q;
    int64_t q_st, q_sh;
    const void *kpool, *vpool;
    int64_t pool_blocks;
    int bs, dim, hkv, hq;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *q_start, *q_len, *kv_len;
    int rows;
    float scale, softcap;
    int window, split;
    float *out;
} job_t;

/* exp(x) for x <= 0 (scores minus their running max), vectorisable: 2^n * p(r), |r| <= ln2 / 2. */
static inline float fast_exp(float x) {
    if (x < -87.0f) x = -87.0f;
    const float log2e = 1.44269504088896341f;
    float n = __builtin_roundf(x * log2e);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

/* Element i of a pool side: float32, or bfloat16 (its 16 bits are a float's upper half). */
static inline float elem(const void *base, int64_t i, const int bf) {
    if (!bf) return ((const float *)base)[i];
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((const uint16_t *)base)[i] << 16;
    return c.f;
}

/* x rounded to the nearest bfloat16 (ties to even), as a float; x finite. */
static inline float round_bf16(float x) {
    union { float f; uint32_t u; } c;
    c.f = x;
    c.u = (c.u + 0x7FFFu + ((c.u >> 16) & 1u)) & 0xFFFF0000u;
    return c.f;
}

static inline float dot(const float *a, const void *b, int64_t at, int n, const int bf) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
    for (; d + 8 <= n; d += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[d + k] * elem(b, at + d + k, bf);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++) s += a[d] * elem(b, at + d, bf);
    return s;
}

/* The pool offset (in elements) of key position p of row table `table`, kv head base `head_base`. */
static inline int64_t key_at(const job_t *j, const int32_t *table, int64_t head_base, int p) {
    return head_base + ((int64_t)table[p / j->bs] * j->bs + p % j->bs) * j->dim;
}

/* The split size of a row of kv keys: torch's flash attention takes one split for fewer keys than a split. */
static inline int split_size(const job_t *j, int kv) { return kv < j->split ? kv : j->split; }

/* One (row, kv head): every query of the row, every query head of the group. */
static inline __attribute__((always_inline)) void run_item(const job_t *j, int r, int g, const int bf) {
    const int D = j->dim, G = j->hq / j->hkv;
    const int ql = j->q_len[r], kv = j->kv_len[r], qs = j->q_start[r], S = split_size(j, kv);
    const int32_t *table = j->tables + (int64_t)r * j->table_stride;
    const int64_t head_base = (int64_t)g * j->pool_blocks * j->bs * D;
    float s[MAX_SPLIT], acc[MAX_DIM];
    for (int i = 0; i < ql; i++) {
        const int pos = kv - ql + i;
        const int lo = (j->window > 0 && pos - j->window + 1 > 0) ? pos - j->window + 1 : 0;
        for (int hh = 0; hh < G; hh++) {
            const int h = g * G + hh;
            const float *qv = j->q + (int64_t)(qs + i) * j->q_st + (int64_t)h * j->q_sh;
            float m = -INFINITY, l = 0.0f;
            for (int d = 0; d < D; d++) acc[d] = 0.0f;
            for (int c0 = (lo / S) * S; c0 <= pos; c0 += S) {
                const int a = lo > c0 ? lo : c0, c1 = c0 + S - 1 < pos ? c0 + S - 1 : pos;
                float bm = -INFINITY;
                for (int p = a; p <= c1; p++) {
                    float sc = dot(qv, j->kpool, key_at(j, table, head_base, p), D, bf) * j->scale;
                    if (j->softcap > 0.0f) sc = j->softcap * tanhf(sc / j->softcap);
                    s[p - a] = sc;
                    if (sc > bm) bm = sc;
                }
                if (bm > m) {
                    const float c = fast_exp(m - bm);
                    l *= c;
                    for (int d = 0; d < D; d++) acc[d] *= c;
                    m = bm;
                }
                for (int p = a; p <= c1; p++) {
                    const float e = fast_exp(s[p - a] - m);
                    l += e;
                    const float w = bf ? round_bf16(e) : e;
                    const int64_t at = key_at(j, table, head_base, p);
                    for (int d = 0; d < D; d++) acc[d] += w * elem(j->vpool, at + d, bf);
                }
            }
            float *o = j->out + ((int64_t)(qs + i) * j->hq + h) * D;
            const float inv = 1.0f / l;
            for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* fast_exp over 16 lanes: the same polynomial, n rounded to nearest even, 2^n applied by scalef. */
static inline __m512 fast_exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 elements of a pool side from element `at`, as floats. */
static inline __m512 load16(const void *base, int64_t at, const int bf) {
    if (!bf) return _mm512_loadu_ps((const float *)base + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* round_bf16 over 16 lanes. */
static inline __m512 round_bf16_16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* run_item with 16-lane vectors, for head dims that are a multiple of 16 (nd = dim / 16 vectors per key): each key's
 * score is one vector dot reduced once, a split's scores are exponentiated 16 at a time, and the weighted values
 * are summed into nd vector accumulators. The same online softmax as run_item, summed in another order. */
static inline __attribute__((always_inline)) void run_item16(const job_t *j, int r, int g, const int nd,
                                                             const int bf) {
    const int D = j->dim, G = j->hq / j->hkv;
    const int ql = j->q_len[r], kv = j->kv_len[r], qs = j->q_start[r], S = split_size(j, kv);
    const int32_t *table = j->tables + (int64_t)r * j->table_stride;
    const int64_t head_base = (int64_t)g * j->pool_blocks * j->bs * D;
    float s[MAX_SPLIT + 16];
    __m512 qv[MAX_DIM / 16], acc[MAX_DIM / 16];
    for (int i = 0; i < ql; i++) {
        const int pos = kv - ql + i;
        const int lo = (j->window > 0 && pos - j->window + 1 > 0) ? pos - j->window + 1 : 0;
        for (int hh = 0; hh < G; hh++) {
            const int h = g * G + hh;
            const float *qp = j->q + (int64_t)(qs + i) * j->q_st + (int64_t)h * j->q_sh;
            for (int c = 0; c < nd; c++) {
                qv[c] = _mm512_loadu_ps(qp + 16 * c);
                acc[c] = _mm512_setzero_ps();
            }
            float m = -INFINITY, l = 0.0f;
            for (int c0 = (lo / S) * S; c0 <= pos; c0 += S) {
                const int a = lo > c0 ? lo : c0, c1 = c0 + S - 1 < pos ? c0 + S - 1 : pos, n = c1 - a + 1;
                for (int p = a; p <= c1; p++) {
                    const int64_t at = key_at(j, table, head_base, p);
                    __m512 x = _mm512_mul_ps(qv[0], load16(j->kpool, at, bf));
                    for (int c = 1; c < nd; c++) x = _mm512_fmadd_ps(qv[c], load16(j->kpool, at + 16 * c, bf), x);
                    float sc = _mm512_reduce_add_ps(x) * j->scale;
                    if (j->softcap > 0.0f) sc = j->softcap * tanhf(sc / j->softcap);
                    s[p - a] = sc;
                }
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int t = 0; t < n; t += 16)
                    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(n - t), s + t));
                const float bm = _mm512_reduce_max_ps(mx);
                if (bm > m) {
                    const float c = fast_exp(m - bm);
                    l *= c;
                    for (int d = 0; d < nd; d++) acc[d] = _mm512_mul_ps(acc[d], _mm512_set1_ps(c));
                    m = bm;
                }
                __m512 lsum = _mm512_setzero_ps();
                for (int t = 0; t < n; t += 16) {
                    const __mmask16 k = lanes(n - t);
                    const __m512 e = _mm512_maskz_mov_ps(
                        k, fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), _mm512_set1_ps(m))));
                    lsum = _mm512_add_ps(lsum, e);
                    _mm512_mask_storeu_ps(s + t, k, bf ? round_bf16_16(e) : e);
                }
                l += _mm512_reduce_add_ps(lsum);
                for (int p = a; p <= c1; p++) {
                    const __m512 w = _mm512_set1_ps(s[p - a]);
                    const int64_t at = key_at(j, table, head_base, p);
                    for (int c = 0; c < nd; c++) acc[c] = _mm512_fmadd_ps(w, load16(j->vpool, at + 16 * c, bf), acc[c]);
                }
            }
            float *o = j->out + ((int64_t)(qs + i) * j->hq + h) * D;
            const __m512 inv = _mm512_set1_ps(1.0f / l);
            for (int c = 0; c < nd; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], inv));
        }
    }
}

static inline __attribute__((always_inline)) void item_as(const job_t *j, int r, int g, const int bf) {
    if (j->dim == 64)
        run_item16(j, r, g, 4, bf);  /* the common head dims, unrolled with their accumulators in registers */
    else if (j->dim == 128)
        run_item16(j, r, g, 8, bf);
    else if (j->dim % 16 == 0)
        run_item16(j, r, g, j->dim / 16, bf);
    else
        run_item(j, r, g, bf);
}
#else
static inline __attribute__((always_inline)) void item_as(const job_t *j, int r, int g, const int bf) {
    run_item(j, r, g, bf);
}
#endif

static void item(const job_t *j, int r, int g, int bf) {
    if (bf)
        item_as(j, r, g, 1);
    else
        item_as(j, r, g, 0);
}

/* Returns 0, or -1 when a block, head or split is too large for this kernel (the caller uses its fallback). */
static int run(const float *q, int64_t q_st, int64_t q_sh, const void *kpool, const void *vpool, int64_t pool_blocks,
               int bs, int dim, int hkv, int hq, const int32_t *tables, int64_t table_stride, const int32_t *q_start,
               const int32_t *q_len, const int32_t *kv_len, int rows, float scale, float softcap, int window,
               int split, float *out, int threads, int bf) {
    if (bs > MAX_BLOCK || dim > MAX_DIM || split < 1 || split > MAX_SPLIT || hkv <= 0 || hq % hkv != 0) return -1;
    job_t j = {q,     q_st,    q_sh,  kpool, vpool,   pool_blocks, bs,     dim,   hkv,   hq,  tables,
               table_stride, q_start, q_len, kv_len, rows, scale, softcap, window, split, out};
    const int items = rows * hkv;
    const int n = threads < items ? threads : items;
#pragma omp parallel for schedule(static, 1) num_threads(n > 0 ? n : 1)
    for (int it = 0; it < items; it++) item(&j, it / hkv, it % hkv, bf);
    return 0;
}

int paged_attention_f32(const float *q, int64_t q_st, int64_t q_sh, const float *kpool, const float *vpool,
                        int64_t pool_blocks, int bs, int dim, int hkv, int hq, const int32_t *tables,
                        int64_t table_stride, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                        int rows, float scale, float softcap, int window, int split, float *out, int threads) {
    return run(q, q_st, q_sh, kpool, vpool, pool_blocks, bs, dim, hkv, hq, tables, table_stride, q_start, q_len,
               kv_len, rows, scale, softcap, window, split, out, threads, 0);
}

/* The same over bfloat16 pools (uint16 bit patterns); queries and output stay float32. */
int paged_attention_bf16(const float *q, int64_t q_st, int64_t q_sh, const uint16_t *kpool, const uint16_t *vpool,
                         int64_t pool_blocks, int bs, int dim, int hkv, int hq, const int32_t *tables,
                         int64_t table_stride, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                         int rows, float scale, float softcap, int window, int split, float *out, int threads) {
    return run(q, q_st, q_sh, kpool, vpool, pool_blocks, bs, dim, hkv, hq, tables, table_stride, q_start, q_len,
               kv_len, rows, scale, softcap, window, split, out, threads, 1);
}
