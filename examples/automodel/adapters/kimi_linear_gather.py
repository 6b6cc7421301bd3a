"""Both documented gathers served by nemo-automodel 0.7.0's Kimi Linear ``all_gather_sequence``.

Framework function: ``nemo_automodel.components.models.kimi_linear.cp.all_gather_sequence(tensor,
cp_group, *, dim=1)``: every rank's shard concatenated along ``dim`` in rank order, always
differentiable (``dist.all_gather`` forward; backward all-reduces the whole gradient and keeps this
rank's slice). ``kimi_k3.cp`` and ``glm5_next.cp`` carry the same function.

Serves (translation only, nothing fixed):

- ``inkling2.gather_sequence(value [B, L, ...], mesh, differentiable) -> [B, N*L, ...]``: ``dim=1``
  (the issue's pairing);
- ``mistral_large4.gather_tokens(value [T, ...], mesh, differentiable) -> [N*T, ...]``: ``dim=0``.

Argument translation: mesh -> its process group. The framework function has no single-rank path
(it would gather over the default group); its caller, ``KimiMLAttention.forward``, only calls it when
the batch is CP-sharded (``packed_context.cp_enabled``), so for ``mesh=None`` or one rank the adapter
returns the input object, as the documented API does. ``differentiable=False`` -> the call runs
under ``torch.no_grad()``. Everything else is ``cp_impl``'s.
"""

from __future__ import annotations

import torch
from nemo_automodel.components.models.kimi_linear import cp as framework

from examples.automodel.adapters._compose import autograd_if, compose, cp_group

FRAMEWORK_FUNCTION = framework.all_gather_sequence
SERVES = {
    "inkling2.gather_sequence": "nemo_automodel.components.models.kimi_linear.cp.all_gather_sequence",
    "mistral_large4.gather_tokens": "nemo_automodel.components.models.kimi_linear.cp.all_gather_sequence",
}


def _gather(value: torch.Tensor, mesh, differentiable: bool, dim: int) -> torch.Tensor:
    group = cp_group(mesh)
    if group is None:
        return value  # the framework's caller skips the gather without CP
    with autograd_if(differentiable):
        return FRAMEWORK_FUNCTION(value, group, dim=dim)


def gather_sequence(value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``[B, L, ...]`` on every rank -> ``[B, N*L, ...]`` in rank order, through the framework's gather."""
    return _gather(value, mesh, differentiable, 1)


def gather_tokens(value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``[T, ...]`` on every rank -> ``[N*T, ...]`` in rank order, through the framework's gather."""
    return _gather(value, mesh, differentiable, 0)


inkling2, mistral_large4 = compose(
    __name__, inkling2={"gather_sequence": gather_sequence}, mistral_large4={"gather_tokens": gather_tokens}
)
