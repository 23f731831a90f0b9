"""Shared pieces of the sharded batch tests: ranks as threads over a host communicator group, and
a seeded engine history of batched calls that every rank (and one unsharded proposer) replays in
lockstep, recording what each rank drafted and holds."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model.config import ModelConfig
from runtime.comm import HostCommGroup
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import cache_snapshot, upload_rows


def run_ranks(
    world: int,
    fn: Callable[[int, HostBackend, Any], Any],
    timeout_s: float = 20.0,
    join_s: float | None = None,
    group: HostCommGroup | None = None,
) -> tuple[list[Any], list[BaseException | None]]:
    """fn(rank, backend, comm) in one thread per rank, each with its own host backend; returns the
    per-rank results and exceptions. A thread still alive after ``join_s`` (default three
    timeouts) fails the caller: a hang is the one outcome no test accepts."""
    group = group or HostCommGroup(world, timeout_s=timeout_s)
    out: list[Any] = [None] * world
    errs: list[BaseException | None] = [None] * world

    def body(r: int) -> None:
        gpu = HostBackend()
        try:
            out[r] = fn(r, gpu, group.communicator(r, gpu))
        except BaseException as e:  # reported to the test thread
            errs[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = join_s if join_s is not None else 3 * timeout_s
    for t in threads:
        t.join(deadline)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"rank(s) {hung} hung"
    return out, errs


def cache_digest(prop, st) -> str:
    """sha256 over every cache of a state's valid region (``cache_snapshot``), in a fixed order."""
    h = hashlib.sha256()
    for name, a in sorted(cache_snapshot(prop, st).items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()


class Seq:
    """One sequence of the engine: its target-side tokens and hidden rows (seeded by its serial, so
    every rank builds the same), and its drafter state in this rank's proposer."""

    def __init__(self, cfg: ModelConfig, serial: int, state, seed: int) -> None:
        rng = np.random.default_rng(seed * 7919 + serial)
        n = cfg.dsa.max_context + 2
        self.serial = serial
        self.tokens = rng.integers(0, cfg.vocab_size, n + 1)
        self.hiddens = rng.standard_normal((n + 1, cfg.hidden_size)).astype(np.float32)
        self.state = state


@dataclass
class Record:
    """What one proposer drafted and held over a history.

    ``drafts[i]``: propose i's [B, k] drafts; ``batches[i]``: its (serials, positions, k);
    ``logits[i]``: the head's logits of its last draft for its B live rows (BF16 bits, this rank's
    vocabulary columns); ``caches[(i, serial)]``: (rows, cache digest) of every live sequence at
    checkpoint i; counts of the calls made."""

    drafts: list[np.ndarray] = field(default_factory=list)
    batches: list[tuple[tuple[int, ...], tuple[int, ...], int]] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    caches: dict[tuple[int, int], tuple[int, str]] = field(default_factory=dict)
    catchups: int = 0
    frees: int = 0
    allocs: int = 0
    rewound: int = 0
    sizes: dict[int, int] = field(default_factory=dict)


def drive_history(
    prop, gpu, seed: int, proposes: int, *, checkpoint_every: int = 10, before_propose=None
) -> Record:
    """A seeded engine loop over ``prop`` (``max_sequences`` slots, ``max_draft_tokens`` KMAX):
    sequences are allocated (into freed slots too) and fed context through ``catchup_batch``;
    random subsets in random order are drafted by ``propose_batch`` (k of 1..KMAX, the position
    at the sequence's rows or one or two behind, which rewinds); ``after_verify_batch`` accepts a
    random count of each (or is skipped, so a later propose rewinds the unverified rows); sequences
    near the drafter's reach are freed. Every decision comes from ``seed`` and the row counts,
    never from the drafts, so every rank makes the same calls. ``before_propose(i)`` runs before
    propose i (the fault tests arm a dying rank there)."""
    cfg, opt = prop.cfg, prop.opt
    cap, kmax, slots = prop.drafter_context_rows, opt.max_draft_tokens, opt.max_sequences
    rng = np.random.default_rng(seed)
    rec = Record()
    live: list[Seq] = []
    serial = 0
    while len(rec.drafts) < proposes:
        # Sequences come and go: at least three live, a new one now and then, freed when full.
        for q in [q for q in live if prop.drafter_rows(q.state) + kmax + 3 > cap]:
            prop.free_state(q.state)
            live.remove(q)
            rec.frees += 1
        fresh: list[Seq] = []
        while len(live) < 3 or (len(live) < slots and rng.random() < 0.2):
            serial += 1
            q = Seq(cfg, serial, prop.alloc_state(), seed)
            live.append(q)
            fresh.append(q)
            rec.allocs += 1
        if rng.random() < 0.04 and len(live) > 2:  # freed mid-life, its slot reused later
            q = live[int(rng.integers(len(live)))]
            prop.free_state(q.state)
            live.remove(q)
            fresh = [f for f in fresh if f is not q]
            rec.frees += 1
        # Catch-up: the new sequences' prompts and a random few others' accepted rows, one call.
        pairs = []
        for q in list(fresh) + [q for q in live if q not in fresh and rng.random() < 0.3]:
            room = cap - prop.drafter_rows(q.state) - kmax - 3
            n = max(0, min(int(rng.integers(1, 24)) if q in fresh else int(rng.integers(0, 6)), room))
            if n or rng.random() < 0.5:  # a sequence with no rows to feed, now and then
                pairs.append((q, n))
        if pairs:
            _catchup(prop, gpu, [q for q, _ in pairs], [n for _, n in pairs])
            rec.catchups += 1
        # Propose: a random subset in random order.
        k = int(rng.integers(1, kmax + 1))
        order = [live[i] for i in rng.permutation(len(live))]
        batch = [
            q for q in order[: 1 + int(rng.integers(len(order)))] if prop.drafter_rows(q.state) + k <= cap
        ]
        if not batch:
            continue
        backs = [int(rng.choice(3, p=[0.8, 0.1, 0.1])) for _ in batch]
        pos = [max(prop.drafter_rows(q.state) - b, 0) for q, b in zip(batch, backs)]
        rec.rewound += sum(p < prop.drafter_rows(q.state) for q, p in zip(batch, pos))
        if before_propose is not None:
            before_propose(len(rec.drafts))
        drafts = _propose(prop, gpu, batch, pos, k)
        rec.drafts.append(drafts)
        rec.batches.append((tuple(q.serial for q in batch), tuple(pos), k))
        rec.sizes[len(batch)] = rec.sizes.get(len(batch), 0) + 1
        rec.logits.append(head_logits(prop, gpu, len(batch)))
        # Verify: usually right away, sometimes never (the next propose then rewinds).
        if rng.random() < 0.9:
            acc = [int(rng.integers(0, k + 1)) for _ in batch]
            prop.after_verify_batch([q.state for q in batch], acc)
        i = len(rec.drafts)
        if i % checkpoint_every == 0 or i == proposes:
            for q in live:
                rec.caches[(i, q.serial)] = (prop.drafter_rows(q.state), cache_digest(prop, q.state))
    for q in live:
        prop.free_state(q.state)
    return rec


def _catchup(prop, gpu, feed: list[Seq], counts: list[int]) -> None:
    bases = [prop.drafter_rows(q.state) for q in feed]
    ptrs = [upload_rows(gpu, q.hiddens[b : b + max(n, 1)]) for q, b, n in zip(feed, bases, counts)]
    try:
        toks = [q.tokens[b : b + n + 1] for q, b, n in zip(feed, bases, counts)]
        assert prop.catchup_batch([q.state for q in feed], toks, ptrs, bases) == counts
    finally:
        for p in ptrs:
            gpu.free(p)


def _propose(prop, gpu, batch: list[Seq], pos: list[int], k: int) -> np.ndarray:
    hid = upload_rows(gpu, np.stack([q.hiddens[p] for q, p in zip(batch, pos)]))
    try:
        toks = [int(q.tokens[p + 1]) for q, p in zip(batch, pos)]
        return prop.propose_batch([q.state for q in batch], toks, hid, pos, k)
    finally:
        gpu.free(hid)


def head_logits(prop, gpu, B: int) -> np.ndarray:
    """The head's BF16 logits (as u16 bits) of the last draft for the step's first B rows: this
    rank's ``head_n`` vocabulary columns from ``head_v0``."""
    out = np.empty((B, prop.head_n), np.uint16)
    gpu.copy_d2h(out, prop.step.logits)
    return out
