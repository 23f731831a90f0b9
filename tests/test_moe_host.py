"""The MoE router's host twin: the shared expert is added with weight 1 (there is no gate row)."""

from __future__ import annotations

import numpy as np

from model.kernels import moe
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend


def test_router_reads_exactly_the_routed_rows_and_weights_the_shared_expert_one():
    """A router [E, H] and a scores buffer of E floats: the host heap refuses any read past them
    (the gated design read an (E + 1)-th row and score)."""
    gpu = HostBackend()
    rng = np.random.default_rng(0)
    E, H, k = 9, 32, 3

    def put(a):
        a = np.ascontiguousarray(a)
        p = gpu.alloc(a.nbytes)
        gpu.copy_h2d(p, a)
        return p

    w = put((rng.standard_normal((E, H)) / 6).astype(BF16))
    y = put(rng.standard_normal(H).astype(BF16))
    bias = put(np.zeros(E, np.float32))
    scores, ids, wts = gpu.alloc(E * 4), gpu.alloc((k + 1) * 4), gpu.alloc((k + 1) * 4)
    counter = put(np.zeros(1, np.uint32))
    moe.router_fused(gpu, w, y, bias, scores, ids, wts, counter, E, H, k, True, 2.5, True)
    got_w, got_i = np.empty(k + 1, np.float32), np.empty(k + 1, np.uint32)
    gpu.copy_d2h(got_w, wts)
    gpu.copy_d2h(got_i, ids)
    assert got_w[k] == 1.0 and got_i[k] == 0
    np.testing.assert_allclose(got_w[:k].sum(), 2.5, rtol=1e-6)
