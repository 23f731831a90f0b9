"""bench/torch_step.py's batched step (BatchDraftStep) on the CPU at a tiny config: each sequence's
drafts, last hidden and cache rows equal what the batch-1 step (DraftStep) gives for that sequence
alone, on the same weights and the same caches. Skipped where PyTorch (with torch._grouped_mm) is
missing; the GPU timing runs the same code at GLM-5.3-Flash shapes.

The FP8-experts variant (``torch._scaled_grouped_mm``, CUDA only) is checked here in its parts: the
per-row quantiser and the FP8 expert stacks bit for bit against NumPy / ml_dtypes, the grouped
layout against a direct construction, the exact call at GLM-5.3-Flash shapes against PyTorch's own
operand checks (its meta kernel), and the MoE and the whole propose through a CPU emulation of the
op (its semantics and operand checks as PyTorch's source states them) against a float64 reference
and the BF16 step."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this PyTorch has no torch._grouped_mm", allow_module_level=True)

import numpy as np  # noqa: E402 - after the skip

from bench.torch_step import (  # noqa: E402 - after the skip
    FP8_GROUP_ALIGN,
    BatchDraftStep,
    DraftStep,
    Fp8GroupedMmUnavailable,
    check_fp8_grouped_device,
    check_fp8_grouped_shapes,
    fp8_expert_weights,
    fp8_group_layout,
    fp8_group_rows,
    quantize_rows_fp8,
    scaled_grouped_mm_fp8,
    scatter_rows_fp8,
)
from model.config import glm5_flash, tiny  # noqa: E402 - after the skip

ROWS = 48


def _cfg(share: bool):
    base = tiny(index_topk=8, index_kpool=2, max_context=64)
    return dataclasses.replace(base, dsa=dataclasses.replace(base.dsa, share_for_mtp_iteration=share))


def _steps(cfg, batch: int, seed: int = 3):
    # float32: torch._grouped_mm has no float64 kernel; ties in the argmaxes are then negligible.
    base = DraftStep(cfg, rows=ROWS, device="cpu", dtype=torch.float32, seed=seed)
    # Norm weights and biases away from their 1 / 0 defaults, so a mixed-up one shows.
    g = torch.Generator().manual_seed(seed + 1)
    for name in ("enorm", "hnorm", "in_norm", "post_norm", "head_norm", "q_a_norm", "kv_a_norm", "ix_ln_w"):
        base.W[name].mul_(1 + 0.2 * torch.randn(base.W[name].shape, generator=g))
    for name in ("ix_ln_b", "ix_ape", "router_bias"):
        base.W[name].add_(0.1 * torch.randn(base.W[name].shape, generator=g))
    return base, BatchDraftStep(base, batch, ROWS, seed=seed + 2)


def _alone(cfg, base, bs, b, ctx, k):
    """Sequence b of the batch drafted alone by the batch-1 step (its caches copied over)."""
    one = DraftStep(cfg, rows=ROWS, device="cpu", dtype=torch.float32, weights=base.W)
    one.latents.copy_(bs.latents[b])
    one.keys.copy_(bs.keys[b])
    one.gates.copy_(bs.gates[b])
    one.pool_keys.copy_(bs.pool_keys[b, : one.pool_keys.shape[0]])
    one.tok_in[0] = bs.tok_in[b]
    one.hid_in.copy_(bs.hid_in[b])
    drafts = one.propose(ctx, k).tolist()
    return one, drafts


@pytest.mark.parametrize("share", [False, True])
def test_batched_drafts_are_each_sequences_batch1_drafts(share):
    # Contexts mixing every branch of the selection: no complete pool yet (0), every row while at
    # most top-k pools (3, 8: draft 2 crosses to the indexer), indexed (9, 21, 30), pools completing
    # on some drafts and not others; a duplicate context with different contents.
    contexts = [3, 21, 8, 0, 30, 9, 21]
    k = 3
    cfg = _cfg(share)
    base, bs = _steps(cfg, len(contexts))
    g = torch.Generator().manual_seed(9)
    bs.tok_in.copy_(torch.randint(0, cfg.vocab_size, (len(contexts),), generator=g))
    alone = [_alone(cfg, base, bs, b, c, k) for b, c in enumerate(contexts)]
    with torch.no_grad():
        got = bs.propose(contexts, k).tolist()
    want = [d for _, d in alone]
    assert got == want
    # The drafts are not all alike: the check would pass on a step that ignores its inputs otherwise.
    assert len({tuple(d) for d in got}) > 2
    for b, (one, _) in enumerate(alone):
        tol = dict(rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(bs.last_hidden[b], one.last_hidden, **tol)
        # The rows the propose wrote, and the pools it completed, as the batch-1 step wrote them.
        torch.testing.assert_close(bs.latents[b], one.latents, **tol)
        torch.testing.assert_close(bs.keys[b], one.keys, **tol)
        torch.testing.assert_close(bs.gates[b], one.gates, **tol)
        torch.testing.assert_close(bs.pool_keys[b, : one.pool_keys.shape[0]], one.pool_keys, **tol)


def test_batched_step_records_the_experts_it_chose():
    cfg = _cfg(True)
    base, bs = _steps(cfg, 4)
    with torch.no_grad():
        bs.propose([5, 17, 30, 11], 2)
    ids = bs.expert_ids[:2]
    m = cfg.moe
    assert ids.shape == (2, 4, m.num_experts_per_tok)
    assert bool(((ids >= 0) & (ids < m.n_routed_experts)).all())
    # Each row's top-k experts are distinct, so a draft chose at least top_k of them.
    assert all(len(set(r)) == m.num_experts_per_tok for r in ids.reshape(-1, m.num_experts_per_tok).tolist())
    assert bs.distinct_experts(2) == [len(set(ids[i].reshape(-1).tolist())) for i in range(2)]


def test_batched_step_refuses_contexts_past_its_caches():
    cfg = _cfg(False)
    _, bs = _steps(cfg, 2)
    with pytest.raises(ValueError, match="outrun"):
        bs.propose([3, ROWS - 2], 3)
    with pytest.raises(ValueError, match="contexts for a batch"):
        bs.propose([3], 1)


# ---- FP8 experts ---------------------------------------------------------------------------------


def _ml_dtypes():
    return pytest.importorskip("ml_dtypes")


def _np_quantize_rows(x):
    """The per-row FP8 quantiser written directly: f32 scale max|row| / 448 (at least 1e-12 / 448),
    x / scale saturated to +-448 and rounded to nearest even by ml_dtypes."""
    mld = _ml_dtypes()
    x = np.asarray(x, np.float32)
    scale = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-12)) / np.float32(448.0)
    q = np.clip(x / scale, np.float32(-448.0), np.float32(448.0)).astype(mld.float8_e4m3fn)
    return q, scale[..., 0]


def _bytes(q: torch.Tensor) -> np.ndarray:
    return q.contiguous().view(torch.uint8).numpy()


def _fp8_cfg(share: bool = True):
    """The tiny config with an intermediate size torch._scaled_grouped_mm takes (K, N % 16 == 0)."""
    base = _cfg(share)
    return dataclasses.replace(base, moe=dataclasses.replace(base.moe, moe_intermediate_size=32))


def _emulated_scaled_grouped_mm(a, scale_a, w_t, scale_w, offs):
    """torch._scaled_grouped_mm, rowwise 2d x 3d, on the CPU: its operand checks (PyTorch's
    GroupedBlas.cpp / GroupedMMUtils.h / ScaledGroupMM.cu) plus this step's 16-row segments, and
    out[r] = (a[r] @ w_t[g]) * scale_a[r] * scale_w[g] in BF16 for the rows r of group g. Rows past
    offs[-1] are NaN: the op leaves them unwritten, so a caller reading them shows."""
    f8 = torch.float8_e4m3fn
    assert a.dtype == f8 and w_t.dtype == f8 and a.dim() == 2 and w_t.dim() == 3
    (M, K), (G, K2, N) = a.shape, w_t.shape
    assert K == K2 and K % 16 == 0 and N % 16 == 0
    assert a.stride(1) == 1 and a.stride(0) >= K and a.stride(0) % 16 == 0  # row-major
    assert w_t.stride(1) == 1 and w_t.stride(2) >= K and w_t.stride(2) % 16 == 0  # column-major
    assert scale_a.dtype == torch.float32 and scale_w.dtype == torch.float32
    assert tuple(scale_a.shape) == (M,) and scale_a.is_contiguous()
    assert tuple(scale_w.shape) == (G, N) and scale_w.stride(1) == 1
    assert offs.dtype == torch.int32 and tuple(offs.shape) == (G,) and G < 1024
    ends = offs.tolist()
    assert all(0 <= s <= e for s, e in zip([0] + ends, ends)) and ends[-1] <= M
    assert all(e % FP8_GROUP_ALIGN == 0 for e in ends)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            acc = a[start:end].float() @ w_t[g].float()
            out[start:end] = (acc * scale_a[start:end, None] * scale_w[g][None]).to(torch.bfloat16)
        start = end
    return out


def _random_idx(g: torch.Generator, B: int, E: int, tk: int) -> torch.Tensor:
    """Each row's top_k distinct experts, in random order."""
    return torch.stack([torch.randperm(E, generator=g)[:tk] for _ in range(B)])


