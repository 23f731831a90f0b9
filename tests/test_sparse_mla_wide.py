"""The wide absorbed-MLA pair's host twins (``sparse_mla_wide_batch``: all heads of an entry per
block, splits of 64 to 256 rows; tests/sparse_mla_wide_util.py) at 3, 8, 16, 20, 24, 32, 64 and 72
heads (one and two 64-head groups), latent widths 48, 64 and 512, NoPE and rope widths 16 to 64,
every split length, selections of 0, 1, 63, 64, 65 rows, both sides of the split and the capacity:

- the output against float64 attention within 2**-7 relative plus 2**-9 of the entry's largest
  (BF16 output); an empty selection gives zeros;
- the workspace against the float64 partials of the same split structure (per split of
  ``split_rows`` rows: the unnormalised output, its max and sum; tolerances in the util), splits
  past the count unwritten;
- each entry of a batch bit for bit its m = 1 launch, workspace too; padding writes nothing;
- rope_dim 0 is NoPE: the bytes of the call with the RoPE keywords given as None / 0, and of a
  direct launch with NaN rope inputs;
- the launch helper, the layer and the proposer options refuse a split length, rope width or
  latent width the kernels do not take; the twins, as the kernels, write nothing for them;
- the layer takes the wide form by configuration (ProposerOptions.attention_split_rows, auto by
  the proposer's size) and the shape, and a proposer with it drafts on the host batch-invariantly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from batch_dsa_util import bytes_of, free_all, poison_all, upload_all
from sparse_mla_wide_util import (
    SHAPE_IDS,
    SHAPES,
    WideShape,
    check_outputs,
    check_workspace,
    inputs_of,
    raw_wide,
    run_wide,
    sizes,
    splits_f64,
    wide_case,
    wide_f64,
    wide_world,
)

from model.kernels import sparse_mla
from model.proposer import ProposerError, ProposerOptions
from runtime.host_backend import HostBackend


@pytest.mark.parametrize("sh", SHAPES, ids=SHAPE_IDS)
def test_wide_twin_against_float64(sh):
    rng = np.random.default_rng(sh.heads * 1000 + sh.dim + sh.rope_dim + sh.split_rows)
    m = 11
    world = wide_world(rng, sh, m)
    case = wide_case(rng, sh, m, npad=2)
    assert len(case.live) == 9 and {s for _, s, _ in case.live} == {0, 1}
    got = run_wide(HostBackend(), world, sh, case)
    check_outputs(got, sh, case, lambda e, slot, rows: wide_f64(world, sh, e, slot, rows))
    check_workspace(got, sh, case, world)


def test_the_cases_depend_on_the_rope_term_and_the_split():
    """Without the RoPE term the float64 attention of every multi-row selection is outside the
    output tolerance, and the float64 partials of another split length outside the workspace's:
    the comparisons above can fail."""
    rng = np.random.default_rng(3)
    for sh in SHAPES:
        world = wide_world(rng, sh, 9)
        case = wide_case(rng, sh, 9, npad=0)
        for e, slot, rows in case.live:
            if rows.size <= 1:
                continue
            if sh.rope_dim:
                ref = wide_f64(world, sh, e, slot, rows)
                other = wide_f64(world, sh, e, slot, rows, rope=False)
                atol = float(np.abs(ref).max()) * 2.0**-9
                assert (np.abs(other - ref) > 2.0**-7 * np.abs(ref) + atol).any()
            if rows.size > 64:
                rp, rml = splits_f64(world, sh, e, slot, rows)
                op, oml = splits_f64(world, sh, e, slot, rows, split_rows=64 if sh.split_rows > 64 else 128)
                k = min(len(rp), len(op))
                assert not np.allclose(op[:k], rp[:k], rtol=2.0**-10) or not np.allclose(oml[:k], rml[:k])


@pytest.mark.parametrize("mode", ["nope", "raw_nope"])
def test_rope_dim_0_is_nope(mode):
    """None / None / 0, and a direct launch with NaN-filled rope inputs and rope_dim 0: the bytes of
    the call without the RoPE keywords (workspace too)."""
    sh = WideShape(heads=20, dim=64, rope_dim=0, split_rows=128)
    rng = np.random.default_rng(11)
    world = wide_world(rng, sh, 6)
    case = wide_case(rng, sh, 6, npad=1)
    old = run_wide(HostBackend(), world, sh, case, mode="rope")
    got = run_wide(HostBackend(), world, sh, case, mode=mode)
    for k in old:
        assert np.array_equal(got[k], old[k]), k


def test_the_wide_and_split_twins_agree():
    """The two forms are one function at two split lengths: within the output tolerance of each
    other (on the host both are f32; on the GPU each is checked against its twin)."""
    sh = WideShape(heads=24, dim=64, rope_dim=16, split_rows=192)
    rng = np.random.default_rng(8)
    world = wide_world(rng, sh, 5)
    case = wide_case(rng, sh, 5, npad=0)
    gpu = HostBackend()
    got = run_wide(gpu, world, sh, case, invariance=False)
    p = upload_all(gpu, inputs_of(world, case))
    pb, mb = sparse_mla.split_workspace_batch(sh.heads, sh.dim, sh.sel_cap, 5)
    o = poison_all(gpu, {"out": 5 * sh.heads * sh.dim * 2, "part": pb, "ml": mb})
    try:
        sparse_mla.sparse_mla_split_batch(
            gpu, q=p["q"], cache=p["cache"], scales=p["scales"], tables=p["tables"], selected=p["sel"],
            count=p["cnt"], part=o["part"], ml=o["ml"], out=o["out"], entries=p["entries"], m=5,
            slot_rows=sh.slot_rows, sel_cap=sh.sel_cap, heads=sh.heads, dim=sh.dim, block_size=sh.bs,
            scale=sh.scale, q_rope=p["q_rope"], rope_keys=p["rope_keys"], rope_dim=sh.rope_dim,
        )  # fmt: skip
        pair = bytes_of(gpu, o, {"out": 5 * sh.heads * sh.dim * 2})
    finally:
        free_all(gpu, p, o)
    from sparse_mla_wide_util import outputs_f32

    w = outputs_f32(got, sh, 5)
    check_outputs(pair, sh, case, lambda e, slot, rows: w[e])


def _helper_kw(gpu, p, **over):
    kw = dict(
        q=p, cache=p, scales=p, tables=p, selected=p, count=p, part=p, ml=p, out=p, entries=p, m=1,
        slot_rows=16, sel_cap=4, heads=3, dim=64, block_size=16, scale=1.0, split_rows=64,
    )  # fmt: skip
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,match",
    [
        ({"split_rows": 0}, "split_rows 0 "),
        ({"split_rows": 32}, "split_rows 32 "),
        ({"split_rows": 96}, "split_rows 96 "),
        ({"split_rows": 320}, "split_rows 320 "),
        ({"split_rows": True}, "split_rows True "),
        ({"dim": 8}, "dim 8 "),
        ({"dim": 40}, "dim 40 "),
        ({"dim": 528}, "dim 528 "),
        ({"rope_dim": 80, "q_rope": "p", "rope_keys": "p"}, "rope_dim 80 is past"),
        ({"rope_dim": 128, "q_rope": "p", "rope_keys": "p"}, "rope_dim 128 is past"),
        ({"rope_dim": 24, "q_rope": "p", "rope_keys": "p"}, "rope_dim 24 is not"),
        ({"rope_dim": 64}, "needs both q_rope and rope_keys"),
        ({"rope_dim": 0, "q_rope": "p"}, "with rope_dim 0"),
        ({"m": 0}, "m=0"),
    ],
)
def test_helper_refuses_what_the_kernels_do_not_take(over, match):
    gpu = HostBackend()
    p = gpu.alloc(1 << 16)
    over = {k: p if v == "p" else v for k, v in over.items()}
    try:
        with pytest.raises(ValueError, match=match):
            sparse_mla.sparse_mla_wide_batch(gpu, **_helper_kw(gpu, p, **over))
    finally:
        gpu.free(p)


@pytest.mark.parametrize(
    "what,kw",
    [
        ("rope_dim 80", dict(rope_dim=80)),
        ("rope_dim 24", dict(rope_dim=24)),
        ("split_rows 32", dict(rope_dim=16, split_rows=32)),
        ("split_rows 320", dict(rope_dim=16, split_rows=320)),
        ("dim 40", dict(rope_dim=16, dim=40)),
    ],
)
def test_what_the_kernels_do_not_take_writes_nothing(what, kw):
    """Past the helper's refusal (a direct launch): the workspace and the output keep their poison,
    as the kernels' guards leave them (tests/test_gpu_sparse_mla_wide.py checks the PTX the same
    way). The merge takes no rope_dim: for a rope width it merges the unwritten poison, which the
    helper's refusal keeps from happening; so only the workspace is checked there."""
    sh = WideShape(heads=3, dim=64, rope_dim=16, split_rows=64)
    rng = np.random.default_rng(5)
    world = wide_world(rng, sh, 3)
    case = wide_case(rng, sh, 3, npad=0)
    gpu = HostBackend()
    p = upload_all(gpu, inputs_of(world, case))
    sz = sizes(sh, 3)
    o = poison_all(gpu, sz)
    try:
        raw_wide(gpu, {**p, **o}, sh, 3, q_rope=p["q_rope"], rope_keys=p["rope_keys"], **kw)
        got = bytes_of(gpu, o, sz)
        for k in ("part", "ml") if what.startswith("rope") else sz:
            assert (got[k] == 0xFF).all(), f"{k} written for {what}"
    finally:
        free_all(gpu, p, o)


