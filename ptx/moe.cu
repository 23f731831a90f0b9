// MoE of a batch (model/kernels/moe.py): the sigmoid router, the top-k with correction bias, the
// grouping of the batch's pairs by expert, and the expert GEMVs, which read the grouping from
// device memory (a graph replays whatever the router chose). Expert weights: gate_up [n_local, 2 * inter, h] (gate rows, then up rows) and
// down [n_local, h, inter].
#include "model_common.cuh"
#include "batch.cuh"
#include "mma_bf16.cuh"

namespace {
constexpr int WARPS = 8;

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// silu(min(g, L)) * clamp(u, -L, L), in the twin's order (g * sigmoid(g)) * u; NaN propagates as
// np.minimum / np.clip propagate it.
__device__ __forceinline__ float clamped_swiglu(float g, float u, float limit) {
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
    return __fmul_rn(__fmul_rn(g, sigmoidf_(g)), u);
}

// NumPy's float32 pairwise sum for n <= 128 (eight partial sums once n >= 8), so the normalised
// routing weights divide by bit-for-bit the sum the host twin divides by.
__device__ __forceinline__ float numpy_sum_f32(const float* a, uint32_t n) {
    if (n < 8u) {
        float res = 0.0f;
        for (uint32_t i = 0; i < n; ++i) res = __fadd_rn(res, a[i]);
        return res;
    }
    float r[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    uint32_t i = 8;
    for (; i < n - (n % 8u); i += 8u)
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = __fadd_rn(r[j], a[i + j]);
    float res = __fadd_rn(__fadd_rn(__fadd_rn(r[0], r[1]), __fadd_rn(r[2], r[3])),
                          __fadd_rn(__fadd_rn(r[4], r[5]), __fadd_rn(r[6], r[7])));
    for (; i < n; ++i) res = __fadd_rn(res, a[i]);
    return res;
}

// The value an ordered_key came from (0, NaN's key, back to a NaN; -0 was keyed as +0).
__device__ __forceinline__ float ordered_value(uint32_t k) {
    if (k == 0u) return __uint_as_float(0x7FC00000u);
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// Group-limited routing (DeepSeek-V3's n_group / topk_group): the kept groups as a bitmask. A
// group is gs consecutive experts, its score the f32 sum of its two largest choices (score + bias),
// and the topk_group best scores are kept, the lower group first on a tie, NaN last. Lane g < n_group
// (n_group <= 32) scores group g from `keys_s` (the choices' ordered keys, n_experts words that
// every lane of the warp wrote and __syncwarp published); each lane starts at its own offset in its
// group, so with gs % 32 == 0 the lanes' reads fall in distinct banks.
__device__ __forceinline__ uint32_t kept_groups(const uint32_t* keys_s, uint32_t n_group, uint32_t gs,
                                                uint32_t topk_group) {
    const uint32_t lane = threadIdx.x & 31;
    uint32_t gk = 0u;  // ordered_key(group score) + 1, so a lane without a group (0) never wins
    if (lane < n_group) {
        const uint32_t* g = keys_s + lane * gs;
        uint32_t a1 = 0u, a2 = 0u, j = lane % gs;
        for (uint32_t t = 0; t < gs; ++t) {
            const uint32_t k = g[j];
            a2 = max(a2, min(a1, k));
            a1 = max(a1, k);
            j = j + 1u == gs ? 0u : j + 1u;
        }
        // gs >= 2: both keys are members' (a 0 is a NaN member, and makes the sum NaN).
        gk = ordered_key(__fadd_rn(ordered_value(a1), ordered_value(a2))) + 1u;
    }
    uint32_t kept = 0u;
    for (uint32_t r = 0; r < topk_group; ++r) {
        const uint32_t hi = __reduce_max_sync(0xFFFFFFFFu, gk);
        const uint32_t win = __ffs(__ballot_sync(0xFFFFFFFFu, gk == hi)) - 1u;  // the lowest such group
        kept |= 1u << win;
        if (lane == win) gk = 0u;
    }
    return kept;
}

// Top-k by (score + bias) descending, lower expert index on ties, by one warp: each lane holds the
// keys (order-preserving bits << 32 | ~index) of experts lane, lane + 32, ... in registers, loaded
// once, so the topk rounds are a register max and a warp reduction each, with no memory latency
// between them; NaN sorts last, as in NumPy's argsort. Scores are read through L2 (__ldcg): in
// the router they were written by other blocks of the same launch (which also passes `bias` as
// a copy in shared memory, loaded beside its weight rows). n_experts <= 1024.
// NPL keys per lane (a template parameter: each round's register scan is NPL long, so 288 experts
// cost 10 compare-selects per round, not 32).
// With n_group > 1 and topk_group < n_group (group-limited routing, kept_groups; the caller has
// checked n_experts % n_group == 0, gs = n_experts / n_group >= 2, n_group <= 32 and
// topk <= topk_group * gs) the experts outside the kept groups drop out before the rounds, through
// `keys_s` (n_experts words of the warp's own); otherwise keys_s is not touched and the rounds see
// every expert, as without groups.
template <int NPL>
__device__ __forceinline__ void route_warp_n(const float* scores, const float* __restrict__ bias,
                                             uint32_t* __restrict__ ids, float* __restrict__ weights,
                                             uint32_t n_experts, uint32_t topk, uint32_t norm, float scale,
                                             uint32_t shared, uint32_t* ids_s, float* wsel, uint32_t n_group,
                                             uint32_t topk_group, uint32_t* keys_s) {
    constexpr int ROUTE_MAX_PER_LANE = NPL;
    const uint32_t lane = threadIdx.x & 31;
    // Group-limited routing first: the kept groups from the choices' ordered keys in keys_s, so
    // the keys below drop the other groups' experts as they are made.
    // Without groups (a warp-uniform branch) kept stays all ones and magic 0: every expert passes,
    // for one multiply-high per key.
    uint32_t kept = 0xFFFFFFFFu, magic = 0u;
    if (n_group > 1u && topk_group < n_group) {
        const uint32_t gs = n_experts / n_group;
#pragma unroll
        for (int c = 0; c < ROUTE_MAX_PER_LANE; ++c) {  // every load in flight at once
            const uint32_t i = lane + 32u * c;
            if (i < n_experts) keys_s[i] = ordered_key(__fadd_rn(__ldcg(scores + i), bias[i]));
        }
        __syncwarp();
        kept = kept_groups(keys_s, n_group, gs, topk_group);
        // i / gs as a high product: exact for i < 2^10 and gs <= 2^9 (the error i * (magic -
        // 2^32 / gs) / 2^32 < 2^-22 stays below the 1 / gs margin to the next integer).
        magic = 0xFFFFFFFFu / gs + 1u;
    }
    unsigned long long key[ROUTE_MAX_PER_LANE];
    float raw[ROUTE_MAX_PER_LANE];  // the sigmoid scores themselves: the winner's lane records its
                                    // weight, instead of a second L2 round trip per chosen expert
#pragma unroll
    for (int c = 0; c < ROUTE_MAX_PER_LANE; ++c) {
        const uint32_t i = lane + 32u * c;
        key[c] = 0ull;
        raw[c] = 0.0f;
        if (i < n_experts && ((kept >> __umulhi(i, magic)) & 1u)) {
            raw[c] = __ldcg(scores + i);
            const float sel = __fadd_rn(raw[c], bias[i]);
            key[c] = ((unsigned long long)ordered_key(sel) << 32) | (0xFFFFFFFFu - i);
        }
    }
    for (uint32_t r = 0; r < topk; ++r) {
        unsigned long long best = 0ull;
#pragma unroll
        for (int c = 0; c < ROUTE_MAX_PER_LANE; ++c) best = key[c] > best ? key[c] : best;
        // The warp's largest 64-bit key as two 32-bit reductions (redux.sync): the high words, then
        // the low words of the lanes holding that high word; five 64-bit shuffle rounds before.
        const uint32_t hi = __reduce_max_sync(0xFFFFFFFFu, (uint32_t)(best >> 32));
        const uint32_t lo = __reduce_max_sync(0xFFFFFFFFu, (uint32_t)(best >> 32) == hi ? (uint32_t)best : 0u);
        best = ((unsigned long long)hi << 32) | lo;
#pragma unroll
        for (int c = 0; c < ROUTE_MAX_PER_LANE; ++c)
            if (key[c] == best) {  // keys are unique (the index is in them): one lane, one slot
                key[c] = 0ull;
                ids_s[r] = 0xFFFFFFFFu - (uint32_t)(best & 0xFFFFFFFFull);
                wsel[r] = raw[c];
            }
    }
    __syncwarp();
    for (uint32_t r = lane; r < topk; r += 32u) ids[r] = ids_s[r];
    if (lane == 0) {
        const float sum = norm ? numpy_sum_f32(wsel, topk) : 1.0f;
        for (uint32_t r = 0; r < topk; ++r) {
            const float wv = norm ? wsel[r] / sum : wsel[r];
            weights[r] = __fmul_rn(wv, scale);
        }
        if (shared) {  // the shared expert is added with weight 1: it has no gate
            ids[topk] = 0u;
            weights[topk] = 1.0f;
        }
    }
}

__device__ __forceinline__ void route_warp(const float* scores, const float* __restrict__ bias,
                                           uint32_t* __restrict__ ids, float* __restrict__ weights,
                                           uint32_t n_experts, uint32_t topk, uint32_t norm, float scale,
                                           uint32_t shared, uint32_t* ids_s, float* wsel, uint32_t n_group,
                                           uint32_t topk_group, uint32_t* keys_s) {
    if (n_experts <= 128u)
        route_warp_n<4>(scores, bias, ids, weights, n_experts, topk, norm, scale, shared, ids_s, wsel, n_group,
                        topk_group, keys_s);
    else if (n_experts <= 320u)
        route_warp_n<10>(scores, bias, ids, weights, n_experts, topk, norm, scale, shared, ids_s, wsel, n_group,
                         topk_group, keys_s);
    else
        route_warp_n<32>(scores, bias, ids, weights, n_experts, topk, norm, scale, shared, ids_s, wsel, n_group,
                         topk_group, keys_s);
}

// The grouped routing's limits (moe.py router_group_batch refuses the rest): up to 32 groups (a
// lane each in kept_groups) of at least 2 experts (a top-2 sum), dividing the experts, holding the
// top-k in the kept groups. n_group == 1 routes over all experts.
__device__ __forceinline__ bool groups_ok(uint32_t n_experts, uint32_t topk, uint32_t n_group, uint32_t topk_group) {
    if (n_group == 1u) return true;
    const uint32_t gs = n_group ? n_experts / n_group : 0u;
    return n_group >= 1u && n_group <= 32u && gs * n_group == n_experts && gs >= 2u && topk_group >= 1u &&
           topk_group <= n_group && topk <= topk_group * gs;
}

// Down rows per warp of moe_down_batch (4 rows x 4 loads of 16 bytes per lane in flight). Four rows,
// not two rows of twice the loads: the shape that measured faster (BENCHMARKS.md, "Drafter kernel
// notes").
constexpr int DOWN_ROWS = 4;

}  // namespace

// The router's bias copy in shared memory, loaded by every thread of a block.
constexpr int ROUTER_BIAS_PER_THREAD = 4;  // 1024 experts at most, over 256 threads

// ==== Batched drafting (issue 15) ===============================================================
//
// One launch per step covers the m entries of a batch (ptx/batch.cuh). router_group_batch scores
// every live row, routes it, and its last block groups the batch's (row, slot) pairs by local
// expert on the device (the host of a captured graph never learns the counts);
// moe_gate_up_batch / moe_down_batch then read each used expert's rows once for all its pairs.
// Every pair keeps its own f32 accumulator in one K order (the lane's 16-byte chunks in increasing
// order, then warp_sum), so a pair's act and parts rows have the same bits whatever m, the pair's
// position or the other pairs.
//
// Pair (e, j) is entry e's slot j; its index e * nslots + j is its row in act [m * nslots][inter]
// and in parts [m * nslots][h], and its y row is e. Work items carry up to MOE_PAIRS pairs of one
// expert; an expert with more pairs has several items, which run as consecutive blocks per row
// block (so all but the first find the expert's rows in L2).

namespace {
constexpr uint32_t MOE_PAIRS = 8;             // pairs per work item (moe.py PAIRS_PER_ITEM)
constexpr uint32_t ROUTER_ROWS = WARPS;       // batch rows per router block: one per warp in the top-k
constexpr uint32_t GROUP_ZERO = 0xFFFFFFFFu;  // item expert: live pairs this rank does not hold
constexpr uint32_t GROUP_HEADER = 4;          // n_items, n_used, local pairs, zero pairs
constexpr uint32_t CODE_PAD = 0xFFFFFFFEu;    // the grouping's per-pair code: padding entry
constexpr uint32_t CODE_ELSEWHERE = 0xFFFFFFFFu;  // ... an expert outside this rank's range

// Work items over `pairs` routed pairs among n_local experts: an expert with c pairs has
// ceil(c / MOE_PAIRS) items, and the zero pairs (other ranks' experts) ceil(z / MOE_PAIRS) more.
// At most `pairs` when every pair can have an expert of its own; beyond, every expert past the
// first MOE_PAIRS pairs costs an item per MOE_PAIRS more, plus one for a partial zero item.
// Sizes the launches' grids from the host (m = 1, top-8: 8 items, one per routed slot).
__device__ __forceinline__ uint32_t items_bound(uint32_t pairs, uint32_t n_local) {
    return pairs <= n_local ? pairs : n_local + (pairs - n_local) / MOE_PAIRS + 1u;
}

// The group workspace (u32 words; moe.py GroupLayout is its twin): the header, the items (uint4
// each: expert, first item of the expert | its item count << 16, the expert's first pair in
// `pairs`, its pair count), counts and offsets per local expert, the used experts, the pairs.
struct GroupLayout {
    uint32_t items, counts, offsets, used, pairs;
};

__device__ __forceinline__ GroupLayout group_layout(uint32_t m, uint32_t ntopk, uint32_t n_local) {
    const uint32_t t = m * ntopk;
    GroupLayout g;
    g.items = GROUP_HEADER;
    g.counts = g.items + 4u * items_bound(t, n_local);
    g.offsets = g.counts + n_local;
    g.used = g.offsets + n_local;
    g.pairs = g.used + min(n_local, t);
    return g;
}

// last_block_done over `total` blocks sharing one counter (the router's blocks of one row chunk).
__device__ __forceinline__ bool last_of(uint32_t* counter, uint32_t total) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const uint32_t prev = atomicAdd(counter, 1u);
        is_last = (prev == total - 1u);
        if (is_last) {
            *counter = 0u;
            __threadfence();
        }
    }
    __syncthreads();
    return is_last;
}

// A warp's R weight rows: row r at base + r * stride (elements); rows r >= nr are past the matrix
// and read as zeros (their results are not stored). One base and a stride, not R pointers: the
// registers the pointers took spilled moe_down_batch's inner loop at two blocks per SM.
struct WRows {
    const uint16_t* base;
    size_t stride;
    uint32_t nr;
};

// One round of a warp's weight loads: chunks c0 + lane + 32u of the R rows (zeros past the row).
template <int R, int U>
__device__ __forceinline__ void load_w_round(uint4 (&wv)[R][U], const WRows& wr, uint32_t c0, uint32_t kc) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const uint32_t c = c0 + lane + 32u * u;
#pragma unroll
        for (int r = 0; r < R; ++r)
            wv[r][u] = (c < kc && (uint32_t)r < wr.nr)
                           ? ld_stream16(reinterpret_cast<const uint4*>(wr.base + (size_t)r * wr.stride) + c)
                           : make_uint4(0, 0, 0, 0);
    }
}

