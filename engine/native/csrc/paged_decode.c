/* Paged decode attention on the CPU, reading K/V straight from the block pool through the block tables.
 *
 * Built and loaded at run time by engine/native/__init__.py (the C compiler on the machine, -O3 -march=native -fopenmp),
 * called through ctypes with raw pointers. No copy of the context's K/V is made: each item (a sequence, or one KV
 * head of a sequence when there are few) walks its sequence's blocks in logical order, wherever they lie in the pool.
 *
 * Layouts (float32, contiguous):
 *   query      [seqs, heads, dim]
 *   key/value  [num_blocks, block_size, kv_heads, dim]
 *   tables     int64 [seqs, table_stride]: logical block i of sequence s is physical block tables[s * stride + i]
 *   lens       int64 [seqs]: context length, the query's own position included
 *   out        [seqs, heads, dim]
 * Query head h reads KV head h / (heads / kv_heads).
 *
 * Per item, two passes: scores of the group's query heads against every key (each K row read once, for all the
 * heads that share it), a softmax over them, then the weighted sum of V (each V row read once). Items are spread
 * over the OpenMP team (torch's own libgomp, already loaded: the same threads torch's kernels use).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"
#include "team.h"

/* a . b over dim floats: sixteen partial sums in one vector, added up as a tree of shuffles (`omp simd reduction`
 * made GCC add the sixteen lanes one after another through the stack, most of what a score cost). */
