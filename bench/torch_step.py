"""The MTP draft step written plainly in PyTorch, timed eager and as a replayed CUDA graph.

    python3 bench/torch_step.py                  # GLM-5.3-Flash shapes, contexts 4096 and 16000, k 1 and 3
    python3 bench/torch_step.py --model glm5     # GLM-5.2's (deepseek_v32: DeepSeek-V3.2's)
    python3 -c "from bench.torch_step import run; print(run(4096, 3, graph=True))"

A baseline for the runtime (about 5.6 ms eager / 3.2 ms graph at context 4096, k = 3, on an H200:
BENCHMARKS.md). BF16 random weights at ``model.config.glm5_flash()`` shapes; ``context`` rows already sit in
the caches (random latents, indexer keys and gates, BF16 pool keys); each draft writes row
``context + i`` and runs:

1. ``x = eh_proj [rmsnorm(embed[t]) * enorm ; rmsnorm(h) * hnorm]``
2. ``y = rmsnorm(x)``; query latent ``rmsnorm(q_a y)``, ``q = q_b .``; latent ``c = rmsnorm(kv_a y)``
   written to row n; indexer key ``LayerNorm(wk y)`` and gate written, the pool compressed when row n
   completes one; pool scores ``sum_h w_h relu(q_h . key_p) / sqrt(idim)``, ``topk`` of
   ``index_topk / kpool`` pools expanded to rows, plus the tail (dense with few pools);
3. absorbed MLA over the gathered latent rows (query through ``kv_b``'s key half, output through its
   value half), ``o_proj``;
4. MoE: sigmoid router, top-8 of score + bias, normalised weights x scaling; the chosen experts'
   weights are gathered (``index_select`` on the stacked [E, I, H] tensors, which keeps the step
   capturable: no host sync) and applied as batched GEMVs; the shared expert with weight 1 (ungated);
   with ``index_share_for_mtp_iteration`` (GLM-5.3-Flash) drafts 2..k skip the indexer and attend
   draft 1's selection plus the rows drafted since, as the runtime does;
5. ``lm_head`` GEMV on ``rmsnorm(x) * shared_head.norm`` and ``argmax``, which feeds draft i+1 on
   the device (embedding row and the normalised ``x`` as the next hidden).

The RoPE family (``cfg`` of ``model.config.glm5()`` / ``deepseek_v32()``; the variant is read from
the config, one code path): ``kv_a`` gives the latent and a shared rope key, rotated at the row's
position (its row) and cached beside the latent (BF16); each query head's last
``qk_rope_head_dim`` dims are rotated alike and score against the selected rows' rope keys besides
the absorbed latent part (``rope``: pairs interleaved, ``cfg.rope_inv_freq``, cos and sin times
``rope.attention_factor``; softmax scale ``attention.softmax_scale``, YaRN's mscale included). The
indexer is the per-token one: each row's key ``LayerNorm(wk y)`` with its first ``dsa.rope_dim``
dims rotated (interleaved for GLM-5, half-split for DeepSeek-V3.2), and the query heads' alike, is
its own pool (BF16 here, FP8 in the runtime), no gate; the top ``index_topk`` rows, every row while
there are at most that many. The router is group-limited where ``moe.n_group`` says so (``route``);
no SwiGLU clamp where ``swiglu_limit`` is infinite.

Graph replays are timed with CUDA events around each replay (median of many); eager runs with a
synchronize around each k-draft propose (median). One graph per (context, k): row indices are
baked into the captured kernels, as a fixed-shape capture would do.

The whole batch (``BatchDraftStep``, ``run_batch``; ``--batches 1,16,64``): B sequences, each with
its own caches and context, drafted together with the same arithmetic per row as ``DraftStep``:
every projection one [B, ·] GEMM; each sequence's indexer scores over its own pools (padded to
the batch's largest pool count, masked), its own top-k and selection (padded to one width, masked
in the softmax) and absorbed MLA over its own latent rows; the MoE as ``torch._grouped_mm`` over
the B x top_k (row, expert) pairs sorted by expert, group ends by ``searchsorted`` on the device
(no host sync: capturable; no padding of groups needed, empty groups allowed), each expert's
weights read once per draft; the shared expert one GEMM; the head one [B, H] x [H, V] GEMM in BF16,
or (``fp8_head``) ``torch._scaled_mm`` on an FP8 copy with per-row scales, the activations
quantized per row (``_scaled_mm`` takes no BF16 operand); argmax per row feeds the next draft.
One graph per (B, k, contexts): the contexts are baked, as above. On an H200 (torch 2.11, k = 3,
every sequence at 4096, BF16 head, graph): 2.9 ms at B = 1, 8.5 ms at B = 16, 16.8 ms at B = 64,
26.3 ms at B = 256; the grouped expert GEMMs take about 70% of it at B = 64 (about 3.1 TB/s of
expert weights), ragged contexts (128..16000) about the same.

FP8 experts (``run_batch(..., fp8_experts=True)``, ``--fp8-experts``): the routed and shared experts
stored as FP8 E4M3 (``fp8_expert_weights``: one f32 scale per output channel, gate and up stacked as
one [E + 1, 2I, H] matrix, the shared expert as group E) and the MoE as two calls of PyTorch's FP8
grouped GEMM, rowwise 2d x 3d::

    torch._scaled_grouped_mm(a8, w8.transpose(1, 2), scale_a, scale_w, offs=offs,
                             out_dtype=torch.bfloat16, use_fast_accum=True)

a8 [rows, K] FP8 row-major (each row's activations quantised on the fly, absmax / 448, saturating:
``quantize_rows_fp8``), w8 [E + 1, N, K] contiguous so its transpose is the [G, K, N] column-major
operand the op takes, scale_a [rows] f32, scale_w [E + 1, N] f32, offs [E + 1] int32 cumulative group
ends; K and N multiples of 16, fewer than 1024 groups, compute capability 9.0 (or 10.0). The pairs are
laid out by ``fp8_group_layout`` on the device (capturable): groups in expert order, each segment
padded to 16 rows, the padding rows zero. The checkpoint's 128x128 block scales are not what the op
takes (rowwise or MX scales only), so this step reads the same expert bytes as a block-scaled FP8
kernel (plus 4 bytes per output channel) but does not compute the same numbers: bytes for bytes, not
bit for bit. Where the op is missing or refuses the device or shapes, ``Fp8GroupedMmUnavailable``
says why (``--fp8-experts`` reports it in its JSON and exits 3). The BF16 path is untouched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a script (python bench/torch_step.py): find model/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402 - after the sys.path insert
import torch.nn.functional as F  # noqa: E402 - after the sys.path insert

from model.config import glm5_flash  # noqa: E402 - after the sys.path insert


def _up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = _up(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * _up(w)).to(x.dtype)


def rope(
    x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, attn_factor: float, interleave: bool
) -> torch.Tensor:
    """x [..., d] rotated at positions ``pos`` (broadcasting against ``x.shape[:-1]``): pair i turns
    by ``pos * inv_freq[i]``, cos and sin scaled by ``attn_factor`` (YaRN's), pairs (2i, 2i + 1)
    with ``interleave`` (the MLA's; GLM-5's indexer's) else (i, i + d/2) (DeepSeek-V3.2's indexer),
    each pair's result in its own places. In f32 (f64 for an f64 x), returned in x's dtype."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    ang = pos.to(ct)[..., None] * inv_freq.to(ct)
    c, s = torch.cos(ang) * attn_factor, torch.sin(ang) * attn_factor
    xf = x.to(ct)
    if interleave:
        x0, x1 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(-2)
    else:
        x0, x1 = xf.chunk(2, -1)
        out = torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], -1)
    return out.to(x.dtype)


