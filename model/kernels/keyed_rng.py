"""The counter-based random numbers of sampling: Philox4x32-10 (Salmon et al., SC'11), keyed by the
request's seed and counted by what the number is for, so a draw depends on (seed, position, draft
index, vocabulary index, stream) and nothing else: not the batch, not the rank, not how often a graph
was replayed. CUDA: ptx/keyed_rng.cuh (the same function; tests/test_keyed_rng.py pins both to the
published known-answer vectors).

- key = (seed & 0xFFFFFFFF, seed >> 32) (seed a u64);
- counter = (index, draft_index, position, stream) (each a u32): ``index`` is the vocabulary index
  for per-token noise (0 for a per-draft number), ``stream`` says which use draws it (``Stream``);
- the uniform is ``((word0 >> 9) + 0.5) * 2**-23``: 2**23 evenly spaced values strictly inside
  (0, 1), each exact in f32 (24 significant bits), so ``log(u)`` is finite and never 0;
- Gumbel noise ``g = -log(-log(u))`` in f32.
"""

from __future__ import annotations

import enum

import numpy as np

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
_MASK = 0xFFFFFFFF


class Stream(enum.IntEnum):
    """What a number is drawn for (counter word 3): each use has its own sequence."""

    DRAFT = 0  # the Gumbel noise of a sampled draft, one per vocabulary index
    ACCEPT = 1  # the verifier's uniform for draft i's accept test
    RESAMPLE = 2  # the Gumbel noise of the verifier's residual or bonus draw
    TARGET = 3  # the Gumbel noise of sampling from the target alone


def philox4x32(counter: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of counters u32 [..., 4] under ``key`` (two u32): u32 [..., 4]."""
    c = np.asarray(counter, np.uint64) & _MASK
    c0, c1, c2, c3 = (c[..., i].copy() for i in range(4))
    k0, k1 = np.uint64(key[0] & _MASK), np.uint64(key[1] & _MASK)
    m0, m1, mask = np.uint64(_M0), np.uint64(_M1), np.uint64(_MASK)
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + np.uint64(_W0)) & mask
            k1 = (k1 + np.uint64(_W1)) & mask
        p0, p1 = m0 * c0, m1 * c2  # < 2**64: exact in u64
        hi0, lo0 = p0 >> np.uint64(32), p0 & mask
        hi1, lo1 = p1 >> np.uint64(32), p1 & mask
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def seed_key(seed: int) -> tuple[int, int]:
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed {seed} is outside 0 .. 2**64 - 1")
    return seed & _MASK, seed >> 32


def uniforms(
    seed: int, position: int, draft_index: int, stream: Stream, index: np.ndarray | int = 0
) -> np.ndarray:
    """f32 uniforms in (0, 1), one per element of ``index``."""
    idx = np.atleast_1d(np.asarray(index, np.uint64))
    ctr = np.empty(idx.shape + (4,), np.uint64)
    ctr[..., 0] = idx
    ctr[..., 1] = draft_index & _MASK
    ctr[..., 2] = position & _MASK
    ctr[..., 3] = int(stream)
    w0 = philox4x32(ctr, seed_key(seed))[..., 0]
    return ((w0 >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)


def gumbel(seed: int, position: int, draft_index: int, stream: Stream, n: int) -> np.ndarray:
    """f32 Gumbel noise for vocabulary indices 0 .. n-1: ``-log(-log(u))`` in f32."""
    u = uniforms(seed, position, draft_index, stream, np.arange(n, dtype=np.uint64))
    return -np.log(-np.log(u))
