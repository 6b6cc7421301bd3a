"""``inkling2.convolution_history`` served by nemo-automodel 0.7.0's Qwen3.8-Flash-Next left halo.

Framework function: ``nemo_automodel.components.models.qwen3_8_flash_next.cp.qwen3_8_flash_next_cp_left_halo(
tensor, context, *, history)``: this rank's ``[batch, local_sequence, channels]`` -> the ``history``
global rows just before the shard, ``[batch, history, channels]``, zeros before global position 0,
possibly spanning several earlier ranks; differentiable (an all-gather of every rank's last
``min(history, local_sequence)`` rows through ``torch.distributed.nn.functional.all_gather``).

Translation only, nothing fixed:

- mesh -> the framework's ``Qwen3_8_FlashNextCPContext`` (group, rank, size, contiguous
  ``local_sequence_start = rank * L``, ``local_sequence_length = L``). The context also carries the
  replicated raw token ids and padding mask, used only for the model's per-layer-embedding hashing
  and never read by the halo; the adapter fills them with zeros ``[batch, N * L]`` of the required
  dtypes. ``mesh=None`` or one rank -> a context of size 1 (the framework then returns zeros);
- ``width`` -> ``history = width - 1``; the documented result is the history followed by the shard,
  so the adapter returns ``cat([halo, masked], dim=1)``, ``[batch, L + width - 1, channels]``.
  A ``width < 1`` reaches the framework as a negative history, which it rejects with ``ValueError``.

Everything else (the other documented functions, the sharder) is ``cp_impl``'s.
"""

from __future__ import annotations

import torch
from nemo_automodel.components.models.qwen3_8_flash_next import cp as framework

from examples.automodel.adapters._compose import compose, cp_group

FRAMEWORK_FUNCTION = framework.qwen3_8_flash_next_cp_left_halo
SERVES = {
    "inkling2.convolution_history": "nemo_automodel.components.models.qwen3_8_flash_next.cp.qwen3_8_flash_next_cp_left_halo"
}


def context_for(masked: torch.Tensor, mesh) -> framework.Qwen3_8_FlashNextCPContext:
    """The framework's CP context for this rank's ``masked [B, L, C]`` on ``mesh``."""
    group = cp_group(mesh)
    size = 1 if group is None else int(mesh.size())
    rank = 0 if group is None else int(mesh.get_local_rank())
    batch, local = int(masked.shape[0]), int(masked.shape[1])
    ids = torch.zeros(batch, size * local, dtype=torch.int64, device=masked.device)
    return framework.Qwen3_8_FlashNextCPContext(
        group=group,
        rank=rank,
        size=size,
        global_input_ids=ids,
        global_padding_mask=torch.zeros_like(ids, dtype=torch.bool),
        local_sequence_start=rank * local,
        local_sequence_length=local,
    )


def convolution_history(masked: torch.Tensor, mesh, width: int) -> torch.Tensor:
    """``[B, L, C]`` -> ``[B, L + width - 1, C]``: the framework's left halo, then ``masked``."""
    halo = FRAMEWORK_FUNCTION(masked, context_for(masked, mesh), history=width - 1)
    return torch.cat([halo, masked], dim=1)


inkling2, mistral_large4 = compose(__name__, inkling2={"convolution_history": convolution_history})
