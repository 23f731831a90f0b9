// The drafter's projections on tensor cores over a batch of rows (model/kernels/proj_mma.py):
// - proj_mma_{bf16,f32}: y[e][h * y_head + col_i + r] = W_i[h][r] . x[e][h * x_head .. + k] for up to
//   four weight segments (BF16, or FP8 E4M3 with 128 x 128 block scales) and `heads` per-head
//   matrices (gridDim.y), every weight byte read from HBM once per launch for all m rows.
// - rmsnorm_rows_batch: the normalised rows such a projection reads, bf16((x / r) * w) per row.
//
// Why: past a few rows the CUDA-core GEMVs (ptx/bgemv.cu, ptx/bgemv_fp8.cu) are bound by their
// FMAs, not by the weights they stream (o_proj in FP8 took 697 us at 64 rows against a 16 us
// weight floor; BENCHMARKS.md, "Kernel sweeps"). mma.sync m16n8k16 does 2048 multiply-adds an
// instruction, so the same launch stays near its weight floor up to 64 rows per tile.
//
// Arithmetic of one output (weight row w, activation row x). BF16 segment: the f32 sum of the
// tensor core over k: superblocks of 64 columns in increasing order, four MMAs each (j = 0..3) into
// one accumulator from 0. FP8 segment: per 128-column block of the full matrix (columns counted
// from s_col0 + h * k), the block's MMAs from 0 into a partial sum, then acc = acc + s * part in
// two f32 roundings, blocks in increasing order (model/kernels/bgemv_fp8.py fp8_block_dot, the twin,
// computes the same outer sum; the tensor core's sum inside a k16 step is its own, so GPU and twin
// differ by the rounding of the partial sums alone). The E4M3 bytes are widened to BF16 exactly
// (ptx/mma_bf16.cuh).
//
// Batch invariance: an output depends only on its weight row, its x row and that fixed order; an
// MMA's output column comes from its own column of B. Neither m, the tile, the column group, the
// other rows nor the row's place in the batch change its bits, so a row drafted in a batch of 256
// has the bits it has alone.
//
// Fragments (as ptx/moe.cu and ptx/draft_head.cu): lane (g = lane / 4, t = lane % 4) loads the 16
// weights at column 64 sb + 16 t of rows g and g + 8 of its warp tile (superblock sb) and, for
// column group c, the 16 x values at the same columns of tile row 8 c + g. MMA j takes elements
// 4j .. 4j + 3 of them: its logical k pairs (2t, 2t + 1) and (2t + 8, 2t + 9) are the physical
// pairs (16t + 4j, +1) and (16t + 4j + 2, +3) for A and B alike, so each product pairs a weight with
// its own x and the four MMAs cover the superblock's 64 columns once.
//
// Work: block = 8 warps, two blocks an SM (125 registers: tiles of 32 x rows; tiles of 64 took 189
// registers, one block an SM, and ran o_proj at 64 rows in 62 us), each warp a tile of 16 weight
// rows of one segment (a segment's last tile is
// clamped: rows past it read its last row and are not stored); blockIdx.x = row group * tiles +
// tile, so the `tiles` blocks of one row group (at most 32 x rows each) run side by side and all
// but the first read the weights from L2; blockIdx.y = head. The tile's x rows are staged in
// shared memory by cp.async (L2 only: x may come from a kernel that released its dependents
// early), row i of a k-slice of S superblocks at i * (128 S + 16) bytes (an odd number of 16-byte
// units apart: the quarter warps' 16-byte loads are conflict-free). With room for all of k the
// slice is staged once; otherwise two buffers alternate, the next slice copied while the MMAs read
// the current one (ptx/draft_head.cu head_argmax_fp8_mma's scheme).
//
// Needs k % 64 == 0, 16-byte aligned x rows and heads (x, x_stride, x_head multiples of 8
// elements), 16-byte aligned weight rows, s_col0 % 64 == 0 and a tile's x rows in the dynamic
// shared memory (at least two slices of one superblock); the launch helper checks all of it.
#include "model_common.cuh"
#include "mma_bf16.cuh"

