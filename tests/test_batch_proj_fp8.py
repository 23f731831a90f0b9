"""Host twins of the FP8 block-scaled projections (model/kernels/bgemv_fp8.py: rmsnorm_gemv_seg_batch,
bgemv_fp8_batch) on the host backend, at awkward shapes:

- against direct NumPy float64 math on the dequantised weights, within the stated bounds
  (kernel_util.py): partial blocks (k and rows not multiples of 128: kv_a's 512 rows of 576, 8 rows,
  130 columns), scale rows placed by row0 (a rank's q_b heads), head columns that start inside a
  block (o_proj groups of a width that is not a multiple of 128, col0 of a later rank);
- the twin's formula itself: block partials in float32, times the block scale, added in block order;
- mixed BF16 / FP8 segments in one launch equal to separate launches, bit for bit, with the columns
  no segment covers left untouched;
- BF16 segments only: bit for bit gemv_bf16_ref of the rmsnorm_ref rows (f32 accumulation of the
  BF16 products), and batch-invariant for rows past NumPy's reduction buffer;
- batch invariance, exactly: every row of an m-row launch is the row launched alone, at m in 1, 3,
  17, 64, 200 and shuffled;
- the refusals (a clear ValueError before anything is launched);
- on the committed PTX, the PDL contracts and the L2 reads the launch order relies on.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from batch_proj_fp8_util import (
    OProj,
    Seg,
    bgemv_fp8,
    bgemv_fp8_bound,
    dequant64,
    dequant_checkpoint,
    fp8_tensor,
    seg_columns,
    seg_gemv,
    seg_gemv_bound,
)
from batch_proj_util import EPS
from kernel_util import abs_dot, assert_dot_close, download, random_bf16, same_bits

from model.kernels import bgemv_fp8 as bf
from runtime.dtypes import BF16
from runtime.kernel import Pdl
from runtime.kernels.gemv_bf16 import gemv_bf16_ref
from runtime.kernels.rmsnorm import rmsnorm_ref

M_AWKWARD = (1, 3, 17, 64, 200)


def rms64(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 RMSNorm of rows, rounded to BF16 as the kernels store it."""
    x64 = np.asarray(x, np.float64)
    r = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS)
    return (x64 / r * np.asarray(w, np.float64)).astype(BF16)


def untouched(y: np.ndarray, cols: np.ndarray, what: str) -> None:
    assert (y[:, cols].view(np.uint16) == 0xFFFF).all(), f"{what}: a column no segment covers was written"


def check_against_float64(y, x, k, x_off, nw, segs, what):
    """Every segment's columns within the bound of float64 math on the dequantised weights."""
    xn = rms64(x[:, x_off : x_off + k], nw)
    for i, (got, sg) in enumerate(zip(seg_columns(y, segs), segs)):
        w64 = sg.dequant()
        ref = xn.astype(np.float64) @ w64.T
        assert_dot_close(got, ref, seg_gemv_bound(xn, w64, ref, k), f"{what} segment {i}")


# ---- the formula ---------------------------------------------------------------------------------------


