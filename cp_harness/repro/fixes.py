"""Fixes proposed upstream, as a script ships them (``--fixed``): the documented gathers built on ``FixedGather``.

``FixedGather`` is the sequence gather proposed for nemo-automodel (``docs/real_clients.md``, D1-D4): an
all-gather forward; a backward that reduce-scatters *contiguous* gradient slices into a contiguous buffer (no
``empty_like`` of a permuted gradient, no global-rank peers), sums bfloat16/float16 slices in float32 and rounds
once, and never writes into the gradient it is handed. ``fixed_gather_sequence`` / ``fixed_gather_tokens`` give
it the documented signature. The source of what a script needs is copied into it (``subjects``); this module
imports only torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class FixedGather(torch.autograd.Function):
    """``[..., L, ...]`` -> ``[..., N*L, ...]`` along ``dim`` over ``group``, with the backward proposed upstream."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        wide = torch.float32 if grad.dtype in (torch.bfloat16, torch.float16) else grad.dtype
        pieces = [p.to(wide).contiguous() for p in grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)]
        mine = torch.empty(pieces[0].shape, dtype=wide, device=grad.device)
        dist.reduce_scatter(mine, pieces, group=ctx.group)
        return mine.to(grad.dtype), None, None


def fixed_gather_sequence(value, mesh, differentiable):
    """``inkling2.gather_sequence`` through ``FixedGather`` (dim 1)."""
    if mesh is None or mesh.size() == 1:
        return value
    with torch.enable_grad() if differentiable else torch.no_grad():
        return FixedGather.apply(value, mesh.get_group(), 1)


def fixed_gather_tokens(value, mesh, differentiable):
    """``mistral_large4.gather_tokens`` through ``FixedGather`` (dim 0)."""
    if mesh is None or mesh.size() == 1:
        return value
    with torch.enable_grad() if differentiable else torch.no_grad():
        return FixedGather.apply(value, mesh.get_group(), 0)


FIXED = {"inkling2.gather_sequence": fixed_gather_sequence, "mistral_large4.gather_tokens": fixed_gather_tokens}


def needed(function: str) -> list:
    """What a script calling ``function`` needs to ship its fix (empty: no fix is proposed for it)."""
    return [FixedGather, FIXED[function]] if function in FIXED else []
