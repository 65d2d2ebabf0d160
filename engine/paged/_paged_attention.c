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
 * loop's speed on 8 rows of 1,500 tokens, 12 heads of 64; the scalar one was bound by arithmetic). Where it targets
 * AVX2 with FMA but not AVX-512 (AMD Zen 2/3, most Intel client CPUs), run_item8 does the same with 8-lane vectors
 * for head dims that are a multiple of 8 (1.3x the scalar loop on a Zen 3: 8 rows x 1,400 keys, 12 layers, scattered
 * blocks), and paged_prefill_f32 runs with 8-lane vectors (prefill_group8).
 *
 * paged_prefill_bf16 serves rows of many new tokens (prefill chunks) over bfloat16 pools where the compiler targets
 * AVX512-BF16: the same online softmax over the same splits, with bf16 pair dot products (vdpbf16ps: each product
 * exact in fp32, the sums in fp32) for the scores and for the probability-weighted values, in tiles of 32 queries.
 * torch's CPU flash attention computes bf16 at about fp32 speed; a bf16 matmul on such a CPU runs several times as
 * fast (benchmarks/bench_agent_attention.py --dtype bfloat16 times both paths and counts the outputs that differ).
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

/* Asks for the `bytes` bytes at `p` to be brought into cache (a block's keys or values, ahead of their reads: blocks
 * lie anywhere in the pool, so the hardware's stream prefetch starts over at each one). __builtin_prefetch: GCC 12
 * dropped _mm_prefetch from these loops. */
#ifndef KV_AHEAD
/* How many blocks ahead the decode path asks for a row's keys, across split boundaries. Against one block ahead
 * within a split (8 rows x 1,024 tokens, bf16, one process, interleaved): blocks in order 0.38 -> 0.36 ms per layer,
 * descending 0.57 -> 0.51, scattered 0.72 -> 0.63; 2 and 8 did about as well as 4 (into L1 then; see KV_HINT). */
#define KV_AHEAD 4
#endif
#ifndef KV_HINT
/* Where the prefetches ask the lines to go: __builtin_prefetch's locality, 2 (prefetcht1: the core's L2) or 3
 * (prefetcht0: L1 as well). Into L2, a core keeps more lines in flight than its L1's few miss buffers allow: on an
 * AMD Zen 4 (8 rows x 1,600 tokens, 12 heads of 64, 12 layers out of cache, the pool in huge pages) the decode path
 * read fp32 blocks at 19 -> 33 GB/s scattered, 34 -> 39 in shuffled runs of 13, 38 -> 41 in order, bf16 at 16 ->
 * 29, 25 -> 36 and 32 -> 39 (in 4 KiB pages, fp32: 17 -> 29 scattered); the prefill path, 4 rows of 32 new tokens
 * over 1,792, 6.2 -> 5.0 ms a layer. Earlier CPUs of this project (before the pool had huge pages) showed no
 * difference either way. KV_HINT=3 builds the old choice (kernel.L1_PREFETCH). The same bits either way. */
#define KV_HINT 2
#endif
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, KV_HINT);
}

/* At key p of an item reading keys lo .. last (p the first key of a block, or of a split): the values of p's block
 * (read after the split's keys), and the keys KV_AHEAD blocks on (at lo, every block up to there); `el` bytes per
 * element. Only asks the memory for lines: changes nothing computed. */
static inline void prefetch_at(const job_t *j, const int32_t *table, int64_t head_base, int p, int lo, int last,
                               int64_t el) {
    const int64_t blk = (int64_t)j->bs * j->dim * el; /* one block of one head, bytes */
    prefetch_bytes((const char *)j->vpool + key_at(j, table, head_base, p - p % j->bs) * el, blk);
    const int b0 = p / j->bs, lb = last / j->bs;
    for (int b = p == lo ? b0 + 1 : b0 + KV_AHEAD; b <= b0 + KV_AHEAD && b <= lb; b++)
        prefetch_bytes((const char *)j->kpool + key_at(j, table, head_base, b * j->bs) * el, blk);
}

#ifndef KV_SPREAD
/* KV_SPREAD (float32 pools): the decode path asks for the same lines as prefetch_at, but a key's worth at a time,
 * beside the key's own reads, instead of two blocks' worth at each block's first key. On an AMD Zen 4 (8 rows x
 * 1,024 tokens, 12 heads of 64, 4 layers out of cache, 2 threads; /tmp A/B, 6 rounds each way in turn, probe 35-37
 * GB/s) fp32 read 4-6% faster (blocks in order 85 -> 89% of the probe, in runs of 13 83 -> 87%, scattered 77 ->
 * 82%), and 16% faster from L3; bf16 read 4% slower from memory (89 -> 85%, 90 -> 86%, 70 -> 69%), so bf16 keeps
 * the blocks' bursts. KV_SPREAD=0 builds bursts for both (bench_decode_roofline's blocks_read times it). The same
 * bits either way. */
#define KV_SPREAD 1
#endif
/* KV_SPREAD's asks at key p of an item reading keys lo .. last, p the first key of its block or of a split: asks
 * now for what the per-key asks will not reach (at lo, the keys of the blocks up to KV_AHEAD - 1 ahead; the keys
 * before p of the block KV_AHEAD ahead) and gives the per-key asks' bases: the keys of the block KV_AHEAD ahead
 * (NULL: past `last`) and the values of p's block. */
static inline void spread_at(const job_t *j, const int32_t *table, int64_t head_base, int p, int lo, int last,
                             int64_t el, const char **kahead, const char **vnow) {
    const int64_t row = (int64_t)j->dim * el, blk = (int64_t)j->bs * row;
    const int o = p % j->bs, b0 = p / j->bs, lb = last / j->bs;
    *vnow = (const char *)j->vpool + key_at(j, table, head_base, p - o) * el;
    if (p == lo)
        for (int b = b0 + 1; b < b0 + KV_AHEAD && b <= lb; b++)
            prefetch_bytes((const char *)j->kpool + key_at(j, table, head_base, b * j->bs) * el, blk);
    const int ba = b0 + KV_AHEAD;
    *kahead = ba <= lb ? (const char *)j->kpool + key_at(j, table, head_base, ba * j->bs) * el : NULL;
    if (*kahead != NULL && o > 0) prefetch_bytes(*kahead, o * row);
}

/* The prefill path's tiles and scratch, for its AVX-512 and AVX2 builds. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <omp.h>
#define PF_QT 32       /* queries per prefill tile: two 16-lane vectors (four 8-lane) */
#define PF_KB 8        /* keys per score block: 16 accumulators */
#define PF_NQ 4        /* queries per PV group (bf16) */
/* PF_NQ_F32: queries per float32 PV group, as many as keep its accumulators (queries x head dim / 16) within 24
 * registers (head dim 64: 6; 128: 3); with the rest in pairs. Each query sums its values in key order whatever its
 * group: the same bits (4 was the first choice: 256 new tokens over 1,400 keys, fp32, 12 layers, 3.07 -> 2.85 ms). */
#ifndef PF_NQ_F32
#define PF_NQ_F32 6
#endif
#define PF_NQ_MAX (PF_NQ_F32 > PF_NQ ? PF_NQ_F32 : PF_NQ)
#define PF_MAX_DIM 256 /* head dims up to this (multiples of 16) */
/* The prefill path's tunings, each 0 (PF_GROUP 1) in a variant built to compare against (kernel.load_variant,
 * kernel.PREFILL_PLAIN; the outputs are the same bits either way).
 * PF_HALF: a tile of at most 16 queries computes one 16-lane half of the tile, 16 keys at a time (else both halves,
 *   8 keys at a time).
 * PF_PREFETCH: the tiles ask for their keys KV_AHEAD blocks ahead and for each block's values (prefetch_at), as the
 *   decode path does. Rows of 8 new tokens over 3,072 cached ones, 12 layers out of cache (bf16, scattered blocks):
 *   1.06 -> 0.45 ms per layer for both (bench_agent_attention).
 * PF_GROUP: up to this many tiles of one row and query head are one work item, run split by split (prefill_group_*):
 *   a split's keys and values come from memory once for the group, from L2 for its other tiles (1: a tile per item,
 *   each reading all its keys and values).
 * PF_GROUP_VALUES: a bf16 group's tiles that read the same keys of a split share its interleaved values (0: each
 *   tile builds them).
 * PF_CONTIG: a score block's keys that lie in one pool block are read at constant offsets from the first.
 * PF_PVB: the weighted values run in blocks of this many keys, every query group over a block in turn, so a block's
 *   values are read from L1 (0: each query group over the whole split, the values from L2).
 * All four of the last, against none (bench_agent_attention's builds, 256 new tokens over 1,536 cached, 12 layers,
 * scattered blocks): fp32 4.75 -> 3.90 ms per layer, bf16 2.45 -> 2.2 ms. */
