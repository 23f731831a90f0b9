"""Helpers for the batched MoE tests (tests/test_batch_moe.py on the host backend,
tests/test_gpu_batch_moe.py on the device): the batch's buffers poisoned (0xFF: NaN in BF16 and f32)
with guard bytes after them, the batched launch sequence (group, gate/up, down), and the
single-row launches of today's kernels that each row of a batch must reproduce."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.kernels import moe
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16

GUARD = 16


def put(gpu, arr: np.ndarray):
    arr = np.ascontiguousarray(arr)
    p = gpu.alloc(max(arr.nbytes, 1))
    if arr.nbytes:
        gpu.copy_h2d(p, arr)
    return p


def poisoned(gpu, nbytes: int):
    """nbytes of 0xFF plus GUARD bytes of 0xFF after them."""
    p = gpu.alloc(nbytes + GUARD)
    gpu.memset(p, 0xFF, nbytes + GUARD)
    return p


def get(gpu, ptr, nbytes: int, check_guard: bool = True) -> np.ndarray:
    """The nbytes at ptr (and, with check_guard, that the GUARD bytes after them are untouched)."""
    buf = np.empty(nbytes + (GUARD if check_guard else 0), np.uint8)
    gpu.copy_d2h(buf, ptr)
    if check_guard:
        assert (buf[nbytes:] == 0xFF).all(), "a kernel wrote past the end of its buffer"
    return buf[:nbytes]


def entries_with_pads(rng, live: int, pads: int, slots_base: int = 0) -> tuple[np.ndarray, list[int]]:
    """u32 [live + pads, 4] entries with the padding at random positions; returns the live rows."""
    m = live + pads
    ent = pack_entries(list(range(slots_base, slots_base + live)), list(range(live)), [0] * live, m)
    order = rng.permutation(m)
    ent = ent[order]
    return np.ascontiguousarray(ent), [e for e in range(m) if ent[e, 0] != 0xFFFFFFFF]


@dataclass
class MoeCase:
    """One MoE configuration: routed experts [n_local, 2I, H] / [n_local, H, I] of this rank's
    range [expert_base, expert_base + n_local), top-ntopk, and the shared-slot mode."""

    n_local: int
    expert_base: int
    inter: int
    h: int
    ntopk: int
    shared: int
    limit: float = 0.5

    @property
    def nslots(self) -> int:
        return self.ntopk + (self.shared != moe.SHARED_NONE)


def random_weights(rng, case: MoeCase, exp_lo: int = -6):
    from kernel_util import random_bf16

    gu = random_bf16(rng, (case.n_local, 2 * case.inter, case.h), exp_lo=exp_lo)
    dn = random_bf16(rng, (case.n_local, case.h, case.inter), exp_lo=exp_lo)
    sgu = random_bf16(rng, (2 * case.inter, case.h), exp_lo=exp_lo)
    sdn = random_bf16(rng, (case.h, case.inter), exp_lo=exp_lo)
    return gu, dn, sgu, sdn


def random_ids(rng, m: int, case: MoeCase, n_experts: int, pool: np.ndarray | None = None) -> np.ndarray:
    """u32 [m, nslots]: per row ntopk distinct experts of 0..n_experts-1 (or of ``pool``), the shared
    slot id 0 as the router writes it."""
    ids = np.zeros((m, case.nslots), np.uint32)
    choices = np.arange(n_experts) if pool is None else np.asarray(pool)
    for e in range(m):
        ids[e, : case.ntopk] = rng.choice(choices, case.ntopk, replace=False)
    return ids


def random_weights_rows(rng, m: int, case: MoeCase) -> np.ndarray:
    wts = (rng.random((m, case.nslots)) + 0.1).astype(np.float32)
    if case.shared != moe.SHARED_NONE:
        wts[:, case.ntopk] = 1.0
    return wts


@dataclass
class Outputs:
    act: np.ndarray  # BF16 [m * nslots, inter]
    parts: np.ndarray  # f32 [m * nslots, h]
    group: np.ndarray | None  # u32 words


def run_batch(gpu, wp, case: MoeCase, y, ids, wts, entries, stream=None) -> Outputs:
    """moe_group_batch + moe_gate_up_batch + moe_down_batch over the batch; ``wp`` the device
    pointers (gu, dn, sgu, sdn). Every output starts as poison."""
    m = len(entries)
    ns, inter, h = case.nslots, case.inter, case.h
    ent_p, y_p, ids_p, wts_p = put(gpu, entries), put(gpu, y), put(gpu, ids), put(gpu, wts)
    gbytes = moe.group_workspace_bytes(m, case.ntopk, case.n_local)
    grp = poisoned(gpu, gbytes) if case.ntopk else None
    act = poisoned(gpu, m * ns * inter * 2)
    parts = poisoned(gpu, m * ns * h * 4)
    gu, dn, sgu, sdn = wp
    try:
        if case.ntopk:
            moe.moe_group_batch(
                gpu,
                ids=ids_p,
                entries=ent_p,
                group=grp,
                m=m,
                ntopk=case.ntopk,
                nslots=ns,
                expert_base=case.expert_base,
                n_local=case.n_local,
                stream=stream,
            )
        moe.moe_gate_up_batch(
            gpu,
            w=gu,
            w_shared=sgu,
            y=y_p,
            group=grp,
            act=act,
            entries=ent_p,
            m=m,
            ntopk=case.ntopk,
            n_local=case.n_local,
            inter=inter,
            h=h,
            limit=case.limit,
            shared=case.shared,
            stream=stream,
        )
        moe.moe_down_batch(
            gpu,
            w=dn,
            w_shared=sdn,
            act=act,
            weights=wts_p,
            group=grp,
            parts=parts,
            entries=ent_p,
            m=m,
            ntopk=case.ntopk,
            n_local=case.n_local,
            h=h,
            inter=inter,
            shared=case.shared,
            stream=stream,
        )
        gpu.synchronize(stream)
        out = Outputs(
            get(gpu, act, m * ns * inter * 2).view(BF16).reshape(m * ns, inter).copy(),
            get(gpu, parts, m * ns * h * 4).view(np.float32).reshape(m * ns, h).copy(),
            get(gpu, grp, gbytes).view(np.uint32).copy() if grp is not None else None,
        )
    finally:
        for p in (ent_p, y_p, ids_p, wts_p, act, parts) + ((grp,) if grp is not None else ()):
            gpu.free(p)
    return out


def run_single_today(gpu, wp, case: MoeCase, y_row, ids_row, wts_row) -> tuple[np.ndarray, np.ndarray]:
    """Today's single-row moe_gate_up / moe_down (a dense case: expert_gate_up / expert_down) on one
    row: act [nslots, inter] BF16 and parts [nslots, h] f32, from poison."""
    ns, inter, h = case.nslots, case.inter, case.h
    y_p, ids_p, wts_p = put(gpu, y_row), put(gpu, ids_row), put(gpu, wts_row)
    act, parts = poisoned(gpu, ns * inter * 2), poisoned(gpu, ns * h * 4)
    gu, dn, sgu, sdn = wp
    try:
        if case.ntopk == 0:  # the dense MLP: one expert, constant id 0 and weight 1
            moe.expert_gate_up(gpu, sgu, y_p, ids_p, act, 0, 1, 0, 1, inter, h, case.limit)
            moe.expert_down(gpu, sdn, act, ids_p, wts_p, parts, 0, 1, 0, 1, h, inter)
        else:
            k, base, nl = case.ntopk, case.expert_base, case.n_local
            moe.moe_gate_up(gpu, gu, sgu, y_p, ids_p, act, k, base, nl, inter, h, case.limit, case.shared)
            moe.moe_down(gpu, dn, sdn, act, ids_p, wts_p, parts, k, base, nl, h, inter, case.shared)
        gpu.synchronize()
        return (
            get(gpu, act, ns * inter * 2).view(BF16).reshape(ns, inter).copy(),
            get(gpu, parts, ns * h * 4).view(np.float32).reshape(ns, h).copy(),
        )
    finally:
        for p in (y_p, ids_p, wts_p, act, parts):
            gpu.free(p)


def upload_weights(gpu, weights):
    return tuple(put(gpu, a) for a in weights)


def free_all(gpu, ptrs) -> None:
    for p in ptrs:
        gpu.free(p)


def router_batch(gpu, w, y, bias, entries, n_experts, h, topk, norm, scale, shared):
    """router_fused_batch from poison: (scores [m, E] f32, ids [m, slots] u32, weights [m, slots],
    counter words)."""
    m = len(entries)
    slots = topk + int(bool(shared))
    ptrs = [put(gpu, w), put(gpu, y), put(gpu, bias), put(gpu, entries)]
    sc, ids, wts = (
        poisoned(gpu, m * n_experts * 4),
        poisoned(gpu, m * slots * 4),
        poisoned(gpu, m * slots * 4),
    )
    cw = moe.router_counter_words(m)
    ctr = put(gpu, np.zeros(cw + GUARD // 4, np.uint32))
    try:
        moe.router_fused_batch(
            gpu,
            w=ptrs[0],
            y=ptrs[1],
            bias=ptrs[2],
            scores=sc,
            ids=ids,
            weights=wts,
            counter=ctr,
            entries=ptrs[3],
            m=m,
            n_experts=n_experts,
            h=h,
            topk=topk,
            norm=norm,
            scale=scale,
            shared=shared,
        )
        gpu.synchronize()
        return (
            get(gpu, sc, m * n_experts * 4).view(np.float32).reshape(m, n_experts).copy(),
            get(gpu, ids, m * slots * 4).view(np.uint32).reshape(m, slots).copy(),
            get(gpu, wts, m * slots * 4).view(np.float32).reshape(m, slots).copy(),
            get(gpu, ctr, 4 * cw + GUARD, check_guard=False).view(np.uint32).copy(),
        )
    finally:
        for p in ptrs + [sc, ids, wts, ctr]:
            gpu.free(p)


def router_single_today(gpu, w, y_row, bias, n_experts, h, topk, norm, scale, shared):
    """Today's router_fused on one row: (scores [E], ids [slots], weights [slots])."""
    slots = topk + int(bool(shared))
    ptrs = [put(gpu, w), put(gpu, y_row), put(gpu, bias)]
    sc, ids, wts = poisoned(gpu, n_experts * 4), poisoned(gpu, slots * 4), poisoned(gpu, slots * 4)
    ctr = put(gpu, np.zeros(1, np.uint32))
    try:
        moe.router_fused(
            gpu, ptrs[0], ptrs[1], ptrs[2], sc, ids, wts, ctr, n_experts, h, topk, norm, scale, shared
        )
        gpu.synchronize()
        return (
            get(gpu, sc, n_experts * 4).view(np.float32).copy(),
            get(gpu, ids, slots * 4).view(np.uint32).copy(),
            get(gpu, wts, slots * 4).view(np.float32).copy(),
        )
    finally:
        for p in ptrs + [sc, ids, wts, ctr]:
            gpu.free(p)