def test_quantize_rows_fp8_is_the_direct_formula():
    g = torch.Generator().manual_seed(11)
    # Awkward width, rows spanning 1e-4 .. 1e4, a zero row, an outlier row, a row of one sign.
    x = torch.randn(7, 48, generator=g) * torch.logspace(-4, 4, 7)[:, None]
    x[2] = 0.0
    x[4, 5] = 3e4
    x[5] = x[5].abs()
    for xin in (x, x.to(torch.bfloat16)):
        q, scale = quantize_rows_fp8(xin)
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert q.shape == xin.shape and scale.shape == xin.shape[:1]
        qn, sn = _np_quantize_rows(xin.float().numpy())
        np.testing.assert_array_equal(_bytes(q), qn.view(np.uint8))
        np.testing.assert_array_equal(scale.numpy(), sn)
        # Each row's largest magnitude lands on +-448 exactly; the zero row is zeros.
        np.testing.assert_array_equal(q.float().abs().amax(-1)[[0, 1, 3, 4, 5, 6]].numpy(), 448.0)
        assert not bool(q[2].float().any()) and 0.0 < float(scale[2]) < 1e-14
        # Dequantised within half an E4M3 step (2^-4 relative) wherever the value is a normal one.
        xf, deq = xin.float(), q.float() * scale[:, None]
        normal = xf.abs() >= scale[:, None] * 2.0**-6
        assert bool(((deq - xf).abs() <= 2.0**-4 * xf.abs() + 1e-30)[normal].all())
    # Leading dimensions pass through (the expert stacks quantise [N, K] slices, the head [V, H]).
    q3, s3 = quantize_rows_fp8(x.view(7, 3, 16))
    assert s3.shape == (7, 3)
    np.testing.assert_array_equal(_bytes(q3), _np_quantize_rows(x.view(7, 3, 16).numpy())[0].view(np.uint8))


