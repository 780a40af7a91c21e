// Pieces shared by the flash-attention kernels (attention.cu: mma.sync, every architecture from
// sm_80; attention_sm90.cu: Hopper's wgmma): tile copies of a sequence's rows and the online
// softmax of one key tile, whose arithmetic (and so its bits) is the same in both.
#pragma once
#include "mma.cuh"

// Where a flash block works, from its grid position (hq, query blocks of the longest sequence,
// sequences). Blocks start in grid order, x fastest: every head's last (longest) query block of a
// sequence starts before any head's next one, so the short blocks fill the tail of the grid
// instead of a long block starting last. A block whose q0 lies past its sequence's end has
// nothing to do.
struct FlashBlock {
    int head, kv_head, start, len, q0;
    long q_stride, kv_stride;  // between tokens of q (and out), of k and v
};
template <int D>
__device__ __forceinline__ FlashBlock flash_block(const int32_t* starts, int hq, int hkv, int rows) {
    const int seq = blockIdx.z, head = blockIdx.x, start = starts[seq];
    return {head,  head / (hq / hkv), start, starts[seq + 1] - start,
            (int)(gridDim.y - 1 - blockIdx.y) * rows, (long)hq * D, (long)hkv * D};
}

// ROWS rows of D values of one head from row0 on (`src`: the head's first value, tokens `stride`
// apart) into shared memory at `at(row, 16-byte chunk)`, zeros past the sequence's end, by
// THREADS threads; the copies run asynchronously until the caller commits and waits for them.
// A thread copies one chunk column of every STEP-th row, so its source and destination move by
// fixed steps: `at` must place row r + 1 PITCH bytes after row r, give or take a shift that
// repeats every 8 rows (padded rows; a 128-byte swizzle, which depends on the row modulo 8, as
// STEP is a multiple of 8).
// Tiles inside the sequence skip the per-row checks: ~3 instructions per copy, where a loop
// over rows * chunks took ~25, all of them between two tiles' MMAs of a latency-bound loop.
template <int D, int THREADS, int ROWS, int PITCH, typename T, typename At>
__device__ __forceinline__ void load_rows(At at, const T* src, long stride, const FlashBlock& b,
                                          int row0) {
    constexpr int CHUNKS = D / 8, STEP = THREADS / CHUNKS;
    if constexpr (THREADS % CHUNKS != 0 || STEP % 8 != 0) {
        // Head sizes whose chunks do not tile the threads in whole rows (192, 256): each copy
        // finds its row and chunk, and `at` places it (padded rows only: no swizzle is built
        // for these sizes).
        static_assert(ROWS * CHUNKS % THREADS == 0, "every thread copies as many chunks");
        const T* first = src + (long)b.start * stride;
#pragma unroll
        for (int j = 0; j < ROWS * CHUNKS / THREADS; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / CHUNKS, c = i % CHUNKS;
            const bool valid = row0 + r < b.len;
            cp_async16(at(r, c), valid ? first + (long)(row0 + r) * stride + c * 8 : first, valid);
        }
        return;
    } else {
        static_assert(ROWS % STEP == 0, "every thread copies whole rows' chunks at a fixed swizzle");
        const int c = threadIdx.x % CHUNKS, r = threadIdx.x / CHUNKS;
        unsigned char* d = reinterpret_cast<unsigned char*>(at(r, c));
        const T* first = src + (long)b.start * stride + c * 8;  // a valid address where no row is
        const T* s = first + (long)(row0 + r) * stride;
        const long step = (long)STEP * stride;
        const int rows_left = b.len - row0 - r;
        if (rows_left >= ROWS) {  // every tile but a sequence's last
#pragma unroll
            for (int j = 0; j < ROWS / STEP; ++j, s += step) cp_async16(d + j * STEP * PITCH, s, true);
            return;
        }
#pragma unroll
        for (int j = 0; j < ROWS / STEP; ++j, s += step) {
            const bool valid = j * STEP < rows_left;
            cp_async16(d + j * STEP * PITCH, valid ? s : first, valid);
        }
    }
}

// A thread's softmax state before the first key tile: O = 0, running max -inf, sum 0.
template <int MT, int D>
__device__ __forceinline__ void softmax_start(float (&acc)[MT][D / 8][4], float (&m)[MT][2],
                                              float (&l)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) acc[mt][d][0] = acc[mt][d][1] = acc[mt][d][2] = acc[mt][d][3] = 0.0f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m[mt][r] = -INFINITY;
            l[mt][r] = 0.0f;
        }
    }
}

// The key tiles (of `keys` keys) that query rows q0 .. q0 + rows - 1 of a sequence of `len`
// tokens see: causal, and within the sliding window when `window` > 0.
struct KeyTiles {
    int first, last;
};
__device__ __forceinline__ KeyTiles key_tiles(int q0, int rows, int len, int window, int keys) {
    const int last_key = min(q0 + rows, len) - 1;
    return {window > 0 ? max(0, q0 - window + 1) / keys : 0, last_key / keys};
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
// `scale_log2`) and sum `l`, turns `s` into p = 2^(s * scale_log2 - max) with one rounding
// (FFMA), and gives the factor `alpha` by which the output so far must be rescaled
// (`rescale_output`). `row(mt, r)` is the query row (within its sequence) of s[mt][.][2 * r ..].
template <int MT, int KEYS, typename RowFn>
__device__ __forceinline__ void softmax_tile(float (&s)[MT][KEYS / 8][4], float (&m)[MT][2],
                                             float (&l)[MT][2], float (&alpha)[MT][2], int k0,
                                             bool edge, int window, float scale_log2, int t,
                                             RowFn row) {
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
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
            // scaling is monotonic, so this is the largest of the rounded scaled scores
            const float m_new = fmaxf(m[mt][r], tile_max[r] * scale_log2);
            base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet
            alpha[mt][r] = exp2_ftz(m[mt][r] - base[r]);
            m[mt][r] = m_new;
            l[mt][r] *= alpha[mt][r];
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

// acc *= alpha row by row. Multiplying by 1 changes nothing: most tiles after the first few
// move no max, so a warp skips the rescale unless one of its rows needs it.
template <int MT, int D>
__device__ __forceinline__ void rescale_output(float (&acc)[MT][D / 8][4], const float (&alpha)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        if (__any_sync(0xffffffff, alpha[mt][0] != 1.0f || alpha[mt][1] != 1.0f)) {
#pragma unroll
            for (int d = 0; d < D / 8; ++d) {
                acc[mt][d][0] *= alpha[mt][0];
                acc[mt][d][1] *= alpha[mt][0];
                acc[mt][d][2] *= alpha[mt][1];
                acc[mt][d][3] *= alpha[mt][1];
            }
        }
    }
}

// softmax_tile, then the output rescaled at once (for kernels whose P·V of the previous tile has
// completed by now).
template <int MT, int KEYS, int D, typename RowFn>
__device__ __forceinline__ void online_softmax(float (&s)[MT][KEYS / 8][4], float (&m)[MT][2],
                                               float (&l)[MT][2], float (&acc)[MT][D / 8][4],
                                               int k0, bool edge, int window, float scale_log2,
                                               int t, RowFn row) {
    float alpha[MT][2];
    softmax_tile<MT, KEYS>(s, m, l, alpha, k0, edge, window, scale_log2, t, row);
    rescale_output<MT, D>(acc, alpha);
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
