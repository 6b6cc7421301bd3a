"""The suite section: examples run and wall time of the full CPU test command.

The command runs from the repository root as a subprocess with ``--cp-summary-json``; its outcome counts,
pytest's own time and the CP examples per size are read from that JSON (the plugin's run summary), not
from the terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from cp_harness.bench.progress import log

ROOT = Path(__file__).resolve().parents[2]


def measure(command: str) -> dict:
    log(f"suite: running {command!r} (the full CPU test command)")
    with tempfile.TemporaryDirectory(prefix="cp-harness-suite-") as folder:
        summary_path = Path(folder) / "summary.json"
        started = time.perf_counter()
        load_before = os.getloadavg()[0]
        proc = subprocess.run(
            f"{command} --cp-summary-json {summary_path}",
            shell=True,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        seconds = time.perf_counter() - started
        data = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    outcomes = data.get("outcomes", {})
    by_size = {int(n): v for n, v in data.get("summary", {}).get("by_size", {}).items()}
    return {
        "command": command,
        "returncode": proc.returncode,
        "seconds": seconds,
        "pytest_seconds": data.get("seconds"),
        "passed": int(outcomes.get("passed", 0)),
        "failed": int(outcomes.get("failed", 0) + outcomes.get("error", 0)),
        "cp_examples": sum(by_size.values()),
        "cp_examples_per_size": ", ".join(f"N={n}: {by_size[n]}" for n in sorted(by_size)) or None,
        "load_average": [load_before, os.getloadavg()[0]],
        "output_tail": proc.stdout[-4000:],
    }
