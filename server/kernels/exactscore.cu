// ExactScore CUDA kernels: dequantization of compressed-tensors weights, activation QDQ and
// fused scoring (log-softmax + gather + argmax + top-k). Every kernel mirrors a CPU reference in
// server/src/quant or server/src/model/scoring.rs; all arithmetic is IEEE f32 (no fast math), so
// dequantization and QDQ are bit-identical to the CPU path.
#include "common.cuh"

// Minifloat decoding by building the f32 bit pattern: every e4m3 and e2m1 value is exact in f32,
// so this equals the CPU reference (quant/minifloat.rs) bit for bit, without table lookups
// (a __constant__ table serialises a warp whose lanes read different entries) or ldexpf.
__device__ __forceinline__ float fp8_e4m3_to_f32(uint8_t b) {
    uint32_t exp = (b >> 3) & 0xF, man = b & 7;
    float mag;
    if (exp == 0) mag = (float)man * 0.001953125f;  // man * 2^-9
    else if (exp == 15 && man == 7) mag = __int_as_float(0x7fc00000);
    else mag = __uint_as_float(((exp + 120) << 23) | (man << 20));  // (1 + man / 8) * 2^(exp - 7)
    return (b & 0x80) ? -mag : mag;
}

__device__ __forceinline__ float fp4_e2m1_to_f32(uint32_t nibble) {
    uint32_t exp = (nibble >> 1) & 3, man = nibble & 1;
    // exp 0: 0 or 0.5; else (1 + man / 2) * 2^(exp - 1)
    float mag = exp == 0 ? 0.5f * man : __uint_as_float(((exp + 126) << 23) | (man << 22));
    return (nibble & 8) ? -mag : mag;
}

// Round to nearest even on a float grid with `mant` explicit bits and smallest normal exponent
// `min_exp` (see quant/minifloat.rs: round_to_grid). The grid step is 2^e with -9 <= e <= 124
// here, so 2^e and 2^-e are normal floats built from exponent bits and x * 2^-e equals x / 2^e
// exactly: no division and no ldexpf, which made the activation QDQ compute-bound.
__device__ __forceinline__ float round_to_grid(float x, int min_exp, int mant) {
    if (x == 0.0f || !isfinite(x)) return x;
    int binade = (int)((__float_as_uint(x) >> 23) & 0xFF) - 127;
    int e = max(binade, min_exp) - mant;
    float step = __uint_as_float((uint32_t)(e + 127) << 23);
    float inv_step = __uint_as_float((uint32_t)(127 - e) << 23);
    return copysignf(rintf(x * inv_step) * step, x);
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// ---- dequantization: one thread per packed word / byte -------------------------------------

// pack-quantized int4/int8: w = (q - zp) * scale. `zps` may be null (symmetric).
template <typename T>
__device__ void dequant_int(const int32_t* packed, const float* scales, const int32_t* zps, T* out,
                            int rows, int cols, int words_per_row, int bits, int group) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)rows * words_per_row) return;
    int r = idx / words_per_row;
    int w = idx % words_per_row;
    uint32_t word = (uint32_t)packed[idx];
    int per = 32 / bits;
    uint32_t mask = (1u << bits) - 1;
    int offset = 1 << (bits - 1);
    int groups = cols / group;
    for (int i = 0; i < per; ++i) {
        int c = w * per + i;
        if (c >= cols) break;
        int g = r * groups + c / group;
        int q = (int)((word >> (i * bits)) & mask) - offset;
        int zp = zps ? zps[g] : 0;
        out[(long)r * cols + c] = from_f32<T>((float)(q - zp) * scales[g]);
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
template <typename T, int BITS>
__device__ void dequant_int_words(const int32_t* packed, const float* scales, const int32_t* zps, T* out,
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
        float s = scales[g];
        int zp = zps ? zps[g] : 0;
        Pack<T, PER> p;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            int q = (int)((words[j] >> (i * BITS)) & ((1u << BITS) - 1)) - (1 << (BITS - 1));
            p.v[i] = from_f32<T>((float)(q - zp) * s);
        }
        *reinterpret_cast<Pack<T, PER>*>(out + (long)r * cols + c0) = p;
    }
}

template <typename T, int BITS>
__device__ void dequant_int_words_stacked(const uint64_t* ptrs, T* out, int rows, int cols, int group) {
    const uint64_t* p = ptrs + 3 * blockIdx.z;
    dequant_int_words<T, BITS>((const int32_t*)p[0], (const float*)p[1], (const int32_t*)p[2],
                               out + (long)blockIdx.z * rows * cols, rows, cols, group, blockIdx.x,
                               blockIdx.y);
}

