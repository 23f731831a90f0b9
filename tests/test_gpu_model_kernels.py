"""The drafter's PTX kernels (model/kernels/*) against their host twins on fresh random data:
awkward sizes (odd dims, row counts that are not a multiple of the block or the 16-byte vector,
misaligned pointers for the element-wise paths) and the full GLM-5.3-Flash shapes (hidden 4096,
288 experts x 2048, 64 heads x 512 latent, 154880-row head, 4096- and 16000-row contexts with
kpool 4 for the scores, the selection and the attention).

Every buffer is poisoned (0xFF: NaN in BF16/F32/FP8) before the launch, on both backends, with 16
guard bytes after it: an element the kernel should write and did not shows as NaN, an element it
should not write must still be poison, and the guards must be intact.

Tolerances (kernel_util.py has the GEMV bound):
- exact: the selection (ids, rows, counts), sum_rows_residual, gate copies, routing with equal
  scores, the argmax key and commit, the draft token of the fused head (against the argmax of the
  device's own logits);
- GEMVs: ``dot_bound(..., roundings=2)`` (one BF16 rounding on each side plus the f32
  accumulation bound k * 2**-24 * sum|x w|); f32 outputs: the accumulation bound alone;
- row norms and LayerNorm: one BF16 ulp (2**-7 relative) plus 2**-12 of the row's largest value
  (sums of squares are added in another order, which can move a rounding);
- FP8 rows: one E4M3 step (2**-3 relative) plus the subnormal step (2**-9 of the row scale), and at
  least 98% of the bytes identical (a wrong formula would move most of them);
- attention: 2**-7 relative plus 2**-9 of the head's largest output (BF16 output on both sides;
  the split kernels carry q and p as BF16 hi/lo pairs, ~2**-16 relative, far below that).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from kernel_util import abs_dot, assert_dot_close, dot_bound, random_bf16

from model.kernels import bgemv as bg
from model.kernels import draft_head, dsa_cache, dsa_select, moe, sparse_mla
from model.kernels.dsa_select import TOPK_MAX_POOLS, select_rows_ref
from model.kernels.mtp_input import HIDDEN_NONFINITE, TOKEN_OUTSIDE, mtp_embed_norm, mtp_input_gemv
from runtime.dtypes import BF16, FP8, quantize_rows_fp8
from runtime.host_backend import HostBackend
from runtime.kernels.rmsnorm import rmsnorm_ref

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN = 154880, 4096
GUARD = 16


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    leaked = gpu.stats().live_allocations
    gpu.close()
    assert leaked == 0, f"{leaked} device allocations leaked by test_gpu_model_kernels"


# ---- running one launch on both backends --------------------------------------------------------


def run_on(
    gpu, fn: Callable[..., None], bufs: dict[str, np.ndarray | int], misalign: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Allocate every buffer with GUARD bytes after it, poison it all (0xFF), upload the arrays
    (ints are output sizes in bytes), call ``fn(gpu, **pointers)``, return every buffer's bytes
    (guards included). ``misalign`` shifts the named buffers off 16-byte alignment."""
    misalign = misalign or {}
    ptrs, allocs, sizes = {}, [], {}
    for name, v in bufs.items():
        nbytes = v.nbytes if isinstance(v, np.ndarray) else int(v)
        off = misalign.get(name, 0)
        base = gpu.alloc(nbytes + off + GUARD)
        allocs.append(base)
        gpu.memset(base, 0xFF, nbytes + off + GUARD)
        ptrs[name] = base.offset(off)
        sizes[name] = nbytes
        if isinstance(v, np.ndarray) and v.nbytes:
            gpu.copy_h2d(ptrs[name], np.ascontiguousarray(v))
    try:
        fn(gpu, **ptrs)
        out = {}
        for name, p in ptrs.items():
            buf = np.empty(sizes[name] + GUARD, np.uint8)
            gpu.copy_d2h(buf, p)
            out[name] = buf
    finally:
        for p in allocs:
            gpu.free(p)
    for name, buf in out.items():
        assert (buf[-GUARD:] == 0xFF).all(), f"{name}: the kernel wrote past the end of the buffer"
        out[name] = buf[:-GUARD]
    return out


def both(cuda, fn, bufs, misalign=None):
    return run_on(cuda, fn, bufs, misalign), run_on(HostBackend(), fn, bufs, misalign)


def as_(buf: np.ndarray, dtype, shape=None) -> np.ndarray:
    a = buf.view(dtype)
    return a.reshape(shape) if shape is not None else a


def assert_close(g, h, rtol: float, atol: float, what: str) -> None:
    g64, h64 = np.asarray(g, np.float64), np.asarray(h, np.float64)
    assert not np.isnan(g64).any(), f"{what}: {int(np.isnan(g64).sum())} NaN (unwritten?) elements"
    assert not np.isnan(h64).any(), f"{what}: the host twin produced NaN"
    err = np.abs(g64 - h64)
    bad = err > rtol * np.abs(h64) + atol
    if bad.any():
        i = np.unravel_index(int(np.argmax(err - rtol * np.abs(h64))), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} outside rtol {rtol} atol {atol}; "
            f"worst at {i}: gpu {g64[i]!r} host {h64[i]!r}"
        )


def assert_fp8_rows_close(gq: np.ndarray, gs: np.ndarray, hq: np.ndarray, hs: np.ndarray, what: str) -> None:
    """FP8 rows with one scale each: dequantised within one E4M3 step, most bytes identical."""
    gs, hs = np.asarray(gs, np.float32), np.asarray(hs, np.float32)
    assert not np.isnan(gs).any(), f"{what}: NaN (unwritten) scales"
    assert_close(gs, hs, 2.0**-7, 0.0, f"{what} scales")
    gd = gq.view(FP8).astype(np.float64) * gs[:, None]
    hd = hq.view(FP8).astype(np.float64) * hs[:, None]
    assert_close(gd, hd, 2.0**-3, float(hs.max()) * 2.0**-9, f"{what} values")
    same = float((gq.view(np.uint8) == hq.view(np.uint8)).mean())
    assert same >= 0.98, f"{what}: only {same:.3f} of the FP8 bytes equal the twin's"


def rows_close_bf16(g: np.ndarray, h: np.ndarray, what: str) -> None:
    g32, h32 = g.astype(np.float32), h.astype(np.float32)
    assert_close(g32, h32, 2.0**-7, float(np.abs(h32).max()) * 2.0**-12, what)


