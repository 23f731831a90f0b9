"""The wide absorbed-MLA pair's PTX (``sparse_mla_partial_wide_batch`` + ``sparse_mla_combine_wide_batch``
through ``sparse_mla_wide_batch``) on the GPU, at the awkward shapes of tests/sparse_mla_wide_util.py
(3 to 72 heads: below a 16-head tile, partial tiles, one and two 64-head groups; latent widths 48,
64 and 512; NoPE and rope widths 16 to 64; split lengths 64, 128, 192, 256; selections of 0, 1, 63,
64, 65 rows, both sides of a split and the capacity, in random order; padding entries; two slots),
at the models' shapes (64 heads x 512, rope 64 and NoPE, up to 1829 selected rows; 128 heads; 32
heads), m = 1, 3 and 17:

- output and workspace poisoned (0xFF) before each launch: every live entry's output written,
  padding entries' output and workspace untouched, splits past an entry's count untouched;
- each entry of a batch bit for bit its m = 1 launch (pointers offset to its rows), workspace too;
- the output against the host twin within 2**-7 relative plus 2**-9 of the entry's largest output
  (BF16 output, about 2**-8 relative; the scores are f32 products of the query's hi/lo halves, p
  likewise, so the BF16 rounding of the output dominates), and against float64 attention alike;
- the workspace against the float64 partials of the same split structure (2**-10 relative plus
  2**-12 of the head's largest partial; max within 2**-12 (1 + |max|), sum within 2**-10
  relative: tests/sparse_mla_wide_util.py);
- rope_dim 0: the bytes of the call without the RoPE keywords (the NoPE builds), also launched
  directly with NaN-filled rope inputs, which it must not read;
- a rope width, split length or latent width the kernels do not take writes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_dsa_util import bytes_of, free_all, poison_all, upload_all
from sparse_mla_wide_util import (
    SHAPE_IDS,
    SHAPES,
    WideShape,
    check_outputs,
    check_workspace,
    inputs_of,
    outputs_f32,
    raw_wide,
    run_wide,
    shape_id,
    sizes,
    wide_case,
    wide_f64,
    wide_world,
)

from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_sparse_mla_wide"


def _against_twin(cuda, sh: WideShape, m: int, npad: int, seed: int, mode: str = "rope"):
    rng = np.random.default_rng(seed)
    world = wide_world(rng, sh, m)
    case = wide_case(rng, sh, m, npad)
    g = run_wide(cuda, world, sh, case, mode=mode)
    h = run_wide(HostBackend(), world, sh, case, mode=mode, invariance=False)
    ho = outputs_f32(h, sh, m)
    check_outputs(g, sh, case, lambda e, slot, rows: ho[e])
    check_outputs(g, sh, case, lambda e, slot, rows: wide_f64(world, sh, e, slot, rows))
    check_workspace(g, sh, case, world)
    # The same splits written as the twin's (and the same left unwritten).
    for k in ("part", "ml"):
        assert np.array_equal(g[k].view(np.uint32) == 0xFFFFFFFF, h[k].view(np.uint32) == 0xFFFFFFFF), (
            f"{k}: written where the twin does not write, or not where it does"
        )
    return world, case, g


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("sh", SHAPES, ids=SHAPE_IDS)
def test_wide_against_twin(cuda, sh, m):
    _against_twin(cuda, sh, m, 0 if m == 1 else max(1, m // 5), sh.heads * 1000 + sh.dim + sh.split_rows + m)


# The models' shapes: 64 heads x 512 (GLM-5.3-Flash NoPE, GLM-5.2 / DeepSeek-V3.2 rope 64) over
# selections of up to 8 splits of 256 rows (1829), at the auto split length and the shortest; 128
# heads (DeepSeek-V3.2); 32 heads (a rank of two).
MODEL_SHAPES = [
    WideShape(heads=64, dim=512, rope_dim=0, split_rows=256, n_splits=8),
    WideShape(heads=64, dim=512, rope_dim=64, split_rows=256, n_splits=8),
    WideShape(heads=64, dim=512, rope_dim=64, split_rows=64, n_splits=5),
    WideShape(heads=128, dim=512, rope_dim=64, split_rows=128, n_splits=3),
    WideShape(heads=32, dim=512, rope_dim=0, split_rows=256, n_splits=4),
]


@pytest.mark.parametrize("sh", MODEL_SHAPES, ids=[shape_id(s) for s in MODEL_SHAPES])
def test_wide_model_shapes_batch_of_17(cuda, sh):
    _against_twin(cuda, sh, 17, 3, 99 + sh.heads + sh.rope_dim + sh.split_rows)


@pytest.mark.parametrize("sh", [SHAPES[1], SHAPES[3], MODEL_SHAPES[0]], ids=lambda s: shape_id(s))
def test_rope_dim_0_is_the_nope_kernel(cuda, sh):
    """None / None / 0 and a direct launch with NaN rope inputs and rope_dim 0: the bytes of the
    call without the RoPE keywords (output and workspace)."""
    assert sh.rope_dim == 0
    world, case, old = _against_twin(cuda, sh, 9, 2, 5 + sh.heads)
    for mode in ("nope", "raw_nope"):
        got = run_wide(cuda, world, sh, case, mode=mode)
        for k in old:
            assert np.array_equal(got[k], old[k]), (
                f"{mode}: {k} differs from the call without the RoPE keywords"
            )


@pytest.mark.parametrize(
    "what,kw",
    [
        ("rope_dim 80", dict(rope_dim=80)),
        ("rope_dim 24", dict(rope_dim=24)),
        ("split_rows 32", dict(rope_dim=16, split_rows=32)),
        ("split_rows 320", dict(rope_dim=16, split_rows=320)),
        ("dim 40", dict(rope_dim=16, dim=40)),
    ],
)
def test_what_the_kernels_do_not_take_writes_nothing(cuda, what, kw):
    """The workspace (and, but for a rope width, which the merge does not take, the output) keep
    their poison (the helper refuses such a launch)."""
    sh = WideShape(heads=3, dim=64, rope_dim=16, split_rows=64)
    rng = np.random.default_rng(21)
    world = wide_world(rng, sh, 3)
    case = wide_case(rng, sh, 3, 0)
    p = upload_all(cuda, inputs_of(world, case))
    sz = sizes(sh, 3)
    o = poison_all(cuda, sz)
    try:
        raw_wide(cuda, {**p, **o}, sh, 3, q_rope=p["q_rope"], rope_keys=p["rope_keys"], **kw)
        got = bytes_of(cuda, o, sz)
        for k in ("part", "ml") if what.startswith("rope") else sz:
            assert (got[k] == 0xFF).all(), f"{k} written for {what}"
    finally:
        free_all(cuda, p, o)
