// y[m, n] = scale[n] * (x[m, k] @ Wq[n, k]^T): FP8 E4M3 weights with one f32 scale per row,
// BF16 activations and output, f32 accumulation. Same streaming design as gemv_bf16.cu (a warp
// owns ROWS rows, each lane keeps ROWS * UNROLL 16-byte weight loads in flight); a 16-byte weight
// chunk is 16 values.
//
// Dequantisation: cvt.rn.f16x2.e4m3x2 turns two E4M3 bytes into an exact f16 pair (every E4M3
// value, subnormals and NaN included, is representable in f16), then f16 -> f32. That is 1.5
// conversions per weight instead of the 3-4 integer ops of a bit-trick decode, and it keeps the
// host twin's math (f32 value of the FP8 weight) bit-for-bit. The scale multiplies the finished
// dot product, as in the host twin.
//
// Per weight byte this kernel issues about three times the instructions of the BF16 GEMV. For
// m <= 2, x is staged once per block in shared memory as f32 (in the layout the lanes read,
// conflict-free), which removes the per-chunk x loads and BF16 unpacking, when the launch gives it
// m * k * 4 bytes of dynamic shared memory (the launch helper does, up to 48 KB); otherwise x is
// read from global memory through L1. Two kernels share the body (see the bottom of this file):
// gemv_fp8w for any m in 1..8 and gemv_fp8w_m2, register-light, for the m = 1 draft head.
// k % 16 != 0 or a pointer that is not 16-byte aligned takes the element-wise path.
#include "common.cuh"
#include "fp8_xsmem.cuh"  // dot16s, stage_x, x_smem
#include <cuda_fp16.h>

// The geometry is fixed by the committed PTX; bench/sweep_gemv.py recompiles with -D overrides to
// measure alternatives (the launch helper's WARPS/ROWS must match the PTX it launches).
#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
#ifndef GEMV_ROWS
#define GEMV_ROWS 2
#endif
#ifndef GEMV_UNROLL1
#define GEMV_UNROLL1 4
#endif
#ifndef GEMV_X_SMEM
#define GEMV_X_SMEM 1
#endif
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 1
#endif

namespace {
constexpr int WARPS = GEMV_WARPS;
constexpr int ROWS = GEMV_ROWS;

// As in gemv_bf16.cu, larger m unrolls less. The register count is set by the m = 8 path, and
// capping it to fit 4 blocks per SM spills (register counts in BENCHMARKS.md, "Runtime kernels:
// notes behind the numbers", FP8 GEMV). bench/sweep_gemv.py measures the trade.
template <int M>
__host__ __device__ constexpr int unroll_for() { return M == 1 ? GEMV_UNROLL1 : (M <= 4 ? 2 : 1); }

template <int M>
__device__ __forceinline__ void store_rows(float (&acc)[M][ROWS], const float* __restrict__ scale, uint16_t* y,
                                           uint32_t row0, uint32_t n) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[mi][r]);
            if (lane == (uint32_t)(mi * ROWS + r) % 32u && row0 + r < n)
                y[(size_t)mi * n + row0 + r] = f32_to_bf16_bits(scale[row0 + r] * v);
        }
}

// x read from global memory (L1) per chunk.
template <int M>
__device__ __forceinline__ void gemv_vec(const uint8_t* __restrict__ W, const float* __restrict__ scale,
                                         const uint16_t* __restrict__ x, uint16_t* __restrict__ y, uint32_t n,
                                         uint32_t k) {
    constexpr int UNROLL = unroll_for<M>();
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (row0 >= n) return;
    const uint32_t kc = k / 16u;  // 16-byte weight chunks per row
    const uint4* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = reinterpret_cast<const uint4*>(W + (size_t)min(row0 + r, n - 1) * k);
    const uint4* xv = reinterpret_cast<const uint4*>(x);  // 2 uint4 of x per weight chunk

    float acc[M][ROWS];
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[mi][r] = 0.0f;

    uint32_t c = lane;
    for (; c + 32u * (UNROLL - 1) < kc; c += 32u * UNROLL) {
        uint4 w[ROWS][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) w[r][u] = ld_stream16(wr[r] + c + 32u * u);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int mi = 0; mi < M; ++mi) {
                const uint4* xc = xv + (size_t)mi * (k / 8u) + 2u * (c + 32u * u);
                const uint4 xa = __ldg(xc), xb = __ldg(xc + 1);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[mi][r] = dot16_fp8(w[r][u], xa, xb, acc[mi][r]);
            }
    }
    for (; c < kc; c += 32u) {
        uint4 w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) w[r] = ld_stream16(wr[r] + c);
