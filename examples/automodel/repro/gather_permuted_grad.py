"""Repro: nemo-automodel 0.7.0 sequence gathers return wrong gradients on gloo for a transposed upstream gradient.

Runs without the harness on two gloo ranks (self-spawning, or ``torchrun --nproc-per-node 2 gather_permuted_grad.py``).
Exit status 1 when the defect shows, 0 when every rank's gradient is right (``--fixed``). ``--dtype bfloat16``
runs the same tensors in bfloat16 (the harness' ``MistralLarge4-mini (bfloat16)`` row): every value and every
sum here is an integer below 256, exact in bfloat16, so the comparison stays bit for bit and a wrong gradient
can only come from where the values land, not from rounding.

Each rank holds ``x`` ``[batch=2, local=2]`` and gathers it to ``y`` ``[2, 4]`` along the sequence (dim 1).
The consumer uses ``y.t()`` (as a model does that moves tokens first or transposes for attention), so the
gradient reaching the gather is a transposed, non-contiguous ``[2, 4]`` view. The right gradient of ``x``
on rank ``r`` is the sum over ranks of their upstream gradient's columns ``[2r, 2r+2)``.

Cause: the framework functions gather with ``torch.distributed.nn.functional.all_gather``. On backends other
than NCCL/XCCL its backward emulates the reduce-scatter with one ``dist.scatter`` per rank into receive buffers
made by ``torch.empty_like(grad)``, which keep the gradient's transposed strides, and gloo's scatter writes its
bytes into them as if they were contiguous: the received slices come back transposed.

``--fixed`` routes the same calls through ``FixedGather`` (``_launch.py``: all-gather forward; backward reduce-scatters
contiguous gradient slices into a contiguous buffer), the change proposed upstream.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _launch import FixedGather, command_line, run

FUNCTIONS = {  # name -> (module, function, how it is called with (tensor, group))
    "deepseek_v41": "nemo_automodel.components.models.deepseek_v41.cp:gather_sequence",
    "deepseek_v4": "nemo_automodel.components.models.deepseek_v4.cp:dsv4_cp_all_gather",
    "glm_moe_dsa": "nemo_automodel.components.models.glm_moe_dsa.cp:glm_dsa_cp_all_gather",
    "qwen3_8_flash_next": "nemo_automodel.components.models.qwen3_8_flash_next.cp:qwen3_8_flash_next_cp_all_gather",
}


def framework_gather(name: str):
    """``gather(tensor [B, L, ...], group) -> [B, N*L, ...]`` through the named framework function."""
    module, function = FUNCTIONS[name].split(":")
    fn = getattr(__import__(module, fromlist=[function]), function)
    if name == "deepseek_v41":
        return lambda t, g: fn(t, g)
    if name == "qwen3_8_flash_next":  # the framework passes its CP context; only group and size are read here
        from types import SimpleNamespace

        return lambda t, g: fn(t, SimpleNamespace(group=g, size=dist.get_world_size(g)), sequence_dim=1)
    return lambda t, g: fn(t, dim=1, cp_group=g)


def check(rank: int, world: int, gather, dtype: torch.dtype = torch.float64) -> bool:
    """One gather and backward; ``True`` when this rank's gradient is right (bit for bit)."""
    group = dist.group.WORLD
    x = torch.arange(4, dtype=dtype).view(2, 2).add(10 * rank).requires_grad_(True)  # [B=2, L=2]
    y = gather(x, group)  # [2, 2*world]
    upstream = [torch.arange(2 * 2 * world, dtype=dtype).view(2 * world, 2).add(100 * r) for r in range(world)]
    (y.t() * upstream[rank]).sum().backward()  # d/dy = upstream[rank].t(): transposed, non-contiguous
    want = torch.stack([u.t()[:, 2 * rank : 2 * rank + 2] for u in upstream]).sum(0)  # integers: exact in any order
    assert x.grad is not None  # a backward that returns sets it
    ok = torch.equal(x.grad, want)
    print(f"rank {rank}: grad {x.grad.tolist()}, expected {want.tolist()}: {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def main(rank: int, world: int, args) -> int:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        names = list(FUNCTIONS) if args.function == "all" else [args.function]
        bad = []
        for name in names:
            gather = (lambda t, g: FixedGather.apply(t, g, 1)) if args.fixed else framework_gather(name)
            if rank == 0:
                print(f"-- {'FixedGather' if args.fixed else FUNCTIONS[name]}", flush=True)
            ok = torch.tensor([int(check(rank, world, gather, getattr(torch, args.dtype)))])
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
    parser.add_argument("--function", default="deepseek_v41", choices=[*FUNCTIONS, "all"])
    parser.add_argument(
        "--dtype",
        default="float64",
        choices=["float64", "bfloat16"],
        help="payload dtype (bfloat16: the harness' bfloat16 model row; integers exact in both)",
    )
    args = parser.parse_args(argv)
    return run(main, 2, args, framework=[FUNCTIONS[n].split(":")[0] for n in FUNCTIONS if args.function in ("all", n)])


if __name__ == "__main__":
    sys.exit(cli())
