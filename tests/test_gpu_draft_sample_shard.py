"""The sharded sampler's PTX (ptx/draft_sample_shard.cu) on one GPU: the ranks emulated one after
the other (each rank's shard of the logits, its own buffers and workspace; the all_gather done on
the host between the local kernels and the commits: tests/sample_shard_util.py run_emulated), at the
real vocabulary n = 154,880 split over 2 and 4 shards, m = 1, 3, 17; world 1 end to end through
sample_sharded_batch and the single-rank communicator, also captured in a graph and replayed.

Checked (every buffer poisoned; tests/sample_shard_util.py check_commit):
- exact: token, q, drafts, probs, host copies and flags bit-identical on every rank; each token the
  reference's draw (model.sampling.draw on the whole row), except where the device's f32 log makes
  two perturbed scores z + g within a few ulps of each other tie the other way (then the device's
  token must be such a near tie: ``near_tie``); greedy q 1; dist[token] bitwise q; padding entries
  and other ranks' dist columns untouched; counters zero after every launch;
- within Q_REL of the float64 reference: q and each rank's dist columns;
- against the host twins: each rank's record (greedy key exact; temperature: zmax exact, the sum
  within 1e-5 relative, the best key and its z exact unless a near tie; top-k: the set of keys
  exact);
- bit for bit: every row of an m = 64 launch, in shuffled order, of an m = 17 subset, and alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from sample_shard_util import (
    RankBuffers,
    ShardCase,
    check_commit,
    expected,
    make_case,
    mixed_params,
    run_emulated,
)

from model.kernels import draft_head
from model.kernels import draft_sample_shard as dss
from model.sampling import GREEDY, SamplingParams
from runtime.comm import SingleRankCommunicator
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

VOCAB = 154_880
NEAR_TIE = 2e-5  # relative gap of two perturbed scores the device's log may order the other way


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_draft_sample_shard"


def scores(case: ShardCase, e: int, idx) -> np.ndarray:
    """The host's perturbed scores z + g of row e at global indices idx."""
    p = case.params[e]
    idx = np.asarray(idx, np.int64)
    z = case.logits[e, idx].astype(np.float32) / np.float32(p.temperature)
    return (z + dss.noise(int(p.seed), int(case.positions[e]), case.draft_index, idx)).astype(np.float32)


def near_tie(case: ShardCase, e: int, a: int, b: int) -> bool:
    s = scores(case, e, [a, b]).astype(np.float64)
    return bool(abs(s[0] - s[1]) <= NEAR_TIE * max(1.0, abs(s[0]), abs(s[1])))


def device_token(case: ShardCase, g: list[dict]):
    """check_commit's token_of: the device's token, which must be the reference's or a near tie."""

    def token_of(e: int) -> int:
        got, want = int(g[0]["entries"][e, 2]), expected(case, e)[0]
        if got != want:
            assert not case.params[e].greedy, f"row {e}: greedy token {got}, reference {want}"
            assert near_tie(case, e, got, want), f"row {e}: token {got}, reference {want}: not a near tie"
        return got

    return token_of


def _mode(case: ShardCase, e: int) -> str:
    p = case.params[e]
    if p.greedy:
        return "greedy"
    return "topk" if 0 < p.top_k < case.vocab else "temp"


def check_records(case: ShardCase, g: list[dict], h: list[dict]) -> None:
    """Each rank's send records, device against twin (see the module docstring)."""
    lo = np.uint64(0xFFFF_FFFF)
    for r in range(case.world):
        for e in case.live:
            gs, hs = g[r]["send"][e], h[r]["send"][e]
            where = f"rank {r} row {e}"
            mode = _mode(case, e)
            if mode == "greedy":
                assert gs[0] == hs[0], f"{where}: greedy key"
            elif mode == "topk":
                keff = min(case.params[e].top_k, case.top_k_cap)
                np.testing.assert_array_equal(
                    np.sort(gs[:keff]), np.sort(hs[:keff]), err_msg=f"{where}: top-k keys"
                )
            else:
                assert gs[1] & lo == hs[1] & lo, f"{where}: zmax"
                gsum = np.array([gs[1] >> np.uint64(32)], np.uint32).view(np.float32)[0]
                hsum = np.array([hs[1] >> np.uint64(32)], np.uint32).view(np.float32)[0]
                assert abs(float(gsum) - float(hsum)) <= 1e-5 * abs(float(hsum)), (
                    f"{where}: sum {gsum} vs {hsum}"
                )
                if gs[0] == hs[0]:
                    assert gs[2] == hs[2], f"{where}: z of the best key"
                else:
                    a, b = (int(x) for x in dss.key_indices(np.array([gs[0], hs[0]], np.uint64)))
                    assert near_tie(case, e, a, b), f"{where}: best index {a}, twin {b}: not a near tie"


