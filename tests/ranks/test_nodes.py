"""A pool across nodes, played on this machine: two torchrun agents (``--nnodes 2``, c10d rendezvous, gloo, two
ranks each) as two "nodes".

- ``verify`` (the settings its command line gives for ``--nnodes 2 --world-sizes 4``) passes three cheap rows at
  CP 4, each case across both nodes, and the mesh rows with CP groups that span them;
- killing one agent mid-case (SIGKILL, as a node is lost) fails that case within the case timeout, naming the node,
  its agent and its ranks; the pool, whose agents all run here, starts again and the next case passes.

What only a real cluster shows (other hosts, NCCL, SLURM) has never run: ``docs/meshes.md``.
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import pytest

from cp_harness import options
from cp_harness.checks.meshes import MESH_IDENTITY
from cp_harness.checks.pool_selftest import POOL_SELFTEST
from cp_harness.ranks.pool import PoolConfig, RankFailure, RankPool
from cp_harness.runner import CaseRunner
from cp_harness.verify import VerifySettings, run_verify

CASE_TIMEOUT = 20.0
ARGS = {"nnodes": 2, "world_sizes": (4,), "case_timeout": CASE_TIMEOUT, "examples": 3, "shrink_seconds": 1.0,
        "rows": ("gather_sequence", "convolution_history", "shifted_cp_loss")}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    values = options.resolve(ARGS, environ={})
    settings = VerifySettings.from_options(values)
    assert settings.pool == {"nnodes": 2, "rank_order": "blocked", "case_timeout": CASE_TIMEOUT}
    pool = RankPool(PoolConfig(world_size=4, collective_timeout=8.0, log_dir=str(tmp_path_factory.mktemp("nodes")),
                               **settings.pool))
    try:
        yield settings, pool
    finally:
        pool.close()
        pool.cleanup_workdir()


def test_verify_across_two_torchrun_agents_passes_three_cheap_rows_at_cp_4(two_nodes):
    settings, pool = two_nodes
    result = run_verify(settings, pool=pool, progress_stream=io.StringIO())
    assert result.cannot_run is None, result.cannot_run
    assert pool.launcher == "torchrun" and len(pool.agents) == 2
    nodes = {rank: hello["node"] for rank, hello in pool.hello.items()}
    assert sorted(nodes.values()) == [0, 0, 1, 1], pool.hello  # two ranks on each "node"
    assert [row.name for row in result.rows] == ["inkling2.gather_sequence", "inkling2.convolution_history",
                                                 "mistral_large4.shifted_cp_loss"]
    assert result.exit_code == 0 and all(row.tally.passed == row.tally.examples >= 3 for row in result.rows)
    assert result.examples_per_world_size.get(4, 0) >= 9
    # CP groups spanning the nodes: cp x dp = 2 x 2 puts CP rank 0 on node 0 and CP rank 1 on node 1.
    runner = CaseRunner(pool.config, pool=pool)
    runner.check(MESH_IDENTITY.case(world_size=2, seed=0, mesh_layout={"dims": ["cp", "dp"], "shape": [2, 2]}))


def test_a_killed_agent_fails_the_case_naming_its_node_and_the_pool_starts_again(two_nodes):
    _, pool = two_nodes
    pool.start()
    agents, starts = pool.agents, pool.starts
    lost = [rank for rank, hello in pool.hello.items() if hello["node"] == 1]
    slow = POOL_SELFTEST.case(world_size=4, seed=0, mode="hang", fault_rank=0, hang_seconds=CASE_TIMEOUT)
    threading.Timer(1.0, os.kill, (agents[1], signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        pool.run(slow)
    elapsed = time.monotonic() - started
    message = str(failure.value)
    assert failure.value.kind == "exited" and failure.value.rank in lost, message
    assert f"torchrun, pid {agents[1]}) on node 1" in message and "is gone" in message, message
    assert f"node 1 (host {os.uname().nodename}, torchrun pid {agents[1]}): ranks {sorted(lost)}" in message, message
    assert elapsed < CASE_TIMEOUT, f"the lost node was reported after {elapsed:.1f} s"
    # Every agent runs here: the next case starts both again.
    CaseRunner(pool.config, pool=pool).check(POOL_SELFTEST.case(world_size=4, seed=1))
    assert pool.starts == starts + 1 and set(pool.agents.values()).isdisjoint(agents.values())
