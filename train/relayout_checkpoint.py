"""Re-write a checkpoint of this project in the published GLM-5.3-Flash layout (no PyTorch).

Same weights, new names and config: the nested config.json (``text_config``), the
``model.language_model.`` prefix, the KPool parameters under their published names
(``index_kpool_compress_gate`` / ``index_kpool_compress_ape``), and nothing the layout does not
describe (the ``mlp.shared_expert_gate`` of checkpoints written before the gate was found not to
exist in the published model is dropped, not folded: the drafts of such a checkpoint change).
The target's tensors go to shard 1, the MTP block's to shard 2, as ``train/train.py`` writes
them, so a drafter-only copy is shard 2 plus the shard holding the embedding and head.

    python train/relayout_checkpoint.py SRC DST
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from model.checkpoint import Checkpoint  # noqa: E402 (after the path set-up above)
from model.checkpoint.naming import NameLayout, logical_name  # noqa: E402
from model.checkpoint.safetensors_io import pending  # noqa: E402
from model.checkpoint.writer import write_checkpoint  # noqa: E402
from model.weights_layout import mtp_layout, mtp_prefix, target_layout  # noqa: E402

# Names this project used before it followed the published checkpoint.
LEGACY_NAMES = {
    "self_attn.indexer.compress_gate.weight": "self_attn.indexer.index_kpool_compress_gate",
    "self_attn.indexer.compress_ape": "self_attn.indexer.index_kpool_compress_ape",
}


def modern(logical: str) -> str:
    for old, new in LEGACY_NAMES.items():
        if logical.endswith("." + old):
            return logical[: -len(old)] + new
    return logical


def relayout(src: Path, dst: Path, *, overwrite: bool = False) -> list[str]:
    """Write ``src`` to ``dst`` in the published layout; returns the stored names dropped."""
    ckpt = Checkpoint(src)
    cfg = ckpt.config
    wanted = {**target_layout(cfg), **mtp_layout(cfg)}
    tensors, dropped = {}, []
    for stored in ckpt.names():
        name = modern(logical_name(stored, ckpt.layout) or stored)
        if name not in wanted:
            dropped.append(stored)
            continue
        tensors[name] = ckpt.get(stored)
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise SystemExit(f"{src} lacks {len(missing)} tensors of its config, e.g. {missing[0]}")
    mtp = mtp_prefix(cfg)
    ordered = [pending(n, a) for n, a in tensors.items() if not n.startswith(mtp)] + [
        pending(n, a) for n, a in tensors.items() if n.startswith(mtp)
    ]
    target_bytes = sum(t.nbytes for t in ordered if not t.name.startswith(mtp))
    extra = {k: v for k, v in ckpt.hf_config.items() if k == "quantization_config"}
    write_checkpoint(
        dst,
        cfg,
        ordered,
        max_shard_bytes=target_bytes,
        extra_config=extra,
        overwrite=overwrite,
        layout=NameLayout.PUBLISHED,
    )
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard_of = {n: f for n, f in index["weight_map"].items()}
    assert len(set(shard_of.values())) == 2, "expected the target and the MTP block in two shards"
    return dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    dropped = relayout(args.src, args.dst, overwrite=args.overwrite)
    print(
        f"wrote {args.dst} in the published layout; dropped {len(dropped)} tensors"
        + (f": {', '.join(dropped)}" if dropped else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
