"""The processes of a rank pool: starting the launchers, the rendezvous, shutting down, and what they left behind.

``RankProcesses`` starts the launcher of every node this process runs
(``python -m cp_harness.ranks.worker --ranks N``, which forks the ranks, or
``torchrun``: one agent per node, with the c10d rendezvous when there are
several nodes), accepts one connection per rank (each rank connects first,
says what it is doing at each step of its start, then hello with its rank,
node and pid), and ends every process of the job again: a polite shutdown
message, then SIGTERM/SIGKILL to each launcher's process group and SIGKILL to
each rank on this machine. Ranks started elsewhere (``node_rank``: the other
nodes' agents; the ``external`` launcher: ``srun``) leave when their
connection closes. It also reads what a failure needs: the launchers' logs and
exit codes, each rank's own log, and the stack dumps of stuck ranks. Which
case runs where is ``tickets``' business; this module knows no cases.
"""

from __future__ import annotations

import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from cp_harness.ranks import wire
from cp_harness.ranks.diagnosis import exits_in_log, start_failure_report, start_timeout_report
from cp_harness.ranks.fork_server import ForkServer, ForkServerGone, process_alive, server_key
from cp_harness.ranks.outputs import SHUTDOWN, PoolConfig, PoolLost

STACK_DUMP_WAIT = 0.5  # seconds the ranks get to write their stacks after SIGUSR1


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r}: give HOST:PORT")
    return host, int(port)


