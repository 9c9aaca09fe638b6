// Paged decode attention: one query token per sequence against its KV blocks in the paged cache.
//
// Owns: the `paged_attention_{f16,bf16,f32}` entry points loaded by fastserve/kernels/cupy_ops.py.
//
// Layout (see fastserve/kernels/__init__.py): key_cache / value_cache are per-layer views
// [num_blocks, block_size, num_heads, head_dim] of a block-major cache, so the block stride is
// NOT block_size * num_heads * head_dim; every stride except the innermost (1) is passed in.
//
// Grouped-query attention: the caches hold num_kv_heads heads (a divisor of num_heads, checked by
// the launcher); query head h reads KV head h / (num_heads / num_kv_heads).
//
// Grid: (num_heads, num_seqs); one thread block per (head, sequence). Each warp walks every
// NUM_WARPS-th context position with its own online-softmax state (running max, running sum,
// fp32 accumulator spread over the lanes); the warps merge their states through shared memory.
// Softmax and accumulation are fp32 whatever the storage type (matches HF OPT's fp32 softmax).
//
// Its one #include, half_types.cuh (raw 16-bit fp16/bf16 storage), is spliced in by cupy_ops.py,
// so NVRTC compiles it through any CuPy wheel without the toolkit's headers.

constexpr int WARP_SIZE = 32;
constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = WARP_SIZE * NUM_WARPS;  // launch with exactly this many threads
constexpr int MAX_HEAD_DIM = 256;
constexpr int DIMS_PER_LANE = MAX_HEAD_DIM / WARP_SIZE;
constexpr unsigned int FULL_WARP_MASK = 0xffffffffu;
constexpr unsigned int NEG_INF_BITS = 0xff800000u;

#include "half_types.cuh"

// Butterfly reduction so that every lane ends up holding the full sum.
__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        x += __shfl_xor_sync(FULL_WARP_MASK, x, offset);
    }
    return x;
}

template <typename T>
__device__ void paged_attention_impl(
    T* __restrict__ out,                     // [num_seqs, num_heads, head_dim], contiguous
    const T* __restrict__ query,             // [num_seqs, num_heads, head_dim], strided
    const T* __restrict__ key_cache,         // [num_blocks, block_size, num_heads, head_dim]
    const T* __restrict__ value_cache,       // same shape, own strides
    const int* __restrict__ block_tables,    // [num_seqs, block_table_stride]
    const int* __restrict__ context_lens,    // [num_seqs]
    const float scale,
    const int num_heads,
    const int num_kv_heads,
    const int head_dim,
    const int block_size,
    const long long block_table_stride,
    const long long q_seq_stride,
    const long long q_head_stride,
    const long long k_block_stride,
    const long long k_token_stride,
    const long long k_head_stride,
    const long long v_block_stride,
    const long long v_token_stride,
    const long long v_head_stride) {
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const float neg_inf = __uint_as_float(NEG_INF_BITS);

    __shared__ float warp_max[NUM_WARPS];
    __shared__ float warp_sum_exp[NUM_WARPS];
    __shared__ float warp_acc[NUM_WARPS][MAX_HEAD_DIM];

    const int context_len = context_lens[seq];
    const int* table = block_tables + seq * block_table_stride;
    const T* q_ptr = query + seq * q_seq_stride + head * q_head_stride;

    // Lane `lane` owns dims lane, lane + 32, ...; scaling q once saves a multiply per token.
    float q[DIMS_PER_LANE];
    float acc[DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + i * WARP_SIZE;
        q[i] = d < head_dim ? to_float(q_ptr[d]) * scale : 0.0f;
        acc[i] = 0.0f;
    }

    float running_max = neg_inf;
    float running_sum = 0.0f;
    for (int pos = warp; pos < context_len; pos += NUM_WARPS) {
        const long long block = table[pos / block_size];
        const long long offset = pos % block_size;
        const T* k_ptr = key_cache + block * k_block_stride + offset * k_token_stride
                         + kv_head * k_head_stride;
        const T* v_ptr = value_cache + block * v_block_stride + offset * v_token_stride
                         + kv_head * v_head_stride;
        float partial = 0.0f;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            const int d = lane + i * WARP_SIZE;
            if (d < head_dim) partial += q[i] * to_float(k_ptr[d]);
        }
        const float score = warp_sum(partial);
        const float new_max = fmaxf(running_max, score);
        const float correction = expf(running_max - new_max);
        const float p = expf(score - new_max);
        running_sum = running_sum * correction + p;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) {
            const int d = lane + i * WARP_SIZE;
            if (d < head_dim) acc[i] = acc[i] * correction + p * to_float(v_ptr[d]);
        }
        running_max = new_max;
    }

    if (lane == 0) {
        warp_max[warp] = running_max;
        warp_sum_exp[warp] = running_sum;
    }
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + i * WARP_SIZE;
        if (d < head_dim) warp_acc[warp][d] = acc[i];
    }
    __syncthreads();

    // A warp that saw no position (context shorter than NUM_WARPS) has sum 0 and max -inf;
    // skipping it avoids exp(-inf - -inf) = NaN.
    float global_max = neg_inf;
    for (int w = 0; w < NUM_WARPS; ++w) {
        if (warp_sum_exp[w] > 0.0f) global_max = fmaxf(global_max, warp_max[w]);
    }
    float weights[NUM_WARPS];
    float denom = 0.0f;
    for (int w = 0; w < NUM_WARPS; ++w) {
        weights[w] = warp_sum_exp[w] > 0.0f ? expf(warp_max[w] - global_max) : 0.0f;
        denom += warp_sum_exp[w] * weights[w];
    }
    const float inv_denom = denom > 0.0f ? 1.0f / denom : 0.0f;

    T* out_ptr = out + (static_cast<long long>(seq) * num_heads + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += NUM_THREADS) {
        float value = 0.0f;
        for (int w = 0; w < NUM_WARPS; ++w) value += warp_acc[w][d] * weights[w];
        out_ptr[d] = from_float<T>(value * inv_denom);
    }
}

#define DEFINE_PAGED_ATTENTION(SUFFIX, T)                                                      \
    extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_##SUFFIX(       \
        T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,     \
        const T* __restrict__ value_cache, const int* __restrict__ block_tables,               \
        const int* __restrict__ context_lens, const float scale, const int num_heads,          \
        const int num_kv_heads, const int head_dim, const int block_size,                      \
        const long long block_table_stride,                                                    \
        const long long q_seq_stride, const long long q_head_stride,                           \
        const long long k_block_stride, const long long k_token_stride,                        \
        const long long k_head_stride, const long long v_block_stride,                         \
        const long long v_token_stride, const long long v_head_stride) {                       \
        paged_attention_impl<T>(out, query, key_cache, value_cache, block_tables, context_lens, \
                                scale, num_heads, num_kv_heads, head_dim, block_size,          \
                                block_table_stride,                                            \
                                q_seq_stride, q_head_stride, k_block_stride, k_token_stride,   \
                                k_head_stride, v_block_stride, v_token_stride, v_head_stride); \
    }

DEFINE_PAGED_ATTENTION(f16, f16_t)
DEFINE_PAGED_ATTENTION(bf16, bf16_t)
DEFINE_PAGED_ATTENTION(f32, float)