def test_fp8_expert_weights_are_each_experts_rows_quantised():
    cfg = _fp8_cfg()
    base, _ = _steps(cfg, 1)
    W, m, H = base.W, cfg.moe, cfg.hidden_size
    E, I = m.n_routed_experts, m.moe_intermediate_size
    ex = fp8_expert_weights(W)
    assert ex.gate_up.shape == (E + 1, 2 * I, H) and ex.gate_up_scale.shape == (E + 1, 2 * I)
    assert ex.down.shape == (E + 1, H, I) and ex.down_scale.shape == (E + 1, H)
    for e in range(E + 1):
        if e < E:
            gu = torch.cat([W["experts_gate_proj"][e], W["experts_up_proj"][e]])
            dn = W["experts_down_proj"][e]
        else:  # the shared expert is group E
            gu = torch.cat([W["shared_gate_proj"], W["shared_up_proj"]])
            dn = W["shared_down_proj"]
        for got, scale, want in (
            (ex.gate_up[e], ex.gate_up_scale[e], gu),
            (ex.down[e], ex.down_scale[e], dn),
        ):
            qn, sn = _np_quantize_rows(want.numpy())
            np.testing.assert_array_equal(_bytes(got), qn.view(np.uint8))
            np.testing.assert_array_equal(scale.numpy(), sn)
    # The op's [G, K, N] operands: views of the stacks, stride 1 along K (column-major), y = a @ w_t[g].
    for w_t, w, (K, N) in ((ex.gate_up_t, ex.gate_up, (H, 2 * I)), (ex.down_t, ex.down, (I, H))):
        assert w_t.shape == (E + 1, K, N) and w_t.stride() == (N * K, 1, K)
        assert w_t.data_ptr() == w.data_ptr()
    want = torch.cat([W["experts_gate_proj"][3], W["experts_up_proj"][3]]).T
    deq = ex.gate_up_t[3].float() * ex.gate_up_scale[3][None, :]
    torch.testing.assert_close(deq, want, rtol=2.0**-4, atol=ex.gate_up_scale[3].max().item() * 2.0**-6)


