"""Host communicator, single-rank communicator, rendezvous store and launcher (CPU only).

Run as a script (``python tests/test_comm_host.py --rendezvous-worker DIR [--bad-rank R]``) this
file is the per-rank worker that the process tests start through ``runtime.launcher.spawn``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_dtypes  # noqa: E402 - after the sys.path insert
import numpy as np  # noqa: E402 - after the sys.path insert

from runtime.errors import CommError  # noqa: E402 - after the sys.path insert
from runtime.rendezvous import DistEnv, rendezvous  # noqa: E402 - after the sys.path insert

REPO = Path(__file__).resolve().parent.parent


def _rendezvous_worker(argv: list[str]) -> int:
    """One rank of the process tests: rendezvous, then write what happened to DIR/rank<R>.json."""
    out = Path(argv[0])
    bad_rank = int(argv[argv.index("--bad-rank") + 1]) if "--bad-rank" in argv else -1
    dist = DistEnv.from_env()
    fingerprint = "cfg-A" if dist.rank != bad_rank else "cfg-B"
    payload = b"\x00unique-id\xff" if dist.rank == 0 else None
    record: dict[str, Any] = {"rank": dist.rank, "world_size": dist.world_size}
    code = 0
    try:
        res = rendezvous(dist, fingerprint, payload=payload, timeout_s=10.0)
        record["payload"] = res.payload.hex()
    except CommError as e:
        record["error"] = str(e)
        code = 3
    (out / f"rank{dist.rank}.json").write_text(json.dumps(record))
    return code


if __name__ == "__main__" and "--rendezvous-worker" in sys.argv:
    sys.exit(_rendezvous_worker(sys.argv[sys.argv.index("--rendezvous-worker") + 1 :]))


import pytest  # noqa: E402 - below the rank worker's exit
from hypothesis import HealthCheck, given, settings  # noqa: E402 - below the rank worker's exit
from hypothesis import strategies as st  # noqa: E402 - below the rank worker's exit

from runtime.comm import (  # noqa: E402 - below the rank worker's exit
    CommDtype,
    Communicator,
    HostCommGroup,
    HostCommunicator,
    ReduceOp,
    SingleRankCommunicator,
    load_nccl,
)
from runtime.device_ptr import DevicePtr  # noqa: E402 - below the rank worker's exit
from runtime.errors import GraphLifetimeError, MemoryFault  # noqa: E402 - below the rank worker's exit
from runtime.host_backend import HostBackend  # noqa: E402 - below the rank worker's exit
from runtime.launcher import free_port, nccl_env, spawn  # noqa: E402 - below the rank worker's exit

# ---- helpers ------------------------------------------------------------------------------------


def run_ranks(world: int, fn: Callable[[int], Any], join_s: float = 30.0) -> list[Any]:
    """Run ``fn(rank)`` on one thread per rank; returns each rank's result or exception."""
    results: list[Any] = [None] * world

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"rank threads {hung} still running after {join_s}s: a collective hung"
    return results


def no_errors(results: list[Any]) -> list[Any]:
    errs = [r for r in results if isinstance(r, BaseException)]
    if errs:
        raise errs[0]
    return results


def make_group(
    world: int, timeout_s: float = 10.0
) -> tuple[HostCommGroup, list[HostBackend], list[HostCommunicator]]:
    group = HostCommGroup(world, timeout_s)
    backends = [HostBackend() for _ in range(world)]
    comms = [group.communicator(r, backends[r]) for r in range(world)]
    return group, backends, comms


def upload(backend: HostBackend, arr: np.ndarray, extra: int = 0) -> DevicePtr:
    p = backend.alloc(arr.nbytes + extra)
    backend.copy_h2d(p, arr)
    return p


def download(backend: HostBackend, p: DevicePtr, dtype: np.dtype, count: int) -> np.ndarray:
    out = np.empty(count, dtype)
    backend.copy_d2h(out, p)
    return out


# ---- an independent scalar reference of NCCL's element semantics --------------------------------
# Written per element with Python ints / floats (exact in float64 for every pairwise step below),
# not with the vectorised float32 path of runtime.comm.reduce.

_F8_MAX = 448.0


