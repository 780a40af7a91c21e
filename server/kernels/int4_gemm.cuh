#pragma once
// A stack of int4 experts' GEMMs with the dequantization inside: y[r, c] = Σ_k x[r, k] · w_z[c, k]
// for the rows r = offsets[z]..offsets[z + 1] of each expert slot z (any number, 0 included: no
// padding), w_z given by the addresses of its packed int4 words, scales and zero points (or 0)
// at ptrs[3z..3z + 3] (as dequant_int4_words_stacked_*_z8 in dequant.cu takes them), the offsets
// following at ptrs[3·slots..]. Scales S as the checkpoint stores them (f32, bf16 or f16; each
// widens to f32 exactly), zero points a signed byte each (see IgGroupAt). For few rows per
// expert (a 2048-token window gives each of 128 experts ~128 rows), where writing every
// dequantized weight to memory and reading it back costs several times the GEMM itself.
//
// Each weight value is dequant_int_words' T((q - 8 - zp) · scale), one f32 product rounded once,
// so the products are those of the dequantized weight; they are summed in f32 on tensor cores
// (mma.sync m16n8k16, or wgmma on Hopper: int4_gemm_sm90.cu, the same bits) in ascending k,
// and rounded once to T.
//
// Tile BM rows × 128 outputs × 64 k, 256 threads, a 3-stage cp.async pipeline of x's rows, the
// raw int4 words, scales and zero points. With mma.sync each k-tile's words are decoded once per
// block into a 16-bit tile in shared memory, one k-tile ahead of the MMAs that read it (and
// after them in program order, so the decoding's ALU work issues while the tensor cores run),
// and one barrier per k-tile orders both; wgmma decodes into its A registers instead. Each weight is read from memory once per BM rows, as 4 bits. Grid
// (n / 128, the most rows of a slot / BM, slots): a block past its slot's rows returns at once,
// and a warp skips the MMA tiles past them. Needs k % 64 == 0, group % 32 == 0 (a 32-wide half
// k-tile has one scale per row), n even and 16-byte aligned x and words (checked by the
// caller); n may be ragged.
#include <type_traits>

#include "mma.cuh"

#define IG_BN 128
#define IG_BK 64
#define IG_HALVES (IG_BK / 32)  // scales per row and k-tile
#define IG_STAGES 3
#define IG_THREADS 256

// 4-byte asynchronous copy (scales, zero points); `valid` false writes zero.
__device__ __forceinline__ void ig_cp_async4(void* smem, const void* gmem, bool valid) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(addr), "l"(gmem),
                 "r"(valid ? 4 : 0));
}

