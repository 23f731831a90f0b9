"""``indexer_scores_batch`` at 33..64 heads of 128 on the GPU: DeepSeek-V3.2's per-token indexer (64
heads, kpool 1, up to 262,144 pools a sequence) on the tensor cores in two 32-head groups
(``indexer_scores_batch_mma2``, ptx/dsa_select.cu score_pools_mma2).

Every check (check_scores, tests/batch_dsa_util.py, as tests/test_gpu_batch_dsa.py):
- scores poisoned (0xFF, NaN) before the launch: every complete pool of a live entry written, nothing
  past them, nothing for padding entries or rows past slot_rows, the pools unchanged;
- bit equality of each entry of an m-entry launch with its own m = 1 launch (pointers offset);
- scores within 8 (dim + heads) 2**-24 of the sum of |terms| of the float64 formula, and within
  twice that of the host twin. The bound stays valid at 64 heads: the key bytes and the scaled q are
  f16 exactly (q's elements below 2**-28 of their row's largest excepted, each off by at most
  2**-39 of it), the products exact in the MMA's f32 accumulation of 8 k16 steps (the dim term
  covers it as it does at 32 heads), then per head 3 roundings (2**-s, the pool scale, the fmaf), a
  chain of 8 fmaf over a lane's heads and 3 shuffle adds, w_h * w_scale and / sqrt(dim): at most
  about 16 roundings of 2**-24 of the sum of |terms|, far inside the heads term 8 * 64 * 2**-24;
- 32 heads unchanged: 64 (and 33) heads whose heads past 32 weigh 0 give, through the two-group
  kernel, the very bits of the first 32 heads through indexer_scores_batch's one-group path (the
  heads are summed in one fixed order, g, g + 8, ..., g + 56 a lane, and a zero-weight head adds
  exactly nothing); indexer_scores_batch's SASS itself is unchanged (its PTX entry is the one before
  the two-group kernel existed);
- the kernel's guards: without its shared memory, mma != 2, more than 64 heads or dim != 128 a
  launch writes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_dsa_util import (
    ReadLayout,
    ScoreShape,
    bytes_of,
    check_scores,
    entries_of,
    free_all,
    poison_all,
    scores_f64,
    upload_all,
)
from kernel_util import random_bf16

from model.kernels import dsa_select
from model.kernels.dsa_select import INDEXER_SCORES_BATCH_MMA2, SCORES_MMA2_SMEM, scores_mma2_grid
from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16, quantize_rows_fp8
from runtime.host_backend import HostBackend
from runtime.launch import launch

pytestmark = pytest.mark.gpu

SLOT_ROWS = 262_144  # DeepSeek-V3.2's per-token indexer: 262,144 pools of one row at kpool 1
SLOTS = 2
DIM = 128


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_indexer_mma2"


@pytest.fixture(scope="module")
def pools() -> tuple[np.ndarray, np.ndarray]:
    """FP8 keys (per-row scales) of SLOTS slots of SLOT_ROWS pools, shared by every test."""
    rng = np.random.default_rng(64)
    return quantize_rows_fp8(rng.standard_normal((SLOTS * SLOT_ROWS, DIM), dtype=np.float32))


def _world(rng, sh: ScoreShape, m: int, pools, wide: bool = False) -> dict[str, np.ndarray]:
    """score_world's layout (q rows of heads * dim + 8, weights of heads + 3) over the shared pools.
    ``wide``: q rows of a wide range (row 0 zero, row 1 near 2**-120 where 2**s clamps at 126, the
    others with half their elements scaled by 2**-k, k up to 40: f16 subnormals, and zeros where
    the scaled element falls below f16's range)."""
    n = sh.slots * sh.pps
    q = random_bf16(rng, (m, sh.heads * sh.dim + 8), exp_lo=-3)
    if wide:
        nq = sh.heads * sh.dim
        f = q.astype(np.float32)
        body = f[:, :nq].reshape(m, sh.heads, sh.dim).copy()
        scale = np.where(rng.random(body.shape) < 0.5, np.exp2(-rng.integers(0, 41, body.shape)), 1.0)
        scale[:, 0] = 0.0
        scale[:, 1] = 2.0**-120
        body *= scale.astype(np.float32)
        f[:, :nq] = body.reshape(m, nq)
        q = f.astype(BF16)  # exact: BF16 values in [2**-3, 2**5) times powers of two down to 2**-120
    return {
        "q": q,
        "w": random_bf16(rng, (m, sh.heads + 3), exp_lo=-2),
        "pool_keys": pools[0][:n],
        "pool_scales": pools[1][:n],
    }


def _layout(rng, sh: ScoreShape, npools_list: list[int], npad: int, outside: bool) -> ReadLayout:
    """Entries of the given complete-pool counts in random slots, shuffled, with ``npad`` padding
    entries and (``outside``) one row past slot_rows; rows as stored (row_add 0)."""
    items: list = [
        (int(rng.integers(0, sh.slots)), min(n * sh.kpool + int(rng.integers(0, sh.kpool)), sh.slot_rows) - 1)
        for n in npools_list
    ]
    if outside:
        items.append((int(rng.integers(0, sh.slots)), sh.slot_rows + int(rng.integers(0, 3))))
    rng.shuffle(items)
    for _ in range(npad):
        items.insert(int(rng.integers(0, len(items) + 1)), None)
    ent, live_all = entries_of(items, 0)
    live = [x for x in live_all if x[2] < sh.slot_rows]
    out = [x for x in live_all if x[2] >= sh.slot_rows]
    return ReadLayout(ent, live, out, [e for e, it in enumerate(items) if it is None])


def _check(cuda, world: dict, sh: ScoreShape, lay: ReadLayout, groups: int = 2) -> None:
    """check_scores on the GPU and the twin, then the bound (module docstring) against float64."""
    a = DevicePtr(256)  # the launches' q rows are 4-byte aligned, their pools 256
    assert dsa_select.scores_mma_groups(sh.heads, sh.dim, a, sh.heads * sh.dim + 8, a) == groups
    g = check_scores(cuda, world, sh, lay, 0)
    h = check_scores(HostBackend(), world, sh, lay, 0, invariance=False)
    for e, slot, row in lay.live:
        npools = (row + 1) // sh.kpool
        if not npools:
            continue
        ref, mag = scores_f64(world, sh, e, slot, row)
        bound = 8 * (sh.dim + sh.heads) * 2.0**-24 * mag + 1e-30
        err = np.abs(g[e, :npools].astype(np.float64) - ref)
        assert (err <= bound).all(), f"entry {e} ({npools} pools): worst {float((err - bound).max())} over"
        assert (np.abs(g[e, :npools].astype(np.float64) - h[e, :npools]) <= 2 * bound).all(), (
            f"entry {e} ({npools} pools) vs twin"
        )


HEADS = [33, 48, 64]


@pytest.mark.parametrize("npools", [1, 7, 33, 1000, 262_144])
@pytest.mark.parametrize("heads", HEADS)
def test_one_entry_at_awkward_lengths(cuda, pools, heads, npools):
    """m = 1: one pool, a partial tile, a partial round, a few blocks, a whole slot."""
    sh = ScoreShape(slots=SLOTS, slot_rows=SLOT_ROWS, heads=heads, dim=DIM, kpool=1)
    rng = np.random.default_rng(heads * 1000 + npools)
    lay = _layout(rng, sh, [npools], npad=0, outside=False)
    _check(cuda, _world(rng, sh, 1, pools), sh, lay)


@pytest.mark.parametrize("heads", [48, 64])
def test_one_entry_wide_q(cuda, pools, heads):
    """q rows of a wide range (a zero row, a row at 2**-120, elements down to 2**-43 of their
    row's largest) at 4099 pools: the per-head power-of-two scaling and f16's subnormals."""
    sh = ScoreShape(slots=SLOTS, slot_rows=SLOT_ROWS, heads=heads, dim=DIM, kpool=1)
    rng = np.random.default_rng(heads + 7)
    lay = _layout(rng, sh, [4099], npad=0, outside=False)
    _check(cuda, _world(rng, sh, 1, pools, wide=True), sh, lay)


def _mixed(rng, n: int) -> list[int]:
    """n complete-pool counts: the awkward ones, a whole slot, 100,003, then random ones below 20,000
    (the float64 reference of many whole slots would dominate the test's time)."""
    fixed = [262_144, 1, 7, 33, 1000, 100_003, 16_385, 32, 31, 8]
    return (fixed + [int(x) for x in rng.integers(2, 20_000, n)])[:n]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("m,kpool", [(3, 1), (17, 1), (17, 4)], ids=["m3", "m17", "m17-kpool4"])
def test_batch_equals_alone(cuda, pools, heads, m, kpool):
    """m = 3 (a whole slot, 33 and 1000 pools) and m = 17 (14 lengths, two padding entries and a
    row past the slot), shuffled: within the bound, the twin's, each entry its m = 1 launch's bits.
    kpool 4: pools of four rows, as GLM-5's pooled indexer, at 64 heads."""
    sh = ScoreShape(slots=SLOTS, slot_rows=SLOT_ROWS, heads=heads, dim=DIM, kpool=kpool)
    rng = np.random.default_rng(100 * m + heads + kpool)
    if m == 3:
        lay = _layout(rng, sh, [262_144 // kpool, 33, 1000], npad=0, outside=False)
    else:
        lay = _layout(rng, sh, [min(n, sh.pps) for n in _mixed(rng, 14)], npad=2, outside=True)
    assert len(lay.entries) == m
    _check(cuda, _world(rng, sh, m, pools), sh, lay)


def _scores(gpu, p, heads, q_stride, w_stride, scores, entries, m, kpool, w_scale) -> None:
    dsa_select.indexer_scores_batch(
        gpu, q=p["q"], q_stride=q_stride, w=p["w"], w_stride=w_stride, pool_keys=p["pool_keys"],
        pool_scales=p["pool_scales"], scores=scores, entries=entries, m=m, row_add=0, slot_rows=SLOT_ROWS,
        heads=heads, dim=DIM, kpool=kpool, w_scale=w_scale,
    )  # fmt: skip


@pytest.mark.parametrize("heads", [33, 64])
def test_32_heads_through_two_groups_are_the_one_group_bits(cuda, pools, heads):
    """``heads`` heads whose heads 32.. weigh 0, through indexer_scores_batch_mma2, against their
    first 32 heads through indexer_scores_batch's one-group path, the same w_scale: the same bits
    for every pool (m = 4: a whole slot, 1000 and 7 pools, and a padding entry)."""
    rng = np.random.default_rng(heads + 32)
    sh = ScoreShape(slots=SLOTS, slot_rows=SLOT_ROWS, heads=heads, dim=DIM, kpool=1)
    lay = _layout(rng, sh, [262_144, 1000, 7], npad=1, outside=False)
    m = len(lay.entries)
    big = _world(rng, sh, m, pools)
    w = big["w"].astype(np.float32)
    w[:, 32:] = 0.0
    big["w"] = w.astype(BF16)
    small = {
        "q": np.ascontiguousarray(big["q"][:, : 32 * DIM]),
        "w": np.ascontiguousarray(big["w"][:, :32]),
    }
    n = m * sh.pps * 4
    p = upload_all(cuda, {**big, "entries": lay.entries})
    ps = upload_all(cuda, small)
    outs = poison_all(cuda, {"two": n, "one": n})
    try:
        _scores(cuda, p, heads, heads * DIM + 8, heads + 3, outs["two"], p["entries"], m, 1, 0.125)
        _scores(cuda, {**p, **ps}, 32, 32 * DIM, 32, outs["one"], p["entries"], m, 1, 0.125)
        b = bytes_of(cuda, outs, {"two": n, "one": n})
        two = b["two"].view(np.float32).reshape(m, sh.pps)
        one = b["one"].view(np.float32).reshape(m, sh.pps)
        for e, _, row in lay.live:
            assert not np.isnan(two[e, : row + 1]).any(), f"entry {e}: a pool not scored"
        assert np.array_equal(two.view(np.uint32), one.view(np.uint32)), (
            "64 heads with zero weights past 32 differ from their first 32 heads on the one-group path"
        )
    finally:
        free_all(cuda, p, ps, outs)


@pytest.mark.parametrize(
    "heads,dim,mma,smem,writes",
    [
        (64, DIM, 2, SCORES_MMA2_SMEM, True),  # the control: the helper's launch writes
        (64, DIM, 2, SCORES_MMA2_SMEM - 16, False),  # less shared memory than the staging needs
        (64, DIM, 2, 0, False),
        (64, DIM, 1, SCORES_MMA2_SMEM, False),  # mma must be 2
        (64, DIM, 0, SCORES_MMA2_SMEM, False),
        (65, DIM, 2, SCORES_MMA2_SMEM, False),  # past two groups
        (64, 64, 2, SCORES_MMA2_SMEM, False),  # dim 128 only
    ],
)
def test_two_group_kernel_guards(cuda, pools, heads, dim, mma, smem, writes):
    """A launch of indexer_scores_batch_mma2 without what it needs writes nothing (every score
    stays poison); with it, every complete pool is written."""
    sh = ScoreShape(slots=SLOTS, slot_rows=SLOT_ROWS, heads=64, dim=DIM, kpool=1)
    rng = np.random.default_rng(5)
    lay = _layout(rng, sh, [1000, 33], npad=0, outside=False)
    m = len(lay.entries)
    world = _world(rng, sh, m, pools)
    n = m * sh.pps * 4
    p = upload_all(cuda, {**world, "entries": lay.entries})
    outs = poison_all(cuda, {"scores": n})
    try:
        launch(
            cuda, cuda.kernel(*INDEXER_SCORES_BATCH_MMA2.key), scores_mma2_grid(m, sh.pps), 256,
            p["q"], 64 * DIM + 8, p["w"], 64 + 3, p["pool_keys"], p["pool_scales"], outs["scores"],
            p["entries"], m, 0, SLOT_ROWS, heads, dim, 1, 0.125, mma, smem=smem,
        )  # fmt: skip
        got = bytes_of(cuda, outs, {"scores": n})["scores"].view(np.float32).reshape(m, sh.pps)
        if writes:
            for e, _, row in lay.live:
                assert not np.isnan(got[e, : row + 1]).any()
                assert np.isnan(got[e, row + 1 :]).all()
        else:
            assert np.isnan(got).all(), "a refused launch wrote scores"
    finally:
        free_all(cuda, p, outs)


def test_65_heads_fall_back_to_the_warp_path(cuda, pools):
    """65 heads of 128 take the warp-per-pool path (more than two groups): still the formula."""
    sh = ScoreShape(slots=SLOTS, slot_rows=SLOT_ROWS, heads=65, dim=DIM, kpool=1)
    rng = np.random.default_rng(65)
    lay = _layout(rng, sh, [777, 33], npad=1, outside=False)
    _check(cuda, _world(rng, sh, len(lay.entries), pools), sh, lay, groups=0)
