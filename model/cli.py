"""``mtpdraft``: the command line.

- ``generate``: prompt in, text out, with acceptance statistics (host backend by default).
- ``eval``: acceptance per draft position on held-out text.
- ``bench``: the GPU benchmark of the drafter (needs a CUDA GPU).

User errors (a bad prompt, backend or checkpoint) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("mtpdraft")

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "glm-tiny-stdlib"
DEFAULT_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


class UserError(Exception):
    """A mistake in what the user asked for: reported in one line, no traceback."""


def make_backend(name: str):
    if name == "host":
        from runtime.host_backend import HostBackend

        return HostBackend()
    if name == "cuda":
        from runtime.cuda_backend import CudaBackend

        try:
            return CudaBackend()
        except Exception as e:  # no driver, no device: a user-facing condition
            raise UserError(f"the cuda backend is not usable here: {e}") from e
    raise UserError(f"unknown backend {name!r} (choose host or cuda)")


def open_checkpoint(path: Path):
    from model.checkpoint import Checkpoint, CheckpointError

    if not path.is_dir():
        raise UserError(f"checkpoint directory {path} does not exist")
    try:
        ckpt = Checkpoint(path)
        _ = ckpt.config
        return ckpt
    except (CheckpointError, ValueError) as e:
        raise UserError(f"{path} is not a usable checkpoint: {e}") from e


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def build(args, *, served: int):
    from model.checkpoint import mtp_tensors, target_tensors
    from model.proposer import MtpProposer, ProposerError, ProposerOptions
    from model.target import TargetModel
    from model.weights import WeightError

    gpu = make_backend(args.backend)
    ckpt = open_checkpoint(Path(args.checkpoint))
    cfg = ckpt.config
    try:  # a corrupt tensor (a NaN weight, say) or options the model cannot serve: one line
        target = TargetModel(gpu, cfg, target_tensors(ckpt, cfg), served)
        drafter = MtpProposer(
            gpu, cfg, mtp_tensors(ckpt, cfg),
            ProposerOptions(served_max_seq_len=served, max_draft_tokens=max(args.k, 1),
                            max_sequences=1, use_graphs=args.backend == "cuda" and args.graphs),
            tables=target.tables,
        )
    except (WeightError, ProposerError) as e:
        raise UserError(f"{args.checkpoint}: {e}") from e
    return gpu, cfg, target, drafter


def cmd_generate(args) -> int:
    from model.speculative import greedy_decode, speculative_decode

    if not args.prompt:
        raise UserError("the prompt is empty")
    prompt = encode(args.prompt)
    if len(prompt) < 2:
        raise UserError("the prompt must be at least 2 bytes long")
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if not 1 <= args.k <= 8:
        raise UserError("-k must be between 1 and 8")
    served = len(prompt) + args.max_new_tokens + args.k + 2
    gpu, cfg, target, drafter = build(args, served=args.max_context)
    if served > target.rows_cap:
        raise UserError(
            f"prompt ({len(prompt)} tokens) plus {args.max_new_tokens} new tokens exceeds the "
            f"served context of {target.rows_cap} tokens (--max-context, capped by the model)"
        )
    with tqdm(total=args.max_new_tokens, desc="generate", unit="tok", disable=args.quiet) as bar:
        out, stats = speculative_decode(target, drafter, prompt, args.max_new_tokens, args.k,
                                        refeed_target_hidden=args.refeed_target_hidden,
                                        progress=bar)
    print(args.prompt + decode(out))
    summary = stats.summary()
    if args.check_lossless:
        ref = greedy_decode(target, prompt, args.max_new_tokens)
        summary["lossless"] = ref == out
        if ref != out:
            log.error("speculative output differs from the target's greedy output")
    print(json.dumps(summary), file=sys.stderr)
    drafter.close()
    target.close()
    return 0 if summary.get("lossless", True) else 1


def cmd_eval(args) -> int:
    from model.evaluation import evaluate_acceptance

    if args.decode:
        from model.evaluation import decode_acceptance

        gpu, cfg, target, drafter = build(args, served=args.prompt_len + args.new_tokens + args.k + 2)
        for refeed in (False, True):
            print(json.dumps(decode_acceptance(target, drafter, k=args.k, prompts=args.samples,
                                               prompt_len=args.prompt_len,
                                               new_tokens=args.new_tokens, refeed=refeed,
                                               quiet=args.quiet)))
        drafter.close()
        target.close()
        return 0
    if args.max_t < 16 or args.samples < 1:
        raise UserError("--max-t must be >= 16 and --samples >= 1")
    gpu, cfg, target, drafter = build(args, served=args.max_t + args.k + 2)
    records: list | None = [] if args.records else None
    res = evaluate_acceptance(target, drafter, Path(args.checkpoint), k=args.k,
                              samples=args.samples, max_t=args.max_t, quiet=args.quiet,
                              records=records)
    if args.records:
        Path(args.records).write_text(json.dumps(records))
    print(json.dumps(res))
    drafter.close()
    target.close()
    return 0


def cmd_bench(args) -> int:
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    try:
        from bench import bench_propose
    except ImportError as e:
        raise UserError(f"the benchmark script is not available in this install: {e}") from e
    return bench_propose.main(args.bench_args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtpdraft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                        help="checkpoint directory (config.json + safetensors); default: the "
                             "shipped tiny model trained on Python's standard library")
        sp.add_argument("--backend", default="host", choices=["host", "cuda"],
                        help="host: NumPy, runs anywhere (default); cuda: the GPU")
        sp.add_argument("-k", type=int, default=3, help="drafts proposed per step (default 3)")
        sp.add_argument("--max-context", type=int, default=1024,
                        help="served context in tokens; the drafter's reach is this, capped by "
                             "its DSA reservation (default 1024)")
        sp.add_argument("--refeed-target-hidden", action="store_true",
                        help="re-feed accepted draft rows with the target's own hidden rows")
        sp.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on cuda, replay propose as one CUDA graph per k (default on)")
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    common(g)
    g.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt text (bytes are tokens)")
    g.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default 48)")
    g.add_argument("--check-lossless", action="store_true",
                   help="also decode with the target alone and check the outputs are identical")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="acceptance per draft position on held-out text")
    common(e)
    e.add_argument("--samples", type=int, default=512,
                   help="positions sampled, in the protocol's order (default 512)")
    e.add_argument("--max-t", type=int, default=1000,
                   help="last position a sample may sit at; the served context follows "
                        "(default 1000, as train/eval_acceptance.py)")
    e.add_argument("--records", metavar="FILE", help="write every sample's record as JSON")
    e.add_argument("--decode", action="store_true",
                   help="instead: acceptance inside speculative decoding on held-out prompts "
                        "(--samples prompts), with and without --refeed-target-hidden")
    e.add_argument("--prompt-len", type=int, default=64, help="with --decode: prompt bytes")
    e.add_argument("--new-tokens", type=int, default=128, help="with --decode: tokens generated")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="GPU benchmark of propose (see bench/bench_propose.py --help)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UserError as e:
        print(f"mtpdraft: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
