"""Checkpoint I/O: safetensors format, sharding, layout validation, FP8, aliases, random weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.checkpoint import (
    DTYPES,
    Checkpoint,
    CheckpointError,
    SafetensorsFile,
    dequantize_fp8,
    load_safetensors,
    mtp_tensors,
    quantize_fp8,
    random_checkpoint,
    random_tensors,
    read_header,
    target_tensors,
    write_checkpoint,
    write_safetensors,
)
from model.checkpoint.fp8 import scale_name
from model.config import ParallelConfig, glm5_flash, tiny
from model.weights_layout import (
    EMBED,
    LM_HEAD,
    mtp_layout,
    mtp_prefix,
    shared_layout,
    target_layout,
)
from runtime.dtypes import BF16, FP8

CFG = tiny()
P = mtp_prefix(CFG)
HEAD_ALIAS = P + "shared_head.head.weight"
EMBED_ALIAS = P + "embed_tokens.weight"


def random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = DTYPES[dtype]
    if dt.kind in "iub":
        info = np.iinfo(dt) if dt.kind != "b" else None
        if info is None:
            return rng.integers(0, 2, shape).astype(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    x = rng.standard_normal(shape) * 10
    return np.clip(x, -448, 448).astype(dt)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaN-safe, and works for dtypes without ufunc equality)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.array_equal(
            np.ascontiguousarray(a).reshape(-1).view(np.uint8),
            np.ascontiguousarray(b).reshape(-1).view(np.uint8),
        )
    )


def tensors_of(cfg, seed: int = 0, **kw) -> dict[str, np.ndarray]:
    """The random checkpoint's tensors, in memory, for writing variants of it."""
    out = {}
    for t in random_tensors(cfg, seed, **kw):
        out[t.name] = np.concatenate([c.reshape(-1) for c in t.chunks()]).reshape(t.shape)
    return out


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", CFG, 0, progress=False)