def _round(x: float, dtype: CommDtype) -> float:
    """Round an exact value to ``dtype`` as one NCCL reduction step does (overflow: inf)."""
    with np.errstate(over="ignore"):
        return _round_quiet(x, dtype)


def _round_quiet(x: float, dtype: CommDtype) -> float:
    if dtype is CommDtype.FLOAT64:
        return x
    if dtype is CommDtype.FLOAT32:
        return float(np.float32(x))
    if dtype is CommDtype.FLOAT16:
        return float(np.float16(x))
    if dtype is CommDtype.BFLOAT16:
        return float(np.array(x).astype(ml_dtypes.bfloat16))
    h = float(np.float16(x))  # fp8: via half, then satfinite
    if not math.isnan(h):
        h = max(-_F8_MAX, min(_F8_MAX, h))
    return float(np.array(h).astype(ml_dtypes.float8_e4m3fn))


def _wrap(v: int, dtype: CommDtype) -> int:
    bits = dtype.itemsize * 8
    v &= (1 << bits) - 1
    if dtype.is_signed_int and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def ref_element(vals: list, dtype: CommDtype, op: ReduceOp) -> float | int:
    n = len(vals)
    if not dtype.is_float:
        ints = [int(v) for v in vals]
        if op is ReduceOp.MAX:
            return max(ints)
        if op is ReduceOp.MIN:
            return min(ints)
        if op is ReduceOp.PROD:
            return _wrap(math.prod(ints), dtype)
        s = _wrap(sum(ints), dtype)
        if op is ReduceOp.AVG:
            return (abs(s) // n) * (1 if s >= 0 else -1)  # C division truncates toward zero
        return s
    xs = [float(v) for v in vals]
    if op is ReduceOp.AVG:
        scale = (
            1.0 / n
            if dtype is CommDtype.FLOAT64
            else float(np.array(np.float32(1.0 / n)).astype(dtype.np_dtype))
        )
        xs = [_round(x * scale, dtype) for x in xs]
        op = ReduceOp.SUM
    step = {
        ReduceOp.SUM: lambda a, b: a + b,
        ReduceOp.PROD: lambda a, b: a * b,
        ReduceOp.MAX: max,
        ReduceOp.MIN: min,
    }[op]
    acc = xs[0]
    for x in xs[1:]:
        acc = _round(step(acc, x), dtype)
    return acc


def ref_reduce(per_rank: list[np.ndarray], dtype: CommDtype, op: ReduceOp) -> np.ndarray:
    count = len(per_rank[0])
    out = [ref_element([a[j] for a in per_rank], dtype, op) for j in range(count)]
    if dtype.is_float:
        return np.array(out, dtype=np.float64).astype(dtype.np_dtype)
    return np.array(out, dtype=dtype.np_dtype)


_FLOAT_RANGE = {
    CommDtype.FLOAT16: 300.0,
    CommDtype.BFLOAT16: 1e4,
    CommDtype.FLOAT32: 1e6,
    CommDtype.FLOAT64: 1e9,
    CommDtype.FP8_E4M3: 448.0,
}


def values(dtype: CommDtype, n: int) -> st.SearchStrategy[np.ndarray]:
    if dtype.is_float:
        r = _FLOAT_RANGE[dtype]
        elem = st.floats(-r, r, allow_nan=False, allow_infinity=False)
        return st.lists(elem, min_size=n, max_size=n).map(
            lambda xs: np.array(xs, np.float64).astype(dtype.np_dtype)
        )
    info = np.iinfo(dtype.np_dtype)
    return st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n).map(
        lambda xs: np.array(xs, dtype.np_dtype)
    )


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values (NaN equal to NaN) of the same dtype."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind in "iu":
        return bool((a == b).all())
    x, y = a.astype(np.float64), b.astype(np.float64)
    return bool(((x == y) | (np.isnan(x) & np.isnan(y))).all())


# ---- reductions: every dtype x op against the reference ----------------------------------------


