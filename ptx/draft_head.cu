// The draft's exchange key and commit (model/kernels/draft_head.py), and the single-rank head that
// fuses the logits GEMV, the argmax and the commit into one launch.
//
// Key: ordered_key(f32 logit) << 32 | (0xFFFFFFFF - global index): a larger key is a larger
// logit, or on a tie the lower index. ordered_key maps NaN to 0, below -inf, so a NaN logit loses
// to every number and NaNs tie-break by index like numbers: a draft is always a valid index (all
// NaN gives the lowest), and the winning key says whether its logit was a number (key_nonfinite).
//
// Non-finite flag: every commit takes a flag byte per entry, which the proposer reads back with the drafts
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

// The logit of `row` (warp-reduced v), rounded to BF16 and stored; its candidate key (never 0: a
// NaN logit has high word 0 and still its index). -0 is folded onto +0 so that equal logits always
// tie-break by index, as argmax_bf16 does.
__device__ __forceinline__ unsigned long long store_logit(float v, uint32_t row, uint16_t* logits) {
    const uint16_t b = f32_to_bf16_bits(v);
    logits[row] = b;
    return ((unsigned long long)ordered_key(bf16_bits_to_f32(b)) << 32) | (0xFFFFFFFFu - row);
}
}  // namespace

// The FP8 head at one row of x (head_argmax_fp8_batch's m = 1 path): logit = scale[row] *
// (Wq[row] . x), the f32 product rounded to BF16 (gemv_fp8w's arithmetic). gemv_fp8w_m2's streaming: 8 warps x 2 rows per
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

// ---- the head over a batch ------------------------------------------------------------------------
//
// head_argmax_{fp8,bf16}_batch: the single-rank head for the m entries of a batched launch
// (ptx/batch.cuh). Row e of x [m][k] gets the logits row e of [m][n] and its argmax, committed as
// the file comment says: entries[e].token (the next draft's embedding reads it),
// drafts[e * kmax + draft_index], with publish drafts[e * kmax + 0 .. draft_index] into
// host_drafts[e * kmax + ...], and the non-finite code into byte flags[e * 4 + flag_byte]. A padding
// entry (slot BATCH_PAD) gets none of these; its logits row is scratch (a tile of padding rows only
// is skipped). keys[0..m) (u64) and counter are zeroed scratch the last block leaves zeroed.
//
// Batch invariance: a row's logits are computed in one order whatever the tile
// (fp8_batch.cuh for the order), so they have the same bits whatever the batch, and the argmax of
// equal logits is the same index. The m rows are split into `tiles` balanced tiles of at most 4
// rows (the launch helper's choice); a block stages its tile's x once and streams its share of the
// weight groups with each weight chunk applied to every row of the tile. With one row per tile
// (m = 1) the block runs the one-row groups (head_fp8_group / head_bf16_group), first weight
// batch before the wait included, so B = 1 keeps its speed.
#include "batch.cuh"
#include "fp8_batch.cuh"
#include "mma_bf16.cuh"  // e4m3x4_to_bf16x2 (head_argmax_fp8_mma)

namespace {
// Weight rows per warp and 16-byte loads per row per lane in flight when the tiles hold 2..4 rows
// of x. Both are what fits the 64 registers without spilling (ptxas -v, nvcc 13.0): four rows per
// warp, or four loads per row at four rows of x, spilled. The weight groups are then the 16 rows of
// the one-row path, so every tile walks the same groups.
constexpr int ROWS_BATCH = 2;
constexpr int U_BATCH = 2;

// Bit i set when row i of the tile is a live entry. After the grid dependency wait, through L2
// (the last block of this kernel writes the entries' token words).
__device__ __forceinline__ uint32_t tile_live(const uint32_t* entries, const BatchTile& tile) {
    uint32_t live = 0u;
    for (uint32_t i = 0; i < tile.rows; ++i)
        if (__ldcg(entries + (size_t)(tile.e0 + i) * ENTRY_WORDS) != BATCH_PAD) live |= 1u << i;
    return live;
}

// The warp's 32-lane max of a key: the one-row groups leave candidates in lanes 0 and 1.
__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long c) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xFFFFFFFFu, c, o);
        c = other > c ? other : c;
    }
    return c;
}

// The launch's shape, common to both batched heads. `tiles` is checked here (the launch helper
// never passes a bad one): with a bad shape the kernel only takes part in the handshake.
struct HeadBatchShape {
    bool active;      // this block has a tile and a first group
    BatchTile tile;   // its tile
    uint32_t tmax;    // rows of the largest tile
    uint32_t gfirst;  // its first weight group
    uint32_t stride;  // blocks per tile: the group stride
    uint32_t m;       // m, or 0 for a bad shape (nothing to commit)
};

// TR: the most rows a tile may hold (BATCH_TILE_ROWS for the CUDA-core heads).
template <int TR = BATCH_TILE_ROWS>
__device__ __forceinline__ HeadBatchShape head_batch_shape(uint32_t m, uint32_t tiles) {
    const bool ok = m >= 1u && m <= BATCH_MAX_ROWS && tiles >= 1u && tiles <= m && (m + tiles - 1u) / tiles <= (uint32_t)TR;
    const uint32_t nt = ok ? tiles : 1u;
    HeadBatchShape s;
    s.stride = gridDim.x / nt;
    s.gfirst = blockIdx.x / nt;
    s.active = ok && s.gfirst < s.stride;
    s.tile = batch_tile(ok ? m : 1u, nt, blockIdx.x % nt);
    s.tmax = ok ? (m + nt - 1u) / nt : 1u;
    s.m = ok ? m : 0u;
    return s;
}

// The commit of a batched head from best[w][i], warp w's best key for row i of the block's tile
// (written and made visible by the caller's barrier): the block's best per live row goes into
// keys[e0 + i] by atomicMax; the last block commits every live entry of the launch from its key
// (the file comment's rules) and re-zeroes keys[0..m). The shape is derived again here rather than kept
// in registers through the weight stream (that spilled the BF16 head). Needs blockDim >= TR.
template <int TR>
__device__ __forceinline__ void commit_tile_keys(const unsigned long long (*best)[TR], uint32_t m, uint32_t tiles,
                                                 unsigned long long* keys, uint32_t* counter, uint32_t* entries,
                                                 uint32_t* drafts, uint32_t draft_index, uint32_t kmax,
                                                 uint32_t* host_drafts, uint32_t publish, uint8_t* flags,
                                                 uint32_t flag_byte) {
    const HeadBatchShape s = head_batch_shape<TR>(m, tiles);
    if (s.active && threadIdx.x < s.tile.rows &&
        __ldcg(entries + (size_t)(s.tile.e0 + threadIdx.x) * ENTRY_WORDS) != BATCH_PAD) {
        unsigned long long b = 0ull;
        for (int w = 0; w < WARPS; ++w) b = best[w][threadIdx.x] > b ? best[w][threadIdx.x] : b;
        if (b) atomicMax(keys + s.tile.e0 + threadIdx.x, b);
    }
    if (!last_block_done(counter)) return;
    for (uint32_t e = threadIdx.x; e < s.m; e += blockDim.x) {
        const unsigned long long k = atomicExch(keys + e, 0ull);
        if (__ldcg(entries + (size_t)e * ENTRY_WORDS) == BATCH_PAD) continue;
        const uint32_t t = key_index(k);
        const uint32_t bad = key_nonfinite(k);
        if (bad) flags[(size_t)e * 4u + flag_byte] = (uint8_t)bad;
        entries[(size_t)e * ENTRY_WORDS + 2u] = t;
        uint32_t* d = drafts + (size_t)e * kmax;
        d[draft_index] = t;
        if (publish) publish_drafts(d, host_drafts + (size_t)e * kmax, draft_index, t);
    }
}

// The batch's argmax and commit: lane i of each warp holds the warp's best key for row i of the block's
// tile (TR <= 32); commit_tile_keys does the rest.
template <int TR = BATCH_TILE_ROWS>
__device__ __forceinline__ void argmax_commit_batch(unsigned long long cand, uint32_t m, uint32_t tiles,
                                                    unsigned long long* keys, uint32_t* counter, uint32_t* entries,
                                                    uint32_t* drafts, uint32_t draft_index, uint32_t kmax,
                                                    uint32_t* host_drafts, uint32_t publish, uint8_t* flags,
                                                    uint32_t flag_byte) {
    __shared__ unsigned long long best_s[WARPS][TR];
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane < (uint32_t)TR) best_s[warp][lane] = cand;
    __syncthreads();
    commit_tile_keys<TR>(best_s, m, tiles, keys, counter, entries, drafts, draft_index, kmax, host_drafts, publish,
                         flags, flag_byte);
}

