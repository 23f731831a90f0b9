"""bench/torch_step.py's batched step (BatchDraftStep) on the CPU at a tiny config: each sequence's
drafts, last hidden and cache rows equal what the batch-1 step (DraftStep) gives for that sequence
alone, on the same weights and the same caches. Skipped where PyTorch (with torch._grouped_mm) is
missing; the GPU timing runs the same code at GLM-5.3-Flash shapes."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this PyTorch has no torch._grouped_mm", allow_module_level=True)

from bench.torch_step import BatchDraftStep, DraftStep  # noqa: E402 - after the skip
from model.config import tiny  # noqa: E402 - after the skip

ROWS = 48


def _cfg(share: bool):
    base = tiny(index_topk=8, index_kpool=2, max_context=64)
    return dataclasses.replace(base, dsa=dataclasses.replace(base.dsa, share_for_mtp_iteration=share))


def _steps(cfg, batch: int, seed: int = 3):
    # float32: torch._grouped_mm has no float64 kernel; ties in the argmaxes are then negligible.
    base = DraftStep(cfg, rows=ROWS, device="cpu", dtype=torch.float32, seed=seed)
    # Norm weights and biases away from their 1 / 0 defaults, so a mixed-up one shows.
    g = torch.Generator().manual_seed(seed + 1)
    for name in ("enorm", "hnorm", "in_norm", "post_norm", "head_norm", "q_a_norm", "kv_a_norm", "ix_ln_w"):
        base.W[name].mul_(1 + 0.2 * torch.randn(base.W[name].shape, generator=g))
    for name in ("ix_ln_b", "ix_ape", "router_bias"):
        base.W[name].add_(0.1 * torch.randn(base.W[name].shape, generator=g))
    return base, BatchDraftStep(base, batch, ROWS, seed=seed + 2)


def _alone(cfg, base, bs, b, ctx, k):
    """Sequence b of the batch drafted alone by the batch-1 step (its caches copied over)."""
    one = DraftStep(cfg, rows=ROWS, device="cpu", dtype=torch.float32, weights=base.W)
    one.latents.copy_(bs.latents[b])
    one.keys.copy_(bs.keys[b])
    one.gates.copy_(bs.gates[b])
    one.pool_keys.copy_(bs.pool_keys[b, : one.pool_keys.shape[0]])
    one.tok_in[0] = bs.tok_in[b]
    one.hid_in.copy_(bs.hid_in[b])
    drafts = one.propose(ctx, k).tolist()
    return one, drafts


@pytest.mark.parametrize("share", [False, True])
def test_batched_drafts_are_each_sequences_batch1_drafts(share):
    # Contexts mixing every branch of the selection: no complete pool yet (0), every row while at
    # most top-k pools (3, 8: draft 2 crosses to the indexer), indexed (9, 21, 30), pools completing
    # on some drafts and not others; a duplicate context with different contents.
    contexts = [3, 21, 8, 0, 30, 9, 21]
    k = 3
    cfg = _cfg(share)
    base, bs = _steps(cfg, len(contexts))
    g = torch.Generator().manual_seed(9)
    bs.tok_in.copy_(torch.randint(0, cfg.vocab_size, (len(contexts),), generator=g))
    alone = [_alone(cfg, base, bs, b, c, k) for b, c in enumerate(contexts)]
    with torch.no_grad():
        got = bs.propose(contexts, k).tolist()
    want = [d for _, d in alone]
    assert got == want
    # The drafts are not all alike: the check would pass on a step that ignores its inputs otherwise.
    assert len({tuple(d) for d in got}) > 2
    for b, (one, _) in enumerate(alone):
        tol = dict(rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(bs.last_hidden[b], one.last_hidden, **tol)
        # The rows the propose wrote, and the pools it completed, as the batch-1 step wrote them.
        torch.testing.assert_close(bs.latents[b], one.latents, **tol)
        torch.testing.assert_close(bs.keys[b], one.keys, **tol)
        torch.testing.assert_close(bs.gates[b], one.gates, **tol)
        torch.testing.assert_close(bs.pool_keys[b, : one.pool_keys.shape[0]], one.pool_keys, **tol)


def test_batched_step_records_the_experts_it_chose():
    cfg = _cfg(True)
    base, bs = _steps(cfg, 4)
    with torch.no_grad():
        bs.propose([5, 17, 30, 11], 2)
    ids = bs.expert_ids[:2]
    m = cfg.moe
    assert ids.shape == (2, 4, m.num_experts_per_tok)
    assert bool(((ids >= 0) & (ids < m.n_routed_experts)).all())
    # Each row's top-k experts are distinct, so a draft chose at least top_k of them.
    assert all(len(set(r)) == m.num_experts_per_tok for r in ids.reshape(-1, m.num_experts_per_tok).tolist())
    assert bs.distinct_experts(2) == [len(set(ids[i].reshape(-1).tolist())) for i in range(2)]


def test_batched_step_refuses_contexts_past_its_caches():
    cfg = _cfg(False)
    _, bs = _steps(cfg, 2)
    with pytest.raises(ValueError, match="outrun"):
        bs.propose([3, ROWS - 2], 3)
    with pytest.raises(ValueError, match="contexts for a batch"):
        bs.propose([3], 1)
