"""The ``Communicator`` protocol, the typed element and reduction enums, and argument checks shared
by every communicator.

The element type of a collective is always an explicit ``CommDtype`` argument: never inferred from
a buffer, never defaulted. (A collective silently typed BF16 once summed FP32 activations as pairs
of garbage halves; making the type a required, checked argument turns that into a TypeError.)
The enum values are NCCL's own ``ncclDataType_t`` / ``ncclRedOp_t`` values, so the NCCL
communicator passes them through unchanged.
"""

from __future__ import annotations

import enum
import math
from typing import Protocol, runtime_checkable

import ml_dtypes
import numpy as np

from ..device_ptr import DevicePtr
from ..errors import MemoryFault

_NP_DTYPES: dict[int, np.dtype] = {
    0: np.dtype(np.int8),
    1: np.dtype(np.uint8),
    2: np.dtype(np.int32),
    3: np.dtype(np.uint32),
    4: np.dtype(np.int64),
    5: np.dtype(np.uint64),
    6: np.dtype(np.float16),
    7: np.dtype(np.float32),
    8: np.dtype(np.float64),
    9: np.dtype(ml_dtypes.bfloat16),
    10: np.dtype(ml_dtypes.float8_e4m3fn),
}


class CommDtype(enum.IntEnum):
    """Element type of a collective; the value is NCCL's ``ncclDataType_t``."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FP8_E4M3 = 10

    @property
    def np_dtype(self) -> np.dtype:
        return _NP_DTYPES[int(self)]

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self >= CommDtype.FLOAT16

    @property
    def is_signed_int(self) -> bool:
        return self in (CommDtype.INT8, CommDtype.INT32, CommDtype.INT64)

    @classmethod
    def of(cls, dtype: object) -> CommDtype:
        """The CommDtype of a NumPy dtype (``np.float32``, ``ml_dtypes.bfloat16``, ...).

        An explicit conversion for callers that hold a NumPy dtype; collectives themselves never
        accept anything but a CommDtype."""
        dt = np.dtype(dtype)  # type: ignore[call-overload]
        for member in cls:
            if member.np_dtype == dt:
                return member
        raise TypeError(f"no collective element type for NumPy dtype {dt}")

    def __str__(self) -> str:
        return self.name.lower()


class ReduceOp(enum.IntEnum):
    """Reduction of an all-reduce; the value is NCCL's ``ncclRedOp_t``."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4

    def __str__(self) -> str:
        return self.name.lower()


@runtime_checkable
class Communicator(Protocol):
    """A group of ``world_size`` ranks that run the same collectives in the same order.

    Collectives are stream-ordered: they are enqueued on ``stream`` (the backend's default stream
    when None) after the work already there, and a collective enqueued inside a graph capture is
    recorded in the graph and runs again at every replay, on the buffers' contents at that time.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(
        self, buf: DevicePtr, count: int, dtype: CommDtype, op: ReduceOp, stream: int | None = None
    ) -> None:
        """In place: ``buf`` holds ``count`` elements of ``dtype`` on every rank; afterwards every
        rank holds the same reduction of all ranks' inputs."""
        ...

    def all_gather(
        self, send: DevicePtr, recv: DevicePtr, count: int, dtype: CommDtype, stream: int | None = None
    ) -> None:
        """``recv`` (``world_size * count`` elements) receives every rank's ``count``-element
        ``send`` block, in rank order."""
        ...

    def barrier(self, timeout_s: float) -> None:
        """Return once every rank has reached its barrier and this rank's work on the default
        stream is done; CommError after ``timeout_s`` instead of hanging."""
        ...

    def close(self) -> None: ...


def check_dtype_op(dtype: object, op: object | None = None) -> None:
    if not isinstance(dtype, CommDtype):
        raise TypeError(
            f"collective dtype must be a CommDtype, got {dtype!r} ({type(dtype).__name__}); "
            "use CommDtype.of(np_dtype) to convert"
        )
    if op is not None and not isinstance(op, ReduceOp):
        raise TypeError(f"reduction op must be a ReduceOp, got {op!r} ({type(op).__name__})")


def check_count(count: object) -> int:
    # bool is an int subclass; a True count is a bug, not one element.
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise TypeError(f"element count must be an int, got {count!r} ({type(count).__name__})")
    if count < 0:
        raise ValueError(f"element count must be >= 0, got {count}")
    return int(count)


def check_ptr(name: str, ptr: object) -> DevicePtr:
    if not isinstance(ptr, DevicePtr):
        raise TypeError(f"{name} must be a DevicePtr, got {type(ptr).__name__}")
    if not ptr:
        raise ValueError(f"{name} is a null DevicePtr")
    return ptr


def check_all_reduce(buf: object, count: object, dtype: object, op: object) -> int:
    """Validate all_reduce arguments; returns the count as an int."""
    check_dtype_op(dtype, op)
    n = check_count(count)
    check_ptr("buf", buf)
    return n


def check_all_gather(send: object, recv: object, count: object, dtype: object) -> int:
    check_dtype_op(dtype)
    n = check_count(count)
    check_ptr("send", send)
    check_ptr("recv", recv)
    return n


def check_timeout(timeout_s: object) -> float:
    t = float(timeout_s)  # type: ignore[arg-type]
    # An infinite timeout would bring back the hang that timeouts exist to prevent.
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"timeout must be a positive finite number of seconds, got {timeout_s!r}")
    return t


def check_span(backend: object, name: str, ptr: DevicePtr, nbytes: int) -> None:
    """Refuse a collective that would run past the end of ``ptr``'s allocation, before the device
    corrupts whatever lies behind it (a count given in bytes instead of elements, a gather buffer
    sized for one rank). Uses the backend's allocation table (``bytes_from``) when it has one."""
    bytes_from = getattr(backend, "bytes_from", None)
    if bytes_from is None or nbytes == 0:
        return
    avail = int(bytes_from(ptr))
    if avail < nbytes:
        raise MemoryFault(
            f"{name}: the collective needs {nbytes} bytes at 0x{ptr.addr:x} but its allocation "
            f"has only {avail} bytes from there"
        )
    # Inside a capture the collective becomes a graph node: its buffers join the graph's lifetime
    # set, so freeing one while the graph lives is refused like any kernel argument.
    touch = getattr(backend, "touch", None)
    if touch is not None:
        touch(ptr, nbytes)
