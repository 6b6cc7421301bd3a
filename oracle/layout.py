"""Row layouts: which slots are real, which document each slot belongs to,
and the position of each token inside its document.

A *layout* is computed on the global (unsharded) sequence from layout
metadata only -- ``seq_lens`` / ``seq_lens_padded`` (THD packs) or
``attention_mask`` (BSHD rows) -- and never from token values, so a real EOS
token whose id equals the pad id stays real.

The three tensors of a :class:`Layout` are derived independently of each
other from the metadata (documents are never inferred from positions), so
that a consumer may cross-check them.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "FILLER",
    "IGNORE_INDEX",
    "Layout",
    "layout_from_lengths",
    "layout_from_attention_mask",
    "layout_from_batch",
]

#: Value that right-fills ``seq_lens`` / ``seq_lens_padded`` where a row holds
#: fewer documents than the widest row.
FILLER = -1000

#: Label value that is never a target (PyTorch / Hugging Face convention).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Layout:
    """Layout of a batch of rows, every tensor ``[batch, sequence]``.

    Attributes:
        keep: bool ``[batch, sequence]``; ``True`` at real tokens, ``False`` at
            padding (per-document padding, tail padding, masked-out slots).
        document_ids: int64 ``[batch, sequence]``; index of the document inside
            its row (``0, 1, ...`` in the order of ``seq_lens``), ``-1`` for
            slots outside every document. Per-document padding carries the
            index of its document.
        positions: int64 ``[batch, sequence]``; position of a real token inside
            its document, ``0`` at the document's first token. The value at
            padding slots is ``0``; it is unspecified by the contract and must
            never be compared.
    """

    keep: Tensor
    document_ids: Tensor
    positions: Tensor


def _as_int_matrix(value: Any, field: str) -> Tensor:
    """Return ``value`` as an int64 tensor, checking it is integer and 2-D."""
    tensor = torch.as_tensor(value)
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise ValueError(
            f"{field} must hold integers, got dtype {tensor.dtype}; "
            f"pass an integer tensor such as torch.tensor([[3, 2]])"
        )
    if tensor.dim() != 2:
        raise ValueError(
            f"{field} must be 2-D [batch, documents], got shape {tuple(tensor.shape)}; wrap a single row as [[...]]"
        )
    return tensor.to(torch.int64)


def _validate_lengths(seq_lens: Tensor, seq_lens_padded: Tensor, sequence_length: int) -> None:
    """Raise ``ValueError`` naming field, row and document for malformed lengths."""
    if seq_lens.shape != seq_lens_padded.shape:
        raise ValueError(
            f"seq_lens has shape {tuple(seq_lens.shape)} but seq_lens_padded has shape "
            f"{tuple(seq_lens_padded.shape)}; both must be [batch, documents] with the "
            f"-1000 filler in the same slots"
        )
    batch, documents = seq_lens.shape
    for b in range(batch):
        seen_filler = False
        total_padded = 0
        for d in range(documents):
            real = int(seq_lens[b, d])
            padded = int(seq_lens_padded[b, d])
            real_is_filler = real == FILLER
            padded_is_filler = padded == FILLER
            if real_is_filler != padded_is_filler:
                raise ValueError(
                    f"row {b}, document {d}: seq_lens is {real} but seq_lens_padded is "
                    f"{padded}; the filler {FILLER} must sit in the same slots of both"
                )
            if real_is_filler:
                seen_filler = True
                continue
            for field, length in (("seq_lens", real), ("seq_lens_padded", padded)):
                if length < 0:
                    raise ValueError(
                        f"{field}[{b}, {d}] = {length} is negative; lengths must be >= 0 "
                        f"(only the filler {FILLER} may be negative)"
                    )
            if seen_filler:
                raise ValueError(
                    f"seq_lens[{b}, {d}] = {real} comes after the filler {FILLER} in row {b}; "
                    f"the filler must only right-fill a row (put documents first)"
                )
            if real > padded:
                raise ValueError(
                    f"row {b}, document {d}: seq_lens = {real} exceeds seq_lens_padded = "
                    f"{padded}; the padded length includes the real tokens, so it must be >= "
                    f"the real length"
                )
            total_padded += padded
        if total_padded > sequence_length:
            raise ValueError(
                f"row {b}: sum of seq_lens_padded = {total_padded} exceeds the sequence "
                f"length {sequence_length}; shorten the documents or lengthen the sequence"
            )


def layout_from_lengths(seq_lens: Any, seq_lens_padded: Any, sequence_length: int) -> Layout:
    """Layout of THD-packed rows.

    Args:
        seq_lens: int ``[batch, documents]``; real length of each document,
            right-filled with ``FILLER`` (-1000) where a row has fewer documents.
        seq_lens_padded: int ``[batch, documents]``; length of each document
            including its per-document padding (which sits at the end of the
            document), filler in the same slots as ``seq_lens``.
        sequence_length: number of slots per row (tokens).

    Document ``d`` of a row occupies ``seq_lens_padded[b, d]`` slots directly
    after document ``d - 1``; its first ``seq_lens[b, d]`` slots are real, the
    rest are padding carrying document id ``d``. Slots after the last document
    are padding with document id ``-1``. Documents of real length 0 are
    allowed (all their slots are padding).

    Returns:
        A :class:`Layout` with tensors of shape ``[batch, sequence_length]`` on
        the device of ``seq_lens``.

    Raises:
        ValueError: naming field, row and document, for non-2-D or mismatching
            shapes, negative lengths other than the filler, a length after the
            filler, real > padded, or a row whose padded lengths overflow.
    """
    lens = _as_int_matrix(seq_lens, "seq_lens")
    lens_padded = _as_int_matrix(seq_lens_padded, "seq_lens_padded")
    try:
        valid_length = not isinstance(sequence_length, bool) and operator.index(sequence_length) >= 0
    except TypeError:
        valid_length = False
    if not valid_length:
        raise ValueError(
            f"sequence_length must be a non-negative int, got {sequence_length!r}; pass input_ids.shape[1]"
        )
    sequence_length = operator.index(sequence_length)
    _validate_lengths(lens, lens_padded, sequence_length)

    batch, documents = lens.shape
    device = lens.device
    keep = torch.zeros(batch, sequence_length, dtype=torch.bool, device=device)
    document_ids = torch.full((batch, sequence_length), -1, dtype=torch.int64, device=device)
    positions = torch.zeros(batch, sequence_length, dtype=torch.int64, device=device)

    for b in range(batch):
        start = 0
        for d in range(documents):
            real = int(lens[b, d])
            padded = int(lens_padded[b, d])
            if real == FILLER:
                break
            # Each tensor is written from the lengths directly.
            document_ids[b, start : start + padded] = d
            keep[b, start : start + real] = True
            positions[b, start : start + real] = torch.arange(real, dtype=torch.int64, device=device)
            start += padded
    return Layout(keep=keep, document_ids=document_ids, positions=positions)


def layout_from_attention_mask(attention_mask: Any) -> Layout:
    """Layout of BSHD rows described by a Hugging Face ``attention_mask``.

    Args:
        attention_mask: int or bool ``[batch, sequence]``; ``1`` / ``True`` marks
            a real token. Padding may sit on the left, the right or both sides,
            but the real tokens of a row must be contiguous.

    Each row is one document: real tokens get document id ``0`` and positions
    ``0, 1, ...`` from the row's first real token; padding gets document id
    ``-1`` and position ``0``. Rows that are all padding are allowed.

    Raises:
        ValueError: for a non-2-D mask, values other than 0/1, or a row whose
            real tokens are not contiguous (naming row and column).
    """
    mask = torch.as_tensor(attention_mask)
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D [batch, sequence], got shape {tuple(mask.shape)}")
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(
            f"attention_mask must be int or bool, got dtype {mask.dtype}; use 1 for real tokens and 0 for padding"
        )
    if mask.dtype != torch.bool:
        bad = ~((mask == 0) | (mask == 1))
        if bool(bad.any()):
            b, s = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"attention_mask[{b}, {s}] = {int(mask[b, s])}; attention_mask may only hold "
                f"0 (padding) and 1 (real token)"
            )
    real = mask.to(torch.bool)

    batch, sequence = real.shape
    device = real.device
    keep = real.clone()
    document_ids = torch.full((batch, sequence), -1, dtype=torch.int64, device=device)
    positions = torch.zeros(batch, sequence, dtype=torch.int64, device=device)

    for b in range(batch):
        columns = [s for s in range(sequence) if bool(real[b, s])]
        if not columns:
            continue  # a row that is all padding
        first, last = columns[0], columns[-1]
        for s in range(first, last + 1):
            if not bool(real[b, s]):
                raise ValueError(
                    f"attention_mask row {b} has padding at column {s} between real tokens "
                    f"(columns {first}..{last}); real tokens of a row must be contiguous -- "
                    f"pack documents with seq_lens instead"
                )
        document_ids[b, first : last + 1] = 0
        positions[b, first : last + 1] = torch.arange(last + 1 - first, dtype=torch.int64, device=device)
    return Layout(keep=keep, document_ids=document_ids, positions=positions)


def _batch_shape(batch: Mapping) -> tuple[int, int, torch.device]:
    """``(batch, sequence, device)`` of the primary token tensor of ``batch``."""
    for key in ("input_ids", "inputs_embeds"):
        value = batch.get(key)
        if value is not None:
            if value.dim() < 2:
                raise ValueError(f"{key} must be at least 2-D [batch, sequence, ...], got shape {tuple(value.shape)}")
            return int(value.shape[0]), int(value.shape[1]), value.device
    raise ValueError("batch has neither input_ids nor inputs_embeds; one of them is needed to know the sequence length")


def layout_from_batch(batch: Mapping) -> Layout:
    """Layout of a model batch.

    * ``seq_lens`` present (not ``None``): THD pack, with ``seq_lens_padded``
      (required) and the sequence length taken from ``input_ids`` (or
      ``inputs_embeds``) dim 1;
    * else ``attention_mask`` present: BSHD rows;
    * else every slot is real, one document per row.

    Token values are never read.
    """
    batch_size, sequence, device = _batch_shape(batch)
    if batch.get("seq_lens") is not None:
        if batch.get("seq_lens_padded") is None:
            raise ValueError(
                "batch has seq_lens but no seq_lens_padded; pass seq_lens_padded (equal to "
                "seq_lens when documents carry no per-document padding)"
            )
        layout = layout_from_lengths(batch["seq_lens"], batch["seq_lens_padded"], sequence)
        if layout.keep.shape[0] != batch_size:
            raise ValueError(
                f"seq_lens has {layout.keep.shape[0]} rows but the batch has {batch_size}; "
                f"give one row of lengths per batch row"
            )
        return layout
    if batch.get("attention_mask") is not None:
        mask = torch.as_tensor(batch["attention_mask"])
        if tuple(mask.shape) != (batch_size, sequence):
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)} but the batch is "
                f"[{batch_size}, {sequence}]; give one mask entry per token"
            )
        return layout_from_attention_mask(mask)
    keep = torch.ones(batch_size, sequence, dtype=torch.bool, device=device)
    document_ids = torch.zeros(batch_size, sequence, dtype=torch.int64, device=device)
    positions = torch.arange(sequence, dtype=torch.int64, device=device).expand(batch_size, sequence).clone()
    return Layout(keep=keep, document_ids=document_ids, positions=positions)
