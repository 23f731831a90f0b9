// Absorbed MLA attention over the selected latent rows of the paged FP8 cache
// (model/kernels/sparse_mla.py). Per head h: s_j = (q_h . c_j + qr_h . kr_j) * scale over the selected
// rows j, p = softmax(s), o_h = sum_j p_j c_j, with c_j = fp8(cache[slot_j]) * scales[slot_j] and
// slot_j = block_table[r / block_size] * block_size + r % block_size for r = selected[j]. The RoPE
// term qr_h . kr_j (BF16 rotated query and key, rope_dim wide; kr dense per sequence slot, row r) is
// absent for rope_dim = 0 (NoPE): each kernel then runs the build without it, bit for bit the
// kernel before the term existed.
// Every kernel covers the m entries of a batch (ptx/batch.cuh), each with its own query, selection
// and slot's block table. The row count is read from device memory (the selection kernel wrote it).
#include "batch.cuh"
#include "model_common.cuh"
#include "mma_bf16.cuh"

// ---- sparse_mla_attend_batch: the one-launch kernel (CUDA cores) -------------------------------
// A block per (head, entry), block 256. Each warp runs an online softmax over rows j = warp, warp + 8, ...
// with the lane owning dims lane + 32 i, then the 8 warps' (max, sum, acc) are merged in shared
// memory. Exact softmax (running max with rescaling); the order of additions differs from NumPy's.
// It has no workspace, so one block serves one head over every row; the proposer uses the split
// pair below (sparse_mla_partial_batch + sparse_mla_combine_batch), which spreads the rows over
// the chip.
#define MLA_MAX_DIM 1024
#define MLA_PER_LANE (MLA_MAX_DIM / 32)
// rope_dim: 0, or a multiple of 16 up to MLA_MAX_ROPE (the split pair's k-steps of 16, held in
// registers; the launch helpers refuse other widths, the kernels write nothing for them).
#define MLA_MAX_ROPE 128

namespace {
__device__ __forceinline__ bool rope_dim_ok(uint32_t rope_dim) {
    return rope_dim % 16u == 0 && rope_dim <= MLA_MAX_ROPE;
}
}  // namespace

namespace {
struct AttendSmem {
    float qs[MLA_MAX_DIM];
    float acc_s[8][MLA_MAX_DIM / 4];  // merged a quarter of the dims at a time
    float m_s[8], l_s[8];
    float qrs[MLA_MAX_ROPE];  // the rope query (ROPE only)
};

// Head blockIdx.x of one sequence over its n selected rows, whichever kernel calls it. ROPE: the
// score adds q_rope . rope_keys[r] (q_rope the head's row, rope_keys the slot's rows), each lane
// taking rope dims lane + 32 i into the same warp sum as its latent dims.
template <bool ROPE>
__device__ __forceinline__ void attend_head(const float* __restrict__ q, const uint16_t* __restrict__ q_rope,
                                            const uint8_t* __restrict__ cache, const float* __restrict__ scales,
                                            const uint16_t* __restrict__ rope_keys,
                                            const uint32_t* __restrict__ block_table,
                                            const uint32_t* __restrict__ selected, uint32_t n,
                                            uint16_t* __restrict__ out, uint32_t dim, uint32_t rope_dim,
                                            uint32_t block_size, float scale, AttendSmem& sm) {
    float* qs = sm.qs;
    float(*acc_s)[MLA_MAX_DIM / 4] = sm.acc_s;
    float* m_s = sm.m_s;
    float* l_s = sm.l_s;
    const uint32_t h = blockIdx.x;
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x) qs[d] = q[(size_t)h * dim + d];
    float* qrs = sm.qrs;
    if (ROPE)
        for (uint32_t d = threadIdx.x; d < rope_dim; d += blockDim.x)
            qrs[d] = bf16_bits_to_f32(q_rope[(size_t)h * rope_dim + d]);
    __syncthreads();
    float acc[MLA_PER_LANE];
#pragma unroll
    for (int i = 0; i < MLA_PER_LANE; ++i) acc[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (uint32_t j = warp; j < n; j += 8u) {
        const uint32_t r = selected[j];
        const uint32_t slot = block_table[r / block_size] * block_size + r % block_size;
        const float sc = scales[slot];
        const uint8_t* row = cache + (size_t)slot * dim;
        float c[MLA_PER_LANE];
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_PER_LANE; ++i) {
            const uint32_t d = lane + 32u * i;
            c[i] = d < dim ? __fmul_rn(fp8_to_f32(row[d]), sc) : 0.0f;
            if (d < dim) dot = fmaf(qs[d], c[i], dot);
        }
        if (ROPE) {
            const uint16_t* kr = rope_keys + (size_t)r * rope_dim;
#pragma unroll
            for (int i = 0; i < MLA_MAX_ROPE / 32; ++i) {
                const uint32_t d = lane + 32u * i;
                if (d < rope_dim) dot = fmaf(qrs[d], bf16_bits_to_f32(kr[d]), dot);
            }
        }
        const float s = __fmul_rn(warp_sum(dot), scale);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);
        const float p = expf(s - m_new);
        l = fmaf(l, corr, p);
#pragma unroll
        for (int i = 0; i < MLA_PER_LANE; ++i) acc[i] = fmaf(acc[i], corr, p * c[i]);
        m = m_new;
    }
    if (lane == 0) { m_s[warp] = m; l_s[warp] = l; }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < 8; ++w) M = fmaxf(M, m_s[w]);
    float L = 0.0f;
    for (int w = 0; w < 8; ++w)
        if (m_s[w] != -INFINITY) L = fmaf(l_s[w], expf(m_s[w] - M), L);
    const float my_w = m == -INFINITY ? 0.0f : expf(m - M);  // this warp's rescale
    const uint32_t quarter = MLA_MAX_DIM / 4;
    for (uint32_t d0 = 0; d0 < dim; d0 += quarter) {
#pragma unroll
        for (int i = 0; i < MLA_PER_LANE; ++i) {
            const uint32_t d = lane + 32u * i;
            if (d >= d0 && d < d0 + quarter && d < dim) acc_s[warp][d - d0] = acc[i] * my_w;
        }
        __syncthreads();
        for (uint32_t d = d0 + threadIdx.x; d < min(dim, d0 + quarter); d += blockDim.x) {
            float o = 0.0f;
            for (int w = 0; w < 8; ++w) o += acc_s[w][d - d0];
            // An empty selection (no complete pool, no tail) attends nothing: output zero.
            out[(size_t)h * dim + d] = f32_to_bf16_bits(n ? o / L : 0.0f);
        }
        __syncthreads();
    }
}
}  // namespace

// Grid (heads, m); entry e's absorbed query
// q + e * heads * dim, its selection selected + e * sel_cap with count[e] rows (at most sel_cap),
// gathered through its slot's block table (tables + slot * blocks_per_slot), its output
// out + e * heads * dim. With rope_dim > 0 its rope query is q_rope + e * heads * rope_dim and the
// rope key of selected row r is rope_keys + (slot * slot_rows + r) * rope_dim (both BF16); with
// rope_dim = 0 neither is read. Padding entries read and write nothing (their output rows keep
// whatever they held), as does every entry for a rope_dim outside rope_dim_ok.
extern "C" __global__ void __launch_bounds__(256) sparse_mla_attend_batch(
    const float* __restrict__ q, const uint16_t* __restrict__ q_rope, const uint8_t* __restrict__ cache,
    const float* __restrict__ scales, const uint16_t* __restrict__ rope_keys, const uint32_t* __restrict__ tables,
    const uint32_t* __restrict__ selected, const uint32_t* __restrict__ count, uint16_t* __restrict__ out,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t slot_rows, uint32_t sel_cap, uint32_t heads,
    uint32_t dim, uint32_t rope_dim, uint32_t block_size, float scale) {
    __shared__ AttendSmem sm;
    const uint32_t e = blockIdx.y;
    if (e >= m || blockIdx.x >= heads || dim > MLA_MAX_DIM) return;
    // The count is the entry's scratch, not a sequence's state: loaded beside the entry (one
    // round trip), used only for a live one.
    const uint32_t n = min(count[e], sel_cap);
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return;
    const size_t hd = (size_t)heads * dim;
    const uint32_t* table = tables + (size_t)b.slot * blocks_per_slot(slot_rows, block_size);
    const uint32_t* sel = selected + (size_t)e * sel_cap;
    // rope_dim is uniform: the NoPE build has no rope instruction at all.
    if (rope_dim == 0u) {
        attend_head<false>(q + e * hd, q_rope, cache, scales, rope_keys, table, sel, n, out + e * hd, dim, 0u,
                           block_size, scale, sm);
    } else if (rope_dim_ok(rope_dim)) {
        attend_head<true>(q + e * hd, q_rope + (size_t)e * heads * rope_dim, cache, scales,
                          rope_keys + (size_t)b.slot * slot_rows * rope_dim, table, sel, n, out + e * hd, dim,
                          rope_dim, block_size, scale, sm);
    }
}

