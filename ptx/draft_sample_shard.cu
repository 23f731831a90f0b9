// The sampled draft with a vocabulary-sharded head (model/kernels/draft_sample_shard.py has the
// contract and the host twins): exact, identical on every rank, and what one rank sampling the whole
// vocabulary draws, because the noise of vocabulary index i is keyed by i alone (keyed_rng.cuh) and
// Gumbel-max is an argmax: argmax_i z_i + g_i.
//
// sample_shard_local_batch (grid chunks x m) -> all_gather of every rank's record -> sample_shard_
// commit_batch (grid chunks x m). One collective a draft. A row's record on this rank (u64 words):
// - greedy (temperature 0): [the argmax key of the logits]
// - temperature only: [the key of max z + g, (max z) | (sum exp(z - max z)) << 32, z at that key]
// - top-k: this rank's top min(k, n_local) keys of z, in no particular order, zeros up to k.
// Keys are the greedy exchange key (draft_head.cu): ordered_key(value) << 32 | (0xFFFFFFFF - global
// index); a larger key is a larger value, or on a tie the lower index, and keys are unique.
//
// Every result is made of selections (exact in any order: the top-k set is the keys above one
// threshold) and of sums in one fixed order per row (the chunks in column order, the ranks in rank
// order, the top-k in key order), so a row's bits do not depend on the batch, the other rows, or on
// which rank computes them.
#include "model_common.cuh"
#include "batch.cuh"
#include "keyed_rng.cuh"

namespace {
constexpr uint32_t THREADS = 256;
constexpr uint32_t CHUNK = 4096;  // columns of a row per block (SHARD_CHUNK)
constexpr uint32_t PER = CHUNK / THREADS;
constexpr uint32_t TOP_K_MAX = 256;  // SHARD_TOP_K_MAX: one candidate a thread in the commit
constexpr uint32_t SAMPLE_WORDS = 8;
constexpr uint32_t MODE_GREEDY = 0, MODE_TEMP = 1, MODE_TOPK = 2;
constexpr uint32_t STREAM_DRAFT = 0;                             // keyed_rng.py Stream.DRAFT
constexpr uint32_t KEY_POS_INF = 0xFF800000u, KEY_NEG_INF = 0x007FFFFFu;  // ordered_key(+-inf)

typedef unsigned long long u64;

// [temperature f32 bits, top_p f32 bits, top_k, seed lo, seed hi, position, dist lo, dist hi]
struct SampleRecord {
    float t;
    uint32_t k;
    u64 seed;
    uint32_t pos;
    u64 dist;
};

__device__ __forceinline__ SampleRecord load_record(const uint32_t* __restrict__ sampling, uint32_t e) {
    const uint32_t* r = sampling + (size_t)e * SAMPLE_WORDS;
    SampleRecord o;
    o.t = __uint_as_float(r[0]);
    o.k = r[2];
    o.seed = (u64)r[3] | ((u64)r[4] << 32);
    o.pos = r[5];
    o.dist = (u64)r[6] | ((u64)r[7] << 32);
    return o;
}

// top_p is not read: check_shard_sampling refused it before anything was drafted. A top-k of 0 or of
// the whole vocabulary keeps every token.
__device__ __forceinline__ uint32_t row_mode(const SampleRecord& r, uint32_t vocab) {
    if (r.t == 0.0f) return MODE_GREEDY;
    return (r.k > 0u && r.k < vocab) ? MODE_TOPK : MODE_TEMP;
}

__device__ __forceinline__ u64 pack_key(float v, uint32_t global_index) {
    return ((u64)ordered_key(v) << 32) | (0xFFFFFFFFu - global_index);
}

// The f32 a key's high word was made from (-0 comes back as +0, NaN as a NaN).
__device__ __forceinline__ float key_value(uint32_t hi) {
    return __uint_as_float((hi & 0x80000000u) ? (hi ^ 0x80000000u) : ~hi);
}

__device__ __forceinline__ uint32_t key_index(u64 k) { return k ? 0xFFFFFFFFu - (uint32_t)k : 0u; }

// draft_head.cu's flag codes from the high word of the row's largest value: 1 no value is a number,
// 2 the largest is infinite.
__device__ __forceinline__ uint32_t nonfinite_code(uint32_t hi) {
    return hi == 0u ? 1u : (hi == KEY_POS_INF || hi == KEY_NEG_INF) ? 2u : 0u;
}

// exp(z - zmax), a -inf logit exactly 0 (also when zmax is -inf: a shard or chunk of -inf logits
// adds nothing instead of exp(NaN)).
__device__ __forceinline__ float soft_term(float z, float zmax) {
    return z == -INFINITY ? 0.0f : expf(__fsub_rn(z, zmax));
}

__device__ __forceinline__ float lo_f32(u64 w) { return __uint_as_float((uint32_t)w); }
__device__ __forceinline__ float hi_f32(u64 w) { return __uint_as_float((uint32_t)(w >> 32)); }
__device__ __forceinline__ u64 two_f32(float lo, float hi) {
    return (u64)__float_as_uint(lo) | ((u64)__float_as_uint(hi) << 32);
}

// z = logit / temperature, IEEE-rounded like the host's f32 division.
__device__ __forceinline__ float z_of(const uint16_t* row, uint32_t i, float t) {
    return __fdiv_rn(bf16_bits_to_f32(row[i]), t);
}

// Block max of a u64 (blockDim.x == THREADS); every thread gets it. scratch: THREADS / 32 words.
__device__ __forceinline__ u64 block_max_u64(u64 v, u64* scratch) {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        v = other > v ? other : v;
    }
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? scratch[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        v = other > v ? other : v;
    }
    __syncthreads();
    return v;
}

