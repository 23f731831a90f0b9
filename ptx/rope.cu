// The query side of rotary attention for m batch entries (model/kernels/rope.py, rope_q_batch):
// entry e's row of the q projection (q + e * q_stride elements) holds `heads` MLA heads of
// [nope ; rope_dim], then at iq_offset `iheads` indexer heads of idim. The MLA heads are split into
// q_nope (a copy) and q_rope (rotated, BF16); the indexer heads' first irope_dim dims are rotated in
// place. Position = entries[e].row + row_add; the rotation is ptx/rope.cuh's.
//
// Grid (m, ceil((heads + rotated indexer heads) / ROPE_Q_WARPS)), block 32 * ROPE_Q_WARPS: one warp
// per head, lane i rotating pairs i, i + 32, ...; each pair is read and written by one lane only, so
// the in-place rotation needs no barrier.
#include "batch.cuh"
#include "common.cuh"
#include "rope.cuh"

#define ROPE_Q_WARPS 4

// q is read through L2 (__ldcg), not the read-only path: the projection that writes it may release
// its dependents early (ptx/common.cuh), and this kernel stores into q as well.
extern "C" __global__ void __launch_bounds__(32 * ROPE_Q_WARPS) rope_q_batch(
    uint16_t* q, uint32_t q_stride, uint32_t heads, uint32_t nope, uint32_t rope_dim, uint32_t iq_offset,
    uint32_t iheads, uint32_t idim, uint32_t irope_dim, const float* __restrict__ inv_freq, float attn_factor,
    uint32_t interleave, uint32_t i_interleave, uint16_t* __restrict__ q_nope, uint16_t* __restrict__ q_rope,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add) {
    grid_dependency_wait();
    const uint32_t e = blockIdx.x;
    const uint32_t unit = blockIdx.y * ROPE_Q_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31u;
    if (e >= m || !rope_dims_ok(rope_dim, irope_dim, idim)) return;
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return;
    const uint32_t pos = b.row + row_add;
    if (unit < heads) {
        const uint16_t* src = q + (size_t)e * q_stride + (size_t)unit * (nope + rope_dim);
        uint16_t* dn = q_nope + ((size_t)e * heads + unit) * nope;
        for (uint32_t d = lane; d < nope; d += 32u) dn[d] = __ldcg(src + d);
        const uint16_t* sr = src + nope;
        uint16_t* dr = q_rope + ((size_t)e * heads + unit) * rope_dim;
        const bool il = interleave != 0u;
        for (uint32_t i = lane; i < rope_dim / 2u; i += 32u) {
            const uint32_t a = rope_first(i, rope_dim, il), z = rope_second(i, rope_dim, il);
            float c, s, y0, y1;
            rope_cos_sin(pos, __ldg(inv_freq + i), attn_factor, c, s);
            rope_rotate(bf16_bits_to_f32(__ldcg(sr + a)), bf16_bits_to_f32(__ldcg(sr + z)), c, s, y0, y1);
            dr[a] = f32_to_bf16_bits(y0);
            dr[z] = f32_to_bf16_bits(y1);
        }
    } else if (irope_dim > 0u && unit - heads < iheads) {
        uint16_t* h = q + (size_t)e * q_stride + iq_offset + (size_t)(unit - heads) * idim;
        const bool il = i_interleave != 0u;
        for (uint32_t i = lane; i < irope_dim / 2u; i += 32u) {
            const uint32_t a = rope_first(i, irope_dim, il), z = rope_second(i, irope_dim, il);
            float c, s, y0, y1;
            rope_cos_sin(pos, __ldg(inv_freq + i), attn_factor, c, s);
            rope_rotate(bf16_bits_to_f32(__ldcg(h + a)), bf16_bits_to_f32(__ldcg(h + z)), c, s, y0, y1);
            h[a] = f32_to_bf16_bits(y0);
            h[z] = f32_to_bf16_bits(y1);
        }
    }
}
