"""RoPE (model/kernels/rope.py) and the kernels that rotate: ``rope_ref`` against an independent
float64 formula, the host twins of ``rope_q_batch`` and ``dsa_cache_write_plain_batch`` against
float64 formulas at awkward sizes (with the checks of tests/rope_util.py: padding and rows past
slot_rows write nothing, each entry alone at m = 1 gives the batch's bytes), and the launch
helpers' refusals of dims the kernels do not define.

Tolerances: float32 RoPE within 2**-21 attn_factor (|x0| + |x1|) of float64 (``rope_bound``); a
BF16 output within that plus 2**-8 relative (one rounding, with slack); FP8 rows dequantised within
one E4M3 step (2**-3 relative) plus 2**-8 of the row's scale, the scale within 2**-16 relative of
float64's absmax / 448 (f32 LayerNorm statistics against float64's; 2**-8 for the latent, which is
rounded to BF16 before it is quantised).
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_dsa_util import free_all, upload_all
from kernel_util import random_bf16
from rope_util import (
    ATTN_FACTOR,
    EPS,
    LN_EPS,
    PLAIN_STATE,
    PlainShape,
    QShape,
    check_bad_dims_write_nothing,
    check_plain,
    check_q,
    entries_at,
    inv_freq_table,
    plain_items,
    plain_launch,
    plain_run,
    plain_state,
    plain_world,
    rope_bound,
    rope_f64,
    with_padding,
)

from model.kernels import dsa_cache, rope
from model.kernels.rope import rope_ref
from runtime.dtypes import BF16, FP8
from runtime.host_backend import HostBackend

POSITIONS = [0, 1, 4095, 1_048_575]


def _bf16_close(got, ref64, x_in, interleave, what):
    """A BF16 output against float64: half a BF16 ulp of rounding on top of the float32 bound."""
    g = np.asarray(got, np.float64)
    assert not np.isnan(g).any(), f"{what}: NaN (unwritten?)"
    bound = 2.0**-8 * np.abs(ref64) + rope_bound(x_in, ATTN_FACTOR, interleave) + 1e-30
    err = np.abs(g - ref64)
    assert (err <= bound).all(), f"{what}: worst {float((err - bound).max())} over the bound"


# ---- rope_ref --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_dim", [16, 64])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("pos", POSITIONS)
def test_rope_ref_against_float64(rope_dim, interleave, pos):
    rng = np.random.default_rng(rope_dim + pos)
    x = random_bf16(rng, (7, rope_dim), exp_lo=-3)
    inv = inv_freq_table(rope_dim)
    got = rope_ref(x, pos, inv, ATTN_FACTOR, interleave)
    assert got.dtype == np.float32 and got.shape == x.shape
    ref = rope_f64(x, pos, inv, ATTN_FACTOR, interleave)
    bound = rope_bound(x, ATTN_FACTOR, interleave)
    err = np.abs(got.astype(np.float64) - ref)
    assert (err <= bound).all(), f"worst {float((err - bound).max())} over the bound"
    # The check can tell the layouts apart, and (past position 0) an unrotated row.
    other = rope_f64(x, pos, inv, ATTN_FACTOR, not interleave)
    if pos:
        assert (np.abs(got - other) > bound).any(), "the other layout passes too"
        assert (np.abs(got - x.astype(np.float64) * ATTN_FACTOR) > bound).any()


def test_rope_ref_angle_is_the_float32_product():
    """At pos 1,048,575 a float32 ulp of the angle is 0.06 rad: the definition's rounded angle and
    the exact one give results far apart, and rope_ref gives the rounded one's."""
    rng = np.random.default_rng(5)
    x = random_bf16(rng, (4, 64), exp_lo=-1)
    inv = inv_freq_table(64)
    got = rope_ref(x, 1_048_575, inv, 1.0, True)
    pairs = x.astype(np.float64).reshape(4, 32, 2)
    exact = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * 1_048_575 * inv.astype(np.float64))
    exact = np.stack([exact.real, exact.imag], -1).reshape(4, 64)
    assert np.abs(got - exact).max() > 1e-3
    np.testing.assert_allclose(got, rope_f64(x, 1_048_575, inv, 1.0, True), rtol=0, atol=1e-5)


