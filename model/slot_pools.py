"""Per-sequence DSA state of every sequence slot, in pools allocated up front and indexed by slot.

A bucket graph of ``propose_batch`` bakes the pools' base addresses, never one sequence's buffers:
the kernels find a sequence's rows from the slot id in its batch entry (model/kernels/batch.py).
So sequences come and go and slots are reused without a recapture, and allocating a sequence
allocates nothing on the device.

Per layer: indexer keys and gates ``[slots][slot_rows][idim]`` BF16, compressed pool keys
``[slots][pools_per_slot][idim]`` FP8 with one f32 scale each. The per-token indexer (GLM-5,
DeepSeek-V3.2) keeps only the FP8 keys (a pool is one token) and no keys or gates; an MLA with a
rope part keeps each row's rotated rope key ``[slots][slot_rows][rope_dim]`` BF16 beside them. Shared by the layers: the paged
latent cache (one FP8 row of ``kv_lora_rank`` per token and layer) and the block tables
``[slots][blocks_per_slot]`` that map a slot's rows into it; every slot claims its blocks here,
so the tables never change after construction.

A slot's bytes past its sequence's row count are unreachable (the selection reads complete pools
below the current row, attention only selected rows), so a reused slot needs no clearing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.backend import GpuBackend
from runtime.device_ptr import DevicePtr
from runtime.kv_cache import BlockTable, PagedKvCache

from .config import DsaConfig
from .dsa import latent_cache_config
from .kernels.batch import SlotGeometry


def slot_bytes_by_kind(
    dsa: DsaConfig, kv_lora_rank: int, slot_rows: int, layers: int = 1, rope_dim: int = 0
) -> dict[str, int]:
    """Device bytes one sequence slot of ``slot_rows`` rows holds in the pools, by kind: the latent
    cache (an FP8 row of ``kv_lora_rank`` and an f32 scale per row of its whole blocks, per layer),
    its block table (its row of the pools' tables and the claim's own device copy), and per layer
    the indexer's per-token BF16 keys and gates, the FP8 pool keys and their f32 scales.

    GLM-5.3-Flash at 1,048,576 rows: latent 541.1 MB, keys 268.4 MB, gates 268.4 MB, pool keys
    33.6 MB, pool scales 1.0 MB, table 0.5 MB: 1.113 GB a sequence (docs/batching.md)."""
    kvc = latent_cache_config(kv_lora_rank, layers)
    g = SlotGeometry(slot_rows, dsa.index_head_dim, dsa.index_kpool, kvc.block_size)
    latent_row = kvc.num_kv_heads * kvc.head_dim * kvc.dtype.itemsize + 4
    token_keys = 0 if dsa.per_token else layers * slot_rows * g.idim * 2
    return {
        "latent_kv": g.blocks_per_slot * kvc.block_size * latent_row * layers,
        "rope_keys": layers * slot_rows * rope_dim * 2,
        "block_table": 2 * g.blocks_per_slot * 4,
        "indexer_keys": token_keys,
        "indexer_gates": token_keys,
        "pool_keys": layers * g.pools_per_slot * g.idim,
        "pool_scales": layers * g.pools_per_slot * 4,
    }


@dataclass(frozen=True)
class LayerPools:
    keys: DevicePtr | None  # None with the per-token indexer (its pools are its keys)
    gates: DevicePtr | None
    pool_keys: DevicePtr
    pool_scales: DevicePtr
    rope_keys: DevicePtr | None = None  # with an MLA rope part


class SlotPools:
    """The DSA caches of ``slots`` sequences of ``slot_rows`` rows each, for ``layers`` layers
    (``rope_dim``: the MLA's rope dims, whose rotated key each row keeps)."""

    def __init__(
        self,
        gpu: GpuBackend,
        dsa: DsaConfig,
        kv_lora_rank: int,
        slot_rows: int,
        slots: int,
        layers: int = 1,
        rope_dim: int = 0,
    ) -> None:
        self.gpu, self.slots, self.slot_rows, self.rope_dim = gpu, slots, slot_rows, rope_dim
        self.per_token = dsa.per_token
        kvc = latent_cache_config(kv_lora_rank, layers)
        self.geometry = g = SlotGeometry(slot_rows, dsa.index_head_dim, dsa.index_kpool, kvc.block_size)
        self._ptrs: list[DevicePtr] = []
        self._claims: list[BlockTable] = []
        self.kv: PagedKvCache | None = None
        self.layers: list[LayerPools] = []
        try:
            self.kv = PagedKvCache(kvc, g.blocks_per_slot * slots, gpu)
            ids = np.empty((slots, g.blocks_per_slot), np.uint32)
            for s in range(slots):
                claim = self.kv.claim(slot_rows)
                self._claims.append(claim)
                ids[s] = claim.blocks
            self.tables = self._alloc(ids.nbytes)
            gpu.copy_h2d(self.tables, ids)
            self.block_ids = ids
            idim, pools = g.idim, g.pools_per_slot
            token = None if dsa.per_token else slots * slot_rows * idim * 2
            for _ in range(layers):
                self.layers.append(
                    LayerPools(
                        keys=self._alloc(token) if token else None,
                        gates=self._alloc(token) if token else None,
                        pool_keys=self._alloc(slots * pools * idim),
                        pool_scales=self._alloc(slots * pools * 4),
                        rope_keys=self._alloc(slots * slot_rows * rope_dim * 2) if rope_dim else None,
                    )
                )
        except Exception:
            self.free()
            raise

    def _alloc(self, nbytes: int) -> DevicePtr:
        p = self.gpu.alloc(max(nbytes, 1))
        self._ptrs.append(p)
        return p

    @property
    def nbytes_by_kind(self) -> dict[str, int]:
        """Device bytes of the pools: the latent cache (with its scales, tables and rope keys), and
        the indexer's per-token keys and gates and compressed pools."""
        g, kv = self.geometry, self.kv
        row = kv.config.num_kv_heads * kv.config.head_dim * kv.config.dtype.itemsize + 4
        latent = kv.num_blocks * kv.config.block_size * row * kv.config.num_layers
        token = 0 if self.per_token else 2 * self.slot_rows * g.idim * 2
        per_layer = self.slots * (token + g.pools_per_slot * (g.idim + 4))
        rope = self.slots * self.slot_rows * self.rope_dim * 2 * len(self.layers)
        return {
            "kv_pool": latent + rope + self.slots * g.blocks_per_slot * 4,
            "indexer_caches": per_layer * len(self.layers),
        }

    def latent_slot(self, slot: int, row: int) -> int:
        """Index of (slot, row) among the latent cache's rows (what the block table maps to)."""
        bs = self.geometry.block_size
        return int(self.block_ids[slot, row // bs]) * bs + row % bs

    def free(self) -> None:
        if self.kv is not None:
            for c in self._claims:
                self.kv.release(c)
            self.kv.free()
            self.kv = None
        self._claims = []
        for p in reversed(self._ptrs):
            self.gpu.free(p)
        self._ptrs = []
        self.layers = []
