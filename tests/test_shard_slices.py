"""A sharded rank runs the same kernels as one rank over its slice of the work: its heads
(attention, the absorbed query, the value projection), its o_proj head groups, its share of the
vocabulary (the head's rows). The spec wants one GPU's bits on every rank, so each kernel must give
a row of the slice exactly the bits the whole call gives it, on the device and in the host twin.

The host twins once did not (issue 17, item 5): BLAS chose the summation order from the shapes, a
rank's one attention head differed in the last bit from the same head among four, and a 4-rank run
drafted 28 where one rank drafted 64 (tests/test_sharded.py pins that history).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_
from kernel_util import random_bf16

from model.kernels import bgemv as bg
from model.kernels import bgemv_fp8 as bf
from model.kernels import draft_head, sparse_mla
from model.kernels.batch import pack_entries
from runtime import host_math
from runtime.dtypes import BF16, quantize_rows_fp8
from runtime.host_backend import HostBackend
from runtime.host_math import dot_rows
from runtime.kernels.gemv_bf16 import gemv_bf16
from runtime.kernels.gemv_fp8w import gemv_fp8w


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    gpu.close()


def run(gpu, fn, inputs: dict[str, np.ndarray], outputs: dict[str, int]) -> dict[str, bytes]:
    """Upload ``inputs``, poison ``outputs`` (bytes; 0xFF is NaN in BF16/F32), call
    ``fn(gpu, **pointers)``, return every output's bytes."""
    ptrs = {}
    for name, a in inputs.items():
        a = np.ascontiguousarray(a)
        ptrs[name] = gpu.alloc(max(a.nbytes, 1))
        gpu.copy_h2d(ptrs[name], a)
    for name, nbytes in outputs.items():
        ptrs[name] = gpu.alloc(nbytes)
        gpu.memset(ptrs[name], 0xFF, nbytes)
    try:
        fn(gpu, **ptrs)
        gpu.synchronize()
        got = {}
        for name, nbytes in outputs.items():
            out = np.empty(nbytes, np.uint8)
            gpu.copy_d2h(out, ptrs[name])
            got[name] = out.tobytes()
        return got
    finally:
        for p in ptrs.values():
            gpu.free(p)


