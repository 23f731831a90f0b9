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
// Prologue of mtp_input_gemv: xs = [rmsnorm(table[*token]) * enorm ; rmsnorm(hidden) * hnorm],
// the half of an out-of-vocabulary token NaN, as mtp_embed_norm writes it. Both rows are staged in
// place in xs (stage_row_sumsq; the hidden row's loads go out before the token is known to be in
// range) and their two sums of squares share one block reduction.
struct MtpConcatToSmem {
    const uint16_t* table;
    const uint32_t* token;
    const uint16_t* enorm;
    const uint16_t* hidden;
    const uint16_t* hnorm;
    uint32_t vocab, h;
    float eps;
    float* scratch;  // 64 floats
    __device__ __forceinline__ void operator()(uint16_t* xs) const {
        const uint32_t t = *token;
        const bool valid = t < vocab;
        const uint16_t* e = table + (size_t)(valid ? t : 0u) * h;
        const bool fast = rms_stage_ok(hidden, hnorm, xs + h, h) && rms_stage_ok(e, enorm, xs, h);
        if (fast) {
            float sh = stage_row_sumsq(hidden, xs + h, h);
            float se = valid ? stage_row_sumsq(e, xs, h) : 0.0f;
            block_sum2(se, sh, scratch);
            if (valid) scale_staged_row(xs, enorm, h, sqrtf(se / (float)h + eps));
            scale_staged_row(xs + h, hnorm, h, sqrtf(sh / (float)h + eps));
            if (!valid)
                for (uint32_t i = threadIdx.x; i < h; i += blockDim.x) xs[i] = (uint16_t)BF16_QNAN_BITS;
        } else {
            if (valid) {
                rms_apply(e, enorm, xs, h, rms_divisor(e, h, eps, scratch));
            } else {
                for (uint32_t i = threadIdx.x; i < h; i += blockDim.x) xs[i] = (uint16_t)BF16_QNAN_BITS;
            }
            rms_apply(hidden, hnorm, xs + h, h, rms_divisor(hidden, h, eps, scratch));
        }
        __syncthreads();
    }
};
}  // namespace

// x = eh_proj @ [rmsnorm(embed[*token]) * enorm ; rmsnorm(hidden) * hnorm] for one row: the two
// norms are the prologue of every block (smem_x_gemv), so the concatenated input never goes
// through device memory and one launch replaces two. Grid min(ceil(n / 8), the blocks resident at
// once), block 256, dynamic smem 2 * h * 2 bytes; __launch_bounds__(256, 4): 62 registers (nvcc
// 13.0, no spills), 4 blocks per SM (the register-held prologue needed 120 and allowed 2).
extern "C" __global__ void __launch_bounds__(256, 4) mtp_input_gemv(
    const uint16_t* __restrict__ table, const uint32_t* __restrict__ token, const uint16_t* __restrict__ enorm,
    const uint16_t* __restrict__ hidden, const uint16_t* __restrict__ hnorm, const uint16_t* __restrict__ w,
    uint16_t* __restrict__ y, uint32_t vocab, uint32_t h, uint32_t n, float eps) {
    extern __shared__ __align__(16) uint16_t xs[];
    __shared__ float scratch[64];
    smem_x_gemv(w, y, n, 2u * h, xs, MtpConcatToSmem{table, token, enorm, hidden, hnorm, vocab, h, eps, scratch});
}
