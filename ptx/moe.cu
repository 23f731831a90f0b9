// MoE (model/kernels/moe.py): the sigmoid router, the top-k with correction bias, and the expert
// GEMVs, which read the chosen expert ids from device memory (a graph replays whatever the router
// chose). Expert weights: gate_up [n_local, 2 * inter, h] (gate rows, then up rows) and
// down [n_local, h, inter].
#include "model_common.cuh"

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

// scores[row] = sigmoid(w[row] . y) for the rows of this warp (one row per warp, 16 loads of 16
// bytes per lane in flight: a 4096-wide row is 16 chunks per lane, so one round trip).
// PDL: the weights' first batch is issued before the wait, and the kernel releases its dependents
// right after it (router_fused).
template <bool PDL>
__device__ __forceinline__ void router_rows(const uint16_t* __restrict__ w, const uint16_t* __restrict__ y,
                                            float* __restrict__ scores, uint32_t n, uint32_t h) {
    const uint32_t row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= n) {
        if (PDL) wait_then_release();
        return;
    }
    const bool vec = (h % 8u == 0) && aligned16(w) && aligned16(y);
    const uint16_t* wr[1] = {w + (size_t)row * h};
    float acc[1] = {0.0f};
    warp_gemv_bf16<1, 16, PDL, PDL, PDL>(wr, y, h, vec, acc);
    const float v = warp_sum(acc[0]);
    if ((threadIdx.x & 31) == 0) scores[row] = sigmoidf_(v);
}

// Top-k by (score + bias) descending, lower expert index on ties, by one warp: each lane holds the
// keys (order-preserving bits << 32 | ~index) of experts lane, lane + 32, ... in registers, loaded
// once, so the topk rounds are a register max and a warp reduction each, with no memory latency
// between them; NaN sorts last, as in NumPy's argsort. Scores are read through L2 (__ldcg): in
// router_fused they were written by other blocks of the same launch (which also passes `bias` as
// a copy in shared memory, loaded beside its weight rows). n_experts <= 1024.
// NPL keys per lane (a template parameter: each round's register scan is NPL long, so 288 experts
// cost 10 compare-selects per round, not 32).
template <int NPL>
__device__ __forceinline__ void route_warp_n(const float* scores, const float* __restrict__ bias,
                                             uint32_t* __restrict__ ids, float* __restrict__ weights,
                                             uint32_t n_experts, uint32_t topk, uint32_t norm, float scale,
                                             uint32_t shared, uint32_t* ids_s, float* wsel) {
    constexpr int ROUTE_MAX_PER_LANE = NPL;
    const uint32_t lane = threadIdx.x & 31;
    unsigned long long key[ROUTE_MAX_PER_LANE];
    float raw[ROUTE_MAX_PER_LANE];  // the sigmoid scores themselves: the winner's lane records its
                                    // weight, instead of a second L2 round trip per chosen expert
#pragma unroll
    for (int c = 0; c < ROUTE_MAX_PER_LANE; ++c) {
        const uint32_t i = lane + 32u * c;
        key[c] = 0ull;
        raw[c] = 0.0f;
        if (i < n_experts) {
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
                                           uint32_t shared, uint32_t* ids_s, float* wsel) {
    if (n_experts <= 128u) route_warp_n<4>(scores, bias, ids, weights, n_experts, topk, norm, scale, shared, ids_s, wsel);
    else if (n_experts <= 320u) route_warp_n<10>(scores, bias, ids, weights, n_experts, topk, norm, scale, shared, ids_s, wsel);
    else route_warp_n<32>(scores, bias, ids, weights, n_experts, topk, norm, scale, shared, ids_s, wsel);
}

// act[j][i] for slot j and intermediate index i (one warp): rows i and inter + i of expert e.
__device__ __forceinline__ void gate_up_one(const uint16_t* __restrict__ we, const uint16_t* __restrict__ y,
                                            uint16_t* __restrict__ act_j, uint32_t i, uint32_t inter, uint32_t h,
                                            float limit) {
    const bool vec = (h % 8u == 0) && aligned16(we) && aligned16(y);
    const uint16_t* wr[2] = {we + (size_t)i * h, we + (size_t)(inter + i) * h};
    float acc[2] = {0.0f, 0.0f};
    warp_gemv_bf16<2, 8>(wr, y, h, vec, acc);
    const float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
    if ((threadIdx.x & 31) == 0) act_j[i] = f32_to_bf16_bits(clamped_swiglu(g, u, limit));
}

// parts[j][row0 .. row0 + 3] = *wgt * (w_e[row] . act_j) (one warp, 4 rows x 4 loads of 16 bytes
// per lane in flight); zeros when we == null. Four rows, not two rows of twice the loads: the shape
// that measured faster (BENCHMARKS.md, "Drafter kernel notes"). The routing weight is read after
// the GEMV: with WAIT (pdl kernels) the weights stream before the grid dependency wait, and *wgt is
// the router's output.
constexpr int DOWN_ROWS = 4;
template <bool WAIT>
__device__ __forceinline__ void down_rows(const uint16_t* __restrict__ we, const uint16_t* __restrict__ act_j,
                                          const float* wgt, float* __restrict__ parts_j, uint32_t row0, uint32_t h,
                                          uint32_t inter) {
    constexpr int R = DOWN_ROWS;
    const uint32_t lane = threadIdx.x & 31;
    if (WAIT && (row0 >= h || we == nullptr)) grid_dependency_wait();
    if (row0 >= h) return;
    if (we == nullptr) {
        if (lane < (uint32_t)R && row0 + lane < h) parts_j[row0 + lane] = 0.0f;
        return;
    }
    const bool vec = (inter % 8u == 0) && aligned16(we) && aligned16(act_j);
    const uint16_t* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = we + (size_t)min(row0 + r, h - 1) * inter;
    float acc[R] = {0.0f, 0.0f, 0.0f, 0.0f};
    warp_gemv_bf16<R, 4, WAIT>(wr, act_j, inter, vec, acc);
    const float g = *wgt;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == (uint32_t)r && row0 + r < h) parts_j[row0 + r] = __fmul_rn(g, v);
    }
}

