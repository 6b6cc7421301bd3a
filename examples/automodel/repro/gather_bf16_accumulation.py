"""Repro: nemo-automodel 0.7.0 Kimi Linear ``all_gather_sequence`` sums bf16 gradients in bf16.

Runs without the harness on three gloo ranks (self-spawning, or ``torchrun --nproc-per-node 3 gather_bf16_accumulation.py``).
Exit status 1 when the defect shows, 0 when every gradient is right (``--fixed``).

A gather's backward hands each rank the sum, over the N ranks, of the gradient slices of its own shard. With a
bf16 payload the precision contract (docs/budgets.md, "bfloat16 and float16") is: accumulate in float32, round once to
bf16. ``_AllGatherSequence.backward`` all-reduces the bf16 gradient, so every partial sum is rounded to bf16 (from
three ranks on, the result depends on the reduction order and is off by up to an ULP per hop). Here each rank
gathers ``x [1, 1, 64]`` bf16 and backpropagates seeded random bf16 gradients ``[1, 3, 64]``; the expected
gradient is the float32 sum of the three ranks' slices, rounded once.

``--fixed`` routes the same calls through ``FixedGather``, whose backward reduce-scatters float32 copies of the
gradient slices and rounds the result once.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from _launch import FixedGather, command_line, run

WORLD = 3


def upstream(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(1, WORLD, 64, generator=g, dtype=torch.float64) * 4).to(torch.bfloat16)


def main(rank: int, world: int, args) -> int:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if args.fixed:
            gather = lambda t: FixedGather.apply(t, dist.group.WORLD, 1)  # noqa: E731
        else:
            from nemo_automodel.components.models.kimi_linear.cp import all_gather_sequence

            gather = lambda t: all_gather_sequence(t, dist.group.WORLD, dim=1)  # noqa: E731
        x = torch.ones(1, 1, 64, dtype=torch.bfloat16, requires_grad=True)
        gather(x).backward(upstream(rank))
        # The float32 sum in rank order, rounded once (reduce adds left to right, as sum() did).
        expected = functools.reduce(torch.add, [upstream(r)[:, rank : rank + 1].float() for r in range(world)])
        expected = expected.to(torch.bfloat16)
        assert x.grad is not None  # a backward that returns sets it
        wrong = int((x.grad != expected).sum())
        print(f"rank {rank}: {wrong} of 64 gradient elements differ from the float32 sum rounded once", flush=True)
        ok = torch.tensor([int(wrong == 0)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if rank == 0:
            print("every gradient is right" if ok.item() else "defect shows: bf16 partial sums", flush=True)
        return 0 if ok.item() else 1
    finally:
        dist.destroy_process_group()


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 1 while the defect shows, 0 when every rank is right."""
    args = command_line(__doc__).parse_args(argv)
    return run(main, WORLD, args, framework=("nemo_automodel.components.models.kimi_linear.cp",))


if __name__ == "__main__":
    sys.exit(cli())
