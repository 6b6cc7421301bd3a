"""THD packs served by nemo-automodel 0.7.0's Transformer Engine THD batch sharding (``make_cp_batch_for_te``) through its ``ContextParallelSharder``.

What the framework runs for a model whose attention is TE on a THD batch (``qkv_format="thd"``): its sharder
dispatch (``context_parallel.utils._prepare_cp_sharder`` -> ``_resolve_cp_sharder(..., is_thd=True)``) returns a
``ContextParallelSharder`` whose ``shard_batch`` is the TE THD strategy: ``make_cp_batch_for_te`` flattens the rows
with ``thd_utils.split_batch_into_thd_chunks`` (``process_input_for_thd``: ``cu_seqlens`` / ``cu_seqlens_padded``
from ``seq_lens`` / ``seq_lens_padded``, the padding mask from the lengths), ``_shard_thd_chunk_for_te`` takes
TE's partition (``thd_get_partitioned_indices``: rank ``r`` holds chunks ``r`` and ``2N-1-r`` of every document)
and ``index_select``-s ``input_ids``, ``labels``, ``position_ids``, ``padding_mask``; the strategy reports the
partition as ``ShardLayout.local_token_global_indices`` with ``input_row_shape`` ``[B, S]`` and ``padded_seq_len``
``B*S``, which the token verbs use. The sharded batch is one flat stream ``[T_local]``.

**Stand-in**: on a CPU without Transformer Engine, TE's partition-index kernel is ``te_thd_partition_cpu``
(``STANDINS``; ``cp_harness/standins/te_thd_partition_cpu.py``): every report of this adapter says so. TE's
attention is not part of this path and is not run.

Translation only: ``mistral_large4.prepare_packed_cp_inputs`` validates and normalises the batch with ``cp_impl``
(which removes ``seq_lens`` / ``seq_lens_padded``: put back, as the framework reads them itself), marks it THD
(``qkv_format``, what the framework's THD packer sets) and returns the framework's sharder. Judged by the verb row
on THD packs as the framework's packer pads them (``ROWS``: documents padded to a multiple of ``2N``, TE's
precondition, which the recipe's packer guarantees; one pack a micro-batch: with ``num_chunks > 1`` the framework's
THD sharder reports no index map, by design): the verbs against the partition the strategy reports, and the
sharded batch's ``input_ids`` against it. The strategy's labels (unshifted, per token), positions and the flat
stream are another contract than the packed hook's (``document_ids``, first-label masking, ``[B, L]`` rows), so
the layout and model rows stay ``cp_impl``'s.
"""

from __future__ import annotations

from typing import Any

from nemo_automodel.components.distributed.context_parallel.utils import _resolve_cp_sharder, make_cp_batch_for_te

import cp_impl
from examples.automodel.adapters._compose import compose

FRAMEWORK_FUNCTION = make_cp_batch_for_te
ROWS = ("thd_packer_verbs",)
STANDINS = ("te_thd_partition_cpu",)
SEQ_LENS_PADDING = -1000  # the framework's seq_lens_padding_value (the dispatch passes it)
_FW = "nemo_automodel.components.distributed"
SERVES = {"mistral_large4.prepare_packed_cp_inputs": f"{_FW}.context_parallel.utils.make_cp_batch_for_te"}
ALSO_USES = {
    f"{_FW}.thd_utils.split_batch_into_thd_chunks": "flattens the pack (make_cp_batch_for_te's first step)",
    f"{_FW}.thd_utils.process_input_for_thd": "cu_seqlens / cu_seqlens_padded and the padding mask from the lengths",
    f"{_FW}.context_parallel.utils._shard_thd_chunk_for_te": "TE's partition, index_select of the token keys",
}


def _prepare_packed(batch, num_chunks: int, shard_primary: bool = True) -> dict[str, Any]:
    lengths = {key: batch[key] for key in ("seq_lens", "seq_lens_padded") if key in batch}
    cp_impl.mistral_large4.prepare_packed_cp_inputs(batch, num_chunks, shard_primary)  # validation, normalisation
    batch.update(lengths, qkv_format="thd")
    strategy = _resolve_cp_sharder(
        None,
        None,
        magi=None,
        is_thd=True,
        num_chunks=num_chunks,
        seq_lens_padding_value=SEQ_LENS_PADDING,
        model=None,
    )
    return {"cp_sharder": strategy}


_prepare_packed.__doc__ = cp_impl.mistral_large4.prepare_packed_cp_inputs.__doc__

inkling2, mistral_large4 = compose(__name__, mistral_large4={"prepare_packed_cp_inputs": _prepare_packed})