// The 8 values T((q - zp)·s) of an int4 word, q = nibble - 8, lowest nibble first, with
// dequant_int_words' arithmetic (one exact product, one rounding to T), two ways:
//  * bf16 with a scale that is itself a bf16 value (as checkpoints store them) and 136 + zp a
//    bf16 integer: a pair of nibbles, OR-ed into the mantissas of two bf16 128.0s, is the pair
//    128 + nibble exactly; minus 136 + zp that is q - zp exactly, and a bf16x2 multiply by the
//    scale rounds the exact product (at most 13 significant bits, and normal: |s| >= 2^-100)
//    once, as the f32 product rounded to bf16 does. 4 instructions per pair.
//  * otherwise in f32, without integer-to-float conversions (a quarter of the FP32 rate): a
//    nibble at bit p of a 16-bit half, OR-ed into the mantissa of 2^23, is the exact f32
//    2^23 + c·nibble (c = 2^p); minus 2^23 + c·(8 + zp) that is c·(q - zp), exactly, and
//    c·(q - zp) · (s / c) is exactly the product (q - zp) · s, since s / c is exact wherever
//    |s| >= 2^-114 (smaller scales take shifts instead).
template <typename T>
struct IgDecodeF32 {
    float scale[4], bias[4];
    bool tiny;
    __device__ __forceinline__ IgDecodeF32(float s, int zp) {
        tiny = s != 0.0f && fabsf(s) < 0x1p-100f;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const float c = (float)(1 << (4 * p));
            scale[p] = tiny ? s : s / c;
            bias[p] = 8388608.0f + c * (float)(8 + zp);
        }
    }
    // Nibbles 4p of `half` (bits 0..15), positions p and p + 1, as a pair.
    __device__ __forceinline__ uint32_t pair(uint32_t half, int p) const {
        const float lo = __uint_as_float((half & (15u << (4 * p))) | 0x4B000000u) - bias[p];
        const float hi = __uint_as_float((half & (15u << (4 * p + 4))) | 0x4B000000u) - bias[p + 1];
        return Mma<T>::pack(lo * scale[p], hi * scale[p + 1]);
    }
    __device__ __forceinline__ uint32_t pair_shifted(uint32_t v) const {
        const float lo = __uint_as_float((v & 15u) | 0x4B000000u) - bias[0];
        const float hi = __uint_as_float(((v >> 4) & 15u) | 0x4B000000u) - bias[0];
        return Mma<T>::pack(lo * scale[0], hi * scale[0]);
    }
    __device__ __forceinline__ uint4 word(uint32_t w) const {
        if (tiny) return {pair_shifted(w), pair_shifted(w >> 8), pair_shifted(w >> 16), pair_shifted(w >> 24)};
        const uint32_t high = w >> 16;
        return {pair(w, 0), pair(w, 2), pair(high, 0), pair(high, 2)};
    }
};

struct IgDecodeBf16 {
    __nv_bfloat162 scale, bias;
    // Whether (s, zp) take this way: s a normal bf16 value, 136 + zp an exact bf16 integer.
    static __device__ __forceinline__ bool applies(float s, int zp) {
        return fabsf(s) >= 0x1p-100f && __bfloat162float(__float2bfloat16_rn(s)) == s &&
               zp >= -136 && zp <= 120;
    }
    __device__ __forceinline__ IgDecodeBf16(float s, int zp)
        : scale(__float2bfloat162_rn(s)), bias(__float2bfloat162_rn(-(float)(136 + zp))) {}
    // Byte j of w in the low half and byte j of w >> 4 in the high half: nibbles 2j and 2j + 1.
    __device__ __forceinline__ uint32_t pair(uint32_t w, uint32_t w4, int j) const {
        const uint32_t v = (__byte_perm(w, w4, j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12)) &
                            0x000F000Fu) | 0x43004300u;
        __nv_bfloat162 r = __hmul2(__hadd2(*reinterpret_cast<const __nv_bfloat162*>(&v), bias), scale);
        return *reinterpret_cast<uint32_t*>(&r);
    }
    __device__ __forceinline__ uint4 word(uint32_t w) const {
        const uint32_t w4 = w >> 4;
        return {pair(w, w4, 0), pair(w, w4, 1), pair(w, w4, 2), pair(w, w4, 3)};
    }
};

// Where 16-bit value 8·chunk of a 64-value (128-byte) row lies in a tile: the 16-byte chunks of
// row r are permuted by r % 8, so that ldmatrix's 8 rows of one chunk, a row's cp.async copies
// and the decoded stores all hit distinct banks without padding the rows.
__device__ __forceinline__ int ig_at(int row, int chunk) { return row * IG_BK + ((chunk ^ (row & 7)) * 8); }

template <int BM>
struct IgStage {
    uint16_t x[BM * IG_BK];             // x rows, 16-bit values, chunks permuted (ig_at)
    uint32_t words[IG_BN * IG_BK / 8];  // the tile's int4 words, 8 per weight row
    uint32_t scales[IG_HALVES][IG_BN];  // the aligned 4 bytes holding each scale (IgGroupAt)
    uint32_t zps[IG_HALVES][IG_BN];     // the aligned 4 bytes holding each zero point
};

// The 4-byte-aligned word that holds the value at `p` (cp.async copies whole words): an f32
// scale itself, or a 16-bit scale or a byte zero point with its neighbours.
template <typename V>
__device__ __forceinline__ const void* ig_word_of(const V* p) {
    return (const void*)((uintptr_t)p & ~(uintptr_t)3);
}

