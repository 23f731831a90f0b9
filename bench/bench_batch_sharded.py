"""Batched drafting on W GPUs against one: ``propose_batch(k)`` of B sequences, experts split by
rank, heads with their o_proj groups, the vocabulary-sharded head with its exchanged keys.

    python -m runtime.launcher --nprocs 2 -- bench/bench_batch_sharded.py --json sharded_w2.json
    python bench/bench_batch_sharded.py --json sharded_w1.json          # W = 1, one GPU

Every rank builds its shard of the drafter from the same random weights (GLM-5.3-Flash shapes,
as bench/bench_batch.py builds them). The run, in order:

1. One GPU, on rank 0 while the other ranks wait at a barrier (``--single-timeout``): the whole
   drafter with the head the ranks use (the FP8 head on CUDA cores: a vocabulary-sharded head
   cannot run on tensor cores, and the two heads' bits differ), through the drafts history (3.),
   then timed; then with its own best head (tensor cores for a batch proposer), timed. Each is
   closed before the next is built: one proposer on a GPU at a time.
2. W ranks: the sharded drafter, through the same history, then timed.
3. The history: ``--proposes`` batched proposes (default 300) over ``--history-sequences``
   sequences at random contexts up to ``--context`` (direct fill), random subsets of 1 to all of
   them, k of 1..K, now and then one or two rows behind (a rewind), random acceptance through
   ``after_verify_batch``, the accepted rows fed back through ``catchup_batch``, sequences freed
   and their slots reused. Every choice comes from ``--seed``, never from the drafts, so every
   rank and the one-GPU drafter make the same calls; the drafts must be equal on every rank (a
   digest gathered from each) and equal to one GPU's, bit for bit.
4. Timing (bench/bench_batch.py ``measure_batch``): for each B of ``--batches`` (1, 16, 64, 256),
   B sequences at ``--context`` (4096), the bucket graph replayed back to back between events
   (median device ms; on W ranks the graph holds the collectives, so this is the step as the
   ranks run it together), the wall time of ``propose_batch``, and each rank's byte share of the
   floor: ``batch_floor_bytes`` over that rank's buffers (its heads, its vocabulary rows) with the
   distinct experts the router chose among the rank's own, o_proj's local groups only and the
   shared expert on its owner only, over that GPU's copy bandwidth. The all-reduced bytes of
   the step are listed beside it (not in the floor: they move over NVLink).

Rank 0 prints a table and writes ``--json``. NCCL runs with NVLink multicast off
(``runtime.launcher.apply_nccl_env``, as every launch of this runtime). ``run_rank`` is the whole
benchmark for one rank on any backend and communicator, so the CPU test runs it on host backends
with host communicators (tests/test_bench_batch_sharded.py).
"""

from __future__ import annotations

import datetime
import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

if not __package__:  # run as a script (python bench/bench_batch_sharded.py): find bench/, model/, runtime/
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402 - after the sys.path insert

from bench.bench_batch import _random_rows, batch_floor_bytes, measure_batch  # noqa: E402
from bench.bench_propose import Arm, ArmProposer, copy_bandwidth, draft_bytes, fill_context  # noqa: E402
from model.config import ModelConfig, glm5_flash, tiny  # noqa: E402
from model.proposer import ProposerOptions  # noqa: E402
from runtime.comm.base import CommDtype  # noqa: E402
from runtime.dtypes import BF16  # noqa: E402

BATCHES = (1, 16, 64, 256)
CONTEXT = 4096
HIDDEN_POOL_ROWS = 512

Log = Callable[..., Any]


# ---- the model -------------------------------------------------------------------------------------


def bench_config(model: str) -> ModelConfig:
    """GLM-5.3-Flash, or a tiny config of the same form whose vocabulary, experts and head groups
    divide by 2 and 4 (for the host-backend test)."""
    if model == "glm5-flash":
        return glm5_flash()
    if model == "tiny":
        return tiny(vocab_size=96, index_topk=8, index_kpool=2, max_context=128)
    raise ValueError(f"model {model!r}: 'glm5-flash' or 'tiny'")


