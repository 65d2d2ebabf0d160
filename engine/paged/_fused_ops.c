/* Fused element-wise ops of Llama-style decoder layers, for float32 and bfloat16 (`bf`) tensors: RMSNorm and the
 * rotary embedding. Each does in one pass over memory what the modeling code does in several torch ops, with the
 * same arithmetic in the same order, rounding where torch rounds:
 * - rms_norm: h = x (as float32); var = sum(h * h) / n; h = h * (1 / sqrt(var + eps)); then h rounded to the input's
 *   dtype and out = weight * h, rounded again (transformers' LlamaRMSNorm). Only the order of var's sum differs
 *   from torch's reduction.
 * - rotary: out = x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype (apply_rotary_pos_emb):
 *   bit for bit torch's, as long as nothing contracts a multiply and an add into one fma: built -ffp-contract=off.
 * - kv_write: a step's new keys and values copied into a pool layer at their slots, both sides in one call
 *   (StepBatch.write_kv, in place of index_copy_ per side).
 * All loops are plain C that the compiler vectorises (-O3 -march=native); rows split across OpenMP threads (torch's
 * own pool: the library links libgomp.so.1, as the attention kernel does) when there are enough of them.
 */
#include <stdint.h>
#include <string.h>

#define PAR_ELEMS 65536 /* below this many elements one thread does the op: OpenMP's start costs more */

static inline float bf16_to_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float -> bfloat16, round to nearest even (torch's c10::BFloat16 for finite values; NaN stays NaN). */
static inline uint16_t f_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t nan = (u >> 16) | 0x40u, rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

static inline float round_to(float f, const int bf) { return bf ? bf16_to_f(f_to_bf16(f)) : f; }

static inline float load(const void *p, int64_t i, const int bf) {
    return bf ? bf16_to_f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, const int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline __attribute__((always_inline)) void rms_norm_rows(const void *x, int64_t ldx, const void *w, void *out, int64_t ldo, int64_t r0, int64_t r1,
                          int n, float eps, const int bf) {
    for (int64_t r = r0; r < r1; r++) {
        const int64_t xo = r * ldx, oo = r * ldo;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < n; i++) {
            const float h = load(x, xo + i, bf);
            s += h * h;
        }
        const float inv = 1.0f / __builtin_sqrtf(s / (float)n + eps);
#pragma omp simd
        for (int i = 0; i < n; i++) {
            const float h = round_to(load(x, xo + i, bf) * inv, bf);
            store(out, oo + i, load(w, i, bf) * h, bf);
        }
    }
}

/* out[r][i] = RMSNorm of row r of x (rows of n elements, row strides ldx / ldo), weight w of n elements. */
int fused_rms_norm(const void *x, int64_t ldx, const void *w, void *out, int64_t ldo, int64_t rows, int n, float eps,
                   int bf, int threads) {
    if (rows * n < PAR_ELEMS || threads <= 1) {
        if (bf) rms_norm_rows(x, ldx, w, out, ldo, 0, rows, n, eps, 1);
        else rms_norm_rows(x, ldx, w, out, ldo, 0, rows, n, eps, 0);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (bf) rms_norm_rows(x, ldx, w, out, ldo, r, r + 1, n, eps, 1);
            else rms_norm_rows(x, ldx, w, out, ldo, r, r + 1, n, eps, 0);
        }
    }
    return 0;
}

typedef struct {
    const void *x, *cos, *sin;
    void *out;
    int64_t xs[3], cs[2], os[3]; /* x and out: strides of batch, head, token; cos and sin: of batch, token */
    int heads, tokens, dim;
} rot_t;

static inline __attribute__((always_inline)) void rotary_bt(const rot_t *j, int64_t b, int64_t t, const int bf) {
    const int half = j->dim / 2;
    const int64_t co = b * j->cs[0] + t * j->cs[1];
    for (int h = 0; h < j->heads; h++) {
        const int64_t xo = b * j->xs[0] + h * j->xs[1] + t * j->xs[2];
        const int64_t oo = b * j->os[0] + h * j->os[1] + t * j->os[2];
#pragma omp simd
        for (int d = 0; d < half; d++) { /* rotate_half: -x[d + half] here, x[d - half] below */
            const float a = round_to(load(j->x, xo + d, bf) * load(j->cos, co + d, bf), bf);
            const float c = round_to(-load(j->x, xo + d + half, bf) * load(j->sin, co + d, bf), bf);
            store(j->out, oo + d, a + c, bf);
        }
#pragma omp simd
        for (int d = half; d < j->dim; d++) {
            const float a = round_to(load(j->x, xo + d, bf) * load(j->cos, co + d, bf), bf);
            const float c = round_to(load(j->x, xo + d - half, bf) * load(j->sin, co + d, bf), bf);
            store(j->out, oo + d, a + c, bf);
        }
    }
}

/* out = x * cos + rotate_half(x) * sin for x of [batch][heads][tokens][dim] (strides xs, dim contiguous), cos and
 * sin of [batch][tokens][dim] (broadcast over heads), out strided os. dim must be even. */
int fused_rotary(const void *x, const int64_t *xs, const void *cos, const void *sin, const int64_t *cs, void *out,
                 const int64_t *os, int batch, int heads, int tokens, int dim, int bf, int threads) {
    if (dim % 2) return -1;
    rot_t j = {x, cos, sin, out, {xs[0], xs[1], xs[2]}, {cs[0], cs[1]}, {os[0], os[1], os[2]}, heads, tokens, dim};
    const int64_t items = (int64_t)batch * tokens;
    if (items * heads * dim < PAR_ELEMS || threads <= 1) {
        for (int64_t i = 0; i < items; i++) {
            if (bf) rotary_bt(&j, i / tokens, i % tokens, 1);
            else rotary_bt(&j, i / tokens, i % tokens, 0);
        }
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            if (bf) rotary_bt(&j, i / tokens, i % tokens, 1);
            else rotary_bt(&j, i / tokens, i % tokens, 0);
        }
    }
    return 0;
}

/* The new tokens' keys and values into a pool layer: for token i of `tokens` and head h of `heads`, the `dim`
 * elements (of `el` bytes) at k + i * k_st + h * k_sh go to kpool + (h * head_elems + slots[i] * dim) * el, and the
 * values likewise (the pool's [heads][blocks][block_size * dim] layout; slot = block * block_size + offset). A copy:
 * the same bytes as torch's index_copy_. One thread: a decode step writes a few kilobytes. */
int kv_write(const void *k, int64_t k_st, int64_t k_sh, const void *v, int64_t v_st, int64_t v_sh, void *kpool,
             void *vpool, int64_t head_elems, const int64_t *slots, int tokens, int heads, int dim, int el) {
    const int64_t row = (int64_t)dim * el;
    for (int i = 0; i < tokens; i++) {
        const int64_t at = slots[i] * dim;
        for (int h = 0; h < heads; h++) {
            const int64_t to = (h * head_elems + at) * el;
            memcpy((char *)kpool + to, (const char *)k + (i * k_st + h * k_sh) * el, (size_t)row);
            memcpy((char *)vpool + to, (const char *)v + (i * v_st + h * v_sh) * el, (size_t)row);
        }
    }
    return 0;
}
