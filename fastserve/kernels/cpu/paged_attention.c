/* Decode attention over a paged KV cache on the CPU: one query token per sequence, the cache in
 * float32 (paged_attention_f32) or bfloat16 (paged_attention_bf16: each element widened to float32
 * as it is read; query, scores, softmax, accumulators and output float32 in both).
 *
 * Grouped-query attention: the caches hold num_kv_heads heads (a divisor of num_heads); query
 * head h reads KV head h / (num_heads / num_kv_heads).
 *
 * Same function as fastserve.kernels.reference.paged_attention, without its dense gather: each work item
 * (a sequence and a run of its KV heads) reads its keys and values straight from the cache blocks
 * its block table names, once, in two token-major passes (scores, then the softmax-weighted sum of
 * values). Token-major matters: one token's heads sit side by side in a block, so a pass reads
 * each token's row as one contiguous run instead of a 256-byte piece per head every 3 KB; on the
 * 2-core Intel (AVX-512) this cut 12 layers at batch 16, context 180, from 26 to 15 ms; it
 * streams its 212 MB of keys and values at ~14 GB/s. Scores and the softmax are float32, as in the
 * reference. Slots past a sequence's context are never read, so a recycled block's stale values
 * cannot leak in.
 *
 * Caches are per-layer views [num_blocks, block_size, num_heads, head_dim] of the block-major
 * pool, passed as a base pointer plus element strides (the block stride spans every layer of the
 * block); head_dim is contiguous. Query and output are contiguous [num_seqs, num_heads, head_dim].
 *
 * Built by fastserve/kernels/cpu_ops.py with the system C compiler (-O3 -march=native -fopenmp) and
 * called through ctypes, which releases the GIL for the call. Work items are shared out over
 * num_threads OpenMP threads.
 *
 * Two implementations behind the same entry points: the portable scalar kernels just below
 * (any CPU; any head_dim) and, where the compiler targets AVX-512 and head_dim is a multiple of
 * 32, the intrinsics path at the end of this file (described there). The scalar one turned out
 * compute-bound, not memory-bound: a 16-lane dot plus a scalar 16-way sum per (token, query
 * head), bf16 widened element by element, value accumulators through memory every token, each
 * KV row re-read for each query head of its group. On the 2-core AMD EPYC (Zen 4, avx512_bf16),
 * SmolLM2-135M shapes (9 query / 3 KV heads, head_dim 64, blocks of 16), context 512, ms per
 * layer (python -m fastserve.bench.bench_attention; scalar -> AVX-512, medians, a shared machine):
 *   bf16 cache, bf16 query:  batch 1 0.100 -> 0.033, batch 4 0.228 -> 0.057, batch 16 0.98 -> 0.18
 *   fp32 cache, fp32 query:  batch 1 0.096 -> 0.033, batch 4 0.210 -> 0.060, batch 16 0.74 -> 0.18
 * (batch 16 bf16 reads 0.15-0.18 across runs, 35-41 GB/s of K+V; a float32 query over a bf16
 * cache, keys widened instead of vdpbf16ps: 0.24). The whole SmolLM2 decode step (30 layers,
 * in-process executor, context 512) at batch 1/4/16: bf16 37.1/42.1/74.0 -> 28.0/31.6/52.4 ms,
 * fp32 47.7/53.0/102.3 -> 41.2/44.6/73.1 ms.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Lanes of the independent partial sums: wide enough for one AVX-512 register of floats, and
 * independent per lane, so the compiler vectorises the dot product without reassociating. */
#define LANES 16

/* Work items per thread when a batch has fewer sequences than that: enough to even out uneven
 * contexts, few enough that each item still reads long contiguous runs of heads. */
#define ITEMS_PER_THREAD 4

/* paged_attention_bf16_rows' status where this build or the shapes cannot take it. */
#define BF16_ROWS_UNSUPPORTED -5

static inline float f32_at(const float *p, int64_t i) { return p[i]; }

/* bfloat16 is the high half of a float32: widening is a 16-bit shift, exact. */
static inline float bf16_at(const uint16_t *p, int64_t i) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)p[i] << 16 };
    return v.f;
}

/* One kernel per cache element type T, read through LOAD(pointer, index). */
#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD)                                                       \
static float NAME##_dot(const float *a, const T *b, int n) {                                      \
    float acc[LANES] = {0};                                                                        \
    int i = 0;                                                                                     \
    for (; i + LANES <= n; i += LANES)                                                             \
        for (int j = 0; j < LANES; ++j) acc[j] += a[i + j] * LOAD(b, i + j);                       \
    float sum = 0.0f;                                                                              \
    for (; i < n; ++i) sum += a[i] * LOAD(b, i);                                                   \
    for (int j = 0; j < LANES; ++j) sum += acc[j];                                                 \
    return sum;                                                                                    \
}                                                                                                  \
                                                                                                   \
/* Returns 0; -1 if the scratch buffer could not be allocated, -2 if num_kv_heads does not       \
 * divide num_heads (nothing is written then). */                                                 \
