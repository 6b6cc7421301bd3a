"""Installed like a user installs it, the plugin gates from any directory.

A fresh virtual environment gets a regular (non-editable) install of a copy
of the project's sources with its ``test`` extra, PyTorch pinned to the CPU
build by ``constraints/cpu.txt``. Then, from a directory that has nothing to
do with the project, ``pytest --pyargs cp_harness.tests --cp-impl cp_impl``
must find the plugin through its ``pytest11`` entry point, start a rank pool,
pass, and print the CP example counts; and the ``cp-harness`` console script
must work.

Slow (about a minute and a half on two cores: most of it is pip unpacking
PyTorch; it also needs the package index that ``scripts/bootstrap.sh``
uses), so it runs nightly and on request::

    ./scripts/test tests/test_install_plugin.py -m slow
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "oracle", "cp_impl", "cp_harness")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CP_IMPL", "VIRTUAL_ENV", "PYTHONHOME", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.slow
def test_installed_plugin_gates_the_bundled_implementation_from_another_directory(tmp_path):
    started = time.perf_counter()
    # A copy of the sources, so that building the wheel leaves nothing (build/, *.egg-info) in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, timeout=300)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          "-c", str(ROOT / "constraints" / "cpu.txt"), f"{src}[test]"], tmp_path, timeout=900)
    installed = time.perf_counter()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(python), "-c", "import cp_harness, cp_harness.checks, cp_impl; print(cp_harness.__file__)"],
                 elsewhere, timeout=120).stdout.strip()
    assert Path(where).is_relative_to(venv), f"cp_harness came from {where}, not from the new environment"

    proc = _run([str(python), "-m", "pytest", "--pyargs", "cp_harness.tests", "--cp-impl", "cp_impl", "-q",
                 "-k", "transport", "--cp-world-sizes", "1,2", "--hypothesis-profile", "dev", "-p", "no:cacheprovider"],
                elsewhere, timeout=600)
    out = proc.stdout + proc.stderr
    assert " passed" in out and "failed" not in out, out
    assert "CP examples run:" in out and "implementation: cp_impl" in out, out

    cli = _run([str(venv / "bin" / "cp-harness"), "verify", "--help"], elsewhere, timeout=120)
    assert "--world-sizes" in cli.stdout and "--json" in cli.stdout
    print(f"install: {installed - started:.1f} s, plugin run: {time.perf_counter() - installed:.1f} s")
