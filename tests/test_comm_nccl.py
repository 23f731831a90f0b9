"""NCCL communicator on real GPUs (marked ``gpu``; run with ``pytest -m gpu``).

One GPU: a one-rank communicator with the CudaBackend (collectives outside and inside a captured
graph, replayed after the input changes; all-gather; barrier; abort), and a two-rank communicator
whose second rank never comes (a bounded CommError, not a hang).
Two or more GPUs: two processes started by ``runtime.launcher.spawn`` rendezvous, build a real
two-rank communicator and compare every result with the host reduction (bit-exact at W=2).

Run as a script (``python tests/test_comm_nccl.py --nccl-worker OUT``) this file is that per-rank
worker.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402 - after the sys.path insert

REPO = Path(__file__).resolve().parent.parent
_CASES = [
    ("float32", "sum"),
    ("float32", "max"),
    ("bfloat16", "sum"),
    ("bfloat16", "max"),
    ("uint64", "sum"),
    ("uint64", "max"),
    ("float32", "avg"),
    ("int32", "prod"),
]


def _rank_input(rank: int, dtype: Any, count: int, salt: int) -> np.ndarray:
    """Deterministic per-rank data that both the worker and the host check can rebuild."""
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype.is_float:
        return rng.standard_normal(count).astype(dtype.np_dtype)
    info = np.iinfo(dtype.np_dtype)
    return rng.integers(info.min, info.max, size=count, dtype=dtype.np_dtype, endpoint=True)


def _nccl_worker(out: Path) -> int:
    """One rank of the multi-GPU test; writes OUT/rank<R>.json."""
    from runtime.launcher import apply_nccl_env
    from runtime.rendezvous import DistEnv

    dist = DistEnv.from_env()
    apply_nccl_env(dist)
    # One GPU per process, chosen before CUDA initialises (the backend then uses device 0).
    os.environ["CUDA_VISIBLE_DEVICES"] = str(dist.local_rank)
    from runtime.comm import CommDtype, NcclCommunicator, ReduceOp
    from runtime.cuda_backend import CudaBackend

    record: dict[str, Any] = {"rank": dist.rank, "results": {}}
    backend = CudaBackend()
    comm = NcclCommunicator.from_rendezvous(backend, dist, "nccl-test-config", timeout_s=60.0)
    count = 1001  # odd, and more than one warp's worth
    try:
        for salt, (dt_name, op_name) in enumerate(_CASES):
            dtype, op = CommDtype[dt_name.upper()], ReduceOp[op_name.upper()]
            buf = backend.alloc(count * dtype.itemsize)
            backend.copy_h2d(buf, _rank_input(dist.rank, dtype, count, salt))
            comm.all_reduce(buf, count, dtype, op)
            comm.wait(timeout_s=30)
            got = np.empty(count, dtype.np_dtype)
            backend.copy_d2h(got, buf)
            record["results"][f"{dt_name}-{op_name}"] = got.view(np.uint8).tobytes().hex()
            backend.free(buf)
        # Captured: all-reduce then all-gather, replayed twice with new inputs.
        dtype = CommDtype.FLOAT32
        buf = backend.alloc(count * 4)
        recv = backend.alloc(dist.world_size * count * 4)
        backend.copy_h2d(buf, np.zeros(count, np.float32))
        backend.synchronize()
        backend.begin_capture()
        comm.all_reduce(buf, count, dtype, ReduceOp.SUM)
        comm.all_gather(buf, recv, count, dtype)
        graph = backend.end_capture(label="nccl-test")
        for replay in range(2):
            backend.copy_h2d(buf, _rank_input(dist.rank, dtype, count, 100 + replay))
            backend.graph_launch(graph)
            comm.wait(timeout_s=30)
            got = np.empty(dist.world_size * count, np.float32)
            backend.copy_d2h(got, recv)
            record["results"][f"graph-{replay}"] = got.view(np.uint8).tobytes().hex()
        backend.graph_destroy(graph)
        backend.free(buf)
        backend.free(recv)
        comm.barrier(30.0)
    finally:
        comm.close()
    (out / f"rank{dist.rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__" and "--nccl-worker" in sys.argv:
    sys.exit(_nccl_worker(Path(sys.argv[sys.argv.index("--nccl-worker") + 1])))


import pytest  # noqa: E402 - below the rank worker's exit

from runtime.comm import CommDtype, NcclCommunicator, ReduceOp, load_nccl, reduce_arrays  # noqa: E402 - below the rank worker's exit
from runtime.errors import CommError, GraphLifetimeError, MemoryFault  # noqa: E402 - below the rank worker's exit

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda() -> Iterator[Any]:
    try:
        from runtime.cuda_backend import CudaBackend
    except ImportError as e:
        pytest.skip(f"runtime.cuda_backend is not importable: {e}")
    from runtime.launcher import apply_nccl_env
    from runtime.rendezvous import DistEnv

    apply_nccl_env(DistEnv())  # this test module is the entry point: NVLS off, loopback bootstrap
    backend = CudaBackend()
    yield backend
    backend.close()


@pytest.fixture
def comm(cuda: Any) -> Iterator[NcclCommunicator]:
    lib = load_nccl()
    c = NcclCommunicator(cuda, 0, 1, lib.get_unique_id(), timeout_s=60.0)
    yield c
    c.close()


def _upload(backend: Any, arr: np.ndarray) -> Any:
    p = backend.alloc(arr.nbytes)
    backend.copy_h2d(p, arr)
    backend.synchronize()
    return p


def _download(backend: Any, p: Any, dtype: np.dtype, count: int) -> np.ndarray:
    out = np.empty(count, dtype)
    backend.copy_d2h(out, p)
    return out


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX], ids=str)
@pytest.mark.parametrize("dtype", [CommDtype.FLOAT32, CommDtype.BFLOAT16, CommDtype.UINT64], ids=str)
def test_one_rank_all_reduce_eager_and_in_graph(
    cuda: Any, comm: NcclCommunicator, dtype: CommDtype, op: ReduceOp
) -> None:
    count = 517
    x = _rank_input(0, dtype, count, 1)
    buf = _upload(cuda, x)
    comm.all_reduce(buf, count, dtype, op)
    comm.wait(timeout_s=30)
    assert (_download(cuda, buf, dtype.np_dtype, count).view(np.uint8) == x.view(np.uint8)).all()

    cuda.begin_capture()
    comm.all_reduce(buf, count, dtype, op)
    graph = cuda.end_capture(label="nccl-1rank")
    for salt in (2, 3):
        y = _rank_input(0, dtype, count, salt)
        cuda.copy_h2d(buf, y)
        cuda.graph_launch(graph)
        comm.wait(timeout_s=30)
        want = reduce_arrays([y], dtype, op)
        assert (_download(cuda, buf, dtype.np_dtype, count).view(np.uint8) == want.view(np.uint8)).all()
    with pytest.raises(GraphLifetimeError, match="nccl-1rank"):
        cuda.free(buf)  # the collective's buffer belongs to the live graph
    cuda.graph_destroy(graph)
    cuda.free(buf)


def test_one_rank_all_gather_writes_exactly_its_block(cuda: Any, comm: NcclCommunicator) -> None:
    count = 333
    x = _rank_input(0, CommDtype.FLOAT32, count, 4)
    send = _upload(cuda, x)
    sentinel = np.full(count + 64, 7.0, np.float32)
    recv = _upload(cuda, sentinel)
    comm.all_gather(send, recv, count, CommDtype.FLOAT32)
    comm.wait(timeout_s=30)
    got = _download(cuda, recv, np.float32, count + 64)
    assert (got[:count] == x).all()
    assert (got[count:] == 7.0).all(), "all_gather wrote past world_size * count elements"
    # In a graph, replayed after the input changes.
    cuda.begin_capture()
    comm.all_gather(send, recv, count, CommDtype.FLOAT32)
    graph = cuda.end_capture(label="gather")
    cuda.copy_h2d(send, x * 3)
    cuda.graph_launch(graph)
    comm.wait(timeout_s=30)
    assert (_download(cuda, recv, np.float32, count) == x * 3).all()
    cuda.graph_destroy(graph)
    cuda.free(send)
    cuda.free(recv)


def test_out_of_bounds_count_is_refused_before_nccl(cuda: Any, comm: NcclCommunicator) -> None:
    if not hasattr(cuda, "bytes_from"):
        pytest.skip("this CudaBackend has no bytes_from")
    buf = cuda.alloc(64)
    with pytest.raises(MemoryFault):
        comm.all_reduce(buf, 64, CommDtype.FLOAT32, ReduceOp.SUM)  # a count in bytes, not elements
    cuda.free(buf)


def test_barrier_and_abort(cuda: Any) -> None:
    lib = load_nccl()
    c = NcclCommunicator(cuda, 0, 1, lib.get_unique_id(), timeout_s=60.0)
    before = cuda.stats().live_allocations
    c.barrier(30.0)
    buf = cuda.alloc(16)
    c.abort("test")
    assert c.handle == 0
    with pytest.raises(CommError, match="unusable"):
        c.all_reduce(buf, 4, CommDtype.FLOAT32, ReduceOp.SUM)
    with pytest.raises(CommError):
        c.barrier(1.0)
    c.abort()  # idempotent
    c.close()  # after abort: nothing left to destroy
    cuda.free(buf)
    assert cuda.stats().live_allocations == before, "the barrier scratch buffer leaked"


def test_missing_peer_at_init_is_a_bounded_error(cuda: Any) -> None:
    """Rank 0 of a two-rank communicator whose rank 1 never starts: CommError after the timeout
    (the init is non-blocking and aborted at the deadline), never a hang."""
    lib = load_nccl()
    timeout = 3.0
    t0 = time.monotonic()
    with pytest.raises(CommError, match="timed out waiting for the other ranks"):
        NcclCommunicator(cuda, 0, 2, lib.get_unique_id(), timeout_s=timeout)
    assert time.monotonic() - t0 < timeout + 10.0


def _gpu_count() -> int:
    from cuda.bindings import driver

    err, n = driver.cuDeviceGetCount()
    return n if int(err) == 0 else 0


def test_two_ranks_match_host_reduction(tmp_path: Path) -> None:
    from runtime.launcher import spawn

    if _gpu_count() < 2:
        pytest.skip("needs two GPUs (two NCCL ranks cannot share one)")
    world, count = 2, 1001
    codes = spawn(
        [str(REPO / "tests" / "test_comm_nccl.py"), "--nccl-worker", str(tmp_path)], world, timeout_s=300
    )
    assert codes == [0] * world
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for salt, (dt_name, op_name) in enumerate(_CASES):
        dtype, op = CommDtype[dt_name.upper()], ReduceOp[op_name.upper()]
        want = reduce_arrays([_rank_input(r, dtype, count, salt) for r in range(world)], dtype, op)
        for rec in recs:
            got = bytes.fromhex(rec["results"][f"{dt_name}-{op_name}"])
            assert got == want.view(np.uint8).tobytes(), f"rank {rec['rank']}: {dt_name} {op_name}"
    for replay in range(2):
        ins = [_rank_input(r, CommDtype.FLOAT32, count, 100 + replay) for r in range(world)]
        total = reduce_arrays(ins, CommDtype.FLOAT32, ReduceOp.SUM)
        want = np.concatenate([total] * world)
        for rec in recs:
            got = np.frombuffer(bytes.fromhex(rec["results"][f"graph-{replay}"]), np.float32)
            assert (got == want).all(), f"rank {rec['rank']}: replay {replay}"
