import numpy as np
import pytest

from runtime import DevicePtr, GraphLifetimeError, LaunchError, MemoryFault, OutOfMemoryError
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend
from runtime.kernels.rmsnorm import RMSNORM, rmsnorm, rmsnorm_ref


def test_fresh_memory_is_poisoned(host):
    p = host.alloc(64)
    out = np.zeros(64, np.uint8)
    host.copy_d2h(out, p)
    assert (out == 0xFF).all()


def test_roundtrip_and_accounting(host):
    p = host.alloc(100)
    q = host.alloc(28)
    assert host.stats().live_allocations == 2 and host.stats().live_bytes == 128
    data = np.arange(100, dtype=np.uint8)
    host.copy_h2d(p, data)
    out = np.empty(100, np.uint8)
    host.copy_d2h(out, p)
    assert (out == data).all()
    host.free(p)
    host.free(q)
    assert host.stats().live_bytes == 0 and host.stats().peak_bytes == 128


def test_memory_faults_name_the_address(host):
    p = host.alloc(16)
    with pytest.raises(MemoryFault, match="past the end"):
        host.copy_h2d(p.offset(8), np.zeros(9, np.uint8))
    host.free(p)
    with pytest.raises(MemoryFault, match=f"double free of 0x{p.addr:x}"):
        host.free(p)
    with pytest.raises(MemoryFault, match="use after free"):
        host.copy_d2h(np.zeros(4, np.uint8), p)
    with pytest.raises(MemoryFault, match="unknown pointer 0x1234"):
        host.free(DevicePtr(0x1234))
    q = host.alloc(32)
    with pytest.raises(MemoryFault, match="not its base"):
        host.free(q.offset(4))
    host.free(q)  # still usable after every error
    assert host.stats().live_allocations == 0


def test_oom_names_the_size_and_leaves_backend_usable():
    h = HostBackend(capacity_bytes=1 << 20)
    with pytest.raises(OutOfMemoryError, match=str(2 << 20)):
        h.alloc(2 << 20)
    p = h.alloc(1000)
    h.free(p)


def test_launch_checks_signature(host):
    k = host.kernel(*RMSNORM.key)
    x = host.alloc(64)
    with pytest.raises(LaunchError, match="takes 6 arguments"):
        host.launch(k, (1, 1, 1), (32, 1, 1), (x, x, x, 1, 32))
    with pytest.raises(LaunchError, match="must be a DevicePtr"):
        host.launch(k, (1, 1, 1), (32, 1, 1), (x.addr, x, x, 1, 32, 1e-5))
    with pytest.raises(LaunchError, match="must be an integer"):
        host.launch(k, (1, 1, 1), (32, 1, 1), (x, x, x, 1.5, 32, 1e-5))
    with pytest.raises(LaunchError, match="does not fit u32"):
        host.launch(k, (1, 1, 1), (32, 1, 1), (x, x, x, -1, 32, 1e-5))
    host.free(x)


def test_try_kernel_gives_null_handle(host):
    k = host.try_kernel("nope", "nothing")
    assert not k and k.is_null
    with pytest.raises(Exception, match="nope.nothing"):
        host.kernel("nope", "nothing")


def test_rmsnorm_twin_matches_float64(host):
    rng = np.random.default_rng(0)
    rows, n = 3, 37
    x = rng.standard_normal((rows, n)).astype(BF16)
    w = rng.standard_normal(n).astype(BF16)
    px, pw, po = host.alloc(x.nbytes), host.alloc(w.nbytes), host.alloc(x.nbytes)
    host.copy_h2d(px, x)
    host.copy_h2d(pw, w)
    rmsnorm(host, px, pw, po, rows, n, 1e-5)
    out = np.empty((rows, n), BF16)
    host.copy_d2h(out, po)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * w.astype(np.float64)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(out, rmsnorm_ref(x, w, 1e-5))


def test_graph_records_replays_and_guards_lifetime(host):
    rng = np.random.default_rng(1)
    n = 40
    px, pw, po = host.alloc(2 * n), host.alloc(2 * n), host.alloc(2 * n)
    host.copy_h2d(pw, np.ones(n, BF16))
    s = host.create_stream()
    host.begin_capture(s)
    rmsnorm(host, px, pw, po, 1, n, 1e-5, stream=s)
    g = host.end_capture(s, label="norm")
    for _ in range(3):  # the graph reads px at replay time, like a CUDA graph does
        x = rng.standard_normal(n).astype(BF16)
        host.copy_h2d(px, x)
        host.memset(po, 0xFF, 2 * n)
        host.graph_launch(g, s)
        out = np.empty(n, BF16)
        host.copy_d2h(out, po)
        np.testing.assert_array_equal(out, rmsnorm_ref(x, np.ones(n, BF16), 1e-5))
    with pytest.raises(GraphLifetimeError, match="norm"):
        host.free(po)
    assert host.stats().live_allocations == 3  # the refused free changed nothing
    host.graph_destroy(g)
    with pytest.raises(GraphLifetimeError, match="destroyed"):
        host.graph_launch(g, s)
    for p in (px, pw, po):
        host.free(p)


def test_resident_blocks_is_notional_and_refuses_the_null_kernel(host):
    from runtime import NULL_KERNEL

    k = host.kernel(*RMSNORM.key)
    assert (
        host.resident_blocks(k, 256)
        == host.resident_blocks(k, 1024, 4096)
        == HostBackend.NOTIONAL_RESIDENT_BLOCKS
    )
    with pytest.raises(LaunchError):
        host.resident_blocks(NULL_KERNEL, 256)


