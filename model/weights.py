"""Device copies of the block's weights, laid out for the kernels and sharded for this rank.

Layouts chosen at load (each saves a pass over memory or a launch per draft):
- ``fused_in`` stacks every projection that reads the normalised block input ``y``:
  ``[kv_a (kv_lora + rope) ; wk (idim) ; compress_gate (idim, KPool only) ; q_a (q_lora) ;
  weights_proj (ih)]`` and zero rows up to a multiple of 8 (each batch row 16-byte aligned), so one
  GEMV reads ``y`` once; a context row runs only the rows before q_a (``context_rows``).
- ``q_fused`` stacks this rank's heads of ``q_b`` and the indexer's ``wq_b`` (both read ``q_lat``).
- ``kv_b``'s key half is stored transposed per head, ``[heads, kv_lora, nope]``, for the absorbed
  query; the value half as ``[heads, v, kv_lora]``.
- ``o_proj`` is split into fixed head groups ``[groups, H, group_heads * v]``. Each group's partial
  sum is an f32 row, and the rows are added in group order, on one rank or after a sum all-reduce
  of the rows each rank fills with its own groups (zero elsewhere, so exact) on several: the
  sharded result is bit-identical to one rank's for any world size dividing ``groups``.
- experts as ``[n_local, 2I, H]`` (gate rows then up rows) and ``[n_local, H, I]``; the router as
  ``[E, H]`` (the shared expert has no gate).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np

from runtime.backend import GpuBackend
from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16

from .checkpoint import fp8
from .config import ModelConfig
from .kernels.bgemv_fp8 import GemvSegment
from .tensors import FP8_BLOCK, TensorLookup, WeightError

log = logging.getLogger(__name__)


@dataclass
class DeviceArena:
    """Owns device copies; ``free`` releases them all (the code that allocates frees)."""

    gpu: GpuBackend
    ptrs: list[DevicePtr] = field(default_factory=list)
    nbytes: int = 0

    def upload(self, arr: np.ndarray, dtype: np.dtype | None = None) -> DevicePtr:
        a = np.ascontiguousarray(arr if dtype is None else np.asarray(arr).astype(dtype))
        p = self.gpu.alloc(max(a.nbytes, 1))
        self.ptrs.append(p)
        self.gpu.copy_h2d(p, a)
        self.nbytes += a.nbytes
        return p

    def zeros(self, nbytes: int) -> DevicePtr:
        p = self.gpu.alloc(nbytes)
        self.ptrs.append(p)
        self.gpu.memset(p, 0, nbytes)
        self.nbytes += nbytes
        return p

    def free(self) -> None:
        for p in reversed(self.ptrs):
            self.gpu.free(p)
        self.ptrs.clear()
        self.nbytes = 0


@dataclass
class SharedTables:
    """The target's embedding and head, which the drafter reads in place (no copy)."""

    embed: DevicePtr  # [vocab, hidden] BF16
    lm_head: DevicePtr  # [vocab, hidden] BF16
    vocab: int
    hidden: int


@dataclass(frozen=True)
class Sharding:
    """How this rank's share of a layer is cut. ``groups`` fixes o_proj's reduction order."""

    rank: int
    world_size: int
    heads: int
    groups: int
    experts: int

    @property
    def local_heads(self) -> int:
        return self.heads // self.world_size

    @property
    def local_groups(self) -> int:
        return self.groups // self.world_size

    @property
    def group_heads(self) -> int:
        return self.heads // self.groups

    @property
    def local_experts(self) -> int:
        return self.experts // self.world_size

    @property
    def expert_base(self) -> int:
        return self.rank * self.local_experts

    @property
    def owns_shared_expert(self) -> bool:
        # The shared expert stays whole on rank 0: splitting its intermediate would turn its output
        # into partial sums and break the bit-exact reduction across world sizes.
        return self.rank == 0

    @classmethod
    def for_config(cls, cfg: ModelConfig, groups: int) -> Sharding:
        p, heads = cfg.parallel, cfg.attention.num_attention_heads
        e = cfg.moe.n_routed_experts
        if heads % groups:
            raise WeightError(f"num_attention_heads {heads} is not divisible by o_proj groups {groups}")
        if groups % p.world_size:
            raise WeightError(
                f"world_size {p.world_size} does not divide the {groups} o_proj head groups "
                "(choose a world size that divides it, or more groups)"
            )
        if e % p.world_size:
            raise WeightError(f"world_size {p.world_size} does not divide n_routed_experts {e}")
        return cls(p.rank, p.world_size, heads, groups, e)


