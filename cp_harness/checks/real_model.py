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

Case keys: ``spec`` (module path of a model spec), ``dtype`` (``float32``, ``bfloat16``), ``seed`` (model
weights), ``overrides`` (optional config fields), ``batch`` (``kind``, ``seq_len`` and ``spec.make_batch``'s
keywords: ``batch_size``, ``seed``, ``documents``, ``pad``), ``world_size``.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import torch
from hypothesis import strategies as st

from cp_harness.cases.profiles import current_space
from cp_harness.cases.strategies import as_space
from cp_harness.checks import Repro, VerifyRow, register
from cp_harness.judging.compare import ExcessVerdict, UlpComparison
from cp_harness.judging.verdicts import CaseReport
from cp_harness.repro import real_model as repro_real_model
from cp_harness.usage import model_specs, spec_contract

C = 4.0
FLOOR = {"float32": 1024.0, "bfloat16": 8.0}  # ULPs of the dtype at the tensor's largest value (docs/real_models.md)


def _prepare(case: dict):
    spec = model_specs.load_spec(case["spec"])
    model = model_specs.cached_model(case["spec"], case["dtype"], int(case.get("seed", 0)), case.get("overrides"))
    return spec, model, model_specs.make_batch(spec, case["batch"])


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
        raise RuntimeError(f"building the model or batch failed on rank(s) {sorted(failed)} ({named}); "
                           f"rank {ctx.rank} did not run the case") from error


class Run(enum.Enum):
    """The runs a case compares, all on rank 0 but ``CP`` (every rank's result, summed and gathered):
    ``REFERENCE`` one device plainly, ``REORDERED`` one device under a neutral change of reduction order (the
    spread), ``PADDED`` one device on the batch right-padded to the CP padded length (padding sensitivity)."""

    CP = "cp"
    REFERENCE = "ref"
    REORDERED = "other"
    PADDED = "padded"


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
        spec, model, batch = _prepare(case)
    except Exception as exc:  # noqa: BLE001 - reported by every rank of the case, naming this one
        error = exc
    _agree_ready(ctx, error)
    forward_only = model_specs.spec_traits(case["spec"]).forward_only(ctx.device.type)
    backward = forward_only is None
    cp = model_specs.step(spec, model, ctx.mesh, batch, backward=backward)
    if ctx.rank != 0:
        return {}, {}
    runs = {Run.CP: _quantities(cp),
            Run.REFERENCE: _quantities(model_specs.step(spec, model, None, batch, backward=backward)),
            Run.REORDERED: _quantities(model_specs.step(spec, model, None, batch, split=max(2, ctx.cp_size),
                                                        reverse=True, backward=backward))}
    valid = spec.valid_positions(batch).to(torch.bool)
    info = {"padded_len": None, "not_judged": {}}
    if forward_only is not None:
        count = sum(1 for p in model.parameters() if p.requires_grad)
        info["not_judged"][f"the gradients of all {count} parameters on {ctx.device.type}"] = forward_only
    arrays = {run: {q: _np(t) for q, t in tensors.items()} for run, tensors in runs.items()}
    if not all(r["ok"] for r in _judged(case, _np(valid), arrays).values()):
        padded_len = _padded_length(spec, model, batch, ctx.cp_size)
        if padded_len is not None:
            seq_len = batch["input_ids"].shape[1]
            padded = model_specs.step(spec, model, None, spec.pad_batch(batch, padded_len), backward=backward)
            padded["logits"] = padded["logits"][:, :seq_len]
            runs[Run.PADDED] = _quantities(padded)
            info["padded_len"] = padded_len
    return info, _to_wire(valid, runs)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.float().numpy() if t.dtype != torch.bool else t.numpy()


def _padded_length(spec, model, batch: dict, cp_size: int) -> int | None:
    if cp_size <= 1 or batch.get("seq_lens") is not None or not all(
            hasattr(spec, f) for f in ("pad_batch", "cp_padded_length")):
        return None
    length = int(spec.cp_padded_length(model, batch["input_ids"].shape[1], cp_size))
    return length if length > batch["input_ids"].shape[1] else None


def _judged(case: dict, valid: np.ndarray, runs: dict[Run, dict[Quantity, np.ndarray]],
            against: Run = Run.REFERENCE) -> dict[Quantity, dict]:
    """Every tensor of the CP run judged against the one-device run ``against`` (``REFERENCE``, or ``PADDED``
    whose spread is taken as the unpadded runs'). The reference spread of a tensor is the worst spread of its
    kind in the case (logits, loss, all parameter gradients): one small tensor's own spread can be zero by
    chance."""
    dtype = case["dtype"]
    ref, other = runs[Run.REFERENCE], runs[Run.REORDERED]

    def mask(q: Quantity):
        return valid if q.kind == "logits" else None

    own = {q: model_specs.judge_tensor(other[q], ref[q], ref[q], dtype, C, FLOOR[dtype], mask(q)) for q in runs[Run.CP]}
    spread: dict[str, float] = {}
    for q, verdict in own.items():
        spread[q.kind] = max(spread.get(q.kind, 0.0), verdict["error"])
    return {q: model_specs.judge_tensor(runs[Run.CP][q], runs[against][q], other[q], dtype, C, FLOOR[dtype], mask(q),
                                        spread[q.kind])
            for q in runs[Run.CP]}


def _where(q: Quantity, index: tuple) -> str:
    if q.kind == "logits" and len(index) == 3:
        return f"row {index[0]}, position {index[1]}, vocabulary entry {index[2]}"
    if q.kind == "grad":
        return f"parameter {q.parameter}, element {list(index)}"
    return f"index {list(index)}"


