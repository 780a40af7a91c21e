// The mixture-of-experts family (ops/moe.rs, cuda/moe.rs): the router's top-k and the weighted
// combine of the experts' outputs.
#include "common.cuh"

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

// A group-limited router (DeepSeek-V3/V2, GLM-4.5, Mistral 4) on its scores (sigmoid or softmax
// of the logits, in f32, `[tokens, experts]`): the steps of ops::moe_route_grouped, which is its
// CPU reference, one warp per token (lane l holds experts l, l + 32, ...). `round`: 0 f32, 1 bf16,
// 2 f16 (the logits' dtype, which every step is rounded to); `top_two`: a group scores the sum of
// its two best choice scores, else its best; dropped groups' experts score `masked`. Orders are
// f32's total order (Rust's total_cmp), ties to the lower index. A token with a NaN score gets
// the id `experts` everywhere.
constexpr int MOE_GROUPED_MAX_EXPERTS = 512;
constexpr int MOE_GROUPED_PER_LANE = MOE_GROUPED_MAX_EXPERTS / 32;
constexpr int MOE_GROUPED_WARPS = 4;  // warps (tokens) per block

__device__ __forceinline__ float moe_round(float v, int round) {
    if (round == 1) return __bfloat162float(__float2bfloat16_rn(v));
    if (round == 2) return __half2float(__float2half_rn(v));
    return v;
}

// Rust's f32::total_cmp as an integer key: a < b in total order iff key(a) < key(b). Its own
// inverse: the value of a key is __int_as_float(moe_total_key(key)) read back as bits.
__device__ __forceinline__ int moe_total_key(float v) {
    int bits = __float_as_int(v);
    return bits ^ (int)(((unsigned)(bits >> 31)) >> 1);
}

__device__ __forceinline__ float moe_key_value(int key) {
    return __int_as_float(key ^ (int)(((unsigned)(key >> 31)) >> 1));
}

