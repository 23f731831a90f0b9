// The drafter's BF16 projections over m rows of activations (model/kernels/bgemv.py): per-head GEMVs
// y[e][h] = W[h] @ x[e][h] (W[h] [n, k] BF16, x [k] BF16, f32 accumulation) and the ordered row sums
// that follow the o_proj head groups and the MoE slots.
//
// Per-head GEMV geometry of one row (model/kernels/bgemv.py rows_per_warp): ceil(n / (8 R)) blocks
// per head, block 256 = 8 warps, each warp owns R consecutive rows with R * U = 16 sixteen-byte loads per lane in
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

// W[b] (rows `tile` * 8 * ROWS ...) against the x row at element x_off into the y row at element
// y_off: the launch's own entry (b * k, b * n) or head b of one row e of the batch (e * x_stride +
// b * k, e * y_stride + b * n).
template <bool OUT_F32, int ROWS, int UNROLL, PdlMode MODE>
__device__ __forceinline__ void bgemv_body(const uint16_t* __restrict__ w, const uint16_t* __restrict__ x,
                                           void* __restrict__ y, bool active, uint32_t b, size_t x_off,
                                           size_t y_off, uint32_t tile, uint32_t n, uint32_t k) {
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (tile * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (!active || row0 >= n) {
        if (MODE == WAIT_FIRST) wait_then_release(); else grid_dependency_wait();
        return;
    }
    const uint16_t* wb = w + (size_t)b * n * k;
    const uint16_t* xb = x + x_off;
    const bool vec = (k % 8u == 0) && aligned16(w) && aligned16(xb);
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
            if (OUT_F32) reinterpret_cast<float*>(y)[y_off + row0 + r] = v;
            else reinterpret_cast<uint16_t*>(y)[y_off + row0 + r] = f32_to_bf16_bits(v);
        }
    }
    if (MODE == BESIDE) grid_dependency_wait();  // not complete before the kernel it ran beside
}

}  // namespace