__device__ __forceinline__ const uint16_t* local_expert(const uint16_t* w, const uint32_t* ids, uint32_t j,
                                                        uint32_t expert_base, uint32_t n_local, size_t stride) {
    // Through L2: moe_gate_up starts while router_fused, which writes the ids, may still run
    // (ptx/common.cuh, "read-only path").
    const uint32_t e = __ldcg(ids + j) - expert_base;  // wraps for ids below the base: not local
    return e < n_local ? w + (size_t)e * stride : nullptr;
}
}  // namespace

// Grid ceil(n / 8), block 256.
extern "C" __global__ void __launch_bounds__(256) router_scores(const uint16_t* __restrict__ w,
                                                                const uint16_t* __restrict__ y,
                                                                float* __restrict__ scores, uint32_t n, uint32_t h) {
    router_rows<false>(w, y, scores, n, h);
}

// One block of 32 threads.
extern "C" __global__ void __launch_bounds__(32) router_topk(const float* __restrict__ scores,
                                                             const float* __restrict__ bias, uint32_t* __restrict__ ids,
                                                             float* __restrict__ weights, uint32_t n_experts,
                                                             uint32_t topk, uint32_t norm, float scale,
                                                             uint32_t shared) {
    __shared__ uint32_t ids_s[128];
    __shared__ float wsel[128];
    if (n_experts > 1024u || topk > 128u || topk > n_experts) return;
    route_warp(scores, bias, ids, weights, n_experts, topk, norm, scale, shared, ids_s, wsel);
}

// router_scores + router_topk in one launch: the last block to finish its rows runs the top-k
// (last_block_done; `counter` is a zeroed u32 the kernel leaves zeroed). Grid ceil(n_experts / 8),
// block 256.
constexpr int ROUTER_BIAS_PER_THREAD = 4;  // 1024 experts at most, over 256 threads
extern "C" __global__ void __launch_bounds__(256) router_fused(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ y, const float* __restrict__ bias,
    float* scores, uint32_t* __restrict__ ids, float* __restrict__ weights, uint32_t* __restrict__ counter,
    uint32_t n_experts, uint32_t h, uint32_t topk, uint32_t norm, float scale, uint32_t shared) {
    __shared__ uint32_t ids_s[128];
    __shared__ float wsel[128];
    __shared__ float bias_s[1024];
    // moe_gate_up's shared slot, which reads the same y, runs beside it: released right after the
    // wait for y (inside router_rows, after the first weight batch is in flight).
    // Every block copies the bias while its rows load (which block routes is known only at the
    // end); last_block_done's barrier orders the copy before the top-k reads it. The loads go out
    // first and the shared stores come after the rows: a store right after its load held the
    // warp for one round trip before it issued its first weight load.
    const uint32_t nb = min(n_experts, 1024u);
    float bias_r[ROUTER_BIAS_PER_THREAD];
#pragma unroll
    for (int q = 0; q < ROUTER_BIAS_PER_THREAD; ++q) {
        const uint32_t i = threadIdx.x + (uint32_t)q * blockDim.x;
        bias_r[q] = i < nb ? __ldg(bias + i) : 0.0f;
    }
    router_rows<true>(w, y, scores, n_experts, h);
#pragma unroll
    for (int q = 0; q < ROUTER_BIAS_PER_THREAD; ++q) {
        const uint32_t i = threadIdx.x + (uint32_t)q * blockDim.x;
        if (i < nb) bias_s[i] = bias_r[q];
    }
    if (!last_block_done(counter)) return;
    if (threadIdx.x < 32 && n_experts <= 1024u && topk <= 128u && topk <= n_experts)
        route_warp(scores, bias_s, ids, weights, n_experts, topk, norm, scale, shared, ids_s, wsel);
}

