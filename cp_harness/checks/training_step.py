"""Check ``training_step``: one training step of a real model as the framework's recipe runs it at CP > 1, with a
data-parallel dimension (``dp_shard x cp = 2 x 2`` on 4 ranks), against one device on the whole global batch.

The ranks run a *step driver* (case key ``driver``, default ``examples.automodel.training.train_ft_step``: the framework's
mesh with ``dp_shard_cp`` flattened, its parallelizer (FSDP2 over ``dp_shard_cp``), the spec's CP ``shard``, the
recipe's label count summed over ``dp`` and its loss scaling, backward, the clip-grad helper) and hand back what the
optimizer sees: each parameter's gradient (its FSDP2 shards gathered whole), the gradient norm the recipe clips
with, the reported loss, and the logits (gathered over CP, then over dp). Each dp rank holds its own rows of the
global batch (``dp rank d``: rows ``d*r .. (d+1)*r - 1``), so the rows' label counts differ between dp ranks.

The reference is the one-device step of the real-model check (``model_specs.step`` on rank 0 with the same spec
model, unsharded, on all rows: loss = summed cross entropy / the global label count), plainly and reordered (the
spread), and the one-device gradient norm ``sqrt(sum of squared gradients)``. Every tensor is judged exactly as
``real_model`` judges it (``C x spread + FLOOR``, normwise ULPs of the model dtype, its ``_judged`` and
``_comparison``); the gradient norm is one more quantity with a spread of its own kind. No explanation runs
(padding, kernels) are made here: a failure is a failure of the step.

Case keys: those of ``real_model`` (``spec``, ``dtype``, ``seed``, ``overrides``, ``batch``: ``batch_size`` is the
*global* row count) and ``world_size`` (= ``dp_shard x cp``), ``dp_shard``, ``cp``, ``driver`` (a module with
``mesh_context(dp_shard, cp)``, ``parallelized(spec, dtype, seed, context, **overrides)``, ``STEP.run(...)`` and
``STAND_IN``; a defect fixture is another driver).
"""

from __future__ import annotations

import importlib

import torch
from hypothesis import strategies as st

from cp_harness import standins
from cp_harness.cases.profiles import current_space
from cp_harness.cases.strategies import as_space
from cp_harness.checks import VerifyRow, register
from cp_harness.checks import real_model as rm
from cp_harness.checks._readiness import refusal, report_refusal
from cp_harness.judging.verdicts import CaseReport
from cp_harness.usage import model_specs

DRIVER = "examples.automodel.training.train_ft_step"
DP_SHARD, CP = 2, 2
NORM = rm.Quantity("grad_norm")
# Both dtypes. A spec runs those of its TRAINING_DTYPES (default both: glm_moe_dsa's TileLang CP path is bfloat16 only);
# a spec whose bfloat16 step cannot run, or is not diagnosed, is skipped naming why (DTYPE_UNSUPPORTED).
STEP_DTYPES = ("float32", "bfloat16")
_FSDP_MODELS: dict[tuple, torch.nn.Module] = {}


def _sizes(case: dict) -> tuple[int, int, int]:
    """``(dp_shard, cp, rows per dp rank)``; a case that cannot run (sizes, rows, an unknown ``loss``) raises naming
    the field and the fix."""
    dp, cp = int(case.get("dp_shard", DP_SHARD)), int(case.get("cp", CP))
    if dp < 1 or cp < 2:
        raise ValueError(f"training_step case: dp_shard={dp}, cp={cp}; give dp_shard >= 1 and cp >= 2")
    if int(case.get("world_size", 0)) != dp * cp:
        raise ValueError(
            f"training_step case: world_size={case.get('world_size')} but dp_shard x cp = {dp} x {cp}; "
            f"give world_size {dp * cp}"
        )
    loss = case.get("loss", "masked")
    if loss not in LOSSES:
        raise ValueError(f"training_step case: loss={loss!r}; give one of {list(LOSSES)}")
    rows = int(case["batch"].get("batch_size", 1))
    if rows % dp:
        raise ValueError(
            f"training_step case: batch.batch_size={rows} (the global rows) is not a multiple of "
            f"dp_shard={dp}; give {dp} x the rows per dp rank"
        )
    return dp, cp, rows // dp


