"""Repro: fla 0.6.0's CP communication (``fla.ops.cp.comm``) fails on gloo: its all-gather allocates a stacked output.

Runs without the harness on two gloo processes, self-spawning or ``torchrun --nproc-per-node 2
fla_stacked_allgather_gloo.py``. Each rank calls ``fla.ops.cp.conv_cp_send_recv_fwd`` (the convolution halo of
Qwen3.5-MoE's Gated DeltaNet CP: send the last ``W - 1`` inputs to the next rank) on a ``[W - 1, D]`` tail. Exit
status 1 when it raises, 0 when every rank receives the previous rank's tail (rank 0: zeros) (``--fixed``).

Cause: ``fla.ops.cp.comm.all_gather_into_tensor`` allocates ``torch.empty(world_size, *inp.shape)`` (stacked) and
passes it to ``torch.distributed.all_gather_into_tensor``. NCCL's ``_allgather_base`` checks only the element count
(``output.numel() == world_size * input.numel()``), so the stacked buffer works there; gloo's checks the shape and
raises ``ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3, 4), got (1, 3, 4))``. Not a
defect of the framework or of fla on its GPU backends: a backend limitation every CPU run of fla's CP meets.
``--fixed`` passes the same memory as its concatenated view (``out.view(-1, *inp.shape[1:])``), which gloo takes:
what the harness's stand-in ``fla_gloo_allgather`` does (``cp_harness/standins/fla_conv_cpu.py``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _launch import command_line, run


def _concatenated(out, inp, group=None, async_op=False):
    return torch.distributed.all_gather_into_tensor(out.view(-1, *inp.shape[1:]), inp, group=group, async_op=async_op)


def main(rank: int, world: int, args) -> int:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import fla.ops.cp.comm as comm

        if args.fixed:
            view = type(sys)("torch.distributed")
            view.__dict__.update(vars(dist))
            setattr(view, "all_gather_into_tensor", _concatenated)  # noqa: B010
            comm.dist = view
        tail = torch.full((3, 4), float(rank + 1))  # [W - 1, D]
        try:
            heads = comm.conv_cp_send_recv_fwd(tail, dist.group.WORLD)
            ok = torch.equal(heads, torch.full_like(tail, float(rank)))  # the previous rank's tail; rank 0 zeros
            print(f"rank {rank}: received {heads[0, 0].item()} (expected {float(rank)}): {'ok' if ok else 'WRONG'}",
                  flush=True)  # fmt: skip
        except RuntimeError as exc:
            ok = False
            print(f"rank {rank}: conv_cp_send_recv_fwd raised {type(exc).__name__}: {exc}", flush=True)
        verdict = torch.tensor([int(ok)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
        return 0 if verdict.item() else 1
    finally:
        dist.destroy_process_group()


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 1 while gloo refuses fla's stacked all-gather, 0 when every rank is right."""
    args = command_line(__doc__).parse_args(argv)
    return run(main, 2, args, framework=("fla.ops.cp.comm",))


if __name__ == "__main__":
    sys.exit(cli())
