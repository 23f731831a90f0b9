"""Elementwise ``out = a + b`` over BF16 (f32 add, BF16 store). Any n, any alignment.

CUDA source: ptx/add_bf16.cu. Grid-stride; the grid is capped so huge n does not launch millions
of blocks.

Only tests and bench/bench_runtime.py launch it; it ships as the smallest complete kernel, which the
backends' contract checks (graph capture, mapped buffers, JIT errors, launch host cost) launch.
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16
from ..kernel import PTR, U32, declare
from ..launch import launch

BLOCK = 256
_PER_BLOCK = BLOCK * 8
MAX_GRID = 4096


def add_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (np.asarray(a, np.float32) + np.asarray(b, np.float32)).astype(BF16)


@declare("add_bf16", "add_bf16", [("a", PTR), ("b", PTR), ("out", PTR), ("n", U32)], writes=("out",))
def ADD_BF16(mem, a, b, out, n):  # noqa: N802 - the declaration is the constant
    if n == 0:
        return
    mem.write(out, add_ref(mem.read(a, BF16, n), mem.read(b, BF16, n)))


def add_bf16(
    gpu: GpuBackend,
    a: DevicePtr,
    b: DevicePtr,
    out: DevicePtr,
    n: int,
    stream: int | None = None,
) -> None:
    if n < 1:
        raise ValueError(f"add_bf16: n={n}")
    grid = min(MAX_GRID, (n + _PER_BLOCK - 1) // _PER_BLOCK)
    launch(gpu, gpu.kernel(*ADD_BF16.key), grid, BLOCK, a, b, out, n, stream=stream)