static int NAME##_scalar(const float *query, const T *key_cache, const T *value_cache,             \
         int64_t block_stride, int64_t token_stride, int64_t head_stride,                         \
         const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,          \
         int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,             \
         float scale, float *out, int num_threads) {                                              \
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) return -2;                             \
    if (num_threads < 1) num_threads = 1;                                                          \
    const int group = num_heads / num_kv_heads;                                                    \
    int max_context = 1;                                                                           \
    for (int b = 0; b < num_seqs; ++b)                                                             \
        if (context_lens[b] > max_context) max_context = context_lens[b];                          \
    /* Work items are (sequence, run of KV heads). A whole sequence per item when there are      \
     * enough sequences; a lone sequence is split over its heads so every thread has work. */     \
    int chunks = (ITEMS_PER_THREAD * num_threads + num_seqs - 1) / num_seqs;                      \
    if (chunks > num_kv_heads) chunks = num_kv_heads;                                              \
    if (chunks < 1) chunks = 1;                                                                    \
    const int heads_per_chunk = (num_kv_heads + chunks - 1) / chunks;                              \
    chunks = (num_kv_heads + heads_per_chunk - 1) / heads_per_chunk;                               \
    /* Per thread: scores [q heads][max_context], then the value accumulators                    \
     * [q heads][head_dim], then one running max per q head. Allocated up front so every        \
     * thread reaches the loop. */                                                                 \
    const int64_t q_per_chunk = (int64_t)heads_per_chunk * group;                                  \
    const int64_t row = q_per_chunk * ((int64_t)max_context + head_dim + 1);                       \
    float *scratch = malloc(sizeof(float) * (size_t)(row * num_threads));                          \
    if (scratch == NULL) return -1;                                                                \
    _Pragma("omp parallel for collapse(2) schedule(static) num_threads(num_threads)")             \
    for (int b = 0; b < num_seqs; ++b) {                                                           \
        for (int c = 0; c < chunks; ++c) {                                                         \
            const int kv0 = c * heads_per_chunk;                                                   \
            const int kv1 = kv0 + heads_per_chunk < num_kv_heads ? kv0 + heads_per_chunk : num_kv_heads; \
            const int q0 = kv0 * group, nq = (kv1 - kv0) * group;                                  \
            float *scores = scratch + row * omp_get_thread_num();                                  \
            float *acc = scores + q_per_chunk * (int64_t)max_context;                              \
            float *maxes = acc + q_per_chunk * (int64_t)head_dim;                                  \
            const float *q = query + ((int64_t)b * num_heads + q0) * head_dim;                     \
            const int32_t *table = block_tables + (int64_t)b * table_stride;                       \
            const int context = context_lens[b];                                                   \
            for (int i = 0; i < nq; ++i) maxes[i] = -INFINITY;                                     \
            /* Keys: token by token, all of this item's heads at once, so each token's row of     \
             * heads is read as one contiguous run. */                                             \
            for (int p = 0; p < context; ++p) {                                                    \
                const T *k = key_cache + (int64_t)table[p / block_size] * block_stride             \
                             + (int64_t)(p % block_size) * token_stride;                           \
                for (int i = 0; i < nq; ++i) {                                                     \
                    const float s = NAME##_dot(q + (int64_t)i * head_dim,                          \
                                               k + (int64_t)(kv0 + i / group) * head_stride,       \
                                               head_dim) * scale;                                  \
                    scores[(int64_t)i * max_context + p] = s;                                      \
                    if (s > maxes[i]) maxes[i] = s;                                                \
                }                                                                                  \
            }                                                                                      \
            for (int i = 0; i < nq; ++i) {                                                         \
                float *s = scores + (int64_t)i * max_context;                                      \
                float total = 0.0f;                                                                \
                for (int p = 0; p < context; ++p) {                                                \
                    s[p] = expf(s[p] - maxes[i]);                                                  \
                    total += s[p];                                                                 \
                }                                                                                  \
                maxes[i] = context > 0 ? 1.0f / total : 0.0f;   /* now the normaliser */          \
                for (int d = 0; d < head_dim; ++d) acc[(int64_t)i * head_dim + d] = 0.0f;          \
            }                                                                                      \
            /* Values: the same token-major walk. */                                               \
            for (int p = 0; p < context; ++p) {                                                    \
                const T *v = value_cache + (int64_t)table[p / block_size] * block_stride           \
                             + (int64_t)(p % block_size) * token_stride;                           \
                for (int i = 0; i < nq; ++i) {                                                     \
                    const float w = scores[(int64_t)i * max_context + p];                          \
                    const T *vh = v + (int64_t)(kv0 + i / group) * head_stride;                    \
                    float *a = acc + (int64_t)i * head_dim;                                        \
                    for (int d = 0; d < head_dim; ++d) a[d] += w * LOAD(vh, d);                    \
                }                                                                                  \
            }                                                                                      \
            for (int i = 0; i < nq; ++i) {                                                         \
                float *o = out + ((int64_t)b * num_heads + q0 + i) * head_dim;                     \
                for (int d = 0; d < head_dim; ++d) o[d] = acc[(int64_t)i * head_dim + d] * maxes[i]; \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    free(scratch);                                                                                 \
    return 0;                                                                                      \
}

DEFINE_PAGED_ATTENTION(paged_attention_f32, float, f32_at)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, bf16_at)

