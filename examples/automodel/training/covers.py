"""What the training-step driver (``train_ft_step.py``) does with the framework's training-step code: the
coverage table's entries for the subjects ``training:<spec>`` (``examples/automodel/tools/coverage.py``).

``COVERS`` (every step), ``COVERS_MASKED``, ``COVERS_LINEAR_CE``, ``COVERS_MTP`` (by loss), ``COVERS_BY_SPEC`` (the VLM
specs: the VLM recipe's step with images): framework callable -> what the step
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

_VLM = f"{_D}.models.qwen3_5_moe.model.Qwen3_5MoeForConditionalGeneration"
COVERS_VLM: dict[str, str] = {
    f"{_D}.distributed.cp_vision_frame_shard.set_cp_vision_group": "the VLM recipe's CP vision group published around "
    "the forward (_cp_vision_frame_sharding_context; the recipe's default policy: frame sharding off)",
    f"{_D}.distributed.cp_vision_frame_shard.reset_cp_vision_group": "the group withdrawn after the forward",
    f"{_D}.distributed.context_parallel.sharder.shard_batch_aux_only": "each dp rank's rows: labels and mRoPE "
    "positions round-robin sharded, input_ids and that rank's own images kept global",
    f"{_VLM}._embed_and_splice_for_cp": "in the FSDP2-wrapped forward: the vision tower (its FSDP2 units) on the dp "
    "rank's images, features spliced before the round-robin shard",
}
"""Called by the VLM recipe's step (a batch with images: ``RecipeStep.vision_group``, the model's CP forward) on top of
``COVERS`` and the loss's entries."""

COVERS_BY_SPEC: dict[str, dict[str, str]] = {"qwen3_5_moe_vlm": COVERS_VLM, "qwen3_5_moe_vlm_mrope": COVERS_VLM}
"""What a spec's training step calls whatever its loss (the VLM specs: the VLM recipe's step with images)."""

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
    "nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM._forward_backward_step": (
        "rebuilt, not called (the recipe does not import here: torchao): RecipeStep.run redoes its ContextParallelSharder "
        "(invoke_pre_embed, the model's shard_batch_aux_only), the forward under the CP vision group, the loss and "
        "the backward of local_loss x dp_cp size; its lines are train_ft.py's but for the vision group"
    ),
    "nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM._run_train_optim_step": (
        "rebuilt (RecipeStep.num_label_tokens, aux_loss_scale, reported_loss): label count of the rows' labels summed "
        "over dp, MoE aux-loss scale cp / microbatches, clip-grad call"
    ),
    "nemo_automodel.recipes.vlm.finetune.FinetuneRecipeForVLM._cp_vision_frame_sharding_context": (
        "rebuilt (RecipeStep.vision_group): the framework's set_cp_vision_group / reset_cp_vision_group on mesh['cp'] "
        "with the default CpVisionFrameShardingConfig()"
    ),
}

NOT_RUN: dict[str, str] = {
    f"{_D}.loss.linear_ce.FusedLinearCrossEntropy": "needs cut_cross_entropy (Triton kernels): not installed on a "
    "CPU runner",
    f"{_D}.loss.te_parallel_ce.TEParallelCrossEntropy": "TransformerEngine's CUDA cross entropy",
    f"{_D}.distributed.cp_vision_frame_shard.maybe_distribute_visual": "the VLM recipe's vision frame sharding over "
    "CP (distributed.multimodal.vision.frame_sharding.enabled, off by default): the training step runs the "
    "default policy, the vision tower replicated on every CP rank",
    f"{_D}.datasets.vlm.fake_image.mask_fake_vision_tokens_batch": "the fake image of a text-only sample: "
    "datasets/vlm needs HF datasets (absent here); the VLM spec lays it out and masks it as this function does "
    "(fake_images, finding M9)",
}


def covers(loss: str = "masked", spec: str | None = None) -> dict[str, str]:
    """The callables a training step with ``loss`` (``"masked"`` / ``"linear_ce"`` / ``"mtp"``) of spec ``spec``
    (its short name; only the MTP rows depend on it) calls."""
    by_loss = {"masked": COVERS_MASKED, "linear_ce": COVERS_LINEAR_CE, "mtp": COVERS_MTP}
    if loss not in by_loss:
        raise ValueError(f"loss={loss!r}: give one of {list(by_loss)}")
    mtp = COVERS_MTP_BY_SPEC.get(spec or "", {}) if loss == "mtp" else {}
    return {**COVERS, **by_loss[loss], **mtp, **COVERS_BY_SPEC.get(spec or "", {})}
