"""DSA sizing and a sequence's row count. Its caches (the latent rows in a paged FP8 pool, the
indexer's per-token keys and gates, the compressed FP8 pool keys) live in the slot pools
(model/slot_pools.py).

Shared selection (``index_share_for_mtp_iteration``, true in the published GLM-5.3-Flash config):
draft 1 of a propose runs the indexer and the top-k; drafts 2..k reuse draft 1's selected pools
without scoring again (as vLLM's MTP drafter reuses draft 1's top-k). What this project adds, where
the published description is silent: with ``index_kpool_always_select_tail`` the rows drafted after
draft 1 are attended too, so draft j at row n + j - 1 attends draft 1's pools, draft 1's tail and
rows n + 1 .. n + j - 1 (itself included), in that ascending order; without the tail it attends
draft 1's selection unchanged. Draft 1's selection is a function of its own row only, so a
rollback needs nothing beyond the row count.

Rewinding is moving the count: rows and pools past it are unreachable (the selection reads only
complete pools below the current row, attention only selected rows), and a pool that a rewind cut
open is recompressed from its per-token keys and gates when a re-feed completes it again, so
rewind-then-refeed gives exactly the state that never advanced.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.kv_cache import KvCacheConfig, KvDtype

from .config import DsaConfig
from .kernels.dsa_select import select_max_pools, selection_capacity
from .proposer_checks import ProposerError

# The drafter's private pool uses the same block size as the target's absorbed-MLA cache, so the
# latent write and the paged gather see the strides they assume.
KV_BLOCK_SIZE = 16


def latent_cache_config(kv_lora_rank: int, layers: int) -> KvCacheConfig:
    """The paged cache of ``layers`` DSA layers' latent rows: one FP8 E4M3 row of ``kv_lora_rank``
    values per token (one f32 scale each), in blocks of ``KV_BLOCK_SIZE`` rows."""
    return KvCacheConfig(KV_BLOCK_SIZE, 1, kv_lora_rank, layers, KvDtype.FP8_E4M3)


class DsaSizingError(ProposerError):
    """A row past the drafter's sizing, or a feed that would leave a hole (a ProposerError, so an
    engine catches one type for every refusal of its input)."""


def max_dsa_context(cfg: DsaConfig) -> int:
    """Rows a DSA layer can ever hold: the indexer reservation in whole pools, clamped to what the
    top-k selection can rank (``select_max_pools(topk_pools)``: TOPK_MAX_POOLS = 262,144 pools,
    1,048,576 tokens at kpool 4). Derived, never a literal."""
    whole_pools = cfg.max_context // cfg.index_kpool
    return min(whole_pools, select_max_pools(cfg.topk_pools)) * cfg.index_kpool


def drafter_context_rows(served_max_seq_len: int, cfg: DsaConfig) -> int:
    """The drafter's reach: the served context clamped to ``max_dsa_context``. Every per-sequence
    buffer is sized from this; a declared context the DSA layer can never reach sizes nothing."""
    if served_max_seq_len <= 0:
        raise DsaSizingError(f"served max_seq_len must be positive, got {served_max_seq_len}")
    return min(served_max_seq_len, max_dsa_context(cfg))


def check_served_context(served_max_seq_len: int, cfg: DsaConfig) -> int:
    """The drafter's reach for a served length that it must cover whole: a served length past
    ``max_dsa_context`` (what the indexer reservation holds in whole pools, within the selection's
    capacity) is refused with a DsaSizingError naming both, so a loader calls this before it
    allocates anything. Returns ``drafter_context_rows`` (then equal to the served length)."""
    reach = drafter_context_rows(served_max_seq_len, cfg)
    if served_max_seq_len > reach:
        whole = cfg.max_context // cfg.index_kpool
        cap = select_max_pools(cfg.topk_pools)
        raise DsaSizingError(
            f"served max_seq_len {served_max_seq_len} is past the {reach} rows the drafter's DSA layer "
            f"can hold: the indexer reservation (index_max_context) of {cfg.max_context} tokens is "
            f"{whole} whole pools of {cfg.index_kpool}, and the top-k selection ranks at most {cap} "
            "pools; raise the reservation or serve a shorter length"
        )
    return reach


@dataclass
class DsaState:
    """A sequence's row count in its slot of the pools (model/slot_pools.py): the one number its
    DSA state needs on the host (rewinding is moving it)."""

    slot: int
    rows_capacity: int
    length: int = 0

    def check_advance(self, start: int, rows: int) -> None:
        """Refuse, before anything is written, a feed that does not start at the current length or
        runs past the sizing (invariant: the row space is dense and within its buffers)."""
        if start != self.length:
            raise DsaSizingError(
                f"feed starts at row {start} but the DSA state holds {self.length} rows: "
                "rows must append exactly at the current length (no hole, no overwrite)"
            )
        if start + rows > self.rows_capacity:
            raise DsaSizingError(
                f"feed of {rows} rows at {start} runs past the {self.rows_capacity} rows this "
                "state was sized for"
            )

    def advance(self, rows: int) -> None:
        self.check_advance(self.length, rows)
        self.length += rows

    def rewind_to(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise DsaSizingError(f"rewind_to({n}) outside 0..{self.length}")
        self.length = n


def selection_rows(cfg: DsaConfig, rows: int, extra: int = 0) -> int:
    """Capacity of the selected-row list for a state of ``rows`` rows, ``extra`` rows appended to
    a shared selection included."""
    return selection_capacity(rows, cfg.topk_pools, cfg.index_kpool, extra)


def shared_selection_extra(cfg: DsaConfig, max_draft_tokens: int) -> int:
    """Rows a shared selection gains over one propose: drafts 2..k each append their own row
    when the tail is selected (none otherwise)."""
    if cfg.share_for_mtp_iteration and cfg.always_select_tail:
        return max(max_draft_tokens - 1, 0)
    return 0
