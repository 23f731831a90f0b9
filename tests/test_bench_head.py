"""bench/bench_head.py on the host backend (--smoke): every (m, kernel) point launched through
head_argmax_batch_mma, every logit written, the two kernels' bits the same, the FLOP rate and the
byte floor (weights, scales, x, logits) from the measured time and bandwidth, the JSON written."""

from __future__ import annotations

import json

from bench import bench_head as bh


def test_smoke_points(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bh.main(["--smoke", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    pts = res["points"]
    n, k = res["n"], res["k"]
    assert {(p["m"], p["kernel"]) for p in pts} == {(m, kern) for m in (1, 3) for kern in bh.KERNELS}
    for p in pts:
        assert p["logits_finite"] and p["same_bits"], p
        assert round(p["MB"] * 1e6) == n * k + 4 * n + 2 * p["m"] * k + 2 * p["m"] * n
        assert abs(p["floor_us"] - p["MB"] * 1e6 / (res["copy_bw_GBps"] * 1e9) * 1e6) < 1e-9 * p["floor_us"]
        assert abs(p["TFLOPs"] - 2 * p["m"] * n * k / p["us"] / 1e6) < 1e-9 * p["TFLOPs"]
        assert p["grid"] % p["tiles"] == 0
    table = capsys.readouterr().out
    assert "x floor" in table and table.count("are the same") == 2


def test_no_v1_times_the_new_kernel_only(tmp_path):
    out = tmp_path / "r.json"
    assert bh.main(["--smoke", "--no-v1", "--json", str(out)]) == 0
    assert {p["kernel"] for p in json.loads(out.read_text())["points"]} == {"head_argmax_fp8_mma"}
