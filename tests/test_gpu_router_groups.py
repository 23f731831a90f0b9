"""Group-limited routing in router_group_batch on the device (ptx/moe.cu kept_groups /
route_warp_n, n_group / topk_group: DeepSeek-V3's expert groups) against its host twin.

Every output starts as poison (0xFF) with guard bytes after it (batch_moe_util.router_group).

Exact (bit for bit):
- ids and weights against the twin's routing (moe.route_ref, the transformers router as
  tests/test_router_groups.py checks it) of the device's own scores, at m = 1, 3, 17, 64, 200,
  E = 256 / n_group 8 / topk_group 4 / top-8, on random routers and on a router with an exact tie at
  the kept groups' border and tied choices inside every group;
- each row of an m-row launch against the launch of that row alone (batch invariance);
- the grouping (every word of the group workspace) against the twin's grouping of the device's ids;
- n_group 1 (and topk_group == n_group) against the launch without the arguments, E = 288.
Within a stated bound: the scores against the twin's, 2**-20 relative plus a quarter of the f32 dot
bound (sigmoid' <= 1/4), as tests/test_gpu_batch_moe.py states it. The group scores are f32 sums of
two of those scores plus their biases, on the device as in the twin: exact given the same scores,
which is why ids and weights are compared against the twin's routing of the device's scores.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_moe_util import entries_with_pads, group_words, router_batch, router_group
from kernel_util import abs_dot, random_bf16, same_bits

from model.kernels import moe
from model.kernels.batch import pack_entries
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

E, NG, TG, K = 256, 8, 4, 8  # DeepSeek-V3 / V3.2
H = 4096
BATCH_SIZES = (1, 3, 17, 64, 200)


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_router_groups"


def poison_rows(a: np.ndarray) -> np.ndarray:
    return (a.view(np.uint8).reshape(a.shape[0], -1) == 0xFF).all(axis=1)


def grouped_router(rng, e: int, ng: int, tg: int, h: int, tied: bool):
    """A router [e, h] BF16 and its bias. ``tied``: group ng - 1 copies group 1 (bit-equal scores,
    so exactly tied group scores) and the biases put that pair at the kept groups' border (groups
    2..tg lifted by 2.5, the pair's first expert by 3: group 1 kept, its copy not); in every group
    expert 2j + 1 copies expert 2j (tied choices: the lower expert first)."""
    w = random_bf16(rng, (e, h), exp_lo=-12)
    bias = (0.05 * rng.standard_normal(e)).astype(np.float32)
    if tied:
        gs = e // ng
        w[1::2] = w[0::2]
        bias[1::2] = bias[0::2]
        for g in range(2, tg + 1):
            bias[g * gs : (g + 1) * gs] += np.float32(2.5)
        bias[gs] += np.float32(3.0)
        w[(ng - 1) * gs :] = w[gs : 2 * gs]
        bias[(ng - 1) * gs :] = bias[gs : 2 * gs]
    return w, bias


def batch_of(rng, pool: int, m: int) -> tuple[np.ndarray, list[int]]:
    """m entries for distinct rows of a pool, about one in seven padding (none at m = 1), shuffled;
    per entry its pool row (-1 for padding)."""
    pads = 0 if m == 1 else max(1, m // 7)
    live = m - pads
    rows = rng.choice(pool, live, replace=False)
    ent = pack_entries(list(range(live)), rows.tolist(), [0] * live, m)
    ent = np.ascontiguousarray(ent[rng.permutation(m)])
    return ent, [int(ent[e, 1]) if ent[e, 0] != 0xFFFFFFFF else -1 for e in range(m)]


@pytest.mark.parametrize("tied", [False, True])
def test_grouped_routing_is_the_twins_at_every_m_and_batch_invariant(cuda, tied):
    rng = np.random.default_rng()
    w, bias = grouped_router(rng, E, NG, TG, H, tied)
    pool = random_bf16(rng, (max(BATCH_SIZES), H), exp_lo=-3)
    groups = dict(n_group=NG, topk_group=TG)
    single: dict[int, tuple] = {}
    bit = rows_seen = 0
    for m in rng.permutation(BATCH_SIZES):
        m = int(m)
        ent, src = batch_of(rng, len(pool), m)
        y = np.stack([pool[max(r, 0)] for r in src])  # a padding entry's y row is some row: never read
        s, i, wt, ctr, g = router_group(cuda, w, y, bias, ent, E, H, K, True, 2.5, True, 0, E, **groups)
        assert (ctr[: moe.router_counter_words(m, grouped=True)] == 0).all(), f"m={m}: counters not reset"
        hs = router_batch(HostBackend(), w, y, bias, ent, E, H, K, True, 2.5, True, **groups)[0]
        gh = group_words(i, ent, K, K + 1, 0, E).view(np.uint32)
        assert g.tobytes() == gh.tobytes(), f"m={m}: the grouping differs from the twin's of the device's ids"
        for e, r in enumerate(src):
            if r < 0:
                assert poison_rows(s[e : e + 1]).all() and poison_rows(i[e : e + 1]).all(), f"m={m}: pad {e}"
                assert poison_rows(wt[e : e + 1]).all(), f"m={m}: pad {e}"
                continue
            absd = abs_dot(y[e][None], w)[0]
            err = np.abs(s[e].astype(np.float64) - hs[e])
            assert (err <= 2.0**-20 * np.abs(hs[e]) + 0.25 * 4 * H * 2.0**-24 * absd.max()).all(), (
                f"scores {e}"
            )
            ri, rw = moe.route_ref(s[e], bias, K, True, 2.5, NG, TG)
            assert (i[e, :K] == ri).all() and i[e, K] == 0, f"m={m} ids of entry {e}: {i[e]} != {ri}"
            assert wt[e, :K].tobytes() == rw.tobytes() and wt[e, K] == 1.0, f"m={m} weights of entry {e}"
            if r not in single:
                single[r] = router_group(
                    cuda, w, pool[r][None], bias, pack_entries([0], [r], [0]), E, H, K, True, 2.5, True, 0, E,
                    **groups,
                )  # fmt: skip
            s1, i1, w1 = single[r][0], single[r][1], single[r][2]
            same_bits(s[e : e + 1], s1, f"m={m} scores of entry {e}")
            same_bits(i[e : e + 1], i1, f"m={m} ids of entry {e}")
            same_bits(wt[e : e + 1], w1, f"m={m} weights of entry {e}")
            rows_seen += 1
            bit += not np.array_equal(ri, moe.route_ref(s[e], bias, K, True, 2.5)[0])
            if tied:
                chosen = i[e, :K] // (E // NG)
                assert (chosen != NG - 1).all(), f"m={m} entry {e}: the tied copy group was kept"
    # the groups decide: the ungrouped top-k would differ in many rows (in every row, tied)
    assert bit > rows_seen // 4, (bit, rows_seen)


@pytest.mark.parametrize(
    "e,ng,tg,k,h",
    [
        (16, 4, 2, 3, 64),
        (288, 8, 3, 8, 45),  # 36 per group, the scalar GEMV path
        (64, 32, 4, 8, 64),  # 32 groups of 2: topk at the kept groups' size
        (1024, 32, 1, 32, 64),  # the kernel's widest: 32 keys per lane
    ],
)
def test_grouped_routing_at_the_shapes_limits(cuda, e, ng, tg, k, h):
    rng = np.random.default_rng()
    for tied in (False, True):
        w, bias = grouped_router(rng, e, ng, tg, h, tied)
        ent, rows = entries_with_pads(rng, 60, 8)
        m = len(ent)
        y = random_bf16(rng, (m, h), exp_lo=-3)
        s, i, wt, _, g = router_group(
            cuda, w, y, bias, ent, e, h, k, True, 2.5, True, 0, e, n_group=ng, topk_group=tg
        )
        for r in rows:
            ri, rw = moe.route_ref(s[r], bias, k, True, 2.5, ng, tg)
            assert (i[r, :k] == ri).all(), f"tied={tied} ids of entry {r}: {i[r]} != {ri}"
            assert wt[r, :k].tobytes() == rw.tobytes(), f"tied={tied} weights of entry {r}"
        assert g.tobytes() == group_words(i, ent, k, k + 1, 0, e).view(np.uint32).tobytes()


@pytest.mark.parametrize("ng", [1, 8])
def test_without_group_limits_the_routing_is_the_default_launchs(cuda, ng):
    """E = 288: n_group 1 / topk_group 1, and n_group 8 / topk_group 8 (every group kept), give
    every output of the launch without the arguments bit for bit, at every m."""
    rng = np.random.default_rng()
    e = 288
    w = random_bf16(rng, (e, H), exp_lo=-12)
    bias = (0.05 * rng.standard_normal(e)).astype(np.float32)
    for m in BATCH_SIZES:
        ent, _ = entries_with_pads(rng, m - m // 7, m // 7)
        y = random_bf16(rng, (m, H), exp_lo=-3)
        base = router_group(cuda, w, y, bias, ent, e, H, K, True, 2.5, True, 0, e)
        got = router_group(cuda, w, y, bias, ent, e, H, K, True, 2.5, True, 0, e, n_group=ng, topk_group=ng)
        for a, b, what in zip(base, got, ("scores", "ids", "weights", "counter", "group"), strict=True):
            same_bits(a, b, f"m={m} {what}")
