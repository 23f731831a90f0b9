"""Host twins of the batched projection kernels (gemv_bf16_batch, mtp_input_gemv_batch,
mtp_embed_norm_batch, bgemv_batch, sum_rows_residual(_rmsnorm)_batch), on the
host backend at awkward sizes:

- at m = 1 against direct NumPy float64 math and the kernels' flag and NaN rules;
- against direct NumPy float64 math within the stated bounds (kernel_util.py);
- batch invariance, exactly: row e of an m-row launch is bit-identical to a launch of that row
  alone, for m in 1, 3, 17, 64, 200 and in shuffled orders;
- padding entries: their output rows and flag bytes are left as they were, and the other bytes of
  their flag words too.

And, on the committed PTX, that each batched kernel keeps its PDL contract and reads what an
early-releasing predecessor may still write through L2 (as tests/test_pdl_ptx.py checks the others).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from batch_proj_util import (
    EPS,
    MtpCase,
    bgemv,
    gemv_batch,
    gemv_single,
    mtp_embed_norm,
    mtp_input,
    sum_rows,
)
from kernel_util import (
    abs_dot,
    assert_dot_close,
    dot_bound,
    download,
    poisoned,
    random_bf16,
    same_bits,
    upload,
)

from model.kernels import bgemv as bg
from model.kernels import mtp_input as mi
from model.kernels.mtp_input import HIDDEN_NONFINITE, TOKEN_OUTSIDE
from runtime.dtypes import BF16
from runtime.kernel import Pdl
from runtime.kernels import gemv_bf16 as gv
from runtime.kernels.rmsnorm import rmsnorm_ref

M_AWKWARD = (1, 3, 17, 64, 200)


def rms64(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 RMSNorm of rows, rounded to BF16 as the kernels store it."""
    x64 = np.asarray(x, np.float64)
    r = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS)
    return (x64 / r * np.asarray(w, np.float64)).astype(BF16)


def norm_bound(xn: np.ndarray, w: np.ndarray, ref: np.ndarray, k: int) -> np.ndarray:
    """The twin (one f32 norm, one f32 dot, one rounding) against float64: the dot bound plus one
    BF16 ulp on each normalised input element (the twin's f32 norm may round it the other way)."""
    absd = abs_dot(np.atleast_2d(xn), w)
    return dot_bound(absd, ref, k) + 2.0**-7 * absd


# ---- gemv_bf16_batch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(37, 64), (19, 29), (5, 4101), (1, 1)])
def test_gemv_batch_at_m1_is_gemv_bf16(host, n, k):
    rng = np.random.default_rng(n * 31 + k)
    w, x = random_bf16(rng, (n, k)), random_bf16(rng, (1, k), exp_lo=-2)
    pw, px, py = upload(host, w), upload(host, x), poisoned(host, n * 2)
    gv.gemv_bf16(host, pw, px, py, 1, n, k)
    same_bits(gemv_batch(host, w, x), download(host, py, BF16, (1, n)), f"gemv m=1 n={n} k={k}")
    for p in (pw, px, py):
        host.free(p)


@pytest.mark.parametrize("m,n,k", [(3, 37, 64), (17, 21, 29), (9, 5, 1000)])
def test_gemv_batch_matches_float64(host, m, n, k):
    rng = np.random.default_rng(m + n + k)
    w, x = random_bf16(rng, (n, k)), random_bf16(rng, (m, k), exp_lo=-2)
    y = gemv_batch(host, w, x)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert_dot_close(y, ref, dot_bound(abs_dot(x, w), ref, k), f"gemv_bf16_batch m={m}")


@pytest.mark.parametrize("m", M_AWKWARD)
def test_gemv_batch_rows_are_batch_invariant(host, m):
    rng = np.random.default_rng(m)
    n, k = 23, 72
    w, x = random_bf16(rng, (n, k)), random_bf16(rng, (m, k), exp_lo=-2)
    alone = gemv_single(host, w, x)
    same_bits(gemv_batch(host, w, x), alone, f"gemv_bf16_batch m={m}")
    perm = rng.permutation(m)
    same_bits(gemv_batch(host, w, x[perm]), alone[perm], f"gemv_bf16_batch m={m} shuffled")


def test_gemv_batch_refuses_m_outside_range(host):
    p = host.alloc(64)
    for m in (0, gv.MAX_BATCH + 1):
        with pytest.raises(ValueError, match="m="):
            gv.gemv_bf16_batch(host, p, p, p, m, 1, 1)
    host.free(p)


