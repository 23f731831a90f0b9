// Writes of the DSA caches for the m entries of a batch, entry e's row entries[e].row + row_add of
// its slot (grid = m, block 128, model/kernels/dsa_cache.py). Each row's inputs are a row of the fused projection output with
// stride `stride` elements: [kv_a (C) ; wk y (idim) ; compress_gate y (idim) ; ...].
//
// Arithmetic follows the host twins: the latent is rmsnorm'd and rounded to BF16, then quantised
// with scale = absmax / 448 (IEEE division, saturating E4M3); the indexer key is a LayerNorm
// rounded to BF16 (multiply and add kept separate, as NumPy does them); a pool key is the
// per-dimension softmax over its slots of (gate + ape) weighting the slots' keys, summed in slot
// order, then quantised like a latent.
//
// dsa_cache_write_plain_batch (the plain per-token indexer with RoPE, every token its own pool)
// reads fused rows [kv_a (C) ; k_rope (rope_dim) ; wk y (idim) ; ...]: the latent as above, the
// rotated k_rope in BF16, and the indexer key LayerNorm'd and rotated in f32 (no BF16 rounding in
// between) and quantised like a latent.
#include "batch.cuh"
#include "model_common.cuh"
#include "rope.cuh"

#define DSA_MAX_DIM 1024   // smem row buffer of a pool key (index_head_dim)
#define DSA_MAX_KPOOL 16   // per-slot LayerNorm statistics kept in smem

namespace {

// Latent row: c = bf16(rmsnorm(x) * w) -> FP8 with one scale, into the paged cache at `slot`.
__device__ __forceinline__ void write_latent(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                                             uint8_t* __restrict__ cache, float* __restrict__ scales, uint32_t slot,
                                             uint32_t dim, float eps, float* scratch) {
    const float d = rms_divisor(x, dim, eps, scratch);
    float amax = 0.0f;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float c = bf16_bits_to_f32(f32_to_bf16_bits(__fmul_rn(bf16_bits_to_f32(x[i]) / d, bf16_bits_to_f32(w[i]))));
        amax = fmaxf(amax, fabsf(c));
    }
    amax = block_max(amax, scratch);
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    uint8_t* dst = cache + (size_t)slot * dim;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float c = bf16_bits_to_f32(f32_to_bf16_bits(__fmul_rn(bf16_bits_to_f32(x[i]) / d, bf16_bits_to_f32(w[i]))));
        dst[i] = f32_to_fp8_sat(c / s);
    }
    if (threadIdx.x == 0) scales[slot] = s;
}

// Indexer key (LayerNorm, BF16) and gate (copied) of one row.
__device__ __forceinline__ void write_key_gate(const uint16_t* __restrict__ kg, const uint16_t* __restrict__ kw,
                                               const uint16_t* __restrict__ kb, uint16_t* __restrict__ keys,
                                               uint16_t* __restrict__ gates, uint32_t row, uint32_t dim, float eps,
                                               float* scratch) {
    float mu, den;
    ln_stats(kg, dim, eps, scratch, mu, den);
    uint16_t* kr = keys + (size_t)row * dim;
    uint16_t* gr = gates + (size_t)row * dim;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        kr[i] = ln_elem(bf16_bits_to_f32(kg[i]), mu, den, bf16_bits_to_f32(kw[i]), bf16_bits_to_f32(kb[i]));
        gr[i] = kg[dim + i];
    }
}

// Pool key of pool p from its kpool slots. Slot i's key and gate come either from the caches
// (kg_rows == nullptr or kg_rows[i] == nullptr) or are recomputed from a fused row of this launch
// (kg_rows[i], with its LayerNorm statistics mu[i], den[i] in shared memory), with the arithmetic
// of the block that writes that row, so the bits agree. Three passes over the slots (max, sum,
// weighted keys) recompute each exp instead of keeping per-slot arrays, which a run-time kpool would
// put in local memory.
__device__ __forceinline__ void slot_key_gate(const uint16_t* __restrict__ keys, const uint16_t* __restrict__ gates,
                                              uint32_t p, uint32_t i, uint32_t d, uint32_t dim, uint32_t kpool,
                                              const uint16_t* const* kg_rows, const float* mu, const float* den,
                                              const uint16_t* kw, const uint16_t* kb, float& k, float& g) {
    const uint16_t* src = kg_rows ? kg_rows[i] : nullptr;
    if (src != nullptr) {
        k = bf16_bits_to_f32(
            ln_elem(bf16_bits_to_f32(src[d]), mu[i], den[i], bf16_bits_to_f32(kw[d]), bf16_bits_to_f32(kb[d])));
        g = bf16_bits_to_f32(src[dim + d]);
    } else {
        const size_t at = ((size_t)p * kpool + i) * dim + d;
        k = bf16_bits_to_f32(keys[at]);
        g = bf16_bits_to_f32(gates[at]);
    }
}

