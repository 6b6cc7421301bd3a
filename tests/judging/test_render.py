"""``cp_harness.judging.render``: the one renderer, one summary per comparison type; no pool."""

from __future__ import annotations

import numpy as np

from cp_harness.judging.compare import ExcessVerdict, TokenGrid, compare_exact, compare_ulp
from cp_harness.judging.render import (comparison_summary, condensed_text, describe_location, problem_text,
                                       repro_command, report_text)
from cp_harness.judging.verdicts import CaseReport, Problem, ProblemKind


def test_an_exact_failure_says_how_many_the_largest_difference_and_where():
    grid = TokenGrid(2, 2)
    comp = compare_exact("labels", np.array([[0, 0, 5, 0]]), np.zeros((1, 4), dtype=np.int64), grid=grid)
    text = comparison_summary(comp)
    assert text.startswith("labels [exact, int64, shape [1, 4]]: 1 of 4 elements differ")
    assert "largest absolute difference 5" in text and "worst at index [0, 2]: actual 5, expected 0" in text
    assert "row 0, global position 2, owned by rank 1, 0 tokens from a shard boundary, AT A SHARD BOUNDARY" in text


def test_an_ulp_failure_names_its_budget_and_the_excess_verdict():
    comp = compare_ulp("loss", np.array([1.0 + 2 ** -40]), np.array([1.0]), budget_ulp=16)
    comp.excess = ExcessVerdict(error=4096.0, baseline=1.0, excess=1000.0, limit=2.0, floor=16.0, mismatched=1)
    text = comparison_summary(comp)
    assert "[ulp, float64, shape [1]]" in text and "budget 16 ULP" in text
    assert "CP excess 1e+03 (limit 2" in text and "CP ADDS ERROR: 1 elements" in text


def test_no_budget_and_a_vacuous_selection_are_said_in_words():
    unbudgeted = compare_ulp("g", np.ones(2), np.ones(2), budget_ulp=float("inf"))
    assert "no ULP budget: judged by its excess over one rank" in comparison_summary(unbudgeted)
    empty = compare_exact("m", np.zeros(2), np.zeros(2), mask=np.zeros(2, bool))
    assert "nothing was compared" in comparison_summary(empty)


def test_a_location_without_a_boundary_does_not_invent_one():
    loc = {"row": 1, "position": 7, "owning_rank": 0, "distance_to_shard_boundary": None,
           "divisibility_padding": True}
    assert describe_location(loc) == "row 1, global position 7, owned by rank 0, divisibility padding"


def test_problems_render_their_headline_and_detail_and_the_condensed_form_counts_the_rest():
    report = CaseReport(case={"check": "x", "world_size": 2})
    report.problem("rank 1 raised ValueError: bad\nTraceback line 1\nTraceback line 2", rank=1,
                   kind=ProblemKind.RANK_RAISED)
    report.add(compare_exact("out@rank0", np.zeros(2), np.ones(2), rank=0))
    assert report.problems[0] == Problem("rank 1 raised ValueError: bad", "Traceback line 1\nTraceback line 2", 1,
                                         ProblemKind.RANK_RAISED)
    assert problem_text(report.problems[0], headline_only=True) == "rank 1 raised ValueError: bad"
    full = report_text(report)
    assert "PROBLEM: rank 1 raised ValueError: bad\nTraceback line 1" in full and "FAIL out@rank0" in full
    short = condensed_text(report)
    assert "Traceback" not in short and "(2 more lines of traceback" in short


def test_the_repro_command_runs_exactly_the_case_against_its_implementation():
    command = repro_command({"check": "gather_sequence", "world_size": 2, "seed": 1, "impl": "mine"}, "cp_impl")
    assert command.startswith("python -m cp_harness run-case --impl mine '")
    assert '"world_size":2' in command
