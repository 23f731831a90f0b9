"""bench/torch_step.py at the RoPE family's tiny shapes (``tiny_rope``: GLM-5's ``glm_moe_dsa`` form and
DeepSeek-V3.2's), on the CPU: the batch-1 step (DraftStep, float64) against a float64 NumPy
reference written here from the models' definitions (independent of tests/reference_f64.py's
absorbed one, see below), the batched step (BatchDraftStep) against the batch-1 step per sequence, and its two new parts on
their own: ``rope`` against the pair rotation written out, ``route`` (group-limited) against a
direct construction. Skipped where PyTorch (with torch._grouped_mm) is missing.

The reference attends in the plain (not absorbed) form: each head's keys ``kv_b``'s key half times
every selected latent with the row's rope key beside them, values through the value half, so it
shares no formula with the step's absorbed MLA. Softmax scale and YaRN's attention factor are
computed here from the config's YaRN parameters (transformers' ``_compute_yarn_parameters`` and
DeepSeek's mscale^2 on the softmax); only the inverse frequencies come from the config
(``ModelConfig.rope_inv_freq``, checked against transformers in tests/test_config_family.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this PyTorch has no torch._grouped_mm", allow_module_level=True)

from bench.torch_step import (  # noqa: E402 - after the skip
    BatchDraftStep,
    DraftStep,
    rope,
    route,
    weights_from_state_dict,
)
from model.config import tiny_rope  # noqa: E402 - after the skip
from tests.reference_f64 import random_mtp_weights  # noqa: E402 - after the skip

ROWS = 48
FAMILIES = ["glm_moe_dsa", "deepseek_v32"]


# ---- the float64 reference -----------------------------------------------------------------------


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_factors(cfg) -> tuple[float, float]:
    """(softmax scale, cos/sin factor) from the config's YaRN parameters, as transformers and
    DeepSeek define them."""
    a = cfg.attention
    scale = 1.0 / math.sqrt(a.qk_nope_head_dim + a.qk_rope_head_dim)
    y = a.rope.yarn
    if y is None:
        return scale, 1.0
    if y.mscale_all_dim:
        scale *= _mscale(y.factor, y.mscale_all_dim) ** 2
    if y.mscale and y.mscale_all_dim:
        af = _mscale(y.factor, y.mscale) / _mscale(y.factor, y.mscale_all_dim)
    else:
        af = _mscale(y.factor)
    return scale, af


def _np_rope(x: np.ndarray, pos: float, inv: np.ndarray, af: float, interleave: bool) -> np.ndarray:
    """x [..., d] with pair i = (x[2i], x[2i+1]) (interleaved) or (x[i], x[i + d/2]) turned by
    pos * inv[i], cos and sin times af; each pair's result in its own places."""
    x = np.array(x, np.float64)
    out = x.copy()
    d = x.shape[-1]
    for i in range(d // 2):
        a, b = (2 * i, 2 * i + 1) if interleave else (i, i + d // 2)
        ang = float(pos) * float(inv[i])
        c, s = math.cos(ang) * af, math.sin(ang) * af
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class _Reference:
    """One sequence's k drafts in float64 from checkpoint-named weights and caches of its context:
    latents [rows, C], rope keys [rows, rope], indexer keys [rows, idim] (rotated)."""

    def __init__(self, cfg, w: dict, latents, rope_keys, index_keys, mla_interleave=None):
        self.cfg, self.w = cfg, {k: np.asarray(v, np.float64) for k, v in w.items()}
        self.latents, self.rope_keys, self.index_keys = (
            np.array(latents, np.float64),
            np.array(rope_keys, np.float64),
            np.array(index_keys, np.float64),
        )
        rp = cfg.attention.rope
        self.mla_il = rp.interleave if mla_interleave is None else mla_interleave
        self.inv = cfg.rope_inv_freq
        self.scale, self.af = _yarn_factors(cfg)
        self.selected: list[list[int]] = []

    def draft(self, tok: int, h: np.ndarray, n: int) -> tuple[int, np.ndarray]:
        cfg, w = self.cfg, self.w
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        eps, C, nope, r, v = (
            cfg.rms_norm_eps,
            a.kv_lora_rank,
            a.qk_nope_head_dim,
            a.qk_rope_head_dim,
            a.v_head_dim,
        )
        nh, ih, idim = a.num_attention_heads, d.index_n_heads, d.index_head_dim
        P = f"model.layers.{cfg.num_hidden_layers}."
        A, X, M = P + "self_attn.", P + "self_attn.indexer.", P + "mlp."
        il_ix = a.rope.indexer_interleave
        e = _rms(w["model.embed_tokens.weight"][tok], w[P + "enorm.weight"], eps)
        x = w[P + "eh_proj.weight"] @ np.concatenate([e, _rms(h, w[P + "hnorm.weight"], eps)])
        y = _rms(x, w[P + "input_layernorm.weight"], eps)
        qa = _rms(w[A + "q_a_proj.weight"] @ y, w[A + "q_a_layernorm.weight"], eps)
        q = (w[A + "q_b_proj.weight"] @ qa).reshape(nh, nope + r)
        kv = w[A + "kv_a_proj_with_mqa.weight"] @ y
        self.latents[n] = _rms(kv[:C], w[A + "kv_a_layernorm.weight"], eps)
        self.rope_keys[n] = _np_rope(kv[C:], n, self.inv, self.af, self.mla_il)
        k = w[X + "wk.weight"] @ y
        k = (k - k.mean()) / np.sqrt(((k - k.mean()) ** 2).mean() + 1e-6) * w[X + "k_norm.weight"]
        k = k + w[X + "k_norm.bias"]
        k[: d.rope_dim] = _np_rope(k[: d.rope_dim], n, self.inv, self.af, il_ix)
        self.index_keys[n] = k
        if n + 1 > d.index_topk:
            qi = (w[X + "wq_b.weight"] @ qa).reshape(ih, idim)
            qi[:, : d.rope_dim] = _np_rope(qi[:, : d.rope_dim], n, self.inv, self.af, il_ix)
            wh = (w[X + "weights_proj.weight"] @ y) / math.sqrt(ih)
            score = [
                sum(wh[hh] * max(qi[hh] @ self.index_keys[j], 0.0) for hh in range(ih)) / math.sqrt(idim)
                for j in range(n + 1)
            ]
            # The index_topk highest, the lower row first on a tie.
            sel = sorted(sorted(range(n + 1), key=lambda j: (-score[j], j))[: d.index_topk])
        else:
            sel = list(range(n + 1))
        self.selected.append(sel)
        kvb = w[A + "kv_b_proj.weight"].reshape(nh, nope + v, C)
        lat, kr = self.latents[sel], self.rope_keys[sel]
        o = []
        for hh in range(nh):
            keys = lat @ kvb[hh, :nope].T  # [S, nope]: the head's keys, not absorbed
            qr = _np_rope(q[hh, nope:], n, self.inv, self.af, self.mla_il)
            s = (keys @ q[hh, :nope] + kr @ qr) * self.scale
            p = np.exp(s - s.max())
            p /= p.sum()
            o.append(p @ (lat @ kvb[hh, nope:].T))
        x = x + w[A + "o_proj.weight"] @ np.concatenate(o)
        # MoE: group-limited routing written as the rule says.
        y2 = _rms(x, w[P + "post_attention_layernorm.weight"], eps)
        sc = _sigmoid(w[M + "gate.weight"] @ y2)
        bias = w[M + "gate.e_score_correction_bias"]
        choice = sc + bias
        E, G = m.n_routed_experts, m.n_group
        gsz = E // G
        gscore = [sum(sorted(choice[g * gsz : (g + 1) * gsz], reverse=True)[:2]) for g in range(G)]
        kept = sorted(range(G), key=lambda g: (-gscore[g], g))[: m.topk_group]
        cand = [ex for ex in range(E) if ex // gsz in kept]
        ids = sorted(cand, key=lambda ex: (-choice[ex], ex))[: m.num_experts_per_tok]
        wts = sc[ids]
        if m.norm_topk_prob:
            wts = wts / wts.sum()
        wts = wts * m.routed_scaling_factor
        L = m.swiglu_limit

        def mlp(pre: str) -> np.ndarray:
            g = np.minimum(w[pre + "gate_proj.weight"] @ y2, L)
            u = np.clip(w[pre + "up_proj.weight"] @ y2, -L, L)
            return w[pre + "down_proj.weight"] @ (g * _sigmoid(g) * u)

        moe = sum(wt * mlp(f"{M}experts.{ex}.") for ex, wt in zip(ids, wts)) + mlp(M + "shared_experts.")
        x = x + moe
        xn = _rms(x, w[P + "shared_head.norm.weight"], eps)
        logits = w["lm_head.weight"] @ xn
        return int(np.argmax(logits)), xn

    def propose(self, tok: int, h: np.ndarray, context: int, k: int) -> tuple[list[int], np.ndarray]:
        drafts = []
        for i in range(k):
            tok, h = self.draft(tok, h, context + i)
            drafts.append(tok)
        return drafts, h


# ---- helpers -------------------------------------------------------------------------------------


def _weights(cfg, seed: int) -> dict:
    w = random_mtp_weights(cfg, seed=seed, dtype=np.float64)
    # A correction bias large enough that routing by score + bias differs from routing by score.
    M = f"model.layers.{cfg.num_hidden_layers}.mlp."
    w[M + "gate.e_score_correction_bias"] = (
        np.random.default_rng(seed + 1).standard_normal(cfg.moe.n_routed_experts) * 0.3
    ).astype(np.float32)
    return w


def _step(cfg, w: dict, dtype=torch.float64, seed: int = 0) -> DraftStep:
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()}
    return DraftStep(
        cfg,
        rows=ROWS,
        device="cpu",
        dtype=dtype,
        seed=seed,
        weights=weights_from_state_dict(cfg, sd, dtype=dtype),
    )


# ---- rope and route on their own -----------------------------------------------------------------


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_is_the_pair_rotation(interleave):
    cfg = tiny_rope(family="deepseek_v32")  # YaRN: an attention factor other than 1
    inv = cfg.rope_inv_freq
    _, af = _yarn_factors(cfg)
    assert af != 1.0
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 16, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 40, 1000])
    got = rope(x, pos[:, None], torch.as_tensor(inv), af, interleave)
    for i in range(5):
        want = _np_rope(x[i].numpy(), int(pos[i]), inv, af, interleave)
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-13, atol=1e-13)
    # Position 0 only scales; a rotation keeps each pair's norm (times af); queries and keys
    # rotated alike score by their distance only.
    np.testing.assert_allclose(got[0].numpy(), af * x[0].numpy(), rtol=1e-14)
    q, k = x[1, 0], x[2, 1]

    def dot(m, n):
        return float(
            rope(q, torch.tensor(m), torch.as_tensor(inv), 1.0, interleave)
            @ rope(k, torch.tensor(n), torch.as_tensor(inv), 1.0, interleave)
        )

    assert dot(9, 4) == pytest.approx(dot(105, 100), rel=1e-10)
    assert dot(9, 4) != pytest.approx(dot(9, 5), rel=1e-3)
    # The two layouts are different rotations of the same numbers.
    other = rope(x, pos[:, None], torch.as_tensor(inv), af, not interleave)
    assert not torch.allclose(other[1:], got[1:])
    # BF16 in, BF16 out (computed in f32).
    assert (
        rope(x.to(torch.bfloat16), pos[:, None], torch.as_tensor(inv), af, interleave).dtype == torch.bfloat16
    )


