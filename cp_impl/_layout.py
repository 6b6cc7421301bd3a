"""Row layout of a global batch: validation, padding and positions.

Private helpers shared by :mod:`cp_impl.inkling2` and
:mod:`cp_impl.mistral_large4`.  Everything here is a pure function of global
tensors (identical on every rank), so errors are raised identically on every
rank and before any collective; nothing here mutates a batch.

Layout conventions (``B`` rows, ``S`` global sequence):

- ``keep [B,S] bool``: real tokens; decided from ``seq_lens``/``seq_lens_padded``
  or ``attention_mask``, never from token ids.
- ``positions [B,S] int64``: position inside the document, 0 at its first
  token.  Padding slots: inside a packed document's padded span the count goes
  on (``real, real+1, ...``); the tail after a row's last document counts
  ``0, 1, 2, ...`` from the start of the tail; in an ``attention_mask`` row,
  padding before the first real token is 0 and padding after the last real
  token keeps counting.
- ``document_ids [B,S] int64``: document index inside its row; per-document
  padding carries its document's index; ``-1`` after the last document (and
  at the padding of an ``attention_mask`` row).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FILLER",
    "IGNORE_INDEX",
    "RowLayout",
    "is_integer_dtype",
    "first_true",
    "primary_key",
    "batch_dims",
    "check_token_tensor",
    "check_num_chunks",
    "check_images",
    "packed_layout",
    "mask_layout",
    "dense_layout",
    "validate_document_positions",
    "derive_layout",
]

FILLER = -1000
IGNORE_INDEX = -100
PACKED_KEYS = ("seq_lens", "seq_lens_padded")


@dataclass(frozen=True)
class RowLayout:
    """Global ``keep``, ``positions`` and ``document_ids``, each ``[B, S]``."""

    keep: torch.Tensor
    positions: torch.Tensor
    document_ids: torch.Tensor


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """True for integer dtypes (bool excluded)."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def first_true(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first ``True`` of ``mask`` in row-major order (``mask.any()`` assumed)."""
    return tuple(int(i) for i in mask.nonzero()[0])


def primary_key(batch: Mapping[str, Any], api: str, *, allow_embeds: bool) -> str:
    """Name of the token tensor that fixes ``[B, S]``: ``input_ids`` or ``inputs_embeds``."""
    has_ids = batch.get("input_ids") is not None
    has_embeds = allow_embeds and batch.get("inputs_embeds") is not None
    if has_ids and has_embeds:
        raise ValueError(f"{api}: pass either input_ids or inputs_embeds, not both")
    if has_ids:
        return "input_ids"
    if has_embeds:
        return "inputs_embeds"
    wanted = (
        "input_ids [batch, sequence] (or inputs_embeds [batch, sequence, hidden])"
        if allow_embeds
        else "input_ids [batch, sequence]"
    )
    raise ValueError(f"{api}: input_ids: the batch has no token tensor; pass {wanted}")


def batch_dims(batch: Mapping[str, Any], key: str, api: str) -> tuple[int, int]:
    """``(B, S)`` of the primary token tensor ``batch[key]``, validated."""
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{api}: {key}: expected a torch.Tensor, got {type(value).__name__}")
    if key == "input_ids":
        if value.dim() != 2 or not is_integer_dtype(value.dtype):
            raise ValueError(
                f"{api}: input_ids: expected an integer tensor [batch, sequence], got "
                f"{value.dtype} of shape {tuple(value.shape)}"
            )
    elif value.dim() < 3 or not value.dtype.is_floating_point:
        raise ValueError(
            f"{api}: {key}: expected a floating tensor [batch, sequence, hidden], got "
            f"{value.dtype} of shape {tuple(value.shape)}"
        )
    b, s = int(value.shape[0]), int(value.shape[1])
    if b < 1 or s < 1:
        raise ValueError(f"{api}: {key}: batch and sequence must be non-empty, got shape {tuple(value.shape)}")
    return b, s


