// Paged decode attention split over the context: the data-plane's default decode kernel on CUDA.
//
// Owns: the `paged_attention_v2_{f16,bf16,f32}` and `paged_attention_reduce_{f16,bf16,f32}` entry
// points loaded by fastserve/kernels/cupy_ops.py, compiled once per (head dim, query-head tile) with
// -DPA_HEAD_DIM=.. -DPA_GROUP=.. (the defaults below are what the build report compiles).
//
// Same contract as paged_attention.cu (the one-block-per-(head, sequence) kernel kept as the
// reference): query [S, H, D], per-layer cache views [num_blocks, block_size, KV, D] with every
// stride but the innermost passed in, block tables [S, >= blocks] with a row stride, int32
// context lengths; query head h reads KV head h / (H / KV). Softmax and accumulation in fp32.
//
// Work split (the shape of vLLM's paged_attention_v2 and of flash-decoding; written here):
// - grid (KV * tiles, S, splits). One block serves PA_GROUP query heads that share one KV head, so
//   each key and value row is read from memory once for the whole group (GQA), not once per head.
// - A sequence's context is cut into partitions of PARTITION tokens; block z of a sequence takes
//   partitions z, z + splits, ... and keeps an online softmax across them. `splits` is chosen by the
//   launcher to fill the GPU (few sequences: many splits; many: one), so the grid is the same for
//   any context up to the table's width (what a CUDA graph needs: blocks past a short context exit).
// - Per partition: the block's (block id, offset) pairs are read from the table once into shared
//   memory (no table -> key dependent load chain per token); Q.K with 16-byte loads, a thread group
//   of TG lanes per key row, several rows in flight per warp; scores to shared memory; one exp2 per
//   (head, token); then P.V with 16-byte loads of the value rows.
// - splits == 1: the block writes the normalised output. Otherwise it writes its unnormalised
//   accumulator, running max and sum (log2 domain) to the workspace and paged_attention_reduce
//   merges the splits of each (sequence, head).
//
// Its one #include, half_types.cuh, is spliced in by cupy_ops.py: NVRTC needs no toolkit header.

#ifndef PA_HEAD_DIM
#define PA_HEAD_DIM 128
#endif
#ifndef PA_GROUP
#define PA_GROUP 4
#endif

constexpr int HEAD_DIM = PA_HEAD_DIM;
constexpr int GROUP = PA_GROUP;          // query heads per block (a tile of one KV head's group)
constexpr int WARP_SIZE = 32;
constexpr int NUM_WARPS = 4;
constexpr int NUM_THREADS = WARP_SIZE * NUM_WARPS;  // launch with exactly this many threads
constexpr int PARTITION = 256;           // tokens per partition (shared-memory score rows)
// Key/value rows each thread group has in flight; halved for the widest tiles to keep their
// accumulators in registers.
constexpr int UNROLL = GROUP >= 8 ? 2 : 4;
constexpr int VEC_BYTES = 16;
constexpr int MAX_SPLITS = 1024;         // must equal PAGED_ATTENTION_MAX_SPLITS in cupy_ops.py
constexpr unsigned int FULL_WARP_MASK = 0xffffffffu;
constexpr unsigned int NEG_INF_BITS = 0xff800000u;
constexpr unsigned int HIGH_HALF_MASK = 0xffff0000u;

// Own 16-byte and pair types rather than CUDA's uint4/int2: nothing here depends on what NVRTC
// pre-declares.
struct alignas(16) Vec16 {
    unsigned int x, y, z, w;
};
struct Row {   // where a position lives: block id, offset in the block
    int block;
    int offset;
};

#include "half_types.cuh"

// One 16-byte vector of T as floats.
template <typename T>
struct Vec {
    static constexpr int N = VEC_BYTES / sizeof(T);
};

__device__ __forceinline__ void unpack(const Vec16& raw, float (&out)[4]) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ void unpack_bf16_pair(unsigned int w, float& lo, float& hi) {
    lo = __uint_as_float(w << BF16_SHIFT);
    hi = __uint_as_float(w & HIGH_HALF_MASK);
}

__device__ __forceinline__ void unpack_f16_pair(unsigned int w, float& lo, float& hi) {
    const unsigned short a = static_cast<unsigned short>(w & 0xffffu);
    const unsigned short b = static_cast<unsigned short>(w >> BF16_SHIFT);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(b));
}

template <typename T>
__device__ __forceinline__ void unpack_vec(const Vec16& raw, float (&out)[Vec<T>::N]);

template <>
__device__ __forceinline__ void unpack_vec<float>(const Vec16& raw, float (&out)[4]) { unpack(raw, out); }

