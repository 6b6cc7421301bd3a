"""The ticket queue of a rank pool: cases sent ahead, collected in order, sent again after a fault.

``TicketQueue.submit`` sends a case to its ranks and returns a ``Ticket`` at
once; ``collect`` waits for the replies of the oldest case in flight until the
wanted ticket is done. A rank failure fails only the case it happened in
(``diagnosis.diagnose`` says which rank and how), tears the processes down,
and the cases queued behind it are sent again to a fresh start. Each collected
case also gets its timing (the ranks' own seconds, and the transport).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import select
import time
from typing import Any

from cp_harness.cases import meshes
from cp_harness.ranks import wire
from cp_harness.ranks.diagnosis import blocked_in_collectives, diagnose, exits_in_log
from cp_harness.ranks.lifecycle import RankProcesses
from cp_harness.ranks.outputs import OffProtocol, RankFailure, RankOutput, decode_reply, mesh_request, run_request

RAISED_GRACE = 5.0  # seconds the peers of a rank that raised get to answer (capped by the case timeout)
# Within that grace the peers that have not answered are looked at (their stacks dumped) FIRST_LOOK seconds after
# the raise and every LOOK_EVERY seconds after a look: when two looks in a row find each of them waiting for
# communication at the same frame (``diagnosis.collective_wait``), they cannot answer without the rank that raised,
# and the grace ends there.
FIRST_LOOK = 0.2
LOOK_EVERY = 0.25


@dataclasses.dataclass(eq=False)
class Ticket:
    """A case submitted to a ``RankPool`` (``RankPool.submit``); ``RankPool.collect`` turns it into outputs.

    ``outputs`` or ``error`` once ``done``; ``sends``: how many times it was sent (more than once when a
    case before it failed and the pool was restarted); ``timing``: ranks/transport seconds once collected.
    ``ranks``: the pool ranks it goes to (a case's, ``cp_harness.cases.meshes.case_ranks``). A ticket with a
    ``mesh`` key is the pool's own request to build that mesh on every rank, for the case ``needed_by``.
    """

    case: dict
    timeout: float
    seq: int
    pool: Any = dataclasses.field(repr=False)
    ranks: tuple[int, ...] = ()
    mesh: str | None = None
    needed_by: Ticket | None = dataclasses.field(default=None, repr=False)
    case_id: int | None = None
    generation: int | None = None
    sends: int = 0
    sent_at: float = 0.0
    send_error: tuple[int, str] | None = None
    done: bool = False
    outputs: list[RankOutput] | None = None
    error: BaseException | None = None
    timing: dict[str, float] = dataclasses.field(default_factory=dict)


class TicketQueue:
    """Cases submitted to ``processes`` and not collected yet, oldest first; ``owner`` is who tickets belong to."""

    def __init__(self, owner: Any, processes: RankProcesses):
        self.owner, self.processes = owner, processes
        self._case_ids = itertools.count()
        self._tickets = itertools.count()
        self._inflight: collections.deque[Ticket] = collections.deque()  # submitted, not collected, in order
        # When each rank finished its last collected case (monotonic), for the start ``_free_generation``.
        self._rank_free: dict[int, float] = {}
        self._free_generation: int | None = None
        self._meshes: dict[int, set[str]] = {}  # start -> the meshes requested from its ranks

    def __len__(self) -> int:
        return sum(1 for t in self._inflight if t.mesh is None)

    def drop_all(self) -> None:
        """Forget every case in flight (the pool is closing): collecting them raises ``RuntimeError``."""
        while self._inflight:
            ticket = self._inflight.popleft()
            ticket.error = RuntimeError(f"the pool was closed before this case was collected: {ticket.case}")
            ticket.done = True

    def submit(self, case: dict, timeout: float) -> Ticket:
        world = self.processes.config.world_size
        n = int(case["world_size"])
        meshes.MeshLayout.of(case, pool_size=world)  # MeshLayoutError (a ValueError) naming the field
        if not 1 <= n <= world or meshes.ranks_needed(case) > world:
            raise ValueError(
                f"case world_size={n} needs {meshes.ranks_needed(case)} ranks; this pool has {world} "
                f"ranks (start it with a larger PoolConfig.world_size)"
            )
        ticket = Ticket(
            case=case, timeout=timeout, seq=next(self._tickets), pool=self.owner, ranks=tuple(meshes.case_ranks(case))
        )
        self._inflight.append(ticket)
        try:
            self._ensure_sent()
        except BaseException:
            # The pool did not start: this case was never sent; the ones before it stay queued.
            self._inflight.remove(ticket)
            raise
        return ticket

    def collect(self, ticket: Ticket) -> list[RankOutput]:
        if ticket.pool is not self.owner:
            raise ValueError("this ticket was submitted to another pool")
        while not ticket.done:
            if not self._inflight:
                raise RuntimeError(f"case {ticket.case} is neither collected nor in flight")
            self._ensure_sent()
            self._collect_head(self._inflight[0])
        if ticket.error is not None:
            raise ticket.error
        assert ticket.outputs is not None  # a ticket done without an error has its outputs
        return ticket.outputs

    def _ensure_sent(self) -> None:
        """Send every queued case not sent to the live pool, starting a fresh pool when needed.

        A pool that still owes replies is not replaced: those replies (or their
        absence) say which case failed; the failure then closes the pool and the
        cases queued behind it are sent to the next one.
        """
        live = self.processes.generation
        unsent = [t for t in self._inflight if live is None or t.generation != live]
        if not unsent:
            return
        if not self.processes.running:
            if live is not None and any(t.generation == live for t in self._inflight):
                return
            self.processes.start()
        for ticket in unsent:
            if ticket.mesh is not None:  # a request of a pool that is gone: the case asks the new one again
                self._inflight.remove(ticket)
        for ticket in unsent:
            if ticket.mesh is None:
                self._send(ticket)

    def _send(self, ticket: Ticket) -> None:
        """Send ``ticket`` to its ranks; first, when the live pool was not asked for its case's mesh yet, the
        request to build it, to every rank (building a mesh creates process groups: all ranks, same order)."""
        generation = self.processes.generation
        assert generation is not None  # _ensure_sent started the pool it sends to
        key = meshes.mesh_key(ticket.case)
        asked = self._meshes.setdefault(generation, set())
        self._meshes = {generation: asked}  # an earlier start's meshes went with its ranks
        if key != f"prefix:{self.processes.config.world_size}" and key not in asked:
            asked.add(key)
            build = Ticket(
                case={"mesh": key},
                timeout=ticket.timeout,
                seq=ticket.seq,
                pool=self.owner,
                ranks=tuple(range(self.processes.config.world_size)),
                mesh=key,
                needed_by=ticket,
            )
            self._inflight.insert(self._inflight.index(ticket), build)
            self._transmit(build, mesh_request)
        self._transmit(ticket, run_request)

    def _transmit(self, ticket: Ticket, request) -> None:
        ticket.case_id = next(self._case_ids)
        ticket.generation = self.processes.generation
        ticket.send_error = None
        ticket.sends += 1
        data = wire.encode(request(ticket.case_id, ticket.mesh if ticket.mesh is not None else ticket.case))
        for rank in ticket.ranks:
            try:
                self.processes.socks[rank].sendall(data)
            except OSError as exc:
                ticket.send_error = (rank, f"rank {rank} could not be sent the case ({exc}); it has probably exited")
                break
        ticket.sent_at = time.monotonic()

    def _collect_head(self, ticket: Ticket) -> None:
        """Wait for the oldest case in flight; record its outputs or its ``RankFailure`` on the ticket."""
        procs = self.processes
        case, timeout = ticket.case, ticket.timeout
        evidence: dict[str, Any] = dict(
            case=case if ticket.needed_by is None else ticket.needed_by.case,
            timeout=timeout,
            launcher=procs.launcher,
            where=self._where(ticket),
        )
        if ticket.send_error is not None:
            return self._fail(ticket, diagnose(**evidence, replies={}, send_error=ticket.send_error))
        outputs: dict[int, RankOutput] = {}
        collect_started = time.monotonic()
        deadline = collect_started + timeout
        grace_deadline = None
        looks: list[dict[int, str]] = []  # stack dumps of the peers that had not answered when a rank raised
        next_look = deadline
        pending = set(ticket.ranks)
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline, next_look)
            remaining = limit - time.monotonic()
            socks = procs.socks
            ready = select.select([socks[r] for r in pending], [], [], max(remaining, 0))[0] if remaining > 0 else []
            if not ready:
                if grace_deadline is not None and time.monotonic() < min(deadline, grace_deadline):
                    looks.append(procs.dump_stacks(sorted(pending)))
                    if blocked_in_collectives(looks[-2:], pending):
                        break
                    next_look = time.monotonic() + LOOK_EVERY
                    continue
                break
            for sock in ready:
                rank = next(r for r in pending if socks[r] is sock)
                try:
                    body, arrays = wire.recv(sock, timeout=max(deadline - time.monotonic(), 1.0))
                except wire.WireError as exc:
                    code = procs.wait_exit()
                    return self._fail(
                        ticket,
                        diagnose(
                            **evidence,
                            replies=outputs,
                            closed=(rank, str(exc)),
                            launcher_exit=code,
                            exits=exits_in_log(procs.log_tail(1 << 20)),
                            log=procs.log_tail(),
                            rank_errors=procs.rank_errors(),
                            rank_logs={r: procs.rank_log_tail(r) for r in ticket.ranks},
                        ),
                    )
                if body.get("op") == "lost":  # the rank's launcher is gone (a lost node): it exits now
                    return self._fail(
                        ticket,
                        diagnose(
                            **evidence,
                            replies=outputs,
                            lost=(rank, body.get("reason")),
                            launcher_exit=procs.wait_exit() if procs.exited_agents() else None,
                        ),
                    )
                try:
                    outputs[rank] = decode_reply(
                        body, arrays, rank=rank, case_id=ticket.case_id, received_at=time.monotonic()
                    )
                except OffProtocol as exc:
                    return self._fail(ticket, diagnose(**evidence, replies=outputs, off_protocol=(rank, str(exc))))
                pending.discard(rank)
                if not outputs[rank].ok and grace_deadline is None:
                    # Peers of a rank that raised may be waiting in a collective; give them a moment.
                    grace_deadline = time.monotonic() + min(RAISED_GRACE, timeout)
                    next_look = time.monotonic() + FIRST_LOOK
        stuck = sorted(pending)
        if stuck and looks and blocked_in_collectives(looks[-2:], stuck):
            stacks = {rank: looks[-1][rank] for rank in stuck if rank in looks[-1]}  # the look that ended the grace
        else:
            stacks = procs.dump_stacks(stuck) if stuck else {}
        failure = diagnose(**evidence, replies=outputs, unanswered=stuck, stacks=stacks)
        if failure is not None:
            return self._fail(ticket, failure)
        ticket.outputs = [outputs[r] for r in ticket.ranks]
        ticket.timing = self._timing(ticket, collect_started)
        ticket.done = True
        self._inflight.popleft()
        return None

    def _where(self, ticket: Ticket) -> str:
        """Where a ticket's ranks are, for a failure message: its CP groups (on a world mesh) and nodes."""
        lines = []
        layout = meshes.MeshLayout.of(ticket.case) if ticket.mesh is None else None
        if layout is not None:
            lines.append(
                "on "
                + "; ".join(layout.group_label(g) for g in layout.running())
                + " (CP rank i of a group is its i-th global rank)"
            )
        elif ticket.mesh is not None:
            lines.append(f"while every rank built the mesh {ticket.mesh} for the next case")
        nodes = {r: self.processes.where(r) for r in ticket.ranks}
        if any(nodes.values()):
            by_node: dict[str, list[int]] = {}
            for r, node in nodes.items():
                by_node.setdefault(node, []).append(r)
            lines.append("ranks by node: " + "; ".join(f"{node}: ranks {rs}" for node, rs in by_node.items()))
        return "".join(line + "\n" for line in lines if line)

    def _timing(self, ticket: Ticket, collect_started: float) -> dict[str, float]:
        """Where a collected case's time went, from the ranks' clocks and ours (both ``time.monotonic``, one machine).

        ``ranks``: the slowest rank's own time on the case; ``transport``: for the slowest path, the request's
        way to the rank (from when it was sent, or the rank finished its previous case, to when the rank took
        it) plus the reply's way back (from when the rank finished, or we started waiting, to its decoding).
        Time a reply waited while the test process was busy with something else is not transport.
        """
        if ticket.generation != self._free_generation:  # a fresh start: its ranks have finished nothing yet
            self._rank_free.clear()
            self._free_generation = ticket.generation
        assert ticket.outputs is not None  # recorded just before
        ranks = max(o.seconds for o in ticket.outputs)
        transport = 0.0
        for o in ticket.outputs:
            if o.started_at is None or o.finished_at is None or o.received_at is None:
                continue
            free = max(ticket.sent_at, self._rank_free.get(o.rank, 0.0))
            there = max(o.started_at - free, 0.0)
            back = max(o.received_at - max(o.finished_at, collect_started), 0.0)
            transport = max(transport, there + back)
            self._rank_free[o.rank] = o.finished_at  # o.rank: the pool rank (the CP rank is o.cp_rank)
        return {"ranks": ranks, "transport": transport}

    def _fail(self, ticket: Ticket, failure: RankFailure | None) -> None:
        """Fail ``ticket`` (the oldest in flight) and tear the pool down; the cases behind it are sent again later.
        A mesh request fails the case it was for (the same request would fail again on a fresh pool)."""
        # diagnose names a failure whenever it is told of one (a send error, a closed connection, a lost rank, an
        # off-protocol reply); only the last call, on the replies alone, can find none, and it is checked first.
        assert failure is not None
        self.processes.shutdown(graceful=False)
        ticket.error = failure
        ticket.done = True
        self._inflight.popleft()
        case = ticket.needed_by
        if case is not None and case in self._inflight:
            self._inflight.remove(case)
            case.error, case.done = failure, True
