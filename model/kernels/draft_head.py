"""The draft's exchange key and commit.

A rank's (max logit, global index) becomes one u64: the order-preserving bits of the f32 logit in
the high word, ``0xFFFFFFFF - index`` in the low word. A u64 MAX all-reduce over ranks then picks
the larger logit, and on a tie the lower index, which is the lower rank since vocabulary shards are
contiguous by rank: exactly the unsharded argmax, identical on every rank. CUDA: ptx/draft_head.cu.
"""

from __future__ import annotations

import numpy as np

from runtime.launch import launch
from runtime.kernel import PTR, U32, declare


def ordered_bits(v: np.float32) -> int:
    """Monotone u32 image of an f32. -0.0 counts as +0.0 (they tie in the unsharded argmax, so the
    lower index must win, not the sign bit) and NaN as -inf (a NaN never wins the argmax)."""
    v = np.float32(v)
    if np.isnan(v):
        v = np.float32(-np.inf)
    elif v == 0:
        v = np.float32(0.0)
    b = int(np.array([v], np.float32).view(np.uint32)[0])
    return (b ^ 0x8000_0000) if b < 0x8000_0000 else (~b & 0xFFFF_FFFF)


def pack_key(val: float, index: int) -> int:
    return (ordered_bits(np.float32(val)) << 32) | (0xFFFF_FFFF - int(index))


def unpack_index(key: int) -> int:
    return 0xFFFF_FFFF - (key & 0xFFFF_FFFF)


@declare(
    "draft_head",
    "argmax_pack",
    [("idx", PTR), ("val", PTR), ("key", PTR), ("v0", U32)],
    writes=("key",),
)
def ARGMAX_PACK(mem, idx, val, key, v0):
    """A shard with no valid logit (argmax index 0xFFFFFFFF: all NaN) packs key 0 and never wins."""
    i = int(mem.scalar(idx, np.uint32))
    v = mem.read(val, np.float32, 1)[0]
    k = 0 if i == 0xFFFF_FFFF else pack_key(v, i + v0)
    mem.write(key, np.array([k], np.uint64))


@declare(
    "draft_head",
    "draft_commit",
    [("key", PTR), ("token", PTR), ("drafts", PTR), ("slot", U32)],
    writes=("token", "drafts"),
)
def DRAFT_COMMIT(mem, key, token, drafts, slot):
    t = np.array([unpack_index(int(mem.scalar(key, np.uint64)))], np.uint32)
    mem.write(token, t)
    mem.write(drafts.offset(slot * 4), t)


def argmax_pack(gpu, idx, val, key, v0, stream=None):
    launch(gpu, gpu.kernel(*ARGMAX_PACK.key), 1, 32, idx, val, key, v0, stream=stream)


def draft_commit(gpu, key, token, drafts, slot, stream=None):
    launch(gpu, gpu.kernel(*DRAFT_COMMIT.key), 1, 32, key, token, drafts, slot, stream=stream)