// One group of the FP8 head over a tile of M rows: ROWS_BATCH weight rows per warp, logits of tile
// row i into logits + i * n, lane i's candidate for tile row i. False once the warp is past n.
template <int M>
__device__ __forceinline__ bool head_fp8_group_batch(const uint8_t* __restrict__ wq, const float* __restrict__ scale,
                                                     const uint16_t* __restrict__ x, uint16_t* __restrict__ logits,
                                                     uint32_t g, uint32_t n, uint32_t k, int mode,
                                                     unsigned long long& cand) {
    constexpr int R = ROWS_BATCH;
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (g * WARPS + (threadIdx.x >> 5)) * R;
    if (row0 >= n) return false;  // warp-uniform; later groups only have larger rows
    const float sc = (lane < (uint32_t)R && row0 + lane < n) ? scale[row0 + lane] : 0.0f;
    float dot[R][M];
    fp8_tile_dots<R, M, U_BATCH>(wq, x, row0, n, k, mode, dot);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = __shfl_sync(0xFFFFFFFFu, sc, r);
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (lane == (uint32_t)i && row0 + r < n) {
                const unsigned long long c = store_logit(__fmul_rn(s, dot[r][i]), row0 + r, logits + (size_t)i * n);
                cand = c > cand ? c : cand;
            }
        }
    }
    return true;
}

template <int M>
__device__ __forceinline__ void head_fp8_groups_batch(const uint8_t* __restrict__ wq, const float* __restrict__ scale,
                                                      const uint16_t* __restrict__ x, uint16_t* __restrict__ logits,
                                                      const HeadBatchShape& s, uint32_t n, uint32_t k, int mode,
                                                      unsigned long long& cand) {
    const uint32_t groups = (n + WARPS * ROWS_BATCH - 1) / (WARPS * ROWS_BATCH);
    for (uint32_t g = s.gfirst; g < groups; g += s.stride)
        if (!head_fp8_group_batch<M>(wq, scale, x, logits, g, n, k, mode, cand)) break;
}
}  // namespace

// Grid: tiles x the blocks per tile (the launch helper: gridDim.x a multiple of tiles, at most the
// blocks resident at once), block 256, dynamic shared memory tmax * k * 4 bytes for the staged x
// tile (without it x is read from global memory; same bits). __launch_bounds__(256, 4): 64
// registers, which its m = 1 path needs for 4 blocks per SM.
extern "C" __global__ void __launch_bounds__(256, 4) head_argmax_fp8_batch(
    const uint8_t* __restrict__ wq, const float* __restrict__ scale, const uint16_t* __restrict__ x,
    uint16_t* __restrict__ logits, unsigned long long* keys, uint32_t* counter, uint32_t* entries, uint32_t* drafts,
    uint32_t draft_index, uint32_t kmax, uint32_t* __restrict__ host_drafts, uint32_t publish, uint32_t m, uint32_t n,
    uint32_t k, uint8_t* __restrict__ flags, uint32_t flag_byte, uint32_t tiles) {
    constexpr int ROWS = ROWS_FP8;
    const uint32_t lane = threadIdx.x & 31;
    const HeadBatchShape s = head_batch_shape(m, tiles);
    const int mode = fp8_x_mode(wq, x, k, s.tmax);
    const uint16_t* xt = x + (size_t)s.tile.e0 * k;
    uint16_t* lt = logits + (size_t)s.tile.e0 * n;
    const bool single = s.tmax == 1u;
    // One row per tile: the one-row groups (head_fp8_group), the first weight batch loaded before the wait.
    const uint32_t groups1 = (n + WARPS * ROWS - 1) / (WARPS * ROWS);
    const uint32_t first_row0 = (s.gfirst * WARPS + (threadIdx.x >> 5)) * ROWS;
    const bool pre_ok = s.active && single && mode == XS_SMEM && (k >> 4) >= 32u * U_FP8 && s.gfirst < groups1 &&
                        first_row0 < n;
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
    const uint32_t live = s.active ? tile_live(entries, s.tile) : 0u;  // block-uniform
    unsigned long long cand = 0ull;
    if (live) {
        if (mode == XS_SMEM) stage_x(xt, s.tile.rows, k);  // every thread of the block
        if (single) {
            const bool vec = mode != XS_SCALAR, smem = mode == XS_SMEM;
            uint32_t g = s.gfirst;
            if (pre_ok) {
                head_fp8_group<true>(wq, scale, xt, lt, g, n, k, vec, smem, pre, cand);
                g += s.stride;
            }
            for (; g < groups1; g += s.stride)
                if (!head_fp8_group<false>(wq, scale, xt, lt, g, n, k, vec, smem, pre, cand)) break;
            cand = warp_max_key(cand);
            cand = lane == 0 ? cand : 0ull;
        } else {
            switch (s.tile.rows) {
                case 1: head_fp8_groups_batch<1>(wq, scale, xt, lt, s, n, k, mode, cand); break;
                case 2: head_fp8_groups_batch<2>(wq, scale, xt, lt, s, n, k, mode, cand); break;
                case 3: head_fp8_groups_batch<3>(wq, scale, xt, lt, s, n, k, mode, cand); break;
                default: head_fp8_groups_batch<4>(wq, scale, xt, lt, s, n, k, mode, cand); break;
            }
        }
    }
    argmax_commit_batch(cand, m, tiles, keys, counter, entries, drafts, draft_index, kmax, host_drafts, publish, flags,
                        flag_byte);
}

namespace {
// stage_x for the BF16 head's 8-weight chunks: float4 ((i * 2 + h) * (k / 8) + c) holds elements
// 8c + 4h .. 8c + 4h + 3 of row i as f32, so lane-consecutive chunks read consecutive float4s.
// Needs k % 8 == 0, x 16-byte aligned and rows * k * 4 bytes of dynamic shared memory; ends with a
// barrier (call from every thread of the block).
__device__ __forceinline__ void stage_x8(const uint16_t* __restrict__ x, uint32_t rows, uint32_t k) {
    const uint32_t kc = k / 8u;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (uint32_t j = threadIdx.x; j < rows * kc; j += blockDim.x) {
        const uint32_t i = j / kc, c = j % kc;
        const uint4 v = __ldcg(xv + j);  // L2: x may come from a kernel that released early
        x_smem[(i * 2u) * kc + c] = make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
        x_smem[(i * 2u + 1u) * kc + c] = make_float4(bf16_lo(v.z), bf16_hi(v.z), bf16_lo(v.w), bf16_hi(v.w));
    }
    __syncthreads();
}

// Elements 8c + 4h .. 8c + 4h + 3 of tile row i as f32 (staged, or from global memory through L2).
template <int MODE>
__device__ __forceinline__ float4 x_quarter8(const uint16_t* __restrict__ x, int i, int h, uint32_t c, uint32_t k) {
    if (MODE == XS_SMEM) return x_smem[((uint32_t)i * 2u + (uint32_t)h) * (k >> 3) + c];
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(x + (size_t)i * k + 8u * c + 4u * (uint32_t)h));
    return make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
}

// acc[r][i] += the lane's 8-weight chunks of BF16 row w[r] times tile row i, in warp_gemv_bf16's
// order: chunks c = lane, lane + 32, ..., within a chunk dot8_bf16's element order; the scalar mode
// is its element-wise path (k % 8 != 0 or an unaligned pointer).
template <int R, int M, int U, int MODE>
__device__ __forceinline__ void bf16_tile_dot(const uint16_t* const (&w)[R], const uint16_t* __restrict__ x, uint32_t k,
                                              float (&acc)[R][M]) {
    const uint32_t lane = threadIdx.x & 31;
    if (MODE == XS_SCALAR) {
        for (uint32_t j = lane; j < k; j += 32u) {
            float wf[R];
#pragma unroll
            for (int r = 0; r < R; ++r) wf[r] = bf16_bits_to_f32(w[r][j]);
#pragma unroll
            for (int i = 0; i < M; ++i) {
                const float xi = bf16_bits_to_f32(__ldcg(x + (size_t)i * k + j));
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r][i] = fmaf(wf[r], xi, acc[r][i]);
            }
        }
        return;
    }
    const uint32_t kc = k >> 3;
    for (uint32_t c0 = lane; c0 < kc; c0 += 32u * U) {
        uint4 wv[R][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t c = c0 + 32u * u;
#pragma unroll
            for (int r = 0; r < R; ++r)
                wv[r][u] = c < kc ? ld_stream16(reinterpret_cast<const uint4*>(w[r]) + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t c = c0 + 32u * u;
            if (c < kc) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float4 xf[M];
#pragma unroll
                    for (int i = 0; i < M; ++i) xf[i] = x_quarter8<MODE>(x, i, h, c, k);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const uint32_t a = word_of(wv[r][u], 2 * h), b = word_of(wv[r][u], 2 * h + 1);
                        const float f0 = bf16_lo(a), f1 = bf16_hi(a), f2 = bf16_lo(b), f3 = bf16_hi(b);
#pragma unroll
                        for (int i = 0; i < M; ++i) {
                            acc[r][i] = fmaf(f0, xf[i].x, acc[r][i]);
                            acc[r][i] = fmaf(f1, xf[i].y, acc[r][i]);
                            acc[r][i] = fmaf(f2, xf[i].z, acc[r][i]);
                            acc[r][i] = fmaf(f3, xf[i].w, acc[r][i]);
                        }
                    }
                }
            }
        }
    }
}

