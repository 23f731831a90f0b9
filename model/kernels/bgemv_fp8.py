"""The drafter's projections with FP8 block-scaled weights, over m rows of activations at once
(1 <= m <= 256). CUDA: ptx/bgemv_fp8.cu (the FP8 dot products: ptx/fp8_block.cuh).

GLM-5.3-Flash ships q_a, q_b, kv_a_proj_with_mqa and o_proj as FP8 E4M3 with one f32 scale per
128 x 128 block, ``W[i, j] = q[i, j] * s[i // 128, j // 128]`` (model/checkpoint/fp8.py). These
kernels read the FP8 bytes and apply the scales, so such a row costs half the bytes of its BF16
dequantisation; every weight byte is read once per launch for all m rows.

- ``rmsnorm_gemv_seg_batch``: ``y[e, col + r] = W_seg[r] . (rmsnorm(x_e) * norm_w)`` for up to four
  weight segments of one launch, each BF16 or FP8 (the fused input projection stacks kv_a, wk,
  compress_gate, q_a and weights_proj, which differ in dtype on disk; the q projection q_b and wq_b).
  A BF16 segment's output is ``gemv_bf16_ref`` of the ``rmsnorm_ref`` rows bit for bit (twin; the PTX
  sums each row in its own fixed per-lane chunk order, the same for every m).
- ``bgemv_fp8_batch``: per head, ``y[e, h] = W8[h] @ x[e, h]`` (o_proj in its head groups), the
  FP8 twin of ``model.kernels.bgemv.bgemv_batch``.

The FP8 arithmetic of one output (weight row q against activation row x; row element j is column
``base + j`` of the full matrix, ``base`` = 0 for rmsnorm_gemv_seg_batch and ``col0 + h * k`` for head
h of bgemv_fp8_batch; the row is row ``row0 + r`` of that matrix for its scales)::

    P_b = float32 dot of the exact f32 FP8 values with x over the row's columns in 128-column block b
    y   = (((0 + P_b0 * s_b0) + P_b1 * s_b1) + ...) + P_bn * s_bn     # b increasing, f32

each product and each sum rounded to float32 (no fused multiply-add), then rounded once to the
output dtype. The host twin computes exactly that, with NumPy's float32 sum for P_b
(``runtime.host_math.dot_rows``: a function of the two vectors alone); the GPU computes the same
outer sum over blocks in the same order, and P_b in its own order (ptx/fp8_block.cuh: per
16-element chunk, then the block's 8 chunks pairwise; or per lane and warp_sum on the element
path), so GPU and twin differ by the rounding of P_b alone. Every output depends on its weight row
and its activation row only, never on m or the other rows (batch invariance, on the host and the GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16, FP8
from runtime.host_math import dot_rows
from runtime.kernel import F32, PTR, U32, Pdl, declare
from runtime.kernels.rmsnorm import rmsnorm_ref
from runtime.launch import grid_stride_blocks, launch

from .batch import check_rows
from .bgemv import BATCH_ROWS, BGEMV_STAGE_MAX

FP8_BLOCK = (128, 128)  # the only block the kernels take (model/checkpoint/fp8.py DEFAULT_BLOCK)
MAX_SEGMENTS = 4
# rmsnorm_gemv_seg_batch: the least shared memory of a launch with FP8 segments, 2048 f32 (ptx/bgemv_fp8.cu seg_pair).
FP8_PAIR_SMEM = 2048 * 4
# bgemv_fp8_batch: weight rows per warp (ptx/bgemv_fp8.cu FP8_ROWS_PER_WARP), 8 warps per block.
ROWS_PER_WARP = 4
_U32_MAX = 2**32 - 1


def check_block(what: str, block: tuple[int, int]) -> None:
    """The kernels apply one scale per 128 x 128 block; a checkpoint with another
    ``weight_block_size`` is refused here, before anything is launched."""
    if tuple(block) != FP8_BLOCK:
        raise ValueError(f"{what}: FP8 block size {tuple(block)} is not supported (only {FP8_BLOCK})")


def fp8_block_dot(
    x: np.ndarray, q: np.ndarray, scales: np.ndarray, *, row0: int = 0, base: int = 0
) -> np.ndarray:
    """The module's FP8 arithmetic on the host: f32 ``[m, rows]`` for x ``[m, k]`` (BF16 or f32
    values), q ``[rows, k]`` FP8 (rows ``row0 ..`` of the full matrix, columns ``base ..``) and the
    full matrix's f32 block scales. Element (i, r) depends on x[i] and q[r] alone."""
    xf = np.asarray(x, np.float32)
    qf = np.asarray(q, np.float32)  # every E4M3 value is exact in f32
    m, k = xf.shape
    rows = qf.shape[0]
    srow = (row0 + np.arange(rows)) // FP8_BLOCK[0]
    acc = np.zeros((m, rows), np.float32)
    bi = FP8_BLOCK[1]
    for b in range(base // bi, (base + k - 1) // bi + 1):
        lo, hi = max(0, b * bi - base), min(k, (b + 1) * bi - base)
        part = dot_rows(xf[:, lo:hi], qf[:, lo:hi])
        acc = acc + part * scales[srow, b].astype(np.float32)[None, :]
    return acc


# ---- rmsnorm_gemv_seg_batch -------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvSegment:
    """One weight segment of ``rmsnorm_gemv_seg_batch``: ``rows`` rows of k weights at ``w``, whose
    outputs go to columns ``col .. col + rows - 1`` of y. ``scales`` None: BF16 ``[rows, k]``. Else
    FP8 E4M3 ``[rows, k]`` holding rows ``row0 .. row0 + rows - 1`` of a larger tensor whose f32
    block scales ``[ceil(total_rows / 128), ceil(k / 128)]`` are at ``scales`` (row r applies scale
    row ``(row0 + r) // 128``: a rank's heads of q_b use the full tensor's scales; kv_a's 512 rows
    of 576 use its first four). ``block``: the checkpoint's weight_block_size (only 128 x 128)."""

    w: DevicePtr
    scales: DevicePtr | None
    rows: int
    col: int
    row0: int = 0
    block: tuple[int, int] = FP8_BLOCK

    def __post_init__(self) -> None:
        if not isinstance(self.w, DevicePtr) or not self.w:
            raise ValueError(f"GemvSegment: w must be a non-null DevicePtr, got {self.w!r}")
        if self.scales is not None and (not isinstance(self.scales, DevicePtr) or not self.scales):
            raise ValueError(f"GemvSegment: scales must be None or a non-null DevicePtr, got {self.scales!r}")
        for name in ("rows", "col", "row0"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"GemvSegment: {name} must be an integer, got {v!r}")
        if not 1 <= self.rows <= _U32_MAX:
            raise ValueError(f"GemvSegment: rows={self.rows} (a segment has at least one row)")
        if not 0 <= self.col <= _U32_MAX or not 0 <= self.row0 <= _U32_MAX - self.rows:
            raise ValueError(f"GemvSegment: col={self.col}, row0={self.row0} out of range")
        if self.scales is None and self.row0:
            raise ValueError(f"GemvSegment: row0={self.row0} on a BF16 segment (row0 places FP8 scales)")
        if self.scales is not None:
            check_block("GemvSegment", self.block)

    @property
    def fp8(self) -> bool:
        return self.scales is not None


_SEG_ARGS = [
    ("x", PTR),
    ("x_stride", U32),
    ("norm_w", PTR),
    ("y", PTR),
    ("y_stride", U32),
    ("m", U32),
    ("n", U32),
    ("k", U32),
    ("eps", F32),
    ("fp8_mask", U32),
] + [
    (f"{name}{i}", typ)
    for i in range(MAX_SEGMENTS)
    for name, typ in (("w", PTR), ("s", PTR), ("rows", U32), ("col", U32), ("row0_", U32))
]


def _seg_gemv(mem, x, x_stride, norm_w, y, y_stride, m, n, k, eps, fp8_mask, *segs) -> None:
    """Row by row the rmsnorm twin, then per segment the BF16 dot_rows (gemv_bf16_ref of the normed
    rows, element for element) or fp8_block_dot, written to its columns of each y row; y's other
    columns are left as they were."""
    xs = np.stack([mem.read(x.offset(e * x_stride * 2), BF16, k) for e in range(m)])
    xn = rmsnorm_ref(xs, mem.read(norm_w, BF16, k), eps)
    kb = -(-k // FP8_BLOCK[1])
    for i in range(MAX_SEGMENTS):
        w, s, rows, col, row0 = segs[5 * i : 5 * i + 5]
        if rows == 0:
            continue
        if (fp8_mask >> i) & 1:
            srows = (row0 + rows - 1) // FP8_BLOCK[0] + 1
            sc = mem.view(s, np.float32, (srows, kb))
            out = fp8_block_dot(xn, mem.view(w, FP8, (rows, k)), sc, row0=row0).astype(BF16)
        else:
            out = dot_rows(xn, mem.view(w, BF16, (rows, k))).astype(BF16)
        for e in range(m):
            mem.write(y.offset((e * y_stride + col) * 2), out[e])


@declare("bgemv_fp8", "rmsnorm_gemv_seg_batch", list(_SEG_ARGS), writes=("y",), pdl=True)
def RMSNORM_GEMV_SEG_BATCH(mem, *args):
    """y[e, col_i + r] = W_i[r] . (rmsnorm(x_e) * norm_w) for each row e < m and segment i (BF16, or
    FP8 where bit i of fp8_mask is set); an unused segment has rows 0."""
    _seg_gemv(mem, *args)


@declare("bgemv_fp8", "rmsnorm_gemv_seg_batch_beside", list(_SEG_ARGS), writes=("y",), pdl=Pdl.BESIDE)
def RMSNORM_GEMV_SEG_BATCH_BESIDE(mem, *args):
    """rmsnorm_gemv_seg_batch that may run beside the kernel launched before it (x is older)."""
    _seg_gemv(mem, *args)


@declare("bgemv_fp8", "rmsnorm_gemv_seg_bf16_batch", list(_SEG_ARGS), writes=("y",), pdl=True)
def RMSNORM_GEMV_SEG_BF16_BATCH(mem, *args):
    """rmsnorm_gemv_seg_batch compiled without its FP8 path, for launches of BF16 segments only."""
    _seg_gemv(mem, *args)


@declare("bgemv_fp8", "rmsnorm_gemv_seg_bf16_batch_beside", list(_SEG_ARGS), writes=("y",), pdl=Pdl.BESIDE)
def RMSNORM_GEMV_SEG_BF16_BATCH_BESIDE(mem, *args):
    """rmsnorm_gemv_seg_bf16_batch beside the kernel launched before it."""
    _seg_gemv(mem, *args)


def _seg_kernel(fp8: bool, beside: bool):
    if fp8:
        return RMSNORM_GEMV_SEG_BATCH_BESIDE if beside else RMSNORM_GEMV_SEG_BATCH
    return RMSNORM_GEMV_SEG_BF16_BATCH_BESIDE if beside else RMSNORM_GEMV_SEG_BF16_BATCH


def chunk_rows(m: int) -> int:
    """Rows of x a block stages (ptx/bgemv.cu and ptx/bgemv_fp8.cu): min(m, BATCH_ROWS) rounded up
    to a power of two."""
    return 1 << (min(m, BATCH_ROWS) - 1).bit_length()


def rmsnorm_gemv_seg_batch_smem(m: int, k: int, fp8: bool) -> int:
    """Dynamic shared memory of rmsnorm_gemv_seg_batch: the chunk's normed rows, [M][k] BF16; a
    launch of one row with FP8 segments stages its row as f32 with its float4s permuted within each
    16-element chunk (ptx/bgemv_fp8.cu seg_x_f32, ptx/fp8_block.cuh fp8_xf32_pos), so k rounded up
    to 16 floats. With FP8 segments at least FP8_PAIR_SMEM: a one-row chunk (m = 1, or the last of
    m = 8j + 1) runs two FP8 rows of k <= 2048 at once, reading 2048 floats of its row whatever k
    (ptx/fp8_block.cuh fp8_pair_vec); without that room it runs them one at a time. Eight BF16 rows
    (16 k bytes) hold a one-row chunk's f32 row: positions past k occur only for k > 32."""
    if not fp8:
        return chunk_rows(m) * k * 2
    rows = -(-k // 16) * 16 * 4 if m == 1 else chunk_rows(m) * k * 2
    return max(rows, FP8_PAIR_SMEM)


def bgemv_fp8_batch_smem(m: int, k: int) -> int:
    """Dynamic shared memory of bgemv_fp8_batch: the chunk's x rows [M][k] BF16, at m = 1 too (read
    per warp through L2, one row's x would cost the L2 twice the weight bytes; ptx/bgemv_fp8.cu
    bgemv_fp8_body), or none where that exceeds BGEMV_STAGE_MAX (the rows are then read from
    global memory, with the same bits)."""
    nbytes = chunk_rows(m) * k * 2
    return nbytes if nbytes <= BGEMV_STAGE_MAX else 0


def check_segments(what: str, segments: Sequence[GemvSegment], y_stride: int) -> None:
    """1..4 segments whose output columns do not overlap and fit in a y row of y_stride."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"{what}: {len(segments)} segments (one launch takes 1..{MAX_SEGMENTS})")
    for i, sg in enumerate(segments):
        if not isinstance(sg, GemvSegment):
            raise ValueError(f"{what}: segment {i} is a {type(sg).__name__}, not a GemvSegment")
    spans = sorted((sg.col, sg.col + sg.rows, i) for i, sg in enumerate(segments))
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{what}: the output columns of segments {i} and {j} overlap")
    if spans[-1][1] > y_stride:
        raise ValueError(
            f"{what}: y_stride={y_stride} is shorter than the segments' columns (up to {spans[-1][1]})"
        )


def segment_args(segments: Sequence[GemvSegment]) -> tuple[int, list]:
    """(fp8_mask, the four segments' launch arguments: w, scales, rows, col, row0 each) as the
    segment kernels take them; an unused segment has rows 0 (valid pointers, never read)."""
    fp8_mask = sum(1 << i for i, sg in enumerate(segments) if sg.fp8)
    seg_args: list = []
    for i in range(MAX_SEGMENTS):
        if i < len(segments):
            sg = segments[i]
            seg_args += [sg.w, sg.scales if sg.fp8 else sg.w, sg.rows, sg.col, sg.row0]
        else:
            seg_args += [segments[0].w, segments[0].w, 0, 0, 0]
    return fp8_mask, seg_args


def rmsnorm_gemv_seg_batch(
    gpu,
    *,
    x: DevicePtr,
    x_stride: int,
    norm_w: DevicePtr,
    segments: Sequence[GemvSegment],
    y: DevicePtr,
    y_stride: int,
    m: int,
    k: int,
    eps: float,
    beside: bool = False,
    stream=None,
) -> None:
    """For each row e < m: ``xn_e = rmsnorm(x_e) * norm_w`` (x_e: k BF16 at ``x + e * x_stride``
    elements) and, for every segment, ``y[e, col + r] = bf16(W_seg[r] . xn_e)`` for r < rows (y BF16,
    row e at ``y + e * y_stride`` elements; y's other columns untouched). BF16 segments: f32
    accumulation of the BF16 products, each lane's 16-byte chunks in a fixed order, then the lanes'
    warp_sum (the same bits for every m); FP8 segments: the module's block-scaled arithmetic. One
    launch: the grid strides over all segments' rows (the blocks resident at once) times the chunks
    of 8 rows of m, each weight byte read once per launch. ``beside``: x was produced before the previous launch on the stream, so the
    projection may run beside that launch (runtime.kernel.Pdl.BESIDE)."""
    what = "rmsnorm_gemv_seg_batch"
    check_rows(what, m)
    if not 1 <= k <= _U32_MAX:
        raise ValueError(f"{what}: k={k}")
    if not k <= x_stride <= _U32_MAX:
        raise ValueError(f"{what}: x_stride={x_stride} is shorter than a row (k={k})")
    if not 1 <= y_stride <= _U32_MAX:
        raise ValueError(f"{what}: y_stride={y_stride}")
    check_segments(what, segments, y_stride)
    n = sum(sg.rows for sg in segments)
    if n > _U32_MAX:
        raise ValueError(f"{what}: {n} rows in all")
    fp8_mask, seg_args = segment_args(segments)
    kernel = gpu.kernel(*_seg_kernel(fp8_mask != 0, beside).key)
    smem = rmsnorm_gemv_seg_batch_smem(m, k, fp8_mask != 0)
    grid = grid_stride_blocks(max(1, -(-n // 8)), gpu.resident_blocks(kernel, 256, smem))
    launch(
        gpu,
        kernel,
        (-(-m // BATCH_ROWS), grid),
        256,
        x,
        x_stride,
        norm_w,
        y,
        y_stride,
        m,
        n,
        k,
        eps,
        fp8_mask,
        *seg_args,
        smem=smem,
        stream=stream,
    )


# ---- bgemv_fp8_batch ------------------------------------------------------------------------------------

_FP8_BATCH_ARGS = [
    ("w", PTR),
    ("s", PTR),
    ("s_cols", U32),
    ("col0", U32),
    ("x", PTR),
    ("y", PTR),
    ("m", U32),
    ("heads", U32),
    ("x_stride", U32),
    ("y_stride", U32),
    ("n", U32),
    ("k", U32),
]


def _bgemv_fp8(mem, w, s, s_cols, col0, x, y, m, heads, x_stride, y_stride, n, k, dtype) -> None:
    """y[e, h] = fp8_block_dot of x[e, h] with W8[h] (columns from col0 + h * k, scale rows r // 128);
    each element depends on its weight row and x row alone. What lies between rows' heads is left
    as it was."""
    q = mem.view(w, FP8, (heads, n, k))
    sc = mem.view(s, np.float32, (-(-n // FP8_BLOCK[0]), s_cols))
    xs = np.stack([mem.read(x.offset(e * x_stride * 2), BF16, (heads, k)) for e in range(m)])
    out = np.empty((m, heads, n), np.float32)
    for h in range(heads):
        out[:, h] = fp8_block_dot(xs[:, h], q[h], sc, base=col0 + h * k)
    isz = np.dtype(dtype).itemsize
    for e in range(m):
        mem.write(y.offset(e * y_stride * isz), out[e].astype(dtype))


@declare("bgemv_fp8", "bgemv_fp8_f32_batch", list(_FP8_BATCH_ARGS), writes=("y",), pdl=True, releases=True)
def BGEMV_FP8_F32_BATCH(mem, w, s, s_cols, col0, x, y, m, heads, x_stride, y_stride, n, k):
    """y[e, h] = W8[h] @ x[e, h] for m rows: W8 [heads, n, k] FP8 block-scaled, y f32."""
    _bgemv_fp8(mem, w, s, s_cols, col0, x, y, m, heads, x_stride, y_stride, n, k, np.float32)


@declare("bgemv_fp8", "bgemv_fp8_f32_batch_beside", list(_FP8_BATCH_ARGS), writes=("y",), pdl=Pdl.BESIDE)
def BGEMV_FP8_F32_BATCH_BESIDE(mem, w, s, s_cols, col0, x, y, m, heads, x_stride, y_stride, n, k):
    """bgemv_fp8_f32_batch that may run beside the kernel launched before it (x is older)."""
    _bgemv_fp8(mem, w, s, s_cols, col0, x, y, m, heads, x_stride, y_stride, n, k, np.float32)


@declare("bgemv_fp8", "bgemv_fp8_bf16_batch", list(_FP8_BATCH_ARGS), writes=("y",), pdl=True, releases=True)
def BGEMV_FP8_BF16_BATCH(mem, w, s, s_cols, col0, x, y, m, heads, x_stride, y_stride, n, k):
    """bgemv_fp8_f32_batch with y BF16."""
    _bgemv_fp8(mem, w, s, s_cols, col0, x, y, m, heads, x_stride, y_stride, n, k, BF16)


def bgemv_fp8_batch(
    gpu,
    *,
    w: DevicePtr,
    scales: DevicePtr,
    scale_cols: int,
    col0: int,
    x: DevicePtr,
    x_stride: int,
    y: DevicePtr,
    y_stride: int,
    m: int,
    heads: int,
    n: int,
    k: int,
    out_f32: bool,
    beside: bool = False,
    block: tuple[int, int] = FP8_BLOCK,
    stream=None,
) -> None:
    """Per head h: ``y[e, h, :] = W8[h] (n x k) @ x[e, h, :]`` for e < m, each weight byte read once
    for all m rows. W8 ``[heads, n, k]`` FP8 E4M3; element (r, c) of head h has scale
    ``scales[r // 128][(col0 + h * k + c) // 128]``, scales being the f32 block scales
    ``[ceil(n / 128), scale_cols]`` of the original ``[n, total_cols]`` matrix (o_proj stored as
    ``[groups, H, group_width]`` with the published ``[ceil(H / 128), ceil(heads * v / 128)]``
    scales; col0 the first column of this rank's first group; group_width need not be a multiple of
    128). Row e's heads ``[heads][k]`` BF16 at ``x + e * x_stride`` elements, its outputs
    ``[heads][n]`` (f32 with ``out_f32``, else BF16) at ``y + e * y_stride``. ``beside``: x was
    produced before the previous launch on the stream (f32 output only; Pdl.BESIDE)."""
    what = "bgemv_fp8_batch"
    check_rows(what, m)
    check_block(what, block)
    if beside and not out_f32:
        raise ValueError(f"the beside variant of {what} writes f32 only")
    if heads < 1 or n < 1 or k < 1:
        raise ValueError(f"{what}: bad shape heads={heads}, n={n}, k={k}")
    if col0 < 0:
        raise ValueError(f"{what}: col0={col0}")
    if not heads * k <= x_stride <= _U32_MAX or not heads * n <= y_stride <= _U32_MAX:
        raise ValueError(f"{what}: strides {x_stride} / {y_stride} below a row's {heads} heads")
    need = -(-(col0 + heads * k) // FP8_BLOCK[1])
    if not need <= scale_cols <= _U32_MAX:
        raise ValueError(
            f"{what}: scale_cols={scale_cols}, but columns {col0}..{col0 + heads * k - 1} need {need} "
            "128-column blocks of scales"
        )
    decl = BGEMV_FP8_F32_BATCH_BESIDE if beside else BGEMV_FP8_F32_BATCH if out_f32 else BGEMV_FP8_BF16_BATCH
    grid = (-(-m // BATCH_ROWS), -(-n // (8 * ROWS_PER_WARP)), heads)
    launch(
        gpu,
        gpu.kernel(*decl.key),
        grid,
        256,
        w,
        scales,
        scale_cols,
        col0,
        x,
        y,
        m,
        heads,
        x_stride,
        y_stride,
        n,
        k,
        smem=bgemv_fp8_batch_smem(m, k),
        stream=stream,
    )
