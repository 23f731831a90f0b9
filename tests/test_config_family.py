"""Configs of the RoPE family (GLM-5's ``glm_moe_dsa``, DeepSeek-V3.2's ``deepseek_v32``) as
their published config.json files state them, and the refusals of what the kernels do not
implement (issue 20)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from model.config import ConfigError, ModelConfig, deepseek_v32, glm5, tiny_rope
from model.dsa import DsaSizingError, check_served_context, max_dsa_context
from model.slot_pools import slot_bytes_by_kind


def glm5_published() -> dict:
    """The fields of zai-org/GLM-5.2's config.json the drafter reads (flat, no index_kpool, no
    swiglu_limit, rope_parameters)."""
    return {
        "model_type": "glm_moe_dsa",
        "hidden_size": 6144,
        "vocab_size": 154880,
        "num_hidden_layers": 78,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 202752,
        "first_k_dense_replace": 3,
        "intermediate_size": 12288,
        "num_attention_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0},
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
    }


def deepseek_published() -> dict:
    """deepseek-ai/DeepSeek-V3.2's config.json: rope_theta and rope_scaling at the top level."""
    return {
        "model_type": "deepseek_v32",
        "hidden_size": 7168,
        "vocab_size": 129280,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "first_k_dense_replace": 3,
        "intermediate_size": 18432,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "n_group": 8,
        "topk_group": 4,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
    }


def test_glm5_published_config():
    cfg = ModelConfig.from_hf_dict(glm5_published(), dsa_max_context=16384)
    assert cfg == glm5()
    a, d, m = cfg.attention, cfg.dsa, cfg.moe
    assert a.rope.theta == 8e6 and a.rope.interleave and a.rope.indexer_interleave and a.rope.yarn is None
    assert d.per_token and d.index_kpool == 1 and not d.always_select_tail and d.rope_dim == 64
    assert math.isinf(m.swiglu_limit) and (m.n_group, m.topk_group) == (1, 1)
    assert a.softmax_scale == pytest.approx(1 / math.sqrt(256))


def test_deepseek_published_config():
    cfg = ModelConfig.from_hf_dict(deepseek_published(), dsa_max_context=16384)
    assert cfg == deepseek_v32()
    a, m = cfg.attention, cfg.moe
    y = a.rope.yarn
    assert (y.factor, y.original_max_position_embeddings, y.mscale, y.mscale_all_dim) == (40, 4096, 1, 1)
    assert a.rope.interleave and not a.rope.indexer_interleave
    assert (m.n_group, m.topk_group) == (8, 4)
    # DeepSeek's softmax scale: qk_head_dim^-0.5 * (0.1 ln 40 + 1)^2; cos / sin unscaled (mscale
    # equals mscale_all_dim).
    assert a.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192), rel=1e-12)
    assert a.rope.attention_factor == 1.0


