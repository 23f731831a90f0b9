"""Kernel declarations: one per CUDA function, with its argument signature and its host twin.

A kernel's Python module (``runtime/kernels/*.py`` or ``model/kernels/*.py``) declares it with
``declare(...)`` and registers the NumPy implementation that the host backend runs and that the GPU
tests compare the PTX against. The CUDA source is ``ptx/<module>.cu``; the function is
``extern "C"`` with the same name and the same arguments in the same order.
"""

from __future__ import annotations

import importlib
import importlib.resources
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path


class Arg(Enum):
    """Kernel argument types (``runtime.launch.ArgPacker`` lays each out for cuLaunchKernel)."""

    PTR = "ptr"
    U32 = "u32"
    I32 = "i32"
    U64 = "u64"
    F32 = "f32"


PTR, U32, I32, U64, F32 = Arg.PTR, Arg.U32, Arg.I32, Arg.U64, Arg.F32


class Pdl(Enum):
    """How a kernel takes part in programmatic dependent launch (sm_90 griddepcontrol).

    NONE: launched plainly; it starts when everything before it on the stream has completed.
    WAIT: it calls griddepcontrol.wait on every path before it reads a previous kernel's output,
      stores, or exits (only weights are read before), so it may start while the kernel before it
      finishes.
    BESIDE: before its wait it reads only inputs from two or more launches back, so it works
      without waiting; it calls the wait before it exits (keeping "my predecessor completed"
      transitive), and after the wait it may also read its predecessor's output. It may overlap its
      predecessor only when that predecessor releases its dependents (``releases=True``); the
      backend checks this at each launch and otherwise launches it plainly.

    A releasing kernel calls griddepcontrol.launch_dependents once everything launched before it
    has completed: at its start when it is NONE (launched plainly), right after its own wait when it
    is WAIT. A BESIDE kernel cannot release: its predecessor may still be running.
    """

    NONE = "none"
    WAIT = "wait"
    BESIDE = "beside"

    def __bool__(self) -> bool:
        return self is not Pdl.NONE


@dataclass(frozen=True)
class KernelDecl:
    module: str
    function: str
    args: tuple[tuple[str, Arg], ...]
    # Pointer arguments the kernel writes: the host backend runs the twin with every other pointer
    # argument's allocation read-only, so a twin that stores into an input is refused.
    writes: tuple[str, ...] = ()
    host: Callable[..., None] | None = field(default=None, compare=False, repr=False)
    # Programmatic dependent launch (Pdl), and whether the kernel releases its dependents as soon as
    # everything before it has completed (griddepcontrol.launch_dependents; what a BESIDE successor
    # needs to overlap it).
    pdl: Pdl = Pdl.NONE
    releases: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.function)

    @property
    def arg_types(self) -> tuple[Arg, ...]:
        return tuple(t for _, t in self.args)


_REGISTRY: dict[tuple[str, str], KernelDecl] = {}


def declare(
    module: str,
    function: str,
    args: list[tuple[str, Arg]],
    *,
    writes: tuple[str, ...] = (),
    pdl: Pdl | bool = Pdl.NONE,
    releases: bool = False,
) -> Callable[[Callable[..., None]], KernelDecl]:
    """Decorator: declare a kernel and register the decorated function as its host twin.

    The host twin is called as ``host(mem, *args)`` where ``mem`` is the host heap
    (``HostMemory``) and pointer arguments arrive as ``DevicePtr``. ``pdl`` declares the
    programmatic-dependent-launch contract the CUDA function honours (``Pdl``; True means
    ``Pdl.WAIT``); tests/test_pdl_ptx.py checks its PTX for it.
    """
    mode = pdl if isinstance(pdl, Pdl) else (Pdl.WAIT if pdl else Pdl.NONE)
    if releases and mode is Pdl.BESIDE:
        # A BESIDE successor reads what was complete before this kernel: a BESIDE kernel has not
        # waited for its own predecessor when it could release, so it cannot give that guarantee.
        raise ValueError(f"{module}.{function}: a kernel that releases its dependents cannot be Pdl.BESIDE")
    names = [n for n, _ in args]
    for w in writes:
        if w not in names:
            raise ValueError(f"{module}.{function}: writes names unknown argument {w!r}")

    def wrap(fn: Callable[..., None]) -> KernelDecl:
        decl = KernelDecl(module, function, tuple(args), tuple(writes), fn, mode, releases)
        old = _REGISTRY.get(decl.key)
        if old is not None and (old.args, old.pdl, old.releases) != (decl.args, decl.pdl, decl.releases):
            raise ValueError(
                f"kernel {module}.{function} declared twice with different arguments or launch flags"
            )
        _REGISTRY[decl.key] = decl
        return decl

    return wrap


def lookup(module: str, function: str) -> KernelDecl | None:
    return _REGISTRY.get((module, function))


def registered() -> list[KernelDecl]:
    return sorted(_REGISTRY.values(), key=lambda d: d.key)


def register_all_kernels() -> None:
    """Import every module of ``runtime.kernels`` so that its ``declare`` has run. Kernels of other
    packages (the model's) are declared when their package is imported: the runtime does not know
    them by name."""
    pkg = importlib.import_module("runtime.kernels")
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"runtime.kernels.{info.name}")


def shipped_ptx_dir() -> Path:
    """The directory of the PTX this installation ships: ``ptx/`` beside the ``runtime`` package,
    which is the checkout's top-level ptx/ (run from a checkout or an editable install) and the
    ``ptx`` package's data in an installed wheel; else wherever ``import ptx`` finds it."""
    beside = Path(__file__).resolve().parent.parent / "ptx"
    if beside.is_dir():
        return beside
    return Path(str(importlib.resources.files("ptx")))
