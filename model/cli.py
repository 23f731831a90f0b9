"""``mtpdraft``: the command line.

- ``generate``: prompt in, text out, with acceptance statistics (host backend by default).
- ``eval``: acceptance per draft position on held-out text.
- ``bench``: the GPU benchmark of the drafter (needs a CUDA GPU; ``mtpdraft bench --help``).
- ``inspect``: whether a drafter can be built from a checkpoint (``model/inspect_checkpoint.py``).

User errors (a bad prompt, option, backend or checkpoint) print one line and exit with status 2;
``-v`` also prints the traceback behind one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import traceback
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("mtpdraft")

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "glm-tiny-stdlib"
DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
MAX_K = 8
BYTE_VOCAB = 256  # prompts and held-out text are fed as bytes: token = byte value


class UserError(Exception):
    """A mistake in what the user asked for: reported in one line, no traceback."""


def one_line(e: BaseException) -> str:
    """An error's text on one line (checkpoint errors list one problem per line)."""
    head, *rest = str(e).splitlines() or [type(e).__name__]
    return " ".join([head, "; ".join(r.strip() for r in rest)]).strip()


# ---- checks that need no model ----------------------------------------------------------------


def check_k(k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise UserError(f"-k must be between 1 and {MAX_K}, got {k}")


SAMPLING_FLAGS = (
    ("temperature", "--temperature"),
    ("top_p", "--top-p"),
    ("top_k", "--top-k"),
    ("seed", "--seed"),
)


def sampling_params(args, vocab: int | None):
    """The request's SamplingParams from the flags, each checked by SamplingParams.check and
    refused naming its flag; ``vocab`` None: before the checkpoint is read (top-k's upper bound
    is checked once it is)."""
    from model.sampling import SamplingParams

    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    for name, flag in SAMPLING_FLAGS:
        try:
            SamplingParams(**{name: getattr(sp, name)}).check(2**62 if vocab is None else vocab, flag)
        except ValueError as e:
            raise UserError(str(e)) from e
    return sp


def sampling_given(args) -> list[str]:
    """The sampling flags set away from their defaults (greedy)."""
    return [flag for name, flag in SAMPLING_FLAGS if getattr(args, name) != DEFAULT_SAMPLING[name]]


DEFAULT_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}


