/* A bfloat16 linear layer for the CPU, y = x W^T (+ bias), on AVX-512 BF16's vdpbf16ps: bf16
 * pairs multiplied exactly and summed in float32, one rounding to bf16 at the end, as oneDNN's
 * bf16 GEMM does.
 *
 * Why our own: oneDNN's packed bf16 GEMM (torch.ops.mkldnn) streams a decode step's weights at
 * 11-17 GB/s on the 2-core AMD EPYC Zen 4, well under the 21-24 GB/s the machine reads; this
 * kernel reads them at 20-26 GB/s at 1-8 rows. SmolLM2-135M's 30 layers of linears (q/k/v and
 * gate/up merged, cold weights, median of 15): 1 row 12.9 -> 8.6 ms, 8 rows 14.7 -> 10.5,
 * 16 rows 20.5 -> 13.4, 256 rows 164 -> 148 (0.67x / 0.72x / 0.65x / 0.90x); a whole 2,048-row
 * prompt on par (0.95-1.02x per weight, rows in panels of ROW_PANEL).
 *
 * Layout (linear_bf16_pack): W [N, K] row-major becomes [N/16][K/2][16][2]: for a block of 16
 * outputs, each k pair of all 16 sits in one 64-byte line, i.e. one register, and a block's
 * weights are one contiguous stream. A task is two adjacent blocks (32 outputs), so each
 * broadcast of an input pair feeds two dot products; up to MAX_ROWS rows share every weight
 * register; a single row runs four independent accumulator chains. Tasks are shared out over
 * num_threads OpenMP threads. Requires K even and N a multiple of 32 (the caller checks).
 *
 * Built by fastserve/kernels/cpu_linear.py like fastserve/kernels/cpu/paged_attention.c; without AVX-512 BF16 in
 * the compiler's target, linear_bf16_available() returns 0 and nothing else is defined.
 */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "simd_math.h"

#define NB 16        /* outputs per block: one register of float32 */
#define MAX_ROWS 8   /* rows sharing each weight register: 8 rows x 2 blocks = 16 accumulators */
#define LINE 64      /* bytes of a cache line: one k pair of a block, one register */
#define ROW_PANEL 256 /* rows whose x one pass over the weights reads: 256 x 1,536 bf16 = 768 KB */

int linear_bf16_available(void) { return 1; }

