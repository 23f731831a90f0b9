"""``mtpdraft inspect``: headers only, fast on a published-size index, every problem by name."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest

from model.checkpoint import (
    Checkpoint,
    mtp_tensors,
    random_checkpoint,
    random_tensors,
    write_checkpoint,
)
from model.checkpoint.fp8 import scale_name
from model.checkpoint.naming import NameLayout, disk_name
from model.checkpoint.reader import INDEX_FILE
from model.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from model.cli import main
from model.config import tiny
from model.inspect_checkpoint import OK, PROBLEMS, UNUSABLE, drafter_device_bytes, run
from model.inspect_checkpoint import inspect as inspect_report
from model.proposer import MtpProposer, ProposerOptions
from model.weights_layout import mtp_prefix
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend

PUB = NameLayout.PUBLISHED
CFG = tiny(index_topk=8, index_kpool=2, max_context=64)
BLOCK = (16, 16)
PUBLISHED_NAMES = 76_108  # zai-org/GLM-5.3-Flash's model.safetensors.index.json


def inspect_text(path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return run(path, out, err), out.getvalue(), err.getvalue()


@pytest.fixture()
def no_tensor_bytes(monkeypatch):
    """Fail the test if anything maps a shard's data (headers are read with plain file reads)."""

    def refuse(self):
        raise AssertionError(f"inspect mapped the data of {self.path}")

    monkeypatch.setattr(SafetensorsFile, "_map", refuse)


def published(path: Path, cfg=CFG, **kw) -> Path:
    kw.setdefault("fp8_block", BLOCK)
    return random_checkpoint(
        path, cfg, 1, include_target=False, fp8_published=True, layout=PUB, progress=False, **kw
    )


def test_a_good_published_checkpoint(tmp_path, no_tensor_bytes):
    code, out, err = inspect_text(published(tmp_path / "p"))
    assert code == OK and not err, err
    assert "model type: glm5_next (text model glm5_next_text); layout: published" in out
    assert f"MTP layer: 2 (tensors {disk_name(mtp_prefix(CFG), PUB)}*)" in out
    assert "F8_E4M3" in out and "F32 (block scales)" in out and "BF16" in out
    assert out.rstrip().endswith("a drafter can be built from this checkpoint")


def test_the_shipped_flat_and_published_checkpoints(tmp_path):
    from model.cli import DEFAULT_CHECKPOINT

    assert inspect_text(DEFAULT_CHECKPOINT)[0] == OK
    flat = random_checkpoint(tmp_path / "f", CFG, 1, progress=False)
    code, out, _ = inspect_text(flat)
    assert code == OK and "layout: flat" in out and "model.layers.2.*" in out


@pytest.mark.parametrize("block", [BLOCK, (128, 128)], ids=["dequantised", "native-fp8"])
def test_device_bytes_are_what_the_proposer_uploads(tmp_path, block):
    """The figure inspect prints is what a proposer uploads: BF16 for FP8 in a block size the
    kernels do not apply (dequantised at load), FP8 and its block scales for 128 x 128 blocks."""
    c = Checkpoint(published(tmp_path / "p", fp8_block=block))
    rep = inspect_report(c.path)
    gpu = HostBackend()
    native = block == (128, 128)
    prop = MtpProposer(
        gpu, c.config, mtp_tensors(c), ProposerOptions(served_max_seq_len=64, native_fp8=native)
    )
    assert prop.head_fp8 is not None and prop.layer.mlp.fp8 == native
    assert prop.weights_nbytes == rep.weight_bytes + rep.fp8_head_bytes
    weights, _ = drafter_device_bytes(c.config)
    assert (rep.weight_bytes < weights) == native
    prop.close()


def _edit_published(tmp_path, edit) -> Path:
    t = {}
    for p in random_tensors(CFG, 1, include_target=False, fp8_published=True, fp8_block=BLOCK):
        t[p.name] = np.concatenate([c.reshape(-1) for c in p.chunks()]).reshape(p.shape)
    edit(t)
    q = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(BLOCK)}}
    return write_checkpoint(tmp_path / "bad", CFG, t, extra_config=q, layout=PUB)


P = mtp_prefix(CFG)
DP = disk_name(P, PUB)


