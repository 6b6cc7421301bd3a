"""What ``verify`` is asked (``VerifySettings``) and what it found (``VerifyResult``), and the two ways a result
is shown: the text the command prints (``result_text``) and the JSON report (``VerifyResult.as_dict``)."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Callable, Mapping
from typing import Any

from cp_harness.cases.descriptions import canonical
from cp_harness.cases.profiles import DEFAULT_WORLD_SIZES, in_dtype_order
from cp_harness.judging.policy import STRICT, JudgingPolicy, policy_named
from cp_harness.judging.render import condensed_text
from cp_harness.judging.serialize import json_safe
from cp_harness.verify.rows import Row

# How long a failing row may shrink its failure. Rows whose ranks raise restart the pool on every failing
# run (seconds each at 8 ranks), rows that fail by value do not; one budget in seconds bounds both the same.
SHRINK_SECONDS = 20.0

TABLE_HEADER = ("function / model", "examples", "passed", "max ULP", "CP excess", "comm moved/min")


@dataclasses.dataclass(frozen=True)
class VerifySettings:
    """One ``verify`` run: the implementation (``impl``, comma-separated for several) or the model specs
    (``model``: then the real-model rows run), the CP sizes, examples per row, seed, the payload dtypes and
    row names it keeps (``None`` / empty: all), the judging policy, how the ranks start, where error maps go
    (``None``: a temporary folder), the shrinking budget in seconds and where standalone repros go (``None``:
    none are written).

    ``known_failure`` (a caller's, not a command-line option): ``(row label, case, CaseReport) -> reason or None``,
    asked about a row's first failing case; a reason means the failure is already accounted for (the real-client
    gate: a documented defect of the subject, whose own case it replays), so the row reports that case as found,
    not shrunk, and says why (``RowFailure.not_shrunk``)."""

    impl: str = "cp_impl"
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    examples: int = 25
    backend: str = "gloo"
    seed: int = 0
    dtypes: tuple[str, ...] | None = None
    rows: tuple[str, ...] = ()
    model: tuple[str, ...] = ()
    step: str = "forward-backward"  # which real-model rows run (``--step``): their ``VerifyRow.step``
    policy: JudgingPolicy = STRICT
    launcher: str | None = None
    error_dir: str | None = None
    shrink_seconds: float = SHRINK_SECONDS
    case_timeout: float | None = None  # None: 120 s, 300 s with model specs (a rank's first case builds the model)
    # Where the ranks run (``cp_harness.ranks.outputs.PoolConfig``): nodes, the rendezvous, this process's address.
    pool: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    export_repros: str | None = None  # where each failing row's standalone repro is written (None: nowhere)
    known_failure: Callable[[str, dict, Any], str | None] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    @property
    def resolved_case_timeout(self) -> float:
        if self.case_timeout is not None:
            return float(self.case_timeout)
        return 300.0 if self.model else 120.0

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> VerifySettings:
        """From the resolved options (``cp_harness.options.resolve``); unknown keys are ignored."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in values.items() if k in fields and v is not None}
        if "precision_policy" in values and values["precision_policy"] is not None:
            kept["policy"] = policy_named(values["precision_policy"])
        kept["model"] = tuple(values.get("model_specs") or ())
        kept["rows"] = tuple(values.get("rows") or ())
        from cp_harness.options import pool_options

        kept["pool"] = {k: v for k, v in pool_options(values).items() if k != "launcher"}
        return cls(**kept)


