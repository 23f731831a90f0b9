"""The sampled draft with a vocabulary-sharded head: exact and identical on every rank.

Rank r holds the BF16 logits of its vocabulary rows [v0, v0 + n_local) (the shards partition the
vocabulary contiguously in rank order, as the sharded head's do) and draws what one rank sampling
the whole row with ``model.sampling.draw`` draws, with its probability q from
``model.sampling.probabilities``. That works because the keyed noise of index i depends on i alone
(``model.kernels.keyed_rng``): Gumbel-max is argmax_i z_i + g_i, an argmax the ranks can exchange.

Per draft (``sample_sharded_batch``): ``sample_shard_local_batch`` -> one ``all_gather`` of every
rank's per-row record (u64 [m][R]) -> ``sample_shard_commit_batch``. The record of a row:

- greedy (temperature 0): [the greedy exchange key of draft_head (ordered logit bits << 32 |
  0xFFFFFFFF - global index)]; the commit takes the largest over ranks, q = 1;
- temperature only (top_k 0 or >= vocab): [the key of this rank's largest s = z + g, (zmax_r) |
  (sum_r) << 32, z at that key] with z = logit / T, zmax_r the shard's largest z and sum_r the
  shard's sum of exp(z - zmax_r); the commit takes the largest key (the token, and its z from the
  winning rank's record), zmax = max_r zmax_r, Z = sum over ranks in rank order of sum_r exp(zmax_r
  - zmax) and q = exp(z_token - zmax) / Z;
- top-k (0 < k < vocab, k <= the cap): this rank's min(k, n_local) largest keys of z (ordered z bits
  << 32 | 0xFFFFFFFF - global index), zeros up to k. The global top k lie in the union, so the
  commit selects the k largest keys of the union, recovers each z exactly from its key, draws the
  argmax of z + g over them and q = exp(z - z_max) / (their sum in key order).

Every rank runs the commit on the same gathered bytes, so token and q are bit-identical on every
rank; they are exact (the same token as ``draw``) and q is within f32 rounding of the float64
reference. top_p < 1 is refused (``check_shard_sampling``): its kept set is a prefix of the sorted
distribution, whose cumulative sums would need every rank's whole shard.

One collective per draft: all_gather of m * R u64 (R = max(top_k_cap, 3)); each rank sends 8 m R
bytes. ``SHARD_TOP_K_MAX`` = 256 bounds top_k_cap (the commit holds one candidate per thread).

Sampling records (``pack_sample_records``): u32 [m][SAMPLE_WORDS] per entry, [temperature f32 bits,
top_p f32 bits, top_k, seed lo, seed hi, position, dist address lo, dist address hi]; the noise of
draft ``draft_index`` is keyed by (seed, position, draft_index, Stream.DRAFT, global index). A dist
address (0: none) is the entry's f32 [kmax][vocab] distribution block: draft i's q(.) goes to row i,
and each rank writes only its columns [v0, v0 + n_local) of it (in its own memory; the caller joins
the ranks' columns if it needs the whole row). dist[token] is bitwise the committed q.

Cost per row and rank: the local kernel reads the shard's logits once (2 n_local bytes, just written
by the head, from L2); a temperature row draws the noise (Philox4x32-10 and two logs) only where it
can win, z >= the chunk's max z - 19.5 (g lies within [-2.81, 16.64]), which skips most of a spread-out
row; a top-k row selects by radix on the keys (up to 8 passes over the chunk in shared memory, then
over the chunks' candidates) and draws noise for its k candidates only, in the commit. The commit
reads world * R words of the gathered records (and the shard's logits again only where the record
asks for dist: 2 + 4 bytes a column).

Batch invariance: the row is cut into chunks of SHARD_CHUNK columns, each reduced by one block, and
combined in chunk order by the row's last block, so a row's record, token, q and dist are
bit-identical whatever m and the other rows. The host twins mirror the kernels' rules (selection
sets, keys, f32 arithmetic); their sums run in NumPy's order and their exp and log are NumPy's, so
a twin's q agrees with the GPU's within f32 rounding, and its token except where two perturbed
scores z + g differ by about an ulp (the host log is within an ulp of the device's).

Workspace (``shard_sample_workspace_bytes``, zeroed once when allocated; a workspace sized for m
serves every smaller m): counters u32 [MAX_ROWS] (zero before and after every launch), then send u64
[m][R], recv u64 [world][m][R], part u64 [m][chunks][P] (P = max(top_k_cap, 2), chunks =
ceil(n_local / SHARD_CHUNK)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.comm import CommDtype
from runtime.device_ptr import DevicePtr
from runtime.dtypes import BF16
from runtime.kernel import PTR, U32, declare
from runtime.launch import launch

from ..sampling import SamplingParams
from .batch import MAX_ROWS, check_rows, is_pad, read_entries
from .draft_head import key_nonfinite
from .draft_sample import SAMPLE_WORDS, commit_draft, pack_sampling
from .keyed_rng import Stream, uniforms

SHARD_TOP_K_MAX = 256  # the largest top-k a sharded head samples (one candidate per commit thread)
SHARD_CHUNK = 4096  # columns of a row per block of both kernels (ptx CHUNK)
SHARD_THREADS = 256
NO_FLAG = 0xFFFF_FFFF  # flag_byte when the caller passes no flags: nothing is flagged

_GREEDY, _TEMP, _TOPK = 0, 1, 2
_F32_NEG_INF = np.float32(-np.inf)


# ---- records, checks, workspace ----------------------------------------------------------------


def pack_sample_records(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    dists: Sequence[int] | None = None,
    m: int | None = None,
) -> np.ndarray:
    """u32 [m][SAMPLE_WORDS]: entry b's record (draft_sample.pack_sampling) from params[b],
    positions[b] and the address of its dist block (dists[b], 0 for none), then zero records
    (greedy) up to m for padding entries."""
    n = len(params)
    m = n if m is None else m
    dists = [0] * n if dists is None else list(dists)
    if not n == len(positions) == len(dists) or m < n:
        raise ValueError(
            f"pack_sample_records: {n} params, {len(positions)} positions, {len(dists)} dists, m={m}"
        )
    out = np.zeros((m, SAMPLE_WORDS), np.uint32)
    for b, (p, pos, d) in enumerate(zip(params, positions, dists)):
        out[b] = pack_sampling(p, int(pos), int(d))
    return out


def f32_bits(v: float) -> int:
    return int(np.array([v], np.float32).view(np.uint32)[0])


def check_top_k_cap(top_k_cap: int, what: str = "sharded sampling") -> None:
    if isinstance(top_k_cap, bool) or not isinstance(top_k_cap, (int, np.integer)):
        raise ValueError(f"{what}: top_k_cap {top_k_cap!r} must be an integer")
    if not 1 <= top_k_cap <= SHARD_TOP_K_MAX:
        raise ValueError(f"{what}: top_k_cap {top_k_cap} outside 1..{SHARD_TOP_K_MAX}")


def check_shard_sampling(
    params: Sequence[SamplingParams],
    vocab: int,
    *,
    top_k_cap: int = SHARD_TOP_K_MAX,
    what: str = "sharded sampling",
) -> None:
    """Refuse, before anything is drafted, what a vocabulary-sharded head cannot sample exactly:
    every SamplingParams check, then for a sampled (temperature > 0) request top_p < 1 and a top_k
    above ``top_k_cap`` (a top_k of 0 or of the whole vocabulary keeps every token and is taken)."""
    check_top_k_cap(top_k_cap, what)
    for b, p in enumerate(params):
        where = f"{what}: request {b}"
        p.check(vocab, where)
        if p.greedy:
            continue
        if p.top_p < 1.0:
            raise ValueError(
                f"{where}: top_p {p.top_p} < 1 is not supported with a vocabulary-sharded head (its "
                "kept set is a prefix of the sorted distribution, which no rank holds); use top_p 1, "
                "top_k, or an unsharded head"
            )
        if top_k_cap < p.top_k < vocab:
            raise ValueError(
                f"{where}: top_k {p.top_k} is above {top_k_cap}, the largest top-k the sharded head "
                f"samples (SHARD_TOP_K_MAX {SHARD_TOP_K_MAX}); use top_k <= {top_k_cap} or 0"
            )


def record_words(top_k_cap: int) -> int:
    """R: u64 words of a row's record (the top-k keys, or the 3 words of temperature sampling)."""
    return max(top_k_cap, 3)


