"""The MTP draft proposer: the contract a serving engine's scheduler calls.

Batched: ``propose_batch / after_verify_batch / catchup_batch`` take one entry per sequence and
read the weights once per draft for all of them. The single-sequence calls (``propose``,
``after_verify``, ``catchup_drafter``, ``prefill_drafter``) are the batch of one, the same code.
Lifecycle: ``alloc_state / free_state / rewind_to``; queries ``drafter_rows``, ``last_pair_key``,
``drafter_context_rows``.

Row space (dense): drafter row r is the pair ``(embed(tokens[r+1]), hidden[r])``; its KV slot, its
indexer row and its position are all r. Context rows append exactly at the current length; a feed
that would leave a hole or run past the sizing is refused before anything is written.

Per-sequence caches live in pools indexed by slot (model/slot_pools.py), allocated up front for
``max_sequences`` slots; the batch scratch and the step's buffers belong to the proposer. So one
CUDA graph per (batch bucket, k) serves every batch: the host writes the batch's entries (slot,
row, token per sequence, padding entries after them) into mapped memory, and the graph's first
kernel brings them in.

Batch invariance: a sequence's drafts and cache bytes are the same whatever batch it is drafted in
(size, bucket, padding, the other sequences, their order) and the same as drafting it alone: no
kernel's arithmetic for a row depends on the other rows.

Every refusal is a ``ProposerError`` (model/proposer_checks.py), raised before any state changes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import numbers
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from runtime.allocations import MappedBuffer
from runtime.backend import GpuBackend
from runtime.comm.base import CommDtype, ReduceOp
from runtime.device_ptr import DevicePtr
from runtime.errors import CommError, MemoryFault
from runtime.external import (
    BF16_TYPESTRS,
    F32_TYPESTRS,
    ExternalArrayError,
    cuda_array,
    has_cuda_array_interface,
)
from runtime.graph import Graph
from runtime.kernels.all_finite_bf16 import NONE as NO_BAD_ROW
from runtime.kernels.all_finite_bf16 import all_finite_bf16
from runtime.kernels.argmax_bf16 import argmax_bf16_batch
from runtime.kernels.copy_words import copy_words
from runtime.kernels.gemv_bf16 import gemv_bf16_batch
from runtime.kernels.gemv_fp8w import gemv_fp8w_batch
from runtime.kernels.quantize_fp8 import quantize_fp8

from .block import BatchScratch, DecoderLayer, xn_stride
from .config import ModelConfig
from .dsa import DsaState, check_served_context, shared_selection_extra
from .kernels import draft_head, draft_sample, draft_sample_shard, sparse_mla
from .kernels import proj_mma as pm
from .kernels.batch import ENTRY_BYTES, ENTRY_WORDS, MAX_ROWS, PAD_SLOT
from .kernels.bgemv_fp8 import GemvSegment
from .kernels.draft_sample import SAMPLE_WORDS, pack_sampling, sample_workspace_bytes
from .kernels.draft_sample_shard import SHARD_TOP_K_MAX
from .kernels.mtp_input import mtp_embed_norm_batch, mtp_input_gemv_batch
from .proposer_checks import (
    FLAG_BYTES,
    FLAG_LOGITS,
    FLAG_OWN_HIDDEN,
    FLAG_TARGET_HIDDEN,
    ProposerError,
    as_int,
    as_tokens,
    exclusive,
    nonfinite_problem,
)
from .sampling import SampledDrafts, SamplingParams
from .slot_pools import SlotPools
from .tensors import TensorLookup
from .weights import DeviceArena, Sharding, SharedTables, WeightError, load_attention, load_moe

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A padding entry as the host writes it (model/kernels/batch.py).
_PAD_ENTRY = np.array([PAD_SLOT] + [0] * (ENTRY_WORDS - 1), np.uint32)


def _nbytes(shape: tuple, itemsize: int) -> int:
    return itemsize * math.prod(shape)


def _unused(obj: object, shape: tuple, itemsize: int) -> bool:
    """A buffer argument that lends nothing: None, or a non-pointer of no elements."""
    return obj is None or (_nbytes(shape, itemsize) == 0 and not isinstance(obj, DevicePtr))


@dataclass(frozen=True)
class ProposerOptions:
    served_max_seq_len: int
    max_draft_tokens: int = 4
    max_sequences: int = 4
    fp8_head: bool = True
    # Weights the checkpoint stores as 128x128 block-scaled FP8 (GLM-5.3-Flash: the experts, the
    # shared expert, q_a, q_b, kv_a, o_proj) stay FP8 on the device, read by kernels that apply the
    # block scales: half the bytes of the BF16 copy a draft would otherwise stream. False
    # dequantises them to BF16 at load.
    native_fp8: bool = True
    # Quantise a BF16 checkpoint's routed and shared experts to 128x128 block-scaled FP8 on load
    # (absmax / 448 per block, saturating): the FP8 bytes at the cost of the checkpoint's precision.
    quantize_experts: bool = False
    # The FP8 head on tensor cores (mma.sync, BF16 from the FP8 rows in registers) instead of the
    # CUDA-core GEMV: 0.20 vs 0.15 ms per draft at one sequence, 0.43 vs 0.91 at 16, 1.35 vs 3.71
    # at 64 (H200, BENCHMARKS.md). Both are batch-invariant; they are not bit-identical to each
    # other, so a proposer uses one for every batch. One rank only; hidden % 64 == 0. None: on for
    # a proposer of 4 or more sequences where it can run (the two cross near 3 sequences), off
    # for one that drafts alone.
    tensor_core_head: bool | None = None
    # The block's projections (fused input, q, absorbed query, value, o_proj) on tensor cores
    # (model/kernels/proj_mma.py) instead of the CUDA-core GEMVs, which are bound by their FMAs
    # past a few rows (BENCHMARKS.md). The two forms are not bit-identical, so a proposer uses one
    # for every batch; each is batch-invariant. None: on for a proposer of 4 or more sequences
    # (as tensor_core_head), off for one that drafts alone, whose GEMVs are tuned for one row.
    tensor_core_projections: bool | None = None
    # The block's attention over its selection: 0 the split pair (64-row splits x 16-head tiles,
    # tuned for one sequence's latency), or the wide pair's split length (64 to 256, a multiple of
    # 64: all heads of a sequence per block, each selected row gathered once per 64 heads, a quarter
    # of the partials at 256; model/kernels/sparse_mla.py sparse_mla_wide_batch). The forms are not
    # bit-identical, so a proposer uses one for every batch; each is batch-invariant. None:
    # sparse_mla.auto_split_rows(max_sequences) (the wide pair at 256 rows from 16 sequences).
    attention_split_rows: int | None = None
    # Context rows one launch feeds (all sequences of a catch-up together): weights are read once
    # per chunk.
    context_chunk: int = 32
    o_proj_groups: int = 8
    use_graphs: bool = False
    # Batch sizes a graph is captured for; a batch runs in the smallest that holds it, padded.
    # Only the buckets up to the first that holds max_sequences are used.
    batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    # Bound on a wait for peer ranks before it becomes a CommError.
    comm_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        # Every count is an integer: a float one (2.0) sizes buffers and ranges wrongly or fails
        # deep inside with a TypeError.
        for name in (
            "served_max_seq_len",
            "max_draft_tokens",
            "max_sequences",
            "context_chunk",
            "o_proj_groups",
        ):
            as_int(getattr(self, name), name)
        if self.max_draft_tokens < 1:
            raise ProposerError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if 0 < self.served_max_seq_len < self.max_draft_tokens:
            # A propose of k drafts writes k drafter rows, which the served context bounds (the
            # proposer bounds it again by its reach, drafter_context_rows).
            raise ProposerError(
                f"max_draft_tokens={self.max_draft_tokens} is more than the served context of "
                f"{self.served_max_seq_len} tokens: a propose of k drafts writes k rows"
            )
        if not 1 <= self.context_chunk <= MAX_ROWS:
            raise ProposerError(f"context_chunk must be 1..{MAX_ROWS} (rows one launch feeds)")
        if not 1 <= self.max_sequences <= MAX_ROWS:
            raise ProposerError(f"max_sequences must be 1..{MAX_ROWS}, got {self.max_sequences}")
        if self.o_proj_groups < 1:
            raise ProposerError(f"o_proj_groups must be >= 1, got {self.o_proj_groups}")
        asr = self.attention_split_rows
        off = isinstance(asr, int) and not isinstance(asr, bool) and asr == 0
        if asr is not None and not (off or sparse_mla.wide_split_rows_ok(asr)):
            raise ProposerError(
                f"attention_split_rows must be None, 0 or a multiple of {sparse_mla.SPLIT_ROWS} from "
                f"{sparse_mla.SPLIT_ROWS} to {sparse_mla.WIDE_MAX_SPLIT_ROWS}, got {asr!r}"
            )
        b = self.batch_buckets
        if (
            not isinstance(b, tuple)
            or not b
            or any(isinstance(v, bool) or not isinstance(v, int) for v in b)
            or list(b) != sorted(set(b))
            or not 1 <= b[0] <= b[-1] <= MAX_ROWS
        ):
            raise ProposerError(
                f"batch_buckets must be a tuple of increasing integers in 1..{MAX_ROWS}, got {b!r}"
            )
        if not isinstance(self.comm_timeout_s, numbers.Real) or not self.comm_timeout_s > 0:
            raise ProposerError(f"comm_timeout_s must be positive, got {self.comm_timeout_s}")

    @property
    def buckets(self) -> tuple[int, ...]:
        """The buckets this proposer uses: up to the first that holds max_sequences."""
        out = []
        for v in self.batch_buckets:
            out.append(v)
            if v >= self.max_sequences:
                break
        return tuple(out)


@dataclass
class ProposerState:
    """A sequence: its slot in the proposer's pools and its row count. Everything on the device is
    the proposer's (pools indexed by ``slot``), so a state holds no device memory."""

    slot: int
    dsa: DsaState
    # The label of the proposer that allocated this state: its rows live in that proposer's pools,
    # so every call checks it (another proposer would read and write its own pools' slot).
    owner: str
    last_drafted: int = 0
    # Host time of the last propose this sequence was in, the wait for the device excluded: checks,
    # the copy of the target's hidden rows, the graph launch (or the eager launches), reading the
    # drafts back.
    last_host_s: float = 0.0
    released: bool = False

    @property
    def rows(self) -> int:
        return self.dsa.length


