"""Helpers for the FP8 expert tests (tests/test_batch_moe_fp8.py on the host backend,
tests/test_gpu_batch_moe_fp8.py on the device): random FP8 experts with 128 x 128 block scales in
the kernels' layouts, their exact float64 values, the launch sequence of moe_gate_up_fp8_batch +
moe_down_fp8_batch from poison (the group workspace of given ids built by the grouping's host twin),
and the checks against float64 and against the twin."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from batch_moe_util import GUARD, MoeCase, Outputs, get, group_words, poisoned, put
from kernel_util import same_bits

from model.kernels import moe
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16, FP8

F32_EPS = 2.0**-24


def random_fp8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Every E4M3 code but the two NaNs, uniformly: signs, subnormals, zeros and +-448 all occur."""
    codes = np.frombuffer(rng.bytes(int(np.prod(shape))), np.uint8).copy()
    nan = (codes & 0x7F) == 0x7F
    codes[nan] ^= 0x01  # 0x7F -> 0x7E (448), 0xFF -> 0xFE (-448)
    return codes.view(FP8).reshape(shape)


def random_scales(
    rng: np.random.Generator, shape: tuple[int, ...], base: float, pow2: bool = False
) -> np.ndarray:
    """Block scales about ``base``: within +-50% (a kernel that applies a neighbour's block scale is
    visibly wrong), or powers of two in [base / 4, base * 4] (then q * s is exact in BF16)."""
    if pow2:
        return (base * 2.0 ** rng.integers(-2, 3, shape)).astype(np.float32)
    return (base * (0.5 + rng.random(shape))).astype(np.float32)


@dataclass
class Fp8Experts:
    """FP8 stacks in the kernels' layouts: routed gate_up [n, 2I, H] / down [n, H, I], the shared
    expert's [1, 2I, H] / [1, H, I], each with its F32 block scales."""

    gu: np.ndarray
    gu_s: np.ndarray
    dn: np.ndarray
    dn_s: np.ndarray
    sgu: np.ndarray
    sgu_s: np.ndarray
    sdn: np.ndarray
    sdn_s: np.ndarray

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.gu, self.gu_s, self.dn, self.dn_s, self.sgu, self.sgu_s, self.sdn, self.sdn_s)


def random_fp8_experts(rng, case: MoeCase, base: float = 2.0**-11, pow2: bool = False) -> Fp8Experts:
    """Random experts for ``case``; with base 2**-11 the weights are up to about 0.3."""
    n, i, h = case.n_local, case.inter, case.h

    def sc(shape):
        return random_scales(rng, shape, base, pow2)

    return Fp8Experts(
        random_fp8(rng, (n, 2 * i, h)),
        sc(moe.gate_up_scale_shape(n, i, h)),
        random_fp8(rng, (n, h, i)),
        sc(moe.down_scale_shape(n, h, i)),
        random_fp8(rng, (1, 2 * i, h)),
        sc(moe.gate_up_scale_shape(1, i, h)),
        random_fp8(rng, (1, h, i)),
        sc(moe.down_scale_shape(1, h, i)),
    )


