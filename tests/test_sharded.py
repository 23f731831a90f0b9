"""Several ranks on the CPU: threads with their own host backends and a host communicator. The
sharded drafter must draft exactly what one rank drafts, on every rank."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st_

from model.config import tiny, tiny_rope
from model.kernels.draft_head import pack_key, unpack_index
from model.proposer import MtpProposer, ProposerOptions
from runtime.comm import HostCommGroup
from runtime.errors import CommError
from runtime.host_backend import HostBackend
from runtime.kernels.argmax_bf16 import argmax_ref
from tests.proposer_fixtures import bf16_weights, upload_rows


def run_ranks(world: int, fn, timeout_s: float = 20.0):
    """fn(rank, backend, comm) in one thread per rank; returns the per-rank results."""
    group = HostCommGroup(world, timeout_s=timeout_s)
    out: list = [None] * world
    errs: list = [None] * world

    def body(r: int) -> None:
        gpu = HostBackend()
        try:
            out[r] = fn(r, gpu, group.communicator(r, gpu))
        except BaseException as e:  # reported to the test thread
            errs[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 3)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out, errs


def history_drafts(cfg, weights, rank_world, gpu, comm, history, seed):
    """Feed and propose through a fixed random history; return every propose's drafts."""
    c = cfg.with_parallel(*rank_world)
    prop = MtpProposer(gpu, c, weights, ProposerOptions(served_max_seq_len=64, o_proj_groups=4), comm=comm)
    st = prop.alloc_state()
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, 80)
    hid = rng.standard_normal((80, cfg.hidden_size)).astype(np.float32)
    drafts, rows = [], 0
    for n_feed, k, acc in history:
        n_feed = min(n_feed, 60 - rows)
        if n_feed > 0:
            p = upload_rows(gpu, hid[rows : rows + n_feed])
            prop.catchup_drafter(st, tokens[rows : rows + n_feed + 1], p, rows)
            gpu.free(p)
            rows += n_feed
        if rows + k > 64:
            break
        p = upload_rows(gpu, hid[rows : rows + 1])
        drafts.append(prop.propose(st, int(tokens[rows + 1]), p, rows, k))
        gpu.free(p)
        prop.after_verify(st, min(acc, k))
        rows += min(k, acc + 1)
    prop.close()
    return drafts


histories = st_.lists(
    st_.tuples(st_.integers(0, 9), st_.integers(1, 4), st_.integers(0, 4)), min_size=2, max_size=8
)


@settings(max_examples=6, deadline=None)
@given(history=histories, seed=st_.integers(0, 1000), vocab=st_.sampled_from([96, 97]))
@example(history=[(1, 3, 2), (0, 1, 0), (0, 1, 0), (8, 2, 0)], seed=208, vocab=97)
def test_world_2_and_4_draft_exactly_what_one_rank_drafts(history, seed, vocab):
    cfg = tiny(vocab_size=vocab, index_topk=8, index_kpool=2, max_context=64)
    w = bf16_weights(cfg, seed)
    one = history_drafts(cfg, w, (0, 1), HostBackend(), None, history, seed)
    for world in (2, 4):
        res, errs = run_ranks(world, lambda r, g, c: history_drafts(cfg, w, (r, world), g, c, history, seed))
        assert errs == [None] * world, errs
        for r in range(world):
            assert res[r] == one, f"world {world} rank {r}"


def batch_drafts(cfg, weights, rank_world, gpu, comm, seed):
    """Four sequences of ragged contexts drafted in padded batches of 3, 4 and 2 through bucket
    graphs (their rows verified and caught up between): every batch's drafts."""
    c = cfg.with_parallel(*rank_world)
    opt = ProposerOptions(
        served_max_seq_len=64, o_proj_groups=4, max_sequences=4, use_graphs=True, batch_buckets=(1, 4)
    )
    prop = MtpProposer(gpu, c, weights, opt, comm=comm)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (4, 60))
    hid = rng.standard_normal((4, 60, cfg.hidden_size)).astype(np.float32)
    sts = [prop.alloc_state() for _ in range(4)]
    rows = [5, 17, 9, 30]
    ptrs = [upload_rows(gpu, hid[b]) for b in range(4)]
    prop.catchup_batch(sts, [tokens[b, : rows[b] + 1] for b in range(4)], ptrs, [0] * 4)
    out = []
    for pick, k in (([2, 0, 3], 3), ([3, 1, 0, 2], 2), ([1, 3], 3)):
        pos = [prop.drafter_rows(sts[b]) for b in pick]
        h = upload_rows(gpu, np.stack([hid[b, p] for b, p in zip(pick, pos)]))
        d = prop.propose_batch(
            [sts[b] for b in pick], [int(tokens[b, p + 1]) for b, p in zip(pick, pos)], h, pos, k
        )
        gpu.free(h)
        out.append(d.tolist())
        prop.after_verify_batch([sts[b] for b in pick], [int(x) % (k + 1) for x in d[:, 0]])
    for p in ptrs:
        gpu.free(p)
    prop.close()
    return out


