"""BF16 GEMV for small m: ``y[m, n] = x[m, k] @ W[n, k]^T``, f32 accumulation, BF16 store.

CUDA source: ptx/gemv_bf16.cu. A warp owns ``ROWS`` rows of W and reads each once for all m rows of
x; 8 warps per block. ``1 <= m <= MAX_M``. Any k (k % 8 != 0 or unaligned pointers take the
kernel's slower element-wise path).
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16
from ..host_math import dot_rows
from ..kernel import PTR, U32, declare
from ..launch import launch

WARPS = 8  # must match GEMV_WARPS in ptx/gemv_bf16.cu
ROWS = 2  # must match GEMV_ROWS
BLOCK = WARPS * 32
MAX_M = 8


def gemv_bf16_ref(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """f32 math on BF16 inputs: ``x [m, k] @ w [n, k]^T`` -> BF16 ``[m, n]``; a row's value does
    not depend on how many rows of ``w`` the call covers (a rank's share of them, runtime.host_math)."""
    return dot_rows(x, w).astype(BF16)


def grid_for(n: int) -> int:
    return (n + WARPS * ROWS - 1) // (WARPS * ROWS)


@declare(
    "gemv_bf16",
    "gemv_bf16",
    [("W", PTR), ("x", PTR), ("y", PTR), ("m", U32), ("n", U32), ("k", U32)],
    writes=("y",),
)
def GEMV_BF16(mem, W, x, y, m, n, k):  # noqa: N802 - the declaration is the constant
    if not 1 <= m <= MAX_M or n == 0:
        return  # the kernel writes nothing either
    wv = mem.view(W, BF16, (n, k))
    xv = mem.read(x, BF16, (m, k))
    mem.write(y, gemv_bf16_ref(wv, xv))


def check_shape(m: int, n: int, k: int) -> None:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv: m={m} rows of x; the kernel handles 1..{MAX_M}")
    if n < 1 or k < 0:
        raise ValueError(f"gemv: bad shape n={n}, k={k}")


def gemv_bf16(
    gpu: GpuBackend,
    W: DevicePtr,
    x: DevicePtr,
    y: DevicePtr,
    m: int,
    n: int,
    k: int,
    stream: int | None = None,
) -> None:
    check_shape(m, n, k)
    launch(gpu, gpu.kernel(*GEMV_BF16.key), grid_for(n), BLOCK, W, x, y, m, n, k, stream=stream)
