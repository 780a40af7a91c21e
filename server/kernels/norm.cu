// The norm and activation family (ops/norm.rs, cuda/norm.rs): RMSNorm and the gated
// activations (SwiGLU, GeGLU), each optionally followed in the same pass by the per-token fp8 QDQ
// of the Linear that reads its output.
#include "qdq.cuh"
#include "rms.cuh"

#define ROW_THREADS 256

// ---- RMSNorm: one block (256 threads) per row ---------------------------------------------

// The sum of every thread's `v` (ROW_THREADS threads), broadcast: a tree that adds value
// tid + s to value tid for s = 128, 64, ..., 1. The last five levels run inside warp 0 through
// shuffles, which pair the same values in the same order as shared memory did (same bits), with
// four barriers instead of nine.
__device__ float tree_sum(float v, float* s_red) {
    const int tid = threadIdx.x;
    s_red[tid] = v;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s >= 32; s >>= 1) {
        if (tid < s) s_red[tid] += s_red[tid + s];
        __syncthreads();
    }
    if (tid < 32) {
        v = s_red[tid];
        for (int s = 16; s > 0; s >>= 1) v += __shfl_down_sync(0xffffffff, v, s);
        if (tid == 0) s_red[0] = v;
    }
    __syncthreads();
    return s_red[0];
}

// LlamaRMSNorm of x, normalised and scaled by the weight in f32 with one rounding at the end.
// PyTorch rounds twice (after the normalisation, after the weight); one rounding is closer to
// the f32 reference, and in f32 the two are the same. (The residual add before it happens in the
// epilogue of the GEMM that produced the addend: cuda/gemm.rs.)
// VEC values per load and store: 8 (16-byte vectors) when cols % 8 == 0 and every row start is
// 16-byte aligned (checked by the caller), else 1.
// W = float with T narrower: GemmaRMSNorm, whose weight (1 + w) is kept in f32 and multiplied in
// f32, as transformers does, before the one rounding.
template <typename T, typename W, int VEC, bool FP8_QDQ>
__device__ void rms_norm(const T* x, const W* weight, T* out, int cols, float eps) {
    using V = Pack<T, VEC>;
    __shared__ float s_red[ROW_THREADS];
    const long base = (long)blockIdx.x * cols;
    const int tid = threadIdx.x;
    float squares = 0.0f;
    for (int i = tid * VEC; i < cols; i += ROW_THREADS * VEC)
        squares = sum_squares(*reinterpret_cast<const V*>(x + base + i), squares);
    const float inv = rsqrtf(tree_sum(squares, s_red) / cols + eps);
    float amax = 0.0f;
    for (int i = tid * VEC; i < cols; i += ROW_THREADS * VEC) {
        const V o = rms_scaled(*reinterpret_cast<const V*>(x + base + i),
                               *reinterpret_cast<const Pack<W, VEC>*>(weight + i), inv);
        if (FP8_QDQ) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_f32(o.v[j])));
        }
        *reinterpret_cast<V*>(out + base + i) = o;
    }
    // the input of the Linears that read this norm, when they all quantize it per token to fp8
    if (FP8_QDQ) fp8_qdq_row<T, VEC>(out + base, out + base, cols, fp8_token_scale(amax));
}

// RMSNorm of rows of at most 8 * LANES values (cols % 8 == 0, 16-byte aligned rows: the per-head
// q/k norms), LANES lanes a row and 256 / LANES rows a block: a block a row left 240 of its 256
// threads idle on a 128-wide head. The bits of rms_norm<T, W, 8, false> (rms_norm_lanes).
template <typename T, typename W, int LANES>
__device__ void rms_norm_narrow(const T* x, const W* weight, T* out, long rows, int cols,
                                float eps) {
    const long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) / LANES;
    const int col = (threadIdx.x % LANES) * 8;
    const bool mine = row < rows && col < cols;
    Pack<T, 8> h{};
    Pack<W, 8> w{};
    if (mine) {
        h = *reinterpret_cast<const Pack<T, 8>*>(x + row * cols + col);
        w = *reinterpret_cast<const Pack<W, 8>*>(weight + col);
    }
    const Pack<T, 8> o = rms_norm_lanes<T, W, LANES>(h, w, mine, cols, eps);
    if (mine) *reinterpret_cast<Pack<T, 8>*>(out + row * cols + col) = o;
}

