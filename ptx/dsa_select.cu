// KPool lightning-indexer scores, the top-k pool selection and the shared selection's extension,
// for the m entries of a batch (model/kernels/dsa_select.py). Each entry's row is read from device
// memory (entries[e].row + row_add), so a captured graph follows the rows the host or an earlier
// node set.
#include "batch.cuh"
#include "model_common.cuh"

// The selection kernel's capacity in pools, and the most one block ranks alone;
// model/kernels/dsa_select.py TOPK_MAX_POOLS and TOPK_SINGLE_BLOCK_POOLS must equal them
// (tests/test_batch_dsa.py and tests/test_dsa_reach.py read both).
#define TOPK_MAX_POOLS_CUDA 262144u
#define TOPK_SINGLE_BLOCK_POOLS 16384u

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

// ---- the tensor-core path of indexer_scores_batch (mma = 1) -------------------------------------
// Past a few thousand pools the warp-per-pool path above is bound by its shared-memory reads (160
// wavefronts of q and key per pool, about 160 us at 262,144 pools), far from streaming the keys
// (132 bytes a pool). Here the dots are mma.sync.m16n8k16 with f16 operands and f32 accumulation:
// M = the heads (two m16 tiles, rows past `heads` zero), N = 8 pools, K = the 128 dimensions in 8
// steps. A warp converts each key byte once (cvt.rn.f16x2.e4m3x2: exact, every E4M3 value is an
// f16) and the 32 heads share it through the MMA.
//
// q as f16 without loss: head h's BF16 row times 2^s_h, s_h the power of two that puts its largest
// magnitude in [2^14, 2^15) (clamped to +-126): a BF16 value's 8 significant bits fit f16's 11, and
// only elements below 2^-28 of the row's largest fall under f16's normal range. The dot is
// multiplied back by 2^-s_h (exact) and then by the pool's scale, so
//   score_p = sum_h (w_h * w_scale) * relu((dot_h(q_h 2^s_h, fp8 key_p) * 2^-s_h) * scale_p) / sqrt(dim)
// equal to the twin's formula up to f32 rounding (the GPU tests' score bound).
//
// Fragments (as ptx/draft_head.cu's head_argmax_fp8_mma): lane (g = lane / 4, t = lane % 4) holds
// elements 32t .. 32t + 31 of q rows g, g + 8, g + 16, g + 24 and loads bytes 32t .. 32t + 31 of
// pool 8T + g's key for tile T (two 16-byte loads; a warp's tile is 1 KB, contiguous). MMA step j
// takes the thread's elements 32t + 4j .. 32t + 4j + 3: its logical k pairs (2t, 2t + 1) and
// (2t + 8, 2t + 9) are the physical (32t + 4j, +1) and (32t + 4j + 2, +3) in A and B alike, so the
// 8 steps pair each q element with its own key byte. The accumulator's columns 2t, 2t + 1 are pools
// 8T + 2t, +1; a lane sums its four heads in order, then three xor shuffles sum the eight lanes of
// its column (a fixed order). A pool's score is thus one warp's fixed arithmetic whatever the grid,
// the warp or the batch.
//
// A warp takes IDX_TILES tiles per round (32 pools, 4 KB) and has the next round's keys in flight
// while it computes one (about 190 registers: one 256-thread block per SM). Needs dim == 128,
// heads <= 32, q rows 4-byte aligned and the pool keys 16-byte aligned (the launch helper checks;
// a launch that asks for this path without them writes nothing). 33 to 64 heads: score_pools_mma2
// below (mma = 2).
#define IDX_MMA_DIM 128u
#define IDX_TILES 4

namespace {
__device__ __forceinline__ void mma_16816_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two E4M3 bytes (the low 16 bits, low byte first) -> an exact f16 pair (low byte in the low half).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
    uint32_t h;
    const uint16_t v = (uint16_t)(two & 0xFFFFu);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
    return h;
}

// A BF16 pair times 2^s (exact in f32) -> an f16 pair, low element in the low half.
__device__ __forceinline__ uint32_t bf16x2_scaled_to_f16x2(uint32_t v, float scale) {
    const __half2 h = __floats2half2_rn(bf16_lo(v) * scale, bf16_hi(v) * scale);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// 2^s as an f32, s in [-126, 126].
__device__ __forceinline__ float pow2f(int s) { return __int_as_float((127 + s) << 23); }

// A round's keys: for each of its tiles, the thread's 32 bytes of pool 8T + g (clamped to the last
// complete pool: its results are dropped).
__device__ __forceinline__ void load_key_round(const uint8_t* __restrict__ keys, uint32_t group, uint32_t npools,
                                               uint32_t g, uint32_t t, uint4 (&kv)[IDX_TILES][2]) {
#pragma unroll
    for (int u = 0; u < IDX_TILES; ++u) {
        const uint32_t p = min((group * IDX_TILES + (uint32_t)u) * 8u + g, npools - 1u);
        const uint8_t* src = keys + (size_t)p * IDX_MMA_DIM + 32u * t;
        kv[u][0] = ld_stream16(src);
        kv[u][1] = ld_stream16(src + 16);
    }
}

__device__ __forceinline__ uint32_t word_of4(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Rounds blockIdx.x * 8 + warp, + gridDim.x * 8, ... of IDX_TILES tiles below npools.
__device__ __forceinline__ void score_pools_mma(const uint16_t* __restrict__ q, const uint16_t* __restrict__ w,
                                                const uint8_t* __restrict__ pool_keys,
                                                const float* __restrict__ pool_scales, float* __restrict__ scores,
                                                uint32_t npools, uint32_t heads, float w_scale) {
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    const uint32_t rounds = (npools + 8u * IDX_TILES - 1u) / (8u * IDX_TILES);
    const uint32_t stride = gridDim.x * (blockDim.x >> 5);
    uint32_t r = blockIdx.x * (blockDim.x >> 5) + warp;
    if (r >= rounds) return;
    uint4 cur[IDX_TILES][2];
    load_key_round(pool_keys, r, npools, g, t, cur);  // in flight while q is staged

    // A fragments: rows g + 8i (i = 0..3), elements 32t .. 32t + 31, 16 words each.
    uint32_t a[4][16];
    float inv[4], wh[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t h = g + 8u * i;
        const uint32_t* src = reinterpret_cast<const uint32_t*>(q + (size_t)h * IDX_MMA_DIM + 32u * t);
#pragma unroll
        for (int k = 0; k < 16; ++k) a[i][k] = h < heads ? __ldg(src + k) : 0u;
        wh[i] = h < heads ? __fmul_rn(bf16_bits_to_f32(w[h]), w_scale) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t mx = 0u;  // the largest |BF16| bits (magnitudes order as their bits)
#pragma unroll
        for (int k = 0; k < 16; ++k) mx = max(mx, max(a[i][k] & 0x7FFFu, (a[i][k] >> 16) & 0x7FFFu));
        mx = max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
        mx = max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
        const int s = min(max(141 - (int)((mx >> 7) & 0xFFu), -126), 126);  // 2^s * max in [2^14, 2^15)
        const float scale = pow2f(s);
        inv[i] = pow2f(-s);
#pragma unroll
        for (int k = 0; k < 16; ++k) a[i][k] = bf16x2_scaled_to_f16x2(a[i][k], scale);
    }
    const float root = sqrtf((float)IDX_MMA_DIM);

    for (; r < rounds; r += stride) {
        uint4 nxt[IDX_TILES][2];
        const bool more = r + stride < rounds;
        if (more) load_key_round(pool_keys, r + stride, npools, g, t, nxt);
#pragma unroll
        for (int u = 0; u < IDX_TILES; ++u) {
            const uint32_t p0 = (r * IDX_TILES + (uint32_t)u) * 8u;
            if (p0 >= npools) break;  // uniform over the warp
            float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const uint32_t kw = word_of4(cur[u][j >> 2], j & 3);
                const uint32_t b0 = e4m3x2_to_f16x2(kw), b1 = e4m3x2_to_f16x2(kw >> 16);
                mma_16816_f16(acc[0], a[0][2 * j], a[1][2 * j], a[0][2 * j + 1], a[1][2 * j + 1], b0, b1);
                mma_16816_f16(acc[1], a[2][2 * j], a[3][2 * j], a[2][2 * j + 1], a[3][2 * j + 1], b0, b1);
            }
            const uint32_t pc = p0 + 2u * t;
            const float sc[2] = {__ldg(pool_scales + min(pc, npools - 1u)), __ldg(pool_scales + min(pc + 1u, npools - 1u))};
            float s[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float v = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float d = __fmul_rn(__fmul_rn(acc[i >> 1][2 * (i & 1) + c], inv[i]), sc[c]);
                    v = fmaf(wh[i], fmaxf(d, 0.0f), v);
                }
                v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
                v += __shfl_xor_sync(0xFFFFFFFFu, v, 8);
                v += __shfl_xor_sync(0xFFFFFFFFu, v, 16);
                s[c] = v / root;
            }
            if (g == 0) {
                if (pc < npools) scores[pc] = s[0];
                if (pc + 1u < npools) scores[pc + 1u] = s[1];
            }
        }
        if (more) {
#pragma unroll
            for (int u = 0; u < IDX_TILES; ++u) {
                cur[u][0] = nxt[u][0];
                cur[u][1] = nxt[u][1];
            }
        }
    }
}
}  // namespace