// One group of the BF16 head at one row of x: 8 warps x 2 rows, x from L2; FIRST: the warp's
// first weight batch is issued before the grid dependency wait and the release (warp_gemv_bf16).
// Lanes 0 and 1 fold their rows' keys into cand. False once the warp is past n (then with FIRST it
// has not waited: the caller waits after).
template <bool FIRST>
__device__ __forceinline__ bool head_bf16_group(const uint16_t* __restrict__ w, const uint16_t* __restrict__ x,
                                                uint16_t* __restrict__ logits, uint32_t g, uint32_t n, uint32_t k,
                                                bool vec, unsigned long long& cand) {
    constexpr int ROWS = ROWS_BF16;
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (g * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (row0 >= n) return false;
    const uint16_t* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = w + (size_t)min(row0 + r, n - 1) * k;
    float acc[ROWS] = {0.0f, 0.0f};
    warp_gemv_bf16<ROWS, 4, FIRST, FIRST, true>(wr, x, k, vec, acc);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == (uint32_t)r && row0 + r < n) {
            const unsigned long long c = store_logit(v, row0 + r, logits);
            cand = c > cand ? c : cand;
        }
    }
    return true;
}

// One group of the BF16 head over a tile of M rows (head_fp8_group_batch without the scale).
template <int M>
__device__ __forceinline__ bool head_bf16_group_batch(const uint16_t* __restrict__ w, const uint16_t* __restrict__ x,
                                                      uint16_t* __restrict__ logits, uint32_t g, uint32_t n,
                                                      uint32_t k, int mode, unsigned long long& cand) {
    constexpr int R = ROWS_BATCH;
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (g * WARPS + (threadIdx.x >> 5)) * R;
    if (row0 >= n) return false;
    const uint16_t* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w + (size_t)min(row0 + (uint32_t)r, n - 1u) * k;
    float dot[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) dot[r][i] = 0.0f;
    if (mode == XS_SMEM) bf16_tile_dot<R, M, U_BATCH, XS_SMEM>(wr, x, k, dot);
    else if (mode == XS_GLOBAL) bf16_tile_dot<R, M, U_BATCH, XS_GLOBAL>(wr, x, k, dot);
    else bf16_tile_dot<R, M, U_BATCH, XS_SCALAR>(wr, x, k, dot);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) {
            const float v = warp_sum(dot[r][i]);
            if (lane == (uint32_t)i && row0 + r < n) {
                const unsigned long long c = store_logit(v, row0 + r, logits + (size_t)i * n);
                cand = c > cand ? c : cand;
            }
        }
    return true;
}

template <int M>
__device__ __forceinline__ void head_bf16_groups_batch(const uint16_t* __restrict__ w, const uint16_t* __restrict__ x,
                                                       uint16_t* __restrict__ logits, uint32_t g0, uint32_t stride,
                                                       uint32_t n, uint32_t k, int mode, unsigned long long& cand) {
    const uint32_t groups = (n + WARPS * ROWS_BATCH - 1) / (WARPS * ROWS_BATCH);
    for (uint32_t g = g0; g < groups; g += stride)
        if (!head_bf16_group_batch<M>(w, x, logits, g, n, k, mode, cand)) break;
}
}  // namespace

// head_argmax_fp8_batch with the BF16 head. One row per tile (m = 1): head_bf16_group, one group per
// block (the launch helper's grid, x read from L2, the first weight batch issued
// before the wait); 2..4 rows: the tile staged in shared memory (tmax * k * 4 bytes) and the
// blocks grid-stride as the FP8 head's.
extern "C" __global__ void __launch_bounds__(256, 4) head_argmax_bf16_batch(
    const uint16_t* __restrict__ w, const uint16_t* __restrict__ x, uint16_t* __restrict__ logits,
    unsigned long long* keys, uint32_t* counter, uint32_t* entries, uint32_t* drafts, uint32_t draft_index,
    uint32_t kmax, uint32_t* __restrict__ host_drafts, uint32_t publish, uint32_t m, uint32_t n, uint32_t k,
    uint8_t* __restrict__ flags, uint32_t flag_byte, uint32_t tiles) {
    const uint32_t lane = threadIdx.x & 31;
    const HeadBatchShape s = head_batch_shape(m, tiles);
    const bool vec = (k % 8u == 0) && aligned16(w) && aligned16(x);
    const int mode = !vec ? XS_SCALAR : (size_t)s.tmax * k * 4u <= dynamic_smem_bytes() ? XS_SMEM : XS_GLOBAL;
    const uint16_t* xt = x + (size_t)s.tile.e0 * k;
    uint16_t* lt = logits + (size_t)s.tile.e0 * n;
    const bool single = s.tmax == 1u;
    const uint32_t groups1 = (n + WARPS * ROWS_BF16 - 1) / (WARPS * ROWS_BF16);
    unsigned long long cand = 0ull;
    uint32_t g = s.gfirst;
    // Its logits are scratch if the entry turns out to be padding (read after the wait).
    if (single && s.active && g < groups1) {
        head_bf16_group<true>(w, xt, lt, g, n, k, vec, cand);
        g += s.stride;
    }
    wait_then_release();  // a warp without rows in its first group has not waited
    const uint32_t live = s.active ? tile_live(entries, s.tile) : 0u;  // block-uniform
    if (live) {
        if (single) {
            // Later groups of a grid smaller than the groups (the launch helper gives one group per
            // block): the tile code for one row, x from global memory, the same bits. A second
            // head_bf16_group loop spilled registers.
            head_bf16_groups_batch<1>(w, xt, lt, g, s.stride, n, k, vec ? XS_GLOBAL : XS_SCALAR, cand);
        } else {
            if (mode == XS_SMEM) stage_x8(xt, s.tile.rows, k);  // every thread of the block
            switch (s.tile.rows) {
                case 1: head_bf16_groups_batch<1>(w, xt, lt, s.gfirst, s.stride, n, k, mode, cand); break;
                case 2: head_bf16_groups_batch<2>(w, xt, lt, s.gfirst, s.stride, n, k, mode, cand); break;
                case 3: head_bf16_groups_batch<3>(w, xt, lt, s.gfirst, s.stride, n, k, mode, cand); break;
                default: head_bf16_groups_batch<4>(w, xt, lt, s.gfirst, s.stride, n, k, mode, cand); break;
            }
        }
    }
    if (single) {
        cand = warp_max_key(cand);
        cand = lane == 0 ? cand : 0ull;
    }
    argmax_commit_batch(cand, m, tiles, keys, counter, entries, drafts, draft_index, kmax, host_drafts, publish, flags,
                        flag_byte);
}

