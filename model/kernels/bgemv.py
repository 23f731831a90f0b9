"""The drafter's BF16 projections and row sums over m rows of activations at once (1 <= m <= 256).

``bgemv_*_batch``: one weight matrix per head, ``y[e][h] = W[h] @ x[e][h]`` -- the per-head absorbed
query (``kv_b``'s key half, stored transposed per head), the per-head value projection, and
``o_proj`` split into fixed head groups (see ``model.weights``). ``sum_rows_residual*_batch``: the
ordered row sums that follow the o_proj head groups and the MoE slots (with the next layer's
RMSNorm). Each weight matrix is read once for all m rows; a row's bits do not depend on m or on the
other rows. CUDA: ptx/bgemv.cu.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16
from runtime.host_math import dot_rows
from runtime.kernel import F32, PTR, U32, Pdl, declare
from runtime.kernels.rmsnorm import rmsnorm_ref
from runtime.launch import launch

from .batch import check_rows


def rows_per_warp(k: int) -> int:
    """ptx/bgemv.cu bgemv_batch_dispatch: short rows get more rows per warp (16 loads per lane in
    flight)."""
    return 16 if k <= 256 else 8 if k <= 512 else 4


# ---- the batch: m rows of activations (1 <= m <= MAX_ROWS), each weight matrix read once ------------
#
# ptx/bgemv.cu: rows of x per block (blockIdx.x is the chunk, so the blocks that stream one tile of
# weights launch one after another and all but the first read it from L2). A chunk of one row runs
# the one-row path (bgemv_body), a chunk of 2..8 rows the path of the next power of two; a row's
# arithmetic is the same in every one of them, so row e of any batch is bit-identical to a launch of
# that row alone (m = 1).
BATCH_ROWS = 8


def _pow2_rows(m: int) -> int:
    """Rows of the largest chunk's template: min(m, BATCH_ROWS) rounded up to a power of two."""
    return 1 << (min(m, BATCH_ROWS) - 1).bit_length()


_BATCH_ARGS = [
    ("w", PTR),
    ("x", PTR),
    ("y", PTR),
    ("m", U32),
    ("heads", U32),
    ("x_stride", U32),
    ("y_stride", U32),
    ("n", U32),
    ("k", U32),
]


def _bgemv_batch(mem, w, x, y, m, heads, x_stride, y_stride, n, k, dtype):
    """y[e, h] = w[h] @ x[e, h] with row e's heads at x + e * x_stride and y + e * y_stride
    (elements); element (e, h, j) depends on x[e, h] and w[h, j] alone (runtime.host_math.dot_rows),
    so no row depends on m or the other rows. What lies between rows' heads is left as it was."""
    wv = mem.read(w, BF16, (heads, n, k)).astype(np.float32)
    isz = np.dtype(dtype).itemsize
    for e in range(m):
        xv = mem.read(x.offset(e * x_stride * 2), BF16, (heads, k)).astype(np.float32)
        out = np.empty((heads, n), np.float32)
        for h in range(heads):
            out[h] = dot_rows(xv[h][None], wv[h])[0]
        mem.write(y.offset(e * y_stride * isz), out.astype(dtype))


@declare("bgemv", "bgemv_bf16_f32_batch", list(_BATCH_ARGS), writes=("y",), pdl=True, releases=True)
def BGEMV_F32_BATCH(mem, w, x, y, m, heads, x_stride, y_stride, n, k):
    """y[e, h] = w[h] @ x[e, h] for m rows: w [heads, n, k], row e's x [heads, k] and y [heads, n] f32."""
    _bgemv_batch(mem, w, x, y, m, heads, x_stride, y_stride, n, k, np.float32)


@declare("bgemv", "bgemv_bf16_f32_batch_beside", list(_BATCH_ARGS), writes=("y",), pdl=Pdl.BESIDE)
def BGEMV_F32_BATCH_BESIDE(mem, w, x, y, m, heads, x_stride, y_stride, n, k):
    """bgemv_bf16_f32_batch that may run beside the kernel launched before it (x is older)."""
    _bgemv_batch(mem, w, x, y, m, heads, x_stride, y_stride, n, k, np.float32)


@declare("bgemv", "bgemv_bf16_bf16_batch", list(_BATCH_ARGS), writes=("y",), pdl=True, releases=True)
def BGEMV_BF16_BATCH(mem, w, x, y, m, heads, x_stride, y_stride, n, k):
    """bgemv_bf16_f32_batch with y [heads, n] BF16 per row."""
    _bgemv_batch(mem, w, x, y, m, heads, x_stride, y_stride, n, k, BF16)


