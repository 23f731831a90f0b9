"""Absorbed MLA attention over the selected latent rows of the paged FP8 cache.

Per head: ``s_j = (q_h . c_j) * scale`` over the selected rows j, softmax, ``o_h = sum_j p_j c_j``.
``q`` is the absorbed query in latent space (f32, [heads, dim]); ``out`` is BF16 [heads, dim].
The selection's row count is read from device memory. CUDA: ptx/sparse_mla.cu.
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16, FP8
from runtime.launch import launch
from runtime.kernel import F32, PTR, U32, declare


@declare(
    "sparse_mla",
    "sparse_mla_attend",
    [
        ("q", PTR), ("cache", PTR), ("scales", PTR), ("block_table", PTR), ("selected", PTR),
        ("count", PTR), ("out", PTR), ("heads", U32), ("dim", U32), ("block_size", U32),
        ("scale", F32),
    ],
    writes=("out",),
)
def SPARSE_MLA_ATTEND(mem, q, cache, scales, block_table, selected, count, out, heads, dim,
                      block_size, scale):
    n = int(mem.scalar(count, np.uint32))
    rows = mem.read(selected, np.uint32, n).astype(np.int64)
    blocks = mem.read(block_table, np.uint32, int(rows.max()) // block_size + 1).astype(np.int64)
    slots = blocks[rows // block_size] * block_size + rows % block_size
    nslots = int(slots.max()) + 1
    c = mem.read(cache, FP8, (nslots, dim))[slots].astype(np.float32)
    c *= mem.read(scales, np.float32, nslots)[slots][:, None]
    qv = mem.read(q, np.float32, (heads, dim))
    s = (qv @ c.T) * np.float32(scale)
    s -= s.max(1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(1, keepdims=True)
    mem.write(out, (p @ c).astype(BF16))


def sparse_mla_attend(gpu, q, cache, scales, block_table, selected, count, out, heads, dim,
                      block_size, scale, stream=None):
    launch(gpu, gpu.kernel(*SPARSE_MLA_ATTEND.key), heads, 256, q, cache, scales, block_table,
           selected, count, out, heads, dim, block_size, scale, stream=stream)