def fp8_rows(rng, n: int, dim: int, spread: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((n, dim)).astype(np.float32) * spread
    q, s = quantize_rows_fp8(x)
    return q, s


# ---- mtp_input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("h,mis", [(HIDDEN, 0), (37, 0), (4104, 0), (HIDDEN, 2)])
def test_mtp_embed_norm(cuda, h, mis):
    rng = np.random.default_rng()
    vocab, rows = 1001, 4
    tokens = np.array([rng.integers(0, vocab), vocab - 1, vocab, 2**32 - 1], np.uint32)
    bufs = {
        "table": random_bf16(rng, (vocab, h)),
        "tokens": tokens,
        "enorm": random_bf16(rng, h, exp_lo=-1),
        "hidden": random_bf16(rng, (rows, h)),
        "hnorm": random_bf16(rng, h, exp_lo=-1),
        "out": rows * 2 * h * 2,
    }
    g, hh = both(
        cuda,
        lambda gpu, table, tokens, enorm, hidden, hnorm, out: mtp_embed_norm(
            gpu, table, tokens, enorm, hidden, hnorm, out, rows, vocab, h, 1e-5
        ),
        bufs,
        {"hidden": mis},
    )
    go, ho = as_(g["out"], BF16, (rows, 2 * h)), as_(hh["out"], BF16, (rows, 2 * h))
    rows_close_bf16(go[:2], ho[:2], "mtp_embed_norm valid tokens")
    rows_close_bf16(go[2:, h:], ho[2:, h:], "mtp_embed_norm hidden half")
    assert np.isnan(go[2:, :h].astype(np.float32)).all(), "a token >= vocab must give a NaN half-row"


def _norm_gemv_bound(xn: np.ndarray, w: np.ndarray, ref: np.ndarray, k: int) -> np.ndarray:
    """dot_bound of the GEMV plus one BF16 ulp (2**-7 relative) on every normalised input element,
    which the device's norm (another summation order) may round the other way."""
    absd = abs_dot(xn[None], w)[0]
    return dot_bound(absd, ref, k, roundings=2) + 2.0**-7 * absd


@pytest.mark.parametrize(
    "n,h,token",
    [(HIDDEN, HIDDEN, 5), (37, 40, 3), (19, 37, 1000), (33, 64, 2**32 - 1), (5000, 64, 7), (20000, 40, 11)],
)
def test_mtp_input_gemv(cuda, n, h, token):
    """eh_proj @ [norm(embed[t]) ; norm(hidden)] in one launch (the proposer's draft input). The
    last two shapes give a warp two rows, and four rows in a grid of more than one wave."""
    rng = np.random.default_rng()
    vocab = 1000
    bufs = {
        "table": random_bf16(rng, (vocab, h)),
        "tok": np.array([token], np.uint32),
        "enorm": random_bf16(rng, h, exp_lo=-1),
        "hidden": random_bf16(rng, h),
        "hnorm": random_bf16(rng, h, exp_lo=-1),
        "w": random_bf16(rng, (n, 2 * h), exp_lo=-8),
        "y": 2 * n,
        "flag": np.zeros(4, np.uint8),
    }
    g, hh = both(
        cuda,
        lambda gpu, table, tok, enorm, hidden, hnorm, w, y, flag: mtp_input_gemv(
            gpu, table, tok, enorm, hidden, hnorm, w, y, vocab, h, n, 1e-5, flag=flag
        ),
        bufs,
    )
    gy, hy = as_(g["y"], BF16), as_(hh["y"], BF16)
    assert g["flag"].tobytes() == hh["flag"].tobytes()
    if token >= vocab:
        assert np.isnan(gy.astype(np.float32)).all(), (
            "an out-of-vocabulary token gives NaN, never a read past the table"
        )
        assert g["flag"].tolist() == [TOKEN_OUTSIDE, 0, 0, 0], "and raises the flag"
        return
    assert not g["flag"].any(), "finite inputs raise no flag"
    xn = np.concatenate(
        [
            rmsnorm_ref(bufs["table"][token], bufs["enorm"], 1e-5),
            rmsnorm_ref(bufs["hidden"], bufs["hnorm"], 1e-5),
        ]
    )
    ref = hy.astype(np.float64)
    assert_dot_close(gy, ref, _norm_gemv_bound(xn, bufs["w"], ref, 2 * h), f"mtp_input_gemv n={n} h={h}")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("h,mis", [(HIDDEN, 0), (37, 0), (HIDDEN, 2)])
def test_mtp_input_gemv_flags_a_nonfinite_hidden(cuda, bad, h, mis):
    """One NaN or Inf in the hidden row raises HIDDEN_NONFINITE (vector and scalar norm paths),
    as the twin does; the output is NaN on both (the row is unusable, the flag says so)."""
    rng = np.random.default_rng()
    vocab, n = 1000, 300
    hidden = random_bf16(rng, h)
    hidden[int(rng.integers(h))] = bad
    bufs = {
        "table": random_bf16(rng, (vocab, h)),
        "tok": np.array([7], np.uint32),
        "enorm": random_bf16(rng, h, exp_lo=-1),
        "hidden": hidden,
        "hnorm": random_bf16(rng, h, exp_lo=-1),
        "w": random_bf16(rng, (n, 2 * h), exp_lo=-8),
        "y": 2 * n,
        "flag": np.zeros(4, np.uint8),
    }
    g, hh = both(
        cuda,
        lambda gpu, table, tok, enorm, hidden, hnorm, w, y, flag: mtp_input_gemv(
            gpu, table, tok, enorm, hidden, hnorm, w, y, vocab, h, n, 1e-5, flag=flag
        ),
        bufs,
        {"hidden": mis},
    )
    assert g["flag"].tolist() == hh["flag"].tolist() == [HIDDEN_NONFINITE, 0, 0, 0]
    assert np.isnan(as_(g["y"], BF16).astype(np.float32)).all()
    assert np.isnan(as_(hh["y"], BF16).astype(np.float32)).all()


@pytest.mark.parametrize("beside", [False, True], ids=["wait", "beside"])
@pytest.mark.parametrize("n,k,mis", [(2336, HIDDEN, 0), (20480, 1536, 0), (37, 29, 0), (100, 48, 2)])
def test_rmsnorm_gemv(cuda, n, k, mis, beside):
    """fused_in (2336 x 4096) and q_fused (20480 x 1536) with their input norms as the prologue;
    the beside variant computes the same (it differs only in where it waits)."""
    rng = np.random.default_rng()
    x, nw, w = random_bf16(rng, k), random_bf16(rng, k, exp_lo=-1), random_bf16(rng, (n, k), exp_lo=-8)
    g, h = both(
        cuda,
        lambda gpu, x, nw, w, y: bg.rmsnorm_gemv(gpu, x, nw, w, y, n, k, 1e-5, beside=beside),
        {"x": x, "nw": nw, "w": w, "y": 2 * n},
        {"x": mis},
    )
    ref = as_(h["y"], BF16).astype(np.float64)
    xn = rmsnorm_ref(x, nw, 1e-5)
    assert_dot_close(as_(g["y"], BF16), ref, _norm_gemv_bound(xn, w, ref, k), f"rmsnorm_gemv n={n} k={k}")


# ---- bgemv ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch,n,k,mis",
    [
        (64, 512, 256, 0),  # wk_t: 64 heads, kv_lora 512 x nope 256
        (64, 256, 512, 0),  # wv
        (8, 4096, 2048, 0),  # o_proj in 8 head groups
        (3, 37, 29, 0),  # k % 8 != 0: element-wise path
        (5, 33, 24, 2),  # misaligned x: element-wise path
        (2, 1, 8, 0),
    ],
)
@pytest.mark.parametrize("out_f32", [True, False])
def test_bgemv(cuda, batch, n, k, mis, out_f32):
    rng = np.random.default_rng()
    w, x = random_bf16(rng, (batch, n, k)), random_bf16(rng, (batch, k), exp_lo=-2)
    isz = 4 if out_f32 else 2
    g, h = both(
        cuda,
        lambda gpu, w, x, y: bg.bgemv(gpu, w, x, y, batch, n, k, out_f32=out_f32),
        {"w": w, "x": x, "y": batch * n * isz},
        {"x": mis},
    )
    dt = np.float32 if out_f32 else BF16
    gy, hy = as_(g["y"], dt, (batch, n)), as_(h["y"], dt, (batch, n))
    absd = np.stack([abs_dot(x[b : b + 1], w[b])[0] for b in range(batch)])
    ref = hy.astype(np.float64)
    if out_f32:
        bound = 2.0 * 2 * k * 2.0**-24 * absd + 1e-30
        assert_dot_close(gy, ref, bound, f"bgemv f32 {batch}x{n}x{k}")
    else:
        assert_dot_close(gy, ref, dot_bound(absd, ref, k, roundings=2), f"bgemv bf16 {batch}x{n}x{k}")


