"""Host twins of the runtime kernels against float64 NumPy math, at awkward sizes (odd lengths,
lengths that are not a multiple of any block or vector width). These run in CI; the GPU tests
(test_gpu_kernels.py) then hold the PTX to these twins. Tolerances: see tests/kernel_util.py."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_util import abs_dot, assert_dot_close, dot_bound, download, poisoned, random_bf16, upload

from runtime.dtypes import BF16, FP8, FP8_MAX
from runtime.kernels.add_bf16 import add_bf16
from runtime.kernels.argmax_bf16 import argmax_bf16
from runtime.kernels.embed_gather_bf16 import embed_gather_bf16
from runtime.kernels.gemv_bf16 import MAX_M, gemv_bf16
from runtime.kernels.gemv_fp8w import gemv_fp8w
from runtime.kernels.quantize_fp8 import quantize_fp8
from runtime.kernels.read_xor import BLOCK as READ_BLOCK
from runtime.kernels.read_xor import read_xor, read_xor_ref
from runtime.kernels.rmsnorm import rmsnorm


@pytest.mark.parametrize("m,n,k", [(1, 37, 64), (3, 101, 29), (MAX_M, 19, 4101), (2, 1, 1)])
def test_gemv_bf16_twin_matches_float64(host, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    w = random_bf16(rng, (n, k))
    x = random_bf16(rng, (m, k), exp_lo=-2)
    pw, px, py = upload(host, w), upload(host, x), poisoned(host, m * n * 2)
    gemv_bf16(host, pw, px, py, m, n, k)
    y = download(host, py, BF16, (m, n))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert_dot_close(y, ref, dot_bound(abs_dot(x, w), ref, k), f"gemv_bf16 twin m={m} n={n} k={k}")
    for p in (pw, px, py):
        host.free(p)


def test_gemv_refuses_m_outside_range(host):
    p = host.alloc(64)
    for m in (0, MAX_M + 1):
        with pytest.raises(ValueError, match="m="):
            gemv_bf16(host, p, p, p, m, 1, 1)
    host.free(p)


@pytest.mark.parametrize("m,n,k", [(1, 33, 48), (2, 7, 37), (MAX_M, 21, 4096)])
def test_gemv_fp8w_twin_matches_float64(host, m, n, k):
    rng = np.random.default_rng(7 * m + n + k)
    w = random_bf16(rng, (n, k))
    x = random_bf16(rng, (m, k), exp_lo=-2)
    pw, pq, ps = upload(host, w), poisoned(host, n * k), poisoned(host, 4 * n)
    quantize_fp8(host, pw, pq, ps, n, k)
    px, py = upload(host, x), poisoned(host, m * n * 2)
    gemv_fp8w(host, pq, ps, px, py, m, n, k)
    q = download(host, pq, FP8, (n, k))
    s = download(host, ps, np.float32, n)
    y = download(host, py, BF16, (m, n))
    wd = q.astype(np.float64) * s.astype(np.float64)[:, None]
    ref = x.astype(np.float64) @ wd.T
    assert_dot_close(y, ref, dot_bound(abs_dot(x, wd), ref, k), f"gemv_fp8w twin m={m} n={n} k={k}")
    # The quantised weights themselves stay within half an FP8 ulp (2**-4 relative) of the input.
    err = np.abs(wd - w.astype(np.float64))
    assert (err <= 2.0**-4 * np.abs(w.astype(np.float64)) + s[:, None] * 2.0**-10).all()
    for p in (pw, pq, ps, px, py):
        host.free(p)


def test_quantize_fp8_rows_scale_zero_row_and_saturation(host):
    rng = np.random.default_rng(3)
    n, k = 5, 37
    x = random_bf16(rng, (n, k)).astype(np.float32)
    x[1] = 0.0  # all-zero row: scale 1, q 0
    x[2, 5] = 3.0e38  # huge: its own row's absmax, so the row saturates nowhere but must not overflow
    x[3] = -x[3]
    xb = x.astype(BF16)
    px, pq, ps = upload(host, xb), poisoned(host, n * k), poisoned(host, 4 * n)
    quantize_fp8(host, px, pq, ps, n, k)
    q = download(host, pq, FP8, (n, k)).astype(np.float64)
    s = download(host, ps, np.float32, n).astype(np.float64)
    x64 = xb.astype(np.float64)
    amax = np.abs(x64).max(axis=1)
    np.testing.assert_allclose(s, np.where(amax > 0, amax / FP8_MAX, 1.0), rtol=2.0**-23)
    assert s[1] == 1.0 and (q[1] == 0).all()
    assert not np.isnan(q).any() and np.abs(q).max() <= FP8_MAX
    assert (np.abs(q).max(axis=1)[amax > 0] == FP8_MAX).all()  # the absmax element maps to 448
    # half an FP8 ulp (3 mantissa bits: 2**-4 relative) plus the subnormal step 2**-9 * 2**-1
    assert (np.abs(q * s[:, None] - x64) <= 2.0**-4 * np.abs(x64) + s[:, None] * 2.0**-10).all()
    for p in (px, pq, ps):
        host.free(p)


def test_fp8_cast_saturates_instead_of_nan():
    """ml_dtypes turns |x| >= 465 into NaN (it does not saturate); the runtime's conversion clips."""
    from runtime.dtypes import to_fp8_saturating

    v = np.array([448.0, 460.0, 500.0, -1e6], np.float32)
    assert np.isnan(v.astype(FP8).astype(np.float32)).any()
    np.testing.assert_array_equal(to_fp8_saturating(v).astype(np.float32), [448, 448, 448, -448])


