"""Acceptance per draft position on held-out text, with the protocol ``train/eval_acceptance.py``
uses in PyTorch float32 (see ``model.corpus``): for a sample (file, t), the target reads
``bytes[0..t]`` and commits its greedy token g_1; the drafter holds rows ``(tokens[r+1], h_r)`` for
r < t and proposes k drafts from ``(g_1, h_t)``; draft i is accepted when it equals the target's
greedy continuation g_{i+1} and every draft before it was accepted.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .corpus import SAMPLE_COUNT, SAMPLE_MAX_T, heldout_files, sample_positions
from .proposer import MtpProposer
from .sampling import SamplingParams
from .target import TargetModel


def evaluate_acceptance(
    target: TargetModel,
    drafter: MtpProposer,
    checkpoint: Path,
    *,
    k: int,
    samples: int = SAMPLE_COUNT,
    max_t: int = SAMPLE_MAX_T,
    quiet: bool = False,
    records: list | None = None,
) -> dict:
    """``records``, when given, receives one dict per sample (file, t, target continuation,
    drafts, accepted) for comparison with another implementation's records."""
    files = dict(heldout_files())
    plan = sample_positions(files.items(), max_t=max_t, n_samples=samples)
    by_file: dict[str, list[int]] = {}
    for rel, t in plan:
        by_file.setdefault(rel, []).append(t)
    reached = np.zeros(k, np.int64)
    accepted = np.zeros(k, np.int64)
    total_acc = 0
    bar = tqdm(total=len(plan), desc="eval", unit="sample", disable=quiet)
    for rel, ts in by_file.items():
        toks = list(files[rel])
        tst = target.alloc_state()
        dst = drafter.alloc_state()
        try:
            for t in ts:
                # Real text up to row t, then its greedy token.
                logits = target.forward(tst, toks[tst.length : t + 1], tst.length)
                g1 = int(np.argmax(logits[-1]))
                # The greedy continuation g_2..g_{k+1} from rows t+1.., then back to the text.
                cont = [g1]
                for _ in range(k):
                    lg = target.forward(tst, [cont[-1]], tst.length)
                    cont.append(int(np.argmax(lg[-1])))
                target.rewind_to(tst, t + 1)
                # Drafter rows 0..t-1 from the real text; then k drafts from (g_1, h_t).
                drafter.rewind_to(dst, min(dst.rows, t))
                if dst.rows < t:
                    base = dst.rows
                    drafter.catchup_drafter(dst, toks[base : t + 1], target.hidden_rows(tst, base), base)
                drafts = drafter.propose(dst, g1, target.hidden_rows(tst, t), t, k)
                a = 0
                while a < k and drafts[a] == cont[a + 1]:
                    a += 1
                reached[: min(a + 1, k)] += 1
                accepted[:a] += 1
                total_acc += a
                drafter.after_verify(dst, a)
                if records is not None:
                    records.append({"file": rel, "t": t, "g": cont, "drafts": drafts, "accepted": a})
                bar.update(1)
        finally:
            drafter.free_state(dst)
            target.free_state(tst)
    bar.close()
    # None (JSON null, not NaN) for a position no sample reached.
    acc = [round(float(a / r), 4) if r else None for a, r in zip(accepted, reached)]
    return {
        "checkpoint": str(checkpoint),
        "k": k,
        "samples": len(plan),
        "files": len(by_file),
        "reached": reached.tolist(),
        "accepted": accepted.tolist(),
        "acceptance": acc,
        "mean_accepted_drafts": round(total_acc / max(len(plan), 1), 4),
    }


def decode_acceptance(
    target: TargetModel,
    drafter: MtpProposer,
    *,
    k: int,
    prompts: int,
    prompt_len: int,
    new_tokens: int,
    refeed: bool,
    sampling: SamplingParams | None = None,
    quiet: bool = False,
) -> dict:
    """Acceptance inside the speculative decoding loop, on prompts cut from the held-out files
    (the first ``prompt_len`` bytes of each, in sorted order). Unlike the protocol above, later
    steps run on rows the loop built, so this is where re-feeding accepted draft rows with the
    target's own hidden rows (``refeed``) can matter. ``sampling`` (None: greedy) is passed to
    ``speculative_decode``: sampled drafts verified by rejection sampling; prompt i decodes with
    seed ``sampling.seed + i`` (mod 2**64): the prompts share their positions, and one seed
    would give them all the same random numbers."""
    from .speculative import SpecStats, speculative_decode

    total = SpecStats(k)
    files = [(rel, data) for rel, data in heldout_files() if len(data) > prompt_len][:prompts]
    for i, (_rel, data) in enumerate(tqdm(files, desc=f"decode refeed={refeed}", disable=quiet)):
        sp = None if sampling is None else replace(sampling, seed=(int(sampling.seed) + i) % 2**64)
        _, s = speculative_decode(
            target,
            drafter,
            list(data[:prompt_len]),
            new_tokens,
            k,
            sampling=sp,
            refeed_target_hidden=refeed,
        )
        total.steps += s.steps
        total.accepted_total += s.accepted_total
        total.reached = [a + b for a, b in zip(total.reached, s.reached)]
        total.accepted_at = [a + b for a, b in zip(total.accepted_at, s.accepted_at)]
    out = total.summary()
    out.update(prompts=len(files), prompt_len=prompt_len, new_tokens=new_tokens, refeed=refeed)
    if sampling is not None and not sampling.greedy:
        out["sampling"] = asdict(sampling)
    for key in ("drafter_ms_per_step", "target_ms_per_step"):
        out.pop(key)
    return out