def bgemv_batch(
    gpu,
    *,
    w,
    x,
    y,
    m,
    heads,
    n,
    k,
    out_f32: bool,
    x_stride: int | None = None,
    y_stride: int | None = None,
    beside: bool = False,
    stream=None,
):
    """Per head h: ``y[e, h, :] = w[h] (n x k) @ x[e, h, :]`` for e < m, w[h] read once for all m
    rows. Row e's heads ``[heads][k]`` BF16 start at ``x + e * x_stride`` elements and its outputs
    ``[heads][n]`` (f32 with ``out_f32``, else BF16) at ``y + e * y_stride``; the strides default to
    dense rows (heads * k, heads * n). ``beside``: x was produced before the previous launch on the
    stream (f32 output only; Pdl.BESIDE)."""
    check_rows("bgemv_batch", m)
    if beside and not out_f32:
        raise ValueError("the beside variant of bgemv_batch writes f32 only")
    if heads < 1 or n < 1:
        raise ValueError(f"bgemv_batch: bad shape heads={heads}, n={n}")
    x_stride = heads * k if x_stride is None else x_stride
    y_stride = heads * n if y_stride is None else y_stride
    if x_stride < heads * k or y_stride < heads * n:
        raise ValueError(f"bgemv_batch: strides {x_stride} / {y_stride} below a row's {heads} heads")
    decl = BGEMV_F32_BATCH_BESIDE if beside else BGEMV_F32_BATCH if out_f32 else BGEMV_BF16_BATCH
    per_block = 8 * rows_per_warp(k)  # 8 warps
    grid = (-(-m // BATCH_ROWS), -(-n // per_block), heads)
    launch(
        gpu,
        gpu.kernel(*decl.key),
        grid,
        256,
        w,
        x,
        y,
        m,
        heads,
        x_stride,
        y_stride,
        n,
        k,
        smem=bgemv_batch_smem(m, k),
        stream=stream,
    )


# Shared memory a bgemv_batch block may stage its chunk's x rows in: two blocks per SM (the register
# count's residency) keep fitting. Longer rows are read from global memory (the kernel sees the size).
BGEMV_STAGE_MAX = 96 << 10


def bgemv_batch_smem(m: int, k: int) -> int:
    """Dynamic shared memory of bgemv_batch: the chunk's x rows [M][k] BF16 when m > 1 (none at m = 1,
    the one-row path and its residency), or none where that exceeds BGEMV_STAGE_MAX."""
    if m < 2:
        return 0
    nbytes = _pow2_rows(m) * k * 2
    return nbytes if nbytes <= BGEMV_STAGE_MAX else 0


_SUM_BATCH_ARGS = [("parts", PTR), ("residual", PTR), ("out", PTR), ("m", U32), ("rows", U32), ("n", U32)]


def _sum_rows_batch(mem, parts, residual, m, rows, n) -> np.ndarray:
    """bf16(residual + (((p0 + p1) + p2) + ...)) for every row e at once: f32 adds in part-row order,
    then the residual (elementwise, so row by row the same)."""
    p = mem.read(parts, np.float32, (m, rows, n))
    acc = p[:, 0].copy()
    for r in range(1, rows):
        acc += p[:, r]
    return (mem.read(residual, BF16, (m, n)).astype(np.float32) + acc).astype(BF16)


@declare("bgemv", "sum_rows_residual_batch", _SUM_BATCH_ARGS, writes=("out",))
def SUM_ROWS_RESIDUAL_BATCH(mem, parts, residual, out, m, rows, n):
    """out[e] = bf16(residual[e] + the ordered sum of parts[e]) for each row e < m: parts [m, rows, n]
    f32, residual / out [m, n] BF16."""
    if rows == 0 or n == 0:
        return  # the kernel writes nothing either
    mem.write(out, _sum_rows_batch(mem, parts, residual, m, rows, n))


@declare(
    "bgemv",
    "sum_rows_residual_rmsnorm_batch",
    [
        ("parts", PTR),
        ("residual", PTR),
        ("norm_w", PTR),
        ("out", PTR),
        ("normed", PTR),
        ("m", U32),
        ("rows", U32),
        ("n", U32),
        ("eps", F32),
    ],
    writes=("out", "normed"),
    pdl=True,
    releases=True,  # right after its wait: its successor launches during its tail (ptx/common.cuh)
)
def SUM_ROWS_RESIDUAL_RMSNORM_BATCH(mem, parts, residual, norm_w, out, normed, m, rows, n, eps):
    """sum_rows_residual_batch into ``out`` [m, n], then normed [m, n] = rmsnorm(out) * norm_w of the BF16
    result: the residual add of one sub-layer and the input norm of the next in one launch."""
    if rows == 0 or n == 0:
        return  # the kernel writes nothing either
    o = _sum_rows_batch(mem, parts, residual, m, rows, n)
    mem.write(out, o)
    mem.write(normed, rmsnorm_ref(o, mem.read(norm_w, BF16, n), eps))


def sum_rows_residual_batch(gpu, *, parts, residual, out, m, rows, n, stream=None):
    """out[e] = bf16(residual[e] + (((parts[e, 0] + parts[e, 1]) + ...))) for e < m."""
    check_rows("sum_rows_residual_batch", m)
    launch(
        gpu,
        gpu.kernel(*SUM_ROWS_RESIDUAL_BATCH.key),
        (-(-n // 256), m),
        256,
        parts,
        residual,
        out,
        m,
        rows,
        n,
        stream=stream,
    )


def sum_rows_residual_rmsnorm_batch(
    gpu, *, parts, residual, norm_w, out, normed, m, rows, n, eps, stream=None
):
    """sum_rows_residual_batch into ``out``, then ``normed[e] = rmsnorm(out[e]) * norm_w``: one
    block of 1024 threads per row."""
    check_rows("sum_rows_residual_rmsnorm_batch", m)
    launch(
        gpu,
        gpu.kernel(*SUM_ROWS_RESIDUAL_RMSNORM_BATCH.key),
        m,
        1024,
        parts,
        residual,
        norm_w,
        out,
        normed,
        m,
        rows,
        n,
        eps,
        stream=stream,
    )
