"""The CP sizes a case space draws: the ci profile's weights (``CaseSpace.size_draws``). No ranks."""

from __future__ import annotations

from collections import Counter

from cp_harness.cases.profiles import (
    CI_FULL_WEIGHT_MAX_SIZE,
    CI_SMALL_SIZE_WEIGHT,
    DEFAULT_WORLD_SIZES,
    CaseSpace,
)


def test_the_ci_space_draws_every_size_and_the_large_ones_a_quarter_as_often():
    drawn = Counter(CaseSpace(favour_small=True).size_draws)
    assert set(drawn) == set(DEFAULT_WORLD_SIZES), drawn  # rarer, never left out
    assert CI_SMALL_SIZE_WEIGHT == 4
    small = [n for n in DEFAULT_WORLD_SIZES if n <= CI_FULL_WEIGHT_MAX_SIZE]
    large = [n for n in DEFAULT_WORLD_SIZES if n > CI_FULL_WEIGHT_MAX_SIZE]
    assert small and large
    assert {drawn[n] for n in small} == {CI_SMALL_SIZE_WEIGHT} and {drawn[n] for n in large} == {1}, drawn
    # shrinking goes towards the first element drawn: the smallest size still comes first
    assert CaseSpace(favour_small=True).size_draws[0] == min(DEFAULT_WORLD_SIZES)


def test_other_profiles_and_a_space_of_large_sizes_only_draw_every_size_equally():
    assert CaseSpace(favour_small=False).size_draws == DEFAULT_WORLD_SIZES
    assert CaseSpace(world_sizes=(8, 16), favour_small=True).size_draws == (8, 16)
    assert CaseSpace(world_sizes=(2, 8), favour_small=True).size_draws == (2,) * CI_SMALL_SIZE_WEIGHT + (8,)
