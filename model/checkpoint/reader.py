"""Open a Hugging Face checkpoint directory: ``config.json`` plus one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``. Tensors come back as read-only memmap views;
FP8 block-scaled weights are dequantised when asked for as BF16."""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from model.config import ModelConfig, ParallelConfig

from . import fp8
from .safetensors_io import DTYPES, CheckpointError, SafetensorsFile, TensorInfo, dtype_name

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _shape_str(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


class Checkpoint:
    """A checkpoint directory, its headers read on open, its data mapped on first access.

    ``parallel`` and ``dsa_max_context`` pass through to ``ModelConfig.from_hf_dict``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        parallel: ParallelConfig | None = None,
        dsa_max_context: int | None = None,
    ) -> None:
        self.path = Path(path)
        self._parallel = parallel
        self._dsa_max_context = dsa_max_context
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a checkpoint: not a directory")
        if not (self.path / CONFIG_FILE).is_file():
            raise CheckpointError(f"{self.path} is not a checkpoint: no {CONFIG_FILE}")
        self.files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}  # tensor name -> file name
        if (self.path / INDEX_FILE).is_file():
            self._open_index()
        elif (self.path / SINGLE_FILE).is_file():
            self._open_file(SINGLE_FILE)
            self._where = {n: SINGLE_FILE for n in self.files[SINGLE_FILE].tensors}
        else:
            raise CheckpointError(
                f"{self.path} is not a checkpoint: no {INDEX_FILE} and no {SINGLE_FILE}"
            )
        log.debug("opened %s: %d tensors in %d files", self.path, len(self._where), len(self.files))

    # ---- opening -----------------------------------------------------------------------------

    def _open_file(self, fname: str) -> SafetensorsFile:
        if fname not in self.files:
            fpath = self.path / fname
            if not fpath.is_file():
                raise CheckpointError(f"{self.path}: {INDEX_FILE} names shard {fname}, "
                                      "which does not exist")
            self.files[fname] = SafetensorsFile(fpath)
        return self.files[fname]

    def _open_index(self) -> None:
        try:
            index = json.loads((self.path / INDEX_FILE).read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.path / INDEX_FILE}: not a safetensors index ({e})") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{self.path / INDEX_FILE}: weight_map is not an object")
        # The index is the authority on which tensors exist; each must be where it says.
        for name, fname in weight_map.items():
            if name not in self._open_file(fname).tensors:
                raise CheckpointError(
                    f"{self.path}: {INDEX_FILE} puts tensor {name} in {fname}, which lacks it"
                )
        self._where = dict(weight_map)
        total = (index.get("metadata") or {}).get("total_size")
        actual = sum(self.info(n).nbytes for n in self._where)
        if total is not None and int(total) != actual:
            # Published indexes disagree with their shards often enough that this only warns.
            log.warning("%s: index total_size %s, tensors hold %d bytes", self.path, total, actual)

    # ---- config ------------------------------------------------------------------------------

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """The raw ``config.json``; a file that is not a JSON object is refused by name."""
        path = self.path / CONFIG_FILE
        text = path.read_bytes()
        if not text.strip():
            raise CheckpointError(f"{path} is empty")
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object, found {type(raw).__name__}")
        return raw

    @cached_property
    def config(self) -> ModelConfig:
        """Parsed on first use, so a config this runtime rejects still lets raw tensors be read."""
        return ModelConfig.from_hf_dict(
            self.hf_config, parallel=self._parallel, dsa_max_context=self._dsa_max_context
        )

    @cached_property
    def fp8_block(self) -> tuple[int, int]:
        q = self.hf_config.get("quantization_config") or {}
        block = q.get("weight_block_size") or fp8.DEFAULT_BLOCK
        return int(block[0]), int(block[1])

    # ---- raw access --------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def _missing(self, name: str, hint: bool = True) -> CheckpointError:
        msg = f"tensor {name} is missing from checkpoint {self.path}"
        if hint:
            # Only names of the same layer are candidates: difflib over a whole GLM-5
            # (~70k names) per miss would take seconds.
            layer = ".".join(name.split(".")[:3])
            close = difflib.get_close_matches(
                name, [n for n in self._where if n.startswith(layer)], n=1, cutoff=0.8
            )
            if close:
                msg += f" (did you mean {close[0]}?)"
        return CheckpointError(msg)

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape and location of a stored tensor, without reading it."""
        if name not in self._where:
            raise self._missing(name)
        return self.files[self._where[name]].tensors[name]

    def get(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only memmap view: no copy, nothing read until used."""
        if name not in self._where:
            raise self._missing(name)
        return self.files[self._where[name]].get(name)

    def get_rows(self, name: str, start: int, stop: int, dtype: str | np.dtype | None = None
                 ) -> np.ndarray:
        """Rows [start, stop) of axis 0, mapping only their bytes (vocab or expert sharding).

        With ``dtype`` BF16 and an FP8 block-scaled tensor, the rows come back dequantised.
        """
        info = self.info(name)
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise CheckpointError(
                f"tensor {name}: rows [{start}, {stop}) outside shape {_shape_str(info.shape)}"
            )
        rows = self.files[self._where[name]].rows(name, start, stop)
        if dtype is None or dtype_name(dtype) == info.dtype:
            return rows
        problem = self._fp8_problem(name, info, dtype_name(dtype))
        if problem:
            raise CheckpointError(problem)
        scale = self.get(fp8.scale_name(name))
        return fp8.dequantize(rows, scale, DTYPES[dtype_name(dtype)], start, self.fp8_block)

    # ---- checked access ----------------------------------------------------------------------

    def _fp8_problem(self, name: str, info: TensorInfo, want: str) -> str | None:
        """Why a stored tensor cannot stand for ``want`` through FP8 dequantisation, or None."""
        found = f"tensor {name}: expected dtype {want}, found {info.dtype}"
        if info.dtype != "F8_E4M3" or want not in ("BF16", "F16", "F32") or len(info.shape) != 2:
            return found
        sname = fp8.scale_name(name)
        if sname not in self._where:
            return f"{found} without its block scales {sname}"
        sinfo = self.info(sname)
        want_shape = fp8.scale_shape(info.shape, self.fp8_block)
        if sinfo.dtype != "F32" or sinfo.shape != want_shape:
            return (f"tensor {sname} (block scales of {name}): "
                    f"expected F32{_shape_str(want_shape)}, "
                    f"found {sinfo.dtype}{_shape_str(sinfo.shape)}")
        return None

    def check(self, name: str, shape: tuple[int, ...], dtype: str | np.dtype) -> str | None:
        """What is wrong with ``name`` as ``dtype[shape]`` (None if usable), reading no data."""
        if name not in self._where:
            return str(self._missing(name, hint=False))
        info = self.info(name)
        want = dtype_name(dtype)
        if tuple(shape) != info.shape:
            return (f"tensor {name}: expected shape {_shape_str(shape)}, "
                    f"found {_shape_str(info.shape)}")
        if info.dtype != want:
            return self._fp8_problem(name, info, want)
        return None

    def get_checked(self, name: str, shape: tuple[int, ...], dtype: str | np.dtype) -> np.ndarray:
        """The tensor if it is ``dtype[shape]``, else CheckpointError naming it, expected, found.

        An F8_E4M3 tensor with ``.weight_scale_inv`` block scales, asked for as BF16, comes back
        dequantised (a new array; every other case is a view of the file).
        """
        problem = self.check(name, shape, dtype)
        if problem:
            raise CheckpointError(problem)
        info = self.info(name)
        want = dtype_name(dtype)
        if info.dtype == want:
            return self.get(name)
        return fp8.dequantize(self.get(name), self.get(fp8.scale_name(name)), DTYPES[want],
                              0, self.fp8_block)

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Drop our file mappings; arrays already returned stay valid."""
        for f in self.files.values():
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpoint({str(self.path)!r}, {len(self._where)} tensors, "
                f"{len(self.files)} files)")