def route(scores: torch.Tensor, bias: torch.Tensor, moe) -> torch.Tensor:
    """The routed experts [..., top_k] of sigmoid ``scores`` [..., E]: the top-k of score + bias,
    the lower expert first on a tie; with group-limited routing (``n_group`` > 1 and ``topk_group``
    < ``n_group``: DeepSeek-V3.2's 8 and 4) only among the experts of the ``topk_group`` groups (E /
    n_group consecutive experts each) whose two best score + bias sum highest, the lower group
    first on a tie."""
    sel = scores + bias
    if moe.n_group > 1 and moe.topk_group < moe.n_group:
        E, G = sel.shape[-1], moe.n_group
        group = sel.unflatten(-1, (G, E // G)).topk(2, dim=-1).values.sum(-1)  # [..., G]
        kept = torch.sort(group, dim=-1, descending=True, stable=True).indices[..., : moe.topk_group]
        keep = torch.zeros_like(group, dtype=torch.bool).scatter_(-1, kept, True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // G, -1), float("-inf"))
    return torch.sort(sel, dim=-1, descending=True, stable=True).indices[..., : moe.num_experts_per_tok]


class DraftStep:
    """Weights and caches of one MTP block, and its k-draft propose. The variant is the config's:
    NoPE MLA with the KPool indexer (GLM-5.3-Flash), or MLA with RoPE and the per-token indexer
    (GLM-5, DeepSeek-V3.2: ``dsa.per_token``), group-limited routing where ``moe.n_group`` says so,
    no SwiGLU clamp where ``moe.swiglu_limit`` is infinite."""

    def __init__(
        self, cfg, rows: int, device="cuda", dtype=torch.bfloat16, seed: int = 0, weights: dict | None = None
    ) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        H, V = cfg.hidden_size, cfg.vocab_size
        self.rows = rows
        g = torch.Generator(device=self.device).manual_seed(seed)
        dev = self.device

        def lin(o, i):
            w = torch.empty(o, i, device=dev, dtype=dtype)
            w.normal_(0.0, 1.0 / math.sqrt(i), generator=g)
            return w

        def norm(n):
            return torch.ones(n, device=dev, dtype=dtype)

        E, I, nh = m.n_routed_experts, m.moe_intermediate_size, a.num_attention_heads
        if weights is None:
            W = {
                "embed": torch.randn(V, H, device=dev, dtype=dtype, generator=g),
                "head": lin(V, H),
                "enorm": norm(H),
                "hnorm": norm(H),
                "in_norm": norm(H),
                "post_norm": norm(H),
                "head_norm": norm(H),
                "eh_proj": lin(H, 2 * H),
                "q_a": lin(a.q_lora_rank, H),
                "q_a_norm": norm(a.q_lora_rank),
                "q_b": lin(nh * a.qk_head_dim, a.q_lora_rank),
                "kv_a": lin(a.kv_lora_rank + a.qk_rope_head_dim, H),  # [latent ; rope key]
                "kv_a_norm": norm(a.kv_lora_rank),
                "kv_b": lin(nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
                "o_proj": lin(H, nh * a.v_head_dim),
                "ix_wq_b": lin(d.index_n_heads * d.index_head_dim, a.q_lora_rank),
                "ix_wk": lin(d.index_head_dim, H),
                "ix_ln_w": norm(d.index_head_dim),
                "ix_ln_b": torch.zeros(d.index_head_dim, device=dev, dtype=dtype),
                "ix_weights": lin(d.index_n_heads, H),
                "router": lin(E, H),
                "router_bias": torch.zeros(E, device=dev, dtype=torch.float32),
                "shared_gate_proj": lin(I, H),
                "shared_up_proj": lin(I, H),
                "shared_down_proj": lin(H, I),
            }
            if not d.per_token:  # the KPool indexer's compression
                W["ix_gate"] = lin(d.index_head_dim, H)
                W["ix_ape"] = torch.zeros(d.index_kpool, d.index_head_dim, device=dev, dtype=dtype)
            # Stacked routed experts [E, I, H] / [E, H, I], drawn expert by expert (no 2x peak).
            for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                t = torch.empty(E, *shape, device=dev, dtype=dtype)
                for e in range(E):
                    t[e].normal_(0.0, 1.0 / math.sqrt(shape[1]), generator=g)
                W["experts_" + name] = t
        else:
            W = weights
        self.W = W
        kvb = W["kv_b"].view(nh, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        self.w_uk = kvb[:, : a.qk_nope_head_dim, :]  # [nh, nope, kl]
        self.w_uv_t = kvb[:, a.qk_nope_head_dim :, :].transpose(1, 2)  # [nh, kl, v]
        # RoPE (GLM-5, DeepSeek-V3.2): one table for the MLA's rope dims and the indexer's first ones.
        rp = a.rope
        self.inv_freq = None if rp is None else torch.as_tensor(cfg.rope_inv_freq, device=dev)
        self.attn_factor = 1.0 if rp is None else rp.attention_factor
        # Each row's position is its row (the drafter's numbering); a view per row, no launch.
        self.positions = torch.arange(rows, device=dev)
        # Caches of the DSA state: latents and (RoPE) rotated rope keys per row; the KPool
        # indexer's keys and gates per row and its pool keys per pool, or the per-token indexer's
        # rotated key per row (its pools are its tokens).
        self.latents = torch.randn(rows, a.kv_lora_rank, device=dev, dtype=dtype, generator=g)
        self.rope_keys = (
            torch.randn(rows, a.qk_rope_head_dim, device=dev, dtype=dtype, generator=g) if rp else None
        )
        self.keys = self.gates = None
        if not d.per_token:
            self.keys = torch.randn(rows, d.index_head_dim, device=dev, dtype=dtype, generator=g)
            self.gates = torch.randn(rows, d.index_head_dim, device=dev, dtype=dtype, generator=g)
        self.pool_keys = torch.randn(
            rows // d.index_kpool, d.index_head_dim, device=dev, dtype=dtype, generator=g
        )
        # Static inputs / outputs (what a graph reads and writes).
        self.tok_in = torch.zeros(1, dtype=torch.long, device=dev)
        self.hid_in = torch.randn(H, device=dev, dtype=dtype, generator=g)
        self.drafts = torch.zeros(8, dtype=torch.long, device=dev)
        self.last_hidden = torch.zeros(H, device=dev, dtype=dtype)
        # The propose's first row and the rows it selected (drafts after it reuse them when the
        # config shares the selection, index_share_for_mtp_iteration).
        self._first_row = rows
        self._first_rows = torch.zeros(0, dtype=torch.long, device=dev)

    def rope_mla(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The MLA's rope dims (a query head's or the shared key's) rotated at ``pos``."""
        return rope(x, pos, self.inv_freq, self.attn_factor, self.cfg.attention.rope.interleave)

    def rope_index(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """An indexer query head or key with its first ``dsa.rope_dim`` dims rotated at ``pos``
        (unchanged without them)."""
        r = self.cfg.dsa.rope_dim
        if not r:
            return x
        il = self.cfg.attention.rope.indexer_interleave
        return torch.cat([rope(x[..., :r], pos, self.inv_freq, self.attn_factor, il), x[..., r:]], -1)

    def index_key(self, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The indexer key of normalised inputs y [..., H]: LayerNorm(wk y) (eps 1e-6), its rope
        dims rotated at ``pos`` (the per-token indexer's), in the step's dtype."""
        W, idim = self.W, self.cfg.dsa.index_head_dim
        k = F.layer_norm(_up(F.linear(y, W["ix_wk"])), (idim,), _up(W["ix_ln_w"]), _up(W["ix_ln_b"]), 1e-6)
        return self.rope_index(k, pos).to(self.dtype)

    def moe(self, y2: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One row's routed experts ``idx`` [top_k] (weights ``w``) and the shared expert on y2 [H]:
        f32 [H]. SwiGLU clamped at ``swiglu_limit`` (infinite, so no clamp, for GLM-5 and
        DeepSeek-V3.2)."""
        W, L = self.W, self.cfg.moe.swiglu_limit
        wg = W["experts_gate_proj"].index_select(0, idx)  # [k, I, H]
        wu = W["experts_up_proj"].index_select(0, idx)
        wd = W["experts_down_proj"].index_select(0, idx)  # [k, H, I]
        yb = y2[None, :, None].expand(idx.numel(), -1, 1)
        act = F.silu(torch.bmm(wg, yb).clamp(max=L)) * torch.bmm(wu, yb).clamp(-L, L)
        routed = (_up(torch.bmm(wd, act)[..., 0]) * w[:, None].to(_up(act).dtype)).sum(0)
        sh = F.linear(
            F.silu(F.linear(y2, W["shared_gate_proj"]).clamp(max=L))
            * F.linear(y2, W["shared_up_proj"]).clamp(-L, L),
            W["shared_down_proj"],
        )
        return routed + _up(sh)

    # ---- one draft -----------------------------------------------------------------------------

    def _draft(self, tok: torch.Tensor, h: torch.Tensor, n: int):
        """Row n from (token [1] on device, hidden [H]); returns (next token [1], normalised x)."""
        cfg, W = self.cfg, self.W
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        eps = cfg.rms_norm_eps
        nh, kp, C, nope = a.num_attention_heads, d.index_kpool, a.kv_lora_rank, a.qk_nope_head_dim
        pos = self.positions[n]
        e = _rms(F.embedding(tok, W["embed"])[0], W["enorm"], eps)
        x = F.linear(torch.cat([e, _rms(h, W["hnorm"], eps)]), W["eh_proj"])
        y = _rms(x, W["in_norm"], eps)
        qa = _rms(F.linear(y, W["q_a"]), W["q_a_norm"], eps)
        q = F.linear(qa, W["q_b"]).view(nh, a.qk_head_dim)
        kv = F.linear(y, W["kv_a"])  # [latent (C) ; rope key]
        self.latents[n] = _rms(kv[:C], W["kv_a_norm"], eps)
        if self.rope_keys is not None:
            self.rope_keys[n] = self.rope_mla(kv[C:], pos)
        # Indexer: this row's key; the per-token indexer's is its own pool's, the KPool indexer's
        # (and gate) complete a pool every kpool rows.
        ncomp = (n + 1) // kp
        if d.per_token:
            self.pool_keys[n] = self.index_key(y, pos)
        else:
            self.keys[n] = self.index_key(y, pos)
            self.gates[n] = F.linear(y, W["ix_gate"])
            if (n + 1) % kp == 0:
                s = slice(n + 1 - kp, n + 1)
                wts = torch.softmax(_up(self.gates[s]) + _up(W["ix_ape"]), dim=0)
                self.pool_keys[ncomp - 1] = (wts * _up(self.keys[s])).sum(0).to(self.dtype)
        K = d.index_topk // kp
        rows = None  # every row 0..n (a view of the caches)
        if d.share_for_mtp_iteration and n > self._first_row:
            # Drafts 2..k reuse draft 1's selection, plus the rows drafted since (model/dsa.py).
            rows = torch.cat([self._first_rows, torch.arange(self._first_row + 1, n + 1, device=self.device)])
        elif ncomp > K:
            qi = self.rope_index(F.linear(qa, W["ix_wq_b"]).view(d.index_n_heads, d.index_head_dim), pos)
            wh = _up(F.linear(y, W["ix_weights"])) / math.sqrt(d.index_n_heads)
            sc = torch.relu(_up(qi @ self.pool_keys[:ncomp].T))  # [ih, P]
            scores = (wh @ sc) / math.sqrt(d.index_head_dim)
            top = torch.sort(scores, descending=True, stable=True).indices[:K]  # ties: lower pool
            rows = (top[:, None] * kp + torch.arange(kp, device=self.device)).reshape(-1)
            if ncomp * kp <= n:
                rows = torch.cat([rows, torch.arange(ncomp * kp, n + 1, device=self.device)])
            self._first_rows = rows
        else:
            self._first_rows = torch.arange(n + 1, device=self.device)
        c = self.latents[: n + 1] if rows is None else self.latents.index_select(0, rows)
        # Absorbed MLA: the nope part through kv_b's key half against the latents, the rope part
        # against the rows' rope keys.
        q_lat = torch.bmm(q[:, None, :nope], self.w_uk)[:, 0]  # [nh, kl]
        s = _up(q_lat @ c.T)
        if self.rope_keys is not None:
            kr = self.rope_keys[: n + 1] if rows is None else self.rope_keys.index_select(0, rows)
            s = s + _up(self.rope_mla(q[:, nope:], pos) @ kr.T)
        p = torch.softmax(s * a.softmax_scale, dim=-1).to(self.dtype)
        o_lat = p @ c  # [nh, kl]
        o = torch.bmm(o_lat[:, None], self.w_uv_t)[:, 0]  # [nh, v]
        x = x + F.linear(o.reshape(-1), W["o_proj"])
        # MoE.
        y2 = _rms(x, W["post_norm"], eps)
        sc = torch.sigmoid(F.linear(_up(y2), _up(W["router"])))
        idx = route(sc, W["router_bias"], m)
        w = sc[idx]
        if m.norm_topk_prob:
            w = w / w.sum()
        w = w * m.routed_scaling_factor
        x = x + self.moe(y2, idx, w).to(self.dtype)
        out = _rms(x, W["head_norm"], eps)
        logits = F.linear(out, W["head"])
        return torch.argmax(logits).reshape(1), out, logits

    def propose(self, context: int, k: int) -> torch.Tensor:
        """k drafts from (tok_in, hid_in), rows context .. context+k-1; drafts land in self.drafts."""
        tok, h = self.tok_in, self.hid_in
        self._first_row = context
        for i in range(k):
            tok, h, _ = self._draft(tok, h, context + i)
            self.drafts[i : i + 1].copy_(tok)
        self.last_hidden.copy_(h)
        return self.drafts[:k]


def weights_from_state_dict(cfg, sd: dict, device="cpu", dtype=torch.float32) -> dict:
    """The step's weight dict from checkpoint names (``TorchModel.state_dict()`` or a checkpoint),
    for checking the step against the reference implementation."""
    P = f"model.layers.{cfg.num_hidden_layers}."
    A, X, M = P + "self_attn.", P + "self_attn.indexer.", P + "mlp."

    def t(name):
        return sd[name].to(device=device, dtype=dtype)

    W = {
        "embed": t("model.embed_tokens.weight"),
        "head": t("lm_head.weight"),
        "enorm": t(P + "enorm.weight"),
        "hnorm": t(P + "hnorm.weight"),
        "in_norm": t(P + "input_layernorm.weight"),
        "post_norm": t(P + "post_attention_layernorm.weight"),
        "head_norm": t(P + "shared_head.norm.weight"),
        "eh_proj": t(P + "eh_proj.weight"),
        "q_a": t(A + "q_a_proj.weight"),
        "q_a_norm": t(A + "q_a_layernorm.weight"),
        "q_b": t(A + "q_b_proj.weight"),
        "kv_a": t(A + "kv_a_proj_with_mqa.weight"),  # [latent ; rope key] rows
        "kv_a_norm": t(A + "kv_a_layernorm.weight"),
        "kv_b": t(A + "kv_b_proj.weight"),
        "o_proj": t(A + "o_proj.weight"),
        "ix_wq_b": t(X + "wq_b.weight"),
        "ix_wk": t(X + "wk.weight"),
        "ix_ln_w": t(X + "k_norm.weight"),
        "ix_ln_b": t(X + "k_norm.bias"),
        "ix_weights": t(X + "weights_proj.weight"),
        "router": t(M + "gate.weight"),
        "router_bias": sd[M + "gate.e_score_correction_bias"].to(device=device, dtype=torch.float32),
        "shared_gate_proj": t(M + "shared_experts.gate_proj.weight"),
        "shared_up_proj": t(M + "shared_experts.up_proj.weight"),
        "shared_down_proj": t(M + "shared_experts.down_proj.weight"),
    }
    if not cfg.dsa.per_token:  # the KPool indexer's compression
        W["ix_gate"] = t(X + "index_kpool_compress_gate")
        W["ix_ape"] = t(X + "index_kpool_compress_ape")
    for name in ("gate_proj", "up_proj", "down_proj"):
        W["experts_" + name] = torch.stack(
            [t(M + f"experts.{e}.{name}.weight") for e in range(cfg.moe.n_routed_experts)]
        )
    return W


# ---- FP8 experts (torch._scaled_grouped_mm) -----------------------------------------------------

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# Row alignment of each expert's segment in the grouped operands. The 2d x 3d rowwise path only
# asserts segments of >= 0 rows, but PyTorch's own tests of it use segments of multiples of 16 and its
# epilogue reads each segment's activation scales from ``scale_a + offs[g - 1]`` (unaligned otherwise);
# padding costs no weight bytes (a segment of up to 64 rows is one M tile either way).
FP8_GROUP_ALIGN = 16
# An inference stack takes Hopper's fast FP8 accumulation; the comparison is of speed.
FP8_FAST_ACCUM = True


# What the FP8-experts step runs, for the benchmark's record.
EXPERTS_FP8 = (
    "fp8 e4m3 torch._scaled_grouped_mm (rowwise: activations per row, weights per output channel; "
    f"use_fast_accum={FP8_FAST_ACCUM}; gate and up one GEMM; the shared expert group E; "
    f"segments padded to {FP8_GROUP_ALIGN} rows)"
)


class Fp8GroupedMmUnavailable(RuntimeError):
    """torch._scaled_grouped_mm is missing here, or refuses this device or these operands."""


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax FP8 E4M3 of x [..., K]: (q [..., K] float8_e4m3fn, scale [...] f32) with
    ``x ~= q * scale[..., None]``, scale = max|row| / 448 (a zero row gets 1e-12 / 448 and zeros),
    q = x / scale saturated to +-448 and rounded to nearest even. The activations' quantiser (each
    call, per row, as an FP8 inference stack quantises on the fly) and the weights' (once, per output
    channel: a weight [N, K]'s rows are its output channels)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1)


@dataclass
class Fp8Experts:
    """The routed experts and the shared expert in FP8 E4M3, one stack per matrix, with one f32 scale
    per output channel (what the rowwise ``torch._scaled_grouped_mm`` takes); index E (the last) is
    the shared expert, so one grouped GEMM covers routed and shared pairs.

    ``gate_up`` [E + 1, 2I, H]: each expert's gate rows then its up rows (one GEMM for both);
    ``gate_up_scale`` [E + 1, 2I]; ``down`` [E + 1, H, I]; ``down_scale`` [E + 1, H]. All contiguous;
    ``gate_up_t`` / ``down_t`` are the [G, K, N] column-major views (stride 1 along K) the op takes."""

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor

    @property
    def gate_up_t(self) -> torch.Tensor:
        return self.gate_up.transpose(1, 2)  # [G, H, 2I]

    @property
    def down_t(self) -> torch.Tensor:
        return self.down.transpose(1, 2)  # [G, I, H]


def fp8_expert_weights(W: dict) -> Fp8Experts:
    """``Fp8Experts`` from the step's weight dict (``experts_*`` [E, I, H] / [E, H, I] and
    ``shared_*``), quantised expert by expert (no full-size f32 copy). Per-output-channel scales are
    not the checkpoint's 128x128 block scales (``_scaled_grouped_mm`` takes rowwise or MX scales, not
    those): the PyTorch FP8 step reads the same bytes of expert weights as a block-scaled kernel,
    plus 4 bytes per output channel, but does not compute the same numbers."""
    g, u, d = W["experts_gate_proj"], W["experts_up_proj"], W["experts_down_proj"]
    E, I, H = g.shape
    shared = (W["shared_gate_proj"], W["shared_up_proj"], W["shared_down_proj"])
    if (
        tuple(shared[0].shape) != (I, H)
        or tuple(shared[1].shape) != (I, H)
        or tuple(shared[2].shape) != (H, I)
    ):
        raise ValueError(
            f"the shared expert ({[tuple(t.shape) for t in shared]}) is not shaped as a routed one "
            f"([{I}, {H}], [{I}, {H}], [{H}, {I}]): it cannot join the routed experts' stack"
        )
    dev, f8 = g.device, torch.float8_e4m3fn
    ex = Fp8Experts(
        torch.empty(E + 1, 2 * I, H, dtype=f8, device=dev),
        torch.empty(E + 1, 2 * I, dtype=torch.float32, device=dev),
        torch.empty(E + 1, H, I, dtype=f8, device=dev),
        torch.empty(E + 1, H, dtype=torch.float32, device=dev),
    )
    for e in range(E + 1):
        ge, ue, de = (g[e], u[e], d[e]) if e < E else shared
        ex.gate_up[e], ex.gate_up_scale[e] = quantize_rows_fp8(torch.cat([ge, ue]))
        ex.down[e], ex.down_scale[e] = quantize_rows_fp8(de)
    return ex


def check_fp8_grouped_shapes(hidden: int, inter: int, n_routed: int) -> None:
    """Raise ``Fp8GroupedMmUnavailable`` unless ``torch._scaled_grouped_mm`` takes the MoE's GEMMs:
    [rows, H] x [G, H, 2I] and [rows, I] x [G, I, H] need K and N multiples of 16 (its TMA rows are
    16-byte aligned), and its CUTLASS path takes fewer than 1024 groups (E routed + 1 shared)."""
    for what, k, n in (("gate/up", hidden, 2 * inter), ("down", inter, hidden)):
        if k % 16 or n % 16:
            raise Fp8GroupedMmUnavailable(
                f"torch._scaled_grouped_mm needs K and N multiples of 16; the experts' {what} GEMM has "
                f"K = {k}, N = {n}"
            )
    if n_routed + 1 >= 1024:
        raise Fp8GroupedMmUnavailable(
            f"torch._scaled_grouped_mm takes fewer than 1024 groups; {n_routed} routed experts + 1 shared"
        )


def check_fp8_grouped_device(device) -> None:
    """Raise ``Fp8GroupedMmUnavailable`` unless this PyTorch has ``_scaled_grouped_mm`` and ``device``
    is a CUDA GPU it runs on (compute capability 9.0 or 10.0, as its own gate says; E4M3FN operands,
    so not ROCm's FNUZ)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise Fp8GroupedMmUnavailable(f"PyTorch {torch.__version__} has no torch._scaled_grouped_mm")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise Fp8GroupedMmUnavailable(
            f"torch._scaled_grouped_mm runs on CUDA GPUs only; the step is on {dev}"
        )
    if torch.version.hip:
        raise Fp8GroupedMmUnavailable(
            "on ROCm torch._scaled_grouped_mm takes float8_e4m3fnuz; this step builds e4m3fn"
        )
    cap = torch.cuda.get_device_capability(dev)
    if cap not in ((9, 0), (10, 0)):
        raise Fp8GroupedMmUnavailable(
            f"torch._scaled_grouped_mm runs on compute capability 9.0 or 10.0 only; "
            f"{torch.cuda.get_device_name(dev)} is {cap[0]}.{cap[1]}"
        )


@dataclass
class Fp8GroupLayout:
    """Where each (row, slot) pair of a batch sits in the grouped operands: ``pos`` [B, top_k + 1]
    (long) its operand row, slot top_k the shared expert (group E); ``offs`` [E + 1] int32 the group
    ends (cumulative, each group's segment padded to ``align`` rows, empty groups empty); ``rows``
    the operands' static row count (>= offs[-1], a bound fixed by B, so the step stays capturable)."""

    pos: torch.Tensor
    offs: torch.Tensor
    rows: int


def fp8_group_rows(batch: int, top_k: int, n_routed: int, align: int = FP8_GROUP_ALIGN) -> int:
    """The operands' row count for a batch: every pair, plus at most align - 1 padding rows for each
    group that can be non-empty (min(E, B x top_k) routed ones and the shared one)."""
    return batch * (top_k + 1) + (align - 1) * (min(n_routed, batch * top_k) + 1)


def fp8_group_layout(idx: torch.Tensor, n_routed: int, align: int = FP8_GROUP_ALIGN) -> Fp8GroupLayout:
    """The grouped layout of a batch's chosen experts ``idx`` [B, top_k] plus the shared expert
    (group ``n_routed``) for every row: groups in expert order, each group's pairs in row order, each
    group padded to a multiple of ``align`` rows. Computed on the device (no host sync)."""
    B, tk = idx.shape
    dev = idx.device
    pairs = torch.cat([idx, idx.new_full((B, 1), n_routed)], 1).reshape(-1)  # (row, slot) order
    P = pairs.numel()
    order = torch.sort(pairs, stable=True).indices  # pairs by group, then by row
    grp = pairs[order]
    ends = torch.searchsorted(grp, torch.arange(n_routed + 1, device=dev), right=True)
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = (counts + align - 1) // align * align
    pends = torch.cumsum(padded, 0)
    dest = (pends - padded)[grp] + torch.arange(P, device=dev) - (ends - counts)[grp]
    pos = torch.empty_like(dest).index_copy_(0, order, dest)
    return Fp8GroupLayout(pos.view(B, tk + 1), pends.to(torch.int32), fp8_group_rows(B, tk, n_routed, align))


def scatter_rows_fp8(
    q: torch.Tensor, scale: torch.Tensor, dest: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows q [n, K] and their scales [n] placed at operand rows ``dest`` [n] (distinct) of a
    [rows, K] operand and its [rows] scales; the padding rows are zero with scale 0 (their outputs
    are never read). The bytes move as uint8 (indexing kernels need not know FP8)."""
    a = torch.zeros(rows, q.shape[1], dtype=torch.uint8, device=q.device)
    a.index_copy_(0, dest, q.view(torch.uint8))
    s = torch.zeros(rows, dtype=torch.float32, device=q.device).index_copy_(0, dest, scale)
    return a.view(torch.float8_e4m3fn), s


def scaled_grouped_mm_fp8(
    a: torch.Tensor, scale_a: torch.Tensor, w_t: torch.Tensor, scale_w: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` (rowwise, 2d x 3d): a [M, K] FP8 row-major, w_t [G, K, N] FP8
    column-major, scale_a [M] f32, scale_w [G, N] f32, offs [G] int32 group ends -> [M, N] BF16,
    rows past offs[-1] unwritten. Its refusal comes back as ``Fp8GroupedMmUnavailable``."""
    try:
        return torch._scaled_grouped_mm(
            a, w_t, scale_a, scale_w, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=FP8_FAST_ACCUM
        )
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
        raise Fp8GroupedMmUnavailable(
            f"torch._scaled_grouped_mm refused a {a.dtype} {tuple(a.shape)} x {w_t.dtype} {tuple(w_t.shape)} "
            f"(strides {tuple(w_t.stride())}) on {a.device}: {exc}"
        ) from exc


# ---- the whole batch -----------------------------------------------------------------------------


class _DraftPlan:
    """One draft's per-sequence indices, built on the host before the step runs (and before a
    capture: a graph bakes them, so there is one graph per (B, k, contexts))."""

    def __init__(self, cfg, contexts: list[int], i: int, device: torch.device) -> None:
        d = cfg.dsa
        kp, K = d.index_kpool, d.index_topk // d.index_kpool
        n = [c + i for c in contexts]
        ncomp = [(r + 1) // kp for r in n]

        def dev(x, dtype=torch.long):
            return torch.as_tensor(x, dtype=dtype, device=device)

        self.i = i
        self.rows = dev(n)  # the row each sequence writes
        comp = [b for b, r in enumerate(n) if (r + 1) % kp == 0]  # sequences whose row completes a pool
        self.comp_seq = dev(comp) if comp else None
        self.comp_rows = dev([[n[b] + 1 - kp + j for j in range(kp)] for b in comp]) if comp else None
        self.comp_pool = dev([ncomp[b] - 1 for b in comp]) if comp else None
        self.pmax = max(ncomp)
        self.dense = dev([c <= K for c in ncomp], torch.bool)  # attends every row, as batch 1 does
        # Made on the device: a per-token indexer's pools are up to 202,752 a sequence.
        nc = dev(ncomp)[:, None]
        self.pool_valid = torch.arange(self.pmax, device=device)[None, :] < nc
        self.k_valid = torch.arange(K, device=device)[None, :] < nc.clamp(max=K)
        # The tail: rows after the last complete pool (at most kp - 1 of them).
        self.tail_rows = dev([[c * kp + j for j in range(kp - 1)] for c in ncomp])
        self.tail_valid = dev(
            [[c * kp + j <= r for j in range(kp - 1)] for c, r in zip(ncomp, n)], torch.bool
        )
        # Rows drafted since draft 1 (a shared selection attends them besides draft 1's).
        self.extra_rows = dev([[c + j for j in range(1, i + 1)] for c in contexts])


class BatchDraftStep:
    """B sequences' DSA caches over one DraftStep's weights, and the k-draft propose for all of
    them at once (the batched form of ``DraftStep.propose``, same arithmetic per row).

    Per draft: every projection is one [B, ·] GEMM; the indexer scores each sequence's own pools,
    padded to the batch's largest pool count and masked; each sequence's selection (top-k pools
    expanded to rows, plus its tail; every row while it has at most top-k pools) is padded to one
    width and masked in the attention's softmax; the MoE runs ``torch._grouped_mm`` over the
    batch's B x top_k (row, expert) pairs sorted by expert, with group offsets computed on the
    device (no host sync, so the step is capturable); the shared expert is a plain GEMM; the head
    one [B, H] x [H, V] GEMM (BF16, or FP8 by ``torch._scaled_mm``), argmax per row feeding the
    next draft on the device."""

    def __init__(self, base: DraftStep, batch: int, rows: int, seed: int = 1) -> None:
        self.base, self.cfg, self.W = base, base.cfg, base.W
        self.dtype, self.device = base.dtype, base.device
        cfg, dev, dt = base.cfg, base.device, base.dtype
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        H = cfg.hidden_size
        self.B, self.rows = batch, rows
        g = torch.Generator(device=dev).manual_seed(seed)

        def rnd(*shape):
            return torch.randn(*shape, device=dev, dtype=dt, generator=g)

        # The caches of DraftStep, one per sequence (its keys and gates with the KPool indexer only,
        # its rope keys with RoPE only).
        self.latents = rnd(batch, rows, a.kv_lora_rank)
        self.keys = None if d.per_token else rnd(batch, rows, d.index_head_dim)
        self.gates = None if d.per_token else rnd(batch, rows, d.index_head_dim)
        self.pool_keys = rnd(batch, rows // d.index_kpool, d.index_head_dim)
        self.rope_keys = rnd(batch, rows, a.qk_rope_head_dim) if a.rope is not None else None
        # Each sequence's own token: with one token for all, draft 1's rows route alike and the
        # batch chooses far fewer distinct experts than a real batch (59 of 288 at B = 16, not 104).
        self.tok_in = torch.randint(0, cfg.vocab_size, (batch,), device=dev, generator=g)
        self.hid_in = rnd(batch, H)
        self.drafts = torch.zeros(batch, 8, dtype=torch.long, device=dev)
        self.last_hidden = torch.zeros(batch, H, device=dev, dtype=dt)
        self.expert_ids = torch.zeros(8, batch, m.num_experts_per_tok, dtype=torch.long, device=dev)
        # The stacked experts as _grouped_mm's [E, K, N] operands: transposed views, no copy.
        self.wg_t = self.W["experts_gate_proj"].transpose(1, 2)  # [E, H, I]
        self.wu_t = self.W["experts_up_proj"].transpose(1, 2)
        self.wd_t = self.W["experts_down_proj"].transpose(1, 2)  # [E, I, H]
        self.head_fp8: torch.Tensor | None = None
        self.head_scale: torch.Tensor | None = None
        self.experts_fp8: Fp8Experts | None = None
        self._fp8_grouped_mm: Callable[..., torch.Tensor] = scaled_grouped_mm_fp8
        self._plans: dict[tuple[tuple[int, ...], int], list[_DraftPlan]] = {}
        self._bidx = torch.arange(batch, device=dev)
        self._sel0: torch.Tensor | None = None
        self._mask0: torch.Tensor | None = None

    def load_sequence(self, b: int, step: DraftStep) -> None:
        """Sequence b's caches and inputs from a batch-1 step's (for comparing the two)."""
        n = min(self.rows, step.rows)
        for name in ("latents", "keys", "gates", "rope_keys"):
            mine = getattr(self, name)
            if mine is not None:
                mine[b, :n] = getattr(step, name)[:n]
        p = min(self.pool_keys.shape[1], step.pool_keys.shape[0])
        self.pool_keys[b, :p] = step.pool_keys[:p]
        self.tok_in[b] = step.tok_in[0]
        self.hid_in[b] = step.hid_in

    def enable_fp8_head(self) -> None:
        """An FP8 E4M3 copy of the head with one f32 scale per vocabulary row (what the runtime's
        FP8 head reads). ``torch._scaled_mm`` needs both operands in FP8, so the activations are
        quantized per row too (the runtime keeps them BF16): same bytes, not the same numbers."""
        self.head_fp8, scale = quantize_rows_fp8(self.W["head"])
        self.head_scale = scale.reshape(1, -1).contiguous()

    def enable_fp8_experts(self, grouped_mm: Callable[..., torch.Tensor] | None = None) -> None:
        """FP8 copies of the routed and shared experts (``fp8_expert_weights``) for the MoE by
        ``torch._scaled_grouped_mm``. Raises ``Fp8GroupedMmUnavailable`` (before any copy is made)
        where the op is missing, the device is not one it runs on, or the shapes are not ones it
        takes. ``grouped_mm`` replaces the op (same arguments as ``scaled_grouped_mm_fp8``): a CPU
        test's emulation of it; the shapes are checked either way."""
        m = self.cfg.moe
        check_fp8_grouped_shapes(self.cfg.hidden_size, m.moe_intermediate_size, m.n_routed_experts)
        if grouped_mm is None:
            check_fp8_grouped_device(self.device)
            grouped_mm = scaled_grouped_mm_fp8
        self.experts_fp8 = fp8_expert_weights(self.W)
        self._fp8_grouped_mm = grouped_mm

    def plan(self, contexts, k: int) -> list[_DraftPlan]:
        key = (tuple(int(c) for c in contexts), k)
        if len(key[0]) != self.B:
            raise ValueError(f"{len(key[0])} contexts for a batch of {self.B}")
        if max(key[0]) + k + self.cfg.dsa.index_kpool > self.rows:
            raise ValueError(f"contexts up to {max(key[0])} with k={k} outrun the {self.rows} cache rows")
        if key not in self._plans:
            self._plans[key] = [_DraftPlan(self.cfg, list(key[0]), i, self.device) for i in range(k)]
        return self._plans[key]

    def _moe_bf16(self, y2: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Routed (``torch._grouped_mm`` over the pairs sorted by expert) plus shared expert, f32 [B, H]."""
        m, W, B = self.cfg.moe, self.W, self.B
        tk = m.num_experts_per_tok
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # pairs by expert, then by row
        experts = torch.arange(m.n_routed_experts, device=self.device)
        offs = torch.searchsorted(flat[order], experts, right=True, out_int32=True)  # group ends
        ya = y2.index_select(0, order // tk)
        L = m.swiglu_limit
        act = F.silu(torch._grouped_mm(ya, self.wg_t, offs=offs).clamp(max=L)) * torch._grouped_mm(
            ya, self.wu_t, offs=offs
        ).clamp(-L, L)
        dn = _up(torch._grouped_mm(act, self.wd_t, offs=offs)) * w.reshape(-1)[order][:, None].to(
            _up(act).dtype
        )
        # Back to (row, slot) order, then the per-row sum in the batch-1 step's order.
        routed = torch.empty_like(dn).index_copy_(0, order, dn).view(B, tk, -1).sum(1)
        sh = F.linear(
            F.silu(F.linear(y2, W["shared_gate_proj"]).clamp(max=L))
            * F.linear(y2, W["shared_up_proj"]).clamp(-L, L),
            W["shared_down_proj"],
        )
        return routed + _up(sh)

    def _moe_fp8(self, y2: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The MoE on ``experts_fp8``: routed and shared pairs in one rowwise FP8 grouped GEMM per
        matrix (gate and up together), activations quantised per row on the fly; f32 [B, H]."""
        m, ex, B = self.cfg.moe, self.experts_fp8, self.B
        tk, I, L = m.num_experts_per_tok, m.moe_intermediate_size, m.swiglu_limit
        lay = fp8_group_layout(idx, m.n_routed_experts)
        dest = lay.pos.reshape(-1)  # (row, slot) order
        q, s = quantize_rows_fp8(y2)  # once per row: every pair of the row reads the same bytes
        src = torch.arange(B * (tk + 1), device=self.device) // (tk + 1)  # each pair's row
        a8, sa = scatter_rows_fp8(q.view(torch.uint8).index_select(0, src), s[src], dest, lay.rows)
        gu = self._fp8_grouped_mm(a8, sa, ex.gate_up_t, ex.gate_up_scale, lay.offs).index_select(0, dest)
        act = F.silu(gu[:, :I].clamp(max=L)) * gu[:, I:].clamp(-L, L)  # [B (tk + 1), I] BF16
        d8, sd = scatter_rows_fp8(*quantize_rows_fp8(act), dest, lay.rows)
        dn = _up(self._fp8_grouped_mm(d8, sd, ex.down_t, ex.down_scale, lay.offs).index_select(0, dest))
        dn = dn.view(B, tk + 1, -1)
        routed = (dn[:, :tk] * w[:, :, None].to(dn.dtype)).sum(1)
        return routed + dn[:, tk]

    def _draft(self, tok: torch.Tensor, h: torch.Tensor, p: _DraftPlan, fp8: bool, fp8_experts: bool = False):
        """One draft for the batch: tokens [B], hiddens [B, H] -> (next tokens [B], normalised x)."""
        cfg, W = self.cfg, self.W
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        eps, B = cfg.rms_norm_eps, self.B
        nh, kp, K = a.num_attention_heads, d.index_kpool, d.index_topk // d.index_kpool
        C, nope, base = a.kv_lora_rank, a.qk_nope_head_dim, self.base
        bidx = self._bidx
        e = _rms(F.embedding(tok, W["embed"]), W["enorm"], eps)
        x = F.linear(torch.cat([e, _rms(h, W["hnorm"], eps)], -1), W["eh_proj"])
        y = _rms(x, W["in_norm"], eps)
        qa = _rms(F.linear(y, W["q_a"]), W["q_a_norm"], eps)
        q = F.linear(qa, W["q_b"]).view(B, nh, a.qk_head_dim)
        kv = F.linear(y, W["kv_a"])  # [B, latent (C) ; rope key]
        self.latents[bidx, p.rows] = _rms(kv[:, :C], W["kv_a_norm"], eps)
        if self.rope_keys is not None:
            self.rope_keys[bidx, p.rows] = base.rope_mla(kv[:, C:], p.rows)
        if d.per_token:  # each row's key is its own pool's
            self.pool_keys[bidx, p.rows] = base.index_key(y, p.rows)
        else:
            self.keys[bidx, p.rows] = base.index_key(y, p.rows)
            self.gates[bidx, p.rows] = F.linear(y, W["ix_gate"])
            if p.comp_seq is not None:
                cs = p.comp_seq[:, None]
                wts = torch.softmax(_up(self.gates[cs, p.comp_rows]) + _up(W["ix_ape"]), dim=1)
                pooled = (wts * _up(self.keys[cs, p.comp_rows])).sum(1).to(self.dtype)
                self.pool_keys[p.comp_seq, p.comp_pool] = pooled
        if d.share_for_mtp_iteration and p.i > 0:
            # Drafts 2..k attend draft 1's selection plus the rows drafted since (model/dsa.py).
            sel = torch.cat([self._sel0, p.extra_rows], 1)
            mask = torch.cat([self._mask0, torch.ones_like(p.extra_rows, dtype=torch.bool)], 1)
        else:
            ar = torch.arange(K, device=self.device).expand(B, K)
            if p.pmax > K:
                qi = F.linear(qa, W["ix_wq_b"]).view(B, d.index_n_heads, d.index_head_dim)
                qi = base.rope_index(qi, p.rows[:, None])
                wh = _up(F.linear(y, W["ix_weights"])) / math.sqrt(d.index_n_heads)
                pk = self.pool_keys[:, : p.pmax]  # padded to the batch's largest pool count
                sc = torch.relu(_up(torch.matmul(qi, pk.transpose(1, 2))))  # [B, ih, P]
                scores = (wh[:, None, :] @ sc)[:, 0] / math.sqrt(d.index_head_dim)
                scores = scores.masked_fill(~p.pool_valid, float("-inf"))
                top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
                top = torch.where(p.dense[:, None], ar, top)  # few pools: every row, in order
            else:
                top = ar
            pool_rows = (top[:, :, None] * kp + torch.arange(kp, device=self.device)).reshape(B, K * kp)
            sel = torch.cat([pool_rows, p.tail_rows], 1)
            mask = torch.cat([p.k_valid.repeat_interleave(kp, 1), p.tail_valid], 1)
            sel = torch.where(mask, sel, 0)
            self._sel0, self._mask0 = sel, mask
        c = self.latents[bidx[:, None], sel]  # [B, S, kl], padded entries masked below
        # Absorbed MLA (and the rope part against the selected rows' rope keys).
        q_lat = torch.bmm(q[:, :, :nope].transpose(0, 1), base.w_uk).transpose(0, 1)
        s = _up(torch.matmul(q_lat, c.transpose(1, 2)))  # [B, nh, S]
        if self.rope_keys is not None:
            kr = self.rope_keys[bidx[:, None], sel]  # [B, S, rope]
            s = s + _up(torch.matmul(base.rope_mla(q[:, :, nope:], p.rows[:, None]), kr.transpose(1, 2)))
        s = (s * a.softmax_scale).masked_fill(~mask[:, None, :], float("-inf"))
        pr = torch.softmax(s, dim=-1).to(self.dtype)
        o_lat = torch.matmul(pr, c)  # [B, nh, kl]
        o = torch.bmm(o_lat.transpose(0, 1), self.base.w_uv_t).transpose(0, 1)  # [B, nh, v]
        x = x + F.linear(o.reshape(B, -1), W["o_proj"])
        # MoE: the batch's (row, expert) pairs sorted by expert, one grouped GEMM per matrix.
        y2 = _rms(x, W["post_norm"], eps)
        scr = torch.sigmoid(F.linear(_up(y2), _up(W["router"])))
        idx = route(scr, W["router_bias"], m)  # [B, tk]
        self.expert_ids[p.i].copy_(idx)
        w = torch.gather(scr, 1, idx)
        if m.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = w * m.routed_scaling_factor
        moe = self._moe_fp8(y2, idx, w) if fp8_experts else self._moe_bf16(y2, idx, w)
        x = x + moe.to(self.dtype)
        out = _rms(x, W["head_norm"], eps)
        if fp8:
            a8, a_scale = quantize_rows_fp8(out)
            logits = torch._scaled_mm(
                a8,
                self.head_fp8.t(),
                scale_a=a_scale[:, None],
                scale_b=self.head_scale,
                out_dtype=torch.bfloat16,
            )
        else:
            logits = F.linear(out, W["head"])
        return torch.argmax(logits, dim=-1), out, logits

    def propose(self, contexts, k: int, fp8: bool = False, fp8_experts: bool = False) -> torch.Tensor:
        """k drafts for every sequence b from (tok_in[b], hid_in[b]) at rows contexts[b] ..
        contexts[b]+k-1; the drafts land in self.drafts[:, :k]. ``fp8``: the head by
        ``torch._scaled_mm``; ``fp8_experts``: the MoE by ``torch._scaled_grouped_mm``."""
        if fp8 and self.head_fp8 is None:
            self.enable_fp8_head()
        if fp8_experts and self.experts_fp8 is None:
            self.enable_fp8_experts()
        plans = self.plan(contexts, k)
        tok, h = self.tok_in, self.hid_in
        for p in plans:
            tok, h, _ = self._draft(tok, h, p, fp8, fp8_experts)
            self.drafts[:, p.i].copy_(tok)
        self.last_hidden.copy_(h)
        return self.drafts[:, :k]

    def distinct_experts(self, k: int) -> list[int]:
        """Distinct routed experts the batch chose in each of the last propose's k drafts."""
        return [int(torch.unique(self.expert_ids[i]).numel()) for i in range(k)]


# ---- timing --------------------------------------------------------------------------------------

_STEP: DraftStep | None = None


def _same_model(a, b) -> bool:
    """The same shapes and variant: the indexer reservation (max_context) sizes nothing here."""
    return dataclasses.replace(a, dsa=dataclasses.replace(a.dsa, max_context=b.dsa.max_context)) == b


def _step(rows_needed: int, cfg=None) -> DraftStep:
    """The batch-1 step (weights and caches) at ``cfg``'s shapes (GLM-5.3-Flash when None), kept
    between calls; rebuilt for another model or more rows."""
    global _STEP
    cfg = cfg or glm5_flash()
    if _STEP is None or _STEP.rows < rows_needed or not _same_model(_STEP.cfg, cfg):
        _STEP = None
        _drop_batch_step()
        torch.cuda.empty_cache()
        _STEP = DraftStep(cfg, rows=max(rows_needed, 16384 + 16), device="cuda")
    return _STEP


@torch.inference_mode()
def run(context: int, k: int, graph: bool, iters: int = 200, warmup: int = 10, cfg=None) -> float:
    """Median milliseconds of one k-draft propose at ``context`` cached rows (``cfg``'s shapes:
    GLM-5.3-Flash when None; BF16, random weights), eager (``graph=False``) or replayed as a torch
    CUDA graph."""
    st = _step(context + k + 1, cfg)
    if not graph:
        for _ in range(warmup):
            st.propose(context, k)
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            st.propose(context, k)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            st.propose(context, k)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        st.propose(context, k)
    for _ in range(warmup):
        gr.replay()
    torch.cuda.synchronize()
    times = []
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        gr.replay()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in ev]
    # The graph must give the eager drafts.
    g_drafts = st.drafts[:k].clone()
    st.propose(context, k)
    if not torch.equal(g_drafts, st.drafts[:k]):
        print(f"warning: graph drafts {g_drafts.tolist()} != eager {st.drafts[:k].tolist()}", file=sys.stderr)
    del gr
    return statistics.median(times)


_BSTEP: BatchDraftStep | None = None


def _drop_batch_step() -> None:
    global _BSTEP
    _BSTEP = None


def _batch_step(batch: int, max_context: int, k: int, cfg=None) -> BatchDraftStep:
    """The batch's caches over the batch-1 step's weights (built once, shared)."""
    global _BSTEP
    base = _step(16384 + 16, cfg)
    rows = max_context + k + base.cfg.dsa.index_kpool
    if _BSTEP is None or _BSTEP.B != batch or _BSTEP.rows < rows or _BSTEP.base is not base:
        _BSTEP = None
        torch.cuda.empty_cache()
        _BSTEP = BatchDraftStep(base, batch, rows)
    return _BSTEP


@torch.inference_mode()
def run_batch(
    contexts,
    k: int,
    graph: bool,
    iters: int = 100,
    warmup: int = 5,
    fp8_head: bool = False,
    info: dict | None = None,
    fp8_experts: bool = False,
    cfg=None,
) -> float:
    """Median milliseconds of one k-draft propose for a batch of ``len(contexts)`` sequences, the
    sequence b at ``contexts[b]`` cached rows (``cfg``'s shapes, GLM-5.3-Flash when None; BF16 weights, the head BF16 or
    FP8, the experts BF16 or, ``fp8_experts``, FP8 E4M3 through ``torch._scaled_grouped_mm``), eager
    (a synchronize around each propose) or as one CUDA graph per (B, k, contexts) replayed back to
    back between CUDA events. ``info`` (a dict) receives the drafts and the distinct experts the
    batch chose per draft (for its byte floor). Raises ``Fp8GroupedMmUnavailable`` where
    ``fp8_experts`` cannot run here, saying why."""
    contexts = [int(c) for c in contexts]
    st = _batch_step(len(contexts), max(contexts), k, cfg)
    fp8 = dict(fp8=fp8_head, fp8_experts=fp8_experts)
    if not graph:
        for _ in range(warmup):
            st.propose(contexts, k, **fp8)
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            st.propose(contexts, k, **fp8)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
    else:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                st.propose(contexts, k, **fp8)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            st.propose(contexts, k, **fp8)
        for _ in range(warmup):
            gr.replay()
        torch.cuda.synchronize()
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        for a, b in ev:
            a.record()
            gr.replay()
            b.record()
        torch.cuda.synchronize()
        ms = statistics.median(a.elapsed_time(b) for a, b in ev)
        g_drafts = st.drafts[:, :k].clone()
        st.propose(contexts, k, **fp8)
        if not torch.equal(g_drafts, st.drafts[:, :k]):
            print("warning: batched graph drafts differ from eager", file=sys.stderr)
        del gr
    if info is not None:
        info["drafts"] = st.drafts[:, :k].tolist()
        info["distinct_experts"] = st.distinct_experts(k)
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16000])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument(
        "--batches",
        type=lambda s: tuple(int(c) for c in s.split(",")),
        help="comma-separated batch sizes: time the batched step (BatchDraftStep) instead, at the "
        "contexts of bench/bench_batch.py contexts_for (uniform 4096 and ragged 128..16000)",
    )
    ap.add_argument(
        "--kinds", default="uniform,ragged", help="with --batches: context kinds (bench_batch's, longest too)"
    )
    ap.add_argument(
        "--model",
        default="glm5_next",
        choices=("glm5_next", "glm5", "deepseek_v32"),
        help="the shapes: glm5_next (GLM-5.3-Flash), glm5 (GLM-5.2), deepseek_v32 (DeepSeek-V3.2)",
    )
    ap.add_argument("--fp8-head", action="store_true", help="with --batches: the head by torch._scaled_mm")
    ap.add_argument(
        "--fp8-experts",
        action="store_true",
        help="with --batches: the routed and shared experts FP8 E4M3 (per-channel scales), the MoE by "
        "torch._scaled_grouped_mm (rowwise) with activations quantised per row",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: bench/torch_step.py times a GPU", file=sys.stderr)
        return 2
    from bench.bench_propose import model_config

    args.cfg = model_config(args.model)
    if args.batches:
        return batch_main(args)
    t0 = time.time()
    _step(max(args.contexts) + max(args.ks) + 1, args.cfg)
    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__}:"
        f" weights and caches built in {time.time() - t0:.1f} s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated",
        flush=True,
    )
    rows = []
    print(f"{'context':>8} {'k':>3} {'eager ms':>9} {'graph ms':>9} {'graph ms/draft':>15}")
    for c in args.contexts:
        for k in args.ks:
            e = run(c, k, graph=False, iters=max(args.iters // 4, 20), cfg=args.cfg)
            try:
                g = run(c, k, graph=True, iters=args.iters, cfg=args.cfg)
            except Exception as exc:  # keep the eager numbers if capture fails
                print(f"graph capture failed at context {c}, k {k}: {exc!r}", file=sys.stderr)
                g = float("nan")
            rows.append({"context": c, "k": k, "eager_ms": round(e, 4), "graph_ms": round(g, 4)})
            print(f"{c:>8} {k:>3} {e:>9.3f} {g:>9.3f} {g / k:>15.3f}", flush=True)
    print(
        "TORCH_STEP_JSON "
        + json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})
    )
    return 0


def batch_main(args) -> int:
    from bench.bench_batch import contexts_for, resolve_kind

    t0 = time.time()
    _step(16384 + 16, args.cfg)
    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__}: weights built in {time.time() - t0:.1f} s",
        flush=True,
    )
    rows = []
    experts = EXPERTS_FP8 if args.fp8_experts else "bf16 torch._grouped_mm"
    print(f"experts: {experts}", flush=True)
    print(
        f"{'kind':>8} {'B':>4} {'k':>3} {'eager ms':>9} {'graph ms':>9} {'ms/seq-draft':>13}  distinct experts"
    )
    opts = dict(fp8_head=args.fp8_head, fp8_experts=args.fp8_experts, cfg=args.cfg)
    refused = None
    for kind, B, k in ((kd, b, kk) for kd in args.kinds.split(",") for b in args.batches for kk in args.ks):
        ctx = contexts_for(resolve_kind(kind, args.cfg, k), B)
        info: dict = {}
        try:
            e = run_batch(ctx, k, graph=False, iters=max(args.iters // 4, 10), **opts)
        except Fp8GroupedMmUnavailable as exc:  # the same for every row: report it once and stop
            refused = str(exc)
            print(f"FP8 experts unavailable: {refused}", file=sys.stderr, flush=True)
            break
        try:
            g = run_batch(ctx, k, graph=True, iters=args.iters, info=info, **opts)
        except Exception as exc:  # keep the eager numbers if capture fails
            print(f"graph capture failed at {kind} B {B}, k {k}: {exc!r}", file=sys.stderr)
            g = float("nan")
        rows.append(
            {
                "kind": kind,
                "B": B,
                "k": k,
                "head": "fp8" if args.fp8_head else "bf16",
                "experts": "fp8" if args.fp8_experts else "bf16",
                "eager_ms": round(e, 4),
                "graph_ms": round(g, 4),
                "distinct_experts": info.get("distinct_experts"),
            }
        )
        print(
            f"{kind:>8} {B:>4} {k:>3} {e:>9.3f} {g:>9.3f} {g / (B * k):>13.4f}  "
            f"{info.get('distinct_experts')}",
            flush=True,
        )
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "experts": experts,
        "rows": rows,
    }
    if refused is not None:
        out["fp8_experts_refused"] = refused
    print("TORCH_STEP_BATCH_JSON " + json.dumps(out))
    return 3 if refused is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
