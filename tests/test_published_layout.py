"""The published GLM-5.3-Flash checkpoint layout (docs/checkpoint.md): nested
config.json, ``model.language_model.`` names, bare KPool parameters, FP8 block-scaled projections
with F32 ``weight_scale_inv``, F32 norms and router, drafter-only copies; and its bad inputs, each
refused by name before any device memory is taken."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model.checkpoint import (
    Checkpoint,
    CheckpointError,
    mtp_tensors,
    random_checkpoint,
    random_tensors,
    target_tensors,
    write_checkpoint,
)
from model.checkpoint.fp8 import scale_name, scale_shape
from model.checkpoint.naming import NameLayout, disk_name, logical_name
from model.config import ConfigError, tiny
from model.proposer import MtpProposer, ProposerOptions
from model.weights_layout import LM_HEAD, is_published_fp8, mtp_layout, mtp_prefix
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import upload_rows

CFG = tiny(index_topk=8, index_kpool=2, max_context=64)
# Several scale blocks per projection at tiny shapes: a block size the FP8 kernels do not apply, so
# these proposers dequantise (native_fp8=False); tests/test_native_fp8.py covers native FP8.
BLOCK = (16, 16)
PUB = NameLayout.PUBLISHED
P = mtp_prefix(CFG)  # logical
DP = disk_name(P, PUB)  # as stored


def published(path: Path, **kw) -> Checkpoint:
    opts = {
        "include_target": False,
        "fp8_published": True,
        "fp8_block": BLOCK,
        "progress": False,
        "layout": PUB,
        **kw,
    }
    return Checkpoint(random_checkpoint(path, CFG, 3, **opts))


def tensors_of(**kw) -> dict[str, np.ndarray]:
    out = {}
    for t in random_tensors(CFG, 3, include_target=False, fp8_published=True, fp8_block=BLOCK, **kw):
        out[t.name] = np.concatenate([c.reshape(-1) for c in t.chunks()]).reshape(t.shape)
    return out


def write_published(path: Path, tensors: dict[str, np.ndarray]) -> Checkpoint:
    q = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}}
    return Checkpoint(write_checkpoint(path, CFG, tensors, extra_config=q, layout=PUB))


def drafts_of(tensors, cfg=CFG) -> list[list[int]]:
    """Drafts of a host proposer over fixed inputs: three proposes after a 23-row prefill."""
    gpu = HostBackend()
    prop = MtpProposer(gpu, cfg, tensors, ProposerOptions(served_max_seq_len=64, native_fp8=False))
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, cfg.vocab_size, 24)
    hid = rng.standard_normal((26, cfg.hidden_size)).astype(BF16)
    st = prop.alloc_state()
    prop.prefill_drafter(st, tokens, upload_rows(gpu, hid[:23]))
    out = [prop.propose(st, int(tokens[-1]), upload_rows(gpu, hid[23 + i : 24 + i]), 23, 3) for i in range(3)]
    prop.close()
    return out


def test_names_dtypes_and_config_on_disk(tmp_path):
    c = published(tmp_path / "p")
    cfg = json.loads((c.path / "config.json").read_text())
    assert cfg["model_type"] == "glm5_next" and cfg["text_config"]["model_type"] == "glm5_next_text"
    assert cfg["quantization_config"]["weight_block_size"] == list(BLOCK)
    assert c.layout is PUB and c.config == CFG
    names = c.names()
    assert all(n.startswith("model.language_model.") or n == LM_HEAD for n in names)
    assert "model.language_model.embed_tokens.weight" in names
    ix = DP + "self_attn.indexer."
    assert c.info(ix + "index_kpool_compress_gate").shape == (16, 64)  # [idim, H], no .weight
    assert c.info(ix + "index_kpool_compress_ape").shape == (2, 16)  # [kpool, idim]
    assert not any("shared_expert_gate" in n for n in names)
    fp8 = [n for n in names if c.info(n).dtype == "F8_E4M3"]
    assert fp8 and all(is_published_fp8(logical_name(n, PUB)) for n in fp8)
    for kind in (
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "o_proj",
        "shared_experts.up_proj",
        "experts.3.down_proj",
    ):
        name = next(n for n in fp8 if kind in n)
        s = c.info(scale_name(name))
        assert s.dtype == "F32" and s.shape == scale_shape(c.info(name).shape, BLOCK)
    for bf16 in (
        "self_attn.kv_b_proj.weight",
        "self_attn.indexer.wq_b.weight",
        "mlp.gate.weight",
        "eh_proj.weight",
        "enorm.weight",
    ):
        assert c.info(DP + bf16).dtype == "BF16"
    assert c.info(DP + "mlp.gate.e_score_correction_bias").dtype == "F32"


def test_logical_names_map_both_ways():
    for name in (*mtp_layout(CFG), "model.embed_tokens.weight", LM_HEAD, "model.norm.weight"):
        assert logical_name(disk_name(name, PUB), PUB) == name
        assert disk_name(name, NameLayout.FLAT) == name
    assert logical_name("model.visual.blocks.0.attn.qkv.weight", PUB) is None


def test_published_and_flat_copies_draft_the_same(tmp_path):
    """The same weights, FP8 dequantised at load, in either layout: identical drafts."""
    pub = mtp_tensors(published(tmp_path / "p"))
    loaded = pub.load()
    flat = Checkpoint(write_checkpoint(tmp_path / "f", CFG, loaded))
    assert flat.layout is NameLayout.FLAT
    d_pub, d_flat = drafts_of(pub), drafts_of(mtp_tensors(flat))
    assert d_pub == d_flat
    assert len({tuple(d) for d in d_pub}) > 1  # the inputs matter


def test_drafter_only_copy_builds_a_proposer(tmp_path):
    """A copy of the shards holding the MTP layer, the embedding and the head, with the full
    index: the drafter builds; the target names what its absent shards hold."""
    d = random_checkpoint(
        tmp_path / "full",
        CFG,
        3,
        fp8_published=True,
        fp8_block=BLOCK,
        layout=PUB,
        progress=False,
        max_shard_bytes=40_000,
    )
    full = Checkpoint(d)
    needed = {full.disk_name(n) for n in mtp_layout(CFG)} | {
        full.disk_name("model.embed_tokens.weight"),
        LM_HEAD,
    }
    needed |= {scale_name(n) for n in needed if full.has(scale_name(n))}
    keep = {full.where(n) for n in needed}
    gone = [f for f in full.shards() if f not in keep]
    assert gone, "the target's layers must fill shards of their own"
    for f in gone:
        (d / f).unlink()
    copy = Checkpoint(d)
    assert drafts_of(mtp_tensors(copy)) == drafts_of(mtp_tensors(full))
    with pytest.raises(
        CheckpointError,
        match=r"model\.language_model\.layers\.0\..* is missing.*"
        r"which is not in the directory",
    ):
        target_tensors(copy)


def _bad(tmp_path, edit) -> Checkpoint:
    t = tensors_of()
    edit(t)
    return write_published(tmp_path / "bad", t)


Q_A = P + "self_attn.q_a_proj.weight"
CASES = {
    "missing": (
        lambda t: t.pop(P + "self_attn.indexer.index_kpool_compress_gate"),
        rf"tensor {DP}self_attn\.indexer\.index_kpool_compress_gate is missing",
    ),
    "shape": (
        lambda t: t.update({P + "eh_proj.weight": t[P + "eh_proj.weight"][:, :64].copy()}),
        rf"{DP}eh_proj\.weight: expected shape \[64, 128\], found \[64, 64\]",
    ),
    "dtype": (
        lambda t: t.update(
            {P + "mlp.gate.e_score_correction_bias": t[P + "mlp.gate.e_score_correction_bias"].astype(BF16)}
        ),
        rf"{DP}mlp\.gate\.e_score_correction_bias: expected dtype F32, found BF16",
    ),
    "fp8 where BF16 has no scale": (
        lambda t: t.pop(scale_name(Q_A)),
        (
            rf"{DP}self_attn\.q_a_proj\.weight: expected dtype BF16, found F8_E4M3 without its "
            rf"block scales {DP}self_attn\.q_a_proj\.weight_scale_inv"
        ),
    ),
    "scale of the wrong block shape": (
        lambda t: t.update({scale_name(Q_A): np.ones((1, 1), np.float32)}),
        (
            rf"tensor {DP}self_attn\.q_a_proj\.weight_scale_inv \(block scales of "
            rf"{DP}self_attn\.q_a_proj\.weight\): expected F32\[3, 4\], found F32\[1, 1\]"
        ),
    ),
    "scale of the wrong dtype": (
        lambda t: t.update({scale_name(Q_A): t[scale_name(Q_A)].astype(BF16)}),
        r"expected F32\[3, 4\], found BF16\[3, 4\]",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_tensor_is_named_before_device_memory(tmp_path, case):
    edit, message = CASES[case]
    c = _bad(tmp_path, edit)
    gpu = HostBackend()
    with pytest.raises(CheckpointError, match=message):
        MtpProposer(gpu, c.config, mtp_tensors(c), ProposerOptions(served_max_seq_len=64, native_fp8=False))
    assert gpu.stats().live_allocations == 0 and gpu.stats().peak_bytes == 0


def test_f32_norms_and_router_are_accepted(tmp_path):
    """A BF16 release may store norms (and the router) in F32: loaded, rounded to BF16."""
    f32 = [
        P + "enorm.weight",
        P + "self_attn.kv_a_layernorm.weight",
        P + "self_attn.indexer.k_norm.weight",
        P + "self_attn.indexer.k_norm.bias",
        P + "mlp.gate.weight",
    ]
    base = tensors_of()
    edited = dict(base)
    for n in f32:
        edited[n] = (base[n].astype(np.float32) * np.float32(1 + 2**-12)).astype(np.float32)
    c = write_published(tmp_path / "f32", edited)
    ts = mtp_tensors(c)
    for n in f32:
        assert c.info(c.disk_name(n)).dtype == "F32"
        assert ts[n].dtype == BF16
        np.testing.assert_array_equal(ts[n], edited[n].astype(BF16))
    assert drafts_of(ts)
    # Other BF16 tensors stay strict: an F32 projection is refused by name.
    edited[P + "eh_proj.weight"] = base[P + "eh_proj.weight"].astype(np.float32)
    with pytest.raises(
        CheckpointError,
        match=rf"{DP}eh_proj\.weight: expected dtype BF16, "
        "found F32",
    ):
        mtp_tensors(write_published(tmp_path / "f32b", edited))


def test_text_config_missing_a_field_is_named(tmp_path):
    c = published(tmp_path / "p")
    cfg = json.loads((c.path / "config.json").read_text())
    del cfg["text_config"]["index_kpool"]
    (c.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="text_config is missing required field 'index_kpool'"):
        _ = Checkpoint(c.path).config