// nvfp4: w = bf16(fp4(code) * (fp8(scale) / global)), two codes per byte, low nibble first.
// One thread per group of 16 weights (8 bytes, one scale).
template <typename T>
__device__ void dequant_nvfp4(const uint8_t* packed, const uint8_t* scales, float global_scale, T* out,
                              int rows, int cols) {
    long g = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long)rows * (cols / 16)) return;
    float s = fp8_e4m3_to_f32(scales[g]) / global_scale;
    uint2 bytes = reinterpret_cast<const uint2*>(packed)[g];
    Pack<T, 16> p;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        uint8_t b = ((i < 4 ? bytes.x : bytes.y) >> ((i % 4) * 8)) & 0xFF;
        p.v[2 * i] = from_f32<T>(bf16_round(fp4_e2m1_to_f32(b & 0xF) * s));
        p.v[2 * i + 1] = from_f32<T>(bf16_round(fp4_e2m1_to_f32(b >> 4) * s));
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

// ---- per-token fp8 QDQ, as a kernel and as the last step of the RMSNorm and SwiGLU kernels ----
// One block of 256 threads per row of k values; each thread handles VEC values per step at
// tid * VEC + n * 256 * VEC.

// The row's scale from each thread's largest |value| (block-wide max / 448; the max does not
// depend on the order it is reduced in, so every VEC and every caller gets the same bits).
__device__ __forceinline__ float fp8_token_scale(float amax) {
    __shared__ float s_max[32];
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    if (threadIdx.x % 32 == 0) s_max[threadIdx.x / 32] = amax;
    __syncthreads();
    for (int w = 0; w < 256 / 32; ++w) amax = fmaxf(amax, s_max[w]);
    float scale = amax / 448.0f;
    return scale == 0.0f ? 1.1920929e-07f : scale;
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

// ---- fused scoring: one block (256 threads) per row -----------------------------------------

#define SCORE_THREADS 256
#define MAX_TOP_K 20

__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
    return a > b || (a == b && ia < ib);
}

// Block-wide best (value, lowest index on ties), broadcast to every thread.
__device__ void block_best(float& v, int& i, float* s_val, int* s_idx) {
    int tid = threadIdx.x;
    s_val[tid] = v;
    s_idx[tid] = i;
    __syncthreads();
    for (int s = SCORE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s && better(s_val[tid + s], s_idx[tid + s], s_val[tid], s_idx[tid])) {
            s_val[tid] = s_val[tid + s];
            s_idx[tid] = s_idx[tid + s];
        }
        __syncthreads();
    }
    v = s_val[0];
    i = s_idx[0];
    __syncthreads();
}

// A running log-sum-exp: the largest value seen and the sum of exp(v - max) over the values.
struct Lse {
    float max, sum;
};

// The largest of N values as lse_add and the argmax need it: fmaxf from v[0] on, so NaN is
// skipped unless every value is NaN.
template <int N>
__device__ __forceinline__ float vector_max(const float (&v)[N]) {
    float m = v[0];
#pragma unroll
    for (int j = 1; j < N; ++j) m = fmaxf(m, v[j]);
    return m;
}

// Adds N values whose vector_max is `m`: one rescale per call at most, and N independent
// exponentials (one per value, each against one running max, as a serial per-value update
// would have chained them).
template <int N>
__device__ __forceinline__ void lse_add(Lse& a, const float (&v)[N], float m) {
    if (m == -INFINITY) return;  // nothing to add (also keeps exp(-inf - -inf) out)
    if (m > a.max) {
        a.sum *= expf(a.max - m);
        a.max = m;
    }
    float e[N];
#pragma unroll
    for (int j = 0; j < N; ++j) e[j] = expf(v[j] - a.max);
    // pairwise, so that the additions do not wait on each other either
#pragma unroll
    for (int w = 1; w < N; w *= 2) {
#pragma unroll
        for (int j = 0; j + w < N; j += 2 * w) e[j] += e[j + w];
    }
    a.sum += e[0];
}

