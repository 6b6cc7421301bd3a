"""Adapters that gate nemo-automodel 0.7.0's own CP primitives with this harness.

One importable module per framework primitive. Each exposes ``inkling2`` and
``mistral_large4`` (the contract of ``cp_harness/cases/implementation.py``) built from
``cp_impl`` with the documented function(s) that primitive maps onto served by
the framework's code, and nothing else changed:

- ``kimi_linear_gather``: ``kimi_linear.cp.all_gather_sequence`` serves both gathers;
- ``deepseek_v41_gather``: ``deepseek_v41.cp.gather_sequence`` serves both gathers;
- ``blockdiag_gather``: ``blockdiag_cp.exchange._AllGatherSeqDiff`` serves both gathers;
- ``qwen3_8_flash_next_halo``: ``qwen3_8_flash_next.cp.qwen3_8_flash_next_cp_left_halo``
  serves ``inkling2.convolution_history``;
- ``shard_batch_contiguous``: the framework's shared ``shard_batch_contiguous`` inside its own
  ``ContextParallelSharder`` serves the hooks' sharding (packed mistral_large4 rows excepted);
- ``framework_sharder``: the framework's ``ContextParallelSharder`` class around ``cp_impl``'s
  strategies (the compatibility case of the sharder contract).
- ``shard_cp_batch_packed``: DeepSeek V4.1's ``shard_cp_batch`` (the packed re-pad into
  ``shard_batch_contiguous``, reporting ``input_token_stream_positions``) serves
  ``mistral_large4.prepare_packed_cp_inputs``; judged by the verb row only (not in ``ADAPTERS``).

Each module names what it serves in ``SERVES`` and the framework callable in
``FRAMEWORK_FUNCTION``; the adapters translate arguments (mesh to group,
dimensions, the ``differentiable`` flag) and fix nothing. ``ADAPTERS`` lists the
modules ``scripts/real_clients`` runs; a new adapter (e.g. the framework's
sharder through ``shard_batch_contiguous``) is one more module here and one
more entry in ``ADAPTERS``. Importing this package does not import the
framework; each adapter module does. Findings: ``docs/real_clients.md``.
"""

ADAPTERS = ("kimi_linear_gather", "deepseek_v41_gather", "blockdiag_gather", "qwen3_8_flash_next_halo",
            "shard_batch_contiguous", "framework_sharder")
