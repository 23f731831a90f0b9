"""The FP8 expert kernels on the device (ptx/moe.cu: moe_gate_up_fp8_batch, moe_down_fp8_batch;
issue 18) against their host twins, against float64 and against themselves at m = 1.

Every output starts as poison (0xFF: NaN in BF16 and f32) with guard bytes after it: an element the
kernel should write and did not shows as NaN, one it must not write (a padding entry's rows, the act
row of a pair another rank holds, a shared slot held elsewhere) must still be poison, and the guards
must be intact.

Exact (bit for bit):
- each row of an m-row launch against the m = 1 launch of that row, at m = 1, 3, 17, 64, 200 in
  shuffled orders with padding at random positions (batch invariance), on the vector and the
  byte-wise load paths, with partial blocks;
- every E4M3 code but NaN, at every byte position of a 16-byte chunk, times power-of-two block
  scales, against its exact value (one-hot activations make each output a single product);
- a graph replay against the eager launch, with new routing each replay.
Within stated bounds (tests/batch_moe_fp8_util.py): act against the twin by twice the block-scaled
f32 dot bound ((min(k, 128) + 2 ceil(k / 128)) 2**-24 sum|w x|, doubled) through the clamped SwiGLU
plus a BF16 ulp; parts by the same bound on the down projection plus the act rows' difference
carried through the down weights; and both against float64 of the exact weights q * s.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_moe_fp8_util import (
    check_against_float64,
    check_against_twin,
    check_unwritten_and_zero,
    poison_rows,
    random_fp8_experts,
    run_batch_fp8,
    run_row_alone_fp8,
    same_bits,
    upload,
)
from batch_moe_util import (
    MoeCase,
    entries_with_pads,
    free_all,
    get,
    group_words,
    poisoned,
    put,
    random_ids,
    random_weights_rows,
    router_batch,
)
from kernel_util import random_bf16

from model.kernels import moe
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16, FP8
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
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_batch_moe_fp8"


def batch_of(rng, pool: int, m: int) -> tuple[np.ndarray, list[int]]:
    """m entries for distinct rows of a pool, about one in seven padding (none at m = 1), in a random
    order; returns the entries and per entry its pool row (-1 for padding)."""
    pads = 0 if m == 1 else max(1, m // 7)
    live = m - pads
    rows = rng.choice(pool, live, replace=False)
    ent = pack_entries(list(range(live)), rows.tolist(), [0] * live, m)
    ent = np.ascontiguousarray(ent[rng.permutation(m)])
    return ent, [int(ent[e, 1]) if ent[e, 0] != 0xFFFFFFFF else -1 for e in range(m)]


# (case, experts in the router's range). The load path of each kernel is the vector one where its k
# is a multiple of 16 (gate/up: h, down: inter), else the byte-wise one; within the vector path the
# whole batches of 256 columns run unpredicated and the rest of a row predicated. Rows past the
# matrix in a warp's 16 where inter % 8 != 0 (gate/up) or h % 16 != 0 (down).
CASES = {
    # gate/up: 256 columns unpredicated + 64 predicated (a partial block); down: predicated
    "here": (MoeCase(12, 0, 160, 320, 8, moe.SHARED_HERE, 4.0), 12),
    "none": (MoeCase(10, 0, 48, 128, 4, moe.SHARED_NONE, 4.0), 10),
    "elsewhere_odd": (MoeCase(4, 4, 37, 45, 3, moe.SHARED_ELSEWHERE, 4.0), 12),  # byte-wise, sharded
    "sharded_here": (MoeCase(6, 12, 32, 64, 4, moe.SHARED_HERE, 4.0), 24),
    "dense": (MoeCase(1, 0, 72, 136, 0, moe.SHARED_HERE, 4.0), 1),  # byte-wise both
    # gate/up unpredicated with rows past inter; down byte-wise
    "ragged_inter": (MoeCase(5, 0, 36, 256, 4, moe.SHARED_HERE, 4.0), 5),
    # down unpredicated with rows past h (and 2 x 256 columns); gate/up byte-wise
    "ragged_h": (MoeCase(5, 0, 512, 72, 4, moe.SHARED_HERE, 4.0), 5),
}


def _routing(rng, m, name):
    case, E = CASES[name]
    if case.ntopk == 0:
        return np.zeros((m, 1), np.uint32), np.ones((m, 1), np.float32)
    return random_ids(rng, m, case, E), random_weights_rows(rng, m, case)


@pytest.mark.parametrize("name", list(CASES))
def test_experts_fp8_against_twin_float64_and_the_row_alone(cuda, name):
    rng = np.random.default_rng()
    case, _ = CASES[name]
    ex = random_fp8_experts(rng, case)
    ent, rows = entries_with_pads(rng, 19, 4)
    m, ns = len(ent), case.nslots
    y = random_bf16(rng, (m, case.h), exp_lo=-6)
    ids, wts = _routing(rng, m, name)
    wp = upload(cuda, ex)
    host = HostBackend()
    try:
        g = run_batch_fp8(cuda, wp, case, y, ids, wts, ent)
        t = run_batch_fp8(host, upload(host, ex), case, y, ids, wts, ent)
        check_unwritten_and_zero(case, ids, rows, g)
        check_against_twin(case, ex, y, ids, wts, rows, g, t)
        check_against_float64(case, ex, y, ids, wts, rows, g, roundings=2)
        for e in rows:
            sl = slice(e * ns, (e + 1) * ns)
            a1, p1 = run_row_alone_fp8(cuda, wp, case, y[e], ids[e], wts[e])
            same_bits(g.act[sl], a1, f"act of entry {e} launched alone")
            same_bits(g.parts[sl], p1, f"parts of entry {e} launched alone")
    finally:
        free_all(cuda, wp)


@pytest.mark.parametrize(
    "name", ["here", "sharded_here", "elsewhere_odd", "dense", "ragged_inter", "ragged_h"]
)
def test_experts_fp8_rows_are_bit_identical_at_every_m(cuda, name):
    """Up to 200 entries over 5-12 experts: up to about 300 pairs per expert, 40 items each."""
    rng = np.random.default_rng()
    case, _ = CASES[name]
    wp = upload(cuda, random_fp8_experts(rng, case))
    n = max(BATCH_SIZES)
    pool_y = random_bf16(rng, (n, case.h), exp_lo=-6)
    pool_ids, pool_wts = _routing(rng, n, name)
    ns = case.nslots
    single = {}
    try:
        for m in rng.permutation(BATCH_SIZES):
            ent, src = batch_of(rng, n, int(m))
            take = [max(r, 0) for r in src]
            out = run_batch_fp8(cuda, wp, case, pool_y[take], pool_ids[take], pool_wts[take], ent)
            for e, r in enumerate(src):
                sl = slice(e * ns, (e + 1) * ns)
                if r < 0:
                    assert poison_rows(out.act[sl]).all() and poison_rows(out.parts[sl]).all(), (
                        f"m={m}: pad {e}"
                    )
                    continue
                if r not in single:
                    single[r] = run_row_alone_fp8(cuda, wp, case, pool_y[r], pool_ids[r], pool_wts[r])
                same_bits(out.act[sl], single[r][0], f"m={m} act of entry {e}")
                same_bits(out.parts[sl], single[r][1], f"m={m} parts of entry {e}")
    finally:
        free_all(cuda, wp)


@pytest.mark.parametrize("inter", [64, 40])  # the vector path; the byte-wise one
def test_every_e4m3_code_widens_exactly(cuda, inter):
    """The down projection of a dense MLP (the shared slot: no routing weight) with one-hot
    activations: entry e's act row is 1 at column e, so parts[e][r] = s[r / 128][e / 128] *
    q[r][e], a single product, exact with power-of-two scales. Column e of the weights holds every
    code but the NaNs over its 256 rows (subnormals, both zeros, +-448), and column e sits at byte
    e % 16 of its lane's chunk: each code is widened at every position."""
    rng = np.random.default_rng()
    h, m = 256, inter
    codes = ((np.arange(h)[:, None] + 37 * np.arange(inter)[None, :]) % 256).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scales = (2.0 ** rng.integers(-12, 6, moe.down_scale_shape(1, h, inter))).astype(np.float32)
    dn = codes.view(FP8)[None]
    act = np.zeros((m, inter), np.float32)
    act[np.arange(m), np.arange(m)] = 1.0
    ptrs = [
        put(cuda, dn.view(np.uint8)),
        put(cuda, scales),
        put(cuda, pack_entries(list(range(m)), list(range(m)), [0] * m)),
    ]
    ptrs.append(put(cuda, act.astype(BF16)))
    parts = poisoned(cuda, m * h * 4)
    try:
        moe.moe_down_fp8_batch(
            cuda, w=ptrs[0], w_scale=ptrs[1], w_shared=ptrs[0], w_shared_scale=ptrs[1], act=ptrs[3], weights=None,
            group=None, parts=parts, entries=ptrs[2], m=m, ntopk=0, n_local=1, h=h, inter=inter, shared=moe.SHARED_HERE,
        )  # fmt: skip
        cuda.synchronize()
        got = get(cuda, parts, m * h * 4).view(np.float32).reshape(m, h)
    finally:
        free_all(cuda, ptrs + [parts])
    want = (dn[0].astype(np.float64) * scales[0][np.arange(h) // 128][:, np.arange(inter) // 128]).T
    assert not np.isnan(got).any()
    bad = got.astype(np.float64) != want
    assert not bad.any(), (
        f"{int(bad.sum())} codes widened wrongly, e.g. code {codes.T[bad][:4]} -> {got[bad][:4]}"
    )


def test_experts_fp8_replay_in_a_graph_with_new_routing(cuda):
    """Captured once, replayed with other ids, weights and grouping each time: each replay gives
    the eager launch's bits."""
    rng = np.random.default_rng()
    case, E = CASES["here"]
    ex = random_fp8_experts(rng, case)
    wp = upload(cuda, ex)
    ent, _ = entries_with_pads(rng, 15, 2)
    m, ns, inter, h = len(ent), case.nslots, case.inter, case.h
    y = random_bf16(rng, (m, h), exp_lo=-6)
    b = {
        "ent": put(cuda, ent),
        "y": put(cuda, y),
        "wts": cuda.alloc(m * ns * 4),
        "grp": cuda.alloc(moe.group_workspace_bytes(m, case.ntopk, case.n_local)),
        "act": cuda.alloc(m * ns * inter * 2),
        "parts": cuda.alloc(m * ns * h * 4),
    }
    gu, gu_s, dn, dn_s, sgu, sgu_s, sdn, sdn_s = wp
    common = dict(entries=b["ent"], m=m, ntopk=case.ntopk, n_local=case.n_local, shared=case.shared)
    s = cuda.create_stream()
    try:
        cuda.begin_capture(s)
        moe.moe_gate_up_fp8_batch(
            cuda, w=gu, w_scale=gu_s, w_shared=sgu, w_shared_scale=sgu_s, y=b["y"], group=b["grp"], act=b["act"],
            inter=inter, h=h, limit=case.limit, stream=s, **common,
        )  # fmt: skip
        moe.moe_down_fp8_batch(
            cuda, w=dn, w_scale=dn_s, w_shared=sdn, w_shared_scale=sdn_s, act=b["act"], weights=b["wts"],
            group=b["grp"], parts=b["parts"], h=h, inter=inter, stream=s, **common,
        )  # fmt: skip
        graph = cuda.end_capture(s, label="batched fp8 moe")
        try:
            for _ in range(3):
                ids = random_ids(rng, m, case, E)
                wts = random_weights_rows(rng, m, case)
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
                eager = run_batch_fp8(cuda, wp, case, y, ids, wts, ent)
                same_bits(act, eager.act, "act of the replay")
                same_bits(parts, eager.parts, "parts of the replay")
        finally:
            cuda.graph_destroy(graph)
    finally:
        cuda.destroy_stream(s)
        free_all(cuda, list(b.values()) + list(wp))


# ---- the GLM-5.3-Flash shape ----------------------------------------------------------------------


def _glm_stacks(cuda, rng, pool, base):
    """Full-size FP8 stacks (288 x [4096, 4096] gate/up, 288 x [4096, 2048] down, 7.2 GB) with the
    experts of ``pool`` holding data and every other expert's codes 0xFF and scales NaN, so an
    output that reads a wrong expert's scales is NaN. Returns (device pointers as upload gives
    them, the compact Fp8Experts of the pool's experts)."""
    E, h, inter = GLM_E, GLM_H, GLM_I
    ex = random_fp8_experts(rng, MoeCase(len(pool), 0, inter, h, GLM_K, moe.SHARED_HERE, 4.0), base=base)
    sizes = [ex.gu[0].nbytes, ex.gu_s[0].nbytes, ex.dn[0].nbytes, ex.dn_s[0].nbytes]
    stacks = [cuda.alloc(E * n) for n in sizes]
    for p, n in zip(stacks, sizes):
        cuda.memset(p, 0xFF, E * n)
    for i, e in enumerate(pool):
        for p, n, a in zip(stacks, sizes, (ex.gu, ex.gu_s, ex.dn, ex.dn_s)):
            cuda.copy_h2d(p.offset(int(e) * n), a[i].view(np.uint8) if a.dtype != np.float32 else a[i])
    shared = [
        put(cuda, a.view(np.uint8) if a.dtype != np.float32 else a)
        for a in (ex.sgu, ex.sgu_s, ex.sdn, ex.sdn_s)
    ]
    return (stacks[0], stacks[1], stacks[2], stacks[3], *shared), ex


def test_glm_shape_experts_of_288(cuda):
    """24 of the 288 experts hold data; the batch routes into those (about 21 pairs per expert at
    m = 64, 67 at m = 200: experts of several items). Every row equals that row launched alone on
    the same stacks bit for bit; at m = 64 the device agrees with the twin on a compact copy of the
    24 experts, and with float64."""
    rng = np.random.default_rng()
    E, h, inter, k = GLM_E, GLM_H, GLM_I, GLM_K
    pool = np.sort(np.concatenate([[0, E - 1], rng.choice(np.arange(1, E - 1), 22, replace=False)])).astype(
        np.uint32
    )
    case_full = MoeCase(E, 0, inter, h, k, moe.SHARED_HERE, 8.0)
    case_compact = MoeCase(len(pool), 0, inter, h, k, moe.SHARED_HERE, 8.0)
    wp, ex = _glm_stacks(cuda, rng, pool, base=2.0**-12)
    try:
        for m in (64, 200):
            ent, rows = entries_with_pads(rng, m - 5, 5)
            y = random_bf16(rng, (m, h), exp_lo=-6)
            ids = random_ids(rng, m, case_full, E, pool=pool)
            wts = random_weights_rows(rng, m, case_full)
            g = run_batch_fp8(cuda, wp, case_full, y, ids, wts, ent)
            ns = k + 1
            assert not np.isnan(g.parts[[e * ns + j for e in rows for j in range(ns)]]).any(), (
                "NaN parts: a wrong expert's scales were read"
            )
            for e in range(m):
                sl = slice(e * ns, (e + 1) * ns)
                if e not in rows:
                    assert poison_rows(g.act[sl]).all() and poison_rows(g.parts[sl]).all()
                    continue
                a1, p1 = run_row_alone_fp8(cuda, wp, case_full, y[e], ids[e], wts[e])
                same_bits(g.act[sl], a1, f"m={m} act of entry {e}")
                same_bits(g.parts[sl], p1, f"m={m} parts of entry {e}")
            if m == 64:
                compact = ids.copy()
                compact[:, :k] = np.searchsorted(pool, ids[:, :k])
                host = HostBackend()
                t = run_batch_fp8(host, upload(host, ex), case_compact, y, compact, wts, ent)
                check_against_twin(case_compact, ex, y, compact, wts, rows, g, t)
                check_against_float64(case_compact, ex, y, compact, wts, rows, g, roundings=2)
                del host, t
    finally:
        free_all(cuda, wp)


def test_glm_shape_router_group_and_fp8_experts_chain(cuda):
    """router_group_batch's routing -> the FP8 gate/up -> down at m = 17 on the real router shape,
    every routed expert filled (the router picks any of the 288): each row's act and parts equal
    that row launched alone."""
    rng = np.random.default_rng()
    E, h, inter, k = GLM_E, GLM_H, GLM_I, GLM_K
    w = random_bf16(rng, (E, h), exp_lo=-12)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    ent, rows = entries_with_pads(rng, 15, 2)
    m = len(ent)
    y = random_bf16(rng, (m, h), exp_lo=-6)
    _, ids, wts, _ = router_batch(cuda, w, y, bias, ent, E, h, k, True, 2.5, True)
    used = np.unique(ids[rows, :k]).astype(np.uint32)
    case = MoeCase(E, 0, inter, h, k, moe.SHARED_HERE, 8.0)
    wp, _ = _glm_stacks(cuda, rng, used, base=2.0**-12)
    try:
        g = run_batch_fp8(cuda, wp, case, y, ids, wts, ent)
        for e in rows:
            sl = slice(e * (k + 1), (e + 1) * (k + 1))
            assert not np.isnan(g.parts[sl]).any()
            a1, p1 = run_row_alone_fp8(cuda, wp, case, y[e], ids[e], wts[e])
            same_bits(g.act[sl], a1, f"act of entry {e}")
            same_bits(g.parts[sl], p1, f"parts of entry {e}")
    finally:
        free_all(cuda, wp)
