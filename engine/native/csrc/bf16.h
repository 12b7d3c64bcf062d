/* bfloat16 <-> float32 for the kernels of the bfloat16 path (paged_decode.c, norm_act_bf16.c). A bfloat16 is
 * the high half of a float32: widening is exact (a shift), narrowing rounds to nearest even, as torch does. */
#ifndef PAGED_KV_BF16_H
#define PAGED_KV_BF16_H

#include <stdint.h>

#include "simd.h"

typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));

/* sixteen bfloat16 values widened to float32 */
static inline v16 widen16(const uint16_t *p) {
    return (v16)(__builtin_convertvector(*(const v16h *)p, v16u) << 16);
}

static inline float widen(uint16_t h) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)h << 16};
    return c.f;
}

/* float32 -> bfloat16, round to nearest even (a NaN stays a quiet NaN) */
static inline uint16_t narrow(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* sixteen float32 values narrowed to bfloat16 and stored (no NaN expected: activations of a finite model) */
static inline void narrow16(uint16_t *p, v16 x) {
    const v16u u = (v16u)x;
    *(v16h *)p = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, v16h);
}

/* x rounded to the nearest bfloat16, kept in float32 */
static inline v16 round16(v16 x) {
    const v16u u = (v16u)x;
    return (v16)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

static inline float round1(float f) { return widen(narrow(f)); }

#endif
