"""Property tests of the proposer's row space on the host backend: rollback, rewind, sizing and
lifecycle, over long random histories."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

from model.config import tiny
from model.dsa import DsaSizingError, drafter_context_rows, max_dsa_context
from model.kernels.dsa_select import TOPK_MAX_POOLS
from model.proposer import ProposerError
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import (
    assert_same_caches,
    bf16_weights,
    cache_snapshot,
    make_proposer,
    upload_rows,
)

CFG = tiny(index_topk=8, index_kpool=2, max_context=96)
WEIGHTS = bf16_weights(CFG, seed=3)
H = CFG.hidden_size


class World:
    """Target-side facts a history draws from: a token and a hidden row per position."""

    def __init__(self, seed: int, n: int) -> None:
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, CFG.vocab_size, n + 1)
        self.hiddens = rng.standard_normal((n + 1, H)).astype(np.float32)


def _feed(prop, st, world: World, base: int, n: int, gpu) -> int:
    p = upload_rows(gpu, world.hiddens[base : base + n])
    try:
        return prop.catchup_drafter(st, world.tokens[base : base + n + 1], p, base)
    finally:
        gpu.free(p)


def _propose(prop, st, world: World, pos: int, k: int, gpu):
    p = upload_rows(gpu, world.hiddens[pos : pos + 1])
    try:
        return prop.propose(st, int(world.tokens[pos + 1]), p, pos, k)
    finally:
        gpu.free(p)


def _refusal(prop, st, world: World, rows: int, kind: str, gpu) -> None:
    """One input the proposer must refuse (ProposerError) at the drafter's current length."""
    hid = world.hiddens[rows : rows + 2].copy()
    if kind == "nan_feed":
        hid[1, 3] = np.nan
    p = upload_rows(gpu, hid)
    tok = int(world.tokens[rows + 1])
    try:
        with pytest.raises(ProposerError):
            if kind == "nan_feed":
                prop.catchup_drafter(st, world.tokens[rows : rows + 3], p, rows)
            elif kind == "float_position":
                prop.propose(st, tok, p, float(rows), 1)
            elif kind == "bool_token":
                prop.propose(st, True, p, rows, 1)
            elif kind == "float_row_base":
                prop.catchup_drafter(st, world.tokens[rows : rows + 3], p, float(rows))
            elif kind == "float_token":
                prop.catchup_drafter(st, world.tokens[rows : rows + 3].astype(np.float64), p, rows)
            elif kind == "float_accept":
                prop.after_verify(st, 0.0)
            else:
                raise AssertionError(kind)
    finally:
        gpu.free(p)


REFUSALS = ["nan_feed", "float_position", "bool_token", "float_row_base", "float_token", "float_accept"]

ops = st_.lists(
    st_.one_of(
        st_.tuples(st_.just("feed"), st_.integers(1, 9)),
        st_.tuples(st_.just("propose"), st_.integers(1, 4), st_.integers(0, 4), st_.integers(0, 3)),
        st_.tuples(st_.just("bad_feed"), st_.integers(-3, 3)),
        st_.tuples(st_.just("nan_propose"), st_.integers(1, 4), st_.integers(0, 3)),
        st_.tuples(st_.just("refuse"), st_.sampled_from(REFUSALS)),
    ),
    min_size=3,
    max_size=14,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=ops, seed=st_.integers(0, 2**16))
