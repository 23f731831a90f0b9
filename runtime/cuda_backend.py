"""``CudaBackend``: the GpuBackend protocol over the CUDA driver API (cuda-bindings 12.6+ / 13.x).

Semantics the model code can rely on (they match ``HostBackend``):

- One context: the device's primary context (what NCCL, CuPy and PyTorch use), made current on the
  constructing thread. Call ``make_current()`` before using the backend from another thread.
- ``default_stream`` is a real stream created non-blocking, so it can be captured into a graph.
  ``stream=None`` everywhere means that stream. Because it does not synchronise with the legacy
  NULL stream, every "synchronous" operation here is an async operation on it plus a stream
  synchronise, never a legacy-stream call that would overtake queued kernels.
- ``copy_h2d`` / ``copy_d2h`` with ``stream=None`` are synchronous (the host array is free to reuse
  on return). With a stream they are asynchronous; ``copy_d2h`` on a stream needs a pinned
  destination from ``alloc_host`` and a captured copy needs a pinned host side (the graph reads or
  writes it at replay time). ``memset``, ``copy_d2d`` and launches are always stream-ordered.
- Allocation accounting, pointer checks and graph lifetime go through a ``Ledger``
  (runtime/ledger.py) exactly as on the host: every pointer a launch, copy or memset touches is
  checked before the driver sees it, so a bad pointer is a ``MemoryFault`` rather than a sticky
  device fault, and a free under a live graph raises ``GraphLifetimeError``.
- Every driver call is checked; a failure raises ``CudaError`` naming the call and the
  CUDA error's name and text. Errors detected before the driver is called leave the backend
  unchanged. A kernel that faults on the device (illegal address) poisons the context for good:
  that is the one error nothing in-process recovers from, which is why pointers are checked first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from cuda.bindings import driver

from .allocations import AllocStats, MappedBuffer
from .backend import NULL_KERNEL, Dim3, KernelHandle
from .cuda_driver import (
    OUT_OF_MEMORY,
    SUCCESS,
    CudaFunction,
    DeviceInfo,
    PinnedHost,
    begin_capture,
    check,
    discard_capture,
    end_capture,
    err_text,
    load_ptx,
)
from .device_ptr import DevicePtr
from .errors import CudaError, GraphLifetimeError, KernelNotFound, LaunchError, MemoryFault, OutOfMemoryError
from .graph import Graph
from .kernel import KernelDecl, lookup, register_all_kernels, shipped_ptx_dir
from .launch import PdlState, check_args
from .ledger import Ledger

__all__ = ["CudaBackend", "check"]

log = logging.getLogger(__name__)


def _graph_handles(g: Graph) -> tuple[Any, Any]:
    """(CUgraph, CUgraphExec) of a graph this backend captured."""
    return cast(tuple[Any, Any], g.handle)


class CudaBackend:
    """``ptx_dir``: where the kernels' PTX is read from (default: the PTX shipped with the package,
    ``runtime.kernel.shipped_ptx_dir``). ``pdl``: launch kernels declared with a ``Pdl`` mode with
    programmatic stream serialisation (sm_90+), so each may start while the kernel before it
    finishes (runtime.kernel.Pdl). False launches every kernel plainly (the comparison arm of the
    benchmarks); it may be switched between launches."""

    name = "cuda"

    def __init__(self, device: int = 0, ptx_dir: Path | str | None = None, pdl: bool = True) -> None:
        self.ptx_dir = Path(ptx_dir) if ptx_dir is not None else shipped_ptx_dir()
        self._closed = True
        check(driver.cuInit(0), "cuInit")
        self.device = device
        self._dev = check(driver.cuDeviceGet(device), f"cuDeviceGet({device})")
        self._ctx = check(driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._closed = False
        self.make_current()
        info = DeviceInfo.query(self._dev)
        self.device_name, self.sm_count = info.name, info.sm_count
        self.compute_capability, self.max_smem_optin = info.compute_capability, info.max_smem_optin
        # griddepcontrol is an sm_90 instruction; the launch attribute is refused below that.
        self._pdl = PdlState(supported=self.compute_capability >= (9, 0), on=pdl)
        self._ledger = Ledger()
        self._pinned = PinnedHost()  # alloc_host and alloc_mapped buffers
        self._streams: dict[int, Any] = {}
        self._adopted: set[int] = set()  # other libraries' streams (adopt_stream): never destroyed here
        self._events: dict[int, Any] = {}
        self._modules: dict[str, Any] = {}
        self._kernels: dict[tuple[str, str], KernelHandle] = {}
        self._default = self.create_stream()
        self._default_cu = self._streams[self._default]
        log.info(
            "CudaBackend on %s (sm_%d%d, %d SMs)", self.device_name, *self.compute_capability, self.sm_count
        )

    @property
    def pdl(self) -> bool:
        return self._pdl.on

    @pdl.setter
    def pdl(self, on: bool) -> None:
        self._pdl.on = on

    @property
    def pdl_supported(self) -> bool:
        return self._pdl.supported

    # ---- lifecycle --------------------------------------------------------------------------------

    def make_current(self) -> None:
        """Make the primary context current on the calling thread."""
        self._alive()
        check(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def _alive(self) -> None:
        if self._closed:
            raise CudaError("the CudaBackend is closed")

    def close(self) -> None:
        """Free everything this backend owns (graphs, allocations, pinned buffers, events, streams,
        modules) and release the primary context. Idempotent. Errors are logged, not raised, so one
        failure does not leak the rest."""
        if self._closed:
            return

        def attempt(what: str, result: tuple) -> None:
            if result[0] != SUCCESS:
                log.warning("close: %s failed: %s", what, err_text(result[0]))

        attempt("cuCtxSynchronize", driver.cuCtxSynchronize())
        self.abort_capture()
        for g in self._ledger.live_graphs():
            self._ledger.drop_graph(g)
            graph, exec_ = _graph_handles(g)
            attempt("cuGraphExecDestroy", driver.cuGraphExecDestroy(exec_))
            attempt("cuGraphDestroy", driver.cuGraphDestroy(graph))
        mapped = set(self._pinned.mapped.values())
        for base in self._ledger.allocations.bases():
            if base not in mapped:  # from cuMemAlloc
                attempt(f"cuMemFree(0x{base:x})", driver.cuMemFree(base))
            self._ledger.remove(DevicePtr(base))
        for p in self._pinned.bases():
            attempt(f"cuMemFreeHost(0x{p:x})", driver.cuMemFreeHost(p))
        self._pinned = PinnedHost()
        for ev in self._events.values():
            attempt("cuEventDestroy", driver.cuEventDestroy(ev))
        self._events.clear()
        for key, s in self._streams.items():
            if key not in self._adopted:
                attempt("cuStreamDestroy", driver.cuStreamDestroy(s))
        self._streams.clear()
        self._adopted.clear()
        for mod in self._modules.values():
            attempt("cuModuleUnload", driver.cuModuleUnload(mod))
        self._modules.clear()
        self._kernels.clear()
        attempt("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease(self._dev))
        self._closed = True

    # ---- memory -------------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> DevicePtr:
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc of {nbytes} bytes: size must be positive")
        free, total = self.mem_info()
        if nbytes > free:
            raise OutOfMemoryError(
                f"alloc of {nbytes} bytes ({nbytes / 2**30:.2f} GiB) requested, {free} bytes "
                f"({free / 2**30:.2f} GiB) free of {total} on {self.device_name}"
            )
        err, dptr = driver.cuMemAlloc(nbytes)
        if err == OUT_OF_MEMORY:
            raise OutOfMemoryError(
                f"alloc of {nbytes} bytes requested: cuMemAlloc ran out of memory "
                f"({free} bytes were free, fragmentation or another process)"
            )
        check((err,), f"cuMemAlloc({nbytes})")
        base = int(dptr)
        self._ledger.add(base, nbytes)
        return DevicePtr(base)

    def free(self, ptr: DevicePtr) -> None:
        self._alive()
        if ptr.addr in self._pinned.mapped.values():
            raise MemoryFault(f"free of 0x{ptr.addr:x}, a buffer from alloc_mapped: use free_mapped")
        self._ledger.check_free(ptr)  # MemoryFault / GraphLifetimeError before the driver sees it
        check(driver.cuMemFree(ptr.addr), f"cuMemFree(0x{ptr.addr:x})")
        self._ledger.remove(ptr)

    def borrow(self, addr: int, nbytes: int):
        """Another library's device memory (a PyTorch tensor's ``__cuda_array_interface__``) as a
        pointer for the duration of a ``with`` block (runtime/ledger.py ``borrowed``)."""
        self._alive()
        return self._ledger.borrowed(addr, nbytes)

    def touch(self, ptr: DevicePtr, nbytes: int) -> None:
        """Stream work issued outside this backend (an NCCL collective) uses ``nbytes`` at ``ptr``:
        checked against the allocation table now, and recorded in an open capture, so the graph's
        lifetime set covers the collective's buffers too."""
        self._ledger.touch(ptr, nbytes)
        self._pdl.work_on_unknown_stream()  # the collective's stream is not known here

    def memset(self, ptr: DevicePtr, byte: int, nbytes: int, stream: int | None = None) -> None:
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            return
        self._ledger.touch(ptr, nbytes)
        check(
            driver.cuMemsetD8Async(ptr.addr, int(byte) & 0xFF, nbytes, self._ordered(stream)),
            "cuMemsetD8Async",
        )

    def copy_h2d(self, dst: DevicePtr, src: np.ndarray | bytes, stream: int | None = None) -> None:
        data = (
            np.frombuffer(bytes(src), np.uint8)
            if isinstance(src, (bytes, bytearray))
            else np.ascontiguousarray(src)
        )
        self._host_copy(dst, data, stream, to_device=True)

    def copy_d2h(self, dst: np.ndarray, src: DevicePtr, stream: int | None = None) -> None:
        if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise ValueError("copy_d2h destination must be a writable C-contiguous numpy array")
        self._host_copy(src, dst, stream, to_device=False)

    def _host_copy(self, dev: DevicePtr, host: np.ndarray, stream: int | None, to_device: bool) -> None:
        self._alive()
        n = host.nbytes
        if n == 0:
            return
        self._ledger.touch(dev, n)
        if stream is None:
            self._ledger.refuse_in_capture("a synchronous copy")
        elif not to_device and not self.is_pinned(host):
            raise ValueError(
                "copy_d2h on a stream needs a pinned destination from alloc_host (into pageable "
                "memory the driver silently makes it synchronous); pass stream=None for a sync copy"
            )
        elif self._ledger.capture is not None and not self.is_pinned(host):
            raise GraphLifetimeError(
                "a captured host-to-device copy needs a pinned source from alloc_host: the graph "
                "reads the host buffer at every replay"
            )
        s = self._ordered(stream)
        if to_device:
            check(driver.cuMemcpyHtoDAsync(dev.addr, host.ctypes.data, n, s), "cuMemcpyHtoDAsync")
        else:
            check(driver.cuMemcpyDtoHAsync(host.ctypes.data, dev.addr, n, s), "cuMemcpyDtoHAsync")
        if stream is None:
            check(driver.cuStreamSynchronize(s), "cuStreamSynchronize")

    def copy_d2d(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: int | None = None) -> None:
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            return
        self._ledger.touch(dst, nbytes)
        self._ledger.touch(src, nbytes)
        check(
            driver.cuMemcpyDtoDAsync(dst.addr, src.addr, nbytes, self._ordered(stream)), "cuMemcpyDtoDAsync"
        )

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer as a uint8 numpy array (view it as any dtype). Free it with
        ``free_host``; the array must not be touched afterwards (it points at freed memory)."""
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc_host of {nbytes} bytes: size must be positive")
        return self._pinned.alloc(nbytes)[0]

    def free_host(self, buf: np.ndarray) -> None:
        self._alive()
        p = self._pinned.whole_buffer(buf, "free_host")
        if p in self._pinned.mapped:
            raise MemoryFault(f"free_host of 0x{p:x}, a buffer from alloc_mapped: use free_mapped")
        self._pinned.free(p)

    def alloc_mapped(self, nbytes: int) -> MappedBuffer:
        """Page-locked host memory mapped into the device's address space: kernels store into it
        (or read it) directly, and the host reads it after synchronising, with no copy node: a
        small device-to-host copy node at the end of a graph costs device time at every replay
        (see BENCHMARKS.md, "MTP drafter: propose", the drafts through mapped pinned memory)."""
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc_mapped of {nbytes} bytes: size must be positive")
        host, dev = self._pinned.alloc(nbytes, mapped=True)
        self._ledger.add(dev, nbytes)
        return MappedBuffer(host, DevicePtr(dev))

    def free_mapped(self, buf: MappedBuffer) -> None:
        """Refused (GraphLifetimeError) while a live graph touches it, like ``free``."""
        self._alive()
        p = buf.host.__array_interface__["data"][0]
        if self._pinned.mapped.get(p) != buf.device.addr:
            raise MemoryFault(f"free_mapped of 0x{p:x}, which is not a live buffer from alloc_mapped")
        self._ledger.check_free(buf.device, "free_mapped")
        self._pinned.free(p)
        self._ledger.remove(buf.device, "free_mapped")

    def is_pinned(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` lies entirely inside one buffer from ``alloc_host``."""
        return self._pinned.holds(arr)

    def mem_info(self) -> tuple[int, int]:
        self._alive()
        free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def stats(self) -> AllocStats:
        return self._ledger.stats()

    def bytes_from(self, ptr: DevicePtr) -> int:
        """Bytes from ``ptr`` to the end of its live allocation (MemoryFault if none)."""
        return self._ledger.bytes_from(ptr)

    # ---- streams and events --------------------------------------------------------------------

    @property
    def default_stream(self) -> int:
        return self._default

    def _key(self, stream: int | None) -> int:
        return self._default if stream is None else stream

    def _stream(self, stream: int | None) -> Any:
        if stream is None:
            return self._default_cu
        try:
            return self._streams[stream]
        except KeyError:
            raise ValueError(f"unknown stream {stream!r} (not created by this backend)") from None

    def _ordered(self, stream: int | None) -> Any:
        """The CUstream for stream work other than a kernel launch, which ends its release chain."""
        s = self._stream(stream)
        self._pdl.other_work(self._key(stream))
        return s

    def create_stream(self) -> int:
        self._alive()
        s = check(
            driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING),
            "cuStreamCreate(NON_BLOCKING)",
        )
        key = int(s)
        self._streams[key] = s
        return key

    def adopt_stream(self, handle: int) -> int:
        """Another library's CUstream (a serving engine's current stream, say ``torch.cuda.
        current_stream().cuda_stream``) usable as this backend's stream: its owner keeps it, so
        ``close`` and ``destroy_stream`` leave it alone. Returns the key calls take."""
        self._alive()
        key = int(handle)
        if key not in self._streams:
            self._streams[key] = driver.CUstream(key)
            self._adopted.add(key)
        return key

    def destroy_stream(self, stream: int) -> None:
        self._alive()
        if stream in self._adopted:
            raise ValueError(f"stream {stream:#x} was adopted (adopt_stream): its owner destroys it")
        if stream == self._default:
            raise ValueError("the default stream is destroyed by close(), not destroy_stream")
        s = self._stream(stream)
        check(driver.cuStreamDestroy(s), "cuStreamDestroy")
        del self._streams[stream]

    def synchronize(self, stream: int | None = None) -> None:
        self._alive()
        self._ledger.refuse_in_capture("synchronize")
        check(driver.cuStreamSynchronize(self._stream(stream)), "cuStreamSynchronize")

    def event_create(self) -> Any:
        self._alive()
        ev = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
        self._events[int(ev)] = ev
        return ev

    def event_record(self, event: Any, stream: int | None = None) -> None:
        check(driver.cuEventRecord(event, self._ordered(stream)), "cuEventRecord")

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded events; waits for ``end``."""
        check(driver.cuEventSynchronize(end), "cuEventSynchronize")
        return float(check(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def event_destroy(self, event: Any) -> None:
        check(driver.cuEventDestroy(event), "cuEventDestroy")
        self._events.pop(int(event), None)

    # ---- kernels --------------------------------------------------------------------------------

    def _load_module(self, module: str) -> Any:
        mod = self._modules.get(module)
        if mod is None:
            path = self.ptx_dir / f"{module}.ptx"
            if not path.exists():
                raise KernelNotFound(
                    f"no PTX for kernel module {module!r}: {path} does not exist (run build.py)"
                )
            mod = self._modules[module] = load_ptx(path)
        return mod

    def kernel(self, module: str, function: str) -> KernelHandle:
        self._alive()
        key = (module, function)
        hit = self._kernels.get(key)
        if hit is not None:
            return hit
        decl = lookup(module, function)
        if decl is None:
            register_all_kernels()
            decl = lookup(module, function)
        path = self.ptx_dir / f"{module}.ptx"
        if decl is None:
            raise KernelNotFound(
                f"no kernel {module}.{function} is declared (import the Python module that declares "
                f"it; its PTX would be {path})"
            )
        mod = self._load_module(module)
        err, func = driver.cuModuleGetFunction(mod, function.encode())
        if err != SUCCESS:
            raise KernelNotFound(
                f"{path} has no function {function!r} for kernel {module}.{function}: {err_text(err)}"
            )
        handle = KernelHandle(decl, CudaFunction(self, func, decl, self.pdl_supported))
        self._kernels[key] = handle
        return handle

    def try_kernel(self, module: str, function: str) -> KernelHandle:
        try:
            return self.kernel(module, function)
        except KernelNotFound:
            return NULL_KERNEL

    def _function(self, kernel: KernelHandle) -> CudaFunction:
        fn = kernel.native
        if not isinstance(fn, CudaFunction) or fn.owner is not self:
            raise LaunchError(f"{kernel.name}: the handle was not loaded by this CudaBackend")
        return fn

    def resident_blocks(self, kernel: KernelHandle, block: int, smem: int = 0) -> int:
        """Blocks of ``kernel`` the device holds at once with ``block`` threads and ``smem`` bytes of
        dynamic shared memory (the occupancy calculator's blocks per SM x SMs): the grid of a
        grid-stride kernel that is meant to run as one wave. Derived from the loaded PTX, so a
        kernel whose register count changes keeps a one-wave grid without a constant to update."""
        return self._function(kernel).blocks_per_sm(block, smem, self.max_smem_optin) * self.sm_count

    def launch(
        self,
        kernel: KernelHandle,
        grid: Dim3,
        block: Dim3,
        args: Sequence[Any],
        smem: int = 0,
        stream: int | None = None,
    ) -> None:
        if self._closed:
            self._alive()
        args = check_args(kernel, args)
        fn = self._function(kernel)
        touch = self._ledger.touch
        for i in fn.ptr_args:
            touch(args[i])  # MemoryFault names the argument's address
        if isinstance(grid, int):
            grid = (grid, 1, 1)
        if isinstance(block, int):
            block = (block, 1, 1)
        if smem > fn.dyn_smem:
            fn.opt_in_smem(smem, self.max_smem_optin)
        s = self._default_cu if stream is None else self._stream(stream)
        key = self._key(stream)
        decl: KernelDecl = kernel.decl  # type: ignore[assignment]  # check_args refused the null kernel
        programmatic = fn.pdl_config is not None and self._pdl.overlaps(decl, key)
        try:
            fn.launch(grid, block, smem, s, fn.packer.pack(args), programmatic)
        finally:
            self._pdl.launched(decl, key)

    # ---- graphs ---------------------------------------------------------------------------------

    def begin_capture(self, stream: int | None = None) -> None:
        self._alive()
        key = self._key(stream)
        s = self._stream(key)
        self._ledger.begin_capture(key)  # refuses a second open capture before the driver sees it
        try:
            begin_capture(s)
        except CudaError:
            self._ledger.abort_capture()
            raise

    def end_capture(self, stream: int | None = None, label: str = "") -> Graph:
        self._alive()
        key = self._key(stream)
        capture = self._ledger.end_capture(key)
        return self._ledger.new_graph(end_capture(self._stream(key), label), capture, label)

    def abort_capture(self) -> None:
        """End an open capture and discard what it recorded (after an error inside a capture)."""
        capture = self._ledger.abort_capture()
        if capture is not None:
            discard_capture(self._stream(capture.stream))

    def graph_launch(self, graph: Graph, stream: int | None = None) -> None:
        self._alive()
        self._ledger.replay(graph)
        _, exec_ = _graph_handles(graph)
        check(driver.cuGraphLaunch(exec_, self._ordered(stream)), f"cuGraphLaunch({graph!r})")

    def graph_destroy(self, graph: Graph) -> None:
        self._alive()
        self._ledger.drop_graph(graph)  # raises on a second destroy before touching the driver
        g, exec_ = _graph_handles(graph)
        check(driver.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
        check(driver.cuGraphDestroy(g), "cuGraphDestroy")

    def live_graphs(self) -> list[Graph]:
        return self._ledger.live_graphs()
