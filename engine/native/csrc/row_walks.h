/* The walks over rows that the float32 elementwise kernels (norm_act.c, rope_store.c) and their bfloat16 twins
 * (norm_act_bf16.c) share, written once on the element type T; each kernel file gives its own per-row function
 * (the rounding is where the two differ). Few rows run on one thread: waking a second costs more than their work. */
#ifndef PAGED_KV_ROW_WALKS_H
#define PAGED_KV_ROW_WALKS_H

#include <stdint.h>

#include "elements.h"
#include "kernels.h"
#include "team.h"

#define ROWS_PER_THREAD 64 /* fewer rows than this per thread: one thread */
#define ROPE_TOKENS_PER_THREAD 64 /* fewer tokens than this in all: one thread */

/* threads a walk over rows takes (the norm, SwiGLU), and over tokens (the rotary pass) */
static inline int row_users(int64_t rows, int threads) { return rows < (int64_t)ROWS_PER_THREAD * 2 ? 1 : threads; }
static inline int rope_users(int64_t tokens, int threads) { return tokens < ROPE_TOKENS_PER_THREAD ? 1 : threads; }

/* x += delta (when given), out = the RMSNorm of x, row by row: ROW(x, delta, weight, out, n, eps); few rows on
 * one thread of the team */
#define ADD_RMS_NORM(T, SUFFIX, ROW)                                                                                   \
    int add_rms_norm_##SUFFIX##_part(T *x, const T *delta, const T *weight, T *out, int64_t rows, int n, float eps,   \
                                     int t, int nt) {                                                                \
        if (n < 1) return 1;                                                                                         \
        const int users = row_users(rows, nt);                                              \
        if (t >= users) return 0;                                                                                    \
        int64_t lo, hi;                                                                                              \
        team_share(rows, t, users, &lo, &hi);                                                                        \
        for (int64_t r = lo; r < hi; r++) ROW(x + r * n, delta ? delta + r * n : 0, weight, out + r * n, n, eps);   \
        return 0;                                                                                                    \
    }                                                                                                                \
    int add_rms_norm_##SUFFIX(T *x, const T *delta, const T *weight, T *out, int64_t rows, int n, float eps,         \
                              int threads) {                                                                         \
        if (n < 1) return 1;                                                                                         \
        TEAM_RUN(row_users(rows, threads),                                                  \
                 add_rms_norm_##SUFFIX##_part(x, delta, weight, out, rows, n, eps, t, nt));                          \
    }

/* out = silu(gate) * up of each row [gate | up] of gate_up: ROW(gate, up, out, n) */
#define SILU_MUL(T, SUFFIX, ROW)                                                                                       \
    int silu_mul_##SUFFIX##_part(const T *gate_up, T *out, int64_t rows, int n, int t, int nt) {                     \
        if (n < 1) return 1;                                                                                         \
        const int users = row_users(rows, nt);                                              \
        if (t >= users) return 0;                                                                                    \
        int64_t lo, hi;                                                                                              \
        team_share(rows, t, users, &lo, &hi);                                                                        \
        for (int64_t r = lo; r < hi; r++)                                                                            \
            ROW(gate_up + r * 2 * (int64_t)n, gate_up + r * 2 * (int64_t)n + n, out + r * (int64_t)n, n);            \
        return 0;                                                                                                    \
    }                                                                                                                \
    int silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int n, int threads) {                              \
        if (n < 1) return 1;                                                                                         \
        TEAM_RUN(row_users(rows, threads), silu_mul_##SUFFIX##_part(gate_up, out, rows, n,  \
                                                                                             t, nt));                \
    }

/* q rotated to q_out, k rotated and v copied to their slots of the caches, token by token: ROTATE(x, cos, sin, out,
 * dim) rotates one head. The caches hold elements of kind kv_kind (elements.h): KIND, T's own, takes the rotated
 * rows as they are; an fp8 pool takes them quantised (WIDEN(x): T as float32, then elements.h's cache write with
 * the layer's inverse scales) */
#define ROPE_STORE(T, SUFFIX, KIND, ROTATE, WIDEN)                                                                     \
    int rope_store_##SUFFIX##_part(const T *qkv, const T *cos, const T *sin, const int64_t *slots, T *q_out,         \
                                   void *key_cache, void *value_cache, int64_t tokens, int heads, int kv_heads,      \
                                   int dim, int kv_kind, float k_inverse, float v_inverse, int t, int nt) {          \
        if (!rope_store_takes(heads, kv_heads, dim) ||                                                              \
            (kv_kind != KIND && (!el_fp8(kv_kind) || dim > MAX_DIM)))                                                \
            return 1;                                                                                                \
        const int users = rope_users(tokens, nt);                                                                    \
        if (t >= users) return 0;                                                                                    \
        const int64_t width = (int64_t)(heads + 2 * kv_heads) * dim, el = el_bytes(kv_kind);                        \
        int64_t lo, hi;                                                                                              \
        team_share(tokens, t, users, &lo, &hi);                                                                      \
        T rotated[MAX_DIM];                                                                                          \
        float wide[MAX_DIM];                                                                                         \
        for (int64_t i = lo; i < hi; i++) {                                                                          \
            const T *row = qkv + i * width;                                                                          \
            const T *c = cos + i * dim, *s = sin + i * dim;                                                          \
            for (int h = 0; h < heads; h++) ROTATE(row + h * dim, c, s, q_out + (i * heads + h) * dim, dim);         \
            char *k = (char *)key_cache + slots[i] * kv_heads * dim * el;                                           \
            char *v = (char *)value_cache + slots[i] * kv_heads * dim * el;                                         \
            const T *vsrc = row + (int64_t)(heads + kv_heads) * dim;                                                 \
            if (kv_kind == KIND) {                                                                                   \
                for (int h = 0; h < kv_heads; h++) ROTATE(row + (heads + h) * dim, c, s, (T *)k + h * dim, dim);    \
                for (int e = 0; e < kv_heads * dim; e++) ((T *)v)[e] = vsrc[e];                                      \
                continue;                                                                                            \
            }                                                                                                        \
            for (int h = 0; h < kv_heads; h++) {                                                                     \
                ROTATE(row + (heads + h) * dim, c, s, rotated, dim);                                                 \
                for (int d = 0; d < dim; d++) wide[d] = WIDEN(rotated[d]);                                           \
                store_row(k + h * dim * el, wide, dim, kv_kind, k_inverse);                                          \
                for (int d = 0; d < dim; d++) wide[d] = WIDEN(vsrc[h * dim + d]);                                    \
                store_row(v + h * dim * el, wide, dim, kv_kind, v_inverse);                                          \
            }                                                                                                        \
        }                                                                                                            \
        return 0;                                                                                                    \
    }                                                                                                                \
    int rope_store_##SUFFIX(const T *qkv, const T *cos, const T *sin, const int64_t *slots, T *q_out,               \
                            void *key_cache, void *value_cache, int64_t tokens, int heads, int kv_heads, int dim,    \
                            int kv_kind, float k_inverse, float v_inverse, int threads) {                            \
        if (!rope_store_takes(heads, kv_heads, dim)) return 1;                                                       \
        TEAM_RUN(rope_users(tokens, threads),                                                                        \
                 rope_store_##SUFFIX##_part(qkv, cos, sin, slots, q_out, key_cache, value_cache, tokens, heads,      \
                                            kv_heads, dim, kv_kind, k_inverse, v_inverse, t, nt));                   \
    }

#endif
