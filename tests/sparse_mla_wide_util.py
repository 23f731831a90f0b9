"""Worlds, launches and float64 references for the wide absorbed-MLA pair (``sparse_mla_wide_batch``:
``sparse_mla_partial_wide_batch`` + ``sparse_mla_combine_wide_batch``): tests/test_sparse_mla_wide.py
runs them on the host backend, tests/test_gpu_sparse_mla_wide.py on the GPU.

A world has two sequence slots of a paged FP8 latent cache (shuffled block tables), dense BF16 rope
keys per slot (with a rope part), and per entry an absorbed f32 query and a BF16 rope query; the
rope values are twice the latent ones in spread, so that the rope term moves the softmax as much as
the latent term does. A shape's selection capacity spans ``n_splits`` splits of its split length,
the last one partial; the counts run through an empty selection, one row, both sides of the 64-row
tile and of the split, and the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from batch_dsa_util import bytes_of, free_all, poison_all, upload_all
from sparse_mla_rope_util import RopeCase, assert_close, outputs_f32, rope_case  # noqa: F401 - re-exported to the wide tests

from model.kernels import sparse_mla
from model.kernels.batch import ENTRY_BYTES
from runtime.dtypes import BF16, quantize_rows_fp8
from runtime.launch import launch

# Outputs: BF16, so about 2**-8 relative; the kernel's scores are f32 products of f32-exact
# operands (the query's hi/lo halves), so the output's rounding dominates.
RTOL = 2.0**-7
ATOL_OF_MAX = 2.0**-9
# The workspace (f32 partials, before the merge): per split and head, within 2**-10 relative plus
# 2**-12 of the head's largest partial; the max within 2**-12 (1 + |max|), the sum within 2**-10
# relative. f32 sums over at most 256 rows and 512 dims are some 1e-5 relative; a row in the wrong
# split, a lost rescale or a missing rope term moves them by far more
# (test_the_workspace_check_depends_on_the_split).
PART_RTOL, PART_ATOL_OF_MAX = 2.0**-10, 2.0**-12
M_ATOL, L_RTOL = 2.0**-12, 2.0**-10


@dataclass(frozen=True)
class WideShape:
    heads: int
    dim: int
    rope_dim: int
    split_rows: int
    n_splits: int = 3
    slots: int = 2
    bs: int = 16

    @property
    def sel_cap(self) -> int:
        return (self.n_splits - 1) * self.split_rows + 37  # the last split partial

    @property
    def slot_rows(self) -> int:
        return self.sel_cap + 97  # not a multiple of the block size

    @property
    def bps(self) -> int:
        return -(-self.slot_rows // self.bs)

    @property
    def nblocks(self) -> int:
        return self.slots * self.bps + 3

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.dim + self.rope_dim))

    @property
    def splits(self) -> int:
        return sparse_mla.wide_splits(self.sel_cap, self.split_rows)

    def counts(self) -> list[int]:
        r = self.split_rows
        return sorted(c for c in {0, 1, 63, 64, 65, r - 1, r + 1, 2 * r, self.sel_cap} if c <= self.sel_cap)


def shape_id(sh: WideShape) -> str:
    return f"h{sh.heads}c{sh.dim}r{sh.rope_dim}s{sh.split_rows}"


# Heads below a tile, one tile, tiles and a partial one, 64 and past a 64-head group (two groups,
# the second partial), 128 (DeepSeek-V3.2: two groups); latent widths 48 and 64 (the runtime-width
# build) and 512 (the GLM build); NoPE and rope widths of 1 to 4 k-steps; every split length.
SHAPES = [
    WideShape(heads=3, dim=64, rope_dim=16, split_rows=64),
    WideShape(heads=8, dim=48, rope_dim=0, split_rows=128),
    WideShape(heads=16, dim=512, rope_dim=64, split_rows=256),
    WideShape(heads=24, dim=512, rope_dim=0, split_rows=64),
    WideShape(heads=20, dim=48, rope_dim=48, split_rows=192),
    WideShape(heads=32, dim=512, rope_dim=64, split_rows=128),
    WideShape(heads=72, dim=64, rope_dim=32, split_rows=64),
    WideShape(heads=64, dim=512, rope_dim=0, split_rows=256, n_splits=2),
]
SHAPE_IDS = [shape_id(s) for s in SHAPES]


def wide_world(rng: np.random.Generator, sh: WideShape, m: int) -> dict[str, np.ndarray]:
    lat = rng.standard_normal((sh.nblocks * sh.bs, sh.dim)).astype(np.float32)
    cache, scales = quantize_rows_fp8(lat)
    perm = rng.permutation(sh.nblocks).astype(np.uint32)
    world = {
        "q": rng.standard_normal((m, sh.heads, sh.dim)).astype(np.float32),
        "cache": cache,
        "scales": scales,
        "tables": perm[: sh.slots * sh.bps].reshape(sh.slots, sh.bps),
    }
    if sh.rope_dim:
        world["q_rope"] = (2.0 * rng.standard_normal((m, sh.heads, sh.rope_dim))).astype(BF16)
        world["rope_keys"] = (2.0 * rng.standard_normal((sh.slots, sh.slot_rows, sh.rope_dim))).astype(BF16)
    return world


WideCase = RopeCase


def wide_case(rng: np.random.Generator, sh: WideShape, m: int, npad: int) -> WideCase:
    """rope_case through the shape's counts."""
    return rope_case(rng, sh, m, npad, sh.counts())