// One row of rms_norm_warp: the normed vectors of 8 values of row `xr` of a lane, each handed
// to `out(column, vector)`.
template <typename T, typename W, typename Out>
__device__ __forceinline__ void rms_norm_warp_row(const T* xr, const W* weight, int cols, float eps,
                                                  int lane, Out out) {
    using V = Pack<T, 8>;
    // thread lane + 32m of rms_norm reads the vectors at base + 256m, base + 2048 j on; eight
    // loads in flight before the sums
    float partial[8] = {};
    for (int base = lane * 8; base < cols; base += ROW_THREADS * 8) {
        V v[8];
#pragma unroll
        for (int m = 0; m < 8; ++m)
            if (base + 256 * m < cols) v[m] = *reinterpret_cast<const V*>(xr + base + 256 * m);
#pragma unroll
        for (int m = 0; m < 8; ++m)
            if (base + 256 * m < cols) partial[m] = sum_squares(v[m], partial[m]);
    }
    const float inv = rsqrtf(lanes_sum<32>(tree8(partial)) / cols + eps);
    for (int base = lane * 8; base < cols; base += 4 * 256) {
        V v[4];
        Pack<W, 8> w[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            if (base + 256 * m >= cols) continue;
            v[m] = *reinterpret_cast<const V*>(xr + base + 256 * m);
            w[m] = *reinterpret_cast<const Pack<W, 8>*>(weight + base + 256 * m);
        }
#pragma unroll
        for (int m = 0; m < 4; ++m)
            if (base + 256 * m < cols) out(base + 256 * m, rms_scaled(v[m], w[m], inv));
    }
}

// RMSNorm of rows wider than 256 values (cols % 8 == 0, 16-byte aligned rows), a warp a row and
// eight rows a block: a block a row took its 256 threads through four barriers a row and kept
// too few loads in flight to stream the rows (~1.5 TB/s at 2,048 columns). Lane l does the
// work of rms_norm's threads l, l + 32, ..., l + 224 (one partial sum each) and adds the
// partial sums in tree_sum's order: threads t and t + 128, then + 64, + 32, then the shuffles.
// The bits of rms_norm<T, W, 8, false>.
template <typename T, typename W>
__device__ void rms_norm_warp(const T* x, const W* weight, T* out, long rows, int cols,
                              float eps) {
    const int lane = threadIdx.x % 32;
    const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;  // the whole warp: no barrier below
    T* orow = out + row * cols;
    rms_norm_warp_row(x + row * cols, weight, cols, eps, lane, [&](int i, const Pack<T, 8>& o) {
        *reinterpret_cast<Pack<T, 8>*>(orow + i) = o;
    });
}

// rms_norm_warp's rows written as the input of Linears on the fp8 tensor cores: e4m3 codes and
// one f32 scale per row (absmax / 448 of the normed row in T, or `static_scale` when > 0), the
// codes that quantize_fp8_rows (fp8_gemm.cu) gives rms_norm_warp's output. The normed row waits
// in dynamic shared memory (cols values of T per warp) between the absmax and the encoding, and
// each lane reads back only the vectors it wrote: no normed row reaches global memory, and the
// registers stay rms_norm_warp's (the row held in registers took 180 and ran no faster than the
// norm and the quantization apart).
template <typename T, typename W>
__device__ void rms_norm_warp_fp8_codes(const T* x, const W* weight, uint8_t* codes,
                                        float* scales, long rows, int cols, float eps,
                                        float static_scale) {
    extern __shared__ __align__(16) unsigned char s_normed[];
    const int lane = threadIdx.x % 32;
    const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;  // the whole warp: no barrier below
    Pack<T, 8>* held = reinterpret_cast<Pack<T, 8>*>(s_normed) + (threadIdx.x / 32) * (cols / 8);
    float amax = 0.0f;
    rms_norm_warp_row(x + row * cols, weight, cols, eps, lane, [&](int i, const Pack<T, 8>& o) {
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(to_f32(o.v[j])));
        held[i / 8] = o;
    });
    const float scale = static_scale > 0.0f ? static_scale : fp8_scale_of(warp_max(amax));
    uint8_t* crow = codes + row * cols;