__device__ __forceinline__ void compress_pool(const uint16_t* __restrict__ keys, const uint16_t* __restrict__ gates,
                                              const uint16_t* __restrict__ ape, uint8_t* __restrict__ pool_keys,
                                              float* __restrict__ pool_scales, uint32_t p, uint32_t dim,
                                              uint32_t kpool, const uint16_t* const* kg_rows, const float* mu,
                                              const float* den, const uint16_t* kw, const uint16_t* kb,
                                              float* key_buf, float* scratch) {
    float amax = 0.0f;
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x) {
        float k, g;
        float m = -INFINITY;
        for (uint32_t i = 0; i < kpool; ++i) {
            slot_key_gate(keys, gates, p, i, d, dim, kpool, kg_rows, mu, den, kw, kb, k, g);
            m = fmaxf(m, __fadd_rn(g, bf16_bits_to_f32(ape[(size_t)i * dim + d])));
        }
        float sum = 0.0f;
        for (uint32_t i = 0; i < kpool; ++i) {
            slot_key_gate(keys, gates, p, i, d, dim, kpool, kg_rows, mu, den, kw, kb, k, g);
            sum = __fadd_rn(sum, expf(__fsub_rn(__fadd_rn(g, bf16_bits_to_f32(ape[(size_t)i * dim + d])), m)));
        }
        float key = 0.0f;
        for (uint32_t i = 0; i < kpool; ++i) {
            slot_key_gate(keys, gates, p, i, d, dim, kpool, kg_rows, mu, den, kw, kb, k, g);
            const float e = expf(__fsub_rn(__fadd_rn(g, bf16_bits_to_f32(ape[(size_t)i * dim + d])), m));
            key = __fadd_rn(key, __fmul_rn(e / sum, k));
        }
        key_buf[d] = key;
        amax = fmaxf(amax, fabsf(key));
    }
    amax = block_max(amax, scratch);  // its barriers also publish key_buf
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x) pool_keys[(size_t)p * dim + d] = f32_to_fp8_sat(key_buf[d] / s);
    if (threadIdx.x == 0) pool_scales[p] = s;
}

// One LayerNorm output element left in f32 (ln_elem's arithmetic without the BF16 rounding).
__device__ __forceinline__ float ln_elem_f32(float x, float mu, float denom, float w, float b) {
    return __fadd_rn(__fmul_rn(__fsub_rn(x, mu) / denom, w), b);
}

__device__ __forceinline__ uint32_t slot_of(const uint32_t* __restrict__ block_table, uint32_t row, uint32_t bs) {
    return block_table[row / bs] * bs + row % bs;
}
}  // namespace

