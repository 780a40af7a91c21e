// The dequant family (ops/dequant.rs, cuda/dequant/): compressed-tensors weights decoded to
// the compute dtype, activation QDQ, and the int4 GEMM that decodes inside the product
// (int4_gemm.cuh). Every kernel mirrors a CPU reference in ops/dequant.rs or quant/; all
// arithmetic is IEEE f32 (no fast math), so dequantization and QDQ are bit-identical to the CPU.
#include "int4_gemm.cuh"
#include "qdq.cuh"

// ---- dequantization: one thread per packed word / byte -------------------------------------

// pack-quantized int4/int8: w = (q - zp) * scale. `zps` may be null (symmetric). Column c
// takes the scale and zero point of group c / group, or g_idx[c] (act-order) where `g_idx` is
// not null; `groups` per row. Scales S as the checkpoint stores them (f32, bf16 or f16: each
// widens to f32 exactly), zero points Z signed, int32 or a byte each.
template <typename T, typename S, typename Z>
__device__ void dequant_int(const int32_t* packed, const S* scales, const Z* zps, T* out,
                            int rows, int cols, int words_per_row, int bits, int group,
                            const uint32_t* g_idx, int groups) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)rows * words_per_row) return;
    int r = idx / words_per_row;
    int w = idx % words_per_row;
    uint32_t word = (uint32_t)packed[idx];
    int per = 32 / bits;
    uint32_t mask = (1u << bits) - 1;
    int offset = 1 << (bits - 1);
    for (int i = 0; i < per; ++i) {
        int c = w * per + i;
        if (c >= cols) break;
        int g = r * groups + (g_idx ? (int)g_idx[c] : c / group);
        int q = (int)((word >> (i * bits)) & mask) - offset;
        int zp = zps ? (int)zps[g] : 0;
        out[(long)r * cols + c] = from_f32<T>((float)(q - zp) * to_f32(scales[g]));
    }
}

// Fast path of dequant_int when every word lies inside one group (group % (32 / BITS) == 0 and
// cols % (32 / BITS) == 0, true for real models): one scale lookup and vector stores per word.
// Grid (rows, word blocks of DEQUANT_ITEMS * blockDim): thread i of a block takes the words
// i + j * blockDim, so no thread divides a 64-bit index to find its row, all its loads are in
// flight before the first is decoded, and every store stays coalesced across the warp.
// The `_stacked` entries dequantize several weights of one shape in one launch (a mixture's
// experts): grid z picks the weight, whose packed, scale and zero-point (or 0) addresses are
// ptrs[3z..3z + 3], and its output follows the previous one's.
#define DEQUANT_ITEMS 2
template <typename T, typename S, typename Z, int BITS>
__device__ void dequant_int_words(const int32_t* packed, const S* scales, const Z* zps, T* out,
                                  int rows, int cols, int group, int r, int word_block) {
    constexpr int PER = 32 / BITS;
    const int words_per_row = cols / PER;
    const int w0 = word_block * blockDim.x * DEQUANT_ITEMS + threadIdx.x;
    uint32_t words[DEQUANT_ITEMS];
#pragma unroll
    for (int j = 0; j < DEQUANT_ITEMS; ++j) {
        const int w = w0 + j * blockDim.x;
        if (w < words_per_row) words[j] = (uint32_t)packed[(long)r * words_per_row + w];
    }
#pragma unroll
    for (int j = 0; j < DEQUANT_ITEMS; ++j) {
        const int w = w0 + j * blockDim.x;
        if (w >= words_per_row) return;
        const int c0 = w * PER;
        const long g = (long)r * (cols / group) + c0 / group;
        float s = to_f32(scales[g]);
        int zp = zps ? (int)zps[g] : 0;
        Pack<T, PER> p;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            int q = (int)((words[j] >> (i * BITS)) & ((1u << BITS) - 1)) - (1 << (BITS - 1));
            p.v[i] = from_f32<T>((float)(q - zp) * s);
        }
        *reinterpret_cast<Pack<T, PER>*>(out + (long)r * cols + c0) = p;
    }
}

template <typename T, typename S, typename Z, int BITS>
__device__ void dequant_int_words_stacked(const uint64_t* ptrs, T* out, int rows, int cols, int group) {
    const uint64_t* p = ptrs + 3 * blockIdx.z;
    dequant_int_words<T, S, Z, BITS>((const int32_t*)p[0], (const S*)p[1], (const Z*)p[2],
                               out + (long)blockIdx.z * rows * cols, rows, cols, group, blockIdx.x,
                               blockIdx.y);
}

