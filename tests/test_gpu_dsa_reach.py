"""The drafter's reach out to 1,048,576 tokens on the GPU: ``select_topk_pools_batch`` (GLM-5.3-Flash's
top-512 at kpool 4 over slots of 1,048,576 rows: up to 262,144 pools, one block up to 16384 and the
chunked selection's radix passes past it; the per-token indexers' top-2048 at kpool 1 over up to
202,752 rows) and ``indexer_scores_batch`` (32 heads of 128, the tensor-core path) at rows of up to
262,144 complete pools.

Every check (tests/dsa_reach_util.py, which tests/test_dsa_reach.py runs on the host twin):
- outputs poisoned (0xFF) before the launch: lists past their count, padding entries and rows past
  slot_rows stay poison (a row past the slot gets count 0); scores past the complete pools stay NaN;
- lists and counts exact against select_rows_ref and against the host twin, for random scores and
  for scores with many exact ties (integers -3..3; normals rounded to 1/16; -0.0, +0.0, +-inf and
  NaN sprinkled in), and data aimed at the radix select's threshold (all equal; three values; a
  tie straddling the cut; the cut among -0.0 and +0.0; the cut inside NaN), with the tail and
  without;
- bit equality of each entry of an m-entry launch (m = 3, 17, 64, shuffled, padding between) with
  its own m = 1 launch (pointers offset), and every workspace counter and histogram back at zero
  after each launch (the m = 1 launches reuse the batched launch's workspace, so they also check
  the reset);
- a captured graph of the launches replayed over new scores and over rows moved between the one
  block and the radix passes, each replay exact; a list past sel_cap leaves the workspace clean;
- scores within 8 (dim + heads) 2**-24 of the sum of |terms| of the float64 formula (as
  tests/test_gpu_batch_dsa.py), and the selection of the GPU's own scores exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_dsa_util import ReadLayout, ScoreShape, check_scores, entries_of, score_world, scores_f64
from dsa_reach_util import (
    KINDS,
    TIE_KINDS,
    SelectShape,
    check_lists,
    check_select_reach,
    check_select_replays,
    check_workspace_clean,
    layout_rows,
    reach_scores,
    replay_rounds,
    select_launch,
)

from model.kernels import dsa_select
from model.kernels.dsa_select import SELECT_CHUNK, TOPK_MAX_POOLS, TOPK_SINGLE_BLOCK_POOLS
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

GLM_1M = 1 << 20
TARGETS = [1, 1023, 16384, 16385, 100_003, 262_143, 262_144]
ALL_KINDS = KINDS + TIE_KINDS
# GLM-5.2 / DeepSeek-V3.2's per-token indexer: top-2048 rows at kpool 1, slots of up to 202,752.
PER_TOKEN = 202_752


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_dsa_reach"


def _both(cuda, scores, sh, lay) -> None:
    g = check_select_reach(cuda, scores, sh, lay)
    h = check_select_reach(HostBackend(), scores, sh, lay, invariance=False)
    assert np.array_equal(g[1], h[1]), "GPU counts differ from the twin"
    assert np.array_equal(g[0], h[0]), "GPU lists differ from the twin"


# ---- select_topk_pools_batch ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
@pytest.mark.parametrize("npools", TARGETS)
def test_select_alone_at_each_length(cuda, npools, kind, tail):
    """One entry (m = 1) at 1 (dense), 1023, 16384 (one block's last), 16385 (three blocks, the
    last of one pool), 100,003 (13 blocks, a short last one and a last bitmap word of 3 pools),
    262,143 (a last word of 31) and 262,144 (32 full blocks) complete pools."""
    sh = SelectShape(slot_rows=GLM_1M, kpool=4, topk=512, tail=tail)
    rng = np.random.default_rng(npools + 11 * tail)
    lay = layout_rows(rng, sh, [npools], npad=0, outside=False)
    _both(cuda, reach_scores(rng, 1, sh.pps, kind), sh, lay)


def _mixed_counts(rng: np.random.Generator, n: int) -> list[int]:
    """The target lengths, chunk edges (a last chunk of one pool, of exactly a chunk) and random
    lengths past the one-block cap."""
    c = SELECT_CHUNK
    edges = [3 * c + 1, 4 * c, 5 * c - 1, TOPK_MAX_POOLS - 1]
    extra = [int(x) for x in rng.integers(TOPK_SINGLE_BLOCK_POOLS + 1, TOPK_MAX_POOLS + 1, n)]
    return (TARGETS + edges + extra)[:n]


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
@pytest.mark.parametrize("m", [3, 17])
def test_select_batch_equals_alone(cuda, m, kind, tail):
    """m = 3 (262,144, 16385 and 1023 pools) and m = 17 (15 lengths, a padding entry, a row past
    the slot), shuffled: exact, the twin's, and each entry's bytes those of its m = 1 launch."""
    sh = SelectShape(slot_rows=GLM_1M, kpool=4, topk=512, tail=tail)
    rng = np.random.default_rng(100 * m + 7 * tail + len(kind))
    if m == 3:
        lay = layout_rows(rng, sh, [262_144, 16385, 1023], npad=0, outside=False)
    else:
        lay = layout_rows(rng, sh, _mixed_counts(rng, 15), npad=1, outside=True)
    assert len(lay[0]) == m
    _both(cuda, reach_scores(rng, m, sh.pps, kind), sh, lay)


def test_select_smaller_topk_and_kpool(cuda):
    """topk 3 at kpool 2, slots of 40,000 pools (5 chunks of 8192): cuts inside ties."""
    sh = SelectShape(slot_rows=2 * 40_000 + 1, kpool=2, topk=3, tail=True)
    rng = np.random.default_rng(5)
    counts = [16385, 40_000, 8193, 24_577, 1, 3, 4, 39_999]
    lay = layout_rows(rng, sh, counts, npad=2, outside=True)
    _both(cuda, reach_scores(rng, len(lay[0]), sh.pps, "ties"), sh, lay)


def test_select_repeated_launches_keep_the_workspace_clean(cuda):
    """Five launches on one workspace (as graph replays would): every result the first one's."""
    sh = SelectShape(slot_rows=GLM_1M, kpool=4, topk=512, tail=True)
    rng = np.random.default_rng(9)
    lay = layout_rows(rng, sh, [262_144, 200_001, 16385], npad=1, outside=True)
    scores = reach_scores(rng, len(lay[0]), sh.pps, "coarse")
    first = check_select_reach(cuda, scores, sh, lay, invariance=False)
    for _ in range(4):
        again = check_select_reach(cuda, scores, sh, lay, invariance=False)
        assert np.array_equal(again[0], first[0]) and np.array_equal(again[1], first[1])