# ---- safetensors format ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F8_E4M3", "I32", "I64", "U8"])
def test_roundtrip_every_dtype(tmp_path, dtype):
    rng = np.random.default_rng(1)
    tensors = {
        "a": random_array(rng, dtype, (5, 7)),
        "b.scalar": random_array(rng, dtype, ()),
        "c.empty": random_array(rng, dtype, (0, 3)),
    }
    write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    back = load_safetensors(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for k in tensors:
        assert same_bits(back[k], tensors[k]), k
    _, meta = read_header(tmp_path / "x.safetensors")
    assert meta == {"format": "pt"}


def test_f8_header_dtype_name(tmp_path):
    write_safetensors(tmp_path / "x.safetensors", {"w": np.ones((2, 2), FP8)})
    (n,) = struct.unpack("<Q", (tmp_path / "x.safetensors").read_bytes()[:8])
    header = json.loads((tmp_path / "x.safetensors").read_bytes()[8 : 8 + n])
    assert header["w"]["dtype"] == "F8_E4M3"


_DTYPE = st.sampled_from(sorted(DTYPES))
_SHAPE = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.tuples(_DTYPE, _SHAPE), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_roundtrip_random_shapes_and_dtypes(tmp_path, specs, seed):
    rng = np.random.default_rng(seed)
    tensors = {f"t{i}": random_array(rng, d, s) for i, (d, s) in enumerate(specs)}
    path = tmp_path / "h.safetensors"
    write_safetensors(path, tensors)
    f = SafetensorsFile(path)
    for name, arr in tensors.items():
        assert same_bits(f.get(name), arr)
        info = f.tensors[name]
        # The writer keeps every tensor aligned to its item size, as the official one does.
        assert info.begin % DTYPES[info.dtype].itemsize == 0


def test_views_are_readonly_memmaps(ckpt_dir):
    c = Checkpoint(ckpt_dir)
    w = c.get(LM_HEAD)
    assert isinstance(w, np.memmap) and w.dtype == BF16 and not w.flags.writeable
    bias = c.get(P + "mlp.gate.e_score_correction_bias")
    assert isinstance(bias, np.memmap) and bias.dtype == np.float32
    # get_checked of a BF16/F32 tensor stored as such is the same view, not a copy.
    assert isinstance(c.get_checked(LM_HEAD, w.shape, "BF16"), np.memmap)
    # Expected dtypes may be given as NumPy dtypes as well as safetensors names.
    assert isinstance(c.get_checked(LM_HEAD, w.shape, BF16), np.memmap)
    with pytest.raises(CheckpointError, match="expected dtype F16, found BF16"):
        c.get_checked(LM_HEAD, w.shape, np.float16)


def test_safetensors_package_agrees(tmp_path):
    sft = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(2)
    ours = {d: random_array(rng, d, (3, 4)) for d in ["BF16", "F16", "F32", "I32", "I64", "U8"]}
    write_safetensors(tmp_path / "ours.safetensors", ours)
    theirs = sft.load_file(str(tmp_path / "ours.safetensors"))
    for k in ours:
        assert same_bits(theirs[k], ours[k]), k
    sft.save_file(ours, str(tmp_path / "theirs.safetensors"))
    back = load_safetensors(tmp_path / "theirs.safetensors")
    for k in ours:
        assert same_bits(back[k], ours[k]), k


@pytest.mark.parametrize("damage", ["truncate", "huge_header", "not_json", "bad_size"])
def test_malformed_file_is_named(tmp_path, damage):
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, {"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.int64)})
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    if damage == "truncate":
        raw = raw[:-4]
    elif damage == "huge_header":
        raw[:8] = struct.pack("<Q", 1 << 40)
    elif damage == "not_json":
        raw[8] = ord("[") + 1
    else:
        header = json.loads(raw[8 : 8 + n])
        header["a"]["shape"] = [5]
        h = json.dumps(header).encode()
        h += b" " * (n - len(h))
        raw[8 : 8 + n] = h
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        SafetensorsFile(path)


# ---- sharding --------------------------------------------------------------------------------


def test_sharded_and_single_file_read_the_same(tmp_path):
    tensors = tensors_of(CFG)
    single = write_checkpoint(tmp_path / "single", CFG, tensors)
    sharded = write_checkpoint(tmp_path / "sharded", CFG, tensors, max_shard_bytes=20_000)
    assert (single / "model.safetensors").is_file()
    assert not (single / "model.safetensors.index.json").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    a, b = Checkpoint(single), Checkpoint(sharded)
    assert a.names() == b.names() == sorted(tensors)
    for name, arr in tensors.items():
        assert same_bits(a.get(name), arr) and same_bits(b.get(name), arr), name
    assert a.config == b.config == CFG


def test_random_values_do_not_depend_on_sharding_or_target(tmp_path):
    a = Checkpoint(random_checkpoint(tmp_path / "a", CFG, 5, progress=False))
    b = Checkpoint(
        random_checkpoint(
            tmp_path / "b", CFG, 5, include_target=False, max_shard_bytes=30_000, progress=False
        )
    )
    assert len(b.shards()) > 1
    for name in b.names():
        assert same_bits(a.get(name), b.get(name)), name
    c = Checkpoint(random_checkpoint(tmp_path / "c", CFG, 6, progress=False))
    assert not same_bits(a.get(LM_HEAD), c.get(LM_HEAD))


def test_writer_refuses_to_overwrite(tmp_path, ckpt_dir):
    d = random_checkpoint(tmp_path / "x", CFG, 0, progress=False, max_shard_bytes=30_000)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        random_checkpoint(d, CFG, 0, progress=False)
    # Overwriting a sharded checkpoint with a single file leaves no stale shard or index.
    random_checkpoint(d, CFG, 1, progress=False, overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]


# ---- layout and validation -------------------------------------------------------------------


def test_random_checkpoint_validates(ckpt_dir):
    c = Checkpoint(ckpt_dir)
    mtp = mtp_tensors(c)
    assert set(mtp) == set(mtp_layout(CFG)) | {HEAD_ALIAS, EMBED_ALIAS}
    for name in mtp:
        arr = mtp[name]
        want = "F32" if name.endswith("e_score_correction_bias") else "BF16"
        assert arr.dtype == DTYPES[want] and arr.shape == mtp.spec(name).shape, name
    tgt = target_tensors(c)
    assert set(tgt) == set(target_layout(CFG))
    assert tgt["model.layers.0.mlp.gate_proj.weight"].shape == (CFG.intermediate_size, 64)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in tgt
    assert "model.layers.0.mlp.experts.0.down_proj.weight" not in tgt


def test_layout_at_reference_shapes_matches_the_spec():
    cfg = glm5_flash()
    mtp = mtp_layout(cfg)
    p = "model.layers.45."
    shapes = {
        "eh_proj.weight": (4096, 8192),
        "self_attn.q_b_proj.weight": (64 * 256, 1536),
        "self_attn.kv_a_proj_with_mqa.weight": (512, 4096),
        "self_attn.kv_b_proj.weight": (64 * 512, 512),
        "self_attn.o_proj.weight": (4096, 64 * 256),
        "self_attn.indexer.wq_b.weight": (32 * 128, 1536),
        "self_attn.indexer.index_kpool_compress_ape": (4, 128),
        "mlp.gate.weight": (288, 4096),
        "mlp.experts.287.down_proj.weight": (4096, 2048),
        "self_attn.indexer.index_kpool_compress_gate": (128, 4096),
        "mlp.shared_experts.down_proj.weight": (4096, 2048),
    }
    for name, shape in shapes.items():
        assert mtp[p + name].shape == shape, name
    assert not any("shared_expert_gate" in n for n in mtp)  # the shared expert has weight 1
    nbytes = {n: np.prod(s.shape) * DTYPES[s.dtype].itemsize for n, s in mtp.items()}
    experts = sum(b for n, b in nbytes.items() if ".mlp.experts." in n)
    block = sum(nbytes.values()) - experts
    # At the GLM-5.3-Flash shapes a draft reads about 0.37 GB of block and 0.40 GB for 8 experts.
    assert abs(block / 1e9 - 0.37) < 0.01
    assert abs(experts * 8 / 288 / 1e9 - 0.40) < 0.01
    assert shared_layout(cfg)[LM_HEAD].shape == (154880, 4096)


def _broken(tmp_path, name, edit) -> Checkpoint:
    tensors = tensors_of(CFG, include_target=False)
    edit(tensors)
    return Checkpoint(write_checkpoint(tmp_path / name, CFG, tensors))


def test_missing_tensor_is_named_before_loading(tmp_path):
    victim = P + "self_attn.indexer.index_kpool_compress_ape"
    c = _broken(tmp_path, "missing", lambda t: t.pop(victim))
    with pytest.raises(CheckpointError) as e:
        mtp_tensors(c)
    assert f"tensor {victim} is missing" in str(e.value)
    assert "1 problem)" in str(e.value)
    with pytest.raises(CheckpointError, match="did you mean"):
        c.get(P + "self_attn.indexer.index_kpool_compress_ape.weight")


def test_wrong_shape_names_expected_and_found(tmp_path):
    victim = P + "eh_proj.weight"
    c = _broken(tmp_path, "shape", lambda t: t.update({victim: t[victim][:, :64].copy()}))
    want = rf"{victim}: expected shape \[64, 128\], found \[64, 64\]"
    with pytest.raises(CheckpointError, match=want):
        mtp_tensors(c)
    with pytest.raises(CheckpointError, match=rf"{victim}: expected shape \[64, 128\], found"):
        c.get_checked(victim, (64, 128), "BF16")


def test_wrong_dtype_names_expected_and_found(tmp_path):
    victim = P + "mlp.gate.e_score_correction_bias"
    c = _broken(tmp_path, "dtype", lambda t: t.update({victim: t[victim].astype(BF16)}))
    with pytest.raises(CheckpointError, match=rf"{victim}: expected dtype F32, found BF16"):
        mtp_tensors(c)


def test_every_problem_is_listed(tmp_path):
    def edit(t):
        t.pop(P + "enorm.weight")
        t[P + "hnorm.weight"] = t[P + "hnorm.weight"].astype(np.float16)

    c = _broken(tmp_path, "two", edit)
    with pytest.raises(CheckpointError) as e:
        mtp_tensors(c)
    msg = str(e.value)
    assert "2 problems" in msg and P + "enorm.weight" in msg and P + "hnorm.weight" in msg


def test_target_of_an_mtp_only_checkpoint_is_refused(tmp_path):
    c = Checkpoint(random_checkpoint(tmp_path / "m", CFG, 0, include_target=False, progress=False))
    mtp_tensors(c)
    with pytest.raises(CheckpointError, match="model.layers.0.input_layernorm.weight is missing"):
        target_tensors(c)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint: not a directory"):
        Checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint: no config.json"):
        Checkpoint(tmp_path / "empty")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    with pytest.raises(CheckpointError, match="not a checkpoint: no model.safetensors.index.json"):
        Checkpoint(tmp_path / "cfg")


def test_index_inconsistent_with_shards(tmp_path):
    """Shards are opened on first use (a drafter-only copy holds some of them): an index that
    names a shard the directory lacks leaves that shard's tensors missing, by name; one that puts
    a tensor in a shard without it is refused when that shard is first read."""
    d = random_checkpoint(tmp_path / "s", CFG, 0, progress=False, max_shard_bytes=30_000)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    home = index["weight_map"][LM_HEAD]
    other = next(f for f in index["weight_map"].values() if f != home)
    index["weight_map"][LM_HEAD] = "model-00099-of-00099.safetensors"
    index_path.write_text(json.dumps(index))
    c = Checkpoint(d)
    assert not c.has(LM_HEAD) and LM_HEAD in c.names()
    with pytest.raises(
        CheckpointError,
        match=f"{LM_HEAD} is missing.*puts it in model-00099-of-00099.safetensors, which is not",
    ):
        c.get(LM_HEAD)
    with pytest.raises(CheckpointError, match=f"{LM_HEAD} is missing"):
        mtp_tensors(c)
    index["weight_map"][LM_HEAD] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"puts tensor {LM_HEAD} in {other}"):
        Checkpoint(d).get(LM_HEAD)


def test_config_passthrough(ckpt_dir):
    c = Checkpoint(ckpt_dir, parallel=ParallelConfig(rank=1, world_size=2), dsa_max_context=64)
    assert c.config.parallel == ParallelConfig(1, 2)
    assert c.config.dsa.max_context == 64
    assert Checkpoint(ckpt_dir).config == CFG


# ---- shared head / embedding aliases ---------------------------------------------------------


def test_aliases_resolve_to_target_when_not_stored(ckpt_dir):
    c = Checkpoint(ckpt_dir)
    assert not c.has(HEAD_ALIAS) and not c.has(EMBED_ALIAS)
    mtp = mtp_tensors(c)
    assert mtp.source(HEAD_ALIAS) == LM_HEAD and mtp.source(EMBED_ALIAS) == EMBED
    assert HEAD_ALIAS in mtp and mtp.has(EMBED_ALIAS) and LM_HEAD not in mtp
    assert same_bits(mtp[HEAD_ALIAS], c.get(LM_HEAD))
    assert same_bits(mtp[EMBED_ALIAS], c.get(EMBED))


def test_aliases_prefer_the_blocks_own_copy(tmp_path):
    d = random_checkpoint(tmp_path / "glm45", CFG, 0, store_mtp_head=True, progress=False)
    c = Checkpoint(d)
    mtp = mtp_tensors(c)
    assert mtp.source(HEAD_ALIAS) == HEAD_ALIAS and mtp.source(EMBED_ALIAS) == EMBED_ALIAS
    # random_checkpoint stores equal copies, as real checkpoints do...
    assert same_bits(c.get(HEAD_ALIAS), c.get(LM_HEAD))
    # ...so prove the preference with a copy that differs.
    tensors = tensors_of(CFG, store_mtp_head=True)
    tensors[HEAD_ALIAS] = (tensors[HEAD_ALIAS].astype(np.float32) * 2).astype(BF16)
    c2 = Checkpoint(write_checkpoint(tmp_path / "differs", CFG, tensors))
    assert same_bits(mtp_tensors(c2)[HEAD_ALIAS], tensors[HEAD_ALIAS])


def test_alias_missing_everywhere_names_both(tmp_path):
    c = _broken(tmp_path, "nohead", lambda t: t.pop(LM_HEAD))
    with pytest.raises(CheckpointError, match=f"{LM_HEAD} is missing.*and so is {HEAD_ALIAS}"):
        mtp_tensors(c)


def test_stored_alias_of_wrong_shape_is_named(tmp_path):
    def edit(t):
        t[EMBED_ALIAS] = np.zeros((CFG.vocab_size - 1, CFG.hidden_size), BF16)

    c = _broken(tmp_path, "badalias", edit)
    with pytest.raises(CheckpointError, match=rf"{EMBED_ALIAS}: expected shape \[97, 64\]"):
        mtp_tensors(c)


# ---- FP8 -------------------------------------------------------------------------------------


def _fp8_checkpoint(tmp_path, shape=(300, 260), block=(128, 128)):
    rng = np.random.default_rng(3)
    w = rng.standard_normal(shape).astype(np.float32)
    q, s = quantize_fp8(w, block)
    s = (s * rng.uniform(0.5, 2.0, s.shape)).astype(np.float32)  # distinct per block
    extra = {"quantization_config": {"weight_block_size": list(block)}}
    d = write_checkpoint(
        tmp_path / "fp8", CFG, {"w.weight": q, scale_name("w.weight"): s}, extra_config=extra
    )
    full = np.repeat(np.repeat(s.astype(np.float64), block[0], 0), block[1], 1)
    exact = q.astype(np.float64) * full[: shape[0], : shape[1]]
    return Checkpoint(d), q, s, exact


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_fp8_block_dequantisation_against_float64(tmp_path, block):
    c, q, s, exact = _fp8_checkpoint(tmp_path, block=block)
    assert c.fp8_block == block
    got = c.get_checked("w.weight", (300, 260), "BF16")
    assert got.dtype == BF16 and got.shape == (300, 260)
    # One rounding to BF16 of the exact product: within half a BF16 ulp (2^-9 relative).
    np.testing.assert_allclose(got.astype(np.float64), exact, rtol=2.0**-8, atol=0)
    assert np.mean(got.astype(np.float64) == exact.astype(np.float32).astype(BF16)) > 0.999
    # The raw FP8 is still there, and so are the scales.
    assert same_bits(c.get_checked("w.weight", (300, 260), "F8_E4M3"), q)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory) -> Checkpoint:
    return _fp8_checkpoint(tmp_path_factory.mktemp("fp8rows"))[0]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_fp8_rows_equal_the_slice(fp8_ckpt, data):
    c = fp8_ckpt
    full = c.get_checked("w.weight", (300, 260), "BF16")
    start = data.draw(st.integers(0, 300))
    stop = data.draw(st.integers(start, 300))
    assert same_bits(c.get_rows("w.weight", start, stop, "BF16"), full[start:stop])