/* w [n][k] bf16, row-major -> out [n/16][k/2][16][2]. */
void linear_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    for (int64_t nb = 0; nb < n / NB; ++nb)
        for (int64_t kp = 0; kp < k / 2; ++kp)
            for (int j = 0; j < NB; ++j) {
                const uint16_t *src = w + (nb * NB + j) * k + 2 * kp;
                uint16_t *dst = out + ((nb * (k / 2) + kp) * NB + j) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

/* R rows (1..MAX_ROWS) times two adjacent blocks of 16 outputs: each broadcast of an input pair
 * feeds two dot products, and each weight register R of them. Meanwhile the weight lines of
 * another block's stream, pf_a and pf_b (each kpairs lines, or NULL), are asked into L2, one
 * line of each per k pair (see next_task_streams). */
static inline __attribute__((always_inline)) void block_rows(
        const uint16_t *pw0, const uint16_t *pw1, int64_t kpairs, const uint16_t *x, int64_t x_stride,
        int R, const char *pf_a, const char *pf_b, float *acc_out /* [R][32] */) {
    __m512 acc[MAX_ROWS][2];
    for (int r = 0; r < R; ++r) { acc[r][0] = _mm512_setzero_ps(); acc[r][1] = _mm512_setzero_ps(); }
    if (R == 1) {   /* one row: four independent chains (two k halves x two blocks) */
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        const int32_t *xr = (const int32_t *)x;
        int64_t kp = 0;
        for (; kp + 2 <= kpairs; kp += 2) {
            if (pf_a) { _mm_prefetch(pf_a + kp * LINE, _MM_HINT_T1); _mm_prefetch(pf_a + (kp + 1) * LINE, _MM_HINT_T1); }
            if (pf_b) { _mm_prefetch(pf_b + kp * LINE, _MM_HINT_T1); _mm_prefetch(pf_b + (kp + 1) * LINE, _MM_HINT_T1); }
            const __m512bh b0 = (__m512bh)_mm512_set1_epi32(xr[kp]), b1 = (__m512bh)_mm512_set1_epi32(xr[kp + 1]);
            acc[0][0] = _mm512_dpbf16_ps(acc[0][0], b0, (__m512bh)_mm512_loadu_si512(pw0 + kp * 32));
            acc[0][1] = _mm512_dpbf16_ps(acc[0][1], b0, (__m512bh)_mm512_loadu_si512(pw1 + kp * 32));
            a2 = _mm512_dpbf16_ps(a2, b1, (__m512bh)_mm512_loadu_si512(pw0 + kp * 32 + 32));
            a3 = _mm512_dpbf16_ps(a3, b1, (__m512bh)_mm512_loadu_si512(pw1 + kp * 32 + 32));
        }
        for (; kp < kpairs; ++kp) {
            if (pf_a) _mm_prefetch(pf_a + kp * LINE, _MM_HINT_T1);
            if (pf_b) _mm_prefetch(pf_b + kp * LINE, _MM_HINT_T1);
            const __m512bh b0 = (__m512bh)_mm512_set1_epi32(xr[kp]);
            acc[0][0] = _mm512_dpbf16_ps(acc[0][0], b0, (__m512bh)_mm512_loadu_si512(pw0 + kp * 32));
            acc[0][1] = _mm512_dpbf16_ps(acc[0][1], b0, (__m512bh)_mm512_loadu_si512(pw1 + kp * 32));
        }
        acc[0][0] = _mm512_add_ps(acc[0][0], a2);
        acc[0][1] = _mm512_add_ps(acc[0][1], a3);
    } else {
        for (int64_t kp = 0; kp < kpairs; ++kp) {
            if (pf_a) _mm_prefetch(pf_a + kp * LINE, _MM_HINT_T1);
            if (pf_b) _mm_prefetch(pf_b + kp * LINE, _MM_HINT_T1);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pw0 + kp * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pw1 + kp * 32);
            for (int r = 0; r < R; ++r) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32(((const int32_t *)(x + r * x_stride))[kp]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(acc_out + r * 32, acc[r][0]);
        _mm512_storeu_ps(acc_out + r * 32 + 16, acc[r][1]);
    }
}

/* block_rows with R (1..MAX_ROWS) a constant in each branch, so its accumulators stay in registers. */
static inline void rows_of_two_blocks(const uint16_t *pw0, const uint16_t *pw1, int64_t kpairs, const uint16_t *x,
                                      int64_t x_stride, int R, const char *pf_a, const char *pf_b,
                                      float *acc_out) {
    switch (R) {
    case 1: block_rows(pw0, pw1, kpairs, x, x_stride, 1, pf_a, pf_b, acc_out); break;
    case 2: block_rows(pw0, pw1, kpairs, x, x_stride, 2, pf_a, pf_b, acc_out); break;
    case 3: block_rows(pw0, pw1, kpairs, x, x_stride, 3, pf_a, pf_b, acc_out); break;
    case 4: block_rows(pw0, pw1, kpairs, x, x_stride, 4, pf_a, pf_b, acc_out); break;
    case 5: block_rows(pw0, pw1, kpairs, x, x_stride, 5, pf_a, pf_b, acc_out); break;
    case 6: block_rows(pw0, pw1, kpairs, x, x_stride, 6, pf_a, pf_b, acc_out); break;
    case 7: block_rows(pw0, pw1, kpairs, x, x_stride, 7, pf_a, pf_b, acc_out); break;
    default: block_rows(pw0, pw1, kpairs, x, x_stride, 8, pf_a, pf_b, acc_out); break;
    }
}

/* The next task's two weight streams (next0, next1: each kpairs lines; NULL after the call's
 * last task), asked into L2 over this task's row groups: group 0 asks for next0, group 1
 * for next1, later groups nothing; a task of one group asks for both. Why: a decode step's
 * weights are cold, and a task's first row group reads its 36-98 KB from DRAM while the later
 * groups find them in L2, so both threads' first groups at once ask ~2x what the machine
 * reads, then nothing. Fetched a task ahead, the demand is even. The 2-core AMD EPYC Zen 4,
 * SmolLM2-135M's 30 layers of linears and its LM head, cold weights, interleaved A/B (median
 * of 15): 32 rows 19.5 -> 18.0 ms and 5.33 -> 4.25 ms (349 -> 377 and 340 -> 427 GFLOP/s);
 * 16 rows 11.5 -> 9.6 and 3.20 -> 2.33; 8 rows 7.9 -> 6.8; 64 rows 36.2 -> 35.3 and 9.4 -> 8.6;
 * 1 and 256 rows within noise. */
static inline void next_task_streams(const char *next0, const char *next1, int64_t group, int one_group,
                                     const char **pf_a, const char **pf_b) {
    *pf_a = group == 0 ? next0 : group == 1 ? next1 : NULL;
    *pf_b = one_group ? next1 : NULL;
}

/* A task's row group: rows r0 .. r0 + R of the panel [p0, p1) times its two blocks (pw0, pw1)
 * into acc [R][32], asking meanwhile for the group's share of the next task's streams. Returns R. */
static inline __attribute__((always_inline)) int task_row_group(
        const uint16_t *pw0, const uint16_t *pw1, int64_t kpairs, const uint16_t *x, int64_t x_stride, int64_t p0,
        int64_t p1, int64_t r0, const char *next0, const char *next1, float *acc) {
    const int R = p1 - r0 < MAX_ROWS ? (int)(p1 - r0) : MAX_ROWS;
    const char *pf_a, *pf_b;
    next_task_streams(next0, next1, (r0 - p0) / MAX_ROWS, p1 - p0 <= MAX_ROWS, &pf_a, &pf_b);
    rows_of_two_blocks(pw0, pw1, kpairs, x + r0 * x_stride, x_stride, R, pf_a, pf_b, acc);
    return R;
}

/* 16 floats rounded to bf16 (nearest even) and widened back: a value torch would store as bf16. */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* y [m][n] = x [m][k] bf16 (rows x_stride apart) times the packed W, transposed, plus bias
 * (float32 [n], or NULL), rounded once to bf16: into y as bf16, or (y NULL) into y_f32 as those
 * bf16 values widened to float32. */
static inline __attribute__((always_inline)) void linear_rows(
        const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *packed, int64_t n,
        const float *bias, uint16_t *y, float *y_f32, int num_threads) {
    const int64_t kpairs = k / 2, tasks = n / (2 * NB);
    /* Rows in panels, so a panel of x stays in L2 while every task streams past it: with all of
     * a 2,048-row prompt at once each task re-read x from L3 (3,072x576 weight: 33 vs oneDNN's
     * 19 ms; by panels, on par). */
    for (int64_t p0 = 0; p0 < m; p0 += ROW_PANEL) {
    const int64_t p1 = p0 + ROW_PANEL < m ? p0 + ROW_PANEL : m;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t t = 0; t < tasks; ++t) {
        const uint16_t *pw0 = packed + 2 * t * kpairs * 32, *pw1 = pw0 + kpairs * 32;
        float acc[MAX_ROWS * 32];
        /* Task t + 1's two blocks follow task t's in the packed weight. */
        const char *next0 = t + 1 < tasks ? (const char *)(pw1 + kpairs * 32) : NULL;
        const char *next1 = next0 ? next0 + kpairs * LINE : NULL;
        for (int64_t r0 = p0; r0 < p1; r0 += MAX_ROWS) {
            const int R = task_row_group(pw0, pw1, kpairs, x, x_stride, p0, p1, r0, next0, next1, acc);
            for (int r = 0; r < R; ++r)
                for (int h = 0; h < 2; ++h) {
                    __m512 v = _mm512_loadu_ps(acc + r * 32 + h * 16);
                    const int64_t col = (2 * t + h) * NB;
                    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col));
                    if (y) _mm256_storeu_si256((__m256i *)(y + (r0 + r) * n + col), (__m256i)_mm512_cvtneps_pbh(v));
                    else _mm512_storeu_ps(y_f32 + (r0 + r) * n + col, round_bf16(v));
                }
        }
    }
    }
}