// The value of type V at element e of an array that starts on a 4-byte boundary (checked by the
// launcher), from the aligned word that holds it.
template <typename V>
__device__ __forceinline__ V ig_part(uint32_t word, long e) {
    const uint32_t part = word >> (8 * sizeof(V) * ((uint32_t)e % (4 / sizeof(V))));
    V v;
    memcpy(&v, &part, sizeof(V));  // the low bytes (little-endian)
    return v;
}

// A k-tile's scales (S, widened to f32) and zero points (signed bytes) from the words its stage
// holds: the value of output r of the block (row n0 + r of the weight) and half h of the tile
// is element (n0 + r) · groups + g[h] of the weight's scales or zero points. Made once per
// k-tile (the divisions), read per value.
template <typename S>
struct IgGroupAt {
    int n0, groups, g[IG_HALVES];  // the block's first output, groups a row, each half's group
    __device__ __forceinline__ IgGroupAt(int n0_, int k0, int groups_, int group)
        : n0(n0_), groups(groups_) {
#pragma unroll
        for (int h = 0; h < IG_HALVES; ++h) g[h] = (k0 + 32 * h) / group;
    }
    __device__ __forceinline__ long at(int r, int h) const { return (long)(n0 + r) * groups + g[h]; }
    __device__ __forceinline__ float scale(const uint32_t (&scales)[IG_HALVES][IG_BN], int r,
                                           int h) const {
        if constexpr (sizeof(S) == 4) return __uint_as_float(scales[h][r]);
        else return to_f32(ig_part<S>(scales[h][r], at(r, h)));
    }
    __device__ __forceinline__ int zero_point(const uint32_t (&zps)[IG_HALVES][IG_BN], int r,
                                              int h) const {
        return (int)ig_part<int8_t>(zps[h][r], at(r, h));
    }
};

template <int BM>
constexpr int ig_shared_bytes() {
    return IG_STAGES * sizeof(IgStage<BM>) + 2 * IG_BN * IG_BK * sizeof(uint16_t);
}
// int4_gemm_shared_bytes in cuda/dequant/int4_gemm.rs (which adds 1024 bytes to align them).
static_assert(ig_shared_bytes<64>() == 75776 && ig_shared_bytes<128>() == 100352, "int4_gemm_shared_bytes");
static_assert(sizeof(IgStage<64>) % 1024 == 0 && sizeof(IgStage<128>) % 1024 == 0, "stages keep wgmma's 1024-byte alignment");

