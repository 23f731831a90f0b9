"""Sampled drafts (model/kernels/draft_sample.py) on the host backend: the twins of the four kernels
of ptx/draft_sample.cu, and the arithmetic they share with the device.

- the arithmetic: sample_exp within 1.5 ulp of e^x (and e^0 = 1, 0 below -86), the order keys
  monotone with NaN as -inf and -0 as +0, the record's layout and refusals, the draw's bounds of
  the noise below its uniform thresholds;
- against model/sampling.py (float64): the kept set equal (a top-p prefix sum within 1e-6 of top_p
  excepted), the token equal to sampling.draw's, q(token) and every q_i within
  4e-7 + 1.2e-7 |z_i - z_max| relative (plus 1e-30), the dist summing to 1 within 1e-6;
- the select kernel's histogram algorithm (emulated here step by step: segment sums, the boundary
  bins, the runs of equal z) reaches sample_select_batch's twin's state exactly, ties, runs of
  several keys (underflowing z), non-finite values and every top-k / top-p combination included;
- greedy rows keep the head's token with q = 1 and a one-hot dist, rows whose z_max is not finite
  too; top_k = 1 is greedy; padding entries write nothing (entry words, drafts, probs, host copies,
  their dist buffers); publish copies exactly drafts / probs [0 .. draft_index]; a dist buffer is
  written only where the record has an address and only in row draft_index; the workspace's
  histograms and counters are zero after a launch;
- batch invariance: every row of a batch, shuffled, with padding anywhere, bit-identical to the row
  launched alone; the seed, the position and the draft index each change the draw; the draws follow
  q (chi-square over 4000 seeds); a captured graph replays the records it finds in memory;
- the PTX waits (griddepcontrol.wait) before any store or return and reads what the head wrote
  through L2 (no ld.global.nc), the wrappers' refusals.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from draft_sample_util import (
    POISON_U32,
    check_outputs,
    expected,
    make_case,
    mixed_bits,
    mixed_params,
    normal_bits,
    run_case,
    special_bits,
    state_words,
    tied_bits,
    u32,
)

from model.kernels import draft_sample as ds
from model.kernels.keyed_rng import Stream
from model.sampling import SamplingParams, draw, kept_order, probabilities
from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16

KERNELS = ("sample_hist_batch", "sample_select_batch", "sample_index_batch", "sample_draw_batch")


# ---- the arithmetic -------------------------------------------------------------------------------


def test_sample_exp_is_within_an_ulp_and_a_half_of_exp():
    rng = np.random.default_rng(0)
    x = -rng.uniform(0, 86, 1_000_000).astype(np.float32)
    x = np.concatenate([x, np.float32([-0.0, -1e-30, -1e-7, -0.34657, -0.34658, -85.999, -86.0])])
    y = ds.sample_exp(x).astype(np.float64)
    ref = np.exp(x.astype(np.float64))
    ulps = np.abs(y - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.5, (float(ulps.max()), x[int(np.argmax(ulps))])
    assert ds.sample_exp(np.float32([0.0, -0.0])).tolist() == [1.0, 1.0]
    assert (ds.sample_exp(np.float32([-86.0001, -1000, -np.inf, np.nan])) == 0).all()
    assert (y <= 1.0).all()
    assert int(ds.fixed_mass(ds.sample_exp(np.float32(0.0)))) == 2**40


def test_the_draws_noise_bounds_hold_below_their_uniforms():
    """ptx/draft_sample.cu gumbel_below: below each uniform threshold the noise -log(-log u) stays
    under its bound by far more than an f32 logarithm's ulp (the draw skips the logarithms of an
    element that cannot reach a score by that bound), and the thresholds and bounds increase."""
    src = (Path(__file__).resolve().parent.parent / "ptx" / "draft_sample.cu").read_text()
    body = src[src.index("float gumbel_below(float u)") :]
    body = body[: body.index("}")]
    pairs = [(float(a), float(b)) for a, b in re.findall(r"u < ([0-9.]+)f \? ([0-9.]+)f", body)]
    assert len(pairs) == 3 and "G_MAX" in body
    assert all(a1 < a2 and b1 < b2 for (a1, b1), (a2, b2) in zip(pairs, pairs[1:]))
    for thr, bound in pairs:
        below = np.nextafter(np.float32(thr), np.float32(0.0))
        g = -math.log(-math.log(float(below)))
        assert g < bound - 1e-3, (thr, bound, g)
        g32 = -np.log(-np.log(np.float32(below)))
        assert g32 < np.float32(bound - 1e-3), (thr, bound, g32)


def test_order_keys_are_monotone_with_nan_as_minus_inf():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    keys, vals = ds.order_keys(bits)
    f = bits.view(BF16).astype(np.float32)
    num = ~np.isnan(f)
    # A larger key is a larger value, equal keys equal values, over every number.
    o = np.argsort(keys[num], kind="stable")
    assert (np.diff(f[num][o]) >= 0).all()
    assert (vals[num] == f[num]).all()
    assert (keys[~num] == ds.KEY_NEG_INF).all() and (vals[~num] == -np.inf).all()
    assert keys[0x8000] == keys[0] == 0x8000  # -0 is +0
    assert keys[0x7F80] == ds.KEY_POS_INF and keys[0xFF80] == ds.KEY_NEG_INF
    assert (ds.key_values(keys[num]) == np.where(f[num] == 0, 0.0, f[num])).all()


def test_pack_sampling_layout():
    p = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, seed=0x1234_5678_9ABC_DEF0)
    rec = ds.pack_sampling(p, 77, 0xAB_CDEF_0124)
    assert rec.dtype == np.uint32 and rec.shape == (ds.SAMPLE_WORDS,)
    assert rec[:2].view(np.float32).tolist() == [np.float32(0.7), np.float32(0.95)]
    assert rec[2:].tolist() == [40, 0x9ABC_DEF0, 0x1234_5678, 77, 0xCDEF_0124, 0xAB]
    r = ds.Record.of(rec)
    assert (r.top_k, r.seed, r.position, r.dist) == (40, p.seed, 77, 0xAB_CDEF_0124) and r.sampled
    assert not ds.Record.of(ds.pack_sampling(SamplingParams(), 0, 0)).sampled
    assert ds.pack_sampling(p, 0, DevicePtr(64))[6] == 64


@pytest.mark.parametrize(
    "params,position,addr,match",
    [
        (SamplingParams(temperature=-1.0), 0, 0, "temperature"),
        (SamplingParams(temperature=float("nan")), 0, 0, "temperature"),
        (SamplingParams(temperature=1e300), 0, 0, "overflows f32"),
        (SamplingParams(temperature=1.0, top_p=0.0), 0, 0, "top_p"),
        (SamplingParams(temperature=1.0, top_p=1.5), 0, 0, "top_p"),
        (SamplingParams(temperature=1.0, top_k=-1), 0, 0, "top_k"),
        (SamplingParams(temperature=1.0, top_k=2**32), 0, 0, "top_k"),
        (SamplingParams(temperature=1.0, seed=-1), 0, 0, "seed"),
        (SamplingParams(temperature=1.0), -1, 0, "position"),
        (SamplingParams(temperature=1.0), 2**32, 0, "position"),
        (SamplingParams(temperature=1.0), True, 0, "position"),
        (SamplingParams(temperature=1.0), 0, 6, "dist address"),
        (SamplingParams(temperature=1.0), 0, -4, "dist address"),
        (SamplingParams(temperature=1.0), 0, 2**64, "dist address"),
    ],
)
def test_pack_sampling_refuses(params, position, addr, match):
    with pytest.raises(ValueError, match=match):
        ds.pack_sampling(params, position, addr)


# ---- against the float64 reference -----------------------------------------------------------------


def _reference_kept(logits32: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    z = logits32 / np.float32(p.temperature)
    order, _ = kept_order(z, p)
    full = np.lexsort((np.arange(z.shape[0]), -z.astype(np.float64)))
    return order, full


def _knife_edge(logits32: np.ndarray, p: SamplingParams, a: int, b: int) -> bool:
    """Whether the reference's top-p prefix sums at kept counts a .. b all lie within 1e-6 of top_p
    (where f32 arithmetic may end the prefix elsewhere)."""
    z = (logits32 / np.float32(p.temperature)).astype(np.float64)
    order = np.lexsort((np.arange(z.shape[0]), -z))
    if p.top_k:
        order = order[: p.top_k]
    e = np.exp(z[order] - z[order[0]])
    c = np.cumsum(e / e.sum())
    lo, hi = min(a, b), max(a, b)
    return bool(np.all(np.abs(c[lo - 1 : hi] - p.top_p) <= 1e-6)) and p.top_p < 1.0


def _check_against_reference(bits: np.ndarray, p: SamplingParams, position: int, di: int, what: str) -> None:
    rec = ds.Record.of(ds.pack_sampling(p, position, 0))
    logits32 = bits.view(BF16).astype(np.float32)
    head = int(np.argmax(logits32))
    row = ds.sample_row(bits, rec, head, di)
    ref_p = probabilities(logits32, p)
    ref_order, _ = _reference_kept(logits32, p) if not p.greedy else (np.array([head]), None)
    kept = np.flatnonzero(row.kept)
    same_set = kept.shape == ref_order.shape and (np.sort(ref_order) == kept).all()
    if not same_set:
        assert _knife_edge(logits32, p, len(kept), len(ref_order)), (
            f"{what}: kept {len(kept)} tokens, the reference {len(ref_order)} ({p})"
        )
        return
    tok = draw(logits32, p, position, di, Stream.DRAFT)
    assert row.token == tok, f"{what}: token {row.token}, reference {tok}"
    z = (logits32 / np.float32(p.temperature)).astype(np.float64) if not p.greedy else np.zeros_like(logits32)
    x = np.abs(z - z.max())
    tol = (4e-7 + 1.2e-7 * np.where(row.kept, x, 0.0)) * ref_p + 1e-30
    err = np.abs(row.dist.astype(np.float64) - ref_p)
    assert (err <= tol).all(), f"{what}: dist off by {err.max():.3g} at {int(np.argmax(err - tol))}"
    assert abs(float(row.q) - ref_p[row.token]) <= tol[row.token]
    assert abs(row.dist.astype(np.float64).sum() - 1.0) <= 1e-6


@pytest.mark.parametrize("n", [1, 2, 7, 300, 5000, 65537])
def test_twin_draws_what_model_sampling_draws(n):
    rng = np.random.default_rng(100 + n)
    params = [
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.6, top_p=0.95, seed=4),
        SamplingParams(temperature=1.0, top_p=0.95, seed=5),
        SamplingParams(temperature=1.3, top_k=50, seed=6),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7),
        SamplingParams(temperature=2.0, top_p=0.3, seed=8),
        SamplingParams(temperature=0.05, top_p=0.99, seed=9),
        SamplingParams(temperature=1.0, top_k=n, top_p=0.7, seed=10),
        SamplingParams(temperature=1.0, top_k=max(n - 1, 1), seed=11),
    ]
    for j, p in enumerate(params):
        for kind, bits in (
            ("normal", normal_bits(rng, n, 2.0)),
            ("tied", tied_bits(rng, n)),
            ("wide", normal_bits(rng, n, 8.0)),
        ):
            _check_against_reference(bits, p, 1000 + j, j % 3, f"n={n} {kind} {p}")


def test_twin_at_the_vocabulary_size():
    rng = np.random.default_rng(7)
    for p in (
        SamplingParams(temperature=1.0, top_p=0.95, seed=1),
        SamplingParams(temperature=0.6, top_k=50, seed=2),
        SamplingParams(temperature=1.0, seed=3),
    ):
        _check_against_reference(normal_bits(rng, 154880, 3.0), p, 12, 1, f"vocab {p}")


# ---- the select kernel's algorithm, emulated ------------------------------------------------------


def _select_by_histogram(bits: np.ndarray, rec: ds.Record) -> np.ndarray:
    """ptx/draft_sample.cu sample_select_batch step by step: the histogram's bins, segment sums
    over 512 segments of 128 bins in descending order, find_bin, run_of, the boundary logic. The
    state words it would write (mode word alone for a greedy-like row)."""
    n, t = bits.shape[0], rec.temperature
    keys, _ = ds.order_keys(bits)
    hist = np.bincount(keys, minlength=ds.HIST_BINS).astype(np.uint64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        zmax = ds.key_values(np.uint32(keys.max())) / t
        kz = ds.key_values(np.arange(ds.HIST_BINS, dtype=np.uint32)) / t
    if not np.isfinite(zmax):
        return np.array([0], np.uint32)
    with np.errstate(invalid="ignore", over="ignore"):
        mass1 = ds.fixed_mass(ds.sample_exp(kz - zmax))  # keys above z_max, NaN keys: no elements
    binm = hist * np.where(hist > 0, mass1, 0).astype(np.uint64)
    seg_c = hist.reshape(512, 128).sum(axis=1)
    seg_m = binm.reshape(512, 128).sum(axis=1)
    # Exclusive sums in descending segment order: ex[s] = the sums of segments above s.
    ex_c = np.concatenate([np.cumsum(seg_c[::-1])[::-1][1:], [0]]).astype(np.uint64)
    ex_m = np.concatenate([np.cumsum(seg_m[::-1])[::-1][1:], [0]]).astype(np.uint64)
    total_m = int(seg_m.sum())

    def find_bin(by_mass: bool, target: int):
        lo = ex_m if by_mass else ex_c
        w = seg_m if by_mass else seg_c
        hits = [s for s in range(512) if int(lo[s]) < target <= int(lo[s]) + int(w[s])]
        assert len(hits) == 1, hits
        s = hits[0]
        ac, am = int(ex_c[s]), int(ex_m[s])
        for b in range(128 * s + 127, 128 * s - 1, -1):
            wk = int(binm[b]) if by_mass else int(hist[b])
            cur = am if by_mass else ac
            if cur < target <= cur + wk:
                return b, int(hist[b]), ac, am, int(mass1[b])
            ac += int(hist[b])
            am += int(binm[b])
        raise AssertionError("no bin")

    def prefix_above(u: int):
        return int(hist[u + 1 :].sum()), int(binm[u + 1 :].sum())

    def run_bounds(b: int):
        lo = hi = b
        zb = kz[b]
        while hi < ds.KEY_POS_INF and kz[hi + 1] == zb:
            hi += 1
        while lo > ds.KEY_NEG_INF and kz[lo - 1] == zb:
            lo -= 1
        return lo, hi

    def run_of(hit):
        b, cnt, ac, am, m1 = hit
        lo, hi = run_bounds(b)
        if lo == hi:
            return dict(lo=lo, hi=hi, above=ac, m_above=am, size=cnt, mass1=m1)
        above, m_above = prefix_above(hi)
        c2, _ = prefix_above(lo - 1)
        return dict(lo=lo, hi=hi, above=above, m_above=m_above, size=c2 - above, mass1=m1)

    jk = rec.top_k if 0 < rec.top_k < n else n
    every = True
    r = dict(lo=0, hi=0, above=0, m_above=0, size=0, mass1=0)
    j, total_k = 0, total_m
    if jk < n:
        r = run_of(find_bin(False, jk))
        j = jk - r["above"]
        total_k = r["m_above"] + j * r["mass1"]
        every = False
    if rec.top_p < np.float32(1.0):
        need = min(max(math.ceil(float(rec.top_p) * float(total_k)), 1), total_k)
        if every or need <= r["m_above"]:
            r = run_of(find_bin(True, need))
            every = False
        if r["mass1"]:
            j = -(-(need - r["m_above"]) // r["mass1"])
    total = total_m if every else r["m_above"] + j * r["mass1"]
    if not every and r["above"] + j == n:
        every = True
    st = ds._State(
        1,
        zmax,
        0 if every else r["lo"],
        0 if every else r["hi"],
        0 if every or j >= r["size"] else j,
        0xFFFF_FFFF,
        ds.FIX_SCALE / float(total),
        total,
    )
    return st.words()


def _select_cases():
    rng = np.random.default_rng(5)
    rows = []
    for n in (1, 2, 5, 130, 1000, 4097):
        rows += [
            normal_bits(rng, n, 1.0),
            normal_bits(rng, n, 6.0),
            tied_bits(rng, n, 3),
            special_bits(rng, n),
        ]
    # Underflowing z: tiny logits over a huge temperature make runs of several keys (one z value).
    rows.append((rng.standard_normal(3000) * 1e-8).astype(BF16).view(np.uint16))
    rows.append(np.full(700, np.float32(2.5).astype(BF16).view(np.uint16), np.uint16))
    return rows


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [
        (1.0, 1.0, 0),
        (1.0, 0.95, 0),
        (0.6, 0.5, 0),
        (1.3, 1.0, 50),
        (0.8, 0.9, 20),
        (1.0, 0.3, 3),
        (1.0, 0.999, 1),
        (0.01, 0.9, 0),
        (1e38, 0.4, 0),
        (1e38, 1.0, 7),
        (1e38, 0.6, 1000),
        (1e-38, 0.9, 0),
    ],
)
def test_the_histogram_select_reaches_the_twins_state(temperature, top_p, top_k):
    for bits in _select_cases():
        rec = ds.Record.of(ds.pack_sampling(SamplingParams(temperature, top_p, top_k, 1), 0, 0))
        st = ds.select_state(bits, rec)
        want = st.words() if st.mode else st.words()[:1]
        got = _select_by_histogram(bits, rec)
        assert got.tolist() == want.tolist(), (bits.shape, temperature, top_p, top_k, got, want)


def test_runs_of_several_keys_are_cut_by_index():
    """Underflowing z (a huge temperature) puts many BF16 values on one z: the kept set takes the
    lowest indices of the run, as the reference's (z desc, index asc) order does."""
    rng = np.random.default_rng(9)
    bits = (rng.standard_normal(3000) * 1e-8).astype(BF16).view(np.uint16)
    for p in (SamplingParams(1e38, 1.0, 7, 2), SamplingParams(1e38, 0.375, 0, 3)):  # f32-exact top_p
        rec = ds.Record.of(ds.pack_sampling(p, 5, 0))
        st = ds.select_state(bits, rec)
        assert st.mode == 1 and st.lo < st.hi and st.jstar > 0, st
        row = ds.sample_row(bits, rec, 0, 0)
        logits32 = bits.view(BF16).astype(np.float32)
        ref_order, _ = _reference_kept(logits32, p)
        assert np.array_equal(np.flatnonzero(row.kept), np.sort(ref_order))
        assert row.token == draw(logits32, p, 5, 0, Stream.DRAFT)


