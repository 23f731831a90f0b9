"""Check a checkpoint against the expected layout before loading anything.

Every expected tensor is checked by header (name, shape, dtype) first and all problems are
reported together; only then is a lazy mapping handed out, whose items read (and, for FP8
weights, dequantise) on access.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from model.config import ModelConfig
from model.weights_layout import (
    Layout,
    TensorSpec,
    mtp_layout,
    mtp_optional_layout,
    mtp_shared_aliases,
    target_layout,
)

from . import fp8
from .reader import Checkpoint
from .safetensors_io import CheckpointError

# A config that mismatches a checkpoint wholesale yields thousands of problems; list a few.
MAX_LISTED_PROBLEMS = 20


@dataclass(frozen=True)
class Resolved:
    spec: TensorSpec  # what is expected, under the logical name
    source: str  # the stored tensor it is read from (its layout's name; for a shared
    # alias, the shared tensor's)


class TensorSet(Mapping[str, np.ndarray]):
    """Validated tensors by logical name, read on access (nothing is cached: FP8 tensors are
    dequantised on each access, so keep what you fetch)."""

    def __init__(self, ckpt: Checkpoint, resolved: dict[str, Resolved]) -> None:
        self.checkpoint = ckpt
        self._resolved = resolved

    def __getitem__(self, name: str) -> np.ndarray:
        r = self._resolved[name]
        return self.checkpoint.get_checked(r.source, r.spec.shape, r.spec.dtype, r.spec.accept)

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved)

    def __len__(self) -> int:
        return len(self._resolved)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read (and dequantise) the tensor just to test membership.
        return name in self._resolved

    def has(self, name: str) -> bool:
        return name in self._resolved

    def spec(self, name: str) -> TensorSpec:
        return self._resolved[name].spec

    def source(self, name: str) -> str:
        """The stored name behind ``name``: where two names share one tensor, upload it once."""
        return self._resolved[name].source

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) in the expected dtype, reading only those rows."""
        r = self._resolved[name]
        return self.checkpoint.get_rows(r.source, start, stop, r.spec.dtype, r.spec.accept)

    def block_fp8_stored(self, name: str) -> bool:
        """Whether ``name`` is stored as FP8 (reads its header only)."""
        return self.checkpoint.info(self._resolved[name].source).dtype == "F8_E4M3"

    def block_fp8(self, name: str) -> tuple[np.ndarray, np.ndarray, tuple[int, int]] | None:
        """(FP8 values, F32 block scales, block size) of ``name`` when it is stored block-scaled
        FP8 (validated: the scales' shape matches), else None: the bytes as the checkpoint holds
        them, for kernels that apply the scales themselves."""
        r = self._resolved[name]
        ckpt = self.checkpoint
        if ckpt.info(r.source).dtype != "F8_E4M3":
            return None
        return ckpt.get(r.source), ckpt.get(fp8.scale_name(r.source)), ckpt.fp8_block

    def load(self) -> dict[str, np.ndarray]:
        """Every tensor, as arrays (views of the file where no dequantisation is needed)."""
        return {name: self[name] for name in self}


def _validate(
    ckpt: Checkpoint, what: str, layout: Layout, aliases: Mapping[str, str], optional: Layout
) -> TensorSet:
    """Check every tensor of ``layout`` (logical names) under its stored name."""
    problems: list[str] = []
    resolved: dict[str, Resolved] = {}
    for name, spec in layout.items():
        stored = ckpt.disk_name(name)
        problem = ckpt.check(stored, spec.shape, spec.dtype, spec.accept)
        if problem:
            problems.append(problem)
        resolved[name] = Resolved(spec, stored)
    for name, shared in aliases.items():
        spec = optional[name]
        own, shared = ckpt.disk_name(name), ckpt.disk_name(shared)
        source = own if ckpt.has(own) else shared
        if not ckpt.has(source):
            problems.append(
                f"{ckpt.check(shared, spec.shape, spec.dtype)}, and so is {own}, "
                "the block's own copy, which would stand for it"
            )
            continue
        problem = ckpt.check(source, spec.shape, spec.dtype, spec.accept)
        if problem:
            problems.append(problem if source == own else f"{problem} (shared as {own})")
        resolved[name] = Resolved(spec, source)
    if problems:
        listed = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(listed)
        raise CheckpointError(
            f"checkpoint {ckpt.path} does not hold the {what} that its config describes "
            f"({len(problems)} problem{'s' * (len(problems) != 1)}):\n  "
            + "\n  ".join(listed)
            + (f"\n  ... and {more} more" if more else "")
        )
    return TensorSet(ckpt, resolved)


def mtp_tensors(ckpt: Checkpoint, cfg: ModelConfig | None = None) -> TensorSet:
    """The MTP block's tensors, plus its head and embedding under the block's own names
    (P``shared_head.head.weight``, P``embed_tokens.weight``): the block's copy where stored
    (GLM-4.5), else ``lm_head.weight`` / ``model.embed_tokens.weight`` (GLM-5)."""
    cfg = cfg or ckpt.config
    return _validate(ckpt, "MTP block", mtp_layout(cfg), mtp_shared_aliases(cfg), mtp_optional_layout(cfg))


def target_tensors(ckpt: Checkpoint, cfg: ModelConfig | None = None) -> TensorSet:
    """Every tensor of the target model (embedding, layers, final norm, head)."""
    cfg = cfg or ckpt.config
    return _validate(ckpt, "target model", target_layout(cfg), {}, {})
