"""Model spec: nemo-automodel 0.7.0's ``Qwen3_5MoeForConditionalGeneration`` at a tiny random config, CP the
framework's way: packed batches through the shared block-diagonal CP package (``distributed/blockdiag_cp``).

Same interface as ``_base`` (see that module's docstring); ``forward``, ``gather_logits``,
``local_labels``, ``loss`` and ``num_label_tokens`` are that module's. What differs is the model, how it enters
CP, and the batches. No ``pad_batch``/``cp_padded_length``: only packed batches are supported (``BATCH_KINDS``), and
the harness's padding re-run is for unpacked ones.

How the framework enters CP for this model (``recipes/llm/train_ft.py``; what ``shard`` does, in this order):

1. Parallelization. ``Qwen3_5MoeForConditionalGeneration`` (the class the registry gives a Qwen3.5-MoE checkpoint,
   through ``NeMoAutoModelForCausalLM`` too) has no parallelizer of its own; with expert parallelism (every CP
   example config of the framework for it has ``ep_size > 1``) the recipe reaches
   ``components/moe/parallelizer.parallelize_model``, whose CP step is ``apply_cp(model, cp_mesh)``: it sets
   ``model.cp_mesh`` (the forward then embeds the full sequence and keeps this rank's contiguous slice),
   ``_cp_enabled`` on the model and its text module, and ``cp_mesh`` on every MoE block (the router's
   load-balancing statistics are all-reduced over it). ``shard`` calls that same ``apply_cp``; the rest of
   ``parallelize_model`` (expert parallelism, activation checkpointing, FSDP2) is not applied: one CP group, no
   data parallelism. ``apply_cp`` imports Transformer Engine's ``DotProductAttention`` only to recognise TE
   attention modules; on a machine without TE the import is satisfied, for that one call, by an empty stand-in
   class that no module of this model is an instance of (its attention is ``attn="sdpa"``), then removed.
   Rank processes are reused across cases (and the one-device reference runs on the same model object), so
   ``shard`` first restores every module attribute to its value after ``build`` (what ``apply_cp`` set is removed).
2. ``ContextParallelSharder(model, mesh, batch)``: at CP > 1 the framework calls the model's
   ``prepare_model_inputs_for_cp``, which selects ``make_cp_blockdiag_batch_and_ctx(shard_primary=False)`` with
   ``contiguous_local_indices`` for packed batches (``_packed_seq_ids`` present) and the round-robin
   ``shard_batch_aux_only`` (torch's ring ``context_parallel``) otherwise. ``sharder.shard(batch)`` pads to
   ``2 x CP``, slices every sequence tensor but ``input_ids`` to this rank's contiguous chunk, drops the dense
   mask and the packed metadata, adds ``padding_mask``, and returns the context that publishes the per-step
   state (global document ids, this rank's row offset) and restricts SDPA to the efficient/math kernels.
3. Forward in that context: the model embeds the full ``input_ids``, keeps its chunk
   (``shard_sequence_for_cp_contiguous``), and every full-attention layer calls ``cp_blockdiag_sdpa``: one
   all-gather of the stacked local K and V over the CP group (``_AllGatherSeqDiff``, whose backward is a
   reduce-scatter), then stock SDPA of the local queries against all keys under the dense per-document causal
   mask rebuilt from the global document ids (``_cp_blockdiag_mask``). The default varlen kernel (``flash``) is
   asked first and reports itself unavailable on CPU (float32: "needs fp16/bf16"; bfloat16: "flash_attn is
   unavailable"), so this dense path is the one run; the needed-only exchanges (halo, a2a) need flash or TE and
   are not run.

One device (``mesh=None``): the identity sharder (the model's hook is not called at CP 1), every module attribute
as built; each full-attention layer reads the dense block-causal ``attention_mask`` ``[B, 1, S, S]`` of the
packed batch, the MoE its ``padding_mask`` from the mask's diagonal.

Batches (``make_batch``): ``"packed"`` is what the LLM recipe feeds this model with NEAT packing
(``packed_sequence.packing_strategy: neat``; the default ``thd`` strategy gives no ``_packed_seq_ids`` and does
not reach block-diagonal CP): one pack per row as ``datasets/llm/neat_packing.py`` builds it (documents
concatenated from column 0, labels shifted within each document with -100 on each document's last token, an
indexed mask 1, 2, ... with 0 on padding, positions restarting per document), collated by the framework's
``neat_packed_collater`` with this model's packing contract (``PACKING``: dense block-causal mask plus
packed-sequence metadata; ``build`` checks it against the framework's ``configure_packing_for_models``):
``input_ids``, ``labels``, ``position_ids`` ``[B, S]``, ``attention_mask`` ``[B, 1, S, S]`` bool,
``packed_token_indices`` ``[B, S]``, ``cu_seqlens`` ``[B, D + 1]``, ``max_seqlen`` (int), ``_packed_seq_ids``
``[B, S]``. Block-diagonal CP takes one packed row per rank: ``make_cp_blockdiag_batch_and_ctx`` raises for
``B > 1`` ("requires local_batch_size=1"), so rows > 1 are not supported. ``"plain"`` / ``"right_padded"`` rows
(``_base.make_batch``) take the round-robin path at CP > 1, whose torch ``context_parallel`` has no
sharding strategy for CPU SDPA (``aten._scaled_dot_product_flash_attention_for_cpu``): not in ``BATCH_KINDS``.

Tiny config (``TEXT``, ``VISION``): hidden 16, 2 decoder layers, both ``full_attention`` (the real model
interleaves Gated DeltaNet linear-attention layers, whose CP path needs the ``fla`` Triton kernels: not on CPU;
their convolution halo alone runs on CPU in ``tests/standins/test_fla_conv_cpu.py``, docs/models/qwen3_5_moe.md),
2 query heads and 1 K/V head of 8 (grouped-query attention: the CP path repeats K/V after the gather), gated
attention output, mRoPE over half the head (sections ``[1, 1, 0]``, interleaved), MoE on every layer with 4
routed experts (2 active) plus a gated shared expert, vocabulary 64; a one-block vision tower that text batches
never run. ``router_aux_loss_coef=0.001`` (the framework's default): the auxiliary loss's gradient
(``MoEAuxLossAutoScaler``, injected whatever the upstream gradient) is judged too; the harness's chunked
reference counts it once (``cp_harness.usage.model_specs.step``; before that it was added once per chunk and
widened the router gradients' spread to 6.6e6 ULP, docs/models/qwen3_5_moe.md). Backend ``BackendConfig(attn="sdpa",
linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")``. The LM head is in the model dtype
(bfloat16 logits in bfloat16).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from nemo_automodel.components.datasets.utils import neat_packed_collater
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.common.packing import PackingCapabilities, configure_packing_for_models
from nemo_automodel.components.models.qwen3_5_moe.model import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from examples.automodel.models import _base, model_owned_cp
from examples.automodel.models._base import *  # noqa: F403  (the shared half of the interface)
from examples.automodel.models._base import dtype_name

NAME = "qwen3_5_moe"
FRAMEWORK_CLASS = "nemo_automodel.components.models.qwen3_5_moe.model.Qwen3_5MoeForConditionalGeneration"

WORLD_SIZES: tuple[int, ...] = (1, 2, 3, 4)
BATCH_KINDS: tuple[str, ...] = ("packed",)
BATCH_ROWS: tuple[int, ...] = (1,)  # block-diagonal CP needs local_batch_size=1 (the framework raises otherwise)
# Framework CP callables this spec's CP path runs: each was seen running (a temporary counting wrapper around it
# during a CP step) at CP 2 in float32 and bfloat16 and at CP 3 in float32.
COVERS: dict[str, str] = {
    "nemo_automodel.components.moe.parallelizer.apply_cp": "the recipe's CP parallelization step: model.cp_mesh, _cp_enabled, the MoE blocks' cp_mesh",
    "nemo_automodel.components.models.qwen3_5_moe.model.Qwen3_5MoeForConditionalGeneration.prepare_model_inputs_for_cp": "the model's CP hook: selects the block-diagonal sharder for packed batches",
    "nemo_automodel.components.distributed.blockdiag_cp.batch.make_cp_blockdiag_batch_and_ctx": "pads to 2 x CP, slices every sequence tensor but input_ids contiguously, publishes the step state",
    "nemo_automodel.components.distributed.blockdiag_cp.kernels.precompute_blockdiag_varlen_meta": "this rank's varlen segmentation (computed; the varlen kernel is unavailable on CPU)",
    "nemo_automodel.components.distributed.context_parallel.sharder.shard_sequence_for_cp_contiguous": "in the forward: pads the embedded full sequence and keeps this rank's slice",
    **_base.COVERS_INDEX_MAP,
    "nemo_automodel.components.distributed.blockdiag_cp.runtime.cp_blockdiag_sdpa": "every full-attention layer: K/V exchange and per-document attention",
    "nemo_automodel.components.distributed.blockdiag_cp.kernels._cp_blockdiag_varlen": "asked first (attn_backend flash), reports itself unavailable on CPU",
    "nemo_automodel.components.distributed.blockdiag_cp.exchange._AllGatherSeqDiff": "one all-gather of stacked K and V per layer; backward a reduce-scatter",
    "nemo_automodel.components.distributed.blockdiag_cp.kernels._cp_blockdiag_mask": "the dense per-document causal mask of the local queries against all keys",
    **_base.COVERS_GATHER_BY_INDICES,
}

# The HF config field that turns the framework's MTP head on (``_resolve_mtp_num_layers`` reads
# ``num_nextn_predict_layers``, then ``mtp_num_hidden_layers``, Qwen3.5's own name): one depth, one full-attention
# MoE sublayer with the eh_proj fusion and final norm (``build_qwen3_5_moe_mtp``). The training-step MTP row
# (``loss: mtp``) builds the CP model and the one-device reference with it; every other row builds without.
MTP_OVERRIDES: dict[str, Any] = {"mtp_num_hidden_layers": 1}


def mtp_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """One MTP depth's global position ids ``[B, S]`` as the model's mRoPE axes ``[3, B, S]``
    (``_split_qwen3_5_moe_position_ids``, the framework's own expansion on its one-device MTP path); ``[3, B, S]``
    unchanged. The training-step MTP step's stand-in for finding T3 (``train_ft_step.MTP_STAND_INS``)."""
    from nemo_automodel.components.models.qwen3_5_moe.model import _split_qwen3_5_moe_position_ids

    if position_ids.dim() != 2:
        return position_ids
    rows, length = position_ids.shape
    return _split_qwen3_5_moe_position_ids(
        position_ids, batch_size=rows, seq_len=length, device=position_ids.device
    ).contiguous()


BACKEND = dict(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")

# fmt: off
TEXT: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, num_hidden_layers=2, layer_types=["full_attention", "full_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=8,
    shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.001,
    rms_norm_eps=1e-6, max_position_embeddings=4096, pad_token_id=0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
)
VISION: dict[str, Any] = dict(
    depth=1, hidden_size=8, intermediate_size=8, num_heads=1, out_hidden_size=16, patch_size=2,
    temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=4,
)
# fmt: on

BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": _base.BATCH_KEYS["required"],
    "optional": {
        "attention_mask": "[B, S] 1 real / 0 padding (unpacked); [B, 1, S, S] bool block-causal (packed; "
        "the one-device attention reads it, CP drops it)",
        "position_ids": "[B, S] int64, document-local when packed (the model repeats them over its 3 mRoPE axes)",
        "_packed_seq_ids": "[B, S] int64 1-based document ids, 0 padding (packed: selects block-diagonal CP, "
        "which builds its mask from them)",
        "packed_token_indices": "[B, S] int64 row-local token index, -1 padding (packed metadata)",
        "cu_seqlens": "[B, D + 1] int32 row-local document boundaries, -1 after the last (packed metadata)",
        "max_seqlen": "int, the longest document (packed metadata)",
    },
    "produced_by_sharder": {
        "padding_mask": "[B, S_local] bool, True on padding (block-diagonal CP)",
    },
}

# The packing contract the framework derives for this model (dense block-causal mask + packed-sequence metadata);
# ``build`` checks it against ``configure_packing_for_models``, the recipe's own derivation.
PACKING = PackingCapabilities(packed_mask_type="block_causal", requires_packed_sequence_metadata=True)


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> Qwen3_5MoeConfig:
    """The framework's (HF) config for the tiny model (``TEXT`` with ``overrides``) in ``dtype``."""
    return Qwen3_5MoeConfig(
        text_config=_base.tiny(TEXT, overrides),
        vision_config=copy.deepcopy(VISION),
        torch_dtype=dtype_name(NAME, dtype),
    )


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``Qwen3_5MoeForConditionalGeneration`` on CPU in train mode, seeded, parameters in ``dtype``; its packing
    contract checked and its module attributes saved (``parallelize`` restores them before each CP entry)."""
    model = _base.build_seeded(
        lambda: Qwen3_5MoeForConditionalGeneration(config(dtype, **overrides), backend=BackendConfig(**BACKEND)),
        dtype,
        seed,
    )
    contract = configure_packing_for_models([model])
    if contract != PACKING:
        raise RuntimeError(f"{NAME}: the framework's packing contract changed: {contract} (spec: {PACKING})")
    _PRISTINE[model] = _snapshot(model)
    return model


# ---- entering CP: the framework's apply_cp, undone before the next call --------------------------------------

_PRISTINE: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()
_TORCH_SLOTS = ("_parameters", "_buffers", "_modules", "training")


def _snapshot(model: torch.nn.Module) -> dict:
    return {module: {k: v for k, v in vars(module).items() if k not in _TORCH_SLOTS} for module in model.modules()}


def _restore(model: torch.nn.Module) -> None:
    """Every module attribute back to its value after ``build`` (what ``apply_cp`` set is removed)."""
    for module, saved in _PRISTINE[model].items():
        now = vars(module)
        for key in [k for k in now if k not in saved and k not in _TORCH_SLOTS]:
            del now[key]
        for key, value in saved.items():
            if now.get(key) is not value:
                now[key] = value


def parallelize(model: torch.nn.Module, mesh: Any) -> None:
    """The model as the recipe's parallelizer leaves it for CP on ``mesh`` (``apply_cp``), or as built (``None``)."""
    _restore(model)
    if model_owned_cp.cp_active(mesh):
        model_owned_cp.apply_moe_cp(model, mesh)


def shard(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """Enter CP the framework's way: ``apply_cp``, then ``ContextParallelSharder(model, mesh, batch)`` + ``shard``.

    Args:
        model: From ``build``.
        mesh: 1-D ``DeviceMesh`` named ``("cp",)`` or ``None`` (one device: the identity sharder).
        batch: Global batch (``make_batch``); not mutated.
    Returns:
        ``(ctx_factory, local_batch, sharder)``; ``local_batch`` holds ``labels``, ``position_ids``,
        ``padding_mask`` and ``_packed_seq_ids`` of this rank (``[B, S_local]``, positions ``[3, B, S_local]``)
        and the full ``input_ids`` ``[B, S]`` (the forward embeds them, then keeps its chunk).
    """
    batch = dict(batch)
    parallelize(model, mesh)
    sharder = ContextParallelSharder(model, mesh, batch, padding_token_id=padding_token_id)
    ctx_factory, local_batch = sharder.shard(batch)
    return ctx_factory, local_batch, sharder


def valid_positions(batch: dict[str, Any]) -> torch.Tensor:
    """Bool ``[B, S]``: real tokens (not padding), the positions whose logits are compared."""
    if batch.get("_packed_seq_ids") is not None:
        return batch["_packed_seq_ids"] > 0
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        return mask.bool()
    return torch.ones_like(batch["input_ids"], dtype=torch.bool)


def _neat_packed(tokens: torch.Tensor, documents: list[list[int]], pad_id: int) -> dict[str, Any]:
    """one pack per row as the LLM NEAT packer leaves it (datasets/llm/neat_packing.py ``_build_packed_sample``:
    documents concatenated, indexed mask 1, 2, ... (0 padding), positions restarting per document), collated by
    ``neat_packed_collater`` with this model's ``PACKING`` (see the module docstring for the keys)."""
    packs = []
    for row, lengths in enumerate(documents):
        input_ids, labels, doc_ids, positions = _base.document_layout(tokens[row], lengths, pad_id)
        packs.append({"input_ids": input_ids, "labels": labels, "attention_mask": doc_ids, "position_ids": positions})
    return neat_packed_collater(packs, packing=PACKING)


make_batch = _base.packed_kind(_neat_packed)
