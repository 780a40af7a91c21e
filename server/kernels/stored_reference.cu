// Stored references (ops/scoring.rs: reference_rows, served_tail_rows, cuda/scoring.rs): a
// row's top K with the log-mass of the rest, and the served model's side against stored ids.
#include "rows.cuh"

// Mirrors ops/scoring.rs: reference_row and served_tail_row. One 256-thread block per row; a row
// is read a few times (max, sums, four radix passes), never copied off the GPU.

#define STORED_MAX_K 4096

// The order of f32 values as unsigned keys (-0 counted as +0, so that they tie as the CPU's
// comparisons tie them).
__device__ __forceinline__ uint32_t order_key(float v) {
    const uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Block-wide max of f32 (fmaxf: NaN skipped unless every value is NaN), broadcast.
__device__ float block_max(float v, float* s_val) {
    return block_reduce(v, s_val, [](float a, float b) { return fmaxf(a, b); });
}

// The key of rank `rank` (1-based) among the row's values that `counted(i)` admits, counting
// from the largest (LARGEST) or the smallest, by four 8-bit radix passes with shared-memory
// histograms (counts: the result does not depend on thread timing). Returns the key; `*ties`
// gets how many values equal to it the first `rank` include.
template <bool LARGEST, typename T, typename Counted>
__device__ uint32_t select_key(const T* row, int vocab, int rank, Counted counted, int* ties) {
    __shared__ int s_hist[256];
    __shared__ int s_digit, s_rest;
    const int tid = threadIdx.x;
    uint32_t prefix = 0, mask = 0;
    int rest = rank;
    for (int shift = 24; shift >= 0; shift -= 8) {
        s_hist[tid] = 0;  // ROW_THREADS == 256 bins
        __syncthreads();
        for (int i = tid; i < vocab; i += ROW_THREADS) {
            const uint32_t key = order_key(to_f32(row[i]));
            if ((key & mask) == prefix && counted(i)) atomicAdd(&s_hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int before = 0, digit = LARGEST ? 0 : 255;
            for (int b = 0; b < 256; ++b) {
                const int bin = LARGEST ? 255 - b : b;
                if (before + s_hist[bin] >= rest) {
                    digit = bin;
                    break;
                }
                before += s_hist[bin];
            }
            s_digit = digit;
            s_rest = rest - before;
        }
        __syncthreads();
        prefix |= (uint32_t)s_digit << shift;
        mask |= 255u << shift;
        rest = s_rest;
        __syncthreads();
    }
    *ties = rest;
    return prefix;
}

// Block-wide min of f64 (fmin: NaN skipped), broadcast.
__device__ double block_min(double v, double* s_sum) {
    return block_reduce(v, s_sum, [](double a, double b) { return fmin(a, b); });
}

// How many threads of the block before this one have `flag` set (warp ballots), and the total.
__device__ int block_exclusive_count(bool flag, int* s_warp, int* total) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned ballot = __ballot_sync(0xffffffff, flag);
    if (lane == 0) s_warp[warp] = __popc(ballot);
    __syncthreads();
    int before = __popc(ballot & ((1u << lane) - 1)), sum = 0;
    for (int w = 0; w < ROW_THREADS / 32; ++w) {
        if (w < warp) before += s_warp[w];
        sum += s_warp[w];
    }
    __syncthreads();
    *total = sum;
    return before;
}

// Sorts n (a power of two, <= STORED_MAX_K) (key, id) pairs in shared memory: by key descending
// then id ascending (DESCENDING), or by id ascending alone.
template <bool DESCENDING>
__device__ void bitonic_sort(uint32_t* keys, int* ids, int n) {
    const auto first = [&](int a, int b) {
        if (DESCENDING) return keys[a] > keys[b] || (keys[a] == keys[b] && ids[a] < ids[b]);
        return ids[a] < ids[b];
    };
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < n; i += ROW_THREADS) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool up = (i & size) == 0;
                    if (up != first(i, j)) {
                        const uint32_t k = keys[i];
                        keys[i] = keys[j];
                        keys[j] = k;
                        const int d = ids[i];
                        ids[i] = ids[j];
                        ids[j] = d;
                    }
                }
            }
            __syncthreads();
        }
    }
}

__device__ __forceinline__ int pow2_at_least(int n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}

