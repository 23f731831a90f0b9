"""Rotary position embedding (RoPE) of the MLA queries and keys and of the plain indexer's
(GLM-5 ``glm_moe_dsa``, DeepSeek-V3.2 ``deepseek_v32``), in one definition: ``rope_ref`` here, the
device helpers of ptx/rope.cuh, used by ``rope_q_batch`` (ptx/rope.cu) and
``dsa_cache_write_plain_batch`` (ptx/dsa_cache.cu, model/kernels/dsa_cache.py).

The caller uploads ``inv_freq``: float32, one value per pair (rope_dim / 2), whatever scaling
(YaRN, ...) the checkpoint's config asks for already folded in; ``attn_factor`` scales cos and sin.
Pair i of a row at position pos turns by ``angle = f32(pos) * inv_freq[i]``, one float32 multiply
(its rounding is part of the definition: at pos ~ 1e6 one float32 ulp of the angle is 0.06 rad),
``c = cos(angle) * attn_factor``, ``s = sin(angle) * attn_factor``:
``(x0, x1) -> (x0 c - x1 s, x1 c + x0 s)``. Interleaved rows pair ``(x[2i], x[2i+1])``, half-split
rows ``(x[i], x[i + rope_dim/2])``; the results go back to the pair's own places (nothing is
de-interleaved). Every operation in float32, each rounded on its own (no fused multiply-add).
"""

from __future__ import annotations

import numpy as np

from runtime.dtypes import BF16
from runtime.kernel import F32, PTR, U32, declare
from runtime.launch import launch

from .batch import is_pad, read_entries


def rope_ref(x, pos, inv_freq, attn_factor: float, interleave: bool) -> np.ndarray:
    """x [..., rope_dim] (any float dtype) rotated at position(s) ``pos`` (an integer, or an array
    broadcasting against ``x.shape[:-1]``) -> a new float32 array."""
    inv = np.asarray(inv_freq, np.float32).reshape(-1)
    out = np.array(x, np.float32)
    if out.shape[-1] != 2 * inv.size:
        raise ValueError(f"rope_ref: rows of {out.shape[-1]} elements, inv_freq of {inv.size} pairs")
    half = inv.size
    # u32 positions to float32 with round to nearest, as the kernels' __uint2float_rn.
    angle = np.asarray(pos, np.float64).astype(np.float32)[..., None] * inv
    af = np.float32(attn_factor)
    c, s = np.cos(angle) * af, np.sin(angle) * af
    if interleave:
        x0, x1 = out[..., 0::2].copy(), out[..., 1::2].copy()
        out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x1 * c + x0 * s
    else:
        x0, x1 = out[..., :half].copy(), out[..., half:].copy()
        out[..., :half], out[..., half:] = x0 * c - x1 * s, x1 * c + x0 * s
    return out


def rope_dims_ok(rope_dim: int, irope_dim: int, idim: int) -> bool:
    """ptx/rope.cuh's rope_dims_ok: whole pairs, and an indexer part either unrotated or rotated
    with the same table inside its head. The kernels write nothing for other dims."""
    return rope_dim % 2 == 0 and irope_dim in (0, rope_dim) and irope_dim <= idim


def check_rope_dims(what: str, rope_dim: int, irope_dim: int, idim: int) -> None:
    if rope_dim < 0 or irope_dim < 0 or not rope_dims_ok(rope_dim, irope_dim, idim):
        raise ValueError(
            f"{what}: rope_dim {rope_dim} / irope_dim {irope_dim} / idim {idim}: RoPE needs an even "
            f"rope_dim and irope_dim either 0 or rope_dim, at most idim (one inv_freq table)"
        )


def rope_launch_args(
    what: str, rope_dim: int, irope_dim: int, idim: int, interleave, i_interleave
) -> tuple[int, int]:
    """The launch helpers' shared check of the rope dims, and the two layout flags as the kernels'
    U32 0 / 1 (a bool is accepted)."""
    check_rope_dims(what, rope_dim, irope_dim, idim)
    flags = []
    for name, v in (("interleave", interleave), ("i_interleave", i_interleave)):
        if v not in (0, 1):  # True / False too
            raise ValueError(f"{what}: {name}={v!r} is not 0 / 1")
        flags.append(int(v))
    return flags[0], flags[1]


