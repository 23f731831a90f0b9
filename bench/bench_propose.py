"""GPU benchmark of the MTP proposer at GLM-5.3-Flash shapes, or with ``--model glm5`` /
``deepseek_v32`` at GLM-5.2's / DeepSeek-V3.2's (``mtpdraft bench`` calls ``main``).

    python3 bench/bench_propose.py [--iters N] [--json PATH] [--update-md BENCHMARKS.md] [--model M]
    python3 bench/bench_propose.py --from-json PATH --update-md BENCHMARKS.md   # no GPU: render only

One run measures, on the device it finds:
- the device copy bandwidth (a 2 GiB device-to-device copy, bytes read + written, median);
- the bytes one draft must read, counted from the weight buffers the step touches (eh_proj,
  fused_in, q_fused, wk_t, wv, o_proj, router, the 8 chosen experts' gate_up + down, the shared
  expert, the head in BF16 or FP8 + scales) plus the cache bytes read (selected latent rows and
  scales, and their BF16 rope keys where the MLA has a rope part; the complete pool keys and
  scales, one per token with the per-token indexer; the embedding row); norms and biases are left out
  (under 0.1 MB); the floor is bytes / bandwidth;
- propose(k = 1 and 3) at contexts 4096 and 16000, eager and graph, BF16 and FP8 head: the graph's
  device time (CUDA events around back-to-back replays of the captured k-draft graph, median) and
  the wall time of ``propose()`` (time.perf_counter around the call, median); their difference is
  the host's time per graph-replayed propose, the copy of the drafts back included, device-side
  latencies of the launch and the copies too; "host CPU us" is the proposer's own account of the
  time it spent outside the wait for the device (``ProposerState.last_host_s``); and the same
  graph captured with programmatic dependent launch off (every kernel launched plainly);
- timing arms that skip the block or the head (``Arm.skip_block`` / ``skip_head``), to place a
  gap;
- the same step in plain PyTorch, eager and CUDA graph (bench/torch_step.py ``run``; skipped with a
  note if it cannot be imported).

Weights are random and never written to disk: every tensor is a slice of one 64 MiB pool of random
BF16 (tiled where a tensor is larger), handed to MtpProposer as a Mapping; host memory peaks near
20 GB (the expert stacks the loader builds). Contexts are fed fast: random FP8 latents and scales,
random indexer keys and gates (the KPool indexer's), random BF16 rope keys (an MLA with a rope
part), and random FP8 pool keys and scales are written straight into a fresh state's caches and
its row count is set; what is timed (the draft rows) then runs the real
kernels over them. One proposer (``ArmProposer``, this benchmark's subclass of MtpProposer, built
once: the weights take most of the run's setup) serves every arm: each state is allocated with the
arm it runs (eager or graph, FP8 or BF16 head, block or head skipped), so no graph captured under
one arm replays under another, and nothing of the proposer is replaced between measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (python bench/bench_propose.py): find model/ and runtime/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from model.checkpoint.random_init import tiled_mtp_weights as random_weights
from model.config import ModelConfig, deepseek_v32, glm5, glm5_flash
from model.kernels.dsa_select import complete_pools
from model.proposer import MtpProposer, ProposerState
from runtime.dtypes import BF16
from runtime.kernels.rmsnorm import rmsnorm

CONTEXTS = (4096, 16000)
KS = (1, 3)
SECTION = "## MTP drafter: propose (bench/bench_propose.py)"
# The models a benchmark runs at (``--model``), by model_type: each preset takes the indexer
# reservation (``max_context``) that sizes the served length.
MODELS = {"glm5_next": glm5_flash, "glm5": glm5, "deepseek_v32": deepseek_v32}
DEFAULT_MAX_CONTEXT = 16384  # the presets' own reservation: contexts up to 16000 and the drafts


def model_config(name: str, max_context: int = DEFAULT_MAX_CONTEXT) -> ModelConfig:
    """The preset of ``--model name`` (``MODELS``) with an indexer reservation of ``max_context``
    tokens (at least the presets' 16384, so a short run is sized as it always was)."""
    if name not in MODELS:
        raise ValueError(f"model {name!r}: one of {', '.join(MODELS)}")
    return MODELS[name](max_context=max(int(max_context), DEFAULT_MAX_CONTEXT))


# ---- the proposer under measurement ---------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    """What a state's proposes run. ``skip_block`` / ``skip_head`` are timing arms: the drafts mean
    nothing then, the device time of the part that remains is what they are for."""

    fp8: bool = True  # the head's FP8 copy, else its BF16 rows
    graphs: bool = False  # one captured graph per k, else eager launches
    skip_block: bool = False  # the block replaced by the head's RMSNorm alone
    skip_head: bool = False  # the head replaced by zero drafts


class ArmProposer(MtpProposer):
    """MtpProposer running one arm at a time through the draft step's own hooks (``_launch_step``,
    ``_block``, ``_head``). ``alloc_state(arm)`` sets the arm; a change of arm drops the captured
    graphs (a graph bakes the arm it was captured under), so no graph of one arm replays under
    another. The live states then all run the new arm."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arm = Arm()
        self._ids_log: list[np.ndarray] | None = None

    def routed_ids(self, states: list[ProposerState], last: list[int], hidden: Any, pos: list[int], k: int):
        """The routed expert ids of each draft of one eager ``propose_batch`` ([B, top_k] per
        draft, read after each draft's block; the captured graphs are left as they are): what a
        batch's byte floor counts its distinct experts from."""
        self._ids_log = []
        try:
            self.propose_batch(states, last, hidden, pos, k)
            return list(self._ids_log)
        finally:
            self._ids_log = None

    def _launch_step(self, m: int, k: int, s: int, sampled: bool = False) -> None:
        if self.arm.graphs and self._ids_log is None:
            self._replay_graph(m, k, s, sampled)
        else:
            self._enqueue_drafts(m, k, s, sampled)

    def alloc_state(self, arm: Arm | None = None) -> ProposerState:
        """A state running ``arm`` (the current arm when None)."""
        arm = self.arm if arm is None else arm
        if arm.fp8 and self.head_fp8 is None:
            raise ValueError("an FP8-head arm on a proposer without the FP8 head")
        if arm != self.arm:
            self.gpu.synchronize(self.stream)
            for g in self._graphs.values():
                self.gpu.graph_destroy(g)
            self._graphs.clear()
            self.arm = arm
        return super().alloc_state()

    def graph(self, m: int, k: int) -> Any:
        """The captured graph of bucket ``m`` and ``k`` drafts (after a graph-replayed propose)."""
        return self._graphs[(m, k)]

    def _block(self, m: int, i: int, s: int) -> None:
        if not self.arm.skip_block:
            super()._block(m, i, s)
            if self._ids_log is not None:
                top = self.cfg.moe.num_experts_per_tok
                ids = np.empty((m, top + int(self.cfg.moe.n_shared_experts > 0)), np.uint32)
                self.gpu.synchronize(s)
                self.gpu.copy_d2h(ids, self.scratch.ids)
                self._ids_log.append(ids[:, :top].copy())
            return
        cfg = self.cfg
        rmsnorm(self.gpu, self.step.x, self.head_norm, self.step.xn, m, cfg.hidden_size, cfg.rms_norm_eps, s)

    def _head(self, m: int, i: int, publish: bool, s: int) -> None:
        if self.arm.skip_head:
            self.gpu.memset(self.step.drafts_out.device, 0, m * self.step.kmax * 4, s)
        elif self.arm.fp8:
            super()._head(m, i, publish, s)
        else:
            self._head_with(m, i, publish, s, self.head_bf16, None)


