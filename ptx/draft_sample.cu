// Sampled drafts on one rank: model/kernels/draft_sample.py has the contract (the per-entry record,
// the rules, the workspace) and the host twins, which compute the same bits as these kernels.
//
// Exactness: every sum is an integer sum (counts, and masses floor(e * 2^40) in u64) and every float
// operation is a correctly rounded one spelled out (__fdiv_rn, __fmul_rn, __fadd_rn, __dmul_rn: no
// contraction into FMAs), so the kept set, the masses and the probabilities do not depend on the
// order in which blocks or atomics run, nor on m: a row's outputs are bit-identical in any batch,
// and the twin's sort reaches the same numbers as the histogram scan here. Only the Gumbel noise
// (keyed_gumbel's logf) may differ from NumPy's f32 log by an ulp.
//
// Four launches per draft (sample_hist_batch, sample_select_batch, sample_index_batch,
// sample_draw_batch), Pdl.WAIT each: griddepcontrol.wait first, release at exit. The head before
// them releases its dependents early, so what it wrote (logits, entries) is read through L2.
#include "model_common.cuh"
#include "batch.cuh"
#include "keyed_rng.cuh"

namespace {
constexpr uint32_t SAMPLE_WORDS = 8;
constexpr uint32_t HIST_BINS = 65536;
constexpr size_t HIST_BYTES = 4u * HIST_BINS;
constexpr uint32_t ROW_STATE_BYTES = 64;
// 1024 threads a block for the histogram: its 128 KB of shared counts allow one block per SM, and
// 32 warps of loads in flight hide L2 latency where 8 could not.
constexpr uint32_t HIST_CHUNK = 8192, HIST_THREADS = 1024;
// sample_hist_batch's dynamic shared memory: a 16-bit count per key (two to a word), flushed to the
// row's global histogram at least every FLUSH_CHUNKS chunks, so no count reaches 2^16.
constexpr uint32_t HIST_SMEM = 2u * HIST_BINS;
constexpr uint32_t FLUSH_CHUNKS = 65535u / HIST_CHUNK;
static_assert(FLUSH_CHUNKS * HIST_CHUNK <= 0xFFFFu && HIST_SMEM == 2u * HIST_BINS, "16-bit shared counts");
constexpr uint32_t INDEX_CHUNK = 4096, INDEX_THREADS = 256;
constexpr uint32_t DRAW_CHUNK = 1024, DRAW_THREADS = 256;
constexpr uint32_t SELECT_THREADS = 1024;
constexpr uint32_t KEY_NEG_INF = 0x007Fu, KEY_POS_INF = 0xFF80u;
constexpr uint32_t NO_KEY = 0xFFFFFFFFu;
constexpr uint32_t FULL = 0xFFFFFFFFu;

// Row state, u32 words (draft_sample.py _State): 0..5 stay zero between launches.
constexpr uint32_t W_UTOP = 0, W_CNT_INDEX = 2, W_CNT_DRAW = 3, W_BEST = 4;  // W_BEST: u64
constexpr uint32_t W_MODE = 6, W_ZMAX = 7, W_LO = 8, W_HI = 9, W_JSTAR = 10, W_ISTAR = 11;
constexpr uint32_t W_INV = 12, W_TOTAL = 14;  // f64, u64

// Bounds of keyed_gumbel over its uniforms' range [2^-24, 1 - 2^-24]: -2.81 .. 16.64, with margin
// for logf's ulp. An element whose z + G_MAX is below a score some kept element reached cannot win.
constexpr float G_MAX = 17.0f, G_MIN = -3.0f;

// An upper bound of keyed_gumbel's -logf(-logf(u)) from its uniform u (the noise increases with u:
// at 0.5f, 0.87f and 0.997f it is 0.3666, 1.9714 and 5.8077; the bounds leave far more than logf's
// ulp of margin), so the draw skips the two logarithms of an element that cannot reach a score.
__device__ __forceinline__ float gumbel_below(float u) {
    return u < 0.5f ? 0.5f : u < 0.87f ? 2.0f : u < 0.997f ? 6.0f : G_MAX;
}

__device__ __forceinline__ uint32_t* row_hist(uint8_t* ws, uint32_t e) {
    return reinterpret_cast<uint32_t*>(ws + (size_t)e * HIST_BYTES);
}
__device__ __forceinline__ uint32_t* row_state(uint8_t* ws, uint32_t m, uint32_t e) {
    return reinterpret_cast<uint32_t*>(ws + (size_t)m * HIST_BYTES + (size_t)e * ROW_STATE_BYTES);
}
__device__ __forceinline__ uint32_t* row_counts(uint8_t* ws, uint32_t m, uint32_t e, uint32_t chunks) {
    return reinterpret_cast<uint32_t*>(ws + (size_t)m * (HIST_BYTES + ROW_STATE_BYTES)) + (size_t)e * chunks;
}

// BF16 bits with NaN made -inf and -0 made +0 (draft_sample.order_keys).
__device__ __forceinline__ uint32_t canon_bf16(uint32_t b) {
    b &= 0xFFFFu;
    if ((b & 0x7FFFu) > 0x7F80u) return 0xFF80u;
    return b == 0x8000u ? 0u : b;
}
// Monotone 16-bit key of canonical bits, and its inverse.
__device__ __forceinline__ uint32_t key16(uint32_t cb) { return (cb & 0x8000u) ? (~cb & 0xFFFFu) : (cb | 0x8000u); }
__device__ __forceinline__ uint32_t key_bits(uint32_t key) {
    return (key & 0x8000u) ? (key & 0x7FFFu) : (~key & 0xFFFFu);
}
__device__ __forceinline__ float key_z(uint32_t key, float t) { return __fdiv_rn(bf16_bits_to_f32(key_bits(key)), t); }

// draft_sample.sample_exp, operation for operation (the same constants as bits).
__device__ __forceinline__ float sample_exp(float x) {
    if (!(x >= -86.0f)) return 0.0f;
    const float k = rintf(__fmul_rn(x, __uint_as_float(0x3FB8AA3Bu)));
    const float r =
        __fsub_rn(__fsub_rn(x, __fmul_rn(k, __uint_as_float(0x3F318000u))), __fmul_rn(k, __uint_as_float(0xB95E8083u)));
    float p = __uint_as_float(0x39500D01u);
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3AB60B61u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3C088889u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3D2AAAABu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3E2AAAABu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3F000000u));
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __int_as_float(((int)k + 127) << 23));
}

