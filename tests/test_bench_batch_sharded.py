"""bench/bench_batch_sharded.py on the host: a rank's share of the floor against a hand count at a
tiny config, the all-reduced bytes, and the whole benchmark end to end at tiny shapes: on two
ranks (threads with host backends and host communicators, through ``run_rank``, as the launcher's
processes run it on GPUs) and on one through ``main``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import bench_batch as bb
from bench import bench_batch_sharded as bbs
from model.proposer import MtpProposer, ProposerOptions
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import bf16_weights
from tests.sharded_util import run_ranks

CFG = bbs.bench_config("tiny")  # tiny(): H 64, 4 heads, 8 experts top-2 (+1 shared), V 96

# By hand (bytes), as tests/test_bench_batch.py counts one rank. Replicated: eh_proj 64*128*2,
# fused_in 120 rows x 64 x 2, the indexer's rows of q_fused (2*16) x 48 x 2, the router 8*64*2. Per
# rank of two: its heads' rows of q_fused (2*16) x 48 x 2, wk_t 2*32*16*2, wv 2*16*32*2, o_proj's 2
# of 4 groups 64*32*2; the shared expert 3*24*64*2 on rank 0; one expert 3*24*64*2; the FP8 head's
# 48 rows 48*64 + 48 f32 scales.
REPLICATED = 16384 + 15360 + 3072 + 1024
PER_RANK = 3072 + 2048 + 2048 + 4096
SHARED, EXPERT, HEAD_SHARD = 9216, 9216, 48 * 64 + 48 * 4


def _args(*extra: str):
    return bbs.parse_args(
        [
            "--model",
            "tiny",
            "--backend",
            "host",
            "--batches",
            "1,3",
            "--context",
            "24",
            "--iters",
            "2",
            "--proposes",
            "40",
            "--history-sequences",
            "6",
            "--bandwidth",
            "1e9",
            "--timeout",
            "60",
            "--single-timeout",
            "30",
            *extra,
        ]
    )


def _opts() -> ProposerOptions:
    return ProposerOptions(served_max_seq_len=64, max_sequences=4, o_proj_groups=8, tensor_core_head=False)


def test_rank_floor_bytes_by_hand():
    w = bf16_weights(CFG, 1)

    def body(r, gpu, comm):
        prop = MtpProposer(gpu, CFG.with_parallel(r, 2), w, _opts(), comm=comm)
        try:
            fb = bbs.rank_floor_bytes(prop, [5, 20], 2, [3, 1], True)
            return fb, bbs.allreduce_bytes(prop, 4, 2), prop.sharding.groups
        finally:
            prop.close()

    res, errs = run_ranks(2, body)
    assert errs == [None, None], errs
    one = MtpProposer(HostBackend(), CFG, w, _opts())
    try:
        whole = bb.batch_floor_bytes(one, [5, 20], 2, [4, 4], True)
        assert bbs.rank_floor_bytes(one, [5, 20], 2, [4, 4], True) == whole  # one rank: the floor itself
        assert bbs.allreduce_bytes(one, 4, 2) == 0
    finally:
        one.close()
    for r, (fb, ar, groups) in enumerate(res):
        assert groups == 4
        assert fb["block"] == 2 * (REPLICATED + PER_RANK + (SHARED if r == 0 else 0)), r
        assert fb["experts"] == (3 + 1) * EXPERT and fb["head"] == 2 * HEAD_SHARD
        # Every rank attends every head's selection of the same latent rows: its cache traffic is
        # the whole drafter's.
        assert fb["cache_reads"] == whole["cache_reads"] and fb["cache_writes"] == whole["cache_writes"]
        assert fb["total"] == sum(v for key, v in fb.items() if key != "total")
        # Per draft, 4 rows: o_proj's 4 groups and the 3 MoE slots of f32 rows, 4 packed u64 keys.
        assert ar == 2 * (4 * 4 * 64 * 4 + 4 * 3 * 64 * 4 + 4 * 8)
    # The two shares hold the whole drafter's weights once, with the replicated ones on each.
    both = res[0][0]["block"] + res[1][0]["block"]
    assert both == whole["block"] + 2 * REPLICATED


def test_two_ranks_end_to_end_on_host_communicators():
    args = _args()
    logs: list[str] = []

    def log(*a, **kw):
        logs.append(" ".join(map(str, a)))

    res, errs = run_ranks(2, lambda r, g, c: bbs.run_rank(args, r, 2, g, c, log=log), timeout_s=60.0)
    assert errs == [None, None], errs
    out = res[0]
    hist = out["history"]
    assert hist["proposes"] == 40 and hist["ranks_agree"] and hist["equals_one_gpu"], hist
    assert len(set(hist["digests"])) == 1 and hist["digests"][0] == hist["one_gpu_digest"]
    assert max(hist["batch_sizes"]) > 3 and hist["rewound"] > 0 and hist["catchups"] > 0
    assert out["head_sharded"] and set(out["single"]) == {"cuda-core", "tensor-core"}
    assert [s["B"] for s in out["summary"]] == [1, 3]
    for i, s in enumerate(out["summary"]):
        assert len(s["ranks_device_ms"]) == 2 and all(t > 0 for t in s["ranks_device_ms"])
        assert s["ranks_ms"] == max(s["ranks_device_ms"])
        assert s["speedup_vs_best_one_gpu"] == pytest.approx(
            min(s["one_gpu_cuda-core_ms"], s["one_gpu_tensor-core_ms"]) / s["ranks_ms"]
        )
        # Same inputs everywhere, so the same routing: the ranks' distinct experts partition the
        # one GPU's, draft by draft.
        per_rank = np.array(s["distinct_experts_by_rank"])
        one = out["single"]["cuda-core"][i]["distinct_experts"]
        np.testing.assert_array_equal(per_rank.sum(axis=0), one)
        # Each rank's share is less than the whole drafter's floor; rank 0 (the shared expert's
        # owner) reports its own share in its rows.
        assert 0 < s["rank_floor_ms"] < s["one_gpu_cuda-core_floor_ms"]
        assert out["rank0"]["rows"][i]["floor_ms"] == pytest.approx(out["ranks"][0][i]["floor_ms"])
        assert s["allreduce_MB"] > 0
    assert res[1]["rank"] == 1 and [r["B"] for r in res[1]["rows"]] == [1, 3]
    text = bbs.table(out)
    assert "| 3 |" in text and "equal on all 2 ranks: yes" in text and "equal to one GPU: yes" in text
    assert any("2 rank(s): the drafts history" in line for line in logs)


def test_one_rank_through_main(tmp_path, capsys):
    path = tmp_path / "w1.json"
    code = bbs.main(
        [
            "--model",
            "tiny",
            "--backend",
            "host",
            "--batches",
            "2",
            "--context",
            "16",
            "--iters",
            "1",
            "--proposes",
            "12",
            "--history-sequences",
            "3",
            "--bandwidth",
            "1e9",
            "--single-heads",
            "cuda-core",
            "--json",
            str(path),
        ]
    )
    assert code == 0
    res = json.loads(path.read_text())
    assert res["world_size"] == 1 and not res["head_sharded"]
    assert res["history"]["equals_one_gpu"] and res["history"]["proposes"] == 12
    assert res["summary"][0]["allreduce_MB"] == 0 and "speedup_vs_cuda-core" in res["summary"][0]
    assert "equal to one GPU: yes" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bbs.parse_args(["--single-heads", "fast"])
    with pytest.raises(SystemExit):
        bbs.parse_args(["--batches", "1,512"])
    with pytest.raises(ValueError, match="divide"):
        bbs.run_rank(_args(), 0, 3, HostBackend(), None)  # 8 experts
