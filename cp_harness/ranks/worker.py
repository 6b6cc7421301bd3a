"""One rank of the persistent pool (see ``cp_harness.ranks.pool``), and the launcher that starts them.

Ranks are started one of three ways, each with its launcher's environment (``cp_harness.ranks.startup``):

- ``--ranks N`` (the default launcher for gloo): this process imports torch,
  the checks, the implementations and the model specs named in
  ``--preload`` once, then forks ``N`` ranks and waits
  for them; when one exits abnormally it ends the others and exits non-zero
  (what torchrun's monitor does). A rank then costs no import of its own:
  8 ranks cost one Python start-up, not 9.
- under ``torchrun`` (``PoolConfig(launcher="torchrun")``; the default for
  nccl, and the fresh-torchrun baseline of ``cp_harness bench``), on one node
  or several (``--nnodes``, c10d rendezvous);
- under ``srun`` (SLURM's environment; ``PoolConfig(launcher="external")``: the pool only listens).

Each rank connects to the test process first and says what it is doing at each
step of its start; it then joins the process group (its store waits
``--start-timeout`` for every rank), loads the implementation and says hello.
Then it runs one request at a time: a case (sent only to the case's ranks), or
a mesh to build (sent to every rank: building a mesh creates process groups,
which every rank of the default group must do, in the same order). A case
runs on today's CP mesh over ranks ``0..n-1`` or on ``world_mesh["cp"]`` of the
world mesh its ``mesh_layout`` names; its communication is confined to its CP
group (``cp_harness.instruments.leaks``).

Every wait is bounded: collectives by the process-group timeout, the wait for
the next request by ``--idle-timeout``; a closed connection ends the rank, and
so does the loss of its launcher.
On ``SIGUSR1`` a rank writes the stacks of all its threads to
``<stack-dir>/rank<r>.stack`` so that the test process can show where a hung
rank was; its output goes to ``<stack-dir>/rank<r>.log``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connect", required=True, help="host:port of the test process")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument(
        "--impl",
        default="cp_impl",
        help="module(s) exposing inkling2 and mistral_large4, comma-separated; a case's 'impl' picks one",
    )
    parser.add_argument("--collective-timeout", type=float, default=60.0, help="seconds before a collective gives up")
    parser.add_argument(
        "--idle-timeout", type=float, default=3600.0, help="seconds without a request before the rank exits"
    )
    parser.add_argument("--stack-dir", default=None, help="folder for stack dumps on SIGUSR1")
    parser.add_argument("--preload", default="", help="model spec modules (comma-separated) the launcher imports once")
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="start this many ranks by forking this process after its imports (without it: one rank, "
        "started by torchrun or srun)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=180.0,
        help="seconds the store waits for every rank to join (the pool grows it with the rank count)",
    )
    parser.add_argument(
        "--rank-order",
        default="blocked",
        choices=("blocked", "cyclic"),
        help="blocked: the launcher's ranks; cyclic: rank r on node r %% nnodes",
    )
    parser.add_argument(
        "--fork-server",
        action="store_true",
        help="with --ranks: import once, then fork a launcher for each start the pool asks for on stdin "
        "(cp_harness.ranks.fork_server)",
    )
    return parser.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_error(stack_dir: str | None, rank: int, text: str) -> None:
    """Keep a rank's own traceback in ``<stack-dir>/rank<r>.error``: in the shared log it is interleaved with,
    and pushed out of the tail by, the lines of the ranks ended after it (the pool shows it first)."""
    if not stack_dir:
        return
    try:
        with open(os.path.join(stack_dir, f"rank{rank}.error"), "w") as f:
            f.write(text)
    except OSError:
        pass


def launch(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Import once, fork ``args.ranks`` ranks, wait for them (see the module docstring); returns the exit status."""
    import_once(args)
    return fork_ranks(args, argv)


def import_once(args: argparse.Namespace) -> None:
    """What every rank needs, imported in the launcher before it forks them (each rank then costs no import)."""
    if args.backend == "nccl":
        # Forked ranks must not inherit an initialised CUDA context; nothing here touches CUDA before the fork,
        # but the nccl pool has only ever run under torchrun, which PoolConfig chooses for it.
        print("cp_harness.ranks.worker: --ranks with nccl is untested; use torchrun", file=sys.stderr, flush=True)
    import torch
    import torch.distributed  # noqa: F401 - imported once for every rank
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401

    from cp_harness.cases.implementation import impl_names, load_impl
    from cp_harness.checks import load_checks

    torch.set_num_threads(1)  # before any tensor work: no OpenMP pool may exist at the fork
    # What the ranks would otherwise import on their own, each in its own pages: autograd's backward with an
    # explicit gradient imports symbolic_shapes, i.e. sympy and mpmath (about 490 modules, 2.5 s of CPU). On the
    # first such case 64 ranks importing it at once on 2 cores took over 60 s, past the case timeout.
    import encodings.idna  # noqa: F401 - socket.create_connection("127.0.0.1") imports it

    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    from cp_harness.instruments import comm_meter, coverage  # noqa: F401 - the rank's own imports
    from cp_harness.ranks import wire  # noqa: F401

    for name in impl_names(args.impl):
        load_impl(name)  # one that does not import stops the launcher here; the pool shows its traceback
    load_checks()
    from cp_harness.usage.model_specs import preload

    for problem in preload(args.preload):  # the real models' specs (and transformers), once
        print(f"cp_harness.ranks.worker: {problem}", file=sys.stderr, flush=True)
    if args.preload:
        _probe_vector_isa()
    import threading

    if threading.active_count() > 1:  # a fork carries only this thread over; the others' locks may be held
        print(
            f"cp_harness.ranks.worker: importing {args.impl} started {threading.active_count() - 1} Python thread(s); "
            f"forked ranks do not have them. If cases hang, start the ranks with torchrun "
            f"(--cp-launcher torchrun / --launcher torchrun).",
            file=sys.stderr,
            flush=True,
        )


