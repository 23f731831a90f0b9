// The drafter's projections with FP8 block-scaled weights over m rows of activations
// (model/kernels/bgemv_fp8.py):
// - rmsnorm_gemv_seg_batch: y[e][col + r] = W_seg[r] . (rmsnorm(x_e) * norm_w) for up to four
//   weight segments in one launch, each BF16 or FP8 with 128 x 128 block scales (the fused input
//   projection [kv_a ; wk ; compress_gate ; q_a ; weights_proj] and the q projection [q_b ; wq_b],
//   whose parts differ in dtype on disk). A BF16 segment's row is the normed rows' f32 dot: each
//   lane's 16-byte chunks lane, lane + 32, ... in that order (dot8_bf16), then warp_sum, the same
//   order at every M, so its bits do not depend on m.
// - bgemv_fp8_{f32,bf16}_batch(_beside): the per-head GEMV of ptx/bgemv.cu bgemv_bf16_*_batch with
//   FP8 weights (o_proj's head groups), scales indexed by the columns of the full matrix.
// The FP8 arithmetic of one output, and why it is the same for every m: ptx/fp8_block.cuh.
#include "model_common.cuh"
#include "fp8_block.cuh"

namespace {
constexpr int WARPS = 8;
constexpr uint32_t BATCH_ROWS = 8;  // model/kernels/bgemv_fp8.py BATCH_ROWS (ptx/bgemv.cu's)

__device__ __forceinline__ uint32_t dynamic_smem_size() {
    uint32_t r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// ---- the norm prologue for M rows (each row bit for bit RmsNormToSmem alone) -----------------------

// Sums of M values over the block at once, each by block_sum's tree (warp_sum, then warp_sum of the
// warps' sums), so each is bit for bit what block_sum / block_sum2 give it alone. `scratch` holds
// 32 * M floats; ends with a barrier.
template <int M>
__device__ __forceinline__ void block_sum_rows(float (&v)[M], float* scratch) {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int i = 0; i < M; ++i) {
        const float s = warp_sum(v[i]);
        if (lane == 0) scratch[i * 32 + warp] = s;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < M; ++i) v[i] = warp_sum(lane < nwarps ? scratch[i * 32 + lane] : 0.0f);
    __syncthreads();
}

// RmsNormToSmem for the first `rows` (<= M, >= 2) rows at once: row i of x (at x + i * x_row)
// normalised into xs + i * n, each bit for bit what RmsNormToSmem gives it alone; rows rows..M-1 of
// xs are zeroed. Staged (every row 16-byte aligned): a thread stages its chunks c = tid, tid +
// blockDim, ... of all rows with M loads in flight, summing each row's squares in that order
// (stage_row_sumsq's), then one block reduction for the M sums and scale_staged_row per row.
// Otherwise each row through rms_divisor and rms_apply, RmsNormToSmem's fallback. Ends with a
// barrier. `scratch` holds 32 * M floats.
template <int M>
__device__ __forceinline__ void rms_rows_to_smem(const uint16_t* __restrict__ x, size_t x_row, uint32_t rows,
                                                 const uint16_t* __restrict__ w, uint32_t n, float eps,
                                                 uint16_t* xs, float* scratch) {
    if ((n % 8u == 0) && aligned16(x) && (x_row % 8u == 0) && aligned16(w) && aligned16(xs)) {
        const uint32_t nc = n / 8u;
        float ss[M];
#pragma unroll
        for (int i = 0; i < M; ++i) ss[i] = 0.0f;
        for (uint32_t c = threadIdx.x; c < nc; c += blockDim.x) {
            uint4 v[M];
#pragma unroll
            for (int i = 0; i < M; ++i)
                v[i] = (uint32_t)i < rows ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)i * x_row) + c)
                                          : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int i = 0; i < M; ++i) {
                reinterpret_cast<uint4*>(xs + (size_t)i * n)[c] = v[i];
                ss[i] = sumsq8(v[i], ss[i]);
            }
        }
        block_sum_rows<M>(ss, scratch);
#pragma unroll
        for (int i = 0; i < M; ++i)
            if ((uint32_t)i < rows) scale_staged_row(xs + (size_t)i * n, w, n, sqrtf(ss[i] / (float)n + eps));
    } else {
#pragma unroll 1
        for (uint32_t i = 0; i < (uint32_t)M; ++i) {
            const uint16_t* xi = x + (size_t)i * x_row;
            if (i < rows) rms_apply(xi, w, xs + (size_t)i * n, n, rms_divisor(xi, n, eps, scratch));
            else
                for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) xs[(size_t)i * n + j] = 0;
        }
    }
    __syncthreads();
}

// Weight loads in flight per lane by rows per block: 8 at M = 1,
// fewer as more rows share each load, within the 64 registers of __launch_bounds__(256, 4).
template <int M>
__host__ __device__ constexpr int seg_gemv_unroll() { return M == 1 ? 8 : (M == 2 ? 4 : 2); }

