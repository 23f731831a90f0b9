"""Helpers for the batched MoE tests (tests/test_batch_moe.py on the host backend,
tests/test_gpu_batch_moe.py on the device): the batch's buffers poisoned (0xFF: NaN in BF16 and f32)
with guard bytes after them, the batched launch sequence (the grouping of given ids on the host,
gate/up, down; or router_group_batch), and the launches of one row alone that each row of a batch
must reproduce."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.kernels import moe
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend

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
    """moe_gate_up_batch + moe_down_batch over the batch, the group workspace of ``ids`` built by the
    host twin of the grouping (group_words); ``wp`` the device pointers (gu, dn, sgu, sdn). Every
    output starts as poison."""
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
            gpu.copy_h2d(grp, group_words(ids, entries, case.ntopk, ns, case.expert_base, case.n_local))
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


def group_words(ids: np.ndarray, entries: np.ndarray, ntopk, nslots, expert_base, n_local) -> np.ndarray:
    """The group workspace bytes the grouping of router_group_batch makes of ``ids`` (u32 [m, nslots];
    its host twin moe.group_batch_ref on the host backend), poison (0xFF) where it writes nothing."""
    host = HostBackend()
    m = len(entries)
    nb = moe.group_workspace_bytes(m, ntopk, n_local)
    ip, ep, gp = put(host, ids), put(host, entries), poisoned(host, nb)
    try:
        moe.group_batch_ref(host.mem, ip, ep, gp, m, ntopk, nslots, expert_base, n_local)
        return get(host, gp, nb).copy()
    finally:
        for p in (ip, ep, gp):
            host.free(p)


def run_row_alone(gpu, wp, case: MoeCase, y_row, ids_row, wts_row) -> tuple[np.ndarray, np.ndarray]:
    """One row launched alone (m = 1) through run_batch: act [nslots, inter] BF16 and parts
    [nslots, h] f32, from poison."""
    out = run_batch(gpu, wp, case, y_row[None], ids_row[None], wts_row[None], pack_entries([0], [0], [0]))
    return out.act, out.parts


def upload_weights(gpu, weights):
    return tuple(put(gpu, a) for a in weights)


def free_all(gpu, ptrs) -> None:
    for p in ptrs:
        gpu.free(p)


def router_batch(gpu, w, y, bias, entries, n_experts, h, topk, norm, scale, shared, **groups):
    """The routing of router_group_batch (every expert local) from poison: (scores [m, E] f32,
    ids [m, slots] u32, weights [m, slots], counter words). ``groups``: n_group / topk_group."""
    return router_group(
        gpu, w, y, bias, entries, n_experts, h, topk, norm, scale, shared, 0, min(n_experts, 1024), **groups
    )[:4]


def router_row_alone(gpu, w, y_row, bias, n_experts, h, topk, norm, scale, shared, **groups):
    """router_batch of one row launched alone (m = 1): (scores [E], ids [slots], weights [slots])."""
    s, i, wt, _ = router_batch(
        gpu,
        w,
        y_row[None],
        bias,
        pack_entries([0], [0], [0]),
        n_experts,
        h,
        topk,
        norm,
        scale,
        shared,
        **groups,
    )
    return s[0], i[0], wt[0]


def router_group(
    gpu, w, y, bias, entries, n_experts, h, topk, norm, scale, shared, expert_base, n_local, **groups
):
    """router_group_batch from poison: (scores, ids, weights, counter words, group words).
    ``groups``: n_group / topk_group, passed only when given (else the launch's defaults)."""
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
            **groups,
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
