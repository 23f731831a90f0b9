"""Worlds and checks for the RoPE kernels' tests (``rope_q_batch``, ``dsa_cache_write_plain_batch``):
tests/test_rope.py runs them on the host backend (the twins against float64 formulas),
tests/test_gpu_rope.py on the GPU (the PTX against the twins).

Each check launches the batched kernel over m entries (outputs poisoned, or pools full of earlier
bytes) and, with ``invariance``, every live entry alone at m = 1 (pointers offset to its rows, in
reverse entry order): the bytes must be the same. It also checks that padding entries (and, for
the cache write, rows past slot_rows) change no byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from batch_dsa_util import bytes_of, free_all, poison_all, random_fp8, upload_all
from kernel_util import random_bf16

from model.kernels import dsa_cache, rope
from model.kernels.batch import ENTRY_BYTES, PAD_SLOT, SlotGeometry
from runtime.launch import launch

EPS, LN_EPS = 1e-5, 1e-6
# A YaRN-like mscale (0.1 ln(40) + 1): not a round number, so an attn_factor dropped or applied
# twice shows.
ATTN_FACTOR = 1.3688879454113936


def inv_freq_table(rope_dim: int, base: float = 10000.0) -> np.ndarray:
    """The usual table base^(-2i/rope_dim), float32: inv_freq[0] = 1, so angles reach the
    position itself (1e6 rad)."""
    return (1.0 / base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)).astype(np.float32)


def rope_f64(x, pos, inv_freq, attn_factor: float, interleave: bool) -> np.ndarray:
    """The rotation in float64 through complex numbers, independent of rope_ref's code. The angle is
    the float32 product the definition names (pos * inv_freq is exact in float64 for pos < 2**29,
    so rounding it once to float32 is the float32 multiply); attn_factor as the kernels get it
    (float32)."""
    x = np.asarray(x, np.float64)
    r = x.shape[-1]
    angle = (np.float64(pos) * np.asarray(inv_freq, np.float64)).astype(np.float32).astype(np.float64)
    rot = np.float64(np.float32(attn_factor)) * np.exp(1j * angle)
    pairs = (
        x.reshape(*x.shape[:-1], r // 2, 2)
        if interleave
        else x.reshape(*x.shape[:-1], 2, r // 2).swapaxes(-1, -2)
    )
    z = (pairs[..., 0] + 1j * pairs[..., 1]) * rot
    out = np.stack([z.real, z.imag], -1)
    return out.reshape(x.shape) if interleave else out.swapaxes(-1, -2).reshape(x.shape)


def rope_bound(x, attn_factor: float, interleave: bool) -> np.ndarray:
    """Allowed |float32 result - float64| per element: cos / sin within 1.5 float32 ulps (at most
    2**-23 absolute), the attn_factor multiply, the products and the sum each rounded (2**-24
    relative): under 2**-21 attn_factor (|x0| + |x1|) of the element's pair."""
    x = np.abs(np.asarray(x, np.float64))
    r = x.shape[-1]
    if interleave:
        s = x[..., 0::2] + x[..., 1::2]
        mag = np.repeat(s, 2, -1)
    else:
        s = x[..., : r // 2] + x[..., r // 2 :]
        mag = np.concatenate([s, s], -1)
    return 2.0**-21 * abs(attn_factor) * mag


def entries_at(items: list, row_add: int) -> tuple[np.ndarray, list[tuple[int, int, int]], list[int]]:
    """u32 entries of a list of (slot, row) / None (padding): the row word is row - row_add modulo
    2**32 (so a row below row_add wraps, as the kernels' u32 sum does). Returns (entries, live
    (e, slot, row), padding positions)."""
    ent = np.zeros((len(items), 4), np.uint32)
    live, pads = [], []
    for e, it in enumerate(items):
        ent[e, 2] = 1000 + e  # the token word: the kernels must ignore it
        if it is None:
            ent[e, 0] = PAD_SLOT
            ent[e, 1] = (e * 2654435761) % 5000  # a padding entry's row means nothing
            pads.append(e)
        else:
            slot, row = it
            ent[e, 0], ent[e, 1] = slot, (row - row_add) & 0xFFFFFFFF
            live.append((e, slot, row))
    return ent, live, pads


def with_padding(rng, items: list, npad: int) -> list:
    out = list(items)
    for _ in range(npad):
        out.insert(int(rng.integers(0, len(out) + 1)), None)
    return out


def _same(a: dict, b: dict, what: str) -> None:
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k}: {what}"


