"""Contiguous CP batch preparation and differentiable key transport for Large 4.

Multi-rank implementation of ``nemo_automodel.components.models.mistral_large4.context_parallel``.

Terms: ``N`` CP ranks, this rank ``r``; the global sequence ``S`` is
right-padded to ``S_pad = ceil(S / N) * N`` and rank ``r`` owns global
positions ``[r*L, (r+1)*L)``, ``L = S_pad / N``.  ``mesh=None`` or a mesh of
size 1 means one rank: no collective runs.  Every multi-rank function starts
with one small all-gather of a shape/dtype descriptor, so that ranks passing
different shapes or dtypes all raise the same ``ValueError`` instead of some
of them waiting forever in a collective.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from . import _layout, _strategy, _transport
from ._mesh import resolve_mesh
from .sharder import ContextParallelSharder

__all__ = ["CPBatch", "gather_tokens", "prepare_cp_inputs", "prepare_packed_cp_inputs", "shifted_cp_loss"]

CPBatch: TypeAlias = dict[str, torch.Tensor | list[torch.Tensor] | str | None]


def gather_tokens(value: torch.Tensor, mesh: DeviceMesh | None, differentiable: bool) -> torch.Tensor:
    """Gather [local_tokens, ...] tensors to [CP * local_tokens, ...] in rank order.

    Local token counts must agree.  Differentiable transport sums remote-query
    contributions back to each key owner; parameter averaging remains FSDP-owned.

    Args:
        value: this rank's local ``[T, ...]``; same shape and dtype on every rank.
        mesh: one-dimensional CP mesh; ``None`` or a single rank returns ``value`` itself.
        differentiable: ``True``: the backward gives every rank the sum over all
            ranks of the gradient rows of its own tokens (one reduce-scatter);
            ``False``: the result carries no autograd history.

    Returns:
        Global ``[N*T, ...]`` in rank order, newly allocated (one all-gather).

    Raises:
        TypeError: ``value`` is not a tensor or ``differentiable`` not a bool.
        ValueError: ``value`` is 0-D, the mesh is not one-dimensional, or ranks
            pass different shapes/dtypes (raised on every rank).
    """
    return _transport.gather_public(value, mesh, differentiable, api="gather_tokens", dim=0)


def _check_shard_primary(shard_primary: Any, api: str) -> None:
    if not isinstance(shard_primary, bool):
        raise TypeError(f"{api}: shard_primary: expected True or False, got {type(shard_primary).__name__}")


def _is_normalised_pack(batch: CPBatch) -> bool:
    """A THD batch that ``prepare_packed_cp_inputs`` already normalised in place."""
    return all(batch.get(k) is not None for k in ("padding_mask", "position_ids", "document_ids"))


def prepare_cp_inputs(
    batch: CPBatch, num_chunks: int = 1, shard_primary: bool = True
) -> dict[str, ContextParallelSharder]:
    """Prepare contiguous CP shards with positions computed before partitioning.

    Args:
        batch: global BSHD batch, normalised in place: ``input_ids [B, S]`` or
            ``inputs_embeds [B, S, D]``, optional unshifted ``labels [B, S]``,
            optional ``attention_mask [B, S]`` (1 = real; left, right or
            two-sided padding; real tokens contiguous), optional
            ``position_ids [B, S]`` (validated), optional complete image
            ``pixel_values [C, H, W]`` and ``image_mask [B, S]`` bool (both stay
            global).  Afterwards the batch also holds bool ``padding_mask`` and
            int64 ``position_ids``.  A batch carrying
            ``seq_lens``/``seq_lens_padded`` is THD and goes to
            :func:`prepare_packed_cp_inputs`.
        num_chunks: positive number of pipeline micro-batches along ``B``; divides ``B``.
        shard_primary: ``True`` shards ``input_ids``/``inputs_embeds`` here;
            ``False`` keeps them global for image splicing and per-microbatch
            sharding in forward (``sharder.shard_token_tensor``).

    Returns:
        ``{"cp_sharder": sharder}``, unresolved.  Resolved with the CP mesh
        (``ContextParallelSharder(device_mesh=mesh, shard_batch=sharder.shard_batch,
        local_token_global_indices=sharder.local_token_global_indices, ...)``),
        ``ctx_factory, local = resolved.shard(batch)``: ``labels``
        (``-100`` in divisibility padding), ``position_ids`` (counting on),
        ``padding_mask`` (``True`` in divisibility padding) and, with
        ``shard_primary``, ``input_ids`` (``padding_token_id``) or
        ``inputs_embeds`` (zeros) are local ``[B, L, ...]``; ``pixel_values``,
        ``image_mask`` and other keys are the same global objects;
        ``attention_mask`` is dropped.

    Raises:
        ValueError / TypeError naming the field for a malformed batch,
        ``num_chunks`` or ``shard_primary``; the batch is then left as it was.
    """
    if isinstance(batch, dict) and (
        any(batch.get(k) is not None for k in _layout.PACKED_KEYS) or _is_normalised_pack(batch)
    ):
        return prepare_packed_cp_inputs(batch, num_chunks, shard_primary)
    api = "mistral_large4.prepare_cp_inputs"
    _strategy.check_batch(batch, api)
    _check_shard_primary(shard_primary, api)
    return _strategy.prepare(
        batch,
        api=api,
        sharder_api="mistral_large4 shard_batch",
        num_chunks=num_chunks,
        allow_embeds=True,
        single_image=True,
        shard_primary=shard_primary,
        packed=False,
    )


def prepare_packed_cp_inputs(batch: CPBatch, num_chunks: int, shard_primary: bool) -> dict[str, ContextParallelSharder]:
    """Preserve packed documents while preparing contiguous model-owned CP.

    Args:
        batch: global THD batch, normalised in place: ``input_ids [chunks, S]``
            (or ``inputs_embeds``), optional unshifted ``labels`` and
            ``position_ids`` (must agree with the pack on real tokens),
            ``seq_lens``/``seq_lens_padded [chunks, documents]`` (``-1000``
            filler), optional complete image ``pixel_values [C, H, W]`` and
            ``image_mask``.  Exactly one packed row belongs to each micro-batch.
            Afterwards the batch holds bool ``padding_mask``, int64
            ``position_ids`` (0 at each document start, counting on through its
            padding; 0, 1, ... again after the last document) and int64
            ``document_ids`` (document index in its row, per-document padding
            carries its index, ``-1`` after the last document); ``seq_lens``,
            ``seq_lens_padded`` and ``qkv_format`` are removed.  A batch this
            function already normalised (``padding_mask``, ``position_ids``,
            ``document_ids``, no lengths) is accepted again as it is.
        num_chunks: positive number of pipeline micro-batches; must equal the batch size.
        shard_primary: ``True`` shards the text IDs here; ``False`` keeps them global.

    Returns:
        ``{"cp_sharder": sharder}``, unresolved; its local batch holds local
        ``[B, L]`` ``labels`` (with ``-100`` at the first token of every
        document, so the shifted loss never predicts one document from another,
        and in divisibility padding; the caller's labels tensor is not
        modified), ``position_ids``, ``padding_mask``, ``document_ids`` (``-1``
        in divisibility padding) and, with ``shard_primary``, ``input_ids``.

    Raises:
        ValueError: ``batch size != num_chunks`` (naming both), malformed
            metadata as for ``inkling2.unpack_row_layout``; TypeError for wrong
            types.  The batch is then left as it was.
    """
    api = "mistral_large4.prepare_packed_cp_inputs"
    _strategy.check_batch(batch, api)
    _check_shard_primary(shard_primary, api)
    missing = [k for k in _layout.PACKED_KEYS if batch.get(k) is None]
    if missing and not _is_normalised_pack(batch):
        raise ValueError(
            f"{api}: {missing[0]}: missing; a packed batch needs seq_lens and seq_lens_padded [chunks, documents]"
        )

    def reused_document_ids(b: int, s: int) -> None:
        if missing:  # normalised before: its document_ids are reused
            _layout.check_token_tensor(batch, "document_ids", b, s, "int", api)

    return _strategy.prepare(
        batch,
        api=api,
        sharder_api="mistral_large4 packed shard_batch",
        num_chunks=num_chunks,
        allow_embeds=True,
        single_image=True,
        shard_primary=shard_primary,
        packed=True,
        check_more=reused_document_ids,
    )


# ----------------------------------------------------------------- loss

_LABEL_RANGE_ERROR = 1
_LOSS_ERRORS = {_LABEL_RANGE_ERROR: "labels at valid positions must be -100 or lie in [0, vocab)"}


def _check_loss_args(logits: Any, labels: Any, valid: Any) -> None:
    api = "shifted_cp_loss"
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise TypeError(f"{api}: logits: expected a floating tensor [batch, local_sequence, vocab]")
    if not isinstance(labels, torch.Tensor) or not _layout.is_integer_dtype(labels.dtype):
        raise TypeError(f"{api}: labels: expected an integer tensor [batch, local_sequence]")
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
        raise TypeError(
            f"{api}: valid: expected a bool tensor [batch * local_sequence]; pass (~padding_mask).reshape(-1)"
        )
    if logits.dim() != 3 or logits.shape[2] < 1:
        raise ValueError(f"{api}: logits: expected [batch, local_sequence, vocab >= 1], got {list(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"{api}: labels: expected shape {list(logits.shape[:2])} (logits' [batch, local_sequence]), got {list(labels.shape)}"
        )
    if tuple(valid.shape) != (labels.numel(),):
        raise ValueError(
            f"{api}: valid: expected the flattened keep mask [{labels.numel()}], got {list(valid.shape)}; "
            f"pass (~padding_mask).reshape(-1)"
        )


def shifted_cp_loss(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, mesh: DeviceMesh | None
) -> torch.Tensor:
    """Compute HF shifted CE across shard boundaries, scaled for FSDP CP averaging.

    Args:
        logits: local (soft-capped) logits ``[B, L, V]``; upcast to at least
            float32 (float64 stays float64).
        labels: local unshifted integer labels ``[B, L]``; ``-100`` is ignored.
        valid: local flattened keep mask ``[B*L]`` bool (``(~padding_mask).reshape(-1)``).
        mesh: CP mesh; peers hold shards of the same padded global batch.
            ``None`` or a single rank runs no collective.

    Global position ``t`` of a row counts when ``valid[t]``, ``valid[t+1]`` and
    ``labels[t+1] != -100``; the label and valid flag for a shard's last
    position come from rank ``r+1`` (one ``[B]`` int64 message); the global last
    position has no target.

    Returns:
        Scalar ``local_sum * N / global_count`` (count summed over the mesh by
        one all-reduce), so that averaging gradients over the CP ranks yields
        the gradient of the global mean loss.  A rank with no local target
        returns a zero connected to ``logits``; with no target anywhere the
        result is a finite zero with zero gradients.

    Raises:
        TypeError / ValueError naming the argument for wrong dtypes or shapes,
        and ``ValueError`` for labels outside ``[0, V)`` (other than ``-100``)
        at valid positions; with a mesh, raised on every rank.
    """
    api = "shifted_cp_loss"
    cp = resolve_mesh(mesh)
    local_error = None
    try:
        _check_loss_args(logits, labels, valid)
    except (TypeError, ValueError):
        structure_ok = False
    else:
        structure_ok = True
    if structure_ok:
        keep = valid.view(labels.shape)
        vocab = logits.shape[2]
        out_of_range = keep & (labels != _layout.IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if out_of_range.any():
            i, j = _layout.first_true(out_of_range)
            local_error = (
                _LABEL_RANGE_ERROR,
                f"{api}: labels[{i}, {j}] = {int(labels[i, j])} at a valid position: expected -100 or a class in [0, {vocab})",
            )
    if not cp.single:
        _transport.agree(
            cp,
            api,
            {"logits": logits, "labels": labels, "valid": valid},
            local_error=local_error,
            error_texts=_LOSS_ERRORS,
            hint="Pass shards of the same padded global batch on every rank.",
        )
    _check_loss_args(logits, labels, valid)
    if local_error:
        raise ValueError(local_error[1])

    batch, local, vocab = logits.shape
    compute = torch.promote_types(logits.dtype, torch.float32)
    targets = labels.to(torch.int64).masked_fill(~keep, _layout.IGNORE_INDEX)  # -100 where not counted as a target
    if cp.single:
        after_last = torch.full((batch,), _layout.IGNORE_INDEX, dtype=torch.int64, device=labels.device)
    else:
        after_last = _transport.receive_from_next(targets[:, 0].contiguous(), cp, _layout.IGNORE_INDEX)
    shifted = torch.cat([targets[:, 1:], after_last[:, None]], dim=1)  # target of local position t
    counted = (keep & (shifted != _layout.IGNORE_INDEX)).view(-1)
    rows = counted.nonzero().squeeze(1)
    picked = logits.reshape(batch * local, vocab).index_select(0, rows).to(compute)
    local_sum = F.cross_entropy(picked, shifted.view(-1).index_select(0, rows), reduction="sum")
    count = counted.sum().view(1)
    if not cp.single:
        count = _transport.all_reduce_sum(count, cp)
    return local_sum * cp.size / count.clamp(min=1).to(compute)[0]
