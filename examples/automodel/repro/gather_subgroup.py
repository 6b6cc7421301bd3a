"""Repro: nemo-automodel 0.7.0 sequence gathers fail in backward on gloo for every CP group but ranks 0..N-1.

Runs without the harness on four gloo processes laid out as two data-parallel replicas of a CP group of two
ranks (``{0, 1}`` and ``{2, 3}``), self-spawning or ``torchrun --nproc-per-node 4 gather_subgroup.py``.
Exit status 1 when the defect shows, 0 when every rank's gradient is right (``--fixed``).

Cause: the framework functions gather with ``torch.distributed.nn.functional.all_gather``; on backends other
than NCCL/XCCL its backward calls ``dist.scatter(..., src=i, group=group)`` for each *group* rank ``i``, but
``src`` is a *global* rank: in the CP group ``{2, 3}`` the first call asks for global rank 0, which is not in
the group, and the backward raises ``ValueError`` on the second replica (with other layouts it could pair
with the wrong peer). ``--fixed`` uses the same ``FixedGather`` as ``gather_permuted_grad.py`` (a
reduce-scatter on the group, no global ranks involved).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _launch import FixedGather, command_line, run


def main(rank: int, world: int, args) -> int:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        group, cp_rank = groups[rank // 2], rank % 2
        if args.fixed:
            gather = lambda t, g: FixedGather.apply(t, g, 1)  # noqa: E731
        else:
            from nemo_automodel.components.models.deepseek_v41.cp import gather_sequence

            gather = gather_sequence
        x = torch.full((1, 2, 3), float(rank), dtype=torch.float64, requires_grad=True)  # [B, L, C]
        y = gather(x, group)  # [1, 4, 3]
        try:
            (y * (cp_rank + 1)).sum().backward()
            assert x.grad is not None  # a backward that returns sets it
            ok = torch.equal(x.grad, torch.full_like(x, 3.0))  # upstream 1 from CP rank 0, 2 from CP rank 1
            print(
                f"rank {rank} (CP group {rank // 2}, CP rank {cp_rank}): grad {x.grad.flatten().tolist()[:3]}..., "
                f"expected 3.0: {'ok' if ok else 'WRONG'}",
                flush=True,
            )
        except (ValueError, RuntimeError) as exc:
            ok = False
            print(
                f"rank {rank} (CP group {rank // 2}, CP rank {cp_rank}): backward raised {type(exc).__name__}: {exc}",
                flush=True,
            )
        # The ValueError is raised before any message moves, on both ranks of the group, so every rank gets
        # here and the verdict can be agreed on (a rank left inside a collective would be killed by the launcher).
        verdict = torch.tensor([int(ok)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
        return 0 if verdict.item() else 1
    finally:
        dist.destroy_process_group()


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 1 while the defect shows, 0 when every rank is right."""
    args = command_line(__doc__).parse_args(argv)
    return run(main, 4, args, framework=("nemo_automodel.components.models.deepseek_v41.cp",))


if __name__ == "__main__":
    sys.exit(cli())