def dequant64(q: np.ndarray, s: np.ndarray, gate_up: bool) -> np.ndarray:
    """The exact values of one expert's weight [rows, cols] as float64 (q * s is exact in float64).
    gate_up: the scales' block rows are the gate's then the up's (the module's layout)."""
    q64 = q.astype(np.float64)
    rows, cols = q.shape
    cb = np.arange(cols) // moe.FP8_BLOCK
    if gate_up:
        i = rows // 2
        nbi = -(-i // moe.FP8_BLOCK)
        rb = np.concatenate([np.arange(i) // moe.FP8_BLOCK, nbi + np.arange(i) // moe.FP8_BLOCK])
    else:
        rb = np.arange(rows) // moe.FP8_BLOCK
    return q64 * s.astype(np.float64)[rb][:, cb]


def expert64(ex: Fp8Experts, x: int) -> tuple[np.ndarray, np.ndarray]:
    """(gate_up, down) of routed expert x (x < 0: the shared expert) as exact float64."""
    if x < 0:
        return dequant64(ex.sgu[0], ex.sgu_s[0], True), dequant64(ex.sdn[0], ex.sdn_s[0], False)
    return dequant64(ex.gu[x], ex.gu_s[x], True), dequant64(ex.dn[x], ex.dn_s[x], False)


def upload(gpu, ex: Fp8Experts) -> tuple:
    """Device pointers (gu, gu_s, dn, dn_s, sgu, sgu_s, sdn, sdn_s)."""
    return tuple(put(gpu, a.view(np.uint8) if a.dtype == FP8 else a) for a in ex.arrays())


def run_batch_fp8(gpu, wp, case: MoeCase, y, ids, wts, entries, stream=None) -> Outputs:
    """moe_gate_up_fp8_batch + moe_down_fp8_batch over the batch from poison, the group workspace of
    ``ids`` built by the grouping's host twin; ``wp`` as upload returns it."""
    m = len(entries)
    ns, inter, h = case.nslots, case.inter, case.h
    ent_p, y_p, ids_p, wts_p = put(gpu, entries), put(gpu, y), put(gpu, ids), put(gpu, wts)
    gbytes = moe.group_workspace_bytes(m, case.ntopk, case.n_local)
    grp = poisoned(gpu, gbytes) if case.ntopk else None
    act = poisoned(gpu, m * ns * inter * 2)
    parts = poisoned(gpu, m * ns * h * 4)
    gu, gu_s, dn, dn_s, sgu, sgu_s, sdn, sdn_s = wp
    common = dict(
        entries=ent_p, m=m, ntopk=case.ntopk, n_local=case.n_local, shared=case.shared, stream=stream
    )
    try:
        if case.ntopk:
            gpu.copy_h2d(grp, group_words(ids, entries, case.ntopk, ns, case.expert_base, case.n_local))
        moe.moe_gate_up_fp8_batch(
            gpu, w=gu, w_scale=gu_s, w_shared=sgu, w_shared_scale=sgu_s, y=y_p, group=grp, act=act,
            inter=inter, h=h, limit=case.limit, **common,
        )  # fmt: skip
        moe.moe_down_fp8_batch(
            gpu, w=dn, w_scale=dn_s, w_shared=sdn, w_shared_scale=sdn_s, act=act, weights=wts_p, group=grp,
            parts=parts, h=h, inter=inter, **common,
        )  # fmt: skip
        gpu.synchronize(stream)
        return Outputs(
            get(gpu, act, m * ns * inter * 2).view(BF16).reshape(m * ns, inter).copy(),
            get(gpu, parts, m * ns * h * 4).view(np.float32).reshape(m * ns, h).copy(),
            get(gpu, grp, gbytes).view(np.uint32).copy() if grp is not None else None,
        )
    finally:
        for p in (ent_p, y_p, ids_p, wts_p, act, parts) + ((grp,) if grp is not None else ()):
            gpu.free(p)


def run_row_alone_fp8(gpu, wp, case: MoeCase, y_row, ids_row, wts_row) -> tuple[np.ndarray, np.ndarray]:
    """One row launched alone (m = 1): act [nslots, inter] BF16 and parts [nslots, h] f32."""
    out = run_batch_fp8(gpu, wp, case, y_row[None], ids_row[None], wts_row[None], pack_entries([0], [0], [0]))
    return out.act, out.parts


def poison_rows(a: np.ndarray) -> np.ndarray:
    """Rows that are all 0xFF bytes."""
    return (a.view(np.uint8).reshape(a.shape[0], -1) == 0xFF).all(axis=1)


def block_dot_bound(absd: np.ndarray, k: int) -> np.ndarray:
    """Allowed |f32 result - exact| of the module's block-scaled dot of length k, given absd =
    sum |w x| (w the exact weights): within a block at most min(k, 128) - 1 rounded additions,
    then the scale product and the add into acc, up to ceil(k / 128) of those; doubled for the
    second-order terms."""
    n = min(k, moe.FP8_BLOCK) + 2 * -(-k // moe.FP8_BLOCK)
    return 2.0 * n * F32_EPS * absd + 1e-30


def pair_slots(case: MoeCase, ids, wts, rows) -> dict[int, list[tuple[int, int, float]]]:
    """Per expert (-1: the shared one) its live pairs (pair, entry, weight) that compute; pairs of
    other ranks' experts and shared slots held elsewhere are left out."""
    ns = case.nslots
    out: dict[int, list[tuple[int, int, float]]] = {}
    for e in rows:
        for j in range(ns):
            p = e * ns + j
            if case.ntopk == 0 or j == case.ntopk:
                if case.shared == moe.SHARED_HERE:
                    out.setdefault(-1, []).append((p, e, 1.0))
                continue
            x = int(ids[e, j]) - case.expert_base
            if 0 <= x < case.n_local:
                out.setdefault(x, []).append((p, e, float(wts[e, j])))
    return out


def check_unwritten_and_zero(case: MoeCase, ids, rows, out: Outputs) -> None:
    """Pairs of other ranks' experts and a shared slot held elsewhere: act left as poison, parts
    zeros; padding entries' rows all poison."""
    ns = case.nslots
    m = out.act.shape[0] // ns
    for e in range(m):
        sl = slice(e * ns, (e + 1) * ns)
        if e not in rows:
            assert poison_rows(out.act[sl]).all() and poison_rows(out.parts[sl]).all(), (
                f"padding entry {e} written"
            )
            continue
        for j in range(ns):
            p = e * ns + j
            if case.ntopk == 0 or j == case.ntopk:
                held = case.shared == moe.SHARED_HERE
            else:
                held = 0 <= int(ids[e, j]) - case.expert_base < case.n_local
            if not held:
                assert poison_rows(out.act[p : p + 1]).all(), f"act of pair {p} (not held here) written"
                assert (out.parts[p] == 0).all(), f"parts of pair {p} (not held here) must be zeros"


def check_against_float64(
    case: MoeCase, ex: Fp8Experts, y, ids, wts, rows, out: Outputs, roundings: int = 1
) -> None:
    """act and parts of every computing pair against float64 of the exact weights: the gate/up dots
    within the block-scaled f32 bound (``roundings`` = 2 when out is the device compared with a
    twin's act), carried through the clamped SwiGLU (|d silu| <= 1.1) plus the BF16 rounding of act;
    parts against float64 of the weights times out's own act (so the act rounding does not enter)."""
    inter, h, lim = case.inter, case.h, case.limit
    for x, lst in pair_slots(case, ids, wts, rows).items():
        wg, wd = expert64(ex, x)
        ps = [p for p, _, _ in lst]
        wt = np.array([w for _, _, w in lst])[:, None]
        y64 = y[[e for _, e, _ in lst]].astype(np.float64)
        ref = y64 @ wg.T
        eb = roundings * block_dot_bound(np.abs(y64) @ np.abs(wg).T, h)
        g, u = ref[:, :inter], ref[:, inter:]
        gg, uu = np.minimum(g, lim), np.clip(u, -lim, lim)
        with np.errstate(over="ignore"):
            act_ref = gg / (1 + np.exp(-gg)) * uu
        got = out.act[ps].astype(np.float64)
        tol = 1.1 * eb[:, :inter] * np.abs(uu) + np.abs(gg) * eb[:, inter:] + 2.0**-8 * np.abs(act_ref)
        tol += roundings * 2.0**-8 * np.abs(got) + 2.0**-20 * np.abs(act_ref) + 1e-30
        assert not np.isnan(got).any(), f"expert {x}: NaN in act (unwritten?)"
        bad = np.abs(got - act_ref) > tol
        assert not bad.any(), f"act of expert {x}: {int(bad.sum())} elements outside the bound"
        pref = wt * (got @ wd.T)
        pb = roundings * block_dot_bound(np.abs(wt) * (np.abs(got) @ np.abs(wd).T), inter) + 2**-23 * np.abs(
            pref
        )
        gp = out.parts[ps].astype(np.float64)
        assert not np.isnan(gp).any(), f"expert {x}: NaN in parts (unwritten?)"
        bad = np.abs(gp - pref) > pb
        assert not bad.any(), f"parts of expert {x}: {int(bad.sum())} elements outside the bound"


def twin_bound(absd: np.ndarray, k: int) -> np.ndarray:
    """|a - b| of two block-scaled f32 dots of the same values (the device's and the twin's)."""
    return 2 * block_dot_bound(absd, k)


def check_against_twin(
    case: MoeCase, ex: Fp8Experts, y, ids, wts, rows, g: Outputs, t: Outputs, bound=twin_bound
) -> None:
    """Outputs g against t (the device against the twin): act within ``bound`` (|difference| of
    the two f32 dots, from sum |w x| and the length) through the SwiGLU plus a BF16 ulp of each;
    parts within the bound of the dots on each side's own act plus what the acts' difference
    carries through the down weights."""
    inter, h, lim = case.inter, case.h, case.limit
    for x, lst in pair_slots(case, ids, wts, rows).items():
        wg, wd = expert64(ex, x)
        ps = [p for p, _, _ in lst]
        wt = np.abs(np.array([w for _, _, w in lst]))[:, None]
        y64 = y[[e for _, e, _ in lst]].astype(np.float64)
        ref = y64 @ wg.T
        eb = bound(np.abs(y64) @ np.abs(wg).T, h)
        gg, uu = np.minimum(ref[:, :inter], lim), np.clip(ref[:, inter:], -lim, lim)
        ga, ta = g.act[ps].astype(np.float64), t.act[ps].astype(np.float64)
        tol = 1.1 * eb[:, :inter] * np.abs(uu) + np.abs(gg) * eb[:, inter:] + 2.0**-7 * np.abs(ta) + 1e-30
        assert not np.isnan(ga).any(), f"expert {x}: NaN in the device's act"
        bad = np.abs(ga - ta) > tol
        assert not bad.any(), f"act of expert {x}: {int(bad.sum())} elements outside the bound of the twin's"
        da = np.abs(ga - ta)
        pb = bound(wt * (np.abs(ta) @ np.abs(wd).T), inter) + wt * (da @ np.abs(wd).T)
        pb += 2.0**-22 * wt * (np.abs(ta) @ np.abs(wd).T) + 1e-30
        gp, tp = g.parts[ps].astype(np.float64), t.parts[ps].astype(np.float64)
        assert not np.isnan(gp).any(), f"expert {x}: NaN in the device's parts"
        bad = np.abs(gp - tp) > pb
        assert not bad.any(), (
            f"parts of expert {x}: {int(bad.sum())} elements outside the bound of the twin's"
        )


__all__ = [
    "GUARD",
    "Fp8Experts",
    "block_dot_bound",
    "check_against_float64",
    "check_against_twin",
    "check_unwritten_and_zero",
    "dequant64",
    "expert64",
    "poison_rows",
    "random_fp8",
    "random_fp8_experts",
    "random_scales",
    "run_batch_fp8",
    "run_row_alone_fp8",
    "same_bits",
    "twin_bound",
    "upload",
]
