"""The MTP draft proposer: the contract a serving engine's scheduler calls.

``alloc_state / prefill_drafter / catchup_drafter / propose / after_verify / free_state``, plus
``drafter_rows``, ``last_pair_key`` and ``drafter_context_rows``.

Row space (dense): drafter row r is the pair ``(embed(tokens[r+1]), hidden[r])``; its KV slot, its
indexer row and its position are all r. Context rows append exactly at the current length; a feed
that would leave a hole or run past the sizing is refused before anything is written.

Every refusal is a ``ProposerError`` (model/proposer_checks.py), raised before any state changes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.allocations import MappedBuffer
from runtime.backend import GpuBackend
from runtime.comm.base import CommDtype, ReduceOp
from runtime.device_ptr import DevicePtr
from runtime.errors import CommError, MemoryFault
from runtime.graph import Graph
from runtime.kernels.all_finite_bf16 import first_nonfinite_row
from runtime.kernels.argmax_bf16 import argmax_bf16
from runtime.kernels.copy_words import copy_words
from runtime.kernels.gemv_bf16 import MAX_M as GEMV_MAX_M
from runtime.kernels.gemv_bf16 import gemv_bf16
from runtime.kernels.gemv_fp8w import gemv_fp8w
from runtime.kernels.quantize_fp8 import quantize_fp8
from runtime.kv_cache import PagedKvCache

from .block import DecoderLayer, LayerScratch
from .config import ModelConfig
from .dsa import DsaState, drafter_context_rows, latent_cache_config, shared_selection_extra
from .kernels import draft_head
from .kernels.mtp_input import mtp_embed_norm, mtp_input_gemv
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
from .tensors import TensorLookup
from .weights import DeviceArena, Sharding, SharedTables, WeightError, load_attention, load_moe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProposerOptions:
    served_max_seq_len: int
    max_draft_tokens: int = 4
    max_sequences: int = 4
    fp8_head: bool = True
    context_chunk: int = 8
    o_proj_groups: int = 8
    use_graphs: bool = False
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
        if not 1 <= self.context_chunk <= GEMV_MAX_M:
            raise ProposerError(f"context_chunk must be 1..{GEMV_MAX_M} (rows one GEMV reads W for)")
        if self.max_sequences < 1:
            raise ProposerError("max_sequences must be >= 1")
        if self.o_proj_groups < 1:
            raise ProposerError(f"o_proj_groups must be >= 1, got {self.o_proj_groups}")
        if not isinstance(self.comm_timeout_s, numbers.Real) or not self.comm_timeout_s > 0:
            raise ProposerError(f"comm_timeout_s must be positive, got {self.comm_timeout_s}")


@dataclass
class ProposerState:
    slot: int
    dsa: DsaState
    scratch: LayerScratch
    arena: DeviceArena
    concat: DevicePtr
    x: DevicePtr
    xn: DevicePtr
    hidden_in: DevicePtr
    logits: DevicePtr
    am_idx: DevicePtr
    am_val: DevicePtr
    key: DevicePtr
    step: DevicePtr  # u32 [row, token]: the step's scalars, one host-to-device copy per propose
    drafts: DevicePtr
    ctx_tokens: DevicePtr
    head_counter: DevicePtr  # u32, zero between launches (head_argmax's last-block handshake)
    # Mapped pinned [row, token] u32: the host writes the step's scalars here, and the step's first
    # kernel (copy_words) brings them into ``step`` (no host-to-device copy node in the graph).
    step_in: MappedBuffer
    # Mapped pinned memory: the launch that commits a step's last draft copies the step's drafts
    # here (the step's one copy back, with no copy node after the graph's last kernel).
    drafts_out: MappedBuffer
    last_drafted: int = 0
    # Host time of the last propose, the wait for the device excluded: checks, the copy of the
    # target's hidden, the graph launch (or the eager launches), and reading the drafts back.
    last_host_s: float = 0.0
    released: bool = False
    graphs: dict[int, Graph] = field(default_factory=dict)
    # The label of the proposer that allocated this state: its pools are indexed by this state's
    # blocks and slot, so every call checks it (another proposer would write into its own pool).
    owner: str = ""
    # u32 answer of the finiteness check of context rows (all_finite_bf16).
    finite_row: DevicePtr | None = None

    @property
    def rows(self) -> int:
        return self.dsa.length

    @property
    def drafts_host(self) -> np.ndarray:
        """The host's view of the last step's drafts (u32, valid after the step's wait), then of
        its flag word (the last word, ``flags_host``)."""
        return self.drafts_out.host.view(np.uint32)

    @property
    def row(self) -> DevicePtr:
        """The first draft row (kernels add the draft index)."""
        return self.step

    @property
    def token(self) -> DevicePtr:
        """The token the next draft embeds; each draft's head overwrites it with its argmax."""
        return self.step.offset(4)

    @property
    def flags_host(self) -> np.ndarray:
        """The step's non-finite flag bytes (proposer_checks.FLAG_*): the last word of drafts_out,
        which the host zeroes before the step and kernels raise; valid after the step's wait."""
        return self.drafts_out.host[-FLAG_BYTES:]

    def flag(self, byte: int) -> DevicePtr:
        """Device address of one flag byte, for the kernel that raises it."""
        return self.drafts_out.device.offset(self.drafts_out.nbytes - FLAG_BYTES + byte)


_SERIALS = itertools.count(1)


class MtpProposer:
    """The drafter of one model on one device (one rank of it when sharded).

    A proposer belongs to one thread and one stream at a time: every public call holds its lock,
    and a call from a second thread while another is inside is refused with a ProposerError, not
    queued (its launches, graph captures and row counts would interleave with the first's). After
    ``close`` every method is refused, except ``close`` and ``free_state``, which are then no-ops
    (the ``drafter_context_rows`` property, a number from the config, stays readable).
    A state belongs to the proposer that allocated it; a state of another proposer is refused.

    Non-finite input: a sequence whose context rows hold a NaN or an Inf is refused before anything
    is written; a propose whose target hidden (or any value of the step) is not finite raises a
    ProposerError naming its slot and what was not finite (see ``propose``). A NaN logit never wins
    the argmax, so even then every draft the kernels commit is a valid token id. Weights are
    checked as they are read (``TensorLookup``); tables passed in as device pointers are not.
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
        self.gpu, self.cfg, self.opt, self.comm = gpu, cfg, options, comm
        self.stream = gpu.default_stream if stream is None else stream
        src = TensorLookup.of(tensors)
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
        self.rows_cap = drafter_context_rows(options.served_max_seq_len, cfg.dsa)
        if options.max_draft_tokens > self.rows_cap:
            raise ProposerError(
                f"max_draft_tokens={options.max_draft_tokens} is more than the {self.rows_cap} rows "
                "the drafter holds (drafter_context_rows): a propose of k drafts writes k rows"
            )
        P = f"model.layers.{cfg.mtp_layer_index}."
        self.arena = arena = DeviceArena(gpu)
        self._slots_free = list(range(options.max_sequences - 1, -1, -1))
        self._states: list[ProposerState] = []
        try:

            def vec(name: str) -> DevicePtr:
                return arena.upload(src.checked(P + name, (H,)))

            self.enorm, self.hnorm = vec("enorm.weight"), vec("hnorm.weight")
            self.head_norm = vec("shared_head.norm.weight")
            self.eh_proj = arena.upload(src.checked(P + "eh_proj.weight", (H, 2 * H)))
            attn = load_attention(arena, src, P, cfg, sh)
            mlp = load_moe(arena, src, P, cfg, sh)
            self.layer = DecoderLayer(
                gpu,
                cfg,
                sh,
                attn,
                mlp,
                comm,
                selection_extra=shared_selection_extra(cfg.dsa, options.max_draft_tokens),
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
            kvc = latent_cache_config(cfg.attention.kv_lora_rank, 1)
            self.kv = PagedKvCache(kvc, kvc.blocks_for(self.rows_cap) * options.max_sequences, gpu)
        except Exception:
            arena.free()
            raise
        log.info(
            "MTP proposer: %d context rows, head %s, %.1f MiB of weights",
            self.rows_cap,
            "FP8" if self.head_fp8 else "BF16",
            arena.nbytes / 2**20,
        )

    def _agree_with_peers(self, options: ProposerOptions) -> None:
        """Every rank must run the same model with the same sharding options, or their collectives
        would pair up different tensors. One all-gather of a config fingerprint settles it before
        any weight is loaded; a dead peer surfaces here as the communicator's timeout."""
        what = {
            "config": {k: v for k, v in self.cfg.to_hf_dict().items()},
            "o_proj_groups": options.o_proj_groups,
            "fp8_head": options.fp8_head,
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
        head = ("gemv_fp8w", "gemv_fp8w") if self.head_sharded else draft_head.HEAD_ARGMAX_FP8.key
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
        """Everything a sequence needs, up front: ``propose`` allocates nothing."""
        if not self._slots_free:
            raise ProposerError(f"all {self.opt.max_sequences} sequence slots are in use")
        cfg, gpu, H = self.cfg, self.gpu, self.cfg.hidden_size
        arena = DeviceArena(gpu)
        dsa = None
        mapped: list[MappedBuffer] = []  # not the arena's: freed here if a later allocation fails
        try:
            dsa = DsaState.alloc(gpu, cfg.dsa, self.rows_cap, self.kv)
            ch = self.opt.context_chunk
            scratch = LayerScratch.alloc(
                arena,
                cfg,
                self.sharding,
                ch,
                self.rows_cap,
                self.layer.attn.fused_rows,
                self.layer.selection_extra,
            )
            z = arena.zeros
            for nbytes in (8, self.opt.max_draft_tokens * 4 + FLAG_BYTES):
                mapped.append(gpu.alloc_mapped(nbytes))
            st = ProposerState(
                slot=self._slots_free[-1],
                dsa=dsa,
                scratch=scratch,
                arena=arena,
                concat=z(ch * 2 * H * 2),
                x=z(ch * H * 2),
                xn=z(H * 2),
                hidden_in=z(H * 2),
                logits=z(self.head_n * 2),
                am_idx=z(4),
                am_val=z(4),
                key=z(8),
                step=z(8),
                drafts=z(self.opt.max_draft_tokens * 4),
                ctx_tokens=z(ch * 4),
                head_counter=z(4),
                step_in=mapped[0],
                drafts_out=mapped[1],
                owner=self.label,
                finite_row=z(4),
            )
        except Exception:
            for m in mapped:
                gpu.free_mapped(m)
            if dsa is not None:
                dsa.free(gpu, self.kv)
            arena.free()
            raise
        self._slots_free.pop()
        self._states.append(st)
        return st

    @exclusive(after_close=True)
    def free_state(self, st: ProposerState) -> None:
        """Release everything ``alloc_state`` took. Graphs go first: they bake these pointers, and
        the slot may be reused with new ones. A second call is a no-op (so is a call after
        ``close``, which freed every state)."""
        self._own(st)
        if st.released:
            return
        self.gpu.synchronize(self.stream)
        for g in st.graphs.values():
            self.gpu.graph_destroy(g)
        st.graphs.clear()
        st.dsa.free(self.gpu, self.kv)
        st.arena.free()
        self.gpu.free_mapped(st.step_in)
        self.gpu.free_mapped(st.drafts_out)
        st.released = True
        self._states.remove(st)
        self._slots_free.append(st.slot)

    @exclusive(after_close=True)
    def close(self) -> None:
        """Free every state, the KV pool and the weights; every later call is refused. A second
        call is a no-op."""
        if self._closed:
            return
        for st in list(self._states):
            self.free_state(st)
        self.kv.free()
        self.arena.free()
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
    def prefill_drafter(self, st: ProposerState, prompt_tokens: Sequence[int], hiddens: DevicePtr) -> int:
        return self.catchup_drafter(st, prompt_tokens, hiddens, 0)

    @exclusive()
    def catchup_drafter(
        self, st: ProposerState, tokens: Sequence[int], hiddens: DevicePtr, row_base: int
    ) -> int:
        """Append rows ``row_base + r = (embed(tokens[r+1]), hiddens[r])``. Returns rows written.
        The hidden rows are checked first (one read, one sync): a NaN or an Inf in any of them is
        refused, naming the row, and nothing is written."""
        self._live(st)
        row_base = as_int(row_base, "row_base")
        toks = self._check_tokens(tokens)
        rows = len(toks) - 1
        if rows <= 0:
            return 0
        st.dsa.check_advance(row_base, rows)
        self._check_buffer(hiddens, rows * self.cfg.hidden_size * 2, "hiddens")
        gpu, s, H = self.gpu, self.stream, self.cfg.hidden_size
        bad = first_nonfinite_row(gpu, hiddens, rows, H, st.finite_row, s)
        if bad is not None:
            raise ProposerError(
                f"catch-up of the sequence in slot {st.slot}: hidden row {bad} (drafter row "
                f"{row_base + bad}) is not finite (NaN or Inf); nothing was written"
            )
        ch = self.opt.context_chunk
        for c in range(0, rows, ch):
            n = min(ch, rows - c)
            gpu.synchronize(s)  # the scalars below are rewritten; the last chunk must have read them
            gpu.copy_h2d(st.row, np.array([row_base + c], np.uint32))
            gpu.copy_h2d(st.ctx_tokens, toks[1 + c : 1 + c + n])
            mtp_embed_norm(
                gpu,
                self.tables.embed,
                st.ctx_tokens,
                self.enorm,
                hiddens.offset(c * H * 2),
                self.hnorm,
                st.concat,
                n,
                self.cfg.vocab_size,
                H,
                self.cfg.rms_norm_eps,
                s,
            )
            gemv_bf16(gpu, self.eh_proj, st.concat, st.x, n, H, 2 * H, s)
            self._context_rows(st, n)
        gpu.synchronize(s)
        st.dsa.advance(rows)
        return rows

    def _context_rows(self, st: ProposerState, n: int) -> None:
        """The caches of the chunk's ``n`` rows ``st.x[n, H]`` at rows ``*st.row ..``: the layer's
        cache-only path (a context row's attention and MoE output is never read)."""
        self.layer.context_rows(st.x, n, st.scratch, st.dsa, self.kv, st.row, 0, self.stream)

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
        self, st: ProposerState, last_token: int, target_hidden: DevicePtr, position: int, k: int
    ) -> list[int]:
        """k drafts. Draft 1 consumes the target's hidden, drafts 2..k the drafter's own output.

        Non-finite values: the step's kernels raise flag bytes that come back with the drafts (no
        extra sync): the first kernel of each draft when its hidden row is not finite (the target's
        for draft 1), the head when its winning logit is not (every logit NaN, or the largest
        infinite). Then, after the wait, this raises a ProposerError naming the slot and the first
        cause, and no draft is committed: the row count and ``last_pair_key`` are as before the
        call. If the drafter was ahead of ``position`` the rewind to ``position`` stands (rows
        ``position..`` were rewritten by the step, so they cannot be kept): then it holds
        ``position`` rows and ``after_verify`` has nothing to trim, as after ``rewind_to``."""
        t_enter = time.perf_counter()
        self._live(st)
        k = as_int(k, "k")
        last_token = as_int(last_token, "last_token")
        position = as_int(position, "position")
        if not 1 <= k <= self.opt.max_draft_tokens:
            raise ProposerError(f"k={k} outside 1..{self.opt.max_draft_tokens} (max_draft_tokens)")
        if not 0 <= last_token < self.cfg.vocab_size:
            raise ProposerError(
                f"last_token {last_token} is outside the vocabulary 0..{self.cfg.vocab_size - 1}"
            )
        if position < 0 or position + k > self.rows_cap:
            raise ProposerError(
                f"propose at position {position} with k={k} runs past the {self.rows_cap} rows "
                "the drafter was sized for"
            )
        if st.rows < position:
            raise ProposerError(
                f"drafter holds {st.rows} rows but propose is at position {position}: catch up "
                "the missing rows first"
            )
        self._check_buffer(target_hidden, self.cfg.hidden_size * 2, "target_hidden")
        rewound = st.rows > position
        if rewound:
            st.dsa.rewind_to(position)
        gpu, s = self.gpu, self.stream
        # Read by the step's first kernel, inside the graph when there is one: the host writes two
        # words of mapped pinned memory instead of issuing copies (the previous step has finished,
        # since propose waits for its drafts).
        step_host = st.step_in.host.view(np.uint32)
        step_host[0], step_host[1] = position, last_token
        out_host = st.drafts_host  # the drafts, then the step's flag word (st.flags_host)
        out_host[-1] = 0
        gpu.copy_d2d(st.hidden_in, target_hidden, self.cfg.hidden_size * 2, s)
        self._launch_step(st, k)
        t_wait = time.perf_counter()
        self._wait(s)
        t_done = time.perf_counter()
        if out_host[-1]:  # a kernel of the step raised a non-finite flag
            if rewound:
                st.last_drafted = 0
            raise ProposerError(
                f"propose for the sequence in slot {st.slot} at position {position}: "
                f"{nonfinite_problem(st.flags_host)}; no draft was committed (the drafter holds "
                f"{st.rows} rows)"
            )
        st.dsa.length = position + k
        st.last_drafted = k
        drafts = [int(t) for t in out_host[:k]]
        st.last_host_s = (t_wait - t_enter) + (time.perf_counter() - t_done)
        return drafts

    def _launch_step(self, st: ProposerState, k: int) -> None:
        """Enqueue the k-draft step: as one graph (captured on first use) or as eager launches."""
        if self.opt.use_graphs:
            self._replay_graph(st, k)
        else:
            self._enqueue_drafts(st, k)

    def _replay_graph(self, st: ProposerState, k: int) -> None:
        gpu, s = self.gpu, self.stream
        g = st.graphs.get(k)
        if g is None:
            gpu.begin_capture(s)
            try:
                self._enqueue_drafts(st, k)
            except BaseException:
                gpu.abort_capture()
                raise
            g = st.graphs[k] = gpu.end_capture(s, label=f"propose k={k} slot={st.slot}")
        gpu.graph_launch(g, s)

    def _enqueue_drafts(self, st: ProposerState, k: int) -> None:
        # The first draft's eh_proj (Pdl.BESIDE) streams its hidden half while this reads the host.
        copy_words(self.gpu, st.step_in.device, st.step, 2, self.stream)
        for i in range(k):
            self._draft_step(st, i, publish=i == k - 1)

    def _draft_step(self, st: ProposerState, i: int, publish: bool) -> None:
        """Draft i; with ``publish`` (the step's last draft) the launch that commits it also copies
        drafts 0..i to ``st.drafts_out``."""
        gpu, s, cfg = self.gpu, self.stream, self.cfg
        H, V, eps = cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps
        hidden = st.hidden_in if i == 0 else st.xn
        # Both input norms are every block's prologue of eh_proj (one launch, no concat round trip).
        mtp_input_gemv(
            gpu,
            self.tables.embed,
            st.token,
            self.enorm,
            hidden,
            self.hnorm,
            self.eh_proj,
            st.x,
            V,
            H,
            H,
            eps,
            s,
            flag=st.flag(FLAG_TARGET_HIDDEN if i == 0 else FLAG_OWN_HIDDEN),
        )
        self._block(st, i)
        self._head(st, i, publish)

    def _block(self, st: ProposerState, i: int) -> None:
        """Draft i's block over ``st.x`` at row ``*st.row + i``, leaving the head's input
        ``st.xn = rmsnorm(x) * head_norm``."""
        # The head's RMSNorm rides on the block's last residual add (one launch for both).
        # Drafts 2..k reuse draft 1's pool selection when the config shares it.
        self.layer.full_row(
            st.x,
            st.scratch,
            st.dsa,
            self.kv,
            st.row,
            i,
            self.rows_cap,
            self.stream,
            next_norm=(self.head_norm, st.xn),
            reuse_selection=i > 0 and self.cfg.dsa.share_for_mtp_iteration,
        )

    def _head(self, st: ProposerState, i: int, publish: bool) -> None:
        """Draft i's token from ``st.xn``, with the FP8 copy of the head when there is one."""
        if self.head_fp8 is not None:
            self._head_with(st, i, publish, self.head_fp8, self.head_fp8_scales)
        else:
            self._head_with(st, i, publish, self.head_bf16, None)

    def _head_with(
        self, st: ProposerState, i: int, publish: bool, w: DevicePtr, sc: DevicePtr | None
    ) -> None:
        """The head with weights ``w`` (this rank's vocabulary rows; FP8 with per-row scales
        ``sc``, else BF16): the argmax of its logits becomes ``st.token`` and ``st.drafts[i]``."""
        gpu, s, H = self.gpu, self.stream, self.cfg.hidden_size
        n = self.head_n
        if not self.head_sharded:
            # One launch: head GEMV, argmax, commit of the draft token (st.key stays zero).
            draft_head.head_argmax(
                gpu,
                w,
                sc,
                st.xn,
                st.logits,
                st.key,
                st.head_counter,
                st.token,
                st.drafts,
                i,
                st.drafts_out.device,
                publish,
                n,
                H,
                s,
                flag=st.flag(FLAG_LOGITS),
            )
            return
        if sc is not None:
            gemv_fp8w(gpu, w, sc, st.xn, st.logits, 1, n, H, s)
        else:
            gemv_bf16(gpu, w, st.xn, st.logits, 1, n, H, s)
        argmax_bf16(gpu, st.logits, st.am_idx, st.am_val, n, s)
        draft_head.argmax_pack(gpu, st.am_idx, st.am_val, st.key, self.head_v0, s)
        self.comm.all_reduce(st.key, 1, CommDtype.UINT64, ReduceOp.MAX, stream=s)
        draft_head.draft_commit(
            gpu, st.key, st.token, st.drafts, i, st.drafts_out.device, publish, s, flag=st.flag(FLAG_LOGITS)
        )

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
        self._live(st)
        accepted = as_int(accepted, "accepted")
        if accepted < 0 or accepted > st.last_drafted:
            raise ProposerError(f"accepted={accepted} outside 0..{st.last_drafted} (drafts proposed)")
        keep = min(st.last_drafted, accepted + 1)
        trim = st.last_drafted - keep
        if trim:
            st.dsa.rewind_to(st.rows - trim)
        st.last_drafted = 0

    # ---- checks ---------------------------------------------------------------------------------

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        return as_tokens(tokens, self.cfg.vocab_size)

    def _check_buffer(self, ptr: DevicePtr, nbytes: int, what: str) -> None:
        if not isinstance(ptr, DevicePtr) or not ptr:
            raise ProposerError(f"{what} must be a non-null DevicePtr")
        try:
            have = self.gpu.bytes_from(ptr)
        except MemoryFault as e:  # freed, or never allocated on this backend
            raise ProposerError(f"{what} is not a live allocation: {e}") from None
        if have < nbytes:
            raise ProposerError(f"{what} holds {have} bytes from its pointer; {nbytes} are needed")