// ---- the tensor-core variant, first form -----------------------------------------------------------
//
// head_argmax_fp8_mma_v1: the tensor-core head before head_argmax_fp8_mma (below), which replaced it
// with the same bits; kept for comparison (bench/bench_head.py, the GPU tests' bit-for-bit check).
// head_argmax_fp8_batch's contract (the same arguments and commit), its logits
// from mma.sync.m16n8k16 with BF16 inputs and f32 accumulation. A warp's 16 weight rows are the
// MMA's M; a tile of up to 64 rows of x is up to eight n8 column groups (the MMA's N = 8), and each
// 64-element superblock of k is four MMAs per column group. The FP8 weights are dequantised to BF16
// in registers once per block (exact: E4M3 -> f16 -> f32 -> BF16 changes no value) and each A
// fragment feeds the MMAs of every column group of the tile, so a launch dequantises and reads the
// weights once per tile, ceil(m / 64) times, instead of once per 8 rows. The row scale multiplies the
// finished f32 sum and x is the BF16 it is, as in the CUDA-core heads; but the sum of each k16 step
// is the tensor core's own, so the logits are not the CUDA-core heads' bits (the GPU tests hold them
// to the twin within the GEMV bound).
//
// Batch invariance: a logit depends only on its weight row, its x row and the fixed order of the
// MMAs over k (superblocks in order, MMAs j = 0..3 within one, into the one accumulator of its
// column group starting from 0; an MMA's output column comes from its own column of B), never on
// m, the tile, the column group, the other rows, the row's place or the k-slicing of the staging.
// That order is the one the 8-row version of this kernel had, so its bits are kept.
//
// Fragments. Lane (g = lane / 4, t = lane % 4) loads the 16 weight bytes at superblock offset 16t
// of rows g and g + 8, and for column group c the 16 x values at the same offset of tile row
// 8c + g. MMA j (0..3) takes elements 16t + 4j .. 16t + 4j + 3 of them: its logical k pairs (2t,
// 2t + 1) and (2t + 8, 2t + 9) are the physical pairs (16t + 4j, +1) and (16t + 4j + 2, +3) for A
// and B alike, so each product pairs a weight with its own x, and the four MMAs cover the
// superblock's 64 k once. The last column group of a tile whose rows are not a multiple of 8 reads
// row rows - 1 for its missing columns (their results are dropped).
//
// x staging. The tile's x is staged in shared memory as BF16 by cp.async, row i of a k-slice of S
// superblocks at i * (128 S + 16) bytes, so lanes g and g + 1 fall an odd number of 16-byte bank
// groups apart and the 16-byte loads of a quarter warp are conflict-free. Dynamic shared memory of
// tmax * P bytes (tmax: the largest tile's rows) holding all of k (P >= 128 k / 64 + 16: up to 11
// rows at k = 4096 in 96 KB) gets one slice, staged once per block as a single-row kernel stages x.
// Otherwise it holds two buffers of S = (P / 2 - 16) / 128 superblocks a row, and every 128-row
// weight group walks the k-slices in turn, the accumulators held in registers across them: the
// next slice (the next group's first after a group's last) is copied into one buffer while the
// MMAs read the other, two barriers a slice (the weight groups run in step over the block, warps
// past n included).
//
// Needs k % 64 == 0, 16-byte aligned wq and x and P >= 288 (or one slice of all of k)
// (else the kernel computes nothing, every live entry commits the empty key: token 0,
// NONFINITE_NAN; the launch helper refuses such shapes).
namespace {
constexpr int MMA_ROWS = 16;  // weight rows per warp: the MMA's M
constexpr int MMA_N = 8;      // rows of x per column group: the MMA's N
constexpr int MMA_NG = 8;     // column groups per tile at most
constexpr int MMA_TILE = MMA_N * MMA_NG;  // rows of x per tile at most
constexpr int MMA_U = 4;      // superblocks per row per lane in flight: 128 bytes, as the FP8 head

// Two E4M3 bytes (the low 16 bits, low byte first) -> a BF16 pair (low byte in the low half), exact.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two) {
    uint32_t h;
    const uint16_t v = (uint16_t)(two & 0xFFFFu);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    uint32_t b;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(b) : "f"(f.y), "f"(f.x));  // first operand: the upper half
    return b;
}

__device__ __forceinline__ void mma_16816_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Superblocks [sb0, sb0 + cnt) of the tile's rows of x into shared memory from uint4 `buf` on, rows
// 8 * S + 1 uint4 apart (S: the slice length), by cp.async (L2 only, no registers: x may come from a
// kernel that released its dependents early) as one commit group. Every thread of the block; the
// caller waits (cp_async_wait) and then needs a barrier before any thread reads the slice.
__device__ __forceinline__ void issue_x_slice(const uint16_t* __restrict__ x, uint32_t rows, uint32_t k,
                                              uint32_t sb0, uint32_t cnt, uint32_t S, uint32_t buf) {
    const uint32_t per_row = 8u * cnt, kc = k / 8u;
    const uint4* xv = reinterpret_cast<const uint4*>(x) + 8u * sb0;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(x_smem) + 16u * buf;
    // Element j = r * per_row + c of the slice, j = threadIdx.x + i * blockDim.x: (r, c) stepped by
    // blockDim's quotient and remainder (two divisions a call, not two an element).
    const uint32_t dr = blockDim.x / per_row, dc = blockDim.x % per_row;
    uint32_t r = threadIdx.x / per_row, c = threadIdx.x % per_row;
    for (; r < rows;) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + 16u * (r * (8u * S + 1u) + c)),
                     "l"(xv + (size_t)r * kc + c)
                     : "memory");
        r += dr;
        c += dc;
        if (c >= per_row) {
            c -= per_row;
            ++r;
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Every commit group of this thread but the newest N is complete.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// One superblock's MMAs for column groups 0 .. NG - 1 (off: its uint4 offset in the slice), four
// groups at a time: their x first, then MMA j of each before MMA j + 1 of any, so that consecutive
// MMAs go to independent accumulators (with a branch per group, ptxas issued each group's four
// dependent MMAs back to back behind its loads). Each accumulator still takes MMAs j = 0..3 in
// order, so the bits are those of one group at a time.
template <int NG>
__device__ __forceinline__ void mma_groups(const uint32_t (&a)[4][4], const uint4* xs, const uint32_t (&xrow)[MMA_NG],
                                           uint32_t off, float (&acc)[MMA_NG][4]) {
    constexpr int Q = NG < 4 ? NG : 4;
#pragma unroll
    for (int c0 = 0; c0 < NG; c0 += Q) {
        uint4 x0[Q], x1[Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            x0[q] = xs[xrow[c0 + q] + off];
            x1[q] = xs[xrow[c0 + q] + off + 1u];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < Q; ++q) {
                const uint4& xh = j < 2 ? x0[q] : x1[q];
                mma_16816_bf16(acc[c0 + q], a[j][0], a[j][1], a[j][2], a[j][3], word_of(xh, 2 * (j & 1)),
                               word_of(xh, 2 * (j & 1) + 1));
            }
    }
}

// acc[c] += the MMAs of superblocks [sb0, sb1) of weight rows w0 / w1 (lane pointers at offset 16t,
// superblock sb at + 64 sb) with column groups c < NG (those past the tile's groups read its last
// row; their results are dropped), x of the slice (superblock sb0 on) staged from uint4 `buf` on.
// xrow[c]: the uint4 offset in a slice of column group c's row of x for this lane (g's row, 2t's
// chunk).
template <int NG>
__device__ __forceinline__ void mma_slice(const uint8_t* __restrict__ w0, const uint8_t* __restrict__ w1,
                                          uint32_t sb0, uint32_t sb1, uint32_t nsb, uint32_t buf,
                                          const uint32_t (&xrow)[MMA_NG], float (&acc)[MMA_NG][4]) {
    const uint4* xs = reinterpret_cast<const uint4*>(x_smem) + buf;
    for (uint32_t b0 = sb0; b0 < sb1; b0 += MMA_U) {
        uint4 wa[MMA_U], wb[MMA_U];
#pragma unroll
        for (int u = 0; u < MMA_U; ++u) {
            const uint32_t sb = b0 + u;
            wa[u] = sb < sb1 ? ld_stream16(w0 + 64u * sb) : make_uint4(0, 0, 0, 0);
            wb[u] = sb < sb1 ? ld_stream16(w1 + 64u * sb) : make_uint4(0, 0, 0, 0);
        }
        // The next batch of the same rows (past the slice too: the next slice's first) towards L2,
        // so its loads wait on L2 rather than HBM: twice the bytes in flight without registers,
        // which the 16 warps a SM of this kernel need to stream at m = 1.
#pragma unroll
        for (int u = 0; u < MMA_U; ++u) {
            const uint32_t sb = b0 + MMA_U + u;
            if (sb < nsb) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(w0 + 64u * sb));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(w1 + 64u * sb));
            }
        }
#pragma unroll
        for (int u = 0; u < MMA_U; ++u) {
            const uint32_t sb = b0 + u;
            if (sb < sb1) {
                uint32_t a[4][4];  // the superblock's four A fragments, dequantised once
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint32_t p = word_of(wa[u], j), q = word_of(wb[u], j);
                    a[j][0] = e4m3x2_to_bf16x2(p);
                    a[j][1] = e4m3x2_to_bf16x2(q);
                    a[j][2] = e4m3x2_to_bf16x2(p >> 16);
                    a[j][3] = e4m3x2_to_bf16x2(q >> 16);
                }
                const uint32_t off = 8u * (sb - sb0);
                mma_groups<NG>(a, xs, xrow, off, acc);
            }
        }
    }
}

// Logit (row, col) of the group into the tile's logits; its key, or 0 outside the tile.
__device__ __forceinline__ unsigned long long mma_store(float v, float sc, uint32_t row, uint32_t col, uint32_t n,
                                                        uint32_t rows, uint16_t* __restrict__ logits) {
    if (row < n && col < rows) return store_logit(__fmul_rn(sc, v), row, logits + (size_t)col * n);
    return 0ull;
}

