/* Rotary embedding of a step's queries and keys, and the keys and values written to their slots in the pool: what
 * engine/model.py does with six torch operations per layer (the rotation's roll, two products and a sum over q
 * and k, then two index_copy_ calls), in one pass. Built with engine/native.py, with paged_decode.c.
 *
 * Bit for bit what the torch form computes: x * cos + roll(x, dim / 2) * sin_signed, each product and the sum
 * rounded on its own (no fused multiply-add: see the function's attribute), as apply_rotary does.
 *
 * Layouts (float32, contiguous):
 *   qkv        [tokens, heads + 2 * kv_heads, dim]: q heads, then k heads, then v heads (the fused projection)
 *   cos, sin   [tokens, dim]: Rotary.cos_sin's tables at each token's position (sin with its first half negated)
 *   slots      int64 [tokens]: block * block_size + offset of each token
 *   q_out      [tokens, heads, dim]
 *   key/value  [num_blocks * block_size, kv_heads, dim]
 */
#include <stdint.h>

#include "kernels.h"

__attribute__((optimize("fp-contract=off")))
static void rotate(const float *restrict x, const float *restrict cos, const float *restrict sin, float *restrict out,
                   int dim) {
    const int half = dim / 2;
    for (int d = 0; d < half; d++) {
        const float a = x[d] * cos[d];
        const float b = x[d + half] * sin[d];
        out[d] = a + b;
    }
    for (int d = half; d < dim; d++) {
        const float a = x[d] * cos[d];
        const float b = x[d - half] * sin[d];
        out[d] = a + b;
    }
}

int rope_store_f32(const float *qkv, const float *cos, const float *sin, const int64_t *slots, float *q_out,
                   float *key_cache, float *value_cache, int64_t tokens, int heads, int kv_heads, int dim,
                   int threads) {
    if (!rope_store_takes(heads, kv_heads, dim)) return 1;
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * dim;
    if (tokens < 64) threads = 1;  /* waking a second thread costs more than a few tokens' work */
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = qkv + t * width;
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int h = 0; h < heads; h++) rotate(row + h * dim, c, s, q_out + (t * heads + h) * dim, dim);
        float *k = key_cache + slots[t] * kv_heads * dim;
        float *v = value_cache + slots[t] * kv_heads * dim;
        for (int h = 0; h < kv_heads; h++) rotate(row + (heads + h) * dim, c, s, k + h * dim, dim);
        const float *vsrc = row + (int64_t)(heads + kv_heads) * dim;
        for (int i = 0; i < kv_heads * dim; i++) v[i] = vsrc[i];
    }
    return 0;
}