@pytest.mark.parametrize("op", list(ReduceOp), ids=str)
@pytest.mark.parametrize("dtype", list(CommDtype), ids=str)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_all_reduce_matches_reference(dtype: CommDtype, op: ReduceOp, data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 4), label="world")
    count = data.draw(st.sampled_from([1, 2, 3, 5, 7, 8, 13]), label="count")
    inputs = [data.draw(values(dtype, count), label=f"rank{r}") for r in range(world)]
    expected = ref_reduce(inputs, dtype, op)
    _, backends, comms = make_group(world)

    def rank_fn(r: int) -> np.ndarray:
        buf = upload(backends[r], inputs[r])
        comms[r].all_reduce(buf, count, dtype, op)
        return download(backends[r], buf, dtype.np_dtype, count)

    outs = no_errors(run_ranks(world, rank_fn))
    for r, out in enumerate(outs):
        assert same(out, expected), f"rank {r}: {out} != expected {expected} (inputs {inputs})"


@pytest.mark.parametrize("dtype", list(CommDtype), ids=str)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_all_gather_rank_order(dtype: CommDtype, data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 4), label="world")
    count = data.draw(st.sampled_from([1, 3, 4, 9]), label="count")
    inputs = [data.draw(values(dtype, count), label=f"rank{r}") for r in range(world)]
    _, backends, comms = make_group(world)

    def rank_fn(r: int) -> np.ndarray:
        b = backends[r]
        send = upload(b, inputs[r])
        recv = b.alloc(world * count * dtype.itemsize)  # poisoned: unwritten bytes would show
        comms[r].all_gather(send, recv, count, dtype)
        return download(b, recv, dtype.np_dtype, world * count)

    expected = np.concatenate(inputs)
    for r, out in enumerate(no_errors(run_ranks(world, rank_fn))):
        assert same(out, expected), f"rank {r}: gathered {out}, expected {expected}"


def test_all_gather_in_place() -> None:
    """send = this rank's block of recv, as NCCL allows."""
    world, count = 3, 4
    _, backends, comms = make_group(world)

    def rank_fn(r: int) -> np.ndarray:
        b = backends[r]
        recv = b.alloc(world * count * 4)
        send = recv.offset(r * count * 4)
        b.copy_h2d(send, np.full(count, 10 * r + 1, np.int32))
        comms[r].all_gather(send, recv, count, CommDtype.INT32)
        return download(b, recv, np.int32, world * count)

    for out in no_errors(run_ranks(world, rank_fn)):
        assert out.tolist() == [1] * 4 + [11] * 4 + [21] * 4


# ---- exact semantics, spelled out ---------------------------------------------------------------


def _reduce_once(dtype: CommDtype, op: ReduceOp, per_rank: list[list]) -> list[np.ndarray]:
    world = len(per_rank)
    _, backends, comms = make_group(world)
    arrays = [
        np.array(v, np.float64).astype(dtype.np_dtype) if dtype.is_float else np.array(v, dtype.np_dtype)
        for v in per_rank
    ]

    def rank_fn(r: int) -> np.ndarray:
        buf = upload(backends[r], arrays[r])
        comms[r].all_reduce(buf, len(arrays[r]), dtype, op)
        return download(backends[r], buf, dtype.np_dtype, len(arrays[r]))

    return no_errors(run_ranks(world, rank_fn))


def test_bf16_sum_rounds_every_step_in_rank_order() -> None:
    e = 2.0**-8  # half an ulp of bf16 at 1.0
    # Two ranks: one step, f32 sum rounded to nearest even: 1 + 2^-8 is a tie -> 1.0;
    # 1 + 3*2^-8 rounds up to 1 + 2^-6.
    out = _reduce_once(CommDtype.BFLOAT16, ReduceOp.SUM, [[1.0, 1.0], [e, 3 * e]])
    for o in out:
        assert o.astype(np.float32).tolist() == [1.0, 1.0 + 2.0**-6]
    # Three ranks: each step rounds, in rank order. Accumulated in f32 the first column would be
    # 1 + 2^-7 (exact in bf16); rounded per step it is 1.0. The second column adds the small
    # terms first and keeps them.
    out = _reduce_once(CommDtype.BFLOAT16, ReduceOp.SUM, [[1.0, e], [e, e], [e, 1.0]])
    for o in out:
        assert o.astype(np.float32).tolist() == [1.0, 1.0 + 2.0**-7]