def router_group(gpu, w, y, bias, entries, n_experts, h, topk, norm, scale, shared, expert_base, n_local):
    """router_group_batch from poison: (scores, ids, weights, counter words, group words)."""
    m = len(entries)
    slots = topk + int(bool(shared))
    ptrs = [put(gpu, w), put(gpu, y), put(gpu, bias), put(gpu, entries)]
    sc, ids, wts = (
        poisoned(gpu, m * n_experts * 4),
        poisoned(gpu, m * slots * 4),
        poisoned(gpu, m * slots * 4),
    )
    gbytes = moe.group_workspace_bytes(m, topk, n_local)
    grp = poisoned(gpu, gbytes)
    cw = moe.router_counter_words(m, grouped=True)
    ctr = put(gpu, np.zeros(cw + GUARD // 4, np.uint32))
    try:
        moe.router_group_batch(
            gpu,
            w=ptrs[0],
            y=ptrs[1],
            bias=ptrs[2],
            scores=sc,
            ids=ids,
            weights=wts,
            counter=ctr,
            entries=ptrs[3],
            group=grp,
            m=m,
            n_experts=n_experts,
            h=h,
            topk=topk,
            norm=norm,
            scale=scale,
            shared=shared,
            expert_base=expert_base,
            n_local=n_local,
        )
        gpu.synchronize()
        return (
            get(gpu, sc, m * n_experts * 4).view(np.float32).reshape(m, n_experts).copy(),
            get(gpu, ids, m * slots * 4).view(np.uint32).reshape(m, slots).copy(),
            get(gpu, wts, m * slots * 4).view(np.float32).reshape(m, slots).copy(),
            get(gpu, ctr, 4 * cw + GUARD, check_guard=False).view(np.uint32).copy(),
            get(gpu, grp, gbytes).view(np.uint32).copy(),
        )
    finally:
        for p in ptrs + [sc, ids, wts, ctr, grp]:
            gpu.free(p)