struct SelectShared {
    uint32_t hist[256];
    uint32_t scan[32];
    uint32_t pick[3];  // digit, count above it, count in it
};

// The threshold of the `want` largest of n u64 keys load(j), j < n: the key thr such that exactly
// `want` keys are >= thr. Keys must be unique except for zeros, and at least `want` of them
// non-zero (zeros then stay below thr). Radix select, most significant byte first, 8 bits a pass,
// stopping at the pass whose bucket is needed whole; the histogram adds once per distinct digit of
// a warp (__match_any_sync), since the high bytes of a row's keys are few and equal. Every thread of
// the block calls it and gets thr; the loops are block-uniform.
template <class Load>
__device__ __forceinline__ u64 block_kth_key(Load load, uint32_t n, uint32_t want, SelectShared& sh) {
    u64 prefix = 0ull, mask = 0ull;
    uint32_t remaining = want;
    for (int b = 7; b >= 0; --b) {
        const uint32_t shift = 8u * (uint32_t)b;
        sh.hist[threadIdx.x] = 0u;
        __syncthreads();
        for (uint32_t base = 0; base < n; base += THREADS) {
            const uint32_t j = base + threadIdx.x;
            uint32_t d = 256u;  // not counted
            if (j < n) {
                const u64 key = load(j);
                if ((key & mask) == prefix) d = (uint32_t)(key >> shift) & 255u;
            }
            const uint32_t peers = __match_any_sync(0xFFFFFFFFu, d);
            if (d < 256u && (threadIdx.x & 31u) == (uint32_t)(__ffs(peers) - 1)) atomicAdd(&sh.hist[d], __popc(peers));
        }
        __syncthreads();
        // Thread t holds bucket 255 - t: its exclusive scan is the count in the buckets above it.
        const uint32_t cnt = sh.hist[255u - threadIdx.x];
        uint32_t total;
        const uint32_t above = block_exclusive_scan(cnt, sh.scan, &total);
        if (above < remaining && remaining <= above + cnt) {
            sh.pick[0] = 255u - threadIdx.x;
            sh.pick[1] = above;
            sh.pick[2] = cnt;
        }
        __syncthreads();
        const uint32_t d = sh.pick[0], ab = sh.pick[1], cn = sh.pick[2];
        prefix |= (u64)d << shift;
        mask |= 255ull << shift;
        remaining -= ab;
        if (remaining == cn) break;  // the whole bucket: every key >= prefix (low bytes 0) is in
        // The next pass rewrites hist and pick only after two barriers every thread passes after
        // reading them here.
    }
    return prefix;
}