// acc[r][p] = w_r . x_p for the pairs p in the (warp-uniform) mask pm, where lane p holds xrow,
// the row of x that pair p multiplies; warp_gemv_bf16's arithmetic per (r, p): the vector path
// accumulates the lane's chunks in increasing order (fmaf per element, dot8_bf16), the scalar path
// its elements lane, lane + 32, ... The weights are read once for all pairs; with `vec` the
// caller has issued round 0 into wv (before its grid dependency wait, for the shared expert).
template <int R, int U>
__device__ __forceinline__ void gemv_pairs(const WRows& wr, uint4 (&wv)[R][U], const uint16_t* __restrict__ x,
                                           uint32_t xrow, uint32_t pm, uint32_t k, bool vec,
                                           float (&acc)[R][MOE_PAIRS]) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int p = 0; p < (int)MOE_PAIRS; ++p) acc[r][p] = 0.0f;
    if (vec) {
        const uint32_t kc = k >> 3;
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        for (uint32_t c0 = 0; c0 < kc; c0 += 32u * U) {
            if (c0 > 0) load_w_round<R, U>(wv, wr, c0, kc);
#pragma unroll
            for (int p = 0; p < (int)MOE_PAIRS; ++p) {
                const uint32_t xr = __shfl_sync(0xFFFFFFFFu, xrow, p);
                if (!((pm >> p) & 1u)) continue;
                uint4 xs[U];
                load_x_chunks<U>(xv + (size_t)xr * kc, c0 + lane, kc, xs);
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (c0 + lane + 32u * u < kc) {
#pragma unroll
                        for (int r = 0; r < R; ++r) acc[r][p] = dot8_bf16(wv[r][u], xs[u], acc[r][p]);
                    }
                }
            }
        }
    } else {
        // The rows' lanes leave this loop at different trips when k % 32 != 0: no shuffle inside.
        uint32_t xr[MOE_PAIRS];
#pragma unroll
        for (int p = 0; p < (int)MOE_PAIRS; ++p) xr[p] = __shfl_sync(0xFFFFFFFFu, xrow, p);
        for (uint32_t i = lane; i < k; i += 32u) {
            float wf[R];
#pragma unroll
            for (int r = 0; r < R; ++r)
                wf[r] = (uint32_t)r < wr.nr ? bf16_bits_to_f32(wr.base[(size_t)r * wr.stride + i]) : 0.0f;
#pragma unroll
            for (int p = 0; p < (int)MOE_PAIRS; ++p) {
                if (!((pm >> p) & 1u)) continue;
                const float xi = bf16_bits_to_f32(x[(size_t)xr[p] * k + i]);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r][p] = fmaf(wf[r], xi, acc[r][p]);
            }
        }
    }
}

