"""Start one process per GPU on this host, torchrun-style.

    python -m runtime.launcher --nprocs 8 -- -m model.sharded_run --model glm5-flash
    python -m runtime.launcher --nprocs 2 -- path/to/script.py args...

Every child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` (read back by ``runtime.rendezvous.DistEnv.from_env``), so torchrun, mpirun
or SLURM can start the same entry point instead. Children pick their GPU from ``LOCAL_RANK``;
``CUDA_VISIBLE_DEVICES`` is left alone because NCCL's peer-to-peer paths want every GPU visible.

NCCL environment (NCCL reads its variables itself; library code never sets or reads them):

- ``NCCL_NVLS_ENABLE=0``: NVLink multicast (NVLS) stays off. Always set by the launcher, and by
  ``apply_nccl_env`` in entry points started by other launchers.
- ``NCCL_SOCKET_IFNAME=lo``: only for single-host launches, so NCCL's bootstrap does not pick an
  interface that the host cannot route to itself on. A value already in the environment wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from .rendezvous import DistEnv

log = logging.getLogger(__name__)


def nccl_env(single_host: bool) -> dict[str, str]:
    """The NCCL variables this runtime runs with (see the module docstring)."""
    env = {"NCCL_NVLS_ENABLE": "0"}
    if single_host:
        env["NCCL_SOCKET_IFNAME"] = "lo"
    return env


def apply_nccl_env(dist: DistEnv) -> None:
    """For entry points: put ``nccl_env`` into this process's environment before NCCL loads.
    ``NCCL_NVLS_ENABLE`` is forced; ``NCCL_SOCKET_IFNAME`` only fills a gap."""
    for key, value in nccl_env(dist.single_host).items():
        if key == "NCCL_NVLS_ENABLE":
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual small race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(dist: DistEnv) -> dict[str, str]:
    env = {
        "RANK": str(dist.rank),
        "WORLD_SIZE": str(dist.world_size),
        "LOCAL_RANK": str(dist.local_rank),
        "MASTER_ADDR": dist.master_addr,
        "MASTER_PORT": str(dist.master_port),
    }
    if dist.local_world_size is not None:
        env["LOCAL_WORLD_SIZE"] = str(dist.local_world_size)
    return env


def spawn(
    argv: Sequence[str],
    nprocs: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 30.0,
) -> list[int]:
    """Run ``python <argv...>`` (``argv`` is ``["-m", "pkg.mod", ...]`` or ``["script.py", ...]``)
    as ``nprocs`` ranks and wait for them; returns their exit codes by rank (negative: killed by
    that signal).

    When a rank fails, the others get ``grace_s`` to notice through their own timeouts and exit;
    then they are terminated. ``timeout_s`` bounds the whole run. ``env`` adds to the parent's
    environment."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if not argv:
        raise ValueError("nothing to run: argv is empty")
    port = master_port or free_port(master_addr)
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(nprocs):
        dist = DistEnv(rank, nprocs, rank, master_addr, port, local_world_size=nprocs)
        child_env = dict(os.environ)
        child_env.update(env or {})
        for key, value in nccl_env(single_host=True).items():
            if key == "NCCL_NVLS_ENABLE" or key not in child_env:
                child_env[key] = value
        child_env.update(rank_env(dist))
        procs.append(subprocess.Popen([sys.executable, *argv], env=child_env))
    log.info(
        "spawned %d ranks (pids %s), rendezvous at %s:%d", nprocs, [p.pid for p in procs], master_addr, port
    )
    return _wait_all(procs, timeout_s, grace_s)


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float | None, grace_s: float) -> list[int]:
    start = time.monotonic()
    first_failure: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]  # type: ignore[arg-type]
        now = time.monotonic()
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = now
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            log.error("rank(s) %s failed; the others have %gs to exit", bad, grace_s)
        overdue = timeout_s is not None and now - start > timeout_s
        if overdue or (first_failure is not None and now - first_failure > grace_s):
            log.error("terminating ranks still running: %s", [r for r, c in enumerate(codes) if c is None])
            _terminate(procs)
            return [int(p.wait()) for p in procs]
        time.sleep(0.05)


def _terminate(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.launcher",
        description="Start one process per GPU with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set.",
    )
    parser.add_argument("--nprocs", type=int, required=True, help="ranks to start on this host")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds the other ranks get to exit after one fails (default 30)",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="after --: -m module args..., or script.py args..."
    )
    ns = parser.parse_args(args)
    command = list(ns.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("give the command to run after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(message)s")
    codes = spawn(command, ns.nprocs, master_port=ns.master_port, timeout_s=ns.timeout, grace_s=ns.grace)
    log.info("exit codes by rank: %s", codes)
    return next((c if c > 0 else 1 for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
