"""Checks: what a case runs on the ranks and how the test process judges it.

A check has two halves, registered under one name:

- ``rank(case, ctx) -> (info, tensors)`` runs on every rank of the case with
  the implementation under test (``ctx.impl``) and returns a JSON-able
  ``info`` dict and named local tensors.
- ``evaluate(case, outputs) -> CaseReport`` runs in the test process: it
  rebuilds the global inputs from the case, runs the oracle and compares.

A check whose oracle costs real time splits its test-process half in two:
``expect(case) -> expected`` does the oracle work from the case alone (no
rank output is needed), and ``evaluate(case, outputs, expected)`` compares.
The runner then computes ``expect`` while the ranks still run the case
(``CaseRunner.run``, ``CaseRunner.run_many``). ``checks.evaluate(case,
outputs)`` stays the one entry point for every caller: it computes
``expect`` itself when it is not given.

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

from cp_harness.judging.compare import TensorComparison, TokenGrid, compare


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
    """``evaluate(case, outputs)``, or ``evaluate(case, outputs, expected)`` when ``expect`` is given."""

    name: str
    rank: Callable[[dict, RankContext], tuple[dict, dict[str, torch.Tensor]]]
    evaluate: Callable[..., CaseReport]
    functions: tuple[str, ...] = ()  # documented functions this check exercises (for reports)
    expect: Callable[[dict], Any] | None = None  # the oracle work, from the case alone


CHECKS: dict[str, Check] = {}
_loaded = False


def register(name: str, *, rank, evaluate, functions: tuple[str, ...] = (), expect=None) -> Check:
    if name in CHECKS:
        raise ValueError(f"check {name!r} registered twice")
    CHECKS[name] = Check(name, rank, evaluate, functions, expect)
    return CHECKS[name]


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


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


def expect(case: dict) -> Any:
    """The oracle half of ``case``'s check, computed from the case alone (before or while the ranks run it).

    ``NOT_GIVEN`` for a check without an ``expect`` (its ``evaluate`` does all the work). Pass the result
    to ``evaluate(case, outputs, expected)``; it is read, never changed, so it may be reused.
    """
    check = get_check(case["check"])
    if check.expect is None:
        return NOT_GIVEN
    with one_intra_op_thread():
        return check.expect(case)


def evaluate(case: dict, outputs: list, expected: Any = NOT_GIVEN) -> CaseReport:
    """Judge the outputs of every rank for ``case`` (test-process side).

    ``expected``: what ``expect(case)`` returned, when the caller computed it
    already (while the ranks ran); computed here otherwise. The oracle runs
    with one intra-op thread (as the ranks do): case tensors are tiny, and on a
    loaded machine OpenMP threads waiting for each other made the evaluation
    10-100 times slower (``docs/benchmarks.md``).
    """
    raised = [o for o in outputs if not o.ok]
    if raised:
        report = CaseReport(case=case)
        for o in raised:
            report.problems.append(f"rank {o.rank} raised {o.error_type}: {o.message}\n{o.traceback}")
    else:
        check = get_check(case["check"])
        with one_intra_op_thread():
            if check.expect is None:
                report = check.evaluate(case, outputs)
            else:
                if expected is NOT_GIVEN:
                    expected = check.expect(case)
                report = check.evaluate(case, outputs, expected)
    report.comm = [{"rank": o.rank, "calls": o.comm} for o in outputs]
    report.called = set().union(*(o.called for o in outputs)) if outputs else set()
    return report


def stack_ranks(outputs: list, name: str, axis: int = 1) -> np.ndarray:
    """Concatenate a local token tensor from every rank in rank order along ``axis`` (global order)."""
    missing = [o.rank for o in outputs if name not in o.tensors]
    if missing:
        raise KeyError(f"ranks {missing} returned no tensor {name!r}")
    return np.concatenate([o.tensors[name] for o in outputs], axis=axis)


@dataclasses.dataclass
class ReportedLayout:
    """The layout the ranks reported, once judged consistent: ``S`` real and ``S_pad`` padded positions,
    each rank's index map ``[L]`` (rank order) and the grid for failure messages."""

    seq_len: int
    padded_len: int
    index_maps: list[np.ndarray]
    grid: TokenGrid

    @property
    def local_len(self) -> int:
        return len(self.index_maps[0]) if self.index_maps else 0

    def scatter(self, outputs: list, name: str, axis: int = 1) -> np.ndarray:
        """A local token tensor from every rank put at its global positions: ``[.., S_pad, ..]`` in global order."""
        missing = [o.rank for o in outputs if name not in o.tensors]
        if missing:
            raise KeyError(f"ranks {missing} returned no tensor {name!r}")
        first = np.asarray(outputs[0].tensors[name])
        shape = list(first.shape)
        shape[axis] = self.padded_len
        out = np.zeros(shape, dtype=first.dtype)
        for o, indices in zip(outputs, self.index_maps):
            where = [slice(None)] * len(shape)
            where[axis] = indices
            out[tuple(where)] = o.tensors[name]
        return out


