"""Cases and checks shared by the sharded sampler's tests (test_draft_sample_shard.py on the host
twins, test_gpu_draft_sample_shard.py on the PTX): a batch of greedy, temperature and top-k entries
with padding anywhere, the vocabulary cut into contiguous shards, every rank's buffers poisoned, and
the commit contract checked entry by entry against the unsharded reference (model.sampling).

Two ways to run the ranks:
- ``run_threads``: one thread per rank, each with its own HostBackend, sample_sharded_batch through a
  host communicator (the real orchestration and collective);
- ``run_emulated``: the ranks one after the other on one backend (a GPU or the host), the all_gather
  done on the host between the local kernels and the commits (what a single GPU can test).

Tolerances (stated once): q and the dist entries against the float64 reference:
``|q - p| <= Q_REL * p + Q_ABS``; f32 throughout (z - zmax rounded to f32 before exp, f32 exp, sums of
at most a few hundred sequential f32 terms in any order), so a relative 2e-5 bounds it with margin,
and Q_ABS covers reference probabilities below f32's normal range (exp underflows there).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from model.kernels import draft_sample_shard as dss
from model.kernels.batch import ENTRY_WORDS, PAD_SLOT
from model.kernels.keyed_rng import Stream
from model.sampling import GREEDY, SamplingParams, draw, probabilities
from runtime.comm import HostCommGroup
from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend

Q_REL = 2e-5
Q_ABS = 1e-37
POISON = 0xFF
TOKEN_BEFORE = 0xDEAD_BEEF
POISON_U32 = 0xFFFF_FFFF


@dataclass
class ShardCase:
    logits: np.ndarray  # BF16 [m][vocab], the whole rows
    params: list[SamplingParams | None]  # None: a padding entry
    positions: np.ndarray  # per entry
    bounds: list[int]  # rank r owns [bounds[r], bounds[r + 1])
    draft_index: int
    kmax: int
    publish: bool
    with_dist: list[bool]
    prior_drafts: np.ndarray  # u32 [m][kmax]: the drafts buffer before the launch
    prior_probs: np.ndarray  # f32 [m][kmax]
    entries: np.ndarray  # u32 [m][4]
    top_k_cap: int = dss.SHARD_TOP_K_MAX
    flag_byte: int = 1

    @property
    def m(self) -> int:
        return self.logits.shape[0]

    @property
    def vocab(self) -> int:
        return self.logits.shape[1]

    @property
    def world(self) -> int:
        return len(self.bounds) - 1

    @property
    def live(self) -> list[int]:
        return [e for e, p in enumerate(self.params) if p is not None]

    def shard(self, r: int) -> tuple[int, int]:
        return self.bounds[r], self.bounds[r + 1] - self.bounds[r]

    def with_world(self, world: int) -> ShardCase:
        """The same batch with the vocabulary cut evenly over ``world`` ranks."""
        return ShardCase(**{**self.__dict__, "bounds": even_bounds(self.vocab, world)})

    def rows(self, idx: list[int]) -> ShardCase:
        """A batch of these rows (in this order): the same logits, params and buffers."""
        d = dict(self.__dict__)
        for name in ("logits", "positions", "prior_drafts", "prior_probs", "entries"):
            d[name] = getattr(self, name)[idx]
        d["params"] = [self.params[i] for i in idx]
        d["with_dist"] = [self.with_dist[i] for i in idx]
        return ShardCase(**d)


def even_bounds(vocab: int, world: int) -> list[int]:
    return [vocab * r // world for r in range(world + 1)]


def random_logits(
    rng: np.random.Generator, m: int, vocab: int, ties: bool = False, spread: float = 2.5
) -> np.ndarray:
    """BF16 [m][vocab], normal with standard deviation ``spread``; with ``ties`` the values come from
    a handful of levels, so equal logits (and equal z) straddle every top-k boundary and every shard
    boundary."""
    if ties:
        return (rng.integers(-6, 3, (m, vocab)).astype(np.float32) * np.float32(0.75)).astype(BF16)
    return (rng.standard_normal((m, vocab)).astype(np.float32) * np.float32(spread)).astype(BF16)


def mixed_params(rng: np.random.Generator, vocab: int, n: int, cap: int = dss.SHARD_TOP_K_MAX) -> list:
    """n requests cycling through every kind a sharded head samples: greedy, temperature only (top_k
    0 and top_k == vocab), top-k from 1 to the cap."""
    kinds = [
        lambda s: GREEDY,
        lambda s: SamplingParams(temperature=1.0, seed=s),
        lambda s: SamplingParams(temperature=0.6, top_k=min(40, cap), seed=s),
        lambda s: SamplingParams(temperature=1.7, seed=s),
        lambda s: SamplingParams(temperature=0.9, top_k=min(cap, vocab), seed=s),
        lambda s: SamplingParams(temperature=1.3, top_k=1, seed=s),
        lambda s: SamplingParams(temperature=0.8, top_k=vocab, seed=s),
        lambda s: SamplingParams(temperature=2.0, top_k=min(7, cap), seed=s),
    ]
    start = int(rng.integers(0, len(kinds)))
    return [kinds[(start + i) % len(kinds)](int(rng.integers(0, 2**64, dtype=np.uint64))) for i in range(n)]


def make_case(
    rng: np.random.Generator,
    m: int,
    vocab: int,
    world: int,
    pads: int = 0,
    *,
    params: list | None = None,
    ties: bool = False,
    kmax: int = 3,
    publish: bool | None = None,
    top_k_cap: int = dss.SHARD_TOP_K_MAX,
    spread: float = 2.5,
) -> ShardCase:
    live = m - pads
    params = mixed_params(rng, vocab, live, top_k_cap) if params is None else list(params)
    assert len(params) == live
    slots = rng.permutation(m)
    pad_at = set(rng.choice(m, pads, replace=False).tolist())
    full: list = []
    it = iter(params)
    for e in range(m):
        full.append(None if e in pad_at else next(it))
    entries = rng.integers(0, 2**32, (m, ENTRY_WORDS), dtype=np.uint64).astype(np.uint32)
    entries[:, 0] = slots
    entries[:, 2] = TOKEN_BEFORE
    for e in pad_at:
        entries[e, 0] = PAD_SLOT
    return ShardCase(
        logits=random_logits(rng, m, vocab, ties, spread),
        params=full,
        positions=rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.int64),
        bounds=even_bounds(vocab, world),
        draft_index=int(rng.integers(0, kmax)),
        kmax=kmax,
        publish=bool(rng.integers(0, 2)) if publish is None else publish,
        with_dist=[bool(rng.integers(0, 2)) for _ in range(m)],
        prior_drafts=rng.integers(0, vocab, (m, kmax)).astype(np.uint32),
        prior_probs=rng.random((m, kmax)).astype(np.float32),
        entries=entries,
        top_k_cap=top_k_cap,
    )


# ---- one rank's buffers --------------------------------------------------------------------------


def _alloc(gpu, nbytes: int, data: np.ndarray | None = None, fill: int = POISON) -> DevicePtr:
    p = gpu.alloc(nbytes)
    gpu.memset(p, fill, nbytes)
    if data is not None:
        gpu.copy_h2d(p, np.ascontiguousarray(data))
    return p


class RankBuffers:
    """Rank r's device buffers for ``case``: its logits shard, the records (dist addresses into its
    own poisoned dist buffer f32 [m][kmax][vocab]), the entries, drafts and probs from the case, the
    host copies and flags poisoned / zero, a zeroed workspace."""

    def __init__(self, gpu, case: ShardCase, r: int) -> None:
        self.gpu, self.case, self.r = gpu, case, r
        m, kmax, vocab = case.m, case.kmax, case.vocab
        self.v0, self.n_local = case.shard(r)
        lg = np.ascontiguousarray(case.logits[:, self.v0 : self.v0 + self.n_local])
        self.ptrs: dict[str, DevicePtr] = {}
        self.ptrs["logits"] = _alloc(gpu, lg.nbytes, lg)
        self.ptrs["dist"] = _alloc(gpu, 4 * m * kmax * vocab)
        base = self.ptrs["dist"].addr
        dists = [base + 4 * e * kmax * vocab if case.with_dist[e] else 0 for e in range(m)]
        params = [p if p is not None else GREEDY for p in case.params]
        recs = dss.pack_sample_records(params, case.positions.tolist(), dists)
        self.ptrs["sampling"] = _alloc(gpu, recs.nbytes, recs)
        self.ptrs["entries"] = _alloc(gpu, case.entries.nbytes, case.entries)
        self.ptrs["drafts"] = _alloc(gpu, case.prior_drafts.nbytes, case.prior_drafts)
        self.ptrs["probs"] = _alloc(gpu, case.prior_probs.nbytes, case.prior_probs)
        self.ptrs["host_drafts"] = _alloc(gpu, 4 * m * kmax)
        self.ptrs["host_probs"] = _alloc(gpu, 4 * m * kmax)
        self.ptrs["flags"] = _alloc(gpu, 4 * m, fill=0)
        self.ws_bytes = dss.shard_sample_workspace_bytes(m, case.world, self.n_local, case.top_k_cap)
        self.ptrs["workspace"] = _alloc(gpu, self.ws_bytes, fill=0)
        self.ws = dss.ShardSampleWorkspace.of(
            self.ptrs["workspace"], m, case.world, self.n_local, case.top_k_cap
        )

    def common(self) -> dict:
        c, p = self.case, self.ptrs
        return dict(logits=p["logits"], sampling=p["sampling"], entries=p["entries"], v0=self.v0,
                    n_local=self.n_local, vocab=c.vocab, top_k_cap=c.top_k_cap, m=c.m)  # fmt: skip

    def commit_args(self) -> dict:
        c, p = self.case, self.ptrs
        return dict(drafts=p["drafts"], probs=p["probs"], host_drafts=p["host_drafts"], host_probs=p["host_probs"],
                    draft_index=c.draft_index, kmax=c.kmax, publish=c.publish, flags=p["flags"],
                    flag_byte=c.flag_byte)  # fmt: skip

    def run_local(self) -> None:
        dss.sample_shard_local_batch(
            self.gpu, part=self.ws.part, counters=self.ws.counters, send=self.ws.send,
            draft_index=self.case.draft_index, **self.common(),
        )  # fmt: skip

    def send(self) -> np.ndarray:
        return self._get(self.ws.send, np.uint64, (self.case.m, self.ws.record_words))

    def run_commit(self, recv: np.ndarray) -> None:
        self.gpu.copy_h2d(self.ws.recv, np.ascontiguousarray(recv, np.uint64))
        dss.sample_shard_commit_batch(
            self.gpu, recv=self.ws.recv, world=self.case.world, **self.common(), **self.commit_args()
        )

    def run_sharded(self, comm) -> None:
        dss.sample_sharded_batch(
            self.gpu, comm, workspace=self.ptrs["workspace"], **self.common(), **self.commit_args()
        )

    def _get(self, p: DevicePtr, dtype, shape) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.gpu.copy_d2h(out, p)
        return out

    def read(self) -> dict[str, np.ndarray]:
        c, p = self.case, self.ptrs
        m, kmax = c.m, c.kmax
        return {
            "entries": self._get(p["entries"], np.uint32, (m, ENTRY_WORDS)),
            "drafts": self._get(p["drafts"], np.uint32, (m, kmax)),
            "probs": self._get(p["probs"], np.float32, (m, kmax)),
            "host_drafts": self._get(p["host_drafts"], np.uint32, (m, kmax)),
            "host_probs": self._get(p["host_probs"], np.uint32, (m, kmax)),
            "flags": self._get(p["flags"], np.uint8, (m, 4)),
            "dist": self._get(p["dist"], np.float32, (m, kmax, c.vocab)),
            "send": self.send(),
            "counters": self._get(self.ws.counters, np.uint32, m),
        }

    def free(self) -> None:
        for ptr in self.ptrs.values():
            self.gpu.free(ptr)


def run_emulated(gpu, case: ShardCase) -> list[dict[str, np.ndarray]]:
    """Every rank's local kernel, the gather on the host, every rank's commit: one backend."""
    ranks = [RankBuffers(gpu, case, r) for r in range(case.world)]
    try:
        for rb in ranks:
            rb.run_local()
        recv = np.stack([rb.send() for rb in ranks])
        for rb in ranks:
            rb.run_commit(recv)
        gpu.synchronize()
        return [rb.read() for rb in ranks]
    finally:
        for rb in ranks:
            rb.free()


def run_threads(case: ShardCase, timeout_s: float = 60.0) -> list[dict[str, np.ndarray]]:
    """sample_sharded_batch on one thread per rank, each with its own HostBackend."""
    group = HostCommGroup(case.world, timeout_s=timeout_s)
    out: list = [None] * case.world
    errs: list = [None] * case.world

    def body(r: int) -> None:
        gpu = HostBackend()
        rb = RankBuffers(gpu, case, r)
        try:
            rb.run_sharded(group.communicator(r, gpu))
            out[r] = rb.read()
        except BaseException as e:  # reported to the test thread
            errs[r] = e
        finally:
            rb.free()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(case.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 2)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for e in errs:
        if e is not None:
            raise e
    return out


# ---- checks --------------------------------------------------------------------------------------


def expected(case: ShardCase, e: int) -> tuple[int, np.ndarray]:
    """(the token one rank sampling the whole row draws, the float64 distribution)."""
    p = case.params[e]
    row = case.logits[e].astype(np.float32)
    tok = draw(row, p, int(case.positions[e]), case.draft_index, Stream.DRAFT)
    return tok, probabilities(row, p)


def assert_q_close(q: np.ndarray, p: np.ndarray, what: str, rel: float = Q_REL) -> None:
    q64, p64 = np.asarray(q, np.float64), np.asarray(p, np.float64)
    assert not np.isnan(q64).any(), f"{what}: NaN (unwritten?)"
    bad = np.abs(q64 - p64) > rel * p64 + Q_ABS
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} outside the bound; first at {i}: q {q64.reshape(-1)[i]!r}, p {p64.reshape(-1)[i]!r}"
        )


def check_identical_across_ranks(case: ShardCase, outs: list[dict]) -> None:
    """Token, q and every other committed output bit-identical on every rank."""
    for name in ("entries", "drafts", "probs", "host_drafts", "host_probs", "flags"):
        for r in range(1, case.world):
            np.testing.assert_array_equal(
                outs[r][name].view(np.uint8),
                outs[0][name].view(np.uint8),
                err_msg=f"{name}: rank {r} != rank 0",
            )


def check_commit(case: ShardCase, outs: list[dict], token_of=None) -> None:
    """The commit contract on every rank (see the module docstring); ``token_of(e)`` overrides the
    expected token (the GPU test passes the device's own where a near tie may flip it)."""
    check_identical_across_ranks(case, outs)
    di = case.draft_index
    for e in range(case.m):
        ref = expected(case, e) if case.params[e] is not None else None
        for r, o in enumerate(outs):
            v0, n = case.shard(r)
            where = f"row {e} rank {r}"
            if case.params[e] is None:
                np.testing.assert_array_equal(
                    o["entries"][e], case.entries[e], err_msg=f"{where}: padding entry"
                )
                np.testing.assert_array_equal(
                    o["drafts"][e], case.prior_drafts[e], err_msg=f"{where}: padding drafts"
                )
                assert (o["probs"][e].view(np.uint32) == case.prior_probs[e].view(np.uint32)).all(), where
                assert (o["host_drafts"][e] == POISON_U32).all() and (
                    o["host_probs"][e] == POISON_U32
                ).all(), where
                assert (o["flags"][e] == 0).all(), f"{where}: padding flags"
                assert (o["dist"][e].view(np.uint32) == POISON_U32).all(), f"{where}: padding dist"
                continue
            want_tok, p = ref
            if token_of is not None:
                want_tok = token_of(e)
            tok, q = int(o["entries"][e, 2]), o["probs"][e, di]
            assert tok == want_tok, f"{where}: token {tok}, reference {want_tok}"
            assert_q_close(q, p[tok], f"{where}: q")
            if case.params[e].greedy:
                assert q == 1.0, f"{where}: greedy q {q}"
            ent = case.entries[e].copy()
            ent[2] = tok
            np.testing.assert_array_equal(o["entries"][e], ent, err_msg=f"{where}: entry words")
            dr, pr = case.prior_drafts[e].copy(), case.prior_probs[e].copy()
            dr[di], pr[di] = tok, q
            np.testing.assert_array_equal(o["drafts"][e], dr, err_msg=f"{where}: drafts")
            assert (o["probs"][e].view(np.uint32) == pr.view(np.uint32)).all(), f"{where}: probs"
            if case.publish:
                np.testing.assert_array_equal(o["host_drafts"][e, : di + 1], dr[: di + 1], err_msg=where)
                assert (o["host_probs"][e, : di + 1] == pr[: di + 1].view(np.uint32)).all(), where
                assert (o["host_drafts"][e, di + 1 :] == POISON_U32).all(), (
                    f"{where}: host drafts past the draft"
                )
                assert (o["host_probs"][e, di + 1 :] == POISON_U32).all(), (
                    f"{where}: host probs past the draft"
                )
            else:
                assert (o["host_drafts"][e] == POISON_U32).all() and (
                    o["host_probs"][e] == POISON_U32
                ).all(), where
            assert (o["flags"][e] == 0).all(), f"{where}: finite logits raise no flag"
            dist = o["dist"][e]
            untouched = np.ones(dist.shape, bool)
            if case.with_dist[e]:
                untouched[di, v0 : v0 + n] = False
                mine = dist[di, v0 : v0 + n]
                assert_q_close(mine, p[v0 : v0 + n], f"{where}: dist")
                if v0 <= tok < v0 + n:
                    assert mine[tok - v0].view(np.uint32) == np.float32(q).view(np.uint32), (
                        f"{where}: dist[token] != q"
                    )
            assert (dist[untouched].view(np.uint32) == POISON_U32).all(), (
                f"{where}: dist written outside its columns"
            )
    for r, o in enumerate(outs):
        assert (o["counters"] == 0).all(), f"rank {r}: counters not zero after the launch"
