"""Speculative decoding: the target verifies the drafter's proposals, and the output is distributed
exactly as the target's own decode: equal to it when greedy, in law when sampled.

Per step, with committed tokens t_0..t_{L-1} and target hiddens h_0..h_{L-2} (t_{L-1} is the
target's own latest token): the drafter proposes k tokens from the pair (t_{L-1}, h_{L-2}) at
position L-2; the target runs [t_{L-1}, d_1..d_k] at rows L-1..L-1+k. Greedy: the longest prefix of
drafts that matches its greedy tokens is accepted, plus its own next token. Sampled: standard
rejection sampling (``verify_sampled``): d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)),
the first rejected one is replaced by a draw from normalise(max(0, p_i - q_i)), and when all k are
accepted a bonus token is drawn from p_{k+1}.

Keys of the random numbers (``model.kernels.keyed_rng``; ``position`` is always the sequence
position of the token being decided, its index in prompt + output):

- the target alone (``sample_decode``, and the first token after the prompt in
  ``speculative_decode``): ``draw`` at (seed, position, 0, Stream.TARGET), so both functions emit
  the same first token for a seed;
- the drafter's draft i (0-based) of a step at drafter position L-2: (seed, L-2, i, Stream.DRAFT);
- verifying draft j (0-based) of a step whose first draft sits at position L: its accept uniform
  at (seed, L + j, j, Stream.ACCEPT); the residual draw replacing it, or the bonus draw (j = k),
  at (seed, L + j, j, Stream.RESAMPLE). Each key is used at most once per sequence (a position is
  decided once, and L grows every step), so every decision draws fresh numbers: the premise of
  rejection sampling's exactness.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .kernels.keyed_rng import Stream, uniforms
from .proposer import MtpProposer
from .sampling import SampledDrafts, SamplingParams, draw, draw_from, probabilities
from .target import TargetModel


@dataclass
class SpecStats:
    k: int
    steps: int = 0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    accepted_total: int = 0
    drafter_s: float = 0.0
    target_s: float = 0.0

    def __post_init__(self) -> None:
        self.reached = [0] * self.k
        self.accepted_at = [0] * self.k

    def record(self, k: int, accepted: int) -> None:
        self.steps += 1
        self.accepted_total += accepted
        for i in range(k):
            if i <= accepted and i < k:
                self.reached[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1

    @property
    def acceptance(self) -> list[float | None]:
        """P(draft i accepted | drafts before it accepted), i = 1..k; None where draft i was never
        reached (JSON null: NaN is not JSON)."""
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached)]

    @property
    def mean_accepted(self) -> float:
        return self.accepted_total / self.steps if self.steps else 0.0

    def summary(self) -> dict:
        return {
            "k": self.k,
            "steps": self.steps,
            "acceptance": [None if a is None else round(a, 4) for a in self.acceptance],
            "mean_accepted_drafts": round(self.mean_accepted, 4),
            "tokens_per_step": round(self.mean_accepted + 1, 4),
            "drafter_ms_per_step": round(1e3 * self.drafter_s / max(self.steps, 1), 3),
            "target_ms_per_step": round(1e3 * self.target_s / max(self.steps, 1), 3),
        }


def greedy_decode(target: TargetModel, prompt: list[int], n_new: int) -> list[int]:
    """The target alone: the output speculative decoding must reproduce."""
    st = target.alloc_state()
    try:
        logits = target.forward(st, prompt, 0)
        out = [int(np.argmax(logits[-1]))]
        while len(out) < n_new:
            logits = target.forward(st, [out[-1]], st.length)
            out.append(int(np.argmax(logits[-1])))
        return out
    finally:
        target.free_state(st)


def sample_decode(target: TargetModel, prompt: list[int], n_new: int, sampling: SamplingParams) -> list[int]:
    """The target alone, sampled: the token at sequence position n (its index in prompt + output)
    is ``draw(logits of row n - 1, sampling, n, 0, Stream.TARGET)``. Greedy params give exactly
    ``greedy_decode``. The law speculative decoding with ``sampling`` must reproduce."""
    sampling.check(target.cfg.vocab_size)
    st = target.alloc_state()
    try:
        logits = target.forward(st, prompt, 0)
        out = [draw(logits[-1], sampling, len(prompt), 0, Stream.TARGET)]
        while len(out) < n_new:
            logits = target.forward(st, [out[-1]], st.length)
            out.append(draw(logits[-1], sampling, len(prompt) + len(out), 0, Stream.TARGET))
        return out
    finally:
        target.free_state(st)


def verify_sampled(
    target_logits: np.ndarray,
    drafts,
    draft_probs,
    draft_dists: np.ndarray,
    sampling: SamplingParams,
    position: int,
) -> tuple[int, int]:
    """Rejection sampling of one step's k drafts: ``(accepted, next_token)``, 0 <= accepted <= k.

    ``target_logits`` f32 [k + 1, V]: row j is the target's logits after the committed tokens and
    drafts 1..j (row 0: after the committed tokens alone). ``drafts`` k tokens; ``draft_probs[j]
    = q_j(drafts[j])`` > 0; ``draft_dists`` [k, V] the full q_j. ``position``: the sequence
    position of ``drafts[0]``; draft j decides the token at ``position + j``.

    For j = 0..k-1, with p_j = ``probabilities(target_logits[j], sampling)``: draft j is accepted
    when ``u_j < p_j(d_j) / q_j(d_j)``, u_j the keyed uniform at (seed, position + j, j,
    Stream.ACCEPT); the first rejected draft is replaced by a draw from normalise(max(0, p_j - q_j))
    (``draw_from`` at (seed, position + j, j, Stream.RESAMPLE)); a zero residual, possible only when
    p_j == q_j, falls back to p_j (``draw`` at the same key). All k accepted: the bonus token is
    ``draw(target_logits[k], sampling, position + k, k, Stream.RESAMPLE)``. The emitted tokens are
    then distributed exactly as the target's own samples, for any q. A pure function of its
    arguments."""
    logits = np.asarray(target_logits, np.float32)
    drafts = [int(d) for d in drafts]
    k = len(drafts)
    if logits.ndim != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"verify_sampled: target_logits of shape {logits.shape}, expected [{k + 1}, V]")
    V = logits.shape[1]
    sampling.check(V)
    qd = np.asarray(draft_probs, np.float64)
    q = np.asarray(draft_dists, np.float64)
    if qd.shape != (k,):
        raise ValueError(f"verify_sampled: {qd.size} draft probabilities for {k} drafts")
    if q.shape != (k, V):
        raise ValueError(f"verify_sampled: draft_dists of shape {q.shape}, expected [{k}, {V}]")
    if any(not 0 <= d < V for d in drafts):
        raise ValueError(f"verify_sampled: a draft of {drafts} is outside the vocabulary 0..{V - 1}")
    if not (np.isfinite(qd).all() and (qd > 0).all()):
        raise ValueError(f"verify_sampled: draft probabilities {qd.tolist()} must be finite and > 0")
    if not (np.isfinite(q).all() and (q >= 0).all()):
        raise ValueError("verify_sampled: draft_dists must be finite and >= 0")
    if not isinstance(position, (int, np.integer)) or position < 0:
        raise ValueError(f"verify_sampled: position {position!r} must be an integer >= 0")
    seed = int(sampling.seed)
    for j, d in enumerate(drafts):
        p = probabilities(logits[j], sampling)
        u = float(uniforms(seed, position + j, j, Stream.ACCEPT)[0])
        if u < p[d] / qd[j]:
            continue
        residual = np.maximum(p - q[j], 0.0)
        if residual.sum() > 0:
            return j, draw_from(residual, seed, position + j, j, Stream.RESAMPLE)
        return j, draw(logits[j], sampling, position + j, j, Stream.RESAMPLE)
    return k, draw(logits[k], sampling, position + k, k, Stream.RESAMPLE)


def speculative_decode(
    target: TargetModel,
    drafter: MtpProposer,
    prompt: list[int],
    n_new: int,
    k: int,
    *,
    sampling: SamplingParams | None = None,
    refeed_target_hidden: bool = False,
    progress=None,
) -> tuple[list[int], SpecStats]:
    """Speculative decoding of ``n_new`` tokens after ``prompt`` (at least 2 tokens).

    ``sampling`` None or greedy: greedy drafts, verified by exact match; the output is exactly
    ``greedy_decode``'s. Otherwise sampled drafts with their probabilities and full draft
    distributions, verified by ``verify_sampled``; the output is distributed exactly as
    ``sample_decode``'s (keys in the module docstring).

    ``refeed_target_hidden``: after a verify, re-feed the rows of accepted drafts with the target's
    own hidden rows (otherwise they keep the rows built from the drafter's own hidden).
    """
    if len(prompt) < 2:
        raise ValueError("speculative decoding needs a prompt of at least 2 tokens")
    V = target.cfg.vocab_size
    if sampling is not None:
        sampling.check(V)
    sampled = sampling is not None and not sampling.greedy
    stats = SpecStats(k)
    gpu = target.gpu
    tst = target.alloc_state()
    dst = drafter.alloc_state()
    dist = None
    try:
        if sampled:
            # The drafter writes its q_i(.) rows here; the residual of a rejection needs them.
            dist = gpu.alloc(max(k, 1) * V * 4)
            q_host = np.empty((max(k, 1), V), np.float32)
        logits = target.forward(tst, prompt, 0)
        first = draw(logits[-1], sampling, len(prompt), 0, Stream.TARGET) if sampled else None
        tokens = list(prompt) + [int(np.argmax(logits[-1])) if first is None else first]
        t0 = time.perf_counter()
        drafter.prefill_drafter(dst, tokens[:-1], target.hidden_rows(tst, 0))
        stats.drafter_s += time.perf_counter() - t0
        produced = 1
        while produced < n_new:
            L = len(tokens)
            pos = L - 2  # the pair (t_{L-1}, h_{L-2})
            kk = max(
                1, min(k, n_new - produced, drafter.drafter_context_rows - pos, target.rows_cap - (L - 1) - 1)
            )
            if pos + kk > drafter.drafter_context_rows or L - 1 + kk >= target.rows_cap:
                break
            t0 = time.perf_counter()
            if drafter.drafter_rows(dst) < pos:  # a full accept left a gap: catch up
                base = drafter.drafter_rows(dst)
                drafter.catchup_drafter(dst, tokens[base : pos + 1], target.hidden_rows(tst, base), base)
            if sampled:
                proposal: SampledDrafts = drafter.propose(
                    dst, tokens[-1], target.hidden_rows(tst, pos), pos, kk, sampling=sampling, draft_dist=dist
                )
                drafts = [int(d) for d in proposal.tokens]
            else:
                drafts = drafter.propose(dst, tokens[-1], target.hidden_rows(tst, pos), pos, kk)
            t1 = time.perf_counter()
            logits = target.forward(tst, [tokens[-1]] + drafts, L - 1)
            if sampled:
                gpu.copy_d2h(q_host[:kk], dist)
                a, nxt = verify_sampled(logits, drafts, proposal.probs, q_host[:kk], sampling, L)
            else:
                greedy = np.argmax(logits, axis=1)
                a = 0
                while a < kk and drafts[a] == int(greedy[a]):
                    a += 1
                nxt = int(greedy[a])
            tokens += drafts[:a] + [nxt]
            target.rewind_to(tst, L + a)  # rows L-1 .. L-1+a hold committed tokens
            t2 = time.perf_counter()
            drafter.after_verify(dst, a)
            if refeed_target_hidden and a > 0:
                # Rows pos+1 .. pos+a were built from the drafter's own hidden; rebuild them from
                # the target's rows, which the next propose's context then matches exactly.
                keep = pos + 1
                drafter.rewind_to(dst, keep)
                new_pos = len(tokens) - 2
                drafter.catchup_drafter(dst, tokens[keep : new_pos + 1], target.hidden_rows(tst, keep), keep)
            stats.drafter_s += (t1 - t0) + (time.perf_counter() - t2)
            stats.target_s += t2 - t1
            stats.record(kk, a)
            produced += a + 1
            if progress is not None:
                progress.update(a + 1)
        return tokens[len(prompt) : len(prompt) + n_new], stats
    finally:
        if dist is not None:
            gpu.free(dist)
        drafter.free_state(dst)
        target.free_state(tst)
