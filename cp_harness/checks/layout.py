"""Layout and sharding checks: the hooks' sharded batches against the oracle's layout.

``inkling2_layout``: ``inkling2.prepare_cp_inputs`` (packed rows go through
``unpack_row_layout``), then the sharder resolved the framework's way
(``cp_harness.usage.resolve_sharder``) shards the batch. Local ``labels``,
``position_ids``, ``padding_mask`` must be the shards of the globally
computed layout *at the global positions the sharder reports*
(``local_token_global_indices``), whatever its padding rule or index map;
``input_ids``, ``image_mask`` and ``pixel_values`` stay global and unchanged.

``mistral_large4_layout``: ``mistral_large4.prepare_cp_inputs`` (packed rows
dispatch to ``prepare_packed_cp_inputs``; with ``direct_packed`` the packed
hook is called directly) with ``shard_primary`` both ways;
local ``document_ids`` for packed rows and the label of every packed
document's first token masked.

The layout itself is judged first (``checks.judge_token_layout``): every
global token owned by exactly one rank, the index map agreeing with the
local tensors. Everything here is data movement: compared bit for bit.
Positions are compared on real tokens only (padding slots carry an
unspecified value); divisibility padding (global positions ``>= S``) must be
padding in every key: ``padding_mask`` true, label ``-100``, positions
counting on from the row's last slot.
"""

from __future__ import annotations

import numpy as np
import torch

from cp_harness.cases.descriptions import IGNORE_INDEX, batches_equal, build_batch, clone_batch
from cp_harness.checks import CaseReport, ReportedLayout, judge_token_layout, register
from cp_harness.judging.compare import compare
from cp_harness.usage.resolve_sharder import hook_sharder, layout_report
from oracle.layout import layout_from_batch


def pad_sequence(value: torch.Tensor, length: int, fill) -> torch.Tensor:
    out = torch.full((value.shape[0], length) + tuple(value.shape[2:]), fill, dtype=value.dtype)
    out[:, :value.shape[1]] = value
    return out


_CONTENT_KEYS = ("input_ids", "labels", "image_mask", "pixel_values")


def _caller_changes(hooked: list[str], original: dict, snapshot: dict) -> list[str]:
    """What the hook changed in the caller's batch (``hooked``), plus tensors of the caller modified in place
    (by the hook or by ``shard``: a framework sharder may replace the batch's entries, never their data)."""
    return hooked + [f"{key} (in place)" for key in _content_changes(original, snapshot) if key not in hooked]


def _content_changes(batch: dict, snapshot: dict) -> list[str]:
    """Which of the caller's token ids, labels and images the hooks changed (they may only add layout keys)."""
    changed = []
    for key in _CONTENT_KEYS:
        if key in snapshot and batches_equal({key: batch.get(key)}, {key: snapshot[key]}) is not None:
            changed.append(key)
    return changed


def _unpack_directly(case: dict, ctx) -> tuple[dict, dict]:
    """``inkling2.unpack_row_layout`` called on its own on a packed batch: its global ``padding_mask`` and
    ``position_ids [B, S]`` and what it did to the batch (the hook may normalise packs with internal code that
    never reaches the documented function, so the row that claims it calls it)."""
    batch = build_batch(case)
    snapshot = clone_batch(batch)
    ctx.impl.inkling2.unpack_row_layout(batch)
    info = {"unpack_keys": sorted(batch), "unpack_changed": _content_changes(batch, snapshot)}
    return info, {"unpacked.padding_mask": batch.get("padding_mask"), "unpacked.position_ids": batch.get("position_ids")}


def _inkling2_rank(case: dict, ctx) -> tuple[dict, dict]:
    unpacked_info, unpacked = _unpack_directly(case, ctx) if case["batch"]["format"] == "thd" else ({}, {})
    batch = build_batch(case)
    original = dict(batch)
    snapshot = clone_batch(batch)
    mesh = ctx.mesh_for(case)
    sharder = hook_sharder(ctx.impl.inkling2.prepare_cp_inputs(batch, num_chunks=int(case.get("num_chunks", 1))), mesh)
    after_prepare = sorted(batch)
    hooked = _content_changes(batch, snapshot)
    _, local = sharder.shard(batch)
    info, layout_tensors = layout_report(sharder, mesh, local["labels"].shape[1], snapshot["input_ids"].shape[1], ctx.device)
    info.update({
        "keys_after_prepare": after_prepare,
        "local_keys": sorted(local),
        "input_ids_global_and_unchanged": local.get("input_ids") is not None
        and tuple(local["input_ids"].shape) == tuple(snapshot["input_ids"].shape)
        and bool(torch.equal(local["input_ids"], snapshot["input_ids"])),
        "image_mask_global": "image_mask" not in original or (
            local.get("image_mask") is not None and bool(torch.equal(local["image_mask"], snapshot["image_mask"]))),
        "pixel_values_global": "pixel_values" not in original or local.get("pixel_values") is original["pixel_values"],
        "caller_content_changed": _caller_changes(hooked, original, snapshot),
    })
    info.update(unpacked_info)
    return info, {"labels": local["labels"], "position_ids": local["position_ids"], "padding_mask": local["padding_mask"],
                  **layout_tensors, **{k: v for k, v in unpacked.items() if v is not None}}


