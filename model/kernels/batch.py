"""The batch addressing every batched kernel shares (ptx/batch.cuh is the CUDA side).

A launch covers ``m`` entries; entry e is four u32 words ``[slot, row, token, reserved]``: the
sequence slot, its drafter row (kernels add their immediate ``row_add``, the draft index), the
token it embeds. An entry whose slot is ``PAD_SLOT`` is padding of a bucket graph: a kernel reads
and writes nothing of any sequence for it.

Per-sequence state lives in pools indexed by slot, each slot sized for ``slot_rows`` rows
(``SlotGeometry``): indexer keys / gates ``[slots][slot_rows][idim]`` BF16, pool keys
``[slots][pools_per_slot][idim]`` FP8, pool scales ``[slots][pools_per_slot]`` f32, block tables
``[slots][blocks_per_slot]`` u32 (block ids of the paged latent cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ENTRY_WORDS = 4
ENTRY_BYTES = 4 * ENTRY_WORDS
PAD_SLOT = 0xFFFFFFFF
# Entries one batched launch covers (every batched kernel takes 1..MAX_ROWS): it bounds a proposer's
# max_sequences and context_chunk.
MAX_ROWS = 256


def check_rows(what: str, m: int) -> None:
    """Every batched kernel of the model covers 1..MAX_ROWS entries per launch."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"{what}: m={m} entries outside 1..{MAX_ROWS} (the entries of one batched launch)")


def pack_entries(slots, rows, tokens, m: int | None = None) -> np.ndarray:
    """u32 ``[m, 4]``: one entry per (slot, row, token), then padding entries up to ``m``."""
    n = len(slots)
    m = n if m is None else m
    if not n == len(rows) == len(tokens) or m < n:
        raise ValueError(f"pack_entries: {len(slots)} slots, {len(rows)} rows, {len(tokens)} tokens, m={m}")
    out = np.zeros((m, ENTRY_WORDS), np.uint32)
    out[:, 0] = PAD_SLOT
    out[:n, 0], out[:n, 1], out[:n, 2] = slots, rows, tokens
    return out


def read_entries(mem, entries, m: int) -> np.ndarray:
    """The host twins' view of a launch's entries: u32 ``[m, 4]``."""
    return mem.read(entries, np.uint32, (m, ENTRY_WORDS))


def is_pad(entry) -> bool:
    return int(entry[0]) == PAD_SLOT


@dataclass(frozen=True)
class SlotGeometry:
    """Where slot ``s``'s rows live in the pools (element offsets, not bytes)."""

    slot_rows: int
    idim: int
    kpool: int
    block_size: int

    @property
    def pools_per_slot(self) -> int:
        return max(self.slot_rows // self.kpool, 1)

    @property
    def blocks_per_slot(self) -> int:
        return -(-self.slot_rows // self.block_size)

    def key_row(self, slot: int, row: int) -> int:
        """Element offset of (slot, row) in the keys / gates pools."""
        return (slot * self.slot_rows + row) * self.idim

    def pool_row(self, slot: int, pool: int) -> int:
        """Index of (slot, pool) in the pool-scales pool (times idim in the pool-keys pool)."""
        return slot * self.pools_per_slot + pool

    def table_base(self, slot: int) -> int:
        """Index of slot ``s``'s first block id in the block-tables pool."""
        return slot * self.blocks_per_slot
