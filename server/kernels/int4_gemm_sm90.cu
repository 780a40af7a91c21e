// int4_gemm.cuh's stacked int4 GEMM on Hopper's warpgroup MMA (built for sm_90a only, see
// build.rs): the same pipeline and the same products, with the weights decoded straight into
// registers as wgmma's A operand and the product transposed, yᵀ = W · xᵀ. x's tile (its ig_at
// layout is wgmma's 128-byte swizzle, K-major) is the B operand, read by the tensor cores from
// shared memory: no decoded tile in shared memory, and no barrier for one.
#include "int4_gemm.cuh"
#include "wgmma.cuh"

// The values at nibbles 2j and 2j + 1 of int4 word `w` as a pair of T, dequant_int_words'
// T((q - zp) · s) (q = nibble - 8): IgDecodeBf16's way where it applies, else one exact f32
// product each, rounded once to T.
template <typename T>
__device__ __forceinline__ uint32_t ig_pair(uint32_t w, int j, float s, int zp, bool bf16_way) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        if (bf16_way) return IgDecodeBf16(s, zp).pair(w, w >> 4, j);
    }
    const float lo = (float)((int)((w >> (8 * j)) & 15u) - 8 - zp);
    const float hi = (float)((int)((w >> (8 * j + 4)) & 15u) - 8 - zp);
    return Mma<T>::pack(lo * s, hi * s);
}

// The contract of int4_gemm.cuh's IgMmaSync on wgmma. Warpgroup wg takes outputs 64·wg.. of the
// block's 128 against all BM rows (m64n{BM}k16, A from registers). A thread decodes the 32
// values of its A fragments per k-tile (mma.sync's A layout): outputs g and g + 8 of its
// warp's 16, k pairs 2t, 2t + 1 and 2t + 8, 2t + 9 of each 16, from the stage's words.
// Accumulators in the m16n8 layout (wgmma.cuh) of outputs × rows. The next k-tile decodes into
// `next` after this one's MMAs complete, and is copied into `a` as its MMAs start: the
// arrangement measured bitwise equal to mma.sync on an H200. Decoding while the MMAs ran gave
// wrong sums there, even with `a` kept alive to the wait.
template <typename T, int BM>
struct IgWgmma {
    static constexpr bool DECODES = true;
    static_assert(BM == 64 || BM == 128, "m64n64k16 or m64n128k16");
    float acc[BM / 2];
    uint32_t a[IG_BK / 16][4], next[IG_BK / 16][4];  // A fragments: in the MMAs, decoded next
    int out_row, t4;  // this thread's first output in the block's 128; lane % 4
    __device__ __forceinline__ explicit IgWgmma(int) {
        const int lane = threadIdx.x % 32;
        out_row = 64 * (threadIdx.x / 128) + 16 * ((threadIdx.x / 32) % 4) + lane / 4;
        t4 = lane % 4;
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) acc[i] = 0.0f;
    }
    __device__ __forceinline__ bool idle() const { return false; }
    template <typename GroupAt>
    __device__ __forceinline__ void decode(const IgStage<BM>& s, const GroupAt& at, bool has_zp) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {  // outputs out_row and out_row + 8
            const int r = out_row + 8 * rr;
            const uint4 lo = *reinterpret_cast<const uint4*>(&s.words[r * 8]);
            const uint4 hi = *reinterpret_cast<const uint4*>(&s.words[r * 8 + 4]);
            const uint32_t ws[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int h = 0; h < IG_HALVES; ++h) {
                const float sc = at.scale(s.scales, r, h);
                const int zp = has_zp ? at.zero_point(s.zps, r, h) : 0;
                const bool bf16_way = IgDecodeBf16::applies(sc, zp);
#pragma unroll
                for (int q = 0; q < 2; ++q) {  // the half's two k16 steps: words 2kk, 2kk + 1
                    const int kk = 2 * h + q;
                    next[kk][rr] = ig_pair<T>(ws[2 * kk], t4, sc, zp, bf16_way);
                    next[kk][2 + rr] = ig_pair<T>(ws[2 * kk + 1], t4, sc, zp, bf16_way);
                }
            }
        }
    }
    // The four k16 steps of the k-tile decode() wrote, waited for.
    __device__ __forceinline__ void multiply(const uint16_t* xs, const uint16_t*) {
#pragma unroll
        for (int kk = 0; kk < IG_BK / 16; ++kk)
#pragma unroll
            for (int i = 0; i < 4; ++i) a[kk][i] = next[kk][i];
        const uint64_t b = descriptor(reinterpret_cast<const unsigned char*>(xs), 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < IG_BK / 16; ++kk) {
            if constexpr (BM == 128) Wgmma<T>::template rs128<0>(acc, a[kk], descriptor_plus(b, 32 * kk));
            else Wgmma<T>::template rs64<0>(acc, a[kk], descriptor_plus(b, 32 * kk));
        }
        wgmma_commit();
        wgmma_wait_all();
        fence_registers<BM / 2>(acc);
    }
    // x's rows (cp.async, the generic proxy) are read by the tensor cores (the async proxy).
    static __device__ __forceinline__ void publish() { fence_proxy_async(); }
    // acc[4j + e]: output out_row + 8·(e / 2), row 8j + 2·t4 + e % 2 of the block's.
    __device__ __forceinline__ void store(T* y, int row0, int m, int n0, int n) const {
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + 8 * j + 2 * t4 + e % 2, c = n0 + out_row + 8 * (e / 2);
                if (r < m && c < n) y[(long)r * n + c] = from_f32<T>(acc[4 * j + e]);
            }
        }
    }
};

// (The first version read the decoded tile from shared memory as B with x as A, both through
// descriptors: 239 against 267 TFLOP/s for 128 experts x 128 rows of [768, 2048] on an H200.
// A fourth pipeline stage, which leaves one 128-row block per SM, was slower there too.)
INT4_GEMM_ENTRIES(_wgmma, IgWgmma)
