"""The batched MoE's host twins (model/kernels/moe.py, issue 15): router_group_batch (its routing
and its grouping), moe_gate_up_batch, moe_down_batch.

- at m = 1 against direct formulas: the router's sigmoid scores and top-k routing, and the
  experts' clamped SwiGLU and down projection in float64;
- the grouping against a direct formula (per local expert the pairs in increasing index, experts in
  increasing order, then the zero pairs), deterministic, within the items bound the grids are sized
  by, with padding giving no pairs;
- every row of a batch equals the m = 1 launch of that row, bit for bit, whatever the batch, its
  order and its padding (random routing with collisions; sharded expert ranges, whose pairs outside
  the range get zero parts rows); padding rows keep their poison;
- the chain against a float64 formula of the MoE.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_moe_util import (
    MoeCase,
    entries_with_pads,
    free_all,
    group_words,
    random_ids,
    random_weights,
    random_weights_rows,
    router_batch,
    router_group,
    router_row_alone,
    run_batch,
    run_row_alone,
    upload_weights,
)
from kernel_util import random_bf16, same_bits

from model.kernels import moe
from model.kernels.batch import MAX_ROWS, pack_entries
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend


def poison_rows(a: np.ndarray) -> np.ndarray:
    """Rows that are all 0xFF bytes."""
    return (a.view(np.uint8).reshape(a.shape[0], -1) == 0xFF).all(axis=1)


# ---- the router ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "E,H,k,norm,shared",
    [(37, 48, 5, True, False), (288, 64, 8, True, True), (9, 45, 9, False, True), (64, 40, 1, True, False)],
)
def test_router_batch_at_m1_is_the_formula(E, H, k, norm, shared):
    """One entry: scores = sigmoid(W @ y) within f32 rounding of float64, ids the top-k of score +
    bias (the lower index first on a tie), weights the scores of those normalised to ``scale``
    (with norm) or scaled, and the shared slot id 0 with weight 1."""
    gpu = HostBackend()
    rng = np.random.default_rng(E * 7 + H)
    w = (rng.standard_normal((E, H)) / 4).astype(BF16)
    y = rng.standard_normal((1, H)).astype(BF16)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    ent = pack_entries([3], [17], [0])
    s, i, wt, ctr = router_batch(gpu, w, y, bias, ent, E, H, k, norm, 2.5, shared)
    w64, y64 = w.astype(np.float64), y[0].astype(np.float64)
    ref = 1.0 / (1.0 + np.exp(-(w64 @ y64)))
    bound = 0.25 * H * 2.0**-24 * (np.abs(w64) @ np.abs(y64)) + 2.0**-21
    assert (np.abs(s[0] - ref) <= bound).all()
    order = np.argsort(-(s[0].astype(np.float64) + bias), kind="stable")[:k]
    assert (i[0, :k] == order).all()
    picked = s[0, order].astype(np.float64)
    want = picked / picked.sum() * 2.5 if norm else picked * 2.5
    np.testing.assert_allclose(wt[0, :k], want, rtol=1e-6)
    if shared:
        assert i[0, k] == 0 and wt[0, k] == 1.0
    assert i.shape[1] == k + int(shared)
    assert (ctr[: moe.router_counter_words(1, grouped=True)] == 0).all()


@pytest.mark.parametrize("live,pads", [(13, 3), (9, 0), (1, 7), (17, 6)])
def test_router_batch_rows_are_their_own_launches(live, pads):
    """Each live row equals a launch of that row alone; padding rows keep their poison; the
    scores are the float64 sigmoid within f32 rounding and the ids are the top-k of score + bias."""
    gpu = HostBackend()
    rng = np.random.default_rng(live * 31 + pads)
    E, H, k = 40, 56, 6
    w = (rng.standard_normal((E, H)) / 4).astype(BF16)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    ent, rows = entries_with_pads(rng, live, pads)
    m = len(ent)
    y = rng.standard_normal((m, H)).astype(BF16)
    s, i, wt, ctr = router_batch(gpu, w, y, bias, ent, E, H, k, True, 1.5, True)
    assert (ctr[: moe.router_counter_words(m, grouped=True)] == 0).all()
    pad = [e for e in range(m) if e not in rows]
    assert poison_rows(s)[pad].all() and poison_rows(i)[pad].all() and poison_rows(wt)[pad].all()
    for e in rows:
        s1, i1, wt1 = router_row_alone(gpu, w, y[e], bias, E, H, k, True, 1.5, True)
        same_bits(s[e : e + 1], s1[None], f"scores row {e}")
        same_bits(i[e : e + 1], i1[None], f"ids row {e}")
        same_bits(wt[e : e + 1], wt1[None], f"weights row {e}")
        w64, y64 = w.astype(np.float64), y[e].astype(np.float64)
        ref = 1.0 / (1.0 + np.exp(-(w64 @ y64)))
        # sigmoid' <= 1/4 of the f32 dot's error bound, plus the f32 sigmoid's own rounding
        bound = 0.25 * H * 2.0**-24 * (np.abs(w64) @ np.abs(y64)) + 2.0**-21
        assert (np.abs(s[e] - ref) <= bound).all()
        order = np.argsort(-(s[e].astype(np.float64) + bias), kind="stable")[:k]
        assert (i[e, :k] == order).all() and i[e, k] == 0 and wt[e, k] == 1.0
        np.testing.assert_allclose(wt[e, :k].sum(), 1.5, rtol=1e-6)


# ---- the grouping -------------------------------------------------------------------------------


def group_run(gpu, ids, ent, ntopk, nslots, base, n_local):
    """The grouping's twin (what router_group_batch's last block writes) of these ids, as u32 words."""
    return group_words(ids, ent, ntopk, nslots, base, n_local).view(np.uint32).copy()


def check_group(words, ids, live, m, ntopk, nslots, base, n_local) -> moe.Group:
    """The workspace against a direct formula, and every word outside the written parts still poison."""
    g = moe.decode_group(words, m, ntopk, n_local)
    lay = moe.GroupLayout(m, ntopk, n_local)
    by, zero = {}, []
    for e in sorted(live):
        for j in range(ntopk):
            x = int(ids[e, j]) - base
            if 0 <= x < n_local:
                by.setdefault(x, []).append(e * nslots + j)
            else:
                zero.append(e * nslots + j)
    counts = np.array([len(by.get(x, [])) for x in range(n_local)])
    assert (g.counts == counts).all()
    assert (g.offsets == np.concatenate([[0], np.cumsum(counts)[:-1]])).all()
    assert g.used.tolist() == sorted(by)
    assert g.n_pairs == counts.sum() and g.n_zero == len(zero)
    assert g.pairs.tolist() == [p for x in sorted(by) for p in by[x]] + zero
    # the items cover each expert's pairs in chunks of PAIRS_PER_ITEM, then the zero pairs
    want = []
    for x in sorted(by):
        n = -(-len(by[x]) // moe.PAIRS_PER_ITEM)
        want += [(x, len(want) | (n << 16), int(g.offsets[x]), len(by[x]))] * n
    if zero:
        n = -(-len(zero) // moe.PAIRS_PER_ITEM)
        want += [(moe.GROUP_ZERO, len(want) | (n << 16), g.n_pairs, len(zero))] * n
    assert g.n_items == len(want) and [tuple(r) for r in g.items.tolist()] == want
    assert g.n_items <= moe.items_bound(m * ntopk, n_local), "more items than the grids are sized for"
    # nothing else written
    written = np.zeros(lay.words, bool)
    written[: moe.GROUP_HEADER_WORDS] = True
    written[lay.items : lay.items + 4 * g.n_items] = True
    written[lay.counts : lay.used + g.n_used] = True
    written[lay.pairs : lay.pairs + g.n_pairs + g.n_zero] = True
    assert (words[~written] == 0xFFFFFFFF).all(), "the grouping wrote outside its outputs"
    return g


@pytest.mark.parametrize(
    "live,pads,E,ntopk,shared,base,n_local",
    [
        (11, 4, 12, 4, True, 0, 12),  # few experts: collisions, experts with several items
        (40, 9, 10, 8, False, 0, 10),  # every expert in up to 40 rows: 5 items each
        (23, 2, 64, 8, True, 16, 16),  # sharded: most pairs are zero pairs
        (1, 0, 288, 8, True, 0, 288),  # the single row
        (5, 3, 20, 3, True, 18, 7),  # a range past the last expert
        (200, 56, 288, 8, True, 0, 288),  # the largest batch
    ],
)
def test_group_is_the_direct_formula(live, pads, E, ntopk, shared, base, n_local):
    gpu = HostBackend()
    rng = np.random.default_rng(live + 100 * E + base)
    case = MoeCase(n_local, base, 1, 1, ntopk, moe.SHARED_HERE if shared else moe.SHARED_NONE)
    ent, rows = entries_with_pads(rng, live, pads)
    m = len(ent)
    ids = random_ids(rng, m, case, E)
    pad = [e for e in range(m) if e not in rows]
    ids[pad, :ntopk] = rng.integers(0, E, (len(pad), ntopk))  # padding rows' ids are garbage
    if pad:
        ids[pad[0], :ntopk] = base  # ... even repeating a local expert
    words = group_run(gpu, ids, ent, ntopk, case.nslots, base, n_local)
    g = check_group(words, ids, rows, m, ntopk, case.nslots, base, n_local)
    assert not {p // case.nslots for p in g.pairs.tolist()} & set(pad), "padding rows got pairs"
    # deterministic: the same bytes again
    assert (group_run(gpu, ids, ent, ntopk, case.nslots, base, n_local) == words).all()


def test_group_items_stay_within_the_bound_in_the_worst_cases():
    """Every row on the same experts (one expert per slot, m pairs each), and a sharded rank that
    holds none of them (all zero pairs), at m = 256."""
    gpu = HostBackend()
    m, k = 256, 8
    ent = pack_entries(list(range(m)), list(range(m)), [0] * m)
    same = np.tile(np.arange(k, dtype=np.uint32), (m, 1))
    for base, n_local in [(0, 288), (0, 8), (100, 16), (0, 1)]:
        ids = np.concatenate([same, np.zeros((m, 1), np.uint32)], axis=1)
        words = group_run(gpu, ids, ent, k, k + 1, base, n_local)
        check_group(words, ids, list(range(m)), m, k, k + 1, base, n_local)
    for n in range(1, 40):
        for t in range(0, 300, 7):
            assert moe.items_bound(t, n) >= min(t, n)


def test_group_refuses_a_row_that_repeats_an_expert():
    gpu = HostBackend()
    ids = np.array([[3, 3, 1]], np.uint32)
    with pytest.raises(ValueError, match="twice"):
        group_run(gpu, ids, pack_entries([0], [0], [0]), 3, 3, 0, 8)


def test_group_layout_of_the_largest_batch_holds_every_smaller_one():
    for k, n in [(8, 288), (8, 36), (4, 12)]:
        big = moe.group_workspace_bytes(MAX_ROWS, k, n)
        assert all(moe.group_workspace_bytes(m, k, n) <= big for m in range(1, MAX_ROWS + 1))
        assert moe.GroupLayout(MAX_ROWS, k, n).items * 4 % 16 == 0


@pytest.mark.parametrize("m,pads,base,n_local", [(1, 0, 0, 40), (21, 5, 0, 40), (30, 3, 30, 10)])
def test_router_group_batch_is_the_router_then_the_grouping(m, pads, base, n_local):
    """The fused launch's scores, ids and weights are those of its routing alone, its group workspace
    the grouping of those ids, and it leaves its chunk counters and the hand-over word zero."""
    gpu = HostBackend()
    rng = np.random.default_rng(m + base)
    E, H, k = 40, 56, 6
    w = (rng.standard_normal((E, H)) / 4).astype(BF16)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    ent, rows = entries_with_pads(rng, m - pads, pads)
    y = rng.standard_normal((m, H)).astype(BF16)
    s, i, wt, ctr, grp = router_group(gpu, w, y, bias, ent, E, H, k, True, 1.5, True, base, n_local)
    s0, i0, w0, _ = router_batch(gpu, w, y, bias, ent, E, H, k, True, 1.5, True)
    same_bits(s, s0, "scores")
    same_bits(i, i0, "ids")
    same_bits(wt, w0, "weights")
    assert (ctr[: moe.router_counter_words(m, grouped=True)] == 0).all()
    assert (grp == group_run(gpu, i0, ent, k, k + 1, base, n_local)).all()
    check_group(grp, i0, rows, m, k, k + 1, base, n_local)


# ---- the experts --------------------------------------------------------------------------------

CASES = {
    "none": MoeCase(6, 0, 24, 64, 4, moe.SHARED_NONE),
    "here": MoeCase(6, 0, 24, 64, 4, moe.SHARED_HERE),
    "elsewhere": MoeCase(4, 4, 37, 45, 3, moe.SHARED_ELSEWHERE),  # sharded, odd sizes
    "sharded_here": MoeCase(5, 5, 16, 40, 4, moe.SHARED_HERE),
    "dense": MoeCase(1, 0, 40, 48, 0, moe.SHARED_HERE),
}
E_OF = {"none": 6, "here": 6, "elsewhere": 12, "sharded_here": 15, "dense": 1}


def _ids_for(rng, m, name):
    case = CASES[name]
    if case.ntopk == 0:
        return np.zeros((m, 1), np.uint32)
    return random_ids(rng, m, case, E_OF[name])


def _wts_for(rng, m, name):
    case = CASES[name]
    if case.ntopk == 0:
        return np.ones((m, 1), np.float32)
    return random_weights_rows(rng, m, case)


@pytest.mark.parametrize("name", list(CASES))
def test_experts_batch_at_m1_is_the_formula(name):
    """One entry, slot by slot: act = BF16 of the clamped SwiGLU of w_x @ y within a BF16 rounding
    of float64 (x the local expert, the shared one in slot ntopk, the dense MLP's in slot 0),
    parts = weight * (w_down_x @ act) within f32 rounding of float64 on that act (weight 1 for the
    shared and the dense slot); a routed expert outside the rank's range and the slot of a shared
    expert held elsewhere get a zero parts row and an unwritten act row."""
    gpu = HostBackend()
    case = CASES[name]
    rng = np.random.default_rng(len(name))
    gu, dn, sgu, sdn = random_weights(rng, case)
    wp = upload_weights(gpu, (gu, dn, sgu, sdn))
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    inter, lim = case.inter, case.limit
    try:
        for _ in range(3):
            y = random_bf16(rng, (1, case.h), exp_lo=-1)
            ids, wts = _ids_for(rng, 1, name), _wts_for(rng, 1, name)
            out = run_batch(gpu, wp, case, y, ids, wts, pack_entries([5], [9], [0]))
            for j in range(case.nslots):
                if j < case.ntopk:
                    x = int(ids[0, j]) - case.expert_base
                    mats = (gu[x], dn[x], float(wts[0, j])) if 0 <= x < case.n_local else None
                else:  # the shared slot, or the dense MLP's one slot
                    mats = (sgu, sdn, 1.0) if case.shared == moe.SHARED_HERE else None
                if mats is None:
                    assert (out.parts[j] == 0).all() and poison_rows(out.act[j : j + 1]).all(), f"slot {j}"
                    continue
                g, d, wt = mats
                h64 = f(g) @ f(y[0])
                a = np.minimum(h64[:inter], lim)
                with np.errstate(over="ignore"):  # exp(-a) of a large negative a: act 0
                    act_ref = a / (1 + np.exp(-a)) * np.clip(h64[inter:], -lim, lim)
                absd = np.abs(f(g)) @ np.abs(f(y[0]))
                tol = 2.0**-7 * np.abs(act_ref) + case.h * 2.0**-22 * (absd[:inter] + absd[inter:]) + 1e-30
                assert (np.abs(f(out.act[j]) - act_ref) <= tol).all(), f"act of slot {j}"
                p_ref = wt * (f(d) @ f(out.act[j]))
                ptol = inter * 2.0**-22 * (np.abs(f(d)) @ np.abs(f(out.act[j]))) * max(abs(wt), 1) + 1e-30
                assert (np.abs(f(out.parts[j]) - p_ref) <= ptol).all(), f"parts of slot {j}"
    finally:
        free_all(gpu, wp)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("live,pads", [(9, 3), (17, 0)])
def test_experts_batch_rows_are_their_own_launches(name, live, pads):
    """Every live row of a batch (random routing with collisions, padding at random positions)
    equals a launch of that row alone; the padding rows' act and parts rows keep their
    poison; pairs outside the rank's range have zero parts rows and unwritten act rows."""
    gpu = HostBackend()
    case = CASES[name]
    rng = np.random.default_rng(live * 13 + pads + len(name))
    wp = upload_weights(gpu, random_weights(rng, case))
    try:
        ent, rows = entries_with_pads(rng, live, pads)
        m, ns = len(ent), case.nslots
        y = random_bf16(rng, (m, case.h), exp_lo=-1)
        ids, wts = _ids_for(rng, m, name), _wts_for(rng, m, name)
        out = run_batch(gpu, wp, case, y, ids, wts, ent)
        for e in range(m):
            sl = slice(e * ns, (e + 1) * ns)
            if e not in rows:
                assert poison_rows(out.act[sl]).all() and poison_rows(out.parts[sl]).all(), f"pad {e}"
                continue
            a1, p1 = run_row_alone(gpu, wp, case, y[e], ids[e], wts[e])
            same_bits(out.act[sl], a1, f"act of row {e}")
            same_bits(out.parts[sl], p1, f"parts of row {e}")
            for j in range(case.ntopk):
                if not 0 <= int(ids[e, j]) - case.expert_base < case.n_local:
                    assert (out.parts[e * ns + j] == 0).all() and poison_rows(
                        out.act[e * ns + j : e * ns + j + 1]
                    ).all()
        # the same rows in another order and another padding give the same bits per row
        perm = rng.permutation(m)
        out2 = run_batch(gpu, wp, case, y[perm], ids[perm], wts[perm], ent[perm])
        for new, old in enumerate(perm):
            same_bits(
                out2.act[new * ns : (new + 1) * ns], out.act[old * ns : (old + 1) * ns], "act, shuffled"
            )
            same_bits(
                out2.parts[new * ns : (new + 1) * ns], out.parts[old * ns : (old + 1) * ns], "parts, shuffled"
            )
    finally:
        free_all(gpu, wp)


def test_moe_chain_against_float64():
    """router_group_batch's routing, the grouping, gate/up and down: the slot sum of parts against a
    float64 MoE (sigmoid router, top-k by score + bias, normalised weights, clamped SwiGLU experts
    and an ungated shared expert), within the BF16 rounding of act."""
    gpu = HostBackend()
    rng = np.random.default_rng(5)
    E, H, inter, k, limit, scale = 16, 48, 20, 4, 0.7, 2.0
    case = MoeCase(E, 0, inter, H, k, moe.SHARED_HERE, limit)
    gu, dn, sgu, sdn = random_weights(rng, case, exp_lo=-8)
    wr = (rng.standard_normal((E, H)) / 4).astype(BF16)
    bias = (0.02 * rng.standard_normal(E)).astype(np.float32)
    ent, rows = entries_with_pads(rng, 10, 2)
    m = len(ent)
    y = rng.standard_normal((m, H)).astype(BF16)
    _, ids, wts, _ = router_batch(gpu, wr, y, bias, ent, E, H, k, True, scale, True)
    wp = upload_weights(gpu, (gu, dn, sgu, sdn))
    try:
        out = run_batch(gpu, wp, case, y, ids, wts, ent)
    finally:
        free_all(gpu, wp)
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731

    def expert(g, d, yv):
        gu64 = f(g) @ yv
        a = np.minimum(gu64[:inter], limit)
        u = np.clip(gu64[inter:], -limit, limit)
        return f(d) @ (a / (1 + np.exp(-a)) * u)

    for e in rows:
        yv = f(y[e])
        s = 1 / (1 + np.exp(-(f(wr) @ yv)))
        top = np.argsort(-(s + bias), kind="stable")[:k]
        wt = s[top] / s[top].sum() * scale
        ref = sum(wt[j] * expert(gu[x], dn[x], yv) for j, x in enumerate(top)) + expert(sgu, sdn, yv)
        got = f(out.parts[e * (k + 1) : (e + 1) * (k + 1)]).sum(axis=0)
        scale_ref = np.abs(ref).max()
        np.testing.assert_allclose(got, ref, rtol=2**-6, atol=2**-6 * scale_ref)


# ---- launches -----------------------------------------------------------------------------------


class GridRecorder(HostBackend):
    """Records each launch's grid and block instead of running the twin (only the shape matters)."""

    def __init__(self):
        super().__init__()
        self.grids = {}

    def launch(self, kernel, grid, block, args, smem=0, stream=None):
        self.grids[kernel.decl.function] = (tuple(grid), tuple(block))


@pytest.mark.parametrize("shared", [moe.SHARED_HERE, moe.SHARED_ELSEWHERE, moe.SHARED_NONE])
def test_single_row_launch_shape(shared):
    """m = 1, top-8, 288 local experts: the router one chunk of 36 expert blocks, gate/up 256 x 9
    (x 8 without the shared expert here), down 128 x 9 (x 8 without a shared slot): one block row
    per routed slot, so B = 1 pays no wave of empty blocks."""
    gpu = GridRecorder()
    E, H, inter, k = 288, 4096, 2048, 8
    z = gpu.alloc(64)
    moe.router_group_batch(
        gpu, w=z, y=z, bias=z, scores=z, ids=z, weights=z, counter=z, entries=z, group=z, m=1,
        n_experts=E, h=H, topk=k, norm=True, scale=1.0, shared=shared != moe.SHARED_NONE,
        expert_base=0, n_local=E,
    )  # fmt: skip
    moe.moe_gate_up_batch(
        gpu, w=z, w_shared=z, y=z, group=z, act=z, entries=z, m=1, ntopk=k, n_local=E, inter=inter, h=H,
        limit=1.0, shared=shared,
    )  # fmt: skip
    moe.moe_down_batch(
        gpu, w=z, w_shared=z, act=z, weights=z, group=z, parts=z, entries=z, m=1, ntopk=k, n_local=E, h=H,
        inter=inter, shared=shared,
    )  # fmt: skip
    assert gpu.grids["router_group_batch"] == ((1, E // 8, 1), (256, 1, 1))
    assert gpu.grids["moe_gate_up_batch"] == (
        (inter // 8, 9 if shared == moe.SHARED_HERE else 8, 1),
        (256, 1, 1),
    )
    assert gpu.grids["moe_down_batch"] == ((H // 32, 8 if shared == moe.SHARED_NONE else 9, 1), (256, 1, 1))


def test_grids_at_batch_sizes_are_bounded_by_the_pairs():
    """The item rows of the grids: at most min(n_local, m * k) + (m * k - n_local) / 8 + 1, e.g. 317
    at m = 64 (about 241 experts used), 509 at m = 256."""
    assert moe.items_bound(64 * 8, 288) == 317 and moe.items_bound(256 * 8, 288) == 509
    assert moe.items_bound(3 * 8, 288) == 24


def _router_args(z, **over):
    args = dict(
        w=z, y=z, bias=z, scores=z, ids=z, weights=z, counter=z, entries=z, group=z, m=1, n_experts=288,
        h=8, topk=8, norm=True, scale=1.0, shared=True, expert_base=0, n_local=288,
    )  # fmt: skip
    return {**args, **over}


def test_wrappers_refuse_batches_outside_the_convention():
    gpu = HostBackend()
    z = gpu.alloc(64)
    with pytest.raises(ValueError, match="outside 1..256"):
        moe.router_group_batch(gpu, **_router_args(z, m=257))
    with pytest.raises(ValueError, match="outside 1..256"):
        moe.moe_gate_up_batch(
            gpu, w=z, w_shared=z, y=z, group=z, act=z, entries=z, m=0, ntopk=8, n_local=8, inter=8, h=8,
            limit=1.0, shared=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="group workspace"):
        moe.moe_gate_up_batch(
            gpu, w=z, w_shared=z, y=z, group=None, act=z, entries=z, m=1, ntopk=8, n_local=8, inter=8, h=8,
            limit=1.0, shared=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="1024 / 128"):
        moe.router_group_batch(gpu, **_router_args(z, n_experts=2000))
    with pytest.raises(ValueError, match="16-byte aligned"):
        moe.router_group_batch(gpu, **_router_args(z, group=z.offset(4)))
    with pytest.raises(ValueError, match="local experts"):
        moe.router_group_batch(gpu, **_router_args(z, n_local=2000))


def test_router_reads_exactly_the_routed_rows_and_weights_the_shared_expert_one():
    """A router [E, H] and a scores row of E floats: the host heap refuses any read past them (a
    gated design read an (E + 1)-th row and score); the shared slot is id 0 with weight 1."""
    gpu = HostBackend()
    rng = np.random.default_rng(0)
    E, H, k = 9, 32, 3
    w = (rng.standard_normal((E, H)) / 6).astype(BF16)
    y = rng.standard_normal((1, H)).astype(BF16)
    _, ids, wts, _ = router_batch(
        gpu, w, y, np.zeros(E, np.float32), pack_entries([0], [0], [0]), E, H, k, True, 2.5, True
    )
    assert wts[0, k] == 1.0 and ids[0, k] == 0
    np.testing.assert_allclose(wts[0, :k].sum(), 2.5, rtol=1e-6)
