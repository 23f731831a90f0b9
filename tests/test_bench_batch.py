"""bench/bench_batch.py on the host: the batch's contexts, the distinct-expert count, the byte
floors against a hand count at a tiny config (and against the proposer's own buffers through
draft_bytes), the graph catcher and timer, the table. measure_batch runs end to end on the host
backend once MtpProposer has the batched API (skipped before)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from bench import bench_batch as bb
from bench.bench_propose import draft_bytes
from model.config import tiny
from model.proposer import MtpProposer
from model.sampling import SamplingParams
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import bf16_weights, make_proposer, upload_rows

# tiny(): H 64, V 97, 4 heads, q_lora 48, kv_lora 32, nope 16, rope 0, v 16; indexer 2 heads x 16,
# top-k 8 rows in pools of 2 (4 pools); 8 experts top-2 of intermediate 24, one shared expert.
CFG = tiny(index_topk=8, index_kpool=2, max_context=64)
SHARE = dataclasses.replace(CFG, dsa=dataclasses.replace(CFG.dsa, share_for_mtp_iteration=True))

# Weights by hand (bytes): eh_proj 64*128*2; fused_in (32 + 16 + 16 + 48 + 2 = 114, zero rows up to
# 120) rows x 64 x 2;
# q_fused (4*16 + 2*16) x 48 x 2; wk_t 4*32*16*2; wv 4*16*32*2; o_proj 64*64*2; router 8*64*2;
# shared expert 3*24*64*2. One expert 3*24*64*2. Head 97*64*2, or FP8 97*64 + 97 f32 scales.
BLOCK = 16384 + 15360 + 9216 + 4096 + 4096 + 8192 + 1024 + 9216
EXPERT = 9216
HEAD_BF16, HEAD_FP8 = 12416, 6596
LAT, POOL, ROW_IN = 32 + 4, 16 + 4, 64 * 2  # FP8 latent + scale, FP8 pool key + scale, a BF16 row
WRITE, COMPLETE = LAT + 2 * 16 * 2, 2 * 16 * 2 + POOL  # every row; a row completing a pool, besides


def test_contexts_for_the_batch_kinds():
    assert bb.contexts_for("uniform", 3) == [4096] * 3
    r = bb.contexts_for("ragged", 5)
    assert r == [128, 4096, 8064, 12032, 16000]
    assert bb.contexts_for("ragged", 1) == [8064]
    assert bb.contexts_for(100, 2) == [100, 100]
    shuffled = bb.contexts_for("ragged", 64, np.random.default_rng(0))
    assert sorted(shuffled) == bb.contexts_for("ragged", 64) and shuffled != sorted(shuffled)
    with pytest.raises(ValueError, match="kind"):
        bb.contexts_for("spread", 4)
    with pytest.raises(ValueError, match="batch"):
        bb.contexts_for("uniform", 0)


def test_distinct_experts():
    ids = np.array([[3, 1], [1, 7], [3, 0]], np.uint32)
    assert bb.distinct_experts(ids, 8) == 4
    assert bb.distinct_experts(np.zeros((0, 2), np.int32), 8) == 0
    assert bb.distinct_experts(np.arange(288).reshape(36, 8), 288) == 288
    with pytest.raises(ValueError, match="0..7"):
        bb.distinct_experts(np.array([[8, 1]]), 8)  # a padding row's id, say
    with pytest.raises(ValueError, match="0..7"):
        bb.distinct_experts(np.array([[-1, 1]]), 8)
    with pytest.raises(ValueError, match="integers"):
        bb.distinct_experts(np.array([[0.5]]), 8)


def test_expected_distinct_experts():
    assert bb.expected_distinct_experts(288, 8, 1) == pytest.approx(8)
    assert bb.expected_distinct_experts(288, 8, 16) == pytest.approx(104.5, abs=0.1)
    assert bb.expected_distinct_experts(288, 8, 64) == pytest.approx(240.5, abs=0.2)
    # Against a simulation of uniform top-8 sets.
    rng = np.random.default_rng(1)
    sim = [
        bb.distinct_experts(np.stack([rng.choice(288, 8, replace=False) for _ in range(16)]), 288)
        for _ in range(300)
    ]
    assert np.mean(sim) == pytest.approx(bb.expected_distinct_experts(288, 8, 16), abs=1.0)


def test_batch_floor_by_hand():
    # Sequence at 5, drafts at rows 5 and 6: 3 complete pools <= 4, every row attended (6, then
    # 7); row 5 completes pool 2. Sequence at 20: rows 20 (10 pools > 4: 4 pools' 8 rows + the
    # 1-row tail) and 21 (11 pools, no tail: 8 rows); row 21 completes a pool.
    reads = (
        (6 * LAT + 3 * POOL + 2 * ROW_IN)  # row 5: latents, pool keys, embedding, target hidden
        + (7 * LAT + 3 * POOL + ROW_IN)
        + (9 * LAT + 10 * POOL + 2 * ROW_IN)
        + (8 * LAT + 11 * POOL + ROW_IN)
    )
    writes = 4 * WRITE + 2 * COMPLETE
    got = bb.batch_floor_bytes(CFG, [5, 20], 2, [3, 4], fp8_head=False)
    assert got == {
        "block": 2 * BLOCK,
        "experts": 7 * EXPERT,
        "head": 2 * HEAD_BF16,
        "cache_reads": reads,
        "cache_writes": writes,
        "total": 2 * BLOCK + 7 * EXPERT + 2 * HEAD_BF16 + reads + writes,
    }
    assert bb.batch_floor_bytes(CFG, [5, 20], 2, [3, 4], fp8_head=True)["head"] == 2 * HEAD_FP8
    # Fractional (expected) expert counts are rounded in bytes, not per draft.
    assert bb.batch_floor_bytes(CFG, [5], 2, [1.5, 2.0], False)["experts"] == round(3.5 * EXPERT)


def test_batch_floor_with_a_shared_selection_by_hand():
    # Drafts 2 and 3 attend draft 1's 9 rows plus the rows drafted since, and read no pool key.
    got = bb.batch_floor_bytes(SHARE, [20], 3, [2, 2, 2], fp8_head=True)
    assert got["cache_reads"] == (9 * LAT + 10 * POOL + 2 * ROW_IN) + (10 * LAT + ROW_IN) + (
        11 * LAT + ROW_IN
    )
    assert got["cache_writes"] == 3 * WRITE + COMPLETE  # row 21 completes pool 10
    assert got["block"] == 3 * BLOCK and got["head"] == 3 * HEAD_FP8 and got["experts"] == 6 * EXPERT


def test_batch_floor_agrees_with_draft_bytes_and_the_proposer():
    """One sequence, one draft: the cache reads are draft_bytes' (plus the target's hidden row),
    and a floor counted on the proposer's own buffers is the one counted from the config."""
    prop = make_proposer(CFG, bf16_weights(CFG, 3), gpu=HostBackend())
    try:
        for ctx in (0, 3, 7, 8, 9, 20, 41):
            want = draft_bytes(prop, ctx, True)
            got = bb.batch_floor_bytes(prop, [ctx], 1, [CFG.moe.num_experts_per_tok], True)
            assert got["cache_reads"] == want["caches"] + ROW_IN, ctx
            assert got["block"] == sum(want[n] for n in bb.BLOCK_WEIGHTS)
            assert got["experts"] == want["experts"] and got["head"] == want["head"]
            assert got == bb.batch_floor_bytes(CFG, [ctx], 1, [CFG.moe.num_experts_per_tok], True)
    finally:
        prop.close()