/* y [m][n] bf16 = x [m][k] bf16 (rows x_stride apart) times the packed W, transposed, plus
 * bias (float32 [n], or NULL), rounded once to bf16. */
void linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *packed,
                 int64_t n, const float *bias, uint16_t *y, int num_threads) {
    linear_rows(x, m, k, x_stride, packed, n, bias, y, NULL, num_threads);
}

/* linear_bf16's bf16 results widened to float32 in y [m][n]: a model's logits, which samplers
 * take in float32, without a second pass to widen them (32 x 49,152 logits: ~0.3 ms). */
void linear_bf16_widened(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *packed,
                         int64_t n, const float *bias, float *y, int num_threads) {
    linear_rows(x, m, k, x_stride, packed, n, bias, NULL, y, num_threads);
}

/* SwiGLU's first half in one call: act [m][inter] bf16 = silu(gate) * up, where gate and up are
 * x times the merged gate/up weight's two halves (packed as one [2 inter][k] weight, gate rows
 * first), each rounded to bf16 as linear_bf16 rounds them. Each task pairs gate block j with up
 * block j, so its epilogue has both and writes act directly; the arithmetic after the rounding
 * is elementwise_bf16.c's silu_mul_bf16 op for op (bf16(bf16(g / (1 + exp(-g))) * u)), so act
 * is the two calls' bits. Why: at batch 32 silu_mul ran on one thread (below its parallel
 * threshold) as its own call, ~27 us a layer of a ~35 ms step on the Zen 4; here it rides the
 * GEMM's threads. inter must be a multiple of 16. */
