"""KPool lightning-indexer scores, the top-k pool selection (with the tail, unless the config's
``index_kpool_always_select_tail`` is false), and the extension of a shared selection by the rows
drafted after it (``index_share_for_mtp_iteration``, ``model.dsa``, "Shared selection").

``TOPK_MAX_POOLS`` is the selection kernel's capacity in pools (``select_max_pools`` for a given
``topk_pools``); ``model.dsa.max_dsa_context`` derives the drafter's reach from it, so a kernel
change moves the sizing with it. Up to ``TOPK_SINGLE_BLOCK_POOLS`` complete pools one block ranks
a row; past that all the row's blocks run a radix select (three histogram phases, then the bitmaps
of the chosen pools, which the last block compacts: four launches, whatever the rows), through a
workspace the caller allocates zeroed (``select_workspace_bytes``). CUDA: ptx/dsa_select.cu.

Each kernel covers m batch entries (model/kernels/batch.py), each entry over its own slot's pools
with its own row, query and output rows; an entry's bits do not depend on the batch.
"""

from __future__ import annotations

import functools

import numpy as np

from runtime.dtypes import BF16, FP8
from runtime.kernel import F32, PTR, U32, declare
from runtime.launch import launch

from .batch import SlotGeometry, is_pad, read_entries

# The selection's capacity in pools (ptx/dsa_select.cu TOPK_MAX_POOLS_CUDA): 1,048,576 tokens at
# kpool 4, GLM-5.3-Flash's max_position_embeddings.
TOPK_MAX_POOLS = 262144
# Pools one block ranks alone (one u32 key each in its 64 KiB of shared memory, the kernel's
# capacity before it had chunks): a slot of at most this many pools needs no workspace.
TOPK_SINGLE_BLOCK_POOLS = 16384
# Past it a row is ranked by a radix select over all its blocks (ptx/dsa_select.cu
# select_radix_hist_batch, three phases, then select_topk_pools_batch): block c of an entry takes
# pools c * SELECT_CHUNK .. + SELECT_CHUNK - 1, eight keys per thread of SELECT_THREADS
# (ptx/dsa_select.cu SELECT_CHUNK, SELECT_THREADS; tests/test_dsa_reach.py reads them).
SELECT_CHUNK = 8192
SELECT_THREADS = 1024
# The largest topk_pools the chunked selection takes: the per-token indexers' 2048 (GLM-5.2,
# DeepSeek-V3.2, kpool 1), the largest it is tested at. The radix passes themselves would take any
# top-k; a larger one is ranked by one block, up to TOPK_SINGLE_BLOCK_POOLS pools.
SELECT_MAX_TOPK = 2048
# The chunked selection's workspace per entry (ptx/dsa_select.cu SEL_WS_MAPS): a counter and 3
# words of padding, the two thresholds the phases record (4 words), the histograms of the key bits
# 31..20 (4096 bins), 19..10 and 9..0 (1024 each); then two bitmaps over the slot's pools.
SELECT_WS_HEAD_WORDS = 4 + 4 + 4096 + 2 * 1024


def complete_pools(row: int, kpool: int) -> int:
    """Pools whose last row is <= row (the spec: pools 0 .. (row+1)//kpool - 1)."""
    return (row + 1) // kpool


def selection_capacity(rows: int, topk_pools: int, kpool: int, extra: int = 0) -> int:
    """Rows one selection can list: the top-k pools' rows and a tail of at most kpool - 1 rows,
    plus ``extra`` rows appended by ``extend_selection_batch`` (drafts after the first of a propose
    that shares draft 1's selection)."""
    return min(rows, topk_pools * kpool + kpool - 1 + extra)


def _score_pools(mem, q, w, pool_keys, pool_scales, scores, npools, heads, dim, w_scale):
    """One sequence's scores of its first ``npools`` pools."""
    if npools == 0:
        return
    qv = mem.read(q, BF16, (heads, dim)).astype(np.float32)
    wv = mem.read(w, BF16, heads).astype(np.float32) * np.float32(w_scale)
    keys = mem.read(pool_keys, FP8, (npools, dim)).astype(np.float32)
    keys *= mem.read(pool_scales, np.float32, npools)[:, None]
    dots = np.maximum(qv @ keys.T, 0)  # [heads, pools]: the shapes are one sequence's alone
    s = (wv @ dots) / np.float32(np.sqrt(dim))
    mem.write(scores, s.astype(np.float32))


