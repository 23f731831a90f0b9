"""The sampling's keyed random numbers: Philox4x32-10 against the published known-answer vectors,
and the properties the samplers rely on (range, keying, independence of the batch)."""

from __future__ import annotations

import numpy as np
import pytest

from model.kernels.keyed_rng import Stream, gumbel, philox4x32, seed_key, uniforms


@pytest.mark.parametrize(
    "ctr, key, want",
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_matches_the_known_answer_vectors(ctr, key, want):
    assert tuple(int(v) for v in philox4x32(np.array(ctr), key)) == want


def test_uniforms_lie_strictly_inside_the_unit_interval_and_are_exact_in_f32():
    u = uniforms(12345, 7, 1, Stream.DRAFT, np.arange(200_000, dtype=np.uint64))
    assert u.dtype == np.float32 and u.min() > 0 and u.max() < 1
    # Every value is (j + 0.5) / 2**23 for an integer j.
    j = u.astype(np.float64) * 2.0**23 - 0.5
    assert np.array_equal(j, np.round(j))
    # Roughly uniform: each tenth of the interval holds about a tenth (6 sigma of a binomial).
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(counts - 20_000) < 6 * np.sqrt(20_000 * 0.9 * 0.1))


def test_every_counter_word_and_the_seed_change_the_draw():
    base = uniforms(5, 10, 2, Stream.DRAFT, 3)
    assert uniforms(5, 10, 2, Stream.DRAFT, 3) == base
    for other in (
        uniforms(6, 10, 2, Stream.DRAFT, 3),
        uniforms(5 + 2**32, 10, 2, Stream.DRAFT, 3),
        uniforms(5, 11, 2, Stream.DRAFT, 3),
        uniforms(5, 10, 3, Stream.DRAFT, 3),
        uniforms(5, 10, 2, Stream.ACCEPT, 3),
        uniforms(5, 10, 2, Stream.DRAFT, 4),
    ):
        assert other != base


def test_a_vocabulary_slice_draws_what_the_whole_vocabulary_draws_there():
    whole = gumbel(99, 3, 0, Stream.DRAFT, 1000)
    part = -np.log(-np.log(uniforms(99, 3, 0, Stream.DRAFT, np.arange(400, 700, dtype=np.uint64))))
    assert np.array_equal(whole[400:700], part)


def test_a_seed_outside_u64_is_refused():
    with pytest.raises(ValueError, match="seed"):
        seed_key(2**64)
    with pytest.raises(ValueError, match="seed"):
        seed_key(-1)
