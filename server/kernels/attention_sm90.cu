// Flash attention on Hopper's warpgroup MMA (wgmma; built for sm_90a only, see build.rs): the
// same blocks, pipeline and online softmax as attention.cu's mma.sync kernel, with Q·Kᵀ read by
// the tensor cores straight from shared memory and P·V taking P from registers. One block is
// one warpgroup (4 warps) over 64 · MT query rows (MT 64-row wgmma tiles) of one head: 128 rows
// at head size 128; 64 at 192 and 256, whose 96 and 128 accumulators a thread holds per tile.
#include "flash.cuh"

// ---- wgmma: m64n64k16 with both operands in shared memory (S = Q·Kᵀ), m64n128k16 and
// m64n64k16 with A in registers and B transposed in shared memory (O += P·V); f32 accumulators in the m16n8 layout of
// each warp's 16 rows (value 4 * j + e: column block j, row g + 8 * (e / 2), column 2t + e % 2).
template <typename T> struct Wgmma;
// One 16-bit input type's two MMAs (PTX_TYPE: its name in the instruction).
#define WGMMA_FOR(T, PTX_TYPE)                                                                        \
    template <> struct Wgmma<T> {                                                                     \
        static __device__ __forceinline__ void qk(float (&d)[32], uint64_t a, uint64_t b, int acc) {   \
            asm volatile(                                                                             \
                "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                           \
                "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE                  \
                " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                : "l"(a), "l"(b), "r"(acc));                                                          \
        }                                                                                             \
        static __device__ __forceinline__ void pv(float (&d)[64], const uint32_t (&a)[4], uint64_t b) { \
            asm volatile(                                                                             \
                "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                              \
                "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE                 \
                " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                \
        }                                                                                             \
        static __device__ __forceinline__ void pv64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) { \
            asm volatile(                                                                             \
                "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                              \
                "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE                  \
                " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                \
        }                                                                                             \
    };
WGMMA_FOR(__nv_bfloat16, "bf16")
WGMMA_FOR(__half, "f16")

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Shared memory written by this thread's cp.async (the generic proxy) becomes visible to the
// tensor cores' reads (the async proxy) after the next barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pins an accumulator register at this point of the program, so that no read of it moves above
// the wait for the asynchronous MMAs that write it.
template <int N> __device__ __forceinline__ void fence_registers(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// ---- shared-memory tiles in the 128-byte swizzle that wgmma reads --------------------------
// A tile of `rows` rows of 128 values (16-bit) is two column halves of [rows][128 bytes]; in
// each 128-byte row, 16-byte chunk c sits at c ^ (row % 8). Halves are 1024-byte aligned.
__device__ __forceinline__ int swizzled(int rows, int row, int chunk) {
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// Matrix descriptor of a 128-byte-swizzled operand at `p`: 8-row groups 1024 bytes apart
// (`sbo`), `lbo` between the 64-value column halves where an MMA spans both (transposed B).
__device__ __forceinline__ uint64_t descriptor(const unsigned char* p, uint32_t lbo, uint32_t sbo) {
    const uint64_t addr = (uint32_t)__cvta_generic_to_shared(p);
    return ((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) after the one `d` describes: only
// the address field (the low 14 bits, in 16-byte units) moves, and an address inside shared
// memory never carries out of it. One 32-bit add instead of building the descriptor anew.
__device__ __forceinline__ uint64_t descriptor_plus(uint64_t d, uint32_t bytes) {
    const uint32_t lo = (uint32_t)d + (bytes >> 4), hi = (uint32_t)(d >> 32);
    return ((uint64_t)hi << 32) | lo;
}

#define WG_THREADS 128

// ROWS rows of D values into a tile of the 128-byte-swizzled layout at `dst` (load_rows; the
// caller commits).
template <int D, int ROWS, typename T>
__device__ __forceinline__ void load_tile_swizzled(unsigned char* dst, const T* src, long stride,
                                                   const FlashBlock& b, int row0) {
    load_rows<D, WG_THREADS, ROWS, 128>([=](int r, int c) { return dst + swizzled(ROWS, r, c); }, src,
                                        stride, b, row0);
}

// Grid and arguments as attention.cu's flash_attention (V strided as it says); D = 128, 192 or
// 256, 64 · MT query rows per block, KEYS keys per step, BUFFERS K and V buffers.
// - Two (head size 128): the next tile's K and V load during the whole of this tile's work (one
//   buffer of each was 3-9 % slower on an H200).
// - One (192 and 256, where two, 160 KiB at 256, would leave one block per SM): V loads during
//   Q·Kᵀ and the softmax, the next K during P·V, as in attention.cu, and two blocks share an
//   SM, one's softmax beside the other's MMAs.
template <typename T, int D, int MT, int KEYS, int BUFFERS>
__device__ void flash_attention_wgmma(const T* __restrict__ q, const T* __restrict__ k,
                                      const T* __restrict__ v, T* __restrict__ out,
                                      const int32_t* __restrict__ starts, int hq, int hkv,
                                      float scale_log2, int window, int v_stride, int v_head_stride) {
    static_assert(D % 64 == 0 && (BUFFERS == 1 || BUFFERS == 2), "P·V runs in 128- and 64-column parts");
    constexpr int ROWS = 64 * MT, TILE = KEYS * D * 2, CHUNK_KEYS = KEYS * 128, CHUNK_ROWS = ROWS * 128;
    extern __shared__ __align__(16) unsigned char wg_smem_raw[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(wg_smem_raw);
    unsigned char* qs = wg_smem_raw + ((1024 - (raw & 1023)) & 1023);
    // buffer i = tile % BUFFERS: K at kv + 2 * i * TILE, V right after it
    unsigned char* kv = qs + ROWS * D * 2;
    auto k_buf = [&](int tile) { return kv + (tile % BUFFERS) * 2 * TILE; };
    auto v_buf = [&](int tile) { return k_buf(tile) + TILE; };

    const FlashBlock b = flash_block<D>(starts, hq, hkv, ROWS);
    const int head = b.head, start = b.start, len = b.len, q0 = b.q0;
    if (q0 >= len) return;
    const long q_stride = b.q_stride, kv_stride = b.kv_stride;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const T* k_head = k + (long)b.kv_head * D;
    const T* v_head = v + (long)b.kv_head * v_head_stride;

    float acc[MT][D / 8][4];
    float m[MT][2], l[MT][2];
    // warp w holds rows 16w + {g, g + 8} of each 64-row tile
    auto row = [&](int mt, int r) { return q0 + 64 * mt + 16 * warp + g + 8 * r; };
    softmax_start<MT, D>(acc, m, l);

    const KeyTiles tiles = key_tiles(q0, ROWS, len, window, KEYS);
    const int first_tile = tiles.first, last_tile = tiles.last;
    auto load_k = [&](int tile) { load_tile_swizzled<D, KEYS>(k_buf(tile), k_head, kv_stride, b, tile * KEYS); };
    auto load_v = [&](int tile) { load_tile_swizzled<D, KEYS>(v_buf(tile), v_head, v_stride, b, tile * KEYS); };
    // Two buffers: one copy group per tile (empty past the last), so that "all but the newest
    // group" is always this tile's.
    auto load_kv = [&](int tile) {
        if (tile <= last_tile) {
            load_k(tile);
            load_v(tile);
        }
        cp_async_commit();
    };
    load_tile_swizzled<D, ROWS>(qs, q + (long)head * D, q_stride, b, q0);
    if constexpr (BUFFERS == 2) {
        load_kv(first_tile);
        load_kv(first_tile + 1);
    } else {
        load_k(first_tile);
        cp_async_commit();
    }
    // The operands' descriptors, built once: each MMA's is one of these plus an offset.
    const uint64_t q_desc = descriptor(qs, 16, 1024);
    const uint64_t k_desc0 = descriptor(k_buf(0), 16, 1024), k_desc1 = descriptor(k_buf(1), 16, 1024);
    const uint64_t v_desc0 = descriptor(v_buf(0), CHUNK_KEYS, 1024), v_desc1 = descriptor(v_buf(1), CHUNK_KEYS, 1024);
    for (int tile = first_tile; tile <= last_tile; ++tile) {
        const uint64_t k_desc = tile & 1 ? k_desc1 : k_desc0, v_desc = tile & 1 ? v_desc1 : v_desc0;
        const int k0 = tile * KEYS;
        if constexpr (BUFFERS == 1) {
            load_v(tile);
            cp_async_commit();
        }
        cp_async_wait<1>();  // Q and K of this tile have landed (and V, with two buffers)
        fence_proxy_async();
        __syncthreads();

        // S = Q·Kᵀ: D / 16 steps of 16, each inside one 64-value chunk (32 bytes apart)
        float s[MT][KEYS / 8][4];
        wgmma_fence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const uint64_t a = descriptor_plus(q_desc, (kk / 4) * CHUNK_ROWS + 64 * mt * 128 + (kk % 4) * 32);
                const uint64_t b = descriptor_plus(k_desc, (kk / 4) * CHUNK_KEYS + (kk % 4) * 32);
                Wgmma<T>::qk(reinterpret_cast<float(&)[KEYS / 2]>(s[mt]), a, b, kk > 0);
            }
        }
        wgmma_commit();
        wgmma_wait_all();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) fence_registers<KEYS / 2>(&s[mt][0][0]);

        const bool edge = k0 + KEYS - 1 > q0 + 16 * warp || window > 0;
        online_softmax<MT, KEYS, D>(s, m, l, acc, k0, edge, window, scale_log2, t, row);

        if constexpr (BUFFERS == 1) {
            cp_async_wait<0>();  // V has landed
            fence_proxy_async();
            __syncthreads();  // ... for every thread, and every MMA reading K has completed
            if (tile < last_tile) load_k(tile + 1);
            cp_async_commit();
        }

        // O += P·V: P rounded to T in the A-register layout, 16 keys per step
        uint32_t p[MT][KEYS / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < KEYS / 16; ++j) {
                p[mt][j][0] = Mma<T>::pack(s[mt][2 * j][0], s[mt][2 * j][1]);
                p[mt][j][1] = Mma<T>::pack(s[mt][2 * j][2], s[mt][2 * j][3]);
                p[mt][j][2] = Mma<T>::pack(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
                p[mt][j][3] = Mma<T>::pack(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
            }
        }
        wgmma_fence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < KEYS / 16; ++j) {
                // V is the transposed B operand: 128 output columns (two 64-value chunks,
                // CHUNK_KEYS apart) per MMA, and the last 64 alone where D is an odd number
                // of 64s (192: MLA's keys)
#pragma unroll
                for (int h = 0; h < D / 128; ++h) {
                    const uint64_t b = descriptor_plus(v_desc, 16 * j * 128 + 2 * h * CHUNK_KEYS);
                    Wgmma<T>::pv(reinterpret_cast<float(&)[64]>(acc[mt][16 * h]), p[mt][j], b);
                }
                if constexpr (D % 128 != 0) {
                    const uint64_t b = descriptor_plus(v_desc, 16 * j * 128 + 2 * (D / 128) * CHUNK_KEYS);
                    Wgmma<T>::pv64(reinterpret_cast<float(&)[32]>(acc[mt][16 * (D / 128)]), p[mt][j], b);
                }
            }
        }
        wgmma_commit();
        wgmma_wait_all();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) fence_registers<D / 2>(&acc[mt][0][0]);
        __syncthreads();  // every MMA reading this tile's buffers has completed
        if constexpr (BUFFERS == 2) load_kv(tile + 2);
    }

    store_rows<T, MT, D>(acc, l, out, start, len, q_stride, head, t, row);
}

// flash_attention_wgmma_d{D}_r{ROWS}_k{KEYS}_{SUFFIX}: the tilings ops/attention.rs lists
// (cuda/attention.rs's `wgmma_kv_buffers` gives BUFFERS for the shared memory size)
#define WG_ENTRY(SUFFIX, T, D, ROWS, KEYS, BUFFERS)                                                  \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 2)                                     \
        flash_attention_wgmma_d##D##_r##ROWS##_k##KEYS##_##SUFFIX(                                 \
            const T* q, const T* k, const T* v, T* o, const int32_t* st, int hq, int hkv, float sl2, \
            int w, int vs, int vhs) {                                                                \
        flash_attention_wgmma<T, D, ROWS / 64, KEYS, BUFFERS>(q, k, v, o, st, hq, hkv, sl2, w, vs, vhs); \
    }
#define WG_ENTRIES(SUFFIX, T)                                                                        \
    WG_ENTRY(SUFFIX, T, 128, 128, 64, 2)                                                             \
    WG_ENTRY(SUFFIX, T, 192, 64, 64, 1)                                                              \
    WG_ENTRY(SUFFIX, T, 256, 64, 64, 1)
WG_ENTRIES(bf16, __nv_bfloat16)
WG_ENTRIES(f16, __half)
