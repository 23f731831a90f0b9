"""GPU runtime: backends, device pointers, kernel declarations and launches, graphs, paged KV
cache and communicators. Knows nothing of models."""

from .allocations import AllocStats
from .backend import NULL_KERNEL, GpuBackend, KernelHandle
from .device_ptr import NULL, DevicePtr
from .errors import (
    CommError,
    CudaError,
    GraphLifetimeError,
    KernelNotFound,
    LaunchError,
    MemoryFault,
    OutOfMemoryError,
)
from .graph import Graph
from .host_backend import HostBackend
from .launch import launch

__all__ = [
    "AllocStats",
    "Graph",
    "GpuBackend",
    "KernelHandle",
    "NULL_KERNEL",
    "DevicePtr",
    "NULL",
    "CommError",
    "CudaError",
    "GraphLifetimeError",
    "KernelNotFound",
    "LaunchError",
    "MemoryFault",
    "OutOfMemoryError",
    "HostBackend",
    "launch",
]