def check_token_tensor(batch: Mapping[str, Any], key: str, b: int, s: int, kind: str, api: str) -> torch.Tensor | None:
    """Validate optional ``batch[key]`` as ``[B, S]`` of ``kind`` (``int``, ``bool``, ``mask``).

    ``mask`` accepts bool or integer.  Returns the tensor, or ``None`` if absent.
    """
    value = batch.get(key)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{api}: {key}: expected a torch.Tensor [batch, sequence], got {type(value).__name__}")
    if tuple(value.shape) != (b, s):
        raise ValueError(f"{api}: {key}: expected shape [batch, sequence] = {[b, s]}, got {list(value.shape)}")
    ok = {
        "int": is_integer_dtype(value.dtype),
        "bool": value.dtype == torch.bool,
        "mask": value.dtype == torch.bool or is_integer_dtype(value.dtype),
    }[kind]
    if not ok:
        wanted = {
            "int": "an integer dtype (e.g. torch.int64)",
            "bool": "torch.bool",
            "mask": "torch.bool or an integer dtype with 0/1 values",
        }[kind]
        raise TypeError(f"{api}: {key}: expected {wanted}, got {value.dtype}")
    return value


def check_num_chunks(num_chunks: Any, batch_size: int, api: str, *, exact: bool = False) -> int:
    """``num_chunks`` must be a positive int dividing (``exact``: equal to) the batch size."""
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool):
        raise TypeError(f"{api}: num_chunks: expected a positive int, got {type(num_chunks).__name__}")
    if num_chunks < 1:
        raise ValueError(
            f"{api}: num_chunks: expected a positive int, got {num_chunks}; pass 1 without pipeline parallelism"
        )
    if exact and batch_size != num_chunks:
        raise ValueError(
            f"{api}: num_chunks={num_chunks} but the batch size is {batch_size}: a packed batch holds exactly "
            f"one row per pipeline micro-batch, so pass num_chunks={batch_size} or pack {num_chunks} rows"
        )
    if batch_size % num_chunks:
        raise ValueError(
            f"{api}: num_chunks={num_chunks} does not divide the batch size {batch_size}; pass a divisor of {batch_size}"
        )
    return num_chunks


def check_images(batch: Mapping[str, Any], b: int, s: int, api: str, *, single_image: bool) -> None:
    """Validate the optional global ``image_mask [B,S] bool`` and ``pixel_values``."""
    check_token_tensor(batch, "image_mask", b, s, "bool", api)
    pixels = batch.get("pixel_values")
    if pixels is None:
        return
    if single_image:
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 3:
            raise ValueError(f"{api}: pixel_values: expected one complete image tensor [channels, height, width]")
        return
    if isinstance(pixels, torch.Tensor):
        if pixels.dim() != 4:
            raise ValueError(
                f"{api}: pixel_values: expected [images, channels, height, width] or a list of [channels, height, width]"
            )
    elif not isinstance(pixels, (list, tuple)) or not all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in pixels):
        raise ValueError(
            f"{api}: pixel_values: expected a list of [channels, height, width] tensors or one [images, channels, height, width] tensor"
        )


# ------------------------------------------------------------- layouts


