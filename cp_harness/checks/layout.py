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
from hypothesis import strategies as st

from cp_harness.cases.descriptions import (
    IGNORE_INDEX,
    batches_equal,
    build_batch,
    clone_batch,
    fixed_num_chunks,
    layout_rows,
    padded_length,
)
from cp_harness.cases.strategies import (
    as_space,
    inkling2_images,
    layouts,
    mistral_image,
    packed_layout,
    seeds,
    with_extras,
    with_impl,
    world_sizes,
)
from cp_harness.checks import GoldenContents, Repro, VerifyRow, register
from cp_harness.checks._token_layout import ReportedLayout, judge_token_layout
from cp_harness.judging import comm_minimum
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport, ProblemKind
from cp_harness.repro import sharding
from cp_harness.usage.resolve_sharder import hook_sharder, layout_report, sharded
from oracle.layout import layout_from_batch


def pad_sequence(value: torch.Tensor, length: int, fill) -> torch.Tensor:
    out = torch.full((value.shape[0], length) + tuple(value.shape[2:]), fill, dtype=value.dtype)
    out[:, : value.shape[1]] = value
    return out


_CONTENT_KEYS = ("input_ids", "labels", "image_mask", "pixel_values")


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
    return info, {
        "unpacked.padding_mask": batch.get("padding_mask"),
        "unpacked.position_ids": batch.get("position_ids"),
    }


def _local_copies(local: dict, keys) -> dict:
    """Copies of the local tensors, taken inside the sharder's context (which may restore buffers on exit)."""
    return {key: local[key].clone() for key in keys if isinstance(local.get(key), torch.Tensor)}


def _inkling2_rank(case: dict, ctx) -> tuple[dict, dict]:
    unpacked_info, unpacked = _unpack_directly(case, ctx) if case["batch"]["format"] == "thd" else ({}, {})
    batch = build_batch(case)
    original = dict(batch)
    snapshot = clone_batch(batch)
    mesh = ctx.mesh_for(case)
    sharder = hook_sharder(ctx.impl.inkling2.prepare_cp_inputs(batch, num_chunks=int(case.get("num_chunks", 1))), mesh)
    after_prepare = sorted(batch)
    hooked = _content_changes(batch, snapshot)
    with sharded(sharder, batch, caller=original) as shard:
        local = shard.local
        info, layout_tensors = layout_report(
            sharder, mesh, local["labels"].shape[1], snapshot["input_ids"].shape[1], ctx.device
        )
        info.update(
            {
                "keys_after_prepare": after_prepare,
                "local_keys": sorted(local),
                "input_ids_global_and_unchanged": local.get("input_ids") is not None
                and tuple(local["input_ids"].shape) == tuple(snapshot["input_ids"].shape)
                and bool(torch.equal(local["input_ids"], snapshot["input_ids"])),
                "image_mask_global": "image_mask" not in original
                or (
                    local.get("image_mask") is not None
                    and bool(torch.equal(local["image_mask"], snapshot["image_mask"]))
                ),
                "pixel_values_global": "pixel_values" not in original
                or local.get("pixel_values") is original["pixel_values"],
                "caller_content_changed": hooked,
            }
        )
        tensors = _local_copies(local, ("labels", "position_ids", "padding_mask"))
    info["caller_changed_by_shard"] = shard.caller_changes
    info.update(unpacked_info)
    return info, {**tensors, **layout_tensors, **{k: v for k, v in unpacked.items() if v is not None}}


