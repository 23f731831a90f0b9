"""The FP8 block-scaled projections' PTX (ptx/bgemv_fp8.cu: rmsnorm_gemv_seg_batch(_beside),
rmsnorm_gemv_seg_bf16_batch(_beside), bgemv_fp8_{f32,bf16}_batch(_beside)) on the device, at the
GLM-5.3-Flash shapes (fused_in 2336 x 4096 as [kv_a FP8 512 of 576 ; wk + compress_gate BF16 256 ;
q_a FP8 1536 ; weights_proj BF16 32], the q projection 20480 x 1536 as [q_b FP8 16384 ; wq_b BF16
4096] read from inside the fused row, a rank's half of q_b by row0, o_proj 8 x 4096 x 2048 and a
second rank's 4 groups by col0) and at awkward ones (k = 1040: a partial last column block; k = 130
and 72: the element path; rows not filling a block; o_proj groups of 144 and 72 columns that start
inside a block; misaligned weights and activations).

Every buffer is poisoned (0xFF) with a guard after it (tests/batch_proj_util.py Bufs), so an unwritten
output shows as NaN, a column no segment covers keeps its poison, and a write past the end breaks the
guard. Each test checks:

- the PTX against the host twin on the same inputs: ``dot_bound(..., roundings=2)`` (kernel_util.py:
  two f32 accumulations of k products and two roundings; the GPU adds a block's products in its own
  order, the blocks in the twin's) plus one BF16 ulp on each normalised input for the norm prologue
  (the device sums the squares in another order); f32 outputs the accumulation bound alone;
- batch invariance: every row of an m-row launch is bit-identical to a launch of that row alone
  (m = 1, pointers at the row), at m in 1, 3, 17, 64, 200 and in a shuffled order;
- BF16 segments: one segment and the same rows cut into three segments give the same bits, and a
  BF16 segment among FP8 ones (the general kernel) the bits of that matrix through the BF16 kernel;
- mixed segments in one launch: bit for bit the same segments in separate launches.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_proj_fp8_util import (
    OProj,
    Seg,
    bgemv_fp8,
    bgemv_fp8_bound,
    fp8_tensor,
    seg_columns,
    seg_gemv,
    seg_gemv_bound,
)
from batch_proj_util import EPS
from kernel_util import assert_dot_close, no_poison, random_bf16, same_bits

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
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_batch_proj_fp8"


def covered(segs: list[Seg], y_stride: int) -> np.ndarray:
    c = np.zeros(y_stride, bool)
    for sg in segs:
        c[sg.col : sg.col + sg.rows] = True
    return c


def check_launch(y: np.ndarray, segs: list[Seg], y_stride: int, what: str) -> None:
    """Every covered column written (finite inputs give finite outputs), every other one untouched."""
    c = covered(segs, y_stride)
    no_poison(y[:, c], what)
    assert (y[:, ~c].view(np.uint16) == 0xFFFF).all(), f"{what}: a column no segment covers was written"


# ---- the cases ---------------------------------------------------------------------------------------


def fused_in_case(rng) -> tuple[list[Seg], int]:
    """GLM-5.3-Flash's fused_in: kv_a FP8 (512 of its 576 rows), wk + compress_gate BF16 (2 x 128),
    q_a FP8 (1536), weights_proj BF16 (32): 2336 rows, k = 4096."""
    kv, kvs = fp8_tensor(rng, 576, HIDDEN)
    qa, qas = fp8_tensor(rng, 1536, HIDDEN)
    return [
        Seg(kv[:512], 0, kvs),
        Seg(random_bf16(rng, (256, HIDDEN), exp_lo=-8), 512),
        Seg(qa, 768, qas),
        Seg(random_bf16(rng, (32, HIDDEN), exp_lo=-8), 2304),
    ], 2336


def q_proj_case(rng, ranks: int = 1) -> tuple[list[Seg], int]:
    """The q projection: this rank's q_b heads (FP8, rank 1 of ``ranks``: rows placed by row0 in the
    full 16384-row tensor's scales) and wq_b (BF16, 32 x 128), k = 1536."""
    qb, qbs = fp8_tensor(rng, 16384, 1536)
    hl = 16384 // ranks
    r0 = (ranks - 1) * hl
    return [Seg(qb[r0 : r0 + hl], 0, qbs, r0), Seg(random_bf16(rng, (4096, 1536), exp_lo=-8), hl)], hl + 4096


def awkward_case(rng, k: int, mis: int = 0) -> tuple[list[Seg], int]:
    """Rows that do not fill a block (8; rows 140..239 of 300), BF16 between them, gaps between the
    columns; ``mis`` misaligns the weights (the element paths)."""
    q1, s1 = fp8_tensor(rng, 8, k)
    q2, s2 = fp8_tensor(rng, 300, k)
    return [
        Seg(q1, 0, s1, 0, mis),
        Seg(random_bf16(rng, (37, k), exp_lo=-8), 9, mis=2 * (mis > 0)),
        Seg(q2[140:240], 50, s2, 140, mis),
        Seg(random_bf16(rng, (5, k), exp_lo=-8), 151),
    ], 160


