"""The safetensors file format, read and written with NumPy and ml_dtypes only.

A file is an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the
data buffer; offsets are relative to the buffer's start. We read through ``np.memmap`` rather than
the ``safetensors`` package because its NumPy loader cannot produce F8_E4M3 arrays (safetensors
0.8's ``numpy.load_file`` fails on them), and a memmap view lets a caller take a row range of a
1.3 GB head without reading the rest.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint or safetensors file is malformed, or lacks a tensor, or holds a wrong one."""


# safetensors dtype names -> NumPy dtypes (explicitly little-endian: the format is).
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES: dict[np.dtype, str] = {dt.newbyteorder("="): name for name, dt in DTYPES.items()}

# The official reader refuses headers above 100 MB; so do we (a corrupt length would otherwise
# make us allocate gigabytes).
MAX_HEADER_BYTES = 100_000_000
# The official writer pads the header with spaces so the buffer starts 8-byte aligned; sorting
# tensors by descending item size then keeps every tensor aligned to its own item size.
HEADER_ALIGN = 8


def dtype_name(dtype: str | np.dtype | type) -> str:
    """The safetensors name of a dtype given as a name (``"BF16"``) or anything NumPy accepts."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise CheckpointError(f"unknown dtype {dtype!r}") from e
    name = _NAMES.get(dt.newbyteorder("="))
    if name is None:
        raise CheckpointError(f"dtype {dt} has no safetensors equivalent (supported: {', '.join(DTYPES)})")
    return name


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype name, shape and absolute byte range."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def nbytes_of(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def _parse_header(path: Path, raw: bytes, data_start: int, file_size: int) -> dict[str, TensorInfo]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    infos: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from e
        if dtype not in DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})"
            )
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise CheckpointError(f"{path}: tensor {name!r} has malformed offsets {[begin, end]}")
        if end - begin != nbytes_of(shape, dtype):
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {end - begin} bytes but {dtype}{shape} needs "
                f"{nbytes_of(shape, dtype)}"
            )
        spans.append((begin, end, name))
        infos[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + begin, data_start + end)
    # The format forbids holes and overlaps: the tensors tile the buffer exactly.
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            raise CheckpointError(
                f"{path}: tensor {name!r} starts at {begin}, expected {cursor} (hole or overlap)"
            )
        cursor = end
    if data_start + cursor != file_size:
        raise CheckpointError(
            f"{path}: file is {file_size} bytes but its header describes {data_start + cursor} "
            "(truncated or trailing bytes)"
        )
    return infos


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse one file's header without touching its data: (tensors by name, ``__metadata__``)."""
    path = Path(path)
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > file_size:
            raise CheckpointError(f"{path}: header length {n} is impossible for a {file_size}-byte file")
        raw = f.read(n)
    infos = _parse_header(path, raw, 8 + n, file_size)
    metadata = json.loads(raw).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is not an object")
    return infos, {str(k): str(v) for k, v in metadata.items()}


class SafetensorsFile:
    """One file, opened lazily: the header is parsed at once, the data mapped on first use."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._mm: np.memmap | None = None

    def _map(self) -> np.memmap:
        if self._mm is None:
            # Read-only: arrays handed out must not write through into the checkpoint.
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the mapped file (no copy, nothing read yet)."""
        return view(self._map(), self.tensors[name])

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of axis 0 as a view; the caller has checked the bounds."""
        return view(self._map(), self.tensors[name], (start, stop))

    def close(self) -> None:
        """Drop our mapping; arrays already handed out keep theirs alive."""
        self._mm = None


def view(mm: np.ndarray, info: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
    """A typed view of ``info`` (optionally rows [start, stop) of axis 0) inside a mapped file."""
    begin, shape = info.begin, info.shape
    if rows is not None:
        start, stop = rows
        row_bytes = nbytes_of(shape[1:], info.dtype)
        begin, shape = begin + start * row_bytes, (stop - start, *shape[1:])
    n = nbytes_of(shape, info.dtype)
    # Slice bytes first, then reinterpret: a reshape to () works for scalars and
    # zero-size tensors alike, where a direct view of the uint8 slice would not.
    return mm[begin : begin + n].view(info.np_dtype).reshape(shape)


@dataclass(frozen=True)
class PendingTensor:
    """A tensor to be written whose bytes are produced on demand, as contiguous chunks.

    ``chunks()`` yields arrays of dtype ``dtype`` whose bytes, concatenated, are the tensor in C
    order. It lets a writer hold one chunk in memory instead of one shard (or one 1.3 GB head).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


def pending(name: str, array: np.ndarray) -> PendingTensor:
    """Wrap an in-memory array as a ``PendingTensor``."""
    dtype = dtype_name(array.dtype)
    return PendingTensor(name, dtype, tuple(array.shape), lambda: (array,))


def _order(tensors: Sequence[PendingTensor]) -> list[PendingTensor]:
    # Descending item size, then name: every offset is then a multiple of its item size.
    return sorted(tensors, key=lambda t: (-DTYPES[t.dtype].itemsize, t.name))


def write_safetensors_streamed(
    path: str | Path,
    tensors: Sequence[PendingTensor],
    metadata: Mapping[str, str] | None = None,
    on_bytes: Callable[[int], object] | None = None,
) -> None:
    """Write one file; the header is known from names/dtypes/shapes, so data is streamed.

    The file appears under ``path`` only once complete (written as ``path.partial``, renamed),
    so an interrupted write never leaves a file that looks valid.
    """
    path = Path(path)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{path}: duplicate tensor names")
    ordered = _order(tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for t in ordered:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in ordered:
                written = 0
                want = DTYPES[t.dtype]
                for chunk in t.chunks():
                    chunk = np.asarray(chunk)
                    if chunk.dtype.newbyteorder("=") != want.newbyteorder("="):
                        raise CheckpointError(
                            f"{path}: tensor {t.name!r} is declared {t.dtype} but its data is {chunk.dtype}"
                        )
                    buf = np.ascontiguousarray(chunk, dtype=want).reshape(-1).view(np.uint8)
                    f.write(buf.data)
                    written += buf.size
                    if on_bytes is not None:
                        on_bytes(buf.size)
                if written != t.nbytes:
                    raise CheckpointError(
                        f"{path}: tensor {t.name!r} produced {written} bytes, "
                        f"{t.dtype}{list(t.shape)} needs {t.nbytes}"
                    )
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write in-memory arrays to one safetensors file (dtype taken from each array)."""
    write_safetensors_streamed(path, [pending(n, a) for n, a in tensors.items()], metadata)


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one file, as read-only memmap views."""
    f = SafetensorsFile(path)
    return {name: f.get(name) for name in f.tensors}
