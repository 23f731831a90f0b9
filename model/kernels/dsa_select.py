"""KPool lightning-indexer scores and the top-k pool selection with the tail.

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


def selection_capacity(rows: int, topk_pools: int, kpool: int) -> int:
    return min(rows, topk_pools * kpool + kpool - 1)


@declare(
    "dsa_select",
    "indexer_scores",
    [
        ("q", PTR), ("w", PTR), ("pool_keys", PTR), ("pool_scales", PTR), ("scores", PTR),
        ("row_ptr", PTR), ("row_add", U32), ("heads", U32), ("dim", U32), ("kpool", U32),
        ("w_scale", F32),
    ],
    writes=("scores",),
    pdl=True,
    releases=True,  # right after its wait: its successor's blocks launch during its tail (ptx/common.cuh)
)
def INDEXER_SCORES(mem, q, w, pool_keys, pool_scales, scores, row_ptr, row_add, heads, dim, kpool,
                   w_scale):
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


def select_rows_ref(scores: np.ndarray, row: int, topk_pools: int, kpool: int) -> np.ndarray:
    """Selected rows in ascending order (scores over the complete pools only)."""
    npools = complete_pools(row, kpool)
    if npools <= topk_pools:
        return np.arange(row + 1, dtype=np.uint32)
    # Higher score first, then lower pool index: a stable sort on -score keeps index order.
    order = np.argsort(-scores[:npools].astype(np.float64), kind="stable")[:topk_pools]
    pools = np.sort(order)
    rows = (pools[:, None] * kpool + np.arange(kpool)[None, :]).reshape(-1)
    tail = np.arange(npools * kpool, row + 1)
    return np.concatenate([rows, tail]).astype(np.uint32)


@declare(
    "dsa_select",
    "select_topk_pools",
    [
        ("scores", PTR), ("selected", PTR), ("count", PTR), ("row_ptr", PTR), ("row_add", U32),
        ("topk_pools", U32), ("kpool", U32),
    ],
    writes=("selected", "count"),
    pdl=True,
    releases=True,  # the q_abs GEMV (bgemv_bf16_f32_beside) runs beside it
)
def SELECT_TOPK_POOLS(mem, scores, selected, count, row_ptr, row_add, topk_pools, kpool):
    row = int(mem.scalar(row_ptr, np.uint32)) + row_add
    npools = complete_pools(row, kpool)
    sc = mem.read(scores, np.float32, npools) if npools > topk_pools else np.zeros(0, np.float32)
    rows = select_rows_ref(sc, row, topk_pools, kpool)
    mem.write(selected, rows)
    mem.write(count, np.array([rows.size], np.uint32))


# indexer_scores: a warp per pool, 8 per block, grid-stride. The grid is capped at two blocks per SM
# of an H200 (132 SMs): past that each block stages q (heads x dim f32) for fewer than one pool per
# warp. Blocks beyond the row's pools exit at once.
SCORES_MAX_GRID = 264


def indexer_scores_smem(heads: int, dim: int) -> int:
    """ptx/dsa_select.cu: q [heads][dim + 4] f32, w [heads] (padded to 4), 8 key rows [dim] f32."""
    return 4 * (heads * (dim + 4) + heads + (-heads % 4) + 8 * dim)


def indexer_scores(gpu, q, w, pool_keys, pool_scales, scores, row_ptr, row_add, heads, dim, kpool,
                   w_scale, max_pools, stream=None):
    grid = min(max(-(-max_pools // 8), 1), SCORES_MAX_GRID)
    launch(gpu, gpu.kernel(*INDEXER_SCORES.key), grid, 256, q, w, pool_keys, pool_scales, scores,
           row_ptr, row_add, heads, dim, kpool, w_scale, smem=indexer_scores_smem(heads, dim),
           stream=stream)


def select_topk_pools(gpu, scores, selected, count, row_ptr, row_add, topk_pools, kpool,
                      stream=None):
    launch(gpu, gpu.kernel(*SELECT_TOPK_POOLS.key), 1, 1024, scores, selected, count, row_ptr,
           row_add, topk_pools, kpool, smem=TOPK_MAX_POOLS * 4, stream=stream)
