"""The MTP block's input half-rows: ``[rmsnorm(embed[t]) * enorm ; rmsnorm(h) * hnorm]``.

The embedding row is read in place from the target's table at a token id held in device memory
(graph replays feed draft i's token to draft i+1 without the host). CUDA: ptx/mtp_input.cu.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16
from runtime.launch import launch
from runtime.kernel import F32, PTR, U32, declare
from runtime.kernels.rmsnorm import rmsnorm_ref


@declare(
    "mtp_input",
    "mtp_embed_norm",
    [
        ("table", PTR), ("tokens", PTR), ("enorm", PTR), ("hidden", PTR), ("hnorm", PTR),
        ("out", PTR), ("rows", U32), ("vocab", U32), ("h", U32), ("eps", F32),
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


def mtp_embed_norm(gpu, table, tokens, enorm, hidden, hnorm, out, rows, vocab, h, eps, stream=None):
    launch(gpu, gpu.kernel(*MTP_EMBED_NORM.key), (rows, 2), 256, table, tokens, enorm, hidden,
           hnorm, out, rows, vocab, h, eps, stream=stream)
