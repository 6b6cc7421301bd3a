"""Running one row: Hypothesis draws its cases (the ``verify`` profile, seeded), the pool runs them, the
row's tally counts them; a failure is shrunk for at most ``shrink_seconds`` and the smallest one kept."""

from __future__ import annotations

import time
import traceback
from typing import Any

from hypothesis import example, given, seed as hypothesis_seed

from cp_harness.cases.descriptions import canonical
from cp_harness.cases.meshes import ranks_needed
from cp_harness.cases.profiles import CaseSpace, command_settings
from cp_harness.instruments import coverage
from cp_harness.judging.error_maps import write_error_maps
from cp_harness.judging.render import comparison_summary, repro_command, report_text
from cp_harness.runner import CaseRunner
from cp_harness.verify.progress import Progress
from cp_harness.verify.rows import Row, RowFailure


def _traceback_head(frames: int = 4) -> str:
    """The exception and its innermost ``frames`` frames, indented (the whole one: run-case, or --json)."""
    return "".join("    " + line for line in traceback.format_exc(limit=-frames).splitlines(keepends=True))


def run_row(row: Row, runner: CaseRunner, space: CaseSpace, examples: int, seed: int, progress: Progress,
            backend: str, error_dir: str | None, shrink_seconds: float, repro_dir: str | None = None) -> None:
    """Draw, run and judge ``examples`` cases of ``row`` (its explicit cases first) into its tally; on a failure
    record the smallest failing case (``row.failure``), its reproduction command, its error maps and, with
    ``repro_dir``, its standalone repro written there (``CaseRunner.export_repro``)."""
    tally = row.tally
    failing: dict[str, Any] = {}  # canonical case -> its report, for every case seen failing
    last_failure: dict[str, Any] = {}
    shrink_started: list[float] = []
    in_flight: dict[str, Any] = {}  # the case being run, and whether it was counted yet (a crash names it)

    @command_settings("verify", examples)
    @hypothesis_seed(seed)
    @given(case=row.spec.cases(space))
    def property_(case):
        in_flight.update(case=case, counted=False)
        key = canonical(case)
        report = failing.get(key)  # seen failing already (e.g. Hypothesis' final replay): not run again
        if report is None:
            if shrink_started and time.perf_counter() - shrink_started[0] > shrink_seconds:
                # Shrinking budget spent: the smallest failure found so far is reported (it really failed).
                return
            report = runner.run(case)
            tally.add(case, report)
            in_flight["counted"] = True
            progress.step(row.name if not shrink_started else f"{row.name}: shrinking a failure")
            if report.ok:
                return
            if not shrink_started:
                shrink_started.append(time.perf_counter())
                first = (report.problems[0].message if report.problems
                         else comparison_summary(report.failures()[0]) if report.failures() else "failed")
                progress.note(f"FAILED {row.name}: {first[:160]}\n  case: {key}\n"
                              f"  (shrinking it for up to {shrink_seconds:g} s; the smallest failure is printed at the end)")
            failing[key] = report
        last_failure["case"], last_failure["report"] = case, report
        raise AssertionError(report_text(report))  # one raise site: Hypothesis tells failures apart by where they rise

    for case in row.spec.explicit:
        if ranks_needed(case) <= space.pool_ranks:
            property_ = example(case=case)(property_)
    try:
        property_()
        never = coverage.covered(row.spec.functions, tally.called)
        if never and row.failure is None and tally.examples:
            tally.failed = max(tally.failed, 1)
            row.failure = RowFailure(
                f"  PROBLEM: the row claims {', '.join(never)}, but none of its {tally.examples} cases called "
                f"{'it' if len(never) == 1 else 'them'} through the documented API (called: "
                f"{', '.join(sorted(tally.called)) or 'nothing'})")
    except AssertionError:
        if "report" not in last_failure:  # Hypothesis itself complained (e.g. a flaky failure)
            tally.failed = max(tally.failed, 1)
            row.failure = RowFailure(traceback.format_exc(limit=3))
            return
        # Hypothesis replays the smallest failing example last: that is the one to report.
        case, report = last_failure["case"], last_failure["report"]
        row.failure = RowFailure(report_text(report), case=case, reproduce=repro_command(case, runner.impl, backend),
                                 report=report, error_maps=write_error_maps(report, error_dir))
        if repro_dir is not None:
            row.failure.repro = runner.export_repro(case, report, repro_dir)
    except Exception:  # noqa: BLE001 - a harness or Hypothesis error fails this row, the others still run
        crashed = in_flight.get("case")
        if crashed is not None and not in_flight.get("counted"):
            tally.examples += 1  # the crashed case counts as run and failed, never as passed
        tally.failed = max(tally.failed, 1)
        at = crashed if crashed is not None else last_failure.get("case")
        row.failure = RowFailure("  PROBLEM: the harness crashed on this case (no verdict on the implementation):\n"
                                 + _traceback_head(), case=at,
                                 reproduce=repro_command(at, runner.impl, backend) if at is not None else None)
