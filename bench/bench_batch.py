"""Batched drafting benchmark: ``propose_batch`` for B sequences against its byte floor (the parts
bench/bench_propose.py wires into its run; issue 15's "Numbers to reach").

    python3 bench/bench_batch.py [--model glm5_next|glm5|deepseek_v32] [--weights bf16,fp8]
        [--batches 1,64] [--kinds uniform,ragged,longest,N] [--k 3] [--iters 20] [--json PATH]

One point per batch size B (1, 2, 4, ..., 256 by default), the B sequences at the contexts of
``contexts_for``: every one at 4096 (``uniform``), spread evenly over 128..16000 (``ragged``), at
the model's longest context (``longest``: ``longest_context``) or at a given number of rows. The
model (``--model``) is GLM-5.3-Flash (``glm5_next``, KPool indexer, NoPE MLA), GLM-5.2 (``glm5``) or
DeepSeek-V3.2 (``deepseek_v32``): MLA with RoPE, whose rows keep a BF16 rope key beside the
latent, and the per-token indexer (one FP8 key and scale per token, read whole by every draft
that runs it: these models do not share draft 1's selection).

- The floor of one ``propose_batch`` of k drafts is the bytes it must move over the measured copy
  bandwidth (``batch_floor_bytes``): per draft, the block's weights once for the whole batch, the
  distinct routed experts the batch chose in that draft (counted from the router's ids, or their
  expectation under uniform routing when the caller has no ids), the head once; and every
  sequence's own cache traffic: its selection's latent rows and scales (and rope keys), its pool
  keys and scales when the indexer runs (draft 1 only where drafts share its selection), its
  embedding row (and the target's hidden row on draft 1), and the rows it writes (latent, rope key,
  the KPool indexer's key and gate, the pool it completes: every row's own with the per-token
  indexer).
- ``measure_batch`` allocates the B states, fills their contexts through ``catchup_batch`` (random
  tokens and hidden rows, the real cache kernels; or bench_propose's fast direct fill), times the
  graph-replayed ``propose_batch`` (the graph it launches is caught and replayed back to back
  between events, median), its wall time and host CPU time, and a whole drafter step: the re-feed
  of each sequence's accepted rows by one ``catchup_batch`` and then ``propose_batch``, against
  that step's floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

if not __package__:  # run as a script (python bench/bench_batch.py): find bench/, model/, runtime/
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402 - after the sys.path insert

from bench.bench_propose import (
    MODELS,
    copy_bandwidth,
    draft_bytes,
    fill_context,
    model_config,
    pool_key_bytes,
    selected_row_bytes,
    selection_size,
)
from model.config import ModelConfig
from model.kernels.dsa_select import complete_pools, select_workspace_bytes
from model.slot_pools import slot_bytes_by_kind
from model.weights import Sharding, context_rows, fused_in_rows
from runtime.dtypes import BF16

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
UNIFORM_CONTEXT = 4096
RAGGED_CONTEXTS = (128, 16000)
LONGEST = "longest"  # every sequence at the model's longest context (longest_context)
# Device memory a run leaves to what the estimates do not count: the CUDA context, captured graphs,
# PyTorch's allocator slack, the copy-bandwidth buffers (2 x 2 GiB, freed before the proposer).
MEMORY_RESERVE = 6 << 30
# A batch row's scratch besides its index scores, bounded (the attention's split partials and the
# rest: about 5 MB a row at GLM-5.3-Flash's shapes, BENCHMARKS.md's memory table).
SCRATCH_ROW = 16 << 20
# The weight buffers of draft_bytes that a batch reads once per draft (the experts and the head apart).
BLOCK_WEIGHTS = ("eh_proj", "fused_in", "q_fused", "wk_t", "wv", "o_proj", "router", "shared_expert")


# ---- what a batch is ------------------------------------------------------------------------------


def longest_context(cfg: ModelConfig, k: int) -> int:
    """The model's longest context a whole drafter step runs at: ``max_position_embeddings`` less
    the 2k + 1 rows measure_batch appends after it (the kept first row, up to k re-fed, k drafted),
    so every row it writes sits at a position the model serves (GLM-5: 202,752 - 7 at k = 3)."""
    n = cfg.max_position_embeddings - 2 * k - 1
    if n < 1:
        raise ValueError(f"max_position_embeddings {cfg.max_position_embeddings} leaves no context at k={k}")
    return n


def resolve_kind(kind: str | int, cfg: ModelConfig, k: int) -> str | int:
    """A ``--kinds`` entry as contexts_for takes it: ``"longest"`` becomes ``longest_context`` (an
    int), digits an int; ``"uniform"`` and ``"ragged"`` stay."""
    if kind == LONGEST:
        return longest_context(cfg, k)
    if isinstance(kind, str) and kind.isdigit():
        return int(kind)
    return kind


def contexts_for(kind: str | int, batch: int, rng: np.random.Generator | None = None) -> list[int]:
    """The cached rows of each of ``batch`` sequences: ``"uniform"`` (all at 4096), ``"ragged"``
    (evenly spread over 128..16000, ends included; one sequence sits at the middle, 8064), or an
    int or a string of digits (all at that). ``rng`` shuffles the order (the set stays)."""
    if isinstance(kind, str) and kind.isdigit():  # a row's "kind" of an int context, as recorded
        kind = int(kind)
    if isinstance(kind, (int, np.integer)):
        ctx = [int(kind)] * batch
    elif kind == "uniform":
        ctx = [UNIFORM_CONTEXT] * batch
    elif kind == "ragged":
        lo, hi = RAGGED_CONTEXTS
        ctx = [(lo + hi) // 2] if batch == 1 else [int(round(c)) for c in np.linspace(lo, hi, batch)]
    else:
        raise ValueError(f"contexts kind {kind!r}: 'uniform', 'ragged' or an int")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if rng is not None:
        ctx = [ctx[i] for i in rng.permutation(batch)]
    return ctx


def distinct_experts(ids: np.ndarray, n_experts: int) -> int:
    """How many different experts appear in ``ids`` (any shape: one draft's [B, top_k] router
    choices). An id outside 0..n_experts-1 is refused (a padding row's or an unwritten buffer's:
    the caller slices those off), not counted."""
    a = np.asarray(ids)
    if a.size == 0:
        return 0
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"expert ids must be integers, got {a.dtype}")
    if a.min() < 0 or a.max() >= n_experts:
        raise ValueError(f"expert ids must lie in 0..{n_experts - 1}, got {a.min()}..{a.max()}")
    return int(np.count_nonzero(np.bincount(a.reshape(-1).astype(np.int64), minlength=n_experts)))


def expected_distinct_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts ``batch`` rows choose on average when each row's top_k set is uniform: an
    expert is missed by one row with probability 1 - top_k / n_experts (about 104 of 288 at
    B = 16 for top-8, 241 at B = 64)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch)


# ---- bytes ----------------------------------------------------------------------------------------


def _floor_view(cfg_or_prop: Any, fp8: bool = False) -> Any:
    """What draft_bytes reads of a proposer (cfg, sharding, the projections' segments, o_proj and
    the experts' kind, the head's rows), from a proposer itself or built from a config as
    MtpProposer lays its weights out: BF16, or with ``fp8`` the published checkpoint's FP8
    tensors kept native (kv_a, q_a, q_b, o_proj, the experts)."""
    if not isinstance(cfg_or_prop, ModelConfig):
        return cfg_or_prop
    cfg = cfg_or_prop
    a, d, V = cfg.attention, cfg.dsa, cfg.vocab_size
    W = cfg.parallel.world_size
    heads = a.num_attention_heads
    # o_proj's bytes do not depend on its group count; one group per head always divides.
    sh = Sharding.for_config(cfg, heads)
    C, ql, idim, ih = a.kv_lora_rank, a.q_lora_rank, d.index_head_dim, d.index_n_heads
    scale = object() if fp8 else None

    def seg(rows: int, is_fp8: bool) -> SimpleNamespace:
        return SimpleNamespace(rows=rows, scales=scale if is_fp8 else None)

    # kv_a_proj_with_mqa (the latent's rows and the rope key's) and q_a are FP8 in the checkpoint.
    kv_a = C + a.qk_rope_head_dim
    bf16_rows = fused_in_rows(cfg) - kv_a - ql
    fused = (
        [seg(kv_a, True), seg(ql, True), seg(bf16_rows, False)] if fp8 else [seg(fused_in_rows(cfg), False)]
    )
    q_rows = sh.local_heads * a.qk_head_dim
    q_segs = [seg(q_rows, True), seg(ih * idim, False)] if fp8 else [seg(q_rows + ih * idim, False)]
    return SimpleNamespace(
        cfg=cfg,
        sharding=sh,
        layer=SimpleNamespace(
            attn=SimpleNamespace(
                fused_rows=fused_in_rows(cfg), fused_full=fused, q_segments=q_segs, o_scales=scale
            ),
            mlp=SimpleNamespace(gate_up_scales=scale),
        ),
        head_n=V // W if V % W == 0 else V,
    )


def _cfg(cfg_or_prop: Any) -> ModelConfig:
    return cfg_or_prop if isinstance(cfg_or_prop, ModelConfig) else cfg_or_prop.cfg


def _row_writes(cfg: ModelConfig, row: int) -> int:
    """Bytes a row writes to its sequence's caches: the FP8 latent and its scale, its BF16 rope key
    (an MLA with a rope part), the KPool indexer's BF16 key and gate, and, when the row completes a
    pool, the pool's FP8 key and scale from the pool's other rows' keys and gates (read back). The
    per-token indexer keeps no BF16 key or gate: every row completes its own pool, its FP8 key."""
    a, d = cfg.attention, cfg.dsa
    idim, kp = d.index_head_dim, d.index_kpool
    key_gate = 0 if d.per_token else 2 * idim * 2
    out = (a.kv_lora_rank + 4) + a.qk_rope_head_dim * 2 + key_gate
    if (row + 1) % kp == 0:
        out += (kp - 1) * key_gate + pool_key_bytes(cfg)
    return out


def sequence_bytes(cfg: ModelConfig, context: int, k: int) -> tuple[int, int]:
    """(reads, writes) of one sequence's own cache traffic over a k-draft propose at ``context``:
    draft i attends its selection (draft 1's plus the rows drafted since, where drafts share it),
    reads the pool keys when it runs the indexer, its embedding row, the target's hidden row on
    draft 1; and writes its row. The per-token indexer's pools are its tokens: a draft at row n
    that runs it reads the n + 1 keys of rows 0..n."""
    d, H = cfg.dsa, cfg.hidden_size
    row_b, key_b = selected_row_bytes(cfg), pool_key_bytes(cfg)
    reads = writes = 0
    sel0 = selection_size(cfg, context)
    for i in range(k):
        row = context + i
        if d.share_for_mtp_iteration and i > 0:
            sel, pools = sel0 + (i if d.always_select_tail else 0), 0
        else:
            sel, pools = selection_size(cfg, row), complete_pools(row, d.index_kpool)
        reads += sel * row_b + pools * key_b + H * 2 + (H * 2 if i == 0 else 0)
        writes += _row_writes(cfg, row)
    return reads, writes


def batch_floor_bytes(
    cfg: Any,
    contexts: Sequence[int],
    k: int,
    chosen_experts_per_draft: Sequence[float],
    fp8_head: bool,
    fp8_weights: bool = False,
) -> dict[str, int]:
    """Bytes one ``propose_batch`` of k drafts must move for sequences at ``contexts`` (``cfg``: a
    ModelConfig, or the proposer itself so its own buffer sizes are counted, as draft_bytes does).
    ``chosen_experts_per_draft[i]``: distinct routed experts the batch chose in draft i.

    Keys: ``block`` (draft_bytes' BLOCK_WEIGHTS, once per draft), ``experts`` (each chosen expert's
    gate_up and down once per draft), ``head``, ``cache_reads`` and ``cache_writes`` (every
    sequence's, ``sequence_bytes``), ``total``."""
    view, c = _floor_view(cfg, fp8_weights), _cfg(cfg)
    contexts = [int(x) for x in contexts]
    if k < 1 or not contexts:
        raise ValueError(f"need k >= 1 and at least one sequence, got k={k}, {len(contexts)} sequences")
    if len(chosen_experts_per_draft) != k:
        raise ValueError(f"{len(chosen_experts_per_draft)} expert counts for {k} drafts")
    m = c.moe
    n_local = view.sharding.local_experts
    for n in chosen_experts_per_draft:
        if not 0 <= n <= n_local:
            raise ValueError(f"{n} distinct experts in a draft: outside 0..{n_local}")
    w = draft_bytes(view, contexts[0], fp8_head)
    per_expert = w["experts"] // m.num_experts_per_tok
    reads = writes = 0
    for ctx in contexts:
        r, wr = sequence_bytes(c, ctx, k)
        reads, writes = reads + r, writes + wr
    out = {
        "block": k * sum(w[name] for name in BLOCK_WEIGHTS),
        "experts": int(round(sum(chosen_experts_per_draft) * per_expert)),
        "head": k * w["head"],
        "cache_reads": reads,
        "cache_writes": writes,
    }
    out["total"] = sum(out.values())
    return out


def catchup_floor_bytes(cfg: Any, row_bases: Sequence[int], rows: Sequence[int]) -> dict[str, int]:
    """Bytes one ``catchup_batch`` must move to append ``rows[b]`` rows at ``row_bases[b]`` to
    sequence b: eh_proj and the cache part of the fused projection (``context_rows``: the latent,
    rope key, indexer key and gate rows) once for the batch, and per row its embedding row, its
    hidden row and the cache bytes it writes. Nothing when no sequence gains a row."""
    c = _cfg(cfg)
    H = c.hidden_size
    total_rows = sum(int(r) for r in rows)
    if total_rows == 0:
        return {"weights": 0, "inputs": 0, "cache_writes": 0, "total": 0}
    ctx_rows = context_rows(c)  # rows of fused_in a context row needs
    writes = sum(_row_writes(c, base + r) for base, n in zip(row_bases, rows) for r in range(int(n)))
    out = {
        "weights": H * 2 * H * 2 + ctx_rows * H * 2,
        "inputs": total_rows * 2 * H * 2,
        "cache_writes": writes,
    }
    out["total"] = sum(out.values())
    return out


def step_floor_bytes(
    cfg: Any,
    contexts: Sequence[int],
    accepted: Sequence[int],
    k: int,
    chosen_experts_per_draft: Sequence[float],
    fp8_head: bool,
) -> dict[str, int]:
    """A whole drafter step for sequences that hold ``contexts[b] + 1`` rows (the last propose's
    first row kept) and had ``accepted[b]`` drafts accepted: the re-feed of those rows by one
    catchup_batch, then propose_batch at ``contexts[b] + 1 + accepted[b]``."""
    bases = [int(c) + 1 for c in contexts]
    cu = catchup_floor_bytes(cfg, bases, accepted)
    pr = batch_floor_bytes(
        cfg, [b + int(a) for b, a in zip(bases, accepted)], k, chosen_experts_per_draft, fp8_head
    )
    return {"catchup": cu["total"], "propose": pr["total"], "total": cu["total"] + pr["total"]}


# ---- memory ---------------------------------------------------------------------------------------


def proposer_memory(
    cfg: ModelConfig, slots: int, rows: int, fp8_weights: bool, fp8_head: bool = True
) -> dict[str, int]:
    """Device bytes an MtpProposer of ``max_sequences = slots`` and a served length of ``rows``
    holds, estimated from the config before anything is allocated: ``weights`` (the block as the
    loader lays it out, every local expert, the BF16 embedding and head, the FP8 head copy),
    ``caches`` (model/slot_pools.py ``slot_bytes_by_kind`` of every slot: all are allocated up
    front), ``scratch`` (the per-row index scores and the selection's workspace, which grow with
    the slot's rows, and ``SCRATCH_ROW`` for the rest of a batch row's), ``total``."""
    view = _floor_view(cfg, fp8_weights)
    a, d, m = cfg.attention, cfg.dsa, cfg.moe
    V, H = cfg.vocab_size, cfg.hidden_size
    w = draft_bytes(view, 0, fp8_head)
    experts = w["experts"] // m.num_experts_per_tok * view.sharding.local_experts
    head = V * H * 2 + (V * H + V * 4 if fp8_head else 0)
    per_slot = slot_bytes_by_kind(d, a.kv_lora_rank, rows, rope_dim=a.qk_rope_head_dim)
    out = {
        "weights": sum(w[n] for n in BLOCK_WEIGHTS) + experts + V * H * 2 + head,
        "caches": slots * sum(per_slot.values()),
        "scratch": slots * (max(rows // d.index_kpool, 1) * 4 + SCRATCH_ROW)
        + select_workspace_bytes(slots, rows, d.index_kpool),
    }
    out["total"] = sum(out.values())
    return out


def torch_step_memory(cfg: ModelConfig, batch: int, rows: int, fp8_experts: bool) -> dict[str, int]:
    """Device bytes bench/torch_step.py's batched step holds for ``batch`` sequences of ``rows``
    cache rows (an estimate): ``weights`` (BF16 block, experts and tables, the FP8 head copy, the
    FP8 expert copies with ``fp8_experts``; the batch-1 step's caches of 16,400 rows besides),
    ``caches`` (BF16 latents, rope keys, indexer keys, and the KPool indexer's gates and pool
    keys), ``indexer`` (one draft's [B, index heads, pools] scores: the BF16 product and two f32
    copies, and the sort), ``total``."""
    a, d, m = cfg.attention, cfg.dsa, cfg.moe
    V, H, E, I = cfg.vocab_size, cfg.hidden_size, m.n_routed_experts, m.moe_intermediate_size
    C, r, ql, nh, ih, idim = (
        a.kv_lora_rank,
        a.qk_rope_head_dim,
        a.q_lora_rank,
        a.num_attention_heads,
        d.index_n_heads,
        d.index_head_dim,
    )
    block = (
        2 * H * H
        + ql * H
        + nh * a.qk_head_dim * ql
        + (C + r) * H
        + nh * (a.qk_nope_head_dim + a.v_head_dim) * C
        + H * nh * a.v_head_dim
        + ih * idim * ql
        + idim * H * (1 if d.per_token else 2)
        + ih * H
        + E * H
    ) * 2
    experts = (E + 1) * 3 * I * H * 2
    fp8 = (E + 1) * 3 * I * H + (E + 1) * (2 * I + H) * 4 if fp8_experts else 0
    tables = 2 * V * H * 2 + V * H + V * 4

    def row_bytes() -> int:  # one cache row of one sequence, BF16
        if d.per_token:
            return (C + r + idim) * 2
        return (C + r + 2 * idim) * 2 + idim * 2 // d.index_kpool

    pools = rows // d.index_kpool
    out = {
        "weights": block + experts + fp8 + tables + 16400 * row_bytes(),
        "caches": batch * rows * row_bytes(),
        "indexer": batch * ih * pools * (2 + 4 + 4) + batch * pools * (4 + 8 + 4),
    }
    out["total"] = sum(out.values())
    return out


def memory_note(what: str, need: int, have: int, of: str = "free") -> str:
    """Why a point is skipped: it needs ``need`` bytes, the device has ``have`` (``of``: free, or
    in all), of which MEMORY_RESERVE is kept for what the estimates leave out."""
    return (
        f"{what} needs about {need / 1e9:.1f} GB of device memory; the device has {have / 1e9:.1f} GB "
        f"{of}, {MEMORY_RESERVE / 2**30:.0f} GiB of it kept in reserve: skipped"
    )


# ---- measuring ------------------------------------------------------------------------------------


@contextlib.contextmanager
def caught_graphs(gpu: Any) -> Iterator[list[tuple[Any, Any]]]:
    """Every (graph, stream) launched on ``gpu`` inside (the proposer's graph for a bucket is its
    own business; this finds it without asking), launching them as usual."""
    caught: list[tuple[Any, Any]] = []
    had = "graph_launch" in vars(gpu)
    old = vars(gpu).get("graph_launch")
    inner = gpu.graph_launch

    def launch(graph: Any, stream: Any = None) -> None:
        caught.append((graph, stream))
        inner(graph, stream)

    gpu.graph_launch = launch
    try:
        yield caught
    finally:
        if had:
            gpu.graph_launch = old
        else:
            del gpu.graph_launch


def time_graphs(gpu: Any, graphs: Sequence[tuple[Any, Any]], iters: int) -> float:
    """Median device milliseconds of one replay of ``graphs`` (in order), back to back."""
    stream = graphs[0][1]
    evs = [(gpu.event_create(), gpu.event_create()) for _ in range(iters)]
    try:
        for _ in range(3):
            for g, s in graphs:
                gpu.graph_launch(g, s)
        for a, b in evs:
            gpu.event_record(a, stream)
            for g, s in graphs:
                gpu.graph_launch(g, s)
            gpu.event_record(b, stream)
        gpu.synchronize(stream)
        return statistics.median(gpu.event_elapsed_ms(a, b) for a, b in evs)
    finally:
        for a, b in evs:
            gpu.event_destroy(a)
            gpu.event_destroy(b)


def _random_rows(gpu: Any, rng: np.random.Generator, rows: int, width: int) -> Any:
    buf = gpu.alloc(rows * width * 2)
    gpu.copy_h2d(buf, rng.standard_normal((rows, width), dtype=np.float32).astype(BF16))
    return buf


def fill_batch(
    prop: Any,
    states: Sequence[Any],
    rows: Sequence[int],
    rng: np.random.Generator,
    chunk: int = 512,
    how: str = "catchup",
) -> None:
    """Give ``states[b]`` ``rows[b]`` rows of context. ``catchup``: through ``catchup_batch``, up
    to ``chunk`` rows of each sequence per call (random tokens; hidden rows drawn from one random
    pool at per-sequence offsets), so the caches hold what the real kernels write; ``direct``:
    bench_propose's fill_context per state (random bytes written straight into the caches)."""
    if how == "direct":
        for st, n in zip(states, rows):
            fill_context(prop, st, int(n), rng)
        return
    if how != "catchup":
        raise ValueError(f"fill {how!r}: 'catchup' or 'direct'")
    cfg, gpu = prop.cfg, prop.gpu
    H, V, spread = cfg.hidden_size, cfg.vocab_size, 61
    pool = _random_rows(gpu, rng, chunk + spread, H)
    try:
        done = [0] * len(states)
        while True:
            todo = [b for b in range(len(states)) if done[b] < rows[b]]
            if not todo:
                break
            toks, hids, bases = [], [], []
            for b in todo:
                n = min(chunk, int(rows[b]) - done[b])
                toks.append([int(t) for t in rng.integers(0, V, n + 1)])
                hids.append(pool.offset(int(rng.integers(0, spread)) * H * 2))
                bases.append(done[b])
            prop.catchup_batch([states[b] for b in todo], toks, hids, bases)
            for b, t in zip(todo, toks):
                done[b] += len(t) - 1
    finally:
        gpu.free(pool)


def _host_s(prop: Any, states: Sequence[Any]) -> float:
    """The proposer's own account of its host time in the last call, the wait excluded (the
    batch-level ``last_host_s`` where the proposer keeps one, else the first state's)."""
    for obj in (prop, states[0]):
        v = getattr(obj, "last_host_s", None)
        if isinstance(v, (int, float)):
            return float(v)
    return float("nan")


ExpertIds = Callable[[Any, Sequence[Any], int], "np.ndarray | Sequence[np.ndarray]"]


def _chosen(
    prop: Any, states: Sequence[Any], k: int, expert_ids: ExpertIds | None
) -> tuple[list[float], str]:
    cfg, B = prop.cfg, len(states)
    m = cfg.moe
    if expert_ids is None:
        n = expected_distinct_experts(m.n_routed_experts, m.num_experts_per_tok, B)
        return [n] * k, "expected"
    ids = expert_ids(prop, states, k)
    per = [ids] * k if isinstance(ids, np.ndarray) else list(ids)
    if len(per) != k:
        raise ValueError(f"expert_ids gave {len(per)} drafts' ids for k={k}")
    return [float(distinct_experts(a, m.n_routed_experts)) for a in per], "router"


def measure_batch(
    prop: Any,
    gpu: Any,
    Bs: Sequence[int],
    contexts_kind: str | int,
    k: int,
    iters: int,
    rng: np.random.Generator,
    *,
    bandwidth: float | None = None,
    expert_ids: ExpertIds | None = None,
    fill: str = "catchup",
    step: bool = True,
    log: Callable[..., Any] = print,
    sampling: Any = None,
) -> list[dict[str, Any]]:
    """One row per batch size in ``Bs`` (``prop``: an MtpProposer with graphs on, max_sequences
    >= max(Bs), served length >= the largest context + 2k + 1).

    For each B: B fresh states at ``contexts_for(contexts_kind, B, rng)`` (filled by
    ``fill_batch``); ``propose_batch`` at those positions (the first call captures; the graph it
    launches is then replayed back to back between events: ``graph_device_ms``, median of
    ``iters``), its wall time (perf_counter around the call, median) and host CPU time (the
    proposer's ``last_host_s``); the floor (``batch_floor_bytes`` over ``bandwidth`` bytes/s,
    measured by copy_bandwidth when not given) with the distinct experts from ``expert_ids(prop,
    states, k)`` (one [B, top_k] id array per draft, or one for all, read after a propose) or their
    expectation under uniform routing; and, with ``step``, a whole drafter step: each sequence
    rewound to ``context + 1`` rows (untimed), then one ``catchup_batch`` re-feeding its accepted
    rows (random acceptance 0..k per sequence, fixed per B) and ``propose_batch`` after them, wall
    time and the device span between events around both (median), against ``step_floor_bytes``.
    With ``sampling`` (a SamplingParams), the same propose sampled: its graph's device time
    (``sampled_device_ms``) and its ratio to the greedy graph's. The states are freed before the
    next B."""
    cfg = prop.cfg
    H, V = cfg.hidden_size, cfg.vocab_size
    bw = bandwidth if bandwidth is not None else copy_bandwidth(gpu)
    fp8 = getattr(prop, "head_fp8", None) is not None
    out: list[dict[str, Any]] = []
    for B in Bs:
        ctx = contexts_for(contexts_kind, B, rng)
        states: list[Any] = []
        bufs: list[Any] = []
        try:
            for _ in range(B):
                states.append(prop.alloc_state())
            t0 = time.perf_counter()
            fill_batch(prop, states, ctx, rng, how=fill)
            fill_s = time.perf_counter() - t0
            hidden = _random_rows(gpu, rng, B, H)
            bufs.append(hidden)
            last = [int(t) for t in rng.integers(0, V, B)]
            prop.propose_batch(states, last, hidden, ctx, k)  # captures the bucket's graph
            with caught_graphs(gpu) as graphs:
                drafts = np.asarray(prop.propose_batch(states, last, hidden, ctx, k))
            if drafts.shape != (B, k) or drafts.min() < 0 or drafts.max() >= V:
                raise AssertionError(
                    f"propose_batch gave {drafts.shape} drafts {drafts.min()}..{drafts.max()}"
                )
            chosen, source = _chosen(prop, states, k, expert_ids)
            walls, hosts = [], []
            for _ in range(iters):
                t1 = time.perf_counter()
                prop.propose_batch(states, last, hidden, ctx, k)
                walls.append(time.perf_counter() - t1)
                hosts.append(_host_s(prop, states))
            device_ms = time_graphs(gpu, graphs, iters) if graphs else float("nan")
            sampled_ms = float("nan")
            if sampling is not None:
                prop.propose_batch(states, last, hidden, ctx, k, sampling=sampling)  # captures
                with caught_graphs(gpu) as sgraphs:
                    prop.propose_batch(states, last, hidden, ctx, k, sampling=sampling)
                sampled_ms = time_graphs(gpu, sgraphs, iters) if sgraphs else float("nan")
            fb = batch_floor_bytes(prop, ctx, k, chosen, fp8)
            row: dict[str, Any] = {
                "kind": str(contexts_kind),
                "B": B,
                "k": k,
                "head": ("fp8 tc" if getattr(prop, "tensor_core_head", False) else "fp8") if fp8 else "bf16",
                "contexts": [min(ctx), int(round(statistics.mean(ctx))), max(ctx)],
                "fill_s": fill_s,
                "distinct_experts": chosen,
                "experts_from": source,
                "floor_bytes": fb,
                "floor_ms": fb["total"] / bw * 1e3,
                "graph_device_ms": device_ms,
                "graph_wall_ms": statistics.median(walls) * 1e3,
                "host_cpu_us": statistics.median(hosts) * 1e6,
                "weights": "fp8" if getattr(prop.layer.mlp, "fp8", False) else "bf16",
            }
            if sampling is not None:
                row["sampled_device_ms"] = sampled_ms
                row["sampled_over_greedy"] = sampled_ms / device_ms
            row["host_us"] = (row["graph_wall_ms"] - device_ms) * 1e3
            row["over_floor"] = device_ms / row["floor_ms"]
            row["ms_per_seq_draft"] = device_ms / (B * k)
            if step:
                row.update(
                    _measure_step(prop, gpu, states, ctx, last, hidden, k, iters, rng, chosen, fp8, bw)
                )
            out.append(row)
            log(
                f"{row['kind']} B {B:>3} k {k}: floor {row['floor_ms']:.3f} ms, graph {device_ms:.3f} ms "
                f"({row['over_floor']:.2f}x), {row['ms_per_seq_draft'] * 1e3:.1f} us per sequence-draft, "
                f"wall {row['graph_wall_ms']:.3f} ms, host CPU {row['host_cpu_us']:.0f} us"
                + (
                    f"; sampled {sampled_ms:.3f} ms ({sampled_ms / device_ms:.3f}x)"
                    if sampling is not None
                    else ""
                )
                + (
                    f"; step {row['step_wall_ms']:.3f} ms wall ({row['step_over_floor']:.2f}x its floor)"
                    if step
                    else ""
                ),
                flush=True,
            )
        finally:
            for st in states:
                prop.free_state(st)
            for buf in bufs:
                gpu.free(buf)
    return out


def _measure_step(
    prop: Any,
    gpu: Any,
    states: Sequence[Any],
    ctx: Sequence[int],
    last: Sequence[int],
    hidden: Any,
    k: int,
    iters: int,
    rng: np.random.Generator,
    chosen: Sequence[float],
    fp8: bool,
    bw: float,
) -> dict[str, Any]:
    """The whole drafter step of measure_batch (re-feed of the accepted rows, then propose)."""
    s, H, V = prop.stream, prop.cfg.hidden_size, prop.cfg.vocab_size
    B = len(states)
    acc = [int(a) for a in rng.integers(0, k + 1, B)]
    feed = [b for b in range(B) if acc[b]]
    toks = [[int(t) for t in rng.integers(0, V, acc[b] + 1)] for b in feed]
    rows = _random_rows(gpu, rng, max(sum(acc), 1), H)
    offs = np.concatenate([[0], np.cumsum([acc[b] for b in feed])]).astype(int)
    hids = [rows.offset(int(o) * H * 2) for o in offs[:-1]]
    bases = [ctx[b] + 1 for b in feed]
    pos = [c + 1 + a for c, a in zip(ctx, acc)]
    e0, e1 = gpu.event_create(), gpu.event_create()
    walls, spans = [], []
    try:
        for it in range(iters + 1):
            for st, c in zip(states, ctx):
                prop.rewind_to(st, c + 1)
            t0 = time.perf_counter()
            gpu.event_record(e0, s)
            if feed:
                prop.catchup_batch([states[b] for b in feed], toks, hids, bases)
            prop.propose_batch(states, last, hidden, pos, k)
            gpu.event_record(e1, s)
            wall = time.perf_counter() - t0
            gpu.synchronize(s)
            if it:  # the first one captures what the new positions need
                walls.append(wall)
                spans.append(gpu.event_elapsed_ms(e0, e1))
    finally:
        gpu.event_destroy(e0)
        gpu.event_destroy(e1)
        gpu.free(rows)
    fb = step_floor_bytes(prop, ctx, acc, k, chosen, fp8)
    out = {
        "step_accepted_mean": statistics.mean(acc),
        "step_floor_bytes": fb,
        "step_floor_ms": fb["total"] / bw * 1e3,
        "step_wall_ms": statistics.median(walls) * 1e3,
        "step_span_ms": statistics.median(spans),
    }
    out["step_over_floor"] = out["step_wall_ms"] / out["step_floor_ms"]
    return out


# ---- reporting ------------------------------------------------------------------------------------


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def batch_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of measure_batch rows. Columns for the PyTorch batched step appear when
    rows carry ``torch_graph_ms`` (bench/torch_step.py run_batch at the same contexts)."""
    torch_cols = any("torch_graph_ms" in r for r in rows)
    torch8_cols = any("torch_fp8_graph_ms" in r for r in rows)
    step_cols = any("step_wall_ms" in r for r in rows)
    sample_cols = any("sampled_device_ms" in r for r in rows)
    head = [
        "contexts",
        "B",
        "k",
        "weights",
        "head",
        "distinct experts / draft",
        "MB / propose",
        "floor ms",
        "graph ms (device)",
        "x floor",
        "us / seq-draft",
        "wall ms",
        "wall - device us",
        "host CPU us",
    ]
    if step_cols:
        head += ["step floor ms", "step wall ms", "step x floor"]
    if sample_cols:
        head += ["sampled ms", "sampled / greedy"]
    if torch_cols:
        head += ["torch graph ms", "torch / ours"]
    if torch8_cols:
        head += ["torch FP8-experts ms", "torch FP8 / ours"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if h in ("contexts", "head", "weights") else "---:" for h in head) + "|",
    ]
    for r in rows:
        lo, mean, hi = r["contexts"]
        ctx = f"{r['kind']} {lo}" if lo == hi else f"{r['kind']} {lo}..{hi} (mean {mean})"
        de = r["distinct_experts"]
        de_s = "/".join(f"{x:.0f}" for x in de) + (
            " (expected)" if r.get("experts_from") == "expected" else ""
        )
        cells = [
            ctx,
            str(r["B"]),
            str(r["k"]),
            r.get("weights", "bf16"),
            r["head"],
            de_s,
            f"{r['floor_bytes']['total'] / 1e6:.0f}",
            _f(r["floor_ms"], ".3f"),
            _f(r["graph_device_ms"], ".3f"),
            _f(r["over_floor"], ".2f"),
            _f(r["ms_per_seq_draft"] * 1e3, ".1f"),
            _f(r["graph_wall_ms"], ".3f"),
            _f(r["host_us"], ".0f"),
            _f(r["host_cpu_us"], ".0f"),
        ]
        if step_cols:
            cells += [
                _f(r.get("step_floor_ms"), ".3f"),
                _f(r.get("step_wall_ms"), ".3f"),
                _f(r.get("step_over_floor"), ".2f"),
            ]
        if sample_cols:
            cells += [_f(r.get("sampled_device_ms"), ".3f"), _f(r.get("sampled_over_greedy"), ".3f")]
        for col, key in ((torch_cols, "torch_graph_ms"), (torch8_cols, "torch_fp8_graph_ms")):
            if col:
                tg = r.get(key)
                ratio = tg / r["graph_device_ms"] if tg is not None and r["graph_device_ms"] else None
                cells += [_f(tg, ".3f"), _f(ratio, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the run ---------------------------------------------------------------------------------------


def _attention_split_rows(choice: str) -> int | None:
    """--attention: None (auto), 0 (the split pair) or the wide pair's split length."""
    return None if choice == "auto" else 0 if choice == "pair" else int(choice)


def run(args: Any, gpu: Any) -> dict[str, Any]:
    """The batch benchmark on ``gpu`` at the shapes of ``args.model`` (``MODELS``: GLM-5.3-Flash,
    GLM-5.2 or DeepSeek-V3.2): every B of ``args.batches`` for every context kind of
    ``args.kinds`` (``resolve_kind``: ``longest`` is the model's longest context), the floor's
    experts counted from the router's own ids, and the same batches through the plain PyTorch step
    (bench/torch_step.py run_batch) unless ``args.torch`` is off.

    The proposer is sized for the run's longest context (its served length, at least the presets'
    16384) and its largest batch: every slot's caches are allocated up front. Where that does not
    fit the device (``proposer_memory``), the largest batches are dropped with a note until it
    does; a PyTorch row that would not fit (``torch_step_memory``) is skipped with a note."""
    from bench.bench_propose import Arm, ArmProposer
    from model.checkpoint.random_init import tiled_fp8_weights, tiled_mtp_weights
    from model.proposer import ProposerOptions
    from model.sampling import SamplingParams

    model = getattr(args, "model", "glm5_next")
    kinds = [resolve_kind(kd, model_config(model), args.k) for kd in args.kinds]
    served = max(max(contexts_for(kd, max(args.batches))) for kd in kinds) + 2 * args.k + 1
    cfg = model_config(model, served)
    bw = copy_bandwidth(gpu)
    print(f"{model}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    sampling = None
    if args.sampling:
        t, top_p, top_k = (list(map(float, args.sampling.split(","))) + [1.0, 0.0])[:3]
        sampling = SamplingParams(temperature=t, top_p=top_p, top_k=int(top_k), seed=1)
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": getattr(gpu, "device_name", gpu.name),
        "model": model,
        "served_rows": cfg.dsa.max_context,
        "copy_bw_GBps": bw / 1e9,
        "pdl": getattr(gpu, "pdl", None),
        "sampling": None if sampling is None else dataclasses.asdict(sampling),
        "rows": [],
        "memory_estimate": {},
    }
    for kind in args.weights:
        free = gpu.mem_info()[0] - MEMORY_RESERVE
        batches = sorted(set(args.batches))
        while batches:
            est = proposer_memory(cfg, batches[-1], cfg.dsa.max_context, kind == "fp8")
            print(
                f"{model} {kind} weights, {batches[-1]} sequences of {cfg.dsa.max_context} rows: about "
                + ", ".join(f"{n} {v / 1e9:.1f} GB" for n, v in est.items()),
                flush=True,
            )
            if est["total"] <= free:
                break
            print(
                memory_note(f"note: B = {batches[-1]} ({kind} weights)", est["total"], free + MEMORY_RESERVE),
                flush=True,
            )
            batches.pop()
        if not batches:
            continue
        res["memory_estimate"][kind] = est
        weights = (tiled_fp8_weights if kind == "fp8" else tiled_mtp_weights)(cfg)
        run_args = SimpleNamespace(**{**vars(args), "batches": tuple(batches)})
        _measure_weights(
            run_args, gpu, cfg, weights, bw, res, sampling, Arm, ArmProposer, ProposerOptions, kinds
        )
        del weights
    if args.torch:
        _torch_rows(args, res, cfg)
    return res


def _measure_weights(
    args: Any,
    gpu: Any,
    cfg: Any,
    weights: dict,
    bw: float,
    res: dict,
    sampling: Any,
    Arm,
    ArmProposer,
    ProposerOptions,
    kinds: Sequence[str | int] | None = None,
) -> None:
    """measure_batch over every context kind (``kinds``, resolved; ``args.kinds`` when None) for
    one proposer built from ``weights``, serving ``cfg.dsa.max_context`` rows."""
    # The router drawn at random, not tiled: tiled rows repeat, so the batch's rows route alike (110
    # of 288 experts per draft at B = 64 instead of about 241) and the floor and the MoE read fewer
    # experts than the PyTorch step's random router makes it read.
    gate = f"model.layers.{cfg.mtp_layer_index}.mlp.gate.weight"
    weights[gate] = (np.random.default_rng(5).standard_normal(weights[gate].shape, np.float32) * 0.02).astype(
        BF16
    )
    opt = ProposerOptions(
        served_max_seq_len=cfg.dsa.max_context,
        max_draft_tokens=args.k,
        max_sequences=max(args.batches),
        use_graphs=True,
        context_chunk=256,
        tensor_core_head={"auto": None, "tensor-core": True, "cuda-core": False}[args.head],
        tensor_core_projections={"auto": None, "tensor-core": True, "cuda-core": False}[args.projections],
        attention_split_rows=_attention_split_rows(getattr(args, "attention", "auto")),
    )
    prop = ArmProposer(gpu, cfg, weights, opt)
    del weights
    prop.arm = Arm(fp8=True, graphs=True)  # before any graph is captured

    def router_ids(p, states, k):
        B, H = len(states), cfg.hidden_size
        hid = _random_rows(gpu, np.random.default_rng(3), B, H)
        try:
            pos = [st.rows for st in states]
            return p.routed_ids(states, [1] * B, hid, pos, k)
        finally:
            for st, n in zip(states, pos):
                p.rewind_to(st, n)
            gpu.free(hid)

    res["tensor_core_head"] = prop.tensor_core_head
    res["tensor_core_projections"] = prop.tensor_core_projections
    res["attention_split_rows"] = prop.attention_split_rows
    rng = np.random.default_rng(1)
    try:
        for kind in args.kinds if kinds is None else kinds:
            res["rows"] += measure_batch(
                prop,
                gpu,
                args.batches,
                kind,
                args.k,
                args.iters,
                rng,
                bandwidth=bw,
                expert_ids=router_ids,
                fill="direct",
                step=kind == "uniform" and args.step,
                sampling=sampling,
            )
        res[f"memory_{res['rows'][-1]['weights']}"] = prop.memory_report()
        if args.profile:
            res["profile"] = profile_batch(prop, gpu, args.profile, args.k, rng)
            print(profile_table(res["profile"]), flush=True)
    finally:
        prop.close()


def _torch_rows(args, res, cfg: ModelConfig | None = None) -> None:
    """The same batches through the plain PyTorch step at ``cfg``'s shapes (GLM-5.3-Flash when
    None): BF16 experts for every row, and for the native-FP8 rows also FP8 experts through
    torch._scaled_grouped_mm (bench/torch_step.py). A row whose memory estimate does not fit the
    device is skipped with a note."""
    try:
        from bench import torch_step
    except Exception as e:  # noqa: BLE001 - the PyTorch rows are optional
        print(f"note: bench/torch_step.py unavailable ({e!r}); the PyTorch rows are skipped")
        return
    if cfg is None:
        cfg = model_config("glm5_next")
    done: dict[tuple, float] = {}
    for row in res["rows"]:
        ctx = contexts_for(row["kind"], row["B"], np.random.default_rng(0))
        arms = [("torch_graph_ms", False)] + (
            [("torch_fp8_graph_ms", True)] if row["weights"] == "fp8" else []
        )
        for key, fp8_experts in arms:
            memo = (row["kind"], row["B"], fp8_experts)
            if memo not in done:
                est = torch_step_memory(cfg, row["B"], max(ctx) + args.k + cfg.dsa.index_kpool, fp8_experts)
                total = torch_step.torch.cuda.mem_get_info()[1]
                done[memo] = float("nan")
                if est["total"] > total - MEMORY_RESERVE:
                    what = f"note: the torch step {key} at B {row['B']}"
                    print(memory_note(what, est["total"], total, "in all"), flush=True)
                else:
                    try:
                        done[memo] = torch_step.run_batch(
                            ctx,
                            args.k,
                            graph=True,
                            iters=args.iters,
                            fp8_head=True,
                            fp8_experts=fp8_experts,
                            cfg=cfg,
                        )
                    except Exception as e:  # noqa: BLE001 - reported, the other rows go on
                        print(f"note: torch step {key} at B {row['B']} failed: {e!r}", flush=True)
                    torch_step.torch.cuda.empty_cache()
            row[key] = done[memo]
            print(f"{row['kind']} B {row['B']}: {key} {row[key]:.3f} ms", flush=True)
        row["torch_over_ours"] = row["torch_graph_ms"] / row["graph_device_ms"]


def profile_batch(prop: Any, gpu: Any, B: int, k: int, rng: np.random.Generator) -> dict[str, Any]:
    """Device time per kernel of one eager ``propose_batch`` of B sequences at context 4096: each
    launch bracketed by events, queued behind a long copy so the kernels run back to back.
    Programmatic dependent launch is off while it records: a kernel that launches early under PDL
    would count its wait for the one before it (GLM-5.2's router read 54 us a draft that way)."""
    from bench.bench_propose import LaunchRecorder, pdl_set

    rec = LaunchRecorder(gpu)
    old_gpu, prop.gpu, prop.layer.gpu = prop.gpu, rec, rec
    states = [prop.alloc_state() for _ in range(B)]
    a, b = gpu.alloc(1 << 30), gpu.alloc(1 << 30)
    hid = _random_rows(gpu, rng, B, prop.cfg.hidden_size)
    arm, prop.arm = prop.arm, dataclasses_replace(prop.arm, graphs=False)
    marks: list = []
    try:
        for st in states:
            fill_context(prop, st, UNIFORM_CONTEXT, rng)
        last, pos = [1] * B, [UNIFORM_CONTEXT] * B
        prop.propose_batch(states, last, hid, pos, k)
        gpu.copy_d2d(b, a, 1 << 30, prop.stream)
        with pdl_set(gpu, False), rec.recording() as marks:
            prop.propose_batch(states, last, hid, pos, k)
        per: dict[str, float] = {}
        launches: dict[str, int] = {}
        for name, _, e0, e1 in marks:
            per[name] = per.get(name, 0.0) + gpu.event_elapsed_ms(e0, e1)
            launches[name] = launches.get(name, 0) + 1
        span = gpu.event_elapsed_ms(marks[0][2], marks[-1][3])
        return {"B": B, "k": k, "span_ms": span, "kernels_ms": per, "launches": launches}
    finally:
        for _, _, e0, e1 in marks:
            gpu.event_destroy(e0)
            gpu.event_destroy(e1)
        prop.arm = arm
        for st in states:
            prop.free_state(st)
        prop.gpu = prop.layer.gpu = old_gpu
        for p in (a, b, hid):
            gpu.free(p)


def dataclasses_replace(obj: Any, **kw: Any) -> Any:
    return dataclasses.replace(obj, **kw)


def profile_table(p: dict[str, Any]) -> str:
    lines = [
        f"Per-kernel device time of one eager propose_batch without PDL, B = {p['B']}, k = {p['k']}, "
        f"context 4096 (span {p['span_ms']:.2f} ms, {sum(p['launches'].values())} launches):",
        "",
        "| kernel | launches | ms per propose |",
        "|---|---:|---:|",
    ]
    for name, ms in sorted(p["kernels_ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {p['launches'][name]} | {ms:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(description="propose_batch against its byte floor and a plain PyTorch step")
    ap.add_argument("--batches", type=lambda s: tuple(int(v) for v in s.split(",")), default=BATCHES)
    ap.add_argument(
        "--kinds",
        type=lambda s: tuple(s.split(",")),
        default=("uniform", "ragged"),
        help="comma-separated context kinds: uniform (all at 4096), ragged (128..16000), longest (the "
        "model's longest: max_position_embeddings - 2k - 1), or a number of rows (all at that)",
    )
    ap.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="glm5_next",
        help="the shapes to run at: glm5_next (GLM-5.3-Flash), glm5 (GLM-5.2), deepseek_v32 (DeepSeek-V3.2)",
    )
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-torch", dest="torch", action="store_false")
    ap.add_argument(
        "--head",
        choices=("auto", "tensor-core", "cuda-core"),
        default="auto",
        help="ProposerOptions.tensor_core_head (auto: tensor cores for 4 or more sequences)",
    )
    ap.add_argument(
        "--projections",
        choices=("auto", "tensor-core", "cuda-core"),
        default="auto",
        help="ProposerOptions.tensor_core_projections (auto: tensor cores for 4 or more sequences)",
    )
    ap.add_argument(
        "--attention",
        choices=("auto", "pair", "64", "128", "192", "256"),
        default="auto",
        help="ProposerOptions.attention_split_rows: the split pair, or the wide pair at this split length "
        "(auto: the wide pair at 256 rows for 16 or more sequences)",
    )
    ap.add_argument(
        "--profile", type=int, default=0, help="per-kernel device time of one eager propose at this B"
    )
    ap.add_argument(
        "--weights",
        type=lambda s: tuple(s.split(",")),
        default=("bf16",),
        help="bf16 (the experts and projections BF16, as a dequantising loader keeps them), fp8 (the "
        "published FP8 tensors kept native), or both comma-separated",
    )
    ap.add_argument(
        "--sampling",
        default="",
        help="also time a sampled propose: temperature[,top_p[,top_k]] (e.g. 0.8,0.95)",
    )
    ap.add_argument("--no-step", dest="step", action="store_false", help="skip the whole drafter step")
    ap.add_argument("--ptx-dir", default=None, help="load the kernels' PTX from here (a variant build)")
    ap.add_argument(
        "--no-pdl",
        dest="pdl",
        action="store_false",
        help="capture and replay the graphs without programmatic dependent launch",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    for kd in args.kinds:  # refused before a GPU minute is spent
        try:
            contexts_for(resolve_kind(kd, model_config(args.model), args.k), 1)
        except ValueError as e:
            ap.error(str(e))
    from bench.bench_propose import pdl_set
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend(ptx_dir=args.ptx_dir)
    try:
        with pdl_set(gpu, args.pdl):
            res = run(args, gpu)
    finally:
        gpu.close()
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=float))
    print(batch_table(res["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