/* ------------------------------------------------------------------ AVX-512 path
 *
 * Same work items, same OpenMP split, same float32 softmax and accumulation; what changes is
 * how an item is computed. Per item, per KV head, per run of up to MAX_TILE_HEADS of the query
 * heads sharing it:
 *   scores: tokens in tiles of 16; each token's key row (of this KV head) is loaded once and
 *     multiplied into every query head of the run, 4 tokens at a time in independent vector
 *     accumulators; a transposing add tree turns 16 tokens' accumulators into one register of
 *     16 scores (no scalar horizontal sums). A tile past the context reads the last real token
 *     again and stores only the real lanes.
 *   softmax: a vectorised exp (Cody-Waite reduction, degree-7 polynomial, scalef; within 2 ulp
 *     of expf), 16 scores at a time.
 *   values: the run's accumulators (up to 4 heads x 64 dims = 16 zmm) stay in registers across
 *     the whole token loop; each token's value row is loaded (widened, for bf16) once.
 * A bf16 cache is read by vdpbf16ps (bf16 pairs multiplied exactly, summed in float32) when the
 * query is itself exactly bf16 -- always so when the model runs in bf16, since the query then
 * came out of a bf16 linear and was widened to float32 exactly on its way here; otherwise (a
 * float32 query over a bf16 cache) keys are widened and multiplied in float32, as the scalar
 * kernel does, so no input is ever rounded. Taken when head_dim is a multiple of 32; other
 * head sizes use the scalar kernels above, as does a compiler without AVX-512.
 *
 * Memory: in a served decode step every layer's KV is cold (the step's weights and the other
 * layers passed through the caches since), and an item that waits for its own rows reads DRAM
 * far below its bandwidth. So each thread runs a known run of items and, while one computes,
 * asks for the next one's rows into L2 a few tokens per tile (struct prefetch_cursor). The
 * real bf16 step (SmolLM2-135M, 2-core AMD EPYC Zen 4, interleaved A/B in one process, a noisy
 * shared host): attention per step at batch 32, context 512, 0.66-0.89x of before (e.g. 30.2 ->
 * 21.4 ms); context 128 0.70-0.77x (7.4 -> 5.2); batch 16, context 512, 17.7 -> 13.6 ms;
 * batch 1 about even. Into L1 (T0) the same prefetches gave nearly all of it back; into L3
 * (T2) about half.
 */
#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"

#define TILE 16            /* tokens per score tile: one register of float32 scores */
#define MAX_TILE_HEADS 4   /* query heads per run: 4 heads x 4 tokens of score accumulators */
#define PREFETCH_TOKENS 16 /* rows fetched this many tokens ahead (blocks scatter; fp32 batch 16 -10%) */
#define VALUE_DIMS 64      /* dims per value pass: 4 heads x 4 registers of accumulators */

enum cache_kind { CACHE_F32, CACHE_BF16_WIDEN, CACHE_BF16_DOT };

/* Four vectors' 128-bit lanes each summed: lane L of the result is [sum of a's lane L, b's, c's,
 * d's]. */
static inline __m512 fold4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
}

/* Two fold4 results (tokens 0-3 and 4-7): lanes [x's 0+1, x's 2+3, y's 0+1, y's 2+3]. */
static inline __m512 fold_lanes(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The next work item's K and V rows, asked into cache a few tokens at a time while this item
 * computes: a decode step finds every layer's KV cold (a whole step's weights and other layers
 * went through the caches since), and an item that waits for its own rows reads DRAM at a
 * fraction of its bandwidth. Spread over the item's tiles, the next item's reads overlap this
 * item's arithmetic. */
struct prefetch_cursor {
    const char *key, *value;        /* the caches, advanced to the item's first KV head */
    const int32_t *table;
    int context, next, block_size;
    int64_t block_bytes, token_bytes, row_bytes;   /* row_bytes: the item's heads of one token */
    int per_tile;                   /* tokens fetched per tile of this item's work */
};

/* The cursor's next per_tile tokens, into L2 (T1: into L1 they evict the rows this item is
 * reading; measured, T0 gave back the whole gain). */
static inline void prefetch_advance(struct prefetch_cursor *c) {
    if (c == NULL || c->next >= c->context) return;
    const int end = c->next + c->per_tile < c->context ? c->next + c->per_tile : c->context;
    int blk = c->next / c->block_size, slot = c->next % c->block_size;
    for (; c->next < end; ++c->next) {
        const int64_t at = (int64_t)c->table[blk] * c->block_bytes + (int64_t)slot * c->token_bytes;
        for (int64_t b = 0; b < c->row_bytes; b += 64) {
            _mm_prefetch(c->key + at + b, _MM_HINT_T1);
            _mm_prefetch(c->value + at + b, _MM_HINT_T1);
        }
        if (++slot == c->block_size) { slot = 0; ++blk; }
    }
}

