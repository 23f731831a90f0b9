// The MTP block's input half-rows of a batch's entries: [rmsnorm(table[token]) * enorm ;
// rmsnorm(hidden) * hnorm] (mtp_embed_norm_batch), and eh_proj applied to them (mtp_input_gemv_batch)
// (model/kernels/mtp_input.py). The tokens are read from device memory (a graph replay feeds draft
// i's argmax to draft i + 1 without the host); a token >= vocab gives BF16 NaN over its half instead
// of a read past the table, as the host twin does.
#include "model_common.cuh"
#include "batch.cuh"

namespace {
constexpr int EH_WARPS = 8;  // block 256 (model/kernels/mtp_input.py)
constexpr int EH_U = 8;      // 16-byte weight loads per lane in flight
// Rows a warp may own: the hidden half's partial sums wait in shared memory for the embedding
// half. The launch helper keeps the grid at or above ceil(n / (8 * EH_ROWS_PER_WARP)).
constexpr int EH_ROWS_PER_WARP = 4;

}  // namespace

// ---- the batch: m entries (1 <= m <= 256, ptx/batch.cuh), eh_proj read once for all of them ---------

namespace {
// Row e of out is [rmsnorm(table[entry e's token]) * enorm ; rmsnorm(hidden[e]) * hnorm] for the m
// entries. Grid (m, 2), block 256: blockIdx.y picks the half, so both 8 KB reductions of a
// 4096-wide row run on two SMs at once. A padding entry's row is not written and nothing is read
// for it. FLAGS: the hidden half's block also stores HIDDEN_NONFINITE (1: the hidden row's RMS
// divisor is not finite) | TOKEN_OUTSIDE (2: the token is not in the vocabulary) into
// flags[4 e + flag_byte] when either holds, as mtp_input_gemv_batch does (one writer a byte: the
// flags live in mapped host memory, where atomics are not assured).
template <bool FLAGS>
__device__ __forceinline__ void embed_norm_row(const uint16_t* __restrict__ table, const uint32_t* __restrict__ entries,
                                               const uint16_t* __restrict__ enorm, const uint16_t* __restrict__ hidden,
                                               const uint16_t* __restrict__ hnorm, uint16_t* __restrict__ out,
                                               uint32_t m, uint32_t vocab, uint32_t h, float eps,
                                               uint8_t* __restrict__ flags, uint32_t flag_byte) {
    __shared__ float scratch[32];
    const uint32_t e = blockIdx.x;
    if (e >= m) return;
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return;
    uint16_t* o = out + (size_t)e * 2u * h + (blockIdx.y ? h : 0u);
    const uint16_t* x;
    const uint16_t* w;
    if (blockIdx.y == 0) {
        if (b.token >= vocab) {
            for (uint32_t i = threadIdx.x; i < h; i += blockDim.x) o[i] = (uint16_t)BF16_QNAN_BITS;
            return;
        }
        x = table + (size_t)b.token * h;
        w = enorm;
    } else {
        x = hidden + (size_t)e * h;
        w = hnorm;
    }
    const float d = rms_divisor(x, h, eps, scratch);
    if (FLAGS && blockIdx.y == 1) {
        const uint32_t bad = (isfinite(d) ? 0u : 1u) | (b.token >= vocab ? 2u : 0u);
        if (threadIdx.x == 0 && bad) flags[(size_t)e * 4u + flag_byte] = (uint8_t)bad;
    }
    rms_apply(x, w, o, h, d);
}
}  // namespace

// The catch-up's input rows (embed_norm_row). No PDL.
extern "C" __global__ void __launch_bounds__(256) mtp_embed_norm_batch(
    const uint16_t* __restrict__ table, const uint32_t* __restrict__ entries, const uint16_t* __restrict__ enorm,
    const uint16_t* __restrict__ hidden, const uint16_t* __restrict__ hnorm, uint16_t* __restrict__ out,
    uint32_t m, uint32_t vocab, uint32_t h, float eps) {
    embed_norm_row<false>(table, entries, enorm, hidden, hnorm, out, m, vocab, h, eps, nullptr, 0u);
}

