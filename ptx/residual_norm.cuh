// The ordered row sums with the residual add and the next sub-layer's RMSNorm, as one block's work:
// out = bf16(residual + (((p0 + p1) + p2) + ...)), normed = bf16((out / r) * w),
// r = sqrt(mean(out^2) + eps). The standalone sum_rows_residual_rmsnorm (ptx/bgemv.cu) runs it in
// one block of 1024 threads; o_proj (bgemv_bf16_f32_sum_norm) and moe_down (moe_down_sum_norm) run
// it in the last of their own blocks to finish (last_block_done), which takes the launch and its
// grid-completion hand-off off the step. The part rows are read through L2: another block or grid
// wrote them, and may have been running when this block started. The adds stay in row order, so
// `out` is bit-identical to sum_rows_residual's. build.py hashes this file into every includer.
#pragma once
#include "model_common.cuh"

namespace {
// CH chunks of four elements (c[j], valid below n4) of the row: the part rows added in row order
// with CH x RL float4 loads in flight, the residual added, the BF16 result stored (and returned
// packed in o01 / o23), and its squares added to ss.
template <int CH, int RL>
__device__ __forceinline__ void sum_chunks_rows(const float* __restrict__ parts, const uint16_t* residual,
                                                uint16_t* out, uint32_t rows, uint32_t n4, const uint32_t (&c)[CH],
                                                uint32_t (&o01)[CH], uint32_t (&o23)[CH], float& ss) {
    const float4* p4 = reinterpret_cast<const float4*>(parts);
    float4 acc[CH];
    uint2 res[CH];
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        acc[j] = c[j] < n4 ? __ldcg(p4 + c[j]) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        res[j] = c[j] < n4 ? *reinterpret_cast<const uint2*>(residual + 4u * c[j]) : make_uint2(0u, 0u);
    }
    for (uint32_t r0 = 1; r0 < rows; r0 += RL) {
        float4 v[CH][RL];
#pragma unroll
        for (int j = 0; j < CH; ++j)
#pragma unroll
            for (int u = 0; u < RL; ++u)
                v[j][u] = (r0 + u < rows && c[j] < n4) ? __ldcg(p4 + (size_t)(r0 + u) * n4 + c[j])
                                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int j = 0; j < CH; ++j)
#pragma unroll
            for (int u = 0; u < RL; ++u) {
                if (r0 + u < rows) {
                    acc[j].x = __fadd_rn(acc[j].x, v[j][u].x);
                    acc[j].y = __fadd_rn(acc[j].y, v[j][u].y);
                    acc[j].z = __fadd_rn(acc[j].z, v[j][u].z);
                    acc[j].w = __fadd_rn(acc[j].w, v[j][u].w);
                }
            }
    }
#pragma unroll
    for (int j = 0; j < CH; ++j) {
        if (c[j] >= n4) continue;
        o01[j] = pack_bf16x2(__fadd_rn(bf16_lo(res[j].x), acc[j].x), __fadd_rn(bf16_hi(res[j].x), acc[j].y));
        o23[j] = pack_bf16x2(__fadd_rn(bf16_lo(res[j].y), acc[j].z), __fadd_rn(bf16_hi(res[j].y), acc[j].w));
        *reinterpret_cast<uint2*>(out + 4u * c[j]) = make_uint2(o01[j], o23[j]);
        const float f[4] = {bf16_lo(o01[j]), bf16_hi(o01[j]), bf16_lo(o23[j]), bf16_hi(o23[j])};
#pragma unroll
        for (int e = 0; e < 4; ++e) ss = fmaf(f[e], f[e], ss);
    }
}

__device__ __forceinline__ uint2 norm_chunk(uint32_t o01, uint32_t o23, uint2 w, float d) {
    return make_uint2(
        pack_bf16x2(__fmul_rn(bf16_lo(o01) / d, bf16_lo(w.x)), __fmul_rn(bf16_hi(o01) / d, bf16_hi(w.x))),
        pack_bf16x2(__fmul_rn(bf16_lo(o23) / d, bf16_lo(w.y)), __fmul_rn(bf16_hi(o23) / d, bf16_hi(w.y))));
}

__device__ __forceinline__ bool residual_norm_vec(const float* parts, const uint16_t* residual,
                                                  const uint16_t* norm_w, const uint16_t* out,
                                                  const uint16_t* normed, uint32_t n) {
    return (n % 4u == 0) && aligned16(parts) && ((uintptr_t)residual & 7u) == 0 && ((uintptr_t)out & 7u) == 0 &&
           ((uintptr_t)normed & 7u) == 0 && ((uintptr_t)norm_w & 7u) == 0;
}

