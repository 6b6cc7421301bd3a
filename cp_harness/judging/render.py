"""The one renderer of verdicts: the text a failing case prints in pytest, verify, run-case and golden.

Everything here reads data (``CaseReport``, ``TensorComparison``) and returns text; nothing judges.
"""

from __future__ import annotations

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
