"""Generate the transformers oracle fixture: a tiny random GLM-5.3-Flash MTP block written as a
published-layout checkpoint, with transformers' own logits for prefill + propose(k = 3).

Run where PyTorch and transformers (with ``models/glm5_next``, >= 5.23) are installed, from the
repository root:

    python tests/oracle/make_glm5next_fixture.py [--out tests/oracle/glm5next_tiny]

transformers has no MTP module (it ignores the MTP layer on load), so the block is composed here
from its own ``Glm5NextTextAttention`` (with its KPool indexer, eager attention),
``Glm5NextTextMoE`` and ``Glm5NextTextRMSNorm`` with a plain residual, and the MTP glue of the
project's model (README, docs/checkpoint.md): ``x = eh_proj([enorm(embed[t]) ; hnorm(h)])``, ``h1 = x + attn(input_layernorm(x))``,
``h2 = h1 + moe(post_attention_layernorm(h1))``, ``out = shared_head.norm(h2)``,
``logits = lm_head(out)``; draft i + 1 consumes draft i's token and ``out``. Drafter row r is
``(embed(tokens[r + 1]), hidden[r])``; a propose at position n writes rows n .. n + k - 1, and each
draft's logits are those of the last row of a full causal pass over rows 0 .. n + i (a row depends
only on the rows before it, so this equals an incremental pass).

Every parameter is random (transformers initialises the compress gate to ones and the ape to
zeros, the norms to ones and the correction bias to zeros, which would hide a swapped axis or a
dropped term). The stored tensors are what the reference computes with: BF16 tensors rounded to
BF16, the published FP8 set (experts, shared experts, q_a, q_b, kv_a_proj_with_mqa, o_proj) block
quantised to E4M3 with F32 ``weight_scale_inv`` and dequantised back. The reference runs in
float64 (the indexer's scores are float32 inside transformers).

With ``index_share_for_mtp_iteration`` (true in the published config, and in this fixture's),
drafts 2..k attend draft 1's selection (transformers' own indexer output for draft 1's row) plus
every row drafted since, the project's definition (model/dsa.py, "Shared selection"); the
selection is passed to transformers' attention as a shared layer's ``prev_topk_indices``. The
fixture holds the reference for both settings.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers.models.glm5_next.configuration_glm5_next import (  # noqa: E402
    Glm5NextConfig,
    Glm5NextTextConfig,
)
from transformers.models.glm5_next.modeling_glm5_next import (  # noqa: E402
    Glm5NextTextAttention,
    Glm5NextTextMoE,
    Glm5NextTextRMSNorm,
)

from model.checkpoint import quantize_fp8, write_safetensors  # noqa: E402
from model.checkpoint.fp8 import dequantize, scale_name  # noqa: E402
from model.checkpoint.naming import PUBLISHED_PREFIX  # noqa: E402
from model.weights_layout import is_published_fp8  # noqa: E402
from runtime.dtypes import BF16  # noqa: E402

SEED = 20261201
BLOCK = (32, 32)  # weight_block_size: several blocks, and partial ones, at these shapes
CONTEXTS = (2, 5, 10, 17, 29, 41, 62, 90)  # before the first pool, dense, then sparse (2 pools of up to 22)
K = 3
TEXT = {
    "vocab_size": 256,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 0,
    "v_head_dim": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 8,
    "index_kpool": 4,
    "index_kpool_always_select_tail": True,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "swiglu_limit": 1.5,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "first_k_dense_replace": 1,
    "intermediate_size": 96,
    "pad_token_id": None,
    "layer_types": ["indexed_attention"] * 2,
    "indexer_types": ["full"] * 2,
    "mlp_layer_types": ["dense", "sparse"],
}


def bf16_round(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(BF16).astype(np.float64)


class MtpReference(torch.nn.Module):
    """transformers' modules plus the MTP glue (float64)."""

    def __init__(self, tc: Glm5NextTextConfig, layer: int) -> None:
        super().__init__()
        H = tc.hidden_size
        self.embed = torch.nn.Embedding(tc.vocab_size, H)
        self.lm_head = torch.nn.Linear(H, tc.vocab_size, bias=False)
        self.enorm = Glm5NextTextRMSNorm(H, tc.rms_norm_eps)
        self.hnorm = Glm5NextTextRMSNorm(H, tc.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = Glm5NextTextRMSNorm(H, tc.rms_norm_eps)
        # transformers' per-layer schedules cover the target's layers only; the module uses its
        # index for the cache (none here) and that schedule, so it is built as the last target
        # layer's (a full indexer).
        self.self_attn = Glm5NextTextAttention(tc, layer - 1)
        self.post_attention_layernorm = Glm5NextTextRMSNorm(H, tc.rms_norm_eps)
        self.mlp = Glm5NextTextMoE(tc)
        self.shared_head_norm = Glm5NextTextRMSNorm(H, tc.rms_norm_eps)

    def rows(
        self, tokens: torch.Tensor, hidden: torch.Tensor, shared_last: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows (tokens[r], hidden[r]) r < S through the block: (logits, out) of the last row and
        the indexer's selection [S, W]. ``shared_last``: the last row attends these rows instead of
        its own selection (a draft after the first of a sharing propose)."""
        S = tokens.shape[0]
        x = self.eh_proj(torch.cat([self.enorm(self.embed(tokens)), self.hnorm(hidden)], -1))[None]
        y = self.input_layernorm(x)
        mask = torch.ones(1, S, dtype=torch.bool)
        attn = self.self_attn
        q_resid = attn.q_a_layernorm(attn.q_a_proj(y))
        topk = attn.indexer(
            hidden_states=y, q_resid=q_resid, attention_mask=mask, past_key_values=None
        )  # [1, S, W] int32, -1 = none
        if shared_last is not None:
            width = max(topk.shape[-1], len(shared_last))
            topk = F.pad(topk, (0, width - topk.shape[-1]), value=-1)
            topk[0, -1] = -1
            topk[0, -1, : len(shared_last)] = torch.tensor(shared_last, dtype=topk.dtype)
        indexer, attn.indexer = attn.indexer, None  # a shared layer: it attends prev_topk_indices
        try:
            a, _, _ = attn(hidden_states=y, attention_mask=mask, prev_topk_indices=topk)
        finally:
            attn.indexer = indexer
        h1 = x + a
        h2 = h1 + self.mlp(self.post_attention_layernorm(h1))
        out = self.shared_head_norm(h2)[0, -1]
        return self.lm_head(out), out, topk[0]


def randomise(ref: MtpReference, rng: np.random.Generator) -> None:
    with torch.no_grad():
        for name, p in list(ref.named_parameters()) + list(ref.named_buffers()):
            shape = tuple(p.shape)
            if name.endswith("e_score_correction_bias"):
                v = 0.05 * rng.standard_normal(shape)
            elif p.dim() == 1:  # norms near 1, LayerNorm bias near 0
                v = (0.1 if name.endswith("bias") else 1.0) + 0.2 * rng.standard_normal(shape)
            elif name.endswith("index_kpool_compress_ape") or name == "embed.weight":
                v = rng.standard_normal(shape)
            else:  # projections [.., out, in]: unit-variance outputs on unit inputs
                v = rng.standard_normal(shape) / math.sqrt(shape[-1])
                if name == "lm_head.weight":
                    v *= 4.0  # a head whose logits spread over a few units
            p.copy_(torch.from_numpy(np.asarray(v, np.float64)))


def stored_tensors(ref: MtpReference, P: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under the published names, and the module weights set to exactly
    what is stored (BF16 rounding, FP8 block quantisation)."""
    mod = {
        "embed.weight": "model.language_model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight",
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
    out: dict[str, np.ndarray] = {}
    params = dict(ref.named_parameters()) | dict(ref.named_buffers())
    with torch.no_grad():
        for mname, stored in mod.items():
            t = params[mname]
            a = t.detach().numpy()
            if mname.endswith("e_score_correction_bias"):
                out[stored] = a.astype(np.float32)
                t.copy_(torch.from_numpy(out[stored].astype(np.float64)))
            elif is_published_fp8(stored):
                q, s = quantize_fp8(a, BLOCK)
                out[stored], out[scale_name(stored)] = q, s
                t.copy_(torch.from_numpy(dequantize(q, s, np.float64, 0, BLOCK)))
            else:
                out[stored] = a.astype(np.float32).astype(BF16)
                t.copy_(torch.from_numpy(bf16_round(a)))
        gu, dn = ref.mlp.experts.gate_up_proj, ref.mlp.experts.down_proj  # [E, 2I, H], [E, H, I]
        inter = dn.shape[-1]
        for e in range(gu.shape[0]):
            for proj, w in (("gate_proj", gu[e, :inter]), ("up_proj", gu[e, inter:]), ("down_proj", dn[e])):
                name = f"{P}mlp.experts.{e}.{proj}.weight"
                q, s = quantize_fp8(w.numpy(), BLOCK)
                out[name], out[scale_name(name)] = q, s
                w.copy_(torch.from_numpy(dequantize(q, s, np.float64, 0, BLOCK)))
    return out


def propose(
    ref: MtpReference,
    tokens: np.ndarray,
    hidden: np.ndarray,
    n: int,
    last: int,
    target_hidden: np.ndarray,
    share: bool,
) -> dict[str, np.ndarray]:
    """Prefill rows 0..n-1, then k drafts from (last, target_hidden) at row n."""
    toks = [int(t) for t in tokens[1 : n + 1]]
    hid = [torch.from_numpy(h) for h in hidden[:n]]
    tok, h = last, torch.from_numpy(target_hidden)
    drafts, logits, first = [], [], None
    for i in range(K):
        toks.append(tok)
        hid.append(h)
        shared = None
        if share and i > 0:
            shared = first + list(range(n + 1, n + i + 1))
        lg, out, topk = ref.rows(torch.tensor(toks), torch.stack(hid), shared)
        if i == 0:
            first = [int(r) for r in topk[-1].tolist() if r >= 0]
        tok, h = int(torch.argmax(lg)), out.detach()
        drafts.append(tok)
        logits.append(lg.detach().numpy())
    return {
        "drafts": np.array(drafts, np.int64),
        "logits": np.array(logits, np.float64),
        "first_selection": np.array(sorted(first), np.int64),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "glm5next_tiny")
    args = ap.parse_args(argv)
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    tc = Glm5NextTextConfig(**TEXT)
    tc._attn_implementation = "eager"
    tc._experts_implementation = "eager"
    layer = tc.num_hidden_layers  # the MTP layer's index
    ref = MtpReference(tc, layer).double().eval()
    assert ref.self_attn.indexer is not None and ref.self_attn.indexer.index_kpool == 4
    randomise(ref, rng)
    P = f"{PUBLISHED_PREFIX}layers.{layer}."
    tensors = stored_tensors(ref, P)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        f.unlink()
    # A drafter-only copy in the published layout: the MTP layer, the embedding and the head.
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    cfg = Glm5NextConfig(text_config=tc.to_dict()).to_dict()
    cfg["text_config"]["index_share_for_mtp_iteration"] = True  # as published (no transformers key)
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True, default=str) + "\n")

    H, V = tc.hidden_size, tc.vocab_size
    cases: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for n in CONTEXTS:
            tokens = rng.integers(0, V, n + 1)
            # Target hidden rows as the drafter receives them: BF16.
            hidden = bf16_round(rng.standard_normal((n, H)))
            target_hidden = bf16_round(rng.standard_normal(H))
            last = int(rng.integers(0, V))
            cases[f"n{n}_tokens"] = tokens
            cases[f"n{n}_hidden"] = hidden.astype(np.float32)
            cases[f"n{n}_target_hidden"] = target_hidden.astype(np.float32)
            cases[f"n{n}_last"] = np.array(last)
            for share in (False, True):
                r = propose(ref, tokens, hidden, n, last, target_hidden, share)
                for key, v in r.items():
                    cases[f"n{n}_share{int(share)}_{key}"] = v
                top2 = np.sort(r["logits"], -1)[:, -2:]
                print(
                    f"context {n:3d} share {int(share)}: drafts {r['drafts'].tolist()}, "
                    f"top-2 gaps {np.round(top2[:, 1] - top2[:, 0], 4).tolist()}, draft 1 "
                    f"attends {len(r['first_selection'])} rows",
                    flush=True,
                )
    cases["contexts"] = np.array(CONTEXTS)
    cases["k"] = np.array(K)
    np.savez_compressed(out / "reference.npz", **cases)
    import transformers

    (out / "PROVENANCE.json").write_text(
        json.dumps(
            {
                "generator": "tests/oracle/make_glm5next_fixture.py",
                "seed": SEED,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": sys.version.split()[0],
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
