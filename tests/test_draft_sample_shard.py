"""The sampled draft with a vocabulary-sharded head on the CPU (model/kernels/draft_sample_shard.py's
host twins): ranks as threads with their own HostBackend and a host communicator running
sample_sharded_batch, world 2 and 4 (and uneven shards, and world 1), against the unsharded reference
(model.sampling.draw / probabilities on the whole row).

Exact: every rank's token, q, drafts, probs, host copies and flags bit-identical; each token the
reference's draw; greedy rows the argmax with q 1; dist[token] bitwise q; padding entries and dist
columns of other ranks untouched; counters zero. Within Q_REL (tests/sample_shard_util.py): q and
each rank's dist columns against the float64 reference probabilities.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from sample_shard_util import (
    ShardCase,
    check_commit,
    make_case,
    run_emulated,
    run_threads,
)

from model.kernels import draft_head
from model.kernels import draft_sample_shard as dss
from model.kernels.keyed_rng import Stream, gumbel
from model.sampling import GREEDY, SamplingParams
from runtime.comm import HostCommGroup, SingleRankCommunicator
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend

VOCAB = 20_000  # world 2: 10,000 columns a rank (3 chunks); world 4: 5,000 (2 chunks, the last short)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ties", [False, True])
def test_world_2_and_4_sample_what_one_rank_samples(world, ties):
    rng = np.random.default_rng()
    case = make_case(rng, 11, VOCAB, world, pads=3, ties=ties)
    check_commit(case, run_threads(case))


def test_top_k_larger_than_a_shard_and_ties_across_shards():
    """vocab 1000 over 4 ranks (250 columns each): top_k 256 and 251 take candidates from every rank,
    250 and 249 around a shard's size; few logit levels, so the kept set ends inside a run of equal z
    that spans ranks (the lower index wins)."""
    rng = np.random.default_rng()
    seeds = rng.integers(0, 2**63, 8).tolist()
    params = [
        SamplingParams(temperature=1.0, top_k=256, seed=seeds[0]),
        SamplingParams(temperature=0.5, top_k=251, seed=seeds[1]),
        SamplingParams(temperature=1.0, top_k=250, seed=seeds[2]),
        SamplingParams(temperature=2.0, top_k=249, seed=seeds[3]),
        SamplingParams(temperature=1.0, top_k=3, seed=seeds[4]),
        SamplingParams(temperature=1.0, seed=seeds[5]),
        GREEDY,
        SamplingParams(temperature=0.25, top_k=100, seed=seeds[7]),
    ]
    case = make_case(rng, 9, 1000, 4, pads=1, params=params, ties=True)
    check_commit(case, run_threads(case))


def test_uneven_shards():
    rng = np.random.default_rng()
    case = make_case(rng, 8, 9000, 3, pads=1)
    case.bounds = [0, 137, 4233, 9000]  # 137 columns (one short chunk), 4096 (one full), 4767 (two)
    check_commit(case, run_threads(case))


def test_world_1_through_the_single_rank_communicator():
    rng = np.random.default_rng()
    case = make_case(rng, 6, 9000, 1, pads=1)
    gpu = HostBackend()
    from sample_shard_util import RankBuffers

    rb = RankBuffers(gpu, case, 0)
    try:
        rb.run_sharded(SingleRankCommunicator(gpu))
        out = rb.read()
    finally:
        rb.free()
    check_commit(case, [out])


def test_masked_logits_and_a_shard_of_minus_infinity():
    """-inf logits (masked tokens) add nothing: a rank whose whole shard is -inf, and a chunk of
    -inf, still give the reference's token and q (no exp(-inf - -inf) = NaN in a sum)."""
    rng = np.random.default_rng()
    seeds = rng.integers(0, 2**63, 4).tolist()
    params = [
        SamplingParams(temperature=1.0, seed=seeds[0]),
        SamplingParams(temperature=0.7, top_k=30, seed=seeds[1]),
        SamplingParams(temperature=1.4, seed=seeds[2]),
        GREEDY,
    ]
    case = make_case(rng, 4, 16_000, 2, params=params)
    lg = case.logits.astype(np.float32)
    lg[:, 8000:] = -np.inf  # rank 1's whole shard
    lg[2, :4096] = -np.inf  # row 2: rank 0's first chunk too
    case.logits = lg.astype(BF16)
    outs = run_threads(case)
    check_commit(case, outs)
    for e in range(4):
        assert int(outs[0]["entries"][e, 2]) < 8000


