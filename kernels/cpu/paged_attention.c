/* Decode attention over a paged KV cache on the CPU, float32: one query token per sequence.
 *
 * Grouped-query attention: the caches hold num_kv_heads heads (a divisor of num_heads); query
 * head h reads KV head h / (num_heads / num_kv_heads).
 *
 * Same function as kernels.reference.paged_attention, without its dense gather: each (sequence,
 * head) reads its keys and values straight from the cache blocks its block table names, once,
 * in two passes (scores, then the softmax-weighted sum of values). Scores and the softmax are
 * float32, as in the reference. Slots past a sequence's context are never read, so a recycled
 * block's stale values cannot leak in.
 *
 * Caches are per-layer views [num_blocks, block_size, num_heads, head_dim] of the block-major
 * pool, passed as a base pointer plus element strides (the block stride spans every layer of the
 * block); head_dim is contiguous. Query and output are contiguous [num_seqs, num_heads, head_dim].
 *
 * Built by kernels/cpu_ops.py with the system C compiler (-O3 -march=native -fopenmp) and
 * called through ctypes, which releases the GIL for the call. Work is split over (sequence,
 * head) pairs on num_threads OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

/* Lanes of the independent partial sums: wide enough for one AVX-512 register of floats, and
 * independent per lane, so the compiler vectorises the dot product without reassociating. */
#define LANES 16

static float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) acc[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (; i < n; ++i) sum += a[i] * b[i];
    for (int j = 0; j < LANES; ++j) sum += acc[j];
    return sum;
}

/* Element offset of position p's slot in a per-layer cache view. */
static inline int64_t slot_of(const int32_t *table, int p, int block_size, int64_t block_stride,
                              int64_t token_stride) {
    return (int64_t)table[p / block_size] * block_stride + (int64_t)(p % block_size) * token_stride;
}

/* Returns 0; -1 if the scratch buffer could not be allocated, -2 if num_kv_heads does not divide
 * num_heads (nothing is written then). */
int paged_attention_f32(const float *query, const float *key_cache, const float *value_cache,
                        int64_t block_stride, int64_t token_stride, int64_t head_stride,
                        const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                        int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, float *out, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) return -2;
    const int group = num_heads / num_kv_heads;
    int max_context = 0;
    for (int b = 0; b < num_seqs; ++b)
        if (context_lens[b] > max_context) max_context = context_lens[b];
    /* One scratch row per thread (scores, then the value accumulator), allocated up front so
     * every thread reaches the work-sharing loop. */
    const int64_t row = (int64_t)(max_context > 0 ? max_context : 1) + head_dim;
    float *scratch = malloc(sizeof(float) * (size_t)(row * (num_threads > 0 ? num_threads : 1)));
    if (scratch == NULL) return -1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int b = 0; b < num_seqs; ++b) {
        for (int h = 0; h < num_heads; ++h) {
            float *scores = scratch + row * omp_get_thread_num();
            float *acc = scores + (row - head_dim);
            const float *q = query + ((int64_t)b * num_heads + h) * head_dim;
            const int64_t kv_head = (int64_t)(h / group) * head_stride;
            const int32_t *table = block_tables + (int64_t)b * table_stride;
            const int context = context_lens[b];
            float max_score = -INFINITY;
            for (int p = 0; p < context; ++p) {
                const float s = dot(q, key_cache + slot_of(table, p, block_size, block_stride, token_stride) +
                                           kv_head, head_dim) * scale;
                scores[p] = s;
                if (s > max_score) max_score = s;
            }
            float total = 0.0f;
            for (int p = 0; p < context; ++p) {
                scores[p] = expf(scores[p] - max_score);
                total += scores[p];
            }
            for (int d = 0; d < head_dim; ++d) acc[d] = 0.0f;
            for (int p = 0; p < context; ++p) {
                const float *v = value_cache + slot_of(table, p, block_size, block_stride, token_stride) +
                                 kv_head;
                const float w = scores[p];
                for (int d = 0; d < head_dim; ++d) acc[d] += w * v[d];
            }
            float *o = out + ((int64_t)b * num_heads + h) * head_dim;
            const float inv = context > 0 ? 1.0f / total : 0.0f;
            for (int d = 0; d < head_dim; ++d) o[d] = acc[d] * inv;
        }
    }
    free(scratch);
    return 0;
}