@pytest.mark.parametrize(
    "edit, expect",
    [
        (
            lambda t: t.pop(P + "hnorm.weight"),
            [rf"tensor {DP}hnorm.weight is missing .*\(expected BF16\[64\]\)"],
        ),
        (
            lambda t: t.update({P + "eh_proj.weight": t[P + "eh_proj.weight"][:, :64].copy()}),
            [rf"{DP}eh_proj.weight: expected shape \[64, 128\], found \[64, 64\]"],
        ),
        (
            lambda t: t.update(
                {P + "self_attn.kv_b_proj.weight": t[P + "self_attn.kv_b_proj.weight"].astype(np.float16)}
            ),
            [rf"{DP}self_attn.kv_b_proj.weight: expected dtype BF16, found F16"],
        ),
        (
            lambda t: t.update({scale_name(P + "self_attn.o_proj.weight"): np.ones((2, 2), np.float32)}),
            [
                (
                    rf"{DP}self_attn.o_proj.weight_scale_inv \(block scales of {DP}self_attn.o_proj.weight\): "
                    r"expected F32\[4, 4\], found F32\[2, 2\]"
                )
            ],
        ),
        (
            lambda t: (t.pop(P + "enorm.weight"), t.pop("lm_head.weight")),
            [
                rf"{DP}enorm.weight is missing",
                rf"lm_head.weight is missing .*and so is {DP}shared_head.head.weight",
            ],
        ),
    ],
)
def test_every_problem_is_named_with_expected_and_found(tmp_path, no_tensor_bytes, edit, expect):
    import re

    code, out, _ = inspect_text(_edit_published(tmp_path, edit))
    assert code == PROBLEMS
    for pattern in expect:
        assert re.search(pattern, out), (pattern, out)
    assert "a drafter cannot be built" in out


def test_not_a_checkpoint_is_one_line(tmp_path):
    code, out, err = inspect_text(tmp_path)
    assert code == UNUSABLE and not out and err.count("\n") == 1 and "no config.json" in err
    d = published(tmp_path / "p")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["n_group"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = inspect_text(d)
    assert code == UNUSABLE and "n_group 8 leaves 1 expert per group" in err


def test_cli_hook(tmp_path, capsys):
    assert main(["inspect", str(published(tmp_path / "p"))]) == OK
    assert "a drafter can be built" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nowhere")]) == UNUSABLE


def test_published_size_index_in_under_five_seconds(tmp_path, no_tensor_bytes):
    """An index of the published checkpoint's 76,108 names: the MTP layer at 288 experts (real
    header sizes, tiny tensors), the target's layers in shards whose tensors hold no bytes. Also
    as a drafter-only copy, without those shards."""
    cfg = tiny(
        hidden_size=64,
        num_hidden_layers=45,
        n_routed_experts=288,
        num_experts_per_tok=8,
        index_topk=16,
        index_kpool=4,
        max_context=256,
    )
    d = published(tmp_path / "big", cfg, max_shard_bytes=1 << 20)
    index_path = d / INDEX_FILE
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    filler, n_shards = PUBLISHED_NAMES - len(wm), 120
    per = -(-filler // n_shards)
    empty = np.zeros((0, 64), BF16)
    for s in range(n_shards):
        fname = f"target-{s:05d}.safetensors"
        names = [
            f"model.language_model.layers.{(s * per + i) % 45}.filler.{s * per + i}.weight"
            for i in range(per)
            if s * per + i < filler
        ]
        write_safetensors(d / fname, {n: empty for n in names})
        wm.update({n: fname for n in names})
    assert len(wm) == PUBLISHED_NAMES
    index_path.write_text(json.dumps(index))
    t0 = time.perf_counter()
    code, out, _ = inspect_text(d)
    took = time.perf_counter() - t0
    assert code == OK, out
    assert f"index: {PUBLISHED_NAMES} tensors" in out and "MTP layer: 45" in out
    assert took < 5.0, f"inspect took {took:.2f} s on {PUBLISHED_NAMES} names"
    for s in range(n_shards):  # a drafter-only copy: the target's shards are not there
        (d / f"target-{s:05d}.safetensors").unlink()
    t0 = time.perf_counter()
    code, out, _ = inspect_text(d)
    assert code == OK and time.perf_counter() - t0 < 5.0
