"""How one rank comes up, and the meshes it builds: the rank side of the pool's start (``cp_harness.ranks.worker``).

- ``placement()``: which rank this process is, from its launcher's environment: the fork launcher's and
  torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK`` for the node) or SLURM's
  (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``). ``rank_order="cyclic"`` numbers
  the ranks round-robin over the nodes (rank ``r`` on node ``r % nnodes``, as ``srun --distribution=cyclic``
  does), so that consecutive CP ranks sit on different nodes.
- ``own_log()``: the rank's stdout and stderr go to ``<dir>/rank<r>.log`` (a start failure shows each rank's
  last line, not an interleaved tail).
- ``Phases``: the rank connects to the test process first and says what it is doing at each step of the
  start (``{"op": "phase"}``), so a pool that does not come up can say where every rank got to, remote ones too.
- ``join()``: the store and the process group; the store waits ``start_timeout`` for every rank (the pool grows
  it with the rank count), collectives ``collective_timeout``.
- ``MeshBook``: the meshes cases run on, built on request: today's one-dimensional CP mesh over ranks
  ``0..N-1`` (``prefix``), or a world mesh of a ``cp_harness.cases.meshes.MeshLayout`` (``layout``), built the
  framework's way (``DeviceMesh(device_type, ranks, mesh_dim_names=dims)`` on every pool rank, then
  ``world_mesh["cp"]`` on its members).
- ``watch_launcher()``: a rank whose launcher (torchrun's agent, the fork launcher) is gone tells the test
  process and exits, as the processes of a lost node would, instead of serving on as an orphan.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import threading
import time

from cp_harness.cases.meshes import MeshLayout
from cp_harness.ranks import wire

LAUNCHER_POLL_S = 0.5  # how often a rank checks that its launcher is still there
LOST_EXIT_CODE = 70  # a rank's exit status when its launcher disappeared


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a rank is: ``rank`` of ``world_size`` (the process group's), ``local_rank`` on ``node`` of
    ``nnodes``, and who started it (``launcher``: ``"fork"``, ``"torchrun"`` or ``"slurm"``)."""

    rank: int
    world_size: int
    local_rank: int
    node: int
    nnodes: int
    launcher: str

    def identity(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "node": self.node,
            "nnodes": self.nnodes,
            "launcher": self.launcher,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "launcher_pid": os.getppid(),
        }