# ---- mtp_input_gemv_batch / mtp_embed_norm_batch -------------------------------------------------------


@pytest.mark.parametrize(
    "n,h,token", [(37, 40, 3), (19, 37, 999), (33, 64, 1000), (40, 16, 2**32 - 1), (300, 8, 7)]
)
@pytest.mark.parametrize("flag_byte", [0, 3])
def test_mtp_input_batch_at_m1_formula_and_flag(host, n, h, token, flag_byte):
    """One entry: y = W @ [rmsnorm(table[token]) * enorm ; rmsnorm(hidden) * hnorm] within the
    bound; an out-of-vocabulary token gives NaN rows and TOKEN_OUTSIDE, a good one leaves the flag
    byte alone; the other bytes of the flag word are never written."""
    rng = np.random.default_rng(n + h)
    c = MtpCase(rng, 1, n, h, 1000, bad_token=[(0, token)], flag_byte=flag_byte)
    y, flags = mtp_input(host, c)
    assert np.delete(flags, flag_byte).tolist() == [0xA5] * 3, "the other bytes of the word are untouched"
    if token >= 1000:
        assert flags[flag_byte] == TOKEN_OUTSIDE and np.isnan(y.astype(np.float32)).all()
        return
    assert flags[flag_byte] == 0xA5, "a good entry leaves its flag byte alone"
    xn = np.concatenate([rms64(c.table[c.entries[:, 2]], c.enorm), rms64(c.hidden, c.hnorm)], axis=1)
    ref = xn.astype(np.float64) @ c.w.astype(np.float64).T
    assert_dot_close(y, ref, norm_bound(xn, c.w, ref, 2 * h), f"mtp_input m=1 n={n} h={h} token={token}")


def test_mtp_input_batch_matches_float64(host):
    rng = np.random.default_rng(5)
    m, n, h = 6, 45, 40
    c = MtpCase(rng, m, n, h, 500)
    y, _ = mtp_input(host, c)
    xn = np.concatenate([rms64(c.table[c.entries[:, 2]], c.enorm), rms64(c.hidden, c.hnorm)], axis=1)
    ref = xn.astype(np.float64) @ c.w.astype(np.float64).T
    assert_dot_close(y, ref, norm_bound(xn, c.w, ref, 2 * h), "mtp_input_gemv_batch")


