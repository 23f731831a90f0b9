"""``mtpdraft inspect PATH``: can a drafter be built from this checkpoint, and what would it hold?

Reads config.json, the index and the safetensors headers of the shards that hold the drafter's
tensors, never a tensor's bytes, so it answers in a second on a published checkpoint (76,108
names) and on a drafter-only copy that lacks the target's shards. It prints the model type and
layout, the MTP layer, every missing or mismatched tensor (expected against found), a summary of
the stored dtypes of the drafter's tensors, and the device bytes its weights would take.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from model.checkpoint import Checkpoint, CheckpointError
from model.checkpoint.fp8 import scale_name
from model.checkpoint.safetensors_io import DTYPES
from model.config import ConfigError, ModelConfig
from model.tensors import FP8_BLOCK
from model.weights import context_rows, fused_in_rows
from model.weights_layout import (
    TensorSpec,
    mtp_layout,
    mtp_optional_layout,
    mtp_prefix,
    mtp_shared_aliases,
)

# Exit statuses: a drafter can be built; it cannot (tensors missing or wrong); not a checkpoint
# this runtime reads at all (no config, a config it refuses).
OK, PROBLEMS, UNUSABLE = 0, 1, 2


@dataclass
class Report:
    """What ``inspect`` found; ``problems`` empty means a drafter can be built."""

    path: Path
    model_type: str
    layout: str
    cfg: ModelConfig
    names: int
    shards: int
    shards_needed: list[str]
    shards_absent: list[str]
    expected: int
    mtp_stored_prefix: str
    problems: list[str] = field(default_factory=list)
    dtypes: Counter = field(default_factory=Counter)  # stored dtype -> tensors
    dtype_bytes: Counter = field(default_factory=Counter)  # stored dtype -> bytes
    weight_bytes: int = 0
    fp8_head_bytes: int = 0

    @property
    def buildable(self) -> bool:
        return not self.problems


def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _gib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def drafter_device_bytes(cfg: ModelConfig, native_fp8: frozenset[str] = frozenset()) -> tuple[int, int]:
    """(weights, FP8 head copy) bytes an unsharded ``MtpProposer`` uploads for ``cfg``: every
    tensor of the block in its loaded dtype (BF16, or for the names in ``native_fp8`` FP8 with its
    128x128 F32 block scales, as the proposer keeps a checkpoint's block-scaled tensors), the
    embedding and the head, and the FP8 copy of the head it quantises on the device."""
    block = 0
    for s in mtp_layout(cfg).values():
        n = math.prod(s.shape)
        if s.name in native_fp8:
            block += n + math.prod(-(-d // b) for d, b in zip(s.shape, FP8_BLOCK)) * 4
        else:
            block += n * DTYPES[s.dtype].itemsize
    # fused_in's zero rows that align each batch row (model.weights.fused_in_rows).
    a, d = cfg.attention, cfg.dsa
    block += (fused_in_rows(cfg) - (context_rows(cfg) + a.q_lora_rank + d.index_n_heads)) * (
        cfg.hidden_size * 2
    )
    tables = 2 * cfg.vocab_size * cfg.hidden_size * 2
    return block + tables, cfg.vocab_size * cfg.hidden_size + cfg.vocab_size * 4


def inspect(path: str | Path) -> Report:
    """Check every tensor the drafter reads, by header; raise CheckpointError / ConfigError when
    the directory is not a checkpoint this runtime reads at all."""
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    hf = ckpt.hf_config
    model_type = str(hf.get("model_type", "?"))
    if "text_config" in hf:
        model_type += f" (text model {hf['text_config'].get('model_type', '?')})"
    expected: dict[str, TensorSpec] = dict(mtp_layout(cfg))
    optional = mtp_optional_layout(cfg)
    rep = Report(
        Path(path),
        model_type,
        ckpt.layout.value,
        cfg,
        len(ckpt.names()),
        len(ckpt.shards()),
        [],
        [],
        0,
        ckpt.disk_name(mtp_prefix(cfg)),
    )
    stored: dict[str, TensorSpec] = {}  # stored name -> what it must be
    stands_for: dict[str, str] = {}  # a shared tensor read for the block's own absent copy
    for name, spec in expected.items():
        stored[ckpt.disk_name(name)] = spec
    for own, shared in mtp_shared_aliases(cfg).items():
        # The block's own copy (GLM-4.5) where stored, else the target's tensor it shares.
        d_own, d_shared = ckpt.disk_name(own), ckpt.disk_name(shared)
        if ckpt.has(d_own):
            stored[d_own] = optional[own]
        else:
            stored[d_shared] = optional[own]
            stands_for[d_shared] = d_own
    rep.expected = len(stored)
    needed = set()
    for name, spec in stored.items():
        where = ckpt.where(name)
        if where is not None:
            needed.add(where)
        if where is not None and ckpt.shard_present(where):
            info = ckpt.info(name)
            rep.dtypes[info.dtype] += 1
            rep.dtype_bytes[info.dtype] += info.nbytes
            sname = scale_name(name)
            if info.dtype == "F8_E4M3" and ckpt.has(sname):
                s = ckpt.info(sname)
                rep.dtypes[s.dtype + " (block scales)"] += 1
                rep.dtype_bytes[s.dtype + " (block scales)"] += s.nbytes
                needed.add(ckpt.where(sname))
        problem = ckpt.check(name, spec.shape, spec.dtype, spec.accept)
        if problem:
            if not ckpt.has(name):
                problem += f" (expected {spec.dtype}{_shape(spec.shape)})"
                if name in stands_for:
                    problem += f", and so is {stands_for[name]}, the block's own copy"
            rep.problems.append(problem)
    rep.shards_needed = sorted(needed)
    rep.shards_absent = [f for f in rep.shards_needed if not ckpt.shard_present(f)]
    # What a proposer with native FP8 (its default) keeps FP8: the tensors stored block-scaled in
    # the block size its kernels apply; any other block size is refused at load (or dequantised).
    native = frozenset(
        n
        for n in expected
        if ckpt.fp8_block == FP8_BLOCK
        and ckpt.has(ckpt.disk_name(n))
        and ckpt.info(ckpt.disk_name(n)).dtype == "F8_E4M3"
    )
    rep.weight_bytes, rep.fp8_head_bytes = drafter_device_bytes(cfg, native)
    return rep


def render(rep: Report, out: TextIO) -> None:
    cfg = rep.cfg
    w = out.write
    w(f"checkpoint: {rep.path}\n")
    w(f"model type: {rep.model_type}; layout: {rep.layout}\n")
    w(
        f"config: hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.num_hidden_layers} target "
        f"layers, {cfg.moe.n_routed_experts} experts top-{cfg.moe.num_experts_per_tok}, index_kpool "
        f"{cfg.dsa.index_kpool}, tail {'selected' if cfg.dsa.always_select_tail else 'not selected'}"
        f", selection {'shared by' if cfg.dsa.share_for_mtp_iteration else 'run for'} drafts 2..k\n"
    )
    w(f"MTP layer: {cfg.mtp_layer_index} (tensors {rep.mtp_stored_prefix}*)\n")
    w(
        f"index: {rep.names} tensors in {rep.shards} files; the drafter reads {rep.expected} tensors "
        f"from {len(rep.shards_needed)} of them"
        + (f" ({len(rep.shards_absent)} absent: {', '.join(rep.shards_absent)})" if rep.shards_absent else "")
        + "\n"
    )
    if rep.dtypes:
        w("stored dtypes of the drafter's tensors:\n")
        for dt, n in sorted(rep.dtypes.items(), key=lambda kv: -rep.dtype_bytes[kv[0]]):
            w(f"  {dt:<20} {n:6d} tensors  {_gib(rep.dtype_bytes[dt])}\n")
    w(
        f"device bytes the drafter would hold (one rank): {_gib(rep.weight_bytes)} of weights "
        f"(embedding and head included, block-scaled FP8 tensors as FP8) + {_gib(rep.fp8_head_bytes)} for "
        "the FP8 copy of the head; per-sequence caches come on top, sized by the served context\n"
    )
    if rep.problems:
        w(f"{len(rep.problems)} problem{'s' * (len(rep.problems) != 1)}:\n")
        for p in rep.problems:
            w(f"  {p}\n")
        w("a drafter cannot be built from this checkpoint\n")
    else:
        w("a drafter can be built from this checkpoint\n")


def run(path: str | Path, out: TextIO, err: TextIO) -> int:
    """Print the report; the exit status (OK, PROBLEMS or UNUSABLE)."""
    try:
        rep = inspect(path)
    except (CheckpointError, ConfigError) as e:
        err.write(f"mtpdraft inspect: {path} is not a checkpoint this runtime reads: {e}\n")
        return UNUSABLE
    render(rep, out)
    return OK if rep.buildable else PROBLEMS