// The shared expert's tiles are blocks y < st; tile t holds entries t * MOE_PAIRS .. + 7. The tile
// varies fastest, so the tiles of one row block are neighbours and read its rows once from HBM.
__device__ __forceinline__ void shared_tile(uint32_t st, uint32_t& xb, uint32_t& tile) {
    const uint32_t l = blockIdx.y * gridDim.x + blockIdx.x;
    xb = l / st;
    tile = l - xb * st;
}

// The live entries of a shared tile as a pair mask; lane p gets pair (entry, slot_j)'s index.
// The slot word is read through L2 (the heads write the entries' token words).
__device__ __forceinline__ uint32_t tile_pairs(const uint32_t* entries, uint32_t m, uint32_t tile, uint32_t nslots,
                                               uint32_t slot_j, uint32_t& pair) {
    const uint32_t lane = threadIdx.x & 31, e = tile * MOE_PAIRS + lane;
    const bool live = lane < MOE_PAIRS && e < m && __ldcg(entries + (size_t)e * ENTRY_WORDS) != BATCH_PAD;
    pair = e * nslots + slot_j;
    return __ballot_sync(0xFFFFFFFFu, live);
}

// Block y >= st: routed item it = y - st of the group. Returns false past the group's item count.
// Expert x's n items occupy n consecutive grid rows; block (bx, it) of them takes row block
// l / n and item l % n of the expert, l = (it - first) * gridDim.x + bx (the items of one row block
// are neighbours, as the shared tiles are). The record is loaded beside the count (it lies inside
// the workspace for every block of the grid, items_bound records): one L2 round trip, not two,
// before the block knows its expert.
__device__ __forceinline__ bool routed_item(const uint32_t* group, const GroupLayout& g, uint32_t it,
                                            uint32_t& expert, uint32_t& xb, uint32_t& pm, uint32_t& pair) {
    const uint32_t n_items = __ldcg(group);
    const uint4 rec = __ldcg(reinterpret_cast<const uint4*>(group + g.items) + it);
    if (it >= n_items) return false;
    const uint32_t first = rec.y & 0xFFFFu, n = rec.y >> 16;
    const uint32_t l = (it - first) * gridDim.x + blockIdx.x;
    xb = l / n;
    const uint32_t p0 = (l - xb * n) * MOE_PAIRS, np = min(MOE_PAIRS, rec.w - p0);
    const uint32_t lane = threadIdx.x & 31;
    pair = lane < np ? __ldcg(group + g.pairs + rec.z + p0 + lane) : 0u;
    pm = (1u << np) - 1u;
    expert = rec.x;
    return true;
}

// Groups the routed pairs (e, j < ntopk) of the live entries by local expert x = ids[e][j] -
// expert_base < n_local, deterministically: an expert's pairs in increasing pair index, the experts
// in increasing order; then the live pairs of experts outside the range (the zero pairs, whose
// parts rows moe_down_batch writes as zeros), in increasing pair index. Writes the header, the
// items, counts / offsets of every local expert, the used experts, the pairs (group_layout).
// A row's routed ids must be distinct (the router's top-k is). Called by a whole block (blockDim a
// multiple of 32, n_local and m at most 4 * blockDim); `sm` is moe.py group_smem_bytes(m, ntopk,
// n_local) of shared memory (the arrays below), `scan_s` 32 u32 more. The ids are read through L2 (in router_group_batch other
// blocks of the launch wrote them).
// Each pair's rank in its expert is the number of earlier rows that chose the expert: a popcount
// over the expert's row bitmask, so no step depends on the order the atomics land in.
constexpr int GROUP_PER_THREAD = 4;

__device__ __forceinline__ void group_pairs(const uint32_t* ids, const uint32_t* entries, uint32_t* group, uint32_t m,
                                            uint32_t ntopk, uint32_t nslots, uint32_t expert_base, uint32_t n_local,
                                            uint32_t* sm, uint32_t* scan_s) {
    constexpr int CH = GROUP_PER_THREAD;
    const uint32_t tid = threadIdx.x, nt = blockDim.x;
    const uint32_t mw = (m + 31u) / 32u, zw = (ntopk + 31u) / 32u, t_pairs = m * ntopk;
    uint32_t* bits = sm;                  // [n_local][mw]: bit e set when row e chose expert x
    uint32_t* code = bits + n_local * mw;  // [t_pairs]: local expert, CODE_PAD or CODE_ELSEWHERE
    uint32_t* zmask = code + t_pairs;      // [m][zw]: bit j set when slot j is a zero pair
    uint32_t* off_s = zmask + m * zw;      // [n_local]: the expert's first pair
    uint32_t* zoff_s = off_s + n_local;    // [m]: the row's first zero pair
    for (uint32_t i = tid; i < n_local * mw; i += nt) bits[i] = 0u;
    for (uint32_t i = tid; i < m * zw; i += nt) zmask[i] = 0u;
    __syncthreads();
    for (uint32_t p = tid; p < t_pairs; p += nt) {
        const uint32_t e = p / ntopk, j = p - e * ntopk;
        uint32_t c = CODE_PAD;
        if (__ldcg(entries + (size_t)e * ENTRY_WORDS) != BATCH_PAD) {
            c = __ldcg(ids + (size_t)e * nslots + j) - expert_base;  // wraps below the base: not local
            if (c < n_local) {
                atomicOr(&bits[c * mw + (e >> 5)], 1u << (e & 31u));
            } else {
                c = CODE_ELSEWHERE;
                atomicOr(&zmask[e * zw + (j >> 5)], 1u << (j & 31u));
            }
        }
        code[p] = c;
    }
    __syncthreads();
    const GroupLayout g = group_layout(m, ntopk, n_local);
    // Thread t holds experts t * ept .. + ept - 1 and rows t * rpt .. + rpt - 1 (contiguous, so a
    // block scan of the per-thread sums gives every expert's and row's exclusive prefix).
    const uint32_t ept = (n_local + nt - 1u) / nt, rpt = (m + nt - 1u) / nt;
    uint32_t cnt[CH], zc[CH], sum_a = 0u, sum_b = 0u;
#pragma unroll
    for (int q = 0; q < CH; ++q) {
        const uint32_t x = tid * ept + (uint32_t)q;
        cnt[q] = 0u;
        if ((uint32_t)q < ept && x < n_local)
            for (uint32_t w = 0; w < mw; ++w) cnt[q] += __popc(bits[x * mw + w]);
        const uint32_t e = tid * rpt + (uint32_t)q;
        zc[q] = 0u;
        if ((uint32_t)q < rpt && e < m)
            for (uint32_t w = 0; w < zw; ++w) zc[q] += __popc(zmask[e * zw + w]);
        // Two 16-bit fields per scan: every total is at most 32768 pairs or 4096 items, and a low
        // field's sum never carries into the high one.
        sum_a += (cnt[q] << 16) | zc[q];
        sum_b += (((cnt[q] + MOE_PAIRS - 1u) / MOE_PAIRS) << 16) | (cnt[q] > 0u ? 1u : 0u);
    }
    uint32_t tot_a, tot_b;
    const uint32_t ex_a = block_exclusive_scan(sum_a, scan_s, &tot_a);
    const uint32_t ex_b = block_exclusive_scan(sum_b, scan_s, &tot_b);
    const uint32_t n_pairs = tot_a >> 16, n_zero = tot_a & 0xFFFFu;
    const uint32_t n_items_local = tot_b >> 16, n_used = tot_b & 0xFFFFu;
    const uint32_t n_zero_items = (n_zero + MOE_PAIRS - 1u) / MOE_PAIRS;
    uint4* items = reinterpret_cast<uint4*>(group + g.items);
    uint32_t off = ex_a >> 16, first = ex_b >> 16, uidx = ex_b & 0xFFFFu, zoff = ex_a & 0xFFFFu;
#pragma unroll
    for (int q = 0; q < CH; ++q) {
        const uint32_t x = tid * ept + (uint32_t)q;
        if ((uint32_t)q < ept && x < n_local) {
            const uint32_t n_x = (cnt[q] + MOE_PAIRS - 1u) / MOE_PAIRS;
            off_s[x] = off;
            group[g.counts + x] = cnt[q];
            group[g.offsets + x] = off;
            if (cnt[q] > 0u) group[g.used + uidx++] = x;
            for (uint32_t t = 0; t < n_x; ++t) items[first + t] = make_uint4(x, first | (n_x << 16), off, cnt[q]);
            off += cnt[q];
            first += n_x;
        }
        const uint32_t e = tid * rpt + (uint32_t)q;
        if ((uint32_t)q < rpt && e < m) {
            zoff_s[e] = zoff;
            zoff += zc[q];
        }
    }
    for (uint32_t t = tid; t < n_zero_items; t += nt)
        items[n_items_local + t] = make_uint4(GROUP_ZERO, n_items_local | (n_zero_items << 16), n_pairs, n_zero);
    if (tid == 0) {
        group[0] = n_items_local + n_zero_items;
        group[1] = n_used;
        group[2] = n_pairs;
        group[3] = n_zero;
    }
    __syncthreads();
    for (uint32_t p = tid; p < t_pairs; p += nt) {
        const uint32_t c = code[p];
        if (c == CODE_PAD) continue;
        const uint32_t e = p / ntopk, j = p - e * ntopk;
        uint32_t below = 0u, at;
        if (c == CODE_ELSEWHERE) {
            for (uint32_t q = 0; q < (j >> 5); ++q) below += __popc(zmask[e * zw + q]);
            below += __popc(zmask[e * zw + (j >> 5)] & ((1u << (j & 31u)) - 1u));
            at = n_pairs + zoff_s[e] + below;
        } else {
            for (uint32_t q = 0; q < (e >> 5); ++q) below += __popc(bits[c * mw + q]);
            below += __popc(bits[c * mw + (e >> 5)] & ((1u << (e & 31u)) - 1u));
            at = off_s[c] + below;
        }
        group[g.pairs + at] = e * nslots + j;
    }
}

