"""The sharder-verbs judge on layout fields a sharder got wrong: it reports them, it does not crash.

A sharder whose layout reports no ``original_seq_len`` (on a sequence that needs no divisibility padding, so
``padded_seq_len`` equals the batch's length) once made the judge itself raise ``TypeError`` while trimming a
form back to the caller's length (``narrow`` by ``None``): the case then failed as a harness crash, not as the
finding the judge had already written down. The ranks' outputs are those of a correct run with the field taken
out, as that sharder would have reported it.
"""

from __future__ import annotations

from cp_harness.checks import sharder_verbs
from cp_harness.checks.sharder_verbs import _example


def test_a_layout_without_original_seq_len_is_reported_not_crashed_on(cp_runner):
    # S = 8 at N = 2: already a multiple of 2N, so the layout's padded length is the batch's length.
    case = _example(2, 21, "strategy", "float64", [
        {"lead": [], "trail": [3], "coords": "caller", "fill": 0.5, "trim": True}], seq_len=8)
    outputs = cp_runner.run_outputs(case)
    assert sharder_verbs._evaluate(case, outputs).ok  # the correct run passes
    assert all(o.info["padded_seq_len"] == 8 for o in outputs)
    for o in outputs:
        o.info["original_seq_len"] = None
    report = sharder_verbs._evaluate(case, outputs)
    assert not report.ok
    assert any("original_seq_len=None" in p.message for p in report.problems), [p.message for p in report.problems]
