// int4_gemm.cuh's stacked int4 GEMM on Hopper's warpgroup MMA (built for sm_90a only, see
// build.rs): the same pipeline, decoding and products, with both tiles read by the tensor cores
// straight from shared memory (their ig_at layout is wgmma's 128-byte swizzle) and the MMAs
// asynchronous, so that the next k-tile's decoding runs beside them rather than between them.
#include "int4_gemm.cuh"
#include "wgmma.cuh"

// The contract of int4_gemm.cuh's IgMmaSync on wgmma. Two warpgroups: at BM 128 each takes 64
// rows × all 128 outputs (m64n128k16), at BM 64 the 64 rows × its half of the outputs
// (m64n64k16). Accumulators in the m16n8 layout of each warp's 16 rows (wgmma.cuh).
template <typename T, int BM>
struct IgWgmma {
    static_assert(BM == 64 || BM == 128, "one 64-row wgmma tile per warpgroup");
    static constexpr int N = BM == 128 ? 128 : 64;  // outputs per warpgroup
    float acc[N / 2];
    int wg, row_base, col_base;  // this warpgroup's first row and output in the block's tile
    bool active;                 // whether its rows hold any of the block's
    __device__ __forceinline__ explicit IgWgmma(int rows) {
        wg = threadIdx.x / 128;
        row_base = BM == 128 ? 64 * wg : 0;
        col_base = BM == 128 ? 0 : 64 * wg;
        active = row_base < rows;
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
    }
    __device__ __forceinline__ bool idle() const { return !active; }
    // Every warpgroup multiplies, rows or none (an idle one's are zeros, never stored): a
    // branch around the MMAs would make ptxas serialize them.
    __device__ __forceinline__ void multiply(const uint16_t* xs, const uint16_t* ws) {
        // 8-row groups 1024 bytes apart; each k16 step is 32 bytes further along the rows.
        const uint64_t a = descriptor(reinterpret_cast<const unsigned char*>(xs + row_base * IG_BK), 16, 1024);
        const uint64_t b = descriptor(reinterpret_cast<const unsigned char*>(ws + col_base * IG_BK), 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < IG_BK / 16; ++kk) {
            if constexpr (N == 128) Wgmma<T>::ss128(acc, descriptor_plus(a, 32 * kk), descriptor_plus(b, 32 * kk));
            else Wgmma<T>::ss64(acc, descriptor_plus(a, 32 * kk), descriptor_plus(b, 32 * kk), 1);
        }
        wgmma_commit();
    }
    __device__ __forceinline__ void finish() {
        wgmma_wait_all();
        fence_registers<N / 2>(acc);
    }
    // The decoded tile (generic stores) and x's rows (cp.async) are read by the async proxy.
    static __device__ __forceinline__ void publish() { fence_proxy_async(); }
    __device__ __forceinline__ void store(T* y, int row0, int m, int n0, int n) const {
        const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row0 + row_base + warp * 16 + half * 8 + lane / 4;
            if (r >= m) continue;
#pragma unroll
            for (int j = 0; j < N / 8; ++j) {
                const int c = n0 + col_base + j * 8 + 2 * (lane % 4);
                if (c < n) {  // n is even: the pair is whole
                    *reinterpret_cast<uint32_t*>(y + (long)r * n + c) =
                        Mma<T>::pack(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
                }
            }
        }
    }
};

// (A fourth pipeline stage, which leaves one 128-row block per SM, was slower on an H200: 214
// against 249 useful TFLOP/s for 128 experts x 128 rows of [768, 2048]; equal at 64 rows.)
INT4_GEMM_ENTRIES(_wgmma, IgWgmma)
