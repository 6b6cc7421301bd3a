"""Gathers and the convolution halo move data bit for bit, forward and backward."""

from hypothesis import example, given

from cp_harness import strategies
from cp_harness.profiles import examples
from hypothesis import settings


@settings(max_examples=examples(1.5))
@given(case=strategies.gather_cases())
@example(case={"check": "gather_sequence", "world_size": 1, "mesh": "none", "seed": 1, "dtype": "float64",
               "shape": [2, 3, 4], "differentiable": True})
@example(case={"check": "gather_tokens", "world_size": 3, "seed": 2, "dtype": "float32", "shape": [2, 5],
               "differentiable": True})
def test_gathers_match_bit_for_bit(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(1.0))
@given(case=strategies.history_cases())
@example(case={"check": "convolution_history", "world_size": 4, "seed": 3, "dtype": "float64", "shape": [2, 1, 3],
               "width": 5})  # history spans every earlier rank
@example(case={"check": "convolution_history", "world_size": 3, "seed": 4, "dtype": "float64", "shape": [1, 2, 2],
               "width": 1})  # no history at all
def test_convolution_history_matches_bit_for_bit(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(0.5))
@given(case=strategies.sharder_cases())
@example(case={"check": "sharder_roundtrip", "world_size": 8, "seed": 13, "dtype": "float64", "shape": [2, 5, 3]})
def test_sharder_round_trip_is_exact(cp_runner, case):
    cp_runner.check(case)
