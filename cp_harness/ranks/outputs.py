"""Plain data of the rank pool: what a rank returned, how a case failed, how to start the pool.

Also the one place where a rank's reply message is decoded into a ``RankOutput``
(``decode_reply``); the request messages the pool sends are built here too, so
that the pool side of the protocol reads in one file.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from cp_harness.judging.verdicts import StrKind


@dataclasses.dataclass
class RankOutput:
    """What one rank returned for one case."""

    rank: int
    ok: bool
    info: dict[str, Any]
    tensors: dict[str, np.ndarray]
    comm: list[dict[str, Any]]
    seconds: float
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    called: list[str] = dataclasses.field(default_factory=list)  # documented functions the case called (coverage)
    # time.monotonic() on the rank when it took the case and when it had its reply ready, and here when the
    # reply was decoded (one machine, one clock): for the pool's transport figures only.
    started_at: float | None = None
    finished_at: float | None = None
    received_at: float | None = None
    # ``rank`` is the pool (global) rank; on a case with a ``mesh_layout`` the rank's place in its CP group:
    cp_rank: int | None = None
    group: int | None = None


class RankFailureKind(StrKind):
    """How a rank failed a case (``RankFailure.kind``); a case's problem then has the kind ``"rank <this>"``
    (``cp_harness.judging.verdicts.ProblemKind.of_rank_failure``)."""

    RAISED = "raised"  # an exception the case did not expect
    EXITED = "exited"  # the process ended (or its node was lost) before it replied
    HUNG = "hung"  # no reply within the case's timeout
    PROTOCOL = "protocol"  # a reply the pool could not read as one


class RankFailure(AssertionError):
    """A rank raised unexpectedly, exited, hung or broke the protocol while running a case.

    ``rank`` is the first rank that failed, ``kind`` a ``RankFailureKind`` (its string value is accepted and
    converted); ``outputs`` holds whatever the other ranks returned.
    """

    def __init__(
        self, message: str, *, rank: int | None, kind: RankFailureKind | str, case: dict, outputs: list[RankOutput]
    ):
        super().__init__(message)
        self.rank, self.kind, self.case, self.outputs = rank, RankFailureKind(kind), case, outputs


# The start's deadline grows with the pool: each rank is a process to schedule, a store client to accept and,
# forked, a copy of the launcher's pages to touch (on 2 cores a 64-rank start took 4-60 s, by load).
START_BASE_S = 60.0
START_PER_RANK_S = 3.0
LAUNCHERS = ("fork", "torchrun", "external")


@dataclasses.dataclass
class PoolConfig:
    """How to start the pool.

    ``world_size``: ranks started (cases may use any size up to it).
    ``case_timeout``: seconds one case may take on the ranks.
    ``collective_timeout``: seconds a rank's collective waits for its peers.
    ``start_timeout``: seconds for every rank to come up (and for the ranks' store to see every rank join);
    ``None``: ``START_BASE_S + START_PER_RANK_S * world_size``.
    ``launcher``: ``"fork"`` (one process imports, then forks the ranks), ``"torchrun"`` or ``"external"``
    (start nothing: the ranks are started elsewhere, e.g. by ``srun``, and connect to ``listen``); ``None``
    picks fork for gloo on one node and torchrun for nccl or several nodes.
    ``preload``: model spec modules the fork launcher imports once, before it forks (the real-model rows).
    ``nnodes``, ``node_rank``, ``rdzv_endpoint``: torchrun's node layout (c10d rendezvous): ``world_size //
    nnodes`` ranks per node; ``node_rank`` is the one node whose agent this process starts (``None``: every
    node's agent, all on this machine, e.g. to test the multi-node path on one); ``rdzv_endpoint`` the
    rendezvous ``HOST:PORT`` (``None``: this machine, a free port).
    ``listen``: ``HOST:PORT`` this process accepts the ranks on (``None``: 127.0.0.1, a free port).
    ``rank_order``: ``"blocked"`` (the launcher's numbering) or ``"cyclic"`` (rank ``r`` on node ``r % nnodes``).
    """

    world_size: int = 8
    backend: str = "gloo"
    launcher: str | None = None
    impl: str = "cp_impl"
    case_timeout: float = 60.0
    collective_timeout: float = 30.0
    start_timeout: float | None = None
    python: str = sys.executable
    log_dir: str | None = None
    preload: tuple[str, ...] = ()
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    listen: str | None = None
    rank_order: str = "blocked"

    def __post_init__(self) -> None:
        if self.launcher is not None and self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}: choose one of {', '.join(LAUNCHERS)}")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(
                f"nnodes={self.nnodes}: the {self.world_size} ranks must split evenly over the nodes "
                f"(give world sizes whose largest is a multiple of --nnodes)"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank}: give 0..{self.nnodes - 1} (--node-rank)")
        if self.nnodes > 1 and self.resolved_launcher == "fork":
            raise ValueError(
                "launcher fork starts ranks on this machine only: with --nnodes > 1 use torchrun "
                "(the default) or external (srun)"
            )
        if self.rank_order not in ("blocked", "cyclic"):
            raise ValueError(f"rank_order={self.rank_order!r}: choose blocked or cyclic")

    @property
    def resolved_launcher(self) -> str:
        """``launcher``, else: torchrun for nccl or several nodes, fork otherwise."""
        if self.launcher is not None:
            return self.launcher
        return "torchrun" if self.backend == "nccl" or self.nnodes > 1 else "fork"

    @property
    def start_seconds(self) -> float:
        """The start's deadline (``start_timeout``, else grown with the rank count)."""
        if self.start_timeout is not None:
            return float(self.start_timeout)
        return START_BASE_S + START_PER_RANK_S * self.world_size

    @property
    def start_timeout_text(self) -> str:
        """How the start's deadline was set, for the message of a start that fails."""
        if self.start_timeout is not None:
            return f"start timeout {self.start_seconds:g} s"
        return (
            f"start timeout {self.start_seconds:.0f} s = {START_BASE_S:.0f} s + {START_PER_RANK_S:.0f} s x "
            f"{self.world_size} ranks"
        )

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_nodes(self) -> tuple[int, ...]:
        """The nodes whose launcher this process starts (none with the external launcher)."""
        if self.resolved_launcher == "external":
            return ()
        return tuple(range(self.nnodes)) if self.node_rank is None else (self.node_rank,)

    @property
    def restartable(self) -> bool:
        """Whether this process can start every rank again after a failure (it launches every node)."""
        return len(self.local_nodes) == self.nnodes


class PoolLost(RuntimeError):
    """The pool's ranks are gone and this process cannot start them again (nodes started elsewhere)."""


# ---------------------------------------------------------------------- messages (pool side)
SHUTDOWN = {"op": "shutdown"}


def run_request(case_id: int, case: dict) -> dict:
    """The message that asks a rank to run ``case``; its reply carries the same ``case_id``."""
    return {"op": "run", "case_id": case_id, "case": case}


class OffProtocol(ValueError):
    """A rank answered something other than the reply to the case it was sent."""


def decode_reply(
    body: dict, arrays: dict[str, np.ndarray], *, rank: int, case_id: int | None, received_at: float
) -> RankOutput:
    """The ``RankOutput`` in rank ``rank``'s reply to case ``case_id``; ``OffProtocol`` when it is not that reply."""
    if body.get("op") != "result" or body.get("case_id") != case_id or int(body.get("rank", -1)) != rank:
        raise OffProtocol(f"rank {rank} answered out of protocol: {str(body)[:300]}")
    return RankOutput(
        rank=rank,
        ok=bool(body["ok"]),
        info=body.get("info", {}),
        tensors=arrays,
        comm=body.get("comm", []),
        seconds=float(body.get("seconds", 0.0)),
        error_type=body.get("error_type"),
        message=body.get("message"),
        traceback=body.get("traceback"),
        called=body.get("called", []),
        started_at=body.get("t_start"),
        finished_at=body.get("t_end"),
        received_at=received_at,
        cp_rank=body.get("cp_rank"),
        group=body.get("group"),
    )


def mesh_request(case_id: int, key: str) -> dict:
    """The message that asks every rank to build the mesh ``key`` (``cp_harness.cases.meshes.mesh_key``)."""
    import json

    return (
        {"op": "mesh", "case_id": case_id, "prefix": int(key.split(":", 1)[1])}
        if key.startswith("prefix:")
        else {"op": "mesh", "case_id": case_id, "layout": json.loads(key)}
    )
