"""Batched drafting on the GPU: a batch drafts bit for bit what each of its sequences drafts alone
(eager, one sequence at a time) at awkward batch sizes with ragged contexts, through padded bucket
graphs and eagerly; slot reuse under bucket graphs a thousand times with the live allocations and
graphs back at their baseline; and a PyTorch tensor and stream as the target's hidden rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from model.config import AttentionConfig, tiny, tiny_rope
from tests.proposer_fixtures import (
    assert_same_caches,
    bf16_weights,
    cache_snapshot,
    make_proposer,
    upload_rows,
)

pytestmark = pytest.mark.gpu

CFG = tiny(index_topk=8, index_kpool=2, max_context=256, share_for_mtp_iteration=True)
W = bf16_weights(CFG, 21)
H = CFG.hidden_size
K = 3


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    gpu.close()


def _world(seed: int, n: int, cfg=CFG):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, n + 2), rng.standard_normal((n + 2, cfg.hidden_size)).astype(
        np.float32
    )


# Every projection of the block in the tensor-core form (every k a multiple of 64).
CFG_TC = dataclasses.replace(CFG, attention=AttentionConfig(2, 64, 64, 64, 0, 64))
W_TC = bf16_weights(CFG_TC, 22)
# The RoPE family (issue 20): MLA with a rope part, the per-token indexer, GLM-5's interleaved
# layouts or DeepSeek-V3.2's YaRN, half-split indexer and group-limited routing; index_topk 8 so
# most rows select sparsely.
FAMILY = {
    fam: (cfg, bf16_weights(cfg, 23))
    for fam in ("glm_moe_dsa", "deepseek_v32")
    for cfg in [tiny_rope(family=fam, max_context=256)]
}
# Every projection on tensor cores with a rope part (and the split attention's rope term).
FAMILY["rope-tensor-core-shapes"] = (
    c := dataclasses.replace(
        FAMILY["glm_moe_dsa"][0],
        attention=AttentionConfig(2, 64, 64, 64, 16, 64, FAMILY["glm_moe_dsa"][0].attention.rope),
    ),
    bf16_weights(c, 24),
)


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize(
    "head,shapes",
    [(None, "tiny"), (False, "tiny"), (None, "tensor-core-shapes"), *((None, f) for f in FAMILY)],
    ids=["auto-head", "cuda-core-head", "tensor-core-projections", *FAMILY],
)
def test_batches_draft_what_each_sequence_drafts_alone(cuda, graphs, head, shapes):
    n_seq = 200
    cfg, w = {"tensor-core-shapes": (CFG_TC, W_TC), "tiny": (CFG, W), **FAMILY}[shapes]
    mk = dict(gpu=cuda, max_sequences=n_seq, max_draft_tokens=K, tensor_core_head=head)
    batched = make_proposer(cfg, w, use_graphs=graphs, **mk)
    alone = make_proposer(cfg, w, use_graphs=False, **mk)
    assert batched.tensor_core_head == alone.tensor_core_head
    if shapes.endswith("tensor-core-shapes"):
        lay = batched.layer
        assert (lay.tc_fused, lay.tc_q, lay.tc_wk, lay.tc_wv, lay.tc_o) == (True,) * 5
    rng = np.random.default_rng(5)
    ctx = [int(c) for c in rng.integers(3, 200, n_seq)]  # ragged, pools complete and not
    worlds = [_world(100 + i, ctx[i] + K, cfg) for i in range(n_seq)]
    a = [batched.alloc_state() for _ in range(n_seq)]
    b = [alone.alloc_state() for _ in range(n_seq)]
    ptrs = [upload_rows(cuda, worlds[i][1][: ctx[i]]) for i in range(n_seq)]
    try:
        toks = [worlds[i][0][: ctx[i] + 1] for i in range(n_seq)]
        batched.catchup_batch(a, toks, ptrs, [0] * n_seq)
        for i in range(n_seq):
            alone.catchup_drafter(b[i], toks[i], ptrs[i], 0)
        for B in (1, 3, 17, 64, 200):
            pick = [int(i) for i in rng.permutation(n_seq)[:B]]
            pos = [ctx[i] - int(rng.integers(0, 2)) for i in pick]  # some one row back: a rewind
            last = [int(worlds[i][0][p + 1]) for i, p in zip(pick, pos)]
            hid = upload_rows(cuda, np.stack([worlds[i][1][p] for i, p in zip(pick, pos)]))
            got = batched.propose_batch([a[i] for i in pick], last, hid, pos, K)
            for j, i in enumerate(pick):
                one = upload_rows(cuda, worlds[i][1][pos[j] : pos[j] + 1])
                want = alone.propose(b[i], last[j], one, pos[j], K)
                cuda.free(one)
                assert list(got[j]) == want, f"B={B}: sequence {i} drafted differently in the batch"
                assert_same_caches(cache_snapshot(batched, a[i]), cache_snapshot(alone, b[i]))
            cuda.free(hid)
            acc = [int(rng.integers(0, K + 1)) for _ in pick]
            batched.after_verify_batch([a[i] for i in pick], acc)
            for i, x in zip(pick, acc):
                alone.after_verify(b[i], x)
        if graphs:
            assert sorted(m for m, _ in batched.captured_graphs) == [1, 4, 32, 64, 256]
    finally:
        for p in ptrs:
            cuda.free(p)
        batched.close()
        alone.close()


def test_slot_reuse_under_bucket_graphs_a_thousand_times(cuda):
    prop = make_proposer(CFG, W, gpu=cuda, max_sequences=3, max_draft_tokens=K, use_graphs=True)
    keep = prop.alloc_state()
    toks, hid = _world(1, 40)
    p = upload_rows(cuda, hid)
    try:
        prop.catchup_drafter(keep, toks[:21], p, 0)
        prop.propose(keep, int(toks[21]), p.offset(20 * H * 2), 20, K)  # captures bucket 1
        st = prop.alloc_state()
        prop.catchup_drafter(st, toks[:6], p, 0)
        prop.propose_batch([st, keep], [int(toks[6]), int(toks[21])], p, [5, 20], K)  # and bucket 2
        prop.free_state(st)
        allocs, graphs = cuda.stats().live_allocations, len(cuda.live_graphs())
        for cycle in range(1000):
            st = prop.alloc_state()
            n = 5 + cycle % 30
            prop.catchup_drafter(st, toks[: n + 1], p, 0)
            got = prop.propose_batch([st, keep], [int(toks[n + 1]), int(toks[21])], p, [n, 20], K)
            assert got.shape == (2, K) and (got >= 0).all() and (got < CFG.vocab_size).all()
            prop.free_state(st)
            assert cuda.stats().live_allocations == allocs and len(cuda.live_graphs()) == graphs
    finally:
        cuda.free(p)
        prop.close()


def test_a_pytorch_tensor_and_stream_feed_the_batch(cuda):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    prop = make_proposer(CFG, W, gpu=cuda, max_sequences=2, max_draft_tokens=K, use_graphs=True)
    toks, hid = _world(3, 40)
    p = upload_rows(cuda, hid)
    try:
        sts = [prop.alloc_state(), prop.alloc_state()]
        prop.catchup_batch(sts, [toks[:21], toks[:11]], [p, p], [0, 0])
        rows = np.stack([hid[20], hid[10]])
        own = upload_rows(cuda, rows)
        want = prop.propose_batch(sts, [int(toks[21]), int(toks[11])], own, [20, 10], K)
        cuda.free(own)
        t = torch.tensor(rows, dtype=torch.float32, device="cuda").to(torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = prop.propose_batch(sts, [int(toks[21]), int(toks[11])], t, [20, 10], K, stream=stream)
        np.testing.assert_array_equal(got, want)
        with pytest.raises(Exception, match="shape"):
            prop.propose_batch(sts, [1, 2], t[:1], [20, 10], K)
    finally:
        cuda.free(p)
        prop.close()