def test_fp8_expert_weights_refuse_a_shared_expert_of_another_shape():
    cfg = _fp8_cfg()
    base, _ = _steps(cfg, 1)
    W = dict(base.W)
    W["shared_gate_proj"] = torch.cat([W["shared_gate_proj"], W["shared_gate_proj"]])
    with pytest.raises(ValueError, match="shared expert"):
        fp8_expert_weights(W)


def _reference_layout(idx: list[list[int]], E: int, align: int):
    """The grouped layout built directly: group g's pairs (row order), group E every row's shared slot."""
    tk = len(idx[0])
    members = [[] for _ in range(E + 1)]
    for b, row in enumerate(idx):
        for j, e in enumerate(row):
            members[e].append((b, j))
        members[E].append((b, tk))
    pos, offs, at = {}, [], 0
    for g in range(E + 1):
        for r, pair in enumerate(members[g]):
            pos[pair] = at + r
        at += -(-len(members[g]) // align) * align
        offs.append(at)
    return [[pos[(b, j)] for j in range(tk + 1)] for b in range(len(idx))], offs


@pytest.mark.parametrize(
    "B,E,tk", [(1, 8, 2), (3, 8, 2), (17, 8, 2), (5, 288, 8), (64, 288, 8), (200, 288, 8)]
)
def test_fp8_group_layout_is_the_direct_construction(B, E, tk):
    g = torch.Generator().manual_seed(B * 1000 + E)
    idx = _random_idx(g, B, E, tk)
    lay = fp8_group_layout(idx, E)
    want_pos, want_offs = _reference_layout(idx.tolist(), E, FP8_GROUP_ALIGN)
    assert lay.pos.tolist() == want_pos
    assert lay.offs.dtype == torch.int32 and lay.offs.tolist() == want_offs
    assert lay.rows == fp8_group_rows(B, tk, E) >= want_offs[-1]
    assert len(set(lay.pos.reshape(-1).tolist())) == B * (tk + 1)
    # Small batches leave experts unchosen: their groups are empty (repeated offsets).
    if B * tk < E:
        assert len(set(want_offs)) < len(want_offs)


def test_fp8_group_rows_bounds_the_worst_batch():
    # Every expert chosen by exactly one pair (one more than a multiple of 16: the most padding).
    E, tk = 288, 8
    B = E // tk
    idx = torch.arange(E).view(B, tk)
    lay = fp8_group_layout(idx, E)
    assert int(lay.offs[-1]) == E * FP8_GROUP_ALIGN + -(-B // FP8_GROUP_ALIGN) * FP8_GROUP_ALIGN
    assert int(lay.offs[-1]) <= lay.rows


def test_scatter_rows_fp8_places_rows_and_zero_pads():
    g = torch.Generator().manual_seed(5)
    q, s = quantize_rows_fp8(torch.randn(6, 32, generator=g))
    dest = torch.tensor([9, 0, 17, 3, 16, 30])
    a, sa = scatter_rows_fp8(q, s, dest, 33)
    assert a.dtype == torch.float8_e4m3fn and a.shape == (33, 32) and a.is_contiguous()
    np.testing.assert_array_equal(_bytes(a[dest]), _bytes(q))
    np.testing.assert_array_equal(sa[dest].numpy(), s.numpy())
    rest = torch.ones(33, dtype=torch.bool)
    rest[dest] = False
    assert not bool(_bytes(a[rest]).any()) and not bool(sa[rest].any())


@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="no torch._scaled_grouped_mm here")
def test_the_scaled_grouped_mm_call_passes_pytorchs_checks_at_glm_shapes():
    """The exact call the GPU step makes, at GLM-5.3-Flash's shapes (B = 64), through PyTorch's own
    operand checks: its meta kernel (the CUDA kernel's shape, stride and dtype rules)."""
    cfg = glm5_flash()
    m, H = cfg.moe, cfg.hidden_size
    E, I, tk, B = m.n_routed_experts, m.moe_intermediate_size, m.num_experts_per_tok, 64
    check_fp8_grouped_shapes(H, I, E)
    meta = torch.device("meta")
    W = {
        "experts_gate_proj": torch.empty(E, I, H, device=meta, dtype=torch.bfloat16),
        "experts_up_proj": torch.empty(E, I, H, device=meta, dtype=torch.bfloat16),
        "experts_down_proj": torch.empty(E, H, I, device=meta, dtype=torch.bfloat16),
        "shared_gate_proj": torch.empty(I, H, device=meta, dtype=torch.bfloat16),
        "shared_up_proj": torch.empty(I, H, device=meta, dtype=torch.bfloat16),
        "shared_down_proj": torch.empty(H, I, device=meta, dtype=torch.bfloat16),
    }
    ex = fp8_expert_weights(W)
    lay = fp8_group_layout(_random_idx(torch.Generator().manual_seed(1), B, E, tk), E)
    dest = lay.pos.reshape(-1)
    q, s = quantize_rows_fp8(torch.randn(B * (tk + 1), H, dtype=torch.bfloat16))
    a8, sa = (t.to(meta) for t in scatter_rows_fp8(q, s, dest, lay.rows))
    offs = lay.offs.to(meta)
    gu = scaled_grouped_mm_fp8(a8, sa, ex.gate_up_t, ex.gate_up_scale, offs)
    assert gu.shape == (lay.rows, 2 * I) and gu.dtype == torch.bfloat16
    d8 = torch.empty(lay.rows, I, device=meta, dtype=torch.float8_e4m3fn)
    dsc = torch.empty(lay.rows, device=meta, dtype=torch.float32)
    dn = scaled_grouped_mm_fp8(d8, dsc, ex.down_t, ex.down_scale, offs)
    assert dn.shape == (lay.rows, H) and dn.dtype == torch.bfloat16
    # Operands the op refuses come back as Fp8GroupedMmUnavailable naming the call: scales for half
    # the outputs, the weights row-major, the offsets int64.
    for bad in (
        (a8, sa, ex.gate_up_t, ex.gate_up_scale[:, :I].contiguous(), offs),
        (a8, sa, ex.gate_up_t.contiguous(), ex.gate_up_scale, offs),
        (a8, sa, ex.gate_up_t, ex.gate_up_scale, offs.long()),
    ):
        with pytest.raises(Fp8GroupedMmUnavailable, match="_scaled_grouped_mm refused"):
            scaled_grouped_mm_fp8(*bad)


@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="no torch._scaled_grouped_mm here")
def test_scaled_grouped_mm_on_the_cpu_is_a_clear_refusal():
    q, s = quantize_rows_fp8(torch.randn(16, 32))
    w, sw = quantize_rows_fp8(torch.randn(2, 16, 32))
    with pytest.raises(Fp8GroupedMmUnavailable, match="refused"):
        scaled_grouped_mm_fp8(q, s, w.transpose(1, 2), sw, torch.tensor([16, 16], dtype=torch.int32))


