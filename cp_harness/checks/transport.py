"""Data-movement checks: ``gather_sequence``, ``gather_tokens``, ``convolution_history`` (the sharder's round
trip, judged by the same rules, is ``sharder_roundtrip``).

All are pure data movement, so forward and backward must match bit for bit,
in every dtype. Upstream gradients differ on every rank. In float32/float64
they are integer-valued, so the sums the backward performs are exact in any
order. In bfloat16/float16 the contract of every sum of gradient
contributions (a gather's backward over ranks, a halo row read by later
ranks) is: accumulate in float32, round once to the payload's dtype. The
upstream values are then dyadic numbers whose float32 sums are exact in any
order but whose bfloat16/float16 partial sums round (``cases.upstream_values``),
so the expected gradient is one bit pattern (``cases.accumulate``) and a
backward that accumulates in the payload's precision is caught bit for bit.

Case keys: ``shape`` (the *local* shape: ``[B, L, ...]`` for the inkling2
functions, ``[T, ...]`` for ``gather_tokens``), ``dtype`` (floating payload:
float64, float32, bfloat16, float16), ``differentiable`` (gathers),
``value_dtype`` (optional ``"int64"``/``"int32"``/``"bool"`` payload instead, not
differentiated; gathers and ``convolution_history``), ``width``
(``convolution_history``).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from cp_harness.cases.descriptions import accumulate, dtype_of, random_tensor, upstream_values
from cp_harness.cases.strategies import (
    FLOAT_DTYPES,
    VALUE_DTYPES,
    as_space,
    payload_dtypes,
    seeds,
    with_payload,
    world_sizes,
)
from cp_harness.checks import GoldenContents, Repro, VerifyRow, register
from cp_harness.checks._token_layout import stack_ranks
from cp_harness.judging import comm_minimum
from cp_harness.judging.compare import TokenGrid, compare_exact, compare_ulp
from cp_harness.judging.verdicts import CaseReport
from cp_harness.repro import calls

_INT_DTYPES = {"int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


def global_value(case: dict, shape: list[int], seq_dim: int) -> torch.Tensor:
    n = int(case["world_size"])
    full = list(shape)
    full[seq_dim] *= n
    name = case.get("value_dtype")
    if name in _INT_DTYPES:
        g = torch.Generator().manual_seed(int(case["seed"]))
        value = torch.randint(0, 2 if name == "bool" else 1000, full, generator=g)
        return value.to(_INT_DTYPES[name])
    return random_tensor(case, "value", tuple(full), dtype=dtype_of(case))


def upstream_gradient(case: dict, rank: int, shape) -> torch.Tensor:
    return upstream_values(case, f"upstream{rank}", tuple(shape), dtype=dtype_of(case))


def _gather_rank(seq_dim: int, function: str):
    def rank_fn(case: dict, ctx) -> tuple[dict, dict]:
        shape = list(case["shape"])
        local_len = shape[seq_dim]
        value = global_value(case, shape, seq_dim).to(ctx.device)
        local = value.narrow(seq_dim, ctx.rank * local_len, local_len).clone()
        differentiable = bool(case.get("differentiable", True)) and local.is_floating_point()
        if differentiable:
            local.requires_grad_(True)
        module = ctx.impl.inkling2 if function == "gather_sequence" else ctx.impl.mistral_large4
        out = getattr(module, function)(local, ctx.mesh_for(case), differentiable)
        info = {
            "same_object": out is local,
            "requires_grad": bool(out.requires_grad),
            "device": str(out.device),
            "dtype": str(out.dtype),
        }
        tensors = {"out": out}
        if differentiable:
            out.backward(upstream_gradient(case, ctx.rank, out.shape).to(ctx.device))
            tensors["grad"] = local.grad if local.grad is not None else torch.full_like(local, float("nan"))
        return info, tensors

    return rank_fn


def _magnitude(contributions) -> float:
    """The largest sum of the contributions' magnitudes over the elements: the scale a sum of them rounds at."""
    return float(sum(c.to(torch.float64).abs() for c in contributions).max()) if contributions else 0.0


