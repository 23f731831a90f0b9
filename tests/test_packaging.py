"""A non-editable install ships the PTX and loads it from the installed package: the built package
holds every ptx/*.ptx, and run from another directory ``shipped_ptx_dir`` resolves inside the
installed tree, not the checkout. (Before, the wheel held no PTX and the default directory was
computed relative to the source checkout.)"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = sorted(p.name for p in (ROOT / "ptx").glob("*.ptx"))


def _staged_source(tmp: Path) -> Path:
    """The files the build reads, copied, so that the build writes nothing into the checkout."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for pkg in ("runtime", "ptx"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def test_built_package_holds_the_ptx_and_resolves_it_installed(tmp_path: Path):
    src, lib = _staged_source(tmp_path), tmp_path / "lib"
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "from setuptools import setup; setup()",
            "-q",
            "build_py",
            "--build-lib",
            str(lib),
        ],
        cwd=src,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert len(COMMITTED) >= 9 and sorted(p.name for p in (lib / "ptx").glob("*.ptx")) == COMMITTED
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(lib)}
    probe = "import runtime, runtime.kernel as k; print(runtime.__file__); print(k.shipped_ptx_dir())"
    res = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    module, ptx_dir = res.stdout.split()
    assert Path(module) == lib / "runtime" / "__init__.py"
    assert Path(ptx_dir) == lib / "ptx"


def test_checkout_resolves_its_own_ptx():
    from runtime.kernel import shipped_ptx_dir

    assert shipped_ptx_dir() == ROOT / "ptx"


@pytest.mark.skipif(importlib.util.find_spec("wheel") is None, reason="the wheel package is not installed")
def test_wheel_holds_the_ptx(tmp_path: Path):
    src, dist = _staged_source(tmp_path), tmp_path / "dist"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    (wheel,) = dist.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert (
        sorted(n.split("/", 1)[1] for n in names if n.startswith("ptx/") and n.endswith(".ptx")) == COMMITTED
    )
