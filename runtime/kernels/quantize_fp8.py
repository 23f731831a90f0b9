"""Per-row FP8 E4M3 quantisation: ``scale[r] = absmax(x[r]) / 448`` (1 for an all-zero row),
``q[r] = saturate(x[r] / scale[r])``, round to nearest even. Makes the weights ``gemv_fp8w`` reads.

CUDA source: ptx/quantize_fp8.cu. One block per row.
"""

from __future__ import annotations

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16, quantize_rows_fp8
from ..kernel import PTR, U32, declare
from ..launch import launch

BLOCK = 256


@declare(
    "quantize_fp8",
    "quantize_fp8",
    [("x", PTR), ("q", PTR), ("scale", PTR), ("n", U32), ("k", U32)],
    writes=("q", "scale"),
)
def QUANTIZE_FP8(mem, x, q, scale, n, k):  # noqa: N802 - the declaration is the constant
    if n == 0:
        return
    qv, sv = quantize_rows_fp8(mem.read(x, BF16, (n, k)))
    if k:
        mem.write(q, qv)
    mem.write(scale, sv)


def quantize_fp8(
    gpu: GpuBackend,
    x: DevicePtr,
    q: DevicePtr,
    scale: DevicePtr,
    n: int,
    k: int,
    stream: int | None = None,
) -> None:
    if n < 1:
        raise ValueError(f"quantize_fp8: n={n} rows")
    launch(gpu, gpu.kernel(*QUANTIZE_FP8.key), n, BLOCK, x, q, scale, n, k, stream=stream)
