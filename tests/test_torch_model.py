"""CPU tests of the PyTorch implementation under train/ (skipped where PyTorch is missing; CI has
none). The model is a tiny random config of the family; nothing here needs a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from model.corpus import is_heldout, sample_positions

try:
    import torch

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (train/ only)")

if HAVE_TORCH:
    from train.torch_model import (
        RunOpts,
        TorchModel,
        fp8_rows,
        hf_tensors,
        import_config_module,
        init_weights,
        load_model,
        mtp_rows,
        save_checkpoint,
        selection_mask,
        selection_width,
        slice_state,
        training_losses,
        update_routing_bias,
    )


def _cfg(**kw):
    from model.config import tiny

    base = dict(index_topk=8, index_kpool=2)
    base.update(kw)
    return tiny(**base)


def _model(cfg, seed=1, std=0.2, dtype=None):
    m = TorchModel(cfg)
    init_weights(m, std=std, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for moe in m.moe_layers():
        moe.gate.e_score_correction_bias.copy_(0.05 * torch.randn(moe.cfg.n_routed_experts, generator=g))
    if dtype is not None:
        m = m.to(dtype)
    return m.eval()


# ---- protocol helpers (no torch) ---------------------------------------------------------------


def test_sample_positions_protocol():
    files = [("b.py", 100), ("a.py", 60), ("c.py", 10)]
    s = sample_positions(files, start=16, stride=37, max_t=80, n_samples=None)
    assert s == [("a.py", 16), ("a.py", 53), ("b.py", 16), ("b.py", 53)]
    assert sample_positions(files, n_samples=3, max_t=80) == s[:3]
    # (relpath, bytes) pairs give the same samples; t < len(file) always.
    s2 = sample_positions([("a.py", b"x" * 54)], n_samples=None)
    assert s2 == [("a.py", 16), ("a.py", 53)]


def test_heldout_is_a_function_of_the_path():
    assert is_heldout("asyncio/events.py") == is_heldout("asyncio/events.py")
    frac = np.mean([is_heldout(f"pkg/mod{i}.py") for i in range(5000)])
    assert 0.01 < frac < 0.03


# ---- names, shapes, dtypes ---------------------------------------------------------------------


@needs_torch
def test_state_dict_names_match_the_checkpoint_layout():
    from model.weights_layout import mtp_layout, target_layout

    cfg = _cfg()
    m = TorchModel(cfg)
    tensors = hf_tensors(m)
    want = {**target_layout(cfg), **mtp_layout(cfg)}
    assert set(tensors) == set(want)
    for name, spec in want.items():
        assert tuple(tensors[name].shape) == spec.shape, name
        assert tensors[name].dtype == (torch.float32 if spec.dtype == "F32" else torch.bfloat16), name
    P = f"model.layers.{cfg.num_hidden_layers}."
    assert P + "self_attn.indexer.index_kpool_compress_ape" in tensors
    assert not any("shared_expert_gate" in n for n in tensors)


@needs_torch
def test_checkpoint_round_trip(tmp_path):
    pytest.importorskip("safetensors")
    cfg = _cfg()
    m = _model(cfg)
    files = save_checkpoint(m, tmp_path)
    assert "model.safetensors.index.json" in files
    back = load_model(tmp_path)
    a, b = hf_tensors(m), hf_tensors(back)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert back.cfg == import_config_module().ModelConfig.from_json(tmp_path)


# ---- FP8 rows ----------------------------------------------------------------------------------


@needs_torch
def test_fp8_rows_matches_ml_dtypes_and_saturates():
    import ml_dtypes

    rng = np.random.default_rng(0)
    x = (
        rng.standard_normal((7, 33)).astype(np.float32)
        * np.array([1e-3, 1, 50, 1e3, 1, 1, 1], np.float32)[:, None]
    )
    x[5] = 0.0
    got = fp8_rows(torch.from_numpy(x)).numpy()
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    q = np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, q * scale)
    assert np.all(got[5] == 0)
    assert np.all(np.abs(got).max(-1) <= amax[:, 0] * (1 + 1e-6))


# ---- selection ---------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("kpool,topk", [(2, 8), (4, 8), (3, 9)])
def test_selection_size_and_top_pools(kpool, topk):
    cfg = _cfg(index_topk=topk, index_kpool=kpool)
    m = _model(cfg)
    T = 41
    toks = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = m.target(toks, opts=RunOpts(record=True, moe_dense=False))
        m.mtp(*mtp_rows(toks, out.hidden), opts=RunOpts(record=True, moe_dense=False))
    K = topk // kpool
    for layer in m.model.layers:
        rec = layer.self_attn.last
        allowed, ps = rec["allowed"], rec["pool_scores"]
        n_rows = allowed.shape[-1]
        for b in range(2):
            for n in range(n_rows):
                row = allowed[b, n]
                assert int(row.sum()) == selection_width(n, topk, kpool), (n, kpool, topk)
                assert not bool(row[n + 1 :].any())  # causal
                ncomp = (n + 1) // kpool
                tail = list(range(ncomp * kpool, n + 1))
                assert all(bool(row[j]) for j in tail)  # the tail always
                if ncomp <= K:
                    assert bool(row[: n + 1].all())  # dense
                    continue
                sc = ps[b, n, :ncomp].tolist()
                want = sorted(sorted(range(ncomp), key=lambda p: (-sc[p], p))[:K])
                got = sorted({j // kpool for j in torch.nonzero(row).flatten().tolist() if j < ncomp * kpool})
                assert got == want


@needs_torch
def test_selection_ties_go_to_the_lower_pool():
    scores = torch.zeros(1, 1, 6)  # every pool ties (relu(...) == 0 is common in practice)
    scores[0, 0, 4] = 1.0
    mask = selection_mask(scores, torch.tensor([12]), 13, topk_pools=3, kpool=2)
    rows = torch.nonzero(mask[0, 0]).flatten().tolist()
    # pools 4 (highest), then 0 and 1 (ties, lower index first), then the tail row 12.
    assert [r for r in rows if r <= 12] == [0, 1, 2, 3, 8, 9, 12]


@needs_torch
def test_moe_routing_ties_and_dense_equals_loop():
    cfg = _cfg()
    m = _model(cfg, dtype=torch.float64)
    moe = m.moe_layers()[0]
    with torch.no_grad():
        moe.gate.weight.zero_()  # every score 0.5: ties everywhere
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[5] = 0.1
        y = torch.randn(3, cfg.hidden_size, dtype=torch.float64)
        idx, w = moe.route(y)
        assert idx.tolist() == [[5, 0]] * 3
        assert torch.allclose(w, torch.full_like(w, cfg.moe.routed_scaling_factor / 2))
        init_weights(m, std=0.2, seed=3)
        y = torch.randn(2, 5, cfg.hidden_size, dtype=torch.float64)
        a = moe(y, RunOpts(moe_dense=True))
        b = moe(y, RunOpts(moe_dense=False))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- rows, incremental decoding, rewind --------------------------------------------------------


@needs_torch
def test_mtp_row_semantics():
    cfg = _cfg()
    m = _model(cfg, dtype=torch.float64)
    T = 12
    toks = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = m.target(toks)
        rt, rh = mtp_rows(toks, out.hidden)
        # Row r pairs token r+1 with hidden r.
        assert torch.equal(rt, toks[:, 1:]) and torch.equal(rh, out.hidden[:, :-1])
        full = m.mtp(rt, rh)
        # Row 0 alone: eh_proj([rmsnorm(embed[t1]) * enorm ; rmsnorm(h0) * hnorm]) -> block -> head.
        L = m.mtp_layer
        e = m.model.embed_tokens.weight[toks[0, 1]]
        h = out.hidden[0, 0]

        def rn(v, w):
            return v / torch.sqrt((v * v).mean() + cfg.rms_norm_eps) * w

        x = L.eh_proj.weight @ torch.cat([rn(e, L.enorm.weight), rn(h, L.hnorm.weight)])
        x1, _, _ = L.block(x[None, None], None, RunOpts())
        torch.testing.assert_close(full.hidden[0, 0], rn(x1[0, 0], L.shared_head.norm.weight))
        # The target's hidden is post-norm: the head of the target applies no further norm.
        torch.testing.assert_close(out.logits, out.hidden @ m.lm_head.weight.T)
    # The loss pairs drafter row r with token r+2.
    losses = training_losses(m, toks, RunOpts())
    want = torch.nn.functional.cross_entropy(full.logits[0, :-1], toks[0, 2:])
    torch.testing.assert_close(losses["mtp_ce"].detach(), want)


@needs_torch
@pytest.mark.parametrize("fp8", [False, True])
def test_incremental_equals_full_and_rewind_is_exact(fp8):
    cfg = _cfg(index_topk=8, index_kpool=4)
    m = _model(cfg)
    T = 45
    toks = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(4))
    opts = RunOpts(fp8=fp8, moe_dense=False)
    with torch.no_grad():
        full = m.target(toks, opts=opts)
        st, hs = None, []
        for a, b in [(0, 1), (1, 7), (7, 30), (30, 45)]:
            r = m.target(toks[:, a:b], st, opts)
            st = r.state
            hs.append(r.hidden)
        torch.testing.assert_close(torch.cat(hs, 1), full.hidden, rtol=1e-4, atol=1e-4)

        # Rewind to a row that cuts a pool open (22 = 5 pools + 2 rows), advance on other tokens,
        # rewind again and re-feed: bitwise equal to the state that never advanced.
        base = slice_state(full.state, 22)
        ref = m.target(toks[:, 22:30], base, opts)
        other = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
        detour = m.target(other, base, opts)
        assert state_len(detour.state) == 31
        again = m.target(toks[:, 22:30], slice_state(detour.state, 22), opts)
        assert torch.equal(again.hidden, ref.hidden) and torch.equal(again.logits, ref.logits)
        for x, y in zip(again.state, ref.state):
            for k in x:
                assert torch.equal(x[k], y[k])
        # The drafter too.
        d_full = m.mtp(*mtp_rows(toks, full.hidden), opts=opts)
        d1 = m.mtp(toks[:, 23:26], full.hidden[:, 22:25], slice_state(d_full.state, 22), opts)
        d2 = m.mtp(
            toks[:, 23:26],
            full.hidden[:, 22:25],
            slice_state(
                m.mtp(toks[:, 23:35], full.hidden[:, 22:34], slice_state(d_full.state, 22), opts).state, 22
            ),
            opts,
        )
        assert torch.equal(d1.hidden, d2.hidden)


def state_len(state):
    return int(state[0]["c"].shape[1])


# ---- agreement with other implementations ------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("fp8", [False, True])
def test_drafter_matches_the_float64_reference(fp8):
    ref_mod = pytest.importorskip("tests.reference_f64")
    cfg = _cfg()
    m = _model(cfg, dtype=torch.float64)
    w = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    ref = ref_mod.ReferenceDrafter(cfg, w, fp8_cache=fp8)
    g = torch.Generator().manual_seed(0)
    T, ctx = 30, 21
    toks = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    hid = torch.randn(1, T, cfg.hidden_size, dtype=torch.float64, generator=g)
    ref.feed(toks[0, :ctx].tolist(), hid[0, :ctx].numpy())
    drafts, logits, _ = ref.propose(int(toks[0, ctx]), hid[0, ctx].numpy(), 3)
    opts = RunOpts(fp8=fp8, moe_dense=False)
    with torch.no_grad():
        st = m.mtp(toks[:, :ctx], hid[:, :ctx], opts=opts).state
        tok, h = toks[:, ctx : ctx + 1], hid[:, ctx : ctx + 1]
        mine, mlog = [], []
        for _ in range(3):
            r = m.mtp(tok, h, st, opts)
            st, h = r.state, r.hidden
            tok = r.logits[:, -1].argmax(-1, keepdim=True)
            mine.append(int(tok))
            mlog.append(r.logits[0, -1].numpy())
    assert mine == drafts
    np.testing.assert_allclose(np.array(mlog), logits, rtol=1e-9, atol=1e-9)


@needs_torch
def test_bench_step_matches_the_model():
    from bench.torch_step import DraftStep, weights_from_state_dict

    cfg = _cfg()
    m = _model(cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    T, ctx = 30, 21
    toks = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    hid = torch.randn(1, T, cfg.hidden_size, dtype=torch.float64, generator=g)
    opts = RunOpts(moe_dense=False)
    with torch.no_grad():
        st = m.mtp(toks[:, :ctx], hid[:, :ctx], opts=opts).state
        ds = DraftStep(
            cfg,
            rows=64,
            device="cpu",
            dtype=torch.float64,
            weights=weights_from_state_dict(cfg, m.state_dict(), dtype=torch.float64),
        )
        ds.latents[:ctx], ds.keys[:ctx], ds.gates[:ctx] = st[0]["c"][0], st[0]["k"][0], st[0]["g"][0]
        ix = m.mtp_layer.self_attn.indexer
        P = ctx // cfg.dsa.index_kpool
        ds.pool_keys[:P] = ix.pool_keys(st[0]["k"], st[0]["g"], False)[0]
        ds.tok_in[0] = toks[0, ctx]
        ds.hid_in.copy_(hid[0, ctx])
        got = ds.propose(ctx, 3).tolist()
        tok, h, want = toks[:, ctx : ctx + 1], hid[:, ctx : ctx + 1], []
        for _ in range(3):
            r = m.mtp(tok, h, st, opts)
            st, h = r.state, r.hidden
            tok = r.logits[:, -1].argmax(-1, keepdim=True)
            want.append(int(tok))
    assert got == want
    torch.testing.assert_close(ds.last_hidden, h[0, 0], rtol=1e-10, atol=1e-10)


@needs_torch
def test_acceptance_eval_matches_brute_force():
    from train.eval_acceptance import evaluate

    cfg = _cfg(vocab_size=256)
    m = _model(cfg, std=0.1)
    rng = np.random.default_rng(0)
    files = {
        "a.py": bytes(rng.integers(97, 105, 90).tolist()),
        "b.py": bytes(rng.integers(97, 100, 60).tolist()),
    }
    samples = sample_positions(files.items(), start=16, stride=11, max_t=80, n_samples=None)
    k = 3
    res = evaluate(m, samples, files, k=k, fp8="all", progress=False)
    opts = RunOpts(fp8=True, moe_dense=False)
    with torch.no_grad():
        for rec in res["records"]:
            data = list(files[rec["file"]])
            t = rec["t"]
            seq = data[: t + 1]
            g = []
            for _ in range(k + 1):  # target greedy by full recomputation
                out = m.target(torch.tensor([seq]), opts=opts)
                g.append(int(out.logits[0, -1].argmax()))
                seq.append(g[-1])
            h = m.target(torch.tensor([data[: t + 1]]), opts=opts).hidden
            # drafter by full recomputation of the row sequence
            rows_t = data[1 : t + 1] + [g[0]]
            rows_h = h[0]
            drafts = []
            for _i in range(k):
                o = m.mtp(torch.tensor([rows_t]), rows_h[None], opts=opts)
                d = int(o.logits[0, -1].argmax())
                drafts.append(d)
                rows_t = rows_t + [d]
                rows_h = torch.cat([rows_h, o.hidden[0, -1:]], 0)
            assert rec["drafts"] == drafts
            n_acc = 0
            while n_acc < k and drafts[n_acc] == g[n_acc + 1]:
                n_acc += 1
            assert rec["accepted"] == n_acc
            assert rec["g"] == g[: len(rec["g"])]
    assert res["reached"][0] == len(samples)


# ---- training ----------------------------------------------------------------------------------


@needs_torch
def test_short_training_reduces_the_loss():
    cfg = _cfg(vocab_size=32)
    torch.manual_seed(0)
    m = TorchModel(cfg)
    init_weights(m, seed=0)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    pattern = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 4)
    first = last = None
    for step in range(40):
        off = step % 20
        x = torch.stack([pattern[off : off + 48], pattern[(off + 7) % 20 : (off + 7) % 20 + 48]])
        losses = training_losses(m, x, RunOpts(sparse=step >= 10, kl=True))
        loss = losses["target_ce"] + 0.5 * losses["mtp_ce"] + losses["indexer_kl"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_routing_bias(m, 1e-3)
        if first is None:
            first = {k: float(v.detach()) for k, v in losses.items()}
        last = {k: float(v.detach()) for k, v in losses.items()}
    assert last["target_ce"] < 0.5 * first["target_ce"]
    assert last["mtp_ce"] < 0.5 * first["mtp_ce"]
    assert math.isfinite(last["indexer_kl"])
    biases = [moe.gate.e_score_correction_bias for moe in m.moe_layers()]
    assert all(b.dtype == torch.float32 for b in biases) and any(bool(b.abs().sum() > 0) for b in biases)


# ---- the unrolled MTP objective and the published layout ---------------------------------------


def _unrolled(m, toks, hid, opts, depth):
    """Depth 1 .. depth outputs of every base row with true tokens (what mtp_losses trains)."""
    t_rows, h_rows = mtp_rows(toks, hid)
    import dataclasses

    mo = m.mtp(t_rows, h_rows, opts=dataclasses.replace(opts, record=True))
    base_c, allowed = mo.state[0]["c"], m.mtp_layer.self_attn.last["allowed"]
    outs, logits, prev_c, prev = [mo.hidden], [mo.logits], [], mo.hidden
    T = toks.shape[1]
    for j in range(2, depth + 1):
        o, lg, c = m.mtp_unrolled(toks[:, j:], prev[:, : T - j], base_c, allowed, prev_c, opts)
        outs.append(o)
        logits.append(lg)
        prev, prev_c = o, [*prev_c, c]
    return mo, outs, logits


@needs_torch
def test_unrolled_drafts_equal_drafting_one_row_at_a_time_when_dense():
    """Dense attention: draft j of base row r, all rows at once, equals the drafter's incremental
    step over rows 0..r plus the drafts before it (true tokens: the drafts that were accepted)."""
    cfg = _cfg(index_topk=64, index_kpool=2)  # 32 pools: dense at these lengths
    m = _model(cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    T = 24
    toks = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    hid = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64, generator=g)
    opts = RunOpts(sparse=False, moe_dense=False)
    with torch.no_grad():
        mo, outs, logits = _unrolled(m, toks, hid, opts, 3)
        for r in (0, 5, 17, T - 4):
            st = slice_state(mo.state, r + 1)
            h = outs[0][:, r : r + 1]
            for j in (2, 3):
                step = m.mtp(toks[:, r + j : r + j + 1], h, st, opts)
                torch.testing.assert_close(step.logits[:, 0], logits[j - 1][:, r], rtol=1e-10, atol=1e-10)
                st, h = step.state, step.hidden


@needs_torch
def test_unrolled_drafts_equal_the_shared_selection_of_the_float64_reference():
    """Sparse attention: draft j attends draft 1's selection plus the rows drafted since, the
    reference's index_share_for_mtp_iteration semantics."""
    import dataclasses

    ref_mod = pytest.importorskip("tests.reference_f64")
    cfg = _cfg(index_topk=4, index_kpool=2)  # 2 pools selected: sparse from row 5
    m = _model(cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    T = 30
    toks = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    hid = torch.randn(1, T, cfg.hidden_size, dtype=torch.float64, generator=g)
    with torch.no_grad():
        _, outs, logits = _unrolled(m, toks, hid, RunOpts(sparse=True, moe_dense=False), 3)
    w = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    share = dataclasses.replace(cfg, dsa=dataclasses.replace(cfg.dsa, share_for_mtp_iteration=True))
    for r in (9, 16, 23):
        ref = ref_mod.ReferenceDrafter(share, w, fp8_cache=False)
        ref.feed(toks[0, 1 : r + 1].tolist(), hid[0, :r].numpy())
        lg, xn = ref.draft_row(int(toks[0, r + 1]), hid[0, r].numpy())
        first = ref.selection(r)
        for j in (2, 3):
            lg, xn = ref.draft_row(int(toks[0, r + j]), xn, ref.shared_selection(first, r, r + j - 1))
            np.testing.assert_allclose(logits[j - 1][0, r].numpy(), lg, rtol=1e-9, atol=1e-9)


@needs_torch
def test_unrolled_training_lowers_every_depth():
    cfg = _cfg(vocab_size=32)
    torch.manual_seed(0)
    m = TorchModel(cfg)
    init_weights(m, seed=0)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    pattern = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 4)
    first = last = None
    for step in range(40):
        off = step % 20
        x = torch.stack([pattern[off : off + 48], pattern[(off + 7) % 20 : (off + 7) % 20 + 48]])
        losses = training_losses(m, x, RunOpts(sparse=step >= 10, kl=True), unroll=3)
        assert set(losses) == {"target_ce", "mtp_ce", "mtp_ce_2", "mtp_ce_3", "indexer_kl"}
        loss = (
            losses["target_ce"]
            + 0.5 * losses["mtp_ce"]
            + losses["indexer_kl"]
            + 0.25 * (losses["mtp_ce_2"] + losses["mtp_ce_3"])
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_routing_bias(m, 1e-3)
        if first is None:
            first = {k: float(v.detach()) for k, v in losses.items()}
        last = {k: float(v.detach()) for k, v in losses.items()}
    for k in ("mtp_ce", "mtp_ce_2", "mtp_ce_3"):
        assert last[k] < 0.7 * first[k], (k, first[k], last[k])


@needs_torch
def test_published_layout_round_trip_and_the_runtime_reads_it(tmp_path):
    pytest.importorskip("safetensors")
    import json

    from model.checkpoint import Checkpoint, mtp_tensors

    cfg = _cfg()
    m = _model(cfg)
    save_checkpoint(m, tmp_path, published=True)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["model_type"] == "glm5_next" and "text_config" in conf
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in index)
    mtp_shard = {f for n, f in index.items() if ".layers.2." in n}
    assert mtp_shard == {"model-00002-of-00002.safetensors"}
    back = load_model(tmp_path)
    a, b = hf_tensors(m), hf_tensors(back)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ckpt = Checkpoint(tmp_path)
    assert ckpt.config == cfg and len(mtp_tensors(ckpt)) > 0