def select_rows_ref(
    scores: np.ndarray, row: int, topk_pools: int, kpool: int, tail: bool = True
) -> np.ndarray:
    """Selected rows in ascending order (scores over the complete pools only). With ``tail`` the
    rows of the incomplete pool are always added; without it a row attends complete pools only
    (none at all before its first pool completes)."""
    npools = complete_pools(row, kpool)
    tail_rows = np.arange(npools * kpool, row + 1) if tail else np.zeros(0, np.int64)
    if npools <= topk_pools:
        return np.concatenate([np.arange(npools * kpool), tail_rows]).astype(np.uint32)
    # Higher score first, then lower pool index: a stable sort on -score keeps index order.
    order = np.argsort(-scores[:npools].astype(np.float64), kind="stable")[:topk_pools]
    pools = np.sort(order)
    rows = (pools[:, None] * kpool + np.arange(kpool)[None, :]).reshape(-1)
    return np.concatenate([rows, tail_rows]).astype(np.uint32)


def select_max_pools(topk_pools: int) -> int:
    """Complete pools the selection ranks for ``topk_pools``: TOPK_MAX_POOLS, or one block's
    TOPK_SINGLE_BLOCK_POOLS for a top-k past SELECT_MAX_TOPK."""
    return TOPK_MAX_POOLS if topk_pools <= SELECT_MAX_TOPK else TOPK_SINGLE_BLOCK_POOLS


def select_is_chunked(pools_per_slot: int) -> bool:
    """Whether a slot of ``pools_per_slot`` pools can need the chunked selection (and its
    workspace)."""
    return pools_per_slot > TOPK_SINGLE_BLOCK_POOLS


