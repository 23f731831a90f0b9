"""The programmatic-dependent-launch contract (runtime.kernel.KernelDecl.pdl), checked on the
committed PTX of every kernel declared ``pdl=True``: a backend starts such a kernel while the one
before it still runs, so the kernel must wait (griddepcontrol.wait) before its first store to
memory and before any return, and it must release its own successor (launch_dependents), or the
overlap the flag asks for never happens. A kernel that stored before the wait would race with the
kernels before it; one that could return before waiting could complete ahead of its predecessor and
let its successor read stale data. These checks are textual over the PTX in program order, which
is the order nvcc emits basic blocks in for these kernels (the early returns are forward branches
to the end); the GPU tests (tests/test_gpu_pdl.py) check the results bit for bit with PDL on and off.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import model.kernels  # noqa: F401  (declares the model's kernels)
import runtime.kernels.copy_words  # noqa: F401  (the one runtime kernel that releases its dependents)
from runtime.kernel import PTR, Pdl, declare, registered

PTX_DIR = Path(__file__).resolve().parent.parent / "ptx"
PDL_DECLS = [d for d in registered() if d.pdl]
RELEASING = [d for d in registered() if d.releases]

# Stores that can reach global memory: st.global, generic st (no state space), atomics, reductions.
_GLOBAL_STORE = re.compile(
    r"^\s*(@!?%p\d+\s+)?(st\.(global|(?!shared|local|param)[a-z0-9]+)|atom\.|red\.)", re.MULTILINE
)
_RET = re.compile(r"^\s*(@!?%p\d+\s+)?ret;", re.MULTILINE)


def entry_body(module: str, function: str) -> str:
    text = (PTX_DIR / f"{module}.ptx").read_text()
    m = re.search(rf"\.entry {re.escape(function)}\(", text)
    assert m, f"{module}.ptx has no .entry {function}"
    start = text.index("{", m.end())
    depth, i = 0, start
    while True:
        c = text[i]
        depth += c == "{"
        depth -= c == "}"
        i += 1
        if depth == 0:
            return text[start:i]


def test_the_drafter_step_kernels_take_part():
    """The flags are on where the step spends its launches (a regression that drops one silently
    costs the overlap, not correctness)."""
    modes = {d.function: d.pdl for d in PDL_DECLS}
    assert {
        "rmsnorm_gemv_seg_batch",
        "rmsnorm_gemv_seg_bf16_batch",
        "dsa_cache_write_batch",
        "select_radix_hist_batch",
        "select_topk_pools_batch",
        "bgemv_bf16_f32_batch",
        "sparse_mla_partial_batch",
        "sparse_mla_combine_batch",
        "sparse_mla_partial_wide_batch",
        "sparse_mla_combine_wide_batch",
        "router_group_batch",
        "moe_gate_up_batch",
        "moe_down_batch",
        "sum_rows_residual_rmsnorm_batch",
        "head_argmax_fp8_batch",
        "head_argmax_bf16_batch",
    } <= {f for f, m in modes.items() if m is Pdl.WAIT}
    assert {f for f, m in modes.items() if m is Pdl.BESIDE} == {
        "mtp_input_gemv_batch",
        "bgemv_bf16_f32_batch_beside",
        "rmsnorm_gemv_seg_batch_beside",
        "rmsnorm_gemv_seg_bf16_batch_beside",
        "bgemv_fp8_f32_batch_beside",
    }
    assert {d.function for d in RELEASING} == {
        "copy_words",
        "dsa_cache_write_batch",
        "dsa_cache_write_plain_batch",
        "indexer_scores_batch",
        "indexer_scores_batch_mma2",
        "select_radix_hist_batch",
        "select_topk_pools_batch",
        "extend_selection_batch",
        "sparse_mla_partial_batch",
        "sparse_mla_combine_batch",
        "sparse_mla_partial_wide_batch",
        "sparse_mla_combine_wide_batch",
        "head_argmax_fp8_batch",
        "head_argmax_bf16_batch",
        "head_argmax_fp8_mma",
        "head_argmax_fp8_mma_v1",
        "bgemv_bf16_f32_batch",
        "bgemv_bf16_bf16_batch",
        "bgemv_fp8_f32_batch",
        "bgemv_fp8_bf16_batch",
        "sum_rows_residual_rmsnorm_batch",
    }


@pytest.mark.parametrize("decl", PDL_DECLS, ids=lambda d: f"{d.module}.{d.function}")
def test_pdl_kernel_waits_before_returning(decl):
    """Every mode: the wait exists and no return comes ahead of it (a grid that could complete
    before its predecessor would break "my predecessor completed" for the kernel after it)."""
    body = entry_body(decl.module, decl.function)
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0, f"{decl.function} is declared {decl.pdl} but never executes griddepcontrol.wait"
    assert _RET.search(body[:wait]) is None, f"{decl.function} can return before griddepcontrol.wait"


@pytest.mark.parametrize(
    "decl", [d for d in PDL_DECLS if d.pdl is Pdl.WAIT], ids=lambda d: f"{d.module}.{d.function}"
)
def test_wait_kernel_stores_nothing_before_its_wait(decl):
    body = entry_body(decl.module, decl.function)
    head = body[: body.find("griddepcontrol.wait")]
    store = _GLOBAL_STORE.search(head)
    assert store is None, f"{decl.function} stores before griddepcontrol.wait: {store.group(0).strip()!r}"


@pytest.mark.parametrize("decl", RELEASING, ids=lambda d: f"{d.module}.{d.function}")
def test_releasing_kernel_releases_once_everything_before_it_completed(decl):
    """Plain: at its start (nothing stored or returned before). WAIT: only after its own wait, so a
    BESIDE successor never starts while the releasing kernel's predecessor may still be writing."""
    body = entry_body(decl.module, decl.function)
    rel = body.find("griddepcontrol.launch_dependents")
    assert rel >= 0, f"{decl.function} is declared releases=True but never executes launch_dependents"
    assert decl.pdl is not Pdl.BESIDE
    if decl.pdl is Pdl.NONE:
        assert _GLOBAL_STORE.search(body[:rel]) is None and _RET.search(body[:rel]) is None
    else:
        wait = body.find("griddepcontrol.wait")
        assert 0 <= wait < rel, f"{decl.function} can release its dependents before its own wait"


