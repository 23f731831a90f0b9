"""Self-consistency tests of the float64 reference drafter (tests/reference_f64.py)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from model.config import tiny
from tests.reference_f64 import (
    ReferenceDrafter,
    argmax_lowest,
    fp8_rows,
    random_mtp_weights,
    rmsnorm,
    top_k_desc,
)


def _rows(cfg, n, seed):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, size=n)
    hid = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
    return toks, hid


def _drafter(cfg, seed=0, **kw):
    return ReferenceDrafter(cfg, random_mtp_weights(cfg, seed), **kw)


def _prefix(cfg):
    return f"model.layers.{cfg.num_hidden_layers}."


def _non_absorbed_attention(dr, y, rows):
    """Plain MLA: explicit per-head keys and values from the stored latents."""
    a = dr.cfg.attention
    P = _prefix(dr.cfg) + "self_attn."
    w = {k: np.asarray(v, np.float64) for k, v in dr._weights_for_test.items() if k.startswith(P)}
    ql = rmsnorm(w[P + "q_a_proj.weight"] @ y, w[P + "q_a_layernorm.weight"], dr.cfg.rms_norm_eps)
    q = (w[P + "q_b_proj.weight"] @ ql).reshape(a.num_attention_heads, a.qk_nope_head_dim)
    kv_b = w[P + "kv_b_proj.weight"]
    c = dr.latents[rows]
    outs = []
    for h in range(a.num_attention_heads):
        blk = kv_b[h * (a.qk_nope_head_dim + a.v_head_dim) : (h + 1) * (a.qk_nope_head_dim + a.v_head_dim)]
        wk, wv = blk[: a.qk_nope_head_dim], blk[a.qk_nope_head_dim :]
        keys = c @ wk.T  # [S, nope]
        vals = c @ wv.T  # [S, v]
        s = keys @ q[h] / math.sqrt(a.qk_nope_head_dim + a.qk_rope_head_dim)
        p = np.exp(s - s.max())
        p /= p.sum()
        outs.append(p @ vals)
    return w[P + "o_proj.weight"] @ np.concatenate(outs)


# (a) absorption ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_cache", [True, False])
def test_absorbed_attention_equals_plain_mla_while_dense(fp8_cache, monkeypatch):
    cfg = tiny(index_topk=8, index_kpool=2)  # 4 pools before sparse selection starts
    weights = random_mtp_weights(cfg, 1)
    dr = ReferenceDrafter(cfg, weights, fp8_cache=fp8_cache)
    dr._weights_for_test = weights
    toks, hid = _rows(cfg, 9, 2)
    T, kp = cfg.dsa.topk_pools, cfg.dsa.index_kpool
    dense_rows = 0
    for i in range(9):
        dr.context_row(int(toks[i]), hid[i])
        n = dr.rows - 1
        if (n + 1) // kp > T:
            break
        dense_rows += 1
        sel = dr.selection(n)
        assert np.array_equal(sel, np.arange(n + 1))
        y = dr._y[n]
        got = dr.attention(y, sel)
        want = _non_absorbed_attention(dr, y, sel)
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    assert dense_rows == T * kp + kp - 1

    # End to end: a whole draft with plain MLA plugged in gives the same logits.
    fresh = ReferenceDrafter(cfg, weights, fp8_cache=fp8_cache)
    fresh._weights_for_test = weights
    fresh.feed(toks[:4], hid[:4])
    lg_abs, xn_abs = fresh.draft_row(int(toks[4]), hid[4])
    fresh.rewind_to(4)
    monkeypatch.setattr(fresh, "attention", lambda y, rows: _non_absorbed_attention(fresh, y, rows))
    lg_plain, xn_plain = fresh.draft_row(int(toks[4]), hid[4])
    np.testing.assert_allclose(lg_abs, lg_plain, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(xn_abs, xn_plain, rtol=1e-10, atol=1e-12)


# (b) rewind ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kpool,topk", [(2, 8), (3, 6)])
@pytest.mark.parametrize("m", [0, 5, 7, 10, 13])
def test_rewind_then_refeed_matches_never_advanced(kpool, topk, m):
    cfg = tiny(index_topk=topk, index_kpool=kpool)
    weights = random_mtp_weights(cfg, 3)
    toks, hid = _rows(cfg, 20, 4)

    ref = ReferenceDrafter(cfg, weights)
    ref.feed(toks[:m], hid[:m])
    want_state = ref.state()
    want = ref.propose(int(toks[m]), hid[m], 3)

    dr = ReferenceDrafter(cfg, weights)
    dr.feed(toks[:17], hid[:17])
    dr.propose(int(toks[17]), hid[17], 2)  # go past m with draft rows too
    dr.rewind_to(m)
    assert dr.rows == m
    for key, val in dr.state().items():
        assert np.array_equal(val, want_state[key]), key
    got = dr.propose(int(toks[m]), hid[m], 3)
    assert got[0] == want[0]
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])

    # Rewinding through propose(position=...) is the same thing.
    dr2 = ReferenceDrafter(cfg, weights)
    dr2.feed(toks[:15], hid[:15])
    got2 = dr2.propose(int(toks[m]), hid[m], 3, position=m)
    assert got2[0] == want[0] and np.array_equal(got2[1], want[1])


def test_rewind_cuts_open_pools_and_refuses_bad_positions():
    cfg = tiny(index_topk=8, index_kpool=2)
    dr = _drafter(cfg)
    toks, hid = _rows(cfg, 9, 5)
    dr.feed(toks, hid)
    assert dr.pool_keys.shape[0] == 4
    dr.rewind_to(7)  # pool 3 (rows 6, 7) loses row 7
    assert dr.pool_keys.shape[0] == 3 and dr.rows == 7
    with pytest.raises(ValueError):
        dr.rewind_to(8)
    with pytest.raises(ValueError):
        dr.propose(int(toks[0]), hid[0], 1, position=9)


def test_after_verify_keeps_accepted_plus_one():
    cfg = tiny()
    dr = _drafter(cfg)
    toks, hid = _rows(cfg, 6, 6)
    dr.feed(toks[:5], hid[:5])
    dr.propose(int(toks[5]), hid[5], 3)
    assert dr.rows == 8
    dr.after_verify(0)
    assert dr.rows == 6  # the first draft row is never trimmed
    dr.propose(int(toks[5]), hid[5], 3, position=5)
    dr.after_verify(5)
    assert dr.rows == 8


# (c) dense does not depend on the indexer --------------------------------------------------------


def test_dense_selection_ignores_indexer_weights():
    cfg = tiny(index_topk=64, index_kpool=2)  # 32 pools: never sparse in 20 rows
    w1 = random_mtp_weights(cfg, 7)
    w2 = dict(w1)
    rng = np.random.default_rng(99)
    X = _prefix(cfg) + "self_attn.indexer."
    for name in (
        "wq_b.weight",
        "wk.weight",
        "weights_proj.weight",
        "k_norm.weight",
        "k_norm.bias",
        "index_kpool_compress_gate",
        "index_kpool_compress_ape",
    ):
        w2[X + name] = rng.standard_normal(w1[X + name].shape).astype(np.float32)
    toks, hid = _rows(cfg, 20, 8)
    a, b = ReferenceDrafter(cfg, w1), ReferenceDrafter(cfg, w2)
    a.feed(toks[:17], hid[:17])
    b.feed(toks[:17], hid[:17])
    ra, rb = a.propose(int(toks[17]), hid[17], 3), b.propose(int(toks[17]), hid[17], 3)
    assert ra[0] == rb[0]
    assert np.array_equal(ra[1], rb[1]) and np.array_equal(ra[2], rb[2])
    assert not np.array_equal(a.pool_keys, b.pool_keys)  # the indexer state did differ

    # Sanity: in the sparse regime the same change does move the selection somewhere.
    cfg_s = tiny(index_topk=4, index_kpool=2)
    w1s = random_mtp_weights(cfg_s, 7)
    w2s = dict(w1s)
    for name in ("wq_b.weight", "wk.weight", "weights_proj.weight", "index_kpool_compress_gate"):
        w2s[X + name] = rng.standard_normal(w1s[X + name].shape).astype(np.float32)
    a, b = ReferenceDrafter(cfg_s, w1s), ReferenceDrafter(cfg_s, w2s)
    a.feed(toks, hid)
    b.feed(toks, hid)
    assert any(not np.array_equal(a.selection(n), b.selection(n)) for n in range(20))


# (d) selection size and content ------------------------------------------------------------------


@pytest.mark.parametrize("kpool,topk", [(2, 8), (3, 6), (4, 4), (1, 3)])
def test_selection_size_and_content(kpool, topk):
    cfg = tiny(index_topk=topk, index_kpool=kpool)
    dr = _drafter(cfg, 11, fp8_cache=False)
    T = cfg.dsa.topk_pools
    toks, hid = _rows(cfg, 30, 12)
    dr.feed(toks, hid)
    for n in range(30):
        sel = dr.selection(n)
        assert len(sel) == min(n + 1, T * kpool + (n + 1) % kpool), n
        assert len(sel) <= topk + kpool - 1
        assert len(set(sel.tolist())) == len(sel) and sel.max() <= n
        complete = (n + 1) // kpool
        tail = set(range(complete * kpool, n + 1))
        assert tail <= set(sel.tolist())
        pools = sorted({int(r) // kpool for r in sel if r < complete * kpool})
        for p in pools:  # whole pools only
            assert set(range(p * kpool, p * kpool + kpool)) <= set(sel.tolist())
        if complete > T:
            # Independent pool scoring from the stored keys and gates.
            d = cfg.dsa
            X = dr
            ape = X.ix_ape
            keys = []
            for p in range(complete):
                k = X.indexer_keys[p * kpool : (p + 1) * kpool]
                g = X.gates[p * kpool : (p + 1) * kpool] + ape
                e = np.exp(g - g.max(axis=0))
                keys.append((e / e.sum(axis=0) * k).sum(axis=0))
            keys = np.array(keys)
            y = dr._y[n]
            qlat = rmsnorm(X.q_a @ y, X.q_a_norm, cfg.rms_norm_eps)
            qi = (X.ix_wq_b @ qlat).reshape(d.index_n_heads, d.index_head_dim)
            wh = X.ix_weights @ y / math.sqrt(d.index_n_heads)
            score = np.array(
                [
                    sum(wh[h] * max(0.0, qi[h] @ keys[p]) for h in range(d.index_n_heads))
                    for p in range(complete)
                ]
            ) / math.sqrt(d.index_head_dim)
            want = sorted(np.lexsort((np.arange(complete), -score))[:T].tolist())
            assert pools == want, n


def test_pool_and_expert_ties_go_to_lower_index():
    assert top_k_desc(np.array([0.0, 1.0, -0.0, 1.0, 0.0]), 3) == [1, 3, 0]
    assert top_k_desc(np.array([-0.0, 0.0, -0.0]), 2) == [0, 1]


# (e) MoE routing -----------------------------------------------------------------------------------


def test_moe_bias_picks_experts_but_weights_use_unbiased_scores():
    cfg = tiny(n_routed_experts=8, num_experts_per_tok=2)
    weights = random_mtp_weights(cfg, 13)
    M = _prefix(cfg) + "mlp."
    H = cfg.hidden_size
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 0.25, -0.5])
    gate = np.zeros((8, H), np.float32)
    gate[:, 0] = logits
    y2 = np.zeros(H)
    y2[0] = 1.0
    s = 1.0 / (1.0 + np.exp(-logits))
    sf = cfg.moe.routed_scaling_factor

    weights[M + "gate.weight"] = gate
    weights[M + "gate.e_score_correction_bias"] = np.zeros(8, np.float32)
    dr = ReferenceDrafter(cfg, weights)
    chosen, w = dr.route(y2)
    assert chosen == [0, 1]
    np.testing.assert_allclose(w, [s[0] / (s[0] + s[1]) * sf, s[1] / (s[0] + s[1]) * sf], rtol=1e-14)

    bias = np.zeros(8, np.float32)
    bias[5] = 3.0  # s[5] + 3 is the largest
    bias[1] = -1.0  # s[1] - 1 falls below s[2]
    weights[M + "gate.e_score_correction_bias"] = bias
    dr = ReferenceDrafter(cfg, weights)
    chosen, w = dr.route(y2)
    assert chosen == [5, 0]
    np.testing.assert_allclose(w, [s[5] / (s[5] + s[0]) * sf, s[0] / (s[5] + s[0]) * sf], rtol=1e-14)
    assert abs(w.sum() - sf) < 1e-12

    # Exact ties of score + bias go to the lower expert index.
    bias = np.zeros(8, np.float32)
    weights[M + "gate.weight"] = np.zeros((8, H), np.float32)
    weights[M + "gate.e_score_correction_bias"] = bias
    dr = ReferenceDrafter(cfg, weights)
    chosen, w = dr.route(y2)
    assert chosen == [0, 1]
    np.testing.assert_allclose(w, [sf / 2, sf / 2], rtol=1e-14)

    # Full MoE output against a hand computation (clamped SwiGLU, shared expert with weight 1).
    weights[M + "gate.weight"] = gate
    weights[M + "gate.e_score_correction_bias"] = np.zeros(8, np.float32)
    dr = ReferenceDrafter(cfg, weights)
    rng = np.random.default_rng(14)
    y = rng.standard_normal(H) * 3.0
    y[0] = 1.0
    L = cfg.moe.swiglu_limit

    def f(name):
        return np.asarray(weights[name], np.float64)

    def expert(pre):
        g = np.minimum(f(pre + "gate_proj.weight") @ y, L)
        u = np.clip(f(pre + "up_proj.weight") @ y, -L, L)
        return f(pre + "down_proj.weight") @ (g / (1 + np.exp(-g)) * u)

    chosen, w = dr.route(y)
    want = sum(w[i] * expert(M + f"experts.{e}.") for i, e in enumerate(chosen))
    want = want + expert(M + "shared_experts.")
    np.testing.assert_allclose(dr.moe(y), want, rtol=1e-12, atol=1e-13)


def test_swiglu_clamp_is_active():
    cfg = tiny()
    weights = random_mtp_weights(cfg, 15)
    dr = ReferenceDrafter(cfg, weights)
    y = np.full(cfg.hidden_size, 40.0)  # pushes projections far past the limit
    M = _prefix(cfg) + "mlp.experts.0."
    g = np.asarray(weights[M + "gate_proj.weight"], np.float64) @ y
    assert np.abs(g).max() > cfg.moe.swiglu_limit
    from tests.reference_f64 import clamped_swiglu

    out = clamped_swiglu(y, *dr.experts[0], cfg.moe.swiglu_limit)
    L = cfg.moe.swiglu_limit
    gg = np.minimum(g, L)
    uu = np.clip(np.asarray(weights[M + "up_proj.weight"], np.float64) @ y, -L, L)
    np.testing.assert_allclose(out, dr.experts[0][2] @ (gg / (1 + np.exp(-gg)) * uu), rtol=1e-12)


# (f) argmax ties -----------------------------------------------------------------------------------


def test_argmax_ties_go_to_lowest_index():
    assert argmax_lowest(np.array([1.0, 3.0, 2.0, 3.0])) == 1
    assert argmax_lowest(np.zeros(5)) == 0
    with pytest.raises(FloatingPointError):
        argmax_lowest(np.array([0.0, np.nan]))

    cfg = tiny()
    weights = random_mtp_weights(cfg, 16)
    V, H = cfg.vocab_size, cfg.hidden_size
    v = np.random.default_rng(17).standard_normal(H).astype(np.float32)
    head = np.zeros((V, H), np.float32)
    head[[30, 70]] = v
    head[[40, 80]] = -v
    weights["lm_head.weight"] = head
    toks, hid = _rows(cfg, 4, 18)
    dr = ReferenceDrafter(cfg, weights)
    dr.feed(toks[:3], hid[:3])
    drafts, logits, _ = dr.propose(int(toks[3]), hid[3], 2)
    for lg, d in zip(logits, drafts):
        assert lg[30] == lg[70] and lg[40] == lg[80] and lg[30] != 0
        assert d == (30 if lg[30] > 0 else 40)

    weights["lm_head.weight"] = np.zeros((V, H), np.float32)
    dr = ReferenceDrafter(cfg, weights)
    assert dr.propose(int(toks[0]), hid[0], 2)[0] == [0, 0]


# propose chaining, FP8 emulation, weight plumbing ---------------------------------------------------


def test_propose_chains_token_and_normalised_hidden():
    cfg = tiny(index_topk=4, index_kpool=2)
    weights = random_mtp_weights(cfg, 19)
    toks, hid = _rows(cfg, 12, 20)
    a = ReferenceDrafter(cfg, weights)
    a.feed(toks[:8], hid[:8])
    drafts, logits, hiddens = a.propose(int(toks[8]), hid[8], 4)
    assert logits.shape == (4, cfg.vocab_size) and hiddens.shape == (4, cfg.hidden_size)
    assert a.rows == 12
    b = ReferenceDrafter(cfg, weights)
    b.feed(toks[:8], hid[:8])
    tok, h = int(toks[8]), hid[8]
    for i in range(4):
        lg, xn = b.draft_row(tok, h)
        assert np.array_equal(lg, logits[i]) and np.array_equal(xn, hiddens[i])
        tok, h = int(np.argmax(lg)), xn
        assert tok == drafts[i]
    # the returned hidden is rmsnorm(block output) * shared_head.norm, so the head reads it directly
    np.testing.assert_allclose(b.head @ hiddens[-1], logits[-1], rtol=1e-12)


def test_fp8_rows_round_trip():
    rng = np.random.default_rng(21)
    x = rng.standard_normal((5, 33)) * np.array([[1e-3], [1.0], [1e3], [1e6], [0.0]])
    q = fp8_rows(x)
    assert np.isfinite(q).all()
    assert np.array_equal(q[4], np.zeros(33))
    amax = np.abs(x[:4]).max(axis=1)
    # the absmax element is exactly representable after scaling (448 is an E4M3 value)
    idx = np.abs(x[:4]).argmax(axis=1)
    np.testing.assert_allclose(np.abs(q[np.arange(4), idx]), amax, rtol=1e-15)
    # relative error of E4M3 (3 mantissa bits) is at most 2^-4 for normals
    big = np.abs(x[:4]) / amax[:, None] * 448 >= 2**-6
    assert (np.abs(q[:4] - x[:4])[big] <= np.abs(x[:4])[big] * 2**-4 + 1e-300).all()
    # every stored value is an E4M3 value times the row's scale
    scaled = q[:4] / (amax[:, None] / 448)
    back = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_allclose(back, scaled, rtol=1e-12, atol=1e-300)


def test_fp8_cache_and_head_options():
    cfg = tiny(index_topk=4, index_kpool=2)
    weights = random_mtp_weights(cfg, 22)
    toks, hid = _rows(cfg, 10, 23)
    exact = ReferenceDrafter(cfg, weights, fp8_cache=False)
    cache = ReferenceDrafter(cfg, weights)
    head = ReferenceDrafter(cfg, weights, fp8_cache=False, fp8_head=True)
    res = []
    for dr in (exact, cache, head):
        dr.feed(toks[:7], hid[:7])
        res.append(dr.propose(int(toks[7]), hid[7], 3))
    # FP8 storage perturbs the numbers but only a little (compared while the drafts agree: a
    # draft that differs feeds the next one another token)
    for r in res[1:]:
        assert not np.array_equal(r[1][0], res[0][1][0])
        same = next((i for i in range(3) if r[0][i] != res[0][0][i]), 2) + 1
        np.testing.assert_allclose(r[1][:same], res[0][1][:same], atol=0.15 * np.abs(res[0][1]).max())
    np.testing.assert_array_equal(cache.latents[:8], fp8_rows(exact.latents[:8]))  # same inputs
    np.testing.assert_array_equal(head.head, fp8_rows(np.asarray(weights["lm_head.weight"], np.float64)))


def test_bf16_weights_and_shared_head_override():
    cfg = tiny()
    w32 = random_mtp_weights(cfg, 24)
    wbf = {k: (v.astype(ml_dtypes.bfloat16) if "correction_bias" not in k else v) for k, v in w32.items()}
    dr = ReferenceDrafter(cfg, wbf)
    assert dr.q_a.dtype == np.float64
    assert np.array_equal(
        dr.q_a, w32[_prefix(cfg) + "self_attn.q_a_proj.weight"].astype(ml_dtypes.bfloat16).astype(np.float64)
    )
    # The MTP block's own embedding and head win when stored (GLM-4.5 layout).
    P = _prefix(cfg)
    w = dict(w32)
    w[P + "embed_tokens.weight"] = np.zeros_like(w32["model.embed_tokens.weight"])
    w[P + "shared_head.head.weight"] = np.ones_like(w32["lm_head.weight"])
    dr = ReferenceDrafter(cfg, w)
    assert not dr.embed.any() and (dr.head == 1).all()
    del w[P + "mlp.experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match="experts.3.up_proj"):
        ReferenceDrafter(cfg, w)
    w = dict(w32)
    w[P + "eh_proj.weight"] = w32[P + "eh_proj.weight"][:, : cfg.hidden_size]
    with pytest.raises(ValueError, match="eh_proj"):
        ReferenceDrafter(cfg, w)


# (h) the RoPE family: MLA with a rope part, the per-token indexer, group-limited routing ------------


def _rope_cfg(*, yarn: bool, interleave_indexer: bool = True, n_group: int = 1, topk_group: int = 1):
    """A tiny flat GLM-5 / DeepSeek-V3.2 config (rope 8 of nope 12, indexer 3 x 24)."""
    from model.config import ModelConfig

    d = {
        "model_type": "deepseek_v32" if yarn else "glm_moe_dsa",
        "hidden_size": 40,
        "vocab_size": 53,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "num_attention_heads": 3,
        "q_lora_rank": 24,
        "kv_lora_rank": 20,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8,
        "v_head_dim": 10,
        "index_n_heads": 3,
        "index_head_dim": 24,
        "index_topk": 6,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_group": n_group,
        "topk_group": topk_group,
        "indexer_rope_interleave": interleave_indexer,
    }
    if yarn:
        d["rope_theta"] = 10000.0
        d["rope_scaling"] = {
            "type": "yarn",
            "factor": 8,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        }
    else:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": 300.0}
    return ModelConfig.from_hf_dict(d)


def _rotate_ref(x: np.ndarray, pos: int, inv_freq: np.ndarray, interleave: bool, factor: float) -> np.ndarray:
    """RoPE as a complex product: pair (a, b) -> (a + i b) * factor * e^{i pos f}."""
    x = np.asarray(x, np.float64)
    h = len(inv_freq)
    a, b = (x[0::2], x[1::2]) if interleave else (x[:h], x[h:])
    z = (a + 1j * b) * factor * np.exp(1j * pos * np.asarray(inv_freq, np.float64))
    out = np.empty_like(x)
    if interleave:
        out[0::2], out[1::2] = z.real, z.imag
    else:
        out[:h], out[h:] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_rotation_is_a_pair_rotation_and_relative(interleave):
    from tests.reference_f64 import rope_rotate

    rng = np.random.default_rng(30)
    f = np.asarray(_rope_cfg(yarn=True).rope_inv_freq, np.float64)
    q, k = rng.standard_normal(8), rng.standard_normal(8)
    for pos in (0, 1, 37, 511):
        np.testing.assert_allclose(
            rope_rotate(q, pos, f, interleave=interleave, factor=1.3),
            _rotate_ref(q, pos, f, interleave, 1.3),
            rtol=1e-13,
            atol=1e-13,
        )
    # A shift common to query and key leaves their dot product (RoPE is relative); a shift of the
    # query alone does not.
    dots = [
        rope_rotate(q, 9 + s, f, interleave=interleave) @ rope_rotate(k, 4 + s, f, interleave=interleave)
        for s in (0, 1, 100)
    ]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-12)
    assert (
        abs(
            rope_rotate(q, 10, f, interleave=interleave) @ rope_rotate(k, 4, f, interleave=interleave)
            - dots[0]
        )
        > 1e-3
    )
    with pytest.raises(ValueError, match="frequencies"):
        rope_rotate(q[:6], 1, f, interleave=interleave)


def _plain_rope_mla(dr, y: np.ndarray, rows: np.ndarray, pos: int) -> np.ndarray:
    """Plain MLA with RoPE: per-head keys [kv_b key half . latent ; rotated shared rope key], the
    query [nope ; rotated rope] from q_b's per-head rows."""
    from tests.reference_f64 import rope_rotate

    cfg, a = dr.cfg, dr.cfg.attention
    P = _prefix(cfg) + "self_attn."
    w = {k: np.asarray(v, np.float64) for k, v in dr._weights_for_test.items() if k.startswith(P)}
    nope, R, v, nh = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.num_attention_heads
    f, r = np.asarray(cfg.rope_inv_freq, np.float64), a.rope
    ql = rmsnorm(w[P + "q_a_proj.weight"] @ y, w[P + "q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (w[P + "q_b_proj.weight"] @ ql).reshape(nh, nope + R)
    kv_b = w[P + "kv_b_proj.weight"].reshape(nh, nope + v, a.kv_lora_rank)
    c = dr.latents[rows]
    k_rope = np.array(
        [
            rope_rotate(
                w[P + "kv_a_proj_with_mqa.weight"][a.kv_lora_rank :] @ dr._y[t],
                t,
                f,
                interleave=r.interleave,
                factor=r.attention_factor,
            )
            for t in rows
        ]
    )
    scale = r.softmax_mscale / math.sqrt(nope + R)
    outs = []
    for h in range(nh):
        qh = np.concatenate(
            [
                q[h, :nope],
                rope_rotate(q[h, nope:], pos, f, interleave=r.interleave, factor=r.attention_factor),
            ]
        )
        keys = np.concatenate([c @ kv_b[h, :nope].T, k_rope], axis=1)
        s = keys @ qh * scale
        p = np.exp(s - s.max())
        outs.append((p / p.sum()) @ (c @ kv_b[h, nope:].T))
    return w[P + "o_proj.weight"] @ np.concatenate(outs)


@pytest.mark.parametrize("yarn", [False, True], ids=["default", "yarn"])
def test_rope_mla_absorbed_equals_plain_and_selection_is_top_k_of_rows(yarn):
    from tests.reference_f64 import layernorm

    cfg = _rope_cfg(yarn=yarn, interleave_indexer=not yarn)
    assert cfg.dsa.per_token and cfg.dsa.rope_dim == 8 and (cfg.attention.rope.yarn is not None) == yarn
    weights = random_mtp_weights(cfg, 31)
    assert not any("index_kpool" in n for n in weights)
    dr = ReferenceDrafter(cfg, weights, fp8_cache=False)
    dr._weights_for_test = weights
    toks, hid = _rows(cfg, 14, 32)
    d = cfg.dsa
    X = _prefix(cfg) + "self_attn.indexer."
    W = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    f, r = np.asarray(cfg.rope_inv_freq, np.float64), cfg.attention.rope
    for i in range(14):
        dr.context_row(int(toks[i]), hid[i])
        n = dr.rows - 1
        y = dr._y[n]
        # Indexer: scores of rows 0..n from an explicit formula; the top index_topk, lower row on a tie.
        ql = dr.q_latent(y)
        keys = []
        for t in range(n + 1):
            k = layernorm(W[X + "wk.weight"] @ dr._y[t], W[X + "k_norm.weight"], W[X + "k_norm.bias"])
            keys.append(
                np.concatenate([_rotate_ref(k[:8], t, f, r.indexer_interleave, r.attention_factor), k[8:]])
            )
        qi = (W[X + "wq_b.weight"] @ ql).reshape(d.index_n_heads, d.index_head_dim)
        qi = np.array(
            [
                np.concatenate([_rotate_ref(q[:8], n, f, r.indexer_interleave, r.attention_factor), q[8:]])
                for q in qi
            ]
        )
        wts = W[X + "weights_proj.weight"] @ y / math.sqrt(d.index_n_heads)
        score = wts @ np.maximum(qi @ np.array(keys).T, 0) / math.sqrt(d.index_head_dim)
        want = sorted(np.lexsort((np.arange(n + 1), -score))[: d.index_topk].tolist())
        sel = dr.selection(n)
        assert sel.tolist() == want, n
        if n + 1 <= d.index_topk:  # dense: every row, the indexer's scores aside
            assert sel.tolist() == list(range(n + 1))
        # MLA over the selection, absorbed against plain.
        np.testing.assert_allclose(
            dr.attention(y, sel), _plain_rope_mla(dr, y, sel, n), rtol=1e-11, atol=1e-12
        )
    assert dr.rope_keys.shape == (14, 8) and dr.gates.shape == (0, d.index_head_dim)
    assert dr.pool_keys.shape == (14, d.index_head_dim)


def test_rope_family_fp8_cache_and_rewind():
    cfg = _rope_cfg(yarn=True, n_group=4, topk_group=2)
    weights = random_mtp_weights(cfg, 33)
    toks, hid = _rows(cfg, 16, 34)
    exact = ReferenceDrafter(cfg, weights, fp8_cache=False)
    dr = ReferenceDrafter(cfg, weights, fp8_cache=True)
    exact.feed(toks[:10], hid[:10])
    dr.feed(toks[:10], hid[:10])
    # Stored: FP8 indexer keys with one scale per row, BF16 rope keys, FP8 latents.
    np.testing.assert_array_equal(dr.pool_keys, fp8_rows(exact.pool_keys))
    np.testing.assert_array_equal(
        dr.rope_keys, exact.rope_keys.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    )
    assert not np.array_equal(dr.rope_keys, exact.rope_keys)
    want_state = dr.state()
    want = dr.propose(int(toks[10]), hid[10], 3)
    dr.feed(toks[13:16], hid[13:16])
    got = dr.propose(int(toks[10]), hid[10], 3, position=10)
    assert got[0] == want[0] and np.array_equal(got[1], want[1])
    dr.rewind_to(10)
    for key, val in dr.state().items():
        assert np.array_equal(val, want_state[key]), key


def test_group_limited_routing_and_no_clamp():
    cfg = _rope_cfg(yarn=True, n_group=4, topk_group=2)
    assert math.isinf(cfg.moe.swiglu_limit)
    weights = random_mtp_weights(cfg, 35)
    M = _prefix(cfg) + "mlp."
    H = cfg.hidden_size
    # Biased scores by group of two: group 0 holds the single best expert, but groups 1 and 3 have
    # the best sums of two; the top-2 comes from those groups only.
    choice = np.array([0.95, 0.05, 0.7, 0.6, 0.3, 0.2, 0.8, 0.55])
    logit = np.log(choice / (1 - choice))
    gate = np.zeros((8, H), np.float32)
    gate[:, 0] = logit
    weights[M + "gate.weight"] = gate
    weights[M + "gate.e_score_correction_bias"] = np.zeros(8, np.float32)
    dr = ReferenceDrafter(cfg, weights)
    y2 = np.zeros(H)
    y2[0] = 1.0
    chosen, w = dr.route(y2)
    s = 1 / (1 + np.exp(-gate[:, 0].astype(np.float64)))
    assert chosen == [6, 2]  # groups 1 (0.7 + 0.6) and 3 (0.8 + 0.55) beat group 0 (0.95 + 0.05)
    sf = cfg.moe.routed_scaling_factor
    np.testing.assert_allclose(w, s[[6, 2]] / s[[6, 2]].sum() * sf, rtol=1e-14)
    # One group (no limit) takes the best experts over all.
    flat = ReferenceDrafter(_rope_cfg(yarn=True), weights)
    assert flat.route(y2)[0] == [0, 6]
    # Infinite swiglu_limit: no clamp at all.
    from tests.reference_f64 import clamped_swiglu

    y = np.full(H, 40.0)
    g_w, u_w, d_w = dr.experts[0]
    assert np.abs(g_w @ y).max() > 10
    np.testing.assert_allclose(
        clamped_swiglu(y, g_w, u_w, d_w, cfg.moe.swiglu_limit),
        d_w @ ((g_w @ y) / (1 + np.exp(-(g_w @ y))) * (u_w @ y)),
        rtol=1e-12,
    )
