"""The RoPE part of the absorbed-MLA attention's host twins (``sparse_mla_split_batch``,
``sparse_mla_attend_batch`` with ``q_rope``, ``rope_keys``, ``rope_dim``; tests/sparse_mla_rope_util.py):

- against float64 attention with the RoPE term, within 2**-7 relative plus 2**-9 of the entry's
  largest output (the output is BF16), at 3, 16 and 20 heads, latent widths 48, 64 and 512, rope
  widths 16, 48, 64, 80 and 128, selections of 1, 63, 65 and 200 rows in random order, padding
  entries, two slots;
- each entry of a batch bit for bit its m = 1 launch; padding writes nothing;
- rope_dim 0 is NoPE: the bytes of the call without the RoPE keywords, with NaN rope inputs
  unread, and the float64 attention without the term;
- the launch helpers refuse a rope_dim the kernels do not take (naming it), a RoPE part without
  its inputs and inputs without a RoPE part; the twins, as the kernels, write nothing for such a
  rope_dim.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_dsa_util import bytes_of, free_all, poison_all, upload_all
from sparse_mla_rope_util import (
    SHAPE_IDS,
    SHAPES,
    RopeShape,
    assert_close,
    outputs_f32,
    raw_launch,
    rope_case,
    rope_f64,
    rope_world,
    run_rope,
)

from model.kernels import sparse_mla
from runtime.host_backend import HostBackend

RTOL = 2.0**-7
ATOL_OF_MAX = 2.0**-9


def _check_f64(world, sh, case, got, m, rope=True):
    o = outputs_f32(got, sh, m)
    for e, slot, rows in case.live:
        ref = rope_f64(world, sh, e, slot, rows, rope=rope)
        assert_close(o[e], ref, RTOL, float(np.abs(ref).max()) * ATOL_OF_MAX, f"entry {e} ({rows.size} rows)")


@pytest.mark.parametrize("sh", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
def test_rope_twin_against_float64(sh, split):
    rng = np.random.default_rng(sh.heads * 1000 + sh.dim + sh.rope_dim + 7 * split)
    m = 7
    world = rope_world(rng, sh, m)
    case = rope_case(rng, sh, m, npad=2)
    assert {s for _, s, _ in case.live} == {0, 1} and len(case.live) == 5
    _check_f64(world, sh, case, run_rope(HostBackend(), world, sh, case, split), m)


def test_the_cases_depend_on_the_rope_term():
    """Without the RoPE term, or with the other slot's rope keys, the float64 attention of every
    multi-row selection is outside the tolerance: the comparisons above can fail."""
    rng = np.random.default_rng(3)
    for sh in SHAPES:
        world = rope_world(rng, sh, 7)
        case = rope_case(rng, sh, 7, npad=2)
        for e, slot, rows in case.live:
            if rows.size == 1:
                continue  # one row: softmax weight 1 whatever the score
            ref = rope_f64(world, sh, e, slot, rows)
            atol = float(np.abs(ref).max()) * ATOL_OF_MAX
            for other in (
                rope_f64(world, sh, e, slot, rows, rope=False),
                rope_f64(world, sh, e, slot, rows, key_slot=1 - slot),
            ):
                assert (np.abs(other - ref) > RTOL * np.abs(ref) + atol).any()


@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
@pytest.mark.parametrize("mode", ["nope", "raw_nope"])
def test_rope_dim_0_is_nope(split, mode):
    """None / None / 0, and a direct launch with NaN-filled rope inputs and rope_dim 0: the bytes of
    the call without the RoPE keywords (workspace too), and the float64 attention without the term."""
    sh = SHAPES[1]
    rng = np.random.default_rng(11 + split)
    world = rope_world(rng, sh, 6)
    case = rope_case(rng, sh, 6, npad=1)
    old = run_rope(HostBackend(), world, sh, case, split, mode="old")
    got = run_rope(HostBackend(), world, sh, case, split, mode=mode)
    for k in old:
        assert np.array_equal(got[k], old[k]), k
    _check_f64(world, sh, case, got, 6, rope=False)


@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
@pytest.mark.parametrize("rope_dim", [8, 24, 136, 144, 256, -16])
def test_helpers_refuse_a_rope_dim_the_kernels_do_not_take(split, rope_dim):
    gpu = HostBackend()
    sh = RopeShape(heads=3, dim=64, rope_dim=16)
    p = gpu.alloc(1 << 16)
    kw = dict(
        q=p, cache=p, scales=p, tables=p, selected=p, count=p, out=p, entries=p, m=1, slot_rows=16,
        sel_cap=4, heads=sh.heads, dim=sh.dim, block_size=16, scale=1.0, q_rope=p, rope_keys=p,
    )  # fmt: skip
    try:
        with pytest.raises(ValueError, match=f"rope_dim {rope_dim} "):
            if split:
                sparse_mla.sparse_mla_split_batch(gpu, part=p, ml=p, rope_dim=rope_dim, **kw)
            else:
                sparse_mla.sparse_mla_attend_batch(gpu, rope_dim=rope_dim, **kw)
    finally:
        gpu.free(p)


@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
@pytest.mark.parametrize(
    "given,rope_dim,match",
    [
        ({"rope_keys": True}, 64, "needs both q_rope and rope_keys"),
        ({"q_rope": True}, 64, "needs both q_rope and rope_keys"),
        ({}, 64, "needs both q_rope and rope_keys"),
        ({"q_rope": True}, 0, "with rope_dim 0"),
        ({"q_rope": True, "rope_keys": True}, 0, "with rope_dim 0"),
    ],
)
def test_helpers_refuse_rope_inputs_that_do_not_match_rope_dim(split, given, rope_dim, match):
    gpu = HostBackend()
    p = gpu.alloc(1 << 16)
    kw = dict(
        q=p, cache=p, scales=p, tables=p, selected=p, count=p, out=p, entries=p, m=1, slot_rows=16,
        sel_cap=4, heads=3, dim=64, block_size=16, scale=1.0, rope_dim=rope_dim,
    )  # fmt: skip
    kw.update({k: p for k in given})
    try:
        with pytest.raises(ValueError, match=match):
            if split:
                sparse_mla.sparse_mla_split_batch(gpu, part=p, ml=p, **kw)
            else:
                sparse_mla.sparse_mla_attend_batch(gpu, **kw)
    finally:
        gpu.free(p)


@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
@pytest.mark.parametrize("rope_dim", [24, 144])
def test_a_rope_dim_the_kernels_do_not_take_writes_nothing(split, rope_dim):
    """Past the helpers' refusal (a direct launch): the attention's output, the split pair's
    workspace keep their poison, as the kernels' guard leaves them (the merge, which takes no
    rope_dim, then merges the poison: the helpers refuse such a launch)
    (tests/test_gpu_sparse_mla_rope.py checks the PTX the same way)."""
    gpu = HostBackend()
    sh = SHAPES[0]
    rng = np.random.default_rng(5)
    world = rope_world(rng, sh, 3)
    case = rope_case(rng, sh, 3, npad=0)
    p = upload_all(gpu, {**world, "sel": case.sel, "cnt": case.cnt, "entries": case.entries})
    pb, mb = sparse_mla.split_workspace(sh.heads, sh.dim, sh.sel_cap)
    sizes = {"out": 3 * sh.heads * sh.dim * 2, "part": 3 * pb, "ml": 3 * mb}
    o = poison_all(gpu, sizes)
    try:
        raw_launch(gpu, {**p, **o}, sh, 3, split, rope_dim, p["q_rope"], p["rope_keys"])
        got = bytes_of(gpu, o, sizes)
        for k in ("part", "ml") if split else ("out",):
            assert (got[k] == 0xFF).all(), f"{k} written for rope_dim {rope_dim}"
    finally:
        free_all(gpu, p, o)


def test_partial_smem_adds_the_rows_only_with_rope():
    assert sparse_mla.partial_smem(512, 64) == sparse_mla.partial_smem(512) + 4 * sparse_mla.SPLIT_ROWS
    assert sparse_mla.partial_smem(512, 0) == sparse_mla.partial_smem(512)
    # Two blocks per SM at the GLM width with the RoPE part (228 KB per SM, 1 KB reserved per block).
    assert 2 * (sparse_mla.partial_smem(512, 128) + 1024) <= 228 * 1024
