/* Vector types and the sixteen-wide exponential shared by the kernels in this folder (a change here rebuilds them
 * all: engine/native/__init__.py hashes the headers with the sources). */
#ifndef PAGED_KV_SIMD_H
#define PAGED_KV_SIMD_H

#include <stdint.h>

/* GCC/clang vector types: one AVX-512 register where the machine has it, pairs or quads of narrower ones elsewhere
 * (the compiler splits them); unaligned, since rows start anywhere a float may. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* a * b + c with one rounding where the machine has fused multiply-add. The build is ISO C (-std=c11), where GCC
 * does not fuse `a * b + c` itself: the float32 panel GEMM's `acc += x * w` ran as a multiply and an add, half the
 * multiply-add rate (the 3M config's 17 linears at 64 rows: 98 GFLOP/s on one core whose fused peak is 239). */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline v16 splat16(float s) { return (v16)_mm512_set1_ps(s); }
#elif defined(__FMA__)
#include <immintrin.h>
static inline v16 fma16(v16 a, v16 b, v16 c) {
    const __m256 lo = _mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                      (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                      (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 hi = _mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                                      (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                      (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector((v8)lo, (v8)hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
static inline v16 fma16(v16 a, v16 b, v16 c) { return a * b + c; }
#endif
#if !defined(__AVX512F__)
/* s in all sixteen lanes (a plain broadcast: `(v16){0} + s` costs an add, which may not be dropped for -0) */
static inline v16 splat16(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
#endif

/* e^x, sixteen at a time, for x <= 0 (scores minus their maximum; -inf gives about 1e-38): Cody-Waite reduction
 * to r in [-ln2/2, ln2/2] and the Cephes polynomial, about 1 ulp from expf. The C library's expf was called once
 * per score, a fifth of the kernel's time. */
static inline v16 exp16(v16 x) {
    const v16 floor_ = (v16){0} - 87.0f;
    const v16i below = x < floor_;
    x = (v16)(((v16i)x & ~below) | ((v16i)floor_ & below));
    const v16i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v16i); /* round(x / ln2), x <= 0 */
    const v16 nf = __builtin_convertvector(n, v16);
    const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v16)((n + 127) << 23);
}

#endif