/* One item's geometry, shared by its passes. */
struct item {
    const void *key, *value;        /* the caches, advanced to this KV head */
    const int64_t *rows;            /* element offset of each token's row, from the block table */
    int context, head_dim;
    int64_t score_stride;           /* floats between two heads' score rows */
    struct prefetch_cursor *ahead;  /* the next item's rows (NULL: none) */
};

/* Dot products of NG query heads (q: their float32 rows, or qb: bf16 rows; head_dim apart) with
 * the keys of tokens p0 .. p0+3, folded: f[g] holds head g's four sums by 128-bit lane (fold4).
 * A token past the context reads the last real one instead; its lane is never stored. */
static inline __attribute__((always_inline)) void score_quad(
        const struct item *it, enum cache_kind kind, int NG, const float *q, const uint16_t *qb,
        int p0, __m512 *f) {
    const int D = it->head_dim;
    const void *row[4];
    for (int j = 0; j < 4; ++j) {
        const int p = p0 + j < it->context ? p0 + j : it->context - 1;
        row[j] = kind == CACHE_F32 ? (const void *)((const float *)it->key + it->rows[p])
                                   : (const void *)((const uint16_t *)it->key + it->rows[p]);
    }
    for (int j = 0; j < 4; ++j)
        if (p0 + j + PREFETCH_TOKENS < it->context) {
            const char *ahead = (const char *)it->key
                + it->rows[p0 + j + PREFETCH_TOKENS] * (kind == CACHE_F32 ? 4 : 2);
            for (int b = 0; b < D * (kind == CACHE_F32 ? 4 : 2); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        }
    __m512 acc[MAX_TILE_HEADS][4];
    for (int g = 0; g < NG; ++g)
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    if (kind == CACHE_BF16_DOT) {
#if defined(__AVX512BF16__)
        for (int d = 0; d < D; d += 32) {
            __m512i k[4];
            for (int j = 0; j < 4; ++j) k[j] = _mm512_loadu_si512((const uint16_t *)row[j] + d);
            for (int g = 0; g < NG; ++g) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + (int64_t)g * D + d);
                for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qv, (__m512bh)k[j]);
            }
        }
#endif
    } else {
        for (int d = 0; d < D; d += 16) {
            __m512 k[4];
            for (int j = 0; j < 4; ++j)
                k[j] = kind == CACHE_F32 ? _mm512_loadu_ps((const float *)row[j] + d)
                                         : widen16((const uint16_t *)row[j] + d);
            for (int g = 0; g < NG; ++g) {
                const __m512 qv = _mm512_loadu_ps(q + (int64_t)g * D + d);
                for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(qv, k[j], acc[g][j]);
            }
        }
    }
    for (int g = 0; g < NG; ++g) f[g] = fold4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
}

/* Scores of NG query heads against every token, times scale, into scores[g * score_stride + p],
 * 16 tokens (one register per head) at a time; each head's maximum into maxes. */
static inline __attribute__((always_inline)) void score_run(
        const struct item *it, enum cache_kind kind, int NG, const float *q, const uint16_t *qb,
        float scale, float *scores, float *maxes) {
    const int context = it->context;
    __m512 vmax[MAX_TILE_HEADS];
    for (int g = 0; g < NG; ++g) vmax[g] = _mm512_set1_ps(-INFINITY);
    for (int p0 = 0; p0 < context; p0 += TILE) {
        prefetch_advance(it->ahead);
        __m512 a[MAX_TILE_HEADS], b[MAX_TILE_HEADS], lo[MAX_TILE_HEADS];
        score_quad(it, kind, NG, q, qb, p0, a);
        score_quad(it, kind, NG, q, qb, p0 + 4, b);
        for (int g = 0; g < NG; ++g) lo[g] = fold_lanes(a[g], b[g]);
        score_quad(it, kind, NG, q, qb, p0 + 8, a);
        score_quad(it, kind, NG, q, qb, p0 + 12, b);
        const int left = context - p0;
        const __mmask16 m = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int g = 0; g < NG; ++g) {
            const __m512 s = _mm512_mul_ps(fold_lanes(lo[g], fold_lanes(a[g], b[g])), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + g * it->score_stride + p0, m, s);
            vmax[g] = _mm512_mask_max_ps(vmax[g], m, vmax[g], s);
        }
    }
    for (int g = 0; g < NG; ++g) maxes[g] = _mm512_reduce_max_ps(vmax[g]);
}

/* Scores of one head row turned into exp(score - max) in place; returns 1 / their sum. */
static float softmax_row(float *s, int context, float max) {
    const __m512 vm = _mm512_set1_ps(max);
    __m512 total = _mm512_setzero_ps();
    for (int p = 0; p < context; p += 16) {
        const int left = context - p;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + p), vm));
        _mm512_mask_storeu_ps(s + p, m, e);
        total = _mm512_mask_add_ps(total, m, total, e);
    }
    return 1.0f / _mm512_reduce_add_ps(total);
}

