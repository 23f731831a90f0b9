"""The MTP block's input half-rows: ``[rmsnorm(embed[t]) * enorm ; rmsnorm(h) * hnorm]``.

The embedding row is read in place from the target's table at a token id held in device memory
(graph replays feed draft i's token to draft i+1 without the host). CUDA: ptx/mtp_input.cu.

``mtp_input_gemv_batch`` (a draft's first kernel) also checks each entry's inputs for the
proposer: it sets the entry's flag byte to ``HIDDEN_NONFINITE`` when the hidden row is not finite (its RMS divisor, computed
anyway for the norm, is NaN or Inf: a NaN or an Inf in the row, or an f32 sum of squares that
overflows), ``|`` ``TOKEN_OUTSIDE`` when the token is not in the vocabulary, and leaves it alone
otherwise.

Both kernels (``mtp_input_gemv_batch``, ``mtp_embed_norm_batch``) take m entries
(model/kernels/batch.py): entry e's token is its word 2, its hidden row the e-th of a dense [m, h]
buffer, its output row the e-th of a dense buffer, its flag byte ``flags + 4 e + flag_byte``. Each
row's arithmetic does not depend on m or the other rows (so it is bit-identical to a launch of that
entry alone); eh_proj is read once for all m. A padding entry's
output row and flag are never written.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16
from runtime.kernel import F32, PTR, U32, Pdl, declare
from runtime.kernels.gemv_bf16 import gemv_bf16_ref
from runtime.kernels.rmsnorm import rmsnorm_ref
from runtime.launch import grid_stride_blocks, launch

from .batch import ENTRY_BYTES, check_rows, is_pad, read_entries

# What mtp_input_gemv_batch stores in an entry's flag byte (bits; 0 is never stored).
HIDDEN_NONFINITE = 1
TOKEN_OUTSIDE = 2


def _embed_norm_rows(mem, table, tokens, enorm, hidden, hnorm, out, rows, vocab, h, eps):
    """out row r = [rmsnorm(table[tokens[r]]) * enorm ; rmsnorm(hidden[r]) * hnorm] ([rows, 2h] BF16);
    a token outside the vocabulary gives a NaN embedding half."""
    toks = mem.read(tokens, np.uint32, rows)
    res = np.empty((rows, 2 * h), BF16)
    e_w, h_w = mem.read(enorm, BF16, h), mem.read(hnorm, BF16, h)
    hid = mem.read(hidden, BF16, (rows, h))
    for r, t in enumerate(toks):
        if t >= vocab:
            res[r, :h] = np.float32(np.nan)  # visible, never an out-of-bounds read
        else:
            res[r, :h] = rmsnorm_ref(mem.read(table.offset(int(t) * h * 2), BF16, h), e_w, eps)
    res[:, h:] = rmsnorm_ref(hid, h_w, eps)
    mem.write(out, res)


def _input_gemv_row(mem, table, token, enorm, hidden, hnorm, w, y, vocab, h, n, eps, flag):
    """y = W @ [rmsnorm(table[*token]) * enorm ; rmsnorm(hidden) * hnorm] for one row (W [n, 2h]):
    _embed_norm_rows (rows = 1) and gemv_bf16 in sequence (the device sums the two half-rows
    separately, within the GEMV's rounding of this). ``flag`` as the module says."""
    t = int(mem.scalar(token, np.uint32))
    x = np.empty(2 * h, BF16)
    hid = mem.read(hidden, BF16, h)
    with np.errstate(over="ignore", invalid="ignore"):
        hf = hid.astype(np.float32)
        divisor = np.sqrt(np.mean(hf * hf, dtype=np.float32) + np.float32(eps))  # rmsnorm_ref's
        bad = (0 if np.isfinite(divisor) else HIDDEN_NONFINITE) | (0 if t < vocab else TOKEN_OUTSIDE)
        if bad:
            mem.write(flag, np.array([bad], np.uint8))
        if t >= vocab:
            x[:h] = np.float32(np.nan)
        else:
            x[:h] = rmsnorm_ref(mem.read(table.offset(t * h * 2), BF16, h), mem.read(enorm, BF16, h), eps)
        x[h:] = rmsnorm_ref(hid, mem.read(hnorm, BF16, h), eps)
        mem.write(y, gemv_bf16_ref(mem.view(w, BF16, (n, 2 * h)), x[None])[0])


# ptx/mtp_input.cu mtp_input_gemv_batch: one row of eh_proj per warp, 8 warps per block, grid-stride over the rows
# with the blocks the device holds at once (gpu.resident_blocks, balanced by grid_stride_blocks),
# so that every block computes the norm prologues once; never more than MTP_INPUT_ROWS_PER_WARP
# rows per warp (the kernel keeps that many hidden-half sums per warp in shared memory). The
# 2h-wide input lives in dynamic smem.
MTP_INPUT_ROWS_PER_WARP = 4


# ---- the batch: m entries (model/kernels/batch.py), eh_proj read once for all of them -------------

# ptx/mtp_input.cu: entries per block of the batched kernel (blockIdx.x is the chunk of entries).
MTP_INPUT_BATCH_ROWS = 8


def _entry_token_ptr(entries, e: int):
    """The token word (word 2) of entry e."""
    return entries.offset(e * ENTRY_BYTES + 8)


_EMBED_NORM_ARGS = [
    ("table", PTR),
    ("entries", PTR),
    ("enorm", PTR),
    ("hidden", PTR),
    ("hnorm", PTR),
    ("out", PTR),
    ("m", U32),
    ("vocab", U32),
    ("h", U32),
    ("eps", F32),
]


@declare(
    "mtp_input",
    "mtp_embed_norm_batch",
    list(_EMBED_NORM_ARGS),
    writes=("out",),
)
def MTP_EMBED_NORM_BATCH(mem, table, entries, enorm, hidden, hnorm, out, m, vocab, h, eps):
    """out row e = [rmsnorm(table[entry e's token]) * enorm ; rmsnorm(hidden[e]) * hnorm] ([m, 2h]
    BF16) for each of m entries, row by row. A padding entry's row is not written and nothing is
    read for it."""
    ents = read_entries(mem, entries, m)
    for e in range(m):
        if is_pad(ents[e]):
            continue
        _embed_norm_rows(
            mem,
            table,
            _entry_token_ptr(entries, e),
            enorm,
            hidden.offset(e * h * 2),
            hnorm,
            out.offset(e * 2 * h * 2),
            1,
            vocab,
            h,
            eps,
        )


@declare(
    "mtp_input",
    "mtp_input_gemv_batch",
    [
        ("table", PTR),
        ("entries", PTR),
        ("enorm", PTR),
        ("hidden", PTR),
        ("hnorm", PTR),
        ("w", PTR),
        ("y", PTR),
        ("m", U32),
        ("vocab", U32),
        ("h", U32),
        ("n", U32),
        ("eps", F32),
        ("flags", PTR),
        ("flag_byte", U32),
    ],
    writes=("y", "flags"),
    # The hidden halves before the wait, beside the head that released it; the entries (whose
    # tokens the head writes) after it.
    pdl=Pdl.BESIDE,
)
def MTP_INPUT_GEMV_BATCH(
    mem, table, entries, enorm, hidden, hnorm, w, y, m, vocab, h, n, eps, flags, flag_byte
):
    """y row e = W @ [rmsnorm(table[token]) * enorm ; rmsnorm(hidden_e) * hnorm] and the flag as
    the module says, for each of the m entries e that is not padding: the token is entry e's word
    2, the hidden row ``hidden + e * h * 2`` bytes, y row e of ``[m, n]`` BF16, the flag byte
    ``flags + e * 4 + flag_byte`` (one u32 of four flag bytes per entry). A padding entry's y row
    and flag are never written."""
    ents = read_entries(mem, entries, m)
    for e in range(m):
        if is_pad(ents[e]):
            continue
        _input_gemv_row(
            mem,
            table,
            _entry_token_ptr(entries, e),
            enorm,
            hidden.offset(e * h * 2),
            hnorm,
            w,
            y.offset(e * n * 2),
            vocab,
            h,
            n,
            eps,
            flags.offset(e * 4 + flag_byte),
        )


def _pow2_rows(m: int, chunk: int) -> int:
    """Rows of the largest chunk's template: min(m, chunk) rounded up to a power of two (a chunk of
    3 runs the 4-row path, whose 4th row of shared memory is zero)."""
    r = min(m, chunk)
    return 1 << (r - 1).bit_length()


def mtp_input_batch_smem(m: int, h: int) -> int:
    """Dynamic shared memory of mtp_input_gemv_batch: the chunk's normed rows, [M][h] BF16."""
    return _pow2_rows(m, MTP_INPUT_BATCH_ROWS) * h * 2


def mtp_input_batch_grid(gpu, m: int, n: int, h: int) -> tuple[int, int]:
    """(chunks of entries, blocks over the rows of eh_proj): the blocks resident at once for the
    shared memory of m's chunks, but never so few that a warp owns more than
    MTP_INPUT_ROWS_PER_WARP rows."""
    kernel = gpu.kernel(*MTP_INPUT_GEMV_BATCH.key)
    units = -(-n // 8)
    grid = grid_stride_blocks(units, gpu.resident_blocks(kernel, 256, mtp_input_batch_smem(m, h)))
    return (-(-m // MTP_INPUT_BATCH_ROWS), max(grid, -(-units // MTP_INPUT_ROWS_PER_WARP)))


def mtp_input_gemv_batch(
    gpu, *, table, entries, enorm, hidden, hnorm, w, y, m, vocab, h, n, eps, flags, flag_byte, stream=None
):
    """y [m, n] BF16: row e = eh_proj @ [rmsnorm(table[entry e's token]) * enorm ; rmsnorm(hidden_e)
    * hnorm] (MTP_INPUT_GEMV_BATCH). ``entries``: m entries (16-byte aligned, u32 [m, 4]);
    ``hidden``: m BF16 rows of h (a padding entry's row is read, never used); ``flags``: m u32
    words, entry e's flag in byte ``flag_byte`` of word e. Each row is bit-identical to a launch of
    that entry alone (m = 1)."""
    check_rows("mtp_input_gemv_batch", m)
    if not 0 <= flag_byte < 4:
        raise ValueError(f"mtp_input_gemv_batch: flag_byte={flag_byte} is not a byte of a u32 (0..3)")
    launch(
        gpu,
        gpu.kernel(*MTP_INPUT_GEMV_BATCH.key),
        mtp_input_batch_grid(gpu, m, n, h),
        256,
        table,
        entries,
        enorm,
        hidden,
        hnorm,
        w,
        y,
        m,
        vocab,
        h,
        n,
        eps,
        flags,
        flag_byte,
        smem=mtp_input_batch_smem(m, h),
        stream=stream,
    )


@declare(
    "mtp_input",
    "mtp_embed_norm_flags_batch",
    _EMBED_NORM_ARGS + [("flags", PTR), ("flag_byte", U32)],
    writes=("out", "flags"),
)
def MTP_EMBED_NORM_FLAGS_BATCH(
    mem, table, entries, enorm, hidden, hnorm, out, m, vocab, h, eps, flags, flag_byte
):
    """MTP_EMBED_NORM_BATCH, and each live entry's flag byte set as mtp_input_gemv_batch sets it
    (HIDDEN_NONFINITE | TOKEN_OUTSIDE where either holds): the input of eh_proj on tensor cores."""
    MTP_EMBED_NORM_BATCH.host(mem, table, entries, enorm, hidden, hnorm, out, m, vocab, h, eps)
    ents = read_entries(mem, entries, m)
    for e in range(m):
        if is_pad(ents[e]):
            continue
        hf = mem.read(hidden.offset(e * h * 2), BF16, h).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            divisor = np.sqrt(np.mean(hf * hf, dtype=np.float32) + np.float32(eps))  # rmsnorm_ref's
        bad = (0 if np.isfinite(divisor) else HIDDEN_NONFINITE) | (
            0 if int(ents[e][2]) < vocab else TOKEN_OUTSIDE
        )
        if bad:
            mem.write(flags.offset(e * 4 + flag_byte), np.array([bad], np.uint8))


def mtp_embed_norm_batch(
    gpu, *, table, entries, enorm, hidden, hnorm, out, m, vocab, h, eps, flags=None, flag_byte=0, stream=None
):
    """out [m, 2h] BF16 for m entries (MTP_EMBED_NORM_BATCH): tokens from the entries, hidden rows
    dense [m, h]; a padding entry's row is left as it was. With ``flags`` (a draft's input rows)
    each live entry's flag byte ``flags + 4 e + flag_byte`` is set as mtp_input_gemv_batch sets it
    (MTP_EMBED_NORM_FLAGS_BATCH)."""
    check_rows("mtp_embed_norm_batch", m)
    args = [table, entries, enorm, hidden, hnorm, out, m, vocab, h, eps]
    decl = MTP_EMBED_NORM_BATCH
    if flags is not None:
        if not 0 <= flag_byte < 4:
            raise ValueError(f"mtp_embed_norm_batch: flag_byte={flag_byte}")
        args += [flags, flag_byte]
        decl = MTP_EMBED_NORM_FLAGS_BATCH
    launch(gpu, gpu.kernel(*decl.key), (m, 2), 256, *args, stream=stream)
