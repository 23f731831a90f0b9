"""GPU benchmark of the drafter's reach out to 1,048,576 tokens (not a test).

    python3 bench/bench_reach.py [--iters N] [--json PATH] [--no-propose]

One run, on the device it finds, at GLM-5.3-Flash's shapes (indexer: 32 heads of 128, FP8 pool keys
with f32 scales, kpool 4; selection: the top 512 pools):

1. Kernels of one row, at 1,024 / 32,768 / 262,144 complete pools, in slots of 1,048,576 rows (what
   a proposer of the full reach launches; 1,024 pools also in a slot of 4096 rows, the batch-1
   drafter at context 4096): ``indexer_scores_batch`` alone, the selection alone (over the
   indexer's own scores: every launch the ``select_topk_pools_batch`` helper makes, which past
   16,384 pools a slot is the three ``select_radix_hist_batch`` phases and the selection) and the
   two as a draft runs them. Device microseconds per call: a graph of REPS back-to-back calls
   captured as the proposer captures its drafts (programmatic dependent launch on where the
   backend has it), CUDA events around each replay, median over ``--iters`` replays, divided by
   REPS. The indexer's floor is its bytes (the FP8 keys and f32 scales it reads, the f32 scores it
   writes: ``indexer_score_bytes``) over the measured copy bandwidth. Each selection is checked
   exactly against ``select_rows_ref`` of the scores it ranked. Then the selection alone at the
   per-token indexers' shape (GLM-5.2 / DeepSeek-V3.2: the top 2048 rows at kpool 1, 202,752 and
   163,840 rows, normal random scores), timed and checked alike.
2. ``propose(k = 3)`` of one sequence at contexts 4096, 131,072 and the reach's last (1,048,576 - k
   rows held, so the k drafted rows fit): the captured graph's device time (bench/bench_propose.py
   ``time_graph``) against a floor of k drafts' weight and cache bytes (``draft_bytes`` without
   its pool-key term) plus the pool keys and scales the indexer reads at that length and the
   scores it writes, once per propose with ``index_share_for_mtp_iteration`` (drafts 2..k reuse
   draft 1's selection), once per draft without. Contexts are fed fast (``fill_context``).
   Needs the selection's workspace passed by the layer (model/block.py, ``BatchScratch``) for
   slots past 16384 pools (65,536 tokens); without it the first propose there raises the
   selection's ValueError, which this script reports and then skips that context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: find model/ and runtime/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from model.config import glm5_flash
from model.kernels import dsa_select
from model.kernels.batch import pack_entries
from model.kernels.dsa_select import (
    complete_pools,
    indexer_score_bytes,
    select_rows_ref,
    select_workspace_bytes,
    selection_capacity,
)
from runtime.dtypes import BF16

REACH = 1 << 20
POOLS = (1024, 32_768, 262_144)
CONTEXTS = (4096, 131_072, REACH)
REPS = 20
K = 3


def _graph_us(gpu: Any, s: int, body, iters: int, label: str) -> float:
    """Device microseconds of one ``body(s)``: a graph of REPS calls, median replay / REPS."""
    body(s)
    gpu.synchronize(s)
    gpu.begin_capture(s)
    try:
        for _ in range(REPS):
            body(s)
    except Exception:
        gpu.abort_capture()
        raise
    g = gpu.end_capture(s, label=label)
    evs = [(gpu.event_create(), gpu.event_create()) for _ in range(iters)]
    try:
        for _ in range(3):
            gpu.graph_launch(g, s)
        for a, b in evs:
            gpu.event_record(a, s)
            gpu.graph_launch(g, s)
            gpu.event_record(b, s)
        gpu.synchronize(s)
        return statistics.median(gpu.event_elapsed_ms(a, b) for a, b in evs) * 1e3 / REPS
    finally:
        for a, b in evs:
            gpu.event_destroy(a)
            gpu.event_destroy(b)
        gpu.graph_destroy(g)


def kernel_rows(gpu: Any, bw: float, iters: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Part 1: the indexer and the selection of one row at each pool count."""
    return [
        kernel_point(gpu, bw, iters, rng, slot_rows, n)
        for slot_rows, n in [(4096, 1024)] + [(REACH, n) for n in POOLS]
    ]


