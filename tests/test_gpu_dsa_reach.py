"""The drafter's reach out to 1,048,576 tokens on the GPU: ``select_topk_pools_batch`` (GLM-5.3-Flash's
top-512 at kpool 4 over slots of 1,048,576 rows: up to 262,144 pools, one block up to 16384 and the
chunked selection past it) and ``indexer_scores_batch`` (32 heads of 128, the tensor-core path) at
rows of up to 262,144 complete pools.

Every check (tests/dsa_reach_util.py, which tests/test_dsa_reach.py runs on the host twin):
- outputs poisoned (0xFF) before the launch: lists past their count, padding entries and rows past
  slot_rows stay poison (a row past the slot gets count 0); scores past the complete pools stay NaN;
- lists and counts exact against select_rows_ref and against the host twin, for random scores and
  for scores with many exact ties (integers -3..3; normals rounded to 1/16; -0.0, +0.0, +-inf and
  NaN sprinkled in), with the tail and without;
- bit equality of each entry of an m-entry launch (m = 3, 17, shuffled, padding between) with its
  own m = 1 launch (pointers offset), and every workspace counter back at zero after each launch
  (the m = 1 launches reuse the batched launch's workspace, so they also check the reset);
- scores within 8 (dim + heads) 2**-24 of the sum of |terms| of the float64 formula (as
  tests/test_gpu_batch_dsa.py), and the selection of the GPU's own scores exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_dsa_util import ReadLayout, ScoreShape, check_scores, entries_of, score_world, scores_f64
from dsa_reach_util import SelectShape, check_select_reach, layout_rows, reach_scores

from model.kernels.dsa_select import TOPK_MAX_POOLS, TOPK_SINGLE_BLOCK_POOLS, select_chunk
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

GLM_1M = 1 << 20
TARGETS = [1, 1023, 16384, 16385, 100_003, 262_144]
KINDS = ["random", "ties", "coarse", "special"]


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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
@pytest.mark.parametrize("npools", TARGETS)
def test_select_alone_at_each_length(cuda, npools, kind, tail):
    """One entry (m = 1) at 1 (dense), 1023, 16384 (one block's last), 16385 (three chunks),
    100,003 (13 chunks, a short last one) and 262,144 (32 full chunks) complete pools."""
    sh = SelectShape(slot_rows=GLM_1M, kpool=4, topk=512, tail=tail)
    rng = np.random.default_rng(npools + 11 * tail)
    lay = layout_rows(rng, sh, [npools], npad=0, outside=False)
    _both(cuda, reach_scores(rng, 1, sh.pps, kind), sh, lay)


def _mixed_counts(rng: np.random.Generator, n: int) -> list[int]:
    """The target lengths, chunk edges (a last chunk of one pool, of exactly a chunk) and random
    lengths past the one-block cap."""
    c = select_chunk(512)
    edges = [3 * c + 1, 4 * c, 5 * c - 1, TOPK_MAX_POOLS - 1]
    extra = [int(x) for x in rng.integers(TOPK_SINGLE_BLOCK_POOLS + 1, TOPK_MAX_POOLS + 1, n)]
    return (TARGETS + edges + extra)[:n]


@pytest.mark.parametrize("kind", KINDS)
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
