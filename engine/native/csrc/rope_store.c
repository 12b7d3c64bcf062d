/* Rotary embedding of a step's queries and keys, and the keys and values written to their slots in the pool: what
 * engine/model/causal_lm.py does with six torch operations per layer (the rotation's roll, two products and a sum over q
 * and k, then two index_copy_ calls), in one pass. Built with engine/native/__init__.py, with paged_decode.c.
 *
 * Bit for bit what the torch form computes: x * cos + roll(x, dim / 2) * sin_signed, each product and the sum
 * rounded on its own (no fused multiply-add: see the function's attribute), as apply_rotary does.
 *
 * Layouts (float32, contiguous):
 *   qkv        [tokens, heads + 2 * kv_heads, dim]: q heads, then k heads, then v heads (the fused projection)
 *   cos, sin   [tokens, dim]: Rotary.cos_sin's tables at each token's position (sin with its first half negated)
 *   slots      int64 [tokens]: block * block_size + offset of each token
 *   q_out      [tokens, heads, dim]
 *   key/value  [num_blocks * block_size, kv_heads, dim], float32, or fp8 (stored as vLLM's cache write stores it:
 *              elements.h)
 */
#include <stdint.h>

#include "elements.h"
#include "kernels.h"
#include "row_walks.h"

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

static inline float same(float x) { return x; }

ROPE_STORE(float, f32, EL_F32, rotate, same)