def _scores_f64(world, sh: WideShape, e: int, slot: int, rows: np.ndarray, rope: bool = True):
    c = world["cache"].astype(np.float64) * world["scales"][:, None].astype(np.float64)
    paged = world["tables"][slot][rows // sh.bs].astype(np.int64) * sh.bs + rows % sh.bs
    s = world["q"][e].astype(np.float64) @ c[paged].T
    if rope and sh.rope_dim:
        s += world["q_rope"][e].astype(np.float64) @ world["rope_keys"][slot][rows].astype(np.float64).T
    return s * sh.scale, c[paged]


def wide_f64(world, sh: WideShape, e: int, slot: int, rows: np.ndarray, rope: bool = True) -> np.ndarray:
    """float64 attention of entry e over its rows, [heads, dim] (zeros for an empty selection);
    ``rope`` False leaves the RoPE term out (only to show the cases depend on it)."""
    if rows.size == 0:
        return np.zeros((sh.heads, sh.dim))
    s, c = _scores_f64(world, sh, e, slot, rows, rope)
    p = np.exp(s - s.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ c


def splits_f64(world, sh: WideShape, e: int, slot: int, rows: np.ndarray, split_rows: int | None = None):
    """float64 partials of entry e: per split of ``split_rows`` (the shape's) rows of its
    selection, sum_j exp(s_j - m) c_j over the split's rows and (m, sum_j exp(s_j - m)), m the
    split's max: [splits, heads, dim] and [splits, heads, 2]."""
    r = split_rows or sh.split_rows
    s, c = _scores_f64(world, sh, e, slot, rows)
    parts, mls = [], []
    for j0 in range(0, rows.size, r):
        seg = slice(j0, min(rows.size, j0 + r))
        mx = s[:, seg].max(1)
        x = np.exp(s[:, seg] - mx[:, None])
        parts.append(x @ c[seg])
        mls.append(np.stack([mx, x.sum(1)], 1))
    if not parts:
        return np.zeros((0, sh.heads, sh.dim)), np.zeros((0, sh.heads, 2))
    return np.stack(parts), np.stack(mls)


def workspace_f32(got: dict, sh: WideShape, m: int):
    """The part and ml bytes as f32 [m, splits, heads, dim] and [m, splits, heads, 2]."""
    part = got["part"].view(np.float32).reshape(m, sh.splits, sh.heads, sh.dim)
    ml = got["ml"].view(np.float32).reshape(m, sh.splits, sh.heads, 2)
    return part, ml


def check_workspace(got: dict, sh: WideShape, case: WideCase, world: dict) -> None:
    """Each live entry's written splits against splits_f64 (the tolerances above), and the splits
    past its count unwritten (poison)."""
    m = len(case.entries)
    part, ml = workspace_f32(got, sh, m)
    pb = got["part"].reshape(m, sh.splits, -1)
    mb = got["ml"].reshape(m, sh.splits, -1)
    for e, slot, rows in case.live:
        rp, rml = splits_f64(world, sh, e, slot, rows)
        ns = rp.shape[0]
        assert (pb[e, ns:] == 0xFF).all() and (mb[e, ns:] == 0xFF).all(), (
            f"entry {e}: a split past its {rows.size} rows written"
        )
        g, gm = part[e, :ns].astype(np.float64), ml[e, :ns].astype(np.float64)
        assert not np.isnan(g).any() and not np.isnan(gm).any(), f"entry {e}: a split not (fully) written"
        tol = PART_RTOL * np.abs(rp) + PART_ATOL_OF_MAX * np.abs(rp).max(2, keepdims=True)
        bad = np.abs(g - rp) > tol
        assert not bad.any(), f"entry {e}: {int(bad.sum())} partials outside the tolerance"
        assert (np.abs(gm[..., 0] - rml[..., 0]) <= M_ATOL * (1 + np.abs(rml[..., 0]))).all(), (
            f"entry {e}: max"
        )
        assert (np.abs(gm[..., 1] - rml[..., 1]) <= L_RTOL * rml[..., 1]).all(), f"entry {e}: sum"


def sizes(sh: WideShape, m: int) -> dict[str, int]:
    pb, mb = sparse_mla.wide_workspace(sh.heads, sh.dim, sh.sel_cap, sh.split_rows)
    return {"out": m * sh.heads * sh.dim * 2, "part": m * pb, "ml": m * mb}


def _geometry(sh: WideShape, m: int) -> dict:
    return dict(
        m=m,
        slot_rows=sh.slot_rows,
        sel_cap=sh.sel_cap,
        heads=sh.heads,
        dim=sh.dim,
        block_size=sh.bs,
        scale=sh.scale,
    )


def helper(gpu, p: dict, sh: WideShape, m: int, mode: str = "rope") -> None:
    """sparse_mla_wide_batch over p's buffers; ``mode``: "rope" (q_rope, rope_keys, rope_dim of the
    shape; none of them for NoPE), "nope" (None, None, 0 given explicitly)."""
    kw = dict(
        q=p["q"],
        cache=p["cache"],
        scales=p["scales"],
        tables=p["tables"],
        selected=p["sel"],
        count=p["cnt"],
        out=p["out"],
        entries=p["entries"],
        part=p["part"],
        ml=p["ml"],
        split_rows=sh.split_rows,
        **_geometry(sh, m),
    )
    if mode == "rope" and sh.rope_dim:
        kw.update(q_rope=p["q_rope"], rope_keys=p["rope_keys"], rope_dim=sh.rope_dim)
    elif mode == "nope":
        kw.update(q_rope=None, rope_keys=None, rope_dim=0)
    sparse_mla.sparse_mla_wide_batch(gpu, **kw)


def raw_wide(
    gpu, p: dict, sh: WideShape, m: int, *, rope_dim: int, q_rope, rope_keys, split_rows=None, dim=None
) -> None:
    """Both kernels launched directly (the helper refuses what this may pass: rope pointers with
    rope_dim 0, a rope_dim, split length or width the kernels do not take), grids and shared memory
    as the helper's (the largest for a rope_dim or length past the kernel's)."""
    r = sh.split_rows if split_rows is None else split_rows
    d = sh.dim if dim is None else dim
    g = _geometry(sh, m)
    splits = sparse_mla.wide_splits(sh.sel_cap, max(r, 1))
    smem = sparse_mla.wide_smem(rope_dim, min(max(r, 64), sparse_mla.WIDE_MAX_SPLIT_ROWS))
    kern = gpu.kernel(*sparse_mla.SPARSE_MLA_PARTIAL_WIDE_BATCH.key)
    head = (
        p["q"],
        q_rope,
        p["cache"],
        p["scales"],
        rope_keys,
        p["tables"],
        p["sel"],
        p["cnt"],
        p["part"],
        p["ml"],
    )
    tail = (
        p["entries"],
        m,
        g["slot_rows"],
        g["sel_cap"],
        g["heads"],
        d,
        rope_dim,
        g["block_size"],
        g["scale"],
        r,
    )
    launch(gpu, kern, (splits, -(-sh.heads // 64), m), 256, *head, *tail, smem=smem)
    kern = gpu.kernel(*sparse_mla.SPARSE_MLA_COMBINE_WIDE_BATCH.key)
    args = (p["part"], p["ml"], p["cnt"], p["out"], p["entries"], m, sh.sel_cap, sh.heads, d, r)
    launch(gpu, kern, (-(-sh.heads // 2), m), 256, *args)


def inputs_of(world: dict, case: WideCase) -> dict[str, np.ndarray]:
    return {**world, "sel": case.sel, "cnt": case.cnt, "entries": case.entries}


def run_wide(
    gpu, world: dict, sh: WideShape, case: WideCase, mode: str = "rope", invariance: bool = True
) -> dict[str, np.ndarray]:
    """One batched launch into poisoned (0xFF) output and workspace: every live entry's output
    written (no NaN), padding entries' output and workspace untouched; with ``invariance`` each
    entry launched alone (m = 1, pointers offset to its rows) gives the same bytes, workspace
    included, and the inputs are unchanged. ``mode``: as ``helper``, or "raw_nope": rope_dim 0
    launched directly with NaN-filled q_rope and rope_keys (which it must not read). Returns the
    bytes of out, part and ml."""
    m = len(case.entries)
    sz = sizes(sh, m)
    p = upload_all(gpu, inputs_of(world, case))
    nan = poison_all(gpu, {"q_rope": 64, "rope_keys": 64})
    variants = ("batch", "alone") if invariance else ("batch",)
    outs = {v: poison_all(gpu, sz) for v in variants}
    try:

        def go(bufs: dict, mm: int) -> None:
            if mode == "raw_nope":
                raw_wide(gpu, bufs, sh, mm, rope_dim=0, q_rope=nan["q_rope"], rope_keys=nan["rope_keys"])
            else:
                helper(gpu, bufs, sh, mm, mode)

        go({**p, **outs["batch"]}, m)
        got = bytes_of(gpu, outs["batch"], sz)
        o = got["out"].view(BF16).reshape(m, sh.heads, sh.dim)
        for e, _, _ in case.live:
            assert not np.isnan(o[e].astype(np.float32)).any(), f"entry {e}: output not (fully) written"
        for e in case.pads:
            for k in sz:
                assert (got[k].reshape(m, -1)[e] == 0xFF).all(), f"padding entry {e}: {k} written"
        if invariance:
            pb, mb = sparse_mla.wide_workspace(sh.heads, sh.dim, sh.sel_cap, sh.split_rows)
            hd = sh.heads * sh.dim
            bufs = {**p, **outs["alone"]}
            for e in range(m):
                at = {
                    "q": p["q"].offset(e * hd * 4),
                    "sel": p["sel"].offset(e * sh.sel_cap * 4),
                    "cnt": p["cnt"].offset(e * 4),
                    "out": bufs["out"].offset(e * hd * 2),
                    "entries": p["entries"].offset(e * ENTRY_BYTES),
                    "part": bufs["part"].offset(e * pb),
                    "ml": bufs["ml"].offset(e * mb),
                }
                if sh.rope_dim and mode == "rope":
                    at["q_rope"] = p["q_rope"].offset(e * sh.heads * sh.rope_dim * 2)
                go({**bufs, **at}, 1)
            alone = bytes_of(gpu, outs["alone"], sz)
            for k in sz:
                assert np.array_equal(alone[k], got[k]), f"{k}: an entry differs from its m = 1 launch"
            inputs = inputs_of(world, case)
            kept = bytes_of(gpu, p, {k: v.nbytes for k, v in inputs.items()})
            for k, v in inputs.items():
                assert np.array_equal(kept[k], np.ascontiguousarray(v).reshape(-1).view(np.uint8)), (
                    f"{k} changed"
                )
        return got
    finally:
        free_all(gpu, p, nan, *outs.values())


def check_outputs(got: dict, sh: WideShape, case: WideCase, ref_of) -> None:
    """Each live entry's output against ``ref_of(e, slot, rows)`` (float64 or a twin's output)
    within RTOL plus ATOL_OF_MAX of its largest; an empty selection exactly zero."""
    o = outputs_f32(got, sh, len(case.entries))
    for e, slot, rows in case.live:
        if rows.size == 0:
            assert not o[e].any(), f"entry {e}: an empty selection must give zeros"
            continue
        ref = ref_of(e, slot, rows)
        assert_close(o[e], ref, RTOL, float(np.abs(ref).max()) * ATOL_OF_MAX, f"entry {e} ({rows.size} rows)")