def _sum_comparison(
    name: str, got, exact, expected: dict, dtype: torch.dtype, policy, grid=None, rank: int | None = None
):
    """A sum of ``expected["terms"]`` contributions: bit for bit under the strict policy (float32 accumulation,
    rounded once); under ``payload`` a bfloat16/float16 sum may round in its own precision, within ``terms - 1``
    ULPs of its dtype at the scale of the contributions' magnitudes (``cp_harness.judging.policy``)."""
    low = dtype in (torch.bfloat16, torch.float16)
    if not (policy.payload_sums and low and expected["terms"] > 1):
        return compare_exact(name, got, exact, grid=grid, rank=rank, gradient=True)
    return compare_ulp(
        name,
        got,
        exact,
        budget_ulp=float(expected["terms"] - 1),
        floor_fraction=1.0,
        ulp_dtype=str(dtype).replace("torch.", ""),
        reference_scale=expected["magnitude"],
        grid=grid,
        rank=rank,
        gradient=True,
    )


def _gather_expect(seq_dim: int):
    def expect(case: dict) -> dict:
        n = int(case["world_size"])
        value = global_value(case, list(case["shape"]), seq_dim)
        differentiable = bool(case.get("differentiable", True)) and value.is_floating_point()
        upstream = [upstream_gradient(case, r, value.shape) for r in range(n)] if differentiable else []
        total = accumulate(upstream, value.dtype) if differentiable else None
        return {
            "value": value,
            "differentiable": differentiable,
            "total": total,
            "terms": n,
            "magnitude": _magnitude(upstream),
        }

    return expect


def _gather_evaluate(seq_dim: int):
    def evaluate(case: dict, outputs: list, expected: dict, policy) -> CaseReport:
        report = CaseReport(case=case)
        n = int(case["world_size"])
        shape = list(case["shape"])
        local_len = shape[seq_dim]
        value, differentiable = expected["value"], expected["differentiable"]
        grid = TokenGrid(local_len, n) if seq_dim == 1 else None
        for o in outputs:
            report.add(compare_exact(f"output@rank{o.rank}", o.tensors["out"], value, grid=grid, rank=o.rank))
            report.require(
                o.info["dtype"] == str(value.dtype),
                f"rank {o.rank}: output dtype {o.info['dtype']}, input {value.dtype}",
            )
            if n == 1:
                report.require(o.info["same_object"], "with one rank the documented result is the input object itself")
            else:
                report.require(not o.info["same_object"], f"rank {o.rank}: the gathered result must be a new tensor")
            if not differentiable:
                report.require(
                    not o.info["requires_grad"], f"rank {o.rank}: differentiable=False must give no autograd history"
                )
        if differentiable:
            total = expected["total"]
            for o in outputs:
                report.add(
                    _sum_comparison(
                        f"grad@rank{o.rank}",
                        o.tensors["grad"],
                        total.narrow(seq_dim, o.rank * local_len, local_len),
                        expected,
                        value.dtype,
                        policy,
                        rank=o.rank,
                    )
                )
        return report

    return evaluate


def _history_rank(case: dict, ctx) -> tuple[dict, dict]:
    B, L, C = case["shape"]
    width = int(case["width"])
    value = global_value(case, [B, L, C], 1).to(ctx.device)
    local = value[:, ctx.rank * L : (ctx.rank + 1) * L].clone()
    differentiable = local.is_floating_point()  # integer and bool payloads move without autograd
    if differentiable:
        local.requires_grad_(True)
    out = ctx.impl.inkling2.convolution_history(local, ctx.mesh_for(case), width)
    info = {"dtype": str(out.dtype), "same_object": out is local}
    tensors = {"out": out}
    if differentiable:
        out.backward(upstream_gradient(case, ctx.rank, out.shape).to(ctx.device))
        tensors["grad"] = local.grad if local.grad is not None else torch.full_like(local, float("nan"))
    return info, tensors


def _history_expect(case: dict) -> dict:
    n = int(case["world_size"])
    B, L, C = case["shape"]
    h = int(case["width"]) - 1
    value = global_value(case, [B, L, C], 1)
    padded = torch.cat([torch.zeros(B, h, C, dtype=value.dtype), value], dim=1)  # global row g sits at g + h
    if not value.is_floating_point():
        return {"value": value, "padded": padded, "grad_total": None}
    # Every global row's gradient: its owner's own upstream plus that of each later rank whose history
    # holds it, accumulated as the contract says (float32 for bfloat16/float16, rounded once).
    contributions, readers = [], torch.zeros(padded.shape[1], dtype=torch.int64)
    for r in range(n):
        # Rank r's output rows are global rows r*L - h .. (r+1)*L - 1: padded rows r*L .. r*L + L + h.
        part = torch.zeros_like(padded)
        part[:, r * L : r * L + L + h] = upstream_gradient(case, r, (B, L + h, C))
        contributions.append(part)
        readers[r * L : r * L + L + h] += 1
    return {
        "value": value,
        "padded": padded,
        "grad_total": accumulate(contributions, value.dtype),
        "terms": int(readers.max()),
        "magnitude": _magnitude(contributions),
    }


