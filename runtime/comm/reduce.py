"""Host reductions with NCCL's element semantics, in a fixed rank order.

NCCL reduces two operands at a time (one ring hop, one tree edge), and each step is rounded to the
element type:

- bf16 / fp16: the operands are widened to f32, combined, and rounded (round to nearest even) to
  bf16 / fp16 (``__hadd``/``__hmul``; exact f32 products and a second rounding that is innocuous
  for sums because f32 has more than 2p+2 bits). Overflow gives inf.
- fp8 e4m3: combined in fp16 (``__hadd(__half(x), __half(y))``), then converted to e4m3 with
  saturation to +-448 (the ``__nv_fp8_e4m3`` constructor is satfinite). NaN stays NaN.
- integers: two's-complement wrap-around for sum and prod; max/min exact.
- max/min of floats ignore a NaN operand (``fmaxf``/``__hmax``).
- avg: integers sum (wrapping) then divide by the world size, truncating toward zero for signed
  types; floats pre-multiply every input by ``dtype(1/world)`` (so a 3-rank bf16 avg scales by
  bf16(1/3)), then sum.

The order here is rank 0, 1, ..., W-1, so every rank gets bit-identical results. NCCL's order
depends on the algorithm and the chunk (ring position), so for W >= 3 a float sum can differ from
NCCL's in the last bit; for W <= 2 there is only one step and the results are identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .base import CommDtype, ReduceOp

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_FP8_MAX = 448.0


def _rounder(dtype: CommDtype) -> tuple[np.dtype, Callable[[np.ndarray], np.ndarray]]:
    """(the wide type one step is computed in, the rounding of a wide result to ``dtype``)."""
    dt = dtype.np_dtype
    if dtype is CommDtype.FLOAT64:
        return dt, lambda x: x
    if dtype is CommDtype.FP8_E4M3:

        def to_fp8(x: np.ndarray) -> np.ndarray:
            # Through fp16 as NCCL does, then saturate: ml_dtypes' e4m3fn turns overflow into NaN.
            return np.clip(x.astype(_F16).astype(_F32), -_FP8_MAX, _FP8_MAX).astype(dt)

        return _F32, to_fp8
    return _F32, lambda x: x.astype(dt)


def _float_reduce(inputs: Sequence[np.ndarray], dtype: CommDtype, op: ReduceOp) -> np.ndarray:
    wide, rnd = _rounder(dtype)
    if op is ReduceOp.AVG:
        # NCCL converts float(1.0 / nranks) straight to the element type (f64: the double).
        scale = np.asarray([1.0 / len(inputs)], dtype=wide).astype(dtype.np_dtype).astype(wide)
        inputs = [rnd(x.astype(wide) * scale) for x in inputs]
        op = ReduceOp.SUM
    step: Callable[[np.ndarray, np.ndarray], np.ndarray] = {
        ReduceOp.SUM: np.add,
        ReduceOp.PROD: np.multiply,
        ReduceOp.MAX: np.fmax,
        ReduceOp.MIN: np.fmin,
    }[op]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = rnd(step(acc.astype(wide), x.astype(wide)))
    return acc


def _int_reduce(inputs: Sequence[np.ndarray], dtype: CommDtype, op: ReduceOp) -> np.ndarray:
    step: Callable[[np.ndarray, np.ndarray], np.ndarray] = {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,
        ReduceOp.PROD: np.multiply,  # same-dtype NumPy array arithmetic wraps silently
        ReduceOp.MAX: np.maximum,
        ReduceOp.MIN: np.minimum,
    }[op]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = step(acc, x)
    if op is ReduceOp.AVG:
        n = len(inputs)
        q = acc // n  # floor; C division truncates toward zero
        if dtype.is_signed_int:
            q = q + ((acc % n != 0) & (acc < 0)).astype(acc.dtype)
        acc = q.astype(dtype.np_dtype)
    return acc


def reduce_arrays(inputs: Sequence[np.ndarray], dtype: CommDtype, op: ReduceOp) -> np.ndarray:
    """Reduce the ranks' inputs (index = rank), each a 1-D array of ``dtype.np_dtype``."""
    if not inputs:
        raise ValueError("reduce of zero inputs")
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype.is_float:
            return _float_reduce(inputs, dtype, op)
        return _int_reduce(inputs, dtype, op)
