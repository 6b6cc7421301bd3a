"""One training step of a model spec as nemo-automodel 0.7.0's ``recipes/llm/train_ft.py`` runs it at CP > 1, on
the framework's own mesh, parallelizer and clip-grad helper (the driver of ``cp_harness.checks.training_step``).
A batch with images (a VLM spec's ``images`` kind) is ``recipes/vlm/finetune.py``'s step: the same lines plus its CP
vision group around the forward (``RecipeStep.vision_group``), each dp rank's rows selected with their images.

What is the framework's own code, called here (nothing of it is copied):

* the mesh: ``MeshContext.build(FSDP2Config(...), ParallelismSizes(cp_size=cp), world_size=dp * cp)``
  (``components/distributed/mesh.py`` -> ``mesh_utils._create_fsdp2_device_mesh``): the 5-D
  ``pp x dp_replicate x dp_shard x cp x tp`` mesh with ``dp``, ``dp_shard_cp`` and ``dp_cp`` flattened by
  ``DeviceMesh._flatten`` exactly as the recipe gets them; read back with ``mesh_utils.get_flat_mesh``;
* the parallelizer: ``model_parallelizer.parallelize_model(model, mesh_context)``, the model class's own sidecar
  (DeepSeek V4.1: ``DeepseekV41ModelParallelizer``), which applies FSDP2 (``fully_shard``) over ``dp_shard_cp``;
* the CP sharder: the spec's ``shard`` on ``mesh["cp"]`` (the framework's ``ContextParallelSharder``, as
  ``_forward_backward_step`` builds it from the world mesh's ``cp`` dimension), ``get_sync_ctx``,
  ``prepare_for_grad_accumulation`` / ``prepare_for_final_backward`` (``components/training/utils.py``), the label
  count ``_count_label_tokens`` (``components/loss/utils.py``), the spec's loss (the framework's
  ``MaskedCrossEntropy``);
* the gradient norm: ``scale_grads_and_clip_grad_norm`` (``components/training/utils.py``, the recipe's call and
  keywords, ``max_grad_norm`` 1.0: the recipe's default) on the FSDP2 DTensor gradients.

Rebuilt with torch API, because ``recipes/llm/train_ft.py`` and ``recipes/base_recipe.py`` do not import here
(they need ``torchao`` and ``torchdata``, which the CPU environment does not install): the recipe's four lines of
step arithmetic, each named where it is done below (``RecipeStep``): ``num_label_tokens`` summed over the ``dp``
group (``_dp_allreduce``), the backward of ``local_loss * dp_cp size`` (``_get_dp_group_size(include_cp=True)``),
the MoE auxiliary-loss scale ``cp size / microbatches`` (``_set_moe_aux_loss_backward_scale``), the reported loss
summed over ``dp_cp``.

**The gloo stand-in (finding D2, ``docs/real_clients.md``).** ``torch.distributed.nn.functional.all_gather``'s
backward on gloo scatters from each *group* rank ``i`` as if it were the global rank ``i``: on the second CP group
``{2, 3}`` of ``dp_shard x cp = 2 x 2`` every CP gather of the framework raises in backward. On NCCL the same
backward is a reduce-scatter on the group. While the step runs on gloo, ``gather_backward_as_on_nccl`` makes the
gloo backward take that NCCL branch (torch's own ``_Reduce_Scatter`` on the group, into a contiguous buffer);
``STAND_IN`` says so in every report. Without it the step raises ``ValueError: Global rank 0 is not part of
group`` on ranks 2 and 3 (``examples/automodel/repro/gather_subgroup.py``).

Every function runs on every rank of the 4-rank world, in the same order (the collectives of FSDP2 span it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist

STAND_IN = (
    "torch.distributed.nn.functional.all_gather's gloo backward (finding D2: scatters from group rank i "
    "as global rank i) replaced by its NCCL branch, a reduce-scatter on the group"
)
MAX_GRAD_NORM = 1.0  # the recipe's default clip_grad_norm.max_norm
MTP_STAND_INS = {
    "train_ft.py's MTP inputs under CP (finding T2)": "the per-depth validity masks are sharded into the batch as "
    "recipes/vlm/finetune.py does (train_ft.py does not: Qwen3_5MoeForConditionalGeneration's CP forward raises "
    "'requires precomputed per-depth inputs, positions, and masks')",
    "the MTP position ids under CP (finding T3)": "each depth's [B, S] position ids expanded to the model's 3 mRoPE "
    "axes before sharding (the CP MTP sublayer indexes them as [3, B, S]: 'IndexError: too many indices for tensor "
    "of dimension 2'; the one-device path expands them itself)",
    "the one-device MTP reference (finding T1)": "padding_mask (the block-causal mask's diagonal, what the decoder "
    "derives itself) passed to the forward: without it the MTP sublayer's MoE raises on a NEAT-packed batch",
}


@contextlib.contextmanager
def gather_backward_as_on_nccl():
    """Inside: the backward of ``torch.distributed.nn.functional.all_gather`` on a non-NCCL group is what its NCCL
    branch does (``_Reduce_Scatter`` of the upstream slices on the group). Restored on exit."""
    from torch.distributed.nn import functional as dnnf

    original = dnnf._AllGather.backward

    def backward(ctx, *grad_outputs):
        if dist.get_backend(group=ctx.group) in (dist.Backend.NCCL, dist.Backend.XCCL):
            return original(ctx, *grad_outputs)
        mine = grad_outputs[dist.get_rank(group=ctx.group)]
        out = torch.empty(mine.shape, dtype=mine.dtype, device=mine.device)
        return (None, dnnf._Reduce_Scatter.apply(dist.ReduceOp.SUM, ctx.group, out, *grad_outputs))

    dnnf._AllGather.backward = staticmethod(backward)
    try:
        yield
    finally:
        dnnf._AllGather.backward = original


def mixed_precision():
    """FSDP2's policy here: the recipe's ``reduce_dtype`` float32, ``param_dtype`` ``None`` (each parameter keeps
    the spec's dtype: the recipe's default bfloat16 would make a float32 model's step another computation than
    the one-device float32 reference)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=False
    )