def test_non_finite_logits_raise_the_flag_on_every_rank():
    rng = np.random.default_rng()
    params = [
        GREEDY,
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.0, top_k=9, seed=6),
        GREEDY,
    ]
    case = make_case(rng, 4, 2000, 2, params=params)
    lg = case.logits.astype(np.float32)
    lg[0, :] = np.nan  # no logit is a number: token 0, NONFINITE_NAN
    lg[1, 1500] = np.inf  # the largest z is infinite
    lg[2, 17] = np.inf
    case.logits = lg.astype(BF16)
    outs = run_threads(case)
    fb = case.flag_byte
    for o in outs:
        assert o["flags"][0, fb] == draft_head.NONFINITE_NAN and int(o["entries"][0, 2]) == 0
        assert o["flags"][1, fb] == draft_head.NONFINITE_INF
        assert o["flags"][2, fb] == draft_head.NONFINITE_INF
        assert o["flags"][3, fb] == 0
        np.testing.assert_array_equal(o["flags"], outs[0]["flags"])
        np.testing.assert_array_equal(o["entries"], outs[0]["entries"])


def test_the_host_emulation_of_the_ranks_is_the_threads_bit_for_bit():
    """run_emulated (what the GPU test runs) against sample_sharded_batch on threads."""
    rng = np.random.default_rng()
    case = make_case(rng, 7, 12_000, 4, pads=2)
    a, b = run_threads(case), run_emulated(HostBackend(), case)
    for r in range(case.world):
        for name in a[r]:
            if name == "send":  # the top-k keys are in no particular order
                continue
            np.testing.assert_array_equal(a[r][name].view(np.uint8), b[r][name].view(np.uint8), err_msg=name)


def test_a_row_is_the_same_alone_and_in_any_batch():
    rng = np.random.default_rng()
    case = make_case(rng, 9, 9000, 2, pads=2)
    full = run_emulated(HostBackend(), case)
    order = rng.permutation(case.m).tolist()
    shuffled = run_emulated(HostBackend(), case.rows(order))
    for j, e in enumerate(order):
        alone = run_emulated(HostBackend(), case.rows([e])) if j < 3 else None
        for r in range(case.world):
            for name in ("entries", "drafts", "probs", "host_drafts", "host_probs", "flags", "dist", "send"):
                want = full[r][name][e].view(np.uint8)
                np.testing.assert_array_equal(
                    shuffled[r][name][j].view(np.uint8), want, err_msg=f"{name} row {e}"
                )
                if alone is not None:
                    np.testing.assert_array_equal(
                        alone[r][name][0].view(np.uint8), want, err_msg=f"{name} row {e}"
                    )


