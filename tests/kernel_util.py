"""Shared helpers for the kernel tests (host twins and PTX): random data, device round trips, and
the stated tolerances.

Tolerances, in one place so that every test states the same thing:

- ``BF16_REL = 2**-8``: one BF16 rounding is at most half an ulp, 2**-9 relative; two results that
  each went through one rounding (the GPU and the host twin, or a twin and float64) differ by at
  most one ulp, 2**-8 relative to the larger.
- A dot product of length k accumulated in f32 (any order) is within ``k * 2**-24 * sum|x_i w_i|``
  of the exact value (the textbook gamma_k bound); ``dot_bound`` adds that to the BF16 rounding.
"""

from __future__ import annotations

import numpy as np

from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16

BF16_REL = 2.0**-8
F32_EPS = 2.0**-24


def random_bf16(rng: np.random.Generator, shape: int | tuple[int, ...], exp_lo: int = -5) -> np.ndarray:
    """Random BF16 with random sign and mantissa and a binary exponent in [exp_lo, exp_lo + 7],
    built from random bits (fast enough for the 634M-element head: one uint16 draw each)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = int(np.prod(shape))
    r = np.frombuffer(rng.bytes(2 * n), dtype=np.uint16)
    exp = ((r >> 7) & np.uint16(7)) + np.uint16(127 + exp_lo)
    bits = (r & np.uint16(0x807F)) | (exp << np.uint16(7))
    return bits.view(BF16).reshape(shape)


def upload(gpu, arr: np.ndarray, pad: int = 0) -> DevicePtr:
    """A fresh allocation holding ``arr`` (plus ``pad`` poisoned bytes after it)."""
    arr = np.ascontiguousarray(arr)
    p = gpu.alloc(arr.nbytes + pad)
    if pad:
        gpu.memset(p, 0xFF, arr.nbytes + pad)
    gpu.copy_h2d(p, arr)
    return p


def download(gpu, ptr: DevicePtr, dtype, shape) -> np.ndarray:
    out = np.empty(shape, dtype)
    gpu.copy_d2h(out, ptr)
    return out


def poisoned(gpu, nbytes: int) -> DevicePtr:
    """An output buffer filled with 0xFF (NaN in BF16/F32/FP8), so an unwritten element shows."""
    p = gpu.alloc(nbytes)
    gpu.memset(p, 0xFF, nbytes)
    return p


def abs_dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``|x| @ |w|^T`` [m, n] (float64 for small operands; f32 for the 634M-element head, whose
    float64 copy would be 5 GB: the bound only needs a few correct digits)."""
    xa = np.abs(np.asarray(x, np.float32))
    wa = np.abs(np.asarray(w, np.float32))
    if wa.size < 50_000_000:
        return xa.astype(np.float64) @ wa.T.astype(np.float64)
    return (xa @ wa.T).astype(np.float64)


def dot_bound(absdot: np.ndarray, ref: np.ndarray, k: int, roundings: int = 1) -> np.ndarray:
    """Allowed |out - ref| for ``out = bf16(f32 dot)`` of length k against ``ref``: per result,
    half a BF16 ulp (2**-9 relative) plus the f32 accumulation bound k * 2**-24 * sum|x w|;
    ``roundings=2`` when both sides carry those errors (GPU against host twin); then a factor 2 of
    slack for the second-order terms."""
    return 2.0 * roundings * (2.0**-9 * np.abs(np.asarray(ref, np.float64)) + k * F32_EPS * absdot) + 1e-30