#pragma unroll
        for (int mi = 0; mi < M; ++mi) {
            const uint4* xc = xv + (size_t)mi * (k / 8u) + 2u * c;
            const uint4 xa = __ldg(xc), xb = __ldg(xc + 1);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[mi][r] = dot16_fp8(w[r], xa, xb, acc[mi][r]);
        }
    }
    store_rows<M>(acc, scale, y, row0, n);
}

// x staged in shared memory as f32 (stage_x). Only the m <= 2 paths use it (the kernel's
// register count is the maximum over all paths, and larger m would raise it for m = 1 too).
template <int M>
__device__ __forceinline__ void gemv_vec_smem(const uint8_t* __restrict__ W, const float* __restrict__ scale,
                                              uint16_t* __restrict__ y, uint32_t n, uint32_t k) {
    constexpr int UNROLL = unroll_for<M>();
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (row0 >= n) return;
    const uint32_t kc = k / 16u;
    const uint4* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = reinterpret_cast<const uint4*>(W + (size_t)min(row0 + r, n - 1) * k);

    float acc[M][ROWS];
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[mi][r] = 0.0f;

    uint32_t c = lane;
    for (; c + 32u * (UNROLL - 1) < kc; c += 32u * UNROLL) {
        uint4 w[ROWS][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) w[r][u] = ld_stream16(wr[r] + c + 32u * u);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int mi = 0; mi < M; ++mi) {
                float4 xf[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) xf[q] = x_smem[(mi * 4u + q) * kc + c + 32u * u];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[mi][r] = dot16s(w[r][u], xf, acc[mi][r]);
            }
    }
    for (; c < kc; c += 32u) {
        uint4 w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) w[r] = ld_stream16(wr[r] + c);
#pragma unroll
        for (int mi = 0; mi < M; ++mi) {
            float4 xf[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) xf[q] = x_smem[(mi * 4u + q) * kc + c];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[mi][r] = dot16s(w[r], xf, acc[mi][r]);
        }
    }
    store_rows<M>(acc, scale, y, row0, n);
}

template <int M>
__device__ __forceinline__ void gemv_scalar(const uint8_t* __restrict__ W, const float* __restrict__ scale,
                                            const uint16_t* __restrict__ x, uint16_t* __restrict__ y, uint32_t n,
                                            uint32_t k) {
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (row0 >= n) return;
    const uint8_t* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = W + (size_t)min(row0 + r, n - 1) * k;
    float acc[M][ROWS];
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[mi][r] = 0.0f;
    for (uint32_t i = lane; i < k; i += 32u) {
        float w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) w[r] = fp8_to_f32(wr[r][i]);
#pragma unroll
        for (int mi = 0; mi < M; ++mi) {
            const float xi = bf16_bits_to_f32(x[(size_t)mi * k + i]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[mi][r] = fmaf(w[r], xi, acc[mi][r]);
        }
    }
    store_rows<M>(acc, scale, y, row0, n);
}

