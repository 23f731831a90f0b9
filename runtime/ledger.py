"""The pointer and capture bookkeeping both backends share, so that the host and the device refuse
the same things with the same messages.

A ``Ledger`` holds a backend's live allocations (``AllocationTable``), its live graphs and what
each references (``GraphTable``), and the open capture. Every pointer a launch, copy, memset or
collective uses goes through ``touch``: it must lie inside a live allocation (checked before any
driver call, so a bad pointer is a ``MemoryFault`` rather than a sticky device fault), and inside a
capture its allocation joins the graph's references. Invariant: a graph never outlives the memory
baked into its nodes, so a free of an allocation a live graph references raises
``GraphLifetimeError``, as does a free while a capture is open (its graph is not built yet).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .allocations import AllocationTable, AllocStats
from .device_ptr import DevicePtr
from .errors import GraphLifetimeError
from .graph import Capture, Graph, GraphTable


class Ledger:
    def __init__(self) -> None:
        self.allocations = AllocationTable()
        self.graphs = GraphTable()
        self.capture: Capture | None = None

    # ---- allocations ------------------------------------------------------------------------------

    def add(self, base: int, size: int) -> None:
        self.allocations.add(base, size)

    def check_free(self, ptr: DevicePtr, what: str = "free") -> int:
        """Validate a free without changing anything; returns the size. MemoryFault for a pointer
        that is not a live allocation's base, GraphLifetimeError under a live graph or a capture."""
        size = self.allocations.check_free(ptr.addr)
        graphs = self.graphs.referencing(ptr.addr)
        if graphs:
            names = ", ".join(repr(g) for g in graphs)
            raise GraphLifetimeError(
                f"{what} of 0x{ptr.addr:x} while live graph(s) reference it: {names}; destroy them first"
            )
        if self.capture is not None:
            raise GraphLifetimeError(f"{what} of 0x{ptr.addr:x} during graph capture")
        return size

    def remove(self, ptr: DevicePtr, what: str = "free") -> int:
        self.check_free(ptr, what)
        return self.allocations.remove(ptr.addr)

    def touch(self, ptr: DevicePtr, nbytes: int = 1) -> int:
        """The base of the live allocation holding ``nbytes`` at ``ptr`` (MemoryFault naming the
        address otherwise), recorded in the open capture."""
        if not isinstance(ptr, DevicePtr):
            raise TypeError(f"expected DevicePtr, got {type(ptr).__name__}")
        base, _ = self.allocations.find(ptr.addr, max(int(nbytes), 1))  # type: ignore[misc]
        if self.capture is not None:
            self.capture.touches.add(base)
        return base

    @contextmanager
    def borrowed(self, addr: int, nbytes: int) -> Iterator[DevicePtr]:
        """Device memory another library owns (a PyTorch tensor), usable as a pointer for the
        duration of the block: it joins the live allocations so copies and launches accept it, and
        leaves them at the end, when a live graph that baked it is a GraphLifetimeError (the owner
        may free it at any time after the call). A range inside a live allocation of this backend
        is that allocation, used as it is."""
        if addr <= 0 or nbytes <= 0:
            raise ValueError(f"borrow of {nbytes} bytes at 0x{addr:x}")
        if self.allocations.find(addr, 1, quiet=True) is not None:
            self.allocations.find(addr, nbytes)  # MemoryFault when the range runs past its end
            yield DevicePtr(addr)
            return
        self.allocations.add(addr, nbytes)
        try:
            yield DevicePtr(addr)
        finally:
            self.remove(DevicePtr(addr), "end of the borrow")

    def bytes_from(self, ptr: DevicePtr) -> int:
        return self.allocations.bytes_from(ptr.addr)

    def stats(self) -> AllocStats:
        return self.allocations.stats()

    # ---- capture ----------------------------------------------------------------------------------

    def refuse_in_capture(self, what: str) -> None:
        """For host-synchronous work (a synchronous copy, a synchronize) that a graph cannot hold."""
        if self.capture is not None:
            raise GraphLifetimeError(f"{what} is not allowed during graph capture")

    def begin_capture(self, stream: int) -> None:
        if self.capture is not None:
            raise GraphLifetimeError("begin_capture while a capture is already open")
        self.capture = Capture(stream)

    def end_capture(self, stream: int) -> Capture:
        """Close the open capture begun on ``stream`` and return it; nothing changes on an error."""
        if self.capture is None:
            raise GraphLifetimeError("end_capture without begin_capture")
        if stream != self.capture.stream:
            raise GraphLifetimeError(
                f"end_capture on stream {stream} but the capture began on {self.capture.stream}"
            )
        capture, self.capture = self.capture, None
        return capture

    def abort_capture(self) -> Capture | None:
        capture, self.capture = self.capture, None
        return capture

    # ---- graphs -----------------------------------------------------------------------------------

    def new_graph(self, handle: object, capture: Capture, label: str = "") -> Graph:
        return self.graphs.add(handle, capture.touches, label)

    def replay(self, g: Graph) -> None:
        """Check that ``g`` may be launched; inside a capture its references join the new graph's."""
        self.graphs.check_live(g)
        if self.capture is not None:
            self.capture.touches |= g.touches

    def drop_graph(self, g: Graph) -> None:
        self.graphs.drop(g)

    def live_graphs(self) -> list[Graph]:
        return self.graphs.live()
