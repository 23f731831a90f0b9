"""Argmax over a BF16 vector: the lowest index holding the largest value, and that value as f32.
NaN never wins (it compares below every number, -inf included). If every element is NaN the index
is 0, the lowest, so it is always a valid index, and the value NaN, which flags it; only an empty
vector gives ``NONE`` (0xFFFFFFFF).

CUDA source: ptx/argmax_bf16.cu. One cluster of ``BLOCKS`` blocks of 1024 threads (the cluster shape
is compiled into the kernel), no workspace, no host sync: capturable and safe on concurrent streams.
``argmax_bf16_batch`` runs the same cluster once per row of an [m][n] matrix (grid (BLOCKS, m)).
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16, F32
from ..dtypes import U32 as U32_DT
from ..kernel import PTR, U32, declare
from ..launch import launch

BLOCK = 1024
BLOCKS = 8  # must match ARGMAX_BLOCKS in ptx/argmax_bf16.cu (the grid is exactly one cluster)
NONE = 0xFFFFFFFF


def argmax_ref(x: np.ndarray) -> tuple[int, float]:
    v = np.asarray(x, np.float32).reshape(-1)
    valid = ~np.isnan(v)
    if not valid.any():
        return (0 if v.size else NONE), float("nan")
    best = v[valid].max()
    return int(np.flatnonzero(v == best)[0]), float(best)


@declare(
    "argmax_bf16",
    "argmax_bf16",
    [("x", PTR), ("out_idx", PTR), ("out_val", PTR), ("n", U32)],
    writes=("out_idx", "out_val"),
)
def ARGMAX_BF16(mem, x, out_idx, out_val, n):  # noqa: N802 - the declaration is the constant
    idx, val = argmax_ref(mem.read(x, BF16, n) if n else np.zeros(0, BF16))
    mem.write(out_idx, np.array([idx], U32_DT))
    mem.write(out_val, np.array([val], F32))


def argmax_bf16(
    gpu: GpuBackend,
    x: DevicePtr,
    out_idx: DevicePtr,
    out_val: DevicePtr,
    n: int,
    stream: int | None = None,
) -> None:
    launch(gpu, gpu.kernel(*ARGMAX_BF16.key), BLOCKS, BLOCK, x, out_idx, out_val, n, stream=stream)


BATCH_MAX_M = 256  # rows of one argmax_bf16_batch launch (a batched propose's entries)


@declare(
    "argmax_bf16",
    "argmax_bf16_batch",
    [("x", PTR), ("out_idx", PTR), ("out_val", PTR), ("m", U32), ("n", U32)],
    writes=("out_idx", "out_val"),
)
def ARGMAX_BF16_BATCH(mem, x, out_idx, out_val, m, n):  # noqa: N802 - the declaration is the constant
    """argmax_bf16 of each row of x [m][n]: out_idx[e], out_val[e]."""
    if m == 0:
        return
    rows = mem.read(x, BF16, (m, n)) if n else np.zeros((m, 0), BF16)
    res = [argmax_ref(rows[e]) for e in range(m)]
    mem.write(out_idx, np.array([i for i, _ in res], U32_DT))
    mem.write(out_val, np.array([v for _, v in res], F32))


def argmax_bf16_batch(
    gpu: GpuBackend,
    x: DevicePtr,
    out_idx: DevicePtr,
    out_val: DevicePtr,
    m: int,
    n: int,
    stream: int | None = None,
) -> None:
    """The argmax of each of the m rows of x [m][n] (rows n elements apart) into out_idx [m] (u32)
    and out_val [m] (f32), each as argmax_bf16 gives it for that row alone: one cluster per row."""
    if not 1 <= m <= BATCH_MAX_M:
        raise ValueError(f"argmax_bf16_batch: m={m} rows; the kernel handles 1..{BATCH_MAX_M}")
    launch(
        gpu,
        gpu.kernel(*ARGMAX_BF16_BATCH.key),
        (BLOCKS, m),
        BLOCK,
        x,
        out_idx,
        out_val,
        m,
        n,
        stream=stream,
    )
