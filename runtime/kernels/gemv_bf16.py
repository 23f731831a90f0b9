"""BF16 GEMV for small m: ``y[m, n] = x[m, k] @ W[n, k]^T``, f32 accumulation, BF16 store.

CUDA source: ptx/gemv_bf16.cu. A warp owns ``ROWS`` rows of W and reads each once for all m rows of
x; 8 warps per block. ``1 <= m <= MAX_M``. Any k (k % 8 != 0 or unaligned pointers take the
kernel's slower element-wise path).

``gemv_bf16_batch`` is the same product for ``1 <= m <= MAX_BATCH`` rows: chunks of ``MAX_M`` rows
of x in consecutive blocks that share each tile of W (so W comes from HBM once), each chunk computed
by gemv_bf16's own m paths, whose per-row arithmetic does not depend on m. Row e of any batch is
bit-identical to gemv_bf16 (m = 1) of that row alone.
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
MAX_BATCH = 256  # rows of a batched launch (model/kernels/batch.py: 1 <= m <= 256)


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


@declare(
    "gemv_bf16",
    "gemv_bf16_batch",
    [("W", PTR), ("x", PTR), ("y", PTR), ("m", U32), ("n", U32), ("k", U32)],
    writes=("y",),
)
def GEMV_BF16_BATCH(mem, W, x, y, m, n, k):  # noqa: N802 - the declaration is the constant
    """``y[m, n] = x[m, k] @ W[n, k]^T``, BF16; element (e, j) depends on x[e] and W[j] alone
    (runtime.host_math.dot_rows), so a row's bits do not depend on m or on the other rows."""
    if not 1 <= m <= MAX_BATCH or n == 0:
        return  # the kernel writes nothing either
    mem.write(y, gemv_bf16_ref(mem.view(W, BF16, (n, k)), mem.read(x, BF16, (m, k))))


def batch_grid(m: int, n: int) -> tuple[int, int]:
    """ptx/gemv_bf16.cu gemv_bf16_batch: (row chunks of MAX_M, tiles of WARPS * ROWS rows of W);
    the chunks are blockIdx.x, so the blocks that read one tile of W launch one after another."""
    return (-(-m // MAX_M), grid_for(n))


def gemv_bf16_batch(
    gpu: GpuBackend,
    W: DevicePtr,
    x: DevicePtr,
    y: DevicePtr,
    m: int,
    n: int,
    k: int,
    stream: int | None = None,
) -> None:
    """y [m, n] BF16 = x [m, k] @ W [n, k]^T for 1 <= m <= MAX_BATCH (x, y dense rows)."""
    if not 1 <= m <= MAX_BATCH:
        raise ValueError(f"gemv_bf16_batch: m={m} rows of x; the kernel handles 1..{MAX_BATCH}")
    if n < 1 or k < 0 or grid_for(n) > 65535:
        raise ValueError(f"gemv_bf16_batch: bad shape n={n}, k={k} (n <= {65535 * WARPS * ROWS})")
    kernel = gpu.kernel(*GEMV_BF16_BATCH.key)
    launch(gpu, kernel, batch_grid(m, n), BLOCK, W, x, y, m, n, k, stream=stream)
