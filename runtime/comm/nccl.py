"""``NcclCommunicator``: the Communicator protocol over NCCL, through ctypes.

The communicator is created non-blocking (``config.blocking = 0``) so that no NCCL call can hold
the Python thread forever: initialisation and every enqueue return at once (ncclSuccess or
ncclInProgress) and we poll ``ncclCommGetAsyncError`` against a deadline; when the deadline
passes, the communicator is aborted (``ncclCommAbort`` also stops kernels spinning on a peer) and
a CommError says what was waited for. After an abort or an asynchronous error the communicator is
unusable and every later call raises at once.

Collectives are enqueued on a CUDA stream and return before they complete, so a peer that never
arrives shows up as a stream that never finishes. ``wait(stream, timeout_s)`` (and ``barrier``)
poll the stream against a deadline; use them, not an unbounded stream synchronize, where ranks
meet. Enqueueing under CUDA stream capture records the collective in the graph; it runs at every
replay on the buffers' contents at that time.

The CUDA context of the backend must be current on the calling thread (NCCL uses the current
device), and one rank per GPU: two ranks of one communicator cannot share a GPU.

NCCL reads its own environment (``NCCL_NVLS_ENABLE``, ``NCCL_SOCKET_IFNAME``, ...); this module
does not. The entry point sets them: see ``runtime.launcher.nccl_env``.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import TYPE_CHECKING

from ..backend import GpuBackend
from ..device_ptr import DevicePtr
from ..errors import CommError
from .base import (
    CommDtype,
    ReduceOp,
    check_all_gather,
    check_all_reduce,
    check_span,
    check_timeout,
)
from .nccl_lib import NCCL_IN_PROGRESS, NCCL_SUCCESS, NcclConfig, NcclLib, load_nccl

if TYPE_CHECKING:
    from ..rendezvous import DistEnv

log = logging.getLogger(__name__)

_CUDA_ERROR_NOT_READY = 600


def missing_peers(rank: int, world_size: int) -> str:
    """The ranks a timed-out wait of ``rank`` was waiting for, as precisely as NCCL allows: it
    reports no per-peer progress, so with two ranks the other one is named, with more the
    candidates (the launcher's log names a rank whose process exited)."""
    peers = [r for r in range(world_size) if r != rank]
    if not peers:
        return "the communicator has no other rank: the stream's own work did not finish"
    if len(peers) == 1:
        return f"rank {peers[0]} did not arrive (dead, or stopped before a collective)"
    return (
        f"one or more of ranks {peers} did not arrive (dead, or stopped before a collective; "
        "NCCL does not say which)"
    )


class NcclCommunicator:
    """One rank of an NCCL communicator of ``world_size`` ranks built from ``unique_id`` (the
    128 bytes that rank 0 got from ``ncclGetUniqueId`` and every rank received, see
    ``from_rendezvous``). ``timeout_s`` bounds initialisation and every host-side wait."""

    def __init__(
        self,
        backend: GpuBackend,
        rank: int,
        world_size: int,
        unique_id: bytes,
        *,
        timeout_s: float = 120.0,
        lib: NcclLib | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.backend = backend
        self.timeout_s = check_timeout(timeout_s)
        self._lib = lib or load_nccl()
        self._rank = rank
        self._world = world_size
        self._comm: int = 0
        self._dead: str | None = None  # why the communicator can no longer be used
        self._scratch: DevicePtr | None = None
        uid = self._lib.unique_id(unique_id)
        config = NcclConfig.make(blocking=False)
        handle = ctypes.c_void_p()
        what = f"ncclCommInitRankConfig(rank {rank} of {world_size})"
        t0 = time.monotonic()
        res = self._lib.ncclCommInitRankConfig(
            ctypes.byref(handle), world_size, uid, rank, ctypes.byref(config)
        )
        self._comm = handle.value or 0
        if res not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            text = self._lib.error_text(res, self._comm or None)
            self._abort_quietly()
            raise CommError(f"{what} failed: {text}")
        self._wait_ready(what, t0 + self.timeout_s, waiting_for="the other ranks to join")
        log.info(
            "NCCL %s communicator ready: rank %d of %d (%.2fs)",
            self._lib.version,
            rank,
            world_size,
            time.monotonic() - t0,
        )

    @classmethod
    def from_rendezvous(
        cls,
        backend: GpuBackend,
        dist: DistEnv,
        fingerprint: str,
        *,
        timeout_s: float = 120.0,
        lib: NcclLib | None = None,
    ) -> NcclCommunicator:
        """Rank 0 creates the unique id; the rendezvous store hands it to every rank after
        checking that all agree on world size and ``fingerprint``; then every rank joins."""
        from ..rendezvous import rendezvous

        lib = lib or load_nccl()
        payload = lib.get_unique_id() if dist.rank == 0 else None
        result = rendezvous(dist, fingerprint, payload=payload, timeout_s=timeout_s)
        return cls(backend, dist.rank, dist.world_size, result.payload, timeout_s=timeout_s, lib=lib)

    # ---- protocol -------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def handle(self) -> int:
        """The raw ncclComm_t (0 once closed or aborted)."""
        return self._comm

    def all_reduce(
        self, buf: DevicePtr, count: int, dtype: CommDtype, op: ReduceOp, stream: int | None = None
    ) -> None:
        n = check_all_reduce(buf, count, dtype, op)
        what = f"ncclAllReduce(count={n}, dtype={dtype}, op={op})"
        self._check_usable(what)
        check_span(self.backend, "all_reduce buf", buf, n * dtype.itemsize)
        s = self._stream(stream)
        res = self._lib.ncclAllReduce(buf.addr, buf.addr, n, int(dtype), int(op), self._comm, s)
        self._after_enqueue(res, what)

    def all_gather(
        self, send: DevicePtr, recv: DevicePtr, count: int, dtype: CommDtype, stream: int | None = None
    ) -> None:
        n = check_all_gather(send, recv, count, dtype)
        what = f"ncclAllGather(count={n}, dtype={dtype})"
        self._check_usable(what)
        check_span(self.backend, "all_gather send", send, n * dtype.itemsize)
        check_span(self.backend, "all_gather recv", recv, self._world * n * dtype.itemsize)
        s = self._stream(stream)
        res = self._lib.ncclAllGather(send.addr, recv.addr, n, int(dtype), self._comm, s)
        self._after_enqueue(res, what)

    def barrier(self, timeout_s: float) -> None:
        """A one-element all-reduce on the default stream, then a bounded wait for the stream."""
        t = check_timeout(timeout_s)
        self._check_usable("barrier")
        if self._scratch is None:
            # Allocated on first use and freed by close(), so a communicator that never meets in
            # a barrier holds no device memory.
            self._scratch = self.backend.alloc(4)
        self.all_reduce(self._scratch, 1, CommDtype.INT32, ReduceOp.SUM)
        self.wait(None, t)

    def wait(self, stream: int | None = None, timeout_s: float | None = None) -> None:
        """Block until ``stream`` (default: the backend's) has finished its work, polling NCCL for
        asynchronous errors; after ``timeout_s`` abort the communicator and raise CommError."""
        from cuda.bindings import driver

        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        self._check_usable("wait")
        s = self._stream(stream)
        deadline = time.monotonic() + t
        pause = 1e-5
        while True:
            (err,) = driver.cuStreamQuery(s)
            code = int(err)
            if code == 0:
                return
            if code != _CUDA_ERROR_NOT_READY:
                raise CommError(f"waiting for stream 0x{s:x}: cuStreamQuery returned {err!r}")
            self._poll_async("wait for the stream")
            if time.monotonic() > deadline:
                reason = (
                    f"stream 0x{s:x} did not finish within {t:g}s: "
                    f"{missing_peers(self._rank, self._world)}; communicator aborted"
                )
                self.abort(reason)
                raise CommError(f"rank {self._rank}: {reason}")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Tear the communicator down at once (``ncclCommAbort``), stopping its in-flight
        kernels; every later call raises. Idempotent."""
        if self._dead is None:
            self._dead = reason
        if self._comm:
            log.warning("aborting NCCL communicator (rank %d of %d): %s", self._rank, self._world, reason)
            self._abort_quietly()
        self._free_scratch()

    def close(self) -> None:
        """Finish pending work and free the communicator (``ncclCommFinalize`` then
        ``ncclCommDestroy``); aborts instead if finalising does not finish within the timeout."""
        if self._comm:
            what = "ncclCommFinalize"
            try:
                if self._dead is None:
                    self._lib.check(self._lib.ncclCommFinalize(self._comm), what, self._comm)
                    self._wait_ready(
                        what, time.monotonic() + self.timeout_s, waiting_for="pending collectives to finish"
                    )
            except CommError as e:
                self.abort(str(e))  # _wait_ready may have aborted already; abort is idempotent
                raise
            finally:
                if self._comm:
                    comm, self._comm = self._comm, 0
                    res = self._lib.ncclCommDestroy(comm)
                    if res != NCCL_SUCCESS:
                        log.warning("ncclCommDestroy: %s", self._lib.error_text(res))
        if self._dead is None:
            self._dead = "closed"
        self._free_scratch()

    # ---- internals ------------------------------------------------------------------------------

    def _stream(self, stream: int | None) -> int:
        return int(self.backend.default_stream if stream is None else stream)

    def _check_usable(self, what: str) -> None:
        if self._dead is not None or not self._comm:
            raise CommError(f"rank {self._rank}: {what} on an unusable NCCL communicator: {self._dead}")

    def _after_enqueue(self, res: int, what: str) -> None:
        if res == NCCL_SUCCESS:
            return
        if res == NCCL_IN_PROGRESS:
            # Non-blocking comms may finish an enqueue (e.g. lazy connection setup) in the
            # background; the next NCCL call must wait for it.
            self._wait_ready(what, time.monotonic() + self.timeout_s, waiting_for="the enqueue")
            return
        text = self._lib.error_text(res, self._comm)
        self._dead = f"{what} failed: {text}"
        # An error from an enqueue leaves the communicator in an undefined state (NCCL docs):
        # abort rather than let the peers wait for a collective that will not come.
        self.abort(self._dead)
        raise CommError(f"rank {self._rank}: {what} failed: {text}")

    def _poll_async(self, what: str) -> int:
        state = ctypes.c_int()
        res = self._lib.ncclCommGetAsyncError(self._comm, ctypes.byref(state))
        if res != NCCL_SUCCESS:
            text = self._lib.error_text(res, self._comm)
            self.abort(f"ncclCommGetAsyncError during {what}: {text}")
            raise CommError(f"rank {self._rank}: ncclCommGetAsyncError during {what}: {text}")
        if state.value not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            text = self._lib.error_text(state.value, self._comm)
            self.abort(f"{what}: {text}")
            raise CommError(f"rank {self._rank}: {what}: asynchronous NCCL error {text}")
        return state.value

    def _wait_ready(self, what: str, deadline: float, *, waiting_for: str) -> None:
        pause = 1e-4
        while self._poll_async(what) == NCCL_IN_PROGRESS:
            if time.monotonic() > deadline:
                reason = (
                    f"{what} timed out waiting for {waiting_for} (rank {self._rank} of {self._world}): "
                    f"{missing_peers(self._rank, self._world)}"
                )
                self.abort(reason)
                raise CommError(reason)
            time.sleep(pause)
            pause = min(pause * 2, 10e-3)

    def _abort_quietly(self) -> None:
        comm, self._comm = self._comm, 0
        if comm:
            res = self._lib.ncclCommAbort(comm)
            if res != NCCL_SUCCESS:
                log.warning("ncclCommAbort: %s", self._lib.error_text(res))

    def _free_scratch(self) -> None:
        if self._scratch is not None:
            ptr, self._scratch = self._scratch, None
            try:
                self.backend.free(ptr)
            except Exception as e:  # a context already torn down must not mask the real error
                log.warning("freeing the barrier scratch buffer: %s", e)

    def __repr__(self) -> str:
        state = "live" if self._comm and self._dead is None else (self._dead or "closed")
        return f"NcclCommunicator(rank={self._rank}, world_size={self._world}, {state})"
