// The linear-attention family (ops/linear_attention.rs, cuda/linear_attention.rs): the two
// sequence ops of a Gated DeltaNet layer in f32, over a batch of sequences whose token ranges
// are starts[i] .. starts[i + 1]. A sequence's arithmetic does not depend on what shares its
// batch (each output reads its own sequence's tokens only, in the same order), so a result is
// bitwise the same alone and batched.

#include "common.cuh"

#define WARP 32
#define DELTA_WARPS 4

// ---- causal depthwise conv1d: one thread per (token, channel) ------------------------------

// sum_j w[c][j] * x[t - kernel + 1 + j][c] for channel c of token t (x `[tokens, channels]`),
// tokens before the first of t's sequence read as zero. The products and sums are rounded one
// by one in tap order (no fused multiply-add), as the CPU reference computes them, so that the
// two give the same bits.
template <typename T>
__device__ float causal_conv_taps(const T* x, const float* weight, int t, int c, int channels,
                                  int kernel, const int* starts, int sequences) {
    int lo = 0, hi = sequences;  // the sequence of t: starts[lo] <= t < starts[lo + 1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (starts[mid] <= t) lo = mid; else hi = mid;
    }
    const int first = starts[lo];
    float acc = 0.0f;
    for (int j = 0; j < kernel; ++j) {
        const int src = t + j - (kernel - 1);
        if (src >= first)
            acc = __fadd_rn(acc, __fmul_rn(weight[c * kernel + j], to_f32(x[(long)src * channels + c])));
    }
    return acc;
}

// out[t][c] = act(the taps (+ bias[c] when has_bias)).
extern "C" __global__ void causal_conv1d_f32(const float* x, const float* weight,
                                             const float* bias, int has_bias, float* out,
                                             int tokens, int channels, int kernel, int silu,
                                             const int* starts, int sequences) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)tokens * channels) return;
    const int t = (int)(i / channels), c = (int)(i % channels);
    float acc = causal_conv_taps(x, weight, t, c, channels, kernel, starts, sequences);
    if (has_bias) acc = __fadd_rn(acc, bias[c]);
    out[i] = silu ? acc / (1.0f + expf(-acc)) : acc;
}

// The conv1d of a Gated DeltaNet's packed q|k|v projection in its compute dtype T: each output
// as causal_conv1d_f32 computes it (from the exact f32 of the input, SiLU), rounded to T as the
// layer's conv output is, then written as f32 into q `[tokens, key_dim]`, k `[tokens, key_dim]`
// or v `[tokens, channels - 2 key_dim]`: the inputs of the delta rule, in one pass where the
// cast, the convolution, the rounding and the three splits took five.
template <typename T>
__device__ void conv_qkv(const T* x, const float* weight, float* q, float* k, float* v,
                         int tokens, int channels, int kernel, int key_dim, const int* starts,
                         int sequences) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)tokens * channels) return;
    const int t = (int)(i / channels), c = (int)(i % channels);
    const float acc = causal_conv_taps(x, weight, t, c, channels, kernel, starts, sequences);
    const float y = to_f32(from_f32<T>(acc / (1.0f + expf(-acc))));
    const int value_dim = channels - 2 * key_dim;
    if (c < key_dim) q[(long)t * key_dim + c] = y;
    else if (c < 2 * key_dim) k[(long)t * key_dim + c - key_dim] = y;
    else v[(long)t * value_dim + c - 2 * key_dim] = y;
}
#define CONV_QKV(SUFFIX, T)                                                                     \
    extern "C" __global__ void conv_qkv_##SUFFIX(const T* x, const float* w, float* q, float* k, \
                                                 float* v, int tokens, int channels, int kernel,  \
                                                 int key_dim, const int* starts, int sequences) { \
        conv_qkv<T>(x, w, q, k, v, tokens, channels, kernel, key_dim, starts, sequences);       \
    }
CONV_QKV(f32, float)
CONV_QKV(bf16, __nv_bfloat16)
CONV_QKV(f16, __half)

// ---- gated delta rule ----------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
    // xor butterfly: every lane ends with the same sum, added in the same order on every run
    for (int s = WARP / 2; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffff, v, s);
    return v;
}