def _route_by_hand(choice: list[float], E: int, G: int, topk_group: int, top_k: int) -> list[int]:
    gsz = E // G
    gscore = [sum(sorted(choice[g * gsz : (g + 1) * gsz], reverse=True)[:2]) for g in range(G)]
    kept = sorted(range(G), key=lambda g: (-gscore[g], g))[:topk_group]
    cand = [e for e in range(E) if e // gsz in kept]
    return sorted(cand, key=lambda e: (-choice[e], e))[:top_k]


@pytest.mark.parametrize("E,G,kg,tk", [(8, 4, 2, 2), (256, 8, 4, 8), (12, 3, 1, 4), (8, 1, 1, 2)])
def test_route_is_the_group_limited_top_k(E, G, kg, tk):
    cfg = tiny_rope(family="deepseek_v32")
    m = dataclasses.replace(cfg.moe, n_routed_experts=E, n_group=G, topk_group=kg, num_experts_per_tok=tk)
    g = torch.Generator().manual_seed(E + G)
    scores = torch.sigmoid(torch.randn(300, E, generator=g))
    bias = (torch.randn(E, generator=g) * 0.2).float()
    got = route(scores, bias, m).tolist()
    choice = (scores + bias).tolist()
    want = [_route_by_hand(c, E, G, kg, tk) for c in choice]
    assert got == want
    if G > 1:  # the groups did change the choice somewhere (else the check above is ungrouped top-k)
        plain = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :tk].tolist()
        assert plain != want
    # Ties: equal groups keep the lower one, equal experts the lower one.
    if (E, G, kg, tk) == (8, 4, 2, 2):
        flat = torch.full((1, 8), 0.5)
        assert route(flat, torch.zeros(8), m).tolist() == [[0, 1]]
        flat[0, 5] = 0.6  # group 2 now leads, group 0 second
        assert route(flat, torch.zeros(8), m).tolist() == [[5, 0]]


