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
from model.config import tiny, tiny_rope
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


# ---- the RoPE family (GLM-5, DeepSeek-V3.2): MLA with a rope key, the per-token indexer ------------

# tiny_rope(): H 64, V 97, 4 heads, q_lora 48, kv_lora 32, nope 16, rope 16, v 16; the per-token
# indexer, 2 heads x 32 (its first 16 dims rotated), top-8 rows, pools of one row and no tail, drafts
# not sharing the selection; 8 experts top-2 of intermediate 24, one shared expert.
# Weights by hand (bytes): eh_proj 64*128*2; fused_in kv_a (32 latent + 16 rope) + wk 32 (no
# compress gate) + q_a 48 + weights_proj 2 = 130 rows, zero rows up to 136, x 64 x 2; q_fused
# (4*(16 + 16) + 2*32) x 48 x 2; wk_t 4*32*16*2; wv 4*16*32*2; o_proj 64*64*2; router 8*64*2;
# shared expert 3*24*64*2.
R_BLOCK = 16384 + 17408 + 18432 + 4096 + 4096 + 8192 + 1024 + 9216
# With the checkpoint's FP8 tensors kept (kv_a's 48 rows, q_a, q_b, o_proj, the experts; one f32
# scale per 128 x 128 block, one block each here): fused_in 48*64+4, 48*64+4 and 40 BF16 rows;
# q_fused 128*48+4 and wq_b's 64 BF16 rows; o_proj 64*64+4; the shared expert 3*(24*64+4).
R_EXPERT_FP8 = 3 * (24 * 64 + 4)
R_BLOCK_FP8 = 16384 + (3076 + 3076 + 40 * 128) + (6148 + 64 * 96) + 4096 + 4096 + 4100 + 1024 + R_EXPERT_FP8
R_ROW = 32 + 4 + 16 * 2  # a selected row: FP8 latent + scale, BF16 rope key
R_KEY = 32 + 4  # a token's FP8 indexer key + scale (its pool's)
R_WRITE = (32 + 4) + 16 * 2 + R_KEY  # every row: latent, rope key, its key; no BF16 key or gate


def _rope_cfg(family):
    return tiny_rope(family=family, max_context=64)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_rope_family_floor_by_hand(family):
    cfg = _rope_cfg(family)
    # Sequence at 5, drafts at rows 5 and 6: at most 8 rows, all attended (6, then 7), every key
    # of rows 0..n read (6, then 7). Sequence at 20: 8 of 21, then 8 of 22 rows attended, 21 then
    # 22 keys read: the selection is not shared, so the second draft runs the indexer again.
    reads = (
        (6 * R_ROW + 6 * R_KEY + 2 * ROW_IN)
        + (7 * R_ROW + 7 * R_KEY + ROW_IN)
        + (8 * R_ROW + 21 * R_KEY + 2 * ROW_IN)
        + (8 * R_ROW + 22 * R_KEY + ROW_IN)
    )
    got = bb.batch_floor_bytes(cfg, [5, 20], 2, [3, 4], fp8_head=False)
    assert got == {
        "block": 2 * R_BLOCK,
        "experts": 7 * EXPERT,
        "head": 2 * HEAD_BF16,
        "cache_reads": reads,
        "cache_writes": 4 * R_WRITE,
        "total": 2 * R_BLOCK + 7 * EXPERT + 2 * HEAD_BF16 + reads + 4 * R_WRITE,
    }
    fp8 = bb.batch_floor_bytes(cfg, [5, 20], 2, [3, 4], fp8_head=True, fp8_weights=True)
    assert fp8["block"] == 2 * R_BLOCK_FP8 and fp8["experts"] == 7 * R_EXPERT_FP8
    assert fp8["head"] == 2 * HEAD_FP8 and fp8["cache_reads"] == reads
    assert [bb.selection_size(cfg, r) for r in (0, 6, 7, 8, 500)] == [1, 7, 8, 8, 8]
    # The catch-up: eh_proj and the context rows of fused_in (latent 32, rope 16, key 32) once.
    cu = bb.catchup_floor_bytes(cfg, [6, 21], [2, 0])
    assert cu["weights"] == 64 * 128 * 2 + 80 * 64 * 2
    assert cu["inputs"] == 2 * 2 * ROW_IN and cu["cache_writes"] == 2 * R_WRITE


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("fp8", [False, True])
def test_rope_family_floor_agrees_with_the_proposer(family, fp8):
    """The floor counted on a host proposer's own buffers (its fused segments with kv_a's rope rows
    and no compress gate, its q_b with the rope dims) is the one counted from the config, BF16 and
    with the FP8 tensors kept; and draft_bytes' cache reads are sequence_bytes' for one draft."""
    from model.checkpoint.random_init import tiled_fp8_weights

    cfg = _rope_cfg(family)
    w = tiled_fp8_weights(cfg) if fp8 else bf16_weights(cfg, 3)
    prop = make_proposer(cfg, w, gpu=HostBackend(), max_sequences=3)
    try:
        assert prop.pools.layers[0].keys is None and prop.pools.layers[0].rope_keys is not None
        for ctx in (0, 5, 7, 8, 20, 41):
            got = bb.batch_floor_bytes(prop, [ctx, ctx + 3], 2, [2, 3], True)
            assert got == bb.batch_floor_bytes(cfg, [ctx, ctx + 3], 2, [2, 3], True, fp8_weights=fp8), ctx
            one = bb.batch_floor_bytes(prop, [ctx], 1, [2], True)
            assert one["cache_reads"] == draft_bytes(prop, ctx, True)["caches"] + ROW_IN
        # The memory estimate: the weights without the norms and biases, the caches as allocated
        # (the estimate counts each claim's own copy of its block table besides).
        est = bb.proposer_memory(cfg, 3, prop.rows_cap, fp8)
        rep = prop.memory_report()
        assert 0.98 * rep["weights"] < est["weights"] <= rep["weights"]
        pools = rep["kv_pool"] + rep["indexer_caches"]
        assert pools <= est["caches"] <= 1.01 * pools
    finally:
        prop.close()