def _comparison(q: Quantity, verdict: dict, shape: tuple, dtype: str, label: str) -> UlpComparison:
    gradient = q.kind == "grad"
    if "shape_problem" in verdict:
        return UlpComparison(q.label, dtype, shape, max_ulp=float("nan"), max_abs=float("nan"), gradient=gradient,
                             problem=verdict["shape_problem"])
    size = int(np.prod(shape)) if shape else 1
    comparison = UlpComparison(
        f"{q.label} ({label})", dtype, shape, compared=size, max_ulp=verdict["error"], max_abs=verdict["max_abs"],
        gradient=gradient, worst_index=verdict["worst_index"], worst_actual=verdict["worst_actual"],
        worst_expected=verdict["worst_expected"], ulp_dtype=dtype, scale=verdict["scale"],
        excess=ExcessVerdict(error=verdict["error"], baseline=verdict["spread"],
                             excess=verdict["error"] / (verdict["spread"] + FLOOR[dtype] / C), limit=C,
                             floor=FLOOR[dtype], mismatched=verdict["above"]))
    if not verdict["ok"]:
        comparison.problem = (
            f"[{dtype}, shape {list(shape)}] CP error {verdict['error']:.3g} ULP > bound {verdict['bound']:.3g} ULP "
            f"(= {C:g} x reference spread {verdict['spread']:.3g} (worst of its kind in this case) + floor {FLOOR[dtype]:g}; ULPs of {dtype} at the "
            f"tensor's largest value {verdict['scale']:.3g}); {verdict['above']} elements above the bound; worst at "
            f"{_where(q, verdict['worst_index'])}: CP {verdict['worst_actual']!r}, one device "
            f"{verdict['worst_expected']!r} ({verdict['max_abs']:.3g} absolute)")
    return comparison


def _evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case, not_judged=dict(outputs[0].info.get("not_judged", {})))
    valid, runs = _from_wire(outputs[0].tensors)
    dtype = case["dtype"]
    judged = _judged(case, valid, runs)
    failing = [q for q, v in judged.items() if not v["ok"]]
    padded_len = outputs[0].info.get("padded_len")
    explained: set[Quantity] = set()
    if failing and padded_len:
        against = _judged(case, valid, runs, against=Run.PADDED)
        for q in failing:
            moved = model_specs.judge_tensor(runs[Run.PADDED][q], runs[Run.REFERENCE][q], runs[Run.REORDERED][q],
                                             dtype, C, FLOOR[dtype], valid if q.kind == "logits" else None,
                                             judged[q]["spread"])
            if against[q]["ok"] and not moved["ok"]:
                explained.add(q)
        if explained:
            command = model_specs.padding_repro_command(case["spec"], dtype, int(case.get("seed", 0)),
                                                        case.get("overrides") or {}, case["batch"], padded_len)
            worst = max(explained, key=lambda q: judged[q]["error"])
            report.problem(
                f"PADDING SENSITIVITY, not a CP failure: padding changes this model's result on one rank. Appending "
                f"masked pad tokens up to the CP padded length {padded_len} changes "
                f"{', '.join(sorted(q.label for q in explained))} "
                f"on one device by as much as CP does (worst: {worst.label} at {_where(worst, judged[worst]['worst_index'])}),"
                f" and CP matches that padded one-device run. One-process repro (no ranks): {command}",
                kind="padding sensitivity")
    for q, verdict in judged.items():
        shape = tuple(runs[Run.CP][q].shape)
        if q in explained:
            report.add(_comparison(q, against[q], shape, dtype, f"CP vs one device padded to {padded_len}"))
        else:
            report.add(_comparison(q, verdict, shape, dtype, "CP vs one device"))
    return report


@st.composite
def _batches(draw, kinds: tuple[str, ...] = spec_contract.BATCH_KINDS) -> dict:
    kind = draw(st.sampled_from(kinds))
    seq_len = draw(st.integers(2, 24))
    rows = draw(st.integers(1, 2))
    batch = {"kind": kind, "seq_len": seq_len, "batch_size": rows, "seed": draw(st.integers(0, 999))}
    if kind == "right_padded":
        batch["pad"] = draw(st.integers(1, seq_len - 2)) if seq_len >= 3 else 0
        if batch["pad"] == 0:
            if "plain" not in kinds:
                batch["seq_len"], batch["pad"] = 3, 1
            else:
                batch["kind"] = "plain"
                del batch["pad"]
    elif kind == "packed":
        documents = []
        for _ in range(rows):
            lengths, left = [], seq_len
            while left > 0 and len(lengths) < 5:
                length = draw(st.integers(1, left))  # single-token documents included
                lengths.append(length)
                left -= length
                if draw(st.booleans()):
                    break
            if max(lengths) < 2:  # every row needs a label
                lengths[0] += 1 if sum(lengths) < seq_len else 0
            documents.append(lengths)
        if all(max(d) < 2 for d in documents):
            documents[0] = [seq_len]  # one document crossing every shard boundary
        batch["documents"] = documents
    return batch


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
        batch = draw(_batches(traits.batch_kinds))
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
            out.append({"check": "real_model", "spec": spec, "dtype": dtype, "seed": 0, "batch": batch,
                        "world_size": n})
    return out


REAL_MODEL = register(
    "real_model", rank=_rank, evaluate=_evaluate,
    rows=tuple(VerifyRow(f"real model ({dtype})", real_model_cases(dtype), (), dtypes=(dtype,), position=20 + i,
                         needs_model=True, id=f"real_model.{dtype}", skip=_skip_reason(dtype))
               for i, dtype in enumerate(("float32", "bfloat16"))),
    gate_share=0.0, repro=Repro(plan=lambda request: repro_real_model.plan(request, C, FLOOR)))
