"""MoE: sigmoid router, top-k with correction bias, and expert GEMVs that read the chosen ids from
device memory.

Slots: the routed experts fill slots 0..topk-1; the shared expert, when present, is slot topk,
with weight 1 (it has no gate: the published checkpoints store none, and transformers'
``Glm5NextTextMoE`` adds it ungated). ``expert_down`` writes one f32 row per slot (zero for an expert this rank does not hold), and
``bgemv.sum_rows_residual`` adds the rows in slot order, so the zero-padded all-reduce of a sharded
run reproduces one rank's arithmetic exactly. CUDA: ptx/moe.cu.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16
from runtime.kernel import F32, PTR, U32, Pdl, declare
from runtime.launch import launch


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-np.asarray(x, np.float32)))).astype(np.float32)


def clamped_swiglu(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    g = np.minimum(np.asarray(g, np.float32), np.float32(limit))
    u = np.clip(np.asarray(u, np.float32), -np.float32(limit), np.float32(limit))
    return g * sigmoid(g) * u


def route_ref(scores: np.ndarray, bias: np.ndarray, topk: int, norm: bool, scale: float):
    """ids by higher score+bias then lower index; weights from the unbiased scores."""
    sel = np.asarray(scores, np.float32) + np.asarray(bias, np.float32)
    ids = np.argsort(-sel.astype(np.float64), kind="stable")[:topk].astype(np.uint32)
    w = scores[ids].astype(np.float32)
    if norm:
        w = w / w.sum(dtype=np.float32)
    return ids, (w * np.float32(scale)).astype(np.float32)


@declare(
    "moe",
    "router_scores",
    [("w", PTR), ("y", PTR), ("scores", PTR), ("n", U32), ("h", U32)],
    writes=("scores",),
)
def ROUTER_SCORES(mem, w, y, scores, n, h):
    """scores[i] = sigmoid(w[i] . y), f32."""
    wv = mem.read(w, BF16, (n, h)).astype(np.float32)
    mem.write(scores, sigmoid(wv @ mem.read(y, BF16, h).astype(np.float32)))


@declare(
    "moe",
    "router_topk",
    [
        ("scores", PTR),
        ("bias", PTR),
        ("ids", PTR),
        ("weights", PTR),
        ("n_experts", U32),
        ("topk", U32),
        ("norm", U32),
        ("scale", F32),
        ("shared", U32),
    ],
    writes=("ids", "weights"),
)
def ROUTER_TOPK(mem, scores, bias, ids, weights, n_experts, topk, norm, scale, shared):
    """With ``shared``, slot topk gets id 0 and weight 1 (the ungated shared expert)."""
    s = mem.read(scores, np.float32, n_experts)
    i, w = route_ref(s, mem.read(bias, np.float32, n_experts), topk, bool(norm), scale)
    if shared:
        i = np.append(i, np.uint32(0))
        w = np.append(w, np.float32(1.0)).astype(np.float32)
    mem.write(ids, i)
    mem.write(weights, w)


_SLOTS = [("slot0", U32), ("nslots", U32), ("expert_base", U32), ("n_local", U32)]


@declare(
    "moe",
    "expert_gate_up",
    [("w", PTR), ("y", PTR), ("ids", PTR), ("act", PTR), *_SLOTS, ("inter", U32), ("h", U32), ("limit", F32)],
    writes=("act",),
)
def EXPERT_GATE_UP(mem, w, y, ids, act, slot0, nslots, expert_base, n_local, inter, h, limit):
    """act[j] = silu(min(g, L)) * clamp(u, -L, L) with [g; u] = w[e] @ y, for local experts.
    w is [n_local, 2*inter, h]: the gate rows, then the up rows."""
    yv = mem.read(y, BF16, h).astype(np.float32)
    idv = mem.read(ids, np.uint32, slot0 + nslots)
    for j in range(slot0, slot0 + nslots):
        e = int(idv[j]) - expert_base
        if not 0 <= e < n_local:
            continue
        we = mem.read(w.offset(e * 2 * inter * h * 2), BF16, (2 * inter, h)).astype(np.float32)
        gu = we @ yv
        mem.write(act.offset(j * inter * 2), clamped_swiglu(gu[:inter], gu[inter:], limit).astype(BF16))


@declare(
    "moe",
    "expert_down",
    [
        ("w", PTR),
        ("act", PTR),
        ("ids", PTR),
        ("weights", PTR),
        ("parts", PTR),
        *_SLOTS,
        ("h", U32),
        ("inter", U32),
    ],
    writes=("parts",),
)
def EXPERT_DOWN(mem, w, act, ids, weights, parts, slot0, nslots, expert_base, n_local, h, inter):
    """parts[j] = weights[j] * (w[e] @ act[j]) in f32; zeros where the expert is not local."""
    idv = mem.read(ids, np.uint32, slot0 + nslots)
    wt = mem.read(weights, np.float32, slot0 + nslots)
    for j in range(slot0, slot0 + nslots):
        e = int(idv[j]) - expert_base
        if not 0 <= e < n_local:
            mem.write(parts.offset(j * h * 4), np.zeros(h, np.float32))
            continue
        we = mem.read(w.offset(e * h * inter * 2), BF16, (h, inter)).astype(np.float32)
        a = mem.read(act.offset(j * inter * 2), BF16, inter).astype(np.float32)
        mem.write(parts.offset(j * h * 4), (np.float32(wt[j]) * (we @ a)).astype(np.float32))


@declare(
    "moe",
    "router_fused",
    [
        ("w", PTR),
        ("y", PTR),
        ("bias", PTR),
        ("scores", PTR),
        ("ids", PTR),
        ("weights", PTR),
        ("counter", PTR),
        ("n_experts", U32),
        ("h", U32),
        ("topk", U32),
        ("norm", U32),
        ("scale", F32),
        ("shared", U32),
    ],
    writes=("scores", "ids", "weights", "counter"),
    pdl=True,
    releases=True,  # moe_gate_up's shared slot runs beside it
)
def ROUTER_FUSED(mem, w, y, bias, scores, ids, weights, counter, n_experts, h, topk, norm, scale, shared):
    """router_scores over the n_experts rows, then router_topk, in one launch; the last block
    runs the top-k. ``counter`` is a zeroed u32 the kernel leaves zeroed."""
    ROUTER_SCORES.host(mem, w, y, scores, n_experts, h)
    ROUTER_TOPK.host(mem, scores, bias, ids, weights, n_experts, topk, norm, scale, shared)
    mem.write(counter, np.zeros(1, np.uint32))


_MOE = [("ntopk", U32), ("expert_base", U32), ("n_local", U32)]
# shared: 0 no shared-expert slot, 1 slot ntopk is the shared expert (w_shared, [1, 2I, H] /
# [1, H, I]), 2 the slot exists but another rank holds the shared expert (its parts row is zero).
SHARED_NONE, SHARED_HERE, SHARED_ELSEWHERE = 0, 1, 2


@declare(
    "moe",
    "moe_gate_up",
    [
        ("w", PTR),
        ("w_shared", PTR),
        ("y", PTR),
        ("ids", PTR),
        ("act", PTR),
        *_MOE,
        ("inter", U32),
        ("h", U32),
        ("limit", F32),
        ("shared", U32),
    ],
    writes=("act",),
    pdl=Pdl.BESIDE,  # the shared slot beside router_fused; the routed slots wait for its ids
)
def MOE_GATE_UP(mem, w, w_shared, y, ids, act, ntopk, expert_base, n_local, inter, h, limit, shared):
    """expert_gate_up of the routed slots 0..ntopk-1 and, with shared == 1, of the shared expert
    as slot ntopk, in one launch."""
    EXPERT_GATE_UP.host(mem, w, y, ids, act, 0, ntopk, expert_base, n_local, inter, h, limit)
    if shared == SHARED_HERE:
        yv = mem.read(y, BF16, h).astype(np.float32)
        we = mem.read(w_shared, BF16, (2 * inter, h)).astype(np.float32)
        gu = we @ yv
        mem.write(act.offset(ntopk * inter * 2), clamped_swiglu(gu[:inter], gu[inter:], limit).astype(BF16))


@declare(
    "moe",
    "moe_down",
    [
        ("w", PTR),
        ("w_shared", PTR),
        ("act", PTR),
        ("ids", PTR),
        ("weights", PTR),
        ("parts", PTR),
        *_MOE,
        ("h", U32),
        ("inter", U32),
        ("shared", U32),
    ],
    writes=("parts",),
    pdl=True,
)
def MOE_DOWN(mem, w, w_shared, act, ids, weights, parts, ntopk, expert_base, n_local, h, inter, shared):
    """expert_down of the routed slots and the shared slot in one launch (zeros for a shared slot
    held by another rank)."""
    EXPERT_DOWN.host(mem, w, act, ids, weights, parts, 0, ntopk, expert_base, n_local, h, inter)
    if shared == SHARED_HERE:
        we = mem.read(w_shared, BF16, (h, inter)).astype(np.float32)
        a = mem.read(act.offset(ntopk * inter * 2), BF16, inter).astype(np.float32)
        wt = mem.read(weights, np.float32, ntopk + 1)[ntopk]
        mem.write(parts.offset(ntopk * h * 4), (np.float32(wt) * (we @ a)).astype(np.float32))
    elif shared == SHARED_ELSEWHERE:
        mem.write(parts.offset(ntopk * h * 4), np.zeros(h, np.float32))


# ptx/moe.cu: rows per block of the GEMVs (8 warps; gate_up one act element per warp, down 4 rows).
GATE_UP_PER_BLOCK = 8
DOWN_ROWS_PER_BLOCK = 32


def router_scores(gpu, w, y, scores, n, h, stream=None):
    launch(gpu, gpu.kernel(*ROUTER_SCORES.key), -(-n // 8), 256, w, y, scores, n, h, stream=stream)


def router_topk(gpu, scores, bias, ids, weights, n_experts, topk, norm, scale, shared, stream=None):
    if n_experts > 1024 or topk > min(128, n_experts):
        raise ValueError(f"router_topk: {n_experts} experts / top-{topk} outside the kernel's 1024 / 128")
    launch(
        gpu,
        gpu.kernel(*ROUTER_TOPK.key),
        1,
        32,
        scores,
        bias,
        ids,
        weights,
        n_experts,
        topk,
        int(norm),
        scale,
        int(shared),
        stream=stream,
    )


def expert_gate_up(gpu, w, y, ids, act, slot0, nslots, expert_base, n_local, inter, h, limit, stream=None):
    launch(
        gpu,
        gpu.kernel(*EXPERT_GATE_UP.key),
        (-(-inter // GATE_UP_PER_BLOCK), nslots),
        256,
        w,
        y,
        ids,
        act,
        slot0,
        nslots,
        expert_base,
        n_local,
        inter,
        h,
        limit,
        stream=stream,
    )


def expert_down(gpu, w, act, ids, weights, parts, slot0, nslots, expert_base, n_local, h, inter, stream=None):
    launch(
        gpu,
        gpu.kernel(*EXPERT_DOWN.key),
        (-(-h // DOWN_ROWS_PER_BLOCK), nslots),
        256,
        w,
        act,
        ids,
        weights,
        parts,
        slot0,
        nslots,
        expert_base,
        n_local,
        h,
        inter,
        stream=stream,
    )


def router_fused(
    gpu, w, y, bias, scores, ids, weights, counter, n_experts, h, topk, norm, scale, shared, stream=None
):
    if n_experts > 1024 or topk > min(128, n_experts):
        raise ValueError(f"router: {n_experts} experts / top-{topk} outside the kernel's 1024 / 128")
    launch(
        gpu,
        gpu.kernel(*ROUTER_FUSED.key),
        -(-n_experts // 8),
        256,
        w,
        y,
        bias,
        scores,
        ids,
        weights,
        counter,
        n_experts,
        h,
        topk,
        int(norm),
        scale,
        int(bool(shared)),
        stream=stream,
    )


def moe_gate_up(
    gpu, w, w_shared, y, ids, act, ntopk, expert_base, n_local, inter, h, limit, shared, stream=None
):
    slots = ntopk + (1 if shared == SHARED_HERE else 0)
    launch(
        gpu,
        gpu.kernel(*MOE_GATE_UP.key),
        (-(-inter // GATE_UP_PER_BLOCK), slots),
        256,
        w,
        w_shared,
        y,
        ids,
        act,
        ntopk,
        expert_base,
        n_local,
        inter,
        h,
        limit,
        shared,
        stream=stream,
    )


def moe_down(
    gpu, w, w_shared, act, ids, weights, parts, ntopk, expert_base, n_local, h, inter, shared, stream=None
):
    slots = ntopk + (1 if shared != SHARED_NONE else 0)
    launch(
        gpu,
        gpu.kernel(*MOE_DOWN.key),
        (-(-h // DOWN_ROWS_PER_BLOCK), slots),
        256,
        w,
        w_shared,
        act,
        ids,
        weights,
        parts,
        ntopk,
        expert_base,
        n_local,
        h,
        inter,
        shared,
        stream=stream,
    )
