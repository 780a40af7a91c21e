// Hopper warpgroup MMA (wgmma) pieces shared by the sm_90a-only kernel files (attention_sm90.cu,
// int4_gemm_sm90.cu): the MMAs, their fences, and the 128-byte-swizzled shared-memory operands.
#pragma once
#include "common.cuh"

// ---- wgmma, f32 accumulators: m64n64k16 with both operands K-major in shared memory (ss64:
// flash attention's S = Q·Kᵀ), and m64n128k16 and m64n64k16 with A in registers and B in shared
// memory (rs128, rs64), transposed (TRANS_B 1: flash attention's O += P·V) or K-major (0: the
// int4 GEMM's weights · xᵀ). Accumulators are in the m16n8 layout of each warp's 16 rows (value
// 4 * j + e: column block j, row g + 8 * (e / 2), column 2t + e % 2).
template <typename T> struct Wgmma;
// One 16-bit input type's MMAs (PTX_TYPE: its name in the instruction).
#define WGMMA_FOR(T, PTX_TYPE)                                                                        \
    template <> struct Wgmma<T> {                                                                     \
        static __device__ __forceinline__ void ss64(float (&d)[32], uint64_t a, uint64_t b, int acc) {   \
            asm volatile(                                                                             \
                "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                           \
                "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE                  \
                " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                : "l"(a), "l"(b), "r"(acc));                                                          \
        }                                                                                             \
        template <int TRANS_B = 1> static __device__ __forceinline__ void rs128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) { \
            asm volatile(                                                                             \
                "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                              \
                "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE                 \
                " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B));                   \
        }                                                                                             \
        template <int TRANS_B = 1> static __device__ __forceinline__ void rs64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) { \
            asm volatile(                                                                             \
                "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                              \
                "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE                  \
                " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n" \
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B));                   \
        }                                                                                             \
    };
WGMMA_FOR(__nv_bfloat16, "bf16")
WGMMA_FOR(__half, "f16")

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Shared memory written by this thread's cp.async (the generic proxy) becomes visible to the
// tensor cores' reads (the async proxy) after the next barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pins an accumulator register at this point of the program, so that no read of it moves above
// the wait for the asynchronous MMAs that write it.
template <int N> __device__ __forceinline__ void fence_registers(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// ---- shared-memory tiles in the 128-byte swizzle that wgmma reads --------------------------
// A tile of `rows` rows of 128 values (16-bit) is two column halves of [rows][128 bytes]; in
// each 128-byte row, 16-byte chunk c sits at c ^ (row % 8). Halves are 1024-byte aligned.
__device__ __forceinline__ int swizzled(int rows, int row, int chunk) {
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// Matrix descriptor of a 128-byte-swizzled operand at `p`: 8-row groups 1024 bytes apart
// (`sbo`), `lbo` between the 64-value column halves where an MMA spans both (transposed B).
__device__ __forceinline__ uint64_t descriptor(const unsigned char* p, uint32_t lbo, uint32_t sbo) {
    const uint64_t addr = (uint32_t)__cvta_generic_to_shared(p);
    return ((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) after the one `d` describes: only
// the address field (the low 14 bits, in 16-byte units) moves, and an address inside shared
// memory never carries out of it. One 32-bit add instead of building the descriptor anew.
__device__ __forceinline__ uint64_t descriptor_plus(uint64_t d, uint32_t bytes) {
    const uint32_t lo = (uint32_t)d + (bytes >> 4), hi = (uint32_t)(d >> 32);
    return ((uint64_t)hi << 32) | lo;
}