@pytest.mark.parametrize("kind", ["random", "cut", "equal"])
def test_select_batch_of_64_ragged_rows(cuda, kind):
    """m = 64 (61 rows from one pool to 262,144, most past the one-block cap, two padding entries,
    a row past the slot): 2048 blocks a launch, more than are resident at once."""
    sh = SelectShape(slot_rows=GLM_1M, kpool=4, topk=512, tail=True)
    rng = np.random.default_rng(64 + len(kind))
    lay = layout_rows(rng, sh, _mixed_counts(rng, 61), npad=2, outside=True)
    assert len(lay[0]) == 64
    _both(cuda, reach_scores(rng, 64, sh.pps, kind), sh, lay)


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
def test_select_per_token_shape(cuda, kind, tail):
    """The per-token indexers' shape: top-2048 rows at kpool 1 over slots of 202,752 rows (25
    blocks), rows at 202,752 (GLM-5.2), 163,840 (DeepSeek-V3.2), 100,003, 16,385, 2049 and 2048
    (every row, no ranking), a padding entry and a row past the slot."""
    sh = SelectShape(slot_rows=PER_TOKEN, kpool=1, topk=2048, tail=tail)
    rng = np.random.default_rng(2048 + 3 * tail + len(kind))
    lay = layout_rows(rng, sh, [PER_TOKEN, 163_840, 100_003, 16_385, 2049, 2048], npad=1, outside=True)
    _both(cuda, reach_scores(rng, len(lay[0]), sh.pps, kind), sh, lay)


@pytest.mark.parametrize(
    "sh",
    [
        SelectShape(slot_rows=GLM_1M, kpool=4, topk=512, tail=True),
        SelectShape(slot_rows=PER_TOKEN, kpool=1, topk=2048, tail=False),
    ],
    ids=["glm-5.3-flash", "per-token"],
)
def test_select_graph_replays(cuda, sh):
    """One captured graph of the four launches, replayed: over new scores (the same rows), then
    with rows moved between the one block and the radix passes and to other lengths (a row of
    262,144 pools now 16,384, one of 1023 now 200,001). Each replay exact, the workspace's counters
    and histograms zero after each: nothing one replay leaves changes the next."""
    rng = np.random.default_rng(sh.kpool)
    top = sh.pps
    counts = [
        [top, 16_385, 1023, 100_003],
        [top, 16_385, 1023, 100_003],
        [16_384, top - 1, 200_001, 16_385],
        [top, 16_385, 1023, 100_003],
    ]
    rounds = replay_rounds(rng, sh, counts, ["random", "cut", "few", "zeros"])
    check_select_replays(cuda, sh, rounds)


