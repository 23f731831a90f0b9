// Batched GEMV y[b] = W[b] @ x[b] (W[b] [n, k] BF16, x[b] [k] BF16, f32 accumulation) and the
// ordered row sums that follow the o_proj head groups and the MoE slots.
//
// bgemv geometry (model/kernels/bgemv.py rows_per_warp): grid (ceil(n / (8 R)), batch), block 256
// = 8 warps, each warp owns R consecutive rows with R * U = 16 sixteen-byte loads per lane in
// flight. The drafter's batched GEMVs have short rows, so rows per warp is what keeps bytes in
// flight: wk_t (k = 256: one chunk per lane per row) takes R = 16, wv (k = 512) R = 8, o_proj
// (k = 2048) R = 4 with 4 chunks per row; with R = 4 everywhere the short rows ran far below the
// read bandwidth (BENCHMARKS.md, "Drafter kernel notes").
#include "model_common.cuh"

namespace {
constexpr int WARPS = 8;

// PDL modes (runtime.kernel.Pdl). WAIT_FIRST: the first weight batch is in flight before the wait
// (warp_gemv_bf16), a warp without rows waits before it exits, every warp releases the kernel's
// dependents right after its wait (wait_then_release, ptx/common.cuh), and x is read through L2
// (its writer releases early too). BESIDE: x comes from the kernel before the previous one, so the
// whole GEMV runs without waiting and the wait comes last.
enum PdlMode { WAIT_FIRST, BESIDE };

template <bool OUT_F32, int ROWS, int UNROLL, PdlMode MODE>
__device__ __forceinline__ void bgemv_body(const uint16_t* __restrict__ w, const uint16_t* __restrict__ x,
                                           void* __restrict__ y, uint32_t batch, uint32_t n, uint32_t k) {
    const uint32_t b = blockIdx.y;
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (b >= batch || row0 >= n) {
        if (MODE == WAIT_FIRST) wait_then_release(); else grid_dependency_wait();
        return;
    }
    const uint16_t* wb = w + (size_t)b * n * k;
    const uint16_t* xb = x + (size_t)b * k;
    const bool vec = (k % 8u == 0) && aligned16(w) && aligned16(x);
    const uint16_t* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = wb + (size_t)min(row0 + r, n - 1) * k;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    warp_gemv_bf16<ROWS, UNROLL, MODE == WAIT_FIRST, MODE == WAIT_FIRST, MODE == WAIT_FIRST>(wr, xb, k, vec, acc);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == (uint32_t)r && row0 + r < n) {
            if (OUT_F32) reinterpret_cast<float*>(y)[(size_t)b * n + row0 + r] = v;
            else reinterpret_cast<uint16_t*>(y)[(size_t)b * n + row0 + r] = f32_to_bf16_bits(v);
        }
    }
    if (MODE == BESIDE) grid_dependency_wait();  // not complete before the kernel it ran beside
}

// Rows per warp by row length; must match model/kernels/bgemv.py rows_per_warp.
template <bool OUT_F32, PdlMode MODE>
__device__ __forceinline__ void bgemv_dispatch(const uint16_t* w, const uint16_t* x, void* y, uint32_t batch,
                                               uint32_t n, uint32_t k) {
    if (k <= 256u) bgemv_body<OUT_F32, 16, 1, MODE>(w, x, y, batch, n, k);
    else if (k <= 512u) bgemv_body<OUT_F32, 8, 2, MODE>(w, x, y, batch, n, k);
    else bgemv_body<OUT_F32, 4, 4, MODE>(w, x, y, batch, n, k);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256) bgemv_bf16_f32(const uint16_t* __restrict__ w,
                                                                 const uint16_t* __restrict__ x,
                                                                 float* __restrict__ y, uint32_t batch,
                                                                 uint32_t n, uint32_t k) {
    bgemv_dispatch<true, WAIT_FIRST>(w, x, y, batch, n, k);
}

// bgemv_bf16_f32 that runs beside the kernel launched before it (Pdl.BESIDE): wk_t's q_abs beside
// select_topk_pools (the selection reads the indexer's scores; q_abs only the q projection, which
// completed before both).
extern "C" __global__ void __launch_bounds__(256) bgemv_bf16_f32_beside(const uint16_t* __restrict__ w,
                                                                        const uint16_t* __restrict__ x,
                                                                        float* __restrict__ y, uint32_t batch,
                                                                        uint32_t n, uint32_t k) {
    bgemv_dispatch<true, BESIDE>(w, x, y, batch, n, k);
}

extern "C" __global__ void __launch_bounds__(256) bgemv_bf16_bf16(const uint16_t* __restrict__ w,
                                                                  const uint16_t* __restrict__ x,
                                                                  uint16_t* __restrict__ y, uint32_t batch,
                                                                  uint32_t n, uint32_t k) {
    bgemv_dispatch<false, WAIT_FIRST>(w, x, y, batch, n, k);
}

