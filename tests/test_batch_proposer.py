"""Batched drafting on the host backend: random histories of batches checked after every step
against a twin proposer that drafts each sequence alone (identical drafts, identical cache bytes),
and the refusals of bad batches (nothing of any sequence changed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st_

from model.config import AttentionConfig, tiny, tiny_rope
from model.proposer import ProposerError
from model.sampling import SamplingParams
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import (
    assert_same_caches,
    bf16_weights,
    cache_snapshot,
    drafts_match_alone,
    make_proposer,
    upload_rows,
)

CFG = tiny(index_topk=8, index_kpool=2, max_context=96)
WEIGHTS = bf16_weights(CFG, seed=5)
H = CFG.hidden_size
# The histories run on each family's block: GLM-5.3-Flash's (NoPE, KPool), GLM-5's and
# DeepSeek-V3.2's (RoPE, per-token indexer; YaRN and group-limited routing for DeepSeek).
FAMILIES = {
    "glm5_next": (CFG, WEIGHTS),
    **{
        fam: (c, bf16_weights(c, seed=6))
        for fam in ("glm_moe_dsa", "deepseek_v32")
        for c in [tiny_rope(family=fam, max_context=96)]
    },
}
# The per-token indexer under NoPE MLA (a glm_moe_dsa config with qk_rope_head_dim 0): no rope key,
# no rotation anywhere.
_NOPE = tiny_rope(max_context=96)
_NOPE = dataclasses.replace(
    _NOPE,
    attention=AttentionConfig(4, 48, 32, 16, 0, 16),
    dsa=dataclasses.replace(_NOPE.dsa, rope_dim=0),
)
FAMILIES["per-token-nope"] = (_NOPE, bf16_weights(_NOPE, seed=7))
SLOTS = 6
KMAX = 3


class Seq:
    """One sequence's target-side facts (a token and a hidden row per position) and its two
    drafter states: in the batched proposer and in the twin that drafts it alone."""

    def __init__(self, cfg, seed: int, a, b) -> None:
        rng = np.random.default_rng(seed)
        n = cfg.dsa.max_context + 2
        self.tokens = rng.integers(0, cfg.vocab_size, n + 1)
        self.hiddens = rng.standard_normal((n + 1, H)).astype(np.float32)
        self.a, self.b = a, b
        # Half the sequences sample (temperature, top-k, top-p drawn at random), half are greedy:
        # batches mix them, as a serving engine's do.
        kind = int(rng.integers(0, 4))
        self.params = (
            SamplingParams()
            if kind == 0
            else SamplingParams(
                temperature=float(rng.choice([0.5, 1.0, 2.0])),
                top_k=int(rng.choice([0, 1, 5])) if kind >= 2 else 0,
                top_p=float(rng.choice([0.3, 0.9, 1.0])) if kind == 3 else 1.0,
                seed=int(rng.integers(0, 2**64, dtype=np.uint64)),
            )
        )


class Pair:
    """The batched proposer (graphs, small buckets so batches need padding) and its twin."""

    def __init__(self, cfg=CFG, weights=WEIGHTS) -> None:
        self.gpu, self.cfg = HostBackend(), cfg
        self.batched = make_proposer(
            cfg,
            weights,
            gpu=self.gpu,
            max_sequences=SLOTS,
            max_draft_tokens=KMAX,
            use_graphs=True,
            batch_buckets=(1, 2, 4, 8),
            context_chunk=5,
        )
        self.alone = make_proposer(cfg, weights, gpu=self.gpu, max_sequences=SLOTS, max_draft_tokens=KMAX)
        self.live: list[Seq] = []

    def check(self, seqs) -> None:
        for q in seqs:
            assert self.batched.drafter_rows(q.a) == self.alone.drafter_rows(q.b)
            assert_same_caches(cache_snapshot(self.batched, q.a), cache_snapshot(self.alone, q.b))

    def close(self) -> None:
        self.batched.close()
        self.alone.close()


def _rows(gpu, q: Seq, base: int, n: int):
    return upload_rows(gpu, q.hiddens[base : base + n])


def _catchup(pair: Pair, seqs: list[Seq], counts: list[int]) -> None:
    gpu = pair.gpu
    bases = [pair.alone.drafter_rows(q.b) for q in seqs]
    ptrs = [_rows(gpu, q, base, max(n, 1)) for q, base, n in zip(seqs, bases, counts)]
    toks = [q.tokens[base : base + n + 1] for q, base, n in zip(seqs, bases, counts)]
    got = pair.batched.catchup_batch([q.a for q in seqs], toks, ptrs, bases)
    want = [pair.alone.catchup_drafter(q.b, t, p, base) for q, t, p, base in zip(seqs, toks, ptrs, bases)]
    assert got == want
    for p in ptrs:
        gpu.free(p)


def _propose(pair: Pair, seqs: list[Seq], backs: list[int], k: int, sampling: bool = False) -> None:
    gpu = pair.gpu
    pos = [max(pair.alone.drafter_rows(q.b) - back, 0) for q, back in zip(seqs, backs)]
    hid = upload_rows(gpu, np.stack([q.hiddens[p] for q, p in zip(seqs, pos)]))
    toks = [int(q.tokens[p + 1]) for q, p in zip(seqs, pos)]
    sampled = sampling and any(not q.params.greedy for q in seqs)
    if sampled:
        got, probs = pair.batched.propose_batch(
            [q.a for q in seqs], toks, hid, pos, k, sampling=[q.params for q in seqs]
        )
        assert probs.shape == (len(seqs), k) and probs.dtype == np.float32
    else:
        got = pair.batched.propose_batch([q.a for q in seqs], toks, hid, pos, k)
    assert got.shape == (len(seqs), k)
    for b, q in enumerate(seqs):
        one = upload_rows(gpu, q.hiddens[pos[b] : pos[b] + 1])
        if sampled:
            want, want_p = pair.alone.propose(q.b, toks[b], one, pos[b], k, sampling=q.params)
            assert probs[b].tolist() == want_p, f"sequence {b}: draft probabilities differ from alone"
        else:
            want = pair.alone.propose(q.b, toks[b], one, pos[b], k)
        gpu.free(one)
        assert list(got[b]) == want, f"sequence {b} of the batch drafted differently than alone"
    gpu.free(hid)


OPS = st_.one_of(
    st_.tuples(st_.just("alloc"), st_.integers(1, 40)),
    st_.tuples(st_.just("propose"), st_.integers(0, 2**32 - 1), st_.integers(1, KMAX), st_.booleans()),
    st_.tuples(st_.just("verify"), st_.integers(0, 2**32 - 1)),
    st_.tuples(st_.just("catchup"), st_.integers(0, 2**32 - 1)),
    st_.tuples(st_.just("rewind"), st_.integers(0, 2**32 - 1)),
    st_.tuples(st_.just("free"), st_.integers(0, 2**32 - 1)),
)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st_.lists(st_.integers(0, 60), min_size=2, max_size=SLOTS),
    ops=st_.lists(OPS, min_size=4, max_size=30),
    seed=st_.integers(0, 10**6),
)
def test_batches_draft_as_each_sequence_alone(family, first, ops, seed):
    """Random subsets and orders of live slots, random positions (rewinds included) and context
    lengths, any acceptance, catch-up, rewind, free and slot reuse, batches that need padding,
    greedy and sampled proposes (sampled batches mixing greedy and sampled sequences): after every
    step every sequence's drafts, draft probabilities and cache bytes equal its twin's, drafted
    alone."""
    cfg = FAMILIES[family][0]
    pair = Pair(*FAMILIES[family])
    rng = np.random.default_rng(seed)
    serial = 0
    proposed: list[Seq] = []
    try:
        for n in first:  # a few sequences to begin with, so that batches are batches
            ops.insert(0, ("alloc", n))
        for op in ops:
            live = pair.live
            if op[0] == "alloc":
                if len(live) >= SLOTS:
                    continue
                serial += 1
                q = Seq(cfg, seed * 1000 + serial, pair.batched.alloc_state(), pair.alone.alloc_state())
                live.append(q)
                _catchup(pair, [q], [min(op[1], cfg.dsa.max_context - KMAX - 8)])
                pair.check([q])
                continue
            if not live:
                continue
            pick = list(np.random.default_rng(op[1]).permutation(len(live)))
            subset = [live[i] for i in pick[: 1 + int(rng.integers(len(live)))]]
            if op[0] == "propose":
                k = op[2]
                subset = [q for q in subset if pair.alone.drafter_rows(q.b) + k + 2 < cfg.dsa.max_context]
                if not subset:
                    continue
                backs = [int(rng.integers(0, 3)) for _ in subset]
                _propose(pair, subset, backs, k, sampling=op[3])
                event(f"propose of {len(subset)} (bucket {pair.batched._bucket(len(subset))})")
                proposed = subset
            elif op[0] == "verify":
                if not proposed or any(q not in live for q in proposed):
                    continue
                acc = [int(rng.integers(0, q.a.last_drafted + 1)) for q in proposed]
                pair.batched.after_verify_batch([q.a for q in proposed], acc)
                for q, a in zip(proposed, acc):
                    pair.alone.after_verify(q.b, a)
                subset, proposed = proposed, []
            elif op[0] == "catchup":
                counts = [
                    int(rng.integers(0, 6)) if pair.alone.drafter_rows(q.b) + 14 < cfg.dsa.max_context else 0
                    for q in subset
                ]
                _catchup(pair, subset, counts)
                event(f"catch-up of {len(subset)}")
            elif op[0] == "rewind":
                q = subset[0]
                n = int(rng.integers(0, pair.alone.drafter_rows(q.b) + 1))
                pair.batched.rewind_to(q.a, n)
                pair.alone.rewind_to(q.b, n)
                subset = [q]
            elif op[0] == "free":
                q = subset[0]
                pair.batched.free_state(q.a)
                pair.alone.free_state(q.b)
                live.remove(q)
                proposed = [p for p in proposed if p is not q]
                continue
            pair.check(live)
    finally:
        pair.close()


# ---- refusals: a clear error, and no sequence of the batch changed ---------------------------------


@pytest.fixture
def filled():
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, max_sequences=4, max_draft_tokens=KMAX, batch_buckets=(1, 2))
    seqs = [Seq(CFG, 50 + i, prop.alloc_state(), None) for i in range(3)]
    for q in seqs:
        p = _rows(gpu, q, 0, 12)
        prop.catchup_drafter(q.a, q.tokens[:13], p, 0)
        gpu.free(p)
    yield gpu, prop, seqs
    prop.close()


def _snapshots(prop, seqs):
    return [(prop.drafter_rows(q.a), cache_snapshot(prop, q.a)) for q in seqs]


def _unchanged(prop, seqs, before):
    for q, (rows, snap) in zip(seqs, before):
        assert prop.drafter_rows(q.a) == rows
        assert_same_caches(cache_snapshot(prop, q.a), snap)


@pytest.mark.parametrize(
    "case, message",
    [
        ("twice", "listed twice"),
        ("freed", "was freed"),
        ("foreign", "belongs to"),
        ("lengths", "2 states but 1 last tokens"),
        ("above_bucket", "largest batch bucket holds 2"),
        ("small_hidden", "holds"),
        ("behind", "catch up the missing rows"),
        ("token", "outside the vocabulary"),
        ("bool_token", "entry 1 of 2: slot .*: last_token must be an integer, got bool"),
        ("float_position", "entry 0 of 2: slot .*: position must be an integer, got float"),
    ],
)
def test_bad_batches_are_refused_and_change_nothing(filled, case, message):
    gpu, prop, seqs = filled
    other = make_proposer(CFG, WEIGHTS, gpu=gpu, max_sequences=1)
    stranger = other.alloc_state()
    dead = prop.alloc_state()
    prop.free_state(dead)
    a, b, c = (q.a for q in seqs)
    rows = prop.drafter_rows(a)
    hid = upload_rows(gpu, np.ones((3, H), np.float32))
    before = _snapshots(prop, seqs)
    args = {
        "twice": ([a, a], [1, 2], hid, [rows, rows]),
        "freed": ([a, dead], [1, 2], hid, [rows, 0]),
        "foreign": ([a, stranger], [1, 2], hid, [rows, 0]),
        "lengths": ([a, b], [1], hid, [rows, rows]),
        "above_bucket": ([a, b, c], [1, 2, 3], hid, [rows] * 3),
        "small_hidden": ([a, b], [1, 2], hid.offset(2 * H * 2), [rows, rows]),
        "behind": ([a, b], [1, 2], hid, [rows, rows + 1]),
        "token": ([a, b], [1, CFG.vocab_size], hid, [rows, rows - 2]),
        "bool_token": ([a, b], [1, True], hid, [rows, rows]),
        "float_position": ([a, b], [1, 2], hid, [float(rows), rows]),
    }[case]
    with pytest.raises(ProposerError, match=message):
        prop.propose_batch(*args, 2)
    _unchanged(prop, seqs, before)
    gpu.free(hid)
    other.close()


def test_bad_catchup_and_verify_batches_change_nothing(filled):
    gpu, prop, seqs = filled
    a, b, _ = (q.a for q in seqs)
    ra, rb = prop.drafter_rows(a), prop.drafter_rows(b)
    good = _rows(gpu, seqs[0], ra, 3)
    nan = upload_rows(gpu, np.where(np.arange(H) == 2, np.nan, 1.0)[None].repeat(3, 0))
    before = _snapshots(prop, seqs)
    toks = [seqs[0].tokens[ra : ra + 4], seqs[1].tokens[rb : rb + 4]]
    with pytest.raises(ProposerError, match="entry 1 of 2: slot .*not finite"):
        prop.catchup_batch([a, b], toks, [good, nan], [ra, rb])
    with pytest.raises(ProposerError, match="entry 1 of 2: slot .*feed starts at row"):
        prop.catchup_batch([a, b], toks, [good, good], [ra, rb + 1])
    with pytest.raises(ProposerError, match="listed twice"):
        prop.catchup_batch([a, a], toks, [good, good], [ra, ra])
    with pytest.raises(ProposerError, match="accepted=1 outside 0..0"):
        prop.after_verify_batch([a, b], [0, 1])
    _unchanged(prop, seqs, before)
    gpu.free(good)
    gpu.free(nan)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_flagged_batch_rewinds_only_the_sequences_ahead_of_their_position(graphs):
    """Sequence 0 proposes behind its two unverified drafts, sequence 1 at its rows after two of
    its own, with a NaN in its hidden row: the refused step leaves sequence 0 rewound to its
    position with nothing to trim, and sequence 1 as it was (rows, drafts to verify, caches)."""
    gpu = HostBackend()
    prop = make_proposer(CFG, WEIGHTS, gpu=gpu, max_sequences=2, max_draft_tokens=KMAX, use_graphs=graphs)
    seqs = [Seq(CFG, 90 + i, prop.alloc_state(), None) for i in range(2)]
    for q in seqs:
        p = _rows(gpu, q, 0, 12)
        prop.catchup_drafter(q.a, q.tokens[:13], p, 0)
        gpu.free(p)
        p = _rows(gpu, q, 12, 1)
        prop.propose(q.a, int(q.tokens[13]), p, 12, 2)
        gpu.free(p)
    a, c = seqs[0].a, seqs[1].a
    below = cache_snapshot(prop, a)
    before = _snapshots(prop, seqs[1:])
    hid = upload_rows(gpu, np.stack([seqs[0].hiddens[12], np.full(H, np.nan)]))
    with pytest.raises(ProposerError, match="entry 1 of 2: slot .* at position 14: target_hidden is not"):
        prop.propose_batch([a, c], [int(seqs[0].tokens[13]), 5], hid, [12, 14], 2)
    assert (a.rows, a.last_drafted, c.rows, c.last_drafted) == (12, 0, 14, 2)
    now = cache_snapshot(prop, a)
    for name in now:
        np.testing.assert_array_equal(now[name], below[name][: len(now[name])], err_msg=name)
    _unchanged(prop, seqs[1:], before)
    prop.after_verify(c, 2)  # its drafts are still there to verify
    gpu.free(hid)
    prop.close()


class FakeTensor:
    """A stand-in for a PyTorch tensor on the host backend: only its __cuda_array_interface__."""

    def __init__(self, ptr, shape, typestr="<V2", strides=None):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr.addr, False),
            "strides": strides,
            "version": 2,
        }


def test_cuda_array_interface_rows_are_read_and_checked(filled):
    gpu, prop, seqs = filled
    a, b, _ = (q.a for q in seqs)
    rows = prop.drafter_rows(a)
    hid = upload_rows(gpu, np.stack([seqs[0].hiddens[rows], seqs[1].hiddens[rows]]))
    toks = [int(seqs[0].tokens[rows + 1]), int(seqs[1].tokens[rows + 1])]
    before = _snapshots(prop, seqs)
    for bad, msg in (
        (FakeTensor(hid, (2, H + 1)), "shape"),
        (FakeTensor(hid, (2, H), typestr="<f2"), "dtype"),
        (FakeTensor(hid, (2, H), strides=(2, 2 * 2)), "C-contiguous"),
    ):
        with pytest.raises(ProposerError, match=msg):
            prop.propose_batch([a, b], toks, bad, [rows, rows], 2)
    _unchanged(prop, seqs, before)
    via_ptr = prop.propose_batch([a, b], toks, hid, [rows, rows], 2)
    via_cai = prop.propose_batch([a, b], toks, FakeTensor(hid, (2, H)), [rows, rows], 2, stream=prop.stream)
    np.testing.assert_array_equal(via_ptr, via_cai)
    gpu.free(hid)


def test_the_tensor_core_head_keeps_batches_invariant():
    """tensor_core_head swaps the head kernel for every batch of the proposer: a sequence drafts
    the same in a padded batch of three as alone, and the option is refused where it cannot run."""
    gpu = HostBackend()
    mk = dict(gpu=gpu, max_sequences=4, max_draft_tokens=KMAX, tensor_core_head=True)
    batched = make_proposer(CFG, WEIGHTS, use_graphs=True, batch_buckets=(1, 4), **mk)
    alone = make_proposer(CFG, WEIGHTS, **mk)
    seqs = [Seq(CFG, 70 + i, batched.alloc_state(), alone.alloc_state()) for i in range(3)]
    pair = Pair.__new__(Pair)
    pair.gpu, pair.batched, pair.alone, pair.live = gpu, batched, alone, seqs
    _catchup(pair, seqs, [9, 20, 13])
    _propose(pair, seqs, [0, 1, 2], KMAX)
    pair.check(seqs)
    pair.close()
    with pytest.raises(ProposerError, match="tensor_core_head needs the FP8 head"):
        make_proposer(CFG, WEIGHTS, gpu=gpu, fp8_head=False, tensor_core_head=True)


def test_tensor_core_projections_keep_the_host_bits():
    """The tensor-core projections' twins are the CUDA-core kernels' arithmetic, so on the host a
    proposer with them drafts and caches exactly what one without them does, batch against alone,
    at shapes where every projection takes the tensor-core form (k a multiple of 64); the default
    follows the proposer's size."""
    cfg = dataclasses.replace(
        tiny(heads=2, index_topk=8, index_kpool=2, max_context=96),
        attention=AttentionConfig(2, 64, 64, 64, 0, 64),
    )
    weights = bf16_weights(cfg, seed=11)
    gpu = HostBackend()
    mk = dict(gpu=gpu, max_sequences=4, max_draft_tokens=KMAX, o_proj_groups=1)
    batched = make_proposer(
        cfg, weights, use_graphs=True, batch_buckets=(1, 4), tensor_core_projections=True, **mk
    )
    lay = batched.layer
    assert (lay.tc_fused, lay.tc_q, lay.tc_wk, lay.tc_wv, lay.tc_o) == (True,) * 5
    alone = make_proposer(cfg, weights, tensor_core_projections=False, **mk)
    assert not alone.layer.tc_fused and not alone.layer.tc_o
    drafts_match_alone(gpu, cfg, batched, alone, KMAX, [[9, 20, 13], [3, 1, 4]])
    batched.close()
    alone.close()
    for n, want in ((1, False), (4, True)):
        prop = make_proposer(CFG, WEIGHTS, gpu=gpu, max_sequences=n)
        assert prop.tensor_core_projections is want
        prop.close()
