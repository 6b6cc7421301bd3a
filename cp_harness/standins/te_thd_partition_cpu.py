"""Stand-in ``te_thd_partition_cpu``: Transformer Engine's THD partition-index kernel,
``transformer_engine_torch.thd_get_partitioned_indices``, computed in torch on a CPU.

nemo-automodel 0.7.0 shards a THD (packed) batch for TE attention in ``context_parallel/utils.py``:
``make_cp_batch_for_te`` flattens the rows with ``thd_utils.split_batch_into_thd_chunks`` (which runs
``process_input_for_thd``), and ``_shard_thd_chunk_for_te`` asks TE for this rank's token indices and
``index_select``-s ``input_ids``, ``labels``, ``position_ids`` and ``padding_mask`` with them; the THD sharder
installs the same indices as its ``ShardLayout.local_token_global_indices``. The only device code on that path is
the index kernel (``import transformer_engine_torch as tex``: a CUDA extension, ``thd_partition_indices_kernel``
in TE's ``context_parallel.cu``). TE's attention itself is not stood in for: it stays GPU-only.

The kernel's contract (TE 2.x, read from its source, no line copied): ``thd_get_partitioned_indices(cu_seqlens,
total_tokens, world_size, rank) -> int32 [total_tokens // world_size]``, with ``cu_seqlens`` int32 ``[D + 1]``, every
boundary divisible by ``2 * world_size``, ``total_tokens`` positive and divisible by ``2 * world_size``, ``0 <= rank
< world_size``. Each document of padded length ``L`` is cut in ``2 * world_size`` chunks of ``L / (2 *
world_size)``; rank ``r`` holds chunks ``r`` and ``2 * world_size - 1 - r`` of every document, in document order.
Local slots past ``cu_seqlens[-1] / world_size`` (a stream longer than its documents) belong to the last document
in the kernel's arithmetic: its binary search never returns past the last document, so those slots continue the
last document's second chunk (an index that can exceed the stream). The stand-in computes exactly that, and raises
``RuntimeError`` where the kernel's checks fail (dtype, shape, rank, divisibility), on the input's device.

While installed, ``import transformer_engine_torch`` yields a module holding that one function (and any other
attribute raises ``AttributeError`` naming the stand-in): entered only where TE is not installed, so a real TE
keeps its kernel. ``meets`` nothing: a spec or tool using it still needs what else TE would provide.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator

import torch

from cp_harness.standins.registry import StandIn, register

MODULE = "transformer_engine_torch"
_CALLS = [0]


def thd_get_partitioned_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """This rank's token indices of a THD stream, TE's contract (module docstring): ``int32 [total_tokens //
    world_size]`` on ``cu_seqlens``'s device; ``RuntimeError`` where the kernel's checks fail."""
    _CALLS[0] += 1
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise RuntimeError(
            f"thd_get_partitioned_indices: cu_seqlens must be int32 [documents + 1] with at least 2 entries, got "
            f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}"
        )
    if world_size <= 0 or not 0 <= rank < world_size:
        raise RuntimeError(f"thd_get_partitioned_indices: rank {rank} outside world_size {world_size}")
    factor = 2 * world_size
    if total_tokens <= 0 or total_tokens % factor:
        raise RuntimeError(
            f"thd_get_partitioned_indices: total_tokens {total_tokens} must be positive and divisible by "
            f"2 * world_size = {factor}"
        )
    if bool((cu_seqlens % factor != 0).any()):
        raise RuntimeError(
            f"thd_get_partitioned_indices: every cu_seqlens boundary must be divisible by 2 * world_size = "
            f"{factor}, got {cu_seqlens.tolist()}"
        )
    local_cu = cu_seqlens.to(torch.int64) // world_size  # [D + 1]: each document's local share starts here
    documents = local_cu.numel() - 1
    slots = torch.arange(total_tokens // world_size, device=cu_seqlens.device)
    # the kernel's search: the number of inner boundaries at or before the slot, never past the last document
    doc = (local_cu[1:documents].unsqueeze(0) <= slots.unsqueeze(1)).sum(dim=1)
    share = local_cu[doc + 1] - local_cu[doc]  # 2 chunks of this document
    offset = slots - local_cu[doc]
    chunk = torch.where(offset < share // 2, rank, 2 * world_size - 2 - rank)
    return (offset + local_cu[doc] * world_size + share // 2 * chunk).to(torch.int32)


def _calls() -> int:
    return _CALLS[0]


def _module() -> types.ModuleType:
    module = types.ModuleType(MODULE, f"{MODULE} stand-in ({__name__}): thd_get_partitioned_indices only")

    def missing(name: str):
        raise AttributeError(
            f"{MODULE}.{name}: not provided by the CPU stand-in te_thd_partition_cpu (only "
            "thd_get_partitioned_indices is); this path needs Transformer Engine"
        )

    vars(module).update(thd_get_partitioned_indices=thd_get_partitioned_indices, __getattr__=missing)
    return module


@contextlib.contextmanager
def install() -> Iterator[None]:
    """``import transformer_engine_torch`` gives the stand-in module inside the block, where TE is not installed;
    a real TE is left alone. Undone on exit."""
    if MODULE in sys.modules or importlib.util.find_spec(MODULE) is not None:
        yield
        return
    sys.modules[MODULE] = _module()
    try:
        yield
    finally:
        sys.modules.pop(MODULE, None)


TE_THD_PARTITION_CPU = register(
    StandIn(
        name="te_thd_partition_cpu",
        device_type="cpu",
        replaces="transformer_engine_torch.thd_get_partitioned_indices (CUDA kernel thd_partition_indices_kernel)",
        role="TE THD partition index kernel",
        computes_with="torch integer arithmetic (per document: chunks r and 2N-1-r of 2N)",
        meets="",
        install=install,
        calls=_calls,
    )
)
