"""The tree stays clean under mypy as configured (``[tool.mypy]`` in pyproject.toml; no ranks, no torch).

``mypy`` from the repository root checks the files the configuration names (``cp_harness/``, ``oracle/``,
``cp_impl/``) at its default strictness; the one per-module exception is written, with its reason, next to it.
The test fails with mypy's own report (file, line, error code). mypy is pinned in the ``test`` extra; without it
the test skips, saying so. Its cache (``.mypy_cache``, ignored by git) keeps a re-run to about a second.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_mypy_is_clean():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed: install the test extra (scripts/bootstrap.sh does)")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"mypy found problems (run: {sys.executable} -m mypy):\n{done.stdout}{done.stderr}"