// ---- 33 to 64 heads on the tensor cores (mma = 2) -----------------------------------------------
// DeepSeek-V3.2's indexer has 64 heads: two groups of 32 (G = 0, 1: heads 32G .. 32G + 31, rows
// past `heads` zero with weight 0), each the M = 32 of score_pools_mma above, over the same key
// fragments (each key byte converted once, for both groups). 2 x 64 A-fragment registers would not
// fit beside the keys' double buffer, so the block stages the scaled f16 q once (all its warps
// serve one entry, blockIdx.y) in shared memory in fragment order: qa[G][j][T][L] is lane L's A
// operand of MMA step j for the m16 tile T of group G, the four words {a0, a1, a2, a3} in order,
// so that one 16-byte load feeds one mma.sync (a layout by row would need register moves to put
// the four words of two rows together). A warp reads one (G, j, T) as 32 consecutive 16-byte
// words: 512 contiguous bytes, 4 wavefronts, no bank conflict. It reads each step's four once a
// round and uses them for the round's 4 tiles: 16 KB a warp per 32 pools (4 wavefronts a pool;
// the 64-head MMAs are 4 a pool), instead of 16 KB per 8 pools had each tile reloaded them. The
// keys stream as in score_pools_mma (the next round's 4 KB, and now its pool scales, in flight
// while a round computes); 216 registers, no spills: one 256-thread block per SM.
//
// The same scaling (s_h from row h's largest |BF16|), MMAs and products as score_pools_mma, and
// the heads summed in one fixed order: lane (g, t) chains heads g, g + 8, g + 16, g + 24, g + 32,
// g + 40, g + 48, g + 56 (fmaf, in that order), then xor shuffles 4, 8, 16 sum the eight lanes of
// its column. Heads 0..31 take exactly score_pools_mma's steps; a zero-weight head adds exactly
// +-0 to a chain that is never -0, so 64 heads whose last 32 weigh 0 score as their first 32 alone
// through indexer_scores_batch, to the bit (tests/test_gpu_indexer_mma2.py).
//
// Dynamic smem IDX_MMA2_SMEM bytes (the launch helper's indexer_scores_smem_mma; a launch with
// less writes nothing): qa, then 2^-s_h [64] and w_h * w_scale [64] as f32.
#define IDX_MMA2_GROUPS 2
#define IDX_MMA2_HEADS (32u * IDX_MMA2_GROUPS)
#define IDX_MMA2_QA_BYTES (IDX_MMA2_GROUPS * 8u * 2u * 32u * 16u)
#define IDX_MMA2_SMEM 16896u
static_assert(IDX_MMA2_SMEM == IDX_MMA2_QA_BYTES + 2u * IDX_MMA2_HEADS * 4u, "model/kernels/dsa_select.py reads it");

