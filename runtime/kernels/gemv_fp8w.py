"""FP8-weight GEMV: ``y[m, n] = scale[n] * (x[m, k] @ Wq[n, k]^T)``, Wq FP8 E4M3 with one f32 scale
per row (as ``quantize_fp8`` makes them), x and y BF16, f32 accumulation.

CUDA source: ptx/gemv_fp8w.cu, two kernels of one body: ``gemv_fp8w`` (m in 1..MAX_M) and
``gemv_fp8w_m2`` (m in 1..2, fewer registers, more warps per SM); the launch helper picks. Same
geometry as gemv_bf16. Any k (k % 16 != 0 or unaligned pointers take the element-wise path).
``gemv_fp8w_batch`` (m in 1..256, the sharded head of a batched propose) is a third kernel with the
same arithmetic per row; see its section below.
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16, F32, FP8
from ..host_math import dot_rows
from ..kernel import PTR, U32, declare
from ..launch import grid_stride_blocks, launch
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


# ---- m in 1..256: gemv_fp8w_batch ----------------------------------------------------------------
#
# ptx/gemv_fp8w.cu (gemv_fp8w_batch) and ptx/fp8_batch.cuh: the rows of x are split into balanced
# tiles of at most BATCH_TILE_ROWS rows; block b works on tile b % tiles, stages its rows of x in
# shared memory as f32 and grid-strides over the weight groups of BATCH_GROUP_ROWS rows with the
# other blocks of its tile, so the blocks of one group run at about the same time and the weights
# come from HBM about once (the other tiles' reads hit L2). Each (weight row, x row) has its own
# accumulator in gemv_fp8w's order: a row's outputs do not depend on m, the tile or its place.

BATCH_MAX_M = 256  # model/kernels/batch.py: a batched launch covers 1..256 entries
BATCH_TILE_ROWS = 4  # BATCH_TILE_ROWS in ptx/fp8_batch.cuh
BATCH_GROUP_ROWS = 16  # 8 warps x 2 weight rows
BATCH_BLOCK = 256
# The staged tile's budget: four rows of 4096 as f32, three blocks per SM. A k too large for one row
# reads x from global memory (the same bits).
BATCH_X_SMEM_MAX = 64 * 1024


def batch_tiling(m: int, k: int, chunk: int = 16) -> tuple[int, int]:
    """(tiles, dynamic shared bytes) of a batched launch over m rows of x of k columns: the fewest
    balanced tiles of at most BATCH_TILE_ROWS rows whose largest tile fits BATCH_X_SMEM_MAX as f32,
    and the bytes that tile needs (0 where the kernel cannot stage: k % chunk != 0, or one row is
    too large). The tiling only decides which block computes a row, never how."""
    per_row = 4 * k
    fit = BATCH_X_SMEM_MAX // per_row if per_row else BATCH_TILE_ROWS
    rows = max(1, min(BATCH_TILE_ROWS, fit))
    tiles = -(-m // rows)
    tmax = -(-m // tiles)
    smem = tmax * per_row if k % chunk == 0 and tmax * per_row <= BATCH_X_SMEM_MAX else 0
    return tiles, smem


def batch_grid(gpu: GpuBackend, kernel, tiles: int, n: int, smem: int) -> int:
    """Blocks of a batched launch: per tile, the grid-stride grid over the n / 16 weight groups
    that the device holds at once with the other tiles' (grid_stride_blocks), times the tiles."""
    groups = max(1, -(-n // BATCH_GROUP_ROWS))
    resident = gpu.resident_blocks(kernel, BATCH_BLOCK, smem)
    return tiles * grid_stride_blocks(groups, max(1, resident // tiles))


def batch_shape_ok(m: int, tiles: int) -> bool:
    """The kernels' own check of (m, tiles); a launch outside it writes nothing."""
    return 1 <= m <= BATCH_MAX_M and 1 <= tiles <= m and -(-m // tiles) <= BATCH_TILE_ROWS


@declare(
    "gemv_fp8w",
    "gemv_fp8w_batch",
    [("Wq", PTR), ("scale", PTR), ("x", PTR), ("y", PTR), ("m", U32), ("n", U32), ("k", U32), ("tiles", U32)],
    writes=("y",),
)
def GEMV_FP8W_BATCH(mem, Wq, scale, x, y, m, n, k, tiles):  # noqa: N802 - the declaration is the constant
    """gemv_fp8w's twin for m rows: dot_rows gives each row its own sums, so a row's outputs are
    the same whatever m (as on the device, where the tiles never change a row's arithmetic)."""
    if not batch_shape_ok(m, tiles) or n == 0:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        _twin(mem, Wq, scale, x, y, m, n, k, BATCH_MAX_M)


def gemv_fp8w_batch(
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
    """``y[m, n] = scale[n] * (x[m, k] @ Wq[n, k]^T)`` for m in 1..256 (rows of x and y dense), each
    row's outputs bit-identical to gemv_fp8w's and to those of any other m."""
    if not 1 <= m <= BATCH_MAX_M:
        raise ValueError(f"gemv_fp8w_batch: m={m} rows of x; the kernel handles 1..{BATCH_MAX_M}")
    if n < 1 or k < 0:
        raise ValueError(f"gemv_fp8w_batch: bad shape n={n}, k={k}")
    kernel = gpu.kernel(*GEMV_FP8W_BATCH.key)
    tiles, smem = batch_tiling(m, k)
    grid = batch_grid(gpu, kernel, tiles, n, smem)
    launch(gpu, kernel, grid, BATCH_BLOCK, Wq, scale, x, y, m, n, k, tiles, smem=smem, stream=stream)