def _fsdp_model(driver, spec, case: dict, context) -> torch.nn.Module:
    model_specs.one_spec_at_a_time(case["spec"])
    key = (
        case.get("driver", DRIVER),
        case["spec"],
        case["dtype"],
        int(case.get("seed", 0)),
        tuple(sorted((case.get("overrides") or {}).items())),
        id(context),
    )
    if key not in _FSDP_MODELS:
        _FSDP_MODELS[key] = driver.parallelized(
            spec, model_specs.DTYPES[case["dtype"]], int(case.get("seed", 0)), context, **(case.get("overrides") or {})
        )
    return _FSDP_MODELS[key]


LOSSES = ("masked", "linear_ce", "mtp")
LOSS_LABELS = {"masked": "", "linear_ce": ", linear CE", "mtp": ", MTP"}
LINEAR_CE_LOGITS = (
    "the recipe's linear-CE step runs the model with logits_to_keep=1 and computes the loss from the final hidden "
    "states and the gathered LM head: no logits exist to judge (the loss, every gradient and the norm are judged)"
)


def _with_norm(result: dict) -> dict[rm.Quantity, torch.Tensor]:
    if "logits" not in result:
        result = {**result, "logits": torch.zeros(0)}
        out = rm._quantities(result)
        out.pop(rm.Quantity("logits"))
    else:
        out = rm._quantities(result)
    if "grad_norm" in result:
        out[NORM] = result["grad_norm"].double()
    else:  # one device: the 2-norm over every parameter's gradient, in float64
        out[NORM] = torch.sqrt(sum((g.double() ** 2).sum() for g in result["grads"].values()))
    return out


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    error, image_counts = None, None
    try:
        dp, cp, rows = _sizes(case)
        if ctx.cp_size != dp * cp or torch.distributed.get_world_size() != dp * cp:
            raise ValueError(
                f"training_step case: the framework's mesh covers the whole default group, but the "
                f"pool has {torch.distributed.get_world_size()} ranks and the case {ctx.cp_size}; "
                f"start the pool with --world-sizes {dp * cp}"
            )
        driver = importlib.import_module(case.get("driver", DRIVER))
        spec, reference_model, batch = rm._prepare(case, ctx.device)
        image_counts = _media_on_every_dp_rank(spec, batch, dp, rows)
        context = driver.mesh_context(dp, cp)
        model = _fsdp_model(driver, spec, case, context)
    except Exception as exc:  # noqa: BLE001 - reported by every rank of the case, naming this one
        error = exc
    refused = refusal(ctx, error)  # every rank, before any collective of the step: an answer, not a raise
    if refused is not None:
        return refused, {}
    loss = case.get("loss", "masked")
    names = model_specs.spec_traits(case["spec"]).standins
    # the spec's kernel stand-ins around the step, as the real-model check enters them (docs/standins.md)
    with standins.entered(names, ctx.device.type) as stood_in:
        step = driver.STEP.run(spec, model, context, batch, rows, **({"loss": loss} if loss != "masked" else {}))
    if ctx.rank != 0:
        return {}, {}
    mtp = getattr(driver, "one_device_mtp_step", None) if loss == "mtp" else None
    with standins.entered(names, ctx.device.type, reference=True):  # only kernels the device has none of
        runs = {
            rm.Run.CP: _with_norm(step),
            rm.Run.REFERENCE: _with_norm(one_device(spec, reference_model, batch, dp, mtp=mtp)),
            rm.Run.REORDERED: _with_norm(
                one_device(spec, reference_model, batch, dp, split=max(2, cp), reverse=True, mtp=mtp)
            ),
        }
    valid = spec.valid_positions(batch).to(torch.bool)
    not_judged = (
        {"torch's gloo backward of torch.distributed.nn.functional.all_gather": driver.STAND_IN}
        if ctx.backend == "gloo"
        else {}
    )
    if loss == "mtp":
        not_judged.update(getattr(driver, "MTP_STAND_INS", {}))
    if "logits" not in step:  # the linear-CE path never materialises them (logits_to_keep=1)
        for run in (rm.Run.REFERENCE, rm.Run.REORDERED):
            runs[run].pop(rm.Quantity("logits"))
        not_judged["logits"] = LINEAR_CE_LOGITS
    info = {
        "not_judged": not_judged,
        "dp_label_counts": _label_counts(batch, dp),
        "dp_image_counts": image_counts,
        "loss": loss,
        "standins": stood_in.used(),
    }
    return info, rm._to_wire(valid, runs)