def _history_evaluate(case: dict, outputs: list, expected: dict, policy) -> CaseReport:
    report = CaseReport(case=case)
    n = int(case["world_size"])
    B, L, C = case["shape"]
    width = int(case["width"])
    h = width - 1
    value, padded = expected["value"], expected["padded"]
    for o in outputs:
        r = o.rank
        # Local row i of rank r's history is global position r*L - h + i (negative: before the sequence).
        report.add(compare_exact(f"history@rank{r}", o.tensors["out"], padded[:, r * L : r * L + L + h], rank=r))
        report.require(not o.info["same_object"], f"rank {r}: convolution_history must return a new tensor")
        report.require(
            o.info["dtype"] == str(value.dtype), f"rank {r}: history dtype {o.info['dtype']}, input {value.dtype}"
        )
    if not value.is_floating_point():
        return report
    grad_total = expected["grad_total"]
    # Gradients in global order, so a failure names the owning rank and its distance to the boundary.
    report.add(
        _sum_comparison(
            "gradient returned to each owner",
            stack_ranks(outputs, "grad"),
            grad_total[:, h : h + n * L],
            expected,
            value.dtype,
            policy,
            grid=TokenGrid(L, n),
        )
    )
    return report


# ------------------------------------------------------------------------------------ standalone repros
def _payload_budget(case: dict, policy, expected: dict):
    return calls.payload_budget(dtype_of(case), policy, expected["terms"], expected["magnitude"])


def _gather_repro(seq_dim: int, function: str):
    """The gather's script: each rank's shard and upstream gradient from the case's seed, this check's oracle;
    a gather recorded in a model run is judged by ``calls.gathered``."""

    def plan(request):
        case = request.case
        expected, n, L = _gather_expect(seq_dim)(case), int(case["world_size"]), list(case["shape"])[seq_dim]
        value, diff = expected["value"], expected["differentiable"]
        call = calls.gather_call(
            function,
            seq_dim,
            [value.narrow(seq_dim, r * L, L) for r in range(n)],
            [upstream_gradient(case, r, value.shape) for r in range(n)] if diff else None,
            value,
            [expected["total"].narrow(seq_dim, r * L, L) for r in range(n)] if diff else None,
            _payload_budget(case, request.policy, expected),
            repr(diff),
            "drawn from the case's seed",
            case.get("mesh") != "none",
        )
        return calls.plan(call, request.subject(function), request.name, request.case_text)

    return Repro(plan=plan, replays={function: calls.recorded_gather(function, seq_dim)})


def _history_plan(request):
    case = request.case
    expected, n, (B, L, C), width = _history_expect(case), int(case["world_size"]), case["shape"], int(case["width"])
    padded, diff, h = expected["padded"], expected["grad_total"] is not None, width - 1
    call = calls.history_call(
        [expected["value"][:, r * L : (r + 1) * L] for r in range(n)],
        [upstream_gradient(case, r, (B, L + h, C)) for r in range(n)] if diff else None,
        [padded[:, r * L : r * L + L + h] for r in range(n)],
        [expected["grad_total"][:, h + r * L : h + (r + 1) * L] for r in range(n)] if diff else None,
        _payload_budget(case, request.policy, expected) if diff else None,
        width,
        "drawn from the case's seed",
        case.get("mesh") != "none",
    )
    return calls.plan(call, request.subject(call.function), request.name, request.case_text)


# ------------------------------------------------------------------------------------ strategies
PAYLOADS = FLOAT_DTYPES + VALUE_DTYPES


@st.composite
def gather_cases(draw, space=None, check: str | None = None) -> dict:
    """``gather_sequence`` / ``gather_tokens`` cases, every float dtype and integer/bool payloads, mesh or ``None``."""
    space = as_space(space)
    n = draw(world_sizes(space))
    check = check or draw(st.sampled_from(("gather_sequence", "gather_tokens")))
    payload = draw(payload_dtypes(space))
    local = draw(st.integers(min_value=1, max_value=5))
    rest = draw(st.lists(st.integers(min_value=1, max_value=3), min_size=0, max_size=2))
    shape = (
        [draw(st.integers(min_value=1, max_value=3)), local, *rest] if check == "gather_sequence" else [local, *rest]
    )
    case = with_payload({"check": check, "world_size": n, "seed": draw(seeds)}, payload)
    case["shape"] = shape
    case["differentiable"] = draw(st.booleans()) if payload in FLOAT_DTYPES else False
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return case


