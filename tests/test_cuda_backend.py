"""CudaBackend on a real GPU: memory and accounting, copies (sync, async, pinned), events, graph
capture and replay, graph lifetime, and bad input that must raise a named error and leave the
backend usable. Marked gpu: skipped with a reason where there is no GPU."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_util import download, poisoned, random_bf16, upload

from runtime import (
    NULL_KERNEL,
    CudaError,
    DevicePtr,
    GraphLifetimeError,
    KernelNotFound,
    LaunchError,
    MemoryFault,
    OutOfMemoryError,
)
from runtime.dtypes import BF16
from runtime.kernels.add_bf16 import add_bf16, add_ref
from runtime.kernels.argmax_bf16 import ARGMAX_BF16, argmax_bf16, argmax_ref
from runtime.kernels.embed_gather_bf16 import embed_gather_bf16

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    gpu.close()


@pytest.fixture(autouse=True)
def no_leaks(cuda):
    before = cuda.stats().live_allocations
    yield
    assert cuda.stats().live_allocations == before, "test leaked device allocations"
    assert not cuda.live_graphs(), "test leaked graphs"


def assert_usable(gpu) -> None:
    """A fresh add on the default stream still gives the right answer."""
    rng = np.random.default_rng()
    a, b = random_bf16(rng, 1001), random_bf16(rng, 1001)
    pa, pb, po = upload(gpu, a), upload(gpu, b), poisoned(gpu, 2002)
    add_bf16(gpu, pa, pb, po, 1001)
    assert download(gpu, po, BF16, 1001).tobytes() == add_ref(a, b).tobytes()
    for p in (pa, pb, po):
        gpu.free(p)


def test_alloc_accounting_and_sync_copies(cuda):
    s0 = cuda.stats()
    p, q = cuda.alloc(1000), cuda.alloc(24)
    assert cuda.stats().live_allocations == s0.live_allocations + 2
    assert cuda.stats().live_bytes == s0.live_bytes + 1024
    assert cuda.bytes_from(p.offset(10)) == 990
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    cuda.copy_h2d(p, data)
    out = np.zeros(1000, np.uint8)
    cuda.copy_d2h(out, p)
    assert (out == data).all()
    cuda.memset(p.offset(100), 0xAB, 50)
    cuda.copy_d2d(q, p.offset(96), 24)
    got = download(cuda, q, np.uint8, 24)
    assert list(got[:4]) == list(data[96:100]) and (got[4:] == 0xAB).all()
    free, total = cuda.mem_info()
    assert 0 < free <= total
    cuda.free(p)
    cuda.free(q)
    assert cuda.stats().peak_bytes >= s0.live_bytes + 1024


def test_async_copies_need_and_use_pinned_buffers(cuda):
    s = cuda.create_stream()
    n = 1 << 20
    pin_in, pin_out = cuda.alloc_host(n), cuda.alloc_host(n)
    assert cuda.is_pinned(pin_in) and cuda.is_pinned(pin_in[10:20]) and not cuda.is_pinned(np.zeros(4))
    pin_in[:] = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    pin_out[:] = 0
    d = cuda.alloc(n)
    cuda.copy_h2d(d, pin_in, stream=s)
    cuda.copy_d2h(pin_out, d, stream=s)
    cuda.synchronize(s)
    assert (pin_out == pin_in).all()
    with pytest.raises(ValueError, match="pinned"):
        cuda.copy_d2h(np.zeros(16, np.uint8), d, stream=s)
    cuda.free(d)
    cuda.free_host(pin_in)
    cuda.free_host(pin_out)
    with pytest.raises(MemoryFault, match="alloc_host"):
        cuda.free_host(np.zeros(4, np.uint8))
    cuda.destroy_stream(s)


def test_events_time_device_work(cuda):
    n = 64 << 20
    a, b = cuda.alloc(n), cuda.alloc(n)
    e0, e1 = cuda.event_create(), cuda.event_create()
    cuda.event_record(e0)
    for _ in range(5):
        cuda.copy_d2d(b, a, n)
    cuda.event_record(e1)
    ms = cuda.event_elapsed_ms(e0, e1)
    assert 0.0 < ms < 1000.0
    cuda.event_destroy(e0)
    cuda.event_destroy(e1)
    cuda.free(a)
    cuda.free(b)


def test_dynamic_shared_memory_above_48k_is_opted_in(cuda):
    """argmax uses 256 bytes of static shared memory; launching it with 100 KB of dynamic shared
    memory only works once cuFuncSetAttribute has raised the kernel's limit."""
    from runtime.kernels.argmax_bf16 import BLOCKS
    from runtime.launch import launch

    rng = np.random.default_rng(2)
    x = random_bf16(rng, 5000)
    px, pi, pv = upload(cuda, x), poisoned(cuda, 4), poisoned(cuda, 4)
    k = cuda.kernel(*ARGMAX_BF16.key)
    launch(cuda, k, BLOCKS, 1024, px, pi, pv, 5000, smem=100 * 1024)
    assert int(download(cuda, pi, np.uint32, 1)[0]) == argmax_ref(x)[0]
    with pytest.raises(LaunchError, match="dynamic shared memory"):
        launch(cuda, k, BLOCKS, 1024, px, pi, pv, 5000, smem=cuda.max_smem_optin + 1)
    for p in (px, pi, pv):
        cuda.free(p)


