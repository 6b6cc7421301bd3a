"""``./scripts/test`` runs under ``-n auto --dist loadgroup``, and the suite depends on its groups: every test of a
group runs on one worker, so an expensive fixture is built once (the shared real-model pool of ``tests/conftest.py``,
the training-step module's 4-rank pool, any module-scoped fixture: ``_uses_a_module_fixture``).

Nothing fails when grouping breaks; the suite only gets slower. pytest 9.2 broke it for pytest-xdist 3.8: xdist writes
the group into a node-id field pytest 9.2 no longer reads (pytest-xdist issue 1386), so every group was spread over the
workers and each built its own pools (measured here: the fla stand-in test's forked ranks twice, 34 s and 39 s; the
training-step pool on both workers). ``constraints/test.txt`` therefore keeps pytest below 9.2. This test runs a
small suite under the same options, with this repository's grouping hook, and asserts where its tests ran.
"""

from __future__ import annotations

import collections
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

CONFTEST = f"""
import importlib.util

_spec = importlib.util.spec_from_file_location("project_conftest", {str(ROOT / "tests" / "conftest.py")!r})
_project = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_project)
pytest_collection_modifyitems = _project.pytest_collection_modifyitems  # this repository's grouping hook
"""

TESTS = """
import os
import pytest

def _log(name):
    with open(os.environ["GROUPING_LOG"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER')} {name}\\n")

@pytest.fixture(scope="module")
def built_once():
    _log("fixture")
    return 1

@pytest.mark.parametrize("i", range(6))
def test_uses_the_module_fixture(built_once, i):
    _log("fixture-test")

@pytest.mark.xdist_group("marked")
@pytest.mark.parametrize("i", range(12))
def test_marked(i):
    _log("marked")

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    _log("free")
"""


def test_loadgroup_keeps_each_group_and_each_module_fixture_on_one_worker(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: install the test extra")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent(TESTS))
    log = tmp_path / "log.txt"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-p", "no:cacheprovider",
         "-p", "no:cp_harness", "-p", "no:randomly", str(tmp_path / "test_grouped.py")],
        cwd=tmp_path, env={**os.environ, "GROUPING_LOG": str(log)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    workers = collections.defaultdict(set)
    for line in log.read_text().splitlines():
        worker, name = line.split()
        workers[name].add(worker)
    # Both workers ran tests (xdist gives each worker work before either asks for more), so a group on one worker
    # shows something. Which worker runs the free tests depends on load: under load one took them all (CI, measured).
    assert len(set().union(*workers.values())) == 2, (workers, "the small suite must use both workers to show anything")
    assert len(workers["marked"]) == 1, (workers, "an xdist_group was spread over the workers: pytest and "
                                         "pytest-xdist disagree on node ids (constraints/test.txt)")  # fmt: skip
    assert len(workers["fixture-test"]) == 1 and len(workers["fixture"]) == 1, workers
