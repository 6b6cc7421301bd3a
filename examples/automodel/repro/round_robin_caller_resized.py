"""Repro: nemo-automodel 0.7.0's round-robin sharders resize the caller's own tensors in place when ``S % 2N == 0``.

Runs without the harness on two gloo ranks (self-spawning, or ``torchrun --nproc-per-node 2
round_robin_caller_resized.py``). Exit status 1 when the behaviour shows, 0 when the caller's tensors are
left as they were (``--fixed``).

``shard_batch_load_balanced`` hands the batch's tensors to torch ``context_parallel`` as ``buffers``, which
shards them in place (``resize_`` / ``copy_``) on entry and does not restore the ``no_restore_buffers``
(input_ids, labels, padding_mask, loss_mask) on exit. When ``S`` is not a multiple of ``2 * cp_size`` the
framework pads first, so the buffers are new tensors and the caller's are untouched; when it is, the buffers
ARE the caller's tensors: after the step the caller's ``input_ids`` and ``labels`` hold this rank's shard
(``[1, 4]`` becomes ``[1, 2]``). ``shard_batch_aux_only`` does the same to ``labels``. A caller that reuses
its batch (a second forward, a reference model, logging, a retry) silently gets the shard, and only for
some sequence lengths.

``--fixed``: the proposed fix, on the caller's side here: the framework hands ``context_parallel`` copies of
the caller's tensors (as it already does whenever it pads), so the caller's tensors stay whole.
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
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ok = True
    for S in (3, 4):  # 3: padded by the framework (copies); 4 = 2N: no padding, the caller's own tensors
        for strategy in (fw.shard_batch_load_balanced, fw.shard_batch_aux_only):
            ids, labels = torch.arange(1, S + 1)[None], torch.arange(1, S + 1)[None]
            caller = {"input_ids": ids, "labels": labels}
            batch = {k: v.clone() for k, v in caller.items()} if args.fixed else dict(caller)
            ctx_factory, local, _ = strategy(mesh, None, batch)
            with ctx_factory():
                pass  # the model's forward would run here
            changed = [f"{k} {[1, S]} -> {list(v.shape)}" for k, v in caller.items() if tuple(v.shape) != (1, S)]
            print(
                f"rank {rank} {strategy.__name__} S={S}: caller's tensors "
                + (f"WRONG, resized in place: {', '.join(changed)}" if changed else "unchanged"),
                flush=True,
            )
            ok = ok and not changed
    return leave(ok)


def cli(argv: list[str]) -> int:
    return run(main, 2, command_line(__doc__).parse_args(argv), framework=(FRAMEWORK,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