@functools.cache
def mesh_context(dp_shard: int, cp: int):
    """The framework's ``MeshContext`` over the whole default group (``dp_shard * cp`` ranks), built once per
    process (every rank builds it in the same case, so the process groups are created in the same order)."""
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes

    world = dist.get_world_size()
    if world != dp_shard * cp:
        raise ValueError(
            f"training step: the framework's mesh dp_shard x cp = {dp_shard} x {cp} covers the whole "
            f"default group, but the pool has {world} ranks; start it with --world-sizes {dp_shard * cp}"
        )
    return MeshContext.build(
        FSDP2Config(mp_policy=mixed_precision()), ParallelismSizes(dp_size=dp_shard, cp_size=cp), world_size=world
    )


@dataclasses.dataclass
class RecipeStep:
    """The recipe's step, one method per piece so that a defect fixture overrides exactly one line of it."""

    def flat(self, mesh, name: str):
        from nemo_automodel.components.distributed.mesh_utils import get_flat_mesh

        return get_flat_mesh(mesh, name)

    def dp_rows(self, spec, mesh, global_batch: dict, rows: int) -> dict:
        """This dp rank's rows of the global batch (the dataloader's shard: dp rank ``d`` holds rows
        ``d*rows .. (d+1)*rows-1``; every CP rank of a dp rank holds the same rows, the sharder splits them), through
        ``model_specs.select_rows``: the spec's ``reorder_rows`` for a batch with media, so that the dp rank gets the
        images of its rows (``pixel_values [P_d, C]``, ``image_grid_thw [I_d, 3]``) and none when its rows hold none."""
        from cp_harness.usage import model_specs

        d = self.flat(mesh, "dp").get_local_rank()
        return model_specs.select_rows(spec, global_batch, range(d * rows, (d + 1) * rows))

    def num_label_tokens(self, mesh, batch: dict) -> int:
        """``_run_train_optim_step``: ``_count_label_tokens`` of the rank's batch, summed over ``dp``
        (``_dp_allreduce``, without CP: every CP rank of a dp rank counts the same unsharded rows)."""
        from nemo_automodel.components.loss.utils import _count_label_tokens

        count = torch.tensor(_count_label_tokens(batch["labels"], -100), dtype=torch.long)
        dist.all_reduce(count, group=self.flat(mesh, "dp").get_group())
        return int(count.item())

    def loss_scale(self, mesh) -> int:
        """``_forward_backward_step``: ``(local_loss * self._get_dp_group_size(include_cp=True)).backward()``,
        undoing FSDP2's average over ``dp_shard_cp``."""
        return self.flat(mesh, "dp_cp").size()

    def aux_loss_scale(self, mesh) -> float:
        """``_set_moe_aux_loss_backward_scale``: ``cp size / microbatches`` (one microbatch here, no PP)."""
        return mesh["cp"].size() / 1

    def reported_loss(self, mesh, local_loss: torch.Tensor) -> torch.Tensor:
        """``reporting_loss = self._dp_allreduce(sum(loss_buffer), include_cp=True)``."""
        total = local_loss.detach().float().clone()
        dist.all_reduce(total, group=self.flat(mesh, "dp_cp").get_group())
        return total

    def stand_in(self):
        """On gloo, ``gather_backward_as_on_nccl()`` (finding D2, the module docstring); elsewhere nothing."""
        return gather_backward_as_on_nccl() if dist.get_backend() == "gloo" else contextlib.nullcontext()

    def vision_group(self, mesh, global_batch: dict):
        """``recipes/vlm/finetune.py``'s ``_cp_vision_frame_sharding_context()`` around its forward when the step is
        the VLM recipe's (the global batch carries media, ``model_specs.MEDIA_KEYS``): the framework's
        ``set_cp_vision_group(mesh["cp"].get_group(), config=CpVisionFrameShardingConfig())`` (the recipe's default
        policy, frame sharding disabled: the vision tower runs replicated on every CP rank), reset on exit. A text
        batch: nothing (``train_ft.py`` has no such context)."""
        from cp_harness.usage.model_specs import MEDIA_KEYS

        if not any(global_batch.get(k) is not None for k in MEDIA_KEYS):
            return contextlib.nullcontext()
        return _cp_vision_group(mesh["cp"].get_group())

    def linear_ce_loss_fn(self):
        """The recipe's linear-projection loss that runs on a CPU: ``ChunkedCrossEntropy`` (a ``LinearCrossEntropy``:
        hidden states and the LM-head weight, no logits), ``compile=False`` (the per-chunk ``torch.compile`` is an
        optimisation; the rank processes run with dynamo disabled, where it is the same eager function)."""
        from nemo_automodel.components.loss.chunked_ce import ChunkedCrossEntropy

        return ChunkedCrossEntropy(compile=False)

    def linear_ce_forward(self, model, mesh, local: dict, labels: torch.Tensor, count: int) -> torch.Tensor:
        """``_forward_backward_step``'s linear-CE branch: ``model(**batch, logits_to_keep=1,
        output_hidden_states=True)``, the LM head gathered once outside its FSDP module
        (``prepare_lm_weight(loss_fn, model, grad_reduce_group=dp_cp)``: ``materialize_lm_weight``'s
        ``full_tensor(grad_placements=Partial)`` and the ``1 / dp_cp`` hook), then ``calculate_loss`` with the
        final hidden states. Returns the local loss."""
        from nemo_automodel.components.loss.utils import calculate_loss, prepare_lm_weight
        from nemo_automodel.components.training.model_output_utils import get_final_hidden_states
        from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

        loss_fn = self.linear_ce_loss_fn()
        kwargs = {k: v for k, v in local.items() if k != "labels" and not k.startswith("_spec")}
        out = model(**{**filter_forward_kwargs(model, kwargs), "logits_to_keep": 1, "output_hidden_states": True})
        group = self.flat(mesh, "dp_cp").get_group()
        weight = prepare_lm_weight(loss_fn, model, grad_reduce_group=group)
        return calculate_loss(
            loss_fn,
            logits=out.logits,
            labels=labels,
            model=model,
            hidden_states=get_final_hidden_states(out),
            num_label_tokens=count,
            lm_weight=weight,
            grad_reduce_group=group,
            logits_dtype=out.logits.dtype,
        )

    def mtp_prepare(self, model, batch: dict):
        """``_forward_backward_step`` before the sharder (CP > 1, no PP, ``model.supports.mtp_enabled``): the
        ``supports_mtp_cp`` gate (the recipe's ``NotImplementedError``), then
        ``model.prepare_mtp_inputs_for_cp(batch, ignore_index=-100)`` on the dp rank's *global* rows ``[B, S]``
        (per-depth token ids, position ids, targets and validity masks, shifted in global order without crossing
        a document). ``batch`` may gain ``position_ids`` (the framework materialises them there)."""
        supports = model_supports(model)
        if not supports.mtp_enabled:
            raise ValueError(
                f"training step loss='mtp': {type(model).__name__} has no MTP head (mtp_config.enabled is False); "
                "give the spec's MTP_OVERRIDES in the case's overrides"
            )
        if not supports.supports_mtp_cp:
            raise NotImplementedError(
                f"{type(model).__name__} declares supports_mtp_cp=False; "
                "MTP target preparation for context parallelism is unavailable"
            )
        return model.prepare_mtp_inputs_for_cp(batch, ignore_index=IGNORE_INDEX)

    def mtp_shard(self, spec, sharder, local: dict, mtp_inputs) -> tuple[torch.Tensor, ...]:
        """After ``cp_sharder.shard``: each depth's token ids and position ids into the local batch through
        ``cp_sharder.shard_token_tensor(..., seq_dim=1, fill=0)``, the targets with ``fill=ignore_index``
        (returned, ``[B, S_local]`` each).

        Two stand-ins (``MTP_STAND_INS``, said in every MTP report; findings T2 and T3, docs/training_step.md):
        the validity masks are sharded too (``fill=False``), the line of ``recipes/vlm/finetune.py``
        (``batch["mtp_per_depth_valid_masks"]``) that ``train_ft.py`` lacks, without which
        ``Qwen3_5MoeForConditionalGeneration``'s CP forward raises; and where the spec has ``mtp_position_ids``
        each depth's position ids go through it first (``[B, S]`` -> the model's ``[3, B, S]`` mRoPE axes, which
        its CP MTP sublayer needs and only its one-device path makes), sharded on their sequence dim 2
        (``position_ids_seq_dim``, the VLM recipe's argument). ``training_step_driver_mtp_train_ft`` runs
        ``train_ft.py``'s lines alone."""
        positions = mtp_inputs.position_ids
        seq_dim = mtp_inputs.position_ids_seq_dim
        if hasattr(spec, "mtp_position_ids"):
            positions = tuple(spec.mtp_position_ids(p) for p in positions)
            seq_dim = positions[0].dim() - 1
        local["mtp_per_depth_input_ids"] = tuple(
            sharder.shard_token_tensor(ids, seq_dim=1, fill=0) for ids in mtp_inputs.input_ids
        )
        local["mtp_per_depth_position_ids"] = tuple(
            sharder.shard_token_tensor(ids, seq_dim=seq_dim, fill=0) for ids in positions
        )
        local["mtp_per_depth_valid_masks"] = tuple(
            sharder.shard_token_tensor(mask, seq_dim=1, fill=False) for mask in mtp_inputs.valid_masks
        )
        return tuple(
            sharder.shard_token_tensor(targets, seq_dim=1, fill=IGNORE_INDEX) for targets in mtp_inputs.targets
        )

    def run(self, spec, model, context, global_batch: dict, rows: int, loss: str = "masked") -> dict[str, Any]:
        """One step: ``{"logits" [B_global, S, V], "loss" [], "grads" {name: full gradient}, "grad_norm" []}``,
        the same on every rank. ``model``: already through ``parallelize_model``; ``rows``: rows per dp rank;
        ``loss``: ``"masked"`` (the spec's loss, ``MaskedCrossEntropy``), ``"linear_ce"`` (``linear_ce_forward``:
        no logits are materialised, so none come back) or ``"mtp"`` (the spec's loss plus the recipe's MTP loss:
        ``mtp_prepare`` on this dp rank's global rows before the sharder, ``mtp_shard`` after it, ``mtp_loss``)."""
        from nemo_automodel.components.distributed.utils import get_sync_ctx
        from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler
        from nemo_automodel.components.training.utils import (
            prepare_for_final_backward,
            prepare_for_grad_accumulation,
            scale_grads_and_clip_grad_norm,
        )
        from torch.distributed.tensor import DTensor

        mesh = context.device_mesh
        batch = self.dp_rows(spec, mesh, global_batch, rows)
        count = self.num_label_tokens(mesh, batch)
        previous = MoEAuxLossAutoScaler.main_loss_backward_scale
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(self.aux_loss_scale(mesh))
        stand_in = self.stand_in()
        try:
            model.zero_grad(set_to_none=True)
            prepare_for_grad_accumulation([model])
            prepare_for_final_backward([model])
            # The spec contract's CP mesh, mesh["cp"] (the recipe hands ContextParallelSharder the world mesh,
            # which slices the same "cp" dimension).
            mtp_inputs = self.mtp_prepare(model, batch) if loss == "mtp" else None
            ctx_factory, local, sharder = spec.shard(model, mesh["cp"], batch)
            targets = None if mtp_inputs is None else self.mtp_shard(spec, sharder, local, mtp_inputs)
            vision = self.vision_group(mesh, global_batch)
            with stand_in, vision, ctx_factory(), get_sync_ctx(model, True, defer_fsdp_grad_sync=True):
                labels = spec.local_labels(local) if hasattr(spec, "local_labels") else local["labels"]
                if loss == "linear_ce":
                    logits = None
                    local_loss = self.linear_ce_forward(model, mesh, local, labels, count)
                elif loss == "mtp":
                    out = forward_output(model, local)
                    logits = out.logits
                    local_loss = spec.loss(logits, labels, count) + mtp_loss(model, out, local, labels, count, targets)
                else:
                    logits = spec.forward(model, local)
                    local_loss = spec.loss(logits, labels, count)
                (local_loss * self.loss_scale(mesh)).backward()
        finally:
            MoEAuxLossAutoScaler.main_loss_backward_scale = previous
        # The gradients as the optimizer sees them: each rank's FSDP2 shard, gathered whole for judging.
        grads = {}
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad:
                continue
            grad = parameter.grad
            if grad is None:
                grad = torch.zeros(parameter.shape, dtype=parameter.dtype)
            elif isinstance(grad, DTensor):
                grad = grad.full_tensor()
            grads[name] = grad.detach().clone()
        dp_cp = self.flat(mesh, "dp_cp").size()
        norm = scale_grads_and_clip_grad_norm(
            MAX_GRAD_NORM,
            [model],
            norm_type=2.0,
            pp_enabled=False,
            device_mesh=mesh,
            moe_mesh=context.moe_mesh,
            ep_axis_name=None,
            pp_axis_name=None,
            foreach=True,
            num_label_tokens=count,
            dp_group_size=dp_cp,
            grad_norm_backend="triton",
        )
        norm = norm.full_tensor() if isinstance(norm, DTensor) else torch.as_tensor(norm)
        out = {} if logits is None else {"logits": self.gather_logits(spec, sharder, mesh, logits.detach())}
        return {
            **out,
            "loss": self.reported_loss(mesh, local_loss),
            "grads": grads,
            "grad_norm": norm.detach().double().reshape(()),
        }

    def gather_logits(self, spec, sharder, mesh, local_logits: torch.Tensor) -> torch.Tensor:
        """The CP group's logits in global order (``spec.gather_logits``), then every dp rank's rows, in dp order."""
        mine = spec.gather_logits(sharder, local_logits).contiguous()
        group = self.flat(mesh, "dp").get_group()
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, mine, group=group)
        return torch.cat(parts, dim=0)


