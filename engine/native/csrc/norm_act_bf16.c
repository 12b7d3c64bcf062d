/* The bfloat16 path's elementwise steps, one pass each instead of torch's chains of bfloat16 operations (each of
 * which reads and writes the whole tensor and rounds to bfloat16): the residual add with the RMSNorm after it, the
 * SwiGLU activation, and the rotary embedding with the step's K/V written to their slots.
 *
 * Each rounds to bfloat16 where transformers' bfloat16 Llama does (every torch operation on bfloat16 tensors
 * computes in float32 and rounds its result), so that the engine's greedy tokens stay with transformers':
 *   add_rms_norm   x = bf16(x + delta); out = bf16(weight * bf16(x * rsqrt(mean(x^2) + eps)))  (the mean in float32,
 *                  summed in torch's order)
 *   silu_mul       out = bf16(bf16(silu(gate)) * up)
 *   rope_store     out = bf16(bf16(x * cos) + bf16(roll(x, dim / 2) * sin_signed))
 * Layouts are engine/native/csrc/norm_act.c's and rope_store.c's, with uint16_t bfloat16 values.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "elements.h"
#include "kernels.h"
#include "row_walks.h"
#include "simd.h"


/* eight squares of widened bfloat16 values (exact in float32: 8-bit significands) */
static inline v8 squares8(const uint16_t *x) {
    const v8 v = (v8)(__builtin_convertvector(*(const v8h *)x, v8u) << 16);
    return v * v;
}

/* The sum of a row's squares in the order torch sums a contiguous float32 row (transformers' RMSNorm takes
 * pow(2).mean(-1), which is that sum divided by n), so that the norm is transformers' to the bit: vectors of 8
 * lanes, 4 accumulators taking every fourth vector, a cascade that folds them into the next level after each
 * level_step of steps (level_step = 2^max(4, ceil(log2(steps)) / 4)), the vectors past the last whole step into
 * the first accumulator, the accumulators added in order, and finally, from zero, the values past the last whole
 * vector and then the 8 lanes, one by one. (Read off ATen's SumKernel.cpp as it behaves on this machine's torch;
 * tests/test_parity_bf16.py checks it against transformers' LlamaRMSNorm at several widths.) */
static float torch_sum_of_squares(const uint16_t *x, int n) {
    enum { LANES = 8, ILP = 4, LEVELS = 4 };
    const int vectors = n / LANES, steps = vectors / ILP;
    int ceil_log2 = 0;
    while ((1 << ceil_log2) < steps) ceil_log2++;
    const int power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4, level_step = 1 << power;
    v8 acc[LEVELS][ILP];
    for (int j = 0; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++) acc[j][k] = (v8){0};
    int i = 0;
    while (i + level_step <= steps) {
        for (int j = 0; j < level_step; j++, i++)
            for (int k = 0; k < ILP; k++) acc[0][k] += squares8(x + (i * ILP + k) * LANES);
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++) {
                acc[j][k] += acc[j - 1][k];
                acc[j - 1][k] = (v8){0};
            }
            if (i & ((level_step - 1) << (j * power))) break;
        }
    }
    for (; i < steps; i++)
        for (int k = 0; k < ILP; k++) acc[0][k] += squares8(x + (i * ILP + k) * LANES);
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++) acc[0][k] += acc[j][k];
    for (int v = steps * ILP; v < vectors; v++) acc[0][0] += squares8(x + v * LANES);
    v8 total = acc[0][0];
    for (int k = 1; k < ILP; k++) total += acc[0][k];
    float sum = 0.0f;
    for (int t = vectors * LANES; t < n; t++) sum += widen(x[t]) * widen(x[t]);
    for (int l = 0; l < LANES; l++) sum += total[l];
    return sum;
}

__attribute__((optimize("fp-contract=off")))
static void norm_row_bf16(uint16_t *restrict x, const uint16_t *restrict delta, const uint16_t *restrict weight,
                          uint16_t *restrict out, int n, float eps) {
    int i = 0;
    if (delta) {
        for (; i + 16 <= n; i += 16) narrow16(x + i, widen16(x + i) + widen16(delta + i));
        for (; i < n; i++) x[i] = narrow(widen(x[i]) + widen(delta[i]));
    }
    const float inv = 1.0f / sqrtf(torch_sum_of_squares(x, n) / (float)n + eps);
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

ROPE_STORE(uint16_t, bf16, EL_BF16, rotate_bf16, widen)
