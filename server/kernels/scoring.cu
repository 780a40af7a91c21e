// The scoring family (ops/scoring.rs, cuda/scoring.rs): fused log-softmax + gather + argmax +
// top-k, the KL divergence of two models' rows, and /diff's per-row sums of two states. Each
// mirrors its CPU reference in ops/scoring.rs; only per-row numbers leave the GPU.
#include "common.cuh"
#include "rows.cuh"

// ---- fused scoring: one block (256 threads) per row -----------------------------------------

#define MAX_TOP_K 20

// A running log-sum-exp: the largest value seen and the sum of exp(v - max) over the values.
struct Lse {
    float max, sum;
};

// The largest of N values as lse_add and the argmax need it: fmaxf from v[0] on, so NaN is
// skipped unless every value is NaN.
template <int N>
__device__ __forceinline__ float vector_max(const float (&v)[N]) {
    float m = v[0];
#pragma unroll
    for (int j = 1; j < N; ++j) m = fmaxf(m, v[j]);
    return m;
}

// Adds N values whose vector_max is `m`: one rescale per call at most, and N independent
// exponentials (one per value, each against one running max, as a serial per-value update
// would have chained them).
template <int N>
__device__ __forceinline__ void lse_add(Lse& a, const float (&v)[N], float m) {
    if (m == -INFINITY) return;  // nothing to add (also keeps exp(-inf - -inf) out)
    if (m > a.max) {
        a.sum *= expf(a.max - m);
        a.max = m;
    }
    float e[N];
#pragma unroll
    for (int j = 0; j < N; ++j) e[j] = expf(v[j] - a.max);
    // pairwise, so that the additions do not wait on each other either
#pragma unroll
    for (int w = 1; w < N; w *= 2) {
#pragma unroll
        for (int j = 0; j + w < N; j += 2 * w) e[j] += e[j + w];
    }
    a.sum += e[0];
}

__device__ __forceinline__ Lse lse_merge(Lse a, Lse b) {
    const float m = fmaxf(a.max, b.max);
    if (m == -INFINITY) return a;
    return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// The `limit` (<= CAP) best values of a row with their ids, best first (lowest id on ties): each
// thread keeps its own sorted list, then `limit` rounds of a block-wide best over the lists'
// heads, whose owner advances. Every thread calls `found(k, value, id)` for round k. Ids past a
// row shorter than `limit` are 0x7fffffff. `s_val`, `s_idx`: the caller's shared scratch.
template <int CAP, typename T, typename Found>
__device__ void block_top(const T* row, int vocab, int limit, float* s_val, int* s_idx,
                          Found found) {
    __shared__ int s_owner[ROW_THREADS];
    const int tid = threadIdx.x;
    float vals[CAP];
    int ids[CAP];
    int n = 0;
    for (int i = tid; i < vocab; i += ROW_THREADS) {
        float v = to_f32(row[i]);
        if (n == limit && !better(v, i, vals[n - 1], ids[n - 1])) continue;
        int at = n < limit ? n++ : n - 1;
        while (at > 0 && better(v, i, vals[at - 1], ids[at - 1])) {
            vals[at] = vals[at - 1];
            ids[at] = ids[at - 1];
            --at;
        }
        vals[at] = v;
        ids[at] = i;
    }
    int head = 0;
    for (int k = 0; k < limit; ++k) {
        s_val[tid] = head < n ? vals[head] : -INFINITY;
        s_idx[tid] = head < n ? ids[head] : 0x7fffffff;
        s_owner[tid] = tid;
        __syncthreads();
        for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
            if (tid < s && better(s_val[tid + s], s_idx[tid + s], s_val[tid], s_idx[tid])) {
                s_val[tid] = s_val[tid + s];
                s_idx[tid] = s_idx[tid + s];
                s_owner[tid] = s_owner[tid + s];
            }
            __syncthreads();
        }
        found(k, s_val[0], s_idx[0]);
        if (tid == s_owner[0]) ++head;
        __syncthreads();
    }
}

