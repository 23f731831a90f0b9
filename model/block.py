"""One decoder layer of the family (DSA attention + MoE or dense MLP, plain residual), as a
sequence of kernel launches through the runtime.

Two entry points:
- ``context_rows``: rows that only fill the caches (the latent, the indexer key and gate, pool
  compression). No attention, no MLP: a context row's output is never read.
- ``full_row``: one row through the whole layer, in place on ``x``: it writes its caches first,
  then attends over the selection, then the MLP.

Every launch addresses the row through ``row_ptr`` (a u32 in device memory) plus an immediate
``row_add``, so a captured graph replays at whatever row the host (or the previous node) set.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.backend import GpuBackend
from runtime.comm.base import CommDtype, ReduceOp
from runtime.device_ptr import DevicePtr
from runtime.kernels.gemv_bf16 import gemv_bf16
from runtime.kernels.rmsnorm import rmsnorm
from runtime.kv_cache import PagedKvCache

from .config import ModelConfig
from .dsa import DsaState, selection_rows
from .kernels import bgemv as bg
from .kernels import dsa_cache, dsa_select, moe, sparse_mla
from .weights import AttentionWeights, DeviceArena, MlpWeights, Sharding

# The indexer's k_norm is a LayerNorm with bias and a fixed eps, not rms_norm_eps (as
# train/torch_model.py's INDEXER_LN_EPS: the checkpoint's training used it).
INDEXER_LN_EPS = 1e-6


@dataclass
class LayerScratch:
    """Per-sequence scratch of one layer call (its pointers are baked into captured graphs, so it
    belongs to a sequence slot, not to the layer)."""

    y: DevicePtr
    fused: DevicePtr
    q_lat: DevicePtr
    q_fused: DevicePtr
    q_abs: DevicePtr
    o_lat: DevicePtr
    o: DevicePtr
    attn_local: DevicePtr
    attn_parts: DevicePtr
    h1: DevicePtr
    y2: DevicePtr
    rscores: DevicePtr
    ids: DevicePtr
    wts: DevicePtr
    act: DevicePtr
    moe_parts: DevicePtr
    iscores: DevicePtr
    selected: DevicePtr
    count: DevicePtr
    router_counter: DevicePtr  # u32, zero between launches (router_fused's last-block handshake)
    attn_part: DevicePtr  # sparse_mla_partial's per-split outputs and (max, sum)
    attn_ml: DevicePtr

    @classmethod
    def alloc(
        cls,
        arena: DeviceArena,
        cfg: ModelConfig,
        sh: Sharding,
        chunk: int,
        rows: int,
        fused_rows: int,
        selection_extra: int = 0,
    ) -> LayerScratch:
        """``selection_extra``: rows a shared selection gains after it was made
        (``DecoderLayer.selection_extra``)."""
        a, d, m, H = cfg.attention, cfg.dsa, cfg.moe, cfg.hidden_size
        slots = m.num_experts_per_tok + 1
        inter = max(m.moe_intermediate_size, cfg.intermediate_size)
        b = arena.zeros
        sel_rows = selection_rows(d, rows, selection_extra)
        part_bytes, ml_bytes = sparse_mla.split_workspace(sh.local_heads, a.kv_lora_rank, sel_rows)
        return cls(
            y=b(chunk * H * 2),
            fused=b(chunk * fused_rows * 2),
            q_lat=b(a.q_lora_rank * 2),
            q_fused=b((sh.local_heads * a.qk_head_dim + d.index_n_heads * d.index_head_dim) * 2),
            q_abs=b(sh.local_heads * a.kv_lora_rank * 4),
            o_lat=b(sh.local_heads * a.kv_lora_rank * 2),
            o=b(sh.local_heads * a.v_head_dim * 2),
            attn_local=b(sh.local_groups * H * 4),
            attn_parts=b(sh.groups * H * 4),
            h1=b(H * 2),
            y2=b(H * 2),
            rscores=b(m.n_routed_experts * 4),
            ids=b(slots * 4),
            wts=b(slots * 4),
            act=b(slots * inter * 2),
            moe_parts=b(slots * H * 4),
            iscores=b(max(rows // d.index_kpool, 1) * 4),
            selected=b(max(sel_rows, 1) * 4),
            count=b(4),
            router_counter=b(4),
            attn_part=b(part_bytes),
            attn_ml=b(ml_bytes),
        )


class DecoderLayer:
    """A layer's weights and its launch sequence. ``comm`` is required when the layer is sharded:
    a sharded layer without one would draft from a partial sum, so construction refuses it.

    ``selection_extra``: rows a selection may gain after it is made, when rows drafted later
    reuse it (``attention(reuse_selection=True)``); the selection buffers and the attention
    launches are sized for it."""

    def __init__(
        self,
        gpu: GpuBackend,
        cfg: ModelConfig,
        sh: Sharding,
        attn: AttentionWeights,
        mlp: MlpWeights,
        comm=None,
        kv_layer: int = 0,
        selection_extra: int = 0,
    ) -> None:
        if sh.world_size > 1 and comm is None:
            raise ValueError(
                f"layer sharded over {sh.world_size} ranks needs a communicator: without one it "
                "would compute from this rank's share of the heads and experts only"
            )
        if comm is not None and comm.world_size != sh.world_size:
            raise ValueError(
                f"communicator has {comm.world_size} ranks, the layer is sharded over {sh.world_size}"
            )
        self.gpu, self.cfg, self.sh, self.attn, self.mlp, self.comm = gpu, cfg, sh, attn, mlp, comm
        self.kv_layer = kv_layer
        self.selection_extra = selection_extra
        a, d = cfg.attention, cfg.dsa
        self.ctx_rows = a.kv_lora_rank + 2 * d.index_head_dim  # rows of fused_in a context row needs

    # ---- caches ---------------------------------------------------------------------------------

    def _write_caches(
        self,
        s: LayerScratch,
        fused: DevicePtr,
        stride: int,
        st: DsaState,
        kv: PagedKvCache,
        row_ptr: DevicePtr,
        row_add: int,
        rows: int,
        stream,
    ) -> None:
        cfg, gpu, w = self.cfg, self.gpu, self.attn
        C, idim = cfg.attention.kv_lora_rank, cfg.dsa.index_head_dim
        # One launch for the latent, the indexer key and gate, and the pools the rows complete
        # (dsa_cache_write = latent_write_fp8 + indexer_write_keys + indexer_compress_pools).
        dsa_cache.dsa_cache_write(
            gpu,
            fused,
            stride,
            w.kv_a_norm,
            kv.data[self.kv_layer],
            kv.scales[self.kv_layer],
            st.table.device,
            w.k_norm_w,
            w.k_norm_b,
            st.keys,
            st.gates,
            w.ape,
            st.pool_keys,
            st.pool_scales,
            row_ptr,
            row_add,
            rows,
            C,
            idim,
            kv.config.block_size,
            cfg.dsa.index_kpool,
            cfg.rms_norm_eps,
            INDEXER_LN_EPS,
            stream,
        )

    def context_rows(
        self,
        x: DevicePtr,
        rows: int,
        s: LayerScratch,
        st: DsaState,
        kv: PagedKvCache,
        row_ptr: DevicePtr,
        row_add: int,
        stream=None,
    ) -> None:
        """Cache rows for ``rows`` consecutive inputs ``x[rows, H]`` (rows <= the scratch chunk)."""
        H = self.cfg.hidden_size
        rmsnorm(self.gpu, x, self.attn.input_norm, s.y, rows, H, self.cfg.rms_norm_eps, stream)
        gemv_bf16(self.gpu, self.attn.fused_in, s.y, s.fused, rows, self.ctx_rows, H, stream)
        self._write_caches(s, s.fused, self.ctx_rows, st, kv, row_ptr, row_add, rows, stream)

    # ---- the whole layer for one row ------------------------------------------------------------

    def full_row(
        self,
        x: DevicePtr,
        s: LayerScratch,
        st: DsaState,
        kv: PagedKvCache,
        row_ptr: DevicePtr,
        row_add: int,
        rows_capacity: int,
        stream=None,
        next_norm: tuple[DevicePtr, DevicePtr] | None = None,
        reuse_selection: bool = False,
    ) -> None:
        """x [H] in place: x = x + attn(norm(x)); x = x + mlp(norm(x)). With ``next_norm = (w, out)``
        the consumer's RMSNorm ``out = rmsnorm(x) * w`` is fused into the last residual add."""
        self.attention(x, s, st, kv, row_ptr, row_add, rows_capacity, stream, reuse_selection)
        self.mlp_forward(s, x, stream, next_norm)

    def attention(
        self,
        x: DevicePtr,
        s: LayerScratch,
        st: DsaState,
        kv: PagedKvCache,
        row_ptr: DevicePtr,
        row_add: int,
        rows_capacity: int,
        stream=None,
        reuse_selection: bool = False,
    ) -> None:
        """With ``reuse_selection`` the row attends the selection the previous full row of this
        scratch made (no indexer scores, no top-k), extended by its own row when the tail is
        selected (``model.dsa``, "Shared selection"); the caller sized ``selection_extra``."""
        cfg, gpu, w, sh = self.cfg, self.gpu, self.attn, self.sh
        a, d, H, eps = cfg.attention, cfg.dsa, cfg.hidden_size, cfg.rms_norm_eps
        C, idim, ih = a.kv_lora_rank, d.index_head_dim, d.index_n_heads
        hl = sh.local_heads
        # The input norm is every block's prologue of the fused projection (no rmsnorm launch).
        bg.rmsnorm_gemv(gpu, x, w.input_norm, w.fused_in, s.fused, w.fused_rows, H, eps, stream)
        self._write_caches(s, s.fused, w.fused_rows, st, kv, row_ptr, row_add, 1, stream)
        q_a = s.fused.offset(self.ctx_rows * 2)
        nq = hl * a.qk_head_dim + ih * idim
        # The q projection reads the same fused rows as the cache write, so it runs beside it.
        bg.rmsnorm_gemv(
            gpu, q_a, w.q_a_norm, w.q_fused, s.q_fused, nq, a.q_lora_rank, eps, stream, beside=True
        )
        iw = q_a.offset(a.q_lora_rank * 2)  # weights_proj y
        if not reuse_selection:
            dsa_select.indexer_scores(
                gpu,
                s.q_fused.offset(hl * a.qk_head_dim * 2),
                iw,
                st.pool_keys,
                st.pool_scales,
                s.iscores,
                row_ptr,
                row_add,
                ih,
                idim,
                d.index_kpool,
                1.0 / ih**0.5,
                max(rows_capacity // d.index_kpool, 1),
                stream,
            )
            dsa_select.select_topk_pools(
                gpu,
                s.iscores,
                s.selected,
                s.count,
                row_ptr,
                row_add,
                d.topk_pools,
                d.index_kpool,
                d.always_select_tail,
                stream,
            )
        elif d.always_select_tail:
            dsa_select.extend_selection(gpu, s.selected, s.count, row_ptr, row_add, stream)
        # The absorbed query needs only the q projection, so it streams wk_t beside the selection
        # (one block on one SM) instead of after it.
        bg.bgemv(
            gpu,
            w.wk_t,
            s.q_fused,
            s.q_abs,
            hl,
            C,
            a.qk_nope_head_dim,
            out_f32=True,
            beside=True,
            stream=stream,
        )
        sel_cap = selection_rows(d, rows_capacity, self.selection_extra)
        if sparse_mla.split_supported(C, sel_cap):
            sparse_mla.sparse_mla_split(
                gpu,
                s.q_abs,
                kv.data[self.kv_layer],
                kv.scales[self.kv_layer],
                st.table.device,
                s.selected,
                s.count,
                s.attn_part,
                s.attn_ml,
                s.o_lat,
                hl,
                C,
                kv.config.block_size,
                a.softmax_scale,
                sel_cap,
                stream,
            )
        else:
            sparse_mla.sparse_mla_attend(
                gpu,
                s.q_abs,
                kv.data[self.kv_layer],
                kv.scales[self.kv_layer],
                st.table.device,
                s.selected,
                s.count,
                s.o_lat,
                hl,
                C,
                kv.config.block_size,
                a.softmax_scale,
                stream,
            )
        bg.bgemv(gpu, w.wv, s.o_lat, s.o, hl, a.v_head_dim, C, out_f32=False, stream=stream)
        gw = sh.group_heads * a.v_head_dim
        if sh.world_size == 1:
            bg.bgemv(gpu, w.o_proj, s.o, s.attn_parts, sh.groups, H, gw, out_f32=True, stream=stream)
        else:
            bg.bgemv(gpu, w.o_proj, s.o, s.attn_local, sh.local_groups, H, gw, out_f32=True, stream=stream)
            self.comm.all_gather(
                s.attn_local, s.attn_parts, sh.local_groups * H, CommDtype.FLOAT32, stream=stream
            )
        # h1 = x + attn, and the MLP's input norm y2 = rmsnorm(h1) * post_norm, in one launch.
        bg.sum_rows_residual_rmsnorm(
            gpu, s.attn_parts, x, self.mlp.post_norm, s.h1, s.y2, sh.groups, H, eps, stream
        )

    def _residual_out(
        self,
        parts: DevicePtr,
        s: LayerScratch,
        x_out: DevicePtr,
        rows: int,
        next_norm: tuple[DevicePtr, DevicePtr] | None,
        stream,
    ) -> None:
        H = self.cfg.hidden_size
        if next_norm is None:
            bg.sum_rows_residual(self.gpu, parts, s.h1, x_out, rows, H, stream)
        else:
            bg.sum_rows_residual_rmsnorm(
                self.gpu,
                parts,
                s.h1,
                next_norm[0],
                x_out,
                next_norm[1],
                rows,
                H,
                self.cfg.rms_norm_eps,
                stream,
            )

    def mlp_forward(
        self,
        s: LayerScratch,
        x_out: DevicePtr,
        stream=None,
        next_norm: tuple[DevicePtr, DevicePtr] | None = None,
    ) -> None:
        """x_out = h1 + mlp(y2), with y2 = post_norm(h1) as ``attention`` left it; with
        ``next_norm = (w, out)`` also out = rmsnorm(x_out) * w."""
        cfg, gpu, w, sh = self.cfg, self.gpu, self.mlp, self.sh
        H, m = cfg.hidden_size, cfg.moe
        if not w.is_moe:
            # A dense MLP is one "expert" whose id and weight are constants of its weights.
            moe.expert_gate_up(
                gpu,
                w.gate_up,
                s.y2,
                w.dense_ids,
                s.act,
                0,
                1,
                0,
                1,
                w.inter,
                H,
                self.cfg.moe.swiglu_limit,
                stream,
            )
            moe.expert_down(
                gpu, w.down, s.act, w.dense_ids, w.dense_weight, s.moe_parts, 0, 1, 0, 1, H, w.inter, stream
            )
            self._residual_out(s.moe_parts, s, x_out, 1, next_norm, stream)
            return
        E, k, L = m.n_routed_experts, m.num_experts_per_tok, m.swiglu_limit
        shared = m.n_shared_experts > 0
        # Scores and top-k in one launch (the last block routes).
        moe.router_fused(
            gpu,
            w.router,
            s.y2,
            w.bias,
            s.rscores,
            s.ids,
            s.wts,
            s.router_counter,
            E,
            H,
            k,
            m.norm_topk_prob,
            m.routed_scaling_factor,
            shared,
            stream,
        )
        if not shared:
            mode, w_sh_gu, w_sh_down = moe.SHARED_NONE, w.gate_up, w.down
        elif w.shared_gate_up is not None:
            mode, w_sh_gu, w_sh_down = moe.SHARED_HERE, w.shared_gate_up, w.shared_down
        else:
            mode, w_sh_gu, w_sh_down = moe.SHARED_ELSEWHERE, w.gate_up, w.down
        # The routed experts and the shared expert as one more slot: one launch each for gate/up
        # and down instead of two each (and no memset for a shared slot another rank holds).
        moe.moe_gate_up(
            gpu,
            w.gate_up,
            w_sh_gu,
            s.y2,
            s.ids,
            s.act,
            k,
            w.expert_base,
            w.n_local,
            w.inter,
            H,
            L,
            mode,
            stream,
        )
        moe.moe_down(
            gpu,
            w.down,
            w_sh_down,
            s.act,
            s.ids,
            s.wts,
            s.moe_parts,
            k,
            w.expert_base,
            w.n_local,
            H,
            w.inter,
            mode,
            stream,
        )
        slots = k + int(shared)
        if sh.world_size > 1:
            # Every slot row is non-zero on exactly one rank, so this sum is exact (x + 0 = x).
            self.comm.all_reduce(s.moe_parts, slots * H, CommDtype.FLOAT32, ReduceOp.SUM, stream=stream)
        self._residual_out(s.moe_parts, s, x_out, slots, next_norm, stream)