__device__ __forceinline__ unsigned long long fixed_mass(float e) {
    return __float2ull_rz(__fmul_rn(e, 1099511627776.0f));  // 2^40: exact scaling, truncated
}

// The mass of one element whose key is `key`.
__device__ __forceinline__ unsigned long long key_mass(uint32_t key, float t, float zmax) {
    return fixed_mass(sample_exp(__fsub_rn(key_z(key, t), zmax)));
}

// q = f32(f64(e) * inv).
__device__ __forceinline__ float prob_of(float z, float zmax, double inv) {
    return __double2float_rn(__dmul_rn((double)sample_exp(__fsub_rn(z, zmax)), inv));
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long w = __shfl_xor_sync(FULL, v, o);
        v = w > v ? w : v;
    }
    return v;
}

// Sum of one u32 per thread over the block (blockDim a multiple of 32); valid in thread 0.
__device__ __forceinline__ uint32_t block_sum_u32(uint32_t v) {
    __shared__ uint32_t part[32];
    v = __reduce_add_sync(FULL, v);
    if ((threadIdx.x & 31u) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    uint32_t s = 0;
    if (threadIdx.x == 0)
        for (uint32_t w = 0; w < blockDim.x / 32u; ++w) s += part[w];
    __syncthreads();  // part is free again for the next call
    return s;
}

// The last of a row's `blocks` blocks to arrive (uniform over the block): last_block_done of
// model_common.cuh with a counter per row (the blocks of blockIdx.y); the last resets it.
__device__ __forceinline__ bool row_last_block(uint32_t* counter, uint32_t blocks) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const uint32_t prev = atomicAdd(counter, 1u);
        is_last = prev == blocks - 1u;
        if (is_last) {
            *counter = 0u;
            __threadfence();
        }
    }
    __syncthreads();
    return is_last;
}

// A live entry whose record samples (temperature > 0); else the caller's blocks have nothing to do
// (sample_draw_batch's greedy path aside). Read after the wait, through L2.
__device__ __forceinline__ bool sampled_entry(const uint32_t* entries, const uint32_t* sampling, uint32_t e, float& t) {
    if (__ldcg(entries + (size_t)e * ENTRY_WORDS) == BATCH_PAD) return false;
    t = __uint_as_float(__ldcg(sampling + (size_t)e * SAMPLE_WORDS));
    return t > 0.0f;
}

// A sampled record that restricts nothing (top-k 0 or >= n, no top-p: draft_sample.keeps_all): its
// kept set is the whole row, so it needs no histogram, only the largest key and the total mass.
__device__ __forceinline__ bool keeps_all(const uint32_t* sampling, uint32_t e, uint32_t n) {
    const uint32_t* rec = sampling + (size_t)e * SAMPLE_WORDS;
    const uint32_t top_k = __ldcg(rec + 2);
    return !(__uint_as_float(__ldcg(rec + 1)) < 1.0f) && (top_k == 0u || top_k >= n);
}
}  // namespace