# ---- the batch-1 step against the reference ------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("context", [5, 7, 30])
def test_family_step_is_the_float64_reference(family, context):
    # Context 5: every draft attends every row (at most index_topk = 8 rows); 7: the second draft
    # is the first to select; 30: every draft selects 8 of up to 33 rows.
    cfg = tiny_rope(family=family, max_context=ROWS)
    w = _weights(cfg, 11)
    ds = _step(cfg, w)
    g = torch.Generator().manual_seed(context)
    ds.tok_in[0] = int(torch.randint(0, cfg.vocab_size, (1,), generator=g))
    ref = _Reference(cfg, w, ds.latents.numpy(), ds.rope_keys.numpy(), ds.pool_keys.numpy())
    want, h = ref.propose(int(ds.tok_in[0]), ds.hid_in.numpy(), context, 3)
    with torch.no_grad():
        got = ds.propose(context, 3).tolist()
    assert got == want
    np.testing.assert_allclose(ds.last_hidden.numpy(), h, rtol=1e-10, atol=1e-10)
    # The rows the drafts wrote: latent, rotated rope key, rotated indexer key (its pool's key).
    s = slice(context, context + 3)
    np.testing.assert_allclose(ds.latents[s].numpy(), ref.latents[s], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ds.rope_keys[s].numpy(), ref.rope_keys[s], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ds.pool_keys[s].numpy(), ref.index_keys[s], rtol=1e-12, atol=1e-12)
    sizes = [len(x) for x in ref.selected]
    assert sizes == [min(context + i + 1, cfg.dsa.index_topk) for i in range(3)]
    if context == 30:
        # The selection is not the last rows (it would pass a step that ignored the scores).
        assert ref.selected[0] != list(range(31 - 8, 31))
        # The MLA's RoPE layout matters at this config: the other one drafts a different hidden.
        other = _Reference(
            cfg, w, ds.latents.numpy(), ds.rope_keys.numpy(), ds.pool_keys.numpy(), mla_interleave=False
        )
        other.rope_keys[:context] = ref.rope_keys[:context]
        _, h_other = other.propose(int(ds.tok_in[0]), ds.hid_in.numpy(), context, 3)
        assert np.abs(h_other - h).max() > 1e-6


