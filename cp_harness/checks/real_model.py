"""Check ``real_model``: a real framework model, sharded by the framework's own CP path, computes what the same
model computes on one device (logits at valid positions, the loss, every parameter gradient).

No float64 oracle exists for real models (their eager attention computes in float32), so the reference is the
same model on one device, in the same dtype, in the same rank process: rank 0 runs it twice, plainly and under a
semantically neutral change of reduction order (the batch rows reversed and the loss's gradient cut into
``max(2, N)`` position chunks backpropagated one by one, so that parameter gradients accumulate as partial
sums, as CP's do).
The difference of those two runs is the *reference spread*; a CP tensor passes when its normwise error (ULPs of
the model's dtype at the tensor's largest one-device value) is at most ``C x spread + FLOOR[dtype]``
(calibration: ``docs/real_models.md``). Every rank runs the CP path the framework's way
(``cp_harness.usage.model_specs.step``).

**Padding sensitivity.** When a tensor fails on an unpacked batch whose CP padded length exceeds its length,
rank 0 also runs one device on the batch right-padded (masked pad tokens, ``spec.pad_batch``) to that length.
If CP matches that run within the same bound and that run differs from the unpadded one, the report says
"padding changes this model's result on one rank" with a one-process repro command: a property of the model,
not a CP defect. It still fails the case (the CP run does not compute what one device computes on the batch
as given); its problem line says which kind of failure it is.

**Kernel sensitivity.** When a tensor fails at CP > 1 and the spec has ``cp_kernels(model)`` (a context manager
inside which the model's one-device forward uses the kernels its CP path uses, without CP), rank 0 also runs one
device under it (and, where the batch is CP-padded, on the padded batch under it as well). If CP matches that
run within the same bound and that run differs from the plain one, the report says "KERNEL SENSITIVITY, not a
CP failure: the CP path's kernels (...) round differently from the one-device path's by as much as CP differs"
with a one-process repro command; where only padding and the kernels together explain it, it says both. The
case still fails; the problem's ``kind`` is ``"kernel sensitivity"`` (``"padding and kernel sensitivity"``).

**Stand-ins.** A spec's declared kernel stand-ins (``STANDINS``, ``cp_harness.standins``) are entered on every
rank around the CP step only (the one-device runs use the real kernel; the kernel-sensitivity runs, which compute
with the CP path's kernels, enter them too); a stand-in for a kernel the device has no implementation of at all
(``StandIn.reference_too``: Mamba's kernels) is entered around every one-device run as well. The ones whose
computation ran in the CP step are named in the report (``CaseReport.standins``: "CPU, stand-in: ...").

Case keys: ``spec`` (module path of a model spec), ``dtype`` (``float32``, ``bfloat16``), ``seed`` (model
weights), ``overrides`` (optional config fields), ``batch`` (``kind``, ``seq_len`` and ``spec.make_batch``'s
keywords: ``batch_size``, ``seed``, ``documents``, ``pad``), ``world_size``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from cp_harness import standins
from cp_harness.cases.profiles import current_space
from cp_harness.cases.strategies import as_space
from cp_harness.checks import Repro, VerifyRow, register
from cp_harness.checks._real_model_batches import _batches, _row_images  # noqa: F401  (the rows' batch strategy)
from cp_harness.judging.compare import ExcessVerdict, UlpComparison
from cp_harness.judging.verdicts import CaseReport, ProblemKind
from cp_harness.repro import real_model as repro_real_model
from cp_harness.usage import model_specs

C = 4.0
FLOOR = {"float32": 1024.0, "bfloat16": 8.0}  # ULPs of the dtype at the tensor's largest value (docs/real_models.md)
GRADIENT_SCALE_FLOOR = 2.0**-10  # a gradient's scale is at least this share of the case's largest gradient


def _prepare(case: dict, device: torch.device):
    """The spec, its model and the case's global batch, on the rank's ``device`` (a spec builds on the CPU; on an
    ``nccl`` pool the model and batch move to the rank's GPU here; never run on a GPU so far)."""
    spec = model_specs.load_spec(case["spec"])
    model = model_specs.cached_model(case["spec"], case["dtype"], int(case.get("seed", 0)), case.get("overrides"))
    if next(model.parameters()).device != device:
        model.to(device)
    batch = {
        k: (v.to(device) if isinstance(v, torch.Tensor) else v)
        for k, v in model_specs.make_batch(spec, case["batch"]).items()
    }
    return spec, model, batch


def _agree_ready(ctx, error: BaseException | None) -> None:
    """Every rank of the case says whether it could build its model and batch before any collective of the CP
    path, so that one rank's failure is named by that rank instead of hanging the others."""
    group = ctx.mesh.get_group() if ctx.mesh is not None and ctx.cp_size > 1 else None
    if group is None:
        if error is not None:
            raise error
        return
    errors: list = [None] * ctx.cp_size
    mine = None if error is None else f"{type(error).__name__}: {error}"
    torch.distributed.all_gather_object(errors, mine, group=group)
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        named = "; ".join(f"rank {r} raised {e}" for r, e in failed.items())
        raise RuntimeError(
            f"building the model or batch failed on rank(s) {sorted(failed)} ({named}); "
            f"rank {ctx.rank} did not run the case"
        ) from error


class Run(enum.Enum):
    """The runs a case compares, all on rank 0 but ``CP`` (every rank's result, summed and gathered):
    ``REFERENCE`` one device plainly, ``REORDERED`` one device under a neutral change of reduction order (the
    spread), ``PADDED`` one device on the batch right-padded to the CP padded length (padding sensitivity),
    ``KERNELS`` one device under ``spec.cp_kernels`` (kernel sensitivity), ``PADDED_KERNELS`` both at once.
    The last three run only when a tensor fails, and are the *explanations* (``EXPLANATIONS``)."""

    CP = "cp"
    REFERENCE = "ref"
    REORDERED = "other"
    PADDED = "padded"
    KERNELS = "kernels"
    PADDED_KERNELS = "padded_kernels"


EXPLANATIONS = (Run.PADDED, Run.KERNELS, Run.PADDED_KERNELS)  # tried in this order: the simplest first


@dataclasses.dataclass(frozen=True)
class Quantity:
    """One compared tensor of a run: the ``logits`` [B, S, V], the ``loss`` [] or the gradient of ``parameter``."""

    kind: str  # "logits", "loss", "grad"
    parameter: str | None = None

    @property
    def label(self) -> str:
        return self.kind if self.parameter is None else f"grad {self.parameter}"


def _quantities(result: dict) -> dict[Quantity, torch.Tensor]:
    out = {Quantity("logits"): result["logits"].float(), Quantity("loss"): result["loss"].float()}
    out.update({Quantity("grad", name): g.float() for name, g in result["grads"].items()})
    return out


# The wire carries flat names: these two functions are the only place that spells a run and a quantity as one.
def _to_wire(valid: torch.Tensor, runs: dict[Run, dict[Quantity, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {"valid": valid}
    for run, tensors in runs.items():
        out.update({f"{run.value}/{q.kind}/{q.parameter or ''}": t for q, t in tensors.items()})
    return out


def _from_wire(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[Run, dict[Quantity, np.ndarray]]]:
    runs: dict[Run, dict[Quantity, np.ndarray]] = {}
    for key, value in arrays.items():
        if key == "valid":
            continue
        run, kind, parameter = key.split("/", 2)
        runs.setdefault(Run(run), {})[Quantity(kind, parameter or None)] = value
    return arrays["valid"], runs


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    error = None
    try:
        spec, model, batch = _prepare(case, ctx.device)
    except Exception as exc:  # noqa: BLE001 - reported by every rank of the case, naming this one
        error = exc
    _agree_ready(ctx, error)
    traits = model_specs.spec_traits(case["spec"])
    forward_only = traits.forward_only(ctx.device.type)
    backward = forward_only is None
    with standins.entered(traits.standins, ctx.device.type) as stood_in:  # the CP step (reference runs: below)
        cp = model_specs.step(spec, model, ctx.mesh, batch, backward=backward)
    if ctx.rank != 0:
        return {}, {}
    # the one-device runs: only stand-ins for kernels the device has no implementation of (reference_too)
    with standins.entered(traits.standins, ctx.device.type, reference=True):
        runs = {
            Run.CP: _quantities(cp),
            Run.REFERENCE: _quantities(model_specs.step(spec, model, None, batch, backward=backward)),
            Run.REORDERED: _quantities(
                model_specs.step(spec, model, None, batch, split=max(2, ctx.cp_size), reverse=True, backward=backward)
            ),
        }
    valid = spec.valid_positions(batch).to(torch.bool)
    info: dict[str, Any] = {"padded_len": None, "not_judged": {}, "standins": stood_in.used()}
    if forward_only is not None:
        count = sum(1 for p in model.parameters() if p.requires_grad)
        info["not_judged"][f"the gradients of all {count} parameters on {ctx.device.type}"] = forward_only
    arrays = {run: {q: _np(t) for q, t in tensors.items()} for run, tensors in runs.items()}
    if not all(r["ok"] for r in _judged(case, _np(valid), arrays).values()):
        runs.update(
            _explaining_runs(
                spec, model, batch, case["batch"]["kind"], ctx.cp_size, backward, info, (traits, ctx.device.type)
            )
        )
    return info, _to_wire(valid, runs)


def _explaining_runs(
    spec, model, batch: dict, kind: str, cp_size: int, backward: bool, info: dict, stand_ins: tuple = ((), "cpu")
) -> dict:
    """The one-device runs that may explain a failure without a CP defect (``EXPLANATIONS``), on rank 0:
    ``PADDED`` where the CP padded length exceeds the batch's, ``KERNELS`` where the spec has ``cp_kernels``
    and CP > 1, ``PADDED_KERNELS`` where both. Logits ``[B, S, V]`` (padded runs cut back to ``S``). Records
    ``padded_len``, ``kernels`` (what the spec's context names) and ``kernels_error`` (the kernel runs raised:
    not run) in ``info``. The kernel runs compute with the CP path's kernels, so they enter the spec's stand-ins
    (``stand_ins``: its traits and the device type) as the CP step does (FlexAttention's CPU backward for Kimi);
    the plain and padded runs never do."""
    seq_len = batch["input_ids"].shape[1]
    padded_len = _padded_length(spec, model, batch, cp_size, kind)
    padded_batch = spec.pad_batch(batch, padded_len) if padded_len is not None else None

    def one_device(inputs: dict, kernels: bool) -> dict[Quantity, torch.Tensor]:
        traits, device_type = stand_ins
        names = getattr(traits, "standins", ())
        with (
            standins.entered(names, device_type, reference=not kernels),
            spec.cp_kernels(model) if kernels else contextlib.nullcontext() as what,
        ):
            result = model_specs.step(spec, model, None, inputs, backward=backward)
        if kernels:
            info["kernels"] = str(what) if what else f"{spec.__name__}.cp_kernels"
        result["logits"] = result["logits"][:, :seq_len]
        return _quantities(result)

    out = {}
    if padded_batch is not None:
        out[Run.PADDED] = one_device(padded_batch, kernels=False)
        info["padded_len"] = padded_len
    if cp_size > 1 and hasattr(spec, "cp_kernels"):
        try:
            out[Run.KERNELS] = one_device(batch, kernels=True)
            if padded_batch is not None:
                out[Run.PADDED_KERNELS] = one_device(padded_batch, kernels=True)
        except Exception as exc:  # noqa: BLE001 - named in the report; the failure itself stands unexplained
            out.pop(Run.KERNELS, None)
            info["kernels_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.float().numpy() if t.dtype != torch.bool else t.numpy()


def _padded_length(spec, model, batch: dict, cp_size: int, kind: str) -> int | None:
    """The CP padded length of an unpacked batch (``None``: not padded, a packed batch, or no padding support)."""
    if (
        cp_size <= 1
        or kind == "packed"
        or batch.get("seq_lens") is not None
        or not all(hasattr(spec, f) for f in ("pad_batch", "cp_padded_length"))
    ):
        return None
    length = int(spec.cp_padded_length(model, batch["input_ids"].shape[1], cp_size))
    return length if length > batch["input_ids"].shape[1] else None


def _scale_floors(ref: dict[Quantity, np.ndarray]):
    """``floor(q)``: the least scale tensor ``q`` is judged at. A gradient is judged at no less than
    GRADIENT_SCALE_FLOOR of the case's largest gradient: one that is mathematically zero (a query path reaching
    one key) is computed as rounding noise of its terms, and judged against that noise alone any other rounding
    reads as 2^23 ULP (the miniature models use the family's scale)."""
    largest = max((float(np.abs(a).max()) for q, a in ref.items() if q.kind == "grad" and a.size), default=0.0)
    return lambda q: largest * GRADIENT_SCALE_FLOOR if q.kind == "grad" else 0.0


def _judged(
    case: dict, valid: np.ndarray, runs: dict[Run, dict[Quantity, np.ndarray]], against: Run = Run.REFERENCE
) -> dict[Quantity, dict]:
    """Every tensor of the CP run judged against the one-device run ``against`` (``REFERENCE``, or one of
    ``EXPLANATIONS``, whose spread is taken as the plain runs'). The reference spread of a tensor is the worst
    spread of its kind in the case (logits, loss, all parameter gradients): one small tensor's own spread can be
    zero by chance."""
    dtype = case["dtype"]
    ref, other = runs[Run.REFERENCE], runs[Run.REORDERED]
    floor = _scale_floors(ref)

    def mask(q: Quantity):
        return valid if q.kind == "logits" else None

    own = {
        q: model_specs.judge_tensor(other[q], ref[q], ref[q], dtype, C, FLOOR[dtype], mask(q), scale_floor=floor(q))
        for q in runs[Run.CP]
    }
    spread: dict[str, float] = {}
    for q, verdict in own.items():
        spread[q.kind] = max(spread.get(q.kind, 0.0), verdict["error"])
    return {
        q: model_specs.judge_tensor(
            runs[Run.CP][q],
            runs[against][q],
            other[q],
            dtype,
            C,
            FLOOR[dtype],
            mask(q),
            spread[q.kind],
            scale_floor=floor(q),
        )
        for q in runs[Run.CP]
    }


def _where(q: Quantity, index: tuple) -> str:
    if q.kind == "logits" and len(index) == 3:
        return f"row {index[0]}, position {index[1]}, vocabulary entry {index[2]}"
    if q.kind == "grad":
        return f"parameter {q.parameter}, element {list(index)}"
    return f"index {list(index)}"


def _comparison(q: Quantity, verdict: dict, shape: tuple, dtype: str, label: str) -> UlpComparison:
    gradient = q.kind == "grad"
    if "shape_problem" in verdict:
        return UlpComparison(
            q.label,
            dtype,
            shape,
            max_ulp=float("nan"),
            max_abs=float("nan"),
            gradient=gradient,
            problem=verdict["shape_problem"],
        )
    size = int(np.prod(shape)) if shape else 1
    comparison = UlpComparison(
        f"{q.label} ({label})",
        dtype,
        shape,
        compared=size,
        max_ulp=verdict["error"],
        max_abs=verdict["max_abs"],
        gradient=gradient,
        worst_index=verdict["worst_index"],
        worst_actual=verdict["worst_actual"],
        worst_expected=verdict["worst_expected"],
        ulp_dtype=dtype,
        scale=verdict["scale"],
        excess=ExcessVerdict(
            error=verdict["error"],
            baseline=verdict["spread"],
            excess=verdict["error"] / (verdict["spread"] + FLOOR[dtype] / C),
            limit=C,
            floor=FLOOR[dtype],
            mismatched=verdict["above"],
        ),
    )
    if not verdict["ok"]:
        comparison.problem = (
            f"[{dtype}, shape {list(shape)}] CP error {verdict['error']:.3g} ULP > bound {verdict['bound']:.3g} ULP "
            f"(= {C:g} x reference spread {verdict['spread']:.3g} (worst of its kind in this case) + floor {FLOOR[dtype]:g}; ULPs of {dtype} at the "
            f"tensor's largest value {verdict['scale']:.3g}); {verdict['above']} elements above the bound; worst at "
            f"{_where(q, verdict['worst_index'])}: CP {verdict['worst_actual']!r}, one device "
            f"{verdict['worst_expected']!r} ({verdict['max_abs']:.3g} absolute)"
        )
    return comparison


def _explained(
    case: dict, valid: np.ndarray, runs: dict[Run, dict[Quantity, np.ndarray]], judged: dict, failing: list[Quantity]
) -> tuple[dict[Quantity, Run], dict[Run, dict[Quantity, dict]]]:
    """``({failing tensor: the explanation run}, {explanation run: every CP tensor judged against it})``. A
    run explains a tensor when CP matches it within the bound and it differs from the plain one-device run by
    more than the bound (so a run that changes nothing explains nothing); the first of ``EXPLANATIONS`` that
    does is taken."""
    dtype = case["dtype"]
    against = {run: _judged(case, valid, runs, against=run) for run in EXPLANATIONS if run in runs}
    explained: dict[Quantity, Run] = {}
    floor = _scale_floors(runs[Run.REFERENCE])
    for q in failing:
        for run, verdicts in against.items():  # the run against the plain one, judged as CP is
            moved = model_specs.judge_tensor(
                runs[run][q],
                runs[Run.REFERENCE][q],
                runs[Run.REORDERED][q],
                dtype,
                C,
                FLOOR[dtype],
                valid if q.kind == "logits" else None,
                judged[q]["spread"],
                scale_floor=floor(q),
            )
            if verdicts[q]["ok"] and not moved["ok"]:
                explained[q] = run
                break
    return explained, against


def _explanation(case: dict, run: Run, tensors: list[Quantity], judged: dict, info: dict) -> tuple[str, ProblemKind]:
    """``(problem line, kind)`` for the tensors ``run`` explains."""
    dtype, padded_len, kernels = case["dtype"], info.get("padded_len"), info.get("kernels")
    worst = max(tensors, key=lambda q: judged[q]["error"])
    names = ", ".join(sorted(q.label for q in tensors))
    where = f"worst: {worst.label} at {_where(worst, judged[worst]['worst_index'])}"
    padded = run is not Run.KERNELS
    given = (case["spec"], dtype, int(case.get("seed", 0)), case.get("overrides") or {}, case["batch"])
    if run is Run.PADDED:
        assert padded_len is not None  # the padded run records the length it padded to
        command = model_specs.padding_repro_command(*given, padded_len)
    else:
        command = model_specs.kernel_repro_command(*given, padded_len if padded else None)
    if run is Run.PADDED:
        return (
            f"PADDING SENSITIVITY, not a CP failure: padding changes this model's result on one rank. Appending "
            f"masked pad tokens up to the CP padded length {padded_len} changes {names} on one device by as much "
            f"as CP does ({where}), and CP matches that padded one-device run. One-process repro (no ranks): "
            f"{command}",
            ProblemKind.PADDING_SENSITIVITY,
        )
    if run is Run.KERNELS:
        return (
            f"KERNEL SENSITIVITY, not a CP failure: the CP path's kernels ({kernels}) round differently from "
            f"the one-device path's by as much as CP differs. On one device, without CP, under the spec's "
            f"cp_kernels, {names} move by as much as CP does ({where}), and CP matches that one-device run. "
            f"One-process repro (no ranks): {command}",
            ProblemKind.KERNEL_SENSITIVITY,
        )
    return (
        f"PADDING AND KERNEL SENSITIVITY, not a CP failure: padding changes this model's result on one rank and "
        f"the CP path's kernels ({kernels}) round differently from the one-device path's; neither alone, but "
        f"the two together (one device, the batch padded to the CP padded length {padded_len}, under the spec's "
        f"cp_kernels) change {names} by as much as CP does ({where}), and CP matches that run. One-process "
        f"repro (no ranks): {command}",
        ProblemKind.PADDING_AND_KERNEL_SENSITIVITY,
    )


_AGAINST = {
    Run.PADDED: "CP vs one device padded to {padded_len}",
    Run.KERNELS: "CP vs one device with the CP path's kernels",
    Run.PADDED_KERNELS: "CP vs one device padded to {padded_len} with the CP path's kernels",
}


def _evaluate(case: dict, outputs: list) -> CaseReport:
    info = outputs[0].info
    report = CaseReport(case=case, not_judged=dict(info.get("not_judged", {})), standins=dict(info.get("standins", {})))
    valid, runs = _from_wire(outputs[0].tensors)
    dtype = case["dtype"]
    judged = _judged(case, valid, runs)
    failing = [q for q, v in judged.items() if not v["ok"]]
    explained, against = _explained(case, valid, runs, judged, failing) if failing else ({}, {})
    # which explanation runs ran, and the tensors each explains (none: the failure stands as a CP failure)
    if against:
        report.info["explanations"] = {
            run.value: sorted(q.label for q, r in explained.items() if r is run) for run in against
        }
    for run in EXPLANATIONS:
        tensors = [q for q in failing if explained.get(q) is run]
        if tensors:
            text, kind = _explanation(case, run, tensors, judged, info)
            report.problem(text, kind=kind)
    if failing and info.get("kernels_error"):
        report.problem(
            f"the kernel-sensitivity run (one device under {case['spec']}.cp_kernels) raised "
            f"{info['kernels_error']}; the failure is not told apart from a CP failure",
            kind=ProblemKind.CONTRACT,
        )
    for q, verdict in judged.items():
        shape = tuple(runs[Run.CP][q].shape)
        explaining = explained.get(q)
        if explaining is not None:
            label = _AGAINST[explaining].format(padded_len=info.get("padded_len"))
            report.add(_comparison(q, against[explaining][q], shape, dtype, label))
        else:
            report.add(_comparison(q, verdict, shape, dtype, "CP vs one device"))
    return report


def _space_models(space) -> tuple[str, ...]:
    models = getattr(space, "models", ()) if space is not None else ()
    return models or current_space().models


def _runnable(models: tuple[str, ...], dtype: str) -> tuple[list[str], dict[str, str]]:
    """``(specs that can run a ``dtype`` case here, {spec: why not} for the others)``."""
    runnable, skipped = [], {}
    for name in models:
        traits = model_specs.spec_traits(name)
        unmet = traits.unmet()
        if unmet:
            skipped[name] = "; ".join(f"needs {key}: {why}" for key, why in unmet.items())
        elif dtype not in traits.dtypes:
            skipped[name] = f"declares DTYPES {list(traits.dtypes)}, not {dtype}"
        else:
            runnable.append(name)
    return runnable, skipped


def _skip_reason(dtype: str):
    def reason(space) -> str | None:
        models = _space_models(as_space(space))
        if not models:
            return None  # the strategy says what is missing
        runnable, skipped = _runnable(models, dtype)
        return None if runnable else "; ".join(f"{name}: {why}" for name, why in skipped.items())

    return reason


def real_model_cases(dtype: str):
    @st.composite
    def cases(draw, space=None) -> dict:
        space = as_space(space)
        models = _space_models(space)
        if not models:
            raise ValueError("no model spec given: pass --model MODULE (verify) or --cp-model MODULE (pytest)")
        runnable, _ = _runnable(models, dtype)
        spec = draw(st.sampled_from(runnable)) if runnable else draw(st.nothing())
        traits = model_specs.spec_traits(spec)
        batch = draw(_batches(traits.batch_kinds, traits.rows_for))
        sizes = (space if space is not None else current_space()).size_draws  # the profile's weights
        allowed = [n for n in sizes if traits.world_sizes is None or n in traits.world_sizes]
        size = draw(st.sampled_from(allowed)) if allowed else draw(st.nothing())
        return {"check": "real_model", "spec": spec, "dtype": dtype, "seed": 0, "batch": batch, "world_size": size}

    return cases


def smoke_cases(spec: str) -> list[dict]:
    """Named cases at CP 2 and 3 in both dtypes: packed (several documents, single-token documents, one document
    crossing every shard boundary), right padding, lengths not divisible by ``2N`` (the default command's smoke)."""
    batches = [
        {"kind": "packed", "seq_len": 19, "documents": [[7, 5, 6]], "seed": 1},
        {"kind": "packed", "seq_len": 23, "batch_size": 2, "documents": [[1, 9, 6, 5], [13, 1, 8]], "seed": 2},
        {"kind": "packed", "seq_len": 21, "documents": [[21]], "seed": 3},
        {"kind": "right_padded", "seq_len": 17, "pad": 4, "batch_size": 2, "seed": 4},
        {"kind": "plain", "seq_len": 13, "seed": 5},
        {"kind": "plain", "seq_len": 19, "seed": 6},
    ]
    out = []
    for i, batch in enumerate(batches):
        for n in (2, 3):
            dtype = "float32" if (i + n) % 2 else "bfloat16"
            out.append(
                {"check": "real_model", "spec": spec, "dtype": dtype, "seed": 0, "batch": batch, "world_size": n}
            )
    return out


REAL_MODEL = register(
    "real_model",
    rank=_rank,
    evaluate=_evaluate,
    rows=tuple(
        VerifyRow(
            f"real model ({dtype})",
            real_model_cases(dtype),
            (),
            dtypes=(dtype,),
            position=20 + i,
            needs_model=True,
            id=f"real_model.{dtype}",
            skip=_skip_reason(dtype),
        )
        for i, dtype in enumerate(("float32", "bfloat16"))
    ),
    gate_share=0.0,
    repro=Repro(plan=lambda request: repro_real_model.plan(request, C, FLOOR)),
)
