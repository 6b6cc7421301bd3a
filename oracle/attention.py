"""Reference attention: rotary embedding and document-masked causal attention.

Everything is dense: the full ``[batch, heads, sequence, sequence]`` score
matrix is built and masked explicitly. Query ``i`` attends key ``j`` iff both
are kept, ``j <= i``, both lie in the same document, and (with a window)
``i - j < window``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rotary_embedding", "rotate_half", "allowed_keys", "attention"]


def rotate_half(x: Tensor) -> Tensor:
    """``rotate_half([a, b]) = [-b, a]`` along the last dim (halves ``a``, ``b``)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotary_embedding(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding, rotate-half convention.

    Args:
        x: ``[batch, sequence, heads, head_dim]``, ``head_dim`` even.
        positions: int ``[batch, sequence]``; position of each token inside its
            document (in tokens).
        base: rotary base (the wavelength scale).

    Returns:
        ``x * cos + rotate_half(x) * sin``, ``[batch, sequence, heads, head_dim]``,
        where ``inv_freq = base ** (-arange(0, head_dim, 2) / head_dim)``,
        ``angle = positions[..., None] * inv_freq`` (radians), and ``cos`` / ``sin``
        are repeated twice along the last dim. Computed in ``x``'s dtype
        (``inv_freq`` and the angles too).
    """
    if x.dim() != 4:
        raise ValueError(f"rotary_embedding: x must be [batch, sequence, heads, head_dim], got shape {tuple(x.shape)}")
    batch, sequence, _, head_dim = x.shape
    if head_dim % 2 != 0:
        raise ValueError(f"rotary_embedding: head_dim must be even, got {head_dim}")
    if tuple(positions.shape) != (batch, sequence):
        raise ValueError(
            f"rotary_embedding: positions must be [batch, sequence] = [{batch}, {sequence}], "
            f"got shape {tuple(positions.shape)}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=x.dtype, device=x.device) / head_dim
    inv_freq = base ** (-exponents)  # [head_dim / 2]
    angle = positions.to(x.dtype)[..., None] * inv_freq  # [batch, sequence, head_dim / 2]
    angle = torch.cat([angle, angle], dim=-1)[:, :, None, :]  # [batch, sequence, 1, head_dim]
    return x * angle.cos() + rotate_half(x) * angle.sin()


def allowed_keys(keep: Tensor, document_ids: Tensor, window: int | None = None) -> Tensor:
    """Dense attention mask.

    Args:
        keep: bool ``[batch, sequence]``.
        document_ids: int ``[batch, sequence]``.
        window: optional sliding window in tokens (``i - j < window``).

    Returns:
        bool ``[batch, sequence(query i), sequence(key j)]``, ``True`` where query
        ``i`` may attend key ``j``.
    """
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be None or an int >= 1 (tokens), got {window!r}")
    sequence = keep.shape[1]
    index = torch.arange(sequence, device=keep.device)
    i = index[:, None]  # query
    j = index[None, :]  # key
    allowed = keep[:, :, None] & keep[:, None, :]
    allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])
    allowed = allowed & (j <= i)[None]
    if window is not None:
        allowed = allowed & ((i - j) < window)[None]
    return allowed


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor,
    document_ids: Tensor,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Document-masked causal grouped-query attention.

    Args:
        q: ``[batch, sequence, q_heads, head_dim]``.
        k, v: ``[batch, sequence, kv_heads, head_dim]``; ``q_heads % kv_heads == 0``
            and key/value head ``h // (q_heads // kv_heads)`` serves query head ``h``.
        keep: bool ``[batch, sequence]``, real tokens.
        document_ids: int ``[batch, sequence]``, document of each slot.
        window: optional sliding window (tokens): also require ``i - j < window``.
        softcap: optional score soft-cap ``cap * tanh(score / cap)``, applied to
            the scaled scores before masking.

    Returns:
        ``[batch, sequence, q_heads, head_dim]``; rows of padding queries are
        exactly zero, and no gradient reaches ``q``, ``k``, ``v`` at padding
        positions (exactly zero, never NaN).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention: q, k, v must be [batch, sequence, heads, head_dim], got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, sequence, q_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != head_dim:
        raise ValueError(
            f"attention: k and v must be [batch, sequence, kv_heads, head_dim] matching q "
            f"{tuple(q.shape)}, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    kv_heads = k.shape[2]
    if kv_heads < 1 or q_heads % kv_heads != 0:
        raise ValueError(f"attention: q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    for name, tensor in (("keep", keep), ("document_ids", document_ids)):
        if tuple(tensor.shape) != (batch, sequence):
            raise ValueError(
                f"attention: {name} must be [batch, sequence] = [{batch}, {sequence}], got shape {tuple(tensor.shape)}"
            )
    if keep.dtype != torch.bool:
        raise ValueError(f"attention: keep must be bool, got {keep.dtype}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention: softcap must be None or > 0, got {softcap!r}")

    # Padding rows of q, k, v are replaced by zeros, so that whatever sits
    # there (even inf/NaN) can neither leak into real rows nor receive a
    # gradient: torch.where sends exactly zero to the unselected branch.
    kept = keep[:, :, None, None]
    q = torch.where(kept, q, torch.zeros((), dtype=q.dtype, device=q.device))
    k = torch.where(kept, k, torch.zeros((), dtype=k.dtype, device=k.device))
    v = torch.where(kept, v, torch.zeros((), dtype=v.dtype, device=v.device))

    group = q_heads // kv_heads
    k = k.repeat_interleave(group, dim=2)  # [batch, sequence, q_heads, head_dim]
    v = v.repeat_interleave(group, dim=2)

    qh = q.permute(0, 2, 1, 3)  # [batch, q_heads, sequence, head_dim]
    kh = k.permute(0, 2, 1, 3)
    vh = v.permute(0, 2, 1, 3)

    scores = (qh @ kh.transpose(-1, -2)) * head_dim**-0.5  # [batch, q_heads, query, key]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)

    allowed = allowed_keys(keep, document_ids, window)  # [batch, query, key]
    # A query with no allowed key (only padding queries: a kept query always
    # sees itself) would softmax an all -inf row into NaN. Give such rows the
    # harmless diagonal; their output is zeroed below.
    no_key = ~allowed.any(dim=-1, keepdim=True)
    diagonal = torch.eye(sequence, dtype=torch.bool, device=keep.device)[None]
    safe = allowed | (no_key & diagonal)

    scores = scores.masked_fill(~safe[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs @ vh).permute(0, 2, 1, 3)  # [batch, sequence, q_heads, head_dim]
    return torch.where(kept, out, torch.zeros((), dtype=out.dtype, device=out.device))
