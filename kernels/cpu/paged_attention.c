/* Decode attention over a paged KV cache on the CPU: one query token per sequence, the cache in
 * float32 (paged_attention_f32) or bfloat16 (paged_attention_bf16: each element widened to float32
 * as it is read; query, scores, softmax, accumulators and output float32 in both).
 *
 * Grouped-query attention: the caches hold num_kv_heads heads (a divisor of num_heads); query
 * head h reads KV head h / (num_heads / num_kv_heads).
 *
 * Same function as kernels.reference.paged_attention, without its dense gather: each work item
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
 * Built by kernels/cpu_ops.py with the system C compiler (-O3 -march=native -fopenmp) and
 * called through ctypes, which releases the GIL for the call. Work items are shared out over
 * num_threads OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

/* Lanes of the independent partial sums: wide enough for one AVX-512 register of floats, and
 * independent per lane, so the compiler vectorises the dot product without reassociating. */
#define LANES 16

/* Work items per thread when a batch has fewer sequences than that: enough to even out uneven
 * contexts, few enough that each item still reads long contiguous runs of heads. */
#define ITEMS_PER_THREAD 4

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
int NAME(const float *query, const T *key_cache, const T *value_cache,                            \
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
