"""Batched GEMV with one weight matrix per batch entry: ``y[b] = W[b] @ x[b]``.

Used for the per-head absorbed query (``kv_b``'s key half, stored transposed per head), the per-head
value projection, and ``o_proj`` split into fixed head groups (see ``model.attention``).
CUDA: ptx/bgemv.cu.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16
from runtime.launch import launch
from runtime.kernel import PTR, U32, declare

_ARGS = [("w", PTR), ("x", PTR), ("y", PTR), ("batch", U32), ("n", U32), ("k", U32)]


def _bgemv(mem, w, x, batch, n, k):
    wv = mem.read(w, BF16, (batch, n, k)).astype(np.float32)
    xv = mem.read(x, BF16, (batch, k)).astype(np.float32)
    return np.einsum("bnk,bk->bn", wv, xv, dtype=np.float32)


@declare("bgemv", "bgemv_bf16_f32", list(_ARGS), writes=("y",))
def BGEMV_F32(mem, w, x, y, batch, n, k):
    mem.write(y, _bgemv(mem, w, x, batch, n, k).astype(np.float32))


@declare("bgemv", "bgemv_bf16_bf16", list(_ARGS), writes=("y",))
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


def bgemv(gpu, w, x, y, batch, n, k, *, out_f32: bool, stream=None):
    decl = BGEMV_F32 if out_f32 else BGEMV_BF16
    launch(gpu, gpu.kernel(*decl.key), (-(-n // 8), batch), 256, w, x, y, batch, n, k, stream=stream)


def sum_rows_residual(gpu, parts, residual, out, rows, n, stream=None):
    launch(gpu, gpu.kernel(*SUM_ROWS_RESIDUAL.key), -(-n // 256), 256, parts, residual, out, rows,
           n, stream=stream)
