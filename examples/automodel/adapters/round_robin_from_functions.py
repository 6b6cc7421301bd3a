"""A round-robin sharder built from nemo-automodel 0.7.0's own CP functions, without ``context_parallel``.

``round_robin_local_indices`` (the index map), ``shard_sequence_for_cp_round_robin`` (pad to ``2 * cp_size``
and keep chunks ``r`` and ``2N-1-r``) and ``shard_token_tensor_by_indices``, inside the framework's
``ContextParallelSharder``: the layout of ``shard_batch_load_balanced`` with every key sharded out of place
(labels padded ``-100``, ``padding_mask`` ``True``, positions counting on, ``loss_mask`` ``False`` / ``0``).
It serves the BSHD rows of both hooks (packs stay ``cp_impl``'s). ``make_strategy(forget_loss_mask=True)``
is the defect of issue 19 (the constructor's ``loss_mask`` is never sharded):
``tests/fixtures/broken_rr_drops_loss_mask`` is this module with it, and the layout rows must fail it
once a case passes a ``loss_mask``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel.sharder import (
    ContextParallelSharder,
    ShardLayout,
    identity_local_indices,
    round_robin_local_indices,
    shard_sequence_for_cp_round_robin,
    shard_token_tensor_by_indices,
)

import cp_impl
from examples.automodel.adapters._compose import compose

FRAMEWORK_FUNCTION = shard_sequence_for_cp_round_robin
_SHARDER = "nemo_automodel.components.distributed.context_parallel.sharder"
SERVES = {
    "inkling2.prepare_cp_inputs": f"{_SHARDER}.shard_sequence_for_cp_round_robin",
    "mistral_large4.prepare_cp_inputs": f"{_SHARDER}.shard_sequence_for_cp_round_robin",
}
# The other framework callables the served hooks run (the coverage table reads them too).
ALSO_USES = {
    f"{_SHARDER}.round_robin_local_indices": "the index map of every shard",
    f"{_SHARDER}.shard_token_tensor_by_indices": "every key sharded out of place",
    f"{_SHARDER}.ContextParallelSharder": "the sharder the hooks return",
}


def _local_indices(cp_mesh, padded_seq_len: int, device=None):
    if cp_mesh is None or cp_mesh.size() <= 1:
        return identity_local_indices(cp_mesh, padded_seq_len, device)
    return round_robin_local_indices(cp_mesh, padded_seq_len, device)


def _shard_batch(
    cp_mesh,
    tp_mesh,
    batch,
    *,
    loss_mask=None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    forget_loss_mask: bool = False,
):
    del tp_mesh
    seq_len = batch["input_ids"].shape[1]
    local = {k: v for k, v in batch.items() if k != "attention_mask"}
    pads = {"labels": -100, "padding_mask": True}
    if shard_primary:
        pads["input_ids"] = padding_token_id
    padded = seq_len
    for key, fill in pads.items():
        if key in batch:
            local[key], _, padded = shard_sequence_for_cp_round_robin(cp_mesh, batch[key], pad_value=fill)
    positions = batch["position_ids"]
    if padded > seq_len:  # positions count on from each row's last slot
        more = positions[:, -1:] + torch.arange(1, padded - seq_len + 1, dtype=positions.dtype)
        positions = torch.cat([positions, more], dim=1)
    local["position_ids"] = shard_token_tensor_by_indices(positions, _local_indices(cp_mesh, padded, positions.device))
    if loss_mask is not None and not forget_loss_mask:
        local["loss_mask"], _, _ = shard_sequence_for_cp_round_robin(
            cp_mesh, loss_mask, pad_value=False if loss_mask.dtype == torch.bool else 0
        )
    return contextlib.nullcontext, local, ShardLayout(original_seq_len=seq_len, padded_seq_len=padded)


def make_strategy(
    hook: Callable[..., dict[str, Any]], shard_primary: Callable[..., bool], *, forget_loss_mask: bool = False
):
    def prepare(batch, *args: Any, **kwargs: Any) -> dict[str, Any]:
        ours = hook(batch, *args, **kwargs)
        if "document_ids" in batch:
            return ours
        strategy = functools.partial(
            _shard_batch, shard_primary=shard_primary(*args, **kwargs), forget_loss_mask=forget_loss_mask
        )
        return {"cp_sharder": ContextParallelSharder(shard_batch=strategy, local_token_global_indices=_local_indices)}

    prepare.__name__, prepare.__doc__ = hook.__name__, hook.__doc__
    return prepare


def _mistral_shard_primary(num_chunks: int = 1, shard_primary: bool = True) -> bool:
    return shard_primary


def build(name: str, *, forget_loss_mask: bool = False):
    return compose(
        name,
        inkling2={
            "prepare_cp_inputs": make_strategy(
                cp_impl.inkling2.prepare_cp_inputs, lambda *a, **k: False, forget_loss_mask=forget_loss_mask
            )
        },
        mistral_large4={
            "prepare_cp_inputs": make_strategy(
                cp_impl.mistral_large4.prepare_cp_inputs, _mistral_shard_primary, forget_loss_mask=forget_loss_mask
            )
        },
    )


inkling2, mistral_large4 = build(__name__)
