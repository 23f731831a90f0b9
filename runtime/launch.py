"""Launching a kernel: ``launch`` (grid, block, shared memory and typed arguments, checked against
the kernel's declared signature before anything runs: a wrong count or type is a ``LaunchError``),
the argument packing cuLaunchKernel reads, the programmatic-dependent-launch state of a backend's
streams, and the grid of a one-wave grid-stride kernel."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any

from .backend import Dim3, GpuBackend, KernelHandle
from .device_ptr import DevicePtr
from .errors import LaunchError
from .kernel import Arg, KernelDecl, Pdl

_INT_RANGE = {
    Arg.U32: (0, 2**32 - 1),
    Arg.I32: (-(2**31), 2**31 - 1),
    Arg.U64: (0, 2**64 - 1),
}


def _dim3(d: int | Sequence[int], what: str, kernel: KernelHandle) -> Dim3:
    t = (d, 1, 1) if isinstance(d, int) else tuple(d) + (1,) * (3 - len(d))
    if len(t) != 3 or any((not isinstance(v, int)) or v < 1 for v in t):
        raise LaunchError(f"{kernel.name}: {what} {d!r} is not 1..3 positive integers")
    return t  # type: ignore[return-value]


def check_args(kernel: KernelHandle, args: Sequence[Any]) -> tuple[Any, ...]:
    """Check ``args`` against the kernel's declaration; return them normalised."""
    if kernel.decl is None:
        raise LaunchError("launch of a null kernel handle (the kernel was absent at lookup)")
    decl = kernel.decl
    if len(args) != len(decl.args):
        raise LaunchError(
            f"{kernel.name} takes {len(decl.args)} arguments "
            f"({', '.join(n for n, _ in decl.args)}), got {len(args)}"
        )
    out = []
    for (name, typ), v in zip(decl.args, args):
        if typ is Arg.PTR:
            if not isinstance(v, DevicePtr):
                raise LaunchError(
                    f"{kernel.name}: argument {name} must be a DevicePtr, got {type(v).__name__}"
                )
            if not v:
                raise LaunchError(f"{kernel.name}: argument {name} is a null pointer")
        elif typ is Arg.F32:
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
                raise LaunchError(f"{kernel.name}: argument {name} must be a float, got {type(v).__name__}")
            v = float(v)
        else:
            if isinstance(v, (bool, float)) or not hasattr(v, "__index__"):
                raise LaunchError(
                    f"{kernel.name}: argument {name} must be an integer ({typ.value}), got {v!r}"
                )
            v = int(v)
            lo, hi = _INT_RANGE[typ]
            if not lo <= v <= hi:
                raise LaunchError(f"{kernel.name}: argument {name}={v} does not fit {typ.value}")
        out.append(v)
    return tuple(out)


def launch(
    gpu: GpuBackend,
    kernel: KernelHandle,
    grid: int | Sequence[int],
    block: int | Sequence[int],
    *args: Any,
    smem: int = 0,
    stream: int | None = None,
) -> None:
    """One launch; the backend checks the arguments against the declaration, once (a second check
    here cost a third of a kernel helper's host time: see BENCHMARKS.md, "Runtime kernels: notes
    behind the numbers")."""
    if kernel.decl is None:
        raise LaunchError("launch of a null kernel handle (the kernel was absent at lookup)")
    g3, b3 = _dim3(grid, "grid", kernel), _dim3(block, "block", kernel)
    if b3[0] * b3[1] * b3[2] > 1024:
        raise LaunchError(f"{kernel.name}: block {b3} has more than 1024 threads")
    gpu.launch(kernel, g3, b3, args, smem, stream)