#ifndef PF_HALF
#define PF_HALF 1
#endif
#ifndef PF_PREFETCH
#define PF_PREFETCH 1
#endif
#ifndef PF_GROUP
#define PF_GROUP 8
#endif
#ifndef PF_GROUP_VALUES
#define PF_GROUP_VALUES 1
#endif
#ifndef PF_CONTIG
#define PF_CONTIG 1
#endif
#ifndef PF_PVB
#define PF_PVB 64
#endif

/* Which of a tile's queries (bit i: query i, at position pos0 + i, i < nq) attend key position p. */
static inline uint32_t tile_mask(int p, int pos0, int nq, int window) {
    int lo = p - pos0 > 0 ? p - pos0 : 0, hi = nq - 1;
    if (window > 0 && p - pos0 + window - 1 < hi) hi = p - pos0 + window - 1;
    if (lo > hi) return 0;
    const uint32_t upto = hi >= 31 ? 0xFFFFFFFFu : ((1u << (hi + 1)) - 1u);
    return upto & ~((1u << lo) - 1u);
}

/* tile_mask, where keys in [full_lo, pos0] (seen by every live query: at or before the first query, inside the
 * last one's window) are the live lanes without computing it. */
static inline uint32_t pf_mask(int p, int full_lo, int pos0, uint32_t live, int nq, int window) {
    return p >= full_lo && p <= pos0 ? live : tile_mask(p, pos0, nq, window);
}

/* Where a tile of queries i0 .. i0 + 31 of row r (query head h) reads: its live queries, their positions, the keys
 * they see, the row's block table and the kv head's base in the pool. */
typedef struct {
    int nq, pos0, posl, lo, full_lo, S, qs;
    uint32_t live;
    const int32_t *table;
    int64_t head_base;
} tile_t;

static inline tile_t tile_at(const job_t *j, int r, int h, int i0) {
    tile_t t;
    const int ql = j->q_len[r], kv = j->kv_len[r], g = h / (j->hq / j->hkv);
    t.nq = ql - i0 < PF_QT ? ql - i0 : PF_QT;
    t.qs = j->q_start[r];
    t.S = split_size(j, kv);
    t.table = j->tables + (int64_t)r * j->table_stride;
    t.head_base = (int64_t)g * j->pool_blocks * j->bs * j->dim;
    t.pos0 = kv - ql + i0;
    t.posl = t.pos0 + t.nq - 1;
    t.lo = (j->window > 0 && t.pos0 - j->window + 1 > 0) ? t.pos0 - j->window + 1 : 0;
    t.live = t.nq >= 32 ? 0xFFFFFFFFu : ((1u << t.nq) - 1u);
    t.full_lo = j->window > 0 ? t.posl - j->window + 1 : 0; /* keys from here to pos0: every live query sees them */
    return t;
}

/* The mask of key position p for tile t (pf_mask). */
static inline uint32_t tile_key_mask(const job_t *j, const tile_t *t, int p) {
    return pf_mask(p, t->full_lo, t->pos0, t->live, t->nq, j->window);
}

/* Bytes of scratch one thread of paged_prefill_bf16 / _f32 uses for head dim `dim` and splits of `split` keys (the
 * larger of the two layouts: queries [dim][32] floats, scores [split][32], probability pairs, values by key pairs or
 * value offsets, output accumulators [32][dim]). */
static int64_t prefill_scratch(int dim, int split) {
    const int64_t pairs = (split + 1) / 2;
    int64_t b = (int64_t)dim * PF_QT * 4 + (int64_t)split * PF_QT * 4 + pairs * PF_QT * 4;
    b += pairs * 2 * dim * 2 + (int64_t)split * 8 + (int64_t)PF_QT * dim * 4 + 4 * 64;
    const int64_t f32 = (int64_t)split * (PF_QT * 4 + 8) + (int64_t)PF_GROUP * (2 * dim * PF_QT + 2 * PF_QT) * 4;
    const int64_t bf = (int64_t)split * PF_QT * 4 + pairs * (PF_QT * 4 + 2 * dim * 2) +
                       (int64_t)PF_GROUP * (dim / 2 * PF_QT + dim * PF_QT + 2 * PF_QT) * 4;
    if (f32 + 64 > b) b = f32 + 64; /* a group of tiles (prefill_group_f32, prefill_group_bf16) */
    if (bf + 64 > b) b = bf + 64;
    return (b + 63) / 64 * 64;
}

#endif

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
 * are summed into nd vector accumulators. The same online softmax as run_item, summed in another order. Keys and
 * values are addressed block by block (one table lookup per block, then D elements on per key) rather than key by
 * key: the same reads and bits; 8 rows x 1,400 keys, 12 layers out of cache, timed in turn over three moments of
 * this host: 1-15% faster over blocks in order or in runs of 13, 4-35% over scattered blocks, fp32 and bf16. */
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
                for (int p = a; p <= c1;) { /* block by block: a block's keys lie D elements apart */
                    const int end = p - p % j->bs + j->bs - 1 < c1 ? p - p % j->bs + j->bs - 1 : c1;
                    const int64_t el = bf ? 2 : 4, row = (int64_t)D * el;
                    const char *kahead = NULL, *vnow = NULL;
                    const int spread = KV_SPREAD && !bf;
                    if (spread)
                        spread_at(j, table, head_base, p, lo, pos, el, &kahead, &vnow);
                    else
                        prefetch_at(j, table, head_base, p, lo, pos, el);
                    int64_t off = (int64_t)(p % j->bs) * row, at = key_at(j, table, head_base, p);
                    for (; p <= end; p++, at += D, off += row) {
                        if (spread) {
                            if (kahead != NULL) prefetch_bytes(kahead + off, row);
                            prefetch_bytes(vnow + off, row);
                        }
                        __m512 x = _mm512_mul_ps(qv[0], load16(j->kpool, at, bf));
                        for (int c = 1; c < nd; c++) x = _mm512_fmadd_ps(qv[c], load16(j->kpool, at + 16 * c, bf), x);
                        float sc = _mm512_reduce_add_ps(x) * j->scale;
                        if (j->softcap > 0.0f) sc = j->softcap * tanhf(sc / j->softcap);
                        s[p - a] = sc;
                    }
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
                for (int p = a; p <= c1;) {
                    const int end = p - p % j->bs + j->bs - 1 < c1 ? p - p % j->bs + j->bs - 1 : c1;
                    for (int64_t at = key_at(j, table, head_base, p); p <= end; p++, at += D) {
                        const __m512 w = _mm512_set1_ps(s[p - a]);
                        for (int c = 0; c < nd; c++) acc[c] = _mm512_fmadd_ps(w, load16(j->vpool, at + 16 * c, bf), acc[c]);
                    }
                }
            }
            float *o = j->out + ((int64_t)(qs + i) * j->hq + h) * D;
            const __m512 inv = _mm512_set1_ps(1.0f / l);
            for (int c = 0; c < nd; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], inv));
        }
    }
}

/* A score block's `un` keys from position a + kb: their scaled scores into s ([k][32]), and the split's running
 * max over the keys each query sees into mx; for the first `nv` 16-lane halves of the tile. */
static inline __attribute__((always_inline)) void store_scores(const job_t *j, const tile_t *t, __m512 (*acc)[2],
                                                                int un, int a, int kb, float *s, __m512 mx[2],
                                                                const int nv) {
    const __m512 scale = _mm512_set1_ps(j->scale);
    for (int u = 0; u < un; u++) {
        const uint32_t mk = tile_key_mask(j, t, a + kb + u);
        for (int v = 0; v < nv; v++) {
            const __m512 sc = _mm512_mul_ps(acc[u][v], scale);
            _mm512_storeu_ps(s + (int64_t)(kb + u) * PF_QT + 16 * v, sc);
            mx[v] = _mm512_mask_max_ps(mx[v], (__mmask16)(mk >> (16 * v)), mx[v], sc);
        }
    }
}

/* A split's running max, rescale factors and sums: m <- max(m, mx) (in mn too), l *= exp(m_old - m) (1 where the max
 * did not move), the factors in cs (so the output accumulators follow), and the exps' sums reset; for the first `nv`
 * 16-lane halves. */