@contextlib.contextmanager
def _cp_vision_group(group):
    """The framework's ``set_cp_vision_group`` / ``reset_cp_vision_group`` pair with the VLM recipe's default
    ``CpVisionFrameShardingConfig()`` (``distributed.multimodal.vision.frame_sharding``, disabled)."""
    from nemo_automodel.components.distributed.cp_vision_frame_shard import (
        CpVisionFrameShardingConfig,
        reset_cp_vision_group,
        set_cp_vision_group,
    )

    token = set_cp_vision_group(group, config=CpVisionFrameShardingConfig())
    try:
        yield
    finally:
        reset_cp_vision_group(token)


STEP = RecipeStep()
IGNORE_INDEX = -100  # the recipe's ignore index (MaskedCrossEntropy's, _get_loss_ignore_index)


def model_supports(model):
    """``model.supports`` as the recipe reads it (the framework's ``ModelSupports``; a model built by the spec, not
    through ``NeMoAutoModel``, has none attached, so one is made for it, mesh ``None``)."""
    from nemo_automodel._transformers.capabilities import ModelSupports

    supports = getattr(model, "supports", None)
    return supports if isinstance(supports, ModelSupports) else ModelSupports(model, None)


def forward_output(model, local: dict):
    """``out = model(**filter_forward_kwargs(model, batch))`` without the labels: the model's whole output (the
    spec's ``forward`` returns only ``out.logits``)."""
    from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

    kwargs = {k: v for k, v in local.items() if k != "labels" and not k.startswith("_spec")}
    return model(**filter_forward_kwargs(model, kwargs))