@dataclass
class AttentionWeights:
    input_norm: DevicePtr
    # The projections of y: every row's [kv_a | wk | compress_gate | q_a | weights_proj] (the
    # fused row, ``fused_rows`` wide), as segments of one launch: a BF16 checkpoint's stack is one
    # segment; native FP8 kv_a and q_a are segments of their own (module docstring).
    fused_full: tuple[GemvSegment, ...]
    fused_ctx: tuple[GemvSegment, ...]  # the same, cut to the columns a context row needs
    fused_rows: int
    kv_a_norm: DevicePtr
    q_a_norm: DevicePtr
    q_segments: tuple[GemvSegment, ...]  # [q_b (this rank's heads) | wq_b] from the q latent
    k_norm_w: DevicePtr
    k_norm_b: DevicePtr
    ape: DevicePtr | None  # the KPool indexer's (None for the per-token one)
    wk_t: DevicePtr
    wv: DevicePtr
    o_proj: DevicePtr  # [local groups, H, group width], BF16 or FP8
    rope_inv_freq: DevicePtr | None  # f32 [qk_rope_head_dim / 2] (None for NoPE)
    o_scales: DevicePtr | None = None  # FP8: the published [ceil(H/128), ceil(heads*v/128)] scales
    o_scale_cols: int = 0
    o_col0: int = 0  # first o_proj column of this rank's groups


@dataclass
class MlpWeights:
    post_norm: DevicePtr
    gate_up: DevicePtr  # [n_local, 2I, H]
    down: DevicePtr  # [n_local, H, I]
    inter: int
    n_local: int
    expert_base: int
    # MoE only
    router: DevicePtr | None = None  # [E, H]
    bias: DevicePtr | None = None  # [E] f32
    shared_gate_up: DevicePtr | None = None
    shared_down: DevicePtr | None = None
    is_moe: bool = True
    # Dense only: the MLP runs as one "expert" with this id (u32 0) and routing weight (f32 1.0).
    dense_ids: DevicePtr | None = None
    dense_weight: DevicePtr | None = None
    # FP8 experts (routed and shared alike): F32 128x128 block scales, gate_up's as
    # [n_local, 2 ceil(I/128), ceil(H/128)] (gate's block rows, then up's), down's as
    # [n_local, ceil(H/128), ceil(I/128)] (ptx/moe.cu's FP8 kernels).
    gate_up_scales: DevicePtr | None = None
    down_scales: DevicePtr | None = None
    shared_gate_up_scales: DevicePtr | None = None
    shared_down_scales: DevicePtr | None = None

    @property
    def fp8(self) -> bool:
        return self.gate_up_scales is not None


def context_rows(cfg: ModelConfig) -> int:
    """Columns of the fused row that a context row needs (what the cache write reads):
    ``[kv_a (kv_lora, then the rope dims) ; wk ; compress_gate (KPool indexer only)]``."""
    a, d = cfg.attention, cfg.dsa
    return a.kv_lora_rank + a.qk_rope_head_dim + d.index_head_dim * (1 if d.per_token else 2)


def fused_in_rows(cfg: ModelConfig) -> int:
    """Width of the fused row of y's projections (see the module docstring), padding included."""
    a, d = cfg.attention, cfg.dsa
    rows = context_rows(cfg) + a.q_lora_rank + d.index_n_heads
    return rows + -rows % 8