@pytest.mark.parametrize("rows,n", [(8, HIDDEN), (9, HIDDEN), (1, 37), (3, 1000)])
def test_sum_rows_residual_bit_exact(cuda, rows, n):
    rng = np.random.default_rng()
    parts = rng.standard_normal((rows, n)).astype(np.float32)
    res = random_bf16(rng, n, exp_lo=-1)
    g, h = both(
        cuda,
        lambda gpu, parts, res, out: bg.sum_rows_residual(gpu, parts, res, out, rows, n),
        {"parts": parts, "res": res, "out": 2 * n},
    )
    assert g["out"].tobytes() == h["out"].tobytes()
    assert not np.isnan(as_(g["out"], BF16).astype(np.float32)).any()


@pytest.mark.parametrize("rows,n", [(8, HIDDEN), (9, HIDDEN), (1, 37), (2, 4104)])
def test_sum_rows_residual_rmsnorm(cuda, rows, n):
    rng = np.random.default_rng()
    parts = rng.standard_normal((rows, n)).astype(np.float32)
    bufs = {
        "parts": parts,
        "res": random_bf16(rng, n, exp_lo=-1),
        "w": random_bf16(rng, n, exp_lo=-1),
        "out": 2 * n,
        "normed": 2 * n,
    }
    g, h = both(
        cuda,
        lambda gpu, parts, res, w, out, normed: bg.sum_rows_residual_rmsnorm(
            gpu, parts, res, w, out, normed, rows, n, 1e-5
        ),
        bufs,
    )
    assert g["out"].tobytes() == h["out"].tobytes(), "the residual sum must be bit-exact"
    rows_close_bf16(as_(g["normed"], BF16), as_(h["normed"], BF16), "sum_rows_residual_rmsnorm normed")


# ---- dsa_cache -----------------------------------------------------------------------------------


