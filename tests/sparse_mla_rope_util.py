"""Worlds and launches for the RoPE part of the absorbed-MLA attention (``sparse_mla_split_batch`` /
``sparse_mla_attend_batch`` with ``q_rope``, ``rope_keys``, ``rope_dim``): tests/test_sparse_mla_rope.py
runs them on the host backend, tests/test_gpu_sparse_mla_rope.py on the GPU.

A world has two sequence slots of a paged FP8 latent cache (shuffled block tables), dense BF16
rope keys per slot, and per entry an absorbed f32 query and a BF16 rope query. The rope values are
twice the latent ones in spread, so that the rope term moves the softmax as much as the latent
term does: a kernel that dropped it, or read another slot's keys, fails the float64 comparison
(``test_the_cases_depend_on_the_rope_term`` checks that of the cases themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from batch_dsa_util import bytes_of, free_all, poison_all, upload_all

from model.kernels import sparse_mla
from model.kernels.batch import ENTRY_BYTES, PAD_SLOT
from runtime.dtypes import BF16, quantize_rows_fp8
from runtime.launch import launch

# Selection sizes: one row, one short of a split, one past it, several splits.
COUNTS = (1, 63, 65, 200)


@dataclass(frozen=True)
class RopeShape:
    heads: int
    dim: int
    rope_dim: int
    slots: int = 2
    slot_rows: int = 300  # not a multiple of the block size
    sel_cap: int = 203  # 4 splits, the last one partial
    bs: int = 16

    @property
    def bps(self) -> int:
        return -(-self.slot_rows // self.bs)

    @property
    def nblocks(self) -> int:
        return self.slots * self.bps + 3

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.dim + self.rope_dim))


# heads below a tile and past one; latent widths 64 (the runtime-width build), 48 and 512 (the GLM
# build); rope widths of one k-step, fewer than the four held, the four (the models'), and more
# (the steps loaded at the product).
SHAPES = [
    RopeShape(heads=3, dim=64, rope_dim=16),
    RopeShape(heads=16, dim=512, rope_dim=64),
    RopeShape(heads=3, dim=512, rope_dim=48),
    RopeShape(heads=16, dim=64, rope_dim=128),
    RopeShape(heads=20, dim=48, rope_dim=80),
]
SHAPE_IDS = [f"h{s.heads}c{s.dim}r{s.rope_dim}" for s in SHAPES]


def rope_world(rng: np.random.Generator, sh: RopeShape, m: int) -> dict[str, np.ndarray]:
    lat = rng.standard_normal((sh.nblocks * sh.bs, sh.dim)).astype(np.float32)
    cache, scales = quantize_rows_fp8(lat)
    perm = rng.permutation(sh.nblocks).astype(np.uint32)
    return {
        "q": rng.standard_normal((m, sh.heads, sh.dim)).astype(np.float32),
        "q_rope": (2.0 * rng.standard_normal((m, sh.heads, sh.rope_dim))).astype(BF16),
        "cache": cache,
        "scales": scales,
        "rope_keys": (2.0 * rng.standard_normal((sh.slots, sh.slot_rows, sh.rope_dim))).astype(BF16),
        "tables": perm[: sh.slots * sh.bps].reshape(sh.slots, sh.bps),
    }


@dataclass
class RopeCase:
    entries: np.ndarray  # [m, 4] u32
    live: list  # (e, slot, rows selected)
    pads: list
    sel: np.ndarray  # [m, sel_cap] u32, poison past each count
    cnt: np.ndarray  # [m] u32, poison for padding


def rope_case(rng: np.random.Generator, sh, m: int, npad: int, counts: Sequence[int] = COUNTS) -> RopeCase:
    """m entries, npad of them padding at random places; the live ones alternate the slots of ``sh``
    (a RopeShape, or anything with its slots, slot_rows and sel_cap) and run through ``counts``
    (from a random start), each selecting distinct rows of its slot in random order."""
    pad_at = set(rng.choice(m, npad, replace=False).tolist()) if npad else set()
    ent = np.zeros((m, 4), np.uint32)
    sel = np.full((m, sh.sel_cap), 0xFFFFFFFF, np.uint32)
    cnt = np.full(m, 0xFFFFFFFF, np.uint32)
    live, pads = [], []
    k0 = int(rng.integers(0, len(counts)))
    for e in range(m):
        ent[e, 2] = 1000 + e  # the token word: ignored
        if e in pad_at:
            ent[e, 0], ent[e, 1] = PAD_SLOT, 77
            pads.append(e)
            continue
        slot = (len(live) + k0) % sh.slots
        n = counts[(len(live) + k0) % len(counts)]
        rows = rng.choice(sh.slot_rows, n, replace=False).astype(np.uint32)
        ent[e, 0], ent[e, 1] = slot, 5
        sel[e, :n], cnt[e] = rows, n
        live.append((e, slot, rows))
    return RopeCase(ent, live, pads, sel, cnt)


def rope_f64(
    world: dict, sh: RopeShape, e: int, slot: int, rows: np.ndarray, rope: bool = True, key_slot=None
):
    """float64 attention of entry e over its rows; ``rope`` False leaves the RoPE term out and
    ``key_slot`` takes the rope keys of another slot (both only to show the cases depend on them)."""
    c = world["cache"].astype(np.float64) * world["scales"][:, None].astype(np.float64)
    paged = world["tables"][slot][rows // sh.bs].astype(np.int64) * sh.bs + rows % sh.bs
    s = world["q"][e].astype(np.float64) @ c[paged].T
    if rope:
        kr = world["rope_keys"][slot if key_slot is None else key_slot][rows].astype(np.float64)
        s += world["q_rope"][e].astype(np.float64) @ kr.T
    s *= sh.scale
    p = np.exp(s - s.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ c[paged]


def _sizes(sh: RopeShape, m: int, split: bool) -> dict[str, int]:
    sizes = {"out": m * sh.heads * sh.dim * 2}
    if split:
        pb, mb = sparse_mla.split_workspace(sh.heads, sh.dim, sh.sel_cap)
        sizes.update(part=m * pb, ml=m * mb)
    return sizes


def _geometry(sh: RopeShape, m: int) -> dict:
    return dict(
        m=m,
        slot_rows=sh.slot_rows,
        sel_cap=sh.sel_cap,
        heads=sh.heads,
        dim=sh.dim,
        block_size=sh.bs,
        scale=sh.scale,
    )


def _helper(gpu, p: dict, sh: RopeShape, m: int, split: bool, mode: str, at: dict) -> None:
    """The launch helper over p's buffers; ``mode``: "rope" (q_rope, rope_keys, rope_dim of the
    shape), "nope" (None, None, 0 given explicitly), "old" (the call without the RoPE keywords)."""
    kw = dict(
        q=p["q"],
        cache=p["cache"],
        scales=p["scales"],
        tables=p["tables"],
        selected=p["sel"],
        count=p["cnt"],
        out=p["out"],
        entries=p["entries"],
        **_geometry(sh, m),
    )
    if split:
        kw.update(part=p["part"], ml=p["ml"])
    if mode == "rope":
        kw.update(q_rope=p["q_rope"], rope_keys=p["rope_keys"], rope_dim=sh.rope_dim)
    elif mode == "nope":
        kw.update(q_rope=None, rope_keys=None, rope_dim=0)
    kw.update(at)
    if split:
        sparse_mla.sparse_mla_split_batch(gpu, **kw)
    else:
        sparse_mla.sparse_mla_attend_batch(gpu, **kw)


def raw_launch(gpu, p: dict, sh: RopeShape, m: int, split: bool, rope_dim: int, q_rope, rope_keys) -> None:
    """The kernels launched directly (the helpers refuse what this passes: rope pointers with
    rope_dim 0, a rope_dim the kernels do not take), grids and shared memory as the helpers'."""
    g = _geometry(sh, m)
    head = (p["q"], q_rope, p["cache"], p["scales"], rope_keys, p["tables"], p["sel"], p["cnt"])
    tail = (
        p["entries"],
        m,
        g["slot_rows"],
        g["sel_cap"],
        g["heads"],
        g["dim"],
        rope_dim,
        g["block_size"],
        g["scale"],
    )
    if split:
        grid = (sparse_mla.batch_splits(sh.sel_cap), -(-sh.heads // sparse_mla.HEAD_TILE), m)
        smem = sparse_mla.partial_smem(sh.dim, rope_dim if sparse_mla.rope_dim_ok(rope_dim) else 0)
        kern = gpu.kernel(*sparse_mla.SPARSE_MLA_PARTIAL_BATCH.key)
        launch(gpu, kern, grid, 256, *head, p["part"], p["ml"], *tail, smem=smem)
        kern = gpu.kernel(*sparse_mla.SPARSE_MLA_COMBINE_BATCH.key)
        args = (p["part"], p["ml"], p["cnt"], p["out"], p["entries"], m, sh.sel_cap, sh.heads, sh.dim)
        launch(gpu, kern, (sh.heads, -(-sh.dim // 128), m), 256, *args)
    else:
        launch(
            gpu,
            gpu.kernel(*sparse_mla.SPARSE_MLA_ATTEND_BATCH.key),
            (sh.heads, m),
            256,
            *head,
            p["out"],
            *tail,
        )


def run_rope(
    gpu, world: dict, sh: RopeShape, case: RopeCase, split: bool, mode: str = "rope", invariance: bool = True
) -> dict[str, np.ndarray]:
    """One batched launch into poisoned (0xFF) outputs and workspace: every live entry's output
    written (no NaN), padding entries' untouched; with ``invariance`` each entry launched alone
    (m = 1, pointers offset to its rows) gives the same bytes, workspace included, and the inputs
    are unchanged. ``mode``: as _helper, or "raw_nope": rope_dim 0 launched directly with NaN-filled
    q_rope and rope_keys (which it must not read). Returns the bytes of out (and part, ml)."""
    m = len(case.entries)
    sizes = _sizes(sh, m, split)
    inputs = {k: world[k] for k in ("q", "q_rope", "cache", "scales", "rope_keys", "tables")}
    p = upload_all(gpu, {**inputs, "sel": case.sel, "cnt": case.cnt, "entries": case.entries})
    nan = poison_all(gpu, {"q_rope": world["q_rope"].nbytes, "rope_keys": world["rope_keys"].nbytes})
    variants = ("batch", "alone") if invariance else ("batch",)
    outs = {v: poison_all(gpu, sizes) for v in variants}
    try:

        def go(bufs: dict, mm: int, at: dict) -> None:
            if mode == "raw_nope":
                raw_launch(gpu, {**bufs, **at}, sh, mm, split, 0, nan["q_rope"], nan["rope_keys"])
            else:
                _helper(gpu, bufs, sh, mm, split, mode, at)

        go({**p, **outs["batch"]}, m, {})
        got = bytes_of(gpu, outs["batch"], sizes)
        o = got["out"].view(BF16).reshape(m, sh.heads, sh.dim)
        for e, _, _ in case.live:
            assert not np.isnan(o[e].astype(np.float32)).any(), f"entry {e}: output not (fully) written"
        for e in case.pads:
            for k in sizes:
                assert (got[k].reshape(m, -1)[e] == 0xFF).all(), f"padding entry {e}: {k} written"
        if invariance:
            pb, mb = sparse_mla.split_workspace(sh.heads, sh.dim, sh.sel_cap)
            hd = sh.heads * sh.dim
            bufs = {**p, **outs["alone"]}
            for e in range(m):
                at = {
                    "q": p["q"].offset(e * hd * 4),
                    "sel": p["sel"].offset(e * sh.sel_cap * 4),
                    "cnt": p["cnt"].offset(e * 4),
                    "out": bufs["out"].offset(e * hd * 2),
                    "entries": p["entries"].offset(e * ENTRY_BYTES),
                }
                if mode == "rope":
                    at["q_rope"] = p["q_rope"].offset(e * sh.heads * sh.rope_dim * 2)
                if split:
                    at.update(part=bufs["part"].offset(e * pb), ml=bufs["ml"].offset(e * mb))
                go({**bufs, **at}, 1, {})
            alone = bytes_of(gpu, outs["alone"], sizes)
            for k in sizes:
                assert np.array_equal(alone[k], got[k]), f"{k}: an entry differs from its m = 1 launch"
            kept = bytes_of(gpu, p, {k: v.nbytes for k, v in inputs.items()})
            for k, v in inputs.items():
                assert np.array_equal(kept[k], np.ascontiguousarray(v).reshape(-1).view(np.uint8)), (
                    f"{k} changed"
                )
        return got
    finally:
        free_all(gpu, p, nan, *outs.values())


def outputs_f32(got: dict, sh: RopeShape, m: int) -> np.ndarray:
    return got["out"].view(BF16).reshape(m, sh.heads, sh.dim).astype(np.float32)


def assert_close(g: np.ndarray, ref: np.ndarray, rtol: float, atol: float, what: str) -> None:
    g64, r64 = np.asarray(g, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(g64).any(), f"{what}: NaN (unwritten?) elements"
    err = np.abs(g64 - r64)
    bad = err > rtol * np.abs(r64) + atol
    if bad.any():
        i = np.unravel_index(int(np.argmax(err - rtol * np.abs(r64))), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} outside rtol {rtol} atol {atol}; worst at {i}: "
            f"{g64[i]} vs {r64[i]}"
        )