def test_quantize_then_dequantize_is_close():
    w = np.random.default_rng(4).standard_normal((200, 300)).astype(np.float32)
    q, s = quantize_fp8(w)
    back = dequantize_fp8(q, s, np.dtype(np.float32))
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for values not near underflow.
    big = np.abs(w) > np.abs(w).max() / 64
    np.testing.assert_allclose(back[big], w[big], rtol=2.0**-4)


def test_fp8_without_scales_or_with_bad_scales(tmp_path):
    q = np.ones((4, 4), FP8)
    c = Checkpoint(write_checkpoint(tmp_path / "a", CFG, {"w.weight": q}))
    with pytest.raises(
        CheckpointError,
        match="w.weight: expected dtype BF16, found F8_E4M3 without its block scales w.weight_scale_inv",
    ):
        c.get_checked("w.weight", (4, 4), "BF16")
    c = Checkpoint(
        write_checkpoint(
            tmp_path / "b", CFG, {"w.weight": q, "w.weight_scale_inv": np.ones((2, 1), np.float32)}
        )
    )
    with pytest.raises(
        CheckpointError,
        match=r"w.weight_scale_inv \(block scales of w.weight\): "
        r"expected F32\[1, 1\], found F32\[2, 1\]",
    ):
        c.get_checked("w.weight", (4, 4), "BF16")