// Rows of `dim` values (q or k `[tokens * heads, dim]`), one warp per row: l2-normalised when
// `l2` (x * rsqrt(sum(x * x) + 1e-6), FLA's l2norm), then multiplied by `scale`.
extern "C" __global__ void delta_rule_prepare_f32(const float* x, float* out, int rows, int dim,
                                                  int l2, float scale) {
    const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    const float* r = x + (long)row * dim;
    float inv = 1.0f;
    if (l2) {
        float squares = 0.0f;
        for (int i = lane; i < dim; i += WARP) squares += r[i] * r[i];
        inv = 1.0f / sqrtf(warp_sum(squares) + 1e-6f);
    }
    for (int i = lane; i < dim; i += WARP) out[(long)row * dim + i] = r[i] * inv * scale;
}

// The gated delta rule from a zero state, token by token (transformers'
// torch_recurrent_gated_delta_rule; the chunked form is the same recurrence regrouped).
// Column e of a value head's state S [k_dim, v_dim] depends on no other column, so a warp owns
// COLS_PER_WARP columns and holds them in registers, lane l owning rows l, l + 32, ...; per
// token and column:
//   S *= exp(g); delta = (v[e] - k . S[:, e]) * beta; S[:, e] += k * delta; out[e] = q . S[:, e]
// The columns' sums are independent, so their shuffles overlap; the block stages the next
// tokens' q, k, g, beta and values in shared memory, so that each is read from global memory
// once per block rather than once per warp. q and k come prepared (l2-normalised, q scaled by
// 1/sqrt(k_dim)); value head h reads key head h / (v_heads / k_heads).
// Grid (v_dim / (DELTA_WARPS * COLS_PER_WARP), v_heads, sequences), DELTA_WARPS warps a block:
// the sequences of a batch run side by side (one alone fills a fraction of the GPU).
#define COLS_PER_WARP 4
#define BLOCK_COLS (DELTA_WARPS * COLS_PER_WARP)
// Tokens staged at once: 32 KiB of q and k whatever the key dimension (rows of K_DIM
// floats, 16-byte aligned: the prepared q and k are fresh allocations).
#define STAGED_KEYS 4096
#define STAGED_VECTORS (STAGED_KEYS / 4 / (DELTA_WARPS * WARP))