def test_fp8_block_dot_is_the_stated_formula():
    """Block partials in float32 (each a float32 dot), times the scale, added in block order in
    float32: the twin's function against that formula written out per element, bit for bit, at a
    row0 and a base that start inside a block."""
    rng = np.random.default_rng(1)
    q, s = fp8_tensor(rng, 300, 700)
    row0, rows, base, k = 140, 37, 200, 330
    qs = q[row0 : row0 + rows, base : base + k]
    x = random_bf16(rng, (3, k), exp_lo=-2)
    got = bf.fp8_block_dot(x, qs, s, row0=row0, base=base)
    xf, qf = x.astype(np.float32), qs.astype(np.float32)
    for i in range(3):
        for r in (0, 1, 17, 36):
            acc = np.float32(0)
            for b in range(base // 128, (base + k - 1) // 128 + 1):
                lo, hi = max(0, 128 * b - base), min(k, 128 * (b + 1) - base)
                part = (xf[i, lo:hi] * qf[r, lo:hi]).sum(dtype=np.float32)
                acc = np.float32(acc + np.float32(part * s[(row0 + r) // 128, b]))
            assert got[i, r].tobytes() == acc.tobytes(), (i, r, got[i, r], acc)


def test_fp8_block_dot_matches_float64_and_the_loader():
    """Against float64 on the exact dequantisation, and the dequantisation against the loader's
    (model/checkpoint/fp8.py dequantize)."""
    rng = np.random.default_rng(2)
    q, s = fp8_tensor(rng, 260, 390)
    x = random_bf16(rng, (4, 390), exp_lo=-2)
    w64 = dequant64(q, s)
    np.testing.assert_allclose(dequant_checkpoint(q, s), w64, rtol=2.0**-23, atol=0)
    ref = x.astype(np.float64) @ w64.T
    got = bf.fp8_block_dot(x, q, s)
    assert_dot_close(got, ref, 2 * 390 * 2.0**-24 * abs_dot(x, w64) + 1e-30, "fp8_block_dot")


# ---- rmsnorm_gemv_seg_batch ----------------------------------------------------------------------------


def _kv_a_case(rng, k):
    """kv_a: the 512 rows of a 576-row FP8 tensor (its scales [5, ceil(k / 128)])."""
    q, s = fp8_tensor(rng, 576, k)
    return Seg(q[:512], 0, s, 0)


@pytest.mark.parametrize(
    "k,x_stride,x_off,case",
    [
        (4096, 4096, 0, "kv_a"),  # 512 of 576 rows, four full scale rows of a five-row grid
        (130, 130, 0, "eight"),  # 8 rows, a partial column block of 2
        (200, 300, 60, "row0"),  # rows 140..239 of a 300-row tensor (a rank's q_b heads)
        (72, 80, 8, "mixed"),  # FP8 and BF16 segments with gaps between their columns
    ],
)
@pytest.mark.parametrize("beside", [False, True])
def test_rmsnorm_gemv_seg_against_float64(host, k, x_stride, x_off, case, beside):
    rng = np.random.default_rng(k + x_off)
    if case == "kv_a":
        segs = [_kv_a_case(rng, k)]
    elif case == "eight":
        q, s = fp8_tensor(rng, 8, k)
        segs = [Seg(q, 3, s)]
    elif case == "row0":
        q, s = fp8_tensor(rng, 300, k)
        segs = [Seg(q[140:240], 0, s, 140)]
    else:
        q1, s1 = fp8_tensor(rng, 150, k)
        q2, s2 = fp8_tensor(rng, 40, k)
        segs = [
            Seg(q1[7:137], 0, s1, 7),
            Seg(random_bf16(rng, (21, k), exp_lo=-8), 133),
            Seg(q2, 160, s2),
            Seg(random_bf16(rng, (5, k), exp_lo=-8), 200),
        ]
    y_stride = max(sg.col + sg.rows for sg in segs) + 3
    for m in (1, 5):
        x, nw = random_bf16(rng, (m, x_stride)), random_bf16(rng, k, exp_lo=-1)
        y = seg_gemv(host, x, k, nw, segs, y_stride, x_off=x_off, beside=beside)
        check_against_float64(y, x, k, x_off, nw, segs, f"rmsnorm_gemv_seg_batch {case} m={m}")
        covered = np.zeros(y_stride, bool)
        for sg in segs:
            covered[sg.col : sg.col + sg.rows] = True
        untouched(y, ~covered, case)


def _fused_in_case(rng, k=256):
    """fused_in's layout at a small k: [kv_a (FP8, 64 of 72 rows) ; wk + compress_gate (BF16) ;
    q_a (FP8) ; weights_proj + pad (BF16)]."""
    kv, kvs = fp8_tensor(rng, 72, k)
    qa, qas = fp8_tensor(rng, 96, k)
    return [
        Seg(kv[:64], 0, kvs),
        Seg(random_bf16(rng, (32, k), exp_lo=-8), 64),
        Seg(qa, 96, qas),
        Seg(random_bf16(rng, (8, k), exp_lo=-8), 192),
    ]


@pytest.mark.parametrize("m", [1, 3, 17])
def test_mixed_segments_in_one_launch_are_separate_launches(host, m):
    rng = np.random.default_rng(m)
    k = 256
    segs = _fused_in_case(rng, k)
    x, nw = random_bf16(rng, (m, k)), random_bf16(rng, k, exp_lo=-1)
    one = seg_gemv(host, x, k, nw, segs, 200)
    apart = seg_gemv(host, x, k, nw, segs, 200, order=[[0], [1], [2], [3]])
    same_bits(one, apart, f"one launch vs four m={m}")
    pairs = seg_gemv(host, x, k, nw, segs, 200, order=[[3, 1], [2, 0]])
    same_bits(one, pairs, f"one launch vs two m={m}")
    check_against_float64(one, x, k, 0, nw, segs, f"fused_in m={m}")


@pytest.mark.parametrize("n,k,x_stride,x_off", [(37, 29, 29, 0), (20, 48, 100, 52), (9, 4096, 4096, 0)])
@pytest.mark.parametrize("beside", [False, True])
def test_bf16_segments_are_the_bf16_formula(host, n, k, x_stride, x_off, beside):
    """One segment of all the rows, and the rows cut into three segments in another order: bit for
    bit gemv_bf16_ref (f32 accumulation of the BF16 products, one rounding) of the rmsnorm_ref rows."""
    rng = np.random.default_rng(n + k)
    w, nw = random_bf16(rng, (n, k), exp_lo=-8), random_bf16(rng, k, exp_lo=-1)
    for m in (1, 3, 17):
        x = random_bf16(rng, (m, x_stride))
        ref = gemv_bf16_ref(w, rmsnorm_ref(x[:, x_off : x_off + k], nw, EPS))
        whole = seg_gemv(host, x, k, nw, [Seg(w, 0)], n, x_off=x_off, beside=beside)
        same_bits(whole, ref, f"one BF16 segment vs the formula m={m}")
        a, b = n // 3, 2 * n // 3
        cut = [Seg(w[b:], b), Seg(w[:a], 0), Seg(w[a:b], a)]
        same_bits(seg_gemv(host, x, k, nw, cut, n, x_off=x_off, beside=beside), ref, f"three segments m={m}")


def test_bf16_segment_long_rows_are_batch_invariant(host):
    """Rows past NumPy's 8192-element reduction buffer: the twin's norm still sums each row alone."""
    rng = np.random.default_rng(9)
    n, k = 3, 9000
    x, nw = random_bf16(rng, (5, k)), random_bf16(rng, k, exp_lo=-1)
    segs = [Seg(random_bf16(rng, (n, k), exp_lo=-8), 0)]
    y = seg_gemv(host, x, k, nw, segs, n)
    same_bits(y, seg_gemv(host, x, k, nw, segs, n, single=True), "one BF16 segment k=9000 vs alone")


@pytest.mark.parametrize("m", M_AWKWARD)
def test_rmsnorm_gemv_seg_is_batch_invariant(host, m):
    """Mixed segments, each row's input a slice of a wider row: every row alone, and shuffled."""
    rng = np.random.default_rng(100 + m)
    k, x_stride, x_off = 136, 150, 6
    q, s = fp8_tensor(rng, 200, k)
    segs = [Seg(q[50:190], 0, s, 50), Seg(random_bf16(rng, (11, k), exp_lo=-8), 141)]
    x, nw = random_bf16(rng, (m, x_stride)), random_bf16(rng, k, exp_lo=-1)
    y = seg_gemv(host, x, k, nw, segs, 160, x_off=x_off)
    same_bits(y, seg_gemv(host, x, k, nw, segs, 160, x_off=x_off, single=True), f"m={m} vs alone")
    perm = rng.permutation(m)
    same_bits(seg_gemv(host, x[perm], k, nw, segs, 160, x_off=x_off), y[perm], f"m={m} shuffled")
    check_against_float64(y, x, k, x_off, nw, segs, f"rmsnorm_gemv_seg_batch m={m}")


def test_rmsnorm_gemv_seg_refusals(host):
    p = host.alloc(4096)
    bf16 = bf.GemvSegment(w=p, scales=None, rows=4, col=0)
    fp8 = bf.GemvSegment(w=p, scales=p, rows=4, col=4)
    host.memset(p, 0xA5, 4096)
    kw = dict(x=p, x_stride=8, norm_w=p, y=p, y_stride=8, m=1, k=8, eps=EPS)

    def refused(match, **over):
        with pytest.raises(ValueError, match=match):
            bf.rmsnorm_gemv_seg_batch(host, **{**kw, "segments": [bf16, fp8], **over})

    refused("segments", segments=[])
    refused(
        "5 segments", segments=[bf.GemvSegment(w=p, scales=None, rows=1, col=i) for i in range(5)], y_stride=8
    )
    refused("overlap", segments=[bf16, bf.GemvSegment(w=p, scales=p, rows=4, col=3)])
    refused("y_stride", y_stride=7)
    refused("x_stride", x_stride=7)
    refused("m=0", m=0)
    refused("m=257", m=257)
    refused("GemvSegment", segments=[bf16, "not a segment"])
    with pytest.raises(ValueError, match="rows=0"):
        bf.GemvSegment(w=p, scales=p, rows=0, col=0)
    with pytest.raises(ValueError, match="block size"):
        bf.GemvSegment(w=p, scales=p, rows=4, col=0, block=(64, 64))
    with pytest.raises(ValueError, match="row0"):
        bf.GemvSegment(w=p, scales=None, rows=4, col=0, row0=128)
    with pytest.raises(ValueError, match="col"):
        bf.GemvSegment(w=p, scales=None, rows=4, col=-1)
    with pytest.raises(ValueError, match="integer"):
        bf.GemvSegment(w=p, scales=None, rows=True, col=0)
    assert (download(host, p, np.uint8, 4096) == 0xA5).all(), "a refused launch wrote"
    host.free(p)


# ---- bgemv_fp8_batch ---------------------------------------------------------------------------------


_BGEMV_SHAPES = [
    (2, 300, 256, 0),  # whole blocks of columns, a partial block of rows (300 = 2 * 128 + 44)
    (3, 130, 72, 0),  # groups of 72 columns: heads 1 and 2 start inside a block
    (2, 40, 96, 200),  # a later rank's groups: col0 inside a block
    (3, 37, 29, 5),  # k % 16 != 0: the element path's shape
]


@pytest.mark.parametrize("heads,n,k,col0", _BGEMV_SHAPES)
@pytest.mark.parametrize("out_f32,beside", [(True, False), (True, True), (False, False)])
def test_bgemv_fp8_against_float64(host, heads, n, k, col0, out_f32, beside):
    rng = np.random.default_rng(heads * n + k + col0)
    o = OProj.random(rng, heads, n, k, col0, extra_cols=50)
    for m in (1, 4):
        x = random_bf16(rng, (m, heads, k), exp_lo=-2)
        y = bgemv_fp8(host, o, x, out_f32=out_f32, beside=beside, x_pad=3, y_pad=5)
        ref = np.stack([x[:, h].astype(np.float64) @ o.dequant(h).T for h in range(heads)], axis=1)
        bound = bgemv_fp8_bound(o, x, ref, out_f32, roundings=1)
        assert_dot_close(y, ref, bound, f"bgemv_fp8_batch m={m} {heads}x{n}x{k} col0={col0}")
        if beside:
            same_bits(y, bgemv_fp8(host, o, x, out_f32=True, x_pad=3, y_pad=5), "beside vs wait")


def test_bgemv_fp8_is_fp8_block_dot_per_head(host):
    """Head h of a launch is fp8_block_dot of its columns (base col0 + h * k) of the full tensor."""
    rng = np.random.default_rng(7)
    o = OProj.random(rng, 3, 50, 72, 40)
    x = random_bf16(rng, (5, 3, 72), exp_lo=-2)
    y = bgemv_fp8(host, o, x, out_f32=True)
    for h in range(3):
        same_bits(y[:, h], bf.fp8_block_dot(x[:, h], o.q[h], o.scales, base=40 + 72 * h), f"head {h}")


@pytest.mark.parametrize("m", M_AWKWARD)
@pytest.mark.parametrize("out_f32", [True, False])
def test_bgemv_fp8_is_batch_invariant(host, m, out_f32):
    rng = np.random.default_rng(m)
    o = OProj.random(rng, 3, 13, 72, 24)
    x = random_bf16(rng, (m, 3, 72), exp_lo=-2)
    y = bgemv_fp8(host, o, x, out_f32=out_f32)
    same_bits(y, bgemv_fp8(host, o, x, out_f32=out_f32, single=True), f"bgemv_fp8_batch m={m}")
    perm = rng.permutation(m)
    same_bits(bgemv_fp8(host, o, x[perm], out_f32=out_f32), y[perm], f"bgemv_fp8_batch m={m} shuffled")


def test_bgemv_fp8_refusals(host):
    p = host.alloc(4096)
    host.memset(p, 0xA5, 4096)
    kw = dict(
        w=p, scales=p, scale_cols=2, col0=0, x=p, x_stride=256, y=p, y_stride=8, m=1, heads=2, n=4, k=128
    )

    def refused(match, **over):
        with pytest.raises(ValueError, match=match):
            bf.bgemv_fp8_batch(host, **{**kw, "out_f32": True, **over})

    refused("beside", out_f32=False, beside=True)
    refused("scale_cols", scale_cols=1)
    refused("scale_cols", col0=1)  # columns 1..256 span three blocks
    refused("block size", block=(128, 64))
    refused("strides", x_stride=255)
    refused("strides", y_stride=7)
    refused("m=0", m=0)
    refused("shape", n=0)
    refused("col0", col0=-1)
    assert (download(host, p, np.uint8, 4096) == 0xA5).all(), "a refused launch wrote"
    host.free(p)


# ---- the PTX: PDL contracts, L2 reads of early-released outputs ------------------------------

# Each kernel's PDL contract and writes, as the kernels it replaces (model/kernels/bgemv.py) have
# them: the drafter's launch order relies on them (ptx/common.cuh).
_CONTRACT = [
    (bf.RMSNORM_GEMV_SEG_BATCH, Pdl.WAIT, False),
    (bf.RMSNORM_GEMV_SEG_BATCH_BESIDE, Pdl.BESIDE, False),
    (bf.RMSNORM_GEMV_SEG_BF16_BATCH, Pdl.WAIT, False),
    (bf.RMSNORM_GEMV_SEG_BF16_BATCH_BESIDE, Pdl.BESIDE, False),
    (bf.BGEMV_FP8_F32_BATCH, Pdl.WAIT, True),
    (bf.BGEMV_FP8_F32_BATCH_BESIDE, Pdl.BESIDE, False),
    (bf.BGEMV_FP8_BF16_BATCH, Pdl.WAIT, True),
]


@pytest.mark.parametrize("decl,pdl,releases", _CONTRACT, ids=lambda d: getattr(d, "function", ""))
def test_each_kernel_keeps_its_pdl_contract(decl, pdl, releases):
    assert (decl.pdl, decl.releases, decl.writes) == (pdl, releases, ("y",))


def _body(function: str) -> str:
    from test_pdl_ptx import entry_body

    return entry_body("bgemv_fp8", function)


@pytest.mark.parametrize("function", ["bgemv_fp8_f32_batch", "bgemv_fp8_bf16_batch"])
def test_o_proj_reads_its_input_through_l2(function):
    """o_proj runs after wv, which releases its dependents early: x (BF16 quads, staged chunks or
    elements) never through the read-only path; the weights stream through the no-allocate loads
    and the scales through the read-only path."""
    body = _body(function)
    for form in (r"ld\.global\.nc\.v[24]\.u32\s", r"ld\.global\.nc\.u16\s", r"ld\.global\.nc\.b16\s"):
        hit = re.search(form, body)
        assert hit is None, f"{function} reads x through the read-only path: {hit.group(0)!r}"
    assert "ld.global.cg.v2.u32" in body and "ld.global.cg.v4.u32" in body
    assert "ld.global.nc.L1::no_allocate.v4.u32" in body and re.search(r"ld\.global\.nc\.f32\s", body)


def test_the_beside_kernels_read_x_through_the_read_only_path():
    """The checks above would pass vacuously if the forms never matched."""
    assert re.search(r"ld\.global\.nc\.v2\.u32\s", _body("bgemv_fp8_f32_batch_beside"))
    for f in ("rmsnorm_gemv_seg_batch", "rmsnorm_gemv_seg_bf16_batch_beside"):
        assert re.search(r"ld\.global\.nc\.v4\.u32\s", _body(f)), f


def test_the_bf16_kernels_have_no_fp8_path():
    """rmsnorm_gemv_seg_bf16_batch(_beside) are compiled without the FP8 dot (no E4M3 conversion),
    the general kernels with it."""
    for f in ("rmsnorm_gemv_seg_bf16_batch", "rmsnorm_gemv_seg_bf16_batch_beside"):
        assert "e4m3x2" not in _body(f), f
    for f in ("rmsnorm_gemv_seg_batch", "rmsnorm_gemv_seg_batch_beside", "bgemv_fp8_f32_batch"):
        assert "cvt.rn.f16x2.e4m3x2" in _body(f), f