def test_a_captured_graph_replays_with_new_records():
    """Captured on each rank (the collective inside the graph) and replayed after the records were
    rewritten with other seeds: each replay samples what the reference draws for those seeds."""
    rng = np.random.default_rng()
    case = make_case(rng, 5, 8000, 2, pads=1, publish=True)
    group = HostCommGroup(2, timeout_s=30.0)
    replays = []
    for _ in range(2):
        params = [
            None
            if p is None
            else SamplingParams(p.temperature, p.top_p, p.top_k, int(rng.integers(0, 2**63)))
            for p in case.params
        ]
        replays.append(params)
    out: list = [[None, None], [None, None]]
    errs: list = [None, None]

    def body(r: int) -> None:
        from sample_shard_util import RankBuffers

        gpu = HostBackend()
        rb = RankBuffers(gpu, case, r)
        try:
            comm = group.communicator(r, gpu)
            s = gpu.create_stream()
            gpu.begin_capture(s)
            dss.sample_sharded_batch(
                gpu, comm, workspace=rb.ptrs["workspace"], stream=s, **rb.common(), **rb.commit_args()
            )
            g = gpu.end_capture(s, label="sharded sampling")
            base = rb.ptrs["dist"].addr
            for i, params in enumerate(replays):
                dists = [
                    base + 4 * e * case.kmax * case.vocab if case.with_dist[e] else 0 for e in range(case.m)
                ]
                recs = dss.pack_sample_records([p or GREEDY for p in params], case.positions.tolist(), dists)
                gpu.copy_h2d(rb.ptrs["sampling"], recs)
                gpu.copy_h2d(rb.ptrs["entries"], case.entries)
                gpu.copy_h2d(rb.ptrs["drafts"], case.prior_drafts)
                gpu.copy_h2d(rb.ptrs["probs"], case.prior_probs)
                gpu.memset(rb.ptrs["dist"], 0xFF, 4 * case.m * case.kmax * case.vocab)
                gpu.memset(rb.ptrs["host_drafts"], 0xFF, 4 * case.m * case.kmax)
                gpu.memset(rb.ptrs["host_probs"], 0xFF, 4 * case.m * case.kmax)
                gpu.graph_launch(g, s)
                gpu.synchronize(s)
                out[i][r] = rb.read()
            gpu.graph_destroy(g)
        except BaseException as e:  # reported to the test thread
            errs[r] = e
        finally:
            rb.free()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    for e in errs:
        if e is not None:
            raise e
    for i, params in enumerate(replays):
        check_commit(ShardCase(**{**case.__dict__, "params": params}), out[i])


# ---- refusals ------------------------------------------------------------------------------------


def test_top_p_below_one_is_refused_for_sampled_requests():
    ok = [GREEDY, SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=5)]
    dss.check_shard_sampling(ok, 1000)
    with pytest.raises(
        ValueError, match=r"request 1: top_p 0\.9 < 1 is not supported with a vocabulary-sharded"
    ):
        dss.check_shard_sampling([GREEDY, SamplingParams(temperature=0.8, top_p=0.9)], 1000)


def test_top_k_above_the_cap_is_refused():
    dss.check_shard_sampling([SamplingParams(temperature=1.0, top_k=dss.SHARD_TOP_K_MAX)], 1000)
    dss.check_shard_sampling([SamplingParams(temperature=1.0, top_k=1000)], 1000)  # keeps everything
    with pytest.raises(ValueError, match=r"top_k 257 is above 256"):
        dss.check_shard_sampling([SamplingParams(temperature=1.0, top_k=257)], 1000)
    with pytest.raises(ValueError, match=r"top_k 17 is above 16"):
        dss.check_shard_sampling([SamplingParams(temperature=1.0, top_k=17)], 1000, top_k_cap=16)
    for cap in (0, 257, True):
        with pytest.raises(ValueError, match="top_k_cap"):
            dss.check_shard_sampling([GREEDY], 1000, top_k_cap=cap)


def test_sampling_params_errors_come_first():
    with pytest.raises(ValueError, match="request 0: temperature -1"):
        dss.check_shard_sampling([SamplingParams(temperature=-1.0)], 1000)
    with pytest.raises(ValueError, match="request 0: top_k 1001"):
        dss.check_shard_sampling([SamplingParams(temperature=1.0, top_k=1001)], 1000)