@dataclass
class _Fp8Rows:
    """Rows ``row0 ..`` of a block-scaled FP8 tensor, with the whole tensor's scales."""

    q: np.ndarray
    scales: np.ndarray
    row0: int = 0


def _weight(src: TensorLookup, name: str, shape: tuple[int, int], native_fp8: bool) -> np.ndarray | _Fp8Rows:
    """The tensor as stored when it is block-scaled FP8 and ``native_fp8``, else BF16."""
    found = src.block_fp8(name, shape) if native_fp8 else None
    return _Fp8Rows(*found) if found is not None else src.checked(name, shape)


def _rows(w: np.ndarray | _Fp8Rows, start: int, stop: int) -> np.ndarray | _Fp8Rows:
    if isinstance(w, _Fp8Rows):
        return _Fp8Rows(w.q[start:stop], w.scales, w.row0 + start)
    return w[start:stop]


def _segments(arena: DeviceArena, pieces: list[np.ndarray | _Fp8Rows]) -> tuple[GemvSegment, ...]:
    """Segments writing ``pieces`` into consecutive output columns: adjacent BF16 pieces become one
    segment (one weight stream), each FP8 piece its own with its scales."""
    out: list[GemvSegment] = []
    col, run = 0, []

    def flush() -> None:
        nonlocal col, run
        if run:
            a = np.concatenate(run)
            out.append(GemvSegment(w=arena.upload(a), scales=None, rows=a.shape[0], col=col))
            col += a.shape[0]
            run = []

    for p in pieces:
        if isinstance(p, _Fp8Rows):
            flush()
            out.append(
                GemvSegment(
                    w=arena.upload(p.q),
                    scales=arena.upload(p.scales),
                    rows=p.q.shape[0],
                    col=col,
                    row0=p.row0,
                )
            )
            col += p.q.shape[0]
        elif p.shape[0]:
            run.append(p)
    flush()
    return tuple(out)


def _clip(segments: tuple[GemvSegment, ...], cols: int) -> tuple[GemvSegment, ...]:
    """The segments cut to output columns [0, cols): the same weights, fewer rows."""
    return tuple(dataclasses.replace(g, rows=min(g.rows, cols - g.col)) for g in segments if g.col < cols)


