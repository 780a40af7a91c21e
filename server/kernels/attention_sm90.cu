// Flash attention on Hopper's warpgroup MMA (wgmma; built for sm_90a only, see build.rs): the
// same blocks, pipeline and online softmax as attention.cu's mma.sync kernel, with Q·Kᵀ read by
// the tensor cores straight from shared memory and P·V taking P from registers. One block is
// one warpgroup (4 warps) over 64 · MT query rows (MT 64-row wgmma tiles) of one head: 128 rows
// at head size 128; 64 at 192 and 256, whose 96 and 128 accumulators a thread holds per tile.
#include "flash.cuh"
#include "wgmma.cuh"

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
                Wgmma<T>::ss64(reinterpret_cast<float(&)[KEYS / 2]>(s[mt]), a, b, kk > 0);
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
                    Wgmma<T>::rs128(reinterpret_cast<float(&)[64]>(acc[mt][16 * h]), p[mt][j], b);
                }
                if constexpr (D % 128 != 0) {
                    const uint64_t b = descriptor_plus(v_desc, 16 * j * 128 + 2 * (D / 128) * CHUNK_KEYS);
                    Wgmma<T>::rs64(reinterpret_cast<float(&)[32]>(acc[mt][16 * (D / 128)]), p[mt][j], b);
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