template <int M>
__device__ __forceinline__ void gemv_dispatch(const uint8_t* W, const float* scale, const uint16_t* x, uint16_t* y,
                                              uint32_t n, uint32_t k, bool vec, bool smem) {
    if (!vec) gemv_scalar<M>(W, scale, x, y, n, k);
#if GEMV_X_SMEM
    else if (M <= 2 && smem) gemv_vec_smem<M>(W, scale, y, n, k);
#endif
    else gemv_vec<M>(W, scale, x, y, n, k);
}
// The whole kernel for m in 1..MAXM: MAXM is a template parameter so that the two exported
// kernels below get their own register allocation.
template <int MAXM>
__device__ __forceinline__ void gemv_fp8w_body(const uint8_t* __restrict__ Wq, const float* __restrict__ scale,
                                               const uint16_t* __restrict__ x, uint16_t* __restrict__ y,
                                               uint32_t m, uint32_t n, uint32_t k) {
    if (m < 1 || m > (uint32_t)MAXM) return;  // the launch helper refuses these before they get here
    const bool vec = (k % 16u == 0) && aligned16(Wq) && aligned16(x);
    // Stage x only if the launch provided the room (read from the hardware, so a launch without
    // the shared memory falls back to the global path instead of overrunning it).
    const uint32_t dyn_smem = dynamic_smem_bytes();
    const bool smem = GEMV_X_SMEM && vec && m <= 2 && (size_t)m * k * 4u <= dyn_smem;
    if (smem) stage_x(x, m, k);  // every thread of the block, before any warp returns
    switch (m) {
        case 1: gemv_dispatch<1>(Wq, scale, x, y, n, k, vec, smem); break;
        case 2: gemv_dispatch<2>(Wq, scale, x, y, n, k, vec, smem); break;
        default:
            if constexpr (MAXM > 2) {
                switch (m) {
                    case 3: gemv_dispatch<3>(Wq, scale, x, y, n, k, vec, false); break;
                    case 4: gemv_dispatch<4>(Wq, scale, x, y, n, k, vec, false); break;
                    case 5: gemv_dispatch<5>(Wq, scale, x, y, n, k, vec, false); break;
                    case 6: gemv_dispatch<6>(Wq, scale, x, y, n, k, vec, false); break;
                    case 7: gemv_dispatch<7>(Wq, scale, x, y, n, k, vec, false); break;
                    case 8: gemv_dispatch<8>(Wq, scale, x, y, n, k, vec, false); break;
                    default: break;
                }
            }
            break;
    }
}
}  // namespace

// An explicit minimum of 1 block is not the same as none (ptxas then takes more registers: same
// notes in BENCHMARKS.md), so the second argument is only given when it binds.
#if GEMV_MIN_BLOCKS > 1
#define GEMV_BOUNDS __launch_bounds__(GEMV_WARPS * 32, GEMV_MIN_BLOCKS)
#else
#define GEMV_BOUNDS __launch_bounds__(GEMV_WARPS * 32)
#endif

// Any m in 1..8. Its register count is set by the m = 8 path (2 blocks of 256 per SM).
extern "C" __global__ void GEMV_BOUNDS gemv_fp8w(const uint8_t* __restrict__ Wq, const float* __restrict__ scale,
                                                 const uint16_t* __restrict__ x, uint16_t* __restrict__ y,
                                                 uint32_t m, uint32_t n, uint32_t k) {
    gemv_fp8w_body<8>(Wq, scale, x, y, m, n, k);
}

// The same for m in 1..2 only (larger m writes nothing), which the launch helper picks for the
// draft head. Without the m > 2 paths it needs 64 registers instead of 96, so 4 blocks of 256 fit
// per SM instead of 2: the general kernel at 16 warps per SM is latency-bound (see BENCHMARKS.md,
// "Runtime kernels: notes behind the numbers", FP8 GEMV).
extern "C" __global__ void GEMV_BOUNDS gemv_fp8w_m2(const uint8_t* __restrict__ Wq, const float* __restrict__ scale,
                                                    const uint16_t* __restrict__ x, uint16_t* __restrict__ y,
                                                    uint32_t m, uint32_t n, uint32_t k) {
    gemv_fp8w_body<2>(Wq, scale, x, y, m, n, k);
}