@declare(
    "rope",
    "rope_q_batch",
    [
        ("q", PTR),
        ("q_stride", U32),
        ("heads", U32),
        ("nope", U32),
        ("rope_dim", U32),
        ("iq_offset", U32),
        ("iheads", U32),
        ("idim", U32),
        ("irope_dim", U32),
        ("inv_freq", PTR),
        ("attn_factor", F32),
        ("interleave", U32),
        ("i_interleave", U32),
        ("q_nope", PTR),
        ("q_rope", PTR),
        ("entries", PTR),
        ("m", U32),
        ("row_add", U32),
    ],
    writes=("q", "q_nope", "q_rope"),
    pdl=True,
)
def ROPE_Q_BATCH(
    mem,
    q,
    q_stride,
    heads,
    nope,
    rope_dim,
    iq_offset,
    iheads,
    idim,
    irope_dim,
    inv_freq,
    attn_factor,
    interleave,
    i_interleave,
    q_nope,
    q_rope,
    entries,
    m,
    row_add,
):
    """Entry e (position entries[e].row + row_add): its MLA heads split into q_nope (copied) and
    q_rope (rotated, BF16), its indexer heads' first irope_dim dims rotated in place in q."""
    if not rope_dims_ok(rope_dim, irope_dim, idim):
        return
    inv = mem.read(inv_freq, np.float32, rope_dim // 2)
    qk = nope + rope_dim
    for e, ent in enumerate(read_entries(mem, entries, m)):
        if is_pad(ent):
            continue
        pos = (int(ent[1]) + row_add) & 0xFFFFFFFF  # the kernel's u32 sum
        row = q.offset(e * q_stride * 2)
        mla = mem.read(row, BF16, (heads, qk))
        mem.write(q_nope.offset(e * heads * nope * 2), np.ascontiguousarray(mla[:, :nope]))
        rot = rope_ref(mla[:, nope:], pos, inv, attn_factor, bool(interleave))
        mem.write(q_rope.offset(e * heads * rope_dim * 2), rot.astype(BF16))
        if irope_dim and iheads:
            ih = row.offset(iq_offset * 2)
            iq = mem.read(ih, BF16, (iheads, idim))
            iq[:, :irope_dim] = rope_ref(iq[:, :irope_dim], pos, inv, attn_factor, bool(i_interleave)).astype(
                BF16
            )
            mem.write(ih, iq)


ROPE_Q_WARPS = 4  # ptx/rope.cu: one warp per head, ROPE_Q_WARPS heads per block


def rope_q_batch(
    gpu,
    *,
    q,
    q_stride,
    heads,
    nope,
    rope_dim,
    iq_offset,
    iheads,
    idim,
    irope_dim,
    inv_freq,
    attn_factor,
    interleave,
    i_interleave,
    q_nope,
    q_rope,
    entries,
    m,
    row_add,
    stream=None,
):
    """The query side of rotary attention for ``m`` batch entries (model/kernels/batch.py).

    Entry e's q row (``q + e * q_stride`` elements, BF16) holds ``heads`` MLA heads of
    ``[nope ; rope_dim]``, then at element ``iq_offset`` ``iheads`` indexer heads of ``idim``. At
    position ``entries[e].row + row_add``: ``q_nope[e, h] = q[e, h, :nope]``,
    ``q_rope[e, h] = bf16(rope(q[e, h, nope:], interleave))`` (both ``[m, heads, ...]`` BF16), and
    each indexer head's first ``irope_dim`` dims (0 or rope_dim) are replaced in q by
    ``bf16(rope(., i_interleave))``. ``inv_freq``: rope_dim / 2 float32 values. Padding entries read
    and write nothing."""
    what = "rope_q_batch"
    interleave, i_interleave = rope_launch_args(what, rope_dim, irope_dim, idim, interleave, i_interleave)
    if m < 1 or heads < 1:  # a catch-up chunk may hold more entries than a draft batch (grid.x is m)
        raise ValueError(f"{what}: m={m} entries, heads={heads}")
    mla_end = heads * (nope + rope_dim)
    rotated = irope_dim > 0 and iheads > 0
    # The in-place rotation must not reach what another warp reads: the MLA heads of the row, or
    # (m > 1) another entry's row.
    if rotated and iq_offset < mla_end:
        raise ValueError(f"{what}: indexer heads at {iq_offset} overlap the MLA heads (0..{mla_end})")
    row_end = max(mla_end, iq_offset + iheads * idim if rotated else 0)
    if m > 1 and q_stride < row_end:
        raise ValueError(f"{what}: q_stride {q_stride} below the row's {row_end} elements")
    units = heads + (iheads if rotated else 0)
    launch(
        gpu,
        gpu.kernel(*ROPE_Q_BATCH.key),
        (m, -(-units // ROPE_Q_WARPS)),
        32 * ROPE_Q_WARPS,
        q,
        q_stride,
        heads,
        nope,
        rope_dim,
        iq_offset,
        iheads,
        idim,
        irope_dim,
        inv_freq,
        attn_factor,
        interleave,
        i_interleave,
        q_nope,
        q_rope,
        entries,
        m,
        row_add,
        stream=stream,
    )