def first_document_tokens(layout) -> torch.Tensor:
    """``[B, S]`` bool: the first token of every document of a packed layout."""
    first = torch.zeros_like(layout.keep)
    first[:, 0] = True
    first[:, 1:] = layout.document_ids[:, 1:] != layout.document_ids[:, :-1]
    return first & (layout.document_ids >= 0)


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
    report.add(compare_exact("padding_mask", reported.scatter(outputs, "padding_mask"), (~keep).numpy(), grid=grid))
    positions = pad_sequence(layout.positions, S_pad, 0)
    got_labels = reported.scatter(outputs, "labels")
    got_positions = reported.scatter(outputs, "position_ids")
    if bool(keep.any()):  # rows of padding alone have no real token to compare
        report.add(
            compare_exact("position_ids (real tokens)", got_positions, positions.numpy(), mask=keep.numpy(), grid=grid)
        )
        report.add(
            compare_exact(
                "labels (real tokens)",
                got_labels,
                pad_sequence(labels_expected, S_pad, IGNORE_INDEX).numpy(),
                mask=keep.numpy(),
                grid=grid,
            )
        )
    if S_pad > S and S > 0:
        # Divisibility padding: positions keep counting from the row's last slot (SPEC).
        counting = got_positions[:, S - 1 : S] + np.arange(1, S_pad - S + 1)[None, :]
        report.add(
            compare_exact(
                "position_ids (divisibility padding keeps counting)",
                got_positions[:, S:],
                counting,
                grid=grid.sliced(S),
            )
        )
    if S_pad > S:
        report.add(
            compare_exact(
                "labels (divisibility padding)",
                got_labels[:, S:],
                np.full((keep.shape[0], S_pad - S), IGNORE_INDEX),
                grid=grid.sliced(S),
            )
        )
    return reported


def _inkling2_evaluate(case: dict, outputs: list, expected) -> CaseReport:
    report = CaseReport(case=case)
    batch, layout = expected  # expected_layout(case), computed while the ranks ran
    for o in outputs:
        report.require(
            o.info["input_ids_global_and_unchanged"], f"rank {o.rank}: input_ids must stay global and unchanged"
        )
        report.require(o.info["image_mask_global"], f"rank {o.rank}: image_mask must stay global and unchanged")
        report.require(o.info["pixel_values_global"], f"rank {o.rank}: pixel_values must stay global (the same object)")
        report.require(
            not o.info.get("caller_content_changed"),
            f"rank {o.rank}: the caller's batch changed (hooks may only add layout keys): {o.info.get('caller_content_changed')}",
        )
        for change in o.info.get("caller_changed_by_shard", []):
            report.problem(f"rank {o.rank}: {change}")
        if "seq_lens" in batch:
            for gone in ("seq_lens", "seq_lens_padded", "qkv_format"):
                report.require(
                    gone not in o.info["keys_after_prepare"],
                    f"rank {o.rank}: {gone} must be removed by unpack_row_layout",
                )
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
        report.require(
            not missing, f"rank {o.rank}: unpack_row_layout wrote no {', '.join(k.split('.')[1] for k in missing)}"
        )
        if missing:
            continue
        report.add(
            compare_exact(
                f"unpack_row_layout padding_mask@rank{o.rank}", o.tensors["unpacked.padding_mask"], ~keep, rank=o.rank
            )
        )
        if keep.any():
            report.add(
                compare_exact(
                    f"unpack_row_layout position_ids (real tokens)@rank{o.rank}",
                    o.tensors["unpacked.position_ids"],
                    layout.positions.numpy(),
                    mask=keep,
                    rank=o.rank,
                )
            )
        left = [k for k in ("seq_lens", "seq_lens_padded", "qkv_format") if k in o.info.get("unpack_keys", [])]
        report.require(not left, f"rank {o.rank}: unpack_row_layout left {left} in the batch")
        report.require(
            not o.info.get("unpack_changed"),
            f"rank {o.rank}: unpack_row_layout changed the caller's {o.info.get('unpack_changed')}",
        )


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
    with sharded(sharder, batch, caller=original) as shard:
        local = shard.local
        info, layout_tensors = layout_report(
            sharder, mesh, local["labels"].shape[1], snapshot["input_ids"].shape[1], ctx.device
        )
        tensors = {
            **_local_copies(local, ("labels", "position_ids", "padding_mask", "input_ids", "document_ids")),
            **layout_tensors,
        }
        info.update({"caller_content_changed": hooked, "local_keys": sorted(local)})
    info["caller_changed_by_shard"] = shard.caller_changes
    return info, tensors


