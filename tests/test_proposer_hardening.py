"""The proposer's refusals on the host backend: non-finite input and weights, a state of another
proposer, calls after close, non-integer positions and tokens, one error type, one thread at a
time, and the bound on max_draft_tokens. Each refusal leaves the state as it was: rows,
``last_pair_key``, the caches and the live bytes."""

from __future__ import annotations

import shutil
import sys
import threading

import numpy as np
import pytest

from model.config import tiny
from model.dsa import DsaSizingError
from model.kernels import draft_head
from model.kernels.mtp_input import HIDDEN_NONFINITE, TOKEN_OUTSIDE
from model.proposer import ProposerError, ProposerOptions
from model.tensors import first_nonfinite
from model.weights import WeightError
from runtime.dtypes import BF16
from runtime.errors import OutOfMemoryError
from runtime.host_backend import HostBackend
from runtime.kernels.all_finite_bf16 import NONE, all_finite_bf16
from tests.proposer_fixtures import (
    assert_same_caches,
    bf16_weights,
    cache_snapshot,
    make_proposer,
    upload_rows,
)

CFG = tiny(index_topk=8, index_kpool=2, max_context=96)
WEIGHTS = bf16_weights(CFG, seed=3)
H, V = CFG.hidden_size, CFG.vocab_size


class World:
    def __init__(self, seed: int, n: int) -> None:
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, V, n + 1)
        self.hiddens = rng.standard_normal((n + 1, H)).astype(np.float32)


def feed(prop, st, world: World, base: int, n: int, hiddens: np.ndarray | None = None) -> int:
    p = upload_rows(prop.gpu, world.hiddens[base : base + n] if hiddens is None else hiddens)
    try:
        return prop.catchup_drafter(st, world.tokens[base : base + n + 1], p, base)
    finally:
        prop.gpu.free(p)


def fed(seed: int, rows: int, states: int = 1, **opts):
    """A proposer sized for 64 rows, World(seed), and ``states`` states each fed its rows
    0..rows-1: ``prop, world, *states``."""
    prop = make_proposer(CFG, WEIGHTS, served=64, **opts)
    world = World(seed, 64)
    sts = [prop.alloc_state() for _ in range(states)]
    for st in sts:
        feed(prop, st, world, 0, rows)
    return (prop, world, *sts)


def propose(prop, st, world: World, pos: int, k: int, hidden: np.ndarray | None = None) -> list[int]:
    p = upload_rows(prop.gpu, world.hiddens[pos : pos + 1] if hidden is None else hidden)
    try:
        return prop.propose(st, int(world.tokens[pos + 1]), p, pos, k)
    finally:
        prop.gpu.free(p)


def snapshot(prop, st):
    return st.rows, st.last_drafted, cache_snapshot(prop, st), prop.gpu.stats().live_bytes


def assert_unchanged(prop, st, snap) -> None:
    rows, drafted, caches, live = snap
    assert st.rows == rows and st.last_drafted == drafted
    assert prop.last_pair_key(st) == (rows - 1 if rows else None)
    assert_same_caches(caches, cache_snapshot(prop, st))
    assert prop.gpu.stats().live_bytes == live


# ---- 1. non-finite input ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fp8_head", [False, True])
def test_a_nonfinite_target_hidden_is_refused_and_changes_nothing(bad, fp8_head):
    prop, world, st, ref = fed(1, 12, 2, fp8_head=fp8_head)
    hid = world.hiddens[12:13].copy()
    hid[0, 5] = bad
    snap = snapshot(prop, st)
    with pytest.raises(ProposerError, match=rf"slot {st.slot} at position 12: target_hidden is not finite"):
        propose(prop, st, world, 12, 3, hidden=hid)
    assert_unchanged(prop, st, snap)
    assert (prop.step.drafts_host[0, :3] < V).all(), "even a refused step committed only valid token ids"
    # nothing of the refused step leaks into the next: the drafts of a state that never saw it
    assert propose(prop, st, world, 12, 3) == propose(prop, ref, world, 12, 3)
    prop.close()


