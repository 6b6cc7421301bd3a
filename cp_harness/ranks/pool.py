"""The persistent rank pool: ranks started once, fed one case at a time.

The ranks are forked by one launcher process after it imported torch and the
implementations (``launcher="fork"``, the default with gloo), or started by
``torchrun`` (``launcher="torchrun"``, the default with nccl); see
``cp_harness.ranks.worker``.

``RankPool.run(case)`` sends a case description (a small JSON dict) to ranks
``0..case["world_size"]-1`` and returns their ``RankOutput``s, or raises
``RankFailure`` saying which rank failed, on which case, and how (its
traceback, its exit, or the stack it was stuck in). After a failure that may
have left ranks inside a collective, the pool is torn down and the next
``run`` starts a fresh one, so one bad case never poisons the next.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from cp_harness.ranks import wire


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


@dataclasses.dataclass(eq=False)
class Ticket:
    """A case submitted to a ``RankPool`` (``RankPool.submit``); ``RankPool.collect`` turns it into outputs.

    ``outputs`` or ``error`` once ``done``; ``sends``: how many times it was sent (more than once when a
    case before it failed and the pool was restarted); ``timing``: ranks/transport seconds once collected.
    """

    case: dict
    timeout: float
    seq: int
    pool: Any = dataclasses.field(repr=False)
    case_id: int | None = None
    generation: int | None = None
    sends: int = 0
    sent_at: float = 0.0
    send_error: tuple[int, str] | None = None
    done: bool = False
    outputs: list[RankOutput] | None = None
    error: BaseException | None = None
    timing: dict[str, float] = dataclasses.field(default_factory=dict)


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


def _looks_like_timeout(message: str | None) -> bool:
    """Whether a rank's error is a consequence of a peer's failure (it gave up waiting, or lost the peer)."""
    text = (message or "").lower()
    return any(sign in text for sign in ("timed out", "timeout", "connection closed by peer", "connection reset by peer",
                                         "broken pipe"))


class RankPool:
    """A long-lived job of ranks that run cases on request (see module docstring)."""

    def __init__(self, config: PoolConfig | None = None):
        self.config = config or PoolConfig()
        self._proc: subprocess.Popen | None = None
        self._socks: dict[int, socket.socket] = {}
        self._pids: dict[int, int] = {}
        self._case_ids = itertools.count()
        self._tickets = itertools.count()
        self._inflight: collections.deque[Ticket] = collections.deque()  # submitted, not collected, in order
        self._live: int | None = None  # the start (``starts``) whose ranks are connected now
        self._rank_free: dict[int, float] = {}  # when each rank finished its last collected case (monotonic)
        self._workdir: Path | None = None
        self.starts = 0
        self.hello: dict[int, dict] = {}

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and len(self._socks) == self.config.world_size

    def start(self) -> None:
        """Start the ranks and wait until every one has connected (bounded by ``start_timeout``).

        The fork launcher picks its rendezvous port by binding port 0 and releasing it for rank 0's store;
        if another process took the port in between (the log says so), the start is tried once more.
        """
        if self.running:
            return
        try:
            self._start_once()
        except RuntimeError as exc:
            if self.launcher != "fork" or "address already in use" not in str(exc).lower():
                raise
            self._start_once()

    def _start_once(self) -> None:
        self._shutdown()
        cfg = self.config
        self._workdir = Path(tempfile.mkdtemp(prefix="cp-pool-", dir=cfg.log_dir))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(cfg.world_size)
        port = listener.getsockname()[1]
        worker = ["-m", "cp_harness.ranks.worker", f"--connect=127.0.0.1:{port}", f"--backend={cfg.backend}",
                  f"--impl={cfg.impl}", f"--collective-timeout={cfg.collective_timeout}", f"--stack-dir={self._workdir}"]
        if self.launcher == "torchrun":
            cmd = [cfg.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.world_size}",
                   "--max-restarts=0", "--monitor-interval=0.2", *worker]
        else:
            cmd = [cfg.python, *worker, f"--ranks={cfg.world_size}"]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env["TORCHELASTIC_ERROR_FILE"] = str(self._workdir / "error.json")
        self._log = open(self._workdir / "launcher.log", "wb")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True, stdin=subprocess.DEVNULL)
        self.starts += 1
        deadline = time.monotonic() + cfg.start_timeout
        try:
            while len(self._socks) < cfg.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._proc.poll() is not None:
                    raise RuntimeError(
                        f"rank pool did not start: {len(self._socks)} of {cfg.world_size} ranks connected "
                        f"within {cfg.start_timeout:.0f} s ({self.launcher} exit code {self._proc.poll()}).\n"
                        f"{self.launcher} log tail:\n{self.log_tail()}")
                listener.settimeout(min(remaining, 1.0))
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                body, _ = wire.recv(conn, timeout=max(deadline - time.monotonic(), 1.0))
                rank = int(body["rank"])
                if body.get("launcher") != self.launcher:
                    raise RuntimeError(f"rank {rank} was started by {body.get('launcher')!r}, not {self.launcher!r}")
                self._socks[rank] = conn
                self._pids[rank] = int(body["pid"])
                self.hello[rank] = body
            self._live = self.starts
            self._rank_free.clear()
        except BaseException:
            self._shutdown()
            raise
        finally:
            listener.close()

    def close(self, graceful: bool = True) -> None:
        """Stop every rank and the launcher; leaves no process behind.

        ``graceful``: ask the ranks to leave and give them 5 s; otherwise (after a
        failure, when ranks may be stuck) kill at once. Cases still in flight are
        dropped: collecting them raises ``RuntimeError``.
        """
        while self._inflight:
            ticket = self._inflight.popleft()
            ticket.error = RuntimeError(f"the pool was closed before this case was collected: {ticket.case}")
            ticket.done = True
        self._shutdown(graceful)

    def _shutdown(self, graceful: bool = True) -> None:
        """``close`` without dropping the cases in flight (they are sent again to the next pool)."""
        self._live = None
        for sock in self._socks.values():
            try:
                wire.send(sock, {"op": "shutdown"})
            except OSError:
                pass
        if graceful and self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.wait(timeout=5 if self._socks else 0.1)
            except subprocess.TimeoutExpired:
                pass
        self._kill_tree()
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        self._pids.clear()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        self._proc = None

    def _kill_tree(self) -> None:
        if self._proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(timeout=3)
                # the launcher may be gone while a rank lingers in the same session: sweep it too.
            except subprocess.TimeoutExpired:
                continue
        for pid in self._pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cleanup_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def log_tail(self, limit: int = 4000) -> str:
        try:
            text = (self._workdir / "launcher.log").read_text(errors="replace")
        except (OSError, TypeError):
            return "(no log)"
        return text[-limit:]

    @property
    def pids(self) -> dict[int, int]:
        """Process id of each rank (for checks that nothing is left behind)."""
        return dict(self._pids)

    @property
    def launcher(self) -> str:
        """``"fork"`` or ``"torchrun"`` (``PoolConfig.launcher``, else by backend)."""
        if self.config.launcher is not None:
            return self.config.launcher
        return "torchrun" if self.config.backend == "nccl" else "fork"

    @property
    def launcher_pid(self) -> int | None:
        """Process id of the launcher (torchrun, or the process that forked the ranks)."""
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------ running cases
    def run(self, case: dict, *, timeout: float | None = None) -> list[RankOutput]:
        """Run ``case`` on ranks ``0..case["world_size"]-1``; returns their outputs in rank order.

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
        n = int(case["world_size"])
        if not 1 <= n <= self.config.world_size:
            raise ValueError(f"case world_size={n}; this pool has {self.config.world_size} ranks "
                             f"(start it with a larger PoolConfig.world_size)")
        ticket = Ticket(case=case, timeout=self.config.case_timeout if timeout is None else float(timeout),
                        seq=next(self._tickets), pool=self)
        self._inflight.append(ticket)
        try:
            self._ensure_sent()
        except BaseException:
            # The pool did not start: this case was never sent; the ones before it stay queued.
            self._inflight.remove(ticket)
            raise
        return ticket

    def collect(self, ticket: Ticket) -> list[RankOutput]:
        """The outputs of a submitted case, in rank order (``RankFailure`` as in ``run``).

        Cases are collected in the order they were submitted: collecting a
        later ticket first collects (and keeps) the earlier ones. Every wait is
        bounded by the ticket's timeout, counted from when its collection starts.
        """
        if ticket.pool is not self:
            raise ValueError("this ticket was submitted to another pool")
        while not ticket.done:
            if not self._inflight:
                raise RuntimeError(f"case {ticket.case} is neither collected nor in flight")
            self._ensure_sent()
            self._collect_head(self._inflight[0])
        if ticket.error is not None:
            raise ticket.error
        return ticket.outputs

    @property
    def in_flight(self) -> int:
        """Cases submitted and not collected yet."""
        return len(self._inflight)

    def _ensure_sent(self) -> None:
        """Send every queued case not sent to the live pool, starting a fresh pool when needed.

        A pool that still owes replies is not replaced: those replies (or their
        absence) say which case failed; the failure then closes the pool and the
        cases queued behind it are sent to the next one.
        """
        unsent = [t for t in self._inflight if self._live is None or t.generation != self._live]
        if not unsent:
            return
        if not self.running:
            if self._live is not None and any(t.generation == self._live for t in self._inflight):
                return
            self.start()
        for ticket in unsent:
            self._send(ticket)

    def _send(self, ticket: Ticket) -> None:
        ticket.case_id = next(self._case_ids)
        ticket.generation = self._live
        ticket.send_error = None
        ticket.sends += 1
        data = wire.encode({"op": "run", "case_id": ticket.case_id, "case": ticket.case})
        for rank in range(int(ticket.case["world_size"])):
            try:
                self._socks[rank].sendall(data)
            except OSError as exc:
                ticket.send_error = (rank, f"rank {rank} could not be sent the case ({exc}); it has probably exited")
                break
        ticket.sent_at = time.monotonic()

    def _collect_head(self, ticket: Ticket) -> None:
        """Wait for the oldest case in flight; record its outputs or its ``RankFailure`` on the ticket."""
        case, timeout = ticket.case, ticket.timeout
        n = int(case["world_size"])
        if ticket.send_error is not None:
            rank, message = ticket.send_error
            return self._fail(ticket, message, rank=rank, kind="exited", outputs=[])
        outputs: dict[int, RankOutput] = {}
        collect_started = time.monotonic()
        deadline = collect_started + timeout
        grace_deadline = None
        pending = set(range(n))
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            ready = select.select([self._socks[r] for r in pending], [], [], max(remaining, 0))[0] if remaining > 0 else []
            if not ready:
                break
            for sock in ready:
                rank = next(r for r in pending if self._socks[r] is sock)
                try:
                    body, arrays = wire.recv(sock, timeout=max(deadline - time.monotonic(), 1.0))
                except wire.WireError as exc:
                    code = self._wait_exit()
                    # The fork launcher ends the other ranks when one exits, so the first closed socket may be
                    # a rank it ended; it logs which rank exited first.
                    first = self._first_exited_rank()
                    culprit = rank if first is None else first
                    seen = "" if culprit == rank else f"; rank {rank}'s connection closed when the launcher ended it"
                    return self._fail(ticket, f"rank {culprit} exited while running the case ({exc}{seen}; "
                                              f"{self.launcher} exit code {code}).\n"
                                              f"{self.launcher} log tail:\n{self.log_tail()}",
                                      rank=culprit, kind="exited", outputs=list(outputs.values()))
                if body.get("op") != "result" or body.get("case_id") != ticket.case_id or int(body.get("rank", -1)) != rank:
                    return self._fail(ticket, f"rank {rank} answered out of protocol: {str(body)[:300]}", rank=rank,
                                      kind="protocol", outputs=list(outputs.values()))
                outputs[rank] = RankOutput(rank=rank, ok=bool(body["ok"]), info=body.get("info", {}), tensors=arrays,
                                           comm=body.get("comm", []), seconds=float(body.get("seconds", 0.0)),
                                           error_type=body.get("error_type"), message=body.get("message"),
                                           traceback=body.get("traceback"), called=body.get("called", []),
                                           started_at=body.get("t_start"), finished_at=body.get("t_end"),
                                           received_at=time.monotonic())
                pending.discard(rank)
                if not body["ok"] and grace_deadline is None:
                    # Peers of a rank that raised may be waiting in a collective; give them a moment.
                    grace_deadline = time.monotonic() + min(5.0, timeout)
        errors = sorted((o for o in outputs.values() if not o.ok), key=lambda o: o.seconds)
        if not pending and not errors:
            ticket.outputs = [outputs[r] for r in range(n)]
            ticket.timing = self._timing(ticket, collect_started)
            ticket.done = True
            self._inflight.popleft()
            return None
        # Something went wrong: name the rank that started it, then restart the pool for the next case.
        stuck = sorted(pending)
        stacks = self._dump_stacks(stuck) if stuck else ""
        root = next((o for o in errors if not _looks_like_timeout(o.message)), None)
        followers = [o.rank for o in errors if o is not root]
        if root is not None:
            return self._fail(ticket, f"rank {root.rank} raised {root.error_type}: {root.message}\n"
                                      + (f"ranks {followers} then failed waiting for it.\n" if followers else "")
                                      + (f"ranks {stuck} then did not answer (waiting in a collective for it).\n"
                                         if stuck else "")
                                      + f"--- traceback of rank {root.rank} ---\n{root.traceback}{stacks}",
                              rank=root.rank, kind="raised", outputs=list(outputs.values()))
        if stuck:
            return self._fail(ticket, f"ranks {stuck} did not answer within {timeout:.1f} s (hung)"
                                      + (f"; ranks {followers} timed out in a collective waiting for them" if followers else "")
                                      + f"; ranks {sorted(set(outputs) - set(followers))} answered normally.\n{stacks}",
                              rank=stuck[0], kind="hung", outputs=list(outputs.values()))
        first = errors[0]
        return self._fail(ticket, f"rank {first.rank} raised {first.error_type}: {first.message}\n{first.traceback}",
                          rank=first.rank, kind="raised", outputs=list(outputs.values()))

    def _timing(self, ticket: Ticket, collect_started: float) -> dict[str, float]:
        """Where a collected case's time went, from the ranks' clocks and ours (both ``time.monotonic``, one machine).

        ``ranks``: the slowest rank's own time on the case; ``transport``: for the slowest path, the request's
        way to the rank (from when it was sent, or the rank finished its previous case, to when the rank took
        it) plus the reply's way back (from when the rank finished, or we started waiting, to its decoding).
        Time a reply waited while the test process was busy with something else is not transport.
        """
        ranks = max(o.seconds for o in ticket.outputs)
        transport = 0.0
        for o in ticket.outputs:
            if o.started_at is None or o.finished_at is None or o.received_at is None:
                continue
            free = max(ticket.sent_at, self._rank_free.get(o.rank, 0.0))
            there = max(o.started_at - free, 0.0)
            back = max(o.received_at - max(o.finished_at, collect_started), 0.0)
            transport = max(transport, there + back)
            self._rank_free[o.rank] = o.finished_at
        return {"ranks": ranks, "transport": transport}

    def _fail(self, ticket: Ticket, message: str, *, rank: int | None, kind: str, outputs: list[RankOutput]) -> None:
        """Fail ``ticket`` (the oldest in flight) and tear the pool down; the cases behind it are sent again later."""
        self._shutdown(graceful=False)
        ticket.error = RankFailure(f"{message}\ncase: {ticket.case}", rank=rank, kind=kind, case=ticket.case,
                                   outputs=outputs)
        ticket.done = True
        self._inflight.popleft()

    def _dump_stacks(self, ranks: list[int]) -> str:
        if self._workdir is None:
            return ""
        for rank in ranks:
            pid = self._pids.get(rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
        parts = []
        for rank in ranks:
            try:
                text = (self._workdir / f"rank{rank}.stack").read_text(errors="replace")
            except OSError:
                continue
            lines = [line for line in text.splitlines() if line.strip()]
            parts.append(f"--- stack of rank {rank} ---\n" + "\n".join(lines[-25:]))
        return "\n".join(parts)

    _EXITED = re.compile(r"^cp_harness\.worker: rank (\d+) \(pid \d+\) exited with", re.MULTILINE)

    def _first_exited_rank(self) -> int | None:
        """The rank the fork launcher saw exit first (``None`` when it logged none, or under torchrun)."""
        match = self._EXITED.search(self.log_tail(1 << 20))
        return int(match.group(1)) if match else None

    def _wait_exit(self) -> int | None:
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None
