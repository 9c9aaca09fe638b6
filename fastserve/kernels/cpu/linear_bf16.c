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
#define _GNU_SOURCE   /* syscall(), for AMX's arch_prctl */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "simd_math.h"

#define NB 16        /* outputs per block: one register of float32 */
#define MAX_ROWS 8   /* rows sharing each weight register: 8 rows x 2 blocks = 16 accumulators */
#define LINE 64      /* bytes of a cache line: one k pair of a block, one register */
#define ROW_PANEL 256 /* rows whose x one pass over the weights reads: 256 x 1,536 bf16 = 768 KB */
#define AMX_ROWS 32  /* rows of an AMX row group: two A tiles of 16 */
#define AMX_KPAIRS 16 /* k pairs of one tile: a B tile is 16 lines of a block, an A tile 32 bf16 of a row */
#define AMX_CHUNK_BYTES (256 << 10) /* weights a chunk of AMX tasks holds in L2 for every row group */
#define GROUP_MAX (AMX_ROWS > MAX_ROWS ? AMX_ROWS : MAX_ROWS)

/* Which arithmetic multiplies (the caller picks it per call, by measurement: fastserve.worker.model.gemm_choice):
 * PATH_DPBF16 vdpbf16ps, a single row on four chains (fastest at one row);
 * PATH_DPBF16_UNIFORM vdpbf16ps, every row on one chain, so a row's sums do not depend on how
 *   many rows share the call (batch-invariant mode);
 * PATH_AMX AMX tiles (tdpbf16ps), rows in groups of 32, zero-padded to whole tiles; each row's
 *   sums are the same whatever the row count. Where AMX is absent, or k is not a multiple of 32,
 *   PATH_AMX runs PATH_DPBF16_UNIFORM. */
