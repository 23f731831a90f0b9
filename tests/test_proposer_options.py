"""Proposer options and load-time errors on the host backend."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from model.config import tiny
from model.proposer import MtpProposer
from model.weights import SharedTables, WeightError
from runtime.backend import NULL_KERNEL
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import (
    assert_same_caches,
    bf16_weights,
    cache_snapshot,
    make_proposer,
    upload_rows,
)

CFG = tiny(index_topk=8, index_kpool=2, max_context=64)
W = bf16_weights(CFG, 11)


def _history(prop, gpu, rows=13, k=3):
    rng = np.random.default_rng(4)
    tok = rng.integers(0, CFG.vocab_size, rows + 2)
    hid = rng.standard_normal((rows + 1, CFG.hidden_size))
    st = prop.alloc_state()
    p = upload_rows(gpu, hid[:rows])
    prop.prefill_drafter(st, tok[: rows + 1], p)
    h = upload_rows(gpu, hid[rows:])
    drafts = prop.propose(st, int(tok[rows + 1]), h, rows, k)
    gpu.free(p)
    gpu.free(h)
    return st, drafts


class FullBlockContextRows(MtpProposer):
    """Diagnostic: context rows through the full block (attention and MoE included), to tell a
    wrong cache-only shortcut from wrong attention over real context."""

    def _context_rows(self, n, s):
        # Full rows over the chunk's entries in one launch (the chunk fits the batch scratch: the
        # test sizes context_chunk to the largest bucket).
        self.layer.full_rows(self.ctx.x, self.scratch, self.pools, self.ctx.entries, n, 0, s)


def test_diagnostic_full_context_rows_build_the_same_caches():
    """Cache rows are pure functions of a row's input, so the shortcut that skips attention and
    MoE for context rows must write exactly what the full block writes."""
    gpu = HostBackend()
    a = make_proposer(CFG, W, gpu=gpu)
    b = make_proposer(CFG, W, gpu=gpu, cls=FullBlockContextRows, context_chunk=4)
    sa, da = _history(a, gpu)
    sb, db = _history(b, gpu)
    assert da == db
    assert_same_caches(cache_snapshot(a, sa), cache_snapshot(b, sb))


class Without(HostBackend):
    """A backend whose PTX lacks the given kernels (a variant build)."""

    def __init__(self, *missing):
        super().__init__()
        self.missing = set(missing)

    def try_kernel(self, module, function):
        if (module, function) in self.missing:
            return NULL_KERNEL
        return super().try_kernel(module, function)


def test_fp8_head_falls_back_to_bf16_with_a_warning(caplog):
    gpu = Without(("draft_head", "head_argmax_fp8_batch"))
    with caplog.at_level(logging.WARNING):
        prop = make_proposer(CFG, W, gpu=gpu, fp8_head=True)
    assert prop.head_fp8 is None and "BF16 head" in caplog.text
    _, d_fallback = _history(prop, gpu)
    g2 = HostBackend()
    _, d_bf16 = _history(make_proposer(CFG, W, gpu=g2, fp8_head=False), g2)
    assert d_fallback == d_bf16


def test_fp8_head_needs_only_the_kernels_its_path_launches(caplog):
    """One rank launches the fused FP8 head, never gemv_fp8w: a build without gemv_fp8w keeps the
    FP8 head there (the check used to look at gemv_fp8w and fell back to BF16)."""
    gpu = Without(("gemv_fp8w", "gemv_fp8w"))
    with caplog.at_level(logging.WARNING):
        prop = make_proposer(CFG, W, gpu=gpu, fp8_head=True)
    assert prop.head_fp8 is not None and "BF16 head" not in caplog.text
    _, d_missing = _history(prop, gpu)
    g2 = HostBackend()
    _, d_fp8 = _history(make_proposer(CFG, W, gpu=g2, fp8_head=True), g2)
    assert d_missing == d_fp8


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda w, n: w.pop(n), "missing tensor"),
        (lambda w, n: w.__setitem__(n, w[n][:-1]), "expected shape"),
        (lambda w, n: w.__setitem__(n, w[n].astype(np.float32)), "expected dtype"),
    ],
)
@pytest.mark.parametrize(
    "name",
    [
        "model.layers.2.eh_proj.weight",
        "model.layers.2.self_attn.kv_b_proj.weight",
        "model.layers.2.mlp.experts.5.down_proj.weight",
        "model.layers.2.mlp.gate.e_score_correction_bias",
    ],
)
def test_bad_checkpoint_tensor_is_named_and_leaks_nothing(mutate, msg, name):
    w = dict(W)
    if "bias" in name and msg == "expected dtype":
        w[name] = w[name].astype(np.float16)
    else:
        mutate(w, name)
    gpu = HostBackend()
    with pytest.raises(WeightError, match=msg) as e:
        make_proposer(CFG, w, gpu=gpu)
    assert name in str(e.value)
    assert gpu.stats().live_bytes == 0


def test_shared_tables_of_another_vocabulary_are_refused():
    gpu = HostBackend()
    other = tiny(vocab_size=CFG.vocab_size + 3)
    emb = gpu.alloc(other.vocab_size * other.hidden_size * 2)
    with pytest.raises(WeightError, match="vocabulary shards would not match"):
        make_proposer(CFG, W, gpu=gpu, tables=SharedTables(emb, emb, other.vocab_size, other.hidden_size))
    gpu.free(emb)
    assert gpu.stats().live_bytes == 0


class SlowSync(HostBackend):
    """A device whose every wait takes 50 ms."""

    WAIT_S = 0.05

    def synchronize(self, stream=None):
        time.sleep(self.WAIT_S)
        super().synchronize(stream)


def test_host_time_of_a_propose_excludes_the_wait_for_the_device():
    gpu = SlowSync()
    prop = make_proposer(CFG, W, gpu=gpu, use_graphs=True)
    st, _ = _history(prop, gpu)  # captures the k=3 graph
    h = upload_rows(gpu, np.zeros((1, CFG.hidden_size)))
    t0 = time.perf_counter()
    prop.propose(st, 5, h, 14, 3)
    wall = time.perf_counter() - t0
    gpu.free(h)
    assert 0.0 < st.last_host_s < wall - SlowSync.WAIT_S, (st.last_host_s, wall)