def _mistral_evaluate(case: dict, outputs: list, expected) -> CaseReport:
    report = CaseReport(case=case)
    batch, layout = expected  # expected_layout(case), computed while the ranks ran
    packed = "seq_lens" in batch
    labels = batch["labels"].clone()
    if packed:
        # The label of each document's first token must be masked: it would be predicted from the previous document.
        labels = torch.where(first_document_tokens(layout), IGNORE_INDEX, labels)
        for o in outputs:
            report.require("document_ids" in o.tensors, f"rank {o.rank}: a packed batch must yield local document_ids")
    for o in outputs:
        report.require(
            not o.info.get("caller_content_changed"),
            f"rank {o.rank}: the caller's batch changed (hooks may only add layout keys): {o.info.get('caller_content_changed')}",
        )
        for change in o.info.get("caller_changed_by_shard", []):
            report.problem(f"rank {o.rank}: {change}")
    reported = _common(report, outputs, layout, labels)
    if reported is None:
        return report
    S, S_pad, grid = reported.seq_len, reported.padded_len, reported.grid
    if packed and all("document_ids" in o.tensors for o in outputs):
        docs = pad_sequence(layout.document_ids, S_pad, -1)
        report.add(compare_exact("document_ids", reported.scatter(outputs, "document_ids"), docs.numpy(), grid=grid))
    if bool(case.get("shard_primary", True)):
        report.add(
            compare_exact(
                "input_ids (sharded)",
                reported.scatter(outputs, "input_ids")[:, :S],
                batch["input_ids"].numpy(),
                grid=grid,
            )
        )
    else:
        for o in outputs:
            report.add(
                compare_exact(
                    f"input_ids (global)@rank{o.rank}", o.tensors["input_ids"], batch["input_ids"].numpy(), rank=o.rank
                )
            )
    return report


# ------------------------------------------------------------------------------------ standalone repros
_LAYOUT_WHAT = (
    "a hook returns an unresolved sharder; once resolved, the local batch holds each key at the global "
    "positions its index map reports (labels and positions as computed on the global sequence, padding "
    "from the layout metadata, never from token values), label -100, padding_mask True and positions "
    "counting on at divisibility padding, and the caller's tensors are left as they were."
)


def failing_keys(report, keys) -> list[str]:
    """The keys of ``keys`` a report's failing comparisons or problems name (all of them without a report)."""
    if report is None or any(p.kind is ProblemKind.RANK_RAISED for p in report.problems):
        return list(keys)
    text = " ".join(
        [c.name for c in report.failures() if not c.name.startswith("unpack_row_layout")]
        + [p.message for p in report.problems if "unpack_row_layout" not in p.message]
    )
    return [k for k in keys if k in text]


