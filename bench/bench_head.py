"""GPU timing of the FP8 draft head on tensor cores alone, at GLM-5.3-Flash's shapes (not a test).

    python3 bench/bench_head.py [--iters N] [--ms 1,4,16,64,128,256] [--no-v1] [--json PATH]
    python3 bench/bench_head.py --smoke      the same code on the host backend, small

The head: vocabulary 154,880 rows of hidden 4096 FP8 E4M3 weights (random codes, no NaN code) with
one f32 scale a row, times m rows of BF16 x, the argmax and commit of every row (all live). For
each m and kernel (``head_argmax_fp8_mma``, and ``head_argmax_fp8_mma_v1``, the kernel it replaced,
unless ``--no-v1``), through ``head_argmax_batch_mma``'s launch: device microseconds per launch (a
graph of REPS back-to-back launches, captured as the proposer captures its drafts, CUDA events
around each replay, median over ``--iters`` replays, divided by REPS, as bench/bench_reach.py);
TFLOP/s (2 m n k per launch); the byte floor (the weights and scales read, x read, the BF16
logits written) over the device copy bandwidth measured in the same run; and the ratio. After the
timing, each m's logits and drafts of the two kernels are compared byte for byte ("same bits": they
must be, the kernels run the same MMAs in the same order) and every logit is checked finite.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: find model/ and runtime/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from model.config import glm5_flash
from model.kernels import draft_head
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16

MS = (1, 4, 16, 64, 128, 256)
KERNELS = ("head_argmax_fp8_mma", "head_argmax_fp8_mma_v1")
KMAX = 4  # drafts a row holds; the head commits draft 0


def head_bytes(m: int, n: int, k: int) -> int:
    """What a launch must move at least: the FP8 weights and f32 scales, x, the BF16 logits."""
    return n * k + 4 * n + 2 * m * k + 2 * m * n


def _alloc(gpu: Any, ptrs: dict[str, Any], name: str, nbytes: int) -> Any:
    ptrs[name] = gpu.alloc(max(nbytes, 16))
    return ptrs[name]


def _fill_weights(gpu: Any, ptr: Any, n: int, k: int, rng: np.random.Generator) -> None:
    """Random E4M3 codes but the NaN codes 0x7F / 0xFF (a quantised head never holds them), one
    chunk of rows repeated over the head (far past L2, so no reuse shows)."""
    rows = min(n, max(1, (64 << 20) // k))
    chunk = rng.integers(0, 256, rows * k, dtype=np.uint8)
    chunk[(chunk & 0x7F) == 0x7F] &= 0xFE
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        gpu.copy_h2d(ptr.offset(r0 * k), chunk[: (r1 - r0) * k])


def time_points(
    gpu: Any, bw: float, iters: int, n: int, k: int, ms: tuple[int, ...], kernels: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Every (m, kernel) point over one resident head; buffers sized for the largest m."""
    from bench.bench_reach import _graph_us

    rng = np.random.default_rng(11)
    mmax = max(ms)
    ptrs: dict[str, Any] = {}
    out: list[dict[str, Any]] = []
    try:
        wq = _alloc(gpu, ptrs, "wq", n * k)
        _fill_weights(gpu, wq, n, k, rng)
        scale = _alloc(gpu, ptrs, "scale", 4 * n)
        gpu.copy_h2d(scale, (2.0 ** rng.uniform(-9, -7, n)).astype(np.float32))
        x = _alloc(gpu, ptrs, "x", 2 * mmax * k)
        gpu.copy_h2d(x, rng.standard_normal((mmax, k)).astype(BF16))
        for name, nbytes in (
            ("logits", 2 * mmax * n),
            ("keys", 8 * mmax),
            ("counter", 4),
            ("entries", 16 * mmax),
            ("drafts", 4 * mmax * KMAX),
            ("host", 4 * mmax * KMAX),
            ("flags", 4 * mmax),
        ):
            _alloc(gpu, ptrs, name, nbytes)
        s = gpu.create_stream()
        try:
            for m in ms:
                got: dict[str, bytes] = {}
                for kernel in kernels:
                    row, got[kernel] = _point(gpu, bw, iters, s, _graph_us, ptrs, m, n, k, kernel)
                    out.append(row)
                same = len(set(got.values())) == 1
                for row in out[-len(kernels) :]:
                    row["same_bits"] = same
                print(
                    f"m={m}: the kernels' logits and drafts are {'the same' if same else 'DIFFERENT'}",
                    flush=True,
                )
        finally:
            gpu.destroy_stream(s)
    finally:
        for p in ptrs.values():
            gpu.free(p)
    return out