def expected_layout(case: dict):
    """``(global batch, oracle layout)`` of a case."""
    batch = build_batch(case)
    return batch, layout_from_batch(batch)


def _common(report: CaseReport, outputs: list, layout, labels_expected: torch.Tensor) -> ReportedLayout | None:
    """Judge the reported layout, then labels, positions and padding at the positions it names."""
    S = layout.keep.shape[1]
    reported = judge_token_layout(report, outputs, S, local_name="labels")
    if reported is None:
        return None
    S_pad, grid = reported.padded_len, reported.grid
    keep = pad_sequence(layout.keep, S_pad, False)
    report.add(compare("padding_mask", reported.scatter(outputs, "padding_mask"), (~keep).numpy(), mode="exact", grid=grid))
    positions = pad_sequence(layout.positions, S_pad, 0)
    got_labels = reported.scatter(outputs, "labels")
    got_positions = reported.scatter(outputs, "position_ids")
    if bool(keep.any()):  # rows of padding alone have no real token to compare
        report.add(compare("position_ids (real tokens)", got_positions, positions.numpy(),
                           mode="exact", mask=keep.numpy(), grid=grid))
        report.add(compare("labels (real tokens)", got_labels, pad_sequence(labels_expected, S_pad, IGNORE_INDEX).numpy(),
                           mode="exact", mask=keep.numpy(), grid=grid))
    if S_pad > S and S > 0:
        # Divisibility padding: positions keep counting from the row's last slot (SPEC).
        counting = got_positions[:, S - 1:S] + np.arange(1, S_pad - S + 1)[None, :]
        report.add(compare("position_ids (divisibility padding keeps counting)", got_positions[:, S:], counting,
                           mode="exact"))
    if S_pad > S:
        report.add(compare("labels (divisibility padding)", got_labels[:, S:], np.full((keep.shape[0], S_pad - S), IGNORE_INDEX),
                           mode="exact"))
    return reported


def _inkling2_evaluate(case: dict, outputs: list, expected) -> CaseReport:
    report = CaseReport(case=case)
    batch, layout = expected  # expected_layout(case), computed while the ranks ran
    for o in outputs:
        report.require(o.info["input_ids_global_and_unchanged"], f"rank {o.rank}: input_ids must stay global and unchanged")
        report.require(o.info["image_mask_global"], f"rank {o.rank}: image_mask must stay global and unchanged")
        report.require(o.info["pixel_values_global"], f"rank {o.rank}: pixel_values must stay global (the same object)")
        report.require(not o.info.get("caller_content_changed"),
                       f"rank {o.rank}: the caller's batch changed (hooks may only add layout keys): {o.info.get('caller_content_changed')}")
        if "seq_lens" in batch:
            for gone in ("seq_lens", "seq_lens_padded", "qkv_format"):
                report.require(gone not in o.info["keys_after_prepare"], f"rank {o.rank}: {gone} must be removed by unpack_row_layout")
    if "seq_lens" in batch:
        _judge_unpacked(report, outputs, layout)
    _common(report, outputs, layout, batch["labels"])
    return report


def _judge_unpacked(report: CaseReport, outputs: list, layout) -> None:
    """What ``unpack_row_layout`` wrote, called on its own: padding from the lengths (an EOS equal to the pad
    id stays real), positions on real tokens, the lengths removed, ids and labels untouched."""
    keep = layout.keep.numpy()
    for o in outputs:
        missing = [k for k in ("unpacked.padding_mask", "unpacked.position_ids") if k not in o.tensors]
        report.require(not missing, f"rank {o.rank}: unpack_row_layout wrote no {', '.join(k.split('.')[1] for k in missing)}")
        if missing:
            continue
        report.add(compare(f"unpack_row_layout padding_mask@rank{o.rank}", o.tensors["unpacked.padding_mask"], ~keep,
                           mode="exact"))
        if keep.any():
            report.add(compare(f"unpack_row_layout position_ids (real tokens)@rank{o.rank}", o.tensors["unpacked.position_ids"],
                               layout.positions.numpy(), mode="exact", mask=keep))
        left = [k for k in ("seq_lens", "seq_lens_padded", "qkv_format") if k in o.info.get("unpack_keys", [])]
        report.require(not left, f"rank {o.rank}: unpack_row_layout left {left} in the batch")
        report.require(not o.info.get("unpack_changed"),
                       f"rank {o.rank}: unpack_row_layout changed the caller's {o.info.get('unpack_changed')}")