namespace {
constexpr uint32_t PM_ROWS = 16;   // weight rows per warp tile: the MMA's M
constexpr uint32_t PM_N = 8;       // x rows per column group: the MMA's N
constexpr int PM_NG = 4;           // column groups per tile (model/kernels/proj_mma.py TILE_ROWS / 8)
constexpr int PM_U8 = 3;           // FP8: superblocks per load batch (3 x 16 bytes a row per lane)
constexpr int PM_U16 = 2;          // BF16: superblocks per load batch (2 x 32 bytes a row per lane)
constexpr uint32_t PM_BLOCK = 128;  // FP8 scale block, both dimensions

extern __shared__ __align__(16) uint4 pm_smem[];

__device__ __forceinline__ uint32_t word_of4(const uint4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t pm_dynamic_smem() {
    uint32_t r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

struct ProjSegs {
    const void* w[4];
    const float* s[4];
    uint32_t rows[4], col[4], row0[4];
    uint32_t fp8_mask;
};

// One warp's tile: its lane's weight rows g and g + 8 at column 16 t, their scale rows (FP8), and
// where its outputs go.
struct WarpTile {
    const uint8_t* w0;
    const uint8_t* w1;
    const float* s0;
    const float* s1;
    uint32_t r0;    // the tile's first row in its segment
    uint32_t rows;  // the segment's rows
    uint32_t col;   // the segment's first output column
    bool fp8;
    bool live;
};

__device__ __forceinline__ uint32_t tiles_of(uint32_t rows) { return (rows + PM_ROWS - 1u) / PM_ROWS; }

// Warp tile `wt` of head h over the segments in argument order. A select chain, not an indexed
// array (a dynamic index into the parameters would copy them to local memory).
__device__ __forceinline__ WarpTile warp_tile(const ProjSegs& a, uint32_t wt, uint32_t h, uint32_t k, uint32_t s_cols,
                                              uint32_t g, uint32_t t) {
    const uint32_t e0 = tiles_of(a.rows[0]), e1 = e0 + tiles_of(a.rows[1]), e2 = e1 + tiles_of(a.rows[2]),
                   e3 = e2 + tiles_of(a.rows[3]);
    const uint32_t i = (uint32_t)(wt >= e0) + (uint32_t)(wt >= e1) + (uint32_t)(wt >= e2);
    const uint32_t start = i == 0 ? 0u : i == 1 ? e0 : i == 2 ? e1 : e2;
    const void* w = i == 0 ? a.w[0] : i == 1 ? a.w[1] : i == 2 ? a.w[2] : a.w[3];
    const float* s = i == 0 ? a.s[0] : i == 1 ? a.s[1] : i == 2 ? a.s[2] : a.s[3];
    const uint32_t rows = i == 0 ? a.rows[0] : i == 1 ? a.rows[1] : i == 2 ? a.rows[2] : a.rows[3];
    const uint32_t col = i == 0 ? a.col[0] : i == 1 ? a.col[1] : i == 2 ? a.col[2] : a.col[3];
    const uint32_t row0 = i == 0 ? a.row0[0] : i == 1 ? a.row0[1] : i == 2 ? a.row0[2] : a.row0[3];
    WarpTile wtile;
    wtile.live = wt < e3;
    wtile.fp8 = (a.fp8_mask >> i) & 1u;
    wtile.rows = rows;
    wtile.col = col;
    wtile.r0 = (wt - start) * PM_ROWS;
    const uint32_t last = rows > 0u ? rows - 1u : 0u;
    const uint32_t ra = min(wtile.r0 + g, last), rb = min(wtile.r0 + g + 8u, last);
    const size_t esz = wtile.fp8 ? 1u : 2u;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(w) + (size_t)h * rows * k * esz;
    wtile.w0 = base + ((size_t)ra * k + 16u * t) * esz;
    wtile.w1 = base + ((size_t)rb * k + 16u * t) * esz;
    wtile.s0 = s + (size_t)((row0 + ra) / PM_BLOCK) * s_cols;
    wtile.s1 = s + (size_t)((row0 + rb) / PM_BLOCK) * s_cols;
    return wtile;
}

// Superblocks [sb0, sb0 + cnt) of the tile's `rows` x rows (row i at xt + i * x_stride elements)
// into shared memory from uint4 `buf` on, rows 8 S + 1 uint4 apart, by cp.async as one commit
// group. Every thread of the block; the caller waits and then needs a barrier.
__device__ __forceinline__ void stage_slice(const uint16_t* __restrict__ xt, uint32_t x_stride, uint32_t rows,
                                            uint32_t sb0, uint32_t cnt, uint32_t S, uint32_t buf) {
    const uint32_t per_row = 8u * cnt;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(pm_smem) + 16u * buf;
    for (uint32_t j = threadIdx.x; j < rows * per_row; j += blockDim.x) {
        const uint32_t r = j / per_row, c = j % per_row;
        const uint4* src = reinterpret_cast<const uint4*>(xt + (size_t)r * x_stride) + 8u * sb0 + c;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + 16u * (r * (8u * S + 1u) + c)),
                     "l"(src)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void pm_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The MMAs of one superblock for column groups 0 .. NG - 1: A from the lane's weight fragments
// a[j][0..3] (MMA j), B from the staged x (column group c's row at xs + xrow[c], superblock at
// +off). All NG groups' x first, then MMA j of every group before MMA j + 1 of any: NG independent
// accumulators between two MMAs into one (with a branch per group, ptxas issued each group's four
// dependent MMAs back to back behind its shared-memory loads: about 80 TFLOP/s at 64 rows).
template <int NG>
__device__ __forceinline__ void superblock_mmas(const uint32_t (&a)[4][4], const uint4* xs,
                                                const uint32_t (&xrow)[PM_NG], uint32_t off,
                                                float (&acc)[PM_NG][4]) {
    uint4 x0[NG], x1[NG];
#pragma unroll
    for (int c = 0; c < NG; ++c) {
        x0[c] = xs[xrow[c] + off];
        x1[c] = xs[xrow[c] + off + 1u];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < NG; ++c) {
            const uint4& xh = j < 2 ? x0[c] : x1[c];
            mma_bf16_16816(acc[c], a[j][0], a[j][1], a[j][2], a[j][3], word_of4(xh, 2 * (j & 1)),
                           word_of4(xh, 2 * (j & 1) + 1));
        }
}

// acc += the warp tile's BF16 rows times superblocks [sb0, sb1) of the slice staged at xs, for
// column groups 0 .. NG - 1 (those past the tile's rows read its last row; their outputs are dropped).
template <int NG>
__device__ __forceinline__ void slice_bf16(const WarpTile& wt, uint32_t sb0, uint32_t sb1, uint32_t nsb,
                                           const uint4* xs, const uint32_t (&xrow)[PM_NG],
                                           float (&acc)[PM_NG][4]) {
    for (uint32_t b0 = sb0; b0 < sb1; b0 += PM_U16) {
        uint4 wa[PM_U16][2], wb[PM_U16][2];
#pragma unroll
        for (int u = 0; u < PM_U16; ++u) {
            const uint32_t sb = b0 + u;
            const bool in = sb < sb1;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                wa[u][q] = in ? ld_stream16(wt.w0 + 128u * sb + 16u * q) : make_uint4(0, 0, 0, 0);
                wb[u][q] = in ? ld_stream16(wt.w1 + 128u * sb + 16u * q) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < PM_U16; ++u) {
            const uint32_t sb = b0 + PM_U16 + u;
            if (sb < nsb) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wt.w0 + 128u * sb));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wt.w1 + 128u * sb));
            }
        }
#pragma unroll
        for (int u = 0; u < PM_U16; ++u) {
            const uint32_t sb = b0 + u;
            if (sb < sb1) {
                // Lane elements 16t .. 16t + 15 of the superblock: word w holds elements 2w, 2w + 1,
                // so MMA j takes words 2j (a0 / a1) and 2j + 1 (a2 / a3).
                const uint32_t pa[8] = {wa[u][0].x, wa[u][0].y, wa[u][0].z, wa[u][0].w,
                                        wa[u][1].x, wa[u][1].y, wa[u][1].z, wa[u][1].w};
                const uint32_t pb[8] = {wb[u][0].x, wb[u][0].y, wb[u][0].z, wb[u][0].w,
                                        wb[u][1].x, wb[u][1].y, wb[u][1].z, wb[u][1].w};
                uint32_t a[4][4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    a[j][0] = pa[2 * j];
                    a[j][1] = pb[2 * j];
                    a[j][2] = pa[2 * j + 1];
                    a[j][3] = pb[2 * j + 1];
                }
                superblock_mmas<NG>(a, xs, xrow, 8u * (sb - sb0), acc);
            }
        }
    }
}