// ---- m rows in 1..256 --------------------------------------------------------------------------
//
// gemv_fp8w_batch: y[m, n] = scale[n] * (x[m, k] @ Wq[n, k]^T) for any m in 1..256, the GEMV of a
// vocabulary shard of the batched draft head (model/kernels/draft_head.py). A row's outputs are the
// bits the batched single-rank head (head_argmax_fp8_batch) computes for the same weight rows, and
// the bits gemv_fp8w computes: fp8_batch.cuh's order, whatever m, the tile or the row's place.
// Grid: tiles x the blocks per tile (block b takes tile b % tiles of at most 4 rows, and grid-strides
// over the 16-row weight groups with the other blocks of its tile), block 256, tmax * k * 4 bytes of
// dynamic shared memory for the staged tile (without them x is read from global memory: same bits).
// Own geometry, independent of the GEMV_* sweep overrides above: the launch helper's BATCH_* match it.
#include "fp8_batch.cuh"

namespace {
constexpr int BATCH_WARPS = 8;
constexpr int BATCH_ROWS = 2;  // weight rows per warp (as the draft head's batched groups)

template <int M, int U>
__device__ __forceinline__ void gemv_fp8w_batch_groups(const uint8_t* __restrict__ Wq, const float* __restrict__ scale,
                                                       const uint16_t* __restrict__ x, uint16_t* __restrict__ y,
                                                       uint32_t gfirst, uint32_t stride, uint32_t n, uint32_t k,
                                                       int mode) {
    constexpr int R = BATCH_ROWS;
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t groups = (n + BATCH_WARPS * R - 1) / (BATCH_WARPS * R);
    for (uint32_t g = gfirst; g < groups; g += stride) {
        const uint32_t row0 = (g * BATCH_WARPS + (threadIdx.x >> 5)) * R;
        if (row0 >= n) break;  // warp-uniform; later groups only have larger rows
        const float sc = (lane < (uint32_t)R && row0 + lane < n) ? scale[row0 + lane] : 0.0f;
        float dot[R][M];
        fp8_tile_dots<R, M, U>(Wq, x, row0, n, k, mode, dot);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float s = __shfl_sync(0xFFFFFFFFu, sc, r);
#pragma unroll
            for (int i = 0; i < M; ++i)
                if (lane == (uint32_t)(i * R + r) && row0 + r < n)
                    y[(size_t)i * n + row0 + r] = f32_to_bf16_bits(__fmul_rn(s, dot[r][i]));
        }
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256, 4) gemv_fp8w_batch(const uint8_t* __restrict__ Wq,
                                                                     const float* __restrict__ scale,
                                                                     const uint16_t* __restrict__ x,
                                                                     uint16_t* __restrict__ y, uint32_t m, uint32_t n,
                                                                     uint32_t k, uint32_t tiles) {
    const bool ok = m >= 1u && m <= BATCH_MAX_ROWS && tiles >= 1u && tiles <= m &&
                    (m + tiles - 1u) / tiles <= (uint32_t)BATCH_TILE_ROWS && n >= 1u;
    if (!ok) return;  // the launch helper refuses these before they get here
    const uint32_t stride = gridDim.x / tiles, gfirst = blockIdx.x / tiles;
    if (gfirst >= stride) return;  // a grid that is not a multiple of tiles: the spare blocks
    const BatchTile tile = batch_tile(m, tiles, blockIdx.x % tiles);
    const uint32_t tmax = (m + tiles - 1u) / tiles;
    const int mode = fp8_x_mode(Wq, x, k, tmax);
    const uint16_t* xt = x + (size_t)tile.e0 * k;
    uint16_t* yt = y + (size_t)tile.e0 * n;
    if (mode == XS_SMEM) stage_x(xt, tile.rows, k);  // every thread of the block
    switch (tile.rows) {
        case 1: gemv_fp8w_batch_groups<1, 4>(Wq, scale, xt, yt, gfirst, stride, n, k, mode); break;
        case 2: gemv_fp8w_batch_groups<2, 2>(Wq, scale, xt, yt, gfirst, stride, n, k, mode); break;
        case 3: gemv_fp8w_batch_groups<3, 2>(Wq, scale, xt, yt, gfirst, stride, n, k, mode); break;
        default: gemv_fp8w_batch_groups<4, 1>(Wq, scale, xt, yt, gfirst, stride, n, k, mode); break;
    }
}
