// Dot products of FP8 E4M3 weight rows with one f32 scale per 128 x 128 block (the DeepSeek / GLM
// checkpoint convention, model/checkpoint/fp8.py: W[i][j] = q[i][j] * s[i / 128][j / 128]) against
// BF16 activation rows, for the block-scaled projections of ptx/bgemv_fp8.cu. build.py hashes this
// file into the .ptx of every includer.
//
// The arithmetic of one output (weight row q, activation row x; model/kernels/bgemv_fp8.py states
// the same formula for the host twin). Element j of the row is column base + j of the full matrix
// (base: where the row's columns start in it; 0 for a whole row, col0 + h * k for head h of o_proj),
// so the row is cut at that matrix's 128-column blocks b. Per block, P_b = the f32 dot of the exact
// f32 FP8 values with x over the row's elements in the block; then
//     y = (((0 + P_b0 * s_b0) + P_b1 * s_b1) + ...) + P_bn * s_bn
// in increasing b, each product and each sum rounded to f32 (no contraction). Within a block:
// - vector path (k % 16 == 0, base % 16 == 0, 16-byte aligned rows): the 16-byte chunk of elements
//   16c .. 16c + 15 has slot ((base / 16 + c) % 8) in its block; its 16 products are fmaf'd in
//   element order from 0 into the chunk partial p, and the block's 8 slots are added pairwise at
//   offsets 4, 2, 1: ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)), a slot with no chunk of the
//   row being +0 (the first and last block of a row that does not fill them);
// - element path (any other shape): element e of the block (e = base + j - 128 b) goes to lane
//   e % 32, which fmaf's its elements in increasing e from 0; then warp_sum's butterfly (offsets
//   16, 8, 4, 2, 1).
// Nothing in that depends on how many weight rows or activation rows a warp takes at once: the
// reductions of several values share their shuffles by recursive halving, which adds each value's
// pairs exactly as the butterfly of that value alone adds them (a + b is b + a), so a row's bits
// are the same alone and in any batch.
//
// Lanes (vector path): the row's chunks are laid out as if preceded by base / 16 % 8 empty chunks
// (the virtual chunk v = c + that offset), and lane v % 32 takes virtual chunk v: the 8 lanes
// 8g .. 8g + 7 then hold the 8 slots of one block, and a warp's 16-byte loads stay one contiguous
// stretch of the row. After each group of 32 virtual chunks (four blocks) the lanes of each block
// reduce their partials, multiply by the block's scale, and lanes 0..7 add the four blocks to their
// accumulators in order (three shuffles down).
#pragma once
#include "common.cuh"

namespace {
constexpr uint32_t FP8_FULL_MASK = 0xFFFFFFFFu;

// Where the activation rows are read from: shared memory as BF16 or as f32 (staged by the caller;
// the same values), global memory through L2 (written by a kernel that may have released its
// dependents early, ptx/common.cuh), or global memory through the read-only path.
enum Fp8XSource : int { FP8_X_SMEM = 0, FP8_X_SMEM_F32 = 1, FP8_X_L2 = 2, FP8_X_RO = 3 };

// Where element j of an f32 staged row (FP8_X_SMEM_F32) lives: its float4s are permuted within
// each 16-element chunk, float4 q of chunk c at 4c + (q ^ ((c >> 1) & 3)). The vector path's lanes
// read float4 q of 32 consecutive chunks at once; in element order, lanes 64 bytes apart would hit
// 8 of the 32 banks (four times the shared-memory wavefronts of a conflict-free 16-byte load, which
// bounded the one-row FP8 launch near 8 weight bytes per clock and SM); permuted, any 8 consecutive
// chunks cover every bank. The writer (ptx/bgemv_fp8.cu rms_row_to_smem_f32) and every reader go
// through this map, so the values, and every product and sum, are those of the unpermuted row. A
// position stays inside its chunk: the row takes ceil(k / 16) * 16 floats.
__host__ __device__ constexpr uint32_t fp8_xf32_pos(uint32_t j) { return j ^ (((j >> 5) & 3u) << 2); }

// Elements e .. e + 3 of an activation row (e % 4 == 0; the row 16-byte aligned) as f32.
template <int XS>
__device__ __forceinline__ float4 fp8_x4(const void* row, uint32_t e) {
    if (XS == FP8_X_SMEM_F32) return *reinterpret_cast<const float4*>(static_cast<const float*>(row) + fp8_xf32_pos(e));
    const uint2* p = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(row) + e);
    const uint2 v = XS == FP8_X_L2 ? __ldcg(p) : XS == FP8_X_RO ? __ldg(p) : *p;
    return make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
}