def assert_dot_close(out: np.ndarray, ref: np.ndarray, bound: np.ndarray, what: str) -> None:
    out64 = np.asarray(out, np.float64)
    assert not np.isnan(out64).any(), f"{what}: {int(np.isnan(out64).sum())} NaN (unwritten?) elements"
    err = np.abs(out64 - ref)
    bad = err > bound
    if bad.any():
        i = np.unravel_index(int(np.argmax(err - bound)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements outside the bound; worst at {i}: "
            f"out {out64[i]!r}, ref {ref[i]!r}, bound {bound[i]!r}"
        )


def check_mapped_buffer_contract(gpu) -> None:
    """GpuBackend.alloc_mapped on either backend: a kernel inside a replayed graph stores into the
    buffer and the host reads the result after synchronising, with no copy; a free under the live
    graph is refused and changes nothing; plain free and a second free_mapped are refused."""
    import pytest

    from runtime import GraphLifetimeError, MemoryFault
    from runtime.kernels.add_bf16 import add_bf16, add_ref

    rng = np.random.default_rng()
    n = 37
    before = gpu.stats().live_allocations
    a, b = gpu.alloc(2 * n), gpu.alloc(2 * n)
    out = gpu.alloc_mapped(2 * n)
    assert out.nbytes == 2 * n and gpu.stats().live_allocations == before + 3
    s = gpu.create_stream()
    gpu.begin_capture(s)
    add_bf16(gpu, a, b, out.device, n, stream=s)
    g = gpu.end_capture(s, label="add into mapped")
    for _ in range(2):  # each replay's result reaches the host without a copy
        x, y = random_bf16(rng, n), random_bf16(rng, n)
        gpu.copy_h2d(a, x)
        gpu.copy_h2d(b, y)
        gpu.graph_launch(g, s)
        gpu.synchronize(s)
        np.testing.assert_array_equal(out.host.view(BF16), add_ref(x, y))
    try:
        with pytest.raises(GraphLifetimeError, match="add into mapped"):
            gpu.free_mapped(out)
        with pytest.raises(MemoryFault, match="free_mapped"):
            gpu.free(out.device)
        gpu.graph_launch(g, s)  # still intact after the refusals
        gpu.synchronize(s)
        np.testing.assert_array_equal(out.host.view(BF16), add_ref(x, y))
    finally:
        gpu.graph_destroy(g)
        gpu.destroy_stream(s)
    gpu.free_mapped(out)
    with pytest.raises(MemoryFault):
        gpu.free_mapped(out)
    gpu.free(a)
    gpu.free(b)
    assert gpu.stats().live_allocations == before


def check_copy_words_from_mapped_memory(gpu) -> None:
    """copy_words from mapped pinned memory into a poisoned device buffer, inside a graph replayed
    after the host rewrote the source: each replay copies the words the host wrote last, and
    nothing past n."""
    from runtime.kernels.copy_words import copy_words

    rng = np.random.default_rng()
    for n in (1, 2, 37, 100):
        src = gpu.alloc_mapped(4 * n)
        dst = gpu.alloc(4 * n + 64)
        s = gpu.create_stream()
        try:
            gpu.begin_capture(s)
            copy_words(gpu, src.device, dst, n, stream=s)
            g = gpu.end_capture(s, label="copy_words")
            for _ in range(3):
                gpu.memset(dst, 0xFF, 4 * n + 64, stream=s)
                words = rng.integers(0, 2**32, n, dtype=np.uint32)
                src.host.view(np.uint32)[:] = words
                gpu.graph_launch(g, s)
                gpu.synchronize(s)
                got = np.empty(n + 16, np.uint32)
                gpu.copy_d2h(got, dst)
                np.testing.assert_array_equal(got[:n], words)
                assert (got[n:] == 0xFFFFFFFF).all(), "copy_words wrote past n"
            gpu.graph_destroy(g)
        finally:
            gpu.destroy_stream(s)
            gpu.free(dst)
            gpu.free_mapped(src)


def same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Bit-for-bit equality of two arrays (NaN-safe), naming the first rows that differ."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} and {b.shape}"
    diff = a.view(np.uint8).reshape(max(a.shape[0], 1) if a.ndim else 1, -1) != b.view(np.uint8).reshape(
        max(b.shape[0], 1) if b.ndim else 1, -1
    )
    if diff.any():
        rows = np.nonzero(diff.any(axis=1))[0]
        raise AssertionError(
            f"{what}: {int(diff.sum())} bytes differ, in {len(rows)} rows, first {rows[:10].tolist()}"
        )


def no_poison(y: np.ndarray, what: str) -> None:
    """Finite inputs give finite outputs: a NaN is an element the kernel did not write (outputs are
    poisoned with 0xFF before the launch)."""
    bad = np.isnan(np.asarray(y, np.float32))
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} NaN (unwritten) elements, rows {np.unique(np.nonzero(bad)[0])[:10]}"
    )