def _moe_reference(bs, y2, idx, w) -> np.ndarray:
    """The FP8 MoE in float64 on the step's own FP8 stacks (checked bit for bit above): each row's
    activations quantised per row, its experts' and the shared expert's SwiGLU, rounded to BF16
    where the step's values are BF16 (the op's outputs and the SwiGLU on them, so the SwiGLU is
    quantised per (row, expert) on the step's grid), the weighted sum plus the shared expert."""
    bf16 = _ml_dtypes().bfloat16
    ex, m = bs.experts_fp8, bs.cfg.moe
    E, I, L = m.n_routed_experts, m.moe_intermediate_size, m.swiglu_limit

    def rnd(v):
        return np.asarray(v, np.float32).astype(bf16).astype(np.float64)

    gu = ex.gate_up.double().numpy() * ex.gate_up_scale.double().numpy()[:, :, None]
    dn = ex.down.double().numpy() * ex.down_scale.double().numpy()[:, :, None]
    qy, sy = _np_quantize_rows(y2.numpy())
    ya = qy.astype(np.float64) * sy.astype(np.float64)[:, None]
    out = np.zeros((y2.shape[0], dn.shape[1]))
    for b in range(y2.shape[0]):
        for e, wt in list(zip(idx[b].tolist(), w[b].tolist())) + [(E, 1.0)]:
            h = rnd(gu[e] @ ya[b])
            gate, up = np.minimum(h[:I], L), np.clip(h[I:], -L, L)
            act = rnd(rnd(gate / (1 + np.exp(-gate))) * up)
            qa, sa = _np_quantize_rows(act)
            out[b] += wt * (dn[e] @ (qa.astype(np.float64) * np.float64(sa)))
    return out


