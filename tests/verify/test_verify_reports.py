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