// group_pairs' workspace, word for word, for the pairs of rows one router block routed itself (m
// <= ROUTER_ROWS, m * ntopk <= 32), by one warp: lane L holds pair (e, j) = (L / ntopk, L % ntopk),
// its id from the routing warps' ids_s (row e's top-k, in shared memory: no L2 round trip), and
// finds its place from the other lanes' codes by shuffles. At m = 1 the router's serial tail is a
// chain of cold instructions (the head's stream has evicted the kernel's code from L2 by the next
// draft): group_pairs' block-wide passes and the second hand-over took 12.5 of the router's 28 us
// (ncu, GLM-5.3-Flash, one draft), about 30 cycles per distinct instruction. This path is a
// fraction of its instructions. `cnt_s`: n_local u32 of shared memory.
__device__ __forceinline__ void group_pairs_warp(const uint32_t (*ids_s)[128], uint32_t live, uint32_t* group,
                                                 uint32_t m, uint32_t ntopk, uint32_t nslots, uint32_t expert_base,
                                                 uint32_t n_local, uint32_t* cnt_s) {
    constexpr uint32_t ALL = 0xFFFFFFFFu;
    const uint32_t lane = threadIdx.x & 31, below_me = (1u << lane) - 1u;
    const uint32_t e = lane / ntopk, j = lane - e * ntopk;
    const bool have = lane < m * ntopk && ((live >> e) & 1u);
    uint32_t c = have ? ids_s[e][j] - expert_base : CODE_PAD;  // wraps below the base: not local
    const bool local = have && c < n_local, zero = have && !local;
    if (!local) c = 0xFFFFFFFFu;  // above every expert: counted below no one
    const uint32_t local_mask = __ballot_sync(ALL, local), zero_mask = __ballot_sync(ALL, zero);
    // A row's ids are distinct, so an expert's lanes are its rows in increasing order.
    const uint32_t peers = __match_any_sync(ALL, local ? c : 0x80000000u | lane);
    const uint32_t cnt = __popc(peers);
    const bool leader = local && (peers & below_me) == 0u;
    const uint32_t n_x = leader ? (cnt + MOE_PAIRS - 1u) / MOE_PAIRS : 0u;
    const uint32_t leader_mask = __ballot_sync(ALL, leader);
    uint32_t off = 0u, first = 0u, uidx = 0u;  // pairs, items and used experts of the lower experts
    for (uint32_t o = 0; o < 32u; ++o) {
        const uint32_t co = __shfl_sync(ALL, c, o), no = __shfl_sync(ALL, n_x, o);
        const bool lower = co < c;  // a non-local lane has no lower expert and is never lower
        off += lower ? 1u : 0u;
        if (lower && ((leader_mask >> o) & 1u)) {
            first += no;
            ++uidx;
        }
    }
    const uint32_t n_pairs = __popc(local_mask), n_zero = __popc(zero_mask), n_used = __popc(leader_mask);
    const uint32_t n_items_local = __reduce_add_sync(ALL, n_x);
    const uint32_t n_zero_items = (n_zero + MOE_PAIRS - 1u) / MOE_PAIRS;
    const GroupLayout g = group_layout(m, ntopk, n_local);
    uint4* items = reinterpret_cast<uint4*>(group + g.items);
    if (local) group[g.pairs + off + __popc(peers & below_me)] = e * nslots + j;
    if (zero) group[g.pairs + n_pairs + __popc(zero_mask & below_me)] = e * nslots + j;
    if (leader) {
        for (uint32_t t = 0; t < n_x; ++t) items[first + t] = make_uint4(c, first | (n_x << 16), off, cnt);
        group[g.used + uidx] = c;
    }
    for (uint32_t t = lane; t < n_zero_items; t += 32u)
        items[n_items_local + t] = make_uint4(GROUP_ZERO, n_items_local | (n_zero_items << 16), n_pairs, n_zero);
    if (lane == 0) {
        group[0] = n_items_local + n_zero_items;
        group[1] = n_used;
        group[2] = n_pairs;
        group[3] = n_zero;
    }
    // counts and offsets of every local expert: the leaders' counts in shared memory, then a
    // running warp scan over them 32 experts at a time.
    for (uint32_t x = lane; x < n_local; x += 32u) cnt_s[x] = 0u;
    __syncwarp();
    if (leader) cnt_s[c] = cnt;
    __syncwarp();
    uint32_t carry = 0u;
    for (uint32_t x0 = 0; x0 < n_local; x0 += 32u) {
        const uint32_t x = x0 + lane, v = x < n_local ? cnt_s[x] : 0u;
        const uint32_t incl = warp_inclusive_scan(v);
        if (x < n_local) {
            group[g.counts + x] = v;
            group[g.offsets + x] = carry + incl - v;
        }
        carry += __shfl_sync(ALL, incl, 31);
    }
}

__device__ __forceinline__ bool group_fits(uint32_t m, uint32_t ntopk, uint32_t n_local) {
    const uint32_t most = (uint32_t)GROUP_PER_THREAD * blockDim.x;
    return m >= 1u && m <= most && n_local <= most && ntopk <= 128u && (blockDim.x & 31u) == 0u;
}
}  // namespace

