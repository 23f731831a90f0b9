"""Every PTX kernel against its host twin on fresh random data: awkward sizes (odd lengths, lengths
that are not a multiple of the block or the 16-byte vector), misaligned pointers (the kernels'
element-wise paths), and the full 154880 x 4096 head for the GEMVs and the argmax. Outputs are
poisoned (0xFF) before each launch so an unwritten element shows as NaN.

Tolerances (tests/kernel_util.py): kernels whose math is order-free (add, gather, quantize,
argmax) must match their twin bit for bit; rmsnorm within one BF16 ulp (2**-7 relative) because
the sum of squares is added in another order; the GEMVs within ``dot_bound(..., roundings=2)``
(one BF16 rounding on each side plus the f32 accumulation bound k * 2**-24 * sum|x w|)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from kernel_util import abs_dot, assert_dot_close, dot_bound, random_bf16

from runtime.dtypes import BF16, FP8, quantize_rows_fp8
from runtime.host_backend import HostBackend
from runtime.kernels.add_bf16 import add_bf16
from runtime.kernels.all_finite_bf16 import NONE as FINITE
from runtime.kernels.all_finite_bf16 import all_finite_bf16, first_nonfinite_row_ref
from runtime.kernels.argmax_bf16 import argmax_bf16, argmax_ref
from runtime.kernels.embed_gather_bf16 import embed_gather_bf16
from runtime.kernels.gemv_bf16 import gemv_bf16, gemv_bf16_ref
from runtime.kernels.gemv_fp8w import gemv_fp8w, gemv_fp8w_ref
from runtime.kernels.quantize_fp8 import quantize_fp8
from runtime.kernels.read_xor import read_xor
from runtime.kernels.rmsnorm import rmsnorm

pytestmark = pytest.mark.gpu

VOCAB, HIDDEN = 154880, 4096


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_kernels"


def run_on(
    gpu,
    fn: Callable[..., None],
    inputs: dict[str, np.ndarray],
    outputs: dict[str, int],
    misalign: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Upload ``inputs``, poison ``outputs`` (name -> bytes), call ``fn(gpu, **pointers)``, return
    the outputs' raw bytes. ``misalign`` shifts the named buffers off 16-byte alignment."""
    misalign = misalign or {}
    ptrs, allocs = {}, []
    for name, arr in inputs.items():
        off = misalign.get(name, 0)
        base = gpu.alloc(arr.nbytes + off + 16)
        allocs.append(base)
        ptrs[name] = base.offset(off)
        gpu.copy_h2d(ptrs[name], np.ascontiguousarray(arr))
    for name, nbytes in outputs.items():
        off = misalign.get(name, 0)
        base = gpu.alloc(nbytes + off + 16)
        allocs.append(base)
        gpu.memset(base, 0xFF, nbytes + off + 16)
        ptrs[name] = base.offset(off)
    fn(gpu, **ptrs)
    out = {}
    for name, nbytes in outputs.items():
        buf = np.empty(nbytes, np.uint8)
        gpu.copy_d2h(buf, ptrs[name])
        out[name] = buf
    for p in allocs:
        gpu.free(p)
    return out


def both(cuda, fn, inputs, outputs, misalign=None):
    host = HostBackend()
    return run_on(cuda, fn, inputs, outputs, misalign), run_on(host, fn, inputs, outputs, misalign)


# ---- elementwise and small kernels -----------------------------------------------------------------


@pytest.mark.parametrize("rows,n,mis", [(1, 4096, 0), (3, 37, 0), (4, 4104, 0), (2, 1, 0), (3, 4096, 2)])
def test_rmsnorm(cuda, rows, n, mis):
    rng = np.random.default_rng()
    x, w = random_bf16(rng, (rows, n)), random_bf16(rng, n, exp_lo=-1)
    g, h = both(
        cuda,
        lambda b, x, w, out: rmsnorm(b, x, w, out, rows, n, 1e-5),
        {"x": x, "w": w},
        {"out": 2 * rows * n},
        {"x": mis},
    )
    go, ho = g["out"].view(BF16).astype(np.float64), h["out"].view(BF16).astype(np.float64)
    assert not np.isnan(go).any()
    np.testing.assert_allclose(go, ho, rtol=2.0**-7, atol=0)