def test_integer_sums_wrap_and_avg_truncates() -> None:
    out = _reduce_once(CommDtype.INT8, ReduceOp.SUM, [[127, -128], [1, -1]])
    assert out[0].tolist() == [-128, 127]
    out = _reduce_once(CommDtype.UINT64, ReduceOp.SUM, [[2**64 - 1], [2]])
    assert out[1].tolist() == [1]
    out = _reduce_once(CommDtype.INT32, ReduceOp.AVG, [[-7, 7], [0, 0], [0, 1]])
    assert out[2].tolist() == [-2, 2]  # -7/3 -> -2 (toward zero), 8/3 -> 2


def test_fp8_saturates_and_float_max_ignores_nan() -> None:
    out = _reduce_once(CommDtype.FP8_E4M3, ReduceOp.SUM, [[448.0, -448.0], [448.0, -448.0]])
    assert out[0].astype(np.float32).tolist() == [448.0, -448.0]  # not NaN as ml_dtypes' cast gives
    out = _reduce_once(CommDtype.FLOAT32, ReduceOp.MAX, [[np.nan, 1.0], [2.0, np.nan]])
    assert out[1].tolist() == [2.0, 1.0]


def test_results_identical_on_every_rank_bitwise() -> None:
    rng = np.random.default_rng(7)
    vals = [rng.standard_normal(64).tolist() for _ in range(4)]
    outs = _reduce_once(CommDtype.BFLOAT16, ReduceOp.SUM, vals)
    raw = [o.view(np.uint16) for o in outs]
    assert all((raw[0] == x).all() for x in raw[1:])


# ---- graphs -------------------------------------------------------------------------------------


def test_captured_collectives_rerun_at_replay_on_current_contents() -> None:
    world, count = 3, 5
    _, backends, comms = make_group(world)

    def rank_fn(r: int) -> list[tuple[list, list]]:
        b, c = backends[r], comms[r]
        buf = upload(b, np.full(count, r, np.float32))
        recv = b.alloc(world * count * 4)
        b.begin_capture()
        c.all_reduce(buf, count, CommDtype.FLOAT32, ReduceOp.SUM)
        c.all_gather(buf, recv, count, CommDtype.FLOAT32)
        g = b.end_capture(label="allreduce+gather")
        # Capture records, it does not run: the input is untouched.
        assert download(b, buf, np.float32, count).tolist() == [float(r)] * count
        seen = []
        for step in range(3):
            b.copy_h2d(buf, np.arange(count, dtype=np.float32) * (step + 1) + r)
            b.graph_launch(g)
            seen.append(
                (
                    download(b, buf, np.float32, count).tolist(),
                    download(b, recv, np.float32, world * count).tolist(),
                )
            )
        with pytest.raises(GraphLifetimeError):
            b.free(buf)  # the graph's collective still references it
        b.graph_destroy(g)
        b.free(buf)
        b.free(recv)
        assert b.stats().live_allocations == 0
        return seen

    results = no_errors(run_ranks(world, rank_fn))
    for step in range(3):
        base = np.arange(count, dtype=np.float32) * (step + 1)
        want = (world * base + sum(range(world))).tolist()
        for r in range(world):
            reduced, gathered = results[r][step]
            assert reduced == want
            assert gathered == want * world  # every rank's block is the reduced buffer


# ---- failures: missing ranks, mismatches, broken groups -----------------------------------------