namespace {
// The router of the batch's rows, then the grouping of all rows by the last row chunk to finish:
// counter[ceil(m / 8)] is the chunks' handshake.
__device__ __forceinline__ void router_batch(const uint16_t* __restrict__ w, const uint16_t* __restrict__ y,
                                             const float* __restrict__ bias, float* scores, uint32_t* ids,
                                             float* __restrict__ weights, uint32_t* __restrict__ counter,
                                             const uint32_t* __restrict__ entries, uint32_t m, uint32_t n_experts,
                                             uint32_t h, uint32_t topk, uint32_t norm, float scale, uint32_t shared,
                                             uint32_t* group, uint32_t expert_base, uint32_t n_local, uint32_t n_group,
                                             uint32_t topk_group) {
    constexpr int U = 16;
    constexpr int R = (int)ROUTER_ROWS;
    __shared__ uint32_t ids_s[WARPS][128];
    __shared__ float wsel[WARPS][128];
    __shared__ float bias_s[1024];
    extern __shared__ uint4 ys4[];  // the chunk's live y rows (staged once: every warp reads them all)
    uint16_t* ys = reinterpret_cast<uint16_t*>(ys4);
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t e0 = blockIdx.x * ROUTER_ROWS;
    const uint32_t nrows = min(ROUTER_ROWS, m - e0);
    const uint32_t row = blockIdx.y * WARPS + warp;
    const bool have = row < n_experts;
    const bool vec = (h % 8u == 0) && aligned16(w) && aligned16(y);
    const uint32_t kc = h >> 3;
    const uint32_t nb = min(n_experts, 1024u);
    float bias_r[ROUTER_BIAS_PER_THREAD];
#pragma unroll
    for (int q = 0; q < ROUTER_BIAS_PER_THREAD; ++q) {
        const uint32_t i = threadIdx.x + (uint32_t)q * blockDim.x;
        bias_r[q] = i < nb ? __ldg(bias + i) : 0.0f;
    }
    const uint16_t* wrow = w + (size_t)(have ? row : 0u) * h;
    uint4 wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const uint32_t c = lane + 32u * u;
        wv[u] = (vec && have && c < kc) ? ld_stream16(reinterpret_cast<const uint4*>(wrow) + c) : make_uint4(0, 0, 0, 0);
    }
    grid_dependency_wait();  // y is the previous kernel's output (read through L2: it releases early)
    // The chunk's y rows are staged whole, padding rows too (y is batch scratch, not a sequence's
    // state): the loads then go out beside the entries' instead of one L2 round trip after them.
    const uint32_t slot = lane < nrows ? __ldcg(entries + (size_t)(e0 + lane) * ENTRY_WORDS) : BATCH_PAD;
    if (vec) {
        // Eight loads in flight per thread before their stores (a store right after its load
        // would hold the thread for one L2 round trip per chunk).
        constexpr int SB = 8;
        const uint4* yv = reinterpret_cast<const uint4*>(y) + (size_t)e0 * kc;
        const uint32_t total = nrows * kc;
        for (uint32_t q0 = threadIdx.x; q0 < total; q0 += SB * blockDim.x) {
            uint4 v[SB];
#pragma unroll
            for (int s = 0; s < SB; ++s) {
                const uint32_t q = q0 + (uint32_t)s * blockDim.x;
                v[s] = q < total ? __ldcg(yv + q) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int s = 0; s < SB; ++s) {
                const uint32_t q = q0 + (uint32_t)s * blockDim.x;
                if (q < total) ys4[q] = v[s];
            }
        }
    } else {
        const uint16_t* yr = y + (size_t)e0 * h;
        for (uint32_t q = threadIdx.x; q < nrows * h; q += blockDim.x) ys[q] = __ldcg(yr + q);
    }
    const uint32_t live = __ballot_sync(0xFFFFFFFFu, slot != BATCH_PAD);
#pragma unroll
    for (int q = 0; q < ROUTER_BIAS_PER_THREAD; ++q) {
        const uint32_t i = threadIdx.x + (uint32_t)q * blockDim.x;
        if (i < nb) bias_s[i] = bias_r[q];
    }
    __syncthreads();
    if (have) {
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        if (vec) {
            for (uint32_t c0 = 0; c0 < kc; c0 += 32u * U) {
                if (c0 > 0) {
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const uint32_t c = c0 + lane + 32u * u;
                        wv[u] = c < kc ? ld_stream16(reinterpret_cast<const uint4*>(wrow) + c) : make_uint4(0, 0, 0, 0);
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (!((live >> r) & 1u)) continue;
                    const uint4* yr = ys4 + (size_t)r * kc;
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const uint32_t c = c0 + lane + 32u * u;
                        if (c < kc) acc[r] = dot8_bf16(wv[u], yr[c], acc[r]);
                    }
                }
            }
        } else {
            for (uint32_t i = lane; i < h; i += 32u) {
                const float wf = bf16_bits_to_f32(wrow[i]);
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if ((live >> r) & 1u) acc[r] = fmaf(wf, bf16_bits_to_f32(ys[(size_t)r * h + i]), acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (!((live >> r) & 1u)) continue;
            const float v = warp_sum(acc[r]);
            if (lane == 0) scores[(size_t)(e0 + r) * n_experts + row] = sigmoidf_(v);
        }
    }
    if (!last_of(counter + blockIdx.x, gridDim.y)) return;
    const bool routable =
        n_experts <= 1024u && topk <= 128u && topk <= n_experts && groups_ok(n_experts, topk, n_group, topk_group);
    const uint32_t slots = topk + (shared ? 1u : 0u);
    if (warp < nrows && ((live >> warp) & 1u) && routable) {
        const uint32_t e = e0 + warp;
        // The grouped top-k's keys in the staging memory, n_experts words per warp: the rows were
        // read before last_of's barrier, and the grouping below reuses it after the next one.
        route_warp(scores + (size_t)e * n_experts, bias_s, ids + (size_t)e * slots, weights + (size_t)e * slots,
                   n_experts, topk, norm, scale, shared, ids_s[warp], wsel[warp], n_group, topk_group,
                   reinterpret_cast<uint32_t*>(ys4) + (size_t)warp * n_experts);
    }
    {
        // The chunks' routing blocks hand over once more (last_of's barrier and fence publish this
        // block's ids); the last one groups every row, in the staging memory the rows are done with.
        // One chunk (m <= 8) routed every row in this block: a block barrier is the hand-over (with
        // a fence first where group_pairs reads the ids through L2; group_pairs_warp reads ids_s).
        __shared__ uint32_t scan_s[32];
        const bool one_warp = gridDim.x == 1u && m * topk <= 32u;
        if (gridDim.x == 1u) {
            if (!one_warp) __threadfence();
            __syncthreads();
        } else if (!last_of(counter + gridDim.x, gridDim.x)) {
            return;
        }
        if (routable && topk >= 1u) {
            uint32_t* sm = reinterpret_cast<uint32_t*>(ys4);
            if (one_warp) {
                if (warp == 0) group_pairs_warp(ids_s, live, group, m, topk, slots, expert_base, n_local, sm);
            } else if (group_fits(m, topk, n_local)) {
                group_pairs(ids, entries, group, m, topk, slots, expert_base, n_local, sm, scan_s);
            }
        }
    }
}
}  // namespace

// The router for the m entries (scores, ids and weights of every live row; the shared expert as slot
// topk with id 0 and weight 1), then the grouping of the batch's pairs into `group`, in one launch:
// the last row chunk to be routed groups them (ids through L2), saving a group launch. Grid
// (ceil(m / 8), ceil(n_experts / 8)), block 256: the 8 rows of a chunk share a block's expert rows.
// `counter` is u32[ceil(m / 8) + 1], zero, left zero; dynamic shared memory the largest of the
// router's staging, group_smem_bytes(m, topk, n_local) and, with group-limited routing (n_group > 1,
// topk_group < n_group: route_warp_n), min(m, 8) * n_experts u32 keys.
extern "C" __global__ void __launch_bounds__(256) router_group_batch(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ y, const float* __restrict__ bias,
    float* scores, uint32_t* ids, float* __restrict__ weights, uint32_t* __restrict__ counter,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t n_experts, uint32_t h, uint32_t topk, uint32_t norm,
    float scale, uint32_t shared, uint32_t* __restrict__ group, uint32_t expert_base, uint32_t n_local,
    uint32_t n_group, uint32_t topk_group) {
    router_batch(w, y, bias, scores, ids, weights, counter, entries, m, n_experts, h, topk, norm, scale, shared,
                 group, expert_base, n_local, n_group, topk_group);
}

// The routed experts' and the shared expert's gate/up rows for every pair of the batch: act[pair][i]
// = silu(min(g, L)) * clamp(u, -L, L), [g; u] = w_x @ y[e]. Grid
// (ceil(inter / 8), st + items_bound(m * ntopk, n_local)), block 256; st = ceil(m / 8) shared tiles
// when shared == 1 (the shared expert of every live entry is slot ntopk), else 0. Warp w of a block
// computes act element 8 * row block + w for the block's pairs (up to 8). Blocks past the group's
// item count, and zero items, exit; shared == 2 writes nothing. With ntopk == 0
// (a dense MLP as a lone shared expert) the group is not read.
// PDL: the shared tiles issue their first weight round before the wait; the routed items wait for
// the group first.
extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up_batch(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ w_shared, const uint16_t* __restrict__ y,
    const uint32_t* __restrict__ group, uint16_t* __restrict__ act, const uint32_t* __restrict__ entries, uint32_t m,
    uint32_t ntopk, uint32_t n_local, uint32_t inter, uint32_t h, float limit, uint32_t shared) {
    constexpr int U = 8;
    const uint32_t warp = threadIdx.x >> 5;
    const uint32_t nslots = ntopk + (shared != 0u ? 1u : 0u);
    const uint32_t st = shared == 1u ? (m + MOE_PAIRS - 1u) / MOE_PAIRS : 0u;
    const bool in_shared = blockIdx.y < st;
    const bool vec = (h % 8u == 0) && aligned16(in_shared ? w_shared : w) && aligned16(y);
    const uint32_t kc = h >> 3;
    uint4 wv[2][U];
    uint32_t xb, pm, pair, i;
    WRows wr;  // the warp's gate row i and up row inter + i
    wr.stride = (size_t)inter * h;
    if (in_shared) {
        uint32_t tile;
        shared_tile(st, xb, tile);
        i = xb * WARPS + warp;
        wr.base = w_shared + (size_t)i * h;
        wr.nr = i < inter ? 2u : 0u;
        if (vec) load_w_round<2, U>(wv, wr, 0, kc);
        grid_dependency_wait();
        pm = tile_pairs(entries, m, tile, nslots, ntopk, pair);
    } else {
        grid_dependency_wait();
        uint32_t x;
        if (!routed_item(group, group_layout(m, ntopk, n_local), blockIdx.y - st, x, xb, pm, pair)) return;
        if (x >= n_local) return;  // a zero item: gate/up has nothing to compute for it
        i = xb * WARPS + warp;
        wr.base = w + (size_t)x * 2 * inter * h + (size_t)i * h;
        wr.nr = i < inter ? 2u : 0u;
        if (vec) load_w_round<2, U>(wv, wr, 0, kc);
    }
    if (i >= inter || pm == 0u) return;
    float acc[2][MOE_PAIRS];
    gemv_pairs<2, U>(wr, wv, y, pair / nslots, pm, h, vec, acc);
#pragma unroll
    for (int p = 0; p < (int)MOE_PAIRS; ++p) {
        const uint32_t pp = __shfl_sync(0xFFFFFFFFu, pair, p);
        if (!((pm >> p) & 1u)) continue;
        const float gv = warp_sum(acc[0][p]), uv = warp_sum(acc[1][p]);
        if ((threadIdx.x & 31) == 0) act[(size_t)pp * inter + i] = f32_to_bf16_bits(clamped_swiglu(gv, uv, limit));
    }
}