static inline __attribute__((always_inline)) void split_rescale(__m512 m[2], __m512 l[2], const __m512 mx[2],
                                                                 __m512 mn[2], __m512 esum[2], float *cs,
                                                                 const int nv) {
    for (int v = 0; v < nv; v++) {
        mn[v] = _mm512_max_ps(m[v], mx[v]);
        const __mmask16 up = _mm512_cmp_ps_mask(mn[v], m[v], _CMP_GT_OQ);
        const __m512 c = _mm512_mask_blend_ps(up, _mm512_set1_ps(1.0f), fast_exp16(_mm512_sub_ps(m[v], mn[v])));
        l[v] = _mm512_mul_ps(l[v], c);
        _mm512_storeu_ps(cs + 16 * v, c);
        m[v] = mn[v];
        esum[v] = _mm512_setzero_ps();
    }
}

/* The tile's outputs: each live query's accumulators `o` ([32][D]) over its sum of exps. */
static inline void tile_store(const job_t *j, const float *o, const __m512 l[2], int r, int h, int i0, int nq, int nd) {
    const int D = nd * 16, qs = j->q_start[r];
    float ls[PF_QT];
    _mm512_storeu_ps(ls, l[0]);
    _mm512_storeu_ps(ls + 16, l[1]);
    for (int i = 0; i < nq; i++) {
        float *dst = j->out + ((int64_t)(qs + i0 + i) * j->hq + h) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / ls[i]);
        for (int x = 0; x < nd; x++) _mm512_storeu_ps(dst + 16 * x, _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)i * D + 16 * x), inv));
    }
}

/* The values' share of `gq` queries (a constant where inlined) for one split over float32 values: their accumulators
 * `o` ([gq][D]) scaled by the rescale factors `c`, plus the probabilities `pr` ([n][32], this group's column first)
 * times the value rows at `vo` (element offsets into the pool), in key order. */
static inline __attribute__((always_inline)) void pv_group_f32(float *o, const float *c, const float *pr,
                                                               const float *vpool, const int64_t *vo, int n,
                                                               const int nd, const int gq) {
    const int D = nd * 16;
    __m512 acc[PF_NQ_MAX][PF_MAX_DIM / 16];
    for (int q = 0; q < gq; q++) {
        const __m512 cq = _mm512_set1_ps(c[q]);
        for (int x = 0; x < nd; x++) acc[q][x] = _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)q * D + 16 * x), cq);
    }
    for (int k = 0; k < n; k++) {
        const float *vr = vpool + vo[k];
        for (int x = 0; x < nd; x++) {
            const __m512 vz = _mm512_loadu_ps(vr + 16 * x);
            for (int q = 0; q < gq; q++) acc[q][x] = _mm512_fmadd_ps(_mm512_set1_ps(pr[(int64_t)k * PF_QT + q]), vz, acc[q][x]);
        }
    }
    for (int q = 0; q < gq; q++)
        for (int x = 0; x < nd; x++) _mm512_storeu_ps(o + (int64_t)q * D + 16 * x, acc[q][x]);
}

/* The scores of KB keys against a tile's queries (`qt`, [D][32]) into acc, summed over the head dim in order, for
 * the first `nv` 16-lane halves: the keys at k0, k0 + D, ... (one block's, in order: the offsets are constants where
 * inlined) when k0 is given, else at kr[u]. The same products and sums either way. */
static inline __attribute__((always_inline)) void scores_f32(__m512 (*acc)[2], const float *qt, const float *k0,
                                                             const float *const *kr, const int nd, const int nv,
                                                             const int KB) {
    const int D = nd * 16;
    for (int u = 0; u < KB; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m512 qa = _mm512_loadu_ps(qt + d * PF_QT);
        const __m512 qb = nv == 2 ? _mm512_loadu_ps(qt + d * PF_QT + 16) : qa;
        for (int u = 0; u < KB; u++) {
            const __m512 kd = _mm512_set1_ps(k0 ? k0[u * D + d] : kr[u][d]);
            acc[u][0] = _mm512_fmadd_ps(qa, kd, acc[u][0]);
            if (nv == 2) acc[u][1] = _mm512_fmadd_ps(qb, kd, acc[u][1]);
        }
    }
}

/* One split (keys from c0) of a float32 prefill tile's online softmax, as run_item16 runs it: scores for KB keys x
 * 32 queries at a time by fp32 FMAs from the keys where they lie (summed over the head dim in order), the split's
 * max as they are stored, the exps in place (summed in key order), and the values weighted straight from the pool, 4
 * queries at a time. The tile's queries `qt` ([D][32]), output accumulators `o` ([32][D]) and running max and sum
 * `ml` ([2][32]) live in scratch between splits; `s` ([S][32]) and `vo` ([S]) are the split's. Keys up to
 * `fetched` are in this core's caches already (an earlier tile of the group read them): no prefetch asked for them.
 * `nv` (a constant): the 16-lane halves computed, 1 where the tile has at most 16 queries (then 16 keys at a time);
 * each query's lane computes the same either way, so the outputs are the same bits. */
static inline __attribute__((always_inline)) void split_f32(const job_t *j, const tile_t *tile, int c0, const float *qt,
                                                            float *o, float *ml, float *s, int64_t *vo, int fetched,
                                                            const int nd, const int nv) {
    const int KB = nv == 1 ? 2 * PF_KB : PF_KB;
    const int D = nd * 16, nq = tile->nq, S = tile->S, lo = tile->lo, posl = tile->posl;
    const int32_t *table = tile->table;
    const int64_t head_base = tile->head_base;
    const float *kpool = (const float *)j->kpool, *vpool = (const float *)j->vpool;
    const int a = lo > c0 ? lo : c0, c1 = c0 + S - 1 < posl ? c0 + S - 1 : posl, n = c1 - a + 1;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 m[2], l[2], mx[2] = {ninf, ninf};
    for (int v = 0; v < 2; v++) {
        m[v] = _mm512_loadu_ps(ml + 16 * v);
        l[v] = _mm512_loadu_ps(ml + PF_QT + 16 * v);
    }
    float cs[PF_QT], ones[PF_QT];
    for (int i = 0; i < PF_QT; i++) ones[i] = 1.0f;
    for (int kb = 0; kb < n; kb += KB) {
        for (int u = 0; u < KB && a + kb + u <= c1; u++) /* at each block the keys ahead, its values */
            if (PF_PREFETCH && a + kb + u > fetched && ((a + kb + u) % j->bs == 0 || kb + u == 0))
                prefetch_at(j, table, head_base, a + kb + u, lo, posl, 4);
        __m512 acc[2 * PF_KB][2];
        const int p0 = a + kb;
        if (PF_CONTIG && p0 % j->bs + KB <= j->bs && p0 + KB - 1 <= c1) /* the KB keys lie in one block, in order */
            scores_f32(acc, qt, kpool + key_at(j, table, head_base, p0), NULL, nd, nv, KB);
        else {
            const float *kr[2 * PF_KB];
            for (int u = 0; u < KB; u++) kr[u] = kpool + key_at(j, table, head_base, p0 + u <= c1 ? p0 + u : c1);
            scores_f32(acc, qt, NULL, kr, nd, nv, KB);
        }
        store_scores(j, tile, acc, n - kb < KB ? n - kb : KB, a, kb, s, mx, nv);
    }
    __m512 mn[2], esum[2];
    split_rescale(m, l, mx, mn, esum, cs, nv);
    for (int k = 0; k < n; k++) {
        const uint32_t mk = tile_key_mask(j, tile, a + k);
        for (int v = 0; v < nv; v++) {
            float *sk = s + (int64_t)k * PF_QT + 16 * v;
            const __m512 e = _mm512_maskz_mov_ps((__mmask16)(mk >> (16 * v)),
                                                 fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(sk), mn[v])));
            esum[v] = _mm512_add_ps(esum[v], e);
            _mm512_storeu_ps(sk, e);
        }
        vo[k] = key_at(j, table, head_base, a + k);
    }
    for (int v = 0; v < nv; v++) {
        l[v] = _mm512_add_ps(l[v], esum[v]);
        _mm512_storeu_ps(ml + 16 * v, m[v]);
        _mm512_storeu_ps(ml + PF_QT + 16 * v, l[v]);
    }
    const int kstep = PF_PVB > 0 ? PF_PVB : n;
    const int GQ = PF_NQ_F32 * nd <= 24 ? PF_NQ_F32 : (24 / nd > 0 ? 24 / nd : 1); /* accumulators in registers */
    for (int k0 = 0; k0 < n; k0 += kstep) { /* every query group over a block of values while they are in L1 */
        const int kn = n - k0 < kstep ? n - k0 : kstep;
        const float *c = k0 == 0 ? cs : ones; /* scaled once per split; x 1.0 after: the same bits */
        const float *pk = s + (int64_t)k0 * PF_QT;
        int i = 0;
        for (; nq - i >= GQ; i += GQ) pv_group_f32(o + (int64_t)i * D, c + i, pk + i, vpool, vo + k0, kn, nd, GQ);
        for (; nq - i >= 2; i += 2) pv_group_f32(o + (int64_t)i * D, c + i, pk + i, vpool, vo + k0, kn, nd, 2);
        if (i < nq) pv_group_f32(o + (int64_t)i * D, c + i, pk + i, vpool, vo + k0, kn, nd, 1);
    }
}

