"""Sampled drafts' PTX (ptx/draft_sample.cu: sample_hist_batch, sample_select_batch,
sample_index_batch, sample_draw_batch through draft_sample_batch) against the host twins, on fresh
random BF16 logits at the GLM-5.3-Flash vocabulary (154,880) and at awkward sizes (1, 7, 1000,
65,537), m = 1, 3, 17, 64, 200, with greedy, temperature, top-k, top-p and combined records mixed
in a batch, padding entries anywhere, dist buffers on some entries, every output poisoned (0xFF)
with guard bytes after it (tests/draft_sample_util.py).

What must hold, and how exactly:

- bit for bit against the twin: the kept set's state (z_max, the boundary run [lo, hi], jstar,
  istar, inv, the total mass), the chunk counts, hence the whole workspace after the launch (which
  must also be zero again in its histograms and counters), every dist row, and q(token) for the
  committed token: every float operation of those is a correctly rounded one in a fixed order and
  every sum an integer one (model/kernels/draft_sample.py);
- the token equal to the twin's, except where the device's and NumPy's logf pick different tokens
  between two kept ones whose perturbed scores, recomputed in float64 from the exact uniforms, are
  within 1e-5 relative (draft_sample_util.gumbel_near_tie); then q is still the twin's dist at the
  device's token. With random logits that happens about once in 10**5 rows, so a failure of the
  exception itself would be reported;
- dist rows sum to 1 within 1e-6 (float64 sum);
- the commit and publish contract, padding entries untouched (draft_sample_util.check_outputs);
- batch invariance: every row of an m-row launch (shuffled, padding inserted) bit-identical to the
  same row launched alone (m = 1): token, probs, dist row, state words;
- a captured graph (with PDL) replays the records it finds in device memory.

A timing print (not an assertion) gives µs per draft_sample_batch at the vocabulary size.
"""

from __future__ import annotations

import numpy as np
import pytest
from draft_sample_util import (
    GUARD,
    check_outputs,
    expected,
    make_case,
    mixed_bits,
    mixed_params,
    normal_bits,
    run_case,
    special_bits,
    state_words,
    tied_bits,
    u32,
)

from model.kernels import draft_sample as ds
from model.sampling import SamplingParams
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend

pytestmark = pytest.mark.gpu

VOCAB = 154880


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_draft_sample"


def _workspace_diff(case, got: np.ndarray, want: np.ndarray) -> str:
    m = case.m
    bad = np.flatnonzero(got != want)
    first = int(bad[0])
    hist_end = m * ds.HIST_BYTES
    state_end = m * (ds.HIST_BYTES + ds.ROW_STATE_BYTES)
    if first < hist_end:
        return f"histogram of row {first // ds.HIST_BYTES} not zero"
    if first < state_end:
        e = (first - hist_end) // ds.ROW_STATE_BYTES
        g = state_words(case, got)[e].tolist()
        w = state_words(case, want)[e].tolist()
        return f"row {e} ({case.params[e]}): state words {g} != twin's {w}"
    return f"chunk counts differ at byte {first - state_end} of the counts"


def against_twin(cuda, case, what: str):
    """The device against the twin (check_outputs) and the device's workspace against the twin's,
    byte for byte; returns the device's outputs."""
    exp = expected(case)
    g = run_case(cuda, case)
    h = run_case(HostBackend(), case)
    check_outputs(case, h, exp, f"{what} (twin)")
    check_outputs(case, g, exp, what, allow_near_ties=True)
    assert np.array_equal(g.workspace, h.workspace), (
        f"{what}: {_workspace_diff(case, g.workspace, h.workspace)}"
    )
    for e, d in enumerate(g.dists):
        if d is not None and case.live(e):
            s = d[case.draft_index].astype(np.float64).sum()
            assert abs(s - 1.0) <= 1e-6, f"{what}: entry {e}'s dist sums to {s!r}"
    return g