template <int XS>
__device__ __forceinline__ float fp8_x1(const void* row, uint32_t j) {
    if (XS == FP8_X_SMEM_F32) return static_cast<const float*>(row)[fp8_xf32_pos(j)];
    const uint16_t* p = static_cast<const uint16_t*>(row) + j;
    return bf16_bits_to_f32(XS == FP8_X_L2 ? __ldcg(p) : XS == FP8_X_RO ? __ldg(p) : *p);
}

__device__ __forceinline__ uint32_t fp8_word(const uint4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

__host__ __device__ constexpr int fp8_halved(int c) { return c >= 2 ? c / 2 : 1; }

// One stage of a reduction over lanes O apart: C values become C / 2 (lanes with bit O set keep the
// upper half), or, for one value, the butterfly's own + partner.
template <int N, int C, int O>
__device__ __forceinline__ void fp8_halve(float (&v)[N], uint32_t lane) {
    if constexpr (C >= 2) {
        const bool upper = (lane & (uint32_t)O) != 0u;
#pragma unroll
        for (int j = 0; j < C / 2; ++j) {
            const float send = upper ? v[j] : v[j + C / 2];
            const float keep = upper ? v[j + C / 2] : v[j];
            v[j] = keep + __shfl_xor_sync(FP8_FULL_MASK, send, O);
        }
    } else {
        v[0] = v[0] + __shfl_xor_sync(FP8_FULL_MASK, v[0], O);
    }
}

// Totals of N values over each group of 8 lanes (offsets 4, 2, 1). Afterwards lane l holds in v[j]
// the total of value (l % 8) * N / 8 + j, for j < max(N / 8, 1); for N < 8 the lanes with
// (l % 8) * N % 8 == 0 hold value (l % 8) * N / 8 (the others hold copies).
template <int N>
__device__ __forceinline__ void fp8_sum8(float (&v)[N], uint32_t lane) {
    constexpr int C1 = fp8_halved(N), C2 = fp8_halved(C1);
    fp8_halve<N, N, 4>(v, lane);
    fp8_halve<N, C1, 2>(v, lane);
    fp8_halve<N, C2, 1>(v, lane);
}

// Over all 32 lanes (offsets 16 .. 1, warp_sum's order), N <= 32: lane l holds value l * N / 32 in
// v[0] (the lanes with l * N % 32 == 0; the others hold copies).
template <int N>
__device__ __forceinline__ void fp8_sum32(float (&v)[N], uint32_t lane) {
    static_assert(N <= 32, "fp8_sum32: at most one value per lane");
    constexpr int C1 = fp8_halved(N), C2 = fp8_halved(C1), C3 = fp8_halved(C2), C4 = fp8_halved(C3);
    fp8_halve<N, N, 16>(v, lane);
    fp8_halve<N, C1, 8>(v, lane);
    fp8_halve<N, C2, 4>(v, lane);
    fp8_halve<N, C3, 2>(v, lane);
    fp8_halve<N, C4, 1>(v, lane);
}

// Values per lane after fp8_sum8 over RS weight rows x M activation rows (value r * M + i).
template <int RS, int M>
__host__ __device__ constexpr int fp8_vec_outs() { return RS * M >= 8 ? RS * M / 8 : 1; }

// The row geometry of the vector path: virtual chunks [off, end) hold the row's chunks, blocks
// b0 .. b0 + nblk - 1 of the scale row.
struct Fp8RowGeom {
    uint32_t off;   // empty virtual chunks before the row's first chunk: (base / 16) % 8
    uint32_t end;   // off + k / 16
    uint32_t b0;    // the first block: base / 128
    uint32_t nblk;  // blocks the row touches
};

__device__ __forceinline__ Fp8RowGeom fp8_row_geom(uint32_t k, uint32_t base) {
    const uint32_t off = (base >> 4) & 7u, end = off + (k >> 4);
    return Fp8RowGeom{off, end, base >> 7, (end + 7u) >> 3};
}

// The weight row whose scale this lane applies in the vector path: value (l % 8) * N / 8 belongs to
// row (that) / M (every value of a lane belongs to one row: RS <= 8).
template <int RS, int M>
__device__ __forceinline__ uint32_t fp8_vec_lane_row(uint32_t lane) {
    return ((lane & 7u) * (uint32_t)(RS * M) / 8u) / (uint32_t)M;
}

// The 16-byte weight loads of virtual chunks vt + lane + 32u (u < U) of the RS rows, and in `sl` the
// scale of block vt / 8 + lane of this lane's row (srow: that row's scales, indexed by block): the
// step's 4U <= 32 blocks, one per lane, which the groups fetch by shuffle (one register instead of
// U). Loads past the row are zeros, never issued.
template <int RS, int U>
__device__ __forceinline__ void fp8_load_step(const uint8_t* const (&w)[RS], const float* srow, const Fp8RowGeom& g,
                                              uint32_t vt, bool active, uint4 (&wv)[RS][U], float& sl) {
    static_assert(U <= 8, "fp8_load_step: a step's blocks fit the warp's lanes");
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const uint32_t v = vt + 32u * u + lane;
        const bool in = active && v >= g.off && v < g.end;
#pragma unroll
        for (int r = 0; r < RS; ++r)
            wv[r][u] = in ? ld_stream16(w[r] + 16u * (v - g.off)) : make_uint4(0, 0, 0, 0);
    }
    const uint32_t blk = (vt >> 3) + lane;
    sl = active && lane < 4u * U && blk < g.nblk ? __ldg(srow + g.b0 + blk) : 0.0f;
}