/* out[g][d0 .. d0 + 16 NV) = inv[g] * sum over tokens of weights[g][p] * value row[p][d0 ..],
 * the NG x NV accumulators in registers for the whole token loop. */
static inline __attribute__((always_inline)) void value_run(
        const struct item *it, enum cache_kind kind, int NG, int NV, int d0, const float *weights,
        const float *inv, float *out) {
    __m512 acc[MAX_TILE_HEADS][VALUE_DIMS / 16];
    for (int g = 0; g < NG; ++g)
        for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
    const int row_bytes = it->head_dim * (kind == CACHE_F32 ? 4 : 2);
    for (int p = 0; p < it->context; ++p) {
        if (p % TILE == 0) prefetch_advance(it->ahead);
        if (p + PREFETCH_TOKENS < it->context) {
            const char *ahead = (const char *)it->value
                + (it->rows[p + PREFETCH_TOKENS] + d0) * (kind == CACHE_F32 ? 4 : 2);
            for (int b = 0; b < row_bytes && b < 4 * VALUE_DIMS; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        }
        __m512 x[VALUE_DIMS / 16];
        for (int v = 0; v < NV; ++v)
            x[v] = kind == CACHE_F32 ? _mm512_loadu_ps((const float *)it->value + it->rows[p] + d0 + 16 * v)
                                     : widen16((const uint16_t *)it->value + it->rows[p] + d0 + 16 * v);
        for (int g = 0; g < NG; ++g) {
            const __m512 w = _mm512_set1_ps(weights[g * it->score_stride + p]);
            for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(w, x[v], acc[g][v]);
        }
    }
    for (int g = 0; g < NG; ++g)
        for (int v = 0; v < NV; ++v)
            _mm512_storeu_ps(out + (int64_t)g * it->head_dim + d0 + 16 * v,
                             _mm512_mul_ps(acc[g][v], _mm512_set1_ps(inv[g])));
}

/* The run's value pass over all of head_dim: 64 dims at a time, then a last 32 if left. */
static inline __attribute__((always_inline)) void values_all(
        const struct item *it, enum cache_kind kind, int NG, const float *weights, const float *inv,
        float *out) {
    int d0 = 0;
    for (; d0 + VALUE_DIMS <= it->head_dim; d0 += VALUE_DIMS)
        value_run(it, kind, NG, VALUE_DIMS / 16, d0, weights, inv, out);
    if (d0 < it->head_dim) value_run(it, kind, NG, 2, d0, weights, inv, out);
}

/* A run of ng (1..MAX_TILE_HEADS) query heads: scores, softmax, values, written to out. */
static inline __attribute__((always_inline)) void attend_run_kind(
        const struct item *it, enum cache_kind kind, int ng, const float *q, const uint16_t *qb,
        float scale, float *scores, float *out) {
    float maxes[MAX_TILE_HEADS], inv[MAX_TILE_HEADS];
    switch (ng) {   /* constant head counts, so every accumulator array lives in registers */
    case 1: score_run(it, kind, 1, q, qb, scale, scores, maxes); break;
    case 2: score_run(it, kind, 2, q, qb, scale, scores, maxes); break;
    case 3: score_run(it, kind, 3, q, qb, scale, scores, maxes); break;
    default: score_run(it, kind, 4, q, qb, scale, scores, maxes); break;
    }
    for (int g = 0; g < ng; ++g) inv[g] = softmax_row(scores + g * it->score_stride, it->context, maxes[g]);
    switch (ng) {
    case 1: values_all(it, kind, 1, scores, inv, out); break;
    case 2: values_all(it, kind, 2, scores, inv, out); break;
    case 3: values_all(it, kind, 3, scores, inv, out); break;
    default: values_all(it, kind, 4, scores, inv, out); break;
    }
}

static void attend_run(const struct item *it, enum cache_kind kind, int ng, const float *q,
                       const uint16_t *qb, float scale, float *scores, float *out) {
    switch (kind) {
    case CACHE_F32: attend_run_kind(it, CACHE_F32, ng, q, qb, scale, scores, out); break;
    case CACHE_BF16_WIDEN: attend_run_kind(it, CACHE_BF16_WIDEN, ng, q, qb, scale, scores, out); break;
    default: attend_run_kind(it, CACHE_BF16_DOT, ng, q, qb, scale, scores, out); break;
    }
}

/* A bf16 query and output in rows of a wider matrix (paged_attention_bf16_rows), instead of
 * float32 [num_seqs][num_heads][head_dim]: the model's step passes its rotated queries and its
 * attention output buffer as they are. */
struct bf16_rows {
    const uint16_t *query;
    int64_t query_stride;           /* elements between two sequences' query rows */
    uint16_t *out;
    int64_t out_stride;
};

/* An item's float32 output [nq][head_dim] rounded to bf16 (to nearest even, as torch rounds)
 * into its sequence's output row. head_dim is a multiple of 32. */
static void round_out(const float *o, const struct bf16_rows *bf16, int b, int q0, int nq, int head_dim) {
#if defined(__AVX512BF16__)
    uint16_t *dst = bf16->out + (int64_t)b * bf16->out_stride + (int64_t)q0 * head_dim;
    for (int64_t j = 0; j < (int64_t)nq * head_dim; j += 16)
        _mm256_storeu_si256((__m256i *)(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(o + j)));
#else
    (void)o; (void)bf16; (void)b; (void)q0; (void)nq; (void)head_dim;
#endif
}

/* The AVX-512 kernel; cache is float32 (CACHE_F32) or bf16 (either other kind). Same contract,
 * arguments and statuses as the scalar kernels; with bf16 (non-NULL; CACHE_BF16_DOT only) the
 * query and output are its rows, and query / out are unused. */
static int paged_attention_avx512(
        const float *query, const void *key_cache, const void *value_cache, int64_t block_stride,
        int64_t token_stride, int64_t head_stride, const int32_t *block_tables, int64_t table_stride,
        const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
        int block_size, float scale, float *out, int num_threads, enum cache_kind kind,
        const struct bf16_rows *bf16) {
    const int group = num_heads / num_kv_heads;
    int max_context = 1;
    for (int b = 0; b < num_seqs; ++b)
        if (context_lens[b] > max_context) max_context = context_lens[b];
    /* The scalar kernels' split into work items (sequence, run of KV heads). */
    int chunks = (ITEMS_PER_THREAD * num_threads + num_seqs - 1) / num_seqs;
    if (chunks > num_kv_heads) chunks = num_kv_heads;
    if (chunks < 1) chunks = 1;
    const int heads_per_chunk = (num_kv_heads + chunks - 1) / chunks;
    chunks = (num_kv_heads + heads_per_chunk - 1) / heads_per_chunk;
    /* Per thread: scores [MAX_TILE_HEADS][context rounded up to a tile], token row offsets
     * [max_context] (int64, counted as two floats each), the item's query in bf16 [nq][head_dim]
     * (half a float each). */
    const int64_t score_stride = ((int64_t)max_context + TILE - 1) / TILE * TILE;
    const int64_t q_per_chunk = (int64_t)heads_per_chunk * group;
    const int64_t row = MAX_TILE_HEADS * score_stride + 2 * (int64_t)max_context + (q_per_chunk * head_dim + 1) / 2
                        + q_per_chunk * head_dim + 16;
    float *scratch = malloc(sizeof(float) * (size_t)(row * num_threads));
    if (scratch == NULL) return -1;
    const size_t elem = kind == CACHE_F32 ? sizeof(float) : sizeof(uint16_t);
    const int items = num_seqs * chunks;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        /* schedule(static)'s split of the items, written out so that an item knows the next one
         * its thread runs (and can fetch its rows ahead). */
        const int threads = omp_get_num_threads(), tid = omp_get_thread_num();
        const int share = items / threads, extra = items % threads;
        const int first = tid * share + (tid < extra ? tid : extra), last = first + share + (tid < extra);
        float *scores = scratch + row * tid;
        int64_t *rows = (int64_t *)(scores + MAX_TILE_HEADS * score_stride);
        uint16_t *qb_scratch = (uint16_t *)(rows + max_context);
        /* the item's float32 output before rounding, with a bf16 output (16 floats aligned) */
        float *o_scratch = (float *)(((uintptr_t)(qb_scratch + q_per_chunk * head_dim) + 63) & ~(uintptr_t)63);
        for (int i = first; i < last; ++i) {
            const int b = i / chunks, c = i % chunks;
            const int kv0 = c * heads_per_chunk;
            const int kv1 = kv0 + heads_per_chunk < num_kv_heads ? kv0 + heads_per_chunk : num_kv_heads;
            const int q0 = kv0 * group, nq = (kv1 - kv0) * group;
            const float *q = bf16 ? NULL : query + ((int64_t)b * num_heads + q0) * head_dim;
            const uint16_t *qb = bf16 ? bf16->query + (int64_t)b * bf16->query_stride + (int64_t)q0 * head_dim
                                      : qb_scratch;
            float *o = bf16 ? o_scratch : out + ((int64_t)b * num_heads + q0) * head_dim;
            const int32_t *table = block_tables + (int64_t)b * table_stride;
            const int context = context_lens[b];
            if (context <= 0) {   /* nothing to attend to: zeros, as the scalar kernels give */
                for (int64_t j = 0; j < (int64_t)nq * head_dim; ++j) o[j] = 0.0f;
                if (bf16) round_out(o, bf16, b, q0, nq, head_dim);
                continue;
            }
            struct prefetch_cursor next, *ahead = NULL;
            if (i + 1 < last && context_lens[(i + 1) / chunks] > 0) {
                const int nb = (i + 1) / chunks, nkv0 = (i + 1) % chunks * heads_per_chunk;
                const int nkv1 = nkv0 + heads_per_chunk < num_kv_heads ? nkv0 + heads_per_chunk : num_kv_heads;
                /* this item's calls to prefetch_advance: a score tile, or a value pass's 16 tokens */
                const int64_t tiles = (int64_t)(kv1 - kv0) * ((group + MAX_TILE_HEADS - 1) / MAX_TILE_HEADS)
                                      * ((context + TILE - 1) / TILE) * (1 + (head_dim + VALUE_DIMS - 1) / VALUE_DIMS);
                next = (struct prefetch_cursor){
                    .key = (const char *)key_cache + (size_t)nkv0 * (size_t)head_stride * elem,
                    .value = (const char *)value_cache + (size_t)nkv0 * (size_t)head_stride * elem,
                    .table = block_tables + (int64_t)nb * table_stride, .context = context_lens[nb], .next = 0,
                    .block_size = block_size, .block_bytes = block_stride * (int64_t)elem,
                    .token_bytes = token_stride * (int64_t)elem,
                    .row_bytes = ((int64_t)(nkv1 - nkv0 - 1) * head_stride + head_dim) * (int64_t)elem,
                    /* Spread over all of this item's tiles. Packed into its first quarter
                     * (as first written), the bursts held up the item's own reads: batch 32,
                     * context 128, attention 5.49 -> 4.65 ms a step; context 512 18.4 -> 14.9;
                     * batch 16 2.69 -> 2.30; batch 4, context 512, 2.65 -> 2.52 (interleaved A/B
                     * in the real bf16 step, the 2-core AMD EPYC Zen 4). */
                    .per_tile = (int)((context_lens[nb] + tiles - 1) / tiles),
                };
                ahead = &next;
            }
            for (int p = 0, blk = 0, slot = 0; p < context; ++p) {
                rows[p] = (int64_t)table[blk] * block_stride + (int64_t)slot * token_stride;
                if (++slot == block_size) { slot = 0; ++blk; }
            }
            if (kind == CACHE_BF16_DOT && !bf16)   /* exact: the caller checked the query is bf16 */
                for (int64_t j = 0; j < (int64_t)nq * head_dim; ++j) {
                    union { float f; uint32_t u; } v = { .f = q[j] };
                    qb_scratch[j] = (uint16_t)(v.u >> 16);
                }
            for (int kvh = kv0; kvh < kv1; ++kvh) {
                struct item it = {
                    .key = (const char *)key_cache + (size_t)kvh * (size_t)head_stride * elem,
                    .value = (const char *)value_cache + (size_t)kvh * (size_t)head_stride * elem,
                    .rows = rows, .context = context, .head_dim = head_dim, .score_stride = score_stride,
                    .ahead = ahead,
                };
                for (int g0 = 0; g0 < group; g0 += MAX_TILE_HEADS) {
                    const int ng = group - g0 < MAX_TILE_HEADS ? group - g0 : MAX_TILE_HEADS;
                    const int64_t at = (int64_t)(kvh - kv0) * group + g0;   /* within the item */
                    attend_run(&it, kind, ng, q ? q + at * head_dim : NULL, qb + at * head_dim, scale, scores,
                               o + at * head_dim);
                }
            }
            if (bf16) round_out(o, bf16, b, q0, nq, head_dim);
        }
    }
    free(scratch);
    return 0;
}

