"""bench/bench_indexer_scores.py on the host backend (--smoke): every point launched through the
helper's path for its heads (one group at 32, two at 64, the warp path for the 2-byte-aligned q),
every score written, the byte floor m x pools x (dim + 8) over the bandwidth, the JSON written."""

from __future__ import annotations

import json

from bench import bench_indexer_scores as bis


def test_smoke_points(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bis.main(["--smoke", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    pts = res["points"]
    want = {(h, n, m, "tensor cores") for h in bis.HEADS for n in (40, 1000) for m in (1, 3)}
    want |= {(64, n, 1, "warp per pool") for n in (40, 1000)}
    assert {(p["heads"], p["pools"], p["m"], p["path"]) for p in pts} == want
    for p in pts:
        assert p["scores_finite"], p
        assert p["groups"] == (0 if p["path"] == "warp per pool" else p["heads"] // 32), p
        assert round(p["MB"] * 1e6) == p["m"] * p["pools"] * (bis.DIM + 8)
        assert abs(p["floor_us"] - p["MB"] * 1e6 / (res["copy_bw_GBps"] * 1e9) * 1e6) < 1e-9 * p["floor_us"]
    table = capsys.readouterr().out
    assert "x floor" in table and table.count("tensor cores") == len(want) - 2
