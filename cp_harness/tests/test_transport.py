"""Gathers, the convolution halo and the sharder move data bit for bit, forward and backward, in every dtype.

bfloat16/float16 gradient sums over ranks must be the float32 sum rounded once (``cases.accumulate``).
"""

from hypothesis import given, settings

from cp_harness.cases.profiles import examples
from cp_harness.checks.sharder_roundtrip import SHARDER_ROUNDTRIP, sharder_cases
from cp_harness.checks.transport import CONVOLUTION_HISTORY, GATHER_SEQUENCE, GATHER_TOKENS, gather_cases, history_cases


@settings(max_examples=examples(3.0))
@given(case=gather_cases())
@GATHER_SEQUENCE.with_examples()
@GATHER_TOKENS.with_examples()
def test_gathers_match_bit_for_bit(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(2.5))
@given(case=history_cases())
@CONVOLUTION_HISTORY.with_examples()
def test_convolution_history_matches_bit_for_bit(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(1.5))
@given(case=sharder_cases())
@SHARDER_ROUNDTRIP.with_examples()
def test_sharder_round_trip_is_exact(cp_runner, case):
    cp_runner.check(case)