@pytest.mark.parametrize("n,mis", [(1, 0), (7, 0), (2049, 0), (100_003, 0), (4096, 2)])
def test_add(cuda, n, mis):
    rng = np.random.default_rng()
    a, b = random_bf16(rng, n), random_bf16(rng, n)
    g, h = both(
        cuda, lambda gpu, a, b, out: add_bf16(gpu, a, b, out, n), {"a": a, "b": b}, {"out": 2 * n}, {"a": mis}
    )
    assert g["out"].tobytes() == h["out"].tobytes()
    assert not np.isnan(g["out"].view(BF16).astype(np.float32)).any()


@pytest.mark.parametrize("k,mis", [(4096, 0), (37, 0), (4100, 0), (4096, 2)])
def test_embed_gather(cuda, k, mis):
    rng = np.random.default_rng()
    vocab = 1001
    table = random_bf16(rng, (vocab, k))
    for token in (int(rng.integers(0, vocab)), vocab - 1, vocab, 2**32 - 1):
        g, h = both(
            cuda,
            lambda gpu, table, tok, out: embed_gather_bf16(gpu, table, tok, out, vocab, k),
            {"table": table, "tok": np.array([token], np.uint32)},
            {"out": 2 * k},
            {"table": mis},
        )
        assert g["out"].tobytes() == h["out"].tobytes(), f"token {token}"
        if token >= vocab:
            assert (g["out"].view(np.uint16) == 0xFFFF).all()
        else:
            assert g["out"].tobytes() == table[token].tobytes()


