// Counter-based random numbers for sampling: Philox4x32-10 keyed by the request's seed, counted by
// (index, draft index, position, stream). The host twin and the exact contract are in
// model/kernels/keyed_rng.py; both are pinned to the published known-answer vectors.
#pragma once
#include <stdint.h>

struct philox_out {
    uint32_t w[4];
};

__device__ __forceinline__ philox_out philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                   uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    philox_out o;
    o.w[0] = c0;
    o.w[1] = c1;
    o.w[2] = c2;
    o.w[3] = c3;
    return o;
}

// ((word0 >> 9) + 0.5) * 2^-23: strictly inside (0, 1), exact in f32 (24 significant bits).
__device__ __forceinline__ float keyed_uniform(uint64_t seed, uint32_t position, uint32_t draft_index,
                                               uint32_t stream, uint32_t index) {
    const philox_out o =
        philox4x32_10(index, draft_index, position, stream, (uint32_t)seed, (uint32_t)(seed >> 32));
    return ((float)(o.w[0] >> 9) + 0.5f) * 1.1920928955078125e-7f;
}

// -log(-log(u)) with the accurate logf (not __logf): the host twin's f32 log differs by an ulp at most.
__device__ __forceinline__ float keyed_gumbel(uint64_t seed, uint32_t position, uint32_t draft_index,
                                              uint32_t stream, uint32_t index) {
    return -logf(-logf(keyed_uniform(seed, position, draft_index, stream, index)));
}