namespace {
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// q's rows as f16 times 2^s_h into qa (fragment order), 2^-s_h and w_h * w_scale into inv_s and
// wh_s; rows heads .. 63 zero, weight 0. Warp w stages rows w, w + nw, ...: a lane loads words
// 2L, 2L + 1 of a row and the row's weight (its eight rows' loads in flight together, not eight L2
// round trips one after another), the warp takes the row's max.
__device__ __forceinline__ void stage_q_groups(const uint16_t* __restrict__ q, const uint16_t* __restrict__ w,
                                               uint32_t heads, float w_scale, uint32_t* qa, float* inv_s,
                                               float* wh_s) {
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u, nw = blockDim.x >> 5;
    for (uint32_t h0 = warp; h0 < IDX_MMA2_HEADS; h0 += 8u * nw) {
        uint32_t v[8][2], wb[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const uint32_t h = h0 + (uint32_t)k * nw;
            const uint32_t* src = reinterpret_cast<const uint32_t*>(q + (size_t)h * IDX_MMA_DIM) + 2u * lane;
            v[k][0] = h < heads ? __ldg(src) : 0u;
            v[k][1] = h < heads ? __ldg(src + 1) : 0u;
            wb[k] = h < heads ? w[h] : 0u;
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const uint32_t h = h0 + (uint32_t)k * nw;
            if (h >= IDX_MMA2_HEADS) break;  // uniform over the warp
            uint32_t mx = max(max(v[k][0] & 0x7FFFu, (v[k][0] >> 16) & 0x7FFFu),
                              max(v[k][1] & 0x7FFFu, (v[k][1] >> 16) & 0x7FFFu));
#pragma unroll
            for (int o = 16; o >= 1; o >>= 1) mx = max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
            const int s = min(max(141 - (int)((mx >> 7) & 0xFFu), -126), 126);  // as score_pools_mma
            const float scale = pow2f(s);
            // Words 2L, 2L + 1 of row h (k pairs 2t, 2t + 1 and 2t + 8, 2t + 9 of step j = L & 7, for
            // t = L >> 3) are words r and 2 + r (r = (h >> 3) & 1: row g or g + 8 of the tile) of
            // lane 4 g + t's operand of step j, tile T = (h >> 4) & 1, group G = h >> 5, g = h & 7.
            const uint32_t G = h >> 5, T = (h >> 4) & 1u, j = lane & 7u;
            const uint32_t at = (((G * 8u + j) * 2u + T) * 32u + 4u * (h & 7u) + (lane >> 3)) * 4u + ((h >> 3) & 1u);
            qa[at] = bf16x2_scaled_to_f16x2(v[k][0], scale);
            qa[at + 2u] = bf16x2_scaled_to_f16x2(v[k][1], scale);
            if (lane == 0) {
                inv_s[h] = pow2f(-s);
                wh_s[h] = h < heads ? __fmul_rn(bf16_bits_to_f32(wb[k]), w_scale) : 0.0f;
            }
        }
    }
}

// A round's pool scales: lane (g, t)'s columns 2t, 2t + 1 of each tile (clamped as the keys).
__device__ __forceinline__ void load_scale_round(const float* __restrict__ pool_scales, uint32_t group,
                                                 uint32_t npools, uint32_t t, float (&sc)[IDX_TILES][2]) {
#pragma unroll
    for (int u = 0; u < IDX_TILES; ++u) {
        const uint32_t pc = (group * IDX_TILES + (uint32_t)u) * 8u + 2u * t;
        sc[u][0] = __ldg(pool_scales + min(pc, npools - 1u));
        sc[u][1] = __ldg(pool_scales + min(pc + 1u, npools - 1u));
    }
}

// Rounds blockIdx.x * 8 + warp, + gridDim.x * 8, ... of IDX_TILES tiles below npools, 33..64 heads.
// Every thread of the block takes part in the staging (one barrier), so a block with no round
// leaves before it and the others only after it.
__device__ __forceinline__ void score_pools_mma2(const uint16_t* __restrict__ q, const uint16_t* __restrict__ w,
                                                 const uint8_t* __restrict__ pool_keys,
                                                 const float* __restrict__ pool_scales, float* __restrict__ scores,
                                                 uint32_t npools, uint32_t heads, float w_scale, float* sm) {
    const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    const uint32_t rounds = (npools + 8u * IDX_TILES - 1u) / (8u * IDX_TILES);
    const uint32_t nw = blockDim.x >> 5, stride = gridDim.x * nw;
    if (blockIdx.x * nw >= rounds) return;  // uniform over the block
    uint32_t r = blockIdx.x * nw + warp;
    uint4 cur[IDX_TILES][2];
    float sc[IDX_TILES][2];
    if (r < rounds) {  // in flight while q is staged
        load_key_round(pool_keys, r, npools, g, t, cur);
        load_scale_round(pool_scales, r, npools, t, sc);
    }
    uint32_t* qa = reinterpret_cast<uint32_t*>(sm);
    float* inv_s = sm + IDX_MMA2_QA_BYTES / 4u;
    float* wh_s = inv_s + IDX_MMA2_HEADS;
    stage_q_groups(q, w, heads, w_scale, qa, inv_s, wh_s);
    __syncthreads();
    if (r >= rounds) return;
    float inv[IDX_MMA2_GROUPS][4], wh[IDX_MMA2_GROUPS][4];
#pragma unroll
    for (int G = 0; G < IDX_MMA2_GROUPS; ++G) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            inv[G][i] = inv_s[32 * G + 8 * i + g];
            wh[G][i] = wh_s[32 * G + 8 * i + g];
        }
    }
    const uint4* qa4 = reinterpret_cast<const uint4*>(qa);
    const float root = sqrtf((float)IDX_MMA_DIM);

    for (; r < rounds; r += stride) {
        uint4 nxt[IDX_TILES][2];
        float nsc[IDX_TILES][2];
        const bool more = r + stride < rounds;
        if (more) {
            load_key_round(pool_keys, r + stride, npools, g, t, nxt);
            load_scale_round(pool_scales, r + stride, npools, t, nsc);
        }
        float acc[IDX_MMA2_GROUPS][IDX_TILES][2][4];
#pragma unroll
        for (int G = 0; G < IDX_MMA2_GROUPS; ++G)
#pragma unroll
            for (int u = 0; u < IDX_TILES; ++u)
#pragma unroll
                for (int x = 0; x < 8; ++x) acc[G][u][x >> 2][x & 3] = 0.0f;
        // Tiles past npools (the last round's) run on clamped keys; their results are dropped.
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            uint4 a[IDX_MMA2_GROUPS][2];
#pragma unroll
            for (int G = 0; G < IDX_MMA2_GROUPS; ++G)
#pragma unroll
                for (int T = 0; T < 2; ++T) a[G][T] = qa4[((G * 8 + j) * 2 + T) * 32 + (int)lane];
#pragma unroll
            for (int u = 0; u < IDX_TILES; ++u) {
                const uint32_t kw = word_of4(cur[u][j >> 2], j & 3);
                const uint32_t b0 = e4m3x2_to_f16x2(kw), b1 = e4m3x2_to_f16x2(kw >> 16);
#pragma unroll
                for (int G = 0; G < IDX_MMA2_GROUPS; ++G)
#pragma unroll
                    for (int T = 0; T < 2; ++T)
                        mma_16816_f16(acc[G][u][T], a[G][T].x, a[G][T].y, a[G][T].z, a[G][T].w, b0, b1);
            }
        }
#pragma unroll
        for (int u = 0; u < IDX_TILES; ++u) {
            const uint32_t p0 = (r * IDX_TILES + (uint32_t)u) * 8u;
            if (p0 >= npools) break;  // uniform over the warp
            const uint32_t pc = p0 + 2u * t;
            float s[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float v = 0.0f;
#pragma unroll
                for (int G = 0; G < IDX_MMA2_GROUPS; ++G) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float d = __fmul_rn(__fmul_rn(acc[G][u][i >> 1][2 * (i & 1) + c], inv[G][i]), sc[u][c]);
                        v = fmaf(wh[G][i], fmaxf(d, 0.0f), v);
                    }
                }
                v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
                v += __shfl_xor_sync(0xFFFFFFFFu, v, 8);
                v += __shfl_xor_sync(0xFFFFFFFFu, v, 16);
                s[c] = v / root;
            }
            if (g == 0) {
                if (pc < npools) scores[pc] = s[0];
                if (pc + 1u < npools) scores[pc + 1u] = s[1];
            }
        }
        if (more) {
#pragma unroll
            for (int u = 0; u < IDX_TILES; ++u) {
                cur[u][0] = nxt[u][0];
                cur[u][1] = nxt[u][1];
                sc[u][0] = nsc[u][0];
                sc[u][1] = nsc[u][1];
            }
        }
    }
}
}  // namespace

