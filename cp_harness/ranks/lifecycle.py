"""The processes of a rank pool: starting the launcher, the rendezvous, shutting down, and what they left behind.

``RankProcesses`` starts the launcher (``python -m cp_harness.ranks.worker --ranks N``,
which forks the ranks, or ``torchrun``), accepts one connection per rank (each
rank says hello with its rank and pid), and ends every process of the job
again: a polite shutdown message, then SIGTERM/SIGKILL to the launcher's
process group and SIGKILL to each rank. It also reads what a failure needs:
the launcher's log, its exit code, and the stack dumps of stuck ranks. Which
case runs where is ``tickets``' business; this module knows no cases.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from cp_harness.ranks import wire
from cp_harness.ranks.diagnosis import exits_in_log, start_failure_report
from cp_harness.ranks.outputs import SHUTDOWN, PoolConfig

STACK_DUMP_WAIT = 0.5  # seconds the ranks get to write their stacks after SIGUSR1


class RankProcesses:
    """The launcher and ranks of one pool, restarted as a whole (``starts`` counts the starts)."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.socks: dict[int, socket.socket] = {}
        self._pids: dict[int, int] = {}
        self._workdir: Path | None = None
        self._log = None
        self.generation: int | None = None  # the start (``starts``) whose ranks are connected now
        self.starts = 0
        self.hello: dict[int, dict] = {}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and len(self.socks) == self.config.world_size

    @property
    def launcher(self) -> str:
        """``"fork"`` or ``"torchrun"`` (``PoolConfig.launcher``, else by backend)."""
        return self.config.resolved_launcher

    @property
    def launcher_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def pids(self) -> dict[int, int]:
        return dict(self._pids)

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

    def _command(self, port: int) -> list[str]:
        cfg = self.config
        worker = ["-m", "cp_harness.ranks.worker", f"--connect=127.0.0.1:{port}", f"--backend={cfg.backend}",
                  f"--impl={cfg.impl}", f"--collective-timeout={cfg.collective_timeout}", f"--stack-dir={self._workdir}"]
        if cfg.preload:
            worker.append(f"--preload={','.join(cfg.preload)}")
        if self.launcher == "torchrun":
            return [cfg.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.world_size}",
                    "--max-restarts=0", "--monitor-interval=0.2", *worker]
        return [cfg.python, *worker, f"--ranks={cfg.world_size}"]

    def _start_once(self) -> None:
        self.shutdown()
        cfg = self.config
        self._workdir = Path(tempfile.mkdtemp(prefix="cp-pool-", dir=cfg.log_dir))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(cfg.world_size)
        cmd = self._command(listener.getsockname()[1])
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env["TORCHELASTIC_ERROR_FILE"] = str(self._workdir / "error.json")
        self._log = open(self._workdir / "launcher.log", "wb")  # noqa: SIM115 - closed in shutdown()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, stdin=subprocess.DEVNULL)
        self.starts += 1
        deadline = time.monotonic() + cfg.start_timeout
        try:
            self._rendezvous(listener, deadline)
            self.generation = self.starts
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()

    def _rendezvous(self, listener: socket.socket, deadline: float) -> None:
        """Accept every rank's connection and hello before ``deadline``, or raise ``RuntimeError`` saying why not."""
        cfg = self.config
        while len(self.socks) < cfg.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                raise RuntimeError(
                    f"rank pool did not start: {len(self.socks)} of {cfg.world_size} ranks connected "
                    f"within {cfg.start_timeout:.0f} s ({self.launcher} exit code {self.proc.poll()}).\n"
                    f"{start_failure_report(exits_in_log(self.log_tail(1 << 24)), self.rank_errors())}"
                    f"{self.launcher} log tail:\n{self.log_tail()}")
            listener.settimeout(min(remaining, 1.0))
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                body, _ = wire.recv(conn, timeout=max(deadline - time.monotonic(), 1.0))
            except wire.WireError:
                # A rank ended (by the launcher, after another rank failed) between connecting and saying hello:
                # the next turn of the loop sees the launcher exit and reports the rank that failed.
                conn.close()
                continue
            rank = int(body["rank"])
            if body.get("launcher") != self.launcher:
                raise RuntimeError(f"rank {rank} was started by {body.get('launcher')!r}, not {self.launcher!r}")
            self.socks[rank] = conn
            self._pids[rank] = int(body["pid"])
            self.hello[rank] = body

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank and the launcher; leaves no process behind.

        ``graceful``: ask the ranks to leave and give them 5 s; otherwise (after a
        failure, when ranks may be stuck) kill at once.
        """
        self.generation = None
        for sock in self.socks.values():
            try:
                wire.send(sock, SHUTDOWN)
            except OSError:
                pass
        if graceful and self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=5 if self.socks else 0.1)
            except subprocess.TimeoutExpired:
                pass
        self._kill_tree()
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()
        self._pids.clear()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None

    def _kill_tree(self) -> None:
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=3)
                # the launcher may be gone while a rank lingers in the same session: sweep it too.
            except subprocess.TimeoutExpired:
                continue
        for pid in self._pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cleanup_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def log_tail(self, limit: int = 4000) -> str:
        try:
            text = (self._workdir / "launcher.log").read_text(errors="replace")
        except (OSError, TypeError):
            return "(no log)"
        return text[-limit:]

    def rank_errors(self) -> dict[int, str]:
        """The tracebacks forked ranks left when they ended with an exception (``<workdir>/rank<r>.error``)."""
        if self._workdir is None:
            return {}
        found = {}
        for path in self._workdir.glob("rank*.error"):
            try:
                found[int(path.stem[4:])] = path.read_text(errors="replace")
            except (OSError, ValueError):
                continue
        return found

    def wait_exit(self) -> int | None:
        """The launcher's exit code, waiting up to 5 s for it (``None``: still running, or never started)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask ``ranks`` for their stacks (SIGUSR1) and return each dump that was written (rank -> its text)."""
        if self._workdir is None:
            return {}
        for rank in ranks:
            pid = self._pids.get(rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(STACK_DUMP_WAIT)
        stacks = {}
        for rank in ranks:
            try:
                stacks[rank] = (self._workdir / f"rank{rank}.stack").read_text(errors="replace")
            except OSError:
                continue
        return stacks