def test_longest_context_and_the_kinds():
    from model.config import deepseek_v32, glm5, glm5_flash

    assert bb.longest_context(glm5(), 3) == 202752 - 7
    assert bb.longest_context(deepseek_v32(), 1) == 163840 - 3
    assert bb.resolve_kind("longest", glm5_flash(), 2) == 202752 - 5
    assert bb.resolve_kind("5000", glm5(), 3) == 5000 and bb.resolve_kind("ragged", glm5(), 3) == "ragged"
    assert bb.contexts_for("202745", 2) == [202745, 202745]  # a row's recorded kind
    with pytest.raises(ValueError, match="kind"):
        bb.contexts_for("longest", 2)  # resolved against a model first
    for argv in (["--kinds", "sideways"], ["--model", "glm4"]):
        with pytest.raises(SystemExit) as e:
            bb.main(argv)  # refused before any device is touched
        assert e.value.code == 2


def test_model_config_sizes_the_reservation():
    from bench.bench_propose import model_config

    assert model_config("glm5_next") == bb.ModelConfig.from_hf_dict(model_config("glm5_next").to_hf_dict())
    assert model_config("glm5").dsa.max_context == 16384  # short runs: the presets' own
    assert model_config("glm5", 202752).dsa.max_context == 202752
    assert model_config("deepseek_v32", 100).dsa.max_context == 16384
    assert model_config("deepseek_v32").moe.n_group == 8
    with pytest.raises(ValueError, match="glm5_next"):
        model_config("glm4")


def _read(gpu, ptr, n, dtype):
    a = np.empty(n, dtype)
    gpu.copy_d2h(a.view(np.uint8), ptr)
    return a


