"""Cases and checks shared by the sampled-draft tests (test_draft_sample.py on the host twins,
test_gpu_draft_sample.py on the PTX): a batch of entries with mixed greedy and sampled records,
padding anywhere, per-entry dist buffers, every output poisoned (0xFF) with guard bytes after it,
and the contract checked entry by entry against model.kernels.draft_sample.sample_row."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model.kernels import draft_sample as ds
from model.kernels.batch import ENTRY_WORDS, PAD_SLOT
from model.kernels.keyed_rng import Stream, uniforms
from model.sampling import SamplingParams
from runtime.dtypes import BF16

GUARD = 16
POISON = 0xFF
POISON_U32 = 0xFFFF_FFFF


@dataclass
class SampleCase:
    """One draft_sample_batch launch. ``bits`` u16 [m, n] (BF16 logits), per entry its params,
    position and whether it has a dist buffer; the entries carry the head's token (the argmax);
    drafts [m, kmax] hold earlier drafts and the head's draft at draft_index, probs earlier probs."""

    bits: np.ndarray
    params: list[SamplingParams]
    positions: list[int]
    with_dist: list[bool]
    entries: np.ndarray
    drafts: np.ndarray
    probs: np.ndarray
    draft_index: int
    kmax: int
    publish: bool
    dist_rows: int = 0  # rows of each dist buffer (0: kmax)

    @property
    def m(self) -> int:
        return self.bits.shape[0]

    @property
    def n(self) -> int:
        return self.bits.shape[1]

    @property
    def rows(self) -> int:
        return self.dist_rows or self.kmax

    def live(self, e: int) -> bool:
        return int(self.entries[e, 0]) != PAD_SLOT

    def record(self, e: int, dist_addr: int = 0) -> np.ndarray:
        return ds.pack_sampling(self.params[e], self.positions[e], dist_addr)

    def subset(self, rows: list[int], pad_at: tuple[int, ...] = ()) -> tuple[SampleCase, list[int]]:
        """Rows ``rows`` of this case as a new batch with padding entries inserted at the
        positions ``pad_at`` of the result; returns it and, per new row, the old one (-1: pad)."""
        src: list[int] = list(rows)
        for p in sorted(pad_at):
            src.insert(p, -1)
        take = [max(r, 0) for r in src]
        ent = self.entries[take].copy()
        ent[[j for j, r in enumerate(src) if r < 0], 0] = PAD_SLOT
        case = SampleCase(
            self.bits[take].copy(),
            [self.params[r] for r in take],
            [self.positions[r] for r in take],
            [self.with_dist[r] for r in take],
            ent,
            self.drafts[take].copy(),
            self.probs[take].copy(),
            self.draft_index,
            self.kmax,
            self.publish,
            self.dist_rows,
        )
        return case, src


def head_tokens(bits: np.ndarray) -> np.ndarray:
    """The head's argmax per row (draft_head's rule: the lowest index of the largest, NaN lowest)."""
    v = bits.view(BF16).astype(np.float32)
    v = np.where(np.isnan(v), -np.inf, v)
    return np.argmax(v, axis=1).astype(np.uint32)


def make_case(
    rng: np.random.Generator,
    bits: np.ndarray,
    params: list[SamplingParams],
    *,
    pads: int = 0,
    with_dist: list[bool] | None = None,
    draft_index: int = 1,
    kmax: int = 4,
    publish: bool = True,
    dist_rows: int = 0,
) -> SampleCase:
    m, n = bits.shape
    ent = rng.integers(0, 2**32, (m, ENTRY_WORDS), dtype=np.uint64).astype(np.uint32)
    ent[:, 0] = rng.choice(4096, m, replace=False)
    if pads:
        ent[rng.choice(m, pads, replace=False), 0] = PAD_SLOT
    ent[:, 2] = head_tokens(bits)
    drafts = np.full((m, kmax), POISON_U32, np.uint32)
    drafts[:, :draft_index] = rng.integers(0, max(n, 1), (m, draft_index))
    drafts[:, draft_index] = ent[:, 2]
    probs = np.full((m, kmax), np.nan, np.float32)
    probs[:, :draft_index] = rng.random((m, draft_index), dtype=np.float32)
    return SampleCase(
        np.ascontiguousarray(bits, np.uint16),
        list(params),
        [int(p) for p in rng.integers(0, 2**32, m, dtype=np.uint64)],
        list(with_dist if with_dist is not None else rng.random(m) < 0.5),
        ent,
        drafts,
        probs,
        draft_index,
        kmax,
        publish,
        dist_rows,
    )


