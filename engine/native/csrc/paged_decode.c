/* Paged decode attention on the CPU, reading K/V straight from the block pool through the block tables: one walk for
 * every element type (float32 and bfloat16 queries; float32, bfloat16 and fp8 pools), with a sliding window for all.
 *
 * Built and loaded at run time by engine/native/__init__.py (the C compiler on the machine, -O3 -march=native
 * -fopenmp), called through ctypes with raw pointers. No copy of the context's K/V is made: each item (a sequence, or
 * one KV head of a sequence when there are few) walks its sequence's blocks in logical order, wherever they lie in
 * the pool.
 *
 * Layouts (contiguous; the query and the output in the query's type, the pool in its own, elements.h's kinds):
 *   query      [seqs, heads, dim]
 *   key/value  [num_blocks, block_size, kv_heads, dim]
 *   tables     int64 [seqs, table_stride]: logical block i of sequence s is physical block tables[s * stride + i]
 *   lens       int64 [seqs]: context length, the query's own position included
 *   out        [seqs, heads, dim]
 * Query head h reads KV head h / (heads / kv_heads). A window w > 0: the query at position p = len - 1 reads the keys
 * at positions > p - w; the blocks wholly before that are never read (their table entries may be anything).
 *
 * Per item, two passes: scores of the group's query heads against every key (each K row read once, for all the
 * heads that share it), a softmax over them, then the weighted sum of V (each V row read once). Items are spread
 * over the OpenMP team (torch's own libgomp, already loaded: the same threads torch's kernels use).
 *
 * The arithmetic is the walk's own, in float32, for every type: a float32 query is scaled before its dot products,
 * a bfloat16 query (and any query over an fp8 pool, as vLLM's CPU attention scales fp8 logits) after them; with a
 * bfloat16 query the softmax's weights are rounded to bfloat16 before they weight V and the output is rounded once,
 * where transformers' bfloat16 attention rounds. With AVX-512 BF16 and a head size that is a multiple of 32, a
 * bfloat16 query takes torch's own order instead (attend_item_torch below), over bfloat16 and fp8 pools alike.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "elements.h"
#include "kernels.h"
#include "simd.h"
#include "team.h"

/* one item of paged decode attention: KV heads [first, first + count) of sequence s, with a thread's scratch */
typedef void (*decode_item)(const void *ctx, int64_t s, int first, int count, float *scores, float *q, float *acc);

/* What one call attends: paged_decode's arguments, for its items. */
struct decode_args {
    const void *query, *key_cache, *value_cache;
    const int64_t *tables, *lens;
    int64_t table_stride, window;
    void *out;
    int heads, kv_heads, dim, block_size;
    float scale, out_scale;
};

/* q . k over dim: sixteen partial sums in one vector, added up as a tree of shuffles (`omp simd reduction` made GCC
 * add the sixteen lanes one after another through the stack, most of what a score cost). */