@pytest.mark.parametrize("which", ["kpool", "rope"])
def test_fill_context_writes_every_cache_of_the_slot(which):
    """bench_propose.fill_context on a host proposer's second slot: the latents (through the block
    table, in runs of consecutive blocks), the rope keys and the per-token pool keys of the RoPE
    family (no keys or gates), the KPool indexer's keys, gates and pools; each array where the
    kernels read it, read back against the same draws."""
    from bench.bench_propose import fill_context
    from runtime.dtypes import BF16 as BF

    cfg = CFG if which == "kpool" else _rope_cfg("glm_moe_dsa")
    gpu = HostBackend()
    prop = make_proposer(cfg, bf16_weights(cfg, 3), gpu=gpu, max_sequences=3)
    try:
        prop.alloc_state()
        st = prop.alloc_state()
        assert st.slot == 1
        rows = 37  # two whole blocks of 16 and part of a third
        fill_context(prop, st, rows, np.random.default_rng(9))
        assert st.rows == rows
        rng = np.random.default_rng(9)  # the same draws, in fill_context's order
        a, d = cfg.attention, cfg.dsa
        C, idim, rope = a.kv_lora_rank, d.index_head_dim, a.qk_rope_head_dim
        lat = rng.integers(0, 256, (rows, C), dtype=np.uint8) & np.uint8(0xBF)
        sc = (0.02 + 0.01 * rng.random(rows)).astype(np.float32)
        pools, lp, g = prop.pools, prop.pools.layers[0], prop.pools.geometry
        for r in range(rows):
            slot = pools.latent_slot(st.slot, r)
            assert np.array_equal(_read(gpu, pools.kv.data[0].offset(slot * C), C, np.uint8), lat[r])
            assert _read(gpu, pools.kv.scales[0].offset(slot * 4), 1, np.float32)[0] == sc[r]
        if which == "kpool":
            keys = rng.standard_normal((rows, idim), dtype=np.float32).astype(BF)
            gates = rng.standard_normal((rows, idim), dtype=np.float32).astype(BF)
            off = g.key_row(st.slot, 0) * 2
            assert np.array_equal(_read(gpu, lp.keys.offset(off), rows * idim, BF).reshape(rows, idim), keys)
            assert np.array_equal(
                _read(gpu, lp.gates.offset(off), rows * idim, BF).reshape(rows, idim), gates
            )
        else:
            assert lp.keys is None and lp.gates is None
            kr = rng.standard_normal((rows, rope), dtype=np.float32).astype(BF)
            got = _read(gpu, lp.rope_keys.offset(st.slot * pools.slot_rows * rope * 2), rows * rope, BF)
            assert np.array_equal(got.reshape(rows, rope), kr)
        npools = rows // d.index_kpool
        pk = rng.integers(0, 256, (npools, idim), dtype=np.uint8) & np.uint8(0xBF)
        ps = (0.01 + 0.01 * rng.random(npools)).astype(np.float32)
        p0 = g.pool_row(st.slot, 0)
        assert np.array_equal(
            _read(gpu, lp.pool_keys.offset(p0 * idim), npools * idim, np.uint8), pk.reshape(-1)
        )
        assert np.array_equal(_read(gpu, lp.pool_scales.offset(p0 * 4), npools, np.float32), ps)
    finally:
        prop.close()


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_measure_batch_on_the_host_backend_at_the_rope_family(family):
    cfg = tiny_rope(family=family, max_context=128)
    gpu = HostBackend()
    prop = make_proposer(
        cfg, bf16_weights(cfg, 5), gpu=gpu, use_graphs=True, max_sequences=4, max_draft_tokens=2
    )
    live = gpu.stats().live_bytes
    try:
        for fill in ("direct", "catchup"):
            rows = bb.measure_batch(
                prop, gpu, (1, 3), 40, 2, 2, np.random.default_rng(0), bandwidth=1e9, fill=fill
            )
            assert [r["B"] for r in rows] == [1, 3]
            for r in rows:
                assert r["graph_device_ms"] > 0 and r["step_wall_ms"] > 0
                ctx = bb.contexts_for(40, r["B"])
                want = bb.batch_floor_bytes(cfg, ctx, 2, r["distinct_experts"], True)
                assert r["floor_bytes"] == want
        assert gpu.stats().live_bytes == live
    finally:
        prop.close()


