// RMSNorm arithmetic shared by the norm kernels (norm.cu) and the per-head norm + RoPE
// (rope.cu): one expression per step, so every kernel that norms a row gets the same bits.
#pragma once
#include "common.cuh"

// `acc` plus the squares of VEC values, in order.
template <typename T, int VEC>
__device__ __forceinline__ float sum_squares(const Pack<T, VEC>& h, float acc) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc += to_f32(h.v[j]) * to_f32(h.v[j]);
    return acc;
}

// x · inv · w in f32, rounded once to T.
template <typename T, typename W, int VEC>
__device__ __forceinline__ Pack<T, VEC> rms_scaled(const Pack<T, VEC>& h, const Pack<W, VEC>& w,
                                                   float inv) {
    Pack<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_f32<T>(to_f32(h.v[j]) * inv * to_f32(w.v[j]));
    return o;
}

// The sum of LANES consecutive lanes' `v` (LANES a power of two dividing 32), in every one of
// them: a halving tree (lane t adds lane t + LANES/2, then + LANES/4, ...), the order of
// norm.cu's block-wide tree_sum over the same partial sums (its levels above LANES add exact
// zeros there). A lane whose partner is below it adds the same two values, and IEEE addition
// commutes, so every lane ends with the lowest lane's sum. Every lane of the warp takes part.
template <int LANES>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// Eight partial sums of one lane added as the block kernels' tree_sum adds the slots t,
// t + 4 LANES·… that a lane holds at m = 0..7 (slot lane + LANES·m): m and m + 4, then m + 2,
// then m + 1; the lanes below are the caller's (lanes_sum).
__device__ __forceinline__ float tree8(float (&partial)[8]) {
#pragma unroll
    for (int m = 0; m < 4; ++m) partial[m] += partial[m + 4];
    partial[0] += partial[2];
    partial[1] += partial[3];
    return partial[0] + partial[1];
}

// RMSNorm of one row of `cols` values held by LANES lanes, 8 each (`mine`: this lane holds the
// 8 values `h` and their weights `w`; lanes past the row's end hold none and add zeros): the
// bits of norm.cu's block-per-row rms_norm with 16-byte vectors, whose threads hold the same 8
// values each when cols <= 8 * 256. The caller loads `h` and `w` (with anything else it needs
// before the reduction, so that the loads overlap).
template <typename T, typename W, int LANES>
__device__ __forceinline__ Pack<T, 8> rms_norm_lanes(const Pack<T, 8>& h, const Pack<W, 8>& w,
                                                     bool mine, int cols, float eps) {
    const float squares = mine ? sum_squares(h, 0.0f) : 0.0f;
    const float inv = rsqrtf(lanes_sum<LANES>(squares) / cols + eps);
    return rms_scaled(h, w, inv);
}

// A Pack held by lane `src` of the warp (every lane takes part).
template <typename P>
__device__ __forceinline__ P shfl_pack(const P& v, int src) {
    static_assert(sizeof(P) % 4 == 0, "a Pack of whole 32-bit words");
    P out;
    const uint32_t* in = reinterpret_cast<const uint32_t*>(&v);
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int w = 0; w < (int)(sizeof(P) / 4); ++w) o[w] = __shfl_sync(0xffffffff, in[w], src);
    return out;
}