namespace {
// Elements 4c .. 4c + 3 of sum_rows_residual_rmsnorm_batch's row: the part rows added in row order with
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

// A row's ordered sum (as sum_rows_residual_batch), then the next layer's RMSNorm of its BF16 result:
// normed = bf16((out / r) * w), r = sqrt(mean(out^2) + eps). One block of 1024 threads owns the
// whole row (the norm needs all of it). Each thread takes 4 consecutive elements and keeps 8 part
// rows' float4 loads in flight, so the launch waits a few L2 round trips instead of one per part
// row (BENCHMARKS.md, "Drafter kernel notes"). The adds stay in row order, so `out` is
// bit-identical to sum_rows_residual_batch's.
namespace {
// The kernel's body for one row (the batch runs it once per block, with that row's pointers).
__device__ __forceinline__ void sum_rows_residual_rmsnorm_row(
    const float* __restrict__ parts, const uint16_t* residual, const uint16_t* __restrict__ norm_w,
    uint16_t* out, uint16_t* __restrict__ normed, uint32_t rows, uint32_t n, float eps, float* scratch) {
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

}  // namespace

// ---- the batch: m rows of activations (1 <= m <= 256) against each weight matrix read once --------
//
// Every batched kernel below takes the rows of x in chunks of BATCH_ROWS: blockIdx.x is the chunk, so
// the blocks that stream one tile of weights are consecutive in launch order and all but the first
// find it in L2 (the weights come from HBM once per launch). A chunk of one row runs the
// one-row path (bgemv_body); a chunk of M rows applies each weight load to its M rows, with one
// accumulator per (row, weight row) summed in the same order as the one-row path sums it: lane l takes the
// 16-byte chunks l, l + 32, ... in that order (eight fmaf each, in element order), then the lanes are
// added in warp_sum's butterfly. How many weight loads are in flight and how many rows share them is
// chosen per M; that order never is. So row e of any batch is bit-identical to a launch of that row
// alone (m = 1), and no row depends on another.
namespace {
constexpr uint32_t BATCH_ROWS = 8;  // model/kernels/bgemv.py BATCH_ROWS

// The 32 per-lane partial sums v[0..31] of a warp reduced so that lane j returns the total of v[j]:
// warp_sum's butterfly as a recursive halving. At offset o a lane keeps the half of its values whose
// index bit o equals its own lane bit o and adds the partner's copy of that half (own + partner, as
// warp_sum adds), so every total is built from the same pairs in the same order as warp_sum builds
// it in every lane: the same bits, with 31 shuffles for 32 totals instead of 160.
// One stage per offset as its own template, so that every index is a constant (a loop over the
// offsets was left rolled and put v in local memory).
template <int O>
__device__ __forceinline__ void scatter_stage(float (&v)[32], uint32_t lane) {
    const bool upper = (lane & (uint32_t)O) != 0u;
#pragma unroll
    for (int j = 0; j < O; ++j) {
        const float send = upper ? v[j] : v[j + O];
        const float keep = upper ? v[j + O] : v[j];
        v[j] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, O);
    }
}

__device__ __forceinline__ float warp_sum_scatter32(float (&v)[32]) {
    const uint32_t lane = threadIdx.x & 31;
    scatter_stage<16>(v, lane);
    scatter_stage<8>(v, lane);
    scatter_stage<4>(v, lane);
    scatter_stage<2>(v, lane);
    scatter_stage<1>(v, lane);
    return v[0];
}

// The 8 BF16 values of a 16-byte chunk as floats, in element order (dot8_bf16's).
__device__ __forceinline__ void unpack8_bf16(uint4 v, float (&f)[8]) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
    f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z);
    f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// warp_gemv_bf16 for M rows of x against RS rows of W, after the wait: acc[i][r] is W[r] . x_i summed
// exactly as warp_gemv_bf16 sums it for one row. Row i of x at x + min(i, rows - 1) * x_row (a chunk
// shorter than the template repeats its last row; the caller drops those totals), in shared memory
// (X_SMEM, staged by the caller) or global memory (through L2 when X_L2). Vector path: `wv` holds
// the first weight batch when `preloaded` (issued before the wait).
template <int RS, int U, int M, bool X_SMEM, bool X_L2>
__device__ __forceinline__ void warp_gemv_bf16_rows(const uint16_t* const (&w)[RS], const uint16_t* x, size_t x_row,
                                                    uint32_t rows, uint32_t k, bool vec, uint4 (&wv)[RS][U],
                                                    bool preloaded, float (&acc)[M][RS]) {
    const uint32_t lane = threadIdx.x & 31;
    const uint16_t* xr[M];
#pragma unroll
    for (int i = 0; i < M; ++i) xr[i] = x + (size_t)min((uint32_t)i, rows - 1u) * x_row;
    if (vec) {
        const uint32_t kc = k >> 3;
        for (uint32_t c0 = 0; c0 < kc; c0 += 32u * U) {
            if (!preloaded || c0 > 0) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const uint32_t c = c0 + lane + 32u * u;
#pragma unroll
                    for (int r = 0; r < RS; ++r)
                        wv[r][u] = c < kc ? ld_stream16(reinterpret_cast<const uint4*>(w[r]) + c) : make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t c = c0 + lane + 32u * u;
                if (c < kc) {
                    // Each weight chunk widened once for the M rows (dot8_bf16 per row would widen it M
                    // times: the compiler does not share it across the rows' blocks); the products are
                    // added in dot8_bf16's element order.
                    float wf[RS][8];
#pragma unroll
                    for (int r = 0; r < RS; ++r) unpack8_bf16(wv[r][u], wf[r]);
#pragma unroll
                    for (int i = 0; i < M; ++i) {
                        const uint4* xc = reinterpret_cast<const uint4*>(xr[i]) + c;
                        float xf[8];
                        unpack8_bf16(X_SMEM ? *xc : ld_x16<X_L2>(xc), xf);
#pragma unroll
                        for (int r = 0; r < RS; ++r)
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc[i][r] = fmaf(wf[r][e], xf[e], acc[i][r]);
                    }
                }
            }
        }
    } else {
        for (uint32_t j = lane; j < k; j += 32u) {
            float wj[RS];
#pragma unroll
            for (int r = 0; r < RS; ++r) wj[r] = bf16_bits_to_f32(w[r][j]);
#pragma unroll
            for (int i = 0; i < M; ++i) {
                const float xf = bf16_bits_to_f32(X_L2 ? __ldcg(xr[i] + j) : xr[i][j]);
#pragma unroll
                for (int r = 0; r < RS; ++r) acc[i][r] = fmaf(wj[r], xf, acc[i][r]);
            }
        }
    }
}