def test_batch_floor_refuses_bad_counts():
    with pytest.raises(ValueError, match="2 expert counts for 3 drafts"):
        bb.batch_floor_bytes(CFG, [5], 3, [2, 2], False)
    with pytest.raises(ValueError, match="outside 0..8"):
        bb.batch_floor_bytes(CFG, [5], 1, [9], False)
    with pytest.raises(ValueError, match="at least one sequence"):
        bb.batch_floor_bytes(CFG, [], 1, [2], False)


def test_catchup_and_step_floors_by_hand():
    # Rows 6 and 7 for the first sequence (7 completes pool 3), none for the second: eh_proj and
    # the cache rows of fused_in (32 + 16 + 16) once, two embedding + hidden row pairs.
    got = bb.catchup_floor_bytes(CFG, [6, 21], [2, 0])
    weights = 64 * 128 * 2 + 64 * 64 * 2
    assert got == {
        "weights": weights,
        "inputs": 2 * 2 * ROW_IN,
        "cache_writes": 2 * WRITE + COMPLETE,
        "total": weights + 2 * 2 * ROW_IN + 2 * WRITE + COMPLETE,
    }
    assert bb.catchup_floor_bytes(CFG, [6, 21], [0, 0])["total"] == 0
    step = bb.step_floor_bytes(CFG, [5, 20], [2, 0], 2, [3, 3], False)
    assert step["catchup"] == got["total"]
    assert step["propose"] == bb.batch_floor_bytes(CFG, [8, 21], 2, [3, 3], False)["total"]
    assert step["total"] == step["catchup"] + step["propose"]


class _FakeGpu:
    def __init__(self):
        self.launched = []

    def graph_launch(self, graph, stream=None):
        self.launched.append((graph, stream))