@st.composite
def history_cases(draw, space=None) -> dict:
    """``convolution_history`` cases (every float dtype, integer and bool payloads), widths whose history is
    often longer than a shard."""
    space = as_space(space)
    n = draw(world_sizes(space))
    local = draw(st.integers(min_value=1, max_value=4))
    width = draw(st.integers(min_value=1, max_value=3 * local + 2))
    case = with_payload(
        {"check": "convolution_history", "world_size": n, "seed": draw(seeds)}, draw(payload_dtypes(space))
    )
    case.update(
        {
            "shape": [draw(st.integers(min_value=1, max_value=2)), local, draw(st.integers(min_value=1, max_value=3))],
            "width": width,
        }
    )
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return case


# ------------------------------------------------------------------------------------ golden files
def _gather_arrays(case: dict, expected: dict) -> dict[str, torch.Tensor]:
    out = {"expected_output": expected["value"]}
    if expected["differentiable"]:
        out["expected_grad"] = expected["total"]
    return out


def _history_arrays(case: dict, expected: dict) -> dict[str, torch.Tensor]:
    n = int(case["world_size"])
    _, L, _ = case["shape"]
    h = int(case["width"]) - 1
    padded = expected["padded"]
    out = {"expected_history": torch.stack([padded[:, r * L : r * L + L + h] for r in range(n)])}
    if expected["grad_total"] is not None:
        out["expected_grad"] = expected["grad_total"][:, h : h + n * L]
    return out


def _grad_axis(axis: int):
    def rank_axis(case: dict, tensor: str) -> int | None:
        return axis if tensor == "grad" else None

    return rank_axis


# The three registrations are mostly case descriptions (named examples, golden cases): one case a line, read as a
# table (the formatter would give each field a line of its own).
# fmt: off
# The gate suite's named explicit examples of this check (regressions that must stay).
GATHER_SEQUENCE_EXAMPLES = {
    "n1-float64-nomesh-seed1": {"check": "gather_sequence", "world_size": 1, "mesh": "none", "seed": 1,
        "dtype": "float64", "shape": [2, 3, 4], "differentiable": True},
    # three bf16 gradient slices: float32 sum rounded once
    "n3-bfloat16-seed7": {"check": "gather_sequence", "world_size": 3, "seed": 7, "dtype": "bfloat16",
        "shape": [2, 3, 4], "differentiable": True},
    "n3-bool-seed9": {"check": "gather_sequence", "world_size": 3, "seed": 9, "dtype": "float64",
        "value_dtype": "bool", "shape": [2, 2, 3], "differentiable": False},
    "n4-int64-seed10": {"check": "gather_sequence", "world_size": 4, "seed": 10, "dtype": "float64",
        "value_dtype": "int64", "shape": [1, 3], "differentiable": False},
}

GATHER_SEQUENCE = register(
    "gather_sequence", rank=_gather_rank(1, "gather_sequence"), evaluate=_gather_evaluate(1),
    expect=_gather_expect(1), functions=("inkling2.gather_sequence",), comm_minimum=comm_minimum.gather,
    precision_policy=True,
    golden=GoldenContents(
        cases={
            "gather_sequence-n1-nomesh": {
                "check": "gather_sequence", "world_size": 1, "mesh": "none", "seed": 101, "dtype": "float64",
                "shape": [2, 3, 4], "differentiable": True},
            "gather_sequence-n4-float32": {
                "check": "gather_sequence", "world_size": 4, "seed": 102, "dtype": "float32",
                "shape": [2, 3, 2], "differentiable": True},
            # bfloat16: the gradient sums in float32 and rounds once (the check's own oracle, cases.accumulate)
            "gather_sequence-n3-bfloat16": {
                "check": "gather_sequence", "world_size": 3, "seed": 119, "dtype": "bfloat16",
                "shape": [1, 2, 3], "differentiable": True},
        },
        oracle_arrays=_gather_arrays, token_arrays=frozenset({"expected_output", "expected_grad"}),
        rank_axis=_grad_axis(1)),
    rows=(VerifyRow("inkling2.gather_sequence", lambda space: gather_cases(space, check="gather_sequence"),
                    ("inkling2.gather_sequence",), PAYLOADS, position=0),),
    examples=GATHER_SEQUENCE_EXAMPLES, repro=_gather_repro(1, "inkling2.gather_sequence"))
