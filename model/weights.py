"""Device copies of the block's weights, laid out for the kernels and sharded for this rank.

Layouts chosen at load (each saves a pass over memory or a launch per draft):
- ``fused_in`` stacks every projection that reads the normalised block input ``y``:
  ``[kv_a (kv_lora) ; wk (idim) ; compress_gate (idim) ; q_a (q_lora) ; weights_proj (ih)]`` and
  zero rows up to a multiple of 8 (each batch row 16-byte aligned), so one GEMV reads ``y`` once;
  a context row runs only the first ``kv_lora + 2 idim`` rows.
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

import logging
from dataclasses import dataclass, field

import numpy as np

from runtime.backend import GpuBackend
from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16

from .config import ModelConfig
from .tensors import TensorLookup, WeightError

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
    fused_in: DevicePtr
    fused_rows: int
    kv_a_norm: DevicePtr
    q_a_norm: DevicePtr
    q_fused: DevicePtr
    k_norm_w: DevicePtr
    k_norm_b: DevicePtr
    ape: DevicePtr
    wk_t: DevicePtr
    wv: DevicePtr
    o_proj: DevicePtr


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


def fused_in_rows(cfg: ModelConfig) -> int:
    """Rows of the stacked ``fused_in`` weight (see the module docstring), padding included."""
    a, d = cfg.attention, cfg.dsa
    rows = a.kv_lora_rank + 2 * d.index_head_dim + a.q_lora_rank + d.index_n_heads
    return rows + -rows % 8


def load_attention(
    arena: DeviceArena, src: TensorLookup, prefix: str, cfg: ModelConfig, sh: Sharding
) -> AttentionWeights:
    a, d, H = cfg.attention, cfg.dsa, cfg.hidden_size
    nope, v, C, ql = a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank, a.q_lora_rank
    ih, idim = d.index_n_heads, d.index_head_dim
    at, ix = prefix + "self_attn.", prefix + "self_attn.indexer."
    kv_a = src.checked(at + "kv_a_proj_with_mqa.weight", (C + a.qk_rope_head_dim, H))[:C]
    fused = np.concatenate(
        [
            kv_a,
            src.checked(ix + "wk.weight", (idim, H)),
            src.checked(ix + "index_kpool_compress_gate", (idim, H)),
            src.checked(at + "q_a_proj.weight", (ql, H)),
            src.checked(ix + "weights_proj.weight", (ih, H)),
        ]
    )
    # Zero rows up to a multiple of 8: each batch row of the fused output then starts on 16 bytes,
    # which the vector paths of the cache write and the q projection need for every row alike (an
    # unaligned row takes the scalar path, whose sums differ in the last bits: a row's bits would
    # depend on its place in the batch).
    pad = fused_in_rows(cfg) - fused.shape[0]
    if pad:
        fused = np.concatenate([fused, np.zeros((pad, H), fused.dtype)])
    heads = slice(sh.rank * sh.local_heads, (sh.rank + 1) * sh.local_heads)
    q_b = src.checked(at + "q_b_proj.weight", (a.num_attention_heads * a.qk_head_dim, ql))
    q_b = q_b.reshape(a.num_attention_heads, a.qk_head_dim, ql)[heads].reshape(-1, ql)
    q_fused = np.concatenate([q_b, src.checked(ix + "wq_b.weight", (ih * idim, ql))])
    kv_b = src.checked(at + "kv_b_proj.weight", (a.num_attention_heads * (nope + v), C))
    kv_b = kv_b.reshape(a.num_attention_heads, nope + v, C)[heads]
    wk_t = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))  # [h, C, nope]
    wv = np.ascontiguousarray(kv_b[:, nope:, :])  # [h, v, C]
    o = src.checked(at + "o_proj.weight", (H, a.num_attention_heads * v))
    gw = sh.group_heads * v
    o_groups = o.reshape(H, sh.groups, gw).transpose(1, 0, 2)  # [groups, H, gw]
    o_local = o_groups[sh.rank * sh.local_groups : (sh.rank + 1) * sh.local_groups]
    return AttentionWeights(
        input_norm=arena.upload(src.checked(prefix + "input_layernorm.weight", (H,))),
        fused_in=arena.upload(fused),
        fused_rows=fused.shape[0],
        kv_a_norm=arena.upload(src.checked(at + "kv_a_layernorm.weight", (C,))),
        q_a_norm=arena.upload(src.checked(at + "q_a_layernorm.weight", (ql,))),
        q_fused=arena.upload(q_fused),
        k_norm_w=arena.upload(src.checked(ix + "k_norm.weight", (idim,))),
        k_norm_b=arena.upload(src.checked(ix + "k_norm.bias", (idim,))),
        ape=arena.upload(src.checked(ix + "index_kpool_compress_ape", (d.index_kpool, idim))),
        wk_t=arena.upload(wk_t),
        wv=arena.upload(wv),
        o_proj=arena.upload(np.ascontiguousarray(o_local)),
    )


def load_moe(
    arena: DeviceArena, src: TensorLookup, prefix: str, cfg: ModelConfig, sh: Sharding
) -> MlpWeights:
    m, H = cfg.moe, cfg.hidden_size
    I, E = m.moe_intermediate_size, m.n_routed_experts
    mp = prefix + "mlp."
    router = src.checked(mp + "gate.weight", (E, H))  # the shared expert has no gate
    gate_up = np.empty((sh.local_experts, 2 * I, H), BF16)
    down = np.empty((sh.local_experts, H, I), BF16)
    for j in range(sh.local_experts):
        e = sh.expert_base + j
        ep = f"{mp}experts.{e}."
        gate_up[j, :I] = src.checked(ep + "gate_proj.weight", (I, H))
        gate_up[j, I:] = src.checked(ep + "up_proj.weight", (I, H))
        down[j] = src.checked(ep + "down_proj.weight", (H, I))
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
    if m.n_shared_experts and sh.owns_shared_expert:
        Is = I * m.n_shared_experts
        sp = mp + "shared_experts."
        w.shared_gate_up = arena.upload(
            np.concatenate(
                [src.checked(sp + "gate_proj.weight", (Is, H)), src.checked(sp + "up_proj.weight", (Is, H))]
            )[None]
        )
        w.shared_down = arena.upload(src.checked(sp + "down_proj.weight", (H, Is))[None])
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