def tall_case(rng, k: int) -> tuple[list[Seg], int]:
    """More FP8 rows than a one-row launch has warps on the H200 (132 x 4 blocks of 8), so its warps
    take rows row and row + warps as a pair, each with its own scale row (rows 50 .. 6049 of a
    6100-row tensor), at k = 1040 (a partial last column block), then BF16 rows, which a warp's
    last FP8 rows do not pair with."""
    q, s = fp8_tensor(rng, 6100, k)
    return [Seg(q[50:6050], 0, s, 50), Seg(random_bf16(rng, (40, k), exp_lo=-8), 6000)], 6040


def build_case(rng, name: str):
    """(segments, y_stride, k, x_stride, x_off) of a named case."""
    if name == "fused_in":
        segs, ys = fused_in_case(rng)
        return segs, ys, HIDDEN, HIDDEN, 0
    if name == "q_proj":
        segs, ys = q_proj_case(rng)
        return segs, ys, 1536, 2336, 768
    if name == "q_proj_rank1":
        segs, ys = q_proj_case(rng, ranks=2)
        return segs, ys, 1536, 2336, 768
    if name == "k1040_tall":
        segs, ys = tall_case(rng, 1040)
        return segs, ys, 1040, 1048, 8
    k, mis = {"k1040": (1040, 0), "k130": (130, 0), "k72": (72, 0), "k256_mis": (256, 1)}[name]
    segs, ys = awkward_case(rng, k, mis)
    return segs, ys, k, k + 8, 8


_CASES = ["fused_in", "q_proj", "q_proj_rank1", "k1040", "k1040_tall", "k130", "k72", "k256_mis"]


# ---- rmsnorm_gemv_seg_batch ----------------------------------------------------------------------------


@pytest.mark.parametrize("beside", [False, True], ids=["wait", "beside"])
@pytest.mark.parametrize("case", _CASES)
def test_rmsnorm_gemv_seg_against_twin(cuda, case, beside):
    rng = np.random.default_rng()
    segs, ys, k, x_stride, x_off = build_case(rng, case)
    for m in (1, 3, 17):
        x, nw = random_bf16(rng, (m, x_stride)), random_bf16(rng, k, exp_lo=-1)
        g = seg_gemv(cuda, x, k, nw, segs, ys, x_off=x_off, beside=beside)
        h = seg_gemv(HostBackend(), x, k, nw, segs, ys, x_off=x_off, beside=beside)
        check_launch(g, segs, ys, f"rmsnorm_gemv_seg_batch {case} m={m}")
        xn = rmsnorm_ref(x[:, x_off : x_off + k], nw, EPS)
        for i, (gc, hc, sg) in enumerate(zip(seg_columns(g, segs), seg_columns(h, segs), segs)):
            ref = hc.astype(np.float64)
            bound = seg_gemv_bound(xn, sg.dequant(), ref, k)
            assert_dot_close(gc, ref, bound, f"rmsnorm_gemv_seg_batch {case} m={m} segment {i}")


@pytest.mark.parametrize("beside", [False, True], ids=["wait", "beside"])
@pytest.mark.parametrize(
    "case,ms",
    [
        ("k1040", M_AWKWARD),
        ("k130", M_AWKWARD),
        ("k256_mis", (3, 17)),
        ("q_proj", (17, 64)),
        ("k1040_tall", (9, 17)),
        ("fused_in", (3, 17)),
    ],
)
def test_rmsnorm_gemv_seg_rows_are_bit_identical_alone(cuda, case, ms, beside):
    rng = np.random.default_rng()
    segs, ys, k, x_stride, x_off = build_case(rng, case)
    nw = random_bf16(rng, k, exp_lo=-1)
    for m in ms:
        x = random_bf16(rng, (m, x_stride))
        got = seg_gemv(cuda, x, k, nw, segs, ys, x_off=x_off, beside=beside)
        check_launch(got, segs, ys, f"rmsnorm_gemv_seg_batch {case} m={m}")
        alone = seg_gemv(cuda, x, k, nw, segs, ys, x_off=x_off, beside=beside, single=True)
        same_bits(got, alone, f"rmsnorm_gemv_seg_batch {case} m={m} vs its rows alone")
        perm = rng.permutation(m)
        shuffled = seg_gemv(cuda, x[perm], k, nw, segs, ys, x_off=x_off, beside=beside)
        same_bits(shuffled, alone[perm], f"rmsnorm_gemv_seg_batch {case} m={m} shuffled")


