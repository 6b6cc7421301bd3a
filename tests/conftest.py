"""Fixtures the project's own tests share across folders.

``real_models``: one warm pool of 3 ranks for every real-model test module of the session (or xdist worker), whose
launcher imports every CPU model spec once before it forks (``PoolConfig.preload``): a pool start with the
framework's models imported costs 15-40 s on 2 cores, and each rank's first case of a model compiles its kernels.
The modules that use it declare ``REAL_MODELS = True``; ``pytest_collection_modifyitems`` below gives each of their
tests the real-model header: skipped without transformers and nemo-automodel (the ``models`` extra) and
``pytest.mark.xdist_group("real_models")`` (``./scripts/test`` distributes with ``--dist loadgroup``), so one worker
starts the pool once.

``framework_adapters``: a runner on a pool of its own for the cases of the documented framework defects
(``examples/automodel/known_defects.json``), whose launcher imports every adapter once before it forks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def cpu_specs() -> tuple[str, ...]:
    """The model specs that run on the CPU (no ``"cuda"`` in their ``REQUIRES``, or a declared kernel stand-in that
    meets it: ``cp_harness.standins``), as module names; imports them."""
    from cp_harness import standins
    from examples.automodel.models import PACKAGE, SPECS, needs_cuda

    def stood_in(name: str) -> bool:
        declared = getattr(importlib.import_module(f"{PACKAGE}.{name}"), "STANDINS", ())
        return any(standins.get(s).meets == "cuda" and standins.get(s).device_type == "cpu" for s in declared)

    return tuple(f"{PACKAGE}.{name}" for name in SPECS if not needs_cuda(name) or stood_in(name))


REAL_MODEL_PACKAGES = ("transformers", "nemo_automodel")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The real-model header of every test in a module declaring ``REAL_MODELS = True``.

    ``tryfirst``: xdist's worker hook of this name reads ``xdist_group`` into the node ids ``--dist loadgroup``
    places, so the mark must be there before it runs.
    """
    missing = [name for name in REAL_MODEL_PACKAGES if importlib.util.find_spec(name) is None]
    for item in items:
        if not getattr(getattr(item, "module", None), "REAL_MODELS", False):
            if _uses_a_module_fixture(item) and item.get_closest_marker("xdist_group") is None:
                # One worker for the module: spread over two, each worker built the fixture (a rank pool, or the
                # fla test's forked ranks: 35 s on each worker, measured) for its half of the tests.
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
            continue
        if missing:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {' and '.join(missing)} (the 'models' extra; scripts/bootstrap.sh installs it and "
                       "nemo-automodel unless CP_HARNESS_NO_FRAMEWORK=1)"))
        item.add_marker(pytest.mark.xdist_group("real_models"))


def _uses_a_module_fixture(item) -> bool:
    """Whether the test uses a fixture of module scope (built once per module on each xdist worker that runs it)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


@pytest.fixture(scope="session")
def real_models():
    """A ``CaseRunner`` on the shared real-model pool (3 ranks, every CPU spec preloaded, fixtures importable)."""
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", "TORCHDYNAMO_DISABLE")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FIXTURES), str(ROOT), saved["PYTHONPATH"]) if p)
    # The framework torch.compile's its MoE activations; each rank compiling them for each model and dtype cost
    # 10-20 s per model on 2 cores, for code that is not CP. The default command runs them eagerly (the same math);
    # scripts/real_clients and the nightly run them as the framework does.
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    runner = CaseRunner(PoolConfig(world_size=3, impl="cp_impl", case_timeout=180.0, collective_timeout=90.0,
                                   preload=cpu_specs()))
    try:
        runner.pool.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield runner
    finally:
        runner.close()


def _framework_importable() -> bool:
    try:
        import nemo_automodel.components.distributed.context_parallel.sharder  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: the framework's tests are skipped or left out
        return False
    return True


@pytest.fixture(scope="session")
def framework_adapters(cp_runner):
    """A ``CaseRunner`` for the documented framework defects' adapter cases (``None`` without the framework): as many
    ranks as the largest case needs (4), ``cp_impl`` and the adapters of those cases imported by the launcher before it forks.

    Most of these cases fail by a rank raising, after which the pool is started again. On the session's pool (8
    ranks at the default sizes) each such start forked 8 ranks and each rank then imported its next case's adapter,
    the framework's CP modules, on its own (about 4 s of CPU a rank); here a start forks 4 ranks that hold them."""
    if not _framework_importable():
        yield None
        return
    from examples.automodel.tools.defects import load_known

    documented = [d for d in load_known() if "adapter" in d]
    adapters = sorted({f"examples.automodel.adapters.{d['adapter']}" for d in documented})
    with runner_with_own_pool(cp_runner, [d["case"] for d in documented], adapters) as runner:
        yield runner


@contextlib.contextmanager
def runner_with_own_pool(cp_runner, cases: list[dict], impls: list[str]):
    """A ``CaseRunner`` on a pool of its own, as small as ``cases`` allow, whose launcher imports ``cp_impl`` and
    ``impls`` once before it forks the ranks (the session runner's other settings); closed on exit, its starts
    counted in the session's. For cases that mostly fail by a rank raising: the pool starts again after each."""
    import dataclasses

    from cp_harness.cases.meshes import ranks_needed
    from cp_harness.runner import CaseRunner

    config = dataclasses.replace(cp_runner.config, world_size=max(ranks_needed(c) for c in cases),
                                 impl=",".join(["cp_impl", *impls]), preload=())
    runner = CaseRunner(config, policy=cp_runner.policy)
    try:
        yield runner
    finally:
        runner.close()
        count_pool_starts(runner)


@pytest.fixture(scope="session")
def own_pool_runner(cp_runner):
    """``own_pool_runner(cases, impls)``: ``runner_with_own_pool`` for the session's runner (a context manager)."""
    return functools.partial(runner_with_own_pool, cp_runner)


def count_pool_starts(runner) -> None:
    """Add the starts of a pool of a test's own to the session's "rank pool starts" (its cases, deliberately failing
    ones, are not examples of the gate and stay out of the counts)."""
    from cp_harness.run_summary import SUMMARY

    SUMMARY.pool_starts += runner.pool.starts
