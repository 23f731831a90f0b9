"""The MTP draft step written plainly in PyTorch, timed eager and as a replayed CUDA graph.

    python3 bench/torch_step.py                  # GLM-5.3-Flash shapes, contexts 4096 and 16000, k 1 and 3
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
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
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


class DraftStep:
    """Weights and caches of one MTP block, and its k-draft propose."""

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
                "kv_a": lin(a.kv_lora_rank, H),
                "kv_a_norm": norm(a.kv_lora_rank),
                "kv_b": lin(nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
                "o_proj": lin(H, nh * a.v_head_dim),
                "ix_wq_b": lin(d.index_n_heads * d.index_head_dim, a.q_lora_rank),
                "ix_wk": lin(d.index_head_dim, H),
                "ix_ln_w": norm(d.index_head_dim),
                "ix_ln_b": torch.zeros(d.index_head_dim, device=dev, dtype=dtype),
                "ix_weights": lin(d.index_n_heads, H),
                "ix_gate": lin(d.index_head_dim, H),
                "ix_ape": torch.zeros(d.index_kpool, d.index_head_dim, device=dev, dtype=dtype),
                "router": lin(E, H),
                "router_bias": torch.zeros(E, device=dev, dtype=torch.float32),
                "shared_gate_proj": lin(I, H),
                "shared_up_proj": lin(I, H),
                "shared_down_proj": lin(H, I),
            }
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
        # Caches of the DSA state: latents, indexer keys and gates per row, pool keys per pool.
        self.latents = torch.randn(rows, a.kv_lora_rank, device=dev, dtype=dtype, generator=g)
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

    # ---- one draft -----------------------------------------------------------------------------

    def _draft(self, tok: torch.Tensor, h: torch.Tensor, n: int):
        """Row n from (token [1] on device, hidden [H]); returns (next token [1], normalised x)."""
        cfg, W = self.cfg, self.W
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        eps = cfg.rms_norm_eps
        nh, kp = a.num_attention_heads, d.index_kpool
        e = _rms(F.embedding(tok, W["embed"])[0], W["enorm"], eps)
        x = F.linear(torch.cat([e, _rms(h, W["hnorm"], eps)]), W["eh_proj"])
        y = _rms(x, W["in_norm"], eps)
        qa = _rms(F.linear(y, W["q_a"]), W["q_a_norm"], eps)
        q = F.linear(qa, W["q_b"]).view(nh, a.qk_head_dim)
        self.latents[n] = _rms(F.linear(y, W["kv_a"]), W["kv_a_norm"], eps)
        # Indexer: this row's key and gate, then the pool it completes.
        self.keys[n] = F.layer_norm(
            _up(F.linear(y, W["ix_wk"])), (d.index_head_dim,), _up(W["ix_ln_w"]), _up(W["ix_ln_b"]), 1e-6
        ).to(self.dtype)
        self.gates[n] = F.linear(y, W["ix_gate"])
        ncomp = (n + 1) // kp
        if (n + 1) % kp == 0:
            s = slice(n + 1 - kp, n + 1)
            wts = torch.softmax(_up(self.gates[s]) + _up(W["ix_ape"]), dim=0)
            self.pool_keys[ncomp - 1] = (wts * _up(self.keys[s])).sum(0).to(self.dtype)
        K = d.index_topk // kp
        if d.share_for_mtp_iteration and n > self._first_row:
            # Drafts 2..k reuse draft 1's selection, plus the rows drafted since (model/dsa.py).
            rows = torch.cat([self._first_rows, torch.arange(self._first_row + 1, n + 1, device=self.device)])
            c = self.latents.index_select(0, rows)
        elif ncomp > K:
            qi = F.linear(qa, W["ix_wq_b"]).view(d.index_n_heads, d.index_head_dim)
            wh = _up(F.linear(y, W["ix_weights"])) / math.sqrt(d.index_n_heads)
            sc = torch.relu(_up(qi @ self.pool_keys[:ncomp].T))  # [ih, P]
            scores = (wh @ sc) / math.sqrt(d.index_head_dim)
            top = torch.sort(scores, descending=True, stable=True).indices[:K]  # ties: lower pool
            rows = (top[:, None] * kp + torch.arange(kp, device=self.device)).reshape(-1)
            if ncomp * kp <= n:
                rows = torch.cat([rows, torch.arange(ncomp * kp, n + 1, device=self.device)])
            c = self.latents.index_select(0, rows)
            self._first_rows = rows
        else:
            c = self.latents[: n + 1]
            self._first_rows = torch.arange(n + 1, device=self.device)
        # Absorbed MLA.
        q_lat = torch.bmm(q[:, None, : a.qk_nope_head_dim], self.w_uk)[:, 0]  # [nh, kl]
        p = torch.softmax(_up(q_lat @ c.T) * a.softmax_scale, dim=-1).to(self.dtype)
        o_lat = p @ c  # [nh, kl]
        o = torch.bmm(o_lat[:, None], self.w_uv_t)[:, 0]  # [nh, v]
        x = x + F.linear(o.reshape(-1), W["o_proj"])
        # MoE.
        y2 = _rms(x, W["post_norm"], eps)
        sc = torch.sigmoid(F.linear(_up(y2), _up(W["router"])))
        idx = torch.sort(sc + W["router_bias"], descending=True, stable=True).indices[
            : m.num_experts_per_tok
        ]  # ties: lower expert
        w = sc[idx]
        if m.norm_topk_prob:
            w = w / w.sum()
        w = w * m.routed_scaling_factor
        L = m.swiglu_limit
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
        x = x + (routed + _up(sh)).to(self.dtype)
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
    kl = cfg.attention.kv_lora_rank

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
        "kv_a": t(A + "kv_a_proj_with_mqa.weight")[:kl],
        "kv_a_norm": t(A + "kv_a_layernorm.weight"),
        "kv_b": t(A + "kv_b_proj.weight"),
        "o_proj": t(A + "o_proj.weight"),
        "ix_wq_b": t(X + "wq_b.weight"),
        "ix_wk": t(X + "wk.weight"),
        "ix_ln_w": t(X + "k_norm.weight"),
        "ix_ln_b": t(X + "k_norm.bias"),
        "ix_weights": t(X + "weights_proj.weight"),
        "ix_gate": t(X + "index_kpool_compress_gate"),
        "ix_ape": t(X + "index_kpool_compress_ape"),
        "router": t(M + "gate.weight"),
        "router_bias": sd[M + "gate.e_score_correction_bias"].to(device=device, dtype=torch.float32),
        "shared_gate_proj": t(M + "shared_experts.gate_proj.weight"),
        "shared_up_proj": t(M + "shared_experts.up_proj.weight"),
        "shared_down_proj": t(M + "shared_experts.down_proj.weight"),
    }
    for name in ("gate_proj", "up_proj", "down_proj"):
        W["experts_" + name] = torch.stack(
            [t(M + f"experts.{e}.{name}.weight") for e in range(cfg.moe.n_routed_experts)]
        )
    return W


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
        self.pool_valid = dev([[p < c for p in range(self.pmax)] for c in ncomp], torch.bool)
        self.k_valid = dev([[j < min(c, K) for j in range(K)] for c in ncomp], torch.bool)
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

        self.latents = rnd(batch, rows, a.kv_lora_rank)
        self.keys = rnd(batch, rows, d.index_head_dim)
        self.gates = rnd(batch, rows, d.index_head_dim)
        self.pool_keys = rnd(batch, rows // d.index_kpool, d.index_head_dim)
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
        self._plans: dict[tuple[tuple[int, ...], int], list[_DraftPlan]] = {}
        self._bidx = torch.arange(batch, device=dev)
        self._sel0: torch.Tensor | None = None
        self._mask0: torch.Tensor | None = None

    def load_sequence(self, b: int, step: DraftStep) -> None:
        """Sequence b's caches and inputs from a batch-1 step's (for comparing the two)."""
        n = min(self.rows, step.rows)
        self.latents[b, :n] = step.latents[:n]
        self.keys[b, :n] = step.keys[:n]
        self.gates[b, :n] = step.gates[:n]
        p = min(self.pool_keys.shape[1], step.pool_keys.shape[0])
        self.pool_keys[b, :p] = step.pool_keys[:p]
        self.tok_in[b] = step.tok_in[0]
        self.hid_in[b] = step.hid_in

    def enable_fp8_head(self) -> None:
        """An FP8 E4M3 copy of the head with one f32 scale per vocabulary row (what the runtime's
        FP8 head reads). ``torch._scaled_mm`` needs both operands in FP8, so the activations are
        quantized per row too (the runtime keeps them BF16): same bytes, not the same numbers."""
        w = self.W["head"].float()
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
        self.head_fp8 = (w / scale).to(torch.float8_e4m3fn)
        self.head_scale = scale.reshape(1, -1).contiguous()

    def plan(self, contexts, k: int) -> list[_DraftPlan]:
        key = (tuple(int(c) for c in contexts), k)
        if len(key[0]) != self.B:
            raise ValueError(f"{len(key[0])} contexts for a batch of {self.B}")
        if max(key[0]) + k + self.cfg.dsa.index_kpool > self.rows:
            raise ValueError(f"contexts up to {max(key[0])} with k={k} outrun the {self.rows} cache rows")
        if key not in self._plans:
            self._plans[key] = [_DraftPlan(self.cfg, list(key[0]), i, self.device) for i in range(k)]
        return self._plans[key]

    def _draft(self, tok: torch.Tensor, h: torch.Tensor, p: _DraftPlan, fp8: bool):
        """One draft for the batch: tokens [B], hiddens [B, H] -> (next tokens [B], normalised x)."""
        cfg, W = self.cfg, self.W
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        eps, B = cfg.rms_norm_eps, self.B
        nh, kp, K = a.num_attention_heads, d.index_kpool, d.index_topk // d.index_kpool
        bidx = self._bidx
        e = _rms(F.embedding(tok, W["embed"]), W["enorm"], eps)
        x = F.linear(torch.cat([e, _rms(h, W["hnorm"], eps)], -1), W["eh_proj"])
        y = _rms(x, W["in_norm"], eps)
        qa = _rms(F.linear(y, W["q_a"]), W["q_a_norm"], eps)
        q = F.linear(qa, W["q_b"]).view(B, nh, a.qk_head_dim)
        self.latents[bidx, p.rows] = _rms(F.linear(y, W["kv_a"]), W["kv_a_norm"], eps)
        self.keys[bidx, p.rows] = F.layer_norm(
            _up(F.linear(y, W["ix_wk"])), (d.index_head_dim,), _up(W["ix_ln_w"]), _up(W["ix_ln_b"]), 1e-6
        ).to(self.dtype)
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
        # Absorbed MLA.
        q_lat = torch.bmm(q[:, :, : a.qk_nope_head_dim].transpose(0, 1), self.base.w_uk).transpose(0, 1)
        s = _up(torch.matmul(q_lat, c.transpose(1, 2))) * a.softmax_scale  # [B, nh, S]
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        pr = torch.softmax(s, dim=-1).to(self.dtype)
        o_lat = torch.matmul(pr, c)  # [B, nh, kl]
        o = torch.bmm(o_lat.transpose(0, 1), self.base.w_uv_t).transpose(0, 1)  # [B, nh, v]
        x = x + F.linear(o.reshape(B, -1), W["o_proj"])
        # MoE: the batch's (row, expert) pairs sorted by expert, one grouped GEMM per matrix.
        y2 = _rms(x, W["post_norm"], eps)
        tk = m.num_experts_per_tok
        scr = torch.sigmoid(F.linear(_up(y2), _up(W["router"])))
        idx = torch.sort(scr + W["router_bias"], dim=-1, descending=True, stable=True).indices[:, :tk]
        self.expert_ids[p.i].copy_(idx)
        w = torch.gather(scr, 1, idx)
        if m.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = w * m.routed_scaling_factor
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
        x = x + (routed + _up(sh)).to(self.dtype)
        out = _rms(x, W["head_norm"], eps)
        if fp8:
            a_scale = _up(out).abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
            a8 = (_up(out) / a_scale).to(torch.float8_e4m3fn)
            logits = torch._scaled_mm(
                a8, self.head_fp8.t(), scale_a=a_scale, scale_b=self.head_scale, out_dtype=torch.bfloat16
            )
        else:
            logits = F.linear(out, W["head"])
        return torch.argmax(logits, dim=-1), out, logits

    def propose(self, contexts, k: int, fp8: bool = False) -> torch.Tensor:
        """k drafts for every sequence b from (tok_in[b], hid_in[b]) at rows contexts[b] ..
        contexts[b]+k-1; the drafts land in self.drafts[:, :k]."""
        if fp8 and self.head_fp8 is None:
            self.enable_fp8_head()
        plans = self.plan(contexts, k)
        tok, h = self.tok_in, self.hid_in
        for p in plans:
            tok, h, _ = self._draft(tok, h, p, fp8)
            self.drafts[:, p.i].copy_(tok)
        self.last_hidden.copy_(h)
        return self.drafts[:, :k]

    def distinct_experts(self, k: int) -> list[int]:
        """Distinct routed experts the batch chose in each of the last propose's k drafts."""
        return [int(torch.unique(self.expert_ids[i]).numel()) for i in range(k)]


