"""pytest plugin (entry point ``pytest11: cp_harness``).

Installed with the project, it is active in every pytest run, so another
repository gates its own implementation with::

    pytest --pyargs cp_harness.tests --cp-impl their.module

Options:

- ``--cp-model MODULE``: model spec(s) whose real model the gate suite also judges (``test_real_models``);
- ``--cp-impl MODULE``: implementation under test (else ``$CP_IMPL``, else ``cp_impl``);
  ``MODULE,MODULE,...`` judges several in one run (each sharder-using case
  draws one; the first is the primary one).
- ``--cp-world-sizes 1,2,3,4,8``: CP sizes the generated cases use; the pool
  starts ``max`` ranks. Explicit examples of a larger size are skipped.
- ``--cp-backend gloo|nccl``: gloo on CPU; nccl with one GPU per rank (a pool
  of ``N`` ranks needs ``N`` visible GPUs; each pytest-xdist worker gets its
  own ``N``, and ``-n auto`` starts as many workers as there are such sets).
- ``--cp-case-timeout SECONDS``: how long one case may run on the ranks.
- ``--cp-launcher fork|torchrun``: how the ranks start (default: fork for
  gloo, torchrun for nccl; torchrun if importing the implementation starts
  threads, which a fork does not carry over).
- ``--update-golden``: rewrite golden files that changed (see ``docs/golden.md``;
  textual expecttest expectations are rewritten with ``EXPECTTEST_ACCEPT=1``).

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

from cp_harness.cases import profiles
from cp_harness.run_summary import SUMMARY
from cp_harness.cases.implementation import impl_names, load_impl, primary_impl, selected_impl_name

profiles.register()

_WORLD_SIZES_HELP = "comma-separated positive integers, e.g. 1,2,3,4,8"
_STARTED = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cp_harness", "context-parallel correctness harness")
    group.addoption("--cp-impl", default=None, metavar="MODULE",
                    help="module exposing inkling2 and mistral_large4 (default: $CP_IMPL or cp_impl); "
                         "a comma-separated list judges several in one run")
    group.addoption("--cp-world-sizes", default="1,2,3,4,8", metavar="SIZES",
                    help="comma-separated CP sizes to exercise (default 1,2,3,4,8); the pool starts max(SIZES) ranks")
    group.addoption("--cp-backend", default="gloo", choices=("gloo", "nccl"),
                    help="process-group backend of the rank pool: gloo on CPU, nccl with one GPU per rank")
    group.addoption("--cp-launcher", default=None, choices=("fork", "torchrun"),
                    help="how the pool's ranks start: forked from one process that imported torch and the "
                         "implementation (default for gloo) or by torchrun (default for nccl; use it if importing "
                         "the implementation starts threads)")
    group.addoption("--cp-case-timeout", type=float, default=120.0, metavar="SECONDS",
                    help="seconds one case may run on the ranks before they count as hung")
    group.addoption("--update-golden", action="store_true", default=False,
                    help="rewrite golden files whose content changed (see docs/golden.md)")
    group.addoption("--cp-model", default=None, metavar="MODULE",
                    help="model spec module(s), comma-separated: the gate suite also judges these real models (the "
                         "framework's own CP path against the same model on one device; cp_harness/tests/"
                         "test_real_models.py); the ranks import them once, before they are forked")
    group.addoption("--cp-precision-policy", default="strict", choices=("strict", "payload"),
                    help="strict: bfloat16/float16 sums accumulate in float32 and round once (the contract); payload: "
                         "partial sums may stay in the payload's precision within N-1 ULPs (cp_harness/judging/policy.py)")
    group.addoption("--cp-summary-json", default=None, metavar="PATH",
                    help="also write the run summary (and pytest's outcome counts and duration) to PATH as JSON")


def _world_sizes(config: pytest.Config) -> tuple[int, ...]:
    from cp_harness.cases.descriptions import parse_world_sizes

    raw = config.getoption("--cp-world-sizes")
    try:
        return parse_world_sizes(raw)
    except ValueError as exc:
        raise pytest.UsageError(f"--cp-world-sizes={raw!r}: give {_WORLD_SIZES_HELP}") from exc


def _is_cp_run(config: pytest.Config) -> bool:
    """Whether this run is about CP: then ``ci`` is the default Hypothesis profile (else Hypothesis' own stays)."""
    if config.getoption("--cp-impl") or os.environ.get("CP_IMPL"):
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
    config.addinivalue_line("markers", "gpu: needs CUDA devices and the NCCL backend (skipped unless --cp-backend nccl)")
    from cp_harness.cases import strategies

    cp_run = _is_cp_run(config)
    profile = config.getoption("--hypothesis-profile", default=None)
    if profile is None and cp_run:
        settings.load_profile("ci")
        profile = "ci"
    sizes = _world_sizes(config)
    impls: tuple[str, ...] = ()
    if cp_run:
        # Ranks and in-process checks must judge the same module (xdist workers inherit it too).
        selection = selected_impl_name(config.getoption("--cp-impl"))
        try:
            impls = tuple(impl_names(selection))
        except ValueError as exc:
            raise pytest.UsageError(f"--cp-impl: {exc}") from exc
        os.environ["CP_IMPL"] = selection
    # The session's case space, set once before any test module builds its strategies (like a profile).
    models = tuple(m for m in (config.getoption("--cp-model") or "").split(",") if m)
    if models:
        from cp_harness.usage.model_specs import PRELOAD_ENV

        os.environ[PRELOAD_ENV] = ",".join(models)  # the pool's launcher imports them before it forks
    strategies.use_session_space(strategies.CaseSpace(world_sizes=tuple(sizes), impls=impls,
                                                      favour_small=profile == "ci", models=models))
    if config.getoption("--cp-backend") == "nccl":
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
    if config.getoption("--cp-backend") != "nccl":
        return None
    from cp_harness.ranks.devices import visible_gpus

    return max(1, len(visible_gpus()) // max(_world_sizes(config)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--cp-backend") == "nccl":
        return
    skip_gpu = pytest.mark.skip(reason="needs --cp-backend nccl and CUDA devices")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def cp_world_sizes(pytestconfig: pytest.Config) -> tuple[int, ...]:
    return _world_sizes(pytestconfig)


@pytest.fixture(scope="session")
def cp_impl_selection(pytestconfig: pytest.Config) -> str:
    """Every implementation of the run, comma-separated (what the ranks load)."""
    return selected_impl_name(pytestconfig.getoption("--cp-impl"))


@pytest.fixture(scope="session")
def cp_impl_name(cp_impl_selection: str) -> str:
    """The primary implementation (single-rank checks judge it; cases without an ``"impl"`` key run it)."""
    return primary_impl(cp_impl_selection)


@pytest.fixture(scope="session")
def cp_impl(cp_impl_name: str):
    return load_impl(cp_impl_name)


@pytest.fixture(scope="session")
def cp_backend(pytestconfig: pytest.Config) -> str:
    return pytestconfig.getoption("--cp-backend")


@pytest.fixture(scope="session")
def cp_update_golden(pytestconfig: pytest.Config) -> bool:
    return bool(pytestconfig.getoption("--update-golden"))


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
        n = int(case["world_size"])
        if n > ranks:
            _skip_case(f"case needs {n} CP ranks; this run's pool has {ranks} (--cp-world-sizes)")
    return admit


@pytest.fixture(scope="session")
def cp_runner(pytestconfig: pytest.Config, cp_world_sizes, cp_impl_selection):
    from cp_harness.ranks.pool import PoolConfig

    for name in impl_names(cp_impl_selection):
        try:  # a module that does not import fails every CP test at once, with this message, before any rank starts
            load_impl(name)
        except Exception as exc:  # noqa: BLE001
            raise pytest.UsageError(f"--cp-impl {name}: the implementation does not import here: "
                                    f"{type(exc).__name__}: {exc}") from exc
    timeout = pytestconfig.getoption("--cp-case-timeout")
    from cp_harness.judging.policy import policy_named
    from cp_harness.runner import CaseRunner

    runner = CaseRunner(PoolConfig(world_size=max(cp_world_sizes), backend=pytestconfig.getoption("--cp-backend"),
                                   impl=cp_impl_selection, case_timeout=timeout,
                                   launcher=pytestconfig.getoption("--cp-launcher"),
                                   collective_timeout=max(10.0, timeout / 2)),
                        admit=_within(max(cp_world_sizes)),
                        policy=policy_named(pytestconfig.getoption("--cp-precision-policy")))
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
    data = {"exit_status": int(exitstatus), "seconds": time.time() - config.stash.get(_STARTED, time.time()),
            "outcomes": outcomes, "summary": SUMMARY.as_dict()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is not None:
        return
    if config.getoption("--cp-summary-json"):
        _write_summary_json(terminalreporter, exitstatus, config, config.getoption("--cp-summary-json"))
    if SUMMARY.empty:
        return
    terminalreporter.section("cp_harness")
    terminalreporter.write_line(f"implementation: {selected_impl_name(config.getoption('--cp-impl'))}, "
                                f"backend: {config.getoption('--cp-backend')}, "
                                f"precision policy: {config.getoption('--cp-precision-policy')}")
    for line in SUMMARY.lines():
        terminalreporter.write_line(line)
