#!/usr/bin/env python3
"""Time the absorbed-MLA split pair (sparse_mla_partial_batch + sparse_mla_combine_batch) with and
without its RoPE part, at the GLM-5 / DeepSeek-V3.2 decode shape by default: 64 heads, latent
width 512, rope width 64, 2048 selected rows per entry, 64 entries (each its own slot).

    python3 bench/bench_sparse_mla_rope.py [--old-ptx DIR]
    python3 bench/bench_sparse_mla_rope.py --wide [--ms 1,16,64,256] [--heads-list 64,128]
        [--rope-list 0,64] [--split-rows 64,128,256] [--no-pdl] [--json PATH]

``--wide``: the split pair against the wide pair (sparse_mla_partial_wide_batch +
sparse_mla_combine_wide_batch, all heads per block) at each split length, for every batch size,
head count and rope width given (latent 512, ``--sel`` selected rows per entry): a table of the
pair's time (partial + merge, and each alone) per launch, the speedup of each wide split length
over the split pair, and each form's largest deviation from the split pair's output (BF16: a few
2**-8 of the output's largest is rounding, more is a bug).

Each configuration is timed with CUDA events over ``--iters`` back-to-back launches, in
``--rounds`` interleaved rounds (median reported), as the pair (the launch helper) and as the
partials kernel alone (the one the RoPE part changes). ``--old-ptx DIR``: a directory with the
sparse_mla.ptx of before the RoPE arguments; its partials kernel (the old argument list) is timed
too, and its NoPE output and workspace are compared byte for byte with this build's rope_dim = 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model.kernels import sparse_mla  # noqa: E402
from runtime.dtypes import BF16  # noqa: E402
from runtime.kernel import F32, PTR, U32, KernelDecl, Pdl  # noqa: E402
from runtime.launch import launch  # noqa: E402

# sparse_mla_partial_batch's arguments before the RoPE part.
OLD_PARTIAL_ARGS = (
    ("q", PTR),
    ("cache", PTR),
    ("scales", PTR),
    ("tables", PTR),
    ("selected", PTR),
    ("count", PTR),
    ("part", PTR),
    ("ml", PTR),
    ("entries", PTR),
    ("m", U32),
    ("slot_rows", U32),
    ("sel_cap", U32),
    ("heads", U32),
    ("dim", U32),
    ("block_size", U32),
    ("scale", F32),
)


def old_partial_kernel(gpu, ptx_dir: Path):
    """The old PTX's partials kernel as a handle of this backend (the registered declaration has
    the new arguments, so the old one is built here)."""
    from cuda.bindings import driver

    from runtime.backend import KernelHandle
    from runtime.cuda_driver import CudaFunction, load_ptx

    decl = KernelDecl(
        "sparse_mla", "sparse_mla_partial_batch", OLD_PARTIAL_ARGS, ("part", "ml"), None, Pdl.WAIT, True
    )
    mod = load_ptx(ptx_dir / "sparse_mla.ptx")
    err, func = driver.cuModuleGetFunction(mod, b"sparse_mla_partial_batch")
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{ptx_dir}/sparse_mla.ptx: no sparse_mla_partial_batch ({err})")
    return KernelHandle(decl, CudaFunction(gpu, func, decl, gpu.pdl_supported))


def _csv(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def wide_world(gpu, rng, m: int, heads: int, dim: int, rd: int, sel: int, slot_rows: int, block_size: int):
    """Device buffers of m entries (each its own slot, sel distinct rows of slot_rows selected in
    random order), as main's."""
    bps = -(-slot_rows // block_size)
    nblocks = m * bps
    cache = np.frombuffer(rng.bytes(nblocks * block_size * dim), np.uint8).copy()
    cache[(cache & 0x7F) == 0x7F] &= 0x80  # no NaN codes
    host = {
        "q": rng.standard_normal((m, heads, dim)).astype(np.float32),
        "cache": cache,
        "scales": rng.uniform(1e-3, 1e-2, nblocks * block_size).astype(np.float32),
        "tables": rng.permutation(nblocks).astype(np.uint32),
        "sel": np.stack([rng.choice(slot_rows, sel, replace=False) for _ in range(m)]).astype(np.uint32),
        "cnt": np.full(m, sel, np.uint32),
        "entries": np.stack([np.arange(m), np.zeros(m), np.zeros(m), np.zeros(m)], 1).astype(np.uint32),
    }
    if rd:
        host["q_rope"] = rng.standard_normal((m, heads, rd)).astype(BF16)
        host["rope_keys"] = rng.standard_normal((m, slot_rows, rd)).astype(BF16)
    p = {}
    for k, v in host.items():
        p[k] = gpu.alloc(v.nbytes)
        gpu.copy_h2d(p[k], np.ascontiguousarray(v))
    return p


def wide_main(a) -> None:
    """The --wide table (the module docstring)."""
    import json

    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend(pdl=not a.no_pdl)
    dim, sel = a.dim, a.sel
    ms, splits = sorted(_csv(a.ms)), _csv(a.split_rows)
    for r in splits:
        if not sparse_mla.wide_split_rows_ok(r):
            raise SystemExit(
                f"--split-rows {r}: not a multiple of 64 from 64 to {sparse_mla.WIDE_MAX_SPLIT_ROWS}"
            )
    e0, e1 = gpu.event_create(), gpu.event_create()

    def timed(fn) -> float:
        """Median over the rounds of the mean time per launch in us."""
        fn()
        gpu.synchronize()
        per = []
        for _ in range(a.rounds):
            gpu.event_record(e0)
            for _ in range(a.iters):
                fn()
            gpu.event_record(e1)
            gpu.synchronize()
            per.append(gpu.event_elapsed_ms(e0, e1) * 1e3 / a.iters)
        return statistics.median(per)

    rows = []
    for heads in _csv(a.heads_list):
        for rd in _csv(a.rope_list):
            rng = np.random.default_rng(heads + rd)
            p = wide_world(gpu, rng, ms[-1], heads, dim, rd, sel, a.slot_rows, a.block_size)
            pb, mb = sparse_mla.split_workspace_batch(heads, dim, sel, ms[-1])  # the larger workspace
            part, ml = gpu.alloc(pb), gpu.alloc(mb)
            outs = {f: gpu.alloc(ms[-1] * heads * dim * 2) for f in ["pair", *map(str, splits)]}
            scale = 1.0 / float(np.sqrt(dim + rd))
            try:
                for m in ms:
                    base = dict(
                        q=p["q"], cache=p["cache"], scales=p["scales"], tables=p["tables"], selected=p["sel"],
                        count=p["cnt"], part=part, ml=ml, entries=p["entries"], m=m, slot_rows=a.slot_rows,
                        sel_cap=sel, heads=heads, dim=dim, block_size=a.block_size, scale=scale,
                    )  # fmt: skip
                    if rd:
                        base.update(q_rope=p["q_rope"], rope_keys=p["rope_keys"], rope_dim=rd)
                    forms = {"pair": lambda o, kw=base: sparse_mla.sparse_mla_split_batch(gpu, out=o, **kw)}
                    for r in splits:
                        forms[str(r)] = lambda o, r=r, kw=base: sparse_mla.sparse_mla_wide_batch(
                            gpu, out=o, split_rows=r, **kw
                        )
                    res = {"m": m, "heads": heads, "rope_dim": rd, "sel": sel}
                    for f, fn in forms.items():
                        res[f] = timed(lambda fn=fn, o=outs[f]: fn(o))
                    # Each form's output against the split pair's, every entry.
                    n = m * heads * dim
                    ref = np.empty(n, np.uint16)
                    gpu.copy_d2h(ref, outs["pair"])
                    rf = ref.view(BF16).astype(np.float32)
                    for r in splits:
                        got = np.empty(n, np.uint16)
                        gpu.copy_d2h(got, outs[str(r)])
                        gf = got.view(BF16).astype(np.float32)
                        res[f"dev_{r}"] = float(np.abs(gf - rf).max() / max(np.abs(rf).max(), 1e-30))
                    rows.append(res)
                    best = min(splits, key=lambda r: res[str(r)])
                    print(
                        f"m={m:4d} heads={heads:3d} rope={rd:3d}: pair {res['pair']:9.1f} us | "
                        + " | ".join(
                            f"wide {r}: {res[str(r)]:8.1f} (x{res['pair'] / res[str(r)]:.2f})" for r in splits
                        )
                        + f" | best {best}",
                        flush=True,
                    )
            finally:
                for ptr in (*p.values(), part, ml, *outs.values()):
                    gpu.free(ptr)
    gpu.event_destroy(e0)
    gpu.event_destroy(e1)
    gpu.close()
    print(
        f"\nus per launch (partial + merge), median of {a.rounds} rounds of {a.iters}; latent {dim}, {sel} rows"
    )
    head = "| m | heads | rope | split pair | " + " | ".join(f"wide {r}" for r in splits) + " | deviation |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r0 in rows:
        dev = max(r0[f"dev_{r}"] for r in splits)
        cells = " | ".join(f"{r0[str(r)]:.1f} (x{r0['pair'] / r0[str(r)]:.2f})" for r in splits)
        print(f"| {r0['m']} | {r0['heads']} | {r0['rope_dim']} | {r0['pair']:.1f} | {cells} | {dev:.1e} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--sel", type=int, default=2048)
    ap.add_argument("--slot-rows", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--old-ptx", type=Path, default=None)
    ap.add_argument("--wide", action="store_true", help="the split pair against the wide pair (a table)")
    ap.add_argument("--ms", default="1,16,64,256", help="--wide: batch sizes")
    ap.add_argument("--heads-list", default="64,128", help="--wide: head counts")
    ap.add_argument("--rope-list", default="0,64", help="--wide: rope widths")
    ap.add_argument("--split-rows", default="64,128,256", help="--wide: the wide pair's split lengths")
    ap.add_argument(
        "--no-pdl", action="store_true", help="--wide: launch without programmatic dependent launch"
    )
    ap.add_argument("--json", type=Path, default=None, help="--wide: write the rows here")
    a = ap.parse_args()
    if a.wide:
        wide_main(a)
        return

    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    rng = np.random.default_rng(0)
    m, heads, dim, rd, sel = a.m, a.heads, a.dim, a.rope_dim, a.sel
    bps = -(-a.slot_rows // a.block_size)
    nblocks = m * bps
    cache = np.frombuffer(rng.bytes(nblocks * a.block_size * dim), np.uint8).copy()
    cache[(cache & 0x7F) == 0x7F] &= 0x80  # no NaN codes
    host = {
        "q": rng.standard_normal((m, heads, dim)).astype(np.float32),
        "q_rope": rng.standard_normal((m, heads, rd)).astype(BF16),
        "cache": cache,
        "scales": rng.uniform(1e-3, 1e-2, nblocks * a.block_size).astype(np.float32),
        "rope_keys": rng.standard_normal((m, a.slot_rows, rd)).astype(BF16),
        "tables": rng.permutation(nblocks).astype(np.uint32),
        "sel": np.stack([rng.choice(a.slot_rows, sel, replace=False) for _ in range(m)]).astype(np.uint32),
        "cnt": np.full(m, sel, np.uint32),
        "entries": np.stack([np.arange(m), np.zeros(m), np.zeros(m), np.zeros(m)], 1).astype(np.uint32),
    }
    p = {}
    for k, v in host.items():
        p[k] = gpu.alloc(v.nbytes)
        gpu.copy_h2d(p[k], np.ascontiguousarray(v))
    pb, mb = sparse_mla.split_workspace_batch(heads, dim, sel, m)
    outs = {
        name: {"part": gpu.alloc(pb), "ml": gpu.alloc(mb), "out": gpu.alloc(m * heads * dim * 2)}
        for name in ("nope", "rope", "old")
    }
    geo = dict(m=m, slot_rows=a.slot_rows, sel_cap=sel, heads=heads, dim=dim, block_size=a.block_size)
    scale = 1.0 / float(np.sqrt(dim + rd))
    base = dict(
        q=p["q"], cache=p["cache"], scales=p["scales"], tables=p["tables"], selected=p["sel"], count=p["cnt"],
        entries=p["entries"], scale=scale, **geo,
    )  # fmt: skip
    rope_kw = dict(q_rope=p["q_rope"], rope_keys=p["rope_keys"], rope_dim=rd)
    partial = gpu.kernel(*sparse_mla.SPARSE_MLA_PARTIAL_BATCH.key)
    combine = gpu.kernel(*sparse_mla.SPARSE_MLA_COMBINE_BATCH.key)
    grid = (sparse_mla.batch_splits(sel), -(-heads // sparse_mla.HEAD_TILE), m)
    tail = (p["entries"], m, a.slot_rows, sel, heads, dim)

    def pair(name: str, rope_dim: int):
        o = outs[name]
        kw = rope_kw if rope_dim else {}
        return lambda: sparse_mla.sparse_mla_split_batch(
            gpu, part=o["part"], ml=o["ml"], out=o["out"], **base, **kw
        )

    def part_only(name: str, rope_dim: int):
        o = outs[name]
        qr, kr = (p["q_rope"], p["rope_keys"]) if rope_dim else (p["q"], p["q"])
        head = (p["q"], qr, p["cache"], p["scales"], kr, p["tables"], p["sel"], p["cnt"], o["part"], o["ml"])
        smem = sparse_mla.partial_smem(dim, rope_dim)
        return lambda: launch(gpu, partial, grid, 256, *head, *tail, rope_dim, a.block_size, scale, smem=smem)

    configs = {
        "pair, rope_dim 0": pair("nope", 0),
        f"pair, rope_dim {rd}": pair("rope", rd),
        "partial, rope_dim 0": part_only("nope", 0),
        f"partial, rope_dim {rd}": part_only("rope", rd),
    }
    if a.old_ptx is not None:
        old = old_partial_kernel(gpu, a.old_ptx)
        o = outs["old"]
        old_args = (
            p["q"],
            p["cache"],
            p["scales"],
            p["tables"],
            p["sel"],
            p["cnt"],
            o["part"],
            o["ml"],
            *tail,
        )
        smem0 = sparse_mla.partial_smem(dim)

        def old_part():
            launch(gpu, old, grid, 256, *old_args, a.block_size, scale, smem=smem0)

        def old_pair():
            old_part()
            merge = (o["part"], o["ml"], p["cnt"], o["out"], p["entries"], m, sel, heads, dim)
            launch(gpu, combine, (heads, -(-dim // 128), m), 256, *merge)

        configs["pair, old PTX (NoPE)"] = old_pair
        configs["partial, old PTX (NoPE)"] = old_part

    # Bits: this build's rope_dim 0 against the old kernel.
    for fn in configs.values():
        fn()
    gpu.synchronize()
    if a.old_ptx is not None:
        configs["pair, rope_dim 0"]()
        configs["pair, old PTX (NoPE)"]()
        gpu.synchronize()
        for k in ("part", "ml", "out"):
            n = {"part": pb, "ml": mb, "out": m * heads * dim * 2}[k]
            x, y = np.empty(n, np.uint8), np.empty(n, np.uint8)
            gpu.copy_d2h(x, outs["nope"][k])
            gpu.copy_d2h(y, outs["old"][k])
            print(
                f"NoPE {k} vs the old PTX: {'bit-identical' if np.array_equal(x, y) else 'DIFFERENT'} ({n} bytes)"
            )
        r, z = np.empty(m * heads * dim * 2, np.uint8), np.empty(m * heads * dim * 2, np.uint8)
        gpu.copy_d2h(r, outs["rope"]["out"])
        gpu.copy_d2h(z, outs["nope"]["out"])
        print(f"rope_dim {rd} output differs from NoPE's: {not np.array_equal(r, z)}")

    e0, e1 = gpu.event_create(), gpu.event_create()
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(a.rounds):
        for name, fn in configs.items():
            fn()
            gpu.event_record(e0)
            for _ in range(a.iters):
                fn()
            gpu.event_record(e1)
            gpu.synchronize()
            times[name].append(gpu.event_elapsed_ms(e0, e1) * 1e3 / a.iters)
    print(
        f"m={m} heads={heads} dim={dim} rope_dim={rd} sel={sel}: us per launch, median of {a.rounds} rounds"
    )
    for name, t in times.items():
        print(f"  {name:28s} {statistics.median(t):8.1f}  (min {min(t):.1f}, max {max(t):.1f})")
    for d in (p, *outs.values()):
        for ptr in d.values():
            gpu.free(ptr)
    gpu.event_destroy(e0)
    gpu.event_destroy(e1)
    gpu.close()


if __name__ == "__main__":
    main()
