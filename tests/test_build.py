"""build.py --check: passes on the committed PTX, fails naming the .ptx on a modified copy. The hash
check needs no nvcc (CI); the recompile-and-compare check runs where nvcc is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import build  # noqa: E402 - after the sys.path insert

HAVE_NVCC = build.find_nvcc() is not None


def run_check(ptx_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "build.py"), "--check", "--ptx-dir", str(ptx_dir), *extra],
        capture_output=True,
        text=True,
    )


# The runtime's kernels (other kernels come and go; these tests need a known, current set).
RUNTIME_KERNELS = (
    "add_bf16",
    "argmax_bf16",
    "embed_gather_bf16",
    "gemv_bf16",
    "gemv_fp8w",
    "quantize_fp8",
    "rmsnorm",
)


@pytest.fixture
def ptx_copy(tmp_path: Path) -> Path:
    d = tmp_path / "ptx"
    d.mkdir()
    for h in (ROOT / "ptx").glob("*.cuh"):  # common.cuh, fp8_xsmem.cuh (gemv_fp8w.cu) and the rest
        shutil.copy(h, d)
    for name in RUNTIME_KERNELS:
        for ext in (".cu", ".ptx"):
            shutil.copy(ROOT / "ptx" / (name + ext), d)
    return d


def test_committed_ptx_is_current_by_hash():
    res = run_check(ROOT / "ptx", "--no-nvcc")
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not installed")
def test_committed_ptx_is_current_by_fresh_compile():
    res = run_check(ROOT / "ptx")
    assert res.returncode == 0, res.stderr


def test_copied_runtime_kernels_are_current(ptx_copy: Path):
    res = run_check(ptx_copy, "--no-nvcc")
    assert res.returncode == 0, res.stderr


def test_modified_source_is_stale(ptx_copy: Path):
    cu = ptx_copy / "add_bf16.cu"
    cu.write_text(cu.read_text() + "\n// a change\n")
    res = run_check(ptx_copy, "--no-nvcc")
    assert res.returncode == 1
    assert "add_bf16.ptx: stale" in res.stderr and "argmax" not in res.stderr


def test_modified_shared_header_marks_its_includers_stale(ptx_copy: Path):
    h = ptx_copy / "common.cuh"
    h.write_text(h.read_text() + "\n// a change\n")
    res = run_check(ptx_copy, "--no-nvcc")
    assert res.returncode == 1
    for name in ("add_bf16", "argmax_bf16", "gemv_bf16", "rmsnorm"):
        assert f"{name}.ptx: stale" in res.stderr


def test_missing_and_headerless_ptx_are_named(ptx_copy: Path):
    (ptx_copy / "argmax_bf16.ptx").unlink()
    body = (ptx_copy / "add_bf16.ptx").read_text().split("\n", 4)[4]
    (ptx_copy / "add_bf16.ptx").write_text(body)
    (ptx_copy / "orphan.ptx").write_text("// nothing\n")
    res = run_check(ptx_copy, "--no-nvcc")
    assert res.returncode == 1
    assert "argmax_bf16.ptx: missing" in res.stderr
    assert "add_bf16.ptx: no build.py header" in res.stderr
    assert "orphan.ptx: no orphan.cu" in res.stderr


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not installed")
def test_hand_edited_ptx_fails_the_fresh_compile(ptx_copy: Path):
    p = ptx_copy / "add_bf16.ptx"
    p.write_text(p.read_text().replace("add.f32", "sub.f32", 1))
    assert run_check(ptx_copy, "--no-nvcc").returncode == 0  # the hashes cannot see this
    res = run_check(ptx_copy)
    assert res.returncode == 1 and "add_bf16.ptx: differs from a fresh compile" in res.stderr


def test_header_roundtrip():
    text = (ROOT / "ptx" / "rmsnorm.ptx").read_text()
    header, body = build.parse_header(text)
    assert header is not None and header.flags == build.flags_text()
    assert body.lstrip().startswith("//") and ".entry rmsnorm_bf16" in body


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not installed")
def test_fresh_compile_does_not_depend_on_the_checkout_path(tmp_path: Path):
    """nvcc hashes the source path into module-internal symbol names; a clone elsewhere must still
    compile the committed PTX byte for byte (draft_head.cu has a function-static __shared__)."""
    d = tmp_path / "elsewhere" / "ptx"
    d.mkdir(parents=True)
    for f in (ROOT / "ptx").iterdir():
        if f.stem in ("draft_head", "gemv_fp8w") or f.suffix == ".cuh":
            shutil.copy(f, d)
    res = run_check(d)
    assert res.returncode == 0, res.stderr
