// Helpers shared by the drafter's kernels (ptx/{mtp_input,bgemv,dsa_cache,dsa_select,sparse_mla,
// moe,draft_head}.cu): FP8 conversions, the order-preserving key the selections sort by, the
// weight-streaming warp GEMV core, block scans, and the row normalisations whose exact arithmetic
// several kernels must share (a fused kernel that recomputes another block's row has to produce
// the same bits, so both call the same function).
#pragma once
#include "common.cuh"
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#define BF16_QNAN_BITS 0x7FC0u  // what NumPy's float32 NaN becomes in bfloat16

// ---- FP8 E4M3 -----------------------------------------------------------------------------------

// Round to nearest even, saturating at +-448: what runtime.dtypes.to_fp8_saturating does.
__device__ __forceinline__ uint8_t f32_to_fp8_sat(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// ---- ordering -----------------------------------------------------------------------------------

// Order-preserving u32 of an f32 for "higher first" selections: larger key = larger value. -0 is
// folded onto +0 (NumPy's sorts and argmax treat them as equal, so an index tie-break must decide),
// and NaN maps to 0, below -inf (NumPy sorts NaN last; argmax never picks it).
__device__ __forceinline__ uint32_t ordered_key(float v) {
    if (isnan(v)) return 0u;
    const uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// ---- block scans (blockDim.x a multiple of 32, <= 1024) ------------------------------------------

// Inclusive prefix sum over a warp's lanes (every lane of the warp takes part).
__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t v) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t t = __shfl_up_sync(0xFFFFFFFFu, v, o);
        if (lane >= (uint32_t)o) v += t;
    }
    return v;
}

// Exclusive prefix sum of one u32 per thread, in thread order; *total gets the block's sum.
// `scratch` holds 32 u32. Ends with a barrier so scratch can be reused at once.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* scratch, uint32_t* total) {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const uint32_t inc = warp_inclusive_scan(v);
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    uint32_t wsum = lane < nwarps ? scratch[lane] : 0u;
    const uint32_t winc = warp_inclusive_scan(wsum);
    const uint32_t warp_excl = __shfl_sync(0xFFFFFFFFu, winc - wsum, warp);
    *total = __shfl_sync(0xFFFFFFFFu, winc, 31);
    __syncthreads();
    return warp_excl + inc - v;
}

// ---- row normalisations -------------------------------------------------------------------------


// out = bf16((x / r) * w) over a row, block-strided (rmsnorm.cu's element order is irrelevant:
// each element is independent).
__device__ __forceinline__ void rms_apply(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                                          uint16_t* __restrict__ out, uint32_t n, float r) {
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = f32_to_bf16_bits(__fmul_rn(bf16_bits_to_f32(x[i]) / r, bf16_bits_to_f32(w[i])));
}

// LayerNorm statistics of a BF16 row as the host twin computes them: mu = sum(x) / n,
// var = sum((x - mu)^2) / n, denom = sqrt(var + eps). Deterministic for a given blockDim, so two
// blocks normalising the same row get the same bits.
__device__ __forceinline__ void ln_stats(const uint16_t* __restrict__ x, uint32_t n, float eps, float* scratch,
                                         float& mu, float& denom) {
    float s = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) s += bf16_bits_to_f32(x[i]);
    mu = block_sum(s, scratch) / (float)n;
    float v = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float d = __fsub_rn(bf16_bits_to_f32(x[i]), mu);
        v = fmaf(d, d, v);
    }
    denom = sqrtf(block_sum(v, scratch) / (float)n + eps);
}

// One LayerNorm output element, rounded to BF16: ((x - mu) / denom) * w + b, no contraction (the
// twin multiplies and adds separately).
__device__ __forceinline__ uint16_t ln_elem(float x, float mu, float denom, float w, float b) {
    return f32_to_bf16_bits(__fadd_rn(__fmul_rn(__fsub_rn(x, mu) / denom, w), b));
}

// ---- the weight-streaming warp GEMV core --------------------------------------------------------
//
// A warp computes ROWS dot products of BF16 (or FP8) weight rows with one BF16 vector x. Batch-1
// decode is pure weight streaming: each lane issues ROWS * U independent 16-byte loads that bypass
// L1 (ld_stream16) before the first FMA, x is read through the read-only path and stays in L1.
// Lanes take 16-byte chunks round-robin; the partial sums are reduced by the caller (warp_sum).
// `vec` (k a multiple of the chunk, every pointer 16-byte aligned) selects the vector path; the
// scalar path is the correctness fallback for odd shapes.

__device__ __forceinline__ float dot8_bf16(uint4 w, uint4 x, float acc) {
    acc = fmaf(bf16_lo(w.x), bf16_lo(x.x), acc);
    acc = fmaf(bf16_hi(w.x), bf16_hi(x.x), acc);
    acc = fmaf(bf16_lo(w.y), bf16_lo(x.y), acc);
    acc = fmaf(bf16_hi(w.y), bf16_hi(x.y), acc);
    acc = fmaf(bf16_lo(w.z), bf16_lo(x.z), acc);
    acc = fmaf(bf16_hi(w.z), bf16_hi(x.z), acc);
    acc = fmaf(bf16_lo(w.w), bf16_lo(x.w), acc);
    acc = fmaf(bf16_hi(w.w), bf16_hi(x.w), acc);
    return acc;
}