// ---- the segments ------------------------------------------------------------------------------------

// Up to four weight segments, concatenated in argument order into the launch's rows (the grid
// strides over all of them). fp8_mask bit i: segment i is FP8 with block scales s_i, else BF16.
struct Segments {
    const void* w[4];
    const float* s[4];
    uint32_t rows[4], col[4], row0[4];
    uint32_t fp8_mask;
};

// One weight row of the launch: its segment's row pointer, its scale row (FP8) and output column.
struct SegRow {
    const uint8_t* w;  // the row's first byte
    const float* s;    // FP8: its block row of scales, [ceil(k / 128)]
    uint32_t col;      // its output column
    bool fp8;
};

// Row `row` (< the launch's rows) of the segments. A select chain over the four, not an indexed
// array (a dynamic index into the parameters would copy them to local memory).
__device__ __forceinline__ SegRow seg_row(const Segments& a, uint32_t row, uint32_t k) {
    const uint32_t e0 = a.rows[0], e1 = e0 + a.rows[1], e2 = e1 + a.rows[2];
    const uint32_t i = (uint32_t)(row >= e0) + (uint32_t)(row >= e1) + (uint32_t)(row >= e2);
    const uint32_t start = i == 0 ? 0u : i == 1 ? e0 : i == 2 ? e1 : e2;
    const void* w = i == 0 ? a.w[0] : i == 1 ? a.w[1] : i == 2 ? a.w[2] : a.w[3];
    const float* s = i == 0 ? a.s[0] : i == 1 ? a.s[1] : i == 2 ? a.s[2] : a.s[3];
    const uint32_t col = i == 0 ? a.col[0] : i == 1 ? a.col[1] : i == 2 ? a.col[2] : a.col[3];
    const uint32_t row0 = i == 0 ? a.row0[0] : i == 1 ? a.row0[1] : i == 2 ? a.row0[2] : a.row0[3];
    const bool fp8 = ((a.fp8_mask >> i) & 1u) != 0u;
    const uint32_t r = row - start;
    SegRow out;
    out.fp8 = fp8;
    out.col = col + r;
    out.w = reinterpret_cast<const uint8_t*>(w) + (size_t)r * k * (fp8 ? 1u : 2u);
    out.s = s + (size_t)((row0 + r) >> 7) * ((k + 127u) >> 7);
    return out;
}

__device__ __forceinline__ bool seg_vec(const SegRow& sr, uint32_t k) {
    return sr.fp8 ? (k % 16u == 0 && aligned16(sr.w)) : (k % 8u == 0 && aligned16(sr.w));
}

// Float4 j4 of an f32 staged row (elements 4 * j4 .. 4 * j4 + 3) at its place, fp8_xf32_pos's.
__device__ __forceinline__ uint32_t xf32_f4(uint32_t j4) { return fp8_xf32_pos(4u * j4) >> 2; }

// RmsNormToSmem into an f32 row: element j = float(bf16((x_j / r) * w_j)), the same bits widened,
// stored at xf[fp8_xf32_pos(j)] (ptx/fp8_block.cuh: ceil(n / 16) * 16 floats). Staged
// (16-byte aligned, n % 8 == 0): each thread copies its chunks c = tid, tid + blockDim, ... widened to
// their place in xf as they arrive (two loads in flight) and sums their squares in that order
// (stage_row_sumsq's); after the block reduction it rewrites its own chunks (scale_staged_row's
// arithmetic). Otherwise rms_divisor and rms_apply's formula. Ends with a barrier.
__device__ __forceinline__ void rms_row_to_smem_f32(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                                                    uint32_t n, float eps, float* xf, float* scratch) {
    if (n % 8u == 0 && aligned16(x) && aligned16(w) && aligned16(xf)) {
        const uint32_t nc = n / 8u;
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        float4* dv = reinterpret_cast<float4*>(xf);
        float ss = 0.0f, unused = 0.0f;
        for (uint32_t c0 = threadIdx.x; c0 < nc; c0 += 2u * blockDim.x) {
            const uint32_t c1 = c0 + blockDim.x;
            const uint4 v0 = __ldg(xv + c0);
            const uint4 v1 = c1 < nc ? __ldg(xv + c1) : make_uint4(0, 0, 0, 0);
            dv[xf32_f4(2u * c0)] = make_float4(bf16_lo(v0.x), bf16_hi(v0.x), bf16_lo(v0.y), bf16_hi(v0.y));
            dv[xf32_f4(2u * c0 + 1u)] = make_float4(bf16_lo(v0.z), bf16_hi(v0.z), bf16_lo(v0.w), bf16_hi(v0.w));
            ss = sumsq8(v0, ss);
            if (c1 < nc) {
                dv[xf32_f4(2u * c1)] = make_float4(bf16_lo(v1.x), bf16_hi(v1.x), bf16_lo(v1.y), bf16_hi(v1.y));
                dv[xf32_f4(2u * c1 + 1u)] = make_float4(bf16_lo(v1.z), bf16_hi(v1.z), bf16_lo(v1.w), bf16_hi(v1.w));
                ss = sumsq8(v1, ss);
            }
        }
        block_sum2(ss, unused, scratch);
        const float d = sqrtf(ss / (float)n + eps);
        const uint4* wv4 = reinterpret_cast<const uint4*>(w);
        for (uint32_t c = threadIdx.x; c < nc; c += blockDim.x) {
            const uint4 wc = __ldg(wv4 + c);
            const float wf[8] = {bf16_lo(wc.x), bf16_hi(wc.x), bf16_lo(wc.y), bf16_hi(wc.y),
                                 bf16_lo(wc.z), bf16_hi(wc.z), bf16_lo(wc.w), bf16_hi(wc.w)};
            const float4 a = dv[xf32_f4(2u * c)], b = dv[xf32_f4(2u * c + 1u)];
            float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int q = 0; q < 8; ++q) f[q] = bf16_bits_to_f32(f32_to_bf16_bits(__fmul_rn(f[q] / d, wf[q])));
            dv[xf32_f4(2u * c)] = make_float4(f[0], f[1], f[2], f[3]);
            dv[xf32_f4(2u * c + 1u)] = make_float4(f[4], f[5], f[6], f[7]);
        }
    } else {
        const float d = rms_divisor(x, n, eps, scratch);
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
            xf[fp8_xf32_pos(i)] = bf16_bits_to_f32(f32_to_bf16_bits(__fmul_rn(bf16_bits_to_f32(x[i]) / d, bf16_bits_to_f32(w[i]))));
    }
    __syncthreads();
}