// The tensor-core half of int4_gemm_stacked on mma.sync (any GPU from sm_80): 8 warps of BM/2
// rows × 32 outputs, A fragments (x) and B fragments (the decoded weights) through ldmatrix.
// int4_gemm_sm90.cu's IgWgmma is the same contract on Hopper's wgmma:
//  * `IgMma(rows)`: this block holds `rows` (>= 1) rows of its expert from row0;
//  * `idle()`: this thread's warp or warpgroup has no row to multiply;
//  * `DECODES`: whether it decodes each k-tile's weights itself (`decode(stage, at, has_zp)`,
//    into its registers; at: the tile's IgGroupAt) instead of reading the block's decoded tile;
//  * `multiply(x, w)`: one k-tile's products (x: BM rows, w: 128 outputs, both 64-wide, ig_at),
//    complete when it returns: its tiles are no longer read;
//  * `publish()`: this thread's shared-memory writes become visible to the next
//    multiply's reads after the next barrier;
//  * `store(y, n0, n)`: the sums, rounded to T, into y's rows row0.. (y at the block's first
//    row), outputs n0.. (< n).
template <typename T, int BM>
struct IgMmaSync {
    static constexpr bool DECODES = false;  // reads the block's shared decoded tile
    static constexpr int ROWS_W = BM / 2, MT = ROWS_W / 16;  // rows and 16-row MMA tiles per warp
    float acc[MT][4][4];
    int lane, wm, wn, tiles_m;  // this warp: rows wm·ROWS_W.., outputs wn·32..; its row tiles
    __device__ __forceinline__ explicit IgMmaSync(int rows) {
        const int warp = threadIdx.x / 32;
        lane = threadIdx.x % 32;
        wm = warp / 4;
        wn = warp % 4;
        tiles_m = min(MT, max(0, (rows - wm * ROWS_W + 15) / 16));
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
    }
    __device__ __forceinline__ bool idle() const { return tiles_m == 0; }
    __device__ __forceinline__ void multiply(const uint16_t* xs, const uint16_t* ws) {
        if (tiles_m == MT) multiply_tiles(xs, ws, std::true_type{});
        else if (tiles_m > 0) multiply_tiles(xs, ws, std::false_type{});
    }
    static __device__ __forceinline__ void publish() {}
    // Every 16-row tile of the warp (`full`), or those holding rows.
    template <typename Full>
    __device__ __forceinline__ void multiply_tiles(const uint16_t* xs, const uint16_t* ws, Full) {
#pragma unroll
        for (int kk = 0; kk < IG_BK / 16; ++kk) {
            // b[np][0], b[np][1]: outputs wn·32 + np·16 + 0..7; b[np][2], b[np][3]: + 8..15
            uint32_t b[2][4];
#pragma unroll
            for (int np = 0; np < 2; ++np)
                ldmatrix_x4(b[np], ws + ig_at(wn * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8,
                                              kk * 2 + ((lane >> 3) & 1)));
            // One 16-row tile's A fragments at a time, both output halves' B fragments held.
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (!Full::value && mt >= tiles_m) break;
                uint32_t a[4];
                ldmatrix_x4(a, xs + ig_at(wm * ROWS_W + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
                for (int np = 0; np < 2; ++np) {
                    Mma<T>::run(acc[mt][2 * np], a, b[np][0], b[np][1]);
                    Mma<T>::run(acc[mt][2 * np + 1], a, b[np][2], b[np][3]);
                }
            }
        }
    }
    // c0, c1: row lane / 4, outputs 2·(lane % 4) + {0, 1}; c2, c3: 8 rows further.
    __device__ __forceinline__ void store(T* y, int row0, int m, int n0, int n) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = row0 + wm * ROWS_W + mt * 16 + half * 8 + lane / 4;
                if (r >= m) continue;
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const int c = n0 + wn * 32 + nt * 8 + 2 * (lane % 4);
                    if (c < n) {  // n is even: the pair is whole
                        *reinterpret_cast<uint32_t*>(y + (long)r * n + c) =
                            Mma<T>::pack(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
                    }
                }
            }
        }
    }
};

