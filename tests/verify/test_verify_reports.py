"""What ``verify`` prints when something other than the implementation goes wrong, and how failures read."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from cp_harness import checks
from cp_harness.checks.transport import GATHER_SEQUENCE
from cp_harness.judging.compare import TokenGrid, compare_exact
from cp_harness.judging.render import comparison_summary
from cp_harness.checks import VerifyRow
from cp_harness.verify import Row, VerifySettings, result_text, run_verify


def test_a_case_that_crashes_the_harness_is_named_with_its_traceback_and_counts_as_failed(
        tmp_path, cp_runner, monkeypatch):
    real = checks.evaluate
    crashed = []

    def evaluate(case, outputs, *args, **kwargs):
        if case["seed"] % 3 == 0:
            crashed.append(case)
            raise RuntimeError("boom in the judge")
        return real(case, outputs, *args, **kwargs)

    monkeypatch.setattr(checks, "evaluate", evaluate)
    row = Row(VerifyRow("gathers", lambda space: GATHER_SEQUENCE.rows[0].cases(space), ("inkling2.gather_sequence",),
                        id="gathers"))
    result = run_verify(VerifySettings(impl=cp_runner.impl, world_sizes=(1, 2), examples=12, shrink_seconds=1.0),
                        rows=[row], pool=cp_runner.pool, progress_stream=io.StringIO())
    (tmp_path / "v.json").write_text(json.dumps(result.as_dict()))
    text, code = result_text(result), result.exit_code
    assert code == 1 and crashed, text
    assert "the harness crashed on this case" in text and "RuntimeError: boom in the judge" in text, text
    assert "reproduce: python -m cp_harness run-case" in text, text
    report = json.loads((tmp_path / "v.json").read_text())["rows"][0]
    assert report["passed"] + report["failed"] == report["examples"], report  # the crash is not counted as passed
    assert report["failing_case"]["seed"] % 3 == 0


def test_a_failure_in_divisibility_padding_names_its_global_position_and_no_shard_boundary():
    """Positions ``>= S`` compared as a slice still name their global position and owner; the sequence's end
    is not a shard boundary, so nothing there is called one."""
    grid = TokenGrid.from_index_maps([np.arange(0, 4), np.arange(4, 8)], seq_len=6)
    got = np.array([[-100, 7]])
    comp = compare_exact("labels (divisibility padding)", got, np.full((1, 2), -100), grid=grid.sliced(6))
    text = comparison_summary(comp)
    assert "global position 7, owned by rank 1, divisibility padding" in text, text
    assert "AT A SHARD BOUNDARY" not in text and "3 tokens from a shard boundary" in text, text
    at_boundary = compare_exact("t", np.array([[0, 0, 0, 1, 0, 0, 0, 0]]), np.zeros((1, 8), dtype=np.int64), grid=grid)
    assert "global position 3, owned by rank 0, 0 tokens from a shard boundary, AT A SHARD BOUNDARY" in \
        comparison_summary(at_boundary)
    one_rank = compare_exact("t", np.array([[0, 1]]), np.zeros((1, 2), dtype=np.int64), grid=TokenGrid(2, 1))
    assert "shard boundary" not in comparison_summary(one_rank)


@pytest.mark.parametrize("order", ["permuted", "other tokens"])
def test_local_tensors_in_another_order_than_the_index_map_are_called_so(order):
    from cp_harness.checks._token_layout import judge_token_layout
    from cp_harness.judging.verdicts import CaseReport
    from cp_harness.ranks.outputs import RankOutput

    maps = [np.array([0, 1, 2]), np.array([3, 4, 5])]
    markers = [np.array([0, 1, 2]), np.array([5, 4, 3]) if order == "permuted" else np.array([3, 4, 4])]
    outputs = [RankOutput(rank=r, ok=True, info={}, comm=[], seconds=0.0,
                          tensors={"token_indices": maps[r], "token_marker": markers[r], "labels": np.zeros((1, 3))})
               for r in range(2)]
    report = CaseReport(case={})
    judge_token_layout(report, outputs, 6, local_name="labels")
    said = "\n".join(p.message for p in report.problems)
    assert not report.ok
    assert ("rank 1: the local tensors hold the tokens of its index map in another order" in said) == \
        (order == "permuted"), said


def _history_row() -> Row:
    from cp_harness.checks.transport import CONVOLUTION_HISTORY

    return Row(VerifyRow("halo", lambda space: CONVOLUTION_HISTORY.rows[0].cases(space),
                         ("inkling2.convolution_history",), id="halo"))


def test_a_failure_the_caller_accounts_for_is_reported_as_found_and_any_other_is_shrunk(cp_runner):
    """``VerifySettings.known_failure``: the real-client gate's documented defects are not shrunk (their own cases
    are replayed); a failure it does not account for shrinks as before. ``broken_gate_halo`` fails every case at
    CP > 1, so the first failing case is drawn at once and shrinking has something to do."""
    if cp_runner.config.world_size < 3:
        pytest.skip("needs 3 ranks (--cp-world-sizes)")
    asked: list[tuple[str, dict, bool]] = []

    def documented(row: str, case: dict, report) -> str | None:
        asked.append((row, case, report.ok))
        return "documented defect X explains it"

    def run(known_failure):
        result = run_verify(VerifySettings(impl="broken_gate_halo", world_sizes=(2, 3), examples=6,
                                           shrink_seconds=60.0, known_failure=known_failure),
                            rows=[_history_row()], pool=cp_runner.pool, progress_stream=io.StringIO())
        return result, result_text(result), json.loads(json.dumps(result.as_dict()))["rows"][0]

    result, text, row = run(documented)
    assert result.exit_code == 1, text
    assert len(asked) == 1 and asked[0][0] == "halo" and asked[0][2] is False, asked  # asked once, on a failure
    assert row["failed"] == 1 and row["examples"] == row["passed"] + 1, row  # not one shrinking run
    assert row["failing_case"] == asked[0][1], row  # the case it was asked about is the one reported
    assert row["not_shrunk"] == "documented defect X explains it", row
    assert "  not shrunk: documented defect X explains it" in text, text

    unexplained: list[dict] = []
    result, text, shrunk = run(lambda row, case, report: unexplained.append(case))  # returns None: not accounted
    assert result.exit_code == 1 and len(unexplained) == 1, text
    assert shrunk["not_shrunk"] is None and "not shrunk" not in text, text
    assert shrunk["failed"] > 1, shrunk  # Hypothesis' shrinking ran the implementation again