// The vector path: RS weight rows w[r] (k FP8 values each, 16-byte aligned, k % 16 == 0) against M
// activation rows xr[i] (k values, BF16 or f32 by XS, 16-byte aligned), srow the scales of this lane's row
// (fp8_vec_lane_row). `wv` / `sl` hold the first step's loads when `preloaded` (issued before the
// caller's wait). acc[j] (lanes 0..7, fp8_sum8's layout over values r * M + i) accumulates the
// blocks in order; the caller zeroes it and stores it.
template <int RS, int M, int U, int XS>
__device__ __forceinline__ void fp8_rows_vec(const uint8_t* const (&w)[RS], const float* srow, const Fp8RowGeom& g,
                                             const void* const (&xr)[M], uint4 (&wv)[RS][U], float& sl,
                                             bool preloaded, float (&acc)[fp8_vec_outs<RS, M>()]) {
    constexpr int N = RS * M, OUTS = fp8_vec_outs<RS, M>();
    static_assert(RS <= 8 && M <= 8 && N <= 64, "fp8_rows_vec: one weight row per lane's values");
    const uint32_t lane = threadIdx.x & 31;
    for (uint32_t vt = 0; vt < g.end; vt += 32u * U) {
        if (!preloaded || vt > 0) fp8_load_step<RS, U>(w, srow, g, vt, true, wv, sl);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t g0 = vt + 32u * u;  // the group's first virtual chunk (the same in the warp)
            if (g0 < g.end) {
                float p[N];
#pragma unroll
                for (int j = 0; j < N; ++j) p[j] = 0.0f;
                const uint32_t v = g0 + lane;
                if (v >= g.off && v < g.end) {
                    const uint32_t e = 16u * (v - g.off);  // the chunk's first element
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        float f[RS][4];
#pragma unroll
                        for (int r = 0; r < RS; ++r) fp8x4_to_f32(fp8_word(wv[r][u], q), f[r]);
#pragma unroll
                        for (int i = 0; i < M; ++i) {
                            const float4 xq = fp8_x4<XS>(xr[i], e + 4u * q);
#pragma unroll
                            for (int r = 0; r < RS; ++r) {
                                float& a = p[r * M + i];
                                a = fmaf(f[r][0], xq.x, a);
                                a = fmaf(f[r][1], xq.y, a);
                                a = fmaf(f[r][2], xq.z, a);
                                a = fmaf(f[r][3], xq.w, a);
                            }
                        }
                    }
                }
                fp8_sum8<N>(p, lane);
                const float sc = __shfl_sync(FP8_FULL_MASK, sl, 4 * u + (int)(lane >> 3));
#pragma unroll
                for (int j = 0; j < OUTS; ++j) p[j] = __fmul_rn(p[j], sc);
                // Lanes 0..7 hold the group's first block; lanes 8 .. 31 the next three, in order.
                const uint32_t blk = g0 >> 3;
#pragma unroll
                for (int j = 0; j < OUTS; ++j) acc[j] = __fadd_rn(acc[j], p[j]);
#pragma unroll
                for (int b = 1; b < 4; ++b) {
                    if (blk + (uint32_t)b < g.nblk) {
#pragma unroll
                        for (int j = 0; j < OUTS; ++j)
                            acc[j] = __fadd_rn(acc[j], __shfl_down_sync(FP8_FULL_MASK, p[j], 8 * b));
                    }
                }
            }
        }
    }
}

