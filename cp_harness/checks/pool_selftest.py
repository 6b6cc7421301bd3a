"""A check that exercises the pool itself, with optional fault injection.

``case["mode"]``: ``"ok"`` (every rank all-reduces its rank and returns it),
``"raise"`` (``case["fault_rank"]`` raises before the collective), ``"exit"``
(it exits abruptly), ``"hang"`` (it sleeps instead of joining the collective,
so its peers wait inside one: ``case["hang_seconds"]``, or until the file ``case["hang_until"]`` exists, whichever
comes first; the file lets a test release the rank once the state it asserts is reached), ``"wrong_shape"`` (it returns a tensor of the
wrong shape), ``"leak"`` (every rank all-reduces on the default group instead of the CP mesh's: on a world
mesh the communication meter must refuse it, ``cp_harness.instruments.leaks``).

``case["done_file"]``: a path every rank creates once its collective is done, so that a test can hold another
case's rank in ``"hang"`` (``hang_until``) exactly until this case has run, instead of guessing how long it takes;
that rank's info says ``released`` when the file, not ``hang_seconds``, ended its wait.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from cp_harness.checks import register
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport


def _hang(seconds: float, until: str | None) -> bool:
    """Sleep ``seconds``, or less once the file ``until`` exists (polled every 10 ms); whether the file ended it."""
    deadline = time.monotonic() + seconds
    if not until:
        time.sleep(seconds)
        return False
    while time.monotonic() < deadline:
        if os.path.exists(until):
            return True
        time.sleep(0.01)
    return False


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    mode = case.get("mode", "ok")
    fault = ctx.rank == int(case.get("fault_rank", 0)) and mode != "ok"
    if fault and mode == "raise":
        raise RuntimeError(f"injected fault on rank {ctx.rank}")
    if fault and mode == "exit":
        os._exit(17)
    released = fault and mode == "hang" and _hang(float(case.get("hang_seconds", 3600)), case.get("hang_until"))
    value = torch.tensor([float(ctx.rank)], device=ctx.device)
    mesh = ctx.mesh_for(case)
    if mode == "leak":
        dist.all_reduce(torch.zeros(1, device=ctx.device))  # the default group: every pool rank
    if mesh is not None and ctx.cp_size > 1:
        dist.all_reduce(value, group=mesh.get_group())
    if case.get("done_file"):
        open(case["done_file"], "a").close()
    out = torch.full((2 if fault and mode == "wrong_shape" else 1,), value.item())
    return {"rank": ctx.rank, "pid": os.getpid(), "released": bool(released)}, {"sum": out}


def _evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    n = int(case["world_size"])
    expected = torch.tensor([float(sum(range(n)))], dtype=torch.float32)
    for o in outputs:
        report.add(compare_exact(f"sum@rank{o.rank}", o.tensors["sum"], expected, rank=o.rank))
        report.require(o.info.get("rank") == o.rank, f"rank {o.rank} reported rank {o.info.get('rank')}")
    return report


POOL_SELFTEST = register("pool_selftest", rank=_rank, evaluate=_evaluate)
