"""The main job: verify an implementation on a warm pool and print a report.

For every documented function (grouped as the API pages group them), the
sharder and both miniature models, Hypothesis draws cases (``--examples`` per
row, seeded by ``--seed``), the pool runs them and the oracle judges them. A
failing row is shrunk by Hypothesis to a small case, its error maps are
written and its reproduction command printed. The table lists, per row:
examples run, passed, the largest error in ULPs (``exact`` for data movement,
which must match bit for bit), the worst CP excess (CP error / error of the
same implementation on one rank, ``cp_harness.judging.excess``; ``-`` where nothing
is arithmetic or every case had one rank), and the bytes moved over the wire
compared with the analytic minimum (``cp_harness.judging.comm_minimum``; ``-`` where
there is no closed form, e.g. whole models; ``unaccounted`` where the meter saw
communication it could not attribute, so no ratio is given). ``--dtypes``
restricts the dtypes the cases draw (rows without any of them are left out),
``--rows`` the rows run. ``--json PATH`` writes the same report as JSON (see
``report_dict``). Exit status: 0 when every row passed, 1 on any failure, 2
when the run could not start (bad arguments, no GPUs, an implementation that
does not import).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, example, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st

from cp_harness import checks
from cp_harness.cases.descriptions import canonical, payload_dtype
from cp_harness.cases.strategies import FLOAT_DTYPES, VALUE_DTYPES, CaseSpace
from cp_harness.instruments import coverage
from cp_harness.judging import comm_minimum
from cp_harness.judging.render import condensed_text
from cp_harness.judging.error_maps import error_map_dir, write_error_maps
from cp_harness.judging.serialize import json_safe
from cp_harness.ranks.pool import PoolConfig, RankPool
from cp_harness.judging.policy import STRICT, JudgingPolicy
from cp_harness.judging.render import repro_command
from cp_harness.runner import CaseRunner


@dataclasses.dataclass
class Row:
    """One line of the report."""

    name: str
    strategy: Callable[[CaseSpace], st.SearchStrategy[dict]]
    functions: tuple[str, ...] = ()  # the documented functions this row claims to exercise (each must run)
    dtypes: tuple[str, ...] = ()  # payload dtypes its cases may draw (``()``: none, layouts and positions)
    explicit: tuple[dict, ...] = ()  # cases run before the generated ones (the claims' witnesses, regressions)
    called: set = dataclasses.field(default_factory=set)  # documented functions its cases called on the ranks
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
    failure: str | None = None
    failing_case: dict | None = None
    reproduce: str | None = None
    error_maps: list[str] = dataclasses.field(default_factory=list)
    failing_report: Any = dataclasses.field(default=None, repr=False)
    needs_model: bool = False  # a real-model row (``--model``)

    @property
    def comm_ratio(self) -> float | None:
        if self.unaccounted_ops:  # bytes of some traffic unknown: no ratio rather than a wrong one
            return None
        return self.moved_bytes / self.minimum_bytes if self.minimum_bytes else None

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.failure is None

    def ulp_text(self) -> str:
        if not self.arithmetic:
            return "exact" if self.ok else "NOT EXACT"
        return f"{self.max_ulp:.3g}"

    def excess_text(self) -> str:
        return "-" if self.max_excess is None else f"{self.max_excess:.3g}"

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("strategy", "failing_report", "explicit", "called", "needs_model")}
        data["functions"] = list(self.functions)
        data["called"] = sorted(self.called)
        data["claimed_but_never_called"] = coverage.covered(self.functions, self.called)
        report = self.failing_report
        data["failing_tensors"] = [c.as_dict() for c in report.failures()] if report is not None else []
        data["ok"] = self.ok
        data["comparison"] = "ulp" if self.arithmetic else "exact"
        data["comm_ratio"] = self.comm_ratio
        return data


def default_rows() -> list[Row]:
    """The report's rows, as the checks declare them (``Check.rows``), in their table order: every documented
    function (grouped as they are called), the sharder, both models (float64, and bfloat16 end to end:
    parameters, activations, gradients).

    Each row's ``functions`` are claims: ``verify`` fails a row whose cases never called one of them through
    the documented API (``cp_harness.instruments.coverage``).
    """
    declared = sorted((r for check in checks.load_checks().values() for r in check.rows), key=lambda r: r.position)
    return [Row(r.label, r.cases, r.functions, r.dtypes, r.explicit, needs_model=r.needs_model) for r in declared]


def select_rows(rows: list[Row], *, dtypes: tuple[str, ...] | None = None, names: tuple[str, ...] = ()) -> list[Row]:
    """Rows whose cases can draw one of ``dtypes`` (``None``: all; a row without a payload dtype counts as
    ``"layout"``) and whose name contains one of ``names`` (empty: all)."""
    out = []
    for row in rows:
        if dtypes is not None and not set(row.dtypes or ("layout",)) & set(dtypes):
            continue
        if names and not any(n in row.name for n in names):
            continue
        out.append(row)
    return out


class Progress:
    """A one-line progress bar on stderr (plain lines, every tenth of the way, when stderr is not a terminal)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self._last_plain = -1

    def note(self, text: str) -> None:
        """A message of its own line (the bar is redrawn by the next step)."""
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def step(self, label: str) -> None:
        self.done += 1
        frac = min(self.done / max(self.total, 1), 1.0)
        elapsed = time.perf_counter() - self.started
        if self.tty:
            bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label[:50]:<50}")
            self.stream.flush()
        elif int(frac * 10) != self._last_plain:
            self._last_plain = int(frac * 10)
            self.stream.write(f"progress: {self.done}/{self.total} cases, {elapsed:.1f}s ({label})\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _run_row(row: Row, runner: CaseRunner, space: CaseSpace, examples: int, seed: int, progress: Progress,
             backend: str, error_dir: str | None, shrink_seconds: float) -> None:
    failing: dict[str, Any] = {}  # canonical case -> its report, for every case seen failing
    last_failure: dict[str, Any] = {}
    shrink_started: list[float] = []
    in_flight: dict[str, Any] = {}  # the case being run, and whether it was counted yet (a crash names it)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink],
              report_multiple_bugs=False)
    @hypothesis_seed(seed)
    @given(case=row.strategy(space))
    def property_(case):
        in_flight.update(case=case, counted=False)
        key = canonical(case)
        report = failing.get(key)  # seen failing already (e.g. Hypothesis' final replay): not run again
        if report is None:
            if shrink_started and time.perf_counter() - shrink_started[0] > shrink_seconds:
                # Shrinking budget spent: the smallest failure found so far is reported (it really failed).
                return
            report = runner.run(case)
            row.called |= report.called
            row.examples += 1
            in_flight["counted"] = True
            dtype = payload_dtype(case)
            row.examples_by_dtype[dtype] = row.examples_by_dtype.get(dtype, 0) + 1
            progress.step(row.name if not shrink_started else f"{row.name}: shrinking a failure")
            moved, minimum = comm_minimum.moved_and_minimum(report, checks.check_of(case).least_communication(case))
            if moved is None:
                row.unaccounted_ops = sorted(set(row.unaccounted_ops) | set(comm_minimum.unaccounted_ops(report)))
            else:
                row.moved_bytes += moved
            row.minimum_bytes += minimum
            row.arithmetic = row.arithmetic or any(c.mode == "ulp" for c in report.comparisons)
            if report.max_ulp == report.max_ulp:  # not NaN
                row.max_ulp = max(row.max_ulp, report.max_ulp)
            excess = report.max_excess
            if excess is not None and excess == excess:
                row.max_excess = excess if row.max_excess is None else max(row.max_excess, excess)
            if report.ok:
                row.passed += 1
                return
            row.failed += 1
            row.failed_by_dtype[dtype] = row.failed_by_dtype.get(dtype, 0) + 1
            if not shrink_started:
                shrink_started.append(time.perf_counter())
                first = (report.problems[0].splitlines()[0] if report.problems
                         else report.failures()[0].summary() if report.failures() else "failed")
                progress.note(f"FAILED {row.name}: {first[:160]}\n  case: {key}\n"
                              f"  (shrinking it for up to {shrink_seconds:g} s; the smallest failure is printed at the end)")
            failing[key] = report
        last_failure["case"], last_failure["report"] = case, report
        raise AssertionError(report.format())  # one raise site: Hypothesis tells failures apart by where they rise

    for case in row.explicit:
        if int(case["world_size"]) <= max(space.world_sizes):
            property_ = example(case=case)(property_)
    try:
        property_()
        never = coverage.covered(row.functions, row.called)
        if never and row.failure is None and row.examples:
            row.failed = max(row.failed, 1)
            row.failure = (f"  PROBLEM: the row claims {', '.join(never)}, but none of its {row.examples} cases called "
                           f"{'it' if len(never) == 1 else 'them'} through the documented API (called: "
                           f"{', '.join(sorted(row.called)) or 'nothing'})")
    except AssertionError:
        if "report" not in last_failure:  # Hypothesis itself complained (e.g. a flaky failure)
            row.failed = max(row.failed, 1)
            row.failure = traceback.format_exc(limit=3)
            return
        # Hypothesis replays the smallest failing example last: that is the one to report.
        case, report = last_failure["case"], last_failure["report"]
        row.failing_case = case
        row.failing_report = report
        row.failure = report.format()
        row.reproduce = repro_command(case, runner.impl, backend)
        row.error_maps = write_error_maps(report, error_dir)
    except Exception:  # noqa: BLE001 - a harness or Hypothesis error fails this row, the others still run
        crashed = in_flight.get("case")
        if crashed is not None and not in_flight.get("counted"):
            row.examples += 1  # the crashed case counts as run and failed, never as passed
        row.failed = max(row.failed, 1)
        row.failure = ("  PROBLEM: the harness crashed on this case (no verdict on the implementation):\n"
                       + _traceback_head())
        case = crashed if crashed is not None else last_failure.get("case")
        if case is not None:
            row.failing_case = case
            row.reproduce = repro_command(case, runner.impl, backend)


