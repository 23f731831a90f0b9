"""The tensor-core projections' PTX (ptx/proj_mma.cu: proj_mma_{bf16,f32}, rmsnorm_rows_batch) on
the device, at the GLM-5.3-Flash shapes (fused_in 2336 x 4096 as [kv_a FP8 512 of 576 ; wk +
compress_gate BF16 256 ; q_a FP8 1536 ; weights_proj BF16 32], the q projection [q_b FP8 ; wq_b
BF16] read from inside the fused row, o_proj 8 x 4096 x 2048 FP8 and a second rank's 4 groups by
col0, the absorbed query 64 x 512 x 256 and the value projection 64 x 256 x 512 in BF16) and at
awkward ones (k = 1088: a partial last column block; k = 64: one superblock; k = 1024 with few rows:
k split four ways and the splits summed by proj_reduce, as fused_in's eight; rows that fill no warp
tile nor block, placed by row0; several tiles and slices).

Every buffer is poisoned with a guard after it (tests/batch_proj_util.py Bufs). Each test checks:
- the PTX against the host twin on the same inputs: ``dot_bound(..., roundings=2)`` (two f32
  accumulations of k products and two roundings: the tensor core adds each k16 step in its own
  order), plus one BF16 ulp on each normalised input for the norm (summed in another order);
- batch invariance: every row of an m-row launch is bit-identical to a launch of that row alone,
  at m in 1, 3, 17, 64, 200 (one to four tiles) and in a shuffled order.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_proj_fp8_util import OProj, Seg, bgemv_fp8_bound, fp8_tensor, seg_columns, seg_gemv_bound
from batch_proj_util import EPS, Bufs
from kernel_util import abs_dot, assert_dot_close, dot_bound, no_poison, random_bf16, same_bits
from proj_mma_util import proj_heads, proj_seg

from model.kernels import proj_mma as pm
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend
from runtime.kernels.rmsnorm import rmsnorm_ref

pytestmark = pytest.mark.gpu

HIDDEN = 4096
M_AWKWARD = (1, 3, 17, 64, 200)


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_proj_mma"


def build_case(rng, name: str):
    """(segments, y_stride, k, x_stride, x_off)."""
    if name == "fused_in":
        kv, kvs = fp8_tensor(rng, 576, HIDDEN)
        qa, qas = fp8_tensor(rng, 1536, HIDDEN)
        segs = [
            Seg(kv[:512], 0, kvs),
            Seg(random_bf16(rng, (256, HIDDEN), exp_lo=-8), 512),
            Seg(qa, 768, qas),
            Seg(random_bf16(rng, (32, HIDDEN), exp_lo=-8), 2304),
        ]
        return segs, 2336, HIDDEN, HIDDEN, 0
    if name == "q_proj":
        qb, qbs = fp8_tensor(rng, 16384, 1536)
        segs = [Seg(qb[8192:], 0, qbs, 8192), Seg(random_bf16(rng, (4096, 1536), exp_lo=-8), 8192)]
        return segs, 8192 + 4096, 1536, 2336, 768
    k = {"k1088": 1088, "k64": 64, "k1024_split": 1024}[name]
    q1, s1 = fp8_tensor(rng, 8, k)
    q2, s2 = fp8_tensor(rng, 300, k)
    segs = [
        Seg(q1, 0, s1),
        Seg(random_bf16(rng, (37, k), exp_lo=-8), 9),
        Seg(q2[100:240], 50, s2, 100),
        Seg(random_bf16(rng, (5, k), exp_lo=-8), 191),
    ]
    return segs, 200, k, k + 8, 8


def check_launch(y: np.ndarray, segs: list[Seg], y_stride: int, what: str) -> None:
    c = np.zeros(y_stride, bool)
    for sg in segs:
        c[sg.col : sg.col + sg.rows] = True
    no_poison(y[:, c], what)
    assert (y[:, ~c].view(np.uint16) == 0xFFFF).all(), f"{what}: a column no segment covers was written"


@pytest.mark.parametrize("case", ["fused_in", "q_proj", "k1088", "k64", "k1024_split"])
def test_segments_against_twin(cuda, case):
    rng = np.random.default_rng()
    segs, ys, k, x_stride, x_off = build_case(rng, case)
    for m in (1, 3, 17):
        x, nw = random_bf16(rng, (m, x_stride)), random_bf16(rng, k, exp_lo=-1)
        g = proj_seg(cuda, x, k, nw, segs, ys, x_off=x_off)
        h = proj_seg(HostBackend(), x, k, nw, segs, ys, x_off=x_off)
        check_launch(g, segs, ys, f"proj_mma {case} m={m}")
        xn = rmsnorm_ref(x[:, x_off : x_off + k], nw, EPS)
        for i, (gc, hc, sg) in enumerate(zip(seg_columns(g, segs), seg_columns(h, segs), segs)):
            ref = hc.astype(np.float64)
            assert_dot_close(
                gc, ref, seg_gemv_bound(xn, sg.dequant(), ref, k), f"proj_mma {case} m={m} seg {i}"
            )


@pytest.mark.parametrize(
    "case,ms",
    [
        ("k1088", M_AWKWARD),
        ("k64", M_AWKWARD),
        ("k1024_split", M_AWKWARD),
        ("fused_in", (3, 64)),
        ("q_proj", (17, 200)),
    ],
)
def test_segment_rows_are_bit_identical_alone(cuda, case, ms):
    rng = np.random.default_rng()
    segs, ys, k, x_stride, x_off = build_case(rng, case)
    nw = random_bf16(rng, k, exp_lo=-1)
    for m in ms:
        x = random_bf16(rng, (m, x_stride))
        got = proj_seg(cuda, x, k, nw, segs, ys, x_off=x_off)
        check_launch(got, segs, ys, f"proj_mma {case} m={m}")
        alone = proj_seg(cuda, x, k, nw, segs, ys, x_off=x_off, single=True)
        same_bits(got, alone, f"proj_mma {case} m={m} vs its rows alone")
        perm = rng.permutation(m)
        same_bits(
            proj_seg(cuda, x[perm], k, nw, segs, ys, x_off=x_off), alone[perm], f"proj_mma {case} shuffled"
        )


def _heads_case(rng, name: str):
    """(w, scales, col0, out_f32)."""
    if name == "o_proj":
        o = OProj.random(rng, heads=8, n=HIDDEN, k=2048)
        return o, True
    if name == "o_proj_rank1":
        o = OProj.random(rng, heads=4, n=HIDDEN, k=2048, col0=4 * 2048)
        return o, True
    if name == "o_awkward":  # rows that fill no block, a col0 inside a scale block
        o = OProj.random(rng, heads=3, n=200, k=192, col0=64, extra_cols=64)
        return o, False
    shape, out_f32 = {"wk_t": ((64, 512, 256), True), "wv": ((64, 256, 512), False)}[name]
    return random_bf16(rng, shape, exp_lo=-6), out_f32


@pytest.mark.parametrize("case", ["o_proj", "o_proj_rank1", "o_awkward", "wk_t", "wv"])
def test_heads_against_twin_and_alone(cuda, case):
    rng = np.random.default_rng()
    w, out_f32 = _heads_case(rng, case)
    fp8 = isinstance(w, OProj)
    heads, n, k = w.shape
    kw = dict(out_f32=out_f32, scales=w.scales, col0=w.col0) if fp8 else dict(out_f32=out_f32)
    wq = w.q if fp8 else w
    for m in (1, 3, 17, 64, 200) if heads * n * k < 80_000_000 else (1, 17, 64):
        x = random_bf16(rng, (m, heads, k))
        g = proj_heads(cuda, wq, x, x_pad=8, y_pad=4, **kw)
        alone = proj_heads(cuda, wq, x, single=True, **kw)
        same_bits(g, alone, f"proj_mma {case} m={m} vs its rows alone")
        if m <= 17:
            h = proj_heads(HostBackend(), wq, x, **kw)
            ref = h.astype(np.float64)
            if fp8:
                bound = bgemv_fp8_bound(w, x, ref, out_f32)
            else:
                absd = np.stack([abs_dot(x[:, i], w[i]) for i in range(heads)], axis=1)
                bound = 4.0 * k * 2.0**-24 * absd + 1e-30 if out_f32 else dot_bound(absd, ref, k, roundings=2)
            assert_dot_close(g, ref, bound, f"proj_mma {case} m={m}")


def test_rmsnorm_rows_batch_against_twin(cuda):
    rng = np.random.default_rng()
    for k, xs in ((4096, 4096), (1536, 2336), (40, 48)):
        x, nw = random_bf16(rng, (17, xs)), random_bf16(rng, k, exp_lo=-1)
        with Bufs(cuda) as b:
            px, pw, po = b.put(x), b.put(nw), b.poison(17 * (k + 8) * 2)
            pm.rmsnorm_rows_batch(
                cuda, x=px, x_stride=xs, norm_w=pw, out=po, out_stride=k + 8, m=17, k=k, eps=EPS
            )
            out = b.get(po).view(BF16).reshape(17, k + 8)
        assert (out[:, k:].view(np.uint16) == 0xFFFF).all()
        ref = rmsnorm_ref(x[:, :k], nw, EPS).astype(np.float64)
        got = out[:, :k].astype(np.float64)
        # One BF16 ulp: the device sums the squares in another order than NumPy's mean.
        assert (np.abs(got - ref) <= 2.0**-7 * np.abs(ref) + 1e-30).all(), f"rmsnorm_rows_batch k={k}"


def test_embed_norm_flags_against_twin(cuda):
    from embed_flags_util import embed_flags_case

    for flag_byte in (0, 3):
        g_out, g_flags = embed_flags_case(cuda, 2, flag_byte)
        h_out, h_flags = embed_flags_case(HostBackend(), 2, flag_byte)
        np.testing.assert_array_equal(g_flags, h_flags)
        assert (g_out[3].view(np.uint16) == 0xFFFF).all(), "a padding entry's row was written"
        live = np.isfinite(h_out.astype(np.float32))
        assert (np.isfinite(g_out.astype(np.float32)) == live).all()
        ref = h_out.astype(np.float64)[live]
        # One BF16 ulp: the device sums the squares in another order than NumPy's mean.
        assert (np.abs(g_out.astype(np.float64)[live] - ref) <= 2.0**-7 * np.abs(ref) + 1e-30).all()
