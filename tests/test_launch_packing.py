"""CPU tests of what stands between Python and cuLaunchKernel: the signature check rejects bad
arguments, the packer lays out exactly the bytes the driver reads, and every declared kernel's
signature matches the ``.entry`` of its committed PTX (a mismatch would be garbage in a kernel,
not an error)."""

from __future__ import annotations

import ctypes
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime import NULL_KERNEL, DevicePtr, KernelHandle, LaunchError
from runtime.kernel import Arg, register_all_kernels, registered
from runtime.kernels.gemv_fp8w import GEMV_FP8W
from runtime.kernels.rmsnorm import RMSNORM
from runtime.launch import ArgPacker, check_args, grid_stride_blocks, launch

PTX_DIR = Path(__file__).resolve().parent.parent / "ptx"


def test_check_args_rejects_bad_input():
    k = KernelHandle(RMSNORM)
    x = DevicePtr(0x1000)
    good = (x, x, x, 3, 64, 1e-5)
    assert check_args(k, good) == (x, x, x, 3, 64, 1e-5)
    bad = {
        "takes 6 arguments": (x, x, x, 3, 64),
        "must be a DevicePtr": (0x1000, x, x, 3, 64, 1e-5),
        "null pointer": (DevicePtr(0), x, x, 3, 64, 1e-5),
        "must be an integer": (x, x, x, 3.0, 64, 1e-5),
        "does not fit u32": (x, x, x, 2**32, 64, 1e-5),
        "must be a float": (x, x, x, 3, 64, "1e-5"),
    }
    for msg, args in bad.items():
        with pytest.raises(LaunchError, match=msg):
            check_args(k, args)
    with pytest.raises(LaunchError, match="null kernel"):
        check_args(NULL_KERNEL, good)
    with pytest.raises(LaunchError, match="more than 1024 threads"):
        launch(None, k, 1, (64, 32, 1), *good)  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="grid"):
        launch(None, k, (0, 1, 1), 32, *good)  # type: ignore[arg-type]


def test_packer_writes_the_bytes_the_driver_reads():
    k = KernelHandle(GEMV_FP8W)
    ptrs = [DevicePtr(0x7F00_0000_1000 + 256 * i) for i in range(4)]
    packer = ArgPacker(GEMV_FP8W)
    addr = packer.pack(check_args(k, (*ptrs, 3, 154880, 4096)))
    raw = packer.slot_bytes()
    assert len(raw) == 7 * 8
    for i, p in enumerate(ptrs):
        assert struct.unpack_from("<Q", raw, 8 * i)[0] == p.addr
    assert [struct.unpack_from("<I", raw, 8 * i)[0] for i in (4, 5, 6)] == [3, 154880, 4096]
    # the void** array points at the slots, in order
    table = np.ctypeslib.as_array((ctypes.c_uint64 * 7).from_address(addr))
    assert list(np.diff(table.astype(np.int64))) == [8] * 6
    # repacking reuses the same buffers (cached per kernel), with the new values
    assert packer.pack(check_args(k, (*ptrs, 1, 7, 9))) == addr
    assert struct.unpack_from("<I", packer.slot_bytes(), 8 * 4)[0] == 1


def test_packer_float_and_signed_slots():
    from runtime.kernel import F32, I32, PTR, declare

    decl = declare("test_packing", "mixed", [("p", PTR), ("i", I32), ("f", F32)])(lambda mem, p, i, f: None)
    packer = ArgPacker(decl)
    packer.pack(check_args(KernelHandle(decl), (DevicePtr(0x10), -5, 0.1)))
    raw = packer.slot_bytes()
    assert struct.unpack_from("<i", raw, 8)[0] == -5
    assert struct.unpack_from("<f", raw, 16)[0] == np.float32(0.1)  # f32, not a double


_PTX_TYPE = {Arg.PTR: "u64", Arg.U64: "u64", Arg.U32: "u32", Arg.I32: "u32", Arg.F32: "f32"}
_ENTRY = re.compile(r"\.visible \.entry (\w+)\(\s*(.*?)\)", re.S)


def test_declarations_match_committed_ptx_entries():
    register_all_kernels()
    checked = 0
    for decl in registered():
        ptx = PTX_DIR / f"{decl.module}.ptx"
        if decl.module.startswith("test_") or not ptx.exists():
            continue
        entries = {
            name: re.findall(r"\.param \.(\w+)", params) for name, params in _ENTRY.findall(ptx.read_text())
        }
        assert decl.function in entries, f"{ptx.name} has no entry {decl.function} (has {sorted(entries)})"
        want = [_PTX_TYPE[t] for t in decl.arg_types]
        # nvcc writes 32-bit integer params as .u32 or .s32 depending on the C type
        got = [
            "u32" if t in ("s32", "b32") else "u64" if t in ("s64", "b64") else t
            for t in entries[decl.function]
        ]
        assert got == want, f"{decl.module}.{decl.function}: declared {want}, PTX has {got}"
        checked += 1
    assert checked >= 7  # the runtime kernels at least


