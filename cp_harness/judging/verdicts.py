"""The verdict model: what judging one case found, as data (rendered by ``cp_harness.judging.render``).

A ``CaseReport`` holds every tensor comparison (``cp_harness.judging.compare.TensorComparison``), every
problem that is not a tensor (a rank raised, an output that must be a new tensor is the input), the
communication the ranks recorded and the documented functions they called. Verify, pytest, golden files
and bench all judge with it and render it with one renderer, so tests assert on fields, not on text.
"""

from __future__ import annotations

import dataclasses

from cp_harness.judging.compare import TensorComparison


@dataclasses.dataclass
class CaseReport:
    """The verdict on one case: every tensor comparison, every problem found, and what moved over the wire."""

    case: dict
    comparisons: list[TensorComparison] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    comm: list[dict] = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)
    called: set[str] = dataclasses.field(default_factory=set)  # documented functions some rank called
    # Where the time went (seconds: ranks, transport, oracle, compare; set by the runner). Not part of the verdict.
    timing: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.comparisons) and all(c.ok for c in self.comparisons)

    def add(self, comparison: TensorComparison) -> TensorComparison:
        self.comparisons.append(comparison)
        return comparison

    def require(self, condition: bool, problem: str) -> None:
        if not condition:
            self.problems.append(problem)

    @property
    def max_ulp(self) -> float:
        values = [c.max_ulp for c in self.comparisons if c.mode == "ulp"]
        return max(values) if values else 0.0

    @property
    def max_excess(self) -> float | None:
        """The largest CP excess over the one-rank baseline (``cp_harness.judging.excess``); ``None`` when not judged."""
        values = [c.excess for c in self.comparisons if c.excess is not None]
        return max(values) if values else None

    def failures(self) -> list[TensorComparison]:
        return [c for c in self.comparisons if not c.ok]

    def format(self) -> str:
        """The full account (``cp_harness.judging.render.report_text``)."""
        from cp_harness.judging.render import report_text

        return report_text(self)
