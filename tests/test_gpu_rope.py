"""The RoPE kernels' PTX (``rope_q_batch``, ``dsa_cache_write_plain_batch``) on the GPU against their
host twins, at the GLM-5 / DeepSeek-V3.2 shapes (MLA heads of 192 / 128 + 64 rope dims, 32 / 64
indexer heads of 128 with 64 rotated, 512-wide latents) and at awkward small ones (heads 3, nope 16,
rope 16, idim 20 / 32, C 32 / 40, rope_dim 0, irope_dim 0), with positions up to 1,048,575 (slots
of 2**20 rows for the cache write).

Every check (tests/rope_util.py, which tests/test_rope.py also runs on the host backend):
- outputs poisoned (0xFF) or pools full of earlier bytes before the launch: padding rows still
  poison, and nothing outside the live rows' places changed;
- bit equality of each entry of an m-entry launch with that entry's m = 1 launch (pointers offset
  to its rows, entries launched in reverse order), at m = 1, 3, 17, 64, 200;
- a launch of padding entries and rows past slot_rows changes no byte.

Tolerances against the twins: q_nope exact (a copy); BF16 rotated outputs within 1e-2 relative
(one BF16 ulp is 2**-8 = 0.4%) plus twice ``rope_bound`` of the input pair (the float32 results
differ only by the device's cosf / sinf against NumPy's, each within 2**-21 attn_factor
(|x0| + |x1|) of exact); FP8 rows dequantised within one E4M3 step (2**-3 relative) plus 2**-9 of
the row's scale, with at least 98% of the bytes equal; pool-key scales within 1e-6 relative,
latent scales within 2**-7 (as tests/test_gpu_batch_dsa.py: the same code).
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_util import random_bf16
from rope_util import (
    ATTN_FACTOR,
    PlainShape,
    QShape,
    check_bad_dims_write_nothing,
    check_plain,
    check_q,
    entries_at,
    plain_items,
    plain_run,
    plain_world,
    rope_bound,
    with_padding,
)

from runtime.dtypes import BF16, FP8
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

MS = [1, 3, 17, 64, 200]
POSITIONS = [0, 1, 4095, 1_048_575]


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_rope"


def assert_close(g, h, bound, what: str) -> None:
    g64, h64 = np.asarray(g, np.float64), np.asarray(h, np.float64)
    assert not np.isnan(g64).any(), f"{what}: {int(np.isnan(g64).sum())} NaN (unwritten?) elements"
    assert not np.isnan(h64).any(), f"{what}: the host twin produced NaN"
    err = np.abs(g64 - h64)
    bad = err > bound
    if bad.any():
        i = np.unravel_index(int(np.argmax(err - bound)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} outside the bound; worst at {i}: gpu {g64[i]!r} host {h64[i]!r}"
        )


def assert_rope_close(g, h, x_in, interleave: bool, what: str) -> None:
    h64 = np.asarray(h, np.float64)
    assert_close(g, h64, 1e-2 * np.abs(h64) + 2 * rope_bound(x_in, ATTN_FACTOR, interleave) + 1e-30, what)


def assert_fp8_rows_close(gq, gs, hq, hs, scale_rtol: float, what: str) -> None:
    gs, hs = np.asarray(gs, np.float32), np.asarray(hs, np.float32)
    assert not np.isnan(gs).any(), f"{what}: NaN (unwritten) scales"
    assert_close(gs, hs, scale_rtol * np.abs(hs.astype(np.float64)), f"{what} scales")
    gd = gq.view(FP8).astype(np.float64) * gs[:, None]
    hd = hq.view(FP8).astype(np.float64) * hs[:, None]
    assert_close(gd, hd, 2.0**-3 * np.abs(hd) + hs[:, None].astype(np.float64) * 2.0**-9, f"{what} values")
    same = float((gq.view(np.uint8) == hq.view(np.uint8)).mean())
    assert same >= 0.98, f"{what}: only {same:.3f} of the FP8 bytes equal the twin's"


# ---- rope_q_batch ----------------------------------------------------------------------------------

Q_SHAPES = {
    "glm5": QShape(heads=64, nope=192, rope_dim=64, iheads=32, idim=128, irope_dim=64, interleave=True),
    "v32": QShape(
        heads=128,
        nope=128,
        rope_dim=64,
        iheads=64,
        idim=128,
        irope_dim=64,
        interleave=False,
        i_interleave=True,
    ),
    "small": QShape(heads=3, nope=16, rope_dim=16, iheads=5, idim=32, irope_dim=16, i_interleave=True),
    "irope0": QShape(heads=3, nope=16, rope_dim=64, iheads=2, idim=128, irope_dim=0),
    "rope0": QShape(heads=3, nope=16, rope_dim=0, iheads=2, idim=32, irope_dim=0),
}


@pytest.mark.parametrize("name", list(Q_SHAPES))
@pytest.mark.parametrize("m", MS)
def test_rope_q_batch(cuda, name, m):
    sh = Q_SHAPES[name]
    rng = np.random.default_rng(m + 1000 * list(Q_SHAPES).index(name))
    n_live = m - m // 4
    pos = list(rng.integers(0, 1_048_576, n_live))
    pos[: min(n_live, 4)] = POSITIONS[: min(n_live, 4)]
    row_add = 2
    ent, live, _ = entries_at(with_padding(rng, [(0, int(p)) for p in pos], m // 4), row_add)
    q = random_bf16(rng, (m, sh.q_stride), exp_lo=-3)
    g = check_q(cuda, sh, q, ent, row_add)
    h = check_q(HostBackend(), sh, q, ent, row_add, invariance=False)
    for e, _, _ in live:
        assert np.array_equal(g["q_nope"][e].view(np.uint16), h["q_nope"][e].view(np.uint16)), f"q_nope {e}"
        heads = q[e, : sh.heads * sh.qk].reshape(sh.heads, sh.qk)
        if sh.rope_dim:
            assert_rope_close(
                g["q_rope"][e], h["q_rope"][e], heads[:, sh.nope :], sh.interleave, f"q_rope {e}"
            )
        if sh.irope_dim:
            sl = slice(sh.iq_offset, sh.iq_offset + sh.iheads * sh.idim)
            gi = g["q"][e, sl].reshape(sh.iheads, sh.idim)[:, : sh.irope_dim]
            hi = h["q"][e, sl].reshape(sh.iheads, sh.idim)[:, : sh.irope_dim]
            xi = q[e, sl].reshape(sh.iheads, sh.idim)[:, : sh.irope_dim]
            assert_rope_close(gi, hi, xi, sh.i_interleave, f"indexer q {e}")


# ---- dsa_cache_write_plain_batch ------------------------------------------------------------------

PLAIN_SHAPES = {
    "glm5": PlainShape(slots=6, slot_rows=16384, C=512, rope_dim=64, idim=128, irope_dim=64, interleave=True),
    "v32": PlainShape(
        slots=6,
        slot_rows=16384,
        C=512,
        rope_dim=64,
        idim=128,
        irope_dim=64,
        interleave=False,
        i_interleave=True,
    ),
    # Slots of 2**20 rows: positions up to 1,048,575.
    "long": PlainShape(
        slots=2, slot_rows=1 << 20, C=32, rope_dim=16, idim=32, irope_dim=16, i_interleave=True
    ),
    "irope0": PlainShape(slots=5, slot_rows=45, C=40, rope_dim=16, idim=20, irope_dim=0),
    "rope0": PlainShape(slots=5, slot_rows=45, C=32, rope_dim=0, idim=32, irope_dim=0),
}


@pytest.mark.parametrize("name", list(PLAIN_SHAPES))
@pytest.mark.parametrize("m", MS)
def test_dsa_cache_write_plain_batch(cuda, name, m):
    sh = PLAIN_SHAPES[name]
    rng = np.random.default_rng(m + 1000 * list(PLAIN_SHAPES).index(name))
    world = plain_world(rng, sh)
    last = sh.slot_rows - 1
    must = [(1, last), (0, 0), (0, 1), (1, 4095)][: max(1, m - m // 5 - (m >= 4))]
    row_add = 1
    run = plain_run(sh, plain_items(rng, sh, m, must), row_add, rng)
    g = check_plain(cuda, world, sh, run, row_add)
    h = check_plain(HostBackend(), world, sh, run, row_add, invariance=False)
    lat = np.array([int(world["tables"][s][r // sh.bs]) * sh.bs + r % sh.bs for _, s, r in run.live])
    gc, hc = g["cache"].reshape(-1, sh.C), h["cache"].reshape(-1, sh.C)
    gsc, hsc = g["scales"].view(np.float32), h["scales"].view(np.float32)
    assert_fp8_rows_close(gc[lat], gsc[lat], hc[lat], hsc[lat], 2.0**-7, "latent rows")
    pools = np.array([sh.geo.pool_row(s, r) for _, s, r in run.live])
    gp, hp = g["pool_keys"].reshape(-1, sh.idim), h["pool_keys"].reshape(-1, sh.idim)
    gps, hps = g["pool_scales"].view(np.float32), h["pool_scales"].view(np.float32)
    assert_fp8_rows_close(gp[pools], gps[pools], hp[pools], hps[pools], 1e-6, "pool keys")
    if sh.rope_dim:
        shape = world["rope_keys"].shape
        gk, hk = g["rope_keys"].view(BF16).reshape(shape), h["rope_keys"].view(BF16).reshape(shape)
        for e, s, r in run.live:
            kr = run.fused[e, sh.C : sh.C + sh.rope_dim]
            assert_rope_close(gk[s, r], hk[s, r], kr, sh.interleave, f"rope key {e} (slot {s} row {r})")


def test_bad_dims_launched_directly_write_nothing(cuda):
    check_bad_dims_write_nothing(
        cuda,
        PlainShape(slots=4, slot_rows=45, C=32, rope_dim=16, idim=32, irope_dim=16),
        QShape(heads=3, nope=16, rope_dim=16, iheads=2, idim=32, irope_dim=16),
    )