def grid_stride_blocks(units: int, resident: int) -> int:
    """Blocks for a one-wave grid-stride kernel over ``units`` equal work items (a block's share of
    one round): at most the ``resident`` blocks the device holds at once, and among grids with the
    fewest rounds the smallest, so that every block runs the same number of rounds but at most one
    fewer. With the full resident grid a last round can be left to a few blocks: the FP8 head's
    9680 sixteen-row groups over 528 blocks gave 176 blocks a 19th round while 352 sat idle; 510
    blocks run 19 rounds each (the 10 last 18)."""
    if units < 1 or resident < 1:
        raise LaunchError(
            f"grid_stride_blocks needs positive units and resident blocks, got {units}, {resident}"
        )
    rounds = -(-units // resident)
    return -(-units // rounds)


class ArgPacker:
    """The ``kernelParams`` array for one kernel: an 8-byte slot per argument and a ``uint64``
    array of the slots' addresses, both allocated once and rewritten in place per launch
    (cuLaunchKernel copies the values at the call, so reuse across launches is safe). This form
    costs less host time per launch than the ``(values, types)`` tuple form, which rebuilds ctypes
    objects on every call (see BENCHMARKS.md, "Runtime kernels: notes behind the numbers").
    """

    __slots__ = ("_buf", "_ptrs", "address", "_struct", "_is_ptr", "_n")

    # One 8-byte slot per argument; a 4-byte argument sits in the low half of its slot
    # (little-endian), which is where the driver reads it.
    _FORMAT = {Arg.PTR: "Q", Arg.U64: "Q", Arg.U32: "I4x", Arg.I32: "i4x", Arg.F32: "f4x"}

    def __init__(self, decl: KernelDecl) -> None:
        n = max(len(decl.args), 1)
        self._n = len(decl.args)
        self._buf = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_uint64 * n)(*[base + 8 * i for i in range(n)])
        self.address: int = ctypes.addressof(self._ptrs)
        # struct.pack_into writes every slot in one C call, cheaper than a numpy item store per
        # argument (same notes in BENCHMARKS.md).
        self._struct = struct.Struct("<" + "".join(self._FORMAT[t] for _, t in decl.args))
        self._is_ptr = tuple(t is Arg.PTR for _, t in decl.args)

    def pack(self, args: Sequence[Any]) -> int:
        """Write already-checked arguments (``check_args`` output) into the slots; return the
        ``void**`` address for cuLaunchKernel."""
        self._struct.pack_into(
            self._buf, 0, *[v.addr if p else v for p, v in zip(self._is_ptr, args, strict=True)]
        )
        return self.address

    def slot_bytes(self) -> bytes:
        """The packed argument bytes (for tests)."""
        return bytes(self._buf)[: 8 * self._n]


class PdlState:
    """Programmatic dependent launch (``runtime.kernel.Pdl``) over one backend's streams: whether
    it is on (it may be switched between launches; a graph keeps the launches it captured), and
    the streams whose last operation is a launch of a kernel that releases its dependents. Only
    there may a ``Pdl.BESIDE`` kernel overlap its predecessor; any other stream operation (a copy,
    a memset, an event, a graph, a collective) takes its stream out."""

    __slots__ = ("supported", "_on", "_after_release")

    def __init__(self, supported: bool, on: bool) -> None:
        self.supported = supported
        self._on = bool(on) and supported
        self._after_release: set[int] = set()

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        self._on = bool(value) and self.supported

    def overlaps(self, decl: KernelDecl, stream: int) -> bool:
        """Whether this launch of ``decl`` on ``stream`` gets programmatic stream serialisation.
        A BESIDE kernel whose predecessor did not release may still see it writing its input: it is
        launched plainly."""
        if not self._on or not decl.pdl:
            return False
        return decl.pdl is not Pdl.BESIDE or stream in self._after_release

    def launched(self, decl: KernelDecl, stream: int) -> None:
        if decl.releases:
            self._after_release.add(stream)
        else:
            self._after_release.discard(stream)

    def other_work(self, stream: int) -> None:
        self._after_release.discard(stream)

    def work_on_unknown_stream(self) -> None:
        self._after_release.clear()