__device__ __forceinline__ Lse lse_merge(Lse a, Lse b) {
    const float m = fmaxf(a.max, b.max);
    if (m == -INFINITY) return a;
    return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// The `limit` (<= CAP) best values of a row with their ids, best first (lowest id on ties): each
// thread keeps its own sorted list, then `limit` rounds of a block-wide best over the lists'
// heads, whose owner advances. Every thread calls `found(k, value, id)` for round k. Ids past a
// row shorter than `limit` are 0x7fffffff. `s_val`, `s_idx`: the caller's shared scratch.
template <int CAP, typename T, typename Found>
__device__ void block_top(const T* row, int vocab, int limit, float* s_val, int* s_idx,
                          Found found) {
    __shared__ int s_owner[SCORE_THREADS];
    const int tid = threadIdx.x;
    float vals[CAP];
    int ids[CAP];
    int n = 0;
    for (int i = tid; i < vocab; i += SCORE_THREADS) {
        float v = to_f32(row[i]);
        if (n == limit && !better(v, i, vals[n - 1], ids[n - 1])) continue;
        int at = n < limit ? n++ : n - 1;
        while (at > 0 && better(v, i, vals[at - 1], ids[at - 1])) {
            vals[at] = vals[at - 1];
            ids[at] = ids[at - 1];
            --at;
        }
        vals[at] = v;
        ids[at] = i;
    }
    int head = 0;
    for (int k = 0; k < limit; ++k) {
        s_val[tid] = head < n ? vals[head] : -INFINITY;
        s_idx[tid] = head < n ? ids[head] : 0x7fffffff;
        s_owner[tid] = tid;
        __syncthreads();
        for (int s = SCORE_THREADS / 2; s > 0; s >>= 1) {
            if (tid < s && better(s_val[tid + s], s_idx[tid + s], s_val[tid], s_idx[tid])) {
                s_val[tid] = s_val[tid + s];
                s_idx[tid] = s_idx[tid + s];
                s_owner[tid] = s_owner[tid + s];
            }
            __syncthreads();
        }
        found(k, s_val[0], s_idx[0]);
        if (tid == s_owner[0]) ++head;
        __syncthreads();
    }
}

// Per row: log-softmax over the vocabulary (f32), log p(target), argmax (lowest id on ties) and
// the top-k. `targets[row] < 0` means no target. Only these small vectors leave the GPU.
// One pass over the row gives the argmax and the log-sum-exp (online, as flash attention
// rescales its sums), read as VEC-value vectors (VEC 8: vocab and the row start multiples of
// 8); the top-k, when asked for, takes a second pass.
template <typename T, int VEC>
__device__ void score_rows(const T* logits, int vocab, const int32_t* targets, int top_k,
                           float* target_lp, int32_t* argmax_id, float* argmax_lp,
                           int32_t* topk_id, float* topk_lp) {
    using V = Pack<T, VEC>;
    __shared__ float s_val[SCORE_THREADS];
    __shared__ int s_idx[SCORE_THREADS];
    __shared__ Lse s_part[SCORE_THREADS / 32];
    __shared__ float s_lse;
    const T* row = logits + (long)blockIdx.x * vocab;
    int tid = threadIdx.x;

    float best = -INFINITY;
    int best_i = 0x7fffffff;
    Lse lse = {-INFINITY, 0.0f};
    for (int i = tid * VEC; i < vocab; i += SCORE_THREADS * VEC) {
        const V x = *reinterpret_cast<const V*>(row + i);
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = to_f32(x.v[j]);
        const float m = vector_max(v);
        // A thread's indices only grow, so a vector can only hold a better value when its max is
        // at least the best so far (NaN compares false, and `better` never picks one); rare
        // after the first vectors, so the exact per-value comparison runs only then.
        if (m >= best) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                if (better(v[j], i + j, best, best_i)) {
                    best = v[j];
                    best_i = i + j;
                }
            }
        }
        lse_add(lse, v, m);
    }
    for (int o = 16; o > 0; o >>= 1)
        lse = lse_merge(lse, {__shfl_xor_sync(0xffffffff, lse.max, o), __shfl_xor_sync(0xffffffff, lse.sum, o)});
    if (tid % 32 == 0) s_part[tid / 32] = lse;
    block_best(best, best_i, s_val, s_idx);  // its barriers also publish s_part
    const float max_v = best;
    const int max_i = best_i;

    if (tid == 0) {
        Lse total = s_part[0];
        for (int w = 1; w < SCORE_THREADS / 32; ++w) total = lse_merge(total, s_part[w]);
        const float lse_v = total.max + logf(total.sum);
        s_lse = lse_v;
        int t = targets[blockIdx.x];
        target_lp[blockIdx.x] = t >= 0 ? to_f32(row[t]) - lse_v : NAN;
        argmax_id[blockIdx.x] = max_i;
        argmax_lp[blockIdx.x] = max_v - lse_v;
    }
    if (top_k <= 0) return;
    __syncthreads();

    block_top<MAX_TOP_K>(row, vocab, top_k, s_val, s_idx, [&](int k, float v, int id) {
        if (tid == 0) {
            topk_id[(long)blockIdx.x * top_k + k] = id;
            topk_lp[(long)blockIdx.x * top_k + k] = v - s_lse;
        }
    });
}