// ---- the split pair: sparse_mla_partial_batch + sparse_mla_combine_batch ------------------------
// Flash-decoding over the selection: block (x, y) takes rows [64 x, 64 x + 64) of the selection and
// heads [16 y, 16 y + 16), computes its local softmax statistics and its unnormalised partial
// output, and sparse_mla_combine_batch merges the ceil(count / 64) partials per head exactly
// (rescaling by exp(m_s - M)). Both products run on the tensor cores (mma.sync m16n8k16, BF16
// operands, f32 accumulation) without giving up f32 accuracy:
//   - the FP8 latent values are exact in BF16; the row scale is applied outside the product
//     (to the score, and folded into p for the output);
//   - q and p are f32: each is split into hi = bf16(v) and lo = bf16(v - hi), and both halves are
//     multiplied, which keeps about 16 mantissa bits (relative error ~2^-17 instead of BF16's 2^-9).
//   - the RoPE term needs neither: its operands are BF16 already, so one product per k-step is
//     exact up to the f32 accumulation.
// Shared memory (dynamic, launch helper): C tile [64][dim + 8] BF16, q hi/lo [16][dim + 8] BF16,
// scores [16][68] f32, p hi/lo [16][72] BF16, row slots and scales: the + 8 pitches put the 32-bit
// fragment loads of a warp on distinct banks; with rope_dim > 0 also the tile's selected rows (64
// u32). dim % 16 == 0 and dim <= 512 (8 n-tiles per warp).
#define MLA_RT 64
#define MLA_HT 16
#define MLA_NTW 8

namespace {
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint16_t bf16_hi_part(float v) { return f32_to_bf16_bits(v); }
__device__ __forceinline__ uint16_t bf16_lo_part(float v, uint16_t hi) {
    return f32_to_bf16_bits(__fsub_rn(v, bf16_bits_to_f32(hi)));
}

__device__ __forceinline__ uint32_t ld_u32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A lane's RoPE rows of a warp's score product: the key of its row (n = g) and the rope queries of
// heads g and g + 8, each with whether it exists (a row past the selection, a head past `heads`:
// zeros, nothing read). Read through the read-only path as q is: their writers must not release
// this kernel early (ptx/common.cuh).
struct RopeRows {
    const uint2* k;
    const uint2* q0;
    const uint2* q1;
    bool kv, qv0, qv1;
};
// One 16-wide k-step of them: A = {q0.x, q1.x, q0.y, q1.y}, B = {k.x, k.y}.
struct RopeFrag {
    uint2 k, q0, q1;
};

__device__ __forceinline__ RopeRows rope_rows(const uint16_t* __restrict__ q_rope, const uint16_t* __restrict__ rope_keys,
                                              uint32_t r, uint32_t h, uint32_t heads, uint32_t rope_dim) {
    return RopeRows{reinterpret_cast<const uint2*>(rope_keys + (size_t)(r != 0xFFFFFFFFu ? r : 0u) * rope_dim),
                    reinterpret_cast<const uint2*>(q_rope + (size_t)h * rope_dim),
                    reinterpret_cast<const uint2*>(q_rope + (size_t)(h + 8u) * rope_dim), r != 0xFFFFFFFFu,
                    h < heads, h + 8u < heads};
}

// Step k (~0u: none, all zeros) for lane t: the 8 bytes at 16 k + 4 t of each row.
__device__ __forceinline__ RopeFrag rope_frag(const RopeRows& rr, uint32_t k, uint32_t t) {
    const uint2 z = make_uint2(0u, 0u);
    const bool in = k != ~0u;
    const uint32_t i = 4u * k + t;
    return RopeFrag{in && rr.kv ? __ldg(rr.k + i) : z, in && rr.qv0 ? __ldg(rr.q0 + i) : z,
                    in && rr.qv1 ? __ldg(rr.q1 + i) : z};
}

__device__ __forceinline__ void rope_mma(float (&acc)[4], const RopeFrag& f) {
    const uint32_t a[4] = {f.q0.x, f.q1.x, f.q0.y, f.q1.y};
    mma_bf16(acc, a, f.k.x, f.k.y);
}
}  // namespace

