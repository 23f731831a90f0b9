"""Group-limited routing in router_group_batch's host twin (model/kernels/moe.py: kept_groups_ref,
route_ref, the launch's n_group / topk_group): DeepSeek-V3's expert groups.

- route_ref and the whole launch against an independent NumPy transcription of transformers'
  ``GlmMoeDsaTopkRouter`` / DeepSeek-V3 router (``hf_route`` below, written line by line from the
  torch code, with torch.topk's unspecified tie order pinned to the lower index) at E = 16 /
  n_group 4 / topk_group 2 / top-3 and E = 256 / 8 / 4 / top-8, on choices drawn from a coarse grid
  (tied choices and tied group scores in most rows), on hand-made near ties (group sums one f32 ulp
  apart, and sums that tie in f32 but not in float64), and through the launch on random routers;
- n_group 1, and topk_group == n_group, give the ungrouped routing bit for bit;
- the masked groups' fill: transformers fills them with 0.0, DeepSeek's reference with -inf; this
  router follows the brief (the kept groups only, i.e. -inf), which differs from transformers only
  when a kept choice below 0 would lose to a masked expert's 0.0; a row showing that difference;
- the launch's refusals of group shapes the kernel does not do.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_moe_util import entries_with_pads, group_words, router_batch, router_group, router_row_alone
from kernel_util import same_bits

from model.kernels import moe
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend


def _topk_idx(x: np.ndarray, k: int) -> np.ndarray:
    """torch.topk(x, k, dim=-1)[1] per row, ties to the lower index (a lexsort, not the twin's sort)."""
    x = np.atleast_2d(x)
    n = x.shape[-1]
    return np.stack([np.lexsort((np.arange(n), -row.astype(np.float64)))[:k] for row in x])


def hf_route(scores, bias, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor, fill=-np.inf):
    """transformers' router after the sigmoid (scores [T, E] f32), line by line in NumPy; ``fill`` is
    what masked_fill writes (transformers: 0.0; DeepSeek's reference and this router: -inf)."""
    scores = np.atleast_2d(np.asarray(scores, np.float32))
    n_routed_experts = scores.shape[-1]
    scores_for_choice = scores.reshape(-1, n_routed_experts) + np.asarray(bias, np.float32)[None]
    # .topk(2, dim=-1)[0].sum(dim=-1): the two largest, summed in f32
    top2 = np.sort(scores_for_choice.reshape(-1, n_group, n_routed_experts // n_group), axis=-1)[..., -2:]
    group_scores = (top2[..., 1] + top2[..., 0]).astype(np.float32)
    group_idx = _topk_idx(group_scores, topk_group)
    group_mask = np.zeros_like(group_scores)
    np.put_along_axis(group_mask, group_idx, 1, axis=1)
    score_mask = np.broadcast_to(
        group_mask[:, :, None], (group_mask.shape[0], n_group, n_routed_experts // n_group)
    ).reshape(-1, n_routed_experts)
    scores_for_choice = np.where(score_mask.astype(bool), scores_for_choice, np.float32(fill))
    topk_indices = _topk_idx(scores_for_choice, top_k)
    topk_weights = np.take_along_axis(scores, topk_indices, axis=1).astype(np.float64)
    if norm_topk_prob:
        denominator = topk_weights.sum(axis=-1, keepdims=True) + 1e-20
        topk_weights = topk_weights / denominator
    topk_weights = topk_weights * routed_scaling_factor
    return topk_indices, topk_weights


def grid_choices(rng, rows: int, E: int, steps: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Scores in (0, 1) and a bias on coarse grids of powers of two (sums exact in f32): many tied
    choices, and tied group scores, in most rows. Returns (scores [rows, E], bias [E])."""
    s = (rng.integers(1, steps, (rows, E)) / np.float32(steps + 8)).astype(np.float32)
    s = (np.round(s * 64) / 64).astype(np.float32)
    bias = (rng.integers(0, 4, E) / np.float32(64)).astype(np.float32)
    return s, bias


SHAPES = [(16, 4, 2, 3), (256, 8, 4, 8)]  # E, n_group, topk_group, top-k


@pytest.mark.parametrize("E,ng,tg,k", SHAPES)
@pytest.mark.parametrize("norm", [True, False])
def test_route_ref_is_the_transformers_router_on_tied_grids(E, ng, tg, k, norm):
    rng = np.random.default_rng(E + ng + int(norm))
    s, bias = grid_choices(rng, 400, E)
    want_i, want_w = hf_route(s, bias, ng, tg, k, norm, 2.5)
    # transformers' 0.0 fill agrees here: every choice is above 0
    assert (hf_route(s, bias, ng, tg, k, norm, 2.5, fill=0.0)[0] == want_i).all()
    differs = border_ties = 0
    for r in range(len(s)):
        ids, wts = moe.route_ref(s[r], bias, k, norm, 2.5, ng, tg)
        assert (ids == want_i[r]).all(), f"row {r}: {ids} != {want_i[r]}"
        # f32 sum and quotient against float64: a few f32 roundings
        np.testing.assert_allclose(wts, want_w[r], rtol=2e-7, atol=0)
        differs += not np.array_equal(ids, moe.route_ref(s[r], bias, k, norm, 2.5)[0])
        gsc = -np.sort(-np.sort((s[r] + bias).reshape(ng, -1), axis=1)[:, -2:].sum(axis=1))
        border_ties += gsc[tg - 1] == gsc[tg]
    # the cases bite: the groups change the routing in many rows, and in over 5% of them the kept
    # groups' last place is a tie (the lower group must win it)
    assert differs > len(s) // 4 and border_ties > len(s) // 20, (differs, border_ties)


def test_group_ties_go_to_the_lower_group_and_use_the_f32_sum():
    """E = 16, four groups of 4, keep 2, top-3. Group 2 is best. Groups 0 and 1 tie in f32 (0.5 +
    2^-26 and 0.5 + 2^-25 both round to 0.5) though group 1 is larger in float64: group 0 is kept.
    Then group 3's sum is raised by one f32 ulp over theirs: group 3 is kept instead."""
    u = np.float32(2.0**-24)
    sel = np.full(16, 2.0**-30, np.float32)  # below every top-2 member
    sel[0:2] = [0.5, 2.0**-26]  # group 0: 0.5 in f32
    sel[4:6] = [2.0**-25, 0.5]  # group 1: 0.5 in f32, larger in float64
    sel[8:10] = [0.4, 0.3]  # group 2: 0.7
    sel[12:14] = [0.25, 0.25 - 0.01]  # group 3: 0.49
    bias = np.zeros(16, np.float32)
    kept = moe.kept_groups_ref(sel, 4, 2)
    assert kept.tolist() == [True, False, True, False]
    ids, _ = moe.route_ref(sel, bias, 3, True, 1.0, 4, 2)
    assert ids.tolist() == [0, 8, 9]
    assert (ids == hf_route(sel, bias, 4, 2, 3, True, 1.0)[0][0]).all()
    # near tie: group 3 one ulp above 0.5
    sel[12:14] = [0.25 + u, 0.25]
    assert moe.kept_groups_ref(sel, 4, 2).tolist() == [False, False, True, True]
    ids, _ = moe.route_ref(sel, bias, 3, True, 1.0, 4, 2)
    assert ids.tolist() == [8, 9, 12]
    assert (ids == hf_route(sel, bias, 4, 2, 3, True, 1.0)[0][0]).all()


def test_tied_choices_go_to_the_lower_expert_inside_the_kept_groups():
    """Every choice equal: groups 0..topk_group-1 are kept, and their first top-k experts chosen;
    the weights are then equal."""
    for E, ng, tg, k in SHAPES:
        s = np.full(E, 0.25, np.float32)
        ids, wts = moe.route_ref(s, np.zeros(E, np.float32), k, True, 2.5, ng, tg)
        assert ids.tolist() == list(range(k))
        np.testing.assert_allclose(wts, 2.5 / k, rtol=1e-6)
        # a tie across a group boundary: the best group's experts, then the next kept group's
        s2 = s.copy()
        gs = E // ng
        s2[gs * (ng - 1) :] = 0.5  # the last group is best
        ids, _ = moe.route_ref(s2, np.zeros(E, np.float32), k, True, 2.5, ng, tg)
        first = list(range(gs * (ng - 1), gs * (ng - 1) + min(k, gs)))
        assert ids.tolist()[: len(first)] == first


def test_masked_groups_are_out_not_zero():
    """A row whose kept groups' choices are negative (bias below -score): this router takes the
    top-k of the kept groups (DeepSeek's -inf fill); transformers' 0.0 fill would take a masked
    expert. The brief's semantics, recorded so the difference is known."""
    E, ng, tg, k = 16, 4, 2, 5
    s = np.full(E, 0.3, np.float32)
    bias = np.full(E, -0.1, np.float32)
    bias[[0, 1, 4, 5]] = 0.5  # groups 0 and 1 kept: sums 1.6
    bias[[2, 3, 6, 7]] = -0.9  # their other experts' choices are -0.6
    ids, _ = moe.route_ref(s, bias, k, True, 1.0, ng, tg)
    assert ids.tolist() == [0, 1, 4, 5, 2]
    assert (ids == hf_route(s, bias, ng, tg, k, True, 1.0)[0][0]).all()
    hf0 = hf_route(s, bias, ng, tg, k, True, 1.0, fill=0.0)[0][0]
    assert ids.tolist() != hf0.tolist() and hf0[4] >= 8  # transformers: a masked expert's 0.0


def tied_border_router(rng, E: int, ng: int, tg: int, H: int):
    """A router [E, H] and bias whose group ng - 1 copies group 1 (bit-equal scores and choices)
    and whose biases put that pair at the border of the kept groups: groups 2..tg lifted by 2.5
    (group scores in (5, 7)), the pair's first expert by 3 (scores in (3, 5)), the other groups'
    scores below 2.1. Group 1 must be kept and its copy must not (the lower group wins the tie);
    group 1's first expert (choice in (3, 4)) is then often among the top-k."""
    gs = E // ng
    w = (rng.standard_normal((E, H)) / 4).astype(BF16)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    for g in range(2, tg + 1):
        bias[g * gs : (g + 1) * gs] += np.float32(2.5)
    bias[gs] += np.float32(3.0)
    w[(ng - 1) * gs :] = w[gs : 2 * gs]
    bias[(ng - 1) * gs :] = bias[gs : 2 * gs]
    return w, bias


@pytest.mark.parametrize("E,ng,tg,k", SHAPES)
@pytest.mark.parametrize("tied", [False, True])
def test_the_launch_routes_by_groups(E, ng, tg, k, tied):
    """Through router_group_batch on the host: ids the transformers router of the launch's own
    scores, weights within f32 rounding of its float64 weights; rows are their own launches, bit
    for bit; the group workspace the grouping of those ids. ``tied``: tied_border_router."""
    gpu = HostBackend()
    rng = np.random.default_rng(E * 3 + k + int(tied))
    H = 40
    if tied:
        w, bias = tied_border_router(rng, E, ng, tg, H)
    else:
        w = (rng.standard_normal((E, H)) / 4).astype(BF16)
        bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    ent, rows = entries_with_pads(rng, 40, 6)
    m = len(ent)
    y = rng.standard_normal((m, H)).astype(BF16)
    groups = dict(n_group=ng, topk_group=tg)
    s, i, wt, ctr, g = router_group(gpu, w, y, bias, ent, E, H, k, True, 2.5, True, 0, E, **groups)
    assert (ctr[: moe.router_counter_words(m, grouped=True)] == 0).all()
    want_i, want_w = hf_route(s[rows], bias, ng, tg, k, True, 2.5)
    assert (i[rows, :k] == want_i).all() and (i[rows, k] == 0).all() and (wt[rows, k] == 1.0).all()
    # f32 sum and quotient against float64: a few f32 roundings
    np.testing.assert_allclose(wt[rows, :k], want_w, rtol=2e-7, atol=0)
    gs = E // ng
    if tied:
        chosen = i[rows, :k] // gs
        assert (chosen != ng - 1).all() and (chosen == 1).any(), "the tie at the border went wrong"
    else:
        ungrouped = router_batch(gpu, w, y, bias, ent, E, H, k, True, 2.5, True)[1]
        assert (ungrouped[rows] != i[rows]).any(axis=1).sum() > len(rows) // 4, "the groups never bit"
    for e in rows[:6]:
        _, i1, w1 = router_row_alone(gpu, w, y[e], bias, E, H, k, True, 2.5, True, **groups)
        same_bits(i[e], i1, f"ids row {e}")
        same_bits(wt[e], w1, f"weights row {e}")
    assert (g == group_words(i, ent, k, k + 1, 0, E).view(np.uint32)).all()


@pytest.mark.parametrize("E,ng", [(288, 1), (256, 8), (16, 4)])
def test_without_group_limits_the_routing_is_unchanged(E, ng):
    """n_group 1 and topk_group == n_group route over all experts: the same bits as the launch
    without the arguments."""
    gpu = HostBackend()
    rng = np.random.default_rng(E)
    H, k = 48, min(8, E // 2)
    w = (rng.standard_normal((E, H)) / 4).astype(BF16)
    bias = (0.05 * rng.standard_normal(E)).astype(np.float32)
    ent = pack_entries(list(range(5)), list(range(5)), [0] * 5)
    y = rng.standard_normal((5, H)).astype(BF16)
    base = router_group(gpu, w, y, bias, ent, E, H, k, True, 2.5, True, 0, E)
    got = router_group(gpu, w, y, bias, ent, E, H, k, True, 2.5, True, 0, E, n_group=ng, topk_group=ng)
    for a, b, what in zip(base, got, ("scores", "ids", "weights", "counter", "group"), strict=True):
        same_bits(a, b, what)
    for r in range(5):
        same_bits(moe.route_ref(base[0][r], bias, k, True, 2.5, ng, ng)[0], base[1][r, :k], f"row {r}")


def _args(z, **over):
    args = dict(
        w=z, y=z, bias=z, scores=z, ids=z, weights=z, counter=z, entries=z, group=z, m=1, n_experts=256,
        h=8, topk=8, norm=True, scale=1.0, shared=True, expert_base=0, n_local=256, n_group=8, topk_group=4,
    )  # fmt: skip
    return {**args, **over}


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(n_experts=250, n_local=250), r"250 experts do not split into n_group 8"),
        (dict(n_experts=16, n_local=16, n_group=16, topk=2), r"groups of 1 expert\(s\) \(16 / n_group 16\)"),
        (dict(topk_group=0), r"topk_group 0 outside 1..n_group 8"),
        (dict(topk_group=9), r"topk_group 9 outside 1..n_group 8"),
        (dict(n_group=1, topk_group=2), r"topk_group 2 outside 1..n_group 1"),
        (dict(topk_group=1, topk=33), r"top-33 exceeds the 1 kept groups' 32 experts"),
        (
            dict(n_experts=128, n_local=128, n_group=64, topk_group=8),
            r"n_group 64 outside the kernel's 1..32",
        ),
        (dict(n_group=0, topk_group=0), r"n_group 0 outside"),
    ],
)
def test_the_launch_refuses_group_shapes_the_kernel_does_not_do(over, match):
    gpu = HostBackend()
    z = gpu.alloc(64)
    with pytest.raises(ValueError, match=match):
        moe.router_group_batch(gpu, **_args(z, **over))


def test_the_launch_takes_the_largest_group_shapes():
    """32 groups of 2 (and of 32), topk at the kept groups' size: accepted, so the refusals above
    are the bounds and not a blanket no."""
    gpu = HostBackend()
    rng = np.random.default_rng(5)
    for E, ng, tg, k in [(64, 32, 4, 8), (1024, 32, 1, 32)]:
        H = 16
        w = (rng.standard_normal((E, H)) / 4).astype(BF16)
        bias = np.zeros(E, np.float32)
        ent = pack_entries([0], [0], [0])
        y = rng.standard_normal((1, H)).astype(BF16)
        s, i, _, _ = router_batch(gpu, w, y, bias, ent, E, H, k, True, 1.0, False, n_group=ng, topk_group=tg)
        assert (i[0] == hf_route(s, bias, ng, tg, k, True, 1.0)[0][0]).all()
