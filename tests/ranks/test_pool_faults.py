"""Rank faults and reproduction: every failure is fast, says why, reproduces, and leaves nothing behind.

A small pool of its own (3 ranks, short timeouts) runs the ``pool_selftest``
check with each injected fault: a rank that raises, one that exits abruptly,
one that hangs (its peers wait inside a collective for it) and one that returns
a tensor of the wrong shape. Each must fail the case within the configured
timeout (plus the bounded teardown), naming the rank, the case and what
happened; a fault that may have left ranks inside a collective tears the pool
down (no process of it survives) and the next case passes on a fresh one.

The same pool's ranks load a deliberately broken implementation
(``tests/fixtures/broken_rel_loss_scale``: its shifted loss lacks the factor
``N``; ``pool_selftest`` never calls it), so that a loss case fails as a
failing test would; the ``reproduce:`` line of that failure, run as a shell
command in a fresh process, must report the same failing tensors with the same
values and leave no process behind. That command runs with
``--launcher=torchrun`` (the fault pool's ranks are forked): the way the nccl
pool starts its ranks must give the same values bit for bit, so that path
stays exercised on CPU. (One pool for both saves a pool start.)
Finally, a pool whose owner disappears (the test process killed) must exit on
its own.

The tests run in file order on one module-scoped pool. Nothing here depends on how loaded the machine is: the
timeouts a fault must trigger fire in a state that is already there (a rank that sleeps for an hour, a start
whose other ranks are ready), and those that must not fire (healthy cases, starts) are generous.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cp_harness.cases.descriptions import canonical
from cp_harness.ranks import lifecycle
from cp_harness.ranks.pool import PoolConfig, RankPool
from cp_harness.runner import CaseRunner

CASE_TIMEOUT = 4.0  # the pool's, for the fault cases: the hang fault must end by it
COLLECTIVE_TIMEOUT = 2.0  # below the case timeout: peers of a stuck rank give up first and point at it
HEALTHY_CASE_TIMEOUT = 120.0  # a healthy case's own: it must not fire, however busy the machine
# Seconds a start may take where the start timeout must not fire: the ranks' store waits as long (a start on two
# busy cores took 4-60 s, docs/benchmarks.md); where it must fire, the test's clock makes it fire (StartClock).
START_TIMEOUT = 180.0
# Teardown after a failure is bounded by the pool: 5 s for the launcher to report an exit, then SIGTERM/SIGKILL
# with 3 s waits, and 0.5 s for stack dumps.
TEARDOWN_ALLOWANCE = 8.0
WORLD = 3
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BROKEN_IMPL = "broken_rel_loss_scale"
LOSS_CASE = {"check": "shifted_cp_loss", "world_size": 2, "seed": 21, "model": "mistral_large4", "dtype": "float64",
             "vocab": 7, "batch": {"format": "thd", "seq_len": 10, "docs": [[[4, 5], [5, 5]]]}}


def healthy(runner: CaseRunner) -> None:
    """A healthy case passes on ``runner``'s pool (within a generous timeout: only a fault may fail it)."""
    runner.check(selftest(), timeout=HEALTHY_CASE_TIMEOUT)


def selftest(mode: str = "ok", fault_rank: int = 0) -> dict:
    case = {"check": "pool_selftest", "world_size": WORLD, "seed": 0, "mode": mode}
    if mode != "ok":
        case["fault_rank"] = fault_rank
    return case


