"""Plain PyTorch implementation of the whole model family (training and evaluation only).

The runtime never imports this module. It exists to train the small shipped checkpoint, to measure
MTP acceptance with an independent implementation, and as a readable statement of the math:

* target: ``model.embed_tokens`` -> ``num_hidden_layers`` decoder layers -> ``model.norm`` ->
  ``lm_head``. Layer i: ``x = x + attn(input_layernorm(x)); x = x + mlp(post_attention_layernorm(x))``;
  the MLP is a dense clamped SwiGLU for i < ``first_k_dense_replace``, else the MoE of the block.
* every attention is DSA: NoPE MLA (computed here in the non-absorbed form, which is equal to the
  runtime's absorbed form) over the rows the layer's own KPool lightning indexer selects.
* the MTP block is ``model.layers.{num_hidden_layers}``: ``x = eh_proj([rmsnorm(embed[t]) * enorm ;
  rmsnorm(h) * hnorm])``, the same decoder layer (always MoE), then ``rmsnorm(x) * shared_head.norm``
  -> ``lm_head``. ``h`` is the target's post-final-norm hidden (the output of ``model.norm``).
  Drafter row r is ``(embed(tokens[r+1]), hidden[r])`` and predicts token r+2.

Exact semantics:

* RMSNorm eps is ``rms_norm_eps``; the indexer's ``k_norm`` is a LayerNorm with bias, eps 1e-6.
* row n writes its latent, indexer key and gate first, then attends; its complete pools are
  ``0 .. (n+1)//kpool - 1``; its tail is rows ``((n+1)//kpool)*kpool .. n`` (always attended). With
  more than ``index_topk // index_kpool`` complete pools, the top ones by score are kept (ties: lower
  pool index), otherwise attention is dense. Row n therefore attends to
  ``min(n+1, index_topk + (n+1) % index_kpool)`` rows.
* experts by higher ``sigmoid score + e_score_correction_bias``, ties to the lower index; weights are
  the unbiased scores of the chosen experts, normalised (``norm_topk_prob``) and multiplied by
  ``routed_scaling_factor``. Every SwiGLU (routed, shared, and the dense MLP of the first layers) is
  ``down(silu(min(gate.y, L)) * clamp(up.y, -L, L))`` with L = ``swiglu_limit``.
* ``fp8`` (per call) emulates the runtime's FP8 E4M3 storage of the latent rows and of the compressed
  pool keys: one scale per row, ``absmax / 448`` (1 for an all-zero row), ``x / scale`` saturated to
  +-448 and rounded to E4M3, read back as ``q * scale``. Per-token indexer keys and gates are kept
  unquantised (they only feed the compression). ``fp8_head`` does the same to the rows of
  ``lm_head`` for the drafter's head.

State for incremental decoding is a list (one per layer) of dicts ``{"c", "k", "g"}`` holding the
per-row latents (as stored), indexer keys and gates, ``[B, rows, *]``. Rows are independent of later
rows, so a rewind is a slice (:func:`slice_state`), and pool keys are recomputed from ``k``/``g``.

Parameter names are exactly the Hugging Face names of the block's tensor table (docs/checkpoint.md) (``state_dict()`` keys), with
``mlp.gate.e_score_correction_bias`` a float32 buffer (updated aux-loss-free during training, not by
gradient).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

FP8_MAX = 448.0
INDEXER_LN_EPS = 1e-6

State = list  # list[dict[str, torch.Tensor]], one entry per layer


# ---- small functions ---------------------------------------------------------------------------


def _up(x: torch.Tensor) -> torch.Tensor:
    """Half-precision values to float32; float32 and float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 storage round trip with one scale per row (the last axis is the row).

    scale = absmax / 448 (1 for an all-zero row); q = E4M3(clamp(x / scale, -448, 448)); returns
    q * scale in x's dtype (computed in float32, or float64 for float64 input).
    """
    xf = _up(x)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(xf.dtype)
    return (q * scale).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Float32 RMSNorm: x / sqrt(mean(x^2) + eps) * weight."""
    xf = _up(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * _up(weight)


def topk_desc_stable(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last axis; ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def clamped_swiglu_act(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)


def selection_width(n: int, topk: int, kpool: int) -> int:
    """Rows that row n attends to: min(n+1, topk + (n+1) % kpool)."""
    return min(n + 1, topk + (n + 1) % kpool)


@dataclass
class RunOpts:
    """Per-call switches.

    sparse: apply the indexer's selection (False: dense causal attention, the indexer warm-up).
    fp8: emulate FP8 storage of latents and pool keys.
    kl: compute the indexer's KL loss toward the detached dense attention mass per pool.
    moe_dense: compute every expert and weight by the (mostly zero) routing weights (fast for
        training on a GPU; exact, since unchosen experts get weight 0); False loops over experts.
    record: keep the attention masks and pool scores of the last call on each attention module.
    """

    sparse: bool = True
    fp8: bool = False
    kl: bool = False
    moe_dense: bool = True
    record: bool = False


@dataclass
class Out:
    hidden: torch.Tensor  # post-final-norm hidden (target) or normalised MTP output [B, m, H]
    logits: torch.Tensor  # [B, m, V]
    state: State
    kl: list = field(default_factory=list)  # per layer indexer KL losses (when opts.kl)


def slice_state(state: State, n: int) -> State:
    """The state of rows 0..n-1 (a rewind)."""
    return [{k: v[:, :n] for k, v in layer.items()} for layer in state]


def state_rows(state: State | None) -> int:
    return 0 if not state else int(state[0]["c"].shape[1])


# ---- modules -----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class SwiGLU(nn.Module):
    """gate_proj / up_proj / down_proj, clamped at ``limit``."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, inter)
        self.up_proj = _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)
        self.limit = limit

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu_act(self.gate_proj(y), self.up_proj(y), self.limit))


class MoEGate(nn.Module):
    def __init__(self, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))


class MoE(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        m, H = cfg.moe, cfg.hidden_size
        self.cfg = m
        self.gate = MoEGate(H, m.n_routed_experts)
        self.experts = nn.ModuleList(
            SwiGLU(H, m.moe_intermediate_size, m.swiglu_limit) for _ in range(m.n_routed_experts)
        )
        if m.n_shared_experts:
            # Added with weight 1: there is no shared_expert_gate (transformers' Glm5NextTextMoE).
            self.shared_experts = SwiGLU(H, m.moe_intermediate_size * m.n_shared_experts, m.swiglu_limit)
        self.last_load: torch.Tensor | None = None  # tokens per expert in the last forward

    def route(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """y [N, H] -> (chosen experts [N, k], their weights [N, k] float32). Router in float32."""
        m = self.cfg
        with torch.autocast(device_type=y.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(_up(y), _up(self.gate.weight)))
        idx = topk_desc_stable(
            scores + self.gate.e_score_correction_bias.to(scores.dtype), m.num_experts_per_tok
        )
        w = scores.gather(1, idx)
        if m.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return idx, w * m.routed_scaling_factor

    def forward(self, y: torch.Tensor, opts: RunOpts) -> torch.Tensor:
        shape = y.shape
        y = y.reshape(-1, shape[-1])
        N, E = y.shape[0], self.cfg.n_routed_experts
        idx, w = self.route(y)
        if self.training:
            flat = idx.reshape(-1)  # scatter_add, not bincount: no host sync on a GPU
            load = (
                torch.zeros(E, device=y.device)
                .scatter_add_(0, flat, torch.ones(flat.shape, device=y.device))
                .detach()
            )
            # Summed over the calls of one step (the MTP block runs once per unrolled depth).
            self.last_load = load if self.last_load is None else self.last_load + load
        if opts.moe_dense:
            I = self.cfg.moe_intermediate_size
            combine = torch.zeros(N, E, device=y.device, dtype=w.dtype).scatter(1, idx, w)
            wg = torch.cat([e.gate_proj.weight for e in self.experts], 0)  # [E*I, H]
            wu = torch.cat([e.up_proj.weight for e in self.experts], 0)
            wd = torch.cat([e.down_proj.weight for e in self.experts], 1)  # [H, E*I]
            act = clamped_swiglu_act(F.linear(y, wg), F.linear(y, wu), self.cfg.swiglu_limit)
            act = (act.view(N, E, I) * combine.unsqueeze(-1).to(act.dtype)).view(N, E * I)
            out = _up(F.linear(act, wd))
        else:
            out = torch.zeros(N, shape[-1], device=y.device, dtype=w.dtype)
            for e in range(E):
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                if tok.numel() == 0:
                    continue
                r = _up(self.experts[e](y[tok])) * w[tok, slot].unsqueeze(-1)
                out.index_add_(0, tok, r)
        if self.cfg.n_shared_experts:
            out = out + _up(self.shared_experts(y))
        return out.view(*shape[:-1], shape[-1])


class Indexer(nn.Module):
    """KPool lightning indexer (one per attention layer)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        a, d, H = cfg.attention, cfg.dsa, cfg.hidden_size
        self.ih, self.idim, self.kpool = d.index_n_heads, d.index_head_dim, d.index_kpool
        self.wq_b = _linear(a.q_lora_rank, d.index_n_heads * d.index_head_dim)
        self.wk = _linear(H, d.index_head_dim)
        self.k_norm = nn.LayerNorm(d.index_head_dim, eps=INDEXER_LN_EPS)
        self.weights_proj = _linear(H, d.index_n_heads)
        # Bare parameters under the published names (transformers' Glm5NextTextIndexer).
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(d.index_head_dim, H))
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(d.index_kpool, d.index_head_dim))

    def row_keys(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row key LayerNorm(wk.y) and gate index_kpool_compress_gate.y, float32 [B, m, idim]."""
        k = F.layer_norm(
            _up(self.wk(y)), (self.idim,), _up(self.k_norm.weight), _up(self.k_norm.bias), INDEXER_LN_EPS
        )
        return k, _up(F.linear(y, self.index_kpool_compress_gate.to(y.dtype)))

    def pool_keys(self, k: torch.Tensor, g: torch.Tensor, fp8: bool) -> torch.Tensor:
        """Complete pools of rows [B, n, idim] -> [B, n // kpool, idim] (FP8 round trip if fp8)."""
        B, n, D = k.shape
        P = n // self.kpool
        kk = _up(k[:, : P * self.kpool].reshape(B, P, self.kpool, D))
        gg = _up(g[:, : P * self.kpool].reshape(B, P, self.kpool, D)) + _up(self.index_kpool_compress_ape)
        key = (torch.softmax(gg, dim=2) * kk).sum(2)
        return fp8_rows(key) if fp8 else key

    def scores(self, y: torch.Tensor, qa: torch.Tensor, pool_keys: torch.Tensor) -> torch.Tensor:
        """score[b, i, p] = sum_h w_h relu(q_h . key_p) / sqrt(idim), float32 [B, m, P]."""
        B, m, _ = y.shape
        q = self.wq_b(qa).view(B, m, self.ih, self.idim)
        w = _up(self.weights_proj(y)) / math.sqrt(self.ih)
        dots = _up(torch.einsum("bmhd,bpd->bmhp", q, pool_keys.to(q.dtype)))
        return torch.einsum("bmhp,bmh->bmp", torch.relu(dots), w) / math.sqrt(self.idim)


def selection_mask(
    scores: torch.Tensor, qpos: torch.Tensor, n: int, topk_pools: int, kpool: int
) -> torch.Tensor:
    """Rows each query may attend to under the KPool selection, [B, m, n] bool.

    scores [B, m, P] over the complete pools of all n rows (P = n // kpool); query i sits at row
    qpos[i]; its complete pools are p < (qpos+1)//kpool. The top ``topk_pools`` of them (higher score,
    then lower index) are kept; rows in no complete pool of the query (its tail) are always kept; the
    causal cut is applied by the caller.
    """
    B, m, P = scores.shape
    dev = scores.device
    ncomp = (qpos + 1) // kpool  # [m]
    valid = torch.arange(P, device=dev)[None, :] < ncomp[:, None]  # [m, P]
    s = scores.masked_fill(~valid, float("-inf"))
    top = topk_desc_stable(s, min(topk_pools, P))
    sel = torch.zeros(B, m, P, dtype=torch.bool, device=dev).scatter(-1, top, True) & valid
    kpos = torch.arange(n, device=dev)
    tok_pool = torch.div(kpos, kpool, rounding_mode="floor").clamp(max=max(P - 1, 0))
    sel_tok = sel[..., tok_pool] if P > 0 else torch.zeros(B, m, n, dtype=torch.bool, device=dev)
    in_complete = kpos[None, :] < (ncomp * kpool)[:, None]  # [m, n]
    return sel_tok | ~in_complete


class DsaAttention(nn.Module):
    """NoPE MLA over the rows selected by the KPool indexer (``self_attn``)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        a, d, H = cfg.attention, cfg.dsa, cfg.hidden_size
        self.a, self.d, self.eps = a, d, cfg.rms_norm_eps
        self.q_a_proj = _linear(H, a.q_lora_rank)
        self.q_a_layernorm = RMSNorm(a.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = _linear(a.q_lora_rank, a.num_attention_heads * a.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(H, a.kv_lora_rank + a.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(a.kv_lora_rank, a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim))
        self.o_proj = _linear(a.num_attention_heads * a.v_head_dim, H)
        self.indexer = Indexer(cfg)
        self.last: dict[str, Any] = {}

    def forward(self, y: torch.Tensor, past: dict | None, opts: RunOpts):
        a, d = self.a, self.d
        nh, dq, dv = a.num_attention_heads, a.qk_head_dim, a.v_head_dim
        B, m, _ = y.shape
        n0 = 0 if past is None else int(past["c"].shape[1])
        n = n0 + m
        dev = y.device

        qa = self.q_a_layernorm(self.q_a_proj(y))  # query latent after q_a_layernorm
        q = self.q_b_proj(qa).view(B, m, nh, dq).transpose(1, 2)  # [B, nh, m, dq]
        c_new = self.kv_a_layernorm(self.kv_a_proj_with_mqa(y)[..., : a.kv_lora_rank])
        if opts.fp8:
            c_new = fp8_rows(c_new)
        # The indexer reads the same y and query latent, detached: it learns only from its KL loss.
        k_new, g_new = self.indexer.row_keys(y.detach())
        if past is None:
            c, ki, gi = c_new, k_new, g_new
        else:
            c = torch.cat([past["c"], c_new], 1)
            ki = torch.cat([past["k"], k_new], 1)
            gi = torch.cat([past["g"], g_new], 1)
        state = {"c": c, "k": ki, "g": gi}

        kv = self.kv_b_proj(c).view(B, n, nh, a.qk_nope_head_dim + dv)
        key, val = kv.split([a.qk_nope_head_dim, dv], dim=-1)
        key, val = key.transpose(1, 2), val.transpose(1, 2)  # [B, nh, n, *]
        s = _up(torch.matmul(q, key.transpose(-1, -2))) * a.softmax_scale  # [B, nh, m, n]

        qpos = torch.arange(n0, n, device=dev)
        kpos = torch.arange(n, device=dev)
        causal = kpos[None, :] <= qpos[:, None]  # [m, n]
        kp, K = d.index_kpool, d.topk_pools
        P = n // kp
        allowed = causal[None]  # [1 or B, m, n]
        kl = None
        sparse_needed = opts.sparse and P > K
        ps = None
        if (sparse_needed or opts.kl or opts.record) and P > 0:
            pk = self.indexer.pool_keys(ki, gi, opts.fp8)
            ps = self.indexer.scores(y.detach(), qa.detach(), pk)  # [B, m, P]
            if sparse_needed:
                allowed = causal[None] & selection_mask(ps, qpos, n, K, kp)
            if opts.kl:
                kl = self._kl(s, causal, ps, qpos, P)
        if opts.record:
            self.last = {"allowed": allowed.expand(B, m, n).detach(), "pool_scores": ps, "qpos": qpos}
        probs = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        o = torch.matmul(probs.to(val.dtype), val)  # [B, nh, m, dv]
        o = o.transpose(1, 2).reshape(B, m, nh * dv)
        return self.o_proj(o), state, kl

    def _kl(self, s, causal, ps, qpos, P):
        """KL(dense attention mass per complete pool (detached, summed over heads) || softmax of the
        indexer's pool scores), over the query rows with at least two complete pools."""
        kp = self.d.index_kpool
        B, nh, m, n = s.shape
        n0 = n - m
        n_rows = n - max(n0, 2 * kp - 1)  # query rows with >= 2 complete pools (host arithmetic)
        if n_rows <= 0:
            return None
        valid = torch.arange(P, device=s.device)[None, :] < ((qpos + 1) // kp)[:, None]  # [m, P]
        rows = (((qpos + 1) // kp) >= 2).to(s.dtype)
        with torch.no_grad():
            pd = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1).sum(1)  # [B, m, n]
            mass = pd[..., : P * kp].reshape(B, m, P, kp).sum(-1) * valid
            tgt = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
        logq = torch.log_softmax(ps.masked_fill(~valid, float("-inf")), dim=-1)
        logq = logq.masked_fill(~valid, 0.0)
        per_row = (torch.xlogy(tgt, tgt) - tgt * logq).sum(-1)  # [B, m]
        return (per_row * rows).sum() / (B * n_rows)

    def attend_unrolled(
        self,
        y: torch.Tensor,
        base_c: torch.Tensor,
        base_allowed: torch.Tensor,
        prev_c: list[torch.Tensor],
        opts: RunOpts,
    ):
        """Attention of the drafts after the first, as served, for every base row at once.

        Query i of ``y`` [B, m, H] is the depth-j draft (j = len(prev_c) + 2) of the propose whose
        first draft is base row i: it attends the base rows that draft 1 attended
        (``base_allowed`` [B, >= m, n] over ``base_c`` [B, n, C], the depth-1 latents as stored),
        plus the latents of depths 2 .. j at its own base row (``prev_c``, each [B, >= m, C], and
        its own, written first). That is the runtime's selection when drafts share draft 1's
        (index_share_for_mtp_iteration); without sharing the runtime re-selects, which differs
        only where the rows drafted complete a pool whose score misses the top-k. The indexer is
        not trained here. Returns (o_proj output, own latent).
        """
        a = self.a
        nh, dv, nope = a.num_attention_heads, a.v_head_dim, a.qk_nope_head_dim
        B, m, _ = y.shape
        n = base_c.shape[1]
        qa = self.q_a_layernorm(self.q_a_proj(y))
        q = self.q_b_proj(qa).view(B, m, nh, a.qk_head_dim).transpose(1, 2)  # [B, nh, m, dq]
        c_own = self.kv_a_layernorm(self.kv_a_proj_with_mqa(y)[..., : a.kv_lora_rank])
        if opts.fp8:
            c_own = fp8_rows(c_own)
        kv = self.kv_b_proj(base_c).view(B, n, nh, nope + dv)
        key, val = (t.transpose(1, 2) for t in kv.split([nope, dv], dim=-1))  # [B, nh, n, *]
        s = [_up(torch.matmul(q, key.transpose(-1, -2))) * a.softmax_scale]  # [B, nh, m, n]
        s[0] = s[0].masked_fill(~base_allowed[:, None, :m], float("-inf"))
        vals = []
        for c in [*(p[:, :m] for p in prev_c), c_own]:
            kd, vd = (
                t.transpose(1, 2)
                for t in self.kv_b_proj(c).view(B, m, nh, nope + dv).split([nope, dv], dim=-1)
            )
            s.append(_up((q * kd).sum(-1, keepdim=True)) * a.softmax_scale)  # [B, nh, m, 1]
            vals.append(vd)
        probs = torch.softmax(torch.cat(s, dim=-1), dim=-1)
        o = torch.matmul(probs[..., :n].to(val.dtype), val)
        for d, vd in enumerate(vals):
            o = o + probs[..., n + d : n + d + 1].to(vd.dtype) * vd
        o = o.transpose(1, 2).reshape(B, m, nh * dv)
        return self.o_proj(o), c_own


class DecoderLayer(nn.Module):
    def __init__(self, cfg, dense: bool) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = DsaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.dense = dense
        self.mlp = SwiGLU(H, cfg.intermediate_size, cfg.moe.swiglu_limit) if dense else MoE(cfg)

    def block(self, x: torch.Tensor, past: dict | None, opts: RunOpts):
        a, state, kl = self.self_attn(self.input_layernorm(x), past, opts)
        x = x + _up(a)
        y2 = self.post_attention_layernorm(x)
        x = x + _up(self.mlp(y2) if self.dense else self.mlp(y2, opts))
        return x, state, kl


class SharedHead(nn.Module):
    def __init__(self, H: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(H, eps)


class MtpLayer(DecoderLayer):
    """The MTP block: eh_proj input, one decoder layer (MoE), shared_head.norm."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg, dense=False)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = _linear(2 * H, H)
        self.shared_head = SharedHead(H, eps)


class _Inner(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, dense=i < cfg.first_k_dense_replace) for i in range(cfg.num_hidden_layers)]
            + [MtpLayer(cfg)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TorchModel(nn.Module):
    """Target + MTP block. ``state_dict()`` keys are the checkpoint's names."""

    def __init__(self, cfg) -> None:
        super().__init__()
        # The selection here always keeps the tail and every draft runs its own indexer; a config
        # asking otherwise would be evaluated with semantics the runtime does not use.
        if not cfg.dsa.always_select_tail or cfg.dsa.share_for_mtp_iteration:
            raise NotImplementedError(
                "train/torch_model.py implements index_kpool_always_select_tail true and "
                "index_share_for_mtp_iteration false only (the runtime and tests/reference_f64.py "
                "implement both options)"
            )
        self.cfg = cfg
        self.model = _Inner(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self._fp8_head_cache: tuple | None = None

    @property
    def mtp_layer(self) -> MtpLayer:
        return self.model.layers[self.cfg.num_hidden_layers]

    def moe_layers(self) -> list[MoE]:
        return [l.mlp for l in self.model.layers if not l.dense]

    def head(self, h: torch.Tensor, fp8_head: bool = False) -> torch.Tensor:
        w = self.lm_head.weight
        if fp8_head:
            key = (w.data_ptr(), w._version)
            if self._fp8_head_cache is None or self._fp8_head_cache[0] != key:
                self._fp8_head_cache = (key, fp8_rows(w.detach()))
            w = self._fp8_head_cache[1]
        return F.linear(h.to(w.dtype) if not torch.is_autocast_enabled() else h, w)

    def target(self, tokens: torch.Tensor, state: State | None = None, opts: RunOpts | None = None) -> Out:
        """Rows state_rows(state) .. +m of the target for tokens [B, m]; hidden is post-norm."""
        opts = opts or RunOpts()
        x = _up(self.model.embed_tokens(tokens))
        new_state, kls = [], []
        for i in range(self.cfg.num_hidden_layers):
            x, st, kl = self.model.layers[i].block(x, None if state is None else state[i], opts)
            new_state.append(st)
            if kl is not None:
                kls.append(kl)
        h = self.model.norm(x)
        return Out(h, self.head(h), new_state, kls)

    def mtp(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        state: State | None = None,
        opts: RunOpts | None = None,
        fp8_head: bool = False,
    ) -> Out:
        """Drafter rows for (token, hidden) pairs [B, m], [B, m, H]. Returns the normalised output
        rmsnorm(x) * shared_head.norm (the hidden the next draft consumes) and its logits."""
        opts = opts or RunOpts()
        L = self.mtp_layer
        e = L.enorm(self.model.embed_tokens(tokens))
        hh = L.hnorm(hidden)
        x = _up(L.eh_proj(torch.cat([e, hh], dim=-1)))
        x, st, kl = L.block(x, None if state is None else state[0], opts)
        out = L.shared_head.norm(x)
        return Out(out, self.head(out, fp8_head), [st], [kl] if kl is not None else [])

    def mtp_unrolled(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        base_c: torch.Tensor,
        base_allowed: torch.Tensor,
        prev_c: list[torch.Tensor],
        opts: RunOpts,
        fp8_head: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Depth-j drafts (j >= 2) of every base row: (token, the previous depth's normalised
        output) pairs [B, m], [B, m, H] through the block as ``DsaAttention.attend_unrolled``
        attends. Returns (normalised output, logits, own latent)."""
        L = self.mtp_layer
        e = L.enorm(self.model.embed_tokens(tokens))
        x = _up(L.eh_proj(torch.cat([e, L.hnorm(hidden)], dim=-1)))
        a, c_own = L.self_attn.attend_unrolled(L.input_layernorm(x), base_c, base_allowed, prev_c, opts)
        x = x + _up(a)
        x = x + _up(L.mlp(L.post_attention_layernorm(x), opts))
        out = L.shared_head.norm(x)
        return out, self.head(out, fp8_head), c_own


# ---- initialisation, losses, routing bias ------------------------------------------------------


def init_weights(model: TorchModel, std: float = 0.02, seed: int | None = None) -> None:
    """Normal(0, std) projections (output projections scaled by 1/sqrt(2 * layers)), unit norms,
    zero biases / ape / correction bias."""
    if seed is not None:
        torch.manual_seed(seed)
    n_layers = model.cfg.num_hidden_layers + 1
    for name, p in model.named_parameters():
        if p.dim() == 1 or name.endswith("compress_ape"):
            if name.endswith("k_norm.bias") or name.endswith("compress_ape"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)
        elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * n_layers))
        else:
            nn.init.normal_(p, 0.0, std)
    for moe in model.moe_layers():
        moe.gate.e_score_correction_bias.zero_()


def mtp_rows(tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter rows of a sequence: row r = (tokens[r+1], hidden[r]), r = 0 .. T-2."""
    return tokens[:, 1:], hidden[:, :-1]


def mtp_losses(
    model: TorchModel, tokens: torch.Tensor, hidden: torch.Tensor, opts: RunOpts, unroll: int = 1
) -> tuple[list[torch.Tensor], Out]:
    """MTP CE per draft depth 1 .. ``unroll`` over every base row, the way the drafter serves:
    depth 1 is row r = (tokens[r+1], hidden[r]) predicting tokens[r+2]; depth j >= 2 consumes
    tokens[r+j] (the draft, where the drafts so far were accepted) and depth j-1's own normalised
    output, attends as ``DsaAttention.attend_unrolled`` describes, and predicts tokens[r+j+1].
    Returns (CEs by depth, the depth-1 output)."""
    V, T = model.cfg.vocab_size, tokens.shape[1]
    t_rows, h_rows = mtp_rows(tokens, hidden)
    unroll = max(1, min(unroll, T - 2))
    mo = model.mtp(t_rows, h_rows, opts=dataclasses.replace(opts, record=opts.record or unroll > 1))
    ces = [F.cross_entropy(_up(mo.logits[:, :-1]).reshape(-1, V), tokens[:, 2:].reshape(-1))]
    if unroll > 1:
        base_c = mo.state[0]["c"]
        base_allowed = model.mtp_layer.self_attn.last["allowed"]
        prev_out, prev_c = mo.hidden, []
        for j in range(2, unroll + 1):
            m = T - j  # base rows r with a token tokens[r + j]
            out_j, logits_j, c_j = model.mtp_unrolled(
                tokens[:, j:], prev_out[:, :m], base_c, base_allowed, prev_c, opts
            )
            ces.append(F.cross_entropy(_up(logits_j[:, :-1]).reshape(-1, V), tokens[:, j + 1 :].reshape(-1)))
            prev_out, prev_c = out_j, [*prev_c, c_j]
    return ces, mo


def training_losses(
    model: TorchModel, tokens: torch.Tensor, opts: RunOpts, detach_hidden: bool = False, unroll: int = 1
) -> dict[str, torch.Tensor]:
    """Target next-token CE, MTP CE (row r predicts tokens[r+2]), with ``unroll`` > 1 the CE of
    the MTP's own drafts 2 .. unroll (``mtp_ce_2`` ...: ``mtp_losses``), and the mean indexer KL."""
    V = model.cfg.vocab_size
    out = model.target(tokens, opts=opts)
    ce_t = F.cross_entropy(_up(out.logits[:, :-1]).reshape(-1, V), tokens[:, 1:].reshape(-1))
    hidden = out.hidden.detach() if detach_hidden else out.hidden
    ces, mo = mtp_losses(model, tokens, hidden, opts, unroll)
    kls = out.kl + mo.kl
    kl = torch.stack(kls).mean() if kls else torch.zeros((), device=tokens.device)
    res = {"target_ce": ce_t, "mtp_ce": ces[0], "indexer_kl": kl}
    res.update({f"mtp_ce_{j}": ce for j, ce in enumerate(ces[1:], start=2)})
    return res


@torch.no_grad()
def update_routing_bias(model: TorchModel, rate: float) -> None:
    """Aux-loss-free balancing: bias += rate * sign(mean load - load) per MoE layer."""
    for moe in model.moe_layers():
        if moe.last_load is None:
            continue
        load = moe.last_load.float()
        moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        moe.last_load = None


# ---- checkpoint I/O (safetensors) ---------------------------------------------------------------


def hf_tensors(model: TorchModel, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: every weight in ``dtype``, the correction biases float32."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        t = t.float() if name.endswith("e_score_correction_bias") else t.to(dtype)
        out[name] = t.contiguous()
    return out


def save_checkpoint(
    model: TorchModel, directory, *, shard_mtp: bool = True, published: bool = False
) -> list[str]:
    """Write config.json and the weights: the target in shard 1, the MTP block in shard 2, with
    model.safetensors.index.json (or one model.safetensors). ``published``: GLM-5.3-Flash's layout
    (the config nested under ``text_config``, text tensors under ``model.language_model.``;
    docs/checkpoint.md), else the flat one."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    naming = import_naming_module()
    layout = naming.NameLayout.PUBLISHED if published else naming.NameLayout.FLAT
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(nested=published), indent=2) + "\n")
    tensors = {naming.disk_name(k, layout): v for k, v in hf_tensors(model).items()}
    meta = {"format": "pt"}
    if not shard_mtp:
        save_file(tensors, str(d / "model.safetensors"), metadata=meta)
        return ["config.json", "model.safetensors"]
    p = naming.disk_name(f"model.layers.{model.cfg.num_hidden_layers}.", layout)
    shards = {
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.startswith(p)},
        "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith(p)},
    }
    weight_map, total = {}, 0
    for fname, part in shards.items():
        save_file(part, str(d / fname), metadata=meta)
        for k, v in part.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return ["config.json", "model.safetensors.index.json", *shards]


def load_tensors(directory) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (sharded with an index, or one model.safetensors),
    under their logical (flat) names whichever layout stores them."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(directory)
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    naming = import_naming_module()
    layout = naming.layout_of(json.loads((d / "config.json").read_text()))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(d / f)).items():
            logical = naming.logical_name(name, layout)
            if logical is not None:  # a published checkpoint's tensors outside the text model
                out[logical] = t
    return out


def load_model(directory, dtype=torch.float32, device="cpu") -> TorchModel:
    """Build from config.json and load the weights (strict names and shapes), cast to ``dtype``
    (the correction biases stay float32)."""
    from pathlib import Path

    cfg = load_config(Path(directory) / "config.json")
    model = TorchModel(cfg)
    tensors = load_tensors(directory)
    missing = set(model.state_dict()) - set(tensors)
    extra = set(tensors) - set(model.state_dict())
    if missing or extra:
        raise KeyError(f"checkpoint mismatch: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}")
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    model.to(device=device, dtype=dtype)
    for moe in model.moe_layers():
        moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.data.float()
    return model.eval()


def import_config_module():
    """``model.config`` from this repository, found from this file's location."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        import model.config as mc  # noqa: PLC0415

        return mc
    except Exception:  # a sibling package __init__ with heavier imports: load the file alone
        spec = importlib.util.spec_from_file_location("_mtp_model_config", root / "model" / "config.py")
        mc = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mc
        spec.loader.exec_module(mc)
        return mc


def import_naming_module():
    """``model/checkpoint/naming.py`` loaded as a file (it needs only the standard library), so
    the checkpoint package's NumPy-side imports are not needed here."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "_mtp_checkpoint_naming"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "model" / "checkpoint" / "naming.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def load_config(path):
    return import_config_module().ModelConfig.from_json(path)