def one_device(
    spec, model, batch: dict, micro_batches: int, *, split: int = 1, reverse: bool = False, mtp=None
) -> dict:
    """The recipe's step on one device over the same global batch: ``micro_batches`` gradient-accumulation
    micro-batches (the dp ranks' rows, in dp order; reversed with ``reverse``), each ``model_specs.step`` with the
    loss divided by the *global* label count (``_run_train_optim_step`` counts all micro-batches first), gradients
    summed, logits in row order, losses summed. The MoE auxiliary-loss scale is the recipe's ``cp / micro-batches``
    = ``1 / micro_batches`` (restored after): a router's load-balancing loss is a per-micro-batch statistic in the
    framework (``Gate._compute_aux_loss``: "assumes batch size = 1"), so one device on all rows at once would be
    another objective than data parallelism computes; the main loss is the same either way. ``mtp`` (MTP cases:
    the driver's ``one_device_mtp_step(spec, model, part, count, reverse=...)``, the recipe's CP-1 MTP step) runs
    each micro-batch instead of ``model_specs.step``; its spread is the reversed row and micro-batch order only (no
    chunked backward). A batch with media (a VLM's ``pixel_values [P, C]``, ``image_grid_thw [I, 3]``, flat over the
    images) is cut into micro-batches with their own images (``model_specs.select_rows``), as the dp ranks' rows are."""
    from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler

    count = spec.num_label_tokens(batch)
    n = batch["input_ids"].shape[0]
    rows = n // micro_batches
    parts = {}
    previous = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0 / micro_batches)
    try:
        order = range(micro_batches)[::-1] if reverse else range(micro_batches)
        for d in order:
            # the dp rank's rows with their images (model_specs.select_rows: the spec's reorder_rows for media)
            part = model_specs.select_rows(spec, batch, range(d * rows, (d + 1) * rows))
            if mtp is not None:
                parts[d] = mtp(spec, model, part, count, reverse=reverse)
            else:
                parts[d] = model_specs.step(
                    spec, model, None, part, split=split, reverse=reverse, num_label_tokens=count
                )
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = previous
    grads: dict = {}
    for d in order:
        for name, grad in parts[d]["grads"].items():
            grads[name] = grad.float() if name not in grads else grads[name] + grad.float()
    dtypes = {name: g.dtype for name, g in parts[0]["grads"].items()}
    loss = sum((parts[d]["loss"] for d in order), torch.zeros(()))
    logits = torch.cat([parts[d]["logits"] for d in range(micro_batches)], dim=0)
    return {"logits": logits, "loss": loss, "grads": {k: v.to(dtypes[k]) for k, v in grads.items()}}


def _image_counts(batch: dict, spec, dp: int, rows: int) -> list[int] | None:
    """Images per dp rank (``image_grid_thw`` rows of its ``select_rows`` batch), ``None`` for a batch without media."""
    if batch.get("image_grid_thw") is None:
        return None
    parts = [model_specs.select_rows(spec, batch, range(d * rows, (d + 1) * rows)) for d in range(dp)]
    return [0 if p.get("image_grid_thw") is None else int(p["image_grid_thw"].shape[0]) for p in parts]


def _media_on_every_dp_rank(spec, batch: dict, dp: int, rows: int) -> list[int] | None:
    """Raises (on every rank, before any collective) when the batch carries images but a dp rank's rows hold none:
    that rank would skip the vision tower, and with it the FSDP2 all-gathers of its units, which the other dp rank's
    ranks run (measured on gloo: the step aborts with 'Received data size doesn't match expected size'). The
    framework's VLM datasets avoid it with a fake image in every text-only sample (``inject_fake_images``). Returns
    the images per dp rank (``_image_counts``), which the rank reports."""
    counts = _image_counts(batch, spec, dp, rows)
    if counts is not None and 0 in counts:
        raise ValueError(
            f"training_step case: dp rank {counts.index(0)}'s rows hold no image (batch.images; images per dp rank "
            f"{counts}): under FSDP2 its vision-tower units would skip the all-gathers the other ranks run; give "
            "batch.fake_images true (the framework's data path: a masked fake image in each text-only row) or an "
            "image in that rank's rows"
        )
    return counts