def test_missing_rank_times_out_on_every_waiting_rank() -> None:
    world, timeout = 3, 0.5
    group, backends, comms = make_group(world, timeout_s=timeout)
    bufs = [upload(backends[r], np.ones(4, np.float32)) for r in range(world)]

    def rank_fn(r: int) -> float:
        if r == 2:
            return 0.0  # never arrives
        t0 = time.monotonic()
        try:
            comms[r].all_reduce(bufs[r], 4, CommDtype.FLOAT32, ReduceOp.SUM)
        except CommError as e:
            elapsed = time.monotonic() - t0
            msg = str(e)
            assert "all_reduce" in msg and "rank(s) [2] did not arrive" in msg, msg
            return elapsed
        raise AssertionError(f"rank {r}: all_reduce returned without rank 2")

    elapsed = no_errors(run_ranks(world, rank_fn))[:2]
    # The rank whose deadline passed first waited the whole timeout; the other was released with
    # it (it may have started later, so only the upper bound applies to it).
    assert max(elapsed) >= timeout * 0.9, elapsed
    assert max(elapsed) < timeout + 1.0, elapsed
    assert group.broken is not None
    # The group stays broken: a late call fails at once, on the latecomer too.
    t0 = time.monotonic()
    with pytest.raises(CommError, match="broken"):
        comms[2].all_reduce(bufs[2], 4, CommDtype.FLOAT32, ReduceOp.SUM)
    with pytest.raises(CommError, match="broken"):
        comms[0].barrier(5.0)
    assert time.monotonic() - t0 < 0.2


@pytest.mark.parametrize(
    "odd_call, needle",
    [
        (lambda c, b, p, q: c.all_reduce(p, 5, CommDtype.FLOAT32, ReduceOp.SUM), "count=5"),
        (lambda c, b, p, q: c.all_reduce(p, 4, CommDtype.BFLOAT16, ReduceOp.SUM), "dtype=bfloat16"),
        (lambda c, b, p, q: c.all_reduce(p, 4, CommDtype.FLOAT32, ReduceOp.MAX), "op=max"),
        (lambda c, b, p, q: c.all_gather(p, q, 4, CommDtype.FLOAT32), "all_gather(count=4"),
        (lambda c, b, p, q: c.barrier(5.0), "barrier()"),
    ],
    ids=["count", "dtype", "op", "kind", "barrier"],
)
def test_mismatched_calls_fail_on_every_rank(odd_call: Callable, needle: str) -> None:
    world = 3
    group, backends, comms = make_group(world, timeout_s=5.0)
    bufs = [upload(backends[r], np.ones(8, np.float32)) for r in range(world)]
    recvs = [backends[r].alloc(world * 8 * 4) for r in range(world)]

    def rank_fn(r: int) -> str:
        c = comms[r]
        try:
            if r == 1:
                odd_call(c, backends[r], bufs[r], recvs[r])
            else:
                c.all_reduce(bufs[r], 4, CommDtype.FLOAT32, ReduceOp.SUM)
        except CommError as e:
            return str(e)
        raise AssertionError(f"rank {r}: mismatched collective returned")

    t0 = time.monotonic()
    msgs = no_errors(run_ranks(world, rank_fn))
    assert time.monotonic() - t0 < 2.0, "a mismatch must not wait for the timeout"
    for msg in msgs:
        assert "mismatched collective #0" in msg, msg
        assert needle in msg and "all_reduce(count=4, dtype=float32, op=sum)" in msg, msg
    assert group.broken is not None


def test_close_releases_waiting_peers() -> None:
    _, backends, comms = make_group(2, timeout_s=10.0)
    buf = upload(backends[0], np.ones(2, np.int64))

    def rank_fn(r: int) -> str:
        if r == 1:
            time.sleep(0.1)
            comms[1].close()
            return ""
        with pytest.raises(CommError) as ei:
            comms[0].all_reduce(buf, 2, CommDtype.INT64, ReduceOp.SUM)
        return str(ei.value)

    t0 = time.monotonic()
    msgs = no_errors(run_ranks(2, rank_fn))
    assert time.monotonic() - t0 < 2.0
    assert "rank(s) [1] closed" in msgs[0]
    with pytest.raises(CommError, match="closed"):
        comms[1].barrier(1.0)


def test_barrier_meets_and_times_out() -> None:
    _, _, comms = make_group(3)
    no_errors(run_ranks(3, lambda r: comms[r].barrier(5.0)))
    _, _, comms = make_group(2)
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"barrier\(\) .*timed out after 0.3s: rank\(s\) \[1\]"):
        comms[0].barrier(0.3)
    assert time.monotonic() - t0 < 1.3


