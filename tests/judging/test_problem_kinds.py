"""Verdict kinds are closed types: ``ProblemKind`` (a case's problems) and ``RankFailureKind`` (how a rank failed).

- a kind given as its string value is converted to the member; any other string raises, so a misspelt kind
  fails where it is produced instead of never matching where it is read;
- a kind is its string value in JSON and in text (reports stay byte-identical to the strings they replaced);
- every ``RankFailureKind`` has the ``ProblemKind`` that the runner records for it;
- no producer in ``cp_harness`` passes ``kind=`` as a string literal (no torch, no ranks).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import pytest

from cp_harness.judging.verdicts import CaseReport, Problem, ProblemKind
from cp_harness.ranks.outputs import RankFailure, RankFailureKind

HARNESS = pathlib.Path(__file__).resolve().parents[2] / "cp_harness"
# Calls that take a problem's or a rank failure's kind: CaseReport.problem / .require, Problem(.of), RankFailure.
PRODUCERS = {"problem", "require", "Problem", "of", "RankFailure", "_failure"}


def test_a_kind_given_as_its_value_becomes_the_member_and_an_unknown_one_raises():
    assert Problem("m", kind="rank raised").kind is ProblemKind.RANK_RAISED
    assert Problem("m").kind is ProblemKind.CONTRACT
    with pytest.raises(ValueError, match="rank crashed"):
        Problem("m", kind="rank crashed")
    with pytest.raises(ValueError, match="harness crashed"):  # documented once, never produced as a kind
        CaseReport(case={}).problem("m", kind="harness crashed")
    assert RankFailure("m", rank=1, kind="hung", case={}, outputs=[]).kind is RankFailureKind.HUNG
    with pytest.raises(ValueError, match="timed out"):
        RankFailure("m", rank=1, kind="timed out", case={}, outputs=[])


def test_a_kind_reads_as_its_string_value_in_json_and_text():
    problem = Problem("rank 1 hung: no reply", rank=1, kind=ProblemKind.RANK_HUNG)
    assert json.dumps(problem.as_dict()) == ('{"message": "rank 1 hung: no reply", "detail": "", "rank": 1, '
                                             '"kind": "rank hung"}')
    assert json.dumps(dataclasses.replace(problem, kind=ProblemKind.ROW).as_dict()).endswith('"kind": "row"}')
    assert (str(problem.kind), f"{problem.kind}", f"[{RankFailureKind.EXITED}]") == ("rank hung", "rank hung",
                                                                                    "[exited]")
    assert problem.kind == "rank hung" and "hung" in problem.kind


@pytest.mark.parametrize("failure", list(RankFailureKind), ids=str)
def test_every_rank_failure_kind_has_its_problem_kind(failure):
    assert ProblemKind.of_rank_failure(failure).value == f"rank {failure.value}"


def _literal_kinds(source: str, where: str) -> list[str]:
    """``where:line: call(kind='...')`` for every producer call in ``source`` whose kind is a string literal."""
    found = []
    for node in ast.walk(ast.parse(source, filename=where)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        for keyword in node.keywords:
            if (name in PRODUCERS and keyword.arg == "kind" and isinstance(keyword.value, ast.Constant)
                    and isinstance(keyword.value.value, str)):
                found.append(f"{where}:{node.lineno}: {name}(kind={keyword.value.value!r})")
    return found


def test_no_producer_writes_a_kind_as_a_string_literal():
    sources = sorted(p for p in HARNESS.rglob("*.py") if "tests" not in p.relative_to(HARNESS).parts)
    literal = [hit for path in sources
               for hit in _literal_kinds(path.read_text(encoding="utf-8"), str(path.relative_to(HARNESS.parent)))]
    assert not literal, "use the ProblemKind / RankFailureKind member:\n" + "\n".join(literal)


def test_the_literal_scan_finds_a_literal_kind():
    sample = ('report.problem("x", kind="rank raised")\nreport.problem("y", kind=ProblemKind.ROW)\n'
              'RankFailure("z", rank=0, kind="hung", case={}, outputs=[])\nnp.dtype("f").kind == "f"\n')
    assert _literal_kinds(sample, "sample.py") == ["sample.py:1: problem(kind='rank raised')",
                                                    "sample.py:3: RankFailure(kind='hung')"]