// ---- 1. the histogram --------------------------------------------------------------------------------
//
// Grid (blocks per row, m), 1024 threads, HIST_SMEM bytes of dynamic shared memory; the blocks of a row
// stride over its chunks of HIST_CHUNK elements, eight elements a thread (strided: coalesced). Each
// block counts its elements' keys in shared memory (16-bit counts, two keys a word) and adds its
// nonzero counts to the row's global histogram (one atomic per key the block saw, not one per
// element), at the end and after every FLUSH_CHUNKS of its chunks. Any split gives the same
// histogram (integer sums), so the launch helper picks one wave of blocks for the batch. The row's
// largest key goes to state word 0 (atomicMax). A row that keeps every element (keeps_all) gets its
// largest key only: its histogram stays zero, sample_index_batch sums its mass.
namespace {
// The block's shared counts added to hist and zeroed again. Every thread calls it.
__device__ void flush_counts(uint32_t* counts, uint32_t* hist) {
    __syncthreads();  // every shared add is in
    uint4* c4 = reinterpret_cast<uint4*>(counts);
    for (uint32_t w = threadIdx.x; w < HIST_BINS / 8u; w += HIST_THREADS) {
        const uint4 v = c4[w];
        if ((v.x | v.y | v.z | v.w) == 0u) continue;
        const uint32_t word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (uint32_t k = 0; k < 4u; ++k) {
            const uint32_t bin = 8u * w + 2u * k;
            if (word[k] & 0xFFFFu) atomicAdd(hist + bin, word[k] & 0xFFFFu);
            if (word[k] >> 16) atomicAdd(hist + bin + 1u, word[k] >> 16);
        }
        c4[w] = make_uint4(0u, 0u, 0u, 0u);
    }
    __syncthreads();  // the counts are zero again before the next chunk's adds
}

// This block's elements of the row's chunks counted into hist; this thread's largest key.
__device__ uint32_t count_keys(const uint16_t* row, uint32_t* hist, uint32_t n, uint32_t chunks) {
    extern __shared__ uint4 hist_smem[];
    uint32_t* counts = reinterpret_cast<uint32_t*>(hist_smem);
    for (uint32_t w = threadIdx.x; w < HIST_BINS / 8u; w += HIST_THREADS) hist_smem[w] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
    uint32_t top = 0, pending = 0;
    for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {  // block-uniform
        if (pending == FLUSH_CHUNKS) {
            flush_counts(counts, hist);
            pending = 0;
        }
        uint32_t u[HIST_CHUNK / HIST_THREADS];
#pragma unroll
        for (uint32_t k = 0; k < HIST_CHUNK / HIST_THREADS; ++k) {
            const uint32_t i = c * HIST_CHUNK + k * HIST_THREADS + threadIdx.x;
            u[k] = i < n ? key16(canon_bf16(__ldcg(row + i))) : NO_KEY;
        }
#pragma unroll
        for (uint32_t k = 0; k < HIST_CHUNK / HIST_THREADS; ++k) {
            if (u[k] != NO_KEY) {
                top = max(top, u[k]);
                atomicAdd(counts + (u[k] >> 1), 1u << ((u[k] & 1u) << 4));
            }
        }
        ++pending;
    }
    flush_counts(counts, hist);
    return top;
}

// The largest key of this thread's elements of the row's chunks.
__device__ __forceinline__ uint32_t max_key(const uint16_t* row, uint32_t n, uint32_t chunks) {
    uint32_t top = 0;
    for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {
#pragma unroll
        for (uint32_t k = 0; k < HIST_CHUNK / HIST_THREADS; ++k) {
            const uint32_t i = c * HIST_CHUNK + k * HIST_THREADS + threadIdx.x;
            if (i < n) top = max(top, key16(canon_bf16(__ldcg(row + i))));
        }
    }
    return top;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(HIST_THREADS) sample_hist_batch(const uint16_t* logits,
                                                                             const uint32_t* sampling,
                                                                             const uint32_t* entries, uint8_t* ws,
                                                                             uint32_t m, uint32_t n) {
    grid_dependency_wait();
    const uint32_t e = blockIdx.y;
    float t;
    if (e >= m || !sampled_entry(entries, sampling, e, t)) return;
    const uint16_t* row = logits + (size_t)e * n;
    const uint32_t chunks = (n + HIST_CHUNK - 1u) / HIST_CHUNK;
    uint32_t top = keeps_all(sampling, e, n) ? max_key(row, n, chunks) : count_keys(row, row_hist(ws, e), n, chunks);
    __shared__ uint32_t wtop[HIST_THREADS / 32];
    top = __reduce_max_sync(FULL, top);
    if ((threadIdx.x & 31u) == 0) wtop[threadIdx.x >> 5] = top;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint32_t w = 1; w < HIST_THREADS / 32; ++w) top = max(top, wtop[w]);
        if (top) atomicMax(row_state(ws, m, e) + W_UTOP, top);
    }
}

