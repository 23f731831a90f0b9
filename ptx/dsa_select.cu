// KPool lightning-indexer scores, the top-k pool selection and the shared selection's extension,
// for the m entries of a batch (model/kernels/dsa_select.py). Each entry's row is read from device
// memory (entries[e].row + row_add), so a captured graph follows the rows the host or an earlier
// node set.
#include "batch.cuh"
#include "model_common.cuh"

// The selection kernel's capacity in pools; model/kernels/dsa_select.py TOPK_MAX_POOLS must equal it
// (tests/test_batch_dsa.py reads both).
#define TOPK_MAX_POOLS_CUDA 16384u

// ---- indexer_scores_batch -----------------------------------------------------------------------
// scores[p] = sum_h (w_h * w_scale) * relu(q_h . key_p) / sqrt(dim) over the complete pools
// p < (row + 1) / kpool, key_p = fp8(pool_keys[p]) * pool_scales[p] (the f32 product, as the twin).
//
// Grid-stride over pools, one warp per pool, lanes over heads (32 heads = one warp): each lane
// does a whole q_h . key dot from shared memory, so there is one warp reduction per pool (over
// heads) instead of one per head. q is staged once per block as f32 with a row pitch of dim + 4
// floats: lane h's 16-byte reads of row h then land on distinct banks (pitch 132 words = 4 mod 32).
// Dynamic smem (launch helper): heads * (dim + 4) * 4 + heads * 4 + 8 * dim * 4 bytes.
namespace {
// The scores of pools blockIdx.x * 8 + warp, + gridDim.x * 8, ... below npools: one sequence's,
// whichever kernel (and grid) calls it, so a pool's score never depends on the launch.
__device__ __forceinline__ void score_pools(const uint16_t* __restrict__ q, const uint16_t* __restrict__ w,
                                            const uint8_t* __restrict__ pool_keys,
                                            const float* __restrict__ pool_scales, float* __restrict__ scores,
                                            uint32_t npools, uint32_t heads, uint32_t dim, float w_scale, float* sm) {
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t pitch = dim + 4u;
    float* qs = sm;                       // [heads][pitch]
    float* ws = qs + (size_t)heads * pitch;  // [heads]
    float* kb = ws + heads + ((4u - (heads & 3u)) & 3u);  // [8][dim], 16-byte aligned
    // Stage q with all of a thread's 16-byte loads in flight at once (32 x 128 BF16 = 2 per thread):
    // an element-wise loop waited one L2 round trip per element.
    if (dim % 8u == 0 && aligned16(q)) {
        constexpr int QL = 4;
        const uint32_t n8 = heads * dim / 8u;
        for (uint32_t base = 0; base < n8; base += blockDim.x * QL) {
            uint4 v[QL];
#pragma unroll
            for (int u = 0; u < QL; ++u) {
                const uint32_t i = base + threadIdx.x + blockDim.x * u;
                v[u] = i < n8 ? __ldg(reinterpret_cast<const uint4*>(q) + i) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < QL; ++u) {
                const uint32_t i = base + threadIdx.x + blockDim.x * u;
                if (i >= n8) continue;
                float* dst = qs + (size_t)((8u * i) / dim) * pitch + (8u * i) % dim;
                const uint32_t vv[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    dst[2 * e] = bf16_lo(vv[e]);
                    dst[2 * e + 1] = bf16_hi(vv[e]);
                }
            }
        }
    } else {
        for (uint32_t i = threadIdx.x; i < heads * dim; i += blockDim.x)
            qs[(i / dim) * pitch + i % dim] = bf16_bits_to_f32(q[i]);
    }
    for (uint32_t i = threadIdx.x; i < heads; i += blockDim.x) ws[i] = __fmul_rn(bf16_bits_to_f32(w[i]), w_scale);
    __syncthreads();
    float* key = kb + (size_t)warp * dim;
    const float inv = sqrtf((float)dim);
    const bool vec4 = (dim % 4u) == 0;
    for (uint32_t p = blockIdx.x * 8u + warp; p < npools; p += gridDim.x * 8u) {
        const float sc = pool_scales[p];
        const uint8_t* kp = pool_keys + (size_t)p * dim;
        for (uint32_t d = lane; d < dim; d += 32u) key[d] = __fmul_rn(fp8_to_f32(kp[d]), sc);
        __syncwarp();
        float contrib = 0.0f;
        for (uint32_t h = lane; h < heads; h += 32u) {
            const float* qh = qs + (size_t)h * pitch;
            float dot = 0.0f;
            if (vec4) {
                for (uint32_t d = 0; d < dim; d += 4u) {
                    const float4 a = *reinterpret_cast<const float4*>(qh + d);
                    const float4 b = *reinterpret_cast<const float4*>(key + d);
                    dot = fmaf(a.x, b.x, dot);
                    dot = fmaf(a.y, b.y, dot);
                    dot = fmaf(a.z, b.z, dot);
                    dot = fmaf(a.w, b.w, dot);
                }
            } else {
                for (uint32_t d = 0; d < dim; ++d) dot = fmaf(qh[d], key[d], dot);
            }
            contrib = fmaf(ws[h], fmaxf(dot, 0.0f), contrib);
        }
        contrib = warp_sum(contrib);
        if (lane == 0) scores[p] = contrib / inv;
        __syncwarp();  // the next pool overwrites key[]
    }
}
}  // namespace