// This block: rows row0..row0 + BM of expert slot z (whose rows start at offsets[z]), outputs
// blockIdx.x · IG_BN.. (the entry points below map the grid to (z, row0)), multiplied by the
// tensor-core half `Mul` (IgMmaSync, or IgWgmma on Hopper). The dynamic shared memory holds
// ig_shared_bytes<BM>() from its first 1024-byte boundary on (wgmma's swizzle atoms).
template <typename T, int BM, typename S, typename Mul>
__device__ void int4_gemm_stacked(const uint64_t* ptrs, const uint64_t* offsets, int z, int row0,
                                  const T* x, T* y, int n, int k, int group) {
#if __CUDA_ARCH__ >= 800
    const long first = (long)offsets[z];
    const int m = (int)((long)offsets[z + 1] - first);
    const int n0 = blockIdx.x * IG_BN;
    if (row0 >= m) return;  // the whole block: no barrier is waiting
    const int32_t* packed = (const int32_t*)ptrs[3 * z];
    const S* scales = (const S*)ptrs[3 * z + 1];
    const int8_t* zps = (const int8_t*)ptrs[3 * z + 2];
    x += first * k;
    y += first * n;
    extern __shared__ __align__(16) unsigned char ig_smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(ig_smem_raw);
    IgStage<BM>* stages = reinterpret_cast<IgStage<BM>*>(ig_smem_raw + ((1024 - (raw & 1023)) & 1023));
    uint16_t* decoded = reinterpret_cast<uint16_t*>(stages + IG_STAGES);  // [2][IG_BN][IG_BK], ig_at
    const int tid = threadIdx.x;
    const int words_per_row = k / 8, groups = k / group, tiles = k / IG_BK;
    // Copies per k-tile: 16-byte chunks of x (chunk tid % 8 of rows tid / 8 + XSTEP·j), one
    // weight row's words (threads < 128, two chunks) or its scales (threads >= 128), and its
    // zero points (threads < 128). Pointers advance with the k-tile; no division in the loop.
    constexpr int XSTEP = IG_THREADS / 8, XROWS = BM / XSTEP;
    const int xr = tid / 8, xc = (tid % 8) * 8;  // row and first value of this thread's chunk
    const T* x_src = x + (long)(row0 + xr) * k + xc;
    uint32_t x_valid = 0;
#pragma unroll
    for (int j = 0; j < XROWS; ++j) x_valid |= (uint32_t)(row0 + xr + XSTEP * j < m) << j;
    const int wr = tid % IG_BN;
    const bool w_valid = n0 + wr < n;
    const long w_row = (long)(w_valid ? n0 + wr : 0);
    const int32_t* w_src = packed + w_row * words_per_row;
    const S* s_src = scales + w_row * groups;
    const int8_t* z_src = zps ? zps + w_row * groups : nullptr;
    const int halves_per_group = group / 32;
    int next_group = 0, halves_left = halves_per_group;  // of the next 32-wide half k-tile
    auto load = [&](int t) {
        IgStage<BM>& s = stages[t % IG_STAGES];
        const int k0 = t * IG_BK;
#pragma unroll
        for (int j = 0; j < XROWS; ++j) {
            const bool valid = (x_valid >> j) & 1;
            cp_async16(&s.x[ig_at(xr + XSTEP * j, tid % 8)], valid ? x_src + (long)XSTEP * j * k + k0 : x, valid);
        }
#pragma unroll
        for (int h = 0; h < IG_HALVES; ++h) {
            if (tid < IG_BN) {
                if (h == 0) {
                    cp_async16(&s.words[wr * 8], w_src + k0 / 8, w_valid);
                    cp_async16(&s.words[wr * 8 + 4], w_src + k0 / 8 + 4, w_valid);
                }
                if (z_src) ig_cp_async4(&s.zps[h][wr], ig_word_of(z_src + next_group), w_valid);
            } else {
                ig_cp_async4(&s.scales[h][wr], ig_word_of(s_src + next_group), w_valid);
            }
            if (--halves_left == 0) {
                ++next_group;
                halves_left = halves_per_group;
            }
        }
    };
    // Thread pairs decode a weight row of a k-tile: 32 values each, the 4 words of one half.
    const int dr = tid / 2, dh = tid % 2;
    auto group_at = [&](int t) { return IgGroupAt<S>(n0, t * IG_BK, groups, group); };
    auto decode = [&](int t) {
        const IgStage<BM>& s = stages[t % IG_STAGES];
        const uint4 w = *reinterpret_cast<const uint4*>(&s.words[dr * 8 + dh * 4]);
        const IgGroupAt<S> at = group_at(t);
        const float sc = at.scale(s.scales, dr, dh);
        const int zp = zps ? at.zero_point(s.zps, dr, dh) : 0;
        uint16_t* d = decoded + (t % 2) * IG_BN * IG_BK;
        auto write = [&](const auto& dq) {
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) *reinterpret_cast<uint4*>(d + ig_at(dr, dh * 4 + j)) = dq.word(ws[j]);
        };
        if (std::is_same<T, __nv_bfloat16>::value && IgDecodeBf16::applies(sc, zp)) write(IgDecodeBf16(sc, zp));
        else write(IgDecodeF32<T>(sc, zp));
    };

    // The next k-tile's weights: into the shared decoded tile, or by the tensor-core half itself
    // (into its registers) where it decodes its own.
    auto prepare = [&](Mul& mul, int t) {
        if constexpr (Mul::DECODES) mul.decode(stages[t % IG_STAGES], group_at(t), zps != nullptr);
        else decode(t);
    };
    Mul mul(m - row0);