@dataclass
class StepBuffers:
    """The propose step's device buffers for up to ``rows`` sequences (one bucket's worth: a
    bucket graph bakes these, never a sequence's)."""

    rows: int
    kmax: int
    entries: DevicePtr  # u32 [rows][4]: slot, row, token (the head rewrites it), reserved
    hidden_in: DevicePtr  # BF16 [rows, H]: the target's hidden rows
    x: DevicePtr  # BF16 [rows, H]
    xn: DevicePtr  # BF16 [rows, H]: the head's input; drafts 2..k read it as their hidden
    concat: DevicePtr | None  # BF16 [rows, 2H]: eh_proj's input rows, for eh_proj on tensor cores
    logits: DevicePtr
    keys: DevicePtr  # u64 [rows], zero between launches (the head's packed argmax)
    am_idx: DevicePtr  # sharded head: per-row argmax of this rank's logits
    am_val: DevicePtr
    head_counter: DevicePtr  # u32, zero between launches (the fused head's last-block handshake)
    drafts: DevicePtr  # u32 [rows][kmax]
    # Mapped pinned u32 [rows][4]: the host writes a step's entries here and the step's first
    # kernel (copy_words) brings them into ``entries`` (no host-to-device copy node in the graph).
    entries_in: MappedBuffer
    # Mapped pinned u32 [rows][kmax] drafts, then [rows] flag words (proposer_checks.FLAG_*): the
    # launch that commits a step's last draft copies the drafts here (the step's one copy back).
    drafts_out: MappedBuffer
    # Sampled steps: each entry's sampling record (model/kernels/draft_sample.py), written by the
    # host into mapped ``sampling_in`` and copied in by the step's first kernels like the entries;
    # the draft probabilities q(token) per draft, and their mapped copy back.
    sampling: DevicePtr
    sampling_in: MappedBuffer
    probs: DevicePtr  # f32 [rows][kmax]
    probs_out: MappedBuffer  # f32 [rows][kmax]
    sample_ws: DevicePtr

    # The host's views of the mapped buffers, made once: a propose uses four of them, and making
    # them anew cost 0.3-0.4 us each per call.

    @cached_property
    def entries_host(self) -> np.ndarray:
        """u32 [rows][ENTRY_WORDS]: the entries the host writes for the step's first kernel."""
        return self.entries_in.host.view(np.uint32)[: self.rows * ENTRY_WORDS].reshape(self.rows, ENTRY_WORDS)

    @cached_property
    def probs_host(self) -> np.ndarray:
        return self.probs_out.host.view(np.float32)[: self.rows * self.kmax].reshape(self.rows, self.kmax)

    @cached_property
    def sampling_host(self) -> np.ndarray:
        return self.sampling_in.host.view(np.uint32)[: self.rows * SAMPLE_WORDS].reshape(
            self.rows, SAMPLE_WORDS
        )

    @cached_property
    def drafts_host(self) -> np.ndarray:
        return self.drafts_out.host.view(np.uint32)[: self.rows * self.kmax].reshape(self.rows, self.kmax)

    @cached_property
    def flags_host(self) -> np.ndarray:
        """u8 [rows][FLAG_BYTES]: the flag bytes of each row, valid after the step's wait."""
        off = self.rows * self.kmax * 4
        return self.drafts_out.host[off : off + self.rows * FLAG_BYTES].reshape(self.rows, FLAG_BYTES)

    @cached_property
    def flag_words_host(self) -> np.ndarray:
        """u32 [rows]: each row's flag bytes as one word (non-zero when any was raised)."""
        return self.drafts_out.host.view(np.uint32)[self.rows * self.kmax : self.rows * (self.kmax + 1)]

    @property
    def flags(self) -> DevicePtr:
        return self.drafts_out.device.offset(self.rows * self.kmax * 4)


@dataclass
class ContextBuffers:
    """Staging of a catch-up chunk: its entries and hidden rows, the MTP input and the projection."""

    rows: int
    entries: DevicePtr
    hidden: DevicePtr  # BF16 [rows, H]
    concat: DevicePtr  # BF16 [rows, 2H]
    x: DevicePtr  # BF16 [rows, H]
    fused: DevicePtr  # BF16 [rows, ctx_rows]
    xn: DevicePtr  # BF16 [rows, xn_stride]: the normed rows of tensor-core projections
    proj_part: DevicePtr | None  # their split-k partials (DecoderLayer.part_row_bytes a row)
    finite_row: DevicePtr  # u32 [max_sequences]: all_finite_bf16's answer per sequence of a catch-up


_SERIALS = itertools.count(1)


