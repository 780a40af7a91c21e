// The embedding family (ops/embedding.rs, cuda/embedding.rs).
#include "common.cuh"

// ---- embedding lookup: out[i] = table[ids[i]], rows of `cols` values; one thread per value ---

template <typename T>
__device__ void gather_rows(const T* table, const uint32_t* ids, T* out, int cols, long n) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    out[idx] = table[(long)ids[idx / cols] * cols + idx % cols];
}

#define EMBEDDING_ENTRIES(SUFFIX, T)                                                               \
    extern "C" __global__ void gather_rows_##SUFFIX(const T* table, const uint32_t* ids, T* o,     \
                                                    int cols, long n) {                            \
        gather_rows<T>(table, ids, o, cols, n);                                                    \
    }

EMBEDDING_ENTRIES(f32, float)
EMBEDDING_ENTRIES(bf16, __nv_bfloat16)
EMBEDDING_ENTRIES(f16, __half)