def bench_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random weights: at the reference shapes bench/bench_batch.py's (tiles of one random pool,
    the router drawn at random so a batch's rows route as a real router's do), else every tensor
    drawn (model.sharded_run.random_weights)."""
    from model.sharded_run import random_weights

    weights = random_weights(cfg, seed)
    if cfg.hidden_size >= 1024:
        # As bench_batch.run: tiled router rows repeat, so a batch would route alike and read fewer
        # experts than a real router makes it read.
        gate = f"model.layers.{cfg.mtp_layer_index}.mlp.gate.weight"
        w = np.random.default_rng(5).standard_normal(weights[gate].shape, np.float32) * 0.02
        weights[gate] = w.astype(BF16)
    return weights


def bench_options(cfg: ModelConfig, args: Any, tensor_core_head: bool | None) -> ProposerOptions:
    """bench_batch's options (served length, context chunk, graphs), slots for the largest batch
    and the history."""
    return ProposerOptions(
        served_max_seq_len=cfg.dsa.max_context,
        max_draft_tokens=args.k,
        max_sequences=max(max(args.batches), args.history_sequences),
        use_graphs=True,
        context_chunk=min(256, cfg.dsa.max_context),
        tensor_core_head=tensor_core_head,
        comm_timeout_s=args.timeout,
    )


def build(gpu: Any, cfg: ModelConfig, weights: dict, args: Any, *, rank_world, comm, tensor_core_head):
    prop = ArmProposer(
        gpu, cfg.with_parallel(*rank_world), weights, bench_options(cfg, args, tensor_core_head), comm=comm
    )
    prop.arm = Arm(fp8=True, graphs=True)  # before any graph is captured
    return prop


# ---- a rank's share of the floor -------------------------------------------------------------------


def rank_floor_bytes(
    prop: Any, contexts: Sequence[int], k: int, chosen_local: Sequence[float], fp8_head: bool
) -> dict[str, int]:
    """``batch_floor_bytes`` of what this rank must move: counted on its own buffers (its heads'
    q, wk_t and wv, its vocabulary rows of the head) with ``chosen_local[i]`` the distinct experts
    of draft i among its own; besides, only its o_proj groups (draft_bytes counts all of them,
    whatever the rank) and the shared expert only on the rank that holds it. One rank: exactly
    ``batch_floor_bytes``."""
    out = dict(batch_floor_bytes(prop, contexts, k, chosen_local, fp8_head))
    w, sh = draft_bytes(prop, int(contexts[0]), fp8_head), prop.sharding
    others = w["o_proj"] - w["o_proj"] * sh.local_groups // sh.groups
    if not sh.owns_shared_expert:
        others += w["shared_expert"]
    out["block"] -= k * others
    out["total"] -= k * others
    return out


def allreduce_bytes(prop: Any, m: int, k: int) -> int:
    """Bytes one rank all-reduces in a k-draft step over an m-row bucket: per draft the o_proj
    groups' f32 rows, the MoE's f32 pair rows and the head's packed keys (none on one rank)."""
    if prop.cfg.parallel.world_size == 1:
        return 0
    H, sh, mc = prop.cfg.hidden_size, prop.sharding, prop.cfg.moe
    slots = mc.num_experts_per_tok + int(mc.n_shared_experts > 0)
    head = m * 8 if prop.head_sharded else 0
    return k * (m * sh.groups * H * 4 + m * slots * H * 4 + head)


def local_expert_ids(prop: Any, states: Sequence[Any], k: int) -> list[np.ndarray]:
    """The router's ids of each draft of one eager propose (``ArmProposer.routed_ids``) for the B
    sequences, kept to this rank's experts: what its share of the floor counts."""
    B, H = len(states), prop.cfg.hidden_size
    hid = _random_rows(prop.gpu, np.random.default_rng(3), B, H)
    pos = [st.rows for st in states]
    try:
        ids = prop.routed_ids(states, [1] * B, hid, pos, k)
    finally:
        for st, n in zip(states, pos):
            prop.rewind_to(st, n)
        prop.gpu.free(hid)
    lo, n = prop.sharding.expert_base, prop.sharding.local_experts
    # The first B rows: a batch padded to its bucket has rows of no sequence after them.
    return [a[:B][(a[:B] >= lo) & (a[:B] < lo + n)] for a in ids]