def test_graph_capture_replays_with_new_inputs_and_host_buffers(cuda):
    """A captured chain: pinned token -> device, embedding gather by that device token, add, argmax,
    result back to a pinned buffer. Each replay reads the pinned input and the static device buffers
    as they are at replay time."""
    rng = np.random.default_rng(3)
    vocab, k = 97, 4100
    table = random_bf16(rng, (vocab, k))
    bias_host = random_bf16(rng, k)
    pt, pbias = upload(cuda, table), upload(cuda, bias_host)
    ptok, prow, psum, pidx, pval = (
        cuda.alloc(4),
        poisoned(cuda, 2 * k),
        poisoned(cuda, 2 * k),
        cuda.alloc(4),
        cuda.alloc(4),
    )
    unused = cuda.alloc(64)
    tok_in, idx_out = cuda.alloc_host(4).view(np.uint32), cuda.alloc_host(4).view(np.uint32)
    s = cuda.create_stream()
    cuda.begin_capture(s)
    cuda.copy_h2d(ptok, tok_in, stream=s)
    embed_gather_bf16(cuda, pt, ptok, prow, vocab, k, stream=s)
    add_bf16(cuda, prow, pbias, psum, k, stream=s)
    argmax_bf16(cuda, psum, pidx, pval, k, stream=s)
    cuda.copy_d2h(idx_out, pidx, stream=s)
    g = cuda.end_capture(s, label="gather-add-argmax")
    assert cuda.live_graphs() == [g]
    for token in rng.integers(0, vocab, 4):
        tok_in[0] = token
        idx_out[0] = 0xDEADBEEF
        cuda.memset(psum, 0xFF, 2 * k, stream=s)
        cuda.graph_launch(g, s)
        cuda.synchronize(s)
        want = argmax_ref(add_ref(table[token], bias_host))[0]
        assert int(idx_out[0]) == want
    # lifetime: every buffer the graph touches is pinned down while it lives
    assert len(g.touches) == 7
    for p in (pt, pbias, ptok, prow, psum, pidx, pval):
        with pytest.raises(GraphLifetimeError, match="gather-add-argmax"):
            cuda.free(p)
    cuda.free(unused)  # not touched by the graph: freeing it is fine
    n_live = cuda.stats().live_allocations
    cuda.graph_destroy(g)
    assert cuda.stats().live_allocations == n_live  # the refused frees changed nothing
    with pytest.raises(GraphLifetimeError, match="destroyed"):
        cuda.graph_launch(g, s)
    with pytest.raises(GraphLifetimeError, match="destroyed twice"):
        cuda.graph_destroy(g)
    for p in (pt, pbias, ptok, prow, psum, pidx, pval):
        cuda.free(p)
    cuda.free_host(tok_in)
    cuda.free_host(idx_out)
    cuda.destroy_stream(s)
    assert_usable(cuda)


