"""Reading a named host tensor and checking its shape and dtype: the one place that does it.

The proposer, the target and the weight loaders all read their tensors through ``TensorLookup``,
so a missing tensor, a wrong shape or a wrong dtype is the same ``WeightError``, naming the tensor,
what was expected and what was found, wherever the tensor is read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.dtypes import BF16


class WeightError(ValueError):
    """A tensor is missing or has the wrong shape or dtype, or the weights do not fit the config."""


class TensorLookup:
    """Host tensors by name, from a Mapping (a dict, a validated ``TensorSet``) or a checkpoint
    (an object with ``has`` and ``get``)."""

    def __init__(self, src: Any) -> None:
        self._src = src
        self._is_checkpoint = hasattr(src, "has")

    @classmethod
    def of(cls, tensors: Any) -> "TensorLookup":
        """``tensors`` itself when it already is a lookup, else a lookup over it."""
        return tensors if isinstance(tensors, TensorLookup) else cls(tensors)

    def __contains__(self, name: str) -> bool:
        return self._src.has(name) if self._is_checkpoint else name in self._src

    def checked(self, name: str, shape: tuple[int, ...], dtype: Any = BF16) -> np.ndarray:
        """The tensor ``name`` if it is ``dtype[shape]``; else a WeightError naming it, the
        expected and the found (invariant: nothing is uploaded that the kernels would misread)."""
        if name not in self:
            raise WeightError(f"missing tensor {name!r}")
        a = self._src.get(name) if self._is_checkpoint else self._src[name]
        if tuple(a.shape) != tuple(shape):
            raise WeightError(f"tensor {name!r}: expected shape {tuple(shape)}, found {tuple(a.shape)}")
        if np.dtype(a.dtype) != np.dtype(dtype):
            raise WeightError(f"tensor {name!r}: expected dtype {np.dtype(dtype)}, found {np.dtype(a.dtype)}")
        return a