// The same scores for m batch entries (ptx/batch.cuh): blockIdx.y = entry e, whose query is
// q + e * q_stride, head weights w + e * w_stride, pools its slot's and scores
// scores + e * pools_per_slot; blockIdx.x strides over its pools (mma = 0: warps over pools; mma
// = 1: warps over rounds of IDX_TILES * 8 pools, the tensor-core path). A pool's score is one
// warp's whatever the grid, so an entry's scores have the same bits in every batch; the path is
// the launch helper's choice from the shapes alone (scores_use_mma), never from m or the rows.
// Padding entries and rows past slot_rows read and write nothing.
extern "C" __global__ void __launch_bounds__(256) indexer_scores_batch(
    const uint16_t* __restrict__ q, uint32_t q_stride, const uint16_t* __restrict__ w, uint32_t w_stride,
    const uint8_t* __restrict__ pool_keys, const float* __restrict__ pool_scales, float* __restrict__ scores,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add, uint32_t slot_rows, uint32_t heads,
    uint32_t dim, uint32_t kpool, float w_scale, uint32_t mma) {
    extern __shared__ __align__(16) float sm[];
    wait_then_release();
    const uint32_t e = blockIdx.y;
    if (e >= m) return;
    const BatchEntry b = load_entry(entries, e);
    const uint32_t row = b.row + row_add;
    if (entry_is_pad(b) || row >= slot_rows) return;
    const uint32_t npools = (row + 1u) / kpool;  // <= pools_per_slot: row < slot_rows
    const size_t pps = pools_per_slot(slot_rows, kpool);
    const uint16_t* qe = q + (size_t)e * q_stride;
    const uint8_t* keys = pool_keys + b.slot * pps * dim;
    if (mma) {
        const bool ok = dim == IDX_MMA_DIM && heads <= 32u && (q_stride & 1u) == 0 &&
                        ((uintptr_t)q & 3u) == 0 && ((uintptr_t)pool_keys & 15u) == 0;
        if (!ok || npools == 0) return;
        score_pools_mma(qe, w + (size_t)e * w_stride, keys, pool_scales + b.slot * pps, scores + e * pps, npools,
                        heads, w_scale);
        return;
    }
    if (blockIdx.x * 8u >= npools) return;
    score_pools(qe, w + (size_t)e * w_stride, keys, pool_scales + b.slot * pps, scores + e * pps, npools, heads, dim,
                w_scale, sm);
}

// 33 to 64 heads at dim 128 (DeepSeek-V3.2's indexer): indexer_scores_batch's formula, entries,
// padding and rows, on the tensor cores in two 32-head groups (score_pools_mma2). Its own entry,
// so that indexer_scores_batch (32 heads and fewer, the other shapes) keeps its code and registers
// to the instruction. `mma` must be 2 and dim 128, q rows 4-byte and the pool keys 16-byte aligned
// with IDX_MMA2_SMEM bytes of dynamic shared memory (the launch helper's scores_mma_groups and
// indexer_scores_smem_mma); a launch without them writes nothing. The launch helper takes this
// entry from the shapes alone, so every launch of a layer runs it or none does.
extern "C" __global__ void __launch_bounds__(256, 1) indexer_scores_batch_mma2(
    const uint16_t* __restrict__ q, uint32_t q_stride, const uint16_t* __restrict__ w, uint32_t w_stride,
    const uint8_t* __restrict__ pool_keys, const float* __restrict__ pool_scales, float* __restrict__ scores,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add, uint32_t slot_rows, uint32_t heads,
    uint32_t dim, uint32_t kpool, float w_scale, uint32_t mma) {
    extern __shared__ __align__(16) float sm[];
    wait_then_release();
    const uint32_t e = blockIdx.y;
    if (e >= m) return;
    const bool ok = mma == 2u && dim == IDX_MMA_DIM && heads <= IDX_MMA2_HEADS && (q_stride & 1u) == 0 &&
                    ((uintptr_t)q & 3u) == 0 && ((uintptr_t)pool_keys & 15u) == 0 &&
                    dynamic_smem_bytes() >= IDX_MMA2_SMEM;
    if (!ok) return;
    const BatchEntry b = load_entry(entries, e);
    const uint32_t row = b.row + row_add;
    if (entry_is_pad(b) || row >= slot_rows) return;
    const uint32_t npools = (row + 1u) / kpool;  // <= pools_per_slot: row < slot_rows
    if (npools == 0) return;
    const size_t pps = pools_per_slot(slot_rows, kpool);
    score_pools_mma2(q + (size_t)e * q_stride, w + (size_t)e * w_stride, pool_keys + b.slot * pps * dim,
                     pool_scales + b.slot * pps, scores + e * pps, npools, heads, w_scale, sm);
}

