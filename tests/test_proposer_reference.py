"""The proposer's drafts against the independent float64 reference, on random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from model.config import tiny
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import bf16_weights, make_proposer, upload_rows
from tests.reference_f64 import ReferenceDrafter

# Logits of the host proposer follow BF16 activations and FP8 caches; against float64 they agree
# to about 5e-3 of their spread (measured on these seeds). Drafts are compared where the reference's top two are
# further apart than that.
LOGIT_RTOL = 2e-2


def _margin(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


@pytest.mark.parametrize(
    "seed,rows,topk,kpool,fp8_head",
    [
        (0, 5, 8, 2, False),  # dense: fewer complete pools than the top-k
        (1, 23, 8, 2, False),  # sparse selection with a tail
        (2, 30, 6, 3, True),  # kpool 3, FP8 head
        (3, 41, 4, 4, False),
    ],
)
def test_drafts_and_logits_match_float64(seed, rows, topk, kpool, fp8_head):
    cfg = tiny(index_topk=topk, index_kpool=kpool, max_context=64)
    w = bf16_weights(cfg, seed)
    gpu = HostBackend()
    prop = make_proposer(cfg, w, gpu=gpu, fp8_head=fp8_head)
    assert (prop.head_fp8 is not None) == fp8_head
    ref = ReferenceDrafter(cfg, w, fp8_cache=True, fp8_head=fp8_head)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, rows + 1)
    hiddens = rng.standard_normal((rows + 1, cfg.hidden_size)).astype(BF16)
    st = prop.alloc_state()
    p = upload_rows(gpu, hiddens[:rows])
    prop.prefill_drafter(st, tokens, p)
    for r in range(rows):
        ref.context_row(int(tokens[r + 1]), hiddens[r].astype(np.float64))
    last = int(rng.integers(0, cfg.vocab_size))
    h = upload_rows(gpu, hiddens[rows : rows + 1])
    k = 3
    drafts = prop.propose(st, last, h, rows, k)
    rdrafts, rlogits, _ = ref.propose(last, hiddens[rows].astype(np.float64), k)
    compared = 0
    for i in range(k):
        if drafts[:i] != rdrafts[:i]:
            break  # later drafts consume different tokens
        if _margin(rlogits[i]) > LOGIT_RTOL * np.ptp(rlogits[i]):
            assert drafts[i] == rdrafts[i], f"draft {i}"
            compared += 1
    assert compared >= 1
    # Logits of the first draft, read back from the proposer's buffer after a k=1 propose.
    prop.propose(st, last, h, rows, 1)
    ref.rewind_to(rows)
    _, rl1, _ = ref.propose(last, hiddens[rows].astype(np.float64), 1)
    got = np.empty(cfg.vocab_size, BF16)
    gpu.copy_d2h(got, prop.step.logits)
    err = np.abs(got.astype(np.float64) - rl1[0]).max() / np.ptp(rl1[0])
    assert err < LOGIT_RTOL, err
    prop.close()
