"""The drafter's reach past 16384 pools: the selection's checks that tests/test_dsa_reach.py (host
twin, small data) and tests/test_gpu_dsa_reach.py (the PTX, GLM-5.3-Flash's top-512 over up to
262,144 pools) both run, a NumPy model of the chunked selection's radix select, and score data
with many exact ties.

A launch's entries are laid out with ``layout_rows``: live rows at chosen pool counts (the tail's
length picked at random), padding entries and a row past slot_rows at random places. Outputs are
poisoned (0xFF) before every launch; the workspace is allocated zeroed, as a caller must.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from batch_dsa_util import bytes_of, entries_of, free_all, poison_all, upload_all

from model.kernels import dsa_select
from model.kernels.batch import ENTRY_BYTES, SlotGeometry
from model.kernels.draft_sample_shard import ordered_bits_array
from model.kernels.dsa_select import (
    SELECT_CHUNK,
    SELECT_WS_HEAD_WORDS,
    select_rows_ref,
    select_workspace_bytes,
    select_workspace_words,
)

POISON = 0xFFFFFFFF


@dataclass(frozen=True)
class SelectShape:
    slot_rows: int
    kpool: int
    topk: int
    tail: bool

    @property
    def pps(self) -> int:
        return SlotGeometry(self.slot_rows, 1, self.kpool, 1).pools_per_slot

    @property
    def sel_cap(self) -> int:
        return dsa_select.selection_capacity(self.slot_rows, self.topk, self.kpool, 2)

    @property
    def ws_words(self) -> int:
        return select_workspace_words(self.pps)


KINDS = ["random", "ties", "coarse", "special"]
# Data aimed at the radix select's threshold: every score equal, three distinct values, a large
# tie straddling the cut, the cut inside a mix of -0.0 and +0.0, the cut inside NaN.
TIE_KINDS = ["equal", "few", "cut", "zeros", "nan"]


def reach_scores(rng: np.random.Generator, m: int, n: int, kind: str) -> np.ndarray:
    """Scores [m, n] f32. ``random``: normal. ``ties``: integers -3..3 (every cut inside a tie).
    ``coarse``: normal rounded to multiples of 1/16 (ties of every size near the cut).
    ``special``: normal with -0.0, +0.0, +-inf and NaN sprinkled in (a twentieth each).
    ``equal``: one value everywhere. ``few``: three values. ``cut``: a thousandth above 5.0, a
    twentieth exactly 5.0, the rest normal (a top-k of 512 past 10,000 pools, or of 2048 past
    41,000, cuts inside the 5.0s). ``zeros``: a thousandth positive, then -0.0 and +0.0 at random
    (the cut falls among zeros of both signs, which rank as equal). ``nan``: a thousandth normal,
    a two-thousandth -inf, the rest NaN (ranked last, so a top-k past them takes the lowest NaNs)."""
    if kind == "ties":
        return rng.integers(-3, 4, (m, n)).astype(np.float32)
    if kind == "equal":
        return np.full((m, n), np.float32(rng.standard_normal()), np.float32)
    if kind == "few":
        return rng.choice(np.float32([-1.5, 0.25, 3.0]), (m, n)).astype(np.float32)
    x = rng.standard_normal((m, n)).astype(np.float32)
    pick = rng.random((m, n))
    if kind == "coarse":
        return (np.round(x * 16) / 16).astype(np.float32)
    if kind == "special":
        x[pick < 0.05] = -0.0
        x[(pick >= 0.05) & (pick < 0.10)] = 0.0
        x[(pick >= 0.10) & (pick < 0.12)] = np.inf
        x[(pick >= 0.12) & (pick < 0.14)] = -np.inf
        x[(pick >= 0.14) & (pick < 0.16)] = np.nan
        return x
    if kind == "cut":
        x[pick < 0.001] = 6.0 + np.abs(x[pick < 0.001])
        x[(pick >= 0.001) & (pick < 0.051)] = 5.0
        return x
    if kind == "zeros":
        x = np.where(rng.random((m, n)) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        x[pick < 0.001] = 1.0 + rng.random(int((pick < 0.001).sum()), np.float32)
        return x
    if kind == "nan":
        x[pick >= 0.0015] = np.nan
        x[(pick >= 0.001) & (pick < 0.0015)] = -np.inf
        return x
    assert kind == "random", kind
    return x


# The chunked selection's digits (ptx/dsa_select.cu): bits 31..20, 19..10, 9..0 of the key.
RADIX_DIGITS = ((20, 4096), (10, 1024), (0, 1024))


def radix_select_ref(scores: np.ndarray, npools: int, topk: int, chunk: int = SELECT_CHUNK) -> np.ndarray:
    """The chunked selection's algorithm in NumPy (ptx/dsa_select.cu): order-preserving u32 keys;
    three passes, each adding every chunk's histogram of the next digit of the keys that share the
    threshold's digits so far, then the bin holding the remaining-th largest; the threshold key T
    and ``need``, the keys equal to it still to take; then each chunk's bitmaps (key > T, key == T)
    and every bit of the first with the ``need`` lowest bits of the second. Returns the chosen
    pools, ascending. Equal to the plain top-k for every input: what makes the kernels exact."""
    keys = ordered_bits_array(scores[:npools]).astype(np.int64)
    prefix, mask, remaining = 0, 0, topk
    for shift, bins in RADIX_DIGITS:
        hist = np.zeros(bins, np.int64)
        for lo in range(0, npools, chunk):
            k = keys[lo : lo + chunk]
            hist += np.bincount((k[(k & mask) == prefix] >> shift) & (bins - 1), minlength=bins)
        above = np.concatenate([np.cumsum(hist[::-1])[::-1][1:], [0]])  # keys in higher bins
        (digit,) = np.flatnonzero((above < remaining) & (above + hist >= remaining))  # exactly one
        remaining -= int(above[digit])
        prefix |= int(digit) << shift
        mask |= (bins - 1) << shift
    gt = np.concatenate([keys[lo : lo + chunk] > prefix for lo in range(0, npools, chunk)])
    eq = np.concatenate([keys[lo : lo + chunk] == prefix for lo in range(0, npools, chunk)])
    assert gt.sum() == topk - remaining and eq.sum() >= remaining >= 1
    gt[np.flatnonzero(eq)[:remaining]] = True
    return np.flatnonzero(gt)


def layout_rows(
    rng: np.random.Generator, sh: SelectShape, npools_list: list[int], npad: int, outside: bool
) -> tuple[np.ndarray, list[tuple[int, int, int]], list[int], list[int]]:
    """Entries for rows with the given complete-pool counts (a random tail of 0 .. kpool - 1 rows,
    within the slot), ``npad`` padding entries and with ``outside`` one row past slot_rows, in a
    shuffled order. Returns (entries, live (e, slot, row), outside entries, padding entries)."""
    items = []
    for n in npools_list:
        assert 1 <= n <= sh.pps, n
        row = min(n * sh.kpool + int(rng.integers(0, sh.kpool)), sh.slot_rows) - 1
        items.append((int(rng.integers(0, 4)), row))
    if outside:
        items.append((0, sh.slot_rows + int(rng.integers(0, 3))))
    rng.shuffle(items)
    layout: list = list(items)
    for _ in range(npad):
        layout.insert(int(rng.integers(0, len(layout) + 1)), None)
    ent, live_all = entries_of(layout, 0)
    live = [x for x in live_all if x[2] < sh.slot_rows]
    out = [x[0] for x in live_all if x[2] >= sh.slot_rows]
    pads = [e for e, it in enumerate(layout) if it is None]
    return ent, live, out, pads


def select_launch(gpu, p: dict, sh: SelectShape, m: int, e0: int = 0, stream: int | None = None) -> None:
    """select_topk_pools_batch over entries e0 .. e0 + m - 1 (pointers offset to e0's rows)."""
    dsa_select.select_topk_pools_batch(
        gpu,
        scores=p["scores"].offset(e0 * sh.pps * 4),
        selected=p["sel"].offset(e0 * sh.sel_cap * 4),
        count=p["cnt"].offset(e0 * 4),
        entries=p["entries"].offset(e0 * ENTRY_BYTES),
        m=m,
        row_add=0,
        slot_rows=sh.slot_rows,
        sel_cap=sh.sel_cap,
        topk_pools=sh.topk,
        kpool=sh.kpool,
        tail=sh.tail,
        workspace=p["ws"].offset(e0 * sh.ws_words * 4) if "ws" in p else None,
        stream=stream,
    )


def check_workspace_clean(gpu, ws, m: int, sh: SelectShape) -> None:
    """Every entry's counter and histograms back at zero (what the next launch or graph replay
    starts from); the thresholds and bitmaps may hold anything."""
    words = np.empty(m * sh.ws_words, np.uint32).reshape(m, sh.ws_words)
    gpu.copy_d2h(words, ws)
    counters = words[:, 0]
    assert not counters.any(), f"workspace counters left non-zero: {counters[counters != 0]}"
    hist = words[:, 8:SELECT_WS_HEAD_WORDS]
    assert not hist.any(), f"workspace histograms left non-zero in entries {np.flatnonzero(hist.any(axis=1))}"


def check_lists(sel: np.ndarray, cnt: np.ndarray, scores: np.ndarray, sh: SelectShape, lay) -> None:
    """Lists [m, sel_cap] and counts [m] read back from poisoned buffers, against ``lay``
    (``layout_rows``): each live row exact against select_rows_ref with nothing past its count (or
    count 0 where the list would pass sel_cap), a row past slot_rows count 0, padding untouched."""
    _, live, outside, pads = lay
    for e, _, row in live:
        ref = select_rows_ref(scores[e], row, sh.topk, sh.kpool, sh.tail)
        if ref.size > sh.sel_cap:
            assert cnt[e] == 0, f"entry {e}: a selection past sel_cap must give count 0"
            continue
        assert cnt[e] == ref.size, f"entry {e} (row {row}): count {cnt[e]}, expected {ref.size}"
        if not np.array_equal(sel[e, : ref.size], ref):
            bad = int(np.flatnonzero(sel[e, : ref.size] != ref)[0])
            raise AssertionError(
                f"entry {e} (row {row}, {(row + 1) // sh.kpool} pools): list differs first at "
                f"{bad}: {sel[e, bad]} vs {ref[bad]}"
            )
        assert (sel[e, ref.size :] == POISON).all(), f"entry {e}: written past its count"
    for e in outside:
        assert cnt[e] == 0 and (sel[e] == POISON).all(), f"entry {e}: a row past slot_rows must give count 0"
    for e in pads:
        assert cnt[e] == POISON and (sel[e] == POISON).all(), f"padding entry {e} was written"


def _zeroed_workspace(gpu, m: int, sh: SelectShape) -> dict:
    if not sh.ws_words:
        return {}
    nbytes = select_workspace_bytes(m, sh.slot_rows, sh.kpool)
    assert nbytes == m * sh.ws_words * 4
    ws = gpu.alloc(nbytes)
    gpu.memset(ws, 0, nbytes)
    return {"ws": ws}


def check_select_reach(gpu, scores: np.ndarray, sh: SelectShape, lay, invariance: bool = True):
    """One batched launch over ``lay`` (``layout_rows``) into poisoned lists: ``check_lists``, and
    every workspace counter and histogram zero after the launch; with ``invariance`` each entry
    alone (m = 1, its pointers offset) gives the same bytes. Returns (selected [m, sel_cap],
    count [m])."""
    ent = lay[0]
    m = len(ent)
    ns, nc = m * sh.sel_cap * 4, m * 4
    io = upload_all(gpu, {"entries": ent, "scores": scores})
    outs = poison_all(gpu, {"sel": ns, "cnt": nc, "sel1": ns, "cnt1": nc})
    ws = _zeroed_workspace(gpu, m, sh)
    try:
        p = {**io, **ws, "sel": outs["sel"], "cnt": outs["cnt"]}
        select_launch(gpu, p, sh, m)
        b = bytes_of(gpu, outs, {"sel": ns, "cnt": nc})
        sel, cnt = b["sel"].view(np.uint32).reshape(m, sh.sel_cap), b["cnt"].view(np.uint32)
        check_lists(sel, cnt, scores, sh, lay)
        if ws:
            check_workspace_clean(gpu, ws["ws"], m, sh)
        if invariance:
            p1 = {**io, **ws, "sel": outs["sel1"], "cnt": outs["cnt1"]}
            for e in range(m):
                select_launch(gpu, p1, sh, 1, e)
            b1 = bytes_of(gpu, outs, {"sel1": ns, "cnt1": nc})
            assert np.array_equal(b1["cnt1"], b["cnt"]), "select: a count differs from its m = 1 launch"
            assert np.array_equal(b1["sel1"], b["sel"]), "select: a list differs from its m = 1 launch"
        return sel, cnt
    finally:
        free_all(gpu, io, outs, ws)


def check_select_replays(gpu, sh: SelectShape, rounds: list[tuple[np.ndarray, tuple]]) -> None:
    """One graph captured of the selection's launches over m entries (all of ``rounds`` have m),
    replayed once per round after that round's scores and entries are copied into the buffers it
    reads and its outputs are poisoned: every replay's lists exact (``check_lists``) and the
    workspace's counters and histograms zero after each. Rounds that move a row between the one
    block and the chunked path, or shorten and lengthen it, catch anything a replay leaves behind."""
    m = len(rounds[0][1][0])
    ns, nc = m * sh.sel_cap * 4, m * 4
    io = upload_all(gpu, {"entries": rounds[0][1][0], "scores": rounds[0][0]})
    outs = poison_all(gpu, {"sel": ns, "cnt": nc})
    ws = _zeroed_workspace(gpu, m, sh)
    s = gpu.create_stream()
    graph = None
    try:
        gpu.begin_capture(s)
        try:
            select_launch(gpu, {**io, **ws, **outs}, sh, m, stream=s)
        except Exception:
            gpu.abort_capture()
            raise
        graph = gpu.end_capture(s, label="select replays")
        for scores, lay in rounds:
            assert len(lay[0]) == m
            gpu.copy_h2d(io["scores"], scores)  # synchronous: done before the replay is queued
            gpu.copy_h2d(io["entries"], lay[0])
            gpu.memset(outs["sel"], 0xFF, ns, s)
            gpu.memset(outs["cnt"], 0xFF, nc, s)
            gpu.graph_launch(graph, s)
            gpu.synchronize(s)
            b = bytes_of(gpu, outs, {"sel": ns, "cnt": nc})
            check_lists(
                b["sel"].view(np.uint32).reshape(m, sh.sel_cap), b["cnt"].view(np.uint32), scores, sh, lay
            )
            if ws:
                check_workspace_clean(gpu, ws["ws"], m, sh)
    finally:
        if graph is not None:
            gpu.graph_destroy(graph)
        gpu.destroy_stream(s)
        free_all(gpu, io, outs, ws)


def replay_rounds(rng: np.random.Generator, sh: SelectShape, counts: list[list[int]], kinds: list[str]):
    """(scores, layout) per round for ``check_select_replays``: round i's rows at counts[i] complete
    pools (the same number each round), one padding entry and one row past slot_rows, its scores
    of kinds[i]."""
    out = []
    for cs, kind in zip(counts, kinds):
        lay = layout_rows(rng, sh, cs, npad=1, outside=True)
        out.append((reach_scores(rng, len(lay[0]), sh.pps, kind), lay))
    return out