#pragma unroll 4
    for (int i = lane * 8; i < cols; i += 256)
        *reinterpret_cast<uint2*>(crow + i) = fp8_codes8(held[i / 8], scale);
    if (lane == 0) scales[row] = scale;
}

// ---- gated activations: out = act(gate) * up (SwiGLU, GeGLU) ---------------------------------------------------------

// Rounded as PyTorch does in T: silu in f32 rounded to T once, then the product in f32 rounded
// once.
struct Silu {
    __device__ __forceinline__ static float f(float x) { return x / (1.0f + expf(-x)); }
};
// PyTorch's gelu(approximate="tanh") in f32 (its opmath for bf16/f16), term for term.
struct GeluTanh {
    __device__ __forceinline__ static float f(float x) {
        const float beta = 0.7978845608028654f, kappa = 0.044715f;  // sqrt(2 / pi)
        return 0.5f * x * (1.0f + tanhf(beta * (x + kappa * (x * x * x))));
    }
};

template <typename T, typename Act>
__device__ __forceinline__ Pack<T, 8> glu_mul8(const Pack<T, 8>& g, const Pack<T, 8>& u) {
    Pack<T, 8> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float s = to_f32(from_f32<T>(Act::f(to_f32(g.v[j]))));
        o.v[j] = from_f32<T>(s * to_f32(u.v[j]));
    }
    return o;
}

// One thread per 8 elements (n % 8 == 0 and 16-byte aligned rows, checked by the caller).
template <typename T, typename Act>
__device__ void glu_mul(const T* gate, const T* up, T* out, long n) {
    long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    // Loaded into registers first: passed straight through, the packs were read as 16 two-byte loads.
    const Pack<T, 8> g = *reinterpret_cast<const Pack<T, 8>*>(gate + i);
    const Pack<T, 8> u = *reinterpret_cast<const Pack<T, 8>*>(up + i);
    *reinterpret_cast<Pack<T, 8>*>(out + i) = glu_mul8<T, Act>(g, u);
}

// The same, one block (256 threads) per row of k values, followed by the per-token fp8 QDQ of the
// down projection's input.
template <typename T, typename Act>
__device__ void glu_mul_fp8_qdq(const T* gate, const T* up, T* out, int k) {
    const long base = (long)blockIdx.x * k;
    float amax = 0.0f;
    for (int i = threadIdx.x * 8; i < k; i += 256 * 8) {
        const Pack<T, 8> g = *reinterpret_cast<const Pack<T, 8>*>(gate + base + i);
        const Pack<T, 8> u = *reinterpret_cast<const Pack<T, 8>*>(up + base + i);
        Pack<T, 8> o = glu_mul8<T, Act>(g, u);
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(to_f32(o.v[j])));
        *reinterpret_cast<Pack<T, 8>*>(out + base + i) = o;
    }
    fp8_qdq_row<T, 8>(out + base, out + base, k, fp8_token_scale(amax));
}