// ---- select_topk_pools_batch --------------------------------------------------------------------
// The topk_pools best complete pools of each entry's row (higher score first, then lower pool
// index), expanded to their kpool rows in ascending order, then with `tail` the rows of the
// incomplete pool (index_kpool_always_select_tail). With npools <= topk_pools the list is every
// complete pool's rows. The result is exactly select_rows_ref's: a unique set, so every algorithm
// below gives the same list, and the grid or the batch can never change it.
//
// Up to TOPK_SINGLE_BLOCK_POOLS complete pools one block (blockIdx.x == 0) ranks all of them with
// select_core: an exact radix select over order-preserving u32 keys in shared memory (4 passes of 8
// bits; histograms with warp-aggregated shared atomics, since scores of one magnitude share their
// top byte and plain atomics would serialise on one bin), then an ordered emission: warp w walks
// its own contiguous segment of keys 32 at a time (consecutive lanes on consecutive words: no bank
// conflicts), ballots give each taken key its place, and one block-wide exchange of the warps'
// counts gives each segment its first output position and its share of the keys equal to the
// threshold (the lowest positions first: ties go to the lower pool index).
//
// Past TOPK_SINGLE_BLOCK_POOLS: a radix select over the whole row by all its blocks, four launches
// (the launch helper makes them, the same four whatever the rows). Block c of an entry owns pools
// c * SELECT_CHUNK .. + SELECT_CHUNK - 1 (32 blocks at 262,144 pools, one key per thread per 1024).
//   select_radix_hist_batch phase 0: each block's shared histogram of the keys' bits 31..20 (4096
//     bins), added into the entry's global histogram (only its non-zero bins);
//   phase 1: every block finds the threshold bin of phase 0 (a scan of the 4096 bins: the bin
//     holding the topk-th largest key, and how many of the keys still to take lie in it), block 0
//     records it, and the keys in that bin add their bits 19..10 into a second histogram (1024);
//   phase 2: likewise, bits 9..0 of the keys whose bits 31..10 are the threshold's (1024 bins);
//   select_topk_pools_batch: every block finds the threshold key T and `need`, the keys equal to T
//     to take (count_above(T) = topk - need < topk <= count_above + count_equal), and writes its
//     pools' two bitmaps (key > T, key == T; a warp's ballot per 32 pools). The last block of the
//     entry (a counter, reset for the next launch and every graph replay) stages both maps of the
//     row (at most 8192 + 8192 words) in shared memory, takes every bit of the first and the
//     `need` lowest bits of the second (ties to the lower pool index, as select_core), compacts
//     them in ascending pool order (per-warp popcounts, one block exchange, shuffle scans over the
//     lanes) into the rows list, appends the tail, writes count[e] and zeroes the three histograms.
// Why: the chunked selection this replaces ranked each chunk's local top k in one block and the
// last chunk merged ceil(npools / chunk) x topk candidates in one block: two single-block 4-pass
// selects over 8-16K keys in series, 23.2 us at 32,768 pools and 50.9 us at 262,144 on the H200
// (GLM-5.3-Flash, top-512 at kpool 4; the issue asks 30). Here the serial part is one block's
// scan of at most 4096 bins a launch and the last block's compaction of at most 2 x 8192 words;
// every block reads its 8192 scores once a launch through L2 (8 loads in flight a thread, issued
// before the scan). So the time is four PDL launch boundaries (a one-thread kernel costs about 2.6
// us a launch in the step: extend_selection_batch) plus a few L2 round trips each, about 15-20 us
// expected (estimated when written, without a GPU: bench/bench_reach.py measures it), whatever the
// row length past 16384 pools and whatever the ties; the per-token shape (top 2048 of up to
// 202,752 at kpool 1) takes the same four. The price: in slots of more than 16384 pools a row of
// fewer still waits for three launches whose blocks exit at once. Not chosen: folding phase 2
// into the last launch (three launches: the last block would have to reread every key sharing
// T's top 22 bits, the whole row when all scores are equal); two 16-bit phases (64K-bin
// histograms: global atomics per key, 256 KB an entry to scan or clear); one launch with a
// spinning grid barrier (the blocks of a batch are not all resident, m = 64 is 2048 blocks, and
// the wk_t GEMV runs beside: a spin could deadlock).
//
// Workspace of entry e (u32, at workspace + e * select_ws_words(pps); allocated zeroed, and every
// launch sequence leaves the counter and the histograms zero again): the counter, 3 words of
// padding, the thresholds phases 1 and 2 found (prefix, keys still to take: 4 words), the three
// histograms (4096 + 1024 + 1024), then the two bitmaps of select_map_words(pps) words each
// (rewritten for the row's words every time: never cleared). Read only past
// TOPK_SINGLE_BLOCK_POOLS complete pools. The radix passes and the final kernel take the same
// rows (select_row_plan), so whatever a pass adds the final kernel's last block clears.
#define SELECT_THREADS 1024u
#define SELECT_CHUNK 8192u  // SELECT_THREADS x 8 keys, model/kernels/dsa_select.py SELECT_CHUNK
#define SEL_KEYS_PER_THREAD 8
#define SEL_HIST0_BINS 4096u  // bits 31..20
#define SEL_HIST_BINS 1024u   // bits 19..10, then 9..0
#define SEL_WS_STATE 4u
#define SEL_WS_HIST0 8u
#define SEL_WS_MAPS (SEL_WS_HIST0 + SEL_HIST0_BINS + 2u * SEL_HIST_BINS)  // 6152
static_assert(SELECT_CHUNK == SELECT_THREADS * SEL_KEYS_PER_THREAD, "a block's keys: 8 a thread");
static_assert(SEL_HIST0_BINS == 4u * SELECT_THREADS && SEL_HIST_BINS == SELECT_THREADS, "bins a thread: 4, 1");
static_assert(SEL_WS_MAPS % 4u == 0, "the bitmaps are read as 16-byte vectors");
static_assert(TOPK_MAX_POOLS_CUDA / 32u <= 8u * SELECT_THREADS, "a row's bitmaps fit 64 KiB of shared memory");
namespace {
struct SelectSmem {
    uint32_t hist[256];
    uint32_t warp_gt[32], warp_eq[32];
    uint32_t digit, remaining;
    bool last;
};

__host__ __device__ __forceinline__ uint32_t select_chunks(uint32_t pools) {
    return (pools + SELECT_CHUNK - 1u) / SELECT_CHUNK;
}

// Words of one bitmap over a slot's pools, a multiple of 4 (16-byte vectors).
__host__ __device__ __forceinline__ uint32_t select_map_words(uint32_t pps) { return ((pps + 31u) / 32u + 3u) & ~3u; }

__device__ __forceinline__ size_t select_ws_words(uint32_t pps) {
    return SEL_WS_MAPS + 2u * (size_t)select_map_words(pps);
}

// What select_topk_pools_batch does with entry e: nothing (padding: SEL_SKIP), count 0 (a row past
// slot_rows or the capacity, a list past sel_cap, a launch of another block size: SEL_FAIL), or its
// list (SEL_RUN, with the row's numbers). The radix passes histogram exactly the rows this plans
// for the chunked path, so the final kernel's last block clears whatever they added.
enum SelectPlanKind { SEL_SKIP, SEL_FAIL, SEL_RUN };
struct SelectPlan {
    uint32_t row, npools, tail0, tail_n, base;
    bool ranked, multi;
};
__device__ __forceinline__ SelectPlanKind select_row_plan(const uint32_t* __restrict__ entries, uint32_t e,
                                                          uint32_t row_add, uint32_t slot_rows, uint32_t sel_cap,
                                                          uint32_t topk_pools, uint32_t kpool, uint32_t tail,
                                                          SelectPlan& p) {
    const BatchEntry b = load_entry(entries, e);
    if (entry_is_pad(b)) return SEL_SKIP;
    p.row = b.row + row_add;
    if (p.row >= slot_rows) return SEL_FAIL;
    p.npools = (p.row + 1u) / kpool;
    p.tail0 = p.npools * kpool;
    p.tail_n = tail ? p.row + 1u - p.tail0 : 0u;
    p.ranked = p.npools > topk_pools;
    p.base = p.ranked ? topk_pools * kpool : p.tail0;  // where the tail goes
    p.multi = p.ranked && p.npools > TOPK_SINGLE_BLOCK_POOLS;
    if (p.base + p.tail_n > sel_cap || p.npools > TOPK_MAX_POOLS_CUDA || (p.multi && blockDim.x != SELECT_THREADS))
        return SEL_FAIL;
    return SEL_RUN;
}

// Whether entry e's row takes the radix passes (and so the final kernel's last-block epilogue).
__device__ __forceinline__ bool select_row_radix(const SelectPlanKind k, const SelectPlan& p, uint32_t topk_pools) {
    return k == SEL_RUN && p.multi && topk_pools > 0u;
}

// keys[0..n) from n f32 scores (through L2: the indexer releases its dependents early), four loads
// in flight per thread. Ends with a barrier.
__device__ __forceinline__ void stage_score_keys(const float* __restrict__ src, uint32_t n, uint32_t* keys) {
    const uint32_t tid = threadIdx.x, nt = blockDim.x;
    for (uint32_t base = 0; base < n; base += 4u * nt) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const uint32_t i = base + tid + nt * u;
            v[u] = i < n ? __ldcg(src + i) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const uint32_t i = base + tid + nt * u;
            if (i < n) keys[i] = ordered_key(v[u]);
        }
    }
    __syncthreads();
}

// The warps' shares of an ordered emission: lane l holds warp l's counts of keys above the
// threshold (lgt) and equal to it (leq); the `need` ties go to the lowest warps first. Returns the
// calling warp's quota of ties, its first output position and how many it takes in all.
struct TieShare {
    uint32_t quota, pos, take;
};
__device__ __forceinline__ TieShare tie_share(uint32_t lgt, uint32_t leq, uint32_t need, uint32_t warp) {
    const uint32_t eq_before = warp_inclusive_scan(leq) - leq;
    const uint32_t lquota = need > eq_before ? min(leq, need - eq_before) : 0u;
    const uint32_t ltake = lgt + lquota;
    const uint32_t take_before = warp_inclusive_scan(ltake) - ltake;
    return TieShare{__shfl_sync(0xFFFFFFFFu, lquota, warp), __shfl_sync(0xFFFFFFFFu, take_before, warp),
                    __shfl_sync(0xFFFFFFFFu, ltake, warp)};
}