// Per row: the k (<= STORED_MAX_K, <= vocab) largest logits, best first and the lowest id first
// on ties, as log-probabilities, and log Σ p of the others (-inf when none), the sums in f64 as
// ops/scoring.rs: reference_row computes them.
template <typename T>
__device__ void reference_rows(const T* logits, int vocab, int k, int32_t* ids_out,
                               float* lp_out, float* tail_out) {
    __shared__ float s_val[ROW_THREADS];
    __shared__ double s_sum[ROW_THREADS];
    __shared__ int s_warp[ROW_THREADS / 32];
    __shared__ uint32_t s_keys[STORED_MAX_K];
    __shared__ int s_ids[STORED_MAX_K];
    const T* row = logits + (long)blockIdx.x * vocab;
    const int tid = threadIdx.x;

    float m = -INFINITY;
    for (int i = tid; i < vocab; i += ROW_THREADS) m = fmaxf(m, to_f32(row[i]));
    const float max_v = block_max(m, s_val);
    double sum = 0.0;
    for (int i = tid; i < vocab; i += ROW_THREADS) sum += exp((double)(to_f32(row[i]) - max_v));
    const double lse = (double)max_v + log(block_sum(sum, s_sum));

    int ties;
    const uint32_t threshold = select_key<true>(row, vocab, k, [](int) { return true; }, &ties);
    // In id order, chunk by chunk: every value above the threshold, and the first `ties` equal
    // to it; the others' exponentials make the tail.
    int taken = 0, equal_seen = 0;
    double tail = 0.0;
    for (int base = 0; base < vocab; base += ROW_THREADS) {
        const int i = base + tid;
        const float v = i < vocab ? to_f32(row[i]) : 0.0f;
        const uint32_t key = order_key(v);
        const bool equal = i < vocab && key == threshold;
        int equal_total;
        const int equal_rank = equal_seen + block_exclusive_count(equal, s_warp, &equal_total);
        const bool take = i < vocab && (key > threshold || (equal && equal_rank < ties));
        int take_total;
        const int at = taken + block_exclusive_count(take, s_warp, &take_total);
        if (take) {
            s_keys[at] = key;
            s_ids[at] = i;
        } else if (i < vocab) {
            tail += exp((double)(v - max_v));
        }
        taken += take_total;
        equal_seen += equal_total;
    }
    const int n = pow2_at_least(k);
    for (int j = k + tid; j < n; j += ROW_THREADS) {
        s_keys[j] = 0;
        s_ids[j] = 0x7fffffff;
    }
    __syncthreads();
    bitonic_sort<true>(s_keys, s_ids, n);
    const double tail_sum = block_sum(tail, s_sum);
    const long out = (long)blockIdx.x * k;
    for (int j = tid; j < k; j += ROW_THREADS) {
        ids_out[out + j] = s_ids[j];
        lp_out[out + j] = (float)((double)key_value(s_keys[j]) - lse);
    }
    if (tid == 0) tail_out[blockIdx.x] = (float)(((double)max_v + log(tail_sum)) - lse);
}