@pytest.mark.parametrize("n,k", [(3, 37), (17, 4096), (2, 1), (5, 4104)])
def test_quantize_fp8_bit_exact(cuda, n, k):
    rng = np.random.default_rng()
    x = random_bf16(rng, (n, k)).astype(np.float32)
    x[0] = 0.0  # all-zero row
    if n > 2:
        x[2, k // 2] = -3.0e38  # one huge element: the rest of its row goes subnormal in FP8
    xb = x.astype(BF16)
    g, h = both(
        cuda,
        lambda gpu, x, q, s: quantize_fp8(gpu, x, q, s, n, k),
        {"x": xb},
        {"q": n * k, "s": 4 * n},
    )
    assert g["s"].tobytes() == h["s"].tobytes()
    assert g["q"].tobytes() == h["q"].tobytes()
    q, s = quantize_rows_fp8(xb)
    assert g["q"].tobytes() == q.tobytes() and g["s"].tobytes() == s.tobytes()


@pytest.mark.parametrize(
    "n16,blocks", [(1, 1), (1, 3), (255, 1), (257, 2), (12_345, 5), (2 * 256 * 8 * 7 + 3, 7)]
)
@pytest.mark.parametrize("l2_256b", [False, True])
def test_read_xor(cuda, n16, blocks, l2_256b):
    """Every block writes its partial, blocks without words included (0), bit for bit the twin's."""
    rng = np.random.default_rng()
    words = rng.integers(0, 2**32, size=4 * n16, dtype=np.uint32)
    g, h = both(
        cuda,
        lambda gpu, src, out: read_xor(gpu, src, 16 * n16, out, blocks, l2_256b=l2_256b),
        {"src": words},
        {"out": 4 * blocks},
    )
    assert g["out"].tobytes() == h["out"].tobytes()
    assert np.bitwise_xor.reduce(g["out"].view(np.uint32)) == np.bitwise_xor.reduce(words)


@pytest.mark.parametrize(
    "rows,h,mis", [(1, 4096, 0), (7, 4096, 0), (300, 4096, 0), (5, 37, 0), (9, 4096, 2), (3, 1, 0)]
)
def test_all_finite(cuda, rows, h, mis):
    """The lowest row holding a NaN or an Inf (every kind, anywhere in the row, in several rows at
    once), or NONE; the output is poisoned before the launch (the helper resets it)."""
    rng = np.random.default_rng()
    x = random_bf16(rng, (rows, h))

    def check(x: np.ndarray) -> int:
        g, hh = both(
            cuda, lambda gpu, x, out: all_finite_bf16(gpu, x, rows, h, out), {"x": x}, {"out": 4}, {"x": mis}
        )
        assert g["out"].tobytes() == hh["out"].tobytes()
        return int(g["out"].view(np.uint32)[0])

    assert check(x) == FINITE
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        r = sorted(rng.choice(rows, size=min(rows, 3), replace=False))
        for rr in r:
            y[rr, int(rng.integers(h))] = bad
        assert check(y) == r[0] == first_nonfinite_row_ref(y)
    y = x.copy()
    y[rows - 1, h - 1] = np.nan  # the very last element (the scalar tail when h is odd)
    assert check(y) == rows - 1
    big = x.copy()
    big[0, 0] = 2.0**127  # huge is finite
    assert check(big) == FINITE


def _argmax_both(cuda, x: np.ndarray, mis: int = 0) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
    n = len(x)
    g, h = both(
        cuda,
        lambda gpu, x, i, v: argmax_bf16(gpu, x, i, v, n),
        {"x": x.astype(BF16)},
        {"i": 4, "v": 4},
        {"x": mis},
    )
    return (int(g["i"].view(np.uint32)[0]), g["v"].tobytes()), (
        int(h["i"].view(np.uint32)[0]),
        h["v"].tobytes(),
    )


@pytest.mark.parametrize(
    "n,mis", [(1, 0), (7, 0), (1000, 0), (8191, 2), (VOCAB, 0), (VOCAB + 1, 0), (VOCAB, 2)]
)
def test_argmax(cuda, n, mis):
    rng = np.random.default_rng()
    x = random_bf16(rng, n).astype(np.float32)
    g, h = _argmax_both(cuda, x, mis)
    assert g == h
    assert g[0] == argmax_ref(x)[0]
    if n < 3:
        return
    # ties at the top: the lowest index wins, even when it is in another thread's slice
    top = np.float32(2.0**12)
    where = sorted(rng.choice(n, size=3, replace=False))
    y = x.copy()
    y[where] = top
    g, h = _argmax_both(cuda, y, mis)
    assert g == h and g[0] == where[0]
    # NaN never wins
    y[rng.choice(n, size=max(1, n // 10), replace=False)] = np.nan
    y[where[1]] = top
    g, h = _argmax_both(cuda, y, mis)
    assert g == h and g[0] == argmax_ref(y)[0]
    # all NaN: index 0 (a valid index) flagged by the NaN value; -inf among NaN: it wins
    z = np.full(n, np.nan, np.float32)
    g, h = _argmax_both(cuda, z, mis)
    assert g[0] == h[0] == 0 and np.isnan(np.frombuffer(g[1], np.float32)[0])
    assert np.isnan(np.frombuffer(h[1], np.float32)[0])
    z[n - 2] = -np.inf
    g, h = _argmax_both(cuda, z, mis)
    assert g == h and g[0] == n - 2
    # +inf is a value too: the lowest +inf wins over NaN and numbers
    y[where[2]] = np.inf
    y[where[1]] = np.inf
    g, h = _argmax_both(cuda, y, mis)
    assert g == h and g[0] == where[1]


# ---- GEMVs ---------------------------------------------------------------------------------------------


GEMV_CASES = [
    (1, 37, 64, {}),
    (3, 101, 29, {}),  # odd k: element-wise path
    (8, 1000, 4096, {}),
    (2, 17, 4095, {}),
    (5, 333, 4104, {}),
    (1, 4099, 8, {}),
    (1, 100, 4096, {"x": 2}),  # misaligned x: element-wise path at a vector-friendly k
    (4, 65, 512, {"W": 2}),
]


@pytest.mark.parametrize("m,n,k,mis", GEMV_CASES)
def test_gemv_bf16(cuda, m, n, k, mis):
    rng = np.random.default_rng()
    w, x = random_bf16(rng, (n, k)), random_bf16(rng, (m, k), exp_lo=-2)
    g, h = both(
        cuda,
        lambda gpu, W, x, y: gemv_bf16(gpu, W, x, y, m, n, k),
        {"W": w, "x": x},
        {"y": 2 * m * n},
        mis,
    )
    gy, hy = g["y"].view(BF16).reshape(m, n), h["y"].view(BF16).reshape(m, n)
    ad = abs_dot(x, w)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert_dot_close(gy, ref, dot_bound(ad, ref, k), f"gemv_bf16 PTX vs float64 m={m} n={n} k={k}")
    assert_dot_close(
        gy, hy.astype(np.float64), dot_bound(ad, hy, k, 2), f"gemv_bf16 PTX vs twin m={m} n={n} k={k}"
    )


FP8_CASES = [
    (1, 37, 64, {}),  # m <= 2 with aligned x: x staged in shared memory
    (2, 301, 4096, {}),
    (2, 17, 37, {}),  # odd k
    (8, 1000, 4096, {}),
    (3, 129, 4112, {}),
    (1, 50, 4095, {}),
    (1, 77, 4096, {"Wq": 1}),  # misaligned weights: element-wise path
]


@pytest.mark.parametrize("m,n,k,mis", FP8_CASES)
def test_gemv_fp8w(cuda, m, n, k, mis):
    rng = np.random.default_rng()
    w, x = random_bf16(rng, (n, k)), random_bf16(rng, (m, k), exp_lo=-2)
    q, s = quantize_rows_fp8(w)
    g, h = both(
        cuda,
        lambda gpu, Wq, s, x, y: gemv_fp8w(gpu, Wq, s, x, y, m, n, k),
        {"Wq": q, "s": s, "x": x},
        {"y": 2 * m * n},
        mis,
    )
    gy, hy = g["y"].view(BF16).reshape(m, n), h["y"].view(BF16).reshape(m, n)
    wd = q.astype(np.float64) * s.astype(np.float64)[:, None]
    ad = abs_dot(x, wd)
    ref = x.astype(np.float64) @ wd.T
    assert_dot_close(gy, ref, dot_bound(ad, ref, k), f"gemv_fp8w PTX vs float64 m={m} n={n} k={k}")
    assert_dot_close(
        gy, hy.astype(np.float64), dot_bound(ad, hy, k, 2), f"gemv_fp8w PTX vs twin m={m} n={n} k={k}"
    )


@pytest.mark.parametrize("which", ["gemv_fp8w", "gemv_fp8w_m2"])
@pytest.mark.parametrize("m,smem", [(1, 0), (1, 4 * 4096 - 4), (1, 4 * 4096), (2, 8 * 4096)])
def test_gemv_fp8w_kernels_with_and_without_staging_room(cuda, which, m, smem):
    """Both exported kernels, launched directly. They stage x in shared memory only if the launch
    gave it room (read from the hardware): a launch without room must still be right."""
    from runtime.kernels.gemv_fp8w import BLOCK, grid_for
    from runtime.launch import launch

    rng = np.random.default_rng()
    n, k = 517, 4096
    w, x = random_bf16(rng, (n, k)), random_bf16(rng, (m, k), exp_lo=-2)
    q, s = quantize_rows_fp8(w)

    def run(gpu, Wq, s, x, y):
        launch(gpu, gpu.kernel("gemv_fp8w", which), grid_for(n), BLOCK, Wq, s, x, y, m, n, k, smem=smem)

    g, h = both(cuda, run, {"Wq": q, "s": s, "x": x}, {"y": 2 * m * n})
    gy, hy = g["y"].view(BF16).reshape(m, n), h["y"].view(BF16).reshape(m, n)
    wd = q.astype(np.float64) * s.astype(np.float64)[:, None]
    assert_dot_close(
        gy, hy.astype(np.float64), dot_bound(abs_dot(x, wd), hy, k, 2), f"{which} m={m} smem={smem}"
    )


def test_gemv_fp8w_m2_writes_nothing_for_larger_m(cuda):
    from runtime.kernels.gemv_fp8w import BLOCK, GEMV_FP8W_M2, grid_for
    from runtime.launch import launch

    rng = np.random.default_rng()
    m, n, k = 3, 33, 64
    q, s = quantize_rows_fp8(random_bf16(rng, (n, k)))
    x = random_bf16(rng, (m, k))

    def run(gpu, Wq, s, x, y):
        launch(gpu, gpu.kernel(*GEMV_FP8W_M2.key), grid_for(n), BLOCK, Wq, s, x, y, m, n, k)

    g, h = both(cuda, run, {"Wq": q, "s": s, "x": x}, {"y": 2 * m * n})
    assert (g["y"] == 0xFF).all() and (h["y"] == 0xFF).all()


# ---- the full draft head: 154880 x 4096 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def head(cuda):
    rng = np.random.default_rng()
    w = random_bf16(rng, (VOCAB, HIDDEN))
    pw = cuda.alloc(w.nbytes)
    cuda.copy_h2d(pw, w)
    yield w, pw
    cuda.free(pw)


def test_gemv_bf16_full_head(cuda, head):
    w, pw = head
    rng = np.random.default_rng()
    x = random_bf16(rng, (1, HIDDEN), exp_lo=-2)
    px, py = cuda.alloc(x.nbytes), cuda.alloc(2 * VOCAB)
    cuda.copy_h2d(px, x)
    cuda.memset(py, 0xFF, 2 * VOCAB)
    gemv_bf16(cuda, pw, px, py, 1, VOCAB, HIDDEN)
    y = np.empty((1, VOCAB), BF16)
    cuda.copy_d2h(y, py)
    twin = gemv_bf16_ref(w, x)  # the host twin's math
    assert_dot_close(
        y, twin.astype(np.float64), dot_bound(abs_dot(x, w), twin, HIDDEN, 2), "gemv_bf16 full head"
    )
    # the device argmax of the device logits is the twin's argmax of the same logits
    pi, pv = cuda.alloc(4), cuda.alloc(4)
    argmax_bf16(cuda, py, pi, pv, VOCAB)
    assert int(_d2h(cuda, pi, 4).view(np.uint32)[0]) == argmax_ref(y)[0]
    for p in (px, py, pi, pv):
        cuda.free(p)


def _d2h(gpu, ptr, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    gpu.copy_d2h(out, ptr)
    return out


def test_quantize_and_gemv_fp8w_full_head(cuda, head):
    w, pw = head
    rng = np.random.default_rng()
    pq, ps = cuda.alloc(VOCAB * HIDDEN), cuda.alloc(4 * VOCAB)
    cuda.memset(pq, 0xFF, VOCAB * HIDDEN)
    cuda.memset(ps, 0xFF, 4 * VOCAB)
    quantize_fp8(cuda, pw, pq, ps, VOCAB, HIDDEN)
    q = _d2h(cuda, pq, VOCAB * HIDDEN).view(FP8).reshape(VOCAB, HIDDEN)
    s = _d2h(cuda, ps, 4 * VOCAB).view(np.float32)
    rows = np.sort(rng.choice(VOCAB, size=2000, replace=False))
    q_ref, s_ref = quantize_rows_fp8(w[rows])
    assert q[rows].tobytes() == q_ref.tobytes() and s[rows].tobytes() == s_ref.tobytes()
    x = random_bf16(rng, (1, HIDDEN), exp_lo=-2)
    px, py = cuda.alloc(x.nbytes), cuda.alloc(2 * VOCAB)
    cuda.copy_h2d(px, x)
    cuda.memset(py, 0xFF, 2 * VOCAB)
    gemv_fp8w(cuda, pq, ps, px, py, 1, VOCAB, HIDDEN)
    y = _d2h(cuda, py, 2 * VOCAB).view(BF16).reshape(1, VOCAB)
    q32 = q.astype(np.float32)  # exact; the twin's own first step, done once for twin and bound
    twin = gemv_fp8w_ref(q32, s, x)
    q32 *= s[:, None]
    assert_dot_close(
        y, twin.astype(np.float64), dot_bound(abs_dot(x, q32), twin, HIDDEN, 2), "gemv_fp8w full head"
    )
    for p in (pq, ps, px, py):
        cuda.free(p)
