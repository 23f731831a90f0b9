// FP8-weight dot products over a batch, shared by the batched draft head (ptx/draft_head.cu,
// head_argmax_fp8_batch) and the batched GEMV of a vocabulary shard (ptx/gemv_fp8w.cu,
// gemv_fp8w_batch), so that a rank's shard of the vocabulary gets the bits the single-rank head
// gets. build.py hashes this file into the .ptx of every includer.
//
// Batch invariance. A warp multiplies R weight rows by the M rows of one batch tile, and every
// (weight row, x row) pair has its own accumulator, summed in the order of the single-row kernels
// (warp_gemv_fp8_xs in draft_head.cu, warp_gemv_fp8 in model_common.cuh, gemv_fp8w.cu): lane L
// takes the 16-weight chunks c = L, L + 32, L + 64, ... in that order, and within a chunk the 16
// weights in order, one fmaf each; the caller then reduces the 32 lane sums with warp_sum and
// multiplies by the row scale. Nothing in that order depends on R, M, the tile, the batch or the
// row's place in it, so a row's logit has the same bits in every launch, alone or in a batch of
// 256, and the same bits as the head's one-row path (the x values are exact in f32 whether they come
// from shared memory or global memory).
//
// Tiles. The launch splits the m rows into `tiles` balanced tiles of at most BATCH_TILE_ROWS rows
// (batch_tile); block b works on tile b % tiles, so the blocks of consecutive ids read the same
// weight groups at about the same time and the weights come from HBM about once per launch (the
// other tiles' reads hit L2). A block stages its tile's x rows once in shared memory as f32
// (stage_x's layout, m = rows) and then grid-strides over the weight groups.
#pragma once
#include "common.cuh"
#include "fp8_xsmem.cuh"  // x_smem, stage_x, dynamic_smem_bytes

namespace {
constexpr uint32_t BATCH_MAX_ROWS = 256;  // model/kernels/batch.py: a launch covers 1..256 entries
constexpr int BATCH_TILE_ROWS = 4;        // rows of x per tile at most (launch helpers: TILE_ROWS)

struct BatchTile {
    uint32_t e0;    // first row of the tile
    uint32_t rows;  // rows in it: ceil(m / tiles) or floor(m / tiles)
};

// Tile t of `tiles` over m rows: the first m % tiles tiles get one row more.
__device__ __forceinline__ BatchTile batch_tile(uint32_t m, uint32_t tiles, uint32_t t) {
    const uint32_t base = m / tiles, rem = m % tiles;
    return BatchTile{t * base + min(t, rem), base + (t < rem ? 1u : 0u)};
}

// How a block reads x: staged in shared memory (XS_SMEM), vector loads from global memory when the
// launch gave no room (XS_GLOBAL; the same values), or element-wise (XS_SCALAR: k % 16 != 0 or an
// unaligned pointer, the single-row kernels' scalar path and its order).
enum XMode : int { XS_SCALAR = 0, XS_GLOBAL = 1, XS_SMEM = 2 };

__device__ __forceinline__ uint32_t word_of(const uint4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

// Elements 16c + 4q .. 16c + 4q + 3 of tile row i as f32. Global reads go through L2: x may come
// from a kernel that released its dependents early (ptx/common.cuh).
template <int MODE>
__device__ __forceinline__ float4 x_quarter16(const uint16_t* __restrict__ x, int i, int q, uint32_t c, uint32_t k) {
    if (MODE == XS_SMEM) return x_smem[((uint32_t)i * 4u + (uint32_t)q) * (k >> 4) + c];
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(x + (size_t)i * k + 16u * c + 4u * (uint32_t)q));
    return make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
}

// acc[r][i] += the lane's chunks of weight row w[r] times tile row i of x (module comment for the
// order). U: 16-byte weight loads per row per lane in flight. The vector modes need k % 16 == 0
// and 16-byte aligned w and x; rows of x are k elements apart.
template <int R, int M, int U, int MODE>
__device__ __forceinline__ void fp8_tile_dot(const uint8_t* const (&w)[R], const uint16_t* __restrict__ x, uint32_t k,
                                             float (&acc)[R][M]) {
    const uint32_t lane = threadIdx.x & 31;
    if (MODE == XS_SCALAR) {
        for (uint32_t j = lane; j < k; j += 32u) {
            float wf[R];
#pragma unroll
            for (int r = 0; r < R; ++r) wf[r] = fp8_to_f32(w[r][j]);
#pragma unroll
            for (int i = 0; i < M; ++i) {
                const float xi = bf16_bits_to_f32(__ldcg(x + (size_t)i * k + j));
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r][i] = fmaf(wf[r], xi, acc[r][i]);
            }
        }
        return;
    }
    const uint32_t kc = k >> 4;
    for (uint32_t c0 = lane; c0 < kc; c0 += 32u * U) {
        uint4 wv[R][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t c = c0 + 32u * u;
#pragma unroll
            for (int r = 0; r < R; ++r)
                wv[r][u] = c < kc ? ld_stream16(reinterpret_cast<const uint4*>(w[r]) + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t c = c0 + 32u * u;
            if (c < kc) {
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    float4 xf[M];
#pragma unroll
                    for (int i = 0; i < M; ++i) xf[i] = x_quarter16<MODE>(x, i, q, c, k);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        float f[4];
                        fp8x4_to_f32(word_of(wv[r][u], q), f);
#pragma unroll
                        for (int i = 0; i < M; ++i) {
                            acc[r][i] = fmaf(f[0], xf[i].x, acc[r][i]);
                            acc[r][i] = fmaf(f[1], xf[i].y, acc[r][i]);
                            acc[r][i] = fmaf(f[2], xf[i].z, acc[r][i]);
                            acc[r][i] = fmaf(f[3], xf[i].w, acc[r][i]);
                        }
                    }
                }
            }
        }
    }
}

// The unscaled dots of weight rows row0 .. row0 + R - 1 (clamped to n - 1: the caller drops the
// rows past n) with the M rows of the tile at x, reduced over the warp: every lane gets every
// dot[r][i] (warp_sum's butterfly gives all lanes the same bits).
template <int R, int M, int U>
__device__ __forceinline__ void fp8_tile_dots(const uint8_t* __restrict__ wq, const uint16_t* __restrict__ x,
                                              uint32_t row0, uint32_t n, uint32_t k, int mode, float (&dot)[R][M]) {
    const uint8_t* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = wq + (size_t)min(row0 + (uint32_t)r, n - 1u) * k;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) dot[r][i] = 0.0f;
    if (mode == XS_SMEM) fp8_tile_dot<R, M, U, XS_SMEM>(wr, x, k, dot);
    else if (mode == XS_GLOBAL) fp8_tile_dot<R, M, U, XS_GLOBAL>(wr, x, k, dot);
    else fp8_tile_dot<R, M, U, XS_SCALAR>(wr, x, k, dot);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) dot[r][i] = warp_sum(dot[r][i]);
}

// The x mode of a launch: staged when the launch gave room for its largest tile (read from the
// hardware, as gemv_fp8w does), else read from global memory.
__device__ __forceinline__ int fp8_x_mode(const uint8_t* wq, const uint16_t* x, uint32_t k, uint32_t tile_rows) {
    const bool vec = (k % 16u == 0) && aligned16(wq) && aligned16(x);
    if (!vec) return XS_SCALAR;
    return (size_t)tile_rows * k * 4u <= dynamic_smem_bytes() ? XS_SMEM : XS_GLOBAL;
}
}  // namespace