def test_a_refused_propose_behind_the_drafter_keeps_its_rewind():
    """The drafter was ahead of ``position``: the step rewrote rows ``position..``, so the rewind
    stands (as the docstring says), rows below it and their caches are untouched."""
    prop = make_proposer(CFG, WEIGHTS, served=64)
    world = World(2, 64)
    st, ref = prop.alloc_state(), prop.alloc_state()
    feed(prop, st, world, 0, 20)
    propose(prop, st, world, 20, 2)  # rows 22, two drafted
    feed(prop, ref, world, 0, 15)
    hid = world.hiddens[15:16].copy()
    hid[0, 0] = np.nan
    live = prop.gpu.stats().live_bytes
    with pytest.raises(ProposerError, match="not finite"):
        propose(prop, st, world, 15, 2, hidden=hid)
    assert st.rows == 15 and st.last_drafted == 0 and prop.last_pair_key(st) == 14
    assert_same_caches(cache_snapshot(prop, ref), cache_snapshot(prop, st))
    assert prop.gpu.stats().live_bytes == live
    with pytest.raises(ProposerError, match="outside 0..0"):
        prop.after_verify(st, 1)  # nothing left to trim
    assert propose(prop, st, world, 15, 3) == propose(prop, ref, world, 15, 3)
    prop.close()


def test_a_nonfinite_context_row_is_refused_before_anything_is_written():
    prop, world, st, ref = fed(3, 6, 2)
    for bad in (np.nan, np.inf):
        rows = world.hiddens[6:14].copy()
        rows[3, 7] = bad
        rows[5, 0] = bad
        snap = snapshot(prop, st)
        with pytest.raises(
            ProposerError, match=rf"slot {st.slot}: hidden row 3 \(drafter row 9\) is not finite"
        ):
            feed(prop, st, world, 6, 8, hiddens=rows)
        assert_unchanged(prop, st, snap)
    # the same rows, finite, then give exactly the state that never saw the bad ones
    assert feed(prop, st, world, 6, 8) == feed(prop, ref, world, 6, 8) == 8
    assert_same_caches(cache_snapshot(prop, ref), cache_snapshot(prop, st))
    assert propose(prop, st, world, 14, 3) == propose(prop, ref, world, 14, 3)
    prop.close()


def test_prefill_with_one_nan_row_is_refused_and_poisons_nothing():
    prop = make_proposer(CFG, WEIGHTS, served=64)
    world = World(4, 64)
    st, ref = prop.alloc_state(), prop.alloc_state()
    rows = world.hiddens[:10].copy()
    rows[9, 3] = np.nan
    p = upload_rows(prop.gpu, rows)
    with pytest.raises(ProposerError, match="hidden row 9"):
        prop.prefill_drafter(st, world.tokens[:11], p)
    prop.gpu.free(p)
    assert st.rows == 0
    feed(prop, st, world, 0, 10)
    feed(prop, ref, world, 0, 10)
    for pos in (10, 11, 12):
        assert propose(prop, st, world, pos, 2) == propose(prop, ref, world, pos, 2)
        prop.after_verify(st, 0)
        prop.after_verify(ref, 0)
    prop.close()


def test_the_step_flags_say_which_input_was_not_finite():
    """Draft 1's input is the target's hidden, drafts 2..k the drafter's own; the head flags a
    winning logit that is not a number. The host twins raise the same bytes as the kernels."""
    prop, world, st = fed(5, 8)
    hid = world.hiddens[8:9].copy()
    hid[0, 1] = np.nan
    with pytest.raises(ProposerError):
        propose(prop, st, world, 8, 3, hidden=hid)
    flags = prop.step.flags_host[0].tolist()
    assert flags[0] == HIDDEN_NONFINITE  # the target's hidden
    assert flags[1] == HIDDEN_NONFINITE  # draft 2's hidden is draft 1's NaN output
    assert flags[2] == draft_head.NONFINITE_NAN  # every logit NaN: token 0, flagged
    assert prop.step.drafts_host[0, :3].tolist() == [0, 0, 0]
    prop.close()


