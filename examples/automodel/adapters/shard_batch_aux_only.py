"""Sharding served by nemo-automodel 0.7.0's ``shard_batch_aux_only``, the model side by ``shard_sequence_for_cp_round_robin``.

The framework-owned peer of ``shard_batch_load_balanced`` for models that
embed and shard their primary stream inside their own forward: it pads the
auxiliary streams (``labels``, ``position_ids``, ``padding_mask``,
``loss_mask``) to a multiple of ``2 * cp_size``, leaves ``input_ids``
full-length, and returns a ``ctx_factory`` whose torch ``context_parallel``
context shards those streams in place (round-robin: rank ``r`` owns chunks
``r`` and ``2N-1-r``) when it is entered. The model then shards its embedded
primary stream with ``shard_sequence_for_cp_round_robin``.

Translation only. The path keeps the primary global, so it serves the hooks
whose contract keeps it global: ``inkling2.prepare_cp_inputs`` and
``mistral_large4.prepare_cp_inputs`` with ``shard_primary=False``
(``shard_primary=True`` rows are the load-balanced path's,
``examples.automodel.adapters.shard_batch_load_balanced``, and stay ``cp_impl``'s here,
as do packs). The model side: the harness' models shard their global
embeddings with the sharder's documented ``shard_token_tensor(x, fill=...)``;
:class:`AuxOnlySharder` (the framework's ``ContextParallelSharder``, same
constructor) serves that call for an original-length tensor with the
framework's ``shard_sequence_for_cp_round_robin(cp_mesh, x, seq_dim=,
pad_value=fill)``, as the framework's models do in their forward; every other
call is the framework's verb. A ``None`` CP mesh (one rank) gets the identity
sharder, as the framework's dispatch does at ``cp_size <= 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel.sharder import (
    ContextParallelSharder,
    identity_local_indices,
    round_robin_local_indices,
    shard_batch_aux_only,
    shard_batch_identity,
    shard_sequence_for_cp_round_robin,
)

import cp_impl
from examples.automodel.adapters._compose import compose

FRAMEWORK_FUNCTION = shard_batch_aux_only
_STRATEGY = "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_aux_only"
SERVES = {"inkling2.prepare_cp_inputs": _STRATEGY, "mistral_large4.prepare_cp_inputs": _STRATEGY}


def _active(cp_mesh) -> bool:
    return cp_mesh is not None and cp_mesh.size() > 1


def _shard_batch(cp_mesh, tp_mesh, batch, **kwargs: Any):
    """``shard_batch_aux_only``, or the framework's identity sharder without an active CP mesh."""
    if not _active(cp_mesh):
        return shard_batch_identity(cp_mesh, tp_mesh, batch, **kwargs)
    return shard_batch_aux_only(cp_mesh, tp_mesh, batch, **kwargs)


def _local_indices(cp_mesh, padded_seq_len: int, device=None):
    """``round_robin_local_indices``, or the identity map without an active CP mesh."""
    if not _active(cp_mesh):
        return identity_local_indices(cp_mesh, padded_seq_len, device)
    return round_robin_local_indices(cp_mesh, padded_seq_len, device)


class AuxOnlySharder(ContextParallelSharder):
    """The framework's sharder; its primary-stream shard is the model side's ``shard_sequence_for_cp_round_robin``."""

    def shard_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, fill: float | int | None = None
    ) -> torch.Tensor:
        layout = self.shard_layout
        if (
            _active(self._cp_mesh)
            and fill is not None
            and layout is not None
            and layout.original_seq_len is not None
            and tensor.shape[seq_dim] == layout.original_seq_len
        ):
            local, _, _ = shard_sequence_for_cp_round_robin(self._cp_mesh, tensor, seq_dim=seq_dim, pad_value=fill)
            return local
        return super().shard_token_tensor(tensor, seq_dim=seq_dim, fill=fill)


def _aux_only(hook: Callable[..., dict[str, Any]], keeps_primary: Callable[..., bool]):
    def prepare(batch, *args: Any, **kwargs: Any) -> dict[str, Any]:
        ours = hook(batch, *args, **kwargs)
        if "document_ids" in batch or not keeps_primary(*args, **kwargs):  # packs; shard_primary=True: cp_impl's
            return ours
        return {"cp_sharder": AuxOnlySharder(shard_batch=_shard_batch, local_token_global_indices=_local_indices)}

    prepare.__name__, prepare.__doc__ = hook.__name__, hook.__doc__
    return prepare


def _mistral_keeps_primary(num_chunks: int = 1, shard_primary: bool = True) -> bool:
    return not shard_primary


inkling2, mistral_large4 = compose(
    __name__,
    inkling2={"prepare_cp_inputs": _aux_only(cp_impl.inkling2.prepare_cp_inputs, lambda *a, **k: True)},
    mistral_large4={"prepare_cp_inputs": _aux_only(cp_impl.mistral_large4.prepare_cp_inputs, _mistral_keeps_primary)},
)
