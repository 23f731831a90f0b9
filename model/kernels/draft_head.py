"""The draft's exchange key and commit.

A rank's (max logit, global index) becomes one u64: the order-preserving bits of the f32 logit in
the high word, ``0xFFFFFFFF - index`` in the low word. A u64 MAX all-reduce over ranks then picks
the larger logit, and on a tie the lower index, which is the lower rank since vocabulary shards are
contiguous by rank: exactly the unsharded argmax, identical on every rank. CUDA: ptx/draft_head.cu.

On one rank (or a head every rank sweeps whole) ``head_argmax_{bf16,fp8}_batch`` (or
``head_argmax_fp8_mma``, the FP8 head on tensor cores) do the head GEMV, the argmax and the commit
in one launch: each block folds its rows' best key into a u64 per row with atomicMax and the last
block commits, which also saves a separate argmax's second read of the logits. The sharded head
runs runtime.kernels' gemv and argmax per vocabulary shard, then ``argmax_pack_batch``, the MAX
all-reduce and ``draft_commit_batch``.

Non-finite logits: NaN compares below every number (its key's high word is 0), so a draft is always
a valid index (every logit NaN gives the lowest). Every commit takes a flag, one byte per entry it sets when
the winning logit is not finite (``NONFINITE_NAN``: no logit is a number; ``NONFINITE_INF``: the
largest is infinite) and leaves alone otherwise; the proposer reads it back with the drafts.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16, FP8
from runtime.kernel import PTR, U32, declare
from runtime.kernels import gemv_fp8w as gemv_fp8w_mod
from runtime.kernels.argmax_bf16 import argmax_ref
from runtime.kernels.gemv_bf16 import gemv_bf16_ref
from runtime.kernels.gemv_fp8w import gemv_fp8w_ref
from runtime.launch import grid_stride_blocks, launch

from .batch import ENTRY_BYTES, MAX_ROWS, check_rows, is_pad, read_entries

# What a commit stores in its flag byte (ptx/draft_head.cu key_nonfinite); 0 is never stored.
NONFINITE_NAN = 1
NONFINITE_INF = 2
_KEY_POS_INF, _KEY_NEG_INF = 0xFF80_0000, 0x007F_FFFF  # ordered_bits(+inf), ordered_bits(-inf)


def ordered_bits(v: np.float32) -> int:
    """Monotone u32 image of an f32 (ordered_key in ptx/model_common.cuh). -0.0 counts as +0.0
    (they tie in the unsharded argmax, so the lower index must win, not the sign bit) and NaN as 0,
    below -inf (a NaN loses to every number, and NaNs tie-break by index)."""
    v = np.float32(v)
    if np.isnan(v):
        return 0
    if v == 0:
        v = np.float32(0.0)
    b = int(np.array([v], np.float32).view(np.uint32)[0])
    return (b ^ 0x8000_0000) if b < 0x8000_0000 else (~b & 0xFFFF_FFFF)


def pack_key(val: float, index: int) -> int:
    return (ordered_bits(np.float32(val)) << 32) | (0xFFFF_FFFF - int(index))


def unpack_index(key: int) -> int:
    """The index a key commits; the zero key (no candidate: an empty head) commits 0."""
    return 0xFFFF_FFFF - (key & 0xFFFF_FFFF) if key else 0


def key_nonfinite(key: int) -> int:
    """0 when the winning key's logit is a number, else the flag code a commit stores."""
    hi = key >> 32
    if hi == 0:
        return NONFINITE_NAN
    return NONFINITE_INF if hi in (_KEY_POS_INF, _KEY_NEG_INF) else 0


def _raise_flag(mem, flag, key: int) -> None:
    code = key_nonfinite(key)
    if code:
        mem.write(flag, np.array([code], np.uint8))


# ptx/draft_head.cu: the BF16 head at m = 1, 8 warps x 2 rows per block.
HEAD_ROWS_PER_BLOCK_BF16 = 16


