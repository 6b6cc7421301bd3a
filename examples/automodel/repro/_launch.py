"""Run a repro's ``main(rank, world, args) -> exit status`` on gloo ranks: under ``torchrun``, or self-started.

Shared by the repro scripts beside this file (they stay runnable as ``python <script>.py``). Exit status: 0
when every rank returned 0, else 1; a rank left waiting in a collective by a peer that raised is killed after
``timeout`` seconds.

Self-started ranks are forked from this process after it has imported torch and the ``preload`` modules (the
framework functions under test), so a rank costs no import of its own: importing nemo-automodel's CP modules
takes about 4 s of CPU, and a repro of four ranks spent most of its time on that. Nothing has touched a
process group, a thread pool or a device before the fork; each rank joins its own gloo group after it.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from typing import Any, Callable, Iterable


def _started(main: Callable[[int, int, Any], int], rank: int, world: int, port: int, args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.exit(main(rank, world, args))


def run(main: Callable[[int, int, Any], int], world: int, args: Any, timeout: float = 120.0,
        preload: Iterable[str] = ()) -> int:
    if "RANK" in os.environ:
        return main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    import torch.multiprocessing as mp

    for module in preload:
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