// The max of a key over the 8 lanes of each t (lane bits 2..4): lanes 0..3 hold it.
__device__ __forceinline__ unsigned long long max_over_g(unsigned long long c) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        const unsigned long long other = __shfl_xor_sync(0xFFFFFFFFu, c, o);
        c = other > c ? other : c;
    }
    return c;
}

// True when any row of the tile is a live entry (block-uniform; through L2, after the wait).
__device__ __forceinline__ bool tile_any_live(const uint32_t* entries, const BatchTile& tile) {
    for (uint32_t i = 0; i < tile.rows; ++i)
        if (__ldcg(entries + (size_t)(tile.e0 + i) * ENTRY_WORDS) != BATCH_PAD) return true;
    return false;
}
}  // namespace

// Grid: tiles x the blocks per tile (gridDim.x a multiple of tiles), block 256: 8 warps x 16 rows =
// 128-row weight groups, grid-stride; dynamic shared memory tmax * P bytes (x staging, above).
// __launch_bounds__(256, 2): the eight column groups' accumulators (32 registers) beside the 128
// bytes per lane of weights in flight and a superblock's A fragments (16) need more than 64
// registers (ptxas -v, nvcc 13.0: 128, no spills), so 16 warps a SM; the L2 prefetches of the next
// weight batch (mma_slice) and of the first two before the wait keep about as many bytes in flight
// as the 32 warps of the 64-register heads do at m = 1.
extern "C" __global__ void __launch_bounds__(256, 2) head_argmax_fp8_mma_v1(
    const uint8_t* __restrict__ wq, const float* __restrict__ scale, const uint16_t* __restrict__ x,
    uint16_t* __restrict__ logits, unsigned long long* keys, uint32_t* counter, uint32_t* entries, uint32_t* drafts,
    uint32_t draft_index, uint32_t kmax, uint32_t* __restrict__ host_drafts, uint32_t publish, uint32_t m, uint32_t n,
    uint32_t k, uint8_t* __restrict__ flags, uint32_t flag_byte, uint32_t tiles) {
    __shared__ unsigned long long best_s[WARPS][MMA_TILE];  // warp w's best key per tile row
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    best_s[warp][lane] = 0ull;
    best_s[warp][lane + 32u] = 0ull;
    const HeadBatchShape s = head_batch_shape<MMA_TILE>(m, tiles);
    const uint32_t nsb = k / 64u;
    const uint32_t per_row = dynamic_smem_bytes() / s.tmax;  // P
    const bool whole = per_row >= 128u * nsb + 16u;          // one slice, staged once
    const uint32_t S = whole ? nsb : per_row >= 288u ? (per_row / 2u - 16u) / 128u : 0u;
    const bool shape_ok = k % 64u == 0 && k > 0 && aligned16(wq) && aligned16(x) && S > 0u;
    const uint32_t groups = (n + WARPS * MMA_ROWS - 1) / (WARPS * MMA_ROWS);
    {
        // The first group's first two weight batches towards L2 before the wait (weights only: no
        // kernel writes them), so that the stream starts under the previous kernel's tail as the
        // single-row head's does; a block whose tile turns out to be padding wasted them.
        const uint32_t row0 = (s.gfirst * WARPS + warp) * MMA_ROWS;
        if (s.active && shape_ok && s.gfirst < groups && row0 < n) {
            const uint8_t* w0 = wq + (size_t)min(row0 + g, n - 1u) * k + 16u * t;
            const uint8_t* w1 = wq + (size_t)min(row0 + g + 8u, n - 1u) * k + 16u * t;
            for (uint32_t sb = 0; sb < min(nsb, 2u * MMA_U); ++sb) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(w0 + 64u * sb));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(w1 + 64u * sb));
            }
        }
    }
    wait_then_release();
    const bool live = s.active && shape_ok && tile_any_live(entries, s.tile);  // block-uniform
    if (live) {
        const uint32_t rows = s.tile.rows, ngc = (rows + MMA_N - 1u) / MMA_N;
        const uint32_t nslices = (nsb + S - 1u) / S;  // 1 when whole, else >= 2
        const uint32_t bufsize = rows * (8u * S + 1u);  // uint4 per buffer
        const uint16_t* xt = x + (size_t)s.tile.e0 * k;
        uint16_t* lt = logits + (size_t)s.tile.e0 * n;
        uint32_t xrow[MMA_NG];
#pragma unroll
        for (int c = 0; c < MMA_NG; ++c) xrow[c] = min((uint32_t)c * MMA_N + g, rows - 1u) * (8u * S + 1u) + 2u * t;
        issue_x_slice(xt, rows, k, 0u, S, S, 0u);  // all of k when whole, else slice 0 into buffer 0
        if (whole) {
            cp_async_wait<0>();
            __syncthreads();
        }
        uint32_t it = 0;  // (group, slice) steps so far: the buffer is it & 1
        for (uint32_t gi = s.gfirst; gi < groups; gi += s.stride) {  // block-uniform
            const uint32_t row0 = (gi * WARPS + warp) * MMA_ROWS;
            const bool mine = row0 < n;  // warp-uniform; a warp past n still joins the barriers
            const uint8_t* w0 = wq + (size_t)min(row0 + g, n - 1u) * k + 16u * t;
            const uint8_t* w1 = wq + (size_t)min(row0 + g + 8u, n - 1u) * k + 16u * t;
            float acc[MMA_NG][4];
#pragma unroll
            for (int c = 0; c < MMA_NG; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;
            for (uint32_t sl = 0; sl < nslices; ++sl, ++it) {  // one step when whole
                if (!whole) {
                    // The next step's slice into the other buffer (its last reader finished before
                    // the barrier that ended the previous step), then this step's slice complete and
                    // seen by every thread.
                    const uint32_t nx = sl + 1u < nslices ? sl + 1u : 0u;
                    if (sl + 1u < nslices || gi + s.stride < groups)
                        issue_x_slice(xt, rows, k, nx * S, min(S, nsb - nx * S), S, ((it + 1u) & 1u) * bufsize);
                    else
                        asm volatile("cp.async.commit_group;" ::: "memory");  // keeps wait_group 1 exact
                    cp_async_wait<1>();
                    __syncthreads();
                }
                const uint32_t s0 = sl * S, buf = whole ? 0u : (it & 1u) * bufsize;
                if (mine) {  // the tile's column groups rounded up to a power of two (block-uniform)
                    const uint32_t s1 = min(nsb, s0 + S);
                    if (ngc <= 1u) mma_slice<1>(w0, w1, s0, s1, nsb, buf, xrow, acc);
                    else if (ngc <= 2u) mma_slice<2>(w0, w1, s0, s1, nsb, buf, xrow, acc);
                    else if (ngc <= 4u) mma_slice<4>(w0, w1, s0, s1, nsb, buf, xrow, acc);
                    else mma_slice<8>(w0, w1, s0, s1, nsb, buf, xrow, acc);
                }
                if (!whole) __syncthreads();  // every warp is done with this buffer before it is refilled
            }
            if (!mine) continue;
            const uint32_t ra = row0 + g, rb = row0 + g + 8u;
            const float sa = ra < n ? scale[ra] : 0.0f, sbb = rb < n ? scale[rb] : 0.0f;
#pragma unroll
            for (int c = 0; c < MMA_NG; ++c) {
                if ((uint32_t)c < ngc) {
                    const uint32_t c0 = (uint32_t)c * MMA_N + 2u * t;  // this lane's tile rows c0, c0 + 1
                    unsigned long long k0 = mma_store(acc[c][0], sa, ra, c0, n, rows, lt);
                    unsigned long long k1 = mma_store(acc[c][1], sa, ra, c0 + 1u, n, rows, lt);
                    const unsigned long long k2 = mma_store(acc[c][2], sbb, rb, c0, n, rows, lt);
                    const unsigned long long k3 = mma_store(acc[c][3], sbb, rb, c0 + 1u, n, rows, lt);
                    k0 = max_over_g(k2 > k0 ? k2 : k0);
                    k1 = max_over_g(k3 > k1 ? k3 : k1);
                    if (g == 0u) {  // lane t owns best_s[warp][c0], [c0 + 1]: no other lane writes them
                        best_s[warp][c0] = k0 > best_s[warp][c0] ? k0 : best_s[warp][c0];
                        best_s[warp][c0 + 1u] = k1 > best_s[warp][c0 + 1u] ? k1 : best_s[warp][c0 + 1u];
                    }
                }
            }
        }
        cp_async_wait<0>();  // none in flight when the block exits (the last step issued an empty group)
    }
    __syncthreads();
    commit_tile_keys<MMA_TILE>(best_s, m, tiles, keys, counter, entries, drafts, draft_index, kmax, host_drafts,
                               publish, flags, flag_byte);
}

