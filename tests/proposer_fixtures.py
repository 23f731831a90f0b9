"""Shared builders for proposer tests: random BF16 weights of a tiny config, a host proposer, and
readers of its caches."""

from __future__ import annotations

import numpy as np

from model.config import ModelConfig, tiny
from model.dsa import max_dsa_context
from model.proposer import MtpProposer, ProposerOptions
from runtime.dtypes import BF16, FP8
from runtime.host_backend import HostBackend
from tests.reference_f64 import random_mtp_weights


def bf16_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    w = random_mtp_weights(cfg, seed=seed, dtype=np.float32)
    out = {}
    for name, a in w.items():
        out[name] = a.astype(np.float32) if name.endswith("e_score_correction_bias") else a.astype(BF16)
    return out


def small_cfg(**kw) -> ModelConfig:
    return tiny(**kw)


def make_proposer(
    cfg: ModelConfig,
    weights,
    *,
    gpu=None,
    served=None,
    tables=None,
    cls: type[MtpProposer] = MtpProposer,
    **opts,
):
    gpu = gpu or HostBackend()
    served = served or max_dsa_context(cfg.dsa)  # the whole reach (the reservation in whole pools)
    return cls(gpu, cfg, weights, ProposerOptions(served_max_seq_len=served, **opts), tables=tables)


def upload_rows(gpu, rows: np.ndarray):
    a = np.ascontiguousarray(rows.astype(BF16))
    p = gpu.alloc(a.nbytes)
    gpu.copy_h2d(p, a)
    return p


def cache_snapshot(prop: MtpProposer, st) -> dict[str, np.ndarray]:
    """The valid region of every cache of a state, read from its slot of the proposer's pools:
    latent rows and scales through the block table, indexer keys and gates (KPool), complete pool
    keys and scales, the rope keys (MLA with a rope part)."""
    gpu, cfg, pools = prop.gpu, prop.cfg, prop.pools
    n, C, idim, kp = st.rows, cfg.attention.kv_lora_rank, cfg.dsa.index_head_dim, cfg.dsa.index_kpool
    g, lp = pools.geometry, pools.layers[0]
    snap: dict[str, np.ndarray] = {}
    lat = np.zeros((n, C), np.uint8)
    sc = np.zeros(n, np.float32)
    for r in range(n):
        slot = pools.latent_slot(st.slot, r)
        row = np.empty(C, np.uint8)
        gpu.copy_d2h(row, pools.kv.data[0].offset(slot * C))
        lat[r] = row
        s = np.empty(1, np.float32)
        gpu.copy_d2h(s, pools.kv.scales[0].offset(slot * 4))
        sc[r] = s[0]
    snap["latent"], snap["latent_scale"] = lat, sc
    R = cfg.attention.qk_rope_head_dim
    regions = [
        ("pool_keys", lp.pool_keys.offset(g.pool_row(st.slot, 0) * idim), (n // kp, idim), FP8),
        ("pool_scales", lp.pool_scales.offset(g.pool_row(st.slot, 0) * 4), (n // kp,), np.float32),
    ]
    if lp.keys is not None:  # the KPool indexer's per-token keys and gates
        regions += [
            ("keys", lp.keys.offset(g.key_row(st.slot, 0) * 2), (n, idim), BF16),
            ("gates", lp.gates.offset(g.key_row(st.slot, 0) * 2), (n, idim), BF16),
        ]
    if lp.rope_keys is not None:
        regions.append(("rope_keys", lp.rope_keys.offset(st.slot * pools.slot_rows * R * 2), (n, R), BF16))
    for name, ptr, shape, dt in regions:
        a = np.empty(shape, dt)
        if a.size:
            gpu.copy_d2h(a.view(np.uint8).reshape(-1), ptr)
        snap[name] = a.view(np.uint8) if dt is not np.float32 else a
    return snap


def assert_same_caches(a: dict, b: dict) -> None:
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"cache {k} differs")


def drafts_match_alone(gpu, cfg, batched: MtpProposer, alone: MtpProposer, k: int, step_counts) -> None:
    """Three sequences fed the same random rows on both proposers: each step catches up
    ``step_counts[step]`` rows a sequence (``catchup_batch`` against ``catchup_drafter``), drafts k
    at 0, 1 and 2 rows behind the end (``propose_batch`` against ``propose`` one at a time, equal
    drafts and equal caches), then verifies 0, 1 and 2 of them."""
    rng = np.random.default_rng(4)
    n = cfg.dsa.max_context + 2
    seqs = [(batched.alloc_state(), alone.alloc_state()) for _ in range(3)]
    toks = [rng.integers(0, cfg.vocab_size, n + 1) for _ in seqs]
    hids = [rng.standard_normal((n + 1, cfg.hidden_size)).astype(np.float32) for _ in seqs]
    for step, counts in enumerate(step_counts):
        bases = [alone.drafter_rows(b) for _, b in seqs]
        ptrs = [upload_rows(gpu, h[base : base + c]) for h, base, c in zip(hids, bases, counts)]
        tk = [t[base : base + c + 1] for t, base, c in zip(toks, bases, counts)]
        batched.catchup_batch([a for a, _ in seqs], tk, ptrs, bases)
        for (_, b), t, p, base in zip(seqs, tk, ptrs, bases):
            alone.catchup_drafter(b, t, p, base)
        pos = [alone.drafter_rows(b) - back for (_, b), back in zip(seqs, [0, 1, 2])]
        hid = upload_rows(gpu, np.stack([h[p] for h, p in zip(hids, pos)]))
        last = [int(t[p + 1]) for t, p in zip(toks, pos)]
        got = batched.propose_batch([a for a, _ in seqs], last, hid, pos, k)
        for i, (_, b) in enumerate(seqs):
            one = upload_rows(gpu, hids[i][pos[i] : pos[i] + 1])
            assert list(got[i]) == alone.propose(b, last[i], one, pos[i], k), f"step {step} sequence {i}"
            gpu.free(one)
            assert_same_caches(cache_snapshot(batched, seqs[i][0]), cache_snapshot(alone, b))
        batched.after_verify_batch([a for a, _ in seqs], [0, 1, 2])
        for (_, b), acc in zip(seqs, [0, 1, 2]):
            alone.after_verify(b, acc)
        for p in ptrs + [hid]:
            gpu.free(p)