@pytest.mark.parametrize("case", ["fused_in", "k1040", "k130", "k256_mis"])
def test_mixed_segments_in_one_launch_are_separate_launches(cuda, case):
    """One launch of all the segments, one launch per segment (an FP8 one alone runs the general
    kernel, a BF16 one the BF16 kernel), and two launches of two: the same bits."""
    rng = np.random.default_rng()
    segs, ys, k, x_stride, x_off = build_case(rng, case)
    nw = random_bf16(rng, k, exp_lo=-1)
    for m in (1, 9):
        x = random_bf16(rng, (m, x_stride))
        one = seg_gemv(cuda, x, k, nw, segs, ys, x_off=x_off)
        apart = seg_gemv(cuda, x, k, nw, segs, ys, x_off=x_off, order=[[i] for i in range(len(segs))])
        same_bits(one, apart, f"{case} m={m}: one launch vs one per segment")
        pairs = seg_gemv(cuda, x, k, nw, segs, ys, x_off=x_off, order=[[3, 0], [2, 1]])
        same_bits(one, pairs, f"{case} m={m}: one launch vs two")


# (n, k, x_stride, x_off, x_mis): fused_in, the q projection inside the fused row, short rows, and
# x_stride % 8 != 0 (every other row misaligned), a misaligned x.
_BF16_SHAPES = [
    (2336, HIDDEN, HIDDEN, 0, 0),
    (20480, 1536, 2336, 768, 0),
    (37, 29, 29, 0, 0),
    (100, 48, 52, 2, 0),
    (40, 72, 72, 0, 2),
]


@pytest.mark.parametrize("beside", [False, True], ids=["wait", "beside"])
@pytest.mark.parametrize("n,k,x_stride,x_off,mis", _BF16_SHAPES)
def test_bf16_segments_against_twin_and_alone(cuda, n, k, x_stride, x_off, mis, beside):
    """BF16 segments only (the BF16 kernel): one segment of all the rows within the twin's bound
    (at m = 1 and 17), every row of it bit for bit that row launched alone and in a shuffled order,
    and the rows cut into three segments launched in another order bit for bit the one segment."""
    rng = np.random.default_rng()
    w, nw = random_bf16(rng, (n, k), exp_lo=-8), random_bf16(rng, k, exp_lo=-1)
    whole_seg = [Seg(w, 0)]
    a, b = n // 3, 2 * n // 3
    cut = [Seg(w[b:], b), Seg(w[:a], 0), Seg(w[a:b], a)]
    for m in M_AWKWARD if n < 10000 else (1, 17):
        x = random_bf16(rng, (m, x_stride))
        whole = seg_gemv(cuda, x, k, nw, whole_seg, n, x_off=x_off, beside=beside, mis=mis)
        no_poison(whole, f"one BF16 segment m={m} n={n} k={k}")
        if m in (1, 17):
            h = seg_gemv(HostBackend(), x, k, nw, whole_seg, n, x_off=x_off, beside=beside, mis=mis)
            ref = h.astype(np.float64)
            bound = seg_gemv_bound(
                rmsnorm_ref(x[:, x_off : x_off + k], nw, EPS), w.astype(np.float64), ref, k
            )
            assert_dot_close(whole, ref, bound, f"one BF16 segment vs twin m={m} n={n} k={k}")
        alone = seg_gemv(cuda, x, k, nw, whole_seg, n, x_off=x_off, beside=beside, mis=mis, single=True)
        same_bits(whole, alone, f"one BF16 segment m={m} n={n} k={k} vs its rows alone")
        perm = rng.permutation(m)
        shuffled = seg_gemv(cuda, x[perm], k, nw, whole_seg, n, x_off=x_off, beside=beside, mis=mis)
        same_bits(shuffled, alone[perm], f"one BF16 segment m={m} n={n} k={k} shuffled")
        parts = seg_gemv(cuda, x, k, nw, cut, n, x_off=x_off, beside=beside, mis=mis)
        same_bits(parts, whole, f"three BF16 segments vs one m={m} n={n} k={k}")


@pytest.mark.parametrize("beside", [False, True], ids=["wait", "beside"])
@pytest.mark.parametrize("case", ["fused_in", "q_proj", "k1040", "k130", "k72"])
def test_bf16_rows_among_fp8_segments_are_the_bf16_kernels(cuda, case, beside):
    """The general kernel (one row: its f32-staged input) gives each BF16 segment's rows the bits
    the BF16 kernel gives that matrix launched alone."""
    rng = np.random.default_rng()
    segs, ys, k, x_stride, x_off = build_case(rng, case)
    nw = random_bf16(rng, k, exp_lo=-1)
    for m in (1, 3, 9):
        x = random_bf16(rng, (m, x_stride))
        y = seg_gemv(cuda, x, k, nw, segs, ys, x_off=x_off, beside=beside)
        for i, sg in enumerate(segs):
            if sg.scales is None and not sg.mis:
                alone = seg_gemv(cuda, x, k, nw, [Seg(sg.w, 0)], sg.rows, x_off=x_off, beside=beside)
                no_poison(alone, f"{case} m={m} BF16 segment {i} alone")
                same_bits(y[:, sg.col : sg.col + sg.rows], alone, f"{case} m={m} BF16 segment {i}")