def test_bad_launch_arguments_are_refused_before_anything_runs():
    rng = np.random.default_rng()
    case = make_case(rng, 3, 4000, 1)
    gpu = HostBackend()
    from sample_shard_util import RankBuffers

    rb = RankBuffers(gpu, case, 0)
    comm = SingleRankCommunicator(gpu)
    try:
        before = rb.read()
        small = gpu.alloc(rb.ws_bytes - 8)
        with pytest.raises(ValueError, match="workspace has"):
            dss.sample_sharded_batch(gpu, comm, workspace=small, **rb.common(), **rb.commit_args())
        gpu.free(small)
        args = {**rb.common(), **rb.commit_args()}
        for bad, match in [
            (dict(v0=1), "bad vocabulary shard"),
            (dict(m=0), "m=0"),
            (dict(m=257), "m=257"),
            (dict(top_k_cap=0), "top_k_cap"),
            (dict(draft_index=case.kmax), "draft_index"),
            (dict(flag_byte=4), "flag_byte"),
        ]:
            with pytest.raises(ValueError, match=match):
                dss.sample_sharded_batch(gpu, comm, workspace=rb.ptrs["workspace"], **{**args, **bad})
        after = rb.read()
        for name in before:
            np.testing.assert_array_equal(
                after[name].view(np.uint8), before[name].view(np.uint8), err_msg=name
            )
    finally:
        rb.free()


# ---- the pieces ----------------------------------------------------------------------------------


def test_record_layout():
    p = SamplingParams(temperature=0.75, top_p=1.0, top_k=12, seed=0x1234_5678_9ABC_DEF0)
    rec = dss.pack_sample_records([p, GREEDY], [7, 2**32 - 5], [0x7F00_1234_5678, 0], m=3)
    assert rec.shape == (3, dss.SAMPLE_WORDS) and rec.dtype == np.uint32
    assert rec[0].tolist() == [0x3F40_0000, 0x3F80_0000, 12, 0x9ABC_DEF0, 0x1234_5678, 7, 0x1234_5678, 0x7F00]
    assert rec[1].tolist() == [0, 0x3F80_0000, 0, 0, 0, 2**32 - 5, 0, 0]
    assert (rec[2] == 0).all()


def test_vectorised_keys_are_draft_heads_keys():
    vals = np.array([0.0, -0.0, 1.5, -1.5, np.inf, -np.inf, np.nan, 3e-41, -3e-41, 65504.0], np.float32)
    idx = np.arange(vals.size) * 1013
    got = dss.pack_keys(vals, idx)
    assert [int(k) for k in got] == [draft_head.pack_key(v, i) for v, i in zip(vals, idx)]
    back = dss.key_values((got >> np.uint64(32)).astype(np.uint32))
    finite = ~np.isnan(vals)
    np.testing.assert_array_equal(
        back[finite], np.where(vals[finite] == 0, 0.0, vals[finite]).astype(np.float32)
    )
    assert np.isnan(back[~finite]).all()
    np.testing.assert_array_equal(dss.key_indices(got), idx)


def test_noise_at_global_indices_is_keyed_rngs_gumbel():
    g = gumbel(99, 12, 2, Stream.DRAFT, 700)
    np.testing.assert_array_equal(dss.noise(99, 12, 2, np.arange(300, 700)), g[300:])


def test_workspace_bytes():
    m, world, n, cap = 5, 4, 9000, 256
    r, p, chunks = 256, 256, 3
    assert dss.shard_sample_workspace_bytes(m, world, n, cap) == 4 * 256 + 8 * (
        m * r + world * m * r + m * chunks * p
    )
    assert dss.shard_sample_workspace_bytes(m, world, n, 1) == 4 * 256 + 8 * (
        m * 3 + world * m * 3 + m * chunks * 2
    )
    assert dss.shard_sample_workspace_bytes(3, world, n) < dss.shard_sample_workspace_bytes(m, world, n)
    with pytest.raises(ValueError, match="m=0"):
        dss.shard_sample_workspace_bytes(0, world, n)
