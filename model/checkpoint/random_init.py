"""Random checkpoints of any config, in the real layout, for tests and benchmarks.

Every tensor is drawn from its own generator seeded by (seed, name), chunk by chunk, so the
values do not depend on sharding or on which other tensors are written, and a reference-shape
checkpoint (tens of GB) is written with one chunk in memory.

Scales keep a block's activations O(1): projections have std scale/sqrt(fan_in) on inputs of
O(1) entries, norms are near 1, biases and ``compress_ape`` near 0. The head has a gain so the
logits spread over a few units and the argmax stands out from the rest of the vocabulary.
Values are uniform rather than normal: 2.5x faster to draw, same variance, no outliers.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from model.config import ModelConfig
from model.weights_layout import (
    Init,
    TensorSpec,
    is_published_fp8,
    is_routed_expert,
    mtp_layout,
    mtp_optional_layout,
    mtp_shared_aliases,
    shared_layout,
    target_layout,
)
from runtime.dtypes import BF16, FP8, FP8_MAX, to_fp8_saturating

from . import fp8
from .naming import NameLayout
from .safetensors_io import DTYPES, PendingTensor
from .writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

HEAD_GAIN = 4.0
NORM_SPREAD = 0.1  # norm weights in 1 +- this
SMALL_STD = 0.02
CHUNK_VALUES = 1 << 24  # 64 MB of f32 per chunk
_SQRT3 = float(np.sqrt(3.0))


def _std(spec: TensorSpec, scale: float) -> float:
    if spec.init is Init.LINEAR:
        return scale / np.sqrt(spec.fan_in)
    if spec.init is Init.HEAD:
        return HEAD_GAIN * scale / np.sqrt(spec.fan_in)
    if spec.init is Init.EMBEDDING:
        return 1.0
    if spec.init is Init.NORM:
        return NORM_SPREAD / _SQRT3
    return SMALL_STD


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _row_chunks(shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    rows = shape[0] if shape else 1
    per_row = max(1, int(np.prod(shape[1:])) if len(shape) > 1 else 1)
    step = max(1, CHUNK_VALUES // per_row)
    for r in range(0, rows, step):
        yield r, min(rows, r + step)


def _uniform(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """``n`` f32 values uniform on [-std*sqrt3, std*sqrt3] (variance std^2)."""
    half = np.float32(std * _SQRT3)
    return (rng.random(n, dtype=np.float32) * (2 * half) - half).astype(np.float32)


def _dense(spec: TensorSpec, seed_name: str, seed: int, scale: float, out_name: str) -> PendingTensor:
    """A tensor in its logical dtype; ``seed_name`` lets an alias repeat another tensor's values."""
    std = _std(spec, scale)
    offset = 1.0 if spec.init is Init.NORM else 0.0
    dtype = DTYPES[spec.dtype]

    def chunks() -> Iterator[np.ndarray]:
        rng = _rng(seed, seed_name)
        row_values = int(np.prod(spec.shape[1:])) if len(spec.shape) > 1 else 1
        for a, b in _row_chunks(spec.shape):
            yield (_uniform(rng, (b - a) * row_values, std) + np.float32(offset)).astype(dtype)

    return PendingTensor(out_name, spec.dtype, spec.shape, chunks)


def _fp8(
    spec: TensorSpec, seed: int, scale: float, block: tuple[int, int]
) -> tuple[PendingTensor, PendingTensor]:
    """An FP8 block-scaled weight drawn directly in its stored form, so the weight and its scales
    come from independent generators and need not be held together. Block scales vary by +-50%
    so that a dequantiser that picks the wrong block is visibly wrong; the dequantised weight has
    about the std of its BF16 counterpart."""
    std = _std(spec, scale)
    sname = fp8.scale_name(spec.name)
    sshape = fp8.scale_shape(spec.shape, block)
    base = std * _SQRT3 / FP8_MAX  # makes q uniform on +-448 have variance std^2

    def scales() -> Iterator[np.ndarray]:
        rng = _rng(seed, sname)
        yield (base * (0.5 + rng.random(sshape, dtype=np.float32))).astype(np.float32)

    def weights() -> Iterator[np.ndarray]:
        rng = _rng(seed, spec.name)
        cols = spec.shape[1]
        for a, b in _row_chunks(spec.shape):
            q = _uniform(rng, (b - a) * cols, FP8_MAX / _SQRT3)
            yield to_fp8_saturating(q)

    return (
        PendingTensor(spec.name, "F8_E4M3", spec.shape, weights),
        PendingTensor(sname, "F32", sshape, scales),
    )