def _probe_vector_isa() -> None:
    """Inductor's check of the CPU's vector instructions, answered once here for every rank of a model pool.

    The real models' compiled functions (the framework's ``torch.compile``) ask it whenever inductor generates C++
    (a shape its cache does not hold: every compile on a clean machine). It loads a probe library in child
    interpreters (0.85 s of CPU here, once per process: ``functools.cache``), so without this every forked rank that
    compiled ran its own: 64 children, 12.5 CPU-s in a warm ``real_clients --examples 10``. A pool whose ranks only
    hit the cache pays the 0.85 s for nothing (the default command's two model pools on a warm machine). The answer
    is the same: the ranks run on this machine with this environment."""
    from torch._inductor import cpu_vec_isa

    bool(cpu_vec_isa.pick_vec_isa())


def fork_ranks(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Fork ``args.ranks`` ranks from this (imported) process and wait for them; the first rank that exits abnormally
    is named on stderr (``diagnosis.exit_line``) and ends the others. Returns this launcher's exit status."""
    from cp_harness.ranks.diagnosis import exit_line

    world = args.ranks
    env = {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    children: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
                code = main(argv)
            except BaseException:  # noqa: BLE001 - the traceback goes to the pool's log
                traceback.print_exc()
                _write_error(args.stack_dir, rank, traceback.format_exc())
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    status = 0
    while children:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            break
        ended = children.pop(pid, None)
        code = os.waitstatus_to_exitcode(wait_status)
        if ended is None or code == 0:
            continue
        # The pool names the rank of the first such line as the one that failed (diagnosis.exits_in_log).
        print(exit_line(ended, pid, code, children.values()), file=sys.stderr, flush=True)
        status = status or 1
        for other in children:
            try:
                os.kill(other, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return status


def serve_forks(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--fork-server``: import once, then start a launcher for each start the pool asks for (``cp_harness.ranks.fork_server``).

    Reads one JSON request a line on stdin (``fork_server.spawn_request``: the start's ``--connect``, ``--stack-dir``,
    log file and environment); forks a launcher for it, which runs ``fork_ranks`` with its output in that log, in a
    process group of its own (the pool ends a start with ``killpg``). Answers on what was stdout:
    ``spawned <pid>`` once the launcher's group exists, ``exit <pid> <code>`` when it ends (``code`` as
    ``Popen.returncode``: negative for a signal). Leaves when stdin closes (the pool closed, or its process died).
    """
    import json
    import select

    from cp_harness.ranks import fork_server

    replies = os.dup(1)  # the pool's pipe; stdout itself goes to stderr, the server's log, so no print corrupts it
    os.dup2(2, 1)
    import_once(args)
    sys.stdout.flush()
    sys.stderr.flush()
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, not SIG_IGN: ended launchers must stay reapable
    launchers: set[int] = set()
    pending = b""
    while True:
        ready = select.select([0, wake_read], [], [], 1.0)[0]
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
        while launchers:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in launchers:
                launchers.discard(pid)
                os.write(replies, fork_server.exit_line(pid, os.waitstatus_to_exitcode(status)))
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return 0  # the pool is gone; its launchers' ranks leave when their connections close
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the start's launcher
                code = 1
                try:
                    os.setpgid(0, 0)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_read, wake_write, replies):
                        os.close(fd)
                    child_argv = fork_server.launcher_argv(argv or sys.argv[1:], request)
                    fork_server.enter_start(request)
                    code = fork_ranks(_parse_args(child_argv), child_argv)
                except BaseException:  # noqa: BLE001 - the traceback goes to the start's log
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            try:
                os.setpgid(pid, pid)  # as the child does: whichever runs first, the group exists before the answer
            except (PermissionError, ProcessLookupError):
                pass
            launchers.add(pid)
            os.write(replies, fork_server.spawned_line(pid))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    forked = args.ranks is not None
    if args.fork_server:
        return serve_forks(args, argv)
    if forked and "RANK" not in os.environ:
        return launch(args, argv)
    from cp_harness.ranks import startup

    place = startup.placement(forked, args.rank_order)
    rank = place.rank
    startup.own_log(args.stack_dir, rank)
    if args.stack_dir:
        stack_file = open(os.path.join(args.stack_dir, f"rank{rank}.stack"), "w")  # noqa: SIM115 - lives as long as the rank
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    phases = startup.Phases(args.connect, place, args.start_timeout)
    startup.watch_launcher(phases)

    import torch
    import torch.distributed as dist

    from cp_harness.checks import RankContext, run_on_rank
    from cp_harness.instruments import comm_meter as comm
    from cp_harness.instruments import coverage
    from cp_harness.ranks import wire

    torch.set_num_threads(1)
    if args.backend == "nccl":
        torch.cuda.set_device(place.local_rank)
        device = torch.device("cuda", place.local_rank)
    else:
        device = torch.device("cpu")
    if args.backend == "gloo":
        # Connect gloo pairs when a collective first uses them, not a full mesh per group at the start: with a
        # subgroup per CP size, eager setup opens sum(n*(n-1)/2) connections (43,680 at 64 ranks), took 23-40 s
        # on 2 cores and failed the start when one rank's share outlasted the collective timeout.
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        # One compile cache per rank: ranks compiling the same kernel at once into one folder loaded each other's
        # half-written files ("file too short", "invalid ELF header"; the real models' MoE kernels).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{os.environ['TORCHINDUCTOR_CACHE_DIR']}-rank{place.local_rank}"
    phases.say(
        f"joining the process group ({args.backend}; store at {os.environ.get('MASTER_ADDR')}:"
        f"{os.environ.get('MASTER_PORT')}, waiting up to {args.start_timeout:.0f} s for {place.world_size} ranks)"
    )
    startup.join(
        args.backend,
        place,
        start_timeout=args.start_timeout,
        collective_timeout=args.collective_timeout,
        device=device if args.backend == "nccl" else None,
    )
    meshes = startup.MeshBook(rank, place.world_size, device.type, args.collective_timeout)

    phases.say(f"in the process group; loading {args.impl}")
    from cp_harness.cases.implementation import case_impl, impl_names, load_impl
    from cp_harness.cases.meshes import mesh_key
    from cp_harness.checks import load_checks

    # Every one imports, or the rank stops here; calls through the documented API are recorded per case.
    impls = {name: coverage.instrument(load_impl(name)) for name in impl_names(args.impl)}
    load_checks()
    # After the implementations and the checks are imported: operators they define are hooked too.
    comm.install()

    phases.send(
        {
            "op": "hello",
            **place.identity(),
            "backend": args.backend,
            "device": str(device),
            "torch": torch.__version__,
            "impl": args.impl,
        }
    )
    sock = phases.sock
    exit_code = 0
    while True:
        try:
            body, arrays = wire.recv(sock, timeout=args.idle_timeout)
        except wire.WireError:
            break  # the test process went away or stayed silent too long: nothing left to do
        if body.get("op") == "shutdown":
            break
        if body.get("op") not in ("run", "mesh"):
            continue
        taken = time.monotonic()  # for the pool's transport figures (same clock as the test process)
        started = time.perf_counter()
        info: dict = {}
        tensors: dict = {}
        reply: dict = {"op": "result", "case_id": body["case_id"], "rank": rank}
        try:
            if body["op"] == "mesh":  # every pool rank, in the same order: it creates process groups
                if "layout" in body:
                    info = meshes.layout(body["layout"])
                else:
                    meshes.prefix(int(body["prefix"]))
                    info = {}
                reply.update(ok=True, info=info, comm=[], called=[])
            else:
                case = body["case"]
                name = case_impl(case, args.impl)
                if name not in impls:  # a case naming another module (run-case): loaded on first use
                    impls[name] = coverage.instrument(load_impl(name))
                    comm.install()  # hooks operators the new module defined
                held = meshes.get(mesh_key(case))
                assert held.cp_rank is not None, f"rank {rank} is not on the mesh {mesh_key(case)} of its case"
                context = RankContext(
                    rank=held.cp_rank,
                    cp_size=int(case["world_size"]),
                    mesh=held.cp_mesh,
                    device=device,
                    backend=args.backend,
                    impl=impls[name],
                    global_rank=rank,
                    group=held.group,
                )
                with comm.recording(allowed=held.members) as calls, coverage.recording() as called:
                    info, tensors = run_on_rank(case, context)
                reply.update(
                    ok=True,
                    info=info,
                    comm=[c.as_dict() for c in calls],
                    called=sorted(called),
                    cp_rank=held.cp_rank,
                    group=held.group,
                )
        except BaseException as exc:  # noqa: BLE001 - everything is reported, SystemExit included
            tensors = {}
            reply.update(ok=False, error_type=type(exc).__name__, message=str(exc), traceback=traceback.format_exc())
            if isinstance(exc, SystemExit):
                exit_code = int(exc.code or 0) if isinstance(exc.code, int) else 1
        reply["seconds"] = time.perf_counter() - started
        reply["t_start"], reply["t_end"] = taken, time.monotonic()
        try:
            phases.send(reply, tensors)
        except OSError:
            break
        if exit_code:
            break
    try:
        sock.close()
    finally:
        if exit_code == 0:
            dist.destroy_process_group()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
