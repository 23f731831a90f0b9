// y[m, n] = x[m, k] @ W[n, k]^T with W row-major BF16, x BF16, y BF16, f32 accumulation.
//
// Batch-1 decode GEMV is pure weight streaming (the draft head is 154880 x 4096 = 1.27 GB per
// draft), so the design goal is bytes in flight, not arithmetic:
//   - one warp owns ROWS consecutive rows of W and reads each exactly once for all m rows of x;
//   - each lane issues ROWS * UNROLL independent 16-byte loads before the first FMA;
//   - W bypasses L1 (ld.global.nc.L1::no_allocate), x (<= 8 rows) stays in L1 and is re-read
//     from there for every row pair.
// Block = 256 threads (8 warps); grid = ceil(n / (8 * ROWS)) (runtime/kernels/gemv_bf16.py).
// k % 8 != 0 or a pointer that is not 16-byte aligned takes the element-wise path: correct, slower.
// gemv_bf16_batch (the end of this file) is the same product for up to 256 rows of x.
#include "common.cuh"

// The geometry is fixed by the committed PTX; bench/sweep_gemv.py recompiles with -D overrides to
// measure alternatives (the launch helper's WARPS/ROWS must match the PTX it launches).
#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
#ifndef GEMV_ROWS
#define GEMV_ROWS 2
#endif
#ifndef GEMV_UNROLL1
#define GEMV_UNROLL1 4
#endif

namespace {
constexpr int WARPS = GEMV_WARPS;
constexpr int ROWS = GEMV_ROWS;
// Chunks per lane per row in flight. The kernel's register count is the maximum over its eight m
// paths and it sets the occupancy of the m = 1 path that matters, so larger m unrolls less: this
// schedule fits 4 blocks of 256 per SM where UNROLL 4 at every m fitted 2 (register counts in
// BENCHMARKS.md, "Runtime kernels: notes behind the numbers", BF16 GEMV geometry).
template <int M>
__host__ __device__ constexpr int unroll_for() { return M == 1 ? GEMV_UNROLL1 : (M <= 4 ? 2 : 1); }

__device__ __forceinline__ float dot8(uint4 w, const float (&xf)[8], float acc) {
    acc = fmaf(bf16_lo(w.x), xf[0], acc);
    acc = fmaf(bf16_hi(w.x), xf[1], acc);
    acc = fmaf(bf16_lo(w.y), xf[2], acc);
    acc = fmaf(bf16_hi(w.y), xf[3], acc);
    acc = fmaf(bf16_lo(w.z), xf[4], acc);
    acc = fmaf(bf16_hi(w.z), xf[5], acc);
    acc = fmaf(bf16_lo(w.w), xf[6], acc);
    acc = fmaf(bf16_hi(w.w), xf[7], acc);
    return acc;
}

__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
    f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z);
    f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

template <int M>
__device__ __forceinline__ void store_rows(float (&acc)[M][ROWS], uint16_t* y, uint32_t row0, uint32_t n) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[mi][r]);
            if (lane == (uint32_t)(mi * ROWS + r) % 32u && row0 + r < n)
                y[(size_t)mi * n + row0 + r] = f32_to_bf16_bits(v);
        }
}

template <int M>
__device__ __forceinline__ void gemv_vec(const uint16_t* __restrict__ W, const uint16_t* __restrict__ x,
                                         uint16_t* __restrict__ y, uint32_t n, uint32_t k, uint32_t tile) {
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (tile * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (row0 >= n) return;
    const uint32_t kc = k / 8u;  // 16-byte chunks per row
    const uint4* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        wr[r] = reinterpret_cast<const uint4*>(W + (size_t)min(row0 + r, n - 1) * k);
    const uint4* xv = reinterpret_cast<const uint4*>(x);

    float acc[M][ROWS];
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[mi][r] = 0.0f;

    constexpr int UNROLL = unroll_for<M>();
    uint32_t c = lane;
    for (; c + 32u * (UNROLL - 1) < kc; c += 32u * UNROLL) {
        uint4 w[ROWS][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) w[r][u] = ld_stream16(wr[r] + c + 32u * u);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int mi = 0; mi < M; ++mi) {
                float xf[8];
                unpack8(__ldg(xv + (size_t)mi * kc + c + 32u * u), xf);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[mi][r] = dot8(w[r][u], xf, acc[mi][r]);
            }
    }
    for (; c < kc; c += 32u) {
        uint4 w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) w[r] = ld_stream16(wr[r] + c);
#pragma unroll
        for (int mi = 0; mi < M; ++mi) {
            float xf[8];
            unpack8(__ldg(xv + (size_t)mi * kc + c), xf);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[mi][r] = dot8(w[r], xf, acc[mi][r]);
        }
    }
    store_rows<M>(acc, y, row0, n);
}