// ---- the tensor-core head: two weight tiles a warp ------------------------------------------------
//
// head_argmax_fp8_mma: head_argmax_fp8_mma_v1's contract, tiles of x (up to 64 rows, balanced, the
// same tiling), fragments and arithmetic, so every logit and commit bit for bit (the GPU tests
// compare the two kernels), reorganised for throughput at 16..256 rows. v1 measured on the H200
// (one eager propose of 3 drafts, kernels timed one by one, no PDL): 1.52 ms a launch at m = 256
// (4 tiles; 325 GFLOP: about 214 TFLOP/s) and 0.44 ms at m = 64 (about 186 TFLOP/s), against a
// byte floor of 0.15 ms (635 MB at 4.25 TB/s) and a mma.sync BF16 rate of several hundred
// TFLOP/s. What v1 spends per HMMA (m16n8k16), at 64 rows of x:
// - the widening: cvt.rn.f16x2.e4m3x2, two f16 -> f32 and a BF16 pack per weight pair (SASS of its
//   loop: 58 F2FP.F16.E4M3.UNPACK_B, 117 HADD2.F32, 59 F2FP.BF16.PACK_AB, 29 SHF per 128 HMMA);
// - 256 bytes of shared memory (two 16-byte x loads per column group feed its four MMAs), which
//   caps an SM at 0.5 HMMA a clock (128 B/clk); and 64 bytes of L2 -> SM traffic (each 128-row
//   weight group's 512 KB of FP8 plus the tile's 512 KB of x, re-staged for every weight group):
//   at twice v1's rate that is about 6 TB/s, the L2's whole bandwidth;
// - two block barriers per k-slice of 5 superblocks (96 KB of x per block, two blocks an SM),
//   after each of which every warp waits on its weight loads at once.
// This kernel:
// - widens by the byte permute of ptx/mma_bf16.cuh (e4m3x4_to_bf16x2: 8 integer / BF16x2
//   instructions per 4 weights and no conversion instruction; the same BF16 values, so the same
//   MMA inputs);
// - gives each warp 32 weight rows (two M tiles 16 rows apart; a row sits at the M position it has
//   in v1, row % 16), so each x fragment loaded from shared memory feeds two MMAs: 128 bytes of
//   shared memory a HMMA; the block's 8 warps cover 256 weight rows, so one pass over the tile's x
//   serves twice v1's weights: 48 bytes of L2 traffic a HMMA;
// - holds one block an SM (__launch_bounds__(256, 1): 64 accumulators, 32 widened A registers,
//   two superblocks of raw weights and four column groups of x a lane; ptxas -v, nvcc 13.0: 240
//   registers, no spills) with up to 210 KB of x: k-slices of 13 superblocks at 64 rows (5 a weight
//   group at k = 4096, against v1's 13), all of k once per block up to 26 rows; one barrier a slice
//   (wait for the slice's copies, barrier; the next slice's copies into the buffer the previous
//   step read are issued a few superblocks at a time between the MMAs of the slice's first half);
// - stages x superblock-major ([superblock][row][64 elements], a row's 16-byte chunks XOR-swizzled
//   by the row's parity: the quarter warps' loads are conflict-free without padding), so a column
//   group's loads sit at an immediate offset (1 KB a group) from one base register per superblock
//   (v1 recomputed each group's address per superblock). Not ldmatrix: a lane's B fragments for the
//   four MMAs of a superblock are its own 32 contiguous bytes (the k pairs of MMA j are elements
//   16t + 4j ..), two 16-byte loads; ldmatrix.x4 also gives 16 bytes a lane an instruction;
// - keeps the weight stream two superblocks ahead in registers (superblock sb + 2's loads issued
//   once sb is widened) and eight ahead in L2 (one prefetch per 128-byte line, running on into
//   the block's next weight group; the first lines before the grid dependency wait).
// Tiles of 128 rows (16 column groups: the weights widened and read half as often at m >= 128)
// would need 128 accumulators a lane with two M tiles, or lose the x reuse with one: the shared
// memory and L2 figures above favour two M tiles. The tile's column groups are a template at every
// count 1..8 (v1 rounded up to a power of two: 8 groups' MMAs for 33..40 rows). Weight groups of
// 256 rows over 132 blocks: 605 groups in 5 rounds at m = 64 (4.58 a block, 92% balanced), 2420
// in 19 at m = 256 (4 tiles, 96%).
//
// The MMA order is v1's: per (weight row, x row) one accumulator from 0, superblocks in order, MMAs
// j = 0..3 within one, the same k pairs per MMA; then the scale multiply and the BF16 rounding.
// Neither the M tile, the column group, the tile, the slicing nor the grid changes a bit (batch
// invariance, SPEC.md, as v1). bench/bench_head.py times the two kernels side by side.
//
// E4M3 NaN codes: 0x7F / 0xFF widen to +-480 here (ptx/mma_bf16.cuh), to NaN in v1 and the twin.
// quantize_fp8 saturates every finite weight to +-448 (only a NaN in its BF16 source gives a NaN
// code), so for every finite head the outputs are v1's.
//
// Needs k % 64 == 0, 16-byte aligned wq and x and P >= 256 (P: bytes of dynamic shared memory per
// row of the largest tile; else the kernel computes nothing and every live entry commits the
// empty key, token 0, NONFINITE_NAN; the launch helper refuses such shapes).
namespace {
constexpr int MMA2_MT = 2;                           // M tiles (16 weight rows each) a warp
constexpr uint32_t MMA2_WROWS = MMA_ROWS * MMA2_MT;  // weight rows a warp: 32
constexpr int MMA2_Q = 4;                            // column groups whose x is loaded together
constexpr uint32_t MMA2_PF = 8;                      // L2 prefetch distance in superblocks (even)

// The lane's four weight rows (row0 + g + 8i, i = 0..3; past n: row n - 1) at offset 16t.
struct Mma2Rows {
    const uint8_t* w[4];
};

__device__ __forceinline__ Mma2Rows mma2_rows(const uint8_t* __restrict__ wq, uint32_t row0, uint32_t n, uint32_t k,
                                              uint32_t g, uint32_t t) {
    Mma2Rows r;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[i] = wq + (size_t)min(row0 + g + 8u * (uint32_t)i, n - 1u) * k + 16u * t;
    return r;
}

__device__ __forceinline__ void mma2_load(const Mma2Rows& r, uint32_t sb, uint4 (&raw)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) raw[i] = ld_stream16(r.w[i] + 64u * sb);
}

// The line of superblock sb of each of the four rows towards L2.
__device__ __forceinline__ void mma2_prefetch(const Mma2Rows& r, uint32_t sb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("prefetch.global.L2 [%0];" ::"l"(r.w[i] + 64u * sb));
}

// A fragments of one superblock for both M tiles: a[mt][j] = MMA j's {a0, a1, a2, a3} from rows
// g + 16 mt (raw[2 mt]) and g + 8 + 16 mt (raw[2 mt + 1]). Word j of a row holds its weights
// 16t + 4j .. + 3: the low pair is MMA j's k pair (2t, 2t + 1), the high pair (2t + 8, 2t + 9),
// what v1's e4m3x2_to_bf16x2 of the word and of the word >> 16 give.
__device__ __forceinline__ void mma2_widen(const uint4 (&raw)[4], uint32_t (&a)[MMA2_MT][4][4]) {
#pragma unroll
    for (int mt = 0; mt < MMA2_MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            e4m3x4_to_bf16x2(word_of(raw[2 * mt], j), a[mt][j][0], a[mt][j][2]);
            e4m3x4_to_bf16x2(word_of(raw[2 * mt + 1], j), a[mt][j][1], a[mt][j][3]);
        }
}

// The lane's x chunks in a superblock of the staged slice (uint4 indices from the superblock's
// first): column group c < NG - 1 at b0 / b1 + 64c (row 8c + g: its parity is g's), the last group
// at l0 / l1 (its row clamped to the tile's last). x0 holds elements 16t .. 16t + 7, x1 the next 8.
struct Mma2X {
    uint32_t b0, b1, l0, l1;
};

template <int NG>
__device__ __forceinline__ Mma2X mma2_x_lanes(uint32_t rows, uint32_t g, uint32_t t) {
    const uint32_t rl = min((uint32_t)(NG - 1) * MMA_N + g, rows - 1u), p = g & 1u, pl = rl & 1u;
    return Mma2X{8u * g + ((2u * t) ^ p), 8u * g + ((2u * t + 1u) ^ p), 8u * rl + ((2u * t) ^ pl),
                 8u * rl + ((2u * t + 1u) ^ pl)};
}

