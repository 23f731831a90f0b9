"""Finiteness of a BF16 matrix ``x [rows, h]``: ``out`` (u32) = the lowest row holding a NaN or an
Inf, or ``NONE`` (0xFFFFFFFF) when every element is finite. For checking rows a caller hands in
before anything is computed from them (the drafter's context rows).

CUDA source: ptx/all_finite_bf16.cu. The kernel lowers ``out`` with atomicMin, so the launch helper
first sets it to ``NONE`` (a memset in stream order); grid-stride, the grid capped.
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16
from ..dtypes import U32 as U32_DT
from ..kernel import PTR, U32, declare
from ..launch import launch

BLOCK = 256
_PER_BLOCK = BLOCK * 8
MAX_GRID = 4096
NONE = 0xFFFFFFFF


def first_nonfinite_row_ref(x: np.ndarray) -> int:
    """The lowest row of ``x`` (rows along the first axis) holding a NaN or an Inf, else NONE."""
    bad = ~np.isfinite(np.asarray(x, np.float32).reshape(len(x), -1)).all(axis=1)
    hit = np.flatnonzero(bad)
    return int(hit[0]) if hit.size else NONE


@declare(
    "all_finite_bf16",
    "all_finite_bf16",
    [("x", PTR), ("rows", U32), ("h", U32), ("out", PTR)],
    writes=("out",),
)
def ALL_FINITE_BF16(mem, x, rows, h, out):  # noqa: N802 - the declaration is the constant
    # min with what ``out`` held, as the kernel's atomicMin does (the helper sets it to NONE).
    found = first_nonfinite_row_ref(mem.read(x, BF16, (rows, h))) if rows and h else NONE
    mem.write(out, np.array([min(found, int(mem.scalar(out, np.uint32)))], U32_DT))


def all_finite_bf16(
    gpu: GpuBackend, x: DevicePtr, rows: int, h: int, out: DevicePtr, stream: int | None = None
) -> None:
    """Enqueue the check: ``out`` = the lowest non-finite row of ``x [rows, h]``, or NONE."""
    if rows < 1 or h < 1:
        raise ValueError(f"all_finite_bf16: rows={rows}, h={h} (both must be positive)")
    if gpu.bytes_from(x) < rows * h * 2:
        raise ValueError(
            f"all_finite_bf16: x holds {gpu.bytes_from(x)} bytes, [{rows}, {h}] BF16 needs {rows * h * 2}"
        )
    grid = max(1, min(MAX_GRID, -(-rows * h // _PER_BLOCK)))
    gpu.memset(out, 0xFF, 4, stream)
    launch(gpu, gpu.kernel(*ALL_FINITE_BF16.key), grid, BLOCK, x, rows, h, out, stream=stream)