template <int M>
__device__ __forceinline__ void gemv_scalar(const uint16_t* __restrict__ W, const uint16_t* __restrict__ x,
                                            uint16_t* __restrict__ y, uint32_t n, uint32_t k, uint32_t tile) {
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row0 = (tile * WARPS + (threadIdx.x >> 5)) * ROWS;
    if (row0 >= n) return;
    const uint16_t* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = W + (size_t)min(row0 + r, n - 1) * k;
    float acc[M][ROWS];
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[mi][r] = 0.0f;
#pragma unroll 4
    for (uint32_t i = lane; i < k; i += 32u) {
        float w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) w[r] = bf16_bits_to_f32(wr[r][i]);
#pragma unroll
        for (int mi = 0; mi < M; ++mi) {
            const float xi = bf16_bits_to_f32(x[(size_t)mi * k + i]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[mi][r] = fmaf(w[r], xi, acc[mi][r]);
        }
    }
    store_rows<M>(acc, y, row0, n);
}

// `tile`: which WARPS * ROWS rows of W this block owns.
template <int M>
__device__ __forceinline__ void gemv_dispatch(const uint16_t* W, const uint16_t* x, uint16_t* y, uint32_t n,
                                              uint32_t k, bool vec, uint32_t tile) {
    if (vec) gemv_vec<M>(W, x, y, n, k, tile);
    else gemv_scalar<M>(W, x, y, n, k, tile);
}

// Rows 1..8 of x against this block's tile of W (the m paths of gemv_bf16, shared by the batch).
__device__ __forceinline__ void gemv_rows(const uint16_t* W, const uint16_t* x, uint16_t* y, uint32_t rows,
                                          uint32_t n, uint32_t k, bool vec, uint32_t tile) {
    switch (rows) {
        case 1: gemv_dispatch<1>(W, x, y, n, k, vec, tile); break;
        case 2: gemv_dispatch<2>(W, x, y, n, k, vec, tile); break;
        case 3: gemv_dispatch<3>(W, x, y, n, k, vec, tile); break;
        case 4: gemv_dispatch<4>(W, x, y, n, k, vec, tile); break;
        case 5: gemv_dispatch<5>(W, x, y, n, k, vec, tile); break;
        case 6: gemv_dispatch<6>(W, x, y, n, k, vec, tile); break;
        case 7: gemv_dispatch<7>(W, x, y, n, k, vec, tile); break;
        case 8: gemv_dispatch<8>(W, x, y, n, k, vec, tile); break;
        default: break;
    }
}
}  // namespace

// m outside 1..8 writes nothing; the launch helper refuses it before it gets here.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_bf16(const uint16_t* __restrict__ W,
                                                            const uint16_t* __restrict__ x,
                                                            uint16_t* __restrict__ y,
                                                            uint32_t m, uint32_t n, uint32_t k) {
    const bool vec = (k % 8u == 0) && aligned16(W) && aligned16(x);
    gemv_rows(W, x, y, m, n, k, vec, blockIdx.x);
}

// The batch: y[m, n] for 1 <= m <= 256, rows of x in chunks of 8. Grid (ceil(m / 8), ceil(n / 16)):
// blockIdx.x is the chunk, so the blocks that read one tile of W are consecutive in launch order and
// all but the first find it in L2 (W comes from HBM once per launch); each computes its chunk with
// gemv_bf16's own m paths. A row's value is the same in every one of them: lane l sums the 16-byte
// chunks l, l + 32, l + 64, ... of the (x row, W row) pair in that order, eight fmaf each in element
// order, and warp_sum adds the lanes in one fixed butterfly; m only sets how many x rows share a
// weight load and how many loads are in flight (unroll_for), never that order. So row e of any
// batch is bit-identical to gemv_bf16 (m = 1) of that row alone, and m = 1 is gemv_bf16 itself.
// The vector path needs k % 8 == 0 and W, x 16-byte aligned (then every row of x is), as gemv_bf16.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_bf16_batch(const uint16_t* __restrict__ W,
                                                                  const uint16_t* __restrict__ x,
                                                                  uint16_t* __restrict__ y,
                                                                  uint32_t m, uint32_t n, uint32_t k) {
    const uint32_t e0 = blockIdx.x * 8u;
    if (e0 >= m) return;
    const bool vec = (k % 8u == 0) && aligned16(W) && aligned16(x);
    gemv_rows(W, x + (size_t)e0 * k, y + (size_t)e0 * n, min(m - e0, 8u), n, k, vec, blockIdx.y);
}