// The whole row by the calling block (every thread calls it). A row of at most MAXC * blockDim
// chunks of four (the GLM hidden 4096: one chunk per thread of 1024, four per thread of 256) keeps
// its sums in registers for the norm, with CH chunks' row loads in flight at a time; `w_pre` holds
// the thread's norm-weight chunks when the caller loaded them (w_ready), e.g. before its wait.
// Longer or unaligned rows take a loop that re-reads its own stores.
template <int CH, int MAXC>
__device__ __forceinline__ void residual_rmsnorm_block(const float* __restrict__ parts, const uint16_t* residual,
                                                       const uint16_t* __restrict__ norm_w, uint16_t* out,
                                                       uint16_t* __restrict__ normed, uint32_t rows, uint32_t n,
                                                       float eps, float* scratch, const uint2 (&w_pre)[MAXC],
                                                       bool w_ready) {
    static_assert(MAXC % CH == 0, "chunks are taken CH at a time");
    constexpr int RL = 8;
    const uint32_t nt = blockDim.x, tid = threadIdx.x;
    const bool vec = residual_norm_vec(parts, residual, norm_w, out, normed, n);
    float ss = 0.0f;
    if (vec && n / 4u <= MAXC * nt) {
        const uint32_t n4 = n / 4u;
        uint32_t o01[MAXC], o23[MAXC];
        uint2 wv[MAXC];
#pragma unroll
        for (int j = 0; j < MAXC; ++j) {
            const uint32_t c = tid + nt * (uint32_t)j;
            wv[j] = w_ready ? w_pre[j] : (c < n4 ? __ldg(reinterpret_cast<const uint2*>(norm_w) + c) : make_uint2(0u, 0u));
        }
#pragma unroll
        for (int j0 = 0; j0 < MAXC; j0 += CH) {
            uint32_t c[CH], a[CH], b[CH];
#pragma unroll
            for (int j = 0; j < CH; ++j) c[j] = tid + nt * (uint32_t)(j0 + j);
            sum_chunks_rows<CH, RL>(parts, residual, out, rows, n4, c, a, b, ss);
#pragma unroll
            for (int j = 0; j < CH; ++j) {
                o01[j0 + j] = a[j];
                o23[j0 + j] = b[j];
            }
        }
        const float d = sqrtf(block_sum(ss, scratch) / (float)n + eps);
#pragma unroll
        for (int j = 0; j < MAXC; ++j) {
            const uint32_t c = tid + nt * (uint32_t)j;
            if (c < n4) *reinterpret_cast<uint2*>(normed + 4u * c) = norm_chunk(o01[j], o23[j], wv[j], d);
        }
        return;
    }
    if (vec) {
        const uint32_t n4 = n / 4u;
        for (uint32_t c0 = tid; c0 < n4; c0 += nt) {
            const uint32_t c[1] = {c0};
            uint32_t a[1], b[1];
            sum_chunks_rows<1, RL>(parts, residual, out, rows, n4, c, a, b, ss);
        }
    } else {
        for (uint32_t i = tid; i < n; i += nt) {
            float acc = __ldcg(parts + i);
            for (uint32_t r = 1; r < rows; ++r) acc = __fadd_rn(acc, __ldcg(parts + (size_t)r * n + i));
            const uint16_t o = f32_to_bf16_bits(__fadd_rn(bf16_bits_to_f32(residual[i]), acc));
            out[i] = o;
            const float v = bf16_bits_to_f32(o);
            ss = fmaf(v, v, ss);
        }
    }
    const float d = sqrtf(block_sum(ss, scratch) / (float)n + eps);
    // Each thread re-reads only the elements it wrote itself: program order makes them visible.
    if (vec) {
        for (uint32_t c = tid; c < n / 4u; c += nt) {
            const uint2 o = *reinterpret_cast<const uint2*>(out + 4u * c);
            *reinterpret_cast<uint2*>(normed + 4u * c) =
                norm_chunk(o.x, o.y, *reinterpret_cast<const uint2*>(norm_w + 4u * c), d);
        }
    } else {
        for (uint32_t i = tid; i < n; i += nt)
            normed[i] = f32_to_bf16_bits(__fmul_rn(bf16_bits_to_f32(out[i]) / d, bf16_bits_to_f32(norm_w[i])));
    }
}
}  // namespace
