"""GPU timing of ``indexer_scores_batch`` at 32 and 64 indexer heads of 128 (not a test).

    python3 bench/bench_indexer_scores.py [--iters N] [--json PATH] [--no-warp-path]
    python3 bench/bench_indexer_scores.py --smoke      the same code on the host backend, small

Per-token pools (kpool 1, DeepSeek-V3.2's indexer; GLM-5's 32 heads for comparison) of 163,840 and
262,144 complete pools a row, m = 1 and 64 sequences, each in its own slot (64 slots of 262,144 FP8
keys of 128 bytes and f32 scales: 2.2 GB). For each point: the kernel the launch helper takes (32
heads: indexer_scores_batch's one-group tensor-core path; 64 heads: indexer_scores_batch_mma2's two
groups) and its grid; device microseconds per launch (a graph of REPS back-to-back launches, CUDA
events around each replay, median over ``--iters`` replays, divided by REPS, as bench/bench_reach.py);
the byte floor: ``indexer_score_bytes`` (the pool keys and scales read, the scores written) times m
over the measured device copy bandwidth; and the ratio. Unless ``--no-warp-path``, 64 heads at m = 1
also through the warp-per-pool path (q 2-byte aligned, which the tensor cores refuse), what
DeepSeek-V3.2 ran before the two-group kernel.
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

from model.kernels import dsa_select
from model.kernels.batch import pack_entries
from model.kernels.dsa_select import indexer_score_bytes, scores_mma2_grid, scores_mma_grid, scores_mma_groups
from runtime.dtypes import BF16

DIM = 128
HEADS = (32, 64)
POOLS = (163_840, 262_144)
MS = (1, 64)


def _alloc(gpu: Any, ptrs: dict[str, Any], name: str, nbytes: int) -> Any:
    ptrs[name] = gpu.alloc(max(nbytes, 16))
    return ptrs[name]


def time_points(
    gpu: Any,
    bw: float,
    iters: int,
    heads_list: tuple[int, ...] = HEADS,
    pools_list: tuple[int, ...] = POOLS,
    ms: tuple[int, ...] = MS,
    warp_path: bool = True,
) -> list[dict[str, Any]]:
    """Every (heads, pools, m) point; slots sized for the largest pools and m, filled once."""
    from bench.bench_reach import _graph_us

    rng = np.random.default_rng(7)
    slots, slot_max = max(ms), max(pools_list)
    hmax = max(heads_list)
    ptrs: dict[str, Any] = {}
    out: list[dict[str, Any]] = []
    try:
        keys = _alloc(gpu, ptrs, "keys", slots * slot_max * DIM)
        chunk = rng.integers(0, 256, slot_max * DIM, dtype=np.uint8) & np.uint8(0xBF)  # finite, below 2
        for s in range(slots):  # one slot's random bytes everywhere: far past L2, so no reuse shows
            gpu.copy_h2d(keys.offset(s * slot_max * DIM), chunk)
        scales = _alloc(gpu, ptrs, "scales", slots * slot_max * 4)
        gpu.copy_h2d(scales, (0.01 + 0.01 * rng.random(slots * slot_max)).astype(np.float32))
        # q of every sequence, and a copy 2 bytes further on: rows the tensor cores refuse.
        qv = rng.standard_normal(slots * hmax * DIM + 1).astype(np.float32).astype(BF16)
        q = _alloc(gpu, ptrs, "q", qv.nbytes + 16)
        gpu.copy_h2d(q, qv)
        w = _alloc(gpu, ptrs, "w", slots * hmax * 2)
        gpu.copy_h2d(w, rng.standard_normal(slots * hmax).astype(np.float32).astype(BF16))
        _alloc(gpu, ptrs, "scores", slots * slot_max * 4)
        _alloc(gpu, ptrs, "entries", slots * 16)
        s = gpu.create_stream()
        try:
            for heads in heads_list:
                for npools in pools_list:
                    for m in ms:
                        paths = [("tensor cores", 0)]
                        if warp_path and heads > 32 and m == 1:
                            paths.append(("warp per pool", 2))
                        for label, q_off in paths:
                            out.append(
                                _point(gpu, bw, iters, s, _graph_us, ptrs, heads, npools, m, q_off, label)
                            )
        finally:
            gpu.destroy_stream(s)
    finally:
        for p in ptrs.values():
            gpu.free(p)
    return out


def _point(
    gpu: Any, bw: float, iters: int, s: int, graph_us, ptrs: dict[str, Any], heads: int, npools: int, m: int,
    q_off: int, label: str,
) -> dict[str, Any]:  # fmt: skip
    slot_rows = npools  # kpool 1: a slot of exactly the row's pools, the row its last
    gpu.copy_h2d(ptrs["entries"], pack_entries(list(range(m)), [npools - 1] * m, [0] * m))
    q = ptrs["q"].offset(q_off)
    groups = scores_mma_groups(heads, DIM, q, heads * DIM, ptrs["keys"])
    grid = (
        scores_mma2_grid(m, npools)
        if groups == 2
        else scores_mma_grid(m, npools)
        if groups == 1
        else dsa_select.scores_batch_grid(m, npools)
    )

    def body(st: int) -> None:
        dsa_select.indexer_scores_batch(
            gpu, q=q, q_stride=heads * DIM, w=ptrs["w"], w_stride=heads, pool_keys=ptrs["keys"],
            pool_scales=ptrs["scales"], scores=ptrs["scores"], entries=ptrs["entries"], m=m, row_add=0,
            slot_rows=slot_rows, heads=heads, dim=DIM, kpool=1, w_scale=1.0 / heads**0.5, stream=st,
        )  # fmt: skip

    gpu.memset(ptrs["scores"], 0xFF, m * npools * 4)  # NaN: a score left unwritten shows
    us = graph_us(gpu, s, body, iters, f"indexer {heads}h {npools} x {m}")
    got = np.empty(m * npools, np.float32)
    gpu.copy_d2h(got, ptrs["scores"])
    nbytes = m * indexer_score_bytes(npools, DIM)
    floor_us = nbytes / bw * 1e6
    row = {
        "heads": heads,
        "pools": npools,
        "m": m,
        "path": label,
        "groups": groups,
        "grid": list(grid),
        "us": us,
        "MB": nbytes / 1e6,
        "floor_us": floor_us,
        "x_floor": us / floor_us,
        "scores_finite": bool(np.isfinite(got).all()),
    }
    print(
        f"{heads:>5} {npools:>8} {m:>3}  {label:<13} {groups:>2}  {grid[0]:>3} x {grid[1]:<3} {us:>10.1f} "
        f"{nbytes / 1e6:>8.1f} {floor_us:>9.1f} {us / floor_us:>6.2f}  {row['scores_finite']}",
        flush=True,
    )
    return row


HEADER = (
    "heads    pools   m  path          G  grid         us/launch       MB  floor us  x floor  finite\n"
    "----- -------- ---  ------------- --  ---------  ----------  -------  --------  -------  ------"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30, help="timed replays per point (median)")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    ap.add_argument("--no-warp-path", dest="warp_path", action="store_false", help="skip the CUDA-core path")
    ap.add_argument(
        "--smoke", action="store_true", help="the host backend at small sizes (checks the script)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        from runtime.host_backend import HostBackend

        gpu: Any = HostBackend()
        bw, pools, ms, iters = 1e9, (40, 1000), (1, 3), 2
    else:
        from bench.bench_propose import copy_bandwidth
        from runtime.cuda_backend import CudaBackend

        gpu = CudaBackend()
        bw, pools, ms, iters = copy_bandwidth(gpu), POOLS, MS, args.iters
    try:
        name = getattr(gpu, "device_name", gpu.name)
        print(f"device {name}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
        print(HEADER, flush=True)
        res = {
            "device": name,
            "copy_bw_GBps": bw / 1e9,
            "points": time_points(gpu, bw, iters, HEADS, pools, ms, args.warp_path),
        }
    finally:
        if hasattr(gpu, "close"):  # the host backend has nothing to close
            gpu.close()
    if not all(r["scores_finite"] for r in res["points"]):
        print("some scores were not finite: a launch left scores unwritten", flush=True)
        return 1
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