def test_wide_smem_fits_one_block_per_sm():
    # The GLM / DeepSeek shape: 230912 bytes, under the 227 KB a block may opt in to on sm_90.
    assert sparse_mla.wide_smem(64, 256) == 230912
    assert sparse_mla.wide_smem(64, 256) <= 227 * 1024
    assert sparse_mla.wide_smem(0, 256) == 230912 - 64 * 72 * 2 - 4 * 256
    assert sparse_mla.wide_smem(64, 64) < sparse_mla.wide_smem(64, 256)


def test_wide_workspace_is_per_entry_and_smaller():
    pb, mb = sparse_mla.wide_workspace(64, 512, 2048, 256)
    assert (pb, mb) == (8 * 64 * 512 * 4, 8 * 64 * 8)
    assert sparse_mla.split_workspace(64, 512, 2048)[0] == 4 * pb  # a quarter of the split pair's
    assert sparse_mla.wide_splits(2049, 256) == 9 and sparse_mla.wide_splits(0, 64) == 1


def test_split_rows_choices():
    ok = [r for r in range(0, 400) if sparse_mla.wide_split_rows_ok(r)]
    assert ok == [64, 128, 192, 256]
    assert not sparse_mla.wide_split_rows_ok(True) and not sparse_mla.wide_split_rows_ok(128.0)
    assert sparse_mla.wide_supported(512, 64) and sparse_mla.wide_supported(32, 0)
    assert not sparse_mla.wide_supported(512, 128) and not sparse_mla.wide_supported(520, 0)
    for n in (1, 2, 3, 4, 8, 15, 16, 64, 256, 4096):
        r = sparse_mla.auto_split_rows(n)
        assert r == 0 or sparse_mla.wide_split_rows_ok(r), n
    assert sparse_mla.auto_split_rows(1) == 0  # one sequence keeps the split pair's latency
    assert sparse_mla.auto_split_rows(256) == sparse_mla.AUTO_WIDE_SPLIT_ROWS


