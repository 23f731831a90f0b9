"""bench/bench_propose.py end to end on the host backend with a tiny config (the GPU run is the
same code at GLM-5.3-Flash shapes): every point is measured, the byte count matches the buffers,
eager and graph drafts agree, and the BENCHMARKS.md section is replaced without touching others."""

from __future__ import annotations

import argparse

from bench import bench_propose as bp
from model.config import tiny
from runtime.host_backend import HostBackend


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
