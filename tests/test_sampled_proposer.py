"""Sampled proposes on the host backend: every draft is model.sampling's keyed draw from the
drafter's own logits with its probability, greedy parameters draft exactly the greedy drafts,
seeded calls replay, the distribution buffer holds q(.), and bad parameters are refused with
nothing changed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from model.config import tiny
from model.kernels.keyed_rng import Stream
from model.proposer import MtpProposer, ProposerError
from model.sampling import SampledDrafts, SamplingParams, draw, probabilities
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import bf16_weights, cache_snapshot, make_proposer, upload_rows

CFG = tiny(index_topk=8, index_kpool=2, max_context=96)
WEIGHTS = bf16_weights(CFG, seed=11)
H, V = CFG.hidden_size, CFG.vocab_size
KMAX = 3


class LogitRecorder(MtpProposer):
    """Records each draft's logits as the sampler sees them (eager launches only)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list[np.ndarray] = []

    def _sample(self, m: int, i: int, publish: bool, s: int) -> None:
        self.gpu.synchronize(s)
        logits = np.empty((m, self.head_n), BF16)
        self.gpu.copy_d2h(logits, self.step.logits)
        self.seen.append(logits.astype(np.float32))
        super()._sample(m, i, publish, s)


def _filled(prop, gpu, seqs: int, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(seqs):
        st = prop.alloc_state()
        toks = rng.integers(0, V, rows + 1)
        hid = rng.standard_normal((rows + 2, H)).astype(np.float32)
        p = upload_rows(gpu, hid[:rows])
        prop.catchup_drafter(st, toks, p, 0)
        gpu.free(p)
        out.append((st, int(toks[-1]), hid[rows]))
    return out


PARAMS = [
    SamplingParams(temperature=1.0, seed=3),
    SamplingParams(temperature=0.6, top_k=5, seed=2**63 + 5),
    SamplingParams(temperature=1.3, top_p=0.8, seed=99),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=7),
    SamplingParams(),  # greedy in a sampled batch
]


def test_each_draft_is_the_keyed_draw_from_the_drafters_logits():
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, cls=LogitRecorder, max_sequences=5, max_draft_tokens=KMAX)
    seqs = _filled(prop, gpu, len(PARAMS), 20, seed=1)
    hid = upload_rows(gpu, np.stack([h for _, _, h in seqs]))
    pos = [20] * len(seqs)
    out = prop.propose_batch(
        [s for s, _, _ in seqs], [t for _, t, _ in seqs], hid, pos, KMAX, sampling=PARAMS
    )
    assert isinstance(out, SampledDrafts)
    assert len(prop.seen) == KMAX
    for i, logits in enumerate(prop.seen):
        for b, p in enumerate(PARAMS):
            want = draw(logits[b], p, pos[b], i, Stream.DRAFT)
            assert out.tokens[b, i] == want, (b, i)
            q = probabilities(logits[b], p)[want]
            assert math.isclose(float(out.probs[b, i]), q, rel_tol=1e-5), (b, i, out.probs[b, i], q)
    assert np.all(out.probs[4] == 1.0)
    prop.close()


def test_greedy_parameters_draft_exactly_the_greedy_drafts():
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, max_sequences=2, max_draft_tokens=KMAX)
    ((st, tok, h),) = _filled(prop, gpu, 1, 17, seed=2)
    hp = upload_rows(gpu, h[None])
    greedy = prop.propose(st, tok, hp, 17, KMAX)
    caches = cache_snapshot(prop, st)
    again = prop.propose(st, tok, hp, 17, KMAX, sampling=SamplingParams(seed=5))
    assert again == SampledDrafts(greedy, [1.0] * KMAX)
    for name, a in cache_snapshot(prop, st).items():
        assert np.array_equal(a, caches[name]), name
    prop.close()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_seeded_propose_replays_and_another_seed_draws_otherwise(graphs):
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, max_sequences=4, max_draft_tokens=KMAX, use_graphs=graphs)
    seqs = _filled(prop, gpu, 4, 30, seed=3)
    hid = upload_rows(gpu, np.stack([h for _, _, h in seqs]))
    states, toks = [s for s, _, _ in seqs], [t for _, t, _ in seqs]
    hot = SamplingParams(temperature=5.0, seed=1)
    runs = [prop.propose_batch(states, toks, hid, [30] * 4, KMAX, sampling=hot) for _ in range(3)]
    for r in runs[1:]:
        assert np.array_equal(r.tokens, runs[0].tokens) and np.array_equal(r.probs, runs[0].probs)
    others = [
        prop.propose_batch(
            states, toks, hid, [30] * 4, KMAX, sampling=SamplingParams(temperature=5.0, seed=s)
        )
        for s in range(2, 8)
    ]
    assert any(not np.array_equal(o.tokens, runs[0].tokens) for o in others)
    if graphs:
        assert (4, KMAX, "sampled") in prop.captured_graphs
    prop.close()


def test_the_distribution_buffer_receives_every_drafts_q():
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, cls=LogitRecorder, max_sequences=3, max_draft_tokens=KMAX)
    seqs = _filled(prop, gpu, 3, 25, seed=4)
    hid = upload_rows(gpu, np.stack([h for _, _, h in seqs]))
    params = [PARAMS[1], PARAMS[4], PARAMS[2]]
    dist = gpu.alloc(3 * 2 * V * 4)
    gpu.memset(dist, 0xFF, 3 * 2 * V * 4)
    out = prop.propose_batch(
        [s for s, _, _ in seqs], [t for _, t, _ in seqs], hid, [25] * 3, 2, sampling=params, draft_dist=dist
    )
    q = np.empty((3, 2, V), np.float32)
    gpu.copy_d2h(q, dist)
    for i, logits in enumerate(prop.seen):
        for b, p in enumerate(params):
            want = probabilities(logits[b], p)
            assert np.allclose(q[b, i], want, rtol=1e-5, atol=1e-7), (b, i)
            assert q[b, i, out.tokens[b, i]] == out.probs[b, i]
    prop.close()


def test_bad_sampling_is_refused_before_anything_is_drafted():
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, max_sequences=2, max_draft_tokens=KMAX)
    seqs = _filled(prop, gpu, 2, 15, seed=6)
    hid = upload_rows(gpu, np.stack([h for _, _, h in seqs]))
    states, toks = [s for s, _, _ in seqs], [t for _, t, _ in seqs]
    before = [cache_snapshot(prop, s) for s in states]
    cases = [
        (
            [SamplingParams(temperature=1.0), SamplingParams(temperature=-1.0)],
            None,
            "entry 1 of 2.*temperature",
        ),
        ([SamplingParams(temperature=1.0, top_p=0.0)] * 2, None, "top_p"),
        ([SamplingParams(temperature=1.0, top_k=V + 1)] * 2, None, "top_k"),
        ([SamplingParams(temperature=1.0)], None, "2 states but 1 sampling"),
        (["hot", SamplingParams()], None, "must be a SamplingParams"),
        (SamplingParams(temperature=1.0), gpu.alloc(2 * KMAX * V * 4 - 4), "draft_dist holds"),
    ]
    for sampling, dist, match in cases:
        with pytest.raises(ProposerError, match=match):
            prop.propose_batch(states, toks, hid, [15, 15], KMAX, sampling=sampling, draft_dist=dist)
    for s, b in zip(states, before):
        assert prop.drafter_rows(s) == 15
        after = cache_snapshot(prop, s)
        for name in b:
            assert np.array_equal(after[name], b[name]), name
    prop.close()
