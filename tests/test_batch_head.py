"""The batched draft head's host twins (model/kernels/draft_head.py: head_argmax_batch,
argmax_pack_batch, draft_commit_batch; runtime/kernels: gemv_fp8w_batch, argmax_bf16_batch) on the
host backend, at awkward sizes with padding entries in random places:

- against float64 (the GEMV bound of tests/kernel_util.py), at m = 1 too; against the runtime's
  single-row twins (gemv_fp8w, argmax_bf16) bit for bit, and argmax_pack_batch / draft_commit_batch
  at m = 1 against pack_key and the commit rules directly;
- ties (the lower index), NaN and Inf rows (token 0 / the lowest +inf, the flag codes), NaN weight
  rows (they never win);
- padding entries write nothing (entry words, drafts, host drafts, flags), whatever their x holds;
- publish copies exactly drafts[e][0 .. draft_index] of the live entries;
- batch invariance: every row of a batch, in any order and with padding anywhere, has the bits of
  the same row launched alone;
- the sharded chain (gemv_fp8w_batch per vocabulary shard, argmax_bf16_batch, argmax_pack_batch,
  the MAX over ranks, draft_commit_batch) commits what the single-rank head commits;
- the launch geometry and the wrappers' refusals; the committed PTX reads x through L2.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from batch_head_util import (
    POISON,
    HeadCase,
    as_u32,
    check_commit,
    check_rows_equal,
    expected_token,
    flag_of,
    head_case,
    logits_of,
    make_entries,
    run_bufs,
    token_of,
)
from kernel_util import abs_dot, assert_dot_close, dot_bound, random_bf16

from model.kernels import draft_head
from model.kernels.batch import ENTRY_WORDS, PAD_SLOT
from runtime.dtypes import BF16, quantize_rows_fp8
from runtime.kernels import gemv_fp8w as gf
from runtime.kernels.argmax_bf16 import argmax_bf16, argmax_bf16_batch, argmax_ref
from runtime.kernels.gemv_fp8w import gemv_fp8w, gemv_fp8w_batch
from runtime.launch import launch

PTX = Path(__file__).resolve().parent.parent / "ptx"


def wd64(case: HeadCase) -> np.ndarray:
    """The head's weights as float64 (dequantised for FP8)."""
    if case.s is None:
        return case.w.astype(np.float64)
    return case.w.astype(np.float64) * case.s.astype(np.float64)[:, None]


# ---- the twin against float64 --------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m,n,k,pads", [(1, 37, 29, 0), (3, 300, 256, 1), (17, 101, 64, 5), (6, 50, 4096, 2)])
def test_head_batch_twin_matches_float64(host, fp8, m, n, k, pads):
    rng = np.random.default_rng(1000 * m + n + k)
    case = head_case(rng, fp8, m, n, k, pads)
    out = case.run(host)
    check_commit(case, out)
    lg = logits_of(case, out)
    w64 = wd64(case)
    for e in case.live:
        x = case.x[e : e + 1]
        ref = x.astype(np.float64) @ w64.T
        assert_dot_close(lg[e : e + 1], ref, dot_bound(abs_dot(x, w64), ref, k), f"row {e} logits")
        tok, flag = expected_token(lg[e])
        assert token_of(case, out, e) == tok and flag_of(case, out, e) == flag == 0


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,k", [(37, 29), (300, 256), (1000, 64)])
@pytest.mark.parametrize("draft_index,kmax,publish", [(0, 1, True), (2, 3, True), (1, 4, False)])
def test_head_batch_at_m1_commits_the_argmax_of_its_logits(host, fp8, n, k, draft_index, kmax, publish):
    """One entry: logits within the float64 bound, the commit (token word, drafts[draft_index], the
    host copy with publish, the flag byte) that of argmax_ref's winner of those logits."""
    rng = np.random.default_rng(n + k + draft_index)
    case = head_case(rng, fp8, 1, n, k, draft_index=draft_index, kmax=kmax, publish=publish, flag_byte=1)
    got = case.run(host)
    check_commit(case, got)
    lg = logits_of(case, got)
    w64 = wd64(case)
    ref = case.x.astype(np.float64) @ w64.T
    assert_dot_close(lg, ref, dot_bound(abs_dot(case.x, w64), ref, k), "m=1 logits")
    tok, flag = expected_token(lg[0])
    assert (token_of(case, got, 0), flag_of(case, got, 0)) == (tok, flag)
    assert as_u32(got["drafts"], (1, kmax))[0, draft_index] == tok