/* Whether every query element is a bf16 value (its low 16 bits zero), so vdpbf16ps reads it
 * exactly. */
static int query_is_bf16(const float *query, int64_t n) {
    uint32_t low = 0;
    for (int64_t i = 0; i < n; ++i) {
        union { float f; uint32_t u; } v = { .f = query[i] };
        low |= v.u & 0xFFFFu;
    }
    return low == 0;
}
#endif

/* The entry points: the AVX-512 kernel where compiled in and head_dim suits it, else the scalar
 * one. Returns 0; -1 if the scratch buffer could not be allocated, -2 if num_kv_heads does not
 * divide num_heads (nothing is written then). */
int paged_attention_f32(const float *query, const float *key_cache, const float *value_cache,
                        int64_t block_stride, int64_t token_stride, int64_t head_stride,
                        const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                        int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, float *out, int num_threads) {
#if defined(__AVX512F__)
    if (num_kv_heads >= 1 && num_heads % num_kv_heads == 0 && head_dim % 32 == 0)
        return paged_attention_avx512(query, key_cache, value_cache, block_stride, token_stride, head_stride,
                                      block_tables, table_stride, context_lens, num_seqs, num_heads,
                                      num_kv_heads, head_dim, block_size, scale, out,
                                      num_threads < 1 ? 1 : num_threads, CACHE_F32, NULL);
#endif
    return paged_attention_f32_scalar(query, key_cache, value_cache, block_stride, token_stride, head_stride,
                                      block_tables, table_stride, context_lens, num_seqs, num_heads,
                                      num_kv_heads, head_dim, block_size, scale, out, num_threads);
}

