"""Launch harness for the batched projection kernels (tests/test_batch_proj.py on the host backend,
tests/test_gpu_batch_proj.py on the device): every scenario runs on any backend from NumPy inputs
and returns NumPy outputs, so the same code gives the host twin's answer and the PTX's.

Every buffer is poisoned (0xFF: NaN in BF16 and f32) before its inputs are copied in, with GUARD
poisoned bytes after it that must survive: an output element the kernel should write and did not
shows as NaN, one it must not write (a padding row, a flag byte) keeps its poison or its value, and
a write past the end breaks the guard.

``single_*`` helpers launch each row alone (m = 1, pointers offset to that row) into one full-size
poisoned buffer, which is what the batch must reproduce bit for bit, row for row.
"""

from __future__ import annotations

import numpy as np
from kernel_util import abs_dot, dot_bound

from model.kernels import bgemv as bg
from model.kernels import mtp_input as mi
from model.kernels.batch import ENTRY_BYTES, PAD_SLOT, pack_entries
from runtime.dtypes import BF16
from runtime.kernels.gemv_bf16 import gemv_bf16_batch

GUARD = 16
EPS = 1e-5


class Bufs:
    """Allocations of one scenario on one backend, each poisoned with a guard after it."""

    def __init__(self, gpu):
        self.gpu = gpu
        self._allocs = []
        self._size: dict[int, int] = {}

    def put(self, arr: np.ndarray, misalign: int = 0):
        arr = np.ascontiguousarray(arr)
        p = self.poison(arr.nbytes, misalign)
        if arr.nbytes:
            self.gpu.copy_h2d(p, arr)
        return p

    def poison(self, nbytes: int, misalign: int = 0):
        base = self.gpu.alloc(nbytes + misalign + GUARD)
        self._allocs.append(base)
        self.gpu.memset(base, 0xFF, nbytes + misalign + GUARD)
        p = base.offset(misalign)
        self._size[p.addr] = nbytes
        return p

    def get(self, p) -> np.ndarray:
        """The buffer's bytes (uint8), after checking that its guard is intact."""
        self.gpu.synchronize()
        n = self._size[p.addr]
        raw = np.empty(n + GUARD, np.uint8)
        self.gpu.copy_d2h(raw, p)
        assert (raw[n:] == 0xFF).all(), "the kernel wrote past the end of a buffer"
        return raw[:n]

    def reset(self, p, arr: np.ndarray | None = None) -> None:
        """Poison the buffer again (and copy ``arr`` in)."""
        self.gpu.memset(p, 0xFF, self._size[p.addr])
        if arr is not None:
            self.gpu.copy_h2d(p, np.ascontiguousarray(arr))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.gpu.synchronize()
        for p in self._allocs:
            self.gpu.free(p)
        self._allocs.clear()


def bf16_rows(raw: np.ndarray, m: int) -> np.ndarray:
    return raw.view(BF16).reshape(m, -1)


def norm_gemv_bound(xn: np.ndarray, w: np.ndarray, ref: np.ndarray, k: int) -> np.ndarray:
    """dot_bound (GPU against twin: two roundings and two f32 accumulations) plus one BF16 ulp
    (2**-7 relative) on every normalised input element, which the device's norm (another summation
    order) may round the other way. xn [m, k] or [k]."""
    xn = np.atleast_2d(xn)
    absd = abs_dot(xn, w)
    return dot_bound(absd, ref, k, roundings=2) + 2.0**-7 * absd


# ---- gemv_bf16_batch -------------------------------------------------------------------------------


def gemv_batch(gpu, w: np.ndarray, x: np.ndarray, mis: int = 0) -> np.ndarray:
    """y [m, n] BF16 of one m-row launch."""
    m, k = x.shape
    n = w.shape[0]
    with Bufs(gpu) as b:
        pw, px, py = b.put(w), b.put(x, mis), b.poison(m * n * 2)
        gemv_bf16_batch(gpu, pw, px, py, m, n, k)
        return bf16_rows(b.get(py), m)


def gemv_single(gpu, w: np.ndarray, x: np.ndarray, mis: int = 0) -> np.ndarray:
    """y [m, n] from m launches of one row each (m = 1, pointers at row e)."""
    m, k = x.shape
    n = w.shape[0]
    with Bufs(gpu) as b:
        pw, px, py = b.put(w), b.put(x, mis), b.poison(m * n * 2)
        for e in range(m):
            gemv_bf16_batch(gpu, pw, px.offset(e * k * 2), py.offset(e * n * 2), 1, n, k)
        return bf16_rows(b.get(py), m)


# ---- mtp_input ---------------------------------------------------------------------------------------