def test_mapped_buffer_is_written_by_kernels_and_guarded_by_graphs(host):
    from kernel_util import check_mapped_buffer_contract

    check_mapped_buffer_contract(host)


def test_copy_words_brings_host_words_in_at_every_replay(host):
    from kernel_util import check_copy_words_from_mapped_memory

    check_copy_words_from_mapped_memory(host)


def test_freed_allocations_are_remembered_within_a_bound_and_use_after_free_stays_refused(host):
    """1,000 lifecycles of allocations (a proposer's frees 41 per lifecycle) used to leave every
    freed allocation in the table forever. The table keeps a bounded number of freed ranges; a use
    after free or a double free is refused whether or not its range is still remembered (host
    addresses are never reused)."""
    from runtime.allocations import AllocationTable

    first = None
    for _ in range(1000):
        ptrs = [host.alloc(64 + 8 * i) for i in range(5)]
        first = first or ptrs[0]
        for p in ptrs:
            host.free(p)
    table = host._ledger.allocations
    assert host.stats().live_allocations == 0
    assert table.entries() <= AllocationTable.FREED_KEPT < 5000
    with pytest.raises(MemoryFault, match="use after free"):
        host.copy_d2h(np.zeros(4, np.uint8), p)  # the last freed: still named as such
    with pytest.raises(MemoryFault, match=f"double free of 0x{p.addr:x}"):
        host.free(p)
    with pytest.raises(MemoryFault, match="not inside any live allocation"):
        host.copy_d2h(np.zeros(4, np.uint8), first)  # the first freed: forgotten, still refused
    with pytest.raises(MemoryFault, match="unknown pointer"):
        host.free(first)
    assert table.entries() <= AllocationTable.FREED_KEPT


def test_a_kernel_that_stores_outside_its_declared_writes_is_refused(host):
    """KernelDecl.writes is checked: the twin runs with its inputs' allocations read-only, so a
    store into an input is a LaunchError naming the kernel, and the input is left unchanged."""
    from runtime.kernel import PTR, U32, declare

    def store_into(arg: str):
        def twin(mem, x, y, n):
            mem.write(x if arg == "x" else y, np.arange(n, dtype=np.uint8))

        return twin

    good = declare("test_writes", "stores_y", [("x", PTR), ("y", PTR), ("n", U32)], writes=("y",))(
        store_into("y")
    )
    bad = declare("test_writes", "stores_x", [("x", PTR), ("y", PTR), ("n", U32)], writes=("y",))(
        store_into("x")
    )
    via_view = declare("test_writes", "view_x", [("x", PTR), ("y", PTR), ("n", U32)], writes=("y",))(
        lambda mem, x, y, n: mem.view(x, np.uint8, n).fill(7)
    )
    x, y = host.alloc(16), host.alloc(16)
    host.launch(host.kernel(*good.key), (1, 1, 1), (32, 1, 1), (x, y, 16))
    np.testing.assert_array_equal(host.mem.read(y, np.uint8, 16), np.arange(16))
    for decl in (bad, via_view):
        with pytest.raises(LaunchError, match=rf"{decl.function} stored into an argument .* read-only: x"):
            host.launch(host.kernel(*decl.key), (1, 1, 1), (32, 1, 1), (x, y, 16))
        assert (host.mem.read(x, np.uint8, 16) == 0xFF).all()  # still the poison it was allocated with
    # The same allocation as an input and as an output stays writable (in-place kernels).
    host.launch(host.kernel(*bad.key), (1, 1, 1), (32, 1, 1), (y.offset(8), y, 8))
    host.copy_h2d(x, np.zeros(16, np.uint8))  # writable again after the refusal
    host.free(x)
    host.free(y)


def test_a_graph_launched_inside_a_capture_joins_the_new_graph(host):
    """As on the device, a graph replayed into a capture becomes part of the captured graph: it runs
    at the new graph's replay, not during the capture, and its memory joins the new graph's."""
    from runtime.kernels.copy_words import copy_words

    src, dst = host.alloc(8), host.alloc(8)
    host.copy_h2d(src, np.array([1, 2], np.uint32))
    host.begin_capture()
    copy_words(host, src, dst, 2)
    inner = host.end_capture(label="inner")
    host.begin_capture()
    host.graph_launch(inner)
    outer = host.end_capture(label="outer")
    assert (host.mem.read(dst, np.uint32, 2) == 0xFFFFFFFF).all()  # captured, not run
    host.graph_destroy(inner)
    with pytest.raises(GraphLifetimeError, match="outer"):
        host.free(dst)
    host.graph_launch(outer)
    np.testing.assert_array_equal(host.mem.read(dst, np.uint32, 2), [1, 2])
    host.graph_destroy(outer)
    host.free(src)
    host.free(dst)


def test_free_during_capture_is_refused_as_on_the_device(host):
    p = host.alloc(16)
    host.begin_capture()
    with pytest.raises(GraphLifetimeError, match="during graph capture"):
        host.free(p)
    with pytest.raises(GraphLifetimeError, match="began on 0"):
        host.end_capture(stream=5)
    host.abort_capture()
    assert host.stats().live_allocations == 1
    host.free(p)