def packed_layout(seq_lens: Any, seq_lens_padded: Any, b: int, s: int, device: torch.device, api: str) -> RowLayout:
    """Layout of THD rows from ``seq_lens``/``seq_lens_padded [B, documents]``.

    Raises ``TypeError``/``ValueError`` for: non-integer or non-2-D lengths,
    shapes that disagree (with each other or with the batch), negative lengths
    other than the ``-1000`` filler, the filler in different slots of the two,
    a real length after the filler, ``real > padded``, and padded lengths
    summing to more than ``S``.
    """
    for key, value in (("seq_lens", seq_lens), ("seq_lens_padded", seq_lens_padded)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{api}: {key}: expected an integer tensor [batch, documents], got {type(value).__name__}")
        if not is_integer_dtype(value.dtype):
            raise TypeError(f"{api}: {key}: expected an integer dtype, got {value.dtype}")
        if value.dim() != 2 or value.shape[0] != b:
            raise ValueError(f"{api}: {key}: expected shape [batch={b}, documents], got {list(value.shape)}")
    if seq_lens.shape != seq_lens_padded.shape:
        raise ValueError(
            f"{api}: seq_lens {list(seq_lens.shape)} and seq_lens_padded {list(seq_lens_padded.shape)} "
            f"must have the same shape [batch, documents]"
        )
    real = seq_lens.to(device=device, dtype=torch.int64)
    padded = seq_lens_padded.to(device=device, dtype=torch.int64)
    fill_r, fill_p = real == FILLER, padded == FILLER
    for key, value, fill in (("seq_lens", real, fill_r), ("seq_lens_padded", padded, fill_p)):
        bad = (value < 0) & ~fill
        if bad.any():
            i, d = first_true(bad)
            raise ValueError(
                f"{api}: {key}[{i}, {d}] = {int(value[i, d])}: lengths must be >= 0, with {FILLER} only as the "
                f"filler after a row's last document"
            )
    if (fill_r != fill_p).any():
        i, d = first_true(fill_r != fill_p)
        raise ValueError(
            f"{api}: seq_lens[{i}, {d}] = {int(real[i, d])} but seq_lens_padded[{i}, {d}] = {int(padded[i, d])}: "
            f"the {FILLER} filler must fill the same slots of both"
        )
    if real.shape[1] > 1:
        resumed = fill_p[:, :-1] & ~fill_p[:, 1:]
        if resumed.any():
            i, d = first_true(resumed)
            raise ValueError(
                f"{api}: seq_lens_padded[{i}, {d + 1}] = {int(padded[i, d + 1])} follows the {FILLER} filler: "
                f"the filler may only right-fill a row after its last document"
            )
    over = (real > padded) & ~fill_r
    if over.any():
        i, d = first_true(over)
        raise ValueError(
            f"{api}: seq_lens[{i}, {d}] = {int(real[i, d])} exceeds seq_lens_padded[{i}, {d}] = {int(padded[i, d])}; "
            f"the padded length includes the real tokens"
        )
    real = real.masked_fill(fill_r, 0)
    padded = padded.masked_fill(fill_p, 0)
    # One length past S already overflows the row; checking it first also keeps the int64 sum
    # below from wrapping around (lengths near 2**62 would otherwise sum to a negative total).
    too_long = padded > s
    if too_long.any():
        i, d = first_true(too_long)
        raise ValueError(
            f"{api}: seq_lens_padded[{i}, {d}] = {int(padded[i, d])} exceeds the sequence length {s}; "
            f"the documents of a row must fit in input_ids"
        )
    ends = padded.cumsum(1)
    total = ends[:, -1] if ends.shape[1] else torch.zeros(b, dtype=torch.int64, device=device)
    if (total > s).any():
        (i,) = first_true(total > s)
        raise ValueError(
            f"{api}: seq_lens_padded row {i} sums to {int(total[i])} > sequence length {s}; "
            f"the documents of a row must fit in input_ids"
        )
    slot = torch.arange(s, device=device).expand(b, s)
    if ends.shape[1] == 0:
        zeros = torch.zeros(b, s, dtype=torch.bool, device=device)
        return RowLayout(zeros, slot.clone(), torch.full((b, s), -1, dtype=torch.int64, device=device))
    doc = torch.searchsorted(ends.contiguous(), slot.contiguous(), right=True)
    in_doc = slot < total[:, None]
    doc_c = doc.clamp(max=ends.shape[1] - 1)
    start = (ends - padded).gather(1, doc_c)
    offset = slot - start
    keep = in_doc & (offset < real.gather(1, doc_c))
    positions = torch.where(in_doc, offset, slot - total[:, None])
    document_ids = torch.where(in_doc, doc, torch.full_like(doc, -1))
    return RowLayout(keep, positions, document_ids)


def mask_layout(attention_mask: torch.Tensor, api: str, name: str = "attention_mask") -> RowLayout:
    """Layout of BSHD rows from ``attention_mask [B, S]`` (1 = real; ``name`` for messages).

    Real tokens must be contiguous inside a row (left, right or two-sided
    padding); rows of only padding are allowed.  Raises ``ValueError`` naming
    row and column for values other than 0/1 and for real tokens that resume
    after padding.
    """
    mask = attention_mask
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bad.any():
            i, j = first_true(bad)
            raise ValueError(f"{api}: {name}[{i}, {j}] = {mask[i, j].item()}: expected 0 (padding) or 1 (real token)")
        mask = mask == 1
    b, s = mask.shape
    starts = mask.clone()
    starts[:, 1:] &= ~mask[:, :-1]
    second = starts & (starts.long().cumsum(1) > 1)
    if second.any():
        i, j = first_true(second)
        raise ValueError(
            f"{api}: {name} row {i}: real tokens resume at column {j} after padding; the real tokens of a "
            f"{name} row must be contiguous. Pack several documents per row with seq_lens/seq_lens_padded "
            f"(THD) instead"
        )
    has_real = mask.any(1)
    first = torch.where(has_real, mask.long().argmax(1), torch.zeros_like(has_real, dtype=torch.int64))
    slot = torch.arange(s, device=mask.device).expand(b, s)
    positions = (slot - first[:, None]).clamp(min=0)
    document_ids = torch.where(mask, torch.zeros_like(positions), torch.full_like(positions, -1))
    return RowLayout(mask, positions, document_ids)


def dense_layout(b: int, s: int, device: torch.device) -> RowLayout:
    """Every token real, one document per row."""
    slot = torch.arange(s, device=device).expand(b, s).clone()
    return RowLayout(
        torch.ones(b, s, dtype=torch.bool, device=device),
        slot,
        torch.zeros(b, s, dtype=torch.int64, device=device),
    )


# ----------------------------------------------------------- positions


def validate_document_positions(
    keep: torch.Tensor, positions: torch.Tensor, api: str = "validate_document_positions"
) -> None:
    """Check document positions of kept tokens row by row (see the public docstring)."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        raise TypeError(
            f"{api}: keep: expected a bool tensor [batch, sequence], got {getattr(keep, 'dtype', type(keep).__name__)}"
        )
    if not isinstance(positions, torch.Tensor) or not is_integer_dtype(positions.dtype):
        raise TypeError(
            f"{api}: positions: expected an integer tensor [batch, sequence], got "
            f"{getattr(positions, 'dtype', type(positions).__name__)}"
        )
    if keep.dim() != 2 or keep.shape != positions.shape:
        raise ValueError(
            f"{api}: keep {list(keep.shape)} and positions {list(positions.shape)} must both be [batch, sequence]"
        )
    if keep.device != positions.device:
        positions = positions.to(keep.device)
    pos = positions.to(torch.int64)
    prev_keep = torch.zeros_like(keep)
    prev_keep[:, 1:] = keep[:, :-1]
    prev_pos = torch.zeros_like(pos)
    prev_pos[:, 1:] = pos[:, :-1]
    seen = (keep.long().cumsum(1) - keep.long()) > 0
    negative = keep & (pos < 0)
    jump = keep & prev_keep & (pos != prev_pos + 1) & (pos != 0)
    resumed = keep & ~prev_keep & seen & (pos != 0)
    bad = negative | jump | resumed
    if not bad.any():
        return
    i, j = first_true(bad)
    value = int(pos[i, j])
    if negative[i, j]:
        why = "kept positions must be >= 0"
    elif jump[i, j]:
        why = (
            f"it follows a kept token at position {int(pos[i, j - 1])}, so it must be {int(pos[i, j - 1]) + 1} "
            f"(same document) or 0 (new document)"
        )
    else:
        why = "it is the first kept token after padding, so it must be 0 (a gap cannot resume a document)"
    raise ValueError(f"{api}: positions row {i}, column {j} = {value}: {why}")


@dataclass(frozen=True)
class DerivedLayout:
    """What ``derive_layout`` found: ``kind`` in ``packed``/``mask``/``dense``."""

    kind: str
    layout: RowLayout
    position_ids: torch.Tensor  # int64 [B, S] to write into the batch


def derive_layout(batch: Mapping[str, Any], primary: str, api: str) -> DerivedLayout:
    """Validate the global batch and derive its layout; the batch is not touched.

    Packed rows (``seq_lens``/``seq_lens_padded``): ``position_ids`` given in
    the batch must agree with the layout on every real token; the derived
    positions are written (deterministic values at padding).  An
    ``attention_mask`` beside them must equal the derived ``keep``.
    ``attention_mask`` rows, rows described by an existing ``padding_mask``
    (a batch normalised before; kind ``prepared``) or rows without metadata:
    given ``position_ids`` are validated with
    :func:`validate_document_positions` and used as they are; otherwise
    positions are derived (an existing ``padding_mask`` then needs contiguous
    real tokens, like an ``attention_mask``).
    """
    b, s = batch_dims(batch, primary, api)
    device = batch[primary].device
    check_token_tensor(batch, "labels", b, s, "int", api)
    given = check_token_tensor(batch, "position_ids", b, s, "int", api)
    mask = check_token_tensor(batch, "attention_mask", b, s, "mask", api)
    present = [k for k in PACKED_KEYS if batch.get(k) is not None]
    if present:
        if len(present) == 1:
            missing = [k for k in PACKED_KEYS if k not in present][0]
            raise ValueError(
                f"{api}: {present[0]} is given without {missing}; a packed batch needs both [batch, documents]"
            )
        layout = packed_layout(batch["seq_lens"], batch["seq_lens_padded"], b, s, device, api)
        if mask is not None:
            differs = mask.to(layout.keep.device).bool() != layout.keep
            if differs.any():
                i, j = first_true(differs)
                raise ValueError(
                    f"{api}: attention_mask[{i}, {j}] disagrees with seq_lens/seq_lens_padded; drop attention_mask "
                    f"from a packed batch or make it equal to the real-token layout"
                )
        if given is not None:
            differs = layout.keep & (given.to(device=device, dtype=torch.int64) != layout.positions)
            if differs.any():
                i, j = first_true(differs)
                raise ValueError(
                    f"{api}: position_ids[{i}, {j}] = {int(given[i, j])} but the packed layout puts that real token at "
                    f"document position {int(layout.positions[i, j])}; drop position_ids or fix seq_lens"
                )
        return DerivedLayout("packed", layout, layout.positions)
    padding = check_token_tensor(batch, "padding_mask", b, s, "bool", api)
    if mask is not None:
        layout, kind = mask_layout(mask.to(device), api), "mask"
    elif padding is not None and given is not None:
        # Already normalised (e.g. prepared before): positions make documents explicit.
        keep = ~padding.to(device)
        layout, kind = RowLayout(keep, given, torch.where(keep, 0, -1)), "prepared"
    elif padding is not None:
        layout, kind = mask_layout(~padding.to(device), api, "padding_mask"), "prepared"
    else:
        layout, kind = dense_layout(b, s, device), "dense"
    if given is None:
        return DerivedLayout(kind, layout, layout.positions)
    given = given.to(device=device, dtype=torch.int64)
    validate_document_positions(layout.keep, given, api=f"{api}: position_ids")
    return DerivedLayout(kind, layout, given)
