// The per-token fp8 QDQ of one row, shared by the QDQ kernel (dequant.cu) and the RMSNorm and
// gated-activation kernels that apply it in their own pass (norm.cu).
#pragma once
#include "minifloat.cuh"

// ---- per-token fp8 QDQ, as a kernel and as the last step of the RMSNorm and SwiGLU kernels ----
// One block of 256 threads per row of k values; each thread handles VEC values per step at
// tid * VEC + n * 256 * VEC.

// The scale of values whose largest |value| is `amax`: amax / 448, or f32's epsilon where that
// is 0 (a row of zeros).
__device__ __forceinline__ float fp8_scale_of(float amax) {
    const float scale = amax / 448.0f;
    return scale == 0.0f ? 1.1920929e-07f : scale;
}

// The largest of the warp's `v`, in every lane.
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// The row's scale from each thread's largest |value| (block-wide max / 448; the max does not
// depend on the order it is reduced in, so every VEC and every caller gets the same bits).
__device__ __forceinline__ float fp8_token_scale(float amax) {
    __shared__ float s_max[32];
    amax = warp_max(amax);
    if (threadIdx.x % 32 == 0) s_max[threadIdx.x / 32] = amax;
    __syncthreads();
    for (int w = 0; w < 256 / 32; ++w) amax = fmaxf(amax, s_max[w]);
    return fp8_scale_of(amax);
}

// src -> dst (may be the same row: each thread reads only the values it then writes).
template <typename T, int VEC>
__device__ void fp8_qdq_row(const T* src, T* dst, int k, float scale) {
    using V = Pack<T, VEC>;
    for (int i = threadIdx.x * VEC; i < k; i += 256 * VEC) {
        V v = *reinterpret_cast<const V*>(src + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float q = fminf(fmaxf(to_f32(v.v[j]) / scale + 0.0f, -448.0f), 448.0f);
            v.v[j] = from_f32<T>(round_to_grid(q, -6, 3) * scale);
        }
        *reinterpret_cast<V*>(dst + i) = v;
    }
}

// ---- e4m3 codes for the fp8 tensor-core GEMM (fp8_gemm.cu, and the gated activations of norm.cu) ----

// The e4m3 codes of 8 values, as fp8_qdq_row computes them up to the multiplication by the
// scale, packed little-endian.
// On GPUs with fp8 (cc >= 8.9, the only ones that run the fp8 GEMM) the hardware conversion
// encodes: round to nearest even onto the e4m3 grid, which for |q| <= 448 is
// round_to_grid(q, -6, 3) and then fp8_e4m3_from_grid, two values per instruction instead of
// ~25 instructions each (it made the encoding compute-bound). `check` holds it to the CPU bitwise.
template <typename V>
__device__ __forceinline__ uint2 fp8_codes8(const V& v, float scale) {
    float q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = fminf(fmaxf(to_f32(v.v[j]) / scale + 0.0f, -448.0f), 448.0f);
    uint32_t word[2] = {0, 0};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
        unsigned short pair;  // q[j + 1] in the high byte, q[j] in the low one
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(q[j + 1]), "f"(q[j]));
        word[j / 4] |= (uint32_t)pair << (8 * (j % 4));
    }
#else
#pragma unroll
    for (int j = 0; j < 8; ++j)
        word[j / 4] |= (uint32_t)fp8_e4m3_from_grid(round_to_grid(q[j], -6, 3)) << (8 * (j % 4));
#endif
    return make_uint2(word[0], word[1]);
}