def run_and_check(cuda, case: ShardCase) -> list[dict]:
    g = run_emulated(cuda, case)
    h = run_emulated(HostBackend(), case)
    check_commit(case, g, device_token(case, g))
    check_records(case, g, h)
    return g


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("m,pads", [(1, 0), (3, 1), (17, 4)])
def test_kernels_against_the_twins_and_the_reference(cuda, world, m, pads):
    rng = np.random.default_rng()
    run_and_check(cuda, make_case(rng, m, VOCAB, world, pads))


@pytest.mark.parametrize("world", [2, 4])
def test_each_kind_alone(cuda, world):
    """m = 1 for every kind of request (the mixed batches above give each m = 1 launch one kind)."""
    rng = np.random.default_rng()
    for p in mixed_params(rng, VOCAB, 8):  # eight consecutive kinds: each one once
        run_and_check(cuda, make_case(rng, 1, VOCAB, world, params=[p]))


@pytest.mark.parametrize("world", [2, 4])
def test_spread_out_logits(cuda, world):
    """Logits spread like a language model's (standard deviation 12): the local kernel draws the
    noise only within 19.5 of a chunk's largest z, which here skips most of the vocabulary; the
    draws must stay the reference's."""
    rng = np.random.default_rng()
    run_and_check(cuda, make_case(rng, 17, VOCAB, world, pads=2, spread=12.0))


def test_ties_at_every_top_k_boundary(cuda):
    """A handful of logit levels: the kept set ends inside runs of equal z that span chunks and
    shards; the lower index wins on the device as in the reference."""
    rng = np.random.default_rng()
    seeds = rng.integers(0, 2**63, 9).tolist()
    params = [
        SamplingParams(temperature=1.0, top_k=256, seed=seeds[0]),
        SamplingParams(temperature=0.5, top_k=255, seed=seeds[1]),
        SamplingParams(temperature=1.0, top_k=1, seed=seeds[2]),
        SamplingParams(temperature=2.0, top_k=100, seed=seeds[3]),
        SamplingParams(temperature=1.0, top_k=17, seed=seeds[4]),
        SamplingParams(temperature=1.0, seed=seeds[5]),
        GREEDY,
        SamplingParams(temperature=0.7, top_k=2, seed=seeds[7]),
        SamplingParams(temperature=1.1, top_k=200, seed=seeds[8]),
    ]
    for world in (2, 4):
        run_and_check(cuda, make_case(rng, 11, VOCAB, world, pads=2, params=params, ties=True))