class MtpProposer:
    """The drafter of one model on one device (one rank of it when sharded).

    A proposer belongs to one thread and one stream at a time: every public call holds its lock,
    and a call from a second thread while another is inside is refused with a ProposerError, not
    queued (its launches, graph captures and row counts would interleave with the first's). After
    ``close`` every method is refused, except ``close`` and ``free_state``, which are then no-ops
    (the ``drafter_context_rows`` property, a number from the config, stays readable).
    A state belongs to the proposer that allocated it; a state of another proposer is refused.

    Streams: every call takes an optional ``stream`` (an engine's current CUDA stream handle, or
    an object with a ``cuda_stream`` attribute such as ``torch.cuda.Stream``), else the proposer's
    own; the work is enqueued on it and the call returns when its results are back.

    Non-finite input: a sequence whose context rows hold a NaN or an Inf is refused before anything
    is written; a propose whose target hidden (or any value of the step) is not finite raises a
    ProposerError naming its slot and what was not finite (see ``propose_batch``). A NaN logit
    never wins the argmax, so even then every draft the kernels commit is a valid token id. Weights
    are checked as they are read (``TensorLookup``); tables passed in as device pointers are not.
    """

    def __init__(
        self,
        gpu: GpuBackend,
        cfg: ModelConfig,
        tensors,
        options: ProposerOptions,
        *,
        comm=None,
        tables: SharedTables | None = None,
        stream: int | None = None,
    ) -> None:
        self.label = f"MtpProposer#{next(_SERIALS)}"
        self._lock = threading.RLock()
        self._closed = False
        self._broken: str | None = None
        self.gpu, self.cfg, self.opt, self.comm = gpu, cfg, options, comm
        self.stream = gpu.default_stream if stream is None else stream
        src = TensorLookup.of(tensors)
        if options.native_fp8:
            src.check_fp8_block()
        H, V = cfg.hidden_size, cfg.vocab_size
        W = cfg.parallel.world_size
        if W > 1 and comm is None:
            raise ProposerError(
                f"proposer sharded over {W} ranks needs a communicator: without one it would "
                "draft from this rank's share of the heads, experts and vocabulary only"
            )
        if comm is not None and comm.world_size != W:
            raise ProposerError(f"communicator has {comm.world_size} ranks, the config says {W}")
        if comm is not None and W > 1:
            self._agree_with_peers(options)
        groups = min(options.o_proj_groups, cfg.attention.num_attention_heads)
        self.sharding = sh = Sharding.for_config(cfg, groups)
        # A served length the indexer reservation cannot hold is refused here, before anything is
        # allocated: a silent clamp would leave the sequences past it without drafts.
        self.rows_cap = check_served_context(options.served_max_seq_len, cfg.dsa)
        if options.max_draft_tokens > self.rows_cap:
            raise ProposerError(
                f"max_draft_tokens={options.max_draft_tokens} is more than the {self.rows_cap} rows "
                "the drafter holds (drafter_context_rows): a propose of k drafts writes k rows"
            )
        self.buckets = options.buckets
        # The bucket of each batch size, by index.
        self._bucket_of = [next(b for b in self.buckets if b >= B) for B in range(self.buckets[-1] + 1)]
        P = f"model.layers.{cfg.mtp_layer_index}."
        self.arena = arena = DeviceArena(gpu)
        self.pools: SlotPools | None = None
        self._mapped: list[MappedBuffer] = []
        self._slots_free = list(range(options.max_sequences - 1, -1, -1))
        # The live states by id: the batch check's one set operation (see _batch).
        self._states: dict[int, ProposerState] = {}
        self._graphs: dict[tuple[int, int], Graph] = {}
        try:

            def vec(name: str) -> DevicePtr:
                return arena.upload(src.checked(P + name, (H,)))

            self.enorm, self.hnorm = vec("enorm.weight"), vec("hnorm.weight")
            self.head_norm = vec("shared_head.norm.weight")
            self.eh_proj = arena.upload(src.checked(P + "eh_proj.weight", (H, 2 * H)))
            attn = load_attention(arena, src, P, cfg, sh, native_fp8=options.native_fp8)
            mlp = load_moe(
                arena,
                src,
                P,
                cfg,
                sh,
                native_fp8=options.native_fp8,
                quantize_experts=options.quantize_experts,
            )
            want_tcp = options.tensor_core_projections
            self.tensor_core_projections = options.max_sequences >= 4 if want_tcp is None else bool(want_tcp)
            want_asr = options.attention_split_rows
            self.attention_split_rows = (
                sparse_mla.auto_split_rows(options.max_sequences) if want_asr is None else want_asr
            )
            self.layer = DecoderLayer(
                gpu,
                cfg,
                sh,
                attn,
                mlp,
                comm,
                selection_extra=shared_selection_extra(cfg.dsa, options.max_draft_tokens),
                tensor_core=self.tensor_core_projections,
                attention_split_rows=self.attention_split_rows,
            )
            if tables is None:
                emb = (
                    P + "embed_tokens.weight"
                    if P + "embed_tokens.weight" in src
                    else "model.embed_tokens.weight"
                )
                head = (
                    P + "shared_head.head.weight"
                    if P + "shared_head.head.weight" in src
                    else "lm_head.weight"
                )
                tables = SharedTables(
                    arena.upload(src.checked(emb, (V, H))), arena.upload(src.checked(head, (V, H))), V, H
                )
            if (tables.vocab, tables.hidden) != (V, H):
                raise WeightError(
                    f"shared embedding/head tables are [{tables.vocab}, {tables.hidden}] but the "
                    f"checkpoint's config needs [{V}, {H}]: the vocabulary shards would not match"
                )
            self.tables = tables
            # Vocabulary shard of the head this rank sweeps (whole vocabulary when the world size
            # does not divide it: then every rank sweeps all of it and no exchange is needed).
            self.head_sharded = W > 1 and V % W == 0
            self.head_n = V // W if self.head_sharded else V
            self.head_v0 = cfg.parallel.rank * self.head_n if self.head_sharded else 0
            self.head_bf16 = tables.lm_head.offset(self.head_v0 * H * 2)
            self.head_fp8 = self.head_fp8_scales = None
            if options.fp8_head:
                self._quantize_head()
            can_tc = self.head_fp8 is not None and not self.head_sharded and H % 64 == 0
            want_tc = options.tensor_core_head
            self.tensor_core_head = can_tc and options.max_sequences >= 4 if want_tc is None else want_tc
            if self.tensor_core_head and not can_tc:
                raise ProposerError(
                    "tensor_core_head needs the FP8 head on one rank (not sharded by vocabulary) and a "
                    f"hidden size divisible by 64 (got fp8 head {self.head_fp8 is not None}, "
                    f"sharded {self.head_sharded}, hidden {H})"
                )
            self.weights_nbytes = arena.nbytes
            self.pools = SlotPools(
                gpu,
                cfg.dsa,
                cfg.attention.kv_lora_rank,
                self.rows_cap,
                options.max_sequences,
                rope_dim=cfg.attention.qk_rope_head_dim,
            )
            # eh_proj on tensor cores too (its input rows and flags by mtp_embed_norm_batch).
            self.eh_segments = (GemvSegment(w=self.eh_proj, scales=None, rows=H, col=0),)
            self.tc_eh = self.tensor_core_projections and pm.proj_mma_supported(2 * H, 2 * H)
            eh_part = pm.proj_workspace_bytes(self.eh_segments, 1, 2 * H, 1, H) if self.tc_eh else 0
            self.part_row_bytes = max(self.layer.part_row_bytes, eh_part)
            m = self.buckets[-1]
            self.scratch = BatchScratch.alloc(
                arena,
                cfg,
                sh,
                m,
                self.rows_cap,
                attn.fused_rows,
                self.layer.selection_extra,
                part_row_bytes=self.part_row_bytes,
                attn_split_rows=self.layer.attn_split_rows,
            )
            self.step = self._alloc_step(m)
            self.ctx = self._alloc_context(options.context_chunk)
        except Exception:
            self._free_device()
            raise
        log.info(
            "MTP proposer: %d sequences of %d context rows, buckets %s, head %s, %.1f MiB of weights",
            options.max_sequences,
            self.rows_cap,
            self.buckets,
            "FP8" if self.head_fp8 else "BF16",
            self.weights_nbytes / 2**20,
        )

    def _alloc_step(self, m: int) -> StepBuffers:
        H, kmax, z = self.cfg.hidden_size, self.opt.max_draft_tokens, self.arena.zeros
        entries_in = self.gpu.alloc_mapped(m * ENTRY_BYTES)
        self._mapped.append(entries_in)
        # Pinned memory starts as the OS left it; a propose writes words 0..2 of its entries and
        # the padding entries, so the reserved word stays this zero.
        entries_in.host[:] = 0
        drafts_out = self.gpu.alloc_mapped(m * kmax * 4 + m * FLAG_BYTES)
        self._mapped.append(drafts_out)
        sampling_in = self.gpu.alloc_mapped(m * SAMPLE_WORDS * 4)
        self._mapped.append(sampling_in)
        probs_out = self.gpu.alloc_mapped(m * kmax * 4)
        self._mapped.append(probs_out)
        return StepBuffers(
            rows=m,
            kmax=kmax,
            entries=z(m * ENTRY_BYTES),
            hidden_in=z(m * H * 2),
            x=z(m * H * 2),
            xn=z(m * H * 2),
            concat=z(m * 2 * H * 2) if self.tc_eh else None,
            logits=z(m * self.head_n * 2),
            keys=z(m * 8),
            am_idx=z(m * 4),
            am_val=z(m * 4),
            head_counter=z(4),
            drafts=z(m * kmax * 4),
            entries_in=entries_in,
            drafts_out=drafts_out,
            sampling=z(m * SAMPLE_WORDS * 4),
            sampling_in=sampling_in,
            probs=z(m * kmax * 4),
            probs_out=probs_out,
            sample_ws=z(max(self._sample_workspace_bytes(m), 4)),
        )

    def _sample_workspace_bytes(self, m: int) -> int:
        if self.head_sharded:
            W = self.cfg.parallel.world_size
            return draft_sample_shard.shard_sample_workspace_bytes(m, W, self.head_n, SHARD_TOP_K_MAX)
        return sample_workspace_bytes(m, self.head_n)

    def _alloc_context(self, rows: int) -> ContextBuffers:
        H, z = self.cfg.hidden_size, self.arena.zeros
        return ContextBuffers(
            rows=rows,
            entries=z(rows * ENTRY_BYTES),
            hidden=z(rows * H * 2),
            concat=z(rows * 2 * H * 2),
            x=z(rows * H * 2),
            fused=z(rows * self.layer.ctx_rows * 2),
            xn=z(rows * xn_stride(self.cfg) * 2),
            proj_part=z(rows * self.part_row_bytes) if self.part_row_bytes else None,
            finite_row=z(4 * self.opt.max_sequences),
        )

    def _free_device(self) -> None:
        for g in self._graphs.values():
            self.gpu.graph_destroy(g)
        self._graphs.clear()
        if self.pools is not None:
            self.pools.free()
            self.pools = None
        for mb in self._mapped:
            self.gpu.free_mapped(mb)
        self._mapped = []
        self.arena.free()

    @property
    def captured_graphs(self) -> dict[tuple[int, int], Graph]:
        """The live graphs by (batch bucket, k)."""
        return dict(self._graphs)

    def memory_report(self) -> dict[str, int]:
        """Device bytes this proposer holds, by kind (graphs are the driver's and not counted
        here: a benchmark measures them from the device's free memory)."""
        pools = self.pools.nbytes_by_kind
        scratch = self.arena.nbytes - self.weights_nbytes
        mapped = sum(mb.nbytes for mb in self._mapped)
        return {"weights": self.weights_nbytes, **pools, "scratch": scratch, "mapped_host": mapped}

    def _agree_with_peers(self, options: ProposerOptions) -> None:
        """Every rank must run the same model with the same sharding options, or their collectives
        would pair up different tensors. One all-gather of a config fingerprint settles it before
        any weight is loaded; a dead peer surfaces here as the communicator's timeout."""
        what = {
            "config": {k: v for k, v in self.cfg.to_hf_dict().items()},
            "o_proj_groups": options.o_proj_groups,
            "fp8_head": options.fp8_head,
            "native_fp8": options.native_fp8,
            "quantize_experts": options.quantize_experts,
            "tensor_core_projections": options.tensor_core_projections,
            "attention_split_rows": options.attention_split_rows,
        }
        fp = int.from_bytes(hashlib.sha256(json.dumps(what, sort_keys=True).encode()).digest()[:8], "little")
        W, gpu = self.cfg.parallel.world_size, self.gpu
        send, recv = gpu.alloc(8), gpu.alloc(8 * W)
        try:
            gpu.copy_h2d(send, np.array([fp], np.uint64))
            self.comm.all_gather(send, recv, 1, CommDtype.UINT64, stream=self.stream)
            gpu.synchronize(self.stream)
            got = np.empty(W, np.uint64)
            gpu.copy_d2h(got, recv)
        finally:
            gpu.free(send)
            gpu.free(recv)
        bad = [r for r in range(W) if got[r] != got[0]]
        if bad:
            raise CommError(
                f"rank {self.cfg.parallel.rank}: ranks {bad} run a different model config or "
                "sharding options than rank 0 (config fingerprints differ)"
            )

    def _quantize_head(self) -> None:
        """The FP8 copy of the head, if the backend has the kernels its path launches (a PTX
        directory built without them drafts with the BF16 head instead of failing at the first
        propose): the quantisation, then the one-launch head on one rank, or the FP8 GEMV whose
        logits the sharded argmax exchanges."""
        head = ("gemv_fp8w", "gemv_fp8w_batch") if self.head_sharded else draft_head.HEAD_ARGMAX_FP8_BATCH.key
        missing = [k for k in (("quantize_fp8", "quantize_fp8"), head) if not self.gpu.try_kernel(*k)]
        if missing:
            log.warning(
                "FP8 draft head unavailable on the %s backend (no %s); drafting with the BF16 head",
                self.gpu.name,
                ", ".join(".".join(k) for k in missing),
            )
            return
        H, n = self.cfg.hidden_size, self.head_n
        self.head_fp8 = self.arena.zeros(n * H)
        self.head_fp8_scales = self.arena.zeros(n * 4)
        quantize_fp8(self.gpu, self.head_bf16, self.head_fp8, self.head_fp8_scales, n, H, self.stream)
        self.gpu.synchronize(self.stream)

    # ---- sizing ---------------------------------------------------------------------------------

    @property
    def drafter_context_rows(self) -> int:
        return self.rows_cap

    # ---- lifecycle ------------------------------------------------------------------------------

    @exclusive()
    def alloc_state(self) -> ProposerState:
        """A free slot of the pools (allocated up front: this allocates nothing on the device)."""
        if not self._slots_free:
            raise ProposerError(f"all {self.opt.max_sequences} sequence slots are in use")
        slot = self._slots_free.pop()
        st = ProposerState(slot=slot, dsa=DsaState(slot, self.rows_cap), owner=self.label)
        self._states[id(st)] = st
        return st

    @exclusive(after_close=True)
    def free_state(self, st: ProposerState) -> None:
        """Give the slot back; its bytes stay, unreachable, until a new sequence overwrites them.
        A second call is a no-op (so is a call after ``close``, which freed every state)."""
        self._own(st)
        if st.released:
            return
        st.released = True
        del self._states[id(st)]
        self._slots_free.append(st.slot)

    @exclusive(after_close=True)
    def close(self) -> None:
        """Free every state, the graphs, the pools and the weights; every later call is refused. A
        second call is a no-op."""
        if self._closed:
            return
        self.gpu.synchronize(self.stream)
        for st in list(self._states.values()):
            self.free_state(st)
        self._free_device()
        self._closed = True

    def _own(self, st: ProposerState) -> None:
        if not isinstance(st, ProposerState):
            raise ProposerError(
                f"expected a ProposerState from {self.label}.alloc_state, got {type(st).__name__}"
            )
        if st.owner != self.label:
            raise ProposerError(
                f"the state of slot {st.slot} belongs to {st.owner or 'no proposer'}, not {self.label}: "
                "a state is used only with the proposer that allocated it (its rows live in that "
                "proposer's pool)"
            )

    def _live(self, st: ProposerState) -> None:
        self._own(st)
        if st.released:
            raise ProposerError(f"proposer state of slot {st.slot} was freed; allocate a new one")

    def _batch(self, states, call: str, *lists: tuple[str, Sequence]) -> list[ProposerState]:
        """The batch's states, every one live, this proposer's and listed once, and every other
        argument with one entry per state; else a ProposerError naming the problem."""
        try:
            states = list(states)
        except TypeError:
            raise ProposerError(f"{call}: states must be a sequence of ProposerState") from None
        if not states:
            raise ProposerError(f"{call}: the batch is empty")
        for name, values in lists:
            try:
                n = len(values)
            except TypeError:
                raise ProposerError(f"{call}: {name} must be a sequence with one entry per state") from None
            if n != len(states):
                raise ProposerError(f"{call}: {len(states)} states but {n} {name}")
        # The common case as one set operation: B distinct states, all among this proposer's live
        # ones (a propose at B = 64 spent 40 us here checking state by state, then 5 us in a pass
        # over the states' fields and a set; now 4). The slow pass below names what is wrong.
        ids = set(map(id, states))
        if len(ids) == len(states) and ids <= self._states.keys():
            return states
        seen: dict[int, int] = {}
        for b, st in enumerate(states):
            try:
                self._live(st)
            except ProposerError as e:
                raise ProposerError(f"{call} entry {b} of {len(states)}: {e}") from None
            if id(st) in seen:
                raise ProposerError(
                    f"{call}: the sequence in slot {st.slot} is listed twice (batch entries "
                    f"{seen[id(st)]} and {b}); each sequence appears once per batch"
                )
            seen[id(st)] = b
        return states

    # ---- queries --------------------------------------------------------------------------------

    @exclusive()
    def drafter_rows(self, st: ProposerState) -> int:
        self._live(st)
        return st.rows

    @exclusive()
    def last_pair_key(self, st: ProposerState) -> int | None:
        self._live(st)
        return st.rows - 1 if st.rows > 0 else None

    # ---- context rows ---------------------------------------------------------------------------

    @exclusive()
    def prefill_drafter(
        self, st: ProposerState, prompt_tokens: Sequence[int], hiddens, *, stream=None
    ) -> int:
        return self.catchup_drafter(st, prompt_tokens, hiddens, 0, stream=stream)

    @exclusive()
    def catchup_drafter(
        self, st: ProposerState, tokens: Sequence[int], hiddens, row_base: int, *, stream=None
    ) -> int:
        """Append rows ``row_base + r = (embed(tokens[r+1]), hiddens[r])``. Returns rows written.
        The batch of one of ``catchup_batch``."""
        return self.catchup_batch([st], [tokens], [hiddens], [row_base], stream=stream)[0]

    @exclusive()
    def catchup_batch(self, states, tokens, hiddens, row_bases, *, stream=None) -> list[int]:
        """For each sequence b, append rows ``row_bases[b] + r = (embed(tokens[b][r+1]),
        hiddens[b][r])``; returns the rows written per sequence. ``hiddens[b]`` is a DevicePtr to
        ``len(tokens[b]) - 1`` BF16 rows of hidden_size, or an object exposing
        ``__cuda_array_interface__`` of that shape. The rows of all sequences go through the
        weights together, ``context_chunk`` rows per launch.

        Everything is checked first, the hidden rows' finiteness included (one read of each): any
        problem is refused naming the sequence, and no sequence is changed."""
        states = self._batch(
            states, "catchup_batch", ("token lists", tokens), ("hiddens", hiddens), ("row bases", row_bases)
        )
        s = self._stream(stream)
        H = self.cfg.hidden_size
        plan: list[tuple[ProposerState, np.ndarray, object, int]] = []
        for b, st in enumerate(states):
            where = f"catchup_batch entry {b} of {len(states)}: slot {st.slot}"
            try:
                base = as_int(row_bases[b], "row_base")
                toks = self._check_tokens(tokens[b])
                rows = max(len(toks) - 1, 0)
                if rows:
                    st.dsa.check_advance(base, rows)
            except ProposerError as e:
                raise type(e)(f"{where}: {e}") from None
            plan.append((st, toks, hiddens[b], rows))
        with self._borrowed_rows(
            [(h, rows, f"hiddens of sequence {b}") for b, (_, _, h, rows) in enumerate(plan)]
        ) as ptrs:
            # One check per sequence, one wait for all of them (a wait per sequence cost more than
            # the catch-up's own launches at B = 64).
            for b, ((_, _, _, rows), p) in enumerate(zip(plan, ptrs)):
                if rows:
                    all_finite_bf16(self.gpu, p, rows, H, self.ctx.finite_row.offset(4 * b), s)
            self.gpu.synchronize(s)
            found = np.empty(len(plan), np.uint32)
            self.gpu.copy_d2h(found, self.ctx.finite_row)
            for b, (st, _, _, rows) in enumerate(plan):
                if rows and int(found[b]) != NO_BAD_ROW:
                    raise ProposerError(
                        f"catchup_batch entry {b} of {len(states)}: slot {st.slot}: hidden row {int(found[b])} "
                        f"(drafter row {st.rows + int(found[b])}) is not finite (NaN or Inf); no sequence was "
                        "changed"
                    )
            # Every sequence's rows, in order, a sequence's rows consecutive and ascending (the
            # cache write finds a pool's rows of the same launch by that order).
            work = [(b, r) for b, (_, _, _, rows) in enumerate(plan) for r in range(rows)]
            for c in range(0, len(work), self.ctx.rows):
                self._context_chunk(plan, ptrs, work[c : c + self.ctx.rows], s)
            self.gpu.synchronize(s)
        for st, _, _, rows in plan:
            st.dsa.advance(rows)
        return [rows for _, _, _, rows in plan]

    def _context_chunk(self, plan, ptrs, chunk: list[tuple[int, int]], s) -> None:
        gpu, cfg, cb, H = self.gpu, self.cfg, self.ctx, self.cfg.hidden_size
        n = len(chunk)
        ent = np.zeros((n, ENTRY_WORDS), np.uint32)
        for e, (b, r) in enumerate(chunk):
            st, toks = plan[b][0], plan[b][1]
            ent[e, 0], ent[e, 1], ent[e, 2] = st.slot, st.rows + r, toks[r + 1]
        gpu.synchronize(s)  # the staging below is rewritten; the last chunk must have read it
        gpu.copy_h2d(cb.entries, ent)
        e = 0
        while e < n:  # one copy per run of a sequence's rows
            b, r0 = chunk[e]
            run = 1
            while e + run < n and chunk[e + run][0] == b:
                run += 1
            gpu.copy_d2d(cb.hidden.offset(e * H * 2), ptrs[b].offset(r0 * H * 2), run * H * 2, s)
            e += run
        mtp_embed_norm_batch(
            gpu,
            table=self.tables.embed,
            entries=cb.entries,
            enorm=self.enorm,
            hidden=cb.hidden,
            hnorm=self.hnorm,
            out=cb.concat,
            m=n,
            vocab=cfg.vocab_size,
            h=H,
            eps=cfg.rms_norm_eps,
            stream=s,
        )
        self._eh_proj(cb.concat, cb.x, n, cb.proj_part, s)
        self._context_rows(n, s)

    def _context_rows(self, n: int, s) -> None:
        """The caches of the chunk's ``n`` rows ``ctx.x[n, H]``: the layer's cache-only path (a
        context row's attention and MoE output is never read)."""
        self.layer.context_rows(
            self.ctx.x,
            self.ctx.fused,
            self.pools,
            self.ctx.entries,
            n,
            s,
            xn=self.ctx.xn,
            part=self.ctx.proj_part,
        )

    @exclusive()
    def rewind_to(self, st: ProposerState, n: int) -> None:
        """Drop rows ``n..``: the caches keep their bytes, which later feeds overwrite."""
        self._live(st)
        st.dsa.rewind_to(as_int(n, "n"))
        st.last_drafted = 0

    # ---- drafting -------------------------------------------------------------------------------
    # ``_context_rows``, ``_launch_step``, ``_block`` and ``_head`` are the parts a timing or
    # diagnostic subclass replaces (bench/bench_propose.py ArmProposer, the tests' full-block
    # context rows); the proposer itself has no switch for them.

    @exclusive()
    def propose(
        self,
        st: ProposerState,
        last_token: int,
        target_hidden,
        position: int,
        k: int,
        *,
        sampling: SamplingParams | None = None,
        draft_dist=None,
        stream=None,
    ):
        """k drafts for one sequence: the batch of one of ``propose_batch``. A list of k tokens;
        with ``sampling``, ``SampledDrafts(tokens, probs)`` of lists (``draft_dist``: f32
        [k, vocab], as ``propose_batch``'s row)."""
        out = self.propose_batch(
            [st],
            [last_token],
            target_hidden,
            [position],
            k,
            sampling=sampling,
            draft_dist=draft_dist,
            stream=stream,
        )
        if sampling is None:
            return [int(t) for t in out[0]]
        return SampledDrafts([int(t) for t in out.tokens[0]], [float(q) for q in out.probs[0]])

    @exclusive()
    def propose_batch(
        self,
        states,
        last_tokens,
        target_hiddens,
        positions,
        k: int,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        draft_dist=None,
        stream=None,
    ):
        """k drafts for each sequence of the batch, as an int64 array ``[B, k]``. Draft 1 of
        sequence b consumes ``target_hiddens`` row b (B contiguous BF16 rows of hidden_size: a
        DevicePtr, or an object exposing ``__cuda_array_interface__`` of shape ``[B, hidden]``);
        drafts 2..k its own output. Sequence b's drafter must hold at least ``positions[b]`` rows;
        one ahead of its position is rewound to it.

        With graphs the batch replays the graph of the smallest bucket that holds it, padded
        with entries that read and write nothing of any sequence.

        Non-finite values: the step's kernels raise flag bytes per sequence that come back with
        the drafts (no extra sync). Then this raises a ProposerError naming the first such sequence
        and the cause, and no draft of any sequence is committed: row counts and ``last_pair_key``
        are as before the call, except that rewinds to ``positions`` stand (rows ``position..``
        were rewritten by the step): such a sequence then holds ``position`` rows and
        ``after_verify`` has nothing to trim, as after ``rewind_to``.

        Sampling: ``sampling`` is one ``SamplingParams`` for the whole batch or one per sequence.
        Then draft i of sequence b is drawn from the drafter's distribution q (model.sampling's
        rules on its logits, the keyed noise at (seed, ``positions[b]``, i)), and the call returns
        ``SampledDrafts(tokens int64 [B, k], probs float32 [B, k])`` with probs[b, i] = q(token).
        A greedy sequence (temperature 0) drafts exactly what it drafts without ``sampling``,
        with probability 1. ``draft_dist``: a caller's f32 buffer [B, k, vocab] (a DevicePtr, or a
        ``__cuda_array_interface__`` array) that receives every draft's whole q(.) (what the
        standard residual resampling needs); on a vocabulary-sharded head each rank writes its
        own columns."""
        t_enter = time.perf_counter()
        if self._broken is not None:
            # Its peers are gone or out of step: another step would pair its collectives with ranks
            # that are not there. Calls that meet no peer (catch-up, rewinds, frees) still run.
            raise CommError(
                f"{self.label} is broken since a collective with its peers failed (propose refused; "
                f"close it and build a new one): {self._broken}"
            )
        states = self._batch(states, "propose_batch", ("last tokens", last_tokens), ("positions", positions))
        B = len(states)
        k = as_int(k, "k")
        if not 1 <= k <= self.opt.max_draft_tokens:
            raise ProposerError(f"k={k} outside 1..{self.opt.max_draft_tokens} (max_draft_tokens)")
        if B > self.buckets[-1]:
            raise ProposerError(
                f"propose_batch of {B} sequences: the largest batch bucket holds {self.buckets[-1]}"
            )
        V = self.cfg.vocab_size
        toks = self._ints(last_tokens, states, "propose_batch", "last_token")
        pos = self._ints(positions, states, "propose_batch", "position")
        rows = np.fromiter((st.dsa.length for st in states), np.int64, B)
        # As unsigned, a negative token or position is past every bound, so each needs one
        # comparison (3.2 -> 2.0 us; k <= max_draft_tokens <= rows_cap keeps the bound >= 0).
        bad = (toks.view(np.uint64) >= V) | (pos.view(np.uint64) > self.rows_cap - k) | (rows < pos)
        if np.count_nonzero(bad):
            b = int(np.flatnonzero(bad)[0])
            t, p, where = int(toks[b]), int(pos[b]), f"propose_batch entry {b} of {B}: slot {states[b].slot}"
            if not 0 <= t < V:
                raise ProposerError(f"{where}: last_token {t} is outside the vocabulary 0..{V - 1}")
            if p < 0 or p + k > self.rows_cap:
                raise ProposerError(
                    f"{where}: propose at position {p} with k={k} runs past the {self.rows_cap} rows "
                    "the drafter was sized for"
                )
            raise ProposerError(
                f"{where}: drafter holds {int(rows[b])} rows but propose is at position {p}: catch up "
                "the missing rows first"
            )
        params = self._sampling(sampling, states, "propose_batch")
        sampled = params is not None and not all(p.greedy for p in params)
        s = self._stream(stream)
        m = self._bucket_of[B] if self.opt.use_graphs else B
        step, H = self.step, self.cfg.hidden_size
        dist_buf = draft_dist if sampling is not None else None
        if type(target_hiddens) is DevicePtr and dist_buf is None:
            # What _borrowed_rows does for this backend's pointer, without building it (3 us a call).
            self._check_buffer(target_hiddens, B * H * 2, "target_hiddens")
            lent = nullcontext((target_hiddens, None))
        else:
            lent = self._borrowed_rows(
                [(target_hiddens, B, "target_hiddens")], [(dist_buf, (B, k, V), "draft_dist")]
            )
        with lent as (hid, dist):
            # Read by the step's first kernel, inside the graph when there is one: the host writes
            # mapped pinned memory instead of issuing copies (the previous step has finished, since
            # propose waits for its drafts).
            ent = step.entries_host
            ent[:B, 0] = np.fromiter((st.slot for st in states), np.uint32, B)
            ent[:B, 1] = pos
            ent[:B, 2] = toks
            ent[B:m] = _PAD_ENTRY
            step.flag_words_host[:m] = 0
            if sampled or dist is not None:
                sampled = True
                rec = step.sampling_host
                rec[:m] = 0
                base = 0 if dist is None else dist.addr
                for b, p in enumerate(params):
                    rec[b] = pack_sampling(p, int(pos[b]), 0 if dist is None else base + b * k * V * 4)
            self.gpu.copy_d2d(step.hidden_in, hid, B * H * 2, s)
            try:
                self._launch_step(m, k, s, sampled)
                t_wait = time.perf_counter()
                self._wait(s)
            except BaseException as e:
                # The step did not finish: as after a flagged step; peers that failed leave the
                # proposer unusable.
                self._uncommitted(states, rows, pos)
                if isinstance(e, CommError):
                    self._broken = f"{type(e).__name__}: {e}"
                raise
            t_done = time.perf_counter()
        words = step.flag_words_host[:B]
        if np.count_nonzero(words):  # a kernel of the step raised a non-finite flag
            flags = step.flags_host[:B]
            b = int(np.flatnonzero(words)[0])
            self._uncommitted(states, rows, pos)
            raise ProposerError(
                f"propose_batch entry {b} of {B}: slot {states[b].slot} at position {pos[b]}: "
                f"{nonfinite_problem(flags[b])}; no draft of the batch was committed"
            )
        drafts = step.drafts_host[:B, :k].astype(np.int64)
        probs = None
        if params is not None:
            probs = step.probs_host[:B, :k].copy() if sampled else np.ones((B, k), np.float32)
        host_s = (t_wait - t_enter) + (time.perf_counter() - t_done)
        for st, end in zip(states, (pos + k).tolist()):
            st.dsa.length = end
            st.last_drafted = k
            st.last_host_s = host_s
        return drafts if probs is None else SampledDrafts(drafts, probs)

    @staticmethod
    def _uncommitted(states: list[ProposerState], rows: np.ndarray, pos: np.ndarray) -> None:
        """After a step that committed nothing: each sequence that was ahead of its position holds
        ``position`` rows (the step rewrote rows ``position..``) and nothing to trim, as after
        ``rewind_to``; the others are as before the call. A committed step sets every row count,
        so the rewinds wait for this (12 us of a propose at B = 64 that rewinds every sequence)."""
        for b in np.flatnonzero(rows > pos).tolist():
            states[b].dsa.rewind_to(int(pos[b]))
            states[b].last_drafted = 0

    @staticmethod
    def _ints(values, states, call: str, what: str) -> np.ndarray:
        """One integer per state as int64, without a Python check per element when they are
        plainly integers (a list of ints, an integer array); anything else goes through
        ``as_int`` element by element, which names the first that is not one."""
        if isinstance(values, np.ndarray):
            a = values
        elif not {bool, np.bool_}.isdisjoint(map(type, values)):
            a = None  # NumPy would read [1, True] as integers; as_int refuses the bool
        else:
            a = np.asarray(values)
        if a is not None and a.ndim == 1 and a.dtype.kind in "iu" and a.dtype != np.uint64:
            return a.astype(np.int64, copy=False)
        return np.array(
            [
                as_int(v, f"{call} entry {b} of {len(states)}: slot {st.slot}: {what}")
                for b, (v, st) in enumerate(zip(values, states))
            ],
            np.int64,
        )

    def _bucket(self, B: int) -> int:
        return self._bucket_of[B]

    def _stream(self, stream) -> int:
        if stream is None:
            return self.stream
        handle = getattr(stream, "cuda_stream", stream)  # torch.cuda.Stream, or a raw handle
        if isinstance(handle, bool) or not isinstance(handle, (int, np.integer)):
            raise ProposerError(f"stream must be a CUDA stream handle (an int), got {type(stream).__name__}")
        return self.gpu.adopt_stream(int(handle))

    def _launch_step(self, m: int, k: int, s: int, sampled: bool = False) -> None:
        """Enqueue the k-draft step over m entries: as the bucket's graph (captured on first use)
        or as eager launches."""
        if self.opt.use_graphs:
            self._replay_graph(m, k, s, sampled)
        else:
            self._enqueue_drafts(m, k, s, sampled)

    def _replay_graph(self, m: int, k: int, s: int, sampled: bool) -> None:
        # A sampled step is its own graph (the sampler after each head), so a greedy batch pays
        # nothing for sampling: (bucket, k) greedy, (bucket, k, "sampled") sampled.
        gpu, key = self.gpu, (m, k, "sampled") if sampled else (m, k)
        g = self._graphs.get(key)
        if g is None:
            gpu.begin_capture(s)
            try:
                self._enqueue_drafts(m, k, s, sampled)
            except BaseException:
                gpu.abort_capture()
                raise
            g = self._graphs[key] = gpu.end_capture(
                s, label=f"propose bucket={m} k={k}" + (" sampled" if sampled else "")
            )
        gpu.graph_launch(g, s)

    def _enqueue_drafts(self, m: int, k: int, s: int, sampled: bool = False) -> None:
        # The first draft's eh_proj streams its weights while this reads the host.
        st = self.step
        copy_words(self.gpu, st.entries_in.device, st.entries, m * ENTRY_WORDS, s)
        if sampled:
            copy_words(self.gpu, st.sampling_in.device, st.sampling, m * SAMPLE_WORDS, s)
        for i in range(k):
            self._draft_step(m, i, publish=i == k - 1, s=s, sampled=sampled)

    def _draft_step(self, m: int, i: int, publish: bool, s: int, sampled: bool = False) -> None:
        """Draft i of every entry; with ``publish`` (the step's last draft) the launch that commits
        it also copies drafts 0..i to ``step.drafts_out``."""
        self._mtp_input(m, i, s)
        self._block(m, i, s)
        # A sampled step's head commits the argmax without publishing; the sampler then draws
        # each sampled row's token (a greedy row keeps the argmax) and publishes drafts and probs.
        if sampled and self.head_sharded:
            # The sharded sampler draws every row, greedy ones included, from this rank's logits and
            # the ranks' exchanged candidates (model/kernels/draft_sample_shard.py).
            self._head_with(m, i, publish, s, *self._head_weights(), sampled=True)
            return
        self._head(m, i, publish and not sampled, s)
        if sampled:
            self._sample(m, i, publish, s)

    def _mtp_input(self, m: int, i: int, s: int) -> None:
        """step.x = eh_proj . [rmsnorm(embed[token]) * enorm ; rmsnorm(hidden) * hnorm] for draft i
        (hidden: the target's rows, then the drafter's own), each entry's input flags raised."""
        cfg, st = self.cfg, self.step
        H = cfg.hidden_size
        inputs = dict(
            table=self.tables.embed,
            entries=st.entries,
            enorm=self.enorm,
            hidden=st.hidden_in if i == 0 else st.xn,
            hnorm=self.hnorm,
            m=m,
            vocab=cfg.vocab_size,
            h=H,
            eps=cfg.rms_norm_eps,
            flags=st.flags,
            flag_byte=FLAG_TARGET_HIDDEN if i == 0 else FLAG_OWN_HIDDEN,
            stream=s,
        )
        if self.tc_eh:
            # The input rows, then eh_proj on tensor cores (model/kernels/proj_mma.py).
            mtp_embed_norm_batch(self.gpu, out=st.concat, **inputs)
            self._eh_proj(st.concat, st.x, m, self.scratch.proj_part, s)
        else:
            # Both input norms are every block's prologue of eh_proj (one launch, no concat round trip).
            mtp_input_gemv_batch(self.gpu, w=self.eh_proj, y=st.x, n=H, **inputs)

    def _eh_proj(self, concat: DevicePtr, x: DevicePtr, n: int, part: DevicePtr | None, s) -> None:
        """x[n, H] = eh_proj . concat[n, 2H]: on tensor cores with tc_eh, else the CUDA-core GEMV."""
        H = self.cfg.hidden_size
        if not self.tc_eh:
            gemv_bf16_batch(self.gpu, self.eh_proj, concat, x, n, H, 2 * H, s)
            return
        pm.proj_mma_batch(
            self.gpu,
            x=concat,
            x_stride=2 * H,
            segments=self.eh_segments,
            y=x,
            y_stride=H,
            m=n,
            k=2 * H,
            out_f32=False,
            part=part,
            stream=s,
        )

    def _sample(self, m: int, i: int, publish: bool, s: int) -> None:
        st = self.step
        draft_sample.draft_sample_batch(
            self.gpu,
            logits=st.logits,
            sampling=st.sampling,
            entries=st.entries,
            drafts=st.drafts,
            probs=st.probs,
            host_drafts=st.drafts_out.device,
            host_probs=st.probs_out.device,
            draft_index=i,
            kmax=st.kmax,
            publish=publish,
            m=m,
            n=self.head_n,
            workspace=st.sample_ws,
            stream=s,
        )

    def _block(self, m: int, i: int, s: int) -> None:
        """Draft i's block over ``step.x`` at rows ``entry.row + i``, leaving the head's input
        ``step.xn = rmsnorm(x) * head_norm``. Drafts 2..k reuse draft 1's pool selection when the
        config shares it."""
        self.layer.full_rows(
            self.step.x,
            self.scratch,
            self.pools,
            self.step.entries,
            m,
            i,
            s,
            next_norm=(self.head_norm, self.step.xn),
            reuse_selection=i > 0 and self.cfg.dsa.share_for_mtp_iteration,
        )

    def _head(self, m: int, i: int, publish: bool, s: int) -> None:
        """Draft i's tokens from ``step.xn``, with the FP8 copy of the head when there is one."""
        self._head_with(m, i, publish, s, *self._head_weights())

    def _head_weights(self) -> tuple[DevicePtr, DevicePtr | None]:
        if self.head_fp8 is not None:
            return self.head_fp8, self.head_fp8_scales
        return self.head_bf16, None

    def _head_with(
        self, m: int, i: int, publish: bool, s: int, w: DevicePtr, sc: DevicePtr | None, sampled: bool = False
    ) -> None:
        """The head with weights ``w`` (this rank's vocabulary rows; FP8 with per-row scales
        ``sc``, else BF16): each row's argmax becomes its entry's token and its draft i."""
        gpu, st, H, n = self.gpu, self.step, self.cfg.hidden_size, self.head_n
        commit = dict(
            entries=st.entries,
            drafts=st.drafts,
            draft_index=i,
            kmax=st.kmax,
            host_drafts=st.drafts_out.device,
            publish=publish,
            m=m,
            flags=st.flags,
            flag_byte=FLAG_LOGITS,
            stream=s,
        )
        if not self.head_sharded:
            # One launch: head GEMV, argmax, commit of the draft tokens (keys stay zero).
            head = (
                draft_head.head_argmax_batch_mma
                if self.tensor_core_head and sc is not None
                else draft_head.head_argmax_batch
            )
            head(
                gpu,
                w=w,
                scale=sc,
                x=st.xn,
                logits=st.logits,
                keys=st.keys,
                counter=st.head_counter,
                n=n,
                k=H,
                **commit,
            )
            return
        if sc is not None:
            gemv_fp8w_batch(gpu, w, sc, st.xn, st.logits, m, n, H, s)
        else:
            gemv_bf16_batch(gpu, w, st.xn, st.logits, m, n, H, s)
        if sampled:
            draft_sample_shard.sample_sharded_batch(
                gpu,
                self.comm,
                logits=st.logits,
                v0=self.head_v0,
                n_local=n,
                vocab=self.cfg.vocab_size,
                sampling=st.sampling,
                entries=st.entries,
                drafts=st.drafts,
                probs=st.probs,
                host_drafts=st.drafts_out.device,
                host_probs=st.probs_out.device,
                draft_index=i,
                kmax=st.kmax,
                publish=publish,
                m=m,
                workspace=st.sample_ws,
                flags=st.flags,
                flag_byte=FLAG_LOGITS,
                top_k_cap=SHARD_TOP_K_MAX,
                stream=s,
            )
            return
        argmax_bf16_batch(gpu, st.logits, st.am_idx, st.am_val, m, n, s)
        draft_head.argmax_pack_batch(
            gpu, idx=st.am_idx, val=st.am_val, keys=st.keys, v0=self.head_v0, m=m, stream=s
        )
        self.comm.all_reduce(st.keys, m, CommDtype.UINT64, ReduceOp.MAX, stream=s)
        draft_head.draft_commit_batch(gpu, keys=st.keys, **commit)

    def _wait(self, stream: int) -> None:
        """Wait for the drafts. With peers in the step a dead rank would leave the stream
        unfinished forever; a communicator that can bound the wait (NCCL's ``wait``) turns that
        into a CommError."""
        wait = getattr(self.comm, "wait", None) if self.cfg.parallel.world_size > 1 else None
        if wait is not None:
            wait(stream, self.opt.comm_timeout_s)
        self.gpu.synchronize(stream)

    @exclusive()
    def after_verify(self, st: ProposerState, accepted: int) -> None:
        """Keep ``min(drafted, accepted + 1)`` of the rows the last propose wrote. Row 0 pairs the
        committed token with the target's hidden and is never trimmed; with one draft nothing is."""
        self.after_verify_batch([st], [accepted])

    @exclusive()
    def after_verify_batch(self, states, accepted) -> None:
        """``after_verify`` for each sequence, ``accepted[b]`` for ``states[b]``; every count is
        checked before any sequence is trimmed."""
        states = self._batch(states, "after_verify_batch", ("accepted counts", accepted))
        counts = self._ints(accepted, states, "after_verify_batch", "accepted")
        drafted = np.fromiter((st.last_drafted for st in states), np.int64, len(states))
        bad = (counts < 0) | (counts > drafted)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise ProposerError(
                f"after_verify_batch entry {b} of {len(states)}: slot {states[b].slot}: accepted={int(counts[b])} "
                f"outside 0..{int(drafted[b])} (drafts proposed)"
            )
        for st, d, a in zip(states, drafted.tolist(), counts.tolist()):
            trim = d - min(d, a + 1)
            if trim:
                st.dsa.rewind_to(st.dsa.length - trim)
            st.last_drafted = 0

    # ---- checks ---------------------------------------------------------------------------------

    def _sampling(self, sampling, states, call: str) -> list[SamplingParams] | None:
        """One checked SamplingParams per state (None when the call is greedy)."""
        if sampling is None:
            return None
        B = len(states)
        params = [sampling] * B if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != B:
            raise ProposerError(f"{call}: {B} states but {len(params)} sampling parameters")
        V = self.cfg.vocab_size
        for b, (p, st) in enumerate(zip(params, states)):
            what = f"{call} entry {b} of {B}: slot {st.slot}"
            if not isinstance(p, SamplingParams):
                raise ProposerError(f"{what}: sampling must be a SamplingParams, got {type(p).__name__}")
            try:
                p.check(V, what)
            except ValueError as e:
                raise ProposerError(str(e)) from None
        if self.head_sharded:
            try:
                draft_sample_shard.check_shard_sampling(params, V, what=call)
            except ValueError as e:
                raise ProposerError(str(e)) from None
        return params

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        return as_tokens(tokens, self.cfg.vocab_size)

    def _borrowed_rows(
        self, items: list[tuple[object, int, str]], f32: Sequence[tuple[object, tuple, str]] = ()
    ):
        """Each item's ``rows`` BF16 rows of hidden_size as a DevicePtr, for a ``with`` block: a
        DevicePtr of this backend, checked to hold them, or a ``__cuda_array_interface__`` object
        of shape [rows, hidden], lent by the backend for the block. ``f32``: (buffer, shape, what)
        of float32 buffers the same way (None stays None; a shape with no elements gives None)."""
        H = self.cfg.hidden_size
        bufs = [(obj, (rows, H), BF16_TYPESTRS, 2, what) for obj, rows, what in items]
        bufs += [(obj, tuple(shape), F32_TYPESTRS, 4, what) for obj, shape, what in f32]
        if all(type(obj) is DevicePtr or _unused(obj, sh, isz) for obj, sh, _, isz, _ in bufs):
            # The common case, without a context stack: this backend's own pointers, checked.
            out = []
            for obj, shape, _, isz, what in bufs:
                if _unused(obj, shape, isz):
                    out.append(None)
                    continue
                if _nbytes(shape, isz) or obj:
                    self._check_buffer(obj, _nbytes(shape, isz), what)
                out.append(obj)
            return nullcontext(out)
        return self._lend(bufs)

    # A method, not a decorated closure per call: contextmanager's wrapping of a new function cost
    # 3 us of each propose that borrows.
    @contextmanager
    def _lend(self, bufs: list[tuple[object, tuple, tuple[str, ...], int, str]]):
        with ExitStack() as stack:
            out = []
            for obj, shape, typestrs, isz, what in bufs:
                if _unused(obj, shape, isz):
                    out.append(None)
                    continue
                if has_cuda_array_interface(obj):
                    try:
                        arr = cuda_array(obj, shape=shape, typestrs=typestrs, itemsize=isz, what=what)
                    except ExternalArrayError as e:
                        raise ProposerError(str(e)) from None
                    try:
                        out.append(stack.enter_context(self.gpu.borrow(arr.addr, arr.nbytes)))
                    except MemoryFault as e:
                        raise ProposerError(
                            f"{what} is not device memory this backend can read: {e}"
                        ) from None
                    continue
                self._check_buffer(obj, _nbytes(shape, isz), what)
                out.append(obj)
            yield out

    def _check_buffer(self, ptr: DevicePtr, nbytes: int, what: str) -> None:
        if not isinstance(ptr, DevicePtr) or not ptr:
            raise ProposerError(f"{what} must be a non-null DevicePtr or a __cuda_array_interface__ array")
        try:
            have = self.gpu.bytes_from(ptr)
        except MemoryFault as e:  # freed, or never allocated on this backend
            raise ProposerError(f"{what} is not a live allocation: {e}") from None
        if have < nbytes:
            raise ProposerError(f"{what} holds {have} bytes from its pointer; {nbytes} are needed")