// ---- KL-divergence: one block (256 threads) per row of both models' logits --------------------

// Block-wide sum in f64, broadcast to every thread (fixed order: deterministic).
__device__ double block_sum(double v, double* s_sum) {
    int tid = threadIdx.x;
    s_sum[tid] = v;
    __syncthreads();
    for (int s = SCORE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_sum[tid] += s_sum[tid + s];
        __syncthreads();
    }
    double total = s_sum[0];
    __syncthreads();
    return total;
}

// The KLD_TOP best ids of a row (block_top; mirrors model/kld.rs: top_ids_and_lse). Thread
// 0 writes `out` (shared); every thread gets the best value back.
#define KLD_TOP 5
template <typename T>
__device__ float block_top_ids(const T* row, int vocab, float* s_val, int* s_idx, int* out) {
    float best = -INFINITY;
    block_top<KLD_TOP>(row, vocab, KLD_TOP, s_val, s_idx, [&](int k, float v, int id) {
        if (k == 0) best = v;
        if (threadIdx.x == 0) out[k] = id;
    });
    return best;
}

// Bit K - 1 set when the first K ids of both lists are the same set, K = 1..KLD_TOP.
__device__ int top_k_agreement(const int* a, const int* b) {
    int mask = 0;
    for (int k = 1; k <= KLD_TOP; ++k) {
        bool same = true;
        for (int i = 0; i < k; ++i) {
            bool found = false;
            for (int j = 0; j < k; ++j) found |= a[i] == b[j];
            same &= found;
        }
        mask |= (int)same << (k - 1);
    }
    return mask;
}

// Per row: KL(reference || model) = sum_v p_ref(v) (log p_ref(v) - log p_model(v)) and the
// reverse KL(model || reference), from the f32 logits of both models, with the log-sum-exps and
// the sums in f64 (mirrors model/kld.rs: kld_row); identical rows give exactly 0. Also both
// models' log p(target), argmax ids, the top-K agreement mask and the reference's top-token
// probability: only these per-row numbers leave the GPU.
template <typename T>
__device__ void kld_rows(const T* ref_logits, const T* logits, int vocab, const int32_t* targets,
                         double* kld, double* reverse_kld, double* ref_top_p, float* lp,
                         float* ref_lp, int32_t* top, int32_t* ref_top, int32_t* agreement) {
    __shared__ float s_val[SCORE_THREADS];
    __shared__ int s_idx[SCORE_THREADS];
    __shared__ double s_sum[SCORE_THREADS];
    __shared__ int s_top_r[KLD_TOP], s_top_m[KLD_TOP];
    const T* r = ref_logits + (long)blockIdx.x * vocab;
    const T* m = logits + (long)blockIdx.x * vocab;
    int tid = threadIdx.x;

    const float best_r = block_top_ids(r, vocab, s_val, s_idx, s_top_r);
    const float best_m = block_top_ids(m, vocab, s_val, s_idx, s_top_m);

    double sum_r = 0.0, sum_m = 0.0;
    for (int i = tid; i < vocab; i += SCORE_THREADS) {
        sum_r += exp((double)(to_f32(r[i]) - best_r));
        sum_m += exp((double)(to_f32(m[i]) - best_m));
    }
    double lse_r = best_r + log(block_sum(sum_r, s_sum));
    double lse_m = best_m + log(block_sum(sum_m, s_sum));

    double kl = 0.0, reverse = 0.0;
    for (int i = tid; i < vocab; i += SCORE_THREADS) {
        double log_p_ref = (double)to_f32(r[i]) - lse_r;
        double log_p = (double)to_f32(m[i]) - lse_m;
        kl += exp(log_p_ref) * (log_p_ref - log_p);
        reverse += exp(log_p) * (log_p - log_p_ref);
    }
    kl = block_sum(kl, s_sum);
    reverse = block_sum(reverse, s_sum);
    if (tid == 0) {
        int row = blockIdx.x, t = targets[row];
        kld[row] = kl;
        reverse_kld[row] = reverse;
        ref_top_p[row] = exp((double)best_r - lse_r);
        lp[row] = (float)((double)to_f32(m[t]) - lse_m);
        ref_lp[row] = (float)((double)to_f32(r[t]) - lse_r);
        top[row] = s_top_m[0];
        ref_top[row] = s_top_r[0];
        agreement[row] = top_k_agreement(s_top_r, s_top_m);
    }
}

