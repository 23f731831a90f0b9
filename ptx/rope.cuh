// Rotary position embedding, one definition for the kernels that rotate (ptx/rope.cu's queries,
// ptx/dsa_cache.cu's keys); model/kernels/rope.py's rope_ref is its host twin.
//
// The caller uploads inv_freq, f32, one value per pair (rope_dim / 2). Pair i of a row at position
// pos turns by angle = f32(pos) * inv_freq[i] (one f32 multiply: the angle's rounding is part of the
// definition, and at pos ~ 1e6 it is a sizeable fraction of a radian, so both sides must round
// alike), with c = cosf(angle) * attn_factor, s = sinf(angle) * attn_factor:
//   (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)
// Interleaved rows pair (x[2i], x[2i+1]); half-split rows pair (x[i], x[i + rope_dim/2]). Either
// way the result goes back to the pair's own places. Every product and sum is rounded on its own
// (no FMA contraction), as NumPy does them in float32.
//
// sincosf is the accurate one (not __sinf / __cosf, whose error grows with |angle|: angles reach
// 1e6 rad); nothing here may be compiled with -use_fast_math.
#pragma once
#include <stdint.h>
#include <math.h>

// The dims a rotation is defined for: a whole number of pairs, and an indexer part that is either
// unrotated or rotated with the same table (irope_dim == rope_dim), inside its head (<= idim).
// Kernels that get others write nothing (the launch helpers refuse them: model/kernels/rope.py).
__device__ __forceinline__ bool rope_dims_ok(uint32_t rope_dim, uint32_t irope_dim, uint32_t idim) {
    return (rope_dim & 1u) == 0 && (irope_dim == 0 || irope_dim == rope_dim) && irope_dim <= idim;
}

// The element indices of pair i in a rotated part of `rope_dim` elements.
__device__ __forceinline__ uint32_t rope_first(uint32_t i, uint32_t rope_dim, bool interleave) {
    return interleave ? 2u * i : i;
}
__device__ __forceinline__ uint32_t rope_second(uint32_t i, uint32_t rope_dim, bool interleave) {
    return interleave ? 2u * i + 1u : i + rope_dim / 2u;
}

// c and s of pair i at position pos (a u32 row converted to f32 with round to nearest).
__device__ __forceinline__ void rope_cos_sin(uint32_t pos, float inv_freq, float attn_factor, float& c, float& s) {
    const float angle = __fmul_rn(__uint2float_rn(pos), inv_freq);
    float sn, cs;
    sincosf(angle, &sn, &cs);
    c = __fmul_rn(cs, attn_factor);
    s = __fmul_rn(sn, attn_factor);
}

__device__ __forceinline__ void rope_rotate(float x0, float x1, float c, float s, float& y0, float& y1) {
    y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    y1 = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
}