def placement(forked: bool, rank_order: str = "blocked", environ=None) -> Placement:
    """This rank's ``Placement`` from the environment its launcher set (``ValueError`` naming what is missing)."""
    env = os.environ if environ is None else environ
    if "RANK" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        node, nnodes = int(env.get("GROUP_RANK", 0)), int(env.get("GROUP_WORLD_SIZE", 1))
        launcher = "fork" if forked else "torchrun"
        per_node = int(env.get("LOCAL_WORLD_SIZE", world // max(nnodes, 1)))
    elif "SLURM_PROCID" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local, node, nnodes = (
            int(env.get("SLURM_LOCALID", 0)),
            int(env.get("SLURM_NODEID", 0)),
            int(env.get("SLURM_NNODES", 1)),
        )
        launcher, per_node = "slurm", world // max(nnodes, 1)
    else:
        raise ValueError(
            "no rank in the environment: start the worker with torchrun (RANK, WORLD_SIZE), srun "
            "(SLURM_PROCID, SLURM_NTASKS) or --ranks N"
        )
    if rank_order == "cyclic":
        if per_node * nnodes != world:
            raise ValueError(
                f"--rank-order cyclic needs the same number of ranks on every node: {world} ranks on {nnodes} nodes"
            )
        rank = local * nnodes + node  # rank r on node r % nnodes
    return Placement(rank, world, local, node, nnodes, launcher)


def own_log(directory: str | None, rank: int) -> None:
    """Send this process's stdout and stderr (Python's and the C++ libraries') to ``<directory>/rank<r>.log``."""
    if not directory:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(directory, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class Phases:
    """The rank's connection to the test process, opened before anything else of the start (see the module
    docstring); ``send`` is safe from the launcher watchdog's thread too."""

    def __init__(self, address: str, place: Placement, timeout: float):
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while True:  # the test process listens before any rank starts; a refused connect is retried until then
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 1))
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.place = place
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.say("connected", **place.identity())

    def send(self, body: dict, arrays=None) -> None:
        with self.lock:
            wire.send(self.sock, body, arrays)

    def say(self, what: str, **extra) -> None:
        """Tell the test process what the rank is doing now (it shows the last one if the start fails)."""
        print(f"cp_harness rank {self.place.rank}: {what}", file=sys.stderr, flush=True)
        self.send(
            {
                "op": "phase",
                "rank": self.place.rank,
                "what": what,
                "seconds": round(time.monotonic() - self.started, 3),
                **extra,
            }
        )


def join(backend: str, place: Placement, *, start_timeout: float, collective_timeout: float, device=None):
    """Join the default process group: the store (created here, so that its timeout is ``start_timeout`` and
    not the collectives') at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent store when it offers one), then the
    group with ``collective_timeout``."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    waiting = datetime.timedelta(seconds=start_timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(host, port, place.world_size, False, timeout=waiting)
    else:
        store = dist.TCPStore(host, port, place.world_size, place.rank == 0, timeout=waiting, multi_tenant=True)
    collective = datetime.timedelta(seconds=collective_timeout)
    store.set_timeout(collective)  # after every rank joined: a lost peer fails a collective, not the start
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=place.rank,
        world_size=place.world_size,
        timeout=collective,
        device_id=device,
    )
    return store


@dataclasses.dataclass
class Built:
    """A mesh one rank holds: its CP mesh (``None`` off the world mesh), CP group index and CP rank, the global
    ranks of its CP group, and the world mesh."""

    cp_mesh: object
    group: int | None
    cp_rank: int | None
    members: tuple[int, ...]
    world_mesh: object = None


class MeshBook:
    """The meshes of one rank, by key (``cp_harness.cases.meshes.mesh_key``); ``build`` runs on every pool rank
    in the same order (it creates process groups), ``get`` on the ranks of the case."""

    def __init__(self, rank: int, world_size: int, device_type: str, timeout: float):
        self.rank, self.world_size, self.device_type = rank, world_size, device_type
        self.timeout = datetime.timedelta(seconds=timeout)
        self.built: dict[str, Built] = {}
        self.prefix(world_size)  # the whole pool: the default group, nothing to create

    def prefix(self, n: int) -> None:
        """Today's CP mesh of size ``n`` over ranks ``0..n-1`` (a subgroup, or the default group for all)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        group = dist.group.WORLD if n == self.world_size else dist.new_group(list(range(n)), timeout=self.timeout)
        assert group is not None  # the rank has joined the default process group
        mesh = DeviceMesh.from_group(group, self.device_type, mesh_dim_names=("cp",)) if self.rank < n else None
        self.built[f"prefix:{n}"] = Built(
            mesh, 0 if self.rank < n else None, self.rank if self.rank < n else None, tuple(range(n))
        )

    def layout(self, spec: dict) -> dict:
        """A world mesh as a layout describes it; returns what this rank holds of it (for the pool's checks)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        layout = MeshLayout.parse(spec, pool_size=self.world_size)
        world = DeviceMesh(self.device_type, torch.tensor(layout.nested(), dtype=torch.int), mesh_dim_names=layout.dims)
        where = layout.place(self.rank)
        if where is None:
            self.built[layout.key] = Built(None, None, None, ())
            return {"in_mesh": False}
        cp_mesh = world["cp"]
        group, cp_rank = where
        members = layout.groups()[group]
        if int(cp_mesh.get_local_rank()) != cp_rank or int(cp_mesh.size()) != len(members):
            raise RuntimeError(
                f"mesh {layout.label()}: torch puts global rank {self.rank} at CP rank "
                f"{cp_mesh.get_local_rank()} of {cp_mesh.size()}, the layout at {cp_rank} of "
                f"{len(members)} (cp_harness.cases.meshes and torch disagree)"
            )
        self.built[layout.key] = Built(cp_mesh, group, cp_rank, members, world)
        return {"in_mesh": True, "group": group, "cp_rank": cp_rank}

    def get(self, key: str) -> Built:
        if key not in self.built:
            raise RuntimeError(
                f"rank {self.rank} holds no mesh {key}: the pool sends a mesh request to every rank "
                f"before the first case on it"
            )
        return self.built[key]


def watch_launcher(phases: Phases) -> None:
    """Exit (``LOST_EXIT_CODE``) once this rank's parent, its launcher, is gone, telling the test process why."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        place = phases.place
        reason = f"its launcher ({place.launcher}, pid {parent}) on node {place.node} ({socket.gethostname()}) is gone"
        print(f"cp_harness rank {place.rank}: {reason}; exiting", file=sys.stderr, flush=True)
        try:
            phases.send({"op": "lost", "rank": place.rank, "node": place.node, "reason": reason})
        except OSError:
            pass
        os._exit(LOST_EXIT_CODE)

    threading.Thread(target=watch, name="cp-harness-launcher-watch", daemon=True).start()
