"""The sharder's round trip: ``shard_token_tensor`` then ``gather_token_tensor`` of any token tensor.

Pure data movement, judged like the gathers (``transport``): forward and backward bit for bit in every dtype,
with the same upstream gradients. Case keys: ``shape`` (the *global* ``[B, S, C]``: batch, tokens, channels;
``S`` need not be a multiple of the CP size), ``dtype`` / ``value_dtype`` (the payload).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from cp_harness.cases.descriptions import accumulate, build_batch
from cp_harness.cases.strategies import as_space, payload_dtypes, seeds, with_impl, with_payload, world_sizes
from cp_harness.checks import Repro, VerifyRow, register
from cp_harness.checks._token_layout import judge_token_layout
from cp_harness.checks.transport import PAYLOADS, global_value, upstream_gradient
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport
from cp_harness.repro import sharding
from cp_harness.usage.resolve_sharder import hook_sharder, layout_report, sharded


@st.composite
def sharder_cases(draw, space=None) -> dict:
    """``shard_token_tensor`` / ``gather_token_tensor`` round trips (sequence not a multiple of N included)."""
    space = as_space(space)
    n = draw(world_sizes(space))
    case = {
        "check": "sharder_roundtrip",
        "world_size": n,
        "seed": draw(seeds),
        **with_payload({}, draw(payload_dtypes(space))),
        "shape": [
            draw(st.integers(min_value=1, max_value=3)),
            draw(st.integers(min_value=1, max_value=19)),
            draw(st.integers(min_value=1, max_value=3)),
        ],
    }
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return draw(with_impl(case, space))


def _sharder_rank(case: dict, ctx) -> tuple[dict, dict]:
    """Shard any token tensor with the sharder of a prepared batch, then gather it back (trimmed and padded)."""
    B, S, C = case["shape"]
    spec = {"format": "bshd", "seq_len": S, "rows": [[0, S]] * B}
    batch = build_batch({"seed": case["seed"], "batch": spec, "model": "inkling2"})
    mesh = ctx.mesh_for(case)
    sharder = hook_sharder(ctx.impl.inkling2.prepare_cp_inputs(batch), mesh)
    with sharded(sharder, batch):  # the verbs are used inside the sharder's context, as in a train step
        return _sharder_roundtrip(case, ctx, sharder, mesh, B, S, C)


def _sharder_roundtrip(case: dict, ctx, sharder, mesh, B: int, S: int, C: int) -> tuple[dict, dict]:
    value = global_value(case, [B, S, C], 1)[:, :S].clone().to(ctx.device)
    info: dict
    layout_tensors: dict
    if not value.is_floating_point():  # integer and bool payloads: the round trip without autograd
        local = sharder.shard_token_tensor(value, fill=0)
        info, layout_tensors = layout_report(sharder, mesh, local.shape[1], S, ctx.device)
        return info, {
            "local": local,
            "restored": sharder.gather_token_tensor(local, trim=True),
            "untrimmed": sharder.gather_token_tensor(local),
            **layout_tensors,
        }
    value.requires_grad_(True)
    local = sharder.shard_token_tensor(value, fill=0)
    local.retain_grad()
    restored = sharder.gather_token_tensor(local, trim=True)
    restored.backward(upstream_gradient(case, ctx.rank, restored.shape).to(ctx.device))
    untrimmed = sharder.gather_token_tensor(local.detach())
    info, layout_tensors = layout_report(sharder, mesh, local.shape[1], S, ctx.device)
    return info, {
        "local": local,
        "restored": restored,
        "untrimmed": untrimmed,
        "local_grad": local.grad,
        "global_grad": value.grad,
        **layout_tensors,
    }


def _sharder_evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    n = int(case["world_size"])
    B, S, C = case["shape"]
    reported = judge_token_layout(report, outputs, S, local_name="local")
    if reported is None:
        return report
    S_pad, grid = reported.padded_len, reported.grid
    value = global_value(case, [B, S, C], 1)[:, :S]
    padded = torch.zeros(B, S_pad, C, dtype=value.dtype)
    padded[:, :S] = value
    total = accumulate((upstream_gradient(case, r, (B, S, C)) for r in range(n)), value.dtype)
    total_padded = torch.zeros(B, S_pad, C, dtype=value.dtype)
    total_padded[:, :S] = total
    for o, index_map in zip(outputs, reported.index_maps):
        r = o.rank
        owned = torch.as_tensor(index_map)
        report.add(
            compare_exact(f"shard_token_tensor@rank{r}", o.tensors["local"], padded.index_select(1, owned), rank=r)
        )
        report.add(
            compare_exact(f"gather_token_tensor(trim=True)@rank{r}", o.tensors["restored"], value, grid=grid, rank=r)
        )
        report.add(
            compare_exact(f"gather_token_tensor(trim=False)@rank{r}", o.tensors["untrimmed"], padded, grid=grid, rank=r)
        )
        if not value.is_floating_point():
            continue
        report.add(
            compare_exact(
                f"grad of the local shard@rank{r}",
                o.tensors["local_grad"],
                total_padded.index_select(1, owned),
                rank=r,
                gradient=True,
            )
        )
        # Through shard_token_tensor each rank's global input receives its own tokens' gradient only.
        own = torch.zeros(B, S_pad, C, dtype=value.dtype)
        own[:, owned] = total_padded[:, owned]
        report.add(
            compare_exact(
                f"grad of the global input@rank{r}",
                o.tensors["global_grad"],
                own[:, :S],
                grid=grid,
                rank=r,
                gradient=True,
            )
        )
    return report


_SHARDER_VERBS = (
    "sharder.shard",
    "sharder.shard_token_tensor",
    "sharder.local_token_global_indices",
    "sharder.gather_token_tensor",
)
# The gate suite's named explicit examples of this check (regressions that must stay).
SHARDER_ROUNDTRIP_EXAMPLES = {
    "n8-float64-seed13": {
        "check": "sharder_roundtrip",
        "world_size": 8,
        "seed": 13,
        "dtype": "float64",
        "shape": [2, 5, 3],
    },
    "n3-bfloat16-seed14": {
        "check": "sharder_roundtrip",
        "world_size": 3,
        "seed": 14,
        "dtype": "bfloat16",
        "shape": [1, 7, 2],
    },
}


def _sharder_repro(request) -> sharding.script.Plan:
    B, S, C = request.case["shape"]
    return sharding.roundtrip(request, global_value(request.case, [B, S, C], 1)[:, :S].clone())


SHARDER_ROUNDTRIP = register(
    "sharder_roundtrip",
    rank=_sharder_rank,
    evaluate=_sharder_evaluate,
    functions=_SHARDER_VERBS,  # every case shards its batch first (``sharded``), then round-trips the tensor
    rows=(
        VerifyRow(
            "sharder.shard_token_tensor + gather_token_tensor", sharder_cases, _SHARDER_VERBS, PAYLOADS, position=7
        ),
    ),
    examples=SHARDER_ROUNDTRIP_EXAMPLES,
    repro=Repro(plan=_sharder_repro),
)