void linear_bf16_swiglu(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *packed,
                        int64_t inter, uint16_t *act, int num_threads) {
    const int64_t kpairs = k / 2, blocks = inter / NB;
    const __m512 one = _mm512_set1_ps(1.0f), arg_max = _mm512_set1_ps(EXP_ARG_MAX);
    for (int64_t p0 = 0; p0 < m; p0 += ROW_PANEL) {
    const int64_t p1 = p0 + ROW_PANEL < m ? p0 + ROW_PANEL : m;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t j = 0; j < blocks; ++j) {
        const uint16_t *pw_gate = packed + j * kpairs * 32, *pw_up = packed + (blocks + j) * kpairs * 32;
        float acc[MAX_ROWS * 32];
        const char *next0 = j + 1 < blocks ? (const char *)(pw_gate + kpairs * 32) : NULL;
        const char *next1 = next0 ? (const char *)(pw_up + kpairs * 32) : NULL;
        for (int64_t r0 = p0; r0 < p1; r0 += MAX_ROWS) {
            const int R = task_row_group(pw_gate, pw_up, kpairs, x, x_stride, p0, p1, r0, next0, next1, acc);
            for (int r = 0; r < R; ++r) {
                const __m512 g = round_bf16(_mm512_loadu_ps(acc + r * 32));
                const __m512 u = round_bf16(_mm512_loadu_ps(acc + r * 32 + 16));
                const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), arg_max));
                const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, e)));
                _mm256_storeu_si256((__m256i *)(act + (r0 + r) * inter + j * NB),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u)));
            }
        }
    }
    }
}
#else
int linear_bf16_available(void) { return 0; }
#endif
