"""Sharding served by nemo-automodel 0.7.0's default CP path, ``shard_batch_load_balanced``, through its ``ContextParallelSharder``.

The framework's default framework-owned CP path (layout ``"round_robin"``):
``ContextParallelSharder(shard_batch=shard_batch_load_balanced,
local_token_global_indices=round_robin_local_indices)``, as its dispatch
(``context_parallel.utils._prepare_cp_sharder``) builds it when CP is active.
``shard_batch_load_balanced`` pads every buffer to a multiple of ``2 * cp_size``
(labels ``-100``, ``padding_mask`` ``True``, everything else 0), returns the
batch FULL-length, and a ``ctx_factory`` whose torch ``context_parallel``
context shards the buffers in place (``resize_`` / ``copy_``) when entered:
the local tensors exist only inside ``with ctx_factory():``, as in the
framework's train step. Rank ``r`` owns chunks ``r`` and ``2N-1-r``.

Translation only: the path shards the primary stream (``input_ids``), so it
serves the hooks whose contract shards it: ``mistral_large4.prepare_cp_inputs``
with ``shard_primary=True``. The hooks that keep ``input_ids`` global
(inkling2, ``shard_primary=False``) are the aux-only peer's
(``examples.automodel.adapters.shard_batch_aux_only``) and stay ``cp_impl``'s here, as do
packs (the path has no notion of documents). A ``None`` CP mesh (one rank)
gets the framework's identity sharder, as its dispatch does at
``cp_size <= 1``.
"""

from __future__ import annotations

from typing import Any

from nemo_automodel.components.distributed.context_parallel.sharder import (
    ContextParallelSharder,
    identity_local_indices,
    round_robin_local_indices,
    shard_batch_identity,
    shard_batch_load_balanced,
)

import cp_impl
from examples.automodel.adapters._compose import compose

FRAMEWORK_FUNCTION = shard_batch_load_balanced
_STRATEGY = "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_load_balanced"
# BSHD mistral_large4 rows with shard_primary=True; everything else stays cp_impl's.
SERVES = {"mistral_large4.prepare_cp_inputs": _STRATEGY}


def _shard_batch(cp_mesh, tp_mesh, batch, **kwargs: Any):
    """``shard_batch_load_balanced``, or the framework's identity sharder without an active CP mesh."""
    if cp_mesh is None or cp_mesh.size() <= 1:
        return shard_batch_identity(cp_mesh, tp_mesh, batch, **kwargs)
    return shard_batch_load_balanced(cp_mesh, tp_mesh, batch, **kwargs)


def _local_indices(cp_mesh, padded_seq_len: int, device=None):
    """``round_robin_local_indices``, or the identity map without an active CP mesh."""
    if cp_mesh is None or cp_mesh.size() <= 1:
        return identity_local_indices(cp_mesh, padded_seq_len, device)
    return round_robin_local_indices(cp_mesh, padded_seq_len, device)


def _prepare(batch, num_chunks: int = 1, shard_primary: bool = True) -> dict[str, Any]:
    ours = cp_impl.mistral_large4.prepare_cp_inputs(batch, num_chunks=num_chunks, shard_primary=shard_primary)
    if "document_ids" in batch or not shard_primary:  # packs, and the aux-only hook contract: cp_impl's
        return ours
    return {"cp_sharder": ContextParallelSharder(shard_batch=_shard_batch, local_token_global_indices=_local_indices)}


_prepare.__name__, _prepare.__doc__ = "prepare_cp_inputs", cp_impl.mistral_large4.prepare_cp_inputs.__doc__

inkling2, mistral_large4 = compose(__name__, mistral_large4={"prepare_cp_inputs": _prepare})
