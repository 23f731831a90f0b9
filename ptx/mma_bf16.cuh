// Tensor-core building blocks shared by the kernels that multiply weight rows with activation rows
// on mma.sync.m16n8k16 (BF16 inputs, f32 accumulation): the FP8 experts (ptx/moe.cu) and the
// batched projections (ptx/proj_mma.cu). build.py hashes this file into the .ptx of every includer.
//
// E4M3 widening: a byte permute with sign replication gives each E4M3 byte b the 16 bits sext(b):b;
// shifted left by 4 and masked to 0x87F0, that is sign << 15 | (b & 0x7F) << 4, the BF16 of the
// value times 2^-120 (exponent field 0..15, a BF16 normal, or subnormal for the E4M3 subnormals),
// and one BF16x2 multiply by 2^120 (which takes subnormal inputs: no .ftz exists for BF16) restores
// it exactly. Per 4 weights: 2 permutes, 2 shifts, 2 masks, 2 multiplies (the f16 route through
// cvt.rn.f16x2.e4m3x2 took 10: ptxas split its sign merge into two LOP3s). The NaN codes 0x7F /
// 0xFF come out 480 / -480, not NaN (an E4M3 weight is never NaN: quantize saturates).
#pragma once
#include "common.cuh"

namespace {
constexpr uint32_t BF16X2_2POW120 = 0x7B807B80u;

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Four E4M3 bytes (element 0 in the low byte) -> BF16 pairs (elements 0, 1) and (2, 3), exact (the
// file comment above). prmt selector nibbles 8 + i replicate byte i's sign over a byte.
__device__ __forceinline__ void e4m3x4_to_bf16x2(uint32_t q, uint32_t& lo, uint32_t& hi) {
    uint32_t p01, p23;
    asm("prmt.b32 %0, %1, %1, 0x9180;" : "=r"(p01) : "r"(q));  // sext(b1):b1 | sext(b0):b0
    asm("prmt.b32 %0, %1, %1, 0xB3A2;" : "=r"(p23) : "r"(q));  // sext(b3):b3 | sext(b2):b2
    lo = bf16x2_mul((p01 << 4) & 0x87F087F0u, BF16X2_2POW120);
    hi = bf16x2_mul((p23 << 4) & 0x87F087F0u, BF16X2_2POW120);
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The end of a 128-column FP8 block: acc += its scale times its partial sums (rows g: s0, rows
// g + 8: s1), in the host twin's two roundings (model/kernels/bgemv_fp8.py fp8_block_dot); the
// partial sums restart from 0.
__device__ __forceinline__ void fp8_block_done(float (&acc)[4], float (&part)[4], float s0, float s1) {
    acc[0] = __fadd_rn(acc[0], __fmul_rn(s0, part[0]));
    acc[1] = __fadd_rn(acc[1], __fmul_rn(s0, part[1]));
    acc[2] = __fadd_rn(acc[2], __fmul_rn(s1, part[2]));
    acc[3] = __fadd_rn(acc[3], __fmul_rn(s1, part[3]));
    part[0] = part[1] = part[2] = part[3] = 0.0f;
}
}  // namespace
