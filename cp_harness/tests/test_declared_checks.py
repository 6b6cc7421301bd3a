"""Checks that bring their own gate property: a check module that sets ``gate_share`` is judged here, on its
own verify rows' strategies and its named examples, so adding a check is adding its one file.

The checks that predate this have a test module of their own (``gate_share`` 0) and are not run twice.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings

from cp_harness.cases.profiles import examples
from cp_harness.checks import load_checks

DECLARED = [(check, row) for check in load_checks().values() if check.gate_share for row in check.rows]


@pytest.mark.parametrize(("check", "row"), DECLARED, ids=[row.label for _, row in DECLARED])
def test_declared_check_holds(cp_runner, check, row):
    @settings(max_examples=examples(check.gate_share))
    @given(case=row.cases(None))
    def holds(case):
        cp_runner.check(case)

    for case in check.examples.values():
        holds = example(case=case)(holds)
    holds()


def test_some_check_declares_its_own_gate_property():
    """The parametrised test above must not pass by running nothing."""
    assert DECLARED, "no check sets gate_share: test_declared_check_holds would run no case"