// The FP8 twin of slice_bf16: per 128-column block of the full matrix (columns from cbase) the
// partial sums `part`, folded into acc with the rows' block scales where a block or the block's
// split of k (at superblock nsb) ends.
template <int NG>
__device__ __forceinline__ void slice_fp8(const WarpTile& wt, uint32_t sb0, uint32_t sb1, uint32_t nsb, uint32_t cbase,
                                          const uint4* xs, const uint32_t (&xrow)[PM_NG], float (&part)[PM_NG][4],
                                          float (&acc)[PM_NG][4]) {
    for (uint32_t b0 = sb0; b0 < sb1; b0 += PM_U8) {
        uint4 wa[PM_U8], wb[PM_U8];
#pragma unroll
        for (int u = 0; u < PM_U8; ++u) {
            const uint32_t sb = b0 + u;
            wa[u] = sb < sb1 ? ld_stream16(wt.w0 + 64u * sb) : make_uint4(0, 0, 0, 0);
            wb[u] = sb < sb1 ? ld_stream16(wt.w1 + 64u * sb) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < PM_U8; ++u) {
            const uint32_t sb = b0 + PM_U8 + u;
            if (sb < nsb) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wt.w0 + 64u * sb));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wt.w1 + 64u * sb));
            }
        }
#pragma unroll
        for (int u = 0; u < PM_U8; ++u) {
            const uint32_t sb = b0 + u;
            if (sb < sb1) {
                const uint32_t qa[4] = {wa[u].x, wa[u].y, wa[u].z, wa[u].w};
                const uint32_t qb[4] = {wb[u].x, wb[u].y, wb[u].z, wb[u].w};
                uint32_t a[4][4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    e4m3x4_to_bf16x2(qa[j], a[j][0], a[j][2]);  // row g: elements 4j, 4j + 1 | 4j + 2, 4j + 3
                    e4m3x4_to_bf16x2(qb[j], a[j][1], a[j][3]);  // row g + 8
                }
                superblock_mmas<NG>(a, xs, xrow, 8u * (sb - sb0), part);
                const uint32_t end = cbase + 64u * (sb + 1u);
                if (end % PM_BLOCK == 0u || sb + 1u == nsb) {
                    const uint32_t kb = (end - 1u) / PM_BLOCK;
                    const float s0 = __ldg(wt.s0 + kb), s1 = __ldg(wt.s1 + kb);
#pragma unroll
                    for (int c = 0; c < NG; ++c) fp8_block_done(acc[c], part[c], s0, s1);
                }
            }
        }
    }
}

