"""A pool across nodes, played on this machine: two torchrun agents (``--nnodes 2``, c10d rendezvous, gloo, two
ranks each) as two "nodes".

- ``verify`` (the settings its command line gives for ``--nnodes 2 --world-sizes 4``) passes three cheap rows at
  CP 4, each case across both nodes, and the mesh rows with CP groups that span them;
- killing one agent mid-case (SIGKILL, as a node is lost) fails that case within the case timeout, naming the node,
  its agent and its ranks; the pool, whose agents all run here, starts again and the next case passes.

The two-agent tests run in the nightly job (marked ``nightly``: they cost the most CPU of any pair in the default
command and catch no defect fixture); the ``srun`` play and the layout errors run in every command.

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
from cp_harness.ranks.outputs import RankFailureKind
from cp_harness.ranks.pool import PoolConfig, RankFailure, RankPool
from cp_harness.runner import CaseRunner
from cp_harness.verify import VerifySettings, run_verify

# Long: nothing in a passing test waits for it (the lost node is reported within a second or two of the kill), and
# a loaded machine must not make the healthy cases of the two-node verify run reach it.
CASE_TIMEOUT = 60.0
ARGS = {"nnodes": 2, "world_sizes": (4,), "case_timeout": CASE_TIMEOUT, "examples": 3, "shrink_seconds": 1.0,
        "rows": ("gather_sequence", "convolution_history", "shifted_cp_loss")}


# Each start of the two agents is six interpreters that import torch (two agents, four ranks): about 20 s of the
# 2-core CPU for the two tests, the most any pair of tests in the default command cost (issue 36). They catch no
# defect fixture (tests/project/test_nightly_scope.py), so they run in the nightly job, beside its two-node run.
TWO_AGENTS = pytest.mark.nightly(reason="two torchrun agents as two nodes (about 20 s of CPU)")


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


@TWO_AGENTS
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


@TWO_AGENTS
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
    assert failure.value.kind is RankFailureKind.EXITED and failure.value.rank in lost, message
    assert f"torchrun, pid {agents[1]}) on node 1" in message and "is gone" in message, message
    assert f"node 1 (host {os.uname().nodename}, torchrun pid {agents[1]}): ranks {sorted(lost)}" in message, message
    assert elapsed < CASE_TIMEOUT, f"the lost node was reported after {elapsed:.1f} s"
    # Every agent runs here: the next case starts both again.
    CaseRunner(pool.config, pool=pool).check(POOL_SELFTEST.case(world_size=4, seed=1))
    assert pool.starts == starts + 1 and set(pool.agents.values()).isdisjoint(agents.values())


def test_ranks_started_elsewhere_by_srun_connect_to_the_pool_that_listens(tmp_path):
    """``--launcher external``: the pool starts nothing and listens; each task ``srun`` starts runs the command
    ``python -m cp_harness node --launcher external`` gives, with SLURM's environment (played here: SLURM_PROCID,
    SLURM_NTASKS, SLURM_NODEID for two tasks on two "nodes"), and becomes one rank. A real ``srun`` has never
    run this (``scripts/slurm/verify_two_nodes.sbatch``)."""
    import shlex
    import socket
    import subprocess
    import sys

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    listen, store = f"127.0.0.1:{free()}", free()
    printed = subprocess.run([sys.executable, "-m", "cp_harness", "node", "--launcher", "external", "--listen", listen,
                              "--nnodes", "2", "--world-sizes", "2", "--print-only"],
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    argv = shlex.split(printed.stdout)
    assert argv[:3] == ["python", "-m", "cp_harness.ranks.worker"] and f"--connect={listen}" in argv, argv
    runner = CaseRunner(PoolConfig(world_size=2, launcher="external", nnodes=2, listen=listen, case_timeout=30,
                                   collective_timeout=10, log_dir=str(tmp_path)))
    tasks = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID=str(rank),
                   SLURM_NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store))
        tasks.append(subprocess.Popen([sys.executable, *argv[1:]], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    try:
        runner.check(MESH_IDENTITY.case(world_size=2, seed=0))
        assert {r: (h["launcher"], h["node"]) for r, h in runner.pool.hello.items()} == {0: ("slurm", 0),
                                                                                        1: ("slurm", 1)}
    finally:
        runner.close()
        codes = [task.wait(timeout=30) for task in tasks]
    assert codes == [0, 0], codes  # they left on the pool's shutdown message


@pytest.mark.parametrize(("args", "says"), [
    (["--nnodes", "3", "--world-sizes", "4"], "nnodes=3: the 4 ranks must split evenly over the nodes"),
    (["--nnodes", "2", "--node-rank", "1", "--world-sizes", "4"], "give --listen HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "1", "--world-sizes", "4", "--listen", "127.0.0.1:29999"],
     "give --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--launcher", "fork", "--world-sizes", "4"], "launcher fork starts ranks on this machine only"),
])
def test_a_node_layout_that_cannot_work_stops_verify_before_any_rank_starts(capsys, args, says):
    from cp_harness.__main__ import main

    assert main(["verify", *args, "--examples", "1"]) == 2
    err = capsys.readouterr().err
    assert says in err, err