# ---- rope_q_batch ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class QShape:
    heads: int
    nope: int
    rope_dim: int
    iheads: int
    idim: int
    irope_dim: int
    interleave: bool = True
    i_interleave: bool = False

    @property
    def qk(self) -> int:
        return self.nope + self.rope_dim

    @property
    def iq_offset(self) -> int:
        return self.heads * self.qk + 3  # not where the MLA heads end: the offset is the argument's

    @property
    def q_stride(self) -> int:
        return self.iq_offset + self.iheads * self.idim + 5

    def out_sizes(self, m: int) -> dict[str, int]:
        return {"q_nope": m * self.heads * self.nope * 2, "q_rope": m * self.heads * self.rope_dim * 2}


def q_launch(gpu, sh: QShape, inv, q, q_nope, q_rope, entries, m: int, row_add: int, q_stride: int) -> None:
    rope.rope_q_batch(
        gpu,
        q=q,
        q_stride=q_stride,
        heads=sh.heads,
        nope=sh.nope,
        rope_dim=sh.rope_dim,
        iq_offset=sh.iq_offset,
        iheads=sh.iheads,
        idim=sh.idim,
        irope_dim=sh.irope_dim,
        inv_freq=inv,
        attn_factor=ATTN_FACTOR,
        interleave=sh.interleave,
        i_interleave=sh.i_interleave,
        q_nope=q_nope,
        q_rope=q_rope,
        entries=entries,
        m=m,
        row_add=row_add,
    )


def rotated_mask(sh: QShape, m: int, live: list) -> np.ndarray:
    """[m, q_stride] True where rope_q_batch rewrites q: the live entries' indexer heads' first
    irope_dim dims."""
    mask = np.zeros((m, sh.q_stride), bool)
    for e, _, _ in live:
        for j in range(sh.iheads):
            at = sh.iq_offset + j * sh.idim
            mask[e, at : at + sh.irope_dim] = True
    return mask


def check_q(
    gpu, sh: QShape, q: np.ndarray, entries: np.ndarray, row_add: int, invariance: bool = True
) -> dict:
    """rope_q_batch over q [m, q_stride] BF16 into poisoned outputs. Checks: padding rows of q_nope /
    q_rope still poison and padding rows of q unchanged, every q element outside the rotated parts
    unchanged; with ``invariance`` each entry alone (m = 1, q_stride 0, on a fresh copy of q) gives
    the same bytes. Returns {"q", "q_nope", "q_rope"} as BF16 arrays."""
    m = len(entries)
    ents = [(e, 0, 0) for e in range(m) if int(entries[e, 0]) != PAD_SLOT]
    pads = [e for e in range(m) if int(entries[e, 0]) == PAD_SLOT]
    sizes = {**sh.out_sizes(m), "q": q.nbytes}
    p = upload_all(gpu, {"inv": inv_freq_table(sh.rope_dim), "entries": entries})
    runs = ("batch", "alone") if invariance else ("batch",)
    bufs = {v: {**poison_all(gpu, sh.out_sizes(m)), **upload_all(gpu, {"q": q})} for v in runs}
    try:
        b = bufs["batch"]
        q_launch(gpu, sh, p["inv"], b["q"], b["q_nope"], b["q_rope"], p["entries"], m, row_add, sh.q_stride)
        got = bytes_of(gpu, b, sizes)
        if invariance:
            a = bufs["alone"]
            for e in reversed(range(m)):
                q_launch(
                    gpu,
                    sh,
                    p["inv"],
                    a["q"].offset(e * sh.q_stride * 2),
                    a["q_nope"].offset(e * sh.heads * sh.nope * 2),
                    a["q_rope"].offset(e * sh.heads * sh.rope_dim * 2),
                    p["entries"].offset(e * ENTRY_BYTES),
                    1,
                    row_add,
                    0,
                )
            _same(got, bytes_of(gpu, a, sizes), "the batch differs from each entry launched alone (m = 1)")
    finally:
        free_all(gpu, p, *bufs.values())
    q_after = got["q"].view(np.uint16).reshape(q.shape)
    keep = ~rotated_mask(sh, m, ents)
    assert np.array_equal(q_after[keep], q.view(np.uint16)[keep]), "q changed outside the rotated dims"
    q_nope = got["q_nope"].view(np.uint16).reshape(m, -1)
    q_rope = got["q_rope"].view(np.uint16).reshape(m, -1)
    for e in pads:
        assert (q_nope[e] == 0xFFFF).all() and (q_rope[e] == 0xFFFF).all(), f"padding entry {e} written"
    from runtime.dtypes import BF16

    return {
        "q": q_after.view(BF16),
        "q_nope": q_nope.view(BF16).reshape(m, sh.heads, sh.nope),
        "q_rope": q_rope.view(BF16).reshape(m, sh.heads, sh.rope_dim),
    }


