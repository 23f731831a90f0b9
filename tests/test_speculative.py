"""Greedy speculative decoding is lossless: its output is the target's own greedy output."""

from __future__ import annotations

import numpy as np
import pytest

from model.checkpoint import Checkpoint, mtp_tensors, random_checkpoint, target_tensors
from model.cli import DEFAULT_CHECKPOINT
from model.config import tiny
from model.proposer import MtpProposer, ProposerError, ProposerOptions
from model.speculative import SpecStats, greedy_decode, speculative_decode
from model.target import TargetError, TargetModel
from runtime.host_backend import HostBackend


def build(path, served):
    gpu = HostBackend()
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    target = TargetModel(gpu, cfg, target_tensors(ckpt, cfg), served)
    drafter = MtpProposer(
        gpu,
        cfg,
        mtp_tensors(ckpt, cfg),
        ProposerOptions(served_max_seq_len=served, max_draft_tokens=4, max_sequences=1),
        tables=target.tables,
    )
    return gpu, cfg, target, drafter


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory):
    cfg = tiny(index_topk=8, index_kpool=2, max_context=160, num_hidden_layers=2)
    return random_checkpoint(tmp_path_factory.mktemp("rand"), cfg, seed=5, progress=False)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_random_checkpoint_is_lossless(random_ckpt, k):
    gpu, cfg, target, drafter = build(random_ckpt, 160)
    prompt = list(np.random.default_rng(k).integers(0, cfg.vocab_size, 9))
    n_new = 60  # 9 + 60 rows: 34 pools of 2, well past the 4-pool top-k
    ref = greedy_decode(target, prompt, n_new)
    for refeed in (False, True):
        out, stats = speculative_decode(target, drafter, prompt, n_new, k, refeed_target_hidden=refeed)
        assert out == ref
        assert stats.steps > 0 and 0 <= stats.mean_accepted <= k
    drafter.close()
    target.close()
    assert gpu.stats().live_bytes == 0


@pytest.mark.parametrize("k", [1, 3, 4])
def test_shipped_checkpoint_is_lossless_and_accepts(k):
    gpu, cfg, target, drafter = build(DEFAULT_CHECKPOINT, 256)
    prompt = list(b"import os\n\ndef main(argv):\n    for name in argv:\n        print(")
    n_new = 90  # 57 + 90 rows: past the 64-token top-k of 4-token pools
    ref = greedy_decode(target, prompt, n_new)
    out, stats = speculative_decode(target, drafter, prompt, n_new, k)
    assert out == ref
    # A trained drafter predicts: far above the 1/256 a random guess gets.
    assert stats.acceptance[0] > 0.3, stats.summary()
    drafter.close()
    target.close()


def test_stats_count_positions():
    s = SpecStats(3)
    for a in (0, 1, 3, 2):
        s.record(3, a)
    assert s.reached == [4, 3, 2] and s.accepted_at == [3, 2, 1]
    assert s.acceptance == [0.75, 2 / 3, 0.5]
    assert s.mean_accepted == 1.5


def test_bad_input_to_the_target_is_a_target_error_and_changes_nothing(random_ckpt):
    """The target has its own error type: an engine catching ProposerError must not take the
    target's refusals for the drafter's."""
    gpu, cfg, target, drafter = build(random_ckpt, 160)
    st = target.alloc_state()
    target.forward(st, [1, 2, 3], 0)
    for bad, msg in [
        (lambda: target.forward(st, [], 3), "no tokens"),
        (lambda: target.forward(st, [cfg.vocab_size], 3), "outside the vocabulary"),
        (lambda: target.forward(st, [1], 2), "must append at 3"),
        (lambda: target.forward(st, [1] * 200, 3), "exceed"),
        (lambda: target.rewind_to(st, 4), "outside 0..3"),
        (lambda: target.alloc_state(), "one sequence at a time"),
    ]:
        with pytest.raises(TargetError, match=msg) as e:
            bad()
        assert not isinstance(e.value, ProposerError)
        assert st.length == 3
    with pytest.raises(TargetError, match="one rank"):
        TargetModel(gpu, cfg.with_parallel(0, 2), target_tensors(Checkpoint(random_ckpt), cfg), 160)
    target.free_state(st)
    drafter.close()
    target.close()
    assert gpu.stats().live_bytes == 0


def test_refeed_rewinds_the_drafter_through_its_own_rewind_to():
    """speculative_decode trims the drafter's rows through MtpProposer.rewind_to (which keeps the
    proposer's bookkeeping), never by moving the DSA state's row count behind its back."""
    gpu, cfg, target, drafter = build(DEFAULT_CHECKPOINT, 256)
    drafter.close()
    calls = []

    class Spy(MtpProposer):
        def rewind_to(self, st, n):
            calls.append(n)
            super().rewind_to(st, n)

    spy = Spy(
        gpu,
        cfg,
        mtp_tensors(Checkpoint(DEFAULT_CHECKPOINT), cfg),
        ProposerOptions(served_max_seq_len=256, max_draft_tokens=4, max_sequences=1),
        tables=target.tables,
    )
    prompt = list(b"import os\n\ndef main(argv):\n")
    out, stats = speculative_decode(target, spy, prompt, 30, 3, refeed_target_hidden=True)
    assert out == greedy_decode(target, prompt, 30)
    assert stats.accepted_total > 0 and len(calls) > 0
    spy.close()
    target.close()
    assert gpu.stats().live_bytes == 0
