"""Launch harness for the tensor-core projections (model/kernels/proj_mma.py): every scenario runs
on any backend from NumPy inputs and returns NumPy outputs, so the same code gives the host twin's
answer (tests/test_proj_mma.py) and the PTX's (tests/test_gpu_proj_mma.py). Buffers are poisoned
with a guard after them (batch_proj_util.Bufs); ``single=True`` launches each row alone (m = 1,
pointers at the row), which a batch must reproduce bit for bit.
"""

from __future__ import annotations

import numpy as np
from batch_proj_fp8_util import Seg, device_segments
from batch_proj_util import EPS, Bufs

from model.kernels import bgemv_fp8 as bf
from model.kernels import proj_mma as pm
from runtime.dtypes import BF16


def proj_seg(
    gpu,
    x: np.ndarray,
    k: int,
    nw: np.ndarray,
    segs: list[Seg],
    y_stride: int,
    *,
    x_off: int = 0,
    single: bool = False,
) -> np.ndarray:
    """y [m, y_stride] BF16 of rmsnorm_rows_batch (row e's input x[e, x_off : x_off + k] into a
    normed buffer) then proj_mma_batch over the segments; untouched columns keep the poison."""
    m, x_stride = x.shape
    xs = -(-k // 8) * 8 + 8  # a normed row longer than k: the kernels must not depend on it
    with Bufs(gpu) as b:
        px, pn, py = b.put(x), b.put(nw), b.poison(m * y_stride * 2)
        pxn = b.poison(m * xs * 2)
        dev = device_segments(b, segs)
        wsb = pm.proj_workspace_bytes(dev, 1, k, m, y_stride)
        part = b.poison(wsb) if wsb else None  # the split-k partials, where the shape splits k
        for e, mm in [(e, 1) for e in range(m)] if single else [(0, m)]:
            pm.rmsnorm_rows_batch(
                gpu,
                x=px.offset((e * x_stride + x_off) * 2),
                x_stride=x_stride,
                norm_w=pn,
                out=pxn.offset(e * xs * 2),
                out_stride=xs,
                m=mm,
                k=k,
                eps=EPS,
            )
            pm.proj_mma_batch(
                gpu,
                x=pxn.offset(e * xs * 2),
                x_stride=xs,
                segments=dev,
                y=py.offset(e * y_stride * 2),
                y_stride=y_stride,
                m=mm,
                k=k,
                out_f32=False,
                part=part,
            )
        normed = b.get(pxn).view(BF16).reshape(m, xs)
        assert (normed[:, k:].view(np.uint16) == 0xFFFF).all(), "rmsnorm_rows_batch wrote past k"
        return b.get(py).view(BF16).reshape(m, y_stride)


def proj_heads(
    gpu,
    w: np.ndarray,
    x: np.ndarray,
    *,
    out_f32: bool,
    scales: np.ndarray | None = None,
    col0: int = 0,
    single: bool = False,
    x_pad: int = 0,
    y_pad: int = 0,
) -> np.ndarray:
    """y [m, heads, n] (f32 or BF16) of proj_mma_batch with ``heads`` matrices w [heads, n, k] (BF16,
    or FP8 with the full matrix's block scales and head h at columns col0 + h * k) for x [m, heads,
    k]; rows ``x_pad`` / ``y_pad`` elements longer than their heads (poisoned, checked untouched)."""
    heads, n, k = w.shape
    m = x.shape[0]
    isz = 4 if out_f32 else 2
    xs, ys = heads * k + x_pad, heads * n + y_pad
    xr = np.full((m, xs), np.nan, BF16)
    xr[:, : heads * k] = x.reshape(m, heads * k)
    with Bufs(gpu) as b:
        pw = b.put(w.view(np.uint8) if scales is not None else w)
        ps = b.put(scales) if scales is not None else None
        px, py = b.put(xr), b.poison(m * ys * isz)
        seg = bf.GemvSegment(w=pw, scales=ps, rows=n, col=0)
        wsb = pm.proj_workspace_bytes([seg], heads, k, m, ys)
        part = b.poison(wsb) if wsb else None
        for e, mm in [(e, 1) for e in range(m)] if single else [(0, m)]:
            pm.proj_mma_batch(
                gpu,
                x=px.offset(e * xs * 2),
                x_stride=xs,
                x_head=k,
                segments=[seg],
                y=py.offset(e * ys * isz),
                y_stride=ys,
                y_head=n,
                heads=heads,
                m=mm,
                k=k,
                out_f32=out_f32,
                s_cols=scales.shape[1] if scales is not None else None,
                s_col0=col0,
                part=part,
            )
        raw = b.get(py)
    y = raw.view(np.float32 if out_f32 else BF16).reshape(m, ys)
    pad = y[:, heads * n :].view(np.uint32 if out_f32 else np.uint16)
    assert (pad == (0xFFFFFFFF if out_f32 else 0xFFFF)).all(), "proj_mma_batch wrote between rows"
    return np.ascontiguousarray(y[:, : heads * n]).reshape(m, heads, n)
