"""Greedy speculative decoding: the target verifies the drafter's proposals; the output is exactly
the target's own greedy decode.

Per step, with committed tokens t_0..t_{L-1} and target hiddens h_0..h_{L-2} (t_{L-1} is the
target's own latest token): the drafter proposes k tokens from the pair (t_{L-1}, h_{L-2}) at
position L-2; the target runs [t_{L-1}, d_1..d_k] at rows L-1..L-1+k; the longest prefix of drafts
that matches its greedy tokens is accepted, plus its own next token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .proposer import MtpProposer
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


def speculative_decode(
    target: TargetModel,
    drafter: MtpProposer,
    prompt: list[int],
    n_new: int,
    k: int,
    *,
    refeed_target_hidden: bool = False,
    progress=None,
) -> tuple[list[int], SpecStats]:
    """Greedy speculative decoding of ``n_new`` tokens after ``prompt`` (at least 2 tokens).

    ``refeed_target_hidden``: after a verify, re-feed the rows of accepted drafts with the target's
    own hidden rows (otherwise they keep the rows built from the drafter's own hidden).
    """
    if len(prompt) < 2:
        raise ValueError("speculative decoding needs a prompt of at least 2 tokens")
    stats = SpecStats(k)
    tst = target.alloc_state()
    dst = drafter.alloc_state()
    try:
        logits = target.forward(tst, prompt, 0)
        tokens = list(prompt) + [int(np.argmax(logits[-1]))]
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
            drafts = drafter.propose(dst, tokens[-1], target.hidden_rows(tst, pos), pos, kk)
            t1 = time.perf_counter()
            logits = target.forward(tst, [tokens[-1]] + drafts, L - 1)
            greedy = np.argmax(logits, axis=1)
            a = 0
            while a < kk and drafts[a] == int(greedy[a]):
                a += 1
            tokens += drafts[:a] + [int(greedy[a])]
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
        drafter.free_state(dst)
        target.free_state(tst)