// The same scores for m batch entries (ptx/batch.cuh): blockIdx.y = entry e, whose query is
// q + e * q_stride, head weights w + e * w_stride, pools its slot's and scores
// scores + e * pools_per_slot; blockIdx.x strides over its pools. A pool's score is one warp's
// whatever the grid, so an entry's scores have the same bits in every batch.
// Padding entries and rows past slot_rows read and write nothing.
extern "C" __global__ void __launch_bounds__(256) indexer_scores_batch(
    const uint16_t* __restrict__ q, uint32_t q_stride, const uint16_t* __restrict__ w, uint32_t w_stride,
    const uint8_t* __restrict__ pool_keys, const float* __restrict__ pool_scales, float* __restrict__ scores,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add, uint32_t slot_rows, uint32_t heads,
    uint32_t dim, uint32_t kpool, float w_scale) {
    extern __shared__ __align__(16) float sm[];
    wait_then_release();
    const uint32_t e = blockIdx.y;
    if (e >= m) return;
    const BatchEntry b = load_entry(entries, e);
    const uint32_t row = b.row + row_add;
    if (entry_is_pad(b) || row >= slot_rows) return;
    const uint32_t npools = (row + 1u) / kpool;  // <= pools_per_slot: row < slot_rows
    if (blockIdx.x * 8u >= npools) return;
    const size_t pps = pools_per_slot(slot_rows, kpool);
    score_pools(q + (size_t)e * q_stride, w + (size_t)e * w_stride, pool_keys + b.slot * pps * dim,
                pool_scales + b.slot * pps, scores + e * pps, npools, heads, dim, w_scale, sm);
}

// ---- select_topk_pools_batch --------------------------------------------------------------------
// One block of 1024 threads; dynamic smem holds one u32 key per pool (TOPK_MAX_POOLS * 4 bytes,
// 64 KiB for 16384 pools, above the 48 KB default: the backend raises the limit at launch).
//
// With npools <= topk_pools the selection is every complete pool's rows. Otherwise the topk_pools largest
// scores (ties: lower pool index first) are found by an exact radix select on order-preserving
// keys (4 passes of 8 bits, histograms with warp-aggregated shared atomics: scores of one
// magnitude share their top byte, so plain atomics would serialise on one bin), then the chosen
// pools are compacted in ascending pool order with two block scans (one for the tie quota, one
// for output positions), expanded to their kpool rows. With `tail` the rows of the incomplete pool
// are appended in both cases (index_kpool_always_select_tail). The result is exactly
// select_rows_ref's.
namespace {
// One sequence's selection for its row (the whole block). A selection longer than sel_cap rows (a
// sizing error) is a visible failure like a row past the capacity: count 0, nothing listed.
struct SelectSmem {
    uint32_t hist[256];
    uint32_t scan_scratch[32];
    uint32_t digit, remaining;
};

__device__ __forceinline__ void select_rows(const float* __restrict__ scores, uint32_t* __restrict__ selected,
                                            uint32_t* __restrict__ count, uint32_t row, uint32_t topk_pools,
                                            uint32_t kpool, uint32_t tail, uint32_t sel_cap, uint32_t* keys_s,
                                            SelectSmem& sm) {
    uint32_t* hist = sm.hist;
    uint32_t* scan_scratch = sm.scan_scratch;
    uint32_t& s_digit = sm.digit;
    uint32_t& s_remaining = sm.remaining;
    const uint32_t tid = threadIdx.x, nt = blockDim.x;
    const uint32_t npools = (row + 1u) / kpool;
    const uint32_t tail0 = npools * kpool, tail_n = tail ? row + 1u - tail0 : 0u;
    if ((npools <= topk_pools ? tail0 : topk_pools * kpool) + tail_n > sel_cap) {
        if (tid == 0) *count = 0u;
        return;
    }
    if (npools <= topk_pools) {
        for (uint32_t i = tid; i < tail0 + tail_n; i += nt) selected[i] = i;
        if (tid == 0) *count = tail0 + tail_n;
        return;
    }
    if (npools > TOPK_MAX_POOLS_CUDA) {  // past the sizing the proposer enforces: a visible failure
        if (tid == 0) *count = 0u;
        return;
    }
    for (uint32_t base = 0; base < npools; base += 4u * nt) {  // 4 loads in flight per thread
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const uint32_t i = base + tid + nt * u;
            v[u] = i < npools ? __ldcg(scores + i) : 0.0f;  // L2: the indexer releases early
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const uint32_t i = base + tid + nt * u;
            if (i < npools) keys_s[i] = ordered_key(v[u]);
        }
    }

