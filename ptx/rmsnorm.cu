// RMSNorm over rows of BF16: out = x / sqrt(mean(x^2) + eps) * w, f32 math, BF16 store.
// One block per row (grid = rows, block = 256, see runtime/kernels/rmsnorm.py). The division and
// square root are the IEEE ones (no fast-math), in the host twin's order: (x / r) * w.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_bf16(const uint16_t* __restrict__ x,
                                                                const uint16_t* __restrict__ w,
                                                                uint16_t* __restrict__ out,
                                                                uint32_t rows, uint32_t n, float eps) {
    __shared__ float scratch[32];
    const uint32_t row = blockIdx.x;
    if (row >= rows) return;
    const uint16_t* xr = x + (size_t)row * n;
    uint16_t* outr = out + (size_t)row * n;
    // Rows of a [rows, n] tensor are 16-byte aligned only when n % 8 == 0 and the base is.
    const bool vec = (n % 8u == 0) && aligned16(x) && aligned16(w) && aligned16(out);

    const float r = rms_divisor(xr, n, eps, scratch);

    if (vec) {
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        const uint4* wv = reinterpret_cast<const uint4*>(w);
        uint4* ov = reinterpret_cast<uint4*>(outr);
        for (uint32_t c = threadIdx.x; c < n / 8u; c += blockDim.x) {
            const uint4 a = xv[c], b = wv[c];
            const uint32_t xa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
            uint32_t o[4];
#pragma unroll
            for (int q = 0; q < 4; ++q)
                o[q] = pack_bf16x2(bf16_lo(xa[q]) / r * bf16_lo(wb[q]), bf16_hi(xa[q]) / r * bf16_hi(wb[q]));
            ov[c] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    } else {
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
            outr[i] = f32_to_bf16_bits(bf16_bits_to_f32(xr[i]) / r * bf16_bits_to_f32(w[i]));
    }
}