def measure(prop: Any, gpu: Any, args: Any, bw: float, log: Log) -> list[dict[str, Any]]:
    """measure_batch's rows (device, wall and host times, distinct local experts) with this rank's
    share of the floor in place of the whole drafter's."""
    rows = measure_batch(
        prop,
        gpu,
        args.batches,
        args.context,
        args.k,
        args.iters,
        np.random.default_rng(args.seed),
        bandwidth=bw,
        expert_ids=local_expert_ids,
        fill="direct",
        step=False,
        log=log,
    )
    for r in rows:
        fb = rank_floor_bytes(prop, [args.context] * r["B"], r["k"], r["distinct_experts"], True)
        r["floor_bytes"], r["floor_ms"] = fb, fb["total"] / bw * 1e3
        r["over_floor"] = r["graph_device_ms"] / r["floor_ms"]
        r["allreduce_bytes"] = allreduce_bytes(prop, prop._bucket(r["B"]), r["k"])
        if prop.cfg.parallel.world_size > 1:  # measure_batch logged the whole drafter's floor
            log(
                f"  B {r['B']:>3}: this rank's share of the floor {r['floor_ms']:.3f} ms ({r['over_floor']:.2f}x)"
            )
    return rows


# ---- the drafts history ----------------------------------------------------------------------------


def drafts_history(prop: Any, gpu: Any, args: Any) -> dict[str, Any]:
    """The seeded history of the module docstring (3.); returns its drafts and what it covered."""
    cfg = prop.cfg
    V, H, K = cfg.vocab_size, cfg.hidden_size, args.k
    cap, S = prop.drafter_context_rows, args.history_sequences
    rng = np.random.default_rng(args.seed + 7)
    pool = _random_rows(gpu, rng, HIDDEN_POOL_ROWS, H)
    live: list[Any] = []
    drafts: list[np.ndarray] = []
    sizes: dict[int, int] = {}
    stats = {"rewound": 0, "catchups": 0, "frees": 0}

    def fresh() -> None:
        st = prop.alloc_state()
        fill_context(prop, st, int(rng.integers(1, max(2, min(args.context, cap - 64)))), rng)
        live.append(st)

    try:
        for _ in range(S):
            fresh()
        while len(drafts) < args.proposes:
            for st in [st for st in live if st.rows + 2 * K + 8 > cap] + (
                [live[int(rng.integers(len(live)))]] if rng.random() < 0.03 else []
            ):
                if st in live:  # freed: its slot goes to the next fresh sequence
                    prop.free_state(st)
                    live.remove(st)
                    stats["frees"] += 1
            while len(live) < S:
                fresh()
            # Batch sizes of every range: one, a few, tens, up to all of them.
            lo, hi = [(1, 1), (2, 8), (9, 32), (33, S)][int(rng.choice(4, p=[0.2, 0.3, 0.3, 0.2]))]
            size = int(rng.integers(min(lo, S), min(hi, S) + 1))
            batch = [live[i] for i in rng.permutation(len(live))[: min(size, len(live))]]
            k = int(rng.integers(1, K + 1))
            back = rng.choice(3, len(batch), p=[0.85, 0.1, 0.05])
            pos = [max(st.rows - int(b), 0) for st, b in zip(batch, back)]
            stats["rewound"] += sum(p < st.rows for st, p in zip(batch, pos))
            off = int(rng.integers(0, HIDDEN_POOL_ROWS - len(batch) + 1))
            last = [int(t) for t in rng.integers(0, V, len(batch))]
            drafts.append(np.asarray(prop.propose_batch(batch, last, pool.offset(off * H * 2), pos, k)))
            sizes[len(batch)] = sizes.get(len(batch), 0) + 1
            acc = [int(a) for a in rng.integers(0, k + 1, len(batch))]
            prop.after_verify_batch(batch, acc)
            # The target's accepted rows, fed back to the sequences that got any.
            feed = [(st, a) for st, a in zip(batch, acc) if a and st.rows + a + 2 * K + 8 <= cap]
            if feed:
                toks = [[int(t) for t in rng.integers(0, V, a + 1)] for _, a in feed]
                hids = [pool.offset(int(rng.integers(0, HIDDEN_POOL_ROWS - a)) * H * 2) for _, a in feed]
                prop.catchup_batch([st for st, _ in feed], toks, hids, [st.rows for st, _ in feed])
                stats["catchups"] += 1
    finally:
        for st in live:
            prop.free_state(st)
        gpu.free(pool)
    return {"drafts": drafts, "sizes": dict(sorted(sizes.items())), **stats}


def drafts_digest(drafts: Sequence[np.ndarray]) -> int:
    h = hashlib.sha256()
    for d in drafts:
        h.update(np.asarray(d.shape, np.int64).tobytes())
        h.update(np.ascontiguousarray(d, np.int64).tobytes())
    return int.from_bytes(h.digest()[:8], "little")