# ---- timing --------------------------------------------------------------------------------------

_STEP: DraftStep | None = None


def _step(rows_needed: int) -> DraftStep:
    global _STEP
    if _STEP is None or _STEP.rows < rows_needed:
        _STEP = None
        torch.cuda.empty_cache()
        cfg = glm5_flash()
        _STEP = DraftStep(cfg, rows=max(rows_needed, 16384 + 16), device="cuda")
    return _STEP


@torch.inference_mode()
def run(context: int, k: int, graph: bool, iters: int = 200, warmup: int = 10) -> float:
    """Median milliseconds of one k-draft propose at ``context`` cached rows (GLM-5.3-Flash shapes,
    BF16, random weights), eager (``graph=False``) or replayed as a torch CUDA graph."""
    st = _step(context + k + 1)
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


def _batch_step(batch: int, max_context: int, k: int) -> BatchDraftStep:
    """The batch's caches over the batch-1 step's weights (built once, shared)."""
    global _BSTEP
    base = _step(16384 + 16)
    rows = max_context + k + base.cfg.dsa.index_kpool
    if _BSTEP is None or _BSTEP.B != batch or _BSTEP.rows < rows:
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
) -> float:
    """Median milliseconds of one k-draft propose for a batch of ``len(contexts)`` sequences, the
    sequence b at ``contexts[b]`` cached rows (GLM-5.3-Flash shapes, BF16 weights, the head BF16 or
    FP8), eager (a synchronize around each propose) or as one CUDA graph per (B, k, contexts)
    replayed back to back between CUDA events. ``info`` (a dict) receives the drafts and the
    distinct experts the batch chose per draft (for its byte floor)."""
    contexts = [int(c) for c in contexts]
    st = _batch_step(len(contexts), max(contexts), k)
    if not graph:
        for _ in range(warmup):
            st.propose(contexts, k, fp8_head)
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            st.propose(contexts, k, fp8_head)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
    else:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                st.propose(contexts, k, fp8_head)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            st.propose(contexts, k, fp8_head)
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
        st.propose(contexts, k, fp8_head)
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
    ap.add_argument("--kinds", default="uniform,ragged", help="with --batches: context kinds")
    ap.add_argument("--fp8-head", action="store_true", help="with --batches: the head by torch._scaled_mm")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: bench/torch_step.py times a GPU", file=sys.stderr)
        return 2
    if args.batches:
        return batch_main(args)
    t0 = time.time()
    _step(max(args.contexts) + max(args.ks) + 1)
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
            e = run(c, k, graph=False, iters=max(args.iters // 4, 20))
            try:
                g = run(c, k, graph=True, iters=args.iters)
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
    from bench.bench_batch import contexts_for

    t0 = time.time()
    _step(16384 + 16)
    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__}: weights built in {time.time() - t0:.1f} s",
        flush=True,
    )
    rows = []
    print(
        f"{'kind':>8} {'B':>4} {'k':>3} {'eager ms':>9} {'graph ms':>9} {'ms/seq-draft':>13}  distinct experts"
    )
    for kind in args.kinds.split(","):
        for B in args.batches:
            ctx = contexts_for(kind, B)
            for k in args.ks:
                info: dict = {}
                e = run_batch(ctx, k, graph=False, iters=max(args.iters // 4, 10), fp8_head=args.fp8_head)
                try:
                    g = run_batch(ctx, k, graph=True, iters=args.iters, fp8_head=args.fp8_head, info=info)
                except Exception as exc:  # keep the eager numbers if capture fails
                    print(f"graph capture failed at {kind} B {B}, k {k}: {exc!r}", file=sys.stderr)
                    g = float("nan")
                rows.append(
                    {
                        "kind": kind,
                        "B": B,
                        "k": k,
                        "head": "fp8" if args.fp8_head else "bf16",
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
    print(
        "TORCH_STEP_BATCH_JSON "
        + json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
