"""pytest plugin (entry point ``pytest11: cp_harness``).

Options:

- ``--cp-impl MODULE``: implementation under test (else ``$CP_IMPL``, else ``cp_impl``).
- ``--cp-world-sizes 1,2,3,4,8``: CP sizes the generated cases use.
- ``--cp-backend gloo|nccl``: gloo on CPU; nccl with one GPU per rank.
- ``--cp-case-timeout SECONDS``: how long one case may run on the ranks.
- ``--update-golden``: rewrite golden files that changed (see ``cp_harness.golden``).

Hypothesis profiles (choose with Hypothesis' own ``--hypothesis-profile``):
``ci`` (default: derandomised, fixed examples, no database writes),
``nightly`` (ten times the examples, random), ``dev`` (few examples).

Fixtures: ``cp_runner`` (a warm rank pool for the session or xdist worker),
``cp_world_sizes``, ``cp_impl_name``, ``cp_impl`` (the implementation loaded in
the test process for single-rank checks). Markers: ``slow``, ``gpu``.

At the end of the run the plugin prints how many CP examples ran per world
size (summed over xdist workers) and the other counters tests record with
``cp_harness.stats.count``.
"""

from __future__ import annotations

import collections
import os

import pytest

from cp_harness import profiles, stats
from cp_harness.impl import load_impl, selected_impl_name

profiles.register()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cp_harness", "context-parallel correctness harness")
    group.addoption("--cp-impl", default=None, help="module exposing inkling2 and mistral_large4 (default: $CP_IMPL or cp_impl)")
    group.addoption("--cp-world-sizes", default="1,2,3,4,8", help="comma-separated CP sizes to exercise")
    group.addoption("--cp-backend", default="gloo", choices=("gloo", "nccl"), help="process-group backend of the rank pool")
    group.addoption("--cp-case-timeout", type=float, default=120.0, help="seconds one case may run on the ranks")
    group.addoption("--update-golden", action="store_true", default=False, help="rewrite golden files whose content changed")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running checks (nightly)")
    config.addinivalue_line("markers", "gpu: needs CUDA devices and the NCCL backend")
    from cp_harness import strategies

    strategies.configure_world_sizes(_world_sizes(config))
    impl = selected_impl_name(config.getoption("--cp-impl"))
    # Ranks and in-process checks must judge the same module.
    os.environ["CP_IMPL"] = impl


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--cp-backend") == "nccl":
        return
    skip_gpu = pytest.mark.skip(reason="needs --cp-backend nccl and CUDA devices")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _world_sizes(config: pytest.Config) -> tuple[int, ...]:
    raw = config.getoption("--cp-world-sizes")
    try:
        sizes = tuple(sorted({int(x) for x in raw.split(",") if x.strip()}))
    except ValueError as exc:
        raise pytest.UsageError(f"--cp-world-sizes={raw!r}: give comma-separated positive integers, e.g. 1,2,3,4,8") from exc
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--cp-world-sizes={raw!r}: give comma-separated positive integers, e.g. 1,2,3,4,8")
    return sizes


@pytest.fixture(scope="session")
def cp_world_sizes(pytestconfig: pytest.Config) -> tuple[int, ...]:
    return _world_sizes(pytestconfig)


@pytest.fixture(scope="session")
def cp_impl_name(pytestconfig: pytest.Config) -> str:
    return selected_impl_name(pytestconfig.getoption("--cp-impl"))


@pytest.fixture(scope="session")
def cp_impl(cp_impl_name: str):
    return load_impl(cp_impl_name)


@pytest.fixture(scope="session")
def cp_runner(pytestconfig: pytest.Config, cp_world_sizes, cp_impl_name):
    from cp_harness.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    timeout = pytestconfig.getoption("--cp-case-timeout")
    runner = CaseRunner(PoolConfig(world_size=max(cp_world_sizes), backend=pytestconfig.getoption("--cp-backend"),
                                   impl=cp_impl_name, case_timeout=timeout, collective_timeout=max(10.0, timeout / 2)))
    try:
        yield runner
    finally:
        runner.close()
        for size, n in runner.counts.items():
            stats.count(f"cp examples at world size {size}", n)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the counters to the controller
        workeroutput["cp_harness_stats"] = dict(stats.COUNTERS)


def pytest_testnodedown(node, error) -> None:
    for key, value in getattr(node, "workeroutput", {}).get("cp_harness_stats", {}).items():
        stats.count(key, value)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is not None or not stats.COUNTERS:
        return
    counters = collections.OrderedDict(sorted(stats.COUNTERS.items()))
    terminalreporter.section("cp_harness")
    examples = {k: v for k, v in counters.items() if k.startswith("cp examples at world size")}
    if examples:
        total = sum(examples.values())
        per_size = ", ".join(f"N={k.rsplit(' ', 1)[1]}: {v}" for k, v in
                             sorted(examples.items(), key=lambda kv: int(kv[0].rsplit(" ", 1)[1])))
        terminalreporter.write_line(f"CP examples run: {total} ({per_size})")
    for key, value in counters.items():
        if key not in examples:
            terminalreporter.write_line(f"{key}: {value}")