// dot8_bf16 with the 8 x values already f32 (xa: elements 0..3, xb: 4..7): the same products in
// the same order, so the same bits.
__device__ __forceinline__ float dot8_bf16_f32(uint4 w, float4 xa, float4 xb, float acc) {
    acc = fmaf(bf16_lo(w.x), xa.x, acc);
    acc = fmaf(bf16_hi(w.x), xa.y, acc);
    acc = fmaf(bf16_lo(w.y), xa.z, acc);
    acc = fmaf(bf16_hi(w.y), xa.w, acc);
    acc = fmaf(bf16_lo(w.z), xb.x, acc);
    acc = fmaf(bf16_hi(w.z), xb.y, acc);
    acc = fmaf(bf16_lo(w.w), xb.z, acc);
    acc = fmaf(bf16_hi(w.w), xb.w, acc);
    return acc;
}

// Whether rows `row` (ra) and row + warps (rb) of a one-row chunk run as a pair (fp8_pair_load /
// fp8_pair_vec): both exist, both FP8 in 16-byte chunks, and a row is one step of 4 load groups
// (k <= 2048: the q projection's k = 1536; fused_in's k = 4096 has at most one row per warp).
// `room`: the staged row has the 2048 floats fp8_pair_vec may read (rmsnorm_gemv_seg_batch_smem).
__device__ __forceinline__ bool seg_pair(const SegRow& ra, const SegRow& rb, uint32_t row, uint32_t warps,
                                         uint32_t n, uint32_t k, bool room) {
    return room && row + warps < n && ra.fp8 && rb.fp8 && seg_vec(ra, k) && seg_vec(rb, k) && (k >> 4) <= 128u;
}

// Whether a chunk of M rows stages its normalised rows as f32 (else BF16): the one-row chunk of a
// launch with FP8 segments, where the FP8 dot's per-element BF16 unpacking would be a quarter of its
// instructions (model/kernels/bgemv_fp8.py rmsnorm_gemv_seg_batch_smem gives it k * 4 bytes). Eight
// rows as f32 would double the shared-memory reads per weight byte, which bound that path already.
template <int M, bool HAS_FP8>
__host__ __device__ constexpr bool seg_x_f32() { return HAS_FP8 && M == 1; }

