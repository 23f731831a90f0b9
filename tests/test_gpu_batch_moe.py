"""The batched MoE kernels on the device (ptx/moe.cu: router_group_batch, moe_gate_up_batch,
moe_down_batch; issue 15) against their host twins and against themselves at m = 1.

Every output starts as poison (0xFF: NaN in BF16 and f32) with guard bytes after it: an element the
kernel should write and did not shows as NaN, one it must not write (a padding entry's rows, the act
row of a pair another rank holds) must still be poison, and the guards must be intact.

Exact (bit for bit):
- each row of an m-row launch against the m = 1 launch of that row, at m = 1, 3, 17, 64, 200 in
  shuffled orders with padding at random positions (batch invariance);
- the grouping of router_group_batch (every word of the workspace, the unwritten ones still
  poison) against its twin's grouping of the device's own ids;
- ids and weights against the twin's routing of the device's own scores.
Within stated bounds against the twins (kernel_util.py): router scores 2**-20 relative plus a quarter
of the f32 dot bound (sigmoid' <= 1/4); act by the f32 dot bound through the clamped SwiGLU plus one
BF16 ulp; parts by the f32 dot bound plus the act rows' one-ulp difference.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_moe_util import (
    MoeCase,
    entries_with_pads,
    free_all,
    get,
    group_words,
    put,
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
from kernel_util import abs_dot, random_bf16, same_bits

from model.kernels import moe
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

# The GLM-5.3-Flash MoE (hidden 4096, 288 experts of intermediate 2048, top-8 + 1 shared expert).
GLM_E, GLM_H, GLM_I, GLM_K = 288, 4096, 2048, 8
BATCH_SIZES = (1, 3, 17, 64, 200)


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_batch_moe"


def poison_rows(a: np.ndarray) -> np.ndarray:
    return (a.view(np.uint8).reshape(a.shape[0], -1) == 0xFF).all(axis=1)


def batch_of(rng, pool: int, m: int) -> tuple[np.ndarray, list[int]]:
    """m entries for distinct rows of a pool (entry e's `row` word names its pool row), about one in
    seven of them padding (none at m = 1), in a random order. Returns the entries and, per entry,
    its pool row (-1 for padding)."""
    pads = 0 if m == 1 else max(1, m // 7)
    live = m - pads
    rows = rng.choice(pool, live, replace=False)
    ent = pack_entries(list(range(live)), rows.tolist(), [0] * live, m)
    order = rng.permutation(m)
    ent = np.ascontiguousarray(ent[order])
    src = [int(ent[e, 1]) if ent[e, 0] != 0xFFFFFFFF else -1 for e in range(m)]
    return ent, src


# ---- router ---------------------------------------------------------------------------------------


def _router_case(rng):
    w = random_bf16(rng, (GLM_E, GLM_H), exp_lo=-12)
    bias = (0.05 * rng.standard_normal(GLM_E)).astype(np.float32)
    return w, bias


def test_router_batch_against_twin_and_the_row_alone(cuda):
    rng = np.random.default_rng()
    w, bias = _router_case(rng)
    E, H, k = GLM_E, GLM_H, GLM_K
    ent, rows = entries_with_pads(rng, 14, 3)
    m = len(ent)
    y = random_bf16(rng, (m, H), exp_lo=-3)
    for _ in range(2):  # the counters the last blocks reset serve the next launch
        gs, gi, gw, gc = router_batch(cuda, w, y, bias, ent, E, H, k, True, 2.5, True)
        assert (gc[: moe.router_counter_words(m, grouped=True)] == 0).all(), (
            "router_group_batch must leave its counters at zero"
        )
    hs, _, _, _ = router_batch(HostBackend(), w, y, bias, ent, E, H, k, True, 2.5, True)
    pad = [e for e in range(m) if e not in rows]
    assert poison_rows(gs)[pad].all() and poison_rows(gi)[pad].all() and poison_rows(gw)[pad].all()
    for e in rows:
        absd = abs_dot(y[e][None], w)[0]
        err = np.abs(gs[e].astype(np.float64) - hs[e])
        assert (err <= 2.0**-20 * np.abs(hs[e]) + 0.25 * 4 * H * 2.0**-24 * absd.max()).all(), f"scores {e}"
        # ids and weights are the twin's routing of the device's own scores
        ri, rw = moe.route_ref(gs[e], bias, k, True, 2.5)
        assert (gi[e, :k] == ri).all() and gi[e, k] == 0
        assert gw[e, :k].tobytes() == rw.tobytes() and gw[e, k] == 1.0
        # and the row launched alone gives the same bits
        s1, i1, w1 = router_row_alone(cuda, w, y[e], bias, E, H, k, True, 2.5, True)
        assert (
            gs[e].tobytes() == s1.tobytes()
            and gi[e].tobytes() == i1.tobytes()
            and gw[e].tobytes() == w1.tobytes()
        )


@pytest.mark.parametrize("h", [GLM_H, 45, 4104])  # the vector path, the scalar path, two rounds per lane
def test_router_batch_rows_are_bit_identical_at_every_m(cuda, h):
    rng = np.random.default_rng()
    E, k = GLM_E, GLM_K
    w = random_bf16(rng, (E, h), exp_lo=-12)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    pool = random_bf16(rng, (max(BATCH_SIZES), h), exp_lo=-3)
    single = {}

    def alone(r):
        if r not in single:
            single[r] = router_batch(
                cuda, w, pool[r][None], bias, pack_entries([0], [r], [0]), E, h, k, True, 2.5, True
            )
        return single[r]

    for m in rng.permutation(BATCH_SIZES):
        ent, src = batch_of(rng, len(pool), int(m))
        y = np.stack([pool[max(r, 0)] for r in src])  # a padding entry's y row is some row: never read
        s, i, wt, _ = router_batch(cuda, w, y, bias, ent, E, h, k, True, 2.5, True)
        for e, r in enumerate(src):
            if r < 0:
                assert poison_rows(s[e : e + 1]).all() and poison_rows(i[e : e + 1]).all(), f"m={m}: pad {e}"
                continue
            s1, i1, w1, _ = alone(r)
            same_bits(s[e : e + 1], s1, f"m={m} scores of entry {e}")
            same_bits(i[e : e + 1], i1, f"m={m} ids of entry {e}")
            same_bits(wt[e : e + 1], w1, f"m={m} weights of entry {e}")


# ---- grouping -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m,pads,E,k,shared,base,n_local",
    [
        (1, 0, 288, 8, True, 0, 288),
        (3, 1, 288, 8, True, 0, 288),
        # One row chunk of at most 32 pairs: the one-warp grouping (group_pairs_warp).
        (1, 0, 288, 8, True, 36, 36),  # a rank's range: zero pairs
        (4, 1, 288, 8, False, 252, 36),  # 32 slots, a padding row, local and zero pairs
        (8, 2, 12, 4, True, 0, 12),  # 32 slots, experts chosen by up to 6 rows
        (2, 0, 40, 16, True, 8, 24),  # top-16, both kinds
        (5, 0, 288, 8, True, 0, 288),  # one chunk of 40 pairs: the block grouping after a barrier
        (17, 4, 12, 4, True, 0, 12),  # collisions: experts with several items
        (64, 9, 288, 8, True, 0, 288),
        (200, 30, 24, 8, True, 0, 24),  # ~60 pairs per expert
        (256, 0, 288, 8, True, 36, 36),  # a rank of 8: most pairs are zero pairs
        (256, 17, 288, 8, False, 252, 36),  # the last rank, no shared slot
        (77, 5, 1024, 128, True, 0, 1024),  # the kernel's limits
    ],
)
def test_group_is_its_twin_word_for_word(cuda, m, pads, E, k, shared, base, n_local):
    """router_group_batch's grouping of its own ids against the twin's grouping of those ids, every
    word of the workspace (the unwritten ones still poison), within the items bound, and the same
    on a second launch."""
    rng = np.random.default_rng()
    H = 64
    w = random_bf16(rng, (E, H), exp_lo=-6)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    ent, _ = entries_with_pads(rng, m - pads, pads)
    y = random_bf16(rng, (m, H), exp_lo=-3)
    _, ids, _, _, g = router_group(cuda, w, y, bias, ent, E, H, k, True, 2.5, shared, base, n_local)
    want = group_words(ids, ent, k, k + int(shared), base, n_local).view(np.uint32)
    assert g.tobytes() == want.tobytes(), "router_group_batch's grouping differs from its twin"
    dec = moe.decode_group(g, m, k, n_local)
    assert dec.n_items <= moe.items_bound(m * k, n_local)
    again = router_group(cuda, w, y, bias, ent, E, H, k, True, 2.5, shared, base, n_local)
    assert again[4].tobytes() == g.tobytes(), "the grouping is deterministic across launches"


@pytest.mark.parametrize("base,n_local", [(0, GLM_E), (252, 36), (36, 36)])
def test_router_group_batch_is_the_router_then_the_grouping(cuda, base, n_local):
    """The routing of a rank's launch (its expert range) against the all-local launch's, bit for bit,
    at every batch size up to 256, and its group against the twin's grouping of the device's own
    ids, word for word."""
    rng = np.random.default_rng()
    w, bias = _router_case(rng)
    E, H, k = GLM_E, GLM_H, GLM_K
    for m in rng.permutation(BATCH_SIZES + (256,)):
        m = int(m)
        ent, rows = entries_with_pads(rng, m - m // 7, m // 7)
        y = random_bf16(rng, (m, H), exp_lo=-3)
        for _ in range(2):  # the counters and the hand-over word serve the next launch
            s, i, wt, ctr, grp = router_group(cuda, w, y, bias, ent, E, H, k, True, 2.5, True, base, n_local)
            assert (ctr[: moe.router_counter_words(m, grouped=True)] == 0).all(), f"m={m}: counters not reset"
        s0, i0, w0, _ = router_batch(cuda, w, y, bias, ent, E, H, k, True, 2.5, True)
        same_bits(s, s0, f"m={m} scores")
        same_bits(i, i0, f"m={m} ids")
        same_bits(wt, w0, f"m={m} weights")
        gh = group_words(i0, ent, k, k + 1, base, n_local).view(np.uint32)
        assert grp.tobytes() == gh.tobytes(), f"m={m}: the fused grouping differs from the twin"


# ---- experts --------------------------------------------------------------------------------------


def check_against_twin(case: MoeCase, weights, y, ids, wts, rows, g, h) -> None:
    """Device outputs g against the twin's h (both Outputs) on the live entries ``rows``; the
    float64 references are computed per expert over all its pairs at once."""
    gu, dn, sgu, sdn = weights
    ns, inter, hh, L = case.nslots, case.inter, case.h, case.limit
    by_expert: dict[int, list[tuple[int, int, float]]] = {}  # expert (-1: shared) -> (pair, entry, weight)
    for e in rows:
        for j in range(ns):
            p = e * ns + j
            if case.ntopk == 0 or j == case.ntopk:
                if case.shared == moe.SHARED_ELSEWHERE:
                    assert poison_rows(g.act[p : p + 1]).all() and (g.parts[p] == 0).all(), f"shared slot {p}"
                    continue
                by_expert.setdefault(-1, []).append((p, e, 1.0))
                continue
            x = int(ids[e, j]) - case.expert_base
            if not 0 <= x < case.n_local:
                assert poison_rows(g.act[p : p + 1]).all(), f"act of pair {p} (another rank's expert) written"
                assert (g.parts[p] == 0).all(), f"parts of pair {p} (another rank's expert) must be zeros"
                continue
            by_expert.setdefault(x, []).append((p, e, float(wts[e, j])))
    for x, lst in by_expert.items():
        wg, wd = (sgu, sdn) if x < 0 else (gu[x], dn[x])
        wg64, wd64 = wg.astype(np.float64), wd.astype(np.float64)
        ps = [p for p, _, _ in lst]
        wt = np.array([w for _, _, w in lst])[:, None]
        y64 = y[[e for _, e, _ in lst]].astype(np.float64)
        ref = y64 @ wg64.T  # [pairs, 2 * inter]
        absd = np.abs(y64) @ np.abs(wg64).T
        eb = 2 * 2 * hh * 2.0**-24 * absd
        gg, uu = np.minimum(ref[:, :inter], L), np.clip(ref[:, inter:], -L, L)
        ga, ha = g.act[ps].astype(np.float64), h.act[ps].astype(np.float64)
        tol = 1.1 * eb[:, :inter] * np.abs(uu) + np.abs(gg) * eb[:, inter:] + 2.0**-7 * np.abs(ha) + 1e-30
        assert not np.isnan(ga).any() and (np.abs(ga - ha) <= tol).all(), f"act of expert {x}'s pairs"
        bound = 2 * 2 * inter * 2.0**-24 * wt * (np.abs(ha) @ np.abs(wd64).T)
        bound += wt * ((2.0**-7 * np.abs(ha)) @ np.abs(wd64).T) + 1e-30
        gp = g.parts[ps].astype(np.float64)
        assert not np.isnan(gp).any() and (np.abs(gp - h.parts[ps]) <= bound).all(), (
            f"parts of expert {x}'s pairs"
        )


CASES = {
    "here": (MoeCase(12, 0, 96, 256, 8, moe.SHARED_HERE), 12),
    "none": (MoeCase(10, 0, 64, 128, 4, moe.SHARED_NONE), 10),
    "elsewhere_odd": (MoeCase(4, 4, 37, 45, 3, moe.SHARED_ELSEWHERE), 12),  # sharded, the scalar paths
    "sharded_here": (MoeCase(6, 12, 40, 64, 4, moe.SHARED_HERE), 24),
    "dense": (MoeCase(1, 0, 72, 128, 0, moe.SHARED_HERE), 1),
}


def _routing(rng, m, name):
    case, E = CASES[name]
    if case.ntopk == 0:
        return np.zeros((m, 1), np.uint32), np.ones((m, 1), np.float32)
    return random_ids(rng, m, case, E), random_weights_rows(rng, m, case)


@pytest.mark.parametrize("name", list(CASES))
def test_experts_batch_against_twin_and_the_row_alone(cuda, name):
    rng = np.random.default_rng()
    case, _ = CASES[name]
    weights = random_weights(rng, case)
    ent, rows = entries_with_pads(rng, 19, 4)
    m, ns = len(ent), case.nslots
    y = random_bf16(rng, (m, case.h), exp_lo=-1)
    ids, wts = _routing(rng, m, name)
    wp = upload_weights(cuda, weights)
    host = HostBackend()
    hp = upload_weights(host, weights)
    try:
        g = run_batch(cuda, wp, case, y, ids, wts, ent)
        h = run_batch(host, hp, case, y, ids, wts, ent)
        check_against_twin(case, weights, y, ids, wts, rows, g, h)
        for e in range(m):
            sl = slice(e * ns, (e + 1) * ns)
            if e not in rows:
                assert poison_rows(g.act[sl]).all() and poison_rows(g.parts[sl]).all(), (
                    f"padding entry {e} written"
                )
                continue
            a1, p1 = run_row_alone(cuda, wp, case, y[e], ids[e], wts[e])
            same_bits(g.act[sl], a1, f"act of entry {e} launched alone")
            same_bits(g.parts[sl], p1, f"parts of entry {e} launched alone")
    finally:
        free_all(cuda, wp)


@pytest.mark.parametrize("name", ["here", "sharded_here", "elsewhere_odd", "dense"])
def test_experts_batch_rows_are_bit_identical_at_every_m(cuda, name):
    """Up to 200 entries over 12 experts: ~130 pairs per expert, 17 items each."""
    rng = np.random.default_rng()
    case, _ = CASES[name]
    wp = upload_weights(cuda, random_weights(rng, case))
    n = max(BATCH_SIZES)
    pool_y = random_bf16(rng, (n, case.h), exp_lo=-1)
    pool_ids, pool_wts = _routing(rng, n, name)
    ns = case.nslots
    single = {}
    try:
        for m in rng.permutation(BATCH_SIZES):
            ent, src = batch_of(rng, n, int(m))
            take = [max(r, 0) for r in src]
            out = run_batch(cuda, wp, case, pool_y[take], pool_ids[take], pool_wts[take], ent)
            for e, r in enumerate(src):
                sl = slice(e * ns, (e + 1) * ns)
                if r < 0:
                    assert poison_rows(out.act[sl]).all() and poison_rows(out.parts[sl]).all(), (
                        f"m={m}: pad {e}"
                    )
                    continue
                if r not in single:
                    one = run_batch(
                        cuda, wp, case, pool_y[r : r + 1], pool_ids[r : r + 1], pool_wts[r : r + 1],
                        pack_entries([0], [r], [0]),
                    )  # fmt: skip
                    single[r] = (one.act, one.parts)
                same_bits(out.act[sl], single[r][0], f"m={m} act of entry {e}")
                same_bits(out.parts[sl], single[r][1], f"m={m} parts of entry {e}")
    finally:
        free_all(cuda, wp)


def test_experts_batch_replays_in_a_graph_with_new_routing(cuda):
    """Captured once, replayed with other ids, weights and grouping each time: the counts stay on
    the device, and each replay gives the eager launch's bits."""
    rng = np.random.default_rng()
    case, E = CASES["here"]
    wp = upload_weights(cuda, random_weights(rng, case))
    ent, _ = entries_with_pads(rng, 15, 2)
    m, ns, inter, h = len(ent), case.nslots, case.inter, case.h
    y = random_bf16(rng, (m, h), exp_lo=-1)
    bufs = {
        "ent": put(cuda, ent),
        "y": put(cuda, y),
        "ids": cuda.alloc(m * ns * 4),
        "wts": cuda.alloc(m * ns * 4),
        "grp": cuda.alloc(moe.group_workspace_bytes(m, case.ntopk, case.n_local)),
        "act": cuda.alloc(m * ns * inter * 2),
        "parts": cuda.alloc(m * ns * h * 4),
    }
    gu, dn, sgu, sdn = wp
    s = cuda.create_stream()
    try:
        b = bufs
        cuda.begin_capture(s)
        moe.moe_gate_up_batch(
            cuda, w=gu, w_shared=sgu, y=b["y"], group=b["grp"], act=b["act"], entries=b["ent"], m=m,
            ntopk=case.ntopk, n_local=case.n_local, inter=inter, h=h, limit=case.limit, shared=case.shared,
            stream=s,
        )  # fmt: skip
        moe.moe_down_batch(
            cuda, w=dn, w_shared=sdn, act=b["act"], weights=b["wts"], group=b["grp"], parts=b["parts"],
            entries=b["ent"], m=m, ntopk=case.ntopk, n_local=case.n_local, h=h, inter=inter,
            shared=case.shared, stream=s,
        )  # fmt: skip
        graph = cuda.end_capture(s, label="batched moe")
        try:
            for _ in range(3):
                ids = random_ids(rng, m, case, E)
                wts = random_weights_rows(rng, m, case)
                cuda.copy_h2d(b["ids"], ids)
                cuda.copy_h2d(b["wts"], wts)
                cuda.copy_h2d(b["grp"], group_words(ids, ent, case.ntopk, ns, 0, case.n_local))
                cuda.memset(b["act"], 0xFF, m * ns * inter * 2)
                cuda.memset(b["parts"], 0xFF, m * ns * h * 4)
                cuda.synchronize()
                cuda.graph_launch(graph, s)
                cuda.synchronize(s)
                act = (
                    get(cuda, b["act"], m * ns * inter * 2, check_guard=False)
                    .view(BF16)
                    .reshape(m * ns, inter)
                )
                parts = (
                    get(cuda, b["parts"], m * ns * h * 4, check_guard=False)
                    .view(np.float32)
                    .reshape(m * ns, h)
                )
                eager = run_batch(cuda, wp, case, y, ids, wts, ent)
                same_bits(act, eager.act, "act of the replay")
                same_bits(parts, eager.parts, "parts of the replay")
        finally:
            cuda.graph_destroy(graph)
    finally:
        cuda.destroy_stream(s)
        free_all(cuda, list(bufs.values()) + list(wp))


# ---- the GLM-5.3-Flash shape ----------------------------------------------------------------------


def test_glm_shape_experts_of_288(cuda):
    """Full-size stacks (288 x [4096, 4096] gate/up, 288 x [4096, 2048] down, 14.5 GB) with 24 of
    the experts holding data and the other 264 NaN (0xFF), so reading a wrong expert shows; the
    batch routes into those 24 (about 21 pairs per expert at m = 64, 67 at m = 200: experts of
    several items). Every row equals that row launched alone on the same stacks bit for bit;
    at m = 64 the device agrees with the twin run on a compact copy of the 24 experts."""
    rng = np.random.default_rng()
    E, h, inter, k = GLM_E, GLM_H, GLM_I, GLM_K
    pool = np.sort(np.concatenate([[0, E - 1], rng.choice(np.arange(1, E - 1), 22, replace=False)])).astype(
        np.uint32
    )
    case_full = MoeCase(E, 0, inter, h, k, moe.SHARED_HERE)
    case_compact = MoeCase(len(pool), 0, inter, h, k, moe.SHARED_HERE)
    gu = random_bf16(rng, (len(pool), 2 * inter, h), exp_lo=-6)
    dn = random_bf16(rng, (len(pool), h, inter), exp_lo=-6)
    sgu = random_bf16(rng, (2 * inter, h), exp_lo=-6)
    sdn = random_bf16(rng, (h, inter), exp_lo=-6)
    gu_b, dn_b = 2 * inter * h * 2, h * inter * 2
    pgu, pdn = cuda.alloc(E * gu_b), cuda.alloc(E * dn_b)
    psgu, psdn = put(cuda, sgu), put(cuda, sdn)
    try:
        cuda.memset(pgu, 0xFF, E * gu_b)
        cuda.memset(pdn, 0xFF, E * dn_b)
        for i, e in enumerate(pool):
            cuda.copy_h2d(pgu.offset(int(e) * gu_b), gu[i])
            cuda.copy_h2d(pdn.offset(int(e) * dn_b), dn[i])
        wp = (pgu, pdn, psgu, psdn)
        for m in (64, 200):
            ent, rows = entries_with_pads(rng, m - 5, 5)
            y = random_bf16(rng, (m, h), exp_lo=-1)
            ids = random_ids(rng, m, case_full, E, pool=pool)
            wts = random_weights_rows(rng, m, case_full)
            g = run_batch(cuda, wp, case_full, y, ids, wts, ent)
            ns = k + 1
            for e in range(m):
                sl = slice(e * ns, (e + 1) * ns)
                if e not in rows:
                    assert poison_rows(g.act[sl]).all() and poison_rows(g.parts[sl]).all()
                    continue
                a1, p1 = run_row_alone(cuda, wp, case_full, y[e], ids[e], wts[e])
                same_bits(g.act[sl], a1, f"m={m} act of entry {e}")
                same_bits(g.parts[sl], p1, f"m={m} parts of entry {e}")
            if m == 64:
                compact = ids.copy()
                compact[:, :k] = np.searchsorted(pool, ids[:, :k])
                host = HostBackend()
                hp = upload_weights(host, (gu, dn, sgu, sdn))
                hh = run_batch(host, hp, case_compact, y, compact, wts, ent)
                check_against_twin(case_compact, (gu, dn, sgu, sdn), y, compact, wts, rows, g, hh)
                del host, hp, hh
    finally:
        free_all(cuda, (pgu, pdn, psgu, psdn))


def test_glm_shape_router_group_and_experts_chain(cuda):
    """router_group_batch -> gate/up -> down at m = 17 on the real router shape,
    with every routed expert filled (the router picks any of the 288): each row's ids, weights,
    act and parts equal that row launched alone."""
    rng = np.random.default_rng()
    E, h, inter, k = GLM_E, GLM_H, GLM_I, GLM_K
    w, bias = _router_case(rng)
    ent, rows = entries_with_pads(rng, 15, 2)
    m = len(ent)
    y = random_bf16(rng, (m, h), exp_lo=-3)
    _, ids, wts, _ = router_batch(cuda, w, y, bias, ent, E, h, k, True, 2.5, True)
    used = np.unique(ids[rows, :k])
    case = MoeCase(E, 0, inter, h, k, moe.SHARED_HERE)
    gu_b, dn_b = 2 * inter * h * 2, h * inter * 2
    pgu, pdn = cuda.alloc(E * gu_b), cuda.alloc(E * dn_b)
    ps = upload_weights(
        cuda, (random_bf16(rng, (2 * inter, h), exp_lo=-6), random_bf16(rng, (h, inter), exp_lo=-6))
    )
    try:
        cuda.memset(pgu, 0xFF, E * gu_b)
        cuda.memset(pdn, 0xFF, E * dn_b)
        for e in used:
            cuda.copy_h2d(pgu.offset(int(e) * gu_b), random_bf16(rng, (2 * inter, h), exp_lo=-6))
            cuda.copy_h2d(pdn.offset(int(e) * dn_b), random_bf16(rng, (h, inter), exp_lo=-6))
        wp = (pgu, pdn, ps[0], ps[1])
        g = run_batch(cuda, wp, case, y, ids, wts, ent)
        for e in rows:
            sl = slice(e * (k + 1), (e + 1) * (k + 1))
            _, i1, w1 = router_row_alone(cuda, w, y[e], bias, E, h, k, True, 2.5, True)
            assert ids[e].tobytes() == i1.tobytes() and wts[e].tobytes() == w1.tobytes()
            a1, p1 = run_row_alone(cuda, wp, case, y[e], ids[e], wts[e])
            same_bits(g.act[sl], a1, f"act of entry {e}")
            same_bits(g.parts[sl], p1, f"parts of entry {e}")
    finally:
        free_all(cuda, (pgu, pdn) + tuple(ps))