def _mistral_rank(case: dict, ctx) -> tuple[dict, dict]:
    batch = build_batch(case)
    original = dict(batch)
    snapshot = clone_batch(batch)
    shard_primary = bool(case.get("shard_primary", True))
    ml = ctx.impl.mistral_large4
    chunks = int(case.get("num_chunks", 1))
    mesh = ctx.mesh_for(case)
    if case.get("direct_packed"):
        returned = ml.prepare_packed_cp_inputs(batch, chunks, shard_primary)
    else:
        returned = ml.prepare_cp_inputs(batch, num_chunks=chunks, shard_primary=shard_primary)
    sharder = hook_sharder(returned, mesh)
    hooked = _content_changes(batch, snapshot)
    _, local = sharder.shard(batch)
    info, layout_tensors = layout_report(sharder, mesh, local["labels"].shape[1], snapshot["input_ids"].shape[1], ctx.device)
    tensors = {"labels": local["labels"], "position_ids": local["position_ids"], "padding_mask": local["padding_mask"],
               "input_ids": local["input_ids"], **layout_tensors}
    if "document_ids" in local:
        tensors["document_ids"] = local["document_ids"]
    info.update({"caller_content_changed": _caller_changes(hooked, original, snapshot), "local_keys": sorted(local)})
    return info, tensors


def _mistral_evaluate(case: dict, outputs: list, expected) -> CaseReport:
    report = CaseReport(case=case)
    batch, layout = expected  # expected_layout(case), computed while the ranks ran
    packed = "seq_lens" in batch
    labels = batch["labels"].clone()
    if packed:
        # The label of each document's first token must be masked: it would be predicted from the previous document.
        first = torch.zeros_like(layout.keep)
        first[:, 0] = True
        first[:, 1:] = layout.document_ids[:, 1:] != layout.document_ids[:, :-1]
        labels = torch.where(first & (layout.document_ids >= 0), IGNORE_INDEX, labels)
        for o in outputs:
            report.require("document_ids" in o.tensors, f"rank {o.rank}: a packed batch must yield local document_ids")
    for o in outputs:
        report.require(not o.info.get("caller_content_changed"),
                       f"rank {o.rank}: the caller's batch changed (hooks may only add layout keys): {o.info.get('caller_content_changed')}")
    reported = _common(report, outputs, layout, labels)
    if reported is None:
        return report
    S, S_pad, grid = reported.seq_len, reported.padded_len, reported.grid
    if packed and all("document_ids" in o.tensors for o in outputs):
        docs = pad_sequence(layout.document_ids, S_pad, -1)
        report.add(compare("document_ids", reported.scatter(outputs, "document_ids"), docs.numpy(), mode="exact", grid=grid))
    if bool(case.get("shard_primary", True)):
        report.add(compare("input_ids (sharded)", reported.scatter(outputs, "input_ids")[:, :S], batch["input_ids"].numpy(),
                           mode="exact", grid=grid))
    else:
        for o in outputs:
            report.add(compare(f"input_ids (global)@rank{o.rank}", o.tensors["input_ids"], batch["input_ids"].numpy(), mode="exact"))
    return report


INKLING2_LAYOUT = register("inkling2_layout", rank=_inkling2_rank, evaluate=_inkling2_evaluate, expect=expected_layout,
         functions=("inkling2.prepare_cp_inputs", "inkling2.unpack_row_layout", "sharder.shard",
                    "sharder.local_token_global_indices", "sharder.shard_token_tensor"))
MISTRAL_LARGE4_LAYOUT = register("mistral_large4_layout", rank=_mistral_rank, evaluate=_mistral_evaluate, expect=expected_layout,
         functions=("mistral_large4.prepare_cp_inputs", "mistral_large4.prepare_packed_cp_inputs", "sharder.shard",
                    "sharder.local_token_global_indices", "sharder.shard_token_tensor"))
