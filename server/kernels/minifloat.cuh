// Minifloat decoding and rounding shared by the dequantization and QDQ kernels (dequant.cu) and
// the fused QDQ of the norm kernels (norm.cu). All arithmetic is IEEE f32 (no fast math), so each
// result is bit-identical to its CPU reference (ops/minifloat.rs).
#pragma once
#include "common.cuh"

// Minifloat decoding by building the f32 bit pattern: every e4m3 and e2m1 value is exact in f32,
// so this equals the CPU reference (ops/minifloat.rs) bit for bit, without table lookups
// (a __constant__ table serialises a warp whose lanes read different entries) or ldexpf.
__device__ __forceinline__ float fp8_e4m3_to_f32(uint8_t b) {
    uint32_t exp = (b >> 3) & 0xF, man = b & 7;
    float mag;
    if (exp == 0) mag = (float)man * 0.001953125f;  // man * 2^-9
    else if (exp == 15 && man == 7) mag = __int_as_float(0x7fc00000);
    else mag = __uint_as_float(((exp + 120) << 23) | (man << 20));  // (1 + man / 8) * 2^(exp - 7)
    return (b & 0x80) ? -mag : mag;
}

__device__ __forceinline__ float fp4_e2m1_to_f32(uint32_t nibble) {
    uint32_t exp = (nibble >> 1) & 3, man = nibble & 1;
    // exp 0: 0 or 0.5; else (1 + man / 2) * 2^(exp - 1)
    float mag = exp == 0 ? 0.5f * man : __uint_as_float(((exp + 126) << 23) | (man << 22));
    return (nibble & 8) ? -mag : mag;
}

// Round to nearest even on a float grid with `mant` explicit bits and smallest normal exponent
// `min_exp` (see ops/minifloat.rs: round_to_grid). The grid step is 2^e with -9 <= e <= 124
// here, so 2^e and 2^-e are normal floats built from exponent bits and x * 2^-e equals x / 2^e
// exactly: no division and no ldexpf, which made the activation QDQ compute-bound.
__device__ __forceinline__ float round_to_grid(float x, int min_exp, int mant) {
    if (x == 0.0f || !isfinite(x)) return x;
    int binade = (int)((__float_as_uint(x) >> 23) & 0xFF) - 127;
    int e = max(binade, min_exp) - mant;
    float step = __uint_as_float((uint32_t)(e + 127) << 23);
    float inv_step = __uint_as_float((uint32_t)(127 - e) << 23);
    return copysignf(rintf(x * inv_step) * step, x);
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The e4m3fn byte of a value already on the e4m3 grid (round_to_grid(x, -6, 3) of x clamped to
// ±448): exact, by moving the f32 exponent and top three mantissa bits (ops/minifloat.rs:
// fp8_e4m3_from_grid). Subnormals (below 2^-6) are multiples of 2^-9.
__device__ __forceinline__ uint8_t fp8_e4m3_from_grid(float v) {
    uint32_t bits = __float_as_uint(v);
    uint32_t sign = (bits >> 24) & 0x80;
    float mag = fabsf(v);
    if (mag < 0.015625f) return (uint8_t)(sign | (uint32_t)(mag * 512.0f));
    uint32_t exp = ((bits >> 23) & 0xFF) - 120;  // (e - 127) + 7
    return (uint8_t)(sign | (exp << 3) | ((bits >> 20) & 7));
}