// Per row: log-softmax over the vocabulary (f32), log p(target), argmax (lowest id on ties) and
// the top-k. `targets[row] < 0` means no target. Only these small vectors leave the GPU.
// One pass over the row gives the argmax and the log-sum-exp (online, as flash attention
// rescales its sums), read as VEC-value vectors (VEC 8: vocab and the row start multiples of
// 8); the top-k, when asked for, takes a second pass.
template <typename T, int VEC>
__device__ void score_rows(const T* logits, int vocab, const int32_t* targets, int top_k,
                           float* target_lp, int32_t* argmax_id, float* argmax_lp,
                           int32_t* topk_id, float* topk_lp) {
    using V = Pack<T, VEC>;
    __shared__ float s_val[ROW_THREADS];
    __shared__ int s_idx[ROW_THREADS];
    __shared__ Lse s_part[ROW_THREADS / 32];
    __shared__ float s_lse;
    const T* row = logits + (long)blockIdx.x * vocab;
    int tid = threadIdx.x;

    float best = -INFINITY;
    int best_i = 0x7fffffff;
    Lse lse = {-INFINITY, 0.0f};
    for (int i = tid * VEC; i < vocab; i += ROW_THREADS * VEC) {
        const V x = *reinterpret_cast<const V*>(row + i);
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = to_f32(x.v[j]);
        const float m = vector_max(v);
        // A thread's indices only grow, so a vector can only hold a better value when its max is
        // at least the best so far (NaN compares false, and `better` never picks one); rare
        // after the first vectors, so the exact per-value comparison runs only then.
        if (m >= best) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                if (better(v[j], i + j, best, best_i)) {
                    best = v[j];
                    best_i = i + j;
                }
            }
        }
        lse_add(lse, v, m);
    }
    for (int o = 16; o > 0; o >>= 1)
        lse = lse_merge(lse, {__shfl_xor_sync(0xffffffff, lse.max, o), __shfl_xor_sync(0xffffffff, lse.sum, o)});
    if (tid % 32 == 0) s_part[tid / 32] = lse;
    block_best(best, best_i, s_val, s_idx);  // its barriers also publish s_part
    const float max_v = best;
    const int max_i = best_i;

    if (tid == 0) {
        Lse total = s_part[0];
        for (int w = 1; w < ROW_THREADS / 32; ++w) total = lse_merge(total, s_part[w]);
        const float lse_v = total.max + logf(total.sum);
        s_lse = lse_v;
        int t = targets[blockIdx.x];
        target_lp[blockIdx.x] = t >= 0 ? to_f32(row[t]) - lse_v : NAN;
        argmax_id[blockIdx.x] = max_i;
        argmax_lp[blockIdx.x] = max_v - lse_v;
    }
    if (top_k <= 0) return;
    __syncthreads();

    block_top<MAX_TOP_K>(row, vocab, top_k, s_val, s_idx, [&](int k, float v, int id) {
        if (tid == 0) {
            topk_id[(long)blockIdx.x * top_k + k] = id;
            topk_lp[(long)blockIdx.x * top_k + k] = v - s_lse;
        }
    });
}

// ---- KL-divergence: one block (256 threads) per row of both models' logits --------------------

// The KLD_TOP best ids of a row (block_top; mirrors ops/scoring.rs: top_ids_and_lse). Thread
// 0 writes `out` (shared); every thread gets the best value back.
#define KLD_TOP 5
template <typename T>
__device__ float block_top_ids(const T* row, int vocab, float* s_val, int* s_idx, int* out) {
    float best = -INFINITY;
    block_top<KLD_TOP>(row, vocab, KLD_TOP, s_val, s_idx, [&](int k, float v, int id) {
        if (k == 0) best = v;
        if (threadIdx.x == 0) out[k] = id;
    });
    return best;
}

// Bit K - 1 set when the first K ids of both lists are the same set, K = 1..KLD_TOP.
__device__ int top_k_agreement(const int* a, const int* b) {
    int mask = 0;
    for (int k = 1; k <= KLD_TOP; ++k) {
        bool same = true;
        for (int i = 0; i < k; ++i) {
            bool found = false;
            for (int j = 0; j < k; ++j) found |= a[i] == b[j];
            same &= found;
        }
        mask |= (int)same << (k - 1);
    }
    return mask;
}

