/* The element types a pool stores (float32, bfloat16, and the fp8 KV cache's two kinds), read as float32 vectors
 * by the one decode walk (paged_decode.c), and written by the cache write (row_walks.h's ROPE_STORE). Each kernel
 * takes a kind as a number, and the walks are written once with the kind as an argument that the compiler makes a
 * constant where they are inlined, so each kind gets its own loop without its own copy of the walk. */
#ifndef PAGED_KV_ELEMENTS_H
#define PAGED_KV_ELEMENTS_H

#include <stdint.h>

#include "bf16.h"
#include "simd.h"

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* engine/native/__init__.py's ELEMENT kinds */
enum { EL_F32 = 0, EL_BF16 = 1, EL_E4M3 = 2, EL_E5M2 = 3 };

static inline int el_valid(int kind) { return kind >= EL_F32 && kind <= EL_E5M2; }
static inline int64_t el_bytes(int kind) { return kind == EL_F32 ? 4 : kind == EL_BF16 ? 2 : 1; }
static inline int el_fp8(int kind) { return kind == EL_E4M3 || kind == EL_E5M2; }

typedef int8_t v16sb __attribute__((vector_size(16), aligned(1)));
typedef uint8_t v16ub __attribute__((vector_size(16), aligned(1)));
typedef int16_t v16hs __attribute__((vector_size(32)));

/* What a read of kind `kind` is short of: the decode walk reads an e4m3 code as its value times 2^-8 (exactly: the
 * scaling of a product or a sum by a power of two rounds as the unscaled one does), and multiplies a score or an
 * output by 256 once instead of every element by it. */
static inline float el_unit(int kind) { return kind == EL_E4M3 ? 256.0f : 1.0f; }

/* Sixteen fp8 codes as float32 through half precision, which both kinds fit into with a shift: e5m2 is the high byte
 * of a float16 (exactly its value), e4m3's seven bits under float16's sign have float16's bias of 15 where e4m3's is
 * 7 (its value times 2^-8, subnormal codes included, since float16 has subnormals where e4m3 does). The hardware's
 * float16 widening takes subnormals at full speed; the first version built float32 bits and multiplied by 2^120,
 * which went through the processor's slow path for every subnormal code (docs/engine.md, "fp8 reads"). */
static inline v16 half16(v16h h) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps((__m256i)h);
#elif defined(__F16C__)
    const __m128i lo = (__m128i)__builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m128i hi = (__m128i)__builtin_shufflevector(h, h, 8, 9, 10, 11, 12, 13, 14, 15);
    const v8 a = (v8)_mm256_cvtph_ps(lo), b = (v8)_mm256_cvtph_ps(hi);
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else /* float16's bits moved into float32's, and float32's bias made up by a multiply (exact) */
    const v16u u = __builtin_convertvector(h, v16u);
    return (v16)(((u & 0x8000u) << 16) | ((u & 0x7fffu) << 13)) * 0x1p112f;
#endif
}

/* sixteen e4m3 codes, their values times 2^-8 (el_unit): sign-extended to sixteen bits, the sign lands in bit 15
 * after the shift, and the mask clears its copy in bit 14 */
static inline v16 e4m3_16(const uint8_t *p) {
#if defined(__AVX2__)
    /* (GCC splits the generic widening below into two halves and an insert, three times the instructions) */
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return half16((v16h)_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xbf80)));
#else
    const v16h w = (v16h)__builtin_convertvector(*(const v16sb *)p, v16hs);
    return half16((w << 7) & 0xbf80);
