"""Check ``loss_mask_layout``: a loss mask given to the sharder is sharded with the batch.

The framework's train step passes a per-token loss mask ``[batch, sequence]`` to the sharder's constructor
(``ContextParallelSharder(..., loss_mask=mask)``); ``shard(batch)`` must return it as the local batch's
``loss_mask``: the mask at the positions of the index map the sharder reports, divisibility padding
(positions ``>= S``) filled with ``False`` for a bool mask and ``0`` for a float one, in the mask's own
dtype. Without a loss mask, the local batch has no ``loss_mask`` key. A sharder that forgets the mask, pads
it with ``1`` or shards it in another order than its tokens fails here; the miniature models never read it.

The local batch is read inside the sharder's context (``with ctx_factory():``), as the framework's train
step reads it. Case keys: ``model`` (whose hook prepares the batch), ``batch`` (layout), ``loss_mask``
(``"bool"``, ``"float"`` or ``"absent"``).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from cp_harness.cases.descriptions import build_batch, fixed_num_chunks
from cp_harness.cases.strategies import as_space, layouts, seeds, with_extras, with_impl, world_sizes
from cp_harness.checks import Repro, VerifyRow, register
from cp_harness.checks._token_layout import judge_token_layout
from cp_harness.checks.layout import pad_sequence
from cp_harness.judging import comm_minimum
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport
from cp_harness.repro import sharding
from cp_harness.usage.resolve_sharder import hook_sharder, layout_report, sharded

KINDS = ("bool", "float", "absent")


def global_loss_mask(case: dict, shape: tuple[int, int]) -> torch.Tensor | None:
    """The caller's loss mask ``[batch, sequence]`` (``None`` when the case has none). Float masks take values
    ``k / 8`` so that any copy is exact."""
    kind = case["loss_mask"]
    if kind == "absent":
        return None
    g = torch.Generator().manual_seed(int(case["seed"]) + 7)
    if kind == "bool":
        return torch.rand(shape, generator=g) < 0.7
    return torch.randint(0, 9, shape, generator=g).to(torch.float32) / 8


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    batch = build_batch(case)
    S = batch["input_ids"].shape[1]
    mask = global_loss_mask(case, tuple(batch["input_ids"].shape))
    mask = None if mask is None else mask.to(ctx.device)
    module = getattr(ctx.impl, case["model"])
    mesh = ctx.mesh_for(case)
    caller = {**batch, "loss_mask": mask}
    sharder = hook_sharder(
        module.prepare_cp_inputs(batch, num_chunks=int(case.get("num_chunks", 1))), mesh, loss_mask=mask
    )
    with sharded(sharder, batch, caller=caller) as shard:
        local = shard.local
        info, tensors = layout_report(sharder, mesh, local["labels"].shape[1], S, ctx.device)
        tensors["labels"] = local["labels"].clone()  # copies: a sharder's context may restore buffers on exit
        info["has_loss_mask"] = "loss_mask" in local
        if "loss_mask" in local:
            tensors["loss_mask"] = local["loss_mask"].clone()
            info["loss_mask_dtype"] = str(local["loss_mask"].dtype)
    info["caller_changed_by_shard"] = shard.caller_changes
    return info, tensors


def _expect(case: dict) -> tuple[int, torch.Tensor | None]:
    batch = build_batch(case)
    return batch["input_ids"].shape[1], global_loss_mask(case, tuple(batch["input_ids"].shape))


def _evaluate(case: dict, outputs: list, expected) -> CaseReport:
    report = CaseReport(case=case)
    S, mask = expected
    for o in outputs:
        for change in o.info.get("caller_changed_by_shard", []):
            report.problem(f"rank {o.rank}: {change}")
    if mask is None:
        for o in outputs:
            report.require(
                not o.info["has_loss_mask"],
                f"rank {o.rank}: no loss_mask was given to the sharder, but its local batch holds one",
            )
        judge_token_layout(report, outputs, S, local_name="labels")
        return report
    missing = [o.rank for o in outputs if not o.info["has_loss_mask"]]
    if missing:
        report.problem(
            f"ranks {missing}: the sharder was given loss_mask [batch, sequence] but its local "
            "batch holds no 'loss_mask' (the framework's train step masks the loss with it)"
        )
        return report
    for o in outputs:
        report.require(
            o.info["loss_mask_dtype"] == str(mask.dtype),
            f"rank {o.rank}: local loss_mask is {o.info['loss_mask_dtype']}, the caller's {mask.dtype}",
        )
    reported = judge_token_layout(report, outputs, S, local_name="loss_mask")
    if reported is None:
        return report
    padded = pad_sequence(mask, reported.padded_len, False if mask.dtype == torch.bool else 0)
    report.add(
        compare_exact(
            "loss_mask (at the reported index map; padding False / 0)",
            reported.scatter(outputs, "loss_mask"),
            padded.numpy(),
            grid=reported.grid,
        )
    )
    return report


def _repro_plan(request):
    """The loss mask the sharder was given, at the reported index map (False / 0 at divisibility padding, the
    caller's dtype), and the caller's tensors left as they were."""
    case = request.case
    batch = build_batch(case)
    S, mask = _expect(case)
    keys = (
        [] if mask is None else [sharding.Key("loss_mask", False if mask.dtype == torch.bool else 0.0, str(mask.dtype))]
    )
    compared = {"loss_mask": torch.ones(tuple(batch["input_ids"].shape), dtype=torch.bool)} if keys else {}
    return sharding.export(
        request,
        sharding.ShardCase(
            int(case["world_size"]),
            (case["model"], "prepare_cp_inputs", {"num_chunks": int(case.get("num_chunks", 1))}),
            batch,
            keys,
            {"loss_mask": mask} if keys else {},
            compared,
            "the sharder is given the caller's loss mask [batch, sequence] (ContextParallelSharder(..., loss_mask=mask), "
            "as the framework's train step gives it); shard() must return it as the local batch's loss_mask, at the "
            "positions of the index map it reports, False / 0 at divisibility padding, in the mask's own dtype, and leave "
            "the caller's tensors as they were.",
            mesh=case.get("mesh") != "none",
            loss_mask=mask,
        ),
    )


@st.composite
def loss_mask_cases(draw, space=None) -> dict:
    """Either model's hook on padded or packed rows, with a bool, a float or no loss mask."""
    space = as_space(space)
    n = draw(world_sizes(space))
    model = draw(st.sampled_from(("inkling2", "mistral_large4")))
    spec = draw(with_extras(layouts(max_len=30, max_rows=3)))
    case = {
        "check": "loss_mask_layout",
        "world_size": n,
        "seed": draw(seeds),
        "model": model,
        "batch": spec,
        "num_chunks": fixed_num_chunks(model, spec) or 1,
        "loss_mask": draw(st.sampled_from(KINDS)),
    }
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return draw(with_impl(case, space))


EXAMPLES = {
    # A bool mask over a packed row whose length is not a multiple of N: divisibility padding must be False.
    "packed-bool-n3": {
        "check": "loss_mask_layout",
        "world_size": 3,
        "seed": 4,
        "model": "inkling2",
        "num_chunks": 1,
        "loss_mask": "bool",
        "batch": {"format": "thd", "seq_len": 7, "docs": [[[3, 3], [4, 4]]]},
    },
    "padded-float-n2": {
        "check": "loss_mask_layout",
        "world_size": 2,
        "seed": 5,
        "model": "mistral_large4",
        "num_chunks": 1,
        "loss_mask": "float",
        "batch": {"format": "bshd", "seq_len": 5, "rows": [[0, 5], [1, 3]]},
    },
}

LOSS_MASK_LAYOUT = register(
    "loss_mask_layout",
    rank=_rank,
    evaluate=_evaluate,
    expect=_expect,
    functions=(
        "inkling2.prepare_cp_inputs",
        "mistral_large4.prepare_cp_inputs",
        "sharder.shard",
        "sharder.local_token_global_indices",
        "sharder.shard_token_tensor",
    ),
    comm_minimum=comm_minimum.nothing,
    rows=(
        VerifyRow(
            "sharder.shard(loss_mask=...)",
            loss_mask_cases,
            ("sharder.shard", "sharder.local_token_global_indices", "sharder.shard_token_tensor"),
            explicit=tuple(EXAMPLES.values()),
            position=7.5,
        ),
    ),
    examples=EXAMPLES,
    gate_share=1.0,
    repro=Repro(plan=_repro_plan),
)
