/* Prefill attention over a paged bfloat16 KV cache on the CPU: each sequence's new tokens (a
 * whole prompt, or a chunk of one that continues a cached prefix) attend causally to every
 * position up to their own, read in place from the cache blocks their table names.
 *
 * Why our own: torch's SDPA (CPU flash, float32 upcast) ran a SmolLM2 layer's 256-token prompt
 * in 1.3-1.6 ms and a 1,024-token one in 14 ms on the 2-core AMD EPYC Zen 4, 60-90 GFLOP/s, ~17 %
 * and ~36 % of the whole prompt; and a chunk that continues a prefix first gathered the prefix
 * from the cache into a dense copy and ran SDPA with a boolean mask. This kernel: one layer
 * 0.60x / 0.77x SDPA at 256 / 1,024 tokens; a whole SmolLM2 prompt 0.83x / 0.88x (docs/engine.md).
 * Still ~90 GFLOP/s at 1,024 tokens: the per-tile softmax (reductions, exp) and the float32
 * value sums bound it, not the dot products; bf16 value sums (P rounded, as GPU flash kernels
 * do) would halve the latter, untried.
 *
 * Same function as fastserve.kernels.reference.context_prefill_attention (start 0 is plain causal
 * prefill), with one precondition the reference does not have: the new tokens' K/V are already
 * in the cache (fastserve.worker.model.attention writes them first). Grouped-query attention: a task takes
 * all G = num_heads / num_kv_heads query heads of one KV head for ROWS_PER_TASK / G query rows of
 * one sequence, so each key and value is read once for G x rows dot products. Keys go in tiles
 * of KT positions: each tile's keys are transposed into k-pair-major order ([D/2][KT][2], one
 * register per pair) so one vdpbf16ps gives a query's partial dot with all KT keys at once
 * (bf16 products exact, float32 sums, as the float32 reference); values are widened to float32
 * once per tile. Softmax is the online (flash) form in float32: a running max and sum per query
 * row, the accumulator rescaled when the max grows; output = accumulator / sum, rounded to bf16
 * once. Keys past a row's position (and past the context) are masked, never read into a sum.
 *
 * q [T][H][D] with rows q_token_stride apart (heads contiguous); out [T][H][D] contiguous;
 * caches as fastserve/kernels/cpu/paged_attention.c takes them (per-layer views, element strides).
 * Tasks (longest first) are shared out over num_threads OpenMP threads. Requires head_dim a
 * multiple of 32 (the caller checks); scratch is sized from head_dim and G at run time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <omp.h>

#include "simd_math.h"

#define KT 16              /* keys per tile: one register of float32 scores */
#define ROWS_PER_TASK 96   /* query (row, head) pairs per task: 96 x 64 dims of float32 = 24 KB, in L1 */
#define HEADS_AT_ONCE 4     /* query heads of one row sharing each key and value load */
#define SCRATCH_FAILED -1

int prefill_attention_bf16_available(void) { return 1; }

struct task {
    int seq, kv_head;
    int64_t row0;   /* first query row, counted from the sequence's first new token */
    int rows;
};

struct geometry {
    const uint16_t *q, *key_cache, *value_cache;
    int64_t q_token_stride, block_stride, token_stride, head_stride;
    const int32_t *tables;
    int64_t table_stride;
    const int64_t *seq_starts;   /* [num_seqs + 1] rows of q/out */
    const int64_t *positions;    /* [num_seqs] position of each sequence's first new token */
    int num_heads, group, head_dim, block_size;
    float scale;
    uint16_t *out;
};

static inline int64_t cache_row(const struct geometry *g, const int32_t *table, int64_t pos, int kv_head) {
    return (int64_t)table[pos / g->block_size] * g->block_stride + (pos % g->block_size) * g->token_stride +
           (int64_t)kv_head * g->head_stride;
}

/* Keys [k0, k0 + nk) of one KV head, transposed to kt[D/2][KT] int32 pairs (missing keys 0), and
 * their values widened to vf[KT][D]. */
static void load_tile(const struct geometry *g, const int32_t *table, int kv_head, int64_t k0, int nk,
                      int32_t *kt, float *vf) {
    const int pairs = g->head_dim / 2;
    for (int t = 0; t < KT; ++t) {
        if (t < nk) {
            const int64_t row = cache_row(g, table, k0 + t, kv_head);
            const int32_t *kr = (const int32_t *)(g->key_cache + row);
            for (int p = 0; p < pairs; ++p) kt[p * KT + t] = kr[p];
            for (int d = 0; d < g->head_dim; d += 16) _mm512_storeu_ps(vf + t * g->head_dim + d, widen16(g->value_cache + row + d));
        } else {
            for (int p = 0; p < pairs; ++p) kt[p * KT + t] = 0;
            for (int d = 0; d < g->head_dim; d += 16) _mm512_storeu_ps(vf + t * g->head_dim + d, _mm512_setzero_ps());
        }
    }
}