# ---- the launch contract ---------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,pads", [(1, 37, 0), (3, 300, 1), (17, 1000, 4), (6, 4097, 2), (5, 9000, 1)])
def test_launch_against_the_rows(host, m, n, pads):
    rng = np.random.default_rng(10 * m + n)
    case = make_case(rng, mixed_bits(rng, m, n), mixed_params(rng, m), pads=pads)
    out = run_case(host, case)
    exp = expected(case)
    check_outputs(case, out, exp, f"m={m} n={n}")
    words = state_words(case, out.workspace)
    for e, x in enumerate(exp):
        if x is not None and case.params[e].temperature > 0:
            want = x.state.words() if x.state.mode else x.state.words()[:1]
            assert words[e, 6 : 6 + len(want)].tolist() == want.tolist(), f"entry {e}: state"


def test_greedy_rows_keep_the_heads_token_even_when_it_is_not_the_argmax(host):
    rng = np.random.default_rng(2)
    m, n = 4, 500
    case = make_case(
        rng, normal_bits(rng, (m, n)), [SamplingParams()] * m, with_dist=[True, False, True, True]
    )
    case.entries[:, 2] = [3, 1, 499, 0]  # whatever the head committed
    case.drafts[:, case.draft_index] = case.entries[:, 2]
    out = run_case(host, case)
    check_outputs(case, out, expected(case), "greedy")
    for e in range(m):
        assert out.entries[e, 2] == case.entries[e, 2] and out.probs[e, case.draft_index] == 1.0
        if out.dists[e] is not None:
            d = out.dists[e][case.draft_index]
            assert d[case.entries[e, 2]] == 1.0 and np.count_nonzero(d) == 1


