"""Writes of the DSA caches for the m entries of a batch (model/kernels/batch.py): entry e's row
(its word 1 + row_add) of its own slot in the slot pools, from fused row e.

- the MLA latent ``c = rmsnorm(kv) * kv_a_layernorm`` as an FP8 E4M3 row with one f32 scale, into
  the paged cache at the row's slot through the slot's block table;
- the indexer's per-token key ``k = LayerNorm(wk y)`` and gate ``g = compress_gate y`` (BF16);
- the compressed key of every pool the rows complete: a per-dimension softmax over the pool's
  slots of ``g + ape`` weighting the slots' ``k``, stored FP8 with a scale.

Rows are read from a fused projection output with row stride ``stride`` (elements).
CUDA: ptx/dsa_cache.cu (``dsa_cache_write_batch``, one block of 128 per entry: the block path's
only cache write). A slot's bytes do not depend on the batch, its order or its chunking.

``dsa_cache_write_plain_batch`` is the same write for the plain per-token indexer with RoPE
(GLM-5, DeepSeek-V3.2: every token its own pool, kpool 1, no keys / gates): the latent as above,
the MLA rope key rotated into a BF16 rope-keys pool, and the indexer key LayerNorm'd, rotated on
its first irope_dim dims (model/kernels/rope.py) and stored FP8 as the row's pool key.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16, FP8, quantize_rows_fp8
from runtime.kernel import F32, PTR, U32, declare
from runtime.kernels.rmsnorm import rmsnorm_ref
from runtime.launch import launch

from .batch import SlotGeometry, is_pad, read_entries
from .rope import rope_dims_ok, rope_launch_args, rope_ref


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


# One row's writes (the twin passes a slot's keys / gates / pool keys / pool scales / block table as
# the bases).


def _latent_row(mem, x_ptr, w, cache, scales, block_table, row, dim, block_size, eps):
    x = mem.read(x_ptr, BF16, dim)
    c = rmsnorm_ref(x, w, eps).astype(np.float32)
    q, s = quantize_rows_fp8(c[None])
    blk = int(mem.scalar(block_table.offset((row // block_size) * 4), np.uint32))
    slot = blk * block_size + row % block_size
    mem.write(cache.offset(slot * dim), q[0])
    mem.write(scales.offset(slot * 4), s)


def _key_gate_row(mem, src_ptr, w, b, keys, gates, row, dim, eps):
    src = mem.read(src_ptr, BF16, 2 * dim)
    mem.write(keys.offset(row * dim * 2), layernorm_ref(src[:dim], w, b, eps).astype(BF16))
    mem.write(gates.offset(row * dim * 2), src[dim:])


def _compress_row_pool(mem, keys, gates, apev, pool_keys, pool_scales, p, dim, kpool):
    k = mem.read(keys.offset(p * kpool * dim * 2), BF16, (kpool, dim))
    g = mem.read(gates.offset(p * kpool * dim * 2), BF16, (kpool, dim))
    q, s = quantize_rows_fp8(compress_pool_ref(k, g, apev)[None])
    mem.write(pool_keys.offset(p * dim), q[0])
    mem.write(pool_scales.offset(p * 4), s)


def _live_entries(mem, entries, m, row_add, slot_rows):
    """(e, slot, row) of every entry that is not padding and whose row lies inside its slot, in
    entry order: what the batched kernels address (the others read and write nothing)."""
    out = []
    for e, ent in enumerate(read_entries(mem, entries, m)):
        row = (int(ent[1]) + row_add) & 0xFFFFFFFF  # the kernel's u32 sum
        if not is_pad(ent) and row < slot_rows:
            out.append((e, int(ent[0]), row))
    return out


@declare(
    "dsa_cache",
    "dsa_cache_write_batch",
    [
        ("fused", PTR),
        ("stride", U32),
        ("kv_norm_w", PTR),
        ("cache", PTR),
        ("scales", PTR),
        ("tables", PTR),
        ("knorm_w", PTR),
        ("knorm_b", PTR),
        ("keys", PTR),
        ("gates", PTR),
        ("ape", PTR),
        ("pool_keys", PTR),
        ("pool_scales", PTR),
        ("entries", PTR),
        ("m", U32),
        ("row_add", U32),
        ("slot_rows", U32),
        ("C", U32),
        ("idim", U32),
        ("block_size", U32),
        ("kpool", U32),
        ("eps", F32),
        ("ln_eps", F32),
    ],
    writes=("cache", "scales", "keys", "gates", "pool_keys", "pool_scales"),
    pdl=True,
    releases=True,  # right after its wait: the q projection runs beside it
)
def DSA_CACHE_WRITE_BATCH(
    mem,
    fused,
    stride,
    kv_norm_w,
    cache,
    scales,
    tables,
    knorm_w,
    knorm_b,
    keys,
    gates,
    ape,
    pool_keys,
    pool_scales,
    entries,
    m,
    row_add,
    slot_rows,
    C,
    idim,
    block_size,
    kpool,
    eps,
    ln_eps,
):
    """The cache writes of m entries: entry e's row (entries[e].row + row_add) of its slot, from
    fused row e; latents, then keys and gates, then the pools the rows complete (so a pool whose
    rows share the launch sees them, as the kernel's recomputation does)."""
    geo = SlotGeometry(slot_rows, idim, kpool, block_size)
    live = _live_entries(mem, entries, m, row_add, slot_rows)
    if not live:
        return
    w = mem.read(kv_norm_w, BF16, C)
    for e, slot, row in live:
        table = tables.offset(geo.table_base(slot) * 4)
        _latent_row(mem, fused.offset(e * stride * 2), w, cache, scales, table, row, C, block_size, eps)
    kw, kb = mem.read(knorm_w, BF16, idim), mem.read(knorm_b, BF16, idim)
    for e, slot, row in live:
        k, g = keys.offset(geo.key_row(slot, 0) * 2), gates.offset(geo.key_row(slot, 0) * 2)
        _key_gate_row(mem, fused.offset((e * stride + C) * 2), kw, kb, k, g, row, idim, ln_eps)
    if not 1 <= kpool <= MAX_KPOOL or idim > MAX_DIM:
        return
    apev = mem.read(ape, BF16, (kpool, idim))
    for _, slot, row in live:
        if (row + 1) % kpool == 0:
            _compress_row_pool(
                mem,
                keys.offset(geo.key_row(slot, 0) * 2),
                gates.offset(geo.key_row(slot, 0) * 2),
                apev,
                pool_keys.offset(geo.pool_row(slot, 0) * idim),
                pool_scales.offset(geo.pool_row(slot, 0) * 4),
                row // kpool,
                idim,
                kpool,
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


def dsa_cache_write_batch(
    gpu,
    *,
    fused,
    stride,
    kv_norm_w,
    cache,
    scales,
    tables,
    knorm_w,
    knorm_b,
    keys,
    gates,
    ape,
    pool_keys,
    pool_scales,
    entries,
    m,
    row_add,
    slot_rows,
    C,
    idim,
    block_size,
    kpool,
    eps,
    ln_eps,
    stream=None,
):
    """The DSA cache writes of ``m`` batch entries (model/kernels/batch.py), one block each.

    Entry e = ``[slot, row, token, reserved]`` writes row ``row + row_add`` of its slot from fused
    row e (``fused + e * stride * 2`` bytes, ``[kv (C) ; wk y (idim) ; compress_gate y (idim) ;
    ...]``): the latent into the paged cache at the slot's block table
    (``tables + slot * blocks_per_slot``), the indexer key and gate into the slot's rows of the
    keys / gates pools, and the pool key of every pool the row completes into the slot's pool keys
    / scales. Several consecutive rows of one sequence may share a launch (a catch-up chunk:
    consecutive entries, ascending rows, no gap), beside other sequences' rows; a pool's rows of
    the same launch are recomputed from their fused rows, with the bits of the cached path. So a
    slot's bytes are those of writing its rows alone, one at a time, in any chunking and batch.
    Padding entries, and entries whose row is not below ``slot_rows``, read and write nothing of any
    sequence."""
    check_dims(idim, kpool)
    if m < 1:  # a catch-up chunk may hold more entries than a draft batch (the grid is m blocks)
        raise ValueError(f"dsa_cache_write_batch: m={m} entries")
    launch(
        gpu,
        gpu.kernel(*DSA_CACHE_WRITE_BATCH.key),
        m,
        128,
        fused,
        stride,
        kv_norm_w,
        cache,
        scales,
        tables,
        knorm_w,
        knorm_b,
        keys,
        gates,
        ape,
        pool_keys,
        pool_scales,
        entries,
        m,
        row_add,
        slot_rows,
        C,
        idim,
        block_size,
        kpool,
        eps,
        ln_eps,
        stream=stream,
    )


# ---- the plain indexer with RoPE (kpool 1) --------------------------------------------------------


def _plain_key_row(mem, src_ptr, w, b, pool_keys, pool_scales, p, row, idim, irope_dim, inv, af, il, ln_eps):
    """Pool p's key (pool = row at kpool 1): LayerNorm, then RoPE on the first irope_dim dims, all in
    f32, as one FP8 row with its scale."""
    k = layernorm_ref(mem.read(src_ptr, BF16, idim), w, b, ln_eps).astype(np.float32)
    if irope_dim:
        k[:irope_dim] = rope_ref(k[:irope_dim], row, inv, af, il)
    q, s = quantize_rows_fp8(k[None])
    mem.write(pool_keys.offset(p * idim), q[0])
    mem.write(pool_scales.offset(p * 4), s)


@declare(
    "dsa_cache",
    "dsa_cache_write_plain_batch",
    [
        ("fused", PTR),
        ("stride", U32),
        ("kv_norm_w", PTR),
        ("cache", PTR),
        ("scales", PTR),
        ("tables", PTR),
        ("knorm_w", PTR),
        ("knorm_b", PTR),
        ("rope_keys", PTR),
        ("pool_keys", PTR),
        ("pool_scales", PTR),
        ("inv_freq", PTR),
        ("attn_factor", F32),
        ("entries", PTR),
        ("m", U32),
        ("row_add", U32),
        ("slot_rows", U32),
        ("C", U32),
        ("rope_dim", U32),
        ("idim", U32),
        ("irope_dim", U32),
        ("block_size", U32),
        ("interleave", U32),
        ("i_interleave", U32),
        ("eps", F32),
        ("ln_eps", F32),
    ],
    writes=("cache", "scales", "rope_keys", "pool_keys", "pool_scales"),
    pdl=True,
    releases=True,  # right after its wait: the q projection runs beside it, as beside the pooled one
)
def DSA_CACHE_WRITE_PLAIN_BATCH(
    mem,
    fused,
    stride,
    kv_norm_w,
    cache,
    scales,
    tables,
    knorm_w,
    knorm_b,
    rope_keys,
    pool_keys,
    pool_scales,
    inv_freq,
    attn_factor,
    entries,
    m,
    row_add,
    slot_rows,
    C,
    rope_dim,
    idim,
    irope_dim,
    block_size,
    interleave,
    i_interleave,
    eps,
    ln_eps,
):
    """The cache writes of m entries for the plain indexer: entry e's row r (entries[e].row +
    row_add) of its slot from fused row e ``[kv (C) ; k_rope (rope_dim) ; wk y (idim) ; ...]``: the
    latent, the rope key at (slot, r) of the rope-keys pool, the indexer key as pool r's key."""
    if not rope_dims_ok(rope_dim, irope_dim, idim) or idim > MAX_DIM:
        return  # the kernel writes nothing either
    geo = SlotGeometry(slot_rows, idim, 1, block_size)
    live = _live_entries(mem, entries, m, row_add, slot_rows)
    if not live:
        return
    w = mem.read(kv_norm_w, BF16, C)
    inv = mem.read(inv_freq, np.float32, rope_dim // 2)
    kw, kb = mem.read(knorm_w, BF16, idim), mem.read(knorm_b, BF16, idim)
    for e, slot, row in live:
        src = fused.offset(e * stride * 2)
        _latent_row(
            mem, src, w, cache, scales, tables.offset(geo.table_base(slot) * 4), row, C, block_size, eps
        )
        if rope_dim:
            kr = rope_ref(
                mem.read(src.offset(C * 2), BF16, rope_dim), row, inv, attn_factor, bool(interleave)
            )
            mem.write(rope_keys.offset((slot * slot_rows + row) * rope_dim * 2), kr.astype(BF16))
        _plain_key_row(
            mem,
            src.offset((C + rope_dim) * 2),
            kw,
            kb,
            pool_keys,
            pool_scales,
            geo.pool_row(slot, row),
            row,
            idim,
            irope_dim,
            inv,
            attn_factor,
            bool(i_interleave),
            ln_eps,
        )


def dsa_cache_write_plain_batch(
    gpu,
    *,
    fused,
    stride,
    kv_norm_w,
    cache,
    scales,
    tables,
    knorm_w,
    knorm_b,
    rope_keys,
    pool_keys,
    pool_scales,
    inv_freq,
    attn_factor,
    entries,
    m,
    row_add,
    slot_rows,
    C,
    rope_dim,
    idim,
    irope_dim,
    block_size,
    interleave,
    i_interleave,
    eps,
    ln_eps,
    stream=None,
):
    """The DSA cache writes of ``m`` batch entries for the plain per-token indexer with RoPE, one
    block each.

    Entry e = ``[slot, row, token, reserved]`` writes row ``r = row + row_add`` of its slot from
    fused row e (``fused + e * stride * 2`` bytes, ``[kv (C) ; k_rope (rope_dim) ; wk y (idim) ;
    ...]``): the latent into the paged cache at the slot's block table (as
    ``dsa_cache_write_batch``); ``bf16(rope(k_rope, r, interleave))`` at
    ``rope_keys + (slot * slot_rows + r) * rope_dim`` (BF16, when rope_dim > 0); and the indexer key
    ``LayerNorm(wk y)`` (knorm_w / knorm_b, ln_eps), rotated on its first ``irope_dim`` dims
    (i_interleave), in f32, as one FP8 row with one f32 scale at the slot's pool r
    (``SlotGeometry(slot_rows, idim, kpool=1, ...).pool_row(slot, r)`` in pool_keys (times idim) and
    pool_scales). ``inv_freq``: rope_dim / 2 float32 values (model/kernels/rope.py); at rope_dim 0
    ``rope_keys`` and ``inv_freq`` are not touched (any allocation will do). Every row depends on
    its own fused row only, so a slot's bytes are the same in any batch, order or chunking.
    Padding entries, and entries whose row is not below ``slot_rows``, read and write nothing of
    any sequence."""
    what = "dsa_cache_write_plain_batch"
    interleave, i_interleave = rope_launch_args(what, rope_dim, irope_dim, idim, interleave, i_interleave)
    check_dims(idim, 1)
    if m < 1:  # a catch-up chunk may hold more entries than a draft batch (the grid is m blocks)
        raise ValueError(f"{what}: m={m} entries")
    launch(
        gpu,
        gpu.kernel(*DSA_CACHE_WRITE_PLAIN_BATCH.key),
        m,
        128,
        fused,
        stride,
        kv_norm_w,
        cache,
        scales,
        tables,
        knorm_w,
        knorm_b,
        rope_keys,
        pool_keys,
        pool_scales,
        inv_freq,
        attn_factor,
        entries,
        m,
        row_add,
        slot_rows,
        C,
        rope_dim,
        idim,
        irope_dim,
        block_size,
        interleave,
        i_interleave,
        eps,
        ln_eps,
        stream=stream,
    )