// The GEMV of normalised rows for the `rows` (<= M) rows of the chunk at e0, over the segments'
// rows: each warp has its first row's first U loads in flight before the wait and the prologue,
// which normalises the chunk into xs [M][k] (BF16, or f32 where seg_x_f32); then it strides over
// the launch's rows, one at a time, and applies every chunk to the M rows. A BF16 row takes the
// BF16 rows' per-lane chunk order (chunks lane, lane + 32, ... by dot8_bf16 into one accumulator per
// x row; warp_sum), whatever the staging; an FP8 row is fp8_rows_vec (or
// fp8_rows_elem where k % 16 != 0 or the segment is not 16-byte aligned) with one weight row. A
// one-row chunk with FP8 segments takes rows row and row + warps together where seg_pair allows
// (fp8_pair_vec: the same bits as each row alone), so a warp keeps two FP8 rows' bytes in flight.
template <int M, bool BESIDE, bool HAS_FP8>
__device__ __forceinline__ void seg_gemv_rows(const Segments& a, const uint16_t* __restrict__ x, uint32_t x_stride,
                                              const uint16_t* __restrict__ norm_w, uint16_t* __restrict__ y,
                                              uint32_t y_stride, uint32_t n, uint32_t k, float eps, uint32_t e0,
                                              uint32_t rows, uint16_t* xs, float* scratch) {
    constexpr int U = seg_gemv_unroll<M>();
    constexpr bool XF = seg_x_f32<M, HAS_FP8>();
    constexpr bool PAIRS = M == 1 && HAS_FP8;
    static_assert(!PAIRS || (XF && U == 8), "seg_gemv_rows: a pair is one step of 8 loads, x staged as f32");
    const bool room = PAIRS && dynamic_smem_size() >= 2048u * 4u;  // the same in the block
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t warps = gridDim.y * (blockDim.x >> 5);
    uint32_t row = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const Fp8RowGeom g = fp8_row_geom(k, 0u);
    float* xsf = reinterpret_cast<float*>(xs);
    uint4 wv[1][U];
    float sl;
    {
        // The first row's segment again after the prologue (a few selects on the parameters), so
        // that only `row` stays live through the prologue (fewer registers held across it).
        const SegRow sr = seg_row(a, row < n ? row : 0u, k);
        const bool live = row < n && seg_vec(sr, k);
        bool paired = false;
        if constexpr (PAIRS) {
            const SegRow sb = seg_row(a, row + warps < n ? row + warps : 0u, k);
            paired = seg_pair(sr, sb, row, warps, n, k, room);
            if (paired) fp8_pair_load(sr.w, sb.w, sr.s, sb.s, g, true, wv, sl);
        }
        if (paired) {
        } else if (HAS_FP8 && sr.fp8) {
            const uint8_t* w1[1] = {sr.w};
            fp8_load_step<1, U>(w1, sr.s, g, 0u, live, wv, sl);
        } else {
            const uint32_t kc = k >> 3;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t c = lane + 32u * u;
                wv[0][u] = (live && c < kc) ? ld_stream16(reinterpret_cast<const uint4*>(sr.w) + c)
                                            : make_uint4(0, 0, 0, 0);
            }
        }
    }
    if (!BESIDE) grid_dependency_wait();  // the prologue reads activations (a no-op unless launched with PDL)
    const uint16_t* xr = x + (size_t)e0 * x_stride;
    if (XF) rms_row_to_smem_f32(xr, norm_w, k, eps, xsf, scratch);
    else if (M == 1) RmsNormToSmem{xr, norm_w, k, eps, scratch}(xs);
    else rms_rows_to_smem<M>(xr, x_stride, rows, norm_w, k, eps, xs, scratch);
    for (bool first = true; row < n; row += warps, first = false) {
        const SegRow sr = seg_row(a, row, k);
        if constexpr (PAIRS) {
            const uint32_t rb = row + warps;
            const SegRow sb = seg_row(a, rb < n ? rb : 0u, k);
            if (seg_pair(sr, sb, row, warps, n, k, room)) {
                if (!first) fp8_pair_load(sr.w, sb.w, sr.s, sb.s, g, true, wv, sl);
                float ya, yb;
                fp8_pair_vec<FP8_X_SMEM_F32>(g, xsf, wv, sl, ya, yb);
                if (lane == 0u) {
                    y[(size_t)e0 * y_stride + sr.col] = f32_to_bf16_bits(ya);
                    y[(size_t)e0 * y_stride + sb.col] = f32_to_bf16_bits(yb);
                }
                row = rb;  // and the loop's step: the pair took rows row and row + warps
                continue;
            }
        }
        const bool vec = seg_vec(sr, k);
        uint16_t* yr = y + (size_t)e0 * y_stride + sr.col;
        if (HAS_FP8 && sr.fp8) {
            constexpr int XS = XF ? FP8_X_SMEM_F32 : FP8_X_SMEM;
            const uint8_t* w1[1] = {sr.w};
            const void* xrow[M];
#pragma unroll
            for (int i = 0; i < M; ++i) xrow[i] = XF ? (const void*)(xsf + (size_t)i * k) : (const void*)(xs + (size_t)i * k);
            if (vec) {
                float acc[fp8_vec_outs<1, M>()];
#pragma unroll
                for (int j = 0; j < fp8_vec_outs<1, M>(); ++j) acc[j] = 0.0f;
                fp8_rows_vec<1, M, U, XS>(w1, sr.s, g, xrow, wv, sl, first, acc);
                // Lane l < 8 holds row (l * M / 8) (fp8_sum8 with N = M <= 8: one value per lane).
                const uint32_t i = lane * (uint32_t)M / 8u;
                if (lane < 8u && (lane * (uint32_t)M) % 8u == 0u && i < rows)
                    yr[(size_t)i * y_stride] = f32_to_bf16_bits(acc[0]);
            } else {
                const float* s1[1] = {sr.s};
                const float v = fp8_rows_elem<1, M, XS>(w1, s1, k, 0u, xrow);
                const uint32_t i = lane * (uint32_t)M / 32u;
                if ((lane * (uint32_t)M) % 32u == 0u && i < rows) yr[(size_t)i * y_stride] = f32_to_bf16_bits(v);
            }
            continue;
        }
        const uint16_t* wr = reinterpret_cast<const uint16_t*>(sr.w);
        const uint32_t kc = k >> 3;
        float acc[M];
#pragma unroll
        for (int i = 0; i < M; ++i) acc[i] = 0.0f;
        if (vec) {
            for (uint32_t c0 = 0; c0 < kc; c0 += 32u * U) {
                if (!first || c0 > 0) {
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const uint32_t c = c0 + lane + 32u * u;
                        wv[0][u] = c < kc ? ld_stream16(reinterpret_cast<const uint4*>(wr) + c) : make_uint4(0, 0, 0, 0);
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const uint32_t c = c0 + lane + 32u * u;
                    if (c < kc) {
#pragma unroll
                        for (int i = 0; i < M; ++i) {
                            if (XF) {
                                const float4* xc = reinterpret_cast<const float4*>(xsf + (size_t)i * k);
                                acc[i] = dot8_bf16_f32(wv[0][u], xc[xf32_f4(2u * c)], xc[xf32_f4(2u * c + 1u)], acc[i]);
                            } else {
                                acc[i] = dot8_bf16(wv[0][u], reinterpret_cast<const uint4*>(xs + (size_t)i * k)[c], acc[i]);
                            }
                        }
                    }
                }
            }
        } else {
            for (uint32_t j = lane; j < k; j += 32u) {
                const float wj = bf16_bits_to_f32(wr[j]);
#pragma unroll
                for (int i = 0; i < M; ++i) {
                    const float xj = XF ? xsf[(size_t)i * k + fp8_xf32_pos(j)] : bf16_bits_to_f32(xs[(size_t)i * k + j]);
                    acc[i] = fmaf(wj, xj, acc[i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < M; ++i) {
            const float v = warp_sum(acc[i]);
            if (lane == (uint32_t)i && (uint32_t)i < rows) yr[(size_t)i * y_stride] = f32_to_bf16_bits(v);
        }
    }
    if (BESIDE) grid_dependency_wait();  // not complete before the kernel it ran beside
}

template <bool BESIDE, bool HAS_FP8>
__device__ __forceinline__ void seg_gemv_batch(const Segments& a, const uint16_t* x, uint32_t x_stride,
                                               const uint16_t* norm_w, uint16_t* y, uint32_t y_stride, uint32_t m,
                                               uint32_t n, uint32_t k, float eps, uint16_t* xs, float* scratch) {
    const uint32_t e0 = blockIdx.x * BATCH_ROWS;
    const uint32_t rows = e0 < m ? min(m - e0, BATCH_ROWS) : 0u;
    // One row runs the M = 1 path; 2..8 rows the M-row path of the next power of two.
    if (rows == 1u) seg_gemv_rows<1, BESIDE, HAS_FP8>(a, x, x_stride, norm_w, y, y_stride, n, k, eps, e0, rows, xs, scratch);
    else if (rows == 2u) seg_gemv_rows<2, BESIDE, HAS_FP8>(a, x, x_stride, norm_w, y, y_stride, n, k, eps, e0, rows, xs, scratch);
    else if (rows > 2u && rows <= 4u)
        seg_gemv_rows<4, BESIDE, HAS_FP8>(a, x, x_stride, norm_w, y, y_stride, n, k, eps, e0, rows, xs, scratch);
    else if (rows > 4u) seg_gemv_rows<8, BESIDE, HAS_FP8>(a, x, x_stride, norm_w, y, y_stride, n, k, eps, e0, rows, xs, scratch);
    else grid_dependency_wait();  // a chunk past m (the launch helper makes none)
}
}  // namespace

#define SEG_PARAMS                                                                                            \
    const uint16_t *__restrict__ x, uint32_t x_stride, const uint16_t *__restrict__ norm_w,                  \
        uint16_t *__restrict__ y, uint32_t y_stride, uint32_t m, uint32_t n, uint32_t k, float eps,           \
        uint32_t fp8_mask, const void *w0, const float *s0, uint32_t rows0, uint32_t col0, uint32_t row0_0,   \
        const void *w1, const float *s1, uint32_t rows1, uint32_t col1, uint32_t row0_1, const void *w2,      \
        const float *s2, uint32_t rows2, uint32_t col2, uint32_t row0_2, const void *w3, const float *s3,     \
        uint32_t rows3, uint32_t col3, uint32_t row0_3
#define SEG_STRUCT                                                                                            \
    Segments{{w0, w1, w2, w3},           {s0, s1, s2, s3},         {rows0, rows1, rows2, rows3},              \
             {col0, col1, col2, col3},   {row0_0, row0_1, row0_2, row0_3}, fp8_mask}

// y[e][col_i + r] = W_i[r] . (rmsnorm(x_e) * norm_w) for each row e < m and each row r < rows_i of
// segment i (i < 4; an unused segment has rows 0): x_e at x + e * x_stride, y row e at
// y + e * y_stride (elements, BF16); n = the segments' rows together. Segment i is FP8 (k bytes a
// row) with block scales s_i [ceil(total rows / 128)][ceil(k / 128)], its row r being row
// row0_i + r of that tensor, when bit i of fp8_mask is set, else BF16 (k elements a row; s_i unread).
// Grid (ceil(m / 8), the blocks resident at once), block 256, dynamic smem M * k * 2 bytes (M the
// next power of two of min(m, 8)); Pdl.WAIT (it releases at exit). The norm is every block's
// prologue. The _bf16 kernels are the same for launches whose segments are all BF16 (fp8_mask 0):
// without the FP8 path the compiler gives the BF16 loop the registers it needs (with the FP8 path
// at M = 1, 8 loads in flight, it spills a few words at its stores).
extern "C" __global__ void __launch_bounds__(256, 4) rmsnorm_gemv_seg_batch(SEG_PARAMS) {
    extern __shared__ __align__(16) uint16_t xs[];
    __shared__ float scratch[32 * BATCH_ROWS];
    seg_gemv_batch<false, true>(SEG_STRUCT, x, x_stride, norm_w, y, y_stride, m, n, k, eps, xs, scratch);
}

// rmsnorm_gemv_seg_batch beside the kernel launched before it (Pdl.BESIDE): the q projection
// beside dsa_cache_write_batch, both reading the fused_in projection that completed before them.
extern "C" __global__ void __launch_bounds__(256, 4) rmsnorm_gemv_seg_batch_beside(SEG_PARAMS) {
    extern __shared__ __align__(16) uint16_t xs[];
    __shared__ float scratch[32 * BATCH_ROWS];
    seg_gemv_batch<true, true>(SEG_STRUCT, x, x_stride, norm_w, y, y_stride, m, n, k, eps, xs, scratch);
}

extern "C" __global__ void __launch_bounds__(256, 4) rmsnorm_gemv_seg_bf16_batch(SEG_PARAMS) {
    extern __shared__ __align__(16) uint16_t xs[];
    __shared__ float scratch[32 * BATCH_ROWS];
    seg_gemv_batch<false, false>(SEG_STRUCT, x, x_stride, norm_w, y, y_stride, m, n, k, eps, xs, scratch);
}

extern "C" __global__ void __launch_bounds__(256, 4) rmsnorm_gemv_seg_bf16_batch_beside(SEG_PARAMS) {
    extern __shared__ __align__(16) uint16_t xs[];
    __shared__ float scratch[32 * BATCH_ROWS];
    seg_gemv_batch<true, false>(SEG_STRUCT, x, x_stride, norm_w, y, y_stride, m, n, k, eps, xs, scratch);
}

// ---- bgemv_fp8: per-head FP8 GEMVs -------------------------------------------------------------------

namespace {
// PDL modes (ptx/bgemv.cu's). WAIT_FIRST: the first weight batch is in flight before the wait,
// every thread releases the kernel's dependents right after its wait, and x is read through L2 (its
// writer releases early too). BESIDE: x comes from the kernel before the previous one, so the whole
// GEMV runs without waiting and the wait comes last.
enum PdlMode { WAIT_FIRST, BESIDE };

constexpr uint32_t FP8_ROWS_PER_WARP = 4;  // model/kernels/bgemv_fp8.py ROWS_PER_WARP

// Weight rows a warp applies each load batch to: 4, and 2 for 8 rows of x, whose 8 x 4 partial
// sums and their reduction spilled at 128 registers.
template <int M>
__host__ __device__ constexpr int fp8_rs() { return M == 8 ? 2 : 4; }

// The chunk's `rows` (<= M) rows of x against the warp's FP8_ROWS_PER_WARP rows of W[b]: the first
// weight batch (4 rows x U 16-byte loads per lane: the whole row at o_proj's k = 2048 when M = 1)
// and its scales issued, then the wait (WAIT_FIRST, releasing), then the block stages the chunk's x
// rows in shared memory once when the launch gave it M * k * 2 bytes, else the rows are read from
// global memory. Staged at M = 1 too: read per warp, each lane's 8-byte loads of its 32-byte piece
// of x fetch a whole L2 sector four times (ld.cg skips L1), per 4 weight rows, so the L2 would
// deliver twice the weight bytes in x and each of a row's chunk groups would wait on its own L2
// round trip after the weights arrived; staged, the block reads x once, in one round trip. Element
// (r, c) of head b has scale s[r / 128][(col0 + b * k + c) / 128] (s_cols a scale row).
template <bool OUT_F32, int M, PdlMode MODE>
__device__ __forceinline__ void bgemv_fp8_body(const uint8_t* __restrict__ w, const float* __restrict__ s,
                                               uint32_t s_cols, uint32_t col0, const uint16_t* __restrict__ x,
                                               void* __restrict__ y, uint32_t x_stride, uint32_t y_stride,
                                               uint32_t n, uint32_t k, uint32_t e0, uint32_t rows, uint32_t b,
                                               uint32_t tile, bool active, uint16_t* xsm) {
    constexpr int RS = fp8_rs<M>(), U = M == 1 ? 4 : 2;
    constexpr int XG = MODE == WAIT_FIRST ? FP8_X_L2 : FP8_X_RO;
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (tile * WARPS + (threadIdx.x >> 5)) * FP8_ROWS_PER_WARP;
    const bool has_rows = active && row0 < n;  // the same in the whole warp
    const uint8_t* wb = w + (size_t)b * n * k;
    const uint32_t base = col0 + b * k;
    const uint16_t* xb = x + (size_t)e0 * x_stride + (size_t)b * k;
    const bool vec = (k % 16u == 0) && (base % 16u == 0) && (x_stride % 8u == 0) && aligned16(w) && aligned16(xb);
    const bool staged = active && vec && (uint32_t)M * k * 2u <= dynamic_smem_size();  // the same in the block
    const Fp8RowGeom g = fp8_row_geom(k, base);
    const uint8_t* wr[RS];
    const float* sr[RS];
    const uint32_t my_r = fp8_vec_lane_row<RS, M>(lane);
    const float* my_s = s;
    auto set_rows = [&](uint32_t r0) {
#pragma unroll
        for (int r = 0; r < RS; ++r) {
            const uint32_t rr = min(r0 + (uint32_t)r, n - 1u);
            wr[r] = wb + (size_t)rr * k;
            sr[r] = s + (size_t)(rr >> 7) * s_cols;
        }
        my_s = sr[0];
#pragma unroll
        for (int r = 1; r < RS; ++r)
            if (my_r == (uint32_t)r) my_s = sr[r];
    };
    set_rows(has_rows ? row0 : 0u);
    uint4 wv[RS][U];
    float sl;
    fp8_load_step<RS, U>(wr, my_s, g, 0u, has_rows && vec, wv, sl);
    if (MODE == WAIT_FIRST) wait_then_release();
    if (staged) {
        const uint32_t kc8 = k >> 3;
        const uint4* xv = reinterpret_cast<const uint4*>(xb);
        uint4* sv4 = reinterpret_cast<uint4*>(xsm);
        for (uint32_t t = threadIdx.x; t < (uint32_t)M * kc8; t += blockDim.x) {
            const uint32_t i = t / kc8, c = t - i * kc8;
            const uint4* p = xv + (size_t)i * (x_stride >> 3) + c;
            sv4[t] = i < rows ? (MODE == WAIT_FIRST ? __ldcg(p) : __ldg(p)) : make_uint4(0, 0, 0, 0);
        }
        __syncthreads();
    }
    if (has_rows) {
        // Two sets of row pointers, so that the staged path's loads compile to shared-memory loads
        // (a pointer that may be either is read with generic loads).
        const void* xs_rows[M];
        const void* xg_rows[M];
#pragma unroll
        for (int i = 0; i < M; ++i) {
            xs_rows[i] = xsm + (size_t)i * k;
            xg_rows[i] = xb + (size_t)min((uint32_t)i, rows - 1u) * x_stride;
        }
#pragma unroll 1
        for (uint32_t r0 = row0; r0 < min(row0 + FP8_ROWS_PER_WARP, n); r0 += RS) {
            if (r0 != row0) set_rows(r0);
            // Value r * M + i is weight row r0 + r against x row i; its owner lane stores it.
            if (vec) {
                constexpr int OUTS = fp8_vec_outs<RS, M>();
                float acc[OUTS];
#pragma unroll
                for (int j = 0; j < OUTS; ++j) acc[j] = 0.0f;
                if (staged) fp8_rows_vec<RS, M, U, FP8_X_SMEM>(wr, my_s, g, xs_rows, wv, sl, r0 == row0, acc);
                else fp8_rows_vec<RS, M, U, XG>(wr, my_s, g, xg_rows, wv, sl, r0 == row0, acc);
                const uint32_t l8 = lane & 7u;
                const bool owner = lane < 8u && (l8 * (uint32_t)(RS * M)) % 8u == 0u;
#pragma unroll
                for (int j = 0; j < OUTS; ++j) {
                    const uint32_t idx = l8 * (uint32_t)(RS * M) / 8u + (uint32_t)j;
                    const uint32_t r = idx / (uint32_t)M, i = idx % (uint32_t)M;
                    if (owner && i < rows && r0 + r < n) {
                        const size_t at = (size_t)(e0 + i) * y_stride + (size_t)b * n + r0 + r;
                        if (OUT_F32) reinterpret_cast<float*>(y)[at] = acc[j];
                        else reinterpret_cast<uint16_t*>(y)[at] = f32_to_bf16_bits(acc[j]);
                    }
                }
            } else {
                const float v = fp8_rows_elem<RS, M, XG>(wr, sr, k, base, xg_rows);
                const uint32_t idx = lane * (uint32_t)(RS * M) / 32u;
                const uint32_t r = idx / (uint32_t)M, i = idx % (uint32_t)M;
                if ((lane * (uint32_t)(RS * M)) % 32u == 0u && i < rows && r0 + r < n) {
                    const size_t at = (size_t)(e0 + i) * y_stride + (size_t)b * n + r0 + r;
                    if (OUT_F32) reinterpret_cast<float*>(y)[at] = v;
                    else reinterpret_cast<uint16_t*>(y)[at] = f32_to_bf16_bits(v);
                }
            }
        }
    }
    if (MODE == BESIDE) grid_dependency_wait();  // not complete before the kernel it ran beside
}

// One chunk of the batch: a single row runs the M = 1 path (x from global memory), 2..8 rows the
// path of the next power of two over the same tile; every path gives a row the same bits.
template <bool OUT_F32, PdlMode MODE>
__device__ __forceinline__ void bgemv_fp8_dispatch(const uint8_t* w, const float* s, uint32_t s_cols, uint32_t col0,
                                                   const uint16_t* x, void* y, uint32_t m, uint32_t x_stride,
                                                   uint32_t y_stride, uint32_t n, uint32_t k, uint16_t* xsm) {
    const uint32_t e0 = blockIdx.x * BATCH_ROWS, b = blockIdx.z, tile = blockIdx.y;
    const uint32_t rows = e0 < m ? min(m - e0, BATCH_ROWS) : 0u;
    // A chunk past m (the launch helper makes none) only waits.
    if (rows <= 1u)
        bgemv_fp8_body<OUT_F32, 1, MODE>(w, s, s_cols, col0, x, y, x_stride, y_stride, n, k, e0, 1u, b, tile,
                                         rows == 1u, xsm);
    else if (rows == 2u)
        bgemv_fp8_body<OUT_F32, 2, MODE>(w, s, s_cols, col0, x, y, x_stride, y_stride, n, k, e0, rows, b, tile, true, xsm);
    else if (rows <= 4u)
        bgemv_fp8_body<OUT_F32, 4, MODE>(w, s, s_cols, col0, x, y, x_stride, y_stride, n, k, e0, rows, b, tile, true, xsm);
    else
        bgemv_fp8_body<OUT_F32, 8, MODE>(w, s, s_cols, col0, x, y, x_stride, y_stride, n, k, e0, rows, b, tile, true, xsm);
}
}  // namespace

#define FP8_BGEMV_PARAMS(YT)                                                                                  \
    const uint8_t *__restrict__ w, const float *__restrict__ s, uint32_t s_cols, uint32_t col0,              \
        const uint16_t *__restrict__ x, YT *__restrict__ y, uint32_t m, uint32_t heads, uint32_t x_stride,    \
        uint32_t y_stride, uint32_t n, uint32_t k

// y[e][h] = W[h] @ x[e][h] for every row e < m and head h < heads (the grid's z): W [heads][n][k] FP8
// with block scales s [ceil(n / 128)][s_cols] of the full [n][s_cols * 128] matrix, head h's column
// c being its column col0 + h * k + c; row e's heads x[e] at x + e * x_stride ([heads][k] BF16), y[e]
// at y + e * y_stride ([heads][n]: a rank's o_proj groups land in its columns of the all-groups
// rows). Grid (ceil(m / 8), ceil(n / (8 * 4)), heads), block 256, dynamic smem M * k * 2 bytes for M
// the next power of two of min(m, 8), or none (the rows are then read from global memory; the
// same bits); PDL WAIT_FIRST (releasing after the wait, x through L2).
extern "C" __global__ void __launch_bounds__(256, 2) bgemv_fp8_f32_batch(FP8_BGEMV_PARAMS(float)) {
    extern __shared__ __align__(16) uint16_t xsm[];
    bgemv_fp8_dispatch<true, WAIT_FIRST>(w, s, s_cols, col0, x, y, m, x_stride, y_stride, n, k, xsm);
}

// bgemv_fp8_f32_batch beside the kernel launched before it (Pdl.BESIDE; x is older).
extern "C" __global__ void __launch_bounds__(256, 2) bgemv_fp8_f32_batch_beside(FP8_BGEMV_PARAMS(float)) {
    extern __shared__ __align__(16) uint16_t xsm[];
    bgemv_fp8_dispatch<true, BESIDE>(w, s, s_cols, col0, x, y, m, x_stride, y_stride, n, k, xsm);
}

extern "C" __global__ void __launch_bounds__(256, 2) bgemv_fp8_bf16_batch(FP8_BGEMV_PARAMS(uint16_t)) {
    extern __shared__ __align__(16) uint16_t xsm[];
    bgemv_fp8_dispatch<false, WAIT_FIRST>(w, s, s_cols, col0, x, y, m, x_stride, y_stride, n, k, xsm);
}
