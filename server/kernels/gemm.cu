// The f32 GEMM family (ops/gemm.rs, cuda/gemm.rs): x · wᵀ with one summation order.
#include "common.cuh"

// ---- f32 GEMM with one summation order: out = x · wᵀ ------------------------------------------
//
// x [m, k] and w [n, k] row-major (both contiguous in k), out [m, n]. Every output is accumulated
// by fmaf over k = 0, 1, ..., k - 1 starting from 0, whatever m and n and wherever the output
// lies in its tile: a row's result depends on that row and w alone. cuBLAS picks its kernel
// (some of which split k) by the shape, so a token's f32 numbers changed with the number of
// tokens in its batch; with this kernel a sequence scores to the same bits alone and in any
// batch. The CPU reference is the sequential fused multiply-add (ops/gemm.rs).
//
// 128 x 128 outputs per block of 256 threads, 8 x 8 per thread (rows ty*4.. and 64 + ty*4..,
// columns tx*4.. and 64 + tx*4..: conflict-free float4 reads of the transposed tiles), k in
// steps of 8 through double-buffered shared memory, the next step's loads in flight while the
// current one is multiplied. Out-of-range rows, columns and k read as 0 (fmaf(0, 0, acc) = acc).
constexpr int GEMM_BM = 128, GEMM_BN = 128, GEMM_BK = 8, GEMM_THREADS = 256, GEMM_PAD = 4;

// 4 consecutive values of row `r` from column `c` of a row-major [rows, k] matrix, 0 outside it;
// VEC4: one float4 load (k and the row starts are multiples of 4, so the 4 lie in the row).
template <bool VEC4>
__device__ __forceinline__ void gemm_load4(const float* __restrict__ a, long r, long rows, int c,
                                           int k, float (&v)[4]) {
    if (VEC4) {
        const float4 q = r < rows && c < k ? *reinterpret_cast<const float4*>(a + r * k + c)
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = r < rows && c + i < k ? a[r * k + c + i] : 0.f;
    }
}

template <bool VEC4>
__device__ void matmul_t_f32(const float* __restrict__ x, const float* __restrict__ w,
                             float* __restrict__ out, int m, int n, int k) {
    __shared__ __align__(16) float xs[2][GEMM_BK][GEMM_BM + GEMM_PAD];
    __shared__ __align__(16) float ws[2][GEMM_BK][GEMM_BN + GEMM_PAD];
    const int tid = threadIdx.x;
    const long row0 = (long)blockIdx.y * GEMM_BM, col0 = (long)blockIdx.x * GEMM_BN;
    // Loads: thread `tid` brings k offsets load_k..load_k + 3 of tile row load_r, of x and of w.
    const int load_r = tid >> 1, load_k = (tid & 1) * 4;
    const int tx = tid & 15, ty = tid >> 4;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
    float xr[4], wr[4];
    gemm_load4<VEC4>(x, row0 + load_r, m, load_k, k, xr);
    gemm_load4<VEC4>(w, col0 + load_r, n, load_k, k, wr);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        xs[0][load_k + i][load_r] = xr[i];
        ws[0][load_k + i][load_r] = wr[i];
    }
    __syncthreads();
    int buf = 0;
    for (int k0 = 0; k0 < k; k0 += GEMM_BK) {
        const bool more = k0 + GEMM_BK < k;
        if (more) {
            gemm_load4<VEC4>(x, row0 + load_r, m, k0 + GEMM_BK + load_k, k, xr);
            gemm_load4<VEC4>(w, col0 + load_r, n, k0 + GEMM_BK + load_k, k, wr);
        }
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4*>(&xs[buf][kk][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&xs[buf][kk][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&ws[buf][kk][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&ws[buf][kk][64 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (more) {
            // The other buffer was last read before the previous barrier.
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                xs[buf ^ 1][load_k + i][load_r] = xr[i];
                ws[buf ^ 1][load_k + i][load_r] = wr[i];
            }
            __syncthreads();
            buf ^= 1;
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const long r = row0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (r >= m) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const long c = col0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (c < n) out[r * n + c] = acc[i][j];
        }
    }
}

// ---- the same sums for narrow outputs (a router: n = 64 experts) ------------------------------
//
// With n <= 64 the 128 x 128 tiles leave most of a block idle and give a 2048-row batch 16
// blocks for 132 SMs. Here a block of 256 threads makes 16 x 64 outputs, 4 a thread (row ty,
// columns tx*4..), k in steps of 32 through shared memory. Each output is the same fmaf chain over
// k = 0, 1, ... from 0, so both kernels give the same bits and either may serve any shape.
constexpr int NARROW_BM = 16, NARROW_BN = 64, NARROW_BK = 32;

template <bool VEC4>
__device__ void matmul_t_f32_narrow(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int m, int n, int k) {
    __shared__ __align__(16) float xs[NARROW_BK][NARROW_BM];
    __shared__ __align__(16) float ws[NARROW_BK][NARROW_BN + GEMM_PAD];
    const int tid = threadIdx.x;
    const long row0 = (long)blockIdx.y * NARROW_BM, col0 = (long)blockIdx.x * NARROW_BN;
    const int ty = tid >> 4, tx = tid & 15;
    // Loads: 8 threads a tile row, 4 k offsets each; x by threads 0..127, w's 64 rows in two
    // halves by every thread.
    const int load_r = tid >> 3, load_k = (tid & 7) * 4;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // The next step's values, loaded while the current step is multiplied.
    float xv[4], wv[2][4];
    const auto load = [&](int k0) {
        if (load_r < NARROW_BM) gemm_load4<VEC4>(x, row0 + load_r, m, k0 + load_k, k, xv);
#pragma unroll
        for (int half = 0; half < 2; ++half)
            gemm_load4<VEC4>(w, col0 + load_r + half * 32, n, k0 + load_k, k, wv[half]);
    };
    load(0);
    for (int k0 = 0; k0 < k; k0 += NARROW_BK) {
        if (load_r < NARROW_BM) {
#pragma unroll
            for (int i = 0; i < 4; ++i) xs[load_k + i][load_r] = xv[i];
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int i = 0; i < 4; ++i) ws[load_k + i][load_r + half * 32] = wv[half][i];
        }
        __syncthreads();
        if (k0 + NARROW_BK < k) load(k0 + NARROW_BK);
#pragma unroll
        for (int kk = 0; kk < NARROW_BK; ++kk) {
            const float a = xs[kk][ty];
            const float4 b = *reinterpret_cast<const float4*>(&ws[kk][tx * 4]);
            acc[0] = fmaf(a, b.x, acc[0]);
            acc[1] = fmaf(a, b.y, acc[1]);
            acc[2] = fmaf(a, b.z, acc[2]);
            acc[3] = fmaf(a, b.w, acc[3]);
        }
        __syncthreads();
    }
    const long r = row0 + ty;
    if (r >= m) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const long c = col0 + tx * 4 + j;
        if (c < n) out[r * n + c] = acc[j];
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    matmul_t_f32_narrow(const float* x, const float* w, float* o, int m, int n, int k) {
    matmul_t_f32_narrow<false>(x, w, o, m, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    matmul_t_f32_narrow_v4(const float* x, const float* w, float* o, int m, int n, int k) {
    matmul_t_f32_narrow<true>(x, w, o, m, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    matmul_t_f32(const float* x, const float* w, float* o, int m, int n, int k) {
    matmul_t_f32<false>(x, w, o, m, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    matmul_t_f32_v4(const float* x, const float* w, float* o, int m, int n, int k) {
    matmul_t_f32<true>(x, w, o, m, n, k);
}
