"""Embedding row gather with the token read from device memory: ``out[0:k] = table[*token_ptr]``.
A token >= vocab writes NaN (0xFFFF) into every element instead of reading out of bounds.

CUDA source: ptx/embed_gather_bf16.cu. The token lives in a device buffer so that the gather can
be captured into a graph and follow a token an earlier kernel (the previous draft's argmax) wrote.
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..dtypes import BF16
from ..kernel import PTR, U32, declare
from ..launch import launch

BLOCK = 256
_PER_BLOCK = BLOCK * 8  # one 16-byte chunk per thread per block pass
NAN_BITS = 0xFFFF


@declare(
    "embed_gather_bf16",
    "embed_gather_bf16",
    [("table", PTR), ("token_ptr", PTR), ("out", PTR), ("vocab", U32), ("k", U32)],
    writes=("out",),
)
def EMBED_GATHER_BF16(mem, table, token_ptr, out, vocab, k):  # noqa: N802 - the declaration is the constant
    token = mem.scalar(token_ptr, np.uint32)
    if k == 0:
        return
    if token >= vocab:
        mem.write(out, np.full(k, NAN_BITS, np.uint16))
        return
    # Only the selected row is read, as on the GPU, so a table shorter than vocab rows faults here.
    mem.write(out, mem.read(table.offset(token * k * 2), BF16, k))


def embed_gather_bf16(
    gpu: GpuBackend,
    table: DevicePtr,
    token_ptr: DevicePtr,
    out: DevicePtr,
    vocab: int,
    k: int,
    stream: int | None = None,
) -> None:
    grid = max(1, (k + _PER_BLOCK - 1) // _PER_BLOCK)
    launch(
        gpu, gpu.kernel(*EMBED_GATHER_BF16.key), grid, BLOCK, table, token_ptr, out, vocab, k, stream=stream
    )
