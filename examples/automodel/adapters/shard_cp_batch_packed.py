"""Packed rows served by nemo-automodel 0.7.0's DeepSeek V4.1 ``shard_cp_batch`` (the packed re-pad) through its ``ContextParallelSharder``.

``deepseek_v41.cp.shard_cp_batch`` re-pads each packed row so that every document starts at a multiple
of ``packed_alignment`` (``packing.packed_layout``), then shards it with the shared
``shard_batch_contiguous`` (rank ``r`` owns ``[r*L, (r+1)*L)``); its ``ShardLayout`` reports
``input_token_stream_positions`` ``[B, S]`` (input column -> re-padded column, ``-1`` for an input pad
slot whose token is dropped) and ``padded_seq_len``, no ``original_seq_len``: a repositioned layout,
which the verbs map through (``shard_token_tensor(x[B, S], fill=)``, ``gather_token_tensor(trim=True, fill=)``).

Translation only: ``mistral_large4.prepare_packed_cp_inputs`` validates and normalises the batch with
``cp_impl`` (which removes ``seq_lens`` / ``seq_lens_padded``; they are put back, since ``shard_cp_batch``
reads them itself), then returns the framework's class holding ``partial(shard_cp_batch,
packed_alignment=ALIGNMENT)`` and ``contiguous_local_indices`` (the identity map without a CP mesh, where
``shard_cp_batch`` reports the map itself). Only the verb row is this adapter's business: ``shard_cp_batch``
expects labels already shifted per document and produces ``packed_seq_ids``, not the packed hook's
``document_ids`` and first-label masking, so the layout and model rows judge a different contract
(``docs/real_clients.md``). Everything else is ``cp_impl``'s.
"""

from __future__ import annotations

import functools
from typing import Any

from nemo_automodel.components.distributed.context_parallel.sharder import (
    ContextParallelSharder,
    contiguous_local_indices,
    identity_local_indices,
)
from nemo_automodel.components.models.deepseek_v41.cp import shard_cp_batch

import cp_impl
from examples.automodel.adapters._compose import compose

FRAMEWORK_FUNCTION = shard_cp_batch
ALIGNMENT = 4  # a document starts at a multiple of 4: the re-pad moves tokens whenever a document is not
ROWS = (
    "sharder_verbs",
)  # the packed re-pad's layout contract differs (per-document pre-shifted labels, packed_seq_ids)
SERVES = {"mistral_large4.prepare_packed_cp_inputs": "nemo_automodel.components.models.deepseek_v41.cp.shard_cp_batch"}


def _local_indices(cp_mesh, padded_seq_len: int, device=None):
    if cp_mesh is None:
        return identity_local_indices(cp_mesh, padded_seq_len, device)
    return contiguous_local_indices(cp_mesh, padded_seq_len, device)


def _prepare_packed(batch, num_chunks: int, shard_primary: bool = True) -> dict[str, Any]:
    lengths = {key: batch[key] for key in ("seq_lens", "seq_lens_padded") if key in batch}
    cp_impl.mistral_large4.prepare_packed_cp_inputs(batch, num_chunks, shard_primary)  # validation, normalisation
    batch.update(lengths)
    strategy = functools.partial(shard_cp_batch, packed_alignment=ALIGNMENT)
    return {"cp_sharder": ContextParallelSharder(shard_batch=strategy, local_token_global_indices=_local_indices)}


_prepare_packed.__doc__ = cp_impl.mistral_large4.prepare_packed_cp_inputs.__doc__

inkling2, mistral_large4 = compose(__name__, mistral_large4={"prepare_packed_cp_inputs": _prepare_packed})
