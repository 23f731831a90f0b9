// out[0:k] = table[token, 0:k] with the token READ FROM DEVICE MEMORY (*token_ptr), so the gather
// can sit inside a captured graph and follow a token that an earlier kernel wrote. A token outside
// the vocabulary writes NaN (0xFFFF) everywhere instead of reading out of bounds: the bug shows.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) embed_gather_bf16(const uint16_t* __restrict__ table,
                                                                    const uint32_t* __restrict__ token_ptr,
                                                                    uint16_t* __restrict__ out,
                                                                    uint32_t vocab, uint32_t k) {
    const uint32_t token = *token_ptr;
    const bool bad = token >= vocab;
    const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t stride = gridDim.x * blockDim.x;
    const uint16_t* row = table + (size_t)(bad ? 0u : token) * k;
    uint32_t done = 0;
    if ((k % 8u == 0) && aligned16(table) && aligned16(out)) {
        const uint4* src = reinterpret_cast<const uint4*>(row);
        uint4* dst = reinterpret_cast<uint4*>(out);
        const uint4 nan4 = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu);
        for (uint32_t c = tid; c < k / 8u; c += stride) dst[c] = bad ? nan4 : src[c];
        done = k;
    }
    for (uint32_t i = done + tid; i < k; i += stride) out[i] = bad ? (uint16_t)BF16_NAN_BITS : row[i];
}
