"""Batched GEMV with one weight matrix per batch entry: ``y[b] = W[b] @ x[b]``.

Used for the per-head absorbed query (``kv_b``'s key half, stored transposed per head), the per-head
value projection, and ``o_proj`` split into fixed head groups (see ``model.weights``).
CUDA: ptx/bgemv.cu (grid (ceil(n / (8 rows_per_warp(k))), batch), block 256).
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16
from runtime.host_math import dot_rows
from runtime.kernel import F32, PTR, U32, Pdl, declare
from runtime.kernels.gemv_bf16 import gemv_bf16_ref
from runtime.kernels.rmsnorm import rmsnorm_ref
from runtime.launch import grid_stride_blocks, launch

_ARGS = [("w", PTR), ("x", PTR), ("y", PTR), ("batch", U32), ("n", U32), ("k", U32)]


def _bgemv(mem, w, x, batch, n, k):
    wv = mem.read(w, BF16, (batch, n, k)).astype(np.float32)
    xv = mem.read(x, BF16, (batch, k)).astype(np.float32)
    # Entry by entry: a rank's heads or head groups get the bits one rank's whole batch gives them.
    out = np.empty((batch, n), np.float32)
    for b in range(batch):
        out[b] = dot_rows(xv[b : b + 1], wv[b])[0]
    return out


# The WAIT bgemvs release right after their wait (ptx/common.cuh): wv's successor o_proj, and
# o_proj's sum_rows_residual_rmsnorm, launch during their tails.
@declare("bgemv", "bgemv_bf16_f32", list(_ARGS), writes=("y",), pdl=True, releases=True)
def BGEMV_F32(mem, w, x, y, batch, n, k):
    mem.write(y, _bgemv(mem, w, x, batch, n, k).astype(np.float32))


@declare("bgemv", "bgemv_bf16_f32_beside", list(_ARGS), writes=("y",), pdl=Pdl.BESIDE)
def BGEMV_F32_BESIDE(mem, w, x, y, batch, n, k):
    """bgemv_bf16_f32 that may run beside the kernel launched before it (x is older than that)."""
    BGEMV_F32.host(mem, w, x, y, batch, n, k)


@declare("bgemv", "bgemv_bf16_bf16", list(_ARGS), writes=("y",), pdl=True, releases=True)
def BGEMV_BF16(mem, w, x, y, batch, n, k):
    mem.write(y, _bgemv(mem, w, x, batch, n, k).astype(BF16))


@declare(
    "bgemv",
    "sum_rows_residual",
    [("parts", PTR), ("residual", PTR), ("out", PTR), ("rows", U32), ("n", U32)],
    writes=("out",),
)
def SUM_ROWS_RESIDUAL(mem, parts, residual, out, rows, n):
    """out = bf16(residual + (((p0 + p1) + p2) + ...)): a fixed order, so that a sharded run whose
    rows arrive through a zero-padded all-reduce is bit-identical to one rank."""
    p = mem.read(parts, np.float32, (rows, n))
    acc = p[0].copy()
    for r in range(1, rows):
        acc += p[r]
    mem.write(out, (mem.read(residual, BF16, n).astype(np.float32) + acc).astype(BF16))


@declare(
    "bgemv",
    "sum_rows_residual_rmsnorm",
    [
        ("parts", PTR),
        ("residual", PTR),
        ("norm_w", PTR),
        ("out", PTR),
        ("normed", PTR),
        ("rows", U32),
        ("n", U32),
        ("eps", F32),
    ],
    writes=("out", "normed"),
    pdl=True,
    releases=True,  # right after its wait: its successor's blocks launch during its tail (ptx/common.cuh)
)
def SUM_ROWS_RESIDUAL_RMSNORM(mem, parts, residual, norm_w, out, normed, rows, n, eps):
    """sum_rows_residual into ``out``, then ``normed = rmsnorm(out) * norm_w`` of the BF16 result:
    the residual add of one sub-layer and the input norm of the next in one launch."""
    SUM_ROWS_RESIDUAL.host(mem, parts, residual, out, rows, n)
    mem.write(normed, rmsnorm_ref(mem.read(out, BF16, n), mem.read(norm_w, BF16, n), eps))


@declare(
    "bgemv",
    "rmsnorm_gemv",
    [("x", PTR), ("norm_w", PTR), ("w", PTR), ("y", PTR), ("n", U32), ("k", U32), ("eps", F32)],
    writes=("y",),
    pdl=True,
)
def RMSNORM_GEMV(mem, x, norm_w, w, y, n, k, eps):
    """y = W @ (rmsnorm(x) * norm_w) for one row x [k]; W [n, k], y [n] BF16: the rmsnorm and
    gemv_bf16 (m = 1) twins in sequence, in one launch on the device."""
    xn = rmsnorm_ref(mem.read(x, BF16, k), mem.read(norm_w, BF16, k), eps)
    mem.write(y, gemv_bf16_ref(mem.view(w, BF16, (n, k)), xn[None])[0])


@declare(
    "bgemv",
    "rmsnorm_gemv_beside",
    [("x", PTR), ("norm_w", PTR), ("w", PTR), ("y", PTR), ("n", U32), ("k", U32), ("eps", F32)],
    writes=("y",),
    pdl=Pdl.BESIDE,
)
def RMSNORM_GEMV_BESIDE(mem, x, norm_w, w, y, n, k, eps):
    """rmsnorm_gemv that may run beside the kernel launched before it (x is older than that)."""
    RMSNORM_GEMV.host(mem, x, norm_w, w, y, n, k, eps)


def rows_per_warp(k: int) -> int:
    """ptx/bgemv.cu bgemv_dispatch: short rows get more rows per warp (16 loads per lane in flight)."""
    return 16 if k <= 256 else 8 if k <= 512 else 4


def bgemv(gpu, w, x, y, batch, n, k, *, out_f32: bool, beside: bool = False, stream=None):
    """``beside``: x was produced before the previous launch on the stream, so the GEMV may run
    beside that launch (f32 output only; runtime.kernel.Pdl.BESIDE)."""
    if beside and not out_f32:
        raise ValueError("the beside variant of bgemv writes f32 only")
    decl = BGEMV_F32_BESIDE if beside else BGEMV_F32 if out_f32 else BGEMV_BF16
    per_block = 8 * rows_per_warp(k)  # 8 warps
    launch(gpu, gpu.kernel(*decl.key), (-(-n // per_block), batch), 256, w, x, y, batch, n, k, stream=stream)


def sum_rows_residual(gpu, parts, residual, out, rows, n, stream=None):
    launch(
        gpu,
        gpu.kernel(*SUM_ROWS_RESIDUAL.key),
        -(-n // 256),
        256,
        parts,
        residual,
        out,
        rows,
        n,
        stream=stream,
    )


def sum_rows_residual_rmsnorm(gpu, parts, residual, norm_w, out, normed, rows, n, eps, stream=None):
    """One block of 1024 threads owns the whole row (the norm needs all of it)."""
    launch(
        gpu,
        gpu.kernel(*SUM_ROWS_RESIDUAL_RMSNORM.key),
        1,
        1024,
        parts,
        residual,
        norm_w,
        out,
        normed,
        rows,
        n,
        eps,
        stream=stream,
    )


# ptx/bgemv.cu rmsnorm_gemv: one row per warp, 8 warps per block, grid-stride with the blocks the
# device holds at once (gpu.resident_blocks, evened out by grid_stride_blocks: the 20480-row q
# projection runs 5 rounds in 512 blocks rather than 4 or 5 in 528), so every block pays its norm
# prologue once. The normalised x lives in dynamic smem.


def rmsnorm_gemv(gpu, x, norm_w, w, y, n, k, eps, stream=None, *, beside: bool = False):
    """``beside``: x was produced before the previous launch on the stream, so the GEMV may run
    beside that launch (runtime.kernel.Pdl.BESIDE)."""
    kernel = gpu.kernel(*(RMSNORM_GEMV_BESIDE if beside else RMSNORM_GEMV).key)
    grid = grid_stride_blocks(max(1, -(-n // 8)), gpu.resident_blocks(kernel, 256, 2 * k))
    launch(gpu, kernel, grid, 256, x, norm_w, w, y, n, k, eps, smem=2 * k, stream=stream)