// Two weight rows (A and B, each with its own scale row sa / sb) against one activation row, for
// rows of at most 4 x 32 chunks at base 0 (k <= 2048, g.off == 0): the rows' 4 groups each are one load
// step, wv[0][u] row A's group u and wv[0][4 + u] row B's, so a warp has both rows' bytes in flight
// at once (an FP8 row is half a BF16 row's bytes; one FP8 row per warp at a time kept half the
// bytes of the BF16 loop in flight). `sl`: lanes 0..15 hold row A's block scales, lanes 16..31
// row B's (at most 16 blocks a row).
__device__ __forceinline__ void fp8_pair_load(const uint8_t* wa, const uint8_t* wb, const float* sa, const float* sb,
                                              const Fp8RowGeom& g, bool active, uint4 (&wv)[1][8], float& sl) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const uint32_t v = 32u * u + lane;
        const bool in = active && v >= g.off && v < g.end;
        wv[0][u] = in ? ld_stream16(wa + 16u * (v - g.off)) : make_uint4(0, 0, 0, 0);
        wv[0][4 + u] = in ? ld_stream16(wb + 16u * (v - g.off)) : make_uint4(0, 0, 0, 0);
    }
    const uint32_t blk = lane & 15u;
    sl = active && blk < g.nblk ? __ldg((lane < 16u ? sa : sb) + g.b0 + blk) : 0.0f;
}