def _layout_repro(request):
    case = request.case
    batch, layout = expected_layout(case)
    mistral, packed = case["check"] == MISTRAL_LARGE4_LAYOUT.name, "seq_lens" in batch
    labels = (
        torch.where(first_document_tokens(layout), IGNORE_INDEX, batch["labels"])
        if mistral and packed
        else batch["labels"]
    )
    primary = bool(case.get("shard_primary", True))
    keys = {
        "labels": (sharding.Key("labels", IGNORE_INDEX), labels, layout.keep),
        "position_ids": (sharding.Key("position_ids", "count"), layout.positions, layout.keep),
        "padding_mask": (sharding.Key("padding_mask", True), ~layout.keep, torch.ones_like(layout.keep)),
        "input_ids": (
            sharding.Key("input_ids", "free" if mistral and primary else "global"),
            batch["input_ids"],
            torch.ones_like(layout.keep),
        ),
    }
    if mistral and packed:
        keys["document_ids"] = (sharding.Key("document_ids", -1), layout.document_ids, torch.ones_like(layout.keep))
    chosen = failing_keys(request.report, keys)
    hook = {"num_chunks": int(case.get("num_chunks", 1))}
    if mistral:
        hook["shard_primary"] = primary
    name = "prepare_packed_cp_inputs" if case.get("direct_packed") else "prepare_cp_inputs"
    unpack = None
    if (
        not mistral
        and packed
        and request.report is not None
        and any("unpack_row_layout" in c.name for c in request.report.failures())
    ):
        unpack = (~layout.keep, layout.positions, layout.keep)
    return sharding.export(
        request,
        sharding.ShardCase(
            int(case["world_size"]),
            (case["model"], name, hook),
            build_batch(case),
            [keys[k][0] for k in chosen],
            {k: keys[k][1] for k in chosen},
            {k: keys[k][2] for k in chosen},
            _LAYOUT_WHAT,
            mesh=case.get("mesh") != "none",
            unpack=unpack,
        ),
    )


# ------------------------------------------------------------------------------------ strategies
@st.composite
def layout_cases(draw, space=None) -> dict:
    """Sharded-layout cases for either model, ``num_chunks`` > 1 and ``shard_primary`` both ways."""
    space = as_space(space)
    n = draw(world_sizes(space))
    model = draw(st.sampled_from(("inkling2", "mistral_large4")))
    if model == "mistral_large4" and draw(st.booleans()):
        chunks = draw(st.integers(min_value=1, max_value=3))
        spec = draw(packed_layout(max_len=30, rows=chunks))
    else:
        spec = draw(layouts(max_len=30, max_rows=4))
        rows = layout_rows(spec)
        chunks = draw(st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]))
        chunks = fixed_num_chunks(model, spec) or chunks
    spec = draw(with_extras(st.just(spec)))
    spec = draw(inkling2_images(spec, n)) if model == "inkling2" else draw(mistral_image(spec, n))
    case = {
        "check": f"{model}_layout",
        "world_size": n,
        "seed": draw(seeds),
        "model": model,
        "batch": spec,
        "num_chunks": chunks,
    }
    if model == "mistral_large4":
        case["shard_primary"] = draw(st.booleans())
        if spec["format"] == "thd" and draw(st.booleans()):
            case["direct_packed"] = True
    return draw(with_impl(case, space))


def _of_model(model: str):
    def cases(space):
        return layout_cases(space).filter(lambda c: c["model"] == model)

    return cases


# ------------------------------------------------------------------------------------ golden files
def _golden_arrays(case: dict, expected) -> dict[str, torch.Tensor]:
    """The global layout padded as the bundled (contiguous) implementation pads: golden files pin that one."""
    batch, layout = expected
    S_pad = padded_length(layout.keep.shape[1], int(case["world_size"]))
    keep = pad_sequence(layout.keep, S_pad, False)
    labels = batch["labels"].clone()
    out = {
        "keep": keep,
        "padding_mask": ~keep,
        "position_ids": pad_sequence(layout.positions, S_pad, 0),
        "input_ids": batch["input_ids"],
    }
    if case["check"] == "mistral_large4_layout" and "seq_lens" in batch:
        labels = torch.where(first_document_tokens(layout), IGNORE_INDEX, labels)
        out["document_ids"] = pad_sequence(layout.document_ids, S_pad, -1)
    out["labels"] = pad_sequence(labels, S_pad, IGNORE_INDEX)
    return out


def _rank_axis(case: dict, tensor: str) -> int | None:
    # Local [B, L] tensors; input_ids stay global (every rank holds all of them) unless sharded.
    return 1 if tensor != "input_ids" or bool(case.get("shard_primary", True)) else None


