"""pytest plugin (entry point ``pytest11: cp_harness``).

Installed with the project, it is active in every pytest run, so another
repository gates its own implementation with::

    pytest --pyargs cp_harness.tests --cp-impl their.module

Options: the one table of ``cp_harness.options``, shared with the command line (``--impl`` there is
``--cp-impl`` here): ``--cp-impl MODULE[,MODULE...]`` (else ``$CP_IMPL``, else ``cp_impl``; several: each
sharder-using case draws one, the first is the primary one), ``--cp-world-sizes 1,2,3,4,8`` (the pool starts
``max`` ranks; explicit examples of a larger size are skipped), ``--cp-backend gloo|nccl`` (nccl: one GPU per
rank, each pytest-xdist worker its own set, ``-n auto`` as many workers as there are sets), ``--cp-launcher
fork|torchrun``, ``--cp-precision-policy strict|payload``, ``--cp-model MODULE`` (the real-model rows,
``test_real_models``), ``--cp-error-maps DIR`` (else ``$CP_HARNESS_ERROR_MAP_DIR``), ``--cp-case-timeout
SECONDS``, ``--cp-summary-json PATH``, ``--update-golden`` (``docs/golden.md``; textual expecttest
expectations are rewritten with ``EXPECTTEST_ACCEPT=1``). The environment is read once, in
``pytest_configure``.

Hypothesis profiles (choose with Hypothesis' own ``--hypothesis-profile``):
``ci`` (default: derandomised, fixed examples, no database writes),
``nightly`` (ten times the examples, random), ``dev`` (few examples). ``ci``
becomes the default only in a run about CP (``--cp-impl``, ``$CP_IMPL``, an
argument naming ``cp_harness``, or this checkout): other projects' tests in
the same environment keep their Hypothesis settings.

Fixtures: ``cp_runner`` (a warm rank pool for the session or xdist worker),
``cp_world_sizes``, ``cp_impl_name``, ``cp_impl`` (the implementation loaded in
the test process for single-rank checks), ``cp_backend``, ``cp_update_golden``.
Markers: ``slow`` (deselect with ``-m "not slow"``), ``gpu`` (skipped unless
``--cp-backend nccl``).

At the end of the run the plugin prints how many CP examples ran per world
size and per dtype (summed over xdist workers; ``layout`` counts the checks
without a floating payload), the other counters tests record with
``cp_harness.run_summary.count``, and the error maps failing cases wrote (from the runner, as data).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import settings

from cp_harness import options
from cp_harness.cases import profiles
from cp_harness.cases.implementation import impl_names, load_impl, primary_impl
from cp_harness.run_summary import SUMMARY

profiles.register()

_STARTED = pytest.StashKey[float]()
_SETTINGS = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_pytest_options(parser.getgroup("cp_harness", "context-parallel correctness harness"))


def cp_settings(config: pytest.Config) -> dict:
    """The run's resolved options (``cp_harness.options``): read once, at ``pytest_configure``."""
    if _SETTINGS not in config.stash:
        config.stash[_SETTINGS] = options.from_pytest(config)
    return config.stash[_SETTINGS]


def _is_cp_run(config: pytest.Config) -> bool:
    """Whether this run is about CP: then ``ci`` is the default Hypothesis profile (else Hypothesis' own stays)."""
    if config.getoption("cp_impl") or os.environ.get("CP_IMPL"):
        return True
    if any("cp_harness" in str(arg) for arg in config.args):
        return True
    return (Path(str(config.rootpath)) / "cp_harness" / "pytest_plugin.py").is_file()