def random_tensors(
    cfg: ModelConfig,
    seed: int,
    *,
    include_target: bool = True,
    fp8_experts: bool = False,
    fp8_published: bool = False,
    store_mtp_head: bool = False,
    scale: float = 1.0,
    fp8_block: tuple[int, int] = fp8.DEFAULT_BLOCK,
) -> list[PendingTensor]:
    """The tensors ``random_checkpoint`` writes, unproduced (each draws on demand)."""
    layout = dict(target_layout(cfg) if include_target else shared_layout(cfg))
    layout.update(mtp_layout(cfg))
    out: list[PendingTensor] = []
    for spec in layout.values():
        if (fp8_experts and is_routed_expert(spec.name)) or (fp8_published and is_published_fp8(spec.name)):
            out.extend(_fp8(spec, seed, scale, fp8_block))
        else:
            out.append(_dense(spec, spec.name, seed, scale, spec.name))
    if store_mtp_head:
        # GLM-4.5 layout: the block's own copies, equal to the shared tensors as in real
        # checkpoints, so drafts do not depend on which copy a loader picks.
        optional = mtp_optional_layout(cfg)
        for name, shared in mtp_shared_aliases(cfg).items():
            out.append(_dense(optional[name], shared, seed, scale, name))
    return out


def random_checkpoint(
    directory: str | Path,
    cfg: ModelConfig,
    seed: int,
    *,
    include_target: bool = True,
    fp8_experts: bool = False,
    fp8_published: bool = False,
    store_mtp_head: bool = False,
    scale: float = 1.0,
    fp8_block: tuple[int, int] = fp8.DEFAULT_BLOCK,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
    layout: NameLayout = NameLayout.FLAT,
) -> Path:
    """Write random weights of ``cfg`` in the checkpoint layout and return the directory.

    ``include_target=False`` writes only the MTP block plus the shared embedding and head (what
    a drafter needs; the only option at reference shapes). ``fp8_experts`` stores the routed
    experts as F8_E4M3 + ``weight_scale_inv`` (and says so in ``quantization_config``);
    ``fp8_published`` stores FP8 exactly what the published GLM-5.3-Flash does (routed and shared
    experts, q_a, q_b, kv_a_proj_with_mqa, o_proj). ``store_mtp_head`` adds the block's own
    ``shared_head.head`` and ``embed_tokens``. ``fp8_block`` (default 128x128, the real
    convention) lets tiny configs span several blocks. ``scale`` multiplies the std of every
    projection and of the head. ``layout`` PUBLISHED writes the published names and the nested
    config.json.
    """
    tensors = random_tensors(
        cfg,
        seed,
        include_target=include_target,
        fp8_experts=fp8_experts,
        fp8_published=fp8_published,
        store_mtp_head=store_mtp_head,
        scale=scale,
        fp8_block=fp8_block,
    )
    extra = None
    if fp8_experts or fp8_published:
        extra = {
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(fp8_block),
            }
        }
    return write_checkpoint(
        directory,
        cfg,
        tensors,
        max_shard_bytes,
        extra_config=extra,
        overwrite=overwrite,
        progress=progress,
        layout=layout,
    )


# 64 MiB of random BF16 that every tiled weight is cut from.
POOL_ELEMS = 32 << 20


