"""The byte-level corpus (the Python standard library's own ``.py`` sources) and the acceptance
protocol's sample positions. No PyTorch here: the runtime side can import this module to mirror the
protocol exactly.

Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages``
and ``__pycache__``, read as bytes (tokens are the byte values 0..255), in sorted order of the
POSIX relative path. A file is held out for evaluation when
``int(sha256(relpath).hexdigest(), 16) % HELDOUT_MODULUS == 0`` (a deterministic ~2 % of files that
does not depend on the Python version's file list; a version that lacks a file simply lacks it).

Acceptance protocol (``sample_positions``): the held-out files in sorted relpath order; in each, the
positions ``t = start, start + stride, ...`` with ``t < len(file)`` and ``t <= max_t``; the first
``n_samples`` of that sequence. A sample's context is ``bytes[0..t]`` (t + 1 tokens, t inclusive).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

HELDOUT_MODULUS = 50

# Defaults of the acceptance protocol (eval_acceptance.py and the runtime's mirror use these).
SAMPLE_START = 16
SAMPLE_STRIDE = 37
SAMPLE_MAX_T = 1000
SAMPLE_COUNT = 512


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    h = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16)
    return h % HELDOUT_MODULUS == 0


def list_py_files(root: Path | None = None) -> list[str]:
    """Sorted POSIX relative paths of the stdlib's .py files (no site-packages, no caches)."""
    root = Path(root or stdlib_root())
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        parts = rel_dir.parts
        if parts and (parts[0] in ("site-packages", "dist-packages") or "__pycache__" in parts):
            dirnames[:] = []
            continue
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("__pycache__", "site-packages", "dist-packages")
        )
        for f in filenames:
            if f.endswith(".py"):
                out.append((rel_dir / f).as_posix())
    return sorted(out)


def load_corpus(root: Path | None = None) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
    """(train files, held-out files) as (relpath, bytes), each sorted by relpath. Empty and
    unreadable files are skipped."""
    root = Path(root or stdlib_root())
    train, held = [], []
    for rel in list_py_files(root):
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        if not data:
            continue
        (held if is_heldout(rel) else train).append((rel, data))
    return train, held


def heldout_files(root: Path | None = None) -> list[tuple[str, bytes]]:
    return load_corpus(root)[1]


def sample_positions(
    files: Iterable[tuple[str, int]] | Sequence[tuple[str, bytes]],
    *,
    start: int = SAMPLE_START,
    stride: int = SAMPLE_STRIDE,
    max_t: int = SAMPLE_MAX_T,
    n_samples: int | None = SAMPLE_COUNT,
) -> list[tuple[str, int]]:
    """The protocol's samples as (relpath, t): files in sorted relpath order, t = start, start +
    stride, ... while t < len(file) and t <= max_t, truncated to the first n_samples.

    ``files`` holds (relpath, length) or (relpath, bytes) pairs.
    """
    items = []
    for rel, data in files:
        length = data if isinstance(data, int) else len(data)
        items.append((rel, length))
    out: list[tuple[str, int]] = []
    for rel, length in sorted(items):
        for t in range(start, min(length - 1, max_t) + 1, stride):
            out.append((rel, t))
            if n_samples is not None and len(out) >= n_samples:
                return out
    return out