def test_rows_whose_largest_z_is_not_finite_are_greedy(host):
    rng = np.random.default_rng(3)
    n = 300
    inf = np.float32(np.inf).astype(BF16).view(np.uint16)
    a = normal_bits(rng, n)
    a[17] = inf  # a +inf logit
    b = np.full(n, 0x7FC1, np.uint16)  # every logit NaN
    b[::7] = np.float32(-np.inf).astype(BF16).view(np.uint16)
    c = normal_bits(rng, n, 100.0)  # l / 1e-38 overflows
    bits = np.stack([a, b, c])
    params = [
        SamplingParams(1.0, 0.9, 0, 1),
        SamplingParams(1.0, 1.0, 5, 2),
        SamplingParams(1e-38, 1.0, 0, 3),
    ]
    case = make_case(rng, bits, params, with_dist=[True] * 3)
    out = run_case(host, case)
    exp = expected(case)
    check_outputs(case, out, exp, "non-finite")
    for e in range(3):
        assert exp[e].state.mode == 0 and out.entries[e, 2] == case.entries[e, 2]
        assert out.probs[e, case.draft_index] == 1.0
    assert out.entries[0, 2] == 17


def test_top_k_one_is_greedy(host):
    rng = np.random.default_rng(4)
    m, n = 6, 2000
    bits = np.concatenate([normal_bits(rng, (3, n)), tied_bits(rng, (3, n))])
    case = make_case(rng, bits, [SamplingParams(0.9, 1.0, 1, s) for s in range(m)], with_dist=[True] * m)
    out = run_case(host, case)
    check_outputs(case, out, expected(case), "top_k 1")
    assert (out.entries[:, 2] == case.entries[:, 2]).all()  # the argmax, lowest index on a tie
    assert (out.probs[:, case.draft_index] == 1.0).all()