// The slice for the tile's column groups, rounded up to a power of two (block-uniform).
__device__ __forceinline__ void slice_any(const WarpTile& wt, uint32_t s0, uint32_t s1, uint32_t nsb, uint32_t cbase,
                                          const uint4* xs, const uint32_t (&xrow)[PM_NG], uint32_t ngc,
                                          float (&part)[PM_NG][4], float (&acc)[PM_NG][4]) {
    if (wt.fp8) {
        if (ngc <= 1u) slice_fp8<1>(wt, s0, s1, nsb, cbase, xs, xrow, part, acc);
        else if (ngc <= 2u) slice_fp8<2>(wt, s0, s1, nsb, cbase, xs, xrow, part, acc);
        else slice_fp8<4>(wt, s0, s1, nsb, cbase, xs, xrow, part, acc);
    } else {
        if (ngc <= 1u) slice_bf16<1>(wt, s0, s1, nsb, xs, xrow, acc);
        else if (ngc <= 2u) slice_bf16<2>(wt, s0, s1, nsb, xs, xrow, acc);
        else slice_bf16<4>(wt, s0, s1, nsb, xs, xrow, acc);
    }
}

template <bool OUT_F32>
__device__ __forceinline__ void store_out(void* y, size_t idx, float v) {
    if (OUT_F32) reinterpret_cast<float*>(y)[idx] = v;
    else reinterpret_cast<uint16_t*>(y)[idx] = f32_to_bf16_bits(v);
}