def test_capture_on_the_default_stream_and_refused_sync_work(cuda):
    rng = np.random.default_rng(4)
    n = 333
    a, b = random_bf16(rng, n), random_bf16(rng, n)
    pa, pb, po = upload(cuda, a), upload(cuda, b), poisoned(cuda, 2 * n)
    cuda.begin_capture()
    with pytest.raises(GraphLifetimeError, match="synchronous copy"):
        cuda.copy_h2d(pa, a)
    with pytest.raises(GraphLifetimeError, match="synchronize"):
        cuda.synchronize()
    with pytest.raises(GraphLifetimeError, match="pinned"):
        cuda.copy_h2d(pa, a, stream=cuda.default_stream)
    with pytest.raises(GraphLifetimeError, match="already open"):
        cuda.begin_capture()
    add_bf16(cuda, pa, pb, po, n)
    g = cuda.end_capture(label="add")
    assert (download(cuda, po, np.uint16, n) == 0xFFFF).all()  # captured, not run
    cuda.graph_launch(g)
    assert download(cuda, po, BF16, n).tobytes() == add_ref(a, b).tobytes()
    cuda.graph_destroy(g)
    with pytest.raises(GraphLifetimeError, match="without begin_capture"):
        cuda.end_capture()
    for p in (pa, pb, po):
        cuda.free(p)


def test_unknown_kernel_names_module_function_and_ptx(cuda):
    with pytest.raises(KernelNotFound) as e:
        cuda.kernel("no_such_module", "no_such_fn")
    assert "no_such_module.no_such_fn" in str(e.value) and "no_such_module.ptx" in str(e.value)
    assert cuda.try_kernel("no_such_module", "no_such_fn") is NULL_KERNEL
    with pytest.raises(LaunchError, match="null kernel"):
        cuda.launch(NULL_KERNEL, (1, 1, 1), (1, 1, 1), ())
    assert_usable(cuda)


def test_ptx_that_fails_to_load_raises_with_the_jit_log(cuda, tmp_path):
    from runtime.cuda_backend import CudaBackend

    good = (cuda.ptx_dir / "add_bf16.ptx").read_text()
    (tmp_path / "add_bf16.ptx").write_text(good.replace("add.f32", "add.f32 %bogus_register,", 1))
    other = CudaBackend(ptx_dir=tmp_path)  # shares the primary context
    try:
        with pytest.raises(CudaError) as e:
            other.kernel("add_bf16", "add_bf16")
        msg = str(e.value)
        assert "cuModuleLoadDataEx" in msg and "add_bf16.ptx" in msg
        jit = msg.split("JIT log:", 1)[1]
        assert "bogus_register" in jit or "ptx input" in jit, msg  # ptxas's own words, not just the code
        # a declared kernel whose module has no PTX in that directory
        with pytest.raises(KernelNotFound, match="argmax_bf16.ptx does not exist"):
            other.kernel("argmax_bf16", "argmax_bf16")
        assert other.try_kernel("argmax_bf16", "argmax_bf16") is NULL_KERNEL
        assert_usable(cuda)
    finally:
        other.close()
    assert_usable(cuda)


def test_allocation_larger_than_free_memory(cuda):
    free, _ = cuda.mem_info()
    with pytest.raises(OutOfMemoryError) as e:
        cuda.alloc(free + (1 << 30))
    assert str(free + (1 << 30)) in str(e.value) and "free" in str(e.value)
    assert_usable(cuda)