@pytest.mark.parametrize(
    "m,n,pads",
    [
        (1, VOCAB, 0),
        (3, VOCAB, 1),
        (17, VOCAB, 3),
        (64, VOCAB, 7),
        (1, 1, 0),
        (3, 7, 1),
        (17, 1000, 4),
        (64, 65537, 6),
        (200, 7, 25),
        (200, 1000, 30),
    ],
)
def test_against_the_twin(cuda, m, n, pads):
    rng = np.random.default_rng()
    di = int(rng.integers(0, 3))
    case = make_case(
        rng,
        mixed_bits(rng, m, n),
        mixed_params(rng, m),
        pads=pads,
        draft_index=di,
        kmax=int(di + rng.integers(1, 3)),
    )
    against_twin(cuda, case, f"m={m} n={n}")


def test_the_hardest_record_at_the_vocabulary_size(cuda):
    """top-k 0 / top-p 0.95 (the kept set is most of a flat row) and top-k 50, on several spreads."""
    rng = np.random.default_rng()
    bits = np.concatenate(
        [normal_bits(rng, (2, VOCAB), s) for s in (0.5, 1.0, 3.0)] + [tied_bits(rng, (2, VOCAB))]
    )
    m = bits.shape[0]
    params = [
        SamplingParams(1.0, 0.95, 0, int(s)) if e % 2 == 0 else SamplingParams(0.7, 1.0, 50, int(s))
        for e, s in enumerate(rng.integers(0, 2**63, m))
    ]
    case = make_case(rng, bits, params, with_dist=[True] * m)
    against_twin(cuda, case, "top-p 0.95 / top-k 50")


def test_special_rows(cuda):
    """Non-finite values among finite ones, a +inf logit, every logit NaN, overflowing l / T
    (greedy-like), underflowing z (runs of many keys on one z), a row of one value."""
    rng = np.random.default_rng()
    n = 5003
    inf = np.float32(np.inf).astype(BF16).view(np.uint16)
    with_inf = normal_bits(rng, n)
    with_inf[int(rng.integers(n))] = inf
    rows = [
        (special_bits(rng, n), SamplingParams(1.0, 0.9, 0, 1)),
        (special_bits(rng, n), SamplingParams(0.5, 1.0, 2000, 2)),
        (with_inf, SamplingParams(1.0, 0.9, 0, 3)),
        (np.full(n, 0x7FC1, np.uint16), SamplingParams(1.0, 1.0, 0, 4)),
        (normal_bits(rng, n, 100.0), SamplingParams(1e-38, 1.0, 0, 5)),
        ((rng.standard_normal(n) * 1e-8).astype(BF16).view(np.uint16), SamplingParams(1e38, 0.375, 0, 6)),
        ((rng.standard_normal(n) * 1e-8).astype(BF16).view(np.uint16), SamplingParams(1e38, 1.0, 7, 7)),
        (np.full(n, np.float32(1.5).astype(BF16).view(np.uint16), np.uint16), SamplingParams(1.0, 0.5, 0, 8)),
        (normal_bits(rng, n, 4.0), SamplingParams(0.01, 0.99, 0, 9)),
    ]
    bits = np.stack([r for r, _ in rows])
    case = make_case(rng, bits, [p for _, p in rows], with_dist=[True] * len(rows))
    against_twin(cuda, case, "special rows")


