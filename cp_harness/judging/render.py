"""The one renderer of verdicts: the text a failing case prints in pytest, verify, run-case, golden and bench.

Everything here reads data (``CaseReport``, ``TensorComparison``, a golden ``Verdict``) and returns text;
nothing judges. ``repro_command`` is the one-line command that runs a case again.
"""

from __future__ import annotations

import shlex

from cp_harness.cases.descriptions import canonical, case_id
from cp_harness.cases.implementation import case_impl
from cp_harness.judging.verdicts import CaseReport


def _where(entry: dict) -> str:
    if "owning_rank" not in entry:
        return ""
    padding = ", divisibility padding" if entry.get("divisibility_padding") else ""
    return f" (row {entry['row']}, position {entry['position']}, rank {entry['owning_rank']}{padding})"


def _also_lines(comp, limit: int | None = None) -> list[str]:
    entries = comp.first_mismatches[1:] if limit is None else comp.first_mismatches[1:1 + limit]
    return [f"       also index {e['index']}: actual {e['actual']!r}, expected {e['expected']!r}{_where(e)}"
            for e in entries]


def _passed_detail(c) -> str:
    if c.mode != "ulp":
        return f"{c.name} (exact)"
    excess = (f"; normwise {c.excess_error:.3g}, one rank {c.baseline_ulp:.3g}, excess {c.excess:.3g}"
              if c.excess is not None else "")
    return f"{c.name} ({c.max_ulp:.3g} ULP{excess})"


def report_text(report: CaseReport) -> str:
    """Readable account: problems first, then each failing tensor, then the passing ones in one line."""
    lines = [f"  PROBLEM: {problem}" for problem in report.problems]
    for comp in report.failures():
        lines.append(f"  FAIL {comp.summary()}")
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
    lines = [f"  PROBLEM: {p.splitlines()[0] if p else p}" for p in report.problems]
    extra_problem_lines = sum(len(p.splitlines()) - 1 for p in report.problems)
    if extra_problem_lines:
        lines.append(f"  ({extra_problem_lines} more lines of traceback in the JSON report / run-case output)")
    failures = report.failures()
    for comp in failures[:max_tensors]:
        lines.append(f"  FAIL {comp.summary()}")
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


def failure_message(case: dict, report: CaseReport | None, impl: str, *, backend: str = "gloo",
                    error: BaseException | None = None) -> str:
    lines = [f"CP case {case_id(case)} failed against implementation {case_impl(case, impl)!r}",
             f"case: {canonical(case)}",
             f"reproduce: {repro_command(case, impl, backend)}"]
    if error is not None:
        lines.append(f"rank failure: {error}")
    if report is not None:
        lines.append(report.format())
    return "\n".join(lines)


def verdict_text(report: CaseReport, impl: str, *, backend: str = "gloo", error_dir: str | None = None) -> str:
    """What ``python -m cp_harness run-case`` prints for ``report``: the pass line, or the failure message
    followed by one ``error map: PATH`` line per map written (into ``error_dir``)."""
    if report.ok:
        return f"case passed against {case_impl(report.case, impl)!r}:\n{report.format()}"
    from cp_harness.judging.error_maps import write_error_maps  # PNG writing, only when something failed

    lines = [failure_message(report.case, report, impl, backend=backend)]
    lines += [f"error map: {path}" for path in write_error_maps(report, error_dir)]
    return "\n".join(lines)


def golden_text(verdict, regenerate: str) -> str:
    """A golden case that does not match (``cp_harness.golden.comparison.Verdict``), and how to regenerate."""
    lines = [f"golden case {verdict.name!r} ({verdict.path or verdict.name}) does not match the current results",
             f"case: {canonical(verdict.case)}"]
    lines += [f"  PROBLEM: {p}" for p in verdict.problems]
    lines += [f"  FAIL {c.summary()}" for c in verdict.comparisons if not c.ok]
    passed = [c for c in verdict.comparisons if c.ok]
    if passed:
        lines.append(f"  passed: {len(passed)} of {len(verdict.comparisons)} array comparisons")
    lines += [f"  note: {n}" for n in verdict.notes]
    lines.append(f"if the change is intended, regenerate with: {regenerate}")
    return "\n".join(lines)
