"""RMSNorm over rows of BF16: ``out = x / sqrt(mean(x^2) + eps) * w`` in f32, stored BF16.

CUDA source: ptx/rmsnorm.cu. One block per row.
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16
from ..kernel import F32, PTR, U32, declare
from ..launch import launch

BLOCK = 256


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """f32 math on BF16 inputs, the BF16 result. Rows along the last axis."""
    xf = np.asarray(x, np.float32)
    ms = np.mean(xf * xf, axis=-1, keepdims=True, dtype=np.float32)
    y = xf / np.sqrt(ms + np.float32(eps)) * np.asarray(w, np.float32)
    return y.astype(BF16)


@declare(
    "rmsnorm",
    "rmsnorm_bf16",
    [("x", PTR), ("w", PTR), ("out", PTR), ("rows", U32), ("n", U32), ("eps", F32)],
    writes=("out",),
)
def RMSNORM(mem, x, w, out, rows, n, eps):  # noqa: N802 - the declaration is the constant
    xv = mem.read(x, BF16, (rows, n))
    wv = mem.read(w, BF16, n)
    mem.write(out, rmsnorm_ref(xv, wv, eps))


def rmsnorm(
    gpu: GpuBackend,
    x: DevicePtr,
    w: DevicePtr,
    out: DevicePtr,
    rows: int,
    n: int,
    eps: float,
    stream: int | None = None,
) -> None:
    launch(gpu, gpu.kernel(*RMSNORM.key), rows, BLOCK, x, w, out, rows, n, eps, stream=stream)