// A draft's input rows for eh_proj on tensor cores (model/kernels/proj_mma.py), with the flags
// (embed_norm_row). No PDL.
extern "C" __global__ void __launch_bounds__(256) mtp_embed_norm_flags_batch(
    const uint16_t* __restrict__ table, const uint32_t* __restrict__ entries, const uint16_t* __restrict__ enorm,
    const uint16_t* __restrict__ hidden, const uint16_t* __restrict__ hnorm, uint16_t* __restrict__ out,
    uint32_t m, uint32_t vocab, uint32_t h, float eps, uint8_t* __restrict__ flags, uint32_t flag_byte) {
    embed_norm_row<true>(table, entries, enorm, hidden, hnorm, out, m, vocab, h, eps, flags, flag_byte);
}

namespace {
constexpr uint32_t EH_BATCH_ROWS = 8;  // entries per block; model/kernels/mtp_input.py MTP_INPUT_BATCH_ROWS

// Weight loads in flight per lane by rows per block: EH_U at M = 1, fewer as more
// rows share each load, within the 64 registers of __launch_bounds__(256, 4).
template <int M>
__host__ __device__ constexpr int eh_unroll() { return M == 1 ? EH_U : (M == 2 ? 4 : 2); }

template <int U>
__device__ __forceinline__ void eh_load(const uint4* __restrict__ wr, uint32_t c0, uint32_t kc, uint4 (&wv)[U]) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const uint32_t c = c0 + lane + 32u * u;
        wv[u] = c < kc ? ld_stream16(wr + c) : make_uint4(0, 0, 0, 0);
    }
}

// One half-row dot for M input rows (row r at xs + r * h): acc[r] is this lane's share of
// W_half[row] . xs_r, summed in the lane's chunk order whatever M; `wv` holds the first batch.
template <int U, int M>
__device__ __forceinline__ void eh_rows_dot(const uint4* __restrict__ wr, const uint16_t* xs, uint32_t h,
                                            uint32_t kc, uint4 (&wv)[U], float (&acc)[M]) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    for (uint32_t c0 = 0; c0 < kc; c0 += 32u * U) {
        if (c0 > 0) eh_load<U>(wr, c0, kc, wv);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t c = c0 + lane + 32u * u;
            if (c < kc) {
#pragma unroll
                for (int r = 0; r < M; ++r)
                    acc[r] = dot8_bf16(wv[u], reinterpret_cast<const uint4*>(xs + (size_t)r * h)[c], acc[r]);
            }
        }
    }
}

template <int M>
__device__ __forceinline__ void eh_rows_dot_scalar(const uint16_t* __restrict__ wr, const uint16_t* xs, uint32_t h,
                                                   float (&acc)[M]) {
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    for (uint32_t i = threadIdx.x & 31; i < h; i += 32u) {
        const float wi = bf16_bits_to_f32(wr[i]);
#pragma unroll
        for (int r = 0; r < M; ++r) acc[r] = fmaf(wi, bf16_bits_to_f32(xs[(size_t)r * h + i]), acc[r]);
    }
}

// Sums of M values over the block at once, each by block_sum's tree (so each is bit for bit what
// block_sum / block_sum2 give it alone). `scratch` holds 32 * M floats; ends with a barrier.
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

