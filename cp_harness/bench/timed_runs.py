"""Running cases for the clock: sequential, pipelined and fresh-torchrun modes, and their per-case summary.

Every timed case is judged; a failing case raises :class:`BenchCaseFailed`,
because the numbers of a wrong implementation mean nothing. Per case the time
is split into ``ranks`` (the slowest rank's time on the case), ``transport``
(the request's and the reply's way, ``TicketQueue._timing``), ``oracle``
(``checks.expect``) and ``compare`` (``checks.evaluate`` given the oracle's result).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

PARTS = ("ranks", "transport", "oracle", "compare")


class BenchCaseFailed(AssertionError):
    """A benchmark case failed its check: the numbers of a wrong implementation mean nothing."""


def judge_case(pool, case: dict, *, timeout: float | None = None):
    """Run and evaluate one case on ``pool`` (the runner's counters are left alone); a failure raises."""
    from cp_harness import checks
    from cp_harness.judging.render import failure_message

    report = checks.evaluate(case, pool.run(case, timeout=timeout))
    if not report.ok:
        raise BenchCaseFailed(failure_message(case, report, pool.config.impl, backend=pool.config.backend))
    return report


def run_sequential(pool, cases: list[dict]) -> list[dict]:
    """Sequential mode: run each case, then judge it (oracle, then comparison); the ranks idle while it is judged.

    One timing record per case (the parts in the module docstring, plus ``wall`` and ``run``).
    """
    from cp_harness import checks
    from cp_harness.judging.render import failure_message

    records = []
    for case in cases:
        started = time.perf_counter()
        ticket = pool.submit(case)
        outputs = pool.collect(ticket)
        ran = time.perf_counter()
        expected = checks.expect(case)
        expected_at = time.perf_counter()
        report = checks.evaluate(case, outputs, expected)
        judged = time.perf_counter()
        if not report.ok:
            raise BenchCaseFailed(failure_message(case, report, pool.config.impl, backend=pool.config.backend))
        records.append(
            {
                "wall": judged - started,
                "run": ran - started,
                "ranks": ticket.timing["ranks"],
                "collective_calls": max(len(o.comm) for o in outputs),
                "transport": ticket.timing["transport"],
                "oracle": expected_at - ran,
                "compare": judged - expected_at,
            }
        )
    return records


def run_pipelined(runner, cases: Iterable[dict]) -> tuple[list[dict], float]:
    """Pipelined mode: ``CaseRunner.run_many`` (the oracle while the ranks run, the next cases queued on the
    ranks while one is judged). Same work per case as :func:`run_sequential` (no excess judge, not counted).

    Returns one timing record per case and the wall time of the whole batch (per-case walls overlap).
    """
    from cp_harness.judging.render import failure_message

    records = []
    started = time.perf_counter()
    for report in runner.run_many(cases, excess=False, count=False):
        if not report.ok:
            raise BenchCaseFailed(
                failure_message(report.case, report, runner.config.impl, backend=runner.config.backend)
            )
        t = report.timing
        records.append(
            {
                "ranks": t["ranks"],
                "transport": t["transport"],
                "oracle": t["oracle"],
                "compare": t["compare"],
                "collective_calls": max(len(c["calls"]) for c in report.comm),
            }
        )
    return records, time.perf_counter() - started


def run_fresh(case: dict, impl: str, backend: str) -> dict:
    """The naive way: a new ``torchrun`` for this one case, then judge it and shut it down."""
    from cp_harness import checks
    from cp_harness.judging.render import failure_message
    from cp_harness.ranks.pool import PoolConfig, RankPool

    started = time.perf_counter()
    pool = RankPool(PoolConfig(world_size=int(case["world_size"]), backend=backend, impl=impl, launcher="torchrun"))
    try:
        pool.start()
        up = time.perf_counter()
        outputs = pool.run(case)
        ran = time.perf_counter()
        report = checks.evaluate(case, outputs)
        judged = time.perf_counter()
    finally:
        pool.close()
        pool.cleanup_workdir()
    closed = time.perf_counter()
    if not report.ok:
        raise BenchCaseFailed(failure_message(case, report, impl, backend=backend))
    return {
        "wall": closed - started,
        "start": up - started,
        "run": ran - up,
        "evaluate": judged - ran,
        "close": closed - judged,
    }


def summarise(records: list[dict], total: float | None = None, *, mode: str = "sequential") -> dict:
    """Rate and per-case breakdown. ``total``: the batch's wall time (pipelined); default the sum of per-case walls.

    ``overlap_gained_ms``: per case, the sum of the parts minus the wall time per case: what ran at the same
    time as something else (about 0 when sequential)."""
    if total is None:
        total = sum(r["wall"] for r in records)
    parts = {k: sum(r[k] for r in records) for k in PARTS}
    n = len(records)
    walls = [r["wall"] for r in records if "wall" in r]
    return {
        "mode": mode,
        "cases": n,
        "seconds": total,
        "cases_per_second": n / total if total else None,
        "mean_ms": 1000 * total / n,
        "median_ms": 1000 * statistics.median(walls) if walls else None,
        "breakdown_ms": {k: 1000 * v / n for k, v in parts.items()},
        "overlap_gained_ms": 1000 * (sum(parts.values()) - total) / n,
        "collective_calls_per_rank": max(r.get("collective_calls", 0) for r in records),
        "breakdown_share": {k: v / total if total else None for k, v in parts.items()},
    }


def merge_batches(batches: list[tuple[list[dict], float]]) -> tuple[list[dict], float]:
    """Pipelined batches as one: all their records and the sum of their wall times."""
    return [r for records, _ in batches for r in records], sum(seconds for _, seconds in batches)