template <bool OUT_F32>
__device__ __forceinline__ void proj_mma_body(const uint16_t* __restrict__ x, uint32_t x_stride, uint32_t x_head,
                                              void* __restrict__ y, uint32_t y_stride, uint32_t y_head, uint32_t m,
                                              uint32_t k, uint32_t tiles, uint32_t heads, uint32_t s_cols,
                                              uint32_t s_col0, uint32_t ksplit, float* __restrict__ part_out,
                                              const ProjSegs& segs) {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const uint32_t g = lane >> 2, t = lane & 3;
    const uint32_t h = blockIdx.y, tile = blockIdx.x % tiles, rk = blockIdx.x / tiles;
    const uint32_t rg = rk / ksplit, ks = rk % ksplit;
    const WarpTile wt = warp_tile(segs, rg * nwarps + warp, h, k, s_cols, g, t);
    // This block's split of k: superblocks [sb_lo, sb_lo + nsb) of the row (ksplit divides k / 64).
    const uint32_t nsb = k / 64u / ksplit, sb_lo = ks * nsb;
    {
        // The tile's first weight batches towards L2 before the wait (weights only: no kernel of
        // the step writes them).
        const uint32_t stride = wt.fp8 ? 64u : 128u;
        if (wt.live)
            for (uint32_t sb = sb_lo; sb < sb_lo + min(nsb, 2u * PM_U8); ++sb) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wt.w0 + stride * sb));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wt.w1 + stride * sb));
            }
    }
    grid_dependency_wait();
    // Tile `tile` of `tiles` balanced tiles over the m rows (the first m % tiles get one more).
    const uint32_t base = m / tiles, rem = m % tiles;
    const uint32_t e0 = tile * base + min(tile, rem), rows = base + (tile < rem ? 1u : 0u);
    const uint32_t tmax = base + (rem ? 1u : 0u);
    const uint32_t per_row = pm_dynamic_smem() / tmax;  // bytes of staging a tile row has
    const bool whole = per_row >= 128u * nsb + 16u;
    const uint32_t S = whole ? nsb : per_row >= 288u ? (per_row / 2u - 16u) / 128u : 0u;
    if (rows == 0u || S == 0u || nsb == 0u || h >= heads) return;  // the launch helper makes none
    const uint32_t nslices = (nsb + S - 1u) / S;
    const uint32_t bufsize = rows * (8u * S + 1u);  // uint4 per buffer
    const uint32_t ngc = (rows + PM_N - 1u) / PM_N;
    const uint16_t* xt = x + (size_t)e0 * x_stride + (size_t)h * x_head;
    uint32_t xrow[PM_NG];
#pragma unroll
    for (int c = 0; c < PM_NG; ++c) xrow[c] = min((uint32_t)c * PM_N + g, rows - 1u) * (8u * S + 1u) + 2u * t;
    float acc[PM_NG][4], part[PM_NG][4];
#pragma unroll
    for (int c = 0; c < PM_NG; ++c)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[c][q] = part[c][q] = 0.0f;
    const uint32_t cbase = s_col0 + h * k, sb_hi = sb_lo + nsb;
    stage_slice(xt, x_stride, rows, sb_lo, min(S, nsb), S, 0u);
    for (uint32_t sl = 0; sl < nslices; ++sl) {
        if (sl + 1u < nslices) {
            const uint32_t nx = sl + 1u;
            stage_slice(xt, x_stride, rows, sb_lo + nx * S, min(S, nsb - nx * S), S, (nx & 1u) * bufsize);
            pm_cp_async_wait<1>();
        } else {
            pm_cp_async_wait<0>();
        }
        __syncthreads();
        const uint32_t s0 = sb_lo + sl * S, s1 = min(sb_hi, s0 + S);
        const uint4* xs = pm_smem + (sl & 1u) * bufsize;
        if (wt.live) slice_any(wt, s0, s1, sb_hi, cbase, xs, xrow, ngc, part, acc);
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
    if (!wt.live) return;
    const uint32_t ra = wt.r0 + g, rb = ra + 8u;
#pragma unroll
    for (int c = 0; c < PM_NG; ++c) {
        if ((uint32_t)c < ngc) {
            const uint32_t i0 = (uint32_t)c * PM_N + 2u * t;  // this lane's tile rows i0, i0 + 1
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint32_t r = q < 2 ? ra : rb, i = i0 + (uint32_t)(q & 1);
                if (r >= wt.rows || i >= rows) continue;
                const size_t at = (size_t)(e0 + i) * y_stride + (size_t)h * y_head + wt.col + r;
                if (ksplit == 1u) store_out<OUT_F32>(y, at, acc[c][q]);
                else part_out[(size_t)ks * m * y_stride + at] = acc[c][q];
            }
        }
    }
}
}  // namespace