def _specified(case: dict, name: str, arr: np.ndarray, oracle: dict[str, np.ndarray]) -> np.ndarray | None:
    """What the contract specifies of a golden implementation array: positions on real tokens, labels on real
    tokens and divisibility padding, input ids outside divisibility padding."""
    if "keep" not in oracle or _rank_axis(case, name) != 1:
        return None
    keep = np.asarray(oracle["keep"], dtype=bool)
    S = int(case["batch"]["seq_len"])
    if arr.shape[:2] != keep.shape:
        return None
    divisibility = np.zeros_like(keep)
    divisibility[:, S:] = True
    return {"position_ids": keep, "labels": keep | divisibility, "input_ids": ~divisibility}.get(name)


def _golden(cases: dict, token_arrays: set[str]) -> GoldenContents:
    return GoldenContents(
        cases=cases,
        oracle_arrays=_golden_arrays,
        token_arrays=frozenset(token_arrays),
        rank_axis=_rank_axis,
        impl_mask=_specified,
    )


_SHARDER = ("sharder.shard", "sharder.shard_token_tensor", "sharder.local_token_global_indices")


def _inkling2_reaches(case: dict) -> tuple[str, ...]:
    """``unpack_row_layout`` is called on its own for a THD batch only (``_unpack_directly``)."""
    thd = case["batch"]["format"] == "thd"
    return ("inkling2.prepare_cp_inputs", *(("inkling2.unpack_row_layout",) if thd else ()), *_SHARDER)


def _mistral_reaches(case: dict) -> tuple[str, ...]:
    """A case calls one hook: ``prepare_packed_cp_inputs`` when ``direct_packed``, else ``prepare_cp_inputs`` (which
    hands a THD batch to the packed hook by internal code: not a call through the documented API)."""
    hook = "prepare_packed_cp_inputs" if case.get("direct_packed") else "prepare_cp_inputs"
    return (f"mistral_large4.{hook}", *_SHARDER)


_TOKEN_ARRAYS = {"keep", "padding_mask", "position_ids", "labels", "input_ids"}

# The two registrations are mostly case descriptions (named examples, golden cases, explicit rows): one case a
# line, read as a table (the formatter would give each field a line of its own).
# fmt: off
# The gate suite's named explicit examples of this check (regressions that must stay).
INKLING2_LAYOUT_EXAMPLES = {
    "n3-thd-seed7": {"check": "inkling2_layout", "world_size": 3, "seed": 7, "model": "inkling2", "num_chunks": 1,
        "batch": {"format": "thd", "seq_len": 10, "docs": [[[1, 1], [0, 2], [4, 5]]], "eos_is_pad": True}},
}

INKLING2_LAYOUT = register(
    "inkling2_layout", rank=_inkling2_rank, evaluate=_inkling2_evaluate, expect=expected_layout,
    reaches=_inkling2_reaches,
    functions=("inkling2.prepare_cp_inputs", "inkling2.unpack_row_layout", "sharder.shard",
               "sharder.local_token_global_indices", "sharder.shard_token_tensor"),
    comm_minimum=comm_minimum.nothing,
    golden=_golden({
        "inkling2_layout-n3-thd-eos-image": {
            "check": "inkling2_layout", "world_size": 3, "seed": 107, "model": "inkling2", "num_chunks": 1,
            "batch": {"format": "thd", "seq_len": 10, "docs": [[[1, 1], [0, 2], [4, 5]], [[6, 6], [3, 4]]],
                      "eos_is_pad": True, "images": [[1, 3, 2, 4]]}},  # image tokens 3, 4 across the 3|4 boundary
        "inkling2_layout-n2-bshd-chunks2": {
            "check": "inkling2_layout", "world_size": 2, "seed": 108, "model": "inkling2", "num_chunks": 2,
            "batch": {"format": "bshd", "seq_len": 7, "rows": [[3, 4], [0, 5]]}},
    }, _TOKEN_ARRAYS),
    # A packed batch whose EOS equals the pad id: inkling2.unpack_row_layout is called on it whatever is drawn.
    rows=(VerifyRow("inkling2.prepare_cp_inputs + unpack_row_layout", _of_model("inkling2"),
                    ("inkling2.prepare_cp_inputs", "inkling2.unpack_row_layout", *_SHARDER), position=2,
                    explicit=({"check": "inkling2_layout", "world_size": 2, "seed": 1, "model": "inkling2",
                               "num_chunks": 1,
                               "batch": {"format": "thd", "seq_len": 9, "docs": [[[3, 4], [4, 4]], [[2, 2], [5, 6]]],
                                         "eos_is_pad": True}},)),),
    examples=INKLING2_LAYOUT_EXAMPLES, repro=Repro(plan=_layout_repro))
