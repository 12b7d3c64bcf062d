/* The residual add with the RMSNorm after it, and the SwiGLU activation: each one pass over the rows instead of
 * torch's composite (RMSNorm in torch 2.13 on the CPU is six operations, an upcast, a square, a mean, an add, a
 * reciprocal square root and two products, about 25 microseconds a call at 16 rows of 256; the activation is a
 * silu, then a product, over a chunk view). Built with engine/native/__init__.py, with paged_decode.c.
 *
 * Not bit for bit torch's: the sum of squares is added up in a different order, and the exponential is the
 * polynomial of simd.h, so results differ from the torch form in the last bits (tests/test_native.py bounds it). The
 * same inputs always give the same bits (no thread count or timing changes an order of additions).
 *
 * Layouts (float32, contiguous):
 *   add_rms_norm: x [rows, n] (updated in place when delta is given: x += delta), weight [n], out [rows, n]
 *                 out = (x * 1 / sqrt(mean(x^2) + eps)) * weight, each product rounded on its own, as torch does
 *   silu_mul:     gate_up [rows, 2 * n] (gate, then up, as the fused projection lays them), out [rows, n]
 *                 out = silu(gate) * up, silu(g) = g * sigmoid(g)
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "row_walks.h"
#include "simd.h"


__attribute__((optimize("fp-contract=off")))
static void norm_row(float *restrict x, const float *restrict delta, const float *restrict weight,
                     float *restrict out, int n, float eps) {
    v16 part = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 v = *(v16 *)(x + i);
        if (delta) {
            v += *(const v16 *)(delta + i);
            *(v16 *)(x + i) = v;
        }
        part += v * v;
    }
    float tail = 0.0f;
    for (; i < n; i++) {
        if (delta) x[i] += delta[i];
        tail += x[i] * x[i];
    }
    float sum = tail;
    for (int l = 0; l < 16; l++) sum += part[l];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    i = 0;
    for (; i + 16 <= n; i += 16) *(v16 *)(out + i) = (*(v16 *)(x + i) * inv) * *(const v16 *)(weight + i);
    for (; i < n; i++) out[i] = (x[i] * inv) * weight[i];
}

ADD_RMS_NORM(float, f32, norm_row)

static void silu_mul_row(const float *restrict gate, const float *restrict up, float *restrict out, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16 g = *(const v16 *)(gate + i);
        const v16i negative = g < 0.0f;
        const v16 magnitude = (v16)((v16i)g & 0x7fffffff);
        const v16 e = exp16(-magnitude);            /* e^-|g|, in (0, 1] */
        const v16 one = (v16){0} + 1.0f;
        const v16 sig = (v16)(((v16i)(one / (one + e)) & ~negative) | ((v16i)(e / (one + e)) & negative));
        *(v16 *)(out + i) = (g * sig) * *(const v16 *)(up + i);
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

SILU_MUL(float, f32, silu_mul_row)
