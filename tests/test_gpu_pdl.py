"""Programmatic dependent launch changes when kernels start, never what they compute: proposers on
the same weights with PDL on (graph and eager) and off (graph) must agree bit for bit (drafts,
the last draft's logits and normed hidden, and every cache) over a long random history of
propose / verify with any acceptance / catch-up. A kernel that read its predecessor's output
before griddepcontrol.wait, or stored ahead of it, would show here as differing bits on some step.
The config is larger than model.config.tiny's defaults so that the step's grids have many blocks
(the races PDL could open need blocks that start while the previous kernel still runs).
"""

from __future__ import annotations

import numpy as np
import pytest

from model.config import tiny
from runtime.dtypes import BF16
from tests.proposer_fixtures import (
    assert_same_caches,
    bf16_weights,
    cache_snapshot,
    make_proposer,
    upload_rows,
)

pytestmark = pytest.mark.gpu

CFG = tiny(
    hidden_size=512,
    vocab_size=3001,
    heads=8,
    index_topk=32,
    index_kpool=4,
    n_routed_experts=32,
    num_experts_per_tok=4,
    max_context=1024,
)


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    if not gpu.pdl_supported:
        gpu.close()
        pytest.skip(f"programmatic dependent launch needs sm_90; this device is sm_{gpu.compute_capability}")
    yield gpu
    gpu.pdl = True
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} allocations leaked"


def _bits(gpu, ptr, n: int) -> bytes:
    out = np.empty(n, np.uint8)
    gpu.copy_d2h(out, ptr)
    return out.tobytes()


# The attention as the split pair (this proposer's size picks it) and as the wide pair.
@pytest.mark.parametrize("attention", [None, 64], ids=["split-pair", "wide-64"])
def test_pdl_on_and_off_agree_bit_for_bit(cuda, attention):
    w = bf16_weights(CFG, 11)
    mk = dict(gpu=cuda, attention_split_rows=attention)
    arms = {  # name -> (proposer, PDL on?)
        "graph+pdl": (make_proposer(CFG, w, use_graphs=True, **mk), True),
        "eager+pdl": (make_proposer(CFG, w, **mk), True),
        "graph": (make_proposer(CFG, w, use_graphs=True, **mk), False),
    }
    assert {p.layer.attn_split_rows for p, _ in arms.values()} == {attention or 0}
    states = {name: p.alloc_state() for name, (p, _) in arms.items()}
    rng = np.random.default_rng(11)
    n = 900
    tokens = rng.integers(0, CFG.vocab_size, n + 1)
    hiddens = upload_rows(cuda, rng.standard_normal((n + 1, CFG.hidden_size)).astype(np.float32))
    H = CFG.hidden_size

    def run(name: str, fn):
        prop, pdl = arms[name]
        cuda.pdl = pdl
        try:
            return fn(prop, states[name])
        finally:
            cuda.pdl = True

    try:
        prefill = 300
        for name in arms:
            run(name, lambda p, st: p.catchup_drafter(st, tokens[: prefill + 1], hiddens, 0))
        pos = rows = prefill
        steps = 0
        while pos + 5 < n and steps < 40:
            k = int(rng.integers(1, 5))
            out = {}
            for name in arms:
                out[name] = run(
                    name,
                    lambda p, st: (
                        p.propose(st, int(tokens[pos + 1]), hiddens.offset(pos * H * 2), pos, k),
                        _bits(cuda, p.step.logits, p.head_n * 2),
                        _bits(cuda, p.step.xn, H * 2),
                    ),
                )
            ref = out["graph"]
            for name in ("graph+pdl", "eager+pdl"):
                assert out[name][0] == ref[0], (
                    f"step {steps}: {name} drafted {out[name][0]}, no-PDL graph {ref[0]}"
                )
                assert out[name][1] == ref[1], f"step {steps}: {name} logits differ from the no-PDL graph's"
                assert out[name][2] == ref[2], f"step {steps}: {name} normed hidden differs"
            acc = int(rng.integers(0, k + 1))
            for name in arms:
                run(name, lambda p, st: p.after_verify(st, acc))
            rows, pos = pos + min(k, acc + 1), pos + acc + 1
            if pos > rows:
                for name in arms:
                    run(
                        name,
                        lambda p, st: p.catchup_drafter(
                            st, tokens[rows : pos + 1], hiddens.offset(rows * H * 2), rows
                        ),
                    )
                rows = pos
            steps += 1
        assert steps >= 30
        snaps = {name: run(name, cache_snapshot) for name in arms}
        assert_same_caches(snaps["graph+pdl"], snaps["graph"])
        assert_same_caches(snaps["eager+pdl"], snaps["graph"])
    finally:
        cuda.free(hiddens)
        for name, (p, _) in arms.items():
            p.free_state(states[name])
            p.close()


def test_pdl_switch_is_per_launch(cuda):
    """``pdl`` is read at every launch: turning it off makes every kernel a plain launch (the
    benchmarks' comparison arm), and kernels not declared pdl never get the attribute."""
    import model.kernels  # noqa: F401 - declares the model's kernels
    from runtime.kernel import lookup

    h = cuda.kernel("bgemv", "bgemv_bf16_f32_batch")
    assert lookup("bgemv", "bgemv_bf16_f32_batch").pdl and h.native.pdl_config is not None
    plain = cuda.kernel("gemv_bf16", "gemv_bf16")
    assert not plain.decl.pdl and plain.native.pdl_config is None
    # Both launch paths run the same kernel to the same bits.
    rng = np.random.default_rng(3)
    wv = rng.standard_normal((3, 40, 24)).astype(BF16)
    xv = rng.standard_normal((3, 24)).astype(BF16)
    w, x = upload_rows(cuda, wv.reshape(-1, 24)), upload_rows(cuda, xv)
    y = cuda.alloc(3 * 40 * 4)
    try:
        from model.kernels.bgemv import bgemv_batch

        outs = []
        for pdl in (True, False):
            cuda.pdl = pdl
            cuda.memset(y, 0xFF, 3 * 40 * 4)
            bgemv_batch(cuda, w=w, x=x, y=y, m=1, heads=3, n=40, k=24, out_f32=True)
            o = np.empty((3, 40), np.float32)
            cuda.copy_d2h(o, y)
            outs.append(o)
        cuda.pdl = True
        np.testing.assert_array_equal(outs[0], outs[1])
        ref = np.einsum("bnk,bk->bn", wv.astype(np.float32), xv.astype(np.float32))
        np.testing.assert_allclose(outs[0], ref, rtol=1e-4, atol=1e-4)
    finally:
        cuda.pdl = True
        for p in (w, x, y):
            cuda.free(p)