def test_random_fp8_experts_load_through_the_checker(tmp_path):
    d = random_checkpoint(tmp_path / "f", CFG, 0, fp8_experts=True, fp8_block=(16, 16), progress=False)
    c = Checkpoint(d)
    name = P + "mlp.experts.5.up_proj.weight"
    assert c.info(name).dtype == "F8_E4M3" and c.info(scale_name(name)).shape == (2, 4)
    assert c.info(P + "mlp.shared_experts.up_proj.weight").dtype == "BF16"
    mtp = mtp_tensors(c)
    w = mtp[name]
    assert w.dtype == BF16 and w.shape == (24, 64)
    exact = (
        c.get(name).astype(np.float64) * np.repeat(np.repeat(c.get(scale_name(name)), 16, 0), 16, 1)[:24, :64]
    )
    np.testing.assert_allclose(w.astype(np.float64), exact, rtol=2.0**-8)
    # Same std as the BF16 experts of the same seed, roughly (independent draws).
    ref = Checkpoint(random_checkpoint(tmp_path / "b", CFG, 0, progress=False)).get(name)
    ratio = np.std(w.astype(np.float32)) / np.std(ref.astype(np.float32))
    assert 0.6 < ratio < 1.6
    assert same_bits(mtp.rows(name, 3, 20), w[3:20])
    target_tensors(c)