/* NH query heads of one row (NH <= HEADS_AT_ONCE) against one key tile: scaled scores, masked
 * past `allowed`, then the online softmax and the value sum, into acc[h][0 .. D). Heads share
 * every key and value load (the tile is read once per row, not once per head); each head's
 * dot runs two chains. */
static inline __attribute__((always_inline)) void row_heads_tile(
        const int NH, const int32_t *const *qp, const int32_t *kt, const float *vf, int pairs, int D, float scale,
        int allowed, float *acc, float *maxes, float *sums, float *w /* [NH][KT] */) {
    const __mmask16 live = (__mmask16)((1u << allowed) - 1u);
    __m512 c[HEADS_AT_ONCE][2];
    for (int h = 0; h < NH; ++h) { c[h][0] = _mm512_setzero_ps(); c[h][1] = _mm512_setzero_ps(); }
    for (int p = 0; p < pairs; p += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * KT), k1 = (__m512bh)_mm512_loadu_si512(kt + (p + 1) * KT);
        for (int h = 0; h < NH; ++h) {
            c[h][0] = _mm512_dpbf16_ps(c[h][0], (__m512bh)_mm512_set1_epi32(qp[h][p]), k0);
            c[h][1] = _mm512_dpbf16_ps(c[h][1], (__m512bh)_mm512_set1_epi32(qp[h][p + 1]), k1);
        }
    }
    float corr[HEADS_AT_ONCE];
    for (int h = 0; h < NH; ++h) {
        const __m512 sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY),
                                               _mm512_mul_ps(_mm512_add_ps(c[h][0], c[h][1]), _mm512_set1_ps(scale)));
        const float tile_max = _mm512_mask_reduce_max_ps(live, sc);
        const float m_new = tile_max > maxes[h] ? tile_max : maxes[h];
        /* exp(old max - new max): 1 while the max stands, 0 on the first tile. */
        corr[h] = m_new == maxes[h] ? 1.0f : expf(maxes[h] - m_new);
        const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
        sums[h] = sums[h] * corr[h] + _mm512_reduce_add_ps(e);
        maxes[h] = m_new;
        _mm512_storeu_ps(w + h * KT, e);
    }
    for (int d0 = 0; d0 < D; d0 += 32) {   /* D is a multiple of 32: two registers per head */
        __m512 a[HEADS_AT_ONCE][2];
        for (int h = 0; h < NH; ++h) {
            a[h][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + d0), _mm512_set1_ps(corr[h]));
            a[h][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + d0 + 16), _mm512_set1_ps(corr[h]));
        }
        for (int t = 0; t < allowed; ++t) {
            const __m512 v0 = _mm512_loadu_ps(vf + t * D + d0), v1 = _mm512_loadu_ps(vf + t * D + d0 + 16);
            for (int h = 0; h < NH; ++h) {
                const __m512 wt = _mm512_set1_ps(w[h * KT + t]);
                a[h][0] = _mm512_fmadd_ps(wt, v0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(wt, v1, a[h][1]);
            }
        }
        for (int h = 0; h < NH; ++h) {
            _mm512_storeu_ps(acc + h * D + d0, a[h][0]);
            _mm512_storeu_ps(acc + h * D + d0 + 16, a[h][1]);
        }
    }
}