// out = bf16(residual + (((p0 + p1) + p2) + ...)): the host twin's order exactly (f32 adds in row
// order, then the residual), so this kernel is bit-identical to its twin. Grid ceil(n / 256),
// block 256, one element per thread.
extern "C" __global__ void __launch_bounds__(256) sum_rows_residual(const float* __restrict__ parts,
                                                                    const uint16_t* residual,
                                                                    uint16_t* out, uint32_t rows,
                                                                    uint32_t n) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || rows == 0) return;
    float acc = parts[i];
    for (uint32_t r = 1; r < rows; ++r) acc = __fadd_rn(acc, parts[(size_t)r * n + i]);
    out[i] = f32_to_bf16_bits(__fadd_rn(bf16_bits_to_f32(residual[i]), acc));
}

namespace {
// Elements 4c .. 4c + 3 of sum_rows_residual_rmsnorm's row: the part rows added in row order with
// RL float4 loads in flight, the residual added, the BF16 result stored (and returned packed in
// o01 / o23), and its squares added to ss.
template <int RL>
__device__ __forceinline__ void sum_chunk_rows(const float* __restrict__ parts, const uint16_t* residual,
                                               uint16_t* out, uint32_t rows, uint32_t n4, uint32_t c,
                                               uint32_t& o01, uint32_t& o23, float& ss) {
    const float4* p4 = reinterpret_cast<const float4*>(parts);
    float4 acc = __ldcg(p4 + c);
    const uint2 res = *reinterpret_cast<const uint2*>(residual + 4u * c);
    for (uint32_t r0 = 1; r0 < rows; r0 += RL) {
        float4 v[RL];
#pragma unroll
        for (int u = 0; u < RL; ++u)
            v[u] = r0 + u < rows ? __ldcg(p4 + (size_t)(r0 + u) * n4 + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int u = 0; u < RL; ++u) {
            if (r0 + u < rows) {
                acc.x = __fadd_rn(acc.x, v[u].x);
                acc.y = __fadd_rn(acc.y, v[u].y);
                acc.z = __fadd_rn(acc.z, v[u].z);
                acc.w = __fadd_rn(acc.w, v[u].w);
            }
        }
    }
    o01 = pack_bf16x2(__fadd_rn(bf16_lo(res.x), acc.x), __fadd_rn(bf16_hi(res.x), acc.y));
    o23 = pack_bf16x2(__fadd_rn(bf16_lo(res.y), acc.z), __fadd_rn(bf16_hi(res.y), acc.w));
    *reinterpret_cast<uint2*>(out + 4u * c) = make_uint2(o01, o23);
    const float f[4] = {bf16_lo(o01), bf16_hi(o01), bf16_lo(o23), bf16_hi(o23)};
#pragma unroll
    for (int e = 0; e < 4; ++e) ss = fmaf(f[e], f[e], ss);
}
}  // namespace

