"""The one renderer of verdicts: the text a failing case prints in pytest, verify, run-case, golden and bench.

Everything here reads data (``CaseReport``, the comparisons of ``cp_harness.judging.compare``, ``Problem``
records, a golden ``Verdict``) and returns text; nothing judges. A comparison's one-line account is
``comparison_summary``, one function per comparison type. ``repro_command`` is the one-line command that runs a
case again.
"""

from __future__ import annotations

import functools
import math
import shlex
from typing import Any

from cp_harness.cases.descriptions import canonical, case_id
from cp_harness.cases.implementation import case_impl
from cp_harness.judging.compare import Comparison, ExactComparison, UlpComparison
from cp_harness.judging.verdicts import CaseReport, Problem


def describe_location(loc: dict[str, Any]) -> str:
    """``row r, global position p, owned by rank k, ...`` of a ``TokenGrid.describe`` entry: how far the nearest
    shard boundary is (only where the layout has one: a boundary can explain the defect only there), and
    whether the position is divisibility padding."""
    parts = [f"row {loc['row']}", f"global position {loc['position']}", f"owned by rank {loc['owning_rank']}"]
    if loc.get("divisibility_padding"):
        parts.append("divisibility padding")
    distance = loc.get("distance_to_shard_boundary")
    if distance is not None:
        parts.append(f"{distance} tokens from a shard boundary" + (", AT A SHARD BOUNDARY" if distance == 0 else ""))
    return ", ".join(parts)


def _head(c: Comparison) -> str:
    return (
        f"{c.name}{f' on {c.group}' if c.group else ''} [{c.kind}, {c.dtype}, shape {list(c.shape)}]: "
        f"{c.mismatched} of {c.compared} elements differ"
    )


def _worst(c: Comparison, failed: bool) -> str:
    if not failed or c.worst_index is None:
        return ""
    text = f"; worst at index {list(c.worst_index)}: actual {c.worst_actual!r}, expected {c.worst_expected!r}"
    return text + (f" ({describe_location(c.location)})" if c.location else "")


@functools.singledispatch
def comparison_summary(c: Comparison) -> str:
    """One line: the tensor, how many elements differ, the largest error and where it is."""
    raise TypeError(f"no summary for {type(c).__name__}")


def _vacuous(c: Comparison) -> str | None:
    if c.problem is not None:
        return f"{c.name}: {c.problem}"
    if c.compared == 0:
        return f"{c.name}: nothing was compared (empty selection): a vacuous comparison is a failure"
    return None


@comparison_summary.register
def _exact_summary(c: ExactComparison) -> str:
    vacuous = _vacuous(c)
    if vacuous is not None:
        return vacuous
    head = _head(c) + (f"; largest absolute difference {c.max_abs:.6g}" if c.mismatched else "")
    return head + _worst(c, bool(c.mismatched))


@comparison_summary.register
def _ulp_summary(c: UlpComparison) -> str:
    vacuous = _vacuous(c)
    if vacuous is not None:
        return vacuous
    unit = f"{c.ulp_dtype} ULP" if c.ulp_dtype and c.ulp_dtype != c.dtype else "ULP"
    budget = (
        f"budget {c.budget_ulp:g} ULP"
        if math.isfinite(c.budget_ulp)
        else "no ULP budget: judged by its excess over one rank"
    )
    head = _head(c) + f"; largest error {c.max_ulp:.3g} {unit} ({budget}), {c.max_abs:.3g} absolute"
    x = c.excess
    if x is not None:
        head += (
            f"; normwise: CP error {x.error:.3g} {unit}, one-rank error {x.baseline:.3g}, "
            f"CP excess {x.excess:.3g} (limit {x.limit:g}: CP error <= {x.limit:g}"
            f" x one-rank error + {x.floor:g} ULP)"
        )
        if x.failed:
            head += f"; CP ADDS ERROR: {x.mismatched} elements above {x.limit:g} x {x.baseline:.3g} ULP + the floor"
    return head + _worst(c, bool(c.mismatched) or (x is not None and x.failed))


def problem_text(problem: Problem, *, headline_only: bool = False) -> str:
    """A problem as text: its message (and, unless ``headline_only``, its traceback or details)."""
    return problem.message if headline_only or not problem.detail else f"{problem.message}\n{problem.detail}"


def _where(entry: dict) -> str:
    if "owning_rank" not in entry:
        return ""
    padding = ", divisibility padding" if entry.get("divisibility_padding") else ""
    return f" (row {entry['row']}, position {entry['position']}, rank {entry['owning_rank']}{padding})"


def _also_lines(comp, limit: int | None = None) -> list[str]:
    entries = comp.first_mismatches[1:] if limit is None else comp.first_mismatches[1 : 1 + limit]
    return [
        f"       also index {e['index']}: actual {e['actual']!r}, expected {e['expected']!r}{_where(e)}"
        for e in entries
    ]


