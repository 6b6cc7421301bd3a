"""Real models (``--cp-model MODULE``): the framework's own CP path of each model spec against the same model on
one device, float32 and bfloat16 (``cp_harness.checks.real_model``; the same rows as ``verify --model``).
Skipped without ``--cp-model``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from cp_harness.cases.profiles import current_space, examples
from cp_harness.checks import load_checks

# The forward-backward rows, as ``verify --model`` runs them (the training step needs a pool of exactly its 4 ranks:
# ``verify --step training``, docs/training_step.md).
ROWS = [
    row for check in load_checks().values() for row in check.rows if row.needs_model and row.step == "forward-backward"
]


@pytest.mark.parametrize("row", ROWS, ids=[row.label for row in ROWS])
def test_real_model_matches_one_device(cp_runner, row):
    if not current_space().models:
        pytest.skip("no model spec given (--cp-model MODULE)")
    reason = row.skip(None) if row.skip is not None else None
    if reason is not None:
        pytest.skip(reason)

    @settings(max_examples=examples(0.5))
    @given(case=row.cases(None))
    def holds(case):
        cp_runner.check(case)

    holds()
