// The fp8 tensor-core GEMM family (ops/fp8_gemm.rs, cuda/fp8_gemm.rs): a Linear's input
// quantized to e4m3 codes with one f32 scale per row, for cuBLASLt's fp8 GEMM, which multiplies
// the codes exactly, sums in f32 and applies the row and column scales. The codes are the ones
// the activation QDQ (qdq.cuh) rounds to, so `code * scale` is the QDQ'd value bit for bit.
#include "qdq.cuh"

// A lane's UNROLL vectors of 8 values of a row at base, base + 256, ..., those below k.
template <typename V, int UNROLL, typename T>
__device__ __forceinline__ void load_vectors(V (&v)[UNROLL], const T* row, int base, int k) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int i = base + u * 32 * 8;
        if (i < k) v[u] = *reinterpret_cast<const V*>(row + i);
    }
}

// One warp per row of k values (k % 8 == 0), eight rows per block of 256 threads;
// `static_scale` > 0 replaces the dynamic per-token scale (absmax / 448, reduced across the
// warp: the max does not depend on the order, so this is fp8_token_scale's value). Writes
// codes[row, :] and scales[row]. The row is read twice, the second time mostly from cache; each
// lane keeps UNROLL 16-byte loads in flight.
template <typename T>
__device__ void quantize_fp8_rows(const T* x, uint8_t* codes, float* scales, int m, int k,
                                  float static_scale) {
    constexpr int VEC = 8, UNROLL = 4;
    using V = Pack<T, VEC>;
    const int lane = threadIdx.x % 32;
    const long r = (long)blockIdx.x * 8 + threadIdx.x / 32;
    if (r >= m) return;
    const T* row = x + r * k;
    uint8_t* out = codes + r * k;
    float scale = static_scale;
    if (scale <= 0.0f) {
        float amax = 0.0f;
        for (int base = lane * VEC; base < k; base += 32 * VEC * UNROLL) {
            V v[UNROLL];
            load_vectors(v, row, base, k);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (base + u * 32 * VEC >= k) break;
#pragma unroll
                for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_f32(v[u].v[j])));
            }
        }
        scale = fp8_scale_of(warp_max(amax));
    }
    for (int base = lane * VEC; base < k; base += 32 * VEC * UNROLL) {
        V v[UNROLL];
        load_vectors(v, row, base, k);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * 32 * VEC;
            if (i < k) *reinterpret_cast<uint2*>(out + i) = fp8_codes8(v[u], scale);
        }
    }
    if (lane == 0) scales[r] = scale;
}

// Block FP8's activations: one scale per row and 128 values (k % 128 == 0), as
// qdq_fp8_group (dequant.cu) computes it: max(absmax, 1e-10) / 448, rounded up to a power of
// two where `power_of_two`. Half a warp per group (16 lanes of 8 values); every lane takes part
// in the shuffles, those past the last group with zeros. Writes codes[row, :] and
// scales[group * m + row]: each group's scales for all rows side by side, as cuBLASLt's
// VEC128_32F scale mode reads them.
template <typename T>
__device__ void quantize_fp8_row_groups(const T* x, uint8_t* codes, float* scales, int m, int k,
                                        int power_of_two) {
    using V = Pack<T, 8>;
    const int groups = k / 128, lane = threadIdx.x % 16;
    const long half = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 16;
    const bool valid = half < (long)m * groups;
    const long row = valid ? half / groups : 0;
    const int group = valid ? (int)(half % groups) : 0;
    const long at = row * k + group * 128 + lane * 8;
    V v;
    float amax = 0.0f;
    if (valid) {
        v = *reinterpret_cast<const V*>(x + at);
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(to_f32(v.v[j])));
    }
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    if (!valid) return;
    float scale = fmaxf(amax, 1e-10f) / 448.0f;
    // UE8M0: rounded up to a power of two (a set mantissa carries into the exponent).
    if (power_of_two) scale = __uint_as_float((__float_as_uint(scale) + 0x7fffffu) & 0xff800000u);
    *reinterpret_cast<uint2*>(codes + at) = fp8_codes8(v, scale);
    if (lane == 0) scales[(long)group * m + row] = scale;
}

#define FP8_GEMM_ENTRIES(T, SUFFIX)                                                                \
    extern "C" __global__ void quantize_fp8_rows_##SUFFIX(const T* x, uint8_t* codes,             \
                                                           float* scales, int m, int k, float s) { \
        quantize_fp8_rows<T>(x, codes, scales, m, k, s);                                           \
    }                                                                                              \
    extern "C" __global__ void quantize_fp8_row_groups_##SUFFIX(                                   \
        const T* x, uint8_t* codes, float* scales, int m, int k, int pow2) {                       \
        quantize_fp8_row_groups<T>(x, codes, scales, m, k, pow2);                                  \
    }

FP8_GEMM_ENTRIES(__nv_bfloat16, bf16)
FP8_GEMM_ENTRIES(__half, f16)