template <int KEY_PER_LANE>
__device__ void gated_delta_rule(const float* q, const float* k, const float* v, const float* g,
                                 const float* beta, float* out, const int* starts, int k_heads,
                                 int v_heads, int v_dim) {
    constexpr int K_DIM = KEY_PER_LANE * WARP;
    // this block's sequence: every pointer moved to its first token
    const int start = starts[blockIdx.z], tokens = starts[blockIdx.z + 1] - start;
    q += (long)start * k_heads * K_DIM;
    k += (long)start * k_heads * K_DIM;
    v += (long)start * v_heads * v_dim;
    out += (long)start * v_heads * v_dim;
    g += (long)start * v_heads;
    beta += (long)start * v_heads;
    constexpr int TILE = STAGED_KEYS / K_DIM;
    __shared__ __align__(16) float qs[TILE][K_DIM];
    __shared__ __align__(16) float ks[TILE][K_DIM];
    __shared__ float vs[TILE][BLOCK_COLS], decays[TILE], betas[TILE];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int h = blockIdx.y, kh = h / (v_heads / k_heads);
    const int col0 = blockIdx.x * BLOCK_COLS;  // the block's first column
    float s[COLS_PER_WARP][KEY_PER_LANE];
#pragma unroll
    for (int c = 0; c < COLS_PER_WARP; ++c)
#pragma unroll
        for (int i = 0; i < KEY_PER_LANE; ++i) s[c][i] = 0.0f;
    for (int t0 = 0; t0 < tokens; t0 += TILE) {
        const int n = min(TILE, tokens - t0);
        // Every load of the tile is issued before the first store, so that their latencies
        // overlap: STAGED_KEYS / 4 float4 of q and of k, STAGED_VECTORS per thread.
        float4 qv[STAGED_VECTORS], kv[STAGED_VECTORS];
#pragma unroll
        for (int r = 0; r < STAGED_VECTORS; ++r) {
            const int i = threadIdx.x + r * DELTA_WARPS * WARP;
            const int tok = i / (K_DIM / 4), col = 4 * (i % (K_DIM / 4));
            if (tok < n) {
                const long row = ((long)(t0 + tok) * k_heads + kh) * K_DIM + col;
                qv[r] = *reinterpret_cast<const float4*>(q + row);
                kv[r] = *reinterpret_cast<const float4*>(k + row);
            }
        }
        // values, decays and betas of the tile (TILE <= 128 = the block's threads)
        constexpr int V_PER_THREAD = TILE * BLOCK_COLS / (DELTA_WARPS * WARP);
        float vv[V_PER_THREAD];
#pragma unroll
        for (int r = 0; r < V_PER_THREAD; ++r) {
            const int i = threadIdx.x + r * DELTA_WARPS * WARP;
            const int tok = i / BLOCK_COLS, e = col0 + i % BLOCK_COLS;
            vv[r] = tok < n && e < v_dim ? v[((long)(t0 + tok) * v_heads + h) * v_dim + e] : 0.0f;
        }
        const bool gated = threadIdx.x < n;
        const float gd = gated ? expf(g[(long)(t0 + threadIdx.x) * v_heads + h]) : 0.0f;
        const float bd = gated ? beta[(long)(t0 + threadIdx.x) * v_heads + h] : 0.0f;
        __syncthreads();  // the previous tile is read
#pragma unroll
        for (int r = 0; r < STAGED_VECTORS; ++r) {
            const int i = threadIdx.x + r * DELTA_WARPS * WARP;
            const int tok = i / (K_DIM / 4), col = 4 * (i % (K_DIM / 4));
            if (tok < n) {
                *reinterpret_cast<float4*>(&qs[tok][col]) = qv[r];
                *reinterpret_cast<float4*>(&ks[tok][col]) = kv[r];
            }
        }
#pragma unroll
        for (int r = 0; r < V_PER_THREAD; ++r) {
            const int i = threadIdx.x + r * DELTA_WARPS * WARP;
            vs[i / BLOCK_COLS][i % BLOCK_COLS] = vv[r];
        }
        if (gated) {
            decays[threadIdx.x] = gd;
            betas[threadIdx.x] = bd;
        }
        __syncthreads();
        for (int j = 0; j < n; ++j) {
            float kr[KEY_PER_LANE], qr[KEY_PER_LANE];
#pragma unroll
            for (int i = 0; i < KEY_PER_LANE; ++i) {
                kr[i] = ks[j][lane + i * WARP];
                qr[i] = qs[j][lane + i * WARP];
            }
            const float decay = decays[j], b = betas[j];
            float kv_mem[COLS_PER_WARP];
#pragma unroll
            for (int c = 0; c < COLS_PER_WARP; ++c) {
                kv_mem[c] = 0.0f;
#pragma unroll
                for (int i = 0; i < KEY_PER_LANE; ++i) {
                    s[c][i] *= decay;
                    kv_mem[c] += s[c][i] * kr[i];
                }
            }
#pragma unroll
            for (int c = 0; c < COLS_PER_WARP; ++c) kv_mem[c] = warp_sum(kv_mem[c]);
            float o[COLS_PER_WARP];
#pragma unroll
            for (int c = 0; c < COLS_PER_WARP; ++c) {
                const float delta = (vs[j][warp * COLS_PER_WARP + c] - kv_mem[c]) * b;
                o[c] = 0.0f;
#pragma unroll
                for (int i = 0; i < KEY_PER_LANE; ++i) {
                    s[c][i] += kr[i] * delta;
                    o[c] += s[c][i] * qr[i];
                }
            }
#pragma unroll
            for (int c = 0; c < COLS_PER_WARP; ++c) o[c] = warp_sum(o[c]);
            const int e = col0 + warp * COLS_PER_WARP + lane;
            if (lane < COLS_PER_WARP && e < v_dim) {
                float mine = o[0];
#pragma unroll
                for (int c = 1; c < COLS_PER_WARP; ++c) mine = lane == c ? o[c] : mine;
                out[((long)(t0 + j) * v_heads + h) * v_dim + e] = mine;
            }
        }
    }
}

#define GATED_DELTA_RULE(K_DIM)                                                                \
    extern "C" __global__ void gated_delta_rule_k##K_DIM##_f32(                                \
        const float* q, const float* k, const float* v, const float* g, const float* beta,     \
        float* out, const int* starts, int k_heads, int v_heads, int v_dim) {                  \
        gated_delta_rule<K_DIM / WARP>(q, k, v, g, beta, out, starts, k_heads, v_heads, v_dim); \
    }
GATED_DELTA_RULE(32)
GATED_DELTA_RULE(64)
GATED_DELTA_RULE(128)
GATED_DELTA_RULE(256)
