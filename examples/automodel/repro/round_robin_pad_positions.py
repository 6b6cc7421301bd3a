"""Repro: nemo-automodel 0.7.0's round-robin sharders pad ``position_ids`` with 0 instead of counting on.

Runs without the harness on two gloo ranks (self-spawning, or ``torchrun --nproc-per-node 2
round_robin_pad_positions.py``). Exit status 1 when the behaviour shows, 0 when the divisibility-padding
positions count on from the row's last position (``--fixed``).

``shard_batch_load_balanced`` (the default framework-owned CP path) and ``shard_batch_aux_only`` pad every
buffer to a multiple of ``2 * cp_size`` through ``_pad_cp_buffers_to_divisor``: floating buffers with 0,
integer ones with ``_ROUND_ROBIN_PAD_FILL`` (labels -100, padding_mask True) or else 0, so ``position_ids``
gets 0 at every pad slot. The framework's contiguous path (``shard_batch_contiguous``) continues them
(``_pad_position_ids_seq_dim_``), as does SPEC (positions count on at padding). The docstring of
``shard_batch_load_balanced`` says pad slots are "zero-filled"; the two framework paths disagree.

Here ``S = 3``, two ranks: padded to 4, rank 0 owns chunks 0 and 3 (global positions 0 and 3, the pad slot);
inside the returned context its local ``position_ids`` are ``[0, 0]``, not ``[0, 3]``.

``--fixed`` is the caller-side equivalent of the fix (pad ``position_ids`` counting on, as the contiguous
path does): the batch arrives already padded to ``2 * cp_size``, so the framework pads nothing.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _launch import command_line, leave, run

FRAMEWORK = "nemo_automodel.components.distributed.context_parallel.sharder"


def batch_of(seq_len: int, padded: int) -> dict:
    ids = torch.arange(1, seq_len + 1)[None]
    labels = ids.clone()
    positions = torch.arange(seq_len)[None]
    pad = padded - seq_len
    if pad:  # --fixed: the caller pads, positions counting on
        ids = torch.cat([ids, torch.zeros(1, pad, dtype=ids.dtype)], 1)
        labels = torch.cat([labels, torch.full((1, pad), -100)], 1)
        positions = torch.arange(padded)[None]
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "padding_mask": torch.arange(ids.shape[1])[None] >= seq_len,
    }


def main(rank: int, world: int, args) -> int:
    from nemo_automodel.components.distributed.context_parallel import sharder as fw
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    S = 3
    padded = S + (-S) % (2 * world)
    ok = True
    for strategy in (fw.shard_batch_load_balanced, fw.shard_batch_aux_only):
        batch = batch_of(S, padded if args.fixed else S)
        ctx_factory, local, layout = strategy(mesh, None, batch)
        owned = fw.round_robin_local_indices(mesh, layout.padded_seq_len)
        with ctx_factory():
            got = local["position_ids"][0].tolist()
        want = owned.tolist()  # a row of one document: position == global index, padding counting on
        print(
            f"rank {rank} {strategy.__name__}: owns global {want}, local position_ids {got}"
            + ("" if got == want else "  WRONG: a pad slot does not count on"),
            flush=True,
        )
        ok = ok and got == want
    return leave(ok)


def cli(argv: list[str]) -> int:
    return run(main, 2, command_line(__doc__).parse_args(argv), framework=(FRAMEWORK,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