@given(units=st.integers(1, 100_000), resident=st.integers(1, 2_000))
def test_grid_stride_blocks_even_out_the_rounds(units, resident):
    """A one-wave grid (never more blocks than resident), with the fewest rounds any such grid
    allows, and no block more than one round behind another."""
    grid = grid_stride_blocks(units, resident)
    assert 1 <= grid <= min(units, resident)
    rounds = -(-units // grid)
    assert rounds == -(-units // resident)
    assert units > (rounds - 1) * grid  # every block has work in every round but the last


def test_grid_stride_blocks_of_the_fp8_head_and_bad_input():
    assert grid_stride_blocks(9680, 528) == 510  # 154880 head rows in 16-row groups, 4 x 132 blocks
    assert grid_stride_blocks(292, 528) == 292
    for units, resident in ((0, 528), (10, 0), (-1, 5)):
        with pytest.raises(LaunchError, match="positive"):
            grid_stride_blocks(units, resident)


@given(n=st.integers(1, 200_000), h=st.sampled_from([8, 40, 37, 4096]), m=st.sampled_from([1, 3, 9, 256]))
def test_mtp_input_grid_keeps_the_rows_per_warp_it_has_room_for(n, h, m):
    """mtp_input_gemv_batch keeps MTP_INPUT_ROWS_PER_WARP hidden-half sums per warp: a grid that
    gave a warp more rows would leave rows unwritten."""
    from model.kernels.mtp_input import MTP_INPUT_BATCH_ROWS, MTP_INPUT_ROWS_PER_WARP, mtp_input_batch_grid
    from runtime.host_backend import HostBackend

    gpu = HostBackend()
    chunks, grid = mtp_input_batch_grid(gpu, m, n, h)
    assert chunks == -(-m // MTP_INPUT_BATCH_ROWS)
    assert -(-n // (grid * 8)) <= MTP_INPUT_ROWS_PER_WARP
    assert grid <= max(gpu.NOTIONAL_RESIDENT_BLOCKS, -(-n // (8 * MTP_INPUT_ROWS_PER_WARP)))


def test_pdl_state_lets_a_beside_kernel_overlap_only_a_releasing_predecessor():
    """What CudaBackend asks before every launch: a WAIT kernel overlaps whenever PDL is on; a
    BESIDE kernel only right after a kernel that releases its dependents on the same stream. Any
    other stream work, a non-releasing launch, or work on a stream the backend does not know (a
    collective) ends that; a device without PDL never overlaps, whatever ``on`` is set to."""
    from runtime.kernel import PTR, Pdl, declare
    from runtime.launch import PdlState

    wait = declare("test_pdl_state", "wait", [("x", PTR)], pdl=Pdl.WAIT)(lambda mem, x: None)
    releasing = declare("test_pdl_state", "releasing", [("x", PTR)], pdl=Pdl.WAIT, releases=True)(
        lambda mem, x: None
    )
    beside = declare("test_pdl_state", "beside", [("x", PTR)], pdl=Pdl.BESIDE)(lambda mem, x: None)
    plain = declare("test_pdl_state", "plain", [("x", PTR)])(lambda mem, x: None)
    pdl = PdlState(supported=True, on=True)
    assert pdl.overlaps(wait, 1) and not pdl.overlaps(plain, 1) and not pdl.overlaps(beside, 1)
    pdl.launched(releasing, 1)
    assert pdl.overlaps(beside, 1) and not pdl.overlaps(beside, 2)
    pdl.other_work(2)
    assert pdl.overlaps(beside, 1)
    pdl.other_work(1)
    assert not pdl.overlaps(beside, 1)
    pdl.launched(releasing, 1)
    pdl.launched(wait, 1)
    assert not pdl.overlaps(beside, 1)
    pdl.launched(releasing, 1)
    pdl.launched(releasing, 2)
    pdl.work_on_unknown_stream()
    assert not pdl.overlaps(beside, 1) and not pdl.overlaps(beside, 2)
    pdl.launched(releasing, 1)
    pdl.on = False
    assert not pdl.overlaps(wait, 1) and not pdl.overlaps(beside, 1)
    off = PdlState(supported=False, on=True)
    off.on = True
    assert not off.on and not off.overlaps(wait, 1)
