#!/usr/bin/env python3
"""Runtime kernel benchmark, one run on the GPU:

- device copy bandwidth (one large device-to-device copy, bytes read + written), the ceiling;
- BF16 GEMV and FP8-weight GEMV at the draft head's shape (154880 x 4096, m = 1) and their ratio
  to the copy bandwidth (FP8: counted on weight bytes);
- a kernel that only reads (read_xor) over the FP8 head's 635 MB, with the weight loads' cache
  policy and with the `.L2::256B` hint, at 4 and 8 blocks of 256 threads per SM;
- argmax over 154880 BF16 logits;
- torch.argmax and torch.nn.functional.linear (cuBLAS) on the same data, for comparison;
- the host-side cost of one eager launch from Python and of one graph launch.

Every device time is the median of many event-timed repetitions after a warm-up, on random data.
The table is printed last and written into BENCHMARKS.md (section "Runtime kernels").

    PYTHONUNBUFFERED=1 python3 bench/bench_runtime.py [--md BENCHMARKS.md] [--section-out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cuda.bindings import driver  # noqa: E402 - after the sys.path insert

from runtime.cuda_backend import CudaBackend  # noqa: E402 - after the sys.path insert
from runtime.dtypes import BF16  # noqa: E402 - after the sys.path insert
from runtime.kernels.add_bf16 import ADD_BF16, add_bf16  # noqa: E402 - after the sys.path insert
from runtime.kernels.argmax_bf16 import argmax_bf16, argmax_ref  # noqa: E402 - after the sys.path insert
from runtime.kernels.gemv_bf16 import gemv_bf16  # noqa: E402 - after the sys.path insert
from runtime.kernels.gemv_fp8w import gemv_fp8w  # noqa: E402 - after the sys.path insert
from runtime.kernels.quantize_fp8 import quantize_fp8  # noqa: E402 - after the sys.path insert
from runtime.kernels.read_xor import BLOCK as READ_BLOCK  # noqa: E402 - after the sys.path insert
from runtime.kernels.read_xor import read_xor, read_xor_decl  # noqa: E402 - after the sys.path insert
from runtime.launch import check_args  # noqa: E402 - after the sys.path insert

log = logging.getLogger("bench_runtime")

VOCAB, HIDDEN = 154880, 4096
COPY_BYTES = 4 << 30  # 4 GiB each way: 70x the 60 MB L2, so the copy streams from HBM
SECTION = "## Runtime kernels"
COMMAND = "PYTHONUNBUFFERED=1 python3 bench/bench_runtime.py"


@dataclass
class Row:
    what: str
    time: str
    rate: str = ""
    ratio: str = ""


def random_bf16_bits(rng: np.random.Generator, n: int, exp_lo: int = -5) -> np.ndarray:
    """Random BF16 bit patterns (uint16): random sign and mantissa, exponent in [exp_lo, exp_lo+7]."""
    r = np.frombuffer(rng.bytes(2 * n), dtype=np.uint16)
    exp = ((r >> 7) & np.uint16(7)) + np.uint16(127 + exp_lo)
    return (r & np.uint16(0x807F)) | (exp << np.uint16(7))


def time_device(
    gpu: CudaBackend, fn: Callable[[], None], reps: int, inner: int = 5, warmup: int = 3
) -> float:
    """Median device milliseconds of one ``fn``: events around ``inner`` back-to-back calls,
    recorded while an earlier call still runs. Events around a single call from an idle GPU would
    also time the Python launch (the first run measured gemv_bf16 at 335 us that way; ncu put
    the kernel itself at 296 us). For kernels shorter than a Python launch use a graph instead."""
    for _ in range(warmup):
        fn()
    gpu.synchronize()
    e0, e1 = gpu.event_create(), gpu.event_create()
    times = []
    for _ in range(reps):
        fn()  # keeps the device busy while e0 and the timed calls are queued
        gpu.event_record(e0)
        for _ in range(inner):
            fn()
        gpu.event_record(e1)
        times.append(gpu.event_elapsed_ms(e0, e1) / inner)
    gpu.event_destroy(e0)
    gpu.event_destroy(e1)
    return statistics.median(times)


def time_torch(fn: Callable[[], object], reps: int, inner: int = 5, warmup: int = 3) -> float:
    """As ``time_device``, on torch's current stream."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        e0.record()
        for _ in range(inner):
            fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / inner)
    return statistics.median(times)


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def update_benchmarks_md(path: Path, section: str) -> None:
    """Replace (or append) the "## Runtime kernels" section of BENCHMARKS.md, keeping the others."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == SECTION), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + section + ("\n" + "".join(lines[end:]) if end < len(lines) else "")
    path.write_text(new)


def render(rows: list[Row], machine: str, notes: list[str]) -> str:
    out = [
        f"{SECTION}\n\n",
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine}.\n\n",
        f"Command: `{COMMAND}`\n\n",
        "| what | device time | throughput | vs copy BW |\n",
        "|---|---|---|---|\n",
    ]
    out += [f"| {r.what} | {r.time} | {r.rate} | {r.ratio} |\n" for r in rows]
    if notes:
        out.append("\n" + "".join(f"- {n}\n" for n in notes))
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--md", type=Path, default=ROOT / "BENCHMARKS.md", help="BENCHMARKS.md to update")
    ap.add_argument("--section-out", type=Path, help="also write the section alone to this file")
    ap.add_argument("--reps", type=int, default=50, help="timed repetitions per measurement")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparisons")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are a convenience

        def tqdm(it, **_):  # type: ignore[no-redef]
            return it

    gpu = CudaBackend()
    rng = np.random.default_rng()
    rows: list[Row] = []
    notes: list[str] = []
    reps = args.reps
    stages = tqdm(total=6, desc="bench", file=sys.stderr)

    # ---- 1. copy bandwidth: the ceiling every ratio is against --------------------------------
    nbytes = COPY_BYTES
    src, dst = gpu.alloc(nbytes), gpu.alloc(nbytes)
    gpu.memset(src, 0x5A, nbytes)
    t_copy = time_device(gpu, lambda: gpu.copy_d2d(dst, src, nbytes), reps)
    copy_bw = 2 * nbytes / (t_copy * 1e-3)
    rows.append(
        Row(
            f"device copy {nbytes >> 30} GiB (read + write)",
            f"{t_copy:.3f} ms",
            f"{copy_bw / 1e12:.3f} TB/s",
            "1.000",
        )
    )
    gpu.free(src)
    gpu.free(dst)
    stages.update()

    # ---- 2. BF16 GEMV at the head's shape ------------------------------------------------------
    w_bits = random_bf16_bits(rng, VOCAB * HIDDEN)
    x_bits = random_bf16_bits(rng, HIDDEN, exp_lo=-2)
    pw, px, py = gpu.alloc(w_bits.nbytes), gpu.alloc(x_bits.nbytes), gpu.alloc(2 * VOCAB)
    gpu.copy_h2d(pw, w_bits)
    gpu.copy_h2d(px, x_bits)
    t_gemv = time_device(gpu, lambda: gemv_bf16(gpu, pw, px, py, 1, VOCAB, HIDDEN), reps)
    gemv_bytes = w_bits.nbytes + x_bits.nbytes + 2 * VOCAB
    bw = gemv_bytes / (t_gemv * 1e-3)
    rows.append(
        Row(
            f"gemv_bf16 {VOCAB}x{HIDDEN}, m=1",
            f"{t_gemv * 1e3:.1f} us",
            f"{bw / 1e12:.3f} TB/s",
            f"{bw / copy_bw:.3f}",
        )
    )
    stages.update()

    # ---- 3. FP8-weight GEMV (weights quantised on the device by quantize_fp8) -------------------
    pq, ps, py8 = gpu.alloc(VOCAB * HIDDEN), gpu.alloc(4 * VOCAB), gpu.alloc(2 * VOCAB)
    quantize_fp8(gpu, pw, pq, ps, VOCAB, HIDDEN)
    t_fp8 = time_device(gpu, lambda: gemv_fp8w(gpu, pq, ps, px, py8, 1, VOCAB, HIDDEN), reps)
    bw8 = VOCAB * HIDDEN / (t_fp8 * 1e-3)
    rows.append(
        Row(
            f"gemv_fp8w {VOCAB}x{HIDDEN}, m=1 (weight bytes)",
            f"{t_fp8 * 1e3:.1f} us",
            f"{bw8 / 1e12:.3f} TB/s",
            f"{bw8 / copy_bw:.3f}",
        )
    )
    t_q = time_device(gpu, lambda: quantize_fp8(gpu, pw, pq, ps, VOCAB, HIDDEN), max(5, reps // 5), inner=2)
    qbw = (w_bits.nbytes + VOCAB * HIDDEN + 4 * VOCAB) / (t_q * 1e-3)
    rows.append(
        Row(
            f"quantize_fp8 {VOCAB}x{HIDDEN}",
            f"{t_q * 1e3:.1f} us",
            f"{qbw / 1e12:.3f} TB/s",
            f"{qbw / copy_bw:.3f}",
        )
    )

    # ---- 3b. a kernel that only reads: the same 635 MB with the weight loads' cache policy, and
    # with the .L2::256B prefetch-size hint those loads had before it measured slower
    read_bytes = VOCAB * HIDDEN
    out = gpu.alloc(4 * 8 * gpu.sm_count)
    whole = np.empty(read_bytes, np.uint8)
    gpu.copy_d2h(whole, pq)
    expect = np.bitwise_xor.reduce(whole.view(np.uint32))
    del whole
    for l2_256b in (False, True):
        full = gpu.resident_blocks(gpu.kernel(*read_xor_decl(l2_256b).key), READ_BLOCK)
        for blocks in sorted({4 * gpu.sm_count, min(full, 8 * gpu.sm_count)}):
            t_rd = time_device(
                gpu, lambda b=blocks, h=l2_256b: read_xor(gpu, pq, read_bytes, out, b, l2_256b=h), reps
            )
            rbw = read_bytes / (t_rd * 1e-3)
            hint = ", .L2::256B hint" if l2_256b else ""
            rows.append(
                Row(
                    f"read_xor {read_bytes >> 20} MiB, {blocks // gpu.sm_count} blocks per SM{hint}",
                    f"{t_rd * 1e3:.1f} us",
                    f"{rbw / 1e12:.3f} TB/s",
                    f"{rbw / copy_bw:.3f}",
                )
            )
            parts = np.empty(blocks, np.uint32)
            gpu.copy_d2h(parts, out)
            assert np.bitwise_xor.reduce(parts) == expect, (
                f"read_xor ({blocks} blocks{hint}) did not read every word"
            )
    gpu.free(out)
    gpu.free(pq)
    gpu.free(ps)
    gpu.free(py8)
    stages.update()

    # ---- 4. argmax over the logits the GEMV wrote ----------------------------------------------
    pi, pv = gpu.alloc(4), gpu.alloc(4)
    t_am = time_device(gpu, lambda: argmax_bf16(gpu, py, pi, pv, VOCAB), reps, inner=20)
    logits = np.empty(VOCAB, np.uint16)
    gpu.copy_d2h(logits, py)
    idx = np.empty(1, np.uint32)
    gpu.copy_d2h(idx, pi)
    assert int(idx[0]) == argmax_ref(logits.view(BF16))[0], "argmax disagrees with its twin"
    rows.append(
        Row(f"argmax_bf16 n={VOCAB} (eager, back-to-back: Python-launch bound)", f"{t_am * 1e3:.2f} us")
    )
    # In the drafter argmax runs inside a graph; time it there, over 64 copies of the logits
    # (64 x 310 KB = 20 MB) in turn, so consecutive launches do not reuse one L2-resident input.
    copies = 64
    pl = gpu.alloc(copies * 2 * VOCAB)
    for c in range(copies):
        gpu.copy_d2d(pl.offset(c * 2 * VOCAB), py, 2 * VOCAB)
    s = gpu.create_stream()
    gpu.begin_capture(s)
    for c in range(copies):
        argmax_bf16(gpu, pl.offset(c * 2 * VOCAB), pi, pv, VOCAB, stream=s)
    g = gpu.end_capture(s, label="argmax x64")
    gpu.synchronize()

    def replay() -> None:
        gpu.graph_launch(g, s)

    e0, e1 = gpu.event_create(), gpu.event_create()
    graph_times = []
    for _ in range(20):
        gpu.event_record(e0, s)
        replay()
        gpu.event_record(e1, s)
        graph_times.append(gpu.event_elapsed_ms(e0, e1) / copies)
    t_am_graph = statistics.median(graph_times[3:])
    gpu.event_destroy(e0)
    gpu.event_destroy(e1)
    rows.append(Row(f"argmax_bf16 n={VOCAB} (in a graph, per launch)", f"{t_am_graph * 1e3:.2f} us"))
    gpu.graph_destroy(g)
    gpu.free(pl)
    stages.update()

    # ---- 5. torch on the same data ---------------------------------------------------------------
    if not args.no_torch:
        try:
            import torch

            wt = torch.from_numpy(w_bits.view(np.int16)).view(torch.bfloat16).reshape(VOCAB, HIDDEN).cuda()
            xt = torch.from_numpy(x_bits.view(np.int16)).view(torch.bfloat16).reshape(1, HIDDEN).cuda()
            lt = torch.from_numpy(logits.view(np.int16)).view(torch.bfloat16).cuda()
            f = torch.nn.functional.linear
            t_tg = time_torch(lambda: f(xt, wt), reps)
            tbw = gemv_bytes / (t_tg * 1e-3)
            rows.append(
                Row(
                    "torch F.linear (cuBLAS), same shape",
                    f"{t_tg * 1e3:.1f} us",
                    f"{tbw / 1e12:.3f} TB/s",
                    f"{tbw / copy_bw:.3f}",
                )
            )
            t_ta = time_torch(lambda: torch.argmax(lt), reps, inner=20)
            rows.append(Row(f"torch.argmax n={VOCAB} (eager, back-to-back)", f"{t_ta * 1e3:.2f} us"))
            g_t = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_t):
                for _ in range(64):
                    torch.argmax(lt)
            t_tag = time_torch(g_t.replay, 20, inner=1) / 64
            rows.append(Row(f"torch.argmax n={VOCAB} (in a graph, per call)", f"{t_tag * 1e3:.2f} us"))
            t_idx = int(torch.argmax(lt).item())
            if t_idx != int(idx[0]):
                notes.append(f"torch.argmax gave {t_idx}, argmax_bf16 gave {int(idx[0])} on the same logits")
            del wt, xt, lt
            torch.cuda.empty_cache()
        except Exception as e:  # the comparison is optional; the runtime's numbers are not
            log.warning("torch comparison skipped: %s", e)
            notes.append(f"torch comparison skipped: {e}")
    stages.update()

    # ---- the two GEMVs again, late in the run: the spread between two measurements of one
    # version is the noise any comparison above has to beat
    t_gemv2 = time_device(gpu, lambda: gemv_bf16(gpu, pw, px, py, 1, VOCAB, HIDDEN), reps)
    bw2 = gemv_bytes / (t_gemv2 * 1e-3)
    rows.append(
        Row(
            "gemv_bf16 again (late in the run)",
            f"{t_gemv2 * 1e3:.1f} us",
            f"{bw2 / 1e12:.3f} TB/s",
            f"{bw2 / copy_bw:.3f}",
        )
    )

    # ---- 6. host-side launch cost ------------------------------------------------------------------
    pa = gpu.alloc(64)
    gpu.memset(pa, 0x3C, 64)
    k = gpu.kernel(*ADD_BF16.key)
    n_launch = 3000

    def host_us(fn: Callable[[], None]) -> float:
        for _ in range(200):
            fn()
        gpu.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_launch):
            fn()
        t1 = time.perf_counter()
        gpu.synchronize()
        return (t1 - t0) / n_launch * 1e6

    out = pa.offset(32)
    us_helper = host_us(lambda: add_bf16(gpu, pa, pa, out, 8))
    args_ = (pa, pa, out, 8)
    us_launch = host_us(lambda: gpu.launch(k, (1, 1, 1), (256, 1, 1), args_))
    # The floor under both: cuLaunchKernel alone with arguments packed once.
    fn = k.native
    params = fn.packer.pack(check_args(k, args_))
    stream = gpu._stream(None)
    us_driver = host_us(lambda: driver.cuLaunchKernel(fn.func, 1, 1, 1, 256, 1, 1, 0, stream, params, 0))
    rows.append(Row("eager launch, host cost: kernel helper (add_bf16)", f"{us_helper:.1f} us"))
    rows.append(Row("eager launch, host cost: gpu.launch (checked, packed)", f"{us_launch:.1f} us"))
    rows.append(Row("eager launch, host cost: bare cuLaunchKernel (floor)", f"{us_driver:.1f} us"))
    gpu.begin_capture(s)
    add_bf16(gpu, pa, pa, out, 8, stream=s)
    g1 = gpu.end_capture(s, label="one add")
    us_graph = host_us(lambda: gpu.graph_launch(g1, s))
    gpu.synchronize(s)
    rows.append(Row("graph launch, host cost (gpu.graph_launch)", f"{us_graph:.1f} us"))
    gpu.graph_destroy(g1)
    gpu.free(pa)
    gpu.destroy_stream(s)
    stages.update()
    stages.close()

    for p in (pw, px, py, pi, pv):
        gpu.free(p)
    leaked = gpu.stats().live_allocations
    machine = (
        f"{gpu.device_name} ({gpu.sm_count} SMs), NVIDIA driver {driver_version()}, "
        f"cuda-bindings {_version('cuda.bindings')}, numpy {np.__version__}, torch {_version('torch')}, "
        f"Python {platform.python_version()}"
    )
    gpu.close()
    if leaked:
        notes.append(f"{leaked} allocations were still live at the end (a leak in this script)")
    notes.append(
        "Device times are medians of event-timed repetitions after warm-up, events around back-to-back "
        "launches queued while the device is busy (so no Python launch time is inside); argmax in a graph "
        "is per launch over a graph of 64 launches on 64 different copies of the logits. GEMV bytes are "
        "W + x + y; the FP8 ratio counts weight bytes only; read_xor counts the bytes it reads (its XOR "
        "of them is checked against the host's). Host costs are wall-clock per call over 3000 calls."
    )
    section = render(rows, machine, notes)
    if args.section_out:
        args.section_out.write_text(section)
    update_benchmarks_md(args.md, section)
    width = max(len(r.what) for r in rows)
    print()
    print(f"{'what':<{width}}  {'device time':>12}  {'throughput':>12}  {'vs copy':>8}")
    for r in rows:
        print(f"{r.what:<{width}}  {r.time:>12}  {r.rate:>12}  {r.ratio:>8}")
    return 0


def _version(mod: str) -> str:
    try:
        m = __import__(mod, fromlist=["__version__"])
        return str(getattr(m, "__version__", "?"))
    except Exception:
        return "absent"


if __name__ == "__main__":
    sys.exit(main())