def part_words(top_k_cap: int) -> int:
    """P: u64 words of a chunk's partial result."""
    return max(top_k_cap, 2)


def shard_chunks(n_local: int) -> int:
    return -(-n_local // SHARD_CHUNK)


_COUNTERS_BYTES = 4 * MAX_ROWS


@dataclass(frozen=True)
class ShardSampleWorkspace:
    """The regions of a workspace for one launch shape (see the module docstring)."""

    counters: DevicePtr
    send: DevicePtr
    recv: DevicePtr
    part: DevicePtr
    record_words: int
    nbytes: int

    @classmethod
    def of(
        cls, workspace: DevicePtr, m: int, world: int, n_local: int, top_k_cap: int
    ) -> ShardSampleWorkspace:
        r = record_words(top_k_cap)
        send = _COUNTERS_BYTES
        recv = send + 8 * m * r
        part = recv + 8 * world * m * r
        end = part + 8 * m * shard_chunks(n_local) * part_words(top_k_cap)
        return cls(workspace, workspace.offset(send), workspace.offset(recv), workspace.offset(part), r, end)


def shard_sample_workspace_bytes(m: int, world: int, n_local: int, top_k_cap: int = SHARD_TOP_K_MAX) -> int:
    """Bytes of the workspace of ``sample_sharded_batch`` for launches of up to m entries."""
    check_rows("shard_sample_workspace_bytes", m)
    check_top_k_cap(top_k_cap, "shard_sample_workspace_bytes")
    if world < 1 or n_local < 1:
        raise ValueError(f"shard_sample_workspace_bytes: world={world}, n_local={n_local} must be >= 1")
    return ShardSampleWorkspace.of(DevicePtr(_COUNTERS_BYTES), m, world, n_local, top_k_cap).nbytes


# ---- the twins' arithmetic (the kernels' rules, vectorised) ------------------------------------


def ordered_bits_array(v: np.ndarray) -> np.ndarray:
    """draft_head.ordered_bits of every element: u32, -0 as +0, NaN as 0."""
    v = np.asarray(v, np.float32)
    b = np.where(v == 0, np.float32(0.0), v).view(np.uint32)
    out = np.where(b & np.uint32(0x8000_0000), ~b, b | np.uint32(0x8000_0000)).astype(np.uint32)
    out[np.isnan(v)] = 0
    return out


def key_values(hi: np.ndarray) -> np.ndarray:
    """The f32 each ordered high word was made from (-0 comes back as +0, 0 as a NaN)."""
    hi = np.asarray(hi, np.uint32)
    return (
        np.where(hi & np.uint32(0x8000_0000), hi ^ np.uint32(0x8000_0000), ~hi)
        .astype(np.uint32)
        .view(np.float32)
    )


def pack_keys(vals: np.ndarray, global_index: np.ndarray) -> np.ndarray:
    """u64 exchange keys: ordered bits << 32 | 0xFFFFFFFF - global index."""
    hi = ordered_bits_array(vals).astype(np.uint64) << np.uint64(32)
    return hi | (np.uint64(0xFFFF_FFFF) - np.asarray(global_index, np.uint64))


def key_indices(keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys, np.uint64)
    return np.where(keys == 0, 0, np.uint64(0xFFFF_FFFF) - (keys & np.uint64(0xFFFF_FFFF))).astype(np.int64)


def soft_terms(z: np.ndarray, zmax: np.float32) -> np.ndarray:
    """f32 exp(z - zmax), a -inf z exactly 0 (ptx soft_term)."""
    z = np.asarray(z, np.float32)
    with np.errstate(all="ignore"):
        t = np.exp((z - np.float32(zmax)).astype(np.float32)).astype(np.float32)
    return np.where(z == _F32_NEG_INF, np.float32(0.0), t).astype(np.float32)


def noise(seed: int, position: int, draft_index: int, global_index: np.ndarray) -> np.ndarray:
    """The draft's Gumbel noise at these vocabulary indices: keyed_rng.gumbel's f32 formula."""
    u = uniforms(seed, position, draft_index, Stream.DRAFT, np.asarray(global_index, np.uint64))
    return -np.log(-np.log(u))


@dataclass(frozen=True)
class _Record:
    t: np.float32
    k: int
    seed: int
    pos: int
    dist: int

    @classmethod
    def of(cls, words: np.ndarray) -> _Record:
        w = [int(x) for x in words]
        t = np.array([w[0]], np.uint32).view(np.float32)[0]
        return cls(t, w[2], w[3] | (w[4] << 32), w[5], w[6] | (w[7] << 32))

    def mode(self, vocab: int) -> int:
        if self.t == 0:
            return _GREEDY
        return _TOPK if 0 < self.k < vocab else _TEMP


def _z(row: np.ndarray, t: np.float32) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (np.asarray(row, np.float32) / np.float32(t)).astype(np.float32)


def _max_value(vals: np.ndarray) -> np.float32:
    """The largest in ordered-key order: NaN below every number, NaN when every one is."""
    return key_values(np.array([ordered_bits_array(vals).max()], np.uint32))[0]


def _two_f32(lo: np.float32, hi: np.float32) -> int:
    return f32_bits(lo) | (f32_bits(hi) << 32)


def _f32_of(word: int) -> np.float32:
    return np.array([word & 0xFFFF_FFFF], np.uint32).view(np.float32)[0]


def _combine(zmaxes: Sequence[np.float32], sums: Sequence[np.float32]) -> tuple[np.float32, np.float32]:
    """(zmax, sum of sum_j exp(zmax_j - zmax)) in the given order, the kernels' f32 steps."""
    zmax = _max_value(np.array(zmaxes, np.float32))
    total = np.float32(0.0)
    with np.errstate(all="ignore"):
        for zj, sj in zip(zmaxes, sums):
            if sj != 0:
                total = np.float32(total + np.float32(sj * np.exp(np.float32(zj - zmax))))
    return zmax, total


def local_record(
    row: np.ndarray, rec: _Record, v0: int, vocab: int, draft_index: int, cap: int
) -> np.ndarray:
    """The u64 words sample_shard_local_batch stores for a live row (the module docstring); top-k
    keys in descending order (the kernel's are in no particular order)."""
    n = row.shape[0]
    gidx = np.arange(v0, v0 + n, dtype=np.uint64)
    mode = rec.mode(vocab)
    if mode == _GREEDY:
        return np.array([pack_keys(row, gidx).max()], np.uint64)
    z = _z(row, rec.t)
    if mode == _TOPK:
        keff = min(rec.k, cap)
        out = np.zeros(keff, np.uint64)
        top = np.sort(pack_keys(z, gidx))[::-1][: min(keff, n)]
        out[: top.size] = top
        return out
    with np.errstate(all="ignore"):
        s = (z + noise(rec.seed, rec.pos, draft_index, gidx)).astype(np.float32)
    best = int(pack_keys(s, gidx).max())
    zmaxes, sums = [], []
    for c0 in range(0, n, SHARD_CHUNK):
        zc = z[c0 : c0 + SHARD_CHUNK]
        zm = _max_value(zc)
        zmaxes.append(zm)
        sums.append(np.float32(soft_terms(zc, zm).sum(dtype=np.float32)))
    zmax, total = _combine(zmaxes, sums)
    zbest = z[int(key_indices(np.array([best], np.uint64))[0]) - v0]
    return np.array([best, _two_f32(zmax, total), f32_bits(zbest)], np.uint64)


@dataclass(frozen=True)
class Draft:
    """A row's committed draft: the token, q(token), the high word of its largest z (for the flag),
    and q over this rank's columns (dist), all from the gathered records."""

    token: int
    q: np.float32
    top_hi: int
    dist: np.ndarray


def commit_row(
    recs: np.ndarray, row: np.ndarray, rec: _Record, v0: int, vocab: int, draft_index: int, cap: int
) -> Draft:
    """What sample_shard_commit_batch derives for a live row from recs (u64 [world][R], the row's
    records of every rank) and this rank's logits row."""
    n = row.shape[0]
    mode = rec.mode(vocab)
    gidx = np.arange(v0, v0 + n)
    if mode == _GREEDY:
        best = int(recs[:, 0].max())
        token = int(key_indices(np.array([best], np.uint64))[0])
        return Draft(token, np.float32(1.0), best >> 32, (gidx == token).astype(np.float32))
    if mode == _TEMP:
        keys = recs[:, 0]
        winner = int(np.argmax(keys))
        zmaxes = [_f32_of(int(w)) for w in recs[:, 1]]
        sums = [_f32_of(int(w) >> 32) for w in recs[:, 1]]
        zmax, total = _combine(zmaxes, sums)
        zt = _f32_of(int(recs[winner, 2]))
        with np.errstate(all="ignore"):
            q = np.float32(soft_terms(np.array([zt]), zmax)[0] / total)
            dist = (soft_terms(_z(row, rec.t), zmax) / total).astype(np.float32)
        token = int(key_indices(np.array([keys[winner]], np.uint64))[0])
        return Draft(token, q, int(ordered_bits_array(np.array([zmax]))[0]), dist)
    keff = min(rec.k, cap)
    union = recs[:, :keff].reshape(-1)
    kept = np.sort(union[union != 0])[::-1][:keff]
    z = key_values((kept >> np.uint64(32)).astype(np.uint32))
    idx = key_indices(kept)
    ex = soft_terms(z, z[0])
    with np.errstate(all="ignore"):
        qs = (ex / ex.sum(dtype=np.float32)).astype(np.float32)
        s = (z + noise(rec.seed, rec.pos, draft_index, idx)).astype(np.float32)
    j = int(np.argmax(pack_keys(s, idx)))
    dist = np.zeros(n, np.float32)
    mine = (idx >= v0) & (idx < v0 + n)
    dist[idx[mine] - v0] = qs[mine]
    return Draft(int(idx[j]), qs[j], int(kept[0] >> np.uint64(32)), dist)


# ---- the kernels ---------------------------------------------------------------------------------


def _shape_ok(m: int, n_local: int, cap: int) -> bool:
    return 1 <= m <= MAX_ROWS and n_local >= 1 and 1 <= cap <= SHARD_TOP_K_MAX


@declare(
    "draft_sample_shard",
    "sample_shard_local_batch",
    [
        ("logits", PTR),
        ("sampling", PTR),
        ("entries", PTR),
        ("part", PTR),
        ("counters", PTR),
        ("send", PTR),
        ("v0", U32),
        ("n_local", U32),
        ("vocab", U32),
        ("draft_index", U32),
        ("cap", U32),
        ("m", U32),
    ],
    writes=("part", "counters", "send"),
)
def SAMPLE_SHARD_LOCAL_BATCH(
    mem, logits, sampling, entries, part, counters, send, v0, n_local, vocab, draft_index, cap, m
):  # noqa: N802
    """Each live row's record into send[e] (u64 [m][R]); its counter is left zero. The chunk
    partials (part) are the kernel's scratch: the twin leaves them as they were."""
    if not _shape_ok(m, n_local, cap):
        return
    ent = read_entries(mem, entries, m)
    recs = mem.read(sampling, np.uint32, (m, SAMPLE_WORDS))
    r = record_words(cap)
    for e in range(m):
        if is_pad(ent[e]):
            continue
        row = mem.read(logits.offset(2 * e * n_local), BF16, n_local)
        words = local_record(row, _Record.of(recs[e]), v0, vocab, draft_index, cap)
        mem.write(send.offset(8 * e * r), words)
        mem.write(counters.offset(4 * e), np.zeros(1, np.uint32))


@declare(
    "draft_sample_shard",
    "sample_shard_commit_batch",
    [
        ("logits", PTR),
        ("sampling", PTR),
        ("entries", PTR),
        ("recv", PTR),
        ("drafts", PTR),
        ("probs", PTR),
        ("host_drafts", PTR),
        ("host_probs", PTR),
        ("draft_index", U32),
        ("kmax", U32),
        ("publish", U32),
        ("v0", U32),
        ("n_local", U32),
        ("vocab", U32),
        ("world", U32),
        ("cap", U32),
        ("m", U32),
        ("flags", PTR),
        ("flag_byte", U32),
    ],
    writes=("entries", "drafts", "probs", "host_drafts", "host_probs", "flags"),
)
def SAMPLE_SHARD_COMMIT_BATCH(  # noqa: N802
    mem,
    logits,
    sampling,
    entries,
    recv,
    drafts,
    probs,
    host_drafts,
    host_probs,
    draft_index,
    kmax,
    publish,
    v0,
    n_local,
    vocab,
    world,
    cap,
    m,
    flags,
    flag_byte,
):
    """Each live row's commit from the gathered records (recv u64 [world][m][R]); the dist block
    of the record, when it has one, is written at this rank's columns (the module docstring)."""
    if not _shape_ok(m, n_local, cap) or world < 1:
        return
    ent = read_entries(mem, entries, m)
    recs = mem.read(sampling, np.uint32, (m, SAMPLE_WORDS))
    r = record_words(cap)
    gathered = mem.read(recv, np.uint64, (world, m, r))
    for e in range(m):
        if is_pad(ent[e]):
            continue
        rec = _Record.of(recs[e])
        row = mem.read(logits.offset(2 * e * n_local), BF16, n_local)
        d = commit_row(gathered[:, e, :], row, rec, v0, vocab, draft_index, cap)
        if rec.dist:
            mem.write(DevicePtr(rec.dist).offset(4 * (draft_index * vocab + v0)), d.dist)
        if flag_byte < 4:
            code = key_nonfinite(d.top_hi << 32)
            if code:
                mem.write(flags.offset(e * 4 + flag_byte), np.array([code], np.uint8))
        commit_draft(
            mem,
            entries=entries,
            drafts=drafts,
            probs=probs,
            host_drafts=host_drafts,
            host_probs=host_probs,
            e=e,
            kmax=kmax,
            draft_index=draft_index,
            token=d.token,
            q=d.q,
            publish=publish,
        )


def _check_shape(what: str, m: int, v0: int, n_local: int, vocab: int, top_k_cap: int) -> None:
    check_rows(what, m)
    check_top_k_cap(top_k_cap, what)
    if n_local < 1 or v0 < 0 or v0 + n_local > vocab or vocab >= 0xFFFF_FFFF:
        raise ValueError(f"{what}: bad vocabulary shard v0={v0}, n_local={n_local}, vocab={vocab}")


def _check_commit(
    what: str, m, v0, n_local, vocab, top_k_cap, draft_index, kmax, world, flags, flag_byte
) -> None:
    _check_shape(what, m, v0, n_local, vocab, top_k_cap)
    if not 0 <= draft_index < kmax:
        raise ValueError(f"{what}: draft_index={draft_index} outside 0..kmax-1 (kmax={kmax})")
    if world < 1:
        raise ValueError(f"{what}: world={world} must be >= 1")
    if flags is not None and not 0 <= flag_byte < 4:
        raise ValueError(f"{what}: flag_byte={flag_byte}; an entry's flags are 4 bytes")


def _launch_grid(m: int, n_local: int) -> tuple[int, int]:
    return shard_chunks(n_local), m


def sample_shard_local_batch(
    gpu,
    *,
    logits,
    sampling,
    entries,
    part,
    counters,
    send,
    v0,
    n_local,
    vocab,
    draft_index,
    top_k_cap,
    m,
    stream=None,
):
    """This rank's record of each live entry e < m into send[e] (u64 [m][R], R =
    record_words(top_k_cap)): logits BF16 [m][n_local] (this rank's columns [v0, v0 + n_local) of
    the vocabulary), sampling u32 [m][SAMPLE_WORDS], part u64 [m][chunks][P] scratch, counters u32
    [m] zero before and after. Padding entries read and write nothing."""
    _check_shape("sample_shard_local_batch", m, v0, n_local, vocab, top_k_cap)
    if draft_index < 0:
        raise ValueError(f"sample_shard_local_batch: draft_index={draft_index} < 0")
    launch(
        gpu,
        gpu.kernel(*SAMPLE_SHARD_LOCAL_BATCH.key),
        _launch_grid(m, n_local),
        SHARD_THREADS,
        logits,
        sampling,
        entries,
        part,
        counters,
        send,
        v0,
        n_local,
        vocab,
        draft_index,
        top_k_cap,
        m,
        stream=stream,
    )


def sample_shard_commit_batch(
    gpu,
    *,
    logits,
    sampling,
    entries,
    recv,
    drafts,
    probs,
    host_drafts,
    host_probs,
    draft_index,
    kmax,
    publish,
    v0,
    n_local,
    vocab,
    world,
    top_k_cap,
    m,
    flags=None,
    flag_byte=0,
    stream=None,
):
    """The commit of each live entry e < m from recv (u64 [world][m][R], every rank's send in rank
    order): entries[e].token, drafts[e * kmax + draft_index] (u32) and probs[e * kmax +
    draft_index] (f32 q), with ``publish`` drafts and probs [e * kmax + 0 .. draft_index] copied to
    host_drafts and host_probs; with ``flags`` (u8 [m][4]) byte flag_byte raised (draft_head's
    NONFINITE_NAN / NONFINITE_INF) when the row's largest z = logit / T (the logit when greedy) is
    not finite; the dist row of the record's dist block at this rank's columns. Padding entries
    write nothing."""
    _check_commit(
        "sample_shard_commit_batch",
        m,
        v0,
        n_local,
        vocab,
        top_k_cap,
        draft_index,
        kmax,
        world,
        flags,
        flag_byte,
    )
    if flags is None:
        flags, flag_byte = entries, NO_FLAG  # never written
    launch(
        gpu,
        gpu.kernel(*SAMPLE_SHARD_COMMIT_BATCH.key),
        _launch_grid(m, n_local),
        SHARD_THREADS,
        logits,
        sampling,
        entries,
        recv,
        drafts,
        probs,
        host_drafts,
        host_probs,
        draft_index,
        kmax,
        int(bool(publish)),
        v0,
        n_local,
        vocab,
        world,
        top_k_cap,
        m,
        flags,
        flag_byte,
        stream=stream,
    )


def sample_sharded_batch(
    gpu,
    comm,
    *,
    logits,
    v0,
    n_local,
    vocab,
    sampling,
    entries,
    drafts,
    probs,
    host_drafts,
    host_probs,
    draft_index,
    kmax,
    publish,
    m,
    workspace,
    flags=None,
    flag_byte=0,
    top_k_cap=SHARD_TOP_K_MAX,
    stream=None,
):
    """The sampled (or greedy, per entry) draft ``draft_index`` of m entries on this rank of
    ``comm``: the local kernel, one all_gather of m * R u64 on ``stream``, the commit (see
    sample_shard_commit_batch for what is written). Every rank calls it with the same m, vocab,
    sampling records, entries and top_k_cap and its own shard (v0, n_local); the ranks' shards
    partition [0, vocab) in rank order. ``workspace``: shard_sample_workspace_bytes(m or more,
    world, n_local, top_k_cap) bytes, zeroed once. The requests must have passed
    check_shard_sampling (the kernels read no top_p, and sample a top_k above the cap from the top
    top_k_cap). Fixed sizes for a given m and no host synchronisation: graph-capturable."""
    world = comm.world_size
    _check_commit(
        "sample_sharded_batch", m, v0, n_local, vocab, top_k_cap, draft_index, kmax, world, flags, flag_byte
    )
    ws = ShardSampleWorkspace.of(workspace, m, world, n_local, top_k_cap)
    have = gpu.bytes_from(workspace)
    if have < ws.nbytes:
        raise ValueError(
            f"sample_sharded_batch: workspace has {have} bytes, needs {ws.nbytes} "
            f"(shard_sample_workspace_bytes(m={m}, world={world}, n_local={n_local}, top_k_cap={top_k_cap}))"
        )
    sample_shard_local_batch(
        gpu,
        logits=logits,
        sampling=sampling,
        entries=entries,
        part=ws.part,
        counters=ws.counters,
        send=ws.send,
        v0=v0,
        n_local=n_local,
        vocab=vocab,
        draft_index=draft_index,
        top_k_cap=top_k_cap,
        m=m,
        stream=stream,
    )
    comm.all_gather(ws.send, ws.recv, m * ws.record_words, CommDtype.UINT64, stream=stream)
    sample_shard_commit_batch(
        gpu,
        logits=logits,
        sampling=sampling,
        entries=entries,
        recv=ws.recv,
        drafts=drafts,
        probs=probs,
        host_drafts=host_drafts,
        host_probs=host_probs,
        draft_index=draft_index,
        kmax=kmax,
        publish=publish,
        v0=v0,
        n_local=n_local,
        vocab=vocab,
        world=world,
        top_k_cap=top_k_cap,
        m=m,
        flags=flags,
        flag_byte=flag_byte,
        stream=stream,
    )