// The `rows` (<= M) rows of the chunk at e0 against the warp's `rpw` rows of W[b] (rows_per_warp(k),
// the tile of the m = 1 path, so the grid is the same for every m), taken RS = 4 at a time so that
// the M * 4 accumulators and the weight loads in flight stay within the register count of the m = 1
// path (the kernel's count is the maximum over its paths). The first weight batch is issued, then
// the wait (WAIT_FIRST, releasing), then the block stages the chunk's x rows in shared memory once
// (`xsm`, [M][k], when the launch gave it M * k * 2 bytes): read per warp, as bgemv_body reads its
// one row, they would cost the L2 eight times the x bytes, twice the weight bytes at o_proj's
// shape. Each total lands in its own lane (warp_sum_scatter32), which stores it.
template <bool OUT_F32, int M, PdlMode MODE>
__device__ __forceinline__ void bgemv_rows_body(const uint16_t* __restrict__ w, const uint16_t* __restrict__ x,
                                                void* __restrict__ y, uint32_t x_stride, uint32_t y_stride,
                                                uint32_t n, uint32_t k, uint32_t e0, uint32_t rows, uint32_t b,
                                                uint32_t tile, uint32_t rpw, uint16_t* xsm) {
    constexpr int RS = 4, U = 2;
    constexpr bool X_L2 = MODE == WAIT_FIRST;
    static_assert(M * RS <= 32, "bgemv_rows_body: 32 totals per warp at most");
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (tile * WARPS + (threadIdx.x >> 5)) * rpw;
    const bool has_rows = row0 < n;  // the same in the whole warp
    const uint16_t* wb = w + (size_t)b * n * k;
    const size_t x_row = x_stride;
    const uint16_t* xb = x + (size_t)e0 * x_stride + (size_t)b * k;
    const bool vec = (k % 8u == 0) && (x_stride % 8u == 0) && aligned16(w) && aligned16(xb);
    const uint32_t kc = k >> 3;
    const bool staged = vec && (uint32_t)M * k * 2u <= dynamic_smem_bytes();  // the same in the whole block
    const uint16_t* wr[RS];
#pragma unroll
    for (int r = 0; r < RS; ++r) wr[r] = wb + (size_t)min(row0 + r, n - 1) * k;
    uint4 wv[RS][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const uint32_t c = lane + 32u * u;
#pragma unroll
        for (int r = 0; r < RS; ++r)
            wv[r][u] = (vec && has_rows && c < kc) ? ld_stream16(reinterpret_cast<const uint4*>(wr[r]) + c)
                                                   : make_uint4(0, 0, 0, 0);
    }
    if (MODE == WAIT_FIRST) wait_then_release();
    if (staged) {
        const uint4* xv = reinterpret_cast<const uint4*>(xb);
        uint4* sv = reinterpret_cast<uint4*>(xsm);
        for (uint32_t t = threadIdx.x; t < (uint32_t)M * kc; t += blockDim.x) {
            const uint32_t i = t / kc, c = t - i * kc;
            sv[t] = i < rows ? ld_x16<X_L2>(xv + i * (x_row >> 3) + c) : make_uint4(0, 0, 0, 0);
        }
        __syncthreads();
    }
    if (has_rows) {
#pragma unroll 1
        for (uint32_t r0 = row0; r0 < min(row0 + rpw, n); r0 += RS) {
            if (r0 != row0) {
#pragma unroll
                for (int r = 0; r < RS; ++r) wr[r] = wb + (size_t)min(r0 + r, n - 1) * k;
            }
            float acc[M][RS];
#pragma unroll
            for (int i = 0; i < M; ++i)
#pragma unroll
                for (int r = 0; r < RS; ++r) acc[i][r] = 0.0f;
            if (staged) warp_gemv_bf16_rows<RS, U, M, true, false>(wr, xsm, k, rows, k, vec, wv, r0 == row0, acc);
            else warp_gemv_bf16_rows<RS, U, M, false, X_L2>(wr, xb, x_row, rows, k, vec, wv, r0 == row0, acc);
            float v[32];
#pragma unroll
            for (int j = 0; j < 32; ++j) v[j] = 0.0f;
#pragma unroll
            for (int i = 0; i < M; ++i)
#pragma unroll
                for (int r = 0; r < RS; ++r) v[i * RS + r] = acc[i][r];
            const float total = warp_sum_scatter32(v);
            const uint32_t i = lane / RS, r = lane % RS;
            if (i < rows && r0 + r < n) {
                const size_t at = (size_t)(e0 + i) * y_stride + (size_t)b * n + r0 + r;
                if (OUT_F32) reinterpret_cast<float*>(y)[at] = total;
                else reinterpret_cast<uint16_t*>(y)[at] = f32_to_bf16_bits(total);
            }
        }
    }
    if (MODE == BESIDE) grid_dependency_wait();  // not complete before the kernel it ran beside
}