// The down rows for every pair: parts[pair][row] = weights[pair] * (w_x[row] . act[pair]) in f32
// (the routing weight read after the GEMV); the shared expert's rows (shared == 1) are its dot products (its weight
// is 1, as the router and the dense MLP give it); zeros for the zero items' pairs and, with shared
// == 2, for every live entry's shared slot. Grid (ceil(h / 32), st + items_bound(m * ntopk,
// n_local)), block 256, st = ceil(m / 8) when shared != 0; warp w computes rows 32 * row block +
// 4w .. + 3 for the block's pairs. Padding entries' rows are not written.
extern "C" __global__ void __launch_bounds__(256, 2) moe_down_batch(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ w_shared, const uint16_t* __restrict__ act,
    const float* __restrict__ weights, const uint32_t* __restrict__ group, float* __restrict__ parts,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t ntopk, uint32_t n_local, uint32_t h, uint32_t inter,
    uint32_t shared) {
    constexpr int R = DOWN_ROWS;
    constexpr int U = 4;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t nslots = ntopk + (shared != 0u ? 1u : 0u);
    const uint32_t st = shared != 0u ? (m + MOE_PAIRS - 1u) / MOE_PAIRS : 0u;
    const bool in_shared = blockIdx.y < st;
    const bool vec = (inter % 8u == 0) && aligned16(in_shared ? w_shared : w) && aligned16(act);
    const uint32_t kc = inter >> 3;
    uint4 wv[R][U];
    uint32_t xb, pm, pair, row0;
    bool compute = false, routed = false;  // neither: the block's pairs get zero rows
    WRows wr;  // the warp's rows row0 .. row0 + 3
    wr.stride = inter;
    if (in_shared) {
        uint32_t tile;
        shared_tile(st, xb, tile);
        row0 = (xb * WARPS + warp) * R;
        if (shared == 1u) {
            compute = true;
            wr.base = w_shared + (size_t)row0 * inter;
            wr.nr = row0 < h ? min((uint32_t)R, h - row0) : 0u;
            if (vec) load_w_round<R, U>(wv, wr, 0, kc);
        }
        grid_dependency_wait();
        pm = tile_pairs(entries, m, tile, nslots, ntopk, pair);
    } else {
        grid_dependency_wait();
        uint32_t x;
        if (!routed_item(group, group_layout(m, ntopk, n_local), blockIdx.y - st, x, xb, pm, pair)) return;
        row0 = (xb * WARPS + warp) * R;
        if (x < n_local) {
            compute = routed = true;
            wr.base = w + (size_t)x * h * inter + (size_t)row0 * inter;
            wr.nr = row0 < h ? min((uint32_t)R, h - row0) : 0u;
            if (vec) load_w_round<R, U>(wv, wr, 0, kc);
        }
    }
    if (row0 >= h || pm == 0u) return;
    if (!compute) {
#pragma unroll
        for (int p = 0; p < (int)MOE_PAIRS; ++p) {
            const uint32_t pp = __shfl_sync(0xFFFFFFFFu, pair, p);
            if (((pm >> p) & 1u) && lane < (uint32_t)R && row0 + lane < h) parts[(size_t)pp * h + row0 + lane] = 0.0f;
        }
        return;
    }
    float acc[R][MOE_PAIRS];
    gemv_pairs<R, U>(wr, wv, act, pair, pm, inter, vec, acc);
    // The routing weight is read after the GEMV: the weights stream before the grid dependency
    // wait, and the routing weight is the router's output.
    const float wt = (routed && ((pm >> lane) & 1u)) ? __ldcg(weights + pair) : 1.0f;
#pragma unroll
    for (int p = 0; p < (int)MOE_PAIRS; ++p) {
        const uint32_t pp = __shfl_sync(0xFFFFFFFFu, pair, p);
        const float g = __shfl_sync(0xFFFFFFFFu, wt, p);
        if (!((pm >> p) & 1u)) continue;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[r][p]);
            if (lane == (uint32_t)r && row0 + r < h) parts[(size_t)pp * h + row0 + r] = routed ? __fmul_rn(g, v) : v;
        }
    }
}

// ==== FP8 experts (issue 18) ======================================================================
//
// moe_gate_up_fp8_batch / moe_down_fp8_batch: the contracts of moe_gate_up_batch / moe_down_batch
// (the same grouping, shared-slot rules, padding and outputs) with the routed and the shared
// expert's weights in FP8 E4M3 and one F32 scale per 128 x 128 block, W[r][c] = q[r][c] *
// s[r / 128][c / 128]. Scales (moe.py gate_up_scale_shape / down_scale_shape): gate_up
// [n_local][2 * ceil(inter / 128)][ceil(h / 128)], the gate's block rows then the up's (up row i
// uses block row ceil(inter / 128) + i / 128); down [n_local][ceil(h / 128)][ceil(inter / 128)];
// the shared expert's the same with n_local = 1. Neither dimension need fill its last block.
//
// Arithmetic of one output (weight row r, pair p with activation row x): acc = 0; for each block
// b of 128 columns in increasing order, part = the f32 sum over the block's columns of q[r][c] *
// x[c] by the tensor core (mma.sync m16n8k16, BF16 inputs: every E4M3 value is exact in BF16 and
// x is the BF16 it is; the block's k16 steps in increasing order into one accumulator from 0), then
// acc = acc + s[r / 128][b] * part, rounded twice (__fmul_rn, __fadd_rn: the twin's formula).
// Then moe_gate_up_batch's clamped SwiGLU and BF16 store, moe_down_batch's routing weight
// (__fmul_rn after the dot) and f32 store.
//
// Batch invariance: an output depends only on its weight row, its x row and that fixed order; an
// MMA's output column comes from its own column of B, so neither the other pairs of the tile, the
// column the pair lands in, m nor the grid change its bits. The vector and the byte-wise load paths
// (k % 16 != 0 or unaligned pointers) build the same fragments, so the path changes no bits either.
//
// Warp tile. A warp multiplies 16 weight rows (the MMA's M) with the up to 8 pairs of its block's
// work item (the MMA's N = 8: one item, one column group): gate_up's rows are gate rows i0 .. i0 + 7
// and up rows inter + i0 .. + 7, so each lane finishes its SwiGLU from its own accumulators; down's
// are rows r0 .. r0 + 15. Lane (g = lane / 4, t = lane % 4) loads the 16 weight bytes at column
// 64 sb + 16 t of rows g and g + 8 (superblock sb: 64 columns) and the 16 x values at the same
// columns of column g's pair; MMA j (0..3) of the superblock takes the lane's elements 4j .. 4j + 3
// (logical k pairs (2t, 2t + 1) and (2t + 8, 2t + 9) are physical (4j, 4j + 1) and (4j + 2, 4j + 3)
// for A and B alike), as head_argmax_fp8_mma does. A weight chunk is widened once for all 8
// columns; FP8_U superblocks (128 bytes a lane) are in flight, the batch FP8_AHEAD ahead prefetched
// to L2 (one prefetch per 128-byte line).
//
// Widening: ptx/mma_bf16.cuh (e4m3x4_to_bf16x2).
namespace {
constexpr uint32_t FP8_BLOCK = 128;     // the scales' block, both dimensions (moe.py FP8_BLOCK)
constexpr uint32_t FP8_WARPS = 4;       // warps per block of the FP8 expert kernels (moe.py FP8_WARPS)
constexpr int FP8_U = 4;                // superblocks per batch: 2 x 64 weight bytes per lane in flight
constexpr uint32_t FP8_AHEAD = 2;       // batches the L2 prefetch runs ahead of the loads

// The 16 weight bytes of `row` at column c (a multiple of 16): zeros past its k columns and for a
// row outside the matrix (!ok). vec: one 16-byte load (k % 16 == 0, 16-byte aligned rows); else
// byte by byte, the same register contents.
template <bool VEC>
__device__ __forceinline__ uint4 w_chunk16(const uint8_t* __restrict__ row, uint32_t c, uint32_t k, bool ok) {
    if (VEC) return (ok && c < k) ? ld_stream16(row + c) : make_uint4(0, 0, 0, 0);
    uint32_t v[4] = {0u, 0u, 0u, 0u};
    if (ok) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if (c + (uint32_t)i < k) v[i >> 2] |= (uint32_t)row[c + (uint32_t)i] << (8 * (i & 3));
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}

// The 16 BF16 values of x row `row` at column c, as w_chunk16 (!ok: a dead column, zeros).
template <bool VEC>
__device__ __forceinline__ void x_chunk16(const uint16_t* __restrict__ row, uint32_t c, uint32_t k, bool ok, uint4& x0,
                                          uint4& x1) {
    if (VEC) {
        const bool in = ok && c < k;
        const uint4* p = reinterpret_cast<const uint4*>(row + c);
        x0 = in ? __ldg(p) : make_uint4(0, 0, 0, 0);
        x1 = in ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
        return;
    }
    uint32_t v[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (ok) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if (c + (uint32_t)i < k) v[i >> 1] |= (uint32_t)row[c + (uint32_t)i] << (16 * (i & 1));
    }
    x0 = make_uint4(v[0], v[1], v[2], v[3]);
    x1 = make_uint4(v[4], v[5], v[6], v[7]);
}

// The lane's rows of a warp tile: w0 / w1 rows g and g + 8 (k bytes each; ok0 / ok1 false for a
// row past the matrix, which reads as zeros), s0 / s1 their block rows of scales (ceil(k / 128)
// each), x column g's activation row (okx false for a dead column).
struct Fp8Tile {
    const uint8_t* w0;
    const uint8_t* w1;
    const float* s0;
    const float* s1;
    const uint16_t* x;
    bool ok0, ok1, okx;
};

// Lane t's share of the 128-byte lines of the batch at superblock sb of the tile's rows, towards
// L2: a batch is FP8_U / 2 lines of each of rows g and g + 8, FP8_U lines per lane quad, one
// prefetch per line (per-lane 16-byte prefetches asked for each line four times). Whole batches
// inside the row only, so no address lies past it.
__device__ __forceinline__ void fp8_batch_prefetch(const Fp8Tile& f, uint32_t sb, uint32_t t) {
    constexpr uint32_t LINES = FP8_U / 2;  // per row and batch
#pragma unroll
    for (uint32_t j = 0; j < (FP8_U + 3u) / 4u; ++j) {
        const uint32_t l = t + 4u * j;
        if (l < (uint32_t)FP8_U) {
            const uint8_t* row = l < LINES ? f.w0 : f.w1;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(row + 64u * sb + 128u * (l % LINES)) : "memory");
        }
    }
}

