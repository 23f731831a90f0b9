"""MTP acceptance of a checkpoint on held-out text, PyTorch float32 (the protocol the runtime mirrors).

    python3 train/eval_acceptance.py --ckpt model/checkpoints/glm-tiny-stdlib [--k 3] [--n 512]

Protocol (``model.corpus.sample_positions`` gives the samples; defaults start 16, stride 37,
max_t 1000, the first 512 samples over the held-out files in sorted relpath order):

1. For a sample (file, t) the context is ``bytes[0..t]`` (t inclusive). The target runs over the
   context and gives its post-norm hiddens h_0..h_t and its greedy next token
   ``g_1 = argmax(logits_t)`` (lowest index on a tie).
2. The drafter's context rows 0..t-1 are ``(tokens[r+1], h_r)`` from the real text.
3. The drafter proposes k drafts: draft 1 from ``(g_1, h_t)`` (row t); draft i+1 from
   ``(d_i, the drafter's own normalised output of draft i)`` (row t+i).
4. The target's greedy continuation ``g_2 .. g_{k+1}`` is computed autoregressively by the target
   from context + g_1 (+ g_2 ...).
5. Draft i is accepted when ``d_i == g_{i+1}`` and drafts 1..i-1 were accepted. Reported:
   accepted_i / reached_i per position and the mean number of accepted drafts per sample.

The FP8 storage of latents and pool keys is emulated (``--fp8 all``: target and drafter, the
runtime's semantics; ``mtp``: drafter only; ``none``); ``--fp8-head`` also rounds the drafter's head
rows to FP8. Weights are loaded (BF16) and computed in float32. Since a row depends only on rows
before it, one target pass and one drafter pass over each file's first ``max_t + 1`` bytes give the
real-text states of every sample (a rewind is a slice of that state); the continuation and the
drafts are then incremental steps on those states.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model.corpus import (  # noqa: E402
    SAMPLE_COUNT,
    SAMPLE_MAX_T,
    SAMPLE_START,
    SAMPLE_STRIDE,
    heldout_files,
    sample_positions,
    stdlib_root,
)
from train.torch_model import RunOpts, load_model, slice_state  # noqa: E402


def acceptance_samples(
    root=None,
    *,
    start: int = SAMPLE_START,
    stride: int = SAMPLE_STRIDE,
    max_t: int = SAMPLE_MAX_T,
    n_samples: int | None = SAMPLE_COUNT,
):
    """(relpath, t) samples of the protocol over this machine's held-out stdlib files, plus the
    files themselves: ``(samples, {relpath: bytes})``."""
    files = heldout_files(root)
    return (
        sample_positions(files, start=start, stride=stride, max_t=max_t, n_samples=n_samples),
        dict(files),
    )


@torch.no_grad()
def evaluate(
    model,
    samples,
    files: dict,
    k: int = 3,
    fp8: str = "all",
    fp8_head: bool = False,
    device="cpu",
    progress: bool = True,
) -> dict:
    """Run the protocol; returns counts, rates and per-sample records."""
    if fp8 not in ("all", "mtp", "none"):
        raise ValueError(f"fp8 must be all, mtp or none, not {fp8!r}")
    t_opts = RunOpts(sparse=True, fp8=fp8 == "all", moe_dense=True)
    d_opts = RunOpts(sparse=True, fp8=fp8 in ("all", "mtp"), moe_dense=True)
    by_file: dict[str, list[int]] = {}
    for rel, t in samples:
        by_file.setdefault(rel, []).append(t)

    reached = [0] * k
    accepted = [0] * k
    lengths = []
    records = []
    real_next = 0  # g_1 equals the real next byte
    t0 = time.time()
    for fi, (rel, ts) in enumerate(by_file.items()):
        data = files[rel]
        L = max(ts) + 1
        toks = torch.tensor(list(data[:L]), dtype=torch.long, device=device)[None]
        tgt = model.target(toks, opts=t_opts)  # rows 0..L-1 of the real text
        # Drafter rows r = 0..L-2: (tokens[r+1], h_r).
        drf = model.mtp(toks[:, 1:], tgt.hidden[:, :-1], opts=d_opts) if L > 1 else None
        for t in ts:
            g = [int(tgt.logits[0, t].argmax())]
            if t + 1 < len(data) and g[0] == data[t + 1]:
                real_next += 1
            # Drafts: row t from (g_1, h_t), then the drafter's own outputs.
            dstate = slice_state(drf.state, t) if t > 0 else None
            tok = torch.tensor([[g[0]]], device=device)
            hid = tgt.hidden[:, t : t + 1]
            drafts = []
            for _ in range(k):
                r = model.mtp(tok, hid, dstate, d_opts, fp8_head=fp8_head)
                dstate = r.state
                d = int(r.logits[0, -1].argmax())
                drafts.append(d)
                tok = torch.tensor([[d]], device=device)
                hid = r.hidden[:, -1:]
            # Target continuation, only as far as the drafts keep being accepted.
            tstate = slice_state(tgt.state, t + 1)
            n_acc = 0
            for i in range(k):
                reached[i] += 1
                o = model.target(torch.tensor([[g[-1]]], device=device), tstate, t_opts)
                tstate = o.state
                g.append(int(o.logits[0, -1].argmax()))
                if drafts[i] != g[i + 1]:
                    break
                accepted[i] += 1
                n_acc += 1
            lengths.append(n_acc)
            records.append({"file": rel, "t": t, "g": g, "drafts": drafts, "accepted": n_acc})
        if progress:
            print(
                f"  [{fi + 1}/{len(by_file)}] {rel}: {len(ts)} samples, "
                f"{len(lengths)} done, {time.time() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    n = len(lengths)
    return {
        "k": k,
        "n_samples": n,
        "n_files": len(by_file),
        "fp8": fp8,
        "fp8_head": fp8_head,
        "reached": reached,
        "accepted": accepted,
        "acceptance": [a / r if r else None for a, r in zip(accepted, reached)],
        "mean_accepted_length": sum(lengths) / n if n else None,
        "target_next_byte_top1": real_next / n if n else None,
        "seconds": round(time.time() - t0, 2),
        "records": records,
    }


def format_table(res: dict) -> str:
    lines = [
        f"MTP acceptance: {res['n_samples']} samples over {res['n_files']} held-out files, "
        f"k={res['k']}, fp8={res['fp8']}, fp8_head={res['fp8_head']} (float32)",
        "position  reached  accepted  rate",
    ]
    for i in range(res["k"]):
        rate = res["acceptance"][i]
        lines.append(
            f"{i + 1:>8}  {res['reached'][i]:>7}  {res['accepted'][i]:>8}  "
            f"{'-' if rate is None else f'{rate:.4f}'}"
        )
    lines.append(
        f"mean accepted length: {res['mean_accepted_length']:.4f}   "
        f"(target greedy == real next byte: {res['target_next_byte_top1']:.4f})"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=str(ROOT / "model/checkpoints/glm-tiny-stdlib"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--n", type=int, default=SAMPLE_COUNT, help="number of samples")
    ap.add_argument("--start", type=int, default=SAMPLE_START)
    ap.add_argument("--stride", type=int, default=SAMPLE_STRIDE)
    ap.add_argument("--max-t", type=int, default=SAMPLE_MAX_T)
    ap.add_argument("--fp8", choices=("all", "mtp", "none"), default="all")
    ap.add_argument("--fp8-head", action="store_true")
    ap.add_argument(
        "--stdlib", default=None, help="stdlib directory to read held-out files from (default: this Python's)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--records", default="", help="write per-sample records (JSON) here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = load_model(args.ckpt, dtype=torch.float32, device=device)
    samples, files = acceptance_samples(
        args.stdlib, start=args.start, stride=args.stride, max_t=args.max_t, n_samples=args.n
    )
    res = evaluate(
        model,
        samples,
        files,
        k=args.k,
        fp8=args.fp8,
        fp8_head=args.fp8_head,
        device=device,
        progress=not args.quiet,
    )
    print(format_table(res))
    if args.records:
        Path(args.records).write_text(json.dumps(res["records"]))
    summary = {k: v for k, v in res.items() if k != "records"}
    summary["ckpt"] = str(args.ckpt)
    summary["device"] = str(device)
    summary["stdlib"] = str(args.stdlib or stdlib_root())
    summary["python"] = platform.python_version()
    print("ACCEPTANCE_JSON " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
