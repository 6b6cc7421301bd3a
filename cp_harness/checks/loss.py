"""``mistral_large4.shifted_cp_loss`` against the oracle's shifted cross-entropy.

Every rank gets random soft-capped logits for its shard, the unshifted labels
and the flattened keep mask of the case's layout (divisibility padding is not
kept). The mean of the per-rank losses must equal the oracle's global mean,
and the per-rank gradients, averaged over ranks as FSDP does, the gradient of
that mean. Case keys: ``batch`` (layout), ``vocab`` (logit width), ``dtype``
(of the logits), ``pad_multiple`` (optional: the logits are drawn for the
sequence padded to a multiple of this instead of ``world_size``; the one-rank
baseline of ``cp_harness.judging.excess`` sets it so that it sees the very logits of
the CP case).

bfloat16/float16 logits: the contract (SPEC: logits are upcast to at least
float32) is that the loss is accumulated and returned in float32, and the
gradient computed in float32 and rounded once to the logits' dtype. So the
loss values are measured in float32 ULPs against the float32 budget, the
gradient in ULPs of the logits' dtype, and a loss returned in another dtype
is a problem.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from cp_harness.cases.descriptions import (
    IGNORE_INDEX,
    LOW_PRECISION,
    build_batch,
    dtype_of,
    padded_length,
    random_tensor,
)
from cp_harness.cases.strategies import FLOAT_DTYPES, as_space, float_dtypes, layouts, seeds, with_extras, world_sizes
from cp_harness.checks import GoldenContents, Repro, VerifyRow, register
from cp_harness.checks._token_layout import stack_ranks
from cp_harness.judging import comm_minimum
from cp_harness.judging.budgets import Budget
from cp_harness.judging.compare import TokenGrid, compare_exact, compare_ulp
from cp_harness.judging.verdicts import CaseReport
from cp_harness.repro import calls
from oracle.layout import layout_from_batch
from oracle.loss import mean_loss, shifted_cross_entropy

SOFTCAP = 5.0


def loss_inputs(case: dict):
    """Global padded ``(logits [B,S_pad,V], labels [B,S_pad], keep [B,S_pad])`` and the unpadded length."""
    n = int(case["world_size"])
    batch = build_batch(case)
    layout = layout_from_batch(batch)
    B, S = batch["input_ids"].shape
    S_pad = padded_length(S, int(case.get("pad_multiple", n)))
    V = int(case.get("vocab", 11))
    raw = random_tensor(case, "logits", (B, S_pad, V), dtype=dtype_of(case)) * 3
    # The soft-cap in float64, rounded once to the case's dtype: a float32 tanh's last bit depends on
    # the processor model (not only on ATEN_CPU_CAPABILITY), and the case's inputs must be the same data everywhere.
    logits = (SOFTCAP * torch.tanh(raw.to(torch.float64) / SOFTCAP)).to(raw.dtype)
    labels = torch.full((B, S_pad), IGNORE_INDEX, dtype=torch.int64)
    labels[:, :S] = batch["labels"] % V
    labels[:, :S] = torch.where(batch["labels"] == IGNORE_INDEX, IGNORE_INDEX, labels[:, :S])
    keep = torch.zeros(B, S_pad, dtype=torch.bool)
    keep[:, :S] = layout.keep
    return logits, labels, keep, S


def per_position_ce(
    logits: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor, *, shifted: bool
) -> torch.Tensor:
    """Cross-entropy of every counted position in float64, zero elsewhere: ``[B, S]``.

    ``shifted``: position ``t`` predicts ``labels[t+1]`` (Hugging Face); else ``labels[t]``.
    ``counted [B, S]`` says which positions count (decided by the caller from the layout).
    Used to split a global loss into the per-rank sums that each rank's loss must carry.
    """
    logp = torch.log_softmax(logits.detach().to(torch.float64), dim=-1)
    target = torch.full_like(labels, 0)
    if shifted:
        target[:, :-1] = labels[:, 1:]
    else:
        target = labels.clone()
    picked = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return torch.where(counted, picked, torch.zeros_like(picked))


def cross_entropy_scale(logits: torch.Tensor, counted: torch.Tensor, *, shifted: bool) -> float:
    """The scale at which any computation of these cross-entropies rounds: the mean, over the counted
    positions, of ``max(|logsumexp|, max |logit|)`` of the row that predicts.

    A cross-entropy is ``logsumexp - picked``; its rounding is relative to those terms (a few units for
    soft-capped logits), not to their difference, which is tiny for a confident prediction. An
    implementation that shares the oracle's log-softmax kernel rounds the same way and hides this; one
    computing ``logsumexp - picked`` (``tests/fixtures/alt_reduction_order``) showed 400 float64 ULPs of a
    0.002 loss, at 2e-16 absolute.
    """
    rows = logits.detach().to(torch.float64)
    mask = torch.zeros_like(counted)
    if shifted:
        mask[:, :-1] = counted[:, :-1]
    else:
        mask = counted
    if not bool(mask.any()):
        return 0.0
    rows = rows[mask]
    terms = torch.maximum(torch.logsumexp(rows, dim=-1).abs(), rows.abs().amax(dim=-1))
    return float(terms.mean())


def compare_rank_losses(
    report: CaseReport,
    outputs: list,
    per_position: torch.Tensor,
    count: int,
    budget,
    ulp_dtype: str,
    scale: float | None = None,
    index_maps: list | None = None,
) -> None:
    """Each rank's loss must be its own sum x N / global count (SPEC), not only their mean: a rank
    returning the global mean everywhere has the right mean and the wrong per-rank gradient scale.

    ``per_position [B, S_pad]`` in global order; ``index_maps``: each rank's global positions (default
    contiguous); ``scale``: the loss's rounding scale (``cross_entropy_scale``); default the global loss itself."""
    n = len(outputs)
    L = per_position.shape[1] // n
    # A rank's loss is its share of the global loss (their mean): judged at the global loss's scale (or
    # the cross-entropy's, when given), as parameter gradients are judged at the model's gradient scale.
    global_loss = abs(float(per_position.sum())) / count if count > 0 else 0.0
    scale = max(global_loss, scale or 0.0)
    for o in outputs:
        owned = (
            torch.as_tensor(index_maps[o.rank])
            if index_maps is not None
            else torch.arange(o.rank * L, (o.rank + 1) * L)
        )
        local_sum = per_position.index_select(1, owned).sum()
        expected = local_sum * n / count if count > 0 else torch.zeros((), dtype=torch.float64)
        report.add(
            compare_ulp(
                f"loss@rank{o.rank} (local sum x N / global count)",
                o.tensors["loss"],
                expected.numpy(),
                budget_ulp=budget.ulp,
                floor_fraction=budget.floor_fraction,
                ulp_dtype=ulp_dtype,
                reference_scale=scale,
                rank=o.rank,
            )
        )


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    n = int(case["world_size"])
    logits, labels, keep, _ = loss_inputs(case)
    L = logits.shape[1] // n
    sl = slice(ctx.rank * L, (ctx.rank + 1) * L)
    local_logits = logits[:, sl].clone().to(ctx.device).requires_grad_(True)
    local_labels = labels[:, sl].clone().to(ctx.device)
    valid = keep[:, sl].reshape(-1).clone().to(ctx.device)
    loss = ctx.impl.mistral_large4.shifted_cp_loss(local_logits, local_labels, valid, ctx.mesh_for(case))
    loss.backward()
    grad = local_logits.grad if local_logits.grad is not None else torch.full_like(local_logits, float("nan"))
    info = {"loss_requires_grad": bool(loss.requires_grad), "loss_dtype": str(loss.dtype)}
    return info, {"loss": loss.reshape(()), "grad": grad}


