"""The CUDA proposer against transformers' glm_moe_dsa and deepseek_v32 (the fixtures and the
comparison of tests/test_oracle_family.py, the same tolerances): the kernels' RoPE, per-token
indexer and group-limited routing, eager and as bucket graphs, CUDA-core and tensor-core forms."""

from __future__ import annotations

import pytest

from tests.test_oracle_family import fixture, proposer_against_transformers  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    from runtime.cuda_backend import CudaBackend

    gpu = CudaBackend()
    yield gpu
    gpu.close()


@pytest.mark.parametrize("fp8_head", [False, True], ids=["bf16-head", "fp8-head"])
@pytest.mark.parametrize(
    "options",
    [{}, {"use_graphs": True, "max_sequences": 4}],
    ids=["one-sequence", "graphs-four-sequences"],
)
def test_cuda_proposer_against_transformers(cuda, fixture, fp8_head, options):  # noqa: F811
    proposer_against_transformers(cuda, fixture, fp8_head, **options)
