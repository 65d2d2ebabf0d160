/* Paged attention for float32 KV pools on the CPU: every query reads its row's keys and values where they lie in
 * the pool, through the row's block table (no gather into a per-row buffer).
 *
 * Pool layout, per layer and side: [Hkv][num_blocks][block_size * D] floats (engine/kv_pool.py), so one head's
 * block is block_size * D contiguous floats.
 * Queries: token-major, q[t][h][d] at q + t * q_st + h * q_sh + d (d contiguous). Output: out[t][h][d], contiguous
 * [T][Hq][D].
 * Row r: queries q_start[r] .. q_start[r] + q_len[r] - 1; key positions 0 .. kv_len[r] - 1, block i of them in
 * pool block tables[r * table_stride + i]. Query i of the row has position kv_len[r] - q_len[r] + i and attends
 * the keys j <= its position, and j > position - window when window > 0 (transformers' sliding window).
 * Scores are q.k * scale, then softcap * tanh(score / softcap) when softcap > 0 (Gemma 2), then a softmax.
 * Query head h reads kv head h / (Hq / Hkv) (grouped-query attention).
 *
 * Work items are (row, kv head) pairs, split across OpenMP threads: the library links libgomp.so.1, which resolves
 * to the copy torch has loaded already, so the kernel runs on torch's own thread pool. Numerics: an online
 * softmax one block at a time, in float32; exp is a polynomial accurate to about 2 ulp. Where the compiler targets
 * AVX-512 (-march=native on such a CPU) and the head dim is a multiple of 16, run_item16 does the same with 16-lane
 * vectors: one reduction per key's score, a block's exps 16 at a time (2.6x the scalar loop's speed on 8 rows of
 * 1,500 tokens, 12 heads of 64; the scalar one was bound by arithmetic at about a quarter of the read bandwidth).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_BLOCK 1024
#define MAX_DIM 1024

typedef struct {
    const float *q;
    int64_t q_st, q_sh;
    const float *kpool, *vpool;
    int64_t pool_blocks;
    int bs, dim, hkv, hq;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *q_start, *q_len, *kv_len;
    int rows;
    float scale, softcap;
    int window;
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

static inline float dot(const float *a, const float *b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
    for (; d + 8 <= n; d += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[d + k] * b[d + k];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* One (row, kv head): every query of the row, every query head of the group. */