def _label_counts(batch: dict, dp: int) -> list[int]:
    labels = batch["labels"]
    return [int((part != -100).sum()) for part in labels.chunk(dp, dim=0)]


def _evaluate(case: dict, outputs: list) -> CaseReport:
    info = outputs[0].info
    report = CaseReport(case=case, not_judged=dict(info.get("not_judged", {})), standins=dict(info.get("standins", {})))
    if report_refusal(report, outputs):
        return report
    report.info["dp_label_counts"] = info.get("dp_label_counts")
    if info.get("dp_image_counts") is not None:
        report.info["dp_image_counts"] = info["dp_image_counts"]
    report.info["loss"] = info.get("loss", "masked")
    valid, runs = rm._from_wire(outputs[0].tensors)
    for q, verdict in rm._judged(case, valid, runs).items():
        label = "training step on dp_shard x cp vs one device"
        report.add(rm._comparison(q, verdict, tuple(runs[rm.Run.CP][q].shape), case["dtype"], label))
    return report


# Specs the linear-CE rows leave out, with what was measured (docs/training_step.md).
LINEAR_CE_UNSUPPORTED = {
    "deepseek_v41": "the recipe's linear-CE call cannot train it: model(..., output_hidden_states=True) returns the "
    "hyper-connection streams [B, S, hc, H], not the final hidden states, and calculate_loss raises 'ValueError: "
    "hidden_states token dimensions must match labels.shape' (one device, no CP: "
    "examples/automodel/repro/models/deepseek_v41_linear_ce_hidden_states.py)",
    "deepseek_v4": "packed (THD) batches fail at dp_shard x cp = 2 x 2 with linear CE (loss 3.3e3 ULP, layer 0's "
    "gradients up to 1.5e6 ULP) while unpacked ones pass and one device's linear CE equals MaskedCrossEntropy "
    "exactly; not diagnosed yet, so not called a finding",
}


# Specs with an MTP head in the framework whose MTP rows do not run, with why (docs/training_step.md, MTP). A spec
# runs MTP when it declares MTP_OVERRIDES (the framework's config field that turns the head on).
DTYPE_UNSUPPORTED = {
    ("deepseek_v41", "bfloat16"): "the spec's bfloat16 build keeps 46 of its 140 trainable parameters in float32 (LM "
    "head, hyper-connections, sinks, compressors) inside the bfloat16 decoder layers, and FSDP2 refuses a unit of mixed "
    "original dtypes at the first forward ('AssertionError: FSDP expects uniform original parameter dtype but got "
    "{torch.bfloat16, torch.float32}', measured); the framework's float32-master / param_dtype=bfloat16 recipe has no "
    "one-device reference of the same computation yet",
    ("deepseek_v4", "bfloat16"): "bfloat16 fails on the hyper-connection gradients only (attn_hc.base / attn_hc.scale, "
    "up to 26 ULP against a bound of 8 with a reference spread of 0, on a plain 2 x 2-token batch; logits, loss and "
    "every other gradient pass); not diagnosed yet (per-rank bfloat16 partial gradients reduced by FSDP2 against one "
    "device's, or a CP difference), so not called a finding",
}

MTP_UNSUPPORTED = {
    "deepseek_v41": "DeepseekV41ForCausalLM has an MTP head (num_nextn_predict_layers) but declares "
    "supports_mtp_cp=False: in the recipe parallelize_model raises 'does not support MTP with context "
    "parallelism' (reject_unsupported_mtp_cp) and the step's gate raises NotImplementedError before sharding "
    "(read from the framework's code)",
    "deepseek_v4": "DeepseekV4ForCausalLM has an MTP head (num_nextn_predict_layers) but declares "
    "supports_mtp_cp=False (as DeepSeek V4.1): the framework refuses MTP with CP",
}


def mtp_overrides(spec: str) -> dict | None:
    """The spec's ``MTP_OVERRIDES`` (config fields that enable its MTP head), or ``None`` without them."""
    overrides = getattr(model_specs.load_spec(spec), "MTP_OVERRIDES", None)
    return dict(overrides) if overrides else None