int paged_attention_bf16(const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
                         int64_t block_stride, int64_t token_stride, int64_t head_stride,
                         const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                         int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                         float scale, float *out, int num_threads) {
#if defined(__AVX512F__)
    if (num_kv_heads >= 1 && num_heads % num_kv_heads == 0 && head_dim % 32 == 0) {
        enum cache_kind kind = CACHE_BF16_WIDEN;
#if defined(__AVX512BF16__)
        if (query_is_bf16(query, (int64_t)num_seqs * num_heads * head_dim)) kind = CACHE_BF16_DOT;
#endif
        return paged_attention_avx512(query, key_cache, value_cache, block_stride, token_stride, head_stride,
                                      block_tables, table_stride, context_lens, num_seqs, num_heads,
                                      num_kv_heads, head_dim, block_size, scale, out,
                                      num_threads < 1 ? 1 : num_threads, kind, NULL);
    }
#endif
    return paged_attention_bf16_scalar(query, key_cache, value_cache, block_stride, token_stride, head_stride,
                                       block_tables, table_stride, context_lens, num_seqs, num_heads,
                                       num_kv_heads, head_dim, block_size, scale, out, num_threads);
}

/* A bf16 query and cache, the output in bf16: the query's sequences query_stride elements
 * apart, the output's out_stride apart (each row [num_heads][head_dim] contiguous), as the
 * model's bf16 step holds them, so neither is converted or copied around the call. Each output
 * is the float32 result paged_attention_bf16 gives for the same (exactly bf16) query, rounded
 * once to bf16. Returns paged_attention_bf16's statuses, and -5 where this build or these
 * shapes cannot take it (no AVX-512 BF16, head_dim not a multiple of 32): nothing is written
 * then, and the caller keeps the float32 entry. */
