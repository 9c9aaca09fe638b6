// Scatter new tokens' keys and values into their slots of the paged KV cache.
//
// Owns: the `write_kv_{f16,bf16,f32}` entry points loaded by fastserve/kernels/cupy_ops.py.
//
// Grid: (num_tokens,); one thread block per token, its threads stride over num_heads * head_dim.
// slot = block_id * block_size + offset; a negative slot is padding and is skipped.
// Cache views are [num_blocks, block_size, num_heads, head_dim] slices of a block-major cache,
// so block/token/head strides are passed in (innermost stride is 1). Source rows may be strided
// too (e.g. slices of a fused QKV projection). The copy is bit-exact, so the element type only
// matters by its size: fp16 and bf16 share the 16-bit instantiation. Self-contained (no #include)
// so that NVRTC compiles it through any CuPy wheel.

template <typename T>
__device__ void write_kv_impl(
    T* __restrict__ key_cache,                // [num_blocks, block_size, num_heads, head_dim]
    T* __restrict__ value_cache,              // same shape, own strides
    const T* __restrict__ key,                // [num_tokens, num_heads, head_dim]
    const T* __restrict__ value,              // [num_tokens, num_heads, head_dim]
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    const int num_heads,
    const int head_dim,
    const int block_size,
    const long long key_token_stride,
    const long long key_head_stride,
    const long long value_token_stride,
    const long long value_head_stride,
    const long long kc_block_stride,
    const long long kc_token_stride,
    const long long kc_head_stride,
    const long long vc_block_stride,
    const long long vc_token_stride,
    const long long vc_head_stride) {
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;
    const long long block = slot / block_size;
    const long long offset = slot % block_size;

    T* kc = key_cache + block * kc_block_stride + offset * kc_token_stride;
    T* vc = value_cache + block * vc_block_stride + offset * vc_token_stride;
    const T* k = key + token * key_token_stride;
    const T* v = value + token * value_token_stride;
    const int row = num_heads * head_dim;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        const int head = i / head_dim;
        const int d = i - head * head_dim;
        kc[head * kc_head_stride + d] = k[head * key_head_stride + d];
        vc[head * vc_head_stride + d] = v[head * value_head_stride + d];
    }
}

#define DEFINE_WRITE_KV(SUFFIX, T)                                                             \
    extern "C" __global__ void write_kv_##SUFFIX(                                              \
        T* __restrict__ key_cache, T* __restrict__ value_cache, const T* __restrict__ key,      \
        const T* __restrict__ value, const long long* __restrict__ slot_mapping,                \
        const int num_heads, const int head_dim, const int block_size,                          \
        const long long key_token_stride, const long long key_head_stride,                      \
        const long long value_token_stride, const long long value_head_stride,                  \
        const long long kc_block_stride, const long long kc_token_stride,                       \
        const long long kc_head_stride, const long long vc_block_stride,                        \
        const long long vc_token_stride, const long long vc_head_stride) {                      \
        write_kv_impl<T>(key_cache, value_cache, key, value, slot_mapping, num_heads, head_dim, \
                         block_size, key_token_stride, key_head_stride, value_token_stride,     \
                         value_head_stride, kc_block_stride, kc_token_stride, kc_head_stride,   \
                         vc_block_stride, vc_token_stride, vc_head_stride);                     \
    }

// fp16 and bf16 are both copied as raw 16-bit words.
DEFINE_WRITE_KV(f16, unsigned short)
DEFINE_WRITE_KV(bf16, unsigned short)
DEFINE_WRITE_KV(f32, float)