// One chunk of the batch: a single row runs bgemv_body (rows per warp by row length,
// model/kernels/bgemv.py rows_per_warp), 2..8 rows the M-row path of the next power
// of two over the same tile.
template <bool OUT_F32, PdlMode MODE>
__device__ __forceinline__ void bgemv_batch_dispatch(const uint16_t* w, const uint16_t* x, void* y, uint32_t m,
                                                     uint32_t x_stride, uint32_t y_stride, uint32_t n, uint32_t k,
                                                     uint16_t* xsm) {
    const uint32_t e0 = blockIdx.x * BATCH_ROWS, b = blockIdx.z, tile = blockIdx.y;
    const uint32_t rows = e0 < m ? min(m - e0, BATCH_ROWS) : 0u;
    if (rows <= 1u) {
        const bool active = rows == 1u;  // a chunk past m (the launch helper makes none) only waits
        const size_t x_off = active ? (size_t)e0 * x_stride + (size_t)b * k : 0u;
        const size_t y_off = active ? (size_t)e0 * y_stride + (size_t)b * n : 0u;
        if (k <= 256u) bgemv_body<OUT_F32, 16, 1, MODE>(w, x, y, active, b, x_off, y_off, tile, n, k);
        else if (k <= 512u) bgemv_body<OUT_F32, 8, 2, MODE>(w, x, y, active, b, x_off, y_off, tile, n, k);
        else bgemv_body<OUT_F32, 4, 4, MODE>(w, x, y, active, b, x_off, y_off, tile, n, k);
        return;
    }
    const uint32_t rpw = k <= 256u ? 16u : k <= 512u ? 8u : 4u;
    if (rows == 2u) bgemv_rows_body<OUT_F32, 2, MODE>(w, x, y, x_stride, y_stride, n, k, e0, rows, b, tile, rpw, xsm);
    else if (rows <= 4u) bgemv_rows_body<OUT_F32, 4, MODE>(w, x, y, x_stride, y_stride, n, k, e0, rows, b, tile, rpw, xsm);
    else bgemv_rows_body<OUT_F32, 8, MODE>(w, x, y, x_stride, y_stride, n, k, e0, rows, b, tile, rpw, xsm);
}
}  // namespace

// y[e][h] = W[h] @ x[e][h] for every row e < m and head h < heads (the grid's z): W [heads][n][k] BF16,
// row e's heads x[e] at x + e * x_stride ([heads][k] BF16, x_stride >= heads * k: the absorbed query
// reads the q heads out of a wider fused row), y[e] at y + e * y_stride ([heads][n]: a rank's o_proj
// groups land in its columns of the all-groups rows). Grid (ceil(m / 8), ceil(n / (8 rows_per_warp(k))), heads), block 256,
// dynamic smem M * k * 2 bytes for M the next power of two of min(m, 8) when m > 1 (none at m = 1:
// the one-row path and its residency), or none, where the chunks read x from global memory; PDL
// WAIT_FIRST (releasing after the wait, x through L2).
// __launch_bounds__(256, 2): the m = 1 path of bgemv_body needs 122 registers, and the M-row paths
// must not raise the count past two blocks per SM (the m = 1 path's residency).
extern "C" __global__ void __launch_bounds__(256, 2) bgemv_bf16_f32_batch(const uint16_t* __restrict__ w,
                                                                        const uint16_t* __restrict__ x,
                                                                        float* __restrict__ y, uint32_t m,
                                                                        uint32_t heads, uint32_t x_stride,
                                                                        uint32_t y_stride,
                                                                        uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) uint16_t xsm[];  // the chunk's x rows, [M][k] (bgemv_rows_body)
    bgemv_batch_dispatch<true, WAIT_FIRST>(w, x, y, m, x_stride, y_stride, n, k, xsm);
}

