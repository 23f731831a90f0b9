// Per-row FP8 E4M3: scale[r] = absmax(x[r]) / 448 (1 for an all-zero row), q[r] = x[r] / scale[r]
// rounded to nearest even and saturated to +-448 (cvt.rn.satfinite, what runtime.dtypes does on
// the host by clipping before the cast). One block per row; the division is the IEEE one.
#include "common.cuh"
#include <cuda_fp8.h>

extern "C" __global__ void __launch_bounds__(1024) quantize_fp8(const uint16_t* __restrict__ x,
                                                                uint8_t* __restrict__ q,
                                                                float* __restrict__ scale,
                                                                uint32_t n, uint32_t k) {
    __shared__ float scratch[32];
    const uint32_t row = blockIdx.x;
    if (row >= n) return;
    const uint16_t* xr = x + (size_t)row * k;
    uint8_t* qr = q + (size_t)row * k;
    // 16-byte loads and 8-byte stores when every row is aligned: element-wise it took 2.5 times as
    // long (see BENCHMARKS.md, "Runtime kernels: notes behind the numbers", quantize_fp8).
    const bool vec = (k % 8u == 0) && aligned16(x) && ((uintptr_t)q % 8u == 0);

    float amax = 0.0f;
    if (vec) {
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        for (uint32_t c = threadIdx.x; c < k / 8u; c += blockDim.x) {
            const uint4 v = xv[c];
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(bf16_lo(v.x)), fabsf(bf16_hi(v.x))),
                                     fmaxf(fabsf(bf16_lo(v.y)), fabsf(bf16_hi(v.y)))));
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(bf16_lo(v.z)), fabsf(bf16_hi(v.z))),
                                     fmaxf(fabsf(bf16_lo(v.w)), fabsf(bf16_hi(v.w)))));
        }
    } else {
        for (uint32_t i = threadIdx.x; i < k; i += blockDim.x) amax = fmaxf(amax, fabsf(bf16_bits_to_f32(xr[i])));
    }
    amax = block_max(amax, scratch);
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (threadIdx.x == 0) scale[row] = s;

    if (vec) {
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        uint2* qv = reinterpret_cast<uint2*>(qr);
        for (uint32_t c = threadIdx.x; c < k / 8u; c += blockDim.x) {
            const uint4 v = xv[c];
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
            uint32_t packed[2] = {0u, 0u};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint32_t lo = __nv_cvt_float_to_fp8(bf16_lo(w[j]) / s, __NV_SATFINITE, __NV_E4M3);
                const uint32_t hi = __nv_cvt_float_to_fp8(bf16_hi(w[j]) / s, __NV_SATFINITE, __NV_E4M3);
                packed[j / 2] |= (lo | (hi << 8)) << (16 * (j % 2));
            }
            qv[c] = make_uint2(packed[0], packed[1]);
        }
    } else {
        for (uint32_t i = threadIdx.x; i < k; i += blockDim.x)
            qr[i] = (uint8_t)__nv_cvt_float_to_fp8(bf16_bits_to_f32(xr[i]) / s, __NV_SATFINITE, __NV_E4M3);
    }
}