def _expect(case: dict) -> dict:
    """The oracle's side of a loss case: its inputs, the float64 loss and gradient, the per-position losses."""
    logits, labels, keep, S = loss_inputs(case)
    ref_logits = logits.detach().to(torch.float64).requires_grad_(True)
    loss_sum, count = shifted_cross_entropy(ref_logits, labels, keep)
    ref = mean_loss(loss_sum, count)
    ref.backward()
    counted = torch.zeros_like(keep)
    counted[:, :-1] = keep[:, :-1] & keep[:, 1:] & (labels[:, 1:] != IGNORE_INDEX)
    return {
        "logits": logits,
        "labels": labels,
        "keep": keep,
        "count": count,
        "ref": ref.detach(),
        "ref_grad": ref_logits.grad,
        "counted": counted,
        "loss_scale": cross_entropy_scale(logits, counted, shifted=True),
        "per_position": per_position_ce(logits, labels, counted, shifted=True),
    }


def _evaluate(case: dict, outputs: list, expected: dict, policy) -> CaseReport:
    report = CaseReport(case=case)
    n = int(case["world_size"])
    logits, labels, keep, count = expected["logits"], expected["labels"], expected["keep"], expected["count"]
    L = logits.shape[1] // n
    ref = expected["ref"]
    dtype = case.get("dtype", "float64")
    # The loss is accumulated in float32 for bfloat16/float16 logits: judged as a float32 loss.
    loss_dtype = "float32" if dtype in LOW_PRECISION else dtype
    loss_budget = policy.budget(SHIFTED_CP_LOSS, loss_dtype)
    budget = policy.budget(SHIFTED_CP_LOSS, dtype)
    losses = np.array([float(o.tensors["loss"]) for o in outputs])
    report.require(bool(np.all(np.isfinite(losses))), f"losses must be finite, got {losses.tolist()}")
    for o in outputs:
        report.require(o.info["loss_requires_grad"], f"rank {o.rank}: the loss must take part in autograd")
        report.require(
            o.info["loss_dtype"] == f"torch.{loss_dtype}",
            f"rank {o.rank}: loss dtype {o.info['loss_dtype']} for {dtype} logits; the contract upcasts "
            f"logits to at least float32 and returns the loss in torch.{loss_dtype}",
        )
    mean = np.array(losses.sum() / n)
    # Rounding scales (see cross_entropy_scale): the loss at its rows' log-sum-exp, the gradient
    # (softmax - one-hot) / count at 1 / count, whatever cancellation leaves of them.
    loss_scale = expected["loss_scale"]
    grad_scale = 1.0 / int(count) if int(count) > 0 else None
    report.add(
        compare_ulp(
            "loss (mean over ranks)",
            mean,
            ref.detach().numpy(),
            budget_ulp=loss_budget.ulp,
            floor_fraction=loss_budget.floor_fraction,
            ulp_dtype=loss_dtype,
            reference_scale=loss_scale,
        )
    )
    grad = stack_ranks(outputs, "grad") / n
    report.add(
        compare_ulp(
            "d loss / d logits",
            grad,
            expected["ref_grad"].numpy(),
            budget_ulp=budget.ulp,
            floor_fraction=budget.floor_fraction,
            grid=TokenGrid(L, n),
            ulp_dtype=dtype,
            reference_scale=grad_scale,
            gradient=True,
        )
    )
    if int(count) == 0:
        report.add(compare_exact("loss when nothing counts", losses, np.zeros(n)))
    compare_rank_losses(
        report, outputs, expected["per_position"], int(count), loss_budget, loss_dtype, scale=loss_scale
    )
    # Positions that predict nothing must get exactly zero gradient.
    predicts = torch.zeros_like(keep)
    predicts[:, :-1] = keep[:, :-1] & keep[:, 1:] & (labels[:, 1:] != IGNORE_INDEX)
    if bool((~predicts).any()):
        report.add(
            compare_exact(
                "d loss / d logits where nothing is predicted",
                grad,
                np.zeros_like(grad),
                mask=(~predicts).numpy(),
                grid=TokenGrid(L, n),
                gradient=True,
            )
        )
    report.info["count"] = int(count)
    report.info["ulp"] = report.max_ulp
    return report


