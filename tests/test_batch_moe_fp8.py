"""The FP8 experts' host twins (model/kernels/moe.py: moe_gate_up_fp8_batch, moe_down_fp8_batch,
issue 18), their layouts and the quantiser a BF16 checkpoint's experts go through on load.

- block_scaled_dot against float64 within the block-scaled f32 bound, and exactly where every
  partial sum is exact (so a wrong block's scale or a wrong block boundary shows), with partial
  blocks in both dimensions;
- the experts at m = 1 against float64 of the exact weights q * s (routed, shared here / elsewhere
  / none, dense, sharded ranges, partial blocks: I = 32, 48, 160, 37; H = 64, 192, 136, 45);
- the FP8 twin on (q, s) against the BF16 twin on dequantise(q, s) (power-of-two scales, so the
  BF16 weights are exact) within the two f32 computations' bounds;
- every row of a batch equals its m = 1 launch bit for bit, in any order, with padding (whose rows
  stay poison) and pairs of other ranks' experts (act unwritten, parts zeros);
- the layouts: stack_gate_up_fp8 and check_fp8_experts refuse wrong shapes, dtypes and block sizes;
  the twin reads exactly the scale layout (one block row short is a fault on the host heap);
- the wrappers' refusals and launch shapes;
- fp8.quantize: absmax / 448 scales, saturating (never NaN), partial blocks, zero blocks, the
  round trip within half an E4M3 ulp, non-finite weights refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_moe_fp8_util import (
    block_dot_bound,
    check_against_float64,
    check_against_twin,
    check_unwritten_and_zero,
    dequant64,
    random_fp8,
    random_fp8_experts,
    run_batch_fp8,
    run_row_alone_fp8,
    same_bits,
    upload,
)
from batch_moe_util import (
    MoeCase,
    entries_with_pads,
    free_all,
    random_ids,
    random_weights_rows,
    run_batch,
    upload_weights,
)
from kernel_util import random_bf16

from model.checkpoint import fp8
from model.kernels import moe
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16, FP8
from runtime.errors import MemoryFault
from runtime.host_backend import HostBackend

CASES = {
    "none": (MoeCase(6, 0, 32, 64, 4, moe.SHARED_NONE, 4.0), 6),  # I and H inside one partial block
    "here": (MoeCase(6, 0, 48, 192, 4, moe.SHARED_HERE, 4.0), 6),  # H: a full block and a half
    "elsewhere_odd": (MoeCase(4, 4, 37, 45, 3, moe.SHARED_ELSEWHERE, 4.0), 12),  # odd sizes, sharded
    "sharded_here": (MoeCase(5, 5, 160, 136, 4, moe.SHARED_HERE, 4.0), 15),  # I: 128 + 32
    "dense": (MoeCase(1, 0, 40, 48, 0, moe.SHARED_HERE, 4.0), 1),
}


def _routing(rng, m, name):
    case, E = CASES[name]
    if case.ntopk == 0:
        return np.zeros((m, 1), np.uint32), np.ones((m, 1), np.float32)
    return random_ids(rng, m, case, E), random_weights_rows(rng, m, case)


# ---- the arithmetic -----------------------------------------------------------------------------


def _dot_inputs(rng, rows, cols, q=None, x=None, pow2=False):
    q = random_fp8(rng, (rows, cols)) if q is None else q
    s = (2.0 ** rng.integers(-3, 4, fp8.scale_shape((rows, cols)))).astype(np.float32)
    if not pow2:
        s = (s * (0.5 + rng.random(s.shape))).astype(np.float32)
    x = random_bf16(rng, cols, exp_lo=-4).astype(np.float32) if x is None else x
    return q, s, x


def _twin_dot(q, s, x):
    host = HostBackend()
    p = host.alloc(q.size)
    host.copy_h2d(p, q.view(np.uint8))
    qb = moe._fp8_rows(host.mem, p, *q.shape)
    return moe.block_scaled_dot(qb, s[np.arange(q.shape[0]) // 128], x)


@pytest.mark.parametrize("rows,cols", [(5, 45), (130, 128), (200, 129), (64, 300), (1, 1)])
def test_block_scaled_dot_against_float64(rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    q, s, x = _dot_inputs(rng, rows, cols)
    got = _twin_dot(q, s, x)
    w = dequant64(q, s, gate_up=False)
    ref = w @ x.astype(np.float64)
    err = np.abs(got.astype(np.float64) - ref)
    assert (
        got.dtype == np.float32
        and (err <= block_dot_bound(np.abs(w) @ np.abs(x.astype(np.float64)), cols)).all()
    )


@pytest.mark.parametrize("rows,cols", [(130, 300), (7, 129)])
def test_block_scaled_dot_applies_each_blocks_own_scale(rows, cols):
    """Small integer weights and activations, power-of-two scales: every partial sum, product and
    accumulation is exact in f32, so the result must equal float64 exactly; a block boundary or a
    block scale off by one would not."""
    rng = np.random.default_rng(cols)
    q = rng.integers(-4, 5, (rows, cols)).astype(np.float32).astype(FP8)
    x = rng.integers(-3, 4, cols).astype(np.float32)
    q, s, x = _dot_inputs(rng, rows, cols, q=q, x=x, pow2=True)
    got = _twin_dot(q, s, x)
    np.testing.assert_array_equal(
        got.astype(np.float64), dequant64(q, s, gate_up=False) @ x.astype(np.float64)
    )


# ---- the experts --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_experts_fp8_at_m1_against_float64(name):
    """One entry, slot by slot: act and parts against float64 of the exact weights (the routed
    expert of each slot, the shared one in slot ntopk, the dense MLP's in slot 0); pairs not held
    here: act unwritten, parts zeros."""
    host = HostBackend()
    case, _ = CASES[name]
    rng = np.random.default_rng(len(name) + 7)
    ex = random_fp8_experts(rng, case)
    wp = upload(host, ex)
    for _ in range(3):
        y = random_bf16(rng, (1, case.h), exp_lo=-6)
        ids, wts = _routing(rng, 1, name)
        out = run_batch_fp8(host, wp, case, y, ids, wts, pack_entries([5], [9], [0]))
        check_against_float64(case, ex, y, ids, wts, [0], out)
        check_unwritten_and_zero(case, ids, [0], out)


@pytest.mark.parametrize("name", ["here", "sharded_here", "dense", "none"])
def test_fp8_twin_equals_the_bf16_twin_on_the_dequantised_weights(name):
    """Power-of-two block scales make dequantise(q, s) exact in BF16; the BF16 twin on it and the
    FP8 twin on (q, s) then compute the same exact values in f32, and agree within the sum of a
    plain f32 dot's bound (k eps sum|w x|) and the block-scaled one's."""
    host = HostBackend()
    case, _ = CASES[name]
    rng = np.random.default_rng(3 * len(name))
    ex = random_fp8_experts(rng, case, pow2=True)
    deq = (
        np.stack([dequant64(ex.gu[i], ex.gu_s[i], True) for i in range(case.n_local)]),
        np.stack([dequant64(ex.dn[i], ex.dn_s[i], False) for i in range(case.n_local)]),
        dequant64(ex.sgu[0], ex.sgu_s[0], True),
        dequant64(ex.sdn[0], ex.sdn_s[0], False),
    )
    bf = tuple(a.astype(BF16) for a in deq)
    for a, b in zip(bf, deq):
        assert (a.astype(np.float64) == b).all(), "power-of-two scales must dequantise exactly"
    ent, rows = entries_with_pads(rng, 9, 2)
    y = random_bf16(rng, (len(ent), case.h), exp_lo=-6)
    ids, wts = _routing(rng, len(ent), name)
    f8 = run_batch_fp8(host, upload(host, ex), case, y, ids, wts, ent)
    b16 = run_batch(host, upload_weights(host, bf), case, y, ids, wts, ent)

    def both(absd, k):
        return block_dot_bound(absd, k) + 2.0 * k * 2.0**-24 * absd

    check_against_twin(case, ex, y, ids, wts, rows, f8, b16, bound=both)
    check_unwritten_and_zero(case, ids, rows, f8)


@pytest.mark.parametrize("name", list(CASES))
def test_experts_fp8_rows_are_their_own_launches(name):
    """Each live row equals the m = 1 launch of that row bit for bit, and again after a shuffle;
    padding rows stay poison; the outputs agree with float64."""
    host = HostBackend()
    case, _ = CASES[name]
    rng = np.random.default_rng(11 * len(name))
    ex = random_fp8_experts(rng, case)
    wp = upload(host, ex)
    ent, rows = entries_with_pads(rng, 13, 4)
    m, ns = len(ent), case.nslots
    y = random_bf16(rng, (m, case.h), exp_lo=-6)
    ids, wts = _routing(rng, m, name)
    out = run_batch_fp8(host, wp, case, y, ids, wts, ent)
    check_against_float64(case, ex, y, ids, wts, rows, out)
    check_unwritten_and_zero(case, ids, rows, out)
    for e in rows:
        sl = slice(e * ns, (e + 1) * ns)
        a1, p1 = run_row_alone_fp8(host, wp, case, y[e], ids[e], wts[e])
        same_bits(out.act[sl], a1, f"act of row {e}")
        same_bits(out.parts[sl], p1, f"parts of row {e}")
    perm = rng.permutation(m)
    out2 = run_batch_fp8(host, wp, case, y[perm], ids[perm], wts[perm], ent[perm])
    for new, old in enumerate(perm):
        same_bits(out2.act[new * ns : (new + 1) * ns], out.act[old * ns : (old + 1) * ns], "act, shuffled")
        same_bits(
            out2.parts[new * ns : (new + 1) * ns], out.parts[old * ns : (old + 1) * ns], "parts, shuffled"
        )


def test_the_twin_reads_exactly_the_scale_layout():
    """Scale buffers of exactly gate_up_scale_shape / down_scale_shape serve the launch; one block
    row short, the host heap refuses the read of the missing row (the kernels read the same
    offsets)."""
    host = HostBackend()
    case = MoeCase(3, 0, 160, 136, 2, moe.SHARED_NONE, 4.0)
    rng = np.random.default_rng(1)
    ex = random_fp8_experts(rng, case)
    ids = np.array([[2, 0]], np.uint32)
    wts = np.ones((1, 2), np.float32)
    y = random_bf16(rng, (1, case.h), exp_lo=-6)
    ent = pack_entries([0], [0], [0])
    run_batch_fp8(host, upload(host, ex), case, y, ids, wts, ent)
    short = random_fp8_experts(rng, case)
    short.gu_s = ex.gu_s.reshape(-1)[: -ex.gu_s.shape[2]].copy()  # expert 2's last up block row missing
    with pytest.raises(MemoryFault):
        run_batch_fp8(host, upload(host, short), case, y, ids, wts, ent)
    short = random_fp8_experts(rng, case)
    short.dn_s = ex.dn_s.reshape(-1)[:-1].copy()
    with pytest.raises(MemoryFault):
        run_batch_fp8(host, upload(host, short), case, y, ids, wts, ent)


# ---- layouts ------------------------------------------------------------------------------------


def test_stack_gate_up_fp8_is_the_kernels_layout():
    """The stacked gate_up of separately quantised gate_proj and up_proj dequantises to the two
    matrices (the up rows use the up's own block rows, also when I is not a multiple of 128)."""
    rng = np.random.default_rng(2)
    i, h = 160, 200
    gate = (rng.standard_normal((i, h)) * 0.02).astype(np.float32)
    up = (rng.standard_normal((i, h)) * 0.5).astype(np.float32)
    (gq, gs), (uq, us) = fp8.quantize(gate), fp8.quantize(up)
    q, s = moe.stack_gate_up_fp8(gq, gs, uq, us)
    assert q.shape == (2 * i, h) and s.shape == moe.gate_up_scale_shape(1, i, h)[1:]
    w = dequant64(q, s, gate_up=True)
    np.testing.assert_array_equal(w[:i], dequant64(gq, gs, False))
    np.testing.assert_array_equal(w[i:], dequant64(uq, us, False))
    moe.check_fp8_experts(q[None], s[None], random_fp8(rng, (1, h, i)), np.ones((1, 2, 2), np.float32), i, h)


def test_layout_checks_refuse_wrong_shapes_dtypes_and_blocks():
    rng = np.random.default_rng(3)
    i, h = 48, 192
    gq, uq = random_fp8(rng, (i, h)), random_fp8(rng, (i, h))
    ok = np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match="up_proj.*F32 \\[1, 2\\]"):
        moe.stack_gate_up_fp8(gq, ok, uq, np.ones((1, 3), np.float32))  # blocks of 64 columns
    with pytest.raises(ValueError, match="gate_proj.*F32"):
        moe.stack_gate_up_fp8(gq, ok.astype(np.float64), uq, ok)
    with pytest.raises(ValueError, match="gate_proj.*F8_E4M3"):
        moe.stack_gate_up_fp8(gq.astype(np.float32).astype(BF16), ok, uq, ok)
    with pytest.raises(ValueError, match="up_proj.*F8_E4M3"):
        moe.stack_gate_up_fp8(gq, ok, uq[:-1], ok)
    n = 3
    gu, dn = random_fp8(rng, (n, 2 * i, h)), random_fp8(rng, (n, h, i))
    gus, dns = (
        np.ones(moe.gate_up_scale_shape(n, i, h), np.float32),
        np.ones(moe.down_scale_shape(n, h, i), np.float32),
    )
    assert moe.gate_up_scale_shape(n, i, h) == (3, 2, 2) and moe.down_scale_shape(n, h, i) == (3, 2, 1)
    moe.check_fp8_experts(gu, gus, dn, dns, i, h)
    with pytest.raises(ValueError, match="gate_up scales: expected F32 \\[3, 2, 2\\]"):
        moe.check_fp8_experts(gu, gus[:, :1], dn, dns, i, h)  # the up's block rows missing
    with pytest.raises(ValueError, match="down scales"):
        moe.check_fp8_experts(gu, gus, dn, np.ones((n, 3, 1), np.float32), i, h)  # blocks of 64 rows
    with pytest.raises(ValueError, match="down: expected F8_E4M3"):
        moe.check_fp8_experts(gu, gus, dn.transpose(0, 2, 1), dns, i, h)
    with pytest.raises(ValueError, match="gate_up: expected"):
        moe.check_fp8_experts(gu.astype(np.float32), gus, dn, dns, i, h)
    moe.check_fp8_block((128, 128))
    for block in [(64, 64), (128, 64), (1, 128)]:
        with pytest.raises(ValueError, match="128 x 128 only"):
            moe.check_fp8_block(block)


# ---- launches -----------------------------------------------------------------------------------


class GridRecorder(HostBackend):
    """Records each launch's grid and block instead of running the twin."""

    def __init__(self):
        super().__init__()
        self.grids = {}

    def launch(self, kernel, grid, block, args, smem=0, stream=None):
        self.grids[kernel.decl.function] = (tuple(grid), tuple(block))


def _fp8_args(z, **over):
    gu = dict(
        w=z, w_scale=z, w_shared=z, w_shared_scale=z, y=z, group=z, act=z, entries=z, m=1, ntopk=8,
        n_local=288, inter=2048, h=4096, limit=7.0, shared=moe.SHARED_HERE,
    )  # fmt: skip
    return {**gu, **over}


def _down_args(z, **over):
    dn = dict(
        w=z, w_scale=z, w_shared=z, w_shared_scale=z, act=z, weights=z, group=z, parts=z, entries=z, m=1,
        ntopk=8, n_local=288, h=4096, inter=2048, shared=moe.SHARED_HERE,
    )  # fmt: skip
    return {**dn, **over}


@pytest.mark.parametrize("shared", [moe.SHARED_HERE, moe.SHARED_ELSEWHERE, moe.SHARED_NONE])
def test_fp8_launch_shapes_at_the_glm_shape(shared):
    """m = 1, top-8 of 288: gate/up 64 x 9 blocks of 128 threads (8 without the shared expert here:
    2304 warps of 8 act elements), down 64 x 9 (8 without a shared slot); m = 64: the items bound."""
    gpu = GridRecorder()
    z = gpu.alloc(64)
    moe.moe_gate_up_fp8_batch(gpu, **_fp8_args(z, shared=shared))
    moe.moe_down_fp8_batch(gpu, **_down_args(z, shared=shared))
    assert gpu.grids["moe_gate_up_fp8_batch"] == ((64, 9 if shared == moe.SHARED_HERE else 8, 1), (128, 1, 1))
    assert gpu.grids["moe_down_fp8_batch"] == ((64, 8 if shared == moe.SHARED_NONE else 9, 1), (128, 1, 1))
    moe.moe_gate_up_fp8_batch(gpu, **_fp8_args(z, shared=shared, m=64))
    st = 8 if shared == moe.SHARED_HERE else 0
    assert gpu.grids["moe_gate_up_fp8_batch"][0] == (64, st + moe.items_bound(512, 288), 1)


def test_fp8_wrappers_refuse_bad_launches():
    gpu = HostBackend()
    z = gpu.alloc(64)
    with pytest.raises(ValueError, match="outside 1..256"):
        moe.moe_gate_up_fp8_batch(gpu, **_fp8_args(z, m=257))
    with pytest.raises(ValueError, match="outside 1..256"):
        moe.moe_down_fp8_batch(gpu, **_down_args(z, m=0))
    with pytest.raises(ValueError, match="w_scale must be a 4-byte aligned"):
        moe.moe_gate_up_fp8_batch(gpu, **_fp8_args(z, w_scale=z.offset(2)))
    with pytest.raises(ValueError, match="w_shared_scale must be"):
        moe.moe_down_fp8_batch(gpu, **_down_args(z, w_shared_scale=None))
    with pytest.raises(ValueError, match="group workspace"):
        moe.moe_gate_up_fp8_batch(gpu, **_fp8_args(z, group=None))
    with pytest.raises(ValueError, match="group workspace and the weights"):
        moe.moe_down_fp8_batch(gpu, **_down_args(z, weights=None))
    with pytest.raises(ValueError, match="16-byte aligned"):
        moe.moe_down_fp8_batch(gpu, **_down_args(z, group=z.offset(4)))
    with pytest.raises(ValueError, match="must be positive"):
        moe.moe_gate_up_fp8_batch(gpu, **_fp8_args(z, inter=0))


# ---- quantise on load ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(130, 200), (128, 128), (1, 300), (257, 1)])
def test_quantize_is_per_block_absmax_and_saturating(shape):
    """scale = the block's absmax / 448 over the elements a partial block holds; the absmax element
    quantises to +-448 (saturated where the f32 quotient lands past it, never NaN); every element
    round-trips within half an E4M3 ulp (2**-4 relative) or, below the normal range, half its
    subnormal step."""
    rng = np.random.default_rng(shape[0] + shape[1])
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-8, 2, shape))).astype(np.float32)
    q, s = fp8.quantize(w)
    assert q.dtype == FP8 and s.dtype == np.float32 and s.shape == fp8.scale_shape(shape)
    qf = q.astype(np.float32)
    assert np.isfinite(qf).all() and np.abs(qf).max() <= 448
    bo, bi = fp8.DEFAULT_BLOCK
    for a in range(s.shape[0]):
        for b in range(s.shape[1]):
            blk = w[a * bo : (a + 1) * bo, b * bi : (b + 1) * bi]
            assert s[a, b] == np.float32(np.abs(blk).max() / np.float32(448))
            qb = qf[a * bo : (a + 1) * bo, b * bi : (b + 1) * bi]
            assert np.abs(qb.reshape(-1)[np.argmax(np.abs(blk))]) == 448
    back = dequant64(q, s, gate_up=False)
    srow = s.astype(np.float64)[np.arange(shape[0]) // bo][:, np.arange(shape[1]) // bi]
    err = np.abs(back - w.astype(np.float64))
    assert (err <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * srow) * (1 + 2.0**-20)).all()


