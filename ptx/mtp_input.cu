// The MTP block's input half-rows: out[r] = [rmsnorm(table[tokens[r]]) * enorm ; rmsnorm(hidden[r]) * hnorm].
// Grid (rows, 2), block 256 (model/kernels/mtp_input.py): blockIdx.y picks the half, so both
// 8 KB reductions of a 4096-wide row run on two SMs at once. The token is read from device memory
// (a graph replay feeds draft i's argmax to draft i + 1 without the host); a token >= vocab writes
// BF16 NaN over its half instead of reading past the table, as the host twin does.
#include "model_common.cuh"

extern "C" __global__ void __launch_bounds__(256) mtp_embed_norm(
    const uint16_t* __restrict__ table, const uint32_t* __restrict__ tokens, const uint16_t* __restrict__ enorm,
    const uint16_t* __restrict__ hidden, const uint16_t* __restrict__ hnorm, uint16_t* __restrict__ out,
    uint32_t rows, uint32_t vocab, uint32_t h, float eps) {
    __shared__ float scratch[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    uint16_t* o = out + (size_t)r * 2u * h + (blockIdx.y ? h : 0u);
    const uint16_t* x;
    const uint16_t* w;
    if (blockIdx.y == 0) {
        const uint32_t t = tokens[r];
        if (t >= vocab) {
            for (uint32_t i = threadIdx.x; i < h; i += blockDim.x) o[i] = (uint16_t)BF16_QNAN_BITS;
            return;
        }
        x = table + (size_t)t * h;
        w = enorm;
    } else {
        x = hidden + (size_t)r * h;
        w = hnorm;
    }
    const float d = rms_divisor(x, h, eps, scratch);
    rms_apply(x, w, o, h, d);
}

namespace {
constexpr int EH_WARPS = 8;  // block 256 (model/kernels/mtp_input.py)
constexpr int EH_U = 8;      // 16-byte weight loads per lane in flight
// Rows a warp may own: the hidden half's partial sums wait in shared memory for the embedding
// half. The launch helper keeps the grid at or above ceil(n / (8 * EH_ROWS_PER_WARP)).
constexpr int EH_ROWS_PER_WARP = 4;

__device__ __forceinline__ void eh_load_batch(const uint4* __restrict__ wr, uint32_t c0, uint32_t kc,
                                              uint4 (&wv)[EH_U]) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < EH_U; ++u) {
        const uint32_t c = c0 + lane + 32u * u;
        wv[u] = c < kc ? ld_stream16(wr + c) : make_uint4(0, 0, 0, 0);
    }
}

// This lane's share of W_half[row] . xs_half over kc 16-byte chunks; `wv` holds the first batch.
__device__ __forceinline__ float eh_half_dot(const uint4* __restrict__ wr, const uint4* xv, uint32_t kc,
                                             uint4 (&wv)[EH_U]) {
    const uint32_t lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (uint32_t c0 = 0; c0 < kc; c0 += 32u * EH_U) {
        if (c0 > 0) eh_load_batch(wr, c0, kc, wv);
#pragma unroll
        for (int u = 0; u < EH_U; ++u) {
            const uint32_t c = c0 + lane + 32u * u;
            if (c < kc) acc = dot8_bf16(wv[u], xv[c], acc);
        }
    }
    return acc;
}

// The scalar path for a half-row that is not 16-byte aligned or not a multiple of 8 wide.
__device__ __forceinline__ float eh_half_dot_scalar(const uint16_t* __restrict__ wr, const uint16_t* xs, uint32_t h) {
    float acc = 0.0f;
    for (uint32_t i = threadIdx.x & 31; i < h; i += 32u) acc = fmaf(bf16_bits_to_f32(wr[i]), bf16_bits_to_f32(xs[i]), acc);
    return acc;
}
}  // namespace