# ---- the batched step against the batch-1 step ---------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_family_batch_is_each_sequences_batch1_drafts(family):
    # Dense (0, 3), crossing into selection (7), selecting (21, 30; a duplicate with other caches).
    contexts = [3, 30, 7, 0, 21, 30]
    k = 3
    cfg = tiny_rope(family=family, max_context=64)
    w = _weights(cfg, 5)
    # float32: torch._grouped_mm has no float64 kernel.
    base = _step(cfg, w, dtype=torch.float32, seed=2)
    bs = BatchDraftStep(base, len(contexts), ROWS, seed=4)
    assert bs.keys is None and bs.gates is None  # the per-token indexer keeps neither
    alone = []
    for b, c in enumerate(contexts):
        one = DraftStep(cfg, rows=ROWS, device="cpu", dtype=torch.float32, weights=base.W)
        one.latents.copy_(bs.latents[b])
        one.rope_keys.copy_(bs.rope_keys[b])
        one.pool_keys.copy_(bs.pool_keys[b])
        one.tok_in[0] = bs.tok_in[b]
        one.hid_in.copy_(bs.hid_in[b])
        with torch.no_grad():
            alone.append((one, one.propose(c, k).tolist()))
    with torch.no_grad():
        got = bs.propose(contexts, k).tolist()
    assert got == [d for _, d in alone]
    assert len({tuple(d) for d in got}) > 2
    tol = dict(rtol=2e-5, atol=2e-5)
    for b, (one, _) in enumerate(alone):
        torch.testing.assert_close(bs.last_hidden[b], one.last_hidden, **tol)
        torch.testing.assert_close(bs.latents[b], one.latents, **tol)
        torch.testing.assert_close(bs.rope_keys[b], one.rope_keys, **tol)
        torch.testing.assert_close(bs.pool_keys[b], one.pool_keys, **tol)
    # Routing recorded per draft, each row's experts from its kept groups only.
    m = cfg.moe
    ids = bs.expert_ids[:k].reshape(-1, m.num_experts_per_tok).tolist()
    gsz = m.n_routed_experts // m.n_group
    assert all(len({e // gsz for e in row}) <= m.topk_group for row in ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_step_of_random_weights_and_a_loaded_sequence(family):
    """The step's own random weights at the family's shapes (kv_a with the rope rows, no compress
    gate), its caches (rope keys, per-token pool keys, no keys or gates), and a batch sequence
    loaded from it drafting what it drafts."""
    cfg = tiny_rope(family=family, max_context=64)
    a, d = cfg.attention, cfg.dsa
    one = DraftStep(cfg, rows=ROWS, device="cpu", dtype=torch.float32, seed=6)
    assert one.W["kv_a"].shape == (a.kv_lora_rank + a.qk_rope_head_dim, cfg.hidden_size)
    assert "ix_gate" not in one.W and "ix_ape" not in one.W
    assert one.keys is None and one.gates is None
    assert one.rope_keys.shape == (ROWS, a.qk_rope_head_dim) and one.pool_keys.shape == (
        ROWS,
        d.index_head_dim,
    )
    bs = BatchDraftStep(one, 2, ROWS, seed=8)
    bs.load_sequence(1, one)
    with torch.no_grad():
        got = bs.propose([9, 25], 2)[1].tolist()
        want = one.propose(25, 2).tolist()
    assert got == want
    torch.testing.assert_close(bs.rope_keys[1], one.rope_keys, rtol=2e-5, atol=2e-5)