def test_copies_past_the_end_fault_before_the_driver(cuda):
    p = cuda.alloc(100)
    with pytest.raises(MemoryFault, match="past the end"):
        cuda.copy_h2d(p, np.zeros(101, np.uint8))
    with pytest.raises(MemoryFault, match="past the end"):
        cuda.copy_d2h(np.zeros(64, np.uint8), p.offset(40))
    q = cuda.alloc(16)
    with pytest.raises(MemoryFault, match="past the end"):
        cuda.copy_d2d(q, p, 17)
    with pytest.raises(MemoryFault, match="past the end"):
        cuda.memset(p.offset(99), 0, 2)
    with pytest.raises(MemoryFault, match="not inside any live allocation"):
        cuda.copy_h2d(DevicePtr(0x10), np.zeros(4, np.uint8))
    cuda.free(q)
    with pytest.raises(MemoryFault, match="use after free"):
        cuda.copy_d2h(np.zeros(4, np.uint8), q)
    with pytest.raises(MemoryFault, match="double free"):
        cuda.free(q)
    with pytest.raises(MemoryFault, match="use after free"):  # a launch with a freed pointer
        add_bf16(cuda, p, p, q, 4)
    cuda.free(p)
    assert_usable(cuda)


def test_launch_checks_signature_and_stream(cuda):
    k = cuda.kernel(*ARGMAX_BF16.key)
    p = cuda.alloc(64)
    with pytest.raises(LaunchError, match="takes 4 arguments"):
        cuda.launch(k, (1, 1, 1), (32, 1, 1), (p, p, p))
    with pytest.raises(LaunchError, match="does not fit u32"):
        cuda.launch(k, (1, 1, 1), (32, 1, 1), (p, p, p, -1))
    with pytest.raises(ValueError, match="unknown stream"):
        cuda.launch(k, (1, 1, 1), (32, 1, 1), (p, p.offset(8), p.offset(16), 4), stream=12345)
    cuda.free(p)
    assert_usable(cuda)


def test_close_frees_everything(cuda):
    from runtime.cuda_backend import CudaBackend

    free0, _ = cuda.mem_info()
    gpu = CudaBackend()
    ptrs = [gpu.alloc(256 << 20) for _ in range(4)]
    gpu.alloc_host(1 << 20)
    mapped = gpu.alloc_mapped(64)
    gpu.event_create()
    gpu.create_stream()
    po = poisoned(gpu, 8)
    gpu.begin_capture()
    add_bf16(gpu, ptrs[0], ptrs[1], po, 4)
    add_bf16(gpu, ptrs[0], ptrs[1], mapped.device, 4)
    gpu.end_capture(label="left live")
    assert cuda.mem_info()[0] < free0 - (1 << 30)
    gpu.close()
    assert gpu.stats().live_allocations == 0 and gpu.live_graphs() == []
    assert cuda.mem_info()[0] > free0 - (64 << 20)  # the GiB came back (same device, same context)
    with pytest.raises(CudaError, match="closed"):
        gpu.alloc(16)
    gpu.close()  # idempotent
    assert_usable(cuda)


def test_resident_blocks_follow_the_kernels_occupancy(cuda):
    """The grid of a one-wave grid-stride kernel comes from the occupancy calculator: the FP8 head
    is bounded to 4 blocks of 256 per SM; a 1024-thread block fits twice in an SM's 2048 threads."""
    import model.kernels  # noqa: F401 - declares the model's kernels

    head = cuda.kernel("draft_head", "head_argmax_fp8_batch")
    assert cuda.resident_blocks(head, 256, 16384) == 4 * cuda.sm_count
    norm = cuda.kernel("bgemv", "sum_rows_residual_rmsnorm_batch")
    assert cuda.resident_blocks(norm, 1024) == 2 * cuda.sm_count
    # More dynamic shared memory than half an SM holds: one block per SM (opted in first).
    k = cuda.kernel("mtp_input", "mtp_input_gemv_batch")
    big = cuda.max_smem_optin - cuda._function(k).static_smem - 1024  # the kernel's static bytes count too
    assert cuda.resident_blocks(k, 256, big) == cuda.sm_count
    with pytest.raises(LaunchError):
        cuda.resident_blocks(NULL_KERNEL, 256)


def test_mapped_buffer_is_written_by_kernels_and_guarded_by_graphs(cuda):
    from kernel_util import check_mapped_buffer_contract

    check_mapped_buffer_contract(cuda)
    assert_usable(cuda)


def test_copy_words_brings_host_words_in_at_every_replay(cuda):
    from kernel_util import check_copy_words_from_mapped_memory

    check_copy_words_from_mapped_memory(cuda)