@dataclasses.dataclass
class VerifyResult:
    """What a run found: its rows (tallies and failures), how long it took, the examples per CP size and the
    one-rank baseline runs; ``cannot_run`` says why nothing ran (exit status 2)."""

    settings: VerifySettings
    rows: list[Row] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    examples_per_world_size: dict[int, int] = dataclasses.field(default_factory=dict)
    baseline_runs: int = 0
    cannot_run: str | None = None
    error_map_dir: str | None = None

    @property
    def failed_rows(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    @property
    def exit_code(self) -> int:
        """0 every row passed, 1 a row failed, 2 the run could not start."""
        return 2 if self.cannot_run is not None else 1 if self.failed_rows else 0

    def dtype_totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(examples, failed)`` per payload dtype over all rows."""
        examples: dict[str, int] = {}
        failed: dict[str, int] = {}
        for row in self.rows:
            for d, n in row.tally.examples_by_dtype.items():
                examples[d] = examples.get(d, 0) + n
            for d, n in row.tally.failed_by_dtype.items():
                failed[d] = failed.get(d, 0) + n
        return examples, failed

    def as_dict(self) -> dict[str, Any]:
        """The JSON report: the run's settings, the table (text and rows) and every failure with its reproduction."""
        import torch

        s = self.settings
        examples, failed = self.dtype_totals()
        return json_safe(
            {
                "format": 1,
                "ok": not self.failed_rows,
                "impl": s.impl,
                "model": list(s.model),
                "backend": s.backend,
                "world_sizes": list(s.world_sizes),
                "seed": s.seed,
                "precision_policy": s.policy.name,
                "nodes": dict(s.pool, nnodes=int(s.pool.get("nnodes", 1))),
                "examples_per_row": s.examples,
                "examples": sum(r.tally.examples for r in self.rows),
                "seconds": round(self.seconds, 3),
                "examples_per_world_size": {str(k): v for k, v in sorted(self.examples_per_world_size.items())},
                "examples_per_dtype": examples,
                "failed_per_dtype": failed,
                "versions": {"python": platform.python_version(), "torch": torch.__version__},
                "columns": COLUMNS,
                "table": format_table(self.rows),
                "failed_rows": [r.name for r in self.failed_rows],
                "rows": [r.as_dict() for r in self.rows],
                "error_map_dir": self.error_map_dir,
            }
        )


COLUMNS = {
    "examples": "cases run (a failing row includes Hypothesis' shrinking runs)",
    "passed": "cases that passed",
    "max_ulp": "largest error of any arithmetic comparison, in ULPs of the compared dtype",
    "max_excess": "largest CP excess: CP error / (error of the same implementation on one rank + "
    "floor / c); a tensor fails above c (cp_harness.judging.excess); null: not judged",
    "examples_by_dtype": "cases run per payload dtype (layout: no floating payload)",
    "comparison": "exact (data movement, bit for bit) or ulp (arithmetic within cp_harness.judging.budgets)",
    "comm_ratio": "payload bytes sent / analytic minimum (cp_harness.judging.comm_minimum); null: no closed "
    "form, or unaccounted_ops is not empty",
    "unaccounted_ops": "communication ops the meter could not attribute (no byte rule, or a group "
    "it could not size); the table then says 'unaccounted' instead of a ratio",
    "not_judged": "what the row's cases could not judge where they ran (e.g. gradients on CPU), and why",
    "standins": "kernel stand-ins some of the row's cases computed with instead of a device kernel (name -> what "
    "ran instead, cp_harness.standins); {}: none",
    "skipped": "why the row did not run here at all (e.g. every model spec it draws needs CUDA); null: it ran",
    "not_shrunk": "why failing_case is the first failing case found rather than a shrunk one (the caller already "
    "accounts for that failure: VerifySettings.known_failure); null: shrunk within shrink_seconds",
}


def format_table(rows: list[Row]) -> str:
    """The report table: one line per row, ``FAILED`` at the end of a failing one."""
    width = max([48] + [len(r.name) for r in rows])
    header = (
        f"{TABLE_HEADER[0]:<{width}} {TABLE_HEADER[1]:>8} {TABLE_HEADER[2]:>7} {TABLE_HEADER[3]:>9} "
        f"{TABLE_HEADER[4]:>9} {TABLE_HEADER[5]:>15}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = row.comm_ratio
        ratio_text = "unaccounted" if row.tally.unaccounted_ops else "-" if ratio is None else f"{ratio:.2f}"
        mark = (
            "   FAILED"
            if not row.ok
            else "   skipped"
            if row.tally.skipped
            else "   stand-in"
            if row.tally.standins
            else ""
        )
        lines.append(
            f"{row.name:<{width}} {row.tally.examples:>8} {row.tally.passed:>7} {row.ulp_text():>9} "
            f"{row.excess_text():>9} {ratio_text:>15}" + mark
        )
    return "\n".join(lines)


def _by_dtype(counts: dict[str, int]) -> str:
    return ", ".join(f"{d}: {counts[d]}" for d in in_dtype_order(counts)) or "none"


def result_text(result: VerifyResult) -> str:
    """What the command prints after the run: the header, the table, the counts, each failure, the notes."""
    s = result.settings
    subject = f"model spec(s) {', '.join(s.model)}" if s.model else f"implementation {s.impl!r}"
    nodes = int(s.pool.get("nnodes", 1))
    where = f", {nodes} nodes (rank order {s.pool.get('rank_order', 'blocked')})" if nodes > 1 else ""
    lines = [
        f"cp_harness verify: {subject}, backend {s.backend}, world sizes {list(s.world_sizes)}{where}, "
        f"seed {s.seed}, {s.examples} examples per row, precision policy {s.policy.name}",
        format_table(result.rows),
    ]
    total = sum(r.tally.examples for r in result.rows)
    sizes = result.examples_per_world_size
    lines.append(
        f"{total} examples in {result.seconds:.1f} s; examples per world size: "
        + ", ".join(f"N={n}: {sizes[n]}" for n in sorted(sizes))
    )
    per_dtype, failed_dtype = result.dtype_totals()
    lines.append(
        f"examples per dtype: {_by_dtype(per_dtype)}; failed per dtype: {_by_dtype(failed_dtype)}; "
        f"one-rank baseline runs: {result.baseline_runs}"
    )
    for row in result.rows:
        if row.tally.skipped:
            lines.append(f"skipped {row.name}: {row.tally.skipped}")
        for what, why in sorted(row.tally.not_judged.items()):
            lines.append(f"not judged in {row.name}: {what} ({why})")
        for name, text in sorted(row.tally.standins.items()):
            lines.append(f"ran on a stand-in in {row.name}: {text} ({name}; the device kernel did not run)")
    for row in result.failed_rows:
        f = row.failure
        lines.append(f"\nFAILED {row.name}")
        if f is None:
            continue
        if f.case is not None:
            lines.append(f"  case: {canonical(f.case)}\n  reproduce: {f.reproduce}")
        if f.not_shrunk is not None:
            lines.append(f"  not shrunk: {f.not_shrunk}")
        lines.append(condensed_text(f.report) if f.report is not None else f.text)
        lines += [f"  error map: {path}" for path in f.error_maps]
        if f.repro is not None:
            lines.append("  " + f.repro.line() + (f" ({f.repro.note})" if f.repro.note else ""))
    unattributed = [f"{r.name} ({', '.join(r.tally.unaccounted_ops)})" for r in result.rows if r.tally.unaccounted_ops]
    if unattributed:
        lines.append(f"communication the meter could not attribute in: {'; '.join(unattributed)} (no ratio given)")
    below = [r.name for r in result.rows if r.comm_ratio is not None and r.comm_ratio < 1.0]
    if below:
        lines.append(f"communication below the minimum in: {', '.join(below)} (data the contract needs never moved)")
    failed = result.failed_rows
    if failed:
        lines.append(f"\n{len(failed)} of {len(result.rows)} rows FAILED: {', '.join(r.name for r in failed)}")
    else:
        ran = [r for r in result.rows if not r.tally.skipped]
        lines.append(
            f"all {len(ran)} rows passed"
            + (f" ({len(result.rows) - len(ran)} skipped)" if len(ran) < len(result.rows) else "")
        )
    return "\n".join(lines)
