// The embedding family (ops/embedding.rs, cuda/embedding.rs).
#include "common.cuh"

// ---- row gather (the embedding lookup, a mixture's routed rows): out[r] = table[ids[r]], rows of
// `cols` values. A block per row, V values a thread (the _v8 entries: 16-byte vectors of 8 where
// cols and the rows' starts allow them).
template <typename T, int V>
__device__ void gather_rows(const T* table, const uint32_t* ids, T* out, int cols) {
    const T* src = table + (long)ids[blockIdx.x] * cols;
    T* dst = out + (long)blockIdx.x * cols;
    for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V)
        *reinterpret_cast<Pack<T, V>*>(dst + c) = *reinterpret_cast<const Pack<T, V>*>(src + c);
}

#define EMBEDDING_ENTRIES(SUFFIX, T)                                                                \
    extern "C" __global__ void gather_rows_##SUFFIX(const T* table, const uint32_t* ids, T* o,      \
                                                    int cols) {                                     \
        gather_rows<T, 1>(table, ids, o, cols);                                                     \
    }                                                                                               \
    extern "C" __global__ void gather_rows_v8_##SUFFIX(const T* table, const uint32_t* ids, T* o,   \
                                                       int cols) {                                  \
        gather_rows<T, 8>(table, ids, o, cols);                                                     \
    }

EMBEDDING_ENTRIES(f32, float)
EMBEDDING_ENTRIES(bf16, __nv_bfloat16)
EMBEDDING_ENTRIES(f16, __half)
