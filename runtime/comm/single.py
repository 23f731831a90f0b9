"""World size 1: every collective is the identity, and it is still checked.

All-reduce leaves the buffer as it is (the reduction of one input, even avg: NCCL scales by 1);
all-gather copies ``send`` to ``recv`` on the stream through the backend, so it is captured in a
graph like any copy. Arguments are validated exactly as the multi-rank communicators do, so code
that passes a wrong dtype fails on one GPU too, not first on eight.
"""

from __future__ import annotations

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


class SingleRankCommunicator:
    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._closed = False

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CommError(f"{what} on a closed communicator")

    def all_reduce(
        self, buf: DevicePtr, count: int, dtype: CommDtype, op: ReduceOp, stream: int | None = None
    ) -> None:
        n = check_all_reduce(buf, count, dtype, op)
        self._check_open("all_reduce")
        check_span(self.backend, "all_reduce buf", buf, n * dtype.itemsize)

    def all_gather(
        self, send: DevicePtr, recv: DevicePtr, count: int, dtype: CommDtype, stream: int | None = None
    ) -> None:
        n = check_all_gather(send, recv, count, dtype)
        self._check_open("all_gather")
        check_span(self.backend, "all_gather send", send, n * dtype.itemsize)
        check_span(self.backend, "all_gather recv", recv, n * dtype.itemsize)
        if n and send != recv:
            self.backend.copy_d2d(recv, send, n * dtype.itemsize, stream)

    def barrier(self, timeout_s: float) -> None:
        check_timeout(timeout_s)
        self._check_open("barrier")
        self.backend.synchronize()

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return "SingleRankCommunicator()"
