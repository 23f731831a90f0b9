"""The batched projection kernels' PTX (gemv_bf16_batch, mtp_input_gemv_batch, mtp_embed_norm_batch,
bgemv_bf16_{f32,bf16}_batch(_beside), sum_rows_residual(_rmsnorm)_batch) on the device, at the
GLM-5.3-Flash shapes (eh_proj 4096 x 8192, wk_t 64 x 512 x 256, wv 64 x 256 x 512,
o_proj 8 x 4096 x 2048, hidden 4096) and at awkward ones (k = 72, k % 8 != 0, misaligned rows,
strides that misalign every other row, n not a multiple of a warp's rows).

Every buffer is poisoned (0xFF) with a guard after it (tests/batch_proj_util.py), so an unwritten
output shows as NaN and a write past the end, into a padding row or into a flag byte it must not
touch, shows too. Each test checks:

- the PTX against the host twin on the same inputs, within the stated tolerances:
  GEMVs ``dot_bound(..., roundings=2)`` (kernel_util.py), those with a norm prologue plus one BF16
  ulp on each normalised input (the device sums the squares in another order); bgemv's f32 output
  the accumulation bound alone; the row sums and flags exact; normed rows one BF16 ulp plus 2**-12
  of the row's largest value;
- batch invariance: every row of an m-row launch is bit-identical to a launch of that row alone
  (m = 1, pointers at the row), at m in 1, 3, 17, 64, 200 (where the shape allows) and in a
  shuffled order;
- padding entries: their output rows and their flag words untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_proj_util import (
    EPS,
    Bufs,
    MtpCase,
    bf16_rows,
    bgemv,
    gemv_batch,
    gemv_single,
    mtp_embed_norm,
    mtp_input,
    norm_gemv_bound,
    sum_rows,
)
from kernel_util import abs_dot, assert_dot_close, dot_bound, no_poison, random_bf16, same_bits

from runtime.host_backend import HostBackend
from runtime.kernels.gemv_bf16 import gemv_bf16
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
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_batch_proj"


def rows_close_bf16(g: np.ndarray, h: np.ndarray, what: str) -> None:
    g32, h32 = np.asarray(g, np.float32), np.asarray(h, np.float32)
    assert not np.isnan(g32).any(), f"{what}: NaN (unwritten) elements"
    tol = 2.0**-7 * np.abs(h32) + np.abs(h32).max(axis=-1, keepdims=True) * 2.0**-12
    bad = np.abs(g32 - h32) > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements outside one BF16 ulp"


# ---- gemv_bf16_batch -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m,n,k,mis",
    [(3, HIDDEN, 2 * HIDDEN, 0), (17, 20480, 1536, 0), (200, 37, 72, 0), (17, 101, 70, 0), (9, 33, 64, 2)],
)
def test_gemv_batch_against_twin(cuda, m, n, k, mis):
    """eh_proj's shape (catch-up rows), the q projection's, k = 72, k % 8 != 0 and a misaligned x
    (the element-wise path)."""
    rng = np.random.default_rng()
    w, x = random_bf16(rng, (n, k)), random_bf16(rng, (m, k), exp_lo=-2)
    g, h = gemv_batch(cuda, w, x, mis), gemv_batch(HostBackend(), w, x, mis)
    ref = h.astype(np.float64)
    assert_dot_close(g, ref, dot_bound(abs_dot(x, w), ref, k, roundings=2), f"gemv_bf16_batch {m}x{n}x{k}")


@pytest.mark.parametrize(
    "n,k,ms",
    [
        (300, 520, M_AWKWARD),
        (37, 72, M_AWKWARD),
        (45, 70, (3, 17, 200)),  # the element-wise path
        (HIDDEN, 2 * HIDDEN, (17, 64)),
        (20480, 1536, (3, 64)),
    ],
)
def test_gemv_batch_rows_are_bit_identical_alone(cuda, n, k, ms):
    rng = np.random.default_rng()
    w = random_bf16(rng, (n, k))
    for m in ms:
        x = random_bf16(rng, (m, k), exp_lo=-2)
        alone = gemv_single(cuda, w, x)
        got = gemv_batch(cuda, w, x)
        no_poison(got, f"gemv_bf16_batch m={m}")
        same_bits(got, alone, f"gemv_bf16_batch m={m} n={n} k={k}")
        perm = rng.permutation(m)
        same_bits(gemv_batch(cuda, w, x[perm]), alone[perm], f"gemv_bf16_batch m={m} shuffled")


@pytest.mark.parametrize("n,k", [(HIDDEN, 2 * HIDDEN), (37, 72), (45, 70)])
def test_gemv_batch_is_todays_gemv_bf16(cuda, n, k):
    """A chunk of 8 rows and single rows are gemv_bf16's own m paths: the same bits."""
    rng = np.random.default_rng()
    w, x = random_bf16(rng, (n, k)), random_bf16(rng, (11, k), exp_lo=-2)
    got = gemv_batch(cuda, w, x)
    with Bufs(cuda) as b:
        pw, px, py = b.put(w), b.put(x), b.poison(11 * n * 2)
        gemv_bf16(cuda, pw, px, py, 8, n, k)
        gemv_bf16(cuda, pw, px.offset(8 * k * 2), py.offset(8 * n * 2), 3, n, k)
        same_bits(got, bf16_rows(b.get(py), 11), "gemv_bf16_batch vs gemv_bf16 (m = 8, then 3)")
        b.reset(py)
        for e in range(11):
            gemv_bf16(cuda, pw, px.offset(e * k * 2), py.offset(e * n * 2), 1, n, k)
        same_bits(got, bf16_rows(b.get(py), 11), "gemv_bf16_batch vs gemv_bf16 (m = 1)")