// ---- 2. the selection ----------------------------------------------------------------------------------
//
// One block of 1024 threads per row. The histogram's 512 segments of 128 bins (segment s = bins
// 128 s .. 128 s + 127) get their count and mass (warp w, lane l, step j: segment 32 j + w, bins
// 4 l .. 4 l + 3 of it: the bins of a run of busy keys spread over all warps), then exclusive sums in
// descending key order; a boundary is then found by one warp reading one segment again.
namespace {
constexpr uint32_t SEGS = HIST_BINS / 128;

struct SelectSmem {
    uint32_t seg_c[SEGS], ex_c[SEGS];
    unsigned long long seg_m[SEGS], ex_m[SEGS];
    uint32_t wc[32];
    unsigned long long wm[32];
    uint32_t hit_seg;
    uint32_t hit_bin, hit_cnt, hit_above_c;
    unsigned long long hit_above_m, hit_mass1;
    uint32_t pa_c;
    unsigned long long pa_m;
};

// 2^40 / total: q_i = f32(f64(e_i) * inv).
__device__ __forceinline__ double inv_of(unsigned long long total) {
    return __ddiv_rn(1099511627776.0, __ull2double_rn(total));
}

// A sampled row's state words (mode 1; istar unresolved).
__device__ __forceinline__ void write_state(uint32_t* st, float zmax, uint32_t lo, uint32_t hi, uint32_t jstar,
                                            double inv, unsigned long long total) {
    st[W_ZMAX] = __float_as_uint(zmax);
    st[W_LO] = lo;
    st[W_HI] = hi;
    st[W_JSTAR] = jstar;
    st[W_ISTAR] = NO_KEY;
    *reinterpret_cast<double*>(st + W_INV) = inv;
    *reinterpret_cast<unsigned long long*>(st + W_TOTAL) = total;
    st[W_MODE] = 1u;
}

// Count and mass of bins b0 .. b0 + 3 (counts v), those above `above` only (NO_KEY: all).
__device__ __forceinline__ void word_sums(uint4 v, uint32_t b0, uint32_t above, float t, float zmax, uint32_t& c,
                                          unsigned long long& mm) {
    const uint32_t cnt[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const uint32_t b = b0 + k;
        if (cnt[k] && (above == NO_KEY || b > above)) {
            c += cnt[k];
            mm += (unsigned long long)cnt[k] * key_mass(b, t, zmax);
        }
    }
}

struct Hit {
    uint32_t bin, cnt, above_c;
    unsigned long long above_m, mass1;
};

// The bin where the running count (by_mass: mass) in descending key order first reaches `target`
// (1 <= target <= the row's total): the bin, its count, the count and mass of the bins above it,
// the mass of one of its elements. Every thread calls it.
__device__ Hit find_bin(SelectSmem& S, const uint4* h4, bool by_mass, unsigned long long target, float t,
                        float zmax) {
    const uint32_t tid = threadIdx.x;
    if (tid < SEGS) {
        const uint32_t s = SEGS - 1u - tid;
        const unsigned long long lo = by_mass ? S.ex_m[s] : S.ex_c[s];
        const unsigned long long w = by_mass ? S.seg_m[s] : S.seg_c[s];
        if (lo < target && target <= lo + w) S.hit_seg = s;
    }
    __syncthreads();
    if (tid < 32) {
        const uint32_t s = S.hit_seg, lane = tid, b0 = 128u * s + 4u * lane;
        const uint4 v = __ldcg(h4 + s * 32u + lane);
        const uint32_t cnt[4] = {v.x, v.y, v.z, v.w};
        unsigned long long m1[4];
        uint32_t lc = 0;
        unsigned long long lm = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            m1[k] = cnt[k] ? key_mass(b0 + k, t, zmax) : 0ull;
            lc += cnt[k];
            lm += (unsigned long long)cnt[k] * m1[k];
        }
        // Sums over this lane and the lanes above it (higher lanes hold higher keys).
        uint32_t sc = lc;
        unsigned long long sm = lm;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t xc = __shfl_down_sync(FULL, sc, o);
            const unsigned long long xm = __shfl_down_sync(FULL, sm, o);
            if (lane + o < 32u) {
                sc += xc;
                sm += xm;
            }
        }
        uint32_t ac = S.ex_c[s] + sc - lc;
        unsigned long long am = S.ex_m[s] + sm - lm;
        if ((by_mass ? am : ac) < target && target <= (by_mass ? am + lm : (unsigned long long)ac + lc)) {
            bool found = false;
#pragma unroll
            for (int k = 3; k >= 0; --k) {
                const unsigned long long wk = (unsigned long long)cnt[k] * (by_mass ? m1[k] : 1ull);
                const unsigned long long cur = by_mass ? am : ac;
                if (!found && cur < target && target <= cur + wk) {
                    found = true;
                    S.hit_bin = b0 + k;
                    S.hit_cnt = cnt[k];
                    S.hit_above_c = ac;
                    S.hit_above_m = am;
                    S.hit_mass1 = m1[k];
                }
                ac += cnt[k];
                am += (unsigned long long)cnt[k] * m1[k];
            }
        }
    }
    __syncthreads();
    const Hit h{S.hit_bin, S.hit_cnt, S.hit_above_c, S.hit_above_m, S.hit_mass1};
    __syncthreads();
    return h;
}

// Count and mass of the bins above key u. Every thread calls it.
__device__ void prefix_above(SelectSmem& S, const uint4* h4, uint32_t u, float t, float zmax, uint32_t& c,
                             unsigned long long& mm) {
    if (threadIdx.x < 32) {
        const uint32_t s = u >> 7, lane = threadIdx.x;
        uint32_t lc = 0;
        unsigned long long lm = 0;
        word_sums(__ldcg(h4 + s * 32u + lane), 128u * s + 4u * lane, u, t, zmax, lc, lm);
        lc = __reduce_add_sync(FULL, lc);
        lm = warp_sum_u64(lm);
        if (lane == 0) {
            S.pa_c = S.ex_c[s] + lc;
            S.pa_m = S.ex_m[s] + lm;
        }
    }
    __syncthreads();
    c = S.pa_c;
    mm = S.pa_m;
    __syncthreads();
}

// [lo, hi]: the keys of numbers whose z equals z(b) (an interval: z is monotone in the key). Almost
// always b alone; else binary searches. Every thread computes the same.
__device__ __forceinline__ void run_bounds(uint32_t b, float t, uint32_t& lo, uint32_t& hi) {
    const float zb = key_z(b, t);
    hi = b;
    if (b < KEY_POS_INF && key_z(b + 1u, t) == zb) {
        uint32_t a = b + 1u, c = KEY_POS_INF;  // z(a) == zb; the largest such key
        while (a < c) {
            const uint32_t mid = (a + c + 1u) >> 1;
            if (key_z(mid, t) == zb) a = mid;
            else c = mid - 1u;
        }
        hi = a;
    }
    lo = b;
    if (b > KEY_NEG_INF && key_z(b - 1u, t) == zb) {
        uint32_t a = KEY_NEG_INF, c = b - 1u;  // z(c) == zb; the smallest such key
        while (a < c) {
            const uint32_t mid = (a + c) >> 1;
            if (key_z(mid, t) == zb) c = mid;
            else a = mid + 1u;
        }
        lo = c;
    }
}

