"""Checks: what a case runs on the ranks and how the test process judges it.

A check has two halves, registered under one name:

- ``rank(case, ctx) -> (info, tensors)`` runs on every rank of the case with
  the implementation under test (``ctx.impl``) and returns a JSON-able
  ``info`` dict and named local tensors.
- ``evaluate(case, outputs) -> CaseReport`` runs in the test process: it
  rebuilds the global inputs from the case, runs the oracle and compares.

Check modules register themselves on import; every module of this package
is one (found with ``pkgutil``), so a new check is a new file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
from typing import Any, Callable

import numpy as np
import torch

from cp_harness.compare import TensorComparison



@dataclasses.dataclass
class RankContext:
    """What a rank knows while it runs a case: its CP rank, the CP size, the mesh (``None`` when the case asks for no mesh), its device, the implementation under test."""

    rank: int
    cp_size: int
    mesh: Any
    device: torch.device
    backend: str
    impl: Any

    def mesh_for(self, case: dict):
        """The mesh argument the case wants the implementation to receive."""
        if case.get("mesh", "mesh") == "none":
            if self.cp_size != 1:
                raise ValueError(f"case asks for mesh='none' with world_size={self.cp_size}; only world_size=1 can run without a mesh")
            return None
        return self.mesh


@dataclasses.dataclass
class CaseReport:
    """The verdict on one case: every tensor comparison, every problem found, and what moved over the wire."""

    case: dict
    comparisons: list[TensorComparison] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    comm: list[dict] = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)

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
        """The largest CP excess over the one-rank baseline (``cp_harness.excess``); ``None`` when not judged."""
        values = [c.excess for c in self.comparisons if c.excess is not None]
        return max(values) if values else None

    def failures(self) -> list[TensorComparison]:
        return [c for c in self.comparisons if not c.ok]

    def format(self) -> str:
        """Readable account: problems first, then each failing tensor, then the passing ones in one line."""
        lines = []
        for problem in self.problems:
            lines.append(f"  PROBLEM: {problem}")
        for comp in self.failures():
            lines.append(f"  FAIL {comp.summary()}")
            for entry in comp.first_mismatches[1:]:
                where = ""
                if "owning_rank" in entry:
                    where = f" (row {entry['row']}, position {entry['position']}, rank {entry['owning_rank']})"
                lines.append(f"       also index {entry['index']}: actual {entry['actual']!r}, expected {entry['expected']!r}{where}")
        passed = [c for c in self.comparisons if c.ok]
        if passed:
            lines.append("  passed: " + ", ".join(
                f"{c.name}" + ((f" ({c.max_ulp:.3g} ULP" + (f"; normwise {c.excess_error:.3g}, one rank {c.baseline_ulp:.3g}, excess {c.excess:.3g}"
                                                           if c.excess is not None else "") + ")")
                               if c.mode == "ulp" else " (exact)") for c in passed))
        if not self.comparisons:
            lines.append("  nothing was compared")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    rank: Callable[[dict, RankContext], tuple[dict, dict[str, torch.Tensor]]]
    evaluate: Callable[[dict, list], CaseReport]
    functions: tuple[str, ...] = ()  # documented functions this check exercises (for reports)


CHECKS: dict[str, Check] = {}
_loaded = False


def register(name: str, *, rank, evaluate, functions: tuple[str, ...] = ()) -> None:
    if name in CHECKS:
        raise ValueError(f"check {name!r} registered twice")
    CHECKS[name] = Check(name, rank, evaluate, functions)


def load_checks() -> dict[str, Check]:
    global _loaded
    if not _loaded:
        for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
            importlib.import_module(f"cp_harness.checks.{module}")
        _loaded = True
    return CHECKS


def get_check(name: str) -> Check:
    checks = load_checks()
    if name not in checks:
        raise KeyError(f"unknown check {name!r}; known: {sorted(checks)}")
    return checks[name]


def to_numpy(value: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy of a tensor (bfloat16 widened to float32)."""
    value = value.detach()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.cpu().numpy().copy()


def run_on_rank(case: dict, ctx: RankContext) -> tuple[dict, dict[str, np.ndarray]]:
    """Run the rank half of ``case["check"]``; tensors come back as numpy arrays."""
    info, tensors = get_check(case["check"]).rank(case, ctx)
    return info, {name: to_numpy(t) if isinstance(t, torch.Tensor) else np.asarray(t) for name, t in tensors.items()}


@contextlib.contextmanager
def one_intra_op_thread():
    """Run the oracle with one torch thread, as the ranks do: faster for tiny tensors, and the
    float64 reductions (hence golden files) then do not depend on the machine's core count."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


def evaluate(case: dict, outputs: list) -> CaseReport:
    """Judge the outputs of every rank for ``case`` (test-process side).

    The oracle runs with one intra-op thread (as the ranks do): case tensors are
    tiny, and on a loaded machine OpenMP threads waiting for each other made
    the evaluation 10-100 times slower (``docs/benchmarks.md``).
    """
    raised = [o for o in outputs if not o.ok]
    if raised:
        report = CaseReport(case=case)
        for o in raised:
            report.problems.append(f"rank {o.rank} raised {o.error_type}: {o.message}\n{o.traceback}")
    else:
        with one_intra_op_thread():
            report = get_check(case["check"]).evaluate(case, outputs)
    report.comm = [{"rank": o.rank, "calls": o.comm} for o in outputs]
    return report


def stack_ranks(outputs: list, name: str, axis: int = 1) -> np.ndarray:
    """Concatenate a local token tensor from every rank in rank order along ``axis`` (global order)."""
    missing = [o.rank for o in outputs if name not in o.tensors]
    if missing:
        raise KeyError(f"ranks {missing} returned no tensor {name!r}")
    return np.concatenate([o.tensors[name] for o in outputs], axis=axis)