def test_quantize_saturates_zero_blocks_and_refuses_non_finite():
    w = np.zeros((130, 130), np.float32)
    w[0, 0] = 3.0
    w[129, 129] = -1e-30  # a partial block holding one tiny element
    q, s = fp8.quantize(w)
    assert s[0, 1] == 1.0 and s[1, 0] == 1.0  # all-zero blocks
    assert q.astype(np.float32)[0, 0] == 448 and q.astype(np.float32)[129, 129] == -448
    assert (q.astype(np.float32)[1:129, 1:129] == 0).all()
    # an f32 quotient just past 448 saturates instead of becoming NaN
    big = np.full((1, 4), 448.0, np.float32)
    big[0, 1] = np.nextafter(np.float32(448), np.float32(1000))
    q, _ = fp8.quantize(big)
    assert np.isfinite(q.astype(np.float32)).all()
    for bad in (np.inf, np.nan):
        w2 = w.copy()
        w2[5, 7] = bad
        with pytest.raises(ValueError, match="non-finite"):
            fp8.quantize(w2)


def test_quantised_experts_run_close_to_the_bf16_experts():
    """A BF16 expert quantised on load (fp8.quantize per tensor, stack_gate_up_fp8) computes through
    the FP8 twin what the BF16 twin computes from the BF16 weights, within the quantisation's error:
    half an E4M3 ulp per weight (|dot error| <= 2**-4 sum |w x| plus the f32 bounds)."""
    host = HostBackend()
    rng = np.random.default_rng(9)
    case = MoeCase(2, 0, 48, 192, 2, moe.SHARED_HERE, 30.0)  # a limit that does not clamp
    gu = random_bf16(rng, (2, 2 * case.inter, case.h), exp_lo=-9)
    dn = random_bf16(rng, (2, case.h, case.inter), exp_lo=-9)
    sgu, sdn = (
        random_bf16(rng, (2 * case.inter, case.h), exp_lo=-9),
        random_bf16(rng, (case.h, case.inter), exp_lo=-9),
    )
    i = case.inter

    def q_gate_up(w):
        (gq, gs), (uq, us) = fp8.quantize(w[:i]), fp8.quantize(w[i:])
        return moe.stack_gate_up_fp8(gq, gs, uq, us)

    qgu = [q_gate_up(gu[x]) for x in range(2)]
    qdn = [fp8.quantize(dn[x]) for x in range(2)]
    sg, sd = q_gate_up(sgu), fp8.quantize(sdn)
    arrays = (
        np.stack([a for a, _ in qgu]), np.stack([b for _, b in qgu]), np.stack([a for a, _ in qdn]),
        np.stack([b for _, b in qdn]), sg[0][None], sg[1][None], sd[0][None], sd[1][None],
    )  # fmt: skip
    moe.check_fp8_experts(arrays[0], arrays[1], arrays[2], arrays[3], i, case.h)
    wp8 = tuple(host.alloc(a.nbytes) for a in arrays)
    for p, a in zip(wp8, arrays):
        host.copy_h2d(p, a.view(np.uint8) if a.dtype == FP8 else a)
    ent = pack_entries([0, 1, 2], [0, 1, 2], [0, 0, 0])
    y = random_bf16(rng, (3, case.h), exp_lo=-3)
    ids = np.array([[0, 1, 0], [1, 0, 0], [0, 1, 0]], np.uint32)
    wts = np.array([[0.7, 0.3, 1.0], [0.6, 0.4, 1.0], [0.5, 0.5, 1.0]], np.float32)
    f8 = run_batch_fp8(host, wp8, case, y, ids, wts, ent)
    b16 = run_batch(host, upload_weights(host, (gu, dn, sgu[None], sdn[None])), case, y, ids, wts, ent)
    for e in range(3):
        for j, (wg, wd) in enumerate(
            [(gu[ids[e, 0]], dn[ids[e, 0]]), (gu[ids[e, 1]], dn[ids[e, 1]]), (sgu, sdn)]
        ):
            p = e * 3 + j
            absg = np.abs(wg.astype(np.float64)) @ np.abs(y[e].astype(np.float64))
            # the act difference through SwiGLU (|d silu| <= 1.1 and |silu(g)| <= |g| at this limit)
            g = wg.astype(np.float64) @ y[e].astype(np.float64)
            dg = 2.0**-4 * absg + 4 * case.h * 2.0**-24 * absg
            tol = 1.1 * dg[:i] * (np.abs(g[i:]) + dg[i:]) + (np.abs(g[:i]) + dg[:i]) * dg[i:]
            tol += 2.0**-7 * np.abs(b16.act[p].astype(np.float64))
            assert (np.abs(f8.act[p].astype(np.float64) - b16.act[p].astype(np.float64)) <= tol).all()
            a8, a16 = f8.act[p].astype(np.float64), b16.act[p].astype(np.float64)
            wt = float(wts[e, j])
            absd = np.abs(wd.astype(np.float64)) @ np.abs(a16)
            ptol = wt * (
                2.0**-4 * absd + np.abs(wd.astype(np.float64)) @ np.abs(a8 - a16) + 4 * i * 2.0**-24 * absd
            )
            assert (np.abs(f8.parts[p].astype(np.float64) - b16.parts[p]) <= ptol + 1e-30).all()
    free_all(host, wp8)
