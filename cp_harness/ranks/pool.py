"""The persistent rank pool: ranks started once, fed one case at a time.

The ranks are forked by one launcher process after it imported torch and the
implementations (``launcher="fork"``, the default with gloo), started by
``torchrun`` (``launcher="torchrun"``, the default with nccl or several nodes:
one agent per node, c10d rendezvous), or elsewhere (``launcher="external"``,
e.g. ``srun``: the pool only listens); see ``cp_harness.ranks.worker``.

``RankPool.run(case)`` sends a case description (a small JSON dict) to ranks
``0..case["world_size"]-1`` (or, for a case with a ``mesh_layout``, to the ranks
of the CP groups that run it, after asking every rank to build its world mesh;
``cp_harness.cases.meshes``) and returns their ``RankOutput``s, or raises
``RankFailure`` saying which rank failed, on which case, and how (its
traceback, its exit, or the stack it was stuck in). After a failure that may
have left ranks inside a collective, the pool is torn down and the next
``run`` starts a fresh one, so one bad case never poisons the next.

``RankPool`` is the façade over three parts: ``lifecycle.RankProcesses`` (the
processes), ``tickets.TicketQueue`` (the cases in flight) and
``diagnosis.diagnose`` (which rank failed, and how).
"""

from __future__ import annotations

import socket

from cp_harness.ranks.lifecycle import RankProcesses
from cp_harness.ranks.outputs import PoolConfig, PoolLost, RankFailure, RankOutput
from cp_harness.ranks.tickets import Ticket, TicketQueue

__all__ = ["PoolConfig", "PoolLost", "RankFailure", "RankOutput", "RankPool", "Ticket"]


class RankPool:
    """A long-lived job of ranks that run cases on request (see module docstring)."""

    def __init__(self, config: PoolConfig | None = None):
        self.config = config or PoolConfig()
        self._processes = RankProcesses(self.config)
        self._queue = TicketQueue(self, self._processes)

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._processes.running

    def start(self) -> None:
        """Start the ranks and wait until every one has connected (bounded by ``start_timeout``).

        The fork launcher picks its rendezvous port by binding port 0 and releasing it for rank 0's store;
        if another process took the port in between (the log says so), the start is tried once more.
        """
        self._processes.start()

    def close(self, graceful: bool = True) -> None:
        """Stop every rank and the launcher; leaves no process behind.

        ``graceful``: ask the ranks to leave and give them 5 s; otherwise (after a
        failure, when ranks may be stuck) kill at once. Cases still in flight are
        dropped: collecting them raises ``RuntimeError``.
        """
        self._queue.drop_all()
        self._processes.close(graceful)

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cleanup_workdir(self) -> None:
        self._processes.cleanup_workdir()

    def log_tail(self, limit: int = 4000) -> str:
        return self._processes.log_tail(limit)

    @property
    def starts(self) -> int:
        """How many times the ranks were started (a failure tears them down; the next case starts them again)."""
        return self._processes.starts

    @property
    def hello(self) -> dict[int, dict]:
        """Each rank's hello message (its device, torch version, pid, ...), from the latest start."""
        return self._processes.hello

    @property
    def pids(self) -> dict[int, int]:
        """Process id of each rank (for checks that nothing is left behind)."""
        return self._processes.pids

    @property
    def launcher(self) -> str:
        """``"fork"`` or ``"torchrun"`` (``PoolConfig.launcher``, else by backend)."""
        return self._processes.launcher

    @property
    def launcher_pid(self) -> int | None:
        """Process id of the launcher (torchrun, or the process that forked the ranks; node 0's of several)."""
        return self._processes.launcher_pid

    @property
    def fork_server_pid(self) -> int | None:
        """Process id of the fork launcher's server (``cp_harness.ranks.fork_server``), which outlives each start
        and ends when the pool is closed; ``None``: none runs (another launcher, or the pool is closed)."""
        server = self._processes.server
        return server.proc.pid if server is not None and server.alive else None

    @property
    def _fork_server_pipe(self):
        """The pipe the fork server reads its requests from (tests close it to play a test process that died)."""
        server = self._processes.server
        assert server is not None and server.proc.stdin is not None
        return server.proc.stdin

    @property
    def agents(self) -> dict[int, int]:
        """Node -> process id of its launcher, for the nodes this process started."""
        return {node: proc.pid for node, proc in self._processes.agents.items()}

    def remote_commands(self) -> dict[int, str]:
        """Node -> the command to run on it, for every node this process does not start (``node_rank`` given)."""
        return self._processes.remote_commands()

    @property
    def _socks(self) -> dict[int, socket.socket]:
        """The connection to each rank (tests close them to play a test process that was killed)."""
        return self._processes.socks

    # ------------------------------------------------------------------ running cases
    def run(self, case: dict, *, timeout: float | None = None) -> list[RankOutput]:
        """Run ``case`` on its ranks (``0..case["world_size"]-1``, or its CP groups); returns their outputs in pool
        rank order (``RankOutput.rank``; on a world mesh ``cp_rank`` and ``group`` say where each rank is).

        Raises ``RankFailure`` (and restarts the pool on the next call) when a
        rank raises unexpectedly, exits, hangs past ``timeout`` seconds
        (default ``config.case_timeout``) or answers out of protocol.
        ``run`` is ``collect(submit(case))``.
        """
        return self.collect(self.submit(case, timeout=timeout))

    def submit(self, case: dict, *, timeout: float | None = None) -> Ticket:
        """Send ``case`` to its ranks and return at once; ``collect(ticket)`` waits for the outputs.

        Several cases may be in flight: each rank runs its requests in the
        order they were sent (one socket, FIFO), so case ``k + 1`` is queued
        on the ranks while the test process judges case ``k``. A rank failure
        fails only the case it happened in (``RankFailure`` from ``collect``);
        the cases sent after it are sent again to the fresh pool, so they get
        outputs of a healthy pool, never a verdict poisoned by the failure.
        """
        return self._queue.submit(case, self.config.case_timeout if timeout is None else float(timeout))

    def collect(self, ticket: Ticket) -> list[RankOutput]:
        """The outputs of a submitted case, in rank order (``RankFailure`` as in ``run``).

        Cases are collected in the order they were submitted: collecting a
        later ticket first collects (and keeps) the earlier ones. Every wait is
        bounded by the ticket's timeout, counted from when its collection starts.
        """
        return self._queue.collect(ticket)

    @property
    def in_flight(self) -> int:
        """Cases submitted and not collected yet."""
        return len(self._queue)
