"""The gate's subjects in two processes at once (``tools/run.py --lanes 2``, the default): the model specs in one, the
adapters, training steps and attention subjects in the other.

One process kept 1.3 of this machine's 2 cores busy (``docs/benchmarks.md``): a real-model case runs its one-device
references on rank 0 while the case's other ranks wait. The two lanes never share a pool (``tools/pools.py`` keys
pools by kind), so each subject runs on a pool of the size and kind it would have in one process, and its verdict is
the same. Each lane verifies, judges and replays its own subjects and writes its part of the summary
(``run._gate``) to a file; the run that started the lanes merges the parts and writes the reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
# A lane is a whole gate run of its subjects and ends by itself (each case has its own timeout); this bounds the wait
# for one that does not. The longest runs measured here took 35 min (--examples 3 under load 60); the nightly's
# --examples 100 was not timed in lanes. Six hours is a GitHub-hosted job's own limit.
LANE_TIMEOUT = 6 * 3600.0


def split(subjects: list[str], lanes: int) -> list[list[str]]:
    """``subjects`` in lanes: with 2, the model specs and the rest (a lane with nothing left out); else one."""
    if lanes < 2:
        return [subjects]
    specs = [s for s in subjects if s.startswith("spec:")]
    rest = [s for s in subjects if not s.startswith("spec:")]
    return [part for part in (specs, rest) if part]


def run(common: list[str], parts: list[list[str]], reports: Path) -> list[dict]:
    """Run each of ``parts`` as ``python -m examples.automodel.tools.run COMMON --lanes 1 --part FILE SUBJECTS``, all
    at once, and return each lane's part of the summary (``run._gate``); a lane that wrote none gives one with a
    ``crashed`` line naming it and its log's tail. While they run, each subject a lane starts is printed (its
    ``verify`` command, headed by the lane); each lane's whole output is printed as it ends."""
    folder = reports / "lanes"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    lanes = []
    for i, subjects in enumerate(parts):
        part, log = folder / f"lane{i}.json", folder / f"lane{i}.log"
        part.unlink(missing_ok=True)
        command = [sys.executable, "-m", "examples.automodel.tools.run", *common, "--lanes", "1", "--part", str(part)]
        with log.open("wb") as out:
            proc = subprocess.Popen([*command, *subjects], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        lanes.append((i, subjects, proc, part, log))
        print(f"real clients: lane {i}: {len(subjects)} subjects ({', '.join(subjects)}); output: {log}", flush=True)
    try:
        return _wait(lanes, started)
    finally:  # interrupted (or a bug here): no lane outlives this run
        for _, _, proc, _, _ in lanes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait(lanes: list, started: float) -> list[dict]:
    """Wait for every lane of ``run``, printing what it starts, then its output; each lane's part of the summary."""
    done: dict[int, dict] = {}
    read = {i: 0 for i, *_ in lanes}  # how far each lane's log has been looked at for the subjects it started
    pending = list(lanes)
    while pending:
        for lane in list(pending):
            i, subjects, proc, part, log = lane
            with log.open("rb") as out:
                out.seek(read[i])
                new = out.read()
            complete = new[: new.rfind(b"\n") + 1]
            read[i] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if line.startswith("$ -m cp_harness verify") or line.startswith("real clients: skipped"):
                    print(f"[lane {i}] {line}", flush=True)
            late = time.monotonic() - started > LANE_TIMEOUT
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            pending.remove(lane)
            text = log.read_text(errors="replace")
            print(f"\n===== real clients: lane {i} ended after {time.monotonic() - started:.0f} s =====", flush=True)
            print(text, flush=True)
            if part.exists():
                done[i] = json.loads(part.read_text())
                continue
            why = f"killed after {LANE_TIMEOUT:.0f} s" if late else f"exited {proc.returncode}"
            done[i] = {
                "subjects": {},
                "skipped": {},
                "findings": [],
                "replays": [],
                "crashed": [
                    f"lane {i} ({', '.join(subjects)}): {why} without its summary; its log ends: {text[-600:]}"
                ],
            }
        time.sleep(0.5)
    return [done[i] for i in sorted(done)]