// nvfp4: w = bf16(fp4(code) * (fp8(scale) / global)), two codes per byte, low nibble first.
// One thread per group of 16 weights (8 bytes, one scale).
template <typename T>
__device__ void dequant_nvfp4(const uint8_t* packed, const uint8_t* scales, float per_tensor,
                              int multiplies, T* out, int rows, int cols) {
    long g = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long)rows * (cols / 16)) return;
    // compressed-tensors: fp8 scale / global scale, each weight rounded to bf16 (as it decodes);
    // ModelOpt: fp8 scale * weight_scale_2, kept in f32 (quant/nvfp4.rs).
    const float s = multiplies ? fp8_e4m3_to_f32(scales[g]) * per_tensor
                               : fp8_e4m3_to_f32(scales[g]) / per_tensor;
    uint2 bytes = reinterpret_cast<const uint2*>(packed)[g];
    Pack<T, 16> p;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        uint8_t b = ((i < 4 ? bytes.x : bytes.y) >> ((i % 4) * 8)) & 0xFF;
        const float lo = fp4_e2m1_to_f32(b & 0xF) * s, hi = fp4_e2m1_to_f32(b >> 4) * s;
        p.v[2 * i] = from_f32<T>(multiplies ? lo : bf16_round(lo));
        p.v[2 * i + 1] = from_f32<T>(multiplies ? hi : bf16_round(hi));
    }
    reinterpret_cast<Pack<T, 16>*>(out)[g] = p;
}

// float-quantized fp8: w = fp8(code) * scale[r / block_rows, c / block_cols].
// Grid (rows, column blocks of DEQUANT_ITEMS * blockDim * 8): thread i of a block takes the
// groups of 8 weights i + j * blockDim, as in dequant_int_words (cols % 8 == 0, checked by the
// caller).
template <typename T>
__device__ void dequant_fp8(const uint8_t* codes, const float* scales, T* out, int rows, int cols,
                            int block_rows, int block_cols, int scale_cols) {
    const int r = blockIdx.x;
    const int v0 = blockIdx.y * blockDim.x * DEQUANT_ITEMS + threadIdx.x;
    uint2 bytes[DEQUANT_ITEMS];
#pragma unroll
    for (int j = 0; j < DEQUANT_ITEMS; ++j) {
        const int c0 = (v0 + j * blockDim.x) * 8;
        if (c0 < cols) bytes[j] = *reinterpret_cast<const uint2*>(codes + (long)r * cols + c0);
    }
    const float* srow = scales + (long)(r / block_rows) * scale_cols;
    // The 8 weights share one scale when scale blocks are whole multiples of 8 columns (channel,
    // tensor and every real block size): one lookup instead of 8 divisions.
    const bool one_scale = block_cols % 8 == 0;
#pragma unroll
    for (int j = 0; j < DEQUANT_ITEMS; ++j) {
        const int c0 = (v0 + j * blockDim.x) * 8;
        if (c0 >= cols) return;
        const float s0 = srow[c0 / block_cols];
        Pack<T, 8> p;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            uint8_t b = ((i < 4 ? bytes[j].x : bytes[j].y) >> ((i % 4) * 8)) & 0xFF;
            p.v[i] = from_f32<T>(fp8_e4m3_to_f32(b) * (one_scale ? s0 : srow[(c0 + i) / block_cols]));
        }
        *reinterpret_cast<Pack<T, 8>*>(out + (long)r * cols + c0) = p;
    }
}

// ---- activation QDQ (x -> out) ------------------------------------------------------------

// Dynamic per-token scale, or `static_scale` when it is > 0.
template <typename T, int VEC>
__device__ void qdq_fp8_token(const T* x, T* out, int k, float static_scale) {
    using V = Pack<T, VEC>;
    const T* row = x + (long)blockIdx.x * k;
    float scale = static_scale;
    if (scale <= 0.0f) {
        float amax = 0.0f;
        for (int i = threadIdx.x * VEC; i < k; i += 256 * VEC) {
            const V v = *reinterpret_cast<const V*>(row + i);
#pragma unroll
            for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_f32(v.v[j])));
        }
        scale = fp8_token_scale(amax);
    }
    fp8_qdq_row<T, VEC>(row, out + (long)blockIdx.x * k, k, scale);
}

// int8 per token, as vLLM's dynamic_scaled_int8_quant_kernel and its GEMM's dequantization
// (ops/dequant.rs: qdq_int8_token): scale = absmax / 127, q = x * (127 / absmax) rounded to
// nearest even and saturated to [-128, 127] (NaN, from an all-zero row, to 0), x' = q * scale.
template <typename T>
__device__ void qdq_int8_token(const T* x, T* out, int k) {
    const T* row = x + (long)blockIdx.x * k;
    T* dst = out + (long)blockIdx.x * k;
    __shared__ float s_max[32];
    float amax = 0.0f;
    for (int i = threadIdx.x; i < k; i += 256) amax = fmaxf(amax, fabsf(to_f32(row[i])));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    if (threadIdx.x % 32 == 0) s_max[threadIdx.x / 32] = amax;
    __syncthreads();
    for (int w = 0; w < 256 / 32; ++w) amax = fmaxf(amax, s_max[w]);
    const float scale = amax / 127.0f, reciprocal = 127.0f / amax;
    for (int i = threadIdx.x; i < k; i += 256) {
        float q = rintf(__fmul_rn(to_f32(row[i]), reciprocal));
        q = isnan(q) ? 0.0f : fminf(fmaxf(q, -128.0f), 127.0f);
        dst[i] = from_f32<T>(__fmul_rn(q, scale));
    }
}

// fp8 per token and `group` inputs, as vLLM's per_token_group_quant_fp8 (ops/dequant.rs:
// Fp8PerTokenGroup): a warp per group, scale = max(absmax, 1e-10) / 448, or that rounded up to
// a power of two (the last group of a row may be shorter).
template <typename T>
__device__ void qdq_fp8_group(const T* x, T* out, int k, int group, int power_of_two) {
    const T* row = x + (long)blockIdx.x * k;
    T* dst = out + (long)blockIdx.x * k;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int first = warp * group; first < k; first += 8 * group) {
        const int end = min(first + group, k);
        float amax = 0.0f;
        for (int i = first + lane; i < end; i += 32) amax = fmaxf(amax, fabsf(to_f32(row[i])));
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
        float scale = fmaxf(amax, 1e-10f) / 448.0f;
        // UE8M0: rounded up to a power of two (a set mantissa carries into the exponent).
        if (power_of_two) scale = __uint_as_float((__float_as_uint(scale) + 0x7fffffu) & 0xff800000u);
        for (int i = first + lane; i < end; i += 32) {
            const float q = fminf(fmaxf(to_f32(row[i]) / scale + 0.0f, -448.0f), 448.0f);
            dst[i] = from_f32<T>(round_to_grid(q, -6, 3) * scale);
        }
    }
}

// fp8 per head (ops/dequant.rs: fp8_head_qdq): element i of n belongs to head (i / inner) %
// heads; its scale is scales[head], or with `absmax` set scales[head] / 448 (f32 epsilon where
// that is 0): the KV cache's static per-head scales, or the simulation's dynamic ones.
template <typename T>
__device__ void qdq_fp8_heads(const T* x, T* out, long n, int heads, long inner,
                              const float* scales, int absmax) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float scale = scales[(i / inner) % heads];
    if (absmax) scale = fp8_scale_of(scale);
    const float q = fminf(fmaxf(to_f32(x[i]) / scale + 0.0f, -448.0f), 448.0f);
    out[i] = from_f32<T>(round_to_grid(q, -6, 3) * scale);
}

// nvfp4: one thread per group of 16 values, read and written as vectors (x and out 16-byte
// aligned, checked by the caller).
template <typename T>
__device__ void qdq_nvfp4(const T* x, T* out, long groups, float global_scale) {
    long g = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    Pack<T, 16> v = reinterpret_cast<const Pack<T, 16>*>(x)[g];
    float lo = 0.0f, hi = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float f = to_f32(v.v[i]);
        lo = fminf(lo, f);
        hi = fmaxf(hi, f);
    }
    float s = global_scale * (fmaxf(fabsf(lo), fabsf(hi)) / 6.0f);
    s = round_to_grid(fminf(fmaxf(s, -448.0f), 448.0f), -6, 3);
    if (s == 0.0f) s = 0.125f;
    float eff = s / global_scale;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float q = fminf(fmaxf(to_f32(v.v[i]) / eff + 0.0f, -6.0f), 6.0f);
        v.v[i] = from_f32<T>(round_to_grid(q, 0, 1) * eff);
    }
    reinterpret_cast<Pack<T, 16>*>(out)[g] = v;
}

// ---- extern "C" entry points, one per dtype -------------------------------------------------

