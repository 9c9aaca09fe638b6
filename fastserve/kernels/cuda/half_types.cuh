// fp16 and bf16 as raw 16-bit storage, and their float conversions: PTX `cvt` for fp16, bit shifts
// for bf16, so that NVRTC needs neither cuda_fp16.h nor cuda_bf16.h. Shared by the decode kernels;
// fastserve/kernels/cupy_ops.py splices it into the source NVRTC compiles (and CuPy's cache keys on).

constexpr unsigned int BF16_CANONICAL_NAN = 0x7fc0u;
constexpr unsigned int FP32_ABS_MASK = 0x7fffffffu;
constexpr unsigned int FP32_INF_BITS = 0x7f800000u;
constexpr unsigned int BF16_SHIFT = 16;
constexpr unsigned int BF16_ROUND_BIAS = 0x7fffu;

struct f16_t {
    unsigned short bits;
};
struct bf16_t {
    unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(f16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

__device__ __forceinline__ float to_float(bf16_t x) {
    return __uint_as_float(static_cast<unsigned int>(x.bits) << BF16_SHIFT);
}

template <typename T>
__device__ __forceinline__ T from_float(float f);

template <>
__device__ __forceinline__ float from_float<float>(float f) { return f; }

template <>
__device__ __forceinline__ f16_t from_float<f16_t>(float f) {
    f16_t out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(f));
    return out;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does.
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
    bf16_t out;
    unsigned int u = __float_as_uint(f);
    if ((u & FP32_ABS_MASK) > FP32_INF_BITS) {
        out.bits = static_cast<unsigned short>(BF16_CANONICAL_NAN);
        return out;
    }
    u += BF16_ROUND_BIAS + ((u >> BF16_SHIFT) & 1u);
    out.bits = static_cast<unsigned short>(u >> BF16_SHIFT);
    return out;
}