// x = eh_proj @ [rmsnorm(embed[*token]) * enorm ; rmsnorm(hidden) * hnorm] for one row, as two
// half-row dot products: y[row] = bf16(W[row, :h] . e + W[row, h:] . hh), each half summed in f32.
// Both norms are block prologues (a few KB from L2 per block), so the concatenated input never goes
// through device memory.
//
// Pdl.BESIDE: the hidden row is the drafter's previous output, complete before the head that runs
// before this kernel started (the head releases its dependents right after its own wait), while the
// token is that head's output. So the hidden half is normalised and its whole 2h*n/2 bytes of
// weights are streamed before griddepcontrol.wait, in the head's tail (its last blocks and its
// argmax handshake); only the token, the embedding row's norm and the embedding half come after.
// Launched plainly (draft 0, or after a kernel that does not release) the wait returns at once.
//
// One row per warp, grid-stride over the rows with at most EH_ROWS_PER_WARP rows per warp, grid
// and block fixed by the launch helper; dynamic smem 2 * h * 2 bytes; __launch_bounds__(256, 4).
//
// Non-finite flag: `flag` is one byte the proposer reads back with the drafts (mapped pinned
// memory). Block 0's first thread stores 1 there when the hidden row is not finite (its RMS
// divisor, which the prologue computes anyway, is NaN or Inf), 2 when the token is not in the
// vocabulary, 3 for both, and stores nothing otherwise; after the wait, as a BESIDE kernel must.
extern "C" __global__ void __launch_bounds__(256, 4) mtp_input_gemv(
    const uint16_t* __restrict__ table, const uint32_t* __restrict__ token, const uint16_t* __restrict__ enorm,
    const uint16_t* __restrict__ hidden, const uint16_t* __restrict__ hnorm, const uint16_t* __restrict__ w,
    uint16_t* __restrict__ y, uint32_t vocab, uint32_t h, uint32_t n, float eps, uint8_t* __restrict__ flag) {
    extern __shared__ __align__(16) uint16_t xs[];  // [normed embedding row ; normed hidden row]
    __shared__ float scratch[64];
    __shared__ float part[EH_ROWS_PER_WARP * EH_WARPS];  // hidden-half sums, lane 0 of each warp
    const uint32_t lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const uint32_t warps = gridDim.x * EH_WARPS;
    const uint32_t row0 = blockIdx.x * EH_WARPS + wib;
    const size_t k = 2u * (size_t)h;
    const bool vec = (h % 8u == 0) && aligned16(w);
    const uint32_t hc = h >> 3;
    uint4 wv[EH_U];

    if (vec && row0 < n) eh_load_batch(reinterpret_cast<const uint4*>(w + row0 * k + h), 0, hc, wv);
    const float hidden_rms = RmsNormToSmem{hidden, hnorm, h, eps, scratch}(xs + h);
    uint32_t i = 0;
    for (uint32_t row = row0; row < n; row += warps, ++i) {
        const uint16_t* wr = w + row * k + h;
        if (vec && row != row0) eh_load_batch(reinterpret_cast<const uint4*>(wr), 0, hc, wv);
        float acc = vec ? eh_half_dot(reinterpret_cast<const uint4*>(wr), reinterpret_cast<const uint4*>(xs + h), hc, wv)
                        : eh_half_dot_scalar(wr, xs + h, h);
        acc = warp_sum(acc);
        if (lane == 0 && i < (uint32_t)EH_ROWS_PER_WARP) part[i * EH_WARPS + wib] = acc;
    }

    if (vec && row0 < n) eh_load_batch(reinterpret_cast<const uint4*>(w + row0 * k), 0, hc, wv);
    grid_dependency_wait();  // the token is the previous kernel's output
    // Through L2, not the read-only path: the head was still running when this grid started, so
    // the token is not read-only over this kernel's lifetime (see ptx/common.cuh).
    const uint32_t t = __ldcg(token);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const uint32_t bad = (isfinite(hidden_rms) ? 0u : 1u) | (t < vocab ? 0u : 2u);
        if (bad) *flag = (uint8_t)bad;
    }
    if (t < vocab) {
        RmsNormToSmem{table + (size_t)t * h, enorm, h, eps, scratch}(xs);
    } else {
        // NaN over the embedding half, as mtp_embed_norm writes it; never a read past the table.
        for (uint32_t j = threadIdx.x; j < h; j += blockDim.x) xs[j] = (uint16_t)BF16_QNAN_BITS;
        __syncthreads();
    }
    i = 0;
    for (uint32_t row = row0; row < n; row += warps, ++i) {
        const uint16_t* wr = w + row * k;
        if (vec && row != row0) eh_load_batch(reinterpret_cast<const uint4*>(wr), 0, hc, wv);
        float acc = vec ? eh_half_dot(reinterpret_cast<const uint4*>(wr), reinterpret_cast<const uint4*>(xs), hc, wv)
                        : eh_half_dot_scalar(wr, xs, h);
        acc = warp_sum(acc);
        if (lane == 0 && i < (uint32_t)EH_ROWS_PER_WARP) y[row] = f32_to_bf16_bits(acc + part[i * EH_WARPS + wib]);
    }
}