@functools.singledispatch
def _passed_detail(c: Comparison) -> str:
    return f"{c.name} (exact)"


@_passed_detail.register
def _(c: UlpComparison) -> str:
    x = c.excess
    excess = f"; normwise {x.error:.3g}, one rank {x.baseline:.3g}, excess {x.excess:.3g}" if x is not None else ""
    return f"{c.name} ({c.max_ulp:.3g} ULP{excess})"


def report_text(report: CaseReport) -> str:
    """Readable account: problems first, then each failing tensor, then the passing ones in one line."""
    lines = [f"  PROBLEM: {problem_text(problem)}" for problem in report.problems]
    for comp in report.failures():
        lines.append(f"  FAIL {comparison_summary(comp)}")
        lines += _also_lines(comp)
    passed = [c for c in report.comparisons if c.ok]
    if passed:
        lines.append("  passed: " + ", ".join(_passed_detail(c) for c in passed))
    if not report.comparisons:
        lines.append("  nothing was compared")
    return "\n".join(lines)


def condensed_text(report: CaseReport, max_tensors: int = 4, max_also: int = 2) -> str:
    """A failing report in a few lines: problems, the first failing tensors (with a couple of elements each),
    the rest by name (the verify command's failure summary)."""
    lines = [f"  PROBLEM: {problem_text(p, headline_only=True)}" for p in report.problems]
    extra_problem_lines = sum(len(p.detail.splitlines()) for p in report.problems)
    if extra_problem_lines:
        lines.append(f"  ({extra_problem_lines} more lines of traceback in the JSON report / run-case output)")
    failures = report.failures()
    for comp in failures[:max_tensors]:
        lines.append(f"  FAIL {comparison_summary(comp)}")
        lines += _also_lines(comp, max_also)
    if len(failures) > max_tensors:
        rest = [c.name for c in failures[max_tensors:]]
        lines.append(f"  ... and {len(rest)} more failing tensors: {', '.join(rest)}")
    passed = [c.name for c in report.comparisons if c.ok]
    if passed:
        lines.append(f"  passed: {', '.join(passed)}")
    return "\n".join(lines)


def repro_command(case: dict, impl: str, backend: str = "gloo") -> str:
    """A shell command that runs exactly this case again and prints its report (``impl``: the run's selection)."""
    parts = ["python", "-m", "cp_harness", "run-case", "--impl", case_impl(case, impl)]
    if backend != "gloo":
        parts += ["--backend", backend]
    return " ".join(shlex.quote(p) for p in parts + [canonical(case)])


def failure_message(
    case: dict, report: CaseReport | None, impl: str, *, backend: str = "gloo", error: BaseException | None = None
) -> str:
    lines = [
        f"CP case {case_id(case)} failed against implementation {case_impl(case, impl)!r}",
        f"case: {canonical(case)}",
        f"reproduce: {repro_command(case, impl, backend)}",
    ]
    if error is not None:
        lines.append(f"rank failure: {error}")
    if report is not None:
        lines.append(report_text(report))
    return "\n".join(lines)


def verdict_text(report: CaseReport, impl: str, *, backend: str = "gloo", error_dir: str | None = None) -> str:
    """What ``python -m cp_harness run-case`` prints for ``report``: the pass line, or the failure message
    followed by one ``error map: PATH`` line per map written (into ``error_dir``)."""
    if report.ok:
        return f"case passed against {case_impl(report.case, impl)!r}:\n{report_text(report)}"
    from cp_harness.judging.error_maps import write_error_maps  # PNG writing, only when something failed

    lines = [failure_message(report.case, report, impl, backend=backend)]
    lines += [f"error map: {path}" for path in write_error_maps(report, error_dir)]
    return "\n".join(lines)


def golden_text(verdict, regenerate: str) -> str:
    """A golden case that does not match (``cp_harness.golden.comparison.Verdict``), and how to regenerate."""
    lines = [
        f"golden case {verdict.name!r} ({verdict.path or verdict.name}) does not match the current results",
        f"case: {canonical(verdict.case)}",
    ]
    lines += [f"  PROBLEM: {p}" for p in verdict.problems]
    lines += [f"  FAIL {comparison_summary(c)}" for c in verdict.comparisons if not c.ok]
    passed = [c for c in verdict.comparisons if c.ok]
    if passed:
        lines.append(f"  passed: {len(passed)} of {len(verdict.comparisons)} array comparisons")
    lines += [f"  note: {n}" for n in verdict.notes]
    lines.append(f"if the change is intended, regenerate with: {regenerate}")
    return "\n".join(lines)
