// The FP8-weight GEMV with x staged once per block in shared memory as f32 (ptx/gemv_fp8w.cu for
// m <= 2, and the single-rank FP8 draft head in ptx/draft_head.cu): the layout the lanes read and
// the 16-weight dot product against it. Staging removes the per-chunk x loads and BF16 unpacking,
// which matters because the FP8 dequantisation already costs about three times the instructions
// of a BF16 GEMV per weight byte. build.py hashes this file into the .ptx of every includer.
#pragma once
#include "common.cuh"

namespace {
// acc += dot(16 weights of chunk w, 16 x values as four float4 from shared memory, already f32).
__device__ __forceinline__ float dot16s(uint4 w, const float4 (&xf)[4], float acc) {
    const uint32_t ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float f[4];
        fp8x4_to_f32(ww[q], f);
        acc = fmaf(f[0], xf[q].x, acc);
        acc = fmaf(f[1], xf[q].y, acc);
        acc = fmaf(f[2], xf[q].z, acc);
        acc = fmaf(f[3], xf[q].w, acc);
    }
    return acc;
}

extern __shared__ float4 x_smem[];

// Shared-memory layout of x: float4 index ((mi * 4 + q) * kc + c) holds elements
// 16c + 4q .. 16c + 4q + 3 of row mi, so lane-consecutive chunks c read consecutive float4s.
// Needs k % 16 == 0, x 16-byte aligned and m * k * 4 bytes of dynamic shared memory; ends with a
// barrier (call from every thread of the block).
__device__ __forceinline__ void stage_x(const uint16_t* __restrict__ x, uint32_t m, uint32_t k) {
    const uint32_t kc = k / 16u;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (uint32_t i = threadIdx.x; i < m * (k / 8u); i += blockDim.x) {
        const uint32_t mi = i / (k / 8u), e8 = i % (k / 8u);  // 8 elements: half of chunk e8 / 2
        const uint32_t c = e8 / 2u, q0 = (e8 % 2u) * 2u;
        const uint4 v = __ldcg(xv + i);  // L2: x may come from a kernel that released early
        x_smem[(mi * 4u + q0) * kc + c] = make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
        x_smem[(mi * 4u + q0 + 1u) * kc + c] = make_float4(bf16_lo(v.z), bf16_hi(v.z), bf16_lo(v.w), bf16_hi(v.w));
    }
    __syncthreads();
}

// Bytes of dynamic shared memory this launch was given (read from the hardware, so a launch
// without the room falls back to a global-x path instead of overrunning it).
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}
}  // namespace