@pytest.mark.parametrize("B", [1, 3, 17])
def test_fp8_moe_is_the_float64_fp8_reference(B):
    cfg = _fp8_cfg()
    base, bs = _steps(cfg, B)
    bs.enable_fp8_experts(grouped_mm=_emulated_scaled_grouped_mm)
    m = cfg.moe
    g = torch.Generator().manual_seed(40 + B)
    y2 = torch.randn(B, cfg.hidden_size, generator=g) * (1 + torch.rand(B, 1, generator=g) * 4)
    idx = _random_idx(g, B, m.n_routed_experts, m.num_experts_per_tok)
    w = torch.rand(B, m.num_experts_per_tok, generator=g) + 0.1
    got = bs._moe_fp8(y2, idx, w)
    assert got.shape == (B, cfg.hidden_size) and bool(torch.isfinite(got).all())
    want = _moe_reference(bs, y2, idx, w)
    # The down GEMM's BF16 output, f32 accumulation, and now and then a value on the other side of
    # a BF16 or E4M3 rounding boundary: well under 1e-2 of a row's scale. Another expert misses by far.
    tol = 1e-2 * np.abs(want).max(-1, keepdims=True)
    assert bool((np.abs(got.numpy() - want) <= tol).all())
    wrong = _moe_reference(bs, y2, (idx + 1) % m.n_routed_experts, w)
    assert bool((np.abs(wrong - want) > tol).any(-1).all())


def test_fp8_experts_propose_tracks_the_bf16_step():
    cfg = _fp8_cfg(share=True)
    contexts = [3, 21, 8, 30, 9]
    _, ref = _steps(cfg, len(contexts), seed=7)
    _, bs = _steps(cfg, len(contexts), seed=7)
    bs.enable_fp8_experts(grouped_mm=_emulated_scaled_grouped_mm)
    with torch.no_grad():
        want = ref.propose(contexts, 3).tolist()
        # The BF16 path is untouched by the FP8 copies: the same drafts and hiddens, bit for bit.
        assert bs.propose(contexts, 3).tolist() == want
        assert torch.equal(bs.last_hidden, ref.last_hidden)
        # One draft with FP8 experts: routed as the BF16 step (the router reads the same x), and a
        # hidden within FP8 rounding of it (E4M3 carries 3 mantissa bits: activations and weights
        # each about 4% rms, and the MoE dominates this tiny block's x; measured 3..5%), but not
        # equal to it (the FP8 MoE did run).
        ref.propose(contexts, 1)
        bs.propose(contexts, 1, fp8_experts=True)
    assert torch.equal(bs.expert_ids[0], ref.expert_ids[0])
    rel = (bs.last_hidden - ref.last_hidden).norm(dim=-1) / ref.last_hidden.norm(dim=-1)
    assert bool((rel > 0).all()) and bool((rel < 0.1).all()), rel.tolist()


def test_fp8_experts_are_refused_with_the_reason():
    # K = I = 24 is no multiple of 16: refused before any copy is made.
    _, bs = _steps(_cfg(True), 2)
    with pytest.raises(Fp8GroupedMmUnavailable, match="multiples of 16.*K = 24"):
        bs.enable_fp8_experts(grouped_mm=_emulated_scaled_grouped_mm)
    assert bs.experts_fp8 is None
    with pytest.raises(Fp8GroupedMmUnavailable, match="fewer than 1024 groups"):
        check_fp8_grouped_shapes(64, 32, 1023)
    # The real op on the CPU: refused, naming the device (or the op, where this PyTorch lacks it).
    _, bs = _steps(_fp8_cfg(), 2)
    with pytest.raises(Fp8GroupedMmUnavailable, match="CUDA GPUs only|has no torch._scaled_grouped_mm"):
        bs.propose([3, 9], 1, fp8_experts=True)
    assert bs.experts_fp8 is None
    with pytest.raises(Fp8GroupedMmUnavailable, match="CUDA GPUs only|has no torch._scaled_grouped_mm"):
        check_fp8_grouped_device("cpu")