// The same, one block (256 threads) per row of k values, written as the down projection's
// input for the fp8 tensor-core GEMM: e4m3 codes and the row's scale (absmax / 448 of the
// products rounded to T, or `static_scale` when > 0), the codes quantize_fp8_rows (fp8_gemm.cu)
// gives the product in T. The products wait in dynamic shared memory (k values of T) between
// the absmax and the encoding: each is computed once and few registers are live, so that
// enough blocks share an SM to keep the loads in flight (products held in registers took 98
// and allowed two blocks). Each thread reads back only the packs it wrote.
template <typename T, typename Act>
__device__ void glu_mul_fp8_codes(const T* gate, const T* up, uint8_t* codes, float* scales, int k,
                                  float static_scale) {
    using P = Pack<T, 8>;
    extern __shared__ __align__(16) unsigned char s_products[];
    P* held = reinterpret_cast<P*>(s_products);
    const long base = (long)blockIdx.x * k;
    float amax = 0.0f;
#pragma unroll 2
    for (int i = threadIdx.x * 8; i < k; i += 256 * 8) {
        const P g = *reinterpret_cast<const P*>(gate + base + i);
        const P u = *reinterpret_cast<const P*>(up + base + i);
        const P p = glu_mul8<T, Act>(g, u);
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(to_f32(p.v[j])));
        held[i / 8] = p;
    }
    // every thread takes part in the block-wide max, whatever the static scale
    float scale = fp8_token_scale(amax);
    if (static_scale > 0.0f) scale = static_scale;
    for (int i = threadIdx.x * 8; i < k; i += 256 * 8) {
        *reinterpret_cast<uint2*>(codes + base + i) = fp8_codes8(held[i / 8], scale);
    }
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
}

// ---- gated RMSNorm (Gated DeltaNet's output norm): one block (256 threads) per row ---------

// transformers' Qwen3NextRMSNormGated / Qwen3_5RMSNormGated, rounded where it rounds:
// n = x * rsqrt(mean(x²) + eps) in f32, rounded to T; p = w * n, kept in f32 for an f32 weight
// (the releases store it so), else rounded to T; out = p * silu(z) in f32, rounded to T.
template <typename T, typename W>
__device__ __forceinline__ T gated_normed(T x, W w, T z, float inv) {
    const float n = to_f32(from_f32<T>(to_f32(x) * inv));
    float p = to_f32(w) * n;
    if (sizeof(W) != sizeof(float)) p = to_f32(from_f32<T>(p));
    return from_f32<T>(p * Silu::f(to_f32(z)));
}

template <typename T, typename W>
__device__ void gated_rms_norm(const T* x, const W* weight, const T* z, T* out, int cols,
                               float eps) {
    __shared__ float s_red[ROW_THREADS];
    const long base = (long)blockIdx.x * cols;
    const int tid = threadIdx.x;
    float squares = 0.0f;
    for (int i = tid; i < cols; i += ROW_THREADS) squares += to_f32(x[base + i]) * to_f32(x[base + i]);
    const float inv = rsqrtf(tree_sum(squares, s_red) / cols + eps);
    for (int i = tid; i < cols; i += ROW_THREADS)
        out[base + i] = gated_normed(x[base + i], weight[i], z[base + i], inv);
}

// The same for rows of at most 256 values (Gated DeltaNet's heads), LANES lanes a row (LANES =
// next power of two of cols / 8, at least 4) and 256 / LANES rows a block: lane l holds the
// values l + LANES·m, m < 8, which gated_rms_norm's threads of those indices hold one each, so
// its tree's pairs are the lane's own (tree8) down to LANES and then across lanes. The same
// bits.
template <typename T, typename W, int LANES>
__device__ void gated_rms_norm_narrow(const T* x, const W* weight, const T* z, T* out, long rows,
                                      int cols, float eps) {
    const long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) / LANES;
    const int lane = threadIdx.x % LANES;
    const long base = row * cols;
    T v[8];
    float squares[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int i = lane + LANES * m;
        const bool has = row < rows && i < cols;
        v[m] = has ? x[base + i] : from_f32<T>(0.0f);
        float s = 0.0f;
        if (has) s += to_f32(v[m]) * to_f32(v[m]);
        squares[m] = s;
    }
    const float inv = rsqrtf(lanes_sum<LANES>(tree8(squares)) / cols + eps);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int i = lane + LANES * m;
        if (row < rows && i < cols) out[base + i] = gated_normed(v[m], weight[i], z[base + i], inv);
    }
}

