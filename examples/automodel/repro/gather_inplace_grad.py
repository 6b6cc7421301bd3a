"""Repro: nemo-automodel 0.7.0 Kimi Linear ``all_gather_sequence`` overwrites the gradient it is given.

Runs without the harness on two gloo ranks (self-spawning, or ``torchrun --nproc-per-node 2 gather_inplace_grad.py``).
Exit status 1 when the defect shows, 0 when every gradient is right (``--fixed``).

``_AllGatherSequence.backward`` all-reduces ``grad_output.contiguous()`` in place; when the incoming gradient
is already contiguous that *is* the autograd buffer, which autograd may share with other consumers. Here the
gathered ``y`` ``[1, 4, 3]`` is added to ``u = 3 * w`` (a residual-style sum): ``AddBackward`` hands the same
gradient tensor to both branches, the gather's backward runs first and all-reduces it, and ``w`` then receives
the sum over ranks of the upstream gradient instead of its own rank's (``w.grad`` 9 on both ranks, not 3 / 6).
The same backward is in ``kimi_k3.cp`` and ``glm5_next.cp`` (not run here: their packages import ``transformers``).

``--fixed`` routes the same calls through ``FixedGather`` (backward reduce-scatters contiguous copies of the
gradient slices and never writes to the gradient it receives; it also moves half the bytes of the
all-reduce).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from _launch import FixedGather, command_line, run

FUNCTIONS = {  # kimi_k3.cp and glm5_next.cp hold the same backward, but their packages import transformers
    "kimi_linear": "nemo_automodel.components.models.kimi_linear.cp",
}


def check(rank: int, gather) -> bool:
    """Residual-style use of one gather; ``True`` when ``w`` and ``x`` get their right gradients."""
    group = dist.group.WORLD
    x = torch.ones(1, 2, 3, dtype=torch.float64, requires_grad=True)  # [B, L, C] on each rank
    w = torch.ones(1, 4, 3, dtype=torch.float64, requires_grad=True)  # [B, N*L, C], e.g. a skip branch
    u = w * 3  # recorded before the gather
    y = gather(x, group)  # [1, 4, 3]
    c = torch.full((1, 4, 3), float(rank + 1), dtype=torch.float64)  # upstream: 1 on rank 0, 2 on rank 1
    ((y + u) * c).sum().backward()
    assert w.grad is not None and x.grad is not None  # a backward that returns sets them
    w_ok = torch.equal(w.grad, 3 * c)  # d/dw = 3 * c, this rank's own
    x_ok = torch.equal(x.grad, torch.full_like(x, 3.0))  # sum over ranks of c = 1 + 2
    print(
        f"rank {rank}: w.grad {w.grad[0, 0, 0].item()} (expected {3 * (rank + 1)}), "
        f"x.grad {x.grad[0, 0, 0].item()} (expected 3.0): {'ok' if w_ok and x_ok else 'WRONG'}",
        flush=True,
    )
    return w_ok and x_ok


def main(rank: int, world: int, args) -> int:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        names = list(FUNCTIONS) if args.function == "all" else [args.function]
        bad = []
        for name in names:
            gather: Callable[[torch.Tensor, object], torch.Tensor]
            if args.fixed:
                gather = lambda t, g: FixedGather.apply(t, g, 1)  # noqa: E731
            else:
                fn = __import__(FUNCTIONS[name], fromlist=["all_gather_sequence"]).all_gather_sequence
                gather = functools.partial(fn, dim=1)
            if rank == 0:
                print(f"-- {'FixedGather' if args.fixed else FUNCTIONS[name] + '.all_gather_sequence'}", flush=True)
            ok = torch.tensor([int(check(rank, gather))])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not ok.item():
                bad.append(name)
        if rank == 0:
            print(f"defect shows in: {', '.join(bad)}" if bad else "every gradient is right", flush=True)
        return 1 if bad else 0
    finally:
        dist.destroy_process_group()


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 1 while the defect shows, 0 when every rank is right."""
    parser = command_line(__doc__)
    parser.add_argument("--function", default="kimi_linear", choices=[*FUNCTIONS, "all"])
    args = parser.parse_args(argv)
    return run(main, 2, args, framework=[FUNCTIONS[n] for n in FUNCTIONS if args.function in ("all", n)])


if __name__ == "__main__":
    sys.exit(cli())