    uint32_t prefix = 0u, mask = 0u, remaining = topk_pools;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (tid < 256) hist[tid] = 0u;
        __syncthreads();
        for (uint32_t i = tid; i < npools; i += nt) {
            const uint32_t k = keys_s[i];
            if ((k & mask) == prefix) {
                const uint32_t digit = (k >> shift) & 255u;
                const uint32_t peers = __match_any_sync(__activemask(), digit);
                if ((tid & 31u) == (uint32_t)(__ffs(peers) - 1)) atomicAdd(&hist[digit], (uint32_t)__popc(peers));
            }
        }
        __syncthreads();
        if (tid < 32) {
            // Lane l owns bins 8l..8l+7; "above" counts keys in higher bins.
            uint32_t local = 0u;
#pragma unroll
            for (int b = 0; b < 8; ++b) local += hist[8u * tid + b];
            uint32_t suffix = local;  // inclusive suffix sum over lanes >= tid
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t t = __shfl_down_sync(0xFFFFFFFFu, suffix, o);
                if (tid + (uint32_t)o < 32u) suffix += t;
            }
            uint32_t above = suffix - local;
#pragma unroll
            for (int b = 7; b >= 0; --b) {
                const uint32_t c = hist[8u * tid + b];
                if (above < remaining && above + c >= remaining) {
                    s_digit = 8u * tid + b;
                    s_remaining = remaining - above;
                }
                above += c;
            }
        }
        __syncthreads();
        prefix |= s_digit << shift;
        mask |= 255u << shift;
        remaining = s_remaining;
        __syncthreads();  // s_digit / s_remaining are rewritten by the next pass
    }
    const uint32_t T = prefix, need = remaining;  // the k-th largest key; take `need` of its ties

    const uint32_t per = (npools + nt - 1u) / nt;
    const uint32_t lo = min(tid * per, npools), hi = min(lo + per, npools);
    uint32_t gt = 0u, eq = 0u;
    for (uint32_t i = lo; i < hi; ++i) {
        const uint32_t k = keys_s[i];
        gt += k > T;
        eq += k == T;
    }
    uint32_t total;
    const uint32_t eq_before = block_exclusive_scan(eq, scan_scratch, &total);
    const uint32_t quota = need > eq_before ? min(eq, need - eq_before) : 0u;
    uint32_t pos = block_exclusive_scan(gt + quota, scan_scratch, &total);
    uint32_t taken_eq = 0u;
    for (uint32_t i = lo; i < hi; ++i) {
        const uint32_t k = keys_s[i];
        bool take = k > T;
        if (k == T && taken_eq < quota) {
            take = true;
            ++taken_eq;
        }
        if (take) {
            for (uint32_t j = 0; j < kpool; ++j) selected[pos * kpool + j] = i * kpool + j;
            ++pos;
        }
    }
    const uint32_t base = topk_pools * kpool;
    for (uint32_t i = tid; i < tail_n; i += nt) selected[base + i] = tail0 + i;
    if (tid == 0) *count = base + tail_n;
}
}  // namespace

// The same selection for m batch entries, one block each (grid = m): entry e's row of its slot
// (entries[e].row + row_add) from scores + e * pools_per_slot, its rows into
// selected + e * sel_cap and their count into count[e]. Dynamic smem: one u32 key per pool a slot
// can have, at most TOPK_MAX_POOLS (launch helper). Padding entries read and write nothing; a row
// past slot_rows gets count 0 (its scores would be another entry's).
extern "C" __global__ void __launch_bounds__(1024) select_topk_pools_batch(
    const float* __restrict__ scores, uint32_t* __restrict__ selected, uint32_t* __restrict__ count,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add, uint32_t slot_rows, uint32_t sel_cap,
    uint32_t topk_pools, uint32_t kpool, uint32_t tail) {
    extern __shared__ uint32_t keys_s[];
    __shared__ SelectSmem sm;
    // The q_abs GEMV runs beside it.
    wait_then_release();
    const uint32_t e = blockIdx.x;
    if (e >= m) return;
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return;
    const uint32_t row = b.row + row_add;
    if (row >= slot_rows) {
        if (threadIdx.x == 0) count[e] = 0u;
        return;
    }
    select_rows(scores + (size_t)e * pools_per_slot(slot_rows, kpool), selected + (size_t)e * sel_cap, count + e,
                row, topk_pools, kpool, tail, sel_cap, keys_s, sm);
}

// Drafts 2..k of a shared selection for m batch entries: entry e appends its row
// (entries[e].row + row_add) to its list selected + e * sel_cap, count[e]. One thread per entry,
// grid ceil(m / 256) x 256 threads, in select_topk_pools_batch's place (it waits and releases as
// that kernel does). A full list (count[e] == sel_cap, a sizing error) is left as it is; padding
// entries read and write nothing.
extern "C" __global__ void __launch_bounds__(256) extend_selection_batch(
    uint32_t* __restrict__ selected, uint32_t* __restrict__ count, const uint32_t* __restrict__ entries, uint32_t m,
    uint32_t row_add, uint32_t sel_cap) {
    wait_then_release();
    const uint32_t e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= m) return;
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return;
    const uint32_t n = count[e];
    if (n >= sel_cap) return;
    selected[(size_t)e * sel_cap + n] = b.row + row_add;
    count[e] = n + 1u;
}
