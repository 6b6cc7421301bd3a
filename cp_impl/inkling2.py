"""Contiguous Inkling2 context shards, differentiable KV and convolution halos.

Multi-rank implementation of ``nemo_automodel.components.models.inkling2.context_parallel``.

Terms: ``N`` CP ranks, this rank ``r``; the global sequence ``S`` is
right-padded to ``S_pad = ceil(S / N) * N`` and rank ``r`` owns global
positions ``[r*L, (r+1)*L)``, ``L = S_pad / N``.  ``mesh=None`` or a mesh of
size 1 means one rank: no collective runs.  Every multi-rank function starts
with one small all-gather of a shape/dtype descriptor, so that ranks passing
different shapes, dtypes or arguments all raise the same ``ValueError``
instead of some of them waiting forever in a collective.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch.distributed.device_mesh import DeviceMesh

from . import _layout, _strategy, _transport
from ._mesh import resolve_mesh
from .sharder import ContextParallelSharder

__all__ = [
    "CPBatch",
    "convolution_history",
    "gather_sequence",
    "prepare_cp_inputs",
    "unpack_row_layout",
    "validate_document_positions",
]

CPBatch: TypeAlias = dict[str, torch.Tensor | list[torch.Tensor] | str | None]


def _check_history_args(masked: object, width: object) -> None:
    if not isinstance(masked, torch.Tensor):
        raise TypeError(f"convolution_history: masked: expected a torch.Tensor, got {type(masked).__name__}")
    if masked.dim() != 3 or masked.shape[1] < 1:
        raise ValueError(
            f"convolution_history: masked: expected this rank's shard [batch, local_sequence >= 1, channels], "
            f"got shape {list(masked.shape)}"
        )
    if not isinstance(width, int) or isinstance(width, bool):
        raise TypeError(
            f"convolution_history: width: expected an int >= 1 (convolution taps), got {type(width).__name__}"
        )
    if width < 1:
        raise ValueError(f"convolution_history: width: expected an int >= 1 (convolution taps), got {width}")


def convolution_history(masked: torch.Tensor, mesh: DeviceMesh | None, width: int) -> torch.Tensor:
    """Prepend causal history to masked [batch, local_sequence, channels].

    Args:
        masked: this rank's local shard ``[B, L, C]`` (``L >= 1``) with invalid
            positions already zeroed; same shape and dtype on every rank.
        mesh: one-dimensional CP mesh; ``None`` or a single rank pads with zeros only.
        width: convolution taps ``W >= 1`` (an ``int``); ``W - 1`` history rows are prepended.

    Returns:
        A new local ``[B, L + W - 1, C]`` tensor: the ``W - 1`` global rows just
        before this shard (zeros before global position 0, so rank 0 and
        ``mesh=None`` get zeros), then ``masked``.  When ``W - 1 > L`` the
        history spans several earlier ranks; the rows come point-to-point from
        exactly the ranks that own them.  Differentiable: the gradient of every
        history row is sent back to its owner and added to its shard's gradient.

    Raises:
        TypeError: ``masked`` is not a tensor or ``width`` is not an int.
        ValueError: ``masked`` is not ``[B, L>=1, C]``, ``width < 1``, the mesh
            is not one-dimensional, or ranks pass different shapes, dtypes or
            widths (raised on every rank).
    """
    cp = resolve_mesh(mesh)
    if not cp.single:
        needs_grad = torch.is_grad_enabled() and isinstance(masked, torch.Tensor) and masked.requires_grad
        _transport.agree(
            cp,
            "convolution_history",
            {"masked": masked},
            flags={"requires_grad": needs_grad},
            extra=("width", width),
            hint="Pass equal-length shards of one padded global batch and the same width on every rank.",
        )
    _check_history_args(masked, width)
    if cp.single:
        batch, _, channels = masked.shape
        return torch.cat([masked.new_zeros(batch, width - 1, channels), masked], dim=1)
    return _transport.halo_history(masked, cp, width - 1)


def gather_sequence(value: torch.Tensor, mesh: DeviceMesh | None, differentiable: bool) -> torch.Tensor:
    """Gather equal-length [batch, local_sequence, ...] tensors in CP rank order.

    Args:
        value: this rank's local shard ``[B, L, ...]``; every rank supplies the
            same shape and dtype.
        mesh: one-dimensional CP mesh; ``None`` or a single rank returns ``value`` itself.
        differentiable: ``True`` routes gradients back to each shard's source
            rank: the backward gives every rank the sum, over all ranks, of the
            gradient slices of its own shard (one reduce-scatter).  ``False``
            returns a result without autograd history.

    Returns:
        Global ``[B, N*L, ...]`` with the shards concatenated in rank order,
        newly allocated (one all-gather).

    Raises:
        TypeError: ``value`` is not a tensor or ``differentiable`` is not a bool.
        ValueError: ``value`` has fewer than 2 dimensions, the mesh is not
            one-dimensional, or ranks pass different shapes/dtypes (or differ in
            whether the gather is differentiable), raised on every rank.
    """
    return _transport.gather_public(value, mesh, differentiable, api="gather_sequence", dim=1)


def validate_document_positions(keep: torch.Tensor, positions: torch.Tensor) -> None:
    """Require unit increments inside documents and zero at a new document.

    A contiguous CP shard may begin partway through a document. Later resets
    explicitly identify new documents; a gap cannot silently resume an old one.

    Args:
        keep: boolean validity ``[B, S]`` (``True`` = real token); global or local.
        positions: integer logical positions ``[B, S]``.  The first real span
            of a row may start at any offset ``>= 0``, including after left padding.

    Raises:
        ValueError: naming row and column, when a kept position is negative, a
            kept token directly after a kept token is neither ``prev + 1`` nor
            ``0``, or a kept token after a gap of padding is not ``0``; also when
            the shapes differ or are not 2-D.
        TypeError: ``keep`` is not bool or ``positions`` is not an integer tensor.
    """
    _layout.validate_document_positions(keep, positions)


def unpack_row_layout(batch: CPBatch) -> None:
    """Normalize shared THD packs to document positions and validity, in place.

    Reads ``input_ids [B, S]``, ``seq_lens`` and ``seq_lens_padded
    [B, documents]`` (real and padded document lengths, right-filled with
    ``-1000``), optional ``position_ids`` and ``labels [B, S]``.  Writes bool
    ``padding_mask`` (``True`` = padding, decided from the lengths, never from
    token ids) and int64 ``position_ids [B, S]``: ``0, 1, 2, ...`` over each
    document's padded span, and ``0, 1, 2, ...`` again over the slots after the
    row's last document.  Removes ``seq_lens``, ``seq_lens_padded`` and a
    ``qkv_format`` marker.  ``input_ids`` and ``labels`` are unchanged.

    Raises:
        ValueError: no ``seq_lens``/``seq_lens_padded``; malformed metadata
            (negative lengths other than the ``-1000`` filler, filler in
            different slots of the two, a real length after the filler,
            real > padded, padded lengths summing to more than ``S``, shapes
            that disagree); given ``position_ids`` that disagree with the
            layout on a real token (naming row and column).
        TypeError: a field is not a tensor or has the wrong dtype.

    On any error the batch is left exactly as it was.
    """
    api = "unpack_row_layout"
    _strategy.check_batch(batch, api)
    missing = [k for k in _layout.PACKED_KEYS if batch.get(k) is None]
    if missing:
        raise ValueError(
            f"{api}: {missing[0]}: missing; a THD pack needs seq_lens and seq_lens_padded [batch, documents]"
        )
    derived = _layout.derive_layout(batch, _layout.primary_key(batch, api, allow_embeds=False), api)
    _strategy.write_layout(batch, derived, document_ids=False)


def prepare_cp_inputs(batch: CPBatch, num_chunks: int = 1) -> dict[str, ContextParallelSharder]:
    """Return a sharder for packed or unpacked global [batch, sequence] text/image inputs.

    IDs, image masks and images remain global for per-microbatch image splicing
    inside forward.  Labels, positions and padding become local.  The shared
    recipes own target alignment and loss normalization; no weights are touched.

    Args:
        batch: global batch, normalised in place: ``input_ids [B, S]``,
            optional ``labels [B, S]`` (already aligned: label ``t`` is the
            target of position ``t``), ``image_mask [B, S]`` bool,
            ``pixel_values`` (list of ``[C, H, W]`` or ``[images, C, H, W]``),
            and either ``seq_lens``/``seq_lens_padded`` (packed rows; see
            :func:`unpack_row_layout`), or ``attention_mask [B, S]`` (1 = real,
            left/right/two-sided padding, real tokens contiguous), or neither
            (every token real).  Optional ``position_ids`` are validated
            (:func:`validate_document_positions`, or agreement with the pack).
            Afterwards the batch holds bool ``padding_mask`` and int64
            ``position_ids [B, S]`` (``attention_mask`` is left in place).
        num_chunks: positive number of pipeline micro-batches; divides ``B``.

    Returns:
        ``{"cp_sharder": sharder}``, unresolved.  Resolved with the CP mesh
        (``ContextParallelSharder(device_mesh=mesh, shard_batch=sharder.shard_batch,
        local_token_global_indices=sharder.local_token_global_indices, ...)``),
        ``ctx_factory, local = resolved.shard(batch)``, ``local``
        is a new dict: ``labels`` (``-100`` in divisibility padding),
        ``position_ids`` (counting on past the end) and ``padding_mask``
        (``True`` in divisibility padding) are local ``[B, L]``;
        ``input_ids``, ``image_mask``, ``pixel_values`` and every other key are
        the same global objects; ``attention_mask`` is dropped.

    Raises:
        ValueError / TypeError naming the field for a malformed batch or
        ``num_chunks``; the batch is then left exactly as it was.
    """
    api = "inkling2.prepare_cp_inputs"
    _strategy.check_batch(batch, api)
    return _strategy.prepare(
        batch,
        api=api,
        sharder_api="inkling2 shard_batch",
        num_chunks=num_chunks,
        allow_embeds=False,
        single_image=False,
        shard_primary=False,
        packed=False,
    )