// The x chunks a lane multiplies with its U weight chunks c, c + 32, ..., all issued before the
// first use: a load inside the `c < kc` guard compiles to a branch around each load and its use,
// one L1/L2 round trip per chunk in sequence. warp_gemv_fp8 keeps its loads in the guard: the
// registers the hoisted loads keep live spill the FP8 head (BENCHMARKS.md, "Drafter kernel notes",
// for both). Indices past the row are clamped to its last chunk, so every load stays in bounds; the
// caller's guard skips those chunks.
// An activation chunk: through L2 when its writer may still run (X_L2, ptx/common.cuh), else
// through the read-only path, where it stays in L1 for the block's other warps.
template <bool X_L2>
__device__ __forceinline__ uint4 ld_x16(const uint4* p) {
    return X_L2 ? __ldcg(p) : __ldg(p);
}

template <int U, bool X_L2 = false>
__device__ __forceinline__ void load_x_chunks(const uint4* __restrict__ xv, uint32_t c, uint32_t kc, uint4 (&xs)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) xs[u] = ld_x16<X_L2>(xv + min(c + 32u * u, kc - 1u));
}

// WAIT_FIRST (pdl kernels): the first batch of weight loads is issued, then grid_dependency_wait(),
// then x is read: the weight stream starts while the previous kernel finishes. RELEASE: the kernel
// releases its dependents right after that wait (release_dependents). X_L2: x is read through L2,
// not the read-only path, because the kernel that writes it releases its dependents early and may
// still run when this one starts (ptx/common.cuh).
template <int ROWS, int U, bool WAIT_FIRST = false, bool RELEASE = false, bool X_L2 = false>
__device__ __forceinline__ void warp_gemv_bf16(const uint16_t* const (&w)[ROWS], const uint16_t* __restrict__ x,
                                               uint32_t k, bool vec, float (&acc)[ROWS]) {
    const uint32_t lane = threadIdx.x & 31;
    if (vec) {
        const uint32_t kc = k >> 3;
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        if (WAIT_FIRST && kc == 0) RELEASE ? wait_then_release() : grid_dependency_wait();
        for (uint32_t c0 = 0; c0 < kc; c0 += 32u * U) {
            uint4 wv[ROWS][U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t c = c0 + lane + 32u * u;
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
                    wv[r][u] = c < kc ? ld_stream16(reinterpret_cast<const uint4*>(w[r]) + c) : make_uint4(0, 0, 0, 0);
            }
            if (WAIT_FIRST && c0 == 0) RELEASE ? wait_then_release() : grid_dependency_wait();
            uint4 xs[U];
            load_x_chunks<U, X_L2>(xv, c0 + lane, kc, xs);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (c0 + lane + 32u * u < kc) {
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r] = dot8_bf16(wv[r][u], xs[u], acc[r]);
                }
            }
        }
    } else {
        if (WAIT_FIRST) RELEASE ? wait_then_release() : grid_dependency_wait();
        for (uint32_t i = lane; i < k; i += 32u) {
            const float xi = bf16_bits_to_f32(X_L2 ? __ldcg(x + i) : x[i]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(bf16_bits_to_f32(w[r][i]), xi, acc[r]);
        }
    }
}

template <int ROWS, int U, bool X_L2 = false>
__device__ __forceinline__ void warp_gemv_fp8(const uint8_t* const (&w)[ROWS], const uint16_t* __restrict__ x,
                                              uint32_t k, bool vec, float (&acc)[ROWS]) {
    const uint32_t lane = threadIdx.x & 31;
    if (vec) {
        const uint32_t kc = k >> 4;
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        for (uint32_t c0 = 0; c0 < kc; c0 += 32u * U) {
            uint4 wv[ROWS][U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t c = c0 + lane + 32u * u;
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
                    wv[r][u] = c < kc ? ld_stream16(reinterpret_cast<const uint4*>(w[r]) + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t c = c0 + lane + 32u * u;
                if (c < kc) {
                    const uint4 xa = ld_x16<X_L2>(xv + 2u * c), xb = ld_x16<X_L2>(xv + 2u * c + 1u);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r] = dot16_fp8(wv[r][u], xa, xb, acc[r]);
                }
            }
        }
    } else {
        for (uint32_t i = lane; i < k; i += 32u) {
            const float xi = bf16_bits_to_f32(X_L2 ? __ldcg(x + i) : x[i]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(fp8_to_f32(w[r][i]), xi, acc[r]);
        }
    }
}

// ---- last-block handshake -----------------------------------------------------------------------
//
// "The last block to finish does the epilogue" without a second launch: every block publishes its
// results, and one thread per block fences and bumps a counter; the block that sees gridDim - 1
// runs the epilogue and resets the counter to 0, so the same counter serves the next launch and
// every graph replay. The barrier orders the block's writes before thread 0's fence (the fence is
// cumulative), as cooperative groups' grid sync does; one fence per block instead of one per thread
// (a gpu-scope fence waits for the issuing thread's outstanding memory operations).
// Call from all threads of a block; returns true in the last block (uniformly).
__device__ __forceinline__ bool last_block_done(uint32_t* counter) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const uint32_t total = gridDim.x * gridDim.y * gridDim.z;
        const uint32_t prev = atomicAdd(counter, 1u);
        is_last = (prev == total - 1u);
        if (is_last) {
            *counter = 0u;
            __threadfence();
        }
    }
    __syncthreads();
    return is_last;
}

