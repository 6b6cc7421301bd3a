"""The rows of the report: what each row is (``VerifyRow``, declared by its check), what its cases tallied, and
how it failed.

A ``Row`` is the declared row (``spec``: its id, label, strategy, claimed functions, dtypes, explicit cases),
the ``RowTally`` of its cases (examples, passes, worst ULP and excess, bytes moved against the minimum, dtypes)
and, when it failed, its ``RowFailure`` (the smallest failing case, its reproduction command, the report).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cp_harness import checks
from cp_harness.cases.descriptions import payload_dtype
from cp_harness.checks import VerifyRow
from cp_harness.instruments import coverage
from cp_harness.judging import comm_minimum
from cp_harness.judging.verdicts import CaseReport, ProblemKind


@dataclasses.dataclass
class RowTally:
    """What a row's cases added up to."""

    examples: int = 0
    passed: int = 0
    failed: int = 0
    max_ulp: float = 0.0
    max_excess: float | None = None  # worst CP error / one-rank error (cp_harness.judging.excess)
    examples_by_dtype: dict = dataclasses.field(default_factory=dict)
    failed_by_dtype: dict = dataclasses.field(default_factory=dict)
    arithmetic: bool = False  # some comparison was in ULPs (else: data movement, compared bit for bit)
    moved_bytes: int = 0
    minimum_bytes: int = 0
    unaccounted_ops: list[str] = dataclasses.field(default_factory=list)  # ops whose bytes the meter could not tell
    called: set = dataclasses.field(default_factory=set)  # documented functions its cases called on the ranks
    not_judged: dict = dataclasses.field(default_factory=dict)  # what its cases could not judge here -> why
    standins: dict = dataclasses.field(default_factory=dict)  # kernel stand-ins its cases ran on -> report line
    skipped: str | None = None  # why the row did not run at all here (e.g. its model specs need CUDA)

    def add(self, case: dict, report: CaseReport) -> None:
        """Count one case's report (its examples, dtype, errors, communication, calls)."""
        self.called |= report.called
        self.examples += 1
        dtype = payload_dtype(case)
        self.examples_by_dtype[dtype] = self.examples_by_dtype.get(dtype, 0) + 1
        moved, minimum = comm_minimum.moved_and_minimum(report, checks.check_of(case).least_communication(case))
        if moved is None:
            self.unaccounted_ops = sorted(set(self.unaccounted_ops) | set(comm_minimum.unaccounted_ops(report)))
        else:
            self.moved_bytes += moved
        self.minimum_bytes += minimum
        self.arithmetic = self.arithmetic or any(c.arithmetic for c in report.comparisons)
        if report.max_ulp == report.max_ulp:  # not NaN
            self.max_ulp = max(self.max_ulp, report.max_ulp)
        excess = report.max_excess
        if excess is not None and excess == excess:
            self.max_excess = excess if self.max_excess is None else max(self.max_excess, excess)
        self.not_judged.update(report.not_judged)
        self.standins.update(report.standins)
        if report.ok:
            self.passed += 1
        else:
            self.failed += 1
            self.failed_by_dtype[dtype] = self.failed_by_dtype.get(dtype, 0) + 1


@dataclasses.dataclass
class RowFailure:
    """How a row failed: ``text`` (the full account), the case (the smallest one Hypothesis found, or the one
    the harness crashed on), its reproduction command, its report (``None`` when the failure is not a case's
    verdict: a crash, a claim never exercised), the error maps it wrote and its standalone repro."""

    text: str
    case: dict | None = None
    reproduce: str | None = None
    report: CaseReport | None = dataclasses.field(default=None, repr=False)
    error_maps: list[str] = dataclasses.field(default_factory=list)
    repro: Any = None  # the standalone repro written for it (``runner.Exported``), with --export-repros
    not_shrunk: str | None = None  # why the case is the first failing one found, not a shrunk one