# ---- ties, NaN, Inf ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
def test_head_batch_ties_nan_and_inf_rows(host, fp8):
    """Each row of one batch gets its own outcome: a tie between two rows goes to the lower index;
    a NaN in x makes every logit NaN (token 0, NONFINITE_NAN); an Inf in x makes the largest logit
    +inf (the lowest such row, NONFINITE_INF); the negated tie row is won by another row; with the
    BF16 head, NaN weight rows never win. Padding entries between them change nothing."""
    rng = np.random.default_rng(5)
    n, k = 200, 64
    w = random_bf16(rng, (n, k), exp_lo=-6)  # |w| < 4
    a, b = sorted(rng.choice(np.arange(1, n), 2, replace=False))
    w[a] = w[b] = 8.0  # with x > 0 these two rows are the maximum, equal
    nan_rows = [] if fp8 else sorted(set(rng.choice(n, 6, replace=False)) - {a, b})
    w[nan_rows] = np.nan  # the FP8 copy of a NaN row is quantize_fp8's business
    xp = np.abs(random_bf16(rng, k, exp_lo=-1).astype(np.float32)).astype(BF16)
    x = np.stack([xp, xp, xp, -xp.astype(np.float32), xp]).astype(BF16)
    x[1, 7] = np.nan
    x[2, 9] = np.inf
    case = head_case(rng, fp8, 5, n, k, w=w)
    case.x = x
    case, rows = case.subset([0, 1, 2, 3, 4], pad_at=[1, 3, 5])
    out = case.run(host)
    check_commit(case, out)
    lg = logits_of(case, out).astype(np.float32)
    for j, e in enumerate(rows):
        if e < 0:
            continue
        tok, flag = token_of(case, out, j), flag_of(case, out, j)
        assert (tok, flag) == expected_token(logits_of(case, out)[j])
        if e in (0, 4):
            assert (tok, flag) == (a, 0), f"row {e}: the tie between {a} and {b} goes to {a}, got {tok}"
        elif e == 1:
            assert (tok, flag) == (0, draft_head.NONFINITE_NAN)
        elif e == 2:
            assert flag == draft_head.NONFINITE_INF and tok == int(np.flatnonzero(lg[j] == np.inf)[0])
        else:
            assert tok not in (a, b) and tok not in nan_rows and flag == 0
            assert lg[j, tok] == np.nanmax(lg[j])


# ---- padding, publish -----------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m,pads", [(5, 5), (9, 4), (64, 63)])
def test_padding_entries_write_nothing(host, fp8, m, pads):
    """Padding entries keep every entry word, drafts row, host row and flag byte; their x rows
    (NaN here) change no live row."""
    rng = np.random.default_rng(m + pads)
    case = head_case(rng, fp8, m, 80, 48, pads)
    pad_rows = [e for e in range(m) if e not in case.live]
    case.x[pad_rows] = np.nan
    out = case.run(host)
    check_commit(case, out)
    for e in case.live:
        alone = case.row(e)
        check_rows_equal(case, out, [e if j == e else -1 for j in range(m)], {e: alone.run(host)}, {e: alone})


@pytest.mark.parametrize("draft_index,kmax", [(0, 1), (0, 3), (2, 3), (3, 5)])
@pytest.mark.parametrize("publish", [False, True])
def test_publish_copies_drafts_up_to_the_index(host, draft_index, kmax, publish):
    rng = np.random.default_rng(draft_index * 10 + kmax)
    case = head_case(rng, True, 7, 64, 32, pads=2, draft_index=draft_index, kmax=kmax, publish=publish)
    check_commit(case, case.run(host))  # exactly drafts[e][0 .. draft_index] of live rows, or nothing