// Per row, against the stored ids `ids[row * k ..]` (distinct, < vocab): log q of each (f64),
// log Q of the tail (the tokens not stored), log q(target) (f32), the argmax (lowest id on
// ties), and the worst tail: max Σ p_j (-log q_j) over 0 <= p_j <= cap[row], Σ p_j = mass[row]
// (the cap on the tail's least likely tokens, the rest on the next). Mirrors ops/scoring.rs:
// served_tail_row; its sums in another order.
template <typename T>
__device__ void served_tail_rows(const T* logits, int vocab, const int32_t* ids, int k,
                                 const int32_t* targets, const double* mass, const double* cap,
                                 double* lp_out, double* tail_out, double* worst_out,
                                 float* target_out, int32_t* argmax_out) {
    __shared__ float s_val[ROW_THREADS];
    __shared__ int s_idx[ROW_THREADS];
    __shared__ double s_sum[ROW_THREADS];
    __shared__ uint32_t s_unused[STORED_MAX_K];
    __shared__ int s_stored[STORED_MAX_K];
    const T* row = logits + (long)blockIdx.x * vocab;
    const int32_t* stored = ids + (long)blockIdx.x * k;
    const int tid = threadIdx.x;

    // The stored ids sorted, for a binary search per value.
    const int n = pow2_at_least(k);
    for (int j = tid; j < n; j += ROW_THREADS) s_stored[j] = j < k ? stored[j] : 0x7fffffff;
    __syncthreads();
    bitonic_sort<false>(s_unused, s_stored, n);
    const auto in_tail = [&](int i) {
        int lo = 0, hi = k;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (s_stored[mid] < i) lo = mid + 1; else hi = mid;
        }
        return lo == k || s_stored[lo] != i;
    };

    float best = -INFINITY;
    int best_i = 0x7fffffff;
    for (int i = tid; i < vocab; i += ROW_THREADS) {
        const float v = to_f32(row[i]);
        if (better(v, i, best, best_i)) {
            best = v;
            best_i = i;
        }
    }
    float m = -INFINITY;
    for (int i = tid; i < vocab; i += ROW_THREADS) m = fmaxf(m, to_f32(row[i]));
    const float max_v = block_max(m, s_val);
    block_best(best, best_i, s_val, s_idx);
    double all = 0.0, tail = 0.0, smallest = INFINITY;
    for (int i = tid; i < vocab; i += ROW_THREADS) {
        const float v = to_f32(row[i]);
        const double e = exp((double)(v - max_v));
        all += e;
        if (in_tail(i)) {
            tail += e;
            smallest = fmin(smallest, (double)v);
        }
    }
    const double lse = (double)max_v + log(block_sum(all, s_sum));
    const double log_tail = ((double)max_v + log(block_sum(tail, s_sum))) - lse;
    smallest = block_min(smallest, s_sum);
    const int tokens = vocab - k;
    const double row_mass = mass[blockIdx.x], row_cap = cap[blockIdx.x];
    double worst = 0.0;
    if (row_mass > 0.0 && row_cap > 0.0 && tokens > 0) {
        const double f = floor(row_mass / row_cap);
        const int full = f >= (double)tokens ? tokens : (int)f;
        const double rest = fmax(row_mass - full * row_cap, 0.0);
        // The (full + 1)-th smallest tail logit (the largest when every token is full): below
        // it every token takes the cap.
        int ties;
        const int rank = full < tokens ? full + 1 : tokens;
        const uint32_t threshold = select_key<false>(row, vocab, rank, in_tail, &ties);
        double below = 0.0;
        int count = 0;
        for (int i = tid; i < vocab; i += ROW_THREADS) {
            const float v = to_f32(row[i]);
            if (order_key(v) < threshold && in_tail(i)) {
                below += lse - (double)v;
                ++count;
            }
        }
        below = block_sum(below, s_sum);
        count = (int)block_sum((double)count, s_sum);
        const double at = lse - (double)key_value(threshold);
        // No mass on a token adds nothing, even at q = 0 (an infinite surprise): 0 · ∞ is 0.
        const auto times = [](double p, double s) { return p > 0.0 ? p * s : 0.0; };
        if (full < tokens) {
            worst = row_cap * (below + times((double)(full - count), at)) + times(rest, at);
        } else {
            // every tail token full: all of them, and the rounding's rest on the largest
            // surprise (the smallest logit)
            const double all_tail = below + times((double)(tokens - count), at);
            worst = row_cap * all_tail + times(rest, lse - smallest);
        }
    }
    if (tid == 0) {
        const int r = blockIdx.x, t = targets[r];
        tail_out[r] = log_tail;
        worst_out[r] = worst;
        target_out[r] = (float)((double)to_f32(row[t]) - lse);
        argmax_out[r] = best_i;
    }
    for (int j = tid; j < k; j += ROW_THREADS)
        lp_out[(long)blockIdx.x * k + j] = (double)to_f32(row[stored[j]]) - lse;
}

// ---- extern "C" entry points, one per dtype -------------------------------------------------

#define STORED_ENTRIES(SUFFIX, T)                                                                  \
    extern "C" __global__ void reference_rows_##SUFFIX(const T* l, int vocab, int k, int32_t* ids,  \
                                                       float* lp, float* tail) {                   \
        reference_rows<T>(l, vocab, k, ids, lp, tail);                                             \
    }                                                                                              \
    extern "C" __global__ void served_tail_rows_##SUFFIX(                                          \
        const T* l, int vocab, const int32_t* ids, int k, const int32_t* t, const double* mass,    \
        const double* cap, double* lp, double* tail, double* worst, float* tlp, int32_t* top) {    \
        served_tail_rows<T>(l, vocab, ids, k, t, mass, cap, lp, tail, worst, tlp, top);            \
    }

STORED_ENTRIES(f32, float)
STORED_ENTRIES(bf16, __nv_bfloat16)
STORED_ENTRIES(f16, __half)
