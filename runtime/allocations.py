"""Allocation accounting and graph lifetime, shared by both backends.

The table maps every live allocation's base to its size, resolves any interior address to its
allocation, keeps the live/peak counters that lifecycle tests read, and counts how many live graphs
reference each allocation so that a free under a live graph is refused (invariant: a graph never
outlives the memory baked into its nodes).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from .device_ptr import DevicePtr
from .errors import GraphLifetimeError, MemoryFault


@dataclass(frozen=True)
class AllocStats:
    live_allocations: int
    live_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class MappedBuffer:
    """Page-locked host memory that kernels address directly (``alloc_mapped``): ``host`` is the
    CPU's view (uint8), ``device`` the address kernels use. It is an allocation like any other for
    argument checks and graph lifetime: a free under a live graph that stores into it is refused."""

    host: np.ndarray
    device: DevicePtr

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)


@dataclass
class Graph:
    """A captured graph: its native handle and the allocations (bases) its nodes touch."""

    gid: int
    handle: object
    touches: frozenset[int]
    label: str = ""
    destroyed: bool = False
    extra: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else "live"
        return f"Graph#{self.gid}({self.label or 'unnamed'}, {len(self.touches)} allocations, {state})"


class AllocationTable:
    def __init__(self) -> None:
        self._bases: list[int] = []  # sorted
        self._sizes: dict[int, int] = {}
        self._freed: dict[int, int] = {}  # base -> size of allocations already freed
        self._graph_refs: dict[int, set[int]] = {}  # base -> ids of live graphs touching it
        self._graphs: dict[int, Graph] = {}
        self._next_gid = 1
        self.live_bytes = 0
        self.peak_bytes = 0

    # ---- allocations ----------------------------------------------------------------------------

    def add(self, base: int, size: int) -> None:
        bisect.insort(self._bases, base)
        self._sizes[base] = size
        self._freed.pop(base, None)
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def check_free(self, ptr: DevicePtr) -> int:
        """Validate a free without changing anything; returns the size. Raises MemoryFault or
        GraphLifetimeError naming the address."""
        base = ptr.addr
        if base not in self._sizes:
            if base in self._freed:
                raise MemoryFault(f"double free of 0x{base:x} ({self._freed[base]} bytes)")
            owner = self.find(base, 1, quiet=True)
            if owner is not None:
                raise MemoryFault(
                    f"free of 0x{base:x}, which is inside the allocation at 0x{owner[0]:x}, "
                    "not its base"
                )
            raise MemoryFault(f"free of unknown pointer 0x{base:x}")
        refs = self._graph_refs.get(base)
        if refs:
            names = ", ".join(repr(self._graphs[g]) for g in sorted(refs))
            raise GraphLifetimeError(
                f"free of 0x{base:x} while live graph(s) reference it: {names}; destroy them first"
            )
        return self._sizes[base]

    def remove(self, ptr: DevicePtr) -> int:
        size = self.check_free(ptr)
        base = ptr.addr
        del self._sizes[base]
        self._bases.pop(bisect.bisect_left(self._bases, base))
        self._freed[base] = size
        self.live_bytes -= size
        return size

    def find(self, addr: int, nbytes: int = 1, *, quiet: bool = False) -> tuple[int, int] | None:
        """The (base, size) of the live allocation holding [addr, addr + nbytes)."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            base = self._bases[i]
            size = self._sizes[base]
            if addr + nbytes <= base + size:
                return base, size
            if addr < base + size and not quiet:
                raise MemoryFault(
                    f"access of {nbytes} bytes at 0x{addr:x} runs {addr + nbytes - base - size} "
                    f"bytes past the end of the {size}-byte allocation at 0x{base:x}"
                )
        if quiet:
            return None
        for fbase, fsize in self._freed.items():
            if fbase <= addr < fbase + fsize:
                raise MemoryFault(
                    f"use after free: 0x{addr:x} is inside the freed allocation at 0x{fbase:x}"
                )
        raise MemoryFault(f"0x{addr:x} is not inside any live allocation")

    def base_of(self, addr: int) -> int | None:
        hit = self.find(addr, 1, quiet=True)
        return hit[0] if hit else None

    def bytes_from(self, addr: int) -> int:
        """Bytes from ``addr`` to the end of its live allocation (raises MemoryFault if none)."""
        base, size = self.find(addr, 1)
        return base + size - addr

    def stats(self) -> AllocStats:
        return AllocStats(len(self._sizes), self.live_bytes, self.peak_bytes)

    def size_of(self, base: int) -> int:
        return self._sizes[base]

    # ---- graphs ---------------------------------------------------------------------------------

    def new_graph(self, handle: object, touches: set[int], label: str = "") -> Graph:
        g = Graph(self._next_gid, handle, frozenset(touches), label)
        self._next_gid += 1
        self._graphs[g.gid] = g
        for base in g.touches:
            self._graph_refs.setdefault(base, set()).add(g.gid)
        return g

    def check_graph_live(self, g: Graph) -> None:
        if g.destroyed or g.gid not in self._graphs:
            raise GraphLifetimeError(f"{g!r} was destroyed; it cannot be launched")
        for base in g.touches:
            if base not in self._sizes:
                raise GraphLifetimeError(f"{g!r} references freed memory at 0x{base:x}")

    def drop_graph(self, g: Graph) -> None:
        if g.destroyed:
            raise GraphLifetimeError(f"{g!r} destroyed twice")
        g.destroyed = True
        self._graphs.pop(g.gid, None)
        for base in g.touches:
            refs = self._graph_refs.get(base)
            if refs is not None:
                refs.discard(g.gid)
                if not refs:
                    del self._graph_refs[base]

    def live_graphs(self) -> list[Graph]:
        return list(self._graphs.values())
