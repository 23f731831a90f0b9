"""The batched DSA kernels' host twins (``dsa_cache_write_batch``, ``indexer_scores_batch``,
``select_topk_pools_batch``, ``extend_selection_batch``, ``sparse_mla_split_batch``,
``sparse_mla_attend_batch``) on per-sequence state laid into slot pools (model/kernels/batch.py):

- each entry against its own m = 1 launch (bit for bit);
- against direct NumPy formulas in float64, with the tolerances of tests/kernel_util.py;
- padding entries, and rows past slot_rows, leave every pool byte untouched (the host backend also
  refuses any store into an argument the declaration does not list as written);
- catch-up: several sequences' consecutive rows in chunks of one launch, in any chunking and slot
  order, give the bytes of writing each sequence's rows alone, one at a time.

The checks in tests/batch_dsa_util.py are the ones tests/test_gpu_batch_dsa.py runs on the GPU at
the GLM-5.3-Flash shapes; running them here on small shapes checks them too.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from batch_dsa_util import (
    EPS,
    LN_EPS,
    STATE,
    AttnShape,
    CacheRun,
    CacheShape,
    ScoreShape,
    attn_case,
    attn_f64,
    attn_world,
    cache_layout,
    cache_world,
    cache_write_batch,
    check_attn,
    check_cache_write,
    check_scores,
    check_select,
    entries_of,
    free_all,
    read_layout,
    score_world,
    scores_f64,
    select_scores,
    state_bytes,
    upload_all,
    written_cache_rows,
)
from kernel_util import random_bf16

from model.kernels import dsa_select, sparse_mla
from model.kernels.batch import PAD_SLOT
from model.kernels.dsa_cache import compress_pool_ref
from model.kernels.dsa_select import selection_capacity
from runtime.dtypes import BF16, FP8
from runtime.host_backend import HostBackend
from runtime.kernel import Pdl

CACHE_SHAPES = [
    CacheShape(slots=4, slot_rows=45, C=32, idim=16, kpool=4),  # slot_rows not a multiple of kpool
    CacheShape(slots=3, slot_rows=40, C=40, idim=20, kpool=3),  # odd kpool, dims not multiples of 16
]


# ---- dsa_cache_write_batch ------------------------------------------------------------------------


@pytest.mark.parametrize("sh", CACHE_SHAPES, ids=["kpool4", "kpool3"])
@pytest.mark.parametrize("m", [1, 3, 9, 17])
@pytest.mark.parametrize("row_add", [0, 2])
def test_cache_write_batch_equals_alone(sh, m, row_add):
    """Runs of consecutive rows of distinct slots with padding between them: the same bytes as each
    entry alone (m = 1, in entry order); padding and rows past slot_rows write nothing."""
    rng = np.random.default_rng(100 * m + row_add)
    world = cache_world(rng, sh)
    run = cache_layout(rng, sh, m, row_add, 0, sh.slot_rows - 1)
    got = check_cache_write(HostBackend(), world, sh, run, row_add)
    w = written_cache_rows(world, sh, run.live)
    # Everything a launch may not write is the world's byte for byte.
    cache = got["cache"].reshape(-1, sh.C)
    assert np.array_equal(cache[~w["latent"]], world["cache"].view(np.uint8)[~w["latent"]])
    keys = got["keys"].view(np.uint16).reshape(sh.slots, sh.slot_rows, sh.idim)
    assert np.array_equal(keys[~w["key"]], world["keys"].view(np.uint16)[~w["key"]])
    pk = got["pool_keys"].reshape(-1, sh.idim)
    assert np.array_equal(pk[~w["pool"]], world["pool_keys"].view(np.uint8)[~w["pool"]])


def _rmsnorm64(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean() + eps) * w.astype(np.float64)


def _ln64(x, w, b, eps):
    x = x.astype(np.float64)
    return (x - x.mean()) / np.sqrt(x.var() + eps) * w.astype(np.float64) + b.astype(np.float64)


def test_cache_write_batch_against_formulas():
    """Latents (FP8 of rmsnorm * w), keys (LayerNorm, BF16), gates (copied) and pool keys (softmax
    over the pool's rows of gate + ape weighting the keys) at their slots' places, in float64."""
    sh = CACHE_SHAPES[0]
    rng = np.random.default_rng(7)
    world = cache_world(rng, sh)
    run = cache_layout(rng, sh, 13, 1, 0, sh.slot_rows - 1)
    assert any((row + 1) % sh.kpool == 0 for _, _, row in run.live), "the case must complete a pool"
    got = check_cache_write(HostBackend(), world, sh, run, 1, invariance=False)
    cache = got["cache"].view(FP8).reshape(-1, sh.C).astype(np.float64)
    scales = got["scales"].view(np.float32)
    keys = got["keys"].view(BF16).reshape(sh.slots, sh.slot_rows, sh.idim)
    gates = got["gates"].view(BF16).reshape(sh.slots, sh.slot_rows, sh.idim)
    pk = got["pool_keys"].view(FP8).reshape(-1, sh.idim).astype(np.float64)
    ps = got["pool_scales"].view(np.float32)
    g = sh.geo
    for e, slot, row in run.live:
        f = run.fused[e]
        at = int(world["tables"][slot][row // sh.bs]) * sh.bs + row % sh.bs
        ref = _rmsnorm64(f[: sh.C], world["kv_w"], EPS)
        np.testing.assert_allclose(
            cache[at] * scales[at], ref, rtol=2.0**-3, atol=float(scales[at]) * 2.0**-8
        )
        kref = _ln64(f[sh.C : sh.C + sh.idim], world["kw"], world["kb"], LN_EPS)
        np.testing.assert_allclose(
            keys[slot, row].astype(np.float64), kref, rtol=2.0**-7, atol=np.abs(kref).max() * 2.0**-12
        )
        assert gates[slot, row].tobytes() == f[sh.C + sh.idim : sh.C + 2 * sh.idim].tobytes()
        if (row + 1) % sh.kpool == 0:
            p = row // sh.kpool
            rows = slice(p * sh.kpool, (p + 1) * sh.kpool)
            lg = gates[slot, rows].astype(np.float64) + world["ape"].astype(np.float64)
            sm = np.exp(lg - lg.max(0))
            pref = (sm / sm.sum(0) * keys[slot, rows].astype(np.float64)).sum(0)
            i = g.pool_row(slot, p)
            np.testing.assert_allclose(pk[i] * ps[i], pref, rtol=2.0**-3, atol=float(ps[i]) * 2.0**-8)
            np.testing.assert_allclose(
                pref,
                compress_pool_ref(keys[slot, rows], gates[slot, rows], world["ape"]),
                rtol=1e-5,
                atol=1e-6,
            )


def test_padding_and_out_of_slot_entries_write_nothing():
    sh = CACHE_SHAPES[0]
    rng = np.random.default_rng(3)
    world = cache_world(rng, sh)
    ent = np.zeros((6, 4), np.uint32)
    ent[:, 0] = PAD_SLOT
    ent[:, 1] = [0, 3, 7, 11, sh.slot_rows - 1, 2]  # padding rows that would complete pools
    ent[4, 0], ent[4, 1] = 1, sh.slot_rows  # a row past its slot: the next slot's first row
    gpu = HostBackend()
    p = upload_all(gpu, world)
    io = upload_all(gpu, {"fused": random_bf16(rng, (6, sh.stride)), "entries": ent})
    cache_write_batch(gpu, p, sh, io["fused"], io["entries"], 6, 0)
    after = state_bytes(gpu, p, world)
    for k in STATE:
        assert np.array_equal(after[k], np.ascontiguousarray(world[k]).reshape(-1).view(np.uint8)), k
    free_all(gpu, p, io)


@pytest.mark.parametrize("sh", CACHE_SHAPES, ids=["kpool4", "kpool3"])
def test_catchup_chunks_equal_sequences_written_alone(sh):
    """Three sequences' rows (each crossing several pools) in launches of random chunks of each,
    sequences in random order with padding between them: every pool byte as writing each
    sequence's rows alone, one row per launch."""
    rng = np.random.default_rng(11)
    world = cache_world(rng, sh)
    seqs = {}
    for slot in rng.choice(sh.slots, 3, replace=False):
        r0 = int(rng.integers(0, 8))
        n = int(rng.integers(12, sh.slot_rows - r0 + 1))
        seqs[int(slot)] = (r0, random_bf16(rng, (n, sh.stride), exp_lo=-2))
    ref_gpu, gpu = HostBackend(), HostBackend()
    pr, p = upload_all(ref_gpu, world), upload_all(gpu, world)
    for slot, (r0, rows) in seqs.items():  # alone: one row per launch
        for i in range(len(rows)):
            ent, _ = entries_of([(slot, r0 + i)], 0)
            io = upload_all(ref_gpu, {"fused": rows[i : i + 1], "entries": ent})
            cache_write_batch(ref_gpu, pr, sh, io["fused"], io["entries"], 1, 0)
            free_all(ref_gpu, io)
    done = dict.fromkeys(seqs, 0)
    launches = 0
    while any(done[s] < len(seqs[s][1]) for s in seqs):
        order = [s for s in rng.permutation(list(seqs)) if done[int(s)] < len(seqs[int(s)][1])]
        layout, fused = [], []
        for s in order:
            s = int(s)
            r0, rows = seqs[s]
            k = int(rng.integers(1, 8))
            take = range(done[s], min(done[s] + k, len(rows)))
            if rng.random() < 0.5:
                layout.append(None)
                fused.append(np.zeros(sh.stride, BF16))
            layout.extend((s, r0 + i) for i in take)
            fused.extend(rows[i] for i in take)
            done[s] = take.stop
        ent, _ = entries_of(layout, 0)
        io = upload_all(gpu, {"fused": np.stack(fused), "entries": ent})
        cache_write_batch(gpu, p, sh, io["fused"], io["entries"], len(layout), 0)
        free_all(gpu, io)
        launches += 1
    assert launches > 1
    a, b = state_bytes(gpu, p, world), state_bytes(ref_gpu, pr, world)
    for k in STATE:
        assert np.array_equal(a[k], b[k]), f"{k}: chunked catch-up differs from rows written alone"


def test_cache_write_batch_keeps_the_slot_order_free():
    """The same runs in another order of slots (and other padding): every pool byte the same."""
    sh = CACHE_SHAPES[0]
    rng = np.random.default_rng(5)
    world = cache_world(rng, sh)
    run = cache_layout(rng, sh, 12, 0, 0, sh.slot_rows - 1)
    got = check_cache_write(HostBackend(), world, sh, run, 0, invariance=False)
    perm = list(rng.permutation(len(run.runs)))
    layout, fused = [None], [np.zeros(sh.stride, BF16)]
    for i in perm:
        e0, slot, r0, n = run.runs[i]
        layout.extend((slot, r0 + j) for j in range(n))
        fused.extend(run.fused[e0 : e0 + n])
    ent, live = entries_of(layout, 0)
    other = check_cache_write(
        HostBackend(), world, sh, CacheRun(ent, live, [], np.stack(fused)), 0, invariance=False
    )
    for k in STATE:
        assert np.array_equal(got[k], other[k]), k


# ---- indexer_scores_batch -------------------------------------------------------------------------

SCORE_SHAPES = [
    ScoreShape(slots=3, slot_rows=64, heads=5, dim=12, kpool=4),  # odd heads, dim % 4 == 0
    ScoreShape(slots=2, slot_rows=50, heads=3, dim=18, kpool=3),  # dim % 4 != 0, slot_rows % kpool != 0
]


@pytest.mark.parametrize("sh", SCORE_SHAPES, ids=["h5d12", "h3d18"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_indexer_scores_batch(sh, m):
    """Bit for bit each entry's m = 1 launch; float64 within
    the f32 accumulation bound; padding and rows past slot_rows write nothing."""
    rng = np.random.default_rng(m)
    world = score_world(rng, sh, m)
    lay = read_layout(rng, sh.slots, sh.slot_rows, m, 1, 0, sh.slot_rows - 1)
    got = check_scores(HostBackend(), world, sh, lay, 1)
    for e, slot, row in lay.live:
        npools = (row + 1) // sh.kpool
        if npools:
            ref, mag = scores_f64(world, sh, e, slot, row)
            bound = 4 * (sh.dim + sh.heads) * 2.0**-24 * mag + 1e-30
            assert (np.abs(got[e, :npools] - ref) <= bound).all(), f"entry {e}"


# ---- select_topk_pools_batch / extend_selection_batch ---------------------------------------------


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("kind", ["random", "ties"])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
def test_select_and_extend_batch(m, kind, tail):
    """Exact against select_rows_ref, bit for bit m = 1; rows spread over the
    dense (pools <= topk) and the ranked regime."""
    sh = ScoreShape(slots=3, slot_rows=64, heads=1, dim=4, kpool=4)
    rng = np.random.default_rng(10 * m + tail)
    lay = read_layout(rng, sh.slots, sh.slot_rows, m, 2, 0, sh.slot_rows - 3)
    sel_cap = selection_capacity(sh.slot_rows, 3, sh.kpool, 2)
    check_select(HostBackend(), select_scores(rng, sh, m, kind), sh, lay, 2, 3, tail, sel_cap)


def test_select_batch_past_sel_cap_is_count_zero():
    """A selection longer than sel_cap (a sizing error) is the visible failure, count 0."""
    sh = ScoreShape(slots=2, slot_rows=64, heads=1, dim=4, kpool=4)
    rng = np.random.default_rng(2)
    ent, _ = entries_of([(0, 40), (1, 9), (1, 62)], 0)
    gpu = HostBackend()
    io = upload_all(gpu, {"entries": ent, "scores": select_scores(rng, sh, 3, "random")})
    out = upload_all(gpu, {"sel": np.full(3 * 8, 0xFFFFFFFF, np.uint32), "cnt": np.full(3, 7, np.uint32)})
    dsa_select.select_topk_pools_batch(
        gpu,
        scores=io["scores"],
        selected=out["sel"],
        count=out["cnt"],
        entries=io["entries"],
        m=3,
        row_add=0,
        slot_rows=sh.slot_rows,
        sel_cap=8,
        topk_pools=2,
        kpool=4,
        tail=True,
    )
    cnt = np.empty(3, np.uint32)
    gpu.copy_d2h(cnt, out["cnt"])
    # row 40: 2 pools + 1 tail row = 9 > 8; row 9: 2 pools (dense) + 2 = 10 > 8; row 62: 8 + 3.
    assert list(cnt) == [0, 0, 0]
    free_all(gpu, io, out)


def test_extend_batch_leaves_a_full_list():
    """Entry 0's list is full (count == sel_cap): unchanged; padding: unchanged; entry 2 appends."""
    gpu = HostBackend()
    ent, _ = entries_of([(0, 5), None, (1, 9)], 0)
    start = 100 + np.arange(12, dtype=np.uint32)
    io = upload_all(gpu, {"entries": ent, "sel": start, "cnt": np.array([4, 1, 2], np.uint32)})
    dsa_select.extend_selection_batch(
        gpu, selected=io["sel"], count=io["cnt"], entries=io["entries"], m=3, row_add=1, sel_cap=4
    )
    sel, cnt = np.empty(12, np.uint32), np.empty(3, np.uint32)
    gpu.copy_d2h(sel, io["sel"])
    gpu.copy_d2h(cnt, io["cnt"])
    assert list(cnt) == [4, 1, 3]
    expect = start.copy()
    expect[2 * 4 + 2] = 10
    np.testing.assert_array_equal(sel, expect)
    free_all(gpu, io)


# ---- sparse_mla_split_batch / sparse_mla_attend_batch ---------------------------------------------

ATTN_SHAPES = [
    AttnShape(slots=3, slot_rows=200, heads=20, dim=32, sel_cap=70),  # a tile and a partial tile
    AttnShape(slots=2, slot_rows=150, heads=4, dim=48, sel_cap=130),  # heads below a tile, 3 splits
]


@pytest.mark.parametrize("sh", ATTN_SHAPES, ids=["h20d32", "h4d48"])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
def test_sparse_mla_batch(sh, m, split):
    """Bit for bit each entry's m = 1 launch (the workspace too);
    float64 attention within 2**-7 relative plus 2**-9 of the head's largest output; empty
    selections give zeros; padding writes nothing."""
    rng = np.random.default_rng(m + 50 * split)
    world = attn_world(rng, sh, m)
    case = attn_case(rng, sh, m, [0, 1, 37, 64, 65, sh.sel_cap])
    got = check_attn(HostBackend(), world, sh, case, split)
    for e, slot, rows in case.live:
        ref = attn_f64(world, sh, e, slot, rows)
        if rows.size == 0:
            assert not got[e].any(), f"entry {e}: an empty selection must give zeros"
            continue
        np.testing.assert_allclose(
            got[e], ref, rtol=2.0**-7, atol=float(np.abs(ref).max()) * 2.0**-9, err_msg=f"entry {e}"
        )


def test_sparse_mla_batch_clamps_the_count_to_sel_cap():
    """A count past sel_cap (a sizing error) attends the first sel_cap rows: the same output as a
    count of sel_cap, never another entry's rows or workspace."""
    sh = ATTN_SHAPES[0]
    rng = np.random.default_rng(4)
    world = attn_world(rng, sh, 2)
    case = attn_case(rng, sh, 2, [sh.sel_cap])
    over = case.cnt.copy()
    over[[e for e, _, _ in case.live]] = sh.sel_cap + 9
    outs = []
    for cnt in (case.cnt, over):
        for split in (True, False):
            c = type(case)(case.entries, case.live, case.pads, case.sel, cnt)
            outs.append(check_attn(HostBackend(), world, sh, c, split, invariance=False))
    assert np.array_equal(outs[0], outs[2]) and np.array_equal(outs[1], outs[3])


def test_split_workspace_batch_is_per_entry():
    pb, mb = sparse_mla.split_workspace(64, 512, 2053)
    assert sparse_mla.split_workspace_batch(64, 512, 2053, 17) == (17 * pb, 17 * mb)
    assert sparse_mla.batch_splits(2053) * 64 * 512 * 4 == pb
    assert sparse_mla.batch_splits(0) == 1


def test_batched_wrappers_refuse_m_outside_the_grid():
    gpu = HostBackend()
    p = gpu.alloc(64)
    with pytest.raises(ValueError, match="m=0"):
        sparse_mla.sparse_mla_attend_batch(
            gpu,
            q=p,
            cache=p,
            scales=p,
            tables=p,
            selected=p,
            count=p,
            out=p,
            entries=p,
            m=0,
            slot_rows=16,
            sel_cap=4,
            heads=1,
            dim=16,
            block_size=16,
            scale=1.0,
        )
    with pytest.raises(ValueError, match="m=70000"):
        dsa_select.indexer_scores_batch(
            gpu,
            q=p,
            q_stride=0,
            w=p,
            w_stride=0,
            pool_keys=p,
            pool_scales=p,
            scores=p,
            entries=p,
            m=70000,
            row_add=0,
            slot_rows=16,
            heads=1,
            dim=4,
            kpool=4,
            w_scale=1.0,
        )
    gpu.free(p)


def test_scores_grid_keeps_m_1_and_bounds_the_launch():
    """At m = 1 an entry gets up to SCORES_MAX_GRID blocks (one per 8 pools); larger batches give each entry fewer blocks, the
    launch about SCORES_BATCH_BLOCKS whatever m."""
    assert dsa_select.scores_batch_grid(1, 4096) == (dsa_select.SCORES_MAX_GRID, 1)
    assert dsa_select.scores_batch_grid(1, 64) == (8, 1)
    assert dsa_select.scores_batch_grid(4, 4096) == (dsa_select.SCORES_MAX_GRID, 4)
    assert dsa_select.scores_batch_grid(64, 4096) == (17, 64)
    assert dsa_select.scores_batch_grid(256, 4096) == (5, 256)
    for m in (3, 17, 64, 200, 256):
        per, _ = dsa_select.scores_batch_grid(m, 4096)
        assert per * m <= dsa_select.SCORES_BATCH_BLOCKS + m


# ---- the committed PTX of the batched kernels (as tests/test_pdl_ptx.py checks every kernel) -----

# (module, function, PDL contract, releases right after its wait): what the step's overlaps rely on.
BATCH_KERNELS = [
    ("dsa_cache", "dsa_cache_write_batch", Pdl.WAIT, True),
    ("dsa_select", "indexer_scores_batch", Pdl.WAIT, True),
    ("dsa_select", "indexer_scores_batch_mma2", Pdl.WAIT, True),
    ("dsa_select", "select_radix_hist_batch", Pdl.WAIT, True),
    ("dsa_select", "select_topk_pools_batch", Pdl.WAIT, True),
    ("dsa_select", "extend_selection_batch", Pdl.WAIT, True),
    ("sparse_mla", "sparse_mla_partial_batch", Pdl.WAIT, True),
    ("sparse_mla", "sparse_mla_combine_batch", Pdl.WAIT, True),
    ("sparse_mla", "sparse_mla_partial_wide_batch", Pdl.WAIT, True),
    ("sparse_mla", "sparse_mla_combine_wide_batch", Pdl.WAIT, True),
    ("sparse_mla", "sparse_mla_attend_batch", Pdl.NONE, False),
]


@pytest.mark.parametrize("module,function,pdl,releases", BATCH_KERNELS, ids=lambda v: str(v))
def test_batched_kernels_pdl_flags(module, function, pdl, releases):
    """Each batched kernel takes part in PDL as the step's order needs (WAIT, releasing right after
    its wait; the one-pass attention fallback not at all)."""
    from runtime.kernel import lookup

    decl = lookup(module, function)
    assert decl is not None
    assert (decl.pdl, decl.releases) == (pdl, releases)


@pytest.mark.parametrize(
    "module,function,form",
    [
        ("dsa_select", "select_topk_pools_batch", "f32"),
        ("sparse_mla", "sparse_mla_combine_batch", "f32"),
        ("sparse_mla", "sparse_mla_combine_wide_batch", "f32"),
    ],
    ids=lambda v: str(v),
)
def test_a_batched_successor_of_an_early_release_reads_it_through_l2(module, function, form):
    """The indexer's scores and the MLA partials come from kernels that release early: their
    readers must not take the read-only path (ptx/common.cuh)."""
    from test_pdl_ptx import _READ_ONLY_FORMS, entry_body

    body = entry_body(module, function)
    assert _READ_ONLY_FORMS[form].search(body) is None, (
        f"{function} reads its predecessor through ld.global.nc"
    )
    assert "ld.global.cg" in body


def test_selection_capacity_constant_matches_the_kernel():
    """model/kernels/dsa_select.py TOPK_MAX_POOLS is the kernel's capacity (ptx/dsa_select.cu)."""
    src = (Path(__file__).resolve().parent.parent / "ptx" / "dsa_select.cu").read_text()
    m = re.search(r"#define TOPK_MAX_POOLS_CUDA (\d+)u", src)
    assert m and int(m.group(1)) == dsa_select.TOPK_MAX_POOLS
