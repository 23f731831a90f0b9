"""The batched draft head's PTX (ptx/draft_head.cu head_argmax_{fp8,bf16}_batch, argmax_pack_batch,
draft_commit_batch; ptx/gemv_fp8w.cu gemv_fp8w_batch; ptx/argmax_bf16.cu argmax_bf16_batch)
against the host twins, against float64, and against itself at other batch sizes. Every buffer is poisoned (0xFF) with guard bytes after it (tests/batch_head_util.py): an
element the kernel should write and did not shows as NaN, padding entries must leave their entry
words, drafts, host drafts and flag bytes as they were, and keys and the counter must be zero again.

Tolerances (tests/kernel_util.py):
- logits against the twin: ``dot_bound(..., roundings=2)``; against float64 or the f32 reference of
  the full head the same bound;
- exact: every token and flag against the argmax of the device's own logits (argmax_ref's rules),
  argmax_bf16_batch / argmax_pack_batch / draft_commit_batch against their twins, the sharded chain
  against the single-rank head;
- bit for bit: every row of a batched launch against the same row launched alone (m = 1) at
  m = 1, 3, 17, 64, 200 in shuffled orders with padding anywhere, staged x against x read from
  global memory, and
  gemv_fp8w_batch rows against gemv_fp8w and against the head's logits.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from batch_head_util import (
    POISON,
    HeadCase,
    check_commit,
    check_row_is_row_alone,
    check_rows_equal,
    expected_token,
    flag_of,
    head_case,
    logits_of,
    make_entries,
    row_alone,
    run_bufs,
    token_of,
)
from kernel_util import abs_dot, assert_dot_close, dot_bound, random_bf16

from model.kernels import draft_head
from runtime.dtypes import BF16, FP8
from runtime.host_backend import HostBackend
from runtime.kernels.argmax_bf16 import argmax_bf16_batch
from runtime.kernels.gemv_fp8w import gemv_fp8w, gemv_fp8w_batch
from runtime.launch import launch

pytestmark = pytest.mark.gpu

VOCAB, HIDDEN = 154880, 4096


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_batch_head"


def wd64(case: HeadCase) -> np.ndarray:
    if case.s is None:
        return case.w.astype(np.float64)
    return case.w.astype(np.float64) * case.s.astype(np.float64)[:, None]


def check_against_twin(case: HeadCase, g: dict[str, np.ndarray], h: dict[str, np.ndarray], what: str) -> None:
    """Live rows' logits within the GEMV bound of the twin's; each token and flag exactly the
    argmax of the device's own logits, and the twin's token where rounding cannot flip it."""
    live = case.live
    gl, hl = logits_of(case, g)[live], logits_of(case, h)[live]
    xl = case.x[live]
    assert_dot_close(
        gl, hl.astype(np.float64), dot_bound(abs_dot(xl, wd64(case)), hl, case.k, 2), f"{what} logits"
    )
    h32 = hl.astype(np.float32)
    for j, e in enumerate(live):
        tok, flag = token_of(case, g, e), flag_of(case, g, e)
        assert (tok, flag) == expected_token(logits_of(case, g)[e]), (
            f"{what} row {e}: not the argmax of its logits"
        )
        top = np.sort(h32[j])[-2:]
        if top[1] - top[0] > 4 * 2.0**-8 * abs(top[1]):
            assert tok == token_of(case, h, e), f"{what} row {e}: token {tok}, twin {token_of(case, h, e)}"


# ---- against the twin ------------------------------------------------------------------------------

TWIN_CASES = [
    (1, 37, 29, 0),  # one row; odd k: the element-wise path
    (3, 1000, 4096, 1),
    (17, 100_003, 64, 4),
    (5, 333, 4104, 2),  # k % 16 != 0: FP8 element-wise, BF16 vector path
    (64, 777, 256, 10),
    (200, 129, 512, 50),
    (256, 40, 16, 0),
]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m,n,k,pads", TWIN_CASES)
def test_head_batch_against_the_twin(cuda, fp8, m, n, k, pads):
    rng = np.random.default_rng()
    case = head_case(
        rng, fp8, m, n, k, pads, draft_index=int(rng.integers(0, 4)), flag_byte=int(rng.integers(0, 4))
    )
    g, h = case.run(cuda), case.run(HostBackend())
    check_commit(case, g)
    check_commit(case, h)
    check_against_twin(case, g, h, f"m={m} n={n} k={k}")
    for e in case.live:
        assert flag_of(case, g, e) == 0, "finite logits raise no flag"


@pytest.mark.parametrize("fp8", [False, True])
def test_ties_nan_and_inf_rows_against_the_twin(cuda, fp8):
    """One batch: x > 0 rows where two weight rows tie at the top (the lower wins), a NaN in x
    (every logit NaN: token 0, NONFINITE_NAN), an Inf in x (the lowest +inf row, NONFINITE_INF),
    the negated tie row, NaN weight rows with the BF16 head (they never win), padding between."""
    rng = np.random.default_rng()
    n, k = 1000, 256
    w = random_bf16(rng, (n, k), exp_lo=-6)
    a, b = sorted(rng.choice(np.arange(1, n), 2, replace=False))
    w[a] = w[b] = 8.0
    nan_rows = [] if fp8 else sorted(set(rng.choice(n, 50, replace=False)) - {a, b})
    w[nan_rows] = np.nan
    xp = np.abs(random_bf16(rng, k, exp_lo=-1).astype(np.float32))
    x = np.stack([xp, xp, xp, -xp, xp]).astype(BF16)
    x[1, 7] = np.nan
    x[2, 9] = np.inf
    case = head_case(rng, fp8, 5, n, k, w=w)
    case.x = x
    case, rows = case.subset([0, 1, 2, 3, 4], pad_at=[1, 3, 5])
    g, h = case.run(cuda), case.run(HostBackend())
    check_commit(case, g)
    for j, e in enumerate(rows):
        if e < 0:
            continue
        assert (token_of(case, g, j), flag_of(case, g, j)) == (token_of(case, h, j), flag_of(case, h, j)), (
            f"row {e}"
        )
        tok, flag = token_of(case, g, j), flag_of(case, g, j)
        if e in (0, 4):
            assert (tok, flag) == (a, 0)
        elif e == 1:
            assert (tok, flag) == (0, draft_head.NONFINITE_NAN)
            assert np.isnan(logits_of(case, g)[j].astype(np.float32)).all()
        elif e == 2:
            gl = logits_of(case, g)[j].astype(np.float32)
            assert flag == draft_head.NONFINITE_INF and tok == int(np.flatnonzero(gl == np.inf)[0])
        else:
            gl = logits_of(case, g)[j].astype(np.float32)
            assert tok not in nan_rows and flag == 0 and gl[tok] == np.nanmax(gl)


@pytest.mark.parametrize("fp8", [False, True])
def test_a_batch_of_padding_writes_nothing(cuda, fp8):
    rng = np.random.default_rng()
    case = head_case(rng, fp8, 8, 300, 4096, pads=8)
    g = case.run(cuda)
    check_commit(case, g)


# ---- bit for bit ----------------------------------------------------------------------------------


def _launch_with_smem(case: HeadCase, smem: int | None):
    """case.launch, but the batched kernel launched directly with ``smem`` bytes of dynamic shared
    memory (0: no room to stage x, so it is read from global memory)."""

    def run(gpu, w, x, logits, keys, ctr, entries, drafts, host, flags, sc=None):
        fp8 = sc is not None
        grid, helper_smem, tiles = draft_head.head_batch_launch(gpu, fp8, case.m, case.n, case.k)
        decl = draft_head.HEAD_ARGMAX_FP8_BATCH if fp8 else draft_head.HEAD_ARGMAX_BF16_BATCH
        weights = (w, sc) if fp8 else (w,)
        launch(
            gpu,
            gpu.kernel(*decl.key),
            grid,
            256,
            *weights,
            x,
            logits,
            keys,
            ctr,
            entries,
            drafts,
            case.draft_index,
            case.kmax,
            host,
            int(case.publish),
            case.m,
            case.n,
            case.k,
            flags,
            case.flag_byte,
            tiles,
            smem=helper_smem if smem is None else smem,
        )

    return run


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,k", [(1000, 4096), (517, 256), (77, 29), (300, 4104)])
def test_rows_are_the_row_alone_and_staging_changes_no_bit(cuda, fp8, n, k):
    """At m = 1, 3 and 9 every live row has the bits of an m = 1 launch of that row alone
    (logits, token, drafts, host drafts, flag), and a launch without room to stage x (read from
    global memory) gives the same bits as the staged launch."""
    rng = np.random.default_rng()
    for m, pads in ((1, 0), (3, 1), (9, 2)):
        case = head_case(rng, fp8, m, n, k, pads)
        staged = run_bufs(cuda, _launch_with_smem(case, None), case.bufs())
        plain = run_bufs(cuda, _launch_with_smem(case, 0), case.bufs())
        check_commit(case, staged)
        check_commit(case, plain)
        for name in ("entries", "drafts", "host", "flags"):
            assert staged[name].tobytes() == plain[name].tobytes(), f"m={m}: {name} differ without staging"
        for e in case.live:
            assert logits_of(case, staged)[e].tobytes() == logits_of(case, plain)[e].tobytes(), (
                f"m={m} row {e}"
            )
            check_row_is_row_alone(case, staged, e, row_alone(cuda, case.row(e)), f"m={m} row {e}")


@pytest.fixture(scope="module")
def pool_weights(cuda):
    """A 5000-row head at hidden 4096 (BF16 and its FP8 copy) resident for the invariance test."""
    rng = np.random.default_rng()
    base = head_case(rng, True, 200, 5000, HIDDEN, pads=0)
    w = rng.standard_normal((5000, HIDDEN)).astype(BF16)
    bf16 = head_case(rng, False, 200, 5000, HIDDEN, pads=0, w=w)
    dev = {}
    for name, arr in (("q", base.w), ("s", base.s), ("w", w)):
        p = cuda.alloc(arr.nbytes)
        cuda.copy_h2d(p, np.ascontiguousarray(arr))
        dev[name] = p
    yield {True: (base, {"w": dev["q"], "sc": dev["s"]}), False: (bf16, {"w": dev["w"]})}
    for p in dev.values():
        cuda.free(p)


@pytest.mark.parametrize("fp8", [False, True])
def test_batch_invariance_bit_for_bit(cuda, pool_weights, fp8):
    """200 rows, each launched alone; then batches of 17, 200, 1, 64 and 3 of them in shuffled
    orders with padding entries anywhere: every row has the bits it had alone."""
    rng = np.random.default_rng()
    base, resident = pool_weights[fp8]
    refcase = {e: base.row(e) for e in range(base.m)}
    ref = {e: refcase[e].run(cuda, resident) for e in range(base.m)}
    for m in (17, 200, 1, 64, 3):
        pads = m // 5
        order = [int(v) for v in rng.permutation(base.m)[: m - pads]]
        case, rows = base.subset(order, pad_at=[int(p) for p in rng.integers(0, len(order) + 1, pads)])
        out = case.run(cuda, resident)
        check_commit(case, out)
        check_rows_equal(case, out, rows, ref, refcase)


@pytest.mark.parametrize("fp8", [False, True])
def test_scratch_is_zero_again_for_the_next_launch(cuda, fp8):
    """Two launches on the same keys, counter and outputs, the first with other x: the second
    commits what a fresh launch commits (the first left keys and counter zero)."""
    rng = np.random.default_rng()
    case = head_case(rng, fp8, 23, 2000, 512, pads=5)
    other = rng.standard_normal(case.x.shape).astype(BF16)

    def twice(gpu, x2, **bufs):
        case.launch(gpu, **{**bufs, "x": x2})
        case.launch(gpu, **bufs)

    again = run_bufs(cuda, twice, {**case.bufs(), "x2": other})
    fresh = case.run(cuda)
    check_commit(case, again)
    for name in ("logits", "entries", "drafts", "host", "flags", "keys", "ctr"):
        if name == "logits":
            for e in case.live:
                assert logits_of(case, again)[e].tobytes() == logits_of(case, fresh)[e].tobytes()
            continue
        assert again[name].tobytes() == fresh[name].tobytes(), f"{name} differ after a second launch"


@pytest.mark.parametrize("tiles", [0, 2, 10])
def test_a_bad_tile_count_writes_nothing(cuda, tiles):
    rng = np.random.default_rng()
    case = head_case(rng, True, 9, 40, 32)

    def run(gpu, w, x, logits, keys, ctr, entries, drafts, host, flags, sc):
        decl = draft_head.HEAD_ARGMAX_FP8_BATCH
        args = (w, sc, x, logits, keys, ctr, entries, drafts, 1, 4, host, 1, 9, 40, 32, flags, 2, tiles)
        launch(gpu, gpu.kernel(*decl.key), 8, 256, *args)

    out = run_bufs(cuda, run, case.bufs())
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


# ---- the full head: 154880 x 4096 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_head(cuda):
    """The full head (BF16) and its FP8 copy quantised on the device by quantize_fp8 (which
    test_gpu_kernels.py holds bit-exact to quantize_rows_fp8), all three resident, and the FP8
    copy dequantised in f32 for the reference."""
    from runtime.kernels.quantize_fp8 import quantize_fp8

    rng = np.random.default_rng()
    w = random_bf16(rng, (VOCAB, HIDDEN), exp_lo=-8)
    pw, pq, ps = cuda.alloc(w.nbytes), cuda.alloc(VOCAB * HIDDEN), cuda.alloc(VOCAB * 4)
    cuda.copy_h2d(pw, w)
    quantize_fp8(cuda, pw, pq, ps, VOCAB, HIDDEN)
    q, s = np.empty((VOCAB, HIDDEN), np.uint8), np.empty(VOCAB, np.float32)
    cuda.copy_d2h(q, pq)
    cuda.copy_d2h(s, ps)
    q = q.view(FP8)
    wd = q.astype(np.float32)
    wd *= s[:, None]
    yield {"w": w, "q": q, "s": s, "wd": wd, "pw": pw, "pq": pq, "ps": ps}
    for p in (pw, pq, ps):
        cuda.free(p)


@pytest.mark.parametrize("m,pads", [(1, 0), (17, 2)])
def test_full_fp8_head(cuda, full_head, m, pads):
    """154880 x 4096 FP8 at m = 1 and 17: logits within the bound of the f32 reference, tokens the
    argmax of the device logits, every row bit-identical to the row alone (m = 1), keys and counter
    zero again."""
    rng = np.random.default_rng()
    f = full_head
    resident = {"w": f["pq"], "sc": f["ps"]}
    case = head_case(rng, True, m, VOCAB, HIDDEN, pads, wq=(f["q"], f["s"]))
    g = case.run(cuda, resident)
    check_commit(case, g)
    live = case.live
    xl = case.x[live]
    ref = (xl.astype(np.float32) @ f["wd"].T).astype(np.float64)
    gl = logits_of(case, g)[live]
    assert_dot_close(gl, ref, dot_bound(abs_dot(xl, f["wd"]), ref, HIDDEN, 2), f"full FP8 head m={m}")
    for e in live:
        assert (token_of(case, g, e), flag_of(case, g, e)) == expected_token(logits_of(case, g)[e])
        alone = case.row(e)
        check_rows_equal(
            case, g, [e if j == e else -1 for j in range(m)], {e: alone.run(cuda, resident)}, {e: alone}
        )


def test_full_bf16_head_rows_are_the_row_alone(cuda, full_head):
    rng = np.random.default_rng()
    f = full_head
    resident = {"w": f["pw"]}
    case = head_case(rng, False, 17, VOCAB, HIDDEN, 2, w=f["w"])
    g = case.run(cuda, resident)
    check_commit(case, g)
    for e in case.live:
        assert (token_of(case, g, e), flag_of(case, g, e)) == expected_token(logits_of(case, g)[e])
        check_row_is_row_alone(case, g, e, row_alone(cuda, case.row(e), resident), f"row {e}")


# ---- the sharded path -------------------------------------------------------------------------------


GEMV_CASES = [(1, 37, 64), (3, 301, 4096), (17, 17, 37), (64, 1000, 4096), (200, 129, 4112), (256, 50, 512)]


@pytest.mark.parametrize("m,n,k", GEMV_CASES)
def test_gemv_fp8w_batch(cuda, m, n, k):
    """Against the twin (the GEMV bound); every row bit-identical to gemv_fp8w's for that row
    alone and to the batched head's logits of the same weights and x."""
    rng = np.random.default_rng()
    case = head_case(rng, True, m, n, k)
    q, s, x = case.w, case.s, case.x

    def run(gpu, q, s, x, y):
        gemv_fp8w_batch(gpu, q, s, x, y, m, n, k)

    bufs = {"q": q, "s": s, "x": x, "y": 2 * m * n}
    g, h = run_bufs(cuda, run, bufs), run_bufs(HostBackend(), run, bufs)
    gy, hy = g["y"].view(BF16).reshape(m, n), h["y"].view(BF16).reshape(m, n)
    assert_dot_close(
        gy, hy.astype(np.float64), dot_bound(abs_dot(x, wd64(case)), hy, k, 2), f"m={m} n={n} k={k}"
    )
    head = case.run(cuda)
    for e in sorted({0, m // 3, m - 1}):
        one = run_bufs(
            cuda,
            lambda gpu, q, s, x, y: gemv_fp8w(gpu, q, s, x, y, 1, n, k),
            {**bufs, "x": x[e : e + 1], "y": 2 * n},
        )
        assert one["y"].tobytes() == gy[e].tobytes(), f"row {e}: gemv_fp8w_batch != gemv_fp8w"
    for e in case.live:
        assert logits_of(case, head)[e].tobytes() == gy[e].tobytes(), (
            f"row {e}: gemv_fp8w_batch != the head's logits"
        )


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_chain_commits_what_one_rank_commits(cuda, world):
    """Per rank gemv_fp8w_batch, argmax_bf16_batch and argmax_pack_batch on the device, the u64
    MAX over ranks on the host (the all-reduce), draft_commit_batch on the device: every byte the
    single-rank head_argmax_batch writes, with a tie across a shard boundary, NaN and Inf rows."""
    rng = np.random.default_rng()
    n, k, m = 5003, 256, 23
    w = random_bf16(rng, (n, k), exp_lo=-6)
    per = -(-n // world)
    shards = [slice(r * per, min(n, (r + 1) * per)) for r in range(world)]
    a, b = shards[0].stop - 1, shards[1].start + 1
    w[a] = w[b] = 8.0
    case = head_case(rng, True, m, n, k, pads=5, w=w)
    case.entries[:3, 0] = [5000, 5001, 5002]
    x = case.x.astype(np.float32)
    x[0] = np.abs(x[0])
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    case.x = x.astype(BF16)
    whole = case.run(cuda)
    check_commit(case, whole)
    assert token_of(case, whole, 0) == a and flag_of(case, whole, 1) == draft_head.NONFINITE_NAN
    keys = np.zeros(m, np.uint64)
    lg = logits_of(case, whole)
    for r in shards:
        nr = r.stop - r.start

        def rank(gpu, q, s, x, y, idx, val, key, r=r, nr=nr):
            gemv_fp8w_batch(gpu, q, s, x, y, m, nr, k)
            argmax_bf16_batch(gpu, y, idx, val, m, nr)
            draft_head.argmax_pack_batch(gpu, idx, val, key, r.start, m)

        bufs = {
            "q": case.w[r],
            "s": case.s[r],
            "x": case.x,
            "y": 2 * m * nr,
            "idx": 4 * m,
            "val": 4 * m,
            "key": 8 * m,
        }
        o = run_bufs(cuda, rank, bufs)
        y = o["y"].view(BF16).reshape(m, nr)
        for e in case.live:
            assert y[e].tobytes() == lg[e, r].tobytes(), f"rank rows {r}, row {e}: logits"
        keys = np.maximum(keys, o["key"].view(np.uint64))

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

    bufs = {"keys": keys, "entries": case.entries, "drafts": case.drafts, "host": 4 * m * case.kmax}
    sharded = run_bufs(cuda, commit, {**bufs, "flags": np.zeros((m, 4), np.uint8)})
    for name in ("entries", "drafts", "host", "flags"):
        assert sharded[name].tobytes() == whole[name].tobytes(), f"{name} differ from one rank's"


@pytest.mark.parametrize("m", [1, 3, 17, 200])
@pytest.mark.parametrize("n", [1, 7, 8191, 19360])
def test_argmax_bf16_batch_exact(cuda, m, n):
    """Rows of numbers, ties, NaN, all NaN, +-inf; n odd makes every other row start unaligned."""
    rng = np.random.default_rng()
    x = random_bf16(rng, (m, n)).astype(np.float32)
    for e in range(m):
        kind = e % 5
        if kind == 1:
            x[e] = np.nan
        elif kind == 2 and n > 2:
            x[e, sorted(rng.choice(n, 3, replace=False))] = 2.0**12
        elif kind == 3:
            x[e, rng.choice(n, max(1, n // 3), replace=False)] = np.nan
            x[e, rng.integers(0, n)] = -np.inf
        elif kind == 4:
            x[e, rng.choice(n, max(1, n // 7), replace=False)] = np.inf
    x = x.astype(BF16)

    def run(gpu, x, i, v):
        argmax_bf16_batch(gpu, x, i, v, m, n)

    bufs = {"x": x, "i": 4 * m, "v": 4 * m}
    g, h = run_bufs(cuda, run, bufs), run_bufs(HostBackend(), run, bufs)
    assert g["i"].tobytes() == h["i"].tobytes()
    gv, hv = g["v"].view(np.float32), h["v"].view(np.float32)
    assert ((gv == hv) | (np.isnan(gv) & np.isnan(hv))).all()


def test_argmax_pack_and_draft_commit_batch_exact(cuda):
    rng = np.random.default_rng()
    m, kmax = 200, 3
    vals = rng.standard_normal(m).astype(np.float32)
    vals[::7] = np.nan
    vals[1::11] = np.inf
    vals[2::13] = -0.0
    idx = rng.integers(0, 19360, m).astype(np.uint32)
    idx[3::17] = 0xFFFFFFFF  # an empty shard
    ent = make_entries(rng, m, 40)
    drafts = rng.integers(0, 154880, (m, kmax)).astype(np.uint32)

    def run(gpu, i, v, keys, entries, drafts, host, flags):
        draft_head.argmax_pack_batch(gpu, i, v, keys, 77440, m)
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
            flag_byte=1,
        )

    bufs = {"i": idx, "v": vals, "keys": 8 * m, "entries": ent, "drafts": drafts, "host": 4 * m * kmax}
    bufs["flags"] = np.zeros((m, 4), np.uint8)
    g, h = run_bufs(cuda, run, bufs), run_bufs(HostBackend(), run, bufs)
    for name in ("keys", "entries", "drafts", "host", "flags"):
        assert g[name].tobytes() == h[name].tobytes(), name


# ---- the tensor-core heads: head_argmax_fp8_mma and head_argmax_fp8_mma_v1 --------------------------

MMA_CASES = [
    (1, 37, 64, 0),
    (3, 1000, 4096, 1),
    (17, 100_003, 64, 4),
    (9, 333, 4160, 2),
    (64, 777, 256, 10),
    (200, 129, 512, 50),
    (256, 40, 64, 0),
    # x in double-buffered k-slices (mma_tiling; v1: mma_v1_tiling): 12 rows of 4096 (v1 31, 31,
    # 2; whole), 30 rows of 4096 (28, 28, 8), 64 of 1024 (v1 5, 5, 5, 1: a slice shorter than a
    # load batch; whole), 64 of 2048 (13, 13, 6), 64 of 1728 (13, 13, 1: a one-superblock slice
    # after an odd start), 3 tiles of 44 / 43 rows (19, 19, 19, 7), 4 of 64 at k = 4160 (65
    # superblocks: 5 x 13) with fewer weight groups than blocks
    (12, 3000, 4096, 2),
    (30, 3000, 4096, 3),
    (64, 1500, 1024, 5),
    (64, 1500, 2048, 5),
    (64, 1100, 1728, 6),
    (130, 700, 4096, 13),
    (256, 300, 4160, 20),
    # awkward tilings: 2 tiles of 33 / 32 rows (5 and 4 column groups in one launch), of 64 / 63,
    # of 64 and 64, 3 of 43; n past a warp's first M tile (513 = 2 x 256 + 1, 257) or inside its
    # second (600, 1000)
    (65, 1000, 4096, 3),
    (127, 600, 4096, 7),
    (128, 513, 4096, 0),
    (129, 257, 4096, 9),
]


@pytest.mark.parametrize("v1", [False, True])
@pytest.mark.parametrize("m,n,k,pads", MMA_CASES)
def test_mma_head_against_the_twin(cuda, m, n, k, pads, v1):
    rng = np.random.default_rng()
    case = head_case(
        rng, True, m, n, k, pads, draft_index=int(rng.integers(0, 4)), flag_byte=int(rng.integers(0, 4))
    )
    case.mma, case.mma_v1 = True, v1
    g, h = case.run(cuda), case.run(HostBackend())
    check_commit(case, g)
    check_commit(case, h)
    check_against_twin(case, g, h, f"mma{'_v1' if v1 else ''} m={m} n={n} k={k}")


@pytest.mark.parametrize("v1", [False, True])
def test_mma_ties_nan_and_inf_rows(cuda, v1):
    rng = np.random.default_rng()
    n, k = 1000, 256
    w = random_bf16(rng, (n, k), exp_lo=-6)
    a, b = sorted(rng.choice(np.arange(1, n), 2, replace=False))
    w[a] = w[b] = 8.0
    xp = np.abs(random_bf16(rng, k, exp_lo=-1).astype(np.float32))
    x = np.stack([xp, xp, xp, -xp]).astype(BF16)
    x[1, 7] = np.nan
    x[2, 9] = np.inf
    case = head_case(rng, True, 4, n, k, w=w)
    case.x, case.mma, case.mma_v1 = x, True, v1
    case, rows = case.subset([0, 1, 2, 3], pad_at=[2])
    g = case.run(cuda)
    check_commit(case, g)
    for j, e in enumerate(rows):
        if e < 0:
            continue
        tok, flag = token_of(case, g, j), flag_of(case, g, j)
        assert (tok, flag) == expected_token(logits_of(case, g)[j]), f"row {e}"
        if e == 0:
            assert (tok, flag) == (a, 0)
        elif e == 1:
            assert (tok, flag) == (0, draft_head.NONFINITE_NAN)
        elif e == 2:
            gl = logits_of(case, g)[j].astype(np.float32)
            assert flag == draft_head.NONFINITE_INF and tok == int(np.flatnonzero(gl == np.inf)[0])
        else:
            assert tok not in (a, b) and flag == 0


def _mma_invariance(cuda, pool_weights, sizes, v1: bool, repeats: bool) -> None:
    """The pool's 200 rows launched alone (m = 1), then batches of each size in ``sizes`` in
    shuffled orders with padding entries anywhere (m // 5 of them; with ``repeats`` the live rows
    drawn with replacement, so a batch may hold more rows than the pool and a row twice): every
    row has the bits it had alone."""
    rng = np.random.default_rng()
    base, resident = pool_weights[True]
    base = replace(base, mma=True, mma_v1=v1)
    refcase = {e: base.row(e) for e in range(base.m)}
    ref = {e: refcase[e].run(cuda, resident) for e in range(base.m)}
    for m in sizes:
        pads = m // 5
        if repeats:
            order = [int(v) for v in rng.integers(0, base.m, m - pads)]
        else:
            order = [int(v) for v in rng.permutation(base.m)[: m - pads]]
        case, rows = base.subset(order, pad_at=[int(p) for p in rng.integers(0, len(order) + 1, pads)])
        out = case.run(cuda, resident)
        check_commit(case, out)
        check_rows_equal(case, out, rows, ref, refcase)


@pytest.mark.parametrize("v1", [False, True])
def test_mma_batch_invariance_bit_for_bit(cuda, pool_weights, v1):
    """As test_batch_invariance_bit_for_bit for the tensor-core kernels: 200 rows alone, then in
    batches of 17, 200, 1, 64 and 3 (tiles of up to 64 rows, a row in any column of any column
    group; x staged once per block at 1, 3 and 17 rows (v1: 1 and 3), in double-buffered k-slices
    at 50 and 64)."""
    _mma_invariance(cuda, pool_weights, (17, 200, 1, 64, 3), v1, repeats=False)


def test_mma_batch_invariance_at_awkward_tilings(cuda, pool_weights):
    """head_argmax_fp8_mma at m = 65 (2 tiles of 33 / 32 rows: 5 and 4 column groups), 127, 128,
    129 (3 tiles of 43), 200 (4 tiles of 50) and 256 (4 of 64), rows drawn with replacement: every
    row has the bits it had alone."""
    _mma_invariance(cuda, pool_weights, (65, 127, 128, 129, 200, 256), False, repeats=True)


# The slicings each kernel is launched with below: bytes of x a row of the tile for all of k (whole)
# or two buffers of S superblocks.
def _mma_per_row(v1: bool, k: int) -> tuple[int, ...]:
    if v1:
        return (2 * k + 16, *(2 * (128 * sb + 16) for sb in (1, 3, 7, 13)))
    return (2 * k, *(256 * sb for sb in (1, 3, 7, 13)))


@pytest.mark.parametrize("v1,expect", [(False, 54), (True, 45)])
def test_mma_bits_do_not_depend_on_the_slicing_the_tiles_or_the_grid(cuda, v1, expect):
    """One batch of 100 rows launched directly with other tile counts (2, 3, 7, 10), other shared
    memory (all of x once, or slices of 1, 3, 7 and 13 superblocks: up to 64 steps a weight group),
    at most the kernel's budget as the launch helper, and other grids (one block per tile, an odd
    stride, more blocks than weight groups): every live row's logits and every commit byte are
    those of the launch helper's shape."""
    rng = np.random.default_rng()
    m, n, k = 100, 2000, HIDDEN
    case = head_case(rng, True, m, n, k, pads=9, draft_index=2, flag_byte=1)
    case.mma, case.mma_v1 = True, v1
    decl = draft_head.HEAD_ARGMAX_FP8_MMA_V1 if v1 else draft_head.HEAD_ARGMAX_FP8_MMA
    budget = draft_head.MMA_V1_X_SMEM_MAX if v1 else draft_head.MMA_X_SMEM_MAX
    group_rows = draft_head.MMA_V1_GROUP_ROWS if v1 else draft_head.MMA_GROUP_ROWS
    resident = {"w": cuda.alloc(case.w.nbytes), "sc": cuda.alloc(case.s.nbytes)}
    cuda.copy_h2d(resident["w"], np.ascontiguousarray(case.w))
    cuda.copy_h2d(resident["sc"], case.s)
    try:
        ref = case.run(cuda, resident)
        check_commit(case, ref)
        live = case.live
        groups = -(-n // group_rows)
        ran = 0
        for tiles in (2, 3, 7, 10):
            rows = -(-m // tiles)
            for per_row in _mma_per_row(v1, k):
                smem = rows * per_row
                if smem > budget:
                    continue
                for blocks in (1, 5, groups + 3):

                    def run(
                        gpu, w, x, logits, keys, ctr, entries, drafts, host, flags, sc, tiles=tiles, smem=smem
                    ):
                        args = (
                            w,
                            sc,
                            x,
                            logits,
                            keys,
                            ctr,
                            entries,
                            drafts,
                            case.draft_index,
                            case.kmax,
                            host,
                        )
                        args += (int(case.publish), m, n, k, flags, case.flag_byte, tiles)
                        launch(gpu, gpu.kernel(*decl.key), tiles * blocks, 256, *args, smem=smem)

                    out = run_bufs(cuda, run, {**case.bufs(), **resident})
                    what = f"tiles={tiles} bytes/row={per_row} blocks/tile={blocks}"
                    check_commit(case, out)
                    assert logits_of(case, out)[live].tobytes() == logits_of(case, ref)[live].tobytes(), what
                    for name in ("entries", "drafts", "host", "flags", "keys", "ctr"):
                        assert out[name].tobytes() == ref[name].tobytes(), f"{what}: {name}"
                    ran += 1
        assert ran == expect
    finally:
        for p in resident.values():
            cuda.free(p)


@pytest.mark.parametrize("m,pads", [(1, 0), (17, 2), (64, 5)])
def test_mma_full_fp8_head(cuda, full_head, m, pads):
    rng = np.random.default_rng()
    f = full_head
    resident = {"w": f["pq"], "sc": f["ps"]}
    case = head_case(rng, True, m, VOCAB, HIDDEN, pads, wq=(f["q"], f["s"]))
    case.mma = True
    g = case.run(cuda, resident)
    check_commit(case, g)
    live = case.live
    xl = case.x[live]
    ref = (xl.astype(np.float32) @ f["wd"].T).astype(np.float64)
    assert_dot_close(
        logits_of(case, g)[live], ref, dot_bound(abs_dot(xl, f["wd"]), ref, HIDDEN, 2), f"mma m={m}"
    )
    for e in live:
        assert (token_of(case, g, e), flag_of(case, g, e)) == expected_token(logits_of(case, g)[e])
        alone = case.row(e)
        check_rows_equal(
            case, g, [e if j == e else -1 for j in range(m)], {e: alone.run(cuda, resident)}, {e: alone}
        )


@pytest.mark.parametrize("m,pads", [(1, 0), (17, 3), (64, 0), (100, 7), (256, 11)])
def test_mma_equals_mma_v1_bit_for_bit(cuda, full_head, m, pads):
    """The full 154880 x 4096 FP8 head (the real slicing and grid: 5 or 13 slices a weight group,
    a tile's blocks over 605 or 1210 weight groups): every live row's logits and every byte of
    the commit (entries, drafts, host drafts, flags, keys, counter) of head_argmax_fp8_mma are
    head_argmax_fp8_mma_v1's. The weights come from quantize_fp8, so no E4M3 NaN code (which the
    two widen differently) is among them."""
    rng = np.random.default_rng()
    f = full_head
    resident = {"w": f["pq"], "sc": f["ps"]}
    case = head_case(rng, True, m, VOCAB, HIDDEN, pads, wq=(f["q"], f["s"]))
    case.mma = True
    new = case.run(cuda, resident)
    old = replace(case, mma_v1=True).run(cuda, resident)
    check_commit(case, new)
    live = case.live
    assert logits_of(case, new)[live].tobytes() == logits_of(case, old)[live].tobytes(), f"m={m}: logits"
    for name in ("entries", "drafts", "host", "flags", "keys", "ctr"):
        assert new[name].tobytes() == old[name].tobytes(), f"m={m}: {name}"


@pytest.mark.parametrize("m", [1, 64, 100])
def test_mma_equals_mma_v1_at_every_e4m3_code(cuda, m):
    """Weight bytes drawn uniformly from every E4M3 code but the two NaN codes (subnormals, zeros of
    both signs, +-448; what quantize_fp8 never gives in such a mix), random row scales: the two
    kernels' widenings give the same BF16 operands, so the same logits and commits bit for bit."""
    rng = np.random.default_rng()
    n, k = 3000, HIDDEN
    codes = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)
    q = rng.choice(codes, (n, k)).view(FP8)
    s = (2.0 ** rng.uniform(-12, -4, n)).astype(np.float32)
    case = head_case(rng, True, m, n, k, pads=m // 7, wq=(q, s))
    case.mma = True
    new = case.run(cuda)
    old = replace(case, mma_v1=True).run(cuda)
    check_commit(case, new)
    live = case.live
    assert logits_of(case, new)[live].tobytes() == logits_of(case, old)[live].tobytes(), f"m={m}: logits"
    for name in ("entries", "drafts", "host", "flags", "keys", "ctr"):
        assert new[name].tobytes() == old[name].tobytes(), f"m={m}: {name}"


# ---- what the heads measure (printed; run with -s) -------------------------------------------------


def test_report_head_times(cuda, full_head):
    """Device time per launch of the full FP8 head (154880 x 4096, 634 MB) for the CUDA-core
    batched kernel and the tensor-core ones (head_argmax_fp8_mma and v1), at m = 1, 2, 4, 8, 16,
    32, 64, 128, 256 (bench/bench_head.py times the launch alone in a graph):
    printed for the lead (pytest -s -k report_head_times); asserts only that each ran. Launches
    back to back on one stream between two events (PDL on, as in the graphs), so a launch's time
    includes its overlap with the one before."""
    f = full_head
    rng = np.random.default_rng()
    reps = 20
    rows = []
    for m in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        case = head_case(rng, True, m, VOCAB, HIDDEN, 0, wq=(f["q"], f["s"]))
        times = {}
        for kind in ["batch", "mma", "mma_v1"]:
            case.mma, case.mma_v1 = kind != "batch", kind == "mma_v1"

            def timed(gpu, w, x, logits, keys, ctr, entries, drafts, host, flags, sc=None, kind=kind):
                def once():
                    case.launch(gpu, w, x, logits, keys, ctr, entries, drafts, host, flags, sc)

                once()
                once()
                start, end = gpu.event_create(), gpu.event_create()
                gpu.event_record(start)
                for _ in range(reps):
                    once()
                gpu.event_record(end)
                gpu.synchronize()
                times[kind] = gpu.event_elapsed_ms(start, end) / reps
                gpu.event_destroy(start)
                gpu.event_destroy(end)

            run_bufs(cuda, timed, {**case.bufs(), "w": f["pq"], "sc": f["ps"]})
            assert times[kind] > 0
        rows.append((m, times))
    floor = VOCAB * HIDDEN / 4.8e12 * 1e3
    print(f"\nFP8 head 154880 x 4096, ms per launch (mean of {reps}); 634 MB at 4.8 TB/s = {floor:.3f} ms")
    print(f"{'m':>4} {'batch':>8} {'mma':>8} {'mma_v1':>8}  batch/floor  mma/floor  v1/floor")
    for m, t in rows:
        print(
            f"{m:4d} {t['batch']:8.3f} {t['mma']:8.3f} {t['mma_v1']:8.3f}  {t['batch'] / floor:11.2f}"
            f"  {t['mma'] / floor:9.2f}  {t['mma_v1'] / floor:8.2f}"
        )