namespace {
// The tile's work for latent width DIM (0: the runtime `dim_arg`). The kernel is bound by the
// latency of each warp's own instruction chain (8 warps per SM): with the width a runtime value the
// index arithmetic of the q and gather loops was integer division, the largest share of its
// instructions in Nsight Compute's samples; the GLM width 512 gets a build where it is shifts.
// ROPE: the scores add Q_rope[16 heads][rope_dim] . K_rope[8 rows][rope_dim]^T per warp (q_rope the
// entry's rows, rope_keys its slot's); without it the build is the NoPE kernel's, instruction for
// instruction.
template <uint32_t DIM, bool ROPE>
__device__ __forceinline__ void mla_partial_tile(
    const float* __restrict__ q, const uint16_t* __restrict__ q_rope, const uint8_t* __restrict__ cache,
    const float* __restrict__ scales, const uint16_t* __restrict__ rope_keys,
    const uint32_t* __restrict__ block_table, const uint32_t* __restrict__ selected, uint32_t n,
    float* __restrict__ part, float* __restrict__ ml, uint32_t heads, uint32_t dim_arg, uint32_t rope_dim,
    uint32_t block_size, float scale, uint8_t* smem) {
    const uint32_t dim = DIM ? DIM : dim_arg;
    const uint32_t j0 = blockIdx.x * MLA_RT, h0 = blockIdx.y * MLA_HT;
    if (j0 >= n || dim % 16u != 0 || dim > 64u * MLA_NTW) return;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const uint32_t dp = dim + 8u;               // BF16 pitch of C and q rows
    constexpr uint32_t SP = MLA_RT + 4u;        // f32 pitch of the score rows
    constexpr uint32_t PP = MLA_RT + 8u;        // BF16 pitch of the p rows
    uint16_t* cs = reinterpret_cast<uint16_t*>(smem);           // [RT][dp]
    uint16_t* qhi = cs + (size_t)MLA_RT * dp;                   // [HT][dp]
    uint16_t* qlo = qhi + (size_t)MLA_HT * dp;                  // [HT][dp]
    float* ss = reinterpret_cast<float*>(qlo + (size_t)MLA_HT * dp);  // [HT][SP]
    uint16_t* phi = reinterpret_cast<uint16_t*>(ss + MLA_HT * SP);    // [HT][PP]
    uint16_t* plo = phi + MLA_HT * PP;                                // [HT][PP]
    uint32_t* slot_s = reinterpret_cast<uint32_t*>(plo + MLA_HT * PP);  // [RT]
    float* sc_s = reinterpret_cast<float*>(slot_s + MLA_RT);           // [RT]
    float* m_s = sc_s + MLA_RT;                                         // [HT]
    float* l_s = m_s + MLA_HT;                                          // [HT]
    uint32_t* r_s = reinterpret_cast<uint32_t*>(l_s + MLA_HT);          // [RT], ROPE only

    const uint32_t nr = min((uint32_t)MLA_RT, n - j0);
    // q tile as float4, every load in flight before the first use: a loop that waits one L2 round
    // trip per element made this kernel several times slower (BENCHMARKS.md, "Drafter kernel
    // notes").
    constexpr int QL = 8;
    const uint32_t d4 = dim / 4u, nq4 = MLA_HT * d4;
    const float4* q4 = reinterpret_cast<const float4*>(q) + (size_t)h0 * d4;
    for (uint32_t base = 0; base < nq4; base += blockDim.x * QL) {
        float4 v[QL];
#pragma unroll
        for (int u = 0; u < QL; ++u) {
            const uint32_t i = base + tid + blockDim.x * u;
            v[u] = (i < nq4 && h0 + i / d4 < heads) ? __ldg(q4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        if (base == 0 && tid < MLA_RT) {  // the row slots, while the q loads are in flight
            uint32_t slot = 0xFFFFFFFFu, r = 0xFFFFFFFFu;
            float sc = 0.0f;
            if (tid < nr) {
                r = selected[j0 + tid];
                slot = block_table[r / block_size] * block_size + r % block_size;
                sc = scales[slot];
            }
            slot_s[tid] = slot;
            sc_s[tid] = sc;
            if (ROPE) r_s[tid] = r;
        }
#pragma unroll
        for (int u = 0; u < QL; ++u) {
            const uint32_t i = base + tid + blockDim.x * u;
            if (i >= nq4) continue;
            const uint32_t hh = i / d4, d = 4u * (i % d4);
            const float f[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
            uint16_t hi[4], lo[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                hi[e] = bf16_hi_part(f[e]);
                lo[e] = bf16_lo_part(f[e], hi[e]);
            }
            *reinterpret_cast<uint2*>(qhi + hh * dp + d) =
                make_uint2((uint32_t)hi[0] | ((uint32_t)hi[1] << 16), (uint32_t)hi[2] | ((uint32_t)hi[3] << 16));
            *reinterpret_cast<uint2*>(qlo + hh * dp + d) =
                make_uint2((uint32_t)lo[0] | ((uint32_t)lo[1] << 16), (uint32_t)lo[2] | ((uint32_t)lo[3] << 16));
        }
    }
    __syncthreads();
    // The RoPE operands straight into the score product's fragments, the first RKS k-steps issued
    // before the gather so that their round trip overlaps it (no shared memory: a tile there would
    // cost the second block per SM at dim 512). Lane (g, t) takes 8 bytes at 4 t of each 16-wide
    // k-step: the k order inside a step is permuted alike for Q and K (A's pairs t / t + 4 and B's
    // are the words .x / .y), which leaves the dot products as they are. Rows past the selection
    // and heads past `heads` are zeros. RKS = 4 covers the models' 64 (93 registers, 64 without the
    // RoPE builds); holding all of 128 took 119, so wider rope parts load their further steps at
    // the product.
    constexpr uint32_t RKS = 4;
    RopeFrag rf[RKS];
    RopeRows rr{};
    if (ROPE) {
        rr = rope_rows(q_rope, rope_keys, r_s[8u * warp + g], h0 + g, heads, rope_dim);
#pragma unroll
        for (uint32_t k = 0; k < RKS; ++k) rf[k] = rope_frag(rr, k < rope_dim / 16u ? k : ~0u, t);
    }
    // Gather the rows: 16 FP8 values per 16-byte load, all of a thread's loads issued first, then
    // widened exactly to BF16.
    constexpr int CL = 8;
    const uint32_t cpr = dim / 16u;
    for (uint32_t base = 0; base < MLA_RT * cpr; base += blockDim.x * CL) {
        uint4 v[CL];
#pragma unroll
        for (int u = 0; u < CL; ++u) {
            const uint32_t i = base + tid + blockDim.x * u;
            const uint32_t slot = i < MLA_RT * cpr ? slot_s[i / cpr] : 0xFFFFFFFFu;
            v[u] = slot != 0xFFFFFFFFu ? __ldg(reinterpret_cast<const uint4*>(cache + (size_t)slot * dim) + i % cpr)
                                       : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < CL; ++u) {
            const uint32_t i = base + tid + blockDim.x * u;
            if (i >= MLA_RT * cpr) continue;
            uint4 lo4, hi4;
            float f[4];
            fp8x4_to_f32(v[u].x, f); lo4.x = pack_bf16x2(f[0], f[1]); lo4.y = pack_bf16x2(f[2], f[3]);
            fp8x4_to_f32(v[u].y, f); lo4.z = pack_bf16x2(f[0], f[1]); lo4.w = pack_bf16x2(f[2], f[3]);
            fp8x4_to_f32(v[u].z, f); hi4.x = pack_bf16x2(f[0], f[1]); hi4.y = pack_bf16x2(f[2], f[3]);
            fp8x4_to_f32(v[u].w, f); hi4.z = pack_bf16x2(f[0], f[1]); hi4.w = pack_bf16x2(f[2], f[3]);
            uint4* dst = reinterpret_cast<uint4*>(cs + (size_t)(i / cpr) * dp + 16u * (i % cpr));
            dst[0] = lo4;
            dst[1] = hi4;
        }
    }
    __syncthreads();

    // Scores: warp w owns rows 8w..8w+7 (one n-tile); k runs over dim in steps of 16.
    {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        float racc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (ROPE) {
            const uint32_t nks = rope_dim / 16u;
#pragma unroll
            for (uint32_t k = 0; k < RKS; ++k)
                if (k < nks) rope_mma(racc, rf[k]);
            for (uint32_t k = RKS; k < nks; ++k) rope_mma(racc, rope_frag(rr, k, t));
        }
        const uint32_t rb = 8u * warp;
        for (uint32_t k0 = 0; k0 < dim; k0 += 16u) {
            uint32_t ah[4], al[4];
            ah[0] = ld_u32(qhi + g * dp + k0 + 2u * t);
            ah[1] = ld_u32(qhi + (g + 8u) * dp + k0 + 2u * t);
            ah[2] = ld_u32(qhi + g * dp + k0 + 8u + 2u * t);
            ah[3] = ld_u32(qhi + (g + 8u) * dp + k0 + 8u + 2u * t);
            al[0] = ld_u32(qlo + g * dp + k0 + 2u * t);
            al[1] = ld_u32(qlo + (g + 8u) * dp + k0 + 2u * t);
            al[2] = ld_u32(qlo + g * dp + k0 + 8u + 2u * t);
            al[3] = ld_u32(qlo + (g + 8u) * dp + k0 + 8u + 2u * t);
            const uint32_t b0 = ld_u32(cs + (rb + g) * dp + k0 + 2u * t);
            const uint32_t b1 = ld_u32(cs + (rb + g) * dp + k0 + 8u + 2u * t);
            mma_bf16(acc, ah, b0, b1);
            mma_bf16(acc, al, b0, b1);
        }
        const uint32_t r0 = rb + 2u * t, r1 = r0 + 1u;
        if (ROPE) {
            // (latent . q * row scale + rope) * scale: the row scale belongs to the latent term only.
            const float c0 = r0 < nr ? sc_s[r0] : 0.0f, c1 = r1 < nr ? sc_s[r1] : 0.0f;
            ss[g * SP + r0] = r0 < nr ? __fmul_rn(fmaf(acc[0], c0, racc[0]), scale) : -INFINITY;
            ss[g * SP + r1] = r1 < nr ? __fmul_rn(fmaf(acc[1], c1, racc[1]), scale) : -INFINITY;
            ss[(g + 8u) * SP + r0] = r0 < nr ? __fmul_rn(fmaf(acc[2], c0, racc[2]), scale) : -INFINITY;
            ss[(g + 8u) * SP + r1] = r1 < nr ? __fmul_rn(fmaf(acc[3], c1, racc[3]), scale) : -INFINITY;
        } else {
            const float f0 = r0 < nr ? __fmul_rn(sc_s[r0], scale) : 0.0f;
            const float f1 = r1 < nr ? __fmul_rn(sc_s[r1], scale) : 0.0f;
            ss[g * SP + r0] = r0 < nr ? acc[0] * f0 : -INFINITY;
            ss[g * SP + r1] = r1 < nr ? acc[1] * f1 : -INFINITY;
            ss[(g + 8u) * SP + r0] = r0 < nr ? acc[2] * f0 : -INFINITY;
            ss[(g + 8u) * SP + r1] = r1 < nr ? acc[3] * f1 : -INFINITY;
        }
    }
    __syncthreads();

    // Local softmax statistics: warp w owns heads 2w, 2w+1; lanes own rows lane, lane + 32.
    for (uint32_t hh = 2u * warp; hh < 2u * warp + 2u; ++hh) {
        const float v0 = ss[hh * SP + lane], v1 = ss[hh * SP + lane + 32u];
        const float m = warp_max(fmaxf(v0, v1));
        const float e0 = expf(v0 - m), e1 = expf(v1 - m);
        const float l = warp_sum(e0 + e1);
        // p carries the row's FP8 scale into the output product (c_j = fp8_j * scale_j).
        const float p0 = e0 * sc_s[lane], p1 = e1 * sc_s[lane + 32u];
        const uint16_t h0b = bf16_hi_part(p0), h1b = bf16_hi_part(p1);
        phi[hh * PP + lane] = h0b;
        phi[hh * PP + lane + 32u] = h1b;
        plo[hh * PP + lane] = bf16_lo_part(p0, h0b);
        plo[hh * PP + lane + 32u] = bf16_lo_part(p1, h1b);
        if (lane == 0) { m_s[hh] = m; l_s[hh] = l; }
    }
    __syncthreads();

    // Output: O[16 heads][dim] = P[16][64] . C[64][dim]; warp w owns n-tiles w, w + 8, ... (8 dims each).
    const uint32_t ntiles = dim / 8u;
    float acc[MLA_NTW][4];
#pragma unroll
    for (int i = 0; i < MLA_NTW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
    for (uint32_t r0 = 0; r0 < MLA_RT; r0 += 16u) {
        uint32_t ah[4], al[4];
        ah[0] = ld_u32(phi + g * PP + r0 + 2u * t);
        ah[1] = ld_u32(phi + (g + 8u) * PP + r0 + 2u * t);
        ah[2] = ld_u32(phi + g * PP + r0 + 8u + 2u * t);
        ah[3] = ld_u32(phi + (g + 8u) * PP + r0 + 8u + 2u * t);
        al[0] = ld_u32(plo + g * PP + r0 + 2u * t);
        al[1] = ld_u32(plo + (g + 8u) * PP + r0 + 2u * t);
        al[2] = ld_u32(plo + g * PP + r0 + 8u + 2u * t);
        al[3] = ld_u32(plo + (g + 8u) * PP + r0 + 8u + 2u * t);
#pragma unroll
        for (int i = 0; i < MLA_NTW; ++i) {
            const uint32_t nt = warp + 8u * i;
            if (nt < ntiles) {
                const uint32_t col = 8u * nt + g;
                const uint16_t* c0 = cs + (size_t)(r0 + 2u * t) * dp + col;
                const uint32_t b0 = (uint32_t)c0[0] | ((uint32_t)c0[dp] << 16);
                const uint32_t b1 = (uint32_t)c0[8u * dp] | ((uint32_t)c0[9u * dp] << 16);
                mma_bf16(acc[i], ah, b0, b1);
                mma_bf16(acc[i], al, b0, b1);
            }
        }
    }
    const uint32_t split = blockIdx.x;
#pragma unroll
    for (int i = 0; i < MLA_NTW; ++i) {
        const uint32_t nt = warp + 8u * i;
        if (nt >= ntiles) continue;
        const uint32_t d = 8u * nt + 2u * t;
        if (h0 + g < heads) {
            float* o = part + ((size_t)split * heads + h0 + g) * dim + d;
            o[0] = acc[i][0];
            o[1] = acc[i][1];
        }
        if (h0 + g + 8u < heads) {
            float* o = part + ((size_t)split * heads + h0 + g + 8u) * dim + d;
            o[0] = acc[i][2];
            o[1] = acc[i][3];
        }
    }
    if (tid < MLA_HT && h0 + tid < heads) {
        ml[((size_t)split * heads + h0 + tid) * 2u] = m_s[tid];
        ml[((size_t)split * heads + h0 + tid) * 2u + 1u] = l_s[tid];
    }
}
}  // namespace

// The split pair for m batch entries: the per-entry workspace of a selection of at most sel_cap
// rows is splits = max(ceil(sel_cap / 64), 1) partials, part + e * splits * heads * dim and
// ml + e * splits * heads * 2 (model/kernels/sparse_mla.py split_workspace_batch).
namespace {
__device__ __forceinline__ uint32_t batch_splits(uint32_t sel_cap) {
    return max((sel_cap + MLA_RT - 1u) / MLA_RT, 1u);
}
}  // namespace

// Grid (splits, ceil(heads / 16), m), blockIdx.z = entry e; the tile of (split, head tile) of entry
// e is mla_partial_tile on e's query, selection (count[e]
// rows, at most sel_cap) and slot's block table, into e's workspace; its rope query and keys are
// addressed as in sparse_mla_attend_batch (not read for rope_dim = 0). Splits past the count and
// padding entries exit (padding reads and writes nothing), as does every tile for a rope_dim
// outside rope_dim_ok.
extern "C" __global__ void __launch_bounds__(256) sparse_mla_partial_batch(
    const float* __restrict__ q, const uint16_t* __restrict__ q_rope, const uint8_t* __restrict__ cache,
    const float* __restrict__ scales, const uint16_t* __restrict__ rope_keys, const uint32_t* __restrict__ tables,
    const uint32_t* __restrict__ selected, const uint32_t* __restrict__ count, float* __restrict__ part,
    float* __restrict__ ml, const uint32_t* __restrict__ entries, uint32_t m, uint32_t slot_rows, uint32_t sel_cap,
    uint32_t heads, uint32_t dim, uint32_t rope_dim, uint32_t block_size, float scale) {
    extern __shared__ __align__(16) uint8_t smem[];
    wait_then_release();
    const uint32_t e = blockIdx.z;
    if (e >= m) return;
    const uint32_t n = min(count[e], sel_cap);  // beside the entry's load, as in sparse_mla_attend_batch
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return;
    const size_t hd = (size_t)heads * dim, splits = batch_splits(sel_cap);
    const float* qe = q + e * hd;
    const uint32_t* table = tables + (size_t)b.slot * blocks_per_slot(slot_rows, block_size);
    const uint32_t* sel = selected + (size_t)e * sel_cap;
    float* pe = part + e * splits * hd;
    float* me = ml + e * splits * heads * 2u;
    // rope_dim is uniform: the NoPE builds have no rope instruction at all.
    if (rope_dim == 0u) {
        if (dim == 512u)
            mla_partial_tile<512, false>(qe, q_rope, cache, scales, rope_keys, table, sel, n, pe, me, heads, dim, 0u,
                                         block_size, scale, smem);
        else
            mla_partial_tile<0, false>(qe, q_rope, cache, scales, rope_keys, table, sel, n, pe, me, heads, dim, 0u,
                                       block_size, scale, smem);
    } else if (rope_dim_ok(rope_dim)) {
        const uint16_t* qre = q_rope + (size_t)e * heads * rope_dim;
        const uint16_t* kre = rope_keys + (size_t)b.slot * slot_rows * rope_dim;
        if (dim == 512u)
            mla_partial_tile<512, true>(qe, qre, cache, scales, kre, table, sel, n, pe, me, heads, dim, rope_dim,
                                        block_size, scale, smem);
        else
            mla_partial_tile<0, true>(qe, qre, cache, scales, kre, table, sel, n, pe, me, heads, dim, rope_dim,
                                      block_size, scale, smem);
    }
}

// out[h] = sum_s exp(m_s - M) part_s[h] / sum_s exp(m_s - M) l_s, M = max_s m_s, over the
// ceil(count / 64) splits sparse_mla_partial_batch wrote. Grid (heads, ceil(dim / 128)), block 256: lane
// l owns dims 128 y + 4 l .. + 3, warp w sums splits w, w + 8, ... with four splits' loads in flight
// (33 splits: two rounds instead of five), and the eight warp sums are added in warp order through
// shared memory. Every warp computes M and L itself over the same splits in the same order, from
// the head's (m, l) pairs staged once in shared memory. dim % 4 == 0 (the split pair takes
// dim % 16 == 0). The merge is latency-bound: eight warps per head, not one block of 128 threads
// with eight splits in flight per thread (BENCHMARKS.md, "Drafter kernel notes").
#define MLA_MAX_SPLITS 1024
namespace {
constexpr int WARPS_C = 8, SL = 4;
struct CombineSmem {
    float4 acc_s[WARPS_C][32];
    // This head's (m, l) of every split, read once per block through L2 (the partials kernel
    // releases its dependents early, ptx/common.cuh), not per warp and per round, which made the
    // merge about twice as slow (BENCHMARKS.md, "Drafter kernel notes").
    float2 ml_s[MLA_MAX_SPLITS];
};

// Head blockIdx.x, dims 128 blockIdx.y + 4 lane of one sequence's n-row selection, whichever
// kernel calls it.
__device__ __forceinline__ void combine_head(const float* __restrict__ part, const float* __restrict__ ml,
                                             uint32_t n, uint16_t* __restrict__ out, uint32_t heads, uint32_t dim,
                                             CombineSmem& sm) {
    float4(*acc_s)[32] = sm.acc_s;
    float2* ml_s = sm.ml_s;
    const uint32_t h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t splits = min((n + MLA_RT - 1u) / MLA_RT, (uint32_t)MLA_MAX_SPLITS);
    for (uint32_t s = threadIdx.x; s < splits; s += blockDim.x)
        ml_s[s] = __ldcg(reinterpret_cast<const float2*>(ml) + (size_t)s * heads + h);
    __syncthreads();
    float M = -INFINITY;
    for (uint32_t s = lane; s < splits; s += 32u) M = fmaxf(M, ml_s[s].x);
    M = warp_max(M);
    float L = 0.0f;
    for (uint32_t s = lane; s < splits; s += 32u) {
        const float2 v = ml_s[s];
        L = fmaf(v.y, expf(v.x - M), L);
    }
    L = warp_sum(L);
    const uint32_t d = blockIdx.y * 128u + 4u * lane;
    const size_t stride = (size_t)heads * dim;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (d < dim) {
        const float* p = part + (size_t)h * dim + d;
        for (uint32_t s0 = warp; s0 < splits; s0 += WARPS_C * SL) {
            float4 v[SL];
            float w[SL];
#pragma unroll
            for (int u = 0; u < SL; ++u) {
                const uint32_t s = s0 + WARPS_C * u;
                v[u] = s < splits ? __ldcg(reinterpret_cast<const float4*>(p + s * stride)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                w[u] = s < splits ? ml_s[s].x : -INFINITY;
            }
#pragma unroll
            for (int u = 0; u < SL; ++u) {
                const float e = s0 + WARPS_C * u < splits ? expf(w[u] - M) : 0.0f;
                o.x = fmaf(v[u].x, e, o.x);
                o.y = fmaf(v[u].y, e, o.y);
                o.z = fmaf(v[u].z, e, o.z);
                o.w = fmaf(v[u].w, e, o.w);
            }
        }
    }
    acc_s[warp][lane] = o;
    __syncthreads();
    if (warp != 0 || d >= dim) return;
    float4 r = acc_s[0][lane];
#pragma unroll
    for (int w = 1; w < WARPS_C; ++w) {
        const float4 a = acc_s[w][lane];
        r.x = __fadd_rn(r.x, a.x);
        r.y = __fadd_rn(r.y, a.y);
        r.z = __fadd_rn(r.z, a.z);
        r.w = __fadd_rn(r.w, a.w);
    }
    if (splits == 0u) r = make_float4(0.0f, 0.0f, 0.0f, 0.0f), L = 1.0f;  // empty selection: zero
    *reinterpret_cast<uint2*>(out + (size_t)h * dim + d) = make_uint2(pack_bf16x2(r.x / L, r.y / L),
                                                                     pack_bf16x2(r.z / L, r.w / L));
}
}  // namespace

// The merge for m entries: grid (heads, ceil(dim / 128), m), blockIdx.z = entry e, over
// e's workspace (batch_splits above) and count[e] (at most sel_cap), into out + e * heads * dim.
// Padding entries read and write nothing.
extern "C" __global__ void __launch_bounds__(256) sparse_mla_combine_batch(
    const float* __restrict__ part, const float* __restrict__ ml, const uint32_t* __restrict__ count,
    uint16_t* __restrict__ out, const uint32_t* __restrict__ entries, uint32_t m, uint32_t sel_cap, uint32_t heads,
    uint32_t dim) {
    __shared__ CombineSmem sm;
    wait_then_release();
    const uint32_t e = blockIdx.z;
    if (e >= m || blockIdx.x >= heads || dim % 4u != 0) return;
    const uint32_t n = min(count[e], sel_cap);  // beside the entry's load, as in sparse_mla_attend_batch
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return;
    const size_t hd = (size_t)heads * dim, splits = batch_splits(sel_cap);
    combine_head(part + e * splits * hd, ml + e * splits * heads * 2u, n, out + e * hd, heads, dim, sm);
}

// ---- the wide pair: sparse_mla_partial_wide_batch + sparse_mla_combine_wide_batch ---------------
// The split pair above for proposers of many sequences. Where the pair's time went (H200, one
// propose of 3 drafts, 2048 selected rows, 64 heads, latent 512, kernels timed without PDL): at
// 256 sequences partial 4.449 ms + combine 1.118 ms, at 64 (rope 64) 1.231 + 0.285 ms. Its tile of
// 64 rows x 16 heads gathers and widens every selected row once per 16 heads (4 times at 64 heads,
// 8 at 128), and its f32 partials are 32 splits x 64 heads x 512 x 4 B = 4 MB per sequence and
// draft, written and read back by the merge (1 GB per draft at 256 sequences), while the products
// themselves (QK and PV with the hi/lo halves) are about 0.5 GFLOP per sequence and draft.
//
// Block (split, head group, entry), 256 threads, one block per SM (its shared memory, below): the
// split is `split_rows` rows (64 to 256, a multiple of 64; the launch helper's argument, chosen per
// proposer, never per batch), the head group 64 heads (128 heads: two groups, each row gathered
// twice instead of 8 times). The split's 64-row tiles run in turn with an online softmax:
//   - the block's q (64 heads, hi/lo BF16 halves as above) is staged in shared memory once, and
//     every row of the split is gathered and widened once (FP8 -> BF16, exact);
//   - scores: warp w takes heads 16 (w % 4) .. + 16 and the tile's rows 32 (w / 4) .. + 32
//     (four 8-row n-tiles), operands through ldmatrix; with the RoPE term a second product per
//     n-tile on the rope keys' tile (BF16, one product per k-step) and the head's rope query held
//     in registers for the whole split;
//   - softmax: the two warps of a head tile exchange their tile maxima through shared memory; each
//     then updates the same running max m, rescales its own share of the output and its own share
//     of the sum l (the two shares are added once at the end) and writes p = exp(s - m) * row
//     scale as hi/lo BF16 halves;
//   - output: warp w accumulates O for its 16 heads over dims 16 (2 i + w / 4) .. + 16 (i < 16:
//     half of the 512 dims, 128 f32 registers), B from the BF16 tile through ldmatrix.trans; the
//     next tile's rows are loaded into registers during this product (they are stored once it
//     is done: shared memory has no room for a second tile).
// The partials are then split_rows / 64 times fewer: at 256 rows 8 splits, 1 MB per sequence and
// draft. The per-split result is the pair's (unnormalised output, max, sum) over the split's rows,
// which sparse_mla_combine_wide_batch merges as sparse_mla_combine_batch does (per head, exp(m_s - M)
// in split order).
// Shared memory (pitches of the widest rows whatever the width, + 8 BF16 for conflict-free
// ldmatrix rows): q hi/lo [64][520] x 2, C [64][520], p hi/lo [64][72] x 2 (BF16), the rope keys'
// tile [64][72] (RoPE only), the split's row slots and scales (and rows, RoPE), the two warps'
// maxima [2][64]: 230912 bytes with rope, 256 rows (227 KB is the limit), so one block per SM, and
// its 255 registers are the SM's. A tile is 4096 MMAs (QK and PV, hi and lo: 64 heads x 64 rows x
// 512 x 2 x 2 / 4096 per m16n8k16) and 800 KB of ldmatrix reads; the floor at 256 sequences is
// about 0.2 ms per draft on the H200 (mma.sync at some 60% of the tensor peak).
// rope_dim: 0 or a multiple of 16 up to 64 (one tile of rope keys; the pair above takes 128).
#define MLA_WH 64
#define MLA_WMAX_SPLIT 256
#define MLA_WMAX_ROPE 64
#define MLA_WPP (MLA_RT + 8)
#define MLA_WDP (512 + 8)
#define MLA_WRP (MLA_WMAX_ROPE + 8)

namespace {
__device__ __forceinline__ bool wide_split_ok(uint32_t split_rows) {
    return split_rows % MLA_RT == 0 && split_rows >= MLA_RT && split_rows <= MLA_WMAX_SPLIT;
}
__device__ __forceinline__ bool wide_rope_ok(uint32_t rope_dim) {
    return rope_dim % 16u == 0 && rope_dim <= MLA_WMAX_ROPE;
}
// Partials per entry of the wide pair's workspace (model/kernels/sparse_mla.py wide_splits).
__device__ __forceinline__ uint32_t wide_splits(uint32_t sel_cap, uint32_t split_rows) {
    return max((sel_cap + split_rows - 1u) / split_rows, 1u);
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const uint16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void mma_w(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_bf16_16816(d, a[0], a[1], a[2], a[3], b0, b1);
}

// 16 E4M3 bytes -> 16 BF16 (exact), as two 16-byte words.
__device__ __forceinline__ void widen16(uint4 v, uint4& lo, uint4& hi) {
    e4m3x4_to_bf16x2(v.x, lo.x, lo.y);
    e4m3x4_to_bf16x2(v.y, lo.z, lo.w);
    e4m3x4_to_bf16x2(v.z, hi.x, hi.y);
    e4m3x4_to_bf16x2(v.w, hi.z, hi.w);
}

__device__ __forceinline__ uint32_t pack_hi_lo(float a, float b, uint32_t& lo) {
    const uint16_t ha = bf16_hi_part(a), hb = bf16_hi_part(b);
    lo = (uint32_t)bf16_lo_part(a, ha) | ((uint32_t)bf16_lo_part(b, hb) << 16);
    return (uint32_t)ha | ((uint32_t)hb << 16);
}

// One split of one head group (DIM: 512, or 0 for the runtime `dim_arg`), the file comment above.
template <uint32_t DIM, bool ROPE>
__device__ __forceinline__ void mla_wide_split(
    const float* __restrict__ q, const uint16_t* __restrict__ q_rope, const uint8_t* __restrict__ cache,
    const float* __restrict__ scales, const uint16_t* __restrict__ rope_keys,
    const uint32_t* __restrict__ block_table, const uint32_t* __restrict__ selected, uint32_t n,
    float* __restrict__ part, float* __restrict__ ml, uint32_t heads, uint32_t dim_arg, uint32_t rope_dim,
    uint32_t block_size, float scale, uint32_t split_rows, uint8_t* smem) {
    const uint32_t dim = DIM ? DIM : dim_arg;
    const uint32_t split = blockIdx.x, j0 = split * split_rows, hg = blockIdx.y * MLA_WH;
    if (j0 >= n || hg >= heads) return;
    const uint32_t ns = min(split_rows, n - j0);  // the split's rows
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const uint32_t mt = warp & 3u, half = warp >> 2;
    const uint32_t hm = hg + 16u * mt;  // the warp's first head
    const bool live = hm < heads;       // a head tile past the model's heads computes nothing
    // Pitches fixed for every width (the widest's): a runtime pitch made the row addresses values
    // that ptxas kept in registers, and spilled.
    constexpr uint32_t dp = MLA_WDP, rp = MLA_WRP, PP = MLA_WPP;
    uint16_t* qhi = reinterpret_cast<uint16_t*>(smem);  // [WH][dp]
    uint16_t* qlo = qhi + (size_t)MLA_WH * dp;          // [WH][dp]
    uint16_t* cs = qlo + (size_t)MLA_WH * dp;           // [RT][dp]
    uint16_t* phi = cs + (size_t)MLA_RT * dp;           // [WH][PP]
    uint16_t* plo = phi + MLA_WH * PP;                  // [WH][PP]
    uint16_t* krs = plo + MLA_WH * PP;                  // [RT][rp], ROPE only
    uint32_t* slot_s = reinterpret_cast<uint32_t*>(krs + (ROPE ? MLA_RT * rp : 0u));  // [split_rows]
    float* sc_s = reinterpret_cast<float*>(slot_s + split_rows);                       // [split_rows]
    float* red = sc_s + split_rows;                                                    // [2][WH]
    uint32_t* r_s = reinterpret_cast<uint32_t*>(red + 2 * MLA_WH);                     // [split_rows], ROPE

    // q as hi/lo halves, every float4 of a round in flight before its first use (as the pair
    // above); the split's row slots (one row per thread) while the first round is in flight. Warp w
    // takes heads w, w + 8, ..., lane l the float4s l, l + 32, ... of a head (no division by a
    // runtime width).
    constexpr int QL = 16;
    const uint32_t d4 = dim / 4u;
    const float4* q4 = reinterpret_cast<const float4*>(q) + (size_t)hg * d4;
    for (uint32_t base = 0; base < MLA_WH / 8u * 4u; base += QL) {  // the warp's (head, quarter of a row) pairs
        float4 v[QL];
#pragma unroll
        for (int u = 0; u < QL; ++u) {
            const uint32_t hh = warp + 8u * ((base + u) >> 2), c = lane + 32u * ((base + u) & 3u);
            v[u] = c < d4 && hg + hh < heads ? __ldg(q4 + (size_t)hh * d4 + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        if (base == 0 && tid < split_rows) {
            uint32_t slot = 0xFFFFFFFFu, r = 0xFFFFFFFFu;
            float sc = 0.0f;
            if (tid < ns) {
                r = selected[j0 + tid];
                slot = block_table[r / block_size] * block_size + r % block_size;
                sc = scales[slot];
            }
            slot_s[tid] = slot;
            sc_s[tid] = sc;
            if (ROPE) r_s[tid] = r;
        }
#pragma unroll
        for (int u = 0; u < QL; ++u) {
            const uint32_t hh = warp + 8u * ((base + u) >> 2), c = lane + 32u * ((base + u) & 3u);
            if (c >= d4) continue;
            uint32_t l0, l1;
            const uint32_t h0 = pack_hi_lo(v[u].x, v[u].y, l0), h1 = pack_hi_lo(v[u].z, v[u].w, l1);
            *reinterpret_cast<uint2*>(qhi + hh * dp + 4u * c) = make_uint2(h0, h1);
            *reinterpret_cast<uint2*>(qlo + hh * dp + 4u * c) = make_uint2(l0, l1);
        }
    }
    // The rope query of heads hm + g and hm + g + 8 (the score product's A fragments; past `heads`
    // zeros), read at each tile's score product through L1: held in registers for the whole split
    // they cost the output product registers it spilled without.
    const uint32_t* rq0 = reinterpret_cast<const uint32_t*>(q_rope + (size_t)(hm + g) * rope_dim);
    const uint32_t* rq1 = reinterpret_cast<const uint32_t*>(q_rope + (size_t)(hm + g + 8u) * rope_dim);
    const bool rv0 = ROPE && hm + g < heads, rv1 = ROPE && hm + g + 8u < heads;
    __syncthreads();

    // A tile's rows in registers: warp w the rows w, w + 8, ..., lane l the 16 FP8 at 16 l of each
    // (dim / 16 <= 32 lanes); the rope keys 8 BF16 per load, thread i the rows i / 8, i / 8 + 32 at
    // 8 (i % 8) (rope_dim / 8 <= 8). Rows past the split are zeros.
    constexpr int CL = MLA_RT / 8, KL = 2;
    const uint32_t kr_row = tid >> 3, kr_c = tid & 7u;
    const bool c_in = lane < dim / 16u, k_in = kr_c < rope_dim / 8u;
    uint4 cv[CL], kv[KL];
    auto fetch = [&](uint32_t tile) {
#pragma unroll
        for (int u = 0; u < CL; ++u) {
            const uint32_t jr = MLA_RT * tile + warp + 8u * u;
            cv[u] = c_in && jr < ns ? ld_stream16(reinterpret_cast<const uint4*>(cache + (size_t)slot_s[jr] * dim) + lane)
                                    : make_uint4(0u, 0u, 0u, 0u);
        }
        if (ROPE) {
#pragma unroll
            for (int u = 0; u < KL; ++u) {
                const uint32_t jr = MLA_RT * tile + kr_row + 32u * u;
                kv[u] = k_in && jr < ns ? __ldg(reinterpret_cast<const uint4*>(rope_keys + (size_t)r_s[jr] * rope_dim) + kr_c)
                                        : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    auto store = [&]() {
        if (c_in) {
#pragma unroll
            for (int u = 0; u < CL; ++u) {
                uint4 lo, hi;
                widen16(cv[u], lo, hi);
                uint4* dst = reinterpret_cast<uint4*>(cs + (warp + 8u * u) * dp + 16u * lane);
                dst[0] = lo;
                dst[1] = hi;
            }
        }
        if (ROPE && k_in) {
#pragma unroll
            for (int u = 0; u < KL; ++u) *reinterpret_cast<uint4*>(krs + (kr_row + 32u * u) * rp + 8u * kr_c) = kv[u];
        }
    };

    // ldmatrix row addresses of lane `lane`: A (16 x 16, row-major) rows lane % 16, columns
    // 8 (lane / 16); B of the scores (rows of C / of the rope keys, k contiguous) rows
    // lane % 8 + 8 (lane / 16), columns 8 (lane / 8 % 2); B of the output (C k-major, .trans)
    // rows lane % 8 + 8 (lane / 8 % 2), columns 8 (lane / 16).
    const uint32_t a_off = (16u * mt + (lane & 15u)) * dp + 8u * (lane >> 4);
    const uint32_t pa_off = (16u * mt + (lane & 15u)) * PP + 8u * (lane >> 4);
    const uint32_t sb_row = 32u * half + (lane & 7u) + 8u * (lane >> 4), sb_col = 8u * ((lane >> 3) & 1u);
    const uint32_t ob_off = ((lane & 7u) + 8u * ((lane >> 3) & 1u)) * dp + 8u * (lane >> 4) + 16u * half;

    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // heads hm + g, hm + g + 8
    const uint32_t tiles = (ns + MLA_RT - 1u) / MLA_RT;
    fetch(0);
    for (uint32_t tile = 0; tile < tiles; ++tile) {
        store();
        __syncthreads();
        float s[4][4];  // n-tile j: rows 32 half + 8 j + 2 t (+1), heads g (0, 1) and g + 8 (2, 3)
        float mx0 = -INFINITY, mx1 = -INFINITY;
        if (live) {
            float acc[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
            const uint16_t* cb = cs + sb_row * dp + sb_col;
#pragma unroll 4
            for (uint32_t k0 = 0; k0 < dim; k0 += 16u) {
                uint32_t ah[4], al[4], b01[4], b23[4];
                ldsm_x4(ah, qhi + a_off + k0);
                ldsm_x4(al, qlo + a_off + k0);
                ldsm_x4(b01, cb + k0);
                ldsm_x4(b23, cb + 16u * dp + k0);
                mma_w(acc[0], ah, b01[0], b01[1]);
                mma_w(acc[1], ah, b01[2], b01[3]);
                mma_w(acc[2], ah, b23[0], b23[1]);
                mma_w(acc[3], ah, b23[2], b23[3]);
                mma_w(acc[0], al, b01[0], b01[1]);
                mma_w(acc[1], al, b01[2], b01[3]);
                mma_w(acc[2], al, b23[0], b23[1]);
                mma_w(acc[3], al, b23[2], b23[3]);
            }
            float racc[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) racc[j][0] = racc[j][1] = racc[j][2] = racc[j][3] = 0.0f;
            if (ROPE) {
                uint32_t rq[MLA_WMAX_ROPE / 16][4];
#pragma unroll
                for (uint32_t k = 0; k < MLA_WMAX_ROPE / 16; ++k) {
                    const bool in = 16u * k < rope_dim;
                    rq[k][0] = in && rv0 ? __ldg(rq0 + 8u * k + t) : 0u;
                    rq[k][1] = in && rv1 ? __ldg(rq1 + 8u * k + t) : 0u;
                    rq[k][2] = in && rv0 ? __ldg(rq0 + 8u * k + 4u + t) : 0u;
                    rq[k][3] = in && rv1 ? __ldg(rq1 + 8u * k + 4u + t) : 0u;
                }
                const uint16_t* kb = krs + sb_row * rp + sb_col;
#pragma unroll
                for (uint32_t k = 0; k < MLA_WMAX_ROPE / 16; ++k) {
                    if (16u * k >= rope_dim) continue;
                    uint32_t b01[4], b23[4];
                    ldsm_x4(b01, kb + 16u * k);
                    ldsm_x4(b23, kb + 16u * rp + 16u * k);
                    mma_w(racc[0], rq[k], b01[0], b01[1]);
                    mma_w(racc[1], rq[k], b01[2], b01[3]);
                    mma_w(racc[2], rq[k], b23[0], b23[1]);
                    mma_w(racc[3], rq[k], b23[2], b23[3]);
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const uint32_t jr = MLA_RT * tile + 32u * half + 8u * j + 2u * t + c;
                    const bool in = jr < ns;
                    const float sc = in ? sc_s[jr] : 0.0f;
                    if (ROPE) {
                        // (latent . q * row scale + rope) * scale: the row scale is the latent term's.
                        s[j][c] = in ? __fmul_rn(fmaf(acc[j][c], sc, racc[j][c]), scale) : -INFINITY;
                        s[j][2 + c] = in ? __fmul_rn(fmaf(acc[j][2 + c], sc, racc[j][2 + c]), scale) : -INFINITY;
                    } else {
                        const float f = __fmul_rn(sc, scale);
                        s[j][c] = in ? acc[j][c] * f : -INFINITY;
                        s[j][2 + c] = in ? acc[j][2 + c] * f : -INFINITY;
                    }
                    mx0 = fmaxf(mx0, s[j][c]);
                    mx1 = fmaxf(mx1, s[j][2 + c]);
                }
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xFFFFFFFFu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xFFFFFFFFu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xFFFFFFFFu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xFFFFFFFFu, mx1, 2));
            if (t == 0) {
                red[half * MLA_WH + 16u * mt + g] = mx0;
                red[half * MLA_WH + 16u * mt + g + 8u] = mx1;
            }
        }
        __syncthreads();
        if (live) {
            // Both warps of the head tile take the tile's max in the same order: the same m, the
            // same rescale of their shares.
            const float n0 = fmaxf(m0, fmaxf(red[16u * mt + g], red[MLA_WH + 16u * mt + g]));
            const float n1 = fmaxf(m1, fmaxf(red[16u * mt + g + 8u], red[MLA_WH + 16u * mt + g + 8u]));
            const float c0 = expf(m0 - n0), c1 = expf(m1 - n1);  // 0 at the first tile (m = -inf)
            m0 = n0;
            m1 = n1;
            float e0 = 0.0f, e1 = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float p[4];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const uint32_t jr = MLA_RT * tile + 32u * half + 8u * j + 2u * t + c;
                    const float sc = jr < ns ? sc_s[jr] : 0.0f;
                    const float x0 = expf(s[j][c] - n0), x1 = expf(s[j][2 + c] - n1);
                    e0 += x0;
                    e1 += x1;
                    // p carries the row's FP8 scale into the output product (c_j = fp8_j * scale_j).
                    p[c] = x0 * sc;
                    p[2 + c] = x1 * sc;
                }
                const uint32_t col = 32u * half + 8u * j + 2u * t;
                uint32_t lo0, lo1;
                const uint32_t hi0 = pack_hi_lo(p[0], p[1], lo0), hi1 = pack_hi_lo(p[2], p[3], lo1);
                *reinterpret_cast<uint32_t*>(phi + (16u * mt + g) * PP + col) = hi0;
                *reinterpret_cast<uint32_t*>(plo + (16u * mt + g) * PP + col) = lo0;
                *reinterpret_cast<uint32_t*>(phi + (16u * mt + g + 8u) * PP + col) = hi1;
                *reinterpret_cast<uint32_t*>(plo + (16u * mt + g + 8u) * PP + col) = lo1;
            }
            l0 = fmaf(l0, c0, e0);
            l1 = fmaf(l1, c1, e1);
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                o[i][0] *= c0;
                o[i][1] *= c0;
                o[i][2] *= c1;
                o[i][3] *= c1;
            }
        }
        __syncthreads();
        if (tile + 1u < tiles) fetch(tile + 1u);  // in flight during the output product
        if (live) {
#pragma unroll 1
            for (uint32_t k0 = 0; k0 < MLA_RT; k0 += 16u) {
                uint32_t ah[4], al[4];
                ldsm_x4(ah, phi + pa_off + k0);
                ldsm_x4(al, plo + pa_off + k0);
                const uint16_t* cb = cs + ob_off + k0 * dp;
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    if (!DIM && 16u * (2u * i + half) >= dim) continue;
                    uint32_t b[4];
                    ldsm_x4_t(b, cb + 32u * i);
                    mma_w(o[2 * i], ah, b[0], b[1]);
                    mma_w(o[2 * i + 1], ah, b[2], b[3]);
                    mma_w(o[2 * i], al, b[0], b[1]);
                    mma_w(o[2 * i + 1], al, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }

    // The sum: each lane's share over its rows, then the four lanes of a head, then the two warps.
    if (live) {
        l0 += __shfl_xor_sync(0xFFFFFFFFu, l0, 1);
        l0 += __shfl_xor_sync(0xFFFFFFFFu, l0, 2);
        l1 += __shfl_xor_sync(0xFFFFFFFFu, l1, 1);
        l1 += __shfl_xor_sync(0xFFFFFFFFu, l1, 2);
        if (t == 0) {
            red[half * MLA_WH + 16u * mt + g] = l0;
            red[half * MLA_WH + 16u * mt + g + 8u] = l1;
        }
    }
    __syncthreads();
    if (!live) return;
    const uint32_t h0 = hm + g, h1 = hm + g + 8u;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const uint32_t d = 16u * (2u * (i >> 1) + half) + 8u * (i & 1) + 2u * t;
        if (!DIM && d >= dim) continue;
        if (h0 < heads)
            *reinterpret_cast<float2*>(part + ((size_t)split * heads + h0) * dim + d) = make_float2(o[i][0], o[i][1]);
        if (h1 < heads)
            *reinterpret_cast<float2*>(part + ((size_t)split * heads + h1) * dim + d) = make_float2(o[i][2], o[i][3]);
    }
    if (half == 0 && t == 0) {
        if (h0 < heads)
            *reinterpret_cast<float2*>(ml + ((size_t)split * heads + h0) * 2u) =
                make_float2(m0, red[16u * mt + g] + red[MLA_WH + 16u * mt + g]);
        if (h1 < heads)
            *reinterpret_cast<float2*>(ml + ((size_t)split * heads + h1) * 2u) =
                make_float2(m1, red[16u * mt + g + 8u] + red[MLA_WH + 16u * mt + g + 8u]);
    }
}
}  // namespace

// Grid (wide_splits(sel_cap, split_rows), ceil(heads / 64), m), block 256, blockIdx.z = entry e:
// the split blockIdx.x of e's selection (count[e] rows, at most sel_cap) for heads
// 64 blockIdx.y .. + 64, into e's workspace: part + e * splits * heads * dim ([split][head][dim]
// f32, unnormalised) and ml + e * splits * heads * 2 ((max, sum) per split and head). Addressed
// as sparse_mla_partial_batch otherwise (q, q_rope, the slot's block table and rope keys).
// Splits past the count and padding entries exit (padding reads and writes nothing), as does every
// block for a split_rows, rope_dim or dim the kernel does not take (wide_split_ok, wide_rope_ok,
// dim % 16 == 0 and 16 <= dim <= 512).
extern "C" __global__ void __launch_bounds__(256, 1) sparse_mla_partial_wide_batch(
    const float* __restrict__ q, const uint16_t* __restrict__ q_rope, const uint8_t* __restrict__ cache,
    const float* __restrict__ scales, const uint16_t* __restrict__ rope_keys, const uint32_t* __restrict__ tables,
    const uint32_t* __restrict__ selected, const uint32_t* __restrict__ count, float* __restrict__ part,
    float* __restrict__ ml, const uint32_t* __restrict__ entries, uint32_t m, uint32_t slot_rows, uint32_t sel_cap,
    uint32_t heads, uint32_t dim, uint32_t rope_dim, uint32_t block_size, float scale, uint32_t split_rows) {
    extern __shared__ __align__(16) uint8_t smem[];
    wait_then_release();
    const uint32_t e = blockIdx.z;
    if (e >= m || blockDim.x != 256u || !wide_split_ok(split_rows) || !wide_rope_ok(rope_dim) || dim % 16u != 0 ||
        dim == 0 || dim > 512u)
        return;
    const uint32_t n = min(count[e], sel_cap);  // beside the entry's load, as in sparse_mla_attend_batch
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return;
    const size_t hd = (size_t)heads * dim, splits = wide_splits(sel_cap, split_rows);
    const float* qe = q + e * hd;
    const uint32_t* table = tables + (size_t)b.slot * blocks_per_slot(slot_rows, block_size);
    const uint32_t* sel = selected + (size_t)e * sel_cap;
    float* pe = part + e * splits * hd;
    float* me = ml + e * splits * heads * 2u;
    // rope_dim is uniform: the NoPE builds have no rope instruction at all.
    if (rope_dim == 0u) {
        if (dim == 512u)
            mla_wide_split<512, false>(qe, q_rope, cache, scales, rope_keys, table, sel, n, pe, me, heads, dim, 0u,
                                       block_size, scale, split_rows, smem);
        else
            mla_wide_split<0, false>(qe, q_rope, cache, scales, rope_keys, table, sel, n, pe, me, heads, dim, 0u,
                                     block_size, scale, split_rows, smem);
    } else {
        const uint16_t* qre = q_rope + (size_t)e * heads * rope_dim;
        const uint16_t* kre = rope_keys + (size_t)b.slot * slot_rows * rope_dim;
        if (dim == 512u)
            mla_wide_split<512, true>(qe, qre, cache, scales, kre, table, sel, n, pe, me, heads, dim, rope_dim,
                                      block_size, scale, split_rows, smem);
        else
            mla_wide_split<0, true>(qe, qre, cache, scales, kre, table, sel, n, pe, me, heads, dim, rope_dim,
                                    block_size, scale, split_rows, smem);
    }
}

// The merge of the wide partials: out[h] = sum_s exp(m_s - M) part_s[h] / sum_s exp(m_s - M) l_s
// over the ceil(count / split_rows) splits, in split order, as sparse_mla_combine_batch. Grid
// (ceil(heads / 2), m), block 256: 128 threads per head, thread i owning dims 4 i .. 4 i + 3
// (dim <= 512, dim % 16 == 0), each summing every split itself with eight splits' loads in flight
// (a few splits per head: no cross-warp sum). The partials and their (m, l) come through L2 (the
// partials kernel releases its dependents early, ptx/common.cuh). Padding entries, and every block
// for a split_rows the partials kernel does not take, read and write nothing.
#define MLA_CW 8
extern "C" __global__ void __launch_bounds__(256) sparse_mla_combine_wide_batch(
    const float* __restrict__ part, const float* __restrict__ ml, const uint32_t* __restrict__ count,
    uint16_t* __restrict__ out, const uint32_t* __restrict__ entries, uint32_t m, uint32_t sel_cap, uint32_t heads,
    uint32_t dim, uint32_t split_rows) {
    wait_then_release();
    const uint32_t e = blockIdx.y, h = 2u * blockIdx.x + (threadIdx.x >> 7), d = 4u * (threadIdx.x & 127u);
    if (e >= m || h >= heads || dim % 16u != 0 || dim > 512u || !wide_split_ok(split_rows)) return;
    const uint32_t n = min(count[e], sel_cap);  // beside the entry's load, as in sparse_mla_attend_batch
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b) || d >= dim) return;
    const size_t hd = (size_t)heads * dim, stride = wide_splits(sel_cap, split_rows);
    const float* p = part + e * stride * hd + (size_t)h * dim + d;
    const float2* mlh = reinterpret_cast<const float2*>(ml + e * stride * heads * 2u) + h;
    const uint32_t splits = (n + split_rows - 1u) / split_rows;
    float M = -INFINITY;
    for (uint32_t s = 0; s < splits; ++s) M = fmaxf(M, __ldcg(mlh + (size_t)s * heads).x);
    float L = 0.0f;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (uint32_t s0 = 0; s0 < splits; s0 += MLA_CW) {
        float4 v[MLA_CW];
        float2 w[MLA_CW];
#pragma unroll
        for (int u = 0; u < MLA_CW; ++u) {
            const uint32_t s = s0 + u;
            v[u] = s < splits ? __ldcg(reinterpret_cast<const float4*>(p + s * hd)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            w[u] = s < splits ? __ldcg(mlh + (size_t)s * heads) : make_float2(-INFINITY, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < MLA_CW; ++u) {
            if (s0 + u >= splits) continue;
            const float x = expf(w[u].x - M);
            L = fmaf(w[u].y, x, L);
            o.x = fmaf(v[u].x, x, o.x);
            o.y = fmaf(v[u].y, x, o.y);
            o.z = fmaf(v[u].z, x, o.z);
            o.w = fmaf(v[u].w, x, o.w);
        }
    }
    if (splits == 0u) o = make_float4(0.0f, 0.0f, 0.0f, 0.0f), L = 1.0f;  // empty selection: zero
    *reinterpret_cast<uint2*>(out + e * hd + (size_t)h * dim + d) =
        make_uint2(pack_bf16x2(o.x / L, o.y / L), pack_bf16x2(o.z / L, o.w / L));
}
