"""What ``CudaBackend`` builds on in cuda-bindings: checked driver calls, the device's properties,
PTX module loading with the JIT log, a loaded kernel function with its launch state, stream capture
into graphs, and page-locked host buffers.

Every driver call is checked; a failure raises ``CudaError`` naming the call and the CUDA error's
name and text.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cuda.bindings import driver

from .allocations import AllocationTable
from .errors import CudaError, LaunchError, MemoryFault
from .kernel import Arg, KernelDecl
from .launch import ArgPacker

SUCCESS = driver.CUresult.CUDA_SUCCESS
OUT_OF_MEMORY = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
_STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in through cuFuncSetAttribute
_JIT_LOG_BYTES = 64 * 1024


def err_text(err: Any) -> str:
    try:
        e1, name = driver.cuGetErrorName(err)
        e2, text = driver.cuGetErrorString(err)
    except Exception:  # pragma: no cover - a driver too broken to describe its own error
        return f"CUresult {int(err)}"
    name_s = name.decode() if e1 == SUCCESS and name else f"CUresult {int(err)}"
    text_s = text.decode() if e2 == SUCCESS and text else ""
    return f"{name_s}: {text_s}" if text_s else name_s


def check(result: tuple, what: str = "") -> Any:
    """Unwrap a cuda-bindings return tuple ``(CUresult, *values)``: raise ``CudaError`` naming the
    call and the error if it failed; otherwise return None, the single value or the tuple."""
    err = result[0]
    if err != SUCCESS:
        raise CudaError(f"{what or 'CUDA driver call'} failed: {err_text(err)}")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    sm_count: int
    compute_capability: tuple[int, int]
    max_smem_optin: int  # dynamic shared memory a block may opt in to

    @classmethod
    def query(cls, dev: Any) -> DeviceInfo:
        name = check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0", 1)[0]
        attr = driver.CUdevice_attribute

        def get(a: Any) -> int:
            return int(check(driver.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a.name})"))

        return cls(
            name.decode(errors="replace"),
            get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            (
                get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ),
            get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        )


def load_ptx(path: Path) -> Any:
    """The CUmodule JIT-compiled from the PTX at ``path``; a failure carries ptxas's own log."""
    image = path.read_bytes() + b"\0"
    err_log = bytearray(_JIT_LOG_BYTES)
    opts = [
        driver.CUjit_option.CU_JIT_ERROR_LOG_BUFFER,
        driver.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ]
    err, mod = driver.cuModuleLoadDataEx(image, len(opts), opts, [err_log, _JIT_LOG_BYTES])
    if err != SUCCESS:
        jit = err_log.split(b"\0", 1)[0].decode(errors="replace").strip()
        raise CudaError(f"cuModuleLoadDataEx({path}) failed: {err_text(err)}\nJIT log:\n{jit or '(empty)'}")
    return mod


def _pdl_launch_config() -> Any:
    """A reusable cuLaunchKernelEx config with programmatic stream serialisation (its launch fields
    are rewritten per launch; the driver copies them at the call)."""
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = driver.CUlaunchConfig()
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


class CudaFunction:
    """A loaded CUfunction: its argument packer, its launch config for programmatic stream
    serialisation (None where the kernel is not declared with a ``Pdl`` mode or the device lacks
    it), its dynamic shared-memory opt-in and its occupancy by launch shape."""

    __slots__ = (
        "owner",
        "name",
        "func",
        "packer",
        "ptr_args",
        "dyn_smem",
        "static_smem",
        "pdl_config",
        "resident",
    )

    def __init__(self, owner: object, func: Any, decl: KernelDecl, pdl_supported: bool) -> None:
        self.owner = owner
        self.name = f"{decl.module}.{decl.function}"
        self.func = func
        self.packer = ArgPacker(decl)
        self.pdl_config = _pdl_launch_config() if decl.pdl and pdl_supported else None
        self.resident: dict[tuple[int, int], int] = {}  # (block, smem) -> blocks resident per SM
        self.ptr_args = tuple(i for i, (_, t) in enumerate(decl.args) if t is Arg.PTR)
        self.static_smem = int(
            check(
                driver.cuFuncGetAttribute(
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func
                ),
                "cuFuncGetAttribute(SHARED_SIZE_BYTES)",
            )
        )
        # Without the opt-in a block gets 48 KB in all, static included: a kernel with static
        # shared memory and a 48 KB dynamic request fit nowhere (the batched head's x tile did).
        self.dyn_smem = max(_STATIC_SMEM_LIMIT - self.static_smem, 0)

    def opt_in_smem(self, smem: int, max_optin: int) -> None:
        """Raise the kernel's dynamic shared-memory limit to ``smem`` bytes (needed above 48 KB)."""
        if smem <= self.dyn_smem:
            return
        if smem > max_optin - self.static_smem:
            raise LaunchError(
                f"{self.name}: {smem} bytes of dynamic shared memory requested; the device allows "
                f"{max_optin} per block and the kernel uses {self.static_smem} statically"
            )
        check(
            driver.cuFuncSetAttribute(
                self.func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem
            ),
            f"cuFuncSetAttribute({self.name}, MAX_DYNAMIC_SHARED_SIZE_BYTES, {smem})",
        )
        self.dyn_smem = smem

    def blocks_per_sm(self, block: int, smem: int, max_optin: int) -> int:
        key = (block, smem)
        hit = self.resident.get(key)
        if hit is None:
            self.opt_in_smem(smem, max_optin)
            hit = int(
                check(
                    driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.func, block, smem),
                    f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})",
                )
            )
            if hit < 1:
                raise LaunchError(
                    f"{self.name}: no block of {block} threads with {smem} bytes of "
                    "dynamic shared memory fits on an SM"
                )
            self.resident[key] = hit
        return hit

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        smem: int,
        stream: Any,
        params: int,
        programmatic: bool,
    ) -> None:
        """cuLaunchKernel, or cuLaunchKernelEx with programmatic stream serialisation."""
        cfg = self.pdl_config if programmatic else None
        if cfg is None:
            (err,) = driver.cuLaunchKernel(
                self.func, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream, params, 0
            )
            what = "cuLaunchKernel"
        else:
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
            cfg.sharedMemBytes = smem
            cfg.hStream = stream
            (err,) = driver.cuLaunchKernelEx(cfg, self.func, params, 0)
            what = "cuLaunchKernelEx(programmatic stream serialization)"
        if err != SUCCESS:
            raise CudaError(
                f"{what}({self.name}, grid={tuple(grid)}, block={tuple(block)}, smem={smem}) failed: {err_text(err)}"
            )


