"""ctypes bindings for the part of ``libnccl.so.2`` this runtime uses.

Pointers, communicators and streams are plain ints. The library comes from the nvidia-nccl-cu13 /
-cu12 wheel, found with ``cuda.pathfinder``; failing that, from the system loader. Loading happens
on first use, not at import, so the host-only test suite never needs NCCL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from dataclasses import dataclass

from ..errors import CommError

log = logging.getLogger(__name__)

NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
UNIQUE_ID_BYTES = 128

_RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}

_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
# The ncclConfig_t prefix below is the layout of NCCL 2.17. NCCL copies min(config.size, its own
# sizeof) bytes over a default-initialised config and reads fields by declared version, so a
# prefix with an older version is accepted by every later NCCL and leaves the newer fields at
# their defaults. (Declaring the full struct of one NCCL release would break on the next.)
_CONFIG_VERSION = 21700


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class NcclConfig(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
    ]

    @classmethod
    def make(cls, *, blocking: bool) -> NcclConfig:
        u = _CONFIG_UNDEF_INT
        return cls(ctypes.sizeof(cls), _CONFIG_MAGIC, _CONFIG_VERSION, int(blocking), u, u, u, None)


def _find_library() -> str:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return load_nvidia_dynamic_lib("nccl").abs_path
    except Exception as e:  # pathfinder missing, or no wheel: try the system loader
        log.debug("cuda.pathfinder did not find NCCL (%s); trying the system loader", e)
    return ctypes.util.find_library("nccl") or "libnccl.so.2"


@dataclass(frozen=True)
class NcclVersion:
    code: int

    @property
    def triple(self) -> tuple[int, int, int]:
        c = self.code
        if c < 10000:  # NCCL <= 2.8 encodes X*1000 + Y*100 + Z
            return c // 1000, c % 1000 // 100, c % 100
        return c // 10000, c % 10000 // 100, c % 100

    def __str__(self) -> str:
        return "%d.%d.%d" % self.triple


class NcclLib:
    """The loaded library with typed entry points. Every call that returns ncclResult_t goes
    through ``check``, which raises CommError with the result's name and NCCL's own message."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or _find_library()
        try:
            self._dll = ctypes.CDLL(self.path)
        except OSError as e:
            raise CommError(
                f"cannot load NCCL from {self.path!r}: {e}; install nvidia-nccl-cu13 (or -cu12)"
            ) from e
        d = self._dll
        vp, ip, c_int = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int

        def fn(name: str, *argtypes: object, restype: object = c_int) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
            f = getattr(d, name)
            f.argtypes = list(argtypes)
            f.restype = restype
            return f

        self.ncclGetVersion = fn("ncclGetVersion", ip)
        self.ncclGetErrorString = fn("ncclGetErrorString", c_int, restype=ctypes.c_char_p)
        self.ncclGetUniqueId = fn("ncclGetUniqueId", ctypes.POINTER(NcclUniqueId))
        self.ncclCommInitRankConfig = fn(
            "ncclCommInitRankConfig",
            ctypes.POINTER(vp),
            c_int,
            NcclUniqueId,
            c_int,
            ctypes.POINTER(NcclConfig),
        )
        self.ncclCommGetAsyncError = fn("ncclCommGetAsyncError", vp, ip)
        self.ncclCommAbort = fn("ncclCommAbort", vp)
        self.ncclCommDestroy = fn("ncclCommDestroy", vp)
        self.ncclCommFinalize = fn("ncclCommFinalize", vp)
        self.ncclCommCount = fn("ncclCommCount", vp, ip)
        self.ncclCommUserRank = fn("ncclCommUserRank", vp, ip)
        self.ncclAllReduce = fn("ncclAllReduce", vp, vp, ctypes.c_size_t, c_int, c_int, vp, vp)
        self.ncclAllGather = fn("ncclAllGather", vp, vp, ctypes.c_size_t, c_int, vp, vp)
        # ncclGetLastError (2.13+) has the detail behind a bare ncclInvalidUsage.
        self.ncclGetLastError = (
            fn("ncclGetLastError", vp, restype=ctypes.c_char_p) if hasattr(d, "ncclGetLastError") else None
        )
        self.version = self._version()
        log.info("loaded NCCL %s from %s", self.version, self.path)

    def _version(self) -> NcclVersion:
        v = ctypes.c_int()
        self.check(self.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return NcclVersion(v.value)

    def error_text(self, result: int, comm: int | None = None) -> str:
        name = _RESULT_NAMES.get(result, f"ncclResult {result}")
        msg = self.ncclGetErrorString(result)
        text = f"{name}: {msg.decode(errors='replace') if msg else '?'}"
        if self.ncclGetLastError is not None:
            last = self.ncclGetLastError(comm)
            if last:
                text += f" (last error: {last.decode(errors='replace')})"
        return text

    def check(self, result: int, what: str, comm: int | None = None) -> int:
        """Raise CommError unless ``result`` is ncclSuccess or ncclInProgress; returns it."""
        if result not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise CommError(f"{what} failed: {self.error_text(result, comm)}")
        return result

    def get_unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check(self.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    @staticmethod
    def unique_id(raw: bytes) -> NcclUniqueId:
        if len(raw) != UNIQUE_ID_BYTES:
            raise CommError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        uid = NcclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), raw, UNIQUE_ID_BYTES)
        return uid


@functools.cache
def load_nccl(path: str | None = None) -> NcclLib:
    """The process-wide NcclLib (loading is idempotent and not free)."""
    return NcclLib(path)
