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

// 4 consecutive values of row `r` from column `c` of a row-major [rows, k] matrix of T, as f32
// (exact: bf16 and f16 values are f32 values), 0 outside it; VEC4: one vector load (k and the
// row starts are multiples of 4, so the 4 lie in the row).
template <bool VEC4, typename T = float>
__device__ __forceinline__ void gemm_load4(const T* __restrict__ a, long r, long rows, int c,
                                           int k, float (&v)[4]) {
    if (VEC4) {
        Pack<T, 4> q;
        if (r < rows && c < k) {
            q = *reinterpret_cast<const Pack<T, 4>*>(a + r * k + c);
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) q.v[i] = from_f32<T>(0.f);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = to_f32(q.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = r < rows && c + i < k ? to_f32(a[r * k + c + i]) : 0.f;
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
// blocks for 132 SMs. Here a block of 256 threads makes (16 * RPT) x (16 * CPT) outputs, RPT
// rows by CPT columns a thread (rows ty * RPT.., columns tx * CPT..), k in steps of 32 through
// shared memory: RPT = CPT = 4 gives 16 products per two shared-memory reads (the loads, not the
// FMAs, bound a thread with one row), and smaller tiles keep short batches on more SMs. Each
// output is the same fmaf chain over k = 0, 1, ... from 0, so every kernel here gives the same
// bits and any of them may serve any shape. (Steps of 64 were slower on an H200: 0.080 against
// 0.070 ms for 2048 rows, 0.192 against 0.160 for 16384.)
constexpr int NARROW_BK = 32, NARROW_LOADERS = GEMM_THREADS / (NARROW_BK / 4);

// RPT consecutive floats of shared memory (4 * RPT bytes aligned) into registers.
template <int RPT> __device__ __forceinline__ void narrow_rows(const float* p, float (&a)[RPT]) {
    if constexpr (RPT == 4) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
    } else if constexpr (RPT == 2) {
        const float2 v = *reinterpret_cast<const float2*>(p);
        a[0] = v.x, a[1] = v.y;
    } else {
        a[0] = *p;
    }
}

template <bool VEC4, int RPT, int CPT, typename TX>
__device__ void matmul_t_f32_narrow(const TX* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int m, int n, int k) {
    constexpr int BM = 16 * RPT, NARROW_BN = 16 * CPT, XS_PITCH = BM + GEMM_PAD;
    constexpr int X_PASSES = (BM + NARROW_LOADERS - 1) / NARROW_LOADERS;
    __shared__ __align__(16) float xs[NARROW_BK][XS_PITCH];
    __shared__ __align__(16) float ws[NARROW_BK][NARROW_BN + GEMM_PAD];
    const int tid = threadIdx.x;
    const long row0 = (long)blockIdx.y * BM, col0 = (long)blockIdx.x * NARROW_BN;
    const int ty = tid >> 4, tx = tid & 15;
    // Loads: NARROW_BK / 4 threads a tile row, 4 k offsets each; x's BM rows and w's 64 rows in
    // passes of NARROW_LOADERS rows.
    const int load_r = tid / (NARROW_BK / 4), load_k = (tid % (NARROW_BK / 4)) * 4;
    constexpr int W_PASSES = NARROW_BN / NARROW_LOADERS;
    float acc[RPT][CPT] = {};
    // The next step's values, loaded while the current step is multiplied.
    float xv[X_PASSES][4], wv[W_PASSES][4];
    const auto load = [&](int k0) {
#pragma unroll
        for (int p = 0; p < X_PASSES; ++p)
            if (load_r + p * NARROW_LOADERS < BM)
                gemm_load4<VEC4, TX>(x, row0 + load_r + p * NARROW_LOADERS, m, k0 + load_k, k, xv[p]);
#pragma unroll
        for (int p = 0; p < W_PASSES; ++p)
            gemm_load4<VEC4>(w, col0 + load_r + p * NARROW_LOADERS, n, k0 + load_k, k, wv[p]);
    };
    load(0);
    for (int k0 = 0; k0 < k; k0 += NARROW_BK) {
#pragma unroll
        for (int p = 0; p < X_PASSES; ++p) {
            if (load_r + p * NARROW_LOADERS < BM) {
#pragma unroll
                for (int i = 0; i < 4; ++i) xs[load_k + i][load_r + p * NARROW_LOADERS] = xv[p][i];
            }
        }
#pragma unroll
        for (int p = 0; p < W_PASSES; ++p) {
#pragma unroll
            for (int i = 0; i < 4; ++i) ws[load_k + i][load_r + p * NARROW_LOADERS] = wv[p][i];
        }
        __syncthreads();
        if (k0 + NARROW_BK < k) load(k0 + NARROW_BK);
#pragma unroll
        for (int kk = 0; kk < NARROW_BK; ++kk) {
            float a[RPT], b[CPT];
            narrow_rows<RPT>(&xs[kk][ty * RPT], a);
            narrow_rows<CPT>(&ws[kk][tx * CPT], b);
#pragma unroll
            for (int i = 0; i < RPT; ++i)
#pragma unroll
                for (int j = 0; j < CPT; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const long r = row0 + ty * RPT + i;
        if (r >= m) return;
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            const long c = col0 + tx * CPT + j;
            if (c < n) out[r * n + c] = acc[i][j];
        }
    }
}

// matmul_t_f32_narrow{RPT}x{CPT}[_v4]_{x's type}: x in f32, or in bf16 / f16 read as f32 (a
// router's f32 product of the compute-dtype hidden states, without a cast of them into memory
// first)
#define NARROW_ENTRY(RPT, CPT, VEC, VEC4, SUFFIX, TX)                                               \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                     \
        matmul_t_f32_narrow##RPT##x##CPT##VEC##_##SUFFIX(const TX* x, const float* w, float* o,    \
                                                         int m, int n, int k) {                    \
        matmul_t_f32_narrow<VEC4, RPT, CPT, TX>(x, w, o, m, n, k);                                 \
    }
#define NARROW_TILE(RPT, CPT, SUFFIX, TX)                                                           \
    NARROW_ENTRY(RPT, CPT, , false, SUFFIX, TX)                                                     \
    NARROW_ENTRY(RPT, CPT, _v4, true, SUFFIX, TX)
#define NARROW_ENTRIES(SUFFIX, TX)                                                                  \
    NARROW_TILE(1, 2, SUFFIX, TX)                                                                   \
    NARROW_TILE(1, 4, SUFFIX, TX)                                                                   \
    NARROW_TILE(2, 2, SUFFIX, TX)                                                                   \
    NARROW_TILE(2, 4, SUFFIX, TX)                                                                   \
    NARROW_TILE(4, 4, SUFFIX, TX)
NARROW_ENTRIES(f32, float)
NARROW_ENTRIES(bf16, __nv_bfloat16)
NARROW_ENTRIES(f16, __half)

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    matmul_t_f32(const float* x, const float* w, float* o, int m, int n, int k) {
    matmul_t_f32<false>(x, w, o, m, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    matmul_t_f32_v4(const float* x, const float* w, float* o, int m, int n, int k) {
    matmul_t_f32<true>(x, w, o, m, n, k);
}
