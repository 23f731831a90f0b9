// dst[i] = src[i] for n 32-bit words, by one warp (runtime/kernels/copy_words.py). It brings a
// graph step's scalars in from mapped pinned host memory (GpuBackend.alloc_mapped) as the graph's
// first kernel, in place of a host-to-device copy node, which costs device time at every replay
// (see BENCHMARKS.md, "MTP drafter: propose", the step's scalars through mapped memory); this
// kernel releases its dependents at its start, so a Pdl.BESIDE successor works through the PCIe
// read.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(32) copy_words(const uint32_t* src, uint32_t* __restrict__ dst,
                                                           uint32_t n) {
    release_dependents();  // launched plainly: everything before it has completed
    // Volatile loads (ld.global.cv): the host rewrites src between launches, and no cached copy of
    // an earlier launch's words may be served.
    for (uint32_t i = threadIdx.x; i < n; i += 32u) dst[i] = __ldcv(src + i);
}
