"""``HostBackend``: the GpuBackend protocol over a NumPy heap.

Device memory is a set of NumPy byte arrays at made-up, never-reused addresses separated by guard
gaps. New and freed memory is poisoned (0xFF: NaN in bf16/f32/fp8, a huge u32), and every access
resolves through the allocation table, so an out-of-bounds pointer, a use after free, a double
free or a free of an unknown pointer raises an error naming the address instead of corrupting
memory silently, as it would on a GPU. Kernels run their registered host twins. Graph capture
records launches and copies and replays them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .allocations import AllocationTable, AllocStats, MappedBuffer
from .backend import NULL_KERNEL, Dim3, KernelHandle
from .device_ptr import DevicePtr
from .errors import KernelNotFound, LaunchError, MemoryFault, OutOfMemoryError
from .graph import Graph
from .kernel import KernelDecl, lookup
from .launch import check_args
from .ledger import Ledger

POISON = 0xFF
_BASE = 0x7F00_0000_0000
_ALIGN = 256
_GUARD = 4096


class HostMemory:
    """What a host twin sees: bounds-checked typed views into the heap."""

    def __init__(self, table: AllocationTable, arrays: dict[int, np.ndarray]) -> None:
        self._table = table
        self._arrays = arrays

    def _bytes(self, ptr: DevicePtr, nbytes: int) -> np.ndarray:
        if not isinstance(ptr, DevicePtr):
            raise TypeError(f"expected DevicePtr, got {type(ptr).__name__}")
        if nbytes < 0:
            raise MemoryFault(f"negative access size {nbytes} at 0x{ptr.addr:x}")
        base, _ = self._table.find(ptr.addr, max(nbytes, 1))
        off = ptr.addr - base
        return self._arrays[base][off : off + nbytes]

    def view(self, ptr: DevicePtr, dtype: Any, count: int | tuple[int, ...]) -> np.ndarray:
        """A writable view of ``count`` elements (or a shape) of ``dtype`` at ``ptr``."""
        dt = np.dtype(dtype)
        shape = (count,) if isinstance(count, (int, np.integer)) else tuple(count)
        n = int(np.prod(shape)) if shape else 1
        raw = self._bytes(ptr, n * dt.itemsize)
        if ptr.addr % dt.alignment:
            raise MemoryFault(f"misaligned {dt} access at 0x{ptr.addr:x}")
        return raw.view(dt).reshape(shape)

    def read(self, ptr: DevicePtr, dtype: Any, count: int | tuple[int, ...]) -> np.ndarray:
        return self.view(ptr, dtype, count).copy()

    def write(self, ptr: DevicePtr, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        self._bytes(ptr, values.nbytes)[:] = values.reshape(-1).view(np.uint8)

    def scalar(self, ptr: DevicePtr, dtype: Any) -> Any:
        return self.view(ptr, dtype, 1)[0].item()


class HostBackend:
    name = "host"

    def __init__(self, capacity_bytes: int = 32 << 30) -> None:
        self.capacity = capacity_bytes
        self._ledger = Ledger()
        self._arrays: dict[int, np.ndarray] = {}
        self._mapped: set[int] = set()  # bases of alloc_mapped buffers
        self.mem = HostMemory(self._ledger.allocations, self._arrays)
        self._next = _BASE
        self._ops: list[Callable[[], None]] | None = None  # what the open capture recorded
        self._streams = {0}
        self._next_stream = 1

    # ---- memory ---------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc of {nbytes} bytes: size must be positive")
        free, _ = self.mem_info()
        if nbytes > free:
            raise OutOfMemoryError(
                f"alloc of {nbytes} bytes ({nbytes / 2**20:.1f} MiB) exceeds the {free} bytes free "
                f"on the host heap (capacity {self.capacity})"
            )
        base = self._next
        self._next += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + _GUARD
        self._arrays[base] = np.full(nbytes, POISON, dtype=np.uint8)
        self._ledger.add(base, nbytes)
        return DevicePtr(base)

    def free(self, ptr: DevicePtr) -> None:
        if ptr.addr in self._mapped:
            raise MemoryFault(f"free of 0x{ptr.addr:x}, a buffer from alloc_mapped: use free_mapped")
        self._free(ptr)

    def _free(self, ptr: DevicePtr) -> None:
        self._ledger.remove(ptr)
        arr = self._arrays.pop(ptr.addr)
        arr[:] = POISON  # any view a twin kept now reads poison

    def memset(self, ptr: DevicePtr, byte: int, nbytes: int, stream: int | None = None) -> None:
        self._ledger.touch(ptr, nbytes)
        self._run(lambda: self.mem._bytes(ptr, nbytes).fill(byte & 0xFF))

    def copy_h2d(self, dst: DevicePtr, src: np.ndarray | bytes, stream: int | None = None) -> None:
        data = (
            np.frombuffer(bytes(src), np.uint8)
            if isinstance(src, (bytes, bytearray))
            else np.ascontiguousarray(src)
        )
        self._ledger.touch(dst, data.nbytes)
        if self._ops is not None:
            if stream is None:
                self._ledger.refuse_in_capture("a synchronous copy")
            # The CUDA graph reads the host buffer at replay time, so the host twin does too.
            self._ops.append(lambda: self.mem.write(dst, data))
            return
        self.mem.write(dst, data.copy())

    def copy_d2h(self, dst: np.ndarray, src: DevicePtr, stream: int | None = None) -> None:
        if not dst.flags.c_contiguous:
            raise ValueError("copy_d2h destination must be C-contiguous")
        self._ledger.touch(src, dst.nbytes)
        if stream is None:
            self._ledger.refuse_in_capture("a synchronous copy")
        flat = dst.reshape(-1).view(np.uint8)
        self._run(lambda: flat.__setitem__(slice(None), self.mem._bytes(src, dst.nbytes)))

    def copy_d2d(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: int | None = None) -> None:
        self._ledger.touch(dst, nbytes)
        self._ledger.touch(src, nbytes)
        self._run(lambda: self.mem._bytes(dst, nbytes).__setitem__(slice(None), self.mem._bytes(src, nbytes)))

    def alloc_host(self, nbytes: int) -> np.ndarray:
        return np.zeros(int(nbytes), dtype=np.uint8)

    def free_host(self, buf: np.ndarray) -> None:
        pass

    def alloc_mapped(self, nbytes: int) -> MappedBuffer:
        """A heap allocation whose bytes the host array views directly: what kernels store, the
        host reads, as through mapped pinned memory on the device."""
        ptr = self.alloc(nbytes)
        self._arrays[ptr.addr][:] = 0  # pinned host memory starts as whatever the OS gave: zeros here
        self._mapped.add(ptr.addr)
        return MappedBuffer(self._arrays[ptr.addr], ptr)

    def free_mapped(self, buf: MappedBuffer) -> None:
        if self._arrays.get(buf.device.addr) is not buf.host:
            raise MemoryFault(
                f"free_mapped of 0x{buf.device.addr:x}, which is not a live buffer from alloc_mapped"
            )
        self._free(buf.device)  # GraphLifetimeError under a live graph, before anything changes
        self._mapped.discard(buf.device.addr)

    def mem_info(self) -> tuple[int, int]:
        return self.capacity - self._ledger.allocations.live_bytes, self.capacity

    def stats(self) -> AllocStats:
        return self._ledger.stats()

    def bytes_from(self, ptr: DevicePtr) -> int:
        return self._ledger.bytes_from(ptr)

    def borrow(self, addr: int, nbytes: int):
        """See ``CudaBackend.borrow``. Host memory has no other owner: the range must lie inside
        one of this backend's allocations (a test's stand-in for a tensor), else MemoryFault."""
        self._ledger.allocations.find(addr, nbytes)
        return self._ledger.borrowed(addr, nbytes)

    def touch(self, ptr: DevicePtr, nbytes: int) -> None:
        """See ``CudaBackend.touch``: checked now, recorded in an open capture."""
        self._ledger.touch(ptr, nbytes)

    def enqueue(self, op: Callable[[], None], touches: Sequence[tuple[DevicePtr, int]] = ()) -> None:
        """Run ``op`` in stream order: now, or at replay when a capture is open. ``touches`` are the
        (pointer, bytes) it reads or writes, checked now and recorded for graph lifetime. This is
        how a host-side collective (the host communicator) joins a captured graph."""
        for ptr, nbytes in touches:
            self._ledger.touch(ptr, nbytes)
        self._run(op)

    def _run(self, op: Callable[[], None]) -> None:
        if self._ops is not None:
            self._ops.append(op)
        else:
            op()

    # ---- streams and events ---------------------------------------------------------------------

    @property
    def default_stream(self) -> int:
        return 0

    def create_stream(self) -> int:
        s = self._next_stream
        self._next_stream += 1
        self._streams.add(s)
        return s

    def adopt_stream(self, handle: int) -> int:
        """See ``CudaBackend.adopt_stream``: host streams are only names, so any int is one."""
        self._streams.add(int(handle))
        return int(handle)

    def destroy_stream(self, stream: int) -> None:
        self._streams.discard(stream)

    def synchronize(self, stream: int | None = None) -> None:
        self._ledger.refuse_in_capture("synchronize")

    def event_create(self) -> list[float]:
        return [0.0]

    def event_record(self, event: list[float], stream: int | None = None) -> None:
        self._run(lambda: event.__setitem__(0, time.perf_counter()))

    def event_elapsed_ms(self, start: list[float], end: list[float]) -> float:
        return (end[0] - start[0]) * 1e3

    def event_destroy(self, event: list[float]) -> None:
        pass

    # ---- kernels --------------------------------------------------------------------------------

    def kernel(self, module: str, function: str) -> KernelHandle:
        decl = lookup(module, function)
        if decl is None or decl.host is None:
            raise KernelNotFound(f"no kernel {module}.{function} is registered on the host backend")
        return KernelHandle(decl, decl.host)

    def try_kernel(self, module: str, function: str) -> KernelHandle:
        try:
            return self.kernel(module, function)
        except KernelNotFound:
            return NULL_KERNEL

    # What resident_blocks answers: an H200's 132 SMs at 4 blocks each. The host runs a kernel's
    # twin once whatever the grid, so the figure only keeps grid arithmetic the same as on a GPU.
    NOTIONAL_RESIDENT_BLOCKS = 132 * 4

    def resident_blocks(self, kernel: KernelHandle, block: int, smem: int = 0) -> int:
        if kernel.is_null:
            raise LaunchError("resident_blocks of the null kernel")
        return self.NOTIONAL_RESIDENT_BLOCKS

    def launch(
        self,
        kernel: KernelHandle,
        grid: Dim3,
        block: Dim3,
        args: Sequence[Any],
        smem: int = 0,
        stream: int | None = None,
    ) -> None:
        args = check_args(kernel, args)
        if kernel.native is None:
            raise LaunchError(f"{kernel.name} has no host twin")
        decl: KernelDecl = kernel.decl  # type: ignore[assignment]  # check_args refused the null kernel
        # Invariant: a kernel stores only into its declared outputs (KernelDecl.writes). The twin
        # runs with the other pointer arguments' allocations read-only, so a store into one raises.
        written: set[int] = set()
        read_only: dict[int, str] = {}  # base -> argument name
        for (name, _), v in zip(decl.args, args):
            if isinstance(v, DevicePtr):
                base = self._ledger.touch(v, 1)
                if name in decl.writes:
                    written.add(base)
                else:
                    read_only.setdefault(base, name)
        locked = [self._arrays[b] for b in read_only.keys() - written]
        fn = kernel.native

        def run() -> None:
            for arr in locked:
                arr.flags.writeable = False
            try:
                fn(self.mem, *args)
            except ValueError as e:
                if "read-only" not in str(e):  # numpy's words for a store into a read-only array
                    raise
                inputs = ", ".join(n for b, n in read_only.items() if b not in written)
                raise LaunchError(
                    f"{kernel.name} stored into an argument it does not declare in writes "
                    f"(writes: {', '.join(decl.writes) or 'none'}; read-only: {inputs})"
                ) from e
            finally:
                for arr in locked:
                    arr.flags.writeable = True

        self._run(run)

    # ---- graphs ---------------------------------------------------------------------------------

    def begin_capture(self, stream: int | None = None) -> None:
        self._ledger.begin_capture(self._key(stream))
        self._ops = []

    def end_capture(self, stream: int | None = None, label: str = "") -> Graph:
        capture = self._ledger.end_capture(self._key(stream))
        ops, self._ops = self._ops, None
        return self._ledger.new_graph(ops, capture, label)

    def abort_capture(self) -> None:
        self._ledger.abort_capture()
        self._ops = None

    def graph_launch(self, graph: Graph, stream: int | None = None) -> None:
        self._ledger.replay(graph)
        ops: list[Callable[[], None]] = graph.handle  # type: ignore[assignment]

        def replay() -> None:
            for op in ops:
                op()

        self._run(replay)  # inside a capture the graph becomes part of the new one, as on the device

    def graph_destroy(self, graph: Graph) -> None:
        self._ledger.drop_graph(graph)

    def live_graphs(self) -> list[Graph]:
        return self._ledger.live_graphs()

    def _key(self, stream: int | None) -> int:
        return 0 if stream is None else stream
