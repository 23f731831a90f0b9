"""Cases and checks shared by the batched draft head's tests (test_batch_head.py on the host twins,
test_gpu_batch_head.py on the PTX): a batch of entries with padding in random places, every buffer
poisoned with guard bytes after it, and the commit contract checked entry by entry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from model.kernels import draft_head
from model.kernels.batch import ENTRY_WORDS, PAD_SLOT
from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16, quantize_rows_fp8

GUARD = 16
POISON = 0xFF
TOKEN_BEFORE = 0xDEAD_BEEF  # the token word of every entry before the launch


def run_bufs(
    gpu, fn: Callable[..., None], bufs: dict[str, np.ndarray | int | DevicePtr]
) -> dict[str, np.ndarray]:
    """Allocate every buffer with GUARD bytes after it, poison it all (0xFF), upload the arrays
    (ints are output sizes in bytes), call ``fn(gpu, **pointers)``, return every buffer's bytes
    without the guards, after checking that the guards are intact. A DevicePtr (weights uploaded
    once for many launches) is passed through as it is and not returned."""
    ptrs, allocs, sizes = {}, [], {}
    for name, v in bufs.items():
        if isinstance(v, DevicePtr):
            ptrs[name] = v
            continue
        nbytes = v.nbytes if isinstance(v, np.ndarray) else int(v)
        base = gpu.alloc(nbytes + GUARD)
        allocs.append(base)
        gpu.memset(base, POISON, nbytes + GUARD)
        ptrs[name] = base
        sizes[name] = nbytes
        if isinstance(v, np.ndarray) and v.nbytes:
            gpu.copy_h2d(base, np.ascontiguousarray(v))
    try:
        fn(gpu, **ptrs)
        out = {}
        for name, nbytes in sizes.items():
            p = ptrs[name]
            buf = np.empty(nbytes + GUARD, np.uint8)
            gpu.copy_d2h(buf, p)
            out[name] = buf
    finally:
        for p in allocs:
            gpu.free(p)
    for name, buf in out.items():
        assert (buf[-GUARD:] == POISON).all(), f"{name}: the kernel wrote past the end of the buffer"
        out[name] = buf[:-GUARD]
    return out


def make_entries(rng: np.random.Generator, m: int, pads: int) -> np.ndarray:
    """u32 [m, 4]: m - pads live entries with distinct slots, `pads` padding entries in random
    places; every token word TOKEN_BEFORE, rows and reserved words random (the head leaves them)."""
    ent = rng.integers(0, 2**32, (m, ENTRY_WORDS), dtype=np.uint64).astype(np.uint32)
    ent[:, 0] = rng.choice(4096, m, replace=False)
    ent[rng.choice(m, pads, replace=False), 0] = PAD_SLOT
    ent[:, 2] = TOKEN_BEFORE
    return ent


@dataclass
class HeadCase:
    """One batched head launch: weights (w BF16, or q FP8 with per-row scales s), x [m][k], the
    entries, the drafts of earlier launches, and the draft index / kmax / publish / flag byte."""

    w: np.ndarray
    s: np.ndarray | None
    x: np.ndarray
    entries: np.ndarray
    drafts: np.ndarray
    draft_index: int
    kmax: int
    publish: bool
    flag_byte: int
    mma: bool = False  # launch the tensor-core variant (head_argmax_batch_mma)
    mma_v1: bool = False  # with mma: through head_argmax_fp8_mma_v1, the kernel it replaced

    @property
    def m(self) -> int:
        return self.x.shape[0]

    @property
    def n(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.x.shape[1]

    @property
    def live(self) -> list[int]:
        return [e for e in range(self.m) if int(self.entries[e, 0]) != PAD_SLOT]

    def bufs(self) -> dict[str, np.ndarray | int]:
        b: dict[str, np.ndarray | int] = {
            "w": self.w,
            "x": self.x,
            "logits": 2 * self.m * self.n,
            "keys": np.zeros(self.m, np.uint64),
            "ctr": np.zeros(1, np.uint32),
            "entries": self.entries,
            "drafts": self.drafts,
            "host": 4 * self.m * self.kmax,
            "flags": np.zeros((self.m, 4), np.uint8),
        }
        if self.s is not None:
            b["sc"] = self.s
        return b

    def launch(self, gpu, w, x, logits, keys, ctr, entries, drafts, host, flags, sc=None) -> None:
        head = draft_head.head_argmax_batch_mma if self.mma else draft_head.head_argmax_batch
        extra = {"v1": True} if self.mma and self.mma_v1 else {}
        head(
            gpu,
            **extra,
            w=w,
            scale=sc,
            x=x,
            logits=logits,
            keys=keys,
            counter=ctr,
            entries=entries,
            drafts=drafts,
            draft_index=self.draft_index,
            kmax=self.kmax,
            host_drafts=host,
            publish=self.publish,
            m=self.m,
            n=self.n,
            k=self.k,
            flags=flags,
            flag_byte=self.flag_byte,
        )

    def run(self, gpu, resident: dict[str, DevicePtr] | None = None) -> dict[str, np.ndarray]:
        """One launch on ``gpu``; ``resident``: the weights already there ("w", and "sc" for FP8)."""
        return run_bufs(gpu, self.launch, {**self.bufs(), **(resident or {})})

    def row(self, e: int, slot: int = 7) -> HeadCase:
        """Entry e alone (m = 1, live, the same drafts row)."""
        ent = self.entries[e : e + 1].copy()
        ent[0, 0] = slot
        return replace(self, x=self.x[e : e + 1].copy(), entries=ent, drafts=self.drafts[e : e + 1].copy())

    def subset(self, order: list[int], pad_at: list[int] | None = None) -> tuple[HeadCase, list[int]]:
        """The rows ``order`` of this case as a new batch, with padding entries inserted before the
        positions in ``pad_at``; returns the case and, per new row, the old row (-1 for padding)."""
        rows: list[int] = []
        pad_at = sorted(pad_at or [])
        for j, e in enumerate(order):
            rows.extend([-1] * sum(1 for p in pad_at if p == j))
            rows.append(e)
        rows.extend([-1] * sum(1 for p in pad_at if p >= len(order)))
        src = [max(r, 0) for r in rows]
        ent = self.entries[src].copy()
        ent[[j for j, r in enumerate(rows) if r < 0], 0] = PAD_SLOT
        return replace(self, x=self.x[src].copy(), entries=ent, drafts=self.drafts[src].copy()), rows


def head_case(
    rng: np.random.Generator,
    fp8: bool,
    m: int,
    n: int,
    k: int,
    pads: int = 0,
    draft_index: int = 1,
    kmax: int = 4,
    publish: bool = True,
    flag_byte: int = 2,
    w: np.ndarray | None = None,
    wq: tuple[np.ndarray, np.ndarray] | None = None,
) -> HeadCase:
    """Random weights (normal draws: a wide spread of exponents, so summation order shows in the
    low bits, as tests/test_shard_slices.py does) unless given, random x rows, earlier drafts in
    drafts[e][0 .. draft_index - 1] and poison after them."""
    if w is None and wq is None:
        w = rng.standard_normal((n, k)).astype(BF16)
    if fp8:
        q, s = wq if wq is not None else quantize_rows_fp8(np.asarray(w, np.float32))
        weights, scales = q, s
    else:
        weights, scales = w, None
    x = rng.standard_normal((m, k)).astype(BF16)
    drafts = np.full((m, kmax), 0xFFFF_FFFF, np.uint32)
    drafts[:, :draft_index] = rng.integers(0, n, (m, draft_index))
    return HeadCase(
        weights, scales, x, make_entries(rng, m, pads), drafts, draft_index, kmax, publish, flag_byte
    )


def as_u32(buf: np.ndarray, shape) -> np.ndarray:
    return buf.view(np.uint32).reshape(shape)


def logits_of(case: HeadCase, out: dict[str, np.ndarray]) -> np.ndarray:
    return out["logits"].view(BF16).reshape(case.m, case.n)


def token_of(case: HeadCase, out: dict[str, np.ndarray], e: int) -> int:
    return int(as_u32(out["entries"], (case.m, ENTRY_WORDS))[e, 2])


def flag_of(case: HeadCase, out: dict[str, np.ndarray], e: int) -> int:
    return int(out["flags"].reshape(case.m, 4)[e, case.flag_byte])


def check_commit(case: HeadCase, out: dict[str, np.ndarray]) -> None:
    """The commit contract, entry by entry: a live entry's token word equals drafts[e][draft_index]
    and is a valid index, the other entry words and the earlier drafts are unchanged, with publish
    exactly drafts[e][0 .. draft_index] reach the host copy (nothing past them), and only the flag
    byte may be raised; a padding entry's entry, drafts, host copy and flags are untouched. keys and
    the counter are zero again."""
    m, kmax, i = case.m, case.kmax, case.draft_index
    ent = as_u32(out["entries"], (m, ENTRY_WORDS))
    drafts = as_u32(out["drafts"], (m, kmax))
    host = out["host"].reshape(m, kmax * 4)
    flags = out["flags"].reshape(m, 4)
    for e in range(m):
        live = int(case.entries[e, 0]) != PAD_SLOT
        what = f"entry {e} of {m} ({'live' if live else 'padding'})"
        same_words = [0, 1, 3] if live else [0, 1, 2, 3]
        assert (ent[e, same_words] == case.entries[e, same_words]).all(), f"{what}: entry words changed"
        if not live:
            assert (drafts[e] == case.drafts[e]).all(), f"{what}: drafts written"
            assert (host[e] == POISON).all(), f"{what}: host drafts written"
            assert not flags[e].any(), f"{what}: flags written"
            continue
        t = int(ent[e, 2])
        assert t != TOKEN_BEFORE and 0 <= t < case.n, f"{what}: token {t:#x} is not a committed index"
        assert int(drafts[e, i]) == t, f"{what}: drafts[{i}] != token"
        keep = [j for j in range(kmax) if j != i]
        assert (drafts[e, keep] == case.drafts[e, keep]).all(), f"{what}: other drafts changed"
        if case.publish:
            got = host[e, : 4 * (i + 1)].view(np.uint32)
            assert (got == drafts[e, : i + 1]).all(), (
                f"{what}: host copy {got} != drafts {drafts[e, : i + 1]}"
            )
            assert (host[e, 4 * (i + 1) :] == POISON).all(), f"{what}: host drafts written past draft {i}"
        else:
            assert (host[e] == POISON).all(), f"{what}: host drafts written without publish"
        others = [b for b in range(4) if b != case.flag_byte]
        assert not flags[e, others].any(), f"{what}: a flag byte other than {case.flag_byte} written"
    assert not out["keys"].any(), "keys are not zero after the launch"
    assert not out["ctr"].any(), "the counter is not zero after the launch"


def expected_token(logits_row: np.ndarray) -> tuple[int, int]:
    """(token, flag) the commit of these BF16 logits gives: argmax_ref's rules and key_nonfinite."""
    idx, val = draft_head.argmax_ref(logits_row)
    key = draft_head.pack_key(val, idx) if idx != 0xFFFF_FFFF else 0
    return draft_head.unpack_index(key), draft_head.key_nonfinite(key)


