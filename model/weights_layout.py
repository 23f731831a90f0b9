"""The tensors a checkpoint must hold, as data: name -> (shape, dtype, how to initialise).

Pure functions of a ``ModelConfig``; no I/O. The loader validates a checkpoint against these
tables, the random-checkpoint writer generates from them, and docs/checkpoint.md describes them.
Shapes are [out, in] as in Hugging Face checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from model.config import ModelConfig


class Init(str, Enum):
    """How ``random_checkpoint`` draws a tensor (the layout says what each tensor *is*)."""

    LINEAR = "linear"  # a projection [out, in]: std ~ 1/sqrt(in)
    HEAD = "head"  # the vocabulary projection: as LINEAR, with a gain for a clear argmax
    EMBEDDING = "embedding"  # rows of O(1) entries
    NORM = "norm"  # a norm's weight: near 1
    SMALL = "small"  # biases, positional offsets: near 0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name of the logical (loaded) dtype: "BF16" or "F32"
    init: Init
    # Stored dtypes that also stand for it, converted at load (beside FP8 block-scaled weights,
    # which any 2-D BF16 tensor may be): a BF16 release may store norms and the router in F32.
    accept: tuple[str, ...] = ()

    @property
    def fan_in(self) -> int:
        return self.shape[-1]


Layout = dict[str, TensorSpec]

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


def mtp_prefix(cfg: ModelConfig) -> str:
    return f"model.layers.{cfg.mtp_layer_index}."


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


class _Builder:
    def __init__(self) -> None:
        self.layout: Layout = {}

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        init: Init,
        dtype: str = "BF16",
        accept: tuple[str, ...] | None = None,
    ) -> None:
        assert name not in self.layout, name
        if accept is None:
            accept = ("F32",) if init is Init.NORM else ()
        self.layout[name] = TensorSpec(name, tuple(int(s) for s in shape), dtype, init, accept)


def _attention(b: _Builder, cfg: ModelConfig, p: str) -> None:
    a, d, h = cfg.attention, cfg.dsa, cfg.hidden_size
    L, N = Init.LINEAR, Init.NORM
    b.add(p + "self_attn.q_a_proj.weight", (a.q_lora_rank, h), L)
    b.add(p + "self_attn.q_a_layernorm.weight", (a.q_lora_rank,), N)
    b.add(p + "self_attn.q_b_proj.weight", (a.num_attention_heads * a.qk_head_dim, a.q_lora_rank), L)
    b.add(p + "self_attn.kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, h), L)
    b.add(p + "self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,), N)
    b.add(
        p + "self_attn.kv_b_proj.weight",
        (a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        L,
    )
    b.add(p + "self_attn.o_proj.weight", (h, a.num_attention_heads * a.v_head_dim), L)
    ix = p + "self_attn.indexer."
    b.add(ix + "wq_b.weight", (d.index_n_heads * d.index_head_dim, a.q_lora_rank), L)
    b.add(ix + "wk.weight", (d.index_head_dim, h), L)
    b.add(ix + "k_norm.weight", (d.index_head_dim,), N)
    b.add(ix + "k_norm.bias", (d.index_head_dim,), Init.SMALL, accept=("F32",))
    b.add(ix + "weights_proj.weight", (d.index_n_heads, h), L)
    if not d.per_token:
        # No ".weight" suffix: parameters of the indexer itself, not of a submodule (the published
        # names, transformers' Glm5NextTextIndexer). The per-token indexer has neither.
        b.add(ix + "index_kpool_compress_gate", (d.index_head_dim, h), L)
        b.add(ix + "index_kpool_compress_ape", (d.index_kpool, d.index_head_dim), Init.SMALL)


def _swiglu(b: _Builder, p: str, hidden: int, inter: int) -> None:
    b.add(p + "gate_proj.weight", (inter, hidden), Init.LINEAR)
    b.add(p + "up_proj.weight", (inter, hidden), Init.LINEAR)
    b.add(p + "down_proj.weight", (hidden, inter), Init.LINEAR)


def _moe(b: _Builder, cfg: ModelConfig, p: str) -> None:
    m, h = cfg.moe, cfg.hidden_size
    b.add(p + "mlp.gate.weight", (m.n_routed_experts, h), Init.LINEAR, accept=("F32",))
    # The only F32 tensor: the router adds it to sigmoid scores of O(1e-2) spacing, where BF16
    # would round the bias away.
    b.add(p + "mlp.gate.e_score_correction_bias", (m.n_routed_experts,), Init.SMALL, "F32")
    for e in range(m.n_routed_experts):
        _swiglu(b, p + f"mlp.experts.{e}.", h, m.moe_intermediate_size)
    if m.n_shared_experts:
        # Added with weight 1: no shared_expert_gate (the published checkpoints have none).
        _swiglu(b, p + "mlp.shared_experts.", h, m.moe_intermediate_size * m.n_shared_experts)


def _decoder_layer(b: _Builder, cfg: ModelConfig, p: str, dense: bool) -> None:
    h = cfg.hidden_size
    b.add(p + "input_layernorm.weight", (h,), Init.NORM)
    _attention(b, cfg, p)
    b.add(p + "post_attention_layernorm.weight", (h,), Init.NORM)
    if dense:
        _swiglu(b, p + "mlp.", h, cfg.intermediate_size)
    else:
        _moe(b, cfg, p)


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of one routed expert of a layer."""
    p = f"{layer_prefix(layer)}mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def mtp_layout(cfg: ModelConfig) -> Layout:
    """The tensors of the MTP block (all required), in checkpoint order."""
    p, h = mtp_prefix(cfg), cfg.hidden_size
    b = _Builder()
    b.add(p + "enorm.weight", (h,), Init.NORM)
    b.add(p + "hnorm.weight", (h,), Init.NORM)
    b.add(p + "eh_proj.weight", (h, 2 * h), Init.LINEAR)
    _decoder_layer(b, cfg, p, dense=False)
    b.add(p + "shared_head.norm.weight", (h,), Init.NORM)
    return b.layout