def _runnable(models: tuple[str, ...], dtype: str, loss: str = "masked") -> tuple[list[str], dict[str, str]]:
    runnable, skipped = rm._runnable(models, dtype)
    for name in list(runnable):
        traits = model_specs.spec_traits(name)
        why = traits.forward_only("cpu")
        short = name.rsplit(".", 1)[-1]
        if (short, dtype) in DTYPE_UNSUPPORTED:
            skipped[name] = f"{dtype}: {DTYPE_UNSUPPORTED[short, dtype]}"
        elif loss == "linear_ce" and short in LINEAR_CE_UNSUPPORTED:
            skipped[name] = f"linear CE: {LINEAR_CE_UNSUPPORTED[short]}"
        elif loss == "mtp" and mtp_overrides(name) is None:
            skipped[name] = f"MTP: {MTP_UNSUPPORTED.get(short, 'the spec declares no MTP_OVERRIDES (no MTP head)')}"
        elif why is not None:
            skipped[name] = f"forward only on this machine ({why}); the training step needs a backward"
        elif dtype not in getattr(importlib.import_module(name), "TRAINING_DTYPES", STEP_DTYPES):
            skipped[name] = (
                f"its training step runs {list(getattr(importlib.import_module(name), 'TRAINING_DTYPES', STEP_DTYPES))}"
                f" (TRAINING_DTYPES), not {dtype}: docs/training_step.md, bfloat16"
            )
        elif traits.world_sizes is not None and CP not in traits.world_sizes:
            skipped[name] = f"declares WORLD_SIZES {list(traits.world_sizes)}, not the step's CP size {CP}"
        elif not _kinds(traits):
            skipped[name] = f"no batch kind allows {DP_SHARD} x its rows per micro-batch (BATCH_ROWS)"
        else:
            continue
        runnable.remove(name)
    return runnable, skipped


def _global_rows(traits, kind: str) -> tuple[int, ...]:
    """Global row counts ``dp_shard x r`` where ``r`` (a dp rank's rows, one micro-batch) is a row count a ``kind``
    batch of the spec may have (the one-device reference runs the same micro-batches, ``one_device``)."""
    return tuple(DP_SHARD * r for r in traits.rows_for(kind))


def _kinds(traits) -> tuple[str, ...]:
    """The spec's batch kinds the step draws: those with a global row count that splits over the dp ranks. A VLM's
    ``images`` kind is among them: its media are split with the rows by ``model_specs.select_rows``."""
    return tuple(k for k in traits.batch_kinds if _global_rows(traits, k))