def check_rows_equal(
    case: HeadCase, out, rows: list[int], ref: dict[int, dict[str, np.ndarray]], refcase
) -> None:
    """Row j of ``out`` (from old row rows[j], -1 for padding) has the bits of ref[rows[j]] (an
    m = 1 launch of that row): logits, token, drafts row, host row and flags."""
    for j, e in enumerate(rows):
        if e < 0:
            continue
        r, rc = ref[e], refcase[e]
        what = f"row {j} (row {e} alone)"
        assert logits_of(case, out)[j].tobytes() == logits_of(rc, r)[0].tobytes(), f"{what}: logits differ"
        assert token_of(case, out, j) == token_of(rc, r, 0), f"{what}: token differs"
        assert flag_of(case, out, j) == flag_of(rc, r, 0), f"{what}: flag differs"
        d = as_u32(out["drafts"], (case.m, case.kmax))[j]
        assert d.tobytes() == as_u32(r["drafts"], (1, case.kmax))[0].tobytes(), f"{what}: drafts differ"
        h = out["host"].reshape(case.m, -1)[j]
        assert h.tobytes() == r["host"].tobytes(), f"{what}: host drafts differ"


def row_alone(
    gpu, case: HeadCase, resident: dict[str, DevicePtr] | None = None
) -> tuple[HeadCase, dict[str, np.ndarray]]:
    """The one row of ``case`` (m = 1) launched alone, as the case launches it: (case, outputs)."""
    assert case.m == 1
    return case, case.run(gpu, resident)


def check_row_is_row_alone(
    case: HeadCase, out, j: int, alone: tuple[HeadCase, dict[str, np.ndarray]], what: str
) -> None:
    """Row j of a batched launch has the bits the head gave that row launched alone (m = 1):
    logits, token, drafts row, host row and flag."""
    rc, r = alone
    assert logits_of(case, out)[j].tobytes() == logits_of(rc, r)[0].tobytes(), f"{what}: logits differ"
    assert token_of(case, out, j) == token_of(rc, r, 0), f"{what}: token differs"
    assert flag_of(case, out, j) == flag_of(rc, r, 0), f"{what}: flag differs"
    d = as_u32(out["drafts"], (case.m, case.kmax))[j]
    assert d.tobytes() == as_u32(r["drafts"], (1, case.kmax))[0].tobytes(), f"{what}: drafts differ"
    assert out["host"].reshape(case.m, -1)[j].tobytes() == r["host"].tobytes(), f"{what}: host drafts differ"