// RmsNormToSmem for M (>= 2) rows at once: row idx[i] of base ([*][n]) normalised into xs + i * n,
// each bit for bit what RmsNormToSmem gives it alone, d[i] its RMS divisor (as RmsNormToSmem returns
// it); a row with use[i] false gets `fill[i]` in every element (and d[i] = 1), reading nothing.
// Staged (every used row 16-byte aligned): a thread stages its chunks c = tid, tid + blockDim, ... of
// all rows (four loads in flight at a time, to stay in the kernel's 64 registers), summing each row's
// squares in that order (stage_row_sumsq's), then one block reduction for the M sums and
// scale_staged_row per row. Otherwise each row through rms_divisor and rms_apply, RmsNormToSmem's
// fallback (whose divisor equals the staged one for an aligned row). Ends with a barrier. `scratch`
// holds 32 * M floats.
template <int M>
__device__ __forceinline__ void rms_rows_to_smem(const uint16_t* __restrict__ base, const uint32_t (&idx)[M],
                                                 const bool (&use)[M], const uint16_t (&fill)[M],
                                                 const uint16_t* __restrict__ w, uint32_t n, float eps,
                                                 uint16_t* xs, float* scratch, float (&d)[M]) {
    bool staged = (n % 8u == 0) && aligned16(w) && aligned16(xs) && aligned16(base);
    if (staged) {
        const uint32_t nc = n / 8u;
        float ss[M];
#pragma unroll
        for (int i = 0; i < M; ++i) ss[i] = 0.0f;
        for (uint32_t c = threadIdx.x; c < nc; c += blockDim.x) {
#pragma unroll
            for (int g = 0; g < M; g += 4) {
                uint4 v[4];
#pragma unroll
                for (int q = 0; q < 4 && g + q < M; ++q) {
                    const int i = g + q;
                    const uint32_t f = (uint32_t)fill[i] * 0x10001u;
                    v[q] = use[i] ? __ldg(reinterpret_cast<const uint4*>(base + (size_t)idx[i] * n) + c)
                                  : make_uint4(f, f, f, f);
                }
#pragma unroll
                for (int q = 0; q < 4 && g + q < M; ++q) {
                    const int i = g + q;
                    reinterpret_cast<uint4*>(xs + (size_t)i * n)[c] = v[q];
                    if (use[i]) ss[i] = sumsq8(v[q], ss[i]);
                }
            }
        }
        block_sum_rows<M>(ss, scratch);
#pragma unroll
        for (int i = 0; i < M; ++i) {
            d[i] = use[i] ? sqrtf(ss[i] / (float)n + eps) : 1.0f;
            if (use[i]) scale_staged_row(xs + (size_t)i * n, w, n, d[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < M; ++i) {
            uint16_t* dst = xs + (size_t)i * n;
            if (use[i]) {
                const uint16_t* src = base + (size_t)idx[i] * n;
                d[i] = rms_divisor(src, n, eps, scratch);
                rms_apply(src, w, dst, n, d[i]);
            } else {
                d[i] = 1.0f;
                for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) dst[j] = fill[i];
            }
        }
    }
    __syncthreads();
}

// mtp_input_gemv_batch for the `rows` (<= M) entries of the chunk at e0: every block
// normalises its rows' hidden halves, streams the hidden half of its rows of W (grid-stride over
// blockIdx.y, one row per warp at a time) and keeps the sums in shared memory, all before the wait;
// after it the entries (through L2: the head that writes their tokens may still run), the flags, the
// embedding rows' norms and the embedding half, y = bf16(embedding sum + hidden sum) per row. The
// embedding rows replace the hidden rows in xs [M][h] (a barrier between). Rows rows..M-1 of the
// template (a short chunk) and padding entries are computed on zeros and never stored.
template <int M>
__device__ __forceinline__ void mtp_input_rows(const uint16_t* __restrict__ table, const uint32_t* __restrict__ entries,
                                               const uint16_t* __restrict__ enorm, const uint16_t* __restrict__ hidden,
                                               const uint16_t* __restrict__ hnorm, const uint16_t* __restrict__ w,
                                               uint16_t* __restrict__ y, uint32_t vocab, uint32_t h, uint32_t n,
                                               float eps, uint8_t* __restrict__ flags, uint32_t flag_byte, uint32_t e0,
                                               uint32_t rows, uint16_t* xs, float* scratch, float* part) {
    constexpr int U = eh_unroll<M>();
    const uint32_t lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const uint32_t warps = gridDim.y * EH_WARPS;
    const uint32_t row0 = blockIdx.y * EH_WARPS + wib;
    const size_t k = 2u * (size_t)h;
    const bool vec = (h % 8u == 0) && aligned16(w);
    const uint32_t hc = h >> 3;
    uint4 wv[U];

    if (vec && row0 < n) eh_load<U>(reinterpret_cast<const uint4*>(w + row0 * k + h), 0, hc, wv);
    // Bit r: row r's hidden RMS divisor is not finite (one register through the loop, not M).
    uint32_t nonfinite = 0u;
    if (M == 1) {
        nonfinite = isfinite(RmsNormToSmem{hidden + (size_t)e0 * h, hnorm, h, eps, scratch}(xs)) ? 0u : 1u;
    } else {
        float hidden_rms[M];
        uint32_t idx[M];
        bool use[M];
        uint16_t fill[M];
#pragma unroll
        for (int r = 0; r < M; ++r) {
            idx[r] = e0 + (uint32_t)r;
            use[r] = (uint32_t)r < rows;
            fill[r] = 0;
        }
        rms_rows_to_smem<M>(hidden, idx, use, fill, hnorm, h, eps, xs, scratch, hidden_rms);
#pragma unroll
        for (int r = 0; r < M; ++r) nonfinite |= isfinite(hidden_rms[r]) ? 0u : 1u << r;
    }
    uint32_t i = 0;
    for (uint32_t row = row0; row < n; row += warps, ++i) {
        const uint16_t* wr = w + row * k + h;
        if (vec && row != row0) eh_load<U>(reinterpret_cast<const uint4*>(wr), 0, hc, wv);
        float acc[M];
        if (vec) eh_rows_dot<U, M>(reinterpret_cast<const uint4*>(wr), xs, h, hc, wv, acc);
        else eh_rows_dot_scalar<M>(wr, xs, h, acc);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            const float v = warp_sum(acc[r]);
            if (lane == (uint32_t)r && i < (uint32_t)EH_ROWS_PER_WARP) part[(i * EH_WARPS + wib) * EH_BATCH_ROWS + r] = v;
        }
    }

    if (vec && row0 < n) eh_load<U>(reinterpret_cast<const uint4*>(w + row0 * k), 0, hc, wv);
    __syncthreads();  // every warp is done with the hidden rows before the embedding rows replace them
    grid_dependency_wait();  // the tokens are the previous kernel's output
    uint32_t tok[M];
    uint32_t live = 0u;  // bit r: row r is a sequence's (in the chunk and not padding)
#pragma unroll
    for (int r = 0; r < M; ++r) {
        tok[r] = 0u;
        if ((uint32_t)r < rows) {
            // Through L2, not the read-only path: the head was still running when this grid started.
            const uint4 ent = __ldcg(reinterpret_cast<const uint4*>(entries) + e0 + r);
            tok[r] = ent.z;
            if (ent.x != BATCH_PAD) live |= 1u << r;
        }
    }
    if (live == 0u) return;  // the same in every thread: nothing of this chunk is stored
    if (blockIdx.y == 0) {
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if (threadIdx.x == (uint32_t)r && ((live >> r) & 1u)) {
                const uint32_t bad = ((nonfinite >> r) & 1u) | (tok[r] < vocab ? 0u : 2u);
                if (bad) flags[(size_t)(e0 + r) * 4u + flag_byte] = (uint8_t)bad;
            }
        }
    }
    if (M == 1) {
        if (tok[0] < vocab) {
            RmsNormToSmem{table + (size_t)tok[0] * h, enorm, h, eps, scratch}(xs);
        } else {
            for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) xs[j] = (uint16_t)BF16_QNAN_BITS;
            __syncthreads();
        }
    } else {
        bool use[M];
        uint16_t fill[M];
        float unused[M];
#pragma unroll
        for (int r = 0; r < M; ++r) {
            // NaN over a bad token's embedding half, as mtp_embed_norm_batch writes it; never a read past the table.
            const bool is_live = (live >> r) & 1u;
            use[r] = is_live && tok[r] < vocab;
            fill[r] = is_live ? (uint16_t)BF16_QNAN_BITS : (uint16_t)0;
        }
        rms_rows_to_smem<M>(table, tok, use, fill, enorm, h, eps, xs, scratch, unused);
    }
    i = 0;
    for (uint32_t row = row0; row < n; row += warps, ++i) {
        const uint16_t* wr = w + row * k;
        if (vec && row != row0) eh_load<U>(reinterpret_cast<const uint4*>(wr), 0, hc, wv);
        float acc[M];
        if (vec) eh_rows_dot<U, M>(reinterpret_cast<const uint4*>(wr), xs, h, hc, wv, acc);
        else eh_rows_dot_scalar<M>(wr, xs, h, acc);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            const float v = warp_sum(acc[r]);
            if (lane == (uint32_t)r && i < (uint32_t)EH_ROWS_PER_WARP && ((live >> r) & 1u))
                y[(size_t)(e0 + r) * n + row] = f32_to_bf16_bits(v + part[(i * EH_WARPS + wib) * EH_BATCH_ROWS + r]);
        }
    }
}
}  // namespace