// One superblock's MMAs for column groups 0 .. NG - 1 and both M tiles (xs: the superblock's first
// uint4 in the slice), MMA2_Q groups at a time: their x first, then MMA j of every group and tile
// before MMA j + 1 of any. Each accumulator takes j = 0..3 in order: v1's bits.
template <int NG>
__device__ __forceinline__ void mma2_groups(const uint32_t (&a)[MMA2_MT][4][4], const uint4* xs, const Mma2X& xl,
                                            float (&acc)[MMA2_MT][NG][4]) {
    constexpr int Q = NG < MMA2_Q ? NG : MMA2_Q;
#pragma unroll
    for (int c0 = 0; c0 < NG; c0 += Q) {
        uint4 x0[Q], x1[Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const int c = c0 + q;
            if (c < NG - 1) {
                x0[q] = xs[xl.b0 + 64u * (uint32_t)c];
                x1[q] = xs[xl.b1 + 64u * (uint32_t)c];
            } else if (c == NG - 1) {
                x0[q] = xs[xl.l0];
                x1[q] = xs[xl.l1];
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < Q; ++q)
#pragma unroll
                for (int mt = 0; mt < MMA2_MT; ++mt)
                    if (c0 + q < NG) {
                        const uint4& xh = j < 2 ? x0[q] : x1[q];
                        mma_16816_bf16(acc[mt][c0 + q], a[mt][j][0], a[mt][j][1], a[mt][j][2], a[mt][j][3],
                                       word_of(xh, 2 * (j & 1)), word_of(xh, 2 * (j & 1) + 1));
                    }
    }
}

// Superblocks [sb0, sb0 + cnt) of the tile's `rows` rows of x into shared memory from uint4 `buf`
// on: superblock i of the slice, row r at uint4 (i * rows + r) * 8, its chunk u (elements 8u ..
// 8u + 7) at + (u ^ (r & 1)). By cp.async (L2 only: x may come from a kernel that released its
// dependents early) as one commit group; every thread of the block.
__device__ __forceinline__ void mma2_issue_x(const uint16_t* __restrict__ x, uint32_t rows, uint32_t k, uint32_t sb0,
                                             uint32_t cnt, uint32_t buf) {
    const uint32_t per_row = 8u * cnt, kc = k / 8u;
    const uint4* xv = reinterpret_cast<const uint4*>(x) + 8u * sb0;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(x_smem) + 16u * buf;
    // Element j = r * per_row + c, j = threadIdx.x + i * blockDim.x: (r, c) stepped by blockDim's
    // quotient and remainder.
    const uint32_t dr = blockDim.x / per_row, dc = blockDim.x % per_row;
    uint32_t r = threadIdx.x / per_row, c = threadIdx.x % per_row;
    for (; r < rows;) {
        const uint32_t dst = ((c >> 3) * rows + r) * 8u + ((c & 7u) ^ (r & 1u));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + 16u * dst), "l"(xv + (size_t)r * kc + c)
                     : "memory");
        r += dr;
        c += dc;
        if (c >= per_row) {
            c -= per_row;
            ++r;
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// The block's x staging through its weight groups (block-uniform). Step i (a slice of a group) is
// in buffer i & 1. A turn at a slice's first superblock waits for the slice's copies and passes the
// barrier (every thread's copies visible; every warp done with the buffer of step i - 1); step
// i + 1's slice (the group's next, or the next group's first) is then copied into that buffer a few
// superblocks at a time, at the first half of step i's superblocks (feed), so that the copies'
// issue runs between MMAs instead of stalling every warp after the barrier. Whole: all of k staged
// once, no turns.
struct Mma2Stage {
    const uint16_t* xt;
    uint32_t rows, k, nsb, S;
    bool whole;
    uint32_t it;       // steps begun: the current slice is in buffer (it - 1) & 1
    uint32_t s0;       // the current slice's first superblock
    uint32_t turn;     // the superblock of the next turn (0xFFFFFFFF: none in this group)
    uint32_t bufsize;  // uint4 a buffer: rows * 8 * S
    uint32_t nbuf, nsb0, ncnt;  // the next slice: its buffer, first superblock, superblocks (0: none)
    uint32_t fed, per;          // its superblocks copied so far, and per feed

    __device__ __forceinline__ uint32_t buf() const { return whole ? 0u : ((it - 1u) & 1u) * bufsize; }

    // At superblock sb == turn (more_groups: the block has a next weight group).
    __device__ __forceinline__ void step(uint32_t sb, bool more_groups) {
        cp_async_wait<0>();
        __syncthreads();
        const uint32_t nx = sb + S, len = min(S, nsb - sb);  // the slice this turn begins
        nbuf = ((it + 1u) & 1u) * bufsize;                    // step it begins; step it + 1's buffer
        nsb0 = nx < nsb ? nx : 0u;
        ncnt = nx < nsb ? min(S, nsb - nx) : more_groups ? S : 0u;  // S < nsb when sliced
        const uint32_t half = (len + 1u) / 2u;
        per = (ncnt + half - 1u) / half;
        fed = 0u;
        ++it;
        s0 = sb;
        turn = nx < nsb ? nx : 0xFFFFFFFFu;
    }

    // At every superblock of a slice, after its turn: the next slice's next `per` superblocks.
    __device__ __forceinline__ void feed() {
        if (fed < ncnt) {
            const uint32_t c = min(per, ncnt - fed);
            mma2_issue_x(xt, rows, k, nsb0 + fed, c, nbuf + fed * rows * 8u);
            fed += c;
        }
    }
};

// One 256-row weight group gi over the tile (every thread of the block: the turns hold barriers):
// warp w's rows row0 = (gi * 8 + w) * 32 .. + 31, rows past n not stored; its logits, and its best
// keys per tile row into best_s.
template <int NG>
__device__ __forceinline__ void mma2_group(const uint8_t* __restrict__ wq, const float* __restrict__ scale, uint32_t gi,
                                           uint32_t next_gi, uint32_t groups, uint32_t n, Mma2Stage& st,
                                           uint16_t* __restrict__ lt, unsigned long long (*best_s)[MMA_TILE]) {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const uint32_t row0 = (gi * WARPS + warp) * MMA2_WROWS;
    const bool mine = row0 < n;  // warp-uniform; a warp past n still takes every turn
    const bool more = next_gi < groups;
    const uint32_t nsb = st.nsb, k = st.k, rows = st.rows;
    const Mma2Rows wr = mma2_rows(wq, row0, n, k, g, t);
    const uint32_t next_row0 = (next_gi * WARPS + warp) * MMA2_WROWS;
    const bool next_mine = more && next_row0 < n;
    const Mma2X xl = mma2_x_lanes<NG>(rows, g, t);
    float acc[MMA2_MT][NG][4];
#pragma unroll
    for (int mt = 0; mt < MMA2_MT; ++mt)
#pragma unroll
        for (int c = 0; c < NG; ++c) acc[mt][c][0] = acc[mt][c][1] = acc[mt][c][2] = acc[mt][c][3] = 0.0f;
    uint4 ra[4], rb[4];  // the raw weights of superblocks sb (even) and sb + 1
    if (mine) {
        mma2_load(wr, 0u, ra);
        if (nsb > 1u) mma2_load(wr, 1u, rb);
    }
    st.turn = st.whole ? 0xFFFFFFFFu : 0u;
    // Superblock sb from raw (the buffer of its parity), which is then refilled with sb + 2.
    auto superblock = [&](uint32_t sb, uint4 (&raw)[4]) {
        if (sb == st.turn) st.step(sb, more);  // block-uniform
        st.feed();                              // every thread: its share of the copies
        if (!mine) return;
        uint32_t a[MMA2_MT][4][4];
        mma2_widen(raw, a);
        if (sb + 2u < nsb) mma2_load(wr, sb + 2u, raw);
        if ((sb & 1u) == 0u) {  // one prefetch a 128-byte line: every other superblock
            const uint32_t p = sb + MMA2_PF;
            if (p < nsb) mma2_prefetch(wr, p);
            else if (next_mine && p - nsb < nsb) mma2_prefetch(mma2_rows(wq, next_row0, n, k, g, t), p - nsb);
        }
        const uint4* xs = reinterpret_cast<const uint4*>(x_smem) + st.buf() + (sb - st.s0) * rows * 8u;
        mma2_groups<NG>(a, xs, xl, acc);
    };
    for (uint32_t sb = 0; sb < nsb; sb += 2u) {
        superblock(sb, ra);
        if (sb + 1u < nsb) superblock(sb + 1u, rb);
    }
    if (!mine) return;
    float sc[MMA2_MT][2];  // the scales of the lane's rows g + 16 mt and g + 8 + 16 mt
#pragma unroll
    for (int mt = 0; mt < MMA2_MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t r = row0 + (uint32_t)mt * MMA_ROWS + 8u * (uint32_t)h + g;
            sc[mt][h] = r < n ? scale[r] : 0.0f;
        }
#pragma unroll
    for (int c = 0; c < NG; ++c) {
        const uint32_t c0 = (uint32_t)c * MMA_N + 2u * t;  // this lane's tile rows c0, c0 + 1
        unsigned long long k0 = 0ull, k1 = 0ull;
#pragma unroll
        for (int mt = 0; mt < MMA2_MT; ++mt) {
            const uint32_t r0 = row0 + (uint32_t)mt * MMA_ROWS + g, r1 = r0 + 8u;
            const unsigned long long q0 = mma_store(acc[mt][c][0], sc[mt][0], r0, c0, n, rows, lt);
            const unsigned long long q1 = mma_store(acc[mt][c][1], sc[mt][0], r0, c0 + 1u, n, rows, lt);
            const unsigned long long q2 = mma_store(acc[mt][c][2], sc[mt][1], r1, c0, n, rows, lt);
            const unsigned long long q3 = mma_store(acc[mt][c][3], sc[mt][1], r1, c0 + 1u, n, rows, lt);
            k0 = q0 > k0 ? q0 : k0;
            k0 = q2 > k0 ? q2 : k0;
            k1 = q1 > k1 ? q1 : k1;
            k1 = q3 > k1 ? q3 : k1;
        }
        k0 = max_over_g(k0);
        k1 = max_over_g(k1);
        if (g == 0u) {  // lane t owns best_s[warp][c0], [c0 + 1]: no other lane writes them
            best_s[warp][c0] = k0 > best_s[warp][c0] ? k0 : best_s[warp][c0];
            best_s[warp][c0 + 1u] = k1 > best_s[warp][c0 + 1u] ? k1 : best_s[warp][c0 + 1u];
        }
    }
}
}  // namespace

// Grid: tiles x the blocks per tile (gridDim.x a multiple of tiles), block 256: 8 warps x 32 rows =
// 256-row weight groups, grid-stride; dynamic shared memory tmax * P bytes (up to 210 KB: one
// block an SM): all of k when P >= 2k, else two buffers of S = P / 256 superblocks.
extern "C" __global__ void __launch_bounds__(256, 1) head_argmax_fp8_mma(
    const uint8_t* __restrict__ wq, const float* __restrict__ scale, const uint16_t* __restrict__ x,
    uint16_t* __restrict__ logits, unsigned long long* keys, uint32_t* counter, uint32_t* entries, uint32_t* drafts,
    uint32_t draft_index, uint32_t kmax, uint32_t* __restrict__ host_drafts, uint32_t publish, uint32_t m, uint32_t n,
    uint32_t k, uint8_t* __restrict__ flags, uint32_t flag_byte, uint32_t tiles) {
    __shared__ unsigned long long best_s[WARPS][MMA_TILE];  // warp w's best key per tile row
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    best_s[warp][lane] = 0ull;
    best_s[warp][lane + 32u] = 0ull;
    const HeadBatchShape s = head_batch_shape<MMA_TILE>(m, tiles);
    const uint32_t nsb = k / 64u;
    const uint32_t per_row = dynamic_smem_bytes() / s.tmax;  // P
    const bool whole = per_row >= 128u * nsb;                // one slice, staged once
    const uint32_t S = whole ? nsb : per_row / 256u;
    const bool shape_ok = k % 64u == 0 && k > 0 && aligned16(wq) && aligned16(x) && S > 0u;
    const uint32_t groups = (n + WARPS * MMA2_WROWS - 1u) / (WARPS * MMA2_WROWS);
    {
        // The first group's first weight lines towards L2 before the wait (weights only: no kernel
        // writes them), so that the stream starts under the previous kernel's tail.
        const uint32_t row0 = (s.gfirst * WARPS + warp) * MMA2_WROWS;
        if (s.active && shape_ok && s.gfirst < groups && row0 < n) {
            const Mma2Rows r = mma2_rows(wq, row0, n, k, g, t);
            for (uint32_t sb = 0; sb < min(nsb, MMA2_PF + 2u); sb += 2u) mma2_prefetch(r, sb);
        }
    }
    wait_then_release();
    const bool live = s.active && shape_ok && tile_any_live(entries, s.tile);  // block-uniform
    if (live) {
        const uint32_t rows = s.tile.rows, ngc = (rows + MMA_N - 1u) / MMA_N;
        Mma2Stage st;
        st.xt = x + (size_t)s.tile.e0 * k;
        st.rows = rows;
        st.k = k;
        st.nsb = nsb;
        st.S = S;
        st.whole = whole;
        st.it = 0u;  // the prologue's slice is step 0's, in buffer 0; the first turn begins it
        st.s0 = 0u;
        st.turn = 0u;
        st.bufsize = rows * 8u * S;
        st.ncnt = st.fed = st.per = st.nbuf = st.nsb0 = 0u;
        uint16_t* lt = logits + (size_t)s.tile.e0 * n;
        mma2_issue_x(st.xt, rows, k, 0u, S, 0u);  // all of k when whole, else slice 0 into buffer 0
        if (whole) {
            cp_async_wait<0>();
            __syncthreads();
        }
        for (uint32_t gi = s.gfirst; gi < groups; gi += s.stride) {  // block-uniform
            const uint32_t nx = gi + s.stride;
            switch (ngc) {  // the tile's column groups exactly
                case 1: mma2_group<1>(wq, scale, gi, nx, groups, n, st, lt, best_s); break;
                case 2: mma2_group<2>(wq, scale, gi, nx, groups, n, st, lt, best_s); break;
                case 3: mma2_group<3>(wq, scale, gi, nx, groups, n, st, lt, best_s); break;
                case 4: mma2_group<4>(wq, scale, gi, nx, groups, n, st, lt, best_s); break;
                case 5: mma2_group<5>(wq, scale, gi, nx, groups, n, st, lt, best_s); break;
                case 6: mma2_group<6>(wq, scale, gi, nx, groups, n, st, lt, best_s); break;
                case 7: mma2_group<7>(wq, scale, gi, nx, groups, n, st, lt, best_s); break;
                default: mma2_group<8>(wq, scale, gi, nx, groups, n, st, lt, best_s); break;
            }
        }
        cp_async_wait<0>();  // none in flight when the block exits
    }
    __syncthreads();
    commit_tile_keys<MMA_TILE>(best_s, m, tiles, keys, counter, entries, drafts, draft_index, kmax, host_drafts,
                               publish, flags, flag_byte);
}

// ---- the sharded path over a batch ---------------------------------------------------------------
//
// gemv_fp8w_batch / the BF16 GEMV -> argmax_bf16_batch -> argmax_pack_batch -> an all-reduce MAX of
// the m keys -> draft_commit_batch: the key packing and the commit once per row. One block of 256
// threads, thread e for row e (m <= 256; the launch helper checks).

// keys[e] = the key of (idx[e] + v0, val[e]) for every row e < m, padding rows included (their
// rows of logits are scratch; the commit skips them).
extern "C" __global__ void __launch_bounds__(256) argmax_pack_batch(const uint32_t* __restrict__ idx,
                                                                    const float* __restrict__ val,
                                                                    unsigned long long* __restrict__ keys, uint32_t v0,
                                                                    uint32_t m) {
    const uint32_t e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= m) return;
    const uint32_t i = idx[e];
    keys[e] = i == 0xFFFFFFFFu ? 0ull : ((unsigned long long)ordered_key(val[e]) << 32) | (0xFFFFFFFFu - (i + v0));
}

