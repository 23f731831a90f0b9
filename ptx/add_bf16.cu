// out = a + b elementwise over BF16 (f32 add, BF16 store, round to nearest even). Any n; any
// alignment (the 16-byte path needs all three pointers 16-byte aligned). Grid-stride loop, so the
// launch helper may cap the grid.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) add_bf16(const uint16_t* __restrict__ a,
                                                           const uint16_t* __restrict__ b,
                                                           uint16_t* __restrict__ out, uint32_t n) {
    const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t stride = gridDim.x * blockDim.x;
    uint32_t done = 0;
    if (aligned16(a) && aligned16(b) && aligned16(out)) {
        const uint32_t nc = n / 8u;
        const uint4* av = reinterpret_cast<const uint4*>(a);
        const uint4* bv = reinterpret_cast<const uint4*>(b);
        uint4* ov = reinterpret_cast<uint4*>(out);
        for (uint32_t c = tid; c < nc; c += stride) {
            const uint4 x = av[c], y = bv[c];
            ov[c] = make_uint4(pack_bf16x2(bf16_lo(x.x) + bf16_lo(y.x), bf16_hi(x.x) + bf16_hi(y.x)),
                               pack_bf16x2(bf16_lo(x.y) + bf16_lo(y.y), bf16_hi(x.y) + bf16_hi(y.y)),
                               pack_bf16x2(bf16_lo(x.z) + bf16_lo(y.z), bf16_hi(x.z) + bf16_hi(y.z)),
                               pack_bf16x2(bf16_lo(x.w) + bf16_lo(y.w), bf16_hi(x.w) + bf16_hi(y.w)));
        }
        done = nc * 8u;
    }
    for (uint32_t i = done + tid; i < n; i += stride)
        out[i] = f32_to_bf16_bits(bf16_bits_to_f32(a[i]) + bf16_bits_to_f32(b[i]));
}