// For m entries (ptx/batch.cuh): y[e] = eh_proj @ [rmsnorm(table[entry e's token]) * enorm ;
// rmsnorm(hidden[e]) * hnorm], one arithmetic per row whatever the chunk (so each row is
// bit-identical to a launch of that entry alone, m = 1), y dense
// [m][n]. hidden holds m rows of h (a padding entry's row is read before the wait, where the entries
// cannot be, but never used). Entry e's flag byte is flags[4 e + flag_byte], set as
// model/kernels/mtp_input.py says; a padding entry's flag and y row are never written. Grid (ceil(m / 8), the blocks
// resident at once but at least ceil(n / (8 EH_ROWS_PER_WARP))), block 256, dynamic smem
// M * h * 2 bytes for M the next power of two of min(m, 8); Pdl.BESIDE (the hidden half
// before the wait, the tokens after).
extern "C" __global__ void __launch_bounds__(256, 4) mtp_input_gemv_batch(
    const uint16_t* __restrict__ table, const uint32_t* __restrict__ entries, const uint16_t* __restrict__ enorm,
    const uint16_t* __restrict__ hidden, const uint16_t* __restrict__ hnorm, const uint16_t* __restrict__ w,
    uint16_t* __restrict__ y, uint32_t m, uint32_t vocab, uint32_t h, uint32_t n, float eps,
    uint8_t* __restrict__ flags, uint32_t flag_byte) {
    extern __shared__ __align__(16) uint16_t xs[];  // [M][h]: the normed hidden rows, then the embedding rows
    __shared__ float scratch[32 * EH_BATCH_ROWS];
    __shared__ float part[EH_ROWS_PER_WARP * EH_WARPS * EH_BATCH_ROWS];  // hidden-half sums
    const uint32_t e0 = blockIdx.x * EH_BATCH_ROWS;
    const uint32_t rows = e0 < m ? min(m - e0, EH_BATCH_ROWS) : 0u;
    if (rows == 1u)
        mtp_input_rows<1>(table, entries, enorm, hidden, hnorm, w, y, vocab, h, n, eps, flags, flag_byte, e0, rows, xs,
                          scratch, part);
    else if (rows == 2u)
        mtp_input_rows<2>(table, entries, enorm, hidden, hnorm, w, y, vocab, h, n, eps, flags, flag_byte, e0, rows, xs,
                          scratch, part);
    else if (rows > 2u && rows <= 4u)
        mtp_input_rows<4>(table, entries, enorm, hidden, hnorm, w, y, vocab, h, n, eps, flags, flag_byte, e0, rows, xs,
                          scratch, part);
    else if (rows > 4u)
        mtp_input_rows<8>(table, entries, enorm, hidden, hnorm, w, y, vocab, h, n, eps, flags, flag_byte, e0, rows, xs,
                          scratch, part);
    else
        grid_dependency_wait();  // a chunk past m (the launch helper makes none)
}