// The exact top k of keys[0..n) (higher key first, then lower position), the whole block:
// emit(pos, i) for every chosen position i, pos = its place among the chosen in ascending i
// (0 .. min(n, k) - 1). keys must be complete (a barrier after their writes). Ends with a barrier.
template <class Emit>
__device__ void select_core(const uint32_t* keys, uint32_t n, uint32_t k, SelectSmem& sm, Emit emit) {
    const uint32_t tid = threadIdx.x, nt = blockDim.x, lane = tid & 31u, warp = tid >> 5, nw = nt >> 5;
    if (k == 0) {  // topk_pools 0: nothing is ranked in (the list is the tail alone)
        __syncthreads();
        return;
    }
    if (n <= k) {
        for (uint32_t i = tid; i < n; i += nt) emit(i, i);
        __syncthreads();
        return;
    }
    uint32_t prefix = 0u, mask = 0u, remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (tid < 256) sm.hist[tid] = 0u;
        __syncthreads();
        for (uint32_t i = tid; i < n; i += nt) {
            const uint32_t key = keys[i];
            if ((key & mask) == prefix) {
                const uint32_t digit = (key >> shift) & 255u;
                const uint32_t peers = __match_any_sync(__activemask(), digit);
                if (lane == (uint32_t)(__ffs(peers) - 1)) atomicAdd(&sm.hist[digit], (uint32_t)__popc(peers));
            }
        }
        __syncthreads();
        if (tid < 32) {
            // Lane l owns bins 8l..8l+7; "above" counts keys in higher bins.
            uint32_t local = 0u;
#pragma unroll
            for (int b = 0; b < 8; ++b) local += sm.hist[8u * tid + b];
            uint32_t suffix = local;  // inclusive suffix sum over lanes >= tid
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t t = __shfl_down_sync(0xFFFFFFFFu, suffix, o);
                if (tid + (uint32_t)o < 32u) suffix += t;
            }
            uint32_t above = suffix - local;
#pragma unroll
            for (int b = 7; b >= 0; --b) {
                const uint32_t c = sm.hist[8u * tid + b];
                if (above < remaining && above + c >= remaining) {
                    sm.digit = 8u * tid + b;
                    sm.remaining = remaining - above;
                }
                above += c;
            }
        }
        __syncthreads();
        prefix |= sm.digit << shift;
        mask |= 255u << shift;
        remaining = sm.remaining;
        __syncthreads();  // digit / remaining are rewritten by the next pass
    }
    const uint32_t T = prefix, need = remaining;  // the k-th largest key; take `need` of its ties

    // Segments of whole 32-key steps, one per warp, in position order.
    const uint32_t seg = (n + 32u * nw - 1u) / (32u * nw) * 32u;
    const uint32_t lo = min(warp * seg, n), hi = min(lo + seg, n);
    uint32_t gt = 0u, eq = 0u;
    for (uint32_t base = lo; base < hi; base += 32u) {
        const uint32_t i = base + lane;
        const uint32_t key = i < hi ? keys[i] : 0u;
        gt += __popc(__ballot_sync(0xFFFFFFFFu, i < hi && key > T));
        eq += __popc(__ballot_sync(0xFFFFFFFFu, i < hi && key == T));
    }
    if (lane == 0) {
        sm.warp_gt[warp] = gt;
        sm.warp_eq[warp] = eq;
    }
    __syncthreads();
    // Lane l: warp l's counts; its ties before it, its quota of ties, its first output position.
    const uint32_t lgt = lane < nw ? sm.warp_gt[lane] : 0u, leq = lane < nw ? sm.warp_eq[lane] : 0u;
    const TieShare share = tie_share(lgt, leq, need, warp);
    const uint32_t quota = share.quota;
    uint32_t pos = share.pos;
    const uint32_t below = (1u << lane) - 1u;
    uint32_t eq_seen = 0u;
    for (uint32_t base = lo; base < hi; base += 32u) {
        const uint32_t i = base + lane;
        const uint32_t key = i < hi ? keys[i] : 0u;
        const uint32_t eqm = __ballot_sync(0xFFFFFFFFu, i < hi && key == T);
        const bool take = (i < hi && key > T) ||
                          (((eqm >> lane) & 1u) && eq_seen + (uint32_t)__popc(eqm & below) < quota);
        const uint32_t tm = __ballot_sync(0xFFFFFFFFu, take);
        if (take) emit(pos + (uint32_t)__popc(tm & below), i);
        pos += (uint32_t)__popc(tm);
        eq_seen += (uint32_t)__popc(eqm);
    }
    __syncthreads();
}

// The chosen pools' rows (pool p -> rows p * kpool .. p * kpool + kpool - 1) at list position pos.
__device__ __forceinline__ void put_pool_rows(uint32_t* __restrict__ selected, uint32_t pos, uint32_t p, uint32_t kpool) {
    for (uint32_t j = 0; j < kpool; ++j) selected[pos * kpool + j] = p * kpool + j;
}

// The last of `n` blocks to arrive at an entry's counter (the whole block; uniform result): it
// resets the counter to 0 and sees every other block's workspace writes (ptx/model_common.cuh
// last_block_done's handshake, with the count of an entry's chunks instead of the grid).
__device__ __forceinline__ bool last_of(uint32_t* counter, uint32_t n, SelectSmem& sm) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const uint32_t prev = atomicAdd(counter, 1u);
        sm.last = prev == n - 1u;
        if (sm.last) {
            *counter = 0u;
            __threadfence();
        }
    }
    __syncthreads();
    return sm.last;
}

// ---- the radix passes of the chunked selection --------------------------------------------------

// The bin of an entry's global histogram (PER bins a thread, PER * blockDim.x in all, through L2:
// the pass before released its dependents early) that holds the remaining-th largest key among
// those it counts: returns the bin and sets `remaining` to the rank the key has inside it. The
// whole block; every thread gets the result. Exactly one bin qualifies where the histogram counts
// at least `remaining` keys (what the passes guarantee); else bin 0 with 1 (never out of bounds).
template <int PER>
__device__ __forceinline__ uint32_t radix_pick(const uint32_t* __restrict__ hist, uint32_t& remaining,
                                               SelectSmem& sm) {
    const uint32_t tid = threadIdx.x;
    uint32_t c[PER];
    if constexpr (PER == 4) {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(hist) + tid);
        c[0] = v.x, c[1] = v.y, c[2] = v.z, c[3] = v.w;
    } else {
        c[0] = __ldcg(hist + tid);
    }
    uint32_t local = 0u;
#pragma unroll
    for (int b = 0; b < PER; ++b) local += c[b];
    if (tid == 0) {
        sm.digit = 0u;
        sm.remaining = 1u;
    }
    uint32_t total;
    const uint32_t before = block_exclusive_scan(local, sm.warp_gt, &total);  // ends with a barrier
    uint32_t above = total - before - local;  // keys in the bins of higher threads
#pragma unroll
    for (int b = PER - 1; b >= 0; --b) {
        if (above < remaining && above + c[b] >= remaining) {
            sm.digit = tid * PER + (uint32_t)b;
            sm.remaining = remaining - above;
        }
        above += c[b];
    }
    __syncthreads();
    const uint32_t d = sm.digit;
    remaining = sm.remaining;
    __syncthreads();  // digit / remaining are rewritten by the next pick
    return d;
}

// The threshold after `done` (1..3) passes: its known top bits in `prefix` (bits 31..20, 31..10 or
// all 32) and `remaining`, the keys still to take among those sharing them. Pass 1 scans the first
// histogram; passes 2 and 3 start from what the pass before recorded (SEL_WS_STATE) and scan its
// histogram. The whole block.
__device__ __forceinline__ void radix_threshold(const uint32_t* ws, uint32_t done, uint32_t topk_pools,
                                                SelectSmem& sm, uint32_t& prefix, uint32_t& remaining) {
    if (done == 1u) {
        remaining = topk_pools;
        prefix = radix_pick<4>(ws + SEL_WS_HIST0, remaining, sm) << 20;
        return;
    }
    const uint32_t* st = ws + SEL_WS_STATE + 2u * (done - 2u);
    const uint32_t p = __ldcg(st);
    remaining = __ldcg(st + 1);
    const uint32_t* hist = ws + SEL_WS_HIST0 + SEL_HIST0_BINS + SEL_HIST_BINS * (done - 2u);
    prefix = p | (radix_pick<1>(hist, remaining, sm) << (done == 2u ? 10 : 0));
}