def test_caught_graphs_records_forwards_and_restores():
    gpu = _FakeGpu()
    with bb.caught_graphs(gpu) as caught:
        gpu.graph_launch("g1", 5)
        gpu.graph_launch("g2", 5)
    assert caught == [("g1", 5), ("g2", 5)] and gpu.launched == caught
    assert "graph_launch" not in vars(gpu)  # the class's method again
    gpu.graph_launch("g3")
    assert caught == [("g1", 5), ("g2", 5)]
    with pytest.raises(RuntimeError), bb.caught_graphs(gpu):
        raise RuntimeError("inside")
    assert "graph_launch" not in vars(gpu)


def test_time_graphs_replays_a_proposer_graph_on_the_host_backend():
    gpu = HostBackend()
    prop = make_proposer(CFG, bf16_weights(CFG, 3), gpu=gpu, use_graphs=True)
    st = prop.alloc_state()
    rng = np.random.default_rng(2)
    hid = upload_rows(gpu, rng.standard_normal((1, CFG.hidden_size)))
    try:
        prop.prefill_drafter(
            st, list(rng.integers(0, CFG.vocab_size, 14)), upload_rows(gpu, np.zeros((13, 64)))
        )
        with bb.caught_graphs(gpu) as caught:
            drafts = prop.propose(st, 5, hid, 13, 2)
        assert caught == [(prop.captured_graphs[(1, 2)], prop.stream)]
        assert bb.time_graphs(gpu, caught, 3) > 0
        assert prop.propose(st, 5, hid, 13, 2) == drafts  # replays redo the same step
    finally:
        prop.close()


def _row(**kw):
    r = {
        "kind": "ragged",
        "B": 4,
        "k": 3,
        "head": "fp8",
        "contexts": [128, 8064, 16000],
        "distinct_experts": [8.0, 8.0, 7.0],
        "experts_from": "router",
        "floor_bytes": {"total": 123_000_000},
        "floor_ms": 0.5,
        "graph_device_ms": 0.6,
        "graph_wall_ms": 0.65,
        "host_us": 50.0,
        "host_cpu_us": float("nan"),
        "over_floor": 1.2,
        "ms_per_seq_draft": 0.05,
    }
    r.update(kw)
    return r


def test_batch_table():
    text = bb.batch_table(
        [_row(), _row(kind="uniform", contexts=[4096, 4096, 4096], experts_from="expected")]
    )
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "ragged 128..16000 (mean 8064)" in lines[2] and "| 8/8/7 |" in lines[2]
    assert "uniform 4096 |" in lines[3] and "(expected)" in lines[3]
    assert "| 123 | 0.500 | 0.600 | 1.20 | 50.0 | 0.650 | 50 | - |" in lines[2]
    assert "torch" not in lines[0] and "step" not in lines[0]
    both = bb.batch_table(
        [_row(torch_graph_ms=1.2, step_floor_ms=1.0, step_wall_ms=1.1, step_over_floor=1.1), _row()]
    )
    head, _, r1, r2 = both.splitlines()
    assert "torch / ours" in head and "step x floor" in head
    assert r1.endswith("| 1.000 | 1.100 | 1.10 | 1.200 | 2.00 |")
    assert r2.endswith("| - | - | - | - | - |")
    assert all(line.count("|") == head.count("|") for line in (r1, r2))


HAS_BATCH_API = all(hasattr(MtpProposer, n) for n in ("propose_batch", "catchup_batch", "after_verify_batch"))


@pytest.mark.skipif(not HAS_BATCH_API, reason="MtpProposer has no batched API yet (propose_batch)")
def test_measure_batch_on_the_host_backend():
    cfg = tiny(index_topk=8, index_kpool=2, max_context=128)
    gpu = HostBackend()
    prop = make_proposer(
        cfg, bf16_weights(cfg, 5), gpu=gpu, use_graphs=True, max_sequences=4, max_draft_tokens=2
    )
    live = gpu.stats().live_bytes
    try:
        rows = bb.measure_batch(
            prop,
            gpu,
            (1, 3),
            40,
            2,
            2,
            np.random.default_rng(0),
            bandwidth=1e9,
            sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=2),
        )
        assert [r["B"] for r in rows] == [1, 3]
        assert all(r["sampled_device_ms"] > 0 and r["weights"] == "bf16" for r in rows)
        assert (4, 2, "sampled") in prop.captured_graphs  # B = 3 runs in the bucket of 4
        for r in rows:
            assert r["graph_device_ms"] > 0 and r["floor_ms"] > 0 and r["step_wall_ms"] > 0
            assert r["experts_from"] == "expected" and len(r["distinct_experts"]) == 2
            assert r["floor_bytes"]["total"] == pytest.approx(r["floor_ms"] * 1e6)
            assert not math.isnan(r["over_floor"])
        assert gpu.stats().live_bytes == live  # every state and buffer freed
        assert "| 3 | 2 | bf16 |" in bb.batch_table(rows) and "sampled / greedy" in bb.batch_table(rows)
    finally:
        prop.close()