/* Float32 prefill tiles t0 .. t0 + nt - 1 (of 32 queries each) of row r, query head h: each tile's online softmax
 * over the same splits as run_item16, split by split, every tile of the group over a split before the next split,
 * so the split's keys and values are read from memory once for the group and from this core's L2 after. Each tile
 * computes what it would alone, in the same order: the same bits. */
static inline __attribute__((always_inline)) void prefill_group_f32(const job_t *j, int r, int h, int t0, int nt,
                                                                    char *scratch, const int nd) {
    const int D = nd * 16;
    tile_t tl[PF_GROUP];
    for (int t = 0; t < nt; t++) tl[t] = tile_at(j, r, h, (t0 + t) * PF_QT);
    const int S = tl[0].S;
    float *s = (float *)scratch;                        /* [S][32] scores, then exps */
    int64_t *vo = (int64_t *)(s + (int64_t)S * PF_QT);  /* [S] the split's value rows */
    float *mine = (float *)(vo + S);                    /* per tile: qt [D][32], o [32][D], ml [2][32] */
    const int64_t per = (int64_t)2 * D * PF_QT + 2 * PF_QT;
    int c_lo = INT32_MAX, c_hi = -1;
    for (int t = 0; t < nt; t++) {
        float *qt = mine + t * per, *o = qt + (int64_t)D * PF_QT, *ml = o + (int64_t)D * PF_QT;
        const int i0 = (t0 + t) * PF_QT;
        for (int i = 0; i < PF_QT; i++) {
            const float *qv =
                i < tl[t].nq ? j->q + (int64_t)(tl[t].qs + i0 + i) * j->q_st + (int64_t)h * j->q_sh : NULL;
            for (int d = 0; d < D; d++) qt[d * PF_QT + i] = qv ? qv[d] : 0.0f; /* past the row's end: zeros */
            ml[i] = -INFINITY;
            ml[PF_QT + i] = 0.0f;
        }
        memset(o, 0, sizeof(float) * PF_QT * D);
        if ((tl[t].lo / S) * S < c_lo) c_lo = (tl[t].lo / S) * S;
        if (tl[t].posl > c_hi) c_hi = tl[t].posl;
    }
    for (int c0 = c_lo; c0 <= c_hi; c0 += S) {
        int fetched = -1; /* the last key an earlier tile of the group read in this split */
        for (int t = 0; t < nt; t++) {
            const tile_t *tile = &tl[t];
            if (c0 < (tile->lo / S) * S || c0 > tile->posl) continue;
            float *qt = mine + t * per, *o = qt + (int64_t)D * PF_QT, *ml = o + (int64_t)D * PF_QT;
            if (PF_HALF && tile->nq <= 16)
                split_f32(j, tile, c0, qt, o, ml, s, vo, fetched, nd, 1);
            else
                split_f32(j, tile, c0, qt, o, ml, s, vo, fetched, nd, 2);
            const int c1 = c0 + S - 1 < tile->posl ? c0 + S - 1 : tile->posl;
            if (c1 > fetched) fetched = c1;
        }
    }
    for (int t = 0; t < nt; t++) {
        const float *o = mine + t * per + (int64_t)D * PF_QT, *ml = o + (int64_t)D * PF_QT;
        const __m512 l[2] = {_mm512_loadu_ps(ml + PF_QT), _mm512_loadu_ps(ml + PF_QT + 16)};
        tile_store(j, o, l, r, h, (t0 + t) * PF_QT, tl[t].nq, nd);
    }
}

static void prefill_item_f32(const job_t *j, int r, int h, int t0, int nt, char *scratch) {
    if (j->dim == 64)
        prefill_group_f32(j, r, h, t0, nt, scratch, 4);
    else if (j->dim == 128)
        prefill_group_f32(j, r, h, t0, nt, scratch, 8);
    else
        prefill_group_f32(j, r, h, t0, nt, scratch, j->dim / 16);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static inline __m512 dpbf(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

/* The bfloat16 pair (x[0], x[1]) of two floats that are bfloat16 values: their upper halves, x[0] in the low one. */
static inline uint32_t bf_pair(const float *x) {
    union { float f; uint32_t u; } a, b;
    a.f = x[0];
    b.f = x[1];
    return (a.u >> 16) | (b.u & 0xFFFF0000u);
}

/* The values' share of `gq` queries (a constant where inlined) for one split: their accumulators `o` ([gq][D]) scaled
 * by the split's rescale factors `c`, plus the probability pairs `pp` (stride PF_QT) times the interleaved values `vp`
 * of `np` key pairs, in key order. */
static inline __attribute__((always_inline)) void pv_group(float *o, const float *c, const uint32_t *pp,
                                                           const uint16_t *vp, int np, const int nd, const int gq) {
    const int D = nd * 16;
    __m512 acc[PF_NQ][PF_MAX_DIM / 16];
    for (int q = 0; q < gq; q++) {
        const __m512 cq = _mm512_set1_ps(c[q]);
        for (int x = 0; x < nd; x++) acc[q][x] = _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)q * D + 16 * x), cq);
    }
    for (int t = 0; t < np; t++) {
        const uint16_t *vt = vp + (int64_t)t * 2 * D;
        for (int x = 0; x < nd; x++) {
            const __m512i vz = _mm512_loadu_si512(vt + 32 * x);
            for (int q = 0; q < gq; q++) acc[q][x] = dpbf(acc[q][x], vz, _mm512_set1_epi32((int)pp[(int64_t)t * PF_QT + q]));
        }
    }
    for (int q = 0; q < gq; q++)
        for (int x = 0; x < nd; x++) _mm512_storeu_ps(o + (int64_t)q * D + 16 * x, acc[q][x]);
}

/* The bf16 scores of KB keys against a tile's query pairs (`qp`, [P][32]) into acc, by AVX512-BF16 dot products
 * over the head dim in order, for the first `nv` halves: keys at k0, k0 + D, ... when k0 is given, else at kr[u] (as
 * scores_f32). */
