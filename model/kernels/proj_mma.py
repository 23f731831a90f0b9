"""The drafter's projections on tensor cores, over m rows of activations at once (1 <= m <= 256).
CUDA: ptx/proj_mma.cu.

- ``proj_mma_batch``: ``y[e, h * y_head + col_i + r] = W_i[h][r] . x[e, h * x_head : + k]`` for up
  to four weight segments (``bgemv_fp8.GemvSegment``: BF16, or FP8 with 128 x 128 block scales) or
  ``heads`` per-head matrices of one segment. It is the tensor-core form of every projection of
  the block: the fused input and q projections (``bgemv_fp8.rmsnorm_gemv_seg_batch``, after
  ``rmsnorm_rows_batch``), the absorbed query and the value projection (``bgemv.bgemv_batch``) and
  o_proj (``bgemv.bgemv_batch`` / ``bgemv_fp8.bgemv_fp8_batch``).
- ``rmsnorm_rows_batch``: ``out[e] = rmsnorm(x[e]) * w`` per row (``rmsnorm_ref``), the input a
  normed projection reads.

Why a second form: the CUDA-core GEMVs are bound by their FMAs past a few rows (o_proj in FP8:
697 us at 64 rows against a 16 us weight floor, BENCHMARKS.md "Kernel sweeps"), the tensor core
keeps a launch near its weight floor up to 64 rows a tile.

The arithmetic is the CUDA-core kernels' contract (a BF16 row's f32 dot; an FP8 row's block-scaled
sum of ``bgemv_fp8.fp8_block_dot``), so the host twins are theirs and the host backend gives the
same bits on either form. On the GPU the sum inside each k16 step is the tensor core's own, so the
two forms differ in the last bits: a proposer uses one form for all its launches
(``ProposerOptions.tensor_core_projections``), and within a form every output depends on its
weight row and its x row alone (batch invariance on the GPU as on the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.dtypes import BF16, FP8
from runtime.host_math import dot_rows
from runtime.kernel import F32, PTR, U32, declare
from runtime.kernels.rmsnorm import rmsnorm_ref
from runtime.launch import launch

from .batch import check_rows
from .bgemv_fp8 import FP8_BLOCK, MAX_SEGMENTS, GemvSegment, check_segments, fp8_block_dot, segment_args

TILE_ROWS = 32  # x rows per tile (ptx/proj_mma.cu PM_NG column groups of 8)
WARP_ROWS = 16  # weight rows per warp tile (PM_ROWS)
WARPS = 8
# Dynamic shared memory of a launch at most: a tile's x rows for all of k when they fit, else two
# slices (ptx/proj_mma.cu); two blocks an SM (the kernel's 128 registers a thread allow it).
SMEM_MAX = 100 * 1024
_U32_MAX = 2**32 - 1


def proj_mma_supported(k: int, *strides: int) -> bool:
    """Whether the tensor-core form takes a projection of k columns whose x rows, heads and scale
    columns are at these element offsets (16-byte aligned x rows and 64-column superblocks). The
    choice is by shape only, never by m, so it cannot break batch invariance."""
    return k >= 64 and k % 64 == 0 and all(s % 8 == 0 for s in strides)


# Blocks a launch should have before its k is split (about one per SM of an H200: 132). Splitting is
# chosen from the shape alone, never from m, so it cannot break batch invariance.
SPLIT_TARGET = 128
SPLIT_MIN_SUPERBLOCKS = 4  # a split keeps at least this many 64-column superblocks


def _row_groups(segments: Sequence[GemvSegment]) -> int:
    """Blocks of WARPS warp tiles of WARP_ROWS weight rows over the segments (a head's)."""
    return -(-sum(-(-sg.rows // WARP_ROWS) for sg in segments) // WARPS)


def proj_ksplit(segments: Sequence[GemvSegment], heads: int, k: int) -> int:
    """Splits of k for a launch whose row groups and heads give few blocks (fused_in: 19 row
    groups at GLM-5.3-Flash's shapes): each split's f32 partials go to a workspace and
    proj_reduce sums them in order. A power of two dividing k / 64."""
    groups = _row_groups(segments)
    nsb, s = k // 64, 1
    while (
        groups * heads * s < SPLIT_TARGET and nsb % (2 * s) == 0 and nsb // (2 * s) >= SPLIT_MIN_SUPERBLOCKS
    ):
        s *= 2
    return s


def proj_workspace_bytes(segments: Sequence[GemvSegment], heads: int, k: int, m: int, y_stride: int) -> int:
    """Bytes of the f32 split partials a launch of m rows needs (0 when k is not split)."""
    s = proj_ksplit(segments, heads, k)
    return 0 if s == 1 else s * m * y_stride * 4


def proj_tiles(m: int) -> int:
    return -(-m // TILE_ROWS)


def proj_mma_smem(m: int, k: int, ksplit: int = 1) -> int:
    """Bytes of x staging (ptx/proj_mma.cu): each tile row ``128 S + 16`` bytes a slice of S
    superblocks of its split of k; the whole split in one slice when the largest tile fits in
    SMEM_MAX, else two buffers of the largest S that fit (a multiple of 6 where that is at least 6:
    whole weight batches of 3 FP8 and 2 BF16 superblocks)."""
    tiles = proj_tiles(m)
    tmax = -(-m // tiles)
    nsb = k // 64 // ksplit
    whole = tmax * (128 * nsb + 16)
    if whole <= SMEM_MAX:
        return whole
    s = min(nsb, (SMEM_MAX // tmax // 2 - 16) // 128)
    s = s // 6 * 6 if s >= 6 else s
    return tmax * 2 * (128 * s + 16)


# ---- host twins ---------------------------------------------------------------------------------------

_PM_ARGS = [
    ("x", PTR),
    ("x_stride", U32),
    ("x_head", U32),
    ("y", PTR),
    ("y_stride", U32),
    ("y_head", U32),
    ("m", U32),
    ("k", U32),
    ("tiles", U32),
    ("heads", U32),
    ("s_cols", U32),
    ("s_col0", U32),
    ("ksplit", U32),
    ("part", PTR),
    ("fp8_mask", U32),
] + [
    (f"{name}{i}", typ)
    for i in range(MAX_SEGMENTS)
    for name, typ in (("w", PTR), ("s", PTR), ("rows", U32), ("col", U32), ("row0_", U32))
]


def _proj(mem, args, dtype) -> None:
    """Per head and segment the CUDA-core twins' arithmetic (dot_rows; fp8_block_dot with the
    head's columns from s_col0 + h * k), written to the segment's columns of each y row; y's other
    columns are left as they were. With ksplit > 1 the f32 result goes to split 0 of ``part`` and
    zeros to the others, so that proj_reduce's ordered sum gives those bits exactly (x + 0 = x).
    ``args``: the launch's arguments in _PM_ARGS order."""
    x, x_stride, x_head, y, y_stride, y_head, m, k, _tiles, heads, s_cols, s_col0, ksplit, part, fp8_mask = (
        args[:15]
    )
    segs = args[15:]
    if ksplit > 1:
        whole = (
            x,
            x_stride,
            x_head,
            part,
            y_stride,
            y_head,
            m,
            k,
            _tiles,
            heads,
            s_cols,
            s_col0,
            1,
            part,
            fp8_mask,
        )
        _proj(mem, whole + tuple(segs), np.float32)
        for sp in range(1, ksplit):
            for h in range(heads):
                for i in range(MAX_SEGMENTS):
                    rows, col = segs[5 * i + 2], segs[5 * i + 3]
                    if rows:
                        for e in range(m):
                            at = (sp * m + e) * y_stride + h * y_head + col
                            mem.write(part.offset(at * 4), np.zeros(rows, np.float32))
        return
    isz = np.dtype(dtype).itemsize
    for h in range(heads):
        xs = np.stack([mem.read(x.offset((e * x_stride + h * x_head) * 2), BF16, k) for e in range(m)])
        for i in range(MAX_SEGMENTS):
            w, s, rows, col, row0 = segs[5 * i : 5 * i + 5]
            if rows == 0:
                continue
            if (fp8_mask >> i) & 1:
                q = mem.view(w.offset(h * rows * k), FP8, (rows, k))
                sc = mem.view(s, np.float32, ((row0 + rows - 1) // FP8_BLOCK[0] + 1, s_cols))
                out = fp8_block_dot(xs, q, sc, row0=row0, base=s_col0 + h * k)
            else:
                out = dot_rows(xs, mem.view(w.offset(h * rows * k * 2), BF16, (rows, k)))
            out = out.astype(dtype)
            for e in range(m):
                mem.write(y.offset((e * y_stride + h * y_head + col) * isz), out[e])


@declare("proj_mma", "proj_mma_bf16", list(_PM_ARGS), writes=("y", "part"), pdl=True)
def PROJ_MMA_BF16(mem, *args):
    """y[e, h * y_head + col_i + r] = W_i[h][r] . x[e, h * x_head ..] for h < heads, y BF16 (with
    ksplit > 1: each split's f32 partials into part, laid out as y; proj_reduce_bf16 sums them)."""
    _proj(mem, args, BF16)


@declare("proj_mma", "proj_mma_f32", list(_PM_ARGS), writes=("y", "part"), pdl=True)
def PROJ_MMA_F32(mem, *args):
    """proj_mma_bf16 with y f32."""
    _proj(mem, args, np.float32)


_PR_ARGS = [
    ("part", PTR),
    ("y", PTR),
    ("y_stride", U32),
    ("y_head", U32),
    ("m", U32),
    ("ksplit", U32),
    ("heads", U32),
] + [(f"{name}{i}", U32) for i in range(MAX_SEGMENTS) for name in ("rows", "col")]


def _reduce(mem, part, y, y_stride, y_head, m, ksplit, heads, segs, dtype):
    isz = np.dtype(dtype).itemsize
    for h in range(heads):
        for i in range(MAX_SEGMENTS):
            rows, col = segs[2 * i], segs[2 * i + 1]
            if not rows:
                continue
            for e in range(m):
                at = e * y_stride + h * y_head + col
                v = mem.read(part.offset(at * 4), np.float32, rows).copy()
                for sp in range(1, ksplit):
                    v = v + mem.read(part.offset((sp * m * y_stride + at) * 4), np.float32, rows)
                mem.write(y.offset(at * isz), v.astype(dtype))


@declare("proj_mma", "proj_reduce_bf16", list(_PR_ARGS), writes=("y",), pdl=True)
def PROJ_REDUCE_BF16(mem, part, y, y_stride, y_head, m, ksplit, heads, *segs):
    """y = the ordered f32 sum of the ksplit partials of proj_mma_bf16, at the segments' columns."""
    _reduce(mem, part, y, y_stride, y_head, m, ksplit, heads, segs, BF16)


@declare("proj_mma", "proj_reduce_f32", list(_PR_ARGS), writes=("y",), pdl=True)
def PROJ_REDUCE_F32(mem, part, y, y_stride, y_head, m, ksplit, heads, *segs):
    """proj_reduce_bf16 with y f32."""
    _reduce(mem, part, y, y_stride, y_head, m, ksplit, heads, segs, np.float32)


@declare(
    "proj_mma",
    "rmsnorm_rows_batch",
    [
        ("x", PTR),
        ("x_stride", U32),
        ("w", PTR),
        ("out", PTR),
        ("out_stride", U32),
        ("m", U32),
        ("k", U32),
        ("eps", F32),
    ],
    writes=("out",),
    pdl=True,
)
def RMSNORM_ROWS_BATCH(mem, x, x_stride, w, out, out_stride, m, k, eps):
    """out[e] = rmsnorm_ref(x[e], w) for rows e < m."""
    xs = np.stack([mem.read(x.offset(e * x_stride * 2), BF16, k) for e in range(m)])
    xn = rmsnorm_ref(xs, mem.read(w, BF16, k), eps)
    for e in range(m):
        mem.write(out.offset(e * out_stride * 2), xn[e])


# ---- launch helpers ------------------------------------------------------------------------------------


def rmsnorm_rows_batch(
    gpu,
    *,
    x,
    x_stride: int,
    norm_w,
    out,
    out_stride: int,
    m: int,
    k: int,
    eps: float,
    stream=None,
) -> None:
    """``out[e, :k] = bf16((x_e / r) * norm_w)`` for e < m (x_e: k BF16 at ``x + e * x_stride``
    elements, out row e at ``out + e * out_stride``), each row as every normed row of the drafter is
    computed (``rmsnorm_ref`` on the host)."""
    what = "rmsnorm_rows_batch"
    check_rows(what, m)
    if not 1 <= k <= min(x_stride, out_stride) or max(x_stride, out_stride) > _U32_MAX:
        raise ValueError(f"{what}: k={k} with strides {x_stride} / {out_stride}")
    kernel = gpu.kernel(*RMSNORM_ROWS_BATCH.key)
    launch(gpu, kernel, m, 256, x, x_stride, norm_w, out, out_stride, m, k, eps, stream=stream)


def proj_mma_batch(
    gpu,
    *,
    x,
    x_stride: int,
    segments: Sequence[GemvSegment],
    y,
    y_stride: int,
    m: int,
    k: int,
    out_f32: bool,
    heads: int = 1,
    x_head: int = 0,
    y_head: int = 0,
    s_cols: int | None = None,
    s_col0: int = 0,
    part=None,
    stream=None,
) -> None:
    """For each row e < m, head h < heads and segment i: ``y[e, h * y_head + col_i + r] =
    W_i[h][r] . x[e, h * x_head : h * x_head + k]`` for r < rows_i (f32 y with ``out_f32``, else
    BF16; y's other columns untouched). With several heads there is one segment and head h's matrix
    is at ``w + h * rows * k`` elements. An FP8 segment's element (r, c) of head h has the scale
    ``s[(row0 + r) // 128][(s_col0 + h * k + c) // 128]`` of scales with ``s_cols`` columns
    (default: ceil(k / 128)). Each weight byte is read from HBM once per launch for all m rows.
    ``part``: an f32 workspace of ``proj_workspace_bytes`` for the shapes whose k is split
    (``proj_ksplit``; then a second launch sums the splits); without it k is never split."""
    what = "proj_mma_batch"
    check_rows(what, m)
    if not proj_mma_supported(k, x_stride, x_head, s_col0) or x.addr % 16:
        raise ValueError(
            f"{what}: k={k}, x_stride={x_stride}, x_head={x_head}, s_col0={s_col0}, x at {x.addr:#x} "
            "(needs k a multiple of 64 and 16-byte aligned x rows, heads and scale columns)"
        )
    if heads < 1 or (heads > 1 and len(segments) != 1):
        raise ValueError(f"{what}: {heads} heads take exactly one segment, got {len(segments)}")
    n = max(sg.col + sg.rows for sg in segments) if segments else 0
    if not (heads - 1) * x_head + k <= x_stride <= _U32_MAX:
        raise ValueError(
            f"{what}: x_stride={x_stride} is shorter than {heads} heads of {k} at {x_head} apart"
        )
    if not (heads - 1) * y_head + n <= y_stride <= _U32_MAX:
        raise ValueError(
            f"{what}: y_stride={y_stride} is shorter than {heads} heads of {n} at {y_head} apart"
        )
    check_segments(what, segments, y_stride)
    s_cols = -(-(s_col0 + heads * k) // FP8_BLOCK[1]) if s_cols is None else s_cols
    if s_cols * FP8_BLOCK[1] < s_col0 + heads * k:
        raise ValueError(f"{what}: s_cols={s_cols} does not cover columns up to {s_col0 + heads * k}")
    fp8_mask, seg_args = segment_args(segments)
    tiles = proj_tiles(m)
    groups = _row_groups(segments)
    ksplit = proj_ksplit(segments, heads, k) if part is not None else 1
    decl = PROJ_MMA_F32 if out_f32 else PROJ_MMA_BF16
    launch(
        gpu,
        gpu.kernel(*decl.key),
        (groups * ksplit * tiles, heads),
        WARPS * 32,
        x,
        x_stride,
        x_head,
        y,
        y_stride,
        y_head,
        m,
        k,
        tiles,
        heads,
        s_cols,
        s_col0,
        ksplit,
        part if ksplit > 1 else y,
        fp8_mask,
        *seg_args,
        smem=proj_mma_smem(m, k, ksplit),
        stream=stream,
    )
    if ksplit > 1:
        red = PROJ_REDUCE_F32 if out_f32 else PROJ_REDUCE_BF16
        cols = [v for i in range(MAX_SEGMENTS) for v in seg_args[5 * i + 2 : 5 * i + 4]]  # rows, col
        launch(
            gpu,
            gpu.kernel(*red.key),
            (m, heads),
            256,
            part,
            y,
            y_stride,
            y_head,
            m,
            ksplit,
            heads,
            *cols,
            stream=stream,
        )