template <>
__device__ __forceinline__ void unpack_vec<bf16_t>(const Vec16& raw, float (&out)[8]) {
    unpack_bf16_pair(raw.x, out[0], out[1]);
    unpack_bf16_pair(raw.y, out[2], out[3]);
    unpack_bf16_pair(raw.z, out[4], out[5]);
    unpack_bf16_pair(raw.w, out[6], out[7]);
}

template <>
__device__ __forceinline__ void unpack_vec<f16_t>(const Vec16& raw, float (&out)[8]) {
    unpack_f16_pair(raw.x, out[0], out[1]);
    unpack_f16_pair(raw.y, out[2], out[3]);
    unpack_f16_pair(raw.z, out[4], out[5]);
    unpack_f16_pair(raw.w, out[6], out[7]);
}

// The caches are read-only for the kernel's lifetime: the non-coherent (read-only) path.
__device__ __forceinline__ Vec16 load16(const void* p) {
    Vec16 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        x = fmaxf(x, __shfl_xor_sync(FULL_WARP_MASK, x, offset));
    }
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        x += __shfl_xor_sync(FULL_WARP_MASK, x, offset);
    }
    return x;
}

constexpr int pow2_at_least(int n) {
    return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2);
}

// Geometry of one head row for storage type T: CHUNKS 16-byte vectors; a thread group of TG lanes
// covers one row (CPL vectors each); NT rows per warp at a time.
template <typename T>
struct Geometry {
    static constexpr int VEC = Vec<T>::N;
    static constexpr int CHUNKS = HEAD_DIM / VEC;
    static constexpr int TG = pow2_at_least(CHUNKS) < WARP_SIZE ? pow2_at_least(CHUNKS) : WARP_SIZE;
    static constexpr int CPL = (CHUNKS + TG - 1) / TG;
    static constexpr int NT = WARP_SIZE / TG;
    static constexpr int STEP = NUM_WARPS * NT;  // rows the block covers per unrolled slice
    static_assert(HEAD_DIM % VEC == 0, "head_dim must be a whole number of 16-byte vectors");
};

