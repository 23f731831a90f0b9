"""KPool lightning-indexer scores, the top-k pool selection (with the tail, unless the config's
``index_kpool_always_select_tail`` is false), and the extension of a shared selection by the rows
drafted after it (``index_share_for_mtp_iteration``, ``model.dsa``, "Shared selection").

``TOPK_MAX_POOLS`` is the selection kernel's capacity (its per-block shared-memory budget holds one
f32 score per pool); ``model.dsa.max_dsa_context`` derives the drafter's reach from it, so a kernel
change moves the sizing with it. CUDA: ptx/dsa_select.cu.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16, FP8
from runtime.kernel import F32, PTR, U32, declare
from runtime.launch import launch

# 16384 pools x 4 B of f32 score = 64 KiB of dynamic shared memory in ptx/dsa_select.cu.
TOPK_MAX_POOLS = 16384


def complete_pools(row: int, kpool: int) -> int:
    """Pools whose last row is <= row (the spec: pools 0 .. (row+1)//kpool - 1)."""
    return (row + 1) // kpool


def selection_capacity(rows: int, topk_pools: int, kpool: int, extra: int = 0) -> int:
    """Rows one selection can list: the top-k pools' rows and a tail of at most kpool - 1 rows,
    plus ``extra`` rows appended by ``extend_selection`` (drafts after the first of a propose
    that shares draft 1's selection)."""
    return min(rows, topk_pools * kpool + kpool - 1 + extra)


@declare(
    "dsa_select",
    "indexer_scores",
    [
        ("q", PTR),
        ("w", PTR),
        ("pool_keys", PTR),
        ("pool_scales", PTR),
        ("scores", PTR),
        ("row_ptr", PTR),
        ("row_add", U32),
        ("heads", U32),
        ("dim", U32),
        ("kpool", U32),
        ("w_scale", F32),
    ],
    writes=("scores",),
    pdl=True,
    releases=True,  # right after its wait: its successor's blocks launch during its tail (ptx/common.cuh)
)
def INDEXER_SCORES(mem, q, w, pool_keys, pool_scales, scores, row_ptr, row_add, heads, dim, kpool, w_scale):
    """scores[p] = sum_h (w_h * w_scale) * relu(q_h . key_p) / sqrt(dim) for every complete pool."""
    row = int(mem.scalar(row_ptr, np.uint32)) + row_add
    npools = complete_pools(row, kpool)
    if npools == 0:
        return
    qv = mem.read(q, BF16, (heads, dim)).astype(np.float32)
    wv = mem.read(w, BF16, heads).astype(np.float32) * np.float32(w_scale)
    keys = mem.read(pool_keys, FP8, (npools, dim)).astype(np.float32)
    keys *= mem.read(pool_scales, np.float32, npools)[:, None]
    dots = np.maximum(qv @ keys.T, 0)  # [heads, pools]
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


@declare(
    "dsa_select",
    "select_topk_pools",
    [
        ("scores", PTR),
        ("selected", PTR),
        ("count", PTR),
        ("row_ptr", PTR),
        ("row_add", U32),
        ("topk_pools", U32),
        ("kpool", U32),
        ("tail", U32),
    ],
    writes=("selected", "count"),
    pdl=True,
    releases=True,  # the q_abs GEMV (bgemv_bf16_f32_beside) runs beside it
)
def SELECT_TOPK_POOLS(mem, scores, selected, count, row_ptr, row_add, topk_pools, kpool, tail):
    row = int(mem.scalar(row_ptr, np.uint32)) + row_add
    npools = complete_pools(row, kpool)
    sc = mem.read(scores, np.float32, npools) if npools > topk_pools else np.zeros(0, np.float32)
    rows = select_rows_ref(sc, row, topk_pools, kpool, bool(tail))
    if rows.size:
        mem.write(selected, rows)
    mem.write(count, np.array([rows.size], np.uint32))


@declare(
    "dsa_select",
    "extend_selection",
    [("selected", PTR), ("count", PTR), ("row_ptr", PTR), ("row_add", U32)],
    writes=("selected", "count"),
    pdl=True,
    releases=True,  # in select_topk_pools' place: the q_abs GEMV runs beside it
)
def EXTEND_SELECTION(mem, selected, count, row_ptr, row_add):
    """Append row ``*row_ptr + row_add`` to the selection: a draft after the first of a propose
    that reuses draft 1's pools still attends itself and the rows drafted since (they follow draft
    1's tail, so the list stays ascending)."""
    n = int(mem.scalar(count, np.uint32))
    mem.write(selected.offset(n * 4), np.array([int(mem.scalar(row_ptr, np.uint32)) + row_add], np.uint32))
    mem.write(count, np.array([n + 1], np.uint32))


# indexer_scores: a warp per pool, 8 per block, grid-stride. The grid is capped at two blocks per SM
# of an H200 (132 SMs): past that each block stages q (heads x dim f32) for fewer than one pool per
# warp. Blocks beyond the row's pools exit at once.
SCORES_MAX_GRID = 264


def indexer_scores_smem(heads: int, dim: int) -> int:
    """ptx/dsa_select.cu: q [heads][dim + 4] f32, w [heads] (padded to 4), 8 key rows [dim] f32."""
    return 4 * (heads * (dim + 4) + heads + (-heads % 4) + 8 * dim)


def indexer_scores(
    gpu,
    q,
    w,
    pool_keys,
    pool_scales,
    scores,
    row_ptr,
    row_add,
    heads,
    dim,
    kpool,
    w_scale,
    max_pools,
    stream=None,
):
    grid = min(max(-(-max_pools // 8), 1), SCORES_MAX_GRID)
    launch(
        gpu,
        gpu.kernel(*INDEXER_SCORES.key),
        grid,
        256,
        q,
        w,
        pool_keys,
        pool_scales,
        scores,
        row_ptr,
        row_add,
        heads,
        dim,
        kpool,
        w_scale,
        smem=indexer_scores_smem(heads, dim),
        stream=stream,
    )


def select_topk_pools(
    gpu, scores, selected, count, row_ptr, row_add, topk_pools, kpool, tail=True, stream=None
):
    launch(
        gpu,
        gpu.kernel(*SELECT_TOPK_POOLS.key),
        1,
        1024,
        scores,
        selected,
        count,
        row_ptr,
        row_add,
        topk_pools,
        kpool,
        int(bool(tail)),
        smem=TOPK_MAX_POOLS * 4,
        stream=stream,
    )


def extend_selection(gpu, selected, count, row_ptr, row_add, stream=None):
    launch(gpu, gpu.kernel(*EXTEND_SELECTION.key), 1, 32, selected, count, row_ptr, row_add, stream=stream)
