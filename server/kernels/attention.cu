// Attention for bf16/f16 compute on the GPU: a flash-attention forward (causal, optional sliding
// window) that never materialises the [heads, T, T] scores, on the projections' natural layout
// [tokens, heads, head_dim] for a whole batch of sequences at once (`starts`: prefix offsets of
// the sequences), so no transposes or GQA copies (RoPE before it: rope.cu); and the materialised
// path's fused causal softmax and soft-capping.
#include "flash.cuh"

#define ROW_THREADS 256

// ---- attention: fused scale + causal (sliding-window) mask + softmax over f32 scores ----------

// `scores` is [heads * t, t] (row = head * t + query). Out-of-window entries become 0.
template <typename T>
__device__ void causal_softmax(const float* scores, T* out, int t, float scale, int window) {
    __shared__ float s_red[ROW_THREADS];
    long row = blockIdx.x;
    int i = row % t;
    int lo = window > 0 ? max(0, i - window + 1) : 0;
    const float* src = scores + row * t;
    T* dst = out + row * t;
    int tid = threadIdx.x;
    float m = -INFINITY;
    for (int j = lo + tid; j <= i; j += ROW_THREADS) m = fmaxf(m, src[j] * scale);
    s_red[tid] = m;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_red[tid] = fmaxf(s_red[tid], s_red[tid + s]);
        __syncthreads();
    }
    m = s_red[0];
    __syncthreads();
    float sum = 0.0f;
    for (int j = lo + tid; j <= i; j += ROW_THREADS) sum += expf(src[j] * scale - m);
    s_red[tid] = sum;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_red[tid] += s_red[tid + s];
        __syncthreads();
    }
    sum = s_red[0];
    for (int j = tid; j < t; j += ROW_THREADS)
        dst[j] = from_f32<T>((j >= lo && j <= i) ? expf(src[j] * scale - m) / sum : 0.0f);
}

// ---- soft-capping: cap * tanh(x / cap) (Gemma's logits and attention scores) -----------------
//
// One pass for candle's three (ops/attention.rs: soft_cap): x * mul + 0 with mul = 1 / cap as
// the dtype holds it, tanh, * cap, each rounded to the dtype as candle's kernels round them.
template <typename T>
__device__ void soft_cap(const T* x, T* out, long n, float mul, float cap) {
    const auto round = [](float v) { return to_f32(from_f32<T>(v)); };
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float scaled = round(fmaf(to_f32(x[i]), mul, 0.0f));
        const float t = round(tanhf(scaled));
        out[i] = from_f32<T>(fmaf(t, cap, 0.0f));
    }
}

// ---- flash attention ---------------------------------------------------------------------------
//
// One block = 4 warps of MT 16-row MMA tiles each (64 * MT query rows of one head of one
// sequence): with MT = 2 every K and V fragment read from shared memory feeds two MMAs. Keys
// are processed in tiles of KEYS with the online softmax (running max and sum in f32, base-2
// exponentials). Q·Kᵀ and P·V run on tensor cores (mma.sync m16n8k16, f32 accumulation); P is
// rounded to T before P·V, the row sums use the unrounded f32 values (as FlashAttention-2
// does). Each row's arithmetic, and its order, does not depend on the tiling of the rows, so a
// row gives the same bits in any block and any batch.

#define FA_THREADS 128
// Dynamic shared memory of one block: the Q tile, one K tile and one V tile, rows padded by 8
// values (conflict-free ldmatrix): (64 * MT + 2 * KEYS) * (D + 8) values; the launcher
// (cuda/attention.rs) computes the same size.

