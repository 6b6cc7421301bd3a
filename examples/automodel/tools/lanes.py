"""The gate's subjects in two processes at once (``tools/run.py --lanes 2``, the default).

One process kept 1.3 of this machine's 2 cores busy (``docs/benchmarks.md``): a real-model case runs its one-device
references on rank 0 while the case's other ranks wait. Each lane is the gate run on every subject, but a lane runs a
group of subjects only once it has claimed the group (``claim``: a file created in a folder both lanes share, so one
lane gets each). A group is the subjects of one pool (``tools/pools.py`` keys pools by kind and size: the adapters and
attention subjects, the training steps, the model specs of each pool size): the lanes never start the same pool twice,
each subject runs on a pool of the size and kind it would have in one process, and its verdict is the same. The
groups are claimed in order of their estimated cost (``group_order``), so the lane that is free takes the next
largest: the lanes end close together whatever a group's real cost on the machine. Each lane verifies, judges and
replays what it claimed and writes its part of the summary (``run._gate``) to a file; the run that started the lanes
merges the parts and writes the reports.
"""

from __future__ import annotations

import json
import os
import shutil
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


# Seconds one subject of each kind took in a clean clone's real_clients --examples 10 (docs/benchmarks.md, 16:03
# UTC 2026-12-05): the order in which lanes claim groups, largest first; only the order matters.
KIND_SECONDS = {"spec": 29.0, "training": 33.0, "adapter": 5.0, "attention": 1.0}


def group_order(groups: dict[tuple, list[str]]) -> list[tuple]:
    """The pool keys of ``groups`` (key -> its subjects), largest estimated cost first (ties: in key order)."""
    cost = {key: sum(KIND_SECONDS.get(s.split(":", 1)[0], 10.0) for s in subjects) for key, subjects in groups.items()}
    return sorted(groups, key=lambda key: (-cost[key], key))


def claim(folder: Path, what: str, lane: int) -> bool:
    """Whether this lane gets ``what`` (a group or a subject): the first lane to create its file in ``folder``."""
    try:
        fd = os.open(folder / what.replace("/", "_").replace(":", "_"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(lane).encode())
    os.close(fd)
    return True


def claimed_by(folder: Path, lane: int) -> list[str]:
    """What lane ``lane`` claimed (the names of its claim files)."""
    return sorted(p.name for p in folder.glob("*") if p.read_text() == str(lane)) if folder.is_dir() else []


def run(common: list[str], subjects: list[str], reports: Path, lanes: int = 2) -> list[dict]:
    """Run ``lanes`` lanes, each ``python -m examples.automodel.tools.run COMMON --lanes 1 --part FILE --claims DIR
    SUBJECTS`` (module docstring), all at once, and return each lane's part of the summary (``run._gate``); a lane that
    wrote none gives one with a ``crashed`` line naming it, what it had claimed and its log's tail. While they run,
    each subject a lane starts is printed (its ``verify`` command, headed by the lane); each lane's whole output is
    printed as it ends."""
    folder = reports / "lanes"
    folder.mkdir(parents=True, exist_ok=True)
    claims = folder / "claims"
    shutil.rmtree(claims, ignore_errors=True)
    claims.mkdir()
    started = time.monotonic()
    running = []
    for i in range(lanes):
        part, log = folder / f"lane{i}.json", folder / f"lane{i}.log"
        part.unlink(missing_ok=True)
        command = [sys.executable, "-m", "examples.automodel.tools.run", *common, "--lanes", "1", "--part", str(part)]
        command += ["--claims", str(claims), "--lane", str(i)]
        with log.open("wb") as out:
            proc = subprocess.Popen([*command, *subjects], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        running.append((i, claims, proc, part, log))
        print(f"real clients: lane {i} of {lanes}, claiming groups of the {len(subjects)} subjects; output: {log}",
              flush=True)  # fmt: skip
    try:
        return _wait(running, started)
    finally:  # interrupted (or a bug here): no lane outlives this run
        for _, _, proc, _, _ in running:
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
            i, claims, proc, part, log = lane
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
                    f"lane {i} (claimed: {', '.join(claimed_by(claims, i)) or 'nothing'}): {why} without its "
                    f"summary; its log ends: {text[-600:]}"
                ],
            }
        time.sleep(0.5)
    return [done[i] for i in sorted(done)]