// ---- extern "C" entry points, one per dtype -------------------------------------------------

// rms_norm_narrow{LANES}_{SUFFIX} and rms_norm_f32w_narrow{LANES}_{SUFFIX}
#define NARROW_NORM_ENTRIES(SUFFIX, T, LANES)                                                      \
    extern "C" __global__ void rms_norm_narrow##LANES##_##SUFFIX(const T* x, const T* w, T* o,     \
                                                                 long rows, int cols, float eps) { \
        rms_norm_narrow<T, T, LANES>(x, w, o, rows, cols, eps);                                    \
    }                                                                                              \
    extern "C" __global__ void rms_norm_f32w_narrow##LANES##_##SUFFIX(                             \
        const T* x, const float* w, T* o, long rows, int cols, float eps) {                        \
        rms_norm_narrow<T, float, LANES>(x, w, o, rows, cols, eps);                                \
    }

// gated_rms_norm_narrow{LANES}_{SUFFIX} and gated_rms_norm_f32w_narrow{LANES}_{SUFFIX}
#define GATED_NARROW_ENTRIES(SUFFIX, T, LANES)                                                     \
    extern "C" __global__ void gated_rms_norm_narrow##LANES##_##SUFFIX(                            \
        const T* x, const T* w, const T* z, T* o, long rows, int cols, float eps) {                \
        gated_rms_norm_narrow<T, T, LANES>(x, w, z, o, rows, cols, eps);                           \
    }                                                                                              \
    extern "C" __global__ void gated_rms_norm_f32w_narrow##LANES##_##SUFFIX(                       \
        const T* x, const float* w, const T* z, T* o, long rows, int cols, float eps) {            \
        gated_rms_norm_narrow<T, float, LANES>(x, w, z, o, rows, cols, eps);                       \
    }