// Per row: KL(reference || model) = sum_v p_ref(v) (log p_ref(v) - log p_model(v)) and the
// reverse KL(model || reference), from the f32 logits of both models, with the log-sum-exps and
// the sums in f64 (mirrors ops/scoring.rs: kld_row); identical rows give exactly 0. Also both
// models' log p(target), argmax ids, the top-K agreement mask and the reference's top-token
// probability: only these per-row numbers leave the GPU.
template <typename T>
__device__ void kld_rows(const T* ref_logits, const T* logits, int vocab, const int32_t* targets,
                         double* kld, double* reverse_kld, double* ref_top_p, float* lp,
                         float* ref_lp, int32_t* top, int32_t* ref_top, int32_t* agreement) {
    __shared__ float s_val[ROW_THREADS];
    __shared__ int s_idx[ROW_THREADS];
    __shared__ double s_sum[ROW_THREADS];
    __shared__ int s_top_r[KLD_TOP], s_top_m[KLD_TOP];
    const T* r = ref_logits + (long)blockIdx.x * vocab;
    const T* m = logits + (long)blockIdx.x * vocab;
    int tid = threadIdx.x;

    const float best_r = block_top_ids(r, vocab, s_val, s_idx, s_top_r);
    const float best_m = block_top_ids(m, vocab, s_val, s_idx, s_top_m);

    double sum_r = 0.0, sum_m = 0.0;
    for (int i = tid; i < vocab; i += ROW_THREADS) {
        sum_r += exp((double)(to_f32(r[i]) - best_r));
        sum_m += exp((double)(to_f32(m[i]) - best_m));
    }
    double lse_r = best_r + log(block_sum(sum_r, s_sum));
    double lse_m = best_m + log(block_sum(sum_m, s_sum));

    double kl = 0.0, reverse = 0.0;
    for (int i = tid; i < vocab; i += ROW_THREADS) {
        double log_p_ref = (double)to_f32(r[i]) - lse_r;
        double log_p = (double)to_f32(m[i]) - lse_m;
        kl += exp(log_p_ref) * (log_p_ref - log_p);
        reverse += exp(log_p) * (log_p - log_p_ref);
    }
    kl = block_sum(kl, s_sum);
    reverse = block_sum(reverse, s_sum);
    if (tid == 0) {
        int row = blockIdx.x, t = targets[row];
        kld[row] = kl;
        reverse_kld[row] = reverse;
        ref_top_p[row] = exp((double)best_r - lse_r);
        lp[row] = (float)((double)to_f32(m[t]) - lse_m);
        ref_lp[row] = (float)((double)to_f32(r[t]) - lse_r);
        top[row] = s_top_m[0];
        ref_top[row] = s_top_r[0];
        agreement[row] = top_k_agreement(s_top_r, s_top_m);
    }
}

// ---- /diff: per row of two f32 states, (Σ a·b, Σ a², Σ b², Σ (a − b)²) in f64 -----------------
// One 256-thread block per row. Products of two f32 values are exact in f64, so the sums differ
// from any other f64 order by f64 rounding alone.
extern "C" __global__ void row_pair_sums(const float* a, const float* b, double* out, int cols) {
    __shared__ double s_red[4][ROW_THREADS];
    const long base = (long)blockIdx.x * cols;
    const int tid = threadIdx.x;
    double v[4] = {0.0, 0.0, 0.0, 0.0};
    for (int i = tid; i < cols; i += ROW_THREADS) {
        const double x = a[base + i], y = b[base + i], d = x - y;
        v[0] += x * y;
        v[1] += x * x;
        v[2] += y * y;
        v[3] += d * d;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) s_red[q][tid] = v[q];
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s)
#pragma unroll
            for (int q = 0; q < 4; ++q) s_red[q][tid] += s_red[q][tid + s];
        __syncthreads();
    }
    if (tid < 4) out[(long)blockIdx.x * 4 + tid] = s_red[tid][0];
}

// ---- extern "C" entry points, one per dtype -------------------------------------------------

#define SCORING_ENTRIES(SUFFIX, T)                                                                 \
    extern "C" __global__ void score_rows_##SUFFIX(const T* l, int vocab, const int32_t* t, int k, \
                                                   float* tl, int32_t* ai, float* al, int32_t* ti, \
                                                   float* tlp) {                                   \
        score_rows<T, 1>(l, vocab, t, k, tl, ai, al, ti, tlp);                                     \
    }                                                                                              \
    extern "C" __global__ void score_rows_v8_##SUFFIX(const T* l, int vocab, const int32_t* t, int k, \
                                                      float* tl, int32_t* ai, float* al, int32_t* ti, \
                                                      float* tlp) {                                \
        score_rows<T, 8>(l, vocab, t, k, tl, ai, al, ti, tlp);                                     \
    }                                                                                              \
    extern "C" __global__ void kld_rows_##SUFFIX(const T* r, const T* l, int vocab, const int32_t* t, \
                                                 double* k, double* rk, double* rp, float* lp,     \
                                                 float* rlp, int32_t* top, int32_t* rtop,          \
                                                 int32_t* agree) {                                 \
        kld_rows<T>(r, l, vocab, t, k, rk, rp, lp, rlp, top, rtop, agree);                         \
    }

SCORING_ENTRIES(f32, float)
SCORING_ENTRIES(bf16, __nv_bfloat16)
SCORING_ENTRIES(f16, __half)
