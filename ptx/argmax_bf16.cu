// Argmax over x[n] BF16: out_idx (u32) = the lowest index holding the largest value, out_val (f32)
// = that value. NaN never wins: it compares below every number, -inf included. If every element
// is NaN, out_idx = 0 (the lowest index: always a valid index, so a caller that commits it never
// reads past its table) and out_val = NaN, which is the flag; only n == 0 gives 0xFFFFFFFF.
// The all-NaN case is settled once at the end, not in the compare chain, which stays as it was.
//
// One thread-block cluster of ARGMAX_BLOCKS blocks x 1024 threads (launch helper: grid =
// ARGMAX_BLOCKS, block 1024; the cluster shape is compiled in, so a plain cuLaunchKernel forms it).
// One SM issuing the compare chain is the limit of a single block (BENCHMARKS.md, "Drafter kernel
// notes"). A cluster spreads that over 8 SMs and still needs no workspace, no second launch and no
// cross-block atomics: the blocks' partial results meet through distributed shared memory, so the
// kernel stays graph-capturable, deterministic and safe to run concurrently on several streams.
#include "common.cuh"
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

#ifndef ARGMAX_BLOCKS
#define ARGMAX_BLOCKS 8
#endif

namespace {
constexpr uint32_t NONE = 0xFFFFFFFFu;
constexpr int UNROLL = 4;

// Candidate (v, i) beats (best, bi)? Within one thread indices only grow, but the cross-thread
// reduction needs the index tie-break.
__device__ __forceinline__ bool better(float v, uint32_t i, float best, uint32_t bi) {
    return i != NONE && !isnan(v) && (bi == NONE || v > best || (v == best && i < bi));
}

__device__ __forceinline__ void consider(float v, uint32_t i, float& best, uint32_t& bi) {
    if (better(v, i, best, bi)) { best = v; bi = i; }
}

__device__ __forceinline__ void consider8(uint4 c, uint32_t i0, float& best, uint32_t& bi) {
    consider(bf16_lo(c.x), i0 + 0, best, bi);
    consider(bf16_hi(c.x), i0 + 1, best, bi);
    consider(bf16_lo(c.y), i0 + 2, best, bi);
    consider(bf16_hi(c.y), i0 + 3, best, bi);
    consider(bf16_lo(c.z), i0 + 4, best, bi);
    consider(bf16_hi(c.z), i0 + 5, best, bi);
    consider(bf16_lo(c.w), i0 + 6, best, bi);
    consider(bf16_hi(c.w), i0 + 7, best, bi);
}

// The argmax of one vector by the cluster of the calling block (the whole body of argmax_bf16;
// argmax_bf16_batch runs it once per row).
__device__ __forceinline__ void argmax_cluster(const uint16_t* __restrict__ x, uint32_t* __restrict__ out_idx,
                                               float* __restrict__ out_val, uint32_t n) {
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    cg::cluster_group cluster = cg::this_cluster();
    const uint32_t rank = cluster.block_rank();
    const uint32_t tid = threadIdx.x, nt = blockDim.x;
    // Global thread index and count across the cluster: a thread's indices only grow.
    const uint32_t gt = rank * nt + tid, gn = ARGMAX_BLOCKS * nt;
    float best = -INFINITY;
    uint32_t bi = NONE;

    uint32_t done = 0;
    if (aligned16(x)) {
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        const uint32_t nc = n / 8u;
        uint32_t c = gt;
        for (; c + gn * (UNROLL - 1) < nc; c += gn * UNROLL) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) v[u] = __ldg(xv + c + gn * u);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) consider8(v[u], 8u * (c + gn * u), best, bi);
        }
        for (; c < nc; c += gn) consider8(__ldg(xv + c), 8u * c, best, bi);
        done = nc * 8u;
    }
    for (uint32_t i = done + gt; i < n; i += gn) consider(bf16_bits_to_f32(x[i]), i, best, bi);

#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xFFFFFFFFu, best, o);
        const uint32_t oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
        consider(ov, oi, best, bi);
    }
    const uint32_t lane = tid & 31, warp = tid >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        best = lane < nt / 32u ? sv[lane] : -INFINITY;
        bi = lane < nt / 32u ? si[lane] : NONE;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xFFFFFFFFu, best, o);
            const uint32_t oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
            consider(ov, oi, best, bi);
        }
    }
    // Block result in sv[0]/si[0] (written after everyone read sv: the barrier orders it).
    __syncthreads();
    if (tid == 0) { sv[0] = best; si[0] = bi; }
    cluster.sync();  // every block's result is visible cluster-wide
    if (rank == 0 && warp == 0) {
        best = -INFINITY;
        bi = NONE;
        if (lane < ARGMAX_BLOCKS) {
            best = *cluster.map_shared_rank(&sv[0], lane);
            bi = *cluster.map_shared_rank(&si[0], lane);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xFFFFFFFFu, best, o);
            const uint32_t oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
            consider(ov, oi, best, bi);
        }
        if (lane == 0) {
            *out_idx = bi != NONE ? bi : (n ? 0u : NONE);
            *out_val = bi == NONE ? __uint_as_float(0x7FC00000u) : best;
        }
    }
    cluster.sync();  // no block exits (freeing its shared memory) before rank 0 has read it
}
}  // namespace

extern "C" __global__ void __cluster_dims__(ARGMAX_BLOCKS, 1, 1) __launch_bounds__(1024)
    argmax_bf16(const uint16_t* __restrict__ x, uint32_t* __restrict__ out_idx, float* __restrict__ out_val,
                uint32_t n) {
    argmax_cluster(x, out_idx, out_val, n);
}

// The argmax of each row of x[m][n] (rows n elements apart) into out_idx[e], out_val[e], by the
// rules above: grid (ARGMAX_BLOCKS, m), cluster e along y works on row e. The result of a row is
// exact whatever m (an argmax has no rounding), so it is the one argmax_bf16 gives that row alone.
// A row whose start is not 16-byte aligned (n % 8 != 0) takes the element-wise loop.
extern "C" __global__ void __cluster_dims__(ARGMAX_BLOCKS, 1, 1) __launch_bounds__(1024)
    argmax_bf16_batch(const uint16_t* __restrict__ x, uint32_t* __restrict__ out_idx, float* __restrict__ out_val,
                      uint32_t m, uint32_t n) {
    const uint32_t e = blockIdx.y;
    if (e >= m) return;  // uniform over the cluster: every block of it has the same row
    argmax_cluster(x + (size_t)e * n, out_idx + e, out_val + e, n);
}