# ---- the layer and the proposer ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [32, 96, 512, -64, True, 64.0])
def test_proposer_options_refuse_a_split_length(bad):
    with pytest.raises(ProposerError, match="attention_split_rows"):
        ProposerOptions(served_max_seq_len=64, attention_split_rows=bad)


def test_the_layer_takes_the_wide_form_by_configuration():
    """Auto: by the proposer's size; explicit: as asked, the attention workspace sized for the form
    taken; a latent width the wide kernel does not take keeps the other forms."""
    from proposer_fixtures import bf16_weights, make_proposer

    from model.config import AttentionConfig, tiny

    cfg = tiny(max_context=96)
    w = bf16_weights(cfg, 3)
    gpu = HostBackend()
    for opts, want in (
        ({"max_sequences": 1}, 0),
        ({"max_sequences": sparse_mla.AUTO_WIDE_MIN_SEQUENCES}, sparse_mla.AUTO_WIDE_SPLIT_ROWS),
        ({"max_sequences": 1, "attention_split_rows": 128}, 128),
        ({"max_sequences": 64, "attention_split_rows": 0}, 0),
    ):
        prop = make_proposer(cfg, w, gpu=gpu, **opts)
        assert prop.attention_split_rows == want and prop.layer.attn_split_rows == want, opts
        prop.close()
    odd = dataclasses.replace(
        cfg, attention=AttentionConfig(cfg.attention.num_attention_heads, 48, 40, 16, 0, 16)
    )
    prop = make_proposer(odd, bf16_weights(odd, 4), gpu=gpu, attention_split_rows=64)
    assert prop.attention_split_rows == 64 and prop.layer.attn_split_rows == 0
    prop.close()


