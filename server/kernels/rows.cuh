// Row-per-block helpers shared by the scoring kernels (scoring.cu, stored_reference.cu): one
// block of ROW_THREADS threads per row of a vocabulary, block-wide best and reductions in a fixed
// order (deterministic).
#pragma once
#include "common.cuh"

#define ROW_THREADS 256

__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
    return a > b || (a == b && ia < ib);
}

// Block-wide best (value, lowest index on ties), broadcast to every thread.
__device__ void block_best(float& v, int& i, float* s_val, int* s_idx) {
    int tid = threadIdx.x;
    s_val[tid] = v;
    s_idx[tid] = i;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s && better(s_val[tid + s], s_idx[tid + s], s_val[tid], s_idx[tid])) {
            s_val[tid] = s_val[tid + s];
            s_idx[tid] = s_idx[tid + s];
        }
        __syncthreads();
    }
    v = s_val[0];
    i = s_idx[0];
    __syncthreads();
}

// Block-wide reduction of one value a thread by `op`, in a fixed tree (deterministic),
// broadcast to every thread; `s`: ROW_THREADS of shared scratch.
template <typename T, typename Op>
__device__ T block_reduce(T v, T* s, Op op) {
    const int tid = threadIdx.x;
    s[tid] = v;
    __syncthreads();
    for (int w = ROW_THREADS / 2; w > 0; w >>= 1) {
        if (tid < w) s[tid] = op(s[tid], s[tid + w]);
        __syncthreads();
    }
    const T total = s[0];
    __syncthreads();
    return total;
}

// Block-wide sum in f64, broadcast to every thread.
__device__ double block_sum(double v, double* s_sum) {
    return block_reduce(v, s_sum, [](double a, double b) { return a + b; });
}
