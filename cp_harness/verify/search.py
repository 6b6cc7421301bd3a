"""Running one row: Hypothesis draws its cases (the ``verify`` profile, seeded), the pool runs them, the
row's tally counts them; a failure is shrunk for at most ``shrink_seconds`` and the smallest one kept (not at all
when the caller already accounts for it: ``VerifySettings.known_failure``)."""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import NoSuchExample, Unsatisfiable

from cp_harness import checks
from cp_harness.cases.descriptions import canonical
from cp_harness.cases.meshes import ranks_needed
from cp_harness.cases.profiles import CaseSpace, command_settings
from cp_harness.instruments import coverage
from cp_harness.judging.error_maps import write_error_maps
from cp_harness.judging.render import comparison_summary, report_text, repro_command
from cp_harness.runner import CaseRunner
from cp_harness.verify.progress import Progress
from cp_harness.verify.rows import Row, RowFailure


def _traceback_head(frames: int = 4) -> str:
    """The exception and its innermost ``frames`` frames, indented (the whole one: run-case, or --json)."""
    return "".join("    " + line for line in traceback.format_exc(limit=-frames).splitlines(keepends=True))


def _built_for(case: dict, claims: list[str]) -> set[str]:
    """The claims a case was built to reach: those its check covers (``Check.reaches`` of the case, else
    ``Check.functions``)."""
    check = checks.check_of(case)
    functions = set(check.reaches(case) if check.reaches is not None else check.functions)
    return {claim for claim in claims if not coverage.covered([claim], functions)}


def _built_for_but_not_run(never: list[str], explicit: tuple[dict, ...], ran_cases: list[dict]) -> list[str]:
    """The claims in ``never`` that only explicit cases which did not run (``ran_cases``: the fitting explicit cases
    and those ``cases_built_for`` drew) were built to reach.

    A claim the run did not reach is a finding when a case built to reach it ran (the implementation did not call
    the function through its documented API), and when no case of the row was built to reach it (a claim nothing
    backs). When its cases could not run here (they need more ranks) and no case of this run's space is built for
    it, the verdict would depend on whether a drawn case happened to reach it, so the row says it was not reached
    and is not failed for it."""
    ran = set().union(*(_built_for(case, never) for case in ran_cases)) if ran_cases else set()
    built = set().union(*(_built_for(case, never) for case in explicit)) if explicit else set()
    return [f for f in never if f in built and f not in ran]


# How many of the row's own draws ``cases_built_for`` looks at for a case built to reach one claim (draws only: no
# case runs while it looks, so the cost is the strategy's, milliseconds).
CLAIM_SEARCH_DRAWS = 300


def cases_built_for(claims: list[str], strategy, space: CaseSpace, seed: int) -> dict[str, dict]:
    """A case of ``strategy`` built to reach each of ``claims`` (its check covers it: ``_built_for``) that fits
    ``space``'s pool, found among the row's own draws (seeded: the same cases for the same seed), claim -> case; a
    claim that none of ``CLAIM_SEARCH_DRAWS`` draws is built for is left out. No case runs here.

    This is what makes a row's verdict independent of ``--examples``: the claims its drawn cases did not happen to
    reach get a case of their own, the way its explicit cases reach them where they fit."""
    found: dict[str, dict] = {}
    look = settings(
        database=None,
        max_examples=CLAIM_SEARCH_DRAWS,
        phases=[Phase.generate],  # the first draw that is built for the claim, not a shrunk one
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )

    def built_for(claim: str) -> Callable[[dict], bool]:
        def fits(case: dict) -> bool:
            return claim in _built_for(case, [claim]) and ranks_needed(case) <= space.pool_ranks

        return fits

    for claim in claims:
        if claim in found:
            continue
        try:
            case = find(strategy, built_for(claim), settings=look, random=random.Random(f"{seed}:{claim}"))
        except (NoSuchExample, Unsatisfiable):
            continue
        for reached in _built_for(case, claims):  # one case may be built for several of the claims
            found.setdefault(reached, case)
    return found