enum { PATH_DPBF16 = 0, PATH_DPBF16_UNIFORM = 1, PATH_AMX = 2 };

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
        int R, int split, const char *pf_a, const char *pf_b, float *acc_out /* [R][32] */) {
    __m512 acc[MAX_ROWS][2];
    for (int r = 0; r < R; ++r) { acc[r][0] = _mm512_setzero_ps(); acc[r][1] = _mm512_setzero_ps(); }
    if (R == 1 && split) {   /* one row: four independent chains (two k halves x two blocks) */
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
                                      int64_t x_stride, int R, int split, const char *pf_a, const char *pf_b,
                                      float *acc_out) {
    switch (R) {
    case 1:
        if (split) block_rows(pw0, pw1, kpairs, x, x_stride, 1, 1, pf_a, pf_b, acc_out);
        else block_rows(pw0, pw1, kpairs, x, x_stride, 1, 0, pf_a, pf_b, acc_out);
        break;
    case 2: block_rows(pw0, pw1, kpairs, x, x_stride, 2, 0, pf_a, pf_b, acc_out); break;
    case 3: block_rows(pw0, pw1, kpairs, x, x_stride, 3, 0, pf_a, pf_b, acc_out); break;
    case 4: block_rows(pw0, pw1, kpairs, x, x_stride, 4, 0, pf_a, pf_b, acc_out); break;
    case 5: block_rows(pw0, pw1, kpairs, x, x_stride, 5, 0, pf_a, pf_b, acc_out); break;
    case 6: block_rows(pw0, pw1, kpairs, x, x_stride, 6, 0, pf_a, pf_b, acc_out); break;
    case 7: block_rows(pw0, pw1, kpairs, x, x_stride, 7, 0, pf_a, pf_b, acc_out); break;
    default: block_rows(pw0, pw1, kpairs, x, x_stride, 8, 0, pf_a, pf_b, acc_out); break;
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

/* A task's row group on vdpbf16ps: rows r0 .. r0 + R of the panel [p0, p1) times its two blocks
 * (pw0, pw1) into acc [R][32], asking meanwhile for the group's share of the next task's
 * streams. Returns R. */
static inline __attribute__((always_inline)) int task_row_group(
        const uint16_t *pw0, const uint16_t *pw1, int64_t kpairs, const uint16_t *x, int64_t x_stride, int64_t p0,
        int64_t p1, int64_t r0, int split, const char *next0, const char *next1, float *acc) {
    const int R = p1 - r0 < MAX_ROWS ? (int)(p1 - r0) : MAX_ROWS;
    const char *pf_a, *pf_b;
    next_task_streams(next0, next1, (r0 - p0) / MAX_ROWS, p1 - p0 <= MAX_ROWS, &pf_a, &pf_b);
    rows_of_two_blocks(pw0, pw1, kpairs, x + r0 * x_stride, x_stride, R, split, pf_a, pf_b, acc);
    return R;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* ldtilecfg's 64-byte operand (palette 1). */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static int amx_permission = -1;

/* Whether this process may use AMX tiles: Linux grants the (large) tile state on request, once per
 * process (arch_prctl). */
static int amx_usable(void) {
    if (amx_permission < 0)
        amx_permission = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permission;
}

/* Every tile 16 rows of 64 bytes: tiles 0-3 accumulate (2 row tiles x 2 blocks), 4-5 hold x,
 * 6-7 the weights. Per thread: tile state is a thread's own. */
static void amx_configure(void) {
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Up to 32 rows (a0: the first 16, a1: the next 16 or NULL, each 16 whole rows a_stride apart)
 * times two blocks into acc [32][32], in k steps of 32; the next task's streams (next0, next1, or
 * NULL) are asked into L2 one line a k pair meanwhile, as the vdpbf16ps path does. */
static inline void amx_rows(const uint16_t *pw0, const uint16_t *pw1, int64_t kpairs, const uint16_t *a0,
                            const uint16_t *a1, int64_t a_stride, const char *pf_a, const char *pf_b, float *acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kp = 0; kp < kpairs; kp += AMX_KPAIRS) {
        if (pf_a) for (int i = 0; i < AMX_KPAIRS; ++i) _mm_prefetch(pf_a + (kp + i) * LINE, _MM_HINT_T1);
        if (pf_b) for (int i = 0; i < AMX_KPAIRS; ++i) _mm_prefetch(pf_b + (kp + i) * LINE, _MM_HINT_T1);
        _tile_loadd(6, pw0 + kp * 32, LINE);
        _tile_loadd(7, pw1 + kp * 32, LINE);
        _tile_loadd(4, a0 + 2 * kp, a_stride * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (a1) {
            _tile_loadd(5, a1 + 2 * kp, a_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 32 * sizeof(float));
    _tile_stored(1, acc + 16, 32 * sizeof(float));
    if (a1) {
        _tile_stored(2, acc + 16 * 32, 32 * sizeof(float));
        _tile_stored(3, acc + 16 * 32 + 16, 32 * sizeof(float));
    }
}

/* A task's row group on AMX: rows r0 .. r0 + R (R <= 32) of the panel [p0, p1) into acc [R][32].
 * Whole tiles of 16 rows are read from x in place; the call's last m % 16 rows from pad, where
 * they were copied with zero rows after them (pad_row: the first of them). Returns R. */
static inline int amx_row_group(const uint16_t *pw0, const uint16_t *pw1, int64_t kpairs, const uint16_t *x,
                                int64_t x_stride, const uint16_t *pad, int64_t pad_row, int64_t p0, int64_t p1,
                                int64_t r0, const char *next0, const char *next1, float *acc) {
    const int R = p1 - r0 < AMX_ROWS ? (int)(p1 - r0) : AMX_ROWS;
    const char *pf_a, *pf_b;
    next_task_streams(next0, next1, (r0 - p0) / AMX_ROWS, p1 - p0 <= AMX_ROWS, &pf_a, &pf_b);
    const int64_t second = r0 + 16;
    if (r0 + R <= pad_row || !pad) {   /* whole tiles only */
        amx_rows(pw0, pw1, kpairs, x + r0 * x_stride, R > 16 ? x + second * x_stride : NULL, x_stride, pf_a, pf_b,
                 acc);
    } else if (r0 == pad_row) {        /* one padded tile */
        amx_rows(pw0, pw1, kpairs, pad, NULL, x_stride, pf_a, pf_b, acc);
    } else {                           /* a whole tile, then the padded one */
        float part[16 * 32];
        amx_rows(pw0, pw1, kpairs, x + r0 * x_stride, NULL, x_stride, pf_a, pf_b, acc);
        amx_rows(pw0, pw1, kpairs, pad, NULL, x_stride, NULL, NULL, part);
        for (int i = 0; i < 16 * 32; ++i) acc[16 * 32 + i] = part[i];
    }
    return R;
}
#else
static int amx_usable(void) { return 0; }
#endif

int linear_bf16_amx_available(void) { return amx_usable(); }

/* Tasks whose weights (two blocks of kpairs lines) a thread's row groups share while in L2. */
static inline int64_t task_chunk(int64_t kpairs) {
    const int64_t task_bytes = 2 * kpairs * LINE;
    return task_bytes >= AMX_CHUNK_BYTES ? 1 : AMX_CHUNK_BYTES / task_bytes;
}

/* The path a call runs: PATH_AMX only where AMX is usable and k a multiple of a tile's 32. */
static inline int effective_path(int path, int64_t k) {
    if (path == PATH_AMX && !(amx_usable() && k % (2 * AMX_KPAIRS) == 0)) return PATH_DPBF16_UNIFORM;
    return path;
}

/* x's last m % 16 rows copied into a [16][x_stride] buffer, zeros after them, for AMX's whole
 * tiles (NULL where none are needed; the caller frees it). *pad_row: the first of those rows. */
static uint16_t *amx_pad(int path, const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, int64_t *pad_row) {
    *pad_row = m;
    if (path != PATH_AMX || m % 16 == 0) return NULL;
    *pad_row = m - m % 16;
    uint16_t *pad = calloc(16 * x_stride, sizeof(uint16_t));
    if (pad)
        for (int64_t r = *pad_row; r < m; ++r) memcpy(pad + (r - *pad_row) * x_stride, x + r * x_stride, k * 2);
    return pad;
}

/* One task's row group on the call's path into acc; returns its rows. */
static inline __attribute__((always_inline)) int row_group(
        int path, const uint16_t *pw0, const uint16_t *pw1, int64_t kpairs, const uint16_t *x, int64_t x_stride,
        const uint16_t *pad, int64_t pad_row, int64_t p0, int64_t p1, int64_t r0, const char *next0,
        const char *next1, float *acc) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (path == PATH_AMX)
        return amx_row_group(pw0, pw1, kpairs, x, x_stride, pad, pad_row, p0, p1, r0, next0, next1, acc);
#else
    (void)pad; (void)pad_row;
#endif
    return task_row_group(pw0, pw1, kpairs, x, x_stride, p0, p1, r0, path == PATH_DPBF16, next0, next1, acc);
}

/* 16 floats rounded to bf16 (nearest even) and widened back: a value torch would store as bf16. */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* The epilogue of a task whose two blocks start at output col: R rows of acc (+ bias) rounded
 * once to bf16, into y as bf16 or (y NULL) into y_f32 widened. */
static inline void store_rows(const float *acc, int R, int64_t r0, int64_t col, int64_t n, const float *bias,
                              uint16_t *y, float *y_f32) {
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) {
            __m512 v = _mm512_loadu_ps(acc + r * 32 + h * 16);
            const int64_t c = col + h * NB;
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));
            if (y) _mm256_storeu_si256((__m256i *)(y + (r0 + r) * n + c), (__m256i)_mm512_cvtneps_pbh(v));
            else _mm512_storeu_ps(y_f32 + (r0 + r) * n + c, round_bf16(v));
        }
}

/* The SwiGLU epilogue: silu(gate) * up for R rows of acc (gate in its first 16 columns, up in
 * the next), into act at column col. */
static inline void store_swiglu(const float *acc, int R, int64_t r0, int64_t col, int64_t inter, uint16_t *act) {
    const __m512 one = _mm512_set1_ps(1.0f), arg_max = _mm512_set1_ps(EXP_ARG_MAX);
    for (int r = 0; r < R; ++r) {
        const __m512 g = round_bf16(_mm512_loadu_ps(acc + r * 32));
        const __m512 u = round_bf16(_mm512_loadu_ps(acc + r * 32 + 16));
        const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), arg_max));
        const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, e)));
        _mm256_storeu_si256((__m256i *)(act + (r0 + r) * inter + col),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u)));
    }
}

