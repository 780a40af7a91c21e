// The RoPE family (ops/rope.rs, cuda/rope.rs): rotations in PyTorch's rounding, on the
// projections' token-major layout `[tokens, heads, head_dim]` the flash kernels read; the per-head
// norm fused with it, and MLA's flash inputs.
#include "common.cuh"
#include "rms.cuh"

// ---- RoPE ------------------------------------------------------------------------------------

// transformers' `x * cos + rotate_half(x) * sin` with every product and the sum rounded to T,
// as PyTorch runs it in T (checked bitwise against a CPU transcription by `exactscore-bench
// check`). candle's rope kernel lets the compiler contract `x1 * c - x2 * s` into one FMA and so
// differs from PyTorch in the last bit of some values. One pair: a at i, b at i + half; lo and
// hi are their rotations.
template <typename T>
__device__ __forceinline__ void rope_pair(T a, T b, T c, T s, T& lo, T& hi) {
    auto r = [](float v) { return to_f32(from_f32<T>(v)); };
    const float af = to_f32(a), bf = to_f32(b), cf = to_f32(c), sf = to_f32(s);
    lo = from_f32<T>(r(af * cf) - r(bf * sf));
    hi = from_f32<T>(r(bf * cf) + r(af * sf));
}

// One thread per (token, head, VEC consecutive i < half), read and written as VEC-value vectors
// (VEC 8: `half` and every start offset a multiple of 8); `pos[token]` is the token's position
// in its sequence.
template <typename T, int VEC>
__device__ void rope_rotate_half(const T* x, T* out, const int32_t* pos, const T* cos,
                                 const T* sin, int heads, int half, long groups) {
    using V = Pack<T, VEC>;
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= groups) return;
    const int per_row = half / VEC;
    int i = (int)(idx % per_row) * VEC;
    long row = idx / per_row;  // token * heads + head
    long token = row / heads;
    const T* src = x + row * 2 * half;
    T* dst = out + row * 2 * half;
    long t = (long)pos[token] * half + i;
    const V c = *reinterpret_cast<const V*>(cos + t), s = *reinterpret_cast<const V*>(sin + t);
    const V x1 = *reinterpret_cast<const V*>(src + i), x2 = *reinterpret_cast<const V*>(src + i + half);
    V o1, o2;
#pragma unroll
    for (int j = 0; j < VEC; ++j) rope_pair(x1.v[j], x2.v[j], c.v[j], s.v[j], o1.v[j], o2.v[j]);
    *reinterpret_cast<V*>(dst + i) = o1;
    *reinterpret_cast<V*>(dst + i + half) = o2;
}

// transformers' per-head q/k norm (where `weight` is given) then RoPE on the first `rot` values
// of each head of x [tokens, heads, dim], the others passed through, in one pass: the bits of
// rms_norm (norm.cu) then rope_rotate_half on the rotary part (`exactscore-bench check`).
// LANES lanes a head, 8 values each (dim % 8 == 0, rot % 16 == 0, 16-byte aligned rows and
// tables); a lane of the rotary part's first half takes its partner's values from rot / 16
// lanes on, one of the second half from as many back.
template <typename T, typename W, int LANES>
__device__ void head_norm_rope(const T* x, const W* weight, T* out, const int32_t* pos,
                               const T* cos, const T* sin, long rows, int heads, int dim, int rot,
                               float eps) {
    using V = Pack<T, 8>;
    const long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) / LANES;
    const int lane = threadIdx.x % LANES, col = lane * 8, half_lanes = rot / 16;
    const bool mine = row < rows && col < dim;
    const bool first = lane < half_lanes, rotary = lane < 2 * half_lanes;
    V h{};
    Pack<W, 8> w{};
    int position = 0;
    if (mine) {
        h = *reinterpret_cast<const V*>(x + row * dim + col);
        if (weight != nullptr) w = *reinterpret_cast<const Pack<W, 8>*>(weight + col);
        position = pos[(int)row / heads];
    }
    if (weight != nullptr) h = rms_norm_lanes<T, W, LANES>(h, w, mine, dim, eps);
    const int partner = threadIdx.x % 32 + (first ? half_lanes : rotary ? -half_lanes : 0);
    const V p = shfl_pack(h, partner);
    if (!mine) return;
    V o = h;
    if (rotary) {
        const int i = (first ? lane : lane - half_lanes) * 8;
        const long t = (long)position * (rot / 2) + i;
        const V c = *reinterpret_cast<const V*>(cos + t), s = *reinterpret_cast<const V*>(sin + t);
        T unused;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (first) rope_pair(h.v[j], p.v[j], c.v[j], s.v[j], o.v[j], unused);
            else rope_pair(p.v[j], h.v[j], c.v[j], s.v[j], unused, o.v[j]);
        }
    }
    *reinterpret_cast<V*>(out + row * dim + col) = o;
}

