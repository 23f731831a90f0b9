"""The batched DSA kernels' PTX (``dsa_cache_write_batch``, ``indexer_scores_batch``,
``select_topk_pools_batch``, ``extend_selection_batch``, ``sparse_mla_split_batch``,
``sparse_mla_attend_batch``) on the GPU, at the GLM-5.3-Flash shapes (512-wide latents, 128-wide
indexer keys, kpool 4, 32 indexer heads, 64 attention heads, top-512 pools, slots of 16384 rows)
with ragged rows 128..16000 in shuffled order, and at awkward small shapes.

Every check (tests/batch_dsa_util.py, which tests/test_batch_dsa.py also runs on the host backend):
- outputs poisoned (0xFF: NaN in BF16 / F32 / FP8) before the launch: what must be written is not
  NaN, what must not (padding entries, scores past the complete pools, lists past their count)
  is still poison;
- bit equality of each entry of an m-entry launch with the m = 1 launch of that entry (pointers
  offset to its rows), at m = 1, 3, 17, 64 (and 200 where the shape allows);
- padding entries, and rows past slot_rows, leave every pool byte untouched: the whole pools are
  compared with what was uploaded (read-only kernels) or with the state before a launch of
  padding only (the cache write);
- against the host twins, with these tolerances: FP8 rows within
  one E4M3 step plus the subnormal step, at least 98% of their bytes equal; LayerNorm keys within
  one BF16 ulp (2**-7 relative) plus 2**-12 of the row's largest; gates, selections, counts exact;
  scores within 8 (dim + heads) 2**-24 of the sum of |terms| (f32 accumulation on both sides);
  attention within 2**-7 relative plus 2**-9 of the entry's largest output.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_dsa_util import (
    AttnCase,
    AttnShape,
    CacheRun,
    CacheShape,
    ScoreShape,
    attn_case,
    attn_world,
    cache_layout,
    cache_world,
    check_attn,
    check_cache_write,
    check_scores,
    check_select,
    entries_of,
    read_layout,
    runs_of,
    score_world,
    scores_f64,
    select_scores,
    written_cache_rows,
)
from kernel_util import random_bf16

from model.kernels.dsa_select import selection_capacity
from runtime.dtypes import BF16, FP8
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

MS = [1, 3, 17, 64]


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_batch_dsa"


def assert_close(g, h, rtol: float, atol: float, what: str) -> None:
    g64, h64 = np.asarray(g, np.float64), np.asarray(h, np.float64)
    assert not np.isnan(g64).any(), f"{what}: {int(np.isnan(g64).sum())} NaN (unwritten?) elements"
    assert not np.isnan(h64).any(), f"{what}: the host twin produced NaN"
    err = np.abs(g64 - h64)
    bad = err > rtol * np.abs(h64) + atol
    if bad.any():
        i = np.unravel_index(int(np.argmax(err - rtol * np.abs(h64))), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} outside rtol {rtol} atol {atol}; "
            f"worst at {i}: gpu {g64[i]!r} host {h64[i]!r}"
        )


def assert_fp8_rows_close(gq, gs, hq, hs, what: str) -> None:
    """FP8 rows with one scale each: dequantised within one E4M3 step, most bytes identical."""
    gs, hs = np.asarray(gs, np.float32), np.asarray(hs, np.float32)
    assert not np.isnan(gs).any(), f"{what}: NaN (unwritten) scales"
    assert_close(gs, hs, 2.0**-7, 0.0, f"{what} scales")
    gd = gq.view(FP8).astype(np.float64) * gs[:, None]
    hd = hq.view(FP8).astype(np.float64) * hs[:, None]
    assert_close(gd, hd, 2.0**-3, float(hs.max()) * 2.0**-9, f"{what} values")
    same = float((gq.view(np.uint8) == hq.view(np.uint8)).mean())
    assert same >= 0.98, f"{what}: only {same:.3f} of the FP8 bytes equal the twin's"


# ---- dsa_cache_write_batch ------------------------------------------------------------------------

GLM_CACHE = CacheShape(slots=8, slot_rows=16384, C=512, idim=128, kpool=4)
SMALL_CACHE = CacheShape(slots=5, slot_rows=45, C=40, idim=20, kpool=3)


def _cache_case(cuda, sh: CacheShape, m: int, row_add: int, lo: int, hi: int, seed: int, run=None) -> None:
    rng = np.random.default_rng(seed)
    world = cache_world(rng, sh)
    run = run or cache_layout(rng, sh, m, row_add, lo, hi)
    g = check_cache_write(cuda, world, sh, run, row_add)
    h = check_cache_write(HostBackend(), world, sh, run, row_add, invariance=False)
    w = written_cache_rows(world, sh, run.live)
    lat, key, pool = w["latent"], w["key"], w["pool"]
    gc, hc = g["cache"].reshape(-1, sh.C), h["cache"].reshape(-1, sh.C)
    gsc, hsc = g["scales"].view(np.float32), h["scales"].view(np.float32)
    assert_fp8_rows_close(gc[lat], gsc[lat], hc[lat], hsc[lat], "latent rows")
    for a, what in ((g, "gpu"), (h, "host")):  # nothing else moved, on either backend
        assert np.array_equal(a["cache"].reshape(-1, sh.C)[~lat], world["cache"].view(np.uint8)[~lat]), what
        assert np.array_equal(a["scales"].view(np.float32)[~lat], world["scales"][~lat]), what
    gk = g["keys"].view(BF16).reshape(sh.slots, sh.slot_rows, sh.idim)
    hk = h["keys"].view(BF16).reshape(sh.slots, sh.slot_rows, sh.idim)
    assert np.array_equal(gk[~key].view(np.uint16), world["keys"][~key].view(np.uint16)), (
        "keys outside the rows"
    )
    gk32, hk32 = gk[key].astype(np.float32), hk[key].astype(np.float32)
    assert_close(gk32, hk32, 2.0**-7, float(np.abs(hk32).max()) * 2.0**-12, "indexer keys")
    assert np.array_equal(g["gates"], h["gates"]), "gates are a copy"
    gp, hp = g["pool_keys"].reshape(-1, sh.idim), h["pool_keys"].reshape(-1, sh.idim)
    gps, hps = g["pool_scales"].view(np.float32), h["pool_scales"].view(np.float32)
    if pool.any():
        assert_fp8_rows_close(gp[pool], gps[pool], hp[pool], hps[pool], "pool keys")
    assert np.array_equal(gp[~pool], world["pool_keys"].view(np.uint8)[~pool]), "a pool no row completed"
    assert np.array_equal(gps[~pool], world["pool_scales"][~pool])


@pytest.mark.parametrize("m", MS)
def test_dsa_cache_write_batch_glm(cuda, m):
    """Catch-up chunks of up to 6 rows of 8 slots (pools completing inside and across the
    chunks), rows 128..16000, padding between the chunks."""
    _cache_case(cuda, GLM_CACHE, m, 1 if m > 1 else 0, 128, 16000, seed=m)


def test_dsa_cache_write_batch_pools_inside_and_across_chunks(cuda):
    """Slot 3 rows 4095..4103: pool 1023 completes with three cached rows, pool 1024 entirely
    inside the launch, pool 1025 with its last row; slot 5 rows 126..131 beside it, slot 0's
    last reachable pool row 16383, and padding between (each checked against m = 1 launches
    and the twin)."""
    sh = GLM_CACHE
    layout = [
        None,
        *((3, r) for r in range(4095, 4104)),
        None,
        None,
        *((5, r) for r in range(126, 132)),
        (0, 16383),
    ]
    ent, live = entries_of(layout, 1)
    runs = runs_of(layout)
    assert [r[1:] for r in runs] == [(3, 4095, 9), (5, 126, 6), (0, 16383, 1)]
    rng = np.random.default_rng(99)
    run = CacheRun(ent, live, runs, random_bf16(rng, (len(layout), sh.stride), exp_lo=-2))
    _cache_case(cuda, sh, len(layout), 1, 0, 0, seed=5, run=run)


@pytest.mark.parametrize("m", [1, 3, 17, 64, 200])
def test_dsa_cache_write_batch_small(cuda, m):
    """Odd kpool, dims not multiples of 16, slot_rows not a multiple of kpool, every row of a
    slot reachable (the first and the last)."""
    _cache_case(cuda, SMALL_CACHE, m, 2, 0, SMALL_CACHE.slot_rows - 1, seed=100 + m)


# ---- indexer_scores_batch -------------------------------------------------------------------------

GLM_SCORES = ScoreShape(slots=8, slot_rows=16384, heads=32, dim=128, kpool=4)
SCORE_SHAPES = [
    (GLM_SCORES, 128, 16000),
    (ScoreShape(slots=3, slot_rows=300, heads=40, dim=16, kpool=2), 0, 299),  # more heads than lanes
    (ScoreShape(slots=3, slot_rows=200, heads=5, dim=18, kpool=3), 0, 199),  # dim % 4 != 0: scalar dot
]


@pytest.mark.parametrize("shape", SCORE_SHAPES, ids=["glm", "h40", "d18"])
@pytest.mark.parametrize("m", MS + [200])
def test_indexer_scores_batch(cuda, shape, m):
    sh, lo, hi = shape
    rng = np.random.default_rng(m)
    world = score_world(rng, sh, m)
    lay = read_layout(rng, sh.slots, sh.slot_rows, m, 1, lo, hi)
    g = check_scores(cuda, world, sh, lay, 1)
    h = check_scores(HostBackend(), world, sh, lay, 1, invariance=False)
    for e, slot, row in lay.live:
        npools = (row + 1) // sh.kpool
        if not npools:
            continue
        ref, mag = scores_f64(world, sh, e, slot, row)
        bound = 8 * (sh.dim + sh.heads) * 2.0**-24 * mag + 1e-30
        for a, what in ((g, "gpu"), (h, "host")):
            err = np.abs(a[e, :npools].astype(np.float64) - ref)
            assert (err <= bound).all(), (
                f"{what} entry {e}: worst {float((err - bound).max())} over the bound"
            )
        assert (np.abs(g[e, :npools].astype(np.float64) - h[e, :npools]) <= 2 * bound).all(), (
            f"entry {e} vs twin"
        )


# ---- select_topk_pools_batch / extend_selection_batch ---------------------------------------------


@pytest.mark.parametrize("m", MS + [200])
@pytest.mark.parametrize("kind", ["random", "ties"])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
def test_select_and_extend_batch_glm(cuda, m, kind, tail):
    """Top-512 of up to 4000 pools per entry (ragged rows 128..16000, the dense regime below row
    2048), exact against select_rows_ref and the host twin."""
    sh = ScoreShape(slots=8, slot_rows=16384, heads=1, dim=4, kpool=4)
    rng = np.random.default_rng(m + 7 * tail)
    lay = read_layout(rng, sh.slots, sh.slot_rows, m, 1, 128, 16000)
    scores = select_scores(rng, sh, m, kind)
    sel_cap = selection_capacity(sh.slot_rows, 512, sh.kpool, 2)
    g = check_select(cuda, scores, sh, lay, 1, 512, tail, sel_cap)
    h = check_select(HostBackend(), scores, sh, lay, 1, 512, tail, sel_cap, invariance=False)
    for (gs, gc), (hs, hc) in zip(g, h):
        assert np.array_equal(gc, hc) and np.array_equal(gs, hs), "GPU selection differs from the twin"


# ---- sparse_mla_split_batch / sparse_mla_attend_batch ---------------------------------------------

GLM_ATTN = AttnShape(
    slots=8, slot_rows=16384, heads=64, dim=512, sel_cap=selection_capacity(16384, 512, 4, 2)
)
SMALL_ATTN = AttnShape(slots=4, slot_rows=4000, heads=20, dim=48, sel_cap=600)


def _attn(cuda, sh: AttnShape, m: int, split: bool, counts) -> None:
    rng = np.random.default_rng(m + 1000 * split)
    world = attn_world(rng, sh, m)
    case = attn_case(rng, sh, m, counts)
    g = check_attn(cuda, world, sh, case, split)
    for e, _, rows in case.live:
        if rows.size == 0:
            assert not g[e].any(), f"entry {e}: an empty selection must give zeros"
    # The twin on the first 16 entries (its float32 gathers of 2k rows x 64 heads cost a fifth of a
    # second an entry); the bit equalities above tie every other entry to its own launch.
    k = min(m, 16)
    head = AttnCase(
        case.entries[:k],
        [x for x in case.live if x[0] < k],
        [e for e in case.pads if e < k],
        case.sel[:k],
        case.cnt[:k],
    )
    h = check_attn(HostBackend(), world, sh, head, split, invariance=False)
    for e, _, _ in head.live:
        assert_close(g[e], h[e], 2.0**-7, float(np.abs(h[e]).max()) * 2.0**-9 + 1e-30, f"entry {e}")


GLM_COUNTS = [0, 1, 64, 65, 1000, 2048, 2051, GLM_ATTN.sel_cap]
SMALL_COUNTS = [0, 1, 37, 64, 65, 300, SMALL_ATTN.sel_cap]


@pytest.mark.parametrize("m", MS)
def test_sparse_mla_split_batch_glm(cuda, m):
    _attn(cuda, GLM_ATTN, m, True, GLM_COUNTS)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_sparse_mla_attend_batch_glm(cuda, m):
    _attn(cuda, GLM_ATTN, m, False, GLM_COUNTS)


@pytest.mark.parametrize("m", [3, 64, 200])
@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
def test_sparse_mla_batch_small(cuda, m, split):
    """20 heads (a tile and a partial tile), 48-wide latents, 10 splits."""
    _attn(cuda, SMALL_ATTN, m, split, SMALL_COUNTS)
