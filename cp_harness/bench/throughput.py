"""The throughput section: the warm pool's rate per CP size against a fresh ``torchrun`` per case.

At each CP size the standard case runs in both modes of ``timed_runs``
(sequential and pipelined), then the pool's floor. At 2 ranks, unless
``--skip-fresh``, the timed cases are split around fresh torchruns: each fresh
torchrun is followed by at least as long of pipelined cases and as long of
sequential ones, so that the three rates are sampled under the same (shared,
noisy) load. The ratio of the pipelined warm rate to the fresh rate at 2 ranks
is the number the target is about.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from cp_harness.bench.cases import floor_case, standard_case
from cp_harness.bench.options import BenchOptions
from cp_harness.bench.progress import log
from cp_harness.bench.timed_runs import merge_batches, run_fresh, run_pipelined, run_sequential, summarise

# Seeds of the fresh-torchrun cases and of the oracle-thread probe, apart from the warm cases' seeds.
_FRESH_SEED = 500_000
_PROBE_SEED = 900_000


def measure(runner, options: BenchOptions, impl: str, backend: str) -> dict:
    """Warm rate per CP size, sequential and pipelined; the fresh-torchrun baseline interleaved at 2 ranks.

    The warm rate of the ratio is the pipelined one (``CaseRunner.run_many``, as the test runs and golden
    files use it).
    """
    result: dict[str, Any] = {
        "case": standard_case(0, 2),
        "warm": {},
        "sequential": {},
        "floor": {},
        "fresh": None,
        "warm_mode": "pipelined (CaseRunner.run_many: oracle while the ranks run, next cases queued on the ranks)",
    }
    fresh_records: list[dict] = []
    for n in options.throughput_sizes:
        seeds = iter(range(1000 * n, 1000 * n + 100000))
        warmup = [standard_case(next(seeds), n) for _ in range(options.warmup_cases)]
        run_sequential(runner.pool, warmup)
        run_pipelined(runner, [standard_case(next(seeds), n) for _ in range(options.warmup_cases)])
        cases = [standard_case(next(seeds), n) for _ in range(options.warm_cases)]
        interleave = n == 2 and not options.skip_fresh
        log(
            f"throughput: {len(cases)} warm cases at N={n}, sequential and pipelined each"
            + (
                f", {options.fresh_cases} fresh torchruns interleaved, each followed by as long of warm cases in each mode"
                if interleave
                else ""
            )
        )
        load_before = os.getloadavg()
        sequential: list[dict] = []
        pipelined: list[tuple[list[dict], float]] = []
        chunks = _split(cases, options.fresh_cases if interleave else 1)
        for index, chunk in enumerate(chunks):
            budget = 0.0
            if interleave:
                # Time-matched sampling: after each fresh torchrun, warm cases for at least as long in each mode.
                fresh = run_fresh(standard_case(_FRESH_SEED + index, 2), impl, backend)
                fresh_records.append(fresh)
                budget = fresh["wall"]
            pipelined.append(run_pipelined(runner, _until(list(chunk), budget, seeds, n)))
            spent = 0.0
            pending = [standard_case(next(seeds), n) for _ in chunk]
            while pending or spent < budget:
                record = run_sequential(runner.pool, [pending.pop(0) if pending else standard_case(next(seeds), n)])[0]
                sequential.append(record)
                spent += record["wall"]
        records, total = merge_batches(pipelined)
        summary = summarise(records, total, mode="pipelined")
        summary["load_average"] = [load_before[0], os.getloadavg()[0]]
        result["warm"][str(n)] = summary
        result["sequential"][str(n)] = summarise(sequential, mode="sequential")
        floor_cases = [floor_case(i, n) for i in range(max(options.warm_cases // 2, 1))]
        result["floor"][str(n)] = summarise(run_sequential(runner.pool, floor_cases))
    if fresh_records:
        total = sum(r["wall"] for r in fresh_records)
        result["fresh"] = {
            "world_size": 2,
            "cases": len(fresh_records),
            "seconds": total,
            "cases_per_second": len(fresh_records) / total,
            "mean_s": {
                k: statistics.mean(r[k] for r in fresh_records) for k in ("wall", "start", "run", "evaluate", "close")
            },
            "records": fresh_records,
        }
    result["oracle_threads"] = _oracle_thread_probe(max(options.warm_cases // 2, 4))
    warm2, seq2 = result["warm"].get("2"), result["sequential"].get("2")
    if warm2 and result["fresh"]:
        result["warm_over_fresh_2"] = warm2["cases_per_second"] / result["fresh"]["cases_per_second"]
        result["sequential_over_fresh_2"] = seq2["cases_per_second"] / result["fresh"]["cases_per_second"]
    return result


def _until(cases: list[dict], seconds: float, seeds: Iterator[int], n: int) -> Iterator[dict]:
    """``cases``, then more standard cases until ``seconds`` have passed since the first was asked for."""
    started = time.perf_counter()
    yield from cases
    while time.perf_counter() - started < seconds:
        yield standard_case(next(seeds), n)


def _split(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` consecutive chunks whose lengths differ by at most one."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _oracle_thread_probe(repeats: int) -> dict:
    """The standard case's oracle with torch's default intra-op threads and with one, interleaved.

    ``checks.evaluate`` runs the oracle with one thread; this records, in the same
    run, what the default would cost on this machine (see ``docs/benchmarks.md``).
    """
    import torch

    from cp_harness.checks import models

    default = torch.get_num_threads()
    times: dict[int, list[float]] = {default: [], 1: []}
    try:
        for i in range(repeats):
            for threads in times:
                torch.set_num_threads(threads)
                started = time.perf_counter()
                models.oracle_run(standard_case(_PROBE_SEED + i, 2))
                times[threads].append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(default)
    out = {}
    for threads, values in times.items():
        values.sort()
        out[f"threads={threads}"] = {
            "mean_ms": 1000 * statistics.mean(values),
            "median_ms": 1000 * statistics.median(values),
            "max_ms": 1000 * values[-1],
        }
    return {"default_threads": default, "repeats": repeats, "results": out}
