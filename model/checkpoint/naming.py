"""Where a tensor of the model lives on disk, per checkpoint layout.

The rest of the project names tensors by their logical (flat) names: ``model.layers.{L}.…``,
``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``. Two layouts store them:

- ``FLAT``: under those names (GLM-5 and this project's own checkpoints, a flat config.json);
- ``PUBLISHED``: GLM-5.3-Flash as published, whose config.json nests the text model under
  ``text_config`` and whose text tensors are prefixed ``model.language_model.`` (the head stays
  ``lm_head.weight``; docs/checkpoint.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

FLAT_PREFIX = "model."
PUBLISHED_PREFIX = "model.language_model."


class NameLayout(str, Enum):
    FLAT = "flat"
    PUBLISHED = "published"


def layout_of(hf_config: Mapping[str, Any]) -> NameLayout:
    """A nested config (``text_config``) is the published multimodal layout."""
    return NameLayout.PUBLISHED if "text_config" in hf_config else NameLayout.FLAT


def disk_name(logical: str, layout: NameLayout) -> str:
    """The stored name of the tensor the project calls ``logical``."""
    if layout is NameLayout.PUBLISHED and logical.startswith(FLAT_PREFIX):
        return PUBLISHED_PREFIX + logical[len(FLAT_PREFIX) :]
    return logical


def logical_name(stored: str, layout: NameLayout) -> str | None:
    """The inverse of ``disk_name``; None for a stored tensor outside the text model (the
    published checkpoint's vision tower, for one)."""
    if layout is NameLayout.FLAT:
        return stored
    if stored.startswith(PUBLISHED_PREFIX):
        return FLAT_PREFIX + stored[len(PUBLISHED_PREFIX) :]
    return None if stored.startswith(FLAT_PREFIX) else stored


__all__ = ["FLAT_PREFIX", "PUBLISHED_PREFIX", "NameLayout", "disk_name", "layout_of", "logical_name"]