// ---- attention: fused scale + causal (sliding-window) mask + softmax over f32 scores ----------

// `scores` is [heads * t, t] (row = head * t + query). Out-of-window entries become 0.
template <typename T>
__device__ void causal_softmax(const float* scores, T* out, int t, float scale, int window) {
    __shared__ float s_red[SCORE_THREADS];
    long row = blockIdx.x;
    int i = row % t;
    int lo = window > 0 ? max(0, i - window + 1) : 0;
    const float* src = scores + row * t;
    T* dst = out + row * t;
    int tid = threadIdx.x;
    float m = -INFINITY;
    for (int j = lo + tid; j <= i; j += SCORE_THREADS) m = fmaxf(m, src[j] * scale);
    s_red[tid] = m;
    __syncthreads();
    for (int s = SCORE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_red[tid] = fmaxf(s_red[tid], s_red[tid + s]);
        __syncthreads();
    }
    m = s_red[0];
    __syncthreads();
    float sum = 0.0f;
    for (int j = lo + tid; j <= i; j += SCORE_THREADS) sum += expf(src[j] * scale - m);
    s_red[tid] = sum;
    __syncthreads();
    for (int s = SCORE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_red[tid] += s_red[tid + s];
        __syncthreads();
    }
    sum = s_red[0];
    for (int j = tid; j < t; j += SCORE_THREADS)
        dst[j] = from_f32<T>((j >= lo && j <= i) ? expf(src[j] * scale - m) / sum : 0.0f);
}

// ---- RMSNorm: one block (256 threads) per row ---------------------------------------------

// The sum of every thread's `v` (SCORE_THREADS threads), broadcast: a tree that adds value
// tid + s to value tid for s = 128, 64, ..., 1. The last five levels run inside warp 0 through
// shuffles, which pair the same values in the same order as shared memory did (same bits), with
// four barriers instead of nine.
__device__ float tree_sum(float v, float* s_red) {
    const int tid = threadIdx.x;
    s_red[tid] = v;
    __syncthreads();
    for (int s = SCORE_THREADS / 2; s >= 32; s >>= 1) {
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
    __shared__ float s_red[SCORE_THREADS];
    const long base = (long)blockIdx.x * cols;
    const int tid = threadIdx.x;
    float squares = 0.0f;
    for (int i = tid * VEC; i < cols; i += SCORE_THREADS * VEC) {
        const V h = *reinterpret_cast<const V*>(x + base + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) squares += to_f32(h.v[j]) * to_f32(h.v[j]);
    }
    const float inv = rsqrtf(tree_sum(squares, s_red) / cols + eps);
    float amax = 0.0f;
    for (int i = tid * VEC; i < cols; i += SCORE_THREADS * VEC) {
        const V hv = *reinterpret_cast<const V*>(x + base + i);
        const Pack<W, VEC> w = *reinterpret_cast<const Pack<W, VEC>*>(weight + i);
        V o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            o.v[j] = from_f32<T>(to_f32(hv.v[j]) * inv * to_f32(w.v[j]));
            if (FP8_QDQ) amax = fmaxf(amax, fabsf(to_f32(o.v[j])));
        }
        *reinterpret_cast<V*>(out + base + i) = o;
    }
    // the input of the Linears that read this norm, when they all quantize it per token to fp8
    if (FP8_QDQ) fp8_qdq_row<T, VEC>(out + base, out + base, cols, fp8_token_scale(amax));
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

// ---- embedding lookup: out[i] = table[ids[i]], rows of `cols` values; one thread per value ---

template <typename T>
__device__ void gather_rows(const T* table, const uint32_t* ids, T* out, int cols, long n) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    out[idx] = table[(long)ids[idx / cols] * cols + idx % cols];
}

// ---- mixture of experts ----------------------------------------------------------------------

// Router, one warp per token: softmax in f32 over `experts` logits (each lane holds experts
// lane, lane + 32, ...), the top `k` by probability (ties to the lowest expert id, as a stable
// sort), renormalised to sum 1 when `norm`, summed in the order chosen. A token with a NaN
// probability gets the id `experts` everywhere, which the caller refuses.
constexpr int MOE_MAX_PER_LANE = 16;  // up to 512 experts

__device__ __forceinline__ bool moe_before(float p, int e, float q, int f) {
    return p > q || (p == q && e < f);
}

