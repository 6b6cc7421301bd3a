"""Layout and sharding checks: the hooks' sharded batches against the oracle's layout.

``inkling2_layout``: ``inkling2.prepare_cp_inputs`` (packed rows go through
``unpack_row_layout``), then ``bind(mesh).shard(batch)``. Local ``labels``,
``position_ids``, ``padding_mask`` must be the contiguous shards of the
globally computed layout; ``input_ids``, ``image_mask`` and ``pixel_values``
stay global and unchanged.

``mistral_large4_layout``: ``mistral_large4.prepare_cp_inputs`` (packed rows
dispatch to ``prepare_packed_cp_inputs``; with ``direct_packed`` the packed
hook is called directly) with ``shard_primary`` both ways;
local ``document_ids`` for packed rows and the label of every packed
document's first token masked.

Everything here is data movement: compared bit for bit. Positions are
compared on real tokens only (padding slots carry an unspecified value);
divisibility padding must be padding with label ``-100``.
"""

from __future__ import annotations

import numpy as np
import torch

from cp_harness.cases import IGNORE_INDEX, batches_equal, build_batch, clone_batch, padded_length
from cp_harness.checks import CaseReport, register, stack_ranks
from cp_harness.compare import TokenGrid, compare
from oracle.layout import layout_from_batch


def pad_sequence(value: torch.Tensor, length: int, fill) -> torch.Tensor:
    out = torch.full((value.shape[0], length) + tuple(value.shape[2:]), fill, dtype=value.dtype)
    out[:, :value.shape[1]] = value
    return out


_CONTENT_KEYS = ("input_ids", "labels", "image_mask", "pixel_values")


def _content_changes(batch: dict, snapshot: dict) -> list[str]:
    """Which of the caller's token ids, labels and images the hooks changed (they may only add layout keys)."""
    changed = []
    for key in _CONTENT_KEYS:
        if key in snapshot and batches_equal({key: batch.get(key)}, {key: snapshot[key]}) is not None:
            changed.append(key)
    return changed


def _inkling2_rank(case: dict, ctx) -> tuple[dict, dict]:
    batch = build_batch(case)
    original = {k: v for k, v in batch.items()}
    snapshot = clone_batch(batch)
    sharder = ctx.impl.inkling2.prepare_cp_inputs(batch, num_chunks=int(case.get("num_chunks", 1)))["cp_sharder"]
    after_prepare = sorted(batch)
    _, local = sharder.bind(ctx.mesh_for(case)).shard(batch)
    info = {
        "keys_after_prepare": after_prepare,
        "local_keys": sorted(local),
        "input_ids_global_and_unchanged": local.get("input_ids") is not None
        and tuple(local["input_ids"].shape) == tuple(snapshot["input_ids"].shape)
        and bool(torch.equal(local["input_ids"], snapshot["input_ids"])),
        "labels_unchanged_in_batch": "labels" not in _content_changes(batch, snapshot),
        "image_mask_global": "image_mask" not in original or (
            local.get("image_mask") is not None and bool(torch.equal(local["image_mask"], snapshot["image_mask"]))),
        "pixel_values_global": "pixel_values" not in original or local.get("pixel_values") is original["pixel_values"],
        "caller_content_changed": _content_changes(batch, snapshot),
    }
    return info, {"labels": local["labels"], "position_ids": local["position_ids"], "padding_mask": local["padding_mask"]}


def expected_layout(case: dict):
    batch = build_batch(case)
    layout = layout_from_batch(batch)
    n = int(case["world_size"])
    S = batch["input_ids"].shape[1]
    S_pad = padded_length(S, n)
    keep = pad_sequence(layout.keep, S_pad, False)
    return batch, layout, keep, S, S_pad


def _common(report: CaseReport, case: dict, outputs: list, keep: torch.Tensor, layout, labels_expected, S_pad: int):
    n = int(case["world_size"])
    L = S_pad // n
    grid = TokenGrid(L, n)
    report.add(compare("padding_mask", stack_ranks(outputs, "padding_mask"), (~keep).numpy(), mode="exact", grid=grid))
    positions = pad_sequence(layout.positions, S_pad, 0)
    got_labels = stack_ranks(outputs, "labels")
    if bool(keep.any()):  # rows of padding alone have no real token to compare
        report.add(compare("position_ids (real tokens)", stack_ranks(outputs, "position_ids"), positions.numpy(),
                           mode="exact", mask=keep.numpy(), grid=grid))
        report.add(compare("labels (real tokens)", got_labels, labels_expected.numpy(), mode="exact", mask=keep.numpy(), grid=grid))
    S = layout.keep.shape[1]
    if S_pad > S and S > 0:
        # Divisibility padding: positions keep counting from the row's last slot (SPEC).
        got_positions = stack_ranks(outputs, "position_ids")
        counting = got_positions[:, S - 1:S] + np.arange(1, S_pad - S + 1)[None, :]
        report.add(compare("position_ids (divisibility padding keeps counting)", got_positions[:, S:], counting,
                           mode="exact"))
    if S_pad > S:
        report.add(compare("labels (divisibility padding)", got_labels[:, S:], np.full((keep.shape[0], S_pad - S), IGNORE_INDEX),
                           mode="exact"))