def first_difference(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> int | None:
    """Index of the first propose whose drafts differ (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or not np.array_equal(x, y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---- between ranks ---------------------------------------------------------------------------------


def gather(comm: Any, gpu: Any, values: np.ndarray, dtype: CommDtype, timeout_s: float) -> np.ndarray:
    """Every rank's ``values`` (the same length on every rank), [world, n], on every rank."""
    values = np.ascontiguousarray(values, dtype.np_dtype).reshape(-1)
    W, n = comm.world_size, values.size
    send, recv = gpu.alloc(n * dtype.itemsize), gpu.alloc(W * n * dtype.itemsize)
    try:
        gpu.copy_h2d(send, values)
        comm.all_gather(send, recv, n, dtype)
        wait = getattr(comm, "wait", None)
        if wait is not None:  # NCCL: a bounded wait, a dead peer is a CommError
            wait(None, timeout_s)
        gpu.synchronize()
        out = np.empty(W * n, dtype.np_dtype)
        gpu.copy_d2h(out, recv)
    finally:
        gpu.free(send)
        gpu.free(recv)
    return out.reshape(W, n)


_ROW_FIELDS = ("graph_device_ms", "graph_wall_ms", "host_cpu_us", "floor_ms", "allreduce_bytes")


def _row_vector(rows: Sequence[dict[str, Any]], k: int) -> np.ndarray:
    """A rank's rows as numbers (the fields above, its floor bytes, then its distinct experts per
    draft), so one all-gather brings every rank's to rank 0."""
    out = []
    for r in rows:
        out += [float(r[f]) for f in _ROW_FIELDS] + [float(r["floor_bytes"]["total"])]
        out += [float(x) for x in r["distinct_experts"]] + [0.0] * (k - len(r["distinct_experts"]))
    return np.asarray(out, np.float64)


def _rows_from_vector(v: np.ndarray, batches: Sequence[int], k: int) -> list[dict[str, Any]]:
    width = len(_ROW_FIELDS) + 1 + k
    out = []
    for i, B in enumerate(batches):
        x = v[i * width : (i + 1) * width]
        r = dict(zip(_ROW_FIELDS, (float(a) for a in x[: len(_ROW_FIELDS)])))
        r["B"], r["floor_bytes_total"] = B, float(x[len(_ROW_FIELDS)])
        r["distinct_experts"] = [float(a) for a in x[len(_ROW_FIELDS) + 1 :]]
        out.append(r)
    return out


# ---- one rank --------------------------------------------------------------------------------------


def _single_phase(gpu, cfg, weights, args, bw, log) -> dict[str, Any]:
    """Rank 0's one-GPU drafters (module docstring, 1.)."""
    out: dict[str, Any] = {}
    for head in args.single_heads:
        prop = build(
            gpu, cfg, weights, args, rank_world=(0, 1), comm=None, tensor_core_head=head == "tensor-core"
        )
        try:
            then = ": the drafts history, then timing" if head == "cuda-core" else ""
            log(f"one GPU, {head} head{then}", flush=True)
            if head == "cuda-core":
                t0 = time.perf_counter()
                out["history"] = drafts_history(prop, gpu, args)
                out["history_s"] = time.perf_counter() - t0
            out[head] = measure(prop, gpu, args, bw, log)
            out[f"{head}_memory"] = prop.memory_report()
        finally:
            prop.close()
    return out


def run_rank(args: Any, rank: int, world: int, gpu: Any, comm: Any, log: Log = print) -> dict[str, Any]:
    """The whole benchmark for one rank (``comm``: its communicator, NCCL or host; any for one
    rank). Returns rank 0's result (every rank's rows and the comparison) on rank 0, this rank's
    own part elsewhere."""
    cfg = bench_config(args.model)
    if world > 1 and (cfg.vocab_size % world or cfg.moe.n_routed_experts % world):
        raise ValueError(f"{world} ranks: the vocabulary and the experts must divide by the world size")
    say = log if rank == 0 else (lambda *a, **kw: None)
    bw = args.bandwidth or copy_bandwidth(gpu)
    say(f"{world} rank(s), copy bandwidth {bw / 1e12:.3f} TB/s (read + write) on rank 0", flush=True)
    weights = bench_weights(cfg, args.seed)
    single: dict[str, Any] = {}
    if args.single_heads:
        if rank == 0:
            single = _single_phase(gpu, cfg, weights, args, bw, say)
        if world > 1:
            comm.barrier(args.single_timeout)  # the other ranks wait for rank 0's one-GPU runs
    say(f"{world} rank(s): the drafts history, then timing", flush=True)
    prop = build(gpu, cfg, weights, args, rank_world=(rank, world), comm=comm, tensor_core_head=False)
    del weights
    try:
        t0 = time.perf_counter()
        hist = drafts_history(prop, gpu, args)
        hist_s = time.perf_counter() - t0
        rows = measure(prop, gpu, args, bw, say)
        memory = prop.memory_report()
        head_sharded = prop.head_sharded
    finally:
        prop.close()
    digests = gather(
        comm, gpu, np.array([drafts_digest(hist["drafts"])], np.uint64), CommDtype.UINT64, args.timeout
    )
    per_rank = gather(comm, gpu, _row_vector(rows, args.k), CommDtype.FLOAT64, args.timeout)
    mine = {"rank": rank, "rows": rows, "memory": memory, "history_s": hist_s}
    if rank != 0:
        return mine
    ranks = [_rows_from_vector(per_rank[r], args.batches, args.k) for r in range(world)]
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": getattr(gpu, "device_name", gpu.name),
        "world_size": world,
        "model": args.model,
        "k": args.k,
        "context": args.context,
        "copy_bw_GBps": bw / 1e9,
        "head_sharded": head_sharded,
        "rank0": mine,
        "ranks": ranks,
        "history": {
            "proposes": len(hist["drafts"]),
            "sequences": args.history_sequences,
            "batch_sizes": hist["sizes"],
            "rewound": hist["rewound"],
            "catchups": hist["catchups"],
            "frees": hist["frees"],
            "ranks_agree": bool((digests == digests[0]).all()),
            "digests": [f"{int(d):016x}" for d in digests[:, 0]],
        },
        "summary": [],
    }
    if "history" in single:
        ref = single["history"]
        diff = first_difference(hist["drafts"], ref["drafts"])
        res["history"]["equals_one_gpu"] = diff is None
        res["history"]["first_difference"] = diff
        res["history"]["one_gpu_digest"] = f"{drafts_digest(ref['drafts']):016x}"
        res["history"]["one_gpu_history_s"] = single["history_s"]
    res["single"] = {h: single[h] for h in args.single_heads if h in single}
    res["single_memory"] = {h: single[f"{h}_memory"] for h in args.single_heads if f"{h}_memory" in single}
    res["summary"] = summarize(res)
    return res