static inline __attribute__((always_inline)) void scores_bf16(__m512 (*acc)[2], const uint32_t *qp, const uint16_t *k0,
                                                              const uint16_t *const *kr, const int nd, const int nv,
                                                              const int KB) {
    const int D = nd * 16, P = D / 2;
    for (int u = 0; u < KB; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
    for (int d = 0; d < P; d++) {
        const __m512i qa = _mm512_loadu_si512(qp + d * PF_QT);
        const __m512i qb = nv == 2 ? _mm512_loadu_si512(qp + d * PF_QT + 16) : qa;
        for (int u = 0; u < KB; u++) {
            const uint32_t *ku = (const uint32_t *)(k0 ? k0 + u * D : kr[u]);
            const __m512i kb2 = _mm512_set1_epi32((int)ku[d]);
            acc[u][0] = dpbf(acc[u][0], qa, kb2);
            if (nv == 2) acc[u][1] = dpbf(acc[u][1], qb, kb2);
        }
    }
}

/* One split (keys from c0) of a bf16 prefill tile: the online softmax of run_item16 with the bf16 dot products of
 * AVX512-BF16 (each product exact, summed in fp32, as torch's bf16 gemm does): scores for KB keys x 32 queries at a
 * time from the keys where they lie, the split's max, the exps (rounded to bf16 for the values, summed unrounded),
 * and the values weighted in pairs of keys from `vp` (the split's values interleaved by key pairs), which this tile
 * builds when `build` (else an earlier tile of the group built it for the same keys). State and `fetched` as in
 * split_f32; `qp` the query pairs ([P][32]), `pp` the probability pairs ([pairs][32]). */
static inline __attribute__((always_inline)) void split_bf16(const job_t *j, const tile_t *tile, int c0,
                                                             const uint32_t *qp, float *o, float *ml, float *s,
                                                             uint32_t *pp, uint16_t *vp, int build, int fetched,
                                                             const int nd, const int nv) {
    const int D = nd * 16, KB = nv == 1 ? 2 * PF_KB : PF_KB;
    const int nq = tile->nq, S = tile->S, lo = tile->lo, posl = tile->posl;
    const int32_t *table = tile->table;
    const int64_t head_base = tile->head_base;
    const uint16_t *kpool = (const uint16_t *)j->kpool;
    const int a = lo > c0 ? lo : c0, c1 = c0 + S - 1 < posl ? c0 + S - 1 : posl, n = c1 - a + 1;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 m[2], l[2], mx[2] = {ninf, ninf};
    for (int v = 0; v < 2; v++) {
        m[v] = _mm512_loadu_ps(ml + 16 * v);
        l[v] = _mm512_loadu_ps(ml + PF_QT + 16 * v);
    }
    float cs[PF_QT], ones[PF_QT];
    for (int i = 0; i < PF_QT; i++) ones[i] = 1.0f;
    for (int kb = 0; kb < n; kb += KB) {
        for (int u = 0; u < KB && a + kb + u <= c1; u++) /* at each block the keys ahead, its values */
            if (PF_PREFETCH && a + kb + u > fetched && ((a + kb + u) % j->bs == 0 || kb + u == 0))
                prefetch_at(j, table, head_base, a + kb + u, lo, posl, 2);
        __m512 acc[2 * PF_KB][2];
        const int p0 = a + kb;
        if (PF_CONTIG && p0 % j->bs + KB <= j->bs && p0 + KB - 1 <= c1) /* the KB keys lie in one block, in order */
            scores_bf16(acc, qp, kpool + key_at(j, table, head_base, p0), NULL, nd, nv, KB);
        else {
            const uint16_t *kr[2 * PF_KB];
            for (int u = 0; u < KB; u++) kr[u] = kpool + key_at(j, table, head_base, p0 + u <= c1 ? p0 + u : c1);
            scores_bf16(acc, qp, NULL, kr, nd, nv, KB);
        }
        store_scores(j, tile, acc, n - kb < KB ? n - kb : KB, a, kb, s, mx, nv);
    }
    __m512 mn[2], esum[2];
    split_rescale(m, l, mx, mn, esum, cs, nv);
    /* per pair of keys: the exps (summed unrounded, in key order), rounded to bf16 and packed as pairs for the
     * values' dot products; and (when building) the pair's values interleaved */
    const int np = (n + 1) / 2;
    for (int t = 0; t < np; t++) {
        const int k0 = 2 * t, k1 = 2 * t + 1;
        const uint32_t mk0 = tile_key_mask(j, tile, a + k0), mk1 = k1 < n ? tile_key_mask(j, tile, a + k1) : 0u;
        for (int v = 0; v < nv; v++) {
            const __m512 e0 = _mm512_maskz_mov_ps(
                (__mmask16)(mk0 >> (16 * v)), fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + (int64_t)k0 * PF_QT + 16 * v), mn[v])));
            esum[v] = _mm512_add_ps(esum[v], e0);
            __m512i pr = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_16(e0)), 16);
            if (k1 < n) {
                const __m512 e1 = _mm512_maskz_mov_ps(
                    (__mmask16)(mk1 >> (16 * v)), fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + (int64_t)k1 * PF_QT + 16 * v), mn[v])));
                esum[v] = _mm512_add_ps(esum[v], e1);
                pr = _mm512_or_si512(pr, _mm512_castps_si512(round_bf16_16(e1)));
            }
            _mm512_storeu_si512(pp + (int64_t)t * PF_QT + 16 * v, pr);
        }
        if (!build) continue;
        const int64_t at0 = key_at(j, table, head_base, a + k0);
        const int64_t at1 = k1 < n ? key_at(j, table, head_base, a + k1) : -1;
        const uint16_t *v0 = (const uint16_t *)j->vpool + at0;
        const uint16_t *v1 = at1 >= 0 ? (const uint16_t *)j->vpool + at1 : NULL;
        for (int c = 0; c < nd; c++) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(v0 + 16 * c));
            const __m256i x1 = v1 ? _mm256_loadu_si256((const __m256i *)(v1 + 16 * c)) : _mm256_setzero_si256();
            const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
            _mm512_storeu_si512(vp + (int64_t)t * 2 * D + 32 * c, _mm512_permutexvar_epi16(ilv, z));
        }
    }
    for (int v = 0; v < nv; v++) {
        l[v] = _mm512_add_ps(l[v], esum[v]);
        _mm512_storeu_ps(ml + 16 * v, m[v]);
        _mm512_storeu_ps(ml + PF_QT + 16 * v, l[v]);
    }
    const int tstep = PF_PVB > 0 ? (PF_PVB + 1) / 2 : np; /* pairs per block of values */
    for (int t0 = 0; t0 < np; t0 += tstep) {
        const int tn = np - t0 < tstep ? np - t0 : tstep;
        const float *c = t0 == 0 ? cs : ones; /* scaled once per split; x 1.0 after: the same bits */
        const uint32_t *pt = pp + (int64_t)t0 * PF_QT;
        const uint16_t *vt = vp + (int64_t)t0 * 2 * D;
        for (int i = 0; i < nq; i += PF_NQ) {
            if (nq - i >= PF_NQ)
                pv_group(o + (int64_t)i * D, c + i, pt + i, vt, tn, nd, PF_NQ);
            else
                for (int q = i; q < nq; q++) pv_group(o + (int64_t)q * D, c + q, pt + q, vt, tn, nd, 1);
        }
    }
}

/* Bf16 prefill tiles t0 .. t0 + nt - 1 of row r, query head h, split by split as prefill_group_f32; a split's
 * interleaved values are built once for the tiles that read the same keys of it. The same bits as tile by tile. */
static inline __attribute__((always_inline)) void prefill_group_bf16(const job_t *j, int r, int h, int t0, int nt,
                                                                     char *scratch, const int nd) {
    const int D = nd * 16, P = D / 2;
    tile_t tl[PF_GROUP];
    for (int t = 0; t < nt; t++) tl[t] = tile_at(j, r, h, (t0 + t) * PF_QT);
    const int S = tl[0].S, pairs_max = (S + 1) / 2;
    float *s = (float *)scratch;                                  /* [S][32] scores, then probabilities */
    uint32_t *pp = (uint32_t *)(s + (int64_t)S * PF_QT);          /* [pairs][32] probability pairs */
    uint16_t *vp = (uint16_t *)(pp + (int64_t)pairs_max * PF_QT); /* [pairs][D][2] values by key pairs */
    float *mine = (float *)(vp + (int64_t)pairs_max * 2 * D);     /* per tile: qp [P][32], o [32][D], ml [2][32] */
    const int64_t per = (int64_t)P * PF_QT + (int64_t)D * PF_QT + 2 * PF_QT;
    int c_lo = INT32_MAX, c_hi = -1;
    for (int t = 0; t < nt; t++) {
        uint32_t *qp = (uint32_t *)(mine + t * per);
        float *o = (float *)(qp + (int64_t)P * PF_QT), *ml = o + (int64_t)D * PF_QT;
        const int i0 = (t0 + t) * PF_QT;
        for (int i = 0; i < PF_QT; i++) {
            ml[i] = -INFINITY;
            ml[PF_QT + i] = 0.0f;
            if (i >= tl[t].nq) { /* past the row's last query: zero pairs (their lanes are computed, never stored) */
                for (int d = 0; d < P; d++) qp[d * PF_QT + i] = 0u;
                continue;
            }
            const float *qv = j->q + (int64_t)(tl[t].qs + i0 + i) * j->q_st + (int64_t)h * j->q_sh;
            for (int d = 0; d < P; d++) qp[d * PF_QT + i] = bf_pair(qv + 2 * d);
        }
        memset(o, 0, sizeof(float) * PF_QT * D);
        if ((tl[t].lo / S) * S < c_lo) c_lo = (tl[t].lo / S) * S;
        if (tl[t].posl > c_hi) c_hi = tl[t].posl;
    }
    for (int c0 = c_lo; c0 <= c_hi; c0 += S) {
        int fetched = -1, built_a = -1, built_n = -1; /* what an earlier tile of the group read, and built, here */
        for (int t = 0; t < nt; t++) {
            const tile_t *tile = &tl[t];
            if (c0 < (tile->lo / S) * S || c0 > tile->posl) continue;
            const uint32_t *qp = (const uint32_t *)(mine + t * per);
            float *o = (float *)(qp + (int64_t)P * PF_QT), *ml = o + (int64_t)D * PF_QT;
            const int a = tile->lo > c0 ? tile->lo : c0, c1 = c0 + S - 1 < tile->posl ? c0 + S - 1 : tile->posl;
            const int build = !(PF_GROUP_VALUES && a == built_a && c1 - a + 1 == built_n);
            if (PF_HALF && tile->nq <= 16)
                split_bf16(j, tile, c0, qp, o, ml, s, pp, vp, build, fetched, nd, 1);
            else
                split_bf16(j, tile, c0, qp, o, ml, s, pp, vp, build, fetched, nd, 2);
            built_a = a;
            built_n = c1 - a + 1;
            if (c1 > fetched) fetched = c1;
        }
    }
    for (int t = 0; t < nt; t++) {
        const float *o = mine + t * per + (int64_t)P * PF_QT, *ml = o + (int64_t)D * PF_QT;
        const __m512 l[2] = {_mm512_loadu_ps(ml + PF_QT), _mm512_loadu_ps(ml + PF_QT + 16)};
        tile_store(j, o, l, r, h, (t0 + t) * PF_QT, tl[t].nq, nd);
    }
}

