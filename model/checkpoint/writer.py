"""Write checkpoints in the Hugging Face layout: ``config.json``, then one ``model.safetensors``
or shards ``model-XXXXX-of-YYYYY.safetensors`` with ``model.safetensors.index.json``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from model.config import ModelConfig

from .naming import NameLayout, disk_name
from .reader import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from .safetensors_io import CheckpointError, PendingTensor, pending, write_safetensors_streamed

log = logging.getLogger(__name__)

# Hugging Face's default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def plan_shards(tensors: Sequence[PendingTensor], max_shard_bytes: int) -> list[list[PendingTensor]]:
    """Greedy in the given order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[PendingTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _clear(directory: Path, overwrite: bool) -> None:
    """Refuse, or remove, a previous checkpoint: stale shards next to a new index would be read."""
    stale = [
        p
        for p in directory.iterdir()
        if p.name in (CONFIG_FILE, INDEX_FILE, SINGLE_FILE)
        or (p.name.startswith("model-") and p.name.endswith(".safetensors"))
    ]
    if stale and not overwrite:
        raise CheckpointError(
            f"{directory} already holds a checkpoint ({stale[0].name}); pass overwrite=True"
        )
    for p in stale:
        p.unlink()


def write_checkpoint(
    directory: str | Path,
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray] | Iterable[PendingTensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    extra_config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    layout: NameLayout = NameLayout.FLAT,
) -> Path:
    """Write ``tensors`` as they are (no layout check: tests write broken checkpoints on purpose).

    Names are the project's logical names, stored under ``layout``'s names (``naming``), and
    config.json takes that layout's form (``PUBLISHED``: nested under ``text_config``).
    Arrays keep their dtype (an ml_dtypes bfloat16 array is stored BF16). ``PendingTensor``s are
    produced chunk by chunk, so at most one chunk is in memory. One shard -> ``model.safetensors``
    and no index, as ``save_pretrained`` does. ``extra_config`` is merged into the top level of
    ``config.json`` (where the published checkpoint keeps ``quantization_config``).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _clear(directory, overwrite)
    items = [pending(n, a) for n, a in tensors.items()] if isinstance(tensors, Mapping) else list(tensors)
    items = [replace(t, name=disk_name(t.name, layout)) for t in items]
    shards = plan_shards(items, max_shard_bytes)
    total = sum(t.nbytes for t in items)
    files = [SINGLE_FILE] if len(shards) == 1 else [shard_name(i, len(shards)) for i in range(len(shards))]
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"writing {directory.name}", disable=not progress
    ) as bar:
        for fname, shard in zip(files, shards, strict=True):
            log.info("writing %s (%d tensors)", directory / fname, len(shard))
            write_safetensors_streamed(directory / fname, shard, {"format": "pt"}, on_bytes=bar.update)
    if len(shards) > 1:
        weight_map = {t.name: f for f, shard in zip(files, shards, strict=True) for t in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    # config.json last: a directory is a checkpoint only once everything else is in place.
    config = {**cfg.to_hf_dict(nested=layout is NameLayout.PUBLISHED), **(extra_config or {})}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory
