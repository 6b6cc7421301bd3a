"""Both documented gathers served by nemo-automodel 0.7.0's block-diagonal CP K/V all-gather.

Framework function: ``nemo_automodel.components.distributed.blockdiag_cp.exchange._AllGatherSeqDiff``
(``.apply(x, group, seq_dim)``), the differentiable K/V gather of the framework's shared
block-diagonal CP attention (``cp_blockdiag_sdpa`` with ``kv_exchange="allgather"``): every rank's
shard concatenated along ``seq_dim`` in rank order; backward reduce-scatters the gradient. It is a
private class of that module, used here exactly as ``cp_blockdiag_sdpa`` (``blockdiag_cp/runtime.py``) uses it.

Serves (translation only, nothing fixed):

- ``inkling2.gather_sequence(value [B, L, ...], mesh, differentiable) -> [B, N*L, ...]``: ``seq_dim=1``;
- ``mistral_large4.gather_tokens(value [T, ...], mesh, differentiable) -> [N*T, ...]``: ``seq_dim=0``.

Argument translation: mesh -> its process group; the framework only builds this exchange when the CP
group has more than one rank, so for ``mesh=None`` or one rank the adapter returns the input object,
as the documented API does; ``differentiable=False`` -> the call runs under ``torch.no_grad()``.
Everything else is ``cp_impl``'s.
"""

from __future__ import annotations

import torch
from nemo_automodel.components.distributed.blockdiag_cp import exchange as framework

from examples.automodel.adapters._compose import autograd_if, compose, cp_group

FRAMEWORK_FUNCTION = framework._AllGatherSeqDiff.apply
SERVES = {
    "inkling2.gather_sequence": "nemo_automodel.components.distributed.blockdiag_cp.exchange._AllGatherSeqDiff",
    "mistral_large4.gather_tokens": "nemo_automodel.components.distributed.blockdiag_cp.exchange._AllGatherSeqDiff",
}


def _gather(value: torch.Tensor, mesh, differentiable: bool, dim: int) -> torch.Tensor:
    group = cp_group(mesh)
    if group is None:
        return value
    with autograd_if(differentiable):
        return FRAMEWORK_FUNCTION(value, group, dim)


def gather_sequence(value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``[B, L, ...]`` on every rank -> ``[B, N*L, ...]`` in rank order, through the framework's gather."""
    return _gather(value, mesh, differentiable, 1)


def gather_tokens(value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``[T, ...]`` on every rank -> ``[N*T, ...]`` in rank order, through the framework's gather."""
    return _gather(value, mesh, differentiable, 0)


inkling2, mistral_large4 = compose(
    __name__, inkling2={"gather_sequence": gather_sequence}, mistral_large4={"gather_tokens": gather_tokens}
)