def run_row(
    row: Row,
    runner: CaseRunner,
    space: CaseSpace,
    examples: int,
    seed: int,
    progress: Progress,
    backend: str,
    error_dir: str | None,
    shrink_seconds: float,
    repro_dir: str | None = None,
    known_failure: Callable[[str, dict, Any], str | None] | None = None,
) -> None:
    """Draw, run and judge ``examples`` cases of ``row`` (its explicit cases first, then a case built for each claim
    that none of them reached: ``cases_built_for``) into its tally; on a failure
    record the smallest failing case (``row.failure``), its reproduction command, its error maps and, with
    ``repro_dir``, its standalone repro written there (``CaseRunner.export_repro``). A first failure that
    ``known_failure`` (``VerifySettings.known_failure``) accounts for is recorded as found, without shrinking."""
    tally = row.tally
    failing: dict[str, Any] = {}  # canonical case -> its report, for every case seen failing
    last_failure: dict[str, Any] = {}
    shrink_started: list[float] = []
    not_shrunk: list[str] = []  # the reason known_failure gave for the first failure: no shrinking runs
    in_flight: dict[str, Any] = {}  # the case being run, and whether it was counted yet (a crash names it)

    def judge(case):
        in_flight.update(case=case, counted=False)
        key = canonical(case)
        report = failing.get(key)  # seen failing already (e.g. Hypothesis' final replay): not run again
        if report is None:
            if not_shrunk or (shrink_started and time.perf_counter() - shrink_started[0] > shrink_seconds):
                # Shrinking budget spent (or the failure is accounted for): the smallest failure found so far is
                # reported (it really failed); Hypothesis' remaining shrink candidates pass without running.
                return
            report = runner.run(case)
            tally.add(case, report)
            in_flight["counted"] = True
            progress.step(row.name if not shrink_started else f"{row.name}: shrinking a failure")
            if report.ok:
                return
            if not shrink_started:
                shrink_started.append(time.perf_counter())
                known = known_failure(row.name, case, report) if known_failure is not None else None
                if known is not None:
                    not_shrunk.append(known)
                first = (
                    report.problems[0].message
                    if report.problems
                    else comparison_summary(report.failures()[0])
                    if report.failures()
                    else "failed"
                )
                progress.note(
                    f"FAILED {row.name}: {first[:160]}\n  case: {key}\n"
                    + (
                        f"  (not shrunk: {known})"
                        if known is not None
                        else f"  (shrinking it for up to {shrink_seconds:g} s; the smallest failure is printed at the end)"
                    )
                )
            failing[key] = report
        last_failure["case"], last_failure["report"] = case, report
        raise AssertionError(report_text(report))  # one raise site: Hypothesis tells failures apart by where they rise

    def property_of(settings_, first: list[dict]):
        """The row's property under ``settings_``, ``first`` run before anything is drawn."""

        @settings_
        @hypothesis_seed(seed)
        @given(case=row.spec.cases(space))
        def property_(case):
            judge(case)

        for case in first:
            property_ = example(case=case)(property_)
        return property_

    fitting = [case for case in row.spec.explicit if ranks_needed(case) <= space.pool_ranks]
    try:
        property_of(command_settings("verify", examples), fitting)()
        never = coverage.covered(row.spec.functions, tally.called)
        # The claims the run did not reach get a case of the row's own strategy built to reach each (its explicit
        # cases' part where they do not fit this run): the verdict on a claim does not depend on --examples.
        drawn_for = cases_built_for(never, row.spec.cases(space), space, seed) if never else {}
        if drawn_for:
            first = list({canonical(case): case for case in drawn_for.values()}.values())
            property_of(settings(command_settings("verify", examples), phases=[Phase.explicit]), first)()
            never = coverage.covered(row.spec.functions, tally.called)
        unreachable = _built_for_but_not_run(never, row.spec.explicit, fitting + list(drawn_for.values()))
        for function in unreachable:
            tally.not_judged[f"the claim {function}"] = (
                f"not reached: none of its {tally.examples} cases called it, the row's cases built to reach it "
                f"need more ranks than this run's {space.pool_ranks}, and none of {CLAIM_SEARCH_DRAWS} cases "
                "drawn for this run is built to reach it"
            )
        never = [f for f in never if f not in unreachable]
        if never and row.failure is None and tally.examples:
            tally.failed = max(tally.failed, 1)
            row.failure = RowFailure(
                f"  PROBLEM: the row claims {', '.join(never)}, but none of its {tally.examples} cases called "
                f"{'it' if len(never) == 1 else 'them'} through the documented API (called: "
                f"{', '.join(sorted(tally.called)) or 'nothing'})"
            )
    except AssertionError:
        if "report" not in last_failure:  # Hypothesis itself complained (e.g. a flaky failure)
            tally.failed = max(tally.failed, 1)
            row.failure = RowFailure(traceback.format_exc(limit=3))
            return
        # Hypothesis replays the smallest failing example last: that is the one to report.
        case, report = last_failure["case"], last_failure["report"]
        row.failure = RowFailure(
            report_text(report),
            case=case,
            reproduce=repro_command(case, runner.impl, backend),
            report=report,
            error_maps=write_error_maps(report, error_dir),
            not_shrunk=not_shrunk[0] if not_shrunk else None,
        )
        if repro_dir is not None:
            row.failure.repro = runner.export_repro(case, report, repro_dir)
    except Exception:  # noqa: BLE001 - a harness or Hypothesis error fails this row, the others still run
        crashed = in_flight.get("case")
        if crashed is not None and not in_flight.get("counted"):
            tally.examples += 1  # the crashed case counts as run and failed, never as passed
        tally.failed = max(tally.failed, 1)
        at = crashed if crashed is not None else last_failure.get("case")
        row.failure = RowFailure(
            "  PROBLEM: the harness crashed on this case (no verdict on the implementation):\n" + _traceback_head(),
            case=at,
            reproduce=repro_command(at, runner.impl, backend) if at is not None else None,
        )