def _repro_plan(request):
    """Every rank's own loss and gradient, within the budgets ``_evaluate`` applies: a rank's loss is its share of
    the global loss (local sum x N / global count, judged at the global loss's scale), its gradient N times its
    slice of the mean loss's (judged at N times the gradient's scale)."""
    case = request.case
    expected, n = _expect(case), int(case["world_size"])
    logits, labels, keep, count = expected["logits"], expected["labels"], expected["keep"], int(expected["count"])
    L, dtype = logits.shape[1] // n, case.get("dtype", "float64")
    loss_dtype = "float32" if dtype in LOW_PRECISION else dtype
    per_position, ref_grad = expected["per_position"], expected["ref_grad"]
    loss_scale = max(abs(float(per_position.sum())) / count if count else 0.0, expected["loss_scale"])
    grad_scale = n * max(float(ref_grad.abs().max()), 1.0 / count if count else 0.0)
    lb, gb = request.policy.budget(SHIFTED_CP_LOSS, loss_dtype), request.policy.budget(SHIFTED_CP_LOSS, dtype)
    ranks = [slice(r * L, (r + 1) * L) for r in range(n)]
    zero = torch.zeros((), dtype=torch.float64)
    call = calls.CallCase(
        "mistral_large4.shifted_cp_loss",
        ['inputs["logits"]', 'inputs["labels"]', 'inputs["valid"]', "mesh"],
        [{"logits": logits[:, sl], "labels": labels[:, sl], "valid": keep[:, sl].reshape(-1)} for sl in ranks],
        [
            calls.Expectation(
                "output", (lb.ulp, lb.floor_fraction, loss_dtype, loss_scale), dtype=f"torch.{loss_dtype}"
            ),
            calls.Expectation("grad logits", (gb.ulp, gb.floor_fraction, dtype, grad_scale), axis=1),
        ],
        [
            {"output": per_position[:, sl].sum() * n / count if count else zero, "grad logits": ref_grad[:, sl] * n}
            for sl in ranks
        ],
        calls.WHAT["mistral_large4.shifted_cp_loss"],
        "drawn from the case's seed",
        ("logits",),
        positions=[{"grad logits": torch.arange(sl.start, sl.stop)} for sl in ranks],
    )
    return calls.plan(call, request.subject(call.function), request.name, request.case_text)