def test_run_on_the_host_backend_sizes_skips_and_passes_the_model(monkeypatch):
    """bench_batch.run end to end on the host backend with the presets replaced by a tiny config:
    the proposer sized for the longest kind, the batches that do not fit the device dropped with a
    note (largest first), both weight kinds measured, and the PyTorch rows run at the model's config
    (their step replaced by a stub here: the PyTorch step needs CUDA) or skipped when too large."""
    from types import SimpleNamespace

    torch_step = pytest.importorskip("bench.torch_step")  # PyTorch: its rows' bookkeeping

    def tiny_model(name, max_context=64):
        assert name == "glm5"
        return tiny(index_topk=8, index_kpool=2, max_context=max(max_context, 64))

    monkeypatch.setattr(bb, "model_config", tiny_model)
    monkeypatch.setattr(bb, "copy_bandwidth", lambda gpu, *a: 1e9)
    cfg = tiny_model("glm5")
    assert bb.longest_context(cfg, 2) == 59
    est = {B: bb.proposer_memory(cfg, B, 64, True)["total"] for B in (2, 3)}
    gpu = HostBackend(capacity_bytes=bb.MEMORY_RESERVE + (est[2] + est[3]) // 2)
    calls = []

    def fake_run_batch(ctx, k, **kw):
        calls.append((list(ctx), k, kw["cfg"], kw["fp8_experts"]))
        return 2.0

    monkeypatch.setattr(torch_step, "run_batch", fake_run_batch)
    monkeypatch.setattr(torch_step.torch.cuda, "mem_get_info", lambda: (0, 64 << 30))
    args = SimpleNamespace(
        model="glm5",
        kinds=("longest", "20"),
        batches=(1, 2, 3),
        k=2,
        iters=2,
        torch=True,
        head="auto",
        projections="auto",
        weights=("bf16", "fp8"),
        sampling="",
        step=True,
        profile=0,
    )
    res = bb.run(args, gpu)
    assert res["model"] == "glm5" and res["served_rows"] == 64
    # B = 3 does not fit: every row is at B 1 or 2, for both weight kinds and both kinds.
    assert [(r["weights"], r["kind"], r["B"]) for r in res["rows"]] == [
        (w, kd, B) for w in ("bf16", "fp8") for kd in ("59", "20") for B in (1, 2)
    ]
    assert set(res["memory_estimate"]) == {"bf16", "fp8"}
    assert all(r["floor_ms"] > 0 and r["graph_device_ms"] > 0 for r in res["rows"])
    assert all(r["torch_graph_ms"] == 2.0 for r in res["rows"])
    assert all(c[2] is not None and c[2].dsa.max_context == 64 for c in calls)
    assert ([59, 59], 2, calls[0][2], False) in calls and any(c[3] for c in calls)  # FP8 experts too
    # A PyTorch row the device cannot hold is skipped (NaN), not run.
    calls.clear()
    monkeypatch.setattr(torch_step.torch.cuda, "mem_get_info", lambda: (0, bb.MEMORY_RESERVE))
    bb._torch_rows(args, res, cfg)
    assert not calls and all(math.isnan(r["torch_graph_ms"]) for r in res["rows"])
    assert gpu.stats().live_bytes == 0


@pytest.mark.parametrize(
    "argv, pdl_during_run, ptx_dir", [([], True, None), (["--no-pdl", "--ptx-dir", "v"], False, "v")]
)
def test_main_passes_pdl_and_the_ptx_dir_to_the_backend(monkeypatch, argv, pdl_during_run, ptx_dir):
    """--ptx-dir reaches the backend; --no-pdl turns PDL off for the whole run (so the graphs are
    captured without it) and the backend's own setting is restored after."""
    import runtime.cuda_backend as cb

    seen: dict = {}

    class FakeBackend:
        def __init__(self, ptx_dir=None):
            seen["ptx_dir"] = ptx_dir
            self.pdl = True

        def close(self):
            seen["pdl_at_close"] = self.pdl

    def fake_run(args, gpu):
        seen["pdl_in_run"] = gpu.pdl
        return {"rows": []}

    monkeypatch.setattr(cb, "CudaBackend", FakeBackend)
    monkeypatch.setattr(bb, "run", fake_run)
    assert bb.main(["--batches", "1", "--kinds", "uniform", *argv]) == 0
    assert seen == {"ptx_dir": ptx_dir, "pdl_in_run": pdl_during_run, "pdl_at_close": True}
