"""Shared body of the ``prepare_cp_inputs`` hooks and their ``shard_batch`` strategies.

Private to :mod:`cp_impl`.  The two model modules differ only in which keys
they shard (inkling2 keeps ``input_ids`` global; mistral_large4 shards them
when ``shard_primary``) and in the packed path of mistral_large4 (which adds
``document_ids`` and masks the label of each document's first token).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from ._layout import (
    IGNORE_INDEX,
    PACKED_KEYS,
    DerivedLayout,
    batch_dims,
    check_images,
    check_num_chunks,
    check_token_tensor,
    derive_layout,
    primary_key,
)
from ._mesh import resolve_mesh
from .sharder import LAYOUTS, ContextParallelSharder, TokenKey, TokenLayout, shard_batch_tokens, unresolved

__all__ = ["check_batch", "write_layout", "make_sharder", "mask_first_document_labels", "prepare", "relayout"]

_LAYOUT_MARKER = "qkv_format"


def check_batch(batch: Any, api: str) -> None:
    """The batch must be a mutable mapping (``dict``) of named tensors."""
    if not isinstance(batch, MutableMapping):
        raise TypeError(f"{api}: batch: expected a dict of named tensors, got {type(batch).__name__}")


def write_layout(batch: MutableMapping[str, Any], derived: DerivedLayout, *, document_ids: bool) -> None:
    """Mutate ``batch`` in place (the last step of a hook, after all validation).

    Writes ``padding_mask`` (bool, True = padding) and int64 ``position_ids``;
    for packed rows removes ``seq_lens``, ``seq_lens_padded`` and the
    ``qkv_format`` marker, and writes ``document_ids`` when asked.
    """
    batch["padding_mask"] = ~derived.layout.keep
    batch["position_ids"] = derived.position_ids
    if derived.kind == "packed":
        for key in (*PACKED_KEYS, _LAYOUT_MARKER):
            batch.pop(key, None)
        if document_ids:
            batch["document_ids"] = derived.layout.document_ids


def mask_first_document_labels(labels: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """New labels with ``-100`` at the first slot of every document (``labels`` untouched)."""
    doc = document_ids.to(labels.device)
    starts = doc >= 0
    starts[:, 1:] &= doc[:, 1:] != doc[:, :-1]
    return labels.masked_fill(starts, IGNORE_INDEX)


def _shard_prepared(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: Mapping[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    api: str,
    num_chunks: int,
    allow_embeds: bool,
    shard_primary: bool,
    packed: bool,
    layout: TokenLayout,
) -> tuple[Any, dict[str, Any], Any]:
    """``shard_batch`` strategy over a batch prepared by the matching hook, cut by ``layout``."""
    del tp_mesh  # the models shard nothing over TP here
    resolve_mesh(cp_mesh, "cp_mesh")  # a mesh that is not the 1-D CP mesh: an error before anything is read
    if not isinstance(batch, Mapping):
        raise TypeError(f"{api}: batch: expected a dict of named tensors, got {type(batch).__name__}")
    primary = primary_key(batch, api, allow_embeds=allow_embeds)
    b, s = batch_dims(batch, primary, api)
    stale = [k for k in PACKED_KEYS if batch.get(k) is not None]
    required = ["padding_mask", "position_ids"] + (["document_ids"] if packed else [])
    missing = [k for k in required if batch.get(k) is None]
    if stale or missing:
        raise ValueError(
            f"{api}: the batch is not prepared (missing {missing}, still holding {stale}); pass the batch that "
            f"prepare_cp_inputs(batch) normalised in place"
        )
    check_token_tensor(batch, "padding_mask", b, s, "bool", api)
    check_token_tensor(batch, "position_ids", b, s, "int", api)
    labels = check_token_tensor(batch, "labels", b, s, "int", api)
    check_num_chunks(num_chunks, b, api, exact=packed)
    plan = {
        "labels": TokenKey(IGNORE_INDEX),
        "position_ids": TokenKey(continue_count=True),
        "padding_mask": TokenKey(True),
    }
    replace: dict[str, torch.Tensor] = {}
    if shard_primary:
        plan[primary] = TokenKey(padding_token_id if primary == "input_ids" else 0)
    if packed:
        document_ids = check_token_tensor(batch, "document_ids", b, s, "int", api)
        assert document_ids is not None  # required when packed: missing raised above
        plan["document_ids"] = TokenKey(-1)
        if labels is not None:
            replace["labels"] = mask_first_document_labels(labels, document_ids)
    if loss_mask is not None:
        if not isinstance(loss_mask, torch.Tensor) or tuple(loss_mask.shape) != (b, s):
            raise ValueError(f"{api}: loss_mask: expected a tensor [batch, sequence] = {[b, s]}")
        plan["loss_mask"] = TokenKey(False if loss_mask.dtype == torch.bool else 0)
        replace["loss_mask"] = loss_mask
    return shard_batch_tokens(cp_mesh, batch, plan, layout=layout, seq_len=s, drop=("attention_mask",), replace=replace)


def make_sharder(
    *,
    api: str,
    num_chunks: int,
    allow_embeds: bool,
    shard_primary: bool,
    packed: bool,
    layout: TokenLayout = LAYOUTS["contiguous"],
) -> ContextParallelSharder:
    """An unresolved sharder whose strategy shards batches prepared by ``api`` with ``layout``."""
    strategy = functools.partial(
        _shard_prepared,
        api=api,
        num_chunks=num_chunks,
        allow_embeds=allow_embeds,
        shard_primary=shard_primary,
        packed=packed,
        layout=layout,
    )
    return unresolved(strategy, layout)


def relayout(sharder: ContextParallelSharder, layout: TokenLayout) -> ContextParallelSharder:
    """The same strategy as ``sharder`` (one that :func:`make_sharder` built), cutting with ``layout`` instead."""
    return unresolved(functools.partial(sharder.shard_batch, layout=layout), layout)


def prepare(
    batch: MutableMapping[str, Any],
    *,
    api: str,
    sharder_api: str,
    num_chunks: Any,
    allow_embeds: bool,
    single_image: bool,
    shard_primary: bool,
    packed: bool,
    check_more: Callable[[int, int], None] | None = None,
) -> dict[str, ContextParallelSharder]:
    """The body every ``prepare_*`` hook shares: validate all of the batch, then normalise its layout in place.

    ``batch [B, S]`` is checked (primary token tensor, ``num_chunks`` dividing
    ``B`` or, for ``packed``, equal to it, ``check_more(B, S)``, images) before
    anything is written, so an error leaves it exactly as it was. Returns
    ``{"cp_sharder": sharder}``, unresolved (the framework resolves it with its mesh).
    """
    primary = primary_key(batch, api, allow_embeds=allow_embeds)
    b, s = batch_dims(batch, primary, api)
    check_num_chunks(num_chunks, b, api, exact=packed)
    if check_more is not None:
        check_more(b, s)
    check_images(batch, b, s, api, single_image=single_image)
    write_layout(batch, derive_layout(batch, primary, api), document_ids=packed)
    sharder = make_sharder(
        api=sharder_api, num_chunks=num_chunks, allow_embeds=allow_embeds, shard_primary=shard_primary, packed=packed
    )
    return {"cp_sharder": sharder}