def test_rope_ref_positions_per_row_and_refusal():
    rng = np.random.default_rng(6)
    x = random_bf16(rng, (5, 16))
    inv = inv_freq_table(16)
    pos = np.array([0, 1, 4095, 70000, 1_048_575], np.uint32)
    rows = np.stack([rope_ref(x[i], int(pos[i]), inv, 0.5, False) for i in range(5)])
    assert np.array_equal(rope_ref(x, pos, inv, 0.5, False), rows)
    assert np.array_equal(rope_ref(x, 0, inv, 1.0, True), x.astype(np.float32)), "position 0 is the identity"
    with pytest.raises(ValueError, match="inv_freq of 8 pairs"):
        rope_ref(x[:, :14], 3, inv, 1.0, True)


# ---- rope_q_batch ----------------------------------------------------------------------------------

Q_SHAPES = [
    QShape(
        heads=3, nope=16, rope_dim=16, iheads=2, idim=32, irope_dim=16, interleave=True, i_interleave=False
    ),
    QShape(
        heads=3, nope=16, rope_dim=64, iheads=5, idim=128, irope_dim=64, interleave=False, i_interleave=True
    ),
    QShape(heads=3, nope=16, rope_dim=16, iheads=5, idim=32, irope_dim=0),  # the indexer unrotated
    QShape(heads=3, nope=16, rope_dim=0, iheads=2, idim=32, irope_dim=0),  # NoPE: a split only
    QShape(heads=1, nope=0, rope_dim=64, iheads=1, idim=64, irope_dim=64),  # the rope part only
]
Q_IDS = ["r16", "r64-half", "irope0", "rope0", "nope0"]