def begin_capture(stream: Any) -> None:
    # Thread-local mode: only this thread's unsafe calls (a sync copy, a synchronize) are refused;
    # other threads of the serving engine keep working while one captures.
    check(
        driver.cuStreamBeginCapture(stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        "cuStreamBeginCapture",
    )


def end_capture(stream: Any, label: str) -> tuple[Any, Any]:
    """(CUgraph, CUgraphExec) of the capture open on ``stream``."""
    graph = check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
    err, exec_ = driver.cuGraphInstantiate(graph, 0)
    if err != SUCCESS:
        driver.cuGraphDestroy(graph)
        raise CudaError(f"cuGraphInstantiate({label or 'unnamed'}) failed: {err_text(err)}")
    return graph, exec_


def discard_capture(stream: Any) -> None:
    """End the capture open on ``stream`` and drop what it recorded, whatever state it is in."""
    err, graph = driver.cuStreamEndCapture(stream)
    if err == SUCCESS and graph is not None and int(graph) != 0:
        driver.cuGraphDestroy(graph)


class PinnedHost:
    """Page-locked host buffers (``cuMemHostAlloc``), by host address: plain ones for async copies
    and mapped ones that kernels address directly (the device address is kept beside)."""

    def __init__(self) -> None:
        self._table = AllocationTable()
        self.mapped: dict[int, int] = {}  # host base of a mapped buffer -> its device address

    def alloc(self, nbytes: int, mapped: bool = False) -> tuple[np.ndarray, int]:
        """(the buffer as a uint8 array, its device address or 0)."""
        flags = driver.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0
        p = int(
            check(
                driver.cuMemHostAlloc(nbytes, flags),
                f"cuMemHostAlloc({nbytes}{', DEVICEMAP' if mapped else ''})",
            )
        )
        dev = 0
        if mapped:
            err, dptr = driver.cuMemHostGetDevicePointer(p, 0)
            if err != SUCCESS:
                driver.cuMemFreeHost(p)
                check((err,), f"cuMemHostGetDevicePointer(0x{p:x})")
            dev = self.mapped[p] = int(dptr)
        self._table.add(p, nbytes)
        array = np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(p)).cast("B"), dtype=np.uint8)
        return array, dev

    def whole_buffer(self, buf: np.ndarray, what: str) -> int:
        """The host base of ``buf``, a whole buffer from ``alloc`` (MemoryFault naming ``what``)."""
        p = buf.__array_interface__["data"][0]
        hit = self._table.find(p, 1, quiet=True)
        if hit is None or hit[0] != p:
            raise MemoryFault(f"{what} of 0x{p:x}, which is not the start of a buffer from alloc_host")
        return p

    def free(self, p: int) -> None:
        check(driver.cuMemFreeHost(p), f"cuMemFreeHost(0x{p:x})")
        self._table.remove(p)
        self.mapped.pop(p, None)

    def holds(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` lies entirely inside one buffer."""
        return (
            self._table.find(arr.__array_interface__["data"][0], max(arr.nbytes, 1), quiet=True) is not None
        )

    def bases(self) -> list[int]:
        return self._table.bases()