static void run_item(const job_t *j, int r, int g) {
    const int bs = j->bs, D = j->dim, G = j->hq / j->hkv;
    const int ql = j->q_len[r], kv = j->kv_len[r], qs = j->q_start[r];
    const int32_t *table = j->tables + (int64_t)r * j->table_stride;
    const int64_t head_base = (int64_t)g * j->pool_blocks * bs * D;
    float s[MAX_BLOCK], acc[MAX_DIM];
    for (int i = 0; i < ql; i++) {
        const int pos = kv - ql + i;
        const int lo = (j->window > 0 && pos - j->window + 1 > 0) ? pos - j->window + 1 : 0;
        for (int hh = 0; hh < G; hh++) {
            const int h = g * G + hh;
            const float *qv = j->q + (int64_t)(qs + i) * j->q_st + (int64_t)h * j->q_sh;
            float m = -INFINITY, l = 0.0f;
            for (int d = 0; d < D; d++) acc[d] = 0.0f;
            for (int b = lo / bs; b <= pos / bs; b++) {
                const int64_t off = head_base + (int64_t)table[b] * bs * D;
                const float *kb = j->kpool + off, *vb = j->vpool + off;
                const int t0 = lo > b * bs ? lo - b * bs : 0;
                const int t1 = pos - b * bs < bs - 1 ? pos - b * bs : bs - 1;
                float bm = -INFINITY;
                for (int t = t0; t <= t1; t++) {
                    float sc = dot(qv, kb + (int64_t)t * D, D) * j->scale;
                    if (j->softcap > 0.0f) sc = j->softcap * tanhf(sc / j->softcap);
                    s[t] = sc;
                    if (sc > bm) bm = sc;
                }
                if (bm > m) {
                    const float c = fast_exp(m - bm);
                    l *= c;
                    for (int d = 0; d < D; d++) acc[d] *= c;
                    m = bm;
                }
                for (int t = t0; t <= t1; t++) s[t] = fast_exp(s[t] - m);
                for (int t = t0; t <= t1; t++) {
                    const float w = s[t];
                    const float *vr = vb + (int64_t)t * D;
                    l += w;
                    for (int d = 0; d < D; d++) acc[d] += w * vr[d];
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

static inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* run_item with 16-lane vectors, for head dims that are a multiple of 16 (nd = dim / 16 vectors per key): each key's
 * score is one vector dot reduced once, a block's scores are exponentiated 16 at a time, and the weighted values
 * are summed into nd vector accumulators. The same online softmax as run_item, summed in another order. */
static inline __attribute__((always_inline)) void run_item16(const job_t *j, int r, int g, const int nd) {
    const int bs = j->bs, D = j->dim, G = j->hq / j->hkv;
    const int ql = j->q_len[r], kv = j->kv_len[r], qs = j->q_start[r];
    const int32_t *table = j->tables + (int64_t)r * j->table_stride;
    const int64_t head_base = (int64_t)g * j->pool_blocks * bs * D;
    float s[MAX_BLOCK + 16];
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
            for (int b = lo / bs; b <= pos / bs; b++) {
                const int64_t off = head_base + (int64_t)table[b] * bs * D;
                const float *kb = j->kpool + off, *vb = j->vpool + off;
                const int t0 = lo > b * bs ? lo - b * bs : 0;
                const int t1 = pos - b * bs < bs - 1 ? pos - b * bs : bs - 1;
                for (int t = t0; t <= t1; t++) {
                    const float *kr = kb + (int64_t)t * D;
                    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
                    for (int c = 1; c < nd; c++) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), a);
                    float sc = _mm512_reduce_add_ps(a) * j->scale;
                    if (j->softcap > 0.0f) sc = j->softcap * tanhf(sc / j->softcap);
                    s[t] = sc;
                }
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int t = t0; t <= t1; t += 16)
                    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(t1 + 1 - t), s + t));
                const float bm = _mm512_reduce_max_ps(mx);
                if (bm > m) {
                    const float c = fast_exp(m - bm);
                    l *= c;
                    for (int d = 0; d < nd; d++) acc[d] = _mm512_mul_ps(acc[d], _mm512_set1_ps(c));
                    m = bm;
                }
                __m512 lsum = _mm512_setzero_ps();
                for (int t = t0; t <= t1; t += 16) {
                    const __mmask16 k = lanes(t1 + 1 - t);
                    const __m512 w = _mm512_maskz_mov_ps(k, fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t),
                                                                                      _mm512_set1_ps(m))));
                    _mm512_mask_storeu_ps(s + t, k, w);
                    lsum = _mm512_add_ps(lsum, w);
                }
                l += _mm512_reduce_add_ps(lsum);
                for (int t = t0; t <= t1; t++) {
                    const __m512 w = _mm512_set1_ps(s[t]);
                    const float *vr = vb + (int64_t)t * D;
                    for (int c = 0; c < nd; c++) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), acc[c]);
                }
            }
            float *o = j->out + ((int64_t)(qs + i) * j->hq + h) * D;
            const __m512 inv = _mm512_set1_ps(1.0f / l);
            for (int c = 0; c < nd; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], inv));
        }
    }
}

static void item(const job_t *j, int r, int g) {
    if (j->dim == 64)
        run_item16(j, r, g, 4);  /* the common head dims, unrolled with their accumulators in registers */
    else if (j->dim == 128)
        run_item16(j, r, g, 8);
    else if (j->dim % 16 == 0)
        run_item16(j, r, g, j->dim / 16);
    else
        run_item(j, r, g);
}
#else
static void item(const job_t *j, int r, int g) { run_item(j, r, g); }
#endif

/* Returns 0, or -1 when a block or head is too large for this kernel (the caller uses its fallback). */
int paged_attention_f32(const float *q, int64_t q_st, int64_t q_sh, const float *kpool, const float *vpool,
                        int64_t pool_blocks, int bs, int dim, int hkv, int hq, const int32_t *tables,
                        int64_t table_stride, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                        int rows, float scale, float softcap, int window, float *out, int threads) {
    if (bs > MAX_BLOCK || dim > MAX_DIM || hkv <= 0 || hq % hkv != 0) return -1;
    job_t j = {q, q_st, q_sh, kpool, vpool, pool_blocks, bs, dim, hkv, hq, tables, table_stride,
               q_start, q_len, kv_len, rows, scale, softcap, window, out};
    const int items = rows * hkv;
    const int n = threads < items ? threads : items;
#pragma omp parallel for schedule(static, 1) num_threads(n > 0 ? n : 1)
    for (int it = 0; it < items; it++) item(&j, it / hkv, it % hkv);
    return 0;
}
