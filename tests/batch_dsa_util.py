"""Slot-pool worlds for the batched DSA kernels' tests (tests/test_batch_dsa.py on the host backend,
tests/test_gpu_batch_dsa.py on the GPU): per-sequence state laid into slot pools as
model/kernels/batch.py describes (``SlotGeometry``), batch entries, and the launches both files
make: the batched kernel over m entries, and the batched kernel at m = 1 for one entry (pointers
offset to that entry's rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from kernel_util import random_bf16

from model.kernels import dsa_cache, dsa_select, sparse_mla
from model.kernels.batch import ENTRY_BYTES, PAD_SLOT, SlotGeometry
from runtime.dtypes import FP8, quantize_rows_fp8

EPS, LN_EPS = 1e-5, 1e-6


def random_fp8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random E4M3 bytes of every finite code (NaN codes 0x7F / 0xFF moved to +-0), as FP8."""
    b = np.frombuffer(rng.bytes(int(np.prod(shape))), np.uint8).copy()
    b[(b & 0x7F) == 0x7F] &= 0x80
    return b.view(FP8).reshape(shape)


def upload_all(gpu, arrays: dict[str, np.ndarray]) -> dict:
    ptrs = {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        ptrs[name] = gpu.alloc(max(a.nbytes, 1))
        if a.nbytes:
            gpu.copy_h2d(ptrs[name], a)
    return ptrs


def poison_all(gpu, sizes: dict[str, int]) -> dict:
    ptrs = {}
    for name, n in sizes.items():
        ptrs[name] = gpu.alloc(max(n, 1))
        gpu.memset(ptrs[name], 0xFF, max(n, 1))
    return ptrs


def bytes_of(gpu, ptrs: dict, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    out = {}
    for name, n in sizes.items():
        buf = np.empty(n, np.uint8)
        if n:
            gpu.copy_d2h(buf, ptrs[name])
        out[name] = buf
    return out


def free_all(gpu, *ptr_dicts) -> None:
    for d in ptr_dicts:
        for p in d.values():
            gpu.free(p)


# ---- dsa_cache_write ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheShape:
    slots: int
    slot_rows: int
    C: int
    idim: int
    kpool: int
    bs: int = 16
    spare_blocks: int = 3

    @property
    def geo(self) -> SlotGeometry:
        return SlotGeometry(self.slot_rows, self.idim, self.kpool, self.bs)

    @property
    def nblocks(self) -> int:
        return self.slots * self.geo.blocks_per_slot + self.spare_blocks

    @property
    def stride(self) -> int:
        # The fused output holds more columns than the cache write reads; 8-element multiple so
        # every fused row is 16-byte aligned as the proposer's are (rms_divisor's vector path).
        return self.C + 2 * self.idim + 8


STATE = ("cache", "scales", "keys", "gates", "pool_keys", "pool_scales")


def cache_world(rng: np.random.Generator, sh: CacheShape) -> dict[str, np.ndarray]:
    """Slot pools holding earlier rows (pools a new row completes read them), block tables that
    give each slot a shuffled disjoint set of blocks, and the weights."""
    g = sh.geo
    perm = rng.permutation(sh.nblocks).astype(np.uint32)
    rows = sh.nblocks * sh.bs
    return {
        "cache": random_fp8(rng, (rows, sh.C)),
        "scales": (rng.random(rows) + 0.5).astype(np.float32),
        "tables": perm[: sh.slots * g.blocks_per_slot].reshape(sh.slots, g.blocks_per_slot),
        "keys": random_bf16(rng, (sh.slots, sh.slot_rows, sh.idim), exp_lo=-1),
        "gates": random_bf16(rng, (sh.slots, sh.slot_rows, sh.idim), exp_lo=-1),
        "pool_keys": random_fp8(rng, (sh.slots * g.pools_per_slot, sh.idim)),
        "pool_scales": (rng.random(sh.slots * g.pools_per_slot) + 0.5).astype(np.float32),
        "kv_w": random_bf16(rng, sh.C, exp_lo=-1),
        "kw": random_bf16(rng, sh.idim, exp_lo=-1),
        "kb": random_bf16(rng, sh.idim, exp_lo=-4),
        "ape": random_bf16(rng, (sh.kpool, sh.idim), exp_lo=-1),
    }


def cache_write_batch(gpu, p: dict, sh: CacheShape, fused, entries, m: int, row_add: int) -> None:
    dsa_cache.dsa_cache_write_batch(
        gpu,
        fused=fused,
        stride=sh.stride,
        kv_norm_w=p["kv_w"],
        cache=p["cache"],
        scales=p["scales"],
        tables=p["tables"],
        knorm_w=p["kw"],
        knorm_b=p["kb"],
        keys=p["keys"],
        gates=p["gates"],
        ape=p["ape"],
        pool_keys=p["pool_keys"],
        pool_scales=p["pool_scales"],
        entries=entries,
        m=m,
        row_add=row_add,
        slot_rows=sh.slot_rows,
        C=sh.C,
        idim=sh.idim,
        block_size=sh.bs,
        kpool=sh.kpool,
        eps=EPS,
        ln_eps=LN_EPS,
    )


def state_bytes(gpu, p: dict, world: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return bytes_of(gpu, p, {k: world[k].nbytes for k in STATE})


# ---- indexer scores, selection ------------------------------------------------------------------


@dataclass(frozen=True)
class ScoreShape:
    slots: int
    slot_rows: int
    heads: int
    dim: int
    kpool: int

    @property
    def geo(self) -> SlotGeometry:
        return SlotGeometry(self.slot_rows, self.dim, self.kpool, 16)

    @property
    def pps(self) -> int:
        return self.geo.pools_per_slot


def score_world(rng: np.random.Generator, sh: ScoreShape, m: int) -> dict[str, np.ndarray]:
    """Pool keys of every slot, and per entry a query [heads][dim] and head weights [heads], each
    row padded by a few elements (q_stride, w_stride above the dense size)."""
    n = sh.slots * sh.pps
    pk, ps = quantize_rows_fp8(rng.standard_normal((n, sh.dim)).astype(np.float32))
    return {
        "q": random_bf16(rng, (m, sh.heads * sh.dim + 8), exp_lo=-3),
        "w": random_bf16(rng, (m, sh.heads + 3), exp_lo=-2),
        "pool_keys": pk,
        "pool_scales": ps,
    }


def scores_batch(gpu, p: dict, sh: ScoreShape, scores, entries, m: int, row_add: int) -> None:
    dsa_select.indexer_scores_batch(
        gpu,
        q=p["q"],
        q_stride=sh.heads * sh.dim + 8,
        w=p["w"],
        w_stride=sh.heads + 3,
        pool_keys=p["pool_keys"],
        pool_scales=p["pool_scales"],
        scores=scores,
        entries=entries,
        m=m,
        row_add=row_add,
        slot_rows=sh.slot_rows,
        heads=sh.heads,
        dim=sh.dim,
        kpool=sh.kpool,
        w_scale=1.0 / sh.heads**0.5,
    )


def scores_entry(gpu, p: dict, sh: ScoreShape, scores, entries, e: int, row_add: int) -> None:
    """indexer_scores_batch at m = 1 for entry e: every pointer offset to e's rows."""
    dsa_select.indexer_scores_batch(
        gpu,
        q=p["q"].offset(e * (sh.heads * sh.dim + 8) * 2),
        q_stride=0,
        w=p["w"].offset(e * (sh.heads + 3) * 2),
        w_stride=0,
        pool_keys=p["pool_keys"],
        pool_scales=p["pool_scales"],
        scores=scores.offset(e * sh.pps * 4),
        entries=entries.offset(e * ENTRY_BYTES),
        m=1,
        row_add=row_add,
        slot_rows=sh.slot_rows,
        heads=sh.heads,
        dim=sh.dim,
        kpool=sh.kpool,
        w_scale=1.0 / sh.heads**0.5,
    )


def scores_f64(world: dict, sh: ScoreShape, e: int, slot: int, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(float64 scores of entry e's complete pools, the magnitude bound's |terms| sum)."""
    npools = (row + 1) // sh.kpool
    base = slot * sh.pps
    keys = world["pool_keys"][base : base + npools].astype(np.float64)
    keys *= world["pool_scales"][base : base + npools, None].astype(np.float64)
    q = world["q"][e, : sh.heads * sh.dim].astype(np.float64).reshape(sh.heads, sh.dim)
    w = world["w"][e, : sh.heads].astype(np.float64) * (1.0 / sh.heads**0.5)
    ref = w @ np.maximum(q @ keys.T, 0) / np.sqrt(sh.dim)
    mag = np.abs(w) @ (np.abs(q) @ np.abs(keys).T) / np.sqrt(sh.dim)
    return ref, mag


def select_batch(
    gpu, scores, selected, count, entries, m, row_add, sh: ScoreShape, sel_cap, topk, tail
) -> None:
    dsa_select.select_topk_pools_batch(
        gpu,
        scores=scores,
        selected=selected,
        count=count,
        entries=entries,
        m=m,
        row_add=row_add,
        slot_rows=sh.slot_rows,
        sel_cap=sel_cap,
        topk_pools=topk,
        kpool=sh.kpool,
        tail=tail,
    )


def select_entry(
    gpu, scores, selected, count, entries, e, row_add, sh: ScoreShape, sel_cap, topk, tail
) -> None:
    select_batch(
        gpu,
        scores.offset(e * sh.pps * 4),
        selected.offset(e * sel_cap * 4),
        count.offset(e * 4),
        entries.offset(e * ENTRY_BYTES),
        1,
        row_add,
        sh,
        sel_cap,
        topk,
        tail,
    )


# ---- sparse MLA ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnShape:
    slots: int
    slot_rows: int
    heads: int
    dim: int
    sel_cap: int
    bs: int = 16

    @property
    def bps(self) -> int:
        return -(-self.slot_rows // self.bs)

    @property
    def nblocks(self) -> int:
        return self.slots * self.bps + 2


def attn_world(rng: np.random.Generator, sh: AttnShape, m: int) -> dict[str, np.ndarray]:
    """A latent cache of FP8 rows with row scales, block tables (shuffled, disjoint per slot), and
    per entry an absorbed query [heads][dim] f32."""
    lat = rng.standard_normal((sh.nblocks * sh.bs, sh.dim)).astype(np.float32)
    cq, cs = quantize_rows_fp8(lat)
    perm = rng.permutation(sh.nblocks).astype(np.uint32)
    return {
        "q": (rng.standard_normal((m, sh.heads, sh.dim)) * 0.2).astype(np.float32),
        "cache": cq,
        "scales": cs,
        "tables": perm[: sh.slots * sh.bps].reshape(sh.slots, sh.bps),
    }


def random_selection(rng, rows_below: int, n: int) -> np.ndarray:
    return np.sort(rng.choice(rows_below, n, replace=False)).astype(np.uint32)


def attn_batch(gpu, p: dict, sh: AttnShape, entries, m: int, split: bool, **at) -> None:
    """The batched attention (split pair or fallback) over p's buffers; ``at`` overrides any of
    q, selected, count, out, part, ml (the m = 1 launches pass offset pointers)."""
    bufs = {"q": p["q"], "selected": p["sel"], "count": p["cnt"], "out": p["out"]}
    if split:
        bufs.update(part=p["part"], ml=p["ml"])
    bufs.update(at)
    kw = dict(
        cache=p["cache"],
        scales=p["scales"],
        tables=p["tables"],
        entries=entries,
        m=m,
        slot_rows=sh.slot_rows,
        sel_cap=sh.sel_cap,
        heads=sh.heads,
        dim=sh.dim,
        block_size=sh.bs,
        scale=1.0 / 16.0,
        **bufs,
    )
    if split:
        sparse_mla.sparse_mla_split_batch(gpu, **kw)
    else:
        sparse_mla.sparse_mla_attend_batch(gpu, **kw)


def attn_entry(gpu, p: dict, sh: AttnShape, entries, e: int, split: bool) -> None:
    """The batched pair at m = 1 for entry e: pointers offset to e's rows and workspace."""
    pb, mb = sparse_mla.split_workspace(sh.heads, sh.dim, sh.sel_cap)
    hd = sh.heads * sh.dim
    at = {
        "q": p["q"].offset(e * hd * 4),
        "selected": p["sel"].offset(e * sh.sel_cap * 4),
        "count": p["cnt"].offset(e * 4),
        "out": p["out"].offset(e * hd * 2),
    }
    if split:
        at.update(part=p["part"].offset(e * pb), ml=p["ml"].offset(e * mb))
    attn_batch(gpu, p, sh, entries.offset(e * ENTRY_BYTES), 1, split, **at)


def attn_f64(world: dict, sh: AttnShape, e: int, slot: int, rows: np.ndarray) -> np.ndarray:
    """float64 attention of entry e over its selected rows (zeros for an empty selection)."""
    if rows.size == 0:
        return np.zeros((sh.heads, sh.dim))
    c = world["cache"].astype(np.float64) * world["scales"][:, None].astype(np.float64)
    slots = world["tables"][slot][rows // sh.bs].astype(np.int64) * sh.bs + rows % sh.bs
    s = world["q"][e].astype(np.float64) @ c[slots].T / 16.0
    pr = np.exp(s - s.max(1, keepdims=True))
    return (pr / pr.sum(1, keepdims=True)) @ c[slots]


# ---- the checks both test files run (the GPU file on the CudaBackend at the GLM shapes, the host
# file on the HostBackend at small ones, which also checks these checks) -------------------------


def _pad_layout(rng, items: list, npad: int) -> list:
    """``items`` (runs or entries) with ``npad`` padding markers (None) at random places between
    them."""
    out = list(items)
    for _ in range(npad):
        out.insert(int(rng.integers(0, len(out) + 1)), None)
    return out


def entries_of(layout: list, row_add: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """u32 entries of a layout of (slot, row) / None, and the live (e, slot, row)."""
    ent = np.zeros((len(layout), 4), np.uint32)
    live = []
    for e, it in enumerate(layout):
        ent[e, 2] = 1000 + e  # the token word: the kernels must ignore it
        if it is None:
            ent[e, 0] = PAD_SLOT
            ent[e, 1] = (e * 2654435761) % 5000  # a padding entry's row means nothing (nor is read)
        else:
            slot, row = it
            ent[e, 0], ent[e, 1] = slot, row - row_add
            live.append((e, slot, row))
    return ent, live


def runs_of(layout: list) -> list[tuple[int, int, int, int]]:
    """(e0, slot, r0, n) of each maximal run of consecutive rows of one slot in a layout."""
    runs = []
    for e, it in enumerate(layout):
        if it is None:
            continue
        slot, row = it
        if (
            runs
            and runs[-1][1] == slot
            and runs[-1][0] + runs[-1][3] == e
            and runs[-1][2] + runs[-1][3] == row
        ):
            e0, _, r0, n = runs[-1]
            runs[-1] = (e0, slot, r0, n + 1)
        else:
            runs.append((e, slot, row, 1))
    return runs


@dataclass
class CacheRun:
    """One launch's layout: entries, the live (e, slot, row), the runs (e0, slot, r0, n)."""

    entries: np.ndarray
    live: list
    runs: list
    fused: np.ndarray


def cache_layout(rng, sh: CacheShape, m: int, row_add: int, lo: int, hi: int, max_run: int = 6) -> CacheRun:
    """m entries: runs of consecutive rows of distinct slots (catch-up chunks, in random slot
    order) starting in [lo, hi], with padding entries between runs (about a quarter of m)."""
    npad = m // 4
    live_n = m - npad
    nseq = min(sh.slots, live_n)
    while nseq * max_run < live_n:
        npad += 1
        live_n -= 1
    lens = np.ones(nseq, np.int64)
    for _ in range(live_n - nseq):
        open_ = np.flatnonzero(lens < max_run)
        lens[rng.choice(open_)] += 1
    slots = rng.choice(sh.slots, nseq, replace=False)
    runs_spec = []
    for s, n in zip(slots, lens):
        r0 = int(rng.integers(max(lo, row_add), max(min(hi, sh.slot_rows - int(n)), max(lo, row_add)) + 1))
        runs_spec.append((int(s), r0, int(n)))
    layout_runs = _pad_layout(rng, runs_spec, npad)
    layout, runs = [], []
    for it in layout_runs:
        if it is None:
            layout.append(None)
            continue
        s, r0, n = it
        runs.append((len(layout), s, r0, n))
        layout.extend((s, r0 + i) for i in range(n))
    ent, live = entries_of(layout, row_add)
    fused = random_bf16(rng, (len(layout), sh.stride), exp_lo=-2)
    return CacheRun(ent, live, runs, fused)


def check_cache_write(gpu, world: dict, sh: CacheShape, run: CacheRun, row_add: int, invariance: bool = True):
    """dsa_cache_write_batch over ``run`` on ``world``; with ``invariance`` also (a) each live entry
    alone at m = 1 in entry order must give the same bytes of every pool, and (b) a launch of padding entries and rows past
    slot_rows must change no byte. Returns the state bytes after the batched launch."""
    m = len(run.entries)
    p = upload_all(gpu, world)
    io = upload_all(gpu, {"fused": run.fused, "entries": run.entries})
    try:
        cache_write_batch(gpu, p, sh, io["fused"], io["entries"], m, row_add)
        got = state_bytes(gpu, p, world)
        if not invariance:
            return got
        # (b) padding, and rows at or past slot_rows, on the state just written.
        junk = np.zeros((max(m, 3), 4), np.uint32)
        junk[:, 0] = PAD_SLOT
        junk[0, 0], junk[0, 1] = 0, sh.slot_rows - row_add
        junk[1, 0], junk[1, 1] = sh.slots - 1, sh.slot_rows + 5 - row_add
        jp = upload_all(
            gpu, {"entries": junk, "fused": random_bf16(np.random.default_rng(1), (len(junk), sh.stride))}
        )
        try:
            cache_write_batch(gpu, p, sh, jp["fused"], jp["entries"], len(junk), row_add)
            after = state_bytes(gpu, p, world)
        finally:
            free_all(gpu, jp)
        for k in STATE:
            assert np.array_equal(after[k], got[k]), f"padding / out-of-slot entries changed {k}"
        # (a) each live entry alone, in entry order (a run's later rows find its earlier ones cached).
        p1 = upload_all(gpu, world)
        try:
            for e, _, _ in run.live:
                cache_write_batch(
                    gpu,
                    p1,
                    sh,
                    io["fused"].offset(e * sh.stride * 2),
                    io["entries"].offset(e * ENTRY_BYTES),
                    1,
                    row_add,
                )
            alone = state_bytes(gpu, p1, world)
        finally:
            free_all(gpu, p1)
        for k in STATE:
            assert np.array_equal(got[k], alone[k]), (
                f"{k}: the batch differs from each entry launched alone (m=1)"
            )
        return got
    finally:
        free_all(gpu, p, io)


def written_cache_rows(world: dict, sh: CacheShape, live: list) -> dict[str, np.ndarray]:
    """Masks of what a launch over ``live`` may write: latent cache rows, (slot, row) key rows,
    pool rows (global pool index) the rows complete."""
    g = sh.geo
    lat = np.zeros(sh.nblocks * sh.bs, bool)
    key = np.zeros((sh.slots, sh.slot_rows), bool)
    pool = np.zeros(sh.slots * g.pools_per_slot, bool)
    for _, slot, row in live:
        lat[int(world["tables"][slot][row // sh.bs]) * sh.bs + row % sh.bs] = True
        key[slot, row] = True
        if (row + 1) % sh.kpool == 0:
            pool[g.pool_row(slot, row // sh.kpool)] = True
    return {"latent": lat, "key": key, "pool": pool}


@dataclass
class ReadLayout:
    """Entries for the read-only kernels: the live (e, slot, row) inside their slot, the
    out-of-slot ones (row >= slot_rows: padding for the kernels), the padding positions."""

    entries: np.ndarray
    live: list
    outside: list
    pads: list


def read_layout(
    rng, slots: int, slot_rows: int, m: int, row_add: int, lo: int, hi: int, outside: bool = True
) -> ReadLayout:
    """m entries of random slots (repeats allowed: the kernels only read the slot) and ragged rows
    in [lo, hi], shuffled, about a fifth padding, and (m >= 3, ``outside``) one row past slot_rows."""
    npad = m // 5
    n_out = 1 if (outside and m >= 3) else 0
    items = [
        (int(rng.integers(0, slots)), int(rng.integers(max(lo, row_add), hi + 1)))
        for _ in range(m - npad - n_out)
    ]
    items += [(int(rng.integers(0, slots)), slot_rows + int(rng.integers(0, 3)))] * n_out
    rng.shuffle(items)
    layout = _pad_layout(rng, items, npad)
    ent, live_all = entries_of(layout, row_add)
    live = [x for x in live_all if x[2] < slot_rows]
    out = [x for x in live_all if x[2] >= slot_rows]
    pads = [e for e, it in enumerate(layout) if it is None]
    return ReadLayout(ent, live, out, pads)


def check_scores(
    gpu, world: dict, sh: ScoreShape, lay: ReadLayout, row_add: int, invariance: bool = True
) -> np.ndarray:
    """indexer_scores_batch into poisoned scores; with ``invariance`` each entry at m = 1 must give
    the same bytes, and the pools must be unchanged. Checks that exactly each live entry's complete pools are written. Returns the
    scores [m, pps] of the batched launch."""
    m = len(lay.entries)
    n = m * sh.pps * 4
    p = upload_all(gpu, world)
    io = upload_all(gpu, {"entries": lay.entries})
    outs = poison_all(gpu, {"batch": n, "alone": n})
    try:
        scores_batch(gpu, p, sh, outs["batch"], io["entries"], m, row_add)
        got = bytes_of(gpu, outs, {"batch": n})["batch"].view(np.float32).reshape(m, sh.pps)
        written = np.zeros((m, sh.pps), bool)
        for e, _, row in lay.live:
            written[e, : (row + 1) // sh.kpool] = True
        assert not np.isnan(got[written]).any(), "a complete pool's score was not written"
        assert np.isnan(got[~written]).all(), "a score written past the complete pools, or for padding"
        if invariance:
            for e in range(m):
                scores_entry(gpu, p, sh, outs["alone"], io["entries"], e, row_add)
            b = bytes_of(gpu, outs, {"alone": n})
            assert np.array_equal(
                b["alone"].view(np.float32).reshape(m, sh.pps).view(np.uint32), got.view(np.uint32)
            ), "indexer_scores_batch: an entry's scores differ from its m = 1 launch"
            pools = bytes_of(
                gpu, p, {"pool_keys": world["pool_keys"].nbytes, "pool_scales": world["pool_scales"].nbytes}
            )
            assert np.array_equal(pools["pool_keys"], world["pool_keys"].reshape(-1).view(np.uint8))
            assert np.array_equal(pools["pool_scales"], world["pool_scales"].view(np.uint8))
        return got
    finally:
        free_all(gpu, p, io, outs)


def select_scores(rng, sh: ScoreShape, m: int, kind: str) -> np.ndarray:
    """Scores [m, pps]: random, or few distinct values (cuts fall inside ties)."""
    if kind == "ties":
        return rng.integers(-3, 4, (m, sh.pps)).astype(np.float32)
    return rng.standard_normal((m, sh.pps)).astype(np.float32)


def check_select(
    gpu,
    scores: np.ndarray,
    sh: ScoreShape,
    lay: ReadLayout,
    row_add: int,
    topk: int,
    tail: bool,
    sel_cap: int,
    invariance: bool = True,
):
    """select_topk_pools_batch then extend_selection_batch (row_add + 1, + 2) into poisoned lists;
    exact against select_rows_ref; with ``invariance`` each entry at m = 1 gives the same bytes. Returns (selected, count) after the selection and after the
    extensions."""
    from model.kernels.dsa_select import select_rows_ref

    m = len(lay.entries)
    ns, nc = m * sel_cap * 4, m * 4
    io = upload_all(gpu, {"entries": lay.entries, "scores": scores})
    names = ("batch", "alone") if invariance else ("batch",)
    outs = poison_all(gpu, {f"{k}_{w}": (ns if w == "sel" else nc) for k in names for w in ("sel", "cnt")})

    def grab(k):
        b = bytes_of(gpu, outs, {f"{k}_sel": ns, f"{k}_cnt": nc})
        return b[f"{k}_sel"].view(np.uint32).reshape(m, sel_cap), b[f"{k}_cnt"].view(np.uint32)

    try:
        select_batch(
            gpu,
            io["scores"],
            outs["batch_sel"],
            outs["batch_cnt"],
            io["entries"],
            m,
            row_add,
            sh,
            sel_cap,
            topk,
            tail,
        )
        sel, cnt = grab("batch")
        for e, _, row in lay.live:
            ref = select_rows_ref(scores[e], row, topk, sh.kpool, tail)
            if ref.size > sel_cap:
                assert cnt[e] == 0, f"entry {e}: a selection past sel_cap must give count 0"
                continue
            assert cnt[e] == ref.size, f"entry {e} (row {row}): count {cnt[e]}, expected {ref.size}"
            np.testing.assert_array_equal(sel[e, : ref.size], ref)
            assert (sel[e, ref.size :] == 0xFFFFFFFF).all(), f"entry {e}: written past its count"
        for e, _, _ in lay.outside:
            assert cnt[e] == 0 and (sel[e] == 0xFFFFFFFF).all(), (
                f"entry {e}: a row past slot_rows must give count 0"
            )
        for e in lay.pads:
            assert cnt[e] == 0xFFFFFFFF and (sel[e] == 0xFFFFFFFF).all(), f"padding entry {e} was written"
        first = (sel.copy(), cnt.copy())
        for add in (1, 2):
            dsa_select.extend_selection_batch(
                gpu,
                selected=outs["batch_sel"],
                count=outs["batch_cnt"],
                entries=io["entries"],
                m=m,
                row_add=row_add + add,
                sel_cap=sel_cap,
            )
        sel2, cnt2 = grab("batch")
        for e, _, row in lay.live + lay.outside:
            n0 = int(first[1][e])
            k = min(2, max(sel_cap - n0, 0))
            assert cnt2[e] == n0 + k, f"entry {e}: extend gave count {cnt2[e]} from {n0}"
            np.testing.assert_array_equal(sel2[e, :n0], first[0][e, :n0])
            np.testing.assert_array_equal(sel2[e, n0 : n0 + k], [row + 1, row + 2][:k])
        for e in lay.pads:
            assert cnt2[e] == 0xFFFFFFFF and (sel2[e] == 0xFFFFFFFF).all(), f"padding entry {e} was extended"
        if invariance:
            for e in range(m):
                select_entry(
                    gpu,
                    io["scores"],
                    outs["alone_sel"],
                    outs["alone_cnt"],
                    io["entries"],
                    e,
                    row_add,
                    sh,
                    sel_cap,
                    topk,
                    tail,
                )
            a_sel, a_cnt = grab("alone")
            assert np.array_equal(a_sel, first[0]) and np.array_equal(a_cnt, first[1]), (
                "select: m = 1 differs"
            )
            for e in range(m):
                for add in (1, 2):
                    dsa_select.extend_selection_batch(
                        gpu,
                        selected=outs["alone_sel"].offset(e * sel_cap * 4),
                        count=outs["alone_cnt"].offset(e * 4),
                        entries=io["entries"].offset(e * ENTRY_BYTES),
                        m=1,
                        row_add=row_add + add,
                        sel_cap=sel_cap,
                    )
            a_sel, a_cnt = grab("alone")
            assert np.array_equal(a_sel, sel2) and np.array_equal(a_cnt, cnt2), "extend: m = 1 differs"
        return first, (sel2, cnt2)
    finally:
        free_all(gpu, io, outs)


@dataclass
class AttnCase:
    entries: np.ndarray
    live: list  # (e, slot, rows selected)
    pads: list
    sel: np.ndarray  # [m, sel_cap] u32, poison past each count
    cnt: np.ndarray  # [m] u32


def attn_case(rng, sh: AttnShape, m: int, counts) -> AttnCase:
    """m entries of random slots, about a fifth padding, each live entry selecting a random count
    (from ``counts``) of its slot's rows; list words past the count are poison (0xFFFFFFFF), which
    a kernel reading them would turn into an out-of-range table index."""
    npad = m // 5
    items = [(int(rng.integers(0, sh.slots)), 0) for _ in range(m - npad)]
    layout = _pad_layout(rng, items, npad)
    ent, live0 = entries_of(layout, 0)
    sel = np.full((m, sh.sel_cap), 0xFFFFFFFF, np.uint32)
    cnt = np.full(m, 0xFFFFFFFF, np.uint32)  # padding: a kernel must not read it either
    live = []
    for e, slot, _ in live0:
        n = int(rng.choice(counts))
        rows = random_selection(rng, sh.slot_rows, n)
        sel[e, :n], cnt[e] = rows, n
        live.append((e, slot, rows))
    pads = [e for e, it in enumerate(layout) if it is None]
    return AttnCase(ent, live, pads, sel, cnt)


def check_attn(
    gpu, world: dict, sh: AttnShape, case: AttnCase, split: bool, invariance: bool = True
) -> np.ndarray:
    """The batched attention into a poisoned output (and workspace); every live entry's output
    written, padding rows untouched; with ``invariance`` each entry at m = 1 gives the same bytes
    (the workspace too), and the cache is unchanged. Returns
    the output [m, heads, dim] as float32."""
    from runtime.dtypes import BF16

    m = len(case.entries)
    hd = sh.heads * sh.dim
    pb, mb = sparse_mla.split_workspace(sh.heads, sh.dim, sh.sel_cap)
    sizes = {"out": m * hd * 2}
    if split:
        sizes.update(part=m * pb, ml=m * mb)
    p = upload_all(gpu, {**world, "sel": case.sel, "cnt": case.cnt, "entries": case.entries})
    variants = ("batch", "alone") if invariance else ("batch",)
    outs = {v: poison_all(gpu, sizes) for v in variants}
    try:

        def bufs(v):
            return {**p, **outs[v]}

        attn_batch(gpu, bufs("batch"), sh, p["entries"], m, split)
        got = bytes_of(gpu, outs["batch"], sizes)
        o = got["out"].view(BF16).reshape(m, sh.heads, sh.dim).astype(np.float32)
        for e, _, _ in case.live:
            assert not np.isnan(o[e]).any(), f"entry {e}: output not (fully) written"
        for e in case.pads:
            assert (got["out"].reshape(m, -1)[e] == 0xFF).all(), f"padding entry {e}: output written"
            if split:
                assert (got["part"].reshape(m, -1)[e] == 0xFF).all(), f"padding entry {e}: workspace written"
                assert (got["ml"].reshape(m, -1)[e] == 0xFF).all(), f"padding entry {e}: workspace written"
        if invariance:
            for e in range(m):
                attn_entry(gpu, bufs("alone"), sh, p["entries"], e, split)
            alone = bytes_of(gpu, outs["alone"], sizes)
            for k in sizes:
                assert np.array_equal(alone[k], got[k]), f"{k}: an entry differs from its m = 1 launch"
            kept = bytes_of(gpu, p, {"cache": world["cache"].nbytes, "scales": world["scales"].nbytes})
            assert np.array_equal(kept["cache"], world["cache"].reshape(-1).view(np.uint8))
            assert np.array_equal(kept["scales"], world["scales"].view(np.uint8))
        return o
    finally:
        free_all(gpu, p, *outs.values())
