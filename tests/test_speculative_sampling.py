"""Sampled speculative decoding is lossless: its emitted tokens are distributed exactly as the
target's own samples (``sample_decode``), for any drafter distribution q.

The statistical test (every use below): over N seeds, the emitted tokens' outcomes are counted in
cells; each cell's expected count under the exact law is N x its probability, computed from the
target's logits with ``model.sampling.probabilities`` (sample_decode's law by construction, and
``sample_decode`` itself is run through the same test). Cells with expected count < 5 are pooled
into one (grown from the next rarest cells until it reaches 5). Pearson's X^2 = sum (O - E)^2 / E
is compared with the chi-square critical value at ALPHA = 1e-3 with df = cells - 1 (nothing is
estimated from the data). An outcome the exact law gives probability 0 (a token outside top-k or
top-p) fails at once. The same harness, at the same N, must reject deliberately wrong verifiers
(accept with min(1, q/p); resample from p instead of the residual): that is its power.

The seeds are fixed, so the results are deterministic; a benign change to the keying redraws them,
and then each test has the stated 1e-3 chance of failing spuriously.

Cost: the target is a random tiny checkpoint (vocabulary 12, one layer) behind a cache of its
logits by prefix (``CachedTarget``: the logits of a prefix are a function of the prefix, so each is
computed once by the real TargetModel on the host backend); the drafter in the law tests is
``FakeDrafter``, which follows propose's sampled contract with known distributions q far from the
target's (so rejections, residual draws and bonus draws all happen).
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import model.speculative as spec
from model.checkpoint import Checkpoint, mtp_tensors, random_checkpoint, target_tensors
from model.config import tiny
from model.kernels.keyed_rng import Stream, uniforms
from model.proposer import MtpProposer, ProposerOptions
from model.sampling import GREEDY, SampledDrafts, SamplingParams, draw, draw_from, probabilities
from model.speculative import greedy_decode, sample_decode, speculative_decode, verify_sampled
from model.target import TargetModel
from runtime.host_backend import HostBackend

ALPHA = 1e-3
MIN_EXPECTED = 5.0
V = 12
SERVED = 48
PROMPT = [3, 7, 1, 10]
N_NEW = 3  # the joint law of the first three emitted tokens is tested

# ---- the chi-square distribution, exactly (no SciPy in the dependencies) -----------------------


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df), by the closed forms of the regularised upper incomplete
    gamma function at integer and half-integer shape, summed in log space."""
    if x <= 0:
        return 1.0
    h = x / 2
    if df % 2 == 0:
        logs = [j * math.log(h) - math.lgamma(j + 1) for j in range(df // 2)]
        head = 0.0
    else:
        logs = [(j - 0.5) * math.log(h) - math.lgamma(j + 0.5) for j in range(1, (df - 1) // 2 + 1)]
        head = math.erfc(math.sqrt(h))
    if not logs:
        return head
    m = max(logs)
    return head + math.exp(m - h + math.log(sum(math.exp(v - m) for v in logs)))


def chi2_critical(alpha: float, df: int) -> float:
    """The x with chi2_sf(x, df) == alpha (bisection: sf is decreasing)."""
    lo, hi = 0.0, df + 50.0 * math.sqrt(2 * df) + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def test_chi2_matches_published_values():
    # SciPy's chi2.isf / chi2.sf, pinned.
    for alpha, df, x in [
        (0.05, 1, 3.8414588206941285),
        (1e-3, 1, 10.827566170662733),
        (1e-3, 2, 13.815510557964274),
        (1e-3, 7, 24.321886347856854),
        (1e-3, 10, 29.58829844507442),
        (1e-3, 100, 149.4492527790389),
        (1e-3, 311, 393.80003469905034),
        (1e-6, 40, 97.65295741506304),
    ]:
        assert chi2_critical(alpha, df) == pytest.approx(x, rel=1e-9)
    assert chi2_sf(150.0, 100) == pytest.approx(0.0009039320423540184, rel=1e-9)
    assert chi2_sf(7.3, 3) == pytest.approx(0.06292623645904312, rel=1e-9)
    assert chi2_sf(2000, 1500) == pytest.approx(5.809910989761926e-17, rel=1e-7)


# ---- the statistical test ----------------------------------------------------------------------


def pooled_cells(law: dict, n: int) -> list[list]:
    """Cells of outcomes: each with expected count >= MIN_EXPECTED alone, the rest pooled into
    one cell grown from the next rarest outcomes until it reaches MIN_EXPECTED too."""
    keys = sorted(law, key=lambda o: (-law[o], o))
    big = [o for o in keys if n * law[o] >= MIN_EXPECTED]
    rest = [o for o in keys if n * law[o] < MIN_EXPECTED]
    while rest and n * sum(law[o] for o in rest) < MIN_EXPECTED and big:
        rest.append(big.pop())
    cells = [[o] for o in big]
    if rest:
        cells.append(rest)
    return cells


def chi2_gof(counts: Counter, law: dict) -> tuple[float, int, float]:
    """(X^2, df, critical value at ALPHA) of the observed ``counts`` against the exact ``law``."""
    n = sum(counts.values())
    impossible = [o for o in counts if law.get(o, 0.0) <= 0.0]
    assert not impossible, f"outcomes of probability 0 were emitted: {impossible[:5]}"
    cells = pooled_cells(law, n)
    x2 = 0.0
    for cell in cells:
        e = n * sum(law[o] for o in cell)
        x2 += (sum(counts[o] for o in cell) - e) ** 2 / e
    df = len(cells) - 1
    return x2, df, chi2_critical(ALPHA, df)


def chi2_homogeneity(a: Counter, b: Counter, law: dict) -> tuple[float, int, float]:
    """Two-sample X^2 (a 2 x cells table) of ``a`` against ``b``, on the cells ``law`` defines
    for their size (the cells do not depend on the data)."""
    na, nb = sum(a.values()), sum(b.values())
    cells = pooled_cells(law, min(na, nb))
    x2 = 0.0
    for cell in cells:
        oa, ob = sum(a[o] for o in cell), sum(b[o] for o in cell)
        tot = oa + ob
        if tot == 0:
            continue
        ea, eb = na * tot / (na + nb), nb * tot / (na + nb)
        x2 += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    df = len(cells) - 1
    return x2, df, chi2_critical(ALPHA, df)


# ---- the target behind a cache, and a drafter with known distributions --------------------------


class CachedTarget:
    """The TargetModel interface speculative_decode and sample_decode use, backed by one real
    TargetModel: a prefix's logits row is computed once (by rewinding the real state to the common
    prefix and forwarding the rest) and then served from the cache. ``hidden=True`` makes
    ``hidden_rows`` bring the real state to the caller's prefix first (a real drafter reads them);
    the fake drafter never reads them."""

    def __init__(self, real: TargetModel, *, hidden: bool) -> None:
        self.real, self.hidden = real, hidden
        self.gpu, self.cfg, self.rows_cap = real.gpu, real.cfg, real.rows_cap
        self.cache: dict[tuple, np.ndarray] = {}
        self.real_st = real.alloc_state()
        self.real_tokens: list[int] = []
        self.misses = 0

    def alloc_state(self):
        return SimpleNamespace(tokens=[], length=0)

    def free_state(self, st) -> None:
        pass

    def rewind_to(self, st, n: int) -> None:
        assert 0 <= n <= st.length
        del st.tokens[n:]
        st.length = n

    def _sync(self, key: tuple) -> None:
        n = 0
        while n < min(len(key), len(self.real_tokens)) and key[n] == self.real_tokens[n]:
            n += 1
        self.real.rewind_to(self.real_st, n)
        if len(key) > n:
            lg = self.real.forward(self.real_st, list(key[n:]), n)
            for i in range(len(key) - n):
                self.cache.setdefault(key[: n + i + 1], lg[i])
            self.misses += len(key) - n
        self.real_tokens = list(key)

    def logits_after(self, prefix) -> np.ndarray:
        key = tuple(int(t) for t in prefix)
        if key not in self.cache:
            self._sync(key)
        return self.cache[key]

    def forward(self, st, tokens, start: int) -> np.ndarray:
        assert start == st.length
        rows = []
        for t in tokens:
            st.tokens.append(int(t))
            rows.append(self.logits_after(st.tokens))
        st.length = len(st.tokens)
        return np.stack(rows)

    def hidden_rows(self, st, row: int):
        if self.hidden and tuple(self.real_tokens[: st.length]) != tuple(st.tokens):
            self._sync(tuple(st.tokens))
        return self.real.hidden_rows(self.real_st, row)


class FakeDrafter:
    """propose's sampled contract with known distributions. q_i is a fixed random function of
    (position, i, the token before the draft): a random distribution of sharpness ``scale``, mixed
    with weight ``mix`` with the target's own p at the draft's prefix (``target``, when given: so
    drafts are accepted often enough for every branch of the verifier to run), then a random third
    of the vocabulary set to probability 0 (mass the target has there comes only from residual
    draws). Draft i is the keyed Gumbel-max draw from q_i at (seed, position, i, Stream.DRAFT);
    ``draft_dist`` receives the q_i rows (f32) through the backend's copy_h2d. Greedy (sampling
    None): the argmax of q_i. Rows are counted as MtpProposer counts them (row r pairs token
    r + 1 with hidden r), and the tokens they stand for are tracked, checked against the calls."""

    def __init__(
        self,
        gpu,
        *,
        target: CachedTarget | None = None,
        mix: float = 0.0,
        scale: float = 2.0,
        tag: int = 0,
        rows: int = SERVED,
    ) -> None:
        self.gpu, self.target, self.mix, self.scale, self.tag = gpu, target, mix, scale, tag
        self.drafter_context_rows = rows
        self._r: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.proposes = 0

    def q(self, prefix: list[int], position: int, i: int, sampling: SamplingParams | None) -> np.ndarray:
        key = (position, i, prefix[-1])
        if key not in self._r:
            rng = np.random.default_rng([self.tag, position, i, prefix[-1]])
            z = rng.normal(size=V) * self.scale
            e = np.exp(z - z.max())
            self._r[key] = (e / e.sum(), rng.permutation(V)[: V // 3])
        r, zero = self._r[key]
        q = (1 - self.mix) * r
        if self.mix and sampling is not None:
            q = q + self.mix * probabilities(self.target.logits_after(prefix), sampling)
        q[zero] = 0.0
        return (q / q.sum()).astype(np.float32)

    def alloc_state(self):
        return SimpleNamespace(rows=0, drafted=0, seq=[], pos=None)

    def free_state(self, st) -> None:
        pass

    def prefill_drafter(self, st, tokens, hidden) -> None:
        self.catchup_drafter(st, tokens, hidden, 0)

    def drafter_rows(self, st) -> int:
        return st.rows

    def catchup_drafter(self, st, tokens, hidden, base) -> None:
        assert base == st.rows and len(st.seq) >= base
        st.seq = st.seq[:base] + [int(t) for t in tokens]
        st.rows = base + len(tokens) - 1

    def rewind_to(self, st, n) -> None:
        assert 0 <= n <= st.rows
        st.rows, st.seq = n, st.seq[: n + 1]

    def after_verify(self, st, accepted) -> None:
        assert 0 <= accepted <= st.drafted
        st.rows = st.pos + min(st.drafted, accepted + 1)
        st.seq = st.seq[: st.pos + 2 + accepted]
        st.drafted = 0

    def propose(self, st, last_token, target_hidden, position, k, *, sampling=None, draft_dist=None):
        assert st.rows >= position and position + k <= self.drafter_context_rows
        assert len(st.seq) >= position + 1
        self.proposes += 1
        seq = st.seq[: position + 1] + [int(last_token)]
        tokens, probs, rows = [], [], []
        for i in range(k):
            q = self.q(seq, position, i, sampling)
            if sampling is None:
                d = int(np.argmax(q))
            else:
                d = draw_from(q, sampling.seed, position, i, Stream.DRAFT)
            tokens.append(d)
            probs.append(float(q[d]))
            rows.append(q)
            seq.append(d)
        st.rows, st.drafted, st.pos, st.seq = position + k, k, position, seq
        if sampling is None:
            return tokens
        if draft_dist is not None:
            assert self.gpu.bytes_from(draft_dist) >= k * V * 4
            self.gpu.copy_h2d(draft_dist, np.stack(rows))
        return SampledDrafts(tokens, probs)


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny(index_topk=8, index_kpool=2, max_context=64, num_hidden_layers=1, vocab_size=V)
    return random_checkpoint(tmp_path_factory.mktemp("spec-sampling"), cfg, seed=5, progress=False)


@pytest.fixture(scope="module")
def models(ckpt):
    """(backend, config, a plain TargetModel, a CachedTarget over a second one)."""
    gpu = HostBackend()
    ck = Checkpoint(ckpt)
    cfg = ck.config
    plain = TargetModel(gpu, cfg, target_tensors(ck, cfg), SERVED)
    cached = CachedTarget(TargetModel(gpu, cfg, target_tensors(ck, cfg), SERVED), hidden=False)
    yield gpu, cfg, plain, cached
    cached.real.free_state(cached.real_st)
    cached.real.close()
    plain.close()
    assert gpu.stats().live_bytes == 0


def exact_law(target: CachedTarget, sampling: SamplingParams, n: int = N_NEW) -> dict[tuple, float]:
    """The exact joint law of sample_decode's first ``n`` tokens after PROMPT."""
    law: dict[tuple, float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == n:
            law[tuple(prefix)] = prob
            return
        p = probabilities(target.logits_after(PROMPT + prefix), sampling)
        for x in np.flatnonzero(p > 0):
            walk(prefix + [int(x)], prob * float(p[x]))

    walk([], 1.0)
    assert abs(sum(law.values()) - 1.0) < 1e-9
    return law


def spec_counts(target, drafter, sampling, k: int, seeds) -> Counter:
    out = Counter()
    for s in seeds:
        toks, _ = speculative_decode(target, drafter, PROMPT, N_NEW, k, sampling=replace(sampling, seed=s))
        out[tuple(toks)] += 1
    return out


def sample_counts(target, sampling, seeds) -> Counter:
    return Counter(tuple(sample_decode(target, PROMPT, N_NEW, replace(sampling, seed=s))) for s in seeds)


def test_the_cached_target_serves_the_models_own_logits(models):
    """The harness's cache is the model: a prefix's row equals a fresh forward of it, bit for bit."""
    _, _, plain, cached = models
    rng = np.random.default_rng(1)
    for n in (1, 2, 5):
        for _ in range(3):
            prefix = PROMPT + [int(t) for t in rng.integers(0, V, n)]
            st = plain.alloc_state()
            try:
                want = plain.forward(st, prefix, 0)[-1]
            finally:
                plain.free_state(st)
            assert np.array_equal(cached.logits_after(prefix), want)


# (temperature, top_k, top_p, k): k = 1 puts a bonus token inside the tested window (draft at
# P + 1, bonus at P + 2); k = 2 two drafts (P + 1, P + 2), residual draws at either.
CONFIGS = [
    (0.7, 0, 1.0, 2),
    (1.0, 0, 1.0, 1),
    (1.5, 0, 1.0, 2),
    (1.0, 4, 1.0, 2),
    (1.5, 0, 0.95, 1),
    (2.0, 6, 0.9, 2),
]
N_SEEDS = 800
MIX = 0.6  # the fake drafter's weight on the target's p: drafts accepted about half the time


def fake_drafter(gpu, target, k: int) -> FakeDrafter:
    return FakeDrafter(gpu, target=target, mix=MIX, tag=k)


@pytest.mark.parametrize("temperature,top_k,top_p,k", CONFIGS)
def test_sampled_speculative_decoding_has_the_targets_law(models, temperature, top_k, top_p, k):
    gpu, cfg, _, target = models
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    law = exact_law(target, sampling)
    drafter = fake_drafter(gpu, target, k)
    got = spec_counts(target, drafter, sampling, k, range(N_SEEDS))
    x2, df, crit = chi2_gof(got, law)
    assert df >= 5, "a degenerate law tests little"
    assert x2 < crit, (x2, df, crit)
    # sample_decode through the same test, on other seeds, and the two samples against each other.
    ref = sample_counts(target, sampling, range(10**6, 10**6 + N_SEEDS))
    x2s, dfs, crits = chi2_gof(ref, law)
    assert x2s < crits, (x2s, dfs, crits)
    x2h, dfh, crith = chi2_homogeneity(got, ref, law)
    assert x2h < crith, (x2h, dfh, crith)


# ---- power: wrong verifiers through the same harness --------------------------------------------


def wrong_ratio(target_logits, drafts, draft_probs, draft_dists, sampling, position):
    """Accepts with min(1, q/p) instead of min(1, p/q)."""
    for j, d in enumerate(drafts):
        p = probabilities(target_logits[j], sampling)
        u = float(uniforms(sampling.seed, position + j, j, Stream.ACCEPT)[0])
        if p[d] > 0 and u < draft_probs[j] / p[d]:
            continue
        r = np.maximum(p - np.asarray(draft_dists[j], np.float64), 0)
        return j, draw_from(r if r.sum() > 0 else p, sampling.seed, position + j, j, Stream.RESAMPLE)
    k = len(drafts)
    return k, draw(target_logits[k], sampling, position + k, k, Stream.RESAMPLE)


def no_residual(target_logits, drafts, draft_probs, draft_dists, sampling, position):
    """The right accept test, but a rejected draft is replaced by a draw from p, not the residual."""
    for j, d in enumerate(drafts):
        p = probabilities(target_logits[j], sampling)
        u = float(uniforms(sampling.seed, position + j, j, Stream.ACCEPT)[0])
        if u < p[d] / draft_probs[j]:
            continue
        return j, draw(target_logits[j], sampling, position + j, j, Stream.RESAMPLE)
    k = len(drafts)
    return k, draw(target_logits[k], sampling, position + k, k, Stream.RESAMPLE)


# Measured over 10 disjoint batches of N_SEEDS seeds each (the correct verifier beside them):
#   config             correct   min(1, q/p)   resample from p
#   (0.7, -, -, k=2)    0/10       10/10          10/10
#   (1.0, -, -, k=1)    1/10       10/10           1/10
#   (1.5, -, -, k=2)    0/10       10/10          10/10
#   (1.0, 4, -, k=2)    0/10       10/10          10/10
#   (1.5, -, .95, k=1)  0/10        9/10           3/10
#   (2.0, 6, .9, k=2)   0/10       10/10          10/10
# (k = 1 tests a single verified draft in the window: less to get wrong there.) The one correct
# rejection was X^2 = 35.3 at df 12; the 30 batches of that config pooled give 55.6 at df 57.
@pytest.mark.parametrize("wrong", [wrong_ratio, no_residual])
@pytest.mark.parametrize("temperature,top_k,top_p,k", [CONFIGS[2], CONFIGS[5]])
def test_the_law_test_rejects_a_wrong_verifier(models, monkeypatch, wrong, temperature, top_k, top_p, k):
    gpu, cfg, _, target = models
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    law = exact_law(target, sampling)
    monkeypatch.setattr(spec, "verify_sampled", wrong)
    got = spec_counts(target, fake_drafter(gpu, target, k), sampling, k, range(N_SEEDS))
    x2, df, crit = chi2_gof(got, law)
    assert x2 > crit, (x2, df, crit)


# ---- verify_sampled alone -----------------------------------------------------------------------


def random_step(rng, k: int, sampling: SamplingParams):
    """Target logits rows [k + 1, V] and, per draft, a q that is half the target's p and half a
    random distribution with a third of the vocabulary at 0."""
    logits = (rng.normal(size=(k + 1, V)) * 2.5).astype(np.float32)
    qs = []
    for j in range(k):
        r = rng.dirichlet(np.full(V, 0.5))
        q = 0.5 * probabilities(logits[j], sampling) + 0.5 * r
        q[rng.permutation(V)[: V // 3]] = 0
        qs.append((q / q.sum()).astype(np.float32))
    return logits, np.stack(qs)


def drafts_from(qs: np.ndarray, seed: int, position: int) -> tuple[list[int], list[float]]:
    d = [draw_from(q, seed, position, j, Stream.DRAFT) for j, q in enumerate(qs)]
    return d, [float(qs[j, t]) for j, t in enumerate(d)]


def test_verify_sampled_emits_the_targets_law_at_every_draft_and_the_bonus():
    """One step of k = 3, fixed rows, many seeds: the first emitted token has law p_0; given
    draft 1 accepted, the second has law p_1; given drafts 1..2, p_2; given all three, the bonus
    has law p_3 (rejection sampling's guarantee, draft by draft)."""
    k, n = 3, 1500
    sampling = SamplingParams(temperature=1.3, top_k=9)
    logits, qs = random_step(np.random.default_rng(7), k, sampling)
    at = [Counter() for _ in range(k + 1)]
    for s in range(n):
        sp = replace(sampling, seed=s)
        d, qd = drafts_from(qs, s, 40)
        a, nxt = verify_sampled(logits, d, qd, qs, sp, 42)
        for j, t in enumerate(d[:a] + [nxt]):
            at[j][(t,)] += 1
    reached = [sum(c.values()) for c in at]
    assert reached[0] == n and reached[k] > 150, reached  # every branch ran, the bonus too
    for j in range(k + 1):
        p = probabilities(logits[j], sampling)
        x2, df, crit = chi2_gof(at[j], {(t,): float(p[t]) for t in np.flatnonzero(p > 0)})
        assert x2 < crit, (j, x2, df, crit)


def test_verify_sampled_with_q_equal_to_p_accepts_everything():
    sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=3)
    logits = np.random.default_rng(2).normal(size=(4, V)).astype(np.float32) * 2
    qs = np.stack([probabilities(row, sampling) for row in logits[:3]])
    for pos in range(30):
        d, qd = drafts_from(qs, sampling.seed, pos)
        assert verify_sampled(logits, d, [float(qs[j, t]) for j, t in enumerate(d)], qs, sampling, pos) == (
            3,
            draw(logits[3], sampling, pos + 3, 3, Stream.RESAMPLE),
        )


def test_verify_sampled_greedy_params_are_greedy_verification():
    logits = np.random.default_rng(4).normal(size=(3, V)).astype(np.float32)
    g = [int(np.argmax(r)) for r in logits]
    one_hot = np.eye(V, dtype=np.float32)
    assert verify_sampled(logits, g[:2], [1.0, 1.0], one_hot[g[:2]], GREEDY, 5) == (2, g[2])
    wrong = (g[1] + 1) % V
    assert verify_sampled(logits, [g[0], wrong], [1.0, 1.0], one_hot[[g[0], wrong]], GREEDY, 5) == (1, g[1])


def test_verify_sampled_rejects_a_draft_the_target_cannot_emit():
    """A draft outside the target's top-k has p = 0: never accepted, and the residual is p."""
    sampling = SamplingParams(temperature=1.0, top_k=2)
    logits = np.random.default_rng(5).normal(size=(2, V)).astype(np.float32)
    p = probabilities(logits[0], sampling)
    out = np.flatnonzero(p == 0)[0]
    q = np.full((1, V), 1.0 / V, np.float32)
    for s in range(50):
        a, nxt = verify_sampled(logits, [out], [1.0 / V], q, replace(sampling, seed=s), 9)
        assert a == 0 and p[nxt] > 0


def test_verify_sampled_is_a_pure_function_of_its_key():
    sampling = SamplingParams(temperature=1.5, seed=11)
    logits, qs = random_step(np.random.default_rng(8), 2, sampling)
    d, qd = drafts_from(qs, 11, 20)
    runs = {pos: verify_sampled(logits, d, qd, qs, sampling, pos) for pos in range(60)}
    assert runs == {pos: verify_sampled(logits, d, qd, qs, sampling, pos) for pos in range(60)}
    assert len(set(runs.values())) > 3  # the position is in the key
    by_seed = {verify_sampled(logits, d, qd, qs, replace(sampling, seed=s), 20) for s in range(60)}
    assert len(by_seed) > 3


@pytest.mark.parametrize(
    "change, msg",
    [
        (dict(target_logits=np.zeros((2, V), np.float32)), r"shape \(2, 12\), expected \[3, V\]"),
        (dict(draft_probs=[0.5]), "1 draft probabilities for 2 drafts"),
        (dict(draft_dists=np.full((2, V - 1), 0.1)), r"draft_dists of shape \(2, 11\)"),
        (dict(drafts=[1, V]), "outside the vocabulary 0..11"),
        (dict(draft_probs=[0.5, 0.0]), "must be finite and > 0"),
        (dict(draft_probs=[0.5, float("nan")]), "must be finite and > 0"),
        (dict(draft_dists=np.full((2, V), -0.1)), "draft_dists must be finite and >= 0"),
        (dict(position=-1), "position -1"),
        (dict(sampling=SamplingParams(temperature=1.0, top_k=V + 1)), "top_k 13"),
    ],
)
def test_verify_sampled_refuses_bad_input(change, msg):
    args = dict(
        target_logits=np.zeros((3, V), np.float32),
        drafts=[1, 2],
        draft_probs=[0.5, 0.5],
        draft_dists=np.full((2, V), 1.0 / V),
        sampling=SamplingParams(temperature=1.0),
        position=4,
    )
    args.update(change)
    with pytest.raises(ValueError, match=msg):
        verify_sampled(**args)


# ---- the loop and sample_decode on the model itself -----------------------------------------------


@pytest.fixture(scope="module")
def real_drafter(ckpt, models):
    gpu, cfg, plain, _ = models
    d = MtpProposer(
        gpu,
        cfg,
        mtp_tensors(Checkpoint(ckpt), cfg),
        ProposerOptions(served_max_seq_len=SERVED, max_draft_tokens=4, max_sequences=1),
        tables=plain.tables,
    )
    yield d
    d.close()


LONG_PROMPT = [5, 1, 9, 9, 2, 0, 7, 3]


def test_greedy_params_are_exactly_greedy_decoding(models, real_drafter):
    """Greedy params (temperature 0, whatever top-k, top-p and seed say) take today's greedy path:
    bit-identical to greedy_decode, with the real drafter, with and without re-feeding."""
    gpu, cfg, plain, _ = models
    ref = greedy_decode(plain, LONG_PROMPT, 16)
    assert sample_decode(plain, LONG_PROMPT, 16, GREEDY) == ref
    assert sample_decode(plain, LONG_PROMPT, 16, SamplingParams(top_k=3, top_p=0.5, seed=9)) == ref
    for sp, refeed in ((None, False), (GREEDY, False), (SamplingParams(top_k=2, seed=123), True)):
        out, stats = speculative_decode(
            plain, real_drafter, LONG_PROMPT, 16, 3, sampling=sp, refeed_target_hidden=refeed
        )
        assert out == ref and stats.steps > 0


def emitted_are_possible(target: CachedTarget, prompt, out, sampling) -> bool:
    return all(
        probabilities(target.logits_after(prompt + out[:i]), sampling)[t] > 0 for i, t in enumerate(out)
    )


def test_seeded_runs_reproduce_and_seeds_differ(models):
    """On the real TargetModel (no cache), long decodes with the fake drafter, with and without
    re-feeding: a seed gives the same tokens every run, different seeds give different tokens,
    the first token is sample_decode's for the seed, every emitted token has target probability
    > 0 under top-k / top-p, accepts and rejects both happen, and the step's draft-distribution
    buffer is freed."""
    gpu, cfg, plain, cached = models
    sampling = SamplingParams(temperature=1.3, top_k=7, top_p=0.95)
    drafter = fake_drafter(gpu, cached, 3)
    live = gpu.stats().live_bytes
    outs = []
    for s, refeed in ((0, False), (1, False), (2, True), (3, True)):
        sp = replace(sampling, seed=s)
        a, stats = speculative_decode(
            plain, drafter, LONG_PROMPT, 16, 3, sampling=sp, refeed_target_hidden=refeed
        )
        if s % 2 == 0:
            b, _ = speculative_decode(
                plain, drafter, LONG_PROMPT, 16, 3, sampling=sp, refeed_target_hidden=refeed
            )
            assert a == b
        assert len(a) == 16 and a[0] == sample_decode(plain, LONG_PROMPT, 1, sp)[0]
        assert emitted_are_possible(cached, LONG_PROMPT, a, sampling)
        assert 0 < stats.accepted_total < 15 and stats.steps < 15, stats.summary()
        outs.append(tuple(a))
    assert len(set(outs)) == 4
    assert gpu.stats().live_bytes == live


def test_sample_decode_reproduces_and_seeds_differ(models):
    _, _, plain, cached = models
    sp = SamplingParams(temperature=1.5, top_p=0.9, seed=4)
    a = sample_decode(plain, LONG_PROMPT, 12, sp)
    assert a == sample_decode(plain, LONG_PROMPT, 12, sp)
    assert emitted_are_possible(cached, LONG_PROMPT, a, sp)
    assert len({tuple(sample_decode(plain, LONG_PROMPT, 12, replace(sp, seed=s))) for s in range(4)}) == 4


@pytest.mark.parametrize(
    "sampling, msg",
    [
        (SamplingParams(temperature=-1.0), "temperature -1.0"),
        (SamplingParams(temperature=1.0, top_p=0.0), "top_p 0.0"),
        (SamplingParams(temperature=1.0, top_k=V + 1), "top_k 13"),
        (SamplingParams(temperature=1.0, seed=-1), "seed"),
    ],
)
def test_bad_sampling_is_refused_before_anything_runs(models, sampling, msg):
    gpu, _, plain, cached = models
    drafter = fake_drafter(gpu, cached, 2)
    with pytest.raises(ValueError, match=msg):
        speculative_decode(plain, drafter, LONG_PROMPT, 5, 2, sampling=sampling)
    with pytest.raises(ValueError, match=msg):
        sample_decode(plain, LONG_PROMPT, 5, sampling)
    assert drafter.proposes == 0 and plain._state is None


# ---- the real drafter ---------------------------------------------------------------------------

SAMPLED_PROPOSE = "sampling" in inspect.signature(MtpProposer.propose).parameters
needs_sampled_propose = pytest.mark.skipif(
    not SAMPLED_PROPOSE,
    reason="MtpProposer.propose does not take sampling= yet (the sampled drafter is being integrated)",
)
N_REAL = 500


@needs_sampled_propose
def test_real_drafter_probabilities_are_its_distributions(models, real_drafter):
    gpu, cfg, plain, _ = models
    sampling = SamplingParams(temperature=1.2, top_k=8, seed=3)
    st = plain.alloc_state()
    dst = real_drafter.alloc_state()
    buf = gpu.alloc(3 * V * 4)
    try:
        plain.forward(st, LONG_PROMPT, 0)
        real_drafter.prefill_drafter(dst, LONG_PROMPT[:-1], plain.hidden_rows(st, 0))
        pos = len(LONG_PROMPT) - 2
        got = real_drafter.propose(
            dst, LONG_PROMPT[-1], plain.hidden_rows(st, pos), pos, 3, sampling=sampling, draft_dist=buf
        )
        q = np.empty((3, V), np.float32)
        gpu.copy_d2h(q, buf)
    finally:
        gpu.free(buf)
        real_drafter.free_state(dst)
        plain.free_state(st)
    assert isinstance(got, SampledDrafts) and len(got.tokens) == len(got.probs) == 3
    assert np.allclose(q.sum(axis=1), 1.0, atol=1e-5) and (q >= 0).all()
    assert (np.count_nonzero(q, axis=1) <= 8).all()  # top-k
    for i, (t, p) in enumerate(zip(got.tokens, got.probs)):
        assert p == pytest.approx(float(q[i, t]), rel=1e-5) and p > 0


@needs_sampled_propose
@pytest.mark.slow
def test_real_drafter_speculative_decoding_has_the_targets_law(models, real_drafter):
    """The law test with MtpProposer's own sampled drafts (its q is whatever the model gives):
    the first two tokens (the second decided by the verifier, k = 1), N_REAL seeds."""
    gpu, cfg, _, target = models
    sampling = SamplingParams(temperature=1.5, top_k=8)
    law = exact_law(target, sampling, 2)
    got = Counter()
    target.hidden = True  # the real drafter reads the target's hidden rows
    try:
        for s in range(N_REAL):
            sp = replace(sampling, seed=s)
            toks, _ = speculative_decode(target, real_drafter, PROMPT, 2, 1, sampling=sp)
            got[tuple(toks)] += 1
    finally:
        target.hidden = False
    x2, df, crit = chi2_gof(got, law)
    assert x2 < crit, (x2, df, crit)
