"""Sampled requests: the parameters, and the distribution a sampled token is drawn from.

A request's ``SamplingParams(temperature, top_p, top_k, seed)`` define, for logits ``l`` over the
vocabulary, the distribution both the drafter (its draft probabilities q) and the verifier (the
target's p) use, with the same rules:

1. ``z_i = l_i / temperature`` (f32); tokens ordered by (z descending, index ascending);
2. ``top_k > 0`` keeps the first ``top_k`` tokens of that order (0: all);
3. ``top_p < 1`` keeps, of those, the shortest prefix of the order whose probabilities
   ``exp(z_i - z_max) / sum_kept exp(z_j - z_max)`` add up to at least ``top_p`` (always >= 1 token);
4. ``prob_i = exp(z_i - z_max) / sum_{j in S} exp(z_j - z_max)`` on the kept set S, 0 elsewhere;
5. the draw is Gumbel-max: the token is argmax over S of ``z_i + g_i`` (lower index on a tie) with
   ``g_i`` the keyed Gumbel noise of ``model.kernels.keyed_rng`` at (seed, position, draft index,
   stream, i). Gumbel-max draws exactly from ``prob`` and needs no prefix sum, so a vocabulary
   sharded over ranks draws the same token on every rank by exchanging (max, index) pairs.

``temperature == 0`` is greedy: the argmax, lower index on a tie, and probability 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .kernels.keyed_rng import Stream, gumbel, seed_key


@dataclass(frozen=True)
class SamplingParams:
    """Per request. ``top_k`` 0 means no top-k; ``top_p`` 1 means no top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self, vocab: int, what: str = "sampling") -> None:
        """Raise ValueError naming the bad field (before anything is drafted)."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{what}: temperature {t!r} must be a finite number >= 0")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"{what}: top_p {p!r} must be in (0, 1]")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= vocab:
            raise ValueError(f"{what}: top_k {k!r} must be an integer in 0 .. vocabulary size {vocab}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise ValueError(f"{what}: seed {s!r} must be an integer")
        try:
            seed_key(int(s))
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None


GREEDY = SamplingParams()


def kept_order(z: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the kept set S in (z desc, index asc) order, their probabilities), rules 1-4."""
    n = z.shape[0]
    order = np.lexsort((np.arange(n), -z.astype(np.float64)))
    if params.top_k:
        order = order[: params.top_k]
    zk = z[order].astype(np.float64)
    e = np.exp(zk - zk[0])
    if params.top_p < 1.0:
        c = np.cumsum(e / e.sum())
        keep = int(np.searchsorted(c, params.top_p, side="left")) + 1
        order, e = order[: min(keep, len(order))], e[: min(keep, len(order))]
    return order, e / e.sum()


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 [n]: the distribution a token is drawn from (one-hot argmax when greedy)."""
    logits = np.asarray(logits, np.float32)
    out = np.zeros(logits.shape[0], np.float64)
    if params.greedy:
        out[int(np.argmax(logits))] = 1.0
        return out
    z = logits / np.float32(params.temperature)
    order, p = kept_order(z, params)
    out[order] = p
    return out


def draw(logits: np.ndarray, params: SamplingParams, position: int, draft_index: int, stream: Stream) -> int:
    """The token drawn from ``probabilities(logits, params)`` with the keyed noise (rule 5)."""
    logits = np.asarray(logits, np.float32)
    if params.greedy:
        return int(np.argmax(logits))
    z = logits / np.float32(params.temperature)
    order, _ = kept_order(z, params)
    g = gumbel(int(params.seed), position, draft_index, stream, logits.shape[0])
    s = z[order] + g[order]
    best = s.max()
    return int(order[s == best].min())


def draw_from(probs: np.ndarray, seed: int, position: int, draft_index: int, stream: Stream) -> int:
    """A token drawn from an explicit distribution ``probs`` (>= 0, any positive total; the
    verifier's residual): Gumbel-max on ``log(probs)`` with the keyed noise at (seed, position,
    draft index, stream), over the tokens with ``probs > 0``, lower index on a tie."""
    probs = np.asarray(probs, np.float64)
    live = np.flatnonzero(probs > 0)
    if live.size == 0:
        raise ValueError("draw_from: the distribution has no positive entry")
    g = gumbel(int(seed), position, draft_index, stream, probs.shape[0])
    s = np.log(probs[live]) + g[live]
    return int(live[int(np.argmax(s))])  # argmax: the first maximum, live is ascending


class SampledDrafts(NamedTuple):
    """What a sampled ``propose`` returns: draft i was drawn from the drafter's distribution q_i
    (these rules on the drafter's logits, keyed noise at (seed, position, i, Stream.DRAFT)) and
    ``probs[i] == q_i(tokens[i])``. Lists from ``propose``; int64 [B, k] and float32 [B, k]
    arrays from ``propose_batch``."""

    tokens: Any
    probs: Any
