/* Paged decode attention over a bfloat16 pool, reading K/V straight from the blocks through the block tables:
 * paged_decode.c's walk (one item is a sequence, or one KV head of a sequence when there are few; scores, softmax,
 * weighted V; each K and V row read once for all the query heads that share it).
 *
 * Layouts (bfloat16 stored as uint16_t, contiguous):
 *   query      [seqs, heads, dim]
 *   key/value  [num_blocks, block_size, kv_heads, dim]
 *   tables     int64 [seqs, table_stride]: logical block i of sequence s is physical block tables[s * stride + i]
 *   lens       int64 [seqs]: context length, the query's own position included
 *   out        [seqs, heads, dim]
 *
 * With AVX-512 BF16 the arithmetic is torch's own CPU flash attention for one query row (the kernel transformers'
 * SDPA reaches in bfloat16), operation for operation, so that a greedy decode keeps transformers' tokens: a model
 * with random weights has near-ties in its logits, and one unit in the last place of an attention output was enough
 * to change a token within the first few (docs/engine.md, "bfloat16"). What torch 2.13 does there was read off its
 * output bits, with inputs built so that each order of a sum gives another answer (2^24 + 1 - 2^24), and off the
 * instructions of its build (its two GEMMs are MKL's bfloat16 gemv kernels):
 *   - a score is the bfloat16 q . k by vdpbf16ps, 32 dims a step into one sixteen-lane sum, whose lanes are then
 *     added as (i, i + 8), then neighbours, then pairs of those, then the two halves; scaled after, in float32;
 *   - the keys go in chunks of 512 (torch's kvSplitSize); in each, e^(score - max) by ATen's fexp_u20 for whole
 *     vectors of sixteen, summed as torch's build sums them (two vectors at a time into two accumulators, a last
 *     whole vector into a third, then (first + third) + second, then ATen's shuffle tree), and by the C library's
 *     exp in double for the rest, added one by one after; each rounded to bfloat16 before it weights V;
 *   - the weighted V is vdpbf16ps over pairs of consecutive keys, each eight keys summed from zero and then added
 *     to the total; a later chunk rescales the total by expf(old max - new max) first, and its sum of
 *     exponentials joins the old one by a fused multiply-add;
 *   - the output is the total times 1 / the sum, rounded to bfloat16 once.
 * Without AVX-512 BF16, for a head size that is not a multiple of 32, and on processors other than Intel's (where
 * MKL may run other code: engine/native/__init__.py turns the order off there), the rows are widened to float32 and summed
 * in float32 in an order of this file's own (the same rounding steps, not the same bits).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "simd.h"

/* q (float32, already widened) . k (bfloat16 row) over dim */
static inline float dot_bf16(const float *restrict q, const uint16_t *restrict k, int dim) {
    v16 part = {0};
    int d = 0;
    for (; d + 16 <= dim; d += 16) part += *(const v16 *)(q + d) * widen16(k + d);
    v8 p8 = __builtin_shufflevector(part, part, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(part, part, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 p4 = __builtin_shufflevector(p8, p8, 0, 1, 2, 3) + __builtin_shufflevector(p8, p8, 4, 5, 6, 7);
    float acc = (p4[0] + p4[2]) + (p4[1] + p4[3]);
    for (; d < dim; d++) acc += q[d] * widen(k[d]);
    return acc;
}

static inline void prefetch_row(const uint16_t *row, int values) {
    for (int f = 0; f < values; f += 32) __builtin_prefetch(row + f);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TORCH_ORDER 1
#define KV_SPLIT 512 /* torch's kvSplitSize: keys per chunk of its online softmax */

typedef uint16_t v32h __attribute__((vector_size(64), aligned(2)));
/* the weights are written over the float32 scores they come from, and read back as pairs: types that may alias */
typedef uint16_t u16a __attribute__((may_alias));
typedef uint32_t u32a __attribute__((may_alias));
typedef uint16_t v16ha __attribute__((vector_size(32), aligned(2), may_alias));

/* ATen's fexp_u20 (Vectorized<float>, AVX-512): 2^(x log2 e) from a cubic in the fraction, the result's bits made
 * by one fused multiply-add and a truncation; below ln(FLT_MIN) 0. The operations and their fusing are torch's. */
static inline __m512 fexp_u20(__m512 x) {
    const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32((int)0xc2aeac50)),
                                               _CMP_LT_OS);
    const __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218)), _CMP_GT_OS);
    __m512 y = _mm512_mul_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b))); /* x log2(e) */
    const __m512 fraction = _mm512_sub_ps(y, _mm512_floor_ps(y));
    __m512 poly = _mm512_fmadd_ps(fraction, _mm512_set1_ps(-0.079204240219773236f),
                                  _mm512_set1_ps(-0.22433836478672356f));
    poly = _mm512_fmadd_ps(fraction, poly, _mm512_set1_ps(0.30354260500649682f));
    poly = _mm512_fmadd_ps(fraction, poly, _mm512_set1_ps(0.00010703434948458272f));
    y = _mm512_sub_ps(y, poly);
    __m512i bits = _mm512_cvttps_epi32(_mm512_fmadd_ps(_mm512_set1_ps(8388608.0f), y,
                                                       _mm512_set1_ps(8388608.0f * 127.0f)));
    bits = _mm512_mask_mov_epi32(bits, below, _mm512_setzero_si512());
    bits = _mm512_mask_mov_epi32(bits, above, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(bits);
}

