"""The MTP draft step written plainly in PyTorch, timed eager and as a replayed CUDA graph.

    python3 bench/torch_step.py                  # GLM-5.3-Flash shapes, contexts 4096 and 16000, k 1 and 3
    python3 -c "from bench.torch_step import run; print(run(4096, 3, graph=True))"

A baseline for the runtime (about 5.6 ms eager / 3.2 ms graph at context 4096, k = 3, on an H200:
BENCHMARKS.md). BF16 random weights at ``model.config.glm5_flash()`` shapes; ``context`` rows already sit in
the caches (random latents, indexer keys and gates, BF16 pool keys); each draft writes row
``context + i`` and runs:

1. ``x = eh_proj [rmsnorm(embed[t]) * enorm ; rmsnorm(h) * hnorm]``
2. ``y = rmsnorm(x)``; query latent ``rmsnorm(q_a y)``, ``q = q_b .``; latent ``c = rmsnorm(kv_a y)``
   written to row n; indexer key ``LayerNorm(wk y)`` and gate written, the pool compressed when row n
   completes one; pool scores ``sum_h w_h relu(q_h . key_p) / sqrt(idim)``, ``topk`` of
   ``index_topk / kpool`` pools expanded to rows, plus the tail (dense with few pools);
3. absorbed MLA over the gathered latent rows (query through ``kv_b``'s key half, output through its
   value half), ``o_proj``;
4. MoE: sigmoid router, top-8 of score + bias, normalised weights x scaling; the chosen experts'
   weights are gathered (``index_select`` on the stacked [E, I, H] tensors, which keeps the step
   capturable: no host sync) and applied as batched GEMVs; the shared expert with weight 1 (ungated);
   with ``index_share_for_mtp_iteration`` (GLM-5.3-Flash) drafts 2..k skip the indexer and attend
   draft 1's selection plus the rows drafted since, as the runtime does;
5. ``lm_head`` GEMV on ``rmsnorm(x) * shared_head.norm`` and ``argmax``, which feeds draft i+1 on
   the device (embedding row and the normalised ``x`` as the next hidden).

Graph replays are timed with CUDA events around each replay (median of many); eager runs with a
synchronize around each k-draft propose (median). One graph per (context, k): row indices are
baked into the captured kernels, as a fixed-shape capture would do.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a script (python bench/torch_step.py): find model/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402 - after the sys.path insert
import torch.nn.functional as F  # noqa: E402 - after the sys.path insert

from model.config import glm5_flash  # noqa: E402 - after the sys.path insert


def _up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = _up(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * _up(w)).to(x.dtype)


class DraftStep:
    """Weights and caches of one MTP block, and its k-draft propose."""

    def __init__(
        self, cfg, rows: int, device="cuda", dtype=torch.bfloat16, seed: int = 0, weights: dict | None = None
    ) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        H, V = cfg.hidden_size, cfg.vocab_size
        self.rows = rows
        g = torch.Generator(device=self.device).manual_seed(seed)
        dev = self.device

        def lin(o, i):
            w = torch.empty(o, i, device=dev, dtype=dtype)
            w.normal_(0.0, 1.0 / math.sqrt(i), generator=g)
            return w

        def norm(n):
            return torch.ones(n, device=dev, dtype=dtype)

        E, I, nh = m.n_routed_experts, m.moe_intermediate_size, a.num_attention_heads
        if weights is None:
            W = {
                "embed": torch.randn(V, H, device=dev, dtype=dtype, generator=g),
                "head": lin(V, H),
                "enorm": norm(H),
                "hnorm": norm(H),
                "in_norm": norm(H),
                "post_norm": norm(H),
                "head_norm": norm(H),
                "eh_proj": lin(H, 2 * H),
                "q_a": lin(a.q_lora_rank, H),
                "q_a_norm": norm(a.q_lora_rank),
                "q_b": lin(nh * a.qk_head_dim, a.q_lora_rank),
                "kv_a": lin(a.kv_lora_rank, H),
                "kv_a_norm": norm(a.kv_lora_rank),
                "kv_b": lin(nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
                "o_proj": lin(H, nh * a.v_head_dim),
                "ix_wq_b": lin(d.index_n_heads * d.index_head_dim, a.q_lora_rank),
                "ix_wk": lin(d.index_head_dim, H),
                "ix_ln_w": norm(d.index_head_dim),
                "ix_ln_b": torch.zeros(d.index_head_dim, device=dev, dtype=dtype),
                "ix_weights": lin(d.index_n_heads, H),
                "ix_gate": lin(d.index_head_dim, H),
                "ix_ape": torch.zeros(d.index_kpool, d.index_head_dim, device=dev, dtype=dtype),
                "router": lin(E, H),
                "router_bias": torch.zeros(E, device=dev, dtype=torch.float32),
                "shared_gate_proj": lin(I, H),
                "shared_up_proj": lin(I, H),
                "shared_down_proj": lin(H, I),
            }
            # Stacked routed experts [E, I, H] / [E, H, I], drawn expert by expert (no 2x peak).
            for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                t = torch.empty(E, *shape, device=dev, dtype=dtype)
                for e in range(E):
                    t[e].normal_(0.0, 1.0 / math.sqrt(shape[1]), generator=g)
                W["experts_" + name] = t
        else:
            W = weights
        self.W = W
        kvb = W["kv_b"].view(nh, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        self.w_uk = kvb[:, : a.qk_nope_head_dim, :]  # [nh, nope, kl]
        self.w_uv_t = kvb[:, a.qk_nope_head_dim :, :].transpose(1, 2)  # [nh, kl, v]
        # Caches of the DSA state: latents, indexer keys and gates per row, pool keys per pool.
        self.latents = torch.randn(rows, a.kv_lora_rank, device=dev, dtype=dtype, generator=g)
        self.keys = torch.randn(rows, d.index_head_dim, device=dev, dtype=dtype, generator=g)
        self.gates = torch.randn(rows, d.index_head_dim, device=dev, dtype=dtype, generator=g)
        self.pool_keys = torch.randn(
            rows // d.index_kpool, d.index_head_dim, device=dev, dtype=dtype, generator=g
        )
        # Static inputs / outputs (what a graph reads and writes).
        self.tok_in = torch.zeros(1, dtype=torch.long, device=dev)
        self.hid_in = torch.randn(H, device=dev, dtype=dtype, generator=g)
        self.drafts = torch.zeros(8, dtype=torch.long, device=dev)
        self.last_hidden = torch.zeros(H, device=dev, dtype=dtype)
        # The propose's first row and the rows it selected (drafts after it reuse them when the
        # config shares the selection, index_share_for_mtp_iteration).
        self._first_row = rows
        self._first_rows = torch.zeros(0, dtype=torch.long, device=dev)

    # ---- one draft -----------------------------------------------------------------------------

    def _draft(self, tok: torch.Tensor, h: torch.Tensor, n: int):
        """Row n from (token [1] on device, hidden [H]); returns (next token [1], normalised x)."""
        cfg, W = self.cfg, self.W
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        eps = cfg.rms_norm_eps
        nh, kp = a.num_attention_heads, d.index_kpool
        e = _rms(F.embedding(tok, W["embed"])[0], W["enorm"], eps)
        x = F.linear(torch.cat([e, _rms(h, W["hnorm"], eps)]), W["eh_proj"])
        y = _rms(x, W["in_norm"], eps)
        qa = _rms(F.linear(y, W["q_a"]), W["q_a_norm"], eps)
        q = F.linear(qa, W["q_b"]).view(nh, a.qk_head_dim)
        self.latents[n] = _rms(F.linear(y, W["kv_a"]), W["kv_a_norm"], eps)
        # Indexer: this row's key and gate, then the pool it completes.
        self.keys[n] = F.layer_norm(
            _up(F.linear(y, W["ix_wk"])), (d.index_head_dim,), _up(W["ix_ln_w"]), _up(W["ix_ln_b"]), 1e-6
        ).to(self.dtype)
        self.gates[n] = F.linear(y, W["ix_gate"])
        ncomp = (n + 1) // kp
        if (n + 1) % kp == 0:
            s = slice(n + 1 - kp, n + 1)
            wts = torch.softmax(_up(self.gates[s]) + _up(W["ix_ape"]), dim=0)
            self.pool_keys[ncomp - 1] = (wts * _up(self.keys[s])).sum(0).to(self.dtype)
        K = d.index_topk // kp
        if d.share_for_mtp_iteration and n > self._first_row:
            # Drafts 2..k reuse draft 1's selection, plus the rows drafted since (model/dsa.py).
            rows = torch.cat([self._first_rows, torch.arange(self._first_row + 1, n + 1, device=self.device)])
            c = self.latents.index_select(0, rows)
        elif ncomp > K:
            qi = F.linear(qa, W["ix_wq_b"]).view(d.index_n_heads, d.index_head_dim)
            wh = _up(F.linear(y, W["ix_weights"])) / math.sqrt(d.index_n_heads)
            sc = torch.relu(_up(qi @ self.pool_keys[:ncomp].T))  # [ih, P]
            scores = (wh @ sc) / math.sqrt(d.index_head_dim)
            top = torch.sort(scores, descending=True, stable=True).indices[:K]  # ties: lower pool
            rows = (top[:, None] * kp + torch.arange(kp, device=self.device)).reshape(-1)
            if ncomp * kp <= n:
                rows = torch.cat([rows, torch.arange(ncomp * kp, n + 1, device=self.device)])
            c = self.latents.index_select(0, rows)
            self._first_rows = rows
        else:
            c = self.latents[: n + 1]
            self._first_rows = torch.arange(n + 1, device=self.device)
        # Absorbed MLA.
        q_lat = torch.bmm(q[:, None, : a.qk_nope_head_dim], self.w_uk)[:, 0]  # [nh, kl]
        p = torch.softmax(_up(q_lat @ c.T) * a.softmax_scale, dim=-1).to(self.dtype)
        o_lat = p @ c  # [nh, kl]
        o = torch.bmm(o_lat[:, None], self.w_uv_t)[:, 0]  # [nh, v]
        x = x + F.linear(o.reshape(-1), W["o_proj"])
        # MoE.
        y2 = _rms(x, W["post_norm"], eps)
        sc = torch.sigmoid(F.linear(_up(y2), _up(W["router"])))
        idx = torch.sort(sc + W["router_bias"], descending=True, stable=True).indices[
            : m.num_experts_per_tok
        ]  # ties: lower expert
        w = sc[idx]
        if m.norm_topk_prob:
            w = w / w.sum()
        w = w * m.routed_scaling_factor
        L = m.swiglu_limit
        wg = W["experts_gate_proj"].index_select(0, idx)  # [k, I, H]
        wu = W["experts_up_proj"].index_select(0, idx)
        wd = W["experts_down_proj"].index_select(0, idx)  # [k, H, I]
        yb = y2[None, :, None].expand(idx.numel(), -1, 1)
        act = F.silu(torch.bmm(wg, yb).clamp(max=L)) * torch.bmm(wu, yb).clamp(-L, L)
        routed = (_up(torch.bmm(wd, act)[..., 0]) * w[:, None].to(_up(act).dtype)).sum(0)
        sh = F.linear(
            F.silu(F.linear(y2, W["shared_gate_proj"]).clamp(max=L))
            * F.linear(y2, W["shared_up_proj"]).clamp(-L, L),
            W["shared_down_proj"],
        )
        x = x + (routed + _up(sh)).to(self.dtype)
        out = _rms(x, W["head_norm"], eps)
        logits = F.linear(out, W["head"])
        return torch.argmax(logits).reshape(1), out, logits

    def propose(self, context: int, k: int) -> torch.Tensor:
        """k drafts from (tok_in, hid_in), rows context .. context+k-1; drafts land in self.drafts."""
        tok, h = self.tok_in, self.hid_in
        self._first_row = context
        for i in range(k):
            tok, h, _ = self._draft(tok, h, context + i)
            self.drafts[i : i + 1].copy_(tok)
        self.last_hidden.copy_(h)
        return self.drafts[:k]


def weights_from_state_dict(cfg, sd: dict, device="cpu", dtype=torch.float32) -> dict:
    """The step's weight dict from checkpoint names (``TorchModel.state_dict()`` or a checkpoint),
    for checking the step against the reference implementation."""
    P = f"model.layers.{cfg.num_hidden_layers}."
    A, X, M = P + "self_attn.", P + "self_attn.indexer.", P + "mlp."
    kl = cfg.attention.kv_lora_rank

    def t(name):
        return sd[name].to(device=device, dtype=dtype)

    W = {
        "embed": t("model.embed_tokens.weight"),
        "head": t("lm_head.weight"),
        "enorm": t(P + "enorm.weight"),
        "hnorm": t(P + "hnorm.weight"),
        "in_norm": t(P + "input_layernorm.weight"),
        "post_norm": t(P + "post_attention_layernorm.weight"),
        "head_norm": t(P + "shared_head.norm.weight"),
        "eh_proj": t(P + "eh_proj.weight"),
        "q_a": t(A + "q_a_proj.weight"),
        "q_a_norm": t(A + "q_a_layernorm.weight"),
        "q_b": t(A + "q_b_proj.weight"),
        "kv_a": t(A + "kv_a_proj_with_mqa.weight")[:kl],
        "kv_a_norm": t(A + "kv_a_layernorm.weight"),
        "kv_b": t(A + "kv_b_proj.weight"),
        "o_proj": t(A + "o_proj.weight"),
        "ix_wq_b": t(X + "wq_b.weight"),
        "ix_wk": t(X + "wk.weight"),
        "ix_ln_w": t(X + "k_norm.weight"),
        "ix_ln_b": t(X + "k_norm.bias"),
        "ix_weights": t(X + "weights_proj.weight"),
        "ix_gate": t(X + "index_kpool_compress_gate"),
        "ix_ape": t(X + "index_kpool_compress_ape"),
        "router": t(M + "gate.weight"),
        "router_bias": sd[M + "gate.e_score_correction_bias"].to(device=device, dtype=torch.float32),
        "shared_gate_proj": t(M + "shared_experts.gate_proj.weight"),
        "shared_up_proj": t(M + "shared_experts.up_proj.weight"),
        "shared_down_proj": t(M + "shared_experts.down_proj.weight"),
    }
    for name in ("gate_proj", "up_proj", "down_proj"):
        W["experts_" + name] = torch.stack(
            [t(M + f"experts.{e}.{name}.weight") for e in range(cfg.moe.n_routed_experts)]
        )
    return W


# ---- timing --------------------------------------------------------------------------------------

_STEP: DraftStep | None = None


def _step(rows_needed: int) -> DraftStep:
    global _STEP
    if _STEP is None or _STEP.rows < rows_needed:
        _STEP = None
        torch.cuda.empty_cache()
        cfg = glm5_flash()
        _STEP = DraftStep(cfg, rows=max(rows_needed, 16384 + 16), device="cuda")
    return _STEP


@torch.inference_mode()
def run(context: int, k: int, graph: bool, iters: int = 200, warmup: int = 10) -> float:
    """Median milliseconds of one k-draft propose at ``context`` cached rows (GLM-5.3-Flash shapes,
    BF16, random weights), eager (``graph=False``) or replayed as a torch CUDA graph."""
    st = _step(context + k + 1)
    if not graph:
        for _ in range(warmup):
            st.propose(context, k)
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            st.propose(context, k)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            st.propose(context, k)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        st.propose(context, k)
    for _ in range(warmup):
        gr.replay()
    torch.cuda.synchronize()
    times = []
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        gr.replay()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in ev]
    # The graph must give the eager drafts.
    g_drafts = st.drafts[:k].clone()
    st.propose(context, k)
    if not torch.equal(g_drafts, st.drafts[:k]):
        print(f"warning: graph drafts {g_drafts.tolist()} != eager {st.drafts[:k].tolist()}", file=sys.stderr)
    del gr
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16000])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: bench/torch_step.py times a GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    _step(max(args.contexts) + max(args.ks) + 1)
    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__}:"
        f" weights and caches built in {time.time() - t0:.1f} s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated",
        flush=True,
    )
    rows = []
    print(f"{'context':>8} {'k':>3} {'eager ms':>9} {'graph ms':>9} {'graph ms/draft':>15}")
    for c in args.contexts:
        for k in args.ks:
            e = run(c, k, graph=False, iters=max(args.iters // 4, 20))
            try:
                g = run(c, k, graph=True, iters=args.iters)
            except Exception as exc:  # keep the eager numbers if capture fails
                print(f"graph capture failed at context {c}, k {k}: {exc!r}", file=sys.stderr)
                g = float("nan")
            rows.append({"context": c, "k": k, "eager_ms": round(e, 4), "graph_ms": round(g, 4)})
            print(f"{c:>8} {k:>3} {e:>9.3f} {g:>9.3f} {g / k:>15.3f}", flush=True)
    print(
        "TORCH_STEP_JSON "
        + json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