static void prefill_item_bf16(const job_t *j, int r, int h, int t0, int nt, char *scratch) {
    if (j->dim == 64)
        prefill_group_bf16(j, r, h, t0, nt, scratch, 4);
    else if (j->dim == 128)
        prefill_group_bf16(j, r, h, t0, nt, scratch, 8);
    else
        prefill_group_bf16(j, r, h, t0, nt, scratch, j->dim / 16);
}
#define PREFILL_BF16_BUILT 1
#else
#define PREFILL_BF16_BUILT 0
static void prefill_item_bf16(const job_t *j, int r, int h, int t0, int nt, char *scratch) {} /* never called: no AVX512-BF16 */
#endif

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
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* fast_exp over 8 lanes: fast_exp16's polynomial and rounding, 2^n applied through the exponent bits (as fast_exp). */
static inline __m256 fast_exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 elements of a pool side from element `at`, as floats. */
static inline __m256 load8(const void *base, int64_t at, const int bf) {
    if (!bf) return _mm256_loadu_ps((const float *)base + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 x) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline float hmax8(__m256 x) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

/* round_bf16 over 8 lanes. */
static inline __m256 round_bf16_8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* run_item16 with 8-lane vectors (AVX2 and FMA, no AVX-512), for head dims that are a multiple of 8 (nd = dim / 8
 * vectors per key): the same online softmax over the same splits, keys and values addressed block by block, each
 * key's score one vector dot reduced once, a split's exps 8 at a time (the lanes past the split's end zeroed). */
static inline __attribute__((always_inline)) void run_item8(const job_t *j, int r, int g, const int nd, const int bf) {
    const int D = j->dim, G = j->hq / j->hkv;
    const int ql = j->q_len[r], kv = j->kv_len[r], qs = j->q_start[r], S = split_size(j, kv);
    const int32_t *table = j->tables + (int64_t)r * j->table_stride;
    const int64_t head_base = (int64_t)g * j->pool_blocks * j->bs * D;
    float s[MAX_SPLIT + 8];
    __m256 qv[MAX_DIM / 8], acc[MAX_DIM / 8];
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < ql; i++) {
        const int pos = kv - ql + i;
        const int lo = (j->window > 0 && pos - j->window + 1 > 0) ? pos - j->window + 1 : 0;
        for (int hh = 0; hh < G; hh++) {
            const int h = g * G + hh;
            const float *qp = j->q + (int64_t)(qs + i) * j->q_st + (int64_t)h * j->q_sh;
            for (int c = 0; c < nd; c++) {
                qv[c] = _mm256_loadu_ps(qp + 8 * c);
                acc[c] = _mm256_setzero_ps();
            }
            float m = -INFINITY, l = 0.0f;
            for (int c0 = (lo / S) * S; c0 <= pos; c0 += S) {
                const int a = lo > c0 ? lo : c0, c1 = c0 + S - 1 < pos ? c0 + S - 1 : pos, n = c1 - a + 1;
                for (int p = a; p <= c1;) { /* block by block: a block's keys lie D elements apart */
                    const int end = p - p % j->bs + j->bs - 1 < c1 ? p - p % j->bs + j->bs - 1 : c1;
                    prefetch_at(j, table, head_base, p, lo, pos, bf ? 2 : 4);
                    for (int64_t at = key_at(j, table, head_base, p); p <= end; p++, at += D) {
                        __m256 x = _mm256_mul_ps(qv[0], load8(j->kpool, at, bf));
                        for (int c = 1; c < nd; c++) x = _mm256_fmadd_ps(qv[c], load8(j->kpool, at + 8 * c, bf), x);
                        float sc = hsum8(x) * j->scale;
                        if (j->softcap > 0.0f) sc = j->softcap * tanhf(sc / j->softcap);
                        s[p - a] = sc;
                    }
                }
                for (int t = n; t < n + 8; t++) s[t] = -INFINITY; /* the last vector's lanes past the split */
                __m256 mx = _mm256_set1_ps(-INFINITY);
                for (int t = 0; t < n; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
                const float bm = hmax8(mx);
                if (bm > m) {
                    const float c = fast_exp(m - bm);
                    l *= c;
                    for (int d = 0; d < nd; d++) acc[d] = _mm256_mul_ps(acc[d], _mm256_set1_ps(c));
                    m = bm;
                }
                __m256 lsum = _mm256_setzero_ps();
                for (int t = 0; t < n; t += 8) {
                    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), iota));
                    const __m256 e =
                        _mm256_and_ps(live, fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m))));
                    lsum = _mm256_add_ps(lsum, e);
                    _mm256_storeu_ps(s + t, bf ? round_bf16_8(e) : e);
                }
                l += hsum8(lsum);
                for (int p = a; p <= c1;) {
                    const int end = p - p % j->bs + j->bs - 1 < c1 ? p - p % j->bs + j->bs - 1 : c1;
                    for (int64_t at = key_at(j, table, head_base, p); p <= end; p++, at += D) {
                        const __m256 w = _mm256_set1_ps(s[p - a]);
                        for (int c = 0; c < nd; c++) acc[c] = _mm256_fmadd_ps(w, load8(j->vpool, at + 8 * c, bf), acc[c]);
                    }
                }
            }
            float *o = j->out + ((int64_t)(qs + i) * j->hq + h) * D;
            const __m256 inv = _mm256_set1_ps(1.0f / l);
            for (int c = 0; c < nd; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], inv));
        }
    }
}

static inline __attribute__((always_inline)) void item_as(const job_t *j, int r, int g, const int bf) {
    if (j->dim == 64)
        run_item8(j, r, g, 8, bf); /* the common head dims, unrolled with their accumulators in registers */
    else if (j->dim == 128)
        run_item8(j, r, g, 16, bf);
    else if (j->dim % 8 == 0)
        run_item8(j, r, g, j->dim / 8, bf);
    else
        run_item(j, r, g, bf);
}

/* The float32 prefill path with 8-lane vectors: prefill_group_f32's tiles of 32 queries (four 8-lane quarters; a
 * tile of at most 8 or 16 queries computes one or two), groups of tiles over the same splits, scores by FMAs summed
 * over the head dim in order, the split's max, exps and sums, and the values weighted in key order: per query and
 * output element the AVX-512 build's arithmetic in its order. Fewer registers: KB8 keys per score block (8 / quarters),
 * the values weighted for two queries at a time over 32 output elements. */
#define AI __attribute__((always_inline))

/* The lanes of quarter v of a tile key mask, as a vector mask. */
static inline __m256 mask8(uint32_t mk, int v) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32((int)((mk >> (8 * v)) & 0xFFu)), bits);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bits));
}

/* The scores of KB keys against the first nv quarters of a tile's queries (`qt`, [D][32]) into acc: the keys at k0,
 * k0 + D, ... when k0 is given, else at kr[u]. */
static inline AI void scores8(__m256 (*acc)[4], const float *qt, const float *k0, const float *const *kr, const int D,
                              const int nv, const int KB) {
    for (int u = 0; u < KB; u++)
        for (int v = 0; v < nv; v++) acc[u][v] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m256 qd[4];
        for (int v = 0; v < nv; v++) qd[v] = _mm256_loadu_ps(qt + d * PF_QT + 8 * v);
        for (int u = 0; u < KB; u++) {
            const __m256 kd = _mm256_broadcast_ss(k0 ? k0 + u * D + d : kr[u] + d);
            for (int v = 0; v < nv; v++) acc[u][v] = _mm256_fmadd_ps(qd[v], kd, acc[u][v]);
        }
    }
}

