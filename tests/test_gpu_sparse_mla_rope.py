"""The RoPE part of the absorbed-MLA attention's PTX (``sparse_mla_partial_batch`` +
``sparse_mla_combine_batch`` through ``sparse_mla_split_batch``, and ``sparse_mla_attend_batch``) on
the GPU, at the awkward shapes of tests/sparse_mla_rope_util.py (3, 16 and 20 heads; latent widths
48, 64 and 512; rope widths 16, 48, 64, 80, 128; selections of 1, 63, 65 and 200 rows in random
order; padding entries; two slots):

- outputs and workspace poisoned (0xFF) before each launch: every live entry's output written,
  padding entries' untouched;
- each entry of a batch bit for bit its m = 1 launch (pointers offset to its rows), workspace too;
- against the host twin with the RoPE term within 2**-7 relative plus 2**-9 of the entry's largest
  output (BF16 output, about 1e-2 relative; the kernels' scores are f32 products of f32-exact
  operands, so the BF16 rounding of the output dominates);
- rope_dim 0: the bytes of the call without the RoPE keywords (the NoPE builds), also launched
  directly with NaN-filled rope inputs, which it must not read;
- a rope_dim the kernels do not take writes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_dsa_util import bytes_of, free_all, poison_all, upload_all
from sparse_mla_rope_util import (
    SHAPE_IDS,
    SHAPES,
    assert_close,
    outputs_f32,
    raw_launch,
    rope_case,
    rope_world,
    run_rope,
)

from model.kernels import sparse_mla
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

RTOL = 2.0**-7
ATOL_OF_MAX = 2.0**-9


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_sparse_mla_rope"


def _against_twin(cuda, sh, split, m, npad, mode, seed):
    rng = np.random.default_rng(seed)
    world = rope_world(rng, sh, m)
    case = rope_case(rng, sh, m, npad)
    g = run_rope(cuda, world, sh, case, split, mode=mode)
    h = run_rope(HostBackend(), world, sh, case, split, mode=mode, invariance=False)
    go, ho = outputs_f32(g, sh, m), outputs_f32(h, sh, m)
    for e, _, rows in case.live:
        assert_close(
            go[e], ho[e], RTOL, float(np.abs(ho[e]).max()) * ATOL_OF_MAX, f"entry {e} ({rows.size} rows)"
        )
    return world, case, g


@pytest.mark.parametrize("sh", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
def test_rope_against_twin(cuda, sh, split):
    _against_twin(cuda, sh, split, 7, 2, "rope", sh.heads * 1000 + sh.dim + sh.rope_dim + 7 * split)


@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
def test_rope_glm_width_batch_of_33(cuda, split):
    """16 heads x 512 + 64 (the GLM build) over 33 entries, 6 of them padding."""
    _against_twin(cuda, SHAPES[1], split, 33, 6, "rope", 99 + split)


@pytest.mark.parametrize("sh", [SHAPES[1], SHAPES[4]], ids=[SHAPE_IDS[1], SHAPE_IDS[4]])
@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
def test_rope_dim_0_is_the_nope_kernel(cuda, sh, split):
    """None / None / 0 and a direct launch with NaN rope inputs and rope_dim 0: the bytes of the call
    without the RoPE keywords (output and workspace), and the NoPE twin within the tolerance."""
    world, case, old = _against_twin(cuda, sh, split, 9, 2, "old", 5 + split)
    for mode in ("nope", "raw_nope"):
        got = run_rope(cuda, world, sh, case, split, mode=mode)
        for k in old:
            assert np.array_equal(got[k], old[k]), (
                f"{mode}: {k} differs from the call without the RoPE keywords"
            )


@pytest.mark.parametrize("split", [True, False], ids=["split", "attend"])
@pytest.mark.parametrize("rope_dim", [24, 144])
def test_a_rope_dim_the_kernels_do_not_take_writes_nothing(cuda, split, rope_dim):
    """The attention's output, the partials' workspace keep their poison (the helpers refuse such a
    launch; the merge would merge the poison)."""
    sh = SHAPES[0]
    rng = np.random.default_rng(21)
    world = rope_world(rng, sh, 3)
    case = rope_case(rng, sh, 3, 0)
    p = upload_all(cuda, {**world, "sel": case.sel, "cnt": case.cnt, "entries": case.entries})
    pb, mb = sparse_mla.split_workspace(sh.heads, sh.dim, sh.sel_cap)
    sizes = {"out": 3 * sh.heads * sh.dim * 2, "part": 3 * pb, "ml": 3 * mb}
    o = poison_all(cuda, sizes)
    try:
        raw_launch(cuda, {**p, **o}, sh, 3, split, rope_dim, p["q_rope"], p["rope_keys"])
        got = bytes_of(cuda, o, sizes)
        for k in ("part", "ml") if split else ("out",):
            assert (got[k] == 0xFF).all(), f"{k} written for rope_dim {rope_dim}"
    finally:
        free_all(cuda, p, o)