# The gate suite's named explicit examples of this check (regressions that must stay).
GATHER_TOKENS_EXAMPLES = {
    "n3-float32-seed2": {"check": "gather_tokens", "world_size": 3, "seed": 2, "dtype": "float32", "shape": [2, 5],
        "differentiable": True},
    "n8-float16-seed8": {"check": "gather_tokens", "world_size": 8, "seed": 8, "dtype": "float16", "shape": [3, 2],
        "differentiable": True},
}

GATHER_TOKENS = register(
    "gather_tokens", rank=_gather_rank(0, "gather_tokens"), evaluate=_gather_evaluate(0),
    expect=_gather_expect(0), functions=("mistral_large4.gather_tokens",), comm_minimum=comm_minimum.gather,
    precision_policy=True,
    golden=GoldenContents(
        cases={
            "gather_tokens-n3": {
                "check": "gather_tokens", "world_size": 3, "seed": 103, "dtype": "float64",
                "shape": [5, 2], "differentiable": True},
            "gather_tokens-n8-int64": {
                "check": "gather_tokens", "world_size": 8, "seed": 104, "dtype": "float64",
                "shape": [2, 3], "differentiable": False, "value_dtype": "int64"},
        },
        oracle_arrays=_gather_arrays, rank_axis=_grad_axis(0)),
    rows=(VerifyRow("mistral_large4.gather_tokens", lambda space: gather_cases(space, check="gather_tokens"),
                    ("mistral_large4.gather_tokens",), PAYLOADS, position=4),),
    examples=GATHER_TOKENS_EXAMPLES, repro=_gather_repro(0, "mistral_large4.gather_tokens"))
# The gate suite's named explicit examples of this check (regressions that must stay).
CONVOLUTION_HISTORY_EXAMPLES = {
    # history spans every earlier rank
    "n4-float64-seed3": {"check": "convolution_history", "world_size": 4, "seed": 3, "dtype": "float64",
        "shape": [2, 1, 3], "width": 5},
    # no history at all
    "n3-float64-seed4": {"check": "convolution_history", "world_size": 3, "seed": 4, "dtype": "float64",
        "shape": [1, 2, 2], "width": 1},
    # a row read by five later ranks: six bf16 gradients, summed in float32
    "n8-bfloat16-seed5": {"check": "convolution_history", "world_size": 8, "seed": 5, "dtype": "bfloat16",
        "shape": [2, 1, 3], "width": 6},
    "n4-bool-seed6": {"check": "convolution_history", "world_size": 4, "seed": 6, "dtype": "float64",
        "value_dtype": "bool", "shape": [2, 2, 3], "width": 4},
    "n3-int64-seed7": {"check": "convolution_history", "world_size": 3, "seed": 7, "dtype": "float64",
        "value_dtype": "int64", "shape": [1, 1, 2], "width": 3},
}

CONVOLUTION_HISTORY = register(
    "convolution_history", rank=_history_rank, evaluate=_history_evaluate, expect=_history_expect,
    functions=("inkling2.convolution_history",), comm_minimum=comm_minimum.halo, precision_policy=True,
    golden=GoldenContents(
        cases={  # width - 1 longer than a shard: the history spans several ranks
            "convolution_history-n4-width5-local1": {
                "check": "convolution_history", "world_size": 4, "seed": 105, "dtype": "float64",
                "shape": [2, 1, 3], "width": 5},
            "convolution_history-n8-width4-local2": {
                "check": "convolution_history", "world_size": 8, "seed": 106, "dtype": "float32",
                "shape": [1, 2, 2], "width": 4},
        },
        oracle_arrays=_history_arrays, token_arrays=frozenset({"expected_grad"}), rank_axis=_grad_axis(1)),
    rows=(VerifyRow("inkling2.convolution_history", history_cases, ("inkling2.convolution_history",), PAYLOADS,
                    position=1),),
    examples=CONVOLUTION_HISTORY_EXAMPLES, repro=Repro(plan=_history_plan, replays={"inkling2.convolution_history": calls.recorded_history}))
# fmt: on
