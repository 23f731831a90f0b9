"""Sampled drafts on one rank: after the head wrote a row's BF16 logits and committed its argmax,
``draft_sample_batch`` replaces that token, for the entries whose request samples, by a draw from
model/sampling.py's distribution (rules 1-5: temperature, top-k, top-p, Gumbel-max with the keyed
noise of model/kernels/keyed_rng.py, Stream.DRAFT), and stores the draft's probability q(token);
optionally the whole distribution q(.) of the draft. CUDA: ptx/draft_sample.cu.

Per-entry record (``pack_sampling``; u32 [m][SAMPLE_WORDS] in device memory, written by the proposer
each step, so that a captured graph replays any request's parameters)::

    [0] temperature   f32 bits (0: greedy)       [4] seed >> 32
    [1] top_p         f32 bits (1: no top-p)     [5] position (the keyed noise's counter word 2)
    [2] top_k         u32 (0: no top-k)          [6] dist address, low word
    [3] seed & 0xFFFFFFFF                        [7] dist address, high word (0: no distribution)

The dist buffer of an entry (when its address is not 0) holds f32 [kmax'][n]: draft i writes row i
(``address + draft_index * n * 4``), every one of its n elements. The address is a raw device
address read by the kernel, not a launch argument: the caller keeps that memory alive and 4-byte
aligned for as long as a graph that reads the record may replay.

Per live entry e of a launch of m (1..256; padding entries read and write nothing, their record
is not read):

- temperature 0 (or a record whose temperature is not > 0): the token stays the head's
  (entries[e].token as the head left it), q = 1, the dist row is one-hot (1.0 at the token);
- otherwise, over the row's logits l (f32 of the BF16 values; a NaN counts as -inf and -0 as +0):
  z = l / T in f32 (correctly rounded division); the order is (z descending, index ascending);
  each element's mass is ``floor(e_i * 2**40)`` (u64), e_i = ``sample_exp(z_i - z_max)``, this
  module's f32 exponential (only correctly rounded multiplies and adds, so the device and the twin
  get the same bits); top-k keeps the first ``top_k`` of the order (0 or >= n: all); top-p keeps the
  shortest prefix of those whose summed mass reaches ``need = ceil(f64(top_p) * f64(total kept by
  top-k))``; the token is the argmax over the kept set S of ``f32(z_i + g_i)``, g_i the keyed
  Gumbel noise (seed, position, draft index, Stream.DRAFT, i), the lower index on a tie;
  ``q_i = f32(f64(e_i) * inv)`` on S (0 elsewhere) with ``inv = 2**40 / f64(sum of S's masses)``;
  the token goes into entries[e].token and drafts[e * kmax + draft_index];
- a sampled row whose largest z is not finite (a +inf logit, every logit NaN or -inf, or l / T
  overflowing) is committed as a greedy one (the head's token, q = 1, one-hot);
- probs[e * kmax + draft_index] = q(token) (f32); with ``publish``, drafts[e * kmax + 0 ..
  draft_index] and probs[e * kmax + 0 .. draft_index] are copied to host_drafts and host_probs at
  the same offsets (mapped host memory: the step's one copy back, so the head runs with publish
  off in a sampled step).

Every sum is an integer sum (masses, counts) and every float operation is a correctly rounded one
in a fixed order, so the kept set, the masses, inv and every q_i are exact functions of the row's
logits and record: the same bits on every launch, for any m, in any batch (batch invariance), and
the host twins below compute the very same bits (tests/test_gpu_draft_sample.py holds the device
to them). The one exception is the Gumbel noise: the device's logf and NumPy's f32 log may differ
by an ulp, so a token may differ where the two best perturbed scores are within rounding of each
other. Against model/sampling.py's float64 reference the probabilities differ by the f32 rounding
of z - z_max and of the exponential and by the mass truncation (at most n * 2**-40 of the total):
a relative 4e-7 + 1.2e-7 * |z_i - z_max|; the kept set can differ only where a top-p prefix sum
lies within that of top_p.

Four launches (graph-capturable, fixed grids for given m and n, no host synchronisation), each
declared Pdl.WAIT (it waits at its top and releases its dependents at exit); a greedy or padding
entry's blocks return at once except in the last. A sampled row whose record restricts nothing
(``Record.keeps_all``: top-k 0 or >= n, top-p not below 1; S is the whole row) needs no histogram:
1 finds only its largest key, 2 writes its state without the total, 3 sums its elements' masses
(an integer sum: the same total as the histogram's, in any order) and its last block derives inv,
4 has no histogram to zero. Its state words and outputs are the same bits as through the histogram.

1. ``sample_hist_batch`` (1024 threads, chunks of HIST_CHUNK elements, HIST_SMEM bytes of dynamic
   shared memory): a 65,536-bin histogram per sampled row of the elements' 16-bit order keys (the
   BF16 bits made monotone: z is a non-decreasing function of the key, so a bin is one value of z
   and a run of equal z is an interval of keys), and the row's largest key; each block counts in
   shared memory (16-bit counts, flushed at least every 7 chunks so none overflows) and adds
   only its nonzero counts to the row's histogram in global memory;
2. ``sample_select_batch`` (one block of 1024 threads per row): scans the histogram (a bin's mass
   is its count times the mass of its key) and resolves the kept set to "every key above hi, and
   of the keys in [lo, hi] (one value of z) the jstar lowest indices" (jstar 0: all of them);
3. ``sample_index_batch`` (chunks of INDEX_CHUNK): where jstar > 0, the chunks count the run's
   elements and the row's last block finds the index of the jstar-th (istar); where the row keeps
   every element, the total mass (u64 atomics, one a block) and inv (the row's last block);
4. ``sample_draw_batch`` (chunks of DRAW_CHUNK): the Gumbel-max over the kept set (noise only where
   it can still win: an element whose ``z + 17`` is below a score already reached, or below
   ``z_max - 3``, cannot; nor one whose ``z`` plus a bound of its noise from its uniform, 0.5, 2 or
   6 below u = 0.5, 0.87 or 0.997, is: then its logarithms are skipped), the dist rows, then the
   commit and publish by the row's last block; it zeroes the histograms again.

In 1, 3 and 4 the blocks of a row stride over its chunks, ``row_blocks`` per row: one wave for the
whole batch (152 draw blocks for one row of 154,880, 16 a row at m = 64).

Workspace (``sample_workspace_bytes(m, n)``, 16-byte aligned, allocated once per bucket and zeroed
once: every launch leaves the histograms, counters and the best key zero again): m histograms of
HIST_BINS u32, then m row states of ROW_STATE_BYTES, then m x ceil(n / INDEX_CHUNK) u32 chunk
counts. See _State for the row state's words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from runtime.device_ptr import DevicePtr
from runtime.kernel import PTR, U32, declare
from runtime.launch import grid_stride_blocks, launch

from ..sampling import SamplingParams
from .batch import ENTRY_BYTES, check_rows, is_pad, read_entries
from .keyed_rng import Stream, uniforms

SAMPLE_WORDS = 8
HIST_BINS = 65536
HIST_BYTES = 4 * HIST_BINS
ROW_STATE_BYTES = 64
HIST_CHUNK = 8192  # elements per block: sample_hist_batch (HIST_THREADS, eight each)
HIST_THREADS = 1024
HIST_SMEM = 2 * HIST_BINS  # sample_hist_batch's dynamic shared memory: a 16-bit count per key
INDEX_CHUNK = 4096  # sample_index_batch (256 threads)
DRAW_CHUNK = 1024  # sample_draw_batch (256 threads, four each)
# Masses are u64 sums of up to n terms of at most 2**40: n < 2**24 keeps every sum below 2**64.
MAX_VOCAB = (1 << 24) - 1
FIX_SCALE = 2.0**40

KEY_NEG_INF = 0x007F  # the order key of -inf (and of NaN, which counts as -inf)
KEY_POS_INF = 0xFF80  # the order key of +inf


def _f32(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


# sample_exp's constants, as bits so that the CUDA source (the same hex words) cannot round them
# another way: log2(e), ln 2 split in a 9-bit high part (k * LN2_HI is exact for |k| < 2**15) and
# the rest, and the Taylor coefficients 1 / j! of e^r on |r| <= ln(2) / 2 (degree 7: truncation
# below 6e-9 relative).
_LOG2E = _f32(0x3FB8AA3B)
_LN2_HI = _f32(0x3F318000)
_LN2_LO = _f32(0xB95E8083)
_TAYLOR = [_f32(b) for b in (0x39500D01, 0x3AB60B61, 0x3C088889, 0x3D2AAAAB, 0x3E2AAAAB, 0x3F000000)]
_ONE = np.float32(1.0)
_EXP_FLOOR = np.float32(-86.0)  # below: 0 (e^-86 < 2**-124: 2**k stays a normal number above)


def sample_exp(x: np.ndarray) -> np.ndarray:
    """f32 e^x for x <= 0 as ptx/draft_sample.cu computes it (bit for bit): k = rint(x * log2e),
    r = (x - k * LN2_HI) - k * LN2_LO, the degree-7 Taylor polynomial by Horner (multiply, then
    add: no fused multiply-add), times 2**k; 0 below -86 (and for -inf). Within a few ulp of e^x.
    e^0 is exactly 1."""
    x = np.asarray(x, np.float32)
    live = x >= _EXP_FLOOR
    xs = np.where(live, x, np.float32(0.0))
    k = np.rint(xs * _LOG2E)
    r = (xs - k * _LN2_HI) - k * _LN2_LO
    p = _TAYLOR[0]
    for c in _TAYLOR[1:]:
        p = p * r + c
    p = p * r + _ONE
    p = p * r + _ONE
    scale = ((k.astype(np.int32) + 127) << 23).astype(np.int32).view(np.float32)
    return np.where(live, p * scale, np.float32(0.0)).astype(np.float32)


def fixed_mass(e: np.ndarray) -> np.ndarray:
    """u64 floor(e * 2**40) (e in [0, 1]: the scaling is exact, the conversion truncates)."""
    return (np.asarray(e, np.float32) * np.float32(FIX_SCALE)).astype(np.uint64)


def order_keys(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u32 order keys, f32 values) of BF16 bit patterns: NaN becomes -inf and -0 becomes +0, then
    the key is the bits with the sign bit set for a positive value and all bits flipped for a
    negative one, so a larger key is a larger value."""
    b = np.asarray(bits, np.uint16).astype(np.uint32)
    b = np.where((b & 0x7FFF) > 0x7F80, np.uint32(0xFF80), b)
    b = np.where(b == 0x8000, np.uint32(0), b)
    keys = np.where(b & 0x8000, ~b & 0xFFFF, b | 0x8000).astype(np.uint32)
    return keys, (b << 16).astype(np.uint32).view(np.float32)


