/* The element types a pool stores (float32, bfloat16, and the fp8 KV cache's two kinds), read as float32 vectors
 * by the one decode walk (paged_decode.c), and written by the cache write (row_walks.h's ROPE_STORE). Each kernel
 * takes a kind as a number, and the walks are written once with the kind as an argument that the compiler makes a
 * constant where they are inlined, so each kind gets its own loop without its own copy of the walk. */
#ifndef PAGED_KV_ELEMENTS_H
#define PAGED_KV_ELEMENTS_H

#include <stdint.h>

#include "bf16.h"
#include "simd.h"

/* engine/native/__init__.py's ELEMENT kinds */
enum { EL_F32 = 0, EL_BF16 = 1, EL_E4M3 = 2, EL_E5M2 = 3 };

static inline int el_valid(int kind) { return kind >= EL_F32 && kind <= EL_E5M2; }
static inline int64_t el_bytes(int kind) { return kind == EL_F32 ? 4 : kind == EL_BF16 ? 2 : 1; }
static inline int el_fp8(int kind) { return kind == EL_E4M3 || kind == EL_E5M2; }

typedef int8_t v16sb __attribute__((vector_size(16), aligned(1)));

/* fp8 codes read as float32, exactly: the code's sign, exponent and mantissa bits are put where float32's are, which
 * leaves the exponent 2^120 (e4m3; e5m2: 2^112) short, made up by one multiply that is exact (a subnormal code
 * becomes a float32 subnormal first, exact too). The code is widened with its sign extended, so one shift puts the
 * sign in bit 31 and the other seven bits under it, and one mask clears the copies of the sign between them (four
 * instructions for sixteen values, as many as a bfloat16 row's widening and its dot product's multiply-add). The
 * codes the cache write never makes (e4m3's NaN 0x7f, e5m2's infinities and NaNs) read as finite values: the pool
 * only holds what the engine wrote. */
static inline v16 e4m3_16(const uint8_t *p) {
    const v16u b = (v16u)__builtin_convertvector(*(const v16sb *)p, v16i);
    return (v16)((b << 20) & 0x87f00000u) * 0x1p120f;
}
static inline v16 e5m2_16(const uint8_t *p) {
    const v16u b = (v16u)__builtin_convertvector(*(const v16sb *)p, v16i);
    return (v16)((b << 21) & 0x8fe00000u) * 0x1p112f;
}
static inline float fp8_1(uint8_t b, int kind) {
    union { uint32_t u; float f; } c = {.u = ((uint32_t)(b & 0x80) << 24) |
                                              ((uint32_t)(b & 0x7f) << (kind == EL_E4M3 ? 20 : 21))};
    return c.f * (kind == EL_E4M3 ? 0x1p120f : 0x1p112f);
}

/* sixteen elements of kind `kind` from element i of a row, as float32 (exact for every kind) */
static inline __attribute__((always_inline)) v16 load16(const void *row, int64_t i, int kind) {
    switch (kind) {
    case EL_F32: return *(const v16 *)((const float *)row + i);
    case EL_BF16: return widen16((const uint16_t *)row + i);
    case EL_E4M3: return e4m3_16((const uint8_t *)row + i);
    default: return e5m2_16((const uint8_t *)row + i);
    }
}

static inline __attribute__((always_inline)) float load1(const void *row, int64_t i, int kind) {
    switch (kind) {
    case EL_F32: return ((const float *)row)[i];
    case EL_BF16: return widen(((const uint16_t *)row)[i]);
    default: return fp8_1(((const uint8_t *)row)[i], kind);
    }
}

/* sixteen elements as bfloat16 (the torch-order walk's operands): a bfloat16 row's own, an fp8 row's exactly (every
 * fp8 value is a bfloat16 value: its float32 bits end in sixteen zeros) */
static inline __attribute__((always_inline)) v16h load16_bf16(const void *row, int64_t i, int kind) {
    if (kind == EL_BF16) return *(const v16h *)((const uint16_t *)row + i);
    return __builtin_convertvector((v16u)load16(row, i, kind) >> 16, v16h);
}

/* vLLM's CPU cache write of one value (engine/kv/fp8.py, which the tests hold this to): x times the float32
 * reciprocal of the scale, clamped to the format's largest finite value (NaN to the positive one), +0 for a zero,
 * the mantissa cut toward zero */
static inline uint8_t to_e4m3(float x, float inverse) {
    float v = x * inverse;
    v = v != v ? 448.0f : v > 448.0f ? 448.0f : v < -448.0f ? -448.0f : v;
    if (v == 0.0f) return 0;
    union { float f; uint32_t u; } c = {.f = v * 0x1p-120f}; /* bias 127 -> 7: the code's bits, cut */
    return (uint8_t)(((c.u >> 24) & 0x80) | ((c.u >> 20) & 0x7f));
}

static inline uint8_t to_e5m2(float x, float inverse) {
    float v = x * inverse;
    v = v != v ? 57344.0f : v > 57344.0f ? 57344.0f : v < -57344.0f ? -57344.0f : v;
    if (v == 0.0f) return 0;
    union { float f; uint32_t u; } c = {.f = v};
    const uint8_t sign = (uint8_t)((c.u >> 24) & 0x80);
    const int exponent = (int)((c.u >> 23) & 0xff) - 127;
    if (exponent < -14) { /* a subnormal code: the significand in units of 2^-16 */
        const int shift = -14 - exponent + 21;
        if (shift >= 32) return sign;
        const uint32_t m = ((c.u & 0x7fffffu) | 0x800000u) >> shift;
        return (uint8_t)(sign | (m > 3 ? 3 : m));
    }
    return (uint8_t)(sign | ((exponent + 15) << 2) | ((c.u >> 21) & 3));
}

/* n float32 values into a row of kind `kind` (fp8: quantised with `inverse`; bfloat16: rounded to nearest even) */
static inline __attribute__((always_inline)) void store_row(void *row, const float *x, int n, int kind, float inverse) {
    for (int i = 0; i < n; i++) {
        switch (kind) {
        case EL_F32: ((float *)row)[i] = x[i]; break;
        case EL_BF16: ((uint16_t *)row)[i] = narrow(x[i]); break;
        case EL_E4M3: ((uint8_t *)row)[i] = to_e4m3(x[i], inverse); break;
        default: ((uint8_t *)row)[i] = to_e5m2(x[i], inverse); break;
        }
    }
}

#endif