def proc_state(pid: int) -> str | None:
    """The state letter of a process that still runs, ``None`` when it is gone.

    A zombie (``Z``) has exited: it is only an exit status waiting for its parent to collect it.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


def processes_mentioning(marker: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``marker`` (every rank and launcher of our pools does)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append((int(entry), cmdline[:200]))
    return found


class Tracker:
    """Records every process a pool started, to check later that none survived."""

    def __init__(self, runner: CaseRunner, marker: str):
        self.runner, self.marker, self.pids = runner, marker, {}

    def record(self) -> None:
        pool = self.runner.pool
        if pool.running:
            self.pids.update({pid: f"rank {rank}" for rank, pid in pool.pids.items()})
            self.pids[pool.launcher_pid] = "launcher"

    def survivors(self, pids: dict[int, str] | None = None) -> list[str]:
        """What is left of the starts in ``pids`` (default: every start recorded), and any process of the pool's
        but its fork server while the pool is open (it outlives a start by design; closing the pool ends it)."""
        pids = self.pids if pids is None else pids
        left = [f"{what} (pid {pid}, state {proc_state(pid)})" for pid, what in pids.items() if proc_state(pid)]
        server = self.runner.pool.fork_server_pid
        left += [f"pid {pid}: {cmd}" for pid, cmd in processes_mentioning(self.marker) if pid != server]
        return left

    def wait_gone(self, pids: dict[int, str] | None = None, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := self.survivors(pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fault-pool")
    with pytest.MonkeyPatch.context() as mp:
        # The ranks import the implementation by module name: the fixtures folder must be on their path.
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p))
        mp.setenv("CP_HARNESS_ERROR_MAP_DIR", str(log_dir / "error-maps"))
        runner = CaseRunner(PoolConfig(world_size=WORLD, impl=BROKEN_IMPL, case_timeout=CASE_TIMEOUT,
                                       collective_timeout=COLLECTIVE_TIMEOUT, start_timeout=START_TIMEOUT,
                                       log_dir=str(log_dir)))
        tracker = Tracker(runner, str(log_dir))
        try:
            yield tracker
        finally:
            runner.close()
            assert not tracker.wait_gone(), f"processes left behind: {tracker.survivors()}"


FAULTS = [
    # mode, faulty rank, failure kind, what the message must say happened
    ("raise", 1, "raised", "injected fault on rank 1"),
    ("exit", 2, "exited", "exited while running the case"),
    ("hang", 0, "hung", "did not answer within"),
]


@pytest.mark.parametrize("mode,fault_rank,kind,what", FAULTS, ids=[f[0] for f in FAULTS])
def test_rank_fault_fails_the_case_and_the_pool_recovers(faulty, mode, fault_rank, kind, what):
    runner = faulty.runner
    healthy(runner)  # a healthy pool before the fault
    faulty.record()
    old = dict(runner.pool.pids)
    old_pids = {pid: f"rank {rank}" for rank, pid in old.items()} | {runner.pool.launcher_pid: "launcher"}
    starts = runner.pool.starts
    case = selftest(mode, fault_rank)

    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        runner.check(case)
    elapsed = time.monotonic() - started

    message = str(failure.value)
    assert f"rank {fault_rank} {kind}" in message, message  # the rank and what happened to it ...
    assert what in message, message
    assert canonical(case) in message, message  # ... the case, and how to run it again
    assert "reproduce: python -m cp_harness run-case" in message, message
    if mode == "hang":  # where the stuck rank was
        assert f"--- stack of rank {fault_rank} ---" in message and "pool_selftest.py" in message, message
    assert elapsed < CASE_TIMEOUT + TEARDOWN_ALLOWANCE, f"the {mode} fault took {elapsed:.1f} s to fail the case"
    # The broken pool is gone, every process of it ...
    assert not runner.pool.running
    assert not faulty.wait_gone(old_pids, timeout=5.0), f"survivors of the torn-down pool: {faulty.survivors(old_pids)}"
    # ... and the next case passes on a fresh one.
    healthy(runner)
    faulty.record()
    assert runner.pool.starts == starts + 1
    assert set(runner.pool.pids.values()).isdisjoint(old.values())


def test_wrong_shape_fails_the_report_and_keeps_the_pool(faulty):
    runner = faulty.runner
    healthy(runner)
    faulty.record()
    starts = runner.pool.starts
    case = selftest("wrong_shape", 1)
    with pytest.raises(AssertionError) as failure:
        runner.check(case)
    message = str(failure.value)
    assert "FAIL sum@rank1" in message and "shape [2] but expected [1]" in message, message
    assert canonical(case) in message, message
    # A wrong answer is not a fault of the pool: the same ranks run the next case.
    healthy(runner)
    assert runner.pool.starts == starts


def failing_lines(text: str) -> list[str]:
    return sorted(line.strip() for line in text.splitlines() if line.strip().startswith(("FAIL ", "also index")))


def test_printed_reproduction_command_reproduces_the_failure(faulty, tmp_path):
    runner = faulty.runner
    with pytest.raises(AssertionError) as failure:
        runner.check(LOSS_CASE)  # the broken loss: what a failing test prints
    message = str(failure.value)
    expected = failing_lines(message)
    assert any("loss (mean over ranks)" in line for line in expected), message

    command = next(line for line in message.splitlines() if line.startswith("reproduce: "))[len("reproduce: "):]
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "cp_harness", "run-case"] and BROKEN_IMPL in argv, command
    argv[0] = sys.executable  # "python" of the environment that ran the test
    # Under torchrun (the nccl pool's launcher; the failure above ran on forked ranks): the same failing
    # values from both ways of starting the ranks.
    argv.insert(4, "--launcher=torchrun")
    session = tmp_path / "session"  # the command's own pool lives under here (TMPDIR)
    session.mkdir()
    proc = subprocess.run(argv, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(session)), capture_output=True,
                          text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert failing_lines(proc.stdout) == expected, output
    # Its session is over: nothing of its pool may survive.
    deadline = time.monotonic() + 10
    while (left := processes_mentioning(str(session))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"the reproduction run left processes behind: {left}"


def test_pool_exits_by_itself_when_its_owner_disappears(faulty):
    """What happens when the test process is killed: the ranks see their connection close and leave."""
    runner = faulty.runner
    healthy(runner)
    faulty.record()
    pool = runner.pool
    pids = {pid: f"rank {rank}" for rank, pid in pool.pids.items()} | {pool.launcher_pid: "launcher"}
    server = pool.fork_server_pid
    assert server is not None
    pids[server] = "fork server"
    for sock in pool._socks.values():  # what the kernel does to the sockets and pipes of a killed process
        sock.close()
    pool._fork_server_pipe.close()
    left = faulty.wait_gone(pids, timeout=15.0)
    runner.close()  # reaps the launcher (our child) and forgets the pool
    assert not left, f"an abandoned pool left processes behind: {left}"


def test_a_rank_that_fails_at_start_is_named_with_its_own_traceback(tmp_path, monkeypatch):
    """One rank of eight raises while it loads the implementation: the start error shows that rank's traceback
    first, not only the log tail of the ranks the launcher ended after it (signal 9)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p))
    world, failing = 8, 2  # failing: tests/fixtures/fault_start_rank.FAILING_RANK
    pool = RankPool(PoolConfig(world_size=world, impl="fault_start_rank", collective_timeout=COLLECTIVE_TIMEOUT,
                               start_timeout=START_TIMEOUT, log_dir=str(tmp_path)))
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as failure:
            pool.start()
        elapsed = time.monotonic() - started
        message = str(failure.value)
    finally:
        pool.close()
    # Reported when the rank exited, not when the start timeout fired: fast, whatever the load.
    assert message.startswith("rank pool did not start: the fork launcher exited (exit code"), message
    head = message.split("fork log tail:")[0]  # what comes before the log's tail
    assert f"rank {failing} failed first during the start: it exited with 1" in head, message
    assert f"--- traceback of rank {failing} ---" in head, message
    assert f"RuntimeError: injected start fault: rank {failing} cannot load mistral_large4" in head, message
    assert "_refuse_to_load" in head, message  # the frame that raised, from the rank's own traceback
    assert elapsed < START_TIMEOUT, f"a start fault took {elapsed:.1f} s to report"
    # the failed start left no process behind
    deadline = time.monotonic() + 10
    while (left := processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"the failed start left processes behind: {left}"


class StartClock:
    """The start's clock (``time`` as ``cp_harness.ranks.lifecycle`` sees it) for a start timeout that must fire
    in a given state: real time until every rank but ``hanging`` is ready, ``hanging`` said it is loading the
    implementation and its log says it stopped there (the pool's own ``socks``, ``progress`` and rank logs: what
    the error must report), then ``START_TIMEOUT`` s later. So the pool's start timeout fires as soon as that
    state is reached, however long the ranks took on a busy machine (a fixed 9 s timeout fired there with 0 of 4
    ranks ready), and by real time only if it is never reached."""

    def __init__(self, processes: lifecycle.RankProcesses, hanging: int):
        self.processes, self.hanging, self.skipped = processes, hanging, 0.0

    def _in_state(self) -> bool:
        procs = self.processes
        others = set(range(procs.config.world_size)) - {self.hanging}
        loading = procs.progress.get(self.hanging, {}).get("what", "")
        return (set(procs.socks) == others and loading.startswith("in the process group; loading")
                and "stops here" in (procs.rank_log_tail(self.hanging, 1) or ""))

    def monotonic(self) -> float:
        if not self.skipped and self._in_state():
            self.skipped = START_TIMEOUT
        return time.monotonic() + self.skipped

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_a_pool_that_does_not_come_up_names_the_timeout_that_fired_and_where_each_rank_stopped(tmp_path, monkeypatch):
    """Rank 1 of four never finishes loading the implementation: the pool's start timeout fires, and the error says
    so (not a store's or a collective's), lists the ranks that are not ready, what each was doing and the last line
    it wrote (its own log), and leaves no process behind."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p))
    pool = RankPool(PoolConfig(world_size=4, impl="fault_start_hang", collective_timeout=COLLECTIVE_TIMEOUT,
                               start_timeout=START_TIMEOUT, log_dir=str(tmp_path)))
    monkeypatch.setattr(lifecycle, "time", StartClock(pool._processes, hanging=1))  # fault_start_hang.HANGING_RANK
    try:
        with pytest.raises(RuntimeError) as failure:
            pool.start()
        message = str(failure.value)
    finally:
        pool.close()
    head = message.split("fork log tail:")[0]
    assert head.startswith(f"rank pool did not start: the pool's start timeout {START_TIMEOUT:g} s fired with 3 of 4 "
                           "ranks ready"), message
    assert "ranks that never connected" not in head, message
    assert "ranks connected but not ready: 1\n" in head, message
    assert "rank 1 (pid " in head and "in the process group; loading fault_start_hang" in head, message
    assert "its last line: fault_start_hang: rank 1 stops here, loading mistral_large4" in head, message
    deadline = time.monotonic() + 10
    while (left := processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"the failed start left processes behind: {left}"
