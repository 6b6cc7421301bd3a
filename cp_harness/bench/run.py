"""One benchmark run: the selected sections on one warm pool, the suite, the targets and the report.

The pool is started once with as many ranks as the largest CP size any
selected section needs (or a caller's warm ``CaseRunner`` is used, left
open); its start-up is not counted in any rate. A failing case stops the
sections and sets exit status 1, since the numbers of a wrong implementation
mean nothing.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from typing import Any

from cp_harness.bench import communication, memory, suite, throughput
from cp_harness.bench.options import BenchOptions
from cp_harness.bench.progress import log
from cp_harness.bench.report import (
    comm_tables,
    memory_tables,
    suite_table,
    targets_table,
    throughput_tables,
    write_json,
)
from cp_harness.bench.targets import targets, targets_spec
from cp_harness.bench.timed_runs import BenchCaseFailed


def _environment(impl: str, backend: str) -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "impl": impl,
        "backend": backend,
        "load_average_start": list(os.getloadavg()),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _pool_sizes(options: BenchOptions) -> set[int]:
    """The CP sizes the selected pool sections run at (empty when all are skipped)."""
    sizes = set()
    if not options.skip_throughput:
        sizes |= set(options.throughput_sizes)
    if not options.skip_comm:
        sizes |= {c["world_size"] for _, _, c in communication.comm_grid(options.quick)}
    if not options.skip_memory:
        sizes |= set(options.memory_sizes)
    return sizes


def run_bench(options: BenchOptions, stream=sys.stdout, runner=None) -> tuple[int, dict]:
    """Run the selected sections; returns ``(exit code, report)`` and writes ``options.json_path``.

    ``runner``: an already warm ``CaseRunner`` to use instead of starting a pool
    (the smoke test passes the test session's); it is used only when it has
    enough ranks and runs the selected implementation, and it is left open.
    """
    from cp_harness.cases.implementation import selected_impl_name

    impl = selected_impl_name(options.impl)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "version": 1,
        "quick": bool(options.quick),
        "environment": _environment(impl, options.backend),
        "targets_spec": targets_spec(),
    }
    sizes = _pool_sizes(options)
    code = 0
    if sizes:
        code = _run_pool_sections(options, impl, sizes, runner, report, stream)
    if not options.skip_suite and code == 0:
        report["suite"] = suite.measure(options.suite_cmd)
        report["suite"]["fresh_case_equivalents"] = suite.fresh_case_equivalents(
            report["suite"], report.get("throughput")
        )
        print(suite_table(report["suite"]) + "\n", file=stream, flush=True)
    else:
        report["suite"] = {"skipped": True}
    report["targets"] = targets(report)
    report["seconds"] = time.perf_counter() - started
    report["environment"]["load_average_end"] = list(os.getloadavg())
    print(targets_table(report["targets"]), file=stream)
    print(
        f"\nbench took {report['seconds']:.1f} s; load average {report['environment']['load_average_start'][0]:.1f} "
        f"at start, {report['environment']['load_average_end'][0]:.1f} at end, {os.cpu_count()} CPUs",
        file=stream,
    )
    if options.json_path:
        write_json(report, options.json_path, stream)
    if code == 0 and options.fail_on_miss and not all(t["ok"] for t in report["targets"]):
        code = 1
    return code, report


def _run_pool_sections(options: BenchOptions, impl: str, sizes: set[int], runner, report: dict, stream) -> int:
    """Throughput, communication and memory on one warm pool, each into ``report``; 1 when a case failed."""
    from cp_harness.ranks.pool import PoolConfig, RankFailure
    from cp_harness.runner import CaseRunner

    shared = (
        runner is not None
        and runner.config.world_size >= max(sizes)
        and runner.config.impl == impl
        and runner.config.backend == options.backend
    )
    if not shared:
        runner = CaseRunner(PoolConfig(world_size=max(sizes), backend=options.backend, impl=impl))
    t = time.perf_counter()
    log(
        f"using the caller's warm pool of {runner.config.world_size} ranks"
        if shared
        else f"starting a warm pool of {max(sizes)} ranks"
    )
    try:
        runner.pool.start()
        report["pool"] = {
            "world_size": runner.config.world_size,
            "start_seconds": time.perf_counter() - t,
            "shared": shared,
        }
        print(
            f"warm pool of {runner.config.world_size} ranks "
            + ("(already running)" if shared else f"started in {report['pool']['start_seconds']:.1f} s")
            + " (not counted in the warm rates)\n",
            file=stream,
        )
        sections = [
            (
                "throughput",
                options.skip_throughput,
                lambda: throughput.measure(runner, options, impl, options.backend),
                throughput_tables,
            ),
            ("communication", options.skip_comm, lambda: communication.measure(runner, options), comm_tables),
            ("memory", options.skip_memory, lambda: memory.measure(runner, options), memory_tables),
        ]
        for name, skip, run, show in sections:
            if skip:
                report[name] = None
                continue
            t = time.perf_counter()
            report[name] = run()
            report[name]["section_seconds"] = time.perf_counter() - t
            print(show(report[name]) + "\n", file=stream, flush=True)
    except (BenchCaseFailed, RankFailure) as exc:
        print(f"a benchmark case failed, so its numbers are not reported:\n{exc}", file=stream)
        return 1
    finally:
        if not shared:
            runner.close()
    return 0
