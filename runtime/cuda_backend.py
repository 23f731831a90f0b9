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
- Allocation accounting and graph lifetime go through ``AllocationTable`` exactly as on the host:
  every pointer a launch, copy or memset touches must lie inside a live allocation (checked before
  the driver sees it, so a bad pointer is a ``MemoryFault`` rather than a sticky device fault), and
  while a capture is open the allocation bases are recorded into the graph; freeing one of them
  while the graph lives raises ``GraphLifetimeError``.
- Every driver call is checked; a failure raises ``CudaError`` naming the call and the
  CUDA error's name and text. Errors detected before the driver is called leave the backend
  unchanged. A kernel that faults on the device (illegal address) poisons the context for good:
  that is the one error nothing in-process recovers from, which is why pointers are checked first.
"""

from __future__ import annotations

import bisect
import ctypes
import importlib
import logging
import pkgutil
import struct
from pathlib import Path
from typing import Any, Sequence, cast

import numpy as np
from cuda.bindings import driver

from .allocations import AllocationTable, AllocStats, Graph, MappedBuffer
from .backend import Dim3, KernelHandle, NULL_KERNEL
from .device_ptr import DevicePtr
from .errors import CudaError, GraphLifetimeError, KernelNotFound, LaunchError, MemoryFault, OutOfMemoryError
from .kernel import Arg, KernelDecl, Pdl, lookup
from .launch import check_args

log = logging.getLogger(__name__)

PTX_DIR = Path(__file__).resolve().parent.parent / "ptx"
_SUCCESS = driver.CUresult.CUDA_SUCCESS
_OOM = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
_STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in through cuFuncSetAttribute
_JIT_LOG_BYTES = 64 * 1024


def _err_text(err: Any) -> str:
    try:
        e1, name = driver.cuGetErrorName(err)
        e2, text = driver.cuGetErrorString(err)
    except Exception:  # pragma: no cover - a driver too broken to describe its own error
        return f"CUresult {int(err)}"
    name_s = name.decode() if e1 == _SUCCESS and name else f"CUresult {int(err)}"
    text_s = text.decode() if e2 == _SUCCESS and text else ""
    return f"{name_s}: {text_s}" if text_s else name_s


def check(result: tuple, what: str = "") -> Any:
    """Unwrap a cuda-bindings return tuple ``(CUresult, *values)``: raise ``CudaError`` naming the
    call and the error if it failed; otherwise return None, the single value or the tuple."""
    err = result[0]
    if err != _SUCCESS:
        raise CudaError(f"{what or 'CUDA driver call'} failed: {_err_text(err)}")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def register_all_kernels() -> None:
    """Import every module of ``runtime.kernels`` so that its ``declare`` has run. Kernels of other
    packages (the model's) are declared when their package is imported: the runtime does not know
    them by name."""
    pkg = importlib.import_module("runtime.kernels")
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"runtime.kernels.{info.name}")


def _graph_handles(g: Graph) -> tuple[Any, Any]:
    """(CUgraph, CUgraphExec) of a graph this backend captured."""
    return cast(tuple[Any, Any], g.handle)


class ArgPacker:
    """The ``kernelParams`` array for one kernel: an 8-byte slot per argument and a ``uint64``
    array of the slots' addresses, both allocated once and rewritten in place per launch
    (cuLaunchKernel copies the values at the call, so reuse across launches is safe).

    REFERENCE.md measured this form at about 5 us per launch from Python against about 7 us for
    the ``(values, types)`` tuple form, which rebuilds ctypes objects on every call.
    """

    __slots__ = ("decl", "_buf", "_ptrs", "address", "_struct", "_is_ptr", "_n")

    # One 8-byte slot per argument; a 4-byte argument sits in the low half of its slot
    # (little-endian), which is where the driver reads it.
    _FORMAT = {Arg.PTR: "Q", Arg.U64: "Q", Arg.U32: "I4x", Arg.I32: "i4x", Arg.F32: "f4x"}

    def __init__(self, decl: KernelDecl) -> None:
        n = max(len(decl.args), 1)
        self.decl = decl
        self._n = len(decl.args)
        self._buf = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_uint64 * n)(*[base + 8 * i for i in range(n)])
        self.address: int = ctypes.addressof(self._ptrs)
        # struct.pack_into writes every slot in one C call (four arguments: 1.1 us against 1.4 us
        # for one numpy item store per argument, measured on the 2-core CI-class machine).
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


class _Function:
    """A loaded CUfunction with its packer and its dynamic shared-memory opt-in state."""

    __slots__ = ("owner", "func", "packer", "ptr_args", "dyn_smem", "static_smem", "ptx_path", "pdl_config",
                 "beside", "releases", "resident")

    def __init__(self, owner: "CudaBackend", func: Any, decl: KernelDecl, ptx_path: Path) -> None:
        self.owner = owner
        self.func = func
        self.packer = ArgPacker(decl)
        # One reusable cuLaunchKernelEx config for kernels launched with programmatic stream
        # serialisation (its fields are rewritten per launch; the driver copies them at the call).
        self.pdl_config = _pdl_launch_config() if decl.pdl and owner.pdl_supported else None
        self.beside = decl.pdl is Pdl.BESIDE
        self.releases = decl.releases
        self.resident: dict[tuple[int, int], int] = {}  # (block, smem) -> blocks resident at once
        self.ptr_args = tuple(i for i, (_, t) in enumerate(decl.args) if t is Arg.PTR)
        self.dyn_smem = _STATIC_SMEM_LIMIT
        self.static_smem = int(
            check(
                driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func),
                "cuFuncGetAttribute(SHARED_SIZE_BYTES)",
            )
        )
        self.ptx_path = ptx_path


def _pdl_launch_config() -> Any:
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = driver.CUlaunchConfig()
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


class CudaBackend:
    """``pdl``: launch kernels declared with a ``Pdl`` mode with programmatic stream serialisation
    (sm_90+), so each may start while the kernel before it finishes (runtime.kernel.Pdl). False
    launches every kernel plainly (the comparison arm of the benchmarks)."""

    name = "cuda"

    def __init__(self, device: int = 0, ptx_dir: Path | str | None = None, pdl: bool = True) -> None:
        self.ptx_dir = Path(ptx_dir) if ptx_dir is not None else PTX_DIR
        self._closed = True
        check(driver.cuInit(0), "cuInit")
        self.device = device
        self._dev = check(driver.cuDeviceGet(device), f"cuDeviceGet({device})")
        self._ctx = check(driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._closed = False
        self.make_current()
        name = check(driver.cuDeviceGetName(256, self._dev), "cuDeviceGetName")
        self.device_name = name.split(b"\0", 1)[0].decode(errors="replace")
        attr = driver.CUdevice_attribute
        self.sm_count = int(check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._dev)))
        self.compute_capability = (
            int(check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._dev))),
            int(check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._dev))),
        )
        self.max_smem_optin = int(
            check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self._dev))
        )
        # griddepcontrol is an sm_90 instruction; the attribute is refused below that. ``pdl`` may
        # be switched between launches (a graph keeps the launches it captured).
        self.pdl_supported = self.compute_capability >= (9, 0)
        self.pdl = bool(pdl) and self.pdl_supported
        # Streams whose last operation is a launch of a kernel that releases its dependents: only
        # there may a Pdl.BESIDE kernel overlap its predecessor. Every other stream operation
        # (copy, memset, event, graph, a collective through touch) takes its stream out.
        self._after_release: set[int] = set()

        self._table = AllocationTable()
        self._owned: set[int] = set()
        self._pinned_bases: list[int] = []  # sorted
        self._pinned: dict[int, int] = {}  # base -> size
        self._mapped: dict[int, int] = {}  # host base of an alloc_mapped buffer -> its device address
        self._streams: dict[int, Any] = {}
        self._events: dict[int, Any] = {}
        self._modules: dict[str, Any] = {}
        self._kernels: dict[tuple[str, str], KernelHandle] = {}
        self._capture_stream: int | None = None
        self._capture_touches: set[int] = set()
        self._default = self.create_stream()
        self._default_cu = self._streams[self._default]
        log.info("CudaBackend on %s (sm_%d%d, %d SMs)", self.device_name, *self.compute_capability, self.sm_count)

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
            if result[0] != _SUCCESS:
                log.warning("close: %s failed: %s", what, _err_text(result[0]))

        attempt("cuCtxSynchronize", driver.cuCtxSynchronize())
        if self._capture_stream is not None:
            self.abort_capture()
        for g in self._table.live_graphs():
            self._table.drop_graph(g)
            graph, exec_ = _graph_handles(g)
            attempt("cuGraphExecDestroy", driver.cuGraphExecDestroy(exec_))
            attempt("cuGraphDestroy", driver.cuGraphDestroy(graph))
        for base in sorted(self._owned):
            attempt(f"cuMemFree(0x{base:x})", driver.cuMemFree(base))
            self._table.remove(DevicePtr(base))
        self._owned.clear()
        for base in list(self._pinned):
            attempt(f"cuMemFreeHost(0x{base:x})", driver.cuMemFreeHost(base))
        for dev in self._mapped.values():
            self._table.remove(DevicePtr(dev))
        self._mapped.clear()
        self._pinned.clear()
        self._pinned_bases.clear()
        for ev in self._events.values():
            attempt("cuEventDestroy", driver.cuEventDestroy(ev))
        self._events.clear()
        for s in self._streams.values():
            attempt("cuStreamDestroy", driver.cuStreamDestroy(s))
        self._streams.clear()
        for mod in self._modules.values():
            attempt("cuModuleUnload", driver.cuModuleUnload(mod))
        self._modules.clear()
        self._kernels.clear()
        attempt("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease(self._dev))
        self._closed = True

    def __enter__(self) -> "CudaBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        if err == _OOM:
            raise OutOfMemoryError(
                f"alloc of {nbytes} bytes requested: cuMemAlloc ran out of memory "
                f"({free} bytes were free, fragmentation or another process)"
            )
        check((err,), f"cuMemAlloc({nbytes})")
        base = int(dptr)
        self._table.add(base, nbytes)
        self._owned.add(base)
        return DevicePtr(base)

    def free(self, ptr: DevicePtr) -> None:
        self._alive()
        if ptr.addr in self._mapped.values():
            raise MemoryFault(f"free of 0x{ptr.addr:x}, a buffer from alloc_mapped: use free_mapped")
        self._table.check_free(ptr)  # MemoryFault / GraphLifetimeError before the driver sees it
        if self._capture_stream is not None:
            raise GraphLifetimeError(f"free of 0x{ptr.addr:x} during graph capture")
        check(driver.cuMemFree(ptr.addr), f"cuMemFree(0x{ptr.addr:x})")
        self._table.remove(ptr)
        self._owned.discard(ptr.addr)

    def touch(self, ptr: DevicePtr, nbytes: int) -> None:
        """Stream work issued outside this backend (an NCCL collective) uses ``nbytes`` at ``ptr``:
        checked against the allocation table now, and recorded in an open capture, so the graph's
        lifetime set covers the collective's buffers too."""
        self._touch(ptr, nbytes)
        self._after_release.clear()  # the collective's stream is not known here

    def _touch(self, ptr: DevicePtr, nbytes: int) -> None:
        if not isinstance(ptr, DevicePtr):
            raise TypeError(f"expected DevicePtr, got {type(ptr).__name__}")
        base, _ = self._table.find(ptr.addr, max(int(nbytes), 1))  # type: ignore[misc]
        if self._capture_stream is not None:
            self._capture_touches.add(base)

    def memset(self, ptr: DevicePtr, byte: int, nbytes: int, stream: int | None = None) -> None:
        self._after_release.discard(self._key(stream))
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            return
        self._touch(ptr, nbytes)
        check(driver.cuMemsetD8Async(ptr.addr, int(byte) & 0xFF, nbytes, self._stream(stream)), "cuMemsetD8Async")

    def copy_h2d(self, dst: DevicePtr, src: np.ndarray | bytes, stream: int | None = None) -> None:
        self._after_release.discard(self._key(stream))
        self._alive()
        data = np.frombuffer(bytes(src), np.uint8) if isinstance(src, (bytes, bytearray)) else np.ascontiguousarray(src)
        n = data.nbytes
        if n == 0:
            return
        self._touch(dst, n)
        s = self._stream(stream)
        if stream is None:
            if self._capture_stream is not None:
                raise GraphLifetimeError("a synchronous copy is not allowed during graph capture")
            check(driver.cuMemcpyHtoDAsync(dst.addr, data.ctypes.data, n, s), "cuMemcpyHtoDAsync")
            check(driver.cuStreamSynchronize(s), "cuStreamSynchronize")
            return
        if self._capture_stream is not None and not self.is_pinned(data):
            raise GraphLifetimeError(
                "a captured host-to-device copy needs a pinned source from alloc_host: the graph "
                "reads the host buffer at every replay"
            )
        check(driver.cuMemcpyHtoDAsync(dst.addr, data.ctypes.data, n, s), "cuMemcpyHtoDAsync")

    def copy_d2h(self, dst: np.ndarray, src: DevicePtr, stream: int | None = None) -> None:
        self._after_release.discard(self._key(stream))
        self._alive()
        if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise ValueError("copy_d2h destination must be a writable C-contiguous numpy array")
        n = dst.nbytes
        if n == 0:
            return
        self._touch(src, n)
        s = self._stream(stream)
        if stream is None:
            if self._capture_stream is not None:
                raise GraphLifetimeError("a synchronous copy is not allowed during graph capture")
            check(driver.cuMemcpyDtoHAsync(dst.ctypes.data, src.addr, n, s), "cuMemcpyDtoHAsync")
            check(driver.cuStreamSynchronize(s), "cuStreamSynchronize")
            return
        if not self.is_pinned(dst):
            raise ValueError(
                "copy_d2h on a stream needs a pinned destination from alloc_host (into pageable "
                "memory the driver silently makes it synchronous); pass stream=None for a sync copy"
            )
        check(driver.cuMemcpyDtoHAsync(dst.ctypes.data, src.addr, n, s), "cuMemcpyDtoHAsync")

    def copy_d2d(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: int | None = None) -> None:
        self._after_release.discard(self._key(stream))
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            return
        self._touch(dst, nbytes)
        self._touch(src, nbytes)
        check(driver.cuMemcpyDtoDAsync(dst.addr, src.addr, nbytes, self._stream(stream)), "cuMemcpyDtoDAsync")

    def alloc_host(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer as a uint8 numpy array (view it as any dtype). Free it with
        ``free_host``; the array must not be touched afterwards (it points at freed memory)."""
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc_host of {nbytes} bytes: size must be positive")
        p = int(check(driver.cuMemHostAlloc(nbytes, 0), f"cuMemHostAlloc({nbytes})"))
        bisect.insort(self._pinned_bases, p)
        self._pinned[p] = nbytes
        return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(p)).cast("B"), dtype=np.uint8)

    def free_host(self, buf: np.ndarray) -> None:
        self._alive()
        p = buf.__array_interface__["data"][0]
        if p not in self._pinned or p in self._mapped:
            raise MemoryFault(f"free_host of 0x{p:x}, which is not the start of a buffer from alloc_host")
        check(driver.cuMemFreeHost(p), f"cuMemFreeHost(0x{p:x})")
        del self._pinned[p]
        self._pinned_bases.pop(bisect.bisect_left(self._pinned_bases, p))

    def alloc_mapped(self, nbytes: int) -> MappedBuffer:
        """Page-locked host memory mapped into the device's address space: kernels store into it
        (or read it) directly, and the host reads it after synchronising, with no copy node. For a
        graph's few result words that matters: a 12-byte device-to-host copy node at the end of a
        graph cost about 8 us of device time per replay on the H200 (CUDA events around
        back-to-back replays of a graph of small kernels: 41.5 us without it, 49.4 with it,
        2026-11-29)."""
        self._alive()
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc_mapped of {nbytes} bytes: size must be positive")
        p = int(check(driver.cuMemHostAlloc(nbytes, driver.CU_MEMHOSTALLOC_DEVICEMAP),
                      f"cuMemHostAlloc({nbytes}, DEVICEMAP)"))
        err, dptr = driver.cuMemHostGetDevicePointer(p, 0)
        if err != _SUCCESS:
            driver.cuMemFreeHost(p)
            check((err,), f"cuMemHostGetDevicePointer(0x{p:x})")
        dev = int(dptr)
        self._table.add(dev, nbytes)
        bisect.insort(self._pinned_bases, p)
        self._pinned[p] = nbytes
        self._mapped[p] = dev
        host = np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(p)).cast("B"), dtype=np.uint8)
        return MappedBuffer(host, DevicePtr(dev))

    def free_mapped(self, buf: MappedBuffer) -> None:
        """Refused (GraphLifetimeError) while a live graph touches it, like ``free``."""
        self._alive()
        p = buf.host.__array_interface__["data"][0]
        if self._mapped.get(p) != buf.device.addr:
            raise MemoryFault(f"free_mapped of 0x{p:x}, which is not a live buffer from alloc_mapped")
        self._table.check_free(buf.device)
        if self._capture_stream is not None:
            raise GraphLifetimeError(f"free of mapped 0x{p:x} during graph capture")
        check(driver.cuMemFreeHost(p), f"cuMemFreeHost(0x{p:x})")
        self._table.remove(buf.device)
        del self._mapped[p], self._pinned[p]
        self._pinned_bases.pop(bisect.bisect_left(self._pinned_bases, p))

    def is_pinned(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` lies entirely inside one buffer from ``alloc_host``."""
        start = arr.__array_interface__["data"][0]
        i = bisect.bisect_right(self._pinned_bases, start) - 1
        if i < 0:
            return False
        base = self._pinned_bases[i]
        return start + arr.nbytes <= base + self._pinned[base]

    def mem_info(self) -> tuple[int, int]:
        self._alive()
        free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def stats(self) -> AllocStats:
        return self._table.stats()

    def bytes_from(self, ptr: DevicePtr) -> int:
        """Bytes from ``ptr`` to the end of its live allocation (MemoryFault if none)."""
        base, size = self._table.find(ptr.addr, 1)  # type: ignore[misc]
        return base + size - ptr.addr

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

    def create_stream(self) -> int:
        self._alive()
        s = check(
            driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate(NON_BLOCKING)"
        )
        key = int(s)
        self._streams[key] = s
        return key

    def destroy_stream(self, stream: int) -> None:
        self._alive()
        if stream == self._default:
            raise ValueError("the default stream is destroyed by close(), not destroy_stream")
        s = self._stream(stream)
        check(driver.cuStreamDestroy(s), "cuStreamDestroy")
        del self._streams[stream]

    def synchronize(self, stream: int | None = None) -> None:
        self._alive()
        if self._capture_stream is not None:
            raise GraphLifetimeError("synchronize during graph capture")
        check(driver.cuStreamSynchronize(self._stream(stream)), "cuStreamSynchronize")

    def synchronize_device(self) -> None:
        self._alive()
        if self._capture_stream is not None:
            raise GraphLifetimeError("synchronize during graph capture")
        check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def event_create(self) -> Any:
        self._alive()
        ev = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
        self._events[int(ev)] = ev
        return ev

    def event_record(self, event: Any, stream: int | None = None) -> None:
        self._after_release.discard(self._key(stream))
        check(driver.cuEventRecord(event, self._stream(stream)), "cuEventRecord")

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
        if mod is not None:
            return mod
        path = self.ptx_dir / f"{module}.ptx"
        if not path.exists():
            raise KernelNotFound(f"no PTX for kernel module {module!r}: {path} does not exist (run build.py)")
        image = path.read_bytes() + b"\0"
        err_log = bytearray(_JIT_LOG_BYTES)
        opts = [
            driver.CUjit_option.CU_JIT_ERROR_LOG_BUFFER,
            driver.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        ]
        err, mod = driver.cuModuleLoadDataEx(image, len(opts), opts, [err_log, _JIT_LOG_BYTES])
        if err != _SUCCESS:
            jit = err_log.split(b"\0", 1)[0].decode(errors="replace").strip()
            raise CudaError(
                f"cuModuleLoadDataEx({path}) failed: {_err_text(err)}\nJIT log:\n{jit or '(empty)'}"
            )
        self._modules[module] = mod
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
        if err != _SUCCESS:
            raise KernelNotFound(f"{path} has no function {function!r} for kernel {module}.{function}: {_err_text(err)}")
        handle = KernelHandle(decl, _Function(self, func, decl, path))
        self._kernels[key] = handle
        return handle

    def try_kernel(self, module: str, function: str) -> KernelHandle:
        try:
            return self.kernel(module, function)
        except KernelNotFound:
            return NULL_KERNEL

    def _function(self, kernel: KernelHandle) -> _Function:
        fn = kernel.native
        if not isinstance(fn, _Function) or fn.owner is not self:
            raise LaunchError(f"{kernel.name}: the handle was not loaded by this CudaBackend")
        return fn

    def resident_blocks(self, kernel: KernelHandle, block: int, smem: int = 0) -> int:
        """Blocks of ``kernel`` the device holds at once with ``block`` threads and ``smem`` bytes of
        dynamic shared memory (the occupancy calculator's blocks per SM x SMs): the grid of a
        grid-stride kernel that is meant to run as one wave. Derived from the loaded PTX, so a
        kernel whose register count changes keeps a one-wave grid without a constant to update."""
        fn = self._function(kernel)
        key = (block, smem)
        hit = fn.resident.get(key)
        if hit is None:
            if smem > fn.dyn_smem:
                self._opt_in_smem(fn, kernel, smem)
            per_sm = int(check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn.func, block, smem),
                               f"cuOccupancyMaxActiveBlocksPerMultiprocessor({kernel.name})"))
            if per_sm < 1:
                raise LaunchError(f"{kernel.name}: no block of {block} threads with {smem} bytes of "
                                  "dynamic shared memory fits on an SM")
            hit = fn.resident[key] = per_sm * self.sm_count
        return hit

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
        capturing = self._capture_stream is not None
        find = self._table.find
        for i in fn.ptr_args:
            base, _ = find(args[i].addr, 1)  # type: ignore[misc]  # MemoryFault names the argument's address
            if capturing:
                self._capture_touches.add(base)
        if isinstance(grid, int):
            grid = (grid, 1, 1)
        if isinstance(block, int):
            block = (block, 1, 1)
        if smem > fn.dyn_smem:
            self._opt_in_smem(fn, kernel, smem)
        s = self._default_cu if stream is None else self._stream(stream)
        params = fn.packer.pack(args)
        key = self._key(stream)
        cfg = fn.pdl_config if self.pdl else None
        if fn.beside and key not in self._after_release:
            cfg = None  # its predecessor may still be writing its input: a plain launch
        if cfg is None:
            err, = driver.cuLaunchKernel(
                fn.func, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, s, params, 0
            )
            what = "cuLaunchKernel"
        else:
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
            cfg.sharedMemBytes = smem
            cfg.hStream = s
            err, = driver.cuLaunchKernelEx(cfg, fn.func, params, 0)
            what = "cuLaunchKernelEx(programmatic stream serialization)"
        if fn.releases:
            self._after_release.add(key)
        else:
            self._after_release.discard(key)
        if err != _SUCCESS:
            raise CudaError(
                f"{what}({kernel.name}, grid={tuple(grid)}, block={tuple(block)}, smem={smem}) "
                f"failed: {_err_text(err)}"
            )

    def _opt_in_smem(self, fn: _Function, kernel: KernelHandle, smem: int) -> None:
        limit = self.max_smem_optin - fn.static_smem
        if smem > limit:
            raise LaunchError(
                f"{kernel.name}: {smem} bytes of dynamic shared memory requested; the device allows "
                f"{self.max_smem_optin} per block and the kernel uses {fn.static_smem} statically"
            )
        check(
            driver.cuFuncSetAttribute(
                fn.func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem
            ),
            f"cuFuncSetAttribute({kernel.name}, MAX_DYNAMIC_SHARED_SIZE_BYTES, {smem})",
        )
        fn.dyn_smem = smem

    # ---- graphs ---------------------------------------------------------------------------------

    def begin_capture(self, stream: int | None = None) -> None:
        self._alive()
        if self._capture_stream is not None:
            raise GraphLifetimeError("begin_capture while a capture is already open")
        key = self._default if stream is None else stream
        s = self._stream(key)
        # Thread-local mode: only this thread's unsafe calls (a sync copy, a synchronize) are
        # refused; other threads of the serving engine keep working while one captures.
        check(
            driver.cuStreamBeginCapture(s, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture",
        )
        self._capture_stream = key
        self._capture_touches = set()

    def end_capture(self, stream: int | None = None, label: str = "") -> Graph:
        self._alive()
        if self._capture_stream is None:
            raise GraphLifetimeError("end_capture without begin_capture")
        key = self._default if stream is None else stream
        if key != self._capture_stream:
            raise GraphLifetimeError(f"end_capture on stream {key} but the capture began on {self._capture_stream}")
        touches = self._capture_touches
        self._capture_stream, self._capture_touches = None, set()
        graph = check(driver.cuStreamEndCapture(self._stream(key)), "cuStreamEndCapture")
        err, exec_ = driver.cuGraphInstantiate(graph, 0)
        if err != _SUCCESS:
            driver.cuGraphDestroy(graph)
            raise CudaError(f"cuGraphInstantiate({label or 'unnamed'}) failed: {_err_text(err)}")
        return self._table.new_graph((graph, exec_), touches, label)

    def abort_capture(self) -> None:
        """End an open capture and discard what it recorded (after an error inside a capture)."""
        if self._capture_stream is None:
            return
        key = self._capture_stream
        self._capture_stream, self._capture_touches = None, set()
        err, graph = driver.cuStreamEndCapture(self._stream(key))
        if err == _SUCCESS and graph is not None and int(graph) != 0:
            driver.cuGraphDestroy(graph)

    @property
    def capturing(self) -> bool:
        return self._capture_stream is not None

    def graph_launch(self, graph: Graph, stream: int | None = None) -> None:
        self._after_release.discard(self._key(stream))
        self._alive()
        self._table.check_graph_live(graph)
        if self._capture_stream is not None:
            self._capture_touches |= graph.touches
        _, exec_ = _graph_handles(graph)
        check(driver.cuGraphLaunch(exec_, self._stream(stream)), f"cuGraphLaunch({graph!r})")

    def graph_destroy(self, graph: Graph) -> None:
        self._alive()
        self._table.drop_graph(graph)  # raises on a second destroy before touching the driver
        g, exec_ = _graph_handles(graph)
        check(driver.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
        check(driver.cuGraphDestroy(g), "cuGraphDestroy")

    def live_graphs(self) -> list[Graph]:
        return self._table.live_graphs()
