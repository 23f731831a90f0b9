"""The drafter's reach out to 1,048,576 tokens on the host: the selection past the one-block
capacity (16384 pools) up to 262,144 pools through the host twin, the chunked selection's radix
select (a NumPy model) against the plain top-k, the wrapper's refusals and its launches, the sizing
derived from the capacity, the refusal
of a served length past the reservation, the bytes a sequence holds, and the indexer's twin and
path choice at long contexts. tests/test_gpu_dsa_reach.py runs the same checks on the PTX."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from batch_dsa_util import ScoreShape, check_scores, entries_of, read_layout, score_world, scores_f64
from dsa_reach_util import (
    KINDS,
    TIE_KINDS,
    SelectShape,
    check_select_reach,
    check_select_replays,
    layout_rows,
    radix_select_ref,
    reach_scores,
    replay_rounds,
)

from model.config import deepseek_v32, glm5_flash, tiny
from model.dsa import DsaSizingError, check_served_context, drafter_context_rows, max_dsa_context
from model.kernels import dsa_select
from model.kernels.dsa_select import (
    SCORES_MMA2_SMEM,
    SCORES_MMA_MAX_GRID,
    SCORES_MMA_ROUND,
    SELECT_CHUNK,
    SELECT_MAX_TOPK,
    SELECT_THREADS,
    SELECT_WS_HEAD_WORDS,
    TOPK_MAX_POOLS,
    TOPK_SINGLE_BLOCK_POOLS,
    indexer_score_bytes,
    indexer_scores_smem_mma,
    scores_mma2_grid,
    scores_mma_grid,
    scores_mma_groups,
    scores_use_mma,
    select_grid,
    select_map_words,
    select_max_pools,
    select_rows_ref,
    select_smem,
    select_workspace_bytes,
    select_workspace_words,
)
from model.proposer_checks import ProposerError
from model.slot_pools import SlotPools, slot_bytes_by_kind
from runtime.device_ptr import DevicePtr
from runtime.host_backend import HostBackend

GLM_1M = 1 << 20


# ---- the chunked selection's algorithm --------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS + TIE_KINDS)
@pytest.mark.parametrize(
    "npools,topk",
    [
        (16385, 512),  # one pool past the one-block cap: 3 chunks, the last of one pool
        (100_003, 512),
        (262_143, 512),
        (262_144, 512),
        (202_752, 2048),  # GLM-5.2's per-token indexer at kpool 1
        (163_840, 2048),  # DeepSeek-V3.2's
        (20_000, 1),
        (16_500, 16_499),  # all but one
    ],
)
def test_radix_selection_is_the_plain_top_k(kind, npools, topk):
    """The radix select's passes (per-chunk histograms of bits 31..20, 19..10, 9..0 among the keys
    sharing the threshold's digits), its threshold and its tie quota: the global top k, ties to the
    lower pool, for every input (the model asserts exactly one threshold bin a pass and
    count_above(T) < k <= count_above + count_equal)."""
    scores = reach_scores(np.random.default_rng(npools + topk), 1, npools, kind)[0]
    want = select_rows_ref(scores, npools - 1, topk, 1, tail=False)  # kpool 1: rows are pools
    np.testing.assert_array_equal(radix_select_ref(scores, npools, topk), want)


def test_the_model_sees_a_wrong_tie_break():
    """The check above could not fail if select_rows_ref and the model agreed by accident: taking
    the highest-indexed ties instead of the lowest differs wherever the cut is inside a tie."""
    scores = reach_scores(np.random.default_rng(2), 1, 20_000, "cut")[0]
    got = radix_select_ref(scores, 20_000, 512)
    want = select_rows_ref(scores, 19_999, 512, 1, tail=False)
    np.testing.assert_array_equal(got, want)
    tied = np.flatnonzero(scores == 5.0)
    above = int((scores > 5.0).sum())
    wrong = np.sort(np.concatenate([np.flatnonzero(scores > 5.0), tied[-(512 - above) :]]))
    assert above < 512 < above + tied.size and not np.array_equal(wrong, want)


# ---- the twin past the old capacity -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
def test_twin_selection_up_to_262144_pools(kind, tail):
    """GLM-5.3-Flash's top-512 at kpool 4 over slots of 1,048,576 rows: rows at 1 (dense), 1023,
    the one-block cap and one past it, 100,003 and 262,144 complete pools, exact; each entry alone
    gives the same bytes; padding untouched; a row past the slot count 0; counters zero."""
    sh = SelectShape(slot_rows=GLM_1M, kpool=4, topk=512, tail=tail)
    rng = np.random.default_rng(7 + tail)
    lay = layout_rows(rng, sh, [1, 1023, 16384, 16385, 100_003, 262_144], npad=2, outside=True)
    check_select_reach(HostBackend(), reach_scores(rng, len(lay[0]), sh.pps, kind), sh, lay)


@pytest.mark.parametrize("m_live", [1, 3, 9])
def test_twin_selection_small_topk_past_the_cap(m_live):
    """topk 3 at kpool 2 (a tail of at most one row) over slots of 40,000 pools: rows spread over
    both regimes, one just past the one-block cap; cuts inside ties."""
    sh = SelectShape(slot_rows=2 * 40_000 + 1, kpool=2, topk=3, tail=True)
    rng = np.random.default_rng(m_live)
    counts = [int(x) for x in rng.integers(1, sh.pps + 1, m_live)]
    counts[0] = TOPK_SINGLE_BLOCK_POOLS + 1
    lay = layout_rows(rng, sh, counts, npad=1, outside=m_live >= 3)
    check_select_reach(HostBackend(), reach_scores(rng, len(lay[0]), sh.pps, "ties"), sh, lay)


def test_twin_selection_graph_replays():
    """A captured graph of the launches replayed over new scores, then over rows moved between
    the one block and the chunked path (tests/test_gpu_dsa_reach.py replays the PTX alike)."""
    sh = SelectShape(slot_rows=4 * 40_000, kpool=4, topk=64, tail=True)
    rng = np.random.default_rng(12)
    counts = [[40_000, 16_385, 1023], [40_000, 16_385, 1023], [16_384, 39_999, 20_001]]
    check_select_replays(HostBackend(), sh, replay_rounds(rng, sh, counts, ["random", "cut", "equal"]))


def test_twin_selection_past_sel_cap_is_count_zero():
    """A list cap too small for topk * kpool + tail is the visible failure at any pool count."""
    sh = SelectShape(slot_rows=4 * 20_000, kpool=4, topk=512, tail=True)
    rng = np.random.default_rng(3)
    ent, _ = entries_of([(0, 4 * 20_000 - 1), (1, 4 * 17_000 + 2)], 0)
    gpu = HostBackend()
    words = select_workspace_words(sh.pps)
    p = {
        "scores": gpu.alloc(2 * sh.pps * 4),
        "sel": gpu.alloc(2 * 100 * 4),
        "cnt": gpu.alloc(8),
        "entries": gpu.alloc(ent.nbytes),
        "ws": gpu.alloc(2 * words * 4),
    }
    gpu.copy_h2d(p["scores"], reach_scores(rng, 2, sh.pps, "random"))
    gpu.copy_h2d(p["entries"], ent)
    gpu.memset(p["cnt"], 0x07, 8)
    gpu.memset(p["ws"], 0, 2 * words * 4)
    dsa_select.select_topk_pools_batch(
        gpu,
        scores=p["scores"],
        selected=p["sel"],
        count=p["cnt"],
        entries=p["entries"],
        m=2,
        row_add=0,
        slot_rows=sh.slot_rows,
        sel_cap=100,
        topk_pools=512,
        kpool=4,
        tail=True,
        workspace=p["ws"],
    )
    cnt = np.empty(2, np.uint32)
    gpu.copy_d2h(cnt, p["cnt"])
    assert list(cnt) == [0, 0]
    for ptr in p.values():
        gpu.free(ptr)


# ---- the wrapper's contract -------------------------------------------------------------------


def _select_kwargs(p: DevicePtr, **over):
    kw = dict(
        scores=p,
        selected=p,
        count=p,
        entries=p,
        m=1,
        row_add=0,
        slot_rows=4 * (TOPK_SINGLE_BLOCK_POOLS + 1),
        sel_cap=2051,
        topk_pools=512,
        kpool=4,
        tail=True,
    )
    kw.update(over)
    return kw


def test_select_wrapper_refuses_what_it_cannot_rank():
    gpu = HostBackend()
    p = gpu.alloc(64)
    with pytest.raises(ValueError, match="need a workspace of select_workspace_bytes"):
        dsa_select.select_topk_pools_batch(gpu, **_select_kwargs(p))
    with pytest.raises(ValueError, match="past the selection's capacity of 262144 pools"):
        dsa_select.select_topk_pools_batch(
            gpu, **_select_kwargs(p, slot_rows=4 * TOPK_MAX_POOLS + 4, workspace=p)
        )
    with pytest.raises(ValueError, match="ranks at most 2048 pools"):
        dsa_select.select_topk_pools_batch(
            gpu, **_select_kwargs(p, topk_pools=SELECT_MAX_TOPK + 1, workspace=p)
        )
    for m in (0, 70000):
        with pytest.raises(ValueError, match=f"m={m}"):
            dsa_select.select_topk_pools_batch(gpu, **_select_kwargs(p, m=m, workspace=p))
    with pytest.raises(ValueError, match="is not 16-byte aligned"):
        dsa_select.select_topk_pools_batch(gpu, **_select_kwargs(p, workspace=p.offset(4)))
    gpu.free(p)


@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("slot_rows,kpool", [(GLM_1M, 4), (202_752, 1), (4 * TOPK_SINGLE_BLOCK_POOLS, 4)])
def test_select_launches_follow_the_shapes(slot_rows, kpool, m):
    """Where a slot can hold more than TOPK_SINGLE_BLOCK_POOLS pools: the three histogram phases,
    then the selection, over one grid, with SELECT_THREADS threads; else the selection alone. A
    function of the shapes only (the rows are device data), so a captured graph replays them all."""
    gpu = _LaunchRecorder()
    z = gpu.alloc(1 << 16)
    dsa_select.select_topk_pools_batch(
        gpu, **_select_kwargs(z, m=m, slot_rows=slot_rows, kpool=kpool, workspace=z)
    )
    pps = slot_rows // kpool
    grid = (*select_grid(m, pps), 1)
    block = (SELECT_THREADS, 1, 1)
    want = [("select_topk_pools_batch", grid, block, z, select_smem(pps))]
    if pps > TOPK_SINGLE_BLOCK_POOLS:
        want = [("select_radix_hist_batch", grid, block, phase, 0) for phase in range(3)] + want
    assert gpu.launches == want
    gpu.free(z)


def test_select_sizing_follows_the_kernel():
    """Blocks of SELECT_CHUNK pools; a workspace of the histograms and two bitmaps a bit per pool,
    the same for every top-k; shared memory for a row's bitmaps within the one block's 64 KiB; no
    workspace where one block ranks every row."""
    assert SELECT_CHUNK == 8 * SELECT_THREADS == 8192
    assert select_grid(5, TOPK_SINGLE_BLOCK_POOLS) == (1, 5)
    assert select_grid(5, TOPK_SINGLE_BLOCK_POOLS + 1) == (3, 5)
    assert select_grid(5, TOPK_MAX_POOLS) == (32, 5)
    assert select_grid(2, 202_752) == (25, 2)  # GLM-5.2's per-token indexer at kpool 1
    assert select_workspace_words(TOPK_SINGLE_BLOCK_POOLS) == 0
    assert select_workspace_bytes(256, 4 * TOPK_SINGLE_BLOCK_POOLS, 4) == 0
    assert SELECT_WS_HEAD_WORDS == 8 + 4096 + 2 * 1024
    assert select_map_words(TOPK_MAX_POOLS) == 8192
    assert select_map_words(TOPK_SINGLE_BLOCK_POOLS + 1) == 516  # 513 words, rounded to 4
    assert select_workspace_words(TOPK_MAX_POOLS) == 6152 + 2 * 8192
    assert select_workspace_bytes(3, GLM_1M, 4) == 3 * (6152 + 2 * 8192) * 4
    for pps in (TOPK_SINGLE_BLOCK_POOLS + 1, 100_003, 202_752, TOPK_MAX_POOLS - 1, TOPK_MAX_POOLS):
        words = select_workspace_words(pps)
        assert words % 4 == 0 and select_map_words(pps) * 32 >= pps, pps  # 16-byte entries
        assert select_smem(pps) == 64 * 1024, pps  # one block's 16384 keys hold a row's maps
    assert select_smem(1024) == 4096
    assert select_max_pools(512) == TOPK_MAX_POOLS
    assert select_max_pools(SELECT_MAX_TOPK + 1) == TOPK_SINGLE_BLOCK_POOLS


def test_capacity_constants_match_the_kernel():
    src = (Path(__file__).resolve().parent.parent / "ptx" / "dsa_select.cu").read_text()

    def define(name: str) -> int:
        hit = re.search(rf"#define {name} (\d+)u", src)
        assert hit, f"ptx/dsa_select.cu has no #define {name}"
        return int(hit.group(1))

    assert define("TOPK_MAX_POOLS_CUDA") == TOPK_MAX_POOLS
    assert define("TOPK_SINGLE_BLOCK_POOLS") == TOPK_SINGLE_BLOCK_POOLS
    assert define("SELECT_CHUNK") == SELECT_CHUNK
    assert define("SELECT_THREADS") == SELECT_THREADS
    assert (
        define("SEL_WS_HIST0") + define("SEL_HIST0_BINS") + 2 * define("SEL_HIST_BINS")
        == SELECT_WS_HEAD_WORDS
    )
    assert "#define SEL_WS_MAPS (SEL_WS_HIST0 + SEL_HIST0_BINS + 2u * SEL_HIST_BINS)" in src
    words = re.search(r"return SEL_WS_MAPS \+ 2u \* \(size_t\)select_map_words\(pps\);", src)
    assert words, "ptx/dsa_select.cu select_ws_words no longer reads as select_workspace_words"
    maps = re.search(r"return \(\(pps \+ 31u\) / 32u \+ 3u\) & ~3u;", src)
    assert maps, "ptx/dsa_select.cu select_map_words no longer reads as select_map_words"


# ---- sizing and the load-time refusal ---------------------------------------------------------


def test_the_reach_is_derived_from_the_capacity():
    """GLM-5.3-Flash's published reservation (max_position_embeddings 1,048,576) is the reach; a
    larger one stops at the selection's 262,144 pools; a top-k past the chunked selection's stops
    at one block's 16384 pools."""
    d = glm5_flash(max_context=GLM_1M).dsa
    assert max_dsa_context(d) == GLM_1M == TOPK_MAX_POOLS * d.index_kpool
    assert drafter_context_rows(GLM_1M, d) == GLM_1M
    assert drafter_context_rows(131_072, d) == 131_072
    assert max_dsa_context(glm5_flash(max_context=4 * GLM_1M).dsa) == GLM_1M
    assert max_dsa_context(glm5_flash(max_context=GLM_1M + 3).dsa) == GLM_1M
    big_topk = dataclasses.replace(d, index_topk=4 * (SELECT_MAX_TOPK + 1))
    assert max_dsa_context(big_topk) == TOPK_SINGLE_BLOCK_POOLS * 4
    for kpool in (1, 2, 8):
        dk = tiny(index_kpool=kpool, index_topk=8 * kpool, max_context=10 * GLM_1M).dsa
        assert max_dsa_context(dk) == TOPK_MAX_POOLS * kpool


