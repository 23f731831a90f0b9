"""Batched drafting on 2 and 4 ranks over a long engine history: 300 ``propose_batch`` calls of
mixed batch sizes and slot subsets, random acceptance, catch-ups, frees and slot reuse, replayed
in lockstep by every rank (threads with host backends and a host communicator group) and by one
unsharded proposer built from the same weights.

Checked, bit for bit: every rank's drafts equal the unsharded proposer's; every rank's cache bytes
(latent rows and scales, indexer keys and gates, pool keys and scales: all computed from the
replicated projections, so defined on every rank) equal the unsharded proposer's at checkpoints;
and each rank's shard of the head's logits equals the unsharded head's columns of that shard (the
part of the head a rank holds, compared where it is defined: the live rows)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from model.config import tiny
from model.proposer import MtpProposer, ProposerOptions
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import bf16_weights
from tests.sharded_util import Record, drive_history, run_ranks

# V 96 divides by 2 and 4, so the head is vocabulary-sharded and exchanged; 8 experts and 4 heads
# (4 o_proj groups) split over 2 and 4 ranks.
CFG = tiny(vocab_size=96, index_topk=8, index_kpool=2, max_context=64)
WEIGHTS = bf16_weights(CFG, seed=21)
SEED = 2121
PROPOSES = 300


def options(graphs: bool) -> ProposerOptions:
    return ProposerOptions(
        served_max_seq_len=CFG.dsa.max_context,
        max_draft_tokens=3,
        max_sequences=6,
        o_proj_groups=4,
        use_graphs=graphs,
        batch_buckets=(1, 2, 4, 8),  # batches of 3, 5, 6 run padded
        context_chunk=5,  # catch-ups of several sequences span chunks
        # The sharded head is the CUDA-core FP8 GEMV; the unsharded reference drafts with the same
        # arithmetic (the tensor-core head's bits differ on the GPU).
        tensor_core_head=False,
    )


def history(rank_world: tuple[int, int], gpu, comm, graphs: bool) -> Record:
    prop = MtpProposer(gpu, CFG.with_parallel(*rank_world), WEIGHTS, options(graphs), comm=comm)
    try:
        assert prop.head_sharded == (rank_world[1] > 1)
        return drive_history(prop, gpu, SEED, PROPOSES)
    finally:
        prop.close()


@pytest.fixture(scope="module")
def reference() -> Record:
    """The unsharded proposer, eager launches (the ranks replay bucket graphs)."""
    return history((0, 1), HostBackend(), None, graphs=False)


def test_the_history_is_a_mix(reference: Record):
    """The history covers what it claims: 300 batched proposes of every batch size, rewinds,
    catch-ups, frees and slot reuse."""
    r = reference
    assert len(r.drafts) == PROPOSES
    assert set(r.sizes) == {1, 2, 3, 4, 5, 6}, r.sizes
    assert {k for _, _, k in r.batches} == {1, 2, 3}
    # More sequences than slots: freed slots were reused.
    assert r.rewound > 10 and r.catchups > 100 and r.frees > 10 and r.allocs > 6
    assert len(r.caches) > 50
    # Not degenerate: the drafts vary.
    assert len({int(t) for d in r.drafts for t in d.reshape(-1)}) > 30


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_drafts_and_holds_what_one_rank_does(world: int, reference: Record):
    t0 = time.perf_counter()
    recs, errs = run_ranks(world, lambda r, g, c: history((r, world), g, c, graphs=True), timeout_s=60.0)
    assert errs == [None] * world, errs
    n = CFG.vocab_size // world
    for r, rec in enumerate(recs):
        assert rec.batches == reference.batches, f"rank {r} made different calls"
        for i, (got, want) in enumerate(zip(rec.drafts, reference.drafts)):
            np.testing.assert_array_equal(got, want, err_msg=f"world {world} rank {r} propose {i}")
        assert len(rec.drafts) == PROPOSES
        assert rec.caches == reference.caches, f"world {world} rank {r}: cache bytes differ"
        for i, (got, want) in enumerate(zip(rec.logits, reference.logits)):
            np.testing.assert_array_equal(
                got, want[:, r * n : (r + 1) * n], err_msg=f"world {world} rank {r} logits of propose {i}"
            )
    print(f"world {world}: {time.perf_counter() - t0:.1f} s")