// ---- dsa_cache_write_batch: the writes above for m entries of the slot pools (ptx/batch.cuh) ----
// Grid = m, block 128: block e writes entry e's row (entries[e].row + row_add) of its slot from
// fused row e (fused + e * stride), through the device functions above, on the slot's keys /
// gates / pool keys / pool scales / block table.
//
// A pool's rows that belong to this launch are recomputed from their fused rows (with the bits of
// the cached path). Entries of one sequence are consecutive and ascending in row (a catch-up
// chunk), so row r' < row of the same slot is in this launch exactly when entry j = e - (row - r')
// exists and holds (slot, r'); rows of other sequences may share the launch. A padding entry, or
// one whose row is past slot_rows (a sizing error that would reach the next slot's rows), reads
// and writes nothing of any sequence. So an entry's bytes are those of writing its sequence's rows
// alone, in any chunking and in any batch.
extern "C" __global__ void __launch_bounds__(128) dsa_cache_write_batch(
    const uint16_t* __restrict__ fused, uint32_t stride, const uint16_t* __restrict__ kv_norm_w,
    uint8_t* __restrict__ cache, float* __restrict__ scales, const uint32_t* __restrict__ tables,
    const uint16_t* __restrict__ knorm_w, const uint16_t* __restrict__ knorm_b, uint16_t* __restrict__ keys,
    uint16_t* __restrict__ gates, const uint16_t* __restrict__ ape, uint8_t* __restrict__ pool_keys,
    float* __restrict__ pool_scales, const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add,
    uint32_t slot_rows, uint32_t C, uint32_t idim, uint32_t block_size, uint32_t kpool, float eps, float ln_eps) {
    __shared__ float scratch[32];
    __shared__ float key_buf[DSA_MAX_DIM];
    __shared__ float mu_s[DSA_MAX_KPOOL], den_s[DSA_MAX_KPOOL];
    __shared__ const uint16_t* kg_rows[DSA_MAX_KPOOL];
    // The q projection over the same fused rows runs beside it.
    wait_then_release();
    const uint32_t e = blockIdx.x;
    if (e >= m) return;
    const BatchEntry b = load_entry(entries, e);
    const uint32_t row = b.row + row_add;
    if (entry_is_pad(b) || row >= slot_rows) return;
    const size_t slot = b.slot;
    const uint32_t pps = pools_per_slot(slot_rows, kpool);
    const uint32_t* table = tables + slot * blocks_per_slot(slot_rows, block_size);
    uint16_t* skeys = keys + slot * slot_rows * idim;
    uint16_t* sgates = gates + slot * slot_rows * idim;
    const uint16_t* src = fused + (size_t)e * stride;
    write_latent(src, kv_norm_w, cache, scales, slot_of(table, row, block_size), C, eps, scratch);
    write_key_gate(src + C, knorm_w, knorm_b, skeys, sgates, row, idim, ln_eps, scratch);
    if (kpool == 0 || kpool > DSA_MAX_KPOOL || idim > DSA_MAX_DIM || (row + 1u) % kpool) return;
    const uint32_t p = row / kpool;  // < pps: row < slot_rows
    // Which of the pool's rows are entries of this launch: lane i looks up row p * kpool + i, all
    // kpool (<= 32) loads in flight at once rather than one round trip per row.
    __shared__ uint32_t here_s;
    if (threadIdx.x < 32) {
        const uint32_t back = row - (p * kpool + threadIdx.x);  // entries before e the row would sit at
        bool here = false;
        if (threadIdx.x < kpool && back <= e) {
            const BatchEntry o = load_entry(entries, e - back);
            here = o.slot == b.slot && o.row + row_add == p * kpool + threadIdx.x;
        }
        const uint32_t mask = __ballot_sync(0xFFFFFFFFu, here);
        if (threadIdx.x == 0) here_s = mask;
    }
    __syncthreads();
    const uint32_t here_mask = here_s;
    for (uint32_t i = 0; i < kpool; ++i) {
        const uint32_t back = row - (p * kpool + i);
        if ((here_mask >> i) & 1u) {  // uniform over the block: ln_stats has barriers
            const uint16_t* kg = fused + (size_t)(e - back) * stride + C;
            float mu, den;
            ln_stats(kg, idim, ln_eps, scratch, mu, den);
            if (threadIdx.x == 0) { mu_s[i] = mu; den_s[i] = den; kg_rows[i] = kg; }
        } else if (threadIdx.x == 0) {
            kg_rows[i] = nullptr;
        }
    }
    __syncthreads();
    compress_pool(skeys, sgates, ape, pool_keys + slot * pps * idim, pool_scales + slot * pps, p, idim, kpool,
                  kg_rows, mu_s, den_s, knorm_w, knorm_b, key_buf, scratch);
}

