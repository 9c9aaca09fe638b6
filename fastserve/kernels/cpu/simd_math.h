/* AVX-512 math shared by the CPU kernels in this folder (included after <immintrin.h>, inside
 * their __AVX512F__ sections). fastserve/kernels/cpu_ops.py keys its build cache on these headers too. */
#ifndef FASTSERVE_SIMD_MATH_H
#define FASTSERVE_SIMD_MATH_H

/* exp(x) of 16 floats, to ~1e-8 relative (used for x <= 0, scores less their max, and for
 * silu's exp(-x), which overflows to +inf past 88.7 as expf does): x = n ln2 + r, |r| <= ln2/2, exp(r) by its Taylor
 * polynomial to r^7 (truncation < 1e-8 relative), times 2^n by scalef (underflows to 0). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* exp's argument bound for silu: exp(104) is +inf in float32 (as expf), and the clamp keeps
 * exp512's range reduction exact for any input (elementwise_bf16.c's silu_mul and
 * linear_bf16.c's fused SwiGLU, which must agree bit for bit). */
#define EXP_ARG_MAX 104.0f

/* 16 bf16 widened to float32: zero-extend each to 32 bits, shift into the high half. */
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#endif