// A run of equal z (the kept set's boundary run): keys [lo, hi], `above` elements and `m_above` mass
// before it in the order, `size` elements, `mass1` each.
struct Run {
    uint32_t lo, hi, above, size;
    unsigned long long m_above, mass1;
};

__device__ Run run_of(SelectSmem& S, const uint4* h4, const Hit& h, float t, float zmax) {
    Run r;
    run_bounds(h.bin, t, r.lo, r.hi);
    r.mass1 = h.mass1;
    if (r.lo == r.hi) {
        r.above = h.above_c;
        r.m_above = h.above_m;
        r.size = h.cnt;
    } else {
        uint32_t c2;
        unsigned long long m2;
        prefix_above(S, h4, r.hi, t, zmax, r.above, r.m_above);
        prefix_above(S, h4, r.lo - 1u, t, zmax, c2, m2);  // lo > KEY_NEG_INF - 1 >= 0
        r.size = c2 - r.above;
    }
    return r;
}

// Exclusive sums of (c, m) in thread order over the block; the totals to every thread.
__device__ void block_excl_scan_cm(SelectSmem& S, uint32_t& c, unsigned long long& mm, uint32_t& tc,
                                   unsigned long long& tm) {
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    uint32_t ic = c;
    unsigned long long im = mm;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t xc = __shfl_up_sync(FULL, ic, o);
        const unsigned long long xm = __shfl_up_sync(FULL, im, o);
        if (lane >= (uint32_t)o) {
            ic += xc;
            im += xm;
        }
    }
    if (lane == 31u) {
        S.wc[warp] = ic;
        S.wm[warp] = im;
    }
    __syncthreads();
    if (warp == 0) {
        uint32_t a = lane < nw ? S.wc[lane] : 0u;
        unsigned long long b = lane < nw ? S.wm[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t xa = __shfl_up_sync(FULL, a, o);
            const unsigned long long xb = __shfl_up_sync(FULL, b, o);
            if (lane >= (uint32_t)o) {
                a += xa;
                b += xb;
            }
        }
        S.wc[lane] = a;  // inclusive over warps
        S.wm[lane] = b;
    }
    __syncthreads();
    const uint32_t bc = warp ? S.wc[warp - 1u] : 0u;
    const unsigned long long bm = warp ? S.wm[warp - 1u] : 0ull;
    tc = S.wc[nw - 1u];
    tm = S.wm[nw - 1u];
    c = bc + ic - c;
    mm = bm + im - mm;
    __syncthreads();
}
}  // namespace

// Grid (1, m), 1024 threads. The row's state (draft_sample.py _State) from its histogram: z_max from
// the largest key (reset to 0 here); a row whose z_max is not finite gets mode 0 (greedy-like) and
// nothing else. Else: top-k's boundary by count (when 0 < top_k < n), the mass kept by top-k,
// top-p's need and its boundary by mass (within top-k's boundary run when the need is beyond the
// mass above it), and the kept set as a run [lo, hi] of which the jstar lowest indices are kept.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS, 1) sample_select_batch(const uint16_t* logits,
                                                                                      const uint32_t* sampling,
                                                                                      const uint32_t* entries,
                                                                                      uint8_t* ws, uint32_t m,
                                                                                      uint32_t n) {
    grid_dependency_wait();
    (void)logits;
    const uint32_t e = blockIdx.y;
    float t;
    if (e >= m || !sampled_entry(entries, sampling, e, t)) return;
    __shared__ SelectSmem S;
    const uint32_t* rec = sampling + (size_t)e * SAMPLE_WORDS;
    uint32_t* st = row_state(ws, m, e);
    const uint4* h4 = reinterpret_cast<const uint4*>(row_hist(ws, e));
    const float top_p = __uint_as_float(__ldcg(rec + 1));
    const uint32_t top_k = __ldcg(rec + 2);
    const uint32_t utop = __ldcg(st + W_UTOP);
    __syncthreads();  // every thread has read the largest key before it is reset
    if (threadIdx.x == 0) st[W_UTOP] = 0u;
    const float zmax = key_z(utop, t);
    if (!isfinite(zmax)) {
        if (threadIdx.x == 0) st[W_MODE] = 0u;
        return;
    }
    if (keeps_all(sampling, e, n)) {  // S is the row: its total mass (and inv) is sample_index_batch's
        if (threadIdx.x == 0) write_state(st, zmax, 0u, 0u, 0u, 0.0, 0ull);
        return;
    }

    // Segment sums.
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (uint32_t j0 = 0; j0 < SEGS / 32u; j0 += 4u) {
        uint4 v[4];
#pragma unroll
        for (uint32_t k = 0; k < 4u; ++k) v[k] = __ldcg(h4 + ((j0 + k) * 32u + warp) * 32u + lane);
#pragma unroll
        for (uint32_t k = 0; k < 4u; ++k) {
            const uint32_t s = (j0 + k) * 32u + warp;
            uint32_t c = 0;
            unsigned long long mm = 0;
            if (__any_sync(FULL, (v[k].x | v[k].y | v[k].z | v[k].w) != 0u)) {
                word_sums(v[k], 128u * s + 4u * lane, NO_KEY, t, zmax, c, mm);
                c = __reduce_add_sync(FULL, c);
                mm = warp_sum_u64(mm);
            }
            if (lane == 0) {
                S.seg_c[s] = c;
                S.seg_m[s] = mm;
            }
        }
    }
    __syncthreads();
    uint32_t c = 0, total_c;
    unsigned long long mm = 0, total_m;
    if (threadIdx.x < SEGS) {
        c = S.seg_c[SEGS - 1u - threadIdx.x];
        mm = S.seg_m[SEGS - 1u - threadIdx.x];
    }
    block_excl_scan_cm(S, c, mm, total_c, total_m);
    if (threadIdx.x < SEGS) {
        S.ex_c[SEGS - 1u - threadIdx.x] = c;
        S.ex_m[SEGS - 1u - threadIdx.x] = mm;
    }
    __syncthreads();

    // The boundary: the run it falls in and how many of the run (lowest indices first) are kept.
    const uint32_t jk = (top_k > 0u && top_k < n) ? top_k : n;
    bool all = true;  // so far every element is kept
    Run r{};
    unsigned long long j = 0, total_k = total_m;
    if (jk < n) {
        r = run_of(S, h4, find_bin(S, h4, false, jk, t, zmax), t, zmax);
        j = jk - r.above;
        total_k = r.m_above + j * r.mass1;
        all = false;
    }
    if (top_p < 1.0f) {
        unsigned long long need = (unsigned long long)ceil(__dmul_rn((double)top_p, __ull2double_rn(total_k)));
        need = min(max(need, 1ull), total_k);
        if (all || need <= r.m_above) {
            r = run_of(S, h4, find_bin(S, h4, true, need, t, zmax), t, zmax);
            all = false;
        }
        if (r.mass1) j = (need - r.m_above + r.mass1 - 1ull) / r.mass1;
    }
    const unsigned long long total = all ? total_m : r.m_above + j * r.mass1;
    if (!all && r.above + j == n) all = true;
    if (threadIdx.x == 0)
        write_state(st, zmax, all ? 0u : r.lo, all ? 0u : r.hi, (all || j >= r.size) ? 0u : (uint32_t)j, inv_of(total),
                    total);
}