def test_rollback_matches_a_history_that_never_drafted_the_rejected_rows(history, seed):
    """Main: propose k, verify with any acceptance. Shadow: propose only the rows that are kept.
    After every step both hold the same rows, bit for bit, and the row count follows the model."""
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, served=80)
    main, shadow = prop.alloc_state(), prop.alloc_state()
    world = World(seed, prop.drafter_context_rows + 8)
    rows = 0  # the model
    for op in history:
        if op[0] == "feed":
            n = min(op[1], prop.drafter_context_rows - rows)
            if n <= 0:
                continue
            assert _feed(prop, main, world, rows, n, gpu) == n
            assert _feed(prop, shadow, world, rows, n, gpu) == n
            rows += n
        elif op[0] == "propose":
            _, k, accepted, back = op
            pos = max(rows - back, 0)  # a propose behind the drafter rewinds it
            if pos + k > prop.drafter_context_rows:
                continue
            accepted = min(accepted, k)
            drafts = _propose(prop, main, world, pos, k, gpu)
            prop.after_verify(main, accepted)
            keep = min(k, accepted + 1)
            assert keep >= 1  # row 0 is never trimmed
            d2 = _propose(prop, shadow, world, pos, keep, gpu)
            prop.after_verify(shadow, keep - 1)
            assert drafts[:keep] == d2
            rows = pos + keep
            if k == 1:
                assert rows == pos + 1  # with one draft nothing is ever trimmed
        elif op[0] == "nan_propose":
            # A NaN in the target's hidden: refused after the step, no draft committed. Behind the
            # drafter the rewind to the position stands (the shadow is rewound through the API).
            _, k, back = op
            pos = max(rows - back, 0)
            if pos + k > prop.drafter_context_rows:
                continue
            before = cache_snapshot(prop, main), gpu.stats().live_bytes
            hid = world.hiddens[pos : pos + 1].copy()
            hid[0, int(seed) % H] = np.nan
            p = upload_rows(gpu, hid)
            with pytest.raises(ProposerError, match="not finite"):
                prop.propose(main, int(world.tokens[pos + 1]), p, pos, k)
            gpu.free(p)
            assert main.rows == pos and gpu.stats().live_bytes == before[1]
            if pos < rows:
                prop.rewind_to(shadow, pos)
            else:
                assert_same_caches(before[0], cache_snapshot(prop, main))
            rows = pos
        elif op[0] == "refuse":
            if rows + 3 > prop.drafter_context_rows:
                continue
            before = cache_snapshot(prop, main), gpu.stats().live_bytes
            _refusal(prop, main, world, rows, op[1], gpu)
            assert main.rows == rows and gpu.stats().live_bytes == before[1]
            assert_same_caches(before[0], cache_snapshot(prop, main))
        else:
            delta = op[1] or 1
            start = rows + delta if rows + delta >= 0 else rows + 1  # a hole or an overwrite
            before = cache_snapshot(prop, main), gpu.stats()
            with pytest.raises(DsaSizingError):
                _feed(prop, main, world, start, 2, gpu)
            assert main.rows == rows and gpu.stats().live_bytes == before[1].live_bytes
            assert_same_caches(before[0], cache_snapshot(prop, main))
        assert prop.drafter_rows(main) == prop.drafter_rows(shadow) == rows
        assert prop.last_pair_key(main) == (rows - 1 if rows else None)
        assert_same_caches(cache_snapshot(prop, main), cache_snapshot(prop, shadow))
    prop.close()
    assert gpu.stats().live_bytes == 0


@settings(max_examples=20, deadline=None)
@given(n=st_.integers(2, 60), data=st_.data())
def test_rewind_then_refeed_equals_straight(n, data):
    m = data.draw(st_.integers(0, n - 1))
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, served=64)
    world = World(n * 7 + m, 70)
    a, b = prop.alloc_state(), prop.alloc_state()
    _feed(prop, a, world, 0, n, gpu)
    # Rewind through the API: a propose at an earlier position rewinds the drafter to it.
    _propose(prop, a, world, m, 1, gpu)
    prop.after_verify(a, 0)
    assert a.rows == m + 1
    a.dsa.rewind_to(m)
    _feed(prop, a, world, m, n - m, gpu)
    _feed(prop, b, world, 0, n, gpu)
    assert_same_caches(cache_snapshot(prop, a), cache_snapshot(prop, b))
    prop.close()


def test_feed_refusals_write_nothing():
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, served=20)
    st = prop.alloc_state()
    world = World(1, 40)
    _feed(prop, st, world, 0, 5, gpu)
    snap = cache_snapshot(prop, st)
    with pytest.raises(DsaSizingError, match="append exactly"):
        _feed(prop, st, world, 6, 2, gpu)  # a hole
    with pytest.raises(DsaSizingError, match="append exactly"):
        _feed(prop, st, world, 3, 2, gpu)  # an overwrite
    with pytest.raises(DsaSizingError, match="past the 20 rows"):
        _feed(prop, st, world, 5, 16, gpu)  # overruns the sizing
    assert st.rows == 5
    assert_same_caches(snap, cache_snapshot(prop, st))
    prop.close()