#define PM_PARAMS                                                                                              \
    const uint16_t *__restrict__ x, uint32_t x_stride, uint32_t x_head, void *__restrict__ y, uint32_t y_stride, \
        uint32_t y_head, uint32_t m, uint32_t k, uint32_t tiles, uint32_t heads, uint32_t s_cols,             \
        uint32_t s_col0, uint32_t ksplit, float *__restrict__ part, uint32_t fp8_mask,                         \
        const void *w0, const float *s0, uint32_t rows0, uint32_t col0, uint32_t row0_0,    \
        const void *w1, const float *s1, uint32_t rows1, uint32_t col1, uint32_t row0_1, const void *w2,       \
        const float *s2, uint32_t rows2, uint32_t col2, uint32_t row0_2, const void *w3, const float *s3,      \
        uint32_t rows3, uint32_t col3, uint32_t row0_3
#define PM_SEGS                                                                                              \
    ProjSegs{{w0, w1, w2, w3},         {s0, s1, s2, s3},         {rows0, rows1, rows2, rows3},               \
             {col0, col1, col2, col3}, {row0_0, row0_1, row0_2, row0_3}, fp8_mask}

// y[e][h * y_head + col_i + r] = W_i[h][r] . x[e][h * x_head .. h * x_head + k) for e < m, head
// h < heads (gridDim.y), segment i < 4 (an unused one has rows 0; with several heads one segment, W_i[h] at
// w_i + h * rows_i * k elements) and r < rows_i. Segment i is FP8 (one byte a weight) with block
// scales s_i [.][s_cols] when bit i of fp8_mask is set, its row r being row row0_i + r of the
// scales and its column c of head h column s_col0 + h * k + c; else BF16. Grid (row groups * tiles,
// heads), block 256 (8 warps of 16 weight rows), dynamic shared memory: the x staging (file
// comment). Pdl.WAIT, releasing at exit.
extern "C" __global__ void __launch_bounds__(256, 2) proj_mma_bf16(PM_PARAMS) {
    proj_mma_body<false>(x, x_stride, x_head, y, y_stride, y_head, m, k, tiles, heads, s_cols, s_col0, ksplit, part,
                         PM_SEGS);
}

// proj_mma_bf16 with y f32.
extern "C" __global__ void __launch_bounds__(256, 2) proj_mma_f32(PM_PARAMS) {
    proj_mma_body<true>(x, x_stride, x_head, y, y_stride, y_head, m, k, tiles, heads, s_cols, s_col0, ksplit, part,
                        PM_SEGS);
}