def test_padding_entries_write_nothing(host):
    rng = np.random.default_rng(5)
    m, n = 9, 700
    params = [SamplingParams(1.0, 0.9, 0, s) for s in range(m)]
    case = make_case(rng, normal_bits(rng, (m, n)), params, pads=5, with_dist=[True] * m)
    out = run_case(host, case)
    check_outputs(case, out, expected(case), "padding")  # checks the padding entries' buffers


@pytest.mark.parametrize("publish", [True, False])
@pytest.mark.parametrize("draft_index,kmax", [(0, 1), (0, 3), (2, 3), (3, 6)])
def test_publish_and_the_draft_index(host, publish, draft_index, kmax):
    rng = np.random.default_rng(draft_index * 10 + kmax)
    m, n = 5, 400
    case = make_case(
        rng,
        normal_bits(rng, (m, n)),
        mixed_params(rng, m),
        pads=1,
        draft_index=draft_index,
        kmax=kmax,
        publish=publish,
    )
    out = run_case(host, case)
    check_outputs(case, out, expected(case), f"publish={publish} draft {draft_index} of {kmax}")


def test_dist_only_where_an_address_is_given(host):
    rng = np.random.default_rng(6)
    m, n = 6, 333
    with_dist = [True, False, True, False, True, False]
    params = [SamplingParams(1.0, 0.95, 0, 1), SamplingParams(1.0, 0.95, 0, 2)] * 3
    params[4] = SamplingParams()
    case = make_case(
        rng, normal_bits(rng, (m, n)), params, with_dist=with_dist, draft_index=2, kmax=3, dist_rows=5
    )
    out = run_case(host, case)
    exp = expected(case)
    check_outputs(case, out, exp, "dist")  # rows other than draft_index untouched, row exact
    for e in range(m):
        assert (out.dists[e] is not None) == with_dist[e]
        if with_dist[e]:
            assert (u32(out.dists[e][3:]) == POISON_U32).all(), "dist rows past the draft's written"
            assert abs(out.dists[e][2].astype(np.float64).sum() - 1.0) <= 1e-6


