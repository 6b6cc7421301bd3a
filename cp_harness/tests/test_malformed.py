"""Malformed inputs are rejected on every rank, quickly, naming the field, leaving the batch alone.

Every entry of ``cp_harness.cases.malformed_catalogue.CATALOGUE`` runs on the session's rank
pool (a real gloo group; CP sizes 2, 3 and 4 in turn, within
``--cp-world-sizes``). Each rank must raise an accepted exception type whose
message names the field, within ``TIME_LIMIT_S`` seconds, with the caller's
input unchanged; then the next case -- the same call on the valid base input
-- must pass on the same pool (no restart), which shows that no rank was left
inside a collective. The number of malformed inputs tried is printed at the
end of the run.
"""

from __future__ import annotations

import pytest

from cp_harness import run_summary
from cp_harness.cases.implementation import REQUIRED
from cp_harness.cases.malformed_catalogue import CATALOGUE, world_size_for
from cp_harness.cases.malformed_inputs import FUNCTIONS, TIME_LIMIT_S
from cp_harness.checks.malformed import case_for

COUNTER = "malformed inputs tried"


def test_catalogue_covers_every_documented_function():
    documented = {f"{module}.{name}" for module, names in REQUIRED.items() for name in names}
    covered = {entry.function for entry in CATALOGUE}
    assert documented <= covered, f"functions without a malformed input: {sorted(documented - covered)}"
    assert set(FUNCTIONS) >= covered
    assert len(CATALOGUE) >= 30


@pytest.mark.parametrize("index", range(len(CATALOGUE)), ids=[entry.name for entry in CATALOGUE])
def test_malformed_input_is_rejected_on_every_rank(cp_runner, cp_world_sizes, index):
    entry = CATALOGUE[index]
    n = world_size_for(entry, index, cp_world_sizes)
    if n is None:
        pytest.skip(f"{entry.name} needs world size >= {entry.min_world_size}; --cp-world-sizes gives {cp_world_sizes}")
    pool = cp_runner.pool
    starts_before = pool.starts if pool.running else None
    run_summary.count(COUNTER)
    # The pool's own deadline is the time limit: a rank that hangs fails the test after it, naming the rank.
    cp_runner.check(case_for(entry, n), timeout=TIME_LIMIT_S)
    starts = pool.starts
    assert starts_before is None or starts == starts_before, "the pool restarted while running a malformed input"
    # The next case runs on the same ranks: the valid base input must pass, without a restart.
    cp_runner.check(case_for(entry, n, control=True), timeout=TIME_LIMIT_S)
    assert pool.starts == starts, "the pool had to restart after a malformed input"
