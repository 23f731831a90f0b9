"""Dot products for the host twins whose value depends on the two vectors alone.

A sharded rank computes a slice of what one rank computes (its heads, its head groups, its share
of the vocabulary) with the same kernels over fewer rows, and the spec asks for the same bits. The
device kernels give a row its own reduction whatever the row count; numpy's matmul does not: the
BLAS picks its kernel, and with it the summation order, from the shapes. With OpenBLAS 0.3.31
(Haswell kernels) ``q[:1] @ c.T`` differed from ``(q @ c.T)[:1]`` in 7 of 8 scores for a [4, 32]
query and 8 rows, so one rank's attention head differed from the same head among four, and a
4-rank host run drafted 28 where one rank drafted 64 (issue 17, item 5; tests/test_sharded.py).

Here every product vector is laid out C-contiguous and summed along that axis, which numpy does by
its pairwise summation of the one row: the result is a function of (x[i], w[j]) only
(tests/test_shard_slices.py checks it, and each twin's slices, bit for bit).
"""

from __future__ import annotations

import numpy as np

# Elements of one product block; bounds the temporary to 16 MiB whatever the matrix size.
_BLOCK_ELEMENTS = 1 << 22


def dot_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """f32 ``x [m, k] @ w [n, k]^T -> [m, n]``; element (i, j) depends on x[i] and w[j] alone."""
    x = np.ascontiguousarray(x, np.float32)
    w = np.ascontiguousarray(w, np.float32)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dot_rows: x {x.shape} and w {w.shape} are not [m, k] and [n, k]")
    m, k = x.shape
    n = w.shape[0]
    out = np.empty((m, n), np.float32)
    step = max(1, _BLOCK_ELEMENTS // max(m * k, 1))
    for j0 in range(0, n, step):
        j1 = min(n, j0 + step)
        # The product is written into a fresh C-ordered block, so its last axis is the contiguous
        # one the sum runs along (a strided or Fortran-ordered product sums in another order).
        prod = np.empty((m, j1 - j0, k), np.float32)
        np.multiply(x[:, None, :], w[None, j0:j1, :], out=prod)
        out[:, j0:j1] = prod.sum(axis=-1, dtype=np.float32)
    return out