/* y [m][n] = x [m][k] bf16 (rows x_stride apart) times the packed W, transposed, plus bias
 * (float32 [n], or NULL), rounded once to bf16: into y as bf16, or (y NULL) into y_f32 as those
 * bf16 values widened to float32; or, with swiglu, act = silu(gate) * up into y, where the
 * packed W is the merged [2n][k] gate/up weight (gate rows first) and task j pairs gate block j
 * with up block j. */
static void linear_rows(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *packed, int64_t n,
                        const float *bias, uint16_t *y, float *y_f32, int swiglu, int num_threads, int path) {
    path = effective_path(path, k);
    const int64_t kpairs = k / 2, tasks = swiglu ? n / NB : n / (2 * NB);
    const int64_t group = path == PATH_AMX ? AMX_ROWS : MAX_ROWS;
    int64_t pad_row;
    uint16_t *pad = amx_pad(path, x, m, k, x_stride, &pad_row);
    /* Rows in panels, so a panel of x stays in L2 while every task streams past it: with all of
     * a 2,048-row prompt at once each task re-read x from L3 (3,072x576 weight: 33 vs oneDNN's
     * 19 ms; by panels, on par). */
    for (int64_t p0 = 0; p0 < m; p0 += ROW_PANEL) {
    const int64_t p1 = p0 + ROW_PANEL < m ? p0 + ROW_PANEL : m;
    _Pragma("omp parallel num_threads(num_threads)")
    {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (path == PATH_AMX) amx_configure();
#endif
    /* Each thread a contiguous run of tasks (as schedule(static)), taken in chunks: every row
     * group of the panel passes over a chunk's weights (in L2) before the next chunk. */
    const int64_t nth = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t t_begin = tasks * id / nth, t_end = tasks * (id + 1) / nth;
    const int64_t chunk = path == PATH_AMX ? task_chunk(kpairs) : 1;
    float acc[GROUP_MAX * 32];
    for (int64_t c0 = t_begin; c0 < t_end; c0 += chunk) {
    const int64_t c1 = c0 + chunk < t_end ? c0 + chunk : t_end;
    for (int64_t r0 = p0; r0 < p1; r0 += group)
    for (int64_t t = c0; t < c1; ++t) {
        const uint16_t *pw0, *pw1;
        const char *next0, *next1;
        if (swiglu) {   /* gate block t and up block t */
            pw0 = packed + t * kpairs * 32;
            pw1 = packed + (tasks + t) * kpairs * 32;
            next0 = t + 1 < tasks ? (const char *)(pw0 + kpairs * 32) : NULL;
            next1 = next0 ? (const char *)(pw1 + kpairs * 32) : NULL;
        } else {        /* task t + 1's two blocks follow task t's */
            pw0 = packed + 2 * t * kpairs * 32;
            pw1 = pw0 + kpairs * 32;
            next0 = t + 1 < tasks ? (const char *)(pw1 + kpairs * 32) : NULL;
            next1 = next0 ? next0 + kpairs * LINE : NULL;
        }
        const int R = row_group(path, pw0, pw1, kpairs, x, x_stride, pad, pad_row, p0, p1, r0, next0, next1, acc);
        if (swiglu) store_swiglu(acc, R, r0, t * NB, n, y);
        else store_rows(acc, R, r0, 2 * t * NB, n, bias, y, y_f32);
    }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (path == PATH_AMX) _tile_release();
#endif
    }
    }
    free(pad);
}

/* y [m][n] bf16 = x [m][k] bf16 (rows x_stride apart) times the packed W, transposed, plus
 * bias (float32 [n], or NULL), rounded once to bf16; path: PATH_*. */
void linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *packed,
                 int64_t n, const float *bias, uint16_t *y, int num_threads, int path) {
    linear_rows(x, m, k, x_stride, packed, n, bias, y, NULL, 0, num_threads, path);
}

/* linear_bf16's bf16 results widened to float32 in y [m][n]: a model's logits, which samplers
 * take in float32, without a second pass to widen them (32 x 49,152 logits: ~0.3 ms). */
void linear_bf16_widened(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *packed,
                         int64_t n, const float *bias, float *y, int num_threads, int path) {
    linear_rows(x, m, k, x_stride, packed, n, bias, NULL, y, 0, num_threads, path);
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
                        int64_t inter, uint16_t *act, int num_threads, int path) {
    linear_rows(x, m, k, x_stride, packed, inter, NULL, act, NULL, 1, num_threads, path);
}
#else
int linear_bf16_available(void) { return 0; }
int linear_bf16_amx_available(void) { return 0; }
#endif
