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

import numpy as np


class ConfigError(ValueError):
    """A config field is missing, has the wrong type, or contradicts another field."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's frequency interpolation (DeepSeek-V3.2: factor 40 over 4096 original positions),
    with transformers' names and defaults (``modeling_rope_utils._compute_yarn_parameters``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """RoPE of the MLA's rope dims and of the indexer's first rope dims (one table for both, as
    transformers' ``GlmMoeDsaRotaryEmbedding`` / ``DeepseekV32RotaryEmbedding`` give both).

    ``interleave``: the MLA rotates pairs (2i, 2i + 1) (``rope_interleave``, both GLM-5 and
    DeepSeek-V3.2); ``indexer_interleave``: the indexer does too (GLM-5), else pairs (i, i + d/2)
    (DeepSeek-V3.2). A pair's rotation is stored in place either way: queries and keys share the
    layout, so every dot product is that of transformers' de-interleaved one."""

    theta: float
    interleave: bool = True
    indexer_interleave: bool = True
    yarn: YarnScaling | None = None

    def inv_freq(self, dim: int) -> np.ndarray:
        """The float32 inverse frequencies of ``dim`` rope dims (``dim // 2`` pairs)."""
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        pos_freqs = self.theta**exponents
        extrapolation = 1.0 / pos_freqs
        y = self.yarn
        if y is None:
            return extrapolation.astype(np.float32)
        interpolation = 1.0 / (y.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
        if y.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv.astype(np.float32)

    @property
    def attention_factor(self) -> float:
        """The factor YaRN puts on cos and sin (1 without YaRN)."""
        y = self.yarn
        if y is None:
            return 1.0
        if y.attention_factor is not None:
            return y.attention_factor
        if y.mscale and y.mscale_all_dim:
            return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
        return yarn_mscale(y.factor)

    @property
    def softmax_mscale(self) -> float:
        """YaRN's correction of the attention's softmax scale (mscale(factor, mscale_all_dim)^2,
        DeepSeek's; transformers' ``yarn_apply_mscale``): 1 without YaRN or mscale_all_dim."""
        y = self.yarn
        if y is None or not y.mscale_all_dim:
            return 1.0
        return yarn_mscale(y.factor, y.mscale_all_dim) ** 2


@dataclass(frozen=True)
class AttentionConfig:
    """Absorbed MLA of the decoder block: NoPE (``qk_rope_head_dim`` 0, GLM-5.3-Flash) or with a
    RoPE part of ``qk_rope_head_dim`` dims per head and a shared rope key (GLM-5, DeepSeek-V3.2)."""

    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        mscale = self.rope.softmax_mscale if self.rope is not None else 1.0
        return mscale / float(self.qk_head_dim) ** 0.5


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

    ``per_token`` (no ``index_kpool`` in the config: GLM-5, DeepSeek-V3.2): the plain DSA indexer,
    one key per token, no compression (``index_kpool`` is 1 and there is never a tail); ``rope_dim``
    of its key and query dims, the first ones, are rotated (the model's ``qk_rope_head_dim``).
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    always_select_tail: bool
    max_context: int
    share_for_mtp_iteration: bool = False
    per_token: bool = False
    rope_dim: int = 0

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
    # Group-limited routing (DeepSeek-V3): the experts in n_group groups, the top-k among the
    # topk_group groups of the highest sum of their two best scores.
    n_group: int = 1
    topk_group: int = 1


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
        if a.qk_rope_head_dim < 0 or a.qk_rope_head_dim % 2 or a.qk_rope_head_dim > 128:
            raise ConfigError(f"qk_rope_head_dim is {a.qk_rope_head_dim}: the kernels take an even 0..128")
        if (a.qk_rope_head_dim > 0) != (a.rope is not None):
            raise ConfigError(
                f"qk_rope_head_dim {a.qk_rope_head_dim} with rope parameters "
                f"{'given' if a.rope is not None else 'missing'}: a rope part needs them, NoPE none"
            )
        if a.qk_rope_head_dim and not d.per_token:
            raise ConfigError(
                f"qk_rope_head_dim {a.qk_rope_head_dim} with index_kpool {d.index_kpool}: the KPool "
                "indexer is implemented for NoPE MLA only (RoPE models use the per-token indexer)"
            )
        if d.per_token and (d.index_kpool != 1 or d.always_select_tail):
            raise ConfigError("the per-token indexer has index_kpool 1 and no tail")
        if d.rope_dim not in (0, a.qk_rope_head_dim) or d.rope_dim > d.index_head_dim:
            raise ConfigError(
                f"indexer rope dims {d.rope_dim}: must be 0 or qk_rope_head_dim "
                f"{a.qk_rope_head_dim}, within index_head_dim {d.index_head_dim}"
            )
        if m.n_group < 1 or m.n_routed_experts % m.n_group:
            raise ConfigError(f"n_group {m.n_group} does not divide n_routed_experts {m.n_routed_experts}")
        if not 1 <= m.topk_group <= m.n_group:
            raise ConfigError(f"topk_group {m.topk_group} outside 1..n_group {m.n_group}")
        if m.n_group > 1 and m.n_routed_experts // m.n_group < 2:
            raise ConfigError(
                f"n_group {m.n_group} leaves {m.n_routed_experts // m.n_group} expert per group: a "
                "group's score is the sum of its two best"
            )
        if m.num_experts_per_tok > m.topk_group * (m.n_routed_experts // m.n_group):
            raise ConfigError(
                f"num_experts_per_tok {m.num_experts_per_tok} exceeds the experts of topk_group "
                f"{m.topk_group} groups of {m.n_routed_experts // m.n_group}"
            )
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

        for key, allowed in (
            ("scoring_func", "sigmoid"),
            ("hidden_act", "silu"),
            ("topk_method", "noaux_tc"),
        ):
            if key in d and d[key] != allowed:
                raise ConfigError(
                    f"{where} field {key!r} is {d[key]!r}: the kernels implement {allowed!r} only"
                )
        n_group = opt("n_group", 1)
        # topk_group absent or null: every group kept.
        topk_group = n_group if d.get("topk_group") is None else req("topk_group")
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
        # The KPool indexer (index_kpool present) is GLM-5.3-Flash's (glm5_next); without it the
        # indexer keys every token (GLM-5's glm_moe_dsa, DeepSeek-V3.2).
        model_type = d.get("model_type", "")
        # GLM-5.3-Flash's config must name its pool size (transformers' class default, 16, is not
        # the published 4): there a missing index_kpool is an error, not the per-token indexer.
        per_token = d.get("index_kpool") is None and "glm5_next" not in model_type
        # swiglu_limit null: no clamp. Absent: transformers' Glm5NextTextConfig default (10) for the
        # KPool family; GLM-5 and DeepSeek-V3.2 have no clamp at all.
        if "swiglu_limit" in d and d["swiglu_limit"] is None:
            limit = math.inf
        else:
            limit = opt("swiglu_limit", math.inf if per_token else 10.0, float)
        rope_dim = opt("qk_rope_head_dim", 0)
        rope = _rope_config(d, where, model_type) if rope_dim else None
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
                    rope=rope,
                ),
                dsa=DsaConfig(
                    index_n_heads=req("index_n_heads"),
                    index_head_dim=req("index_head_dim"),
                    index_topk=req("index_topk"),
                    # Where present, read as is: transformers' class default (16) is not the
                    # published value (4).
                    index_kpool=1 if per_token else req("index_kpool"),
                    always_select_tail=False if per_token else opt(tail_key, True, bool),
                    max_context=int(reservation),
                    share_for_mtp_iteration=opt("index_share_for_mtp_iteration", False, bool),
                    per_token=per_token,
                    rope_dim=rope_dim if per_token else 0,
                ),
                moe=MoeConfig(
                    n_routed_experts=req("n_routed_experts"),
                    num_experts_per_tok=req("num_experts_per_tok"),
                    moe_intermediate_size=req("moe_intermediate_size"),
                    n_shared_experts=opt("n_shared_experts", 1),
                    routed_scaling_factor=opt("routed_scaling_factor", 1.0, float),
                    norm_topk_prob=opt("norm_topk_prob", True, bool),
                    swiglu_limit=limit,
                    n_group=n_group,
                    topk_group=topk_group,
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
        }
        renamed = (
            "max_context",
            "always_select_tail",
            "share_for_mtp_iteration",
            "per_token",
            "rope_dim",
            "rope",
        )
        for part in (a, d, m):
            for f in fields(part):
                if f.name not in renamed:
                    out[f.name] = getattr(part, f.name)
        if d.per_token:
            # The per-token indexer is the config without index_kpool (and so without a tail).
            del out["index_kpool"], out["index_kpool_always_select_tail"]
        if a.rope is not None:
            out.update(_rope_hf_fields(a.rope))
        if math.isinf(m.swiglu_limit):
            out["swiglu_limit"] = None  # no clamp (JSON has no infinity)
        if not nested:
            return out
        return {
            "model_type": "glm5_next",
            "architectures": ["Glm5NextForConditionalGeneration"],
            "text_config": out,
        }

    @property
    def rope_inv_freq(self) -> np.ndarray | None:
        """The float32 inverse frequencies of the rope dims (None for NoPE)."""
        a = self.attention
        return a.rope.inv_freq(a.qk_rope_head_dim) if a.rope is not None else None

    def with_parallel(self, rank: int, world_size: int) -> ModelConfig:
        return replace(self, parallel=ParallelConfig(rank=rank, world_size=world_size))

    def describe(self) -> str:
        return json.dumps(asdict(self), indent=1)


_ROPE_TYPES = ("default", "yarn")


def _rope_config(d: Mapping[str, Any], where: str, model_type: str) -> RopeConfig:
    """RoPE from ``rope_parameters`` (transformers 5) or the older ``rope_theta`` + ``rope_scaling``
    (DeepSeek-V3.2's published config.json). A type or scaling the kernels do not implement is an
    error naming the key and its value."""
    params = d.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        key = "rope_scaling"
        if "rope_theta" in d:
            params.setdefault("rope_theta", d["rope_theta"])
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where} field {key!r} must be an object, found {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(
            f"{where} field {key!r} has rope_type {rope_type!r}: the kernels implement {_ROPE_TYPES}"
        )
    if "rope_theta" not in params:
        raise ConfigError(f"{where} has no rope_theta (in {key!r} or at the top)")
    known = {
        "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
        "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate", "partial_rotary_factor",
    }  # fmt: skip
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"{where} field {key!r} has {unknown[0]!r}, which the kernels do not implement")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where} field {key!r}: partial_rotary_factor is not implemented")

    def num(name: str, default: Any = None) -> Any:
        v = params.get(name, default)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"{where} field {key!r} entry {name!r} must be a number, found {v!r}")
        return v

    yarn = None
    if rope_type == "yarn":
        if num("factor") is None or num("original_max_position_embeddings") is None:
            raise ConfigError(
                f"{where} field {key!r}: yarn needs factor and original_max_position_embeddings"
            )
        yarn = YarnScaling(
            factor=float(num("factor")),
            original_max_position_embeddings=int(num("original_max_position_embeddings")),
            beta_fast=float(num("beta_fast") or 32.0),
            beta_slow=float(num("beta_slow") or 1.0),
            mscale=num("mscale"),
            mscale_all_dim=num("mscale_all_dim"),
            attention_factor=num("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )
    for flag in ("rope_interleave", "indexer_rope_interleave"):
        if flag in d and not isinstance(d[flag], bool):
            raise ConfigError(f"{where} field {flag!r} must be bool, found {d[flag]!r}")
    return RopeConfig(
        theta=float(num("rope_theta")),
        interleave=d.get("rope_interleave", True),
        # transformers hard-codes the indexer's layout by model: GLM-5 interleaved, DeepSeek-V3.2 not.
        indexer_interleave=d.get("indexer_rope_interleave", model_type != "deepseek_v32"),
        yarn=yarn,
    )


def _rope_hf_fields(rope: RopeConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": rope.theta}
    if rope.yarn is not None:
        params.update({k: v for k, v in asdict(rope.yarn).items() if v is not None})
        params["rope_type"] = "yarn"
    return {
        "rope_parameters": params,
        "rope_interleave": rope.interleave,
        "indexer_rope_interleave": rope.indexer_interleave,
    }


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


def glm5(max_context: int = 16384) -> ModelConfig:
    """GLM-5.2's MTP block (``glm_moe_dsa``, ``zai-org/GLM-5.2``): MLA with interleaved RoPE, the
    per-token indexer with interleaved RoPE on its first 64 dims, no SwiGLU clamp."""
    return ModelConfig(
        hidden_size=6144,
        vocab_size=154880,
        num_hidden_layers=78,
        rms_norm_eps=1e-5,
        max_position_embeddings=202752,
        attention=AttentionConfig(64, 2048, 512, 192, 64, 256, RopeConfig(theta=8e6)),
        dsa=DsaConfig(32, 128, 2048, 1, False, max_context, per_token=True, rope_dim=64),
        moe=MoeConfig(256, 8, 2048, 1, 2.5, True, math.inf),
        first_k_dense_replace=3,
        intermediate_size=12288,
    )


def deepseek_v32(max_context: int = 16384) -> ModelConfig:
    """DeepSeek-V3.2's MTP block (``deepseek_v32``): YaRN RoPE (factor 40 over 4096, mscale 1),
    the indexer's RoPE half-split, group-limited routing (8 groups, 4 kept)."""
    yarn = YarnScaling(40.0, 4096, 32.0, 1.0, mscale=1.0, mscale_all_dim=1.0)
    return ModelConfig(
        hidden_size=7168,
        vocab_size=129280,
        num_hidden_layers=61,
        rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        attention=AttentionConfig(
            128, 1536, 512, 128, 64, 128, RopeConfig(theta=1e4, indexer_interleave=False, yarn=yarn)
        ),
        dsa=DsaConfig(64, 128, 2048, 1, False, max_context, per_token=True, rope_dim=64),
        moe=MoeConfig(256, 8, 2048, 1, 2.5, True, math.inf, n_group=8, topk_group=4),
        first_k_dense_replace=3,
        intermediate_size=18432,
    )


def tiny_rope(
    *,
    family: str = "glm_moe_dsa",
    hidden_size: int = 64,
    vocab_size: int = 97,
    heads: int = 4,
    index_topk: int = 8,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    max_context: int = 256,
) -> ModelConfig:
    """A CPU-sized config of the RoPE family: ``glm_moe_dsa`` (GLM-5's form) or ``deepseek_v32``
    (YaRN, half-split indexer RoPE, group-limited routing over 4 groups, 2 kept)."""
    ds = family == "deepseek_v32"
    if family not in ("glm_moe_dsa", "deepseek_v32"):
        raise ConfigError(f"tiny_rope: unknown family {family!r}")
    yarn = YarnScaling(4.0, 32, 32.0, 1.0, mscale=1.0, mscale_all_dim=0.7) if ds else None
    rope = RopeConfig(theta=1e4 if ds else 8e6, indexer_interleave=not ds, yarn=yarn)
    return ModelConfig(
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        num_hidden_layers=2,
        rms_norm_eps=1e-6 if ds else 1e-5,
        max_position_embeddings=max_context,
        attention=AttentionConfig(heads, 48, 32, 16, 16, 16, rope),
        dsa=DsaConfig(2, 32, index_topk, 1, False, max_context, per_token=True, rope_dim=16),
        moe=MoeConfig(
            n_routed_experts,
            num_experts_per_tok,
            24,
            1,
            2.5,
            True,
            math.inf,
            n_group=4 if ds else 1,
            topk_group=2 if ds else 1,
        ),
        first_k_dense_replace=1,
        intermediate_size=80,
    )