// fp8_rows_vec's arithmetic for the two rows of fp8_pair_load (which issued `wv` / `sl`), so each
// row's bits are those of the row alone: each chunk's 16 fmaf's from 0 (+0 for a chunk outside the
// row; such a lane reads x past the row, inside the 2048 elements that xr must hold, and discards
// the result: one address per q for all 8 loads, where clamping kept 16 live), each block's butterfly
// (fp8_sum8 over the lane's 8 partials at once: lane l ends with the total of row (l % 8) / 4's
// group l % 4, i.e. its block 4 * (l % 4) + l / 8), each block times its scale, and each row's
// blocks added from 0 in increasing b (block j of row r fetched from lane 8 * (j % 4) + 4 r + j / 4).
// The 8 dot products are straight-line code; the pair costs 7 + 1 + 2 x (blocks) shuffles. y on
// every lane.
template <int XS>
__device__ __forceinline__ void fp8_pair_vec(const Fp8RowGeom& g, const void* xr, const uint4 (&wv)[1][8], float sl,
                                             float& ya, float& yb) {
    const uint32_t lane = threadIdx.x & 31;
    float p[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint32_t v = 32u * (uint32_t)(i & 3) + lane;
        const bool in = v >= g.off && v < g.end;
        const uint32_t e = 16u * v;  // past the row: inside the 128 chunks the launch gave, discarded
        float a = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float f[4];
            fp8x4_to_f32(fp8_word(wv[0][i], q), f);
            const float4 xq = fp8_x4<XS>(xr, e + 4u * q);
            a = fmaf(f[0], xq.x, a);
            a = fmaf(f[1], xq.y, a);
            a = fmaf(f[2], xq.z, a);
            a = fmaf(f[3], xq.w, a);
        }
        p[i] = in ? a : 0.0f;
    }
    fp8_sum8<8>(p, lane);
    const uint32_t l8 = lane & 7u;
    const uint32_t src = 16u * (l8 >> 2) + 4u * (l8 & 3u) + (lane >> 3);  // this lane's block's scale
    const float t = __fmul_rn(p[0], __shfl_sync(FP8_FULL_MASK, sl, (int)src));
    float a = 0.0f, b = 0.0f;
#pragma unroll 4
    for (uint32_t j = 0; j < g.nblk; ++j) {
        const uint32_t at = 8u * (j & 3u) + (j >> 2);
        a = __fadd_rn(a, __shfl_sync(FP8_FULL_MASK, t, (int)at));
        b = __fadd_rn(b, __shfl_sync(FP8_FULL_MASK, t, (int)(at + 4u)));
    }
    ya = a;
    yb = b;
}

// The element path: the same rows for any k, base and alignment (xr[i] rows of k values, w[r]
// rows of k bytes, s[r] row r's scales indexed by block). Lane l returns in `acc` the total of value
// l * N / 32 (N = RS * M <= 32; the lanes with l * N % 32 == 0 own it).
template <int RS, int M, int XS>
__device__ __forceinline__ float fp8_rows_elem(const uint8_t* const (&w)[RS], const float* const (&s)[RS], uint32_t k,
                                               uint32_t base, const void* const (&xr)[M]) {
    constexpr int N = RS * M;
    static_assert(N <= 32, "fp8_rows_elem: at most one value per lane");
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t idx = lane * (uint32_t)N / 32u, my_r = idx / (uint32_t)M;
    const float* my_s = s[0];
#pragma unroll
    for (int r = 1; r < RS; ++r)
        if (my_r == (uint32_t)r) my_s = s[r];
    float acc = 0.0f;
    const uint32_t bl = base >> 7, bh = (base + k - 1u) >> 7;
    for (uint32_t b = bl; b <= bh; ++b) {
        float p[N];
#pragma unroll
        for (int j = 0; j < N; ++j) p[j] = 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint32_t col = 128u * b + lane + 32u * t;  // a column of the full matrix
            if (col >= base && col < base + k) {
                const uint32_t j = col - base;
                float f[RS];
#pragma unroll
                for (int r = 0; r < RS; ++r) f[r] = fp8_to_f32(w[r][j]);
#pragma unroll
                for (int i = 0; i < M; ++i) {
                    const float xv = fp8_x1<XS>(xr[i], j);
#pragma unroll
                    for (int r = 0; r < RS; ++r) p[r * M + i] = fmaf(f[r], xv, p[r * M + i]);
                }
            }
        }
        fp8_sum32<N>(p, lane);
        acc = __fadd_rn(acc, __fmul_rn(p[0], __ldg(my_s + b)));
    }
    return acc;
}
}  // namespace