def _traceback_head(frames: int = 4) -> str:
    """The exception and its innermost ``frames`` frames, indented (the whole one: run-case, or --json)."""
    return "".join("    " + line for line in traceback.format_exc(limit=-frames).splitlines(keepends=True))


# How long a failing row may shrink its failure. Rows whose ranks raise restart the pool on every failing
# run (seconds each at 8 ranks), rows that fail by value do not; one budget in seconds bounds both the same.
SHRINK_SECONDS = 20.0

TABLE_HEADER = ("function / model", "examples", "passed", "max ULP", "CP excess", "comm moved/min")


def format_table(rows: list[Row]) -> str:
    """The report table: one line per row, ``FAILED`` at the end of a failing one."""
    width = max([48] + [len(r.name) for r in rows])
    header = (f"{TABLE_HEADER[0]:<{width}} {TABLE_HEADER[1]:>8} {TABLE_HEADER[2]:>7} {TABLE_HEADER[3]:>9} "
              f"{TABLE_HEADER[4]:>9} {TABLE_HEADER[5]:>15}")
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = row.comm_ratio
        ratio_text = "unaccounted" if row.unaccounted_ops else "-" if ratio is None else f"{ratio:.2f}"
        lines.append(f"{row.name:<{width}} {row.examples:>8} {row.passed:>7} {row.ulp_text():>9} "
                     f"{row.excess_text():>9} {ratio_text:>15}" + ("   FAILED" if not row.ok else ""))
    return "\n".join(lines)