def load_attention(
    arena: DeviceArena,
    src: TensorLookup,
    prefix: str,
    cfg: ModelConfig,
    sh: Sharding,
    native_fp8: bool = True,
) -> AttentionWeights:
    """The layer's attention weights; with ``native_fp8`` the tensors stored as block-scaled FP8
    stay FP8 on the device (kv_a, q_a, q_b, o_proj in the published checkpoints)."""
    a, d, H = cfg.attention, cfg.dsa, cfg.hidden_size
    nope, v, C, ql = a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank, a.q_lora_rank
    ih, idim = d.index_n_heads, d.index_head_dim
    at, ix = prefix + "self_attn.", prefix + "self_attn.indexer."
    kv_a = _weight(src, at + "kv_a_proj_with_mqa.weight", (C + a.qk_rope_head_dim, H), native_fp8)
    rows = context_rows(cfg) + ql + ih
    # Zero rows up to a multiple of 8: each batch row of the fused output then starts on 16 bytes,
    # which the vector paths of the cache write and the q projection need for every row alike (an
    # unaligned row takes the scalar path, whose sums differ in the last bits: a row's bits would
    # depend on its place in the batch).
    gate = [] if d.per_token else [src.checked(ix + "index_kpool_compress_gate", (idim, H))]
    pieces = [
        kv_a,
        src.checked(ix + "wk.weight", (idim, H)),
        *gate,
        _weight(src, at + "q_a_proj.weight", (ql, H), native_fp8),
        src.checked(ix + "weights_proj.weight", (ih, H)),
        np.zeros((fused_in_rows(cfg) - rows, H), BF16),
    ]
    fused = _segments(arena, pieces)
    heads = a.num_attention_heads
    h0, h1 = sh.rank * sh.local_heads, (sh.rank + 1) * sh.local_heads
    q_b = _rows(
        _weight(src, at + "q_b_proj.weight", (heads * a.qk_head_dim, ql), native_fp8),
        h0 * a.qk_head_dim,
        h1 * a.qk_head_dim,
    )
    q_segments = _segments(arena, [q_b, src.checked(ix + "wq_b.weight", (ih * idim, ql))])
    kv_b = src.checked(at + "kv_b_proj.weight", (heads * (nope + v), C))
    kv_b = kv_b.reshape(heads, nope + v, C)[h0:h1]
    wk_t = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))  # [h, C, nope]
    wv = np.ascontiguousarray(kv_b[:, nope:, :])  # [h, v, C]
    o = _weight(src, at + "o_proj.weight", (H, heads * v), native_fp8)
    gw = sh.group_heads * v
    g0, g1 = sh.rank * sh.local_groups, (sh.rank + 1) * sh.local_groups
    o_vals = o.q if isinstance(o, _Fp8Rows) else o
    o_local = o_vals.reshape(H, sh.groups, gw).transpose(1, 0, 2)[g0:g1]  # [local groups, H, gw]
    w = AttentionWeights(
        input_norm=arena.upload(src.checked(prefix + "input_layernorm.weight", (H,))),
        fused_full=fused,
        fused_ctx=_clip(fused, context_rows(cfg)),
        fused_rows=fused_in_rows(cfg),
        kv_a_norm=arena.upload(src.checked(at + "kv_a_layernorm.weight", (C,))),
        q_a_norm=arena.upload(src.checked(at + "q_a_layernorm.weight", (ql,))),
        q_segments=q_segments,
        k_norm_w=arena.upload(src.checked(ix + "k_norm.weight", (idim,))),
        k_norm_b=arena.upload(src.checked(ix + "k_norm.bias", (idim,))),
        ape=None
        if d.per_token
        else arena.upload(src.checked(ix + "index_kpool_compress_ape", (d.index_kpool, idim))),
        rope_inv_freq=None if cfg.rope_inv_freq is None else arena.upload(cfg.rope_inv_freq),
        wk_t=arena.upload(wk_t),
        wv=arena.upload(wv),
        o_proj=arena.upload(np.ascontiguousarray(o_local)),
    )
    if isinstance(o, _Fp8Rows):
        w.o_scales = arena.upload(o.scales)
        w.o_scale_cols = o.scales.shape[1]
        w.o_col0 = g0 * gw
    return w


def _expert(
    src: TensorLookup, name: str, shape: tuple[int, int], native_fp8: bool, quantize: bool
) -> np.ndarray | _Fp8Rows:
    """An expert matrix as stored (FP8 kept with ``native_fp8``), or a BF16 one quantised to
    128x128 block-scaled FP8 when ``quantize`` (absmax / 448 per block, saturating)."""
    w = _weight(src, name, shape, native_fp8 or quantize)
    if quantize and not isinstance(w, _Fp8Rows):
        return _Fp8Rows(*fp8.quantize(w, FP8_BLOCK))
    return w


