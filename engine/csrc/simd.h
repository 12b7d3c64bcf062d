/* Vector types and the sixteen-wide exponential shared by the kernels in this folder (a change here rebuilds them
 * all: engine/native.py hashes the headers with the sources). */
#ifndef PAGED_KV_SIMD_H
#define PAGED_KV_SIMD_H

#include <stdint.h>

/* GCC/clang vector types: one AVX-512 register where the machine has it, pairs or quads of narrower ones elsewhere
 * (the compiler splits them); unaligned, since rows start anywhere a float may. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));

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