# ---- batch invariance ------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
def test_batch_invariance_of_the_twin(host, fp8):
    """Every row of a batch, in shuffled orders and with padding anywhere, has the bits of the row
    launched alone (logits, token, drafts, host drafts, flag)."""
    rng = np.random.default_rng(11)
    base = head_case(rng, fp8, 40, 150, 96, pads=0)
    ref = {e: base.row(e).run(host) for e in range(base.m)}
    refcase = {e: base.row(e) for e in range(base.m)}
    for m, pads in ((1, 0), (3, 1), (17, 4), (40, 9)):
        order = [int(v) for v in rng.permutation(base.m)[: m - pads]]
        case, rows = base.subset(order, pad_at=[int(p) for p in rng.integers(0, len(order) + 1, pads)])
        out = case.run(host)
        check_commit(case, out)
        check_rows_equal(case, out, rows, ref, refcase)


# ---- the sharded chain -----------------------------------------------------------------------------


def _shards(n: int, world: int) -> list[slice]:
    per = -(-n // world)
    return [slice(r * per, min(n, (r + 1) * per)) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_chain_commits_what_one_rank_commits(host, world):
    """gemv_fp8w_batch over each rank's rows, argmax_bf16_batch, argmax_pack_batch (v0 = the
    shard's first row), the u64 MAX over ranks (what the all-reduce does), draft_commit_batch: the
    same logits bits, tokens, drafts, host drafts and flags as head_argmax_batch on one rank, for
    rows whose winner is in any shard, a tie across a shard boundary, a NaN row and an Inf row."""
    rng = np.random.default_rng(world)
    n, k, m = 301, 64, 11
    w = random_bf16(rng, (n, k), exp_lo=-6)
    sl = _shards(n, world)
    a, b = sl[0].stop - 1, sl[1].start + 1  # a tie across the first boundary
    w[a] = w[b] = 8.0
    case = head_case(rng, True, m, n, k, pads=3, w=w)
    case.entries[:3, 0] = [5000, 5001, 5002]  # rows 0..2 live (the others' slots are below 4096)
    x = case.x.astype(np.float32)
    x[0] = np.abs(x[0])
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    case.x = x.astype(BF16)
    whole = case.run(host)
    check_commit(case, whole)
    q, s = case.w, case.s
    keys = np.zeros(m, np.uint64)
    parts = []
    for r in sl:
        nr = r.stop - r.start

        def rank(gpu, q, s, x, y, idx, val, key, r=r, nr=nr):
            gemv_fp8w_batch(gpu, q, s, x, y, m, nr, k)
            argmax_bf16_batch(gpu, y, idx, val, m, nr)
            draft_head.argmax_pack_batch(gpu, idx, val, key, r.start, m)

        o = run_bufs(
            host,
            rank,
            {"q": q[r], "s": s[r], "x": case.x, "y": 2 * m * nr, "idx": 4 * m, "val": 4 * m, "key": 8 * m},
        )
        parts.append(o["y"].view(BF16).reshape(m, nr))
        keys = np.maximum(keys, o["key"].view(np.uint64))
    lg = logits_of(case, whole)
    for e in case.live:
        assert np.concatenate([p[e] for p in parts]).tobytes() == lg[e].tobytes(), f"row {e}: shard logits"

    def commit(gpu, keys, entries, drafts, host, flags):
        draft_head.draft_commit_batch(
            gpu,
            keys=keys,
            entries=entries,
            drafts=drafts,
            draft_index=case.draft_index,
            kmax=case.kmax,
            host_drafts=host,
            publish=case.publish,
            m=m,
            flags=flags,
            flag_byte=case.flag_byte,
        )

    sharded = run_bufs(
        host,
        commit,
        {
            "keys": keys,
            "entries": case.entries,
            "drafts": case.drafts,
            "host": 4 * m * case.kmax,
            "flags": np.zeros((m, 4), np.uint8),
        },
    )
    for name in ("entries", "drafts", "host", "flags"):
        assert sharded[name].tobytes() == whole[name].tobytes(), f"{name} differ from one rank's"
    assert (token_of(case, whole, 0), flag_of(case, whole, 0)) == (a, 0), "the tie across shards"
    assert (token_of(case, whole, 1), flag_of(case, whole, 1)) == (0, draft_head.NONFINITE_NAN)
    assert flag_of(case, whole, 2) == draft_head.NONFINITE_INF


def test_argmax_pack_and_commit_batch_at_m1(host):
    """One row: the key is pack_key(val, idx + v0) (0 for an empty shard, index 0xFFFFFFFF), the
    commit stores its index in the entry's token word and drafts[1], publishes drafts[0..1], and
    raises flag byte 3 (only) as key_nonfinite says."""
    for val, idx, v0 in [
        (1.5, 7, 0),
        (-0.0, 3, 5),
        (float("inf"), 9, 10),
        (float("nan"), 0, 77),
        (2.0, 0xFFFFFFFF, 3),
    ]:
        key = 0 if idx == 0xFFFFFFFF else draft_head.pack_key(np.float32(val), idx + v0)
        tok = draft_head.unpack_index(key)
        ent = make_entries(np.random.default_rng(0), 1, 0)

        def batch(gpu, i, v, keys, entries, drafts, out, flags):
            draft_head.argmax_pack_batch(gpu, i, v, keys, v0, 1)
            draft_head.draft_commit_batch(
                gpu,
                keys=keys,
                entries=entries,
                drafts=drafts,
                draft_index=1,
                kmax=2,
                host_drafts=out,
                publish=True,
                m=1,
                flags=flags,
                flag_byte=3,
            )

        got = run_bufs(
            host,
            batch,
            {
                "i": np.array([idx], np.uint32),
                "v": np.array([val], np.float32),
                "keys": 8,
                "entries": ent,
                "drafts": np.array([5, 0xFFFFFFFF], np.uint32),
                "out": 8,
                "flags": np.zeros(4, np.uint8),
            },
        )
        assert int(got["keys"].view(np.uint64)[0]) == key
        assert got["entries"].view(np.uint32)[2] == tok
        assert got["drafts"].view(np.uint32).tolist() == [5, tok]
        assert got["out"].view(np.uint32).tolist() == [5, tok]
        assert got["flags"][3] == draft_head.key_nonfinite(key) and not got["flags"][:3].any()


def test_draft_commit_batch_skips_padding(host):
    rng = np.random.default_rng(3)
    m, kmax = 9, 3
    ent = make_entries(rng, m, 4)
    keys = np.array(
        [
            draft_head.pack_key(float(v), int(i))
            for v, i in zip(rng.standard_normal(m), rng.integers(0, 1000, m))
        ],
        np.uint64,
    )
    keys[0] = 0  # the empty key: token 0, flagged NaN
    drafts = rng.integers(0, 1000, (m, kmax)).astype(np.uint32)

    def run(gpu, keys, entries, drafts, host, flags):
        draft_head.draft_commit_batch(
            gpu,
            keys=keys,
            entries=entries,
            drafts=drafts,
            draft_index=2,
            kmax=kmax,
            host_drafts=host,
            publish=True,
            m=m,
            flags=flags,
            flag_byte=0,
        )

    out = run_bufs(
        host,
        run,
        {
            "keys": keys,
            "entries": ent,
            "drafts": drafts,
            "host": 4 * m * kmax,
            "flags": np.zeros((m, 4), np.uint8),
        },
    )
    got_e = as_u32(out["entries"], (m, ENTRY_WORDS))
    got_d = as_u32(out["drafts"], (m, kmax))
    for e in range(m):
        if int(ent[e, 0]) == PAD_SLOT:
            assert (got_e[e] == ent[e]).all() and (got_d[e] == drafts[e]).all()
            assert (out["host"].reshape(m, -1)[e] == POISON).all() and not out["flags"].reshape(m, 4)[e].any()
            continue
        t = draft_head.unpack_index(int(keys[e]))
        assert got_e[e, 2] == t == got_d[e, 2] and (got_d[e, :2] == drafts[e, :2]).all()
        assert (out["host"].reshape(m, -1)[e].view(np.uint32) == got_d[e]).all()
        assert out["flags"].reshape(m, 4)[e, 0] == draft_head.key_nonfinite(int(keys[e]))


# ---- gemv_fp8w_batch, argmax_bf16_batch ------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", [(1, 33, 48), (5, 7, 37), (8, 21, 4096), (37, 64, 64), (256, 9, 32)])
def test_gemv_fp8w_batch_rows_are_gemv_fp8w_rows(host, m, n, k):
    rng = np.random.default_rng(m * 7 + n)
    q, s = quantize_rows_fp8(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(BF16)
    got = run_bufs(
        host,
        lambda gpu, q, s, x, y: gemv_fp8w_batch(gpu, q, s, x, y, m, n, k),
        {"q": q, "s": s, "x": x, "y": 2 * m * n},
    )
    y = got["y"].view(BF16).reshape(m, n)
    wd = q.astype(np.float64) * s.astype(np.float64)[:, None]
    ref = x.astype(np.float64) @ wd.T
    assert_dot_close(y, ref, dot_bound(abs_dot(x, wd), ref, k), f"gemv_fp8w_batch m={m}")
    for e in sorted({0, m // 2, m - 1}):
        one = run_bufs(
            host,
            lambda gpu, q, s, x, y: gemv_fp8w(gpu, q, s, x, y, 1, n, k),
            {"q": q, "s": s, "x": x[e : e + 1], "y": 2 * n},
        )
        assert one["y"].tobytes() == y[e].tobytes(), f"row {e}: gemv_fp8w_batch != gemv_fp8w"


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_argmax_bf16_batch_rows_are_argmax_bf16(host, n):
    rng = np.random.default_rng(n)
    m = 6
    x = random_bf16(rng, (m, n)).astype(np.float32)
    x[1] = np.nan  # all NaN: index 0, value NaN
    if n > 2:
        x[2, [n // 3, n // 2]] = 2.0**12  # a tie
        x[3, rng.choice(n, n // 2, replace=False)] = np.nan
    x = x.astype(BF16)
    got = run_bufs(
        host, lambda gpu, x, i, v: argmax_bf16_batch(gpu, x, i, v, m, n), {"x": x, "i": 4 * m, "v": 4 * m}
    )
    for e in range(m):
        one = run_bufs(host, lambda gpu, x, i, v: argmax_bf16(gpu, x, i, v, n), {"x": x[e], "i": 4, "v": 4})
        assert got["i"][4 * e : 4 * e + 4].tobytes() == one["i"].tobytes()
        assert got["v"][4 * e : 4 * e + 4].tobytes() == one["v"].tobytes()
        assert int(got["i"].view(np.uint32)[e]) == argmax_ref(x[e])[0]


# ---- geometry and refusals ---------------------------------------------------------------------------


def _tile(m: int, tiles: int, t: int) -> tuple[int, int]:
    """batch_tile in ptx/fp8_batch.cuh."""
    base, rem = divmod(m, tiles)
    return t * base + min(t, rem), base + (1 if t < rem else 0)


@pytest.mark.parametrize("k", [4096, 37, 64, 20000])
def test_batch_tiling_covers_every_row_once(k):
    for m in range(1, gf.BATCH_MAX_M + 1):
        tiles, smem = gf.batch_tiling(m, k)
        assert gf.batch_shape_ok(m, tiles), (m, k, tiles)
        covered = []
        for t in range(tiles):
            e0, rows = _tile(m, tiles, t)
            covered.extend(range(e0, e0 + rows))
        assert covered == list(range(m)), (m, tiles)
        tmax = -(-m // tiles)
        assert smem in (0, tmax * 4 * k) and smem <= gf.BATCH_X_SMEM_MAX
        if k == 4096:
            assert tiles == -(-m // gf.BATCH_TILE_ROWS) and smem == tmax * 4 * k
        if k == 37:
            assert smem == 0  # no vector path to stage for
    assert gf.batch_tiling(1, 4096) == (1, 4 * 4096)  # m = 1: x staged as f32
    assert not gf.batch_shape_ok(9, 2) and not gf.batch_shape_ok(0, 1) and not gf.batch_shape_ok(257, 65)


def test_m1_launch_is_one_tile_with_x_staged(host):
    n, k = 154880, 4096
    grid, smem, tiles = draft_head.head_batch_launch(host, True, 1, n, k)
    assert tiles == 1 and smem == 4 * k and grid >= 1
    assert draft_head.head_batch_launch(host, False, 1, n, k) == (n // 16, 0, 1)
    grid, smem, tiles = draft_head.head_batch_launch(host, True, 256, n, k)
    assert tiles == 64 and grid % tiles == 0 and smem == 4 * 4 * k


def test_the_wrappers_refuse_bad_batches(host):
    p = host.alloc(1 << 16)
    kw = dict(
        w=p,
        scale=p,
        x=p,
        logits=p,
        keys=p,
        counter=p,
        entries=p,
        drafts=p,
        host_drafts=p,
        flags=p,
        publish=True,
    )
    for bad, match in [
        (dict(m=0), "m=0"),
        (dict(m=257), "m=257"),
        (dict(draft_index=4), "draft_index=4"),
        (dict(flag_byte=4), "flag_byte=4"),
        (dict(n=0), "n=0"),
    ]:
        args = dict(kw, m=2, n=10, k=16, draft_index=0, kmax=4, flag_byte=0) | bad
        with pytest.raises(ValueError, match=match):
            draft_head.head_argmax_batch(host, **args)
    for m in (0, 257):
        with pytest.raises(ValueError, match=f"m={m}"):
            gemv_fp8w_batch(host, p, p, p, p, m, 4, 16)
        with pytest.raises(ValueError, match=f"m={m}"):
            argmax_bf16_batch(host, p, p, p, m, 4)
        with pytest.raises(ValueError, match=f"m={m}"):
            draft_head.argmax_pack_batch(host, p, p, p, 0, m)
    host.free(p)


@pytest.mark.parametrize("tiles", [0, 1, 2, 10])
def test_a_bad_tile_count_writes_nothing(host, tiles):
    """m = 9 in fewer than 3 tiles (more than 4 rows in one) or in more than 9 is outside the
    kernel's shapes: the twin (as the kernel) commits nothing and leaves keys and counter zero."""
    rng = np.random.default_rng(tiles)
    case = head_case(rng, True, 9, 40, 32)

    def run(gpu, w, x, logits, keys, ctr, entries, drafts, host, flags, sc):
        launch(
            gpu,
            gpu.kernel(*draft_head.HEAD_ARGMAX_FP8_BATCH.key),
            8,
            256,
            w,
            sc,
            x,
            logits,
            keys,
            ctr,
            entries,
            drafts,
            1,
            4,
            host,
            1,
            9,
            40,
            32,
            flags,
            2,
            tiles,
        )

    out = run_bufs(host, run, case.bufs())
    assert (
        out["entries"].tobytes() == case.entries.tobytes()
        and out["drafts"].tobytes() == case.drafts.tobytes()
    )
    assert (
        (out["host"] == POISON).all()
        and not out["flags"].any()
        and not out["keys"].any()
        and not out["ctr"].any()
    )


# ---- the committed PTX --------------------------------------------------------------------------------


def _entry_body(module: str, function: str) -> str:
    text = (PTX / f"{module}.ptx").read_text()
    m = re.search(rf"\.entry {re.escape(function)}\(", text)
    assert m, f"{module}.ptx has no .entry {function}"
    start = text.index("{", m.end())
    depth, i = 0, start
    while True:
        depth += text[i] == "{"
        depth -= text[i] == "}"
        i += 1
        if depth == 0:
            return text[start:i]


@pytest.mark.parametrize("function", ["head_argmax_fp8_batch", "head_argmax_bf16_batch"])
def test_the_batched_heads_read_x_and_entries_through_l2(function):
    """Their x comes from sum_rows_residual_rmsnorm, which releases its dependents early, and their
    entries are written by their own last block: no read-only (ld.global.nc) load of 16-bit, 8-byte
    or 16-byte activations except the weight stream's L1::no_allocate form, and L2 loads present."""
    body = _entry_body("draft_head", function)
    ro = re.findall(r"ld\.global\.nc(?!\.L1::no_allocate)(\.v[24])?\.(u16|b16|u32|b32|f32)\s", body)
    allowed = {("", "f32"), ("", "u32")} if "fp8" in function else set()  # the FP8 row scales (weights)
    assert set(ro) <= allowed, f"{function}: read-only loads {sorted(set(ro))}"
    assert "ld.global.cg" in body
    wait = body.find("griddepcontrol.wait")
    assert 0 <= wait < body.find("griddepcontrol.launch_dependents")


# ---- the tensor-core heads' twin --------------------------------------------------------------------


@pytest.mark.parametrize("v1", [False, True])
@pytest.mark.parametrize("m,n,k,pads", [(1, 37, 64, 0), (9, 300, 256, 3), (200, 20, 64, 30)])
def test_mma_twin_is_the_batch_twin(host, m, n, k, pads, v1):
    """Both tensor-core kernels' twin is head_argmax_fp8_batch's math (the kernels differ in how the
    device sums, not in what): the same bytes, and the same commit contract."""
    rng = np.random.default_rng(m + n)
    case = head_case(rng, True, m, n, k, pads)
    plain = case.run(host)
    case.mma, case.mma_v1 = True, v1
    mma = case.run(host)
    check_commit(case, mma)
    for name in ("entries", "drafts", "host", "flags", "keys", "ctr"):
        assert mma[name].tobytes() == plain[name].tobytes(), name
    for e in case.live:
        assert logits_of(case, mma)[e].tobytes() == logits_of(case, plain)[e].tobytes()


def _x_bytes(whole: bool, s: int, k: int, v1: bool) -> int:
    """Bytes a row of the tile's x takes in the kernel's layout (all of k, or two slices of s)."""
    if v1:
        return 2 * k + 16 if whole else 2 * (128 * s + 16)
    return 2 * k if whole else 2 * 128 * s


@pytest.mark.parametrize("v1", [False, True])
@pytest.mark.parametrize("k", [64, 256, 1024, 4096, 4160, 7168])
def test_mma_tiling_fits_and_the_kernel_reads_it_back(k, v1):
    """Every m: the fewest tiles of at most 64 rows (balanced), at most the kernel's shared-memory
    budget, all of k staged once where it fits and else two buffers of S >= 1 superblocks, S as
    large as fits; the kernel's own derivation (its x_slice of the bytes per row of the largest
    tile) gets that back."""
    nsb = k // 64
    tiling = draft_head.mma_v1_tiling if v1 else draft_head.mma_tiling
    x_slice = draft_head.mma_v1_x_slice if v1 else draft_head.mma_x_slice
    budget = draft_head.MMA_V1_X_SMEM_MAX if v1 else draft_head.MMA_X_SMEM_MAX
    for m in range(1, 257):
        tiles, smem = tiling(m, k)
        rows = -(-m // tiles)
        assert tiles == -(-m // draft_head.MMA_TILE_ROWS) and rows <= draft_head.MMA_TILE_ROWS
        assert smem <= budget and smem % rows == 0
        whole, s = x_slice(k, smem // rows)
        if rows * _x_bytes(True, nsb, k, v1) <= budget:
            assert (whole, s, smem) == (True, nsb, rows * _x_bytes(True, nsb, k, v1))
        else:
            assert not whole and 1 <= s < nsb and smem == rows * _x_bytes(False, s, k, v1)
            assert rows * _x_bytes(False, s + 1, k, v1) > budget  # the largest S
        if v1:
            assert ((128 * s + 16) // 16) % 2 == 1  # rows an odd number of 16-byte bank groups apart


def test_mma_tiling_at_the_model_shapes():
    """What the proposer's batches get at hidden 4096: one pass over the weights up to 64 rows; all
    of x once per block up to 26 rows (v1: 11); slices of 13 superblocks at 64 rows (v1: 5)."""
    assert draft_head.mma_tiling(1, 4096) == (1, 8192)
    assert draft_head.mma_tiling(26, 4096) == (1, 26 * 8192)
    assert draft_head.mma_tiling(27, 4096) == (1, 27 * 256 * 31)
    assert draft_head.mma_tiling(64, 4096) == (1, 64 * 256 * 13)
    assert draft_head.mma_tiling(65, 4096)[0] == 2
    assert draft_head.mma_tiling(256, 4096) == (4, 64 * 256 * 13)
    assert draft_head.mma_x_slice(4096, 255) == (False, 0)  # too little: the kernel computes nothing
    assert draft_head.mma_v1_tiling(1, 4096) == (1, 8208)
    assert draft_head.mma_v1_tiling(11, 4096) == (1, 11 * 8208)
    assert draft_head.mma_v1_tiling(12, 4096) == (1, 12 * 2 * (128 * 31 + 16))
    assert draft_head.mma_v1_tiling(64, 4096) == (1, 64 * 2 * (128 * 5 + 16))
    assert draft_head.mma_v1_tiling(256, 4096) == (4, 64 * 2 * (128 * 5 + 16))
    assert draft_head.mma_v1_x_slice(4096, 100) == (False, 0)
    # One block of head_argmax_fp8_mma an SM: its x beside the 4 KB of static keys in the H200's
    # 227 KB a block.
    assert draft_head.MMA_X_SMEM_MAX + 8 * 64 * 8 <= 227 * 1024


@pytest.mark.parametrize("v1", [False, True])
def test_mma_shapes_and_refusals(host, v1):
    p = host.alloc(1 << 16)
    kw = dict(w=p, scale=p, x=p, logits=p, keys=p, counter=p, entries=p, drafts=p, host_drafts=p, flags=p)
    kw.update(publish=True, m=2, n=10, draft_index=0, kmax=4, flag_byte=0, v1=v1)
    with pytest.raises(ValueError, match="k % 64"):
        draft_head.head_argmax_batch_mma(host, **kw, k=48)
    with pytest.raises(ValueError, match="FP8"):
        draft_head.head_argmax_batch_mma(host, **(kw | dict(scale=None)), k=64)
    with pytest.raises(ValueError, match="k % 64"):
        draft_head.head_argmax_batch_mma(host, **(kw | dict(x=p.offset(2))), k=64)
    host.free(p)


def test_mma_launch_shapes(host):
    """The grid is a multiple of the tiles, at most the resident blocks, and one round covers the
    weight groups of each kernel's rows per block (256 rows; v1 128)."""
    n, k = 154_880, 4096
    for v1, group in ((False, draft_head.MMA_GROUP_ROWS), (True, draft_head.MMA_V1_GROUP_ROWS)):
        for m in (1, 17, 64, 65, 129, 256):
            grid, smem, tiles = draft_head.head_mma_launch(host, m, n, k, v1)
            tiling = draft_head.mma_v1_tiling if v1 else draft_head.mma_tiling
            assert (tiles, smem) == tiling(m, k)
            per_tile = grid // tiles
            assert grid % tiles == 0 and grid <= host.NOTIONAL_RESIDENT_BLOCKS
            groups = -(-n // group)
            rounds = -(-groups // per_tile)
            assert rounds == -(-groups // (host.NOTIONAL_RESIDENT_BLOCKS // tiles)), (v1, m)


@pytest.mark.parametrize("function", ["head_argmax_fp8_mma", "head_argmax_fp8_mma_v1"])
def test_mma_kernel_without_its_shape_commits_the_empty_key(host, function):
    """Launched directly with k % 64 != 0 the kernel computes nothing: every live entry commits
    token 0 flagged NONFINITE_NAN (the twin as the kernel), padding nothing."""
    rng = np.random.default_rng(2)
    case = head_case(rng, True, 5, 30, 48, pads=2)

    def run(gpu, w, x, logits, keys, ctr, entries, drafts, host, flags, sc):
        args = (w, sc, x, logits, keys, ctr, entries, drafts, 1, 4, host, 1, 5, 30, 48, flags, 2, 1)
        launch(gpu, gpu.kernel("draft_head", function), 4, 256, *args)

    out = run_bufs(host, run, case.bufs())
    check_commit(case, out)
    for e in case.live:
        assert (token_of(case, out, e), flag_of(case, out, e)) == (0, draft_head.NONFINITE_NAN)


def _read_only_loads(body: str) -> set[tuple[str, str]]:
    return set(re.findall(r"ld\.global\.nc(?!\.L1::no_allocate)(\.v[24])?\.(u16|b16|u32|b32|f32)\s", body))


def test_mma_ptx_uses_the_tensor_cores_and_reads_x_through_l2():
    """Both kernels: mma.sync on BF16, x staged by cp.async through L2 only, no read-only load but
    the row scales'. head_argmax_fp8_mma widens by byte permutes and one BF16x2 multiply (no
    conversion instruction), v1 through the f16 conversion."""
    for function in ("head_argmax_fp8_mma", "head_argmax_fp8_mma_v1"):
        body = _entry_body("draft_head", function)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in body, function
        assert _read_only_loads(body) <= {("", "f32")}, (function, sorted(_read_only_loads(body)))
        assert "cp.async.cg.shared.global" in body, function  # x staged through L2 only
        assert "ld.global.cg.v4.u32" not in body and "cp.async.ca" not in body, function
    new, v1 = (
        _entry_body("draft_head", "head_argmax_fp8_mma"),
        _entry_body("draft_head", "head_argmax_fp8_mma_v1"),
    )
    assert "cvt.rn.f16x2.e4m3x2" not in new and "cvt.rn.bf16x2.f32" not in new
    assert "prmt.b32" in new and "mul.rn.bf16x2" in new
    assert "cvt.rn.f16x2.e4m3x2" in v1 and "cvt.rn.bf16x2.f32" in v1