class RankProcesses:
    """The launchers and ranks of one pool, restarted as a whole (``starts`` counts the starts)."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self.agents: dict[int, subprocess.Popen] = {}  # node -> its launcher, for the nodes this process starts
        self.socks: dict[int, socket.socket] = {}
        self._pids: dict[int, int] = {}
        self._workdir: Path | None = None
        self._logs: list = []
        self.generation: int | None = None  # the start (``starts``) whose ranks are connected now
        self.starts = 0
        self.hello: dict[int, dict] = {}
        self.progress: dict[int, dict] = {}  # rank -> the last phase it reported while starting
        self._rdzv: str | None = None
        self._listen: tuple[str, int] | None = None
        self.lost: str | None = None  # why a pool that cannot restart is gone
        self.server: ForkServer | None = None  # the fork launcher's imports, kept between starts (fork_server)

    @property
    def proc(self) -> subprocess.Popen | None:
        """The first local launcher (the only one on one node)."""
        return next(iter(self.agents.values()), None)

    @property
    def running(self) -> bool:
        return (
            self.generation is not None
            and all(p.poll() is None for p in self.agents.values())
            and len(self.socks) == self.config.world_size
        )

    @property
    def launcher(self) -> str:
        """``"fork"``, ``"torchrun"`` or ``"external"`` (``PoolConfig.launcher``, else by backend and nodes)."""
        return self.config.resolved_launcher

    @property
    def launcher_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    def start(self) -> None:
        """Start the ranks and wait until every one has connected (bounded by the start timeout).

        The fork launcher picks its rendezvous port by binding port 0 and releasing it for rank 0's store;
        if another process took the port in between (the log says so), the start is tried once more.
        A pool whose other nodes were started elsewhere starts once: after that ``PoolLost``.
        """
        if self.running:
            return
        if self.starts and not self.config.restartable:
            raise PoolLost(
                self.lost
                or "the pool's ranks are gone, and its other nodes were started outside this "
                "process: start them again and rerun"
            )
        try:
            self._start_once()
        except RuntimeError as exc:
            if self.launcher != "fork" or "address already in use" not in str(exc).lower():
                raise
            self._start_once()

    # ------------------------------------------------------------------ commands
    def worker_args(self, *, local: bool = True) -> list[str]:
        """The worker's arguments (``local``: with the stack and log folder, which ranks elsewhere cannot use)."""
        cfg = self.config
        host, port = self._listen or _split(cfg.listen or "127.0.0.1:0")
        args = [
            "-m",
            "cp_harness.ranks.worker",
            f"--connect={host}:{port}",
            f"--backend={cfg.backend}",
            f"--impl={cfg.impl}",
            f"--collective-timeout={cfg.collective_timeout}",
            f"--start-timeout={cfg.start_seconds:.0f}",
            f"--rank-order={cfg.rank_order}",
        ]
        if local and self._workdir is not None:
            args.append(f"--stack-dir={self._workdir}")
        if cfg.preload:
            args.append(f"--preload={','.join(cfg.preload)}")
        return args

    def node_command(self, node: int, *, local: bool = True) -> list[str]:
        """The command that starts node ``node``'s ranks (``local=False``: as the user runs it on that node)."""
        cfg = self.config
        if self._listen is None:
            self._addresses()
        worker = self.worker_args(local=local)
        if self.launcher == "external":  # one rank, as srun starts each task (its environment says which)
            return ["python", *worker]
        if self.launcher == "fork":
            return [cfg.python, *worker, f"--ranks={cfg.world_size}"]
        if cfg.nnodes == 1:
            return [
                cfg.python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={cfg.world_size}",
                "--max-restarts=0",
                "--monitor-interval=0.2",
                *worker,
            ]
        conf = f"join_timeout={cfg.start_seconds:.0f}"
        if cfg.restartable:  # every agent on this machine: node 0's hosts the rendezvous store
            conf += f",is_host={'true' if node == 0 else 'false'}"
        return [
            cfg.python if local else "python",
            "-m",
            "torch.distributed.run",
            f"--nnodes={cfg.nnodes}",
            f"--nproc-per-node={cfg.ranks_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self._rdzv}",
            f"--rdzv-id=cp-harness-{self._listen[1] if self._listen else 0}",
            f"--rdzv-conf={conf}",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            *worker,
        ]

    def remote_commands(self) -> dict[int, str]:
        """For each node this process does not start: the command to run on it (printed for the user)."""
        if self._listen is None:
            self._addresses()
        return {
            node: shlex.join(self.node_command(node, local=False))
            for node in range(self.config.nnodes)
            if node not in self.config.local_nodes and self.launcher == "torchrun"
        }

    def _addresses(self) -> None:
        cfg = self.config
        remote = not cfg.restartable
        if remote and cfg.listen is None:
            raise ValueError(
                "ranks started elsewhere must reach this process: give --listen HOST:PORT (an address "
                "of this machine that every node can reach)"
            )
        host, port = _split(cfg.listen or "127.0.0.1:0")
        self._listen = (host, port or _free_port(host if host != "0.0.0.0" else "127.0.0.1"))
        if cfg.nnodes > 1 and self.launcher == "torchrun":
            if cfg.rdzv_endpoint is None and remote:
                raise ValueError("nodes started elsewhere need the rendezvous: give --rdzv-endpoint HOST:PORT")
            self._rdzv = cfg.rdzv_endpoint or f"127.0.0.1:{_free_port()}"

    # ------------------------------------------------------------------ start
    def _start_once(self) -> None:
        self.shutdown()
        cfg = self.config
        self._workdir = Path(tempfile.mkdtemp(prefix="cp-pool-", dir=cfg.log_dir))
        if self._listen is None or cfg.listen is None:
            self._addresses()
        assert self._listen is not None  # _addresses sets it
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(self._listen)
        listener.listen(cfg.world_size)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        self.starts += 1
        self.progress = {}
        deadline = time.monotonic() + cfg.start_seconds
        try:
            for node in cfg.local_nodes:
                name = "launcher.log" if len(cfg.local_nodes) == 1 else f"node{node}.log"
                env["TORCHELASTIC_ERROR_FILE"] = str(self._workdir / f"error{node}.json")
                if self.launcher == "fork":
                    self.agents[node] = self._fork_launcher(self._workdir / name, env, deadline)
                    continue
                log = open(self._workdir / name, "wb")  # noqa: SIM115 - closed in shutdown()
                self._logs.append(log)
                self.agents[node] = subprocess.Popen(
                    self.node_command(node),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                )
            self._rendezvous(listener, deadline)
            self.generation = self.starts
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()

    def _fork_launcher(self, log: Path, env: dict[str, str], deadline: float):
        """This start's fork launcher, from the pool's fork server (started, or started again, when the command or
        environment changed or it is gone). A server that cannot import fails the start as a launcher that cannot:
        its output in ``log``, the exit code in the report."""
        command = self.node_command(0)
        if self.server is not None and (not self.server.alive or self.server.key != server_key(command, env)):
            self._close_server()
        if self.server is None:
            self.server = ForkServer(
                command, env, Path(tempfile.mkdtemp(prefix="cp-fork-server-", dir=self.config.log_dir))
            )
        assert self._listen is not None and self._workdir is not None
        try:
            return self.server.spawn(
                connect=f"{self._listen[0]}:{self._listen[1]}",
                stack_dir=str(self._workdir),
                log=str(log),
                env=env,
                timeout=max(deadline - time.monotonic(), 0.0),
            )
        except (ForkServerGone, TimeoutError) as exc:
            log.write_text(self.server.log_text() + "\n")
            code = exc.code if isinstance(exc, ForkServerGone) else None  # None: still importing at the deadline
            self._close_server()
            raise RuntimeError(self._start_failure({} if code is None else {0: code})) from None

    def _close_server(self) -> None:
        if self.server is not None:
            self.server.close()
            shutil.rmtree(self.server.folder, ignore_errors=True)
            self.server = None

    def close(self, graceful: bool = True) -> None:
        """Stop every rank and launcher, and the fork server: the pool is closed (``start`` starts all again)."""
        self.shutdown(graceful)
        self._close_server()

    def _rendezvous(self, listener: socket.socket, deadline: float) -> None:
        """Accept every rank's connection, its phases and its hello before ``deadline``, or raise ``RuntimeError``
        naming the timeout that fired, the ranks that never connected and where the others got to."""
        cfg = self.config
        starting: dict[socket.socket, int | None] = {}  # connected, no hello yet -> its rank once it said
        try:
            while len(self.socks) < cfg.world_size:
                remaining = deadline - time.monotonic()
                exited = {node: code for node, p in self.agents.items() if (code := p.poll()) is not None}
                if remaining <= 0 or exited:
                    raise RuntimeError(self._start_failure(exited))
                ready = select.select([listener, *starting], [], [], min(remaining, 1.0))[0]
                for sock in ready:
                    if sock is listener:
                        conn, _ = listener.accept()
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        starting[conn] = None
                        continue
                    try:
                        body, _ = wire.recv(sock, timeout=max(deadline - time.monotonic(), 1.0))
                    except wire.WireError:
                        # A rank ended (by the launcher, after another rank failed) while starting: the next turn
                        # of the loop sees the launcher exit and reports the rank that failed.
                        rank = starting.pop(sock)
                        sock.close()
                        if rank is not None:
                            self.progress[rank]["what"] += " (then its connection closed)"
                        continue
                    rank = int(body.get("rank", -1))
                    starting[sock] = rank
                    if body.get("op") == "phase":
                        self.progress[rank] = {**self.progress.get(rank, {}), **body, "at": time.monotonic()}
                        continue
                    if body.get("op") != "hello":
                        raise RuntimeError(f"rank {rank} sent {str(body)[:200]} while starting")
                    if self.launcher == "external" and body.get("launcher") in ("torchrun", "slurm"):
                        pass
                    elif body.get("launcher") != self.launcher:
                        raise RuntimeError(
                            f"rank {rank} was started by {body.get('launcher')!r}, not {self.launcher!r}"
                        )
                    del starting[sock]
                    self.socks[rank] = sock
                    self._pids[rank] = int(body["pid"])
                    self.hello[rank] = body
        finally:
            for sock in starting:
                sock.close()

    def _start_failure(self, exited: dict[int, int]) -> str:
        cfg = self.config
        lines = [
            start_timeout_report(
                world=cfg.world_size,
                ready=sorted(self.socks),
                progress=self.progress,
                exited=exited,
                timeout_text=cfg.start_timeout_text,
                launcher=self.launcher,
                nodes=cfg.nnodes,
                last_lines={r: self.rank_log_tail(r, 1) for r in range(cfg.world_size) if r not in self.socks},
                now=time.monotonic(),
            )
        ]
        lines.append(start_failure_report(exits_in_log(self.log_tail(1 << 24)), self.rank_errors()))
        return "\n".join(lines) + f"{self.launcher} log tail:\n{self.log_tail()}"

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank and launcher; leaves no process of this machine behind.

        ``graceful``: ask the ranks to leave and give them 5 s; otherwise (after a
        failure, when ranks may be stuck) kill at once.
        """
        if self.generation is not None and not self.config.restartable and self.lost is None:
            self.lost = "the pool was shut down"
        self.generation = None
        for sock in self.socks.values():
            try:
                wire.send(sock, SHUTDOWN)
            except OSError:
                pass
        for proc in self.agents.values():
            if graceful and proc.poll() is None:
                try:
                    proc.wait(timeout=5 if self.socks else 0.1)
                except subprocess.TimeoutExpired:
                    pass
        if graceful and not self.agents and self.socks:  # ranks started elsewhere: they leave on the message
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(process_alive(pid) for pid in self._local_pids()):
                time.sleep(0.1)
        self._kill_tree()
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()
        self._pids.clear()
        for log in self._logs:
            log.close()
        self._logs = []
        self.agents = {}

    def _kill_tree(self) -> None:
        for proc in self.agents.values():
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=3)
                    # the launcher may be gone while a rank lingers in the same session: sweep it too.
                except subprocess.TimeoutExpired:
                    continue
        for pid in self._local_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _local_pids(self) -> list[int]:
        """The ranks' process ids on this machine (a rank on another node leaves when its connection closes)."""
        here = socket.gethostname()
        return [pid for rank, pid in self._pids.items() if self.hello.get(rank, {}).get("host", here) == here]

    def cleanup_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    # ------------------------------------------------------------------ what a failure needs
    def log_tail(self, limit: int = 4000) -> str:
        """The tail of the launcher's log (of each local node's, headed by its node, when there are several)."""
        if self._workdir is None:
            return "(no log)"
        logs = sorted(self._workdir.glob("node*.log")) or [self._workdir / "launcher.log"]
        parts = []
        for path in logs:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            parts.append(text[-limit:] if len(logs) == 1 else f"--- {path.stem} ---\n{text[-limit:]}")
        return "\n".join(parts) if parts else "(no log)"

    def rank_log_tail(self, rank: int, lines: int = 20) -> str | None:
        """The last ``lines`` non-blank lines rank ``rank`` wrote (its own log; ``None``: none here)."""
        if self._workdir is None:  # never started
            return None
        try:
            text = (self._workdir / f"rank{rank}.log").read_text(errors="replace")
        except OSError:
            return None
        kept = [line for line in text.splitlines() if line.strip()]
        return "\n".join(kept[-lines:]) if kept else ""

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
        """The exit code of the launcher that ended (waiting up to 5 s for one; ``None``: all still run, or none
        was started here)."""
        deadline = time.monotonic() + 5
        while self.agents and time.monotonic() < deadline:
            for proc in self.agents.values():
                if proc.poll() is not None:
                    return proc.returncode
            time.sleep(0.05)
        return None

    def exited_agents(self) -> dict[int, int]:
        """Node -> exit code of each local launcher that has ended."""
        return {node: code for node, p in self.agents.items() if (code := p.poll()) is not None}

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask ``ranks`` for their stacks (SIGUSR1) and return the dump each wrote for this request (rank -> its
        text; a rank's file holds every dump it wrote since it started, so only what it added now is returned)."""
        if self._workdir is None:
            return {}
        files = {rank: self._workdir / f"rank{rank}.stack" for rank in ranks}
        before = {rank: (path.stat().st_size if path.exists() else 0) for rank, path in files.items()}
        for rank in ranks:
            pid = self._pids.get(rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(STACK_DUMP_WAIT)
        stacks = {}
        for rank, path in files.items():
            try:
                with path.open("rb") as dump:
                    dump.seek(before[rank])
                    stacks[rank] = dump.read().decode(errors="replace")
            except OSError:
                continue
        return stacks

    def where(self, rank: int) -> str:
        """``node 1 (host h, torchrun pid 123)`` for a rank that said hello, else ``""``."""
        hello = self.hello.get(rank)
        if not hello or self.config.nnodes == 1:
            return ""
        return f"node {hello.get('node')} (host {hello.get('host')}, {hello.get('launcher')} pid {hello.get('launcher_pid')})"
