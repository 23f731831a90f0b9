"""Native FP8 weights: tensors stored as 128x128 block-scaled FP8 stay FP8 on the device and the
drafts follow the float64 reference computed from the same dequantised values; the BF16-dequantised
path, the quantise-on-load option, and the refusals at load."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from model.checkpoint import fp8
from model.checkpoint.random_init import fp8_on_disk_names, random_checkpoint
from model.checkpoint.reader import Checkpoint
from model.checkpoint.validate import mtp_tensors
from model.config import AttentionConfig, MoeConfig, tiny, tiny_rope
from model.tensors import WeightError
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import bf16_weights, make_proposer, upload_rows
from tests.reference_f64 import ReferenceDrafter

# Sizes that span several 128-wide blocks with partial last blocks in both dimensions (hidden
# 272 = 2 x 128 + 16, q_lora 160, kv_lora 144, experts' intermediate 136), and o_proj head groups
# of 32 columns: a scale looked up in the wrong block shows.
CFG = dataclasses.replace(
    tiny(index_topk=8, index_kpool=2, max_context=64, hidden_size=272),
    attention=AttentionConfig(4, 160, 144, 32, 0, 32),
    moe=MoeConfig(8, 2, 136, 1, 2.5, True, 10.0),
)
# The RoPE family at the same awkward sizes: kv_a's rows are the latent's 144 and 16 rope rows
# (160 = 128 + 32: its rope rows cross into the partial block), DeepSeek-V3.2's YaRN, half-split
# indexer RoPE and group-limited routing.
_DS = tiny_rope(family="deepseek_v32", hidden_size=272, max_context=64)
CFG_ROPE = dataclasses.replace(
    _DS,
    attention=AttentionConfig(4, 160, 144, 32, 16, 32, _DS.attention.rope),
    moe=MoeConfig(8, 2, 136, 1, 2.5, True, math.inf, n_group=4, topk_group=2),
)
LOGIT_RTOL = 2e-2  # as tests/test_proposer_reference.py: BF16 activations and FP8 caches


def _fp8_weights(cfg, seed):
    """BF16 random weights with the published FP8 tensors block-quantised: (the FP8 mapping, the
    same weights dequantised exactly in float64 for the reference)."""
    w = bf16_weights(cfg, seed)
    exact = dict(w)
    for name in fp8_on_disk_names(cfg):
        q, s = fp8.quantize(w[name].astype(np.float32))
        w[name], w[name + "_scale_inv"] = q, s
        rows = np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)[: q.shape[0], : q.shape[1]]
        exact[name] = q.astype(np.float64) * rows
    return w, exact


def _margin(logits):
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def _run(prop, ref, gpu, rows, seed, k=3):
    rng = np.random.default_rng(seed)
    H, V = prop.cfg.hidden_size, prop.cfg.vocab_size
    tokens = rng.integers(0, V, rows + 1)
    hid = rng.standard_normal((rows + 1, H)).astype(BF16)
    st = prop.alloc_state()
    p = upload_rows(gpu, hid[:rows])
    prop.prefill_drafter(st, tokens, p)
    for r in range(rows):
        ref.context_row(int(tokens[r + 1]), hid[r].astype(np.float64))
    last = int(rng.integers(0, V))
    h = upload_rows(gpu, hid[rows : rows + 1])
    drafts = prop.propose(st, last, h, rows, k)
    rdrafts, rlogits, _ = ref.propose(last, hid[rows].astype(np.float64), k)
    prop.propose(st, last, h, rows, 1)
    got = np.empty(V, BF16)
    gpu.copy_d2h(got, prop.step.logits)
    return drafts, rdrafts, rlogits, got.astype(np.float64)


@pytest.mark.parametrize("cfg", [CFG, CFG_ROPE], ids=["glm5_next", "deepseek_v32"])
@pytest.mark.parametrize("seed,rows", [(0, 9), (1, 30)])
def test_native_fp8_drafts_follow_the_float64_reference_of_the_same_values(seed, rows, cfg):
    w, exact = _fp8_weights(cfg, seed)
    gpu = HostBackend()
    prop = make_proposer(cfg, w, gpu=gpu, served=64, fp8_head=False)
    attn, mlp = prop.layer.attn, prop.layer.mlp
    assert mlp.fp8 and mlp.shared_gate_up_scales is not None and attn.o_scales is not None
    assert [g.scales is not None for g in attn.fused_full] == [True, False, True, False]
    assert [g.scales is not None for g in attn.q_segments] == [True, False]
    ref = ReferenceDrafter(cfg, exact, fp8_cache=True)
    drafts, rdrafts, rlogits, logits1 = _run(prop, ref, gpu, rows, seed)
    compared = 0
    for i in range(3):
        if drafts[:i] != rdrafts[:i]:
            break
        if _margin(rlogits[i]) > LOGIT_RTOL * np.ptp(rlogits[i]):
            assert drafts[i] == rdrafts[i], f"draft {i}"
            compared += 1
    assert compared >= 1
    prop.close()


def test_native_fp8_against_the_bf16_dequantised_path():
    """The same checkpoint with FP8 kept and with FP8 dequantised to BF16 at load: the logits differ
    by the BF16 rounding of the dequantised weights only (measured: well under the tolerance)."""
    w, exact = _fp8_weights(CFG, 3)
    deq = {n: a for n, a in w.items() if not n.endswith("_scale_inv")}
    for name in fp8_on_disk_names(CFG):
        deq[name] = fp8.dequantize(w[name], w[name + "_scale_inv"])
    logits = []
    for weights, native in ((w, True), (deq, False)):
        gpu = HostBackend()
        prop = make_proposer(CFG, weights, gpu=gpu, served=64, fp8_head=False, native_fp8=native)
        ref = ReferenceDrafter(CFG, exact, fp8_cache=True)
        *_, l1 = _run(prop, ref, gpu, 20, 3)
        assert prop.layer.mlp.fp8 == native
        logits.append(l1)
        prop.close()
    err = np.abs(logits[0] - logits[1]).max() / np.ptp(logits[1])
    assert 0 < err < LOGIT_RTOL, err


def test_quantize_experts_makes_a_bf16_checkpoints_experts_fp8():
    w = bf16_weights(CFG, 4)
    gpu = HostBackend()
    prop = make_proposer(CFG, w, gpu=gpu, served=64, quantize_experts=True)
    mlp = prop.layer.mlp
    assert mlp.fp8 and mlp.shared_down_scales is not None
    assert prop.layer.attn.o_scales is None  # only the experts are quantised
    P = f"model.layers.{CFG.mtp_layer_index}.mlp."
    exact = dict(w)
    for name in [n for n in fp8_on_disk_names(CFG) if n.startswith(P)]:
        q, s = fp8.quantize(w[name].astype(np.float32))
        exact[name] = fp8.dequantize(q, s, np.float64)
    ref = ReferenceDrafter(CFG, exact, fp8_cache=True)
    drafts, rdrafts, rlogits, _ = _run(prop, ref, gpu, 15, 4)
    if _margin(rlogits[0]) > LOGIT_RTOL * np.ptp(rlogits[0]):
        assert drafts[0] == rdrafts[0]
    prop.close()


def test_an_fp8_checkpoint_on_disk_loads_native_and_dequantised(tmp_path):
    path = random_checkpoint(
        tmp_path / "ck", CFG, 5, include_target=False, fp8_published=True, progress=False
    )
    with Checkpoint(path) as ck:
        for native in (True, False):
            gpu = HostBackend()
            prop = make_proposer(CFG, mtp_tensors(ck, CFG), gpu=gpu, served=64, native_fp8=native)
            assert prop.layer.mlp.fp8 == native and (prop.layer.attn.o_scales is not None) == native
            prop.close()


def test_an_unsupported_block_size_is_refused_before_device_memory_is_taken(tmp_path):
    path = random_checkpoint(
        tmp_path / "ck", CFG, 6, include_target=False, fp8_published=True, fp8_block=(64, 64), progress=False
    )
    with Checkpoint(path) as ck:
        gpu = HostBackend()
        with pytest.raises(WeightError, match=r"block size \(64, 64\)"):
            make_proposer(CFG, mtp_tensors(ck, CFG), gpu=gpu, served=64)
        assert gpu.stats().peak_bytes == 0
        # Dequantising needs no kernel of that block size.
        prop = make_proposer(CFG, mtp_tensors(ck, CFG), gpu=gpu, served=64, native_fp8=False)
        prop.close()


def test_a_scale_of_the_wrong_block_shape_is_refused_naming_it():
    w, _ = _fp8_weights(CFG, 7)
    name = f"model.layers.{CFG.mtp_layer_index}.self_attn.o_proj.weight"
    w[name + "_scale_inv"] = np.ones((9, 9), np.float32)
    with pytest.raises(WeightError, match="block scales of .*o_proj"):
        make_proposer(CFG, w, gpu=HostBackend(), served=64)