def test_group_rejects_bad_ranks_and_second_communicator() -> None:
    group = HostCommGroup(2, 1.0)
    group.communicator(0, HostBackend())
    with pytest.raises(ValueError, match="already"):
        group.communicator(0, HostBackend())
    with pytest.raises(ValueError, match="outside"):
        group.communicator(2, HostBackend())
    with pytest.raises(ValueError):
        HostCommGroup(0)
    with pytest.raises(ValueError):
        HostCommGroup(2, timeout_s=math.inf)


# ---- argument checks (every communicator) --------------------------------------------------------


def _single() -> tuple[Communicator, HostBackend]:
    b = HostBackend()
    return SingleRankCommunicator(b), b


def _host1() -> tuple[Communicator, HostBackend]:
    _, backends, comms = make_group(1)
    return comms[0], backends[0]


@pytest.mark.parametrize("make", [_single, _host1], ids=["single", "host"])
def test_argument_checks(make: Callable[[], tuple[Communicator, HostBackend]]) -> None:
    comm, b = make()
    assert isinstance(comm, Communicator)
    p = b.alloc(16)
    with pytest.raises(TypeError, match="CommDtype"):
        comm.all_reduce(p, 4, np.float32, ReduceOp.SUM)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CommDtype"):
        comm.all_reduce(p, 4, "bf16", ReduceOp.SUM)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReduceOp"):
        comm.all_reduce(p, 4, CommDtype.FLOAT32, "sum")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReduceOp"):
        comm.all_reduce(p, 4, CommDtype.FLOAT32, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        comm.all_reduce(p, 4, CommDtype.FLOAT32)  # type: ignore[call-arg]  # op is required
    with pytest.raises(ValueError, match=">= 0"):
        comm.all_reduce(p, -1, CommDtype.FLOAT32, ReduceOp.SUM)
    with pytest.raises(TypeError, match="int"):
        comm.all_reduce(p, 4.0, CommDtype.FLOAT32, ReduceOp.SUM)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DevicePtr"):
        comm.all_reduce(p.addr, 4, CommDtype.FLOAT32, ReduceOp.SUM)  # type: ignore[arg-type]
    with pytest.raises(MemoryFault, match="past the end|only 16 bytes"):
        comm.all_reduce(p, 5, CommDtype.FLOAT32, ReduceOp.SUM)  # 20 bytes in a 16-byte buffer
    with pytest.raises(MemoryFault):
        comm.all_gather(p, p.offset(8), 4, CommDtype.FLOAT32)  # recv runs past the end
    with pytest.raises(ValueError, match="timeout"):
        comm.barrier(0)
    comm.close()
    with pytest.raises(CommError, match="closed"):
        comm.all_reduce(p, 4, CommDtype.FLOAT32, ReduceOp.SUM)


def test_single_rank_is_identity_and_gather_copies_in_stream_order() -> None:
    comm, b = _single()
    assert (comm.rank, comm.world_size) == (0, 1)
    x = np.array([1.5, -2.0, 3.25], np.float32)
    buf = upload(b, x)
    for op in ReduceOp:
        comm.all_reduce(buf, 3, CommDtype.FLOAT32, op)
    assert download(b, buf, np.float32, 3).tolist() == x.tolist()
    recv = b.alloc(12)
    b.begin_capture()
    comm.all_gather(buf, recv, 3, CommDtype.FLOAT32, stream=b.default_stream)
    g = b.end_capture()
    assert (download(b, recv, np.uint8, 12) == 0xFF).all()  # captured, not run
    b.copy_h2d(buf, x * 2)
    b.graph_launch(g)
    assert download(b, recv, np.float32, 3).tolist() == (x * 2).tolist()
    comm.barrier(1.0)


def test_comm_dtype_table() -> None:
    sizes = {
        CommDtype.INT8: 1,
        CommDtype.UINT8: 1,
        CommDtype.INT32: 4,
        CommDtype.UINT32: 4,
        CommDtype.INT64: 8,
        CommDtype.UINT64: 8,
        CommDtype.FLOAT16: 2,
        CommDtype.FLOAT32: 4,
        CommDtype.FLOAT64: 8,
        CommDtype.BFLOAT16: 2,
        CommDtype.FP8_E4M3: 1,
    }
    assert {d: d.itemsize for d in CommDtype} == sizes
    # NCCL's ncclDataType_t / ncclRedOp_t values (nccl.h).
    assert [int(d) for d in CommDtype] == list(range(11))
    assert [int(o) for o in ReduceOp] == [0, 1, 2, 3, 4]
    assert CommDtype.of(ml_dtypes.bfloat16) is CommDtype.BFLOAT16
    assert CommDtype.of(np.uint64) is CommDtype.UINT64
    with pytest.raises(TypeError):
        CommDtype.of(np.complex64)


# ---- NCCL library (loads on a CPU machine; no GPU needed) ---------------------------------------


def test_nccl_library_loads_and_reports_version() -> None:
    try:
        lib = load_nccl()
    except CommError as e:
        pytest.skip(f"NCCL not installed here: {e}")
    major, minor, _ = lib.version.triple
    assert (major, minor) >= (2, 17), f"NCCL {lib.version} is older than the 2.17 config layout"
    assert "libnccl" in os.path.basename(lib.path)
    assert lib.error_text(5).startswith("ncclInvalidUsage")


def test_nccl_config_prefix_layout() -> None:
    from runtime.comm.nccl_lib import NcclConfig

    # size_t size; unsigned magic, version; int blocking, cgaClusterSize, minCTAs, maxCTAs;
    # const char* netName (NCCL 2.17 layout, 64-bit).
    assert [NcclConfig.blocking.offset, NcclConfig.netName.offset] == [16, 32]
    cfg = NcclConfig.make(blocking=False)
    assert (cfg.size, cfg.magic, cfg.blocking, cfg.minCTAs) == (40, 0xCAFEBEEF, 0, -(2**31))


# ---- rendezvous ---------------------------------------------------------------------------------


def _dist(rank: int, world: int, port: int) -> DistEnv:
    return DistEnv(rank, world, rank, "127.0.0.1", port)


@pytest.mark.parametrize("world", [2, 3])
def test_rendezvous_broadcasts_rank0_payload(world: int) -> None:
    port = free_port()
    payload = bytes(range(128))

    def rank_fn(r: int) -> bytes:
        return rendezvous(
            _dist(r, world, port), "fp-1", payload=payload if r == 0 else None, timeout_s=10.0
        ).payload

    assert no_errors(run_ranks(world, rank_fn)) == [payload] * world


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"fingerprint": "fp-other"}, "rank 2 disagrees with rank 0 about the config fingerprint"),
        ({"world": 4}, "rank 2 disagrees with rank 0 about the world size: 4 vs 3"),
    ],
    ids=["fingerprint", "world_size"],
)
def test_rendezvous_disagreement_fails_every_rank(bad: dict, needle: str) -> None:
    world, port = 3, free_port()

    def rank_fn(r: int) -> str:
        fp = bad.get("fingerprint", "fp-1") if r == 2 else "fp-1"
        w = bad.get("world", world) if r == 2 else world
        dist = DistEnv(r, w, r, "127.0.0.1", port)
        with pytest.raises(CommError) as ei:
            rendezvous(dist, fp, payload=b"id" if r == 0 else None, timeout_s=10.0)
        return str(ei.value)

    t0 = time.monotonic()
    msgs = no_errors(run_ranks(world, rank_fn))
    assert time.monotonic() - t0 < 5.0, "a disagreement must not wait for the timeout"
    for msg in msgs:
        assert needle in msg, msg


