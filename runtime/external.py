"""Device arrays of other libraries (a PyTorch tensor, a CuPy array), read through their
``__cuda_array_interface__`` (https://numba.readthedocs.io/en/stable/cuda/cuda_array_interface.html).

The runtime depends on no such library: it reads the interface's dictionary, checks the shape,
dtype and contiguity a caller asks for, and hands back the address and the byte count, which the
backend then lends for the duration of one call (``GpuBackend.borrow``).
"""

from __future__ import annotations

from dataclasses import dataclass

# BF16 has no NumPy typestr of its own: PyTorch and ml_dtypes describe it as two opaque bytes.
BF16_TYPESTRS = ("<V2",)
F32_TYPESTRS = ("<f4",)
_TYPE_NAMES = {BF16_TYPESTRS: "BF16", F32_TYPESTRS: "float32"}


class ExternalArrayError(ValueError):
    """An object offered as a device array that is not one of the shape, dtype or layout asked."""


@dataclass(frozen=True)
class ExternalArray:
    addr: int
    nbytes: int


def has_cuda_array_interface(obj) -> bool:
    return hasattr(obj, "__cuda_array_interface__")


def cuda_array(
    obj, *, shape: tuple[int, ...], typestrs: tuple[str, ...], itemsize: int, what: str
) -> ExternalArray:
    """The address and size of ``obj``'s C-contiguous device array, which must have exactly
    ``shape`` and one of ``typestrs``; an ExternalArrayError naming ``what`` otherwise."""
    try:
        cai = obj.__cuda_array_interface__
    except Exception as e:  # a CPU tensor raises here
        raise ExternalArrayError(f"{what}: no usable __cuda_array_interface__ ({e})") from None
    got_shape = tuple(int(d) for d in cai.get("shape", ()))
    if got_shape != tuple(shape):
        raise ExternalArrayError(f"{what} has shape {got_shape}, expected {tuple(shape)}")
    typestr = cai.get("typestr")
    if typestr not in typestrs:
        name = _TYPE_NAMES.get(tuple(typestrs), "")
        raise ExternalArrayError(f"{what} has dtype {typestr!r}, expected {name} ({' or '.join(typestrs)})")
    strides = cai.get("strides")
    if strides is not None:
        want, acc = [], itemsize
        for d in reversed(shape):
            want.append(acc)
            acc *= d
        if tuple(strides) != tuple(reversed(want)) and any(d > 1 for d in shape):
            raise ExternalArrayError(f"{what} is not C-contiguous (strides {tuple(strides)})")
    data = cai.get("data")
    addr = int(data[0]) if data else 0
    n = itemsize
    for d in shape:
        n *= d
    if n and not addr:
        raise ExternalArrayError(f"{what} has a null data pointer")
    return ExternalArray(addr, n)
