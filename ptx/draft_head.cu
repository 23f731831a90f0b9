// The draft's exchange key and commit (model/kernels/draft_head.py), and the single-rank head that
// fuses the logits GEMV, the argmax and the commit into one launch.
//
// Key: ordered_key(f32 logit) << 32 | (0xFFFFFFFF - global index): a larger key is a larger
// logit, or on a tie the lower index. ordered_key maps NaN to 0, below -inf, so a NaN logit loses
// to every number and NaNs tie-break by index like numbers: a draft is always a valid index (all
// NaN gives the lowest), and the winning key says whether its logit was a number (key_nonfinite).
//
// Non-finite flag: every commit takes `flag`, one byte the proposer reads back with the drafts
// (mapped pinned memory); the committing thread stores key_nonfinite's code there when the winning
// logit is not a number (every logit NaN: 1) or infinite (2), and stores nothing otherwise. The
// check is on the one winning key, so the logits get no extra pass.
#include "model_common.cuh"
#include "fp8_xsmem.cuh"  // dot16s, stage_x, x_smem, dynamic_smem_bytes

namespace {
constexpr uint32_t KEY_POS_INF = 0xFF800000u;  // ordered_key(+inf)
constexpr uint32_t KEY_NEG_INF = 0x007FFFFFu;  // ordered_key(-inf)

// 0: the winning logit is a number; 1: no logit is (every one NaN, or no rows); 2: it is +-inf.
__device__ __forceinline__ uint32_t key_nonfinite(unsigned long long k) {
    const uint32_t hi = (uint32_t)(k >> 32);
    return hi == 0u ? 1u : (hi == KEY_POS_INF || hi == KEY_NEG_INF) ? 2u : 0u;
}

// The index a key commits; a zero key (no candidate at all: no rows) commits 0, a valid index.
__device__ __forceinline__ uint32_t key_index(unsigned long long k) {
    return k ? 0xFFFFFFFFu - (uint32_t)(k & 0xFFFFFFFFull) : 0u;
}

constexpr int WARPS = 8;
// Rows per warp, 2 for both heads: four for the FP8 copy measured slower (BENCHMARKS.md, "Drafter
// kernel notes").
constexpr int ROWS_BF16 = 2;
constexpr int ROWS_FP8 = 2;
constexpr int U_FP8 = 4;  // 16-byte loads per row per lane in flight (gemv_fp8w_m2's UNROLL1)

// acc[r] += the dots of one batch of U chunks per row (chunk c + 32u) against the staged x.
template <int ROWS, int U>
__device__ __forceinline__ void fp8_xs_batch(const uint4 (&wv)[ROWS][U], uint32_t c, uint32_t kc, float (&acc)[ROWS]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float4 xf[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) xf[q] = x_smem[q * kc + c + 32u * u];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = dot16s(wv[r][u], xf, acc[r]);
    }
}

// ROWS dot products of FP8 rows with the x staged in shared memory (stage_x, m = 1): gemv_fp8w_m2's
// loop and arithmetic order (lane-strided chunks, f32 x, fmaf per weight), k % 16 == 0.
// With PRE, the first batch (chunks lane + 32u, u < U; the caller checked kc >= 32 U) is `pre`,
// loaded by the caller before the grid dependency wait and the x staging.
template <int ROWS, int U, bool PRE>
__device__ __forceinline__ void warp_gemv_fp8_xs(const uint8_t* const (&w)[ROWS], uint32_t k, float (&acc)[ROWS],
                                                 const uint4 (&pre)[ROWS][U]) {
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t kc = k >> 4;
    const uint4* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = reinterpret_cast<const uint4*>(w[r]);
    uint32_t c = lane;
    if (PRE) {
        fp8_xs_batch<ROWS, U>(pre, c, kc, acc);
        c += 32u * U;
    }
    for (; c + 32u * (U - 1) < kc; c += 32u * U) {
        uint4 wv[ROWS][U];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) wv[r][u] = ld_stream16(wr[r] + c + 32u * u);
        fp8_xs_batch<ROWS, U>(wv, c, kc, acc);
    }
    for (; c < kc; c += 32u) {
        uint4 wv[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wv[r] = ld_stream16(wr[r] + c);
        float4 xf[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) xf[q] = x_smem[q * kc + c];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = dot16s(wv[r], xf, acc[r]);
    }
}

// The drafts 0..slot (slot's is t) into host_drafts when publish is set: the step's one copy of its
// drafts to the host, stored by the thread that commits the last draft (host_drafts is mapped
// pinned memory, GpuBackend.alloc_mapped), instead of a copy node after the graph's last kernel.
// The earlier drafts were committed by earlier launches; read through L2 all the same.
__device__ __forceinline__ void publish_drafts(const uint32_t* drafts, uint32_t* host_drafts, uint32_t slot,
                                               uint32_t t) {
    for (uint32_t i = 0; i < slot; ++i) host_drafts[i] = __ldcg(drafts + i);
    host_drafts[slot] = t;
}