static inline __attribute__((always_inline)) float dot(const float *restrict q, const void *restrict k, int dim,
                                                       int kind) {
    v16 part = {0};
    int d = 0;
    for (; d + 16 <= dim; d += 16) part += *(const v16 *)(q + d) * load16(k, d, kind);
    v8 p8 = __builtin_shufflevector(part, part, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(part, part, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 p4 = __builtin_shufflevector(p8, p8, 0, 1, 2, 3) + __builtin_shufflevector(p8, p8, 4, 5, 6, 7);
    float acc = (p4[0] + p4[2]) + (p4[1] + p4[3]);
    for (; d < dim; d++) acc += q[d] * load1(k, d, kind);
    return acc;
}

/* Rows [t0, slots) of one KV head's slice of a block, for all the query heads that read it: a float32 or bfloat16
 * pool's own rows (*row_bytes: a slot; *kind: the pool's, whose reading is one instruction or two), an fp8 pool's
 * converted once into conv as float32 over el_unit (*row_bytes: dim floats; *kind: float32), where converting in every
 * head's dot product cost a group's worth of conversions per row. */
static inline __attribute__((always_inline)) const char *head_rows(const char *slice, int64_t slot_bytes, int t0,
                                                                   int slots, int dim, float *restrict conv,
                                                                   int64_t *row_bytes, int *kind, const int kv_kind) {
    if (!el_fp8(kv_kind)) {
        *row_bytes = slot_bytes;
        *kind = kv_kind;
        return slice;
    }
    for (int t = t0; t < slots; t++) {
        int d = 0;
        for (; d + 16 <= dim; d += 16) *(v16 *)(conv + (int64_t)t * dim + d) = load16(slice + t * slot_bytes, d, kv_kind);
        for (; d < dim; d++) conv[(int64_t)t * dim + d] = load1(slice + t * slot_bytes, d, kv_kind);
    }
    *row_bytes = (int64_t)dim * sizeof(float);
    *kind = EL_F32;
    return (const char *)conv;
}

/* Asks for the cache lines of one slot's `bytes` ahead of their use (into L2 only with `l2`: V rows wanted in the
 * second pass, a while later). */
static inline void prefetch_bytes(const void *slot, int64_t bytes, int l2) {
    for (int64_t b = 0; b < bytes; b += 64) {
        if (l2) __builtin_prefetch((const char *)slot + b, 0, 2);
        else __builtin_prefetch((const char *)slot + b);
    }
}

#define EARLY_V_BYTES (512 * 1024) /* an item's V at most this large is fetched during the first pass (L2: 1 MiB) */

/* the first position a query at len - 1 reads */
static inline int64_t window_begin(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The output rows of an item's heads: acc / total, times out_scale after the output type's rounding (the layer
 * multiplies by V's scale after attention, in its own type: engine/model/causal_lm.py). */
static inline __attribute__((always_inline)) void store_out(void *out, int64_t first, int heads, int dim,
                                                            const float *restrict acc, const float *total,
                                                            float out_scale, int q_kind) {
    for (int h = 0; h < heads; h++) {
        const float inv = 1.0f / total[h];
        for (int d = 0; d < dim; d++) {
            const float v = acc[h * dim + d] * inv;
            if (q_kind == EL_BF16) {
                uint16_t *dst = (uint16_t *)out + first + h * dim + d;
                *dst = out_scale == 1.0f ? narrow(v) : narrow(round1(v) * out_scale);
            } else {
                ((float *)out)[first + h * dim + d] = out_scale == 1.0f ? v : v * out_scale;
            }
        }
    }
}

/* One item in the walk's own order: KV heads [first, first + count) of sequence s. Scratch: scores of at least
 * (len rounded up to 16) * count * group floats, q and acc of count * group * dim floats each, then block_size * dim
 * floats for a block's rows of one KV head converted to float32. A whole block of the item is fetched ahead as one
 * sequential read, all its KV heads together, then its heads' slices are used one after another from the cache
 * (items of one KV head each over the same blocks ran 3x slower: every scattered block cost a TLB and cache miss
 * per head). */
static inline __attribute__((always_inline)) void attend_item(const struct decode_args *a, int64_t s, int first,
                                                              int count, float *restrict scores, float *restrict q,
                                                              float *restrict acc, const int q_kind,
                                                              const int kv_kind) {
    const int dim = a->dim, block_size = a->block_size, group = a->heads / a->kv_heads;
    const int heads = count * group; /* query heads of this item: rows of q, acc and scores */
    const int64_t row = (int64_t)a->kv_heads * dim; /* elements between consecutive slots of a block */
    const int64_t len = a->lens[s], begin = window_begin(len, a->window);
    const int64_t *table = a->tables + s * a->table_stride;
    const char *key_cache = a->key_cache, *value_cache = a->value_cache;
    const int64_t el = el_bytes(kv_kind), head_off = (int64_t)first * dim * el;
    const int scale_after = q_kind == EL_BF16 || el_fp8(kv_kind); /* else q is scaled before its dot products */
    /* positions begin..len-1 are read; score i is position begin + i */
    const int64_t n = len - begin;
    const int64_t stride = (n + 15) / 16 * 16; /* scores of one head: n, then padding up to whole vectors */
    const int64_t query_item = (s * a->heads + (int64_t)first * group) * dim;
    float *restrict conv = acc + (int64_t)heads * dim;
    float top[MAX_HEADS], total[MAX_HEADS];
    for (int h = 0; h < heads; h++) {
        for (int d = 0; d < dim; d++) {
            const float x = load1(a->query, query_item + h * dim + d, q_kind);
            q[h * dim + d] = scale_after ? x : x * a->scale;
        }
        top[h] = -INFINITY;
        for (int64_t t = n; t < stride; t++) scores[h * stride + t] = -INFINITY;
    }
    const int64_t num_blocks = (len + block_size - 1) / block_size, first_block = begin / block_size;
    const int64_t block_bytes = block_size * row * el, slot_bytes = row * el, item_bytes = (int64_t)count * dim * el;
    /* V is fetched into L2 while the scores are computed when it fits there, so that the two passes' memory traffic
     * overlaps the first pass's arithmetic (64 sequences of 150 positions, K/V from memory: 0.70 -> 0.49 ms); a
     * longer context's V would be evicted before its use, and is fetched a block ahead in the second pass */
    const int early_v = n * item_bytes <= EARLY_V_BYTES;
    /* pass 1: scores [heads, n], block by block through the table */
    for (int64_t b = first_block; b < num_blocks; b++) {
        const int64_t start = b * block_size;
        const int64_t slots = len - start < block_size ? len - start : block_size;
        const int64_t t0 = b == first_block ? begin - start : 0;
        /* the next block's slots are fetched while this one's are used: blocks lie anywhere, so no hardware
         * prefetcher can guess where the next one starts (for the last block: the first V block) */
        const char *next = (b + 1 < num_blocks ? key_cache + table[b + 1] * block_bytes
                                               : value_cache + table[first_block] * block_bytes) + head_off;
        const char *k = key_cache + table[b] * block_bytes + head_off;
        const char *v = value_cache + table[b] * block_bytes + head_off;
        if (el_fp8(kv_kind)) {
            /* one KV head's slice of the block at a time, converted once for its group's heads (converting a slot's
             * heads together, then scoring, was slower: docs/engine.md, "fp8 reads") */
            for (int64_t t = 0; t < block_size; t++) prefetch_bytes(next + t * slot_bytes, item_bytes, 0);
            if (early_v)
                for (int64_t t = t0; t < slots; t++) prefetch_bytes(v + t * slot_bytes, item_bytes, 1);
            for (int c = 0; c < count; c++) {
                int64_t rs;
                int rk;
                const char *rows = head_rows(k + c * dim * el, slot_bytes, (int)t0, (int)slots, dim, conv, &rs, &rk,
                                             kv_kind);
                for (int g = 0; g < group; g++) {
                    const int h = c * group + g;
                    for (int64_t t = t0; t < slots; t++) {
                        const float x = dot(q + h * dim, rows + t * rs, dim, rk) * el_unit(kv_kind) * a->scale;
                        scores[h * stride + start + t - begin] = x;
                        if (x > top[h]) top[h] = x;
                    }
                }
            }
            continue;
        }
        for (int64_t t = t0; t < slots; t++) {
            prefetch_bytes(next + t * slot_bytes, item_bytes, 0);
            if (early_v) prefetch_bytes(v + t * slot_bytes, item_bytes, 1);
            for (int c = 0; c < count; c++) {
                for (int g = 0; g < group; g++) {
                    const int h = c * group + g;
                    float x = dot(q + h * dim, k + t * slot_bytes + c * dim * el, dim, kv_kind);
                    if (scale_after) x *= a->scale;
                    scores[h * stride + start + t - begin] = x;
                    if (x > top[h]) top[h] = x;
                }
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        v16 sum = {0};
        float *sc = scores + h * stride;
        for (int64_t t = 0; t < stride; t += 16) {
            const v16 e = exp16(*(v16 *)(sc + t) - top[h]);
            sum += e; /* the denominator from the float32 exponentials */
            *(v16 *)(sc + t) = q_kind == EL_BF16 ? round16(e) : e; /* bfloat16: V weighted by them rounded */
        }
        total[h] = 0.0f;
        for (int l = 0; l < 16; l++) total[h] += sum[l];
    }
    /* pass 2: the weighted sum of V, in the same order; each head's sum stays in a register across a block's slots
     * (the block's V slice is read once from memory, converted once, then read from L1 by the group's heads) */
    memset(acc, 0, sizeof(float) * heads * dim);
    for (int64_t b = first_block; b < num_blocks; b++) {
        const int64_t start = b * block_size;
        const int slots = (int)(len - start < block_size ? len - start : block_size);
        const int t0 = b == first_block ? (int)(begin - start) : 0;
        const char *v = value_cache + table[b] * block_bytes + head_off;
        if (!early_v && b + 1 < num_blocks) {
            const char *next = value_cache + table[b + 1] * block_bytes + head_off;
            for (int t = 0; t < slots; t++) prefetch_bytes(next + t * slot_bytes, item_bytes, 0);
        }
        const float *sc = scores + start - begin;
        for (int c = 0; c < count; c++) {
            int64_t rs;
            int rk;
            const char *vr = head_rows(v + c * dim * el, slot_bytes, t0, slots, dim, conv, &rs, &rk, kv_kind);
            for (int g = 0; g < group; g++) {
                const int h = c * group + g;
                float *o = acc + h * dim;
                int d = 0;
                for (; d + 16 <= dim; d += 16) {
                    /* four independent sums over the slots: one chain of dependent FMAs waited on each other */
                    v16 sum0 = *(v16 *)(o + d), sum1 = {0}, sum2 = {0}, sum3 = {0};
                    int t = t0;
                    for (; t + 4 <= slots; t += 4) {
                        sum0 += sc[h * stride + t] * load16(vr + t * rs, d, rk);
                        sum1 += sc[h * stride + t + 1] * load16(vr + (t + 1) * rs, d, rk);
                        sum2 += sc[h * stride + t + 2] * load16(vr + (t + 2) * rs, d, rk);
                        sum3 += sc[h * stride + t + 3] * load16(vr + (t + 3) * rs, d, rk);
                    }
                    for (; t < slots; t++) sum0 += sc[h * stride + t] * load16(vr + t * rs, d, rk);
                    *(v16 *)(o + d) = (sum0 + sum1) + (sum2 + sum3);
                }
                for (; d < dim; d++) {
                    float sum = o[d];
                    for (int t = t0; t < slots; t++) sum += sc[h * stride + t] * load1(vr + t * rs, d, rk);
                    o[d] = sum;
                }
            }
        }
    }
    if (el_unit(kv_kind) != 1.0f)
        for (int i = 0; i < heads * dim; i++) acc[i] *= el_unit(kv_kind);
    store_out(a->out, query_item, heads, dim, acc, total, a->out_scale, q_kind);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TORCH_ORDER 1
#define KV_SPLIT 512 /* torch's kvSplitSize: keys per chunk of its online softmax */

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
static inline const char *key_row(const char *cache, const int64_t *table, int64_t t, int block_size,
                                  int64_t slot_bytes, int64_t head_off) {
    return cache + (table[t / block_size] * block_size + t % block_size) * slot_bytes + head_off;
}

/* One item in torch's order (paged_decode.c's header; docs/engine.md, "torch's decode attention, read off its
 * bits"): KV heads [first, first + count) of sequence s, a bfloat16 query, dim a multiple of 32, the pool bfloat16
 * or fp8 (read as the bfloat16 values it holds: exactly those). What torch 2.13 computes for one query row:
 *   - a score is the bfloat16 q . k by vdpbf16ps, 32 dims a step into one sixteen-lane sum, whose lanes are then
 *     added as (i, i + 8), then neighbours, then pairs of those, then the two halves; scaled after, in float32;
 *   - the keys go in chunks of 512 (torch's kvSplitSize) from the first the query reads (with a window: the
 *     window's first, as a cache holding only the window gives them to torch); in each, e^(score - max) by ATen's
 *     fexp_u20 for whole vectors of sixteen, summed as torch's build sums them, by the C library's exp in double for
 *     the rest; each rounded to bfloat16 before it weights V;
 *   - the weighted V is vdpbf16ps over pairs of consecutive keys, each eight keys summed from zero and then added
 *     to the total; a later chunk rescales the total by expf(old max - new max) first, and its sum of
 *     exponentials joins the old one by a fused multiply-add;
 *   - the output is the total times 1 / the sum, rounded to bfloat16 once.
 * Scratch: scores of at least (min(n, 512) rounded up to 16) * count * group floats (each head's row holds its
 * bfloat16 weights after the softmax, written over the scores as they are read) and acc of count * group * dim
 * floats (the walk's q scratch goes unused: q stays bfloat16). The build is ISO C, where GCC fuses no multiply
 * with an add unless told to: every rounding above is the one written. */
static inline __attribute__((always_inline)) void attend_item_torch(const struct decode_args *a, int64_t s,
                                                                    int first, int count, float *restrict scores,
                                                                    float *restrict acc, const int kv_kind) {
    const int dim = a->dim, block_size = a->block_size, group = a->heads / a->kv_heads;
    const int heads = count * group;
    const int64_t el = el_bytes(kv_kind), slot_bytes = (int64_t)a->kv_heads * dim * el;
    const int64_t head_off = (int64_t)first * dim * el;
    const int64_t len = a->lens[s], begin0 = window_begin(len, a->window);
    const int64_t *table = a->tables + s * a->table_stride;
    const char *key_cache = a->key_cache, *value_cache = a->value_cache;
    const int steps = dim / 32, vectors = dim / 16;
    const int64_t query_item = (s * a->heads + (int64_t)first * group) * dim;
    const uint16_t *query = (const uint16_t *)a->query + query_item;
    float top[MAX_HEADS], total[MAX_HEADS];
    memset(acc, 0, sizeof(float) * heads * dim);
    for (int64_t begin = begin0; begin < len; begin += KV_SPLIT) {
        const int64_t n = len - begin < KV_SPLIT ? len - begin : KV_SPLIT;
        const int64_t stride = (n + 15) / 16 * 16;
        float chunk_top[MAX_HEADS];
        for (int h = 0; h < heads; h++) chunk_top[h] = -INFINITY;
        /* pass 1: scores [heads, n] */
        const char *next = key_row(key_cache, table, begin, block_size, slot_bytes, head_off);
        for (int64_t t = 0; t < n; t++) {
            const char *k = next; /* this key's row, found a key ahead to be fetched */
            if (t + 1 < n) {
                next = key_row(key_cache, table, begin + t + 1, block_size, slot_bytes, head_off);
                prefetch_bytes(next, count * dim * el, 0);
            }
            for (int c = 0; c < count; c++) {
                __m512i kv[MAX_DIM / 32];
                for (int j = 0; j < steps; j++) {
                    if (kv_kind == EL_BF16) {
                        kv[j] = _mm512_loadu_si512(k + (c * dim + 32 * j) * el);
                    } else {
                        const v16h lo = load16_bf16(k, c * dim + 32 * j, kv_kind);
                        const v16h hi = load16_bf16(k, c * dim + 32 * j + 16, kv_kind);
                        kv[j] = (__m512i)__builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
                                                                 27, 28, 29, 30, 31);
                    }
                }
                for (int g = 0; g < group; g++) {
                    const int h = c * group + g;
                    const uint16_t *qh = query + h * dim;
                    __m512 lanes = _mm512_setzero_ps();
                    for (int j = 0; j < steps; j++)
                        lanes = _mm512_dpbf16_ps(lanes, (__m512bh)kv[j], (__m512bh)_mm512_loadu_si512(qh + 32 * j));
                    const float v = score_lanes(lanes) * a->scale;
                    scores[h * stride + t] = v;
                    if (v > chunk_top[h]) chunk_top[h] = v;
                }
            }
        }
        /* the softmax's weights, as bfloat16 over each head's scores; the running maximum and sum */
        for (int h = 0; h < heads; h++) {
            float *sc = scores + h * stride;
            const float rescale = softmax_join(sc, (u16a *)sc, n, begin - begin0, chunk_top[h], &top[h], &total[h]);
            ((u16a *)sc)[n] = 0; /* the pair of an odd last key */
            if (begin > begin0)
                for (int d = 0; d < dim; d++) acc[h * dim + d] *= rescale;
        }
        /* pass 2: the weighted V, eight keys (four pairs) at a time summed from zero, then added to the total */
        for (int64_t g8 = 0; g8 < n; g8 += 8) {
            const int pairs = (int)((n - g8 < 8 ? n - g8 : 8) + 1) / 2;
            const char *v[8];
            for (int t = 0; t < 2 * pairs; t++)
                v[t] = g8 + t < n ? key_row(value_cache, table, begin + g8 + t, block_size, slot_bytes, head_off)
                                  : NULL;
            for (int c = 0; c < count; c++) {
                for (int dv = 0; dv < vectors; dv++) {
                    __m512i pv[4];
                    for (int j = 0; j < pairs; j++) {
                        const v16h x = load16_bf16(v[2 * j], c * dim + 16 * dv, kv_kind);
                        const v16h y = v[2 * j + 1] ? load16_bf16(v[2 * j + 1], c * dim + 16 * dv, kv_kind)
                                                    : (v16h){0};
                        pv[j] = (__m512i)__builtin_shufflevector(x, y, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                                                                 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13,
                                                                 29, 14, 30, 15, 31);
                    }
                    for (int g = 0; g < group; g++) {
                        const int h = c * group + g;
                        const u32a *w = (const u32a *)(scores + h * stride) + g8 / 2;
                        __m512 part = _mm512_setzero_ps();
                        for (int j = 0; j < pairs; j++)
                            part = _mm512_dpbf16_ps(part, (__m512bh)pv[j], (__m512bh)_mm512_set1_epi32((int)w[j]));
                        float *o = acc + h * dim + 16 * dv;
                        _mm512_storeu_ps(o, _mm512_add_ps(part, _mm512_loadu_ps(o)));
                    }
                }
            }
        }
    }
    store_out(a->out, query_item, heads, dim, acc, total, a->out_scale, EL_BF16);
}
#else
#define TORCH_ORDER 0
#endif

static int torch_order = 1; /* bf16_decode_torch_order(0): the walk's own order, to compare the two */

/* mode 1: a bfloat16 query's attention in torch's order where the build has AVX-512 BF16 (the default); 0: the
 * walk's own order; -1: no change. Returns whether torch's order served before the call (never without AVX-512
 * BF16). */
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

/* one item of each kind, the walk inlined with its kinds as constants (elements.h) */
#define ITEM(NAME, Q, KV)                                                                                              \
    static void NAME(const void *ctx, int64_t s, int first, int count, float *scores, float *q, float *acc) {         \
        attend_item(ctx, s, first, count, scores, q, acc, Q, KV);                                                    \
    }
ITEM(item_f32_f32, EL_F32, EL_F32)
ITEM(item_f32_e4m3, EL_F32, EL_E4M3)
ITEM(item_f32_e5m2, EL_F32, EL_E5M2)
ITEM(item_bf16_bf16, EL_BF16, EL_BF16)
ITEM(item_bf16_e4m3, EL_BF16, EL_E4M3)
ITEM(item_bf16_e5m2, EL_BF16, EL_E5M2)

#if TORCH_ORDER
#define TORCH_ITEM(NAME, KV, FALLBACK)                                                                                 \
    static void NAME(const void *ctx, int64_t s, int first, int count, float *scores, float *q, float *acc) {         \
        const struct decode_args *a = ctx;                                                                           \
        if (a->dim % 32 == 0 && a->dim <= MAX_DIM && __atomic_load_n(&torch_order, __ATOMIC_RELAXED))                \
            attend_item_torch(a, s, first, count, scores, acc, KV);                                                  \
        else                                                                                                         \
            FALLBACK(ctx, s, first, count, scores, q, acc);                                                          \
    }
TORCH_ITEM(item_torch_bf16, EL_BF16, item_bf16_bf16)
TORCH_ITEM(item_torch_e4m3, EL_E4M3, item_bf16_e4m3)
TORCH_ITEM(item_torch_e5m2, EL_E5M2, item_bf16_e5m2)
#endif

/* the item function for a query kind and a pool kind; NULL for a pair the walk does not take (a float32 query over a
 * bfloat16 pool, or the reverse: the engine never makes one) */
static decode_item item_for(int q_kind, int kv_kind) {
    if (q_kind == EL_F32) {
        return kv_kind == EL_F32 ? item_f32_f32 : kv_kind == EL_E4M3 ? item_f32_e4m3
                                                : kv_kind == EL_E5M2 ? item_f32_e5m2 : NULL;
    }
    if (q_kind != EL_BF16) return NULL;
#if TORCH_ORDER
    return kv_kind == EL_BF16 ? item_torch_bf16 : kv_kind == EL_E4M3 ? item_torch_e4m3
                                                : kv_kind == EL_E5M2 ? item_torch_e5m2 : NULL;
#else
    return kv_kind == EL_BF16 ? item_bf16_bf16 : kv_kind == EL_E4M3 ? item_bf16_e4m3
                                                : kv_kind == EL_E5M2 ? item_bf16_e5m2 : NULL;
#endif
}

/* the items for a team of nt: whole sequences (*per_item = kv_heads) when there are enough to share, else one KV
 * head each */
static int64_t decode_items(int64_t seqs, int kv_heads, int nt, int *per_item) {
    *per_item = seqs >= 4 * (int64_t)nt ? kv_heads : 1;
    return seqs * (kv_heads / *per_item);
}

/* Thread t's part of the items, which the team's threads take one at a time from the shared counter *next (zero at
 * the start of the call: schedule(dynamic, 1)); each thread has one scratch for the scores (the longest context's)
 * and its items' q and sums. Returns 0, or 2 when scratch memory ran out. */
static int decode_items_part(const struct decode_args *a, int64_t seqs, decode_item item, int64_t *next, int t,
                             int nt) {
    const int group = a->heads / a->kv_heads;
    int per_item;
    const int64_t items = decode_items(seqs, a->kv_heads, nt, &per_item);
    if (t >= items || __atomic_load_n(next, __ATOMIC_RELAXED) >= items) return 0; /* (nothing left to take) */
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; s++) {
        const int64_t n = a->lens[s] - window_begin(a->lens[s], a->window);
        if (n > longest) longest = n;
    }
    const size_t score_floats = (size_t)((longest + 15) / 16 * 16 + 16) * per_item * group;
    const size_t head_floats = (size_t)per_item * group * a->dim;
    const size_t conv_floats = (size_t)a->block_size * a->dim; /* attend_item's converted rows */
    float *scores = team_scratch(sizeof(float) * (score_floats + 2 * head_floats + conv_floats));
    if (!scores) return 2;
    for (int64_t i; (i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < items;)
        item(a, i / (a->kv_heads / per_item), (int)(i % (a->kv_heads / per_item)) * per_item, per_item, scores,
             scores + score_floats, scores + score_floats + head_floats);
    free(scores);
    return 0;
}

/* paged_decode's part for thread t of a team (decode_stack.c); *next: the items' shared counter, zero */
int paged_decode_part(const void *query, const void *key_cache, const void *value_cache, const int64_t *tables,
                      int64_t table_stride, const int64_t *lens, void *out, int64_t seqs, int heads, int kv_heads,
                      int dim, int block_size, float scale, float out_scale, int64_t window, int kinds,
                      int64_t *next, int t, int nt) {
    const decode_item item = item_for(kinds & 15, kinds >> 4);
    if (!paged_decode_takes(heads, kv_heads, dim, block_size) || window < 0 || !item) return 1;
    const struct decode_args args = {query, key_cache, value_cache, tables, lens, table_stride, window, out, heads,
                                     kv_heads, dim, block_size, scale, out_scale};
    return decode_items_part(&args, seqs, item, next, t, nt);
}

/* Decode attention of a batch: `kinds` the query's element kind | the pool's << 4 (elements.h). Returns 0 on
 * success, 1 when a shape or a pair of kinds is outside what this kernel handles (nothing written), 2 when scratch
 * memory ran out. */
int paged_decode(const void *query, const void *key_cache, const void *value_cache, const int64_t *tables,
                 int64_t table_stride, const int64_t *lens, void *out, int64_t seqs, int heads, int kv_heads, int dim,
                 int block_size, float scale, float out_scale, int64_t window, int kinds, int threads) {
    if (!paged_decode_takes(heads, kv_heads, dim, block_size) || window < 0 || !item_for(kinds & 15, kinds >> 4))
        return 1;
    if (threads < 1) threads = 1;
    int per_item;
    const int64_t items = decode_items(seqs, kv_heads, threads, &per_item);
    int64_t next = 0;
    TEAM_RUN(items < threads ? (int)items : threads,
             paged_decode_part(query, key_cache, value_cache, tables, table_stride, lens, out, seqs, heads, kv_heads,
                               dim, block_size, scale, out_scale, window, kinds, &next, t, nt));
}
