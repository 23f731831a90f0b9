"""Writes of the DSA caches for rows ``row = *row_ptr + row_add + r``, r < rows.

- the MLA latent ``c = rmsnorm(kv) * kv_a_layernorm`` as an FP8 E4M3 row with one f32 scale, into
  the paged cache at the row's slot through the block table;
- the indexer's per-token key ``k = LayerNorm(wk y)`` and gate ``g = compress_gate y`` (BF16);
- the compressed key of every pool the rows complete: a per-dimension softmax over the pool's
  slots of ``g + ape`` weighting the slots' ``k``, stored FP8 with a scale.

Rows are read from a fused projection output with row stride ``stride`` (elements).
CUDA: ptx/dsa_cache.cu (grid = rows, block 128). ``dsa_cache_write`` does all three for the same
rows in one launch (the block path's only cache write).
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16, FP8, quantize_rows_fp8
from runtime.kernel import F32, PTR, U32, declare
from runtime.kernels.rmsnorm import rmsnorm_ref
from runtime.launch import launch


def layernorm_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    xf = np.asarray(x, np.float32)
    mu = xf.mean(-1, keepdims=True, dtype=np.float32)
    var = ((xf - mu) ** 2).mean(-1, keepdims=True, dtype=np.float32)
    return (xf - mu) / np.sqrt(var + np.float32(eps)) * np.asarray(w, np.float32) + np.asarray(b, np.float32)


def compress_pool_ref(k: np.ndarray, g: np.ndarray, ape: np.ndarray) -> np.ndarray:
    """k, g: [kpool, d]; ape [kpool, d] -> pool key [d] (f32)."""
    logits = np.asarray(g, np.float32) + np.asarray(ape, np.float32)
    logits = logits - logits.max(0, keepdims=True)
    e = np.exp(logits)
    p = e / e.sum(0, keepdims=True)
    return (p * np.asarray(k, np.float32)).sum(0, dtype=np.float32)


def _rows(mem, row_ptr, row_add, rows):
    base = int(mem.scalar(row_ptr, np.uint32)) + row_add
    return range(base, base + rows)


@declare(
    "dsa_cache",
    "latent_write_fp8",
    [
        ("kv", PTR),
        ("stride", U32),
        ("norm_w", PTR),
        ("cache", PTR),
        ("scales", PTR),
        ("block_table", PTR),
        ("row_ptr", PTR),
        ("row_add", U32),
        ("rows", U32),
        ("dim", U32),
        ("block_size", U32),
        ("eps", F32),
    ],
    writes=("cache", "scales"),
)
def LATENT_WRITE_FP8(
    mem, kv, stride, norm_w, cache, scales, block_table, row_ptr, row_add, rows, dim, block_size, eps
):
    w = mem.read(norm_w, BF16, dim)
    for r, row in enumerate(_rows(mem, row_ptr, row_add, rows)):
        x = mem.read(kv.offset(r * stride * 2), BF16, dim)
        c = rmsnorm_ref(x, w, eps).astype(np.float32)
        q, s = quantize_rows_fp8(c[None])
        blk = int(mem.scalar(block_table.offset((row // block_size) * 4), np.uint32))
        slot = blk * block_size + row % block_size
        mem.write(cache.offset(slot * dim), q[0])
        mem.write(scales.offset(slot * 4), s)


@declare(
    "dsa_cache",
    "indexer_write_keys",
    [
        ("kg", PTR),
        ("stride", U32),
        ("knorm_w", PTR),
        ("knorm_b", PTR),
        ("keys", PTR),
        ("gates", PTR),
        ("row_ptr", PTR),
        ("row_add", U32),
        ("rows", U32),
        ("dim", U32),
        ("eps", F32),
    ],
    writes=("keys", "gates"),
)
def INDEXER_WRITE_KEYS(mem, kg, stride, knorm_w, knorm_b, keys, gates, row_ptr, row_add, rows, dim, eps):
    """kg row r holds [wk y (dim) ; compress_gate y (dim)]."""
    w, b = mem.read(knorm_w, BF16, dim), mem.read(knorm_b, BF16, dim)
    for r, row in enumerate(_rows(mem, row_ptr, row_add, rows)):
        src = mem.read(kg.offset(r * stride * 2), BF16, 2 * dim)
        mem.write(keys.offset(row * dim * 2), layernorm_ref(src[:dim], w, b, eps).astype(BF16))
        mem.write(gates.offset(row * dim * 2), src[dim:])


@declare(
    "dsa_cache",
    "indexer_compress_pools",
    [
        ("keys", PTR),
        ("gates", PTR),
        ("ape", PTR),
        ("pool_keys", PTR),
        ("pool_scales", PTR),
        ("row_ptr", PTR),
        ("row_add", U32),
        ("rows", U32),
        ("dim", U32),
        ("kpool", U32),
    ],
    writes=("pool_keys", "pool_scales"),
)
def INDEXER_COMPRESS_POOLS(mem, keys, gates, ape, pool_keys, pool_scales, row_ptr, row_add, rows, dim, kpool):
    """Compress every pool whose last row is among the rows written: row + 1 divisible by kpool."""
    apev = mem.read(ape, BF16, (kpool, dim))
    for row in _rows(mem, row_ptr, row_add, rows):
        if (row + 1) % kpool:
            continue
        p = row // kpool
        k = mem.read(keys.offset(p * kpool * dim * 2), BF16, (kpool, dim))
        g = mem.read(gates.offset(p * kpool * dim * 2), BF16, (kpool, dim))
        q, s = quantize_rows_fp8(compress_pool_ref(k, g, apev)[None])
        mem.write(pool_keys.offset(p * dim), q[0])
        mem.write(pool_scales.offset(p * 4), s)


@declare(
    "dsa_cache",
    "dsa_cache_write",
    [
        ("fused", PTR),
        ("stride", U32),
        ("kv_norm_w", PTR),
        ("cache", PTR),
        ("scales", PTR),
        ("block_table", PTR),
        ("knorm_w", PTR),
        ("knorm_b", PTR),
        ("keys", PTR),
        ("gates", PTR),
        ("ape", PTR),
        ("pool_keys", PTR),
        ("pool_scales", PTR),
        ("row_ptr", PTR),
        ("row_add", U32),
        ("rows", U32),
        ("C", U32),
        ("idim", U32),
        ("block_size", U32),
        ("kpool", U32),
        ("eps", F32),
        ("ln_eps", F32),
    ],
    writes=("cache", "scales", "keys", "gates", "pool_keys", "pool_scales"),
    pdl=True,
    releases=True,  # the q projection (rmsnorm_gemv_beside) runs beside it
)
def DSA_CACHE_WRITE(
    mem,
    fused,
    stride,
    kv_norm_w,
    cache,
    scales,
    block_table,
    knorm_w,
    knorm_b,
    keys,
    gates,
    ape,
    pool_keys,
    pool_scales,
    row_ptr,
    row_add,
    rows,
    C,
    idim,
    block_size,
    kpool,
    eps,
    ln_eps,
):
    """latent_write_fp8, indexer_write_keys and indexer_compress_pools of the same rows, in that
    order, in one launch. Fused row r: [kv (C) ; wk y (idim) ; compress_gate y (idim) ; ...]."""
    LATENT_WRITE_FP8.host(
        mem, fused, stride, kv_norm_w, cache, scales, block_table, row_ptr, row_add, rows, C, block_size, eps
    )
    INDEXER_WRITE_KEYS.host(
        mem, fused.offset(C * 2), stride, knorm_w, knorm_b, keys, gates, row_ptr, row_add, rows, idim, ln_eps
    )
    INDEXER_COMPRESS_POOLS.host(
        mem, keys, gates, ape, pool_keys, pool_scales, row_ptr, row_add, rows, idim, kpool
    )


assert FP8.itemsize == 1

# ptx/dsa_cache.cu keeps a pool key row and per-slot LayerNorm statistics in static shared memory.
MAX_DIM = 1024
MAX_KPOOL = 16


def check_dims(idim: int, kpool: int) -> None:
    if not 1 <= kpool <= MAX_KPOOL or not 1 <= idim <= MAX_DIM:
        raise ValueError(
            f"dsa_cache: index_head_dim {idim} / index_kpool {kpool} outside the kernels' "
            f"1..{MAX_DIM} / 1..{MAX_KPOOL}"
        )


def latent_write_fp8(
    gpu,
    kv,
    stride,
    norm_w,
    cache,
    scales,
    block_table,
    row_ptr,
    row_add,
    rows,
    dim,
    block_size,
    eps,
    stream=None,
):
    launch(
        gpu,
        gpu.kernel(*LATENT_WRITE_FP8.key),
        rows,
        128,
        kv,
        stride,
        norm_w,
        cache,
        scales,
        block_table,
        row_ptr,
        row_add,
        rows,
        dim,
        block_size,
        eps,
        stream=stream,
    )


def indexer_write_keys(
    gpu, kg, stride, knorm_w, knorm_b, keys, gates, row_ptr, row_add, rows, dim, eps, stream=None
):
    launch(
        gpu,
        gpu.kernel(*INDEXER_WRITE_KEYS.key),
        rows,
        128,
        kg,
        stride,
        knorm_w,
        knorm_b,
        keys,
        gates,
        row_ptr,
        row_add,
        rows,
        dim,
        eps,
        stream=stream,
    )


def indexer_compress_pools(
    gpu, keys, gates, ape, pool_keys, pool_scales, row_ptr, row_add, rows, dim, kpool, stream=None
):
    check_dims(dim, kpool)
    launch(
        gpu,
        gpu.kernel(*INDEXER_COMPRESS_POOLS.key),
        rows,
        128,
        keys,
        gates,
        ape,
        pool_keys,
        pool_scales,
        row_ptr,
        row_add,
        rows,
        dim,
        kpool,
        stream=stream,
    )


def dsa_cache_write(
    gpu,
    fused,
    stride,
    kv_norm_w,
    cache,
    scales,
    block_table,
    knorm_w,
    knorm_b,
    keys,
    gates,
    ape,
    pool_keys,
    pool_scales,
    row_ptr,
    row_add,
    rows,
    C,
    idim,
    block_size,
    kpool,
    eps,
    ln_eps,
    stream=None,
):
    check_dims(idim, kpool)
    launch(
        gpu,
        gpu.kernel(*DSA_CACHE_WRITE.key),
        rows,
        128,
        fused,
        stride,
        kv_norm_w,
        cache,
        scales,
        block_table,
        knorm_w,
        knorm_b,
        keys,
        gates,
        ape,
        pool_keys,
        pool_scales,
        row_ptr,
        row_add,
        rows,
        C,
        idim,
        block_size,
        kpool,
        eps,
        ln_eps,
        stream=stream,
    )