// MLA's flash inputs in one pass (model/blocks/mla.rs: flash_attend): per token and head,
// q = [q_nope; rope(q_rot)] (times `qscale[token]` where given: Mistral 4), k = [kv_nope;
// rope(k_rot)] (k_rot shared by the heads), v = kv's value part, each zero-padded to `width`
// (v only where `v_out` is given: the flash kernel reads values that need no padding in place).
// The same arithmetic as the composition it replaces: rope_rotate_half's rounding above, the
// scale a product rounded once, the padding +0. `interleave`: DeepSeek's paired layout, whose
// de-interleaved copy ([evens; odds]) is rotated.
template <typename T>
__device__ T mla_rope_at(const T* x, int j, int rot, bool interleave, const T* cos, const T* sin,
                         long t) {
    const int half = rot / 2;
    const int i = j < half ? j : j - half;
    // x' = interleave ? [x0, x2, ...; x1, x3, ...] : x
    const float a = to_f32(interleave ? x[2 * i] : x[i]);
    const float b = to_f32(interleave ? x[2 * i + 1] : x[i + half]);
    const float c = to_f32(cos[t * half + i]), s = to_f32(sin[t * half + i]);
    auto r = [](float v) { return to_f32(from_f32<T>(v)); };
    return j < half ? from_f32<T>(r(a * c) - r(b * s)) : from_f32<T>(r(b * c) + r(a * s));
}

// mla_rope_at for the 8 values j0..j0 + 7 of one half (j0 and rot / 2 multiples of 8), from
// 16-byte loads of x and of the tables' row `t`: the same products and roundings.
template <typename T>
__device__ Pack<T, 8> mla_rope8(const T* x, int j0, int rot, bool interleave, const T* cos,
                                const T* sin, long t) {
    using V = Pack<T, 8>;
    const int half = rot / 2, first = j0 < half, i0 = first ? j0 : j0 - half;
    V a, b;
    if (interleave) {  // x[2i], x[2i + 1] for i = i0..i0 + 7
        const V lo = *reinterpret_cast<const V*>(x + 2 * i0), hi = *reinterpret_cast<const V*>(x + 2 * i0 + 8);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            a.v[e] = lo.v[2 * e], b.v[e] = lo.v[2 * e + 1];
            a.v[e + 4] = hi.v[2 * e], b.v[e + 4] = hi.v[2 * e + 1];
        }
    } else {
        a = *reinterpret_cast<const V*>(x + i0);
        b = *reinterpret_cast<const V*>(x + i0 + half);
    }
    const V c = *reinterpret_cast<const V*>(cos + t * half + i0), s = *reinterpret_cast<const V*>(sin + t * half + i0);
    auto r = [](float v) { return to_f32(from_f32<T>(v)); };
    V o;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float av = to_f32(a.v[e]), bv = to_f32(b.v[e]), cv = to_f32(c.v[e]), sv = to_f32(s.v[e]);
        o.v[e] = first ? from_f32<T>(r(av * cv) - r(bv * sv)) : from_f32<T>(r(bv * cv) + r(av * sv));
    }
    return o;
}

// One thread per (token, head, 8 consecutive d < width): three 16-byte stores, and 32-bit index
// arithmetic (the launcher checks that the chunks fit), where a thread per value with 64-bit
// divisions spent most of its time finding its place (3.9 ms per window of GLM-4.7-Flash).
// `vec`: nope, v_dim multiples of 8, rot of 16, and q, kv, k_rot and the tables 16-byte aligned:
// each chunk lies in one part (and one rotary half) and takes 16-byte loads, so that the lanes
// of a warp, whichever part they hold, do alike work. Else each value is found one by one.
constexpr int MLA_VALUES = 8;
template <typename T>
__device__ void mla_flash_inputs(const T* q, const T* kv, const T* k_rot, const int32_t* pos,
                                 const T* cos, const T* sin, const T* qscale, T* q_out, T* k_out,
                                 T* v_out, int tokens, int heads, int nope, int rot, int v_dim,
                                 int width, int interleave, int vec) {
    using V = Pack<T, MLA_VALUES>;
    const int chunks = width / MLA_VALUES;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= tokens * heads * chunks) return;
    const int row = idx / chunks;  // token * heads + head
    const int d0 = (idx - row * chunks) * MLA_VALUES;
    const int token = row / heads;
    const long t = pos[token];
    const T* qh = q + (long)row * (nope + rot);
    const T* kvh = kv + (long)row * (nope + v_dim);
    const T* kr = k_rot + (long)token * rot;
    const T zero = from_f32<T>(0.0f);
    V qc, kc, vc;
    if (vec) {
        if (d0 < nope) {
            qc = *reinterpret_cast<const V*>(qh + d0);
            kc = *reinterpret_cast<const V*>(kvh + d0);
        } else if (d0 < nope + rot) {
            qc = mla_rope8(qh + nope, d0 - nope, rot, interleave, cos, sin, t);
            kc = mla_rope8(kr, d0 - nope, rot, interleave, cos, sin, t);
        } else {
#pragma unroll
            for (int j = 0; j < MLA_VALUES; ++j) qc.v[j] = kc.v[j] = zero;
        }
        if (v_out != nullptr) {
            if (d0 < v_dim) {
                vc = *reinterpret_cast<const V*>(kvh + nope + d0);
            } else {
#pragma unroll
                for (int j = 0; j < MLA_VALUES; ++j) vc.v[j] = zero;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < MLA_VALUES; ++j) {
            const int d = d0 + j;
            T qv = zero, kval = zero;
            if (d < nope) {
                qv = qh[d];
                kval = kvh[d];
            } else if (d < nope + rot) {
                qv = mla_rope_at(qh + nope, d - nope, rot, interleave, cos, sin, t);
                kval = mla_rope_at(kr, d - nope, rot, interleave, cos, sin, t);
            }
            qc.v[j] = qv;
            kc.v[j] = kval;
            if (v_out != nullptr) vc.v[j] = d < v_dim ? kvh[nope + d] : zero;
        }
    }
    if (qscale != nullptr) {
        const float scale = to_f32(qscale[token]);
#pragma unroll
        for (int j = 0; j < MLA_VALUES; ++j)
            if (d0 + j < nope + rot) qc.v[j] = from_f32<T>(to_f32(qc.v[j]) * scale);
    }
    const long at = (long)row * width + d0;
    *reinterpret_cast<V*>(q_out + at) = qc;
    *reinterpret_cast<V*>(k_out + at) = kc;
    if (v_out != nullptr) *reinterpret_cast<V*>(v_out + at) = vc;
}