template <typename T>
__device__ void moe_topk(const T* logits, int experts, int k, int norm, uint32_t* ids,
                         float* weights, int rows) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (warp >= rows) return;
    const T* l = logits + (long)warp * experts;
    float p[MOE_MAX_PER_LANE];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < MOE_MAX_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        p[i] = e < experts ? to_f32(l[e]) : -INFINITY;
        m = fmaxf(m, p[i]);
    }
    for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, s));
    float sum = 0.0f;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < MOE_MAX_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        if (e < experts) {
            p[i] = expf(p[i] - m);
            sum += p[i];
            nan |= isnan(p[i]);
        }
    }
    for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, s);
    nan = __any_sync(0xffffffff, nan) || isnan(sum);
#pragma unroll
    for (int i = 0; i < MOE_MAX_PER_LANE; ++i) p[i] = lane + 32 * i < experts ? p[i] / sum : -1.0f;
    float total = 0.0f;
    for (int j = 0; j < k; ++j) {
        float best = -1.0f;
        int best_e = experts;
#pragma unroll
        for (int i = 0; i < MOE_MAX_PER_LANE; ++i)
            if (moe_before(p[i], lane + 32 * i, best, best_e)) { best = p[i]; best_e = lane + 32 * i; }
        for (int s = 16; s > 0; s >>= 1) {
            const float q = __shfl_xor_sync(0xffffffff, best, s);
            const int f = __shfl_xor_sync(0xffffffff, best_e, s);
            if (moe_before(q, f, best, best_e)) { best = q; best_e = f; }
        }
#pragma unroll
        for (int i = 0; i < MOE_MAX_PER_LANE; ++i)
            if (lane + 32 * i == best_e) p[i] = -1.0f;  // taken
        total += best;
        if (lane == 0) {
            ids[(long)warp * k + j] = nan ? (uint32_t)experts : (uint32_t)best_e;
            weights[(long)warp * k + j] = best;
        }
    }
    if (norm && lane == 0)
        for (int j = 0; j < k; ++j) weights[(long)warp * k + j] /= total;
}

// out[t] = residual[t] + (((0 + w_0 y[pos[t][0]]) + w_1 y[pos[t][1]]) + ...): a token's
// expert outputs weighted by their router weights (in f32 and rounded to T, or, with
// `compute_dtype_weights`, by the weight rounded to T), summed in the order of `pos` (ascending
// expert), every add rounded to T (an add in f32 rounded once is the correctly rounded add in
// bf16/f16), as a weighted multiply, an index_add into zeros and the residual add give it. One
// thread per output value.
template <typename T>
__device__ void moe_combine(const T* y, const float* w, const uint32_t* pos, const T* residual,
                            T* out, int k, int cols, int compute_dtype_weights, long n) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    const long t = idx / cols;
    const int c = idx % cols;
    T acc = from_f32<T>(0.0f);
    for (int j = 0; j < k; ++j) {
        const long row = pos[t * k + j];
        const float weight = compute_dtype_weights ? to_f32(from_f32<T>(w[row])) : w[row];
        const T term = from_f32<T>(to_f32(y[row * cols + c]) * weight);
        acc = from_f32<T>(to_f32(acc) + to_f32(term));
    }
    out[idx] = from_f32<T>(to_f32(residual[idx]) + to_f32(acc));
}

// ---- /diff: per row of two f32 states, (Σ a·b, Σ a², Σ b², Σ (a − b)²) in f64 -----------------
// One 256-thread block per row. Products of two f32 values are exact in f64, so the sums differ
// from any other f64 order by f64 rounding alone.
extern "C" __global__ void row_pair_sums(const float* a, const float* b, double* out, int cols) {
    __shared__ double s_red[4][SCORE_THREADS];
    const long base = (long)blockIdx.x * cols;
    const int tid = threadIdx.x;
    double v[4] = {0.0, 0.0, 0.0, 0.0};
    for (int i = tid; i < cols; i += SCORE_THREADS) {
        const double x = a[base + i], y = b[base + i], d = x - y;
        v[0] += x * y;
        v[1] += x * x;
        v[2] += y * y;
        v[3] += d * d;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) s_red[q][tid] = v[q];
    __syncthreads();
    for (int s = SCORE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s)
#pragma unroll
            for (int q = 0; q < 4; ++q) s_red[q][tid] += s_red[q][tid + s];
        __syncthreads();
    }
    if (tid < 4) out[(long)blockIdx.x * 4 + tid] = s_red[tid][0];
}