// Per block: candidate key of this block's rows (0 if it has none) -> atomicMax into *key; the
// last block commits the winner's index to token and drafts[slot], raises *flag when the winner is
// not finite, publishes the drafts when asked (publish_drafts) and re-zeroes key.
__device__ __forceinline__ void argmax_commit(unsigned long long cand, unsigned long long* key, uint32_t* counter,
                                              uint32_t* token, uint32_t* drafts, uint32_t slot,
                                              uint32_t* host_drafts, uint32_t publish, uint8_t* flag) {
    __shared__ unsigned long long best_s[WARPS];
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xFFFFFFFFu, cand, o);
        cand = other > cand ? other : cand;
    }
    if (lane == 0) best_s[warp] = cand;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long b = 0ull;
        for (int w = 0; w < WARPS; ++w) b = best_s[w] > b ? best_s[w] : b;
        if (b) atomicMax(key, b);
    }
    if (!last_block_done(counter)) return;
    if (threadIdx.x == 0) {
        const unsigned long long k = atomicOr(key, 0ull);
        const uint32_t t = key_index(k);
        const uint32_t bad = key_nonfinite(k);
        if (bad) *flag = (uint8_t)bad;
        *token = t;
        drafts[slot] = t;
        if (publish) publish_drafts(drafts, host_drafts, slot, t);
        *key = 0ull;
    }
}

// The logit of `row` (warp-reduced v), rounded to BF16 and stored; its candidate key (never 0: a
// NaN logit has high word 0 and still its index). -0 is folded onto +0 so that equal logits always
// tie-break by index, as argmax_bf16 does.
__device__ __forceinline__ unsigned long long store_logit(float v, uint32_t row, uint16_t* logits) {
    const uint16_t b = f32_to_bf16_bits(v);
    logits[row] = b;
    return ((unsigned long long)ordered_key(bf16_bits_to_f32(b)) << 32) | (0xFFFFFFFFu - row);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(32) argmax_pack(const uint32_t* __restrict__ idx,
                                                             const float* __restrict__ val,
                                                             unsigned long long* __restrict__ key, uint32_t v0) {
    if (threadIdx.x != 0) return;
    const uint32_t i = *idx;
    // A shard whose logits are all NaN (argmax_bf16: index 0, value NaN) packs high word 0: it
    // loses to any number on another rank, and among all-NaN shards the lowest index wins. An
    // empty shard (index 0xFFFFFFFF) packs 0 and never wins.
    *key = i == 0xFFFFFFFFu ? 0ull : ((unsigned long long)ordered_key(*val) << 32) | (0xFFFFFFFFu - (i + v0));
}

extern "C" __global__ void __launch_bounds__(32) draft_commit(const unsigned long long* __restrict__ key,
                                                              uint32_t* __restrict__ token, uint32_t* drafts,
                                                              uint32_t slot, uint32_t* __restrict__ host_drafts,
                                                              uint32_t publish, uint8_t* __restrict__ flag) {
    if (threadIdx.x != 0) return;
    const unsigned long long k = *key;
    const uint32_t t = key_index(k);
    const uint32_t bad = key_nonfinite(k);
    if (bad) *flag = (uint8_t)bad;
    *token = t;
    drafts[slot] = t;
    if (publish) publish_drafts(drafts, host_drafts, slot, t);
}

// logits = W @ x (BF16 head), draft = argmax(logits) (lowest index on ties, NaN below every
// number), *token = drafts[slot] = draft, *flag raised when the winning logit is not finite. Grid ceil(n / 16), block 256: 8 warps x 2 rows, 4 x 2 loads of
// 16 bytes per lane in flight. `key` (u64) and `counter` (u32) are zeroed scratch the kernel
// leaves zeroed; every replay of a graph reuses them.
extern "C" __global__ void __launch_bounds__(256) head_argmax_bf16(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ x, uint16_t* __restrict__ logits,
    unsigned long long* key, uint32_t* counter, uint32_t* __restrict__ token, uint32_t* drafts,
    uint32_t slot, uint32_t* __restrict__ host_drafts, uint32_t publish, uint32_t n, uint32_t k,
    uint8_t* __restrict__ flag) {
    constexpr int ROWS = ROWS_BF16;
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    unsigned long long cand = 0ull;
    if (row0 < n) {
        const bool vec = (k % 8u == 0) && aligned16(w) && aligned16(x);
        const uint16_t* wr[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wr[r] = w + (size_t)min(row0 + r, n - 1) * k;
        float acc[ROWS] = {0.0f, 0.0f};
        warp_gemv_bf16<ROWS, 4, true, true, true>(wr, x, k, vec, acc);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[r]);
            if (lane == (uint32_t)r && row0 + r < n) cand = store_logit(v, row0 + r, logits);
        }
    }
    wait_then_release();  // a warp without rows never reached the wait in warp_gemv_bf16
    argmax_commit(cand, key, counter, token, drafts, slot, host_drafts, publish, flag);
}