@pytest.mark.parametrize(
    "seed, family", [(3, "glm5_next"), (11, "glm5_next"), (5, "glm_moe_dsa"), (7, "deepseek_v32")]
)
def test_sharded_batches_draft_exactly_what_one_rank_drafts(seed, family):
    """The batched step's collectives (o_proj's zero-padded groups, the MoE rows, one exchanged
    key per sequence) over padded bucket graphs: every rank drafts what one rank drafts, for each
    family's block (the rope queries of a rank's own heads, group-limited routing over every
    rank's experts)."""
    if family == "glm5_next":
        cfg = tiny(vocab_size=96, index_topk=8, index_kpool=2, max_context=64)
    else:
        cfg = tiny_rope(family=family, vocab_size=96, max_context=64)
    w = bf16_weights(cfg, seed)
    one = batch_drafts(cfg, w, (0, 1), HostBackend(), None, seed)
    for world in (2, 4):
        res, errs = run_ranks(world, lambda r, g, c: batch_drafts(cfg, w, (r, world), g, c, seed))
        assert errs == [None] * world, errs
        for r in range(world):
            assert res[r] == one, f"world {world} rank {r}"


def test_sharded_layer_without_a_communicator_refuses_to_start():
    cfg = tiny().with_parallel(0, 2)
    with pytest.raises(ValueError, match="needs a communicator"):
        MtpProposer(HostBackend(), cfg, bf16_weights(tiny(), 0), ProposerOptions(64, o_proj_groups=4))


def test_communicator_world_size_must_match_the_config():
    cfg = tiny()

    def body(r, gpu, comm):
        MtpProposer(
            gpu,
            cfg.with_parallel(r, 4),
            bf16_weights(cfg, 0),
            ProposerOptions(64, o_proj_groups=4),
            comm=comm,
        )

    _, errs = run_ranks(2, body)
    assert all(isinstance(e, ValueError) and "communicator has 2 ranks" in str(e) for e in errs)


def test_ranks_with_different_configs_fail_on_every_rank():
    base = tiny()

    def body(r, gpu, comm):
        cfg = tiny(num_experts_per_tok=2 + r)  # rank 1 disagrees
        MtpProposer(
            gpu,
            cfg.with_parallel(r, 2),
            bf16_weights(cfg, 0),
            ProposerOptions(64, o_proj_groups=4),
            comm=comm,
        )

    _, errs = run_ranks(2, body)
    assert all(isinstance(e, CommError) and "config" in str(e) for e in errs), errs
    assert base  # the failure is the mismatch, not the base config


def test_a_dead_peer_is_a_timeout_error_not_a_hang():
    cfg = tiny()

    def body(r, gpu, comm):
        if r == 1:
            return "never arrives"
        MtpProposer(
            gpu,
            cfg.with_parallel(r, 2),
            bf16_weights(cfg, 0),
            ProposerOptions(64, o_proj_groups=4),
            comm=comm,
        )

    _, errs = run_ranks(2, body, timeout_s=1.0)
    assert isinstance(errs[0], CommError)


# ---- the cross-rank argmax ---------------------------------------------------------------------

special = st_.sampled_from([0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 3.5])
values = st_.one_of(special, st_.floats(-1e4, 1e4, width=32))


@settings(max_examples=300)
@given(logits=st_.lists(values, min_size=1, max_size=40), world=st_.integers(1, 5), data=st_.data())
def test_cross_rank_argmax_equals_the_unsharded_argmax(logits, world, data):
    x = np.asarray(logits, np.float32)
    # Adversarial: copy the global max into several shards.
    if data.draw(st_.booleans()) and x.size > 1:
        j = data.draw(st_.integers(0, x.size - 1))
        x[j] = np.max(x)
    n = x.size
    bounds = np.linspace(0, n, world + 1).astype(int)
    keys = []
    for r in range(world):
        lo, hi = bounds[r], bounds[r + 1]
        if hi == lo:
            continue
        idx, val = argmax_ref(x[lo:hi])
        keys.append(pack_key(val, lo + idx))
    want, _ = argmax_ref(x)
    assert unpack_index(max(keys)) == want


