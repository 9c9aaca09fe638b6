/* The elementwise bfloat16 ops of a LLaMA layer on the CPU, one pass each: RMSNorm (with the
 * residual add before it fused in), SwiGLU's silu(gate) * up, and the rotary embedding.
 *
 * Why: in torch each is four to eight ops (a float32 copy, pow, mean, rsqrt, two muls, a cast;
 * roll, two muls and an add for each of q and k), each a dispatch of a few microseconds and a
 * pass over memory. A SmolLM2-135M decode step at batch 1 spent ~13 ms of its 29 outside the
 * linears and attention on the 2-core AMD EPYC Zen 4, F.rms_norm alone 33 us a call.
 *
 * Numerics are torch's eager bf16 ops, rounding where they round: every op widens bf16 to
 * float32, computes, and rounds to nearest even once, so each intermediate torch rounds to bf16
 * is rounded here too (the rotary's two products and their sum; silu before the product; the
 * normalised row before the weight). Products of two bf16 values are exact in float32, so those
 * steps are bit for bit torch's; the norm's sum of squares (a different summation order) and
 * silu's exp (exp512, ~1e-8 relative) may differ from torch in the last float32 bits, which moves
 * a bf16 rounding now and then (fastserve.kernels.reference holds the semantics; tests/unit/test_cpu_elementwise.py
 * bounds the difference).
 *
 * Rows are contiguous runs of bf16 with a row stride (views of a merged projection's output are
 * taken in place); outputs are contiguous. Rows are shared out over num_threads OpenMP threads
 * once a call has PARALLEL_MIN_ELEMENTS elements: below ~10K a team's start costs what it saves.
 * At 65,536 a batch-32 SmolLM2 step ran its 61 norms (18,432 elements each) on one thread:
 * 0.58 ms a step, 0.40 on two (2-core AMD EPYC Zen 4), and the rotary call 0.28 -> 0.18.
 * Built by fastserve/kernels/cpu_elementwise.py like fastserve/kernels/cpu/paged_attention.c; without AVX-512 BF16
 * (and BW/VL, which every such CPU has) in the compiler's target, elementwise_bf16_available()
 * returns 0 and nothing else is defined.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "simd_math.h"

#define LANES 16
#define PARALLEL_MIN_ELEMENTS 16384

int elementwise_bf16_available(void) { return 1; }

static inline __mmask16 lanes_left(int64_t n, int64_t i) {
    return n - i >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
}

/* Up to 16 bf16 (masked) widened to float32 exactly. */
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* v rounded to bf16 (nearest even) and widened back: where torch stores a bf16 intermediate. */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* out[r] = weight * bf16(v * rsqrt(mean(v^2) + eps)), v = x[r] in float32; with delta, first
 * sum[r] = bf16(x[r] + delta[r]) and v = sum[r] (the residual add before the norm). */
int rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *delta, int64_t delta_stride,
                  uint16_t *sum, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t cols,
                  float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *v = x + r * x_stride;
        if (delta) {
            const uint16_t *d = delta + r * delta_stride;
            uint16_t *s = sum + r * cols;
            for (int64_t i = 0; i < cols; i += LANES) {
                const __mmask16 m = lanes_left(cols, i);
                store_bf16(s + i, _mm512_add_ps(load_bf16(v + i, m), load_bf16(d + i, m)), m);
            }
            v = s;
        }
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < cols; i += LANES) {
            const __m512 a = load_bf16(v + i, lanes_left(cols, i));
            squares = _mm512_fmadd_ps(a, a, squares);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)cols + eps));
        uint16_t *o = out + r * cols;
        for (int64_t i = 0; i < cols; i += LANES) {
            const __mmask16 m = lanes_left(cols, i);
            const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(v + i, m), inv));
            store_bf16(o + i, _mm512_mul_ps(load_bf16(weight + i, m), normed), m);
        }
    }
    return 0;
}

/* out[r] = bf16(bf16(silu(gate[r])) * up[r]), silu(g) = g / (1 + exp(-g)). */
int silu_mul_bf16(const uint16_t *gate, int64_t gate_stride, const uint16_t *up, int64_t up_stride,
                  uint16_t *out, int64_t rows, int64_t cols, int num_threads) {
    const __m512 one = _mm512_set1_ps(1.0f), arg_max = _mm512_set1_ps(EXP_ARG_MAX);
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *g = gate + r * gate_stride, *u = up + r * up_stride;
        uint16_t *o = out + r * cols;
        for (int64_t i = 0; i < cols; i += LANES) {
            const __mmask16 m = lanes_left(cols, i);
            const __m512 a = load_bf16(g + i, m);
            const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), arg_max));
            const __m512 silu = round_bf16(_mm512_div_ps(a, _mm512_add_ps(one, e)));
            store_bf16(o + i, _mm512_mul_ps(silu, load_bf16(u + i, m)), m);
        }
    }
    return 0;
}

/* The half-split rotary embedding of x [tokens][heads][head_dim] (token rows token_stride apart,
 * heads contiguous within a row) into out [tokens][heads][head_dim], contiguous:
 * out = bf16(bf16(x * cos) + bf16(roll(x, head_dim / 2) * signed_sin)), cos and signed_sin
 * [tokens][head_dim] contiguous (signed_sin's first half negated). head_dim / 2 must be a
 * multiple of 16 (the caller checks). */
int rope_bf16(const uint16_t *x, int64_t token_stride, int64_t heads, int64_t head_dim, const uint16_t *cos,
              const uint16_t *signed_sin, uint16_t *out, int64_t tokens, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *c = cos + t * head_dim, *s = signed_sin + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t *xh = x + t * token_stride + h * head_dim;
            uint16_t *o = out + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < head_dim; i += LANES) {
                const int64_t partner = i < half ? i + half : i - half;
                const __m512 a = round_bf16(_mm512_mul_ps(load_bf16(xh + i, 0xFFFF), load_bf16(c + i, 0xFFFF)));
                const __m512 b = round_bf16(_mm512_mul_ps(load_bf16(xh + partner, 0xFFFF), load_bf16(s + i, 0xFFFF)));
                store_bf16(o + i, _mm512_add_ps(a, b), 0xFFFF);
            }
        }
    }
    return 0;
}
#else
int elementwise_bf16_available(void) { return 0; }
#endif
