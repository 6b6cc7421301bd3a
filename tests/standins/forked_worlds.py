"""The launcher shared by the stand-in tests' rank scripts (``ring_sdpa_ranks.py``, ``fla_conv_ranks.py``): the
calling process has imported torch (and whatever else is slow) once; ``main`` then forks every rank of every CP size
in ``--worlds`` (gloo over 127.0.0.1, one rendezvous port per size), as the harness's launcher does, and waits.

A rank calls ``rank_main(variants, "<--out-dir>/<world>.json")`` with the JSON list ``--variants``; a rank that
raises prints ``CP <world>, rank <rank>:`` and its traceback on stderr and exits 1, and the launcher then kills
every other rank (a peer blocked in a collective would otherwise wait for its timeout) and returns 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous of one CP size)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(rank_main: Callable[[list[dict], str], None], before_fork: Callable[[], None] | None = None) -> int:
    """Parse ``--variants``, ``--worlds`` (default ``1,2,3``) and ``--out-dir``; run ``before_fork()`` (imports every
    rank needs) once; fork and wait for every rank. Returns the process's exit status: 0, or 1 if any rank failed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", required=True, help="JSON list of variants")
    parser.add_argument("--worlds", default="1,2,3", help="CP sizes, comma-separated")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    variants = json.loads(args.variants)
    torch.set_num_threads(1)  # before any tensor work: no OpenMP pool may exist at the fork
    if before_fork is not None:
        before_fork()
    children: dict[int, tuple[int, int]] = {}
    for world in (int(w) for w in args.worlds.split(",")):
        env = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "TORCH_GLOO_LAZY_INIT": "1"}  # fmt: skip
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.environ.update(env, RANK=str(rank))
                    rank_main(variants, os.path.join(args.out_dir, f"{world}.json"))
                    code = 0
                except BaseException:  # noqa: BLE001 - the traceback is the test's message
                    print(f"CP {world}, rank {rank}:", file=sys.stderr)
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            children[pid] = (world, rank)
    status = 0
    while children:
        pid, wait_status = os.wait()
        world, rank = children.pop(pid)
        if os.waitstatus_to_exitcode(wait_status) != 0:
            print(f"CP {world}, rank {rank} failed; ending the other ranks", file=sys.stderr)
            status = 1
            for other in children:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return status
