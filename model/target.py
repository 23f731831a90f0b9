"""The target model of the family: embedding, decoder layers (DSA attention + dense MLP for the
first ``first_k_dense_replace`` layers, MoE after), final norm, ``lm_head``.

It exists to drive the drafter: ``prefill`` and ``verify`` (k + 1 rows in one call) return the
logits and leave the post-final-norm hidden rows in a device buffer the drafter reads in place.
Rows run one at a time through every layer: this is a reference-quality target, not a fast one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.backend import GpuBackend
from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16
from runtime.kernels.embed_gather_bf16 import embed_gather_bf16
from runtime.kernels.gemv_bf16 import gemv_bf16
from runtime.kernels.rmsnorm import rmsnorm

from .block import BatchScratch, DecoderLayer
from .config import ModelConfig
from .dsa import drafter_context_rows
from .kernels.batch import ENTRY_WORDS
from .slot_pools import SlotPools
from .tensors import TensorLookup
from .weights import DeviceArena, Sharding, SharedTables, load_attention, load_dense_mlp, load_moe


class TargetError(ValueError):
    """Bad input to the target model; raised before any state changes."""


@dataclass
class TargetState:
    arena: DeviceArena
    hiddens: DevicePtr  # [rows_cap, H] BF16 post-final-norm rows
    x: DevicePtr
    logits: DevicePtr
    token: DevicePtr
    entry: DevicePtr  # the one batch entry of the layers' launches: slot 0, the row, the token
    length: int = 0
    released: bool = False


class TargetModel:
    def __init__(
        self, gpu: GpuBackend, cfg: ModelConfig, tensors, max_seq_len: int, stream: int | None = None
    ) -> None:
        if cfg.parallel.world_size != 1:
            raise TargetError("the target model runs on one rank")
        self.gpu, self.cfg = gpu, cfg
        self.stream = gpu.default_stream if stream is None else stream
        src = TensorLookup.of(tensors)
        self.rows_cap = drafter_context_rows(max_seq_len, cfg.dsa)
        H, V = cfg.hidden_size, cfg.vocab_size
        self.arena = arena = DeviceArena(gpu)
        sh = Sharding.for_config(cfg, 1)
        try:
            self.embed = arena.upload(src.checked("model.embed_tokens.weight", (V, H)))
            self.lm_head = arena.upload(src.checked("lm_head.weight", (V, H)))
            self.norm = arena.upload(src.checked("model.norm.weight", (H,)))
            self.layers: list[DecoderLayer] = []
            for i in range(cfg.num_hidden_layers):
                p = f"model.layers.{i}."
                attn = load_attention(arena, src, p, cfg, sh)
                mlp = (
                    load_dense_mlp(arena, src, p, cfg)
                    if i < cfg.first_k_dense_replace
                    else load_moe(arena, src, p, cfg, sh)
                )
                self.layers.append(DecoderLayer(gpu, cfg, sh, attn, mlp, kv_layer=i))
            # One sequence: slot 0 of pools with a latent cache and indexer pools per layer.
            self.pools = SlotPools(
                gpu,
                cfg.dsa,
                cfg.attention.kv_lora_rank,
                self.rows_cap,
                1,
                layers=cfg.num_hidden_layers,
                rope_dim=cfg.attention.qk_rope_head_dim,
            )
            self.scratch = BatchScratch.alloc(
                arena, cfg, sh, 1, self.rows_cap, max(layer.attn.fused_rows for layer in self.layers)
            )
        except Exception:
            if getattr(self, "pools", None) is not None:
                self.pools.free()
            arena.free()
            raise
        self._state: TargetState | None = None

    @property
    def tables(self) -> SharedTables:
        """The embedding and head the drafter shares, read in place."""
        return SharedTables(self.embed, self.lm_head, self.cfg.vocab_size, self.cfg.hidden_size)

    def alloc_state(self) -> TargetState:
        if self._state is not None:
            raise TargetError("the target serves one sequence at a time; free its state first")
        cfg, gpu, H = self.cfg, self.gpu, self.cfg.hidden_size
        arena = DeviceArena(gpu)
        st = TargetState(
            arena=arena,
            hiddens=arena.zeros(self.rows_cap * H * 2),
            x=arena.zeros(H * 2),
            logits=arena.zeros(cfg.vocab_size * 2),
            token=arena.zeros(4),
            entry=arena.zeros(ENTRY_WORDS * 4),
        )
        self._state = st
        return st

    def free_state(self, st: TargetState) -> None:
        if st.released:
            return
        st.arena.free()
        st.released = True
        self._state = None

    def close(self) -> None:
        if self._state is not None:
            self.free_state(self._state)
        self.pools.free()
        self.arena.free()

    def rewind_to(self, st: TargetState, n: int) -> None:
        if not 0 <= n <= st.length:
            raise TargetError(f"target rewind_to({n}) outside 0..{st.length}")
        st.length = n

    def forward(self, st: TargetState, tokens, start: int) -> np.ndarray:
        """Rows ``start .. start + len(tokens) - 1`` (start must be the current length). Returns
        their logits as float32 [n, V]; their hidden rows land in ``st.hiddens``."""
        cfg, gpu, s, H, V = self.cfg, self.gpu, self.stream, self.cfg.hidden_size, self.cfg.vocab_size
        toks = np.asarray(tokens, np.int64)
        if toks.size == 0:
            raise TargetError("forward of no tokens")
        if ((toks < 0) | (toks >= V)).any():
            raise TargetError(f"token outside the vocabulary 0..{V - 1}")
        if start != st.length:
            raise TargetError(f"target rows must append at {st.length}, got {start}")
        if start + toks.size > self.rows_cap:
            raise TargetError(f"{start + toks.size} rows exceed the target's {self.rows_cap}-row context")
        out = np.empty((toks.size, V), np.float32)
        buf = np.empty(V, BF16)
        for i, t in enumerate(toks):
            row = start + i
            gpu.copy_h2d(st.entry, np.array([0, row, t, 0], np.uint32))
            gpu.copy_h2d(st.token, np.array([t], np.uint32))
            embed_gather_bf16(gpu, self.embed, st.token, st.x, V, H, s)
            for layer in self.layers:
                layer.full_rows(st.x, self.scratch, self.pools, st.entry, 1, 0, s)
            hid = st.hiddens.offset(row * H * 2)
            rmsnorm(gpu, st.x, self.norm, hid, 1, H, cfg.rms_norm_eps, s)
            gemv_bf16(gpu, self.lm_head, hid, st.logits, 1, V, H, s)
            gpu.synchronize(s)
            gpu.copy_d2h(buf, st.logits)
            out[i] = buf.astype(np.float32)
        st.length = start + toks.size
        return out

    def hidden_rows(self, st: TargetState, row: int) -> DevicePtr:
        return st.hiddens.offset(row * self.cfg.hidden_size * 2)