static inline float dot(const float *restrict a, const float *restrict b, int dim) {
    v16 part = {0};
    int d = 0;
    for (; d + 16 <= dim; d += 16) part += *(const v16 *)(a + d) * *(const v16 *)(b + d);
    v8 p8 = __builtin_shufflevector(part, part, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(part, part, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 p4 = __builtin_shufflevector(p8, p8, 0, 1, 2, 3) + __builtin_shufflevector(p8, p8, 4, 5, 6, 7);
    float acc = (p4[0] + p4[2]) + (p4[1] + p4[3]);
    for (; d < dim; d++) acc += a[d] * b[d];
    return acc;
}

/* Asks for the cache lines of one slot's [floats] values ahead of their use. */
static inline void prefetch_slot(const float *slot, int floats) {
    for (int f = 0; f < floats; f += 16) __builtin_prefetch(slot + f);
}

/* The same, into L2 only: V rows wanted in the second pass, a while later. */
static inline void prefetch_slot_l2(const float *slot, int floats) {
    for (int f = 0; f < floats; f += 16) __builtin_prefetch(slot + f, 0, 2);
}

#define EARLY_V_BYTES (512 * 1024) /* an item's V at most this large is fetched during the first pass (L2: 1 MiB) */

/* One item: KV heads [first, first + count) of one sequence. Scratch: scores of at least len * count * group
 * floats, q and acc of count * group * dim each. A block's slots are read in memory order, all the item's KV heads
 * of a slot together, so a whole block of a sequence is one sequential read when the item covers every KV head
 * (reading one head's 128-byte slice of each slot instead, four items over the same blocks, ran 3x slower: every
 * scattered block cost a TLB and cache miss per head). */
static void attend_item(const float *restrict query, const float *restrict key_cache,
                        const float *restrict value_cache, const int64_t *restrict table, int64_t len,
                        int64_t begin, float *restrict out, float *restrict scores, float *restrict q,
                        float *restrict acc, int group, int kv_heads, int first, int count, int dim, int block_size,
                        float scale) {
    const int heads = count * group;   /* query heads of this item: rows of q, acc and scores */
    const int64_t row = (int64_t)kv_heads * dim; /* floats between consecutive slots of a block */
    /* positions begin..len-1 are read (begin > 0: a sliding window; the blocks wholly before it are never
     * dereferenced, so their table entries may be -1); score i is position begin + i */
    const int64_t n = len - begin;
    const int64_t stride = (n + 15) / 16 * 16;  /* scores of one head: n, then padding up to whole vectors */
    const float *query_item = query + (int64_t)first * group * dim;
    float top[MAX_HEADS], total[MAX_HEADS];
    for (int h = 0; h < heads; h++) {
        for (int d = 0; d < dim; d++) q[h * dim + d] = query_item[h * dim + d] * scale;
        top[h] = -INFINITY;
        for (int64_t t = n; t < stride; t++) scores[h * stride + t] = -INFINITY;
    }
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    /* V is fetched into L2 while the scores are computed when it fits there, so that the two passes' memory
     * traffic overlaps the first pass's arithmetic (64 sequences of 150 positions, K/V from memory: 0.70 -> 0.49 ms);
     * a longer context's V would be evicted before its use, and is fetched a block ahead in the second pass */
    const int64_t first_block = begin / block_size;
    const int early_v = n * count * dim * (int64_t)sizeof(float) <= EARLY_V_BYTES;
    /* pass 1: scores [heads, n], block by block through the table */
    for (int64_t b = first_block; b < num_blocks; b++) {
        const int64_t start = b * block_size;
        const int64_t slots = len - start < block_size ? len - start : block_size;
        /* the next block's slots are fetched while this one's are used: blocks lie anywhere, so no hardware
         * prefetcher can guess where the next one starts (for the last block: the first V block) */
        const float *next = b + 1 < num_blocks ? key_cache + table[b + 1] * block_size * row + (int64_t)first * dim
                                               : value_cache + table[first_block] * block_size * row + (int64_t)first * dim;
        const int64_t t0 = b == first_block ? begin - start : 0;
        const float *k = key_cache + (table[b] * block_size + t0) * row + (int64_t)first * dim;
        const float *v = value_cache + (table[b] * block_size + t0) * row + (int64_t)first * dim;
        next += t0 * row;
        for (int64_t t = t0; t < slots; t++, k += row, next += row, v += row) {
            prefetch_slot(next, count * dim);
            if (early_v) prefetch_slot_l2(v, count * dim);
            for (int c = 0; c < count; c++) {
                for (int g = 0; g < group; g++) {
                    const int h = c * group + g;
                    const float v = dot(q + h * dim, k + c * dim, dim);
                    scores[h * stride + start + t - begin] = v;
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
            *(v16 *)(s + t) = e;
            sum += e;
        }
        total[h] = 0.0f;
        for (int l = 0; l < 16; l++) total[h] += sum[l];
    }
    /* pass 2: the weighted sum of V, in the same order; each head's sum stays in a register across a block's slots
     * (the block's V slice is read once from memory, then from L1 by the group's other heads) */
    memset(acc, 0, sizeof(float) * heads * dim);
    for (int64_t b = first_block; b < num_blocks; b++) {
        const int64_t start = b * block_size;
        const int slots = (int)(len - start < block_size ? len - start : block_size);
        const int t0 = b == first_block ? (int)(begin - start) : 0;
        const float *v = value_cache + table[b] * block_size * row + (int64_t)first * dim;
        if (!early_v && b + 1 < num_blocks) {
            const float *next = value_cache + table[b + 1] * block_size * row + (int64_t)first * dim;
            for (int t = 0; t < slots; t++) prefetch_slot(next + t * row, count * dim);
        }
        const float *s = scores + start - begin;
        for (int c = 0; c < count; c++) {
            for (int g = 0; g < group; g++) {
                const int h = c * group + g;
                float *a = acc + h * dim;
                int d = 0;
                for (; d + 16 <= dim; d += 16) {
                    /* four independent sums over the slots: one chain of dependent FMAs waited on each other */
                    v16 sum0 = *(v16 *)(a + d), sum1 = {0}, sum2 = {0}, sum3 = {0};
                    const float *vd = v + c * dim + d;
                    int t = t0;
                    for (; t + 4 <= slots; t += 4) {
                        sum0 += s[h * stride + t] * *(const v16 *)(vd + t * row);
                        sum1 += s[h * stride + t + 1] * *(const v16 *)(vd + (t + 1) * row);
                        sum2 += s[h * stride + t + 2] * *(const v16 *)(vd + (t + 2) * row);
                        sum3 += s[h * stride + t + 3] * *(const v16 *)(vd + (t + 3) * row);
                    }
                    for (; t < slots; t++) sum0 += s[h * stride + t] * *(const v16 *)(vd + t * row);
                    *(v16 *)(a + d) = (sum0 + sum1) + (sum2 + sum3);
                }
                for (; d < dim; d++) {
                    float sum = a[d];
                    for (int t = t0; t < slots; t++) sum += s[h * stride + t] * v[t * row + c * dim + d];
                    a[d] = sum;
                }
            }
        }
    }
    float *dst = out + (int64_t)first * group * dim;
    for (int h = 0; h < heads; h++) {
        const float inv = 1.0f / total[h];
        for (int d = 0; d < dim; d++) dst[h * dim + d] = acc[h * dim + d] * inv;
    }
}

int paged_decode_f32(const float *query, const float *key_cache, const float *value_cache, const int64_t *tables,
                     int64_t table_stride, const int64_t *lens, float *out, int64_t seqs, int heads, int kv_heads,
                     int dim, int block_size, float scale, int threads) {
    return paged_decode_window_f32(query, key_cache, value_cache, tables, table_stride, lens, out, seqs, heads,
                                   kv_heads, dim, block_size, scale, threads, 0);
}

/* The walk over the items shared with paged_decode_bf16.c: an item is a whole sequence (every KV head: its blocks
 * read once, in order) unless there are too few sequences to keep the threads busy, then one KV head of a
 * sequence; each thread has one scratch for the scores (the longest context's) and its items' q and sums.
 * item(ctx, sequence, first KV head, KV heads, scores, q, acc) attends one. Returns 0, or 2 when scratch memory
 * ran out. */
/* the items for a team of nt: whole sequences (*per_item = kv_heads) when there are enough to share, else one KV
 * head each */
static int64_t decode_items(int64_t seqs, int kv_heads, int nt, int *per_item) {
    *per_item = seqs >= 4 * (int64_t)nt ? kv_heads : 1;
    return seqs * (kv_heads / *per_item);
}

/* Thread t's part of the items, which the team's threads take one at a time from the shared counter *next (zero at
 * the start of the call: schedule(dynamic, 1)). */
int paged_decode_items_part(const int64_t *lens, int64_t seqs, int heads, int kv_heads, int dim, decode_item item,
                            const void *ctx, int64_t *next, int t, int nt) {
    const int group = heads / kv_heads;
    int per_item;
    const int64_t items = decode_items(seqs, kv_heads, nt, &per_item);
    if (t >= items) return 0;
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; s++)
        if (lens[s] > longest) longest = lens[s];
    const size_t score_floats = (size_t)((longest + 15) / 16 * 16 + 16) * per_item * group;
    const size_t head_floats = (size_t)per_item * group * dim;
    float *scores = team_scratch(sizeof(float) * (score_floats + 2 * head_floats));
    if (!scores) return 2;
    for (int64_t i; (i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < items;)
        item(ctx, i / (kv_heads / per_item), (int)(i % (kv_heads / per_item)) * per_item, per_item, scores,
             scores + score_floats, scores + score_floats + head_floats);
    free(scores);
    return 0;
}

int paged_decode_items(const int64_t *lens, int64_t seqs, int heads, int kv_heads, int dim, int threads,
                       decode_item item, const void *ctx) {
    if (threads < 1) threads = 1;
    int per_item;
    const int64_t items = decode_items(seqs, kv_heads, threads, &per_item);
    int64_t next = 0;
    TEAM_RUN(items < threads ? (int)items : threads,
             paged_decode_items_part(lens, seqs, heads, kv_heads, dim, item, ctx, &next, t, nt));
}

struct decode_f32 { /* paged_decode_window_f32's arguments, for its items */
    const float *query, *key_cache, *value_cache;
    const int64_t *tables, *lens;
    int64_t table_stride, window;
    float *out;
    int heads, kv_heads, dim, block_size;
    float scale;
};

static void decode_item_f32(const void *ctx, int64_t s, int first, int count, float *scores, float *q, float *acc) {
    const struct decode_f32 *a = ctx;
    const int64_t begin = a->window > 0 && a->lens[s] > a->window ? a->lens[s] - a->window : 0;
    attend_item(a->query + s * a->heads * a->dim, a->key_cache, a->value_cache, a->tables + s * a->table_stride,
                a->lens[s], begin, a->out + s * a->heads * a->dim, scores, q, acc, a->heads / a->kv_heads,
                a->kv_heads, first, count, a->dim, a->block_size, a->scale);
}

/* paged_decode_f32's part for thread t of a team (decode_stack.c); *next: the items' shared counter, zero */
int paged_decode_f32_part(const float *query, const float *key_cache, const float *value_cache,
                          const int64_t *tables, int64_t table_stride, const int64_t *lens, float *out, int64_t seqs,
                          int heads, int kv_heads, int dim, int block_size, float scale, int64_t *next, int t, int nt) {
    if (!paged_decode_takes(heads, kv_heads, dim, block_size)) return 1;
    const struct decode_f32 args = {query, key_cache, value_cache, tables, lens, table_stride, 0, out, heads,
                                    kv_heads, dim, block_size, scale};
    return paged_decode_items_part(lens, seqs, heads, kv_heads, dim, decode_item_f32, &args, next, t, nt);
}

/* Returns 0 on success, 1 when a shape is outside what this kernel handles, 2 when scratch memory ran out.
 * window > 0: a sliding window; a query at position p (= len - 1) reads the keys at positions > p - window. */
int paged_decode_window_f32(const float *query, const float *key_cache, const float *value_cache,
                            const int64_t *tables, int64_t table_stride, const int64_t *lens, float *out,
                            int64_t seqs, int heads, int kv_heads, int dim, int block_size, float scale, int threads,
                            int64_t window) {
    if (!paged_decode_takes(heads, kv_heads, dim, block_size) || window < 0) return 1;
    const struct decode_f32 args = {query, key_cache, value_cache, tables, lens, table_stride, window, out, heads,
                                    kv_heads, dim, block_size, scale};
    return paged_decode_items(lens, seqs, heads, kv_heads, dim, threads, decode_item_f32, &args);
}