// The chunk's keys: thread t holds pools lo + t + SELECT_THREADS * u (u < 8) of the row: warp w's
// lanes the 32 pools of words w, w + 32, ... of the chunk, coalesced. Past the row's pools 0.0,
// which no pass counts (each tests j < len).
__device__ __forceinline__ void load_chunk_scores(const float* __restrict__ sc, uint32_t len,
                                                  float (&v)[SEL_KEYS_PER_THREAD]) {
#pragma unroll
    for (int u = 0; u < SEL_KEYS_PER_THREAD; ++u) {
        const uint32_t j = threadIdx.x + SELECT_THREADS * (uint32_t)u;
        v[u] = j < len ? __ldcg(sc + j) : 0.0f;
    }
}
}  // namespace

// Phase `phase` (0, 1, 2) of the chunked selection's radix select (see above), grid and arguments
// as select_topk_pools_batch's, SELECT_THREADS threads. Adds the histogram of the phase's 12 / 10 /
// 10 key bits of block c's pools (among those sharing the threshold's bits found so far) into the
// entry's workspace; phases 1 and 2 first find that threshold from the phase before's histogram
// (block 0 records it for the next). Rows one block ranks, padding, rows past slot_rows or the
// capacity or sel_cap: nothing (select_row_plan). Releases right after its wait: the next phase's
// blocks are resident when this one completes.
extern "C" __global__ void __launch_bounds__(1024, 2) select_radix_hist_batch(
    const float* __restrict__ scores, const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add,
    uint32_t slot_rows, uint32_t sel_cap, uint32_t topk_pools, uint32_t kpool, uint32_t tail,
    uint32_t* __restrict__ workspace, uint32_t phase) {
    __shared__ uint32_t hist[SEL_HIST0_BINS];
    __shared__ SelectSmem sm;
    wait_then_release();
    const uint32_t e = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, lane = tid & 31u;
    if (e >= m || phase > 2u) return;
    SelectPlan p;
    const SelectPlanKind kind = select_row_plan(entries, e, row_add, slot_rows, sel_cap, topk_pools, kpool, tail, p);
    if (!select_row_radix(kind, p, topk_pools) || c >= select_chunks(p.npools)) return;
    const uint32_t pps = pools_per_slot(slot_rows, kpool);
    uint32_t* ws = workspace + (size_t)e * select_ws_words(pps);
    const uint32_t lo = c * SELECT_CHUNK, len = min(SELECT_CHUNK, p.npools - lo);
    float v[SEL_KEYS_PER_THREAD];
    load_chunk_scores(scores + (size_t)e * pps + lo, len, v);  // in flight while the threshold is found
    const uint32_t bins = phase == 0u ? SEL_HIST0_BINS : SEL_HIST_BINS;
    for (uint32_t i = tid; i < bins; i += SELECT_THREADS) hist[i] = 0u;
    uint32_t prefix = 0u, mask = 0u, remaining = topk_pools;
    if (phase > 0u) {
        radix_threshold(ws, phase, topk_pools, sm, prefix, remaining);  // its barriers order the zeroing
        mask = phase == 1u ? 0xFFF00000u : 0xFFFFFC00u;
        if (c == 0 && tid == 0) {
            ws[SEL_WS_STATE + 2u * (phase - 1u)] = prefix;
            ws[SEL_WS_STATE + 2u * (phase - 1u) + 1u] = remaining;
        }
    } else {
        __syncthreads();
    }
    const uint32_t shift = phase == 0u ? 20u : phase == 1u ? 10u : 0u;
#pragma unroll
    for (int u = 0; u < SEL_KEYS_PER_THREAD; ++u) {
        const uint32_t key = ordered_key(v[u]);
        if (tid + SELECT_THREADS * (uint32_t)u < len && (key & mask) == prefix) {
            const uint32_t digit = (key >> shift) & (bins - 1u);
            const uint32_t peers = __match_any_sync(__activemask(), digit);
            if (lane == (uint32_t)(__ffs(peers) - 1)) atomicAdd(&hist[digit], (uint32_t)__popc(peers));
        }
    }
    __syncthreads();
    uint32_t* g = ws + SEL_WS_HIST0 + (phase == 0u ? 0u : SEL_HIST0_BINS + SEL_HIST_BINS * (phase - 1u));
    for (uint32_t i = tid; i < bins; i += SELECT_THREADS) {
        const uint32_t n = hist[i];
        if (n) atomicAdd(g + i, n);
    }
}

namespace {
// The last block's epilogue of the chunked selection: the row's two bitmaps staged in shared
// memory (`maps`, 2 x select_map_words(npools) words), then every bit of the first and the `need`
// lowest bits of the second, compacted in ascending pool order into selected[0 .. topk_pools) as
// the pools' rows. Warp w owns a contiguous run of words (whole 32-word steps, in word order): a
// first sweep counts its bits, one exchange of the warps' counts (as select_core's) gives each its
// first position and its share of the ties, a second sweep places each lane's bits by lane scans.
// Not inlined: inside the kernel's 32 registers it spilled 48 bytes (ptxas -v); called, neither it
// nor the kernel spills.
__device__ __noinline__ void emit_bitmaps(const uint32_t* gt_map, const uint32_t* eq_map, uint32_t npools,
                                             uint32_t need, uint32_t topk_pools, uint32_t kpool,
                                             uint32_t* __restrict__ sel, uint32_t* maps, SelectSmem& sm) {
    const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, nw = SELECT_THREADS >> 5;
    const uint32_t W = (npools + 31u) / 32u, n4 = (W + 3u) / 4u;  // words with pools, their vectors
    uint4* gts = reinterpret_cast<uint4*>(maps);  // then the eq map's n4 vectors
    for (uint32_t base = 0; base < 2u * n4; base += 4u * SELECT_THREADS) {  // 4 loads in flight per thread
        uint4 t[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const uint32_t k = base + tid + SELECT_THREADS * (uint32_t)u;
            if (k < 2u * n4)
                t[u] = __ldcg(k < n4 ? reinterpret_cast<const uint4*>(gt_map) + k
                                     : reinterpret_cast<const uint4*>(eq_map) + (k - n4));
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const uint32_t k = base + tid + SELECT_THREADS * (uint32_t)u;
            if (k < 2u * n4) gts[k] = t[u];
        }
    }
    __syncthreads();
    const uint32_t* g32 = maps;
    const uint32_t* e32 = maps + 4u * n4;
    const uint32_t seg = (W + 32u * nw - 1u) / (32u * nw) * 32u;
    const uint32_t lo = min(warp * seg, W), hi = min(lo + seg, W);
    uint32_t gt = 0u, eq = 0u;
    for (uint32_t b = lo; b < hi; b += 32u) {
        const uint32_t i = b + lane;
        if (i < hi) {
            gt += __popc(g32[i]);
            eq += __popc(e32[i]);
        }
    }
    gt = __reduce_add_sync(0xFFFFFFFFu, gt);
    eq = __reduce_add_sync(0xFFFFFFFFu, eq);
    if (lane == 0) {
        sm.warp_gt[warp] = gt;
        sm.warp_eq[warp] = eq;
    }
    __syncthreads();
    // Lane l: warp l's counts; its ties before it, its quota of ties, its first output position.
    const uint32_t lgt = sm.warp_gt[lane], leq = sm.warp_eq[lane];  // nw == 32
    const TieShare share = tie_share(lgt, leq, need, warp);
    const uint32_t quota = share.quota;
    uint32_t pos = share.pos;
    if (share.take == 0u) return;  // nothing chosen in this warp's words
    uint32_t eq_seen = 0u;
    for (uint32_t b = lo; b < hi; b += 32u) {
        const uint32_t i = b + lane;
        const uint32_t g = i < hi ? g32[i] : 0u;
        uint32_t q = i < hi ? e32[i] : 0u;
        const uint32_t qc = __popc(q);
        const uint32_t q_inc = warp_inclusive_scan(qc);
        const uint32_t before = eq_seen + q_inc - qc;  // ties in lower words of the row
        const uint32_t keep = quota > before ? min(qc, quota - before) : 0u;
        if (keep < qc) {  // the lowest `keep` of the word's ties
            uint32_t rest = q;
            for (uint32_t k = 0; k < keep; ++k) rest &= rest - 1u;
            q ^= rest;
        }
        uint32_t s = g | q;
        const uint32_t sc = __popc(s);
        const uint32_t s_inc = warp_inclusive_scan(sc);
        uint32_t at = pos + s_inc - sc;
        while (s) {
            const uint32_t bit = (uint32_t)__ffs(s) - 1u;
            s &= s - 1u;
            if (at < topk_pools) put_pool_rows(sel, at, 32u * i + bit, kpool);
            ++at;
        }
        pos += __shfl_sync(0xFFFFFFFFu, s_inc, 31);
        eq_seen += __shfl_sync(0xFFFFFFFFu, q_inc, 31);
    }
}
}  // namespace

