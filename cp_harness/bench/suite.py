"""The suite section: examples run and wall time of the full CPU test command.

The command runs from the repository root as a subprocess; its pass and fail
counts, pytest's own time and the plugin's ``CP examples run: N (...)`` line
are read from its terminal output.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from cp_harness.bench.progress import log

ROOT = Path(__file__).resolve().parents[2]

_PASSED = re.compile(r"(\d+) passed")
_FAILED = re.compile(r"(\d+) (failed|error|errors)\b")
_EXAMPLES = re.compile(r"CP examples run: (\d+)(?: \(([^)]*)\))?")
_PYTEST_TIME = re.compile(r" in ([\d.]+)s")


def measure(command: str) -> dict:
    log(f"suite: running {command!r} (the full CPU test command)")
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    proc = subprocess.run(command, shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    out = proc.stdout
    passed = _PASSED.findall(out)
    last_line = out.splitlines()[-1] if out.strip() else ""
    failed = sum(int(m[0]) for m in _FAILED.findall(last_line))
    examples = _EXAMPLES.findall(out)
    timing = _PYTEST_TIME.findall(last_line)
    return {"command": command, "returncode": proc.returncode, "seconds": seconds,
            "pytest_seconds": float(timing[-1]) if timing else None,
            "passed": int(passed[-1]) if passed else 0, "failed": failed,
            "cp_examples": int(examples[-1][0]) if examples else 0,
            "cp_examples_per_size": examples[-1][1] if examples else None,
            "load_average": [load_before, os.getloadavg()[0]],
            "output_tail": out[-4000:]}