// The tile's first FP8_AHEAD batches towards L2 (weights only: a PDL kernel may do this before its
// wait).
__device__ __forceinline__ void fp8_tile_prefetch(const Fp8Tile& f, uint32_t k, bool vec) {
    if (!vec) return;
    const uint32_t t = threadIdx.x & 3u, nfull = (k / 64u) / FP8_U * FP8_U;
#pragma unroll
    for (uint32_t d = 0; d < FP8_AHEAD; ++d)
        if ((d + 1u) * FP8_U <= nfull) fp8_batch_prefetch(f, d * FP8_U, t);
}

// One superblock's four MMAs into part: A from the lane's 16 weight bytes of rows g (wa) and g + 8
// (wb), B from its 16 x values (x0, x1), MMA j on elements 4j .. 4j + 3 (the module comment).
__device__ __forceinline__ void fp8_superblock(float (&part)[4], const uint4& wa, const uint4& wb, const uint4& x0,
                                               const uint4& x1) {
    const uint32_t qa[4] = {wa.x, wa.y, wa.z, wa.w};
    const uint32_t qb[4] = {wb.x, wb.y, wb.z, wb.w};
    const uint32_t xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        uint32_t a0, a1, a2, a3;
        e4m3x4_to_bf16x2(qa[j], a0, a2);  // row g: elements 4j, 4j + 1 | 4j + 2, 4j + 3
        e4m3x4_to_bf16x2(qb[j], a1, a3);  // row g + 8
        mma_bf16_16816(part, a0, a1, a2, a3, xv[2 * j], xv[2 * j + 1]);
    }
}


// acc = the block-scaled dots of the warp tile (module comment): acc[0] / acc[1] row g with columns
// 2t / 2t + 1, acc[2] / acc[3] row g + 8 with the same columns. Call from the whole warp. VEC: the
// 16-byte loads (k % 16 == 0, aligned rows), else byte-wise ones; the same fragments either way.
// With VEC the whole batches (FP8_U superblocks inside the row) run without a predicate: a row past
// the matrix reads a real row (its pointer is clamped; its outputs are dropped) and a dead column
// a real x row (its pointer is clamped likewise); an MMA's output row depends only on its own A
// row and an output column only on its own B column, so neither changes a live output. The rest
// (the byte-wise path, and the last superblocks of a row that do not fill a batch) zero-fill past
// k, past the matrix and for dead columns.
template <bool VEC>
__device__ __forceinline__ void fp8_tile_dots_k(const Fp8Tile& f, uint32_t k, float (&acc)[4]) {
    const uint32_t t = threadIdx.x & 3u;
    const uint32_t nsb = (k + 63u) / 64u, nb = (k + FP8_BLOCK - 1u) / FP8_BLOCK;
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    uint32_t sb0 = 0;
    if (VEC) {
        const uint32_t nfull = (k / 64u) / FP8_U * FP8_U;  // superblocks in whole batches
        const uint8_t* p0 = f.w0 + 16u * t;
        const uint8_t* p1 = f.w1 + 16u * t;
        const uint16_t* px = f.x + 16u * t;
        const float* q0 = f.s0;
        const float* q1 = f.s1;
        // Batches 1 .. FP8_AHEAD - 1 towards L2 (the shared tiles did 0 .. FP8_AHEAD - 1 before
        // their wait; batch 0's own loads follow at once).
#pragma unroll
        for (uint32_t d = 1; d < FP8_AHEAD; ++d)
            if ((d + 1u) * FP8_U <= nfull) fp8_batch_prefetch(f, d * FP8_U, t);
        // The next batch's loads are written after each superblock's MMAs (its registers are free
        // then); ptxas issues all 2 x FP8_U of them together at the bottom of the trip, ahead of
        // the x loads and MMAs that follow. Loaded at the top of the trip, it let the last
        // superblocks' loads wait behind the first MMAs (one more round trip per batch).
        uint4 wa[FP8_U], wb[FP8_U];
        if (nfull > 0u) {
#pragma unroll
            for (int u = 0; u < FP8_U; ++u) {
                wa[u] = ld_stream16(p0 + 64 * u);
                wb[u] = ld_stream16(p1 + 64 * u);
            }
        }
        for (; sb0 < nfull; sb0 += FP8_U) {
            // The batch FP8_AHEAD ahead towards L2, so the HBM reads run ahead of the loads that
            // wait on them. Unpredicated: past the row's end it asks for the last batch again,
            // which is in L2.
            fp8_batch_prefetch(f, min(sb0 + FP8_AHEAD * FP8_U, nfull - FP8_U), t);
            const bool more = sb0 + FP8_U < nfull;  // warp-uniform: a next batch to load
            float sa[FP8_U / 2], sc[FP8_U / 2];  // the batch's blocks' scales: FP8_U is even, sb0 too
#pragma unroll
            for (int v = 0; v < FP8_U / 2; ++v) {
                sa[v] = __ldg(q0 + v);
                sc[v] = __ldg(q1 + v);
            }
#pragma unroll
            for (int u = 0; u < FP8_U; ++u) {
                const uint4* xq = reinterpret_cast<const uint4*>(px + 64 * u);
                fp8_superblock(part, wa[u], wb[u], __ldg(xq), __ldg(xq + 1));
                if (u & 1) fp8_block_done(acc, part, sa[u / 2], sc[u / 2]);
                if (more) {
                    wa[u] = ld_stream16(p0 + 64 * (FP8_U + u));
                    wb[u] = ld_stream16(p1 + 64 * (FP8_U + u));
                }
            }
            p0 += 64 * FP8_U;
            p1 += 64 * FP8_U;
            px += 64 * FP8_U;
            q0 += FP8_U / 2;
            q1 += FP8_U / 2;
        }
    }
    for (; sb0 < nsb; sb0 += FP8_U) {
        uint4 wa[FP8_U], wb[FP8_U];
#pragma unroll
        for (int u = 0; u < FP8_U; ++u) {
            const uint32_t c = 64u * (sb0 + (uint32_t)u) + 16u * t;
            wa[u] = w_chunk16<VEC>(f.w0, c, k, f.ok0);
            wb[u] = w_chunk16<VEC>(f.w1, c, k, f.ok1);
        }
        float sa[FP8_U / 2], sc[FP8_U / 2];
#pragma unroll
        for (int v = 0; v < FP8_U / 2; ++v) {
            const uint32_t b = sb0 / 2u + (uint32_t)v;
            sa[v] = b < nb ? __ldg(f.s0 + b) : 0.0f;
            sc[v] = b < nb ? __ldg(f.s1 + b) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < FP8_U; ++u) {
            const uint32_t sb = sb0 + (uint32_t)u;
            if (sb < nsb) {  // warp-uniform
                uint4 x0, x1;
                x_chunk16<VEC>(f.x, 64u * sb + 16u * t, k, f.okx, x0, x1);
                fp8_superblock(part, wa[u], wb[u], x0, x1);
                if ((sb & 1u) || sb + 1u == nsb) fp8_block_done(acc, part, sa[u / 2], sc[u / 2]);
            }
        }
    }
}
__device__ __forceinline__ void fp8_tile_dots(const Fp8Tile& f, uint32_t k, bool vec, float (&acc)[4]) {
    if (vec) fp8_tile_dots_k<true>(f, k, acc);
    else fp8_tile_dots_k<false>(f, k, acc);
}
}  // namespace