def mtp_loss(model, out, local: dict, labels: torch.Tensor, count: int, targets) -> torch.Tensor:
    """``_forward_backward_step``'s MTP term: ``calculate_mtp_loss(loss_fn, mtp_per_depth_h=...,
    mtp_per_depth_targets=targets, seq_idx=..., labels=labels, model=model, scaling_factor=
    out.mtp_loss_scaling_factor, num_label_tokens=count, ignore_index=-100, cu_seqlens=...)`` with the recipe's
    arguments: ``seq_idx`` is the batch's ``_packed_seq_ids`` only without per-depth targets (one device), and
    ``cu_seqlens`` is passed only without targets and without NEAT's ``packed_token_indices``. ``loss_fn`` the
    spec's ``MaskedCrossEntropy(reduction="sum")``: each depth's CE through the shared LM head, summed over depths,
    times ``scaling_factor / depths``. Raises, as the recipe does, when the model emits MTP outputs under CP
    without targets."""
    from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
    from nemo_automodel.components.loss.mtp import calculate_mtp_loss

    per_depth_h = getattr(out, "mtp_per_depth_h", None)
    per_depth_logits = getattr(out, "mtp_per_depth_logits", None)
    if per_depth_h is None and per_depth_logits is None:
        raise ValueError(f"training step loss='mtp': {type(model).__name__} returned no MTP outputs (train mode?)")
    from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

    # the recipe tests `"packed_token_indices" in batch` on the batch after filter_forward_kwargs
    filtered = filter_forward_kwargs(model, {k: v for k, v in local.items() if k != "labels"})
    return calculate_mtp_loss(
        MaskedCrossEntropy(ignore_index=IGNORE_INDEX, reduction="sum"),
        mtp_per_depth_h=per_depth_h,
        mtp_per_depth_logits=per_depth_logits,
        mtp_per_depth_targets=targets,
        seq_idx=local.get("_packed_seq_ids") if targets is None else None,
        labels=labels,
        model=model,
        scaling_factor=out.mtp_loss_scaling_factor,
        num_label_tokens=count,
        ignore_index=IGNORE_INDEX,
        cu_seqlens=None if targets is not None or "packed_token_indices" in filtered else filtered.get("cu_seqlens"),
    )


