"""The tensor-core projections (model/kernels/proj_mma.py) on the host backend: their twins are the
CUDA-core kernels' arithmetic, so every launch must give the bits of the CUDA-core launch it
replaces (rmsnorm_gemv_seg_batch; bgemv_batch / bgemv_fp8_batch per head), write exactly the
columns it owns, and refuse the shapes the PTX does not take. The PTX against these twins:
tests/test_gpu_proj_mma.py."""

from __future__ import annotations

import numpy as np
import pytest
from batch_proj_fp8_util import OProj, Seg, bgemv_fp8, fp8_tensor, seg_gemv
from batch_proj_util import EPS, Bufs
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_util import no_poison, random_bf16, same_bits
from proj_mma_util import proj_heads, proj_seg

from model.kernels import bgemv as bg
from model.kernels import bgemv_fp8 as bf
from model.kernels import mtp_input as mi
from model.kernels import proj_mma as pm
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend
from runtime.kernels.rmsnorm import rmsnorm_ref


def mixed_segments(rng, k: int) -> tuple[list[Seg], int]:
    """FP8 rows that fill no block (20 rows placed at row0 100 of a 300-row tensor), BF16 rows that
    fill no warp tile (37), a gap between the output columns, a 5-row BF16 segment."""
    q1, s1 = fp8_tensor(rng, 8, k)
    q2, s2 = fp8_tensor(rng, 300, k)
    return [
        Seg(q1, 0, s1),
        Seg(random_bf16(rng, (37, k), exp_lo=-8), 9),
        Seg(q2[100:120], 50, s2, 100),
        Seg(random_bf16(rng, (5, k), exp_lo=-8), 71),
    ], 80


@pytest.mark.parametrize("k,x_off", [(192, 8), (64, 0), (320, 16), (1024, 8)])
def test_segments_are_the_cuda_core_launch(k, x_off):
    """k = 1024 splits k (a few row groups: proj_ksplit) and sums the splits in a second launch."""
    rng = np.random.default_rng(k)
    segs, ys = mixed_segments(rng, k)
    host = HostBackend()
    dummy = [bf.GemvSegment(w=host.alloc(16), scales=None, rows=sg.rows, col=sg.col) for sg in segs]
    assert (pm.proj_ksplit(dummy, 1, k) > 1) == (k == 1024)
    for m in (1, 5):
        x = random_bf16(rng, (m, k + x_off + 8))
        nw = random_bf16(rng, k, exp_lo=-1)
        got = proj_seg(host, x, k, nw, segs, ys, x_off=x_off)
        want = seg_gemv(host, x, k, nw, segs, ys, x_off=x_off)
        same_bits(got, want, f"proj_mma k={k} m={m} against rmsnorm_gemv_seg_batch")
        covered = np.zeros(ys, bool)
        for sg in segs:
            covered[sg.col : sg.col + sg.rows] = True
        no_poison(got[:, covered], "proj_mma covered columns")
        assert (got[:, ~covered].view(np.uint16) == 0xFFFF).all(), "a column no segment covers was written"


@pytest.mark.parametrize("out_f32", [True, False], ids=["f32", "bf16"])
def test_fp8_heads_are_bgemv_fp8(out_f32):
    """o_proj's head groups with a col0 inside a scale block (this rank's groups of a wider tensor)."""
    rng = np.random.default_rng(7)
    o = OProj.random(rng, heads=3, n=40, k=128, col0=64, extra_cols=64)
    host = HostBackend()
    for m in (1, 4):
        x = random_bf16(rng, (m, 3, 128))
        got = proj_heads(host, o.q, x, out_f32=out_f32, scales=o.scales, col0=o.col0, x_pad=8, y_pad=4)
        want = bgemv_fp8(host, o, x, out_f32=out_f32, x_pad=8, y_pad=4)
        same_bits(got, want, f"proj_mma heads m={m} against bgemv_fp8_batch")


@pytest.mark.parametrize("out_f32", [True, False], ids=["f32", "bf16"])
def test_bf16_heads_are_bgemv(out_f32):
    rng = np.random.default_rng(8)
    heads, n, k = 4, 24, 64
    w = random_bf16(rng, (heads, n, k), exp_lo=-6)
    host = HostBackend()
    for m in (1, 3):
        x = random_bf16(rng, (m, heads, k))
        got = proj_heads(host, w, x, out_f32=out_f32)
        with Bufs(host) as b:
            pw, px = b.put(w), b.put(x.reshape(m, heads * k))
            isz = 4 if out_f32 else 2
            py = b.poison(m * heads * n * isz)
            bg.bgemv_batch(
                host,
                w=pw,
                x=px,
                x_stride=heads * k,
                y=py,
                y_stride=heads * n,
                m=m,
                heads=heads,
                n=n,
                k=k,
                out_f32=out_f32,
            )
            want = b.get(py).view(np.float32 if out_f32 else BF16).reshape(m, heads, n)
        same_bits(got, want, f"proj_mma BF16 heads m={m} against bgemv_batch")


