"""The one lookup every loader reads through (model/tensors.py), and state objects that hold only
the fields their dataclasses declare."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from model.checkpoint import Checkpoint, random_checkpoint, target_tensors
from model.config import tiny
from model.target import TargetModel
from model.tensors import TensorLookup, WeightError
from runtime.dtypes import BF16
from runtime.host_backend import HostBackend
from tests.proposer_fixtures import bf16_weights, make_proposer

CFG = tiny(index_topk=8, index_kpool=2, max_context=64, num_hidden_layers=2)


class HasGet:
    """A checkpoint-like source: ``has`` and ``get`` instead of a Mapping."""

    def __init__(self, d):
        self.d = d

    def has(self, name):
        return name in self.d

    def get(self, name):
        return self.d[name]


@pytest.mark.parametrize("wrap", [dict, HasGet])
def test_checked_names_the_tensor_the_expected_and_the_found(wrap):
    src = TensorLookup.of(wrap({"a": np.zeros((2, 3), BF16), "b": np.zeros(4, np.float32)}))
    assert "a" in src and "c" not in src
    assert src.checked("a", (2, 3)).shape == (2, 3)
    assert src.checked("b", (4,), np.float32).dtype == np.float32
    with pytest.raises(WeightError, match="missing tensor 'c'"):
        src.checked("c", (1,))
    with pytest.raises(WeightError, match=r"tensor 'a': expected shape \(3, 2\), found \(2, 3\)"):
        src.checked("a", (3, 2))
    with pytest.raises(WeightError, match="tensor 'b': expected dtype bfloat16, found float32"):
        src.checked("b", (4,))
    assert TensorLookup.of(src) is src


@pytest.fixture(scope="module")
def target_weights(tmp_path_factory):
    path = random_checkpoint(tmp_path_factory.mktemp("t"), CFG, seed=3, progress=False)
    return target_tensors(Checkpoint(path), CFG).load()


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.1.mlp.experts.2.up_proj.weight"])
def test_the_target_reports_a_bad_tensor_as_the_proposer_does(target_weights, name):
    """Top-level tensors and layer tensors of the target go through the same check."""
    w = dict(target_weights)
    w[name] = w[name].astype(np.float32)
    gpu = HostBackend()
    with pytest.raises(WeightError, match=f"tensor '{name}': expected dtype bfloat16, found float32"):
        TargetModel(gpu, CFG, w, 32)
    assert gpu.stats().live_bytes == 0


def _undeclared(obj) -> set[str]:
    """Attributes of a dataclass instance that are not its declared fields."""
    return set(vars(obj)) - {f.name for f in dataclasses.fields(obj)}


def test_state_objects_hold_only_their_declared_fields(target_weights):
    gpu = HostBackend()
    target = TargetModel(gpu, CFG, target_weights, 32)
    tst = target.alloc_state()
    prop = make_proposer(CFG, bf16_weights(CFG, 1), gpu=gpu)
    pst = prop.alloc_state()
    for obj in (tst, pst, pst.dsa, prop.step, prop.ctx, prop.scratch):
        assert not _undeclared(obj), (type(obj).__name__, _undeclared(obj))
    target.free_state(tst)
    prop.free_state(pst)
    prop.close()
    target.close()
    assert gpu.stats().live_bytes == 0