class MtpCase:
    """Inputs of one mtp_input_gemv_batch / mtp_embed_norm_batch launch: m entries (some padding,
    some with tokens outside the vocabulary, some hidden rows not finite, as the caller makes them)."""

    def __init__(self, rng, m, n, h, vocab, *, pad=(), bad_token=(), bad_hidden=(), flag_byte=1):
        self.m, self.n, self.h, self.vocab, self.flag_byte = m, n, h, vocab, flag_byte
        from kernel_util import random_bf16

        self.table = random_bf16(rng, (vocab, h))
        self.enorm = random_bf16(rng, h, exp_lo=-1)
        self.hnorm = random_bf16(rng, h, exp_lo=-1)
        self.w = random_bf16(rng, (n, 2 * h), exp_lo=-8)
        self.hidden = random_bf16(rng, (m, h))
        for e, v in bad_hidden:
            self.hidden[e, int(rng.integers(h))] = v
        tokens = rng.integers(0, vocab, m).astype(np.uint32)
        for e, t in bad_token:
            tokens[e] = t
        slots = rng.permutation(1000)[:m].astype(np.uint32)
        self.entries = pack_entries(slots, rng.integers(0, 5000, m), tokens)
        self.entries[list(pad), 0] = PAD_SLOT
        # Nonzero flag bytes: a byte the kernel must leave alone keeps 0xA5, one it sets shows its bits.
        self.flags = np.full(4 * m, 0xA5, np.uint8)

    @property
    def live(self) -> np.ndarray:
        return self.entries[:, 0] != PAD_SLOT

    def shuffled(self, perm: np.ndarray) -> MtpCase:
        c = object.__new__(MtpCase)
        c.__dict__.update(self.__dict__)
        c.entries, c.hidden, c.m = self.entries[perm], self.hidden[perm], len(perm)
        c.flags = self.flags.reshape(-1, 4)[perm].reshape(-1).copy()
        return c


def mtp_input(gpu, c: MtpCase, *, single: bool = False, mis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(y [m, n] BF16, flags [m * 4] u8) of one m-entry launch, or of m launches of one entry each."""
    m, n, h = c.m, c.n, c.h
    with Bufs(gpu) as b:
        table, ents = b.put(c.table), b.put(c.entries)
        enorm, hnorm, w = b.put(c.enorm), b.put(c.hnorm), b.put(c.w)
        hidden, y, flags = b.put(c.hidden, mis), b.poison(m * n * 2), b.put(c.flags)
        rows = [(e, 1) for e in range(m)] if single else [(0, m)]
        for e, mm in rows:
            mi.mtp_input_gemv_batch(
                gpu,
                table=table,
                entries=ents.offset(e * ENTRY_BYTES),
                enorm=enorm,
                hidden=hidden.offset(e * h * 2),
                hnorm=hnorm,
                w=w,
                y=y.offset(e * n * 2),
                m=mm,
                vocab=c.vocab,
                h=h,
                n=n,
                eps=EPS,
                flags=flags.offset(e * 4),
                flag_byte=c.flag_byte,
            )
        return bf16_rows(b.get(y), m), b.get(flags)


def mtp_embed_norm(gpu, c: MtpCase, *, single: bool = False, mis: int = 0) -> np.ndarray:
    """out [m, 2h] BF16 of one m-entry launch of mtp_embed_norm_batch (or m single ones)."""
    m, h = c.m, c.h
    with Bufs(gpu) as b:
        table, ents = b.put(c.table), b.put(c.entries)
        enorm, hnorm = b.put(c.enorm), b.put(c.hnorm)
        hidden, out = b.put(c.hidden, mis), b.poison(m * 2 * h * 2)
        for e, mm in [(e, 1) for e in range(m)] if single else [(0, m)]:
            mi.mtp_embed_norm_batch(
                gpu,
                table=table,
                entries=ents.offset(e * ENTRY_BYTES),
                enorm=enorm,
                hidden=hidden.offset(e * h * 2),
                hnorm=hnorm,
                out=out.offset(e * 2 * h * 2),
                m=mm,
                vocab=c.vocab,
                h=h,
                eps=EPS,
            )
        return bf16_rows(b.get(out), m)


# ---- bgemv.py's batched kernels ----------------------------------------------------------------------


def bgemv(
    gpu, w: np.ndarray, x: np.ndarray, *, out_f32: bool, beside=False, single=False, mis=0
) -> np.ndarray:
    """y [m, heads, n] (f32 or BF16) for w [heads, n, k], x [m, heads, k]."""
    heads, n, k = w.shape
    m = x.shape[0]
    isz = 4 if out_f32 else 2
    with Bufs(gpu) as b:
        pw, px, py = b.put(w), b.put(x, mis), b.poison(m * heads * n * isz)
        for e, mm in [(e, 1) for e in range(m)] if single else [(0, m)]:
            bg.bgemv_batch(
                gpu,
                w=pw,
                x=px.offset(e * heads * k * 2),
                y=py.offset(e * heads * n * isz),
                m=mm,
                heads=heads,
                n=n,
                k=k,
                out_f32=out_f32,
                beside=beside,
            )
        return b.get(py).view(np.float32 if out_f32 else BF16).reshape(m, heads, n)


def sum_rows(gpu, parts: np.ndarray, res: np.ndarray, norm_w=None, *, single=False):
    """out [m, n] (and normed [m, n] with ``norm_w``) for parts [m, rows, n], res [m, n]."""
    m, rows, n = parts.shape
    with Bufs(gpu) as b:
        pp, pr, po = b.put(parts), b.put(res), b.poison(m * n * 2)
        pn = b.put(norm_w) if norm_w is not None else None
        pz = b.poison(m * n * 2) if norm_w is not None else None
        for e, mm in [(e, 1) for e in range(m)] if single else [(0, m)]:
            at = dict(
                parts=pp.offset(e * rows * n * 4), residual=pr.offset(e * n * 2), out=po.offset(e * n * 2)
            )
            if norm_w is None:
                bg.sum_rows_residual_batch(gpu, **at, m=mm, rows=rows, n=n)
            else:
                bg.sum_rows_residual_rmsnorm_batch(
                    gpu, **at, norm_w=pn, normed=pz.offset(e * n * 2), m=mm, rows=rows, n=n, eps=EPS
                )
        out = bf16_rows(b.get(po), m)
        return out if norm_w is None else (out, bf16_rows(b.get(pz), m))