# ---- mtp_input_gemv_batch --------------------------------------------------------------------------


def _mtp_case(rng, m, n, h, vocab=1000, flag_byte=1):
    """m entries with a few padding ones, out-of-vocabulary tokens and non-finite hidden rows."""
    pick = rng.permutation(m)
    pad = pick[: m // 6].tolist()
    bad_tok = [(int(e), t) for e, t in zip(pick[m // 6 : m // 6 + m // 8], [vocab, 2**32 - 1] * 99)]
    bad_hid = [(int(e), v) for e, v in zip(pick[m - m // 8 :], [np.nan, np.inf, -np.inf] * 99)]
    return MtpCase(rng, m, n, h, vocab, pad=pad, bad_token=bad_tok, bad_hidden=bad_hid, flag_byte=flag_byte)


def _check_mtp_against_twin(c: MtpCase, gy, gf, hy, hf, what):
    assert gf.tobytes() == hf.tobytes(), f"{what}: flags differ from the twin's"
    live = c.live
    assert (gy[~live].view(np.uint16) == 0xFFFF).all(), f"{what}: a padding entry's row was written"
    words = gf.reshape(c.m, 4)
    assert (words[~live] == 0xA5).all(), f"{what}: a padding entry's flag word was written"
    bad = words[:, c.flag_byte] != 0xA5
    assert not bad[~live].any()
    good = live & ~bad
    assert np.isnan(gy[bad].astype(np.float32)).all(), f"{what}: a flagged row is not NaN"
    if good.any():
        t = c.entries[good, 2]
        xn = np.concatenate(
            [rmsnorm_ref(c.table[t], c.enorm, EPS), rmsnorm_ref(c.hidden[good], c.hnorm, EPS)], axis=1
        )
        ref = hy[good].astype(np.float64)
        assert_dot_close(gy[good], ref, norm_gemv_bound(xn, c.w, ref, 2 * c.h), what)


@pytest.mark.parametrize(
    "m,n,h,mis",
    [
        (3, HIDDEN, HIDDEN, 0),  # eh_proj
        (17, HIDDEN, HIDDEN, 0),
        (5, 37, 40, 0),
        (9, 19, 37, 0),  # h % 8 != 0: element-wise paths
        (4, 300, 64, 2),  # misaligned hidden rows: the norms' element-wise path
        (12, 5000, 64, 0),  # two rows per warp
        (6, 20000, 40, 0),  # four rows per warp, more than one wave
    ],
)
def test_mtp_input_batch_against_twin(cuda, m, n, h, mis):
    rng = np.random.default_rng()
    c = _mtp_case(rng, m, n, h, flag_byte=int(rng.integers(4)))
    gy, gf = mtp_input(cuda, c, mis=mis)
    hy, hf = mtp_input(HostBackend(), c, mis=mis)
    _check_mtp_against_twin(c, gy, gf, hy, hf, f"mtp_input_gemv_batch m={m} n={n} h={h}")


@pytest.mark.parametrize("n,h,ms", [(300, 64, M_AWKWARD), (70, 37, (3, 17)), (HIDDEN, HIDDEN, (17, 64))])
def test_mtp_input_batch_rows_are_bit_identical_alone(cuda, n, h, ms):
    """Padding, bad tokens and non-finite hidden rows among the entries; shuffled too."""
    rng = np.random.default_rng()
    for m in ms:
        c = _mtp_case(rng, m, n, h, flag_byte=2)
        y, f = mtp_input(cuda, c)
        y1, f1 = mtp_input(cuda, c, single=True)
        same_bits(y, y1, f"mtp_input_gemv_batch m={m} n={n} h={h}")
        same_bits(f, f1, f"mtp_input_gemv_batch flags m={m}")
        live = c.live
        no_poison(y[live & (f.reshape(m, 4)[:, 2] == 0xA5)], f"mtp_input_gemv_batch m={m}")
        assert (y[~live].view(np.uint16) == 0xFFFF).all() and (f.reshape(m, 4)[~live] == 0xA5).all()
        perm = rng.permutation(m)
        ys, fs = mtp_input(cuda, c.shuffled(perm))
        same_bits(ys, y[perm], f"mtp_input_gemv_batch m={m} shuffled")
        same_bits(fs.reshape(m, 4), f.reshape(m, 4)[perm], f"mtp_input_gemv_batch flags m={m} shuffled")


@pytest.mark.parametrize("n,h", [(HIDDEN, HIDDEN), (37, 40), (19, 37)])
def test_mtp_input_batch_nine_rows_are_the_rows_alone(cuda, n, h):
    """A chunk of 8 and one more, no padding: every row and flag byte as its entry launched alone."""
    rng = np.random.default_rng()
    m = 9
    c = _mtp_case(rng, m, n, h, flag_byte=3)
    c.entries[:, 0] = np.arange(m)
    y, f = mtp_input(cuda, c)
    y1, f1 = mtp_input(cuda, c, single=True)
    same_bits(y, y1, "mtp_input_gemv_batch vs its rows alone")
    same_bits(f, f1, "mtp_input_gemv_batch flags vs its rows alone")


@pytest.mark.parametrize("h,mis", [(HIDDEN, 0), (37, 0), (4104, 0), (HIDDEN, 2)])
def test_mtp_embed_norm_batch(cuda, h, mis):
    rng = np.random.default_rng()
    for m in M_AWKWARD:
        c = MtpCase(rng, m, 1, h, 1001, pad=[m - 1] if m > 1 else [], bad_token=[(0, 1001)] if m > 2 else [])
        g = mtp_embed_norm(cuda, c, mis=mis)
        same_bits(g, mtp_embed_norm(cuda, c, single=True, mis=mis), f"mtp_embed_norm_batch m={m} h={h}")
        hh = mtp_embed_norm(HostBackend(), c, mis=mis)
        live, ok = c.live, c.live & (c.entries[:, 2] < 1001)
        assert (g[~live].view(np.uint16) == 0xFFFF).all(), "a padding entry's row was written"
        rows_close_bf16(g[ok], hh[ok], f"mtp_embed_norm_batch m={m}")
        rows_close_bf16(g[live, h:], hh[live, h:], f"mtp_embed_norm_batch hidden halves m={m}")
        assert np.isnan(g[live & ~ok, :h].astype(np.float32)).all()


# ---- bgemv_batch ---------------------------------------------------------------------------------------

_BGEMV_SHAPES = [
    (64, 512, 256, 0),  # wk_t
    (64, 256, 512, 0),  # wv
    (8, HIDDEN, 2048, 0),  # o_proj in 8 head groups
    (3, 37, 29, 0),  # k % 8 != 0: element-wise path
    (5, 33, 24, 2),  # misaligned x
    (2, 1, 8, 0),
]
_MODES = [(True, False), (True, True), (False, False)]
_MODE_IDS = ["f32", "f32-beside", "bf16"]


def _bgemv_bound(w, x, ref, out_f32):
    k = w.shape[2]
    absd = np.stack([abs_dot(x[:, h], w[h]) for h in range(w.shape[0])], axis=1)
    return 2.0 * 2 * k * 2.0**-24 * absd + 1e-30 if out_f32 else dot_bound(absd, ref, k, roundings=2)


@pytest.mark.parametrize("out_f32,beside", _MODES, ids=_MODE_IDS)
@pytest.mark.parametrize("heads,n,k,mis", _BGEMV_SHAPES)
def test_bgemv_batch_against_twin(cuda, heads, n, k, mis, out_f32, beside):
    rng = np.random.default_rng()
    w = random_bf16(rng, (heads, n, k))
    for m in (3, 17):
        x = random_bf16(rng, (m, heads, k), exp_lo=-2)
        g = bgemv(cuda, w, x, out_f32=out_f32, beside=beside, mis=mis)
        hy = bgemv(HostBackend(), w, x, out_f32=out_f32, beside=beside, mis=mis)
        ref = hy.astype(np.float64)
        assert_dot_close(g, ref, _bgemv_bound(w, x, ref, out_f32), f"bgemv_batch m={m} {heads}x{n}x{k}")


@pytest.mark.parametrize("out_f32,beside", _MODES, ids=_MODE_IDS)
@pytest.mark.parametrize(
    "heads,n,k,mis,ms",
    [
        (3, 70, 256, 0, M_AWKWARD),  # 16 rows per warp, n not a multiple of them
        (2, 40, 304, 0, M_AWKWARD),  # 8 rows per warp
        (4, 33, 520, 0, M_AWKWARD),  # 4 rows per warp
        (2, 21, 6400, 0, (3, 17)),  # 8 rows of x too long to stage in shared memory: read from L2
        (3, 37, 29, 0, (3, 17, 200)),  # element-wise path
        (2, 20, 64, 2, (3, 17)),  # misaligned x
        (64, 512, 256, 0, (17, 64)),  # wk_t
        (8, HIDDEN, 2048, 0, (17,)),  # o_proj
    ],
)
def test_bgemv_batch_rows_are_bit_identical_alone(cuda, heads, n, k, mis, ms, out_f32, beside):
    rng = np.random.default_rng()
    w = random_bf16(rng, (heads, n, k))
    for m in ms:
        x = random_bf16(rng, (m, heads, k), exp_lo=-2)
        got = bgemv(cuda, w, x, out_f32=out_f32, beside=beside, mis=mis)
        no_poison(got, f"bgemv_batch m={m}")
        alone = bgemv(cuda, w, x, out_f32=out_f32, beside=beside, single=True, mis=mis)
        same_bits(got, alone, f"bgemv_batch m={m} {heads}x{n}x{k}")
        perm = rng.permutation(m)
        same_bits(bgemv(cuda, w, x[perm], out_f32=out_f32, beside=beside, mis=mis), alone[perm], "shuffled")


@pytest.mark.parametrize("out_f32,beside", _MODES, ids=_MODE_IDS)
@pytest.mark.parametrize("heads,n,k,mis", _BGEMV_SHAPES)
def test_bgemv_batch_nine_rows_are_the_rows_alone(cuda, heads, n, k, mis, out_f32, beside):
    """Row e of a 9-row batch (a chunk of 8, then one) against that row launched alone."""
    rng = np.random.default_rng()
    m = 9
    w, x = random_bf16(rng, (heads, n, k)), random_bf16(rng, (m, heads, k), exp_lo=-2)
    got = bgemv(cuda, w, x, out_f32=out_f32, beside=beside, mis=mis)
    alone = bgemv(cuda, w, x, out_f32=out_f32, beside=beside, mis=mis, single=True)
    same_bits(got, alone, "bgemv_batch vs its rows alone")


# ---- sum_rows_residual(_rmsnorm)_batch -----------------------------------------------------------------


@pytest.mark.parametrize("rows,n", [(8, HIDDEN), (9, HIDDEN), (1, 37), (3, 1000), (2, 4104)])
def test_sum_rows_batch(cuda, rows, n):
    """out bit-exact against the twin (f32 adds in row order), normed within one BF16 ulp; every
    row bit-identical alone."""
    rng = np.random.default_rng()
    for m in M_AWKWARD:
        parts = rng.standard_normal((m, rows, n)).astype(np.float32)
        res, nw = random_bf16(rng, (m, n), exp_lo=-1), random_bf16(rng, n, exp_lo=-1)
        g = sum_rows(cuda, parts, res)
        h = sum_rows(HostBackend(), parts, res)
        same_bits(g, h, f"sum_rows_residual_batch m={m} vs twin")
        same_bits(g, sum_rows(cuda, parts, res, single=True), f"sum_rows_residual_batch m={m} alone")
        go, gn = sum_rows(cuda, parts, res, nw)
        ho, hn = sum_rows(HostBackend(), parts, res, nw)
        same_bits(go, ho, f"sum_rows_residual_rmsnorm_batch out m={m} vs twin")
        rows_close_bf16(gn, hn, f"sum_rows_residual_rmsnorm_batch normed m={m}")
        so, sn = sum_rows(cuda, parts, res, nw, single=True)
        same_bits(go, so, f"sum_rows_residual_rmsnorm_batch out m={m} alone")
        same_bits(gn, sn, f"sum_rows_residual_rmsnorm_batch normed m={m} alone")