__device__ __forceinline__ void publish_row(const uint32_t* d, const float* p, uint32_t* host_d, float* host_p,
                                            uint32_t draft_index, uint32_t token, float q) {
    // Earlier drafts were committed by earlier launches: through L2 all the same.
    for (uint32_t i = 0; i < draft_index; ++i) {
        host_d[i] = __ldcg(d + i);
        host_p[i] = __ldcg(p + i);
    }
    host_d[draft_index] = token;
    host_p[draft_index] = q;
}
}  // namespace

// Grid (chunks, m), chunks = ceil(n_local / CHUNK), block THREADS. Block (c, e) reduces columns
// [c CHUNK, min(n_local, (c + 1) CHUNK)) of row e of logits [m][n_local] into part (u64 [m][chunks]
// [P], P = max(cap, 2)); the row's last block to finish (counters u32 per row, zero before and after)
// combines its row's chunks, in chunk order, into the row's record send[e] (u64 [m][R], R = max(cap,
// 3)). Padding entries read and write nothing.
extern "C" __global__ void __launch_bounds__(THREADS) sample_shard_local_batch(
    const uint16_t* __restrict__ logits, const uint32_t* __restrict__ sampling, const uint32_t* __restrict__ entries,
    unsigned long long* part, uint32_t* counters, unsigned long long* __restrict__ send, uint32_t v0, uint32_t n_local,
    uint32_t vocab, uint32_t draft_index, uint32_t cap, uint32_t m) {
    __shared__ u64 ks[CHUNK];
    __shared__ SelectShared sel;
    __shared__ u64 red_u[THREADS / 32];
    __shared__ float red_f[32];
    __shared__ uint32_t cnt_s;
    __shared__ bool last_s;
    const uint32_t e = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const uint32_t chunks = (n_local + CHUNK - 1u) / CHUNK;
    if (e >= m || c >= chunks || cap == 0u || cap > TOP_K_MAX) return;
    if (__ldcg(entries + (size_t)e * ENTRY_WORDS) == BATCH_PAD) return;
    const SampleRecord rec = load_record(sampling, e);
    const uint32_t mode = row_mode(rec, vocab);
    const uint32_t P = max(cap, 2u), R = max(cap, 3u), keff = min(rec.k, cap);
    const uint32_t c0 = c * CHUNK, len = min(CHUNK, n_local - c0);
    const uint16_t* row = logits + (size_t)e * n_local;
    u64* pc = part + ((size_t)e * chunks + c) * P;

    if (mode == MODE_GREEDY) {
        u64 best = 0ull;
#pragma unroll
        for (uint32_t j = 0; j < PER; ++j) {
            const uint32_t l = tid + j * THREADS;
            if (l < len) {
                const u64 key = pack_key(bf16_bits_to_f32(row[c0 + l]), v0 + c0 + l);
                best = key > best ? key : best;
            }
        }
        best = block_max_u64(best, red_u);
        if (tid == 0) pc[0] = best;
    } else if (mode == MODE_TEMP) {
        float z[PER];
        uint32_t zmax_key = 0u;
#pragma unroll
        for (uint32_t j = 0; j < PER; ++j) {
            const uint32_t l = tid + j * THREADS;
            z[j] = l < len ? z_of(row, c0 + l, rec.t) : -INFINITY;
            if (l < len) zmax_key = max(zmax_key, ordered_key(z[j]));
        }
        const float zmax = key_value((uint32_t)(block_max_u64(zmax_key, red_u)));
        // The noise only where it can win: g lies in [G_MIN, G_MAX] = [-2.8116, 16.6356] (u in
        // [2^-24, 1 - 2^-24]), so z + g of a z below zmax - 19.45 is below the chunk's largest z's
        // own z + g and is not the chunk's best. The cut keeps 0.05 plus 8 ulps of zmax to spare for
        // the roundings of z + g; NaN (in z or zmax) and infinities are never cut. Exact: the same
        // best key as the noise everywhere, at a fraction of the Philox work when the logits are
        // spread out (a language model's are).
        const float cut = __fsub_rn(zmax, __fadd_rn(19.5f, __fmul_rn(9.5367431640625e-7f, fabsf(zmax))));
        u64 best = 0ull;
        float s = 0.0f;
#pragma unroll
        for (uint32_t j = 0; j < PER; ++j) {
            const uint32_t l = tid + j * THREADS;
            s = __fadd_rn(s, soft_term(z[j], zmax));
            if (l < len && !(z[j] < cut)) {
                const uint32_t gi = v0 + c0 + l;
                const float g = keyed_gumbel(rec.seed, rec.pos, draft_index, STREAM_DRAFT, gi);
                const u64 key = pack_key(__fadd_rn(z[j], g), gi);
                best = key > best ? key : best;
            }
        }
        best = block_max_u64(best, red_u);
        s = block_sum(s, red_f);
        if (tid == 0) {
            pc[0] = best;
            pc[1] = two_f32(zmax, s);
        }
    } else {
#pragma unroll
        for (uint32_t j = 0; j < PER; ++j) {
            const uint32_t l = tid + j * THREADS;
            ks[l] = l < len ? pack_key(z_of(row, c0 + l, rec.t), v0 + c0 + l) : 0ull;
        }
        __syncthreads();
        const u64 thr = block_kth_key([&](uint32_t j) { return ks[j]; }, CHUNK, min(keff, len), sel);
        if (tid == 0) cnt_s = 0u;
        __syncthreads();
#pragma unroll
        for (uint32_t j = 0; j < PER; ++j) {
            const u64 key = ks[tid + j * THREADS];
            if (key != 0ull && key >= thr) pc[atomicAdd(&cnt_s, 1u)] = key;
        }
    }

    // The row's last block combines (threadFenceReduction: the stores, a fence, the count).
    __threadfence();
    __syncthreads();
    if (tid == 0) last_s = atomicAdd(counters + e, 1u) == chunks - 1u;
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    u64* out = send + (size_t)e * R;
    const u64* prow = part + (size_t)e * chunks * P;
    if (mode == MODE_GREEDY) {
        if (tid == 0) {
            u64 best = 0ull;
            for (uint32_t k = 0; k < chunks; ++k) {
                const u64 key = __ldcg(prow + (size_t)k * P);
                best = key > best ? key : best;
            }
            out[0] = best;
        }
    } else if (mode == MODE_TEMP) {
        if (tid == 0) {
            u64 best = 0ull;
            uint32_t zmax_key = 0u;
            for (uint32_t k = 0; k < chunks; ++k) {
                const u64 key = __ldcg(prow + (size_t)k * P);
                best = key > best ? key : best;
                zmax_key = max(zmax_key, ordered_key(lo_f32(__ldcg(prow + (size_t)k * P + 1u))));
            }
            const float zmax = key_value(zmax_key);
            float s = 0.0f;
            for (uint32_t k = 0; k < chunks; ++k) {
                const u64 w = __ldcg(prow + (size_t)k * P + 1u);
                const float sk = hi_f32(w);
                if (sk != 0.0f) s = __fadd_rn(s, __fmul_rn(sk, expf(__fsub_rn(lo_f32(w), zmax))));
            }
            out[0] = best;
            out[1] = two_f32(zmax, s);
            out[2] = (u64)__float_as_uint(z_of(row, key_index(best) - v0, rec.t));
        }
    } else {
        // Chunk k holds min(keff, its length) keys at prow + k P; only the last chunk can be shorter
        // than keff (CHUNK > TOP_K_MAX), so union element j is chunk j / keff's key j % keff.
        const uint32_t len_last = n_local - (chunks - 1u) * CHUNK;
        const uint32_t n = (chunks - 1u) * keff + min(keff, len_last);
        auto at = [&](uint32_t j) { return __ldcg(prow + (size_t)(j / keff) * P + j % keff); };
        const uint32_t want = min(keff, n_local);
        const u64 thr = block_kth_key(at, n, want, sel);
        if (tid == 0) cnt_s = 0u;
        __syncthreads();
        for (uint32_t j = tid; j < n; j += THREADS) {
            const u64 key = at(j);
            if (key != 0ull && key >= thr) out[atomicAdd(&cnt_s, 1u)] = key;
        }
        for (uint32_t w = want + tid; w < keff; w += THREADS) out[w] = 0ull;
    }
    if (tid == 0) counters[e] = 0u;
}