def first_nonfinite_row(gpu, x, rows, h, out):
    """all_finite_bf16's answer, waited for and read back: None when every row is finite."""
    all_finite_bf16(gpu, x, rows, h, out)
    gpu.synchronize()
    got = np.empty(1, np.uint32)
    gpu.copy_d2h(got, out)
    return None if int(got[0]) == NONE else int(got[0])


def test_host_twins_of_the_checks():
    gpu = HostBackend()
    x = np.ones((4, 6), np.float32)
    p, out = upload_rows(gpu, x), gpu.alloc(4)
    assert first_nonfinite_row(gpu, p, 4, 6, out) is None
    x[2, 5], x[3, 0] = np.inf, np.nan
    gpu.copy_h2d(p, x.astype(BF16))
    assert first_nonfinite_row(gpu, p, 4, 6, out) == 2
    gpu.memset(out, 0, 4)  # the kernel only lowers out (atomicMin): the helper resets it first
    assert first_nonfinite_row(gpu, p, 4, 6, out) == 2
    out_host = np.empty(1, np.uint32)
    gpu.copy_d2h(out_host, out)
    assert int(out_host[0]) == 2 != NONE
    assert draft_head.key_nonfinite(draft_head.pack_key(np.nan, 3)) == draft_head.NONFINITE_NAN
    assert draft_head.key_nonfinite(draft_head.pack_key(-np.inf, 3)) == draft_head.NONFINITE_INF
    assert draft_head.key_nonfinite(draft_head.pack_key(-3.0, 3)) == 0
    assert draft_head.pack_key(-np.inf, 900) > draft_head.pack_key(np.nan, 0), "NaN is below -inf"
    assert TOKEN_OUTSIDE != HIDDEN_NONFINITE


