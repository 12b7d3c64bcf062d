/* Paged decode attention over a bfloat16 pool, reading K/V straight from the blocks through the block tables:
 * paged_decode.c's walk (one item is a sequence, or one KV head of a sequence when there are few; scores, softmax,
 * weighted V; each K and V row read once for all the query heads that share it), with bfloat16 rows widened to
 * float32 as they are read and every sum kept in float32.
 *
 * Layouts (bfloat16 stored as uint16_t, contiguous):
 *   query      [seqs, heads, dim]
 *   key/value  [num_blocks, block_size, kv_heads, dim]
 *   tables     int64 [seqs, table_stride]: logical block i of sequence s is physical block tables[s * stride + i]
 *   lens       int64 [seqs]: context length, the query's own position included
 *   out        [seqs, heads, dim]
 *
 * The rounding follows torch's CPU attention for bfloat16 (the flash-attention kernel that transformers' SDPA
 * reaches), so that the engine's greedy tokens stay with transformers' bfloat16 run: scores are float32 dot products
 * of the bfloat16 q and k, scaled after; the softmax's exponentials are summed in float32 but rounded to bfloat16
 * before they weight V (torch feeds them to a bfloat16 matmul); the weighted sum is float32, divided by the sum and
 * rounded to bfloat16 once at the end.
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