def test_propose_refuses_bad_input_before_changing_state():
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, served=20)
    st = prop.alloc_state()
    world = World(2, 40)
    _feed(prop, st, world, 0, 6, gpu)
    hid = upload_rows(gpu, world.hiddens[6:7])
    small = gpu.alloc(H)  # half a hidden row
    snap = cache_snapshot(prop, st)
    cases = [
        (dict(last_token=CFG.vocab_size, target_hidden=hid, position=6, k=2), "outside the vocabulary"),
        (dict(last_token=-1, target_hidden=hid, position=6, k=2), "outside the vocabulary"),
        (dict(last_token=1, target_hidden=hid, position=19, k=2), "past the 20 rows"),
        (dict(last_token=1, target_hidden=hid, position=8, k=1), "catch up"),
        (dict(last_token=1, target_hidden=small, position=6, k=1), "bytes"),
        (dict(last_token=1, target_hidden=hid, position=6, k=5), "max_draft_tokens"),
    ]
    for kw, msg in cases:
        with pytest.raises(ProposerError, match=msg):
            prop.propose(st, **kw)
        assert st.rows == 6
        assert_same_caches(snap, cache_snapshot(prop, st))
    with pytest.raises(ProposerError, match="outside 0..0"):
        prop.after_verify(st, 1)
    gpu.free(hid)
    gpu.free(small)
    prop.close()


# ---- sizing ------------------------------------------------------------------------------------


@given(
    reservation=st_.integers(1, 200_000),
    served=st_.integers(1, 300_000),
    kpool=st_.sampled_from([1, 2, 4, 8]),
)
def test_drafter_context_rows_follows_the_config(reservation, served, kpool):
    d = tiny(index_kpool=kpool, index_topk=8 * kpool, max_context=reservation).dsa
    whole = (reservation // kpool) * kpool
    cap = TOPK_MAX_POOLS * kpool
    assert max_dsa_context(d) == min(whole, cap)
    assert drafter_context_rows(served, d) == min(served, whole, cap)
    assert drafter_context_rows(served, d) % kpool == 0 or served < min(whole, cap)


def test_buffers_are_sized_from_the_drafter_reach():
    """Per-sequence bytes (a slot's share of the pools) grow with the reach, the served length
    where the reservation holds it (past it the proposer refuses to build:
    tests/test_dsa_reach.py); allocating a sequence allocates nothing (the pools are up front)."""

    def state_bytes(reservation: int, served: int) -> tuple[int, int]:
        cfg = tiny(index_topk=8, index_kpool=2, max_context=reservation)
        gpu = HostBackend()
        prop = make_proposer(cfg, bf16_weights(cfg, 0), gpu=gpu, served=served)
        before = gpu.stats().live_bytes
        prop.alloc_state()
        assert gpu.stats().live_bytes == before
        rep = prop.memory_report()
        used = (rep["kv_pool"] + rep["indexer_caches"]) // prop.opt.max_sequences
        kv_rows = prop.pools.geometry.blocks_per_slot * prop.pools.geometry.block_size
        prop.close()
        return used, kv_rows

    b64, kv64 = state_bytes(64, 64)
    b128, kv128 = state_bytes(128, 128)
    b128s, _ = state_bytes(128, 64)  # served context below the reservation sizes it
    assert b64 == b128s
    assert b128 > b64
    assert kv64 >= 64 and kv64 - 64 < 16 and kv128 >= 128 and kv128 - 128 < 16
    per_row = (b128 - b64) / 64  # bytes a row costs: latent, keys and gates, pool key
    assert per_row >= 2 * 2 * CFG.dsa.index_head_dim + CFG.attention.kv_lora_rank


# ---- lifecycle ---------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(plan=st_.lists(st_.tuples(st_.integers(0, 3), st_.integers(1, 4)), min_size=1, max_size=12))
def test_lifecycle_leaves_live_bytes_where_they_started(plan):
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, served=40, max_sequences=4)
    world = World(0, 50)
    start = gpu.stats()
    live = []
    for action, k in plan:
        if action == 0 or not live:
            if len(live) < 4:
                st = prop.alloc_state()
                _feed(prop, st, world, 0, 6, gpu)
                live.append(st)
        elif action == 1:
            st = live.pop(0)
            prop.free_state(st)
            prop.free_state(st)  # a second free is a no-op
        else:
            st = live[-1]
            hid = upload_rows(gpu, world.hiddens[st.rows : st.rows + 1])
            if st.rows + k <= prop.drafter_context_rows:
                before = gpu.stats().live_allocations
                prop.propose(st, 1, hid, st.rows, k)
                assert gpu.stats().live_allocations == before  # propose allocates nothing
                prop.after_verify(st, k)
            gpu.free(hid)
    for st in live:
        prop.free_state(st)
    assert gpu.stats().live_bytes == start.live_bytes
    assert gpu.stats().live_allocations == start.live_allocations
    gone = prop.alloc_state()
    prop.free_state(gone)
    with pytest.raises(ProposerError, match="freed"):
        prop.propose(gone, 1, None, 0, 1)
    prop.close()
    assert gpu.stats().live_bytes == 0
