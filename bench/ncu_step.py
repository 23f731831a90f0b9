"""One eager propose at a model's shapes (GLM-5.3-Flash by default) between cuProfilerStart /
cuProfilerStop, for Nsight Compute: each kernel's own duration, without the event brackets of
bench_propose's profile.

    ncu --profile-from-start off --cache-control none --clock-control none \
        --metrics gpu__time_duration.sum --csv python3 bench/ncu_step.py [--k 3] [--context 4096]

ncu serialises the launches, so programmatic dependent launch overlaps nothing here: the figures
are per-kernel durations with warm caches and free-running clocks, the step's parts rather than
its graph time (bench/bench_propose.py measures that).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_propose import MODELS, fill_context, model_config, random_weights  # noqa: E402 - after the sys.path insert
from model.checkpoint.random_init import tiled_fp8_weights  # noqa: E402 - after the sys.path insert
from runtime.dtypes import BF16  # noqa: E402 - after the sys.path insert


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--bf16-head", action="store_true")
    ap.add_argument("--model", choices=tuple(MODELS), default="glm5_next")
    ap.add_argument(
        "--weights", choices=("bf16", "fp8"), default="fp8", help="fp8: the published FP8 set kept native"
    )
    ap.add_argument("--ptx-dir", default=None, help="load the kernels' PTX from here (a variant build)")
    args = ap.parse_args(argv)

    from cuda.bindings import driver

    from model.proposer import MtpProposer, ProposerOptions
    from runtime.cuda_backend import CudaBackend, check

    cfg = model_config(args.model)
    gpu = CudaBackend(ptx_dir=args.ptx_dir)
    prop = MtpProposer(
        gpu,
        cfg,
        (tiled_fp8_weights if args.weights == "fp8" else random_weights)(cfg),
        ProposerOptions(
            served_max_seq_len=args.context + args.k,
            max_draft_tokens=args.k,
            max_sequences=1,
            fp8_head=not args.bf16_head,
        ),
    )
    rng = np.random.default_rng(1)
    hidden = gpu.alloc(cfg.hidden_size * 2)
    gpu.copy_h2d(hidden, rng.standard_normal(cfg.hidden_size, dtype=np.float32).astype(BF16))
    st = prop.alloc_state()
    try:
        fill_context(prop, st, args.context, rng)
        prop.propose(st, 7, hidden, args.context, args.k)  # warm-up: modules loaded, smem opted in
        check(driver.cuProfilerStart(), "cuProfilerStart")
        drafts = prop.propose(st, 7, hidden, args.context, args.k)
        check(driver.cuProfilerStop(), "cuProfilerStop")
        print(f"drafts {drafts}", file=sys.stderr)
    finally:
        prop.free_state(st)
        gpu.free(hidden)
        prop.close()
        gpu.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
