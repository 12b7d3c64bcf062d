/* The walks over rows that the float32 elementwise kernels (norm_act.c, rope_store.c) and their bfloat16 twins
 * (norm_act_bf16.c) share, written once on the element type T; each kernel file gives its own per-row function
 * (the rounding is where the two differ). Few rows run on one thread: waking a second costs more than their work. */
#ifndef PAGED_KV_ROW_WALKS_H
#define PAGED_KV_ROW_WALKS_H

#include <stdint.h>

#include "kernels.h"

#define ROWS_PER_THREAD 64 /* fewer rows than this per thread: one thread */
#define ROPE_TOKENS_PER_THREAD 64 /* fewer tokens than this in all: one thread */

/* x += delta (when given), out = the RMSNorm of x, row by row: ROW(x, delta, weight, out, n, eps) */
#define ADD_RMS_NORM(T, SUFFIX, ROW)                                                                                   \
    int add_rms_norm_##SUFFIX(T *x, const T *delta, const T *weight, T *out, int64_t rows, int n, float eps,         \
                              int threads) {                                                                         \
        if (n < 1) return 1;                                                                                         \
        if (rows < (int64_t)ROWS_PER_THREAD * 2) threads = 1;                                                        \
        _Pragma("omp parallel for num_threads(threads) if (threads > 1) schedule(static)")                           \
        for (int64_t r = 0; r < rows; r++) ROW(x + r * n, delta ? delta + r * n : 0, weight, out + r * n, n, eps); \
        return 0;                                                                                                    \
    }

/* out = silu(gate) * up of each row [gate | up] of gate_up: ROW(gate, up, out, n) */
#define SILU_MUL(T, SUFFIX, ROW)                                                                                       \
    int silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int n, int threads) {                              \
        if (n < 1) return 1;                                                                                         \
        if (rows < (int64_t)ROWS_PER_THREAD * 2) threads = 1;                                                        \
        _Pragma("omp parallel for num_threads(threads) if (threads > 1) schedule(static)")                           \
        for (int64_t r = 0; r < rows; r++)                                                                           \
            ROW(gate_up + r * 2 * (int64_t)n, gate_up + r * 2 * (int64_t)n + n, out + r * (int64_t)n, n);            \
        return 0;                                                                                                    \
    }

/* q rotated to q_out, k rotated and v copied to their slots of the caches, token by token:
 * ROTATE(x, cos, sin, out, dim) rotates one head */
#define ROPE_STORE(T, SUFFIX, ROTATE)                                                                                  \
    int rope_store_##SUFFIX(const T *qkv, const T *cos, const T *sin, const int64_t *slots, T *q_out, T *key_cache,  \
                            T *value_cache, int64_t tokens, int heads, int kv_heads, int dim, int threads) {         \
        if (!rope_store_takes(heads, kv_heads, dim)) return 1;                                                       \
        const int64_t width = (int64_t)(heads + 2 * kv_heads) * dim;                                                 \
        if (tokens < ROPE_TOKENS_PER_THREAD) threads = 1;                                                            \
        _Pragma("omp parallel for num_threads(threads) if (threads > 1) schedule(static)")                           \
        for (int64_t t = 0; t < tokens; t++) {                                                                       \
            const T *row = qkv + t * width;                                                                          \
            const T *c = cos + t * dim, *s = sin + t * dim;                                                          \
            for (int h = 0; h < heads; h++) ROTATE(row + h * dim, c, s, q_out + (t * heads + h) * dim, dim);         \
            T *k = key_cache + slots[t] * kv_heads * dim;                                                            \
            T *v = value_cache + slots[t] * kv_heads * dim;                                                          \
            for (int h = 0; h < kv_heads; h++) ROTATE(row + (heads + h) * dim, c, s, k + h * dim, dim);              \
            const T *vsrc = row + (int64_t)(heads + kv_heads) * dim;                                                 \
            for (int i = 0; i < kv_heads * dim; i++) v[i] = vsrc[i];                                                 \
        }                                                                                                            \
        return 0;                                                                                                    \
    }

#endif
