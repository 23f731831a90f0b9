"""Paged KV cache: a pool of fixed-size blocks per layer, a block allocator and block tables.

Rows are stored per layer as ``[num_blocks * block_size, heads * head_dim]`` elements; FP8 E4M3
layers carry one f32 scale per row (``[num_blocks * block_size]``). A sequence's block table maps
its row ``r`` to slot ``table[r // block_size] * block_size + r % block_size``; the device copy of
the table is what kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from .backend import GpuBackend
from .device_ptr import DevicePtr


class KvDtype(Enum):
    BF16 = ("bf16", 2)
    FP8_E4M3 = ("fp8_e4m3", 1)

    @property
    def itemsize(self) -> int:
        return self.value[1]


@dataclass(frozen=True)
class KvCacheConfig:
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: KvDtype = KvDtype.BF16

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_dim", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvCacheConfig.{name} must be positive, got {getattr(self, name)}")

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_size)


@dataclass
class BlockTable:
    """A sequence's claimed blocks: the host list and its device copy."""

    blocks: list[int]
    device: DevicePtr


class PagedKvCache:
    """Owns the pools (and frees them in ``free``); hands out and takes back blocks."""

    def __init__(self, config: KvCacheConfig, num_blocks: int, gpu: GpuBackend) -> None:
        if num_blocks <= 0:
            raise ValueError(f"PagedKvCache needs at least one block, got {num_blocks}")
        self.config = config
        self.num_blocks = num_blocks
        self.gpu = gpu
        self.data: list[DevicePtr] = []
        self.scales: list[DevicePtr | None] = []
        slots = num_blocks * config.block_size
        row_bytes = config.num_kv_heads * config.head_dim * config.dtype.itemsize
        try:
            for _ in range(config.num_layers):
                self.data.append(gpu.alloc(slots * row_bytes))
                self.scales.append(gpu.alloc(slots * 4) if config.dtype is KvDtype.FP8_E4M3 else None)
        except Exception:
            self.free()
            raise
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._tables: list[BlockTable] = []

    def claim(self, rows: int) -> BlockTable:
        """Claim every block ``rows`` rows need, up front, and upload the table. Nothing is claimed
        if there are not enough free blocks."""
        n = self.config.blocks_for(rows)
        if n > len(self._free_blocks):
            raise MemoryError(
                f"KV cache: {rows} rows need {n} blocks of {self.config.block_size}, "
                f"only {len(self._free_blocks)} of {self.num_blocks} are free"
            )
        dev = self.gpu.alloc(max(n, 1) * 4)
        blocks = [self._free_blocks.pop() for _ in range(n)]
        self.gpu.copy_h2d(dev, np.asarray(blocks, np.uint32))
        table = BlockTable(blocks, dev)
        self._tables.append(table)
        return table

    def release(self, table: BlockTable) -> None:
        if table not in self._tables:
            raise ValueError("KV cache: release of a block table this cache did not hand out (or twice)")
        self.gpu.free(table.device)
        self._tables.remove(table)
        self._free_blocks.extend(reversed(table.blocks))
        table.blocks = []

    def free(self) -> None:
        """Release the pools. Every table must have been released first."""
        if getattr(self, "_tables", None):
            raise RuntimeError(f"KV cache freed with {len(self._tables)} block tables still claimed")
        for p in self.data:
            self.gpu.free(p)
        for s in self.scales:
            if s is not None:
                self.gpu.free(s)
        self.data, self.scales = [], []
