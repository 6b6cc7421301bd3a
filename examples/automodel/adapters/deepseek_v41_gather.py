"""Both documented gathers served by nemo-automodel 0.7.0's DeepSeek V4.1 ``gather_sequence``.

Framework function: ``nemo_automodel.components.models.deepseek_v41.cp.gather_sequence(tensor, group)``:
``[batch, local_sequence, ...]`` on every rank -> ``[batch, N * local_sequence, ...]`` (concatenated
along dim 1), differentiable when ``tensor.requires_grad`` through
``torch.distributed.nn.functional.all_gather``; ``group=None`` returns the input.

Serves (translation only, nothing fixed):

- ``mistral_large4.gather_tokens(value [T, ...], mesh, differentiable) -> [N*T, ...]``: the
  framework gathers along dim 1, so ``value`` is viewed as ``[1, T, ...]`` and the result
  ``[1, N*T, ...]`` viewed back as ``[N*T, ...]`` (the issue's pairing);
- ``inkling2.gather_sequence(value [B, L, ...], mesh, differentiable) -> [B, N*L, ...]``: the
  framework's own dim, passed through.

Argument translation shared by both: mesh -> its process group (``None`` for ``mesh=None`` or one
rank, where the framework returns its input object, as documented); ``differentiable=False`` -> the
call runs under ``torch.no_grad()`` (the framework has no such flag: it follows ``requires_grad``).
Everything else (the other documented functions, the sharder) is ``cp_impl``'s.
"""

from __future__ import annotations

import torch
from nemo_automodel.components.models.deepseek_v41 import cp as framework

from examples.automodel.adapters._compose import autograd_if, compose, cp_group

FRAMEWORK_FUNCTION = framework.gather_sequence
SERVES = {
    "mistral_large4.gather_tokens": "nemo_automodel.components.models.deepseek_v41.cp.gather_sequence",
    "inkling2.gather_sequence": "nemo_automodel.components.models.deepseek_v41.cp.gather_sequence",
}


def gather_tokens(value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``[T, ...]`` on every rank -> ``[N*T, ...]`` in rank order, through the framework's gather."""
    group = cp_group(mesh)
    if group is None:
        return FRAMEWORK_FUNCTION(value, None)
    with autograd_if(differentiable):
        return FRAMEWORK_FUNCTION(value.unsqueeze(0), group).squeeze(0)


def gather_sequence(value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``[B, L, ...]`` on every rank -> ``[B, N*L, ...]`` in rank order, through the framework's gather."""
    group = cp_group(mesh)
    with autograd_if(differentiable or group is None):
        return FRAMEWORK_FUNCTION(value, group)


inkling2, mistral_large4 = compose(
    __name__, inkling2={"gather_sequence": gather_sequence}, mistral_large4={"gather_tokens": gather_tokens}
)
