"""Repro: nemo-automodel 0.7.0's round-robin sharders give the caller no local ``loss_mask``.

Runs without the harness on two gloo ranks (self-spawning, or ``torchrun --nproc-per-node 2
round_robin_loss_mask.py``). Exit status 1 when the behaviour shows, 0 when the local batch carries this
rank's ``loss_mask`` shard (``--fixed``).

``ContextParallelSharder(shard_batch=shard_batch_load_balanced | shard_batch_aux_only, loss_mask=m)``:
``shard()`` passes ``m`` to the strategy, which appends it to the ``context_parallel`` buffers "as an arg
(not in batch) so it has no key". So the returned batch has no ``loss_mask`` (``shard_batch_contiguous``
returns ``batch["loss_mask"]``, sharded), and the shard exists only as a side effect: when ``S % 2N == 0``
the context resizes the caller's own ``m`` in place to the shard; when ``S % 2N != 0`` it pads a copy of
``m`` that nobody holds, shards that, and the caller's ``m`` stays full-length: this rank's loss mask is
unreachable. ``shard_batch_identity`` deletes the argument (at one rank the caller's ``m`` is the local one,
but nothing in the batch says so).

``--fixed``: the workaround a caller has today, and the shape of the fix: ``loss_mask`` travels as a batch
key registered in ``extra_seq_buffers`` (padded ``0``, mirrored into the batch, sharded with it), so the
local batch holds ``loss_mask`` at this rank's positions for every ``S``.
"""

from __future__ import annotations

import functools
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
    for S in (3, 4):  # 3: the framework pads; 4 = 2N: it does not
        for strategy in (fw.shard_batch_load_balanced, fw.shard_batch_aux_only):
            mask = torch.tensor([[1.0, 0.0, 0.5, 0.25][:S]])
            batch = {"input_ids": torch.arange(1, S + 1)[None], "labels": torch.arange(1, S + 1)[None]}
            if args.fixed:
                batch["loss_mask"] = mask.clone()
                sharder = fw.ContextParallelSharder(
                    device_mesh=mesh,
                    shard_batch=functools.partial(strategy, extra_seq_buffers={"loss_mask": 1}),
                    local_token_global_indices=fw.round_robin_local_indices,
                )
            else:
                sharder = fw.ContextParallelSharder(
                    device_mesh=mesh,
                    shard_batch=strategy,
                    local_token_global_indices=fw.round_robin_local_indices,
                    loss_mask=mask,
                )
            ctx_factory, local = sharder.shard(batch)
            padded = sharder.shard_layout.padded_seq_len
            owned = fw.round_robin_local_indices(mesh, padded)
            want = torch.cat([torch.tensor([[1.0, 0.0, 0.5, 0.25][:S]]), torch.zeros(1, padded - S)], 1)[:, owned]
            with ctx_factory():
                got = local.get("loss_mask")
                right = got is not None and torch.equal(got, want)
                print(
                    f"{'' if right else 'WRONG: '}rank {rank} {strategy.__name__} S={S}: local batch loss_mask "
                    f"{None if got is None else got.tolist()}, want {want.tolist()}; the constructor's "
                    f"tensor is now {list(mask.shape)}",
                    flush=True,
                )
                ok = ok and right
    return leave(ok)


def cli(argv: list[str]) -> int:
    return run(main, 2, command_line(__doc__).parse_args(argv), framework=(FRAMEWORK,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
