"""SamplingParams' refusals and the reference distribution and draw of model/sampling.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from model.kernels.keyed_rng import Stream
from model.sampling import SamplingParams, draw, probabilities


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=math.inf), "temperature"),
        (SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
        (SamplingParams(temperature=1.0, top_p=1.5), "top_p"),
        (SamplingParams(temperature=1.0, top_k=-1), "top_k"),
        (SamplingParams(temperature=1.0, top_k=101), "top_k"),
        (SamplingParams(temperature=1.0, seed=-3), "seed"),
        (SamplingParams(temperature=1.0, seed=2**64), "seed"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        params.check(100)


def test_good_parameters_pass():
    SamplingParams(temperature=0.7, top_p=0.9, top_k=100, seed=2**64 - 1).check(100)
    SamplingParams().check(1)


def test_top_k_and_top_p_keep_the_documented_sets():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 0.0], np.float32)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    # Order (z desc, index asc): 1, 3, 2, 0, 4; top-2 keeps 1 and 3, equally likely.
    assert np.allclose(p, [0, 0.5, 0, 0.5, 0])
    e = np.exp(np.array([3.0, 3.0, 2.0, 1.0, 0.0]) - 3.0)
    c = np.cumsum(e / e.sum())
    # top_p just above the first two's mass keeps three tokens, exactly at it keeps two.
    p3 = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(c[1]) + 1e-6))
    assert np.count_nonzero(p3) == 3 and p3[0] == 0
    p2 = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(c[1]) - 1e-6))
    assert np.count_nonzero(p2) == 2 and p2[1] == p2[3]
    assert np.array_equal(probabilities(logits, SamplingParams()), [0, 1, 0, 0, 0])


def test_the_keyed_draw_follows_the_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=12).astype(np.float32)
    params = dict(temperature=0.8, top_k=8, top_p=0.9)
    p = probabilities(logits, SamplingParams(**params))
    n = 6000
    counts = np.bincount(
        [draw(logits, SamplingParams(seed=s, **params), 17, 1, Stream.DRAFT) for s in range(n)], minlength=12
    )
    assert np.all(counts[p == 0] == 0)
    live = p > 0
    chi2 = float((((counts - n * p) ** 2)[live] / (n * p[live])).sum())
    # Chi-square with live - 1 degrees of freedom: 3.5 x the mean is far in the tail (p < 1e-4 here).
    assert chi2 < 3.5 * (live.sum() - 1) + 10, (chi2, counts, n * p)


def test_a_draw_is_a_function_of_its_key():
    logits = np.linspace(0, 1, 50, dtype=np.float32)
    sp = SamplingParams(temperature=1.0, seed=7)
    a = [draw(logits, sp, pos, i, Stream.DRAFT) for pos in range(20) for i in range(3)]
    assert a == [draw(logits, sp, pos, i, Stream.DRAFT) for pos in range(20) for i in range(3)]
    assert len(set(a)) > 10