/* sixteen lanes folded to eight, lane i with lane i + 8: the first step of both sums below */
static inline v8 fold8(__m512 lanes) {
    const v16 l = (v16)lanes;
    return __builtin_shufflevector(l, l, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(l, l, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* one score's sixteen lanes added as torch's bfloat16 GEMM for one row adds them: (i, i + 8), neighbours, pairs */
static inline float score_lanes(__m512 lanes) {
    const v8 t = fold8(lanes);
    const v4 u = __builtin_shufflevector(t, t, 0, 2, 4, 6) + __builtin_shufflevector(t, t, 1, 3, 5, 7);
    return (u[0] + u[1]) + (u[2] + u[3]);
}

/* ATen's vec_reduce_all for a sum of sixteen lanes: lane i with i ^ 8, then ^ 4, ^ 2, ^ 1 */
static inline float aten_sum(__m512 lanes) {
    const v8 t = fold8(lanes);
    const v4 u = __builtin_shufflevector(t, t, 0, 1, 2, 3) + __builtin_shufflevector(t, t, 4, 5, 6, 7);
    return (u[0] + u[2]) + (u[1] + u[3]);
}

/* sixteen float32 values rounded to bfloat16 (bf16.h's narrow16, as a value) */
static inline v16ha narrow16v(v16 x) {
    const v16u u = (v16u)x;
    return __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, v16ha);
}

/* e^(s - top) over one chunk's n scores, as torch's build computes them: ATen's fexp_u20 for whole vectors of
 * sixteen, summed two vectors at a time into two accumulators and a last whole vector into a third, then (first +
 * third) + second and ATen's shuffle tree; the C library's exp in double for the rest, added one by one. Writes
 * each weight rounded to bfloat16 to p, which may be s itself (a weight is written after its score is read, and
 * never over a score still to be read); returns the float32 sum of the unrounded weights. */
static float softmax_chunk(const float *s, u16a *p, int64_t n, float top) {
    const __m512 m = _mm512_set1_ps(top);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(), last = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 e0 = fexp_u20(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
        const __m512 e1 = fexp_u20(_mm512_sub_ps(_mm512_loadu_ps(s + i + 16), m));
        even = _mm512_add_ps(even, e0);
        odd = _mm512_add_ps(odd, e1);
        *(v16ha *)(p + i) = narrow16v((v16)e0);
        *(v16ha *)(p + i + 16) = narrow16v((v16)e1);
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 e = fexp_u20(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
        last = _mm512_add_ps(last, e);
        *(v16ha *)(p + i) = narrow16v((v16)e);
    }
    float sum = aten_sum(_mm512_add_ps(_mm512_add_ps(even, last), odd));
    for (; i < n; i++) { /* torch calls exp on the float: the double one */
        const float e = (float)exp((double)(s[i] - top));
        sum += e;
        p[i] = narrow(e);
    }
    return sum;
}

/* One chunk of a head's softmax, starting at key `begin` of the row, with the row's running maximum *top and sum
 * *total (both unset before the first chunk): the chunk's weights over its scores (softmax_chunk), the maximum so
 * far, and the sum joined as torch's build joins it (qk_sum = tmp_sum + exp_tmp * qk_sum, one fused multiply-add).
 * Returns the factor the weighted V so far is to be scaled by (1 for the first chunk). */
static float softmax_join(const float *s, u16a *p, int64_t n, int64_t begin, float chunk_top, float *top,
                          float *total) {
    const float top_now = begin == 0 || chunk_top > *top ? chunk_top : *top;
    const float sum = softmax_chunk(s, p, n, top_now);
    float rescale = 1.0f;
    if (begin == 0) {
        *total = sum;
    } else {
        rescale = expf(*top - top_now);
        *total = fmaf(rescale, *total, sum);
    }
    *top = top_now;
    return rescale;
}

/* The row of key t (KV head 0 of the item's first) in a cache: slot t % block_size of block table[t / block_size] */
static inline const uint16_t *key_row(const uint16_t *cache, const int64_t *table, int64_t t, int block_size,
                                      int64_t row, int first, int dim) {
    return cache + (table[t / block_size] * block_size + t % block_size) * row + (int64_t)first * dim;
}

/* One item in torch's order (the header): KV heads [first, first + count) of one sequence, dim a multiple of 32.
 * Scratch: scores of at least (min(len, 512) rounded up to 16) * count * group floats (each head's row holds its
 * bfloat16 weights after the softmax, written over the scores as they are read) and acc of count * group * dim
 * floats (paged_decode.c's q scratch goes unused: q stays bfloat16). */
__attribute__((optimize("fp-contract=off")))
static void attend_item_torch(const uint16_t *restrict query, const uint16_t *restrict key_cache,
                              const uint16_t *restrict value_cache, const int64_t *restrict table, int64_t len,
                              uint16_t *restrict out, float *restrict scores, float *restrict acc, int group,
                              int kv_heads, int first, int count, int dim, int block_size, float scale) {
    const int heads = count * group;
    const int64_t row = (int64_t)kv_heads * dim;
    const int steps = dim / 32, vectors = dim / 16;
    const uint16_t *query_item = query + (int64_t)first * group * dim;
    float top[MAX_HEADS], total[MAX_HEADS];
    memset(acc, 0, sizeof(float) * heads * dim);
    for (int64_t begin = 0; begin < len; begin += KV_SPLIT) {
        const int64_t n = len - begin < KV_SPLIT ? len - begin : KV_SPLIT;
        const int64_t stride = (n + 15) / 16 * 16;
        float chunk_top[MAX_HEADS];
        for (int h = 0; h < heads; h++) chunk_top[h] = -INFINITY;
        /* pass 1: scores [heads, n] */
        const uint16_t *next = key_row(key_cache, table, begin, block_size, row, first, dim);
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *k = next; /* this key's row, found a key ahead to be fetched */
            if (t + 1 < n) prefetch_row(next = key_row(key_cache, table, begin + t + 1, block_size, row, first, dim),
                                        count * dim);
            for (int c = 0; c < count; c++) {
                for (int g = 0; g < group; g++) {
                    const int h = c * group + g;
                    const uint16_t *q = query_item + h * dim;
                    __m512 lanes = _mm512_setzero_ps();
                    for (int j = 0; j < steps; j++)
                        lanes = _mm512_dpbf16_ps(lanes, (__m512bh)_mm512_loadu_si512(k + c * dim + 32 * j),
                                                 (__m512bh)_mm512_loadu_si512(q + 32 * j));
                    const float v = score_lanes(lanes) * scale;
                    scores[h * stride + t] = v;
                    if (v > chunk_top[h]) chunk_top[h] = v;
                }
            }
        }
        /* the softmax's weights, as bfloat16 over each head's scores; the running maximum and sum */
        for (int h = 0; h < heads; h++) {
            float *s = scores + h * stride;
            const float rescale = softmax_join(s, (u16a *)s, n, begin, chunk_top[h], &top[h], &total[h]);
            ((u16a *)s)[n] = 0; /* the pair of an odd last key */
            if (begin > 0)
                for (int d = 0; d < dim; d++) acc[h * dim + d] *= rescale;
        }
        /* pass 2: the weighted V, eight keys (four pairs) at a time summed from zero, then added to the total */
        for (int64_t g8 = 0; g8 < n; g8 += 8) {
            const int pairs = (int)((n - g8 < 8 ? n - g8 : 8) + 1) / 2;
            const uint16_t *v[8];
            for (int t = 0; t < 2 * pairs; t++)
                v[t] = g8 + t < n ? key_row(value_cache, table, begin + g8 + t, block_size, row, first, dim) : NULL;
            for (int c = 0; c < count; c++) {
                for (int dv = 0; dv < vectors; dv++) {
                    __m512i pv[4];
                    for (int j = 0; j < pairs; j++) {
                        const v16h a = *(const v16h *)(v[2 * j] + c * dim + 16 * dv);
                        const v16h b = v[2 * j + 1] ? *(const v16h *)(v[2 * j + 1] + c * dim + 16 * dv) : (v16h){0};
                        pv[j] = (__m512i)__builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                                                                 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13,
                                                                 29, 14, 30, 15, 31);
                    }
                    for (int g = 0; g < group; g++) {
                        const int h = c * group + g;
                        const u32a *w = (const u32a *)(scores + h * stride) + g8 / 2;
                        __m512 part = _mm512_setzero_ps();
                        for (int j = 0; j < pairs; j++)
                            part = _mm512_dpbf16_ps(part, (__m512bh)pv[j], (__m512bh)_mm512_set1_epi32((int)w[j]));
                        float *a = acc + h * dim + 16 * dv;
                        _mm512_storeu_ps(a, _mm512_add_ps(part, _mm512_loadu_ps(a)));
                    }
                }
            }
        }
    }
    uint16_t *dst = out + (int64_t)first * group * dim;
    for (int h = 0; h < heads; h++) {
        const float inv = 1.0f / total[h];
        for (int d = 0; d < dim; d++) dst[h * dim + d] = narrow(acc[h * dim + d] * inv);
    }
}
#else
#define TORCH_ORDER 0
#endif

/* One item: KV heads [first, first + count) of one sequence. Scratch: scores of at least (len rounded up to 16)
 * * count * group floats, q and acc of count * group * dim floats each. */
static void attend_item_bf16(const uint16_t *restrict query, const uint16_t *restrict key_cache,
                             const uint16_t *restrict value_cache, const int64_t *restrict table, int64_t len,
                             uint16_t *restrict out, float *restrict scores, float *restrict q, float *restrict acc,
                             int group, int kv_heads, int first, int count, int dim, int block_size, float scale) {
    const int heads = count * group;
    const int64_t row = (int64_t)kv_heads * dim; /* values between consecutive slots of a block */
    const int64_t stride = (len + 15) / 16 * 16;
    const uint16_t *query_item = query + (int64_t)first * group * dim;
    float top[MAX_HEADS], total[MAX_HEADS];
    for (int h = 0; h < heads; h++) {
        for (int d = 0; d < dim; d++) q[h * dim + d] = widen(query_item[h * dim + d]);
        top[h] = -INFINITY;
        for (int64_t t = len; t < stride; t++) scores[h * stride + t] = -INFINITY;
    }
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    /* pass 1: scores [heads, len], block by block through the table, the next block fetched while this one is used */
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t start = b * block_size;
        const int64_t slots = len - start < block_size ? len - start : block_size;
        const uint16_t *next = b + 1 < num_blocks ? key_cache + table[b + 1] * block_size * row + (int64_t)first * dim
                                                  : value_cache + table[0] * block_size * row + (int64_t)first * dim;
        const uint16_t *k = key_cache + table[b] * block_size * row + (int64_t)first * dim;
        for (int64_t t = 0; t < slots; t++, k += row, next += row) {
            prefetch_row(next, count * dim);
            for (int c = 0; c < count; c++) {
                for (int g = 0; g < group; g++) {
                    const int h = c * group + g;
                    const float v = dot_bf16(q + h * dim, k + c * dim, dim) * scale;
                    scores[h * stride + start + t] = v;
                    if (v > top[h]) top[h] = v;
                }
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        v16 sum = {0};
        float *s = scores + h * stride;
        for (int64_t t = 0; t < stride; t += 16) {
            const v16 e = exp16(*(v16 *)(s + t) - top[h]);
            sum += e;                      /* the denominator from the float32 exponentials */
            *(v16 *)(s + t) = round16(e); /* V is weighted by them rounded to bfloat16 */
        }
        total[h] = 0.0f;
        for (int l = 0; l < 16; l++) total[h] += sum[l];
    }
    /* pass 2: the weighted sum of V in float32, each head's sum kept in registers across a block's slots */
    memset(acc, 0, sizeof(float) * heads * dim);
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t start = b * block_size;
        const int slots = (int)(len - start < block_size ? len - start : block_size);
        const uint16_t *v = value_cache + table[b] * block_size * row + (int64_t)first * dim;
        if (b + 1 < num_blocks) {
            const uint16_t *next = value_cache + table[b + 1] * block_size * row + (int64_t)first * dim;
            for (int t = 0; t < slots; t++) prefetch_row(next + t * row, count * dim);
        }
        const float *s = scores + start;
        for (int c = 0; c < count; c++) {
            for (int g = 0; g < group; g++) {
                const int h = c * group + g;
                float *a = acc + h * dim;
                int d = 0;
                for (; d + 16 <= dim; d += 16) {
                    v16 sum0 = *(v16 *)(a + d), sum1 = {0}, sum2 = {0}, sum3 = {0};
                    const uint16_t *vd = v + c * dim + d;
                    int t = 0;
                    for (; t + 4 <= slots; t += 4) {
                        sum0 += s[h * stride + t] * widen16(vd + t * row);
                        sum1 += s[h * stride + t + 1] * widen16(vd + (t + 1) * row);
                        sum2 += s[h * stride + t + 2] * widen16(vd + (t + 2) * row);
                        sum3 += s[h * stride + t + 3] * widen16(vd + (t + 3) * row);
                    }
                    for (; t < slots; t++) sum0 += s[h * stride + t] * widen16(vd + t * row);
                    *(v16 *)(a + d) = (sum0 + sum1) + (sum2 + sum3);
                }
                for (; d < dim; d++) {
                    float sum = a[d];
                    for (int t = 0; t < slots; t++) sum += s[h * stride + t] * widen(v[t * row + c * dim + d]);
                    a[d] = sum;
                }
            }
        }
    }
    uint16_t *dst = out + (int64_t)first * group * dim;
    for (int h = 0; h < heads; h++) {
        const float inv = 1.0f / total[h];
        for (int d = 0; d < dim; d++) dst[h * dim + d] = narrow(acc[h * dim + d] * inv);
    }
}

static int torch_order = 1; /* bf16_decode_torch_order(0): the float32-widening walk, to compare the two */

/* mode 1: decode attention in torch's order where the build has AVX-512 BF16 (the default); 0: the widening walk;
 * -1: no change. Returns whether torch's order served before the call (never without AVX-512 BF16). */
int bf16_decode_torch_order(int mode) {
    const int previous = TORCH_ORDER && __atomic_load_n(&torch_order, __ATOMIC_RELAXED);
    if (mode >= 0) __atomic_store_n(&torch_order, mode ? 1 : 0, __ATOMIC_RELAXED);
    return previous;
}

/* The softmax's denominator over a whole row of n scores as the kernel computes it in torch's order: chunks of 512
 * (softmax_join, what the kernel runs for each chunk of each head); the bfloat16 weights of the last chunk in
 * weights, the sum in *sum and the maximum in *top. For tests against torch's logsumexp. Returns 1 where torch's
 * order is not built (no AVX-512 BF16), else 0. */
int bf16_softmax_row(const float *scores, int64_t n, uint16_t *weights, float *sum, float *top) {
#if TORCH_ORDER
    for (int64_t begin = 0; begin < n; begin += KV_SPLIT) {
        const int64_t count = n - begin < KV_SPLIT ? n - begin : KV_SPLIT;
        float chunk_top = -INFINITY;
        for (int64_t i = 0; i < count; i++)
            if (scores[begin + i] > chunk_top) chunk_top = scores[begin + i];
        softmax_join(scores + begin, (u16a *)weights, count, begin, chunk_top, top, sum);
    }
    return 0;
#else
    (void)scores, (void)n, (void)weights, (void)sum, (void)top;
    return 1;
#endif
}

struct decode_bf16 { /* paged_decode_bf16's arguments, for its items */
    const uint16_t *query, *key_cache, *value_cache;
    const int64_t *tables, *lens;
    int64_t table_stride;
    uint16_t *out;
    int heads, kv_heads, dim, block_size;
    float scale;
};

static void decode_item_bf16(const void *ctx, int64_t s, int first, int count, float *scores, float *q, float *acc) {
    const struct decode_bf16 *a = ctx;
#if TORCH_ORDER
    if (a->dim % 32 == 0 && __atomic_load_n(&torch_order, __ATOMIC_RELAXED)) {
        attend_item_torch(a->query + s * a->heads * a->dim, a->key_cache, a->value_cache,
                          a->tables + s * a->table_stride, a->lens[s], a->out + s * a->heads * a->dim, scores, acc,
                          a->heads / a->kv_heads, a->kv_heads, first, count, a->dim, a->block_size, a->scale);
        return;
    }
#endif
    attend_item_bf16(a->query + s * a->heads * a->dim, a->key_cache, a->value_cache, a->tables + s * a->table_stride,
                     a->lens[s], a->out + s * a->heads * a->dim, scores, q, acc, a->heads / a->kv_heads, a->kv_heads,
                     first, count, a->dim, a->block_size, a->scale);
}

/* paged_decode_bf16's part for thread t of a team (decode_stack.c); *next: the items' shared counter, zero */
int paged_decode_bf16_part(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                           const int64_t *tables, int64_t table_stride, const int64_t *lens, uint16_t *out,
                           int64_t seqs, int heads, int kv_heads, int dim, int block_size, float scale, int64_t *next,
                           int t, int nt) {
    if (!paged_decode_takes(heads, kv_heads, dim, block_size)) return 1;
    const struct decode_bf16 args = {query, key_cache, value_cache, tables, lens, table_stride, out, heads, kv_heads,
                                     dim, block_size, scale};
    return paged_decode_items_part(lens, seqs, heads, kv_heads, dim, decode_item_bf16, &args, next, t, nt);
}

/* Returns 0 on success, 1 when a shape is outside what this kernel handles, 2 when scratch memory ran out. The
 * items and their threads are paged_decode.c's (paged_decode_items). */
int paged_decode_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                      const int64_t *tables, int64_t table_stride, const int64_t *lens, uint16_t *out, int64_t seqs,
                      int heads, int kv_heads, int dim, int block_size, float scale, int threads) {
    if (!paged_decode_takes(heads, kv_heads, dim, block_size)) return 1;
    const struct decode_bf16 args = {query, key_cache, value_cache, tables, lens, table_stride, out, heads, kv_heads,
                                     dim, block_size, scale};
    return paged_decode_items(lens, seqs, heads, kv_heads, dim, threads, decode_item_bf16, &args);
}