def tiled_mtp_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """For benchmarks at the reference shapes, where drawing 17 GB of random numbers costs minutes.
    Every tensor of the MTP block, the embedding and the head, at ``cfg``'s shapes: slices of one
    random pool at tensor-specific offsets (tiled when larger), so nothing is zero and building
    them costs a few copies, not a random draw per weight."""
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_ELEMS, dtype=np.float32) * 0.02).astype(BF16)
    salt = [0]

    def t(*shape: int, scale_one: bool = False) -> np.ndarray:
        n = math.prod(shape)
        salt[0] += 1
        if scale_one:  # norm weights near 1
            return (
                (1.0 + pool[salt[0] * 4099 % (POOL_ELEMS - n) :][:n].astype(np.float32))
                .astype(BF16)
                .reshape(shape)
            )
        if n <= POOL_ELEMS // 2:
            off = (salt[0] * 1_000_003) % (POOL_ELEMS - n)
            return pool[off : off + n].reshape(shape)
        return np.resize(pool, n).reshape(shape)

    a, d, m = cfg.attention, cfg.dsa, cfg.moe
    H, V = cfg.hidden_size, cfg.vocab_size
    P = f"model.layers.{cfg.mtp_layer_index}."
    A, X, M = P + "self_attn.", P + "self_attn.indexer.", P + "mlp."
    nh, I, E = a.num_attention_heads, m.moe_intermediate_size, m.n_routed_experts
    w = {
        "model.embed_tokens.weight": t(V, H),
        "lm_head.weight": t(V, H),
        P + "enorm.weight": t(H, scale_one=True),
        P + "hnorm.weight": t(H, scale_one=True),
        P + "eh_proj.weight": t(H, 2 * H),
        P + "input_layernorm.weight": t(H, scale_one=True),
        P + "post_attention_layernorm.weight": t(H, scale_one=True),
        P + "shared_head.norm.weight": t(H, scale_one=True),
        A + "q_a_proj.weight": t(a.q_lora_rank, H),
        A + "q_a_layernorm.weight": t(a.q_lora_rank, scale_one=True),
        A + "q_b_proj.weight": t(nh * a.qk_head_dim, a.q_lora_rank),
        A + "kv_a_proj_with_mqa.weight": t(a.kv_lora_rank + a.qk_rope_head_dim, H),
        A + "kv_a_layernorm.weight": t(a.kv_lora_rank, scale_one=True),
        A + "kv_b_proj.weight": t(nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        A + "o_proj.weight": t(H, nh * a.v_head_dim),
        X + "wq_b.weight": t(d.index_n_heads * d.index_head_dim, a.q_lora_rank),
        X + "wk.weight": t(d.index_head_dim, H),
        X + "weights_proj.weight": t(d.index_n_heads, H),
        X + "k_norm.weight": t(d.index_head_dim, scale_one=True),
        X + "k_norm.bias": t(d.index_head_dim),
        X + "index_kpool_compress_gate": t(d.index_head_dim, H),
        X + "index_kpool_compress_ape": t(d.index_kpool, d.index_head_dim),
        M + "gate.weight": t(E, H),
        M + "gate.e_score_correction_bias": (0.01 * rng.standard_normal(E)).astype(np.float32),
    }
    for e in range(E):
        w[M + f"experts.{e}.gate_proj.weight"] = t(I, H)
        w[M + f"experts.{e}.up_proj.weight"] = t(I, H)
        w[M + f"experts.{e}.down_proj.weight"] = t(H, I)
    if m.n_shared_experts:
        Is = I * m.n_shared_experts
        w[M + "shared_experts.gate_proj.weight"] = t(Is, H)
        w[M + "shared_experts.up_proj.weight"] = t(Is, H)
        w[M + "shared_experts.down_proj.weight"] = t(H, Is)
    return w


def fp8_on_disk_names(cfg: ModelConfig) -> list[str]:
    """The MTP block's tensors the published FP8 checkpoints store as 128x128 block-scaled FP8
    (REFERENCE.md): every routed and shared expert, q_a, q_b, kv_a_proj_with_mqa and o_proj."""
    P = f"model.layers.{cfg.mtp_layer_index}."
    A, M = P + "self_attn.", P + "mlp."
    names = [A + n + ".weight" for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")]
    for e in range(cfg.moe.n_routed_experts):
        names += [M + f"experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    if cfg.moe.n_shared_experts:
        names += [M + f"shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def tiled_fp8_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """``tiled_mtp_weights`` in the published FP8 layout: the tensors of ``fp8_on_disk_names`` as
    random FP8 E4M3 (slices of one random byte pool, exponent's top bit clear: finite, below 2 in
    magnitude) with random F32 block scales under ``name + '_scale_inv'``; the rest as there."""
    w = tiled_mtp_weights(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    pool = (rng.integers(0, 256, POOL_ELEMS, dtype=np.uint8) & np.uint8(0xBF)).view(FP8)
    for i, name in enumerate(fp8_on_disk_names(cfg)):
        out, inp = w[name].shape
        n = out * inp
        if n <= POOL_ELEMS // 2:
            off = (i * 1_000_003) % (POOL_ELEMS - n)
            q = pool[off : off + n].reshape(out, inp)
        else:
            q = np.resize(pool, n).reshape(out, inp)
        w[name] = q
        w[name + "_scale_inv"] = (0.005 + 0.01 * rng.random((-(-out // 128), -(-inp // 128)))).astype(
            np.float32
        )
    return w
