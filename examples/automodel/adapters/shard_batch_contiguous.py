"""Sharding served by nemo-automodel 0.7.0's shared ``shard_batch_contiguous`` through its ``ContextParallelSharder``.

The hooks normalise the batch with ``cp_impl`` (validation, ``padding_mask``,
``position_ids`` computed on the global sequence, ``document_ids`` of packs)
and return the framework's class holding the framework's strategy, as a model
hook would: ``ContextParallelSharder(shard_batch=partial(shard_batch_contiguous,
shard_primary=...), local_token_global_indices=contiguous_local_indices)``.
``shard_batch_contiguous`` pads the sequence to a multiple of
``cp_size * max(pad_multiple, 2)`` (not ``ceil(S/N)*N``), pads labels with
``-100``, ``padding_mask`` with ``True`` and continues positions, and mutates
the batch dict it is given (the dict becomes the local batch).

Translation only: inkling2 keeps ``input_ids`` global (``shard_primary=False``,
its documented behaviour); mistral_large4 passes its ``shard_primary``; a
``None`` CP mesh (one rank, which SPEC allows) gets the framework's identity
sharder (``shard_batch_identity`` / ``identity_local_indices``), as the
framework's own dispatch does at ``cp_size <= 1``. Packed
mistral_large4 batches keep ``cp_impl``'s packed strategy: the shared sharder
has no notion of documents (it neither masks the label of each document's
first token nor knows ``document_ids``), which the packed hook's contract
requires (``docs/real_clients.md``, ``cp_impl/README.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from nemo_automodel.components.distributed.context_parallel.sharder import (
    ContextParallelSharder,
    contiguous_local_indices,
    identity_local_indices,
    shard_batch_contiguous,
    shard_batch_identity,
)

import cp_impl
from examples.automodel.adapters._compose import compose

FRAMEWORK_FUNCTION = shard_batch_contiguous
_STRATEGY = "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_contiguous"
# The sharding of the hooks' batches (mistral_large4: BSHD rows; packs keep cp_impl's packed strategy).
SERVES = {"inkling2.prepare_cp_inputs": _STRATEGY, "mistral_large4.prepare_cp_inputs": _STRATEGY}


def _shard_batch(cp_mesh, tp_mesh, batch, *, shard_primary: bool, **kwargs: Any):
    """``shard_batch_contiguous``, or the framework's identity sharder without a CP mesh."""
    if cp_mesh is None:
        return shard_batch_identity(cp_mesh, tp_mesh, batch, **kwargs)
    return shard_batch_contiguous(cp_mesh, tp_mesh, batch, shard_primary=shard_primary, **kwargs)


def _local_indices(cp_mesh, padded_seq_len: int, device=None):
    """``contiguous_local_indices``, or the identity map without a CP mesh."""
    if cp_mesh is None:
        return identity_local_indices(cp_mesh, padded_seq_len, device)
    return contiguous_local_indices(cp_mesh, padded_seq_len, device)


def _framework_strategy(hook: Callable[..., dict[str, Any]], shard_primary: Callable[..., bool]):
    def prepare(batch, *args: Any, **kwargs: Any) -> dict[str, Any]:
        ours = hook(batch, *args, **kwargs)["cp_sharder"]
        if "document_ids" in batch:  # a normalised pack: the shared sharder has no document semantics
            return {"cp_sharder": ours}
        strategy = functools.partial(_shard_batch, shard_primary=shard_primary(*args, **kwargs))
        return {"cp_sharder": ContextParallelSharder(shard_batch=strategy, local_token_global_indices=_local_indices)}

    prepare.__name__, prepare.__doc__ = hook.__name__, hook.__doc__
    return prepare


def _mistral_shard_primary(num_chunks: int = 1, shard_primary: bool = True) -> bool:
    return shard_primary


inkling2, mistral_large4 = compose(
    __name__,
    inkling2={"prepare_cp_inputs": _framework_strategy(cp_impl.inkling2.prepare_cp_inputs, lambda *a, **k: False)},
    mistral_large4={
        "prepare_cp_inputs": _framework_strategy(cp_impl.mistral_large4.prepare_cp_inputs, _mistral_shard_primary)
    },
)