class LaunchRecorder:
    """The backend the benchmark's proposer is built on: the device's own, except that inside
    ``recording()`` every kernel launch is bracketed by a pair of events (``profile_step``)."""

    def __init__(self, gpu: Any) -> None:
        self._gpu = gpu
        self.marks: list[tuple[str, tuple[int, ...], Any, Any]] = []
        self.launch = gpu.launch  # outside a recording: the device's own, no extra call

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._gpu, name)
        if callable(value):
            # Kept, so the next lookup is as cheap as on the backend itself (the benchmark times
            # the host's share of a propose); properties such as ``pdl`` are read through each time.
            self.__dict__[name] = value
        return value

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[str, tuple[int, ...], Any, Any]]]:
        """Record the launches made inside; the caller destroys the marks' events."""
        self.marks = []
        self.launch = self._recorded_launch
        try:
            yield self.marks
        finally:
            self.launch = self._gpu.launch

    def _recorded_launch(
        self, kernel: Any, grid: Any, block: Any, args: Any, smem: int = 0, stream: Any = None
    ) -> None:
        a, b = self._gpu.event_create(), self._gpu.event_create()
        self._gpu.event_record(a, stream)
        self._gpu.launch(kernel, grid, block, args, smem, stream)
        self._gpu.event_record(b, stream)
        self.marks.append((kernel.name, tuple(grid) if not isinstance(grid, int) else (grid,), a, b))


# ---- bytes per draft -------------------------------------------------------------------------------


