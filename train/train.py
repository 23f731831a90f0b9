"""Train the tiny byte-level model of this family on the Python standard library's sources.

    python3 train/train.py --out model/checkpoints/glm-tiny-stdlib --time-budget 285

What it does (all choices in one place, recorded in the TRAINING.md it writes):

* data: ``model.corpus.load_corpus()`` (every stdlib ``.py`` file as bytes, ~2 % of files held out by
  a hash of the relative path). Training windows of ``--seq`` bytes are drawn from the
  concatenation of the training files; a quarter of them start at a file start (the evaluation
  contexts do).
* loss: target next-byte CE + ``--mtp-lambda`` * MTP CE (drafter row r = (embed(x[r+1]), h[r])
  predicts x[r+2]; ``h`` is the target's post-``model.norm`` hidden, NOT detached: the MTP loss
  also trains the target) + ``--unroll-lambda`` * the CE of drafts 2 .. ``--unroll`` trained the
  way they are served, unrolled: draft j consumes x[r+j] and draft j-1's own normalised output,
  and attends draft 1's selection plus the rows drafted since (``train.torch_model.mtp_losses``)
  + ``--kl-weight`` * indexer KL. The indexers read detached inputs and
  learn only from a KL loss toward the detached dense attention mass per complete pool (summed
  over heads), DeepSeek-V3.2 lightning-indexer style; selection is a non-differentiable mask.
  For the first ``--dense-frac`` of the time budget attention is dense (the indexer warm-up);
  afterwards every layer attends only to its selected rows.
* MoE routing bias: aux-loss-free balancing (bias += ``--bias-rate`` * sign(mean load - load)
  after every step); the bias is saved (float32).
* bf16 autocast, AdamW, warm-up then cosine decay over the wall-clock budget; no torch.compile
  (the step is small and mask/top-k heavy; compile time would eat a large share of the budget).
* output: config.json, the weights in BF16 as two safetensors shards (target / MTP block) +
  ``model.safetensors.index.json``, in the published GLM-5.3-Flash layout (``--layout published``,
  the default: nested config, ``model.language_model.`` names; docs/checkpoint.md) or the flat one,
  and TRAINING.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model.corpus import HELDOUT_MODULUS, load_corpus, stdlib_root  # noqa: E402
from train.torch_model import (  # noqa: E402
    RunOpts,
    TorchModel,
    import_config_module,
    init_weights,
    mtp_losses,
    save_checkpoint,
    training_losses,
    update_routing_bias,
)

DATE = time.strftime("%Y-%m-%d")


def stdlib_tiny_config(max_context: int = 2048):
    """The shipped tiny config: byte vocabulary, 4 target layers (the first dense) + MTP block."""
    mc = import_config_module()
    return mc.ModelConfig(
        hidden_size=256,
        vocab_size=256,
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=max_context,
        attention=mc.AttentionConfig(
            num_attention_heads=4,
            q_lora_rank=192,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=0,
            v_head_dim=64,
        ),
        dsa=mc.DsaConfig(
            index_n_heads=4,
            index_head_dim=32,
            index_topk=64,
            index_kpool=4,
            always_select_tail=True,
            max_context=max_context,
        ),
        moe=mc.MoeConfig(
            n_routed_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            swiglu_limit=10.0,
        ),
        first_k_dense_replace=1,
        intermediate_size=768,
    )


class Windows:
    """Random training windows over the concatenated training files (on the device)."""

    def __init__(self, files, device, seed: int) -> None:
        blob = b"".join(d for _, d in files)
        self.data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        starts, off = [], 0
        for _, d in files:
            starts.append(off)
            off += len(d)
        self.starts = torch.tensor(starts, dtype=torch.long)
        self.n = len(blob)
        self.g = torch.Generator(device="cpu").manual_seed(seed)
        self.device = device

    def batch(self, B: int, T: int) -> torch.Tensor:
        hi = self.n - T - 1
        rnd = torch.randint(0, hi, (B,), generator=self.g)
        at_start = torch.rand(B, generator=self.g) < 0.25
        fs = self.starts[torch.randint(0, len(self.starts), (B,), generator=self.g)]
        start = torch.where(at_start, fs.clamp(max=hi), rnd).to(self.device)
        idx = start[:, None] + torch.arange(T, device=self.device)[None, :]
        return self.data[idx].long()


def param_groups(model, wd: float):
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def heldout_eval(model, files, device, T: int, n_windows: int, amp: bool, fp8: bool, unroll: int = 1) -> dict:
    """Held-out losses (sparse attention) on windows from the start of each held-out file; with
    ``unroll`` > 1 also the CE of the MTP's own drafts 2 .. unroll (``mtp_ce_2`` ...)."""
    model.eval()
    seqs = []
    for _, d in files:
        for off in range(0, len(d) - T, T):
            seqs.append(list(d[off : off + T]))
            if len(seqs) >= n_windows:
                break
        if len(seqs) >= n_windows:
            break
    tot = {
        "target_ce": 0.0,
        "mtp_ce": 0.0,
        "indexer_kl": 0.0,
        **{f"mtp_ce_{j}": 0.0 for j in range(2, unroll + 1)},
    }
    acc_t = acc_m = 0.0
    nb = 0
    for i in range(0, len(seqs), 16):
        x = torch.tensor(seqs[i : i + 16], dtype=torch.long, device=device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            out = model.target(x, opts=RunOpts(sparse=True, kl=True, fp8=fp8))
            ces, mo = mtp_losses(model, x, out.hidden, RunOpts(sparse=True, kl=True, fp8=fp8), unroll)
        for j, ce in enumerate(ces[1:], start=2):
            tot[f"mtp_ce_{j}"] += float(ce)
        V = model.cfg.vocab_size
        tot["target_ce"] += float(
            torch.nn.functional.cross_entropy(out.logits[:, :-1].float().reshape(-1, V), x[:, 1:].reshape(-1))
        )
        tot["mtp_ce"] += float(
            torch.nn.functional.cross_entropy(mo.logits[:, :-1].float().reshape(-1, V), x[:, 2:].reshape(-1))
        )
        tot["indexer_kl"] += float(torch.stack(out.kl + mo.kl).mean())
        acc_t += float((out.logits[:, :-1].argmax(-1) == x[:, 1:]).float().mean())
        acc_m += float((mo.logits[:, :-1].argmax(-1) == x[:, 2:]).float().mean())
        nb += 1
    model.train()
    res = {k: v / max(nb, 1) for k, v in tot.items()}
    res["target_top1"] = acc_t / max(nb, 1)
    res["mtp_top1"] = acc_m / max(nb, 1)
    res["windows"] = len(seqs)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "model/checkpoints/glm-tiny-stdlib"))
    ap.add_argument("--time-budget", type=float, default=285.0, help="seconds of optimisation")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--mtp-lambda", type=float, default=0.5)
    ap.add_argument(
        "--unroll",
        type=int,
        default=3,
        help="drafts per base row trained as served (1: the MTP sees only the "
        "target's hidden, as the first shipped checkpoint was trained)",
    )
    ap.add_argument(
        "--unroll-lambda",
        type=float,
        default=0.25,
        help="weight of each unrolled draft's CE (drafts 2 .. --unroll)",
    )
    ap.add_argument(
        "--layout",
        choices=("published", "flat"),
        default="published",
        help="checkpoint layout written (docs/checkpoint.md)",
    )
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--dense-frac", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--heldout-windows", type=int, default=64)
    ap.add_argument(
        "--tiny-test",
        action="store_true",
        help="a minute-long CPU smoke run (small batch/seq); still writes everything",
    )
    args = ap.parse_args(argv)
    if args.tiny_test:
        args.batch, args.seq, args.heldout_windows = 4, 128, 8
        args.warmup_steps = min(args.warmup_steps, 5)

    t_start = time.time()
    device = torch.device(args.device)
    amp = device.type == "cuda"
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    train_files, held_files = load_corpus()
    n_train_bytes = sum(len(d) for _, d in train_files)
    n_held_bytes = sum(len(d) for _, d in held_files)
    print(
        f"stdlib {stdlib_root()} (Python {platform.python_version()}): "
        f"{len(train_files)} train files {n_train_bytes} bytes, "
        f"{len(held_files)} held-out files {n_held_bytes} bytes",
        flush=True,
    )
    windows = Windows(train_files, device, args.seed)
    t_data = time.time() - t_start

    cfg = stdlib_tiny_config()
    model = TorchModel(cfg)
    init_weights(model, seed=args.seed)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    ckpt_bytes = sum(
        t.numel() * (4 if n.endswith("e_score_correction_bias") else 2) for n, t in model.state_dict().items()
    )
    print(
        f"params {n_params} ({ckpt_bytes / 1e6:.2f} MB in BF16); config {json.dumps(cfg.to_hf_dict())}",
        flush=True,
    )
    if ckpt_bytes > 20e6:
        raise SystemExit("checkpoint would exceed 20 MB")

    opt = torch.optim.AdamW(
        param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
    )
    budget = args.time_budget
    history = []
    step = 0
    t0 = time.time()
    tokens_seen = 0
    last_log_t, last_log_tok = t0, 0
    phase_switch_step = None
    while step < args.max_steps:
        el = time.time() - t0
        if el >= budget:
            break
        frac = el / budget
        sparse = frac >= args.dense_frac
        if sparse and phase_switch_step is None:
            phase_switch_step = step
        lr_scale = min(1.0, (step + 1) / args.warmup_steps) * (
            args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac))
        )
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        x = windows.batch(args.batch, args.seq)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            losses = training_losses(model, x, RunOpts(sparse=sparse, kl=True, fp8=False), unroll=args.unroll)
        loss = (
            losses["target_ce"]
            + args.mtp_lambda * losses["mtp_ce"]
            + args.kl_weight * losses["indexer_kl"]
            + args.unroll_lambda * sum(v for k, v in losses.items() if k.startswith("mtp_ce_"))
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_routing_bias(model, args.bias_rate)
        step += 1
        tokens_seen += x.numel()
        if step % args.log_every == 0 or step == 1:
            now = time.time()
            rec = {
                "step": step,
                "elapsed_s": round(now - t0, 1),
                "lr": args.lr * lr_scale,
                "sparse": sparse,
                **{k: round(float(v.detach()), 4) for k, v in losses.items()},
                "grad_norm": round(float(gnorm), 3),
                "tok_per_s": round((tokens_seen - last_log_tok) / max(now - last_log_t, 1e-9)),
                "max_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)
                if device.type == "cuda"
                else None,
            }
            last_log_t, last_log_tok = now, tokens_seen
            history.append(rec)
            print(json.dumps(rec), flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t0
    print(f"trained {step} steps in {train_s:.1f} s ({tokens_seen} tokens)", flush=True)

    bias_spread = [
        [
            round(float(m.gate.e_score_correction_bias.min()), 4),
            round(float(m.gate.e_score_correction_bias.max()), 4),
        ]
        for m in model.moe_layers()
    ]
    held = heldout_eval(
        model, held_files, device, args.seq, args.heldout_windows, amp, fp8=False, unroll=args.unroll
    )
    held_fp8 = heldout_eval(
        model, held_files, device, args.seq, args.heldout_windows, amp, fp8=True, unroll=args.unroll
    )
    print("held-out", json.dumps(held), "fp8", json.dumps(held_fp8), flush=True)

    out = Path(args.out)
    written = save_checkpoint(model, out, published=args.layout == "published")
    sizes = {f: (out / f).stat().st_size for f in written}
    total_mb = sum(sizes.values()) / 1e6
    print(f"checkpoint {out}: {sizes} ({total_mb:.2f} MB)", flush=True)

    machine = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    final = history[-1] if history else {}
    md = [
        "# glm-tiny-stdlib: training note",
        "",
        "A tiny byte-level model of the GLM-5 MoE + DSA family (target + MTP block), trained by",
        "`train/train.py` so that the runtime has real weights to draft with. Not a useful language",
        "model; its point is a drafter whose acceptance is measurably above chance.",
        "",
        f"- date: {DATE}",
        f"- command: `python3 train/train.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"- machine: {machine}; torch {torch.__version__}; Python {platform.python_version()}",
        f"- wall time: {time.time() - t_start:.0f} s in all (data {t_data:.1f} s, "
        f"optimisation {train_s:.1f} s)",
        f"- steps: {step} (dense attention until step {phase_switch_step}, sparse after), "
        f"batch {args.batch} x {args.seq} bytes, {tokens_seen / 1e6:.1f} M tokens",
        f"- parameters: {n_params} ({total_mb:.2f} MB of BF16 safetensors; correction biases F32)",
        f"- final training losses (step {final.get('step')}): target CE {final.get('target_ce')}, "
        f"MTP CE {final.get('mtp_ce')}, indexer KL {final.get('indexer_kl')} (nats/byte)",
        f"- held-out (first {held['windows']} windows of {args.seq} bytes, sparse, bf16, "
        f"FP8 cache off): target CE {held['target_ce']:.4f} "
        f"({held['target_ce'] / math.log(2):.3f} bits/byte), MTP CE {held['mtp_ce']:.4f}, "
        f"indexer KL {held['indexer_kl']:.4f}, target top-1 {held['target_top1']:.4f}, "
        f"MTP top-1 (x[r+2]) {held['mtp_top1']:.4f}",
        f"- held-out with the FP8 cache emulated: target CE {held_fp8['target_ce']:.4f}, "
        f"MTP CE {held_fp8['mtp_ce']:.4f}, MTP top-1 {held_fp8['mtp_top1']:.4f}",
        "- held-out CE of the MTP's own drafts 2 .. k (unrolled, FP8 cache off / on): "
        + (
            ", ".join(
                f"draft {j} {held[f'mtp_ce_{j}']:.4f} / {held_fp8[f'mtp_ce_{j}']:.4f}"
                for j in range(2, args.unroll + 1)
            )
            or "not trained (--unroll 1)"
        ),
        f"- layout: {args.layout} (docs/checkpoint.md)",
        f"- routing correction bias range per MoE layer: {bias_spread}",
        "",
        "## Hyperparameters",
        "",
        f"- optimiser AdamW lr {args.lr} (betas 0.9/0.95, wd {args.wd} on matrices), warm-up "
        f"{args.warmup_steps} steps, cosine to {args.min_lr_frac} x lr over the {budget:.0f} s "
        "budget, grad clip 1.0, bf16 autocast, float32 master weights, no torch.compile",
        f"- loss = target CE + {args.mtp_lambda} x MTP CE + {args.unroll_lambda} x (CE of drafts 2 .. "
        f"{args.unroll}, unrolled) + {args.kl_weight} x indexer KL; the MTP block reads the target's "
        "post-norm hidden NOT detached (its loss trains the target too); unrolled draft j consumes "
        "x[r+j] and draft j-1's own normalised output and attends draft 1's selection plus the "
        "rows drafted since (train/torch_model.py, mtp_losses)",
        "- indexer: inputs detached, KL(dense attention mass per complete pool, summed over heads, "
        "detached || softmax of pool scores) over rows with >= 2 complete pools; dense attention "
        f"for the first {args.dense_frac:.0%} of the budget, then sparse (selection is a mask, "
        "not differentiated)",
        f"- MoE: aux-loss-free bias update, rate {args.bias_rate} per step; routing in float32",
        "- init: normal(0, 0.02), output projections / sqrt(2 x 5 layers); norms 1; ape, k_norm "
        "bias and correction bias 0",
        f"- seed {args.seed}",
        "",
        "## Config",
        "",
        "```json",
        json.dumps(cfg.to_hf_dict(nested=args.layout == "published"), indent=1),
        "```",
        "",
        "## Data",
        "",
        f"The `.py` files of the standard library at `{stdlib_root()}` (Python "
        f"{platform.python_version()}), bytes as tokens, skipping site-packages and __pycache__. "
        f"{len(train_files)} training files ({n_train_bytes} bytes). A file is held out when "
        f"`int(sha256(relpath).hexdigest(), 16) % {HELDOUT_MODULUS} == 0` (`model/corpus.py`); the "
        f"{len(held_files)} held-out files ({n_held_bytes} bytes) on the training machine:",
        "",
        *[f"- `{r}`" for r, _ in held_files],
        "",
        "## Log (every %d steps)" % args.log_every,
        "",
        "```",
        *[json.dumps(h) for h in history],
        "```",
        "",
    ]
    (out / "TRAINING.md").write_text("\n".join(md))
    print(
        json.dumps(
            {
                "train_summary": {
                    "steps": step,
                    "train_s": round(train_s, 1),
                    "final": final,
                    "heldout": held,
                    "heldout_fp8": held_fp8,
                    "checkpoint_mb": round(total_mb, 3),
                }
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