_DTYPE_ORDER = ("float64", "float32", "bfloat16", "float16", "int64", "int32", "bool", "layout")


def _by_dtype(counts: dict[str, int]) -> str:
    order = {d: i for i, d in enumerate(_DTYPE_ORDER)}
    return ", ".join(f"{d}: {counts[d]}" for d in sorted(counts, key=lambda d: (order.get(d, 99), d))) or "none"


def dtype_totals(rows: list[Row]) -> tuple[dict[str, int], dict[str, int]]:
    """``(examples, failed)`` per payload dtype over all rows."""
    examples: dict[str, int] = {}
    failed: dict[str, int] = {}
    for row in rows:
        for d, n in row.examples_by_dtype.items():
            examples[d] = examples.get(d, 0) + n
        for d, n in row.failed_by_dtype.items():
            failed[d] = failed.get(d, 0) + n
    return examples, failed


def report_dict(*, impl: str, backend: str, world_sizes, seed: int, examples: int, seconds: float, rows: list[Row],
                counts: dict[int, int], policy: str = "strict") -> dict[str, Any]:
    """The JSON report: the run's settings, the table (text and rows) and every failure with its reproduction."""
    import torch

    failed = [r for r in rows if not r.ok]
    return json_safe({
        "format": 1,
        "ok": not failed,
        "impl": impl, "backend": backend, "world_sizes": list(world_sizes), "seed": seed, "precision_policy": policy,
        "examples_per_row": examples,
        "examples": sum(r.examples for r in rows),
        "seconds": round(seconds, 3),
        "examples_per_world_size": {str(k): v for k, v in sorted(counts.items())},
        "examples_per_dtype": dtype_totals(rows)[0],
        "failed_per_dtype": dtype_totals(rows)[1],
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "columns": {"examples": "cases run (a failing row includes Hypothesis' shrinking runs)",
                    "passed": "cases that passed",
                    "max_ulp": "largest error of any arithmetic comparison, in ULPs of the compared dtype",
                    "max_excess": "largest CP excess: CP error / (error of the same implementation on one rank + "
                                  "floor / c); a tensor fails above c (cp_harness.judging.excess); null: not judged",
                    "examples_by_dtype": "cases run per payload dtype (layout: no floating payload)",
                    "comparison": "exact (data movement, bit for bit) or ulp (arithmetic within cp_harness.judging.budgets)",
                    "comm_ratio": "payload bytes sent / analytic minimum (cp_harness.judging.comm_minimum); null: no closed "
                                  "form, or unaccounted_ops is not empty",
                    "unaccounted_ops": "communication ops the meter could not attribute (no byte rule, or a group "
                                       "it could not size); the table then says 'unaccounted' instead of a ratio"},
        "table": format_table(rows),
        "failed_rows": [r.name for r in failed],
        "rows": [r.as_dict() for r in rows],
    })


