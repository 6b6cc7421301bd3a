"""Standalone repros run as their users run them (nightly: it installs PyTorch into a fresh virtual environment).

The environment holds torch and numpy (the CPU pin) and, for the framework's findings and the real models,
nemo-automodel and the models' pins; the code under test (``cp_impl``, the broken fixtures, the adapters'
packages, the model specs) is a copy of those folders on ``PYTHONPATH``; ``cp_harness``, ``oracle`` and Hypothesis
are not there. Every exported script runs by its own command line, its ranks spawned (each importing torch):
exit 1 as it is, 0 with ``--impl cp_impl`` / ``--fixed`` / the bundled spec. The real models' scripts (one
minute or two each) run here only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from targets import SPECS
from test_repros import ROOT, export_targets, framework

pytestmark = pytest.mark.nightly


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    *args], check=True, timeout=1800)


def test_every_repro_runs_in_a_fresh_environment_with_torch_numpy_and_the_code_under_test_only(
        cp_runner, own_pool_runner, tmp_path_factory):
    exported = export_targets(cp_runner, own_pool_runner, tmp_path_factory)
    specs = tmp_path_factory.mktemp("specs")
    from cp_harness import checks, repro
    from cp_harness.judging.policy import STRICT

    if framework():
        for name, (case, _) in SPECS.items():
            exported[name] = Path(repro.write(checks.check_of(case).repro.plan(repro.Request(case, "cp_impl", STRICT)),
                                              str(specs), f"{name}-repro"))
    base = tmp_path_factory.mktemp("fresh")
    venv, code = base / "venv", base / "code"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True)
    _pip(venv, "-c", str(ROOT / "constraints" / "cpu.txt"), "torch", "numpy")
    if framework():
        _pip(venv, "--no-deps", "-r", str(ROOT / "constraints" / "framework.txt"),
             "-r", str(ROOT / "constraints" / "models.txt"))
    for folder in ("cp_impl", "examples", "tests/fixtures"):
        shutil.copytree(ROOT / folder, code / Path(folder).name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(base), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{code / 'fixtures'}:{code}"}
    python = str(venv / "bin" / "python")
    alone = subprocess.run([python, "-c", "import cp_harness"], env=env, cwd=base, capture_output=True, text=True)
    assert alone.returncode != 0 and "No module named 'cp_harness'" in alone.stderr, alone.stderr
    for name, script in exported.items():
        fixes = [["--spec", "examples.automodel.models.deepseek_v41"]] if name in SPECS else [["--impl", "cp_impl"]]
        fixes += [["--fixed"]] if "--fixed" in script.read_text() else []
        wait = ["--timeout", "30"] if "MESH = {" in script.read_text() else []  # a message to a wrong rank waits
        for args, status in [([], 1), *((f, 0) for f in fixes)]:
            run = subprocess.run([python, str(script), *args, *wait], env=env, cwd=base, capture_output=True, text=True,
                                 timeout=900)
            assert run.returncode == status, f"{name} {args}: exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
            if status:  # failing for the defect, not for a module the environment lacks
                output = run.stdout + run.stderr
                assert "ModuleNotFoundError" not in output and "ImportError" not in output, output[-3000:]
                assert (SPECS[name][1] if name in SPECS else "") in output, run.stdout
                assert re.search(r"differ|raised|holds no|changed the caller's|cuts|not sharded|CP error", output), \
                    output[-3000:]
