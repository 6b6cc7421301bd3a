"""The fork launcher's server (``cp_harness.ranks.fork_server``): a pool imports once and every start after a fault
forks a fresh launcher from those imports; what a start looks like to the pool does not change."""

from __future__ import annotations

import os
import time

import pytest
from test_pool_faults import FIXTURES, proc_state, processes_mentioning

from cp_harness.ranks.pool import PoolConfig, RankFailure, RankPool

OK = {"check": "pool_selftest", "world_size": 2, "seed": 0, "mode": "ok"}


def _gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if proc_state(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def pool(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p))
    pool = RankPool(PoolConfig(world_size=2, impl="cp_impl", log_dir=str(tmp_path), collective_timeout=20.0))
    yield pool
    pool.close()


def test_a_start_after_a_fault_forks_a_new_launcher_from_the_same_server_until_the_environment_changes(
    pool, monkeypatch
):
    pool.start()
    server, launcher, ranks = pool.fork_server_pid, pool.launcher_pid, dict(pool.pids)
    assert server is not None and launcher not in (None, server)
    assert {pool.hello[r]["launcher_pid"] for r in ranks} == {launcher}  # the ranks' parent is the start's launcher
    with pytest.raises(RankFailure, match="rank 1 raised"):
        pool.run({**OK, "mode": "raise", "fault_rank": 1})
    assert not _gone([launcher, *ranks.values()]), "the failed start's launcher and ranks are gone"
    assert pool.fork_server_pid == server  # ... and the server is not
    assert len(pool.run(OK)) == 2
    assert pool.starts == 2 and pool.fork_server_pid == server
    assert pool.launcher_pid != launcher and set(pool.pids.values()).isdisjoint(ranks.values())

    monkeypatch.setenv("CP_HARNESS_TEST_FORK_SERVER", "1")  # what a start imports may depend on it
    with pytest.raises(RankFailure):
        pool.run({**OK, "mode": "raise", "fault_rank": 0})
    assert len(pool.run(OK)) == 2
    second = pool.fork_server_pid
    assert second not in (None, server) and proc_state(second)
    assert not _gone([server]), "the server of the old environment was ended"
    pool.close()
    assert pool.fork_server_pid is None and not _gone([second])


def test_an_implementation_that_does_not_import_fails_the_start_with_its_traceback(tmp_path):
    pool = RankPool(PoolConfig(world_size=2, impl="no_such_module_for_the_fork_server", log_dir=str(tmp_path)))
    try:
        with pytest.raises(RuntimeError) as failure:
            pool.start()
    finally:
        pool.close()
    message = str(failure.value)
    assert message.startswith("rank pool did not start: the fork launcher exited (exit code 1)"), message
    assert "No module named 'no_such_module_for_the_fork_server'" in message, message
    deadline = time.monotonic() + 10
    while (left := processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"the failed start left processes behind: {left}"
