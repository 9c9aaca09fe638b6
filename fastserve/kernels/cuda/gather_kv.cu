// Gather each prefill sequence's keys and values (cached prefix and new tokens alike) from the paged
// cache into packed [total, KV, D] rows, for one varlen flash-attention call over every sequence.
//
// Owns: the `gather_kv_{w16,w4,w2}` entry points loaded by fastserve/kernels/cupy_ops.py, named by
// the word each copies (16-byte vectors where every row and stride allows, else 4- or 2-byte words;
// the copy is bit-exact, so only the width matters).
//
// Grid: (ceil(max_k / TOKENS_PER_BLOCK), num_seqs); a block copies TOKENS_PER_BLOCK positions of one
// sequence, its threads striding over the words of each position's row (KV * D elements, contiguous
// in the cache). Position p of sequence b lives in block table[b][p / block_size] at offset
// p % block_size and goes to packed row cu_k[b] + p; positions at or past the sequence's context
// (cu_k[b + 1] - cu_k[b]) are skipped. Strides are in words. Self-contained (no #include).

constexpr int TOKENS_PER_BLOCK = 16;

struct alignas(16) Vec16 {   // own type rather than CUDA's uint4: nothing depends on NVRTC's builtins
    unsigned int x, y, z, w;
};

template <typename W>
__device__ void gather_kv_impl(
    W* __restrict__ packed_k,            // [total, row_words]
    W* __restrict__ packed_v,
    const W* __restrict__ key_cache,     // [num_blocks, block_size, row_words] strided
    const W* __restrict__ value_cache,
    const int* __restrict__ block_tables,  // [num_seqs, table_stride]
    const int* __restrict__ cu_k,        // [num_seqs + 1]
    const int block_size,
    const int row_words,
    const long long table_stride,
    const long long k_block_stride,
    const long long k_token_stride,
    const long long v_block_stride,
    const long long v_token_stride) {
    const int seq = blockIdx.y;
    const int begin = cu_k[seq];
    const int context = cu_k[seq + 1] - begin;
    const int* table = block_tables + seq * table_stride;
    const int first = blockIdx.x * TOKENS_PER_BLOCK;
    for (int i = 0; i < TOKENS_PER_BLOCK; ++i) {
        const int pos = first + i;
        if (pos >= context) return;
        const long long block = table[pos / block_size];
        const long long offset = pos % block_size;
        const W* k = key_cache + block * k_block_stride + offset * k_token_stride;
        const W* v = value_cache + block * v_block_stride + offset * v_token_stride;
        W* k_out = packed_k + static_cast<long long>(begin + pos) * row_words;
        W* v_out = packed_v + static_cast<long long>(begin + pos) * row_words;
        for (int w = threadIdx.x; w < row_words; w += blockDim.x) {
            k_out[w] = k[w];
            v_out[w] = v[w];
        }
    }
}

#define DEFINE_GATHER_KV(SUFFIX, W)                                                                \
    extern "C" __global__ void gather_kv_##SUFFIX(                                                 \
        W* __restrict__ packed_k, W* __restrict__ packed_v, const W* __restrict__ key_cache,       \
        const W* __restrict__ value_cache, const int* __restrict__ block_tables,                   \
        const int* __restrict__ cu_k, const int block_size, const int row_words,                   \
        const long long table_stride, const long long k_block_stride,                              \
        const long long k_token_stride, const long long v_block_stride,                            \
        const long long v_token_stride) {                                                          \
        gather_kv_impl<W>(packed_k, packed_v, key_cache, value_cache, block_tables, cu_k,          \
                          block_size, row_words, table_stride, k_block_stride, k_token_stride,     \
                          v_block_stride, v_token_stride);                                         \
    }

DEFINE_GATHER_KV(w16, Vec16)
DEFINE_GATHER_KV(w4, unsigned int)
DEFINE_GATHER_KV(w2, unsigned short)
