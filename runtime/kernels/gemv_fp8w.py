"""FP8-weight GEMV: ``y[m, n] = scale[n] * (x[m, k] @ Wq[n, k]^T)``, Wq FP8 E4M3 with one f32 scale
per row (as ``quantize_fp8`` makes them), x and y BF16, f32 accumulation.

CUDA source: ptx/gemv_fp8w.cu, two kernels of one body: ``gemv_fp8w`` (m in 1..MAX_M) and
``gemv_fp8w_m2`` (m in 1..2, fewer registers, more warps per SM); the launch helper picks. Same
geometry as gemv_bf16. Any k (k % 16 != 0 or unaligned pointers take the element-wise path).
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16, F32, FP8
from ..host_math import dot_rows
from ..kernel import PTR, U32, declare
from ..launch import launch
from .gemv_bf16 import MAX_M, check_shape

WARPS = 8  # must match GEMV_WARPS in ptx/gemv_fp8w.cu
ROWS = 2  # must match GEMV_ROWS
BLOCK = WARPS * 32
# The kernel stages x in shared memory as f32 for m <= 2 when the launch gives it m * k * 4 bytes;
# kept under the 48 KB that needs no opt-in so it never costs occupancy beyond 4 blocks per SM.
X_SMEM_MAX = 48 * 1024
SMALL_M = 2  # gemv_fp8w_m2 handles m <= SMALL_M


def x_smem_bytes(m: int, k: int) -> int:
    nbytes = m * k * 4
    return nbytes if m <= 2 and nbytes <= X_SMEM_MAX else 0


def gemv_fp8w_ref(wq: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """f32 math: the exact f32 value of each FP8 weight, dot with x in f32, times the row scale."""
    acc = dot_rows(x, np.asarray(wq, np.float32))  # a vocabulary shard's rows as the whole head's
    return (acc * np.asarray(scale, np.float32)[None, :]).astype(BF16)


def grid_for(n: int) -> int:
    return (n + WARPS * ROWS - 1) // (WARPS * ROWS)


_ARGS = [("Wq", PTR), ("scale", PTR), ("x", PTR), ("y", PTR), ("m", U32), ("n", U32), ("k", U32)]


def _twin(mem, Wq, scale, x, y, m, n, k, max_m):
    if not 1 <= m <= max_m or n == 0:
        return  # the kernel writes nothing either
    wv = mem.view(Wq, FP8, (n, k))
    sv = mem.read(scale, F32, n)
    xv = mem.read(x, BF16, (m, k))
    mem.write(y, gemv_fp8w_ref(wv, sv, xv))


@declare("gemv_fp8w", "gemv_fp8w", list(_ARGS), writes=("y",))
def GEMV_FP8W(mem, Wq, scale, x, y, m, n, k):  # noqa: N802 - the declaration is the constant
    _twin(mem, Wq, scale, x, y, m, n, k, MAX_M)


# The same kernel compiled for m <= 2 only: 64 registers instead of 96, twice the warps per SM,
# which is what the m = 1 draft head needs (see ptx/gemv_fp8w.cu). m > 2 writes nothing.
@declare("gemv_fp8w", "gemv_fp8w_m2", list(_ARGS), writes=("y",))
def GEMV_FP8W_M2(mem, Wq, scale, x, y, m, n, k):  # noqa: N802 - the declaration is the constant
    _twin(mem, Wq, scale, x, y, m, n, k, SMALL_M)


def gemv_fp8w(
    gpu: GpuBackend,
    Wq: DevicePtr,
    scale: DevicePtr,
    x: DevicePtr,
    y: DevicePtr,
    m: int,
    n: int,
    k: int,
    stream: int | None = None,
) -> None:
    check_shape(m, n, k)
    decl = GEMV_FP8W_M2 if m <= SMALL_M else GEMV_FP8W
    launch(
        gpu,
        gpu.kernel(*decl.key),
        grid_for(n),
        BLOCK,
        Wq,
        scale,
        x,
        y,
        m,
        n,
        k,
        smem=x_smem_bytes(m, k),
        stream=stream,
    )