@dataclasses.dataclass
class Row:
    """One line of the report: the declared row, its tally, and how it failed (``None``: it did not)."""

    spec: VerifyRow
    tally: RowTally = dataclasses.field(default_factory=RowTally)
    failure: RowFailure | None = None

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def name(self) -> str:
        """The display label."""
        return self.spec.label

    @property
    def comm_ratio(self) -> float | None:
        t = self.tally
        if t.unaccounted_ops:  # bytes of some traffic unknown: no ratio rather than a wrong one
            return None
        return t.moved_bytes / t.minimum_bytes if t.minimum_bytes else None

    @property
    def ok(self) -> bool:
        return self.tally.failed == 0 and self.failure is None

    def ulp_text(self) -> str:
        if not self.tally.arithmetic:
            return "exact" if self.ok else "NOT EXACT"
        return f"{self.tally.max_ulp:.3g}"

    def excess_text(self) -> str:
        return "-" if self.tally.max_excess is None else f"{self.tally.max_excess:.3g}"

    def as_dict(self) -> dict[str, Any]:
        t, f = self.tally, self.failure
        report = f.report if f is not None else None
        data: dict[str, Any] = {
            "id": self.id,
            "name": self.name,
            "examples": t.examples,
            "passed": t.passed,
            "failed": t.failed,
            "max_ulp": t.max_ulp,
            "max_excess": t.max_excess,
            "examples_by_dtype": t.examples_by_dtype,
            "failed_by_dtype": t.failed_by_dtype,
            "arithmetic": t.arithmetic,
            "moved_bytes": t.moved_bytes,
            "minimum_bytes": t.minimum_bytes,
            "unaccounted_ops": t.unaccounted_ops,
            "not_judged": t.not_judged,
            "standins": t.standins,
            "skipped": t.skipped,
            "failure": f.text if f is not None else None,
            "failing_case": f.case if f is not None else None,
            "reproduce": f.reproduce if f is not None else None,
            "not_shrunk": f.not_shrunk if f is not None else None,
            "error_maps": f.error_maps if f is not None else [],
            "repro_script": f.repro.path if f is not None and f.repro is not None else None,
            "repro_script_note": (f.repro.why or f.repro.note) if f is not None and f.repro is not None else None,
            "functions": list(self.spec.functions),
            "dtypes": list(self.spec.dtypes),
            "called": sorted(t.called),
            "claimed_but_never_called": coverage.covered(self.spec.functions, t.called),
            "failing_tensors": [c.as_dict() for c in report.failures()] if report is not None else [],
            "problems": [p.as_dict() for p in report.problems] if report is not None else [],
            "ok": self.ok,
            "comparison": "ulp" if t.arithmetic else "exact",
            "comm_ratio": self.comm_ratio,
        }
        if report is None and f is not None:  # the row failed without a verdict (a crash, a claim never run)
            data["problems"] = [
                {"message": f.text.strip().splitlines()[0], "detail": "", "rank": None, "kind": ProblemKind.ROW}
            ]
        return data


def default_rows() -> list[Row]:
    """The report's rows, as the checks declare them (``Check.rows``), in their table order: every documented
    function (grouped as they are called), the sharder, both models (float64, and bfloat16 end to end:
    parameters, activations, gradients), and the real-model rows (run only with ``--model``).

    Each row's ``functions`` are claims: ``verify`` fails a row whose cases never called one of them through
    the documented API (``cp_harness.instruments.coverage``).
    """
    declared = sorted((r for check in checks.load_checks().values() for r in check.rows), key=lambda r: r.position)
    return [Row(r) for r in declared]


def select_rows(rows: list[Row], *, dtypes: tuple[str, ...] | None = None, names: tuple[str, ...] = ()) -> list[Row]:
    """Rows whose cases can draw one of ``dtypes`` (``None``: all; a row without a payload dtype counts as
    ``"layout"``) and whose label or id contains one of ``names`` (empty: all)."""
    out = []
    for row in rows:
        if dtypes is not None and not set(row.spec.dtypes or ("layout",)) & set(dtypes):
            continue
        if names and not any(n in row.name or n in row.id for n in names):
            continue
        out.append(row)
    return out