# ---- dsa_cache_write_plain_batch ------------------------------------------------------------------


@dataclass(frozen=True)
class PlainShape:
    slots: int
    slot_rows: int
    C: int
    rope_dim: int
    idim: int
    irope_dim: int
    interleave: bool = True
    i_interleave: bool = False
    bs: int = 16
    spare_blocks: int = 3

    @property
    def geo(self) -> SlotGeometry:
        return SlotGeometry(self.slot_rows, self.idim, 1, self.bs)

    @property
    def nblocks(self) -> int:
        return self.slots * self.geo.blocks_per_slot + self.spare_blocks

    @property
    def stride(self) -> int:
        # More columns than the write reads, rounded to 8 elements so every fused row is 16-byte
        # aligned as the proposer's are (rms_divisor's vector path when C allows it).
        return -(-(self.C + self.rope_dim + self.idim + 5) // 8) * 8


PLAIN_STATE = ("cache", "scales", "rope_keys", "pool_keys", "pool_scales")


def plain_world(rng: np.random.Generator, sh: PlainShape) -> dict[str, np.ndarray]:
    """Pools full of earlier bytes (so a stray write shows), block tables giving each slot a
    shuffled disjoint set of blocks, weights, inv_freq."""
    g = sh.geo
    perm = rng.permutation(sh.nblocks).astype(np.uint32)
    rows = sh.nblocks * sh.bs
    npools = sh.slots * g.pools_per_slot
    return {
        "cache": random_fp8(rng, (rows, sh.C)),
        "scales": (rng.random(rows) + 0.5).astype(np.float32),
        "tables": perm[: sh.slots * g.blocks_per_slot].reshape(sh.slots, g.blocks_per_slot),
        "rope_keys": random_bf16(rng, (sh.slots, sh.slot_rows, max(sh.rope_dim, 1)), exp_lo=-1),
        "pool_keys": random_fp8(rng, (npools, sh.idim)),
        "pool_scales": (rng.random(npools) + 0.5).astype(np.float32),
        "kv_w": random_bf16(rng, sh.C, exp_lo=-1),
        "kw": random_bf16(rng, sh.idim, exp_lo=-1),
        "kb": random_bf16(rng, sh.idim, exp_lo=-4),
        "inv": inv_freq_table(max(sh.rope_dim, 2)),
    }


def plain_launch(gpu, p: dict, sh: PlainShape, fused, entries, m: int, row_add: int) -> None:
    dsa_cache.dsa_cache_write_plain_batch(
        gpu,
        fused=fused,
        stride=sh.stride,
        kv_norm_w=p["kv_w"],
        cache=p["cache"],
        scales=p["scales"],
        tables=p["tables"],
        knorm_w=p["kw"],
        knorm_b=p["kb"],
        rope_keys=p["rope_keys"],
        pool_keys=p["pool_keys"],
        pool_scales=p["pool_scales"],
        inv_freq=p["inv"],
        attn_factor=ATTN_FACTOR,
        entries=entries,
        m=m,
        row_add=row_add,
        slot_rows=sh.slot_rows,
        C=sh.C,
        rope_dim=sh.rope_dim,
        idim=sh.idim,
        irope_dim=sh.irope_dim,
        block_size=sh.bs,
        interleave=sh.interleave,
        i_interleave=sh.i_interleave,
        eps=EPS,
        ln_eps=LN_EPS,
    )


def plain_state(gpu, p: dict, world: dict) -> dict[str, np.ndarray]:
    return bytes_of(gpu, p, {k: world[k].nbytes for k in PLAIN_STATE})


@dataclass
class PlainRun:
    entries: np.ndarray
    live: list  # (e, slot, row), rows inside the slot
    outside: list  # (e, slot, row), rows at or past slot_rows: write nothing
    pads: list
    fused: np.ndarray


def plain_run(sh: PlainShape, items: list, row_add: int, rng: np.random.Generator) -> PlainRun:
    ent, live, pads = entries_at(items, row_add)
    inside = [x for x in live if x[2] < sh.slot_rows]
    outside = [x for x in live if x[2] >= sh.slot_rows]
    return PlainRun(ent, inside, outside, pads, random_bf16(rng, (len(items), sh.stride), exp_lo=-2))


def plain_items(rng, sh: PlainShape, m: int, must: list = ()) -> list:
    """m entries: ``must`` (slot, row) first, then runs of consecutive rows of random slots at
    random starts (distinct (slot, row) throughout), one row past slot_rows when m >= 4, about a
    fifth padding, in random order."""
    npad = m // 5
    n_out = 1 if m >= 4 else 0
    seen = set(must)
    items = list(must)
    while len(items) < m - npad - n_out:
        slot = int(rng.integers(0, sh.slots))
        r0 = int(rng.integers(0, sh.slot_rows))
        for r in range(r0, min(r0 + int(rng.integers(1, 5)), sh.slot_rows)):
            if (slot, r) not in seen and len(items) < m - npad - n_out:
                seen.add((slot, r))
                items.append((slot, r))
    items += [(int(rng.integers(0, sh.slots)), sh.slot_rows + int(rng.integers(0, 3)))] * n_out
    order = rng.permutation(len(items))
    return with_padding(rng, [items[i] for i in order], npad)


def plain_written(world: dict, sh: PlainShape, live: list) -> dict[str, np.ndarray]:
    """Masks of what a launch over ``live`` may write: latent cache rows, (slot, row) rope-key rows,
    pool rows (global index)."""
    lat = np.zeros(sh.nblocks * sh.bs, bool)
    key = np.zeros((sh.slots, sh.slot_rows), bool)
    pool = np.zeros(sh.slots * sh.geo.pools_per_slot, bool)
    for _, slot, row in live:
        lat[int(world["tables"][slot][row // sh.bs]) * sh.bs + row % sh.bs] = True
        key[slot, row] = True
        pool[sh.geo.pool_row(slot, row)] = True
    return {"latent": lat, "key": key, "pool": pool}


def check_plain(
    gpu, world: dict, sh: PlainShape, run: PlainRun, row_add: int, invariance: bool = True
) -> dict:
    """dsa_cache_write_plain_batch over ``run`` on ``world``. Checks that nothing outside the live
    rows' latent / rope-key / pool rows changed; with ``invariance`` also that (a) a launch of padding
    and rows past slot_rows changes no byte and (b) each live entry alone at m = 1, in reverse entry
    order, gives the same bytes. Returns the state bytes after the batched launch."""
    m = len(run.entries)
    p = upload_all(gpu, world)
    io = upload_all(gpu, {"fused": run.fused, "entries": run.entries})
    try:
        plain_launch(gpu, p, sh, io["fused"], io["entries"], m, row_add)
        got = plain_state(gpu, p, world)
        if invariance:
            junk = np.zeros((max(m, 3), 4), np.uint32)
            junk[:, 0] = PAD_SLOT
            junk[:, 1] = 0
            junk[0, 0], junk[0, 1] = 0, (sh.slot_rows - row_add) & 0xFFFFFFFF
            junk[1, 0], junk[1, 1] = sh.slots - 1, (sh.slot_rows + 5 - row_add) & 0xFFFFFFFF
            jp = upload_all(
                gpu, {"entries": junk, "fused": random_bf16(np.random.default_rng(1), (len(junk), sh.stride))}
            )
            try:
                plain_launch(gpu, p, sh, jp["fused"], jp["entries"], len(junk), row_add)
                _same(got, plain_state(gpu, p, world), "padding / out-of-slot entries changed it")
            finally:
                free_all(gpu, jp)
            p1 = upload_all(gpu, world)
            try:
                for e, _, _ in reversed(run.live + run.outside):
                    plain_launch(
                        gpu,
                        p1,
                        sh,
                        io["fused"].offset(e * sh.stride * 2),
                        io["entries"].offset(e * ENTRY_BYTES),
                        1,
                        row_add,
                    )
                _same(
                    got,
                    plain_state(gpu, p1, world),
                    "the batch differs from each entry launched alone (m = 1)",
                )
            finally:
                free_all(gpu, p1)
    finally:
        free_all(gpu, p, io)
    w = plain_written(world, sh, run.live)
    cache = got["cache"].reshape(-1, sh.C)
    assert np.array_equal(cache[~w["latent"]], world["cache"].view(np.uint8)[~w["latent"]]), "cache"
    sc = got["scales"].view(np.float32)
    assert np.array_equal(sc[~w["latent"]], world["scales"][~w["latent"]]), "scales"
    rk = got["rope_keys"].view(np.uint16).reshape(world["rope_keys"].shape)
    if sh.rope_dim:
        assert np.array_equal(rk[~w["key"]], world["rope_keys"].view(np.uint16)[~w["key"]]), "rope keys"
    else:
        assert np.array_equal(rk, world["rope_keys"].view(np.uint16)), "rope keys written at rope_dim 0"
    pk = got["pool_keys"].reshape(-1, sh.idim)
    assert np.array_equal(pk[~w["pool"]], world["pool_keys"].view(np.uint8)[~w["pool"]]), "pool keys"
    ps = got["pool_scales"].view(np.float32)
    assert np.array_equal(ps[~w["pool"]], world["pool_scales"][~w["pool"]]), "pool scales"
    return got


# ---- the kernels' own guard (dims the launch helpers refuse) ------------------------------------


def launch_plain_raw(gpu, p, sh: PlainShape, fused, entries, m, rope_dim, irope_dim) -> None:
    """The kernel launched directly, past the helper's checks."""
    launch(
        gpu,
        gpu.kernel(*dsa_cache.DSA_CACHE_WRITE_PLAIN_BATCH.key),
        m,
        128,
        fused,
        sh.stride,
        p["kv_w"],
        p["cache"],
        p["scales"],
        p["tables"],
        p["kw"],
        p["kb"],
        p["rope_keys"],
        p["pool_keys"],
        p["pool_scales"],
        p["inv"],
        1.0,
        entries,
        m,
        0,
        sh.slot_rows,
        sh.C,
        rope_dim,
        sh.idim,
        irope_dim,
        sh.bs,
        1,
        0,
        EPS,
        LN_EPS,
    )


def launch_q_raw(gpu, sh: QShape, q, inv, q_nope, q_rope, entries, m, rope_dim, irope_dim) -> None:
    launch(
        gpu,
        gpu.kernel(*rope.ROPE_Q_BATCH.key),
        (m, 2),
        128,
        q,
        sh.q_stride,
        sh.heads,
        sh.nope,
        rope_dim,
        sh.iq_offset,
        sh.iheads,
        sh.idim,
        irope_dim,
        inv,
        1.0,
        1,
        0,
        q_nope,
        q_rope,
        entries,
        m,
        0,
    )


def check_bad_dims_write_nothing(gpu, sh: PlainShape, qs: QShape) -> None:
    """Launched directly with dims ptx/rope.cuh does not define, both kernels (and so their twins)
    write nothing; the same launch with good dims does write (the check can fail)."""
    rng = np.random.default_rng(4)
    # The bad dims below are chosen for these: irope_dim 40 > idim.
    assert sh.rope_dim == qs.rope_dim == sh.irope_dim == qs.irope_dim == 16 and sh.idim == qs.idim == 32
    world = plain_world(rng, sh)
    p = upload_all(gpu, world)
    ent, _, _ = entries_at([(0, 3), (1, 7)], 0)
    io = upload_all(gpu, {"fused": random_bf16(rng, (2, sh.stride)), "entries": ent})
    qh = random_bf16(rng, (2, qs.q_stride), exp_lo=-3)
    qo = upload_all(gpu, {"q": qh, "inv": inv_freq_table(16)})
    outs = {k: gpu.alloc(n) for k, n in qs.out_sizes(2).items()}
    try:
        for k, n in qs.out_sizes(2).items():
            gpu.memset(outs[k], 0xFF, n)
        for rd, ird in ((15, 0), (16, 8), (40, 40)):  # odd; irope_dim not rope_dim; irope_dim > idim
            launch_plain_raw(gpu, p, sh, io["fused"], io["entries"], 2, rd, ird)
            after = plain_state(gpu, p, world)
            for k in PLAIN_STATE:
                assert np.array_equal(after[k], np.ascontiguousarray(world[k]).reshape(-1).view(np.uint8)), (
                    rd,
                    ird,
                    k,
                )
            launch_q_raw(
                gpu, qs, qo["q"], qo["inv"], outs["q_nope"], outs["q_rope"], io["entries"], 2, rd, ird
            )
            qa = np.empty_like(qh)
            gpu.copy_d2h(qa, qo["q"])
            assert np.array_equal(qa.view(np.uint16), qh.view(np.uint16)), (rd, ird)
            for k, n in qs.out_sizes(2).items():
                b = np.empty(n, np.uint8)
                gpu.copy_d2h(b, outs[k])
                assert (b == 0xFF).all(), (rd, ird, k)
        launch_plain_raw(gpu, p, sh, io["fused"], io["entries"], 2, sh.rope_dim, sh.irope_dim)
        after = plain_state(gpu, p, world)
        assert not np.array_equal(after["pool_keys"], world["pool_keys"].reshape(-1).view(np.uint8))
        launch_q_raw(gpu, qs, qo["q"], qo["inv"], outs["q_nope"], outs["q_rope"], io["entries"], 2, 16, 16)
        b = np.empty(qs.out_sizes(2)["q_rope"], np.uint8)
        gpu.copy_d2h(b, outs["q_rope"])
        assert not (b == 0xFF).any()
    finally:
        free_all(gpu, p, io, qo, outs)