def test_the_rank_entry_point_runs_one_rank_on_the_host(capsys):
    from model.sharded_run import main

    assert main(["--backend", "host", "--steps", "6", "--timing-iters", "2", "--context", "48"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert '"ranks_agree": true' in line and '"proposes": 6' in line


def sampled_batch_drafts(cfg, weights, rank_world, gpu, comm, seed, params):
    """Three sequences drafted with ``params`` (one per sequence) through a bucket graph, twice
    (the second after rewinding: a replay): (tokens, probs) of each call."""
    c = cfg.with_parallel(*rank_world)
    opt = ProposerOptions(
        served_max_seq_len=64, o_proj_groups=4, max_sequences=4, use_graphs=True, batch_buckets=(1, 4)
    )
    prop = MtpProposer(gpu, c, weights, opt, comm=comm)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (3, 40))
    hid = rng.standard_normal((3, 40, cfg.hidden_size)).astype(np.float32)
    sts = [prop.alloc_state() for _ in range(3)]
    rows = [6, 19, 11]
    ptrs = [upload_rows(gpu, hid[b]) for b in range(3)]
    prop.catchup_batch(sts, [tokens[b, : rows[b] + 1] for b in range(3)], ptrs, [0] * 3)
    h = upload_rows(gpu, np.stack([hid[b, rows[b]] for b in range(3)]))
    out = []
    for _ in range(2):
        d = prop.propose_batch(
            sts, [int(tokens[b, rows[b] + 1]) for b in range(3)], h, rows, 3, sampling=params
        )
        out.append((d.tokens.tolist(), d.probs.copy()))
    for p in (*ptrs, h):
        gpu.free(p)
    prop.close()
    return out


def test_sharded_sampling_draws_what_one_rank_draws_on_every_rank():
    """Temperature and top-k rows (and a greedy one) on a vocabulary-sharded head: every rank commits
    the same tokens and the same probabilities, the tokens one unsharded head draws (the noise of a
    vocabulary index is the same on every rank), the probabilities within f32 rounding of its."""
    from model.sampling import SamplingParams

    cfg = tiny(vocab_size=96, index_topk=8, index_kpool=2, max_context=64)
    w = bf16_weights(cfg, 21)
    params = [
        SamplingParams(temperature=1.5, seed=4),
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=7, seed=2**40 + 9),
    ]
    one = sampled_batch_drafts(cfg, w, (0, 1), HostBackend(), None, 21, params)
    for world in (2, 4):
        res, errs = run_ranks(
            world, lambda r, g, c: sampled_batch_drafts(cfg, w, (r, world), g, c, 21, params)
        )
        assert errs == [None] * world, errs
        for r in range(world):
            for (tok, q), (tok1, q1), (_, q0) in zip(res[r], one, res[0]):
                assert tok == tok1, f"world {world} rank {r}: tokens differ from one rank's"
                assert np.array_equal(q, q0), f"world {world} rank {r}: probabilities differ across ranks"
                np.testing.assert_allclose(q, q1, rtol=1e-5)
            assert res[r][0][0] == res[r][1][0]  # the graph replay draws the same


def test_top_p_on_a_sharded_head_is_refused_before_anything_is_drafted():
    from model.proposer import ProposerError
    from model.sampling import SamplingParams

    cfg = tiny(vocab_size=96, index_topk=8, index_kpool=2, max_context=64)
    w = bf16_weights(cfg, 22)

    def body(r, gpu, comm):
        prop = MtpProposer(
            gpu,
            cfg.with_parallel(r, 2),
            w,
            ProposerOptions(served_max_seq_len=64, o_proj_groups=4),
            comm=comm,
        )
        st = prop.alloc_state()
        h = upload_rows(gpu, np.zeros((1, cfg.hidden_size), np.float32))
        try:
            with pytest.raises(
                ProposerError, match="top_p 0.9 < 1 is not supported with a vocabulary-sharded"
            ):
                prop.propose(st, 1, h, 0, 2, sampling=SamplingParams(temperature=1.0, top_p=0.9))
            return prop.propose(st, 1, h, 0, 2, sampling=SamplingParams(temperature=1.0, top_k=5))
        finally:
            prop.close()

    res, errs = run_ranks(2, body)
    assert errs == [None, None], errs
    assert res[0] == res[1]