/* Whether paged_attention_bf16_rows is built here (AVX-512 BF16 in the compiler's target). */
int paged_attention_bf16_rows_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int paged_attention_bf16_rows(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                              const uint16_t *value_cache, int64_t block_stride, int64_t token_stride,
                              int64_t head_stride, const int32_t *block_tables, int64_t table_stride,
                              const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads,
                              int head_dim, int block_size, float scale, uint16_t *out, int64_t out_stride,
                              int num_threads) {
#if defined(__AVX512BF16__)
    if (num_kv_heads < 1 || num_heads % num_kv_heads) return -2;
    if (head_dim % 32 == 0) {
        const struct bf16_rows rows = { .query = query, .query_stride = query_stride, .out = out,
                                        .out_stride = out_stride };
        return paged_attention_avx512(NULL, key_cache, value_cache, block_stride, token_stride, head_stride,
                                      block_tables, table_stride, context_lens, num_seqs, num_heads,
                                      num_kv_heads, head_dim, block_size, scale, NULL,
                                      num_threads < 1 ? 1 : num_threads, CACHE_BF16_DOT, &rows);
    }
#endif
    (void)query; (void)query_stride; (void)key_cache; (void)value_cache; (void)block_stride; (void)token_stride;
    (void)head_stride; (void)block_tables; (void)table_stride; (void)context_lens; (void)num_seqs;
    (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)out;
    (void)out_stride; (void)num_threads;
    return BF16_ROWS_UNSUPPORTED;
}

/* ------------------------------------------------------------------ checks and cache writes
 *
 * Both run once per layer call, so they replace what used to be a handful of torch reductions
 * and index ops per layer (block-id range checks, the slot arithmetic, two index_put): on the
 * 2-core AMD EPYC those cost ~0.15 ms a layer, ~4.5 ms of a 34 ms SmolLM2 decode step at batch 1.
 */

/* Whether the tables may be read: every context fits its table row (table_width blocks), and
 * every block id a context reaches lies in [0, num_blocks). Returns 0; -3 if a context is
 * longer than its row, -4 if a block id is out of range. Nothing else is read. */
int check_block_tables(const int32_t *block_tables, int64_t table_stride, int64_t table_width,
                       const int32_t *context_lens, int num_seqs, int block_size, int64_t num_blocks) {
    for (int b = 0; b < num_seqs; ++b) {
        const int64_t used = ((int64_t)context_lens[b] + block_size - 1) / block_size;
        if (used > table_width) return -3;
        const int32_t *table = block_tables + (int64_t)b * table_stride;
        for (int64_t i = 0; i < used; ++i)
            if (table[i] < 0 || table[i] >= num_blocks) return -4;
    }
    return 0;
}

/* Copy each token's key and value row (row_bytes: its heads side by side) into its cache slot,
 * slot = block * block_size + offset; a slot < 0 is padding and skipped. Sources are rows
 * key_stride / value_stride bytes apart; in the caches a block is block_stride bytes, a token
 * token_stride bytes, and a row contiguous. Returns 0; -4 if a slot lies past the pool (nothing
 * is written then). */
int write_kv_rows(const char *key, const char *value, int64_t key_stride, int64_t value_stride,
                  char *key_cache, char *value_cache, int64_t block_stride, int64_t token_stride,
                  const int64_t *slots, int num_tokens, int block_size, int64_t num_blocks,
                  int64_t row_bytes) {
    for (int t = 0; t < num_tokens; ++t)
        if (slots[t] >= num_blocks * block_size) return -4;
    for (int t = 0; t < num_tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t at = slot / block_size * block_stride + slot % block_size * token_stride;
        memcpy(key_cache + at, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + at, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
