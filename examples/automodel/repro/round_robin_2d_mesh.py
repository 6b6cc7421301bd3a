"""Repro: nemo-automodel 0.7.0's round-robin sharders take a 2-D mesh as their CP mesh without a word.

Runs without the harness on four gloo ranks (self-spawning, or ``torchrun --nproc-per-node 4
round_robin_2d_mesh.py``). Exit status 1 when a 2-D mesh is accepted, 0 when it is rejected before the
batch is touched (``--fixed``).

``shard_batch_load_balanced`` and ``shard_batch_aux_only`` read ``cp_mesh.size()`` (every rank of the mesh)
and never check that the mesh is 1-D. Given the whole ``(dp=2, cp=2)`` mesh instead of its ``"cp"``
submesh they return normally, having popped the caller's ``attention_mask`` and padded its tensors to a
multiple of ``2 * 4`` (not ``2 * 2``) into the caller's dict; only entering the returned context fails, in
torch's ``context_parallel`` (``placements`` must have the same length as ``device_mesh.ndim``). SPEC (and
the harness' malformed-input row ``sharder/shard_batch_two_dimensional_mesh``, which passes a
``(dp=1, cp=N)`` mesh) requires a 2-D mesh to be rejected before the batch is touched. The framework's own
dispatch always passes ``device_mesh["cp"]``, so this bites a caller that builds the sharder itself.

``--fixed``: the check the strategies lack (``cp_mesh.ndim != 1`` raises ``ValueError``) in front of them.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _launch import command_line, leave, run

FRAMEWORK = "nemo_automodel.components.distributed.context_parallel.sharder"


def main(rank: int, world: int, args) -> int:
    from nemo_automodel.components.distributed.context_parallel import sharder as fw
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ok = True
    for strategy in (fw.shard_batch_load_balanced, fw.shard_batch_aux_only):
        S = 10  # padded to 16 for 2 * 4 ranks, 12 for cp=2: the strategy pads, into the caller's dict
        batch = {
            "input_ids": torch.arange(1, S + 1)[None],
            "labels": torch.arange(1, S + 1)[None],
            "attention_mask": torch.ones(1, S, dtype=torch.long),
        }
        try:
            if args.fixed and mesh.ndim != 1:
                raise ValueError(f"the CP mesh must be 1-D, got {mesh.ndim}-D {mesh.mesh_dim_names}")
            ctx_factory, local, layout = strategy(mesh, None, batch)
        except ValueError as error:
            print(f"rank {rank} {strategy.__name__}: rejected before touching the batch: {error}", flush=True)
            continue
        ok = False
        touched: dict[str, object] = {k: list(v.shape) for k, v in batch.items()}
        touched["attention_mask"] = "popped" if "attention_mask" not in batch else "kept"
        try:
            with ctx_factory():
                late = "entering its context did not raise either"
        except ValueError as error:
            late = f"entering its context raised only then: {str(error)[:90]}"
        print(
            f"rank {rank} {strategy.__name__}: WRONG: accepted a {mesh.ndim}-D mesh {mesh.mesh_dim_names}: "
            f"padded_seq_len {layout.padded_seq_len} (2 * all 4 ranks; cp=2 needs {S + (-S) % 4}), the caller's "
            f"batch is now {touched}; {late}",
            flush=True,
        )
    return leave(ok)


def cli(argv: list[str]) -> int:
    return run(main, 4, command_line(__doc__).parse_args(argv), framework=(FRAMEWORK,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
