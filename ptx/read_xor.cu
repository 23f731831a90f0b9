// out[b] = XOR of the 32-bit words that block b reads of src (runtime/kernels/read_xor.py): a
// streaming read with nothing else in it, for measuring how fast a kernel can read HBM
// (bench/bench_runtime.py). Thread t of block b takes the 16-byte words t + 256 b + j * 256 * blocks
// (grid-stride over `blocks`, the launch's grid), eight loads in flight per thread.
//
// read_xor loads as the weight streams do (ld_stream16, ptx/common.cuh), so the figure follows any
// change of their cache policy; read_xor_l2_256b adds the `.L2::256B` prefetch-size hint the weight
// loads had until it measured slower (see BENCHMARKS.md, "Runtime kernels: notes behind the
// numbers", the weight-load cache policy).
#include "common.cuh"

namespace {
__device__ __forceinline__ uint4 ld_l2_256b(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

constexpr int UNROLL = 8;

template <bool L2_256B>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
    return L2_256B ? ld_l2_256b(p) : ld_stream16(p);
}

template <bool L2_256B>
__device__ __forceinline__ void read_xor_body(const uint4* __restrict__ src, uint32_t n16, uint32_t blocks,
                                              uint32_t* __restrict__ out) {
    const size_t stride = (size_t)blocks * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint32_t acc = 0u;
    for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = ld16<L2_256B>(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = ld16<L2_256B>(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xFFFFFFFFu, acc, o);
    __shared__ uint32_t warp_acc[32];
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_acc[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t b = 0u;
        for (uint32_t w = 0; w < (blockDim.x + 31u) / 32u; ++w) b ^= warp_acc[w];
        out[blockIdx.x] = b;
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256) read_xor(const uint4* __restrict__ src, uint32_t n16,
                                                           uint32_t blocks, uint32_t* __restrict__ out) {
    read_xor_body<false>(src, n16, blocks, out);
}

extern "C" __global__ void __launch_bounds__(256) read_xor_l2_256b(const uint4* __restrict__ src, uint32_t n16,
                                                                   uint32_t blocks, uint32_t* __restrict__ out) {
    read_xor_body<true>(src, n16, blocks, out);
}