@pytest.mark.parametrize("nan_ranks", [(0, 1), (1,)])
def test_a_nonfinite_hidden_is_refused_on_every_rank(nan_ranks):
    """Sharded over two ranks, a NaN in the target's hidden (on every rank, or on one) is refused
    on every rank alike, in lockstep (the head's flag comes from the all-reduced key), and the next
    propose drafts the same on both."""
    from model.proposer import MtpProposer
    from tests.test_sharded import run_ranks

    cfg = tiny(vocab_size=96, index_topk=8, index_kpool=2, max_context=64)
    w = bf16_weights(cfg, 5)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 96, 20)
    hid = rng.standard_normal((20, cfg.hidden_size)).astype(np.float32)

    def body(r, gpu, comm):
        prop = MtpProposer(
            gpu,
            cfg.with_parallel(r, 2),
            w,
            ProposerOptions(served_max_seq_len=64, o_proj_groups=4),
            comm=comm,
        )
        st = prop.alloc_state()
        p = upload_rows(gpu, hid[:10])
        prop.catchup_drafter(st, tokens[:11], p, 0)
        gpu.free(p)
        h = hid[10:11].copy()
        if r in nan_ranks:
            h[0, 2] = np.nan
        p, clean = upload_rows(gpu, h), upload_rows(gpu, hid[10:11])
        try:
            prop.propose(st, int(tokens[11]), p, 10, 2)
            msg = None
        except ProposerError as e:
            msg = str(e)
        rows = st.rows
        drafts = prop.propose(st, int(tokens[11]), clean, 10, 2)
        gpu.free(p)
        gpu.free(clean)
        prop.close()
        return msg, rows, drafts

    out, errs = run_ranks(2, body)
    assert errs == [None, None], errs
    for r, (msg, rows, _) in enumerate(out):
        assert msg is not None and "not finite" in msg, f"rank {r} did not refuse: {msg}"
        assert rows == 10
    assert out[0][2] == out[1][2]


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.{L}.eh_proj.weight",
        "model.layers.{L}.mlp.experts.1.up_proj.weight",
        "model.layers.{L}.self_attn.kv_a_layernorm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.{L}.mlp.gate.e_score_correction_bias",
    ],
)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_weights_are_refused_at_load_by_name(name, bad):
    name = name.format(L=CFG.mtp_layer_index)
    w = dict(WEIGHTS)
    a = np.array(w[name])
    a.reshape(-1)[a.size // 2] = bad
    w[name] = a
    gpu = HostBackend()
    with pytest.raises(WeightError, match=rf"tensor '{name}' holds a non-finite value"):
        make_proposer(CFG, w, gpu=gpu, served=64)
    assert gpu.stats().live_bytes == 0, "a refused load frees what it had uploaded"


def test_first_nonfinite_covers_the_weight_dtypes():
    from runtime.dtypes import FP8

    for dt in (BF16, np.float32, np.float16, FP8):
        a = np.zeros(40, np.float32).astype(dt)
        assert first_nonfinite(a) is None
        a[17] = np.nan
        assert first_nonfinite(a) == 17
    assert first_nonfinite(np.arange(5)) is None
    assert first_nonfinite(np.zeros(0, BF16)) is None
    big = np.zeros((3, 1 << 21), BF16)  # more than one slice of the bit test
    big[2, 5] = -np.inf
    assert first_nonfinite(big) == 2 * (1 << 21) + 5


def test_cli_prints_a_nan_checkpoint_as_one_line(tmp_path, capsys):
    from model.checkpoint import Checkpoint
    from model.cli import DEFAULT_CHECKPOINT, main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_CHECKPOINT, ckpt)
    c = Checkpoint(ckpt)
    name = f"model.layers.{c.config.num_hidden_layers}.eh_proj.weight"  # logical; stored:
    info = c.info(c.disk_name(name))
    with open(info.path, "r+b") as f:
        f.seek(info.begin + 2 * 12345)
        f.write(np.array([np.nan], np.float32).astype(BF16).tobytes())
    assert main(["generate", "--checkpoint", str(ckpt), "-q", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert name in err and "non-finite" in err


# ---- 2. a state belongs to its proposer ---------------------------------------------------------


def test_a_state_of_another_proposer_is_refused_by_every_call():
    gpu = HostBackend()
    p, q = make_proposer(CFG, WEIGHTS, gpu=gpu, served=64), make_proposer(CFG, WEIGHTS, gpu=gpu, served=64)
    world = World(6, 64)
    mine, theirs = p.alloc_state(), q.alloc_state()
    feed(p, mine, world, 0, 10)
    feed(q, theirs, world, 0, 4)
    p_snap, q_snap = snapshot(p, mine), snapshot(q, theirs)
    hid = upload_rows(gpu, world.hiddens[4:5])
    calls = [
        lambda: feed(p, theirs, world, 4, 3),
        lambda: p.prefill_drafter(theirs, world.tokens[:3], hid),
        lambda: p.propose(theirs, 1, hid, 4, 2),
        lambda: p.after_verify(theirs, 0),
        lambda: p.rewind_to(theirs, 2),
        lambda: p.drafter_rows(theirs),
        lambda: p.last_pair_key(theirs),
        lambda: p.free_state(theirs),
        lambda: p.propose(object(), 1, hid, 4, 2),
    ]
    for call in calls:
        with pytest.raises(ProposerError, match=rf"{q.label}, not {p.label}|expected a ProposerState"):
            call()
        gpu.free(hid)  # live bytes as at the snapshots
        assert_unchanged(p, mine, p_snap)
        assert_unchanged(q, theirs, q_snap)
        hid = upload_rows(gpu, world.hiddens[4:5])
    gpu.free(hid)
    p.close()
    q.close()
    assert gpu.stats().live_bytes == 0


# ---- 3. nothing after close ---------------------------------------------------------------------


def test_calls_after_close_are_refused_and_close_twice_is_a_no_op():
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, served=64)
    st = prop.alloc_state()
    prop.close()
    assert gpu.stats().live_bytes == 0
    prop.close()
    with pytest.raises(ProposerError, match="closed"):
        prop.alloc_state()
    assert gpu.stats().live_bytes == 0 and gpu.stats().live_allocations == 0, "nothing leaked"
    world = World(7, 8)
    for call in (
        lambda: feed(prop, st, world, 0, 3),
        lambda: prop.propose(st, 1, None, 0, 1),
        lambda: prop.after_verify(st, 0),
        lambda: prop.rewind_to(st, 0),
        lambda: prop.drafter_rows(st),
        lambda: prop.last_pair_key(st),
    ):
        with pytest.raises(ProposerError, match="closed"):
            call()
    prop.free_state(st)  # close freed it: a second free is a no-op
    assert gpu.stats().live_bytes == 0


# ---- 4. integers --------------------------------------------------------------------------------


BAD_INTS = [20.0, True, np.float64(3.0), "3", None, np.bool_(False)]


@pytest.mark.parametrize("bad", BAD_INTS, ids=repr)
@pytest.mark.parametrize("arg", ["position", "last_token", "k"])
def test_propose_refuses_a_non_integer(arg, bad):
    prop, world, st = fed(8, 20)
    hid = upload_rows(prop.gpu, world.hiddens[20:21])
    kw = dict(last_token=int(world.tokens[21]), target_hidden=hid, position=20, k=2)
    kw[arg] = bad
    snap = snapshot(prop, st)
    with pytest.raises(ProposerError, match=rf"{arg} must be an integer"):
        prop.propose(st, **kw)
    assert_unchanged(prop, st, snap)
    kw[arg] = {"position": np.int64(20), "last_token": np.uint32(world.tokens[21]), "k": np.int32(2)}[arg]
    assert len(prop.propose(st, **kw)) == 2  # NumPy integers are integers
    assert type(st.rows) is int and st.rows == 22
    prop.close()


@pytest.mark.parametrize(
    "case",
    [
        "float_base",
        "bool_base",
        "float_tokens",
        "bool_token",
        "float_list",
        "2d_tokens",
        "huge_token",
        "no_tokens",
    ],
)
def test_catchup_refuses_non_integer_rows_and_tokens(case):
    prop, world, st = fed(9, 5)
    toks, base = list(int(t) for t in world.tokens[5:9]), 5
    match = "must be"
    if case == "float_base":
        base = 5.0
    elif case == "bool_base":
        base = True
    elif case == "float_tokens":
        toks = np.asarray(toks, np.float64)
    elif case == "bool_token":
        toks[2] = True
    elif case == "float_list":
        toks[1] = 7.0
    elif case == "2d_tokens":
        toks = np.asarray(toks).reshape(2, 2)
        match = "one-dimensional"
    elif case == "no_tokens":
        toks = None
        match = "must be a sequence of token ids, got NoneType"
    else:
        toks[3] = 2**70
        match = "outside the vocabulary"
    hid = upload_rows(prop.gpu, world.hiddens[5:8])
    snap = snapshot(prop, st)
    with pytest.raises(ProposerError, match=match):
        prop.catchup_drafter(st, toks, hid, base)
    assert_unchanged(prop, st, snap)
    assert prop.catchup_drafter(st, np.asarray(world.tokens[5:9], np.int32), hid, np.int64(5)) == 3
    prop.close()


@pytest.mark.parametrize("bad", [1.0, True])
def test_after_verify_and_rewind_refuse_non_integers(bad):
    prop, world, st = fed(10, 8)
    propose(prop, st, world, 8, 3)
    snap = snapshot(prop, st)
    with pytest.raises(ProposerError, match="accepted must be an integer"):
        prop.after_verify(st, bad)
    with pytest.raises(ProposerError, match="n must be an integer"):
        prop.rewind_to(st, bad)
    assert_unchanged(prop, st, snap)
    prop.close()


# ---- 5. one error type; freed states ------------------------------------------------------------


def test_every_refusal_of_input_is_a_proposer_error():
    assert issubclass(DsaSizingError, ProposerError)
    prop, world, st = fed(11, 8)
    snap = snapshot(prop, st)
    p = upload_rows(prop.gpu, world.hiddens[:8])
    for call in (
        lambda: prop.prefill_drafter(st, world.tokens[:9], p),  # a re-prefill
        lambda: feed(prop, st, world, 3, 2),  # an overwrite
        lambda: feed(prop, st, world, 9, 2),  # a hole
        lambda: prop.rewind_to(st, 9),
        lambda: prop.rewind_to(st, -1),
    ):
        with pytest.raises(ProposerError):
            call()
    gone = upload_rows(prop.gpu, world.hiddens[8:9])
    prop.gpu.free(gone)
    for call in (
        lambda: prop.catchup_drafter(st, world.tokens[8:10], gone, 8),  # a freed pointer
        lambda: prop.propose(st, 1, gone, 8, 1),
        lambda: prop.propose(st, 1, p.offset(10**9), 8, 1),
    ):  # past every allocation
        with pytest.raises(ProposerError, match="not a live allocation"):
            call()
    prop.gpu.free(p)
    assert_unchanged(prop, st, snap)
    with pytest.raises(ProposerError):
        ProposerOptions(served_max_seq_len=64, max_draft_tokens=0)
    with pytest.raises(ProposerError):
        make_proposer(CFG, WEIGHTS, served=-1)
    prop.close()


def test_queries_on_a_freed_state_raise():
    prop, world, st = fed(12, 8)
    prop.free_state(st)
    for call in (
        lambda: prop.drafter_rows(st),
        lambda: prop.last_pair_key(st),
        lambda: prop.rewind_to(st, 0),
        lambda: prop.after_verify(st, 0),
    ):
        with pytest.raises(ProposerError, match="freed"):
            call()
    prop.close()


# ---- 6. one thread at a time --------------------------------------------------------------------


def test_a_second_thread_is_refused_while_the_first_is_inside():
    prop, world, a, b = fed(13, 10, 2)
    inside, release = threading.Event(), threading.Event()
    real_wait = prop._wait

    def slow_wait(stream):  # thread A parks inside propose, after its launches
        inside.set()
        assert release.wait(10)
        real_wait(stream)

    prop._wait = slow_wait
    result: dict = {}

    def thread_a():
        result["a"] = propose(prop, a, world, 10, 2)

    ta = threading.Thread(target=thread_a)
    ta.start()
    assert inside.wait(10)
    errors = []
    hid = upload_rows(prop.gpu, world.hiddens[10:11])
    for call in (
        lambda: prop.propose(b, int(world.tokens[11]), hid, 10, 2),
        lambda: prop.alloc_state(),
        lambda: prop.drafter_rows(b),
        lambda: prop.close(),
    ):
        tb = threading.Thread(target=lambda c=call: errors.append(_raised(c)))
        tb.start()
        tb.join(10)
    release.set()
    ta.join(10)
    prop._wait = real_wait
    assert len(errors) == 4
    for e in errors:
        assert isinstance(e, ProposerError) and "in use by another thread" in str(e), e
    assert b.rows == 10 and a.rows == 12
    assert propose(prop, b, world, 10, 2) == result["a"], "the refused thread changed nothing"
    prop.gpu.free(hid)
    prop.close()


def _raised(call):
    try:
        call()
    except Exception as e:
        return e
    return None


def test_threads_hammering_one_proposer_get_only_the_clear_error():
    """Four threads, one state each, switching every few microseconds: calls collide, and every
    collision is the clear refusal; every call that ran drafted what a lone thread drafts."""
    prop, world, *states = fed(14, 10, 4, max_sequences=4)
    want = propose(prop, states[0], world, 10, 2)
    prop.rewind_to(states[0], 10)
    # Uploaded up front: the threads call only the proposer (the host backend's heap is not
    # meant for concurrent allocation).
    hid = upload_rows(prop.gpu, world.hiddens[10:11])
    errors: list = []
    drafts: list = []
    start = threading.Barrier(4)

    def worker(st):
        start.wait()
        for _ in range(15):
            try:
                if st.rows != 10:
                    prop.rewind_to(st, 10)
                drafts.append(prop.propose(st, int(world.tokens[11]), hid, 10, 2))
                prop.after_verify(st, 0)
            except Exception as e:
                errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(st,)) for st in states]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert errors, "no call collided: the test did not exercise concurrency"
    assert all(isinstance(e, ProposerError) and "another thread" in str(e) for e in errors), errors[:3]
    assert drafts and all(d == want for d in drafts)
    prop.gpu.free(hid)
    prop.close()