static void run_task(const struct geometry *g, const struct task *tk, int32_t *kt, float *vf, float *acc,
                     float *w, float *maxes, float *sums) {
    const int G = g->group, D = g->head_dim, pairs = D / 2, n = tk->rows * G;
    const int64_t first_pos = g->positions[tk->seq] + tk->row0;
    const int64_t num_keys = first_pos + tk->rows;   /* the last row sees up to its own position */
    const int32_t *table = g->tables + tk->seq * g->table_stride;
    const int64_t q_row0 = g->seq_starts[tk->seq] + tk->row0;
    for (int i = 0; i < n; ++i) { maxes[i] = -INFINITY; sums[i] = 0.0f; }
    for (int64_t i = 0; i < (int64_t)n * D; ++i) acc[i] = 0.0f;
    for (int64_t k0 = 0; k0 < num_keys; k0 += KT) {
        const int nk = num_keys - k0 < KT ? (int)(num_keys - k0) : KT;
        load_tile(g, table, tk->kv_head, k0, nk, kt, vf);
        for (int r = 0; r < tk->rows; ++r) {
            /* Row r sits at position first_pos + r and sees keys up to it: `allowed` of this tile
             * (at least one once any is: key tiles start at 0 and rows only grow). */
            const int64_t allowed64 = first_pos + r - k0 + 1;
            if (allowed64 <= 0) continue;
            const int allowed = allowed64 > nk ? nk : (int)allowed64;
            const uint16_t *qrow = g->q + (q_row0 + r) * g->q_token_stride + (int64_t)tk->kv_head * G * D;
            for (int h0 = 0; h0 < G; h0 += HEADS_AT_ONCE) {
                const int nh = G - h0 < HEADS_AT_ONCE ? G - h0 : HEADS_AT_ONCE;
                const int32_t *qp[HEADS_AT_ONCE];
                for (int h = 0; h < nh; ++h) qp[h] = (const int32_t *)(qrow + (int64_t)(h0 + h) * D);
                const int i = r * G + h0;
                float *a = acc + (int64_t)i * D;
                switch (nh) {
                case 1: row_heads_tile(1, qp, kt, vf, pairs, D, g->scale, allowed, a, maxes + i, sums + i, w); break;
                case 2: row_heads_tile(2, qp, kt, vf, pairs, D, g->scale, allowed, a, maxes + i, sums + i, w); break;
                case 3: row_heads_tile(3, qp, kt, vf, pairs, D, g->scale, allowed, a, maxes + i, sums + i, w); break;
                default: row_heads_tile(4, qp, kt, vf, pairs, D, g->scale, allowed, a, maxes + i, sums + i, w); break;
                }
            }
        }
    }
    for (int r = 0; r < tk->rows; ++r)
        for (int h = 0; h < G; ++h) {
            const int i = r * G + h;
            const __m512 inv = _mm512_set1_ps(1.0f / sums[i]);
            uint16_t *o = g->out + ((q_row0 + r) * g->num_heads + tk->kv_head * G + h) * D;
            for (int d = 0; d < D; d += 16)
                _mm256_storeu_si256((__m256i *)(o + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)i * D + d), inv)));
        }
}

int prefill_attention_bf16(const uint16_t *q, int64_t q_token_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, int64_t block_stride, int64_t token_stride,
                           int64_t head_stride, const int32_t *tables, int64_t table_stride,
                           const int64_t *seq_starts, const int64_t *positions, int num_seqs, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, float scale, uint16_t *out,
                           int num_threads) {
    const int G = num_heads / num_kv_heads;
    const int rows_per_task = ROWS_PER_TASK / G > 0 ? ROWS_PER_TASK / G : 1;
    int64_t num_tasks = 0;
    for (int b = 0; b < num_seqs; ++b)
        num_tasks += (seq_starts[b + 1] - seq_starts[b] + rows_per_task - 1) / rows_per_task * num_kv_heads;
    struct task *tasks = malloc((size_t)(num_tasks > 0 ? num_tasks : 1) * sizeof *tasks);
    if (!tasks) return SCRATCH_FAILED;
    /* Longest first: a sequence's last rows see the most keys. */
    int64_t k = 0;
    for (int b = 0; b < num_seqs; ++b) {
        const int64_t len = seq_starts[b + 1] - seq_starts[b];
        for (int64_t r0 = (len - 1) / rows_per_task * rows_per_task; r0 >= 0; r0 -= rows_per_task)
            for (int h = 0; h < num_kv_heads; ++h) {
                tasks[k].seq = b; tasks[k].kv_head = h; tasks[k].row0 = r0;
                tasks[k].rows = len - r0 < rows_per_task ? (int)(len - r0) : rows_per_task;
                ++k;
            }
    }
    const struct geometry g = {q, key_cache, value_cache, q_token_stride, block_stride, token_stride, head_stride,
                               tables, table_stride, seq_starts, positions, num_heads, G, head_dim, block_size,
                               scale, out};
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int n = rows_per_task * G;
        int32_t *kt = malloc((size_t)KT * (head_dim / 2) * sizeof *kt);
        float *vf = malloc((size_t)KT * head_dim * sizeof *vf);
        float *acc = malloc((size_t)n * head_dim * sizeof *acc);
        float *scores = malloc((size_t)HEADS_AT_ONCE * KT * sizeof *scores);
        float *stats = malloc((size_t)2 * n * sizeof *stats);
        const int ready = kt && vf && acc && scores && stats;
        /* Every thread takes part in the loop (a worksharing loop must be met by all); one
         * without scratch fails the call instead of running its tasks. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tasks; ++t) {
            if (ready) {
                run_task(&g, &tasks[t], kt, vf, acc, scores, stats, stats + n);
            } else {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(kt); free(vf); free(acc); free(scores); free(stats);
    }
    free(tasks);
    return failed ? SCRATCH_FAILED : 0;
}
#else
int prefill_attention_bf16_available(void) { return 0; }
#endif