def summarize(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per B: the W ranks' step (the slowest rank's device time), each rank's floor share (the
    largest), one GPU with each head, and the speedups."""
    out = []
    single = res["single"]
    for i, B in enumerate(r["B"] for r in res["ranks"][0]):
        per = [rows[i] for rows in res["ranks"]]
        s = {
            "B": B,
            "ranks_device_ms": [r["graph_device_ms"] for r in per],
            "ranks_ms": max(r["graph_device_ms"] for r in per),
            "ranks_wall_ms": max(r["graph_wall_ms"] for r in per),
            "rank_floor_ms": max(r["floor_ms"] for r in per),
            "allreduce_MB": per[0]["allreduce_bytes"] / 1e6,
            "distinct_experts_by_rank": [r["distinct_experts"] for r in per],
        }
        s["ranks_over_floor"] = s["ranks_ms"] / s["rank_floor_ms"]
        for head, rows in single.items():
            s[f"one_gpu_{head}_ms"] = rows[i]["graph_device_ms"]
            s[f"one_gpu_{head}_floor_ms"] = rows[i]["floor_ms"]
            s[f"speedup_vs_{head}"] = rows[i]["graph_device_ms"] / s["ranks_ms"]
        if single:
            best = min(rows[i]["graph_device_ms"] for rows in single.values())
            s["speedup_vs_best_one_gpu"] = best / s["ranks_ms"]
        out.append(s)
    return out


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def table(res: dict[str, Any]) -> str:
    W, hist = res["world_size"], res["history"]
    heads = list(res["single"])
    head = ["B", f"{W} ranks ms (slowest)", "rank floor ms (largest share)", "x floor", "all-reduced MB"]
    head += ["one GPU floor ms"] * bool(heads)
    head += [f"one GPU {h} head ms" for h in heads] + [f"speedup vs {h}" for h in heads]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for s in res["summary"]:
        cells = [
            str(s["B"]),
            _f(s["ranks_ms"], ".3f"),
            _f(s["rank_floor_ms"], ".3f"),
            _f(s["ranks_over_floor"], ".2f"),
            _f(s["allreduce_MB"], ".1f"),
        ]
        cells += [_f(s.get(f"one_gpu_{heads[0]}_floor_ms"), ".3f")] * bool(heads)
        cells += [_f(s.get(f"one_gpu_{h}_ms"), ".3f") for h in heads]
        cells += [_f(s.get(f"speedup_vs_{h}"), ".2f") for h in heads]
        lines.append("| " + " | ".join(cells) + " |")
    eq = hist.get("equals_one_gpu")
    lines.append("")
    lines.append(
        f"drafts history: {hist['proposes']} batched proposes, batch sizes {min(hist['batch_sizes'])}.."
        f"{max(hist['batch_sizes'])}, {hist['rewound']} rewound entries, {hist['catchups']} catch-ups, "
        f"{hist['frees']} frees; equal on all {W} ranks: {'yes' if hist['ranks_agree'] else 'NO'}; "
        f"equal to one GPU: {'-' if eq is None else 'yes' if eq else 'NO (first at propose %s)' % hist['first_difference']}"
    )
    return "\n".join(lines)


# ---- the command -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> Any:
    import argparse
    from pathlib import Path

    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    ap = argparse.ArgumentParser(prog="bench/bench_batch_sharded.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("glm5-flash", "tiny"), default="glm5-flash")
    ap.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--batches", type=ints, default=BATCHES)
    ap.add_argument("--context", type=int, default=CONTEXT, help="rows of every timed sequence")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--proposes", type=int, default=300, help="batched proposes in the drafts history")
    ap.add_argument("--history-sequences", type=int, default=64, help="live sequences in the history")
    ap.add_argument(
        "--single-heads",
        type=lambda s: tuple(h for h in s.split(",") if h),
        default=("cuda-core", "tensor-core"),
        help="one-GPU runs on rank 0 ('cuda-core' also drafts the reference history; '' for none)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a peer is dead")
    ap.add_argument(
        "--single-timeout",
        type=float,
        default=1800.0,
        help="seconds the ranks wait for rank 0's one-GPU runs",
    )
    ap.add_argument("--bandwidth", type=float, default=0.0, help="bytes/s for the floor (0: measure)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    bad = [h for h in args.single_heads if h not in ("cuda-core", "tensor-core")]
    if bad:
        ap.error(f"--single-heads: {bad}: 'cuda-core' and/or 'tensor-core'")
    if args.history_sequences > 256 or max(args.batches) > 256:
        ap.error("at most 256 sequences")
    return args


def main(argv: list[str] | None = None) -> int:
    import json

    from runtime.rendezvous import DistEnv

    args = parse_args(argv)
    dist = DistEnv.from_env()
    if args.backend == "host":
        from runtime.host_backend import HostBackend

        if dist.world_size > 1:
            print(
                "the host backend runs one rank per process; tests/test_bench_batch_sharded.py runs threads"
            )
            return 2
        gpu: Any = HostBackend()
    else:
        from runtime.cuda_backend import CudaBackend
        from runtime.launcher import apply_nccl_env

        apply_nccl_env(dist)  # NVLink multicast off, before NCCL loads
        gpu = CudaBackend(device=dist.local_rank)
    try:
        if dist.world_size > 1:
            from runtime.comm import NcclCommunicator

            fp = hashlib.sha256(json.dumps(vars(args), default=str, sort_keys=True).encode()).hexdigest()
            comm: Any = NcclCommunicator.from_rendezvous(gpu, dist, fp, timeout_s=args.timeout)
        else:
            from runtime.comm import SingleRankCommunicator

            comm = SingleRankCommunicator(gpu)
        try:
            res = run_rank(args, dist.rank, dist.world_size, gpu, comm, log=print)
        finally:
            comm.close()
    finally:
        if hasattr(gpu, "close"):
            gpu.close()
    if dist.rank != 0:
        return 0
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=_json_default))
    print(table(res), flush=True)
    hist = res["history"]
    return 0 if hist["ranks_agree"] and hist.get("equals_one_gpu", True) else 1


def _json_default(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)


if __name__ == "__main__":
    raise SystemExit(main())
