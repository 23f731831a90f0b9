"""DeepSeek / GLM-5 FP8 weight convention: block-scaled E4M3.

A quantised weight ``W`` [out, in] is stored as ``W.weight`` in F8_E4M3 plus
``W.weight_scale_inv`` in F32 of shape [ceil(out/bo), ceil(in/bi)] (bo = bi = 128 unless the
config's ``quantization_config.weight_block_size`` says otherwise). Despite the name, the scale is
a multiplier: ``W[i, j] = q[i, j] * s[i // bo, j // bi]``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from runtime.dtypes import BF16, to_fp8_saturating

DEFAULT_BLOCK: tuple[int, int] = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # appended to the ".weight" name


def scale_name(weight_name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``."""
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    out, inp = shape
    return (-(-out // block[0]), -(-inp // block[1]))


def dequantize_rows(
    q: np.ndarray,
    scale: np.ndarray,
    row_start: int = 0,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (offset, f32 rows) of ``q * scale``, one row block at a time.

    ``q`` holds rows [row_start, row_start + len(q)) of the full weight, so a vocab shard of an FP8
    head dequantises without reading other rows; working a block at a time bounds the f32
    temporary to ``block[0] * in`` values whatever the weight's size.
    """
    bo, bi = block
    rows = q.shape[0]
    r = 0
    while r < rows:
        global_row = row_start + r
        n = min(rows - r, bo - global_row % bo)  # up to the next block boundary
        s = np.repeat(np.asarray(scale[global_row // bo], dtype=np.float32), bi)[: q.shape[1]]
        yield r, np.asarray(q[r : r + n], dtype=np.float32) * s
        r += n


def dequantize(
    q: np.ndarray,
    scale: np.ndarray,
    dtype: np.dtype = BF16,
    row_start: int = 0,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> np.ndarray:
    """``q * scale`` per block, in f32, rounded once to ``dtype`` (BF16 by default)."""
    out = np.empty(q.shape, dtype=dtype)
    for r, rows in dequantize_rows(q, scale, row_start, block):
        out[r : r + len(rows)] = rows.astype(dtype)
    return out


def quantize(w: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise ``w`` [out, in]: scale = block absmax / 448 (1 for an all-zero block; never
    below the smallest f32 subnormal), q = w / scale in f32, rounded to nearest and saturated at
    +-448 (an f32 quotient just past 448 never becomes NaN). Partial blocks (out or in not a
    multiple of the block) take the absmax of the elements they hold.

    Returns (q F8_E4M3 [out, in], scale F32 [ceil(out/bo), ceil(in/bi)]). The writer uses it for
    FP8 test checkpoints and the loader to quantise a BF16 checkpoint's experts. A non-finite
    weight is a ValueError (its block would have no scale).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a matrix, got shape {list(w.shape)}")
    if not np.isfinite(w).all():
        raise ValueError(f"quantize: {int((~np.isfinite(w)).sum())} non-finite weights")
    bo, bi = block
    out, inp = w.shape
    so, si = scale_shape(w.shape, block)
    padded = np.zeros((so * bo, si * bi), dtype=np.float32)
    padded[:out, :inp] = np.abs(w)
    amax = padded.reshape(so, bo, si, bi).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    scale = np.maximum(scale, np.finfo(np.float32).smallest_subnormal)
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:out, :inp]
    return to_fp8_saturating(w / full), scale


__all__ = ["DEFAULT_BLOCK", "dequantize", "dequantize_rows", "quantize", "scale_name", "scale_shape"]