// sum_rows_residual, then the next layer's RMSNorm of its BF16 result in the same launch:
// normed = bf16((out / r) * w), r = sqrt(mean(out^2) + eps). One block of 1024 threads owns the
// whole row (the norm needs all of it). Each thread takes 4 consecutive elements and keeps 8 part
// rows' float4 loads in flight, so the launch waits a few L2 round trips instead of one per part
// row (BENCHMARKS.md, "Drafter kernel notes"). The adds stay in row order, so `out` is
// bit-identical to sum_rows_residual's.
extern "C" __global__ void __launch_bounds__(1024) sum_rows_residual_rmsnorm(
    const float* __restrict__ parts, const uint16_t* residual, const uint16_t* __restrict__ norm_w,
    uint16_t* out, uint16_t* __restrict__ normed, uint32_t rows, uint32_t n, float eps) {
    __shared__ float scratch[32];
    const bool vec = (n % 4u == 0) && aligned16(parts) && ((uintptr_t)residual & 7u) == 0 &&
                     ((uintptr_t)out & 7u) == 0 && ((uintptr_t)normed & 7u) == 0 && ((uintptr_t)norm_w & 7u) == 0;
    // A row of at most 4 * blockDim elements (the GLM hidden 4096): one float4 per thread, the norm
    // weight loaded before the wait (it is a weight) and the sum kept in registers for the norm, so
    // the launch costs one round trip for its inputs instead of two.
    const bool one_chunk = vec && n / 4u <= blockDim.x;
    uint2 w1 = make_uint2(0u, 0u);
    if (one_chunk && threadIdx.x < n / 4u) w1 = __ldg(reinterpret_cast<const uint2*>(norm_w) + threadIdx.x);
    wait_then_release();
    if (rows == 0) return;
    constexpr int RL = 8;
    float ss = 0.0f;
    if (one_chunk) {
        const uint32_t c = threadIdx.x;
        uint32_t o01 = 0u, o23 = 0u;
        if (c < n / 4u) {
            sum_chunk_rows<RL>(parts, residual, out, rows, n / 4u, c, o01, o23, ss);
        }
        ss = block_sum(ss, scratch);
        const float d = sqrtf(ss / (float)n + eps);
        if (c < n / 4u)
            *reinterpret_cast<uint2*>(normed + 4u * c) = make_uint2(
                pack_bf16x2(__fmul_rn(bf16_lo(o01) / d, bf16_lo(w1.x)), __fmul_rn(bf16_hi(o01) / d, bf16_hi(w1.x))),
                pack_bf16x2(__fmul_rn(bf16_lo(o23) / d, bf16_lo(w1.y)), __fmul_rn(bf16_hi(o23) / d, bf16_hi(w1.y))));
        return;
    }
    if (vec) {
        const uint32_t n4 = n / 4u;
        for (uint32_t c = threadIdx.x; c < n4; c += blockDim.x) {
            uint32_t o01, o23;
            sum_chunk_rows<RL>(parts, residual, out, rows, n4, c, o01, o23, ss);
        }
    } else {
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
            float acc = __ldcg(parts + i);
            for (uint32_t r = 1; r < rows; ++r) acc = __fadd_rn(acc, __ldcg(parts + (size_t)r * n + i));
            const uint16_t o = f32_to_bf16_bits(__fadd_rn(bf16_bits_to_f32(residual[i]), acc));
            out[i] = o;
            const float v = bf16_bits_to_f32(o);
            ss = fmaf(v, v, ss);
        }
    }
    ss = block_sum(ss, scratch);
    const float d = sqrtf(ss / (float)n + eps);
    // Each thread re-reads only the elements it wrote itself: program order makes them visible.
    if (vec) {
        for (uint32_t c = threadIdx.x; c < n / 4u; c += blockDim.x) {
            const uint2 o = *reinterpret_cast<const uint2*>(out + 4u * c);
            const uint2 w = *reinterpret_cast<const uint2*>(norm_w + 4u * c);
            *reinterpret_cast<uint2*>(normed + 4u * c) = make_uint2(
                pack_bf16x2(__fmul_rn(bf16_lo(o.x) / d, bf16_lo(w.x)), __fmul_rn(bf16_hi(o.x) / d, bf16_hi(w.x))),
                pack_bf16x2(__fmul_rn(bf16_lo(o.y) / d, bf16_lo(w.y)), __fmul_rn(bf16_hi(o.y) / d, bf16_hi(w.y))));
        }
    } else {
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
            normed[i] = f32_to_bf16_bits(__fmul_rn(bf16_bits_to_f32(out[i]) / d, bf16_bits_to_f32(norm_w[i])));
    }
}

// y = W @ (rmsnorm(x) * norm_w): the RMSNorm of the GEMV's input computed by every block into
// shared memory (smem_x_gemv), replacing a single-block rmsnorm launch and its round trip.
// Grid min(ceil(n / 8), the blocks resident at once), block 256, dynamic smem k * 2 bytes.
// __launch_bounds__(256, 4): 62 registers, 4 blocks per SM, which the prologue staged in shared
// memory allows (stage_row_sumsq, ptx/model_common.cuh; BENCHMARKS.md, "Drafter kernel notes").
extern "C" __global__ void __launch_bounds__(256, 4) rmsnorm_gemv(const uint16_t* __restrict__ x,
                                                               const uint16_t* __restrict__ norm_w,
                                                               const uint16_t* __restrict__ w,
                                                               uint16_t* __restrict__ y, uint32_t n, uint32_t k,
                                                               float eps) {
    extern __shared__ __align__(16) uint16_t xs[];
    __shared__ float scratch[64];
    smem_x_gemv(w, y, n, k, xs, RmsNormToSmem{x, norm_w, k, eps, scratch});
}

// rmsnorm_gemv beside the kernel launched before it (Pdl.BESIDE): the q projection beside
// dsa_cache_write, both reading the fused_in projection that completed before them.
extern "C" __global__ void __launch_bounds__(256, 4) rmsnorm_gemv_beside(const uint16_t* __restrict__ x,
                                                                      const uint16_t* __restrict__ norm_w,
                                                                      const uint16_t* __restrict__ w,
                                                                      uint16_t* __restrict__ y, uint32_t n,
                                                                      uint32_t k, float eps) {
    extern __shared__ __align__(16) uint16_t xs[];
    __shared__ float scratch[64];
    smem_x_gemv<true>(w, y, n, k, xs, RmsNormToSmem{x, norm_w, k, eps, scratch});
}