# ---- bgemv_fp8_batch ---------------------------------------------------------------------------------

# (heads, n, k, col0, x_mis): o_proj in 8 groups; a second rank's 4 groups; rows not filling a block
# with heads starting mid-block (144 columns: offsets of 1, 2, 3 chunks); 72 columns (the element path);
# a misaligned x (the element path); one row of one head.
_BGEMV_SHAPES = [
    (8, HIDDEN, 2048, 0, 0),
    (4, HIDDEN, 2048, 4 * 2048, 0),
    (3, 300, 144, 16, 0),
    (2, 130, 256, 64, 0),
    (3, 130, 72, 40, 0),
    (2, 33, 64, 0, 2),
    (1, 1, 16, 0, 0),
]
_MODES = [(True, False), (True, True), (False, False)]
_MODE_IDS = ["f32", "f32-beside", "bf16"]


@pytest.mark.parametrize("out_f32,beside", _MODES, ids=_MODE_IDS)
@pytest.mark.parametrize("heads,n,k,col0,mis", _BGEMV_SHAPES)
def test_bgemv_fp8_against_twin(cuda, heads, n, k, col0, mis, out_f32, beside):
    rng = np.random.default_rng()
    o = OProj.random(rng, heads, n, k, col0, extra_cols=100)
    for m in (1, 3, 17):
        x = random_bf16(rng, (m, heads, k), exp_lo=-2)
        g = bgemv_fp8(cuda, o, x, out_f32=out_f32, beside=beside, mis=mis, x_pad=8, y_pad=3)
        h = bgemv_fp8(HostBackend(), o, x, out_f32=out_f32, beside=beside, mis=mis, x_pad=8, y_pad=3)
        ref = h.astype(np.float64)
        bound = bgemv_fp8_bound(o, x, ref, out_f32)
        assert_dot_close(g, ref, bound, f"bgemv_fp8_batch m={m} {heads}x{n}x{k} col0={col0}")


@pytest.mark.parametrize("out_f32,beside", _MODES, ids=_MODE_IDS)
@pytest.mark.parametrize(
    "heads,n,k,col0,mis,ms",
    [
        (3, 70, 256, 0, 0, M_AWKWARD),
        (2, 40, 144, 16, 0, M_AWKWARD),  # heads starting 1 and 10 chunks into a block
        (3, 37, 72, 8, 0, (3, 17, 200)),  # the element path
        (2, 20, 64, 0, 2, (3, 17)),  # misaligned x
        (2, 21, 6400, 0, 0, (3, 17)),  # 8 rows of x too long to stage: read from L2
        (8, HIDDEN, 2048, 0, 0, (17,)),  # o_proj
    ],
)
def test_bgemv_fp8_rows_are_bit_identical_alone(cuda, heads, n, k, col0, mis, ms, out_f32, beside):
    rng = np.random.default_rng()
    o = OProj.random(rng, heads, n, k, col0)
    for m in ms:
        x = random_bf16(rng, (m, heads, k), exp_lo=-2)
        got = bgemv_fp8(cuda, o, x, out_f32=out_f32, beside=beside, mis=mis)
        no_poison(got.reshape(m, -1), f"bgemv_fp8_batch m={m}")
        alone = bgemv_fp8(cuda, o, x, out_f32=out_f32, beside=beside, mis=mis, single=True)
        same_bits(got, alone, f"bgemv_fp8_batch m={m} {heads}x{n}x{k} vs its rows alone")
        perm = rng.permutation(m)
        shuffled = bgemv_fp8(cuda, o, x[perm], out_f32=out_f32, beside=beside, mis=mis)
        same_bits(shuffled, alone[perm], f"bgemv_fp8_batch m={m} shuffled")


@pytest.mark.parametrize("heads,n,k,col0", [(8, HIDDEN, 2048, 0), (3, 130, 72, 40)])
def test_bgemv_fp8_beside_is_the_waiting_kernel(cuda, heads, n, k, col0):
    rng = np.random.default_rng()
    o = OProj.random(rng, heads, n, k, col0)
    for m in (1, 9):
        x = random_bf16(rng, (m, heads, k), exp_lo=-2)
        same_bits(
            bgemv_fp8(cuda, o, x, out_f32=True, beside=True),
            bgemv_fp8(cuda, o, x, out_f32=True),
            f"bgemv_fp8_batch beside vs wait m={m}",
        )