def test_a_served_length_past_the_reservation_is_refused():
    d = glm5_flash(max_context=GLM_1M).dsa
    assert check_served_context(GLM_1M, d) == GLM_1M
    assert check_served_context(4096, d) == 4096
    with pytest.raises(DsaSizingError, match=r"served max_seq_len 1048577 is past the 1048576 rows") as err:
        check_served_context(GLM_1M + 1, d)
    assert isinstance(err.value, ProposerError)
    assert "1048576 tokens" in str(err.value) and "262144" in str(err.value)
    small = glm5_flash(max_context=65_538).dsa  # 16384 whole pools and a 2-row remainder
    with pytest.raises(DsaSizingError, match="65538 tokens is 16384 whole pools of 4"):
        check_served_context(65_537, small)
    with pytest.raises(DsaSizingError, match="must be positive"):
        check_served_context(0, d)


# ---- memory per sequence ----------------------------------------------------------------------


def test_bytes_per_sequence_at_1m():
    cfg = glm5_flash(max_context=GLM_1M)
    got = slot_bytes_by_kind(cfg.dsa, cfg.attention.kv_lora_rank, GLM_1M)
    assert got == {
        "latent_kv": GLM_1M * (512 + 4),
        "rope_keys": 0,
        "block_table": 2 * (GLM_1M // 16) * 4,
        "indexer_keys": GLM_1M * 128 * 2,
        "indexer_gates": GLM_1M * 128 * 2,
        "pool_keys": (GLM_1M // 4) * 128,
        "pool_scales": (GLM_1M // 4) * 4,
    }
    assert sum(got.values()) == 1_113_063_424


@pytest.mark.parametrize("slot_rows,layers", [(100, 1), (77, 2)])
def test_bytes_per_sequence_are_what_the_pools_allocate(slot_rows, layers):
    """slot_bytes_by_kind times the slots is SlotPools' own account, and what the device holds
    (the claims' tables included)."""
    cfg = tiny(max_context=256)
    gpu = HostBackend()
    slots = 3
    before = gpu.stats().live_bytes
    pools = SlotPools(gpu, cfg.dsa, cfg.attention.kv_lora_rank, slot_rows, slots, layers)
    try:
        per = slot_bytes_by_kind(cfg.dsa, cfg.attention.kv_lora_rank, slot_rows, layers)
        own = pools.nbytes_by_kind
        assert slots * (per["latent_kv"] + per["block_table"] // 2) == own["kv_pool"]
        idx = ("indexer_keys", "indexer_gates", "pool_keys", "pool_scales")
        assert slots * sum(per[k] for k in idx) == own["indexer_caches"]
        assert gpu.stats().live_bytes - before >= slots * sum(per.values())
    finally:
        pools.free()


# ---- the indexer at long contexts -------------------------------------------------------------


def test_indexer_twin_past_the_old_cap():
    """The host twin scores every complete pool of rows past 16384 pools (small dims) within the
    f32 bound of the float64 formula, each entry alone the same."""
    sh = ScoreShape(slots=2, slot_rows=4 * 70_000, heads=3, dim=8, kpool=4)
    rng = np.random.default_rng(11)
    m = 4
    world = score_world(rng, sh, m)
    lay = read_layout(rng, sh.slots, sh.slot_rows, m, 1, 4 * 16_385, sh.slot_rows - 1)
    got = check_scores(HostBackend(), world, sh, lay, 1)
    for e, slot, row in lay.live:
        npools = (row + 1) // sh.kpool
        assert npools > TOPK_SINGLE_BLOCK_POOLS
        ref, mag = scores_f64(world, sh, e, slot, row)
        bound = 8 * (sh.dim + sh.heads) * 2.0**-24 * mag + 1e-30
        assert (np.abs(got[e, :npools].astype(np.float64) - ref) <= bound).all()


def test_indexer_path_and_grid():
    """GLM-5.3-Flash's indexer (32 heads of 128) takes the tensor cores in one 32-head group,
    DeepSeek-V3.2's (64 heads) in two; other shapes or misaligned buffers the warp-per-pool path.
    The one-group grid gives an entry one wave at m = 1 and shares about two waves among a batch."""
    a16, a4 = DevicePtr(0x10000), DevicePtr(0x10004)
    assert scores_use_mma(32, 128, a16, 4104, a16)
    assert scores_use_mma(5, 128, a4, 4104, a16)
    assert scores_use_mma(33, 128, a16, 4104, a16)
    assert scores_use_mma(64, 128, a4, 8200, a16)
    assert not scores_use_mma(65, 128, a16, 4104, a16)
    assert not scores_use_mma(0, 128, a16, 4104, a16)
    assert not scores_use_mma(32, 64, a16, 4104, a16)
    assert not scores_use_mma(64, 64, a16, 4104, a16)
    assert not scores_use_mma(32, 128, a16, 4105, a16)
    assert not scores_use_mma(64, 128, a16, 8201, a16)
    assert not scores_use_mma(32, 128, DevicePtr(0x10002), 4104, a16)
    assert not scores_use_mma(64, 128, DevicePtr(0x10002), 8200, a16)
    assert not scores_use_mma(32, 128, a16, 4104, a4)
    assert not scores_use_mma(64, 128, a16, 8200, a4)
    groups = [scores_mma_groups(h, 128, a16, 0, a16) for h in range(0, 70)]
    assert groups == [0] + [1] * 32 + [2] * 32 + [0] * 5
    for cfg, want in ((glm5_flash(), 1), (deepseek_v32(), 2)):
        # model/block.py's launch: q at hl * qk_head_dim BF16 into rows of nq, for any head shard
        a, d = cfg.attention, cfg.dsa
        for hl in range(1, a.num_attention_heads + 1):
            nq = hl * a.qk_head_dim + d.index_n_heads * d.index_head_dim
            q = DevicePtr(0x10000 + hl * a.qk_head_dim * 2)
            assert scores_mma_groups(d.index_n_heads, d.index_head_dim, q, nq, a16) == want, (cfg, hl)
    # The 32-head kernel's grid fills waves as the two-group kernel's does (one block an SM): a
    # whole wave at m = 1, 2 blocks an entry (one wave) for 64 long rows, not 5 (three waves).
    assert scores_mma_grid(1, TOPK_MAX_POOLS) == (128, 1)
    assert scores_mma_grid(1, 1024) == (4, 1)
    assert scores_mma_grid(64, TOPK_MAX_POOLS) == (2, 64)
    assert scores_mma_grid(64, 202_752) == (2, 64)
    assert scores_mma_grid(256, 16) == (1, 256)
    for m in (1, 3, 64, 200, 65535):
        for pps in (1, 33, 16385, 262_144):
            per, mm = scores_mma_grid(m, pps)
            rounds = -(-pps // SCORES_MMA_ROUND)
            rounds8 = -(-rounds // 8)
            assert mm == m and 1 <= per <= min(SCORES_MMA_MAX_GRID, rounds8)
    assert indexer_score_bytes(TOPK_MAX_POOLS, 128) == TOPK_MAX_POOLS * 136


def test_two_group_grid_fills_waves():
    """indexer_scores_batch_mma2's grid: at most one wave (132 blocks, one a SM) an entry, no more
    blocks than a slot's 8-round block loads, a whole wave at m = 1 and 64 of the long rows, and
    never a cost (waves x (busiest warp's rounds + staging)) past 3% of the best count's."""
    assert scores_mma2_grid(1, 262_144) == (128, 1)  # 8 rounds a warp, every warp
    assert scores_mma2_grid(64, 163_840) == (2, 64)  # 128 blocks: one wave
    assert scores_mma2_grid(1, 1) == (1, 1)
    assert scores_mma2_grid(3, 1000) == (4, 3)  # 32 rounds: 4 blocks of 8 warps
    for m in (1, 2, 3, 17, 45, 64, 131, 132, 133, 200, 256, 65535):
        for pps in (1, 7, 33, 1000, 16385, 163_840, 262_144):
            per, mm = scores_mma2_grid(m, pps)
            assert mm == m
            rounds = -(-pps // SCORES_MMA_ROUND)
            rounds8 = -(-rounds // 8)
            assert 1 <= per <= min(SCORES_MMA_MAX_GRID, rounds8), (m, pps, per)

            def cost(k: int) -> int:
                return -(-(m * k) // SCORES_MMA_MAX_GRID) * (-(-rounds8 // k) + 1)

            best = min(cost(k) for k in range(1, min(SCORES_MMA_MAX_GRID, rounds8) + 1))
            assert cost(per) * 100 <= best * 103, (m, pps, per)
            assert all(cost(k) * 100 > best * 103 for k in range(1, per)), (m, pps, per)


def test_two_group_smem_matches_the_kernel():
    """The launch's dynamic shared memory is the kernel's IDX_MMA2_SMEM (16 KB of f16 q for 64
    heads of 128, their 2^-s and weights); the kernel writes nothing with less, so a drift would
    zero DeepSeek-V3.2's scores silently."""
    src = (Path(__file__).resolve().parent.parent / "ptx" / "dsa_select.cu").read_text()
    smem = re.search(r"#define IDX_MMA2_SMEM (\d+)u", src)
    tiles = re.search(r"#define IDX_TILES (\d+)\n", src)
    assert smem and int(smem.group(1)) == SCORES_MMA2_SMEM == 64 * 128 * 2 + 2 * 64 * 4
    assert tiles and 8 * int(tiles.group(1)) == SCORES_MMA_ROUND
    assert indexer_scores_smem_mma(1) == 0
    assert indexer_scores_smem_mma(2) == SCORES_MMA2_SMEM
    for bad in (0, 3):
        with pytest.raises(ValueError, match="1 or 2"):
            indexer_scores_smem_mma(bad)


class _LaunchRecorder(HostBackend):
    """Records each launch (kernel, grid, block, the mma argument, smem) instead of running it."""

    def __init__(self):
        super().__init__()
        self.launches = []

    def launch(self, kernel, grid, block, args, smem=0, stream=None):
        self.launches.append((kernel.decl.function, tuple(grid), tuple(block), args[-1], smem))


@pytest.mark.parametrize(
    "heads,dim,q_off,want",
    [
        (1, 128, 0, ("indexer_scores_batch", 1)),
        (32, 128, 0, ("indexer_scores_batch", 1)),
        (33, 128, 0, ("indexer_scores_batch_mma2", 2)),
        (48, 128, 4, ("indexer_scores_batch_mma2", 2)),
        (64, 128, 0, ("indexer_scores_batch_mma2", 2)),
        (65, 128, 0, ("indexer_scores_batch", 0)),
        (64, 64, 0, ("indexer_scores_batch", 0)),
        (64, 128, 2, ("indexer_scores_batch", 0)),  # q rows only 2-byte aligned
    ],
)
@pytest.mark.parametrize("m", [1, 64])
def test_the_launch_follows_the_path(heads, dim, q_off, want, m):
    """The helper's launch: the kernel, its mma argument, grid and dynamic shared memory follow
    scores_mma_groups from the shapes and buffers alone (the same at m = 1 and 64)."""
    gpu = _LaunchRecorder()
    z = gpu.alloc(1 << 16)
    slot_rows, kpool = 163_840, 1
    dsa_select.indexer_scores_batch(
        gpu, q=z.offset(q_off), q_stride=heads * dim, w=z, w_stride=heads, pool_keys=z, pool_scales=z,
        scores=z, entries=z, m=m, row_add=0, slot_rows=slot_rows, heads=heads, dim=dim, kpool=kpool,
        w_scale=1.0,
    )  # fmt: skip
    ((fn, grid, block, mma, smem),) = gpu.launches
    assert (fn, mma) == want
    assert block == (256, 1, 1)
    pps = slot_rows // kpool
    if mma == 2:
        assert (grid, smem) == ((*scores_mma2_grid(m, pps), 1), SCORES_MMA2_SMEM)
    elif mma == 1:
        assert (grid, smem) == ((*scores_mma_grid(m, pps), 1), 0)
    else:
        assert (grid, smem) == (
            (*dsa_select.scores_batch_grid(m, pps), 1),
            dsa_select.indexer_scores_smem(heads, dim),
        )


@pytest.mark.parametrize("heads", [33, 48, 64])
def test_indexer_twin_through_the_two_group_launch(heads):
    """33..64 heads of 128 launch indexer_scores_batch_mma2, whose twin is indexer_scores_batch's:
    every complete pool within the f32 bound of the float64 formula (8 (dim + heads) 2**-24 of the
    sum of |terms|), nothing past them, padding untouched, each entry alone the same bits."""
    sh = ScoreShape(slots=3, slot_rows=1500, heads=heads, dim=128, kpool=1)
    rng = np.random.default_rng(heads)
    m = 5
    world = score_world(rng, sh, m)
    lay = read_layout(rng, sh.slots, sh.slot_rows, m, 1, 0, sh.slot_rows - 1)
    assert lay.live
    got = check_scores(HostBackend(), world, sh, lay, 1)
    for e, slot, row in lay.live:
        npools = (row + 1) // sh.kpool
        ref, mag = scores_f64(world, sh, e, slot, row)
        bound = 8 * (sh.dim + sh.heads) * 2.0**-24 * mag + 1e-30
        assert (np.abs(got[e, :npools].astype(np.float64) - ref) <= bound).all()


# ---- the proposer past 16384 pools ------------------------------------------------------------


@pytest.mark.parametrize("share", [True, False], ids=["shared", "per-draft"])
def test_a_proposer_past_the_one_block_cap_selects_exactly(share):
    """A host proposer of 16434-pool slots (tiny config, kpool 2), its context fed fast to 16433
    complete pools: after propose(k = 3) the layer's list is the exact top-k of its own indexer
    scores (the chunked selection through the layer's workspace), then the drafted rows when
    drafts 2..k share draft 1's selection."""
    from proposer_fixtures import bf16_weights, make_proposer

    from bench.bench_propose import fill_context
    from model.dsa import selection_rows
    from runtime.dtypes import BF16

    reach = 2 * 16384 + 100
    cfg = tiny(max_context=reach, share_for_mtp_iteration=share)
    d = cfg.dsa
    prop = make_proposer(cfg, bf16_weights(cfg, 3), served=reach, max_draft_tokens=3, max_sequences=1)
    try:
        assert prop.pools.geometry.pools_per_slot > TOPK_SINGLE_BLOCK_POOLS
        st = prop.alloc_state()
        ctx = reach - 3
        fill_context(prop, st, ctx, np.random.default_rng(4))
        hid = np.random.default_rng(5).standard_normal(cfg.hidden_size).astype(np.float32).astype(BF16)
        hidden = prop.gpu.alloc(hid.nbytes)
        prop.gpu.copy_h2d(hidden, hid)
        drafts = prop.propose(st, 7, hidden, ctx, 3)
        assert len(drafts) == 3 and all(0 <= t < cfg.vocab_size for t in drafts)
        s, gpu = prop.scratch, prop.gpu
        pps = prop.pools.geometry.pools_per_slot
        sel_cap = selection_rows(d, prop.rows_cap, prop.layer.selection_extra)
        scores = np.empty(pps, np.float32)
        gpu.copy_d2h(scores, s.iscores)
        cnt = np.empty(1, np.uint32)
        gpu.copy_d2h(cnt, s.count)
        sel = np.empty(sel_cap, np.uint32)
        gpu.copy_d2h(sel, s.selected)
        last = ctx if share else ctx + 2  # the row whose selection the list holds
        want = select_rows_ref(scores, last, d.topk_pools, d.index_kpool, d.always_select_tail)
        if share:
            want = np.concatenate([want, [ctx + 1, ctx + 2]]).astype(np.uint32)
        assert (last + 1) // d.index_kpool > TOPK_SINGLE_BLOCK_POOLS
        assert cnt[0] == want.size
        np.testing.assert_array_equal(sel[: want.size], want)
        ws = np.empty(select_workspace_bytes(1, prop.rows_cap, d.index_kpool) // 4, np.uint32)
        gpu.copy_d2h(ws, s.select_ws)
        assert ws[0] == 0, "the workspace counter must be left zero"
        assert not ws[8:SELECT_WS_HEAD_WORDS].any(), "the workspace histograms must be left zero"
        gpu.free(hidden)
        prop.free_state(st)
    finally:
        prop.close()
