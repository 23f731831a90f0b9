"""``out[b]`` = XOR of the 32-bit words block ``b`` of ``blocks`` reads of ``src``: a kernel that
only reads, for measuring how fast the device streams memory into a kernel (bench/bench_runtime.py).

``read_xor`` loads with the weight streams' cache policy (``ld_stream16`` in ptx/common.cuh);
``read_xor_l2_256b`` adds the ``.L2::256B`` prefetch-size hint, kept for the comparison that took
it out of the weight loads. Thread ``t`` of block ``b`` reads the 16-byte words
``t + BLOCK * b + j * BLOCK * blocks``. CUDA source: ptx/read_xor.cu.

Only the benchmark and tests launch it; it ships because it is the read-bandwidth floor the weight
streams are judged against, and must be built from the same ``ld_stream16`` as the kernels it measures.
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..kernel import PTR, U32, KernelDecl, declare
from ..launch import launch

BLOCK = 256
_ARGS = [("src", PTR), ("n16", U32), ("blocks", U32), ("out", PTR)]


def read_xor_ref(words: np.ndarray, blocks: int) -> np.ndarray:
    """Per-block XOR (uint32, ``blocks`` of them) of ``words`` (uint32, a multiple of 4 long)."""
    w16 = np.bitwise_xor.reduce(np.asarray(words, np.uint32).reshape(-1, 4), axis=1)
    stride = blocks * BLOCK
    padded = np.zeros(-(-w16.size // stride) * stride, np.uint32)
    padded[: w16.size] = w16
    return np.bitwise_xor.reduce(np.bitwise_xor.reduce(padded.reshape(-1, blocks, BLOCK), axis=0), axis=1)


def _twin(mem, src, n16, blocks, out):
    mem.write(out, read_xor_ref(mem.read(src, np.uint32, 4 * n16), blocks))


READ_XOR = declare("read_xor", "read_xor", _ARGS, writes=("out",))(_twin)
READ_XOR_L2_256B = declare("read_xor", "read_xor_l2_256b", _ARGS, writes=("out",))(_twin)


def read_xor_decl(l2_256b: bool = False) -> KernelDecl:
    """The declaration ``read_xor`` launches: with the weight loads' policy, or with the hint."""
    return READ_XOR_L2_256B if l2_256b else READ_XOR


def read_xor(
    gpu: GpuBackend,
    src: DevicePtr,
    nbytes: int,
    out: DevicePtr,
    blocks: int,
    l2_256b: bool = False,
    stream: int | None = None,
) -> None:
    """Read ``nbytes`` of ``src`` (16-byte aligned, a multiple of 16) with ``blocks`` blocks; ``out``
    receives ``blocks`` uint32 partials."""
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"read_xor: nbytes={nbytes} must be a positive multiple of 16")
    if nbytes // 16 > 0xFFFFFFFF:
        raise ValueError(f"read_xor: nbytes={nbytes} is more than 2**32 16-byte words")
    if src.addr % 16:
        raise ValueError(f"read_xor: src {src.addr:#x} is not 16-byte aligned")
    if blocks < 1:
        raise ValueError(f"read_xor: blocks={blocks}")
    if gpu.bytes_from(src) < nbytes:
        raise ValueError(f"read_xor: src holds {gpu.bytes_from(src)} bytes, {nbytes} asked")
    if gpu.bytes_from(out) < 4 * blocks:
        raise ValueError(
            f"read_xor: out holds {gpu.bytes_from(out)} bytes, {blocks} partials need {4 * blocks}"
        )
    launch(
        gpu,
        gpu.kernel(*read_xor_decl(l2_256b).key),
        blocks,
        BLOCK,
        src,
        nbytes // 16,
        blocks,
        out,
        stream=stream,
    )