// As head_argmax_bf16 with the FP8 copy of the head: logit = scale[row] * (Wq[row] . x), the f32
// product rounded to BF16 (gemv_fp8w's arithmetic). gemv_fp8w_m2's streaming: 8 warps x 2 rows per
// 16-row group, 4 x 2 sixteen-byte loads per lane in flight, x staged once per block in shared
// memory as f32 when the launch gives k * 4 bytes (else read through L1). Unlike gemv_fp8w the
// blocks grid-stride over the 16-row groups (the launch helper sizes the grid to the blocks that
// fit on the chip at once), so the x staging and the argmax handshake (a fence and two atomics)
// happen once per resident block instead of once per 16 rows (9680 times for the 154880-row head).
// __launch_bounds__(256, 4): 64 registers (ptxas -v, nvcc 13.0, no spills), 4 blocks per SM, the
// residency the launch helper's grid assumes.
namespace {
// One 16-row group of the FP8 head: ROWS logits per warp into `logits`, the best key into cand.
// PRE: the warp's first weight batch is `pre` (warp_gemv_fp8_xs). Returns false when the warp has
// no rows in this group (nor in any later one).
template <bool PRE>
__device__ __forceinline__ bool head_fp8_group(const uint8_t* __restrict__ wq, const float* __restrict__ scale,
                                               const uint16_t* __restrict__ x, uint16_t* __restrict__ logits,
                                               uint32_t g, uint32_t n, uint32_t k, bool vec, bool smem,
                                               const uint4 (&pre)[ROWS_FP8][U_FP8], unsigned long long& cand) {
    constexpr int ROWS = ROWS_FP8;
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (g * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (row0 >= n) return false;  // warp-uniform; later groups only have larger rows
    const uint8_t* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = wq + (size_t)min(row0 + r, n - 1) * k;
    // Lane r's row scale, loaded under the weight stream instead of after the reduction.
    const float sc = (lane < (uint32_t)ROWS && row0 + lane < n) ? scale[row0 + lane] : 0.0f;
    float acc[ROWS] = {0.0f, 0.0f};
    if (PRE) warp_gemv_fp8_xs<ROWS, U_FP8, true>(wr, k, acc, pre);
    else if (smem) warp_gemv_fp8_xs<ROWS, U_FP8, false>(wr, k, acc, pre);
    else warp_gemv_fp8<ROWS, U_FP8, true>(wr, x, k, vec, acc);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == (uint32_t)r && row0 + r < n) {
            const unsigned long long c = store_logit(__fmul_rn(sc, v), row0 + r, logits);
            cand = c > cand ? c : cand;
        }
    }
    return true;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256, 4) head_argmax_fp8(
    const uint8_t* __restrict__ wq, const float* __restrict__ scale, const uint16_t* __restrict__ x,
    uint16_t* __restrict__ logits, unsigned long long* key, uint32_t* counter, uint32_t* __restrict__ token,
    uint32_t* drafts, uint32_t slot, uint32_t* __restrict__ host_drafts, uint32_t publish, uint32_t n, uint32_t k,
    uint8_t* __restrict__ flag) {
    constexpr int ROWS = ROWS_FP8;
    const uint32_t lane = threadIdx.x & 31;
    const bool vec = (k % 16u == 0) && aligned16(wq) && aligned16(x);
    const bool smem = vec && (size_t)k * 4u <= dynamic_smem_bytes();
    const uint32_t groups = (n + WARPS * ROWS - 1) / (WARPS * ROWS);
    // The first group's first weight batch is loaded before the wait for the previous kernel (x is
    // its output): with PDL the head's stream starts under the tail of the kernel before it.
    const uint32_t first_row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    const bool pre_ok = smem && (k >> 4) >= 32u * U_FP8 && blockIdx.x < groups && first_row0 < n;
    uint4 pre[ROWS][U_FP8];
    if (pre_ok) {
#pragma unroll
        for (int u = 0; u < U_FP8; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                pre[r][u] = ld_stream16(reinterpret_cast<const uint4*>(wq + (size_t)min(first_row0 + r, n - 1) * k) +
                                        lane + 32u * u);
    }
    wait_then_release();
    if (smem) stage_x(x, 1, k);  // every thread of the block
    unsigned long long cand = 0ull;
    uint32_t g = blockIdx.x;
    if (pre_ok) {
        head_fp8_group<true>(wq, scale, x, logits, g, n, k, vec, smem, pre, cand);
        g += gridDim.x;
    }
    for (; g < groups; g += gridDim.x) {
        if (!head_fp8_group<false>(wq, scale, x, logits, g, n, k, vec, smem, pre, cand)) break;
    }
    argmax_commit(cand, key, counter, token, drafts, slot, host_drafts, publish, flag);
}