// Grid (ceil(inter / 8), nslots), block 256: warp w of block x computes act[j][8x + w].
extern "C" __global__ void __launch_bounds__(256) expert_gate_up(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ y, const uint32_t* __restrict__ ids,
    uint16_t* __restrict__ act, uint32_t slot0, uint32_t nslots, uint32_t expert_base, uint32_t n_local,
    uint32_t inter, uint32_t h, float limit) {
    const uint32_t j = slot0 + blockIdx.y;
    const uint32_t i = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (blockIdx.y >= nslots || i >= inter) return;
    const uint16_t* we = local_expert(w, ids, j, expert_base, n_local, (size_t)2 * inter * h);
    if (we == nullptr) return;  // not this rank's expert: act is not written, as in the twin
    gate_up_one(we, y, act + (size_t)j * inter, i, inter, h, limit);
}

// Grid (ceil(h / 32), nslots), block 256: warp w of block x computes parts[j][32x + 4w .. + 3].
extern "C" __global__ void __launch_bounds__(256) expert_down(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ act, const uint32_t* __restrict__ ids,
    const float* __restrict__ weights, float* __restrict__ parts, uint32_t slot0, uint32_t nslots,
    uint32_t expert_base, uint32_t n_local, uint32_t h, uint32_t inter) {
    const uint32_t j = slot0 + blockIdx.y;
    if (blockIdx.y >= nslots) return;
    const uint16_t* we = local_expert(w, ids, j, expert_base, n_local, (size_t)h * inter);
    const uint32_t row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * DOWN_ROWS;
    down_rows<false>(we, act + (size_t)j * inter, weights + j, parts + (size_t)j * h, row0, h, inter);
}

// The routed experts of slots 0..ntopk-1 and the shared expert as slot ntopk in one launch
// (expert_gate_up twice -> once). shared: 0 no shared slot, 1 compute it from w_shared (one expert,
// same intermediate size), 2 the slot exists but this rank does not hold it (act not written).
// Grid (ceil(inter / 8), ntopk + (shared == 1)), block 256. blockIdx.y 0 is the shared slot when
// there is one, so its blocks are dispatched first: they need only y, which was complete before the
// router started, and stream the shared expert beside router_fused (Pdl.BESIDE); the routed
// slots wait for the router's ids.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ w_shared, const uint16_t* __restrict__ y,
    const uint32_t* __restrict__ ids, uint16_t* __restrict__ act, uint32_t ntopk, uint32_t expert_base,
    uint32_t n_local, uint32_t inter, uint32_t h, float limit, uint32_t shared) {
    const uint32_t j = (blockIdx.y + ntopk) % gridDim.y;  // blockIdx.y 0 -> the shared slot, if any
    const uint32_t i = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const bool shared_here = j == ntopk && shared == 1u;
    if (!shared_here) grid_dependency_wait();  // a routed slot's expert is the router's output
    if (i < inter) {
        const uint16_t* we;
        if (j < ntopk) we = local_expert(w, ids, j, expert_base, n_local, (size_t)2 * inter * h);
        else we = shared_here ? w_shared : nullptr;
        if (we != nullptr) gate_up_one(we, y, act + (size_t)j * inter, i, inter, h, limit);
    }
    if (shared_here) grid_dependency_wait();  // not complete before the router it ran beside
}

// expert_down for the routed slots and the shared slot in one launch; a shared slot this rank does
// not hold (shared == 2) is written as zeros (the memset it replaces).
// Grid (ceil(h / 32), ntopk + (shared != 0)), block 256.
extern "C" __global__ void __launch_bounds__(256) moe_down(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ w_shared, const uint16_t* __restrict__ act,
    const uint32_t* __restrict__ ids, const float* __restrict__ weights, float* __restrict__ parts, uint32_t ntopk,
    uint32_t expert_base, uint32_t n_local, uint32_t h, uint32_t inter, uint32_t shared) {
    const uint32_t j = blockIdx.y;
    // As moe_gate_up: routed slots wait before reading ids, the shared slot after its first batch.
    if (j != ntopk || shared != 1u) grid_dependency_wait();
    if (j > ntopk || (j == ntopk && shared == 0u)) return;
    const uint16_t* we;
    if (j < ntopk) we = local_expert(w, ids, j, expert_base, n_local, (size_t)h * inter);
    else we = shared == 1u ? w_shared : nullptr;
    const uint32_t row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * DOWN_ROWS;
    down_rows<true>(we, act + (size_t)j * inter, weights + j, parts + (size_t)j * h, row0, h, inter);
}
