"""Run a repro's ``main(rank, world, args) -> exit status`` on gloo ranks: under ``torchrun``, or self-spawned.

Shared by the repro scripts beside this file (they stay runnable as ``python <script>.py``). Exit status: 0
when every rank returned 0, else 1; a rank left waiting in a collective by a peer that raised is killed after
``timeout`` seconds.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable


def _spawned(main: Callable[[int, int, Any], int], rank: int, world: int, port: int, args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.exit(main(rank, world, args))


def run(main: Callable[[int, int, Any], int], world: int, args: Any, timeout: float = 120.0) -> int:
    if "RANK" in os.environ:
        return main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    procs = [context.Process(target=_spawned, args=(main, r, world, port, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return 1 if any(p.exitcode != 0 for p in procs) else 0
