#!/usr/bin/env python3
"""Measure GEMV geometries (warps per block, rows per warp, unroll of the m = 1 path) at the head's
shape, to choose the defaults compiled into ptx/gemv_bf16.cu and ptx/gemv_fp8w.cu.

Build the variants where nvcc is (machine code, so the GPU spends no time JIT-compiling them):

    python3 bench/sweep_gemv.py --build DIR

then time them on the GPU (each variant is checked against the host twin first):

    python3 bench/sweep_gemv.py --variants DIR

A variant directory is named ``<module>_w<W>_r<R>_u<U>_s<S>_mb<B>[_tag]`` and holds ``<module>.ptx`` (PTX or a
cubin: cuModuleLoadDataEx takes either).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (module, warps, rows, unroll of the m = 1 path, x staged in shared memory, min blocks per SM, tag).
# The first variant of each module is the compiled-in default; it is measured twice (tag "again")
# so that the spread between two runs of one version is on the table.
VARIANTS = [
    ("gemv_bf16", 8, 2, 4, 0, 1, ""),
    ("gemv_bf16", 8, 2, 4, 0, 1, "again"),
    ("gemv_bf16", 8, 4, 4, 0, 1, ""),
    ("gemv_bf16", 8, 1, 4, 0, 1, ""),
    ("gemv_fp8w", 8, 2, 4, 1, 1, ""),
    ("gemv_fp8w", 8, 2, 4, 1, 1, "again"),
    ("gemv_fp8w", 8, 1, 4, 0, 1, ""),
    ("gemv_fp8w", 8, 1, 4, 1, 1, ""),
    ("gemv_fp8w", 8, 1, 8, 1, 1, ""),
    ("gemv_fp8w", 8, 2, 2, 1, 1, ""),
    ("gemv_fp8w", 4, 1, 4, 1, 1, ""),
    ("gemv_fp8w", 16, 1, 4, 1, 1, ""),
    ("gemv_fp8w", 8, 2, 4, 1, 3, ""),
    ("gemv_fp8w", 8, 2, 4, 0, 3, ""),
]
MODULES = ("gemv_bf16", "gemv_fp8w")
VOCAB, HIDDEN = 154880, 4096
_NAME = re.compile(r"^(gemv_[a-z0-9]+)_w(\d+)_r(\d+)_u(\d+)_s(\d)_mb(\d+)(_\w+)?$")


def variant_name(module: str, w: int, r: int, u: int, smem: int, mb: int, tag: str) -> str:
    return f"{module}_w{w}_r{r}_u{u}_s{smem}_mb{mb}" + (f"_{tag}" if tag else "")


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for module, w, r, u, smem, mb, tag in VARIANTS:
        d = out / variant_name(module, w, r, u, smem, mb, tag)
        d.mkdir(exist_ok=True)
        cmd = [
            "nvcc",
            "-arch=sm_90",
            "-cubin",
            "-O3",
            "-std=c++17",
            f"-DGEMV_WARPS={w}",
            f"-DGEMV_ROWS={r}",
            f"-DGEMV_UNROLL1={u}",
            f"-DGEMV_X_SMEM={smem}",
            f"-DGEMV_MIN_BLOCKS={mb}",
            "-Xptxas",
            "-v",
            str(ROOT / "ptx" / f"{module}.cu"),
            "-o",
            str(d / f"{module}.ptx"),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        regs = re.findall(r"Used (\d+) registers", res.stderr)
        spill = re.findall(r"(\d+) bytes spill stores", res.stderr)
        print(f"{d.name}: {regs[-1] if regs else '?'} registers, {spill[-1] if spill else '?'} bytes spilled")


def bits(rng: np.random.Generator, n: int, exp_lo: int) -> np.ndarray:
    r = np.frombuffer(rng.bytes(2 * n), dtype=np.uint16)
    return (r & np.uint16(0x807F)) | ((((r >> 7) & np.uint16(7)) + np.uint16(127 + exp_lo)) << np.uint16(7))


def sweep(variants: Path, reps: int) -> None:
    from runtime.cuda_backend import CudaBackend
    from runtime.dtypes import BF16, quantize_rows_fp8
    from runtime.kernels.gemv_bf16 import gemv_bf16_ref
    from runtime.kernels.gemv_fp8w import gemv_fp8w_ref
    from runtime.launch import launch

    rng = np.random.default_rng()
    w = bits(rng, VOCAB * HIDDEN, -5).view(BF16).reshape(VOCAB, HIDDEN)
    x = bits(rng, HIDDEN, -2).view(BF16).reshape(1, HIDDEN)
    q, s = quantize_rows_fp8(w[:4096])
    q = np.tile(q, (VOCAB // 4096 + 1, 1))[:VOCAB]  # timing only: FP8 speed does not depend on values
    s = np.tile(s, VOCAB // 4096 + 1)[:VOCAB]
    ref_bf16 = gemv_bf16_ref(w[:4099], x).astype(np.float32)
    ref_fp8 = gemv_fp8w_ref(q[:4099], s[:4099], x).astype(np.float32)
    results = []
    for d in sorted(p for p in variants.iterdir() if p.is_dir()):
        m = _NAME.match(d.name)
        if not m:
            continue
        module, nw, nr = m.group(1), int(m.group(2)), int(m.group(3))
        gpu = CudaBackend(ptx_dir=d)
        try:
            # the kernel the launch helper uses for m = 1 (gemv_fp8w_m2 where the PTX has it)
            k = (
                gpu.try_kernel(module, "gemv_fp8w_m2")
                if module == "gemv_fp8w"
                else gpu.kernel(module, module)
            )
            k = k or gpu.kernel(module, module)
            grid, block = (VOCAB + nw * nr - 1) // (nw * nr), nw * 32
            smem = HIDDEN * 4 if module == "gemv_fp8w" else 0  # x staged as f32 where compiled in
            py = gpu.alloc(2 * VOCAB)
            px = gpu.alloc(x.nbytes)
            gpu.copy_h2d(px, x)
            if module == "gemv_bf16":
                pw = gpu.alloc(w.nbytes)
                gpu.copy_h2d(pw, w)
                args = (pw, px, py, 1, VOCAB, HIDDEN)
                ref, nbytes = ref_bf16, w.nbytes
                extra = [pw]
            else:
                pw, ps = gpu.alloc(q.nbytes), gpu.alloc(s.nbytes)
                gpu.copy_h2d(pw, q.view(np.uint8))
                gpu.copy_h2d(ps, s)
                args = (pw, ps, px, py, 1, VOCAB, HIDDEN)
                ref, nbytes = ref_fp8, q.nbytes
                extra = [pw, ps]
            gpu.memset(py, 0xFF, 2 * VOCAB)
            launch(gpu, k, grid, block, *args, smem=smem)
            y = np.empty(VOCAB, BF16)
            gpu.copy_d2h(y, py)
            err = np.abs(y[:4099].astype(np.float32) - ref[0]).max() / np.abs(ref).max()
            e0, e1 = gpu.event_create(), gpu.event_create()
            times = []
            inner = 5
            for i in range(reps + 3):
                # events around back-to-back launches queued behind a running one, so the Python
                # launch time is not inside the interval (bench_runtime.time_device)
                launch(gpu, k, grid, block, *args, smem=smem)
                gpu.event_record(e0)
                for _ in range(inner):
                    launch(gpu, k, grid, block, *args, smem=smem)
                gpu.event_record(e1)
                if i >= 3:
                    times.append(gpu.event_elapsed_ms(e0, e1) / inner)
            t = statistics.median(times)
            results.append((d.name, t * 1e3, nbytes / (t * 1e-3) / 1e12, err))
            print(
                f"{d.name:28s} {t * 1e3:8.1f} us  {nbytes / (t * 1e-3) / 1e12:6.3f} TB/s  max rel err {err:.2e}",
                flush=True,
            )
            for p in (py, px, *extra):
                gpu.free(p)
        finally:
            gpu.close()
    print("\nbest per module:")
    for module in MODULES:
        rs = [r for r in results if r[0].startswith(module + "_w")]
        if rs:
            best = min(rs, key=lambda r: r[1])
            print(f"  {best[0]}: {best[1]:.1f} us, {best[2]:.3f} TB/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, help="compile the variants into this directory")
    ap.add_argument("--variants", type=Path, help="time the variants in this directory")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if args.build:
        build(args.build)
    if args.variants:
        sweep(args.variants, args.reps)
    if not (args.build or args.variants):
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp))
            sweep(Path(tmp), args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
