"""Gathers, the convolution halo and the sharder move data bit for bit, forward and backward, in every dtype.

bfloat16/float16 gradient sums over ranks must be the float32 sum rounded once (``cases.accumulate``).
"""

from hypothesis import example, given

from cp_harness.checks.transport import gather_cases, history_cases, sharder_cases
from cp_harness.cases.profiles import examples
from hypothesis import settings


@settings(max_examples=examples(3.0))
@given(case=gather_cases())
@example(case={"check": "gather_sequence", "world_size": 1, "mesh": "none", "seed": 1, "dtype": "float64",
               "shape": [2, 3, 4], "differentiable": True})
@example(case={"check": "gather_tokens", "world_size": 3, "seed": 2, "dtype": "float32", "shape": [2, 5],
               "differentiable": True})
@example(case={"check": "gather_sequence", "world_size": 3, "seed": 7, "dtype": "bfloat16", "shape": [2, 3, 4],
               "differentiable": True})  # three bf16 gradient slices: float32 sum rounded once
@example(case={"check": "gather_tokens", "world_size": 8, "seed": 8, "dtype": "float16", "shape": [3, 2],
               "differentiable": True})
@example(case={"check": "gather_sequence", "world_size": 3, "seed": 9, "dtype": "float64", "value_dtype": "bool",
               "shape": [2, 2, 3], "differentiable": False})
@example(case={"check": "gather_sequence", "world_size": 4, "seed": 10, "dtype": "float64", "value_dtype": "int64",
               "shape": [1, 3], "differentiable": False})
def test_gathers_match_bit_for_bit(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(2.5))
@given(case=history_cases())
@example(case={"check": "convolution_history", "world_size": 4, "seed": 3, "dtype": "float64", "shape": [2, 1, 3],
               "width": 5})  # history spans every earlier rank
@example(case={"check": "convolution_history", "world_size": 3, "seed": 4, "dtype": "float64", "shape": [1, 2, 2],
               "width": 1})  # no history at all
@example(case={"check": "convolution_history", "world_size": 8, "seed": 5, "dtype": "bfloat16", "shape": [2, 1, 3],
               "width": 6})  # a row read by five later ranks: six bf16 gradients, summed in float32
@example(case={"check": "convolution_history", "world_size": 4, "seed": 6, "dtype": "float64", "value_dtype": "bool",
               "shape": [2, 2, 3], "width": 4})
@example(case={"check": "convolution_history", "world_size": 3, "seed": 7, "dtype": "float64", "value_dtype": "int64",
               "shape": [1, 1, 2], "width": 3})
def test_convolution_history_matches_bit_for_bit(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(1.5))
@given(case=sharder_cases())
@example(case={"check": "sharder_roundtrip", "world_size": 8, "seed": 13, "dtype": "float64", "shape": [2, 5, 3]})
@example(case={"check": "sharder_roundtrip", "world_size": 3, "seed": 14, "dtype": "bfloat16", "shape": [1, 7, 2]})
def test_sharder_round_trip_is_exact(cp_runner, case):
    cp_runner.check(case)
