// Helpers shared by the kernels in ptx/*.cu. build.py hashes this file into every .ptx that
// includes it, so a change here marks those .ptx stale.
#pragma once
#include <stdint.h>
#include <math.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define BF16_NAN_BITS 0xFFFFu

// BF16 is the top half of an f32: widening is a shift, never a conversion instruction.
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// Round to nearest even, as ml_dtypes does on the host.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    return (uint32_t)f32_to_bf16_bits(lo) | ((uint32_t)f32_to_bf16_bits(hi) << 16);
}

__device__ __forceinline__ bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

// Weights are read exactly once per launch: keep them out of L1 (where the activation row lives),
// and give L2 no prefetch-size hint: `.L2::256B` made the weight streams slower and `.L2::128B` no
// faster, and without `.L1::no_allocate` the weights evict the activations from L1 (read_xor
// measures this load; see BENCHMARKS.md, "Runtime kernels: notes behind the numbers", the
// weight-load cache policy).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// ---- programmatic dependent launch (sm_90 griddepcontrol) ----------------------------------------
//
// A kernel declared Pdl.WAIT (runtime/kernel.py) is launched with programmatic stream
// serialisation: it may start while the kernel before it on the stream is still running, once that
// kernel's blocks have all released it (or exited). Before grid_dependency_wait() such a kernel may
// only read weights (memory no kernel of the step writes); every thread calls the wait on every path
// before its first global store and before it exits, so that a grid cannot complete ahead of its
// predecessor and "my predecessor completed" keeps implying "every earlier kernel completed".
// Pdl.BESIDE kernels are described at release_dependents below. Launched without the attribute both
// instructions are no-ops. tests/test_pdl_ptx.py checks the PTX of every pdl kernel for the wait
// and for stores and returns ahead of it.
// A kernel releases its successor at exit unless it calls release_dependents / wait_then_release
// below, where a measurement showed a gain: releasing everywhere early made the step slower (the
// GEMVs fill the SMs, and successors launched early only take their place). The placements
// measured are in BENCHMARKS.md, "MTP drafter: propose" (programmatic dependent launch).
__device__ __forceinline__ void grid_dependency_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
// The read-only path (ld.global.nc: __ldg, or a plain load through a const __restrict__ pointer,
// which nvcc turns into one) may serve only data that no grid writes during the reading kernel's
// lifetime. A successor of a kernel that releases its dependents early starts while that kernel
// still runs, so it reads that kernel's outputs with __ldcg (L2), even after its wait: through
// the read-only path the graph with PDL drafted other tokens than the graph without
// (tests/test_gpu_pdl.py; see BENCHMARKS.md, "MTP drafter: propose", the read-only path and PDL).
// So the successors of the early releases below read the released kernel's output through L2:
// the GEMV core's x (X_L2), stage_x, the selection's scores, the MLA partials, the row sums' parts.
// Unconditional release, for a kernel whose successor is built to run beside it: the successor's
// input comes from the kernel before this one, so it works without waiting and waits only before
// it exits or before it reads this kernel's output (select_topk_pools_batch ->
// bgemv_bf16_f32_batch_beside, dsa_cache_write_batch -> rmsnorm_gemv_seg_batch_beside, the heads
// head_argmax_{bf16,fp8}_batch -> the next draft's mtp_input_gemv_batch, whose tokens are the
// head's output).
// Called once everything before this kernel has completed: right after its own wait (these are
// Pdl.WAIT kernels; launched plainly the wait is a no-op and that holds at the start).
__device__ __forceinline__ void release_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Release right after the wait also where no successor runs beside: the latency-bound kernels of
// the attention chain and the residual norms (indexer_scores_batch, sparse_mla_partial_batch and
// _combine_batch, sum_rows_residual_rmsnorm_batch) and the per-head GEMVs wv and o_proj. Their successors' blocks then
// launch during their tails and have their first weight batch in flight when the wait returns
// (wv's whole 8 rows x 1 KB per warp). Releasing the MoE's down projection, the fused_in projection
// (rmsnorm_gemv) and the MTP input GEMV early too gave nothing more, so those release at exit (see BENCHMARKS.md,
// "MTP drafter: propose", the early releases).
__device__ __forceinline__ void wait_then_release() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    release_dependents();
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

// Block-wide reductions for blockDim.x a multiple of 32 (<= 1024). Every thread gets the result.
// `scratch` holds 32 floats; the trailing barrier lets callers reuse it immediately.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -INFINITY;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// ---- FP8 E4M3 -----------------------------------------------------------------------------------

// Four E4M3 bytes (low byte first) -> four exact floats: cvt.rn.f16x2.e4m3x2 is exact (every E4M3
// value is an f16), f16 -> f32 is exact.
__device__ __forceinline__ void fp8x4_to_f32(uint32_t v, float (&f)[4]) {
    uint32_t h01, h23;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n\tcvt.rn.f16x2.e4m3x2 %1, hi;\n\t}"
        : "=r"(h01), "=r"(h23)
        : "r"(v));
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&h01));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&h23));
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}

__device__ __forceinline__ float fp8_to_f32(uint8_t b) {
    uint32_t h;
    const uint16_t b16 = b;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(b16));
    return __half2float(__ushort_as_half((unsigned short)(h & 0xFFFFu)));
}

// 1 / the RMS divisor of a BF16 row, as ptx/rmsnorm.cu computes it: f32 sum of squares with fmaf
// in thread-strided order, r = sqrt(ss / n + eps); the caller does (x / r) * w.
__device__ __forceinline__ float rms_divisor(const uint16_t* __restrict__ x, uint32_t n, float eps, float* scratch) {
    float ss = 0.0f;
    if ((n % 8u == 0) && aligned16(x)) {
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        for (uint32_t c = threadIdx.x; c < n / 8u; c += blockDim.x) {
            const uint4 v = xv[c];
            const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float a = bf16_lo(words[q]), b = bf16_hi(words[q]);
                ss = fmaf(a, a, ss);
                ss = fmaf(b, b, ss);
            }
        }
    } else {
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
            const float a = bf16_bits_to_f32(x[i]);
            ss = fmaf(a, a, ss);
        }
    }
    ss = block_sum(ss, scratch);
    return sqrtf(ss / (float)n + eps);
}

// acc += dot(16 E4M3 weights in w, 16 BF16 values of x in xa, xb), in element order.
__device__ __forceinline__ float dot16_fp8(uint4 w, uint4 xa, uint4 xb, float acc) {
    const uint32_t ww[4] = {w.x, w.y, w.z, w.w};
    const uint32_t xx[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float f[4];
        fp8x4_to_f32(ww[q], f);
        acc = fmaf(f[0], bf16_lo(xx[2 * q]), acc);
        acc = fmaf(f[1], bf16_hi(xx[2 * q]), acc);
        acc = fmaf(f[2], bf16_lo(xx[2 * q + 1]), acc);
        acc = fmaf(f[3], bf16_hi(xx[2 * q + 1]), acc);
    }
    return acc;
}