// ---- dsa_cache_write_plain_batch: the plain indexer (kpool 1) with RoPE ---------------------------
// Grid = m, block 128: block e writes entry e's row r = entries[e].row + row_add of its slot from
// fused row e: the latent (write_latent, as above), the rope key
// rope_keys[(slot * slot_rows + r) * rope_dim ..] = bf16(rope(k_rope, r)), and the indexer key
// k = rope(LayerNorm(wk y), r) on its first irope_dim dims, one FP8 row with one scale at pool r of
// the slot (kpool 1: pools_per_slot = slot_rows). Each row depends on its own fused row only, so a
// slot's bytes cannot depend on the batch, its order or its chunking. A padding entry, one whose
// row is past slot_rows, or dims ptx/rope.cuh does not define (or an idim past key_buf) write
// nothing.
extern "C" __global__ void __launch_bounds__(128) dsa_cache_write_plain_batch(
    const uint16_t* __restrict__ fused, uint32_t stride, const uint16_t* __restrict__ kv_norm_w,
    uint8_t* __restrict__ cache, float* __restrict__ scales, const uint32_t* __restrict__ tables,
    const uint16_t* __restrict__ knorm_w, const uint16_t* __restrict__ knorm_b, uint16_t* __restrict__ rope_keys,
    uint8_t* __restrict__ pool_keys, float* __restrict__ pool_scales, const float* __restrict__ inv_freq,
    float attn_factor, const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add, uint32_t slot_rows,
    uint32_t C, uint32_t rope_dim, uint32_t idim, uint32_t irope_dim, uint32_t block_size, uint32_t interleave,
    uint32_t i_interleave, float eps, float ln_eps) {
    __shared__ float scratch[32];
    __shared__ float key_buf[DSA_MAX_DIM];
    // The q projection over the same fused rows runs beside it, as beside dsa_cache_write_batch.
    wait_then_release();
    const uint32_t e = blockIdx.x;
    if (e >= m || !rope_dims_ok(rope_dim, irope_dim, idim) || idim > DSA_MAX_DIM) return;
    const BatchEntry b = load_entry(entries, e);
    const uint32_t row = b.row + row_add;
    if (entry_is_pad(b) || row >= slot_rows) return;
    const size_t slot = b.slot;
    const uint32_t* table = tables + slot * blocks_per_slot(slot_rows, block_size);
    const uint16_t* src = fused + (size_t)e * stride;
    write_latent(src, kv_norm_w, cache, scales, slot_of(table, row, block_size), C, eps, scratch);
    const uint16_t* kr = src + C;
    uint16_t* dr = rope_keys + (slot * slot_rows + row) * rope_dim;
    const bool il = interleave != 0u, iil = i_interleave != 0u;
    for (uint32_t i = threadIdx.x; i < rope_dim / 2u; i += blockDim.x) {
        const uint32_t a = rope_first(i, rope_dim, il), z = rope_second(i, rope_dim, il);
        float c, s, y0, y1;
        rope_cos_sin(row, inv_freq[i], attn_factor, c, s);
        rope_rotate(bf16_bits_to_f32(kr[a]), bf16_bits_to_f32(kr[z]), c, s, y0, y1);
        dr[a] = f32_to_bf16_bits(y0);
        dr[z] = f32_to_bf16_bits(y1);
    }
    // The indexer key in f32: LayerNorm ((x - mu) / den * w + b, no contraction, as the twin's
    // layernorm_ref), then its first irope_dim dims rotated pair by pair. A thread owns the
    // elements it writes (a pair's two, or one unrotated element), so the max needs no barrier first.
    const uint16_t* kx = kr + rope_dim;
    float mu, den;
    ln_stats(kx, idim, ln_eps, scratch, mu, den);
    float amax = 0.0f;
    for (uint32_t i = threadIdx.x; i < irope_dim / 2u; i += blockDim.x) {
        const uint32_t a = rope_first(i, irope_dim, iil), z = rope_second(i, irope_dim, iil);
        float c, s, y0, y1;
        rope_cos_sin(row, inv_freq[i], attn_factor, c, s);
        rope_rotate(ln_elem_f32(bf16_bits_to_f32(kx[a]), mu, den, bf16_bits_to_f32(knorm_w[a]), bf16_bits_to_f32(knorm_b[a])),
                    ln_elem_f32(bf16_bits_to_f32(kx[z]), mu, den, bf16_bits_to_f32(knorm_w[z]), bf16_bits_to_f32(knorm_b[z])),
                    c, s, y0, y1);
        key_buf[a] = y0;
        key_buf[z] = y1;
        amax = fmaxf(amax, fmaxf(fabsf(y0), fabsf(y1)));
    }
    for (uint32_t d = irope_dim + threadIdx.x; d < idim; d += blockDim.x) {
        const float k = ln_elem_f32(bf16_bits_to_f32(kx[d]), mu, den, bf16_bits_to_f32(knorm_w[d]), bf16_bits_to_f32(knorm_b[d]));
        key_buf[d] = k;
        amax = fmaxf(amax, fabsf(k));
    }
    amax = block_max(amax, scratch);  // its barriers also publish key_buf
    const float sc = amax > 0.0f ? amax / 448.0f : 1.0f;
    const size_t p = slot * slot_rows + row;  // pools_per_slot(slot_rows, 1) == slot_rows
    for (uint32_t d = threadIdx.x; d < idim; d += blockDim.x) pool_keys[p * idim + d] = f32_to_fp8_sat(key_buf[d] / sc);
    if (threadIdx.x == 0) pool_scales[p] = sc;
}
