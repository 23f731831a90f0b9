"""The drafter's kernels: one module per CUDA source in ptx/, each with its declarations, host twins
and launch helpers. Importing the package declares them all, which is how a backend learns them."""

from . import (  # noqa: F401 - imported to declare the kernels
    bgemv,
    bgemv_fp8,
    draft_head,
    draft_sample,
    draft_sample_shard,
    dsa_cache,
    dsa_select,
    moe,
    mtp_input,
    rope,
    sparse_mla,
)