def test_a_beside_kernel_cannot_release():
    with pytest.raises(ValueError, match="cannot be Pdl.BESIDE"):
        declare("test_pdl", "bad", [("x", PTR)], pdl=Pdl.BESIDE, releases=True)(lambda mem, x: None)


def test_the_store_pattern_finds_global_and_generic_stores():
    """The check above would pass vacuously if its pattern never matched."""
    for line in (
        "\tst.global.u32 \t[%rd4], %r3;",
        "\t@%p1 st.u16 \t[%rd2], %rs1;",
        "\tatom.global.add.u32 %r1, [%rd1], 1;",
        "\tred.global.max.u64 [%rd1], %rd2;",
    ):
        assert _GLOBAL_STORE.search(line), line
    for line in (
        "\tst.shared.f32 \t[%r2], %f1;",
        "\tst.local.u32 [%rd1], %r1;",
        "\tld.global.u32 %r1, [%rd1];",
    ):
        assert not _GLOBAL_STORE.search(line), line


# What each kernel reads that a kernel releasing its dependents early (right after its wait, before
# it completes) may still be writing, and the PTX form that read must not take: the read-only path
# (ld.global.nc) may serve data that no grid writes during the reader's lifetime only. On the H200
# a token read this way drafted other tokens with PDL than without (ptx/common.cuh).
_READ_ONLY_FORMS = {
    # x through the GEMV core's __ldg: the BF16 chunks of an activation vector.
    "x": re.compile(r"ld\.global\.nc\.v4\.u32\s"),
    "f32": re.compile(r"ld\.global\.nc(\.v[24])?\.f32\s"),
    "u32": re.compile(r"ld\.global\.nc\.u32\s"),
}
_EARLY_RELEASE_SUCCESSORS = [
    ("bgemv", "bgemv_bf16_bf16_batch", "x"),  # wv after sparse_mla_combine_batch
    ("bgemv", "bgemv_bf16_f32_batch", "x"),  # o_proj after wv
    ("bgemv_fp8", "bgemv_fp8_f32_batch", "x"),  # the FP8 o_proj after wv
    ("bgemv_fp8", "bgemv_fp8_bf16_batch", "x"),
    ("moe", "router_group_batch", "x"),  # after sum_rows_residual_rmsnorm_batch
    ("draft_head", "head_argmax_bf16_batch", "x"),  # after sum_rows_residual_rmsnorm_batch
    ("draft_head", "head_argmax_fp8_batch", "x"),
    ("draft_head", "head_argmax_fp8_mma", "x"),
    ("draft_head", "head_argmax_fp8_mma_v1", "x"),
    ("bgemv", "sum_rows_residual_rmsnorm_batch", "f32"),  # o_proj's partial rows
    ("dsa_select", "select_topk_pools_batch", "f32"),  # the indexer's scores
    ("dsa_select", "select_topk_pools_batch", "u32"),  # the last radix phase's histogram and threshold
    ("dsa_select", "select_radix_hist_batch", "f32"),  # the indexer's scores
    ("dsa_select", "select_radix_hist_batch", "u32"),  # the phase before's histogram and threshold
    ("sparse_mla", "sparse_mla_combine_batch", "f32"),  # the partials and their (m, l)
    ("sparse_mla", "sparse_mla_combine_wide_batch", "f32"),  # the wide partials and their (m, l)
    ("moe", "moe_gate_up_batch", "u32"),  # the router's grouping of the expert ids
]


@pytest.mark.parametrize("module,function,form", _EARLY_RELEASE_SUCCESSORS, ids=lambda v: str(v))
def test_a_successor_of_an_early_release_reads_it_through_l2(module, function, form):
    body = entry_body(module, function)
    hit = _READ_ONLY_FORMS[form].search(body)
    assert hit is None, (
        f"{function} reads its predecessor's output through the read-only path: {hit.group(0)!r}"
    )
    assert "ld.global.cg" in body, f"{function} has no L2 load at all"


def test_the_read_only_forms_match_what_ldg_compiles_to():
    """The checks above would pass vacuously if the patterns never matched: the BESIDE wk_t GEMV
    reads its (older) x through __ldg, the router its bias, the MLA merge its count."""
    assert _READ_ONLY_FORMS["x"].search(entry_body("bgemv", "bgemv_bf16_f32_batch_beside"))
    assert _READ_ONLY_FORMS["f32"].search(entry_body("moe", "router_group_batch"))
    assert _READ_ONLY_FORMS["u32"].search(entry_body("sparse_mla", "sparse_mla_combine_batch"))
