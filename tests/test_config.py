"""ModelConfig <-> config.json: roundtrips, required fields, consistency checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.config import ConfigError, ModelConfig, ParallelConfig, glm5_flash, tiny

REQUIRED = [
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "rms_norm_eps",
    "max_position_embeddings",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
]


@pytest.mark.parametrize("preset", [glm5_flash, tiny], ids=["glm5_flash", "tiny"])
def test_hf_dict_roundtrip(preset, tmp_path):
    cfg = preset()
    d = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(d) == cfg
    # ...and through JSON text on disk, as a checkpoint stores it.
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_json(tmp_path) == cfg
    assert ModelConfig.from_json(tmp_path / "config.json").to_hf_dict() == d


def test_glm5_flash_reference_values():
    d = glm5_flash().to_hf_dict()
    assert d["hidden_size"] == 4096 and d["vocab_size"] == 154880 and d["num_hidden_layers"] == 45
    assert (d["q_lora_rank"], d["kv_lora_rank"], d["qk_nope_head_dim"], d["v_head_dim"]) == (
        1536,
        512,
        256,
        256,
    )
    assert (d["index_n_heads"], d["index_head_dim"], d["index_topk"], d["index_kpool"]) == (32, 128, 2048, 4)
    assert (d["n_routed_experts"], d["num_experts_per_tok"], d["moe_intermediate_size"]) == (288, 8, 2048)
    assert d["qk_rope_head_dim"] == 0 and d["swiglu_limit"] == 10.0


@settings(max_examples=50, deadline=None)
@given(
    hidden=st.integers(1, 512),
    vocab=st.integers(1, 1000),
    layers=st.integers(0, 8),
    heads=st.integers(1, 16),
    kpool=st.integers(1, 8),
    pools=st.integers(1, 16),
    experts=st.integers(1, 64),
    data=st.data(),
)
def test_random_configs_roundtrip(hidden, vocab, layers, heads, kpool, pools, experts, data):
    cfg = tiny(
        hidden_size=hidden,
        vocab_size=vocab,
        num_hidden_layers=layers,
        heads=heads,
        index_kpool=kpool,
        index_topk=kpool * pools,
        n_routed_experts=experts,
        num_experts_per_tok=data.draw(st.integers(1, experts)),
    )
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field_is_named(field):
    d = tiny().to_hf_dict()
    del d[field]
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        ModelConfig.from_hf_dict(d)


def test_optional_fields_have_defaults():
    d = tiny().to_hf_dict()
    for f in (
        "qk_rope_head_dim",
        "n_shared_experts",
        "swiglu_limit",
        "index_kpool_always_select_tail",
        "index_share_for_mtp_iteration",
        "n_group",
        "topk_group",
        "index_max_context",
        "first_k_dense_replace",
        "intermediate_size",
    ):
        del d[f]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.attention.qk_rope_head_dim == 0 and cfg.moe.n_shared_experts == 1
    assert cfg.moe.swiglu_limit == 10.0 and cfg.dsa.always_select_tail
    assert not cfg.dsa.share_for_mtp_iteration
    assert cfg.dsa.max_context == d["max_position_embeddings"]
    assert cfg.first_k_dense_replace == 0


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"index_topk": 7, "index_kpool": 2}, "index_topk"),
        ({"num_experts_per_tok": 9, "n_routed_experts": 8}, "num_experts_per_tok"),
        ({"qk_rope_head_dim": 64}, "rope_theta"),
        ({"qk_rope_head_dim": 64, "rope_theta": 1e4}, "KPool indexer is implemented for NoPE MLA only"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"index_kpool": -4}, "index_kpool"),
        ({"first_k_dense_replace": 1, "intermediate_size": 0}, "intermediate_size"),
    ],
)
def test_inconsistent_field_is_named(changes, field):
    d = {**tiny().to_hf_dict(), **changes}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "value", ["abc", 64.5, None, "false"], ids=["string", "fraction", "null", "string-bool"]
)
def test_wrong_type_is_named(value):
    field = "index_kpool_always_select_tail" if value == "false" else "hidden_size"
    d = {**tiny().to_hf_dict(), field: value}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(d)


def test_overrides_and_parallel():
    d = tiny().to_hf_dict()
    cfg = ModelConfig.from_hf_dict(d, parallel=ParallelConfig(1, 4), dsa_max_context=100)
    assert cfg.parallel == ParallelConfig(1, 4) and cfg.dsa.max_context == 100
    assert tiny().with_parallel(3, 4).parallel.rank == 3
    with pytest.raises(ConfigError, match="rank 4 is outside world_size 4"):
        ParallelConfig(4, 4)
    with pytest.raises(ConfigError, match="world_size"):
        ParallelConfig(0, 0)


def test_no_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)


# ---- the published GLM-5.3-Flash config.json (docs/checkpoint.md) ----------


def published_config() -> dict:
    """config.json as zai-org/GLM-5.3-Flash publishes it: nested, quantization at the top."""
    text = {
        "model_type": "glm5_next_text",
        "num_hidden_layers": 45,
        "num_nextn_predict_layers": 1,
        "hidden_size": 4096,
        "vocab_size": 154880,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "first_k_dense_replace": 3,
        "intermediate_size": 12288,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 256,
        "qk_rope_head_dim": 0,
        "v_head_dim": 256,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_kpool": 4,
        "index_kpool_always_select_tail": True,
        "index_share_for_mtp_iteration": True,
        "n_routed_experts": 288,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "layer_types": ["linear_attention"] * 3 + ["indexed_attention"],
    }
    return {
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "glm5_next_vision", "depth": 24},
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"],
        },
    }


def test_published_nested_config_loads():
    cfg = ModelConfig.from_hf_dict(published_config())
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers) == (4096, 154880, 45)
    assert cfg.mtp_layer_index == 45 and cfg.max_position_embeddings == 1048576
    assert (cfg.dsa.index_kpool, cfg.dsa.index_topk, cfg.dsa.index_n_heads) == (4, 2048, 32)
    assert cfg.dsa.always_select_tail and cfg.dsa.share_for_mtp_iteration
    assert (cfg.moe.n_routed_experts, cfg.moe.swiglu_limit, cfg.moe.routed_scaling_factor) == (288, 10.0, 2.5)
    assert cfg.first_k_dense_replace == 3 and cfg.intermediate_size == 12288


def test_nested_roundtrip_and_flat_equivalence():
    cfg = tiny(always_select_tail=False, share_for_mtp_iteration=True)
    nested = cfg.to_hf_dict(nested=True)
    assert nested["model_type"] == "glm5_next"
    assert nested["text_config"]["model_type"] == "glm5_next_text"
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(nested))) == cfg
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("field", REQUIRED)
def test_text_config_missing_field_is_named(field):
    d = published_config()
    del d["text_config"][field]
    with pytest.raises(ConfigError, match=f"text_config is missing required field '{field}'"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_group": 7, "topk_group": 4}, "n_group 7 does not divide n_routed_experts 288"),
        ({"topk_group": 0}, "topk_group 0 outside 1..n_group 1"),
        ({"qk_rope_head_dim": 64}, "no rope_theta"),
        ({"scoring_func": "softmax"}, "'scoring_func' is 'softmax'"),
        ({"num_nextn_predict_layers": 0}, "no MTP layer"),
        ({"index_kpool": 3}, "index_topk 2048 is not a multiple of index_kpool 3"),
        ({"index_share_for_mtp_iteration": "yes"}, "index_share_for_mtp_iteration"),
    ],
)
def test_published_config_this_block_cannot_serve_is_named(changes, message):
    d = published_config()
    d["text_config"].update(changes)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_text_config_not_an_object():
    with pytest.raises(ConfigError, match="'text_config' must be an object"):
        ModelConfig.from_hf_dict({"model_type": "glm5_next", "text_config": [1]})


def test_tail_and_share_flags_are_honoured_both_ways():
    for tail in (True, False):
        for share in (True, False):
            d = published_config()
            d["text_config"].update(index_kpool_always_select_tail=tail, index_share_for_mtp_iteration=share)
            dsa = ModelConfig.from_hf_dict(d).dsa
            assert (dsa.always_select_tail, dsa.share_for_mtp_iteration) == (tail, share)


def test_legacy_tail_key_of_earlier_flat_checkpoints():
    d = tiny().to_hf_dict()
    del d["index_kpool_always_select_tail"]
    d["index_always_select_tail"] = False
    assert not ModelConfig.from_hf_dict(d).dsa.always_select_tail


def test_swiglu_limit_null_is_no_clamp():
    d = published_config()
    d["text_config"]["swiglu_limit"] = None
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.moe.swiglu_limit == float("inf")
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