#endif
}
static inline v16 e5m2_16(const uint8_t *p) {
#if defined(__AVX2__)
    return half16((v16h)_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
#else
    return half16(__builtin_convertvector(*(const v16ub *)p, v16h) << 8);
#endif
}
/* one code, as e4m3_16 and e5m2_16 read it (e4m3: its value times 2^-8) */
static inline float fp8_1(uint8_t b, int kind) {
    union { uint32_t u; float f; } c = {.u = ((uint32_t)(b & 0x80) << 24) |
                                              ((uint32_t)(b & 0x7f) << (kind == EL_E4M3 ? 20 : 21))};
    return c.f * 0x1p112f;
}

/* sixteen elements of kind `kind` from element i of a row, as float32: exactly their values over el_unit(kind) */
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
    return __builtin_convertvector((v16u)(load16(row, i, kind) * el_unit(kind)) >> 16, v16h);
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

/* sixteen lanes of a where m is set, of b elsewhere (m: a comparison's all-ones or zero lanes) */
static inline v16 pick16(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }

/* x * inverse, NaN made `top`, clamped to [-top, top]: the first steps of both cache writes below */
static inline v16 clamp16(v16 x, float inverse, float top) {
    v16 v = x * inverse;
    v = pick16(v != v, splat16(top), v);
    v = pick16(v > top, splat16(top), v);
    return pick16(v < -top, splat16(-top), v);
}

/* to_e4m3 of sixteen values, the same operations lane by lane (a subnormal code's multiply takes the processor's
 * slow path once for sixteen, not sixteen times) */
static inline v16i to_e4m3_16(v16 x, float inverse) {
    const v16 v = clamp16(x, inverse, 448.0f);
    const v16u c = (v16u)(v * 0x1p-120f);
    const v16i code = (v16i)(((c >> 24) & 0x80u) | ((c >> 20) & 0x7fu));
    return code & ~(v16i)(v == 0.0f);
}

/* to_e5m2 of sixteen values, in integers: the exponent rebiased, or a subnormal code's significand shifted */
static inline v16i to_e5m2_16(v16 x, float inverse) {
    const v16 v = clamp16(x, inverse, 57344.0f);
    const v16u c = (v16u)v;
    const v16i sign = (v16i)((c >> 24) & 0x80u);
    const v16i exponent = (v16i)((c >> 23) & 0xffu) - 127;
    const v16i normal = sign | ((exponent + 15) << 2) | (v16i)((c >> 21) & 3u);
    v16i shift = -14 - exponent + 21; /* used where exponent < -14: at least 22; from 32 on the code is the sign */
    shift = (shift & ~(v16i)(shift > 31)) | ((v16i){0} + 31 & (v16i)(shift > 31)); /* 31 shifts the 24 bits out */
    v16i m = (v16i)(((c & 0x7fffffu) | 0x800000u) >> (v16u)shift);
    m = (m & ~(v16i)(m > 3)) | ((v16i){0} + 3 & (v16i)(m > 3));
    const v16i tiny = (v16i)(exponent < -14);
    return (((sign | m) & tiny) | (normal & ~tiny)) & ~(v16i)(v == 0.0f);
}

/* n float32 values into a row of kind `kind` (fp8: quantised with `inverse`; bfloat16: rounded to nearest even) */
static inline __attribute__((always_inline)) void store_row(void *row, const float *x, int n, int kind, float inverse) {
    int i = 0;
    if (el_fp8(kind)) /* sixteen at a time: one value at a time, a long prompt's K/V writes cost more than its dots */
        for (; i + 16 <= n; i += 16) {
            const v16 v = *(const v16 *)(x + i);
            const v16i code = kind == EL_E4M3 ? to_e4m3_16(v, inverse) : to_e5m2_16(v, inverse);
            *(v16ub *)((uint8_t *)row + i) = __builtin_convertvector(code, v16ub);
        }
    for (; i < n; i++) {
        switch (kind) {
        case EL_F32: ((float *)row)[i] = x[i]; break;
        case EL_BF16: ((uint16_t *)row)[i] = narrow(x[i]); break;
        case EL_E4M3: ((uint8_t *)row)[i] = to_e4m3(x[i], inverse); break;
        default: ((uint8_t *)row)[i] = to_e5m2(x[i], inverse); break;
        }
    }
}

#endif