// Every live entry e < m commits its all-reduced key as the fused head does (the entries' token
// word, drafts[e * kmax + draft_index], the flag byte flags[e * 4 + flag_byte], with publish the
// copy of drafts[e * kmax + 0 .. draft_index] to host_drafts); a padding entry writes nothing.
extern "C" __global__ void __launch_bounds__(256) draft_commit_batch(
    const unsigned long long* __restrict__ keys, uint32_t* entries, uint32_t* drafts, uint32_t draft_index,
    uint32_t kmax, uint32_t* __restrict__ host_drafts, uint32_t publish, uint32_t m, uint8_t* __restrict__ flags,
    uint32_t flag_byte) {
    const uint32_t e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= m) return;
    if (__ldcg(entries + (size_t)e * ENTRY_WORDS) == BATCH_PAD) return;
    const unsigned long long k = keys[e];
    const uint32_t t = key_index(k);
    const uint32_t bad = key_nonfinite(k);
    if (bad) flags[(size_t)e * 4u + flag_byte] = (uint8_t)bad;
    entries[(size_t)e * ENTRY_WORDS + 2u] = t;
    uint32_t* d = drafts + (size_t)e * kmax;
    d[draft_index] = t;
    if (publish) publish_drafts(d, host_drafts + (size_t)e * kmax, draft_index, t);
}