def test_rmsnorm_rows_batch_is_rmsnorm_ref_per_row():
    rng = np.random.default_rng(3)
    host = HostBackend()
    m, k, xs, os = 3, 40, 48, 56
    x, w = random_bf16(rng, (m, xs)), random_bf16(rng, k, exp_lo=-1)
    with Bufs(host) as b:
        px, pw, po = b.put(x), b.put(w), b.poison(m * os * 2)
        pm.rmsnorm_rows_batch(host, x=px, x_stride=xs, norm_w=pw, out=po, out_stride=os, m=m, k=k, eps=EPS)
        out = b.get(po).view(BF16).reshape(m, os)
    same_bits(out[:, :k], rmsnorm_ref(x[:, :k], w, EPS), "rmsnorm_rows_batch")
    assert (out[:, k:].view(np.uint16) == 0xFFFF).all(), "rmsnorm_rows_batch wrote past k"


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 256), nsb=st.integers(1, 512))
def test_smem_holds_a_slice_and_fits(m, nsb):
    """The kernel derives its slice from the dynamic shared memory and the largest tile (ptx/
    proj_mma.cu): it must find all of k, or two buffers of at least one superblock, within SMEM_MAX."""
    k = 64 * nsb
    smem = pm.proj_mma_smem(m, k)
    tiles = pm.proj_tiles(m)
    tmax = -(-m // tiles)
    assert tmax <= pm.TILE_ROWS and smem <= pm.SMEM_MAX
    per_row = smem // tmax
    whole = per_row >= 128 * nsb + 16
    s = nsb if whole else (per_row // 2 - 16) // 128
    assert 1 <= s <= nsb
    assert whole or per_row >= 288


def test_refusals_name_the_problem():
    host = HostBackend()
    rng = np.random.default_rng(0)
    with Bufs(host) as b:
        w = b.put(random_bf16(rng, (16, 128)))
        x, y = b.poison(4 * 256 * 2), b.poison(4 * 64 * 4)
        seg = bf.GemvSegment(w=w, scales=None, rows=16, col=0)
        ok = dict(x=x, x_stride=128, segments=[seg], y=y, y_stride=16, m=4, k=128, out_f32=True)
        pm.proj_mma_batch(host, **ok)
        with pytest.raises(ValueError, match="multiple of 64"):
            pm.proj_mma_batch(host, **{**ok, "k": 96})
        with pytest.raises(ValueError, match="aligned"):
            pm.proj_mma_batch(host, **{**ok, "x_stride": 132})
        with pytest.raises(ValueError, match="aligned"):
            pm.proj_mma_batch(host, **{**ok, "x": x.offset(2)})
        with pytest.raises(ValueError, match="one segment"):
            pm.proj_mma_batch(host, **{**ok, "segments": [seg, seg], "heads": 2})
        with pytest.raises(ValueError, match="y_stride"):
            pm.proj_mma_batch(host, **{**ok, "y_stride": 8})
        with pytest.raises(ValueError, match="x_stride"):
            pm.proj_mma_batch(host, **{**ok, "heads": 2, "x_head": 128, "y_head": 16, "y_stride": 32})
        with pytest.raises(ValueError, match="entries"):
            pm.proj_mma_batch(host, **{**ok, "m": 0})


def test_embed_norm_flags_rows_and_flags():
    """The tensor-core eh_proj's input: mtp_embed_norm_batch's rows, and mtp_input_gemv_batch's flag
    bits for a token outside the vocabulary and a hidden row with a NaN; a padding entry untouched."""
    from embed_flags_util import H, embed_flags_case

    out, flags = embed_flags_case(HostBackend(), 1, flag_byte=2)
    assert flags[:, [0, 1, 3]].sum() == 0
    assert list(flags[:, 2]) == [0, mi.TOKEN_OUTSIDE, mi.HIDDEN_NONFINITE, 0]
    assert np.isfinite(out[0].astype(np.float32)).all()
    assert np.isnan(out[1, :H].astype(np.float32)).all()
    assert (out[3].view(np.uint16) == 0xFFFF).all(), "a padding entry's row was written"
