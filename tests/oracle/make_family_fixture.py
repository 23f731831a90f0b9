"""Generate the transformers oracle fixtures of the RoPE family: a tiny random MTP block of GLM-5 /
5.1 / 5.2 (``glm_moe_dsa``) or DeepSeek-V3.2 (``deepseek_v32``) written as a published-layout
checkpoint, with transformers' own logits for prefill + propose(k = 3).

Run where PyTorch and transformers (with ``models/glm_moe_dsa`` and ``models/deepseek_v32``,
>= 5.24) are installed, from the repository root:

    python tests/oracle/make_family_fixture.py --family glm_moe_dsa [--out DIR]
    python tests/oracle/make_family_fixture.py --family deepseek_v32 [--out DIR]

The default output is ``tests/oracle/{family}_tiny``. As for glm5_next
(tests/oracle/make_glm5next_fixture.py), transformers has no MTP module, so the block is composed
here from its own attention (``GlmMoeDsaAttention`` / ``DeepseekV32Attention``, with its per-token
DSA indexer, eager attention), its rotary embedding (``*RotaryEmbedding``: the default table, or
YaRN with its attention factor on cos / sin and ``mscale_all_dim`` folded into the softmax scale),
its MoE (``*MoE``: the group-limited ``*TopkRouter``, no SwiGLU clamp) and its RMSNorm with a plain
residual, and the MTP glue of the project's model: ``x = eh_proj([enorm(embed[t]) ; hnorm(h)])``,
``h1 = x + attn(input_layernorm(x))``, ``h2 = h1 + moe(post_attention_layernorm(h1))``,
``out = shared_head.norm(h2)``, ``logits = head(out)``; draft i + 1 consumes draft i's token and
``out``.

Positions: drafter row r is ``(embed(tokens[r + 1]), hidden[r])`` and has RoPE position r (offset
0: the target position of its hidden row), passed to transformers as ``position_ids = r``. A
propose at position n writes rows n .. n + k - 1; each draft's logits are those of the last row of
a full causal pass over rows 0 .. n + i (a row depends only on the rows before it, so this equals
an incremental pass). The indexer keeps the top ``index_topk`` of the rows up to its own (all of
them while there are no more); contexts past ``index_topk`` make the selection sparse. The indexer's
selection of every draft row is stored beside the logits.

The published forms:

- ``glm_moe_dsa``: a flat config.json (``model_type glm_moe_dsa``, ``rope_parameters`` {rope_type
  default, rope_theta}, ``rope_interleave`` / ``indexer_rope_interleave`` true, no index_kpool, no
  swiglu_limit), the MTP layer at ``model.layers.{num_hidden_layers}.`` without its own embedding or
  head; FP8 block-scaled experts, shared experts, q_a, q_b, kv_a_proj_with_mqa, kv_b, o_proj and the
  indexer's wq_b and wk.
- ``deepseek_v32``: a flat config.json with ``rope_theta`` and ``rope_scaling`` {type yarn, factor,
  original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim} at the top,
  ``n_group`` / ``topk_group``, ``scale_fmt ue8m0`` (power-of-two block scales); the same FP8 set;
  every norm (and the indexer's k_norm bias) stored F32; the MTP layer's own ``embed_tokens`` and
  ``shared_head.head`` stored, and DIFFERENT from ``model.embed_tokens`` / ``lm_head`` (random decoys
  of the same shape), so a loader that reads the target's fails.

Every parameter is random (transformers initialises the norms to ones and the correction bias to
zeros, which would hide a swapped axis or a dropped term). The stored tensors are what the reference
computes with: BF16 tensors rounded to BF16, F32 tensors as stored, the FP8 set block quantised to
E4M3 with F32 ``weight_scale_inv`` and dequantised back. The reference runs in float64 (transformers
computes the RoPE angles, the RMSNorm statistics, the router, the indexer's scores and the attention
softmax in float32 inside).

One deliberate departure from transformers' modules: its MLA normalises the q and kv latents with
the class default eps (1e-6) instead of the config's ``rms_norm_eps``; the serving engines (vLLM's
and SGLang's DeepSeek-V2 MLA, which serve both families) and this project use ``rms_norm_eps``, so
the generator sets the two norms' eps to it (a no-op for DeepSeek-V3.2, whose rms_norm_eps is
1e-6; with GLM-5's 1e-5 transformers' own eps moves the logits by 5.4e-6 of their spread on the
fixture, 30 times the float64 reference's agreement).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config  # noqa: E402
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (  # noqa: E402
    DeepseekV32Attention,
    DeepseekV32MoE,
    DeepseekV32RMSNorm,
    DeepseekV32RotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig  # noqa: E402
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (  # noqa: E402
    GlmMoeDsaAttention,
    GlmMoeDsaMoE,
    GlmMoeDsaRMSNorm,
    GlmMoeDsaRotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)

from model.checkpoint import quantize_fp8, write_safetensors  # noqa: E402
from model.checkpoint.fp8 import dequantize, scale_name, scale_shape  # noqa: E402
from model.weights_layout import is_published_fp8  # noqa: E402
from runtime.dtypes import BF16, to_fp8_saturating  # noqa: E402

BLOCK = (32, 32)  # weight_block_size: several blocks, and partial ones, at these shapes
K = 3
# Dense (every row fits in index_topk 8), crossing (draft 1 dense, drafts 2 and 3 sparse), then
# sparse up to positions past 90.
CONTEXTS = (2, 5, 7, 12, 23, 41, 66, 90)
# A case is drawn again while a draft row's index_topk-th and next index scores are closer than
# this fraction of the largest |score|: a selection a rounding could flip (the float64 reference
# against transformers' float32 scores, the FP8 keys of the device cache) would compare nothing.
# 0.01 was too close for the FP8 keys: the drafter's selection swapped a row of DeepSeek-V3.2's
# context 66 (its scores move by about 3% of a key's largest element per element rounded).
MIN_GAP = 0.03
MAX_DRAWS = 200
# The routing's margin (sigmoid + bias units) a case needs: the drafter's router reads BF16 inputs
# about 1e-2 off in the logit, about 2.5e-3 in the sigmoid; DeepSeek-V3.2's group-limited routing
# turned such near-ties into whole other experts at drafts 2..3 of 5 of 8 contexts.
MIN_ROUTE_GAP = 0.01

# Tiny, awkward shapes: q_lora 48 and moe_intermediate 24 leave partial 32 x 32 FP8 blocks, the
# rope part (16) is as wide as the nope part on GLM and narrower than v on DeepSeek, the indexer
# rotates the first 16 of its 32 dims.
_COMMON: dict[str, Any] = {
    "architectures": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 64,
    "index_head_dim": 32,
    "index_topk": 8,
    "initializer_range": 0.02,
    "intermediate_size": 80,
    "kv_lora_rank": 32,
    "moe_layer_freq": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

PUBLISHED: dict[str, dict[str, Any]] = {
    "glm_moe_dsa": _COMMON
    | {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 97,
        "v_head_dim": 16,
        "index_n_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": 24,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        # Not the class default (10000): a loader that ignores rope_parameters rotates wrongly.
        "rope_parameters": {"rope_type": "default", "rope_theta": 2500.0},
        "rope_interleave": True,
        "indexer_rope_interleave": True,
        "pad_token_id": 96,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK),
            "modules_to_not_convert": ["lm_head"],
        },
    },
    "deepseek_v32": _COMMON
    | {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": 101,
        "v_head_dim": 24,
        "index_n_heads": 2,
        "n_routed_experts": 16,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 24,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 5120,
        "rope_theta": 10000,
        # The published keys; mscale_all_dim differs from mscale (both 1.0 as published) so that
        # YaRN's attention factor on cos / sin is not 1 and the softmax correction is not the same.
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(BLOCK),
        },
    },
}


@dataclass(frozen=True)
class Family:
    config_cls: type
    attention: type
    moe: type
    norm: type
    rotary: type
    indexer_rope: Any  # the rotation transformers' indexer applies (for the tie check only)
    seed: int
    mtp_own_head: bool  # the MTP layer stores its own embed_tokens and shared_head.head
    f32_norms: bool
    pow2_scales: bool  # scale_fmt ue8m0


FAMILIES = {
    "glm_moe_dsa": Family(
        GlmMoeDsaConfig,
        GlmMoeDsaAttention,
        GlmMoeDsaMoE,
        GlmMoeDsaRMSNorm,
        GlmMoeDsaRotaryEmbedding,
        apply_rotary_pos_emb_interleave,
        seed=20261205,
        mtp_own_head=False,
        f32_norms=False,
        pow2_scales=False,
    ),
    "deepseek_v32": Family(
        DeepseekV32Config,
        DeepseekV32Attention,
        DeepseekV32MoE,
        DeepseekV32RMSNorm,
        DeepseekV32RotaryEmbedding,
        apply_rotary_pos_emb,
        seed=20261206,
        mtp_own_head=True,
        f32_norms=True,
        pow2_scales=True,
    ),
}

# The projections stored FP8 in both families: GLM-5.3-Flash's set plus kv_b and the indexer's
# wq_b and wk.
_EXTRA_FP8 = (".self_attn.kv_b_proj.weight", ".self_attn.indexer.wq_b.weight", ".self_attn.indexer.wk.weight")


def stored_fp8(name: str) -> bool:
    return is_published_fp8(name) or name.endswith(_EXTRA_FP8)


def bf16_round(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(BF16).astype(np.float64)


def quantize_pow2(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Block quantisation with power-of-two scales (``scale_fmt ue8m0``): the smallest 2^e with
    block absmax / 2^e <= 448."""
    w = np.asarray(w, np.float32)
    bo, bi = block
    so, si = scale_shape(w.shape, block)
    padded = np.zeros((so * bo, si * bi), np.float32)
    padded[: w.shape[0], : w.shape[1]] = np.abs(w)
    amax = padded.reshape(so, bo, si, bi).max(axis=(1, 3)).astype(np.float64)
    scale = np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0))).astype(np.float32)
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[: w.shape[0], : w.shape[1]]
    return to_fp8_saturating(w / full), scale