# The gate suite's named explicit examples of this check (regressions that must stay).
MISTRAL_LARGE4_LAYOUT_EXAMPLES = {
    "n8-thd-seed8": {"check": "mistral_large4_layout", "world_size": 8, "seed": 8, "model": "mistral_large4",
        "num_chunks": 2, "shard_primary": False,
        "batch": {"format": "thd", "seq_len": 9, "docs": [[[2, 3], [5, 5]], [[9, 9]]]}},
    "n2-bshd-seed9": {"check": "mistral_large4_layout", "world_size": 2, "seed": 9, "model": "mistral_large4",
        "num_chunks": 1, "shard_primary": True, "batch": {"format": "bshd", "seq_len": 7, "rows": [[3, 4], [0, 0]]}},
}

MISTRAL_LARGE4_LAYOUT = register(
    "mistral_large4_layout", rank=_mistral_rank, evaluate=_mistral_evaluate, expect=expected_layout,
    reaches=_mistral_reaches,
    functions=("mistral_large4.prepare_cp_inputs", "mistral_large4.prepare_packed_cp_inputs", "sharder.shard",
               "sharder.local_token_global_indices", "sharder.shard_token_tensor"),
    comm_minimum=comm_minimum.nothing,
    golden=_golden({
        "mistral_large4_layout-n8-thd-global-primary": {
            "check": "mistral_large4_layout", "world_size": 8, "seed": 109, "model": "mistral_large4",
            "num_chunks": 2, "shard_primary": False,
            "batch": {"format": "thd", "seq_len": 9, "docs": [[[2, 3], [5, 5]], [[9, 9]]]}},
        "mistral_large4_layout-n2-bshd-eos": {
            "check": "mistral_large4_layout", "world_size": 2, "seed": 110, "model": "mistral_large4",
            "num_chunks": 1, "shard_primary": True,
            "batch": {"format": "bshd", "seq_len": 7, "rows": [[2, 4], [0, 7]], "eos_is_pad": True}},
    }, _TOKEN_ARRAYS | {"document_ids"}),
    # The packed hook called directly, and a padded batch with the primary stream left global.
    rows=(VerifyRow("mistral_large4.prepare_cp_inputs (BSHD/THD)", _of_model("mistral_large4"),
                    ("mistral_large4.prepare_cp_inputs", "mistral_large4.prepare_packed_cp_inputs", *_SHARDER),
                    position=5,
                    explicit=({"check": "mistral_large4_layout", "world_size": 3, "seed": 2, "model": "mistral_large4",
                               "num_chunks": 1, "shard_primary": True, "direct_packed": True,
                               "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 3], [4, 5]]],
                                         "eos_is_pad": True}},
                              {"check": "mistral_large4_layout", "world_size": 2, "seed": 3, "model": "mistral_large4",
                               "num_chunks": 1, "shard_primary": False,
                               "batch": {"format": "bshd", "seq_len": 7, "rows": [[2, 5], [0, 7]]}})),),
    examples=MISTRAL_LARGE4_LAYOUT_EXAMPLES, repro=Repro(plan=_layout_repro))
# fmt: on