def reported_layout(outputs: list, seq_len: int) -> ReportedLayout:
    """The layout the ranks reported (``token_indices``), taken as it is (``judge_token_layout`` judges it)."""
    maps = [np.asarray(o.tensors["token_indices"]).reshape(-1).astype(np.int64) for o in outputs]
    return ReportedLayout(seq_len, sum(len(m) for m in maps), maps, TokenGrid.from_index_maps(maps))


def judge_token_layout(report: CaseReport, outputs: list, seq_len: int, *, local_name: str) -> ReportedLayout | None:
    """Judge the layout every rank reported (``sharding.layout_report``) against the contract; ``None`` when
    it is not usable (the problems are in ``report``).

    - every rank's index map has as many tokens as its local tensor ``local_name`` (axis 1), all ranks equally many;
    - together they own every position of ``[0, N*L)`` exactly once, and ``N*L >= S``;
    - the reported ``original_seq_len`` / ``padded_seq_len`` (when given) are ``S`` and ``N*L``;
    - ``shard_token_tensor`` of the global ``arange(S)`` (fill ``-1``) selects exactly the index map's tokens.
    """
    maps = [np.asarray(o.tensors["token_indices"]).reshape(-1).astype(np.int64) for o in outputs]
    usable = True
    for o, indices in zip(outputs, maps):
        local_len = np.asarray(o.tensors[local_name]).shape[1]
        if len(indices) != local_len:
            report.problems.append(f"rank {o.rank}: the index map lists {len(indices)} tokens but its local "
                                   f"{local_name} holds {local_len}")
            usable = False
    lengths = {len(m) for m in maps}
    if len(lengths) > 1:
        report.problems.append(f"ranks own different numbers of tokens: {[len(m) for m in maps]} (the verbs need equal shards)")
        usable = False
    padded = sum(len(m) for m in maps)
    if usable:
        owned = np.concatenate(maps) if maps else np.zeros(0, dtype=np.int64)
        counts = np.bincount(owned[(owned >= 0) & (owned < padded)], minlength=padded)
        outside = owned[(owned < 0) | (owned >= padded)]
        if outside.size or (counts != 1).any():
            twice = np.flatnonzero(counts > 1)[:5].tolist()
            nobody = np.flatnonzero(counts == 0)[:5].tolist()
            report.problems.append(f"the index maps do not own every global position of [0, {padded}) exactly once: "
                                   f"owned twice {twice}, by nobody {nobody}, outside {outside[:5].tolist()}")
            usable = False
    if padded < seq_len:
        report.problems.append(f"the ranks hold {padded} tokens in all, fewer than the sequence's {seq_len}")
        usable = False
    for o in outputs:
        original, reported = o.info.get("original_seq_len"), o.info.get("padded_seq_len")
        if original is not None and original != seq_len:
            report.problems.append(f"rank {o.rank}: shard_layout.original_seq_len={original}, the batch has {seq_len}")
        if reported is not None and reported != padded:
            report.problems.append(f"rank {o.rank}: shard_layout.padded_seq_len={reported}, but the ranks hold {padded}")
    if not usable:
        return None
    layout = reported_layout(outputs, seq_len)
    for o, indices in zip(outputs, maps):
        report.add(compare(f"shard_token_tensor(arange(S)) agrees with the index map@rank{o.rank}",
                           np.asarray(o.tensors["token_marker"]), np.where(indices < seq_len, indices, -1), mode="exact"))
    return layout