def key_values(keys: np.ndarray) -> np.ndarray:
    """The f32 value of each order key (the inverse of order_keys on canonical values)."""
    k = np.asarray(keys, np.uint32)
    b = np.where(k & 0x8000, k & 0x7FFF, ~k & 0xFFFF).astype(np.uint32)
    return (b << 16).view(np.float32)


_VALID_KEYS = np.arange(KEY_NEG_INF, KEY_POS_INF + 1, dtype=np.uint32)
_VALID_VALUES = key_values(_VALID_KEYS)


def group_keys(zg: np.float32, t: np.float32) -> tuple[int, int]:
    """[lo, hi]: the order keys (of numbers, -inf .. +inf) whose z equals zg. z is monotone in the
    key, so they are an interval; it holds more than one key only where l / t rounds several BF16
    values to one f32 (overflow, underflow, the two zeros)."""
    with np.errstate(over="ignore", under="ignore"):
        hit = np.flatnonzero((_VALID_VALUES / t) == zg)
    return int(_VALID_KEYS[hit[0]]), int(_VALID_KEYS[hit[-1]])


# ---- the per-entry record ---------------------------------------------------------------------------


def pack_sampling(params: SamplingParams, position: int, dist_addr: int) -> np.ndarray:
    """u32 [SAMPLE_WORDS]: one entry's record (module docstring). ``dist_addr`` 0: no distribution;
    else a device address, 4-byte aligned, of f32 [kmax'][n] (row draft_index per draft). Raises
    ValueError naming the field before anything is written. The vocabulary bound of top_k is the
    caller's (SamplingParams.check(vocab)); a top_k >= n keeps every token."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"pack_sampling: params must be SamplingParams, got {type(params).__name__}")
    params.check(0xFFFF_FFFF, "pack_sampling")
    with np.errstate(over="ignore"):
        t32 = np.float32(params.temperature)
    if not np.isfinite(t32):
        raise ValueError(f"pack_sampling: temperature {params.temperature!r} overflows f32")
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not 0 <= position < 2**32:
        raise ValueError(f"pack_sampling: position {position!r} must be an integer in 0 .. 2**32 - 1")
    if isinstance(dist_addr, DevicePtr):
        dist_addr = dist_addr.addr
    if (
        isinstance(dist_addr, bool)
        or not isinstance(dist_addr, (int, np.integer))
        or not 0 <= dist_addr < 2**64
        or dist_addr % 4
    ):
        raise ValueError(f"pack_sampling: dist address {dist_addr!r} must be 0 or a 4-byte aligned address")
    seed, addr = int(params.seed), int(dist_addr)
    rec = np.zeros(SAMPLE_WORDS, np.uint32)
    rec[0] = np.array([t32], np.float32).view(np.uint32)[0]
    rec[1] = np.array([params.top_p], np.float32).view(np.uint32)[0]
    rec[2] = int(params.top_k)
    rec[3], rec[4] = seed & 0xFFFF_FFFF, seed >> 32
    rec[5] = int(position)
    rec[6], rec[7] = addr & 0xFFFF_FFFF, addr >> 32
    return rec


@dataclass(frozen=True)
class Record:
    """A record as the kernels read it."""

    temperature: np.float32
    top_p: np.float32
    top_k: int
    seed: int
    position: int
    dist: int

    @staticmethod
    def of(words: np.ndarray) -> Record:
        w = np.asarray(words, np.uint32)
        f = w[:2].view(np.float32)
        return Record(
            f[0], f[1], int(w[2]), int(w[3]) | int(w[4]) << 32, int(w[5]), int(w[6]) | int(w[7]) << 32
        )

    @property
    def sampled(self) -> bool:
        return bool(self.temperature > 0)

    def keeps_all(self, n: int) -> bool:
        """A record that restricts nothing (top-k 0 or >= n, top-p not below 1): a sampled row's
        kept set is the whole row, so the kernels skip its histogram (the module docstring)."""
        return not self.top_p < np.float32(1.0) and (self.top_k == 0 or self.top_k >= n)


def index_blocks(n: int) -> int:
    return -(-n // INDEX_CHUNK)


def sample_workspace_bytes(m: int, n: int) -> int:
    """Bytes of draft_sample_batch's workspace for launches of up to m entries over n logits (the
    module docstring's layout); zero it once after allocating it."""
    return m * (HIST_BYTES + ROW_STATE_BYTES) + 16 * (-(-(m * index_blocks(n) * 4) // 16))


def _state_ptr(workspace: DevicePtr, m: int, e: int) -> DevicePtr:
    return workspace.offset(m * HIST_BYTES + e * ROW_STATE_BYTES)


# ---- the arithmetic (the twins' and, operation for operation, the kernels') ------------------------


@dataclass
class _State:
    """A row's state after sample_hist_batch (and istar after sample_index_batch), in the u32 words
    of its ROW_STATE_BYTES: [0] largest key, [1..3] the kernels' counters, [4..5] the best draw key
    (those stay zero between launches), [6] mode (1 sampled, 0 greedy-like), [7] z_max (f32), [8] lo,
    [9] hi, [10] jstar (0: the whole [lo, hi] run is kept), [11] istar, [12..13] inv (f64),
    [14..15] total mass of S (u64). S = {key > hi} + {lo <= key <= hi, index <= istar}; lo = hi =
    0 when S is the whole row."""

    mode: int
    zmax: np.float32 = np.float32(0.0)
    lo: int = 0
    hi: int = 0
    jstar: int = 0
    istar: int = 0xFFFF_FFFF
    inv: float = 0.0
    total: int = 0

    def words(self) -> np.ndarray:
        w = np.zeros(10, np.uint32)
        w[0] = self.mode
        w[1] = np.array([self.zmax], np.float32).view(np.uint32)[0]
        w[2:6] = self.lo, self.hi, self.jstar, self.istar
        w[6:8] = np.array([self.inv], np.float64).view(np.uint32)
        w[8:10] = np.array([self.total], np.uint64).view(np.uint32)
        return w

    @staticmethod
    def of(words: np.ndarray) -> _State:
        w = np.asarray(words, np.uint32)
        return _State(
            int(w[0]),
            w[1:2].view(np.float32)[0],
            int(w[2]),
            int(w[3]),
            int(w[4]),
            int(w[5]),
            float(w[6:8].view(np.float64)[0]),
            int(w[8:10].view(np.uint64)[0]),
        )


_STATE_WORD0 = 6  # the first of _State.words() in a row state
_STATE_WORDS = 10


def _row_z(bits: np.ndarray, t: np.float32) -> tuple[np.ndarray, np.ndarray]:
    keys, l = order_keys(bits)
    with np.errstate(over="ignore", under="ignore"):
        return keys, l / t


def select_state(bits: np.ndarray, rec: Record) -> _State:
    """sample_hist_batch's state for one sampled row (istar not yet resolved), from a sort: the
    kernel finds the same numbers by scanning its histogram."""
    n = bits.shape[0]
    keys, z = _row_z(bits, rec.temperature)
    # z of the largest key (the kernel's): z.max() might be -0.0 where that is +0.0.
    with np.errstate(over="ignore", under="ignore"):
        zmax = key_values(keys.max()) / rec.temperature
    if not np.isfinite(zmax):
        return _State(0)
    with np.errstate(over="ignore"):
        e = sample_exp(z - zmax)  # an overflowing difference is -inf: mass 0, as on the device
    mass = fixed_mass(e)
    order = np.lexsort((np.arange(n), -z))
    c = np.cumsum(mass[order], dtype=np.uint64)
    jk = rec.top_k if 0 < rec.top_k < n else n
    total_k = int(c[jk - 1])
    j = jk
    if rec.top_p < np.float32(1.0):
        need = min(max(math.ceil(float(rec.top_p) * float(total_k)), 1), total_k)
        j = int(np.searchsorted(c[:jk], np.uint64(need), side="left")) + 1
    total = int(c[j - 1])
    st = _State(1, zmax, inv=FIX_SCALE / float(total), total=total)
    if j < n:
        zg = z[order[j - 1]]
        above = int(np.count_nonzero(z > zg))
        size = int(np.count_nonzero(z == zg))
        st.lo, st.hi = group_keys(zg, rec.temperature)
        st.jstar = j - above if j - above < size else 0
    return st


def resolve_istar(bits: np.ndarray, st: _State) -> int:
    """sample_index_batch: the index of the jstar-th element (lowest index first) of [lo, hi]."""
    keys, _ = order_keys(bits)
    run = np.flatnonzero((keys >= st.lo) & (keys <= st.hi))
    return int(run[st.jstar - 1])


def kept_mask(bits: np.ndarray, st: _State) -> np.ndarray:
    keys, _ = order_keys(bits)
    idx = np.arange(bits.shape[0], dtype=np.int64)
    return (keys > st.hi) | ((keys >= st.lo) & (idx <= st.istar))


def draw_row(bits: np.ndarray, rec: Record, st: _State, draft_index: int) -> tuple[int, np.ndarray]:
    """(token, f32 q over the row) of a sampled row from its resolved state: Gumbel-max over S."""
    _, z = _row_z(bits, rec.temperature)
    s_mask = kept_mask(bits, st)
    kept = np.flatnonzero(s_mask)
    u = uniforms(rec.seed, rec.position, draft_index, Stream.DRAFT, kept.astype(np.uint64))
    g = -np.log(-np.log(u))
    score = z[kept] + g
    token = int(kept[score == score.max()].min())
    with np.errstate(over="ignore"):
        e = sample_exp(z - st.zmax)
    q = np.where(s_mask, (e.astype(np.float64) * st.inv).astype(np.float32), np.float32(0.0))
    return token, q.astype(np.float32)


@dataclass(frozen=True)
class RowSample:
    """One row's outcome, as the three kernels leave it."""

    token: int
    q: np.float32
    dist: np.ndarray  # f32 [n]
    kept: np.ndarray  # bool [n]: the set S drawn from (one token when greedy-like)
    state: _State


def sample_row(bits: np.ndarray, rec: Record, head_token: int, draft_index: int) -> RowSample:
    """The whole pipeline for one row (the twins in one call): what the tests compare against."""
    bits = np.asarray(bits, np.uint16)
    n = bits.shape[0]
    st = select_state(bits, rec) if rec.sampled else _State(0)
    if st.mode == 0:
        dist = np.zeros(n, np.float32)
        dist[head_token] = 1.0
        return RowSample(head_token, np.float32(1.0), dist, dist > 0, st)
    if st.jstar:
        st.istar = resolve_istar(bits, st)
    token, q = draw_row(bits, rec, st, draft_index)
    return RowSample(token, q[token], q, kept_mask(bits, st), st)


# ---- the kernels and their twins -------------------------------------------------------------------
#
# The twins model the workspace too: the histogram and the largest key as sample_hist_batch leaves
# them, the state words sample_select_batch writes (only the mode word of a greedy-like row), the
# chunk counts and istar of sample_index_batch, and the histogram zeroed again by sample_draw_batch;
# so a test can hold the device's whole workspace to the twin's after a launch.


def _live_records(mem, sampling, entries, m: int):
    """(e, record) of every live entry of the launch (padding records are not read)."""
    ent = read_entries(mem, entries, m)
    recs = mem.read(sampling, np.uint32, (m, SAMPLE_WORDS))
    return [(e, Record.of(recs[e])) for e in range(m) if not is_pad(ent[e])]


def _row_bits(mem, logits, e: int, n: int) -> np.ndarray:
    return mem.read(logits.offset(e * n * 2), np.uint16, n)


def _read_state(mem, workspace, m: int, e: int) -> _State:
    words = mem.read(_state_ptr(workspace, m, e), np.uint32, ROW_STATE_BYTES // 4)
    return _State.of(words[_STATE_WORD0 : _STATE_WORD0 + _STATE_WORDS])


def _write_state(mem, workspace, m: int, e: int, st: _State) -> None:
    words = st.words() if st.mode else st.words()[:1]  # a greedy-like row: the mode word alone
    mem.write(_state_ptr(workspace, m, e).offset(4 * _STATE_WORD0), words)


_FRONT = [("logits", PTR), ("sampling", PTR), ("entries", PTR), ("workspace", PTR), ("m", U32), ("n", U32)]


@declare("draft_sample", "sample_hist_batch", _FRONT, writes=("workspace",), pdl=True)
def SAMPLE_HIST_BATCH(mem, logits, sampling, entries, workspace, m, n):
    """Every live sampled row: its keys counted into its histogram (not where the row keeps every
    element), its largest key (state word 0)."""
    for e, rec in _live_records(mem, sampling, entries, m):
        if not rec.sampled:
            continue
        keys, _ = order_keys(_row_bits(mem, logits, e, n))
        if not rec.keeps_all(n):
            hist = mem.view(workspace.offset(e * HIST_BYTES), np.uint32, HIST_BINS)
            hist += np.bincount(keys, minlength=HIST_BINS).astype(np.uint32)
        top = mem.view(_state_ptr(workspace, m, e), np.uint32, 1)
        top[0] = max(int(top[0]), int(keys.max()))


@declare("draft_sample", "sample_select_batch", _FRONT, writes=("workspace",), pdl=True)
def SAMPLE_SELECT_BATCH(mem, logits, sampling, entries, workspace, m, n):
    """Every live sampled row's state (from a sort; the kernel scans the histogram), and its
    largest key back to zero. A row that keeps every element gets its state without the total mass
    and inv (0 both: sample_index_batch's)."""
    for e, rec in _live_records(mem, sampling, entries, m):
        if rec.sampled:
            st = select_state(_row_bits(mem, logits, e, n), rec)
            if st.mode and rec.keeps_all(n):
                st.inv, st.total = 0.0, 0
            _write_state(mem, workspace, m, e, st)
            mem.write(_state_ptr(workspace, m, e), np.zeros(1, np.uint32))


@declare("draft_sample", "sample_index_batch", _FRONT, writes=("workspace",), pdl=True)
def SAMPLE_INDEX_BATCH(mem, logits, sampling, entries, workspace, m, n):
    """Every live sampled row whose boundary cuts its run of equal z (jstar > 0): the run's count
    per INDEX_CHUNK chunk, and istar; every live sampled row that keeps every element: its total
    mass and inv."""
    chunks = index_blocks(n)
    for e, rec in _live_records(mem, sampling, entries, m):
        if not rec.sampled:
            continue
        st = _read_state(mem, workspace, m, e)
        if st.mode and rec.keeps_all(n):
            _write_state(mem, workspace, m, e, select_state(_row_bits(mem, logits, e, n), rec))
            continue
        if not (st.mode and st.jstar):
            continue
        bits = _row_bits(mem, logits, e, n)
        keys, _ = order_keys(bits)
        run = (keys >= st.lo) & (keys <= st.hi)
        pad = np.zeros(chunks * INDEX_CHUNK, bool)
        pad[:n] = run
        counts = pad.reshape(chunks, INDEX_CHUNK).sum(axis=1).astype(np.uint32)
        mem.write(workspace.offset(m * (HIST_BYTES + ROW_STATE_BYTES) + e * chunks * 4), counts)
        st.istar = resolve_istar(bits, st)
        _write_state(mem, workspace, m, e, st)


@declare(
    "draft_sample",
    "sample_draw_batch",
    [
        ("logits", PTR),
        ("sampling", PTR),
        ("entries", PTR),
        ("drafts", PTR),
        ("probs", PTR),
        ("host_drafts", PTR),
        ("host_probs", PTR),
        ("draft_index", U32),
        ("kmax", U32),
        ("publish", U32),
        ("m", U32),
        ("n", U32),
        ("workspace", PTR),
    ],
    writes=("entries", "drafts", "probs", "host_drafts", "host_probs", "workspace"),
    pdl=True,
)
def SAMPLE_DRAW_BATCH(
    mem,
    logits,
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
    n,
    workspace,
):
    """The draw, the dist rows (at the records' addresses), the commit and publish of every live
    entry (the module docstring's rules); a sampled row's histogram zeroed again (one that keeps
    every element was never counted into)."""
    ent = read_entries(mem, entries, m)
    for e, rec in _live_records(mem, sampling, entries, m):
        st = _State(0)
        if rec.sampled:
            st = _read_state(mem, workspace, m, e)
            if not rec.keeps_all(n):
                mem.write(workspace.offset(e * HIST_BYTES), np.zeros(HIST_BINS, np.uint32))
        if st.mode == 0:
            t = int(ent[e, 2])
            q = np.float32(1.0)
            dist = np.zeros(n, np.float32)
            dist[t] = 1.0
        else:
            t, dist = draw_row(_row_bits(mem, logits, e, n), rec, st, draft_index)
            q = dist[t]
        if rec.dist:
            mem.write(DevicePtr(rec.dist + draft_index * n * 4), dist)
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
            token=None if st.mode == 0 else t,
            q=q,
            publish=publish,
        )


def commit_draft(
    mem, *, entries, drafts, probs, host_drafts, host_probs, e, kmax, draft_index, token, q, publish
) -> None:
    """The twins' commit of entry e's draft (both samplers, ptx/draft_sample*.cu): ``token`` into
    entries[e].token and drafts[e * kmax + draft_index] (None: the head's token stays), q into
    probs; with ``publish`` the entry's drafts and probs 0..draft_index into the host copies."""
    if token is not None:
        tok = np.array([token], np.uint32)
        mem.write(entries.offset(e * ENTRY_BYTES + 8), tok)
        mem.write(drafts.offset((e * kmax + draft_index) * 4), tok)
    mem.write(probs.offset((e * kmax + draft_index) * 4), np.array([q], np.float32))
    if publish:
        row = e * kmax * 4
        mem.write(host_drafts.offset(row), mem.read(drafts.offset(row), np.uint32, draft_index + 1))
        mem.write(host_probs.offset(row), mem.read(probs.offset(row), np.float32, draft_index + 1))


def row_blocks(gpu, m: int, n: int) -> tuple[int, int, int]:
    """Blocks per row of sample_hist_batch, sample_index_batch and sample_draw_batch: the blocks of
    a row stride over its chunks, and the m rows share one wave of resident blocks (at most one
    block per chunk; grid_stride_blocks evens out the rounds). The split cannot change a result:
    every combination across blocks is an integer sum or a max of unique keys."""
    out = []
    for decl, chunk, threads, smem in (
        (SAMPLE_HIST_BATCH, HIST_CHUNK, HIST_THREADS, HIST_SMEM),
        (SAMPLE_INDEX_BATCH, INDEX_CHUNK, 256, 0),
        (SAMPLE_DRAW_BATCH, DRAW_CHUNK, 256, 0),
    ):
        per_row = max(1, gpu.resident_blocks(gpu.kernel(*decl.key), threads, smem) // m)
        out.append(grid_stride_blocks(-(-n // chunk), per_row))
    return out[0], out[1], out[2]


def _check(m: int, n: int, draft_index: int, kmax: int, workspace) -> None:
    check_rows("draft_sample_batch", m)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_VOCAB:
        raise ValueError(f"draft_sample_batch: n={n!r} logits per row outside 1..{MAX_VOCAB}")
    if not 1 <= kmax or not 0 <= draft_index < kmax:
        raise ValueError(f"draft_sample_batch: draft_index={draft_index} outside 0..kmax-1 (kmax={kmax})")
    if not isinstance(workspace, DevicePtr) or not workspace or workspace.addr % 16:
        raise ValueError(
            f"draft_sample_batch: workspace {workspace!r} must be a 16-byte aligned device pointer"
        )


def draft_sample_batch(
    gpu,
    *,
    logits,
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
    n,
    workspace,
    stream=None,
):
    """Sample the drafts of the m entries at ``entries`` (u32 [m][4]) from the head's logits (BF16
    [m][n], row e for entry e) by their records ``sampling`` (u32 [m][SAMPLE_WORDS], pack_sampling),
    right after the head of the same draft: see the module docstring for the rules. drafts, probs
    (f32), host_drafts and host_probs (mapped) are [m][kmax]; ``workspace`` holds
    sample_workspace_bytes(m, n) bytes, zeroed once after allocation. Padding entries write
    nothing. A row's results are bit-identical whatever m and whatever the other rows."""
    _check(m, n, draft_index, kmax, workspace)
    front = (logits, sampling, entries, workspace, m, n)
    hist, index, draw = row_blocks(gpu, m, n)
    k = gpu.kernel
    launch(gpu, k(*SAMPLE_HIST_BATCH.key), (hist, m), HIST_THREADS, *front, smem=HIST_SMEM, stream=stream)
    launch(gpu, k(*SAMPLE_SELECT_BATCH.key), (1, m), 1024, *front, stream=stream)
    launch(gpu, k(*SAMPLE_INDEX_BATCH.key), (index, m), 256, *front, stream=stream)
    launch(
        gpu,
        k(*SAMPLE_DRAW_BATCH.key),
        (draw, m),
        256,
        logits,
        sampling,
        entries,
        drafts,
        probs,
        host_drafts,
        host_probs,
        draft_index,
        kmax,
        int(bool(publish)),
        m,
        n,
        workspace,
        stream=stream,
    )