// The int kernels, one per dtype T, scale dtype S (SS in the name: `_s{f32,bf16,f16}`) and
// zero-point type Z (ZS: `` for int32 or none, `_z8` for a byte each).
#define DEQUANT_INT_ENTRIES(SUFFIX, T, SS, S, ZS, Z)                                               \
    extern "C" __global__ void dequant_int_s##SS##ZS##_##SUFFIX(                                   \
        const int32_t* p, const S* s, const Z* z, T* o, int rows, int cols, int wpr, int bits,     \
        int g, const uint32_t* gi, int groups) {                                                   \
        dequant_int<T, S, Z>(p, s, z, o, rows, cols, wpr, bits, g, gi, groups);                    \
    }                                                                                              \
    extern "C" __global__ void dequant_int4_words_s##SS##ZS##_##SUFFIX(                            \
        const int32_t* p, const S* s, const Z* z, T* o, int rows, int cols, int g) {               \
        dequant_int_words<T, S, Z, 4>(p, s, z, o, rows, cols, g, blockIdx.x, blockIdx.y);          \
    }                                                                                              \
    extern "C" __global__ void dequant_int8_words_s##SS##ZS##_##SUFFIX(                            \
        const int32_t* p, const S* s, const Z* z, T* o, int rows, int cols, int g) {               \
        dequant_int_words<T, S, Z, 8>(p, s, z, o, rows, cols, g, blockIdx.x, blockIdx.y);          \
    }                                                                                              \
    extern "C" __global__ void dequant_int4_words_stacked_s##SS##ZS##_##SUFFIX(                    \
        const uint64_t* ptrs, T* o, int rows, int cols, int g) {                                   \
        dequant_int_words_stacked<T, S, Z, 4>(ptrs, o, rows, cols, g);                             \
    }                                                                                              \
    extern "C" __global__ void dequant_int8_words_stacked_s##SS##ZS##_##SUFFIX(                    \
        const uint64_t* ptrs, T* o, int rows, int cols, int g) {                                   \
        dequant_int_words_stacked<T, S, Z, 8>(ptrs, o, rows, cols, g);                             \
    }
#define DEQUANT_INT_ZERO_POINTS(SUFFIX, T, SS, S)          \
    DEQUANT_INT_ENTRIES(SUFFIX, T, SS, S, , int32_t)      \
    DEQUANT_INT_ENTRIES(SUFFIX, T, SS, S, _z8, int8_t)
#define DEQUANT_INT_ALL_SCALES(SUFFIX, T)                  \
    DEQUANT_INT_ZERO_POINTS(SUFFIX, T, f32, float)         \
    DEQUANT_INT_ZERO_POINTS(SUFFIX, T, bf16, __nv_bfloat16) \
    DEQUANT_INT_ZERO_POINTS(SUFFIX, T, f16, __half)

#define DEQUANT_ENTRIES(SUFFIX, T)                                                                 \
    DEQUANT_INT_ALL_SCALES(SUFFIX, T)                                                              \
    extern "C" __global__ void dequant_nvfp4_##SUFFIX(const uint8_t* p, const uint8_t* s, float pt, \
                                                      int mul, T* o, int rows, int cols) {         \
        dequant_nvfp4<T>(p, s, pt, mul, o, rows, cols);                                            \
    }                                                                                              \
    extern "C" __global__ void dequant_fp8_##SUFFIX(const uint8_t* c, const float* s, T* o, int rows, \
                                                    int cols, int br, int bc, int sc) {            \
        dequant_fp8<T>(c, s, o, rows, cols, br, bc, sc);                                           \
    }                                                                                              \
    extern "C" __global__ void qdq_fp8_token_##SUFFIX(const T* x, T* o, int k, float static_scale) { \
        qdq_fp8_token<T, 1>(x, o, k, static_scale);                                                \
    }                                                                                              \
    extern "C" __global__ void qdq_fp8_token_v8_##SUFFIX(const T* x, T* o, int k,                  \
                                                         float static_scale) {                     \
        qdq_fp8_token<T, 8>(x, o, k, static_scale);                                                \
    }                                                                                              \
    extern "C" __global__ void qdq_nvfp4_##SUFFIX(const T* x, T* o, long groups, float gs) {       \
        qdq_nvfp4<T>(x, o, groups, gs);                                                            \
    }                                                                                              \
    extern "C" __global__ void qdq_int8_token_##SUFFIX(const T* x, T* o, int k) {                  \
        qdq_int8_token<T>(x, o, k);                                                                \
    }                                                                                              \
    extern "C" __global__ void qdq_fp8_group_##SUFFIX(const T* x, T* o, int k, int group,         \
                                                      int pow2) {                                  \
        qdq_fp8_group<T>(x, o, k, group, pow2);                                                    \
    }                                                                                              \
    extern "C" __global__ void qdq_fp8_heads_##SUFFIX(const T* x, T* o, long n, int heads,         \
                                                      long inner, const float* s, int absmax) {    \
        qdq_fp8_heads<T>(x, o, n, heads, inner, s, absmax);                                        \
    }

DEQUANT_ENTRIES(f32, float)
DEQUANT_ENTRIES(bf16, __nv_bfloat16)
DEQUANT_ENTRIES(f16, __half)

INT4_GEMM_ENTRIES(, IgMmaSync)