def _q_case(rng, sh: QShape, m: int, row_add: int):
    items = [(0, int(p)) for p in rng.choice(POSITIONS + [17, 70000, 999_999], m - m // 4)]
    ent, live, pads = entries_at(with_padding(rng, items, m // 4), row_add)
    return ent, live, pads, random_bf16(rng, (m, sh.q_stride), exp_lo=-3)


@pytest.mark.parametrize("sh", Q_SHAPES, ids=Q_IDS)
@pytest.mark.parametrize("m", [1, 6, 13])
@pytest.mark.parametrize("row_add", [0, 3])
def test_rope_q_batch_against_float64(sh, m, row_add):
    rng = np.random.default_rng(10 * m + row_add)
    ent, live, _, q = _q_case(rng, sh, m, row_add)
    got = check_q(HostBackend(), sh, q, ent, row_add)
    inv = inv_freq_table(sh.rope_dim)
    for e, _, pos in live:
        heads = q[e, : sh.heads * sh.qk].reshape(sh.heads, sh.qk)
        assert np.array_equal(got["q_nope"][e].view(np.uint16), heads[:, : sh.nope].view(np.uint16))
        if sh.rope_dim:
            xr = heads[:, sh.nope :]
            _bf16_close(
                got["q_rope"][e],
                rope_f64(xr, pos, inv, ATTN_FACTOR, sh.interleave),
                xr,
                sh.interleave,
                f"q_rope {e}",
            )
        if sh.irope_dim:
            at = sh.iq_offset
            ih = q[e, at : at + sh.iheads * sh.idim].reshape(sh.iheads, sh.idim)[:, : sh.irope_dim]
            gi = got["q"][e, at : at + sh.iheads * sh.idim].reshape(sh.iheads, sh.idim)[:, : sh.irope_dim]
            ref = rope_f64(ih, pos, inv, ATTN_FACTOR, sh.i_interleave)
            _bf16_close(gi, ref, ih, sh.i_interleave, f"indexer q {e}")


def test_rope_q_batch_wraps_the_row_sum():
    """pos = row + row_add in u32: a row word of 2**32 - 2 with row_add 3 is position 1."""
    sh = Q_SHAPES[0]
    rng = np.random.default_rng(2)
    q = random_bf16(rng, (2, sh.q_stride), exp_lo=-3)
    a, _, _ = entries_at([(0, 1), (0, 1)], 3)  # both position 1: row word 2**32 - 2
    b, _, _ = entries_at([(0, 1), (0, 1)], 0)
    assert a[0, 1] == 0xFFFFFFFE
    ga, gb = check_q(HostBackend(), sh, q, a, 3), check_q(HostBackend(), sh, q, b, 0)
    for k in ga:
        assert np.array_equal(ga[k].view(np.uint16), gb[k].view(np.uint16)), k


# ---- dsa_cache_write_plain_batch ------------------------------------------------------------------

PLAIN_SHAPES = [
    PlainShape(
        slots=4, slot_rows=45, C=32, rope_dim=16, idim=32, irope_dim=16, interleave=True, i_interleave=False
    ),
    PlainShape(
        slots=3, slot_rows=40, C=512, rope_dim=64, idim=128, irope_dim=64, interleave=False, i_interleave=True
    ),
    PlainShape(slots=3, slot_rows=37, C=40, rope_dim=16, idim=20, irope_dim=0),  # indexer unrotated, odd dims
    PlainShape(slots=3, slot_rows=37, C=32, rope_dim=0, idim=32, irope_dim=0),  # NoPE
]
PLAIN_IDS = ["r16", "r64-half", "irope0", "rope0"]


def _rms64(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean() + eps) * w.astype(np.float64)


def _ln64(x, w, b, eps):
    x = x.astype(np.float64)
    return (x - x.mean()) / np.sqrt(x.var() + eps) * w.astype(np.float64) + b.astype(np.float64)


def _fp8_close(q, s, ref, what, scale_rtol=2.0**-16):
    d = q.view(FP8).astype(np.float64) * float(s)
    assert abs(float(s) - np.abs(ref).max() / 448.0) <= scale_rtol * float(s), f"{what}: scale"
    err = np.abs(d - ref)
    bound = 2.0**-3 * np.abs(ref) + float(s) * 2.0**-8
    assert (err <= bound).all(), f"{what}: worst {float((err - bound).max())} over the bound"


@pytest.mark.parametrize("sh", PLAIN_SHAPES, ids=PLAIN_IDS)
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("row_add", [0, 2])
def test_cache_write_plain_against_float64(sh, m, row_add):
    """Latents (FP8 of rmsnorm * w), rope keys (BF16 rope of k_rope at the row's position) and
    pool keys (FP8 of rope(LayerNorm(wk y))) at their slots' places, in float64."""
    rng = np.random.default_rng(100 * m + row_add)
    world = plain_world(rng, sh)
    must = [(0, 0), (1, sh.slot_rows - 1)] if m >= 4 else [(1, sh.slot_rows - 1)]  # the first, the last
    run = plain_run(sh, plain_items(rng, sh, m, must), row_add, rng)
    got = check_plain(HostBackend(), world, sh, run, row_add)
    cache = got["cache"].reshape(-1, sh.C)
    scales = got["scales"].view(np.float32)
    rk = got["rope_keys"].view(BF16).reshape(world["rope_keys"].shape)
    pk = got["pool_keys"].reshape(-1, sh.idim)
    ps = got["pool_scales"].view(np.float32)
    inv = world["inv"]
    for e, slot, row in run.live:
        f = run.fused[e]
        at = int(world["tables"][slot][row // sh.bs]) * sh.bs + row % sh.bs
        # The latent is rounded to BF16 before it is quantised (as dsa_cache_write_batch's): its
        # scale is within half a BF16 ulp of float64's.
        _fp8_close(cache[at], scales[at], _rms64(f[: sh.C], world["kv_w"], EPS), f"latent {e}", 2.0**-8)
        if sh.rope_dim:
            kr = f[sh.C : sh.C + sh.rope_dim]
            ref = rope_f64(kr, row, inv, ATTN_FACTOR, sh.interleave)
            _bf16_close(rk[slot, row], ref, kr, sh.interleave, f"rope key {e}")
        k = _ln64(f[sh.C + sh.rope_dim : sh.C + sh.rope_dim + sh.idim], world["kw"], world["kb"], LN_EPS)
        if sh.irope_dim:
            k[: sh.irope_dim] = rope_f64(k[: sh.irope_dim], row, inv, ATTN_FACTOR, sh.i_interleave)
        p = sh.geo.pool_row(slot, row)
        assert p == slot * sh.slot_rows + row
        _fp8_close(pk[p], ps[p], k, f"pool key {e}")


def test_cache_write_plain_chunks_and_orders_agree():
    """Three slots' consecutive rows written in random chunks, slots in random order with padding:
    the same pool bytes as one row per launch."""
    sh = PLAIN_SHAPES[0]
    rng = np.random.default_rng(11)
    world = plain_world(rng, sh)
    seqs = {
        int(s): random_bf16(rng, (sh.slot_rows, sh.stride), exp_lo=-2)
        for s in rng.choice(sh.slots, 3, replace=False)
    }
    ref_gpu, gpu = HostBackend(), HostBackend()
    pr, p = upload_all(ref_gpu, world), upload_all(gpu, world)
    for slot, rows in seqs.items():
        for r in range(sh.slot_rows):
            ent, _, _ = entries_at([(slot, r)], 0)
            io = upload_all(ref_gpu, {"fused": rows[r : r + 1], "entries": ent})
            plain_launch(ref_gpu, pr, sh, io["fused"], io["entries"], 1, 0)
            free_all(ref_gpu, io)
    done = dict.fromkeys(seqs, 0)
    while any(done[s] < sh.slot_rows for s in seqs):
        items, fused = [], []
        for s in (int(x) for x in rng.permutation(list(seqs))):
            take = range(done[s], min(done[s] + int(rng.integers(1, 9)), sh.slot_rows))
            if rng.random() < 0.5:
                items.append(None)
                fused.append(np.zeros(sh.stride, BF16))
            items.extend((s, r) for r in take)
            fused.extend(seqs[s][r] for r in take)
            done[s] = take.stop
        ent, _, _ = entries_at(items, 0)
        io = upload_all(gpu, {"fused": np.stack(fused), "entries": ent})
        plain_launch(gpu, p, sh, io["fused"], io["entries"], len(items), 0)
        free_all(gpu, io)
    a, b = plain_state(ref_gpu, pr, world), plain_state(gpu, p, world)
    for k in PLAIN_STATE:
        assert np.array_equal(a[k], b[k]), k
    assert not np.array_equal(b["pool_keys"], world["pool_keys"].reshape(-1).view(np.uint8))


# ---- refusals, and the kernels' own guard ---------------------------------------------------------

BAD_DIMS = [
    (15, 0, 32),  # odd rope_dim
    (16, 16, 8),  # irope_dim > idim
    (16, 8, 32),  # irope_dim neither 0 nor rope_dim
    (16, 32, 64),  # irope_dim neither 0 nor rope_dim (wider)
]


@pytest.mark.parametrize("rope_dim,irope_dim,idim", BAD_DIMS)
def test_helpers_refuse_bad_dims(rope_dim, irope_dim, idim):
    gpu = HostBackend()
    buf = gpu.alloc(1 << 16)
    with pytest.raises(ValueError, match="RoPE needs an even rope_dim"):
        rope.rope_q_batch(
            gpu,
            q=buf,
            q_stride=4096,
            heads=2,
            nope=8,
            rope_dim=rope_dim,
            iq_offset=64,
            iheads=2,
            idim=idim,
            irope_dim=irope_dim,
            inv_freq=buf,
            attn_factor=1.0,
            interleave=1,
            i_interleave=0,
            q_nope=buf,
            q_rope=buf,
            entries=buf,
            m=1,
            row_add=0,
        )
    with pytest.raises(ValueError, match="RoPE needs an even rope_dim"):
        dsa_cache.dsa_cache_write_plain_batch(
            gpu,
            fused=buf,
            stride=256,
            kv_norm_w=buf,
            cache=buf,
            scales=buf,
            tables=buf,
            knorm_w=buf,
            knorm_b=buf,
            rope_keys=buf,
            pool_keys=buf,
            pool_scales=buf,
            inv_freq=buf,
            attn_factor=1.0,
            entries=buf,
            m=1,
            row_add=0,
            slot_rows=16,
            C=32,
            rope_dim=rope_dim,
            idim=idim,
            irope_dim=irope_dim,
            block_size=16,
            interleave=1,
            i_interleave=0,
            eps=EPS,
            ln_eps=LN_EPS,
        )


def _q_kwargs(sh: QShape, buf, **over):
    kw = dict(
        q=buf,
        q_stride=sh.q_stride,
        heads=sh.heads,
        nope=sh.nope,
        rope_dim=sh.rope_dim,
        iq_offset=sh.iq_offset,
        iheads=sh.iheads,
        idim=sh.idim,
        irope_dim=sh.irope_dim,
        inv_freq=buf,
        attn_factor=1.0,
        interleave=1,
        i_interleave=0,
        q_nope=buf,
        q_rope=buf,
        entries=buf,
        m=2,
        row_add=0,
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,match",
    [
        ({"iq_offset": 3 * 32 - 1}, "overlap the MLA heads"),  # the in-place rotation would race
        ({"q_stride": 0}, "q_stride 0 below"),  # rows of entries overlap (m > 1)
        ({"interleave": 2}, "interleave=2 is not 0 / 1"),
        ({"i_interleave": -1}, "i_interleave=-1 is not 0 / 1"),
        ({"m": 0}, "m=0 entries"),
        ({"heads": 0, "iq_offset": 0}, "heads=0"),
        ({"idim": 8, "irope_dim": 16}, "RoPE needs"),
    ],
)
def test_rope_q_batch_refuses_overlaps_and_flags(over, match):
    sh = Q_SHAPES[0]
    gpu = HostBackend()
    buf = gpu.alloc(1 << 16)
    with pytest.raises(ValueError, match=match):
        rope.rope_q_batch(gpu, **_q_kwargs(sh, buf, **over))


def test_plain_helper_refuses_idim_and_flags():
    sh = PLAIN_SHAPES[0]
    gpu = HostBackend()
    p = upload_all(gpu, plain_world(np.random.default_rng(0), sh))
    ent = upload_all(gpu, {"e": entries_at([(0, 1)], 0)[0], "f": np.zeros((1, 4096), BF16)})
    for bad, match in (
        (dict(idim=2048, irope_dim=16), "index_head_dim 2048"),
        (dict(interleave=3), "interleave=3"),
    ):
        kw = {**sh.__dict__, **bad}
        with pytest.raises(ValueError, match=match):
            dsa_cache.dsa_cache_write_plain_batch(
                gpu,
                fused=ent["f"],
                stride=sh.stride,
                kv_norm_w=p["kv_w"],
                cache=p["cache"],
                scales=p["scales"],
                tables=p["tables"],
                knorm_w=p["kw"],
                knorm_b=p["kb"],
                rope_keys=p["rope_keys"],
                pool_keys=p["pool_keys"],
                pool_scales=p["pool_scales"],
                inv_freq=p["inv"],
                attn_factor=1.0,
                entries=ent["e"],
                m=1,
                row_add=0,
                slot_rows=sh.slot_rows,
                C=sh.C,
                rope_dim=sh.rope_dim,
                idim=kw["idim"],
                irope_dim=kw["irope_dim"],
                block_size=sh.bs,
                interleave=kw["interleave"],
                i_interleave=0,
                eps=EPS,
                ln_eps=LN_EPS,
            )


def test_bad_dims_launched_directly_write_nothing():
    check_bad_dims_write_nothing(HostBackend(), PLAIN_SHAPES[0], Q_SHAPES[0])