// Grid (G, m): blockIdx.y = entry e, blockIdx.x = chunk (G = 1 when a slot holds at most
// TOPK_SINGLE_BLOCK_POOLS pools, else ceil(pools_per_slot / SELECT_CHUNK)). Entry e's row of its
// slot (entries[e].row + row_add) from scores + e * pools_per_slot, its rows into
// selected + e * sel_cap and their count into count[e]. Dynamic smem: select_smem (launch helper),
// one u32 key per pool one block ranks, or the two bitmaps of a chunked row. Rows past
// TOPK_SINGLE_BLOCK_POOLS complete pools need the three select_radix_hist_batch phases launched
// before this, with the same arguments and workspace. Padding entries read and write nothing; a
// row past slot_rows, a list longer than sel_cap (a sizing error) or a row past the capacity give
// count 0 and no list. Two blocks per SM (32 registers, 64 KiB of keys each at GLM-5.3-Flash's
// sizes): a batch's rows share the SMs.
extern "C" __global__ void __launch_bounds__(1024, 2) select_topk_pools_batch(
    const float* __restrict__ scores, uint32_t* __restrict__ selected, uint32_t* __restrict__ count,
    const uint32_t* __restrict__ entries, uint32_t m, uint32_t row_add, uint32_t slot_rows, uint32_t sel_cap,
    uint32_t topk_pools, uint32_t kpool, uint32_t tail, uint32_t* __restrict__ workspace) {
    extern __shared__ __align__(16) uint32_t keys_s[];
    __shared__ SelectSmem sm;
    // The q_abs GEMV runs beside it.
    wait_then_release();
    const uint32_t e = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    if (e >= m) return;
    SelectPlan p;
    const SelectPlanKind kind = select_row_plan(entries, e, row_add, slot_rows, sel_cap, topk_pools, kpool, tail, p);
    if (kind == SEL_SKIP) return;
    if (kind == SEL_FAIL) {
        if (c == 0 && tid == 0) count[e] = 0u;
        return;
    }
    const uint32_t pps = pools_per_slot(slot_rows, kpool);
    const float* sc = scores + (size_t)e * pps;
    uint32_t* sel = selected + (size_t)e * sel_cap;
    const uint32_t npools = p.npools, tail0 = p.tail0, tail_n = p.tail_n, base = p.base;
    if (!p.multi) {
        if (c != 0) return;
        if (!p.ranked) {
            for (uint32_t i = tid; i < tail0; i += blockDim.x) sel[i] = i;
        } else {
            stage_score_keys(sc, npools, keys_s);
            select_core(keys_s, npools, topk_pools, sm,
                        [&](uint32_t pos, uint32_t i) { put_pool_rows(sel, pos, i, kpool); });
        }
    } else if (!select_row_radix(kind, p, topk_pools)) {
        if (c != 0) return;  // topk_pools 0: the list is the tail alone
    } else {
        const uint32_t nch = select_chunks(npools);
        if (c >= nch) return;
        uint32_t* ws = workspace + (size_t)e * select_ws_words(pps);
        uint32_t* gt_map = ws + SEL_WS_MAPS;
        uint32_t* eq_map = gt_map + select_map_words(pps);
        const uint32_t lo = c * SELECT_CHUNK, len = min(SELECT_CHUNK, npools - lo);
        float v[SEL_KEYS_PER_THREAD];
        load_chunk_scores(sc + lo, len, v);  // in flight while the threshold is found
        uint32_t T, need;
        radix_threshold(ws, 3u, topk_pools, sm, T, need);
        const uint32_t lane = tid & 31u, warp = tid >> 5;
#pragma unroll
        for (int u = 0; u < SEL_KEYS_PER_THREAD; ++u) {
            const uint32_t key = ordered_key(v[u]);
            const bool in = tid + SELECT_THREADS * (uint32_t)u < len;
            const uint32_t gtm = __ballot_sync(0xFFFFFFFFu, in && key > T);
            const uint32_t eqm = __ballot_sync(0xFFFFFFFFu, in && key == T);
            const uint32_t w = warp + (SELECT_THREADS >> 5) * (uint32_t)u;  // the chunk's word
            if (lane == 0 && 32u * w < len) {
                gt_map[lo / 32u + w] = gtm;
                eq_map[lo / 32u + w] = eqm;
            }
        }
        if (!last_of(ws, nch, sm)) return;
        // The next launch's histograms start from zero (every block of the entry has read them).
        uint4* h = reinterpret_cast<uint4*>(ws + SEL_WS_HIST0);
        for (uint32_t i = tid; i < (SEL_HIST0_BINS + 2u * SEL_HIST_BINS) / 4u; i += SELECT_THREADS)
            h[i] = make_uint4(0u, 0u, 0u, 0u);
        if (dynamic_smem_bytes() < 32u * ((npools + 127u) / 128u)) {  // 2 maps of W words, in vectors
            if (tid == 0) count[e] = 0u;
            return;
        }
        emit_bitmaps(gt_map, eq_map, npools, need, topk_pools, kpool, sel, keys_s, sm);
    }
    for (uint32_t i = tid; i < tail_n; i += blockDim.x) sel[base + i] = tail0 + i;
    if (tid == 0) count[e] = base + tail_n;
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