# ---- logits --------------------------------------------------------------------------------------


def normal_bits(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(BF16).view(np.uint16)


def tied_bits(rng: np.random.Generator, shape, levels: int = 6) -> np.ndarray:
    """Few distinct values: long runs of equal z, so the boundaries cut inside runs."""
    return rng.integers(-levels, levels, shape).astype(np.float32).astype(BF16).view(np.uint16)


def special_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """A normal row with some -inf, NaN and -0.0 among finite values."""
    b = normal_bits(rng, n, 2.0)
    idx = rng.permutation(n)
    k = max(1, n // 10)
    b[idx[:k]] = np.array([-np.inf], np.float32).astype(BF16).view(np.uint16)[0]
    b[idx[k : 2 * k]] = 0x7FC1  # a NaN
    b[idx[2 * k : 3 * k]] = 0x8000  # -0.0
    if n >= 3 * k + 1:
        b[idx[3 * k]] = np.float32(9.0).astype(BF16).view(np.uint16)  # a clear maximum
    return b


PARAM_CHOICES = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=1.3, top_k=50),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.5),
    SamplingParams(temperature=2.0, top_p=0.3),
    SamplingParams(temperature=0.7, top_k=1),
]


def mixed_params(rng: np.random.Generator, m: int) -> list[SamplingParams]:
    out = []
    for _ in range(m):
        p = PARAM_CHOICES[int(rng.integers(len(PARAM_CHOICES)))]
        out.append(
            SamplingParams(p.temperature, p.top_p, p.top_k, int(rng.integers(0, 2**64, dtype=np.uint64)))
        )
    return out


def mixed_bits(rng: np.random.Generator, m: int, n: int) -> np.ndarray:
    """Rows of several kinds: normal at two spreads, tied, special values, kernel_util's random."""
    from kernel_util import random_bf16

    rows = []
    for e in range(m):
        kind = e % 5
        if kind == 0:
            rows.append(normal_bits(rng, n, 1.0))
        elif kind == 1:
            rows.append(normal_bits(rng, n, 4.0))
        elif kind == 2:
            rows.append(tied_bits(rng, n))
        elif kind == 3:
            rows.append(special_bits(rng, n))
        else:
            rows.append(random_bf16(rng, n, exp_lo=-3).view(np.uint16))
    return np.stack(rows)


# ---- running -------------------------------------------------------------------------------------


@dataclass
class Outputs:
    entries: np.ndarray
    drafts: np.ndarray
    probs: np.ndarray
    host_drafts: np.ndarray
    host_probs: np.ndarray
    dists: list[np.ndarray | None]  # per entry: f32 [rows, n] or None
    workspace: np.ndarray  # u8
    dist_guards_ok: list[bool] = field(default_factory=list)


def _put(gpu, arr: np.ndarray | None, nbytes: int, fill: int = POISON):
    p = gpu.alloc(nbytes + GUARD)
    gpu.memset(p, fill, nbytes + GUARD)
    if fill != POISON:
        gpu.memset(p.offset(nbytes), POISON, GUARD)
    if arr is not None and arr.nbytes:
        gpu.copy_h2d(p, np.ascontiguousarray(arr))
    return p


def _get(gpu, p, nbytes: int, what: str) -> np.ndarray:
    buf = np.empty(nbytes + GUARD, np.uint8)
    gpu.copy_d2h(buf, p)
    assert (buf[nbytes:] == POISON).all(), f"{what}: the kernel wrote past the end of the buffer"
    return buf[:nbytes]


