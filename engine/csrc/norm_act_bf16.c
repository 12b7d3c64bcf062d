/* The bfloat16 path's elementwise steps, one pass each instead of torch's chains of bfloat16 operations (each of
 * which reads and writes the whole tensor and rounds to bfloat16): the residual add with the RMSNorm after it, the
 * SwiGLU activation, and the rotary embedding with the step's K/V written to their slots.
 *
 * Each rounds to bfloat16 where transformers' bfloat16 Llama does (every torch operation on bfloat16 tensors
 * computes in float32 and rounds its result), so that the engine's greedy tokens stay with transformers':
 *   add_rms_norm   x = bf16(x + delta); out = bf16(weight * bf16(x * rsqrt(mean(x^2) + eps)))  (the mean in float32)
 *   silu_mul       out = bf16(bf16(silu(gate)) * up)
 *   rope_store     out = bf16(bf16(x * cos) + bf16(roll(x, dim / 2) * sin_signed))
 * Layouts are engine/csrc/norm_act.c's and rope_store.c's, with uint16_t bfloat16 values.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"
#include "row_walks.h"
#include "simd.h"


__attribute__((optimize("fp-contract=off")))
static void norm_row_bf16(uint16_t *restrict x, const uint16_t *restrict delta, const uint16_t *restrict weight,
                          uint16_t *restrict out, int n, float eps) {
    v16 part = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 v = widen16(x + i);
        if (delta) {
            v = round16(v + widen16(delta + i));
            narrow16(x + i, v);
        }
        part += v * v;
    }
    float tail = 0.0f;
    for (; i < n; i++) {
        if (delta) x[i] = narrow(widen(x[i]) + widen(delta[i]));
        tail += widen(x[i]) * widen(x[i]);
    }
    float sum = tail;
    for (int l = 0; l < 16; l++) sum += part[l];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    i = 0;
    for (; i + 16 <= n; i += 16) narrow16(out + i, round16(widen16(x + i) * inv) * widen16(weight + i));
    for (; i < n; i++) out[i] = narrow(round1(widen(x[i]) * inv) * widen(weight[i]));
}

ADD_RMS_NORM(uint16_t, bf16, norm_row_bf16)

__attribute__((optimize("fp-contract=off")))
static void silu_mul_row_bf16(const uint16_t *restrict gate, const uint16_t *restrict up, uint16_t *restrict out,
                              int n) {
    int i = 0;
    const v16 one = (v16){0} + 1.0f;
    for (; i + 16 <= n; i += 16) {
        const v16 g = widen16(gate + i);
        const v16 e = exp16(-(v16)((v16i)g & 0x7fffffff)); /* e^-|g|, in (0, 1] */
        const v16i negative = g < 0.0f;
        const v16 sig = (v16)(((v16i)(one / (one + e)) & ~negative) | ((v16i)(e / (one + e)) & negative));
        narrow16(out + i, round16(g * sig) * widen16(up + i));
    }
    for (; i < n; i++) {
        const float g = widen(gate[i]);
        out[i] = narrow(round1(g / (1.0f + expf(-g))) * widen(up[i]));
    }
}

SILU_MUL(uint16_t, bf16, silu_mul_row_bf16)

__attribute__((optimize("fp-contract=off")))
static void rotate_bf16(const uint16_t *restrict x, const uint16_t *restrict cos, const uint16_t *restrict sin,
                        uint16_t *restrict out, int dim) {
    const int half = dim / 2;
    for (int d = 0; d < dim; d++) {
        const float a = round1(widen(x[d]) * widen(cos[d]));
        const float b = round1(widen(x[d < half ? d + half : d - half]) * widen(sin[d]));
        out[d] = narrow(a + b);
    }
}

ROPE_STORE(uint16_t, bf16, rotate_bf16)