// Sum of two floats over the block at once (one barrier pair instead of two). blockDim.x a
// multiple of 32; `scratch` holds 64 floats.
__device__ __forceinline__ void block_sum2(float& a, float& b, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) { scratch[warp] = a; scratch[32 + warp] = b; }
    __syncthreads();
    a = warp_sum(lane < nwarps ? scratch[lane] : 0.0f);
    b = warp_sum(lane < nwarps ? scratch[32 + lane] : 0.0f);
    __syncthreads();
}

// A row normalised in place in shared memory: stage_row_sumsq copies the row's 16-byte chunks to
// their place in `dst` as they arrive (thread-strided, two loads in flight per thread) and sums
// their squares (fmaf per element, in element order within a chunk, chunks in the thread's order);
// after the block reduction, scale_staged_row rewrites each thread's own chunks as
// bf16((x / d) * w) (the thread reads back only what it wrote, so no barrier in between). Staged in
// shared memory, not held in registers through the prologue, which would cap the residency of the
// kernels that call it (BENCHMARKS.md, "Drafter kernel notes"). Needs n % 8 == 0 and 16-byte
// alignment.
__device__ __forceinline__ float sumsq8(uint4 v, float ss) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float a = bf16_lo(w[q]), b = bf16_hi(w[q]);
        ss = fmaf(a, a, ss);
        ss = fmaf(b, b, ss);
    }
    return ss;
}

__device__ __forceinline__ float stage_row_sumsq(const uint16_t* __restrict__ x, uint16_t* dst, uint32_t n) {
    const uint32_t nc = n / 8u;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* dv = reinterpret_cast<uint4*>(dst);
    float ss = 0.0f;
    for (uint32_t c0 = threadIdx.x; c0 < nc; c0 += 2u * blockDim.x) {
        const uint32_t c1 = c0 + blockDim.x;
        const uint4 v0 = __ldg(xv + c0);
        const uint4 v1 = c1 < nc ? __ldg(xv + c1) : make_uint4(0, 0, 0, 0);
        dv[c0] = v0;
        ss = sumsq8(v0, ss);
        if (c1 < nc) {
            dv[c1] = v1;
            ss = sumsq8(v1, ss);
        }
    }
    return ss;
}

__device__ __forceinline__ void scale_staged_row(uint16_t* dst, const uint16_t* __restrict__ w, uint32_t n, float d) {
    uint4* dv = reinterpret_cast<uint4*>(dst);
    const uint4* wv4 = reinterpret_cast<const uint4*>(w);
    for (uint32_t c = threadIdx.x; c < n / 8u; c += blockDim.x) {
        const uint4 xc = dv[c], wc = __ldg(wv4 + c);
        const uint32_t xv[4] = {xc.x, xc.y, xc.z, xc.w}, wv[4] = {wc.x, wc.y, wc.z, wc.w};
        uint32_t o[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
            o[q] = pack_bf16x2(__fmul_rn(bf16_lo(xv[q]) / d, bf16_lo(wv[q])), __fmul_rn(bf16_hi(xv[q]) / d, bf16_hi(wv[q])));
        dv[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

__device__ __forceinline__ bool rms_stage_ok(const uint16_t* x, const uint16_t* w, const uint16_t* dst, uint32_t n) {
    return n % 8u == 0 && aligned16(x) && aligned16(w) && aligned16(dst);
}

// Prologue: xs[0..n) = bf16((x / r) * w), r the RMS divisor of x (rmsnorm.cu's arithmetic).
// Returns r, the same in every thread: it is not finite exactly when the row's f32 sum of squares
// is not, i.e. when x holds a NaN or an Inf (or |x| so large that the sum overflows), which is how
// a caller checks its input row without another pass over it.
struct RmsNormToSmem {
    const uint16_t* x;
    const uint16_t* w;
    uint32_t n;
    float eps;
    float* scratch;  // 64 floats
    __device__ __forceinline__ float operator()(uint16_t* xs) const {
        float d;
        if (rms_stage_ok(x, w, xs, n)) {
            float ss = stage_row_sumsq(x, xs, n), unused = 0.0f;
            block_sum2(ss, unused, scratch);
            d = sqrtf(ss / (float)n + eps);
            scale_staged_row(xs, w, n, d);
        } else {
            d = rms_divisor(x, n, eps, scratch);
            rms_apply(x, w, xs, n, d);
        }
        __syncthreads();
        return d;
    }
};
