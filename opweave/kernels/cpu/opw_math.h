/* Helpers of the OpWeave CPU kernels: a float32 dot product and a vectorisable exp for x <= 0. */
#ifndef OPW_MATH_H
#define OPW_MATH_H

#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* sum of a[i] * b[i], i < n: one 16-lane accumulator, reduced once */
static inline float dot(const float *restrict a, const float *restrict b, int n) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}
#else
/* sum of a[i] * b[i], i < n: 16 independent partial sums, so the compiler vectorises it without
 * reassociating one running sum (no -ffast-math) */
static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++)
            part[j] += a[i + j] * b[i + j];
    for (int w = 8; w >= 1; w /= 2)  /* a tree, not a chain of 16 dependent adds */
        for (int j = 0; j < w; j++)
            part[j] += part[j + w];
    float s = part[0];
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}
#endif

/* exp(x) for x <= 0 (x < -87 gives 0): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-7
 * Taylor polynomial (relative error below 2e-7, a few float ulps); branch-free, so the compiler
 * vectorises a loop of it (glibc's expf is a call per element). */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;  /* Horner steps as fused multiply-adds (one rounding each) */
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return x <= -87.0f ? 0.0f : p * scale.f;
}

#endif