template <typename T>
__device__ void paged_attention_v2_impl(
    T* __restrict__ out,                  // [S, H, D] contiguous (written when splits == 1)
    float* __restrict__ part_acc,         // [S, H, splits, D]
    float* __restrict__ part_max,         // [S, H, splits] (log2 domain)
    float* __restrict__ part_sum,         // [S, H, splits]
    const T* __restrict__ query,          // [S, H, D], strided
    const T* __restrict__ key_cache,      // [num_blocks, block_size, KV, D], strided
    const T* __restrict__ value_cache,
    const int* __restrict__ block_tables, // [S, table_stride]
    const int* __restrict__ context_lens, // [S]
    const float scale_log2,               // softmax scale * log2(e)
    const int num_heads,
    const int num_kv_heads,
    const int block_size,
    const long long table_stride,
    const long long q_seq_stride,
    const long long q_head_stride,
    const long long k_block_stride,
    const long long k_token_stride,
    const long long k_head_stride,
    const long long v_block_stride,
    const long long v_token_stride,
    const long long v_head_stride) {
    using G = Geometry<T>;
    constexpr int VEC = G::VEC;
    constexpr int TG = G::TG;
    constexpr int CPL = G::CPL;
    constexpr int NT = G::NT;
    constexpr int STEP = G::STEP;

    const int group = num_heads / num_kv_heads;
    const int tiles = group / GROUP;
    const int kv_head = blockIdx.x / tiles;
    const int head0 = kv_head * group + (blockIdx.x % tiles) * GROUP;
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int splits = gridDim.z;
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const int slot = lane / TG;   // which of the warp's NT rows
    const int tl = lane % TG;     // lane within the row's thread group
    const float neg_inf = __uint_as_float(NEG_INF_BITS);

    __shared__ float scores[GROUP][PARTITION];
    __shared__ Row rows[PARTITION];
    __shared__ float run_max[GROUP];
    __shared__ float run_sum[GROUP];
    __shared__ float correction[GROUP];
    __shared__ float merge[NUM_WARPS][GROUP][HEAD_DIM];

    const int context_len = context_lens[seq];
    const int* table = block_tables + seq * table_stride;
    const int num_parts = (context_len + PARTITION - 1) / PARTITION;

    // This lane's vectors of each query head, scaled so that scores come out in log2 units.
    float q[GROUP][CPL][VEC];
    float acc[GROUP][CPL][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const T* q_ptr = query + seq * q_seq_stride + (head0 + g) * q_head_stride;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
            const int chunk = tl + c * TG;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                q[g][c][e] = chunk < G::CHUNKS ? to_float(q_ptr[chunk * VEC + e]) * scale_log2 : 0.0f;
                acc[g][c][e] = 0.0f;
            }
        }
    }
    if (threadIdx.x < GROUP) {
        run_max[threadIdx.x] = neg_inf;
        run_sum[threadIdx.x] = 0.0f;
    }
    const long long k_head_off = kv_head * k_head_stride;
    const long long v_head_off = kv_head * v_head_stride;

    for (int part = split; part < num_parts; part += splits) {
        const int start = part * PARTITION;
        const int n = min(PARTITION, context_len - start);
        for (int i = threadIdx.x; i < n; i += NUM_THREADS) {
            const int pos = start + i;
            rows[i] = Row{table[pos / block_size], pos % block_size};
        }
        __syncthreads();

        // Scores: q . k for every row of the partition and every head of the tile.
        for (int base = 0; base < n; base += STEP * UNROLL) {
            Vec16 k_raw[UNROLL][CPL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = base + u * STEP + warp * NT + slot;
                const Row r = rows[t < n ? t : 0];
                const T* k_ptr = key_cache + r.block * k_block_stride + r.offset * k_token_stride + k_head_off;
#pragma unroll
                for (int c = 0; c < CPL; ++c) {
                    const int chunk = tl + c * TG;
                    k_raw[u][c] = (t < n && chunk < G::CHUNKS) ? load16(k_ptr + chunk * VEC)
                                                                : Vec16{0u, 0u, 0u, 0u};
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = base + u * STEP + warp * NT + slot;
                float s[GROUP];
#pragma unroll
                for (int g = 0; g < GROUP; ++g) s[g] = 0.0f;
#pragma unroll
                for (int c = 0; c < CPL; ++c) {
                    float k[VEC];
                    unpack_vec<T>(k_raw[u][c], k);
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) s[g] = fmaf(q[g][c][e], k[e], s[g]);
                    }
                }
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
#pragma unroll
                    for (int offset = TG / 2; offset > 0; offset /= 2) {
                        s[g] += __shfl_xor_sync(FULL_WARP_MASK, s[g], offset);
                    }
                }
                if (t < n) {
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) {
                        if (tl == g % TG) scores[g][t] = s[g];
                    }
                }
            }
        }
        __syncthreads();

        // Softmax of the partition, folded into each head's running max and sum.
        for (int g = warp; g < GROUP; g += NUM_WARPS) {
            float m = neg_inf;
            for (int i = lane; i < n; i += WARP_SIZE) m = fmaxf(m, scores[g][i]);
            m = warp_max(m);
            const float m_old = run_max[g];
            const float m_new = fmaxf(m_old, m);
            float sum = 0.0f;
            for (int i = lane; i < n; i += WARP_SIZE) {
                const float p = exp2f(scores[g][i] - m_new);
                scores[g][i] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float c = exp2f(m_old - m_new);   // 0 for the first partition (m_old = -inf)
                correction[g] = c;
                run_sum[g] = run_sum[g] * c + sum;
                run_max[g] = m_new;
            }
        }
        __syncthreads();

#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float c = correction[g];
#pragma unroll
            for (int cc = 0; cc < CPL; ++cc) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][cc][e] *= c;
            }
        }

        // Values: acc += p * v over the partition's rows.
        for (int base = 0; base < n; base += STEP * UNROLL) {
            Vec16 v_raw[UNROLL][CPL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = base + u * STEP + warp * NT + slot;
                const Row r = rows[t < n ? t : 0];
                const T* v_ptr = value_cache + r.block * v_block_stride + r.offset * v_token_stride + v_head_off;
#pragma unroll
                for (int c = 0; c < CPL; ++c) {
                    const int chunk = tl + c * TG;
                    v_raw[u][c] = (t < n && chunk < G::CHUNKS) ? load16(v_ptr + chunk * VEC)
                                                                : Vec16{0u, 0u, 0u, 0u};
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = base + u * STEP + warp * NT + slot;
                if (t < n) {
#pragma unroll
                    for (int c = 0; c < CPL; ++c) {
                        float v[VEC];
                        unpack_vec<T>(v_raw[u][c], v);
#pragma unroll
                        for (int g = 0; g < GROUP; ++g) {
                            const float p = scores[g][t];
#pragma unroll
                            for (int e = 0; e < VEC; ++e) acc[g][c][e] = fmaf(p, v[e], acc[g][c][e]);
                        }
                    }
                }
            }
        }
        __syncthreads();   // rows and scores are rewritten by the next partition
    }

    // Merge the warp's NT row slots, then the warps, through shared memory.
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
#pragma unroll
                for (int offset = TG; offset < WARP_SIZE; offset *= 2) {
                    acc[g][c][e] += __shfl_xor_sync(FULL_WARP_MASK, acc[g][c][e], offset);
                }
            }
        }
    }
    if (slot == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                const int chunk = tl + c * TG;
                if (chunk < G::CHUNKS) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) merge[warp][g][chunk * VEC + e] = acc[g][c][e];
                }
            }
        }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int g = i / HEAD_DIM;
        const int d = i - g * HEAD_DIM;
        float value = 0.0f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) value += merge[w][g][d];
        const long long row = static_cast<long long>(seq) * num_heads + head0 + g;
        if (splits == 1) {
            const float sum = run_sum[g];
            out[row * HEAD_DIM + d] = from_float<T>(sum > 0.0f ? value / sum : 0.0f);
        } else {
            part_acc[(row * splits + split) * HEAD_DIM + d] = value;
            if (d == 0) {
                part_max[row * splits + split] = run_max[g];
                part_sum[row * splits + split] = run_sum[g];
            }
        }
    }
}

