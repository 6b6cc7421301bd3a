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


class RankFailure(AssertionError):
    """A rank raised unexpectedly, exited, hung or broke the protocol while running a case.

    ``rank`` is the first rank that failed, ``kind`` one of ``"raised"``,
    ``"exited"``, ``"hung"``, ``"protocol"``; ``outputs`` holds whatever the
    other ranks returned.
    """

    def __init__(self, message: str, *, rank: int | None, kind: str, case: dict, outputs: list[RankOutput]):
        super().__init__(message)
        self.rank, self.kind, self.case, self.outputs = rank, kind, case, outputs


@dataclasses.dataclass
class PoolConfig:
    """How to start the pool.

    ``world_size``: ranks started (cases may use any size up to it).
    ``case_timeout``: seconds one case may take on the ranks.
    ``collective_timeout``: seconds a rank's collective waits for its peers.
    ``start_timeout``: seconds for the launcher to bring every rank up.
    ``launcher``: ``"fork"`` (one process imports, then forks the ranks) or
    ``"torchrun"``; ``None`` picks fork for gloo and torchrun for nccl (the
    nccl pool has only run under torchrun).
    ``preload``: model spec modules the fork launcher imports once, before it forks (the real-model rows).
    """

    world_size: int = 8
    backend: str = "gloo"
    launcher: str | None = None
    impl: str = "cp_impl"
    case_timeout: float = 60.0
    collective_timeout: float = 30.0
    start_timeout: float = 180.0
    python: str = sys.executable
    log_dir: str | None = None
    preload: tuple[str, ...] = ()

    @property
    def resolved_launcher(self) -> str:
        """``launcher``, else by backend: torchrun for nccl, fork otherwise."""
        if self.launcher is not None:
            return self.launcher
        return "torchrun" if self.backend == "nccl" else "fork"


# ---------------------------------------------------------------------- messages (pool side)
SHUTDOWN = {"op": "shutdown"}


def run_request(case_id: int, case: dict) -> dict:
    """The message that asks a rank to run ``case``; its reply carries the same ``case_id``."""
    return {"op": "run", "case_id": case_id, "case": case}


class OffProtocol(ValueError):
    """A rank answered something other than the reply to the case it was sent."""


def decode_reply(body: dict, arrays: dict[str, np.ndarray], *, rank: int, case_id: int | None,
                 received_at: float) -> RankOutput:
    """The ``RankOutput`` in rank ``rank``'s reply to case ``case_id``; ``OffProtocol`` when it is not that reply."""
    if body.get("op") != "result" or body.get("case_id") != case_id or int(body.get("rank", -1)) != rank:
        raise OffProtocol(f"rank {rank} answered out of protocol: {str(body)[:300]}")
    return RankOutput(rank=rank, ok=bool(body["ok"]), info=body.get("info", {}), tensors=arrays,
                      comm=body.get("comm", []), seconds=float(body.get("seconds", 0.0)),
                      error_type=body.get("error_type"), message=body.get("message"),
                      traceback=body.get("traceback"), called=body.get("called", []),
                      started_at=body.get("t_start"), finished_at=body.get("t_end"), received_at=received_at)
