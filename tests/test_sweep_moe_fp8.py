"""bench/sweep_moe_fp8.py on the host backend at a tiny shape: both kinds run end to end through
the twins, and each table row counts the weight bytes by hand (the distinct routed experts and the
shared one, BF16 at 2 bytes a weight, FP8 at 1 plus its F32 block scales)."""

from __future__ import annotations

import numpy as np

from bench import sweep_moe_fp8 as sw
from runtime.host_backend import HostBackend


def test_sweep_rows_count_the_bytes_of_each_kind():
    gpu = HostBackend()
    rng = np.random.default_rng(0)
    shape = sw.Shape(experts=12, hidden=192, inter=160, topk=3)
    st = sw.Stacks(gpu, rng, shape)
    try:
        rows = sw.run_m(gpu, st, 5, rng, reps=1, bw=1e12)
    finally:
        st.free()
    assert len(rows) == 2
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[1] for c in cells] == ["bf16", "fp8"]
    distinct = int(cells[0][2])
    assert 3 <= distinct <= 12 and int(cells[1][2]) == distinct
    weights = 3 * 160 * 192  # gate, up and down of one expert
    scales = 4 * (4 * 2 + 2 * 2)  # gate_up [4, 2] and down [2, 2] blocks of 128 x 128, f32
    assert float(cells[0][6]) == round((distinct + 1) * 2 * weights / 1e6, 3)
    assert float(cells[1][6]) == round((distinct + 1) * (weights + scales) / 1e6, 3)
    assert gpu.stats().live_allocations == 0
