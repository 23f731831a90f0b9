"""The ``GpuBackend`` protocol that model code speaks to, and ``KernelHandle``.

Two backends implement it: ``CudaBackend`` (the CUDA driver API) and ``HostBackend`` (a NumPy
heap that runs every kernel's host twin). Streams and events are opaque ints/objects; device memory
is ``DevicePtr``; host buffers are NumPy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from .allocations import AllocStats, Graph
from .device_ptr import DevicePtr
from .kernel import KernelDecl


@dataclass(frozen=True)
class KernelHandle:
    """A loaded kernel. ``decl`` is None for the null handle that ``try_kernel`` gives when a
    kernel is absent; launching the null handle is an error."""

    decl: KernelDecl | None
    native: Any = None

    @property
    def is_null(self) -> bool:
        return self.decl is None

    def __bool__(self) -> bool:
        return self.decl is not None

    @property
    def name(self) -> str:
        return "<null kernel>" if self.decl is None else f"{self.decl.module}.{self.decl.function}"


NULL_KERNEL = KernelHandle(None)

Dim3 = tuple[int, int, int]


class GpuBackend(Protocol):
    name: str

    # memory
    def alloc(self, nbytes: int) -> DevicePtr: ...
    def free(self, ptr: DevicePtr) -> None: ...
    def memset(self, ptr: DevicePtr, byte: int, nbytes: int, stream: int | None = None) -> None: ...
    def copy_h2d(self, dst: DevicePtr, src: np.ndarray, stream: int | None = None) -> None: ...
    def copy_d2h(self, dst: np.ndarray, src: DevicePtr, stream: int | None = None) -> None: ...
    def copy_d2d(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream: int | None = None) -> None: ...
    def alloc_host(self, nbytes: int) -> np.ndarray: ...
    def free_host(self, buf: np.ndarray) -> None: ...
    def mem_info(self) -> tuple[int, int]: ...
    def stats(self) -> AllocStats: ...
    def bytes_from(self, ptr: DevicePtr) -> int: ...

    # streams, events
    @property
    def default_stream(self) -> int: ...
    def create_stream(self) -> int: ...
    def destroy_stream(self, stream: int) -> None: ...
    def synchronize(self, stream: int | None = None) -> None: ...
    def event_create(self) -> Any: ...
    def event_record(self, event: Any, stream: int | None = None) -> None: ...
    def event_elapsed_ms(self, start: Any, end: Any) -> float: ...
    def event_destroy(self, event: Any) -> None: ...

    # kernels
    def kernel(self, module: str, function: str) -> KernelHandle: ...
    def try_kernel(self, module: str, function: str) -> KernelHandle: ...
    def launch(
        self,
        kernel: KernelHandle,
        grid: Dim3,
        block: Dim3,
        args: Sequence[Any],
        smem: int = 0,
        stream: int | None = None,
    ) -> None: ...

    # graphs
    def begin_capture(self, stream: int | None = None) -> None: ...
    def end_capture(self, stream: int | None = None, label: str = "") -> Graph: ...
    def graph_launch(self, graph: Graph, stream: int | None = None) -> None: ...
    def graph_destroy(self, graph: Graph) -> None: ...
    def live_graphs(self) -> list[Graph]: ...