def _naming_impl(row: Row, impl: str) -> Row:
    """``row`` whose cases name ``impl`` (its primary module unless a case drew another): on a shared pool the
    ranks' default implementation is the pool's, not this run's."""
    from cp_harness.cases.implementation import primary_impl

    primary = primary_impl(impl)

    def name(case: dict) -> dict:
        return case if "impl" in case else {**case, "impl": primary}

    return dataclasses.replace(row, strategy=lambda space: row.strategy(space).map(name),
                               explicit=tuple(name(c) for c in row.explicit))


def _preflight(impl: str, backend: str, world_size: int) -> str | None:
    """Why the run cannot start (``None`` when it can): the implementation must import, the devices must fit."""
    from cp_harness.ranks.devices import DeviceError, check_backend
    from cp_harness.cases.implementation import impl_names, load_impl

    try:
        check_backend(backend, world_size)
        names = impl_names(impl)
    except (DeviceError, ValueError) as exc:
        return str(exc)
    for name in names:
        try:
            load_impl(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported as such
            return (f"implementation {name!r} does not import here: {type(exc).__name__}: {exc}\n"
                    f"(is it installed, or on PYTHONPATH? sys.path[0] is {sys.path[0]!r})")
    return None


def _preflight_models(models: tuple[str, ...]) -> str | None:
    """Why the model specs cannot be used (``None`` when they can): each imports and has every required field."""
    from cp_harness.usage.model_specs import load_spec

    for name in models:
        try:
            load_spec(name)
        except Exception as exc:  # noqa: BLE001 - a missing field, or an import failure, stops the run
            return f"{type(exc).__name__}: {exc}"
    return None


def run_verify(*, impl: str, world_sizes: tuple[int, ...], examples: int, backend: str, seed: int,
               json_path: str | None, rows: list[Row] | None = None, stream=None, error_dir: str | None = None,
               progress_stream=None, shrink_seconds: float = SHRINK_SECONDS, dtypes: tuple[str, ...] | None = None,
               row_names: tuple[str, ...] = (), pool: RankPool | None = None, launcher: str | None = None,
               model: str | None = None, policy: JudgingPolicy = STRICT) -> int:
    """Run the verification; print the table (and failures); return the exit code (0 = all passed, 1 = a failure, 2 = could not run).

    ``pool``: run on this warm pool (its ranks load ``impl`` on first use; it needs ``max(world_sizes)``
    ranks and stays up afterwards) instead of starting one. ``model``: model spec module(s), comma-separated:
    run the real-model rows (``cp_harness.checks.real_model``) instead of the implementation's rows.
    """
    stream = stream if stream is not None else sys.stdout
    models = tuple(m for m in (model or "").split(",") if m)
    rows = [r for r in (rows or default_rows()) if r.needs_model == bool(models)]
    rows = select_rows(rows, dtypes=dtypes, names=row_names)
    if not rows:
        print(f"cp_harness verify: cannot run: no row matches --dtypes {dtypes} / --rows {list(row_names)}",
              file=sys.stderr)
        return 2
    ranks = max(world_sizes)
    if pool is not None and pool.config.world_size < ranks:
        print(f"cp_harness verify: cannot run: the given pool has {pool.config.world_size} ranks, "
              f"world sizes {list(world_sizes)} need {ranks}", file=sys.stderr)
        return 2
    problem = _preflight(impl, backend, ranks) or _preflight_models(models)
    if problem:
        print(f"cp_harness verify: cannot run: {problem}", file=sys.stderr)
        return 2
    from cp_harness.cases.implementation import impl_names

    drawn = (tuple(d for d in dtypes if d != "layout") or FLOAT_DTYPES) if dtypes is not None else FLOAT_DTYPES + VALUE_DTYPES
    space = CaseSpace(world_sizes=tuple(world_sizes), dtypes=drawn, impls=impl_names(impl), models=models)
    if models:  # the launcher imports the specs (and transformers) once, before it forks the ranks
        from cp_harness.usage.model_specs import PRELOAD_ENV

        os.environ[PRELOAD_ENV] = ",".join(models)
    if pool is None:
        runner = CaseRunner(PoolConfig(world_size=ranks, backend=backend, impl=impl, launcher=launcher), policy=policy)
    else:  # the pool's own selection stays; every case names its implementation
        runner = CaseRunner(pool.config, pool=pool, policy=policy)
        rows = [_naming_impl(row, impl) for row in rows]
    progress = Progress(total=examples * len(rows), stream=progress_stream)
    started = time.perf_counter()
    try:
        progress.note(f"cp_harness verify: starting {ranks} ranks ({backend}) for implementation {impl!r} ...")
        try:
            runner.pool.start()
        except Exception as exc:  # noqa: BLE001
            progress.note(f"cp_harness verify: cannot run: the rank pool did not start: {exc}")
            return 2
        progress.note(f"cp_harness verify: pool up in {time.perf_counter() - started:.1f} s; "
                      f"{examples} examples per row, {len(rows)} rows")
        for row in rows:
            _run_row(row, runner, space, examples, seed, progress, backend, error_dir, shrink_seconds)
    finally:
        progress.finish()
        runner.close()
    seconds = time.perf_counter() - started
    subject = f"model spec(s) {', '.join(models)}" if models else f"implementation {impl!r}"
    print(f"cp_harness verify: {subject}, backend {backend}, world sizes {list(world_sizes)}, "
          f"seed {seed}, {examples} examples per row, precision policy {policy.name}", file=stream)
    print(format_table(rows), file=stream)
    total = sum(r.examples for r in rows)
    failed = [r for r in rows if not r.ok]
    print(f"{total} examples in {seconds:.1f} s; examples per world size: "
          + ", ".join(f"N={n}: {runner.tally.by_size[n]}" for n in sorted(runner.tally.by_size)), file=stream)
    per_dtype, failed_dtype = dtype_totals(rows)
    print(f"examples per dtype: {_by_dtype(per_dtype)}; failed per dtype: {_by_dtype(failed_dtype)}; "
          f"one-rank baseline runs: {runner.tally.baseline_runs}", file=stream)
    for row in failed:
        print(f"\nFAILED {row.name}", file=stream)
        if row.failing_case is not None:
            print(f"  case: {canonical(row.failing_case)}\n  reproduce: {row.reproduce}", file=stream)
        print(condensed_text(row.failing_report) if row.failing_report is not None else row.failure, file=stream)
        for path in row.error_maps:
            print(f"  error map: {path}", file=stream)
    unattributed = [f"{r.name} ({', '.join(r.unaccounted_ops)})" for r in rows if r.unaccounted_ops]
    if unattributed:
        print(f"communication the meter could not attribute in: {'; '.join(unattributed)} (no ratio given)",
              file=stream)
    below = [r.name for r in rows if r.comm_ratio is not None and r.comm_ratio < 1.0]
    if below:
        print(f"communication below the minimum in: {', '.join(below)} (data the contract needs never moved)",
              file=stream)
    if failed:
        print(f"\n{len(failed)} of {len(rows)} rows FAILED: {', '.join(r.name for r in failed)}", file=stream)
    else:
        print(f"all {len(rows)} rows passed", file=stream)
    if json_path:
        directory = os.path.dirname(os.path.abspath(json_path))
        os.makedirs(directory, exist_ok=True)
        data = report_dict(impl=impl, backend=backend, world_sizes=world_sizes, seed=seed, examples=examples,
                           seconds=seconds, rows=rows, counts=dict(runner.tally.by_size), policy=policy.name)
        data["error_map_dir"] = os.path.abspath(error_map_dir(error_dir))
        with open(json_path, "w") as f:
            json.dump(data, f, indent=2, allow_nan=False)
            f.write("\n")
        print(f"JSON report written to {json_path}", file=stream)
    return 1 if failed else 0
