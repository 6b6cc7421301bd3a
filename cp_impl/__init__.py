"""Multi-rank implementation of the model-owned context-parallel (CP) modules.

Submodules (the documented API):

- :mod:`cp_impl.inkling2`: ``convolution_history``, ``gather_sequence``,
  ``prepare_cp_inputs``, ``unpack_row_layout``, ``validate_document_positions``, ``CPBatch``.
- :mod:`cp_impl.mistral_large4`: ``gather_tokens``, ``prepare_cp_inputs``,
  ``prepare_packed_cp_inputs``, ``shifted_cp_loss``, ``CPBatch``.
- :mod:`cp_impl.sharder`: ``ContextParallelSharder``, ``ShardLayout``,
  ``contiguous_local_token_global_indices``.

This package knows nothing of the oracles or the harness.
"""

from . import inkling2, mistral_large4, sharder

__all__ = ["inkling2", "mistral_large4", "sharder"]