// q: [tokens, hq, D], k: [tokens, hkv, D], out: [tokens, hq, D]; v: [tokens, hkv, D] with its
// tokens `v_stride` and its heads `v_head_stride` values apart (multiples of 8: a view of MLA's
// values in place); grid (hq, query blocks of the longest sequence, sequences). `scale_log2` =
// softmax scale * log2(e); `window` 0 = none.
template <typename T, int D, int MT, int KEYS>
__device__ void flash_attention(const T* __restrict__ q, const T* __restrict__ k,
                                const T* __restrict__ v, T* __restrict__ out,
                                const int32_t* __restrict__ starts, int hq, int hkv,
                                float scale_log2, int window, int v_stride, int v_head_stride) {
    constexpr int LD = D + 8;
    constexpr int FA_ROWS = 64 * MT, FA_KEYS = KEYS;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* qs = reinterpret_cast<T*>(fa_smem);
    T* ks = qs + FA_ROWS * LD;
    T* vs = ks + FA_KEYS * LD;

    const FlashBlock b = flash_block<D>(starts, hq, hkv, FA_ROWS);
    const int head = b.head, kv_head = b.kv_head, start = b.start, len = b.len, q0 = b.q0;
    if (q0 >= len) return;
    const long q_stride = b.q_stride, kv_stride = b.kv_stride;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

    // one tile of ROWS rows into padded rows, as one copy group
    auto padded = [&](T* dst) { return [=](int r, int c) { return dst + r * LD + c * 8; }; };
    auto load_keys = [&](T* dst, const T* src, long stride, int row0) {
        load_rows<D, FA_THREADS, FA_KEYS, LD * sizeof(T)>(padded(dst), src, stride, b, row0);
        cp_async_commit();
    };

    // This warp's rows in the block: warp_row0 + 16 * mt + {g, g + 8} for mt < MT.
    const int warp_row0 = warp * 16 * MT;
    float acc[MT][D / 8][4];
    float m[MT][2], l[MT][2];
    // the query row (within its sequence) of the values acc[mt][.][2 * r ..] of this thread
    auto row = [&](int mt, int r) { return q0 + warp_row0 + 16 * mt + g + 8 * r; };
    softmax_start<MT, D>(acc, m, l);

    const KeyTiles tiles = key_tiles(q0, FA_ROWS, len, window, FA_KEYS);
    const int first_tile = tiles.first, last_tile = tiles.last;
    // the last key any of this warp's rows sees
    const int warp_last_key = q0 + warp_row0 + 16 * MT - 1;
    // Software pipeline: V of this tile loads during Q·Kᵀ and the softmax, K of the next tile
    // during P·V. One buffer each: the barriers below order every reuse.
    load_rows<D, FA_THREADS, FA_ROWS, LD * sizeof(T)>(padded(qs), q + (long)head * D, q_stride, b, q0);
    cp_async_commit();
    load_keys(ks, k + (long)kv_head * D, kv_stride, first_tile * FA_KEYS);
    for (int tile = first_tile; tile <= last_tile; ++tile) {
        const int k0 = tile * FA_KEYS;
        load_keys(vs, v + (long)kv_head * v_head_stride, v_stride, k0);
        cp_async_wait<1>();  // Q and K of this tile have landed (V may still be in flight)
        __syncthreads();

        // Causal: a tile whose every key lies after all of this warp's rows changes nothing
        // for it (every p would be exactly 0), so the warp skips its arithmetic; it still
        // takes part in every barrier.
        const bool visible = k0 <= warp_last_key;
        float s[MT][FA_KEYS / 8][4];
        if (visible) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < FA_KEYS / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldmatrix_x4(a[mt], qs + (warp_row0 + 16 * mt + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int np = 0; np < FA_KEYS / 16; ++np) {
                    // b[0], b[1]: keys np*16 + 0..7; b[2], b[3]: keys np*16 + 8..15
                    uint32_t b[4];
                    const int key = np * 16 + (lane & 7) + (lane >> 4) * 8;
                    ldmatrix_x4(b, ks + key * LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        Mma<T>::run(s[mt][2 * np], a[mt], b[0], b[1]);
                        Mma<T>::run(s[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }

            // Diagonal tiles, sliding window, keys past the end: masked per element.
            const bool edge = k0 + FA_KEYS - 1 > q0 + warp_row0 || window > 0;
            online_softmax<MT, FA_KEYS, D>(s, m, l, acc, k0, edge, window, scale_log2, t, row);
        }

        cp_async_wait<0>();  // V has landed
        __syncthreads();     // ... for every thread, and every warp is done reading K
        if (tile < last_tile) load_keys(ks, k + (long)kv_head * D, kv_stride, k0 + FA_KEYS);

        // O += P·V: the S accumulators are already in the A-operand layout, 16 keys per step
        if (visible) {
#pragma unroll
            for (int j = 0; j < FA_KEYS / 16; ++j) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    a[mt][0] = Mma<T>::pack(s[mt][2 * j][0], s[mt][2 * j][1]);
                    a[mt][1] = Mma<T>::pack(s[mt][2 * j][2], s[mt][2 * j][3]);
                    a[mt][2] = Mma<T>::pack(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
                    a[mt][3] = Mma<T>::pack(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
                }
                const int key = j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, vs + key * LD + dp * 16 + (lane >> 4) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        Mma<T>::run(acc[mt][2 * dp], a[mt], b[0], b[1]);
                        Mma<T>::run(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();
    }

    store_rows<T, MT, D>(acc, l, out, start, len, q_stride, head, t, row);
}

// flash_attention_d{D}_r{ROWS}_k{KEYS}_{SUFFIX}: the tilings cuda/attention.rs lists
#define FLASH_ENTRY(SUFFIX, T, D, ROWS, KEYS)                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 2)                                     \
        flash_attention_d##D##_r##ROWS##_k##KEYS##_##SUFFIX(                                       \
            const T* q, const T* k, const T* v, T* o, const int32_t* st, int hq, int hkv, float sl2, \
            int w, int vs, int vhs) {                                                                \
        flash_attention<T, D, ROWS / 64, KEYS>(q, k, v, o, st, hq, hkv, sl2, w, vs, vhs);           \
    }
#define FLASH_ENTRIES(SUFFIX, T)                                                                     \
    FLASH_ENTRY(SUFFIX, T, 64, 128, 64)                                                              \
    FLASH_ENTRY(SUFFIX, T, 128, 128, 64)                                                             \
    FLASH_ENTRY(SUFFIX, T, 128, 64, 64)                                                              \
    FLASH_ENTRY(SUFFIX, T, 192, 64, 64)                                                              \
    FLASH_ENTRY(SUFFIX, T, 256, 64, 64)

FLASH_ENTRIES(bf16, __nv_bfloat16)
FLASH_ENTRIES(f16, __half)

#define CAUSAL_SOFTMAX_ENTRIES(SUFFIX, T)                                                          \
    extern "C" __global__ void causal_softmax_##SUFFIX(const float* s, T* o, int t, float scale, int w) { \
        causal_softmax<T>(s, o, t, scale, w);                                                      \
    }
CAUSAL_SOFTMAX_ENTRIES(f32, float)
CAUSAL_SOFTMAX_ENTRIES(bf16, __nv_bfloat16)
CAUSAL_SOFTMAX_ENTRIES(f16, __half)

#define SOFT_CAP_ENTRY(SUFFIX, T)                                                                  \
    extern "C" __global__ void soft_cap_##SUFFIX(const T* x, T* o, long n, float mul, float cap) { \
        soft_cap<T>(x, o, n, mul, cap);                                                            \
    }
SOFT_CAP_ENTRY(f32, float)
SOFT_CAP_ENTRY(bf16, __nv_bfloat16)
SOFT_CAP_ENTRY(f16, __half)
