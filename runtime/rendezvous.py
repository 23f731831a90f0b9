"""Rank discovery: the torchrun conventions, and a tiny TCP store on rank 0.

``DistEnv.from_env()`` is the only place that reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; a command-line entry point calls it and
hands the dataclass to library code. So a process started by ``runtime.launcher.spawn``, torchrun,
mpirun (with the variables mapped) or SLURM runs the same entry point.

``rendezvous(dist, fingerprint, payload)`` meets all ranks at rank 0's store. Rank 0 listens on
``MASTER_ADDR:MASTER_PORT``; every rank (rank 0 too) connects and says (rank, world size, config
fingerprint). The store answers every rank at once, with the same verdict: either rank 0's
``payload`` (the NCCL unique id), or an error that names the ranks that disagree with rank 0 about
the world size or the fingerprint, a duplicate or out-of-range rank, or the ranks that did not
arrive within the timeout. Every wait is bounded: connect retries, the store's deadline, the
reply's socket timeout.

Wire format: 4-byte big-endian length, then a UTF-8 JSON object. Payloads travel as hex.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CommError

log = logging.getLogger(__name__)

_PROTOCOL = "mtp-rendezvous/1"
_MAX_MESSAGE = 1 << 16
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# How much longer than the store's deadline a client waits for the store's verdict, so the
# verdict (which names the missing ranks) arrives before the client's own socket timeout.
_REPLY_GRACE_S = 3.0


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits among the ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"WORLD_SIZE must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK {self.rank} is outside WORLD_SIZE {self.world_size}")
        if self.local_rank < 0:
            raise ValueError(f"LOCAL_RANK must be >= 0, got {self.local_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"MASTER_PORT {self.master_port} is not a TCP port")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read the launcher's variables (``os.environ`` unless ``environ`` is given). Absent
        variables mean a single rank on this host."""
        env = os.environ if environ is None else environ

        def num(name: str, default: int | None) -> int | None:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

        rank, world, port = num("RANK", 0), num("WORLD_SIZE", 1), num("MASTER_PORT", 29500)
        local_rank = num("LOCAL_RANK", rank)
        assert rank is not None and world is not None and port is not None and local_rank is not None
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
            master_port=port,
            local_world_size=num("LOCAL_WORLD_SIZE", None),
        )

    @property
    def single_host(self) -> bool:
        """True when every rank is on this host (so NCCL's bootstrap can use loopback)."""
        if self.world_size == 1 or self.master_addr in _LOOPBACK:
            return True
        return self.local_world_size is not None and self.local_world_size == self.world_size


@dataclass(frozen=True)
class RendezvousResult:
    payload: bytes
    world_size: int


# ---- wire ---------------------------------------------------------------------------------------


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_MESSAGE:
        raise ConnectionError(f"message of {n} bytes exceeds the {_MAX_MESSAGE}-byte limit")
    msg = json.loads(_recv_exact(sock, n).decode())
    if not isinstance(msg, dict) or msg.get("protocol") != _PROTOCOL:
        raise ConnectionError(f"not a {_PROTOCOL} message")
    return msg


# ---- the store on rank 0 ------------------------------------------------------------------------


