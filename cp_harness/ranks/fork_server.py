"""The fork launcher's server: one process imports torch and the implementations once per pool, then forks a fresh
launcher for every start of that pool.

Without it each start of a ``launcher="fork"`` pool runs ``python -m cp_harness.ranks.worker --ranks N``, which
imports torch, the checks, the implementations and the preloaded model specs again (1.6 s of CPU plain, 2.8 s with
the framework's adapters, on this project's 2-core machines) before it forks the ranks; a pool starts again after
every case a rank fails in. With it, the pool keeps one ``worker --ranks N --fork-server`` process
(``worker.serve_forks``) and each start asks it for a launcher: a fork of the imported process that runs the same
``worker.fork_ranks`` as ``launch`` does, in a process group of its own, its output in the start's
``launcher.log``. What the pool sees of a start is unchanged: a launcher process (``Launcher``, the part of
``subprocess.Popen`` that ``lifecycle`` uses) that exits non-zero, naming the rank, when a rank dies.

The server is reused only while the pool's launcher command, environment and working folder are the ones it was
started with (``ForkServer.key``): anything a start's imports could depend on starts a new server. It leaves
when its stdin closes (the pool closed it, or the test process died).

Messages, one line each: the pool sends ``spawn_request`` (JSON), the server answers ``spawned <pid>`` once the
launcher's process group exists and ``exit <pid> <code>`` when that launcher ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

# Environment variables that change between starts without changing what a start imports: the test that is
# running (pytest sets it per phase) and the start's own error file. A start gets them in its request.
PER_START_ENV = ("PYTEST_CURRENT_TEST", "TORCHELASTIC_ERROR_FILE")
PER_START_ARGS = ("--connect=", "--stack-dir=")


class ForkServerGone(RuntimeError):
    """The server exited (``code``; its log, ``ForkServer.log_text``, says why: most often an implementation that
    does not import)."""

    def __init__(self, code: int | None):
        super().__init__(f"the fork launcher's server exited (exit code {code})")
        self.code = code


# ---------------------------------------------------------------------- the messages
def spawned_line(pid: int) -> bytes:
    return f"spawned {pid}\n".encode()


def exit_line(pid: int, code: int) -> bytes:
    return f"exit {pid} {code}\n".encode()


def spawn_request(*, connect: str, stack_dir: str, log: str, server_log: str, env: dict[str, str]) -> bytes:
    """One start's request: where its ranks connect and keep their logs, its launcher's log, its environment."""
    return (
        json.dumps({"connect": connect, "stack_dir": stack_dir, "log": log, "server_log": server_log, "env": env})
        + "\n"
    ).encode()


def launcher_argv(argv: list[str], request: dict) -> list[str]:
    """The server's own arguments with the start's ``--connect`` and ``--stack-dir``, without ``--fork-server``."""
    kept = [a for a in argv if not a.startswith(PER_START_ARGS) and a != "--fork-server"]
    return [*kept, f"--connect={request['connect']}", f"--stack-dir={request['stack_dir']}"]


def enter_start(request: dict) -> None:
    """In the forked launcher: its output to the start's log (headed by what the server printed while importing,
    as a launcher that imported for itself would have), no stdin, the start's environment."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        with open(request["server_log"], "rb") as imported:
            os.write(fd, imported.read())
    except OSError:
        pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])


# ---------------------------------------------------------------------- the pool's side
def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has exited: only its exit status waits for its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def server_key(command: list[str], env: dict[str, str]) -> tuple:
    """What a server must have been started with to serve a start of ``command`` in ``env`` (see module docstring)."""
    try:
        folder = os.getcwd()
    except FileNotFoundError:  # the working folder was deleted: a launcher started now would inherit it as it is
        folder = None
    return (
        tuple(a for a in command if not a.startswith(PER_START_ARGS)),
        tuple(sorted((k, v) for k, v in env.items() if k not in PER_START_ENV)),
        folder,
    )


class Launcher:
    """One start's launcher, forked by the server: ``pid``, ``poll()``, ``wait(timeout)``, ``returncode`` as on a
    ``subprocess.Popen`` (its exit code comes from the server, which is its parent)."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout or 0.0)
            self.server.read(0.05 if left is None else min(left, 0.05))
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """The server process of one pool (see module docstring); ``folder`` holds its log."""

    def __init__(self, command: list[str], env: dict[str, str], folder: Path):
        self.key = server_key(command, env)
        self.folder = folder
        self.log_path = folder / "fork-server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [*command, f"--stack-dir={folder}", "--fork-server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._pending = b""
        self._spawned: deque[int] = deque()
        self._exits: dict[int, int] = {}

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def read(self, timeout: float = 0.0) -> None:
        """Take in what the server answered (waiting up to ``timeout`` s for a first answer)."""
        if not select.select([self._fd], [], [], max(timeout, 0.0))[0]:
            return
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            self._pending += data
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            what, *values = line.decode().split()
            if what == "spawned":
                self._spawned.append(int(values[0]))
            elif what == "exit":
                self._exits[int(values[0])] = int(values[1])

    def exit_code(self, pid: int) -> int | None:
        """The exit code of launcher ``pid``, ``None`` while it runs. A launcher that outlived a server that died
        is its own parent's business: gone, it counts as exit code 1."""
        self.read()
        if pid in self._exits:
            return self._exits[pid]
        if not self.alive and not process_alive(pid):
            self.read()
            return self._exits.get(pid, 1)
        return None

    def spawn(self, *, connect: str, stack_dir: str, log: str, env: dict[str, str], timeout: float) -> Launcher:
        """A launcher for one start (``ForkServerGone`` if the server exited, ``TimeoutError`` if it did not answer
        within ``timeout`` s: still importing)."""
        request = spawn_request(connect=connect, stack_dir=stack_dir, log=log, server_log=str(self.log_path), env=env)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.proc.wait()
            raise ForkServerGone(self.proc.returncode) from None
        deadline = time.monotonic() + timeout
        while not self._spawned:
            if not self.alive:
                self.read()
                if self._spawned:
                    break
                raise ForkServerGone(self.proc.returncode)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the fork launcher's server did not start a launcher within {timeout:.0f} s")
            self.read(min(left, 0.5))
        return Launcher(self, self._spawned.popleft())

    def close(self) -> None:
        """End the server (its launchers are the pool's to end first) and close its log."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self.alive:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