@needs_torch
def test_bench_step_shares_the_selection_as_the_runtime_does():
    """bench/torch_step.py with index_share_for_mtp_iteration (GLM-5.3-Flash's setting): its
    drafts are the float64 reference's sharing drafts."""
    import dataclasses

    from bench.torch_step import DraftStep, weights_from_state_dict

    ref_mod = pytest.importorskip("tests.reference_f64")
    base = _cfg(index_topk=4, index_kpool=2)
    cfg = dataclasses.replace(base, dsa=dataclasses.replace(base.dsa, share_for_mtp_iteration=True))
    m = _model(base, dtype=torch.float64)  # TorchModel re-selects: it only fills the caches here
    w = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    T, ctx = 40, 29
    toks = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    hid = torch.randn(1, T, cfg.hidden_size, dtype=torch.float64, generator=g)
    ref = ref_mod.ReferenceDrafter(cfg, w, fp8_cache=False)
    ref.feed(toks[0, :ctx].tolist(), hid[0, :ctx].numpy())
    want, _, hiddens = ref.propose(int(toks[0, ctx]), hid[0, ctx].numpy(), 3)
    with torch.no_grad():
        st = m.mtp(toks[:, :ctx], hid[:, :ctx], opts=RunOpts(moe_dense=False)).state
        ds = DraftStep(
            cfg,
            rows=64,
            device="cpu",
            dtype=torch.float64,
            weights=weights_from_state_dict(cfg, m.state_dict(), dtype=torch.float64),
        )
        ds.latents[:ctx], ds.keys[:ctx], ds.gates[:ctx] = st[0]["c"][0], st[0]["k"][0], st[0]["g"][0]
        P = ctx // cfg.dsa.index_kpool
        ds.pool_keys[:P] = m.mtp_layer.self_attn.indexer.pool_keys(st[0]["k"], st[0]["g"], False)[0]
        ds.tok_in[0] = toks[0, ctx]
        ds.hid_in.copy_(hid[0, ctx])
        got = ds.propose(ctx, 3).tolist()
    assert got == want
    np.testing.assert_allclose(ds.last_hidden.numpy(), hiddens[-1], rtol=1e-9, atol=1e-9)
