"""validate_document_positions rejects exactly what the SPEC forbids, naming row and column, on every rank."""

from hypothesis import given, settings

from cp_harness.cases.profiles import examples
from cp_harness.checks.positions import VALIDATE_DOCUMENT_POSITIONS, position_cases


@settings(max_examples=examples(1.5))
@given(case=position_cases())
@VALIDATE_DOCUMENT_POSITIONS.with_examples()
def test_validate_document_positions_follows_the_spec(cp_runner, case):
    cp_runner.check(case)