def test_select_past_sel_cap_leaves_the_workspace_clean(cuda):
    """A list cap too small for the chunked rows gives count 0, and the radix passes skip those rows
    as the last block does (else their histograms would stay dirty): the workspace is clean after
    it, and the same workspace then selects exactly with the right cap."""
    sh = SelectShape(slot_rows=GLM_1M, kpool=4, topk=512, tail=True)
    rng = np.random.default_rng(21)
    lay = layout_rows(rng, sh, [262_144, 16_385, 100_003], npad=0, outside=False)
    m = len(lay[0])
    scores = reach_scores(rng, m, sh.pps, "random")
    ns = m * sh.sel_cap * 4
    p = {
        "entries": cuda.alloc(lay[0].nbytes),
        "scores": cuda.alloc(scores.nbytes),
        "ws": cuda.alloc(m * sh.ws_words * 4),
        "sel": cuda.alloc(ns),
        "cnt": cuda.alloc(m * 4),
    }
    try:
        cuda.copy_h2d(p["entries"], lay[0])
        cuda.copy_h2d(p["scores"], scores)
        cuda.memset(p["ws"], 0, m * sh.ws_words * 4)
        cuda.memset(p["cnt"], 0xFF, m * 4)
        dsa_select.select_topk_pools_batch(
            cuda, scores=p["scores"], selected=p["sel"], count=p["cnt"], entries=p["entries"], m=m,
            row_add=0, slot_rows=sh.slot_rows, sel_cap=100, topk_pools=sh.topk, kpool=sh.kpool,
            tail=sh.tail, workspace=p["ws"],
        )  # fmt: skip
        got = np.empty(m, np.uint32)
        cuda.copy_d2h(got, p["cnt"])
        assert not got.any(), f"counts {got}: a list past sel_cap must give count 0"
        check_workspace_clean(cuda, p["ws"], m, sh)
        cuda.memset(p["sel"], 0xFF, ns)
        cuda.memset(p["cnt"], 0xFF, m * 4)
        select_launch(cuda, p, sh, m)
        sel = np.empty((m, sh.sel_cap), np.uint32)
        cnt = np.empty(m, np.uint32)
        cuda.copy_d2h(sel, p["sel"])
        cuda.copy_d2h(cnt, p["cnt"])
        check_lists(sel, cnt, scores, sh, lay)
        check_workspace_clean(cuda, p["ws"], m, sh)
    finally:
        for ptr in p.values():
            cuda.free(ptr)


# ---- indexer_scores_batch at long rows ---------------------------------------------------------

GLM_LONG = ScoreShape(slots=2, slot_rows=GLM_1M, heads=32, dim=128, kpool=4)


def _rows_layout(rng, sh: ScoreShape, npools_list: list[int], npad: int) -> ReadLayout:
    items: list = [
        (int(rng.integers(0, sh.slots)), n * sh.kpool + int(rng.integers(0, sh.kpool)) - 1)
        for n in npools_list
    ]
    items = [(s, min(r, sh.slot_rows - 1)) for s, r in items]
    rng.shuffle(items)
    for _ in range(npad):
        items.insert(int(rng.integers(0, len(items) + 1)), None)
    ent, live = entries_of(items, 1)
    return ReadLayout(ent, live, [], [e for e, it in enumerate(items) if it is None])


@pytest.mark.parametrize(
    "npools_list,npad",
    [
        ([262_144], 0),
        ([1, 7, 33, 16385], 1),  # one pool, a partial tile, a partial round, past the old cap
        ([100_003, 262_144, 8], 1),
    ],
    ids=["1m", "edges", "mixed"],
)
def test_indexer_scores_long_rows(cuda, npools_list, npad):
    """Every complete pool scored within the f32 bound of the float64 formula, nothing past them,
    each entry alone the same bits (check_scores), and the GPU within twice the bound of the twin."""
    sh = GLM_LONG
    rng = np.random.default_rng(len(npools_list))
    lay = _rows_layout(rng, sh, npools_list, npad)
    m = len(lay.entries)
    world = score_world(rng, sh, m)
    g = check_scores(cuda, world, sh, lay, 1)
    h = check_scores(HostBackend(), world, sh, lay, 1, invariance=False)
    for e, slot, row in lay.live:
        npools = (row + 1) // sh.kpool
        ref, mag = scores_f64(world, sh, e, slot, row)
        bound = 8 * (sh.dim + sh.heads) * 2.0**-24 * mag + 1e-30
        err = np.abs(g[e, :npools].astype(np.float64) - ref)
        assert (err <= bound).all(), f"entry {e} ({npools} pools): worst {float((err - bound).max())} over"
        assert (np.abs(g[e, :npools].astype(np.float64) - h[e, :npools]) <= 2 * bound).all(), (
            f"entry {e} vs twin"
        )


def test_select_of_the_gpu_scores_at_1m(cuda):
    """The chain at 262,144 pools: the GPU's scores of a whole 1M-row slot, then its selection,
    exact against select_rows_ref of those very scores."""
    sh = GLM_LONG
    rng = np.random.default_rng(3)
    lay = _rows_layout(rng, sh, [262_144, 131_072], 0)
    world = score_world(rng, sh, len(lay.entries))
    scores = check_scores(cuda, world, sh, lay, 1, invariance=False)
    ssh = SelectShape(slot_rows=sh.slot_rows, kpool=sh.kpool, topk=512, tail=True)
    ent = lay.entries.copy()
    ent[:, 1] += 1  # the rows check_scores scored (row_add 1), for a launch at row_add 0
    check_select_reach(cuda, scores, ssh, (ent, lay.live, [], []))
