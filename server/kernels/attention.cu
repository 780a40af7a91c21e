// Attention for bf16/f16 compute on the GPU: RoPE in token-major layout and a flash-attention
// forward (causal, optional sliding window) that never materialises the [heads, T, T] scores.
// Both work on the projections' natural layout [tokens, heads, head_dim] for a whole batch of
// sequences at once (`starts`: prefix offsets of the sequences), so no transposes or GQA copies.
#include "common.cuh"

// ---- RoPE ------------------------------------------------------------------------------------

// transformers' `x * cos + rotate_half(x) * sin` with every product and the sum rounded to T,
// as PyTorch runs it in T (checked bitwise against a CPU transcription by `exactscore-bench
// check`). candle's rope kernel lets the compiler contract `x1 * c - x2 * s` into one FMA and so
// differs from PyTorch in the last bit of some values.
// One thread per (token, head, i < half); `pos[token]` is the token's position in its sequence.
template <typename T>
__device__ void rope_rotate_half(const T* x, T* out, const int32_t* pos, const T* cos,
                                 const T* sin, int heads, int half, long pairs) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= pairs) return;
    int i = idx % half;
    long row = idx / half;  // token * heads + head
    long token = row / heads;
    const T* src = x + row * 2 * half;
    T* dst = out + row * 2 * half;
    long t = (long)pos[token] * half + i;
    float c = to_f32(cos[t]), s = to_f32(sin[t]);
    float x1 = to_f32(src[i]), x2 = to_f32(src[i + half]);
    auto r = [](float v) { return to_f32(from_f32<T>(v)); };
    dst[i] = from_f32<T>(r(x1 * c) - r(x2 * s));
    dst[i + half] = from_f32<T>(r(x2 * c) + r(x1 * s));
}

// ---- flash attention ---------------------------------------------------------------------------
//
// One block = 64 query rows of one head of one sequence, 4 warps of 16 rows. Keys are processed
// in tiles of 64 with the online softmax (running max and sum in f32, base-2 exponentials).
// Q·Kᵀ and P·V run on tensor cores (mma.sync m16n8k16, f32 accumulation); P is rounded to T
// before P·V, the row sums use the unrounded f32 values (as FlashAttention-2 does).

#define FA_ROWS 64
#define FA_KEYS 64
#define FA_THREADS 128

template <typename T> struct Mma;
// mma.sync for one 16-bit input type, and packing two f32 into that type's pair register.
#define MMA_FOR(T, PTX_TYPE, PAIR, TO_PAIR)                                                           \
    template <> struct Mma<T> {                                                                   \
        static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0,      \
                                                   uint32_t b1) {                                 \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE          \
                         ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"         \
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                        \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));       \
        }                                                                                         \
        static __device__ __forceinline__ uint32_t pack(float lo, float hi) {                     \
            PAIR v = TO_PAIR(lo, hi);                                                             \
            return *reinterpret_cast<uint32_t*>(&v);                                              \
        }                                                                                         \
    };
MMA_FOR(__nv_bfloat16, "bf16", __nv_bfloat162, __floats2bfloat162_rn)
MMA_FOR(__half, "f16", __half2, __floats2half2_rn)

// Four 8x8 b16 matrices from shared memory, transposed: the B operand of P·V from row-major V.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ uint32_t lds32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

// 16-byte asynchronous copy global -> shared; `valid` false fills the 16 bytes with zeros.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// q: [tokens, hq, D], k and v: [tokens, hkv, D], out: [tokens, hq, D]; grid (query blocks of the
// longest sequence, hq, sequences). `scale_log2` = softmax scale * log2(e); `window` 0 = none.
template <typename T, int D>
__device__ void flash_attention(const T* __restrict__ q, const T* __restrict__ k,
                                const T* __restrict__ v, T* __restrict__ out,
                                const int32_t* __restrict__ starts, int hq, int hkv,
                                float scale_log2, int window) {
    constexpr int LD = D + 8;  // padded rows: conflict-free fragment loads and ldmatrix
    __shared__ __align__(16) T ks[FA_KEYS * LD];  // holds the Q tile first
    __shared__ __align__(16) T vs[FA_KEYS * LD];

    const int seq = blockIdx.z, head = blockIdx.y;
    const int start = starts[seq], len = starts[seq + 1] - start;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;  // the longest rows start first
    if (q0 >= len) return;
    const int kv_head = head / (hq / hkv);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const long q_stride = (long)hq * D, kv_stride = (long)hkv * D;

    // rows [row0, row0 + 64) of one head into shared memory, zeros past the sequence end; the
    // copy runs asynchronously until the next cp_async_wait
    auto load_tile = [&](T* dst, const T* src, long stride, int row0) {
        constexpr int VECS = D / 8;  // 16-byte vectors per row
        for (int i = tid; i < FA_KEYS * VECS; i += FA_THREADS) {
            int r = i / VECS, c = (i % VECS) * 8;
            bool valid = row0 + r < len;
            const T* from = src + (long)(start + (valid ? row0 + r : 0)) * stride + c;
            cp_async16(dst + r * LD + c, from, valid);
        }
        cp_async_commit();
    };

    const int wr = warp * 16 + g;  // this thread's rows in the tile: wr and wr + 8
    load_tile(ks, q + (long)head * D, q_stride, q0);
    cp_async_wait<0>();
    __syncthreads();
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const T* r0 = ks + wr * LD + kk * 16 + 2 * t;
        const T* r1 = r0 + 8 * LD;
        qf[kk][0] = lds32(r0);
        qf[kk][1] = lds32(r1);
        qf[kk][2] = lds32(r0 + 8);
        qf[kk][3] = lds32(r1 + 8);
    }
    __syncthreads();

    float acc[D / 8][4];
#pragma unroll
    for (int d = 0; d < D / 8; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const int row[2] = {q0 + wr, q0 + wr + 8};

    const int last_key = min(q0 + FA_ROWS, len) - 1;
    const int first_tile = window > 0 ? max(0, q0 - window + 1) / FA_KEYS : 0;
    // Software pipeline: V of this tile loads during Q·Kᵀ and the softmax, K of the next tile
    // during P·V. One buffer each: the barriers below order every reuse.
    const int last_tile = last_key / FA_KEYS;
    load_tile(ks, k + (long)kv_head * D, kv_stride, first_tile * FA_KEYS);
    for (int tile = first_tile; tile <= last_tile; ++tile) {
        const int k0 = tile * FA_KEYS;
        load_tile(vs, v + (long)kv_head * D, kv_stride, k0);
        cp_async_wait<1>();  // K of this tile has landed (V may still be in flight)
        __syncthreads();

        float s[FA_KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < FA_KEYS / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int n = 0; n < FA_KEYS / 8; ++n) {
                const T* kr = ks + (n * 8 + g) * LD + kk * 16 + 2 * t;
                Mma<T>::run(s[n], qf[kk], lds32(kr), lds32(kr + 8));
            }
        }

        // mask (diagonal tile, sliding window, keys past the end) and the running max
        const bool edge = k0 + FA_KEYS - 1 > q0 || window > 0;
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < FA_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2, key = k0 + n * 8 + 2 * t + (e & 1);
                float x = s[n][e] * scale_log2;
                if (edge && (key > row[r] || (window > 0 && row[r] - key >= window))) x = -INFINITY;
                s[n][e] = x;
                tile_max[r] = fmaxf(tile_max[r], x);
            }
        }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
            const float m_new = fmaxf(m[r], tile_max[r]);
            base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet
            const float alpha = exp2f(m[r] - base[r]);
            m[r] = m_new;
            l[r] *= alpha;