// ---- f32 GEMM with one summation order: out = x · wᵀ ------------------------------------------
//
// x [m, k] and w [n, k] row-major (both contiguous in k), out [m, n]. Every output is accumulated
// by fmaf over k = 0, 1, ..., k - 1 starting from 0, whatever m and n and wherever the output
// lies in its tile: a row's result depends on that row and w alone. cuBLAS picks its kernel
// (some of which split k) by the shape, so a token's f32 numbers changed with the number of
// tokens in its batch; with this kernel a sequence scores to the same bits alone and in any
// batch. The CPU reference is the sequential fused multiply-add (quant/gemm.rs).
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

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    matmul_t_f32(const float* x, const float* w, float* o, int m, int n, int k) {
    matmul_t_f32<false>(x, w, o, m, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    matmul_t_f32_v4(const float* x, const float* w, float* o, int m, int n, int k) {
    matmul_t_f32<true>(x, w, o, m, n, k);
}

// ---- extern "C" entry points, one per dtype -------------------------------------------------

#define DEQUANT_ENTRY(SUFFIX, T)                                                                     \
    extern "C" __global__ void dequant_int_##SUFFIX(const int32_t* p, const float* s, const int32_t* z, \
                                                    T* o, int rows, int cols, int wpr, int bits, int g) { \
        dequant_int<T>(p, s, z, o, rows, cols, wpr, bits, g);                                        \
    }                                                                                                \
    extern "C" __global__ void dequant_int4_words_##SUFFIX(const int32_t* p, const float* s, const int32_t* z, \
                                                           T* o, int rows, int cols, int g) {        \
        dequant_int_words<T, 4>(p, s, z, o, rows, cols, g, blockIdx.x, blockIdx.y);                  \
    }                                                                                                \
    extern "C" __global__ void dequant_int8_words_##SUFFIX(const int32_t* p, const float* s, const int32_t* z, \
                                                           T* o, int rows, int cols, int g) {        \
        dequant_int_words<T, 8>(p, s, z, o, rows, cols, g, blockIdx.x, blockIdx.y);                  \
    }                                                                                                \
    extern "C" __global__ void dequant_int4_words_stacked_##SUFFIX(const uint64_t* ptrs, T* o, int rows, \
                                                                   int cols, int g) {                \
        dequant_int_words_stacked<T, 4>(ptrs, o, rows, cols, g);                                     \
    }                                                                                                \
    extern "C" __global__ void dequant_int8_words_stacked_##SUFFIX(const uint64_t* ptrs, T* o, int rows, \
                                                                   int cols, int g) {                \
        dequant_int_words_stacked<T, 8>(ptrs, o, rows, cols, g);                                     \
    }                                                                                                \
    extern "C" __global__ void dequant_nvfp4_##SUFFIX(const uint8_t* p, const uint8_t* s, float gs,  \
                                                      T* o, int rows, int cols) {                    \
        dequant_nvfp4<T>(p, s, gs, o, rows, cols);                                                   \
    }                                                                                                \
    extern "C" __global__ void dequant_fp8_##SUFFIX(const uint8_t* c, const float* s, T* o, int rows, \
                                                    int cols, int br, int bc, int sc) {              \
        dequant_fp8<T>(c, s, o, rows, cols, br, bc, sc);                                             \
    }                                                                                                \
    extern "C" __global__ void qdq_fp8_token_##SUFFIX(const T* x, T* o, int k, float static_scale) { \
        qdq_fp8_token<T, 1>(x, o, k, static_scale);                                                  \
    }                                                                                                \
    extern "C" __global__ void qdq_fp8_token_v8_##SUFFIX(const T* x, T* o, int k,                    \
                                                         float static_scale) {                       \
        qdq_fp8_token<T, 8>(x, o, k, static_scale);                                                  \
    }                                                                                                \
    extern "C" __global__ void qdq_nvfp4_##SUFFIX(const T* x, T* o, long groups, float gs) {       \
        qdq_nvfp4<T>(x, o, groups, gs);                                                              \
    }                                                                                                \
    extern "C" __global__ void rms_norm_##SUFFIX(const T* x, const T* w, T* o, int cols, float eps) { \
        rms_norm<T, T, 1, false>(x, w, o, cols, eps);                                                \
    }                                                                                                \
    extern "C" __global__ void rms_norm_v8_##SUFFIX(const T* x, const T* w, T* o, int cols,          \
                                                    float eps) {                                     \
        rms_norm<T, T, 8, false>(x, w, o, cols, eps);                                                \
    }                                                                                                \
    extern "C" __global__ void rms_norm_v8_fp8_qdq_##SUFFIX(const T* x, const T* w, T* o, int cols,  \
                                                            float eps) {                             \
        rms_norm<T, T, 8, true>(x, w, o, cols, eps);                                                 \
    }                                                                                                \
    extern "C" __global__ void rms_norm_f32w_##SUFFIX(const T* x, const float* w, T* o, int cols,    \
                                                      float eps) {                                   \
        rms_norm<T, float, 1, false>(x, w, o, cols, eps);                                            \
    }                                                                                                \
    extern "C" __global__ void rms_norm_f32w_v8_##SUFFIX(const T* x, const float* w, T* o, int cols, \
                                                         float eps) {                                \
        rms_norm<T, float, 8, false>(x, w, o, cols, eps);                                            \
    }                                                                                                \
    extern "C" __global__ void rms_norm_f32w_v8_fp8_qdq_##SUFFIX(const T* x, const float* w, T* o,   \
                                                                 int cols, float eps) {              \
        rms_norm<T, float, 8, true>(x, w, o, cols, eps);                                             \
    }                                                                                                \
    extern "C" __global__ void moe_topk_##SUFFIX(const T* l, int e, int k, int norm, uint32_t* ids,  \
                                                 float* w, int rows) {                               \
        moe_topk<T>(l, e, k, norm, ids, w, rows);                                                    \
    }                                                                                                \
    extern "C" __global__ void moe_combine_##SUFFIX(const T* y, const float* w, const uint32_t* pos,  \
                                                    const T* r, T* o, int k, int cols, int cw,       \
                                                    long n) {                                        \
        moe_combine<T>(y, w, pos, r, o, k, cols, cw, n);                                             \
    }                                                                                                \
    extern "C" __global__ void gather_rows_##SUFFIX(const T* table, const uint32_t* ids, T* o,        \
                                                    int cols, long n) {                              \
        gather_rows<T>(table, ids, o, cols, n);                                                      \
    }                                                                                                \
    extern "C" __global__ void silu_mul_##SUFFIX(const T* g, const T* u, T* o, long n) {             \
        glu_mul<T, Silu>(g, u, o, n);                                                                \
    }                                                                                                \
    extern "C" __global__ void silu_mul_fp8_qdq_##SUFFIX(const T* g, const T* u, T* o, int k) {      \
        glu_mul_fp8_qdq<T, Silu>(g, u, o, k);                                                        \
    }                                                                                                \
    extern "C" __global__ void gelu_tanh_mul_##SUFFIX(const T* g, const T* u, T* o, long n) {        \
        glu_mul<T, GeluTanh>(g, u, o, n);                                                            \
    }                                                                                                \
    extern "C" __global__ void gelu_tanh_mul_fp8_qdq_##SUFFIX(const T* g, const T* u, T* o, int k) { \
        glu_mul_fp8_qdq<T, GeluTanh>(g, u, o, k);                                                    \
    }                                                                                                \
    extern "C" __global__ void causal_softmax_##SUFFIX(const float* s, T* o, int t, float scale, int w) { \
        causal_softmax<T>(s, o, t, scale, w);                                                        \
    }                                                                                                \
    extern "C" __global__ void score_rows_##SUFFIX(const T* l, int vocab, const int32_t* t, int k,  \
                                                   float* tl, int32_t* ai, float* al, int32_t* ti,   \
                                                   float* tlp) {                                     \
        score_rows<T, 1>(l, vocab, t, k, tl, ai, al, ti, tlp);                                       \
    }                                                                                                \
    extern "C" __global__ void score_rows_v8_##SUFFIX(const T* l, int vocab, const int32_t* t, int k, \
                                                      float* tl, int32_t* ai, float* al, int32_t* ti, \
                                                      float* tlp) {                                  \
        score_rows<T, 8>(l, vocab, t, k, tl, ai, al, ti, tlp);                                       \
    }                                                                                                \
    extern "C" __global__ void kld_rows_##SUFFIX(const T* r, const T* l, int vocab, const int32_t* t, \
                                                 double* k, double* rk, double* rp, float* lp,       \
                                                 float* rlp, int32_t* top, int32_t* rtop,            \
                                                 int32_t* agree) {                                   \
        kld_rows<T>(r, l, vocab, t, k, rk, rp, lp, rlp, top, rtop, agree);                           \
    }

DEQUANT_ENTRY(f32, float)
DEQUANT_ENTRY(bf16, __nv_bfloat16)
DEQUANT_ENTRY(f16, __half)