# ---- rows ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rows_ckpt(tmp_path_factory) -> Checkpoint:
    return Checkpoint(
        random_checkpoint(tmp_path_factory.mktemp("rows") / "r", CFG, 9, include_target=False, progress=False)
    )


@settings(max_examples=30, deadline=None)
@given(start=st.integers(0, CFG.vocab_size), length=st.integers(0, CFG.vocab_size))
def test_get_rows_equals_the_slice(rows_ckpt, start, length):
    c = rows_ckpt
    stop = min(CFG.vocab_size, start + length)
    for name in (LM_HEAD, EMBED):
        assert same_bits(c.get_rows(name, start, stop), np.asarray(c.get(name))[start:stop])
    assert same_bits(mtp_tensors(c).rows(HEAD_ALIAS, start, stop), c.get(LM_HEAD)[start:stop])


def test_get_rows_out_of_range(ckpt_dir):
    c = Checkpoint(ckpt_dir)
    want = r"lm_head.weight: rows \[90, 98\) outside shape \[97, 64\]"
    with pytest.raises(CheckpointError, match=want):
        c.get_rows(LM_HEAD, 90, 98)
    with pytest.raises(CheckpointError, match="rows"):
        c.get_rows(LM_HEAD, 5, 4)


# ---- random weights give O(1) activations ----------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + eps) * w.astype(np.float64)