def test_the_layer_refuses_a_split_length():
    from proposer_fixtures import bf16_weights, make_proposer

    from model.block import DecoderLayer
    from model.config import tiny

    cfg = tiny(max_context=96)
    gpu = HostBackend()
    prop = make_proposer(cfg, bf16_weights(cfg, 3), gpu=gpu)
    lay = prop.layer
    try:
        for bad in (96, 320, 32):
            with pytest.raises(ValueError, match=f"attention_split_rows {bad}"):
                DecoderLayer(gpu, cfg, lay.sh, lay.attn, lay.mlp, attention_split_rows=bad)
        assert (
            DecoderLayer(gpu, cfg, lay.sh, lay.attn, lay.mlp, attention_split_rows=192).attn_split_rows == 192
        )
    finally:
        prop.close()


@pytest.mark.parametrize("family", ["glm5_next", "glm_moe_dsa"])
def test_a_wide_proposer_drafts_batch_invariantly(family):
    """On the host, a proposer with the wide attention (64-row splits, selections of several
    splits) drafts and caches in a batch, through bucket graphs, exactly what it drafts for each
    sequence alone; its drafts are the split pair proposer's where the two agree to the last bit
    is not required (the forms round differently), so only the wide form is compared with itself."""
    from proposer_fixtures import bf16_weights, drafts_match_alone, make_proposer

    from model.config import tiny, tiny_rope

    cfg = (
        tiny(index_topk=150, index_kpool=2, max_context=256)
        if family == "glm5_next"
        else tiny_rope(family=family, max_context=256)
    )
    if family != "glm5_next":
        cfg = dataclasses.replace(cfg, dsa=dataclasses.replace(cfg.dsa, index_topk=150))
    weights = bf16_weights(cfg, seed=12)
    gpu = HostBackend()
    k = 3
    mk = dict(gpu=gpu, max_sequences=4, max_draft_tokens=k, attention_split_rows=64)
    batched = make_proposer(cfg, weights, use_graphs=True, batch_buckets=(1, 4), **mk)
    alone = make_proposer(cfg, weights, **mk)
    assert batched.layer.attn_split_rows == alone.layer.attn_split_rows == 64
    try:
        drafts_match_alone(gpu, cfg, batched, alone, k, [[150, 200, 90], [3, 1, 4]])
    finally:
        batched.close()
        alone.close()
