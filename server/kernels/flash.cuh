// Pieces shared by the flash-attention kernels (attention.cu: mma.sync, every architecture from
// sm_80; attention_sm90.cu: Hopper's wgmma): the MMA pair packing, asynchronous tile copies and
// the online softmax of one key tile, whose arithmetic (and so its bits) is the same in both.
#pragma once
#include "common.cuh"

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

// 2^x with subnormal results flushed to zero (one MUFU.EX2, no subnormal fix-up): a weight
// under 2^-126 next to the row's largest, which weighs 1, changes no f32 sum.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The online softmax of one tile of KEYS keys for a thread's MT 16-row MMA tiles, on the raw
// scores `s` in the m16n8 accumulator layout (value e of column block n: row g + 8 * (e / 2),
// key k0 + 8 * n + 2 * t + e % 2): masks (only where `edge`: the causal diagonal, the sliding
// window, keys past the end), updates the running max `m` (in base-2 units: score *
// `scale_log2`) and sum `l`, rescales `acc` where a max moved, and turns `s` into
// p = 2^(s * scale_log2 - max) with one rounding (FFMA). `row(mt, r)` is the query row (within
// its sequence) of the values s[mt][.][2 * r ..].
template <int MT, int KEYS, int D, typename RowFn>
__device__ __forceinline__ void online_softmax(float (&s)[MT][KEYS / 8][4], float (&m)[MT][2],
                                               float (&l)[MT][2], float (&acc)[MT][D / 8][4],
                                               int k0, bool edge, int window, float scale_log2,
                                               int t, RowFn row) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2, key = k0 + n * 8 + 2 * t + (e & 1);
                if (edge && (key > row(mt, r) || (window > 0 && row(mt, r) - key >= window)))
                    s[mt][n][e] = -INFINITY;
                tile_max[r] = fmaxf(tile_max[r], s[mt][n][e]);
            }
        }
        float base[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
            // scaling is monotonic, so this is the largest of the rounded scaled scores
            const float m_new = fmaxf(m[mt][r], tile_max[r] * scale_log2);
            base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet
            alpha[r] = exp2_ftz(m[mt][r] - base[r]);
            m[mt][r] = m_new;
            l[mt][r] *= alpha[r];
        }
        // Multiplying by 1 changes nothing: most tiles after the first few move no max, so the
        // warp skips the rescale unless one of its rows needs it.
        if (__any_sync(0xffffffff, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int d = 0; d < D / 8; ++d) {
                acc[mt][d][0] *= alpha[0];
                acc[mt][d][1] *= alpha[0];
                acc[mt][d][2] *= alpha[1];
                acc[mt][d][3] *= alpha[1];
            }
        }
#pragma unroll
        for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2_ftz(fmaf(s[mt][n][e], scale_log2, -base[e / 2]));
                s[mt][n][e] = p;
                l[mt][e / 2] += p;
            }
        }
    }
}

// Each thread's rows of O = acc / l, rounded once to T, into `out` ([tokens, hq, D] rows of
// `q_stride` values; `start`: the sequence's first token). Rows past `len` are not written.
template <typename T, int MT, int D, typename RowFn>
__device__ __forceinline__ void store_rows(const float (&acc)[MT][D / 8][4], const float (&l)[MT][2],
                                           T* out, int start, int len, long q_stride, int head,
                                           int t, RowFn row) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            if (row(mt, r) >= len) continue;
            const float inv = 1.0f / sum;
            T* dst = out + (long)(start + row(mt, r)) * q_stride + (long)head * D + 2 * t;
#pragma unroll
            for (int d = 0; d < D / 8; ++d)
                *reinterpret_cast<uint32_t*>(dst + d * 8) =
                    Mma<T>::pack(acc[mt][d][2 * r] * inv, acc[mt][d][2 * r + 1] * inv);
        }
    }
}
