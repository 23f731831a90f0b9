"""What the proposer checks of what it is handed, and the one error type an engine catches.

Every refusal is a ``ProposerError`` (``DsaSizingError`` is one too), raised before any state
changes: integers that must be integers, tokens in the vocabulary, a state of this proposer that is
still live, a proposer that is open and used by one thread at a time.
The non-finite flags of a propose step (which kernel saw what) are decoded here as well.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from .kernels.draft_head import NONFINITE_NAN
from .kernels.mtp_input import HIDDEN_NONFINITE, TOKEN_OUTSIDE


class ProposerError(ValueError):
    """Bad input to the proposer, or a call it cannot serve; raised before any state changes."""


# ---- integers and tokens --------------------------------------------------------------------------


def as_int(value, what: str) -> int:
    """``value`` as a Python int when it is an integer (int or NumPy integer). A bool, a float
    (even ``20.0``) or anything else is refused, naming ``what``: a position that is silently
    truncated, or stored as a float, corrupts the row count without an error."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ProposerError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def as_tokens(tokens: Sequence[int] | np.ndarray, vocab: int, what: str = "tokens") -> np.ndarray:
    """A 1-D sequence of token ids as uint32, each an integer in ``0..vocab-1``; else refused,
    naming the first bad one."""
    if isinstance(tokens, np.ndarray):
        t = tokens
        if t.dtype.kind not in "iu":
            raise ProposerError(f"{what} must be integers, got an array of {t.dtype}")
    else:
        try:
            tokens = list(tokens)
        except TypeError:  # None, an int: not a sequence of ids at all
            raise ProposerError(
                f"{what} must be a sequence of token ids, got {type(tokens).__name__}"
            ) from None
        bad = next(
            (
                i
                for i, v in enumerate(tokens)
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))
            ),
            None,
        )
        if bad is not None:
            v = tokens[bad]
            raise ProposerError(f"{what}[{bad}] must be an integer token id, got {type(v).__name__} {v!r}")
        try:
            t = np.asarray(tokens, dtype=np.int64)
        except OverflowError:
            raise ProposerError(f"{what} holds an id outside the vocabulary 0..{vocab - 1}") from None
    if t.ndim != 1:
        raise ProposerError(f"{what} must be one-dimensional, got shape {t.shape}")
    out = (t < 0) | (t >= vocab)
    if out.any():
        i = int(np.flatnonzero(out)[0])
        raise ProposerError(f"token {int(t[i])} at index {i} is outside the vocabulary 0..{vocab - 1}")
    return t.astype(np.uint32)


# ---- a propose step's non-finite flags ------------------------------------------------------------

# Bytes of a sequence's flag word (the last word of its drafts_out, mapped pinned memory the host
# zeroes before each step): each is stored only by one kind of kernel, only with a nonzero value, so
# no kernel clears another's report and no atomic to host memory is needed.
FLAG_TARGET_HIDDEN = 0  # mtp_input_gemv_batch of draft 1: the target's hidden (and the committed token)
FLAG_OWN_HIDDEN = 1  # mtp_input_gemv_batch of drafts 2..k: the drafter's own output
FLAG_LOGITS = 2  # the head's commit (head_argmax_*_batch / draft_commit_batch): the winning logit
FLAG_BYTES = 4


def nonfinite_problem(flags: np.ndarray) -> str | None:
    """What the step's flag bytes report, the earliest cause first; None when nothing was raised."""
    f = [int(b) for b in flags[:FLAG_BYTES]]
    if not any(f):
        return None
    if f[FLAG_TARGET_HIDDEN] & HIDDEN_NONFINITE:
        return (
            "target_hidden is not finite (a NaN or an Inf, or values so large that its f32 sum "
            "of squares overflows)"
        )
    if f[FLAG_TARGET_HIDDEN] & TOKEN_OUTSIDE or f[FLAG_OWN_HIDDEN] & TOKEN_OUTSIDE:
        return "a draft's input token was outside the vocabulary"
    # Not this rank's input: a value of the step overflowed, or (sharded) another rank's hidden
    # was not finite and reached this one through the collectives.
    why = "a value of the step overflowed, or another rank's target_hidden was not finite"
    if f[FLAG_OWN_HIDDEN]:
        return f"a later draft's input row (the drafter's own output) is not finite: {why}"
    kind = "no logit is a number" if f[FLAG_LOGITS] == NONFINITE_NAN else "the largest is infinite"
    return f"the drafter's logits are not finite ({kind}): {why}"


# ---- one thread at a time, and nothing after close ------------------------------------------------

F = TypeVar("F", bound=Callable)


def exclusive(*, after_close: bool = False) -> Callable[[F], F]:
    """A public proposer call. It holds the proposer's lock for its duration, taken without waiting:
    a second thread that calls in meanwhile gets a ProposerError at once instead of interleaving its
    launches, captures and row counts with the first's (reentrant, so a public call may call
    another). Refused after ``close`` unless ``after_close``."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            lock: threading.RLock = self._lock
            if not lock.acquire(blocking=False):
                raise ProposerError(
                    f"{self.label} is in use by another thread ({method.__name__} refused): a proposer "
                    "belongs to one thread and one stream at a time"
                )
            try:
                if self._closed and not after_close:
                    raise ProposerError(f"{self.label} is closed ({method.__name__} refused)")
                return method(self, *args, **kwargs)
            finally:
                lock.release()

        return call  # type: ignore[return-value]

    return wrap
