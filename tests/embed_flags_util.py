"""Launch harness for mtp_embed_norm_batch with flags (MTP_EMBED_NORM_FLAGS_BATCH) (model/kernels/mtp_input.py) on any backend: a
batch with a live entry, one whose token is outside the vocabulary, one whose hidden row holds a
NaN, and a padding entry; returns (out rows [m, 2h] BF16, flag bytes [m, 4])."""

from __future__ import annotations

import numpy as np
from batch_proj_util import EPS, Bufs
from kernel_util import random_bf16

from model.kernels import mtp_input as mi
from model.kernels.batch import pack_entries
from runtime.dtypes import BF16

VOCAB, H = 50, 64


def embed_flags_case(gpu, seed: int, flag_byte: int):
    rng = np.random.default_rng(seed)
    table = random_bf16(rng, (VOCAB, H))
    hidden = random_bf16(rng, (4, H))
    hidden[2, 5] = np.float32(np.nan)
    ent = pack_entries([0, 1, 2], [3, 4, 5], [7, VOCAB + 3, 9], m=4)
    enorm, hnorm = random_bf16(rng, H, exp_lo=-1), random_bf16(rng, H, exp_lo=-1)
    with Bufs(gpu) as b:
        pt, pe, pen, ph, phn = b.put(table), b.put(ent), b.put(enorm), b.put(hidden), b.put(hnorm)
        po = b.poison(4 * 2 * H * 2)
        pf = b.put(np.zeros(16, np.uint8))
        mi.mtp_embed_norm_batch(
            gpu, table=pt, entries=pe, enorm=pen, hidden=ph, hnorm=phn, out=po, m=4, vocab=VOCAB, h=H, eps=EPS,
            flags=pf, flag_byte=flag_byte,
        )  # fmt: skip
        return b.get(po).view(BF16).reshape(4, 2 * H), b.get(pf).reshape(4, 4)
