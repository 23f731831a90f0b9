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
from .naming import NameLayout, disk_name, layout_of
from .safetensors_io import DTYPES, CheckpointError, SafetensorsFile, TensorInfo, dtype_name

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _shape_str(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


class Checkpoint:
    """A checkpoint directory: its index read on open, a shard's header when one of its tensors
    is first asked for, its data mapped on first access. Names here are as stored; the project's
    logical names map to them through ``disk_name`` (``naming``).

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
        self._where: dict[str, str] = {}  # stored tensor name -> file name
        self._present: dict[str, bool] = {}  # shard file name -> is it in the directory
        self._by_file: dict[str, list[str]] = {}  # shard file name -> the index's names in it
        if (self.path / INDEX_FILE).is_file():
            self._read_index()
        elif (self.path / SINGLE_FILE).is_file():
            self._open_file(SINGLE_FILE)
            self._where = {n: SINGLE_FILE for n in self.files[SINGLE_FILE].tensors}
        else:
            raise CheckpointError(f"{self.path} is not a checkpoint: no {INDEX_FILE} and no {SINGLE_FILE}")
        log.debug(
            "opened %s: %d tensors in %d files", self.path, len(self._where), len(set(self._where.values()))
        )

    # ---- opening -----------------------------------------------------------------------------

    def shard_present(self, fname: str) -> bool:
        if fname not in self._present:
            self._present[fname] = (self.path / fname).is_file()
        return self._present[fname]

    def _open_file(self, fname: str) -> SafetensorsFile:
        """A shard's header, read on first use. The index is the authority on which tensors
        exist; each tensor it puts in this shard must be there."""
        if fname not in self.files:
            f = SafetensorsFile(self.path / fname)
            lacking = [n for n in self._by_file.get(fname, ()) if n not in f.tensors]
            if lacking:
                raise CheckpointError(
                    f"{self.path}: {INDEX_FILE} puts tensor {lacking[0]} in {fname}, which lacks it"
                )
            self.files[fname] = f
        return self.files[fname]

    def _read_index(self) -> None:
        """Only the index: shards are opened when one of their tensors is asked for, so a copy
        that holds some shards of a published checkpoint (a drafter-only copy: the MTP layer, the
        embedding and the head) opens, and opening reads no shard of a 76,000-name index."""
        try:
            index = json.loads((self.path / INDEX_FILE).read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.path / INDEX_FILE}: not a safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(
                f"{self.path / INDEX_FILE}: weight_map is not an object of tensor name -> shard file name"
            )
        self._where = dict(weight_map)
        for name, fname in self._where.items():
            self._by_file.setdefault(fname, []).append(name)

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
    def layout(self) -> NameLayout:
        """How tensor names are stored: flat, or as GLM-5.3-Flash is published."""
        return layout_of(self.hf_config)

    def disk_name(self, logical: str) -> str:
        """The stored name of the tensor the project calls ``logical`` (``naming``)."""
        return disk_name(logical, self.layout)

    @cached_property
    def config(self) -> ModelConfig:
        """Parsed on first use, so a config this runtime rejects still lets raw tensors be read."""
        return ModelConfig.from_hf_dict(
            self.hf_config, parallel=self._parallel, dsa_max_context=self._dsa_max_context
        )

    @cached_property
    def fp8_block(self) -> tuple[int, int]:
        q = (
            self.hf_config.get("quantization_config")
            or (self.hf_config.get("text_config") or {}).get("quantization_config")
            or {}
        )
        block = q.get("weight_block_size") or fp8.DEFAULT_BLOCK
        return int(block[0]), int(block[1])

    # ---- raw access --------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._where)

    def shards(self) -> list[str]:
        """The files the index names (present or not)."""
        return sorted(set(self._where.values()))

    def where(self, name: str) -> str | None:
        """The file the index puts ``name`` in, None if it lists no such tensor."""
        return self._where.get(name)

    def has(self, name: str) -> bool:
        """Listed, and its file is in the directory."""
        return name in self._where and self.shard_present(self._where[name])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.has(name)

    def _missing(self, name: str, hint: bool = True) -> CheckpointError:
        msg = f"tensor {name} is missing from checkpoint {self.path}"
        if name in self._where:
            return CheckpointError(
                f"{msg}: {INDEX_FILE} puts it in {self._where[name]}, which is not in the directory"
            )
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
        """Dtype, shape and location of a stored tensor, reading its file's header only."""
        if not self.has(name):
            raise self._missing(name)
        return self._open_file(self._where[name]).tensors[name]

    def get(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only memmap view: no copy, nothing read until used."""
        if not self.has(name):
            raise self._missing(name)
        return self._open_file(self._where[name]).get(name)

    def get_rows(
        self,
        name: str,
        start: int,
        stop: int,
        dtype: str | np.dtype | None = None,
        accept: tuple[str, ...] = (),
    ) -> np.ndarray:
        """Rows [start, stop) of axis 0, mapping only their bytes (vocab or expert sharding).

        With ``dtype`` BF16 and an FP8 block-scaled tensor, the rows come back dequantised; a
        stored dtype in ``accept`` is converted.
        """
        info = self.info(name)
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise CheckpointError(
                f"tensor {name}: rows [{start}, {stop}) outside shape {_shape_str(info.shape)}"
            )
        rows = self._open_file(self._where[name]).rows(name, start, stop)
        if dtype is None or dtype_name(dtype) == info.dtype:
            return rows
        if info.dtype in accept:
            return rows.astype(DTYPES[dtype_name(dtype)])
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
        if not self.has(sname):
            return f"{found} without its block scales {sname}"
        sinfo = self.info(sname)
        want_shape = fp8.scale_shape(info.shape, self.fp8_block)
        if sinfo.dtype != "F32" or sinfo.shape != want_shape:
            return (
                f"tensor {sname} (block scales of {name}): "
                f"expected F32{_shape_str(want_shape)}, "
                f"found {sinfo.dtype}{_shape_str(sinfo.shape)}"
            )
        return None

    def check(
        self, name: str, shape: tuple[int, ...], dtype: str | np.dtype, accept: tuple[str, ...] = ()
    ) -> str | None:
        """What is wrong with ``name`` as ``dtype[shape]`` (None if usable), reading no data.
        A stored dtype in ``accept`` stands for ``dtype`` (converted when read)."""
        if not self.has(name):
            return str(self._missing(name, hint=False))
        info = self.info(name)
        want = dtype_name(dtype)
        if tuple(shape) != info.shape:
            return f"tensor {name}: expected shape {_shape_str(shape)}, found {_shape_str(info.shape)}"
        if info.dtype != want and info.dtype not in accept:
            return self._fp8_problem(name, info, want)
        return None

    def get_checked(
        self, name: str, shape: tuple[int, ...], dtype: str | np.dtype, accept: tuple[str, ...] = ()
    ) -> np.ndarray:
        """The tensor if it is ``dtype[shape]``, else CheckpointError naming it, expected, found.

        An F8_E4M3 tensor with ``.weight_scale_inv`` block scales, asked for as BF16, comes back
        dequantised, and a stored dtype in ``accept`` converted (a new array; every other case is
        a view of the file).
        """
        problem = self.check(name, shape, dtype, accept)
        if problem:
            raise CheckpointError(problem)
        info = self.info(name)
        want = dtype_name(dtype)
        if info.dtype == want:
            return self.get(name)
        if info.dtype in accept:
            return np.asarray(self.get(name)).astype(DTYPES[want])
        return fp8.dequantize(self.get(name), self.get(fp8.scale_name(name)), DTYPES[want], 0, self.fp8_block)

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
        return (
            f"Checkpoint({str(self.path)!r}, {len(self._where)} tensors, "
            f"{len(set(self._where.values()))} files)"
        )
