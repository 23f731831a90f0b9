"""Entry point of one rank of a sharded drafter: start it once per GPU with
``python -m runtime.launcher --nprocs N -- -m model.sharded_run ...`` (or torchrun, mpirun, SLURM:
it reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

Every rank builds its shard of the drafter from the same weights, runs the same random history of
feeds, proposes and verifies in lockstep, and checks that (1) every rank drafted the same tokens
(an all-gather of a digest of its drafts) and (2) on rank 0, they equal the drafts of an unsharded
drafter on the same weights. Then it times ``propose(k)`` replayed as a graph with the collectives
inside. Prints one JSON line per rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np


def random_weights(cfg, seed: int) -> dict:
    from model.checkpoint import DTYPES, random_tensors
    from model.checkpoint.random_init import tiled_mtp_weights

    if cfg.hidden_size >= 1024:  # reference shapes: tiles of one random pool, built in seconds
        return tiled_mtp_weights(cfg, seed)

    out = {}
    for t in random_tensors(cfg, seed, include_target=False):
        flat = np.concatenate([np.asarray(c).reshape(-1) for c in t.chunks()])
        out[t.name] = flat.view(DTYPES[t.dtype]).reshape(t.shape)
    return out


def run_history(prop, gpu, history, seed: int) -> list[list[int]]:
    from runtime.dtypes import BF16

    cfg = prop.cfg
    st = prop.alloc_state()
    n = prop.drafter_context_rows
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, n + 2)
    hid = rng.standard_normal((n + 1, cfg.hidden_size)).astype(BF16)
    hbuf = gpu.alloc(hid.nbytes)
    gpu.copy_h2d(hbuf, hid)
    H2 = cfg.hidden_size * 2
    drafts, rows = [], 0
    try:
        for n_feed, k, acc in history:
            n_feed = min(n_feed, n - rows - k)
            if n_feed > 0:
                prop.catchup_drafter(st, tokens[rows : rows + n_feed + 1], hbuf.offset(rows * H2), rows)
                rows += n_feed
            if rows + k > n:
                break
            drafts.append(prop.propose(st, int(tokens[rows + 1]), hbuf.offset(rows * H2), rows, k))
            prop.after_verify(st, min(acc, k))
            rows += min(k, acc + 1)
    finally:
        prop.free_state(st)
        gpu.free(hbuf)
    return drafts


def time_propose(prop, gpu, k: int, iters: int) -> float:
    """Median wall time of propose(k) (graph replay on CUDA), drafts copied back, in ms: one
    state, the same position each time."""
    st = prop.alloc_state()
    hid = gpu.alloc(prop.cfg.hidden_size * 2)
    gpu.memset(hid, 0x3C, prop.cfg.hidden_size * 2)  # 0x3C3C: bf16 ~0.0115, never zero
    times = []
    for _ in range(iters + 5):
        t0 = time.perf_counter()
        prop.propose(st, 1, hid, 0, k)
        times.append(time.perf_counter() - t0)
    gpu.free(hid)
    prop.free_state(st)
    return round(1e3 * float(np.median(times[5:])), 4)


def main(argv: list[str] | None = None) -> int:
    from model.config import glm5_flash, tiny
    from model.proposer import MtpProposer, ProposerOptions
    from runtime.comm import CommDtype, SingleRankCommunicator
    from runtime.rendezvous import DistEnv

    p = argparse.ArgumentParser(prog="model.sharded_run", description=__doc__)
    p.add_argument(
        "--model", choices=["tiny", "glm5-flash"], default="tiny", help="random weights of this config"
    )
    p.add_argument(
        "--checkpoint", default=None, help="draft with this checkpoint's MTP block instead of random weights"
    )
    p.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    p.add_argument("--context", type=int, default=256, help="served context (rows)")
    p.add_argument("--steps", type=int, default=40, help="propose/verify steps in the history")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-iters", type=int, default=50)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a peer is dead")
    args = p.parse_args(argv)

    dist = DistEnv.from_env()
    if args.backend == "cuda":
        from runtime.cuda_backend import CudaBackend
        from runtime.launcher import apply_nccl_env

        apply_nccl_env(dist)
        gpu = CudaBackend(device=dist.local_rank)
    else:
        from runtime.host_backend import HostBackend

        if dist.world_size > 1:
            print(
                "the host backend runs one rank per process; use tests/test_sharded.py for threads",
                file=sys.stderr,
            )
            return 2
        gpu = HostBackend()
    if args.checkpoint:
        from model.checkpoint import Checkpoint, mtp_tensors

        ckpt = Checkpoint(args.checkpoint)
        cfg = ckpt.config
        weights = mtp_tensors(ckpt, cfg)
    else:
        cfg = (
            tiny(max_context=args.context)
            if args.model == "tiny"
            else glm5_flash(max_context=max(args.context, 16384))
        )
        weights = random_weights(cfg, args.seed)
    fingerprint = hashlib.sha256(json.dumps(cfg.to_hf_dict(), sort_keys=True).encode()).hexdigest()
    if dist.world_size > 1:
        from runtime.comm import NcclCommunicator

        comm = NcclCommunicator.from_rendezvous(gpu, dist, fingerprint, timeout_s=args.timeout)
    else:
        comm = SingleRankCommunicator(gpu)
    rng = np.random.default_rng(args.seed + 1)
    history = [(int(rng.integers(0, 9)), args.k, int(rng.integers(0, args.k + 1))) for _ in range(args.steps)]
    opts = ProposerOptions(
        served_max_seq_len=args.context,
        max_draft_tokens=args.k,
        max_sequences=2,
        use_graphs=args.backend == "cuda",
        comm_timeout_s=args.timeout,
    )
    prop = MtpProposer(gpu, cfg.with_parallel(dist.rank, dist.world_size), weights, opts, comm=comm)
    drafts = run_history(prop, gpu, history, args.seed)
    digest = int.from_bytes(hashlib.sha256(json.dumps(drafts).encode()).digest()[:8], "little")
    send, recv = gpu.alloc(8), gpu.alloc(8 * dist.world_size)
    gpu.copy_h2d(send, np.array([digest], np.uint64))
    comm.all_gather(send, recv, 1, CommDtype.UINT64)
    gpu.synchronize()
    all_digests = np.empty(dist.world_size, np.uint64)
    gpu.copy_d2h(all_digests, recv)
    gpu.free(send)
    gpu.free(recv)
    result = {
        "rank": dist.rank,
        "world_size": dist.world_size,
        "model": args.checkpoint or args.model,
        "proposes": len(drafts),
        "ranks_agree": bool((all_digests == digest).all()),
    }
    result["propose_ms_median"] = time_propose(prop, gpu, args.k, args.timing_iters)
    prop.close()
    if dist.rank == 0 and dist.world_size > 1:
        single = MtpProposer(gpu, cfg, weights, opts, comm=None)
        ref = run_history(single, gpu, history, args.seed)
        result["single_rank_propose_ms_median"] = time_propose(single, gpu, args.k, args.timing_iters)
        single.close()
        result["equals_single_rank"] = ref == drafts
    print(json.dumps(result), flush=True)
    comm.close()
    ok = result["ranks_agree"] and result.get("equals_single_rank", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
