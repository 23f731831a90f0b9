"""Absorbed MLA attention over the selected latent rows of the paged FP8 cache.

Per head: ``s_j = (q_h . c_j + qr_h . kr_j) * scale`` over the selected rows j, softmax,
``o_h = sum_j p_j c_j``. ``q`` is the absorbed query in latent space (f32, [heads, dim]); ``out`` is
BF16 [heads, dim]. The RoPE term (MLA's qk_rope_head_dim part: GLM-5 / DeepSeek-V3.2, 64 wide) takes
the rotated query ``qr`` (BF16 [heads, rope_dim]) and the rotated key ``kr_j`` of selected row r
(BF16, dense per sequence slot: ``rope_keys[(slot * slot_rows + r) * rope_dim]``, not paged);
``rope_dim = 0`` (NoPE) leaves it out, and then neither is read.
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


def _rope_term(mem, q_rope, slot_keys, selected, n, heads, rope_dim):
    """f32 [heads, n]: the rope query . the rope key of each selected row (``slot_keys`` the slot's
    rows), or None for NoPE (rope_dim 0), where nothing is read."""
    if rope_dim == 0:
        return None
    if n == 0:
        return np.zeros((heads, 0), np.float32)
    rows = mem.read(selected, np.uint32, n).astype(np.int64)
    kr = mem.read(slot_keys, BF16, (int(rows.max()) + 1, rope_dim))[rows]
    return dot_rows(mem.read(q_rope, BF16, (heads, rope_dim)).astype(np.float32), kr.astype(np.float32))


def _scores(mem, q, c, rope, heads, dim, scale):
    qv = mem.read(q, np.float32, (heads, dim))
    if rope is None:
        return dot_rows(qv, c) * np.float32(scale)
    return (dot_rows(qv, c) + rope) * np.float32(scale)


def _attend(mem, q, n, c, rope, out, heads, dim, scale):
    """One sequence's attention over its gathered rows (``rope``: _rope_term)."""
    if n == 0:
        mem.write(out, np.zeros((heads, dim), BF16))
        return
    s = _scores(mem, q, c, rope, heads, dim, scale)
    s -= s.max(1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(1, keepdims=True)
    mem.write(out, dot_rows(p, c.T).astype(BF16))


# ptx/sparse_mla.cu: rows per split and heads per tile of sparse_mla_partial_batch.
SPLIT_ROWS = 64
HEAD_TILE = 16
MAX_SPLITS = 1024


def _partial(mem, q, n, c, rope, part, ml, heads, dim, scale, split_rows=SPLIT_ROWS):
    s = _scores(mem, q, c, rope, heads, dim, scale)
    for sp in range(-(-n // split_rows)):
        seg = slice(sp * split_rows, min(n, (sp + 1) * split_rows))
        m = s[:, seg].max(1)
        e = np.exp(s[:, seg] - m[:, None])
        mem.write(part.offset(sp * heads * dim * 4), dot_rows(e, c[seg].T))
        mem.write(ml.offset(sp * heads * 8), np.stack([m, e.sum(1, dtype=np.float32)], 1).astype(np.float32))


def _combine(mem, part, ml, n, out, heads, dim, split_rows=SPLIT_ROWS):
    splits = -(-n // split_rows)
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
# workspace is per entry (split_workspace_batch). With rope_dim > 0 its rope query is
# q_rope + e * heads * rope_dim and its slot's rope keys rope_keys + slot * slot_rows * rope_dim
# (BF16 elements). Padding entries read and write nothing.


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


# ptx/sparse_mla.cu MLA_MAX_ROPE: the RoPE width is a whole number of the split pair's 16-wide
# k-steps, at most 128; for another width the kernels (and so the twins) write nothing.
MAX_ROPE_DIM = 128


def rope_dim_ok(rope_dim: int) -> bool:
    """0 (NoPE) or a multiple of 16 up to MAX_ROPE_DIM."""
    return 0 <= rope_dim <= MAX_ROPE_DIM and rope_dim % 16 == 0


def _entry_rope(q_rope, rope_keys, e, slot, slot_rows, heads, rope_dim):
    """Entry e's rope query and its slot's rope keys (BF16 element offsets)."""
    return q_rope.offset(e * heads * rope_dim * 2), rope_keys.offset(slot * slot_rows * rope_dim * 2)


@declare(
    "sparse_mla",
    "sparse_mla_attend_batch",
    [
        ("q", PTR),
        ("q_rope", PTR),
        ("cache", PTR),
        ("scales", PTR),
        ("rope_keys", PTR),
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
        ("rope_dim", U32),
        ("block_size", U32),
        ("scale", F32),
    ],
    writes=("out",),
)
def SPARSE_MLA_ATTEND_BATCH(
    mem,
    q,
    q_rope,
    cache,
    scales,
    rope_keys,
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
    rope_dim,
    block_size,
    scale,
):
    if not rope_dim_ok(rope_dim):
        return
    bps = _blocks_per_slot(slot_rows, block_size)
    for e, slot, n in _batch_entries(mem, entries, m, count, sel_cap):
        table, sel = tables.offset(slot * bps * 4), selected.offset(e * sel_cap * 4)
        _, c = _gather_n(mem, cache, scales, table, sel, n, dim, block_size)
        qr, kr = _entry_rope(q_rope, rope_keys, e, slot, slot_rows, heads, rope_dim)
        rope = _rope_term(mem, qr, kr, sel, n, heads, rope_dim)
        _attend(
            mem, q.offset(e * heads * dim * 4), n, c, rope, out.offset(e * heads * dim * 2), heads, dim, scale
        )


# The arguments of the partial and merge launches (the wide pair adds split_rows to each).
_PARTIAL_ARGS = (
    ("q", PTR),
    ("q_rope", PTR),
    ("cache", PTR),
    ("scales", PTR),
    ("rope_keys", PTR),
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
    ("rope_dim", U32),
    ("block_size", U32),
    ("scale", F32),
)
_COMBINE_ARGS = (
    ("part", PTR),
    ("ml", PTR),
    ("count", PTR),
    ("out", PTR),
    ("entries", PTR),
    ("m", U32),
    ("sel_cap", U32),
    ("heads", U32),
    ("dim", U32),
)


def _partial_entries(
    mem,
    q,
    q_rope,
    cache,
    scales,
    rope_keys,
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
    rope_dim,
    block_size,
    scale,
    splits,
    split_rows,
):
    """Each entry's partials over splits of split_rows rows into its workspace of `splits` splits
    (both pairs' twin)."""
    bps = _blocks_per_slot(slot_rows, block_size)
    for e, slot, n in _batch_entries(mem, entries, m, count, sel_cap):
        table, sel = tables.offset(slot * bps * 4), selected.offset(e * sel_cap * 4)
        _, c = _gather_n(mem, cache, scales, table, sel, n, dim, block_size)
        qr, kr = _entry_rope(q_rope, rope_keys, e, slot, slot_rows, heads, rope_dim)
        _partial(
            mem,
            q.offset(e * heads * dim * 4),
            n,
            c,
            _rope_term(mem, qr, kr, sel, n, heads, rope_dim),
            part.offset(e * splits * heads * dim * 4),
            ml.offset(e * splits * heads * 8),
            heads,
            dim,
            scale,
            split_rows,
        )


def _combine_entries(mem, part, ml, count, out, entries, m, sel_cap, heads, dim, splits, split_rows):
    """Each entry's merge of its `splits` splits of split_rows rows (both pairs' twin)."""
    for e, _, n in _batch_entries(mem, entries, m, count, sel_cap):
        _combine(
            mem,
            part.offset(e * splits * heads * dim * 4),
            ml.offset(e * splits * heads * 8),
            n,
            out.offset(e * heads * dim * 2),
            heads,
            dim,
            split_rows,
        )


@declare(
    "sparse_mla",
    "sparse_mla_partial_batch",
    list(_PARTIAL_ARGS),
    writes=("part", "ml"),
    pdl=True,
    releases=True,  # right after its wait: the merge launches during its tail
)
def SPARSE_MLA_PARTIAL_BATCH(
    mem,
    q,
    q_rope,
    cache,
    scales,
    rope_keys,
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
    rope_dim,
    block_size,
    scale,
):
    """Each entry's per-split partial attention (unnormalised output and its (max, sum)) into its
    workspace (split_workspace_batch)."""
    if not rope_dim_ok(rope_dim):
        return
    _partial_entries(
        mem,
        q,
        q_rope,
        cache,
        scales,
        rope_keys,
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
        rope_dim,
        block_size,
        scale,
        batch_splits(sel_cap),
        SPLIT_ROWS,
    )


@declare(
    "sparse_mla",
    "sparse_mla_combine_batch",
    list(_COMBINE_ARGS),
    writes=("out",),
    pdl=True,
    releases=True,  # right after its wait: wv launches during its tail
)
def SPARSE_MLA_COMBINE_BATCH(mem, part, ml, count, out, entries, m, sel_cap, heads, dim):
    """The exact merge of each entry's splits into out + e * heads * dim."""
    _combine_entries(
        mem, part, ml, count, out, entries, m, sel_cap, heads, dim, batch_splits(sel_cap), SPLIT_ROWS
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


def partial_smem(dim: int, rope_dim: int = 0) -> int:
    """ptx/sparse_mla.cu sparse_mla_partial_batch: C [64][dim+8] and q hi/lo [16][dim+8] BF16, scores
    [16][68] f32, p hi/lo [16][72] BF16, 64 slots and scales, 16 (m, l); with a RoPE part also the
    64 selected rows (its operands live in registers)."""
    dp = dim + 8
    return (
        2 * SPLIT_ROWS * dp
        + 4 * HEAD_TILE * dp
        + 4 * HEAD_TILE * 68
        + 4 * HEAD_TILE * 72
        + 8 * SPLIT_ROWS
        + 8 * HEAD_TILE
        + (4 * SPLIT_ROWS if rope_dim else 0)
    )


# Grid dims y and z of a launch (the batched kernels put the entry there).
MAX_GRID_YZ = 65535


def _check_batch(what: str, m: int) -> None:
    if not 1 <= m <= MAX_GRID_YZ:
        raise ValueError(f"{what}: m={m} entries outside 1..{MAX_GRID_YZ}")


def _rope_args(what: str, q, q_rope, rope_keys, rope_dim: int):
    """The (q_rope, rope_keys) pointers a launch passes: the caller's for rope_dim > 0; for NoPE
    (rope_dim 0, neither read) q in their place, as the launch wants a valid pointer."""
    if rope_dim == 0:
        if q_rope is not None or rope_keys is not None:
            raise ValueError(f"{what}: q_rope / rope_keys given with rope_dim 0 (they would not be read)")
        return q, q
    if not rope_dim_ok(rope_dim):
        raise ValueError(f"{what}: rope_dim {rope_dim} is not 0 or a multiple of 16 up to {MAX_ROPE_DIM}")
    if q_rope is None or rope_keys is None:
        raise ValueError(f"{what}: rope_dim {rope_dim} needs both q_rope and rope_keys")
    return q_rope, rope_keys


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
    q_rope=None,
    rope_keys=None,
    rope_dim=0,
    stream=None,
):
    """The split attention for ``m`` batch entries (model/kernels/batch.py): partials over grid
    ``(batch_splits(sel_cap), ceil(heads / 16), m)``, then the merge over ``(heads, ceil(dim / 128),
    m)``. Entry e: absorbed query ``q + e * heads * dim * 4`` (f32 ``[heads][dim]``), selection
    ``selected + e * sel_cap * 4`` with ``count[e]`` rows (at most ``sel_cap``), latent rows through
    its slot's block table (``tables + slot * ceil(slot_rows / block_size) * 4``), workspace
    ``part`` / ``ml`` per entry (``split_workspace_batch``), output ``out + e * heads * dim * 2``
    (BF16). The RoPE part (``rope_dim`` 0, or a multiple of 16 up to 128): rope query
    ``q_rope + e * heads * rope_dim * 2`` (BF16 ``[heads][rope_dim]``), the rope key of selected row
    r ``rope_keys + (slot * slot_rows + r) * rope_dim * 2`` (BF16); both None for NoPE. Each entry's
    output is that of a launch of its entry alone, bit for bit. Padding entries read and write
    nothing (their output rows keep what they held)."""
    if not split_supported(dim, sel_cap):
        raise ValueError(f"sparse_mla_split_batch: dim {dim} / {sel_cap} rows outside the split kernels")
    _check_batch("sparse_mla_split_batch", m)
    q_rope, rope_keys = _rope_args("sparse_mla_split_batch", q, q_rope, rope_keys, rope_dim)
    launch(
        gpu,
        gpu.kernel(*SPARSE_MLA_PARTIAL_BATCH.key),
        (batch_splits(sel_cap), -(-heads // HEAD_TILE), m),
        256,
        q,
        q_rope,
        cache,
        scales,
        rope_keys,
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
        rope_dim,
        block_size,
        scale,
        smem=partial_smem(dim, rope_dim),
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
    q_rope=None,
    rope_keys=None,
    rope_dim=0,
    stream=None,
):
    """The one-pass attention (the fallback for shapes ``split_supported`` refuses) for ``m`` entries,
    grid ``(heads, m)``, addressed as ``sparse_mla_split_batch`` (the RoPE part too); no workspace."""
    if dim > 1024:
        raise ValueError(f"sparse_mla_attend_batch: dim {dim} > 1024 (the kernel's per-lane registers)")
    _check_batch("sparse_mla_attend_batch", m)
    q_rope, rope_keys = _rope_args("sparse_mla_attend_batch", q, q_rope, rope_keys, rope_dim)
    launch(
        gpu,
        gpu.kernel(*SPARSE_MLA_ATTEND_BATCH.key),
        (heads, m),
        256,
        q,
        q_rope,
        cache,
        scales,
        rope_keys,
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
        rope_dim,
        block_size,
        scale,
        stream=stream,
    )


# ---- the wide pair: all heads of an entry per block, longer splits (ptx/sparse_mla.cu) -----------
# sparse_mla_partial_wide_batch takes a split of ``split_rows`` rows (64 to 256, a multiple of 64)
# for 64 heads at once, its 64-row tiles folded with an online softmax: every selected row is
# gathered once per 64 heads (not per 16) and the partials are split_rows / 64 times fewer.
# sparse_mla_combine_wide_batch merges them as sparse_mla_combine_batch does. The per-split result
# is the split pair's function with another split length, so the twins are _partial and _combine
# at split_rows. Which form (and split length) a proposer uses is fixed by its configuration
# (``auto_split_rows``), never by a batch's size: a sequence's bits depend on the form.
WIDE_HEADS = 64
WIDE_MAX_SPLIT_ROWS = 256
# The rope query's fragments of the wide kernel: up to 64 rope dims (the models' width); a wider
# rope part keeps the split pair.
WIDE_MAX_ROPE_DIM = 64
# Fixed shared-memory pitches of the wide kernel (BF16 elements): the widest latent and rope rows.
_WIDE_DP = 512 + 8
_WIDE_RP = WIDE_MAX_ROPE_DIM + 8


def wide_split_rows_ok(split_rows: int) -> bool:
    """A split length the wide kernel takes: a multiple of 64 from 64 to WIDE_MAX_SPLIT_ROWS."""
    return (
        not isinstance(split_rows, bool)
        and isinstance(split_rows, int)
        and split_rows % SPLIT_ROWS == 0
        and SPLIT_ROWS <= split_rows <= WIDE_MAX_SPLIT_ROWS
    )


def wide_rope_dim_ok(rope_dim: int) -> bool:
    """0 (NoPE) or a multiple of 16 up to WIDE_MAX_ROPE_DIM."""
    return 0 <= rope_dim <= WIDE_MAX_ROPE_DIM and rope_dim % 16 == 0


def _wide_dim_ok(dim: int) -> bool:
    return dim % 16 == 0 and 16 <= dim <= 512


def wide_supported(dim: int, rope_dim: int) -> bool:
    """Shapes the wide pair takes: dim a multiple of 16 up to 512, rope_dim wide_rope_dim_ok."""
    return _wide_dim_ok(dim) and wide_rope_dim_ok(rope_dim)


def wide_splits(sel_cap: int, split_rows: int) -> int:
    """Partials per entry of the wide pair: a selection of at most sel_cap rows."""
    return max(-(-sel_cap // split_rows), 1)


def wide_workspace(heads: int, dim: int, sel_cap: int, split_rows: int) -> tuple[int, int]:
    """Bytes of (part, ml) per entry of the wide pair (entry e's at e times these)."""
    splits = wide_splits(sel_cap, split_rows)
    return splits * heads * dim * 4, splits * heads * 8


def wide_smem(rope_dim: int, split_rows: int) -> int:
    """ptx/sparse_mla.cu sparse_mla_partial_wide_batch: q hi/lo [64][520] and C [64][520] BF16, p
    hi/lo [64][72] BF16, the two warps' maxima [2][64] f32, the split's slots and scales; with a
    RoPE part also the rope keys' tile [64][72] BF16 and the split's rows."""
    base = 2 * WIDE_HEADS * _WIDE_DP * 2 + SPLIT_ROWS * _WIDE_DP * 2 + 2 * WIDE_HEADS * 72 * 2
    rope = SPLIT_ROWS * _WIDE_RP * 2 + 4 * split_rows if rope_dim else 0
    return base + 8 * split_rows + 2 * WIDE_HEADS * 4 + rope


# The auto choice per proposer size (ProposerOptions.attention_split_rows None). Proposers of 16 or
# more sequences take the wide pair at 256-row splits: a full batch of 16 already fills the chip
# (16 x 2048 rows / 256 = 128 blocks, one per SM), and at 64 and 256 sequences the split pair's
# repeated gathers and 4 MB of partials per sequence are where its time went. Smaller proposers
# keep the split pair, whose one-sequence latency is tuned (a lone sequence of a wide proposer
# makes only 2048 / 256 = 8 blocks). Measured (H200, GLM-5.3-Flash, a 256-sequence proposer,
# BENCHMARKS.md "Selection, attention and head at scale"): B = 256 16.5 ms at 256 rows, 17.4 at
# 128, 19.7 with the split pair; B = 1 1.45, 1.41 and 1.34 ms. The launch alone at m = 16 is 2.3x
# faster at 256 rows than the split pair; 4..15 sequences were not measured in the proposer.
AUTO_WIDE_MIN_SEQUENCES = 16
AUTO_WIDE_SPLIT_ROWS = 256


def auto_split_rows(max_sequences: int) -> int:
    """0 (the split pair) or the wide pair's split length for a proposer of max_sequences."""
    return AUTO_WIDE_SPLIT_ROWS if max_sequences >= AUTO_WIDE_MIN_SEQUENCES else 0


@declare(
    "sparse_mla",
    "sparse_mla_partial_wide_batch",
    [*_PARTIAL_ARGS, ("split_rows", U32)],
    writes=("part", "ml"),
    pdl=True,
    releases=True,  # right after its wait: the merge launches during its tail
)
def SPARSE_MLA_PARTIAL_WIDE_BATCH(
    mem,
    q,
    q_rope,
    cache,
    scales,
    rope_keys,
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
    rope_dim,
    block_size,
    scale,
    split_rows,
):
    """Each entry's per-split partial attention over splits of split_rows rows (unnormalised output
    [split][head][dim] and its (max, sum) per split and head) into its workspace (wide_workspace).
    For a split length, rope_dim or dim the kernel does not take it writes nothing, as the kernel."""
    if not (wide_split_rows_ok(split_rows) and wide_rope_dim_ok(rope_dim) and _wide_dim_ok(dim)):
        return
    _partial_entries(
        mem,
        q,
        q_rope,
        cache,
        scales,
        rope_keys,
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
        rope_dim,
        block_size,
        scale,
        wide_splits(sel_cap, split_rows),
        split_rows,
    )


@declare(
    "sparse_mla",
    "sparse_mla_combine_wide_batch",
    [*_COMBINE_ARGS, ("split_rows", U32)],
    writes=("out",),
    pdl=True,
    releases=True,  # right after its wait: wv launches during its tail
)
def SPARSE_MLA_COMBINE_WIDE_BATCH(mem, part, ml, count, out, entries, m, sel_cap, heads, dim, split_rows):
    """The exact merge of each entry's wide splits into out + e * heads * dim."""
    if not (wide_split_rows_ok(split_rows) and _wide_dim_ok(dim)):
        return
    splits = wide_splits(sel_cap, split_rows)
    _combine_entries(mem, part, ml, count, out, entries, m, sel_cap, heads, dim, splits, split_rows)


def sparse_mla_wide_batch(
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
    split_rows,
    q_rope=None,
    rope_keys=None,
    rope_dim=0,
    stream=None,
):
    """The wide attention for ``m`` batch entries: partials over grid ``(wide_splits(sel_cap,
    split_rows), ceil(heads / 64), m)`` (one block per SM: ``wide_smem``), then the merge over
    ``(ceil(heads / 2), m)``. Addressed as ``sparse_mla_split_batch`` (the RoPE part too), with the
    workspace of ``wide_workspace(heads, dim, sel_cap, split_rows)`` per entry. ``split_rows``: a
    multiple of 64 from 64 to 256, the proposer's choice (never the batch's: a sequence's bits
    depend on it). Each entry's output is that of a launch of its entry alone, bit for bit;
    padding entries read and write nothing."""
    if not wide_split_rows_ok(split_rows):
        raise ValueError(
            f"sparse_mla_wide_batch: split_rows {split_rows!r} is not a multiple of {SPLIT_ROWS} "
            f"from {SPLIT_ROWS} to {WIDE_MAX_SPLIT_ROWS}"
        )
    if not _wide_dim_ok(dim):
        raise ValueError(f"sparse_mla_wide_batch: dim {dim} is not a multiple of 16 from 16 to 512")
    _check_batch("sparse_mla_wide_batch", m)
    q_rope, rope_keys = _rope_args("sparse_mla_wide_batch", q, q_rope, rope_keys, rope_dim)
    if not wide_rope_dim_ok(rope_dim):
        raise ValueError(
            f"sparse_mla_wide_batch: rope_dim {rope_dim} is past the wide kernel's {WIDE_MAX_ROPE_DIM} "
            "(the split pair takes it)"
        )
    launch(
        gpu,
        gpu.kernel(*SPARSE_MLA_PARTIAL_WIDE_BATCH.key),
        (wide_splits(sel_cap, split_rows), -(-heads // WIDE_HEADS), m),
        256,
        q,
        q_rope,
        cache,
        scales,
        rope_keys,
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
        rope_dim,
        block_size,
        scale,
        split_rows,
        smem=wide_smem(rope_dim, split_rows),
        stream=stream,
    )
    launch(
        gpu,
        gpu.kernel(*SPARSE_MLA_COMBINE_WIDE_BATCH.key),
        (-(-heads // 2), m),
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
        split_rows,
        stream=stream,
    )
