"""Reference causal depthwise convolution over documents.

Output ``t`` sums tap ``k = 0..W-1`` of input ``t - k`` only when ``t - k``
is a kept slot of the same document as ``t``: the convolution never reads
across a document boundary or from padding, and padding outputs are zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["causal_depthwise_conv"]


def causal_depthwise_conv(x: Tensor, weight: Tensor, keep: Tensor, document_ids: Tensor) -> Tensor:
    """Causal depthwise (per-channel) convolution that stays inside documents.

    Args:
        x: ``[batch, sequence, channels]``.
        weight: ``[width, channels]``; ``weight[k]`` multiplies the input ``k``
            tokens back (``k = 0`` is the current token).
        keep: bool ``[batch, sequence]``, real tokens.
        document_ids: int ``[batch, sequence]``, document of each slot.

    Returns:
        ``y [batch, sequence, channels]`` with
        ``y[t] = sum_k weight[k] * x[t - k]`` over ``k = 0..width-1`` such that
        ``t - k >= 0``, ``keep[t - k]`` and ``document_ids[t - k] == document_ids[t]``;
        ``y[t] = 0`` where ``keep[t]`` is False. Taps are summed in order
        ``k = 0, 1, ...``. No gradient reaches ``x`` at padding slots (exactly zero).
    """
    if x.dim() != 3:
        raise ValueError(f"causal_depthwise_conv: x must be [batch, sequence, channels], got shape {tuple(x.shape)}")
    batch, sequence, channels = x.shape
    if weight.dim() != 2:
        raise ValueError(f"causal_depthwise_conv: weight must be [width, channels], got shape {tuple(weight.shape)}")
    width = weight.shape[0]
    if width < 1:
        raise ValueError(f"causal_depthwise_conv: width (weight.shape[0]) must be >= 1, got {width}")
    if weight.shape[1] != channels:
        raise ValueError(
            f"causal_depthwise_conv: weight has {weight.shape[1]} channels but x has {channels}; "
            f"weight must be [width, channels]"
        )
    for name, tensor in (("keep", keep), ("document_ids", document_ids)):
        if tuple(tensor.shape) != (batch, sequence):
            raise ValueError(
                f"causal_depthwise_conv: {name} must be [batch, sequence] = [{batch}, {sequence}], "
                f"got shape {tuple(tensor.shape)}"
            )
    if keep.dtype != torch.bool:
        raise ValueError(f"causal_depthwise_conv: keep must be bool, got {keep.dtype}")

    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    y = torch.zeros(batch, sequence, channels, dtype=torch.result_type(x, weight), device=x.device)
    for k in range(min(width, sequence)):
        # Target slots t = k..S-1 read source slots t - k = 0..S-1-k.
        source = x[:, : sequence - k]
        valid = keep[:, k:] & keep[:, : sequence - k] & (document_ids[:, : sequence - k] == document_ids[:, k:])
        tap = torch.where(valid[..., None], source, zero) * weight[k]
        shifted = torch.cat([torch.zeros(batch, k, channels, dtype=tap.dtype, device=x.device), tap], dim=1)
        y = y + shifted
    return y