// out[e][0..k) = bf16((x_e / r) * w), r = sqrt(sum(x_e^2) / k + eps) (ptx/common.cuh rms_divisor's
// sum: thread-strided fmaf, then block_sum; so the row has the bits every other normalised row of
// the drafter has). One block of 256 per row e (gridDim.x = m). x through L2 (it may come from a
// kernel that released its dependents early). Pdl.WAIT, releasing at exit.
extern "C" __global__ void __launch_bounds__(256) rmsnorm_rows_batch(const uint16_t* __restrict__ x, uint32_t x_stride,
                                                                     const uint16_t* __restrict__ w,
                                                                     uint16_t* __restrict__ out, uint32_t out_stride,
                                                                     uint32_t m, uint32_t k, float eps) {
    __shared__ float scratch[32];
    grid_dependency_wait();
    if (blockIdx.x >= m) return;  // the launch helper makes none
    const uint16_t* xr = x + (size_t)blockIdx.x * x_stride;
    uint16_t* orow = out + (size_t)blockIdx.x * out_stride;
    const bool vec = k % 8u == 0 && aligned16(xr) && aligned16(w) && aligned16(orow);
    float ss = 0.0f;
    if (vec) {
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        for (uint32_t c = threadIdx.x; c < k / 8u; c += blockDim.x) {
            const uint4 v = __ldcg(xv + c);
            const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float a = bf16_lo(words[q]), b = bf16_hi(words[q]);
                ss = fmaf(a, a, ss);
                ss = fmaf(b, b, ss);
            }
        }
    } else {
        for (uint32_t i = threadIdx.x; i < k; i += blockDim.x) {
            const float a = bf16_bits_to_f32(__ldcg(xr + i));
            ss = fmaf(a, a, ss);
        }
    }
    ss = block_sum(ss, scratch);
    const float d = sqrtf(ss / (float)k + eps);
    if (vec) {
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        const uint4* wv = reinterpret_cast<const uint4*>(w);
        for (uint32_t c = threadIdx.x; c < k / 8u; c += blockDim.x) {
            const uint4 xc = __ldcg(xv + c), wc = __ldg(wv + c);
            const uint32_t xw[4] = {xc.x, xc.y, xc.z, xc.w}, ww[4] = {wc.x, wc.y, wc.z, wc.w};
            uint32_t o[4];
#pragma unroll
            for (int q = 0; q < 4; ++q)
                o[q] = pack_bf16x2(__fmul_rn(bf16_lo(xw[q]) / d, bf16_lo(ww[q])),
                                   __fmul_rn(bf16_hi(xw[q]) / d, bf16_hi(ww[q])));
            reinterpret_cast<uint4*>(orow)[c] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    } else {
        for (uint32_t i = threadIdx.x; i < k; i += blockDim.x)
            orow[i] = f32_to_bf16_bits(__fmul_rn(bf16_bits_to_f32(__ldcg(xr + i)) / d, bf16_bits_to_f32(w[i])));
    }
}

// The split-k sum of proj_mma_{bf16,f32} launched with ksplit > 1: y[e][h * y_head + col_i + r] =
// (((part[0] + part[1]) + part[2]) + ...) of the splits' f32 partials (laid out as y, f32, split s
// at part + s * m * y_stride), the splits in increasing order, for the segments' columns only.
// Grid (m, heads), block 256. Pdl.WAIT, releasing at exit.
template <bool OUT_F32>
__device__ __forceinline__ void proj_reduce_body(const float* __restrict__ part, void* __restrict__ y, uint32_t y_stride,
                                                 uint32_t y_head, uint32_t m, uint32_t ksplit, uint32_t heads,
                                                 const uint32_t (&rows)[4],
                                                 const uint32_t (&col)[4]) {
    grid_dependency_wait();
    const uint32_t e = blockIdx.x, h = blockIdx.y;
    if (e >= m || h >= heads) return;  // the launch helper makes none
    const uint32_t e1 = rows[0], e2 = e1 + rows[1], e3 = e2 + rows[2], n = e3 + rows[3];
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        const uint32_t i = (uint32_t)(j >= e1) + (uint32_t)(j >= e2) + (uint32_t)(j >= e3);
        const uint32_t start = i == 0 ? 0u : i == 1 ? e1 : i == 2 ? e2 : e3;
        const uint32_t c = (i == 0 ? col[0] : i == 1 ? col[1] : i == 2 ? col[2] : col[3]) + (j - start);
        const size_t at = (size_t)e * y_stride + (size_t)h * y_head + c;
        float v = __ldcg(part + at);
        for (uint32_t s = 1; s < ksplit; ++s) v = __fadd_rn(v, __ldcg(part + (size_t)s * m * y_stride + at));
        store_out<OUT_F32>(y, at, v);
    }
}

#define PR_PARAMS                                                                                              \
    const float *__restrict__ part, void *__restrict__ y, uint32_t y_stride, uint32_t y_head, uint32_t m,       \
        uint32_t ksplit, uint32_t heads, uint32_t rows0, uint32_t col0, uint32_t rows1, uint32_t col1, uint32_t rows2,         \
        uint32_t col2, uint32_t rows3, uint32_t col3

extern "C" __global__ void __launch_bounds__(256) proj_reduce_bf16(PR_PARAMS) {
    proj_reduce_body<false>(part, y, y_stride, y_head, m, ksplit, heads, {rows0, rows1, rows2, rows3}, {col0, col1, col2, col3});
}

extern "C" __global__ void __launch_bounds__(256) proj_reduce_f32(PR_PARAMS) {
    proj_reduce_body<true>(part, y, y_stride, y_head, m, ksplit, heads, {rows0, rows1, rows2, rows3}, {col0, col1, col2, col3});
}
