"""The MTP block's input half-rows: ``[rmsnorm(embed[t]) * enorm ; rmsnorm(h) * hnorm]``.

The embedding row is read in place from the target's table at a token id held in device memory
(graph replays feed draft i's token to draft i+1 without the host). CUDA: ptx/mtp_input.cu.

``mtp_input_gemv`` (a draft's first kernel) also checks its inputs for the proposer: it sets its
``flag`` byte to ``HIDDEN_NONFINITE`` when the hidden row is not finite (its RMS divisor, computed
anyway for the norm, is NaN or Inf: a NaN or an Inf in the row, or an f32 sum of squares that
overflows), ``|`` ``TOKEN_OUTSIDE`` when the token is not in the vocabulary, and leaves it alone
otherwise.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16
from runtime.kernel import F32, PTR, U32, Pdl, declare
from runtime.kernels.gemv_bf16 import gemv_bf16_ref
from runtime.kernels.rmsnorm import rmsnorm_ref
from runtime.launch import grid_stride_blocks, launch

# What mtp_input_gemv stores in its flag byte (bits; 0 is never stored).
HIDDEN_NONFINITE = 1
TOKEN_OUTSIDE = 2


@declare(
    "mtp_input",
    "mtp_embed_norm",
    [
        ("table", PTR),
        ("tokens", PTR),
        ("enorm", PTR),
        ("hidden", PTR),
        ("hnorm", PTR),
        ("out", PTR),
        ("rows", U32),
        ("vocab", U32),
        ("h", U32),
        ("eps", F32),
    ],
    writes=("out",),
)
def MTP_EMBED_NORM(mem, table, tokens, enorm, hidden, hnorm, out, rows, vocab, h, eps):
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


@declare(
    "mtp_input",
    "mtp_input_gemv",
    [
        ("table", PTR),
        ("token", PTR),
        ("enorm", PTR),
        ("hidden", PTR),
        ("hnorm", PTR),
        ("w", PTR),
        ("y", PTR),
        ("vocab", U32),
        ("h", U32),
        ("n", U32),
        ("eps", F32),
        ("flag", PTR),
    ],
    writes=("y", "flag"),
    # The hidden half runs before the wait, beside the head that released it (ptx/mtp_input.cu).
    pdl=Pdl.BESIDE,
)
def MTP_INPUT_GEMV(mem, table, token, enorm, hidden, hnorm, w, y, vocab, h, n, eps, flag):
    """y = W @ [rmsnorm(table[*token]) * enorm ; rmsnorm(hidden) * hnorm] for one row (W [n, 2h]):
    mtp_embed_norm (rows = 1) and gemv_bf16 in sequence, in one launch on the device (which sums
    the two half-rows separately, within the GEMV's rounding of this). ``flag`` as the module says."""
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


# ptx/mtp_input.cu mtp_input_gemv: one row per warp, 8 warps per block, grid-stride over the rows
# with the blocks the device holds at once (gpu.resident_blocks, balanced by grid_stride_blocks),
# so that every block computes the norm prologues once; never more than MTP_INPUT_ROWS_PER_WARP
# rows per warp (the kernel keeps that many hidden-half sums per warp in shared memory). The
# 2h-wide input lives in dynamic smem.
MTP_INPUT_ROWS_PER_WARP = 4


def mtp_input_grid(gpu, n: int, h: int) -> int:
    kernel = gpu.kernel(*MTP_INPUT_GEMV.key)
    units = -(-n // 8)
    grid = grid_stride_blocks(units, gpu.resident_blocks(kernel, 256, 4 * h))
    return max(grid, -(-units // MTP_INPUT_ROWS_PER_WARP))


def mtp_input_gemv(gpu, table, token, enorm, hidden, hnorm, w, y, vocab, h, n, eps, stream=None, *, flag):
    launch(
        gpu,
        gpu.kernel(*MTP_INPUT_GEMV.key),
        mtp_input_grid(gpu, n, h),
        256,
        table,
        token,
        enorm,
        hidden,
        hnorm,
        w,
        y,
        vocab,
        h,
        n,
        eps,
        flag,
        smem=4 * h,
        stream=stream,
    )


def mtp_embed_norm(gpu, table, tokens, enorm, hidden, hnorm, out, rows, vocab, h, eps, stream=None):
    launch(
        gpu,
        gpu.kernel(*MTP_EMBED_NORM.key),
        (rows, 2),
        256,
        table,
        tokens,
        enorm,
        hidden,
        hnorm,
        out,
        rows,
        vocab,
        h,
        eps,
        stream=stream,
    )
