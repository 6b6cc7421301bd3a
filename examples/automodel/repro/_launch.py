"""Run a repro's ``main(rank, world, args) -> exit status`` on gloo ranks: under ``torchrun``, or self-started.

Shared by the repro scripts beside this file (they stay runnable as ``python <script>.py``), with what they
have in common: ``FixedGather`` (the sequence gather proposed upstream, ``--fixed``) and ``leave(ok)`` (the
ranks agree on the verdict and leave together). Exit status: 0 when every rank returned 0, else 1; a rank left
waiting in a collective by a peer that raised is killed after ``timeout`` seconds.

Self-started ranks are forked from this process after it has imported torch and the ``preload`` modules (the
framework functions under test), so a rank costs no import of its own: importing nemo-automodel's CP modules
takes about 4 s of CPU, and a repro of four ranks spent most of its time on that. Nothing has touched a
process group, a thread pool or a device before the fork; each rank joins its own gloo group after it.

``python _launch.py SCRIPT.py ...`` runs each script's command line, as it is and with ``--fixed``, in this
one interpreter (torch and the framework imported once for all of them) and prints one JSON object per run:
``{"script", "fixed", "exit", "output"}``. Its own exit status is 0 when every script exits 1 as it is and 0
fixed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class FixedGather(torch.autograd.Function):
    """``[B, L, ...]`` -> ``[B, N*L, ...]`` along ``dim``, the gather proposed upstream: an all-gather forward;
    a backward that reduce-scatters *contiguous* gradient slices into a contiguous buffer (D1, D2: no
    ``empty_like`` of a permuted gradient, no global-rank peers), summing bfloat16/float16 slices in float32
    and rounding once (D4), and never writing into the gradient it is handed (D3)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        wide = torch.float32 if grad.dtype in (torch.bfloat16, torch.float16) else grad.dtype
        pieces = [p.to(wide).contiguous() for p in grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)]
        mine = torch.empty(pieces[0].shape, dtype=wide, device=grad.device)
        dist.reduce_scatter(mine, pieces, group=ctx.group)
        return mine.to(grad.dtype), None, None


def leave(ok: bool) -> int:
    """Agree with every rank on the verdict (all must be right) and leave the process group together: rank 0
    hosts the store, and a peer still talking to it fails if rank 0 exits first. Returns the exit status."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    return 0 if flag.item() else 1


def _started(main: Callable[[int, int, Any], int], rank: int, world: int, port: int, args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.exit(main(rank, world, args))


def command_line(doc: str) -> argparse.ArgumentParser:
    """The options every repro has: ``--fixed`` (the proposed fix instead of the framework's function)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--fixed", action="store_true", help="use the proposed fix instead of the framework's gather")
    return parser


def run(
    main: Callable[[int, int, Any], int],
    world: int,
    args: argparse.Namespace,
    timeout: float = 120.0,
    framework: Iterable[str] = (),
) -> int:
    """``main(rank, world, args)`` on every rank; ``framework``: the modules under test, imported before the fork
    unless ``args.fixed``."""
    if "RANK" in os.environ:
        return main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    import torch.multiprocessing as mp

    for module in () if args.fixed else framework:
        importlib.import_module(module)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("fork")
    procs = [context.Process(target=_started, args=(main, r, world, port, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return 1 if any(p.exitcode != 0 for p in procs) else 0


def _captured(cli: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    """``cli(argv)`` with this process's and its ranks' stdout and stderr captured (file descriptors 1 and 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            code = cli(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        return code, out.read().decode(errors="replace")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    every = True
    for script in sys.argv[1:]:
        module = importlib.import_module(Path(script).stem)
        for fixed in (False, True):
            code, output = _captured(module.cli, ["--fixed"] if fixed else [])
            every = every and code == (0 if fixed else 1)
            print(json.dumps({"script": Path(script).name, "fixed": fixed, "exit": code, "output": output}), flush=True)
    sys.exit(0 if every else 1)
