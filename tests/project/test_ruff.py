"""The tree stays as ruff checks and formats it (``[tool.ruff]`` in pyproject.toml; no ranks, no torch).

``ruff check`` (pyflakes, pycodestyle, bugbear, import order, pyupgrade) and ``ruff format --check`` over
``cp_harness/``, ``examples/``, ``oracle/`` and ``cp_impl/``, as configured; the generated repros are excluded there,
with the reason. Each test fails with ruff's own report (file, line, rule), so the fix is ``ruff check --fix`` or
``ruff format`` on what it names. ruff is pinned in the ``test`` extra; without it the tests skip, saying so.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TREES = ("cp_harness", "examples", "oracle", "cp_impl")


def _ruff() -> list[str]:
    beside = pathlib.Path(sys.executable).with_name("ruff")  # the test environment's own, as pinned
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed: install the test extra (scripts/bootstrap.sh does)")
    return [found]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_ruff(), *args, *TREES], cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_check_is_clean():
    done = _run("check", "--no-cache", "--output-format", "concise")
    assert done.returncode == 0, f"ruff check found problems (fix: ruff check --fix {' '.join(TREES)}):\n" \
                                 f"{done.stdout}{done.stderr}"


def test_ruff_format_leaves_the_tree_as_it_is():
    done = _run("format", "--check", "--no-cache")
    assert done.returncode == 0, f"not formatted (fix: ruff format {' '.join(TREES)}):\n{done.stdout}{done.stderr}"