#define NORM_ENTRIES(SUFFIX, T)                                                                    \
    extern "C" __global__ void rms_norm_##SUFFIX(const T* x, const T* w, T* o, int cols, float eps) { \
        rms_norm<T, T, 1, false>(x, w, o, cols, eps);                                              \
    }                                                                                              \
    extern "C" __global__ void rms_norm_v8_##SUFFIX(const T* x, const T* w, T* o, int cols,        \
                                                    float eps) {                                   \
        rms_norm<T, T, 8, false>(x, w, o, cols, eps);                                              \
    }                                                                                              \
    extern "C" __global__ void rms_norm_v8_fp8_qdq_##SUFFIX(const T* x, const T* w, T* o, int cols, \
                                                            float eps) {                           \
        rms_norm<T, T, 8, true>(x, w, o, cols, eps);                                               \
    }                                                                                              \
    extern "C" __global__ void rms_norm_f32w_##SUFFIX(const T* x, const float* w, T* o, int cols,  \
                                                      float eps) {                                 \
        rms_norm<T, float, 1, false>(x, w, o, cols, eps);                                          \
    }                                                                                              \
    extern "C" __global__ void rms_norm_f32w_v8_##SUFFIX(const T* x, const float* w, T* o, int cols, \
                                                         float eps) {                              \
        rms_norm<T, float, 8, false>(x, w, o, cols, eps);                                          \
    }                                                                                              \
    extern "C" __global__ void rms_norm_f32w_v8_fp8_qdq_##SUFFIX(const T* x, const float* w, T* o, \
                                                                 int cols, float eps) {            \
        rms_norm<T, float, 8, true>(x, w, o, cols, eps);                                           \
    }                                                                                              \
    extern "C" __global__ void rms_norm_warp_##SUFFIX(const T* x, const T* w, T* o, long rows,     \
                                                      int cols, float eps) {                       \
        rms_norm_warp<T, T>(x, w, o, rows, cols, eps);                                             \
    }                                                                                              \
    extern "C" __global__ void rms_norm_f32w_warp_##SUFFIX(const T* x, const float* w, T* o,       \
                                                           long rows, int cols, float eps) {       \
        rms_norm_warp<T, float>(x, w, o, rows, cols, eps);                                         \
    }                                                                                              \
    extern "C" __global__ void rms_norm_warp_fp8_codes_##SUFFIX(                                   \
        const T* x, const T* w, uint8_t* c, float* s, long rows, int cols, float eps, float ss) {  \
        rms_norm_warp_fp8_codes<T, T>(x, w, c, s, rows, cols, eps, ss);                            \
    }                                                                                              \
    extern "C" __global__ void rms_norm_f32w_warp_fp8_codes_##SUFFIX(                              \
        const T* x, const float* w, uint8_t* c, float* s, long rows, int cols, float eps,          \
        float ss) {                                                                                \
        rms_norm_warp_fp8_codes<T, float>(x, w, c, s, rows, cols, eps, ss);                        \
    }                                                                                              \
    NARROW_NORM_ENTRIES(SUFFIX, T, 8)                                                              \
    NARROW_NORM_ENTRIES(SUFFIX, T, 16)                                                             \
    NARROW_NORM_ENTRIES(SUFFIX, T, 32)                                                             \
    extern "C" __global__ void silu_mul_##SUFFIX(const T* g, const T* u, T* o, long n) {           \
        glu_mul<T, Silu>(g, u, o, n);                                                              \
    }                                                                                              \
    extern "C" __global__ void silu_mul_fp8_qdq_##SUFFIX(const T* g, const T* u, T* o, int k) {    \
        glu_mul_fp8_qdq<T, Silu>(g, u, o, k);                                                      \
    }                                                                                              \
    extern "C" __global__ void silu_mul_fp8_codes_##SUFFIX(const T* g, const T* u, uint8_t* c,     \
                                                           float* s, int k, float ss) {            \
        glu_mul_fp8_codes<T, Silu>(g, u, c, s, k, ss);                                             \
    }                                                                                              \
    extern "C" __global__ void gelu_tanh_mul_fp8_codes_##SUFFIX(const T* g, const T* u, uint8_t* c, \
                                                                float* s, int k, float ss) {       \
        glu_mul_fp8_codes<T, GeluTanh>(g, u, c, s, k, ss);                                         \
    }                                                                                              \
    extern "C" __global__ void gelu_tanh_mul_##SUFFIX(const T* g, const T* u, T* o, long n) {      \
        glu_mul<T, GeluTanh>(g, u, o, n);                                                          \
    }                                                                                              \
    extern "C" __global__ void gelu_tanh_mul_fp8_qdq_##SUFFIX(const T* g, const T* u, T* o, int k) { \
        glu_mul_fp8_qdq<T, GeluTanh>(g, u, o, k);                                                  \
    }                                                                                              \
    GATED_NARROW_ENTRIES(SUFFIX, T, 4)                                                             \
    GATED_NARROW_ENTRIES(SUFFIX, T, 8)                                                             \
    GATED_NARROW_ENTRIES(SUFFIX, T, 16)                                                            \
    GATED_NARROW_ENTRIES(SUFFIX, T, 32)                                                            \
    extern "C" __global__ void gated_rms_norm_##SUFFIX(const T* x, const T* w, const T* z, T* o,   \
                                                       int cols, float eps) {                      \
        gated_rms_norm<T, T>(x, w, z, o, cols, eps);                                               \
    }                                                                                              \
    extern "C" __global__ void gated_rms_norm_f32w_##SUFFIX(const T* x, const float* w, const T* z, \
                                                            T* o, int cols, float eps) {           \
        gated_rms_norm<T, float>(x, w, z, o, cols, eps);                                           \
    }

NORM_ENTRIES(f32, float)
NORM_ENTRIES(bf16, __nv_bfloat16)
NORM_ENTRIES(f16, __half)
