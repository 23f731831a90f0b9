"""bench/bench_propose.py end to end on the host backend with a tiny config (the GPU run is the
same code at GLM-5.3-Flash shapes): every point is measured, the byte count matches the buffers,
eager and graph drafts agree, and the BENCHMARKS.md section is replaced without touching others."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench import bench_propose as bp
from model.config import tiny, tiny_rope
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import bf16_weights, make_proposer, upload_rows


def test_bench_runs_on_the_host_backend_and_renders(tmp_path):
    cfg = tiny(index_topk=8, index_kpool=2, max_context=256)
    args = argparse.Namespace(iters=2, torch=False, argv=["--iters", "2"])
    res = bp.measure(args, gpu=HostBackend(), cfg=cfg, contexts=(40, 100), copy_bytes=1 << 16)
    assert len(res["rows"]) == 2 * 2 * len(bp.KS)
    assert res["eager_equals_graph"] is True
    for r in res["rows"]:
        assert r["graph_device_ms"] > 0 and r["eager_wall_ms"] > 0 and r["floor_ms"] > 0
    b = res["bytes"]["40/fp8"]
    H, V = cfg.hidden_size, cfg.vocab_size
    assert b["eh_proj"] == 2 * H * H * 2 and b["head"] == V * H + V * 4
    assert res["bytes"]["40/bf16"]["head"] == V * H * 2
    # row 40: 20 complete pools > 4 selected -> 8 rows + the 1-row tail
    assert b["caches"] == 9 * (cfg.attention.kv_lora_rank + 4) + 20 * (cfg.dsa.index_head_dim + 4) + H * 2
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Runtime kernels\n\nkeep me\n")
    bp.update_markdown(md, bp.table(res))
    bp.update_markdown(md, bp.table(res))  # replaced, not appended twice
    text = md.read_text()
    assert text.count(bp.SECTION) == 1 and "keep me" in text
    assert text.index("## Runtime kernels") < text.index(bp.SECTION)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_bench_runs_on_the_host_backend_at_the_rope_family(family):
    cfg = tiny_rope(family=family, max_context=256)
    args = argparse.Namespace(iters=2, torch=False, argv=["--iters", "2"], rows_only=True)
    res = bp.measure(args, gpu=HostBackend(), cfg=cfg, contexts=(5, 100), copy_bytes=1 << 16)
    assert len(res["rows"]) == 2 * 2 * len(bp.KS)
    b = res["bytes"]["100/fp8"]
    a, d = cfg.attention, cfg.dsa
    # row 100: 8 of 101 rows attended (latent, scale, rope key), all 101 keys read (FP8 + scale)
    assert (
        b["caches"]
        == 8 * (a.kv_lora_rank + 4 + a.qk_rope_head_dim * 2)
        + 101 * (d.index_head_dim + 4)
        + cfg.hidden_size * 2
    )


CFG = tiny(index_topk=8, index_kpool=2, max_context=64)
W = bf16_weights(CFG, 11)


def _history(prop, gpu, *arm, rows=13, k=3):
    """Prefill ``rows`` rows and propose k drafts on a fresh state (allocated with ``arm``)."""
    rng = np.random.default_rng(4)
    tok = rng.integers(0, CFG.vocab_size, rows + 2)
    hid = rng.standard_normal((rows + 1, CFG.hidden_size))
    st = prop.alloc_state(*arm)
    p, h = upload_rows(gpu, hid[:rows]), upload_rows(gpu, hid[rows:])
    try:
        prop.prefill_drafter(st, tok[: rows + 1], p)
        return prop.propose(st, int(tok[rows + 1]), h, rows, k)
    finally:
        prop.free_state(st)
        gpu.free(p)
        gpu.free(h)


def test_timing_arms_change_what_they_skip():
    gpu = HostBackend()
    prop = make_proposer(CFG, W, gpu=gpu, cls=bp.ArmProposer)
    full = _history(prop, gpu, bp.Arm())
    no_head = _history(prop, gpu, bp.Arm(skip_head=True))
    no_block = _history(prop, gpu, bp.Arm(skip_block=True))
    assert no_head == [0, 0, 0]
    assert no_block != full


def test_arms_share_one_proposer_and_draft_what_a_proposer_built_for_each_draws():
    """Eager and graph, FP8 and BF16 head on one ArmProposer: each arm drafts what a plain
    proposer built with those options drafts, and the proposer's options and head stay its own."""
    gpu = HostBackend()
    prop = make_proposer(CFG, W, gpu=gpu, cls=bp.ArmProposer)
    opt, head = prop.opt, (prop.head_fp8, prop.head_fp8_scales)
    for fp8 in (True, False):
        for graphs in (False, True):
            ref = make_proposer(CFG, W, gpu=gpu, fp8_head=fp8, use_graphs=graphs)
            assert _history(prop, gpu, bp.Arm(fp8=fp8, graphs=graphs)) == _history(ref, gpu)
            ref.close()
    assert prop.opt is opt and (prop.head_fp8, prop.head_fp8_scales) == head
    prop.close()
    assert gpu.stats().live_bytes == 0


def test_profile_records_every_launch_of_the_step_and_only_while_recording():
    host = HostBackend()
    rec = bp.LaunchRecorder(host)
    prop = make_proposer(CFG, W, gpu=rec, cls=bp.ArmProposer)
    st = prop.alloc_state(bp.Arm())
    hid = upload_rows(host, np.zeros((1, CFG.hidden_size)))
    try:
        bp.fill_context(prop, st, 20, np.random.default_rng(0))
        p = bp.profile_step(prop, st, hid, 20, 3, 1 << 12)
    finally:
        prop.free_state(st)
        host.free(hid)
    names = [x["kernel"] for x in p["launches"]]
    head = "head_argmax_fp8_mma" if prop.tensor_core_head else "head_argmax_fp8_batch"
    assert names.count(f"draft_head.{head}") == 3, names
    assert rec.launch == host.launch  # outside the recording: the device's own launch
    prop.close()
    assert host.stats().live_bytes == 0


@pytest.mark.gpu
def test_bench_runs_on_the_cuda_backend_with_every_arm():
    """The same end-to-end run on a GPU at the tiny config: the arms, the PDL-off graph and the
    profile go through ArmProposer's hooks and the LaunchRecorder on the CUDA backend."""
    from runtime.cuda_backend import CudaBackend

    cfg = tiny(index_topk=8, index_kpool=2, max_context=256)
    gpu = CudaBackend()
    try:
        args = argparse.Namespace(iters=3, torch=False, argv=["--iters", "3"])
        res = bp.measure(args, gpu=gpu, cfg=cfg, contexts=(40, 100), copy_bytes=1 << 20)
        assert res["eager_equals_graph"] is True
        assert len(res["arms"]) == 6 and all(a["graph_device_ms"] > 0 for a in res["arms"])
        names = [x["kernel"] for x in res["profile"]["launches"]]
        assert names.count("draft_head.head_argmax_fp8_batch") == 3, names  # two sequences: CUDA cores
        assert gpu.stats().live_allocations == 0 and not gpu.live_graphs()
    finally:
        gpu.close()
