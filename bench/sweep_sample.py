#!/usr/bin/env python3
"""µs per draft_sample_batch launch (model/kernels/draft_sample.py) at the GLM-5.3-Flash vocabulary,
for m = 1, 16, 64, 256 entries and the records greedy (all entries), temperature only, top-k 50 and
top-p 0.95, each without and with the full distribution written:

    python3 bench/sweep_sample.py [--n 154880] [--iters 50] [--kernels]

Random BF16 logits (normal, standard deviation 2; --flat: 0.5, where top-p 0.95 keeps most of the
row and the draw's pruning skips nothing), every entry live, one seed per entry. Timed with events
around ``iters`` back-to-back launches after a warm-up (the logits stay in L2 between launches, as
they are after the head). --kernels also times each of the four kernels alone (events between them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model.kernels import draft_sample as ds  # noqa: E402
from model.kernels.batch import pack_entries  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from runtime.dtypes import BF16  # noqa: E402

RECORDS = {
    "greedy": SamplingParams(),
    "temperature 1": SamplingParams(temperature=1.0),
    "top-k 50": SamplingParams(temperature=1.0, top_k=50),
    "top-p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
}


class _Setup:
    """The buffers of one (m, n, record) measurement."""

    def __init__(self, gpu, m: int, n: int, params: SamplingParams, dist: bool, spread: float, kmax: int = 4):
        rng = np.random.default_rng(0)
        bits = (rng.standard_normal((m, n)) * spread).astype(BF16)
        heads = np.argmax(bits.astype(np.float32), axis=1).astype(np.uint32)
        self.gpu, self.m, self.n, self.kmax = gpu, m, n, kmax
        self.allocs = []
        self.dist = self._alloc(m * kmax * n * 4) if dist else None
        recs = np.stack(
            [
                ds.pack_sampling(
                    SamplingParams(params.temperature, params.top_p, params.top_k, 1000 + e),
                    17 + e,
                    self.dist.addr + e * kmax * n * 4 if dist else 0,
                )
                for e in range(m)
            ]
        )
        drafts = np.zeros((m, kmax), np.uint32)
        drafts[:, 1] = heads
        self.logits = self._put(bits)
        self.sampling = self._put(recs)
        self.entries = self._put(pack_entries(list(range(m)), [0] * m, heads.tolist()))
        self.drafts = self._put(drafts)
        self.probs = self._alloc(m * kmax * 4)
        wsb = ds.sample_workspace_bytes(m, n)
        self.ws = self._alloc(wsb)
        gpu.memset(self.ws, 0, wsb)
        self.hd, self.hp = gpu.alloc_mapped(m * kmax * 4), gpu.alloc_mapped(m * kmax * 4)

    def _alloc(self, nbytes: int):
        p = self.gpu.alloc(nbytes)
        self.allocs.append(p)
        return p

    def _put(self, arr: np.ndarray):
        p = self._alloc(arr.nbytes)
        self.gpu.copy_h2d(p, np.ascontiguousarray(arr))
        return p

    def launch(self, stream=None) -> None:
        ds.draft_sample_batch(
            self.gpu,
            logits=self.logits,
            sampling=self.sampling,
            entries=self.entries,
            drafts=self.drafts,
            probs=self.probs,
            host_drafts=self.hd.device,
            host_probs=self.hp.device,
            draft_index=1,
            kmax=self.kmax,
            publish=True,
            m=self.m,
            n=self.n,
            workspace=self.ws,
            stream=stream,
        )

    def close(self) -> None:
        for p in self.allocs:
            self.gpu.free(p)
        self.gpu.free_mapped(self.hd)
        self.gpu.free_mapped(self.hp)


def time_sample(
    gpu, m: int, n: int, params: SamplingParams, dist: bool, iters: int = 50, spread: float = 2.0
) -> float:
    """Mean µs per draft_sample_batch over ``iters`` launches (after three warm-up launches)."""
    s = _Setup(gpu, m, n, params, dist, spread)
    try:
        for _ in range(3):
            s.launch()
        gpu.synchronize()
        a, b = gpu.event_create(), gpu.event_create()
        gpu.event_record(a)
        for _ in range(iters):
            s.launch()
        gpu.event_record(b)
        gpu.synchronize()
        us = 1000.0 * gpu.event_elapsed_ms(a, b) / iters
        gpu.event_destroy(a)
        gpu.event_destroy(b)
        return us
    finally:
        s.close()


def time_kernels(
    gpu, m: int, n: int, params: SamplingParams, dist: bool, iters: int = 20, spread: float = 2.0
) -> list[float]:
    """Mean µs of each of the four launches (events recorded between them)."""
    s = _Setup(gpu, m, n, params, dist, spread)
    real_launch = ds.launch
    marks: list = []

    def marked(*args, **kw):
        real_launch(*args, **kw)
        ev = gpu.event_create()
        gpu.event_record(ev)
        marks.append(ev)

    try:
        s.launch()
        gpu.synchronize()
        totals = [0.0] * 4
        ds.launch = marked
        for _ in range(iters):
            start = gpu.event_create()
            gpu.event_record(start)
            marks.clear()
            s.launch()
            gpu.synchronize()
            prev = start
            for k, ev in enumerate(marks):
                totals[k] += 1000.0 * gpu.event_elapsed_ms(prev, ev)
                prev = ev
            for ev in (start, *marks):
                gpu.event_destroy(ev)
        return [t / iters for t in totals]
    finally:
        ds.launch = real_launch
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=154880)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--flat", action="store_true", help="logits of standard deviation 0.5 instead of 2")
    ap.add_argument("--kernels", action="store_true", help="also time each kernel alone")
    args = ap.parse_args()

    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    spread = 0.5 if args.flat else 2.0
    print(f"draft_sample_batch, n = {args.n}, logits N(0, {spread}^2); µs per launch (mean of {args.iters})")
    print(f"{'record':<16}{'dist':<6}" + "".join(f"{'m=' + str(m):>12}" for m in args.ms))
    for name, p in RECORDS.items():
        for dist in (False, True):
            row = [time_sample(gpu, m, args.n, p, dist, args.iters, spread) for m in args.ms]
            print(f"{name:<16}{'yes' if dist else 'no':<6}" + "".join(f"{us:12.1f}" for us in row))
    if args.kernels:
        print("\nper kernel (hist, select, index, draw), µs:")
        for name, p in RECORDS.items():
            for m in args.ms:
                ks = time_kernels(gpu, m, args.n, p, False, 20, spread)
                print(f"{name:<16} m={m:<4}" + "".join(f"{k:9.1f}" for k in ks))
    gpu.close()


if __name__ == "__main__":
    main()
