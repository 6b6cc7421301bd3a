"""Running cases on the pool and turning verdicts into readable failures.

``CaseRunner`` owns one ``RankPool`` (started lazily, restarted after a rank
failure), runs a case, evaluates it and keeps per-world-size counts. On a
failing case ``failure_message`` gives the case, a one-line command that
reproduces it, and the per-tensor account of what differs and where.

An arithmetic case of ``N > 1`` ranks is also judged against the same
implementation on one rank (``cp_harness.excess``): that baseline runs on
rank 0 of the same warm pool, is evaluated against the same oracle, and is
cached per description (the case without its CP size), so a case shrunk or
drawn again costs one run.
"""

from __future__ import annotations

import collections
import shlex
import time

from cp_harness import checks, excess
from cp_harness.cases import canonical, case_id, payload_dtype
from cp_harness.checks import CaseReport
from cp_harness.impl import case_impl, primary_impl
from cp_harness.pool import PoolConfig, RankFailure, RankPool


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
    from cp_harness.errormap import write_error_maps

    lines = [failure_message(report.case, report, impl, backend=backend)]
    lines += [f"error map: {path}" for path in write_error_maps(report, error_dir)]
    return "\n".join(lines)


class CaseRunner:
    """Runs cases on a warm pool and remembers what ran (``counts``: examples per world size)."""

    def __init__(self, config: PoolConfig, *, pool: RankPool | None = None):
        """``pool``: run on another runner's warm pool (its ranks, this runner's own counters); ``close``
        then leaves that pool running for its owner."""
        self.config = pool.config if pool is not None else config
        self.pool = pool if pool is not None else RankPool(config)
        self._owns_pool = pool is None
        self.counts: collections.Counter[int] = collections.Counter()
        self.by_check: collections.Counter[str] = collections.Counter()
        self.by_impl: collections.Counter[str] = collections.Counter()
        self.by_dtype: collections.Counter[str] = collections.Counter()
        self.baseline_runs = 0
        self._baselines: dict[str, CaseReport] = {}
        self.failures = 0
        self.seconds = 0.0
        self.error_maps: list[str] = []

    @property
    def impl(self) -> str:
        """The primary implementation (the one cases without an ``"impl"`` key run)."""
        return primary_impl(self.config.impl)

    def run_outputs(self, case: dict, *, timeout: float | None = None):
        """The raw per-rank outputs (``RankFailure`` on a rank fault)."""
        started = time.perf_counter()
        try:
            return self.pool.run(case, timeout=timeout)
        finally:
            self.seconds += time.perf_counter() - started
            self.counts[int(case["world_size"])] += 1
            self.by_check[case["check"]] += 1
            self.by_impl[case_impl(case, self.config.impl)] += 1
            self.by_dtype[payload_dtype(case)] += 1

    BASELINE_CACHE = 1024

    def baseline(self, case: dict, *, timeout: float | None = None) -> CaseReport:
        """The one-rank run ``case`` is judged against, evaluated (cached per description)."""
        key = canonical(case)
        if key not in self._baselines:
            started = time.perf_counter()
            try:
                outputs = self.pool.run(case, timeout=timeout)
            except RankFailure as exc:
                report = CaseReport(case=case)
                report.problems.append(f"rank {exc.rank} {exc.kind}: {exc}")
            else:
                report = checks.evaluate(case, outputs)
            finally:
                self.seconds += time.perf_counter() - started
                self.baseline_runs += 1
            if len(self._baselines) >= self.BASELINE_CACHE:
                self._baselines.pop(next(iter(self._baselines)))
            self._baselines[key] = report
        return self._baselines[key]

    def judge_excess(self, report: CaseReport, *, timeout: float | None = None) -> None:
        """Judge an arithmetic multi-rank report against its one-rank baseline (``cp_harness.excess``)."""
        base_case = excess.baseline_case(report.case)
        if base_case is None or report.problems or not any(c.mode == "ulp" for c in report.comparisons):
            return
        base = self.baseline(base_case, timeout=timeout)
        if base.problems:
            report.problems.append("the one-rank baseline of this case (same implementation, world_size 1) failed: "
                                   + base.problems[0])
            return
        excess.apply(report, base)

    def run(self, case: dict, *, timeout: float | None = None) -> CaseReport:
        """Run and evaluate ``case``; a rank fault becomes a failed report naming the rank."""
        try:
            outputs = self.run_outputs(case, timeout=timeout)
        except RankFailure as exc:
            self.failures += 1
            report = CaseReport(case=case)
            report.problems.append(f"rank {exc.rank} {exc.kind}: {exc}")
            return report
        report = checks.evaluate(case, outputs)
        self.judge_excess(report, timeout=timeout)
        if not report.ok:
            self.failures += 1
        return report

    def check(self, case: dict, *, timeout: float | None = None) -> CaseReport:
        """Run ``case`` and raise ``AssertionError`` with the full failure message unless it passes."""
        report = self.run(case, timeout=timeout)
        if not report.ok:
            from cp_harness.errormap import write_error_maps

            paths = write_error_maps(report)
            self.error_maps.extend(paths)
            message = failure_message(case, report, self.config.impl, backend=self.config.backend)
            if paths:
                message += "\nerror maps: " + ", ".join(paths)
            raise AssertionError(message)
        return report

    def sharing_pool(self) -> "CaseRunner":
        """A runner with its own counters on this runner's pool (the harness's own tests judge deliberately
        broken modules on the session's ranks without counting them as examples of the gate)."""
        return CaseRunner(self.config, pool=self.pool)

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()
            self.pool.cleanup_workdir()