def test_a_masked_shard_and_non_finite_rows(cuda):
    rng = np.random.default_rng()
    seeds = rng.integers(0, 2**63, 4).tolist()
    params = [
        SamplingParams(temperature=1.0, seed=seeds[0]),
        SamplingParams(temperature=0.7, top_k=30, seed=seeds[1]),
        SamplingParams(temperature=1.4, seed=seeds[2]),
        GREEDY,
    ]
    case = make_case(rng, 4, VOCAB, 2, params=params)
    lg = case.logits.astype(np.float32)
    lg[:, VOCAB // 2 :] = -np.inf  # rank 1's whole shard
    lg[2, :4096] = -np.inf  # row 2: rank 0's first chunk too
    case.logits = lg.astype(BF16)
    run_and_check(cuda, case)

    bad = make_case(rng, 4, VOCAB, 2, params=[GREEDY, params[0], params[1], GREEDY])
    lg = bad.logits.astype(np.float32)
    lg[0, :] = np.nan
    lg[1, 100_000] = np.inf
    lg[2, 17] = np.inf
    bad.logits = lg.astype(BF16)
    g, h = run_emulated(cuda, bad), run_emulated(HostBackend(), bad)
    fb = bad.flag_byte
    for o in g:
        np.testing.assert_array_equal(o["flags"], h[0]["flags"])
        assert o["flags"][0, fb] == draft_head.NONFINITE_NAN and int(o["entries"][0, 2]) == 0
        assert o["flags"][1, fb] == draft_head.NONFINITE_INF and o["flags"][2, fb] == draft_head.NONFINITE_INF
        assert o["flags"][3, fb] == 0
        np.testing.assert_array_equal(o["entries"][[0, 3]], g[0]["entries"][[0, 3]])


def _row_bytes(case: ShardCase, o: dict, e: int) -> dict[str, bytes]:
    out = {
        n: o[n][e].tobytes()
        for n in ("entries", "drafts", "probs", "host_drafts", "host_probs", "flags", "dist")
    }
    send = o["send"][e].copy()
    if case.params[e] is not None and _mode(case, e) == "topk":
        keff = min(case.params[e].top_k, case.top_k_cap)
        send[:keff] = np.sort(send[:keff])  # the kernel stores the set in no particular order
    out["send"] = send.tobytes()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_row_is_bit_identical_alone_and_in_any_batch(cuda, world):
    rng = np.random.default_rng()
    case = make_case(rng, 64, VOCAB, world, pads=9, kmax=2)
    full = run_emulated(cuda, case)
    check_commit(case, full, device_token(case, full))
    order = rng.permutation(case.m).tolist()
    sub = order[:17]
    runs = [(order, run_emulated(cuda, case.rows(order))), (sub, run_emulated(cuda, case.rows(sub)))]
    for e in rng.choice(case.m, 4, replace=False).tolist():
        runs.append(([e], run_emulated(cuda, case.rows([e]))))
    for rows, outs in runs:
        for j, e in enumerate(rows):
            for r in range(world):
                want = _row_bytes(case, full[r], e)
                got = _row_bytes(case.rows(rows), outs[r], j)
                for name in want:
                    assert got[name] == want[name], (
                        f"rank {r} row {e} (at {j} of {len(rows)}): {name} differs"
                    )


def test_world_1_end_to_end_and_graph_replay(cuda):
    """sample_sharded_batch with the single-rank communicator (its all_gather a device copy): direct,
    then captured once and replayed with records rewritten to other seeds."""
    rng = np.random.default_rng()
    case = make_case(rng, 17, VOCAB, 1, pads=3, publish=True)
    rb = RankBuffers(cuda, case, 0)
    comm = SingleRankCommunicator(cuda)
    try:
        rb.run_sharded(comm)
        cuda.synchronize()
        g = [rb.read()]
        check_commit(case, g, device_token(case, g))
        check_records(case, g, run_emulated(HostBackend(), case))
        s = cuda.create_stream()
        try:
            cuda.begin_capture(s)
            dss.sample_sharded_batch(
                cuda, comm, workspace=rb.ptrs["workspace"], stream=s, **rb.common(), **rb.commit_args()
            )
            graph = cuda.end_capture(s, label="sharded sampling, world 1")
            try:
                base = rb.ptrs["dist"].addr
                dists = [
                    base + 4 * e * case.kmax * case.vocab if case.with_dist[e] else 0 for e in range(case.m)
                ]
                for _ in range(2):
                    params = [
                        None
                        if p is None
                        else SamplingParams(p.temperature, p.top_p, p.top_k, int(rng.integers(0, 2**63)))
                        for p in case.params
                    ]
                    recs = dss.pack_sample_records(
                        [p or GREEDY for p in params], case.positions.tolist(), dists
                    )
                    cuda.copy_h2d(rb.ptrs["sampling"], recs)
                    cuda.copy_h2d(rb.ptrs["entries"], case.entries)
                    cuda.copy_h2d(rb.ptrs["drafts"], case.prior_drafts)
                    cuda.copy_h2d(rb.ptrs["probs"], case.prior_probs)
                    cuda.memset(rb.ptrs["dist"], 0xFF, 4 * case.m * case.kmax * case.vocab)
                    cuda.memset(rb.ptrs["host_drafts"], 0xFF, 4 * case.m * case.kmax)
                    cuda.memset(rb.ptrs["host_probs"], 0xFF, 4 * case.m * case.kmax)
                    cuda.synchronize()
                    cuda.graph_launch(graph, s)
                    cuda.synchronize(s)
                    replayed = ShardCase(**{**case.__dict__, "params": params})
                    out = [rb.read()]
                    check_commit(replayed, out, device_token(replayed, out))
            finally:
                cuda.graph_destroy(graph)
        finally:
            cuda.destroy_stream(s)
    finally:
        rb.free()