@pytest.mark.parametrize("n", [1, 7, 1001])
def test_argmax_twin(host, n):
    rng = np.random.default_rng(n)
    x = random_bf16(rng, n).astype(np.float32)
    pidx, pval = poisoned(host, 4), poisoned(host, 4)

    def run(v: np.ndarray) -> tuple[int, float]:
        px = upload(host, v.astype(BF16))
        argmax_bf16(host, px, pidx, pval, len(v))
        host.free(px)
        return int(download(host, pidx, np.uint32, 1)[0]), float(download(host, pval, np.float32, 1)[0])

    i, val = run(x)
    assert i == int(np.argmax(x)) and val == x.max()
    if n > 2:
        # ties: the lowest index wins
        y = x.copy()
        y[[n // 3, n - 1]] = 2.0**10
        assert run(y) == (n // 3, 1024.0)
        # NaN never wins, wherever it is
        y[0] = np.nan
        y[n // 2] = np.nan
        assert run(y) == (n // 3, 1024.0)
        # -inf is a value: it wins over NaN
        z = np.full(n, np.nan, np.float32)
        z[n - 2] = -np.inf
        assert run(z) == (n - 2, -np.inf)
    # every element NaN: the lowest index (always a valid one), flagged by the NaN value
    i, val = run(np.full(n, np.nan, np.float32))
    assert i == 0 and np.isnan(val)
    host.free(pidx)
    host.free(pval)


def test_embed_gather_reads_token_from_device(host):
    rng = np.random.default_rng(5)
    vocab, k = 11, 37
    table = random_bf16(rng, (vocab, k))
    pt, ptok, po = upload(host, table), host.alloc(4), poisoned(host, 2 * k)
    for token in (0, 7, vocab - 1):
        host.copy_h2d(ptok, np.array([token], np.uint32))
        embed_gather_bf16(host, pt, ptok, po, vocab, k)
        assert download(host, po, BF16, k).tobytes() == table[token].tobytes()
    for token in (vocab, 2**32 - 1):
        host.copy_h2d(ptok, np.array([token], np.uint32))
        embed_gather_bf16(host, pt, ptok, po, vocab, k)
        assert (download(host, po, np.uint16, k) == 0xFFFF).all()
    for p in (pt, ptok, po):
        host.free(p)


@pytest.mark.parametrize("n", [1, 9, 2049])
def test_add_twin(host, n):
    rng = np.random.default_rng(n)
    a, b = random_bf16(rng, n), random_bf16(rng, n)
    pa, pb, po = upload(host, a), upload(host, b), poisoned(host, 2 * n)
    add_bf16(host, pa, pb, po, n)
    out = download(host, po, BF16, n).astype(np.float64)
    ref = a.astype(np.float64) + b.astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=2.0**-8, atol=0)  # one BF16 rounding of an exact sum
    for p in (pa, pb, po):
        host.free(p)


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 37), (2, 4104)])
def test_rmsnorm_twin_awkward_sizes(host, rows, n):
    rng = np.random.default_rng(rows * n)
    x, w = random_bf16(rng, (rows, n)), random_bf16(rng, n, exp_lo=-1)
    px, pw, po = upload(host, x), upload(host, w), poisoned(host, x.nbytes)
    rmsnorm(host, px, pw, po, rows, n, 1e-5)
    out = download(host, po, BF16, (rows, n)).astype(np.float64)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * w.astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=2.0**-7, atol=0)
    for p in (px, pw, po):
        host.free(p)


@pytest.mark.parametrize("n16,blocks", [(1, 1), (1, 4), (300, 1), (3 * 256 + 5, 2), (10_007, 3)])
def test_read_xor_twin_is_the_per_block_xor_of_its_words(host, n16, blocks):
    """The twin against a plain loop over the kernel's word assignment (word i to block
    (i // BLOCK) % blocks), through the host backend with the output poisoned."""
    rng = np.random.default_rng()
    words = rng.integers(0, 2**32, size=4 * n16, dtype=np.uint32)
    expect = [0] * blocks
    for i in range(n16):
        w = words[4 * i : 4 * i + 4]
        expect[(i // READ_BLOCK) % blocks] ^= int(w[0] ^ w[1] ^ w[2] ^ w[3])
    assert read_xor_ref(words, blocks).tolist() == expect
    src, out = upload(host, words), poisoned(host, 4 * blocks)
    read_xor(host, src, 16 * n16, out, blocks)
    assert download(host, out, np.uint32, blocks).tolist() == expect


def test_read_xor_refuses_what_it_cannot_read(host):
    src, out = upload(host, np.zeros(64, np.uint32)), poisoned(host, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        read_xor(host, src, 24, out, 1)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        read_xor(host, src.offset(4), 16, out, 1)
    with pytest.raises(ValueError, match="blocks=0"):
        read_xor(host, src, 16, out, 0)
    with pytest.raises(ValueError, match="src holds 256 bytes, 272 asked"):
        read_xor(host, src, 272, out, 1)
    with pytest.raises(ValueError, match="2 partials need 8"):
        read_xor(host, src, 16, out, 2)
    assert (download(host, out, np.uint32, 1) == 0xFFFFFFFF).all()  # nothing launched