def run_case(gpu, case: SampleCase, records: np.ndarray | None = None, repeat: int = 1) -> Outputs:
    """One launch on ``gpu`` (``repeat`` launches: outputs of the last); every buffer poisoned with
    a guard after it, the workspace zeroed; the records packed with each entry's dist address (or
    the given records, whose dist words are replaced)."""
    m, n, kmax = case.m, case.n, case.kmax
    allocs = []

    def put(arr, nbytes, fill=POISON):
        p = _put(gpu, arr, nbytes, fill)
        allocs.append(p)
        return p

    try:
        dbytes = case.rows * n * 4
        dists = [put(None, dbytes) if case.with_dist[e] else None for e in range(m)]
        recs = np.stack([case.record(e, dists[e].addr if dists[e] else 0) for e in range(m)])
        if records is not None:
            recs[:, :6] = records[:, :6]
        logits = put(case.bits, case.bits.nbytes)
        sampling = put(recs, recs.nbytes)
        entries = put(case.entries, case.entries.nbytes)
        drafts = put(case.drafts, case.drafts.nbytes)
        probs = put(case.probs, case.probs.nbytes)
        wsb = ds.sample_workspace_bytes(m, n)
        ws = put(None, wsb, fill=0)
        hd, hp = gpu.alloc_mapped(m * kmax * 4 + GUARD), gpu.alloc_mapped(m * kmax * 4 + GUARD)
        try:
            hd.host[:] = POISON
            hp.host[:] = POISON
            for _ in range(repeat):
                ds.draft_sample_batch(
                    gpu,
                    logits=logits,
                    sampling=sampling,
                    entries=entries,
                    drafts=drafts,
                    probs=probs,
                    host_drafts=hd.device,
                    host_probs=hp.device,
                    draft_index=case.draft_index,
                    kmax=kmax,
                    publish=case.publish,
                    m=m,
                    n=n,
                    workspace=ws,
                )
            gpu.synchronize()
            host_d, host_p = hd.host.copy(), hp.host.copy()
        finally:
            gpu.free_mapped(hd)
            gpu.free_mapped(hp)
        assert (host_d[m * kmax * 4 :] == POISON).all() and (host_p[m * kmax * 4 :] == POISON).all(), (
            "the kernel wrote past the host buffers"
        )
        out_dists = [
            _get(gpu, d, dbytes, f"dist of entry {e}").view(np.float32).reshape(case.rows, n) if d else None
            for e, d in enumerate(dists)
        ]
        return Outputs(
            _get(gpu, entries, case.entries.nbytes, "entries").view(np.uint32).reshape(m, ENTRY_WORDS),
            _get(gpu, drafts, case.drafts.nbytes, "drafts").view(np.uint32).reshape(m, kmax),
            _get(gpu, probs, case.probs.nbytes, "probs").view(np.float32).reshape(m, kmax),
            host_d[: m * kmax * 4].view(np.uint32).reshape(m, kmax),
            host_p[: m * kmax * 4].view(np.float32).reshape(m, kmax),
            out_dists,
            _get(gpu, ws, wsb, "workspace"),
        )
    finally:
        for p in allocs:
            gpu.free(p)


def expected(case: SampleCase) -> list[ds.RowSample | None]:
    """sample_row per live entry (None for padding)."""
    out: list[ds.RowSample | None] = []
    for e in range(case.m):
        if not case.live(e):
            out.append(None)
            continue
        rec = ds.Record.of(case.record(e))
        out.append(ds.sample_row(case.bits[e], rec, int(case.entries[e, 2]), case.draft_index))
    return out


# ---- checks --------------------------------------------------------------------------------------


