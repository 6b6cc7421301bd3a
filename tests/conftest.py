"""Fixtures the project's own tests share across folders.

``real_models``: one warm pool of 3 ranks for every real-model test module of the session (or xdist worker), whose
launcher imports every CPU model spec once before it forks (``PoolConfig.preload``): a pool start with the
framework's models imported costs 15-40 s on 2 cores, and each rank's first case of a model compiles its kernels.
The modules that use it declare ``REAL_MODELS = True``; ``pytest_collection_modifyitems`` below gives each of their
tests the real-model header: skipped without transformers and nemo-automodel (the ``models`` extra) and
``pytest.mark.xdist_group("real_models")`` (``./scripts/test`` distributes with ``--dist loadgroup``), so one worker
starts the pool once.
"""

from __future__ import annotations

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