@pytest.mark.parametrize(
    "n,ms", [(1000, (3, 17, 64, 200)), (7, (3, 200)), (65537, (3, 17)), (VOCAB, (17, 64))]
)
def test_rows_are_bit_identical_alone(cuda, n, ms):
    rng = np.random.default_rng()
    for m in ms:
        case = make_case(rng, mixed_bits(rng, m, n), mixed_params(rng, m), with_dist=[True] * m)
        alone = [run_case(cuda, case.subset([e])[0]) for e in range(m)]
        batch = run_case(cuda, case)
        shuffled, src = case.subset(rng.permutation(m).tolist(), pad_at=(0, m // 2))
        sh = run_case(cuda, shuffled)
        for got, rows, what in ((batch, list(range(m)), "batch"), (sh, src, "shuffled")):
            words = state_words(case if got is batch else shuffled, got.workspace)
            for j, e in enumerate(rows):
                if e < 0:
                    continue
                a = alone[e]
                w = f"m={m} n={n} {what}: row {e} ({case.params[e]})"
                assert got.entries[j, 2] == a.entries[0, 2], f"{w}: token"
                assert u32(got.probs[j]).tolist() == u32(a.probs[0]).tolist(), f"{w}: probs"
                assert np.array_equal(u32(got.dists[j]), u32(a.dists[0])), f"{w}: dist"
                assert words[j].tolist() == state_words(case.subset([e])[0], a.workspace)[0].tolist(), (
                    f"{w}: state"
                )


def test_a_captured_graph_replays_the_records_in_memory(cuda):
    rng = np.random.default_rng()
    m, n = 5, VOCAB
    case = make_case(rng, normal_bits(rng, (m, n), 2.0), mixed_params(rng, m), with_dist=[False] * m)
    gpu = cuda
    recs = np.stack([case.record(e) for e in range(m)])
    ptrs = {}
    for name, arr in (
        ("logits", case.bits),
        ("sampling", recs),
        ("entries", case.entries),
        ("drafts", case.drafts),
    ):
        ptrs[name] = gpu.alloc(arr.nbytes + GUARD)
        gpu.copy_h2d(ptrs[name], np.ascontiguousarray(arr))
    ptrs["probs"] = gpu.alloc(m * case.kmax * 4)
    wsb = ds.sample_workspace_bytes(m, n)
    ptrs["ws"] = gpu.alloc(wsb)
    gpu.memset(ptrs["ws"], 0, wsb)
    hd, hp = gpu.alloc_mapped(m * case.kmax * 4), gpu.alloc_mapped(m * case.kmax * 4)
    s = gpu.create_stream()
    g = None
    try:
        gpu.begin_capture(s)
        ds.draft_sample_batch(
            gpu,
            logits=ptrs["logits"],
            sampling=ptrs["sampling"],
            entries=ptrs["entries"],
            drafts=ptrs["drafts"],
            probs=ptrs["probs"],
            host_drafts=hd.device,
            host_probs=hp.device,
            draft_index=case.draft_index,
            kmax=case.kmax,
            publish=True,
            m=m,
            n=n,
            workspace=ptrs["ws"],
            stream=s,
        )
        g = gpu.end_capture(s, label="draft_sample")
        for _ in range(3):
            case.params = mixed_params(rng, m)
            gpu.copy_h2d(ptrs["sampling"], np.stack([case.record(e) for e in range(m)]), stream=s)
            # What the head rewrites before each sampling step: the entries' tokens, drafts[di].
            gpu.copy_h2d(ptrs["entries"], case.entries, stream=s)
            gpu.copy_h2d(ptrs["drafts"], case.drafts, stream=s)
            gpu.graph_launch(g, s)
            gpu.synchronize(s)
            exp = expected(case)
            got_t = hd.host.view(np.uint32).reshape(m, case.kmax)[:, case.draft_index]
            got_q = hp.host.view(np.float32).reshape(m, case.kmax)[:, case.draft_index]
            for e, x in enumerate(exp):
                if int(got_t[e]) != x.token:
                    from draft_sample_util import gumbel_near_tie

                    assert gumbel_near_tie(case, e, int(got_t[e]), x.token, x.kept), f"replay row {e}: token"
                q = x.dist[int(got_t[e])] if x.state.mode else np.float32(1.0)
                assert u32(got_q[e]) == u32(q), f"replay row {e}: q {got_q[e]!r}, expected {q!r}"
    finally:
        if g is not None:
            gpu.graph_destroy(g)
        gpu.destroy_stream(s)
        for p in ptrs.values():
            gpu.free(p)
        gpu.free_mapped(hd)
        gpu.free_mapped(hp)


def test_timing_print(cuda):
    """µs per draft_sample_batch at the vocabulary size (a print for the lead, not an assertion)."""
    from bench.sweep_sample import time_sample

    for m in (1, 64):
        for label, p, dist in (
            ("greedy", SamplingParams(), False),
            ("top-p 0.95", SamplingParams(1.0, 0.95, 0, 1), False),
            ("top-p 0.95 + dist", SamplingParams(1.0, 0.95, 0, 1), True),
            ("top-k 50", SamplingParams(1.0, 1.0, 50, 1), False),
        ):
            us = time_sample(cuda, m, VOCAB, p, dist, iters=20)
            print(f"draft_sample_batch m={m} n={VOCAB} {label}: {us:.1f} us")
