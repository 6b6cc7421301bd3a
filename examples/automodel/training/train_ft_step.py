"""One training step of a model spec as nemo-automodel 0.7.0's ``recipes/llm/train_ft.py`` runs it at CP > 1, on
the framework's own mesh, parallelizer and clip-grad helper (the driver of ``cp_harness.checks.training_step``).

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

    def dp_rows(self, mesh, global_batch: dict, rows: int) -> dict:
        """This dp rank's rows of the global batch (the dataloader's shard: dp rank ``d`` holds rows
        ``d*rows .. (d+1)*rows-1``; every CP rank of a dp rank holds the same rows, the sharder splits them)."""
        d = self.flat(mesh, "dp").get_local_rank()
        n = global_batch["input_ids"].shape[0]
        return {
            k: (v[d * rows : (d + 1) * rows] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n else v)
            for k, v in global_batch.items()
        }

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

    def run(self, spec, model, context, global_batch: dict, rows: int, loss: str = "masked") -> dict[str, Any]:
        """One step: ``{"logits" [B_global, S, V], "loss" [], "grads" {name: full gradient}, "grad_norm" []}``,
        the same on every rank. ``model``: already through ``parallelize_model``; ``rows``: rows per dp rank;
        ``loss``: ``"masked"`` (the spec's loss, ``MaskedCrossEntropy``) or ``"linear_ce"`` (``linear_ce_forward``:
        no logits are materialised, so none come back)."""
        from nemo_automodel.components.distributed.utils import get_sync_ctx
        from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler
        from nemo_automodel.components.training.utils import (
            prepare_for_final_backward,
            prepare_for_grad_accumulation,
            scale_grads_and_clip_grad_norm,
        )
        from torch.distributed.tensor import DTensor

        mesh = context.device_mesh
        batch = self.dp_rows(mesh, global_batch, rows)
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
            ctx_factory, local, sharder = spec.shard(model, mesh["cp"], batch)
            with stand_in, ctx_factory(), get_sync_ctx(model, True, defer_fsdp_grad_sync=True):
                labels = spec.local_labels(local) if hasattr(spec, "local_labels") else local["labels"]
                if loss == "linear_ce":
                    logits = None
                    local_loss = self.linear_ce_forward(model, mesh, local, labels, count)
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


STEP = RecipeStep()


def parallelized(spec, dtype: torch.dtype, seed: int, context, **overrides) -> torch.nn.Module:
    """A fresh ``spec.build`` model through the framework's ``parallelize_model`` (FSDP2 over ``dp_shard_cp``)."""
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

    return parallelize_model(spec.build(dtype, seed, **overrides), context)