/* store_scores with quarters: `un` keys' scaled scores into s ([k][32]) and the running max over the keys each query
 * sees into mx. */
static inline AI void store_scores8(const job_t *j, const tile_t *t, __m256 (*acc)[4], int un, int a, int kb,
                                    float *s, __m256 mx[4], const int nv) {
    const __m256 scale = _mm256_set1_ps(j->scale);
    for (int u = 0; u < un; u++) {
        const uint32_t mk = tile_key_mask(j, t, a + kb + u);
        for (int v = 0; v < nv; v++) {
            const __m256 sc = _mm256_mul_ps(acc[u][v], scale);
            _mm256_storeu_ps(s + (int64_t)(kb + u) * PF_QT + 8 * v, sc);
            mx[v] = _mm256_blendv_ps(mx[v], _mm256_max_ps(mx[v], sc), mask8(mk, v));
        }
    }
}

/* Two (gq) queries' accumulators `o` ([gq][D]) over output elements x0 .. x0 + 8 cw - 1: scaled by `c`, plus the
 * probabilities `pr` ([n][32]) times the value rows at `vo`, in key order. */
static inline AI void pv_chunk8(float *o, const float *c, const float *pr, const float *vpool, const int64_t *vo,
                                int n, const int D, int x0, const int gq, const int cw) {
    __m256 acc[2][4];
    for (int q = 0; q < gq; q++) {
        const __m256 cq = _mm256_set1_ps(c[q]);
        for (int x = 0; x < cw; x++) acc[q][x] = _mm256_mul_ps(_mm256_loadu_ps(o + (int64_t)q * D + x0 + 8 * x), cq);
    }
    for (int k = 0; k < n; k++) {
        const float *vr = vpool + vo[k] + x0;
        __m256 vz[4];
        for (int x = 0; x < cw; x++) vz[x] = _mm256_loadu_ps(vr + 8 * x);
        for (int q = 0; q < gq; q++) {
            const __m256 p = _mm256_broadcast_ss(pr + (int64_t)k * PF_QT + q);
            for (int x = 0; x < cw; x++) acc[q][x] = _mm256_fmadd_ps(p, vz[x], acc[q][x]);
        }
    }
    for (int q = 0; q < gq; q++)
        for (int x = 0; x < cw; x++) _mm256_storeu_ps(o + (int64_t)q * D + x0 + 8 * x, acc[q][x]);
}

static inline AI void pv8(float *o, const float *c, const float *pr, const float *vpool, const int64_t *vo, int n,
                          const int D, const int gq) {
    int x0 = 0;
    for (; D - x0 >= 32; x0 += 32) pv_chunk8(o, c, pr, vpool, vo, n, D, x0, gq, 4);
    if (x0 < D) pv_chunk8(o, c, pr, vpool, vo, n, D, x0, gq, 2); /* D is a multiple of 16 */
}

/* One split (keys from c0) of a tile: split_f32 with quarters (see above). */
static inline AI void split8(const job_t *j, const tile_t *tile, int c0, const float *qt, float *o, float *ml,
                             float *s, int64_t *vo, int fetched, const int D, const int nv) {
    const int KB = 8 / nv;
    const int nq = tile->nq, S = tile->S, lo = tile->lo, posl = tile->posl;
    const int32_t *table = tile->table;
    const int64_t head_base = tile->head_base;
    const float *kpool = (const float *)j->kpool, *vpool = (const float *)j->vpool;
    const int a = lo > c0 ? lo : c0, c1 = c0 + S - 1 < posl ? c0 + S - 1 : posl, n = c1 - a + 1;
    __m256 m[4], l[4], mx[4], esum[4];
    for (int v = 0; v < nv; v++) {
        m[v] = _mm256_loadu_ps(ml + 8 * v);
        l[v] = _mm256_loadu_ps(ml + PF_QT + 8 * v);
        mx[v] = _mm256_set1_ps(-INFINITY);
    }
    float cs[PF_QT];
    for (int kb = 0; kb < n; kb += KB) {
        for (int u = 0; u < KB && a + kb + u <= c1; u++) /* at each block the keys ahead, its values */
            if (PF_PREFETCH && a + kb + u > fetched && ((a + kb + u) % j->bs == 0 || kb + u == 0))
                prefetch_at(j, table, head_base, a + kb + u, lo, posl, 4);
        __m256 acc[8][4];
        const int p0 = a + kb;
        if (p0 % j->bs + KB <= j->bs && p0 + KB - 1 <= c1) /* the KB keys lie in one block, in order */
            scores8(acc, qt, kpool + key_at(j, table, head_base, p0), NULL, D, nv, KB);
        else {
            const float *kr[8];
            for (int u = 0; u < KB; u++) kr[u] = kpool + key_at(j, table, head_base, p0 + u <= c1 ? p0 + u : c1);
            scores8(acc, qt, NULL, kr, D, nv, KB);
        }
        store_scores8(j, tile, acc, n - kb < KB ? n - kb : KB, a, kb, s, mx, nv);
    }
    for (int v = 0; v < nv; v++) { /* split_rescale */
        const __m256 mn = _mm256_max_ps(m[v], mx[v]);
        const __m256 up = _mm256_cmp_ps(mn, m[v], _CMP_GT_OQ);
        const __m256 c = _mm256_blendv_ps(_mm256_set1_ps(1.0f), fast_exp8(_mm256_sub_ps(m[v], mn)), up);
        l[v] = _mm256_mul_ps(l[v], c);
        _mm256_storeu_ps(cs + 8 * v, c);
        m[v] = mn;
        esum[v] = _mm256_setzero_ps();
    }
    for (int k = 0; k < n; k++) {
        const uint32_t mk = tile_key_mask(j, tile, a + k);
        for (int v = 0; v < nv; v++) {
            float *sk = s + (int64_t)k * PF_QT + 8 * v;
            const __m256 e = _mm256_and_ps(mask8(mk, v), fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(sk), m[v])));
            esum[v] = _mm256_add_ps(esum[v], e);
            _mm256_storeu_ps(sk, e);
        }
        vo[k] = key_at(j, table, head_base, a + k);
    }
    for (int v = 0; v < nv; v++) {
        l[v] = _mm256_add_ps(l[v], esum[v]);
        _mm256_storeu_ps(ml + 8 * v, m[v]);
        _mm256_storeu_ps(ml + PF_QT + 8 * v, l[v]);
    }
    float ones[PF_QT];
    for (int i = 0; i < PF_QT; i++) ones[i] = 1.0f;
    const int kstep = PF_PVB > 0 ? PF_PVB : n;
    for (int k0 = 0; k0 < n; k0 += kstep) { /* every query pair over a block of values while they are in L1 */
        const int kn = n - k0 < kstep ? n - k0 : kstep;
        const float *c = k0 == 0 ? cs : ones; /* scaled once per split; x 1.0 after: the same bits */
        const float *pk = s + (int64_t)k0 * PF_QT;
        int i = 0;
        for (; nq - i >= 2; i += 2) pv8(o + (int64_t)i * D, c + i, pk + i, vpool, vo + k0, kn, D, 2);
        if (i < nq) pv8(o + (int64_t)i * D, c + i, pk + i, vpool, vo + k0, kn, D, 1);
    }
}