def one_device_mtp_step(spec, model, batch: dict, count: int, *, reverse: bool = False) -> dict[str, Any]:
    """The recipe's MTP step on one device (CP 1: no per-depth targets, ``calculate_mtp_loss`` shifts the labels
    itself and masks across documents with ``seq_idx = _packed_seq_ids``; the model rolls its own MTP inputs):
    ``{"logits" [B, S, V], "loss" [], "grads" {name: tensor}}`` like ``model_specs.step``, rows reversed with
    ``reverse`` (the spread; logits back in row order).

    One addition, finding T1 (docs/training_step.md): with a NEAT-packed batch the one-device forward raises in
    the MTP sublayer's MoE (``RuntimeError: The size of tensor a (38) must match the size of tensor b (722)``:
    ``Qwen3_5MoeForConditionalGeneration.forward`` hands the MTP head ``padding_mask=None`` with the 4-D
    block-causal mask, which ``qwen3_next.Block`` inverts whole as a padding mask). The batch therefore carries
    ``padding_mask`` = the mask's diagonal inverted, exactly what the decoder derives for itself
    (``Qwen3_5MoeTextModelBackend.forward``), so the main model is unchanged and the MTP head sees the same
    padding (``examples/automodel/repro/models/qwen3_5_moe_mtp_one_device.py``)."""
    rows = batch["input_ids"].shape[0]
    order = list(range(rows))[::-1] if reverse else list(range(rows))
    batch = {
        k: (v[order] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v) for k, v in batch.items()
    }
    model.zero_grad(set_to_none=True)
    ctx_factory, local, sharder = spec.shard(model, None, batch)
    mask = local.get("attention_mask")
    if "padding_mask" not in local and isinstance(mask, torch.Tensor) and mask.ndim == 4:
        local = {**local, "padding_mask": mask[:, 0].diagonal(dim1=-2, dim2=-1).bool().logical_not()}
    with ctx_factory():
        out = forward_output(model, local)
        labels = spec.local_labels(local) if hasattr(spec, "local_labels") else local["labels"]
        value = spec.loss(out.logits, labels, count) + mtp_loss(model, out, local, labels, count, None)
        value.backward()
    logits = spec.gather_logits(sharder, out.logits.detach())
    if reverse:
        logits = logits[[order.index(r) for r in range(rows)]]
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return {"logits": logits, "loss": value.detach().float().clone(), "grads": grads}


def parallelized(spec, dtype: torch.dtype, seed: int, context, **overrides) -> torch.nn.Module:
    """A fresh ``spec.build`` model through the framework's ``parallelize_model`` (FSDP2 over ``dp_shard_cp``)."""
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

    return parallelize_model(spec.build(dtype, seed, **overrides), context)