def select_map_words(pools_per_slot: int) -> int:
    """u32 words of one of the chunked selection's bitmaps (a bit per pool), a multiple of 4
    (ptx/dsa_select.cu select_map_words)."""
    return (-(-pools_per_slot // 32) + 3) & ~3


def select_workspace_words(pools_per_slot: int) -> int:
    """u32 words of one entry's workspace (ptx/dsa_select.cu select_ws_words): the counter, the
    thresholds and the three histograms (SELECT_WS_HEAD_WORDS), then the bitmaps of the pools above
    the threshold and of those equal to it; 0 where one block ranks every row. The top-k does not
    change it."""
    if not select_is_chunked(pools_per_slot):
        return 0
    return SELECT_WS_HEAD_WORDS + 2 * select_map_words(pools_per_slot)


def select_workspace_bytes(rows: int, slot_rows: int, kpool: int) -> int:
    """Bytes of the selection workspace for launches of up to ``rows`` entries over slots of
    ``slot_rows`` rows (dense per entry, 16-byte aligned where the buffer is). Allocate it zeroed:
    the kernels' per-entry counter and histograms must start at 0, and every launch leaves them 0
    again (graph-capturable: no host sync, no reset)."""
    pps = SlotGeometry(slot_rows, 1, kpool, 1).pools_per_slot
    return rows * select_workspace_words(pps) * 4


def select_smem(pools_per_slot: int) -> int:
    """Dynamic shared memory of select_topk_pools_batch: one u32 key per pool one block ranks, and
    where rows can be chunked, the two bitmaps of a row (what the last block stages)."""
    words = min(pools_per_slot, TOPK_SINGLE_BLOCK_POOLS)
    if select_is_chunked(pools_per_slot):
        words = max(words, 2 * select_map_words(pools_per_slot))
    return words * 4


def select_grid(m: int, pools_per_slot: int) -> tuple[int, int]:
    """The selection kernels' grid: (blocks per entry, m); one block per SELECT_CHUNK pools of the
    slot where a row can need the chunked selection. Blocks past a row's pools exit at once; the
    grid never changes a list (a selection is a unique set)."""
    if not select_is_chunked(pools_per_slot):
        return 1, m
    return -(-pools_per_slot // SELECT_CHUNK), m


def _select(mem, scores, selected, count, row, topk_pools, kpool, tail, sel_cap):
    """One sequence's selection. A row past the kernel's TOPK_MAX_POOLS or a selection of more than
    ``sel_cap`` rows is the kernel's visible failure, count 0."""
    npools = complete_pools(row, kpool)
    if npools > TOPK_MAX_POOLS:
        mem.write(count, np.array([0], np.uint32))
        return
    sc = mem.read(scores, np.float32, npools) if npools > topk_pools else np.zeros(0, np.float32)
    rows = select_rows_ref(sc, row, topk_pools, kpool, bool(tail))
    if rows.size > sel_cap:
        mem.write(count, np.array([0], np.uint32))
        return
    if rows.size:
        mem.write(selected, rows)
    mem.write(count, np.array([rows.size], np.uint32))


# ---- the batched kernels: m entries [slot, row, token, reserved] of the slot pools (batch.py) ----


def _entry_rows(mem, entries, m, row_add):
    """(e, slot, row) of every entry that is not padding, in entry order."""
    return [
        (e, int(ent[0]), (int(ent[1]) + row_add) & 0xFFFFFFFF)  # the kernel's u32 sum
        for e, ent in enumerate(read_entries(mem, entries, m))
        if not is_pad(ent)
    ]


_INDEXER_SCORES_ARGS = [
    ("q", PTR),
    ("q_stride", U32),
    ("w", PTR),
    ("w_stride", U32),
    ("pool_keys", PTR),
    ("pool_scales", PTR),
    ("scores", PTR),
    ("entries", PTR),
    ("m", U32),
    ("row_add", U32),
    ("slot_rows", U32),
    ("heads", U32),
    ("dim", U32),
    ("kpool", U32),
    ("w_scale", F32),
    ("mma", U32),
]


def _indexer_scores_twin(
    mem,
    q,
    q_stride,
    w,
    w_stride,
    pool_keys,
    pool_scales,
    scores,
    entries,
    m,
    row_add,
    slot_rows,
    heads,
    dim,
    kpool,
    w_scale,
    mma,
):
    """The scores of each entry's slot's complete pools, into scores + e * pools_per_slot (every
    path of the kernels: one formula, f32 rounding apart)."""
    geo = SlotGeometry(slot_rows, dim, kpool, 1)
    pps = geo.pools_per_slot
    for e, slot, row in _entry_rows(mem, entries, m, row_add):
        if row >= slot_rows:
            continue
        _score_pools(
            mem,
            q.offset(e * q_stride * 2),
            w.offset(e * w_stride * 2),
            pool_keys.offset(geo.pool_row(slot, 0) * dim),
            pool_scales.offset(geo.pool_row(slot, 0) * 4),
            scores.offset(e * pps * 4),
            complete_pools(row, kpool),
            heads,
            dim,
            w_scale,
        )


# Both release right after their wait: the selection launches during their tail.
INDEXER_SCORES_BATCH = declare(
    "dsa_select", "indexer_scores_batch", _INDEXER_SCORES_ARGS, writes=("scores",), pdl=True, releases=True
)(_indexer_scores_twin)
# 33..64 heads of 128 on the tensor cores (ptx/dsa_select.cu score_pools_mma2): its own entry, so
# that indexer_scores_batch's code for 32 heads and fewer stays what it was to the instruction.
INDEXER_SCORES_BATCH_MMA2 = declare(
    "dsa_select",
    "indexer_scores_batch_mma2",
    _INDEXER_SCORES_ARGS,
    writes=("scores",),
    pdl=True,
    releases=True,
)(_indexer_scores_twin)


_SELECT_ROW_ARGS = [
    ("entries", PTR),
    ("m", U32),
    ("row_add", U32),
    ("slot_rows", U32),
    ("sel_cap", U32),
    ("topk_pools", U32),
    ("kpool", U32),
    ("tail", U32),
    ("workspace", PTR),
]


@declare(
    "dsa_select",
    "select_radix_hist_batch",
    [("scores", PTR), *_SELECT_ROW_ARGS, ("phase", U32)],
    writes=("workspace",),
    pdl=True,
    releases=True,  # right after its wait: the next phase's blocks are resident when it completes
)
def SELECT_RADIX_HIST_BATCH(
    mem, scores, entries, m, row_add, slot_rows, sel_cap, topk_pools, kpool, tail, workspace, phase
):
    """A histogram phase of the chunked selection: its counts live in the workspace, the kernel's
    scratch, which select_topk_pools_batch's twin does not need (it ranks the scores itself), so
    the twin writes nothing."""


@declare(
    "dsa_select",
    "select_topk_pools_batch",
    [("scores", PTR), ("selected", PTR), ("count", PTR), *_SELECT_ROW_ARGS],
    writes=("selected", "count", "workspace"),
    pdl=True,
    releases=True,  # right after its wait: the q_abs GEMV runs beside it
)
def SELECT_TOPK_POOLS_BATCH(
    mem,
    scores,
    selected,
    count,
    entries,
    m,
    row_add,
    slot_rows,
    sel_cap,
    topk_pools,
    kpool,
    tail,
    workspace,
):
    """The top-k pools' rows of each entry: scores + e * pools_per_slot -> selected + e * sel_cap,
    count[e]. The workspace is the kernels' scratch (the twin leaves it, as the kernels leave its
    counter and histograms, zero)."""
    pps = SlotGeometry(slot_rows, 1, kpool, 1).pools_per_slot
    for e, _, row in _entry_rows(mem, entries, m, row_add):
        cnt = count.offset(e * 4)
        if row >= slot_rows:
            mem.write(cnt, np.array([0], np.uint32))
            continue
        _select(
            mem,
            scores.offset(e * pps * 4),
            selected.offset(e * sel_cap * 4),
            cnt,
            row,
            topk_pools,
            kpool,
            tail,
            sel_cap,
        )


@declare(
    "dsa_select",
    "extend_selection_batch",
    [("selected", PTR), ("count", PTR), ("entries", PTR), ("m", U32), ("row_add", U32), ("sel_cap", U32)],
    writes=("selected", "count"),
    pdl=True,
    releases=True,  # in select_topk_pools_batch's place
)
def EXTEND_SELECTION_BATCH(mem, selected, count, entries, m, row_add, sel_cap):
    """Each entry's row appended to selected + e * sel_cap, count[e] + 1; a
    full list (count == sel_cap) is left as it is."""
    for e, _, row in _entry_rows(mem, entries, m, row_add):
        n = int(mem.scalar(count.offset(e * 4), np.uint32))
        if n >= sel_cap:
            continue
        mem.write(selected.offset((e * sel_cap + n) * 4), np.array([row], np.uint32))
        mem.write(count.offset(e * 4), np.array([n + 1], np.uint32))


# indexer_scores_batch: a warp per pool, 8 per block, grid-stride. An entry's grid is capped at two blocks per SM
# of an H200 (132 SMs): past that each block stages q (heads x dim f32) for fewer than one pool per
# warp. Blocks beyond the row's pools exit at once.
SCORES_MAX_GRID = 264


def indexer_scores_smem(heads: int, dim: int) -> int:
    """ptx/dsa_select.cu: q [heads][dim + 4] f32, w [heads] (padded to 4), 8 key rows [dim] f32."""
    return 4 * (heads * (dim + 4) + heads + (-heads % 4) + 8 * dim)


# Grid dims y and z of a launch (the batched kernels put the entry there).
MAX_GRID_YZ = 65535


def _check_m(what: str, m: int, hi: int = MAX_GRID_YZ) -> None:
    if not 1 <= m <= hi:
        raise ValueError(f"{what}: m={m} entries outside 1..{hi}")


# indexer_scores_batch: blocks of a launch, about eight resident per SM of an H200 (256 threads and
# 21 KB of shared memory each): past one entry, the launch's pools are many, and a warp's rounds
# wait on its pool key's load, so more warps in flight hide more of it. Not measured yet.
SCORES_BATCH_BLOCKS = 4 * SCORES_MAX_GRID


def scores_batch_grid(m: int, pools_per_slot: int) -> tuple[int, int]:
    """indexer_scores_batch's grid: (blocks per entry, m). An entry gets SCORES_BATCH_BLOCKS / m
    blocks, at least one and at most SCORES_MAX_GRID or one per 8 pools a slot can have (what
    m = 1 gets); at m = 64 an entry's 17 blocks take its
    pools grid-stride instead of 264 blocks that would mostly exit. A pool's score is one warp's
    in every grid, so the choice moves work, never bits."""
    per = max(-(-SCORES_BATCH_BLOCKS // m), 1)
    return min(per, SCORES_MAX_GRID, max(-(-pools_per_slot // 8), 1)), m


# The tensor-core paths (ptx/dsa_select.cu), dim 128: up to 32 heads indexer_scores_batch's
# score_pools_mma (one group of 32 heads, q's A fragments in registers), 33..64 heads
# indexer_scores_batch_mma2's score_pools_mma2 (two groups over the same key fragments, q's
# fragments staged once per block in SCORES_MMA2_SMEM bytes of shared memory). A warp takes rounds
# of SCORES_MMA_ROUND pools (4 tiles of 8). Their ~220 registers hold one 256-thread block per SM,
# so an entry's grid is at most one H200 wave (132 blocks).
SCORES_MMA_DIM = 128
SCORES_MMA_GROUP_HEADS = 32
SCORES_MMA_MAX_HEADS = 2 * SCORES_MMA_GROUP_HEADS
SCORES_MMA2_SMEM = 16896  # ptx/dsa_select.cu IDX_MMA2_SMEM: 16 KB of f16 q, 2^-s_h and w_h [64]
SCORES_MMA_ROUND = 32
SCORES_MMA_MAX_GRID = 132


def scores_mma_groups(heads: int, dim: int, q, q_stride: int, pool_keys) -> int:
    """The 32-head groups indexer_scores_batch runs on the tensor cores: 1 (up to 32 heads), 2 (33
    to 64: indexer_scores_batch_mma2), or 0 (the warp-per-pool path: another dim, more heads, or
    q rows not 4-byte / pool keys not 16-byte aligned). A function of the layer's shapes and
    buffers only, never of m or the rows, so every launch of a layer takes one path."""
    if not (
        dim == SCORES_MMA_DIM
        and 1 <= heads <= SCORES_MMA_MAX_HEADS
        and q_stride % 2 == 0
        and int(q) % 4 == 0
        and int(pool_keys) % 16 == 0
    ):
        return 0
    return -(-heads // SCORES_MMA_GROUP_HEADS)


def scores_use_mma(heads: int, dim: int, q, q_stride: int, pool_keys) -> bool:
    """Whether indexer_scores_batch runs on the tensor cores (``scores_mma_groups`` > 0): dim 128,
    at most 64 heads, q rows of 4 bytes, pool keys of 16."""
    return scores_mma_groups(heads, dim, q, q_stride, pool_keys) > 0


def indexer_scores_smem_mma(groups: int) -> int:
    """Dynamic shared memory of the tensor-core path of ``groups`` 32-head groups: none for one (q
    in registers), SCORES_MMA2_SMEM for two."""
    if groups not in (1, 2):
        raise ValueError(
            f"indexer_scores_smem_mma: {groups} groups of 32 heads, the tensor cores take 1 or 2"
        )
    return 0 if groups == 1 else SCORES_MMA2_SMEM


def _wave_grid(m: int, pools_per_slot: int, staging_rounds: float) -> tuple[int, int]:
    """(blocks per entry, m) for a tensor-core scores kernel: one block runs per SM (its
    registers), so a launch takes about its waves of SCORES_MMA_MAX_GRID blocks times the rounds of
    a block's busiest warp, plus what a block spends before its first round (``staging_rounds``):
    cost(per) = ceil(m per / 132) (ceil(rounds / (8 per)) + staging), per in 1 .. min(132, one per
    8 rounds). The fewest blocks within 3% of the least cost: past that, more blocks only add
    partial waves (or stage q more often). The choice moves work, never bits (a pool's score is
    one warp's fixed arithmetic)."""
    rounds = -(-pools_per_slot // SCORES_MMA_ROUND)
    block_rounds = max(-(-rounds // 8), 1)
    pers = range(1, min(SCORES_MMA_MAX_GRID, block_rounds) + 1)
    cost = [-(-(m * per) // SCORES_MMA_MAX_GRID) * (-(-block_rounds // per) + staging_rounds) for per in pers]
    least = min(cost)
    return next(per for per, c in zip(pers, cost) if c * 100 <= least * 103), m


@functools.lru_cache(maxsize=512)
def scores_mma_grid(m: int, pools_per_slot: int) -> tuple[int, int]:
    """indexer_scores_batch's tensor-core grid at up to 32 heads (q's fragments loaded to registers
    and scaled: about half a round a block). At m = 64 and 262,144 pools, 2 blocks an entry (128:
    one wave) where the earlier rule's 5 (320: three waves, the last 42% full) cost a fifth more."""
    return _wave_grid(m, pools_per_slot, 0.5)


@functools.lru_cache(maxsize=512)
def scores_mma2_grid(m: int, pools_per_slot: int) -> tuple[int, int]:
    """indexer_scores_batch_mma2's grid: as ``scores_mma_grid``, with about one round a block for
    staging q in shared memory. At m = 64 and 163,840 pools that is 2 blocks an entry (128, one
    wave)."""
    return _wave_grid(m, pools_per_slot, 1)


def indexer_score_bytes(npools: int, dim: int) -> int:
    """Bytes the indexer reads for one row of ``npools`` complete pools (FP8 keys and f32 scales)
    and writes (f32 scores): its HBM floor is this over the copy bandwidth."""
    return npools * (dim + 4 + 4)


def indexer_scores_batch(
    gpu,
    *,
    q,
    q_stride,
    w,
    w_stride,
    pool_keys,
    pool_scales,
    scores,
    entries,
    m,
    row_add,
    slot_rows,
    heads,
    dim,
    kpool,
    w_scale,
    stream=None,
):
    """The indexer scores of ``m`` batch entries (model/kernels/batch.py).

    Entry e ``[slot, row, ...]`` scores its slot's complete pools below row ``row + row_add``
    (pools ``0 .. (row + row_add + 1) // kpool - 1`` of the slot's pool keys / scales, a slot
    holding ``pools_per_slot = max(slot_rows // kpool, 1)``) with its query ``q + e * q_stride * 2``
    (BF16 ``[heads][dim]``) and head weights ``w + e * w_stride * 2`` (BF16 ``[heads]``), into
    ``scores + e * pools_per_slot * 4`` (f32): score = w_scale * sum over heads of w[h] *
    relu(q[h] . pool key) / sqrt(dim) (FP8 keys times their scale). Each score's bits do not depend
    on m or the entry's place. At dim 128 and up to 64 heads (GLM-5.3-Flash's 32, DeepSeek-V3.2's
    64) the dots run on the tensor cores (``scores_mma_groups``: one group of 32 heads, or two
    through ``indexer_scores_batch_mma2``), streaming the keys at any length.
    Padding entries and rows at or past ``slot_rows`` read and write nothing; scores past an
    entry's complete pools are not written."""
    _check_m("indexer_scores_batch", m)
    pps = SlotGeometry(slot_rows, dim, kpool, 1).pools_per_slot
    groups = scores_mma_groups(heads, dim, q, q_stride, pool_keys)
    if groups == 2:
        kernel, grid, smem = INDEXER_SCORES_BATCH_MMA2, scores_mma2_grid(m, pps), indexer_scores_smem_mma(2)
    elif groups == 1:
        kernel, grid, smem = INDEXER_SCORES_BATCH, scores_mma_grid(m, pps), indexer_scores_smem_mma(1)
    else:
        kernel, grid, smem = INDEXER_SCORES_BATCH, scores_batch_grid(m, pps), indexer_scores_smem(heads, dim)
    launch(
        gpu,
        gpu.kernel(*kernel.key),
        grid,
        256,
        q,
        q_stride,
        w,
        w_stride,
        pool_keys,
        pool_scales,
        scores,
        entries,
        m,
        row_add,
        slot_rows,
        heads,
        dim,
        kpool,
        w_scale,
        groups,
        smem=smem,
        stream=stream,
    )


def select_topk_pools_batch(
    gpu,
    *,
    scores,
    selected,
    count,
    entries,
    m,
    row_add,
    slot_rows,
    sel_cap,
    topk_pools,
    kpool,
    tail,
    workspace=None,
    stream=None,
):
    """The top-k pool selection (with the tail) for ``m`` entries: entry e's row ``row + row_add``,
    its scores at ``scores + e * pools_per_slot * 4``, its ascending rows into
    ``selected + e * sel_cap * 4`` and their number into ``count[e]`` (u32), the same whatever the
    batch (a selection is a unique set: higher score first, then lower pool index). A selection
    longer than ``sel_cap`` (size it with ``selection_capacity(slot_rows, topk_pools, kpool,
    extra)``) or a row at or past ``slot_rows`` gives count 0. Padding entries read and write
    nothing.

    ``workspace``: ``select_workspace_bytes(rows, slot_rows, kpool)`` bytes for up to ``rows`` >= m
    entries, 16-byte aligned and allocated zeroed once (the launches leave it zero), needed where a
    slot holds more than TOPK_SINGLE_BLOCK_POOLS pools; elsewhere it may be None.

    Where a slot can hold more, this is four launches (select_radix_hist_batch phases 0, 1, 2, then
    select_topk_pools_batch; ptx/dsa_select.cu says why), the same four for every launch of those
    shapes, whatever the rows: a captured graph replays them all."""
    _check_m("select_topk_pools_batch", m)
    pps = SlotGeometry(slot_rows, 1, kpool, 1).pools_per_slot
    if pps > TOPK_MAX_POOLS:
        raise ValueError(
            f"select_topk_pools_batch: slots of {slot_rows} rows hold {pps} pools of {kpool}, past the "
            f"selection's capacity of {TOPK_MAX_POOLS} pools"
        )
    chunked = select_is_chunked(pps)
    if chunked and topk_pools > SELECT_MAX_TOPK:
        raise ValueError(
            f"select_topk_pools_batch: topk_pools={topk_pools} over slots of {pps} pools: the chunked "
            f"selection ranks at most {SELECT_MAX_TOPK} pools, one block at most "
            f"{TOPK_SINGLE_BLOCK_POOLS} pools (select_max_pools)"
        )
    if chunked and workspace is None:
        raise ValueError(
            f"select_topk_pools_batch: slots of {pps} pools (more than {TOPK_SINGLE_BLOCK_POOLS}) need a "
            "workspace of select_workspace_bytes(rows, slot_rows, kpool) bytes, allocated zeroed"
        )
    if chunked and int(workspace) % 16:
        # The histograms and bitmaps are read as 16-byte vectors (select_workspace_words keeps each
        # entry's part a multiple of 16 bytes).
        raise ValueError(
            f"select_topk_pools_batch: the workspace at {int(workspace):#x} is not 16-byte aligned"
        )
    grid = select_grid(m, pps)
    ws = count if workspace is None else workspace  # never read where no row can need chunks
    row_args = (entries, m, row_add, slot_rows, sel_cap, topk_pools, kpool, int(bool(tail)), ws)
    if chunked:
        hist = gpu.kernel(*SELECT_RADIX_HIST_BATCH.key)
        for phase in range(3):
            launch(gpu, hist, grid, SELECT_THREADS, scores, *row_args, phase, stream=stream)
    launch(
        gpu,
        gpu.kernel(*SELECT_TOPK_POOLS_BATCH.key),
        grid,
        SELECT_THREADS,
        scores,
        selected,
        count,
        *row_args,
        smem=select_smem(pps),
        stream=stream,
    )


def extend_selection_batch(gpu, *, selected, count, entries, m, row_add, sel_cap, stream=None):
    """The shared selection's extension for ``m`` entries: entry e appends row ``row + row_add`` to its list
    ``selected + e * sel_cap * 4`` and increments ``count[e]`` (a full list is left as it is).
    Padding entries read and write nothing."""
    _check_m("extend_selection_batch", m, 2**31 - 1)
    launch(
        gpu,
        gpu.kernel(*EXTEND_SELECTION_BATCH.key),
        -(-m // 256),
        256,
        selected,
        count,
        entries,
        m,
        row_add,
        sel_cap,
        stream=stream,
    )