def mtp_shared_aliases(cfg: ModelConfig) -> dict[str, str]:
    """The MTP block's optional own copies of the head and embedding -> the target's tensor.

    GLM-4.5 stores both in the block; GLM-5 stores neither and shares the target's.
    """
    p = mtp_prefix(cfg)
    return {p + "shared_head.head.weight": LM_HEAD, p + "embed_tokens.weight": EMBED}


def shared_layout(cfg: ModelConfig) -> Layout:
    """The target's embedding and head, which the MTP block reads too."""
    b = _Builder()
    b.add(EMBED, (cfg.vocab_size, cfg.hidden_size), Init.EMBEDDING)
    b.add(LM_HEAD, (cfg.vocab_size, cfg.hidden_size), Init.HEAD)
    return b.layout


def mtp_optional_layout(cfg: ModelConfig) -> Layout:
    """The alias names with the shapes of the tensors they stand for."""
    shared = shared_layout(cfg)
    return {
        name: TensorSpec(name, shared[target].shape, shared[target].dtype, shared[target].init)
        for name, target in mtp_shared_aliases(cfg).items()
    }


def target_layout(cfg: ModelConfig) -> Layout:
    """Every tensor of the target model (layers 0 .. num_hidden_layers-1), in checkpoint order."""
    b = _Builder()
    b.add(EMBED, (cfg.vocab_size, cfg.hidden_size), Init.EMBEDDING)
    for i in range(cfg.num_hidden_layers):
        _decoder_layer(b, cfg, layer_prefix(i), dense=i < cfg.first_k_dense_replace)
    b.add(FINAL_NORM, (cfg.hidden_size,), Init.NORM)
    b.add(LM_HEAD, (cfg.vocab_size, cfg.hidden_size), Init.HEAD)
    return b.layout


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


# The projections GLM-5.3-Flash publishes as F8_E4M3 with 128x128 block scales (docs/checkpoint.md).
_PUBLISHED_FP8 = (
    ".mlp.experts.",
    ".mlp.shared_experts.",
    ".self_attn.q_a_proj.",
    ".self_attn.q_b_proj.",
    ".self_attn.kv_a_proj_with_mqa.",
    ".self_attn.o_proj.",
)


def is_published_fp8(name: str) -> bool:
    return name.endswith(".weight") and any(part in name for part in _PUBLISHED_FP8)
