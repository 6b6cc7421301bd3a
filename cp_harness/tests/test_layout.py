"""The hooks shard labels, positions, padding and documents exactly as the oracle lays them out."""

from hypothesis import given, settings

from cp_harness.cases.profiles import examples
from cp_harness.checks.layout import INKLING2_LAYOUT, MISTRAL_LARGE4_LAYOUT, layout_cases


@settings(max_examples=examples(3.0))
@given(case=layout_cases())
@INKLING2_LAYOUT.with_examples()
@MISTRAL_LARGE4_LAYOUT.with_examples()
def test_sharded_layout_matches_oracle(cp_runner, case):
    cp_runner.check(case)
