"""A rank that dies in the middle of a batched call, on 2 and 4 host ranks: every other rank gets a
CommError that names the missing rank within its timeout (never a hang), and no sequence of the
surviving ranks is left half-changed.

How a rank dies: its communicator is wrapped so that, once armed, its n-th collective *execution*
(at the call when eager, at that point of the replay when the step is a graph) raises (a crash:
the thread ends and its communicator is never closed, as a dead process closes nothing) or blocks
(a rank that stops). ``catchup_batch`` has no collective: a rank that dies inside it is noticed
by the others at their next collective, the next ``propose_batch``.

What a surviving rank's sequences look like after the failed ``propose_batch`` (what the proposer
does: the step's kernels up to the failed collective have run, so the rows at ``position..`` may
be written; the row counts are moved only after the step completes): each sequence of the batch
holds ``min(rows before, position)`` rows, with its cache bytes in those rows as before; the
sequences outside the batch are untouched; the next call that meets the peers fails at once with
the same cause.

Over NCCL (not run here) the same death is a timed-out ``wait``; its message names the ranks it
waited for (``runtime.comm.nccl.missing_peers``: exactly the other rank of two)."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from model.config import tiny
from model.proposer import MtpProposer, ProposerOptions
from runtime.comm.nccl import missing_peers
from runtime.errors import CommError
from tests.proposer_fixtures import bf16_weights, cache_snapshot
from tests.sharded_util import Seq, _catchup, _propose, run_ranks

CFG = tiny(vocab_size=96, index_topk=8, index_kpool=2, max_context=64)
WEIGHTS = bf16_weights(CFG, seed=4)
SEED = 77
TIMEOUT_S = 1.5  # the host group's bound on a wait at a collective
CONTEXTS = (10, 7, 15, 4)


class RankDied(Exception):
    """The simulated crash of a rank (raised on that rank only)."""


class Dying:
    """A rank's communicator that dies at its ``n``-th collective execution after ``arm``: raises
    ``RankDied`` (``mode="raise"``) or blocks until ``release`` is set (``mode="stop"``) before
    the collective. The tick is enqueued on the rank's host backend ahead of each collective, so
    it runs when the collective would: at the call, or at each replay of a captured graph."""

    def __init__(self, inner, backend, release: threading.Event) -> None:
        self.inner, self.backend, self.release = inner, backend, release
        self.at: int | None = None
        self.mode = "raise"
        self.count = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def arm(self, n: int, mode: str) -> None:
        self.at, self.mode, self.count = n, mode, 0

    def _tick(self) -> None:
        if self.at is None:
            return
        self.count += 1
        if self.count == self.at:
            if self.mode == "raise":
                raise RankDied(f"rank {self.rank} died before its collective #{self.at} of the call")
            self.release.wait(10 * TIMEOUT_S)

    def all_reduce(self, *args, **kwargs) -> None:
        self.backend.enqueue(self._tick)
        self.inner.all_reduce(*args, **kwargs)

    def all_gather(self, *args, **kwargs) -> None:
        self.backend.enqueue(self._tick)
        self.inner.all_gather(*args, **kwargs)

    def barrier(self, timeout_s: float) -> None:
        self.inner.barrier(timeout_s)

    def close(self) -> None:
        self.inner.close()


def options(graphs: bool) -> ProposerOptions:
    return ProposerOptions(
        served_max_seq_len=CFG.dsa.max_context,
        max_draft_tokens=3,
        max_sequences=4,
        o_proj_groups=4,
        use_graphs=graphs,
        batch_buckets=(1, 2, 4),
        tensor_core_head=False,
    )


def snapshot(prop, seqs) -> dict[int, tuple[int, dict]]:
    return {q.serial: (prop.drafter_rows(q.state), cache_snapshot(prop, q.state)) for q in seqs}


def prefix(snap: dict, rows: int, kpool: int) -> dict:
    """A cache snapshot cut to a state of ``rows`` rows (its complete pools ``rows // kpool``)."""
    out = {}
    for name, a in snap.items():
        out[name] = a[: rows // kpool] if name.startswith("pool") else a[:rows]
    return out


def setup(rank: int, world: int, gpu, comm, graphs: bool, release: threading.Event):
    """A sharded proposer with four sequences fed through one catch-up, one verified propose of
    all four (captures the bucket-4 graph at k = 3) and one unverified propose of the first two."""
    comm = Dying(comm, gpu, release)
    prop = MtpProposer(gpu, CFG.with_parallel(rank, world), WEIGHTS, options(graphs), comm=comm)
    seqs = [Seq(CFG, s, prop.alloc_state(), SEED) for s in range(4)]
    _catchup(prop, gpu, seqs, list(CONTEXTS))
    pos = [prop.drafter_rows(q.state) for q in seqs]
    _propose(prop, gpu, seqs, pos, 3)
    prop.after_verify_batch([q.state for q in seqs], [1, 0, 3, 2])
    _propose(prop, gpu, seqs[:2], [prop.drafter_rows(q.state) for q in seqs[:2]], 2)
    return comm, prop, seqs


def failing_propose(
    rank: int, world: int, gpu, comm, release: threading.Event, *, dead: int, at: int, mode: str, graphs: bool
):
    """Every rank: set up, then one propose_batch of sequences [3, 0, 1] at k = 3 (sequence 0 one
    row behind its unverified drafts: the call rewinds it; sequence 1 at its rows) during which
    rank ``dead`` dies at its collective ``at`` (a stopped one waits for ``release``). A survivor
    returns what it saw."""
    comm, prop, seqs = setup(rank, world, gpu, comm, graphs, release)
    batch = [seqs[3], seqs[0], seqs[1]]
    pos = [
        prop.drafter_rows(seqs[3].state),
        prop.drafter_rows(seqs[0].state) - 1,
        prop.drafter_rows(seqs[1].state),
    ]
    before = snapshot(prop, seqs)
    if rank == dead:
        comm.arm(at, mode)
    t0 = time.perf_counter()
    try:
        _propose(prop, gpu, batch, pos, 3)
    except CommError as e:
        err = e
    else:
        err = None
    if rank == dead:
        if err is None:
            raise AssertionError("the dead rank's propose returned")
        raise err
    elapsed = time.perf_counter() - t0
    comm.release.set()  # a stopped peer may go on now (and finds the group broken)
    after = snapshot(prop, seqs)
    t1 = time.perf_counter()
    try:
        _propose(prop, gpu, [seqs[2]], [prop.drafter_rows(seqs[2].state)], 1)
    except CommError as e:
        next_err = e
    else:
        next_err = None
    return dict(
        err=err,
        elapsed=elapsed,
        before=before,
        after=after,
        pos={q.serial: p for q, p in zip(batch, pos)},
        next_err=next_err,
        next_elapsed=time.perf_counter() - t1,
        prop=prop,
        seqs=seqs,
    )


def missing_ranks(err: BaseException) -> list[int]:
    m = re.search(r"rank\(s\) \[([\d, ]+)\] did not arrive", str(err))
    assert m, f"the error does not name the missing rank(s): {err}"
    return [int(x) for x in m.group(1).split(",")]


def check_survivors(res: list, errs: list, world: int, dead: int, mode: str) -> None:
    if mode == "raise":
        assert isinstance(errs[dead], RankDied), errs[dead]
    else:  # the stopped rank went on after the others gave up, into a broken group
        assert isinstance(errs[dead], CommError) and "broken" in str(errs[dead]), errs[dead]
    for r in range(world):
        if r == dead:
            continue
        assert errs[r] is None, f"rank {r}: {errs[r]!r}"
        out = res[r]
        assert isinstance(out["err"], CommError), f"rank {r}: the failed propose returned"
        assert dead in missing_ranks(out["err"]), out["err"]
        assert f"rank {r}:" in str(out["err"]) and "all_reduce" in str(out["err"])
        # Bounded: one timeout, not a hang and not a timeout per collective.
        assert out["elapsed"] < TIMEOUT_S + 2.0, out["elapsed"]
        # No sequence half-changed: rows at min(before, position), the bytes of those rows as before.
        kp = CFG.dsa.index_kpool
        for serial, (rows_before, caches_before) in out["before"].items():
            rows_after, caches_after = out["after"][serial]
            want = min(rows_before, out["pos"].get(serial, rows_before))
            assert rows_after == want, f"rank {r} sequence {serial}: {rows_after} rows, want {want}"
            for name, a in prefix(caches_before, want, kp).items():
                np.testing.assert_array_equal(caches_after[name], a, err_msg=f"rank {r} seq {serial} {name}")
        # The next call that meets the peers fails at once, with the same cause.
        assert isinstance(out["next_err"], CommError), out["next_err"]
        assert "broken" in str(out["next_err"]) and dead in missing_ranks(out["next_err"])
        assert out["next_elapsed"] < 0.5 * TIMEOUT_S, out["next_elapsed"]
        out["prop"].close()


# The step of k = 3 drafts meets the peers three times per draft: attention's o_proj groups, the
# MoE rows, the head's exchanged keys. Dying before the 1st (draft 1's attention), 5th (draft 2's
# MoE) or 9th (draft 3's head exchange).
@pytest.mark.parametrize(
    "world, dead, at, mode, graphs",
    [
        (2, 1, 1, "raise", False),
        (2, 0, 9, "raise", True),
        (2, 1, 5, "stop", True),
        (4, 2, 5, "raise", True),
        (4, 3, 9, "stop", False),
    ],
)
def test_a_rank_dying_in_propose_batch_names_it_on_every_other_rank(world, dead, at, mode, graphs):
    release = threading.Event()
    res, errs = run_ranks(
        world,
        lambda r, g, c: failing_propose(r, world, g, c, release, dead=dead, at=at, mode=mode, graphs=graphs),
        timeout_s=TIMEOUT_S,
        join_s=30.0,
    )
    check_survivors(res, errs, world, dead, mode)


@pytest.mark.parametrize("world, dead", [(2, 1), (4, 0)])
def test_a_rank_dying_in_catchup_batch_is_named_at_the_next_propose(world, dead):
    """catchup_batch meets no peer: the survivors' catch-up completes (their sequences advance as
    on one rank), and their next propose_batch fails within the timeout naming the dead rank."""

    def body(rank, gpu, comm):
        comm, prop, seqs = setup(rank, world, gpu, comm, True, threading.Event())
        prop.after_verify_batch([q.state for q in seqs[:2]], [2, 0])
        rows = [prop.drafter_rows(q.state) for q in seqs]
        if rank == dead:

            def die(n, s):
                raise RankDied(f"rank {rank} died inside catchup_batch")

            prop._context_rows = die
        _catchup(prop, gpu, seqs, [3, 0, 2, 5])  # raises RankDied on the dead rank
        assert [prop.drafter_rows(q.state) for q in seqs] == [r + n for r, n in zip(rows, [3, 0, 2, 5])]
        t0 = time.perf_counter()
        with pytest.raises(CommError) as ei:
            _propose(prop, gpu, seqs[1:], [prop.drafter_rows(q.state) for q in seqs[1:]], 2)
        elapsed = time.perf_counter() - t0
        after = [prop.drafter_rows(q.state) for q in seqs]
        prop.close()
        return ei.value, elapsed, after, rows

    res, errs = run_ranks(world, body, timeout_s=TIMEOUT_S, join_s=30.0)
    assert isinstance(errs[dead], RankDied), errs[dead]
    for r in range(world):
        if r != dead:
            assert errs[r] is None, f"rank {r}: {errs[r]!r}"
            err, elapsed, after, rows = res[r]
            assert dead in missing_ranks(err) and f"rank {r}:" in str(err), err
            assert elapsed < TIMEOUT_S + 2.0
            assert after == [r + n for r, n in zip(rows, [3, 0, 2, 5])]  # the failed propose moved none


def test_after_a_failed_collective_a_rewound_sequence_has_nothing_to_trim():
    """Sequence 0 had two unverified drafts; the failed propose rewound it one row behind them.
    As after a flagged step (and after ``rewind_to``), ``after_verify`` must then keep its rows."""
    res, errs = run_ranks(
        2,
        lambda r, g, c: failing_propose(
            r, 2, g, c, threading.Event(), dead=1, at=2, mode="raise", graphs=False
        ),
        timeout_s=TIMEOUT_S,
        join_s=30.0,
    )
    out = res[0]
    try:
        assert isinstance(out["err"], CommError)
        prop, q = out["prop"], out["seqs"][0]
        rows = prop.drafter_rows(q.state)
        prop.after_verify_batch([q.state], [0])
        assert prop.drafter_rows(q.state) == rows
    finally:
        out["prop"].close()


def test_an_nccl_timeout_names_the_ranks_it_waited_for():
    """NCCL reports no per-peer progress: a timed-out wait names the other rank of two, the
    candidates of more (the message of ``NcclCommunicator.wait`` and of its init's timeout)."""
    assert missing_peers(0, 2).startswith("rank 1 did not arrive")
    assert missing_peers(1, 2).startswith("rank 0 did not arrive")
    assert "ranks [0, 1, 3] did not arrive" in missing_peers(2, 4) and "does not say which" in missing_peers(
        2, 4
    )
    assert "no other rank" in missing_peers(0, 1)
