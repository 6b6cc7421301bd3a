"""Check ``malformed``: one entry of ``cp_harness.cases.malformed_inputs`` on a real process group.

Rank half: build the entry's input for this CP rank (base, then the
mutations, some only on chosen ranks), snapshot it, call the function and
catch what it raises. It never raises itself for an error of the call, so a
well-behaved rejection leaves the pool healthy; it returns the account of the
call (``malformed.attempt``). Evaluate: every rank must have raised an
accepted exception type whose message names the field, within the time
limit, with the caller's input unchanged (``malformed.judge``); with
``case["control"]`` every rank must have accepted the unmodified base input.

Case keys: those of ``Malformed.case`` (``name``, ``function``, ``base``,
``mutations``, ``errors``, ``fields``, ``why``, ``seed``, optional ``control``).
"""

from __future__ import annotations

import numpy as np
import torch

from cp_harness.cases import malformed_inputs as malformed
from cp_harness.cases.malformed_catalogue import Malformed
from cp_harness.checks import register
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport

# Meshes built on demand in this rank process, keyed by (kind, CP size): process groups are created once.
_MESHES: dict[tuple[str, int], object] = {}


def _mesh_factory(ctx):
    def build(kind: str):
        key = (kind, ctx.cp_size)
        if key not in _MESHES:
            _MESHES[key] = _two_dimensional_mesh(kind, ctx)
        return _MESHES[key]

    return build


def _two_dimensional_mesh(kind: str, ctx):
    """A real 2-D ``DeviceMesh`` of shape ``(1, N)``, dims ``("dp", "cp")``, over CP ranks ``0..N-1``.

    It is the world mesh of a ``dp=1 x cp=N`` job: what a caller passes by mistake instead of
    ``world_mesh["cp"]``. Its ``cp`` dimension is the case's CP group; its ``dp`` dimension a group of
    this rank alone, created with local synchronisation (no other rank takes part). A ``2 x 2`` mesh
    would need two-member groups created by some ranks only, which hangs in gloo once the pool's
    subgroups exist (see docs/reliability.md).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if kind != "2d":
        raise ValueError(f"unknown mesh kind {kind!r}")
    cp_group = ctx.mesh.get_group()
    ranks = [dist.get_global_rank(cp_group, i) for i in range(ctx.cp_size)]
    # A gloo group whatever the pool's backend: NCCL would split the default communicator, which needs every rank.
    alone = dist.new_group([ranks[ctx.rank]], backend="gloo", use_local_synchronization=True)
    return DeviceMesh.from_group(
        [alone, cp_group], ctx.device.type, mesh=torch.tensor([ranks]), mesh_dim_names=("dp", "cp")
    )


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    inputs = malformed.build_inputs(
        case,
        rank=ctx.rank,
        cp_size=ctx.cp_size,
        mesh=ctx.mesh_for(case),
        mesh_factory=_mesh_factory(ctx),
        device=ctx.device,
    )
    account = malformed.attempt(case["function"], ctx.impl, inputs)
    account["rank"] = ctx.rank
    return account, {}


def _evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    accounts = [o.info for o in outputs]
    for problem in malformed.judge(case, accounts):
        report.problem(problem)
    behaved = np.array([not malformed.judge(case, [acc]) for acc in accounts])
    what = "accepted the valid base input" if case.get("control") else "rejected the malformed input as documented"
    report.add(compare_exact(f"ranks that {what}", behaved, np.ones(len(outputs), dtype=bool)))
    report.info = {"accounts": accounts}
    return report


MALFORMED = register("malformed", rank=_rank, evaluate=_evaluate, functions=tuple(sorted(malformed.FUNCTIONS)))


def case_for(entry: Malformed, world_size: int, *, control: bool = False, seed: int | None = None) -> dict:
    """The case description of a catalogue entry at ``world_size`` (``control``: the valid base call alone)."""
    return MALFORMED.case(**entry.description(world_size, control=control, seed=seed))
