"""Reference cross-entropy losses (sum and count; the mean is taken last).

Both losses return ``(loss_sum, count)``: the sum of per-token cross-entropy
(natural log, nats) over the counted positions and the number of counted
positions as an int64 0-dim tensor. Only counted rows of the logits enter the
computation, so uncounted rows (padding, ignored labels) get exactly zero
gradient even if they hold inf or NaN; when nothing counts the sum is an
exact, differentiable zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oracle.layout import IGNORE_INDEX

__all__ = ["shifted_cross_entropy", "aligned_cross_entropy", "mean_loss"]


def _prepare_logits(logits: Tensor, softcap: float | None) -> Tensor:
    """Upcast to at least float32 (float64 stays), then apply the optional soft-cap."""
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.to(torch.float32)
    if softcap is not None:
        if not softcap > 0:
            raise ValueError(f"softcap must be None or > 0, got {softcap!r}")
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _check_shapes(logits: Tensor, labels: Tensor, keep: Tensor, document_ids: Tensor | None) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, sequence, vocab], got shape {tuple(logits.shape)}")
    batch, sequence, _ = logits.shape
    named = [("labels", labels), ("keep", keep)]
    if document_ids is not None:
        named.append(("document_ids", document_ids))
    for name, tensor in named:
        if tuple(tensor.shape) != (batch, sequence):
            raise ValueError(
                f"{name} must be [batch, sequence] = [{batch}, {sequence}] like logits, got shape {tuple(tensor.shape)}"
            )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if keep.dtype != torch.bool:
        raise ValueError(f"keep must be bool, got dtype {keep.dtype}")


def _sum_cross_entropy(logits: Tensor, targets: Tensor, counted: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of ``-log_softmax(logits[b, t])[targets[b, t]]`` over ``counted[b, t]``.

    ``logits [batch, n, vocab]``, ``targets`` int and ``counted`` bool ``[batch, n]``.
    """
    vocab = logits.shape[-1]
    rows_b, rows_t = counted.nonzero(as_tuple=True)
    picked = logits[rows_b, rows_t]  # [count, vocab]
    target = targets[rows_b, rows_t].to(torch.int64)  # [count]
    out_of_range = (target < 0) | (target >= vocab)
    if bool(out_of_range.any()):
        first = int(out_of_range.nonzero()[0])
        raise ValueError(
            f"label {int(target[first])} used as a target at [{int(rows_b[first])}, "
            f"{int(rows_t[first])}] is outside the vocabulary [0, {vocab}); use {IGNORE_INDEX} "
            f"for positions without a target"
        )
    log_probs = torch.log_softmax(picked, dim=-1)
    nll = -log_probs.gather(1, target[:, None]).squeeze(1)
    count = torch.tensor(int(rows_b.numel()), dtype=torch.int64, device=logits.device)
    return nll.sum(), count


def shifted_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    keep: Tensor,
    document_ids: Tensor | None = None,
    *,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Hugging Face causal-LM loss: position ``t`` predicts ``labels[t + 1]``.

    Args:
        logits: ``[batch, sequence, vocab]``; upcast to at least float32
            (float64 stays float64), then soft-capped ``cap * tanh(logits / cap)``
            when ``softcap`` is given.
        labels: int ``[batch, sequence]``, unshifted; ``-100`` is ignored.
        keep: bool ``[batch, sequence]``, real tokens.
        document_ids: optional int ``[batch, sequence]``; when given, ``t`` and
            ``t + 1`` must lie in the same document.

    Position ``t`` counts when ``keep[t]``, ``keep[t + 1]``, ``labels[t + 1] != -100``
    and (if ``document_ids`` is given) ``document_ids[t] == document_ids[t + 1]``.
    The last position of a row never counts.

    Returns:
        ``(loss_sum, count)``: 0-dim sum of cross-entropy (nats) in the upcast
        dtype, and the int64 0-dim number of counted positions.
    """
    _check_shapes(logits, labels, keep, document_ids)
    logits = _prepare_logits(logits, softcap)
    counted = keep[:, :-1] & keep[:, 1:] & (labels[:, 1:] != IGNORE_INDEX)
    if document_ids is not None:
        counted = counted & (document_ids[:, :-1] == document_ids[:, 1:])
    return _sum_cross_entropy(logits[:, :-1], labels[:, 1:], counted)


def aligned_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    keep: Tensor,
    *,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Cross-entropy with labels already aligned: ``labels[t]`` is the target of position ``t``.

    Args:
        logits: ``[batch, sequence, vocab]``; upcast and soft-capped as in
            :func:`shifted_cross_entropy`.
        labels: int ``[batch, sequence]``; ``-100`` is ignored.
        keep: bool ``[batch, sequence]``.

    Position ``t`` counts when ``keep[t]`` and ``labels[t] != -100``.

    Returns:
        ``(loss_sum, count)`` as in :func:`shifted_cross_entropy`.
    """
    _check_shapes(logits, labels, keep, None)
    logits = _prepare_logits(logits, softcap)
    counted = keep & (labels != IGNORE_INDEX)
    return _sum_cross_entropy(logits, labels, counted)


def mean_loss(loss_sum: Tensor, count: Tensor) -> Tensor:
    """``loss_sum / count``, or ``0 * loss_sum`` (a finite zero with zero gradients) when ``count == 0``."""
    if int(count) == 0:
        return loss_sum * 0
    return loss_sum / count