/* prefill_group_f32 with quarters: tiles t0 .. t0 + nt - 1 of row r, query head h, split by split. */
static inline AI void prefill_group8(const job_t *j, int r, int h, int t0, int nt, char *scratch, const int D) {
    tile_t tl[PF_GROUP];
    for (int t = 0; t < nt; t++) tl[t] = tile_at(j, r, h, (t0 + t) * PF_QT);
    const int S = tl[0].S;
    float *s = (float *)scratch;                       /* [S][32] scores, then exps */
    int64_t *vo = (int64_t *)(s + (int64_t)S * PF_QT); /* [S] the split's value rows */
    float *mine = (float *)(vo + S);                   /* per tile: qt [D][32], o [32][D], ml [2][32] */
    const int64_t per = (int64_t)2 * D * PF_QT + 2 * PF_QT;
    int c_lo = INT32_MAX, c_hi = -1;
    for (int t = 0; t < nt; t++) {
        float *qt = mine + t * per, *o = qt + (int64_t)D * PF_QT, *ml = o + (int64_t)D * PF_QT;
        const int i0 = (t0 + t) * PF_QT;
        for (int i = 0; i < PF_QT; i++) {
            const float *qv =
                i < tl[t].nq ? j->q + (int64_t)(tl[t].qs + i0 + i) * j->q_st + (int64_t)h * j->q_sh : NULL;
            for (int d = 0; d < D; d++) qt[d * PF_QT + i] = qv ? qv[d] : 0.0f; /* past the row's end: zeros */
            ml[i] = -INFINITY;
            ml[PF_QT + i] = 0.0f;
        }
        memset(o, 0, sizeof(float) * PF_QT * D);
        if ((tl[t].lo / S) * S < c_lo) c_lo = (tl[t].lo / S) * S;
        if (tl[t].posl > c_hi) c_hi = tl[t].posl;
    }
    for (int c0 = c_lo; c0 <= c_hi; c0 += S) {
        int fetched = -1; /* the last key an earlier tile of the group read in this split */
        for (int t = 0; t < nt; t++) {
            const tile_t *tile = &tl[t];
            if (c0 < (tile->lo / S) * S || c0 > tile->posl) continue;
            float *qt = mine + t * per, *o = qt + (int64_t)D * PF_QT, *ml = o + (int64_t)D * PF_QT;
            if (tile->nq <= 8)
                split8(j, tile, c0, qt, o, ml, s, vo, fetched, D, 1);
            else if (tile->nq <= 16)
                split8(j, tile, c0, qt, o, ml, s, vo, fetched, D, 2);
            else
                split8(j, tile, c0, qt, o, ml, s, vo, fetched, D, 4);
            const int c1 = c0 + S - 1 < tile->posl ? c0 + S - 1 : tile->posl;
            if (c1 > fetched) fetched = c1;
        }
    }
    for (int t = 0; t < nt; t++) { /* tile_store */
        const float *o = mine + t * per + (int64_t)D * PF_QT, *ml = o + (int64_t)D * PF_QT;
        const int i0 = (t0 + t) * PF_QT, qs = j->q_start[r];
        for (int i = 0; i < tl[t].nq; i++) {
            float *dst = j->out + ((int64_t)(qs + i0 + i) * j->hq + h) * D;
            const __m256 inv = _mm256_set1_ps(1.0f / ml[PF_QT + i]);
            for (int x = 0; x < D; x += 8)
                _mm256_storeu_ps(dst + x, _mm256_mul_ps(_mm256_loadu_ps(o + (int64_t)i * D + x), inv));
        }
    }
}

static void prefill_item_f32(const job_t *j, int r, int h, int t0, int nt, char *scratch) {
    if (j->dim == 64)
        prefill_group8(j, r, h, t0, nt, scratch, 64);
    else if (j->dim == 128)
        prefill_group8(j, r, h, t0, nt, scratch, 128);
    else
        prefill_group8(j, r, h, t0, nt, scratch, j->dim);
}
#define PREFILL_BF16_BUILT 0
#define PREFILL_8LANE 1
static void prefill_item_bf16(const job_t *j, int r, int h, int t0, int nt, char *scratch) {} /* never called */
#undef AI
#else
static inline __attribute__((always_inline)) void item_as(const job_t *j, int r, int g, const int bf) {
    run_item(j, r, g, bf);
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* 1: the float32 prefill path is built (AVX-512 or AVX2 with FMA); | 2: the bfloat16 one too (AVX512-BF16); | 4: it
 * is the 8-lane build (AVX2: attention.PREFILL_MAX_QUERIES_8LANE). */
#ifndef PREFILL_8LANE
#define PREFILL_8LANE 0
#endif
int paged_prefill_available(void) { return 1 | (PREFILL_BF16_BUILT ? 2 : 0) | (PREFILL_8LANE ? 4 : 0); }

int64_t paged_prefill_scratch(int dim, int split) { return prefill_scratch(dim, split); }

/* Work items (row, query head, tile of 32 queries) of the prefill rows over both threads; -1 for shapes it does not
 * serve (a head dim not a multiple of 16 or over 256, a split over MAX_SPLIT, a soft-cap, too little scratch). */
static int prefill_run(const job_t *j, int threads, char *scratch, int64_t scratch_bytes, int bf) {
    if (j->dim % 16 != 0 || j->dim > PF_MAX_DIM || j->split < 1 || j->split > MAX_SPLIT || j->softcap > 0.0f ||
        j->hkv <= 0 || j->hq % j->hkv != 0 || threads < 1 ||
        scratch_bytes < (int64_t)threads * prefill_scratch(j->dim, j->split) || (bf && !PREFILL_BF16_BUILT))
        return -1;
    const int32_t *q_len = j->q_len;
    const int hq = j->hq, G = PF_GROUP; /* tiles per work item */
    int items = 0;
    for (int r = 0; r < j->rows; r++) items += hq * ((q_len[r] + G * PF_QT - 1) / (G * PF_QT));
    const int n = threads < items ? threads : items;
    const int64_t per = prefill_scratch(j->dim, j->split);
#pragma omp parallel for schedule(dynamic, 1) num_threads(n > 0 ? n : 1)
    for (int it = 0; it < items; it++) {
        int r = 0, rest = it;
        while (rest >= hq * ((q_len[r] + G * PF_QT - 1) / (G * PF_QT)))
            rest -= hq * ((q_len[r++] + G * PF_QT - 1) / (G * PF_QT));
        const int tiles = (q_len[r] + PF_QT - 1) / PF_QT, groups = (tiles + G - 1) / G;
        const int h = rest / groups, t0 = (rest % groups) * G;
        char *mine = scratch + (int64_t)omp_get_thread_num() * per;
        if (bf)
            prefill_item_bf16(j, r, h, t0, tiles - t0 < G ? tiles - t0 : G, mine);
        else
            prefill_item_f32(j, r, h, t0, tiles - t0 < G ? tiles - t0 : G, mine);
    }
    return 0;
}

/* Attention of prefill rows (many new tokens each), with the arguments of paged_attention_bf16 (float32 queries
 * holding bfloat16 values) and `scratch`: `threads` * paged_prefill_scratch(dim, split) bytes. 0, or -1 (above). */
int paged_prefill_bf16(const float *q, int64_t q_st, int64_t q_sh, const uint16_t *kpool, const uint16_t *vpool,
                       int64_t pool_blocks, int bs, int dim, int hkv, int hq, const int32_t *tables,
                       int64_t table_stride, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                       int rows, float scale, float softcap, int window, int split, float *out, int threads,
                       char *scratch, int64_t scratch_bytes) {
    const job_t j = {q,     q_st,    q_sh,  kpool, vpool,   pool_blocks, bs,     dim,   hkv,   hq,  tables,
                     table_stride, q_start, q_len, kv_len, rows, scale, softcap, window, split, out};
    return prefill_run(&j, threads, scratch, scratch_bytes, 1);
}

/* The same over float32 pools. */
int paged_prefill_f32(const float *q, int64_t q_st, int64_t q_sh, const float *kpool, const float *vpool,
                      int64_t pool_blocks, int bs, int dim, int hkv, int hq, const int32_t *tables,
                      int64_t table_stride, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                      int rows, float scale, float softcap, int window, int split, float *out, int threads,
                      char *scratch, int64_t scratch_bytes) {
    const job_t j = {q,     q_st,    q_sh,  kpool, vpool,   pool_blocks, bs,     dim,   hkv,   hq,  tables,
                     table_stride, q_start, q_len, kv_len, rows, scale, softcap, window, split, out};
    return prefill_run(&j, threads, scratch, scratch_bytes, 0);
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
    /* dynamic: rows of unequal lengths, and a thread the OS takes away (a serving process shares its cores with its
       HTTP thread and, in benchmarks, the clients), no longer hold the whole call back; outputs are identical */
#pragma omp parallel for schedule(dynamic, 1) num_threads(n > 0 ? n : 1)
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

#if !(defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
int paged_prefill_available(void) { return 0; }

int64_t paged_prefill_scratch(int dim, int split) { return 0; }

int paged_prefill_bf16(const float *q, int64_t q_st, int64_t q_sh, const uint16_t *kpool, const uint16_t *vpool,
                       int64_t pool_blocks, int bs, int dim, int hkv, int hq, const int32_t *tables,
                       int64_t table_stride, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                       int rows, float scale, float softcap, int window, int split, float *out, int threads,
                       char *scratch, int64_t scratch_bytes) {
    return -1; /* this CPU (or compiler target) has neither AVX-512 nor AVX2 with FMA: the torch path */
}

int paged_prefill_f32(const float *q, int64_t q_st, int64_t q_sh, const float *kpool, const float *vpool,
                      int64_t pool_blocks, int bs, int dim, int hkv, int hq, const int32_t *tables,
                      int64_t table_stride, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                      int rows, float scale, float softcap, int window, int split, float *out, int threads,
                      char *scratch, int64_t scratch_bytes) {
    return -1;
}
#endif