@pytest.mark.parametrize("m", M_AWKWARD)
def test_mtp_input_batch_rows_are_batch_invariant(host, m):
    """Row e of an m-entry launch equals entry e launched alone, with padding, out-of-vocabulary
    tokens and non-finite hidden rows among the entries, in the given order and shuffled; padding
    entries' rows and flag bytes are never written."""
    rng = np.random.default_rng(100 + m)
    n, h, vocab = 21, 24, 300
    pick = rng.permutation(m)
    pad = set(pick[: m // 5].tolist())
    bad_tok = [(int(e), vocab + int(e)) for e in pick[m // 5 : m // 5 + max(1, m // 9)]]
    bad_hid = [(int(e), v) for e, v in zip(pick[-max(1, m // 7) :], [np.nan, np.inf, -np.inf] * 99)]
    c = MtpCase(rng, m, n, h, vocab, pad=pad, bad_token=bad_tok, bad_hidden=bad_hid, flag_byte=2)
    y, flags = mtp_input(host, c)
    y1, f1 = mtp_input(host, c, single=True)
    same_bits(y, y1, f"mtp_input_gemv_batch m={m}")
    same_bits(flags, f1, f"mtp_input_gemv_batch flags m={m}")
    live = c.live
    assert (y[~live].view(np.uint16) == 0xFFFF).all(), "a padding entry's row is never written"
    words = flags.reshape(m, 4)
    assert (words[~live] == 0xA5).all(), "a padding entry's flag word is never written"
    assert (np.delete(words, 2, axis=1) == 0xA5).all(), "only byte flag_byte of a word is written"
    want = np.full(m, 0xA5, np.uint8)
    for e, _ in bad_tok:
        want[e] = TOKEN_OUTSIDE
    for e, _ in bad_hid:
        want[e] = (want[e] if want[e] != 0xA5 else 0) | HIDDEN_NONFINITE
    want[~live] = 0xA5
    assert words[:, 2].tolist() == want.tolist()
    perm = rng.permutation(m)
    ys, fs = mtp_input(host, c.shuffled(perm))
    same_bits(ys, y[perm], f"mtp_input_gemv_batch m={m} shuffled")
    same_bits(fs.reshape(m, 4), words[perm], f"mtp_input_gemv_batch flags m={m} shuffled")


@pytest.mark.parametrize("m", [1, 3, 17])
def test_mtp_embed_norm_batch(host, m):
    """Row e equals a launch of entry e alone and the float64 norms of its token's embedding and its
    hidden row, a bad token gives a NaN half, a padding entry's row stays as it was."""
    rng = np.random.default_rng(m)
    h, vocab = 37, 100
    pad = {m - 1} if m > 1 else set()
    c = MtpCase(rng, m, 1, h, vocab, pad=pad, bad_token=[(0, vocab)] if m > 1 else [])
    out = mtp_embed_norm(host, c)
    same_bits(out, mtp_embed_norm(host, c, single=True), f"mtp_embed_norm_batch m={m}")
    live = c.live
    assert (out[~live].view(np.uint16) == 0xFFFF).all(), "a padding entry's row is never written"
    tokens = c.entries[:, 2]
    ok = live & (tokens < vocab)
    ref = np.concatenate(
        [rms64(c.table[np.minimum(tokens, vocab - 1)], c.enorm), rms64(c.hidden, c.hnorm)], axis=1
    )
    err = np.abs(out[ok].astype(np.float64) - ref[ok].astype(np.float64))
    assert (err <= 2.0**-7 * np.abs(ref[ok].astype(np.float64)) + 1e-30).all()
    assert np.isnan(out[live & (tokens >= vocab), :h].astype(np.float32)).all()


# ---- bgemv_batch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,n,k", [(3, 37, 29), (2, 1, 8), (4, 20, 256)])
@pytest.mark.parametrize("out_f32,beside", [(True, False), (True, True), (False, False)])
def test_bgemv_batch_at_m1_matches_float64(host, heads, n, k, out_f32, beside):
    """One row: each head within the bound of float64 math, the beside variant's bits the waiting one's."""
    rng = np.random.default_rng(heads + n + k)
    w, x = random_bf16(rng, (heads, n, k)), random_bf16(rng, (1, heads, k), exp_lo=-2)
    y = bgemv(host, w, x, out_f32=out_f32, beside=beside)
    if beside:
        same_bits(y, bgemv(host, w, x, out_f32=out_f32), "bgemv_batch beside vs wait")
    for h in range(heads):
        ref = x[:, h].astype(np.float64) @ w[h].astype(np.float64).T
        absd = abs_dot(x[:, h], w[h])
        bound = k * 2.0**-24 * absd * 2 + 1e-30 if out_f32 else dot_bound(absd, ref, k)
        assert_dot_close(y[:, h], ref, bound, f"bgemv_batch m=1 head {h}")


@pytest.mark.parametrize("m", M_AWKWARD)
@pytest.mark.parametrize("out_f32", [True, False])
def test_bgemv_batch_is_batch_invariant_and_exact(host, m, out_f32):
    rng = np.random.default_rng(m)
    heads, n, k = 3, 13, 40
    w, x = random_bf16(rng, (heads, n, k)), random_bf16(rng, (m, heads, k), exp_lo=-2)
    y = bgemv(host, w, x, out_f32=out_f32)
    same_bits(y, bgemv(host, w, x, out_f32=out_f32, single=True), f"bgemv_batch m={m}")
    perm = rng.permutation(m)
    same_bits(bgemv(host, w, x[perm], out_f32=out_f32), y[perm], f"bgemv_batch m={m} shuffled")
    for h in range(heads):
        ref = x[:, h].astype(np.float64) @ w[h].astype(np.float64).T
        absd = abs_dot(x[:, h], w[h])
        bound = k * 2.0**-24 * absd * 2 + 1e-30 if out_f32 else dot_bound(absd, ref, k)
        assert_dot_close(y[:, h], ref, bound, f"bgemv_batch m={m} head {h}")


def test_bgemv_batch_refuses_beside_bf16(host):
    p = host.alloc(64)
    with pytest.raises(ValueError, match="beside"):
        bg.bgemv_batch(host, w=p, x=p, y=p, m=1, heads=1, n=1, k=8, out_f32=False, beside=True)
    host.free(p)


# ---- sum_rows_residual(_rmsnorm)_batch -------------------------------------------------------------------


@pytest.mark.parametrize("m", M_AWKWARD)
@pytest.mark.parametrize("rows,n", [(9, 64), (1, 37), (3, 100)])
def test_sum_rows_batch_exact_and_batch_invariant(host, m, rows, n):
    """out is exact against the f32 sum in row order (then the residual), whatever m; normed is
    rmsnorm of out; both row by row what a launch of that row alone gives."""
    rng = np.random.default_rng(m * 7 + rows)
    parts = rng.standard_normal((m, rows, n)).astype(np.float32)
    res, nw = random_bf16(rng, (m, n), exp_lo=-1), random_bf16(rng, n, exp_lo=-1)
    out = sum_rows(host, parts, res)
    acc = parts[:, 0].copy()
    for r in range(1, rows):
        acc += parts[:, r]
    same_bits(out, (res.astype(np.float32) + acc).astype(BF16), "sum_rows_residual_batch vs the row order")
    same_bits(out, sum_rows(host, parts, res, single=True), f"sum_rows_residual_batch m={m}")
    out2, normed = sum_rows(host, parts, res, nw)
    same_bits(out2, out, "sum_rows_residual_rmsnorm_batch out")
    o2, n2 = sum_rows(host, parts, res, nw, single=True)
    same_bits(normed, n2, f"sum_rows_residual_rmsnorm_batch m={m}")
    same_bits(normed, rmsnorm_ref(out, nw, EPS), "normed = rmsnorm(out)")


# ---- the PTX: PDL contracts, L2 reads of early-released outputs ------------------------------

# Each batched kernel's PDL contract (runtime.kernel.Pdl; whether it releases right after its wait)
# and what it writes: the contracts the drafter's launch order relies on (docs in ptx/common.cuh).
_CONTRACT = [
    (gv.GEMV_BF16_BATCH, Pdl.NONE, False, ("y",)),
    (mi.MTP_INPUT_GEMV_BATCH, Pdl.BESIDE, False, ("y", "flags")),
    (mi.MTP_EMBED_NORM_BATCH, Pdl.NONE, False, ("out",)),
    (bg.BGEMV_F32_BATCH, Pdl.WAIT, True, ("y",)),
    (bg.BGEMV_F32_BATCH_BESIDE, Pdl.BESIDE, False, ("y",)),
    (bg.BGEMV_BF16_BATCH, Pdl.WAIT, True, ("y",)),
    (bg.SUM_ROWS_RESIDUAL_BATCH, Pdl.NONE, False, ("out",)),
    (bg.SUM_ROWS_RESIDUAL_RMSNORM_BATCH, Pdl.WAIT, True, ("out", "normed")),
]


@pytest.mark.parametrize("decl,pdl,releases,writes", _CONTRACT, ids=lambda d: getattr(d, "function", ""))
def test_each_batched_kernel_keeps_its_pdl_contract(decl, pdl, releases, writes):
    assert (decl.pdl, decl.releases) == (pdl, releases)
    assert set(decl.writes) == set(writes)


def _body(module: str, function: str) -> str:
    from test_pdl_ptx import entry_body

    return entry_body(module, function)


@pytest.mark.parametrize(
    "function,form",
    [
        ("bgemv_bf16_bf16_batch", r"ld\.global\.nc\.v4\.u32\s"),  # x (wv after sparse_mla_combine)
        ("bgemv_bf16_f32_batch", r"ld\.global\.nc\.v4\.u32\s"),  # x (o_proj after wv)
        ("sum_rows_residual_rmsnorm_batch", r"ld\.global\.nc(\.v[24])?\.f32\s"),  # o_proj's partial rows
    ],
)
def test_batched_successors_of_early_releases_read_through_l2(function, form):
    body = _body("bgemv", function)
    hit = re.search(form, body)
    assert hit is None, (
        f"{function} reads its predecessor's output through the read-only path: {hit.group(0)!r}"
    )
    assert "ld.global.cg" in body


def test_the_entries_after_the_heads_wait_are_l2_loads():
    """In each of the kernel's four row-count paths (1, 2, 4, 8) the first load after the wait is
    an entry through L2 (the fifth wait, of a chunk past m, is followed by another path's code)."""
    body = _body("mtp_input", "mtp_input_gemv_batch")
    firsts = [re.search(r"ld\.global[.\w:]*", part) for part in body.split("griddepcontrol.wait")[1:]]
    firsts = [f.group(0) if f else None for f in firsts]
    assert firsts[0] == "ld.global.cg.v4.u32" and firsts.count("ld.global.cg.v4.u32") >= 4, firsts
