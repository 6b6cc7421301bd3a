"""Running cases on the pool and judging them.

``CaseRunner`` owns one ``RankPool`` (started lazily, restarted after a rank
failure), runs a case, evaluates it and keeps what ran (``RunCounts``). On a
failing case ``check`` raises with the text of ``cp_harness.judging.render``:
the case, a one-line command that reproduces it, and the per-tensor account
of what differs and where.

A failing case can be written as a standalone script (``export_repro``, ``cp_harness.repro``): torch, numpy and
the code under test only; a failure seen through a whole model is narrowed first to the documented call that is
wrong on its own (its inputs and upstream gradient recorded on the ranks) or to a failing case of another check.

An arithmetic case of ``N > 1`` ranks is also judged against the same
implementation on one rank (``cp_harness.judging.excess``): that baseline runs on
rank 0 of the same warm pool, is evaluated against the same oracle, and is
cached per description (the case without its CP size), so a case shrunk or
drawn again costs one run.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cp_harness import checks, repro
from cp_harness.cases import meshes
from cp_harness.cases.descriptions import canonical, payload_dtype
from cp_harness.cases.implementation import case_impl, primary_impl
from cp_harness.judging import excess
from cp_harness.judging.policy import STRICT, JudgingPolicy
from cp_harness.judging.render import failure_message
from cp_harness.judging.verdicts import CaseReport, ProblemKind, merge_groups
from cp_harness.ranks.pool import PoolConfig, RankFailure, RankPool, Ticket
from cp_harness.repro import calls as repro_calls


def _baseline_of(case: dict) -> dict | None:
    return checks.check_of(case).baseline_case(case)


def per_group(outputs: list, layout: meshes.MeshLayout | None) -> list[list]:
    """The outputs of each CP group that ran a case, each in CP rank order with ``rank`` its CP rank (what a
    check's ``evaluate`` reads); today's case: the one group of all outputs, as they are."""
    if layout is None:
        return [outputs]
    by_group: dict[int, list] = {}
    for o in outputs:
        by_group.setdefault(o.group, []).append(dataclasses.replace(o, rank=o.cp_rank))
    return [sorted(by_group.get(g, []), key=lambda o: o.rank) for g in layout.running()]


@dataclasses.dataclass(eq=False)
class _Job:
    """A case on its way through the runner: sent (``ticket``), its oracle (``expected``), or why it was not sent."""

    case: dict
    ticket: Ticket | None = None
    error: BaseException | None = None
    expected: Any = checks.NOT_GIVEN
    expect_error: BaseException | None = None
    expected_done: bool = False
    oracle_seconds: float = 0.0


@dataclasses.dataclass
class RunCounts:
    """What a runner ran: cases per CP size, check, implementation and payload dtype, the one-rank baselines
    the excess judge used, the cases that failed, and the seconds spent sending to and waiting for the ranks."""

    by_size: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_check: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_impl: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_dtype: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    baseline_runs: int = 0
    failures: int = 0
    seconds: float = 0.0
    not_judged: dict = dataclasses.field(default_factory=dict)  # "<subject>: <what>" -> why it was not judged

    standins: dict = dataclasses.field(default_factory=dict)  # "<subject>: <stand-in>" -> its report line

    def add_not_judged(self, report: CaseReport) -> None:
        """What the case could not judge, and the kernel stand-ins it ran on (both named in the summary)."""
        subject = report.case.get("spec") or report.case["check"]
        for what, why in report.not_judged.items():
            self.not_judged[f"{subject}: {what}"] = why
        for name, text in report.standins.items():
            self.standins[f"{subject}: {name}"] = text

    def add(self, case: dict, selection: str) -> None:
        self.by_size[int(case["world_size"])] += 1
        self.by_check[case["check"]] += 1
        self.by_impl[case_impl(case, selection)] += 1
        self.by_dtype[payload_dtype(case)] += 1


@dataclasses.dataclass
class Exported:
    """What ``CaseRunner.export_repro`` did: ``path`` of the script written (``None``: none, ``why`` says why),
    the ``case`` it reproduces (the narrowed one, when narrowed) and ``note``: how it was reached."""

    path: str | None
    why: str = ""
    case: dict | None = None
    note: str = ""

    def line(self) -> str:
        """One line for a report: the script, or why there is none."""
        return f"standalone repro: {self.path}" if self.path else f"standalone repro: none ({self.why})"


class BaselineCache:
    """One-rank baselines: judged reports by canonical case (``reports``), and runs queued on the pool that no
    judge has asked for yet (``queued``). Both are bounded: the oldest entry goes first."""

    def __init__(self, reports: int = 1024, queued: int = 64):
        self.limits = (reports, queued)
        self.reports: dict[str, CaseReport] = {}
        self.queued: dict[str, _Job] = {}

    def knows(self, key: str) -> bool:
        return key in self.reports or key in self.queued

    def queue(self, key: str, job: _Job) -> None:
        while len(self.queued) >= self.limits[1]:
            self.queued.pop(next(iter(self.queued)))
        self.queued[key] = job

    def keep(self, key: str, report: CaseReport) -> None:
        if len(self.reports) >= self.limits[0]:
            self.reports.pop(next(iter(self.reports)))
        self.reports[key] = report


def admit_all(case: dict) -> None:
    """The default admission: every case is sent."""


class CaseRunner:
    """Runs cases on a warm pool and remembers what ran (``tally``: cases per CP size, check, dtype, ...)."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        pool: RankPool | None = None,
        policy: JudgingPolicy = STRICT,
        admit: Callable[[dict], None] = admit_all,
        error_dir: str | None = None,
        repro_dir: str | None = None,
    ):
        """``pool``: run on another runner's warm pool (its ranks, this runner's own counters); ``close``
        then leaves that pool running for its owner. ``policy``: how arithmetic is judged. ``admit(case)``
        raises to refuse a case before it is sent (the pytest plugin skips cases larger than its pool).
        ``error_dir``: where ``check`` writes the error maps of failing cases (default: a temporary folder);
        ``repro_dir``: where it writes their standalone repros (``export_repro``; default: none)."""
        self.policy = policy
        self.error_dir = error_dir
        self.repro_dir = repro_dir
        self.admit = admit
        self.config = pool.config if pool is not None else config
        self.pool = pool if pool is not None else RankPool(config)
        self._owns_pool = pool is None
        self.tally = RunCounts()
        self.baselines = BaselineCache()
        self.error_maps: list[str] = []  # error-map PNGs that ``check`` wrote for failing cases

    @property
    def impl(self) -> str:
        """The primary implementation (the one cases without an ``"impl"`` key run)."""
        return primary_impl(self.config.impl)

    def run_outputs(self, case: dict, *, timeout: float | None = None):
        """The raw per-rank outputs (``RankFailure`` on a rank fault)."""
        job = self._submit(case, timeout=timeout, excess=False)
        if job.error is not None:
            raise job.error
        return self._collect(job)

    def run_outputs_many(
        self, cases: Iterable[dict], *, timeout: float | None = None, ahead: int = 2
    ) -> Iterator[list]:
        """``run_outputs`` of each case, in order, with up to ``ahead`` later cases queued on the ranks
        while the caller works on one; a ``RankFailure`` is raised at its own case's turn."""
        jobs = self._pipeline(cases, timeout=timeout, excess=False, count=True, ahead=ahead)
        for job in jobs:
            if job.error is not None:
                raise job.error
            yield self._collect(job)

    def _submit(self, case: dict, *, timeout: float | None, excess: bool, count: bool = True) -> _Job:
        """Send ``case`` to the pool (and, for the excess judge, its one-rank baseline when not cached)."""
        job = _Job(case)
        try:
            self.admit(case)
        except BaseException as exc:  # noqa: BLE001 - a skip is raised at the case's turn
            job.error = exc
            return job
        self._send(job, timeout=timeout)
        if count:
            self.tally.add(case, self.config.impl)
        if excess and job.error is None:
            self._prefetch_baseline(case, timeout=timeout)
        return job

    def _send(self, job: _Job, *, timeout: float | None) -> _Job:
        """Put ``job`` on the pool; an error is kept and raised at the job's turn."""
        started = time.perf_counter()
        try:
            job.ticket = self.pool.submit(job.case, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - raised at the case's turn
            job.error = exc
        finally:
            self.tally.seconds += time.perf_counter() - started
        return job

    def _prefetch_baseline(self, case: dict, *, timeout: float | None) -> None:
        """Queue the one-rank baseline right behind ``case`` so that it is ready when the excess judge asks.

        It is counted in ``baseline_runs`` when it is used (``baseline``), as a sequential run would count it:
        a case whose report fails before the excess judge never asks for it.
        """
        base = _baseline_of(case)
        if base is None:
            return
        key = canonical(base)
        if not self.baselines.knows(key):
            self.baselines.queue(key, self._send(_Job(base), timeout=timeout))

    def _expect(self, job: _Job) -> None:
        """The oracle half of ``job`` (``checks.expect``), once; an error is raised where evaluate would raise it."""
        if job.expected_done:
            return
        started = time.perf_counter()
        try:
            job.expected = checks.expect(job.case)
        except Exception as exc:  # noqa: BLE001 - raised after the ranks' outputs are collected
            job.expect_error = exc
        job.oracle_seconds = time.perf_counter() - started
        job.expected_done = True

    def _collect(self, job: _Job):
        assert job.ticket is not None  # a job that was not sent has its error, raised before collecting
        started = time.perf_counter()
        try:
            return self.pool.collect(job.ticket)
        finally:
            self.tally.seconds += time.perf_counter() - started

    def baseline(self, case: dict, *, timeout: float | None = None) -> CaseReport:
        """The one-rank run ``case`` is judged against, evaluated (cached per description)."""
        key = canonical(case)
        if key not in self.baselines.reports:
            job = self.baselines.queued.pop(key, None) or self._send(_Job(case), timeout=timeout)
            try:
                if job.error is not None:
                    raise job.error
                self._expect(job)
                outputs = self._collect(job)
            except RankFailure as exc:
                report = CaseReport(case=case)
                report.problem(
                    f"rank {exc.rank} {exc.kind}: {exc}", rank=exc.rank, kind=ProblemKind.of_rank_failure(exc.kind)
                )
            else:
                if job.expect_error is not None:
                    raise job.expect_error
                report = checks.evaluate(case, outputs, job.expected, policy=self.policy)
            finally:
                self.tally.baseline_runs += 1
            self.baselines.keep(key, report)
        return self.baselines.reports[key]

    def judge_excess(self, report: CaseReport, *, timeout: float | None = None) -> None:
        """Judge an arithmetic multi-rank report against its one-rank baseline (``cp_harness.judging.excess``)."""
        base_case = _baseline_of(report.case)
        if base_case is None or report.problems or not any(c.arithmetic for c in report.comparisons):
            return
        base = self.baseline(base_case, timeout=timeout)
        if base.problems:
            first = base.problems[0]
            report.problem(
                "the one-rank baseline of this case (same implementation, world_size 1) failed: "
                + first.message
                + (f"\n{first.detail}" if first.detail else ""),
                kind=ProblemKind.BASELINE_FAILED,
            )
            return
        excess.apply(report, base, self.policy.excess_rule(report.case.get("dtype", "float64")))

    def _judge(self, job: _Job, *, timeout: float | None, excess: bool = True) -> CaseReport:
        """Collect and evaluate a submitted case; its oracle (and its baseline's) runs first, while the ranks work."""
        if job.error is not None:
            raise job.error
        self._expect(job)
        base = self.baselines.queued.get(canonical(b)) if excess and (b := _baseline_of(job.case)) else None
        if base is not None and base.error is None:
            self._expect(base)
        try:
            outputs = self._collect(job)
        except RankFailure as exc:
            self.tally.failures += 1
            report = CaseReport(case=job.case)
            layout = meshes.MeshLayout.of(job.case)
            where = f" ({layout.describe(exc.rank)})" if layout is not None and exc.rank is not None else ""
            report.problem(
                f"rank {exc.rank}{where} {exc.kind}: {exc}", rank=exc.rank, kind=ProblemKind.of_rank_failure(exc.kind)
            )
            if layout is not None:
                self._compare_with_prefix_mesh(report, timeout=timeout)
            return report
        if job.expect_error is not None:
            raise job.expect_error
        started = time.perf_counter()
        layout = meshes.MeshLayout.of(job.case)
        groups = per_group(outputs, layout)
        reports = [checks.evaluate(job.case, group, job.expected, policy=self.policy) for group in groups]
        compared = time.perf_counter()
        for part in reports:
            self.tally.add_not_judged(part)
            if excess:
                self.judge_excess(part, timeout=timeout)
        report = (
            reports[0]
            if layout is None
            else merge_groups(job.case, [(layout.group_label(g), part) for g, part in zip(layout.running(), reports)])
        )
        if layout is not None and not report.ok:
            self._compare_with_prefix_mesh(report, timeout=timeout)
        if not report.ok:
            self.tally.failures += 1
        assert job.ticket is not None  # collected above
        report.timing = {
            **job.ticket.timing,
            "oracle": job.oracle_seconds,
            "compare": compared - started,
            "excess": time.perf_counter() - compared,
        }
        return report

    def _compare_with_prefix_mesh(self, report: CaseReport, *, timeout: float | None) -> None:
        """A case failed on a world mesh: run it again on today's mesh over ranks ``0..N-1``; when it passes there,
        say so (what differs is where the CP group is: a global rank taken for a CP rank, or another group)."""
        twin = meshes.without_layout(report.case)
        other = self._judge(self._submit(twin, timeout=timeout, excess=True, count=False), timeout=timeout)
        if other.ok:
            report.problem(
                f"the same case passes on a one-dimensional mesh over ranks 0..{int(twin['world_size']) - 1} "
                f"(where a CP rank is its global rank): the implementation mistakes a global rank for a CP "
                f"rank (dist.get_rank(), a peer addressed by CP rank) or communicates outside "
                f"mesh['cp']'s group; the problems above say where",
                kind=ProblemKind.MESH_FINDING,
            )

    def run(self, case: dict, *, timeout: float | None = None) -> CaseReport:
        """Run and evaluate ``case``; a rank fault becomes a failed report naming the rank.

        The case (and its one-rank baseline, when the excess judge will want it and it is not cached) is
        sent first; the oracle runs while the ranks work; then the outputs are collected and compared.
        """
        return self._judge(self._submit(case, timeout=timeout, excess=True), timeout=timeout)

    def run_many(
        self,
        cases: Iterable[dict],
        *,
        timeout: float | None = None,
        excess: bool = True,
        count: bool = True,
        ahead: int = 2,
    ) -> Iterator[CaseReport]:
        """``run`` of each case, in order, pipelined: while case ``k`` is judged, cases ``k+1..k+ahead`` are
        queued on the ranks, so the ranks never wait for the test process (nor it for them, when it is slower).

        Reports are those ``run`` gives one by one (same comparisons, verdicts, counters). A rank failure
        fails its own case only; the cases behind it are run again on the fresh pool. An error raised
        for a case (a skip, a bad description) is raised at that case's turn. ``excess``: judge arithmetic
        cases against their one-rank baseline (as ``run`` does); ``count``: add the cases to the counters.
        """
        for job in self._pipeline(cases, timeout=timeout, excess=excess, count=count, ahead=ahead):
            yield self._judge(job, timeout=timeout, excess=excess)

    def _pipeline(
        self, cases: Iterable[dict], *, timeout: float | None, excess: bool, count: bool, ahead: int
    ) -> Iterator[_Job]:
        """Submitted jobs in order, keeping ``ahead`` more submitted while the caller handles one."""
        if ahead < 0:
            raise ValueError(f"ahead={ahead}; at least 0")
        source = iter(cases)
        pending: collections.deque[_Job] = collections.deque()

        def top_up(limit: int) -> None:
            while len(pending) < limit:
                try:
                    case = next(source)
                except StopIteration:
                    return
                pending.append(self._submit(case, timeout=timeout, excess=excess, count=count))

        top_up(ahead + 1)
        while pending:
            job = pending.popleft()
            top_up(ahead)
            yield job

    def check(self, case: dict, *, timeout: float | None = None) -> CaseReport:
        """Run ``case`` and raise ``AssertionError`` with the full failure message unless it passes."""
        report = self.run(case, timeout=timeout)
        if not report.ok:
            from cp_harness.judging.error_maps import write_error_maps

            paths = write_error_maps(report, self.error_dir)
            self.error_maps.extend(paths)
            message = failure_message(case, report, self.config.impl, backend=self.config.backend)
            if paths:
                message += "\nerror maps: " + ", ".join(paths)
            if self.repro_dir is not None:
                exported = self.export_repro(case, report, self.repro_dir)
                message += "\n" + exported.line() + (f" ({exported.note})" if exported.note else "")
            raise AssertionError(message)
        return report

    def export_repro(
        self, case: dict, report: CaseReport, directory: str, *, note: str = "", name: str | None = None
    ) -> Exported:
        """Write the standalone repro of the failing ``case`` (judged as ``report``) into ``directory`` (as
        ``name``.py, default the case's id): the script's path, or why none was written (a check without one, a
        kind of case no script family covers)."""
        check = checks.check_of(case)
        request = repro.Request(case, case_impl(case, self.config.impl), self.policy, report, note)
        try:
            if check.repro is not None and check.repro.narrow is not None:
                return self._narrowed(case, check, directory, name)
            if check.repro is None or check.repro.plan is None:
                raise repro.NotExportable(f"the check {check.name!r} writes no standalone repro")
            return Exported(
                repro.write(repro.on_world_mesh(check.repro.plan(request), case), directory, name), case=case, note=note
            )
        except repro.NotExportable as why:
            return Exported(None, why=str(why), case=case)

    def _narrowed(self, case: dict, check: checks.Check, directory: str, name: str | None) -> Exported:
        """A model failure narrowed: the first documented call of the run that is wrong on its own, replayed on
        the ranks with what it received (judged by the check that replays that function), else the first failing
        case of ``check.repro.narrow``."""
        definitions = {
            f: judge
            for c in checks.load_checks().values()
            if c.repro is not None
            for f, judge in c.repro.replays.items()
        }
        impl = case_impl(case, self.config.impl)
        try:
            outputs = per_group(self.run_outputs({**case, "record_calls": True}), meshes.MeshLayout.of(case))[0]
        except RankFailure:  # the run raised before its calls could be replayed: narrow to the cases below
            outputs = []
        for call in repro.recorded_calls(outputs) if outputs else []:
            if call.function not in definitions:
                continue
            if repro_calls.replay_differs(definitions[call.function](call), call):
                expected = definitions[call.function](repro.portable(call))
                note = (
                    f"narrowed from that case to call {call.index + 1} of its run ({call.function}), with the "
                    "inputs and upstream gradient it received on the ranks"
                )
                request = repro.Request(case, impl, self.policy, note=note)
                plan = repro_calls.plan(
                    expected, request.subject(call.function), f"{request.name}-call{call.index + 1}", request.case_text
                )
                return Exported(repro.write(repro.on_world_mesh(plan, case), directory, name), case=case, note=note)
        assert check.repro is not None and check.repro.narrow is not None  # export_repro narrows only then
        for other in check.repro.narrow(case):
            report = self.run(other)
            if not report.ok:
                return self.export_repro(
                    other, report, directory, note=f"narrowed from the case {canonical(case)}", name=name
                )
        return Exported(
            None,
            case=case,
            why="no documented call of the model run is wrong on its own, and no case it "
            "was narrowed to fails: the model's failure has no standalone repro",
        )

    def sharing_pool(self) -> CaseRunner:
        """A runner with its own counters on this runner's pool (the harness's own tests judge deliberately
        broken modules on the session's ranks without counting them as examples of the gate)."""
        return CaseRunner(
            self.config,
            pool=self.pool,
            policy=self.policy,
            admit=self.admit,
            error_dir=self.error_dir,
            repro_dir=self.repro_dir,
        )

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()
            self.pool.cleanup_workdir()