def _point(
    gpu: Any,
    bw: float,
    iters: int,
    s: int,
    graph_us,
    ptrs: dict[str, Any],
    m: int,
    n: int,
    k: int,
    kernel: str,
) -> tuple[dict[str, Any], bytes]:
    """One kernel at one m: its row of the table, and its logits and drafts (for the comparison)."""
    v1 = kernel == "head_argmax_fp8_mma_v1"
    gpu.memset(ptrs["keys"], 0, 8 * m)
    gpu.memset(ptrs["counter"], 0, 4)
    gpu.memset(ptrs["flags"], 0, 4 * m)
    gpu.memset(ptrs["logits"], 0xFF, 2 * m * n)  # NaN: a logit left unwritten shows
    gpu.copy_h2d(ptrs["entries"], pack_entries(list(range(m)), [0] * m, [0] * m))

    def body(st: int) -> None:
        draft_head.head_argmax_batch_mma(
            gpu, w=ptrs["wq"], scale=ptrs["scale"], x=ptrs["x"], logits=ptrs["logits"], keys=ptrs["keys"],
            counter=ptrs["counter"], entries=ptrs["entries"], drafts=ptrs["drafts"], draft_index=0, kmax=KMAX,
            host_drafts=ptrs["host"], publish=True, m=m, n=n, k=k, flags=ptrs["flags"], flag_byte=0, stream=st,
            v1=v1,
        )  # fmt: skip

    grid, smem, tiles = draft_head.head_mma_launch(gpu, m, n, k, v1)
    us = graph_us(gpu, s, body, iters, f"{kernel} m={m}")
    logits = np.empty(m * n, np.uint16)
    gpu.copy_d2h(logits, ptrs["logits"])
    drafts = np.empty(m * KMAX, np.uint32)
    gpu.copy_d2h(drafts, ptrs["drafts"])
    finite = bool(np.isfinite(logits.view(BF16).astype(np.float32)).all())
    nbytes = head_bytes(m, n, k)
    floor_us = nbytes / bw * 1e6
    tflops = 2 * m * n * k / (us * 1e-6) / 1e12
    row = {
        "m": m,
        "kernel": kernel,
        "grid": grid,
        "tiles": tiles,
        "smem": smem,
        "us": us,
        "TFLOPs": tflops,
        "MB": nbytes / 1e6,
        "floor_us": floor_us,
        "x_floor": us / floor_us,
        "logits_finite": finite,
    }
    print(
        f"{m:>4}  {kernel:<24} {grid:>5} {tiles:>5} {smem:>7} {us:>10.1f} {tflops:>8.1f} {nbytes / 1e6:>8.1f} "
        f"{floor_us:>9.1f} {us / floor_us:>7.2f}  {finite}",
        flush=True,
    )
    return row, logits.tobytes() + drafts[0::KMAX].tobytes()


HEADER = (
    "   m  kernel                    grid tiles    smem  us/launch  TFLOP/s       MB  floor us  x floor  finite\n"
    "----  ------------------------ ----- ----- ------- ---------- -------- -------- --------- -------  ------"
)


def _summary(points: list[dict[str, Any]]) -> None:
    """v1's time over the new kernel's at each m (the speed-up), where both ran."""
    by = {(p["m"], p["kernel"]): p for p in points}
    for m in sorted({p["m"] for p in points}):
        new, old = by.get((m, KERNELS[0])), by.get((m, KERNELS[1]))
        if new and old:
            print(
                f"m={m:>4}: v1 {old['us']:.1f} us, new {new['us']:.1f} us: {old['us'] / new['us']:.2f}x",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30, help="timed replays per point (median)")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x, comma-separated")
    ap.add_argument("--no-v1", dest="v1", action="store_false", help="time head_argmax_fp8_mma only")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    ap.add_argument(
        "--smoke", action="store_true", help="the host backend at small sizes (checks the script)"
    )
    args = ap.parse_args(argv)
    kernels = KERNELS if args.v1 else KERNELS[:1]
    if args.smoke:
        from runtime.host_backend import HostBackend

        gpu: Any = HostBackend()
        bw, n, k, ms, iters = 1e9, 300, 256, (1, 3), 2
    else:
        from bench.bench_propose import copy_bandwidth
        from runtime.cuda_backend import CudaBackend

        cfg = glm5_flash()
        gpu = CudaBackend()
        bw, n, k, ms, iters = copy_bandwidth(gpu), cfg.vocab_size, cfg.hidden_size, args.ms, args.iters
        ms = tuple(int(v) for v in ms.split(","))
    try:
        name = getattr(gpu, "device_name", gpu.name)
        print(
            f"device {name}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write); head {n} x {k} FP8",
            flush=True,
        )
        print(HEADER, flush=True)
        points = time_points(gpu, bw, iters, n, k, ms, kernels)
        _summary(points)
        res = {"device": name, "copy_bw_GBps": bw / 1e9, "n": n, "k": k, "points": points}
    finally:
        if hasattr(gpu, "close"):  # the host backend has nothing to close
            gpu.close()
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    if not all(p["logits_finite"] and p.get("same_bits", True) for p in points):
        print("a launch left a logit unwritten, or the kernels' bits differ", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