def u32(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def gumbel_near_tie(case: SampleCase, e: int, a: int, b: int, kept: np.ndarray, rel: float = 1e-5) -> bool:
    """Whether tokens a and b of entry e are both kept and their perturbed scores, recomputed in
    float64 from the exact uniforms, are within ``rel`` of each other (so that an ulp of logf can
    decide between them): the one case where the device's token may differ from the twin's."""
    if not (kept[a] and kept[b]):
        return False
    p = case.params[e]
    _, l = ds.order_keys(case.bits[e, [a, b]])
    z = (l / np.float32(p.temperature)).astype(np.float64)
    u = uniforms(int(p.seed), case.positions[e], case.draft_index, Stream.DRAFT, np.array([a, b], np.uint64))
    s = z - np.log(-np.log(u.astype(np.float64)))
    return bool(abs(s[0] - s[1]) <= rel * max(1.0, abs(s[0]), abs(s[1])))


def check_outputs(
    case: SampleCase, out: Outputs, exp: list[ds.RowSample | None], what: str, allow_near_ties: bool = False
) -> int:
    """The contract, entry by entry, against the expected rows; returns the number of tokens that
    differed from the twin's at a Gumbel near-tie (only with ``allow_near_ties``, else none may)."""
    m, kmax, i = case.m, case.kmax, case.draft_index
    ties = 0
    for e in range(m):
        w = f"{what}: entry {e} of {m}"
        if not case.live(e):
            assert (out.entries[e] == case.entries[e]).all(), f"{w} (padding): entry words written"
            assert (out.drafts[e] == case.drafts[e]).all(), f"{w} (padding): drafts written"
            assert (u32(out.probs[e]) == u32(case.probs[e])).all(), f"{w} (padding): probs written"
            assert (u32(out.host_drafts[e]) == POISON_U32).all(), f"{w} (padding): host drafts written"
            assert (u32(out.host_probs[e]) == POISON_U32).all(), f"{w} (padding): host probs written"
            if out.dists[e] is not None:
                assert (u32(out.dists[e]) == POISON_U32).all(), f"{w} (padding): its dist buffer was written"
            continue
        x = exp[e]
        assert x is not None
        t = int(out.entries[e, 2])
        assert (out.entries[e, [0, 1, 3]] == case.entries[e, [0, 1, 3]]).all(), f"{w}: entry words changed"
        assert 0 <= t < case.n, f"{w}: token {t:#x} is not an index"
        if t != x.token:
            assert allow_near_ties and gumbel_near_tie(case, e, t, x.token, x.kept), (
                f"{w}: token {t}, expected {x.token} ({case.params[e]})"
            )
            ties += 1
        q = x.dist[t] if x.state.mode else np.float32(1.0)
        assert u32(out.probs[e, i]) == u32(q), f"{w}: q {out.probs[e, i]!r}, expected {q!r}"
        assert int(out.drafts[e, i]) == (t if x.state.mode else int(case.drafts[e, i])), f"{w}: drafts[{i}]"
        keep = [j for j in range(kmax) if j != i]
        assert (out.drafts[e, keep] == case.drafts[e, keep]).all(), f"{w}: other drafts changed"
        assert (u32(out.probs[e, keep]) == u32(case.probs[e, keep])).all(), f"{w}: other probs changed"
        if case.publish:
            assert (out.host_drafts[e, : i + 1] == out.drafts[e, : i + 1]).all(), f"{w}: host drafts"
            assert (u32(out.host_probs[e, : i + 1]) == u32(out.probs[e, : i + 1])).all(), f"{w}: host probs"
            assert (u32(out.host_drafts[e, i + 1 :]) == POISON_U32).all(), (
                f"{w}: host drafts past draft_index"
            )
            assert (u32(out.host_probs[e, i + 1 :]) == POISON_U32).all(), f"{w}: host probs past draft_index"
        else:
            assert (u32(out.host_drafts[e]) == POISON_U32).all(), f"{w}: host drafts written without publish"
            assert (u32(out.host_probs[e]) == POISON_U32).all(), f"{w}: host probs written without publish"
        d = out.dists[e]
        if d is not None:
            other = [r for r in range(case.rows) if r != i]
            assert (u32(d[other]) == POISON_U32).all(), f"{w}: dist rows other than {i} written"
            bad = u32(d[i]) != u32(x.dist)
            assert not bad.any(), (
                f"{w}: {int(bad.sum())} dist elements differ, first {int(np.argmax(bad))}: "
                f"{d[i][bad][:3]!r} expected {x.dist[bad][:3]!r}"
            )
    check_workspace_rest(case, out.workspace)
    return ties


def check_workspace_rest(case: SampleCase, ws: np.ndarray) -> None:
    """Histograms, largest keys, counters and best keys zero after a launch (a replay needs them)."""
    m = case.m
    assert not ws[: m * ds.HIST_BYTES].any(), "a histogram is not zero after the launch"
    states = ws[m * ds.HIST_BYTES : m * (ds.HIST_BYTES + ds.ROW_STATE_BYTES)].view(np.uint32).reshape(m, -1)
    assert not states[:, :6].any(), "a row's largest key, counters or best key are not zero after the launch"


def state_words(case: SampleCase, ws: np.ndarray) -> np.ndarray:
    m = case.m
    return ws[m * ds.HIST_BYTES : m * (ds.HIST_BYTES + ds.ROW_STATE_BYTES)].view(np.uint32).reshape(m, -1)