#pragma unroll
    for (int t = 0; t < IG_STAGES - 1; ++t) {
        if (t < tiles) load(t);
        cp_async_commit();
    }
    cp_async_wait<IG_STAGES - 2>();
    __syncthreads();
    prepare(mul, 0);
    for (int t = 0; t < tiles; ++t) {
        // Tile t + 1 has landed, everyone decoded tile t and is done with tile t - 1.
        cp_async_wait<IG_STAGES - 3>();
        Mul::publish();
        __syncthreads();
        if (t + IG_STAGES - 1 < tiles) load(t + IG_STAGES - 1);
        cp_async_commit();
        mul.multiply(stages[t % IG_STAGES].x, decoded + (t % 2) * IG_BN * IG_BK);
        if (t + 1 < tiles) prepare(mul, t + 1);
    }
    cp_async_wait<0>();
    if (!mul.idle()) mul.store(y, row0, m, n0, n);
#endif
}

// One entry per dtype, tile height and scale dtype for the tensor-core half MUL (NAME in the
// kernels' names, SS the scales' dtype: `_s{f32,bf16,f16}`).
// `stacked`: block (x, y, z) takes expert slot z's rows y · BM.., the offsets following the
// weights' addresses in ptrs (a plan made on the host). `tiled`: block (x, y) takes tile y of
// `tiles` ([count, (slot, first row)...], as moe_plan_place writes it on the device; blocks past
// the count return at once).
#define INT4_GEMM_ENTRY(NAME, MUL, SUFFIX, T, BM, SS, S)                                           \
    extern "C" __global__ void __launch_bounds__(IG_THREADS, 2)                                    \
        matmul_t_int4_stacked##NAME##_m##BM##_s##SS##_##SUFFIX(const uint64_t* ptrs, const T* x,   \
                                                              T* y, int n, int k, int g) {         \
        int4_gemm_stacked<T, BM, S, MUL<T, BM>>(ptrs, ptrs + 3 * gridDim.z, blockIdx.z,            \
                                                blockIdx.y * BM, x, y, n, k, g);                   \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(IG_THREADS, 2)                                    \
        matmul_t_int4_tiled##NAME##_m##BM##_s##SS##_##SUFFIX(const uint64_t* ptrs,                 \
                                                            const uint64_t* offsets,               \
                                                            const uint32_t* tiles, const T* x,     \
                                                            T* y, int n, int k, int g) {           \
        if (blockIdx.y >= tiles[0]) return;                                                        \
        int4_gemm_stacked<T, BM, S, MUL<T, BM>>(ptrs, offsets, tiles[1 + 2 * blockIdx.y],          \
                                                tiles[2 + 2 * blockIdx.y], x, y, n, k, g);         \
    }
#define INT4_GEMM_SCALES(NAME, MUL, SUFFIX, T, BM)               \
    INT4_GEMM_ENTRY(NAME, MUL, SUFFIX, T, BM, f32, float)         \
    INT4_GEMM_ENTRY(NAME, MUL, SUFFIX, T, BM, bf16, __nv_bfloat16) \
    INT4_GEMM_ENTRY(NAME, MUL, SUFFIX, T, BM, f16, __half)
#define INT4_GEMM_ENTRIES(NAME, MUL)                            \
    INT4_GEMM_SCALES(NAME, MUL, bf16, __nv_bfloat16, 128)       \
    INT4_GEMM_SCALES(NAME, MUL, f16, __half, 128)               \
    INT4_GEMM_SCALES(NAME, MUL, bf16, __nv_bfloat16, 64)        \
    INT4_GEMM_SCALES(NAME, MUL, f16, __half, 64)
