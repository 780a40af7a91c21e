// Tensor-core pieces shared by the mma.sync kernels (attention.cu, attention_sm90.cu through
// flash.cuh, int4_gemm.cuh): the MMA and its pair packing, ldmatrix, asynchronous tile copies.
#pragma once
#include "common.cuh"

template <typename T> struct Mma;
// mma.sync for one 16-bit input type, and packing two f32 into that type's pair register.
#define MMA_FOR(T, PTX_TYPE, PAIR, TO_PAIR)                                                           \
    template <> struct Mma<T> {                                                                   \
        static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0,      \
                                                   uint32_t b1) {                                 \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE          \
                         ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"         \
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                        \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));       \
        }                                                                                         \
        static __device__ __forceinline__ uint32_t pack(float lo, float hi) {                     \
            PAIR v = TO_PAIR(lo, hi);                                                             \
            return *reinterpret_cast<uint32_t*>(&v);                                              \
        }                                                                                         \
    };
MMA_FOR(__nv_bfloat16, "bf16", __nv_bfloat162, __floats2bfloat162_rn)
MMA_FOR(__half, "f16", __half2, __floats2half2_rn)

// 16-byte asynchronous copy global -> shared; `valid` false fills the 16 bytes with zeros.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices from shared memory (lane i gives the address of row i % 8 of matrix
// i / 8): as stored, or transposed (the B operand of P·V from row-major V).
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