def _stack_experts(
    mats: list[list[np.ndarray | _Fp8Rows]], what: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """Experts' matrices (each expert: its pieces stacked by rows, e.g. [gate ; up]) as one
    [n, rows, cols] array, with [n, block rows, block cols] scales when they are FP8. A layer's
    experts are all FP8 or all BF16 (one kernel runs them all)."""
    kinds = {isinstance(p, _Fp8Rows) for e in mats for p in e}
    if len(kinds) > 1:
        raise WeightError(f"{what}: some experts are stored FP8 and others BF16; a layer needs one kind")
    if kinds == {True}:
        q = np.stack([np.concatenate([p.q for p in e]) for e in mats])
        s = np.stack([np.concatenate([p.scales for p in e]) for e in mats])
        return q, s
    return np.stack([np.concatenate(e) for e in mats]), None


def load_moe(
    arena: DeviceArena,
    src: TensorLookup,
    prefix: str,
    cfg: ModelConfig,
    sh: Sharding,
    native_fp8: bool = True,
    quantize_experts: bool = False,
) -> MlpWeights:
    """This rank's experts and the router (the shared expert on the rank that owns it). With
    ``native_fp8`` experts stored block-scaled FP8 stay FP8; ``quantize_experts`` makes a BF16
    checkpoint's experts FP8 on load."""
    m, H = cfg.moe, cfg.hidden_size
    I, E = m.moe_intermediate_size, m.n_routed_experts
    mp = prefix + "mlp."
    router = src.checked(mp + "gate.weight", (E, H))  # the shared expert has no gate

    def expert(name: str, shape: tuple[int, int]):
        return _expert(src, name, shape, native_fp8, quantize_experts)

    gu, dn = [], []
    for j in range(sh.local_experts):
        ep = f"{mp}experts.{sh.expert_base + j}."
        gu.append([expert(ep + "gate_proj.weight", (I, H)), expert(ep + "up_proj.weight", (I, H))])
        dn.append([expert(ep + "down_proj.weight", (H, I))])
    gate_up, gu_s = _stack_experts(gu, f"{mp}experts")
    down, dn_s = _stack_experts(dn, f"{mp}experts")
    w = MlpWeights(
        post_norm=arena.upload(src.checked(prefix + "post_attention_layernorm.weight", (H,))),
        gate_up=arena.upload(gate_up),
        down=arena.upload(down),
        inter=I,
        n_local=sh.local_experts,
        expert_base=sh.expert_base,
        router=arena.upload(router),
        bias=arena.upload(src.checked(mp + "gate.e_score_correction_bias", (E,), np.float32)),
    )
    del gate_up, down
    if gu_s is not None:
        w.gate_up_scales, w.down_scales = arena.upload(gu_s), arena.upload(dn_s)
    if m.n_shared_experts and sh.owns_shared_expert:
        Is = I * m.n_shared_experts
        sp = mp + "shared_experts."
        sgu, sgu_s = _stack_experts(
            [[expert(sp + "gate_proj.weight", (Is, H)), expert(sp + "up_proj.weight", (Is, H))]], sp
        )
        sdn, sdn_s = _stack_experts([[expert(sp + "down_proj.weight", (H, Is))]], sp)
        if (sgu_s is None) != (gu_s is None):
            raise WeightError(f"{sp}: the shared expert and the routed experts must be both FP8 or both BF16")
        w.shared_gate_up, w.shared_down = arena.upload(sgu), arena.upload(sdn)
        if sgu_s is not None:
            w.shared_gate_up_scales, w.shared_down_scales = arena.upload(sgu_s), arena.upload(sdn_s)
    return w


def load_dense_mlp(arena: DeviceArena, src: TensorLookup, prefix: str, cfg: ModelConfig) -> MlpWeights:
    H, I = cfg.hidden_size, cfg.intermediate_size
    mp = prefix + "mlp."
    gu = np.concatenate(
        [src.checked(mp + "gate_proj.weight", (I, H)), src.checked(mp + "up_proj.weight", (I, H))]
    )
    return MlpWeights(
        post_norm=arena.upload(src.checked(prefix + "post_attention_layernorm.weight", (H,))),
        gate_up=arena.upload(gu[None]),
        down=arena.upload(src.checked(mp + "down_proj.weight", (H, I))[None]),
        inter=I,
        n_local=1,
        expert_base=0,
        is_moe=False,
        dense_ids=arena.upload(np.zeros(1, np.uint32)),
        dense_weight=arena.upload(np.ones(1, np.float32)),
    )