// Merge the splits of one (head, sequence): out = sum_z acc_z * 2^(m_z - M) / sum_z l_z * 2^(m_z - M).
// A split that saw no partition (sum 0, max -inf) weighs nothing.
template <typename T>
__device__ void paged_attention_reduce_impl(
    T* __restrict__ out,                   // [S, H, D] contiguous
    const float* __restrict__ part_acc,    // [S, H, splits, D]
    const float* __restrict__ part_max,    // [S, H, splits]
    const float* __restrict__ part_sum,    // [S, H, splits]
    const int num_heads,
    const int splits) {
    __shared__ float weight[MAX_SPLITS];
    __shared__ float denom_s;
    const long long row = static_cast<long long>(blockIdx.y) * num_heads + blockIdx.x;
    const float* maxes = part_max + row * splits;
    const float* sums = part_sum + row * splits;
    const float neg_inf = __uint_as_float(NEG_INF_BITS);

    if (threadIdx.x < WARP_SIZE) {
        float m = neg_inf;
        for (int z = threadIdx.x; z < splits; z += WARP_SIZE) {
            if (sums[z] > 0.0f) m = fmaxf(m, maxes[z]);
        }
        m = warp_max(m);
        float denom = 0.0f;
        for (int z = threadIdx.x; z < splits; z += WARP_SIZE) {
            const float w = sums[z] > 0.0f ? exp2f(maxes[z] - m) : 0.0f;
            weight[z] = w;
            denom += sums[z] * w;
        }
        denom = warp_sum(denom);
        if (threadIdx.x == 0) denom_s = denom;
    }
    __syncthreads();
    const float inv = denom_s > 0.0f ? 1.0f / denom_s : 0.0f;
    const float* acc = part_acc + row * splits * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float value = 0.0f;
        for (int z = 0; z < splits; ++z) value += acc[z * HEAD_DIM + d] * weight[z];
        out[row * HEAD_DIM + d] = from_float<T>(value * inv);
    }
}

#define DEFINE_PAGED_ATTENTION_V2(SUFFIX, T)                                                          \
    extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_##SUFFIX(           \
        T* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_max,               \
        float* __restrict__ part_sum, const T* __restrict__ query, const T* __restrict__ key_cache,    \
        const T* __restrict__ value_cache, const int* __restrict__ block_tables,                       \
        const int* __restrict__ context_lens, const float scale_log2, const int num_heads,             \
        const int num_kv_heads, const int block_size, const long long table_stride,                    \
        const long long q_seq_stride, const long long q_head_stride,                                   \
        const long long k_block_stride, const long long k_token_stride,                                \
        const long long k_head_stride, const long long v_block_stride,                                 \
        const long long v_token_stride, const long long v_head_stride) {                               \
        paged_attention_v2_impl<T>(out, part_acc, part_max, part_sum, query, key_cache, value_cache,   \
                                   block_tables, context_lens, scale_log2, num_heads, num_kv_heads,    \
                                   block_size, table_stride, q_seq_stride, q_head_stride,              \
                                   k_block_stride, k_token_stride, k_head_stride, v_block_stride,      \
                                   v_token_stride, v_head_stride);                                     \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_reduce_##SUFFIX(       \
        T* __restrict__ out, const float* __restrict__ part_acc, const float* __restrict__ part_max,   \
        const float* __restrict__ part_sum, const int num_heads, const int splits) {                   \
        paged_attention_reduce_impl<T>(out, part_acc, part_max, part_sum, num_heads, splits);          \
    }

DEFINE_PAGED_ATTENTION_V2(f16, f16_t)
DEFINE_PAGED_ATTENTION_V2(bf16, bf16_t)
DEFINE_PAGED_ATTENTION_V2(f32, float)
