"""Installed like a user installs it, the plugin gates from any directory.

Both tests make a regular (non-editable) install of the project into a new
virtual environment, then, from a directory that has nothing to do with the
project, ``pytest --pyargs cp_harness.tests --cp-impl cp_impl`` must find the
plugin through its ``pytest11`` entry point, start a rank pool, pass and print
the CP example counts; and the ``cp-harness`` console script must work.

- **offline** (the default command): a wheel is built from a copy of the
  sources (``pip wheel --no-deps --no-build-isolation``, nothing downloaded)
  and installed with ``--no-deps --no-index`` into a new environment that sees
  the dependencies already installed here (PyTorch, pytest, Hypothesis, ...)
  through a ``.pth`` file naming a folder of links to them, the project
  itself left out. About 15-30 s on two cores.
- **download** (``nightly``: needs the package index, about a minute and a half
  on two cores, most of it pip unpacking PyTorch): ``pip install
  <copy>[test]`` with every dependency resolved and downloaded as a user
  would, PyTorch pinned by ``constraints/cpu.txt``. It runs when
  ``CP_HARNESS_NIGHTLY=1`` (the nightly workflow) or when ``-m`` names
  ``nightly``; the default command skips it::

      CP_HARNESS_NIGHTLY=1 ./scripts/test -n 0 tests/project/test_install_plugin.py
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "constraints", "oracle", "cp_impl", "cp_harness")
PROJECT_TOP_LEVEL = ("cp_harness", "cp_impl", "oracle")  # packages and their metadata, never shared


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CP_IMPL", "VIRTUAL_ENV", "PYTHONHOME", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def _copy_sources(tmp_path: Path) -> Path:
    """A copy of the sources, so that building leaves nothing (build/, *.egg-info) in the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    return src


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _gates_from_elsewhere(venv: Path, tmp_path: Path) -> None:
    """From an unrelated directory: the package comes from ``venv``, the plugin gates, the console script runs."""
    python = venv / "bin" / "python"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # One interpreter: where the packages come from, then the gate suite through the plugin's entry point.
    gate = ("import sys, cp_harness, cp_harness.checks, cp_impl, oracle, pytest; "
            "print('FROM', cp_harness.__file__, cp_impl.__file__, oracle.__file__, flush=True); "
            "sys.exit(pytest.main(sys.argv[1:]))")
    proc = _run([python, "-c", gate, "--pyargs", "cp_harness.tests", "--cp-impl", "cp_impl", "-q",
                 "-k", "gathers", "--cp-world-sizes", "1,2", "--hypothesis-profile", "dev", "-p", "no:cacheprovider"],
                elsewhere, timeout=600)
    out = proc.stdout + proc.stderr
    where = next(line for line in proc.stdout.splitlines() if line.startswith("FROM ")).split()[1:]
    assert len(where) == 3, where
    for path in where:
        assert Path(path).is_relative_to(venv), f"imported {path}, not from the new environment"
    assert " passed" in out and "failed" not in out, out
    assert "CP examples run:" in out and "implementation: cp_impl" in out, out

    cli = _run([venv / "bin" / "cp-harness", "verify", "--help"], elsewhere, timeout=120)
    assert "--world-sizes" in cli.stdout and "--json" in cli.stdout


def _shared_dependencies(tmp_path: Path) -> Path:
    """A folder of links to everything installed next to PyTorch here, except the project itself."""
    import torch

    installed = Path(torch.__file__).resolve().parents[1]
    assert installed in {Path(p).resolve() for p in site.getsitepackages()}, installed
    # Named site-packages: Hypothesis reads the source of every module it takes for the project's own (any path
    # without "/site-packages/") for constants, which for all of PyTorch cost ~8 s of the run from elsewhere.
    deps = tmp_path / "shared" / "site-packages"
    deps.mkdir(parents=True)
    for entry in installed.iterdir():
        name = entry.name
        if (name.startswith(PROJECT_TOP_LEVEL) or name.startswith(("__editable__", "_virtualenv", "__pycache__"))
                or name.endswith(".pth") or name.replace("-", "_").startswith("cp_harness")):
            continue  # the project (editable or not) and path hooks stay out
        (deps / name).symlink_to(entry)
    return deps


@pytest.mark.slow
def test_installed_wheel_gates_the_bundled_implementation_from_another_directory_offline(tmp_path):
    started = time.perf_counter()
    src = _copy_sources(tmp_path)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
          "--no-build-isolation", "--no-index", "--wheel-dir", dist, src], tmp_path, timeout=600)
    wheels = list(dist.glob("cp_harness-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, built {sorted(p.name for p in dist.iterdir())}"
    built = time.perf_counter()

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, timeout=300)
    purelib = _site_packages(venv)
    assert purelib.is_dir(), purelib
    (purelib / "cp_harness_test_dependencies.pth").write_text(f"{_shared_dependencies(tmp_path)}\n")
    # pip of this environment installs into the new one; --no-index: nothing can be downloaded.
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet",
          "--disable-pip-version-check", "--no-deps", "--no-index", wheels[0]], tmp_path, timeout=600)
    installed = time.perf_counter()

    # A regular install of the wheel: the files are in the environment, no editable hook anywhere.
    assert (purelib / "cp_harness" / "pytest_plugin.py").is_file()
    assert not (purelib / "cp_harness" / "pytest_plugin.py").is_symlink()
    assert (purelib / "cp_harness" / "tests" / "test_transport.py").is_file(), "the gate suite is in the wheel"
    metadata = list(purelib.glob("cp_harness-*.dist-info"))
    assert len(metadata) == 1 and "cp_harness.pytest_plugin" in (metadata[0] / "entry_points.txt").read_text()
    assert not list(purelib.glob("__editable__*")), "an editable install"

    _gates_from_elsewhere(venv, tmp_path)
    print(f"wheel: {built - started:.1f} s, install: {installed - built:.1f} s, "
          f"plugin run: {time.perf_counter() - installed:.1f} s")


@pytest.mark.slow
@pytest.mark.nightly
def test_installed_plugin_gates_the_bundled_implementation_from_another_directory(tmp_path):
    started = time.perf_counter()
    src = _copy_sources(tmp_path)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path, timeout=300)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          "-c", ROOT / "constraints" / "cpu.txt", f"{src}[test]"], tmp_path, timeout=900)
    installed = time.perf_counter()
    _gates_from_elsewhere(venv, tmp_path)
    print(f"install: {installed - started:.1f} s, plugin run: {time.perf_counter() - installed:.1f} s")