class MtpReference(torch.nn.Module):
    """transformers' modules plus the MTP glue (float64)."""

    def __init__(self, fam: Family, tc, layer: int) -> None:
        super().__init__()
        self.indexer_rope = fam.indexer_rope
        H, eps = tc.hidden_size, tc.rms_norm_eps
        self.embed = torch.nn.Embedding(tc.vocab_size, H)
        self.lm_head = torch.nn.Linear(H, tc.vocab_size, bias=False)
        self.enorm = fam.norm(H, eps)
        self.hnorm = fam.norm(H, eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = fam.norm(H, eps)
        # transformers' per-layer schedules cover the target's layers only; the module uses its
        # index for the cache (none here) and that schedule, so it is built as the last target
        # layer's (a full indexer).
        self.self_attn = fam.attention(tc, layer - 1)
        # The latents' norms at the config's eps, as served (the module docstring says why).
        self.self_attn.q_a_layernorm.variance_epsilon = eps
        self.self_attn.kv_a_layernorm.variance_epsilon = eps
        self.post_attention_layernorm = fam.norm(H, eps)
        self.mlp = fam.moe(tc)
        self.shared_head_norm = fam.norm(H, eps)
        self.rotary = fam.rotary(tc)
        self._selection: list[torch.Tensor] = []
        self.self_attn.indexer.register_forward_hook(lambda _m, _a, out: self._selection.append(out))

    def rows(
        self, tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Rows (tokens[r], hidden[r]) r < S at positions 0 .. S-1 through the block: (logits, out)
        of the last row and the indexer's selection of the last row (sorted)."""
        S = tokens.shape[0]
        x = self.eh_proj(torch.cat([self.enorm(self.embed(tokens)), self.hnorm(hidden)], -1))[None]
        y = self.input_layernorm(x)
        position_ids = torch.arange(S)[None]
        pe = self.rotary(y, position_ids)
        # Additive causal mask [1, 1, S, S] as transformers' eager path builds it.
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        mask = torch.zeros(1, 1, S, S, dtype=y.dtype).masked_fill(~causal, torch.finfo(y.dtype).min)
        self._selection.clear()
        a = self.self_attn(
            hidden_states=y, position_embeddings=pe, attention_mask=mask, position_ids=position_ids
        )[0]
        (topk,) = self._selection  # [1, S, min(index_topk, S)] int32
        # The last row sees every row, so its top-k holds no causally masked one.
        last = sorted(int(r) for r in topk[0, -1].tolist())
        assert len(set(last)) == len(last) and 0 <= last[0] and last[-1] < S
        self.gap = self.selection_gap(y, pe, last)
        h1 = x + a
        y2 = self.post_attention_layernorm(h1)
        self.route_gap = self.routing_gap(y2[0, -1])
        h2 = h1 + self.mlp(y2)
        out = self.shared_head_norm(h2)[0, -1]
        return self.lm_head(out), out, last

    def selection_gap(
        self, y: torch.Tensor, pe: tuple[torch.Tensor, torch.Tensor], chosen: list[int]
    ) -> float:
        """How far the last row's selection is from a tie: (k-th - (k+1)-th best index score) / the
        largest |score| (inf while every row is selected). The scores are recomputed here as
        transformers' indexer computes them (float32 products of its own modules and rotation), only
        to reject a case whose selection a rounding could flip (a tie at zero is common: a row whose
        head weights are all negative scores zero on every key that every head's ReLU zeroes)."""
        ix, attn = self.self_attn.indexer, self.self_attn
        S, R, D = y.shape[1], ix.qk_rope_head_dim, ix.head_dim
        if S <= ix.index_topk:
            return math.inf
        q = ix.wq_b(attn.q_a_layernorm(attn.q_a_proj(y)))[:, -1:].view(1, 1, ix.n_heads, D)
        k = ix.k_norm(ix.wk(y)).unsqueeze(2)
        cos, sin = pe
        q_rot, _ = self.indexer_rope(q[..., :R], q[..., :R], cos[:, -1:], sin[:, -1:], unsqueeze_dim=2)
        _, k_rot = self.indexer_rope(k[..., :R], k[..., :R], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., R:]], -1)[0, 0].float()  # [heads, D]
        k = torch.cat([k_rot, k[..., R:]], -1)[0, :, 0].float()  # [S, D]
        w = ix.weights_proj(y[0, -1]).float() * ix.n_heads**-0.5
        scores = (w[:, None] * torch.relu(q @ k.T * ix.softmax_scale)).sum(0).double().numpy()
        order = np.argsort(-scores, kind="stable")
        K = ix.index_topk
        gap = float(scores[order[K - 1]] - scores[order[K]]) / max(float(np.abs(scores).max()), 1e-30)
        # Away from a tie the recomputed selection is transformers' (a check of the recomputation).
        assert gap < 1e-5 or sorted(order[:K].tolist()) == chosen, "recomputed scores disagree"
        return gap

    def routing_gap(self, y2: torch.Tensor) -> float:
        """How far the last row's routing is from a tie, in the router's choice units (sigmoid
        score + bias): the smaller of the kept groups' margin (the topk_group-th group score minus
        the next) and the chosen experts' (the k-th choice among the kept groups minus the next).
        A rounding that flips either swaps whole experts, so the drafter's BF16 logits would be
        compared with another computation than its own (transformers' router, recomputed)."""
        g = self.mlp.gate
        choice = (torch.sigmoid(y2.double() @ g.weight.double().T) + g.e_score_correction_bias).numpy()
        E, G, KG, K = g.num_experts, g.num_group, g.topk_group, g.top_k
        gap = math.inf
        kept = np.ones(E, bool)
        if G > 1 and KG < G:
            gs = np.sort(choice.reshape(G, E // G), -1)[:, -2:].sum(-1)
            order = np.argsort(-gs, kind="stable")
            gap = float(gs[order[KG - 1]] - gs[order[KG]])
            kept = np.repeat(np.isin(np.arange(G), order[:KG]), E // G)
        c = np.sort(choice[kept])[::-1]
        return min(gap, float(c[K - 1] - c[K])) if len(c) > K else gap


def randomise(ref: MtpReference, rng: np.random.Generator) -> None:
    with torch.no_grad():
        for name, p in list(ref.named_parameters()) + list(ref.named_buffers()):
            if name.startswith("rotary."):
                continue  # the frequency table is transformers' own
            shape = tuple(p.shape)
            if name.endswith("e_score_correction_bias"):
                v = 0.05 * rng.standard_normal(shape)
            elif p.dim() == 1:  # norms near 1, LayerNorm bias near 0
                v = (0.1 if name.endswith("bias") else 1.0) + 0.2 * rng.standard_normal(shape)
            elif name == "embed.weight":
                v = rng.standard_normal(shape)
            else:  # projections [.., out, in]: unit-variance outputs on unit inputs
                v = rng.standard_normal(shape) / math.sqrt(shape[-1])
                if name == "lm_head.weight":
                    v *= 4.0  # a head whose logits spread over a few units
            p.copy_(torch.from_numpy(np.asarray(v, np.float64)))


def stored_tensors(fam: Family, ref: MtpReference, P: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under the published names, and the module weights set to exactly
    what is stored (BF16 rounding, FP8 block quantisation)."""
    embed, head = (
        (P + "embed_tokens.weight", P + "shared_head.head.weight")
        if fam.mtp_own_head
        else ("model.embed_tokens.weight", "lm_head.weight")
    )
    mod = {
        "embed.weight": embed,
        "lm_head.weight": head,
        "enorm.weight": P + "enorm.weight",
        "hnorm.weight": P + "hnorm.weight",
        "eh_proj.weight": P + "eh_proj.weight",
        "input_layernorm.weight": P + "input_layernorm.weight",
        "post_attention_layernorm.weight": P + "post_attention_layernorm.weight",
        "shared_head_norm.weight": P + "shared_head.norm.weight",
    }
    for name, _ in list(ref.named_parameters()) + list(ref.named_buffers()):
        if name.startswith(("self_attn.", "mlp.")) and not name.startswith("mlp.experts."):
            mod[name] = P + name
    quantize = quantize_pow2 if fam.pow2_scales else quantize_fp8

    def fp8(stored: str, w: np.ndarray) -> np.ndarray:
        q, s = quantize(w, BLOCK)
        out[stored], out[scale_name(stored)] = q, s
        return dequantize(q, s, np.float64, 0, BLOCK)

    out: dict[str, np.ndarray] = {}
    params = dict(ref.named_parameters()) | dict(ref.named_buffers())
    with torch.no_grad():
        for mname, stored in mod.items():
            t = params[mname]
            a = t.detach().numpy()
            if mname.endswith("e_score_correction_bias") or (fam.f32_norms and a.ndim == 1):
                out[stored] = a.astype(np.float32)
                t.copy_(torch.from_numpy(out[stored].astype(np.float64)))
            elif stored_fp8(stored):
                t.copy_(torch.from_numpy(fp8(stored, a)))
            else:
                out[stored] = a.astype(np.float32).astype(BF16)
                t.copy_(torch.from_numpy(bf16_round(a)))
        gu, dn = ref.mlp.experts.gate_up_proj, ref.mlp.experts.down_proj  # [E, 2I, H], [E, H, I]
        inter = dn.shape[-1]
        for e in range(gu.shape[0]):
            for proj, w in (("gate_proj", gu[e, :inter]), ("up_proj", gu[e, inter:]), ("down_proj", dn[e])):
                w.copy_(torch.from_numpy(fp8(f"{P}mlp.experts.{e}.{proj}.weight", w.numpy())))
    if fam.mtp_own_head:
        # The target's embedding and head: decoys the block must not read.
        V, H = ref.embed.weight.shape
        out["model.embed_tokens.weight"] = rng.standard_normal((V, H)).astype(np.float32).astype(BF16)
        out["lm_head.weight"] = (
            (4.0 * rng.standard_normal((V, H)) / math.sqrt(H)).astype(np.float32).astype(BF16)
        )
    return out


def propose(
    ref: MtpReference, tokens: np.ndarray, hidden: np.ndarray, n: int, last: int, target_hidden: np.ndarray
) -> dict[str, np.ndarray]:
    """Prefill rows 0..n-1, then k drafts from (last, target_hidden) at row n."""
    toks = [int(t) for t in tokens[1 : n + 1]]
    hid = [torch.from_numpy(h) for h in hidden[:n]]
    tok, h = last, torch.from_numpy(target_hidden)
    drafts, logits, selections, gaps, route_gaps = [], [], [], [], []
    for _ in range(K):
        toks.append(tok)
        hid.append(h)
        lg, out, sel = ref.rows(torch.tensor(toks), torch.stack(hid))
        gaps.append(ref.gap)
        route_gaps.append(ref.route_gap)
        tok, h = int(torch.argmax(lg)), out.detach()
        drafts.append(tok)
        logits.append(lg.detach().numpy())
        selections.append(sel + [-1] * (ref.self_attn.indexer.index_topk - len(sel)))
    return {
        "drafts": np.array(drafts, np.int64),
        "logits": np.array(logits, np.float64),
        "selections": np.array(selections, np.int64),  # per draft, sorted, -1 padded
        "selection_gaps": np.array(gaps, np.float64),
        "routing_gaps": np.array(route_gaps, np.float64),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), required=True)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    fam = FAMILIES[args.family]
    out = args.out or Path(__file__).resolve().parent / f"{args.family}_tiny"
    torch.manual_seed(fam.seed)
    rng = np.random.default_rng(fam.seed)
    published = dict(PUBLISHED[args.family])
    import transformers

    published["transformers_version"] = transformers.__version__
    # transformers reads the published form itself (DeepSeek-V3.2's rope_scaling standardised into
    # rope_parameters), so the modules see what a user's from_pretrained would.
    # (A copy: transformers standardises rope_scaling in place, adding keys the file has not.)
    tc = fam.config_cls.from_dict(copy.deepcopy(published))
    tc._attn_implementation = "eager"
    tc._experts_implementation = "eager"
    layer = tc.num_hidden_layers  # the MTP layer's index
    ref = MtpReference(fam, tc, layer).double().eval()
    assert ref.self_attn.indexer is not None
    assert ref.self_attn.qk_rope_head_dim == ref.self_attn.indexer.qk_rope_head_dim == 16
    randomise(ref, rng)
    P = f"model.layers.{layer}."
    tensors = stored_tensors(fam, ref, P, rng)

    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        f.unlink()
    # A drafter-only copy in the published layout: the MTP layer, the embedding and the head.
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(published, indent=1, sort_keys=True) + "\n")

    H, V = tc.hidden_size, tc.vocab_size
    cases: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for n in CONTEXTS:
            for attempt in range(MAX_DRAWS):
                tokens = rng.integers(0, V, n + 1)
                # Target hidden rows as the drafter receives them: BF16.
                hidden = bf16_round(rng.standard_normal((n, H)))
                target_hidden = bf16_round(rng.standard_normal(H))
                last = int(rng.integers(0, V))
                r = propose(ref, tokens, hidden, n, last, target_hidden)
                if r["selection_gaps"].min() > MIN_GAP and r["routing_gaps"].min() > MIN_ROUTE_GAP:
                    break
                print(
                    f"context {n:3d}: draw {attempt} rejected, selection gaps {r['selection_gaps']}, "
                    f"routing gaps {r['routing_gaps']}"
                )
            else:
                raise RuntimeError(f"context {n}: no draw of {MAX_DRAWS} has a clear selection")
            cases[f"n{n}_tokens"] = tokens
            cases[f"n{n}_hidden"] = hidden.astype(np.float32)
            cases[f"n{n}_target_hidden"] = target_hidden.astype(np.float32)
            cases[f"n{n}_last"] = np.array(last)
            for key, v in r.items():
                cases[f"n{n}_{key}"] = v
            top2 = np.sort(r["logits"], -1)[:, -2:]
            print(
                f"context {n:3d}: drafts {r['drafts'].tolist()}, top-2 gaps "
                f"{np.round(top2[:, 1] - top2[:, 0], 4).tolist()}, drafts attend "
                f"{[int((s >= 0).sum()) for s in r['selections']]} rows",
                flush=True,
            )
    cases["contexts"] = np.array(CONTEXTS)
    cases["k"] = np.array(K)
    # transformers' own frequency table and cos / sin factor, to check the config's against.
    cases["rope_inv_freq"] = ref.rotary.inv_freq.numpy().astype(np.float32)
    cases["rope_attention_scaling"] = np.array(float(ref.rotary.attention_scaling))
    cases["softmax_scale"] = np.array(float(ref.self_attn.scaling))
    np.savez_compressed(out / "reference.npz", **cases)

    (out / "PROVENANCE.json").write_text(
        json.dumps(
            {
                "generator": f"tests/oracle/make_family_fixture.py --family {args.family}",
                "seed": fam.seed,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": sys.version.split()[0],
                "departures": "q_a_layernorm / kv_a_layernorm eps set to rms_norm_eps (see the generator)",
            },
            indent=1,
        )
        + "\n"
    )
    total = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({total / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