// rope_rotate_half_{SUFFIX} (one pair per thread) and rope_rotate_half_v8_{SUFFIX}
#define ROPE_ENTRY(SUFFIX, T)                                                                         \
    extern "C" __global__ void rope_rotate_half_##SUFFIX(const T* x, T* o, const int32_t* pos,       \
                                                         const T* c, const T* s, int heads,          \
                                                         int half, long groups) {                    \
        rope_rotate_half<T, 1>(x, o, pos, c, s, heads, half, groups);                                \
    }                                                                                                 \
    extern "C" __global__ void rope_rotate_half_v8_##SUFFIX(const T* x, T* o, const int32_t* pos,    \
                                                            const T* c, const T* s, int heads,       \
                                                            int half, long groups) {                 \
        rope_rotate_half<T, 8>(x, o, pos, c, s, heads, half, groups);                                \
    }

// head_norm_rope{,_f32w}_l{LANES}_{SUFFIX}
#define HEAD_NORM_ROPE_ENTRY(SUFFIX, T, LANES)                                                       \
    extern "C" __global__ void head_norm_rope_l##LANES##_##SUFFIX(                                 \
        const T* x, const T* w, T* o, const int32_t* pos, const T* c, const T* s, long rows,         \
        int heads, int dim, int rot, float eps) {                                                     \
        head_norm_rope<T, T, LANES>(x, w, o, pos, c, s, rows, heads, dim, rot, eps);                 \
    }                                                                                                 \
    extern "C" __global__ void head_norm_rope_f32w_l##LANES##_##SUFFIX(                             \
        const T* x, const float* w, T* o, const int32_t* pos, const T* c, const T* s, long rows,     \
        int heads, int dim, int rot, float eps) {                                                     \
        head_norm_rope<T, float, LANES>(x, w, o, pos, c, s, rows, heads, dim, rot, eps);             \
    }
#define HEAD_NORM_ROPE_ENTRIES(SUFFIX, T)                                                             \
    HEAD_NORM_ROPE_ENTRY(SUFFIX, T, 8)                                                                \
    HEAD_NORM_ROPE_ENTRY(SUFFIX, T, 16)                                                               \
    HEAD_NORM_ROPE_ENTRY(SUFFIX, T, 32)

#define MLA_ENTRY(SUFFIX, T)                                                                          \
    extern "C" __global__ void mla_flash_inputs_##SUFFIX(                                             \
        const T* q, const T* kv, const T* kr, const int32_t* pos, const T* c, const T* s,            \
        const T* qs, T* qo, T* ko, T* vo, int tokens, int heads, int nope, int rot, int v_dim,       \
        int width, int interleave, int vec) {                                                         \
        mla_flash_inputs<T>(q, kv, kr, pos, c, s, qs, qo, ko, vo, tokens, heads, nope, rot, v_dim,   \
                            width, interleave, vec);                                                  \
    }

ROPE_ENTRY(bf16, __nv_bfloat16)
ROPE_ENTRY(f16, __half)
HEAD_NORM_ROPE_ENTRIES(bf16, __nv_bfloat16)
HEAD_NORM_ROPE_ENTRIES(f16, __half)
MLA_ENTRY(bf16, __nv_bfloat16)
MLA_ENTRY(f16, __half)