// Grid (chunks, m), block THREADS. recv: u64 [world][m][R], every rank's record (all_gather), the
// same bytes on every rank. Every block of row e derives the row's draft from recv alone (so every
// rank and every block gets the same bits); block 0 commits it (entries[e].token, drafts and probs
// [e kmax + draft_index], with publish drafts / probs [e kmax + 0 .. draft_index] to the host copies,
// the flag byte when the row's largest z is not finite); when the record has a dist address each
// block c writes q for its columns [c CHUNK, ...) of this rank's vocabulary [v0, v0 + n_local), at
// dist + draft_index vocab + v0 + i. A block of a row without dist other than block 0 exits at once.
extern "C" __global__ void __launch_bounds__(THREADS) sample_shard_commit_batch(
    const uint16_t* __restrict__ logits, const uint32_t* __restrict__ sampling, uint32_t* entries,
    const unsigned long long* __restrict__ recv, uint32_t* drafts, float* probs, uint32_t* __restrict__ host_drafts,
    float* __restrict__ host_probs, uint32_t draft_index, uint32_t kmax, uint32_t publish, uint32_t v0, uint32_t n_local,
    uint32_t vocab, uint32_t world, uint32_t cap, uint32_t m, uint8_t* flags, uint32_t flag_byte) {
    __shared__ SelectShared sel;
    __shared__ u64 cand[TOP_K_MAX];
    __shared__ u64 sorted[TOP_K_MAX];
    __shared__ u64 red_u[THREADS / 32];
    __shared__ float red_f[32];
    __shared__ uint32_t cnt_s;
    __shared__ float q_s;
    const uint32_t e = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const uint32_t chunks = (n_local + CHUNK - 1u) / CHUNK;
    if (e >= m || c >= chunks || cap == 0u || cap > TOP_K_MAX || world == 0u) return;
    if (__ldcg(entries + (size_t)e * ENTRY_WORDS) == BATCH_PAD) return;
    const SampleRecord rec = load_record(sampling, e);
    float* dist = rec.dist ? reinterpret_cast<float*>(rec.dist) + (size_t)draft_index * vocab + v0 : nullptr;
    if (c != 0u && dist == nullptr) return;
    const uint32_t mode = row_mode(rec, vocab);
    const uint32_t R = max(cap, 3u);
    const size_t stride = (size_t)m * R;  // from one rank's records to the next's
    const u64* rr = recv + (size_t)e * R;
    const uint32_t c0 = c * CHUNK, len = min(CHUNK, n_local - c0);
    const uint16_t* row = logits + (size_t)e * n_local;
    uint32_t token, top_hi;
    float q;
    if (mode == MODE_GREEDY) {
        u64 best = 0ull;
        for (uint32_t r = 0; r < world; ++r) best = max(best, rr[r * stride]);
        token = key_index(best);
        top_hi = (uint32_t)(best >> 32);
        q = 1.0f;
        if (dist)
            for (uint32_t l = tid; l < len; l += THREADS) dist[c0 + l] = v0 + c0 + l == token ? 1.0f : 0.0f;
    } else if (mode == MODE_TEMP) {
        u64 best = 0ull;
        uint32_t winner = 0u, zmax_key = 0u;
        for (uint32_t r = 0; r < world; ++r) {
            const u64 key = rr[r * stride];
            if (key > best) {
                best = key;
                winner = r;
            }
            zmax_key = max(zmax_key, ordered_key(lo_f32(rr[r * stride + 1u])));
        }
        const float zmax = key_value(zmax_key);
        float sum = 0.0f;  // in rank order
        for (uint32_t r = 0; r < world; ++r) {
            const u64 w = rr[r * stride + 1u];
            const float sr = hi_f32(w);
            if (sr != 0.0f) sum = __fadd_rn(sum, __fmul_rn(sr, expf(__fsub_rn(lo_f32(w), zmax))));
        }
        const float zt = __uint_as_float((uint32_t)rr[winner * stride + 2u]);
        token = key_index(best);
        top_hi = zmax_key;
        q = __fdiv_rn(soft_term(zt, zmax), sum);
        if (dist)
            for (uint32_t l = tid; l < len; l += THREADS)
                dist[c0 + l] = __fdiv_rn(soft_term(z_of(row, c0 + l, rec.t), zmax), sum);
    } else {
        // The global top keff of the union of the ranks' top keff: rank r's keys at rr + r stride.
        const uint32_t keff = min(rec.k, cap);
        auto at = [&](uint32_t j) { return rr[(size_t)(j / keff) * stride + j % keff]; };
        const uint32_t n = world * keff;
        const u64 thr = block_kth_key(at, n, keff, sel);
        if (tid == 0) cnt_s = 0u;
        __syncthreads();
        for (uint32_t j = tid; j < n; j += THREADS) {
            const u64 key = at(j);
            if (key != 0ull && key >= thr) cand[atomicAdd(&cnt_s, 1u)] = key;
        }
        __syncthreads();
        // Into key order (descending), so that the sum of the kept terms has one order.
        if (tid < keff) {
            const u64 mine = cand[tid];
            uint32_t rank = 0u;
            for (uint32_t j = 0; j < keff; ++j) rank += cand[j] > mine;
            sorted[rank] = mine;
        }
        __syncthreads();
        const bool kept = tid < keff;
        const u64 key = kept ? sorted[tid] : 0ull;
        const float z0 = key_value((uint32_t)(sorted[0] >> 32));
        const float z = kept ? key_value((uint32_t)(key >> 32)) : -INFINITY;
        const float ex = kept ? soft_term(z, z0) : 0.0f;
        const float sum = block_sum(ex, red_f);
        const float qt = __fdiv_rn(ex, sum);
        const uint32_t gi = key_index(key);
        u64 skey = 0ull;
        if (kept) skey = pack_key(__fadd_rn(z, keyed_gumbel(rec.seed, rec.pos, draft_index, STREAM_DRAFT, gi)), gi);
        const u64 best = block_max_u64(skey, red_u);
        if (kept && skey == best) q_s = qt;
        __syncthreads();
        token = key_index(best);
        top_hi = (uint32_t)(sorted[0] >> 32);
        q = q_s;
        if (dist) {
            for (uint32_t l = tid; l < len; l += THREADS) dist[c0 + l] = 0.0f;
            __syncthreads();
            if (kept && gi >= v0 + c0 && gi - v0 - c0 < len) dist[gi - v0] = qt;
        }
    }
    if (c == 0u && tid == 0) {
        if (flag_byte < 4u) {
            const uint32_t bad = nonfinite_code(top_hi);
            if (bad) flags[(size_t)e * 4u + flag_byte] = (uint8_t)bad;
        }
        entries[(size_t)e * ENTRY_WORDS + 2u] = token;
        uint32_t* d = drafts + (size_t)e * kmax;
        float* p = probs + (size_t)e * kmax;
        d[draft_index] = token;
        p[draft_index] = q;
        if (publish) publish_row(d, p, host_drafts + (size_t)e * kmax, host_probs + (size_t)e * kmax, draft_index, token, q);
    }
}