# ---- 7. max_draft_tokens ------------------------------------------------------------------------


def test_max_draft_tokens_is_bounded_by_what_the_drafter_holds():
    with pytest.raises(ProposerError, match="served context"):
        ProposerOptions(served_max_seq_len=100, max_draft_tokens=10**6)
    with pytest.raises(ProposerError, match="max_draft_tokens must be an integer"):
        ProposerOptions(served_max_seq_len=100, max_draft_tokens=2.0)
    gpu = HostBackend()
    with pytest.raises(ProposerError, match=r"served max_seq_len 10000000 is past the \d+ rows"):
        make_proposer(CFG, WEIGHTS, gpu=gpu, served=10**7, max_draft_tokens=10**6)
    assert gpu.stats().live_bytes == 0
    probe = make_proposer(CFG, WEIGHTS, gpu=gpu, served=64)
    cap = probe.drafter_context_rows
    probe.close()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, served=64, max_draft_tokens=cap)
    st = prop.alloc_state()
    world = World(15, cap + 2)
    assert len(propose(prop, st, world, 0, cap)) == cap  # the largest k the rows allow
    prop.close()


@pytest.mark.parametrize(
    "field,bad,msg",
    [
        ("served_max_seq_len", 64.0, "served_max_seq_len must be an integer"),
        ("max_sequences", 2.0, "max_sequences must be an integer"),
        ("context_chunk", 4.0, "context_chunk must be an integer"),
        ("o_proj_groups", 4.0, "o_proj_groups must be an integer"),
        ("o_proj_groups", 0, "o_proj_groups must be >= 1"),
        ("comm_timeout_s", 0, "comm_timeout_s must be positive"),
        ("comm_timeout_s", None, "comm_timeout_s must be positive"),
    ],
)
def test_every_option_is_checked_as_the_options_are_made(field, bad, msg):
    """A float count (2.0 sequences) would fail later inside range() or size a buffer wrongly; zero
    o_proj_groups divided by zero in the sharding."""
    with pytest.raises(ProposerError, match=msg):
        ProposerOptions(**{"served_max_seq_len": 64, field: bad})


class MappedRunsOut(HostBackend):
    """Mapped memory runs out after ``left`` more buffers."""

    left = 1 << 30

    def alloc_mapped(self, nbytes: int):
        if self.left == 0:
            raise OutOfMemoryError(f"alloc_mapped of {nbytes} bytes: no mapped memory left")
        self.left -= 1
        return super().alloc_mapped(nbytes)


@pytest.mark.parametrize("left", [0, 1])
def test_a_proposer_that_runs_out_of_mapped_memory_leaks_nothing(left):
    """The step's mapped buffers (entries in, drafts and flags out) are taken when the proposer is
    built: running out at either one frees everything already taken; a sequence then allocates
    nothing on the device."""
    gpu = MappedRunsOut()
    before = gpu.stats()
    gpu.left = left
    with pytest.raises(OutOfMemoryError):
        make_proposer(CFG, WEIGHTS, gpu=gpu, served=64)
    assert gpu.stats().live_bytes == before.live_bytes
    assert gpu.stats().live_allocations == before.live_allocations
    gpu.left = 1 << 30
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, served=64)
    built = gpu.stats()
    st = prop.alloc_state()
    assert st.slot == 0 and gpu.stats() == built
    prop.close()
