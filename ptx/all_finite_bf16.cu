// Finiteness of a BF16 matrix x [rows, h] (runtime/kernels/all_finite_bf16.py): *out = min(*out,
// the lowest row holding a NaN or an Inf). The launch helper sets *out = 0xFFFFFFFF first, so it
// ends as that row, or 0xFFFFFFFF when every element is finite. A caller checks rows it is handed
// (the drafter's context rows) before anything is computed from them: one read of the matrix, and
// an atomic only in a thread that found a non-finite element.
//
// Grid-stride over 16-byte chunks when x is 16-byte aligned, else over elements; any rows and h
// (indices are 64-bit: rows * h may pass 2**32). Block 256, grid capped by the launch helper.
#include "common.cuh"

namespace {
// A BF16 is NaN or Inf when its exponent bits are all ones.
__device__ __forceinline__ bool nonfinite_bf16(uint32_t bits) { return (bits & 0x7F80u) == 0x7F80u; }

__device__ __forceinline__ bool any_nonfinite8(uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    bool bad = false;
#pragma unroll
    for (int q = 0; q < 4; ++q) bad |= nonfinite_bf16(w[q]) | nonfinite_bf16(w[q] >> 16);
    return bad;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256) all_finite_bf16(const uint16_t* __restrict__ x, uint32_t rows,
                                                                  uint32_t h, uint32_t* __restrict__ out) {
    const uint64_t n = (uint64_t)rows * h;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    // A thread's indices only grow, so the first non-finite element it meets is its lowest.
    uint64_t first = UINT64_MAX;
    uint64_t done = 0;
    if (aligned16(x)) {
        const uint64_t nc = n / 8u;
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        for (uint64_t c = tid; c < nc; c += stride) {
            if (any_nonfinite8(ld_stream16(xv + c))) {
                for (uint32_t j = 0; j < 8u; ++j)
                    if (nonfinite_bf16(x[8u * c + j])) { first = 8u * c + j; break; }
                break;
            }
        }
        done = nc * 8u;
    }
    if (first == UINT64_MAX) {
        for (uint64_t i = done + tid; i < n; i += stride)
            if (nonfinite_bf16(x[i])) { first = i; break; }
    }
    if (first != UINT64_MAX) atomicMin(out, (uint32_t)(first / h));
}
