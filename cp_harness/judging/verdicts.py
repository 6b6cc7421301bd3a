"""The verdict model: what judging one case found, as data (rendered by ``cp_harness.judging.render``).

A ``CaseReport`` holds every tensor comparison (``cp_harness.judging.compare``), every ``Problem`` that is
not a tensor (a rank raised, an output that must be a new tensor is the input), the communication the ranks
recorded and the documented functions they called. Verify, pytest, golden files and bench all judge with it
and render it with one renderer, so tests assert on fields, not on text.
"""

from __future__ import annotations

import dataclasses
import enum

from cp_harness.judging.compare import Comparison, UlpComparison


class StrKind(str, enum.Enum):
    """A closed set of kinds that are strings: a member is its value in JSON (``json.dumps``), in ``str()`` and
    f-strings, and compares equal to it (``enum.StrEnum``, which needs Python 3.11; the package supports 3.10)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


class ProblemKind(StrKind):
    """What sort of problem a ``Problem`` is: the closed set producers write and readers compare against."""

    CONTRACT = "contract"  # the implementation broke the documented contract (the default)
    # RANK_*: a rank raised while running the case (its traceback is the detail), or the pool's diagnosis of a
    # rank fault of that kind (``cp_harness.ranks.outputs.RankFailureKind``, ``of_rank_failure``).
    RANK_RAISED = "rank raised"
    RANK_EXITED = "rank exited"
    RANK_HUNG = "rank hung"
    RANK_PROTOCOL = "rank protocol"
    NOT_SHARDED_LIKE_THE_TOKENS = "not sharded like the tokens"  # a batch key the sharder left whole or mis-split
    BASELINE_FAILED = "baseline failed"  # the one-rank run the excess judge needs failed itself
    MESH_FINDING = "mesh finding"  # fails on a world mesh, passes on a mesh over ranks 0..N-1
    PADDING_SENSITIVITY = "padding sensitivity"  # real models: one device on the CP-padded batch explains it
    KERNEL_SENSITIVITY = "kernel sensitivity"  # real models: one device under the CP path's kernels explains it
    PADDING_AND_KERNEL_SENSITIVITY = "padding and kernel sensitivity"
    # verify's JSON: a row that failed without a case's verdict (the harness crashed on a case, a claimed function
    # was never called, Hypothesis itself complained); its message is the failure's first line.
    ROW = "row"

    @classmethod
    def of_rank_failure(cls, failure_kind: str) -> ProblemKind:
        """The kind of the problem a ``RankFailure`` of kind ``failure_kind`` becomes (``raised``: ``RANK_RAISED``)."""
        return cls(f"rank {failure_kind}")


@dataclasses.dataclass(frozen=True)
class Problem:
    """Something wrong that is not a tensor. ``message``: one line that says what (the headline a summary
    prints); ``detail``: the rest (a traceback, the account of a finding); ``rank``: the rank it concerns
    (``None``: the case as a whole); ``kind``: what sort of problem (a ``ProblemKind``; its string value is
    accepted and converted, anything else raises ``ValueError``)."""

    message: str
    detail: str = ""
    rank: int | None = None
    kind: ProblemKind = ProblemKind.CONTRACT

    def __post_init__(self):
        object.__setattr__(self, "kind", ProblemKind(self.kind))  # frozen: the one place the kind is normalised

    @classmethod
    def of(cls, text: str, **fields) -> Problem:
        """A problem from a text whose first line is the headline."""
        message, _, detail = str(text).partition("\n")
        return cls(message, detail, **fields)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CaseReport:
    """The verdict on one case: every tensor comparison, every problem found, and what moved over the wire."""

    case: dict
    comparisons: list[Comparison] = dataclasses.field(default_factory=list)
    problems: list[Problem] = dataclasses.field(default_factory=list)
    comm: list[dict] = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)
    called: set[str] = dataclasses.field(default_factory=set)  # documented functions some rank called
    # What this case could not judge where it ran, and why (e.g. gradients on a device without a backward
    # kernel): named so that a report never reads as if it had judged them.
    not_judged: dict[str, str] = dataclasses.field(default_factory=dict)
    # Kernel stand-ins the CP run computed with instead of a device kernel (cp_harness.standins): name -> the
    # report line ("CPU, stand-in: ..."), so that a report never reads as if the device kernel had run.
    standins: dict[str, str] = dataclasses.field(default_factory=dict)
    # Where the time went (seconds: ranks, transport, oracle, compare; set by the runner). Not part of the verdict.
    timing: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.comparisons) and all(c.ok for c in self.comparisons)

    def add(self, comparison: Comparison) -> Comparison:
        self.comparisons.append(comparison)
        return comparison

    def problem(self, text: str, **fields) -> Problem:
        """Record a problem (its first line is the headline, the rest its detail) and return it."""
        found = Problem.of(text, **fields)
        self.problems.append(found)
        return found

    def require(self, condition: bool, problem: str, **fields) -> None:
        if not condition:
            self.problem(problem, **fields)

    @property
    def max_ulp(self) -> float:
        values = [c.max_ulp for c in self.comparisons if isinstance(c, UlpComparison)]  # the arithmetic ones
        return max(values) if values else 0.0

    @property
    def max_excess(self) -> float | None:
        """The largest CP excess over the one-rank baseline (``cp_harness.judging.excess``); ``None`` when not judged."""
        values = [c.excess.excess for c in self.comparisons if isinstance(c, UlpComparison) and c.excess is not None]
        return max(values) if values else None

    def failures(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.ok]


def merge_groups(case: dict, reports: list[tuple[str, CaseReport]]) -> CaseReport:
    """One report for a case that ran on several CP groups at once (``cp_harness.cases.meshes``), from each
    group's own report, ``(label, report)`` in group order: every comparison, tagged with its group, and every
    problem, headed by its group. ``comm`` is the first group's (every group runs the same case, so the
    communication judged against the case's minimum is one group's); ``called`` and ``not_judged`` are the
    union."""
    merged = CaseReport(case=case)
    for label, report in reports:
        for comparison in report.comparisons:
            comparison.group = label
            merged.comparisons.append(comparison)
        merged.problems += [dataclasses.replace(p, message=f"{label}: {p.message}") for p in report.problems]
        merged.called |= report.called
        merged.not_judged.update(report.not_judged)
        merged.standins.update(report.standins)
    if reports:
        merged.comm, merged.info = reports[0][1].comm, reports[0][1].info
    return merged