// The warp's best (key, index): the larger key, the lower index on ties; index -1 is none.
// Broadcast to every lane: a sequential scan in index order keeping strictly larger keys.
__device__ __forceinline__ void warp_best(int& key, int& index) {
    for (int o = 16; o > 0; o >>= 1) {
        const int k2 = __shfl_xor_sync(0xffffffff, key, o);
        const int i2 = __shfl_xor_sync(0xffffffff, index, o);
        if (i2 >= 0 && (index < 0 || k2 > key || (k2 == key && i2 < index))) {
            key = k2;
            index = i2;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * MOE_GROUPED_WARPS)
    moe_route_grouped(const float* scores, const float* bias, int tokens, int experts, int k,
                      int groups, int topk_group, int norm, float scale, int top_two,
                      float masked, int round, uint32_t* ids, float* weights) {
    __shared__ float s_group[MOE_GROUPED_WARPS][MOE_GROUPED_MAX_EXPERTS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const long t = (long)blockIdx.x * MOE_GROUPED_WARPS + warp;
    if (t >= tokens) return;  // the whole warp
    const float* s = scores + t * experts;
    const int per_group = experts / groups;
    // This lane's experts' choice scores, kept as total-order keys.
    int choice[MOE_GROUPED_PER_LANE];
    bool nan = false;
#pragma unroll
    for (int j = 0; j < MOE_GROUPED_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        choice[j] = 0;
        if (e < experts) {
            nan |= isnan(s[e]);
            choice[j] = moe_total_key(moe_round(s[e], round) + (bias ? bias[e] : 0.0f));
        }
    }
    if (__any_sync(0xffffffff, nan)) {
        for (int j = lane; j < k; j += 32) {
            ids[t * k + j] = experts;
            weights[t * k + j] = NAN;
        }
        return;
    }
    // Each group's score: its best choice score, plus (top_two) the next best.
    for (int g = 0; g < groups; ++g) {
        int best = 0, best_e = -1;
#pragma unroll
        for (int j = 0; j < MOE_GROUPED_PER_LANE; ++j) {
            const int e = lane + 32 * j;
            if (e < experts && e / per_group == g && (best_e < 0 || choice[j] > best)) {
                best = choice[j];
                best_e = e;
            }
        }
        warp_best(best, best_e);
        const float b0 = moe_key_value(best);
        float score = b0;
        if (top_two) {
            int second = 0, second_e = -1;
#pragma unroll
            for (int j = 0; j < MOE_GROUPED_PER_LANE; ++j) {
                const int e = lane + 32 * j;
                if (e < experts && e / per_group == g && e != best_e &&
                    (second_e < 0 || choice[j] > second)) {
                    second = choice[j];
                    second_e = e;
                }
            }
            warp_best(second, second_e);
            const float b1 = second_e < 0 ? b0 : moe_key_value(second);
            score = moe_round(b0 + b1, round);
        }
        if (lane == 0) s_group[warp][g] = score;
    }
    __syncwarp();
    // The kept groups (a bit set, the same in every lane).
    uint64_t kept[MOE_GROUPED_MAX_EXPERTS / 64] = {};
    for (int j = 0; j < topk_group; ++j) {
        int best = 0, best_g = -1;
        for (int g = lane; g < groups; g += 32) {
            if (kept[g / 64] >> (g % 64) & 1) continue;
            const int key = moe_total_key(s_group[warp][g]);
            if (best_g < 0 || key > best) {
                best = key;
                best_g = g;
            }
        }
        warp_best(best, best_g);
        kept[best_g / 64] |= 1ull << (best_g % 64);
    }
    // The top k experts of the kept groups (the others at `masked`), best first.
    const int masked_key = moe_total_key(masked);
    bool taken[MOE_GROUPED_PER_LANE] = {};
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
        int best = 0, best_e = -1;
#pragma unroll
        for (int i = 0; i < MOE_GROUPED_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e >= experts || taken[i]) continue;
            const int g = e / per_group;
            const int key = (kept[g / 64] >> (g % 64) & 1) ? choice[i] : masked_key;
            if (best_e < 0 || key > best) {
                best = key;
                best_e = e;
            }
        }
        warp_best(best, best_e);
#pragma unroll
        for (int i = 0; i < MOE_GROUPED_PER_LANE; ++i) taken[i] |= lane + 32 * i == best_e;
        const float w = moe_round(s[best_e], round);
        if (lane == 0) {
            ids[t * k + j] = best_e;
            weights[t * k + j] = w;
        }
        sum += w;
    }
    if (lane != 0) return;
    const float denominator = norm ? moe_round(sum, round) + 1e-20f : 1.0f;
    for (int j = 0; j < k; ++j) {
        float* w = &weights[t * k + j];
        *w = moe_round(moe_round(*w / denominator, round) * scale, round);
    }
}

// ---- the experts' rows planned on the device ---------------------------------------------------
// The layout the host plan gives (ExpertRows in model/blocks/moe.rs), without reading the router's
// choice back: expert e's rows are the entries i = t·k + s with ids[i] = e, in entry order, at
// offsets[e]..offsets[e + 1]; rows_token / row_weight give each row's token and router weight;
// positions[t·k + j] is the row of token t's j-th smallest expert (the order moe_combine adds
// in). A token whose router saw a NaN (ids = experts everywhere) gets no rows and the position
// MOE_NO_ROW. One warp per expert in both kernels.
constexpr uint32_t MOE_NO_ROW = 0xffffffffu;
// Entries a lane reads before the warp scans them: the warp's loop over every entry is bound by
// the loads' latency, not by the scan.
constexpr int MOE_PLAN_AHEAD = 8;

// counts[e]: the entries that chose e; and MOE_NO_ROW for the positions of NaN tokens.
extern "C" __global__ void moe_plan_count(const uint32_t* ids, int entries, int experts,
                                          uint32_t* counts, uint32_t* positions) {
    const long thread = (long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long i = thread; i < entries; i += (long)gridDim.x * blockDim.x)
        if (ids[i] >= (uint32_t)experts) positions[i] = MOE_NO_ROW;
    const int e = thread / 32, lane = threadIdx.x % 32;
    if (e >= experts) return;
    uint32_t n = 0;
    for (int base = 0; base < entries; base += 32 * MOE_PLAN_AHEAD) {
#pragma unroll
        for (int u = 0; u < MOE_PLAN_AHEAD; ++u) {
            const int i = base + 32 * u + lane;
            n += i < entries && ids[i] == (uint32_t)e;
        }
    }
    for (int s = 16; s > 0; s >>= 1) n += __shfl_xor_sync(0xffffffff, n, s);
    if (lane == 0) counts[e] = n;
}

// Every row of expert e, and e's tiles of `tile_rows` rows for matmul_t_int4_tiled: tiles =
// [count, (e, first row)...], the experts' tiles in expert order.
extern "C" __global__ void moe_plan_place(const uint32_t* ids, const float* weights,
                                          const uint32_t* counts, int tokens, int k, int experts,
                                          int tile_rows, uint32_t* rows_token, float* row_weight,
                                          uint32_t* positions, uint64_t* offsets, uint32_t* tiles) {
    const int e = (int)(((long)blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (e >= experts) return;
    uint32_t first = 0, tile0 = 0;
    for (int f = lane; f < e; f += 32) {
        first += counts[f];
        tile0 += (counts[f] + tile_rows - 1) / tile_rows;
    }
    for (int s = 16; s > 0; s >>= 1) {
        first += __shfl_xor_sync(0xffffffff, first, s);
        tile0 += __shfl_xor_sync(0xffffffff, tile0, s);
    }
    const uint32_t count = counts[e], my_tiles = (count + tile_rows - 1) / tile_rows;
    if (lane == 0) {
        offsets[e] = first;
        if (e == experts - 1) {
            offsets[experts] = first + count;
            tiles[0] = tile0 + my_tiles;
        }
    }
    for (uint32_t j = lane; j < my_tiles; j += 32) {
        tiles[1 + 2 * (tile0 + j)] = e;
        tiles[2 + 2 * (tile0 + j)] = j * tile_rows;
    }
    const int entries = tokens * k;
    uint32_t placed = 0;
    for (int base = 0; base < entries; base += 32 * MOE_PLAN_AHEAD) {
        uint32_t id[MOE_PLAN_AHEAD];  // loaded together: one memory latency per MOE_PLAN_AHEAD steps
#pragma unroll
        for (int u = 0; u < MOE_PLAN_AHEAD; ++u) {
            const int i = base + 32 * u + lane;
            id[u] = i < entries ? ids[i] : MOE_NO_ROW;
        }
#pragma unroll
        for (int u = 0; u < MOE_PLAN_AHEAD; ++u) {
            const int i = base + 32 * u + lane;
            const bool mine = id[u] == (uint32_t)e;
            const uint32_t ballot = __ballot_sync(0xffffffff, mine);
            if (mine) {
                const uint32_t row = first + placed + __popc(ballot & ((1u << lane) - 1));
                const int t = i / k;
                rows_token[row] = t;
                row_weight[row] = weights[i];
                int j = 0;
                for (int s = 0; s < k; ++s) j += ids[t * k + s] < (uint32_t)e;
                positions[t * k + j] = row;
            }
            placed += __popc(ballot);
        }
    }
}

// The plan's rows padded for experts that run as batched GEMMs over groups of one row count
// (model/blocks/moe.rs: experts_stacked lays the host plan out the same way): expert e's rows go
// to dest[e].., followed by pad_to[e] - count padding rows that repeat its first token and weigh
// 0; map[old row] = its padded row. A warp per expert.
extern "C" __global__ void moe_pad_rows(const uint32_t* rows_token, const float* row_weight,
                                        const uint64_t* offsets, const uint32_t* dest,
                                        const uint32_t* pad_to, int experts, uint32_t* padded_token,
                                        float* padded_weight, uint32_t* map) {
    const int e = (int)(((long)blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (e >= experts) return;
    const uint64_t first = offsets[e];
    const uint32_t count = (uint32_t)(offsets[e + 1] - first), to = dest[e];
    for (uint32_t r = lane; r < pad_to[e]; r += 32) {
        const bool real = r < count;
        padded_token[to + r] = rows_token[first + (real ? r : 0)];
        padded_weight[to + r] = real ? row_weight[first + r] : 0.0f;
        if (real) map[first + r] = to + r;
    }
}

// positions[i] (a plan row, or MOE_NO_ROW) through `map`.
extern "C" __global__ void moe_pad_positions(const uint32_t* positions, const uint32_t* map,
                                             int entries, uint32_t* out) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= entries) return;
    out[i] = positions[i] == MOE_NO_ROW ? MOE_NO_ROW : map[positions[i]];
}

// out[t] = residual[t] + ((((0 + w_0 y[pos[t][0]]) + w_1 y[pos[t][1]]) + ...) + shared[t]): a
// token's expert outputs weighted by their router weights (in f32 and rounded to T, or, with
// `compute_dtype_weights`, by the weight rounded to T), summed in the order of `pos` (ascending
// expert), plus the shared expert's output where `shared` is not null, every add rounded to T
// (an add in f32 rounded once is the correctly rounded add in bf16/f16), as a weighted
// multiply, an index_add into zeros, the shared expert's add and the residual add give it. A
// block per token, V values a thread (the _v8 entries: 16-byte vectors where cols and the rows'
// starts allow them).
template <typename T, int V>
__device__ void moe_combine(const T* y, const float* w, const uint32_t* pos, const T* residual,
                            const T* shared, T* out, int k, int cols, int compute_dtype_weights) {
    const long t = blockIdx.x;
    for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V) {
        T acc[V];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = from_f32<T>(0.0f);
        for (int j = 0; j < k; ++j) {
            const uint32_t row = pos[t * k + j];
            if (row == MOE_NO_ROW) continue;  // a NaN token: its residual is NaN
            const float weight = compute_dtype_weights ? to_f32(from_f32<T>(w[row])) : w[row];
            const Pack<T, V> ys = *reinterpret_cast<const Pack<T, V>*>(y + (long)row * cols + c);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const T term = from_f32<T>(to_f32(ys.v[i]) * weight);
                acc[i] = from_f32<T>(to_f32(acc[i]) + to_f32(term));
            }
        }
        if (shared) {
            const Pack<T, V> ss = *reinterpret_cast<const Pack<T, V>*>(shared + t * cols + c);
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] = from_f32<T>(to_f32(acc[i]) + to_f32(ss.v[i]));
        }
        const Pack<T, V> rs = *reinterpret_cast<const Pack<T, V>*>(residual + t * cols + c);
        Pack<T, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i) o.v[i] = from_f32<T>(to_f32(rs.v[i]) + to_f32(acc[i]));
        *reinterpret_cast<Pack<T, V>*>(out + t * cols + c) = o;
    }
}

// ---- extern "C" entry points, one per dtype -------------------------------------------------

#define MOE_ENTRIES(SUFFIX, T)                                                                     \
    extern "C" __global__ void moe_topk_##SUFFIX(const T* l, int e, int k, int norm, uint32_t* ids, \
                                                 float* w, int rows) {                             \
        moe_topk<T>(l, e, k, norm, ids, w, rows);                                                  \
    }                                                                                              \
    extern "C" __global__ void moe_combine_##SUFFIX(const T* y, const float* w, const uint32_t* pos, \
                                                    const T* r, const T* s, T* o, int k, int cols, \
                                                    int cw) {                                      \
        moe_combine<T, 1>(y, w, pos, r, s, o, k, cols, cw);                                        \
    }                                                                                              \
    extern "C" __global__ void moe_combine_v8_##SUFFIX(const T* y, const float* w,                 \
                                                       const uint32_t* pos, const T* r, const T* s, \
                                                       T* o, int k, int cols, int cw) {            \
        moe_combine<T, 8>(y, w, pos, r, s, o, k, cols, cw);                                        \
    }

MOE_ENTRIES(f32, float)
MOE_ENTRIES(bf16, __nv_bfloat16)
MOE_ENTRIES(f16, __half)