def encode(text: str) -> list[int]:
    """The prompt's UTF-8 bytes. argv that is not UTF-8 arrives as lone surrogates
    (surrogateescape): refused by name rather than guessed at."""
    try:
        return list(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"code point U+{c:04X}"
        raise UserError(f"the prompt is not valid UTF-8 ({what} at character {e.start})") from e


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")


def check_writable(path: Path, option: str) -> None:
    """Fail now, not after the work, if ``path`` cannot be written; leaves no file behind."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as e:
        raise UserError(f"{option} {path}: cannot write there ({e.strerror or e})") from e
    if not existed:
        path.unlink()


# ---- backend and checkpoint -------------------------------------------------------------------


def make_backend(name: str):
    if name == "host":
        from runtime.host_backend import HostBackend

        return HostBackend()
    if name == "cuda":
        from runtime.cuda_backend import CudaBackend

        try:
            return CudaBackend()
        except Exception as e:  # no driver, no device: a user-facing condition
            raise UserError(f"the cuda backend is not usable here: {one_line(e)}") from e
    raise UserError(f"unknown backend {name!r} (choose host or cuda)")


def open_checkpoint(path: Path):
    """The checkpoint with its config parsed; tensors are checked when loaded (``build``)."""
    from model.checkpoint import Checkpoint, CheckpointError
    from model.config import ConfigError

    if not path.exists():
        raise UserError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise UserError(
            f"--checkpoint {path} is a file; give the checkpoint's directory (config.json + safetensors)"
        )
    try:
        ckpt = Checkpoint(path)
        _ = ckpt.config
        return ckpt
    except CheckpointError as e:  # its text names the checkpoint or the file
        raise UserError(one_line(e)) from e
    except (ConfigError, OSError) as e:
        raise UserError(f"{path} is not a usable checkpoint: {one_line(e)}") from e


def build(args, ckpt, *, served: int):
    """Backend, target and drafter for a checkpoint already opened; a tensor the config
    describes but the checkpoint lacks (or holds at another dtype or shape) is a UserError."""
    from model.checkpoint import CheckpointError, mtp_tensors, target_tensors
    from model.config import ConfigError
    from model.proposer import MtpProposer, ProposerError, ProposerOptions
    from model.target import TargetError, TargetModel
    from model.tensors import WeightError

    gpu = make_backend(args.backend)
    cfg = ckpt.config
    try:
        target = TargetModel(gpu, cfg, target_tensors(ckpt, cfg), served)
        drafter = MtpProposer(
            gpu,
            cfg,
            mtp_tensors(ckpt, cfg),
            ProposerOptions(
                served_max_seq_len=served,
                max_draft_tokens=args.k,
                max_sequences=1,
                use_graphs=args.backend == "cuda" and args.graphs,
            ),
            tables=target.tables,
        )
    except CheckpointError as e:  # its text names the checkpoint
        raise UserError(one_line(e)) from e
    # A corrupt tensor (a NaN weight, say) or options the model cannot serve.
    except (WeightError, ConfigError, ProposerError, TargetError, OSError) as e:
        raise UserError(f"{ckpt.path}: {one_line(e)}") from e
    return target, drafter


def context_rows(cfg, served: int) -> int:
    """Rows the target and drafter will hold for ``served`` (capped by the model's DSA reach)."""
    from model.dsa import drafter_context_rows

    return drafter_context_rows(served, cfg.dsa)


def run_model(fn, *a, **kw):
    """Run decoding or evaluation; a bad-input error from the model (a checkpoint whose weights
    produce non-finite values, say) is reported as one line."""
    from model.proposer import ProposerError
    from model.target import TargetError

    try:
        return fn(*a, **kw)
    except (ProposerError, TargetError) as e:
        raise UserError(f"decoding failed: {one_line(e)}") from e


def print_json(obj: dict, file=None) -> None:
    # allow_nan=False: the stats must parse under strict JSON (a never-reached position is null).
    print(json.dumps(obj, allow_nan=False), file=file)


# ---- commands ---------------------------------------------------------------------------------


def cmd_generate(args) -> int:
    from model.speculative import greedy_decode, speculative_decode

    if not args.prompt:
        raise UserError("the prompt is empty")
    prompt = encode(args.prompt)
    if len(prompt) < 2:
        raise UserError("the prompt must be at least 2 bytes long")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_k(args.k)
    if args.max_context < 1:
        raise UserError(f"--max-context must be at least 1, got {args.max_context}")
    sampling = sampling_params(args, None)
    if args.check_lossless and not sampling.greedy:
        raise UserError(
            "--check-lossless compares with the target's greedy decode: it needs --temperature 0 "
            "(a sampled decode keeps the target's distribution, not its tokens)"
        )
    ckpt = open_checkpoint(Path(args.checkpoint))
    served = len(prompt) + args.max_new_tokens + args.k + 2
    cap = context_rows(ckpt.config, args.max_context)
    if served > cap:
        raise UserError(
            f"prompt ({len(prompt)} tokens) plus {args.max_new_tokens} new tokens exceeds the "
            f"served context of {cap} tokens (--max-context, capped by the model)"
        )
    vocab = ckpt.config.vocab_size
    sampling = sampling_params(args, vocab)
    if max(prompt) >= vocab:
        at = next(i for i, b in enumerate(prompt) if b >= vocab)
        raise UserError(
            f"the prompt's byte 0x{prompt[at]:02x} (offset {at}) is outside the "
            f"checkpoint's vocabulary 0..{vocab - 1} (tokens are bytes)"
        )
    target, drafter = build(args, ckpt, served=args.max_context)
    try:
        with tqdm(total=args.max_new_tokens, desc="generate", unit="tok", disable=args.quiet) as bar:
            out, stats = run_model(
                speculative_decode,
                target,
                drafter,
                prompt,
                args.max_new_tokens,
                args.k,
                sampling=sampling,
                refeed_target_hidden=args.refeed_target_hidden,
                progress=bar,
            )
        print(args.prompt + decode(out))
        summary = stats.summary()
        if not sampling.greedy:
            summary["sampling"] = dataclasses.asdict(sampling)
        if args.check_lossless:
            ref = run_model(greedy_decode, target, prompt, args.max_new_tokens)
            summary["lossless"] = ref == out
            if ref != out:
                log.error("speculative output differs from the target's greedy output")
        print_json(summary, file=sys.stderr)
    finally:
        drafter.close()
        target.close()
    return 0 if summary.get("lossless", True) else 1


def cmd_eval(args) -> int:
    from model.evaluation import decode_acceptance, evaluate_acceptance

    check_k(args.k)
    if args.samples < 1:
        raise UserError(f"--samples must be at least 1, got {args.samples}")
    sampling = sampling_params(args, None)
    if not args.decode and sampling_given(args):
        raise UserError(
            f"{', '.join(sampling_given(args))}: sampling applies to --decode (the protocol "
            "compares greedy drafts with the target's greedy continuation)"
        )
    if args.decode:
        if args.records:
            raise UserError("--records writes the protocol's samples; it does not apply to --decode")
        if args.prompt_len < 2:
            raise UserError(
                f"--prompt-len must be at least 2 (decoding starts from a target "
                f"row and its token), got {args.prompt_len}"
            )
        if args.new_tokens < 1:
            raise UserError(f"--new-tokens must be at least 1, got {args.new_tokens}")
        served = args.prompt_len + args.new_tokens + args.k + 2
        what = "--prompt-len plus --new-tokens"
    else:
        if args.max_t < 16:
            raise UserError(f"--max-t must be at least 16, got {args.max_t}")
        if args.records:
            check_writable(Path(args.records), "--records")
        served = args.max_t + args.k + 2
        what = "--max-t"
    ckpt = open_checkpoint(Path(args.checkpoint))
    sampling = sampling_params(args, ckpt.config.vocab_size)
    cap = context_rows(ckpt.config, served)
    if served > cap:
        raise UserError(
            f"{what} ({served - args.k - 2}) plus k + 2 exceeds the model's context of {cap} tokens"
        )
    if ckpt.config.vocab_size < BYTE_VOCAB:
        raise UserError(
            f"eval feeds held-out text as bytes 0..255; the checkpoint's vocabulary "
            f"is 0..{ckpt.config.vocab_size - 1}"
        )
    target, drafter = build(args, ckpt, served=served)
    try:
        if args.decode:
            for refeed in (False, True):
                res = run_model(
                    decode_acceptance,
                    target,
                    drafter,
                    k=args.k,
                    prompts=args.samples,
                    prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens,
                    refeed=refeed,
                    sampling=sampling,
                    quiet=args.quiet,
                )
                if res["prompts"] == 0:
                    raise UserError(f"no held-out file is longer than --prompt-len {args.prompt_len} bytes")
                print_json(res)
            return 0
        records: list | None = [] if args.records else None
        res = run_model(
            evaluate_acceptance,
            target,
            drafter,
            Path(args.checkpoint),
            k=args.k,
            samples=args.samples,
            max_t=args.max_t,
            quiet=args.quiet,
            records=records,
        )
        if args.records:
            try:
                Path(args.records).write_text(json.dumps(records, allow_nan=False))
            except OSError as e:
                raise UserError(f"--records {args.records}: {e.strerror or e}") from e
        print_json(res)
        return 0
    finally:
        drafter.close()
        target.close()


def cmd_bench(args, bench_args: list[str]) -> int:
    """Every argument after ``bench`` goes to the benchmark's own parser, ``--help`` included."""
    try:
        from bench import bench_propose
    except ImportError as e:
        raise UserError(f"the benchmark is not available in this install: {e}") from e
    return bench_propose.main(bench_args, prog="mtpdraft bench")


# ---- parser -----------------------------------------------------------------------------------


def cmd_inspect(args) -> int:
    from model.inspect_checkpoint import run

    return run(args.path, sys.stdout, sys.stderr)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtpdraft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log progress at INFO level; print the traceback behind an error",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        # Also after the subcommand; SUPPRESS keeps a -v given before it.
        sp.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="as mtpdraft -v"
        )
        sp.add_argument(
            "--checkpoint",
            default=str(DEFAULT_CHECKPOINT),
            help="checkpoint directory (config.json + safetensors); default: the "
            "shipped tiny model trained on Python's standard library",
        )
        sp.add_argument(
            "--backend",
            default="host",
            choices=["host", "cuda"],
            help="host: NumPy, runs anywhere (default); cuda: the GPU",
        )
        sp.add_argument("-k", type=int, default=3, help=f"drafts proposed per step, 1..{MAX_K} (default 3)")
        sp.add_argument(
            "--graphs",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="on cuda, replay propose as one CUDA graph per k (default on)",
        )
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    def sampling_flags(sp, what: str):
        d = DEFAULT_SAMPLING
        sp.add_argument(
            "--temperature",
            type=float,
            default=d["temperature"],
            help=f"sample {what} at this temperature; 0 (default) is greedy and lossless token for "
            "token, above 0 the drafts are sampled and verified by rejection sampling, which keeps "
            "the target's distribution exactly",
        )
        sp.add_argument(
            "--top-p",
            type=float,
            default=d["top_p"],
            help="keep the smallest top set of this mass, (0, 1] (default 1: all)",
        )
        sp.add_argument(
            "--top-k", type=int, default=d["top_k"], help="keep the k most likely tokens (default 0: all)"
        )
        sp.add_argument(
            "--seed",
            type=int,
            default=d["seed"],
            help="the sampling seed, 0 .. 2**64 - 1: a run is reproducible from it (default 0)",
        )

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    common(g)
    g.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help="the prompt text, UTF-8 (its bytes are the tokens)"
    )
    g.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default 48)")
    g.add_argument(
        "--max-context",
        type=int,
        default=1024,
        help="served context in tokens; the drafter's reach is this, capped by "
        "its DSA reservation (default 1024)",
    )
    g.add_argument(
        "--refeed-target-hidden",
        action="store_true",
        help="re-feed accepted draft rows with the target's own hidden rows",
    )
    g.add_argument(
        "--check-lossless",
        action="store_true",
        help="also decode with the target alone and check the outputs are identical",
    )
    sampling_flags(g, "the tokens")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="acceptance per draft position on held-out text")
    common(e)
    e.add_argument(
        "--samples", type=int, default=512, help="positions sampled, in the protocol's order (default 512)"
    )
    e.add_argument(
        "--max-t",
        type=int,
        default=1000,
        help="last position a sample may sit at; the served context follows "
        "(default 1000, as train/eval_acceptance.py)",
    )
    e.add_argument("--records", metavar="FILE", help="write every sample's record as JSON")
    e.add_argument(
        "--decode",
        action="store_true",
        help="instead: acceptance inside speculative decoding on held-out prompts "
        "(--samples prompts), with and without --refeed-target-hidden",
    )
    e.add_argument("--prompt-len", type=int, default=64, help="with --decode: prompt bytes")
    e.add_argument("--new-tokens", type=int, default=128, help="with --decode: tokens generated")
    sampling_flags(e, "with --decode: the tokens")
    e.set_defaults(func=cmd_eval)

    i = sub.add_parser(
        "inspect",
        help="whether a drafter can be built from a checkpoint, read "
        "from config.json, the index and the headers only",
    )
    i.add_argument("path", help="checkpoint directory")
    i.set_defaults(func=cmd_inspect)

    # No options of its own (not even -h): main() hands everything after "bench" to the benchmark.
    b = sub.add_parser(
        "bench", add_help=False, help="GPU benchmark of propose (mtpdraft bench --help for its options)"
    )
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, rest = p.parse_known_args(argv)
    if rest and args.func is not cmd_bench:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args, rest) if args.func is cmd_bench else args.func(args)
    except UserError as e:
        if args.verbose and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)
        print(f"mtpdraft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mtpdraft: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