def _matrix_bytes(rows: int, cols: int, fp8: bool) -> int:
    """A weight's bytes: BF16, or FP8 plus its 128x128 block scales."""
    if not fp8:
        return rows * cols * 2
    return rows * cols + -(-rows // 128) * -(-cols // 128) * 4


def selection_size(cfg: ModelConfig, row: int) -> int:
    """Rows a draft at ``row`` attends when it runs the indexer: every row while there are at
    most top-k complete pools, else the top-k pools' rows; the incomplete tail besides, where
    ``always_select_tail``. The per-token indexer (pools of one row, no tail): min(row + 1,
    index_topk)."""
    d = cfg.dsa
    kp = d.index_kpool
    npools = complete_pools(row, kp)
    tail = row + 1 - npools * kp if d.always_select_tail else 0
    return (npools if npools <= d.topk_pools else d.topk_pools) * kp + tail


def selected_row_bytes(cfg: ModelConfig) -> int:
    """Bytes the attention reads of one selected row: its FP8 latent and f32 scale, and with an
    MLA rope part (GLM-5, DeepSeek-V3.2) its BF16 rotated rope key."""
    a = cfg.attention
    return a.kv_lora_rank + 4 + a.qk_rope_head_dim * 2


def pool_key_bytes(cfg: ModelConfig) -> int:
    """Bytes the indexer reads of one complete pool: its FP8 key and f32 scale (one per token with
    the per-token indexer, whose keys are its pools)."""
    return cfg.dsa.index_head_dim + 4


def draft_bytes(prop: Any, context_row: int, fp8_head: bool) -> dict[str, int]:
    """Bytes one draft of one sequence at row ``context_row`` reads, from the buffers the step
    touches (FP8 weights counted at one byte plus their block scales)."""
    cfg, sh = prop.cfg, prop.sharding
    a, d, m, H = cfg.attention, cfg.dsa, cfg.moe, cfg.hidden_size
    hl, C, I = sh.local_heads, a.kv_lora_rank, m.moe_intermediate_size
    attn, mlp = prop.layer.attn, prop.layer.mlp
    npools = complete_pools(context_row, d.index_kpool)
    sel = selection_size(cfg, context_row)
    expert_fp8 = mlp.gate_up_scales is not None
    out = {
        "eh_proj": H * 2 * H * 2,
        "fused_in": sum(_matrix_bytes(g.rows, H, g.scales is not None) for g in attn.fused_full),
        "q_fused": sum(_matrix_bytes(g.rows, a.q_lora_rank, g.scales is not None) for g in attn.q_segments),
        "wk_t": hl * C * a.qk_nope_head_dim * 2,
        "wv": hl * a.v_head_dim * C * 2,
        "o_proj": _matrix_bytes(H, sh.local_groups * sh.group_heads * a.v_head_dim, attn.o_scales is not None)
        * sh.world_size,
        "router": m.n_routed_experts * H * 2,
        "experts": m.num_experts_per_tok
        * (2 * _matrix_bytes(I, H, expert_fp8) + _matrix_bytes(H, I, expert_fp8)),
        "shared_expert": (
            2 * _matrix_bytes(I * m.n_shared_experts, H, expert_fp8)
            + _matrix_bytes(H, I * m.n_shared_experts, expert_fp8)
            if m.n_shared_experts
            else 0
        ),
        "head": prop.head_n * H + prop.head_n * 4 if fp8_head else prop.head_n * H * 2,
        "caches": sel * selected_row_bytes(cfg) + npools * pool_key_bytes(cfg) + H * 2,
    }
    return out


# ---- measuring ------------------------------------------------------------------------------------


def copy_bandwidth(gpu: Any, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes read + written per second of a device-to-device copy (median of ``reps``)."""
    a, b = gpu.alloc(nbytes), gpu.alloc(nbytes)
    e0, e1 = gpu.event_create(), gpu.event_create()
    try:
        gpu.memset(a, 0x3C, nbytes)
        gpu.copy_d2d(b, a, nbytes)
        times = []
        for _ in range(reps):
            gpu.event_record(e0)
            gpu.copy_d2d(b, a, nbytes)
            gpu.event_record(e1)
            times.append(gpu.event_elapsed_ms(e0, e1) / 1e3)
        return 2 * nbytes / statistics.median(times)
    finally:
        gpu.event_destroy(e0)
        gpu.event_destroy(e1)
        gpu.free(a)
        gpu.free(b)


def fill_context(prop: Any, st: Any, rows: int, rng: np.random.Generator) -> None:
    """Write ``rows`` rows of random cache contents straight into ``st``'s slot of the pools and
    set its length (the fast feed this benchmark documents: what is timed is the draft rows, not
    the prefill): FP8 latents and scales, the FP8 pool keys and scales of the complete pools, the
    KPool indexer's BF16 keys and gates (the per-token indexer has none: its keys are its pools),
    and each row's BF16 rope key where the MLA has a rope part."""
    gpu, cfg, pools = prop.gpu, prop.cfg, prop.pools
    C, idim, kp = cfg.attention.kv_lora_rank, cfg.dsa.index_head_dim, cfg.dsa.index_kpool
    rope = cfg.attention.qk_rope_head_dim
    g, lp, kv = pools.geometry, pools.layers[0], pools.kv
    bs = g.block_size
    # FP8 E4M3 with the exponent's top bit clear: finite values below 2, never NaN.
    lat = rng.integers(0, 256, (rows, C), dtype=np.uint8) & np.uint8(0xBF)
    sc = (0.02 + 0.01 * rng.random(rows)).astype(np.float32)
    # One copy per run of consecutive blocks (a fresh slot's blocks usually are): 202,752 rows are
    # 12,672 blocks, too many copies of 8 KB to make one by one for 64 sequences.
    b = 0
    nblocks = -(-rows // bs)
    while b < nblocks:
        slot0 = pools.latent_slot(st.slot, b * bs)
        e = b + 1
        while e < nblocks and pools.latent_slot(st.slot, e * bs) == slot0 + (e - b) * bs:
            e += 1
        r0, r1 = b * bs, min(rows, e * bs)
        gpu.copy_h2d(kv.data[0].offset(slot0 * C), lat[r0:r1])
        gpu.copy_h2d(kv.scales[0].offset(slot0 * 4), sc[r0:r1])
        b = e
    if lp.keys is not None:  # the KPool indexer's per-token keys and gates
        keys = (rng.standard_normal((rows, idim), dtype=np.float32)).astype(BF16)
        gates = (rng.standard_normal((rows, idim), dtype=np.float32)).astype(BF16)
        gpu.copy_h2d(lp.keys.offset(g.key_row(st.slot, 0) * 2), keys)
        gpu.copy_h2d(lp.gates.offset(g.key_row(st.slot, 0) * 2), gates)
    if rope:
        # Row r of slot s at (s * slot_rows + r) * rope (model/slot_pools.py LayerPools.rope_keys).
        kr = (rng.standard_normal((rows, rope), dtype=np.float32)).astype(BF16)
        gpu.copy_h2d(lp.rope_keys.offset(st.slot * pools.slot_rows * rope * 2), kr)
    pools_n = rows // kp
    if pools_n:
        pk = rng.integers(0, 256, (pools_n, idim), dtype=np.uint8) & np.uint8(0xBF)
        gpu.copy_h2d(lp.pool_keys.offset(g.pool_row(st.slot, 0) * idim), pk)
        gpu.copy_h2d(
            lp.pool_scales.offset(g.pool_row(st.slot, 0) * 4),
            (0.01 + 0.01 * rng.random(pools_n)).astype(np.float32),
        )
    st.dsa.length = rows
    gpu.synchronize()


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def time_propose(
    prop: Any,
    st: Any,
    hidden: Any,
    context: int,
    k: int,
    iters: int,
    rng: np.random.Generator,
    host: list[float] | None = None,
) -> tuple[float, list[int]]:
    """Median wall milliseconds of ``propose`` (perf_counter around the call) and the last drafts;
    ``host`` collects each call's host time without the device wait (``st.last_host_s``)."""
    vocab = prop.cfg.vocab_size
    drafts = prop.propose(st, int(rng.integers(0, vocab)), hidden, context, k)  # warm-up / capture
    times = []
    for _ in range(iters):
        tok = int(rng.integers(0, vocab))
        t0 = time.perf_counter()
        drafts = prop.propose(st, tok, hidden, context, k)
        times.append(time.perf_counter() - t0)
        if host is not None:
            host.append(st.last_host_s)
    return _median_ms(times), drafts


@contextlib.contextmanager
def pdl_set(gpu: Any, on: bool) -> Iterator[None]:
    """Programmatic dependent launch on or off for the block (a graph captured inside keeps it);
    a backend without the switch (the host's) runs the block unchanged."""
    old = getattr(gpu, "pdl", None)
    if old is not None:
        gpu.pdl = on
    try:
        yield
    finally:
        if old is not None:
            gpu.pdl = old


def time_graph(prop: Any, st: Any, k: int, iters: int) -> float:
    """Median device milliseconds of one replay of the captured k-draft graph of one sequence
    (bucket 1), back to back."""
    gpu, s, g = prop.gpu, prop.stream, prop.graph(1, k)
    evs = [(gpu.event_create(), gpu.event_create()) for _ in range(iters)]
    try:
        for _ in range(3):
            gpu.graph_launch(g, s)
        for a, b in evs:
            gpu.event_record(a, s)
            gpu.graph_launch(g, s)
            gpu.event_record(b, s)
        gpu.synchronize(s)
        return statistics.median(gpu.event_elapsed_ms(a, b) for a, b in evs)
    finally:
        for a, b in evs:
            gpu.event_destroy(a)
            gpu.event_destroy(b)


def profile_step(
    prop: ArmProposer, st: Any, hidden: Any, context: int, k: int, blocker_bytes: int
) -> dict[str, Any]:
    """Device time of every launch of one eager k-draft propose (``prop`` built on a
    LaunchRecorder). A long device copy is queued first so the host enqueues the whole step before
    the GPU reaches it: the kernels then run back to back, as in a graph, and each one's events
    bracket its own execution."""
    rec = prop.gpu
    a, b = rec.alloc(blocker_bytes), rec.alloc(blocker_bytes)
    marks: list[tuple[str, tuple[int, ...], Any, Any]] = []
    try:
        prop.propose(st, 1, hidden, context, k)
        rec.copy_d2d(b, a, blocker_bytes, prop.stream)
        with rec.recording() as marks:
            prop.propose(st, 2, hidden, context, k)
        launches = []
        for i, (name, grid, e0, e1) in enumerate(marks):
            gap = rec.event_elapsed_ms(marks[i - 1][3], e0) if i else 0.0
            launches.append(
                {
                    "kernel": name,
                    "grid": list(grid),
                    "us": rec.event_elapsed_ms(e0, e1) * 1e3,
                    "gap_us": gap * 1e3,
                }
            )
        span = rec.event_elapsed_ms(marks[0][2], marks[-1][3]) * 1e3
        return {"context": context, "k": k, "span_us": span, "launches": launches}
    finally:
        for _, _, e0, e1 in marks:
            rec.event_destroy(e0)
            rec.event_destroy(e1)
        rec.free(a)
        rec.free(b)


def profile_text(p: dict[str, Any]) -> str:
    per: dict[str, list[float]] = {}
    for x in p["launches"]:
        per.setdefault(x["kernel"], []).append(x["us"])
    k = p["k"]
    busy = sum(x["us"] for x in p["launches"])
    lines = [
        f"Per-launch device time of one eager k={k} propose at context {p['context']} (FP8 head), queued "
        f"behind a long copy so the kernels run back to back: span {p['span_us']:.0f} us, kernels "
        f"{busy:.0f} us, gaps and events {p['span_us'] - busy:.0f} us.",
        "",
        "| kernel | launches | us per draft |",
        "|---|---:|---:|",
    ]
    for name, us in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        count = str(len(us) // k) if len(us) % k == 0 else f"{len(us)}/{k}"  # once per step: 1/k
        lines.append(f"| {name} | {count} | {sum(us) / k:.1f} |")
    lines += ["", "The step's own launches, then draft 0, in order (grid: us):", ""]
    per_step = sum(len(us) for us in per.values() if len(us) % k)
    n0 = per_step + (len(p["launches"]) - per_step) // k
    lines.append(
        "; ".join(
            f"{x['kernel'].split('.')[-1]} {tuple(x['grid'])}: {x['us']:.1f}" for x in p["launches"][:n0]
        )
    )
    return "\n".join(lines)


def measure(
    args: argparse.Namespace,
    gpu: Any = None,
    cfg: ModelConfig | None = None,
    contexts: tuple[int, ...] = CONTEXTS,
    copy_bytes: int = 2 << 30,
) -> dict[str, Any]:
    """The whole run on ``gpu`` (default: a new CudaBackend) at ``cfg`` (default: glm5_flash). The
    host backend with a tiny config runs the same code (tests/test_bench_propose.py)."""
    from model.proposer import ProposerOptions

    owned = gpu is None
    if gpu is None:
        from runtime.cuda_backend import CudaBackend

        gpu = CudaBackend(ptx_dir=getattr(args, "ptx_dir", None))
    cfg = cfg or glm5_flash()
    if not getattr(args, "share_selection", True):
        # The arm for what index_share_for_mtp_iteration saves: every draft runs the indexer.
        cfg = dataclasses.replace(cfg, dsa=dataclasses.replace(cfg.dsa, share_for_mtp_iteration=False))
    prog = getattr(args, "prog", "python3 bench/bench_propose.py")  # or "mtpdraft bench"
    res: dict[str, Any] = {
        "share_selection": cfg.dsa.share_for_mtp_iteration,
        "date": datetime.date.today().isoformat(),
        "device": getattr(gpu, "device_name", gpu.name),
        "sm_count": getattr(gpu, "sm_count", None),
        "command": " ".join([prog, *args.argv]),
    }
    log = print
    try:
        import subprocess

        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        res["nvidia_smi"] = smi.stdout.strip()
    except Exception as e:  # informational only
        res["nvidia_smi"] = f"unavailable: {e}"
    bw = copy_bandwidth(gpu, copy_bytes)
    res["copy_bw_GBps"] = bw / 1e9
    log(
        f"device {res['device']}, {res['sm_count']} SMs; copy bandwidth {bw / 1e12:.3f} TB/s (read + write)",
        flush=True,
    )

    t0 = time.time()
    weights = random_weights(cfg)
    served = max(contexts) + max(KS)
    opt = ProposerOptions(served_max_seq_len=served, max_draft_tokens=max(KS), max_sequences=2, fp8_head=True)
    prop = ArmProposer(LaunchRecorder(gpu), cfg, weights, opt)
    del weights
    assert prop.head_fp8 is not None, "the FP8 head kernels must load"
    log(
        f"weights built and uploaded in {time.time() - t0:.1f} s ({prop.weights_nbytes / 2**30:.2f} GiB)",
        flush=True,
    )
    rng = np.random.default_rng(1)
    hid = (rng.standard_normal(cfg.hidden_size, dtype=np.float32)).astype(BF16)
    hidden = gpu.alloc(hid.nbytes)
    gpu.copy_h2d(hidden, hid)
    heads = tuple(h == "fp8" for h in getattr(args, "heads", ("fp8", "bf16")))
    ks = getattr(args, "ks", KS)
    rows: list[dict[str, Any]] = []
    res["rows"] = rows
    res["bytes"] = {}
    try:
        for ctx in contexts:
            for fp8 in heads:
                b = draft_bytes(prop, ctx, fp8)
                res["bytes"][f"{ctx}/{'fp8' if fp8 else 'bf16'}"] = b
                per_draft = sum(b.values())
                for k in ks:
                    row = {
                        "context": ctx,
                        "head": "fp8" if fp8 else "bf16",
                        "k": k,
                        "bytes_per_draft": per_draft,
                    }
                    # draft i reads row ctx + i's selection: count each draft's own cache bytes
                    floor_bytes = sum(sum(draft_bytes(prop, ctx + i, fp8).values()) for i in range(k))
                    row["floor_ms"] = floor_bytes / bw * 1e3
                    for graphs in (False, True):
                        st = prop.alloc_state(Arm(fp8=fp8, graphs=graphs))
                        try:
                            fill_context(prop, st, ctx, rng)
                            host: list[float] = []
                            wall, drafts = time_propose(prop, st, hidden, ctx, k, args.iters, rng, host)
                            assert all(0 <= t < cfg.vocab_size for t in drafts), drafts
                            if graphs:
                                row["graph_wall_ms"] = wall
                                row["graph_device_ms"] = time_graph(prop, st, k, args.iters)
                                row["host_us"] = (wall - row["graph_device_ms"]) * 1e3
                                row["host_cpu_us"] = statistics.median(host) * 1e6
                            else:
                                row["eager_wall_ms"] = wall
                        finally:
                            prop.free_state(st)
                    if getattr(gpu, "pdl", False):
                        # The same graph captured with every kernel launched plainly: what
                        # programmatic dependent launch is worth.
                        st = prop.alloc_state(Arm(fp8=fp8, graphs=True))
                        try:
                            with pdl_set(gpu, False):
                                fill_context(prop, st, ctx, rng)
                                time_propose(prop, st, hidden, ctx, k, 3, rng)
                            row["graph_nopdl_device_ms"] = time_graph(prop, st, k, args.iters)
                        finally:
                            prop.free_state(st)
                    row["graph_over_floor"] = row["graph_device_ms"] / row["floor_ms"]
                    rows.append(row)
                    log(
                        f"ctx {ctx:>5} head {row['head']:>4} k {k}: floor {row['floor_ms']:.3f} ms, "
                        f"graph {row['graph_device_ms']:.3f} ms device ({row['graph_over_floor']:.2f}x floor), "
                        f"{row['graph_wall_ms']:.3f} ms wall (host {row['host_us']:.0f} us, CPU {row['host_cpu_us']:.0f} us), "
                        f"eager {row['eager_wall_ms']:.3f} ms",
                        flush=True,
                    )
        if getattr(args, "rows_only", False):
            return res
        # Arms that place a gap: the block alone, the head alone (context 4096, k = 3, graph).
        arms_out = []
        for fp8 in (True, False):
            for skip_block, skip_head in ((True, False), (False, True), (True, True)):
                st = prop.alloc_state(Arm(fp8=fp8, graphs=True, skip_block=skip_block, skip_head=skip_head))
                try:
                    fill_context(prop, st, contexts[0], rng)
                    time_propose(prop, st, hidden, contexts[0], 3, 3, rng)
                    ms = time_graph(prop, st, 3, args.iters)
                finally:
                    prop.free_state(st)
                arms_out.append(
                    {
                        "head": "fp8" if fp8 else "bf16",
                        "skip_block": skip_block,
                        "skip_head": skip_head,
                        "graph_device_ms": ms,
                    }
                )
                log(
                    f"arm head {'fp8' if fp8 else 'bf16'} skip_block={skip_block} skip_head={skip_head}: "
                    f"{ms:.3f} ms",
                    flush=True,
                )
        res["arms"] = arms_out
        # Same inputs, eager vs graph, PDL on and off: identical drafts (deterministic kernels).
        same = True
        pdl_modes = (True, False) if getattr(gpu, "pdl", False) else (False,)
        for fp8 in (True, False):
            outs = []
            for graphs in (False, True):
                for pdl in pdl_modes:
                    st = prop.alloc_state(Arm(fp8=fp8, graphs=graphs))
                    try:
                        with pdl_set(gpu, pdl):
                            fill_context(prop, st, contexts[0], np.random.default_rng(7))
                            outs.append(prop.propose(st, 12345 % cfg.vocab_size, hidden, contexts[0], 3))
                    finally:
                        prop.free_state(st)
            same &= all(o == outs[0] for o in outs)
        res["eager_equals_graph"] = same
        log(f"eager and graph drafts, PDL on and off, identical on the same inputs: {same}", flush=True)
        st = prop.alloc_state(Arm(fp8=True, graphs=False))
        try:
            fill_context(prop, st, contexts[0], rng)
            res["profile"] = profile_step(prop, st, hidden, contexts[0], 3, min(4 << 30, 64 * copy_bytes))
        finally:
            prop.free_state(st)
        log(profile_text(res["profile"]), flush=True)
    finally:
        gpu.free(hidden)
        prop.close()
        if owned:
            gpu.close()

    res["torch"] = torch_rows(args, contexts, cfg) if args.torch else {"skipped": "--no-torch"}
    return res


def torch_rows(
    args: argparse.Namespace, contexts: tuple[int, ...], cfg: ModelConfig | None = None
) -> dict[str, Any]:
    try:
        from bench import torch_step
    except Exception as e:
        print(f"note: bench/torch_step.py unavailable ({e!r}); the PyTorch rows are skipped", flush=True)
        return {"skipped": repr(e)}
    out: dict[str, Any] = {}
    for ctx in contexts:
        for k in KS:
            try:
                eager = torch_step.run(ctx, k, graph=False, iters=max(args.iters // 2, 10), cfg=cfg)
                graph = torch_step.run(ctx, k, graph=True, iters=args.iters, cfg=cfg)
            except Exception as e:
                print(f"note: torch step at context {ctx}, k {k} failed: {e!r}", flush=True)
                out[f"{ctx}/{k}"] = {"error": repr(e)}
                continue
            out[f"{ctx}/{k}"] = {"eager_ms": eager, "graph_ms": graph}
            print(f"torch ctx {ctx} k {k}: eager {eager:.3f} ms, graph {graph:.3f} ms", flush=True)
    return out


# ---- reporting ------------------------------------------------------------------------------------


def table(res: dict[str, Any]) -> str:
    bw = res["copy_bw_GBps"]
    lines = [
        f"Device: {res['device']} ({res.get('sm_count', '?')} SMs; {res.get('nvidia_smi', '')}). "
        f"Measured copy bandwidth {bw / 1e3:.3f} TB/s (bytes read + written). Date {res['date']}.",
        f"Command: `{res['command']}`",
        "",
        "| context | head | k | MB/draft | floor ms | graph ms (device) | x floor | graph ms without PDL | propose wall ms | wall - device us | host CPU us | eager ms | torch graph ms | torch eager ms | torch graph / ours |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    torch = res.get("torch", {})
    for r in res["rows"]:
        t = torch.get(f"{r['context']}/{r['k']}", {})
        tg, te = t.get("graph_ms", float("nan")), t.get("eager_ms", float("nan"))
        lines.append(
            f"| {r['context']} | {r['head']} | {r['k']} | {r['bytes_per_draft'] / 1e6:.0f} | {r['floor_ms']:.3f} | "
            f"{r['graph_device_ms']:.3f} | {r['graph_over_floor']:.2f} | {r.get('graph_nopdl_device_ms', float('nan')):.3f} | "
            f"{r['graph_wall_ms']:.3f} | "
            f"{r['host_us']:.0f} | {r.get('host_cpu_us', float('nan')):.0f} | {r['eager_wall_ms']:.3f} | {tg:.3f} | {te:.3f} | "
            f"{tg / r['graph_device_ms']:.2f} |"
        )
    if "skipped" in torch:
        lines.append(f"\nPyTorch rows skipped: {torch['skipped']}")
    if res.get("arms"):
        lines += [
            "",
            "Timing arms (context 4096, k = 3, graph, device ms):",
            "",
            "| head | skip_block | skip_head | ms |",
            "|---|---|---|---:|",
        ]
        for a in res["arms"]:
            lines.append(
                f"| {a['head']} | {a['skip_block']} | {a['skip_head']} | {a['graph_device_ms']:.3f} |"
            )
    b = res["bytes"].get("4096/fp8")
    if b:
        lines += [
            "",
            "Bytes per draft at context 4096 (FP8 head): "
            + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in b.items()),
        ]
    lines.append(
        f"\nEager and graph drafts (PDL on and off) identical on the same inputs: "
        f"{res.get('eager_equals_graph')}"
    )
    if res.get("profile"):
        lines += ["", profile_text(res["profile"])]
    return "\n".join(lines)


def update_markdown(path: Path, body: str) -> None:
    """Replace (or append) this benchmark's section of BENCHMARKS.md, leaving every other section."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION)
    block = f"{SECTION}\n\n{body}\n"
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + block
    else:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + block + ("" if nxt < 0 else text[nxt:])
    path.write_text(text)


def _unusable(path: Path, mode: str) -> str | None:
    """Why ``path`` cannot be opened with ``mode`` ("r" or "a"), or None; creates nothing."""
    existed = path.exists()
    try:
        with path.open(mode):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        path.unlink()
    return None


def _error(prog: str, msg: str) -> int:
    print(f"{prog}: error: {' '.join(msg.split())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``prog``: the name the help and errors use (``mtpdraft bench`` when called from the CLI)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    prog = ap.prog
    ap.add_argument("--iters", type=int, default=50, help="timed proposes / replays per point (median)")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    ap.add_argument("--update-md", type=Path, help="rewrite this benchmark's section of this markdown file")
    ap.add_argument("--notes", type=Path, help="markdown appended under the table in --update-md")
    ap.add_argument("--from-json", type=Path, help="render a previous run's results (no GPU needed)")
    ap.add_argument("--no-torch", dest="torch", action="store_false", help="skip the PyTorch rows")
    ap.add_argument("--ptx-dir", type=Path, help="load the kernels' PTX from here (a variant build)")
    ap.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="glm5_next",
        help="the shapes to run at: glm5_next (GLM-5.3-Flash), glm5 (GLM-5.2), deepseek_v32",
    )
    ap.add_argument(
        "--heads",
        type=lambda s: tuple(s.split(",")),
        default=("fp8", "bf16"),
        help="comma-separated heads to measure (fp8,bf16)",
    )
    ap.add_argument(
        "--ks",
        type=lambda s: tuple(int(c) for c in s.split(",")),
        default=KS,
        help="comma-separated draft counts to measure",
    )
    ap.add_argument(
        "--no-share-selection",
        dest="share_selection",
        action="store_false",
        help="drafts 2..k run the indexer again instead of reusing draft 1's pool "
        "selection (GLM-5.3-Flash's index_share_for_mtp_iteration is true): the "
        "arm for what sharing saves per propose",
    )
    ap.add_argument(
        "--rows-only",
        action="store_true",
        help="only the timing rows: no arms, equality check, profile or PyTorch",
    )
    ap.add_argument(
        "--contexts",
        type=lambda s: tuple(int(c) for c in s.split(",")),
        default=CONTEXTS,
        help="comma-separated contexts to measure (default 4096,16000; the arms and the "
        "profile use the first)",
    )
    args = ap.parse_args(argv)
    args.argv = argv
    args.prog = "python3 bench/bench_propose.py" if prog == "bench_propose.py" else prog
    if args.iters < 1:
        return _error(prog, f"--iters must be at least 1, got {args.iters}")
    # Every file is checked before a GPU minute is spent on the run.
    for opt, path, mode in (
        ("--json", args.json, "a"),
        ("--update-md", args.update_md, "a"),
        ("--notes", args.notes, "r"),
        ("--from-json", args.from_json, "r"),
    ):
        problem = path and _unusable(path, mode)
        if problem:
            return _error(prog, f"{opt} {path}: {problem}")
    if args.from_json:
        try:
            res = json.loads(args.from_json.read_text())
            out = table(res)
        except (ValueError, KeyError, TypeError) as e:
            return _error(prog, f"--from-json {args.from_json}: not this benchmark's results ({e!r})")
    else:
        try:
            from runtime.cuda_backend import CudaBackend

            gpu = CudaBackend(ptx_dir=args.ptx_dir)
        except Exception as e:  # noqa: BLE001 (no bindings, driver or device: any failure means no run)
            return _error(prog, f"needs a CUDA GPU, and none is usable here: {e}")
        try:
            cfg = model_config(args.model, max(args.contexts) + max(KS))
            res = measure(args, gpu=gpu, cfg=cfg, contexts=args.contexts)
        finally:
            gpu.close()
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        out = table(res)
    if args.update_md:
        notes = args.notes.read_text().strip() if args.notes else ""
        update_markdown(args.update_md, out + ("\n\n" + notes if notes else ""))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
