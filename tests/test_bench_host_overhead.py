"""bench/bench_host_overhead.py on the host backend, untimed: a stubbed replay runs the product's
graph-replay path (one replay per propose, the drafts of the real replay), for both kinds of
hidden rows, and the table renders."""

from __future__ import annotations

import numpy as np

from bench import bench_host_overhead as bh


def test_stubbed_replays_take_the_graph_path_and_render():
    gpu = bh.FreeReplayBackend()
    prop = bh.build(gpu, 4)
    rng = np.random.default_rng(1)
    try:
        rows = [bh.measure(prop, gpu, B, 3, rng, hidden_as=h) for B, h in ((1, "pointer"), (3, "array"))]
    finally:
        prop.close()
    assert [(r["B"], r["bucket"], r["hidden"]) for r in rows] == [(1, 1, "pointer"), (3, 4, "array")]
    assert all(r["host_us"] > 0 and r["wall_us"] >= r["host_us"] for r in rows)
    assert gpu.stubbed is False and gpu.stats().live_bytes == 0
    assert "| 3 | 4 | 3 | array |" in bh.table(rows)


def test_main_prints_the_table(capsys):
    assert bh.main(["--batches", "2", "--iters", "2", "--profile", "2", "--profile-top", "3"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 2 | 3 | pointer |" in out and "function calls" in out