@st.composite
def _images_on_one_dp_rank(draw, batch: dict) -> dict:
    """An ``images`` batch description, half of the time with one dp rank's rows text only: as the framework's VLM
    data path hands them over, each with its fake image (``fake_images``: a constant image at the row's start, its
    placeholders masked by ``attention_mask`` 0; ``inject_fake_images``, on by default, because a rank whose
    micro-batch has no image would skip the vision tower's FSDP2 all-gathers). ``real_model._batches`` puts one or
    two real images in every row."""
    rows = int(batch["batch_size"]) // DP_SHARD
    if draw(st.booleans()):
        empty = draw(st.integers(0, DP_SHARD - 1))
        images = [[] if r // rows == empty else placed for r, placed in enumerate(batch["images"])]
        if any(images) and batch["seq_len"] >= 6:  # the fake image (4 placeholders) and a text target after it
            batch = {**batch, "images": images, "fake_images": True}
    return batch


def _skip_reason(dtype: str, loss: str = "masked"):
    def reason(space) -> str | None:
        space = as_space(space) or current_space()
        models = rm._space_models(space)
        if not models:
            return None
        need = DP_SHARD * CP
        if need not in space.world_sizes or space.pool_ranks != need:
            return (
                f"the training step runs on {need} ranks as dp_shard x cp = {DP_SHARD} x {CP} over the whole pool: "
                f"give --world-sizes {need} (world sizes {list(space.world_sizes)}, pool {space.pool_ranks})"
            )
        runnable, skipped = _runnable(models, dtype, loss)
        return None if runnable else "; ".join(f"{name}: {why}" for name, why in skipped.items())

    return reason


def training_step_cases(dtype: str, loss: str = "masked"):
    @st.composite
    def cases(draw, space=None) -> dict:
        models = rm._space_models(as_space(space))
        if not models:
            raise ValueError("no model spec given: pass --model MODULE (verify)")
        runnable, _ = _runnable(models, dtype, loss)
        spec = draw(st.sampled_from(runnable)) if runnable else draw(st.nothing())
        traits = model_specs.spec_traits(spec)
        batch = draw(rm._batches(_kinds(traits), lambda kind: _global_rows(traits, kind)))
        if batch["kind"] == "images":
            batch = draw(_images_on_one_dp_rank(batch))
        elif draw(st.booleans()):  # the pad id as content: each document's end (an EOS = pad) and middle
            batch["pad_content"] = True  # (not for images: the VLM spec's make_batch plants no pad id)
        return {
            "check": "training_step",
            "spec": spec,
            "dtype": dtype,
            "seed": 0,
            "batch": batch,
            "world_size": DP_SHARD * CP,
            "dp_shard": DP_SHARD,
            "cp": CP,
            **_loss_keys(spec, loss),
        }

    return cases


def _loss_keys(spec: str, loss: str) -> dict:
    """The case keys of a loss: none for ``masked``; ``loss`` otherwise, and for ``mtp`` the spec's
    ``MTP_OVERRIDES`` as ``overrides`` (the CP model and the one-device reference both get the MTP head)."""
    if loss == "masked":
        return {}
    if loss == "mtp":
        overrides = mtp_overrides(spec)
        if overrides is None:
            raise ValueError(f"training_step case: loss='mtp' but {spec} declares no MTP_OVERRIDES")
        return {"loss": loss, "overrides": overrides}
    return {"loss": loss}


def mtp_case(case: dict) -> dict:
    """``case`` as an MTP case (``loss: mtp`` and the spec's ``MTP_OVERRIDES``)."""
    return {**case, **_loss_keys(case["spec"], "mtp")}


def smoke_cases(spec: str, dtype: str = "float32", driver: str | None = None) -> list[dict]:
    """Named cases for the default command: two dp ranks whose rows hold different label counts (packed rows with
    other documents: 15 and 10 labels; one dp rank's row of single-token documents only: no label at all), right
    padding, an odd length, and a packed batch whose documents hold and end with the pad id (``pad_content``),
    one of them spanning its whole row (every shard boundary)."""
    batches = [
        {"kind": "packed", "seq_len": 19, "batch_size": 2, "documents": [[7, 5, 6], [3, 1, 9]], "seed": 1},
        {"kind": "packed", "seq_len": 17, "batch_size": 2, "documents": [[9, 8], [1, 1, 1]], "seed": 2},
        {"kind": "right_padded", "seq_len": 13, "pad": 4, "batch_size": 2, "seed": 4},
        {"kind": "plain", "seq_len": 11, "batch_size": 2, "seed": 5},
        # the pad id (0, the recipe's padding_token_id without a tokenizer) inside documents and ending them; a
        # document crossing every shard boundary, a single-token one
        {
            "kind": "packed",
            "seq_len": 21,
            "batch_size": 2,
            "documents": [[21], [6, 1, 9]],
            "seed": 6,
            "pad_content": True,
        },
    ]
    extra = {"driver": driver} if driver else {}
    return [
        {
            "check": "training_step",
            "spec": spec,
            "dtype": dtype,
            "seed": 0,
            "batch": b,
            "world_size": DP_SHARD * CP,
            "dp_shard": DP_SHARD,
            "cp": CP,
            **extra,
        }
        for b in batches
    ]


TRAINING_STEP = register(
    "training_step",
    rank=_rank,
    evaluate=_evaluate,
    rows=tuple(
        VerifyRow(
            f"training step dp_shard x cp = {DP_SHARD} x {CP} ({dtype}{LOSS_LABELS[loss]})",
            training_step_cases(dtype, loss),
            (),
            dtypes=(dtype,),
            position=22 + i + 0.5 * j,
            needs_model=True,
            id=f"training_step.{dtype}" + (f".{loss}" if loss != "masked" else ""),
            skip=_skip_reason(dtype, loss),
            step="training",
        )
        for i, dtype in enumerate(STEP_DTYPES)
        for j, loss in enumerate(LOSSES)
    ),
    gate_share=0.0,
)
