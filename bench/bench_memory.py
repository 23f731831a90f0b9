"""Device memory of a batched proposer, by kind, at GLM-5.3-Flash shapes.

    python3 bench/bench_memory.py [--sequences 64 256] [--rows 16384] [--k 3]

For each ``max_sequences``: the proposer's own account (``MtpProposer.memory_report``: weights, the
latent KV pool with its block tables, the indexer caches, the batch scratch, mapped host memory)
and what the driver reports (``mem_info``) for the proposer and, after a propose of every bucket
at k drafts, for the captured graphs. Every pool is allocated when the proposer is built, so
these are the figures at any number of live sequences.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: find model/ and runtime/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from model.checkpoint.random_init import tiled_mtp_weights
from model.config import glm5_flash
from model.proposer import MtpProposer, ProposerOptions
from runtime.dtypes import BF16


def measure(gpu: Any, sequences: int, rows: int, k: int, weights: dict) -> dict[str, Any]:
    cfg = glm5_flash(max_context=rows)
    free0 = gpu.mem_info()[0]
    opt = ProposerOptions(
        served_max_seq_len=rows, max_draft_tokens=k, max_sequences=sequences, use_graphs=True
    )
    prop = MtpProposer(gpu, cfg, weights, opt)
    try:
        gpu.synchronize()
        free1 = gpu.mem_info()[0]
        H = cfg.hidden_size
        states = [prop.alloc_state() for _ in range(sequences)]
        hid = gpu.alloc(sequences * H * 2)
        gpu.copy_h2d(hid, np.full((sequences, H), 0.5, BF16))
        for m in prop.buckets:  # capture every bucket's graph (drafts at row 0 of empty sequences)
            prop.propose_batch(states[:m], [1] * m, hid, [0] * m, k)
            for st in states[:m]:
                prop.rewind_to(st, 0)
        gpu.synchronize()
        free2 = gpu.mem_info()[0]
        gpu.free(hid)
        rep = prop.memory_report()
        return {
            "sequences": sequences,
            "rows": rows,
            "k": k,
            **rep,
            "driver_proposer": free0 - free1,
            "graphs": free1 - free2 - sequences * H * 2,
            "buckets": list(prop.buckets),
        }
    finally:
        prop.close()


def table(rows: list[dict[str, Any]]) -> str:
    kinds = ("weights", "kv_pool", "indexer_caches", "scratch", "graphs", "driver_proposer")
    head = "| sequences x rows | " + " | ".join(kinds) + " | mapped host |"
    lines = [head, "|" + "---|" * (len(kinds) + 2)]
    for r in rows:
        cells = " | ".join(f"{r[k] / 2**30:.2f} GiB" for k in kinds)
        lines.append(f"| {r['sequences']} x {r['rows']} | {cells} | {r['mapped_host'] / 2**10:.0f} KiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args(argv)
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    weights = tiled_mtp_weights(glm5_flash(max_context=args.rows))
    out = [measure(gpu, n, args.rows, args.k, weights) for n in args.sequences]
    print(table(out))
    gpu.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