def _inkling2_evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    batch, layout, keep, S, S_pad = expected_layout(case)
    for o in outputs:
        report.require(o.info["input_ids_global_and_unchanged"], f"rank {o.rank}: input_ids must stay global and unchanged")
        report.require(o.info["labels_unchanged_in_batch"], f"rank {o.rank}: the caller's labels changed")
        report.require(o.info["image_mask_global"], f"rank {o.rank}: image_mask must stay global and unchanged")
        report.require(o.info["pixel_values_global"], f"rank {o.rank}: pixel_values must stay global (the same object)")
        report.require(not o.info.get("caller_content_changed"),
                       f"rank {o.rank}: the hooks changed the caller's {o.info.get('caller_content_changed')} in place")
        if "seq_lens" in batch:
            for gone in ("seq_lens", "seq_lens_padded", "qkv_format"):
                report.require(gone not in o.info["keys_after_prepare"], f"rank {o.rank}: {gone} must be removed by unpack_row_layout")
    _common(report, case, outputs, keep, layout, pad_sequence(batch["labels"], S_pad, IGNORE_INDEX), S_pad)
    return report


def _mistral_rank(case: dict, ctx) -> tuple[dict, dict]:
    batch = build_batch(case)
    snapshot = clone_batch(batch)
    shard_primary = bool(case.get("shard_primary", True))
    ml = ctx.impl.mistral_large4
    chunks = int(case.get("num_chunks", 1))
    if case.get("direct_packed"):
        sharder = ml.prepare_packed_cp_inputs(batch, chunks, shard_primary)["cp_sharder"]
    else:
        sharder = ml.prepare_cp_inputs(batch, num_chunks=chunks, shard_primary=shard_primary)["cp_sharder"]
    _, local = sharder.bind(ctx.mesh_for(case)).shard(batch)
    tensors = {"labels": local["labels"], "position_ids": local["position_ids"], "padding_mask": local["padding_mask"],
               "input_ids": local["input_ids"]}
    if "document_ids" in local:
        tensors["document_ids"] = local["document_ids"]
    info = {"labels_unchanged_in_batch": "labels" not in _content_changes(batch, snapshot),
            "caller_content_changed": _content_changes(batch, snapshot), "local_keys": sorted(local)}
    return info, tensors


def _mistral_evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    batch, layout, keep, S, S_pad = expected_layout(case)
    n = int(case["world_size"])
    grid = TokenGrid(S_pad // n, n)
    packed = "seq_lens" in batch
    labels = batch["labels"].clone()
    if packed:
        # The label of each document's first token must be masked: it would be predicted from the previous document.
        first = torch.zeros_like(layout.keep)
        first[:, 0] = True
        first[:, 1:] = layout.document_ids[:, 1:] != layout.document_ids[:, :-1]
        labels = torch.where(first & (layout.document_ids >= 0), IGNORE_INDEX, labels)
        docs = pad_sequence(layout.document_ids, S_pad, -1)
        for o in outputs:
            report.require("document_ids" in o.tensors, f"rank {o.rank}: a packed batch must yield local document_ids")
        if all("document_ids" in o.tensors for o in outputs):
            report.add(compare("document_ids", stack_ranks(outputs, "document_ids"), docs.numpy(), mode="exact", grid=grid))
    for o in outputs:
        report.require(o.info["labels_unchanged_in_batch"], f"rank {o.rank}: the caller's labels changed")
        report.require(not o.info.get("caller_content_changed"),
                       f"rank {o.rank}: the hooks changed the caller's {o.info.get('caller_content_changed')} in place")
    _common(report, case, outputs, keep, layout, pad_sequence(labels, S_pad, IGNORE_INDEX), S_pad)
    if bool(case.get("shard_primary", True)):
        report.add(compare("input_ids (sharded)", stack_ranks(outputs, "input_ids")[:, :S], batch["input_ids"].numpy(),
                           mode="exact", grid=grid))
    else:
        for o in outputs:
            report.add(compare(f"input_ids (global)@rank{o.rank}", o.tensors["input_ids"], batch["input_ids"].numpy(), mode="exact"))
    return report


register("inkling2_layout", rank=_inkling2_rank, evaluate=_inkling2_evaluate,
         functions=("inkling2.prepare_cp_inputs", "inkling2.unpack_row_layout", "sharder.shard"))
register("mistral_large4_layout", rank=_mistral_rank, evaluate=_mistral_evaluate,
         functions=("mistral_large4.prepare_cp_inputs", "mistral_large4.prepare_packed_cp_inputs", "sharder.shard"))
