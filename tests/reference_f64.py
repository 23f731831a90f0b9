"""Independent NumPy float64 reference of the MTP draft proposer (the test oracle).

Written directly from the project's specification of the model, the proposer and their exact
semantics (written out in this module's functions), and nothing else:
it imports no kernel, no runtime helper and no model code other than ``model.config``. Every
number is computed in float64; the only deliberate loss of precision is the FP8 storage emulation
of the latent cache and the pool keys (``fp8_cache``, on by default) and, optionally, of the draft
head (``fp8_head``), which mirror what the real drafter stores.

Row space: drafter row r is the pair (embedding of a token, hidden row); its latent, its indexer key
and gate, and its position are all r. ``context_row`` appends a row that only fills the caches;
``draft_row`` appends a row and runs it through the block and the head.

Two attention variants, chosen by the config:

- GLM-5.3-Flash: NoPE MLA (``qk_rope_head_dim`` 0) and the KPool indexer (keys and gates per token,
  compressed pool keys, the incomplete tail pool).
- GLM-5 / DeepSeek-V3.2: MLA with a rope part and the plain per-token indexer
  (``dsa.per_token``). Row r's query and keys are rotated at position r (offset 0: the target
  position of the row's hidden state). Scores are ``scale * (absorbed nope . latent + q_rope .
  k_rope)`` with one rotated rope key per row shared by the heads and ``scale = mscale^2 /
  sqrt(nope + rope)`` (YaRN's ``mscale_all_dim`` correction, 1 otherwise); cos and sin carry YaRN's
  attention factor. The indexer's key is ``LayerNorm(wk . y)`` with its first ``rope_dim`` dims
  rotated, its query likewise; ``score_t = sum_h w_h relu(q_h . k_t) / sqrt(idim)`` with
  ``w = weights_proj . y / sqrt(heads)``; a row attends the top ``index_topk`` of rows 0..n (itself
  included), ties to the lower row, every row while there are no more than ``index_topk``. The
  frequencies are ``ModelConfig.rope_inv_freq`` (float32), the angles ``position * freq`` in
  float64. Pairs are (2i, 2i + 1) with ``interleave`` (rotated in place: queries and keys share the
  layout, so every dot product is that of a de-interleaved rotation), else (i, i + d/2).
  With ``fp8_cache`` the per-token indexer's keys are stored FP8 with one scale per row (the device
  keeps only those: a pool is one token) and the rope keys BF16 (model/slot_pools.py).

The MoE routes group-limited where ``n_group`` > 1 (DeepSeek-V3: the ``topk_group`` groups of the
highest sum of their two best biased scores, then the top-k of their experts); SwiGLU is unclamped
where ``swiglu_limit`` is infinite (no clamp in the config).

Weights are a mapping from the Hugging Face names of the block's tensor table (docs/checkpoint.md) (P =
``model.layers.{num_hidden_layers}.``) plus ``model.embed_tokens.weight`` and ``lm_head.weight``;
any float dtype (bfloat16 from ml_dtypes, float32, ...) is upcast to float64 once, at construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from model.config import ModelConfig

FP8_MAX = 448.0
INDEXER_LN_EPS = 1e-6


# ---- small pure functions ------------------------------------------------------------------------


def f64(a) -> np.ndarray:
    """Upcast any numeric array (bf16/fp8 from ml_dtypes included) to a float64 copy."""
    a = np.asarray(a)
    if a.dtype == np.float64:
        return a.copy()
    return a.astype(np.float64)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = INDEXER_LN_EPS) -> np.ndarray:
    mu = np.mean(x, axis=-1, keepdims=True)
    d = x - mu
    var = np.mean(d * d, axis=-1, keepdims=True)
    return d / np.sqrt(var + eps) * w + b


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def clamped_swiglu(
    y: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, limit: float
) -> np.ndarray:
    """down(silu(min(gate.y, L)) * clip(up.y, -L, L)); L = inf is no clamp."""
    g = np.minimum(w_gate @ y, limit)
    u = np.clip(w_up @ y, -limit, limit)
    return w_down @ (silu(g) * u)


def fp8_rows(x: np.ndarray) -> np.ndarray:
    """FP8 E4M3 storage round trip with one scale per row (last axis is the row).

    scale = absmax / 448 (1 for an all-zero row); q = E4M3(clip(x / scale, -448, 448)); returns
    q * scale in float64. The clip is required: ml_dtypes' float8_e4m3fn does not saturate.
    """
    x = np.asarray(x, dtype=np.float64)
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0)
    q = np.clip(x / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64) * scale


def argmax_lowest(v: np.ndarray) -> int:
    """Index of the maximum, the lowest index on a tie (np.argmax's documented behaviour)."""
    v = np.asarray(v)
    if np.isnan(v).any():
        raise FloatingPointError("NaN in logits")
    return int(np.argmax(v))


def top_k_desc(values: np.ndarray, k: int) -> list[int]:
    """The k indices of the largest values; ties by lower index. -0.0 and 0.0 tie."""
    order = sorted(range(len(values)), key=lambda i: (-float(values[i]), i))
    return order[:k]


def bf16_rows(x: np.ndarray) -> np.ndarray:
    """BF16 storage round trip (round to nearest even), back in float64."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def rope_rotate(
    x: np.ndarray, pos: int, inv_freq: np.ndarray, *, interleave: bool, factor: float = 1.0
) -> np.ndarray:
    """Rotate the last axis of ``x`` (its ``2 * len(inv_freq)`` rope dims) to position ``pos``:
    pair i by ``pos * inv_freq[i]``, cos and sin times ``factor`` (YaRN's attention factor).
    ``interleave``: pairs (2i, 2i + 1), rotated in place; else pairs (i, i + d/2)."""
    x = np.asarray(x, dtype=np.float64)
    half = len(inv_freq)
    if x.shape[-1] != 2 * half:
        raise ValueError(f"rope over {x.shape[-1]} dims with {half} frequencies")
    ang = float(pos) * np.asarray(inv_freq, np.float64)
    cos, sin = np.cos(ang) * factor, np.sin(ang) * factor
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    out = np.empty_like(x)
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if interleave:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :half], out[..., half:] = ra, rb
    return out


# ---- the drafter ---------------------------------------------------------------------------------


class ReferenceDrafter:
    """Float64 MTP drafter: one decoder block (absorbed MLA + DSA + MoE) and the head: NoPE MLA with
    the KPool indexer, or MLA with a rope part and the per-token indexer (the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, np.ndarray],
        *,
        fp8_cache: bool = True,
        fp8_head: bool = False,
    ) -> None:
        a, d, m = cfg.attention, cfg.dsa, cfg.moe
        R = a.qk_rope_head_dim
        if R and not d.per_token:
            raise ValueError("reference covers the KPool indexer with NoPE MLA only")
        if d.per_token and d.rope_dim not in (0, R):
            raise ValueError(f"indexer rope dims {d.rope_dim} are not the MLA's {R}")
        if cfg.parallel.world_size != 1:
            raise ValueError("the reference is the unsharded drafter (world_size 1)")
        self.cfg = cfg
        self.fp8_cache = fp8_cache
        self.fp8_head = fp8_head
        H = cfg.hidden_size
        P = f"model.layers.{cfg.num_hidden_layers}."
        self.prefix = P

        def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
            if name not in weights:
                raise KeyError(f"missing tensor {name}")
            t = f64(weights[name])
            if t.shape != shape:
                raise ValueError(f"tensor {name}: expected shape {shape}, found {t.shape}")
            return t

        nh, nope, v, ql, kl = (
            a.num_attention_heads,
            a.qk_nope_head_dim,
            a.v_head_dim,
            a.q_lora_rank,
            a.kv_lora_rank,
        )
        ih, idim, kp = d.index_n_heads, d.index_head_dim, d.index_kpool
        E, I = m.n_routed_experts, m.moe_intermediate_size
        V = cfg.vocab_size

        emb_name = (
            P + "embed_tokens.weight" if P + "embed_tokens.weight" in weights else "model.embed_tokens.weight"
        )
        head_name = (
            P + "shared_head.head.weight" if P + "shared_head.head.weight" in weights else "lm_head.weight"
        )
        self.embed = get(emb_name, (V, H))
        head = get(head_name, (V, H))
        self.head = fp8_rows(head) if fp8_head else head

        self.enorm = get(P + "enorm.weight", (H,))
        self.hnorm = get(P + "hnorm.weight", (H,))
        self.eh_proj = get(P + "eh_proj.weight", (H, 2 * H))
        self.in_norm = get(P + "input_layernorm.weight", (H,))
        self.post_norm = get(P + "post_attention_layernorm.weight", (H,))
        self.head_norm = get(P + "shared_head.norm.weight", (H,))

        A = P + "self_attn."
        self.q_a = get(A + "q_a_proj.weight", (ql, H))
        self.q_a_norm = get(A + "q_a_layernorm.weight", (ql,))
        # q_b's rows per head: [nope ; rope].
        q_b = get(A + "q_b_proj.weight", (nh * (nope + R), ql)).reshape(nh, nope + R, ql)
        self.q_b = q_b[:, :nope].reshape(nh * nope, ql)
        self.q_b_rope = q_b[:, nope:].reshape(nh * R, ql)
        kv_a = get(A + "kv_a_proj_with_mqa.weight", (kl + R, H))
        self.kv_a = kv_a[:kl]
        self.kv_a_rope = kv_a[kl:]  # the shared rope key's rows
        self.inv_freq = np.asarray(cfg.rope_inv_freq, np.float64) if R else None
        self.kv_a_norm = get(A + "kv_a_layernorm.weight", (kl,))
        kv_b = get(A + "kv_b_proj.weight", (nh * (nope + v), kl)).reshape(nh, nope + v, kl)
        self.w_uk = kv_b[:, :nope, :]  # [nh, nope, kl]: key half per head
        self.w_uv = kv_b[:, nope:, :]  # [nh, v, kl]: value half per head
        self.o_proj = get(A + "o_proj.weight", (H, nh * v))

        X = A + "indexer."
        self.ix_wq_b = get(X + "wq_b.weight", (ih * idim, ql))
        self.ix_wk = get(X + "wk.weight", (idim, H))
        self.ix_weights = get(X + "weights_proj.weight", (ih, H))
        self.ix_ln_w = get(X + "k_norm.weight", (idim,))
        self.ix_ln_b = get(X + "k_norm.bias", (idim,))
        self.ix_gate = self.ix_ape = None
        if not d.per_token:
            self.ix_gate = get(X + "index_kpool_compress_gate", (idim, H))
            self.ix_ape = get(X + "index_kpool_compress_ape", (kp, idim))

        M = P + "mlp."
        self.router = get(M + "gate.weight", (E, H))
        self.router_bias = get(M + "gate.e_score_correction_bias", (E,))
        self.experts = [
            (
                get(M + f"experts.{e}.gate_proj.weight", (I, H)),
                get(M + f"experts.{e}.up_proj.weight", (I, H)),
                get(M + f"experts.{e}.down_proj.weight", (H, I)),
            )
            for e in range(E)
        ]
        self.shared = None
        if m.n_shared_experts:
            self.shared = (
                get(M + "shared_experts.gate_proj.weight", (I * m.n_shared_experts, H)),
                get(M + "shared_experts.up_proj.weight", (I * m.n_shared_experts, H)),
                get(M + "shared_experts.down_proj.weight", (H, I * m.n_shared_experts)),
            )

        # Per-row state (row r at index r) and per-pool compressed keys.
        self._y: list[np.ndarray] = []  # normalised block input (kept to recompute selection)
        self._c: list[np.ndarray] = []  # latent rows as read back from storage [kl]
        self._kr: list[np.ndarray] = []  # rotated rope keys as read back [rope] (RoPE MLA only)
        self._k: list[np.ndarray] = []  # indexer keys [idim] (per-token: rotated)
        self._g: list[np.ndarray] = []  # compress gates [idim] (KPool only)
        # Stored pool keys (read back) [idim]; per-token, one per row: the stored keys.
        self._pool_keys: list[np.ndarray] = []
        self._draft_rows = 0  # rows written by the last propose (for after_verify)

    # ---- state -----------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self._c)

    @property
    def latents(self) -> np.ndarray:
        """Stored latent rows as read back, [rows, kv_lora]."""
        return np.array(self._c).reshape(self.rows, self.cfg.attention.kv_lora_rank)

    @property
    def indexer_keys(self) -> np.ndarray:
        return np.array(self._k).reshape(self.rows, self.cfg.dsa.index_head_dim)

    @property
    def gates(self) -> np.ndarray:
        """Compress gates, [rows, index_head_dim] (no rows with the per-token indexer)."""
        return np.array(self._g).reshape(len(self._g), self.cfg.dsa.index_head_dim)

    @property
    def rope_keys(self) -> np.ndarray:
        """Stored rotated rope keys as read back, [rows, qk_rope_head_dim] (no columns for NoPE)."""
        return np.array(self._kr).reshape(self.rows, self.cfg.attention.qk_rope_head_dim)

    @property
    def pool_keys(self) -> np.ndarray:
        """Stored pool keys as read back, [complete pools, index_head_dim]."""
        return np.array(self._pool_keys).reshape(len(self._pool_keys), self.cfg.dsa.index_head_dim)

    def state(self) -> dict[str, np.ndarray]:
        """A copy of the whole cache state, for exact comparisons."""
        return {
            "y": np.array(self._y).reshape(self.rows, self.cfg.hidden_size),
            "latents": self.latents,
            "indexer_keys": self.indexer_keys,
            "gates": self.gates,
            "pool_keys": self.pool_keys,
            "rope_keys": self.rope_keys,
        }

    def rewind_to(self, n: int) -> None:
        """Keep rows 0..n-1; drop every pool that is no longer complete."""
        if not 0 <= n <= self.rows:
            raise ValueError(f"rewind_to({n}) outside 0..{self.rows}")
        del self._y[n:], self._c[n:], self._kr[n:], self._k[n:], self._g[n:]
        del self._pool_keys[n // self.cfg.dsa.index_kpool :]

    # ---- the pieces of the math ------------------------------------------------------------------

    def embed_row(self, token: int) -> np.ndarray:
        if not 0 <= int(token) < self.cfg.vocab_size:
            raise ValueError(f"token {token} outside the vocabulary")
        return self.embed[int(token)]

    def block_input(self, token: int, hidden: np.ndarray) -> np.ndarray:
        """x = eh_proj [rmsnorm(embed[t]) * enorm ; rmsnorm(h) * hnorm]."""
        eps = self.cfg.rms_norm_eps
        h = f64(hidden).reshape(self.cfg.hidden_size)
        e = rmsnorm(self.embed_row(token), self.enorm, eps)
        hh = rmsnorm(h, self.hnorm, eps)
        return self.eh_proj @ np.concatenate([e, hh])

    def q_latent(self, y: np.ndarray) -> np.ndarray:
        return rmsnorm(self.q_a @ y, self.q_a_norm, self.cfg.rms_norm_eps)

    def rope(self, x: np.ndarray, pos: int, *, indexer: bool = False) -> np.ndarray:
        """Rotate the rope dims (the last axis) of the MLA's query or key, or with ``indexer`` of
        the indexer's, to position ``pos``."""
        r = self.cfg.attention.rope
        return rope_rotate(
            x,
            pos,
            self.inv_freq,
            interleave=r.indexer_interleave if indexer else r.interleave,
            factor=r.attention_factor,
        )

    def indexer_key(self, y: np.ndarray, pos: int) -> np.ndarray:
        """LayerNorm(wk . y), per-token with its first rope_dim dims rotated to ``pos``."""
        k = layernorm(self.ix_wk @ y, self.ix_ln_w, self.ix_ln_b)
        rd = self.cfg.dsa.rope_dim if self.cfg.dsa.per_token else 0
        if rd:
            k = np.concatenate([self.rope(k[:rd], pos, indexer=True), k[rd:]])
        return k

    def pool_key(self, k: np.ndarray, g: np.ndarray) -> np.ndarray:
        """k, g: [kpool, idim] -> per-dimension softmax over slots of (g + ape) weighting k."""
        wts = softmax(g + self.ix_ape, axis=0)
        return np.sum(wts * k, axis=0)

    def _append(self, token: int, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write row n = rows: latent, indexer key, gate; compress the pool it completes."""
        eps = self.cfg.rms_norm_eps
        n = self.rows  # the new row's index and position
        x = self.block_input(token, hidden)
        y = rmsnorm(x, self.in_norm, eps)
        c = rmsnorm(self.kv_a @ y, self.kv_a_norm, eps)
        k = self.indexer_key(y, n)
        self._y.append(y)
        self._c.append(fp8_rows(c) if self.fp8_cache else c)
        kr = self.rope(self.kv_a_rope @ y, n) if self.inv_freq is not None else np.zeros(0)
        self._kr.append(bf16_rows(kr) if self.fp8_cache else kr)
        self._k.append(k)
        d = self.cfg.dsa
        if d.per_token:  # a pool is one token: its key is the stored key
            self._pool_keys.append(fp8_rows(k) if self.fp8_cache else k)
        else:
            self._g.append(self.ix_gate @ y)
            kp = d.index_kpool
            if (n + 1) % kp == 0:
                s = slice(n + 1 - kp, n + 1)
                key = self.pool_key(np.array(self._k[s]), np.array(self._g[s]))
                self._pool_keys.append(fp8_rows(key) if self.fp8_cache else key)
        assert len(self._pool_keys) == self.rows // d.index_kpool
        return x, y

    def pool_scores(self, y: np.ndarray, n_pools: int, pos: int | None = None) -> np.ndarray:
        """score_p = sum_h w_h relu(q_h . key_p) / sqrt(idim) for pools 0..n_pools-1; the
        per-token indexer's query is rotated to ``pos`` (default: the last row's)."""
        d = self.cfg.dsa
        qi = (self.ix_wq_b @ self.q_latent(y)).reshape(d.index_n_heads, d.index_head_dim)
        if d.per_token and d.rope_dim:
            pos = self.rows - 1 if pos is None else pos
            qi = np.concatenate([self.rope(qi[:, : d.rope_dim], pos, indexer=True), qi[:, d.rope_dim :]], 1)
        w = (self.ix_weights @ y) / math.sqrt(d.index_n_heads)
        keys = self.pool_keys[:n_pools]  # [P, idim]
        rel = np.maximum(qi @ keys.T, 0.0)  # [ih, P]
        return (w @ rel) / math.sqrt(d.index_head_dim)

    def selection(self, n: int | None = None) -> np.ndarray:
        """Sorted rows that row n (already written) attends to: the top ``index_topk / kpool``
        complete pools (all of them when there are no more), plus with always_select_tail the
        rows of the incomplete pool. Without the tail a row before its first complete pool
        attends nothing."""
        if n is None:
            n = self.rows - 1
        if not 0 <= n < self.rows:
            raise ValueError(f"row {n} is not written (rows = {self.rows})")
        d = self.cfg.dsa
        kp, T = d.index_kpool, d.topk_pools
        complete = (n + 1) // kp
        tail = list(range(complete * kp, n + 1)) if d.always_select_tail else []
        if complete <= T:
            pools = list(range(complete))
        else:
            pools = sorted(top_k_desc(self.pool_scores(self._y[n], complete, n), T))
        sel = [p * kp + s for p in pools for s in range(kp)] + tail
        return np.array(sel, dtype=np.int64)

    def shared_selection(self, first: np.ndarray, n_first: int, n: int) -> np.ndarray:
        """The selection of row n drafted after row n_first in one propose, when drafts share
        draft 1's selection (index_share_for_mtp_iteration): draft 1's rows, and with the tail
        every row drafted since (n_first + 1 .. n)."""
        extra = range(n_first + 1, n + 1) if self.cfg.dsa.always_select_tail else range(0)
        return np.concatenate([first, np.array(list(extra), dtype=np.int64)])

    def attention(self, y: np.ndarray, rows: np.ndarray, pos: int | None = None) -> np.ndarray:
        """Absorbed MLA over the given latent rows (with their rope keys where the MLA has a rope
        part, the query rotated to ``pos``, default the last row's); returns o_proj output [H]
        (zero over no rows: softmax over an empty set attends nothing)."""
        a = self.cfg.attention
        if len(rows) == 0:
            return np.zeros(self.cfg.hidden_size)
        ql = self.q_latent(y)
        q = (self.q_b @ ql).reshape(a.num_attention_heads, a.qk_nope_head_dim)
        qa = np.einsum("hdk,hd->hk", self.w_uk, q)  # [nh, kl]
        c = self.latents[rows]  # [S, kl]
        s = qa @ c.T  # [nh, S]
        if self.inv_freq is not None:
            pos = self.rows - 1 if pos is None else pos
            qr = self.rope((self.q_b_rope @ ql).reshape(a.num_attention_heads, a.qk_rope_head_dim), pos)
            s = s + qr @ self.rope_keys[rows].T
        p = softmax(s * a.softmax_scale, axis=-1)  # [nh, S]
        o_lat = p @ c  # [nh, kl]
        o = np.einsum("hvk,hk->hv", self.w_uv, o_lat)  # [nh, v]
        return self.o_proj @ o.reshape(-1)

    def route(self, y2: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Chosen experts (by score + bias; group-limited where n_group > 1: only the experts of
        the topk_group groups of the highest sum of their two best biased scores) and their weights
        (from the unbiased scores)."""
        m = self.cfg.moe
        scores = sigmoid(self.router @ y2)
        choice = scores + self.router_bias
        if m.n_group > 1:
            per = m.n_routed_experts // m.n_group
            groups = choice.reshape(m.n_group, per)
            best2 = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
            keep = top_k_desc(best2, m.topk_group)
            masked = np.full(m.n_group, True)
            masked[keep] = False
            choice = np.where(np.repeat(masked, per), -np.inf, choice)
        chosen = top_k_desc(choice, m.num_experts_per_tok)
        w = scores[chosen]
        if m.norm_topk_prob:
            w = w / np.sum(w)
        return chosen, w * m.routed_scaling_factor

    def moe(self, y2: np.ndarray) -> np.ndarray:
        L = self.cfg.moe.swiglu_limit
        chosen, w = self.route(y2)
        out = np.zeros(self.cfg.hidden_size)
        for e, we in zip(chosen, w):
            out += we * clamped_swiglu(y2, *self.experts[e], L)
        if self.shared is not None:  # weight 1: the shared expert has no gate
            out += clamped_swiglu(y2, *self.shared, L)
        return out

    def block(self, x: np.ndarray, y: np.ndarray, rows: np.ndarray) -> np.ndarray:
        h1 = x + self.attention(y, rows)
        return h1 + self.moe(rmsnorm(h1, self.post_norm, self.cfg.rms_norm_eps))

    def head_logits(self, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xn = rmsnorm(out, self.head_norm, self.cfg.rms_norm_eps)
        return self.head @ xn, xn

    # ---- the public drafter API ------------------------------------------------------------------

    def context_row(self, token: int, hidden: np.ndarray) -> None:
        self._append(token, hidden)

    def feed(self, tokens, hiddens) -> None:
        """Context rows for consecutive (token, hidden) pairs."""
        for t, h in zip(tokens, hiddens, strict=True):
            self._append(int(t), h)

    def draft_row(
        self, token: int, hidden: np.ndarray, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Append a row and run it through the block over ``rows`` (default: its own selection)."""
        x, y = self._append(token, hidden)
        out = self.block(x, y, self.selection() if rows is None else rows)
        return self.head_logits(out)

    def propose(
        self, last_token: int, target_hidden: np.ndarray, k: int, *, position: int | None = None
    ) -> tuple[list[int], np.ndarray, np.ndarray]:
        """k drafts; draft 1 writes row ``position`` (default: the current length).

        A drafter ahead of ``position`` is rewound to it; one behind it refuses.
        """
        if k < 1:
            raise ValueError("k must be >= 1")
        if position is not None:
            if position > self.rows:
                raise ValueError(f"drafter has {self.rows} rows, behind position {position}")
            self.rewind_to(position)
        drafts, logits, hiddens = [], [], []
        tok, hid = int(last_token), target_hidden
        n_first, first = self.rows, None
        for i in range(k):
            rows = None
            if i > 0 and self.cfg.dsa.share_for_mtp_iteration:
                rows = self.shared_selection(first, n_first, n_first + i)
            lg, xn = self.draft_row(tok, hid, rows)
            if i == 0:  # draft 1's own selection, once its row is written
                first = self.selection(n_first)
            tok, hid = argmax_lowest(lg), xn
            drafts.append(tok)
            logits.append(lg)
            hiddens.append(xn)
        self._draft_rows = k
        return drafts, np.array(logits), np.array(hiddens)

    def after_verify(self, accepted: int) -> None:
        """Keep min(drafted, accepted + 1) of the rows the last propose wrote."""
        k = self._draft_rows
        if k == 0:
            raise RuntimeError("after_verify without a propose")
        keep = min(k, max(0, int(accepted)) + 1)
        self.rewind_to(self.rows - k + keep)
        self._draft_rows = 0


# ---- random weights for tests --------------------------------------------------------------------


def random_mtp_weights(cfg: ModelConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random weights of the block's names and shapes, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    a, d, m = cfg.attention, cfg.dsa, cfg.moe
    H, V = cfg.hidden_size, cfg.vocab_size
    P = f"model.layers.{cfg.num_hidden_layers}."
    A, X, M = P + "self_attn.", P + "self_attn.indexer.", P + "mlp."
    nh, nope, v, ql, kl = (
        a.num_attention_heads,
        a.qk_nope_head_dim,
        a.v_head_dim,
        a.q_lora_rank,
        a.kv_lora_rank,
    )
    ih, idim = d.index_n_heads, d.index_head_dim
    E, I = m.n_routed_experts, m.moe_intermediate_size

    def lin(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) / math.sqrt(i)).astype(dtype)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(dtype)

    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(dtype),
        "lm_head.weight": lin(V, H),
        P + "enorm.weight": norm(H),
        P + "hnorm.weight": norm(H),
        P + "eh_proj.weight": lin(H, 2 * H),
        P + "input_layernorm.weight": norm(H),
        P + "post_attention_layernorm.weight": norm(H),
        P + "shared_head.norm.weight": norm(H),
        A + "q_a_proj.weight": lin(ql, H),
        A + "q_a_layernorm.weight": norm(ql),
        A + "q_b_proj.weight": lin(nh * (nope + a.qk_rope_head_dim), ql),
        A + "kv_a_proj_with_mqa.weight": lin(kl + a.qk_rope_head_dim, H),
        A + "kv_a_layernorm.weight": norm(kl),
        A + "kv_b_proj.weight": lin(nh * (nope + v), kl),
        A + "o_proj.weight": lin(H, nh * v),
        X + "wq_b.weight": lin(ih * idim, ql),
        X + "wk.weight": lin(idim, H),
        X + "weights_proj.weight": lin(ih, H),
        X + "k_norm.weight": norm(idim),
        X + "k_norm.bias": (0.1 * rng.standard_normal(idim)).astype(dtype),
    }
    if not d.per_token:  # drawn here, in the order the KPool tests' seeds were set with
        w[X + "index_kpool_compress_gate"] = lin(idim, H)
        w[X + "index_kpool_compress_ape"] = rng.standard_normal((d.index_kpool, idim)).astype(dtype)
    w |= {
        M + "gate.weight": lin(E, H),
        M + "gate.e_score_correction_bias": (0.1 * rng.standard_normal(E)).astype(np.float32),
    }
    for e in range(E):
        w[M + f"experts.{e}.gate_proj.weight"] = lin(I, H)
        w[M + f"experts.{e}.up_proj.weight"] = lin(I, H)
        w[M + f"experts.{e}.down_proj.weight"] = lin(H, I)
    if m.n_shared_experts:
        w[M + "shared_experts.gate_proj.weight"] = lin(I, H)
        w[M + "shared_experts.up_proj.weight"] = lin(I, H)
        w[M + "shared_experts.down_proj.weight"] = lin(H, I)
    return w