@st.composite
def loss_cases(draw, space=None) -> dict:
    space = as_space(space)
    n = draw(world_sizes(space))
    return {
        "check": "shifted_cp_loss",
        "world_size": n,
        "seed": draw(seeds),
        "model": "mistral_large4",
        "dtype": draw(float_dtypes(space=space)),
        "vocab": draw(st.integers(min_value=2, max_value=13)),
        "batch": draw(with_extras(layouts(min_len=2, max_len=24))),
    }


def _one_rank_changes(case: dict) -> dict:
    """The one-rank baseline draws its logits for the sequence padded as the CP case's are: the same logits."""
    return {"pad_multiple": int(case.get("pad_multiple", case["world_size"]))}


def _golden_arrays(case: dict, expected: dict) -> dict:
    return {
        "loss": expected["ref"],
        "grad": expected["ref_grad"],
        "count": np.asarray(int(expected["count"]), dtype=np.int64),
    }


# Measured and explained in cp_harness/judging/budgets.py (figures: ``docs/budgets.md``).
BUDGETS = {
    "float64": Budget(16.0, 1.0),
    "float32": Budget(256.0, 1.0),
    # bf16/fp16 logits: the gradient (the loss values use the float32 entry)
    "bfloat16": Budget(2.0, 1 / 1024),
    "float16": Budget(2.0, 1.0),
}

# The gate suite's named explicit examples of this check (regressions that must stay).
SHIFTED_CP_LOSS_EXAMPLES = {
    # nothing counts
    "n2-bshd-float64-seed5": {
        "check": "shifted_cp_loss",
        "world_size": 2,
        "seed": 5,
        "model": "mistral_large4",
        "dtype": "float64",
        "vocab": 7,
        "batch": {"format": "bshd", "seq_len": 6, "rows": [[0, 0], [0, 0]]},
    },
    # targets across boundaries
    "n4-thd-float64-seed6": {
        "check": "shifted_cp_loss",
        "world_size": 4,
        "seed": 6,
        "model": "mistral_large4",
        "dtype": "float64",
        "vocab": 5,
        "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 4], [4, 4]]]},
    },
    "n3-bshd-bfloat16-seed7": {
        "check": "shifted_cp_loss",
        "world_size": 3,
        "seed": 7,
        "model": "mistral_large4",
        "dtype": "bfloat16",
        "vocab": 11,
        "batch": {"format": "bshd", "seq_len": 20, "rows": [[0, 20], [3, 17]]},
    },
    "n8-thd-float16-seed8": {
        "check": "shifted_cp_loss",
        "world_size": 8,
        "seed": 8,
        "model": "mistral_large4",
        "dtype": "float16",
        "vocab": 13,
        "batch": {"format": "thd", "seq_len": 17, "docs": [[[9, 9], [7, 8]]]},
    },
}

SHIFTED_CP_LOSS = register(
    "shifted_cp_loss",
    rank=_rank,
    evaluate=_evaluate,
    expect=_expect,
    functions=("mistral_large4.shifted_cp_loss",),
    arithmetic=True,
    budgets=BUDGETS,
    one_rank_changes=_one_rank_changes,
    comm_minimum=comm_minimum.boundary_labels,
    golden=GoldenContents(
        cases={
            "shifted_cp_loss-n4-thd": {
                "check": "shifted_cp_loss",
                "world_size": 4,
                "seed": 111,
                "model": "mistral_large4",
                "dtype": "float64",
                "vocab": 5,
                "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 4], [4, 4]]]},
            },
            "shifted_cp_loss-n3-bshd-eos-float32": {
                "check": "shifted_cp_loss",
                "world_size": 3,
                "seed": 112,
                "model": "mistral_large4",
                "dtype": "float32",
                "vocab": 7,
                "batch": {"format": "bshd", "seq_len": 7, "rows": [[1, 5], [0, 7]], "eos_is_pad": True},
            },
        },
        oracle_arrays=_golden_arrays,
        token_arrays=frozenset({"grad"}),
        rank_axis=lambda case, tensor: 1 if tensor == "grad" else None,
    ),
    rows=(
        VerifyRow(
            "mistral_large4.shifted_cp_loss", loss_cases, ("mistral_large4.shifted_cp_loss",), FLOAT_DTYPES, position=6
        ),
    ),
    examples=SHIFTED_CP_LOSS_EXAMPLES,
    repro=Repro(plan=_repro_plan),
)