def test_random_weights_keep_activations_order_one(ckpt_dir):
    m = {k: v.astype(np.float64) for k, v in mtp_tensors(Checkpoint(ckpt_dir)).load().items()}
    rng = np.random.default_rng(0)
    h = rng.standard_normal(CFG.hidden_size)
    x = m[P + "eh_proj.weight"] @ np.concatenate(
        [_rms(m[EMBED_ALIAS][11], m[P + "enorm.weight"]), _rms(h, m[P + "hnorm.weight"])]
    )
    assert 0.5 < np.std(x) < 2
    y = _rms(x, m[P + "input_layernorm.weight"])
    for proj in (
        "self_attn.q_a_proj",
        "self_attn.kv_a_proj_with_mqa",
        "mlp.experts.0.gate_proj",
        "mlp.shared_experts.up_proj",
        "self_attn.indexer.wk",
    ):
        assert 0.4 < np.std(m[P + proj + ".weight"] @ y) < 2.5, proj
    assert np.abs(m[P + "mlp.gate.e_score_correction_bias"]).max() < 0.1
    assert np.abs(m[P + "self_attn.indexer.index_kpool_compress_ape"]).max() < 0.1
    assert np.all(np.abs(m[P + "enorm.weight"] - 1) <= 0.1 + 1e-2)
    logits = m[HEAD_ALIAS] @ _rms(x, m[P + "shared_head.norm.weight"])
    top2 = np.sort(logits)[-2:]
    assert 2 < np.std(logits) < 8 and top2[1] - top2[0] > 1e-3