def test_rendezvous_missing_rank_times_out() -> None:
    world, port, timeout = 3, free_port(), 1.0

    def rank_fn(r: int) -> tuple[str, float]:
        if r == 2:
            return "", 0.0
        t0 = time.monotonic()
        with pytest.raises(CommError) as ei:
            rendezvous(_dist(r, world, port), "fp", payload=b"id" if r == 0 else None, timeout_s=timeout)
        return str(ei.value), time.monotonic() - t0

    results = no_errors(run_ranks(world, rank_fn))[:2]
    for msg, _ in results:
        assert "rank(s) [2] did not arrive" in msg, msg
    elapsed = [t for _, t in results]
    assert timeout * 0.9 <= max(elapsed) < timeout + 2.0, elapsed


def test_rendezvous_without_rank0_fails_to_connect_in_time() -> None:
    port, timeout = free_port(), 0.8
    t0 = time.monotonic()
    with pytest.raises(CommError, match="could not reach the rendezvous store of rank 0"):
        rendezvous(_dist(1, 2, port), "fp", timeout_s=timeout)
    assert time.monotonic() - t0 < timeout + 1.0


def test_rendezvous_payload_rules() -> None:
    with pytest.raises(ValueError, match="rank 0"):
        rendezvous(_dist(1, 2, 1234), "fp", payload=b"x")
    with pytest.raises(ValueError, match="rank 0"):
        rendezvous(_dist(0, 2, 1234), "fp")
    assert rendezvous(DistEnv(), "fp", payload=b"solo").payload == b"solo"


