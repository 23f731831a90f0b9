#!/usr/bin/env python3
"""Time the FP8 block-scaled projections (model/kernels/bgemv_fp8.py) against their BF16 forms, at
GLM-5.3-Flash's shapes, on a GPU:

- fused_in, k = 4096, 2336 rows: rmsnorm_gemv_seg_batch with the BF16 matrix as one segment and as
  its four parts, with the checkpoint's dtypes (kv_a 512 of 576 rows and q_a 1536 rows FP8, wk +
  compress_gate 256 and weights_proj 32 rows BF16), and all FP8;
- the q projection, k = 1536 read from inside the 2336-wide fused row, 64 * 256 + 32 * 128 rows:
  the BF16 matrix as one segment, and q_b FP8 with wq_b BF16;
- o_proj in 8 head groups of 2048 columns (model/proposer.py o_proj_groups) x H 4096, f32 out:
  bgemv_batch (BF16) against bgemv_fp8_batch;

at m = 1, 4, 16, 64 rows of activations. Each time is one launch's device time inside a CUDA graph of
back-to-back launches (a Python launch takes longer than these kernels), the launches cycling over
enough copies of the weights that none finds them in the 60 MB L2; TB/s counts the weight and scale
bytes once per launch. Every configuration is checked against its host twin at m = 1 first.

    python3 bench/sweep_fp8_gemv.py [--reps 20] [--ms 1,4,16,64] [--no-pdl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model.checkpoint.fp8 import quantize  # noqa: E402 - after the sys.path insert
from model.kernels import bgemv as bg  # noqa: E402
from model.kernels import bgemv_fp8 as bf  # noqa: E402
from model.kernels import proj_mma as pm  # noqa: E402
from runtime.dtypes import BF16  # noqa: E402
from runtime.host_backend import HostBackend  # noqa: E402

H, K_Q, FUSED = 4096, 1536, 2336
CTX_ROWS = 512 + 2 * 128  # where q_a starts in the fused row
Q_B, WQ_B = 64 * 256, 32 * 128
GROUPS, GROUP_W = 8, 2048
EPS = 1e-5
L2_BYTES = 60 << 20
LAUNCHES = 24  # per graph replay


def bf16_weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    r = np.frombuffer(rng.bytes(2 * int(np.prod(shape))), dtype=np.uint16)
    bits = (r & np.uint16(0x807F)) | ((((r >> 7) & np.uint16(7)) + np.uint16(127 - 8)) << np.uint16(7))
    return bits.view(BF16).reshape(shape)


def fp8_weights(rng: np.random.Generator, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(q FP8 [rows, k], scales f32): one 4096-row tile quantised and repeated (speed does not
    depend on the values, and quantising 16384 x 1536 takes a while on the host)."""
    tile = min(rows, 4096)
    q, s = quantize(bf16_weights(rng, (tile, k)).astype(np.float32))
    reps = -(-rows // tile)
    return np.tile(q, (reps, 1))[:rows], np.tile(s, (reps, 1))[: -(-rows // 128)]


@dataclass
class Part:
    """One segment's host data: BF16 w, or FP8 q with its full tensor's scales."""

    w: np.ndarray
    col: int
    scales: np.ndarray | None = None
    row0: int = 0

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (0 if self.scales is None else self.scales.nbytes)


class Copies:
    """``n`` device copies of a set of arrays, so that consecutive launches read different bytes."""

    def __init__(self, gpu, arrays: list[np.ndarray], nbytes: int):
        self.gpu = gpu
        self.n = max(2, -(-3 * L2_BYTES // max(nbytes, 1)))
        self.ptrs = []
        for _ in range(self.n):
            row = []
            for a in arrays:
                p = gpu.alloc(max(a.nbytes, 16))
                gpu.copy_h2d(p, np.ascontiguousarray(a).view(np.uint8).reshape(-1))
                row.append(p)
            self.ptrs.append(row)

    def free(self) -> None:
        for row in self.ptrs:
            for p in row:
                self.gpu.free(p)


def time_graph(gpu, launch: Callable[[int, int], None], copies: int, reps: int) -> float:
    """Median device microseconds of one launch: a graph of LAUNCHES launches (launch i on copy
    i % copies) replayed between events."""
    s = gpu.create_stream()
    gpu.begin_capture(s)
    for i in range(LAUNCHES):
        launch(i % copies, s)
    g = gpu.end_capture(s, label="sweep_fp8_gemv")
    e0, e1 = gpu.event_create(), gpu.event_create()
    times = []
    for i in range(reps + 3):
        gpu.graph_launch(g, s)  # keeps the device busy while e0 is queued
        gpu.event_record(e0, s)
        gpu.graph_launch(g, s)
        gpu.event_record(e1, s)
        if i >= 3:
            times.append(gpu.event_elapsed_ms(e0, e1) * 1e3 / LAUNCHES)
    gpu.synchronize()
    gpu.event_destroy(e0)
    gpu.event_destroy(e1)
    gpu.graph_destroy(g)
    gpu.destroy_stream(s)
    return statistics.median(times)


def seg_runner(
    gpu, parts: list[Part], k: int, x_stride: int, x_off: int, y_stride: int, m: int, tc: bool = False
):
    """(launch(copy, stream), copies, weight bytes, check(), free()) for one rmsnorm_gemv_seg_batch
    configuration; ``tc``: its tensor-core form (rmsnorm_rows_batch, then proj_mma_batch)."""
    rng = np.random.default_rng(0)
    nbytes = sum(p.nbytes for p in parts)
    arrays = []
    for p in parts:
        arrays.append(p.w.view(np.uint8) if p.scales is not None else p.w)
        if p.scales is not None:
            arrays.append(p.scales)
    cp = Copies(gpu, arrays, nbytes)
    x = bf16_weights(rng, (m, x_stride))
    nw = bf16_weights(rng, (k,))
    px, pn, py = gpu.alloc(x.nbytes), gpu.alloc(nw.nbytes), gpu.alloc(m * y_stride * 2)
    pxn = gpu.alloc(m * k * 2)
    gpu.copy_h2d(px, x)
    gpu.copy_h2d(pn, nw)

    def segments(c: int) -> list[bf.GemvSegment]:
        ptrs, out = iter(cp.ptrs[c]), []
        for p in parts:
            w = next(ptrs)
            s = next(ptrs) if p.scales is not None else None
            out.append(bf.GemvSegment(w=w, scales=s, rows=p.w.shape[0], col=p.col, row0=p.row0))
        return out

    segs = [segments(c) for c in range(cp.n)]
    xa = px.offset(x_off * 2)

    def launch(c: int, stream) -> None:
        if tc:
            pm.rmsnorm_rows_batch(
                gpu,
                x=xa,
                x_stride=x_stride,
                norm_w=pn,
                out=pxn,
                out_stride=k,
                m=m,
                k=k,
                eps=EPS,
                stream=stream,
            )
            pm.proj_mma_batch(
                gpu, x=pxn, x_stride=k, segments=segs[c], y=py, y_stride=y_stride, m=m, k=k, out_f32=False,
                stream=stream,
            )  # fmt: skip
            return
        bf.rmsnorm_gemv_seg_batch(
            gpu, x=xa, x_stride=x_stride, norm_w=pn, segments=segs[c], y=py, y_stride=y_stride, m=m,
            k=k, eps=EPS, stream=stream,
        )  # fmt: skip

    def check() -> float:
        """Largest |GPU - twin| / max |twin| at this m."""
        gpu.memset(py, 0xFF, m * y_stride * 2)
        launch(0, None)
        gpu.synchronize()
        got = np.empty((m, y_stride), BF16)
        gpu.copy_d2h(got, py)
        host = HostBackend()
        hx, hn, hy = host.alloc(x.nbytes), host.alloc(nw.nbytes), host.alloc(m * y_stride * 2)
        host.copy_h2d(hx, x)
        host.copy_h2d(hn, nw)
        hsegs = []
        for p in parts:
            hw = host.alloc(p.w.nbytes)
            host.copy_h2d(hw, p.w.view(np.uint8).reshape(-1))
            hs = None
            if p.scales is not None:
                hs = host.alloc(p.scales.nbytes)
                host.copy_h2d(hs, p.scales)
            hsegs.append(bf.GemvSegment(w=hw, scales=hs, rows=p.w.shape[0], col=p.col, row0=p.row0))
        bf.rmsnorm_gemv_seg_batch(
            host, x=hx.offset(x_off * 2), x_stride=x_stride, norm_w=hn, segments=hsegs, y=hy,
            y_stride=y_stride, m=m, k=k, eps=EPS,
        )  # fmt: skip
        ref = np.empty((m, y_stride), BF16)
        host.copy_d2h(ref, hy)
        g32, r32 = got.astype(np.float32), ref.astype(np.float32)
        assert not np.isnan(g32).any(), "unwritten outputs"
        return float(np.abs(g32 - r32).max() / max(np.abs(r32).max(), 1e-30))

    def free() -> None:
        cp.free()
        for p in (px, pn, py, pxn):
            gpu.free(p)

    return launch, cp.n, nbytes, check, free


def oproj_runner(gpu, m: int, fp8: bool, rng: np.random.Generator, tc: bool = False):
    heads, n, k = GROUPS, H, GROUP_W
    if fp8:
        q, s = fp8_weights(rng, n, heads * k)
        w = np.ascontiguousarray(q.reshape(n, heads, k).transpose(1, 0, 2))
        arrays, nbytes = [w.view(np.uint8), s], w.nbytes + s.nbytes
    else:
        w = bf16_weights(rng, (heads, n, k))
        arrays, nbytes = [w], w.nbytes
    cp = Copies(gpu, arrays, nbytes)
    x = bf16_weights(rng, (m, heads * k))
    px, py = gpu.alloc(x.nbytes), gpu.alloc(m * heads * n * 4)
    gpu.copy_h2d(px, x)

    def launch(c: int, stream) -> None:
        common = dict(x=px, x_stride=heads * k, y=py, y_stride=heads * n, m=m, heads=heads, n=n, k=k)
        if tc:
            w0 = cp.ptrs[c][0]
            sc = cp.ptrs[c][1] if fp8 else None
            pm.proj_mma_batch(
                gpu, x=px, x_stride=heads * k, x_head=k, segments=[bf.GemvSegment(w=w0, scales=sc, rows=n, col=0)],
                y=py, y_stride=heads * n, y_head=n, heads=heads, m=m, k=k, out_f32=True,
                s_cols=s.shape[1] if fp8 else None, stream=stream,
            )  # fmt: skip
        elif fp8:
            wq, sc = cp.ptrs[c]
            bf.bgemv_fp8_batch(
                gpu, w=wq, scales=sc, scale_cols=s.shape[1], col0=0, out_f32=True, stream=stream, **common
            )
        else:
            bg.bgemv_batch(gpu, w=cp.ptrs[c][0], out_f32=True, stream=stream, **common)

    def check() -> float:
        gpu.memset(py, 0xFF, m * heads * n * 4)
        launch(0, None)
        gpu.synchronize()
        got = np.empty((m, heads, n), np.float32)
        gpu.copy_d2h(got, py)
        assert not np.isnan(got).any(), "unwritten outputs"
        xs = x.reshape(m, heads, k).astype(np.float32)
        if fp8:
            ref = np.stack([bf.fp8_block_dot(xs[:, h], w[h], s, base=h * k) for h in range(heads)], axis=1)
        else:
            ref = np.stack([xs[:, h] @ w[h].astype(np.float32).T for h in range(heads)], axis=1)
        return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))

    def free() -> None:
        cp.free()
        for p in (px, py):
            gpu.free(p)

    return launch, cp.n, nbytes, check, free


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    ap.add_argument(
        "--forms",
        default="cuda-core,tensor-core",
        help="the projections' forms to time (model/kernels/proj_mma.py)",
    )
    args = ap.parse_args()
    forms = [f == "tensor-core" for f in args.forms.split(",")]
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend(pdl=not args.no_pdl)
    ms = [int(v) for v in args.ms.split(",")]
    rng = np.random.default_rng(1)
    print(f"device: {gpu.device_name} ({gpu.sm_count} SMs), PDL {'on' if gpu.pdl else 'off'}")

    fused_bf16 = bf16_weights(rng, (FUSED, H))
    kv, kvs = fp8_weights(rng, 576, H)
    qa, qas = fp8_weights(rng, 1536, H)
    fused_fp8, fused_fp8_s = fp8_weights(rng, FUSED, H)
    fused_cases = {
        "BF16 one segment": [Part(fused_bf16, 0)],
        "BF16 four segments": [
            Part(fused_bf16[a:b], a) for a, b in ((0, 512), (512, 768), (768, 2304), (2304, FUSED))
        ],
        "checkpoint dtypes": [
            Part(kv[:512], 0, kvs),
            Part(fused_bf16[512:768], 512),
            Part(qa, 768, qas),
            Part(fused_bf16[2304:], 2304),
        ],
        "all FP8": [Part(fused_fp8, 0, fused_fp8_s)],
    }
    q_bf16 = bf16_weights(rng, (Q_B + WQ_B, K_Q))
    qb, qbs = fp8_weights(rng, Q_B, K_Q)
    q_cases = {
        "BF16 one segment": [Part(q_bf16, 0)],
        "checkpoint dtypes": [Part(qb, 0, qbs), Part(q_bf16[Q_B:], Q_B)],
    }
    print(
        f"\n{'projection':12s} {'weights':26s} {'m':>3s} {'us':>9s} {'TB/s':>7s} {'MB':>7s}  rel err vs twin (m=1)"
    )
    for title, cases, k, x_stride, x_off, ys in (
        ("fused_in", fused_cases, H, H, 0, FUSED),
        ("q_proj", q_cases, K_Q, FUSED, CTX_ROWS, Q_B + WQ_B),
    ):
        for name, parts in cases.items():
            for tc in forms:
                label = ("TC " if tc else "") + name
                for m in ms:
                    launch, copies, nbytes, check, free = seg_runner(
                        gpu, parts, k, x_stride, x_off, ys, m, tc
                    )
                    err = check() if m in (1, 17) else float("nan")
                    t = time_graph(gpu, launch, copies, args.reps)
                    print(
                        f"{title:12s} {label:26s} {m:3d} {t:9.2f} {nbytes / (t * 1e-6) / 1e12:7.3f} "
                        f"{nbytes / 1e6:7.2f}  {err:.2e}",
                        flush=True,
                    )
                    free()
    for name, fp8 in (("BF16 bgemv_batch", False), ("FP8 bgemv_fp8_batch", True)):
        for tc in forms:
            label = ("TC " + name.split()[0]) if tc else name
            for m in ms:
                launch, copies, nbytes, check, free = oproj_runner(gpu, m, fp8, rng, tc)
                err = check() if m in (1, 17) else float("nan")
                t = time_graph(gpu, launch, copies, args.reps)
                print(
                    f"{'o_proj':12s} {label:26s} {m:3d} {t:9.2f} {nbytes / (t * 1e-6) / 1e12:7.3f} "
                    f"{nbytes / 1e6:7.2f}  {err:.2e}",
                    flush=True,
                )
                free()
    gpu.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
