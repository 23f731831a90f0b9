"""Captured graphs and the open capture, as both backends keep them.

A graph's nodes have device addresses baked in, so the invariant is that a graph never outlives
the memory it references: ``Ledger`` (runtime/ledger.py) refuses a free while a live graph
touches the allocation, using the references kept here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import GraphLifetimeError


@dataclass
class Graph:
    """A captured graph: its native handle and the allocations (bases) its nodes touch."""

    gid: int
    handle: object
    touches: frozenset[int]
    label: str = ""
    destroyed: bool = False

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else "live"
        return f"Graph#{self.gid}({self.label or 'unnamed'}, {len(self.touches)} allocations, {state})"


@dataclass
class Capture:
    """An open stream capture: the stream it began on and the allocation bases its work touched."""

    stream: int
    touches: set[int] = field(default_factory=set)


class GraphTable:
    """The live graphs, and for every allocation base the live graphs that reference it."""

    def __init__(self) -> None:
        self._graphs: dict[int, Graph] = {}
        self._refs: dict[int, set[int]] = {}  # base -> ids of live graphs touching it
        self._next_gid = 1

    def add(self, handle: object, touches: set[int], label: str = "") -> Graph:
        g = Graph(self._next_gid, handle, frozenset(touches), label)
        self._next_gid += 1
        self._graphs[g.gid] = g
        for base in g.touches:
            self._refs.setdefault(base, set()).add(g.gid)
        return g

    def referencing(self, base: int) -> list[Graph]:
        return [self._graphs[gid] for gid in sorted(self._refs.get(base, ()))]

    def check_live(self, g: Graph) -> None:
        if g.destroyed or self._graphs.get(g.gid) is not g:
            raise GraphLifetimeError(f"{g!r} was destroyed; it cannot be launched")

    def drop(self, g: Graph) -> None:
        if g.destroyed:
            raise GraphLifetimeError(f"{g!r} destroyed twice")
        g.destroyed = True
        self._graphs.pop(g.gid, None)
        for base in g.touches:
            refs = self._refs.get(base)
            if refs is not None:
                refs.discard(g.gid)
                if not refs:
                    del self._refs[base]

    def live(self) -> list[Graph]:
        return list(self._graphs.values())