def kernel_point(
    gpu: Any, bw: float, iters: int, rng: np.random.Generator, slot_rows: int, npools: int
) -> dict[str, Any]:
    """The indexer and the selection of one row of ``npools`` complete pools in a slot of
    ``slot_rows`` rows."""
    d = glm5_flash(max_context=REACH).dsa
    heads, dim, kpool, topk = d.index_n_heads, d.index_head_dim, d.index_kpool, d.topk_pools
    pps = slot_rows // kpool
    sel_cap = selection_capacity(slot_rows, topk, kpool, K - 1)
    keys = rng.integers(0, 256, (pps, dim), dtype=np.uint8) & np.uint8(0xBF)  # finite, below 2
    ptrs: dict[str, Any] = {}

    def up(name: str, a: np.ndarray) -> Any:
        ptrs[name] = gpu.alloc(max(a.nbytes, 16))
        gpu.copy_h2d(ptrs[name], np.ascontiguousarray(a))
        return ptrs[name]

    up("q", rng.standard_normal(heads * dim).astype(np.float32).astype(BF16))
    up("w", rng.standard_normal(heads).astype(np.float32).astype(BF16))
    up("keys", keys)
    up("scales", (0.01 + 0.01 * rng.random(pps)).astype(np.float32))
    up("entries", pack_entries([0], [npools * kpool - 1], [0]))
    up("scores", np.zeros(pps, np.float32))
    up("sel", np.zeros(sel_cap, np.uint32))
    up("cnt", np.zeros(1, np.uint32))
    ws_bytes = select_workspace_bytes(1, slot_rows, kpool)
    ws = up("ws", np.zeros(max(ws_bytes // 4, 1), np.uint32)) if ws_bytes else None
    try:

        def scores(s: int) -> None:
            dsa_select.indexer_scores_batch(
                gpu,
                q=ptrs["q"],
                q_stride=heads * dim,
                w=ptrs["w"],
                w_stride=heads,
                pool_keys=ptrs["keys"],
                pool_scales=ptrs["scales"],
                scores=ptrs["scores"],
                entries=ptrs["entries"],
                m=1,
                row_add=0,
                slot_rows=slot_rows,
                heads=heads,
                dim=dim,
                kpool=kpool,
                w_scale=1.0 / heads**0.5,
                stream=s,
            )

        def select(s: int) -> None:
            dsa_select.select_topk_pools_batch(
                gpu,
                scores=ptrs["scores"],
                selected=ptrs["sel"],
                count=ptrs["cnt"],
                entries=ptrs["entries"],
                m=1,
                row_add=0,
                slot_rows=slot_rows,
                sel_cap=sel_cap,
                topk_pools=topk,
                kpool=kpool,
                tail=d.always_select_tail,
                workspace=ws,
                stream=s,
            )

        def both(s: int) -> None:
            scores(s)
            select(s)

        s = gpu.create_stream()
        try:
            us_idx = _graph_us(gpu, s, scores, iters, f"indexer {npools}")
            us_sel = _graph_us(gpu, s, select, iters, f"select {npools}")
            us_both = _graph_us(gpu, s, both, iters, f"indexer+select {npools}")
        finally:
            gpu.destroy_stream(s)
        got_sc = np.empty(pps, np.float32)
        gpu.copy_d2h(got_sc, ptrs["scores"])
        cnt = np.empty(1, np.uint32)
        gpu.copy_d2h(cnt, ptrs["cnt"])
        got = np.empty(int(cnt[0]), np.uint32)
        if got.size:
            gpu.copy_d2h(got, ptrs["sel"])
        want = select_rows_ref(got_sc, npools * kpool - 1, topk, kpool, d.always_select_tail)
        exact = bool(np.array_equal(got, want))
        nbytes = indexer_score_bytes(npools, dim)
        row = {
            "slot_rows": slot_rows,
            "pools": npools,
            "indexer_us": us_idx,
            "indexer_MB": nbytes / 1e6,
            "indexer_floor_us": nbytes / bw * 1e6,
            "select_us": us_sel,
            "indexer_select_us": us_both,
            "selection_exact": exact,
        }
        print(
            f"slot {slot_rows:>7} rows, {npools:>6} pools: indexer {us_idx:6.1f} us "
            f"({nbytes / 1e6:.1f} MB, floor {row['indexer_floor_us']:.1f} us), selection {us_sel:6.1f} us, "
            f"both {us_both:6.1f} us; selection exact: {exact}",
            flush=True,
        )
        return row
    finally:
        for p in ptrs.values():
            gpu.free(p)


PER_TOKEN = (202_752, 163_840)


def per_token_rows(gpu: Any, iters: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Part 1b: the selection alone at each per-token length."""
    return [per_token_point(gpu, iters, rng, rows) for rows in PER_TOKEN]


def per_token_point(gpu: Any, iters: int, rng: np.random.Generator, rows: int) -> dict[str, Any]:
    """The selection alone of one row filling a slot of ``rows`` rows at the per-token indexers'
    shape (kpool 1, top 2048, no tail), over normal random scores."""
    topk, kpool = 2048, 1
    sel_cap = selection_capacity(rows, topk, kpool, K - 1)
    scores = rng.standard_normal(rows).astype(np.float32)
    ptrs: dict[str, Any] = {}

    def up(name: str, a: np.ndarray) -> None:
        ptrs[name] = gpu.alloc(max(a.nbytes, 16))
        gpu.copy_h2d(ptrs[name], np.ascontiguousarray(a))

    up("scores", scores)
    up("entries", pack_entries([0], [rows - 1], [0]))
    up("sel", np.zeros(sel_cap, np.uint32))
    up("cnt", np.zeros(1, np.uint32))
    up("ws", np.zeros(max(select_workspace_bytes(1, rows, kpool) // 4, 1), np.uint32))
    try:

        def select(s: int) -> None:
            dsa_select.select_topk_pools_batch(
                gpu,
                scores=ptrs["scores"],
                selected=ptrs["sel"],
                count=ptrs["cnt"],
                entries=ptrs["entries"],
                m=1,
                row_add=0,
                slot_rows=rows,
                sel_cap=sel_cap,
                topk_pools=topk,
                kpool=kpool,
                tail=False,
                workspace=ptrs["ws"],
                stream=s,
            )

        s = gpu.create_stream()
        try:
            us = _graph_us(gpu, s, select, iters, f"select per-token {rows}")
        finally:
            gpu.destroy_stream(s)
        cnt = np.empty(1, np.uint32)
        gpu.copy_d2h(cnt, ptrs["cnt"])
        got = np.empty(int(cnt[0]), np.uint32)
        if got.size:
            gpu.copy_d2h(got, ptrs["sel"])
        exact = bool(np.array_equal(got, select_rows_ref(scores, rows - 1, topk, kpool, False)))
        print(f"per-token selection, {rows:>6} rows, top {topk}: {us:6.1f} us; exact: {exact}", flush=True)
        return {"rows": rows, "topk": topk, "select_us": us, "selection_exact": exact}
    finally:
        for p in ptrs.values():
            gpu.free(p)


def propose_rows(
    gpu: Any,
    bw: float,
    iters: int,
    rng: np.random.Generator,
    cfg: Any = None,
    contexts: tuple[int, ...] = CONTEXTS,
    fp8_weights: bool = True,
) -> list[dict[str, Any]]:
    """Part 2: propose(k = 3) of one sequence at each context, against its floor (``cfg``: GLM-5.3-Flash
    with the full reservation; a tiny config runs the same code on the host backend), with the
    published checkpoint's FP8 tensors native (``fp8_weights``) or all BF16."""
    from bench.bench_propose import Arm, ArmProposer, draft_bytes, fill_context, time_graph, time_propose
    from model.checkpoint.random_init import tiled_fp8_weights, tiled_mtp_weights
    from model.proposer import ProposerOptions

    cfg = cfg or glm5_flash(max_context=REACH)
    d = cfg.dsa
    reach = cfg.dsa.max_context
    t0 = time.time()
    weights = (tiled_fp8_weights if fp8_weights else tiled_mtp_weights)(cfg)
    opt = ProposerOptions(served_max_seq_len=reach, max_draft_tokens=K, max_sequences=1, fp8_head=True)
    prop = ArmProposer(gpu, cfg, weights, opt)
    del weights
    print(f"proposer of reach {prop.drafter_context_rows} built in {time.time() - t0:.0f} s", flush=True)
    hid = rng.standard_normal(cfg.hidden_size, dtype=np.float32).astype(BF16)
    hidden = gpu.alloc(hid.nbytes)
    gpu.copy_h2d(hidden, hid)
    out = []
    try:
        for want_ctx in contexts:
            ctx = min(want_ctx, prop.drafter_context_rows - K)
            npools = complete_pools(ctx, d.index_kpool)
            per_draft = 0
            for i in range(K):
                b = draft_bytes(prop, ctx + i, True)
                b["caches"] -= complete_pools(ctx + i, d.index_kpool) * (d.index_head_dim + 4)
                per_draft += sum(b.values())
            runs = 1 if d.share_for_mtp_iteration else K
            idx_bytes = runs * indexer_score_bytes(npools, d.index_head_dim)
            floor_ms = (per_draft + idx_bytes) / bw * 1e3
            row: dict[str, Any] = {
                "context": ctx,
                "pools": npools,
                "floor_ms": floor_ms,
                "indexer_MB": idx_bytes / 1e6,
                "bytes_MB": (per_draft + idx_bytes) / 1e6,
            }
            st = prop.alloc_state(Arm(fp8=True, graphs=True))
            try:
                fill_context(prop, st, ctx, rng)
                wall, drafts = time_propose(prop, st, hidden, ctx, K, max(iters // 4, 3), rng)
                assert all(0 <= t < cfg.vocab_size for t in drafts), drafts
                row["graph_device_ms"] = time_graph(prop, st, K, iters)
                row["propose_wall_ms"] = wall
                row["x_floor"] = row["graph_device_ms"] / floor_ms
                print(
                    f"context {ctx:>7} ({npools} pools): propose(k={K}) graph {row['graph_device_ms']:.3f} ms "
                    f"device, floor {floor_ms:.3f} ms ({row['bytes_MB']:.0f} MB, of which indexer "
                    f"{row['indexer_MB']:.1f} MB): {row['x_floor']:.2f}x; wall {wall:.3f} ms",
                    flush=True,
                )
            except ValueError as e:
                row["error"] = repr(e)
                print(f"context {ctx}: propose failed: {e}", flush=True)
            finally:
                prop.free_state(st)
            out.append(row)
    finally:
        gpu.free(hidden)
        prop.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30, help="timed replays per point (median)")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    ap.add_argument("--no-propose", dest="propose", action="store_false", help="the kernels only")
    ap.add_argument("--bf16-weights", dest="fp8", action="store_false", help="propose with all weights BF16")
    args = ap.parse_args(argv)
    from bench.bench_propose import copy_bandwidth
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    try:
        bw = copy_bandwidth(gpu)
        print(
            f"device {getattr(gpu, 'device_name', gpu.name)}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write)",
            flush=True,
        )
        rng = np.random.default_rng(1)
        res: dict[str, Any] = {"device": getattr(gpu, "device_name", gpu.name), "copy_bw_GBps": bw / 1e9}
        res["kernels"] = kernel_rows(gpu, bw, args.iters, rng)
        res["per_token"] = per_token_rows(gpu, args.iters, rng)
        if args.propose:
            res["propose"] = propose_rows(gpu, bw, args.iters, rng, fp8_weights=args.fp8)
    finally:
        gpu.close()
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
