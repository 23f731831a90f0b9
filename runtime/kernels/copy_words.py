"""``dst[i] = src[i]`` for ``n`` 32-bit words, one warp.

A graph's first kernel uses it to bring a step's scalars in from mapped pinned host memory
(``GpuBackend.alloc_mapped``) instead of a captured host-to-device copy: it releases its dependents
at its start (it is launched plainly), so a ``Pdl.BESIDE`` successor overlaps the PCIe read.
CUDA source: ptx/copy_words.cu.
"""

from __future__ import annotations

import numpy as np

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..kernel import PTR, U32, declare
from ..launch import launch


@declare("copy_words", "copy_words", [("src", PTR), ("dst", PTR), ("n", U32)], writes=("dst",), releases=True)
def COPY_WORDS(mem, src, dst, n):  # noqa: N802 - the declaration is the constant
    if n:
        mem.write(dst, mem.read(src, np.uint32, n))


def copy_words(gpu: GpuBackend, src: DevicePtr, dst: DevicePtr, n: int, stream: int | None = None) -> None:
    if n < 1:
        raise ValueError(f"copy_words: n={n}")
    launch(gpu, gpu.kernel(*COPY_WORDS.key), 1, 32, src, dst, n, stream=stream)