def _cache_case(rng, *, C: int, idim: int, kpool: int, rows: int, base: int, bs: int = 16):
    """Fused projection rows, norms, a shuffled block table, and caches that already hold the rows
    below ``base`` (the pools the new rows complete read them)."""
    stride = C + 2 * idim + 7  # the fused output has more rows than the cache writes read
    total = base + rows
    nblocks = -(-total // bs) + 3
    table = rng.permutation(nblocks).astype(np.uint32)
    keys = random_bf16(rng, (total, idim), exp_lo=-1)
    gates = random_bf16(rng, (total, idim), exp_lo=-1)
    return (
        {
            "fused": random_bf16(rng, (rows, stride), exp_lo=-2),
            "kv_w": random_bf16(rng, C, exp_lo=-1),
            "cache": nblocks * bs * C,
            "scales": nblocks * bs * 4,
            "table": table,
            "kw": random_bf16(rng, idim, exp_lo=-1),
            "kb": random_bf16(rng, idim, exp_lo=-4),
            "keys": keys,
            "gates": gates,
            "ape": random_bf16(rng, (kpool, idim), exp_lo=-1),
            "pkeys": (total // kpool + 1) * idim,
            "pscales": (total // kpool + 1) * 4,
            "row": np.array([base - 2], np.uint32),  # row_add = 2 below
        },
        stride,
        nblocks,
    )


def _check_caches(g, h, *, C, idim, kpool, rows, base, bs, nblocks, table):
    total = base + rows
    slots = np.array([int(table[r // bs]) * bs + r % bs for r in range(base, total)])
    gc, hc = as_(g["cache"], np.uint8, (nblocks * bs, C)), as_(h["cache"], np.uint8, (nblocks * bs, C))
    gsc, hsc = as_(g["scales"], np.float32), as_(h["scales"], np.float32)
    assert_fp8_rows_close(gc[slots], gsc[slots], hc[slots], hsc[slots], "latent rows")
    others = np.setdiff1d(np.arange(nblocks * bs), slots)
    assert (gc[others] == 0xFF).all() and np.isnan(gsc[others]).all(), "latent written outside its slots"
    gk, hk = as_(g["keys"], BF16, (total, idim)), as_(h["keys"], BF16, (total, idim))
    assert gk[:base].tobytes() == hk[:base].tobytes(), "keys of earlier rows changed"
    rows_close_bf16(gk[base:], hk[base:], "indexer keys")
    assert g["gates"].tobytes() == h["gates"].tobytes(), "gates are a copy"
    done = [r // kpool for r in range(base, total) if (r + 1) % kpool == 0]
    gp, hp = as_(g["pkeys"], np.uint8, (-1, idim)), as_(h["pkeys"], np.uint8, (-1, idim))
    gps, hps = as_(g["pscales"], np.float32), as_(h["pscales"], np.float32)
    if done:
        assert_fp8_rows_close(gp[done], gps[done], hp[done], hps[done], "pool keys")
    rest = np.setdiff1d(np.arange(gp.shape[0]), done)
    assert (gp[rest] == 0xFF).all() and np.isnan(gps[rest]).all(), "a pool key written that no row completed"
    return len(done)


@pytest.mark.parametrize(
    "C,idim,kpool,rows,base",
    [
        (512, 128, 4, 1, 4095),  # the draft row completes pool 1023
        (512, 128, 4, 1, 4094),  # no pool completes
        (512, 128, 4, 8, 15998),  # a context chunk: pools complete inside the launch and across it
        (32, 16, 2, 5, 6),  # tiny config
        (40, 20, 3, 7, 5),  # odd kpool, dims not multiples of 16
    ],
)
def test_dsa_cache_write_and_its_three_parts(cuda, C, idim, kpool, rows, base):
    rng = np.random.default_rng()
    bs = 16
    bufs, stride, nblocks = _cache_case(rng, C=C, idim=idim, kpool=kpool, rows=rows, base=base, bs=bs)

    def fused(gpu, fused, kv_w, cache, scales, table, kw, kb, keys, gates, ape, pkeys, pscales, row):
        dsa_cache.dsa_cache_write(
            gpu,
            fused,
            stride,
            kv_w,
            cache,
            scales,
            table,
            kw,
            kb,
            keys,
            gates,
            ape,
            pkeys,
            pscales,
            row,
            2,
            rows,
            C,
            idim,
            bs,
            kpool,
            1e-5,
            1e-6,
        )

    def three(gpu, fused, kv_w, cache, scales, table, kw, kb, keys, gates, ape, pkeys, pscales, row):
        dsa_cache.latent_write_fp8(gpu, fused, stride, kv_w, cache, scales, table, row, 2, rows, C, bs, 1e-5)
        dsa_cache.indexer_write_keys(
            gpu, fused.offset(C * 2), stride, kw, kb, keys, gates, row, 2, rows, idim, 1e-6
        )
        dsa_cache.indexer_compress_pools(gpu, keys, gates, ape, pkeys, pscales, row, 2, rows, idim, kpool)

    kw = dict(C=C, idim=idim, kpool=kpool, rows=rows, base=base, bs=bs, nblocks=nblocks, table=bufs["table"])
    g, h = both(cuda, fused, bufs)
    pools = _check_caches(g, h, **kw)
    g3, h3 = both(cuda, three, bufs)
    _check_caches(g3, h3, **kw)
    if pools:
        # The fused kernel recomputes in-launch slots instead of reading them back: same bits.
        assert g["pkeys"].tobytes() == g3["pkeys"].tobytes()
    assert g["cache"].tobytes() == g3["cache"].tobytes() and g["keys"].tobytes() == g3["keys"].tobytes()


# ---- dsa_select ----------------------------------------------------------------------------------


def _scores_case(rng, heads: int, dim: int, npools_cap: int):
    q = random_bf16(rng, (heads, dim), exp_lo=-3)
    w = random_bf16(rng, heads, exp_lo=-2)
    pk, ps = fp8_rows(rng, npools_cap, dim)
    return q, w, pk, ps


@pytest.mark.parametrize(
    "heads,dim,kpool,row,cap",
    [
        (32, 128, 4, 4095, 4096 // 4),  # context 4096: 1024 pools
        (32, 128, 4, 16000, 16384 // 4),  # context 16000 (+1 row): 4000 pools, grid-stride
        (32, 128, 4, 2, 64),  # no complete pool: nothing written
        (3, 20, 3, 100, 40),  # odd heads, dim % 4 == 0
        (5, 18, 2, 77, 40),  # dim % 4 != 0: scalar dot
        (40, 16, 2, 63, 40),  # more heads than lanes
    ],
)
def test_indexer_scores(cuda, heads, dim, kpool, row, cap):
    rng = np.random.default_rng()
    q, w, pk, ps = _scores_case(rng, heads, dim, cap)
    ws = 1.0 / heads**0.5
    g, h = both(
        cuda,
        lambda gpu, q, w, pk, ps, out, rowp: dsa_select.indexer_scores(
            gpu, q, w, pk, ps, out, rowp, 1, heads, dim, kpool, ws, cap
        ),
        {"q": q, "w": w, "pk": pk, "ps": ps, "out": cap * 4, "rowp": np.array([row - 1], np.uint32)},
    )
    npools = (row + 1) // kpool
    gs, hs = as_(g["out"], np.float32), as_(h["out"], np.float32)
    assert np.isnan(gs[npools:]).all(), "scores past the complete pools must not be written"
    if npools:
        keys = pk[:npools].view(FP8).astype(np.float64) * ps[:npools, None]
        mag = (np.abs(w.astype(np.float64)) * ws) @ np.abs(q.astype(np.float64) @ keys.T) / np.sqrt(dim)
        absmag = (np.abs(w.astype(np.float64)) * ws) @ (np.abs(q.astype(np.float64)) @ np.abs(keys).T)
        bound = 4 * dim * 2.0**-24 * absmag / np.sqrt(dim) + 1e-6 * mag + 1e-30
        assert_dot_close(gs[:npools], hs[:npools].astype(np.float64), bound, "indexer_scores")


def _select(cuda_or_host, scores, row, topk, kpool, cap_rows, tail=True):
    add = min(row, 3)  # the row is *row_ptr + row_add
    return run_on(
        cuda_or_host,
        lambda gpu, sc, sel, cnt, rowp: dsa_select.select_topk_pools(
            gpu, sc, sel, cnt, rowp, add, topk, kpool, tail
        ),
        {"sc": scores, "sel": max(cap_rows, 1) * 4, "cnt": 4, "rowp": np.array([row - add], np.uint32)},
    )


@pytest.mark.parametrize(
    "row,topk,kpool,kind",
    [
        (4095, 512, 4, "random"),  # context 4096: 1024 pools, no tail
        (15999, 512, 4, "random"),  # context 16000: 4000 pools
        (16001, 512, 4, "ties"),  # 4000 pools, a 2-row tail, heavy ties across the cut
        (4 * TOPK_MAX_POOLS - 1, 512, 4, "random"),  # the kernel's capacity
        (2047, 512, 4, "random"),  # 512 pools: dense
        (2050, 512, 4, "random"),  # 512 complete pools + tail: still dense
        (2051, 512, 4, "specials"),  # 513 pools: -0/+0, NaN, -inf
        (60, 8, 3, "ties"),  # odd kpool, small top-k
        (999, 1, 2, "ties"),  # top-1
        (3, 4, 4, "random"),  # the first row that completes a pool (no tail either way)
    ],
)
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
def test_select_topk_pools_exact(cuda, row, topk, kpool, kind, tail):
    rng = np.random.default_rng()
    npools = (row + 1) // kpool
    n = max(npools, 1)
    if kind == "random":
        scores = rng.standard_normal(n).astype(np.float32)
    elif kind == "ties":
        scores = rng.integers(-3, 4, n).astype(np.float32)  # 7 values: the cut falls in a tie
    else:
        scores = rng.standard_normal(n).astype(np.float32)
        scores[rng.choice(n, n // 4, replace=False)] = 0.0
        scores[rng.choice(n, n // 8, replace=False)] = -0.0
        scores[rng.choice(n, 5, replace=False)] = np.nan
        scores[rng.choice(n, 5, replace=False)] = -np.inf
    cap = min(row + 1, topk * kpool + kpool - 1)
    g = _select(cuda, scores, row, topk, kpool, cap, tail)
    h = _select(HostBackend(), scores, row, topk, kpool, cap, tail)
    ref = select_rows_ref(scores, row, topk, kpool, tail)
    cnt = int(as_(g["cnt"], np.uint32)[0])
    assert cnt == ref.size == int(as_(h["cnt"], np.uint32)[0])
    np.testing.assert_array_equal(as_(g["sel"], np.uint32)[:cnt], ref)
    assert g["sel"].tobytes() == h["sel"].tobytes()


@pytest.mark.parametrize("row", [0, 2])
def test_select_without_tail_before_the_first_pool_is_empty(cuda, row):
    """index_kpool_always_select_tail false: a row before its first complete pool selects
    nothing (count 0, the list untouched)."""
    g = _select(cuda, np.zeros(1, np.float32), row, 8, 4, 8, tail=False)
    h = _select(HostBackend(), np.zeros(1, np.float32), row, 8, 4, 8, tail=False)
    assert int(as_(g["cnt"], np.uint32)[0]) == 0 == int(as_(h["cnt"], np.uint32)[0])
    assert g["sel"].tobytes() == h["sel"].tobytes()


def test_extend_selection_appends_the_row(cuda):
    """Drafts 2..k of a shared selection (index_share_for_mtp_iteration) append their own row."""
    sel = np.zeros(12, np.uint32)
    sel[:5] = [4, 5, 6, 7, 9]

    def run(gpu, sel, cnt, rowp):
        dsa_select.extend_selection(gpu, sel, cnt, rowp, 1)
        dsa_select.extend_selection(gpu, sel, cnt, rowp, 2)

    g, h = both(cuda, run, {"sel": sel, "cnt": np.array([5], np.uint32), "rowp": np.array([9], np.uint32)})
    assert as_(g["cnt"], np.uint32)[0] == 7 == as_(h["cnt"], np.uint32)[0]
    np.testing.assert_array_equal(as_(g["sel"], np.uint32)[:7], [4, 5, 6, 7, 9, 10, 11])
    assert g["sel"].tobytes() == h["sel"].tobytes()


# ---- sparse_mla ----------------------------------------------------------------------------------


def _attn_case(rng, heads: int, dim: int, count: int, context: int, bs: int = 16):
    nblocks = -(-context // bs) + 2
    table = rng.permutation(nblocks).astype(np.uint32)
    rows = np.sort(rng.choice(context, count, replace=False)).astype(np.uint32)
    lat = rng.standard_normal((nblocks * bs, dim)).astype(np.float32)
    cq, cs = quantize_rows_fp8(lat)
    q = (rng.standard_normal((heads, dim)) * 0.2).astype(np.float32)
    return {
        "q": q,
        "cache": cq,
        "scales": cs,
        "table": table,
        "sel": rows,
        "cnt": np.array([count], np.uint32),
    }


ATTN_CASES = [
    (64, 512, 2051, 16000),  # topk 2048 + 3 tail rows of a 16000-row context
    (64, 512, 2048, 4096),  # context 4096, full pools only
    (64, 512, 64, 4096),  # exactly one split
    (64, 512, 65, 100),  # one split and one row
    (4, 32, 37, 200),  # tiny config: heads below a tile
    (20, 48, 1, 10),  # one row; 20 heads = a tile and a partial tile
]


@pytest.mark.parametrize("heads,dim,count,context", ATTN_CASES)
def test_sparse_mla_attend(cuda, heads, dim, count, context):
    rng = np.random.default_rng()
    bufs = _attn_case(rng, heads, dim, count, context)
    bufs["out"] = heads * dim * 2
    scale = 1.0 / 16.0
    g, h = both(
        cuda,
        lambda gpu, q, cache, scales, table, sel, cnt, out: sparse_mla.sparse_mla_attend(
            gpu, q, cache, scales, table, sel, cnt, out, heads, dim, 16, scale
        ),
        bufs,
    )
    go, ho = (
        as_(g["out"], BF16, (heads, dim)).astype(np.float32),
        as_(h["out"], BF16, (heads, dim)).astype(np.float32),
    )
    assert_close(go, ho, 2.0**-7, float(np.abs(ho).max()) * 2.0**-9, "sparse_mla_attend")


@pytest.mark.parametrize("heads,dim", [(64, 512), (4, 32)])
def test_sparse_mla_of_an_empty_selection_is_zero(cuda, heads, dim):
    """No selected row (no complete pool, tail not selected): both kernels output exact zeros."""
    rng = np.random.default_rng()
    bufs = _attn_case(rng, heads, dim, 1, 40)
    bufs["cnt"] = np.array([0], np.uint32)
    pb, mb = sparse_mla.split_workspace(heads, dim, 64)
    bufs.update(part=pb, ml=mb, out=heads * dim * 2)

    def attend(gpu, q, cache, scales, table, sel, cnt, part, ml, out):
        sparse_mla.sparse_mla_attend(gpu, q, cache, scales, table, sel, cnt, out, heads, dim, 16, 0.1)

    def split(gpu, q, cache, scales, table, sel, cnt, part, ml, out):
        sparse_mla.sparse_mla_split(
            gpu, q, cache, scales, table, sel, cnt, part, ml, out, heads, dim, 16, 0.1, 64
        )

    for fn in (attend,) + ((split,) if sparse_mla.split_supported(dim, 64) else ()):
        g, h = both(cuda, fn, bufs)
        assert not as_(g["out"], np.uint16).any() and not as_(h["out"], np.uint16).any(), fn.__name__


@pytest.mark.parametrize("heads,dim,count,context", ATTN_CASES)
def test_sparse_mla_split_pair(cuda, heads, dim, count, context):
    rng = np.random.default_rng()
    bufs = _attn_case(rng, heads, dim, count, context)
    cap = max(2051, count)
    pb, mb = sparse_mla.split_workspace(heads, dim, cap)
    bufs.update(part=pb, ml=mb, out=heads * dim * 2)
    scale = 1.0 / 16.0

    def split(gpu, q, cache, scales, table, sel, cnt, part, ml, out):
        sparse_mla.sparse_mla_split(
            gpu, q, cache, scales, table, sel, cnt, part, ml, out, heads, dim, 16, scale, cap
        )

    g, h = both(cuda, split, bufs)
    go = as_(g["out"], BF16, (heads, dim)).astype(np.float32)
    ho = as_(h["out"], BF16, (heads, dim)).astype(np.float32)
    assert_close(go, ho, 2.0**-7, float(np.abs(ho).max()) * 2.0**-9, "sparse_mla split pair")
    # Against float64 attention as well: the hi/lo BF16 products must not cost f32 accuracy.
    c = bufs["cache"].view(FP8).astype(np.float64) * bufs["scales"][:, None].astype(np.float64)
    rows = bufs["sel"]
    slots = bufs["table"][rows // 16].astype(np.int64) * 16 + rows % 16
    s = bufs["q"].astype(np.float64) @ c[slots].T * scale
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ c[slots]
    assert_close(go, ref, 2.0**-8, float(np.abs(ref).max()) * 2.0**-10, "split pair vs float64")
    splits = -(-count // sparse_mla.SPLIT_ROWS)
    gml = as_(g["ml"], np.float32, (-1, heads, 2))
    assert not np.isnan(gml[:splits]).any() and np.isnan(gml[splits:]).all(), "splits past the count ran"


# ---- moe -----------------------------------------------------------------------------------------


def test_router_scores_topk_and_fused(cuda):
    rng = np.random.default_rng()
    E, H, k = 288, HIDDEN, 8
    w = random_bf16(rng, (E, H), exp_lo=-12)  # no shared-expert gate row
    y = random_bf16(rng, H, exp_lo=-3)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    g, h = both(
        cuda, lambda gpu, w, y, s: moe.router_scores(gpu, w, y, s, E, H), {"w": w, "y": y, "s": E * 4}
    )
    gs, hs = as_(g["s"], np.float32), as_(h["s"], np.float32)
    absd = abs_dot(y[None], w)[0]
    # sigmoid' <= 1/4: the score moves by at most a quarter of the dot's error, plus f32 exp.
    assert_close(gs, hs, 2.0**-20, 0.25 * 2 * 2 * H * 2.0**-24 * float(absd.max()), "router_scores")

    # The top-k of identical scores is exact, weights included (NumPy's pairwise sum order).
    def topk(gpu, s, b, ids, wts):
        moe.router_topk(gpu, s, b, ids, wts, E, k, True, 2.5, True)

    gt, ht = both(cuda, topk, {"s": gs, "b": bias, "ids": (k + 1) * 4, "wts": (k + 1) * 4})
    assert gt["ids"].tobytes() == ht["ids"].tobytes() and gt["wts"].tobytes() == ht["wts"].tobytes()
    assert as_(gt["wts"], np.float32)[k] == 1.0, "the shared expert is added with weight 1"

    def fused(gpu, w, y, b, s, ids, wts, ctr):
        moe.router_fused(gpu, w, y, b, s, ids, wts, ctr, E, H, k, True, 2.5, True)

    zero = np.zeros(1, np.uint32)
    for _ in range(2):  # the counter the last block resets serves the next launch
        gf = run_on(
            cuda,
            fused,
            {"w": w, "y": y, "b": bias, "s": E * 4, "ids": (k + 1) * 4, "wts": (k + 1) * 4, "ctr": zero},
        )
        assert as_(gf["wts"], np.float32)[k] == 1.0, "the shared expert is added with weight 1"
        assert as_(gf["ctr"], np.uint32)[0] == 0, "router_fused must leave its counter at zero"
        assert_close(
            as_(gf["s"], np.float32),
            hs,
            2.0**-20,
            0.25 * 4 * H * 2.0**-24 * float(absd.max()),
            "router_fused scores",
        )
        # ids and weights are router_topk's of the device's own scores
        again = run_on(
            HostBackend(),
            topk,
            {"s": as_(gf["s"], np.float32), "b": bias, "ids": (k + 1) * 4, "wts": (k + 1) * 4},
        )
        assert gf["ids"].tobytes() == again["ids"].tobytes() and gf["wts"].tobytes() == again["wts"].tobytes()


@pytest.mark.parametrize("E,k,norm,shared", [(37, 5, True, False), (9, 9, False, True), (300, 8, True, True)])
def test_router_topk_ties_and_nan(cuda, E, k, norm, shared):
    rng = np.random.default_rng()
    s = (rng.integers(1, 5, E) / 8.0).astype(np.float32)  # few values: ties decide
    b = np.zeros(E, np.float32)
    b[rng.choice(E, 2, replace=False)] = np.nan
    g, h = both(
        cuda,
        lambda gpu, s, b, ids, wts: moe.router_topk(gpu, s, b, ids, wts, E, k, norm, 1.5, shared),
        {"s": s, "b": b, "ids": (k + 1) * 4, "wts": (k + 1) * 4},
    )
    assert g["ids"].tobytes() == h["ids"].tobytes() and g["wts"].tobytes() == h["wts"].tobytes()
    if shared:
        assert as_(g["wts"], np.float32)[k] == 1.0, "the shared expert is added with weight 1"


def _experts_case(rng, n_local: int, inter: int, h: int):
    y = random_bf16(rng, h, exp_lo=-1)
    gu = random_bf16(rng, (n_local, 2 * inter, h), exp_lo=-6)
    dn = random_bf16(rng, (n_local, h, inter), exp_lo=-6)
    return y, gu, dn


@pytest.mark.parametrize(
    "n_local,base,inter,h,ids",
    [
        (6, 0, 24, 64, [5, 0, 3, 3, 1]),  # tiny: every slot local
        (4, 4, 37, 45, [5, 1, 7, 4, 2, 9]),  # sharded: slots outside 4..7 are not this rank's
        (3, 0, 2048, HIDDEN, [2, 0, 1]),  # full-size rows
    ],
)
def test_expert_gate_up_and_down(cuda, n_local, base, inter, h, ids):
    rng = np.random.default_rng()
    y, gu, dn = _experts_case(rng, n_local, inter, h)
    ids_a = np.array(ids, np.uint32)
    ns = len(ids)
    wts = rng.random(ns).astype(np.float32) + 0.1
    limit = 0.5  # the clamp engages for part of the elements

    def run(gpu, gu, dn, y, ids, wts, act, parts):
        moe.expert_gate_up(gpu, gu, y, ids, act, 0, ns, base, n_local, inter, h, limit)
        moe.expert_down(gpu, dn, act, ids, wts, parts, 0, ns, base, n_local, h, inter)

    g, hh = both(
        cuda,
        run,
        {"gu": gu, "dn": dn, "y": y, "ids": ids_a, "wts": wts, "act": ns * inter * 2, "parts": ns * h * 4},
    )
    local = [(e - base) in range(n_local) for e in ids]
    ga, ha = as_(g["act"], BF16, (ns, inter)), as_(hh["act"], BF16, (ns, inter))
    gp, hp = as_(g["parts"], np.float32, (ns, h)), as_(hh["parts"], np.float32, (ns, h))
    for j, loc in enumerate(local):
        if not loc:
            assert np.isnan(ga[j].astype(np.float32)).all(), "act of a non-local slot must stay unwritten"
            assert (gp[j] == 0).all(), "parts of a non-local slot are zeros"
            continue
        e = ids[j] - base
        absd = abs_dot(y[None], gu[e])[0]
        # act = swiglu(g, u): |d act| <= (|u| |d silu| + |silu| |d u|), d silu <= 1.1 |d g|
        gref = gu[e].astype(np.float64) @ y.astype(np.float64)
        eb = 2 * 2 * h * 2.0**-24 * absd
        gg, uu = np.minimum(gref[:inter], limit), np.clip(gref[inter:], -limit, limit)
        tol = (
            1.1 * eb[:inter] * np.abs(uu)
            + np.abs(gg) * eb[inter:]
            + 2.0**-7 * np.abs(ha[j].astype(np.float64))
        )
        assert_dot_close(ga[j], ha[j].astype(np.float64), tol + 1e-30, f"gate_up slot {j}")
        a64 = ha[j].astype(np.float64)
        bound = 2 * 2 * inter * 2.0**-24 * wts[j] * abs_dot(ha[j][None], dn[e])[0] + 1e-30
        # The host's act is the reference input; the device's act may differ by one BF16 ulp.
        bound += wts[j] * np.abs(dn[e].astype(np.float64)) @ (2.0**-7 * np.abs(a64))
        assert_dot_close(gp[j], hp[j].astype(np.float64), bound, f"down slot {j}")


@pytest.mark.parametrize("shared", [moe.SHARED_NONE, moe.SHARED_HERE, moe.SHARED_ELSEWHERE])
def test_moe_fused_slots_match_separate_launches(cuda, shared):
    """moe_gate_up / moe_down on the device against the device's own expert_gate_up / expert_down
    (and the memset of a shared slot another rank holds): the same arithmetic, so the same bits."""
    rng = np.random.default_rng()
    n_local, inter, h, k = 8, 2048, HIDDEN, 4
    y, gu, dn = _experts_case(rng, n_local, inter, h)
    _, sgu, sdn = _experts_case(rng, 1, inter, h)
    ids = np.array([6, 1, 7, 0, 0], np.uint32)
    wts = (rng.random(k + 1) + 0.1).astype(np.float32)
    slots = k + (shared != moe.SHARED_NONE)
    bufs = {
        "gu": gu,
        "dn": dn,
        "sgu": sgu,
        "sdn": sdn,
        "y": y,
        "ids": ids,
        "wts": wts,
        "act": (k + 1) * inter * 2,
        "parts": (k + 1) * h * 4,
    }

    def fused(gpu, gu, dn, sgu, sdn, y, ids, wts, act, parts):
        moe.moe_gate_up(gpu, gu, sgu, y, ids, act, k, 0, n_local, inter, h, 10.0, shared)
        moe.moe_down(gpu, dn, sdn, act, ids, wts, parts, k, 0, n_local, h, inter, shared)

    def separate(gpu, gu, dn, sgu, sdn, y, ids, wts, act, parts):
        moe.expert_gate_up(gpu, gu, y, ids, act, 0, k, 0, n_local, inter, h, 10.0)
        moe.expert_down(gpu, dn, act, ids, wts, parts, 0, k, 0, n_local, h, inter)
        if shared == moe.SHARED_HERE:
            moe.expert_gate_up(gpu, sgu, y, ids, act, k, 1, 0, 1, inter, h, 10.0)
            moe.expert_down(gpu, sdn, act, ids, wts, parts, k, 1, 0, 1, h, inter)
        elif shared == moe.SHARED_ELSEWHERE:
            gpu.memset(parts.offset(k * h * 4), 0, h * 4)

    f, s = run_on(cuda, fused, bufs), run_on(cuda, separate, bufs)
    assert f["act"].tobytes() == s["act"].tobytes()
    assert f["parts"].tobytes() == s["parts"].tobytes()
    assert not np.isnan(as_(f["parts"], np.float32, (k + 1, h))[:slots]).any()
    # and the twin agrees with the device on the shared slot
    hf = run_on(HostBackend(), fused, bufs)
    if shared == moe.SHARED_HERE:
        ga = as_(f["act"], BF16, (k + 1, inter))[k].astype(np.float32)
        ha = as_(hf["act"], BF16, (k + 1, inter))[k].astype(np.float32)
        assert_close(ga, ha, 2.0**-6, 1e-3 * float(np.abs(ha).max()), "shared slot act")


def test_experts_read_only_the_chosen_of_288(cuda):
    """Full-size expert stacks (288 x [4096, 4096] gate/up, 288 x [4096, 2048] down, 14.5 GB) on the
    device: only the 8 chosen experts hold data, every other expert is NaN (0xFF), so reading a
    wrong expert shows. The host twin runs the same slots on a compact copy of the chosen experts."""
    rng = np.random.default_rng()
    E, inter, h, k = 288, 2048, HIDDEN, 8
    chosen = np.sort(rng.choice(E, k, replace=False)).astype(np.uint32)
    order = rng.permutation(k)
    ids = chosen[order]
    y, gu, dn = _experts_case(rng, k, inter, h)  # gu[i] is expert chosen[i]
    wts = (rng.random(k) + 0.1).astype(np.float32)
    gu_b, dn_b = 2 * inter * h * 2, h * inter * 2
    pgu, pdn = cuda.alloc(E * gu_b), cuda.alloc(E * dn_b)
    try:
        cuda.memset(pgu, 0xFF, E * gu_b)
        cuda.memset(pdn, 0xFF, E * dn_b)
        for i, e in enumerate(chosen):
            cuda.copy_h2d(pgu.offset(int(e) * gu_b), gu[i])
            cuda.copy_h2d(pdn.offset(int(e) * dn_b), dn[i])

        def run_dev(gpu, y, ids, wts, act, parts):
            moe.expert_gate_up(gpu, pgu, y, ids, act, 0, k, 0, E, inter, h, 10.0)
            moe.expert_down(gpu, pdn, act, ids, wts, parts, 0, k, 0, E, h, inter)

        g = run_on(cuda, run_dev, {"y": y, "ids": ids, "wts": wts, "act": k * inter * 2, "parts": k * h * 4})
    finally:
        cuda.free(pgu)
        cuda.free(pdn)
    compact = np.searchsorted(chosen, ids).astype(np.uint32)

    def run_host(gpu, gu, dn, y, ids, wts, act, parts):
        moe.expert_gate_up(gpu, gu, y, ids, act, 0, k, 0, k, inter, h, 10.0)
        moe.expert_down(gpu, dn, act, ids, wts, parts, 0, k, 0, k, h, inter)

    hh = run_on(
        HostBackend(),
        run_host,
        {"gu": gu, "dn": dn, "y": y, "ids": compact, "wts": wts, "act": k * inter * 2, "parts": k * h * 4},
    )
    ga, ha = (
        as_(g["act"], BF16, (k, inter)).astype(np.float32),
        as_(hh["act"], BF16, (k, inter)).astype(np.float32),
    )
    assert_close(ga, ha, 2.0**-6, 1e-3 * float(np.abs(ha).max()), "act of 288 experts")
    gp, hp = as_(g["parts"], np.float32, (k, h)), as_(hh["parts"], np.float32, (k, h))
    assert_close(gp, hp, 2.0**-6, 1e-3 * float(np.abs(hp).max()), "parts of 288 experts")


# ---- draft_head ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "val,idx,v0",
    [
        (1.5, 7, 0),
        (-2.0, 0, 1000),
        (0.0, 3, 5),
        (-0.0, 3, 5),
        (float("inf"), 154879, 0),
        (-1e-30, 12, 77440),
        (float("nan"), 9, 0),
    ],
)
@pytest.mark.parametrize("publish", [0, 1])
def test_argmax_pack_and_commit_exact(cuda, val, idx, v0, publish):
    def run(gpu, i, v, key, tok, drafts, out, flag):
        draft_head.argmax_pack(gpu, i, v, key, v0)
        draft_head.draft_commit(gpu, key, tok, drafts, 2, out, publish, flag=flag)

    prior = np.array([11, 22, 0xFFFFFFFF, 0xFFFFFFFF], np.uint32)  # drafts 0 and 1 of the step
    g, h = both(
        cuda,
        run,
        {
            "i": np.array([idx], np.uint32),
            "v": np.array([val], np.float32),
            "key": 8,
            "tok": 4,
            "drafts": prior,
            "out": 16,
            "flag": np.zeros(4, np.uint8),
        },
    )
    assert g["key"].tobytes() == h["key"].tobytes()
    assert g["out"].tobytes() == h["out"].tobytes()
    assert g["flag"].tobytes() == h["flag"].tobytes()
    # a NaN logit commits its (valid) index and raises NONFINITE_NAN, an infinite one NONFINITE_INF
    want = draft_head.NONFINITE_NAN if np.isnan(val) else draft_head.NONFINITE_INF if np.isinf(val) else 0
    assert g["flag"].tolist() == [want, 0, 0, 0]
    assert int(as_(g["key"], np.uint64)[0]) == draft_head.pack_key(val, idx + v0)
    assert int(as_(g["tok"], np.uint32)[0]) == idx + v0 == int(as_(g["drafts"], np.uint32)[2])
    assert (g["drafts"][12:] == 0xFF).all()
    if publish:  # drafts 0..2 copied out, nothing past them
        assert as_(g["out"], np.uint32)[:3].tolist() == [11, 22, idx + v0] and (g["out"][12:] == 0xFF).all()
    else:
        assert (g["out"] == 0xFF).all()


def test_argmax_pack_of_an_all_nan_shard_loses_to_every_number(cuda):
    """argmax_bf16 of an all-NaN shard is (0, NaN): its key has high word 0 and keeps its index,
    below the key of -inf on any other rank; an empty shard (0xFFFFFFFF) packs 0."""

    def pack(i, v):
        g, h = both(
            cuda,
            lambda gpu, i, v, key: draft_head.argmax_pack(gpu, i, v, key, 77440),
            {"i": np.array([i], np.uint32), "v": np.array([v], np.float32), "key": 8},
        )
        assert g["key"].tobytes() == h["key"].tobytes()
        return int(as_(g["key"], np.uint64)[0])

    nan_key = pack(0, np.nan)
    assert nan_key == 0xFFFFFFFF - 77440 and draft_head.unpack_index(nan_key) == 77440
    assert pack(5, -np.inf) > nan_key
    assert pack(0xFFFFFFFF, np.nan) == 0


def test_draft_commit_of_an_empty_key_is_a_valid_token(cuda):
    """The zero key (no candidate at all) commits token 0, flagged NaN: never 0xFFFFFFFF."""

    def run(gpu, key, tok, drafts, out, flag):
        draft_head.draft_commit(gpu, key, tok, drafts, 0, out, True, flag=flag)

    g, h = both(
        cuda,
        run,
        {"key": np.zeros(1, np.uint64), "tok": 4, "drafts": 4, "out": 4, "flag": np.zeros(4, np.uint8)},
    )
    for b in (g, h):
        assert int(as_(b["tok"], np.uint32)[0]) == 0 == int(as_(b["out"], np.uint32)[0])
        assert b["flag"].tolist() == [draft_head.NONFINITE_NAN, 0, 0, 0]


@pytest.fixture(scope="module")
def head_w(cuda):
    """The full head, and its FP8 copy made on the device by the runtime's quantize_fp8 (which
    test_gpu_kernels.py holds bit-exact to quantize_rows_fp8; on the host it takes seconds)."""
    from runtime.kernels.quantize_fp8 import quantize_fp8

    rng = np.random.default_rng()
    w = random_bf16(rng, (VOCAB, HIDDEN), exp_lo=-8)
    pw, pq, ps = cuda.alloc(w.nbytes), cuda.alloc(VOCAB * HIDDEN), cuda.alloc(VOCAB * 4)
    try:
        cuda.copy_h2d(pw, w)
        quantize_fp8(cuda, pw, pq, ps, VOCAB, HIDDEN)
        q, s = np.empty((VOCAB, HIDDEN), np.uint8), np.empty(VOCAB, np.float32)
        cuda.copy_d2h(q, pq)
        cuda.copy_d2h(s, ps)
    finally:
        for p in (pw, pq, ps):
            cuda.free(p)
    return w, q.view(FP8), s


def _head_run(gpu, w, scale, x, n, k, slot=1, launches=1):
    """The head ``launches`` times; the last one publishes drafts 0..slot to ``out``."""
    zero8, zero4 = np.zeros(1, np.uint64), np.zeros(1, np.uint32)
    bufs = {
        "w": w,
        "x": x,
        "logits": 2 * n,
        "key": zero8,
        "ctr": zero4,
        "tok": 4,
        "drafts": 16,
        "out": 16,
        "flag": np.zeros(4, np.uint8),
    }
    if scale is not None:
        bufs["sc"] = scale

    def run(gpu, w, x, logits, key, ctr, tok, drafts, out, flag, sc=None):
        for i in range(launches):
            draft_head.head_argmax(
                gpu, w, sc, x, logits, key, ctr, tok, drafts, slot, out, i == launches - 1, n, k, flag=flag
            )

    return run_on(gpu, run, bufs)


@pytest.mark.parametrize("fp8", [False, True])
def test_head_argmax_full_vocab(cuda, head_w, fp8):
    rng = np.random.default_rng()
    w, q, s = head_w
    x = random_bf16(rng, (1, HIDDEN), exp_lo=-1)
    g = _head_run(cuda, q if fp8 else w, s if fp8 else None, x, VOCAB, HIDDEN, launches=2)
    gl = as_(g["logits"], BF16)
    wd = q.astype(np.float32) * s[:, None] if fp8 else w
    ref = (wd.astype(np.float32) @ x[0].astype(np.float32)).astype(np.float64)  # f32 twin math
    assert_dot_close(gl, ref, dot_bound(abs_dot(x, wd)[0], ref, HIDDEN, 2), "head logits")
    tok = int(as_(g["tok"], np.uint32)[0])
    gl32 = gl.astype(np.float32)
    assert tok == int(np.flatnonzero(gl32 == gl32.max())[0]), "token is the argmax of the device logits"
    assert int(as_(g["drafts"], np.uint32)[1]) == tok
    assert (g["drafts"][:4] == 0xFF).all() and (g["drafts"][8:] == 0xFF).all()
    assert g["out"][:8].tobytes() == g["drafts"][:8].tobytes() and (g["out"][8:] == 0xFF).all()
    assert int(as_(g["key"], np.uint64)[0]) == 0 and int(as_(g["ctr"], np.uint32)[0]) == 0
    assert not g["flag"].any(), "finite logits raise no flag"
    top = np.sort(ref)[-2:]
    if top[1] - top[0] > 4 * 2.0**-8 * abs(top[1]):  # the twin's draft where rounding cannot flip it
        assert tok == int(np.argmax(ref))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,k,mis", [(37, 29, 0), (100_003, 64, 0), (1000, 4096, 2)])
def test_head_argmax_ties_and_awkward_sizes(cuda, n, k, mis, fp8):
    rng = np.random.default_rng()
    w = random_bf16(rng, (n, k), exp_lo=-6)
    a, b = sorted(rng.choice(n, 2, replace=False))
    w[a] = w[b] = 8.0  # above every other weight (< 2**2), and x > 0: these two rows are the maximum
    x = np.abs(random_bf16(rng, (1, k), exp_lo=-1).astype(np.float32)).astype(BF16)
    q, s = quantize_rows_fp8(w)
    zero8, zero4 = np.zeros(1, np.uint64), np.zeros(1, np.uint32)
    bufs = {
        "w": q if fp8 else w,
        "x": x,
        "logits": 2 * n,
        "key": zero8,
        "ctr": zero4,
        "tok": 4,
        "drafts": 16,
        "out": 16,
        "flag": np.zeros(4, np.uint8),
    }
    if fp8:
        bufs["sc"] = s

    def run(gpu, w, x, logits, key, ctr, tok, drafts, out, flag, sc=None):
        draft_head.head_argmax(gpu, w, sc, x, logits, key, ctr, tok, drafts, 3, out, False, n, k, flag=flag)

    gd, hd = both(cuda, run, bufs, {"x": mis})
    gl, hl = as_(gd["logits"], BF16).astype(np.float32), as_(hd["logits"], BF16).astype(np.float32)
    assert_close(gl, hl, 2.0**-6, 1e-3 * float(np.abs(hl).max()), "head logits")
    tok = int(as_(gd["tok"], np.uint32)[0])
    assert tok == a, f"tie between rows {a} and {b}: the lower index wins, got {tok}"
    assert gd["tok"].tobytes() == hd["tok"].tobytes() and gd["drafts"].tobytes() == hd["drafts"].tobytes()
    assert (gd["out"] == 0xFF).all(), "a draft that is not the step's last publishes nothing"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case", ["nan_x", "inf_x", "nan_rows", "inf_logit"])
def test_head_argmax_nonfinite(cuda, fp8, case):
    """NaN never wins and every draft is a valid index: a NaN in x makes every logit NaN (token 0,
    NONFINITE_NAN); an Inf in x or an overflowing row makes the largest logit +inf (the lowest such
    row, NONFINITE_INF); NaN weight rows lose to the numbers (no flag). Device and twin agree."""
    rng = np.random.default_rng()
    n, k = 1000, 256
    w = random_bf16(rng, (n, k), exp_lo=-6)
    x = np.abs(random_bf16(rng, (1, k), exp_lo=-1).astype(np.float32)).astype(BF16)
    want_tok, want_flag = None, 0
    if case == "nan_x":
        x[0, 7] = np.nan
        want_tok, want_flag = 0, draft_head.NONFINITE_NAN
    elif case == "inf_x":
        x[0, 7] = np.inf
        want_flag = draft_head.NONFINITE_INF
    elif case == "nan_rows":
        nan_rows = rng.choice(n, 50, replace=False)
        w[nan_rows] = np.nan
    else:
        r = int(rng.integers(1, n))
        w[r] = 2.0**126  # x > 0: the logit overflows to +inf on both heads
        want_tok, want_flag = r, draft_head.NONFINITE_INF
    if fp8:
        if case == "nan_rows":
            return  # the FP8 copy of a NaN row is quantize_fp8's business (its scale is NaN)
        q, sc = quantize_rows_fp8(w)
    bufs = {
        "w": q if fp8 else w,
        "x": x,
        "logits": 2 * n,
        "key": np.zeros(1, np.uint64),
        "ctr": np.zeros(1, np.uint32),
        "tok": 4,
        "drafts": 16,
        "out": 16,
        "flag": np.zeros(4, np.uint8),
    }
    if fp8:
        bufs["sc"] = sc

    def run(gpu, w, x, logits, key, ctr, tok, drafts, out, flag, sc=None):
        draft_head.head_argmax(gpu, w, sc, x, logits, key, ctr, tok, drafts, 1, out, True, n, k, flag=flag)

    gd, hd = both(cuda, run, bufs)
    tok = int(as_(gd["tok"], np.uint32)[0])
    assert 0 <= tok < n, f"draft {tok} is not a valid index"
    assert gd["tok"].tobytes() == hd["tok"].tobytes() and gd["flag"].tobytes() == hd["flag"].tobytes()
    assert gd["flag"].tolist() == [want_flag, 0, 0, 0]
    assert int(as_(gd["out"], np.uint32)[1]) == tok
    if want_tok is not None:
        assert tok == want_tok
    gl = as_(gd["logits"], BF16).astype(np.float32)
    if case == "inf_x":
        assert tok == int(np.flatnonzero(gl == np.inf)[0]), "the lowest +inf row wins"
    if case == "nan_rows":
        assert not np.isnan(gl[tok]) and gl[tok] == np.nanmax(gl)
    assert int(as_(gd["key"], np.uint64)[0]) == 0 and int(as_(gd["ctr"], np.uint32)[0]) == 0


# ---- capacities shared between Python and CUDA ----------------------------------------------------


def test_selection_capacity_constant_matches_the_kernel():
    src = (ROOT / "ptx" / "dsa_select.cu").read_text()
    m = re.search(r"#define TOPK_MAX_POOLS_CUDA (\d+)u", src)
    assert m and int(m.group(1)) == TOPK_MAX_POOLS
