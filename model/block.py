"""One decoder layer of the family (DSA attention + MoE or dense MLP, plain residual), as a
sequence of kernel launches through the runtime, over a batch of ``m`` rows.

Two entry points:
- ``context_rows``: rows that only fill the caches (the latent, the indexer key and gate, pool
  compression). No attention, no MLP: a context row's output is never read.
- ``full_rows``: rows through the whole layer, in place on ``x``: each writes its caches first,
  then attends over its own sequence's selection, then the MLP.

Row e of a launch belongs to the sequence of batch entry e (model/kernels/batch.py): its slot in
the pools and its row (``entry.row + row_add``) are read by the kernels from device memory, so a
captured graph replays for whatever sequences and rows the host wrote into the entries. Weights are
read once per launch for all m rows; the MoE reads each distinct expert once for all its pairs.
A row's arithmetic never depends on the other rows (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.backend import GpuBackend
from runtime.comm.base import CommDtype, ReduceOp
from runtime.device_ptr import DevicePtr

from .config import ModelConfig
from .dsa import selection_rows
from .kernels import bgemv as bg
from .kernels import bgemv_fp8 as bg8
from .kernels import dsa_cache, dsa_select, moe, rope, sparse_mla
from .kernels import proj_mma as pm
from .kernels.bgemv_fp8 import GemvSegment
from .slot_pools import SlotPools
from .weights import AttentionWeights, DeviceArena, MlpWeights, Sharding, context_rows

# The indexer's k_norm is a LayerNorm with bias and a fixed eps, not rms_norm_eps (as
# train/torch_model.py's INDEXER_LN_EPS: the checkpoint's training used it).
INDEXER_LN_EPS = 1e-6


@dataclass
class BatchScratch:
    """Scratch of one layer launch over up to ``rows`` batch rows: every buffer is dense per row
    (row e at ``base + e * row_bytes``). It belongs to the proposer, not to a sequence, so captured
    graphs bake it without baking any sequence."""

    rows: int
    xn: DevicePtr  # a normed projection input per row (tensor-core projections), xn_stride elements
    proj_part: DevicePtr | None  # split-k partials of tensor-core projections (DecoderLayer.part_row_bytes)
    fused: DevicePtr
    q_fused: DevicePtr
    q_nope: DevicePtr | None  # with a rope part: each head's nope query, heads packed (rope_q_batch)
    q_rope: DevicePtr | None  # with a rope part: each head's rotated rope query
    q_abs: DevicePtr
    o_lat: DevicePtr
    o: DevicePtr
    attn_parts: DevicePtr
    h1: DevicePtr
    y2: DevicePtr
    rscores: DevicePtr
    ids: DevicePtr
    wts: DevicePtr
    act: DevicePtr
    moe_parts: DevicePtr
    group: DevicePtr  # the MoE's grouping of (row, slot) pairs by expert (moe.GroupLayout)
    iscores: DevicePtr
    selected: DevicePtr
    count: DevicePtr
    select_ws: DevicePtr  # the chunked selection's per-row workspace (zeroed; left zeroed by each launch)
    router_counter: DevicePtr  # u32s, zero between launches (router_group_batch's last-block handshakes)
    attn_part: DevicePtr  # the attention's per-split outputs and (max, sum), per row
    attn_ml: DevicePtr

    @classmethod
    def alloc(
        cls,
        arena: DeviceArena,
        cfg: ModelConfig,
        sh: Sharding,
        rows: int,
        slot_rows: int,
        fused_rows: int,
        selection_extra: int = 0,
        part_row_bytes: int = 0,
        attn_split_rows: int = 0,
    ) -> BatchScratch:
        """``selection_extra``: rows a shared selection gains after it was made
        (``DecoderLayer.selection_extra``); ``part_row_bytes``: the layer's split-k workspace per row
        (``DecoderLayer.part_row_bytes``); ``attn_split_rows``: the layer's attention form
        (``DecoderLayer.attn_split_rows``: 0 the split pair, else the wide pair's split length),
        which sizes the attention's workspace."""
        a, d, m, H = cfg.attention, cfg.dsa, cfg.moe, cfg.hidden_size
        slots = m.num_experts_per_tok + 1
        inter = max(m.moe_intermediate_size, cfg.intermediate_size)
        b = arena.zeros
        sel_rows = selection_rows(d, slot_rows, selection_extra)
        if attn_split_rows:
            part_bytes, ml_bytes = sparse_mla.wide_workspace(
                sh.local_heads, a.kv_lora_rank, sel_rows, attn_split_rows
            )
        else:
            part_bytes, ml_bytes = sparse_mla.split_workspace(sh.local_heads, a.kv_lora_rank, sel_rows)
        hl = sh.local_heads
        return cls(
            rows=rows,
            xn=b(rows * xn_stride(cfg) * 2),
            proj_part=b(rows * part_row_bytes) if part_row_bytes else None,
            fused=b(rows * fused_rows * 2),
            q_fused=b(rows * (hl * a.qk_head_dim + d.index_n_heads * d.index_head_dim) * 2),
            q_nope=b(rows * hl * a.qk_nope_head_dim * 2) if a.qk_rope_head_dim else None,
            q_rope=b(rows * hl * a.qk_rope_head_dim * 2) if a.qk_rope_head_dim else None,
            q_abs=b(rows * hl * a.kv_lora_rank * 4),
            o_lat=b(rows * hl * a.kv_lora_rank * 2),
            o=b(rows * hl * a.v_head_dim * 2),
            # All groups on every rank: a rank writes its own and the others stay zero, so the
            # all-reduce that completes them is exact (x + 0 = x).
            attn_parts=b(rows * sh.groups * H * 4),
            h1=b(rows * H * 2),
            y2=b(rows * H * 2),
            rscores=b(rows * max(m.n_routed_experts, 1) * 4),
            ids=b(rows * slots * 4),
            wts=b(rows * slots * 4),
            act=b(rows * slots * inter * 2),
            moe_parts=b(rows * slots * H * 4),
            group=b(moe.group_workspace_bytes(rows, m.num_experts_per_tok, max(m.n_routed_experts, 1))),
            iscores=b(rows * max(slot_rows // d.index_kpool, 1) * 4),
            selected=b(rows * max(sel_rows, 1) * 4),
            count=b(rows * 4),
            select_ws=b(max(dsa_select.select_workspace_bytes(rows, slot_rows, d.index_kpool), 4)),
            router_counter=b(4 * moe.router_counter_words(rows, grouped=True)),
            attn_part=b(rows * part_bytes),
            attn_ml=b(rows * ml_bytes),
        )


def xn_stride(cfg: ModelConfig) -> int:
    """Elements per row of ``BatchScratch.xn``: the longer of the two normed projection inputs (the
    layer input and the q latent), 16-byte aligned rows."""
    return -(-max(cfg.hidden_size, cfg.attention.q_lora_rank) // 8) * 8


class DecoderLayer:
    """A layer's weights and its launch sequence. ``comm`` is required when the layer is sharded:
    a sharded layer without one would draft from a partial sum, so construction refuses it.

    ``selection_extra``: rows a selection may gain after it is made, when rows drafted later
    reuse it (``attention(reuse_selection=True)``); the selection buffers and the attention
    launches are sized for it. ``kv_layer``: the layer's index in the pools' latent cache and
    indexer pools. ``tensor_core``: the projections on tensor cores (``model.kernels.proj_mma``) where
    their shapes allow, else (and without it) the CUDA-core GEMVs; the two are not bit-identical,
    so one layer uses one form for every launch. ``attention_split_rows``: the attention over the
    selection as the wide pair (``sparse_mla.sparse_mla_wide_batch``: all heads per block, splits of
    this many rows) where its shapes allow, else (and with 0) the split pair; as with the
    projections, one form for every launch (``attn_split_rows`` is the one taken)."""

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
        tensor_core: bool = False,
        attention_split_rows: int = 0,
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
        if attention_split_rows and not sparse_mla.wide_split_rows_ok(attention_split_rows):
            raise ValueError(
                f"attention_split_rows {attention_split_rows!r}: 0, or a multiple of {sparse_mla.SPLIT_ROWS} "
                f"from {sparse_mla.SPLIT_ROWS} to {sparse_mla.WIDE_MAX_SPLIT_ROWS}"
            )
        # The attention's form, by configuration and shape alone (never by m): a sequence's bits
        # depend on the split length.
        wide_ok = sparse_mla.wide_supported(a.kv_lora_rank, a.qk_rope_head_dim)
        self.attn_split_rows = attention_split_rows if wide_ok else 0
        self.ctx_rows = context_rows(cfg)  # rows of fused_in a context row needs
        # With a rope part the nope queries are packed per head (rope_q_batch) for the absorption.
        self.rope = a.qk_rope_head_dim > 0
        # Which projections run on tensor cores: by shape alone (never by m), fixed for the layer.
        hl, xs = sh.local_heads, xn_stride(cfg)
        nq = hl * a.qk_head_dim + d.index_n_heads * d.index_head_dim
        tc = tensor_core
        self.tc_fused = tc and pm.proj_mma_supported(cfg.hidden_size, xs)
        self.tc_q = tc and pm.proj_mma_supported(a.q_lora_rank, xs)
        wk_stride = hl * a.qk_nope_head_dim if self.rope else nq
        self.tc_wk = tc and pm.proj_mma_supported(a.qk_nope_head_dim, wk_stride, a.qk_nope_head_dim)
        self.tc_wv = tc and pm.proj_mma_supported(a.kv_lora_rank, hl * a.kv_lora_rank, a.kv_lora_rank)
        gw = sh.group_heads * a.v_head_dim
        self.tc_o = tc and pm.proj_mma_supported(gw, hl * a.v_head_dim, gw, attn.o_col0)
        # The per-head projections' weights as one segment each, made once (not per launch).
        H, C = cfg.hidden_size, a.kv_lora_rank
        self.wk_seg = (GemvSegment(w=attn.wk_t, scales=None, rows=C, col=0),)
        self.wv_seg = (GemvSegment(w=attn.wv, scales=None, rows=a.v_head_dim, col=0),)
        self.o_seg = (GemvSegment(w=attn.o_proj, scales=attn.o_scales, rows=H, col=0),)
        # The split-k workspace a row of each tensor-core launch needs (k split by shape alone).
        sites = [
            (self.tc_fused, attn.fused_full, 1, H, attn.fused_rows),
            (self.tc_fused, attn.fused_ctx, 1, H, self.ctx_rows),
            (self.tc_q, attn.q_segments, 1, a.q_lora_rank, nq),
            (self.tc_wk, self.wk_seg, hl, a.qk_nope_head_dim, hl * C),
            (self.tc_wv, self.wv_seg, hl, C, hl * a.v_head_dim),
            (self.tc_o, self.o_seg, sh.local_groups, gw, sh.groups * H),
        ]
        self.part_row_bytes = max(
            (pm.proj_workspace_bytes(sg, heads, k, 1, ys) for on, sg, heads, k, ys in sites if on), default=0
        )

    def _normed_projection(
        self,
        *,
        x: DevicePtr,
        x_stride: int,
        norm_w: DevicePtr,
        segments,
        y: DevicePtr,
        y_stride: int,
        m: int,
        k: int,
        xn: DevicePtr | None,
        tc: bool,
        part: DevicePtr | None = None,
        beside: bool = False,
        stream=None,
    ) -> None:
        """y[e, segments' columns] = W_seg . (rmsnorm(x_e) * norm_w): on tensor cores through the
        normed rows ``xn`` (two launches), else in one CUDA-core launch with the norm as prologue."""
        eps = self.cfg.rms_norm_eps
        if not tc:
            bg8.rmsnorm_gemv_seg_batch(
                self.gpu,
                x=x,
                x_stride=x_stride,
                norm_w=norm_w,
                segments=segments,
                y=y,
                y_stride=y_stride,
                m=m,
                k=k,
                eps=eps,
                beside=beside,
                stream=stream,
            )
            return
        xs = xn_stride(self.cfg)
        pm.rmsnorm_rows_batch(
            self.gpu,
            x=x,
            x_stride=x_stride,
            norm_w=norm_w,
            out=xn,
            out_stride=xs,
            m=m,
            k=k,
            eps=eps,
            stream=stream,
        )
        pm.proj_mma_batch(
            self.gpu,
            x=xn,
            x_stride=xs,
            segments=segments,
            y=y,
            y_stride=y_stride,
            m=m,
            k=k,
            out_f32=False,
            part=part,
            stream=stream,
        )

    def _head_projection(
        self,
        *,
        tc: bool,
        seg: tuple[GemvSegment],
        x: DevicePtr,
        x_stride: int,
        y: DevicePtr,
        y_stride: int,
        m: int,
        heads: int,
        n: int,
        k: int,
        out_f32: bool,
        scale_cols: int = 0,
        col0: int = 0,
        part: DevicePtr | None = None,
        beside: bool = False,
        stream=None,
    ) -> None:
        """Per head h: y[e, h * n : + n] = W[h] (n x k) @ x[e, h * k : + k]; W (``seg``: the one
        segment of rows n) BF16, or FP8 with block scales (o_proj). Tensor cores with ``tc``
        (``part``: the split-k workspace), else the CUDA-core GEMVs."""
        w, scales = seg[0].w, seg[0].scales
        if tc:
            pm.proj_mma_batch(
                self.gpu,
                x=x,
                x_stride=x_stride,
                x_head=k,
                segments=seg,
                y=y,
                y_stride=y_stride,
                y_head=n,
                heads=heads,
                m=m,
                k=k,
                out_f32=out_f32,
                s_cols=scale_cols if scales is not None else None,
                s_col0=col0,
                part=part,
                stream=stream,
            )
            return
        common = dict(
            x=x,
            x_stride=x_stride,
            y=y,
            y_stride=y_stride,
            m=m,
            heads=heads,
            n=n,
            k=k,
            out_f32=out_f32,
            stream=stream,
        )
        if scales is not None:
            bg8.bgemv_fp8_batch(
                self.gpu, w=w, scales=scales, scale_cols=scale_cols, col0=col0, beside=beside, **common
            )
        else:
            bg.bgemv_batch(self.gpu, w=w, beside=beside, **common)

    # ---- caches ---------------------------------------------------------------------------------

    def _write_caches(
        self,
        fused: DevicePtr,
        stride: int,
        pools: SlotPools,
        entries: DevicePtr,
        m: int,
        row_add: int,
        stream,
    ) -> None:
        cfg, w, kv = self.cfg, self.attn, pools.kv
        lp, g = pools.layers[self.kv_layer], pools.geometry
        a, d = cfg.attention, cfg.dsa
        common = dict(
            fused=fused,
            stride=stride,
            kv_norm_w=w.kv_a_norm,
            cache=kv.data[self.kv_layer],
            scales=kv.scales[self.kv_layer],
            tables=pools.tables,
            knorm_w=w.k_norm_w,
            knorm_b=w.k_norm_b,
            pool_keys=lp.pool_keys,
            pool_scales=lp.pool_scales,
            entries=entries,
            m=m,
            row_add=row_add,
            slot_rows=g.slot_rows,
            C=a.kv_lora_rank,
            idim=g.idim,
            block_size=g.block_size,
            eps=cfg.rms_norm_eps,
            ln_eps=INDEXER_LN_EPS,
            stream=stream,
        )
        # One launch for the latent, the indexer key (and gate), the rope key and the pools the
        # rows complete (a per-token key is its own pool).
        if d.per_token:
            rp = a.rope
            # NoPE with the per-token indexer reads no rope key and no frequency: the launcher
            # takes no null pointer, so the pool keys stand in (rope_dim 0: never dereferenced).
            dsa_cache.dsa_cache_write_plain_batch(
                self.gpu,
                rope_keys=lp.rope_keys if self.rope else lp.pool_keys,
                inv_freq=w.rope_inv_freq if rp is not None else lp.pool_scales,
                attn_factor=rp.attention_factor if rp is not None else 1.0,
                rope_dim=a.qk_rope_head_dim,
                irope_dim=d.rope_dim,
                interleave=bool(rp is not None and rp.interleave),
                i_interleave=bool(rp is not None and rp.indexer_interleave),
                **common,
            )
        else:
            dsa_cache.dsa_cache_write_batch(
                self.gpu, keys=lp.keys, gates=lp.gates, ape=w.ape, kpool=g.kpool, **common
            )

    def context_rows(
        self,
        x: DevicePtr,
        fused: DevicePtr,
        pools: SlotPools,
        entries: DevicePtr,
        m: int,
        stream=None,
        xn: DevicePtr | None = None,
        part: DevicePtr | None = None,
    ) -> None:
        """Cache rows for the m inputs ``x[m, H]`` of entries ``entries[0..m)`` (a sequence's rows
        consecutive and ascending), through ``fused [m, ctx_rows]`` (and, with tensor-core
        projections, the normed rows ``xn [m, xn_stride]``). The projection is the full row's, cut
        to the rows a cache needs, so a context row writes exactly the bytes its full row would."""
        H = self.cfg.hidden_size
        self._normed_projection(
            x=x,
            x_stride=H,
            norm_w=self.attn.input_norm,
            segments=self.attn.fused_ctx,
            y=fused,
            y_stride=self.ctx_rows,
            m=m,
            k=H,
            xn=xn,
            tc=self.tc_fused,
            part=part,
            stream=stream,
        )
        self._write_caches(fused, self.ctx_rows, pools, entries, m, 0, stream)

    # ---- the whole layer ------------------------------------------------------------------------

    def full_rows(
        self,
        x: DevicePtr,
        s: BatchScratch,
        pools: SlotPools,
        entries: DevicePtr,
        m: int,
        row_add: int,
        stream=None,
        next_norm: tuple[DevicePtr, DevicePtr] | None = None,
        reuse_selection: bool = False,
    ) -> None:
        """x [m, H] in place: x = x + attn(norm(x)); x = x + mlp(norm(x)). With ``next_norm = (w, out)``
        the consumer's RMSNorm ``out = rmsnorm(x) * w`` is fused into the last residual add."""
        self.attention(x, s, pools, entries, m, row_add, stream, reuse_selection)
        self.mlp_forward(s, x, entries, m, stream, next_norm)

    def attention(
        self,
        x: DevicePtr,
        s: BatchScratch,
        pools: SlotPools,
        entries: DevicePtr,
        m: int,
        row_add: int,
        stream=None,
        reuse_selection: bool = False,
    ) -> None:
        """With ``reuse_selection`` each row attends the selection the previous full row of its
        batch position made (no indexer scores, no top-k), extended by its own row when the tail is
        selected (``model.dsa``, "Shared selection"); the caller sized ``selection_extra``."""
        cfg, gpu, w, sh = self.cfg, self.gpu, self.attn, self.sh
        a, d, H, eps = cfg.attention, cfg.dsa, cfg.hidden_size, cfg.rms_norm_eps
        C, idim, ih = a.kv_lora_rank, d.index_head_dim, d.index_n_heads
        hl, g = sh.local_heads, pools.geometry
        lp, kv = pools.layers[self.kv_layer], pools.kv
        fr = w.fused_rows
        # The input norm is every block's prologue of the CUDA-core fused projection.
        self._normed_projection(
            x=x,
            x_stride=H,
            norm_w=w.input_norm,
            segments=w.fused_full,
            y=s.fused,
            y_stride=fr,
            m=m,
            k=H,
            xn=s.xn,
            tc=self.tc_fused,
            part=s.proj_part,
            stream=stream,
        )
        self._write_caches(s.fused, fr, pools, entries, m, row_add, stream)
        q_a = s.fused.offset(self.ctx_rows * 2)
        nq = hl * a.qk_head_dim + ih * idim
        # The q projection reads the same fused rows as the cache write, so the CUDA-core one runs
        # beside it.
        self._normed_projection(
            x=q_a,
            x_stride=fr,
            norm_w=w.q_a_norm,
            segments=w.q_segments,
            y=s.q_fused,
            y_stride=nq,
            m=m,
            k=a.q_lora_rank,
            xn=s.xn,
            tc=self.tc_q,
            part=s.proj_part,
            beside=True,
            stream=stream,
        )
        if self.rope or d.rope_dim:
            rp = a.rope
            rope.rope_q_batch(
                gpu,
                q=s.q_fused,
                q_stride=nq,
                heads=hl,
                nope=a.qk_nope_head_dim,
                rope_dim=a.qk_rope_head_dim,
                iq_offset=hl * a.qk_head_dim,
                iheads=ih,
                idim=idim,
                irope_dim=d.rope_dim,
                inv_freq=w.rope_inv_freq,
                attn_factor=rp.attention_factor,
                interleave=rp.interleave,
                i_interleave=rp.indexer_interleave,
                q_nope=s.q_nope,
                q_rope=s.q_rope,
                entries=entries,
                m=m,
                row_add=row_add,
                stream=stream,
            )
        sel_cap = selection_rows(d, g.slot_rows, self.selection_extra)
        if not reuse_selection:
            dsa_select.indexer_scores_batch(
                gpu,
                q=s.q_fused.offset(hl * a.qk_head_dim * 2),
                q_stride=nq,
                w=q_a.offset(a.q_lora_rank * 2),  # weights_proj y
                w_stride=fr,
                pool_keys=lp.pool_keys,
                pool_scales=lp.pool_scales,
                scores=s.iscores,
                entries=entries,
                m=m,
                row_add=row_add,
                slot_rows=g.slot_rows,
                heads=ih,
                dim=idim,
                kpool=d.index_kpool,
                w_scale=1.0 / ih**0.5,
                stream=stream,
            )
            dsa_select.select_topk_pools_batch(
                gpu,
                scores=s.iscores,
                selected=s.selected,
                count=s.count,
                entries=entries,
                m=m,
                row_add=row_add,
                slot_rows=g.slot_rows,
                sel_cap=sel_cap,
                topk_pools=d.topk_pools,
                kpool=d.index_kpool,
                tail=d.always_select_tail,
                workspace=s.select_ws,
                stream=stream,
            )
        elif d.always_select_tail:
            dsa_select.extend_selection_batch(
                gpu,
                selected=s.selected,
                count=s.count,
                entries=entries,
                m=m,
                row_add=row_add,
                sel_cap=sel_cap,
                stream=stream,
            )
        # The absorbed query needs only the q projection, so the CUDA-core one streams wk_t beside
        # the selection.
        self._head_projection(
            tc=self.tc_wk,
            part=s.proj_part,
            seg=self.wk_seg,
            x=s.q_nope if self.rope else s.q_fused,
            x_stride=hl * a.qk_nope_head_dim if self.rope else nq,
            y=s.q_abs,
            y_stride=hl * C,
            m=m,
            heads=hl,
            n=C,
            k=a.qk_nope_head_dim,
            out_f32=True,
            beside=True,
            stream=stream,
        )
        attend = dict(
            q=s.q_abs,
            cache=kv.data[self.kv_layer],
            scales=kv.scales[self.kv_layer],
            tables=pools.tables,
            selected=s.selected,
            count=s.count,
            out=s.o_lat,
            entries=entries,
            m=m,
            slot_rows=g.slot_rows,
            sel_cap=sel_cap,
            heads=hl,
            dim=C,
            block_size=g.block_size,
            scale=a.softmax_scale,
            q_rope=s.q_rope,
            rope_keys=lp.rope_keys,
            rope_dim=a.qk_rope_head_dim,
            stream=stream,
        )
        if self.attn_split_rows:
            sparse_mla.sparse_mla_wide_batch(
                gpu, part=s.attn_part, ml=s.attn_ml, split_rows=self.attn_split_rows, **attend
            )
        elif sparse_mla.split_supported(C, sel_cap):
            sparse_mla.sparse_mla_split_batch(gpu, part=s.attn_part, ml=s.attn_ml, **attend)
        else:
            sparse_mla.sparse_mla_attend_batch(gpu, **attend)
        gw = sh.group_heads * a.v_head_dim
        self._head_projection(
            tc=self.tc_wv,
            part=s.proj_part,
            seg=self.wv_seg,
            x=s.o_lat,
            x_stride=hl * C,
            y=s.o,
            y_stride=hl * a.v_head_dim,
            m=m,
            heads=hl,
            n=a.v_head_dim,
            k=C,
            out_f32=False,
            stream=stream,
        )
        # This rank's groups of o_proj into its columns of the all-groups rows; on several ranks a
        # sum all-reduce fills in the others' (each element is non-zero on one rank only, so the
        # sum is exact and the rows are added in group order as on one rank).
        g0 = sh.rank * sh.local_groups if sh.world_size > 1 else 0
        if sh.world_size > 1:
            # The all-reduce below leaves every rank's groups in place; they must be zero again
            # before this rank's contribution (else the next draft adds the last one's back in).
            gpu.memset(s.attn_parts, 0, m * sh.groups * H * 4, stream)
        self._head_projection(
            tc=self.tc_o,
            part=s.proj_part,
            seg=self.o_seg,
            x=s.o,
            x_stride=hl * a.v_head_dim,
            y=s.attn_parts.offset(g0 * H * 4),
            y_stride=sh.groups * H,
            m=m,
            heads=sh.local_groups,
            n=H,
            k=gw,
            out_f32=True,
            scale_cols=w.o_scale_cols,
            col0=w.o_col0,
            stream=stream,
        )
        if sh.world_size > 1:
            self.comm.all_reduce(
                s.attn_parts, m * sh.groups * H, CommDtype.FLOAT32, ReduceOp.SUM, stream=stream
            )
        # h1 = x + attn, and the MLP's input norm y2 = rmsnorm(h1) * post_norm, in one launch.
        bg.sum_rows_residual_rmsnorm_batch(
            gpu,
            parts=s.attn_parts,
            residual=x,
            norm_w=self.mlp.post_norm,
            out=s.h1,
            normed=s.y2,
            m=m,
            rows=sh.groups,
            n=H,
            eps=eps,
            stream=stream,
        )

    def _residual_out(
        self,
        parts: DevicePtr,
        s: BatchScratch,
        x_out: DevicePtr,
        m: int,
        rows: int,
        next_norm: tuple[DevicePtr, DevicePtr] | None,
        stream,
    ) -> None:
        H = self.cfg.hidden_size
        if next_norm is None:
            bg.sum_rows_residual_batch(
                self.gpu, parts=parts, residual=s.h1, out=x_out, m=m, rows=rows, n=H, stream=stream
            )
        else:
            bg.sum_rows_residual_rmsnorm_batch(
                self.gpu,
                parts=parts,
                residual=s.h1,
                norm_w=next_norm[0],
                out=x_out,
                normed=next_norm[1],
                m=m,
                rows=rows,
                n=H,
                eps=self.cfg.rms_norm_eps,
                stream=stream,
            )

    def mlp_forward(
        self,
        s: BatchScratch,
        x_out: DevicePtr,
        entries: DevicePtr,
        m: int,
        stream=None,
        next_norm: tuple[DevicePtr, DevicePtr] | None = None,
    ) -> None:
        """x_out = h1 + mlp(y2), with y2 = post_norm(h1) as ``attention`` left it; with
        ``next_norm = (w, out)`` also out = rmsnorm(x_out) * w."""
        cfg, gpu, w = self.cfg, self.gpu, self.mlp
        H, mc = cfg.hidden_size, cfg.moe
        if not w.is_moe:
            # A dense MLP is the shared slot alone: every live row, weight 1.
            ntopk, shared, w_sh_gu, w_sh_down = 0, moe.SHARED_HERE, w.gate_up, w.down
        else:
            ntopk = mc.num_experts_per_tok
            if mc.n_shared_experts == 0:
                shared, w_sh_gu, w_sh_down = moe.SHARED_NONE, w.gate_up, w.down
            elif w.shared_gate_up is not None:
                shared, w_sh_gu, w_sh_down = moe.SHARED_HERE, w.shared_gate_up, w.shared_down
            else:
                shared, w_sh_gu, w_sh_down = moe.SHARED_ELSEWHERE, w.gate_up, w.down
            # Scores, top-k and the grouping of the batch's pairs by expert in one launch.
            moe.router_group_batch(
                gpu,
                w=w.router,
                y=s.y2,
                bias=w.bias,
                scores=s.rscores,
                ids=s.ids,
                weights=s.wts,
                counter=s.router_counter,
                entries=entries,
                group=s.group,
                m=m,
                n_experts=mc.n_routed_experts,
                h=H,
                topk=ntopk,
                norm=mc.norm_topk_prob,
                scale=mc.routed_scaling_factor,
                shared=mc.n_shared_experts > 0,
                n_group=mc.n_group,
                topk_group=mc.topk_group,
                expert_base=w.expert_base,
                n_local=w.n_local,
                stream=stream,
            )
        slots = ntopk + int(shared != moe.SHARED_NONE)
        common = dict(entries=entries, m=m, ntopk=ntopk, n_local=w.n_local, shared=shared, stream=stream)
        gate_up = dict(
            w=w.gate_up,
            w_shared=w_sh_gu,
            y=s.y2,
            group=s.group if ntopk else None,
            act=s.act,
            inter=w.inter,
            h=H,
            limit=mc.swiglu_limit,
            **common,
        )
        down = dict(
            w=w.down,
            w_shared=w_sh_down,
            act=s.act,
            weights=s.wts if ntopk else None,
            group=s.group if ntopk else None,
            parts=s.moe_parts,
            h=H,
            inter=w.inter,
            **common,
        )
        if w.fp8:
            # The shared slot's scales follow its weights (the routed ones where it has none here).
            here = shared == moe.SHARED_HERE and w.shared_gate_up_scales is not None
            moe.moe_gate_up_fp8_batch(
                gpu,
                w_scale=w.gate_up_scales,
                w_shared_scale=w.shared_gate_up_scales if here else w.gate_up_scales,
                **gate_up,
            )
            moe.moe_down_fp8_batch(
                gpu,
                w_scale=w.down_scales,
                w_shared_scale=w.shared_down_scales if here else w.down_scales,
                **down,
            )
        else:
            moe.moe_gate_up_batch(gpu, **gate_up)
            moe.moe_down_batch(gpu, **down)
        if self.sh.world_size > 1:
            # Every pair row is non-zero on exactly one rank, so this sum is exact (x + 0 = x).
            self.comm.all_reduce(s.moe_parts, m * slots * H, CommDtype.FLOAT32, ReduceOp.SUM, stream=stream)
        self._residual_out(s.moe_parts, s, x_out, m, slots, next_norm, stream)
