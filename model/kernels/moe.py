"""MoE of a batch: sigmoid router, top-k with correction bias (optionally group-limited, as
DeepSeek-V3's n_group / topk_group), and expert GEMVs that read the chosen ids from device memory,
over the m entries of a batch (model/kernels/batch.py).

Slots: the routed experts fill slots 0..topk-1; the shared expert, when present, is slot topk,
with weight 1 (it has no gate: the published checkpoints store none, and transformers'
``Glm5NextTextMoE`` adds it ungated). ``moe_down_batch`` writes one f32 row per slot (zero for an
expert this rank does not hold), and ``bgemv.sum_rows_residual_batch`` adds the rows in slot order,
so the zero-padded all-reduce of a sharded run reproduces one rank's arithmetic exactly.

router_group_batch routes the batch and groups its (entry, slot) pairs by local expert in its last
block; moe_gate_up_batch and moe_down_batch then read each used expert's rows once for all its
pairs. A pair's arithmetic does not depend on the batch. moe_gate_up_fp8_batch and
moe_down_fp8_batch are the same contracts with FP8 E4M3 experts and 128 x 128 block scales (the
section "FP8 experts" below). CUDA: ptx/moe.cu.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.dtypes import BF16, FP8
from runtime.kernel import F32, PTR, U32, declare
from runtime.launch import launch

from .batch import check_rows, is_pad, read_entries


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-np.asarray(x, np.float32)))).astype(np.float32)


def clamped_swiglu(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    g = np.minimum(np.asarray(g, np.float32), np.float32(limit))
    u = np.clip(np.asarray(u, np.float32), -np.float32(limit), np.float32(limit))
    return g * sigmoid(g) * u


def kept_groups_ref(sel: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """Group-limited routing's kept groups (bool [n_group]): the experts split into n_group
    consecutive groups, a group's score the f32 sum of its two largest ``sel`` (score + bias)
    values, the topk_group highest scores kept, the lower group first on a tie and NaN last."""
    g = np.asarray(sel, np.float32).reshape(n_group, -1)
    top2 = np.take_along_axis(g, np.argsort(-g.astype(np.float64), axis=1, kind="stable")[:, :2], axis=1)
    score = (top2[:, 0] + top2[:, 1]).astype(np.float32)
    kept = np.zeros(n_group, bool)
    kept[np.argsort(-score.astype(np.float64), kind="stable")[:topk_group]] = True
    return kept


def route_ref(
    scores: np.ndarray,
    bias: np.ndarray,
    topk: int,
    norm: bool,
    scale: float,
    n_group: int = 1,
    topk_group: int = 1,
):
    """ids by higher score+bias then lower index, among the kept groups' experts (kept_groups_ref)
    with n_group > 1 and topk_group < n_group, else among all; weights from the unbiased scores."""
    sel = np.asarray(scores, np.float32) + np.asarray(bias, np.float32)
    cand = np.arange(len(sel))
    if n_group > 1 and topk_group < n_group:
        cand = cand[np.repeat(kept_groups_ref(sel, n_group, topk_group), len(sel) // n_group)]
    # cand is increasing, so the stable sort keeps the lower index first on a tie.
    ids = cand[np.argsort(-sel[cand].astype(np.float64), kind="stable")[:topk]].astype(np.uint32)
    w = scores[ids].astype(np.float32)
    if norm:
        w = w / w.sum(dtype=np.float32)
    return ids, (w * np.float32(scale)).astype(np.float32)


# shared: 0 no shared-expert slot, 1 slot ntopk is the shared expert (w_shared, [1, 2I, H] /
# [1, H, I]), 2 the slot exists but another rank holds the shared expert (its parts row is zero).
SHARED_NONE, SHARED_HERE, SHARED_ELSEWHERE = 0, 1, 2


# ptx/moe.cu: rows per block of the GEMVs (8 warps; gate_up one act element per warp, down 4 rows).
GATE_UP_PER_BLOCK = 8
DOWN_ROWS_PER_BLOCK = 32


# ---- batched drafting (issue 15) -----------------------------------------------------------------
#
# One launch covers the m entries of a batch (model/kernels/batch.py): the router scores and routes
# every live entry and its last block groups the batch's (entry, slot) pairs by local expert on
# the device (router_group_batch); moe_gate_up_batch / moe_down_batch read each used expert's rows once for all its pairs.
# Pair (e, j) is entry e's slot j; its index e * nslots + j is its row in act [m * nslots][inter] and
# in parts [m * nslots][h] (nslots = ntopk + 1 with a shared-expert slot), and its y row is e. A
# pair's act and parts rows are the bits it gets in a launch of its entry alone, whatever the batch.

# Pairs per work item (ptx/moe.cu MOE_PAIRS): an expert with c pairs has ceil(c / 8) items, each
# item's blocks read the expert's rows once for up to 8 pairs (8 f32 accumulators per row and lane).
PAIRS_PER_ITEM = 8
ROUTER_ROWS = 8  # batch rows per router block (ptx/moe.cu ROUTER_ROWS)
GROUP_ZERO = 0xFFFFFFFF  # an item's expert: live pairs of experts this rank does not hold
GROUP_HEADER_WORDS = 4  # n_items, n_used, local pairs, zero pairs


def items_bound(pairs: int, n_local: int) -> int:
    """Most work items ``pairs`` routed pairs can make over ``n_local`` experts (the zero items
    included): ``pairs`` while every pair can have an expert of its own, else one item per expert
    plus one per further PAIRS_PER_ITEM pairs plus one partial zero item. The launches' grids are
    sized by it: at m = 1, top-8, 8 items, one per routed slot."""
    if pairs <= n_local:
        return pairs
    return n_local + (pairs - n_local) // PAIRS_PER_ITEM + 1


@dataclass(frozen=True)
class GroupLayout:
    """The group workspace (u32 words, ptx/moe.cu group_layout): header [n_items, n_used,
    n_pairs (local), n_zero], items [items_bound][4] (expert or GROUP_ZERO, the expert's first item
    | its item count << 16, its first pair in ``pairs``, its pair count), counts [n_local],
    offsets [n_local], used [min(n_local, m * ntopk)], pairs [m * ntopk] (the local pairs by
    expert, then the zero pairs). The workspace must be 16-byte aligned (the items are uint4)."""

    m: int
    ntopk: int
    n_local: int

    @property
    def n_items_max(self) -> int:
        return items_bound(self.m * self.ntopk, self.n_local)

    @property
    def items(self) -> int:
        return GROUP_HEADER_WORDS

    @property
    def counts(self) -> int:
        return self.items + 4 * self.n_items_max

    @property
    def offsets(self) -> int:
        return self.counts + self.n_local

    @property
    def used(self) -> int:
        return self.offsets + self.n_local

    @property
    def pairs(self) -> int:
        return self.used + min(self.n_local, self.m * self.ntopk)

    @property
    def words(self) -> int:
        return self.pairs + self.m * self.ntopk


def group_workspace_bytes(m: int, ntopk: int, n_local: int) -> int:
    """Bytes of the group workspace for m entries (also enough for every smaller m)."""
    return 4 * GroupLayout(m, ntopk, n_local).words


def router_counter_words(m: int, grouped: bool = False) -> int:
    """u32 words of the router's counter: one per row chunk (zero, left zero), and with ``grouped``
    one more for router_group_batch's hand-over between the chunks."""
    return -(-m // ROUTER_ROWS) + (1 if grouped else 0)


def group_smem_bytes(m: int, ntopk: int, n_local: int) -> int:
    """Shared memory of the grouping (ptx/moe.cu group_smem_words): the experts' row bitmasks, a
    code per pair, the rows' zero-slot masks, an offset per expert and per row."""
    return 4 * (n_local * -(-m // 32) + m * ntopk + m * -(-ntopk // 32) + n_local + m)


@dataclass(frozen=True)
class Group:
    """A decoded group workspace (tests and the host twins read it)."""

    n_items: int
    n_used: int
    n_pairs: int
    n_zero: int
    items: np.ndarray  # [n_items, 4] u32
    counts: np.ndarray  # [n_local]
    offsets: np.ndarray  # [n_local]
    used: np.ndarray  # [n_used]
    pairs: np.ndarray  # [n_pairs + n_zero]


def decode_group(words: np.ndarray, m: int, ntopk: int, n_local: int) -> Group:
    """The written parts of a group workspace (u32 words, as read back from memory)."""
    g = GroupLayout(m, ntopk, n_local)
    w = np.asarray(words, np.uint32)
    n_items, n_used, n_pairs, n_zero = (int(v) for v in w[:GROUP_HEADER_WORDS])
    return Group(
        n_items,
        n_used,
        n_pairs,
        n_zero,
        w[g.items : g.items + 4 * n_items].reshape(n_items, 4),
        w[g.counts : g.counts + n_local],
        w[g.offsets : g.offsets + n_local],
        w[g.used : g.used + n_used],
        w[g.pairs : g.pairs + n_pairs + n_zero],
    )


def _live(mem, entries, m: int) -> list[int]:
    ent = read_entries(mem, entries, m)
    return [e for e in range(m) if not is_pad(ent[e])]


def route_batch_ref(
    mem,
    w,
    y,
    bias,
    scores,
    ids,
    weights,
    entries,
    m,
    n_experts,
    h,
    topk,
    norm,
    scale,
    shared,
    n_group=1,
    topk_group=1,
):
    """The routing of each live entry e: y row e [h] BF16 -> scores row e [n_experts] f32 =
    sigmoid(W @ y), ids / weights row e [topk + shared] by route_ref (group-limited with n_group /
    topk_group; the shared expert as slot topk: id 0, weight 1). A padding entry's output rows are
    not written (the device reads its y row, which is batch scratch). Each row's values are its own
    matrix-vector product's alone."""
    wv = mem.read(w, BF16, (n_experts, h)).astype(np.float32)
    b = mem.read(bias, np.float32, n_experts)
    slots = topk + (1 if shared else 0)
    for e in _live(mem, entries, m):
        s = sigmoid(wv @ mem.read(y.offset(e * h * 2), BF16, h).astype(np.float32))
        mem.write(scores.offset(e * n_experts * 4), s)
        i, wt = route_ref(s, b, topk, bool(norm), scale, n_group, topk_group)
        if shared:
            i = np.append(i, np.uint32(0))
            wt = np.append(wt, np.float32(1.0)).astype(np.float32)
        mem.write(ids.offset(e * slots * 4), i.astype(np.uint32))
        mem.write(weights.offset(e * slots * 4), wt.astype(np.float32))


def group_ref(
    ids: np.ndarray, live: list[int], m: int, ntopk: int, nslots: int, expert_base: int, n_local: int
):
    """The grouping as plain Python: ``ids`` u32 [m, nslots] (only the live rows' first ntopk
    slots are looked at). Returns (counts, pairs by local expert, zero pairs) in the kernel's
    deterministic order: pair indices increasing within an expert and among the zero pairs."""
    by_expert: list[list[int]] = [[] for _ in range(n_local)]
    zero: list[int] = []
    for e in live:
        seen = set()
        for j in range(ntopk):
            x = (int(ids[e, j]) - expert_base) & 0xFFFFFFFF  # below the base wraps: not local
            if x < n_local:
                if x in seen:
                    raise ValueError(
                        f"router_group_batch: entry {e} names local expert {x} twice (a row's routed "
                        "ids must be distinct, as the router's top-k makes them)"
                    )
                seen.add(x)
                by_expert[x].append(e * nslots + j)
            else:
                zero.append(e * nslots + j)
    return by_expert, zero


def group_batch_ref(mem, ids, entries, group, m, ntopk, nslots, expert_base, n_local):
    """The live entries' routed pairs (e, j < ntopk) grouped by local expert x = ids[e][j] -
    expert_base in [0, n_local), into the group workspace (GroupLayout): per expert its pairs in
    increasing pair index, experts in increasing order, then the zero pairs (live pairs of other
    ranks' experts) in increasing pair index; counts and offsets of every local expert, the used
    experts, and the work items (ceil(count / 8) per used expert, then ceil(zero / 8)). Padding
    entries give no pairs. Writes the header, items [0, n_items), counts, offsets, used [0, n_used)
    and pairs [0, n_pairs + n_zero), nothing else. A row's routed ids must be distinct."""
    g = GroupLayout(m, ntopk, n_local)
    idv = mem.read(ids, np.uint32, (m, nslots))
    by_expert, zero = group_ref(idv, _live(mem, entries, m), m, ntopk, nslots, expert_base, n_local)
    counts = np.array([len(p) for p in by_expert], np.uint32)
    offsets = (np.cumsum(counts, dtype=np.uint64) - counts).astype(np.uint32)
    used = np.array([x for x in range(n_local) if counts[x]], np.uint32)
    items = []
    for x in used:
        n = -(-int(counts[x]) // PAIRS_PER_ITEM)
        first = len(items)
        items += [(int(x), first | (n << 16), int(offsets[x]), int(counts[x]))] * n
    n_pairs = int(counts.sum())
    if zero:
        n = -(-len(zero) // PAIRS_PER_ITEM)
        first = len(items)
        items += [(GROUP_ZERO, first | (n << 16), n_pairs, len(zero))] * n
    pairs = np.array([p for lst in by_expert for p in lst] + zero, np.uint32)
    base = group
    mem.write(base, np.array([len(items), len(used), n_pairs, len(zero)], np.uint32))
    if items:
        mem.write(base.offset(4 * g.items), np.array(items, np.uint32).reshape(-1))
    if n_local:
        mem.write(base.offset(4 * g.counts), counts)
        mem.write(base.offset(4 * g.offsets), offsets)
    if len(used):
        mem.write(base.offset(4 * g.used), used)
    if len(pairs):
        mem.write(base.offset(4 * g.pairs), pairs)


@declare(
    "moe",
    "router_group_batch",
    [
        ("w", PTR),
        ("y", PTR),
        ("bias", PTR),
        ("scores", PTR),
        ("ids", PTR),
        ("weights", PTR),
        ("counter", PTR),
        ("entries", PTR),
        ("m", U32),
        ("n_experts", U32),
        ("h", U32),
        ("topk", U32),
        ("norm", U32),
        ("scale", F32),
        ("shared", U32),
        ("group", PTR),
        ("expert_base", U32),
        ("n_local", U32),
        ("n_group", U32),
        ("topk_group", U32),
    ],
    writes=("scores", "ids", "weights", "counter", "group"),
    pdl=True,
)
def ROUTER_GROUP_BATCH(
    mem,
    w,
    y,
    bias,
    scores,
    ids,
    weights,
    counter,
    entries,
    m,
    n_experts,
    h,
    topk,
    norm,
    scale,
    shared,
    group,
    expert_base,
    n_local,
    n_group,
    topk_group,
):
    """route_batch_ref (group-limited with n_group / topk_group), then group_batch_ref of its ids
    (nslots = topk + shared), in one launch (the last row chunk to be routed groups the batch).
    ``counter``: u32[router_counter_words(m, grouped=True)], zero, left zero."""
    route_batch_ref(
        mem,
        w,
        y,
        bias,
        scores,
        ids,
        weights,
        entries,
        m,
        n_experts,
        h,
        topk,
        norm,
        scale,
        shared,
        n_group,
        topk_group,
    )
    slots = topk + (1 if shared else 0)
    group_batch_ref(mem, ids, entries, group, m, topk, slots, expert_base, n_local)
    mem.write(counter, np.zeros(router_counter_words(m, grouped=True), np.uint32))


def _items(mem, group, m: int, ntopk: int, n_local: int):
    """(expert, pair indices) of each work item, as the device blocks read them."""
    g = GroupLayout(m, ntopk, n_local)
    n_items = int(mem.read(group, np.uint32, 1)[0])
    if n_items == 0:
        return
    rec = mem.read(group.offset(4 * g.items), np.uint32, (n_items, 4))
    for it in range(n_items):
        x, fn, start, count = (int(v) for v in rec[it])
        t = it - (fn & 0xFFFF)
        p0 = t * PAIRS_PER_ITEM
        n = min(PAIRS_PER_ITEM, count - p0)
        yield x, mem.read(group.offset(4 * (g.pairs + start + p0)), np.uint32, n)


@declare(
    "moe",
    "moe_gate_up_batch",
    [
        ("w", PTR),
        ("w_shared", PTR),
        ("y", PTR),
        ("group", PTR),
        ("act", PTR),
        ("entries", PTR),
        ("m", U32),
        ("ntopk", U32),
        ("n_local", U32),
        ("inter", U32),
        ("h", U32),
        ("limit", F32),
        ("shared", U32),
    ],
    writes=("act",),
    pdl=True,
)
def MOE_GATE_UP_BATCH(mem, w, w_shared, y, group, act, entries, m, ntopk, n_local, inter, h, limit, shared):
    """The gate/up projection of every pair of the batch: act[pair] = clamped SwiGLU of w_x @ y[e] for the
    group's local pairs (w [n_local, 2 * inter, h]), and with shared == SHARED_HERE of w_shared @
    y[e] as slot ntopk of every live entry. Zero pairs, padding entries and (SHARED_ELSEWHERE) the
    shared slot are not written. ntopk == 0 with SHARED_HERE is a dense MLP (the group is not
    read)."""
    nslots = ntopk + (1 if shared != SHARED_NONE else 0)

    def run(we: np.ndarray, pairs) -> None:
        for p in pairs:
            p = int(p)
            yv = mem.read(y.offset((p // nslots) * h * 2), BF16, h).astype(np.float32)
            gu = we @ yv
            mem.write(act.offset(p * inter * 2), clamped_swiglu(gu[:inter], gu[inter:], limit).astype(BF16))

    if shared == SHARED_HERE:
        we = mem.read(w_shared, BF16, (2 * inter, h)).astype(np.float32)
        run(we, [e * nslots + ntopk for e in _live(mem, entries, m)])
    if ntopk:
        cache: dict[int, np.ndarray] = {}
        for x, pairs in _items(mem, group, m, ntopk, n_local):
            if x >= n_local:
                continue
            if x not in cache:
                cache = {
                    x: mem.read(w.offset(x * 2 * inter * h * 2), BF16, (2 * inter, h)).astype(np.float32)
                }
            run(cache[x], pairs)


@declare(
    "moe",
    "moe_down_batch",
    [
        ("w", PTR),
        ("w_shared", PTR),
        ("act", PTR),
        ("weights", PTR),
        ("group", PTR),
        ("parts", PTR),
        ("entries", PTR),
        ("m", U32),
        ("ntopk", U32),
        ("n_local", U32),
        ("h", U32),
        ("inter", U32),
        ("shared", U32),
    ],
    writes=("parts",),
    pdl=True,
)
def MOE_DOWN_BATCH(
    mem, w, w_shared, act, weights, group, parts, entries, m, ntopk, n_local, h, inter, shared
):
    """The down projection of every pair: parts[pair] = weights[pair] * (w_x @ act[pair]) in f32 for the
    group's local pairs (w [n_local, h, inter]); zeros for its zero pairs; the shared slot of every
    live entry: w_shared @ act[pair] with SHARED_HERE (its weight is 1, as the router and the dense
    MLP give it), zeros with SHARED_ELSEWHERE. Padding entries' rows are not written."""
    nslots = ntopk + (1 if shared != SHARED_NONE else 0)
    if shared != SHARED_NONE:
        pairs = [e * nslots + ntopk for e in _live(mem, entries, m)]
        we = mem.read(w_shared, BF16, (h, inter)).astype(np.float32) if shared == SHARED_HERE else None
        for p in pairs:
            if we is None:
                mem.write(parts.offset(p * h * 4), np.zeros(h, np.float32))
            else:
                a = mem.read(act.offset(p * inter * 2), BF16, inter).astype(np.float32)
                mem.write(parts.offset(p * h * 4), (we @ a).astype(np.float32))
    if ntopk:
        cache: dict[int, np.ndarray] = {}
        for x, pairs in _items(mem, group, m, ntopk, n_local):
            for p in pairs:
                p = int(p)
                if x >= n_local:
                    mem.write(parts.offset(p * h * 4), np.zeros(h, np.float32))
                    continue
                if x not in cache:
                    cache = {x: mem.read(w.offset(x * h * inter * 2), BF16, (h, inter)).astype(np.float32)}
                a = mem.read(act.offset(p * inter * 2), BF16, inter).astype(np.float32)
                wt = mem.read(weights.offset(p * 4), np.float32, 1)[0]
                mem.write(parts.offset(p * h * 4), (np.float32(wt) * (cache[x] @ a)).astype(np.float32))


def _check_batch(what: str, m: int, group=None) -> None:
    check_rows(what, m)
    if group is not None and group.addr % 16:
        raise ValueError(f"{what}: the group workspace must be 16-byte aligned (its items are uint4)")


# Expert groups of group-limited routing: one lane of the routing warp scores each group
# (ptx/moe.cu kept_groups).
MAX_EXPERT_GROUPS = 32


def _check_expert_groups(n_experts: int, topk: int, n_group: int, topk_group: int) -> None:
    """The group-limited routing the kernel does (ptx/moe.cu groups_ok), else a ValueError."""
    if not 1 <= n_group <= MAX_EXPERT_GROUPS:
        raise ValueError(f"router_group_batch: n_group {n_group} outside the kernel's 1..{MAX_EXPERT_GROUPS}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"router_group_batch: topk_group {topk_group} outside 1..n_group {n_group}")
    if n_group == 1:
        return
    if n_experts % n_group:
        raise ValueError(
            f"router_group_batch: {n_experts} experts do not split into n_group {n_group} equal groups"
        )
    gs = n_experts // n_group
    if gs < 2:
        raise ValueError(
            f"router_group_batch: groups of {gs} expert(s) ({n_experts} / n_group {n_group}): a group's "
            "score is the sum of its two largest choices"
        )
    if topk > topk_group * gs:
        raise ValueError(
            f"router_group_batch: top-{topk} exceeds the {topk_group} kept groups' "
            f"{topk_group * gs} experts (topk_group {topk_group} x {gs} per group)"
        )


def router_group_batch(
    gpu,
    *,
    w,
    y,
    bias,
    scores,
    ids,
    weights,
    counter,
    entries,
    group,
    m,
    n_experts,
    h,
    topk,
    norm,
    scale,
    shared,
    expert_base,
    n_local,
    n_group: int = 1,
    topk_group: int = 1,
    stream=None,
):
    """ROUTER_GROUP_BATCH. Grid (ceil(m / 8), ceil(n_experts / 8)): the 8 rows of a chunk share a
    block's expert rows, the chunks of one expert block are neighbours (the expert rows come from
    HBM once). The grouping runs in the last routing block (256 threads) in the staging memory, so
    the launch asks for the larger of the two; group-limited routing (n_group > 1, topk_group <
    n_group: DeepSeek-V3's expert groups) keeps each routing warp's n_experts keys there too.
    n_group == 1 (or topk_group == n_group) routes over all experts, as without groups."""
    _check_batch("router_group_batch", m, group)
    if n_experts > 1024 or topk > min(128, n_experts) or topk < 1:
        raise ValueError(f"router: {n_experts} experts / top-{topk} outside the kernel's 1024 / 128")
    if not 1 <= n_local <= 1024:
        raise ValueError(f"router_group_batch: {n_local} local experts outside 1..1024")
    _check_expert_groups(n_experts, topk, n_group, topk_group)
    smem = max(min(m, ROUTER_ROWS) * (-(-h * 2 // 16) * 16), group_smem_bytes(m, topk, n_local))
    if n_group > 1 and topk_group < n_group:
        smem = max(smem, min(m, ROUTER_ROWS) * n_experts * 4)
    if smem > 200 * 1024:
        raise ValueError(f"router_group_batch: h = {h} needs {smem} bytes of shared memory per block")
    launch(
        gpu,
        gpu.kernel(*ROUTER_GROUP_BATCH.key),
        (-(-m // ROUTER_ROWS), -(-n_experts // 8)),
        256,
        w,
        y,
        bias,
        scores,
        ids,
        weights,
        counter,
        entries,
        m,
        n_experts,
        h,
        topk,
        int(norm),
        scale,
        int(bool(shared)),
        group,
        expert_base,
        n_local,
        n_group,
        topk_group,
        smem=smem,
        stream=stream,
    )


def _batch_grid_y(m: int, ntopk: int, n_local: int, shared_tiles: bool) -> int:
    st = -(-m // PAIRS_PER_ITEM) if shared_tiles else 0
    return st + (items_bound(m * ntopk, n_local) if ntopk else 0)


def moe_gate_up_batch(
    gpu, *, w, w_shared, y, group, act, entries, m, ntopk, n_local, inter, h, limit, shared, stream=None
):
    """MOE_GATE_UP_BATCH. Grid (ceil(inter / 8), shared tiles + items_bound): at m = 1, top-8 with
    a shared expert, (256, 9). ``group`` may be None when ntopk == 0 (dense MLP)."""
    _check_batch("moe_gate_up_batch", m, group)
    gy = _batch_grid_y(m, ntopk, n_local, shared == SHARED_HERE)
    if gy == 0:
        return
    if group is None:
        if ntopk:
            raise ValueError("moe_gate_up_batch: routed experts need the group workspace")
        group = entries  # never read with ntopk == 0; the launch wants a pointer
    launch(
        gpu,
        gpu.kernel(*MOE_GATE_UP_BATCH.key),
        (-(-inter // GATE_UP_PER_BLOCK), gy),
        256,
        w,
        w_shared,
        y,
        group,
        act,
        entries,
        m,
        ntopk,
        n_local,
        inter,
        h,
        limit,
        shared,
        stream=stream,
    )


def moe_down_batch(
    gpu,
    *,
    w,
    w_shared,
    act,
    weights,
    group,
    parts,
    entries,
    m,
    ntopk,
    n_local,
    h,
    inter,
    shared,
    stream=None,
):
    """MOE_DOWN_BATCH. Grid (ceil(h / 32), shared tiles + items_bound): (128, 9) at m = 1, top-8
    with a shared slot. ``group`` / ``weights`` may be None when ntopk == 0."""
    _check_batch("moe_down_batch", m, group)
    gy = _batch_grid_y(m, ntopk, n_local, shared != SHARED_NONE)
    if gy == 0:
        return
    if ntopk and (group is None or weights is None):
        raise ValueError("moe_down_batch: routed experts need the group workspace and the weights")
    group = entries if group is None else group
    weights = entries if weights is None else weights
    launch(
        gpu,
        gpu.kernel(*MOE_DOWN_BATCH.key),
        (-(-h // DOWN_ROWS_PER_BLOCK), gy),
        256,
        w,
        w_shared,
        act,
        weights,
        group,
        parts,
        entries,
        m,
        ntopk,
        n_local,
        h,
        inter,
        shared,
        stream=stream,
    )


# ---- FP8 experts (issue 18) ----------------------------------------------------------------------
#
# moe_gate_up_fp8_batch / moe_down_fp8_batch: the contracts of moe_gate_up_batch / moe_down_batch
# (the same group workspace, shared-slot rules, padding and outputs) with every expert, routed and
# shared, in FP8 E4M3 with one F32 scale per 128 x 128 block: W[r, c] = q[r, c] * s[r // 128, c // 128]
# (model/checkpoint/fp8.py, the checkpoint's ``weight_scale_inv``). Layouts:
#   gate_up q [n_local, 2I, H] (gate rows, then up rows), scales [n_local, 2 * ceil(I / 128),
#     ceil(H / 128)]: the gate's block rows, then the up's (up row i uses block row ceil(I / 128) +
#     i // 128), as stack_gate_up_fp8 builds them from the two tensors' own scales;
#   down q [n_local, H, I], scales [n_local, ceil(H / 128), ceil(I / 128)];
#   the shared expert the same with n_local = 1 (its intermediate is I: n_shared_experts <= 1).
# Neither I nor H need be a multiple of 128: the last block row / column is partial.
#
# Arithmetic of one output (weight row r, activation row x of its pair), which the twins compute:
#   acc = 0 (f32); for each block b of 128 columns, in increasing order:
#     part = sum over the block's columns c of q[r, c] * x[c], in f32 (q converted exactly; on the
#            device the tensor core's sum of eight k16 steps, on the host NumPy's f32 dot);
#     acc = f32(acc + f32(s[r // 128, b] * part)).
# Then act = BF16(clamped SwiGLU(acc_gate, acc_up)), parts = f32(weight * acc) (routed pairs) or acc
# (the shared slot), as the BF16 kernels. The device and the twin differ only in the order within
# a block's partial sum (tests: within the f32 dot bound); each is batch-invariant.
#
# Device design (ptx/moe.cu): a warp multiplies 16 weight rows by the up to 8 pairs of its work item
# with mma.sync m16n8k16 (BF16 in, f32 accumulate): each FP8 weight chunk is read once per launch
# for all its pairs and widened to BF16 once (a sign-replicating byte permute, a shift and a mask,
# one BF16x2 multiply by 2^120; exact); a block of 4 warps covers 32 act elements (gate_up) or 64 output
# rows (down). The E4M3 NaN codes (0x7F, 0xFF) are not weights (quantize saturates): the device does
# not read them as NaN.

FP8_BLOCK = 128  # the scales' block in both dimensions (the checkpoints' weight_block_size)
FP8_WARPS = 4  # warps per block of the FP8 expert kernels (ptx/moe.cu FP8_WARPS)
FP8_GATE_UP_PER_BLOCK = 8 * FP8_WARPS  # act elements per block (8 per warp)
FP8_DOWN_ROWS_PER_BLOCK = 16 * FP8_WARPS  # output rows per block (16 per warp: the MMA's M)


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def gate_up_scale_shape(n_local: int, inter: int, h: int) -> tuple[int, int, int]:
    """Shape of the gate_up scales: [n_local, 2 * ceil(inter / 128), ceil(h / 128)]."""
    return (n_local, 2 * _blocks(inter), _blocks(h))


def down_scale_shape(n_local: int, h: int, inter: int) -> tuple[int, int, int]:
    """Shape of the down scales: [n_local, ceil(h / 128), ceil(inter / 128)]."""
    return (n_local, _blocks(h), _blocks(inter))


def check_fp8_block(block: tuple[int, int]) -> None:
    """ValueError unless a checkpoint's ``weight_block_size`` is the kernels' 128 x 128."""
    if tuple(int(b) for b in block) != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(
            f"FP8 experts: block scales of {list(block)} blocks; the kernels take {FP8_BLOCK} x {FP8_BLOCK} only"
        )


def _check_fp8_weight(what: str, q: np.ndarray, s: np.ndarray, rows: int, cols: int) -> None:
    q, s = np.asarray(q), np.asarray(s)
    if q.dtype != FP8 or q.shape != (rows, cols):
        raise ValueError(f"{what}: expected F8_E4M3 [{rows}, {cols}], got {q.dtype} {list(q.shape)}")
    want = (_blocks(rows), _blocks(cols))
    if s.dtype != np.float32 or s.shape != want:
        raise ValueError(
            f"{what}: block scales must be F32 {list(want)} (blocks of {FP8_BLOCK} x {FP8_BLOCK}), "
            f"got {s.dtype} {list(s.shape)}"
        )


def stack_gate_up_fp8(
    gate_q: np.ndarray, gate_s: np.ndarray, up_q: np.ndarray, up_s: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One expert's gate_up in the kernels' layout from the checkpoint's gate_proj and up_proj
    (each q F8_E4M3 [I, H] with its scales F32 [ceil(I / 128), ceil(H / 128)]): q [2I, H], scales
    [2 * ceil(I / 128), ceil(H / 128)] (the gate's block rows, then the up's). A wrong dtype or
    shape, or scales of another block size, is a ValueError."""
    gate_q = np.asarray(gate_q)
    if gate_q.ndim != 2:
        raise ValueError(f"gate_proj: expected a matrix [I, H], got shape {list(gate_q.shape)}")
    i, h = gate_q.shape
    _check_fp8_weight("gate_proj", gate_q, gate_s, i, h)
    _check_fp8_weight("up_proj", up_q, up_s, i, h)
    return np.concatenate([gate_q, up_q]), np.concatenate([gate_s, up_s])


def check_fp8_experts(
    gate_up: np.ndarray,
    gate_up_scale: np.ndarray,
    down: np.ndarray,
    down_scale: np.ndarray,
    inter: int,
    h: int,
) -> None:
    """ValueError unless the stacks are the kernels' layout for this ``inter`` and ``h``: gate_up
    F8_E4M3 [n, 2 inter, h] with F32 gate_up_scale_shape(n, inter, h), down F8_E4M3 [n, h, inter]
    with F32 down_scale_shape(n, h, inter). For the loader, before device memory is taken."""
    gate_up, down = np.asarray(gate_up), np.asarray(down)
    n = gate_up.shape[0] if gate_up.ndim == 3 else -1
    checks = [
        ("gate_up", gate_up, (n, 2 * inter, h), gate_up_scale, gate_up_scale_shape(n, inter, h)),
        ("down", down, (n, h, inter), down_scale, down_scale_shape(n, h, inter)),
    ]
    for what, q, qshape, s, sshape in checks:
        s = np.asarray(s)
        if q.dtype != FP8 or q.shape != qshape or n < 1:
            raise ValueError(f"{what}: expected F8_E4M3 {list(qshape)}, got {q.dtype} {list(q.shape)}")
        if s.dtype != np.float32 or s.shape != sshape:
            raise ValueError(
                f"{what} scales: expected F32 {list(sshape)} (blocks of {FP8_BLOCK} x {FP8_BLOCK}), "
                f"got {s.dtype} {list(s.shape)}"
            )


def _fp8_rows(mem, ptr, rows: int, cols: int) -> np.ndarray:
    """[nb, rows, 128] f32: the exact values of an FP8 [rows, cols] matrix by column block, zero
    past the last column."""
    nb = _blocks(cols)
    q = np.zeros((rows, nb * FP8_BLOCK), np.float32)
    q[:, :cols] = mem.read(ptr, np.uint8, (rows, cols)).view(FP8).astype(np.float32)
    return np.ascontiguousarray(q.reshape(rows, nb, FP8_BLOCK).transpose(1, 0, 2))


def block_scaled_dot(qb: np.ndarray, srows: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The module's arithmetic for every row of one weight against one activation row: qb [nb,
    rows, 128] (_fp8_rows), srows [rows, nb] f32 (each row's block row of scales), x [cols] f32.
    Returns [rows] f32. One row's value depends on that row and x alone."""
    nb = qb.shape[0]
    xb = np.zeros(nb * FP8_BLOCK, np.float32)
    xb[: len(x)] = x
    part = np.matmul(qb, xb.reshape(nb, FP8_BLOCK, 1))[:, :, 0]  # [nb, rows] f32
    acc = np.zeros(qb.shape[1], np.float32)
    for b in range(nb):
        acc = (acc + (srows[:, b] * part[b]).astype(np.float32)).astype(np.float32)
    return acc


def _gate_up_fp8(mem, w, ws, x: int, inter: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert x's gate_up as (_fp8_rows, per-row scales [2 inter, nbh])."""
    nbi, nbh = _blocks(inter), _blocks(h)
    qb = _fp8_rows(mem, w.offset(x * 2 * inter * h), 2 * inter, h)
    s = mem.read(ws.offset(x * 2 * nbi * nbh * 4), np.float32, (2 * nbi, nbh))
    i = np.arange(inter) // FP8_BLOCK
    return qb, np.concatenate([s[i], s[nbi + i]])


def _down_fp8(mem, w, ws, x: int, h: int, inter: int) -> tuple[np.ndarray, np.ndarray]:
    nbh, nbi = _blocks(h), _blocks(inter)
    qb = _fp8_rows(mem, w.offset(x * h * inter), h, inter)
    s = mem.read(ws.offset(x * nbh * nbi * 4), np.float32, (nbh, nbi))
    return qb, s[np.arange(h) // FP8_BLOCK]


@declare(
    "moe",
    "moe_gate_up_fp8_batch",
    [
        ("w", PTR),
        ("w_scale", PTR),
        ("w_shared", PTR),
        ("w_shared_scale", PTR),
        ("y", PTR),
        ("group", PTR),
        ("act", PTR),
        ("entries", PTR),
        ("m", U32),
        ("ntopk", U32),
        ("n_local", U32),
        ("inter", U32),
        ("h", U32),
        ("limit", F32),
        ("shared", U32),
    ],
    writes=("act",),
    pdl=True,
)
def MOE_GATE_UP_FP8_BATCH(
    mem,
    w,
    w_scale,
    w_shared,
    w_shared_scale,
    y,
    group,
    act,
    entries,
    m,
    ntopk,
    n_local,
    inter,
    h,
    limit,
    shared,
):
    """MOE_GATE_UP_BATCH's outputs with FP8 experts (w [n_local, 2 inter, h] E4M3 with w_scale
    gate_up_scale_shape(n_local, inter, h); w_shared [1, 2 inter, h] with w_shared_scale
    gate_up_scale_shape(1, inter, h)): act[pair] = clamped SwiGLU of block_scaled_dot over the
    expert's gate and up rows with y[e]. The same pairs written and the same ones left alone."""
    nslots = ntopk + (1 if shared != SHARED_NONE else 0)

    def run(qb, srows, pairs) -> None:
        for p in pairs:
            p = int(p)
            yv = mem.read(y.offset((p // nslots) * h * 2), BF16, h).astype(np.float32)
            gu = block_scaled_dot(qb, srows, yv)
            mem.write(act.offset(p * inter * 2), clamped_swiglu(gu[:inter], gu[inter:], limit).astype(BF16))

    if shared == SHARED_HERE:
        run(
            *_gate_up_fp8(mem, w_shared, w_shared_scale, 0, inter, h),
            [e * nslots + ntopk for e in _live(mem, entries, m)],
        )
    if ntopk:
        cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for x, pairs in _items(mem, group, m, ntopk, n_local):
            if x >= n_local:
                continue
            if x not in cache:
                cache = {x: _gate_up_fp8(mem, w, w_scale, x, inter, h)}
            run(*cache[x], pairs)


@declare(
    "moe",
    "moe_down_fp8_batch",
    [
        ("w", PTR),
        ("w_scale", PTR),
        ("w_shared", PTR),
        ("w_shared_scale", PTR),
        ("act", PTR),
        ("weights", PTR),
        ("group", PTR),
        ("parts", PTR),
        ("entries", PTR),
        ("m", U32),
        ("ntopk", U32),
        ("n_local", U32),
        ("h", U32),
        ("inter", U32),
        ("shared", U32),
    ],
    writes=("parts",),
    pdl=True,
)
def MOE_DOWN_FP8_BATCH(
    mem,
    w,
    w_scale,
    w_shared,
    w_shared_scale,
    act,
    weights,
    group,
    parts,
    entries,
    m,
    ntopk,
    n_local,
    h,
    inter,
    shared,
):
    """MOE_DOWN_BATCH's outputs with FP8 experts (w [n_local, h, inter] E4M3 with w_scale
    down_scale_shape(n_local, h, inter); w_shared [1, h, inter] with down_scale_shape(1, h, inter)):
    parts[pair] = f32(weights[pair] * block_scaled_dot(expert, act[pair])) for routed pairs, the dot
    alone for the shared slot with SHARED_HERE, zeros for zero pairs and (SHARED_ELSEWHERE) the shared
    slot; padding entries' rows are not written."""
    nslots = ntopk + (1 if shared != SHARED_NONE else 0)

    def dot(qb, srows, p: int) -> np.ndarray:
        return block_scaled_dot(
            qb, srows, mem.read(act.offset(p * inter * 2), BF16, inter).astype(np.float32)
        )

    if shared != SHARED_NONE:
        sh = _down_fp8(mem, w_shared, w_shared_scale, 0, h, inter) if shared == SHARED_HERE else None
        for e in _live(mem, entries, m):
            p = e * nslots + ntopk
            mem.write(parts.offset(p * h * 4), np.zeros(h, np.float32) if sh is None else dot(*sh, p))
    if ntopk:
        cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for x, pairs in _items(mem, group, m, ntopk, n_local):
            for p in pairs:
                p = int(p)
                if x >= n_local:
                    mem.write(parts.offset(p * h * 4), np.zeros(h, np.float32))
                    continue
                if x not in cache:
                    cache = {x: _down_fp8(mem, w, w_scale, x, h, inter)}
                wt = np.float32(mem.read(weights.offset(p * 4), np.float32, 1)[0])
                mem.write(parts.offset(p * h * 4), (wt * dot(*cache[x], p)).astype(np.float32))


def _check_fp8_launch(what: str, m: int, group, scales, inter: int, h: int) -> None:
    _check_batch(what, m, group)
    if inter < 1 or h < 1:
        raise ValueError(f"{what}: inter = {inter} and h = {h} must be positive")
    for name, p in scales.items():
        if p is None or p.addr % 4:
            raise ValueError(f"{what}: {name} must be a 4-byte aligned pointer to F32 block scales")


def moe_gate_up_fp8_batch(
    gpu,
    *,
    w,
    w_scale,
    w_shared,
    w_shared_scale,
    y,
    group,
    act,
    entries,
    m,
    ntopk,
    n_local,
    inter,
    h,
    limit,
    shared,
    stream=None,
):
    """MOE_GATE_UP_FP8_BATCH. Grid (ceil(inter / 32), shared tiles + items_bound), block 128: at
    m = 1, top-8 with a shared expert, (64, 9). ``group`` may be None when ntopk == 0 (dense MLP).
    The scale pointers must hold the module's layouts (a wrapper cannot see their sizes:
    check_fp8_experts is the loader's check); with SHARED_NONE / SHARED_ELSEWHERE the shared ones
    are not read (any aligned pointer)."""
    _check_fp8_launch(
        "moe_gate_up_fp8_batch", m, group, {"w_scale": w_scale, "w_shared_scale": w_shared_scale}, inter, h
    )
    gy = _batch_grid_y(m, ntopk, n_local, shared == SHARED_HERE)
    if gy == 0:
        return
    if group is None:
        if ntopk:
            raise ValueError("moe_gate_up_fp8_batch: routed experts need the group workspace")
        group = entries  # never read with ntopk == 0; the launch wants a pointer
    launch(
        gpu,
        gpu.kernel(*MOE_GATE_UP_FP8_BATCH.key),
        (-(-inter // FP8_GATE_UP_PER_BLOCK), gy),
        32 * FP8_WARPS,
        w,
        w_scale,
        w_shared,
        w_shared_scale,
        y,
        group,
        act,
        entries,
        m,
        ntopk,
        n_local,
        inter,
        h,
        limit,
        shared,
        stream=stream,
    )


def moe_down_fp8_batch(
    gpu,
    *,
    w,
    w_scale,
    w_shared,
    w_shared_scale,
    act,
    weights,
    group,
    parts,
    entries,
    m,
    ntopk,
    n_local,
    h,
    inter,
    shared,
    stream=None,
):
    """MOE_DOWN_FP8_BATCH. Grid (ceil(h / 64), shared tiles + items_bound), block 128: (64, 9) at
    m = 1, top-8 with a shared slot. ``group`` / ``weights`` may be None when ntopk == 0."""
    _check_fp8_launch(
        "moe_down_fp8_batch", m, group, {"w_scale": w_scale, "w_shared_scale": w_shared_scale}, inter, h
    )
    gy = _batch_grid_y(m, ntopk, n_local, shared != SHARED_NONE)
    if gy == 0:
        return
    if ntopk and (group is None or weights is None):
        raise ValueError("moe_down_fp8_batch: routed experts need the group workspace and the weights")
    group = entries if group is None else group
    weights = entries if weights is None else weights
    launch(
        gpu,
        gpu.kernel(*MOE_DOWN_FP8_BATCH.key),
        (-(-h // FP8_DOWN_ROWS_PER_BLOCK), gy),
        32 * FP8_WARPS,
        w,
        w_scale,
        w_shared,
        w_shared_scale,
        act,
        weights,
        group,
        parts,
        entries,
        m,
        ntopk,
        n_local,
        h,
        inter,
        shared,
        stream=stream,
    )
