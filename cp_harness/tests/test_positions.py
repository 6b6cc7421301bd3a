"""validate_document_positions rejects exactly what the SPEC forbids, naming row and column, on every rank."""

from hypothesis import example, given, settings

from cp_harness.checks.positions import position_cases
from cp_harness.cases.profiles import examples


@settings(max_examples=examples(1.5))
@given(case=position_cases())
@example(case={"check": "validate_document_positions", "world_size": 2, "seed": 1, "model": "inkling2",
               "batch": {"format": "thd", "seq_len": 9, "docs": [[[3, 4], [4, 5]]]},
               "corruption": {"kind": "resume", "row": 0, "nth": 0}})  # a gap must not resume a document
@example(case={"check": "validate_document_positions", "world_size": 3, "seed": 2, "model": "inkling2",
               "batch": {"format": "bshd", "seq_len": 7, "rows": [[3, 4]]},
               "corruption": {"kind": "offset_start", "row": 0, "nth": 2}})  # a shard may begin mid-document
def test_validate_document_positions_follows_the_spec(cp_runner, case):
    cp_runner.check(case)
