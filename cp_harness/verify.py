"""The main job: verify an implementation on a warm pool and print a report.

For every documented function and both miniature models, Hypothesis draws
cases (``--examples`` per row, seeded by ``--seed``), the pool runs them and
the oracle judges them. A failing row is shrunk by Hypothesis to a small
case, its error maps are written and its reproduction command printed. The
table lists, per row: examples run, passed, the largest error in ULPs, and
the bytes moved over the wire compared with the analytic minimum.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st

from cp_harness import comm_minimum, strategies
from cp_harness.cases import canonical
from cp_harness.errormap import write_error_maps
from cp_harness.pool import PoolConfig
from cp_harness.runner import CaseRunner, repro_command


@dataclasses.dataclass
class Row:
    """One line of the report."""

    name: str
    strategy: Callable[[tuple[int, ...]], st.SearchStrategy[dict]]
    weight: float = 1.0
    examples: int = 0
    passed: int = 0
    failed: int = 0
    max_ulp: float = 0.0
    moved_bytes: int = 0
    minimum_bytes: int = 0
    failure: str | None = None
    failing_case: dict | None = None
    error_maps: list[str] = dataclasses.field(default_factory=list)

    @property
    def comm_ratio(self) -> float | None:
        return self.moved_bytes / self.minimum_bytes if self.minimum_bytes else None

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "strategy"}
        data["comm_ratio"] = self.comm_ratio
        return data


def _filtered(check: str):
    def make(sizes):
        return strategies.gather_cases(sizes).filter(lambda c: c["check"] == check)
    return make


def default_rows() -> list[Row]:
    return [
        Row("inkling2.gather_sequence", _filtered("gather_sequence")),
        Row("inkling2.convolution_history", lambda s: strategies.history_cases(s)),
        Row("inkling2.prepare_cp_inputs + unpack_row_layout",
            lambda s: strategies.layout_cases(s).filter(lambda c: c["model"] == "inkling2")),
        Row("mistral_large4.gather_tokens", _filtered("gather_tokens")),
        Row("mistral_large4.prepare_cp_inputs (BSHD/THD)",
            lambda s: strategies.layout_cases(s).filter(lambda c: c["model"] == "mistral_large4")),
        Row("mistral_large4.shifted_cp_loss", lambda s: strategies.loss_cases(s)),
        Row("sharder.shard_token_tensor + gather_token_tensor", lambda s: strategies.sharder_cases(s)),
        Row("model: Inkling2-mini (float64)",
            lambda s: strategies.model_cases(s, dtypes=("float64",)).filter(lambda c: c["model"] == "inkling2")),
        Row("model: MistralLarge4-mini (float64)",
            lambda s: strategies.model_cases(s, dtypes=("float64",)).filter(lambda c: c["model"] == "mistral_large4")),
    ]


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, 0, stream
        self.tty = stream.isatty()
        self.started = time.perf_counter()
        self._last_plain = -1

    def step(self, label: str) -> None:
        self.done += 1
        frac = min(self.done / max(self.total, 1), 1.0)
        elapsed = time.perf_counter() - self.started
        if self.tty:
            bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label[:40]:<40}")
            self.stream.flush()
        elif int(frac * 10) != self._last_plain:
            self._last_plain = int(frac * 10)
            self.stream.write(f"progress: {self.done}/{self.total} cases, {elapsed:.1f}s ({label})\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _run_row(row: Row, runner: CaseRunner, sizes, examples: int, seed: int, progress: Progress) -> None:
    last_failure: dict[str, Any] = {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink], report_multiple_bugs=False)
    @hypothesis_seed(seed)
    @given(case=row.strategy(sizes))
    def property_(case):
        report = runner.run(case)
        row.examples += 1
        progress.step(row.name)
        moved, minimum = comm_minimum.moved_and_minimum(case, report)
        row.moved_bytes += moved
        row.minimum_bytes += minimum
        if report.ok:
            row.passed += 1
            row.max_ulp = max(row.max_ulp, report.max_ulp)
            return
        row.failed += 1
        last_failure["case"], last_failure["report"] = case, report
        raise AssertionError(report.format())

    try:
        property_()
    except AssertionError:
        # Hypothesis re-ran the shrunk example last: that is the one to report.
        case, report = last_failure["case"], last_failure["report"]
        row.failing_case = case
        row.failure = report.format()
        row.error_maps = write_error_maps(report)


def format_table(rows: list[Row]) -> str:
    header = f"{'function / model':<48} {'examples':>8} {'passed':>7} {'max ULP':>9} {'comm moved/min':>15}"
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = row.comm_ratio
        ratio_text = "-" if ratio is None else f"{ratio:.2f}"
        lines.append(f"{row.name:<48} {row.examples:>8} {row.passed:>7} {row.max_ulp:>9.3g} {ratio_text:>15}"
                     + ("   FAILED" if row.failed else ""))
    return "\n".join(lines)


def run_verify(*, impl: str, world_sizes: tuple[int, ...], examples: int, backend: str, seed: int,
               json_path: str | None, rows: list[Row] | None = None, stream=sys.stdout) -> int:
    """Run the verification; print the table (and failures); return the exit code (0 = all passed)."""
    rows = rows or default_rows()
    runner = CaseRunner(PoolConfig(world_size=max(world_sizes), backend=backend, impl=impl))
    progress = Progress(total=examples * len(rows))
    started = time.perf_counter()
    try:
        for row in rows:
            _run_row(row, runner, world_sizes, examples, seed, progress)
    finally:
        progress.finish()
        runner.close()
    seconds = time.perf_counter() - started
    print(f"cp_harness verify: implementation {impl!r}, backend {backend}, world sizes {list(world_sizes)}, seed {seed}",
          file=stream)
    print(format_table(rows), file=stream)
    total = sum(r.examples for r in rows)
    failed = [r for r in rows if r.failed]
    print(f"{total} examples in {seconds:.1f} s; examples per world size: "
          + ", ".join(f"N={n}: {runner.counts[n]}" for n in sorted(runner.counts)), file=stream)
    for row in failed:
        print(f"\nFAILED {row.name}\n  case: {canonical(row.failing_case)}\n"
              f"  reproduce: {repro_command(row.failing_case, impl, backend)}\n{row.failure}", file=stream)
        for path in row.error_maps:
            print(f"  error map: {path}", file=stream)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"impl": impl, "backend": backend, "world_sizes": list(world_sizes), "seed": seed,
                       "examples": total, "seconds": seconds, "ok": not failed,
                       "examples_per_world_size": {str(k): v for k, v in sorted(runner.counts.items())},
                       "rows": [r.as_dict() for r in rows]}, f, indent=2)
        print(f"JSON report written to {json_path}", file=stream)
    return 1 if failed else 0
