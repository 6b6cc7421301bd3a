"""What the training-step driver (``train_ft_step.py``) does with the framework's training-step code: the
coverage table's entries for the subjects ``training:<spec>`` (``examples/automodel/tools/coverage.py``).

``COVERS`` (every step), ``COVERS_MASKED``, ``COVERS_LINEAR_CE``, ``COVERS_MTP`` (by loss): framework callable -> what the step
does with it; each is called by the framework's own code path or
the driver on every rank of a step (counted by ``tools/covers_check.py --step training``, which exits 1 when a
declared callable is never called). ``REBUILT``: the recipe's methods whose CP lines the driver rebuilds with torch
API because the recipe does not import on a CPU (it needs ``torchao`` and ``torchdata``): never called, so the
table lists them as not judged, saying which ``RecipeStep`` method rebuilds which lines. ``NOT_RUN``: training-step code the CP path reaches in
the framework that no subject runs here, and why.
"""

from __future__ import annotations

_D = "nemo_automodel.components"

COVERS: dict[str, str] = {
    f"{_D}.distributed.mesh.MeshContext.build": "the training mesh pp x dp_replicate x dp_shard x cp x tp = 1x1x2x2x1",
    f"{_D}.distributed.mesh_utils._create_fsdp2_device_mesh": "MeshContext.build's mesh, dp / dp_shard_cp / dp_cp "
    "flattened",
    f"{_D}.distributed.mesh_utils.get_flat_mesh": "dp, dp_cp read back as the recipe reads them",
    f"{_D}.distributed.model_parallelizer.parallelize_model": "the model class's parallelizer: FSDP2 over dp_shard_cp",
    f"{_D}.distributed.utils.get_sync_ctx": "the final micro-batch's gradient-sync context (defer_fsdp_grad_sync)",
    f"{_D}.training.utils.prepare_for_grad_accumulation": "FSDP2 state before the first micro-batch",
    f"{_D}.training.utils.prepare_for_final_backward": "FSDP2 state before the last backward (reduce-scatter on)",
    f"{_D}.training.utils.scale_grads_and_clip_grad_norm": "the clip-grad norm over the FSDP2 gradient shards",
    f"{_D}.loss.utils._count_label_tokens": "each dp rank's label count (summed over dp: num_label_tokens)",
}
"""Called in every training step the driver runs, whatever its loss."""

COVERS_MASKED: dict[str, str] = {
    f"{_D}.loss.masked_ce.MaskedCrossEntropy.forward": "the spec's loss, sum over the global label count",
}
"""Called by the masked cross-entropy rows (the default loss) on top of ``COVERS`` (the linear-CE step does not:
``covers_check --step training --loss linear_ce`` counted 0 calls when it was declared for every step)."""

COVERS_LINEAR_CE: dict[str, str] = {
    f"{_D}.loss.utils.prepare_lm_weight": "the LM head gathered once outside its FSDP2 unit, gradient reduced over "
    "dp_cp",
    f"{_D}.loss.utils.calculate_loss": "the recipe's loss dispatch for a linear-projection loss",
    f"{_D}.loss.chunked_ce.ChunkedCrossEntropy.forward": "linear cross entropy on the final hidden states",
    f"{_D}.loss.linear_ce_base.LinearCrossEntropy.materialize_lm_weight": "the LM-head weight as the loss sees it",
    f"{_D}.training.model_output_utils.get_final_hidden_states": "the final hidden states of the model output",
    f"{_D}.utils.model_utils.filter_forward_kwargs": "the forward's keyword arguments, as the recipe filters them",
}
"""Called by the linear-CE rows (``loss: linear_ce``) on top of ``COVERS``."""

COVERS_MTP: dict[str, str] = {
    f"{_D}.loss.mtp.calculate_mtp_loss": "the MTP term added to the main loss (CP: the globally prepared targets)",
    f"{_D}.loss.masked_ce.MaskedCrossEntropy.forward": "the main loss and each MTP depth's cross entropy",
}
"""Called by the MTP rows (``loss: mtp``) on top of ``COVERS``; the model's own ``prepare_mtp_inputs_for_cp`` is in
``COVERS_MTP_BY_SPEC``."""

COVERS_MTP_BY_SPEC: dict[str, dict[str, str]] = {
    "qwen3_5_moe": {
        f"{_D}.models.qwen3_5_moe.model.Qwen3_5MoeForConditionalGeneration.prepare_mtp_inputs_for_cp": (
            "MTP ids, positions, targets and validity masks prepared on the global rows before the sharder"
        ),
    },
}
"""The MTP preparation each spec's model class owns (the recipe calls ``model.prepare_mtp_inputs_for_cp``)."""

REBUILT: dict[str, str] = {
    "nemo_automodel.recipes.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction._forward_backward_step": (
        "rebuilt, not called (the recipe does not import here: torchao, torchdata): RecipeStep.run and "
        "linear_ce_forward redo its sharder, forward, loss and backward of local_loss x dp_cp size"
    ),
    "nemo_automodel.recipes.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction._run_train_optim_step": (
        "rebuilt (RecipeStep.num_label_tokens, reported_loss): label count summed over dp, loss over dp_cp, "
        "clip-grad call"
    ),
    "nemo_automodel.recipes.base_recipe.BaseRecipe._get_dp_group_size": "rebuilt (RecipeStep.loss_scale)",
    "nemo_automodel.recipes.base_recipe.BaseRecipe._set_moe_aux_loss_backward_scale": (
        "rebuilt (RecipeStep.aux_loss_scale)"
    ),
    "nemo_automodel.recipes.base_recipe.BaseRecipe._dp_allreduce": "rebuilt (RecipeStep.num_label_tokens, "
    "reported_loss)",
}

NOT_RUN: dict[str, str] = {
    f"{_D}.loss.linear_ce.FusedLinearCrossEntropy": "needs cut_cross_entropy (Triton kernels): not installed on a "
    "CPU runner",
    f"{_D}.loss.te_parallel_ce.TEParallelCrossEntropy": "TransformerEngine's CUDA cross entropy",
    "nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM._forward_backward_step": "no VLM spec has a training "
    "step yet (issue 34 item 4)",
}


def covers(loss: str = "masked", spec: str | None = None) -> dict[str, str]:
    """The callables a training step with ``loss`` (``"masked"`` / ``"linear_ce"`` / ``"mtp"``) of spec ``spec``
    (its short name; only the MTP rows depend on it) calls."""
    by_loss = {"masked": COVERS_MASKED, "linear_ce": COVERS_LINEAR_CE, "mtp": COVERS_MTP}
    if loss not in by_loss:
        raise ValueError(f"loss={loss!r}: give one of {list(by_loss)}")
    mtp = COVERS_MTP_BY_SPEC.get(spec or "", {}) if loss == "mtp" else {}
    return {**COVERS, **by_loss[loss], **mtp}
