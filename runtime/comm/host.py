"""Host communicator: ranks are threads of one process, each with its own ``HostBackend``.

A ``HostCommGroup`` is the meeting point. The n-th collective that a rank *executes* meets the
n-th collective of every other rank (a "round"); executions happen when the backend runs the
stream work, i.e. at the call or, for work recorded in a graph capture, at each replay. So a
captured collective re-reads its input buffers and meets the peers again at every replay, as an
NCCL collective in a CUDA graph does.

Failures are bounded and sticky:

- a rank that does not arrive within the group's timeout fails the round on every waiting rank
  with a CommError naming the collective and the missing ranks;
- a rank whose call differs from the first arrival's (kind, count, dtype, op) fails the round on
  every rank with a CommError naming both calls;
- a rank that closes its communicator fails any round still waiting for it.

After any failure the group is broken: ranks are no longer in lockstep, so every later call on
every rank raises at once instead of pairing the wrong collectives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..device_ptr import DevicePtr
from ..errors import CommError
from ..host_backend import HostBackend
from .base import CommDtype, ReduceOp, check_all_gather, check_all_reduce, check_timeout
from .reduce import reduce_arrays

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Call:
    """What a rank asked for; all ranks of a round must ask for the same thing."""

    kind: str  # "all_reduce" | "all_gather" | "barrier"
    count: int = 0
    dtype: CommDtype | None = None
    op: ReduceOp | None = None

    def __str__(self) -> str:
        if self.kind == "barrier":
            return "barrier()"
        args = f"count={self.count}, dtype={self.dtype}"
        if self.op is not None:
            args += f", op={self.op}"
        return f"{self.kind}({args})"


@dataclass
class _Round:
    seq: int
    first_rank: int
    call: _Call
    inputs: dict[int, np.ndarray] = field(default_factory=dict)
    result: np.ndarray | None = None
    collected: int = 0


class HostCommGroup:
    """Shared state of ``world_size`` host ranks; ``communicator(rank, backend)`` gives each its
    communicator. ``timeout_s`` bounds how long a rank waits for the others at a collective."""

    def __init__(self, world_size: int, timeout_s: float = 30.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout_s = check_timeout(timeout_s)
        self._cond = threading.Condition()
        self._rounds: dict[int, _Round] = {}
        self._next_seq = [0] * world_size
        self._closed: set[int] = set()
        self._members: dict[int, HostCommunicator] = {}
        self._broken: str | None = None

    @property
    def broken(self) -> str | None:
        """Why the group failed, or None while it is healthy."""
        return self._broken

    def communicator(self, rank: int, backend: HostBackend) -> HostCommunicator:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        with self._cond:
            if rank in self._members:
                raise ValueError(f"rank {rank} already has a communicator in this group")
            comm = HostCommunicator(self, rank, backend)
            self._members[rank] = comm
            return comm

    # ---- the meeting ----------------------------------------------------------------------------

    def _break(self, reason: str) -> None:
        """Caller holds the lock."""
        if self._broken is None:
            self._broken = reason
            log.error("host comm group broken: %s", reason)
        self._cond.notify_all()

    def _raise_broken(self, rank: int) -> None:
        raise CommError(f"rank {rank}: host comm group is broken: {self._broken}")

    def exchange(self, rank: int, call: _Call, data: np.ndarray, timeout_s: float) -> np.ndarray:
        """Meet the other ranks at this rank's next round; returns the round's result (the
        reduction, or the rank-ordered concatenation for a gather)."""
        with self._cond:
            if self._broken is not None:
                self._raise_broken(rank)
            if rank in self._closed:
                raise CommError(f"rank {rank}: {call} on a closed communicator")
            seq = self._next_seq[rank]
            self._next_seq[rank] += 1
            rnd = self._rounds.get(seq)
            if rnd is None:
                rnd = self._rounds[seq] = _Round(seq, rank, call)
            elif call != rnd.call:
                self._break(
                    f"mismatched collective #{seq}: rank {rank} called {call} but rank "
                    f"{rnd.first_rank} called {rnd.call}"
                )
                self._raise_broken(rank)
            rnd.inputs[rank] = data
            if len(rnd.inputs) == self.world_size:
                try:
                    rnd.result = self._combine(rnd)
                except Exception as e:  # never leave the peers waiting on a result that won't come
                    self._break(f"{call} (collective #{seq}) failed: {e!r}")
                    raise
                self._cond.notify_all()

            deadline = time.monotonic() + timeout_s
            while rnd.result is None:
                if self._broken is not None:
                    self._raise_broken(rank)
                missing = sorted(set(range(self.world_size)) - set(rnd.inputs))
                gone = [r for r in missing if r in self._closed]
                if gone:
                    self._break(
                        f"{call} (collective #{seq}): rank(s) {gone} closed their communicator "
                        f"before arriving; arrived: {sorted(rnd.inputs)}"
                    )
                    self._raise_broken(rank)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._break(
                        f"{call} (collective #{seq}) timed out after {timeout_s:g}s: rank(s) "
                        f"{missing} did not arrive; arrived: {sorted(rnd.inputs)}"
                    )
                    self._raise_broken(rank)
                self._cond.wait(remaining)

            rnd.collected += 1
            if rnd.collected == self.world_size:
                del self._rounds[seq]
            return rnd.result

    def _combine(self, rnd: _Round) -> np.ndarray:
        inputs = [rnd.inputs[r] for r in range(self.world_size)]
        if rnd.call.kind == "all_reduce":
            assert rnd.call.dtype is not None and rnd.call.op is not None
            out = reduce_arrays(inputs, rnd.call.dtype, rnd.call.op)
        else:
            out = np.concatenate(inputs)
        out.flags.writeable = False  # one array shared by all ranks; each copies it out
        return out

    def _close(self, rank: int) -> None:
        with self._cond:
            self._closed.add(rank)
            self._cond.notify_all()


class HostCommunicator:
    """One rank of a ``HostCommGroup``. Collectives run through ``HostBackend.enqueue``: now, or
    at every replay of a graph whose capture they were called in. Each rank's communicator and
    backend belong to that rank's thread; ``stream`` is accepted for the protocol and ignored
    (the host backend runs all stream work in call order)."""

    def __init__(self, group: HostCommGroup, rank: int, backend: HostBackend) -> None:
        self._group = group
        self._rank = rank
        self.backend = backend
        self._closed = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def group(self) -> HostCommGroup:
        return self._group

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CommError(f"rank {self._rank}: {what} on a closed communicator")
        if self._group.broken is not None:
            raise CommError(f"rank {self._rank}: host comm group is broken: {self._group.broken}")

    def all_reduce(
        self, buf: DevicePtr, count: int, dtype: CommDtype, op: ReduceOp, stream: int | None = None
    ) -> None:
        n = check_all_reduce(buf, count, dtype, op)
        call = _Call("all_reduce", n, dtype, op)
        self._check_open(str(call))
        mem, group, rank, timeout = self.backend.mem, self._group, self._rank, self._group.timeout_s
        np_dt = dtype.np_dtype

        def run() -> None:
            # Read at execution time: a replayed graph reduces the buffer's current contents.
            data = mem.read(buf, np_dt, n) if n else np.empty(0, np_dt)
            out = group.exchange(rank, call, data, timeout)
            if n:
                mem.write(buf, out)

        self.backend.enqueue(run, self._touches((buf, n * dtype.itemsize)))

    def all_gather(
        self, send: DevicePtr, recv: DevicePtr, count: int, dtype: CommDtype, stream: int | None = None
    ) -> None:
        n = check_all_gather(send, recv, count, dtype)
        call = _Call("all_gather", n, dtype)
        self._check_open(str(call))
        mem, group, rank, timeout = self.backend.mem, self._group, self._rank, self._group.timeout_s
        np_dt = dtype.np_dtype
        world = self.world_size

        def run() -> None:
            # Read ``send`` before writing ``recv``: in-place (send inside recv) works as in NCCL.
            data = mem.read(send, np_dt, n) if n else np.empty(0, np_dt)
            out = group.exchange(rank, call, data, timeout)
            if n:
                mem.write(recv, out)

        self.backend.enqueue(
            run, self._touches((send, n * dtype.itemsize), (recv, world * n * dtype.itemsize))
        )

    def barrier(self, timeout_s: float) -> None:
        t = check_timeout(timeout_s)
        self._check_open("barrier()")
        # Not stream work: a barrier is a host-side meeting, so it refuses to run under capture
        # (HostBackend.synchronize raises there), as a CUDA synchronize would.
        self.backend.synchronize()
        self._group.exchange(self._rank, _Call("barrier"), np.empty(0, np.uint8), t)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._group._close(self._rank)

    @staticmethod
    def _touches(*spans: tuple[DevicePtr, int]) -> Sequence[tuple[DevicePtr, int]]:
        # A zero-count collective touches no memory; the pointer is not dereferenced.
        return [(p, nb) for p, nb in spans if nb > 0]

    def __repr__(self) -> str:
        return f"HostCommunicator(rank={self._rank}, world_size={self.world_size})"
