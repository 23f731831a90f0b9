"""The drafter's reach past 16384 pools: the selection's checks that tests/test_dsa_reach.py (host
twin, small data) and tests/test_gpu_dsa_reach.py (the PTX, GLM-5.3-Flash's top-512 over up to
262,144 pools) both run, a NumPy model of the chunked selection's algorithm, and score data with
many exact ties.

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
from model.kernels.dsa_select import select_rows_ref, select_workspace_bytes, select_workspace_words

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
        return select_workspace_words(self.pps, self.topk)


def reach_scores(rng: np.random.Generator, m: int, n: int, kind: str) -> np.ndarray:
    """Scores [m, n] f32. ``random``: normal. ``ties``: integers -3..3 (every cut inside a tie).
    ``coarse``: normal rounded to multiples of 1/16 (ties of every size near the cut).
    ``special``: normal with -0.0, +0.0, +-inf and NaN sprinkled in (a twentieth each)."""
    if kind == "ties":
        return rng.integers(-3, 4, (m, n)).astype(np.float32)
    x = rng.standard_normal((m, n)).astype(np.float32)
    if kind == "coarse":
        return (np.round(x * 16) / 16).astype(np.float32)
    if kind == "special":
        pick = rng.random((m, n))
        x[pick < 0.05] = -0.0
        x[(pick >= 0.05) & (pick < 0.10)] = 0.0
        x[(pick >= 0.10) & (pick < 0.12)] = np.inf
        x[(pick >= 0.12) & (pick < 0.14)] = -np.inf
        x[(pick >= 0.14) & (pick < 0.16)] = np.nan
        return x
    assert kind == "random", kind
    return x


def chunked_select_ref(scores: np.ndarray, npools: int, topk: int, chunk: int) -> np.ndarray:
    """The chunked selection's algorithm in NumPy (ptx/dsa_select.cu): each chunk's top ``topk``
    (higher score first, then lower pool), the lists concatenated in chunk order, then the top
    ``topk`` of the lists with ties to the lower list position. Returns the chosen pools, ascending.
    Equal to the plain top-k for every input: what makes the kernel's merge exact."""
    neg = -scores[:npools].astype(np.float64)
    lists = []
    for lo in range(0, npools, chunk):
        part = neg[lo : lo + chunk]
        lists.append(lo + np.sort(np.argsort(part, kind="stable")[:topk]))
    cand = np.concatenate(lists)
    pick = np.argsort(neg[cand], kind="stable")[:topk]  # stable: ties to the lower position
    return np.sort(cand[pick])


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


def select_launch(gpu, p: dict, sh: SelectShape, m: int, e0: int = 0) -> None:
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
    )


def check_select_reach(gpu, scores: np.ndarray, sh: SelectShape, lay, invariance: bool = True):
    """One batched launch over ``lay`` (``layout_rows``) into poisoned lists: exact against
    select_rows_ref, nothing past a count, padding untouched, a row past slot_rows count 0, every
    workspace counter zero after the launch; with ``invariance`` each entry alone (m = 1, its
    pointers offset) gives the same bytes. Returns (selected [m, sel_cap], count [m])."""
    ent, live, outside, pads = lay
    m = len(ent)
    ns, nc = m * sh.sel_cap * 4, m * 4
    io = upload_all(gpu, {"entries": ent, "scores": scores})
    outs = poison_all(gpu, {"sel": ns, "cnt": nc, "sel1": ns, "cnt1": nc})
    ws = {}
    if sh.ws_words:
        nbytes = select_workspace_bytes(m, sh.slot_rows, sh.kpool, sh.topk)
        assert nbytes == m * sh.ws_words * 4
        ws["ws"] = gpu.alloc(nbytes)
        gpu.memset(ws["ws"], 0, nbytes)
    try:
        p = {**io, **ws, "sel": outs["sel"], "cnt": outs["cnt"]}
        select_launch(gpu, p, sh, m)
        b = bytes_of(gpu, outs, {"sel": ns, "cnt": nc})
        sel, cnt = b["sel"].view(np.uint32).reshape(m, sh.sel_cap), b["cnt"].view(np.uint32)
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
            assert cnt[e] == 0 and (sel[e] == POISON).all(), (
                f"entry {e}: a row past slot_rows must give count 0"
            )
        for e in pads:
            assert cnt[e] == POISON and (sel[e] == POISON).all(), f"padding entry {e} was written"
        if ws:
            words = np.empty(m * sh.ws_words, np.uint32)
            gpu.copy_d2h(words, ws["ws"])
            counters = words.reshape(m, sh.ws_words)[:, 0]
            assert not counters.any(), f"workspace counters left non-zero: {counters[counters != 0]}"
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
