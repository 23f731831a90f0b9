"""Absorbed MLA attention over the selected latent rows of the paged FP8 cache.

Per head: ``s_j = (q_h . c_j) * scale`` over the selected rows j, softmax, ``o_h = sum_j p_j c_j``.
``q`` is the absorbed query in latent space (f32, [heads, dim]); ``out`` is BF16 [heads, dim].
The selection's row count is read from device memory; an empty selection (a row with no complete
pool when the tail is not selected) attends nothing and outputs zero. CUDA: ptx/sparse_mla.cu.

Two implementations of the same function, each for m batch entries (model/kernels/batch.py):
``sparse_mla_attend_batch`` (one launch, one block per head and entry, CUDA cores) and the split
pair ``sparse_mla_partial_batch`` + ``sparse_mla_combine_batch`` (``sparse_mla_split_batch``;
flash-decoding: 64-row splits x 16-head tiles on the tensor cores, then an exact merge), which the
decoder block uses where the shapes allow it (``split_supported``). Each entry attends its own
selection through its own slot's block table; its bits do not depend on the batch.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16, FP8
from runtime.host_math import dot_rows
from runtime.kernel import F32, PTR, U32, declare
from runtime.launch import launch

from .batch import is_pad, read_entries


def _gather_n(mem, cache, scales, block_table, selected, n, dim, block_size):
    if n == 0:
        return 0, np.zeros((0, dim), np.float32)
    rows = mem.read(selected, np.uint32, n).astype(np.int64)
    blocks = mem.read(block_table, np.uint32, int(rows.max()) // block_size + 1).astype(np.int64)
    slots = blocks[rows // block_size] * block_size + rows % block_size
    nslots = int(slots.max()) + 1
    c = mem.read(cache, FP8, (nslots, dim))[slots].astype(np.float32)
    c *= mem.read(scales, np.float32, nslots)[slots][:, None]
    return n, c


def _attend(mem, q, n, c, out, heads, dim, scale):
    """One sequence's attention over its gathered rows."""
    if n == 0:
        mem.write(out, np.zeros((heads, dim), BF16))
        return
    qv = mem.read(q, np.float32, (heads, dim))
    s = dot_rows(qv, c) * np.float32(scale)
    s -= s.max(1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(1, keepdims=True)
    mem.write(out, dot_rows(p, c.T).astype(BF16))


# ptx/sparse_mla.cu: rows per split and heads per tile of sparse_mla_partial_batch.
SPLIT_ROWS = 64
HEAD_TILE = 16
MAX_SPLITS = 1024


def _partial(mem, q, n, c, part, ml, heads, dim, scale):
    qv = mem.read(q, np.float32, (heads, dim))
    s = dot_rows(qv, c) * np.float32(scale)
    for sp in range(-(-n // SPLIT_ROWS)):
        seg = slice(sp * SPLIT_ROWS, min(n, (sp + 1) * SPLIT_ROWS))
        m = s[:, seg].max(1)
        e = np.exp(s[:, seg] - m[:, None])
        mem.write(part.offset(sp * heads * dim * 4), dot_rows(e, c[seg].T))
        mem.write(ml.offset(sp * heads * 8), np.stack([m, e.sum(1, dtype=np.float32)], 1).astype(np.float32))


def _combine(mem, part, ml, n, out, heads, dim):
    splits = -(-n // SPLIT_ROWS)
    if splits == 0:
        mem.write(out, np.zeros((heads, dim), BF16))
        return
    p = mem.read(part, np.float32, (splits, heads, dim))
    mlv = mem.read(ml, np.float32, (splits, heads, 2))
    w = np.exp(mlv[:, :, 0] - mlv[:, :, 0].max(0))
    # Splits added in split order, each head on its own (the sum's order is not numpy's choice).
    num, den = p[0] * w[0][:, None], mlv[0, :, 1] * w[0]
    for sp in range(1, splits):
        num += p[sp] * w[sp][:, None]
        den += mlv[sp, :, 1] * w[sp]
    mem.write(out, (num / den[:, None]).astype(BF16))


# ---- the batched kernels: m entries [slot, row, token, reserved] of the slot pools (batch.py) ----
# Entry e's absorbed query is q + e * heads * dim (f32), its selection selected + e * sel_cap with
# count[e] rows (at most sel_cap), its latent rows gathered through its slot's block table
# (tables + slot * blocks_per_slot), its output out + e * heads * dim (BF16); the split pair's
# workspace is per entry (split_workspace_batch). Padding entries read and write nothing.


def _batch_entries(mem, entries, m, count, sel_cap):
    """(e, slot, n) of every entry that is not padding, n = min(count[e], sel_cap)."""
    out = []
    for e, ent in enumerate(read_entries(mem, entries, m)):
        if not is_pad(ent):
            out.append((e, int(ent[0]), min(int(mem.scalar(count.offset(e * 4), np.uint32)), sel_cap)))
    return out


def batch_splits(sel_cap: int) -> int:
    """Partials per entry of the batched split pair: a selection of at most sel_cap rows."""
    return max(-(-sel_cap // SPLIT_ROWS), 1)


def _blocks_per_slot(slot_rows: int, block_size: int) -> int:
    return -(-slot_rows // block_size)


@declare(
    "sparse_mla",
    "sparse_mla_attend_batch",
    [
        ("q", PTR),
        ("cache", PTR),
        ("scales", PTR),
        ("tables", PTR),
        ("selected", PTR),
        ("count", PTR),
        ("out", PTR),
        ("entries", PTR),
        ("m", U32),
        ("slot_rows", U32),
        ("sel_cap", U32),
        ("heads", U32),
        ("dim", U32),
        ("block_size", U32),
        ("scale", F32),
    ],
    writes=("out",),
)
def SPARSE_MLA_ATTEND_BATCH(
    mem,
    q,
    cache,
    scales,
    tables,
    selected,
    count,
    out,
    entries,
    m,
    slot_rows,
    sel_cap,
    heads,
    dim,
    block_size,
    scale,
):
    bps = _blocks_per_slot(slot_rows, block_size)
    for e, slot, n in _batch_entries(mem, entries, m, count, sel_cap):
        table = tables.offset(slot * bps * 4)
        _, c = _gather_n(mem, cache, scales, table, selected.offset(e * sel_cap * 4), n, dim, block_size)
        _attend(mem, q.offset(e * heads * dim * 4), n, c, out.offset(e * heads * dim * 2), heads, dim, scale)


@declare(
    "sparse_mla",
    "sparse_mla_partial_batch",
    [
        ("q", PTR),
        ("cache", PTR),
        ("scales", PTR),
        ("tables", PTR),
        ("selected", PTR),
        ("count", PTR),
        ("part", PTR),
        ("ml", PTR),
        ("entries", PTR),
        ("m", U32),
        ("slot_rows", U32),
        ("sel_cap", U32),
        ("heads", U32),
        ("dim", U32),
        ("block_size", U32),
        ("scale", F32),
    ],
    writes=("part", "ml"),
    pdl=True,
    releases=True,  # right after its wait: the merge launches during its tail
)
def SPARSE_MLA_PARTIAL_BATCH(
    mem,
    q,
    cache,
    scales,
    tables,
    selected,
    count,
    part,
    ml,
    entries,
    m,
    slot_rows,
    sel_cap,
    heads,
    dim,
    block_size,
    scale,
):
    """Each entry's per-split partial attention (unnormalised output and its (max, sum)) into its
    workspace (split_workspace_batch)."""
    bps, splits = _blocks_per_slot(slot_rows, block_size), batch_splits(sel_cap)
    for e, slot, n in _batch_entries(mem, entries, m, count, sel_cap):
        table = tables.offset(slot * bps * 4)
        _, c = _gather_n(mem, cache, scales, table, selected.offset(e * sel_cap * 4), n, dim, block_size)
        _partial(
            mem,
            q.offset(e * heads * dim * 4),
            n,
            c,
            part.offset(e * splits * heads * dim * 4),
            ml.offset(e * splits * heads * 8),
            heads,
            dim,
            scale,
        )


@declare(
    "sparse_mla",
    "sparse_mla_combine_batch",
    [
        ("part", PTR),
        ("ml", PTR),
        ("count", PTR),
        ("out", PTR),
        ("entries", PTR),
        ("m", U32),
        ("sel_cap", U32),
        ("heads", U32),
        ("dim", U32),
    ],
    writes=("out",),
    pdl=True,
    releases=True,  # right after its wait: wv launches during its tail
)
def SPARSE_MLA_COMBINE_BATCH(mem, part, ml, count, out, entries, m, sel_cap, heads, dim):
    """The exact merge of each entry's splits into out + e * heads * dim."""
    splits = batch_splits(sel_cap)
    for e, _, n in _batch_entries(mem, entries, m, count, sel_cap):
        _combine(
            mem,
            part.offset(e * splits * heads * dim * 4),
            ml.offset(e * splits * heads * 8),
            n,
            out.offset(e * heads * dim * 2),
            heads,
            dim,
        )


def split_supported(dim: int, rows_capacity: int) -> bool:
    """Shapes the tensor-core split kernels take: dim a multiple of 16 up to 512, and at most
    MAX_SPLITS splits (sparse_mla_combine_batch's shared weights)."""
    return dim % 16 == 0 and 16 <= dim <= 512 and -(-rows_capacity // SPLIT_ROWS) <= MAX_SPLITS


def split_workspace(heads: int, dim: int, rows_capacity: int) -> tuple[int, int]:
    """Bytes of (part, ml) for a selection of at most ``rows_capacity`` rows."""
    splits = max(-(-rows_capacity // SPLIT_ROWS), 1)
    return splits * heads * dim * 4, splits * heads * 8


def split_workspace_batch(heads: int, dim: int, sel_cap: int, m: int) -> tuple[int, int]:
    """Bytes of (part, ml) for m entries of the batched split pair, entry e's at
    ``e * split_workspace(heads, dim, sel_cap)`` (``batch_splits(sel_cap)`` partials each)."""
    pb, mb = split_workspace(heads, dim, sel_cap)
    return m * pb, m * mb


def partial_smem(dim: int) -> int:
    """ptx/sparse_mla.cu sparse_mla_partial_batch: C [64][dim+8] and q hi/lo [16][dim+8] BF16, scores
    [16][68] f32, p hi/lo [16][72] BF16, 64 slots and scales, 16 (m, l)."""
    dp = dim + 8
    return (
        2 * SPLIT_ROWS * dp
        + 4 * HEAD_TILE * dp
        + 4 * HEAD_TILE * 68
        + 4 * HEAD_TILE * 72
        + 8 * SPLIT_ROWS
        + 8 * HEAD_TILE
    )


# Grid dims y and z of a launch (the batched kernels put the entry there).
MAX_GRID_YZ = 65535


def _check_batch(what: str, m: int) -> None:
    if not 1 <= m <= MAX_GRID_YZ:
        raise ValueError(f"{what}: m={m} entries outside 1..{MAX_GRID_YZ}")


def sparse_mla_split_batch(
    gpu,
    *,
    q,
    cache,
    scales,
    tables,
    selected,
    count,
    part,
    ml,
    out,
    entries,
    m,
    slot_rows,
    sel_cap,
    heads,
    dim,
    block_size,
    scale,
    stream=None,
):
    """The split attention for ``m`` batch entries (model/kernels/batch.py): partials over grid
    ``(batch_splits(sel_cap), ceil(heads / 16), m)``, then the merge over ``(heads, ceil(dim / 128),
    m)``. Entry e: absorbed query ``q + e * heads * dim * 4`` (f32 ``[heads][dim]``), selection
    ``selected + e * sel_cap * 4`` with ``count[e]`` rows (at most ``sel_cap``), latent rows through
    its slot's block table (``tables + slot * ceil(slot_rows / block_size) * 4``), workspace
    ``part`` / ``ml`` per entry (``split_workspace_batch``), output ``out + e * heads * dim * 2``
    (BF16). Each entry's output is that of a launch of its entry alone, bit for bit. Padding
    entries read and write nothing (their output rows keep what they held)."""
    if not split_supported(dim, sel_cap):
        raise ValueError(f"sparse_mla_split_batch: dim {dim} / {sel_cap} rows outside the split kernels")
    _check_batch("sparse_mla_split_batch", m)
    launch(
        gpu,
        gpu.kernel(*SPARSE_MLA_PARTIAL_BATCH.key),
        (batch_splits(sel_cap), -(-heads // HEAD_TILE), m),
        256,
        q,
        cache,
        scales,
        tables,
        selected,
        count,
        part,
        ml,
        entries,
        m,
        slot_rows,
        sel_cap,
        heads,
        dim,
        block_size,
        scale,
        smem=partial_smem(dim),
        stream=stream,
    )
    launch(
        gpu,
        gpu.kernel(*SPARSE_MLA_COMBINE_BATCH.key),
        (heads, -(-dim // 128), m),
        256,
        part,
        ml,
        count,
        out,
        entries,
        m,
        sel_cap,
        heads,
        dim,
        stream=stream,
    )


def sparse_mla_attend_batch(
    gpu,
    *,
    q,
    cache,
    scales,
    tables,
    selected,
    count,
    out,
    entries,
    m,
    slot_rows,
    sel_cap,
    heads,
    dim,
    block_size,
    scale,
    stream=None,
):
    """The one-pass attention (the fallback for shapes ``split_supported`` refuses) for ``m`` entries,
    grid ``(heads, m)``, addressed as ``sparse_mla_split_batch``; no workspace."""
    if dim > 1024:
        raise ValueError(f"sparse_mla_attend_batch: dim {dim} > 1024 (the kernel's per-lane registers)")
    _check_batch("sparse_mla_attend_batch", m)
    launch(
        gpu,
        gpu.kernel(*SPARSE_MLA_ATTEND_BATCH.key),
        (heads, m),
        256,
        q,
        cache,
        scales,
        tables,
        selected,
        count,
        out,
        entries,
        m,
        slot_rows,
        sel_cap,
        heads,
        dim,
        block_size,
        scale,
        stream=stream,
    )