class _Store:
    """Rank 0's listener. One thread accepts; one thread per connection reads the rank's join
    and waits (bounded) for the verdict, which every connection receives."""

    def __init__(self, dist: DistEnv, fingerprint: str, payload: bytes, timeout_s: float) -> None:
        self._world = dist.world_size
        self._fingerprint = fingerprint
        self._payload_hex = payload.hex()
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._where = f"{dist.master_addr}:{dist.master_port}"
        self._cond = threading.Condition()
        self._joined: dict[int, dict[str, Any]] = {}
        self._error: str | None = None
        self._done = False
        self._in_flight = 0  # accepted connections not yet answered
        try:
            self._sock = socket.create_server((dist.master_addr, dist.master_port))
        except OSError as e:
            raise CommError(f"rank 0 cannot listen for the rendezvous on {self._where}: {e}") from e
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept_loop, name="rendezvous-store", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        try:
            # After a failure keep answering latecomers with the verdict until the deadline; after
            # success every rank has its answer and the port is released at once.
            while time.monotonic() < self._deadline + _REPLY_GRACE_S:
                with self._cond:
                    if self._done and self._error is None:
                        return
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                with self._cond:
                    self._in_flight += 1
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        finally:
            self._sock.close()

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every accepted connection has its answer. Rank 0 calls this
        before returning: the store's threads are daemons and die with rank 0's process, which
        may exit as soon as rendezvous() returns, before the other ranks have read the verdict."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("rendezvous: %d rank(s) not answered yet", self._in_flight)
                    return
                self._cond.wait(remaining)

    def _fail(self, reason: str) -> None:
        """Caller holds the lock."""
        if self._error is None:
            self._error = reason
            log.error("rendezvous failed: %s", reason)
        self._cond.notify_all()

    def _judge(self, msg: dict[str, Any]) -> None:
        """Record one rank's join; caller holds the lock."""
        rank, world, fp = msg.get("rank"), msg.get("world_size"), msg.get("fingerprint")
        if not isinstance(rank, int) or not 0 <= rank < self._world:
            self._fail(f"a process claims rank {rank!r}, outside rank 0's world size {self._world}")
        elif rank in self._joined:
            self._fail(f"two processes claim rank {rank}")
        elif world != self._world:
            self._fail(f"rank {rank} disagrees with rank 0 about the world size: {world} vs {self._world}")
        elif fp != self._fingerprint:
            self._fail(
                f"rank {rank} disagrees with rank 0 about the config fingerprint: {fp!r} vs "
                f"{self._fingerprint!r}"
            )
        else:
            self._joined[rank] = msg
            if len(self._joined) == self._world:
                self._done = True
                self._cond.notify_all()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_one(conn)
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(max(0.1, self._deadline - time.monotonic()))
                msg = _recv(conn)
            except (OSError, ValueError) as e:
                log.warning("rendezvous: dropping a bad connection: %s", e)
                return
            with self._cond:
                if self._done and self._error is None:
                    # The verdict is final once every rank has it; a straggler (a duplicate
                    # rank that connected late) gets its own error.
                    late = f"rank {msg.get('rank')!r} joined after all {self._world} ranks had"
                    reply: dict[str, Any] = {"protocol": _PROTOCOL, "ok": False, "error": late}
                    self._reply(conn, msg, reply)
                    return
                if self._error is None:
                    self._judge(msg)
                while self._error is None and not self._done:
                    remaining = self._deadline - time.monotonic()
                    if remaining <= 0:
                        missing = sorted(set(range(self._world)) - set(self._joined))
                        self._fail(
                            f"rank(s) {missing} did not arrive at {self._where} within "
                            f"{self._timeout_s:g}s (arrived: {sorted(self._joined)})"
                        )
                        break
                    self._cond.wait(remaining)
                if self._error is not None:
                    reply = {"protocol": _PROTOCOL, "ok": False, "error": self._error}
                else:
                    reply = {"protocol": _PROTOCOL, "ok": True, "payload": self._payload_hex}
            self._reply(conn, msg, reply)

    @staticmethod
    def _reply(conn: socket.socket, msg: dict[str, Any], reply: dict[str, Any]) -> None:
        try:
            _send(conn, reply)
        except OSError as e:
            log.warning("rendezvous: could not answer rank %r: %s", msg.get("rank"), e)


# ---- the client (every rank) --------------------------------------------------------------------


def _connect(dist: DistEnv, deadline: float) -> socket.socket:
    """Connect to rank 0, retrying while it is not listening yet, until ``deadline``."""
    where = f"{dist.master_addr}:{dist.master_port}"
    pause = 0.02
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CommError(
                f"rank {dist.rank}: could not reach the rendezvous store of rank 0 at {where} "
                f"(last error: {last})"
            )
        try:
            return socket.create_connection((dist.master_addr, dist.master_port), timeout=min(remaining, 5.0))
        except OSError as e:
            last = e
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.5)


def rendezvous(
    dist: DistEnv, fingerprint: str, *, payload: bytes | None = None, timeout_s: float = 120.0
) -> RendezvousResult:
    """Meet every rank; returns rank 0's ``payload`` (rank 0 must give one, the others must not).

    Raises CommError on every rank, within ``timeout_s`` plus a few seconds, when a rank is
    missing, when ranks disagree about the world size or ``fingerprint`` (the error names the
    disagreeing rank), or when rank 0 cannot be reached."""
    if (payload is None) != (dist.rank != 0):
        raise ValueError("rank 0, and only rank 0, provides the rendezvous payload")
    if not isinstance(fingerprint, str):
        raise TypeError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
    if dist.world_size == 1:
        assert payload is not None
        return RendezvousResult(payload, 1)
    start = time.monotonic()
    store = None
    if dist.rank == 0:
        assert payload is not None
        store = _Store(dist, fingerprint, payload, timeout_s)
    deadline = start + timeout_s
    try:
        reply = _ask(dist, fingerprint, deadline)
    finally:
        if store is not None:
            store.drain(_REPLY_GRACE_S)
    if not reply.get("ok"):
        raise CommError(f"rank {dist.rank}: rendezvous failed: {reply.get('error')}")
    log.info(
        "rank %d of %d: rendezvous complete in %.2fs", dist.rank, dist.world_size, time.monotonic() - start
    )
    return RendezvousResult(bytes.fromhex(reply["payload"]), dist.world_size)


def _ask(dist: DistEnv, fingerprint: str, deadline: float) -> dict[str, Any]:
    """Send this rank's join and read the store's verdict, all before ``deadline`` (+ grace)."""
    sock = _connect(dist, deadline)
    with sock:
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()) + _REPLY_GRACE_S)
            _send(
                sock,
                {
                    "protocol": _PROTOCOL,
                    "rank": dist.rank,
                    "world_size": dist.world_size,
                    "fingerprint": fingerprint,
                    "host": socket.gethostname(),
                },
            )
            return _recv(sock)
        except (OSError, ValueError) as e:
            raise CommError(
                f"rank {dist.rank}: no verdict from the rendezvous store at "
                f"{dist.master_addr}:{dist.master_port}: {e}"
            ) from e