def test_dist_env_from_env() -> None:
    d = DistEnv.from_env(
        {
            "RANK": "2",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "node7",
            "MASTER_PORT": "1234",
            "LOCAL_WORLD_SIZE": "2",
        }
    )
    assert d == DistEnv(2, 4, 0, "node7", 1234, local_world_size=2)
    assert not d.single_host
    assert DistEnv.from_env({}) == DistEnv()
    assert DistEnv.from_env({"RANK": "1", "WORLD_SIZE": "2"}).local_rank == 1
    assert DistEnv.from_env({"RANK": "1", "WORLD_SIZE": "2"}).single_host  # loopback default
    with pytest.raises(ValueError, match="outside"):
        DistEnv.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        DistEnv.from_env({"WORLD_SIZE": "0"})
    with pytest.raises(ValueError, match="not an integer"):
        DistEnv.from_env({"MASTER_PORT": "http"})


def test_nccl_env_for_launches() -> None:
    assert nccl_env(single_host=True) == {"NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo"}
    assert nccl_env(single_host=False) == {"NCCL_NVLS_ENABLE": "0"}


# ---- processes through the launcher -------------------------------------------------------------

_WORKER = [str(REPO / "tests" / "test_comm_host.py"), "--rendezvous-worker"]


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_spawned_ranks_rendezvous(tmp_path: Path) -> None:
    codes = spawn([*_WORKER, str(tmp_path)], 3, timeout_s=60)
    assert codes == [0, 0, 0]
    recs = _records(tmp_path, 3)
    assert [r["rank"] for r in recs] == [0, 1, 2]
    assert {r["payload"] for r in recs} == {b"\x00unique-id\xff".hex()}


def test_spawned_fingerprint_mismatch_fails_every_rank(tmp_path: Path) -> None:
    codes = spawn([*_WORKER, str(tmp_path), "--bad-rank", "1"], 2, timeout_s=60)
    assert codes == [3, 3]
    for rec in _records(tmp_path, 2):
        assert "rank 1 disagrees with rank 0 about the config fingerprint: 'cfg-B' vs 'cfg-A'" in rec["error"]


def test_spawn_terminates_survivors_after_a_failure(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(5)\ntime.sleep(120)\n"
    )
    t0 = time.monotonic()
    codes = spawn([str(script)], 2, grace_s=0.5, timeout_s=60)
    assert codes[0] == 5 and codes[1] < 0, codes  # rank 1 was terminated by a signal
    assert time.monotonic() - t0 < 10.0


def test_a_captured_collective_keeps_its_buffer_alive():
    """The collective's buffer joins the graph's lifetime set: freeing it under the live graph is
    refused, and legal once the graph is destroyed."""
    from runtime.comm import CommDtype, HostCommGroup, ReduceOp
    from runtime.errors import GraphLifetimeError
    from runtime.host_backend import HostBackend

    gpu = HostBackend()
    comm = HostCommGroup(1, timeout_s=5).communicator(0, gpu)
    buf = gpu.alloc(16)
    gpu.copy_h2d(buf, np.arange(4, dtype=np.float32))
    gpu.begin_capture(1)
    comm.all_reduce(buf, 4, CommDtype.FLOAT32, ReduceOp.SUM, stream=1)
    g = gpu.end_capture(1, label="collective")
    with pytest.raises(GraphLifetimeError, match="collective"):
        gpu.free(buf)
    gpu.graph_destroy(g)
    gpu.free(buf)
