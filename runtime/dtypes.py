"""Host-side dtypes and the exact conversions the kernels perform (round to nearest even;
FP8 E4M3 saturating at +-448, as the GPU's ``satfinite`` conversion does)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
F32 = np.dtype(np.float32)
U32 = np.dtype(np.uint32)
I32 = np.dtype(np.int32)

FP8_MAX = 448.0


def to_fp8_saturating(x: np.ndarray) -> np.ndarray:
    """ml_dtypes' float8_e4m3fn does not saturate (|x| >= 465 becomes NaN): clip to +-448 first."""
    return np.clip(np.asarray(x, dtype=np.float32), -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_rows_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row FP8: scale = absmax / 448 (1 for an all-zero row), q = x / scale saturated.

    Returns (q [rows, cols] FP8, scale [rows] f32). The division is done in f32 as the kernels do.
    """
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=-1)
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = to_fp8_saturating(x / scale[..., None])
    return q, scale