def transformers_inv_freq(theta: float, dim: int, yarn: dict | None) -> np.ndarray:
    """transformers' _compute_default_rope_parameters / _compute_yarn_parameters, in float32 as
    torch computes them (written out independently of model.config)."""
    f32 = np.float32
    pos = (f32(theta) ** (np.arange(0, dim, 2).astype(f32) / f32(dim))).astype(f32)
    extra = (f32(1) / pos).astype(f32)
    if yarn is None:
        return extra
    inter = (f32(1) / (f32(yarn["factor"]) * pos)).astype(f32)

    def corr(rot):
        return (
            dim
            * math.log(yarn["original_max_position_embeddings"] / (rot * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = math.floor(corr(yarn["beta_fast"])), math.ceil(corr(yarn["beta_slow"]))
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - low) / f32(high - low), 0, 1).astype(f32)
    ef = f32(1) - ramp
    return (inter * (1 - ef) + extra * ef).astype(f32)


@pytest.mark.parametrize("which", ["glm5", "deepseek"])
def test_inv_freq_is_transformers(which):
    d = glm5_published() if which == "glm5" else deepseek_published()
    cfg = ModelConfig.from_hf_dict(d)
    yarn = d.get("rope_scaling")
    theta = d["rope_parameters"]["rope_theta"] if which == "glm5" else d["rope_theta"]
    want = transformers_inv_freq(theta, 64, yarn)
    got = cfg.rope_inv_freq
    assert got.dtype == np.float32 and got.shape == (32,)
    # float64 then rounded against torch's float32 pow: a few ulp.
    np.testing.assert_allclose(got, want, rtol=2e-6)
    if yarn:  # the ramp really mixes: the first pairs extrapolate, the last interpolate
        assert got[0] == pytest.approx(want[0]) and got[-1] == pytest.approx(
            1 / (40 * 10000 ** (62 / 64)), rel=1e-5
        )


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_presets_round_trip(family):
    for cfg in (tiny_rope(family=family), glm5() if family == "glm_moe_dsa" else deepseek_v32()):
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'dynamic'",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "low_freq_factor": 1}},
            "'low_freq_factor'",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn needs factor"),
        ({"rope_parameters": {"rope_type": "default"}}, "no rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "'rope_theta' must be a number"),
        ({"rope_interleave": "yes"}, "'rope_interleave' must be bool"),
        ({"scoring_func": "softmax"}, "'scoring_func' is 'softmax'"),
        ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu'"),
        ({"n_group": 3}, "n_group 3 does not divide n_routed_experts 256"),
        ({"n_group": 8, "topk_group": 9}, "topk_group 9 outside 1..n_group 8"),
        ({"n_group": 256, "topk_group": 8}, "leaves 1 expert per group"),
        ({"n_group": 64, "topk_group": 1}, "num_experts_per_tok 8 exceeds the experts of topk_group 1"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim is 63"),
    ],
)
def test_what_the_kernels_do_not_implement_is_named(change, message):
    d = {**glm5_published(), **change}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_two_experts_per_group_are_enough():
    cfg = ModelConfig.from_hf_dict({**glm5_published(), "n_group": 128, "topk_group": 4})
    assert (cfg.moe.n_group, cfg.moe.topk_group) == (128, 4)


def test_glm5_next_still_requires_index_kpool():
    """The KPool family must name its pool size: a glm5_next config without it is refused, not
    read as the per-token indexer."""
    d = tiny_rope().to_hf_dict(nested=True)
    with pytest.raises(ConfigError, match="missing required field 'index_kpool'"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("preset, longest", [(glm5, 202752), (deepseek_v32, 163840)])
def test_the_per_token_indexer_reaches_the_models_whole_context(preset, longest):
    """Every token is its own pool: the selection ranks up to 262,144 of them, past both models'
    max_position_embeddings, and a sequence at the longest context holds its latent (FP8 + scale),
    its rope key (BF16) and its FP8 indexer key (+ scale) per row and no BF16 keys or gates."""
    cfg = preset(max_context=longest)
    assert cfg.max_position_embeddings == longest
    assert check_served_context(longest, cfg.dsa) == max_dsa_context(cfg.dsa) == longest
    with pytest.raises(DsaSizingError, match="past the"):
        check_served_context(longest + 1, cfg.dsa)
    got = slot_bytes_by_kind(cfg.dsa, 512, longest, rope_dim=64)
    assert got == {
        "latent_kv": longest * (512 + 4),
        "rope_keys": longest * 64 * 2,
        "block_table": 2 * (longest // 16) * 4,
        "indexer_keys": 0,
        "indexer_gates": 0,
        "pool_keys": longest * 128,
        "pool_scales": longest * 4,
    }
    # GLM-5: 157.4 MB a sequence at 202,752 tokens; DeepSeek-V3.2: 127.2 MB at 163,840.
    assert sum(got.values()) == {202752: 157_436_928, 163840: 127_221_760}[longest]