# ---- the head over a batch ------------------------------------------------------------------------
#
# ptx/draft_head.cu (head_argmax_{fp8,bf16}_batch, argmax_pack_batch, draft_commit_batch) and the
# batch convention of model/kernels/batch.py. Per live entry e of a launch of m (1..256): row e of
# x [m][k] gives row e of the logits [m][n] and its argmax; the draft is stored in word 2 of entry e
# (the token the next draft embeds) and in drafts[e * kmax + draft_index]; with publish,
# drafts[e * kmax + 0 .. draft_index] are copied to host_drafts at the same offsets (mapped host
# memory: the step's one copy back); a non-finite winner raises byte flags[e * 4 + flag_byte]. A
# padding entry (slot PAD_SLOT) writes none of these; its logits row is scratch.
#
# Batch invariance: every logit's arithmetic depends on its row and its weight row alone (see
# ptx/fp8_batch.cuh), so a row's logits, draft and flag are bit-identical whatever the batch, and
# identical to a launch of that row alone. The twins use dot_rows (runtime.host_math), whose
# element (i, j) depends on x[i] and w[j] alone, so they are batch-invariant exactly too.


def _batch_commit(
    mem, keys: list[int], entries, drafts, draft_index, kmax, host_drafts, publish, m, flags, flag_byte
):
    """The commit of every live entry e < m from its key keys[e] (the module docstring's rules)."""
    ent = read_entries(mem, entries, m)
    for e in range(m):
        if is_pad(ent[e]):
            continue
        key = keys[e]
        _raise_flag(mem, flags.offset(e * 4 + flag_byte), key)
        t = np.array([unpack_index(key)], np.uint32)
        mem.write(entries.offset(e * ENTRY_BYTES + 8), t)
        row = drafts.offset(e * kmax * 4)
        mem.write(row.offset(draft_index * 4), t)
        if publish:
            mem.write(host_drafts.offset(e * kmax * 4), mem.read(row, np.uint32, draft_index + 1))


_HEAD_BATCH_TAIL = [
    ("logits", PTR),
    ("keys", PTR),
    ("counter", PTR),
    ("entries", PTR),
    ("drafts", PTR),
    ("draft_index", U32),
    ("kmax", U32),
    ("host_drafts", PTR),
    ("publish", U32),
    ("m", U32),
    ("n", U32),
    ("k", U32),
    ("flags", PTR),
    ("flag_byte", U32),
    ("tiles", U32),
]
_HEAD_BATCH_WRITES = ("logits", "keys", "counter", "entries", "drafts", "host_drafts", "flags")


