"""Host CPU time of a graph-replayed ``propose_batch`` with the device's part taken away (issue 15:
at most 60 us at B = 64).

The proposer is the product's, graphs on, over ``FreeReplayBackend``: the host backend (the shipped
tiny checkpoint) whose graph replays and device-to-device copies, once ``stubbed`` is set, keep the
pointer and graph checks the CUDA backend makes before its driver call and do nothing else. Each
bucket's graph is captured and replayed for real first; then only the proposer's Python path of a
replayed propose is left to time, and its drafts are those of the real replay (the mapped memory
keeps them), which the run checks.

Per B (1, 16, 64, 256 by default): B sequences at ragged contexts, ``propose_batch`` at the same
positions call after call (every sequence rewound by k each time, as bench/bench_batch.py times
it), median over ``iters`` calls of the proposer's own ``last_host_s`` (what bench_batch reports
as "host CPU us"), of perf_counter around the call (the lock and the argument handling
``last_host_s`` starts after included) and of thread_time around it. The target's hidden rows
are a DevicePtr (as bench_batch passes them), or with ``--hidden array`` an object exposing only
``__cuda_array_interface__`` (what an engine's tensor offers; the tensor's own cost of building
the interface is not in it). ``--profile B`` prints cProfile's functions by own time over the
calls at that B.

    python bench/bench_host_overhead.py [--batches 1,16,64,256] [--iters 3000] [--hidden array]
        [--profile 64]
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

if not __package__:  # run as a script (python bench/bench_host_overhead.py): find bench/, model/, runtime/
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402 - after the sys.path insert

from model.checkpoint import Checkpoint, mtp_tensors  # noqa: E402
from model.cli import DEFAULT_CHECKPOINT  # noqa: E402
from model.proposer import MtpProposer, ProposerOptions  # noqa: E402
from runtime.device_ptr import DevicePtr  # noqa: E402
from runtime.dtypes import BF16  # noqa: E402
from runtime.external import BF16_TYPESTRS  # noqa: E402
from runtime.graph import Graph  # noqa: E402
from runtime.host_backend import HostBackend  # noqa: E402

BATCHES = (1, 16, 64, 256)
CONTEXTS = (4, 24)  # each sequence's cached rows, spread over this range
K = 3


class FreeReplayBackend(HostBackend):
    """With ``stubbed`` set, a graph replay and a device-to-device copy cost what the CUDA backend's
    Python costs before its driver call (the ledger's checks), and the device work is skipped."""

    stubbed = False
    replays = 0

    def graph_launch(self, graph: Graph, stream: int | None = None) -> None:
        if not self.stubbed:
            super().graph_launch(graph, stream)
            return
        self._ledger.replay(graph)
        self.replays += 1

    def copy_d2d(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: int | None = None) -> None:
        if not self.stubbed:
            super().copy_d2d(dst, src, nbytes, stream)
            return
        self._ledger.touch(dst, nbytes)
        self._ledger.touch(src, nbytes)


class DeviceArray:
    """BF16 rows of another library, as the proposer sees them: only ``__cuda_array_interface__``."""

    def __init__(self, ptr: DevicePtr, rows: int, width: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (rows, width),
            "typestr": BF16_TYPESTRS[0],
            "data": (ptr.addr, False),
            "strides": None,
            "version": 3,
        }


def build(gpu: HostBackend, max_sequences: int, k: int = K) -> MtpProposer:
    """The tiny checkpoint's drafter for ``max_sequences`` sequences, graphs on."""
    ckpt = Checkpoint(DEFAULT_CHECKPOINT)
    cfg = ckpt.config
    opts = ProposerOptions(
        served_max_seq_len=CONTEXTS[1] + 2 * k + 1,
        max_draft_tokens=k,
        max_sequences=max_sequences,
        use_graphs=True,
    )
    return MtpProposer(gpu, cfg, mtp_tensors(ckpt, cfg), opts)


def measure(
    prop: MtpProposer,
    gpu: FreeReplayBackend,
    B: int,
    iters: int,
    rng: np.random.Generator,
    *,
    k: int = K,
    hidden_as: str = "pointer",
    profile: Callable[[Callable[[], Any]], None] | None = None,
) -> dict[str, Any]:
    """One row: B fresh states filled to ragged contexts by ``catchup_batch``, the bucket's graph
    captured and replayed for real, then ``iters`` stubbed replays timed (medians, in us). The
    states are freed at the end."""
    H, V = prop.cfg.hidden_size, prop.cfg.vocab_size
    ctx = [int(c) for c in rng.integers(CONTEXTS[0], CONTEXTS[1] + 1, B)]
    states = [prop.alloc_state() for _ in range(B)]
    bufs: list[DevicePtr] = []
    try:
        for n in ctx:
            bufs.append(gpu.alloc(n * H * 2))
            gpu.copy_h2d(bufs[-1], rng.standard_normal((n, H)).astype(BF16))
        tokens = [[int(t) for t in rng.integers(0, V, n + 1)] for n in ctx]
        prop.catchup_batch(states, tokens, bufs, [0] * B)
        hidden = gpu.alloc(B * H * 2)
        bufs.append(hidden)
        gpu.copy_h2d(hidden, rng.standard_normal((B, H)).astype(BF16))
        arg = hidden if hidden_as == "pointer" else DeviceArray(hidden, B, H)
        last = [int(t) for t in rng.integers(0, V, B)]
        gpu.stubbed = False
        real = prop.propose_batch(states, last, arg, ctx, k)  # captures and replays the graph
        key = (next(m for m in prop.buckets if m >= B), k)
        if key not in prop.captured_graphs:
            raise AssertionError(f"no graph {key} after a propose of {B} with graphs on")
        gpu.stubbed, gpu.replays = True, 0
        call = lambda: prop.propose_batch(states, last, arg, ctx, k)  # noqa: E731
        for _ in range(min(iters, 200)):  # warm caches and the allocator
            drafts = call()
        if not np.array_equal(drafts, real):
            raise AssertionError("a stubbed replay returned other drafts than the real one")
        host, wall, cpu = [], [], []
        gc.collect()
        for _ in range(iters):
            c0, t0 = time.thread_time(), time.perf_counter()
            call()
            t1, c1 = time.perf_counter(), time.thread_time()
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
            host.append(states[0].last_host_s)
        if gpu.replays != min(iters, 200) + iters:
            raise AssertionError(f"{gpu.replays} graph replays for {min(iters, 200) + iters} proposes")
        if profile is not None:
            profile(call)
        return {
            "B": B,
            "bucket": key[0],
            "hidden": hidden_as,
            "k": k,
            "host_us": statistics.median(host) * 1e6,
            "wall_us": statistics.median(wall) * 1e6,
            "thread_us": statistics.median(cpu) * 1e6,
            "wall_p90_us": float(np.percentile(wall, 90)) * 1e6,
        }
    finally:
        gpu.stubbed = False
        for st in states:
            prop.free_state(st)
        for p in bufs:
            gpu.free(p)


def profiler(iters: int, top: int, out: Callable[[str], Any] = print) -> Callable[[Callable[[], Any]], None]:
    def run(call: Callable[[], Any]) -> None:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(iters):
            call()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
        out(s.getvalue())

    return run


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| B | bucket | k | hidden | last_host_s us | wall us | thread_time us | wall p90 us |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['bucket']} | {r['k']} | {r['hidden']} | {r['host_us']:.1f} | {r['wall_us']:.1f} | "
            f"{r['thread_us']:.1f} | {r['wall_p90_us']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        description="host CPU time of a graph-replayed propose_batch, device stubbed"
    )
    ap.add_argument("--batches", type=lambda s: tuple(int(v) for v in s.split(",")), default=BATCHES)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--k", type=int, default=K)
    ap.add_argument("--hidden", choices=("pointer", "array"), default="pointer")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the proposes at this B")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gpu = FreeReplayBackend()
    prop = build(gpu, max(args.batches), args.k)
    rng = np.random.default_rng(args.seed)
    rows = []
    try:
        for B in args.batches:
            prof = profiler(args.iters, args.profile_top) if B == args.profile else None
            rows.append(measure(prop, gpu, B, args.iters, rng, k=args.k, hidden_as=args.hidden, profile=prof))
            r = rows[-1]
            print(
                f"B {B:>3}: last_host_s {r['host_us']:.1f} us, wall {r['wall_us']:.1f} us, "
                f"thread_time {r['thread_us']:.1f} us",
                file=sys.stderr,
            )
    finally:
        prop.close()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