// bgemv_bf16_f32_batch beside the kernel launched before it (Pdl.BESIDE): wk_t's q_abs beside
// select_topk_pools_batch (the selection reads the indexer's scores; q_abs only the q projection,
// which completed before both).
extern "C" __global__ void __launch_bounds__(256, 2) bgemv_bf16_f32_batch_beside(const uint16_t* __restrict__ w,
                                                                               const uint16_t* __restrict__ x,
                                                                               float* __restrict__ y, uint32_t m,
                                                                               uint32_t heads, uint32_t x_stride,
                                                                               uint32_t y_stride, uint32_t n,
                                                                               uint32_t k) {
    extern __shared__ __align__(16) uint16_t xsm[];  // the chunk's x rows, [M][k] (bgemv_rows_body)
    bgemv_batch_dispatch<true, BESIDE>(w, x, y, m, x_stride, y_stride, n, k, xsm);
}

extern "C" __global__ void __launch_bounds__(256, 2) bgemv_bf16_bf16_batch(const uint16_t* __restrict__ w,
                                                                         const uint16_t* __restrict__ x,
                                                                         uint16_t* __restrict__ y, uint32_t m,
                                                                         uint32_t heads, uint32_t x_stride,
                                                                         uint32_t y_stride,
                                                                         uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) uint16_t xsm[];  // the chunk's x rows, [M][k] (bgemv_rows_body)
    bgemv_batch_dispatch<false, WAIT_FIRST>(w, x, y, m, x_stride, y_stride, n, k, xsm);
}

// out[e] = bf16(residual[e] + (((p0 + p1) + p2) + ...)) for each row e < m: parts [m][rows][n] f32,
// residual / out [m][n] BF16; f32 adds in part-row order, then the residual (the host twin's order
// exactly, so bit-identical to it). Grid (ceil(n / 256), m), block 256, one element per thread.
extern "C" __global__ void __launch_bounds__(256) sum_rows_residual_batch(const float* __restrict__ parts,
                                                                          const uint16_t* residual, uint16_t* out,
                                                                          uint32_t m, uint32_t rows, uint32_t n) {
    const uint32_t e = blockIdx.y;
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= m || i >= n || rows == 0) return;
    const float* p = parts + (size_t)e * rows * n;
    float acc = p[i];
    for (uint32_t r = 1; r < rows; ++r) acc = __fadd_rn(acc, p[(size_t)r * n + i]);
    out[(size_t)e * n + i] = f32_to_bf16_bits(__fadd_rn(bf16_bits_to_f32(residual[(size_t)e * n + i]), acc));
}

// sum_rows_residual_rmsnorm_batch_row for each row e < m, one block of 1024 threads per row (grid m): parts
// [m][rows][n] f32, residual / out / normed [m][n] BF16. The vector path's test sees row e's own
// pointers, which are aligned as row 0's whenever n % 4 == 0 (the only case it takes).
extern "C" __global__ void __launch_bounds__(1024) sum_rows_residual_rmsnorm_batch(
    const float* __restrict__ parts, const uint16_t* residual, const uint16_t* __restrict__ norm_w,
    uint16_t* out, uint16_t* __restrict__ normed, uint32_t m, uint32_t rows, uint32_t n, float eps) {
    __shared__ float scratch[32];
    const uint32_t e = blockIdx.x;
    if (e >= m) {
        wait_then_release();
        return;
    }
    const size_t row = (size_t)e * n;
    sum_rows_residual_rmsnorm_row(parts + row * rows, residual + row, norm_w, out + row, normed + row, rows, n, eps,
                                  scratch);
}
