"""The suite section: examples run, wall time and where the time goes in the full CPU test command.

The command runs from the repository root as a subprocess with ``--cp-summary-json`` and ``--junitxml``; its
outcome counts, pytest's own time and the CP examples per size are read from that JSON (the plugin's run
summary), and each test's seconds (setup + call + teardown, as pytest's junit report totals them: a
module-scoped pool's start and close fall to the first and last test that uses it) from the junit XML, summed
per test file (``by_file``) and listed for the slowest tests (``slowest``), not from the terminal.

In units of a fresh 2-rank ``torchrun`` case (``fresh_case_equivalents``: pytest's seconds over one fresh case's
wall seconds, both measured in this run by the throughput section) the figure is a ratio, comparable between runs
on machines of different speed or load.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from cp_harness.bench.progress import log

ROOT = Path(__file__).resolve().parents[2]


def measure(command: str) -> dict:
    log(f"suite: running {command!r} (the full CPU test command)")
    with tempfile.TemporaryDirectory(prefix="cp-harness-suite-") as folder:
        summary_path = Path(folder) / "summary.json"
        junit_path = Path(folder) / "junit.xml"
        started = time.perf_counter()
        load_before = os.getloadavg()[0]
        proc = subprocess.run(
            f"{command} --cp-summary-json {summary_path} --junitxml {junit_path}",
            shell=True,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        seconds = time.perf_counter() - started
        data = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        tests = test_seconds(junit_path) if junit_path.is_file() else {}
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
        "test_seconds_total": sum(tests.values()),
        "by_file": by_file(tests),
        "slowest": sorted(tests.items(), key=lambda item: -item[1])[:SLOWEST],
        "output_tail": proc.stdout[-4000:],
    }


SLOWEST = 25  # tests listed by name in the report


def test_seconds(junit_xml: Path) -> dict[str, float]:
    """``{"tests/x/test_y.py::test_z[id]": seconds}`` from a pytest junit XML report (setup + call + teardown)."""
    out: dict[str, float] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        name = f"{_file_of(case.get('file'), case.get('classname', ''))}::{case.get('name', '')}"
        out[name] = out.get(name, 0.0) + float(case.get("time", 0.0))
    return out


def _file_of(file: str | None, classname: str) -> str:
    """The test file of a junit testcase: its ``file`` attribute, else its dotted ``classname`` as a path (pytest
    writes ``tests.ranks.test_pool`` or ``tests.ranks.test_pool.TestClass``)."""
    if file:
        return file
    parts = classname.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py" if parts else classname


def by_file(tests: dict[str, float]) -> list[tuple[str, float, int]]:
    """``[(test file, seconds, tests)]``, the most expensive file first."""
    files: dict[str, list[float]] = {}
    for name, seconds in tests.items():
        files.setdefault(name.split("::", 1)[0], []).append(seconds)
    return sorted(((f, sum(v), len(v)) for f, v in files.items()), key=lambda row: -row[1])


def fresh_case_equivalents(suite_result: dict, throughput_result: dict | None) -> float | None:
    """pytest's seconds of the suite over one fresh 2-rank torchrun case's wall seconds, both from this run
    (``None`` without a fresh measurement)."""
    fresh = (throughput_result or {}).get("fresh")
    seconds = suite_result.get("pytest_seconds")
    if not fresh or not seconds:
        return None
    return float(seconds) / float(fresh["mean_s"]["wall"])