// ---- 3. the index of the boundary --------------------------------------------------------------------
//
// Grid (blocks per row, m), 256 threads, the blocks striding over the row's chunks of INDEX_CHUNK.
// Rows with jstar > 0 only: each chunk's count of the elements of the run [lo, hi]; the row's last
// block finds the chunk of the jstar-th and in it (16 consecutive elements a thread, then a scan)
// the element: istar. Rows that keep every element (keeps_all) instead: each block's sum of its
// elements' masses into the state's total (an integer sum: any order, the same bits), and the row's
// last block derives inv from it, which sample_draw_batch needs before it writes any q.
namespace {
// Every thread's elements of the row's chunks: their summed mass added to st's total.
__device__ void add_row_mass(const uint16_t* row, uint32_t* st, uint32_t n, float t, float zmax) {
    const uint32_t chunks = (n + INDEX_CHUNK - 1u) / INDEX_CHUNK;
    unsigned long long mass = 0;
    for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {
#pragma unroll 4
        for (uint32_t k = 0; k < INDEX_CHUNK / INDEX_THREADS; ++k) {
            const uint32_t i = c * INDEX_CHUNK + k * INDEX_THREADS + threadIdx.x;
            if (i < n) {
                const float z = __fdiv_rn(bf16_bits_to_f32(canon_bf16(__ldcg(row + i))), t);
                mass += fixed_mass(sample_exp(__fsub_rn(z, zmax)));
            }
        }
    }
    __shared__ unsigned long long wmass[INDEX_THREADS / 32];
    mass = warp_sum_u64(mass);
    if ((threadIdx.x & 31u) == 0) wmass[threadIdx.x >> 5] = mass;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint32_t w = 1; w < INDEX_THREADS / 32; ++w) mass += wmass[w];
        if (mass) atomicAdd(reinterpret_cast<unsigned long long*>(st + W_TOTAL), mass);
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(INDEX_THREADS) sample_index_batch(const uint16_t* logits,
                                                                               const uint32_t* sampling,
                                                                               const uint32_t* entries, uint8_t* ws,
                                                                               uint32_t m, uint32_t n) {
    grid_dependency_wait();
    const uint32_t e = blockIdx.y, tid = threadIdx.x;
    float t;
    if (e >= m || !sampled_entry(entries, sampling, e, t)) return;
    uint32_t* st = row_state(ws, m, e);
    if (__ldcg(st + W_MODE) == 0u) return;
    if (keeps_all(sampling, e, n)) {
        add_row_mass(logits + (size_t)e * n, st, n, t, __uint_as_float(__ldcg(st + W_ZMAX)));
        if (row_last_block(st + W_CNT_INDEX, gridDim.x) && tid == 0) {
            // Every block's add is in (row_last_block's fences); the atomic reads it from L2.
            const unsigned long long total = atomicAdd(reinterpret_cast<unsigned long long*>(st + W_TOTAL), 0ull);
            *reinterpret_cast<double*>(st + W_INV) = inv_of(total);
        }
        return;
    }
    const uint32_t jstar = __ldcg(st + W_JSTAR);
    if (jstar == 0u) return;
    const uint32_t lo = __ldcg(st + W_LO), hi = __ldcg(st + W_HI);
    const uint16_t* row = logits + (size_t)e * n;
    const uint32_t chunks = (n + INDEX_CHUNK - 1u) / INDEX_CHUNK;
    uint32_t* counts = row_counts(ws, m, e, chunks);
    for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {  // block-uniform
        uint32_t cnt = 0;
#pragma unroll  // sixteen independent loads in flight
        for (uint32_t k = 0; k < INDEX_CHUNK / INDEX_THREADS; ++k) {
            const uint32_t i = c * INDEX_CHUNK + k * INDEX_THREADS + tid;
            if (i < n) {
                const uint32_t u = key16(canon_bf16(__ldcg(row + i)));
                cnt += (u >= lo && u <= hi) ? 1u : 0u;
            }
        }
        cnt = block_sum_u32(cnt);
        if (tid == 0) counts[c] = cnt;
    }
    if (!row_last_block(st + W_CNT_INDEX, gridDim.x)) return;

    __shared__ uint32_t scratch[32];
    __shared__ uint32_t sh_chunk, sh_rank;
    uint32_t base = 0;
    for (uint32_t b0 = 0; b0 < chunks; b0 += INDEX_THREADS) {  // block-uniform
        const uint32_t v = b0 + tid < chunks ? __ldcg(counts + b0 + tid) : 0u;
        uint32_t sum;
        const uint32_t ex = base + block_exclusive_scan(v, scratch, &sum);
        if (ex < jstar && jstar <= ex + v) {
            sh_chunk = b0 + tid;
            sh_rank = jstar - ex;
        }
        base += sum;
    }
    __syncthreads();
    const uint32_t rank = sh_rank, s0 = sh_chunk * INDEX_CHUNK + tid * (INDEX_CHUNK / INDEX_THREADS);
    static_assert(INDEX_CHUNK / INDEX_THREADS <= 32, "one bit of `in_run` per element of a thread");
    uint32_t in_run = 0;  // bit k: element s0 + k is of the run (read once, all loads in flight)
#pragma unroll
    for (uint32_t k = 0; k < INDEX_CHUNK / INDEX_THREADS; ++k) {
        const uint32_t i = s0 + k;
        if (i < n) {
            const uint32_t u = key16(canon_bf16(__ldcg(row + i)));
            in_run |= (u >= lo && u <= hi) ? 1u << k : 0u;
        }
    }
    const uint32_t mine = __popc(in_run);
    uint32_t sum;
    const uint32_t ex = block_exclusive_scan(mine, scratch, &sum);
    if (ex < rank && rank <= ex + mine) {
        // The (rank - ex)-th set bit, lowest first: drop the rank - ex - 1 lower ones.
        uint32_t b = in_run;
        for (uint32_t j = ex + 1u; j < rank; ++j) b &= b - 1u;
        st[W_ISTAR] = s0 + (uint32_t)(__ffs(b) - 1);
    }
}

// ---- 4. the draw -----------------------------------------------------------------------------------------
//
// Grid (blocks per row, m), 256 threads striding over the row's chunks of DRAW_CHUNK, four elements
// a thread in a chunk (strided). A greedy-like row:
// the dist row one-hot at the head's token (entries[e].token), block 0 commits q = 1. A sampled row:
// each block's best key (ordered f32 score << 32 | ~index: the larger score, then the lower index)
// into state words 4-5 by atomicMax (order-free), the dist row q_i = f32(f64(e_i) * inv) on the kept
// set; the row's last block commits. Every block of a sampled row zeroes its share of the histogram
// (not where the row keeps every element: sample_hist_batch left that one zero).
namespace {
__device__ __forceinline__ void commit_row(uint32_t* entries, uint32_t* drafts, float* probs, uint32_t* host_drafts,
                                           float* host_probs, uint32_t e, uint32_t di, uint32_t kmax,
                                           uint32_t publish, uint32_t t, float q, bool token) {
    const size_t r = (size_t)e * kmax;
    if (token) {
        entries[(size_t)e * ENTRY_WORDS + 2u] = t;
        drafts[r + di] = t;
    }
    probs[r + di] = q;
    if (publish) {
        // The earlier drafts' words were committed by earlier launches; read through L2 all the same.
        for (uint32_t i = 0; i < di; ++i) {
            host_drafts[r + i] = __ldcg(drafts + r + i);
            host_probs[r + i] = __ldcg(probs + r + i);
        }
        host_drafts[r + di] = token ? t : __ldcg(drafts + r + di);
        host_probs[r + di] = q;
    }
}

__device__ __forceinline__ void zero_hist_share(uint32_t* hist, uint32_t b, uint32_t blocks) {
    constexpr uint32_t WORDS = HIST_BINS / 4u;
    const uint32_t per = (WORDS + blocks - 1u) / blocks, end = min(WORDS, (b + 1u) * per);
    uint4* h4 = reinterpret_cast<uint4*>(hist);
    for (uint32_t w = b * per + threadIdx.x; w < end; w += blockDim.x) h4[w] = make_uint4(0u, 0u, 0u, 0u);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(DRAW_THREADS) sample_draw_batch(
    const uint16_t* logits, const uint32_t* sampling, uint32_t* entries, uint32_t* drafts, float* probs,
    uint32_t* host_drafts, float* host_probs, uint32_t draft_index, uint32_t kmax, uint32_t publish, uint32_t m,
    uint32_t n, uint8_t* ws) {
    grid_dependency_wait();
    const uint32_t e = blockIdx.y, tid = threadIdx.x;
    if (e >= m || __ldcg(entries + (size_t)e * ENTRY_WORDS) == BATCH_PAD) return;
    const uint32_t* rec = sampling + (size_t)e * SAMPLE_WORDS;
    const float t = __uint_as_float(__ldcg(rec));
    const unsigned long long daddr = (unsigned long long)__ldcg(rec + 6) | ((unsigned long long)__ldcg(rec + 7) << 32);
    float* dist = daddr ? reinterpret_cast<float*>(daddr) + (size_t)draft_index * n : nullptr;
    uint32_t* st = row_state(ws, m, e);
    const uint16_t* row = logits + (size_t)e * n;
    const uint32_t chunks = (n + DRAW_CHUNK - 1u) / DRAW_CHUNK;
    const bool sampled = t > 0.0f;
    if (sampled && !keeps_all(sampling, e, n)) zero_hist_share(row_hist(ws, e), blockIdx.x, gridDim.x);
    if (!sampled || __ldcg(st + W_MODE) == 0u) {
        const uint32_t tok = __ldcg(entries + (size_t)e * ENTRY_WORDS + 2u);
        if (dist) {
            for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {
                for (uint32_t k = 0; k < DRAW_CHUNK / DRAW_THREADS; ++k) {
                    const uint32_t i = c * DRAW_CHUNK + k * DRAW_THREADS + tid;
                    if (i < n) dist[i] = i == tok ? 1.0f : 0.0f;
                }
            }
        }
        if (blockIdx.x == 0 && tid == 0)
            commit_row(entries, drafts, probs, host_drafts, host_probs, e, draft_index, kmax, publish, tok, 1.0f, false);
        return;
    }
    const float zmax = __uint_as_float(__ldcg(st + W_ZMAX));
    const uint32_t lo = __ldcg(st + W_LO), hi = __ldcg(st + W_HI), istar = __ldcg(st + W_ISTAR);
    const double inv = __ldcg(reinterpret_cast<const double*>(st + W_INV));
    const unsigned long long seed = (unsigned long long)__ldcg(rec + 3) | ((unsigned long long)__ldcg(rec + 4) << 32);
    const uint32_t position = __ldcg(rec + 5);
    // The first of the order is kept and scores at least z_max + G_MIN: nothing below can win.
    const float floor_s = __fadd_rn(zmax, G_MIN);
    float best_s = -INFINITY;
    unsigned long long best = 0ull;
    for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {
        for (uint32_t k = 0; k < DRAW_CHUNK / DRAW_THREADS; ++k) {
            const uint32_t i = c * DRAW_CHUNK + k * DRAW_THREADS + tid;
            if (i >= n) break;
            const uint32_t cb = canon_bf16(__ldcg(row + i)), u = key16(cb);
            const float z = __fdiv_rn(bf16_bits_to_f32(cb), t);
            const bool kept = u > hi || (u >= lo && i <= istar);
            if (dist) dist[i] = kept ? prob_of(z, zmax, inv) : 0.0f;
            const float bound = fmaxf(floor_s, best_s);
            if (!kept || __fadd_rn(z, G_MAX) < bound) continue;
            const float uni = keyed_uniform(seed, position, draft_index, 0u, i);
            if (__fadd_rn(z, gumbel_below(uni)) < bound) continue;  // the logarithms only where it can win
            const float s = __fadd_rn(z, -logf(-logf(uni)));  // keyed_gumbel of this element
            const unsigned long long key = ((unsigned long long)ordered_key(s) << 32) | (0xFFFFFFFFu - i);
            if (key > best) {
                best = key;
                best_s = s;
            }
        }
    }
    __shared__ unsigned long long wbest[DRAW_THREADS / 32];
    best = warp_max_u64(best);
    if ((tid & 31u) == 0) wbest[tid >> 5] = best;
    __syncthreads();
    if (tid == 0) {
        for (uint32_t w = 1; w < DRAW_THREADS / 32; ++w) best = wbest[w] > best ? wbest[w] : best;
        if (best) atomicMax(reinterpret_cast<unsigned long long*>(st + W_BEST), best);
    }
    if (!row_last_block(st + W_CNT_DRAW, gridDim.x)) return;
    if (tid == 0) {
        const unsigned long long k = atomicExch(reinterpret_cast<unsigned long long*>(st + W_BEST), 0ull);
        // k is never 0 (the first of the order is kept and never skipped); the head's token if it were.
        const uint32_t tok = k ? 0xFFFFFFFFu - (uint32_t)(k & 0xFFFFFFFFull) : __ldcg(entries + (size_t)e * ENTRY_WORDS + 2u);
        const float z = __fdiv_rn(bf16_bits_to_f32(canon_bf16(__ldcg(row + tok))), t);
        commit_row(entries, drafts, probs, host_drafts, host_probs, e, draft_index, kmax, publish, tok,
                   prob_of(z, zmax, inv), true);
    }
}
