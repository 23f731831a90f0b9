"""Launch harness for the FP8 block-scaled projections (model/kernels/bgemv_fp8.py): every scenario
runs on any backend from NumPy inputs and returns NumPy outputs, so the same code gives the host
twin's answer (tests/test_batch_proj_fp8.py) and the PTX's (tests/test_gpu_batch_proj_fp8.py).

Buffers are poisoned with a guard after them (batch_proj_util.Bufs): an output the kernel should
write and did not shows as NaN, a column it must not write keeps its poison, a write past the end
breaks the guard. ``single=True`` launches each row alone (m = 1, pointers at the row) into one
full-size poisoned buffer: what a batch must reproduce bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from batch_proj_util import EPS, Bufs
from kernel_util import abs_dot, dot_bound, random_bf16

from model.checkpoint.fp8 import dequantize, quantize
from model.kernels import bgemv_fp8 as bf
from runtime.dtypes import BF16, FP8

BLOCK = 128


def fp8_tensor(
    rng: np.random.Generator, rows: int, k: int, exp_lo: int = -8
) -> tuple[np.ndarray, np.ndarray]:
    """(q FP8 [rows, k], scales f32 [ceil(rows / 128), ceil(k / 128)]) of random weights whose
    128 x 128 blocks differ in magnitude by up to 2**6 (so that every block's scale matters)."""
    w = random_bf16(rng, (rows, k), exp_lo=exp_lo).astype(np.float32)
    sb = 2.0 ** rng.integers(-3, 4, (-(-rows // BLOCK), -(-k // BLOCK)))
    w *= np.repeat(np.repeat(sb, BLOCK, axis=0), BLOCK, axis=1)[:rows, :k].astype(np.float32)
    q, s = quantize(w)
    assert q.dtype == FP8 and s.dtype == np.float32
    return q, s


def dequant64(q: np.ndarray, s: np.ndarray, row0: int = 0, base: int = 0) -> np.ndarray:
    """float64 W[r, c] = q[r, c] * s[(row0 + r) // 128, (base + c) // 128], exactly."""
    rows, k = q.shape
    sr = s[(row0 + np.arange(rows)) // BLOCK][:, (base + np.arange(k)) // BLOCK].astype(np.float64)
    return q.astype(np.float64) * sr


def dequant_checkpoint(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The loader's own dequantisation (model/checkpoint/fp8.py) of a whole tensor, in f32."""
    return dequantize(q, s, dtype=np.float32)


@dataclass
class Seg:
    """One segment of a launch: BF16 ``w [rows, k]``, or FP8 ``w`` (rows row0 .. of a tensor whose
    full scales are ``scales``); outputs to columns col .. col + rows - 1."""

    w: np.ndarray
    col: int
    scales: np.ndarray | None = None
    row0: int = 0
    mis: int = 0  # bytes the device copy of w is misaligned by (the element paths)

    @property
    def rows(self) -> int:
        return self.w.shape[0]

    def dequant(self) -> np.ndarray:
        """float64 [rows, k]."""
        if self.scales is None:
            return self.w.astype(np.float64)
        return dequant64(self.w, self.scales, self.row0)


def device_segments(b: Bufs, segs: list[Seg]) -> list[bf.GemvSegment]:
    """The segments' weights (and scales) uploaded into ``b``, as the kernels take them."""
    dev = []
    for sg in segs:
        pw = b.put(sg.w.view(np.uint8) if sg.scales is not None else sg.w, sg.mis)
        ps = b.put(sg.scales) if sg.scales is not None else None
        dev.append(bf.GemvSegment(w=pw, scales=ps, rows=sg.rows, col=sg.col, row0=sg.row0))
    return dev


def seg_gemv(
    gpu,
    x: np.ndarray,
    k: int,
    nw: np.ndarray,
    segs: list[Seg],
    y_stride: int,
    *,
    x_off: int = 0,
    beside: bool = False,
    single: bool = False,
    mis: int = 0,
    order: list[list[int]] | None = None,
) -> np.ndarray:
    """y [m, y_stride] BF16 (untouched columns keep the poison bits) of rmsnorm_gemv_seg_batch with
    row e's input at x[e, x_off : x_off + k] (x [m, x_stride]). ``order``: launch these groups of
    segment indices one launch each (default: all in one launch)."""
    m, x_stride = x.shape
    groups = order if order is not None else [list(range(len(segs)))]
    with Bufs(gpu) as b:
        px, pn, py = b.put(x, mis), b.put(nw), b.poison(m * y_stride * 2)
        dev = device_segments(b, segs)
        for grp in groups:
            for e, mm in [(e, 1) for e in range(m)] if single else [(0, m)]:
                bf.rmsnorm_gemv_seg_batch(
                    gpu,
                    x=px.offset((e * x_stride + x_off) * 2),
                    x_stride=x_stride,
                    norm_w=pn,
                    segments=[dev[i] for i in grp],
                    y=py.offset(e * y_stride * 2),
                    y_stride=y_stride,
                    m=mm,
                    k=k,
                    eps=EPS,
                    beside=beside,
                )
        return b.get(py).view(BF16).reshape(m, y_stride)


def seg_columns(y: np.ndarray, segs: list[Seg]) -> list[np.ndarray]:
    """Each segment's columns of y, in segment order."""
    return [y[:, sg.col : sg.col + sg.rows] for sg in segs]


def seg_gemv_bound(
    xn: np.ndarray, w64: np.ndarray, ref: np.ndarray, k: int, norm_ulps: float = 1.0
) -> np.ndarray:
    """A launch against another launch or against float64 (ref): dot_bound for two f32
    accumulations of k products and two roundings (kernel_util.py), plus ``norm_ulps`` BF16 ulps on
    every normalised input (the device's norm sums its squares in another order; the twin's f32
    norm against float64), with w64 the dequantised weights."""
    absd = abs_dot(np.atleast_2d(xn), w64)
    return dot_bound(absd, ref, k, roundings=2) + norm_ulps * 2.0**-7 * absd


# ---- bgemv_fp8_batch ------------------------------------------------------------------------------------


@dataclass
class OProj:
    """An o_proj-like FP8 weight: the full [n, total_cols] tensor's scales and this rank's heads
    [heads, n, k] cut from columns col0 .. col0 + heads * k - 1 (head h = columns col0 + h * k ..)."""

    q: np.ndarray  # [heads, n, k] FP8
    scales: np.ndarray  # [ceil(n / 128), ceil(total_cols / 128)] f32
    col0: int

    @classmethod
    def random(cls, rng, heads: int, n: int, k: int, col0: int = 0, extra_cols: int = 0) -> OProj:
        total = col0 + heads * k + extra_cols
        qf, s = fp8_tensor(rng, n, total)
        q = qf[:, col0 : col0 + heads * k].reshape(n, heads, k).transpose(1, 0, 2)
        return cls(np.ascontiguousarray(q), s, col0)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.q.shape

    def dequant(self, h: int) -> np.ndarray:
        """float64 [n, k] of head h."""
        k = self.q.shape[2]
        return dequant64(self.q[h], self.scales, 0, self.col0 + h * k)


def bgemv_fp8(
    gpu,
    o: OProj,
    x: np.ndarray,
    *,
    out_f32: bool,
    beside: bool = False,
    single: bool = False,
    mis: int = 0,
    x_pad: int = 0,
    y_pad: int = 0,
) -> np.ndarray:
    """y [m, heads, n] (f32 or BF16) for x [m, heads, k]; rows of x (and y) ``x_pad`` (``y_pad``)
    elements longer than their heads (those elements poisoned and, in y, checked untouched)."""
    heads, n, k = o.shape
    m = x.shape[0]
    isz = 4 if out_f32 else 2
    xs, ys = heads * k + x_pad, heads * n + y_pad
    xr = np.full((m, xs), np.nan, BF16)
    xr[:, : heads * k] = x.reshape(m, heads * k)
    with Bufs(gpu) as b:
        pw, ps = b.put(o.q.view(np.uint8)), b.put(o.scales)
        px, py = b.put(xr, mis), b.poison(m * ys * isz)
        for e, mm in [(e, 1) for e in range(m)] if single else [(0, m)]:
            bf.bgemv_fp8_batch(
                gpu,
                w=pw,
                scales=ps,
                scale_cols=o.scales.shape[1],
                col0=o.col0,
                x=px.offset(e * xs * 2),
                x_stride=xs,
                y=py.offset(e * ys * isz),
                y_stride=ys,
                m=mm,
                heads=heads,
                n=n,
                k=k,
                out_f32=out_f32,
                beside=beside,
            )
        raw = b.get(py)
    y = raw.view(np.float32 if out_f32 else BF16).reshape(m, ys)
    pad = y[:, heads * n :].view(np.uint32 if out_f32 else np.uint16)
    assert (pad == (0xFFFFFFFF if out_f32 else 0xFFFF)).all(), "bgemv_fp8_batch wrote between rows"
    return np.ascontiguousarray(y[:, : heads * n]).reshape(m, heads, n)


def bgemv_fp8_bound(
    o: OProj, x: np.ndarray, ref: np.ndarray, out_f32: bool, roundings: int = 2
) -> np.ndarray:
    """Two f32 accumulations of k products (and, for BF16 output, two roundings) against ref
    [m, heads, n]."""
    heads, n, k = o.shape
    absd = np.stack([abs_dot(x[:, h], o.dequant(h)) for h in range(heads)], axis=1)
    if out_f32:
        return 2.0 * roundings * k * 2.0**-24 * absd + 1e-30
    return dot_bound(absd, ref, k, roundings=roundings)