def _head_batch(
    mem,
    logits_of,
    logits,
    keys,
    counter,
    entries,
    drafts,
    draft_index,
    kmax,
    host_drafts,
    publish,
    m,
    n,
    flags,
    flag_byte,
    tiles,
    tile_rows=gemv_fp8w_mod.BATCH_TILE_ROWS,
):
    """The batched heads' twin: ``logits_of(rows)`` gives the BF16 logits [len(rows), n] of those
    rows of x. Only live rows are computed and stored (a padding row's logits are scratch). A tile
    count the kernel refuses (more than ``tile_rows`` rows in a tile) writes nothing."""
    if not (1 <= m <= MAX_ROWS and 1 <= tiles <= m and -(-m // tiles) <= tile_rows):
        mem.write(counter, np.zeros(1, np.uint32))  # the kernel only takes part in the handshake
        return
    ent = read_entries(mem, entries, m)
    live = [e for e in range(m) if not is_pad(ent[e])]
    best = [0] * m
    if live:
        with np.errstate(over="ignore", invalid="ignore"):
            y = logits_of(live)
        for j, e in enumerate(live):
            mem.write(logits.offset(e * n * 2), y[j])
            idx, val = argmax_ref(y[j])
            best[e] = pack_key(val, idx) if idx != 0xFFFF_FFFF else 0
    _batch_commit(mem, best, entries, drafts, draft_index, kmax, host_drafts, publish, m, flags, flag_byte)
    mem.write(keys, np.zeros(m, np.uint64))
    mem.write(counter, np.zeros(1, np.uint32))


# Both release their dependents right after their wait (the next draft's batched embedding streams
# its weights in the head's tail).
@declare(
    "draft_head",
    "head_argmax_bf16_batch",
    [("w", PTR), ("x", PTR), *_HEAD_BATCH_TAIL],
    writes=_HEAD_BATCH_WRITES,
    pdl=True,
    releases=True,
)
def HEAD_ARGMAX_BF16_BATCH(
    mem,
    w,
    x,
    logits,
    keys,
    counter,
    entries,
    drafts,
    draft_index,
    kmax,
    host_drafts,
    publish,
    m,
    n,
    k,
    flags,
    flag_byte,
    tiles,
):
    """The BF16 head for every live entry of a batch (see the section comment)."""

    def logits_of(rows):
        return gemv_bf16_ref(mem.view(w, BF16, (n, k)), mem.read(x, BF16, (m, k))[rows])

    _head_batch(
        mem,
        logits_of,
        logits,
        keys,
        counter,
        entries,
        drafts,
        draft_index,
        kmax,
        host_drafts,
        publish,
        m,
        n,
        flags,
        flag_byte,
        tiles,
    )


def _fp8_logits(mem, wq, scale, x, m: int, n: int, k: int):
    """The FP8 heads' logits of some rows of x (the f32 math both FP8 kernels' twins share)."""

    def logits_of(rows):
        xs = mem.read(x, BF16, (m, k))[rows]
        return gemv_fp8w_ref(mem.view(wq, FP8, (n, k)), mem.read(scale, np.float32, n), xs)

    return logits_of


@declare(
    "draft_head",
    "head_argmax_fp8_batch",
    [("wq", PTR), ("scale", PTR), ("x", PTR), *_HEAD_BATCH_TAIL],
    writes=_HEAD_BATCH_WRITES,
    pdl=True,
    releases=True,
)
def HEAD_ARGMAX_FP8_BATCH(
    mem,
    wq,
    scale,
    x,
    logits,
    keys,
    counter,
    entries,
    drafts,
    draft_index,
    kmax,
    host_drafts,
    publish,
    m,
    n,
    k,
    flags,
    flag_byte,
    tiles,
):
    """The FP8 head for every live entry of a batch (see the section comment)."""

    logits_of = _fp8_logits(mem, wq, scale, x, m, n, k)
    _head_batch(
        mem,
        logits_of,
        logits,
        keys,
        counter,
        entries,
        drafts,
        draft_index,
        kmax,
        host_drafts,
        publish,
        m,
        n,
        flags,
        flag_byte,
        tiles,
    )


def head_batch_launch(gpu, fp8: bool, m: int, n: int, k: int) -> tuple[int, int, int]:
    """(grid, dynamic shared bytes, tiles) of head_argmax_{fp8,bf16}_batch. One row (m = 1): the FP8
    head grid-strides over its 16-row groups with x staged as f32, the BF16 head takes one 16-row
    group per block with x from L2. Otherwise balanced tiles of at most four
    rows, x staged per tile, blocks grid-striding over the groups (runtime.kernels.gemv_fp8w)."""
    decl = HEAD_ARGMAX_FP8_BATCH if fp8 else HEAD_ARGMAX_BF16_BATCH
    tiles, smem = gemv_fp8w_mod.batch_tiling(m, k, 16 if fp8 else 8)
    if tiles == 1 and m == 1 and not fp8:
        return max(1, -(-n // HEAD_ROWS_PER_BLOCK_BF16)), 0, 1
    return gemv_fp8w_mod.batch_grid(gpu, gpu.kernel(*decl.key), tiles, n, smem), smem, tiles


def _check_batch(m: int, n: int, k: int, draft_index: int, kmax: int, flag_byte: int, what: str) -> None:
    check_rows(what, m)
    if n < 1 or k < 0:
        raise ValueError(f"{what}: bad shape n={n}, k={k}")
    if not 0 <= draft_index < kmax:
        raise ValueError(f"{what}: draft_index={draft_index} outside 0..kmax-1 (kmax={kmax})")
    if not 0 <= flag_byte < 4:
        raise ValueError(f"{what}: flag_byte={flag_byte}; an entry's flags are 4 bytes")


def head_argmax_batch(
    gpu,
    *,
    w,
    scale,
    x,
    logits,
    keys,
    counter,
    entries,
    drafts,
    draft_index,
    kmax,
    host_drafts,
    publish,
    m,
    n,
    k,
    flags,
    flag_byte,
    stream=None,
):
    """The single-rank head for the m entries at ``entries`` (u32 [m][4], model/kernels/batch.py):
    the FP8 head when ``scale`` is given (w its FP8 copy, one f32 scale per row), else the BF16
    head. x BF16 [m][k]; logits BF16 [m][n] (scratch; a padding row's may hold anything); keys u64
    [m] and counter u32, zero before and after; drafts and host_drafts u32 [m][kmax]; flags u8
    [m][4]. Per live entry e: the argmax of row e (lowest index on ties, NaN below every number, 0
    if all are NaN) into entries[e].token and drafts[e * kmax + draft_index]; with ``publish``
    drafts[e * kmax + 0 .. draft_index] copied to host_drafts; byte flag_byte of entry e's flags
    raised (NONFINITE_NAN / NONFINITE_INF) when its winning logit is not finite. Padding entries
    write nothing. A row's results are bit-identical whatever m and whatever the other rows (so to a
    launch of that row alone); the weights are read from HBM about once per launch."""
    _check_batch(m, n, k, draft_index, kmax, flag_byte, "head_argmax_batch")
    fp8 = scale is not None
    grid, smem, tiles = head_batch_launch(gpu, fp8, m, n, k)
    decl = HEAD_ARGMAX_FP8_BATCH if fp8 else HEAD_ARGMAX_BF16_BATCH
    weights = (w, scale) if fp8 else (w,)
    launch(
        gpu,
        gpu.kernel(*decl.key),
        grid,
        256,
        *weights,
        x,
        logits,
        keys,
        counter,
        entries,
        drafts,
        draft_index,
        kmax,
        host_drafts,
        int(bool(publish)),
        m,
        n,
        k,
        flags,
        flag_byte,
        tiles,
        smem=smem,
        stream=stream,
    )


@declare(
    "draft_head",
    "argmax_pack_batch",
    [("idx", PTR), ("val", PTR), ("keys", PTR), ("v0", U32), ("m", U32)],
    writes=("keys",),
)
def ARGMAX_PACK_BATCH(mem, idx, val, keys, v0, m):
    """keys[e] = pack_key(val[e], idx[e] + v0) for every row e < m, 0 for an empty shard's index
    0xFFFFFFFF (padding rows too: the commit skips them). An all-NaN shard (index 0, value NaN)
    packs high word 0: it loses to any number elsewhere."""
    if m == 0:
        return
    ii = mem.read(idx, np.uint32, m)
    vv = mem.read(val, np.float32, m)
    out = [0 if int(i) == 0xFFFF_FFFF else pack_key(v, (int(i) + v0) & 0xFFFF_FFFF) for i, v in zip(ii, vv)]
    mem.write(keys, np.array(out, np.uint64))


@declare(
    "draft_head",
    "draft_commit_batch",
    [
        ("keys", PTR),
        ("entries", PTR),
        ("drafts", PTR),
        ("draft_index", U32),
        ("kmax", U32),
        ("host_drafts", PTR),
        ("publish", U32),
        ("m", U32),
        ("flags", PTR),
        ("flag_byte", U32),
    ],
    writes=("entries", "drafts", "host_drafts", "flags"),
)
def DRAFT_COMMIT_BATCH(
    mem, keys, entries, drafts, draft_index, kmax, host_drafts, publish, m, flags, flag_byte
):
    """The commit of every live entry e < m from keys[e] (the all-reduced keys)."""
    if m == 0:
        return
    ks = [int(v) for v in mem.read(keys, np.uint64, m)]
    _batch_commit(mem, ks, entries, drafts, draft_index, kmax, host_drafts, publish, m, flags, flag_byte)


def argmax_pack_batch(gpu, idx, val, keys, v0, m, stream=None):
    """keys[e] = the exchange key of (idx[e] + v0, val[e]) for the m rows of argmax_bf16_batch."""
    check_rows("argmax_pack_batch", m)
    launch(gpu, gpu.kernel(*ARGMAX_PACK_BATCH.key), 1, 256, idx, val, keys, v0, m, stream=stream)


def draft_commit_batch(
    gpu, *, keys, entries, drafts, draft_index, kmax, host_drafts, publish, m, flags, flag_byte, stream=None
):
    """Per live entry e < m, the commit of keys[e] (u64 [m], all-reduced over the vocabulary
    shards): entries[e].token, drafts[e * kmax + draft_index], with ``publish`` drafts
    [e * kmax + 0 .. draft_index] into host_drafts, and the flag byte flags[e * 4 + flag_byte] as
    head_argmax_batch stores them. Padding entries write nothing."""
    _check_batch(m, 1, 0, draft_index, kmax, flag_byte, "draft_commit_batch")
    launch(
        gpu,
        gpu.kernel(*DRAFT_COMMIT_BATCH.key),
        1,
        256,
        keys,
        entries,
        drafts,
        draft_index,
        kmax,
        host_drafts,
        int(bool(publish)),
        m,
        flags,
        flag_byte,
        stream=stream,
    )


# ---- the tensor-core heads ----------------------------------------------------------------------------
#
# ptx/draft_head.cu head_argmax_fp8_mma (and head_argmax_fp8_mma_v1, the kernel it replaced, kept
# for comparison): head_argmax_fp8_batch's contract, its logits from mma.sync.m16n8k16 (the FP8
# weights widened to BF16 in registers, f32 accumulation, the row scale after the sum). Tiles of up
# to MMA_TILE_ROWS rows (eight column groups of the MMA's N = 8, each A fragment applied to all of
# them), so the weights are read and widened ceil(m / 64) times per launch. x is staged per tile
# in shared memory, all of k or double-buffered k-slices (mma_x_slice / mma_v1_x_slice).
# Not the CUDA-core heads' bits (the tensor core sums each k16 step its own way): the twin is the
# same f32 math, which the GPU test holds it to within the GEMV bound; rows are bit-identical across
# batches (each MMA output column depends on its own x row only, and the MMAs over k run in one
# order whatever the tile or the slicing), and the two kernels give the same bits (the same MMAs in
# the same order; they differ in how the work is spread and staged: the .cu's comment).
#
# head_argmax_fp8_mma: 8 warps x 32 weight rows a block (one block an SM), x staged superblock-major
# in up to MMA_X_SMEM_MAX bytes. v1: 8 warps x 16 rows (two blocks an SM), x row-major in up to
# MMA_V1_X_SMEM_MAX bytes. One exception to "the same bits": an E4M3 NaN code (0x7F / 0xFF) widens
# to +-480 in head_argmax_fp8_mma, NaN in v1 and the twin; quantize_fp8 gives none for finite weights.

MMA_TILE_ROWS = 64
MMA_GROUP_ROWS = 256  # 8 warps x 32 weight rows
MMA_X_SMEM_MAX = 210 * 1024  # 13 superblocks a slice at 64 rows; the static 4 KB and one block fit an SM
MMA_V1_GROUP_ROWS = 128  # 8 warps x 16 weight rows
MMA_V1_X_SMEM_MAX = 96 * 1024


def mma_x_slice(k: int, per_row: int) -> tuple[bool, int]:
    """head_argmax_fp8_mma's x staging for ``per_row`` bytes of dynamic shared memory per row of the
    largest tile: (whole, S). Whole: all k // 64 superblocks (128 bytes a row each), staged once
    per block (per_row >= 2k); else two buffers of S = per_row // 256 superblocks a row. S == 0:
    the kernel cannot run (it computes nothing)."""
    nsb = k // 64
    if per_row >= 128 * nsb:
        return True, nsb
    return False, per_row // 256


def mma_tiling(m: int, k: int) -> tuple[int, int]:
    """(tiles, dynamic shared bytes) of head_argmax_fp8_mma: ceil(m / MMA_TILE_ROWS) balanced tiles;
    all of the largest tile's x (2k bytes a row) where it fits MMA_X_SMEM_MAX, else the two slice
    buffers of the most superblocks that fit (mma_x_slice)."""
    tiles = -(-m // MMA_TILE_ROWS)
    rows = -(-m // tiles)
    if rows * 2 * k <= MMA_X_SMEM_MAX:
        return tiles, rows * 2 * k
    return tiles, rows * 256 * (MMA_X_SMEM_MAX // (rows * 256))


def mma_v1_x_slice(k: int, per_row: int) -> tuple[bool, int]:
    """head_argmax_fp8_mma_v1's x staging (rows 2k + 16 or 128 S + 16 bytes apart): (whole, S).
    Whole: per_row >= 2k + 16; else two buffers of S superblocks a row (per_row >= 2 (128 S + 16)).
    S == 0: the kernel cannot run."""
    nsb = k // 64
    if per_row >= 128 * nsb + 16:
        return True, nsb
    return False, (per_row // 2 - 16) // 128 if per_row >= 288 else 0


def mma_v1_tiling(m: int, k: int) -> tuple[int, int]:
    """(tiles, dynamic shared bytes) of head_argmax_fp8_mma_v1: the tiles of mma_tiling; all of the
    largest tile's x (rows of 2k + 16 bytes) where it fits MMA_V1_X_SMEM_MAX, else the two slice
    buffers of the most superblocks that fit (mma_v1_x_slice)."""
    tiles = -(-m // MMA_TILE_ROWS)
    rows = -(-m // tiles)
    whole = 2 * k + 16
    if rows * whole <= MMA_V1_X_SMEM_MAX:
        return tiles, rows * whole
    s = (MMA_V1_X_SMEM_MAX // rows // 2 - 16) // 128
    return tiles, rows * 2 * (128 * s + 16)


def _mma_supported(wq, x, k: int) -> bool:
    return k > 0 and k % 64 == 0 and wq.addr % 16 == 0 and x.addr % 16 == 0


def _head_mma_twin(
    mem,
    wq,
    scale,
    x,
    logits,
    keys,
    counter,
    entries,
    drafts,
    draft_index,
    kmax,
    host_drafts,
    publish,
    m,
    n,
    k,
    flags,
    flag_byte,
    tiles,
):
    """head_argmax_fp8_batch's twin, up to MMA_TILE_ROWS rows per tile; a shape the kernel cannot
    run (k % 64 != 0, an unaligned pointer) computes nothing: every live entry commits the empty key
    (token 0, NONFINITE_NAN), as on the device. Both tensor-core kernels: their bits are the same."""
    tiles_ok = 1 <= m <= MAX_ROWS and 1 <= tiles <= m and -(-m // tiles) <= MMA_TILE_ROWS
    if tiles_ok and not _mma_supported(wq, x, k):
        _batch_commit(
            mem, [0] * m, entries, drafts, draft_index, kmax, host_drafts, publish, m, flags, flag_byte
        )
        mem.write(keys, np.zeros(m, np.uint64))
        mem.write(counter, np.zeros(1, np.uint32))
        return

    logits_of = _fp8_logits(mem, wq, scale, x, m, n, k)
    _head_batch(
        mem,
        logits_of,
        logits,
        keys,
        counter,
        entries,
        drafts,
        draft_index,
        kmax,
        host_drafts,
        publish,
        m,
        n,
        flags,
        flag_byte,
        tiles,
        MMA_TILE_ROWS,
    )


_MMA_ARGS = [("wq", PTR), ("scale", PTR), ("x", PTR), *_HEAD_BATCH_TAIL]
HEAD_ARGMAX_FP8_MMA = declare(
    "draft_head", "head_argmax_fp8_mma", _MMA_ARGS, writes=_HEAD_BATCH_WRITES, pdl=True, releases=True
)(_head_mma_twin)
HEAD_ARGMAX_FP8_MMA_V1 = declare(
    "draft_head", "head_argmax_fp8_mma_v1", _MMA_ARGS, writes=_HEAD_BATCH_WRITES, pdl=True, releases=True
)(_head_mma_twin)


def head_mma_launch(gpu, m: int, n: int, k: int, v1: bool = False) -> tuple[int, int, int]:
    """(grid, dynamic shared bytes, tiles) of head_argmax_fp8_mma (v1: of head_argmax_fp8_mma_v1):
    the tiles' blocks side by side (blockIdx % tiles), each tile's blocks grid-striding over the
    weight groups in rounds of the blocks resident at once."""
    decl = HEAD_ARGMAX_FP8_MMA_V1 if v1 else HEAD_ARGMAX_FP8_MMA
    tiles, smem = mma_v1_tiling(m, k) if v1 else mma_tiling(m, k)
    groups = max(1, -(-n // (MMA_V1_GROUP_ROWS if v1 else MMA_GROUP_ROWS)))
    resident = gpu.resident_blocks(gpu.kernel(*decl.key), 256, smem)
    return tiles * grid_stride_blocks(groups, max(1, resident // tiles)), smem, tiles


def head_argmax_batch_mma(
    gpu,
    *,
    w,
    scale,
    x,
    logits,
    keys,
    counter,
    entries,
    drafts,
    draft_index,
    kmax,
    host_drafts,
    publish,
    m,
    n,
    k,
    flags,
    flag_byte,
    stream=None,
    v1=False,
):
    """head_argmax_batch (FP8 head) through the tensor-core kernel: the same buffers, commit and
    padding rules; k % 64 == 0 and 16-byte aligned w and x. ``v1``: through head_argmax_fp8_mma_v1
    (the same bits; for comparison). Both give every row the bits it has in any other batch, so
    the kernel may be chosen by m."""
    _check_batch(m, n, k, draft_index, kmax, flag_byte, "head_argmax_batch_mma")
    if scale is None:
        raise ValueError("head_argmax_batch_mma: the tensor-core head is the FP8 head (scale is required)")
    if not _mma_supported(w, x, k):
        raise ValueError(f"head_argmax_batch_mma: needs k % 64 == 0 (k={k}) and 16-byte aligned w and x")
    grid, smem, tiles = head_mma_launch(gpu, m, n, k, v1)
    decl = HEAD_ARGMAX_FP8_MMA_V1 if v1 else HEAD_ARGMAX_FP8_MMA
    launch(
        gpu,
        gpu.kernel(*decl.key),
        grid,
        256,
        w,
        scale,
        x,
        logits,
        keys,
        counter,
        entries,
        drafts,
        draft_index,
        kmax,
        host_drafts,
        int(bool(publish)),
        m,
        n,
        k,
        flags,
        flag_byte,
        tiles,
        smem=smem,
        stream=stream,
    )
