#!/usr/bin/env python3
"""Time the batched MoE's expert projections with BF16 experts (moe_gate_up_batch + moe_down_batch)
against FP8 E4M3 experts with 128 x 128 block scales (moe_gate_up_fp8_batch + moe_down_fp8_batch,
issue 18) at the GLM-5.3-Flash shape: 288 routed experts, top-8 plus one shared expert, hidden
4096, intermediate 2048; m = 1, 16, 64, 256 entries routed uniformly at random (each row 8
distinct experts), the group workspace built by the grouping's host twin.

Per m and kind: device microseconds of gate/up, of down and of the two back to back (median of
event-timed repetitions queued behind a running launch, bench_runtime.time_device), the distinct
routed experts the batch reads, the weight bytes that implies (each distinct expert and the shared
expert once; FP8 counts its scales too; activations and outputs are under 1% and left out), the
effective TB/s (those bytes over the time) and the ratio to the copy-bandwidth floor.

    PYTHONUNBUFFERED=1 python3 bench/sweep_moe_fp8.py [--batches 1,16,64,256] [--reps 20]

The stacks hold random values (FP8: every code but NaN; BF16: finite), replicated from a 64 MB
random block on the device (values do not change the speed of these kernels).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from batch_moe_util import MoeCase, group_words, random_ids  # noqa: E402 - after the sys.path insert

from bench.bench_propose import copy_bandwidth  # noqa: E402
from bench.bench_runtime import time_device  # noqa: E402
from model.kernels import moe  # noqa: E402
from model.kernels.batch import pack_entries  # noqa: E402
from runtime.dtypes import BF16  # noqa: E402

CHUNK = 64 << 20


@dataclass(frozen=True)
class Shape:
    experts: int = 288
    hidden: int = 4096
    inter: int = 2048
    topk: int = 8


GLM = Shape()


def fill(gpu, ptr, nbytes: int, rng: np.random.Generator, fp8: bool) -> None:
    """nbytes of random weights at ptr: one random block copied over the whole range."""
    n = min(CHUNK, nbytes)
    if fp8:
        block = np.frombuffer(rng.bytes(n), np.uint8).copy()
        block[(block & 0x7F) == 0x7F] ^= 1  # no NaN codes
    else:
        r = np.frombuffer(rng.bytes(n), np.uint16)
        block = (
            (r & np.uint16(0x807F)) | ((((r >> 7) & np.uint16(7)) + np.uint16(127 - 8)) << np.uint16(7))
        ).view(np.uint8)
    gpu.copy_h2d(ptr, block)
    done = n
    while done < nbytes:
        step = min(done, nbytes - done)
        gpu.copy_d2d(ptr.offset(done), ptr, step)
        done += step


class Stacks:
    """Device stacks of both kinds, routed and shared, at ``shape``."""

    def __init__(self, gpu, rng: np.random.Generator, shape: Shape = GLM) -> None:
        self.gpu, self.shape = gpu, shape
        E, H, INTER = shape.experts, shape.hidden, shape.inter
        gu16, dn16 = 2 * INTER * H * 2, H * INTER * 2
        gu8, dn8 = 2 * INTER * H, H * INTER
        gus = 4 * int(np.prod(moe.gate_up_scale_shape(1, INTER, H)))
        dns = 4 * int(np.prod(moe.down_scale_shape(1, H, INTER)))
        self.bytes16 = (gu16, dn16)
        self.bytes8 = (gu8 + gus, dn8 + dns)
        self.ptrs = []

        def alloc(n: int, fp8: bool | None):
            p = gpu.alloc(n)
            self.ptrs.append(p)
            if fp8 is None:  # scales: positive, about 2**-11
                s = (2.0**-11 * (0.5 + rng.random(n // 4))).astype(np.float32)
                gpu.copy_h2d(p, s)
            else:
                fill(gpu, p, n, rng, fp8)
            return p

        self.gu16, self.dn16 = alloc(E * gu16, False), alloc(E * dn16, False)
        self.sgu16, self.sdn16 = alloc(gu16, False), alloc(dn16, False)
        self.gu8, self.dn8 = alloc(E * gu8, True), alloc(E * dn8, True)
        self.gu8s, self.dn8s = alloc(E * gus, None), alloc(E * dns, None)
        self.sgu8, self.sdn8 = alloc(gu8, True), alloc(dn8, True)
        self.sgu8s, self.sdn8s = alloc(gus, None), alloc(dns, None)

    def free(self) -> None:
        for p in self.ptrs:
            self.gpu.free(p)


def run_m(gpu, st: Stacks, m: int, rng: np.random.Generator, reps: int, bw: float) -> list[str]:
    """The table rows of batch size m (one per kind), printed as they come."""
    E, H, INTER, TOPK = st.shape.experts, st.shape.hidden, st.shape.inter, st.shape.topk
    case = MoeCase(E, 0, INTER, H, TOPK, moe.SHARED_HERE)
    ns = case.nslots
    ent = pack_entries(list(range(m)), list(range(m)), [0] * m)
    ids = random_ids(rng, m, case, E)
    wts = (rng.random((m, ns)) + 0.1).astype(np.float32)
    wts[:, TOPK] = 1.0
    y = (rng.standard_normal((m, H)) * 0.5).astype(BF16)
    distinct = len(np.unique(ids[:, :TOPK]))
    bufs = {
        "ent": ent,
        "y": y,
        "wts": wts,
        "grp": group_words(ids, ent, TOPK, ns, 0, E).view(np.uint32),
    }
    p = {}
    for k, a in bufs.items():
        p[k] = gpu.alloc(a.nbytes)
        gpu.copy_h2d(p[k], np.ascontiguousarray(a))
    p["act"] = gpu.alloc(m * ns * INTER * 2)
    p["parts"] = gpu.alloc(m * ns * H * 4)
    common = dict(entries=p["ent"], m=m, ntopk=TOPK, n_local=E, shared=moe.SHARED_HERE)

    def gu16():
        moe.moe_gate_up_batch(
            gpu, w=st.gu16, w_shared=st.sgu16, y=p["y"], group=p["grp"], act=p["act"], inter=INTER, h=H, limit=7.0,
            **common,
        )  # fmt: skip

    def dn16():
        moe.moe_down_batch(
            gpu, w=st.dn16, w_shared=st.sdn16, act=p["act"], weights=p["wts"], group=p["grp"], parts=p["parts"], h=H,
            inter=INTER, **common,
        )  # fmt: skip

    def gu8():
        moe.moe_gate_up_fp8_batch(
            gpu, w=st.gu8, w_scale=st.gu8s, w_shared=st.sgu8, w_shared_scale=st.sgu8s, y=p["y"], group=p["grp"],
            act=p["act"], inter=INTER, h=H, limit=7.0, **common,
        )  # fmt: skip

    def dn8():
        moe.moe_down_fp8_batch(
            gpu, w=st.dn8, w_scale=st.dn8s, w_shared=st.sdn8, w_shared_scale=st.sdn8s, act=p["act"],
            weights=p["wts"], group=p["grp"], parts=p["parts"], h=H, inter=INTER, **common,
        )  # fmt: skip

    lines = []
    try:
        for kind, g, d, (bg, bd) in (("bf16", gu16, dn16, st.bytes16), ("fp8", gu8, dn8, st.bytes8)):
            tg = time_device(gpu, g, reps)
            td = time_device(gpu, d, reps)
            tb = time_device(gpu, lambda g=g, d=d: (g(), d()), reps)
            out = np.empty((m * ns, H), np.float32)
            gpu.synchronize()
            gpu.copy_d2h(out, p["parts"])
            assert np.isfinite(out).all(), f"{kind} m={m}: non-finite parts"
            nb = (distinct + 1) * (bg + bd)  # the distinct routed experts and the shared one
            floor_us = nb / bw * 1e6
            lines.append(
                f"| {m} | {kind} | {distinct} | {tg * 1e3:.1f} | {td * 1e3:.1f} | {tb * 1e3:.1f} | "
                f"{nb / 1e6:.3f} | {nb / (tb * 1e-3) / 1e12:.2f} | {tb * 1e3 / floor_us:.2f} |"
            )
            print(lines[-1], flush=True)
    finally:
        for v in p.values():
            gpu.free(v)
    return lines


HEADER = (
    "| m | experts | distinct routed | gate/up us | down us | both us | weight MB | effective TB/s | x floor |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    rng = np.random.default_rng(args.seed)
    bw = copy_bandwidth(gpu)  # bytes read + written per second: the floor's bandwidth, as bench_batch's
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + written): the floor")
    st = Stacks(gpu, rng)
    try:
        print(HEADER)
        for m in (int(v) for v in args.batches.split(",")):
            run_m(gpu, st, m, rng, args.reps, bw)
    finally:
        st.free()
        gpu.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