def _xdist_workers(config: pytest.Config) -> int:
    """Number of pools that run at once: xdist workers (0 or 1 without xdist)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return int(workerinput.get("workercount", 1))
    if getattr(config.option, "dist", "no") != "no":
        return len(getattr(config.option, "tx", None) or []) or 1
    return 1


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running checks (run nightly; deselect with -m 'not slow')")
    config.addinivalue_line(
        "markers", "gpu: needs CUDA devices and the NCCL backend (skipped unless --cp-backend nccl)"
    )
    cp_run = _is_cp_run(config)
    values = cp_settings(config)  # the one read of the environment ($CP_IMPL, $CP_HARNESS_ERROR_MAP_DIR)
    profile = config.getoption("--hypothesis-profile", default=None)
    if profile is None and cp_run:
        settings.load_profile("ci")
        profile = "ci"
    sizes = values["world_sizes"]
    impls: tuple[str, ...] = ()
    if cp_run:
        try:
            impls = tuple(impl_names(values["impl"]))
        except ValueError as exc:
            raise pytest.UsageError(f"--cp-impl: {exc}") from exc
    # The session's case space, registered and loaded once before any test module builds its strategies (as
    # Hypothesis profiles are).
    profiles.register_space(
        "session",
        profiles.CaseSpace(
            world_sizes=tuple(sizes), impls=impls, favour_small=profile == "ci", models=tuple(values["model_specs"])
        ),
    )
    profiles.load_space("session")
    if values["backend"] == "nccl":
        _configure_gpus(config, max(sizes))


def _configure_gpus(config: pytest.Config, ranks: int) -> None:
    """Fail early when the GPUs cannot give every rank its own device; give each xdist worker its own slice."""
    from cp_harness.ranks.devices import DeviceError, check_backend, gpu_slice

    workerinput = getattr(config, "workerinput", None)
    try:
        if workerinput is None:
            check_backend("nccl", ranks, pools=_xdist_workers(config))
        else:
            worker = int(str(workerinput.get("workerid", "gw0")).removeprefix("gw") or 0)
            # The pool's ranks (subprocesses) see only this worker's devices, as 0..ranks-1.
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu_slice(worker, ranks)
    except DeviceError as exc:
        raise pytest.UsageError(f"--cp-backend nccl: {exc}") from exc


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config):
    """With ``--cp-backend nccl``, ``-n auto`` means one worker per set of GPUs that holds a whole pool."""
    if cp_settings(config)["backend"] != "nccl":
        return None
    from cp_harness.ranks.devices import visible_gpus

    return max(1, len(visible_gpus()) // max(cp_settings(config)["world_sizes"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cp_settings(config)["backend"] == "nccl":
        return
    skip_gpu = pytest.mark.skip(reason="needs --cp-backend nccl and CUDA devices")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def cp_world_sizes(pytestconfig: pytest.Config) -> tuple[int, ...]:
    return tuple(cp_settings(pytestconfig)["world_sizes"])


@pytest.fixture(scope="session")
def cp_impl_selection(pytestconfig: pytest.Config) -> str:
    """Every implementation of the run, comma-separated (what the ranks load)."""
    return cp_settings(pytestconfig)["impl"]


@pytest.fixture(scope="session")
def cp_impl_name(cp_impl_selection: str) -> str:
    """The primary implementation (single-rank checks judge it; cases without an ``"impl"`` key run it)."""
    return primary_impl(cp_impl_selection)


@pytest.fixture(scope="session")
def cp_impl(cp_impl_name: str):
    return load_impl(cp_impl_name)


@pytest.fixture(scope="session")
def cp_backend(pytestconfig: pytest.Config) -> str:
    return cp_settings(pytestconfig)["backend"]


@pytest.fixture(scope="session")
def cp_update_golden(pytestconfig: pytest.Config) -> bool:
    return bool(cp_settings(pytestconfig)["update_golden"])


def _skip_case(reason: str) -> None:
    """Leave this case out: a rejected example inside a Hypothesis test, a skip elsewhere."""
    from hypothesis import assume
    from hypothesis.control import currently_in_test_context

    if currently_in_test_context():
        assume(False)  # explicit @example cases rejected this way are skipped, not failed
    pytest.skip(reason)


def _within(ranks: int):
    """Admission of a pool of ``ranks``: a case that needs more is skipped, saying why."""

    def admit(case: dict) -> None:
        from cp_harness.cases.meshes import ranks_needed

        n = ranks_needed(case)
        if n > ranks:
            _skip_case(f"case needs {n} ranks; this run's pool has {ranks} (--cp-world-sizes)")

    return admit


@pytest.fixture(scope="session")
def cp_runner(pytestconfig: pytest.Config, cp_world_sizes, cp_impl_selection):
    from cp_harness.ranks.pool import PoolConfig

    for name in impl_names(cp_impl_selection):
        try:  # a module that does not import fails every CP test at once, with this message, before any rank starts
            load_impl(name)
        except Exception as exc:  # noqa: BLE001
            raise pytest.UsageError(
                f"--cp-impl {name}: the implementation does not import here: {type(exc).__name__}: {exc}"
            ) from exc
    values = cp_settings(pytestconfig)
    timeout = values["case_timeout"] if values["case_timeout"] is not None else 120.0
    from cp_harness.judging.policy import policy_named
    from cp_harness.runner import CaseRunner

    runner = CaseRunner(
        PoolConfig(
            world_size=max(cp_world_sizes),
            backend=values["backend"],
            preload=tuple(values["model_specs"]),
            impl=cp_impl_selection,
            **{**options.pool_options(values), "case_timeout": timeout},
            collective_timeout=max(10.0, timeout / 2),
        ),
        admit=_within(max(cp_world_sizes)),
        policy=policy_named(values["precision_policy"]),
        error_dir=values["error_dir"],
        repro_dir=values["export_repros"],
    )
    try:
        yield runner
    finally:
        runner.close()
        SUMMARY.add_runner(runner, several_impls=len(impl_names(cp_impl_selection)) > 1)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand its summary to the controller
        workeroutput["cp_harness_summary"] = SUMMARY.as_dict()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    SUMMARY.merge((getattr(node, "workeroutput", None) or {}).get("cp_harness_summary", {}))


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.time()


def _write_summary_json(terminalreporter, exitstatus, config: pytest.Config, path: str) -> None:
    outcomes = {key: len(terminalreporter.stats.get(key, [])) for key in ("passed", "failed", "error", "skipped")}
    data = {
        "exit_status": int(exitstatus),
        "seconds": time.time() - config.stash.get(_STARTED, time.time()),
        "outcomes": outcomes,
        "summary": SUMMARY.as_dict(),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is not None:
        return
    values = cp_settings(config)
    if values["summary_json"]:
        _write_summary_json(terminalreporter, exitstatus, config, values["summary_json"])
    if SUMMARY.empty:
        return
    terminalreporter.section("cp_harness")
    kernels = ""
    if values["backend"] == "gloo":  # the float kernels the ranks ran (ATEN_CPU_CAPABILITY picks another set)
        import torch

        kernels = f" (CPU kernels: {torch.backends.cpu.get_cpu_capability().lower()})"
    terminalreporter.write_line(
        f"implementation: {values['impl']}, backend: {values['backend']}{kernels}, "
        f"precision policy: {values['precision_policy']}"
    )
    for line in SUMMARY.lines():
        terminalreporter.write_line(line)