// moe_gate_up_batch's contract with FP8 weights: w [n_local][2 * inter][h] and w_shared
// [1][2 * inter][h] E4M3, ws / ws_shared their scales (module comment above). Grid
// (ceil(inter / 32), st + items_bound(m * ntopk, n_local)), block 128: warp w of block x computes
// act elements i0 .. i0 + 7, i0 = 8 (4x + w), for the block's pairs (its item's, or its shared tile's
// entries). At m = 1, top-8 with a shared expert here: (64, 9), 2304 warps, one wave at 5 blocks a
// SM. PDL as moe_gate_up_batch: the shared tiles prefetch their first weight batches before the
// wait, the routed items wait for the group first.
extern "C" __global__ void __launch_bounds__(128, 5) moe_gate_up_fp8_batch(
    const uint8_t* __restrict__ w, const float* __restrict__ ws, const uint8_t* __restrict__ w_shared,
    const float* __restrict__ ws_shared, const uint16_t* __restrict__ y, const uint32_t* __restrict__ group,
    uint16_t* __restrict__ act, const uint32_t* __restrict__ entries, uint32_t m, uint32_t ntopk, uint32_t n_local,
    uint32_t inter, uint32_t h, float limit, uint32_t shared) {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const uint32_t nslots = ntopk + (shared != 0u ? 1u : 0u);
    const uint32_t st = shared == 1u ? (m + MOE_PAIRS - 1u) / MOE_PAIRS : 0u;
    const uint32_t nbi = (inter + FP8_BLOCK - 1u) / FP8_BLOCK, nbh = (h + FP8_BLOCK - 1u) / FP8_BLOCK;
    const bool in_shared = blockIdx.y < st;
    uint32_t xb, pm, pair;
    const uint8_t* wx;  // the expert's [2 * inter][h] rows
    const float* sx;    // and its [2 * nbi][nbh] scales
    Fp8Tile f;
    if (in_shared) {
        uint32_t tile;
        shared_tile(st, xb, tile);
        wx = w_shared;
        sx = ws_shared;
        const uint32_t i = (xb * FP8_WARPS + warp) * 8u + g;
        f.ok0 = f.ok1 = i < inter;
        f.w0 = wx + (size_t)(f.ok0 ? i : 0u) * h;
        f.w1 = wx + (size_t)(inter + (f.ok0 ? i : 0u)) * h;
        fp8_tile_prefetch(f, h, h % 16u == 0 && aligned16(w_shared));
        grid_dependency_wait();
        pm = tile_pairs(entries, m, tile, nslots, ntopk, pair);
    } else {
        grid_dependency_wait();
        uint32_t x;
        if (!routed_item(group, group_layout(m, ntopk, n_local), blockIdx.y - st, x, xb, pm, pair)) return;
        if (x >= n_local) return;  // a zero item: gate/up has nothing to compute for it
        wx = w + (size_t)x * 2u * inter * h;
        sx = ws + (size_t)x * 2u * nbi * nbh;
    }
    const uint32_t i0 = (xb * FP8_WARPS + warp) * 8u, i = i0 + g;
    if (i0 >= inter || pm == 0u) return;  // warp-uniform
    const bool vec = h % 16u == 0 && aligned16(wx) && aligned16(y);
    f.ok0 = f.ok1 = i < inter;
    f.w0 = wx + (size_t)(f.ok0 ? i : 0u) * h;            // gate row i
    f.w1 = wx + (size_t)(inter + (f.ok0 ? i : 0u)) * h;  // up row i
    f.s0 = sx + (size_t)(i0 / FP8_BLOCK) * nbh;          // i0 .. i0 + 7 share a block row (8 | 128)
    f.s1 = sx + (size_t)(nbi + i0 / FP8_BLOCK) * nbh;
    const uint32_t pg = __shfl_sync(0xFFFFFFFFu, pair, g);
    f.okx = (pm >> g) & 1u;
    f.x = y + (f.okx ? (size_t)(pg / nslots) * h : 0u);  // a dead column reads row 0 (its outputs are dropped)
    float acc[4];
    fp8_tile_dots(f, h, vec, acc);
    const uint32_t pa = __shfl_sync(0xFFFFFFFFu, pair, 2u * t), pb = __shfl_sync(0xFFFFFFFFu, pair, 2u * t + 1u);
    if (i < inter) {
        if ((pm >> (2u * t)) & 1u) act[(size_t)pa * inter + i] = f32_to_bf16_bits(clamped_swiglu(acc[0], acc[2], limit));
        if ((pm >> (2u * t + 1u)) & 1u)
            act[(size_t)pb * inter + i] = f32_to_bf16_bits(clamped_swiglu(acc[1], acc[3], limit));
    }
}

// moe_down_batch's contract with FP8 weights: w [n_local][h][inter], w_shared [1][h][inter] E4M3,
// ws / ws_shared their scales. Grid (ceil(h / 64), st + items_bound(m * ntopk, n_local)), block
// 128, st = ceil(m / 8) when shared != 0: warp w of block x computes rows r0 .. r0 + 15, r0 =
// 16 (4x + w), for the block's pairs; zeros for a zero item's pairs and, with shared == 2, for the
// shared slot. (64, 9) at m = 1, top-8 with a shared slot.
extern "C" __global__ void __launch_bounds__(128, 5) moe_down_fp8_batch(
    const uint8_t* __restrict__ w, const float* __restrict__ ws, const uint8_t* __restrict__ w_shared,
    const float* __restrict__ ws_shared, const uint16_t* __restrict__ act, const float* __restrict__ weights,
    const uint32_t* __restrict__ group, float* __restrict__ parts, const uint32_t* __restrict__ entries, uint32_t m,
    uint32_t ntopk, uint32_t n_local, uint32_t h, uint32_t inter, uint32_t shared) {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const uint32_t nslots = ntopk + (shared != 0u ? 1u : 0u);
    const uint32_t st = shared != 0u ? (m + MOE_PAIRS - 1u) / MOE_PAIRS : 0u;
    const uint32_t nbh = (h + FP8_BLOCK - 1u) / FP8_BLOCK, nbi = (inter + FP8_BLOCK - 1u) / FP8_BLOCK;
    const bool in_shared = blockIdx.y < st;
    uint32_t xb, pm, pair;
    bool compute = false, routed = false;  // neither: the block's pairs get zero rows
    const uint8_t* wx = w;  // the expert's [h][inter] rows
    const float* sx = ws;   // and its [nbh][nbi] scales
    Fp8Tile f;
    if (in_shared) {
        uint32_t tile;
        shared_tile(st, xb, tile);
        if (shared == 1u) {
            compute = true;
            wx = w_shared;
            sx = ws_shared;
            const uint32_t r = (xb * FP8_WARPS + warp) * 16u + g;
            f.ok0 = r < h;
            f.ok1 = r + 8u < h;
            f.w0 = wx + (size_t)(f.ok0 ? r : 0u) * inter;
            f.w1 = wx + (size_t)(f.ok1 ? r + 8u : 0u) * inter;
            fp8_tile_prefetch(f, inter, inter % 16u == 0 && aligned16(w_shared));
        }
        grid_dependency_wait();
        pm = tile_pairs(entries, m, tile, nslots, ntopk, pair);
    } else {
        grid_dependency_wait();
        uint32_t x;
        if (!routed_item(group, group_layout(m, ntopk, n_local), blockIdx.y - st, x, xb, pm, pair)) return;
        if (x < n_local) {
            compute = routed = true;
            wx = w + (size_t)x * h * inter;
            sx = ws + (size_t)x * nbh * nbi;
        }
    }
    const uint32_t r0 = (xb * FP8_WARPS + warp) * 16u, ra = r0 + g, rb = r0 + g + 8u;
    if (r0 >= h || pm == 0u) return;  // warp-uniform
    const uint32_t pa = __shfl_sync(0xFFFFFFFFu, pair, 2u * t), pb = __shfl_sync(0xFFFFFFFFu, pair, 2u * t + 1u);
    const bool la = (pm >> (2u * t)) & 1u, lb = (pm >> (2u * t + 1u)) & 1u;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float wta = 1.0f, wtb = 1.0f;
    if (compute) {
        const bool vec = inter % 16u == 0 && aligned16(wx) && aligned16(act);
        f.ok0 = ra < h;
        f.ok1 = rb < h;
        f.w0 = wx + (size_t)(f.ok0 ? ra : 0u) * inter;
        f.w1 = wx + (size_t)(f.ok1 ? rb : 0u) * inter;
        f.s0 = f.s1 = sx + (size_t)(r0 / FP8_BLOCK) * nbi;  // r0 .. r0 + 15 share a block row (16 | 128)
        const uint32_t pg = __shfl_sync(0xFFFFFFFFu, pair, g);
        f.okx = (pm >> g) & 1u;
        f.x = act + (f.okx ? (size_t)pg * inter : 0u);  // a dead column reads row 0 (its outputs are dropped)
        fp8_tile_dots(f, inter, vec, acc);
        // The routing weight is read after the GEMV, as moe_down_batch reads it.
        const float wt = (routed && ((pm >> lane) & 1u)) ? __ldcg(weights + pair) : 1.0f;
        wta = __shfl_sync(0xFFFFFFFFu, wt, 2u * t);
        wtb = __shfl_sync(0xFFFFFFFFu, wt, 2u * t + 1u);
        if (routed) {
            acc[0] = __fmul_rn(wta, acc[0]);
            acc[2] = __fmul_rn(wta, acc[2]);
            acc[1] = __fmul_rn(wtb, acc[1]);
            acc[3] = __fmul_rn(wtb, acc[3]);
        }
    }
    if (la) {
        if (ra < h) parts[(size_t)pa * h + ra] = acc[0];
        if (rb < h) parts[(size_t)pa * h + rb] = acc[2];
    }
    if (lb) {
        if (ra < h) parts[(size_t)pb * h + ra] = acc[1];
        if (rb < h) parts[(size_t)pb * h + rb] = acc[3];
    }
}