def shards(n: int, world: int) -> list[slice]:
    return [slice(r * (n // world), (r + 1) * (n // world)) for r in range(world)]


# ---- the host primitive ------------------------------------------------------------------------


@contextlib.contextmanager
def product_blocks(elements: int):
    """dot_rows with product blocks of ``elements`` (as small as one output element)."""
    saved, host_math._BLOCK_ELEMENTS = host_math._BLOCK_ELEMENTS, elements
    try:
        yield
    finally:
        host_math._BLOCK_ELEMENTS = saved


@settings(max_examples=60, deadline=None)
@given(
    m=st_.integers(1, 8),
    n=st_.integers(1, 120),
    k=st_.integers(1, 700),
    block=st_.sampled_from([1, 97, 1 << 22]),
    seed=st_.integers(0, 2**32 - 1),
    data=st_.data(),
)
def test_dot_rows_element_depends_on_its_two_rows_alone(m, n, k, block, seed, data):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    with product_blocks(block):
        full = dot_rows(x, w)
    i = data.draw(st_.integers(0, m - 1))
    j0 = data.draw(st_.integers(0, n - 1))
    j1 = data.draw(st_.integers(j0 + 1, n))
    # A later slice of the rows, Fortran-ordered operands, and one pair alone: the same bits.
    assert dot_rows(x[i : i + 1], w[j0:j1]).tobytes() == full[i : i + 1, j0:j1].tobytes()
    assert (
        dot_rows(np.asfortranarray(x), np.asfortranarray(w[j0:j1])).tobytes()
        == np.ascontiguousarray(full[:, j0:j1]).tobytes()
    )
    assert dot_rows(x[i : i + 1], w[j0 : j0 + 1])[0, 0] == full[i, j0]


def test_dot_rows_refuses_shapes_that_do_not_pair():
    with pytest.raises(ValueError, match=r"x \(2, 3\) and w \(4, 5\)"):
        dot_rows(np.zeros((2, 3)), np.zeros((4, 5)))


# ---- attention: a rank's heads -----------------------------------------------------------------


def attention_case(seed: int, heads: int, dim: int, count: int, context: int, bs: int = 16):
    rng = np.random.default_rng(seed)
    nblocks = -(-context // bs) + 1
    rows = np.sort(rng.choice(context, count, replace=False)).astype(np.uint32)
    cache, scales = quantize_rows_fp8(rng.standard_normal((nblocks * bs, dim)).astype(np.float32))
    return {
        "q": (rng.standard_normal((heads, dim)) * 0.3).astype(np.float32),
        "cache": cache,
        "scales": scales,
        "table": rng.permutation(nblocks).astype(np.uint32),
        "sel": rows,
        "cnt": np.array([count], np.uint32),
    }


def attention_out(gpu, case: dict, heads: int, dim: int, split: bool, cap: int) -> bytes:
    """The output of one batch entry (slot 0, its block table the case's) through the split or the
    one-pass batched attention, the selection padded to ``cap`` rows."""
    scale = 1.0 / np.sqrt(dim)
    sel = np.zeros(cap, np.uint32)
    sel[: len(case["sel"])] = case["sel"]
    inputs = {**case, "sel": sel, "ent": pack_entries([0], [0], [0])}
    geo = dict(m=1, slot_rows=len(case["table"]) * 16, sel_cap=cap, heads=heads, dim=dim, block_size=16)
    if split:
        part, ml = sparse_mla.split_workspace_batch(heads, dim, cap, 1)

        def fn(gpu, q, cache, scales, table, sel, cnt, ent, part, ml, out):
            sparse_mla.sparse_mla_split_batch(
                gpu, q=q, cache=cache, scales=scales, tables=table, selected=sel, count=cnt, part=part,
                ml=ml, out=out, entries=ent, scale=scale, **geo,
            )  # fmt: skip

        outs = {"part": part, "ml": ml, "out": heads * dim * 2}
    else:

        def fn(gpu, q, cache, scales, table, sel, cnt, ent, out):
            sparse_mla.sparse_mla_attend_batch(
                gpu, q=q, cache=cache, scales=scales, tables=table, selected=sel, count=cnt, out=out,
                entries=ent, scale=scale, **geo,
            )  # fmt: skip

        outs = {"out": heads * dim * 2}
    return run(gpu, fn, inputs, outs)["out"]


def check_attention_slices(gpu, seed, heads, world, dim, count, context, split):
    case = attention_case(seed, heads, dim, count, context)
    cap = max(context, count)
    whole = attention_out(gpu, case, heads, dim, split, cap)
    row = dim * 2
    for r, sl in enumerate(shards(heads, world)):
        mine = attention_out(gpu, {**case, "q": case["q"][sl]}, sl.stop - sl.start, dim, split, cap)
        assert mine == whole[sl.start * row : sl.stop * row], f"rank {r} of {world}, heads {sl}"


@settings(max_examples=25, deadline=None)
@given(
    heads_world=st_.sampled_from([(2, 2), (4, 2), (4, 4), (8, 4), (20, 5), (32, 2)]),
    dim=st_.sampled_from([16, 32, 48]),
    count=st_.integers(1, 150),
    split=st_.booleans(),
    seed=st_.integers(0, 2**32 - 1),
)
def test_host_attention_of_a_ranks_heads_is_those_heads_of_the_whole(heads_world, dim, count, split, seed):
    heads, world = heads_world
    check_attention_slices(HostBackend(), seed, heads, world, dim, count, count + 40, split)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads,world,dim,count,context",
    [
        (64, 8, 512, 2051, 16000),  # the full shape, 8 heads a rank: below one 16-head tile
        (64, 2, 512, 65, 100),  # two full tiles a rank, one split and one row
        (20, 5, 48, 37, 200),  # the whole has a partial tile, every rank's one tile is partial
    ],
)
@pytest.mark.parametrize("split", [True, False])
def test_gpu_attention_of_a_ranks_heads_is_those_heads_of_the_whole(
    cuda, heads, world, dim, count, context, split
):
    check_attention_slices(cuda, 17, heads, world, dim, count, context, split)


# ---- per-head projections and o_proj groups: a rank's batch entries ----------------------------


def check_bgemv_slices(gpu, seed, batch, world, n, k, out_f32, beside):
    rng = np.random.default_rng(seed)
    w, x = random_bf16(rng, (batch, n, k)), random_bf16(rng, (batch, k), exp_lo=-2)
    size = 4 if out_f32 else 2

    def call(b):  # one row of b heads (a rank's heads or head groups)
        def fn(gpu, w, x, y):
            bg.bgemv_batch(gpu, w=w, x=x, y=y, m=1, heads=b, n=n, k=k, out_f32=out_f32, beside=beside)

        return fn

    whole = run(gpu, call(batch), {"w": w, "x": x}, {"y": batch * n * size})["y"]
    for r, sl in enumerate(shards(batch, world)):
        b = sl.stop - sl.start
        mine = run(gpu, call(b), {"w": w[sl], "x": x[sl]}, {"y": b * n * size})["y"]
        assert mine == whole[sl.start * n * size : sl.stop * n * size], f"rank {r} of {world}"


@settings(max_examples=25, deadline=None)
@given(
    batch_world=st_.sampled_from([(2, 2), (4, 4), (8, 2), (8, 4), (6, 3)]),
    n=st_.integers(1, 70),
    k=st_.integers(1, 300),
    kind=st_.sampled_from(["f32", "bf16", "beside"]),
    seed=st_.integers(0, 2**32 - 1),
)
def test_host_bgemv_of_a_ranks_entries_is_those_entries_of_the_whole(batch_world, n, k, kind, seed):
    batch, world = batch_world
    check_bgemv_slices(HostBackend(), seed, batch, world, n, k, kind != "bf16", kind == "beside")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,world,n,k",
    [
        (64, 8, 512, 192),  # the absorbed query: heads x (kv_lora, nope)
        (64, 8, 256, 512),  # the value projection
        (8, 4, 4096, 2048),  # o_proj in 8 head groups
        (4, 2, 37, 100),
    ],
)
@pytest.mark.parametrize("kind", ["f32", "bf16", "beside"])
def test_gpu_bgemv_of_a_ranks_entries_is_those_entries_of_the_whole(cuda, batch, world, n, k, kind):
    check_bgemv_slices(cuda, 5, batch, world, n, k, kind != "bf16", kind == "beside")


# ---- the head and the q projection: a rank's rows of W -----------------------------------------


def gemv_rows(gpu, kind: str, w, scale, x, norm_w, n: int, k: int) -> bytes:
    """The n outputs of one row x through ``kind``: gemv_bf16, gemv_fp8w, rmsnorm_gemv_seg_batch with
    one BF16 segment (the q projection in BF16) or the single-rank fused head (head_bf16, head_fp8:
    head_argmax_batch at m = 1)."""
    inputs = {"w": w, "scale": scale, "x": x, "norm_w": norm_w}
    outs = {"y": n * 2}
    if kind.startswith("head"):
        # keys and counter are zeroed scratch the kernel leaves zeroed
        inputs.update(keys=np.zeros(1, np.uint64), counter=np.zeros(1, np.uint32))
        inputs.update(entries=pack_entries([0], [0], [0]))
        outs.update(drafts=4, host_drafts=4, flags=4)

    def fn(gpu, w, scale, x, norm_w, y, **head):
        if kind == "bf16":
            gemv_bf16(gpu, w, x, y, 1, n, k)
        elif kind == "fp8":
            gemv_fp8w(gpu, w, scale, x, y, 1, n, k)
        elif kind == "rmsnorm":
            seg = [bf.GemvSegment(w=w, scales=None, rows=n, col=0)]
            bf.rmsnorm_gemv_seg_batch(
                gpu, x=x, x_stride=k, norm_w=norm_w, segments=seg, y=y, y_stride=n, m=1, k=k, eps=1e-5
            )
        else:
            draft_head.head_argmax_batch(
                gpu,
                w=w,
                scale=scale if kind == "head_fp8" else None,
                x=x,
                logits=y,
                keys=head["keys"],
                counter=head["counter"],
                entries=head["entries"],
                drafts=head["drafts"],
                draft_index=0,
                kmax=1,
                host_drafts=head["host_drafts"],
                publish=True,
                m=1,
                n=n,
                k=k,
                flags=head["flags"],
                flag_byte=0,
            )

    return run(gpu, fn, inputs, outs)["y"]


def check_row_slices(gpu, seed, n, world, k, whole_kind, shard_kind):
    rng = np.random.default_rng(seed)
    # Normal draws (a wide spread of exponents): random_bf16's eight binades make most dot products
    # exact in f32, where no summation order shows.
    w = rng.standard_normal((n, k)).astype(BF16)
    scale = np.ones(n, np.float32)
    if "fp8" in whole_kind:
        w, scale = quantize_rows_fp8(w.astype(np.float32))  # per row: a shard's rows quantise alike
    x, norm_w = rng.standard_normal(k).astype(BF16), rng.standard_normal(k).astype(BF16)
    whole = gemv_rows(gpu, whole_kind, w, scale, x, norm_w, n, k)
    for r, sl in enumerate(shards(n, world)):
        mine = gemv_rows(gpu, shard_kind, w[sl], scale[sl], x, norm_w, sl.stop - sl.start, k)
        assert mine == whole[sl.start * 2 : sl.stop * 2], f"rank {r} of {world}: rows {sl}"


ROW_KINDS = [
    ("bf16", "bf16"),
    ("fp8", "fp8"),
    ("rmsnorm", "rmsnorm"),
    ("head_fp8", "fp8"),
    ("head_bf16", "bf16"),
]


# With numpy's matmul the f32 sums of an odd shard (97 of 194 rows) differed from the whole head's
# for about a third of the k tried, though the BF16 rounding of the logits hid it in every case
# tried: this guards the invariant rather than reproducing the failure (the attention test does).
@settings(max_examples=40, deadline=None)
@given(
    n_world=st_.sampled_from([(96, 2), (96, 4), (194, 2), (202, 2), (48, 3), (2, 2)]),
    k=st_.integers(1, 500),
    kinds=st_.sampled_from(ROW_KINDS),
    seed=st_.integers(0, 2**32 - 1),
)
def test_host_a_ranks_rows_of_a_gemv_are_those_rows_of_the_whole(n_world, k, kinds, seed):
    n, world = n_world
    check_row_slices(HostBackend(), seed, n, world, k, *kinds)


@pytest.mark.gpu
# k = 4096 is the GLM-5.3-Flash hidden (the x staging and the fused head's early first batch);
# 2 x 8545 rows are more 16-row groups than the 528 blocks resident at once, so the fused head
# grid-strides (a row's value must not depend on that either).
@pytest.mark.parametrize("n,world,k", [(17090, 2, 4096), (16896, 8, 4096), (96, 4, 64), (202, 2, 37)])
@pytest.mark.parametrize("kinds", [k for k in ROW_KINDS if k[0] != "rmsnorm"])
def test_gpu_a_ranks_rows_of_a_gemv_are_those_rows_of_the_whole(cuda, n, world, k, kinds):
    """The sharded head (gemv + argmax + key exchange) against one rank's fused head: the same
    logits bit for bit, or a near-tie would draft differently."""
    check_row_slices(cuda, 3, n, world, k, *kinds)


@pytest.mark.gpu
@pytest.mark.parametrize("n,world,k", [(20480, 8, 2048), (96, 4, 48)])
def test_gpu_a_ranks_rows_of_rmsnorm_gemv_are_those_rows_of_the_whole(cuda, n, world, k):
    check_row_slices(cuda, 4, n, world, k, "rmsnorm", "rmsnorm")
