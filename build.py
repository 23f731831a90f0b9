#!/usr/bin/env python3
"""Compile ptx/*.cu to ptx/*.ptx with nvcc, or check that the committed PTX is current.

    python3 build.py              compile every ptx/*.cu (or only the names given)
    python3 build.py --check      exit 1 naming every .ptx that is missing or stale

Every .ptx starts with a header that records the sha256 of its source (the .cu and every local
header it includes, recursively), the nvcc flags and the nvcc version. ``--check`` is cheap without
nvcc (hashes only, which is what CI can do) and, where nvcc of the recorded version is present,
also recompiles into a temporary directory and compares the PTX byte for byte, which catches a
hand-edited .ptx or a system header that changed under an unchanged source.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PTX_DIR = ROOT / "ptx"
ARCH = "sm_90"
# -std=c++17 pins the dialect so a future nvcc default cannot change the PTX silently. No
# -lineinfo: it embeds the source path, which would make the PTX depend on the checkout location.
NVCC_FLAGS = (f"-arch={ARCH}", "-ptx", "-O3", "-std=c++17")

HEADER_TAG = "// build.py:"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

log = logging.getLogger("build")


@dataclass(frozen=True)
class Header:
    source_sha256: str
    flags: str
    nvcc: str


def find_nvcc(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def source_closure(cu: Path) -> list[Path]:
    """The .cu and every local header it includes (quoted includes resolved next to the includer),
    in a stable order."""
    seen: dict[Path, None] = {}
    stack = [cu.resolve()]
    while stack:
        f = stack.pop()
        if f in seen:
            continue
        seen[f] = None
        for name in _INCLUDE.findall(f.read_text()):
            dep = (f.parent / name).resolve()
            if dep.exists():
                stack.append(dep)
    first, *rest = seen
    return [first, *sorted(rest)]


def source_hash(cu: Path) -> str:
    h = hashlib.sha256()
    for f in source_closure(cu):
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def flags_text() -> str:
    return " ".join(NVCC_FLAGS)


def render_header(cu: Path, version: str) -> str:
    deps = ", ".join(f.name for f in source_closure(cu)[1:]) or "none"
    return (
        f"{HEADER_TAG} generated from {cu.name} (headers: {deps}); do not edit, run build.py\n"
        f"{HEADER_TAG} source-sha256 {source_hash(cu)}\n"
        f"{HEADER_TAG} flags {flags_text()}\n"
        f"{HEADER_TAG} nvcc {version}\n"
    )


def parse_header(text: str) -> tuple[Header | None, str]:
    """(header, body): the body is what nvcc wrote."""
    lines = text.splitlines(keepends=True)
    fields: dict[str, str] = {}
    n = 0
    for line in lines:
        if not line.startswith(HEADER_TAG):
            break
        n += 1
        rest = line[len(HEADER_TAG) :].strip()
        key, _, value = rest.partition(" ")
        fields[key] = value
    body = "".join(lines[n:])
    if not {"source-sha256", "flags", "nvcc"} <= fields.keys():
        return None, body
    return Header(fields["source-sha256"], fields["flags"], fields["nvcc"]), body


# nvcc names module-internal symbols (anonymous namespaces, function-static __shared__ arrays) with
# a hash of the source's absolute path: a clone at another path compiled byte-different PTX and
# failed --check (seen on a CI-like clone under /tmp). The hash is replaced by a constant; the
# symbols stay unique within the module, which is all the driver needs.
_PATH_HASH = re.compile(r"(_INTERNAL_|_GLOBAL__N__)[0-9a-f]{8}")


def canonical_ptx(text: str) -> str:
    return _PATH_HASH.sub(lambda m: m.group(1) + "00000000", text)


FRESH_COMPILES = 4


# nvcc 13.0's PTX for one source can differ from run to run: gemv_bf16.cu came out with two
# registers' roles swapped (two cvta.to.global lines and every later use) in 5 of 8 compiles run
# side by side (2026-12-04), while with address-space randomisation off 10 of 10 were the same.
# So nvcc runs under `setarch -R` where the machine has it and allows it, for builds and checks;
# with it the PTX still followed the length of the source's path (a clone at another path got the
# other order every time), so nvcc compiles a copy in a temporary folder (compile_body).
@functools.cache
def _no_aslr() -> tuple[str, ...]:
    setarch = shutil.which("setarch")
    if setarch is None:
        return ()
    cmd = (setarch, platform.machine(), "-R")
    return cmd if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0 else ()


def compile_body(nvcc: str, cu: Path, out_dir: Path) -> str:
    out = out_dir / (cu.stem + ".ptx")
    # The source and its headers copied to a folder of their own in out_dir (checks run side by
    # side there) and compiled by bare name: the PTX must not depend on where the clone is
    # (_no_aslr).
    src = out_dir / f"{cu.stem}.src"
    src.mkdir(exist_ok=True)
    for f in source_closure(cu):
        shutil.copyfile(f, src / f.name)
    cmd = [*_no_aslr(), nvcc, *NVCC_FLAGS, cu.name, "-o", str(out.resolve())]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=src)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed on {cu.name}:\n{' '.join(cmd)}\n{res.stderr}")
    if res.stderr.strip():
        log.warning("%s: %s", cu.name, res.stderr.strip())
    return canonical_ptx(out.read_text())


def build(ptx_dir: Path, names: list[str], nvcc: str) -> int:
    version = nvcc_version(nvcc)
    sources = [ptx_dir / f"{n}.cu" for n in names] if names else sorted(ptx_dir.glob("*.cu"))
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for cu in sources:
            if not cu.exists():
                log.error("no source %s", cu)
                failed += 1
                continue
            try:
                body = compile_body(nvcc, cu, Path(tmp))
            except RuntimeError as e:
                log.error("%s", e)
                failed += 1
                continue
            target = cu.with_suffix(".ptx")
            target.write_text(render_header(cu, version) + body)
            log.info("built %s (%d bytes)", target.relative_to(ptx_dir.parent), target.stat().st_size)
    return 1 if failed else 0


def check(ptx_dir: Path, nvcc: str | None) -> list[str]:
    """Problems, one line each naming the .ptx; empty when everything is current."""
    problems: list[str] = []
    version = None
    if nvcc is not None:
        try:
            version = nvcc_version(nvcc)
        except (OSError, subprocess.CalledProcessError) as e:
            log.warning("nvcc at %s unusable (%s): checking hashes only", nvcc, e)
            nvcc = None
    sources = sorted(ptx_dir.glob("*.cu"))

    def check_one(cu: Path, tmp: Path) -> str | None:
        ptx = cu.with_suffix(".ptx")
        rel = ptx.relative_to(ptx_dir.parent) if ptx_dir.parent in ptx.parents else ptx
        if not ptx.exists():
            return f"{rel}: missing (run build.py)"
        header, body = parse_header(ptx.read_text())
        if header is None:
            return f"{rel}: no build.py header (not built by build.py)"
        if header.source_sha256 != source_hash(cu):
            return f"{rel}: stale, {cu.name} or a header it includes changed"
        if header.flags != flags_text():
            return f"{rel}: stale, built with flags '{header.flags}', now '{flags_text()}'"
        if nvcc is None:
            return None
        if version != header.nvcc:
            log.warning("%s: built by nvcc %s, this is %s: hash check only", rel, header.nvcc, version)
            return None
        try:
            fresh = compile_body(nvcc, cu, tmp)
            # Where setarch is missing nvcc may still number the registers differently (see
            # _no_aslr): a .ptx is current when any of a few fresh compiles equals it. A hand
            # edit matches none of them.
            for _ in range(FRESH_COMPILES - 1):
                if fresh == body:
                    break
                fresh = compile_body(nvcc, cu, tmp)
        except RuntimeError as e:
            return f"{rel}: source no longer compiles: {e}"
        if fresh != body:
            return f"{rel}: differs from a fresh compile of {cu.name} (edited by hand?)"
        return None

    with tempfile.TemporaryDirectory() as tmp:
        # The fresh compiles are separate nvcc processes: one per core at a time (45 s serial for
        # the 20 sources on this 2-core machine, past the 40 s a pre-stop check allows).
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            found = list(pool.map(lambda cu: check_one(cu, Path(tmp)), sources))
        problems += [p for p in found if p is not None]
        for ptx in sorted(ptx_dir.glob("*.ptx")):
            if not ptx.with_suffix(".cu").exists():
                problems.append(f"{ptx.name}: no {ptx.stem}.cu beside it (orphan PTX)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="kernel sources to build (stems of ptx/*.cu); default all")
    ap.add_argument("--check", action="store_true", help="verify the committed PTX; exit 1 if stale")
    ap.add_argument("--ptx-dir", type=Path, default=PTX_DIR, help="directory of .cu/.ptx (default ptx/)")
    ap.add_argument("--nvcc", help="nvcc to use (default: nvcc on PATH, then /usr/local/cuda/bin/nvcc)")
    ap.add_argument("--no-nvcc", action="store_true", help="--check by hashes only, even if nvcc exists")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    nvcc = None if args.no_nvcc else find_nvcc(args.nvcc)
    if args.check:
        problems = check(args.ptx_dir, nvcc)
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            how = "hashes and a fresh compile" if nvcc else "hashes (no nvcc)"
            print(f"ptx: {len(list(args.ptx_dir.glob('*.cu')))} kernels current ({how})")
        return 1 if problems else 0
    if nvcc is None:
        print("nvcc not found: pass --nvcc", file=sys.stderr)
        return 2
    return build(args.ptx_dir, args.names, nvcc)


if __name__ == "__main__":
    sys.exit(main())
