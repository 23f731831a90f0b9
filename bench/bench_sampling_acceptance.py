"""Acceptance of sampled requests on held-out text (issue 19): sampled drafts with their
probabilities against greedy drafts treated as certain, both verified by rejection sampling.

    python3 bench/bench_sampling_acceptance.py [--samples 128] [--temperatures 0.6,1.0] [-k 3]
        [--backend host|cuda] [--json PATH]

On the samples (file, t) of the acceptance protocol (``model.corpus.sample_positions``, as
``mtpdraft eval``), at each temperature T, with seed ``--seed + sample index``:

- the target reads bytes[0..t] and draws its own next token x at position t + 1 (``draw`` at
  (seed, t + 1, 0, Stream.TARGET), as ``sample_decode`` would); the drafter holds the rows of the
  real text and proposes k drafts from (x, h_t) at position t;
- (a) ``sampled``: the drafter's sampled drafts d_i with q_i(d_i) and the full q_i
  (``propose(..., sampling=, draft_dist=)``);
- (b) ``greedy``: the drafter's greedy drafts with the draft treated as certain, q_i = one-hot(d_i):
  d_i is accepted with probability p_i(d_i), a rejection resamples from p_i without d_i;
- the target scores [x, d_1..d_k]; ``model.speculative.verify_sampled`` decides, exactly as in
  ``speculative_decode``.

Per draft position i: ``reached`` (drafts 1..i-1 accepted), ``accepted``, the realised acceptance
accepted / reached, and the expected acceptance, the mean over reached samples of
min(1, p_i(d_i) / q_i(d_i)) (the same quantity without the accept draw's noise). Both arms share x,
the target's rows and the drafter's context: a paired comparison. Host backend by default (CPU:
about a second per sample at k = 3 and two temperatures, plus the text's rows); ``--backend cuda``
for the device.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: find model/ and runtime/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from tqdm import tqdm

from model.corpus import SAMPLE_MAX_T, heldout_files, sample_positions
from model.kernels.keyed_rng import Stream
from model.proposer import MtpProposer
from model.sampling import SamplingParams, draw, probabilities
from model.speculative import verify_sampled

ARMS = ("sampled", "greedy")


class Tally:
    """Per draft position: reached, accepted, and the sum of the acceptance probabilities."""

    def __init__(self, k: int) -> None:
        self.reached = np.zeros(k, np.int64)
        self.accepted = np.zeros(k, np.int64)
        self.prob = np.zeros(k, np.float64)
        self.samples = 0

    def add(self, accepted: int, probs: list[float]) -> None:
        n = len(probs)  # positions reached: min(accepted + 1, k)
        self.samples += 1
        self.reached[:n] += 1
        self.accepted[:accepted] += 1
        self.prob[:n] += probs

    def summary(self) -> dict:
        def per(a: np.ndarray) -> list[float | None]:
            return [round(float(x / r), 4) if r else None for x, r in zip(a, self.reached)]

        return {
            "samples": self.samples,
            "reached": self.reached.tolist(),
            "accepted": self.accepted.tolist(),
            "acceptance": per(self.accepted),
            "expected_acceptance": per(self.prob),
            "mean_accepted_drafts": round(float(self.accepted.sum() / max(self.samples, 1)), 4),
        }


def sampled_propose_available(drafter) -> bool:
    return "sampling" in inspect.signature(drafter.propose).parameters


def measure(
    target,
    drafter: MtpProposer,
    *,
    k: int,
    temperatures: list[float],
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    samples: int = 128,
    max_t: int = SAMPLE_MAX_T,
    arms: tuple[str, ...] = ARMS,
    quiet: bool = False,
) -> dict:
    gpu, V = target.gpu, target.cfg.vocab_size
    files = dict(heldout_files())
    plan = sample_positions(files.items(), max_t=max_t, n_samples=samples)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for idx, (rel, t) in enumerate(plan):
        by_file.setdefault(rel, []).append((idx, t))
    params = {T: SamplingParams(temperature=T, top_p=top_p, top_k=top_k) for T in temperatures}
    for sp in params.values():
        sp.check(V)
    tally = {(T, arm): Tally(k) for T in temperatures for arm in arms}
    one_hot = np.eye(V, dtype=np.float32)
    q = np.empty((k, V), np.float32)
    dist = gpu.alloc(k * V * 4)
    bar = tqdm(total=len(plan), desc="sampling acceptance", unit="sample", disable=quiet)
    t_start = time.perf_counter()
    try:
        for rel, ts in by_file.items():
            toks = list(files[rel])
            tst = target.alloc_state()
            dst = drafter.alloc_state()
            try:
                for idx, t in ts:
                    row_t = target.forward(tst, toks[tst.length : t + 1], tst.length)[-1]
                    drafter.rewind_to(dst, min(drafter.drafter_rows(dst), t))
                    if drafter.drafter_rows(dst) < t:
                        base = drafter.drafter_rows(dst)
                        drafter.catchup_drafter(dst, toks[base : t + 1], target.hidden_rows(tst, base), base)
                    for T, base_sp in params.items():
                        sp = SamplingParams(base_sp.temperature, top_p, top_k, (seed + idx) % 2**64)
                        x = draw(row_t, sp, t + 1, 0, Stream.TARGET)
                        for arm in arms:
                            drafter.rewind_to(dst, t)
                            hid = target.hidden_rows(tst, t)
                            if arm == "sampled":
                                got = drafter.propose(dst, x, hid, t, k, sampling=sp, draft_dist=dist)
                                drafts, qd = [int(d) for d in got.tokens], [float(p) for p in got.probs]
                                gpu.copy_d2h(q, dist)
                                qs = q
                            else:
                                drafts = [int(d) for d in drafter.propose(dst, x, hid, t, k)]
                                qd, qs = [1.0] * k, one_hot[drafts]
                            logits = target.forward(tst, [x] + drafts, t + 1)
                            target.rewind_to(tst, t + 1)
                            a, _ = verify_sampled(logits, drafts, qd, qs, sp, t + 2)
                            reached = min(a + 1, k)
                            probs = [
                                min(1.0, float(probabilities(logits[i], sp)[drafts[i]]) / qd[i])
                                for i in range(reached)
                            ]
                            tally[(T, arm)].add(a, probs)
                            drafter.after_verify(dst, a)
                    bar.update(1)
            finally:
                drafter.free_state(dst)
                target.free_state(tst)
    finally:
        gpu.free(dist)
        bar.close()
    return {
        "k": k,
        "samples": len(plan),
        "files": len(by_file),
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "seconds": round(time.perf_counter() - t_start, 1),
        "results": [
            {"temperature": T, "arm": arm, **tally[(T, arm)].summary()} for T in temperatures for arm in arms
        ],
    }


def table(res: dict) -> str:
    k = res["k"]
    head = ["T", "drafts"] + [f"acc {i + 1} (expected)" for i in range(k)] + ["mean accepted"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["results"]:
        cells = [
            f"{a:.3f} ({e:.3f})" if a is not None else "-"
            for a, e in zip(r["acceptance"], r["expected_acceptance"])
        ]
        what = "sampled, with q" if r["arm"] == "sampled" else "greedy, q = one-hot"
        lines.append(
            f"| {r['temperature']} | {what} | " + " | ".join(cells) + f" | {r['mean_accepted_drafts']} |"
        )
    note = (
        f"\n{res['samples']} protocol samples from {res['files']} held-out files, k = {k}, "
        f"top-p {res['top_p']}, top-k {res['top_k']}, seed {res['seed']}; acceptance = accepted / "
        "reached per draft position (expected: mean of min(1, p/q) over the reached samples)."
    )
    return "\n".join(lines) + "\n" + note


def _error(prog: str, msg: str) -> int:
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from model.cli import DEFAULT_CHECKPOINT, UserError, build, open_checkpoint

    prog = prog or "bench_sampling_acceptance"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="default: the shipped checkpoint")
    ap.add_argument("--backend", default="host", choices=["host", "cuda"])
    ap.add_argument(
        "--graphs", action=argparse.BooleanOptionalAction, default=True, help="cuda: graph replay"
    )
    ap.add_argument("-k", type=int, default=3, help="drafts per sample (default 3)")
    ap.add_argument("--temperatures", default="0.6,1.0", help="comma-separated (default 0.6,1.0)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="sample i uses seed + i")
    ap.add_argument("--samples", type=int, default=128, help="protocol samples (default 128)")
    ap.add_argument("--max-t", type=int, default=SAMPLE_MAX_T, help="last position a sample may sit at")
    ap.add_argument("--arms", default=",".join(ARMS), help="sampled,greedy (default both)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        temps = [float(x) for x in args.temperatures.split(",")]
    except ValueError:
        return _error(prog, f"--temperatures {args.temperatures!r}: comma-separated numbers")
    arms = tuple(a for a in args.arms.split(",") if a)
    if not arms or set(arms) - set(ARMS):
        return _error(prog, f"--arms {args.arms!r}: choose from {', '.join(ARMS)}")
    if not 1 <= args.k <= 8 or args.samples < 1 or args.max_t < 16:
        return _error(prog, "-k must be 1..8, --samples at least 1, --max-t at least 16")
    for T in temps:
        try:
            SamplingParams(T, args.top_p, 0, args.seed).check(2**62, "sampling")
        except ValueError as e:
            return _error(prog, str(e))
        if T == 0:
            return _error(prog, "--temperatures: 0 is greedy (mtpdraft eval measures it)")
    if "sampled" in arms and not sampled_propose_available(MtpProposer):
        return _error(
            prog,
            "the sampled arm needs MtpProposer.propose(..., sampling=, draft_dist=), which this "
            "drafter does not take yet (--arms greedy runs the other arm)",
        )
    try:
        ckpt = open_checkpoint(Path(args.checkpoint))
        if ckpt.config.vocab_size < 256:
            return _error(prog, "the held-out text is fed as bytes 0..255: the vocabulary is smaller")
        if args.top_k > ckpt.config.vocab_size or args.top_k < 0:
            return _error(prog, f"--top-k {args.top_k} outside 0..{ckpt.config.vocab_size}")
        served = args.max_t + args.k + 2
        target, drafter = build(args, ckpt, served=served)
    except UserError as e:
        return _error(prog, str(e))
    try:
        res = measure(
            target,
            drafter,
            k=args.k,
            temperatures=temps,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            samples=args.samples,
            max_t=args.max_t,
            arms=arms,
            quiet=args.quiet,
        )
    finally:
        drafter.close()
        target.close()
    res.update(checkpoint=str(args.checkpoint), backend=args.backend)
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