#pragma unroll
            for (int d = 0; d < D / 8; ++d) {
                acc[d][2 * r] *= alpha;
                acc[d][2 * r + 1] *= alpha;
            }
        }
#pragma unroll
        for (int n = 0; n < FA_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[n][e] - base[e / 2]);
                s[n][e] = p;
                l[e / 2] += p;
            }
        }

        cp_async_wait<0>();  // V has landed
        __syncthreads();     // ... for every thread, and every warp is done reading K
        if (tile < last_tile) load_tile(ks, k + (long)kv_head * D, kv_stride, k0 + FA_KEYS);

        // O += P·V: the S accumulators are already in the A-operand layout, 16 keys per step
#pragma unroll
        for (int j = 0; j < FA_KEYS / 16; ++j) {
            const uint32_t a[4] = {Mma<T>::pack(s[2 * j][0], s[2 * j][1]),
                                   Mma<T>::pack(s[2 * j][2], s[2 * j][3]),
                                   Mma<T>::pack(s[2 * j + 1][0], s[2 * j + 1][1]),
                                   Mma<T>::pack(s[2 * j + 1][2], s[2 * j + 1][3])};
            const int key = j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, vs + key * LD + dp * 16 + (lane >> 4) * 8);
                Mma<T>::run(acc[2 * dp], a, b[0], b[1]);
                Mma<T>::run(acc[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
        if (row[r] >= len) continue;
        const float inv = 1.0f / l[r];
        T* dst = out + (long)(start + row[r]) * q_stride + (long)head * D + 2 * t;
#pragma unroll
        for (int d = 0; d < D / 8; ++d)
            *reinterpret_cast<uint32_t*>(dst + d * 8) =
                Mma<T>::pack(acc[d][2 * r] * inv, acc[d][2 * r + 1] * inv);
    }
}

#define ATTENTION_ENTRY(SUFFIX, T)                                                                    \
    extern "C" __global__ void rope_rotate_half_##SUFFIX(const T* x, T* o, const int32_t* pos,       \
                                                         const T* c, const T* s, int heads,          \
                                                         int half, long pairs) {                     \
        rope_rotate_half<T>(x, o, pos, c, s, heads, half, pairs);                                    \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_d64_##SUFFIX(           \
        const T* q, const T* k, const T* v, T* o, const int32_t* st, int hq, int hkv, float sl2,     \
        int w) {                                                                                      \
        flash_attention<T, 64>(q, k, v, o, st, hq, hkv, sl2, w);                                     \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_d128_##SUFFIX(          \
        const T* q, const T* k, const T* v, T* o, const int32_t* st, int hq, int hkv, float sl2,     \
        int w) {                                                                                      \
        flash_attention<T, 128>(q, k, v, o, st, hq, hkv, sl2, w);                                    \
    }

ATTENTION_ENTRY(bf16, __nv_bfloat16)
ATTENTION_ENTRY(f16, __half)
