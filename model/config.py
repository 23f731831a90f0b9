"""Model, DSA, MoE and parallel configuration, read from a Hugging Face ``config.json``.

Every size in the project comes from one of these dataclasses; nothing is sized by a literal.
Field names follow the Hugging Face names of GLM-5 / DeepSeek-V3.2 configs where one exists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config field is missing, has the wrong type, or contradicts another field."""


@dataclass(frozen=True)
class AttentionConfig:
    """Absorbed NoPE MLA of the decoder block."""

    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return 1.0 / float(self.qk_head_dim) ** 0.5


@dataclass(frozen=True)
class DsaConfig:
    """KPool lightning indexer of DeepSeek Sparse Attention.

    ``max_context`` is the indexer cache reservation in tokens (what a serving engine reserves per
    sequence); ``max_dsa_context`` in ``model.dsa`` rounds it down to whole pools and clamps it to
    the top-k kernel's capacity.

    ``always_select_tail`` (``index_kpool_always_select_tail``): the rows of the incomplete tail
    pool are attended besides the selected pools. Without it a row attends complete pools only,
    and a row with no complete pool attends nothing (its attention output is zero).
    ``share_for_mtp_iteration`` (``index_share_for_mtp_iteration``): drafts 2..k of one propose
    reuse draft 1's pool selection (``model.dsa``, "Shared selection").
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    always_select_tail: bool
    max_context: int
    share_for_mtp_iteration: bool = False

    @property
    def topk_pools(self) -> int:
        return self.index_topk // self.index_kpool


@dataclass(frozen=True)
class MoeConfig:
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process sits among the ranks that run ``propose`` in lockstep."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")


@dataclass(frozen=True)
class ModelConfig:
    """The whole model family: target layers plus the MTP block at index ``num_hidden_layers``."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    attention: AttentionConfig
    dsa: DsaConfig
    moe: MoeConfig
    # Target only: the first ``first_k_dense_replace`` layers use a dense SwiGLU MLP of this width.
    first_k_dense_replace: int = 0
    intermediate_size: int = 0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def mtp_layer_index(self) -> int:
        return self.num_hidden_layers

    def validate(self) -> None:
        a, d, m = self.attention, self.dsa, self.moe
        positive = {
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_attention_heads": a.num_attention_heads,
            "q_lora_rank": a.q_lora_rank,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "v_head_dim": a.v_head_dim,
            "index_n_heads": d.index_n_heads,
            "index_head_dim": d.index_head_dim,
            "index_topk": d.index_topk,
            "index_kpool": d.index_kpool,
            "max_context": d.max_context,
            "n_routed_experts": m.n_routed_experts,
            "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if a.qk_rope_head_dim != 0:
            raise ConfigError(f"qk_rope_head_dim is {a.qk_rope_head_dim}: this block is NoPE MLA and needs 0")
        if d.index_topk % d.index_kpool:
            raise ConfigError(f"index_topk {d.index_topk} is not a multiple of index_kpool {d.index_kpool}")
        if m.num_experts_per_tok > m.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok {m.num_experts_per_tok} exceeds n_routed_experts {m.n_routed_experts}"
            )
        if m.n_shared_experts not in (0, 1):
            raise ConfigError(f"n_shared_experts must be 0 or 1, got {m.n_shared_experts}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.first_k_dense_replace and self.intermediate_size <= 0:
            raise ConfigError("first_k_dense_replace > 0 needs a positive intermediate_size")
        if not m.swiglu_limit > 0:
            raise ConfigError(f"swiglu_limit must be > 0, got {m.swiglu_limit}")

    # ---- Hugging Face config.json -------------------------------------------------------------

    @classmethod
    def from_hf_dict(
        cls,
        d: Mapping[str, Any],
        *,
        parallel: ParallelConfig | None = None,
        dsa_max_context: int | None = None,
    ) -> ModelConfig:
        """Build from a ``config.json`` mapping. A missing required field names itself.

        Two forms: flat (every field at the top, as GLM-5 and this project's own checkpoints
        store it), and nested as GLM-5.3-Flash is published (``model_type: glm5_next``, the text
        model's fields under ``text_config``). ``dsa_max_context`` overrides the indexer
        reservation; otherwise ``index_max_context`` from the file, else
        ``max_position_embeddings``.
        """
        where = "config.json"
        if "text_config" in d:
            d = d["text_config"]
            where = "config.json text_config"
            if not isinstance(d, Mapping):
                raise ConfigError(
                    f"config.json field 'text_config' must be an object, found {type(d).__name__}"
                )

        def typed(name: str, v: Any, kind: type) -> Any:
            # A silent int("64.5") or bool("false") would size buffers from a typo; refuse instead.
            ok = {
                int: isinstance(v, int) and not isinstance(v, bool),
                float: isinstance(v, (int, float)) and not isinstance(v, bool),
                bool: isinstance(v, bool),
            }[kind]
            if not ok:
                raise ConfigError(
                    f"{where} field {name!r} must be {kind.__name__}, found {v!r} ({type(v).__name__})"
                )
            return kind(v)

        def req(name: str, kind: type = int) -> Any:
            if name not in d:
                raise ConfigError(f"{where} is missing required field {name!r}")
            return typed(name, d[name], kind)

        def opt(name: str, default: Any, kind: type = int) -> Any:
            return typed(name, d[name], kind) if name in d else default

        # Group-limited routing (DeepSeek-V3's n_group experts groups, topk_group of them kept)
        # is not what this block's router does: refuse it rather than route over all experts.
        n_group, topk_group = opt("n_group", 1), opt("topk_group", opt("n_group", 1))
        if n_group != 1:
            raise ConfigError(
                f"{where} field 'n_group' is {n_group}: this block routes over all "
                "experts at once and needs n_group 1 (no group-limited routing)"
            )
        if topk_group < n_group:
            raise ConfigError(
                f"{where} field 'topk_group' is {topk_group}, below n_group "
                f"{n_group}: group-limited routing is not implemented"
            )
        if opt("num_nextn_predict_layers", 1) < 1:
            raise ConfigError(
                f"{where} field 'num_nextn_predict_layers' is "
                f"{d['num_nextn_predict_layers']}: the checkpoint has no MTP layer"
            )
        # The published name, then the name this project wrote before it followed the published
        # config (flat checkpoints written by earlier versions).
        tail_key = (
            "index_kpool_always_select_tail"
            if "index_kpool_always_select_tail" in d
            else "index_always_select_tail"
        )
        # swiglu_limit null: no clamp; absent: transformers' Glm5NextTextConfig default, 10.
        limit = (
            math.inf
            if "swiglu_limit" in d and d["swiglu_limit"] is None
            else opt("swiglu_limit", 10.0, float)
        )
        max_pos = req("max_position_embeddings")
        reservation = dsa_max_context if dsa_max_context is not None else opt("index_max_context", max_pos)
        try:
            return cls(
                hidden_size=req("hidden_size"),
                vocab_size=req("vocab_size"),
                num_hidden_layers=req("num_hidden_layers"),
                rms_norm_eps=req("rms_norm_eps", float),
                max_position_embeddings=max_pos,
                attention=AttentionConfig(
                    num_attention_heads=req("num_attention_heads"),
                    q_lora_rank=req("q_lora_rank"),
                    kv_lora_rank=req("kv_lora_rank"),
                    qk_nope_head_dim=req("qk_nope_head_dim"),
                    qk_rope_head_dim=opt("qk_rope_head_dim", 0),
                    v_head_dim=req("v_head_dim"),
                ),
                dsa=DsaConfig(
                    index_n_heads=req("index_n_heads"),
                    index_head_dim=req("index_head_dim"),
                    index_topk=req("index_topk"),
                    # Required: transformers' class default (16) is not the published value (4).
                    index_kpool=req("index_kpool"),
                    always_select_tail=opt(tail_key, True, bool),
                    max_context=int(reservation),
                    share_for_mtp_iteration=opt("index_share_for_mtp_iteration", False, bool),
                ),
                moe=MoeConfig(
                    n_routed_experts=req("n_routed_experts"),
                    num_experts_per_tok=req("num_experts_per_tok"),
                    moe_intermediate_size=req("moe_intermediate_size"),
                    n_shared_experts=opt("n_shared_experts", 1),
                    routed_scaling_factor=opt("routed_scaling_factor", 1.0, float),
                    norm_topk_prob=opt("norm_topk_prob", True, bool),
                    swiglu_limit=limit,
                ),
                first_k_dense_replace=opt("first_k_dense_replace", 0),
                intermediate_size=opt("intermediate_size", 0),
                parallel=parallel or ParallelConfig(),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{where} has a field of the wrong type: {e}") from e

    @classmethod
    def from_json(cls, path: str | Path, **kw: Any) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object, found {type(raw).__name__}")
        return cls.from_hf_dict(raw, **kw)

    def to_hf_dict(self, *, nested: bool = False) -> dict[str, Any]:
        """The flat ``config.json`` (``glm_moe_dsa``), or with ``nested`` the published form:
        ``model_type: glm5_next`` with the text model's fields under ``text_config``."""
        a, d, m = self.attention, self.dsa, self.moe
        out: dict[str, Any] = {
            "model_type": "glm5_next_text" if nested else "glm_moe_dsa",
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_nextn_predict_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "first_k_dense_replace": self.first_k_dense_replace,
            "intermediate_size": self.intermediate_size,
            "index_max_context": d.max_context,
            "index_kpool_always_select_tail": d.always_select_tail,
            "index_share_for_mtp_iteration": d.share_for_mtp_iteration,
            "n_group": 1,
            "topk_group": 1,
        }
        renamed = ("max_context", "always_select_tail", "share_for_mtp_iteration")
        for part in (a, d, m):
            for f in fields(part):
                if f.name not in renamed:
                    out[f.name] = getattr(part, f.name)
        if math.isinf(m.swiglu_limit):
            out["swiglu_limit"] = None  # no clamp (JSON has no infinity)
        if not nested:
            return out
        return {
            "model_type": "glm5_next",
            "architectures": ["Glm5NextForConditionalGeneration"],
            "text_config": out,
        }

    def with_parallel(self, rank: int, world_size: int) -> ModelConfig:
        return replace(self, parallel=ParallelConfig(rank=rank, world_size=world_size))

    def describe(self) -> str:
        return json.dumps(asdict(self), indent=1)


def glm5_flash(max_context: int = 16384) -> ModelConfig:
    """GLM-5.3-Flash MTP block at the shapes of its published config (``zai-org/GLM-5.3-Flash``)."""
    return ModelConfig(
        hidden_size=4096,
        vocab_size=154880,
        num_hidden_layers=45,
        rms_norm_eps=1e-5,
        max_position_embeddings=202752,
        attention=AttentionConfig(64, 1536, 512, 256, 0, 256),
        dsa=DsaConfig(32, 128, 2048, 4, True, max_context, share_for_mtp_iteration=True),
        moe=MoeConfig(288, 8, 2048, 1, 2.5, True, 10.0),
        first_k_dense_replace=1,
        intermediate_size=10240,
    )


def tiny(
    *,
    hidden_size: int = 64,
    vocab_size: int = 97,
    num_hidden_layers: int = 2,
    heads: int = 4,
    index_topk: int = 8,
    index_kpool: int = 2,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    max_context: int = 256,
    always_select_tail: bool = True,
    share_for_mtp_iteration: bool = False,
) -> ModelConfig:
    """A config of the same form, small enough for a CPU test; awkward sizes on purpose."""
    return ModelConfig(
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        num_hidden_layers=num_hidden_layers,
        rms_norm_eps=1e-5,
        max_position_embeddings=max_context,
        attention=AttentionConfig(heads, 48, 32, 16, 0, 16),
        dsa=DsaConfig(
            2, 16, index_topk, index_kpool, always_select_tail, max_context, share_for_mtp_iteration
        ),
        moe=MoeConfig(n_routed_experts, num_experts_per_tok, 24, 1, 2.5, True, 10.0),
        first_k_dense_replace=1,
        intermediate_size=80,
    )