def test_workspace_is_zero_again_and_relaunches_agree(host):
    rng = np.random.default_rng(7)
    m, n = 5, 3000
    case = make_case(rng, mixed_bits(rng, m, n), mixed_params(rng, m), pads=1)
    once = run_case(host, case)
    twice = run_case(host, case, repeat=2)
    check_outputs(case, twice, expected(case), "relaunched")
    assert (once.entries == twice.entries).all() and (u32(once.probs) == u32(twice.probs)).all()


@pytest.mark.parametrize("m,n", [(3, 500), (17, 1000), (64, 257)])
def test_rows_are_bit_identical_alone_and_shuffled(host, m, n):
    rng = np.random.default_rng(m + n)
    case = make_case(rng, mixed_bits(rng, m, n), mixed_params(rng, m), with_dist=[True] * m)
    batch = run_case(host, case)
    perm = rng.permutation(m).tolist()
    shuffled, src = case.subset(perm, pad_at=(0, m // 2))
    sh = run_case(host, shuffled)
    for j, e in enumerate(src):
        if e < 0:
            continue
        alone_case, _ = case.subset([e])
        alone = run_case(host, alone_case)
        for got, what in ((batch, "batch"), (sh, "shuffled")):
            r = e if got is batch else j
            assert got.entries[r, 2] == alone.entries[0, 2], f"{what} row {e}: token"
            assert u32(got.probs[r]).tolist() == u32(alone.probs[0]).tolist(), f"{what} row {e}: probs"
            assert (u32(got.dists[r]) == u32(alone.dists[0])).all(), f"{what} row {e}: dist"
            assert (
                state_words(case, batch.workspace)[e] == state_words(alone_case, alone.workspace)[0]
            ).all()


def test_seed_position_and_draft_index_change_the_draw(host):
    rng = np.random.default_rng(8)
    n = 64
    bits = np.zeros(n, np.uint16)  # every logit 0: a uniform draw over all 64 tokens
    base = SamplingParams(temperature=1.0, seed=11)

    def token(seed: int, position: int, draft_index: int) -> int:
        p = SamplingParams(base.temperature, seed=seed)
        return ds.sample_row(bits, ds.Record.of(ds.pack_sampling(p, position, 0)), 0, draft_index).token

    for vary in ("seed", "position", "draft_index"):
        toks = [
            token(
                11 + (v if vary == "seed" else 0),
                5 + (v if vary == "position" else 0),
                v if vary == "draft_index" else 0,
            )
            for v in range(24)
        ]
        assert len(set(toks)) >= 8, (vary, toks)
    # The launch draws what the row function draws, for each of the three.
    case = make_case(
        rng, np.tile(bits, (3, 1)), [SamplingParams(1.0, seed=s) for s in (1, 2, 3)], draft_index=1
    )
    out = run_case(host, case)
    check_outputs(case, out, expected(case), "keys")


def test_draws_follow_q(host):
    """4000 draws (16 launches of 250 rows, one seed each) of one row against its q: chi-square."""
    rng = np.random.default_rng(12)
    n, m = 12, 250
    logits = rng.standard_normal(n).astype(BF16).view(np.uint16)
    bits = np.tile(logits, (m, 1))
    counts = np.zeros(n, np.int64)
    q = None
    for launch_i in range(16):
        params = [SamplingParams(0.8, 0.9, 8, launch_i * m + s) for s in range(m)]
        case = make_case(rng, bits, params, with_dist=[False] * m)
        out = run_case(host, case)
        counts += np.bincount(out.entries[:, 2], minlength=n)
        q = expected(case)[0].dist.astype(np.float64)
    draws = 16 * m
    ref = probabilities(logits.view(BF16).astype(np.float32), SamplingParams(0.8, 0.9, 8))
    assert np.allclose(q, ref, rtol=1e-5, atol=1e-9)
    assert np.all(counts[q == 0] == 0)
    live = q > 0
    chi2 = float((((counts - draws * q) ** 2)[live] / (draws * q[live])).sum())
    # Chi-square with live - 1 degrees of freedom: 3.5 x the mean plus 10 is beyond p = 1e-4.
    assert chi2 < 3.5 * (live.sum() - 1) + 10, (chi2, counts, draws * q)


def test_a_captured_graph_replays_the_records_in_memory(host):
    """The parameters are read from device memory at each replay: new seeds written between
    replays change the draws as a direct launch with them does."""
    from draft_sample_util import GUARD

    rng = np.random.default_rng(13)
    m, n = 4, 600
    case = make_case(rng, normal_bits(rng, (m, n), 2.0), mixed_params(rng, m))
    recs = np.stack([case.record(e) for e in range(m)])
    gpu = host
    ptrs = {}
    for name, arr in (
        ("logits", case.bits),
        ("sampling", recs),
        ("entries", case.entries),
        ("drafts", case.drafts),
    ):
        ptrs[name] = gpu.alloc(arr.nbytes + GUARD)
        gpu.copy_h2d(ptrs[name], np.ascontiguousarray(arr))
    probs = gpu.alloc(m * case.kmax * 4)
    ws = gpu.alloc(ds.sample_workspace_bytes(m, n))
    gpu.memset(ws, 0, ds.sample_workspace_bytes(m, n))
    hd, hp = gpu.alloc_mapped(m * case.kmax * 4), gpu.alloc_mapped(m * case.kmax * 4)
    s = gpu.create_stream()
    gpu.begin_capture(s)
    ds.draft_sample_batch(
        gpu,
        logits=ptrs["logits"],
        sampling=ptrs["sampling"],
        entries=ptrs["entries"],
        drafts=ptrs["drafts"],
        probs=probs,
        host_drafts=hd.device,
        host_probs=hp.device,
        draft_index=case.draft_index,
        kmax=case.kmax,
        publish=True,
        m=m,
        n=n,
        workspace=ws,
        stream=s,
    )
    g = gpu.end_capture(s, label="draft_sample")
    try:
        for _ in range(3):
            case.params = mixed_params(rng, m)
            gpu.copy_h2d(ptrs["sampling"], np.stack([case.record(e) for e in range(m)]))
            # What the head rewrites before each sampling step: the entries' tokens, drafts[di].
            gpu.copy_h2d(ptrs["entries"], case.entries)
            gpu.copy_h2d(ptrs["drafts"], case.drafts)
            gpu.graph_launch(g, s)
            gpu.synchronize(s)
            want = [x.token for x in expected(case)]
            assert hd.host.view(np.uint32).reshape(m, case.kmax)[:, case.draft_index].tolist() == want
    finally:
        gpu.graph_destroy(g)
        gpu.destroy_stream(s)
        for p in (*ptrs.values(), probs, ws):
            gpu.free(p)
        gpu.free_mapped(hd)
        gpu.free_mapped(hp)


# ---- the wrapper, the workspace, the PTX -------------------------------------------------------------


def test_workspace_bytes():
    assert ds.sample_workspace_bytes(1, 154880) == ds.HIST_BYTES + ds.ROW_STATE_BYTES + 16 * -(-38 * 4 // 16)
    assert ds.sample_workspace_bytes(256, 1) == 256 * (ds.HIST_BYTES + ds.ROW_STATE_BYTES) + 16 * 64
    assert ds.sample_workspace_bytes(3, 5000) % 16 == 0


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(m=0), "m=0"),
        (dict(m=257), "m=257"),
        (dict(n=0), "n=0"),
        (dict(n=1 << 24), "n=16777216"),
        (dict(draft_index=4), "draft_index=4"),
        (dict(kmax=0, draft_index=0), "kmax=0"),
        (dict(workspace=DevicePtr(8)), "16-byte aligned"),
    ],
)
def test_wrapper_refuses_before_launching(host, change, match):
    p = host.alloc(64)
    args = dict(
        logits=p,
        sampling=p,
        entries=p,
        drafts=p,
        probs=p,
        host_drafts=p,
        host_probs=p,
        draft_index=1,
        kmax=4,
        publish=True,
        m=2,
        n=10,
        workspace=p,
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ds.draft_sample_batch(host, **args)
    host.free(p)


def test_every_kernel_is_declared_with_its_twin():
    from runtime.kernel import Pdl, lookup

    for f in KERNELS:
        d = lookup("draft_sample", f)
        assert d is not None and d.host is not None and d.pdl is Pdl.WAIT and not d.releases
    assert set(lookup("draft_sample", "sample_draw_batch").writes) == {
        "entries",
        "drafts",
        "probs",
        "host_drafts",
        "host_probs",
        "workspace",
    }


@pytest.mark.parametrize("function", KERNELS)
def test_ptx_waits_first_and_reads_through_l2(function):
    from test_pdl_ptx import _GLOBAL_STORE, _RET, entry_body

    body = entry_body("draft_sample", function)
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0
    assert _GLOBAL_STORE.search(body[:wait]) is None and _RET.search(body[:wait]) is None
    assert "launch_dependents" not in body
    # The head releases its dependents early: what it wrote (logits, entries) must come from L2.
    assert "ld.global.nc" not in body, f"{function} uses the read-only path"
    assert "fma.rn.f32" not in body or function == "sample_draw_batch"  # logf's own, in the draw


def test_declarations_match_the_ptx_params():
    """tests/test_launch_packing.py's check, for these kernels (declared when this module is
    imported): the declared argument types are the PTX entry's parameters."""
    import re

    from runtime.kernel import Arg, lookup

    text = (Path(__file__).resolve().parent.parent / "ptx" / "draft_sample.ptx").read_text()
    entries = {
        name: re.findall(r"\.param \.(\w+)", params)
        for name, params in re.findall(r"\.visible \.entry (\w+)\(\s*(.*?)\)", text, re.S)
    }
    ptx_type = {Arg.PTR: "u64", Arg.U32: "u32"}
    for f in KERNELS:
        want = [ptx_type[t] for t in lookup("draft_sample", f).arg_types]
        got = ["u32" if t in ("s32", "b32") else "u64" if t in ("s64", "b64") else t for t in entries[f]]
        assert got == want, (f, got, want)
